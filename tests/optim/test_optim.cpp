// Optimizers (SGD, Adam, AdamW) against PyTorch 1.13 trajectories, flat parameter buffers, state_dict
// round trips, skipped parameters and option checking.
#include <catch2/catch.hpp>

#include <cmath>

#include "booster/autograd/autograd.h"
#include "booster/ops/ops.h"
#include "booster/optim/flat_buffer.h"
#include "booster/optim/optimizer.h"
#include "fixture.h"

using namespace booster;
using namespace booster::optim;
using nlohmann::json;

namespace {

// g = a * (p - t) in the parameter's dtype, the same float operations the fixture script does.
Tensor quadratic_grad(const Tensor& p, const Tensor& a, const Tensor& t) {
  Tensor g = Tensor::empty(p.shape(), p.dtype());
  BOOSTER_DISPATCH_FLOATING(p.dtype(), "quadratic_grad", [&] {
    const Tensor pc = p.detach().contiguous();
    const scalar_t* pp = pc.data<scalar_t>();
    const scalar_t* ap = a.data<scalar_t>();
    const scalar_t* tp = t.data<scalar_t>();
    scalar_t* gp = g.data<scalar_t>();
    for (int64_t i = 0; i < p.numel(); ++i) gp[i] = scalar_t(ap[i] * scalar_t(pp[i] - tp[i]));
  });
  return g;
}

struct Problem {
  std::vector<Tensor> params, scale, target;
};

Problem problem_from(const json& c) {
  Problem pr;
  for (int i = 0; i < 2; ++i) {
    const std::string k = "p" + std::to_string(i);
    pr.params.push_back(testing::tensor_from_json(c.at(k + ".init")).requires_grad_());
    pr.scale.push_back(testing::tensor_from_json(c.at(k + ".scale")));
    pr.target.push_back(testing::tensor_from_json(c.at(k + ".target")));
  }
  return pr;
}

// How a test hands gradients to the optimizer.
enum class GradMode {
  InPlace,  // zero_grad, then write into the flat gradient views (as AccumulateGrad does)
  Replace,  // set_grad(new tensor) or set_grad(undefined), as a user assigning p.grad
};

void give_grads(Optimizer& opt, Problem& pr, int step, int skip_step, GradMode mode) {
  if (mode == GradMode::InPlace) opt.zero_grad();
  for (size_t i = 0; i < pr.params.size(); ++i) {
    const bool skip = step == skip_step && i == 1;
    Tensor g = quadratic_grad(pr.params[i], pr.scale[i], pr.target[i]);
    if (mode == GradMode::InPlace) {
      if (!skip) pr.params[i].grad().copy_(g);
    } else {
      pr.params[i].set_grad(skip ? Tensor() : g);
    }
  }
}

json with_type(const json& c) {
  json cfg = c.at("options");
  cfg["type"] = c.at("type");
  return cfg;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) { return a.shape() == b.shape() && a.tolist() == b.tolist(); }

std::vector<double> values(const Tensor& t) { return t.tolist(); }

}  // namespace

TEST_CASE("SGD, Adam and AdamW follow PyTorch 1.13 trajectories", "[optim]") {
  const json fx = testing::load_fixture_json("optim.json");
  int cases = 0;
  for (auto it = fx.begin(); it != fx.end(); ++it) {
    if (it.key().rfind("scheduler.", 0) == 0) continue;
    const json& c = it.value();
    for (GradMode mode : {GradMode::InPlace, GradMode::Replace}) {
      Problem pr = problem_from(c);
      const bool f64 = pr.params[0].dtype() == DType::Float64;
      // Relative to the values' scale (about 1): torch's vectorized add_ uses fma, so float32 results
      // differ from ours by a rounding, which the cancellation in p - lr * d turns into larger
      // relative differences on values near zero.
      const double rtol = f64 ? 1e-12 : 1e-6, atol = rtol;
      auto opt = make_optimizer(with_type(c), pr.params);
      const int steps = c.at("steps").get<int>(), skip = c.at("skip_step").get<int>();
      for (int step = 1; step <= steps; ++step) {
        give_grads(*opt, pr, step, skip, mode);
        opt->step();
        for (size_t i = 0; i < 2; ++i) {
          const Tensor want = testing::tensor_from_json(c.at("p" + std::to_string(i) + ".step" + std::to_string(step)));
          INFO(it.key() << (mode == GradMode::InPlace ? " (in-place grads)" : " (replaced grads)") << " step " << step
                        << " param " << i << " max diff " << testing::max_abs_diff(pr.params[i], want));
          REQUIRE(testing::allclose(pr.params[i], want, rtol, atol));
        }
      }
      // The skipped step is not counted for parameter 1, as torch's per-parameter step.
      REQUIRE(opt->param_step(0) == steps);
      REQUIRE(opt->param_step(1) == steps - 1);
    }
    ++cases;
  }
  REQUIRE(cases == 22);
}

TEST_CASE("FlatBuffer repoints parameters, collects gradients and binds idempotently", "[optim]") {
  Tensor w = from_vector(std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, {3, 4}).requires_grad_();
  Tensor b = from_vector(std::vector<float>{-1, -2, -3, -4, -5}, {5}).requires_grad_();
  Tensor frozen = from_vector(std::vector<float>{7, 7}, {2});  // requires_grad false
  Tensor w_handle = w;                                           // as a module would hold it
  FlatBuffer flat({w, b, frozen});
  REQUIRE(flat.copied_values());
  REQUIRE(flat.numel() == 19);
  REQUIRE(flat.offsets() == std::vector<int64_t>{0, 12, 17, 19});
  // Values survive and every handle now reads the flat storage.
  REQUIRE(w_handle.storage() == flat.data().storage());
  REQUIRE(w_handle.tolist() == std::vector<double>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
  REQUIRE(flat.data_span<float>()[12] == -1.0f);
  REQUIRE(flat.data_span<float>()[17] == 7.0f);
  // Writing through the span is seen by the parameter.
  flat.data_span<float>()[0] = 100.0f;
  REQUIRE(w.tolist()[0] == 100.0);
  flat.data_span<float>()[0] = 1.0f;
  // Gradient views point into the flat gradient buffer; the frozen parameter gets none.
  REQUIRE(w.grad().storage() == flat.grad().storage());
  REQUIRE(b.grad().data_ptr() == static_cast<float*>(flat.grad().data_ptr()) + 12);
  REQUIRE_FALSE(frozen.grad().defined());
  REQUIRE(flat.sync_grads() == std::vector<char>{0, 0, 0});

  // Two backwards accumulate in place, in the flat buffer; b gets no gradient.
  Tensor c = from_vector(std::vector<float>{1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3}, {3, 4});
  for (int k = 0; k < 2; ++k) mul(w, c).backward(ones({3, 4}));
  auto gs = flat.grad_span<float>();
  REQUIRE(gs[0] == 2.0f);
  REQUIRE(gs[11] == 6.0f);
  REQUIRE(gs[12] == 0.0f);
  REQUIRE(w.grad().storage() == flat.grad().storage());
  REQUIRE(flat.sync_grads() == std::vector<char>{1, 0, 0});

  // A parameter whose gradient was replaced gets it copied into the buffer.
  b.set_grad(from_vector(std::vector<float>{1, 2, 3, 4, 5}, {5}));
  REQUIRE(flat.sync_grads() == std::vector<char>{1, 1, 0});
  REQUIRE(gs[16] == 5.0f);
  REQUIRE(b.grad().storage() == flat.grad().storage());

  // zero_grad is one memset and resets arrival.
  flat.zero_grad();
  for (float v : flat.grad_span<float>()) REQUIRE(v == 0.0f);
  REQUIRE(flat.sync_grads() == std::vector<char>{0, 0, 0});
  REQUIRE(w.grad().storage() == flat.grad().storage());

  // Binding the same parameters again copies nothing.
  void* data_before = flat.data().data_ptr();
  void* grad_before = flat.grad().data_ptr();
  FlatBuffer again({w, b, frozen});
  REQUIRE_FALSE(again.copied_values());
  REQUIRE(again.data().data_ptr() == data_before);
  REQUIRE(again.grad().data_ptr() == grad_before);
  // A subset that is still adjacent and in order is reused too.
  FlatBuffer tail({b, frozen});
  REQUIRE_FALSE(tail.copied_values());
  REQUIRE(tail.data().data_ptr() == static_cast<float*>(data_before) + 12);
  flat.check_bound("test");
  // A different order must copy, which moves the parameters out of the first buffer.
  FlatBuffer reordered({b, w});
  REQUIRE(reordered.copied_values());
  REQUIRE(w.tolist()[11] == 12.0);
  REQUIRE_THROWS_AS(flat.check_bound("test"), StateError);
}

TEST_CASE("FlatBuffer rejects mixed dtypes, duplicates and empty lists", "[optim]") {
  Tensor a = zeros({2}), d = zeros({2}, DType::Float64), i = zeros({2}, DType::Int64);
  REQUIRE_THROWS_AS(FlatBuffer({a, d}), DTypeError);
  REQUIRE_THROWS_AS(FlatBuffer({i}), DTypeError);
  REQUIRE_THROWS_WITH(FlatBuffer({a, a}), Catch::Contains("twice"));
  REQUIRE_THROWS_AS(FlatBuffer(std::vector<Tensor>{}), ValueError);
}

TEST_CASE("optimizers step the flat buffer: gradients from backward reach the update", "[optim]") {
  Tensor w = from_vector(std::vector<float>{1, 2, 3}, {3}).requires_grad_();
  SGD opt({w}, SGDOptions{.lr = 0.5});
  opt.zero_grad();
  mul(w, w).backward(ones({3}));  // grad 2w
  opt.step();
  REQUIRE(w.tolist() == std::vector<double>{0, 0, 0});  // w - 0.5 * 2w
  REQUIRE(w.version() > 0);                              // in-place update is visible to caches
}

TEST_CASE("a parameter without a gradient is not updated (Adam with weight decay)", "[optim]") {
  Tensor used = from_vector(std::vector<float>{1, -2, 3}, {3}).requires_grad_();
  Tensor unused = from_vector(std::vector<float>{0.5f, 1.5f}, {2}).requires_grad_();
  const std::vector<double> unused_before = unused.tolist();
  Adam opt({used, unused}, AdamOptions{.lr = 0.1, .weight_decay = 0.1});
  Tensor c = from_vector(std::vector<float>{1, 2, 3}, {3});
  for (int k = 0; k < 3; ++k) {
    opt.zero_grad();
    mul(used, c).backward(ones({3}));
    opt.step();
  }
  REQUIRE(unused.tolist() == unused_before);  // zeros + weight decay would have moved it
  REQUIRE(used.tolist() != std::vector<double>{1, -2, 3});
  REQUIRE(opt.param_step(0) == 3);
  REQUIRE(opt.param_step(1) == 0);
  // Its state does not exist yet, as in torch.
  const OptimizerState st = opt.state_dict();
  REQUIRE(st.tensors.count("state.0.exp_avg") == 1);
  REQUIRE(st.tensors.count("state.1.exp_avg") == 0);
  REQUIRE_FALSE(st.meta.at("state").contains("1"));
  // Once it gets a gradient, its own step count starts at 1 (torch's bias correction per parameter).
  opt.zero_grad();
  mul(unused, unused).backward(ones({2}));
  opt.step();
  REQUIRE(opt.param_step(1) == 1);
  REQUIRE(opt.param_step(0) == 3);  // got no gradient this time
  // First Adam step moves each element by lr * sign(g) (up to eps), whatever weight decay adds.
  REQUIRE(unused.tolist()[0] == Approx(0.5 - 0.1).epsilon(1e-5));
}

TEST_CASE("state_dict round trip resumes bitwise", "[optim]") {
  const json fx = testing::load_fixture_json("optim.json");
  for (const char* name : {"sgd_nesterov.float32", "sgd_dampening.float64", "adam_amsgrad_weight_decay.float32",
                           "adamw_amsgrad.float64", "adam.float32"}) {
    const json& c = fx.at(name);
    INFO(name);
    const int skip = c.at("skip_step").get<int>();
    Problem straight = problem_from(c);
    auto opt = make_optimizer(with_type(c), straight.params);
    for (int step = 1; step <= 10; ++step) {
      give_grads(*opt, straight, step, skip, GradMode::InPlace);
      opt->step();
    }

    Problem first = problem_from(c);
    auto opt1 = make_optimizer(with_type(c), first.params);
    for (int step = 1; step <= 5; ++step) {
      give_grads(*opt1, first, step, skip, GradMode::InPlace);
      opt1->step();
    }
    const OptimizerState saved = opt1->state_dict();
    Problem second = problem_from(c);
    for (size_t i = 0; i < 2; ++i) {
      NoGradGuard ng;
      second.params[i].copy_(first.params[i]);
    }
    // The fresh optimizer is built with other hyperparameters; loading restores the saved ones.
    json other = with_type(c);
    other["lr"] = 123.0;
    auto opt2 = make_optimizer(other, second.params);
    opt2->load_state_dict(saved);
    REQUIRE(opt2->lr() == c.at("options").at("lr").get<double>());
    for (int step = 6; step <= 10; ++step) {
      give_grads(*opt2, second, step, skip, GradMode::InPlace);
      opt2->step();
    }
    for (size_t i = 0; i < 2; ++i) REQUIRE(bitwise_equal(second.params[i], straight.params[i]));
    REQUIRE(opt2->param_step(1) == 9);
  }
}

TEST_CASE("state_dict layout follows torch", "[optim]") {
  Tensor a = ones({2, 3}).requires_grad_(), b = ones({4}).requires_grad_(), c = ones({1}).requires_grad_();
  AdamW opt({ParamGroup{{a, b}, {{"lr", 0.1}}}, ParamGroup{{c}, {{"amsgrad", true}}}}, json{{"lr", 0.01}});
  a.grad().fill_(1.0);
  b.grad().fill_(1.0);
  c.grad().fill_(1.0);
  opt.step();
  const OptimizerState st = opt.state_dict();
  REQUIRE(st.meta.at("type") == "AdamW");
  REQUIRE(st.meta.at("param_groups").size() == 2);
  REQUIRE(st.meta.at("param_groups")[0].at("params") == json{0, 1});
  REQUIRE(st.meta.at("param_groups")[1].at("params") == json{2});
  REQUIRE(st.meta.at("param_groups")[0].at("lr") == 0.1);
  REQUIRE(st.meta.at("param_groups")[1].at("lr") == 0.01);
  REQUIRE(st.meta.at("param_groups")[1].at("weight_decay") == 0.01);  // AdamW's default
  REQUIRE(st.meta.at("state").at("2").at("step") == 1);
  REQUIRE(st.tensors.at("state.0.exp_avg").shape() == Shape{2, 3});
  REQUIRE(st.tensors.at("state.1.exp_avg_sq").shape() == Shape{4});
  REQUIRE(st.tensors.at("state.2.max_exp_avg_sq").shape() == Shape{1});
  REQUIRE(st.tensors.count("state.0.max_exp_avg_sq") == 0);
  REQUIRE(st.tensors.size() == 7);
  // exp_avg after one step is (1 - beta1) * g.
  REQUIRE(st.tensors.at("state.1.exp_avg").tolist()[3] == Approx(0.1));
}

TEST_CASE("load_state_dict rejects states that do not fit, naming the mismatch", "[optim]") {
  Tensor a = ones({2, 3}).requires_grad_(), b = ones({4}).requires_grad_();
  Adam opt({a, b});
  a.grad().fill_(1.0);
  b.grad().fill_(1.0);
  opt.step();
  const OptimizerState good = opt.state_dict();

  Tensor a2 = ones({2, 3}).requires_grad_(), b2 = ones({4}).requires_grad_();
  Adam fresh({a2, b2});
  OptimizerState bad_shape = good;
  bad_shape.tensors["state.1.exp_avg"] = zeros({5});
  REQUIRE_THROWS_WITH(fresh.load_state_dict(bad_shape),
                      Catch::Contains("state.1.exp_avg") && Catch::Contains("[5]") && Catch::Contains("[4]"));
  OptimizerState missing = good;
  missing.tensors.erase("state.0.exp_avg_sq");
  REQUIRE_THROWS_WITH(fresh.load_state_dict(missing), Catch::Contains("missing 'state.0.exp_avg_sq'"));
  OptimizerState unknown = good;
  unknown.tensors["state.0.momentum_buffer"] = zeros({2, 3});
  REQUIRE_THROWS_AS(fresh.load_state_dict(unknown), CheckpointError);
  OptimizerState out_of_range = good;
  out_of_range.tensors["state.7.exp_avg"] = zeros({4});
  REQUIRE_THROWS_WITH(fresh.load_state_dict(out_of_range), Catch::Contains("parameter 7"));
  // Nothing was applied by the failed loads.
  REQUIRE(fresh.param_step(0) == 0);

  Tensor c = ones({4}).requires_grad_();
  Adam one_param({c});
  REQUIRE_THROWS_WITH(one_param.load_state_dict(good), Catch::Contains("2 parameters in the saved state but 1"));
  Tensor d = ones({4}).requires_grad_(), e = ones({4}).requires_grad_();
  Adam two_groups({ParamGroup{{d}, {}}, ParamGroup{{e}, {}}}, json::object());
  REQUIRE_THROWS_WITH(two_groups.load_state_dict(good), Catch::Contains("number of parameter groups"));
  Tensor f = ones({2, 3}).requires_grad_(), g = ones({4}).requires_grad_();
  SGD sgd({f, g}, SGDOptions{.lr = 0.1});
  REQUIRE_THROWS_WITH(sgd.load_state_dict(good), Catch::Contains("saved by \"Adam\""));
}

TEST_CASE("bad optimizer options throw with torch's messages", "[optim]") {
  auto p = [] { return std::vector<Tensor>{ones({2}).requires_grad_()}; };
  REQUIRE_THROWS_WITH(SGD(p(), SGDOptions{.lr = -1.0}), "Invalid learning rate: -1");
  REQUIRE_THROWS_WITH(SGD(p(), SGDOptions{.lr = 0.1, .momentum = -0.5}), "Invalid momentum value: -0.5");
  REQUIRE_THROWS_AS(SGD(p(), SGDOptions{.lr = 0.1, .weight_decay = -1}), ValueError);
  REQUIRE_THROWS_WITH(SGD(p(), SGDOptions{.lr = 0.1, .nesterov = true}),
                      Catch::StartsWith("Nesterov momentum requires a momentum and zero dampening"));
  REQUIRE_THROWS_AS(SGD(p(), SGDOptions{.lr = 0.1, .momentum = 0.9, .dampening = 0.1, .nesterov = true}),
                    ValueError);
  REQUIRE_THROWS_WITH(SGD(p(), SGDOptions{}), Catch::Contains("required optimization parameter lr"));
  REQUIRE_THROWS_WITH(Adam(p(), AdamOptions{.betas = {1.0, 0.9}}), "Invalid beta parameter at index 0: 1");
  REQUIRE_THROWS_WITH(Adam(p(), AdamOptions{.betas = {0.9, -0.1}}), "Invalid beta parameter at index 1: -0.1");
  REQUIRE_THROWS_WITH(Adam(p(), AdamOptions{.eps = -1e-8}), "Invalid epsilon value: -1e-08");
  REQUIRE_THROWS_WITH(AdamW(p(), json{{"weight_decay", -0.1}}), "Invalid weight_decay value: -0.1");
  REQUIRE_THROWS_WITH(make_optimizer(json{{"type", "adamw"}, {"lr", 0.1}, {"momentum", 0.9}}, p()),
                      Catch::Contains("unknown option 'momentum'") && Catch::Contains("amsgrad, betas, eps, lr"));
  REQUIRE_THROWS_AS(make_optimizer(json{{"type", "adam"}, {"betas", 0.9}}, p()), ConfigError);
  REQUIRE_THROWS_AS(make_optimizer(json{{"type", "sgd"}, {"lr", "0.1"}}, p()), ConfigError);
  REQUIRE_THROWS_WITH(make_optimizer(json{{"type", "rmsprop"}}, p()),
                      Catch::Contains("'rmsprop'") && Catch::Contains("sgd, adam, adamw"));
  REQUIRE_THROWS_WITH(make_optimizer(json{{"lr", 0.1}}, p()), Catch::Contains("missing \"type\""));
  REQUIRE_THROWS_WITH(Adam(std::vector<Tensor>{}), Catch::Contains("empty parameter list"));
  Tensor q = ones({2}).requires_grad_();
  REQUIRE_THROWS_WITH(Adam({q, q}), Catch::Contains("more than once"));
  Tensor nonleaf = mul(q, 2.0);
  REQUIRE_THROWS_WITH(Adam({nonleaf}), Catch::Contains("non-leaf"));
  Adam ok(p());
  REQUIRE_THROWS_AS(ok.set_lr(-0.5), ValueError);
  REQUIRE_THROWS_WITH(ok.add_param_group(ParamGroup{{ones({1}).requires_grad_()}, {{"lr", -2.0}}}),
                      "Invalid learning rate: -2");
}

TEST_CASE("factory, defaults, groups with their own options, set_lr", "[optim]") {
  Tensor a = ones({3}).requires_grad_();
  auto adamw = make_optimizer(json{{"type", "AdamW"}, {"lr", 0.01}}, {a});
  REQUIRE(adamw->name() == "AdamW");
  REQUIRE(adamw->defaults().at("weight_decay") == 0.01);
  REQUIRE(adamw->param_groups()[0].options.at("betas") == json{0.9, 0.999});
  Tensor a2 = ones({3}).requires_grad_(), a3 = ones({3}).requires_grad_();
  REQUIRE(AdamW({a2}, AdamOptions{.lr = 0.1}).defaults().at("weight_decay") == 0.01);  // torch's defaults
  REQUIRE(Adam({a3}, AdamOptions{.lr = 0.1}).defaults().at("weight_decay") == 0.0);

  // Two groups, two dtypes in the second: each group steps with its own lr.
  Tensor w = from_vector(std::vector<float>{1, 2}, {2}).requires_grad_();
  Tensor x = from_vector(std::vector<double>{1, 2}, {2}).requires_grad_();
  Tensor y = from_vector(std::vector<float>{4}, {1}).requires_grad_();
  SGD sgd({ParamGroup{{w}, {}}, ParamGroup{{x, y}, {{"lr", 0.01}}}}, json{{"lr", 0.1}});
  REQUIRE(sgd.flat_buffers(1).size() == 2);
  REQUIRE(sgd.lr(0) == 0.1);
  REQUIRE(sgd.lr(1) == 0.01);
  for (Tensor t : {w, x, y}) t.grad().fill_(1.0);
  sgd.step();
  REQUIRE(w.tolist() == std::vector<double>{1 - 0.1f, 2 - 0.1f});
  REQUIRE(x.tolist() == std::vector<double>{1 - 0.01, 2 - 0.01});
  REQUIRE(y.tolist()[0] == Approx(4 - 0.01));
  sgd.set_lr(0.5);
  REQUIRE(sgd.lr(1) == 0.5);
  REQUIRE_THROWS_AS(sgd.lr(2), IndexError);
}

TEST_CASE("float16 and bfloat16 parameters update in float32 and round", "[optim]") {
  // Reference: torch's AdamW written out here in double, stepped from the 16-bit parameter's actual
  // value each step (with g = p) and state carried in double. The library computes the step in
  // float32 and rounds the new value once to the 16-bit dtype: round to nearest is within u (2^-11
  // float16, 2^-8 bfloat16) of the exact value, relative, and the float32 arithmetic before it adds a
  // few float32 roundoffs (2^-24) of the step, so each step is held to u |p| + 2^-20 |step|. That is
  // well under a step (lr = 0.05 moves 0.5 by 10% and 2.0 by 2.5%, several ulps of both dtypes), so a
  // step rounded wrongly, skipped, or applied twice fails at once.
  const std::vector<float> init{0.5f, -1.25f, 2.0f, 0.125f};
  const double lr = 0.05, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  for (auto [dt, u] : {std::pair{DType::Float16, 0x1p-11}, std::pair{DType::BFloat16, 0x1p-8}}) {
    INFO(dtype_name(dt));
    Tensor lo = from_vector(init, {4}, dt).requires_grad_();
    AdamW a({lo}, json{{"lr", lr}});
    std::vector<double> m(4, 0.0), v(4, 0.0);
    for (int k = 1; k <= 5; ++k) {
      const std::vector<double> p = lo.tolist();
      {
        NoGradGuard ng;
        lo.grad().copy_(lo);  // g = p
      }
      a.step();
      const std::vector<double> got = lo.tolist();
      for (size_t i = 0; i < 4; ++i) {
        const double g = p[i];
        m[i] = beta1 * m[i] + (1 - beta1) * g;
        v[i] = beta2 * v[i] + (1 - beta2) * g * g;
        const double m_hat = m[i] / (1 - std::pow(beta1, k)), v_hat = v[i] / (1 - std::pow(beta2, k));
        const double decayed = p[i] * (1 - lr * weight_decay);
        const double step = lr * m_hat / (std::sqrt(v_hat) + eps);
        const double want = decayed - step;
        INFO("step " << k << ", element " << i << ": " << p[i] << " -> " << got[i] << ", exact " << want);
        CHECK(std::abs(got[i] - want) <= u * std::abs(want) + 0x1p-20 * std::abs(step));
        CHECK(got[i] != p[i]);  // every step moves every element by more than its rounding
      }
    }
    REQUIRE(lo.dtype() == dt);
    // State stays in float32.
    REQUIRE(a.state_dict().tensors.at("state.0.exp_avg").dtype() == DType::Float32);
  }
}

TEST_CASE("a large group split over threads equals the same update on small pieces", "[optim]") {
  // One 200k-element parameter crosses the parallel grain; 200 small ones do not. Any chunking or
  // offset bug in the parallel path shows up as a bitwise difference.
  Generator gen(7);
  Tensor big_init = randn({200000}, &gen), grads = randn({200000}, &gen);
  Tensor big = big_init.clone().requires_grad_();
  std::vector<Tensor> pieces;
  for (int k = 0; k < 200; ++k) pieces.push_back(big_init.narrow(0, k * 1000, 1000).clone().requires_grad_());
  AdamW one({big}, json{{"lr", 0.01}, {"amsgrad", true}});
  AdamW many(pieces, json{{"lr", 0.01}, {"amsgrad", true}});
  for (int step = 0; step < 3; ++step) {
    NoGradGuard ng;
    big.grad().copy_(grads);
    for (int k = 0; k < 200; ++k) pieces[size_t(k)].grad().copy_(grads.narrow(0, k * 1000, 1000));
    one.step();
    many.step();
  }
  REQUIRE(values(big) == values(many.flat_buffers(0)[0]->data()));
}

TEST_CASE("stepping parameters that left the flat buffer is a StateError", "[optim]") {
  Tensor w = ones({3}).requires_grad_(), b = ones({2}).requires_grad_();
  SGD opt({w, b}, SGDOptions{.lr = 0.1});
  w.grad().fill_(1.0);
  opt.step();
  FlatBuffer elsewhere({b, w});  // another order: copies and repoints both parameters
  REQUIRE_THROWS_WITH(opt.step(), Catch::Contains("no longer lives in the optimizer's flat buffer"));
  SGD other({ones({1}).requires_grad_()}, SGDOptions{.lr = 0.1});
  other.param_groups().push_back(ParamGroup{{ones({1}).requires_grad_()}, {{"lr", 0.1}}});
  REQUIRE_THROWS_WITH(other.step(), Catch::Contains("add_param_group"));
}

TEST_CASE("SGD makes its momentum buffer on the first step that uses momentum", "[optim]") {
  // torch: a step with momentum 0 leaves momentum_buffer None; the first step with momentum copies d.
  Tensor w = from_vector(std::vector<double>{1.0}, {1}).requires_grad_();
  SGD opt({w}, json{{"lr", 0.1}});
  w.grad().fill_(1.0);
  opt.step();  // plain: 0.9
  REQUIRE(opt.state_dict().tensors.empty());
  opt.param_groups()[0].options["momentum"] = 0.5;
  opt.param_groups()[0].options["dampening"] = 0.5;
  opt.step();  // buf = 1 (not (1 - dampening) * 1): 0.8
  REQUIRE(w.tolist()[0] == Approx(0.8).epsilon(1e-15));
  opt.step();  // buf = 0.5 * 1 + 0.5 * 1 = 1: 0.7
  REQUIRE(w.tolist()[0] == Approx(0.7).epsilon(1e-15));
  REQUIRE(opt.state_dict().tensors.at("state.0.momentum_buffer").tolist()[0] == 1.0);
}
