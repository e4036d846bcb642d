// Mixed precision: the registry and options, the fused gradient passes, GradScaler (torch 1.13 rules),
// DynamicGradScaler (Megatron's hysteresis), and every strategy end to end on the CPU, where float16
// and bfloat16 round, underflow and overflow exactly as on a GPU.
//
// Reference for the scaler trajectories: torch 1.13's CPU build has no kernel for _amp_update_scale_
// (torch.cuda.amp.GradScaler disables itself without CUDA, and calling the op on CPU tensors raises
// "Could not run 'aten::_amp_update_scale_' with arguments from the 'CPU' backend"), so no fixture can
// be recorded here. The expected sequences below are written out by hand from the rules of
// torch/cuda/amp/grad_scaler.py and aten's _amp_update_scale_cuda_kernel (and, for hysteresis, from
// Megatron-LM's DynamicGradScaler.update), independently of the code under test.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "booster/autograd/autograd.h"
#include "booster/booster/booster.h"
#include "booster/data/synthetic.h"
#include "booster/mixed_precision/mixed_precision.h"
#include "booster/nn/activation.h"
#include "booster/nn/container.h"
#include "booster/nn/linear.h"
#include "booster/nn/normalization.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/random.h"
#include "booster/mixed_precision/dynamic_grad_scaler.h"
#include "booster/mixed_precision/grad_scaler.h"

using namespace booster;
using namespace booster::mixed_precision;
using Catch::Matchers::Contains;
using json = nlohmann::json;

namespace {

const float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

// Bitwise copies of every tensor (values and optimizer state) for "left untouched" checks.
std::vector<std::vector<uint8_t>> snapshot(const std::vector<Tensor>& ts) {
  std::vector<std::vector<uint8_t>> out;
  for (const Tensor& t : ts) {
    Tensor c = t.contiguous();
    const auto* p = static_cast<const uint8_t*>(c.data_ptr());
    out.emplace_back(p, p + c.nbytes());
  }
  return out;
}

std::vector<Tensor> state_tensors(const optim::Optimizer& opt) {
  std::vector<Tensor> out;
  for (const auto& [k, t] : opt.state_dict().tensors) out.push_back(t);
  return out;
}

Criterion cross_entropy_criterion() {
  return [](const Tensor& out, const Tensor& y) { return cross_entropy(out, y); };
}

struct Setup {
  std::unique_ptr<MixedPrecision> mp;
  Configured c;
};

// An MLP classifier with an optimizer over its float32 parameters, configured by `strategy`.
Setup make_setup(const std::string& strategy, const json& options, uint64_t seed, int64_t features = 16,
                 int64_t classes = 4, const json& opt_cfg = {{"type", "adam"}, {"lr", 3e-3}}) {
  auto model = std::make_shared<nn::MLPClassifier>(features, std::vector<int64_t>{32}, classes, "relu", seed);
  std::shared_ptr<optim::Optimizer> opt = optim::make_optimizer(opt_cfg, model->parameters());
  Setup s;
  s.mp = create(strategy, options);
  s.c = s.mp->configure(model, opt, cross_entropy_criterion());
  return s;
}

// One step on rows [begin, begin + batch) of (x, y). Returns the loss.
double train_step(Setup& s, const Tensor& x, const Tensor& y, int64_t begin, int64_t batch,
                  double clip = 0.0) {
  s.c.optimizer->zero_grad();
  Tensor loss = s.c.criterion((*s.c.model)(x.narrow(0, begin, batch)), y.narrow(0, begin, batch));
  s.mp->backward(loss, *s.c.optimizer);
  if (clip > 0) s.mp->clip_grad_norm(*s.c.optimizer, clip);
  s.mp->step(*s.c.optimizer);
  return loss.item();
}

double accuracy(Setup& s, const Tensor& x, const Tensor& y) {
  NoGradGuard no_grad;
  s.c.model->eval();
  Tensor pred = argmax((*s.c.model)(x), 1);
  s.c.model->train();
  const auto p = pred.to_vector<int64_t>(), t = y.to_vector<int64_t>();
  int64_t right = 0;
  for (size_t i = 0; i < p.size(); ++i) right += p[i] == t[i];
  return double(right) / double(p.size());
}

// Writes `value` into the first element of the first parameter's gradient (a forced overflow).
void poison_first_grad(const Configured& c, float value) {
  Tensor g = c.model->parameters().front().grad();
  REQUIRE(g.defined());
  switch (g.dtype()) {
    case DType::Float32: g.data<float>()[0] = value; break;
    case DType::Float16: g.data<Half>()[0] = Half(value); break;
    case DType::BFloat16: g.data<BFloat16>()[0] = BFloat16(value); break;
    default: FAIL("unexpected gradient dtype");
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------- registry

TEST_CASE("registry: every strategy is registered, unknown names and options are ConfigErrors", "[amp]") {
  const auto names = registered_strategies();
  for (const char* n : {"fp32", "no", "fp16", "bf16", "fp16_naive", "fp16_apex", "fp8"})
    CHECK(std::find(names.begin(), names.end(), n) != names.end());

  REQUIRE_THROWS_AS(create("fp4"), ConfigError);
  REQUIRE_THROWS_WITH(create("fp4"), Contains("unknown strategy 'fp4'") && Contains("fp16_naive") &&
                                         Contains("bf16") && Contains("fp8"));

  REQUIRE_THROWS_AS(create("fp16", {{"init_scal", 1024}}), ConfigError);
  REQUIRE_THROWS_WITH(create("fp16", {{"init_scal", 1024}}),
                      Contains("unknown option 'init_scal'") && Contains("init_scale") && Contains("growth_interval"));
  REQUIRE_THROWS_WITH(create("fp32", {{"scale", 1}}), Contains("unknown option 'scale'"));
  REQUIRE_THROWS_WITH(create("bf16", {{"pure", 1}}), Contains("'pure' must be true or false"));
  REQUIRE_THROWS_WITH(create("fp16", {{"backoff_factor", 1.5}}), Contains("'backoff_factor'") && Contains("out of range"));
  REQUIRE_THROWS_WITH(create("fp16", {{"growth_factor", 1.0}}), Contains("'growth_factor'") && Contains("> 1"));
  REQUIRE_THROWS_WITH(create("fp16", {{"growth_interval", 0}}), Contains("'growth_interval'"));
  REQUIRE_THROWS_WITH(create("fp16_naive", {{"hysteresis", 0}}), Contains("'hysteresis'"));
  REQUIRE_THROWS_WITH(create("fp16_naive", {{"min_scale", 4.0}, {"initial_scale", 2.0}}),
                      Contains("min_scale") && Contains("initial_scale"));
  REQUIRE_THROWS_WITH(create("fp16_naive", {{"max_scale", 8.0}, {"initial_scale", 16.0}}), Contains("max_scale"));
  REQUIRE_THROWS_AS(create("fp16", json::array()), ConfigError);

  CHECK(create("fp16")->options() == json{{"init_scale", 65536.0}, {"growth_factor", 2.0}, {"backoff_factor", 0.5},
                                          {"growth_interval", 2000}, {"enabled", true},
                                          {"min_scale", std::ldexp(1.0, -24)}});
  const json naive = create("fp16_naive")->options();
  CHECK(naive.at("initial_scale") == 65536.0);
  CHECK(naive.at("min_scale") == 1.0);
  CHECK(naive.at("growth_interval") == 1000);
  CHECK(naive.at("hysteresis") == 2);
  CHECK(naive.at("max_scale") == 4294967296.0);
  CHECK(create("no")->name() == "no");
}

// --------------------------------------------------------------------------------- fused grad passes

TEST_CASE("fused unscale and inf/NaN check: one pass over float32, float16 and bfloat16 spans", "[amp]") {
  // Large enough to run on several threads, with the bad value in different chunks and in the tail.
  const int64_t n = 3 * 32768 + 7;  // several threads' chunks (cpu::kParallelGrain)
  for (DType dt : {DType::Float32, DType::Float16, DType::BFloat16}) {
    for (int64_t bad_at : {int64_t(-1), int64_t(0), n / 2, n - 1}) {
      for (float bad : {kInf, -kInf, kNaN}) {
        Tensor src = full({n}, 4.0, dt);
        if (bad_at >= 0) src.narrow(0, bad_at, 1).fill_(bad);
        Tensor dst = zeros({n}, DType::Float32);
        const bool found = fused_unscale_and_check({{src, dst}}, 0.25f);
        CHECK(found == (bad_at >= 0));
        CHECK(dst.narrow(0, 1, 1).item() == 1.0);  // 4 * 0.25
        // The check alone (inv_scale 1, in place; the tracer's check) reads 16-bit exponent bits.
        CHECK(fused_unscale_and_check({{src, src}}, 1.0f) == (bad_at >= 0));
        if (bad_at < 0) break;
      }
    }
    // Every element of every thread's chunk, the tail included, against a serial loop: integer
    // gradients times a power of two are exact in every dtype, so the comparison is exact.
    std::vector<double> values(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) values[size_t(i)] = double((i * 37) % 61 - 30);
    Tensor src = from_vector(values, {n}, dt);
    Tensor dst = zeros({n}, DType::Float32);
    CHECK_FALSE(fused_unscale_and_check({{src, dst}}, 0.25f));
    std::vector<double> want(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) want[size_t(i)] = values[size_t(i)] * 0.25;
    CHECK(dst.tolist() == want);
    CHECK_FALSE(fused_unscale_and_check({{src, src}}, 0.25f));  // in place
    CHECK(src.tolist() == want);
    // In place, several spans: found_inf from the second span only.
    Tensor a = full({100}, 8.0, dt), b = full({50}, 2.0, dt);
    CHECK_FALSE(fused_unscale_and_check({{a, a}, {b, b}}, 0.5f));
    CHECK(a.narrow(0, 99, 1).item() == 4.0);
    CHECK(b.narrow(0, 0, 1).item() == 1.0);
    b.narrow(0, 49, 1).fill_(kInf);
    CHECK(fused_unscale_and_check({{a, a}, {b, b}}, 1.0f));
    CHECK(a.narrow(0, 0, 1).item() == 4.0);  // inv_scale 1 leaves values alone
  }
  // The formats' largest values are finite: no false positive from the exponent test.
  Tensor h = full({8}, 65504.0, DType::Float16);
  CHECK_FALSE(fused_unscale_and_check({{h, h}}, 1.0f));
  Tensor bf = full({8}, -3.3895313892515355e38, DType::BFloat16);
  CHECK_FALSE(fused_unscale_and_check({{bf, bf}}, 1.0f));
  // A destination that is neither float32 nor the source is refused.
  Tensor h2 = zeros({8}, DType::Float16);
  CHECK_THROWS_AS(fused_unscale_and_check({{h, h2}}, 1.0f), DTypeError);
  CHECK_THROWS_AS(fused_unscale_and_check({{h, zeros({7})}}, 1.0f), ShapeError);
}

TEST_CASE("gradient L2 norm, scaling and zero count over flat buffers", "[amp]") {
  // Closed form: n ones and m twos have norm sqrt(n + 4m), exactly representable sums; n spans several
  // 16384-element norm chunks with a large last one, so a dropped chunk or thread partial shows.
  const int64_t n = 3 * 16384 + 10001, m = 1001;
  const double exact = std::sqrt(double(n) + 4.0 * double(m));
  CHECK(grad_norm_l2({ones({n}), full({m}, 2.0, DType::BFloat16)}) == Approx(exact).epsilon(1e-15));
  CHECK(grad_norm_l2({full({m}, 2.0, DType::Float16), ones({n})}) == Approx(exact).epsilon(1e-15));

  Generator gen(3);
  Tensor a = randn({2 * 32768 + 5}, &gen), b = randn({33}, &gen).to(DType::Float16);
  double ref = 0;  // a serial loop in double
  for (double v : a.tolist()) ref += v * v;
  for (double v : b.tolist()) ref += v * v;
  ref = std::sqrt(ref);
  // Squares round once in float32 and are summed in 16 float32 lanes over chunks of 16384, so each lane
  // adds 1024 non-negative terms: the sum of squares is within 1025 * u32 (u32 = 2^-24) relative, its
  // square root within half that.
  CHECK(grad_norm_l2({a, b}) == Approx(ref).epsilon(1025 * 0x1p-24 / 2));
  scale_grads({a, b}, 0.5f);
  CHECK(grad_norm_l2({a, b}) == Approx(ref / 2).epsilon(1e-3));
  Tensor z = zeros({10});
  z.narrow(0, 3, 2).fill_(1.0);
  CHECK(count_zeros({z, zeros({5}, DType::BFloat16)}) == 13);
}

// ------------------------------------------------------------------------------------------ GradScaler

namespace {

// A float32 parameter whose gradient is set directly to `g` (after a zero_grad), as backward would.
struct OneParam {
  Tensor p = zeros({4}).requires_grad_(true);
  std::unique_ptr<optim::SGD> opt;
  OneParam() {
    opt = std::make_unique<optim::SGD>(std::vector<Tensor>{p}, json{{"lr", 1.0}});
  }
  void set_grad(float g) {
    opt->zero_grad();
    Tensor loss = sum(mul(p, 1.0));
    loss.backward();  // gradient 1 everywhere, arrives in the flat buffer
    Tensor grad = p.grad();
    grad.data<float>()[0] = g;
  }
};

}  // namespace

TEST_CASE("GradScaler: unscale_ state machine errors carry torch's messages", "[amp]") {
  OneParam w;
  GradScaler scaler({/*init_scale*/ 4.0});
  w.set_grad(8.0f);
  scaler.unscale_(*w.opt);
  CHECK(w.p.grad().tolist() == std::vector<double>{2.0, 0.25, 0.25, 0.25});
  REQUIRE_THROWS_AS(scaler.unscale_(*w.opt), StateError);
  REQUIRE_THROWS_WITH(scaler.unscale_(*w.opt),
                      "unscale_() has already been called on this optimizer since the last update().");
  CHECK(scaler.step(*w.opt));
  REQUIRE_THROWS_WITH(scaler.unscale_(*w.opt), "unscale_() is being called after step().");
  REQUIRE_THROWS_WITH(scaler.step(*w.opt), "step() has already been called since the last update().");
  scaler.update();
  // After update() the cycle starts again: step() unscales by itself.
  w.set_grad(4.0f);
  CHECK(scaler.step(*w.opt));
  scaler.update();

  // A float16 loss is scaled in float32 (torch's float32 scale tensor promotes): 2 * 2^16 would be inf.
  Tensor scaled = GradScaler().scale(full({}, 2.0, DType::Float16));
  CHECK(scaled.dtype() == DType::Float32);
  CHECK(scaled.item() == 131072.0);

  GradScaler fresh;
  REQUIRE_THROWS_WITH(fresh.update(), "No inf checks were recorded prior to update().");

  GradScaler disabled({65536.0, 2.0, 0.5, 2000, false});
  w.set_grad(kInf);
  CHECK(disabled.state_dict() == json::object());
  CHECK(disabled.get_scale() == 1.0);
  CHECK(disabled.step(*w.opt));  // disabled: always steps, never checks
}

TEST_CASE("GradScaler: scale and growth tracker follow torch's update rule step by step", "[amp]") {
  // init 8, growth_interval 3: (step kind, expected scale after update, expected _growth_tracker)
  struct Expect { bool inf; double scale; int64_t tracker; };
  const std::vector<Expect> script = {
      {false, 8, 1},  {false, 8, 2},  {false, 16, 0}, {true, 8, 0},  {false, 8, 1}, {false, 8, 2},
      {true, 4, 0},   {true, 2, 0},   {false, 2, 1},  {false, 2, 2}, {false, 4, 0}, {false, 4, 1},
  };
  OneParam w;
  GradScaler scaler({8.0, 2.0, 0.5, 3, true});
  for (size_t i = 0; i < script.size(); ++i) {
    INFO("step " << i);
    w.set_grad(script[i].inf ? kInf : 1.0f);
    const auto before = snapshot({w.p});
    const bool stepped = scaler.step(*w.opt);
    scaler.update();
    CHECK(stepped == !script[i].inf);
    CHECK((snapshot({w.p}) == before) == script[i].inf);  // a skipped step leaves the parameter alone
    CHECK(scaler.get_scale() == script[i].scale);
    CHECK(scaler.growth_tracker() == script[i].tracker);
  }
  const json sd = scaler.state_dict();
  CHECK(sd == json{{"scale", 4.0}, {"growth_factor", 2.0}, {"backoff_factor", 0.5}, {"growth_interval", 3},
                   {"_growth_tracker", 1}});
  GradScaler restored;
  restored.load_state_dict(sd);
  CHECK(restored.get_scale() == 4.0);
  CHECK(restored.growth_tracker() == 1);
  CHECK_THROWS_AS(restored.load_state_dict(json::object()), CheckpointError);

  // Growth that would overflow float32 is not applied (the kernel keeps the old scale), tracker resets.
  GradScaler huge({3.0e38, 2.0, 0.5, 1, true});
  w.set_grad(1.0f);
  huge.step(*w.opt);
  huge.update();
  CHECK(huge.get_scale() == double(3.0e38f));
  CHECK(huge.growth_tracker() == 0);
}

// ----------------------------------------------------------------------------------- DynamicGradScaler

TEST_CASE("DynamicGradScaler: hysteresis delays backoff exactly as Megatron's, growth at the interval, bounds",
          "[amp]") {
  DynamicGradScalerOptions o;
  o.initial_scale = 16;
  o.min_scale = 1;
  o.growth_interval = 3;
  o.hysteresis = 2;
  o.max_scale = 64;
  DynamicGradScaler s(o);
  struct Expect { bool inf; double scale; int64_t growth, hysteresis; };
  const std::vector<Expect> script = {
      {true, 16, 0, 1},   // first overflow: absorbed by hysteresis
      {true, 8, 0, 0},    // second: backoff
      {true, 4, 0, -1},   // budget spent: every further overflow backs off at once
      {false, 4, 1, -1},  // clean steps do not restore the budget...
      {false, 4, 2, -1},
      {false, 8, 0, 2},   // ...a growth does
      {true, 8, 0, 1},
      {false, 8, 1, 1},   // a clean step between overflows does not reset the hysteresis tracker
      {true, 4, 0, 0},
      {false, 4, 1, 0}, {false, 4, 2, 0}, {false, 8, 0, 2},
      {false, 8, 1, 2}, {false, 8, 2, 2}, {false, 16, 0, 2},
      {false, 16, 1, 2}, {false, 16, 2, 2}, {false, 32, 0, 2},
      {false, 32, 1, 2}, {false, 32, 2, 2}, {false, 64, 0, 2},
      {false, 64, 1, 2}, {false, 64, 2, 2}, {false, 64, 0, 2},  // max_scale holds
  };
  for (size_t i = 0; i < script.size(); ++i) {
    INFO("step " << i);
    s.update(script[i].inf);
    CHECK(s.scale() == script[i].scale);
    CHECK(s.growth_tracker() == script[i].growth);
    CHECK(s.hysteresis_tracker() == script[i].hysteresis);
  }
  CHECK(s.state_dict() == json{{"scale", 64.0}, {"growth_tracker", 0}, {"hysteresis_tracker", 2}});

  // The floor: a backoff below min_scale is clamped; one due at min_scale stops training.
  DynamicGradScalerOptions f;
  f.initial_scale = 3;
  f.min_scale = 2;
  f.hysteresis = 1;
  DynamicGradScaler floor(f);
  floor.update(true);
  CHECK(floor.scale() == 2);
  REQUIRE_THROWS_AS(floor.update(true), TrainingError);
  DynamicGradScaler at_floor(f);
  at_floor.update(true);
  REQUIRE_THROWS_WITH(at_floor.update(true), Contains("floor min_scale = 2"));

  // Arguments are validated, each by name.
  auto bad = [](auto edit) {
    DynamicGradScalerOptions x;
    edit(x);
    return x;
  };
  CHECK_THROWS_WITH(DynamicGradScaler(bad([](auto& x) { x.initial_scale = 0; })), Contains("initial_scale"));
  CHECK_THROWS_WITH(DynamicGradScaler(bad([](auto& x) { x.min_scale = 0; })), Contains("min_scale"));
  CHECK_THROWS_WITH(DynamicGradScaler(bad([](auto& x) { x.min_scale = 1e9; })), Contains("min_scale"));
  CHECK_THROWS_WITH(DynamicGradScaler(bad([](auto& x) { x.growth_factor = 1; })), Contains("growth_factor"));
  CHECK_THROWS_WITH(DynamicGradScaler(bad([](auto& x) { x.backoff_factor = 1; })), Contains("backoff_factor"));
  CHECK_THROWS_WITH(DynamicGradScaler(bad([](auto& x) { x.growth_interval = 0; })), Contains("growth_interval"));
  CHECK_THROWS_WITH(DynamicGradScaler(bad([](auto& x) { x.hysteresis = 0; })), Contains("hysteresis"));
  CHECK_THROWS_WITH(DynamicGradScaler(bad([](auto& x) { x.max_scale = 1; })), Contains("max_scale"));
  CHECK_THROWS_AS(DynamicGradScaler(bad([](auto& x) { x.hysteresis = 0; })), ValueError);
}

// ---------------------------------------------------------------------------------------- underflow

namespace {

// Linear regression y = x w* whose loss is multiplied by 2^-30: every true gradient at the float16
// boundary (the output of the float16 linear) is ~1e-10, far below float16's smallest subnormal
// (2^-24 ~ 6e-8), so unscaled float16 gradients are exactly zero. SGD's lr undoes the factor, so with
// loss scaling this is ordinary least squares and converges.
struct Underflow {
  static constexpr double kLossFactor = 1.0 / 1073741824.0;  // 2^-30
  Tensor x, y;
  Underflow() {
    Generator gen(7);
    x = randn({64, 4}, &gen);
    y = matmul(x, from_vector(std::vector<float>{1.0f, -2.0f, 0.5f, 3.0f}, {4, 1}));
  }
  // Final weight after `steps` full-batch steps, starting from zero.
  std::vector<double> train(const std::string& strategy, const json& options, int steps) {
    auto model = std::make_shared<nn::Linear>(4, 1, false);
    {
      NoGradGuard no_grad;
      model->weight.zero_();
    }
    std::shared_ptr<optim::Optimizer> opt =
        std::make_shared<optim::SGD>(model->parameters(), json{{"lr", 0.2 / kLossFactor}});
    auto mp = create(strategy, options);
    Criterion crit = [](const Tensor& out, const Tensor& t) { return mul(mse_loss(out, t), kLossFactor); };
    Configured c = mp->configure(model, opt, crit);
    for (int i = 0; i < steps; ++i) {
      c.optimizer->zero_grad();
      Tensor loss = c.criterion((*c.model)(x), y);
      mp->backward(loss, *c.optimizer);
      if (i == 0) CHECK_FALSE(std::isnan(loss.item()));
      mp->step(*c.optimizer);
      REQUIRE_FALSE(mp->step_was_skipped());
    }
    return model->weight.to(DType::Float32).tolist();
  }
};

}  // namespace

TEST_CASE("underflow: gradients below float16's smallest subnormal vanish unscaled and survive scaling",
          "[amp]") {
  Underflow u;
  const std::vector<double> target = {1.0, -2.0, 0.5, 3.0};
  // Without scaling every float16 gradient is zero: the model does not move at all.
  CHECK(u.train("fp16", {{"enabled", false}}, 30) == std::vector<double>(4, 0.0));
  CHECK(u.train("fp16_naive", {{"initial_scale", 1.0}, {"min_scale", 1.0}}, 30) == std::vector<double>(4, 0.0));
  // log_num_zeros_in_grad counts the zero master-gradient elements: all 4 unscaled, none scaled.
  for (double scale : {1.0, 65536.0}) {
    auto model = std::make_shared<nn::Linear>(4, 1, false);
    std::shared_ptr<optim::Optimizer> opt = std::make_shared<optim::SGD>(model->parameters(), json{{"lr", 0.1}});
    auto mp = create("fp16_naive", {{"initial_scale", scale}, {"log_num_zeros_in_grad", true}});
    Criterion crit = [](const Tensor& out, const Tensor& t) { return mul(mse_loss(out, t), Underflow::kLossFactor); };
    Configured c = mp->configure(model, opt, crit);
    mp->backward(c.criterion((*c.model)(u.x), u.y), *c.optimizer);
    mp->step(*c.optimizer);
    CHECK(mp->last_step_stats().num_zeros == (scale == 1.0 ? 4 : 0));
  }
  CHECK(create("fp16_naive")->last_step_stats().num_zeros == -1);  // off by default
  // With the default scale (2^16) it learns.
  for (const char* strategy : {"fp16", "fp16_naive"}) {
    INFO(strategy);
    const std::vector<double> w = u.train(strategy, json::object(), 60);
    for (size_t i = 0; i < 4; ++i) CHECK(w[i] == Approx(target[i]).margin(0.02));
  }
}

// ----------------------------------------------------------------------------------------- overflow

TEST_CASE("overflow: an inf gradient skips the step, leaves parameters and optimizer state bit-identical, "
          "and lowers the scale", "[amp]") {
  auto data = data::synthetic_classification(256, 16, 4, 1);
  const Tensor& x = data->x();
  const Tensor& y = data->y();

  SECTION("fp16 (GradScaler): halves at once") {
    Setup s = make_setup("fp16", {{"init_scale", 1024.0}}, 5);
    for (int i = 0; i < 3; ++i) train_step(s, x, y, 32 * i, 32);
    REQUIRE(s.mp->loss_scale() == 1024.0);
    for (float bad : {kInf, kNaN}) {
      const double scale = s.mp->loss_scale();
      s.c.optimizer->zero_grad();
      Tensor loss = s.c.criterion((*s.c.model)(x.narrow(0, 0, 32)), y.narrow(0, 0, 32));
      s.mp->backward(loss, *s.c.optimizer);
      poison_first_grad(s.c, bad);
      const auto params = snapshot(s.c.model->parameters());
      const auto state = snapshot(state_tensors(*s.c.optimizer));
      const int64_t steps = s.c.optimizer->param_step(0);
      s.mp->step(*s.c.optimizer);
      CHECK(s.mp->step_was_skipped());
      CHECK(s.mp->last_step_stats().loss_scale == scale);
      CHECK(snapshot(s.c.model->parameters()) == params);
      CHECK(snapshot(state_tensors(*s.c.optimizer)) == state);
      CHECK(s.c.optimizer->param_step(0) == steps);
      CHECK(s.mp->loss_scale() == scale / 2);
    }
    train_step(s, x, y, 0, 32);
    CHECK_FALSE(s.mp->step_was_skipped());
  }

  SECTION("fp16_naive (DynamicGradScaler): hysteresis 2 skips twice, backs off on the second") {
    Setup s = make_setup("fp16_naive", {{"initial_scale", 1024.0}}, 5);
    for (int i = 0; i < 3; ++i) train_step(s, x, y, 32 * i, 32);
    auto all_state = [&] {
      auto v = s.c.model->parameters();
      for (const Tensor& t : state_tensors(*s.c.optimizer)) v.push_back(t);
      for (const auto& [k, t] : s.mp->state_dict().tensors) v.push_back(t);  // the masters
      return v;
    };
    const std::vector<double> expected_scale = {1024.0, 512.0, 256.0};
    for (double after : expected_scale) {
      s.c.optimizer->zero_grad();
      Tensor loss = s.c.criterion((*s.c.model)(x.narrow(0, 0, 32)), y.narrow(0, 0, 32));
      s.mp->backward(loss, *s.c.optimizer);
      poison_first_grad(s.c, kInf);
      const auto before = snapshot(all_state());
      s.mp->step(*s.c.optimizer);
      CHECK(s.mp->step_was_skipped());
      CHECK(snapshot(all_state()) == before);
      CHECK(s.mp->loss_scale() == after);
    }
    train_step(s, x, y, 0, 32);
    CHECK_FALSE(s.mp->step_was_skipped());
  }

  SECTION("bf16 never skips, even on inf") {
    for (bool pure : {false, true}) {
      Setup s = make_setup("bf16", {{"pure", pure}}, 5);
      s.c.optimizer->zero_grad();
      Tensor loss = s.c.criterion((*s.c.model)(x.narrow(0, 0, 32)), y.narrow(0, 0, 32));
      s.mp->backward(loss, *s.c.optimizer);
      poison_first_grad(s.c, kInf);
      s.mp->step(*s.c.optimizer);
      CHECK_FALSE(s.mp->step_was_skipped());
      CHECK(s.mp->loss_scale() == 1.0);
    }
  }

  SECTION("fp16: a scale pushed below its floor is a TrainingError") {
    Setup s = make_setup("fp16", {{"init_scale", 4.0}, {"min_scale", 2.0}}, 5);
    auto poisoned_step = [&] {
      s.c.optimizer->zero_grad();
      Tensor loss = s.c.criterion((*s.c.model)(x.narrow(0, 0, 32)), y.narrow(0, 0, 32));
      s.mp->backward(loss, *s.c.optimizer);
      poison_first_grad(s.c, kInf);
      s.mp->step(*s.c.optimizer);
    };
    poisoned_step();  // 4 -> 2: at the floor, allowed
    CHECK(s.mp->loss_scale() == 2.0);
    REQUIRE_THROWS_AS(poisoned_step(), TrainingError);
  }
}

TEST_CASE("fp16: growth happens exactly at growth_interval clean steps, through the strategy", "[amp]") {
  auto data = data::synthetic_classification(256, 16, 4, 1);
  Setup s = make_setup("fp16", {{"init_scale", 256.0}, {"growth_interval", 4}}, 5);
  const std::vector<double> expected = {256, 256, 256, 512, 512, 512, 512, 1024};
  for (size_t i = 0; i < expected.size(); ++i) {
    train_step(s, data->x(), data->y(), 32 * int64_t(i % 8), 32);
    CHECK_FALSE(s.mp->step_was_skipped());
    CHECK(s.mp->loss_scale() == expected[i]);
  }
  CHECK(s.mp->state_dict().meta.at("scaler").at("_growth_tracker") == 0);
}

// --------------------------------------------------------------------------------- every strategy

namespace {

struct StrategyCase {
  const char* name;
  json options;
};

const std::vector<StrategyCase>& all_strategies() {
  static const std::vector<StrategyCase> cases = {
      {"fp32", json::object()},       {"no", json::object()},          {"fp16", json::object()},
      {"bf16", json::object()},       {"bf16", {{"pure", true}}},      {"fp16_naive", json::object()},
      {"fp16_apex", {{"opt_level", "O0"}}}, {"fp16_apex", {{"opt_level", "O1"}}},
      {"fp16_apex", {{"opt_level", "O2"}}}, {"fp16_apex", {{"opt_level", "O3"}}},
      {"fp8", {{"lm_head", true}, {"amax_history_len", 4}}},
  };
  return cases;
}

}  // namespace

TEST_CASE("every strategy trains an MLP to within 1 point of float32 accuracy", "[amp]") {
  // Few features and many classes: overlapping blobs, so accuracy is well below 100% and a strategy
  // that trains worse shows.
  auto data = data::synthetic_classification(4096, 4, 8, 11);
  const Tensor& x = data->x();
  const Tensor& y = data->y();
  const int64_t batch = 64, epochs = 3;
  double fp32_accuracy = -1;
  for (const StrategyCase& sc : all_strategies()) {
    INFO(sc.name << " " << sc.options.dump());
    Setup s = make_setup(sc.name, sc.options, 21, 4, 8);
    int64_t skipped = 0;
    for (int64_t e = 0; e < epochs; ++e)
      for (int64_t b = 0; b + batch <= x.size(0); b += batch) {
        train_step(s, x, y, b, batch, /*clip*/ 5.0);
        skipped += s.mp->step_was_skipped();
        CHECK(std::isfinite(s.mp->last_step_stats().grad_norm));
      }
    const double acc = accuracy(s, x, y);
    if (fp32_accuracy < 0) {
      fp32_accuracy = acc;
      // Learnable but not saturated; otherwise the comparison says nothing.
      REQUIRE(fp32_accuracy > 0.8);
      REQUIRE(fp32_accuracy < 0.99);
    }
    CHECK(std::abs(acc - fp32_accuracy) <= 0.01);
    UNSCOPED_INFO(sc.name << sc.options.dump() << ": accuracy " << acc << " (fp32 " << fp32_accuracy << ")");
    CHECK(skipped == 0);  // the default scales (65536) do not overflow on this problem
  }
}

TEST_CASE("every strategy's state_dict round trip continues the same trajectory", "[amp]") {
  auto data = data::synthetic_classification(512, 16, 4, 3);
  const Tensor& x = data->x();
  const Tensor& y = data->y();
  const int64_t batch = 32;
  for (StrategyCase sc : all_strategies()) {
    // Small intervals so the scaler state (scale, trackers) changes within the run.
    if (std::string(sc.name) == "fp16") sc.options = {{"growth_interval", 3}};
    if (std::string(sc.name) == "fp16_naive") sc.options = {{"growth_interval", 3}, {"hysteresis", 2}};
    INFO(sc.name << " " << sc.options.dump());

    Setup a = make_setup(sc.name, sc.options, 1);
    for (int64_t i = 0; i < 4; ++i) train_step(a, x, y, batch * i, batch);
    // Checkpoint: clones of the model, optimizer and strategy state.
    nn::StateDict model_sd;
    for (const auto& [k, t] : a.c.model->state_dict()) model_sd[k] = t.clone();
    optim::OptimizerState opt_sd = a.c.optimizer->state_dict();
    for (auto& [k, t] : opt_sd.tensors) t = t.clone();
    MixedPrecisionState mp_sd = a.mp->state_dict();
    for (auto& [k, t] : mp_sd.tensors) t = t.clone();
    const json mp_meta_at_save = mp_sd.meta;

    // A fresh run from another seed, restored from the checkpoint.
    Setup b = make_setup(sc.name, sc.options, 99);
    b.c.model->load_state_dict(model_sd);
    b.c.optimizer->load_state_dict(opt_sd);
    b.mp->load_state_dict(mp_sd);
    CHECK(b.mp->state_dict().meta == mp_meta_at_save);

    for (int64_t i = 4; i < 10; ++i) {
      for (Setup* s : {&a, &b}) {
        s->c.optimizer->zero_grad();
        Tensor loss = s->c.criterion((*s->c.model)(x.narrow(0, batch * i, batch)), y.narrow(0, batch * i, batch));
        s->mp->backward(loss, *s->c.optimizer);
        if (i == 6 && s->mp->loss_scale() != 1.0) poison_first_grad(s->c, kInf);  // exercise the scaler
        s->mp->step(*s->c.optimizer);
      }
      CHECK(a.mp->step_was_skipped() == b.mp->step_was_skipped());
      CHECK(a.mp->loss_scale() == b.mp->loss_scale());
    }
    CHECK(snapshot(a.c.model->parameters()) == snapshot(b.c.model->parameters()));
    CHECK(a.mp->state_dict().meta == b.mp->state_dict().meta);
    CHECK(snapshot(state_tensors(*a.c.optimizer)) == snapshot(state_tensors(*b.c.optimizer)));
  }
}

TEST_CASE("strategies wrap the model without renaming it and run the forward under autocast", "[amp]") {
  auto data = data::synthetic_classification(64, 16, 4, 2);
  Setup s = make_setup("fp16", json::object(), 1);
  std::vector<std::string> names;
  for (const auto& [k, t] : s.c.model->named_parameters()) names.push_back(k);
  CHECK(names == std::vector<std::string>{"layers.0.weight", "layers.0.bias", "layers.2.weight", "layers.2.bias"});
  // The logits of the float16 linear layer are rounded to float16: autocast was on.
  Tensor out = (*s.c.model)(data->x());
  CHECK(out.dtype() == DType::Float16);
  // eval() reaches the wrapped model's own flag (a model may consult it in its forward).
  auto wrapped = std::dynamic_pointer_cast<PrecisionModule>(s.c.model);
  REQUIRE(wrapped);
  s.c.model->eval();
  (*s.c.model)(data->x());
  CHECK_FALSE(wrapped->inner()->is_training());
  s.c.model->train();
  (*s.c.model)(data->x());
  CHECK(wrapped->inner()->is_training());
  // fp16_naive keeps the whole model in float16 but hands float32 out (the loss is float32).
  Setup n = make_setup("fp16_naive", json::object(), 1);
  CHECK(n.c.model->parameters().front().dtype() == DType::Float16);
  CHECK((*n.c.model)(data->x()).dtype() == DType::Float32);
  // Passing the user's original optimizer instead of the master-weight one is refused.
  auto other = std::make_shared<nn::Linear>(2, 2);
  optim::SGD wrong(other->parameters(), json{{"lr", 0.1}});
  Tensor loss = n.c.criterion((*n.c.model)(data->x()), data->y());
  CHECK_THROWS_AS(n.mp->backward(loss, wrong), StateError);
}

// --------------------------------------------------------------------------------------------- apex

TEST_CASE("fp16_apex: opt levels follow apex's property table, overrides are checked as apex does", "[amp]") {
  const json o0 = create("fp16_apex", {{"opt_level", "O0"}})->options();
  CHECK(o0.at("cast_model_type") == "float32");
  CHECK(o0.at("patch_torch_functions") == false);
  CHECK(o0.at("keep_batchnorm_fp32").is_null());
  CHECK(o0.at("master_weights") == false);
  CHECK(o0.at("loss_scale") == 1.0);
  const json o1 = create("fp16_apex", {{"opt_level", "O1"}})->options();
  CHECK(o1.at("cast_model_type").is_null());
  CHECK(o1.at("patch_torch_functions") == true);
  CHECK(o1.at("keep_batchnorm_fp32").is_null());
  CHECK(o1.at("master_weights").is_null());
  CHECK(o1.at("loss_scale") == "dynamic");
  CHECK(o1.at("max_loss_scale") == 16777216.0);
  CHECK(o1.at("min_loss_scale").is_null());
  const json o2 = create("fp16_apex", {{"opt_level", "O2"}})->options();
  CHECK(o2.at("cast_model_type") == "float16");
  CHECK(o2.at("patch_torch_functions") == false);
  CHECK(o2.at("keep_batchnorm_fp32") == true);
  CHECK(o2.at("master_weights") == true);
  CHECK(o2.at("loss_scale") == "dynamic");
  const json o3 = create("fp16_apex", {{"opt_level", "O3"}})->options();
  CHECK(o3.at("cast_model_type") == "float16");
  CHECK(o3.at("keep_batchnorm_fp32") == false);
  CHECK(o3.at("master_weights") == false);
  CHECK(o3.at("loss_scale") == 1.0);
  CHECK(create("fp16_apex")->options().at("opt_level") == "O1");

  // Overrides.
  const json o2s = create("fp16_apex", {{"opt_level", "O2"}, {"loss_scale", 128}, {"keep_batchnorm_fp32", "False"}})
                       ->options();
  CHECK(o2s.at("loss_scale") == 128.0);
  CHECK(o2s.at("keep_batchnorm_fp32") == false);
  CHECK(create("fp16_apex", {{"opt_level", "O3"}, {"loss_scale", "dynamic"}})->options().at("loss_scale") == "dynamic");

  REQUIRE_THROWS_AS(create("fp16_apex", {{"opt_level", "O4"}}), ConfigError);
  REQUIRE_THROWS_WITH(create("fp16_apex", {{"opt_level", "04"}}),
                      Contains("'O0', 'O1', 'O2', 'O3'") && Contains("letter O, not the number zero"));
  REQUIRE_THROWS_WITH(create("fp16_apex", {{"opt_level", "O1"}, {"cast_model_type", "float16"}}),
                      Contains("O1 inserts casts around Torch functions"));
  CHECK_NOTHROW(create("fp16_apex", {{"opt_level", "O1"}, {"cast_model_type", "float32"}}));
  REQUIRE_THROWS_WITH(create("fp16_apex", {{"opt_level", "O1"}, {"master_weights", true}}),
                      Contains("master_weights with O1"));
  REQUIRE_THROWS_WITH(create("fp16_apex", {{"opt_level", "O1"}, {"keep_batchnorm_fp32", false}}),
                      Contains("keep_batchnorm_fp32 should be None"));
  REQUIRE_THROWS_WITH(create("fp16_apex", {{"opt_level", "O2"}, {"patch_torch_functions", true}}),
                      Contains("patch_torch_functions=True should only be set by selecting opt_level='O1'"));
  // A null override is no override (amp.initialize applies only overrides that are not None).
  CHECK(create("fp16_apex", {{"opt_level", "O2"}, {"master_weights", nullptr}})->options().at("master_weights") == true);
  CHECK_NOTHROW(create("fp16_apex", {{"opt_level", "O1"}, {"master_weights", nullptr}}));
  CHECK_NOTHROW(create("fp16_apex", {{"opt_level", "O1"}, {"cast_model_type", false}}));
  REQUIRE_THROWS_WITH(create("fp16_apex", {{"loss_scale", "auto"}}), Contains("'loss_scale'"));
  REQUIRE_THROWS_WITH(create("fp16_apex", {{"min_loss_scale", -1}}), Contains("'min_loss_scale'"));
  REQUIRE_THROWS_WITH(create("fp16_apex", {{"opt_levl", "O2"}}), Contains("unknown option 'opt_levl'") &&
                                                                    Contains("opt_level"));
}

TEST_CASE("fp16_apex: dynamic scale starts at min(max_loss_scale, 2^16), halves and skips on overflow, "
          "respects min_loss_scale", "[amp]") {
  auto data = data::synthetic_classification(256, 16, 4, 1);
  for (const char* level : {"O1", "O2"}) {
    INFO(level);
    Setup s = make_setup("fp16_apex", {{"opt_level", level}, {"max_loss_scale", 1024.0}, {"min_loss_scale", 256.0}}, 5);
    CHECK(s.mp->loss_scale() == 1024.0);
    train_step(s, data->x(), data->y(), 0, 32);
    CHECK_FALSE(s.mp->step_was_skipped());
    for (double after : {512.0, 256.0}) {
      s.c.optimizer->zero_grad();
      Tensor loss = s.c.criterion((*s.c.model)(data->x().narrow(0, 0, 32)), data->y().narrow(0, 0, 32));
      s.mp->backward(loss, *s.c.optimizer);
      poison_first_grad(s.c, kNaN);
      const auto before = snapshot(s.c.model->parameters());
      s.mp->step(*s.c.optimizer);
      CHECK(s.mp->step_was_skipped());
      CHECK(snapshot(s.c.model->parameters()) == before);
      CHECK(s.mp->loss_scale() == after);
    }
    // At the floor, another overflow stops training.
    s.c.optimizer->zero_grad();
    Tensor loss = s.c.criterion((*s.c.model)(data->x().narrow(0, 0, 32)), data->y().narrow(0, 0, 32));
    s.mp->backward(loss, *s.c.optimizer);
    poison_first_grad(s.c, kInf);
    CHECK_THROWS_AS(s.mp->step(*s.c.optimizer), TrainingError);
  }
  // O2 keeps float32 masters of a float16 model; O3 steps the float16 model directly.
  Setup o2 = make_setup("fp16_apex", {{"opt_level", "O2"}}, 5);
  CHECK(o2.c.model->parameters().front().dtype() == DType::Float16);
  CHECK(o2.mp->state_dict().tensors.size() == 4);
  Setup o3 = make_setup("fp16_apex", {{"opt_level", "O3"}}, 5);
  CHECK(o3.c.model->parameters().front().dtype() == DType::Float16);
  CHECK(o3.mp->state_dict().tensors.empty());
  // A static scale never skips.
  Setup st = make_setup("fp16_apex", {{"opt_level", "O1"}, {"loss_scale", 8.0}}, 5);
  st.c.optimizer->zero_grad();
  Tensor loss = st.c.criterion((*st.c.model)(data->x().narrow(0, 0, 32)), data->y().narrow(0, 0, 32));
  st.mp->backward(loss, *st.c.optimizer);
  poison_first_grad(st.c, kInf);
  st.mp->step(*st.c.optimizer);
  CHECK_FALSE(st.mp->step_was_skipped());
  CHECK(st.mp->loss_scale() == 8.0);
}

TEST_CASE("fp16_apex O2 keeps batch norm float32 in a float16 model and trains through it", "[amp]") {
  auto data = data::synthetic_classification(512, 16, 4, 4);
  auto model = std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
      std::make_shared<nn::Linear>(16, 32), std::make_shared<nn::BatchNorm1d>(32), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Linear>(32, 4)});
  std::shared_ptr<optim::Optimizer> opt = std::make_shared<optim::Adam>(model->parameters(), json{{"lr", 1e-2}});
  auto mp = create("fp16_apex", {{"opt_level", "O2"}});
  Configured c = mp->configure(model, opt, cross_entropy_criterion());
  const auto named = c.model->named_parameters();
  for (const auto& [n, p] : named) {
    INFO(n);
    CHECK(p.dtype() == (n.rfind("1.", 0) == 0 ? DType::Float32 : DType::Float16));
  }
  double first = 0, last = 0;
  for (int i = 0; i < 40; ++i) {
    c.optimizer->zero_grad();
    Tensor loss = c.criterion((*c.model)(data->x().narrow(0, 32 * (i % 16), 32)), data->y().narrow(0, 32 * (i % 16), 32));
    mp->backward(loss, *c.optimizer);
    mp->step(*c.optimizer);
    REQUIRE_FALSE(mp->step_was_skipped());
    (i == 0 ? first : last) = loss.item();
  }
  CHECK(last < first * 0.5);
}

TEST_CASE("fp16: gradients created outside the flat buffer (module zero_grad to None) are unscaled too", "[amp]") {
  auto data = data::synthetic_classification(256, 16, 4, 6);
  const json sgd = {{"type", "sgd"}, {"lr", 0.1}};
  Setup a = make_setup("fp16", json::object(), 8, 16, 4, sgd);
  Setup b = make_setup("fp16", json::object(), 8, 16, 4, sgd);
  for (int64_t i = 0; i < 3; ++i) {
    a.c.optimizer->zero_grad();
    b.c.model->zero_grad(/*set_to_none*/ true);  // the next backward makes separate gradient tensors
    for (Setup* s : {&a, &b}) {
      Tensor loss = s->c.criterion((*s->c.model)(data->x().narrow(0, 32 * i, 32)), data->y().narrow(0, 32 * i, 32));
      s->mp->backward(loss, *s->c.optimizer);
      s->mp->clip_grad_norm(*s->c.optimizer, 100.0);
      s->mp->step(*s->c.optimizer);
    }
    CHECK(a.mp->last_step_stats().grad_norm == b.mp->last_step_stats().grad_norm);
  }
  CHECK(snapshot(a.c.model->parameters()) == snapshot(b.c.model->parameters()));
}

namespace {

// What `body` wrote to stderr (fd 2), read back from a temporary file.
template <class Body>
std::string captured_stderr(Body body) {
  std::fflush(stderr);
  char path[] = "/tmp/booster_test_amp_stderr_XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  const int saved = ::dup(STDERR_FILENO);
  ::dup2(fd, STDERR_FILENO);
  body();
  std::fflush(stderr);
  ::dup2(saved, STDERR_FILENO);
  ::close(saved);
  std::string text;
  ::lseek(fd, 0, SEEK_SET);
  char buf[4096];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) text.append(buf, size_t(n));
  ::close(fd);
  ::unlink(path);
  return text;
}

int64_t occurrences(const std::string& text, const std::string& what) {
  int64_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

// Note [A backward the scaler did not see] (precision_strategy.h).
TEST_CASE("loss.backward() instead of booster.backward() under a loss scale warns once", "[amp][booster]") {
  const std::vector<std::pair<std::string, json>> strategies = {
      {"fp16", json::object()},
      {"fp16_apex", {{"opt_level", "O1"}}},
      {"fp16_apex", {{"opt_level", "O2"}}},
      {"fp16_naive", json::object()},
  };
  const std::string warning = "call booster.backward(loss, optimizer)";
  for (const auto& [name, options] : strategies) {
    for (const bool through_booster : {false, true}) {
      INFO(name << " " << options.dump() << (through_booster ? " booster.backward" : " loss.backward"));
      manual_seed(5);
      Booster booster(BoosterConfig{.mixed_precision = name, .mixed_precision_options = options});
      nn::ModulePtr model = nn::make_model({{"type", "mlp"}, {"in", 8}, {"hidden", {16}}, {"classes", 3}}, 3);
      auto adamw = std::make_shared<optim::AdamW>(model->parameters(), json{{"lr", 0.01}});
      booster.boost(model, adamw, cross_entropy_criterion());
      const Boosted& parts = booster.boosted();
      const Tensor x = randn({16, 8});
      const Tensor y = from_vector(std::vector<float>(16, 1.0f), {16}).to(DType::Int64);
      const std::string err = captured_stderr([&] {
        for (int step = 0; step < 3; ++step) {
          parts.optimizer->zero_grad();
          const Tensor loss = parts.criterion((*parts.model)(x), y);
          if (through_booster) booster.backward(loss, *parts.optimizer);
          else loss.backward();
          parts.optimizer->step();
        }
      });
      CHECK(occurrences(err, warning) == (through_booster ? 0 : 1));
    }
  }
}
