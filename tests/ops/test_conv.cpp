// Convolution and pooling (Note [Convolution as gather + GEMM] in ops/conv.cpp): forward values and
// gradients against PyTorch 1.13 (fixtures/conv.json, by make_conv_fixtures.py), gradients against
// central finite differences, 16-bit storage against the float64 result, the nn layers' parameters and
// defaults, and a small CNN that trains under every mixed-precision strategy.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "booster/autocast/autocast.h"
#include "booster/booster/booster.h"
#include "booster/nn/nn.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "fixture.h"
#include "gradcheck.h"

using namespace booster;
using booster::testing::allclose;
using booster::testing::gradcheck;
using booster::testing::max_abs_diff;
using booster::testing::tensor_from_json;
using nlohmann::json;

namespace {

nn::Pair pair_of(const json& j, const char* key, nn::Pair fallback) {
  if (!j.contains(key)) return fallback;
  if (j.at(key).is_number()) return {j.at(key).get<int64_t>(), j.at(key).get<int64_t>()};
  return {j.at(key)[0].get<int64_t>(), j.at(key)[1].get<int64_t>()};
}

// Runs a fixture case's op on `x` (and the conv parameters).
Tensor run_case(const json& c, const Tensor& x, const Tensor& w = Tensor(), const Tensor& b = Tensor()) {
  const std::string op = c.at("op");
  if (op == "conv2d")
    return conv2d(x, w, b, pair_of(c, "stride", {1, 1}), pair_of(c, "padding", {0, 0}), pair_of(c, "dilation", {1, 1}),
                  c.at("groups").get<int64_t>());
  if (op == "max_pool2d")
    return max_pool2d(x, pair_of(c, "kernel_size", {1, 1}), pair_of(c, "stride", {0, 0}), pair_of(c, "padding", {0, 0}),
                      pair_of(c, "dilation", {1, 1}));
  if (op == "avg_pool2d")
    return avg_pool2d(x, pair_of(c, "kernel_size", {1, 1}), pair_of(c, "stride", {0, 0}), pair_of(c, "padding", {0, 0}));
  REQUIRE(op == "adaptive_avg_pool2d");
  return adaptive_avg_pool2d(x, pair_of(c, "output_size", {1, 1}));
}

}  // namespace

TEST_CASE("conv2d and pooling: values and gradients match PyTorch", "[conv][fixture]") {
  const json all = booster::testing::load_fixture_json("conv.json");
  int checked = 0;
  for (const auto& [name, c] : all.items()) {
    const std::string op = c.at("op");
    if (op.rfind("batch_norm", 0) == 0) continue;
    INFO(name);
    Tensor x = tensor_from_json(c.at("x")).requires_grad_();
    Tensor w = c.contains("weight") ? tensor_from_json(c.at("weight")).requires_grad_() : Tensor();
    Tensor b = c.contains("bias") ? tensor_from_json(c.at("bias")).requires_grad_() : Tensor();
    Tensor out = run_case(c, x, w, b);
    const Tensor want = tensor_from_json(c.at("out"));
    INFO("out max diff " << max_abs_diff(out, want));
    REQUIRE(allclose(out, want, 1e-10, 1e-10));
    mul(sum(mul(out, out)), 0.5).backward();
    CHECK(allclose(x.grad(), tensor_from_json(c.at("grad_x")), 1e-10, 1e-10));
    if (w.defined()) CHECK(allclose(w.grad(), tensor_from_json(c.at("grad_weight")), 1e-10, 1e-10));
    if (b.defined()) CHECK(allclose(b.grad(), tensor_from_json(c.at("grad_bias")), 1e-10, 1e-10));
    ++checked;
  }
  CHECK(checked == 13);
}

TEST_CASE("conv2d and pooling: gradients match finite differences", "[conv][gradcheck]") {
  Generator g(4);
  const Tensor x = randn({2, 4, 6, 5}, &g, DType::Float64);
  const Tensor w = randn({6, 2, 3, 2}, &g, DType::Float64), b = randn({6}, &g, DType::Float64);
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return conv2d(t[0], t[1], t[2], {2, 1}, {1, 1}, {1, 2}, 2); },
                  {x, w, b}));
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return conv2d(t[0], t[1]); },
                  {x, randn({3, 4, 2, 2}, &g, DType::Float64)}));
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return max_pool2d(t[0], {3, 2}, {2, 1}, {1, 1}); }, {x}));
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return avg_pool2d(t[0], {3, 3}, {2, 2}, {1, 1}); }, {x}));
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return adaptive_avg_pool2d(t[0], {4, 3}); }, {x}));
  // BatchNorm2d's op: batch_norm over [N, C, H*W] with batch statistics.
  CHECK(gradcheck(
      [](const std::vector<Tensor>& t) {
        return batch_norm(t[0].reshape({2, 4, 30}), Tensor(), Tensor(), t[1], t[2], true).reshape({2, 4, 6, 5});
      },
      {x, randn({4}, &g, DType::Float64), randn({4}, &g, DType::Float64)}));
}

TEST_CASE("conv2d and pooling in float16 and bfloat16 storage follow the float64 result", "[conv][half]") {
  Generator g(6);
  const Tensor x = randn({2, 3, 8, 8}, &g, DType::Float64), w = randn({4, 3, 3, 3}, &g, DType::Float64);
  const Tensor b = randn({4}, &g, DType::Float64);
  for (DType dt : {DType::Float16, DType::BFloat16, DType::Float32}) {
    INFO(dt);
    const double tol = dt == DType::BFloat16 ? 6e-2 : dt == DType::Float16 ? 1e-2 : 1e-5;
    const Tensor ref = conv2d(x, w, b, {1, 1}, {1, 1});
    const Tensor got = conv2d(x.to(dt), w.to(dt), b.to(dt), {1, 1}, {1, 1});
    CHECK(got.dtype() == dt);
    CHECK(allclose(got.to(DType::Float64), ref, tol, tol * 4));
    CHECK(allclose(max_pool2d(x.to(dt), {2, 2}).to(DType::Float64), max_pool2d(x.to(dt).to(DType::Float64), {2, 2}), 0, 0));
    CHECK(allclose(avg_pool2d(x.to(dt), {2, 2}).to(DType::Float64), avg_pool2d(x, {2, 2}), tol, tol));
  }
  // Under autocast conv2d computes in the lower precision, as torch's CUDA autocast does.
  autocast::AutocastGuard guard(true, DType::BFloat16);
  CHECK(conv2d(x.to(DType::Float32), w.to(DType::Float32)).dtype() == DType::BFloat16);
}

TEST_CASE("nn layers: Conv2d, pools, Flatten and BatchNorm2d as torch.nn", "[conv][nn]") {
  nn::Conv2d conv(4, 6, {3, 3}, {1, 1}, {1, 1}, {1, 1}, 2);
  const auto params = conv.named_parameters();
  REQUIRE(params.size() == 2);
  CHECK(params[0].first == "weight");
  CHECK(params[0].second.shape() == Shape{6, 2, 3, 3});
  CHECK(params[1].first == "bias");
  // U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = 2 * 3 * 3.
  const double bound = 1.0 / std::sqrt(18.0);
  CHECK(max(abs(conv.weight)).item() <= bound);
  CHECK(max(abs(conv.weight)).item() > 0.8 * bound);
  CHECK(conv(randn({2, 4, 5, 5})).shape() == Shape{2, 6, 5, 5});
  CHECK_THROWS_AS(conv(randn({2, 3, 5, 5})), ShapeError);
  CHECK_THROWS_AS(nn::Conv2d(3, 6, {3, 3}, {1, 1}, {0, 0}, {1, 1}, 2), ValueError);
  CHECK_THROWS_WITH(conv2d(randn({1, 4, 2, 2}), conv.weight, Tensor(), {1, 1}, {0, 0}, {1, 1}, 2), Catch::Contains("smaller than the kernel"));

  CHECK(nn::MaxPool2d({2, 2})(randn({1, 1, 5, 5})).shape() == Shape{1, 1, 2, 2});
  CHECK(nn::AvgPool2d({3, 3}, {1, 1}, {1, 1})(randn({1, 1, 5, 5})).shape() == Shape{1, 1, 5, 5});
  CHECK(nn::AdaptiveAvgPool2d({1, 1})(randn({2, 3, 5, 5})).shape() == Shape{2, 3, 1, 1});
  CHECK(nn::Flatten()(randn({2, 3, 4, 5})).shape() == Shape{2, 60});
  CHECK(nn::Flatten(2)(randn({2, 3, 4, 5})).shape() == Shape{2, 3, 20});
  CHECK_THROWS_AS(max_pool2d(randn({1, 1, 4, 4}), {2, 2}, {2, 2}, {2, 2}), ValueError);

  // BatchNorm2d: training statistics and running stats as torch's.
  const json c = booster::testing::load_fixture_json("conv.json").at("batchnorm2d_train");
  nn::BatchNorm2d bn(3);
  bn.to(DType::Float64);
  {
    NoGradGuard ng;
    bn.weight.copy_(tensor_from_json(c.at("weight")));
    bn.bias.copy_(tensor_from_json(c.at("bias")));
  }
  Tensor x = tensor_from_json(c.at("x")).requires_grad_();
  Tensor out = bn(x);
  CHECK(allclose(out, tensor_from_json(c.at("out")), 1e-9, 1e-9));
  mul(sum(mul(out, out)), 0.5).backward();
  CHECK(allclose(x.grad(), tensor_from_json(c.at("grad_x")), 1e-8, 1e-9));
  CHECK(allclose(bn.weight.grad(), tensor_from_json(c.at("grad_weight")), 1e-8, 1e-9));
  CHECK(allclose(bn.running_mean, tensor_from_json(c.at("running_mean")), 1e-10, 1e-12));
  CHECK(allclose(bn.running_var, tensor_from_json(c.at("running_var")), 1e-10, 1e-12));
  bn.eval();
  const json e = booster::testing::load_fixture_json("conv.json").at("batchnorm2d_eval");
  CHECK(allclose(bn(tensor_from_json(e.at("x"))), tensor_from_json(e.at("out")), 1e-9, 1e-9));
  CHECK(nn::is_batch_norm(bn));
}

TEST_CASE("a small CNN trains under every mixed-precision strategy", "[conv][amp]") {
  Generator g(8);
  const Tensor x = randn({16, 1, 12, 12}, &g);
  const Tensor y = randint(0, 4, {16}, &g);
  const std::vector<std::pair<std::string, json>> strategies = {
      {"fp32", json::object()},      {"fp16", json::object()},      {"bf16", json::object()},
      {"fp16_naive", json::object()}, {"fp16_apex", {{"opt_level", "O1"}}}, {"fp16_apex", {{"opt_level", "O2"}}},
      {"fp16_apex", {{"opt_level", "O3"}}}};
  for (const auto& [strategy, options] : strategies) {
    INFO(strategy << " " << options.dump());
    Generator init(1);
    auto cnn = std::make_shared<nn::Sequential>();
    cnn->push_back(std::make_shared<nn::Conv2d>(1, 8, nn::Pair{3, 3}, nn::Pair{1, 1}, nn::Pair{1, 1}, nn::Pair{1, 1}, 1,
                                                true, &init));
    cnn->push_back(std::make_shared<nn::BatchNorm2d>(8));
    cnn->push_back(std::make_shared<nn::ReLU>());
    cnn->push_back(std::make_shared<nn::MaxPool2d>(nn::Pair{2, 2}));
    cnn->push_back(std::make_shared<nn::AdaptiveAvgPool2d>(nn::Pair{2, 2}));
    cnn->push_back(std::make_shared<nn::Flatten>());
    cnn->push_back(std::make_shared<nn::Linear>(32, 4, true, &init));
    Booster booster(BoosterConfig{.mixed_precision = strategy, .mixed_precision_options = options});
    auto opt = std::make_shared<optim::AdamW>(cnn->parameters(), json{{"lr", 1e-2}});
    nn::Criterion ce = [](const Tensor& o, const Tensor& t) { return cross_entropy(o, t); };
    auto [model, optimizer, criterion, loader, scheduler] = booster.boost(cnn, opt, ce);
    const Tensor before = cnn->parameters().front().to(DType::Float32).clone();
    double first = 0, last = 0;
    for (int step = 0; step < 8; ++step) {
      optimizer->zero_grad();
      Tensor loss = criterion((*model)(x), y);
      if (step == 0) first = loss.item();
      last = loss.item();
      REQUIRE(std::isfinite(last));
      booster.backward(loss, *optimizer);
      optimizer->step();
    }
    CHECK(max(abs(sub(model->parameters().front().to(DType::Float32), before))).item() > 0);
    CHECK(last < first);
  }
}
