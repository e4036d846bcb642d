// The fp8 strategy: delayed and current scaling against Transformer Engine's formula on scripted amax
// sequences, the fp8 linear layer against float64 references over its own quantized operands and against
// the plain linear where quantization is exact, layer choice, options and state.
#include <catch2/catch.hpp>
#include <cmath>

#include "booster/autocast/autocast.h"
#include "booster/autograd/autograd.h"
#include "booster/mixed_precision/float8.h"
#include "booster/nn/linear.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/random.h"
#include "float8_reference.h"

using namespace booster;
using namespace booster::mixed_precision;

namespace {

// Transformer Engine's scale update, written out: sf = (fp8_max / amax) / 2^margin, kept where amax is
// 0 or not finite.
float te_scale(float fp8_max, float amax, int margin, float previous) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return previous;
  return (fp8_max / amax) / float(std::pow(2.0, margin));
}

// Float64 matrices from a tensor.
std::vector<double> doubles(const Tensor& t) { return t.to(DType::Float64).contiguous().to_vector<double>(); }

}  // namespace

TEST_CASE("fp8 delayed scaling follows the amax-history formula on scripted sequences") {
  const std::vector<float> amaxes{2.0f, 0.5f, 0.0f, 8.0f, INFINITY, 1.0f, 0.25f, 3.0f, 0.125f, 0.0f};
  for (const std::string algo : {"max", "most_recent"})
    for (const int64_t len : {1, 3, 16})
      for (const int margin : {0, 2}) {
        INFO("algo " << algo << ", history " << len << ", margin " << margin);
        Float8ScalingOptions o;
        o.amax_history_len = len;
        o.amax_compute_algo = algo;
        o.margin = margin;
        Float8Scale s(448.0f, o);
        std::vector<float> history;  // most recent first
        float want = 1.0f;
        for (size_t step = 0; step < amaxes.size(); ++step) {
          // Two casts in the step (two micro-batches): the step's amax is the larger.
          CHECK(s.scale_for(amaxes[step] / 2) == want);  // the cast uses the last update's scale
          CHECK(s.scale_for(amaxes[step]) == want);
          s.update();
          history.insert(history.begin(), amaxes[step]);
          if (int64_t(history.size()) > len) history.pop_back();
          float amax = history.front();
          if (algo == "max")
            for (float a : history) amax = std::max(amax, a);
          want = te_scale(448.0f, amax, margin, want);
          CHECK(s.scale() == want);
        }
        std::vector<float> h = s.history();
        h.resize(history.size());
        CHECK(h == history);
      }
}

// A NaN amax (a step whose activations or gradients went non-finite, later skipped by the loss
// scaler) never becomes a scale: the cast keeps the last good one, a NaN among a step's casts marks the
// whole step's amax, and under "max" the NaN holds the scale for as long as it stays in the history
// (it is not a number to take a max over); "most_recent" recovers at the next finite step.
TEST_CASE("fp8 delayed scaling keeps its scale through a NaN amax until the NaN leaves the history") {
  for (const std::string algo : {"max", "most_recent"}) {
    INFO(algo);
    Float8ScalingOptions o;
    o.amax_history_len = 3;
    o.amax_compute_algo = algo;
    Float8Scale s(448.0f, o);
    s.scale_for(4.0f);
    s.update();
    CHECK(s.scale() == 112.0f);
    CHECK(s.scale_for(NAN) == 112.0f);
    CHECK(s.scale_for(1.0f) == 112.0f);  // a finite cast after the NaN in the same step
    CHECK(std::isnan(s.step_amax()));
    s.update();
    CHECK(s.scale() == 112.0f);
    CHECK(std::isnan(s.history().front()));
    // Steps of amax 1: under "max" the NaN stays in the history of 3 for two more updates.
    const std::vector<float> want = algo == "max" ? std::vector<float>{112.0f, 112.0f, 448.0f}
                                                  : std::vector<float>{448.0f, 448.0f, 448.0f};
    for (float w : want) {
      CHECK(s.scale_for(1.0f) > 0.0f);
      s.update();
      CHECK(s.scale() == w);
      CHECK(std::isfinite(s.scale()));
    }
  }
}

TEST_CASE("fp8 current scaling uses each tensor's own amax, keeping the last good scale") {
  Float8ScalingOptions o;
  o.delayed = false;
  Float8Scale s(57344.0f, o);
  CHECK(s.scale_for(4.0f) == 57344.0f / 4.0f);
  CHECK(s.scale_for(0.0f) == 57344.0f / 4.0f);  // an all-zero tensor keeps the scale
  CHECK(s.scale_for(NAN) == 57344.0f / 4.0f);
  CHECK(s.scale_for(0.5f) == 57344.0f / 0.5f);
  s.update();
  CHECK(s.history().empty());
  Float8Scale restored(57344.0f, o);
  restored.load_state(s.state());
  CHECK(restored.scale() == s.scale());
  Float8ScalingOptions delayed;
  delayed.amax_history_len = 8;
  CHECK_THROWS_AS(Float8Scale(448.0f, delayed).load_state(s.state()), StateError);
}

TEST_CASE("an fp8 linear equals the plain linear where its operands quantize exactly, backward too") {
  // Current scaling with amaxes that make power-of-two scales (448 / 7 = 64, 448 / 3.5 = 128,
  // 57344 / 1.75 = 32768), and values that stay e4m3 / e5m2 values when scaled.
  Float8LinearOptions o;
  o.scaling.delayed = false;
  o.lm_head = true;
  o.output_dtype = DType::Float32;
  auto linears = std::make_shared<Float8Linears>(o);
  auto layer = std::make_shared<nn::Linear>(4, 3);
  linears->bind(*layer);
  REQUIRE(linears->layer_names() == std::vector<std::string>{""});
  {
    NoGradGuard ng;
    layer->weight.copy_(from_vector(std::vector<float>{1, -2, 0.5f, 3.5f, 0.25f, 3, -1, 2, -3.5f, 1, 1.5f, -0.5f}, {3, 4}));
    layer->bias.copy_(from_vector(std::vector<float>{0.1f, -0.2f, 0.3f}, {3}));
  }
  Tensor x = from_vector(std::vector<float>{2, -1, 0.5f, 7, -3, 1, 4, 0.75f}, {2, 4}).requires_grad_();
  Tensor y8;
  {
    autocast::AutocastGuard guard(true, DType::BFloat16, nullptr, linears);
    y8 = layer->forward(x);
  }
  const Tensor y = linear(x, layer->weight, layer->bias);
  CHECK(y8.dtype() == DType::Float32);
  CHECK(doubles(y8) == doubles(y));
  const Tensor g = from_vector(std::vector<float>{1, -0.5f, 1.75f, 0.25f, -1.5f, 1}, {2, 3});
  y8.backward(g);
  const Tensor gx8 = x.grad().clone(), gw8 = layer->weight.grad().clone(), gb8 = layer->bias.grad().clone();
  x.set_grad(Tensor());
  layer->zero_grad();
  y.backward(g);
  CHECK(doubles(gx8) == doubles(x.grad()));
  CHECK(doubles(gw8) == doubles(layer->weight.grad()));
  CHECK(doubles(gb8) == doubles(layer->bias.grad()));
}

TEST_CASE("an fp8 linear computes the scaled GEMM of its quantized operands (float64 reference)") {
  Generator gen(7);
  const int64_t rows = 6, in = 20, out = 5;
  Float8LinearOptions o;
  o.lm_head = true;
  o.scaling.delayed = false;
  auto linears = std::make_shared<Float8Linears>(o);
  auto layer = std::make_shared<nn::Linear>(in, out, true, &gen);
  linears->bind(*layer);
  Tensor x = (randn({2, rows / 2, in}, &gen) * 3.0).requires_grad_();
  Tensor y;
  {
    autocast::AutocastGuard guard(true, DType::BFloat16, nullptr, linears);
    y = layer->forward(x);
  }
  REQUIRE(y.dtype() == DType::BFloat16);
  REQUIRE(y.shape() == Shape{2, rows / 2, out});
  // The reference quantizes with the same scales (current: 448 / amax) and multiplies in float64.
  const double amax_x = max(abs(x.detach())).item(), amax_w = max(abs(layer->weight.detach())).item();
  const float sx = 448.0f / float(amax_x), sw = 448.0f / float(amax_w);
  const std::vector<double> qx = doubles(to_float8(x.detach(), DType::Float8E4M3FN, sx, true));
  const std::vector<double> qw = doubles(to_float8(layer->weight.detach(), DType::Float8E4M3FN, sw, true));
  const std::vector<double> b = doubles(layer->bias), got = doubles(y);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < out; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < in; ++k) acc += qx[size_t(r * in + k)] * qw[size_t(j * in + k)];
      const double want = acc / (double(sx) * double(sw)) + b[size_t(j)];
      // float32 accumulation of 20 products, then one rounding to bfloat16.
      CHECK(got[size_t(r * out + j)] == Approx(want).epsilon(0x1p-8).margin(1e-3));
    }
  // Backward: the output gradient in e5m2 with its own scale (57344 / amax).
  const Tensor g = randn({2, rows / 2, out}, &gen).to(DType::BFloat16);
  y.backward(g);
  const float sg = 57344.0f / float(max(abs(g)).item());
  const std::vector<double> qg = doubles(to_float8(g, DType::Float8E5M2, sg, true));
  const std::vector<double> gx = doubles(x.grad()), gw = doubles(layer->weight.grad());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < in; ++k) {
      double acc = 0;
      for (int64_t j = 0; j < out; ++j) acc += qg[size_t(r * out + j)] * qw[size_t(j * in + k)];
      CHECK(gx[size_t(r * in + k)] == Approx(acc / (double(sg) * sw)).epsilon(1e-5).margin(1e-6));
    }
  for (int64_t j = 0; j < out; ++j)
    for (int64_t k = 0; k < in; ++k) {
      double acc = 0;
      for (int64_t r = 0; r < rows; ++r) acc += qg[size_t(r * out + j)] * qx[size_t(r * in + k)];
      CHECK(gw[size_t(j * in + k)] == Approx(acc / (double(sg) * sx)).epsilon(1e-5).margin(1e-6));
    }
}

TEST_CASE("fp8 chooses layers by path, size and lm_head, and refuses bad options") {
  nn::GPTConfig cfg;
  cfg.width = 32;
  cfg.layers = 2;
  cfg.heads = 2;
  cfg.context = 8;
  const nn::GPT gpt(cfg);
  auto names = [&](const Float8LinearOptions& o) {
    Float8Linears l(o);
    l.bind(gpt);
    return l.layer_names();
  };
  const std::vector<std::string> all_blocks{"blocks.0.attn.c_attn", "blocks.0.attn.c_proj", "blocks.0.mlp.c_fc",
                                            "blocks.0.mlp.c_proj",  "blocks.1.attn.c_attn", "blocks.1.attn.c_proj",
                                            "blocks.1.mlp.c_fc",    "blocks.1.mlp.c_proj"};
  const Float8LinearOptions defaults;
  CHECK(names(defaults) == all_blocks);
  Float8LinearOptions with_head;
  with_head.lm_head = true;
  CHECK(names(with_head).back() == "lm_head");
  Float8LinearOptions mlp_only;
  mlp_only.layers = {"*.mlp.*"};
  mlp_only.exclude = {"blocks.1.*"};
  CHECK(names(mlp_only) == std::vector<std::string>{"blocks.0.mlp.c_fc", "blocks.0.mlp.c_proj"});
  Float8LinearOptions big;
  big.min_size = 32 * 96;  // c_attn (32 x 96) and the mlp layers (32 x 128) only
  CHECK(names(big).size() == 6);

  CHECK_THROWS_WITH(create("fp8", {{"scaling", "just_in_time"}}), Catch::Contains("scaling"));
  CHECK_THROWS_WITH(create("fp8", {{"layers", "blocks"}}), Catch::Contains("list of module paths"));
  CHECK_THROWS_WITH(create("fp8", nlohmann::json{{"amax_history", 8}}), Catch::Contains("amax_history_len"));
}

TEST_CASE("fp8 trains a GPT through the strategy, and its scaling state round-trips") {
  nn::GPTConfig cfg;
  cfg.width = 32;
  cfg.layers = 1;
  cfg.heads = 2;
  cfg.context = 8;
  cfg.vocab_size = 16;
  auto run = [&](int steps, const MixedPrecisionState* resume, MixedPrecisionState* save) {
    auto model = std::make_shared<nn::GPT>(cfg, 3);
    std::shared_ptr<optim::Optimizer> opt = optim::make_optimizer({{"type", "adamw"}, {"lr", 1e-2}}, model->parameters());
    auto mp = create("fp8", {{"amax_history_len", 4}});
    Configured c = mp->configure(model, opt, [](const Tensor& logits, const Tensor& y) {
      return cross_entropy(logits.reshape({-1, 16}), y.reshape({-1}));
    });
    if (resume) mp->load_state_dict(*resume);
    Generator gen(11);
    std::vector<double> losses;
    for (int s = 0; s < steps; ++s) {
      const Tensor idx = randint(0, 16, {4, 8}, &gen);
      c.optimizer->zero_grad();
      const Tensor loss = c.criterion(c.model->forward(idx), idx);
      losses.push_back(loss.item());
      mp->backward(loss, *c.optimizer);
      mp->step(*c.optimizer);
    }
    if (save) *save = mp->state_dict();
    return losses;
  };
  MixedPrecisionState state;
  const std::vector<double> losses = run(12, nullptr, &state);
  CHECK(losses.back() < losses.front() * 0.8);  // it learns (the targets are the inputs)
  CHECK(state.meta["float8_layers"].size() == 4);
  CHECK(state.tensors.count("float8.blocks.0.mlp.c_fc.grad_output") == 1);
  // The saved scales are the ones the history gives: not the initial 1.
  CHECK(state.tensors.at("float8.blocks.0.mlp.c_fc.input").to_vector<float>()[0] != 1.0f);
  MixedPrecisionState empty;
  CHECK_THROWS_AS(run(0, &empty, nullptr), StateError);
  MixedPrecisionState wrong = state;
  wrong.tensors["float8.blocks.0.mlp.c_fc.input"] = zeros({3});
  CHECK_THROWS_AS(run(0, &wrong, nullptr), StateError);
}

TEST_CASE("fp8 layers recomputed under activation checkpointing give the gradients of the first forward") {
  nn::GPTConfig cfg;
  cfg.width = 32;
  cfg.layers = 2;
  cfg.heads = 2;
  cfg.context = 8;
  cfg.vocab_size = 16;
  std::vector<std::vector<double>> grads_of_run;
  for (const bool checkpointing : {false, true}) {
    cfg.activation_checkpointing = checkpointing;
    auto model = std::make_shared<nn::GPT>(cfg, 5);
    Float8LinearOptions o;
    o.scaling.delayed = false;  // current: the recomputation measures the same amaxes again
    auto linears = std::make_shared<Float8Linears>(o);
    linears->bind(*model);
    Generator gen(3);
    const Tensor idx = randint(0, 16, {2, 8}, &gen);
    Tensor loss;
    {
      autocast::AutocastGuard guard(true, DType::BFloat16, nullptr, linears);
      loss = cross_entropy(model->forward(idx).reshape({-1, 16}).to(DType::Float32), idx.reshape({-1}));
    }
    loss.backward();
    std::vector<double> all;
    for (const auto& [name, p] : model->named_parameters()) {
      const std::vector<double> g = doubles(p.grad());
      all.insert(all.end(), g.begin(), g.end());
    }
    grads_of_run.push_back(all);
  }
  CHECK(grads_of_run[0] == grads_of_run[1]);
}

TEST_CASE("float8_mm is the scaled product of its float8 operands, and refuses what it cannot take") {
  Generator gen(12);
  const Tensor a32 = randn({7, 24}, &gen) * 5.0, b32 = randn({9, 24}, &gen) * 0.1;
  const float sa = 448.0f / float(max(abs(a32)).item()), sb = 57344.0f / float(max(abs(b32)).item());
  const Tensor a = to_float8(a32, DType::Float8E4M3FN, sa, true), b = to_float8(b32, DType::Float8E5M2, sb, true);
  testing::check_float8_mm(a, b, sa, sb, DType::Float32);
  testing::check_float8_mm(a, b, sa, sb, DType::BFloat16);
  testing::check_float8_mm(b.narrow(0, 0, 7), a.narrow(0, 0, 7), sb, sa, DType::Float32);  // e5m2 x e4m3

  CHECK_THROWS_AS(float8_mm(b, b, sb, sb), DTypeError);  // two e5m2 operands
  CHECK_THROWS_AS(float8_mm(a32, a, 1.0f, sa), DTypeError);
  CHECK_THROWS_AS(float8_mm(a, a.narrow(1, 0, 16), sa, sa), ShapeError);
  CHECK_THROWS_AS(float8_mm(a, a, 0.0f, sa), ValueError);
  CHECK_THROWS_AS(float8_mm(a, a, sa, sa, DType::Float16), DTypeError);
}
