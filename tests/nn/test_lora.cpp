// LoRA adapters (booster/nn/lora.h): with B = 0 an adapted model is its base bit for bit; the forward
// and the gradients of A, B and the input equal a float64 computation of y = W x + b + s B A x written
// here (not the library's code), for alpha / r and rsLoRA's alpha / sqrt(r); the base is frozen and
// only A and B change through training under the single, ddp and low_level_zero (stages 1, 2, 3) plugins
// and under bf16 autocast; names, refusals and Booster::enable_lora's place before boost(); under the
// 16-bit strategies and ZeRO the base keeps the strategy's dtype and gets no master, gradient or optimizer
// state; boost() refuses an optimizer holding the base; the base digest of adapter-only checkpoints.
#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "booster/booster/booster.h"
#include "booster/nn/container.h"
#include "booster/nn/linear.h"
#include "booster/nn/llama.h"
#include "booster/nn/lora.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/grad_mode.h"

using namespace booster;
using Catch::Contains;
using nlohmann::json;

namespace {

std::shared_ptr<nn::Llama> tiny_llama(uint64_t seed = 5) {
  nn::LlamaConfig c;
  c.vocab_size = 19;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 24;
  return std::make_shared<nn::Llama>(c, seed);
}

Tensor loss_of(const Tensor& logits, const Tensor& y) {
  return cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
}

std::vector<double> values(const Tensor& t) { return t.to(DType::Float64).tolist(); }

// Row-major [m, k] x [k, n] in float64.
std::vector<double> matmul(const std::vector<double>& a, const std::vector<double>& b, int64_t m, int64_t k, int64_t n) {
  std::vector<double> c(size_t(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < k; ++p)
      for (int64_t j = 0; j < n; ++j) c[size_t(i * n + j)] += a[size_t(i * k + p)] * b[size_t(p * n + j)];
  return c;
}
std::vector<double> transpose(const std::vector<double>& a, int64_t rows, int64_t cols) {
  std::vector<double> t(a.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) t[size_t(j * rows + i)] = a[size_t(i * cols + j)];
  return t;
}
double max_rel(const std::vector<double>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  double scale = 0, m = 0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (size_t i = 0; i < got.size(); ++i) m = std::max(m, std::abs(got[i] - want[i]));
  return m / std::max(scale, 1e-30);
}

}  // namespace

TEST_CASE("lora: with B zero the adapted model is the base bit for bit, and only the adapters train",
          "[lora][nn]") {
  auto base = tiny_llama(), adapted = tiny_llama();
  const std::vector<std::string> paths = nn::apply_lora(*adapted, {.r = 4, .alpha = 8, .target_modules = {"q_proj", "v_proj"}});
  CHECK(paths == std::vector<std::string>{"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
                                          "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"});
  const Tensor ids = from_vector(std::vector<int64_t>{1, 5, 2, 16, 3, 3, 9, 0}, {2, 4});
  {
    NoGradGuard no_grad;
    CHECK(values((*adapted)(ids)) == values((*base)(ids)));
  }
  std::map<std::string, Tensor> params;
  for (const auto& [n, p] : adapted->named_parameters()) params[n] = p;
  REQUIRE(params.count("model.layers.0.self_attn.q_proj.lora_A.weight"));
  CHECK(params.at("model.layers.0.self_attn.q_proj.lora_A.weight").shape() == Shape{4, 16});
  CHECK(params.at("model.layers.1.self_attn.v_proj.lora_B.weight").shape() == Shape{8, 4});  // 2 kv heads x 4
  const std::vector<Tensor> trainable = nn::trainable_parameters(*adapted);
  CHECK(trainable.size() == 8);
  for (const Tensor& t : trainable) CHECK(t.name().find(".lora_") != std::string::npos);
  // A drawn as a Linear's default: within +-1/sqrt(in).
  for (double a : values(params.at("model.layers.0.self_attn.q_proj.lora_A.weight"))) CHECK(std::abs(a) <= 0.25);
  CHECK(values(params.at("model.layers.0.self_attn.q_proj.lora_B.weight")) == std::vector<double>(64, 0.0));  // [16, 4]

  // Refusals: twice, no matching layer (naming those there are), bad settings.
  CHECK_THROWS_AS(nn::apply_lora(*adapted, {}), StateError);
  CHECK_THROWS_WITH(nn::apply_lora(*tiny_llama(), {.target_modules = {"query"}}),
                    Contains("q_proj") && Contains("o_proj") && Contains("target_modules"));
  CHECK_THROWS_AS(nn::apply_lora(*tiny_llama(), {.r = 0}), ValueError);
  CHECK_THROWS_AS(nn::apply_lora(*tiny_llama(), {.alpha = 0}), ValueError);
  CHECK_THROWS_AS(nn::apply_lora(*tiny_llama(), {.dropout = 1.0}), ValueError);
}

TEST_CASE("lora: forward and gradients equal W x + b + s B A x computed in float64", "[lora][nn]") {
  for (bool rslora : {false, true}) {
    INFO("use_rslora " << rslora);
    const int64_t in = 7, out = 5, rows = 3, r = 2;
    const double alpha = 3.0, s = rslora ? alpha / std::sqrt(2.0) : alpha / 2.0;
    auto holder = std::make_shared<nn::Sequential>();
    Generator gen(9);
    auto layer = std::make_shared<nn::Linear>(in, out, true, &gen);
    holder->push_back(layer);
    nn::apply_lora(*holder, {.r = r, .alpha = alpha, .target_modules = {"0"}, .use_rslora = rslora});
    Tensor A, B;
    for (const auto& [n, p] : holder->named_parameters()) {
      if (n == "0.lora_A.weight") A = p;
      if (n == "0.lora_B.weight") B = p;
    }
    REQUIRE(A.defined());
    REQUIRE(B.defined());
    {
      NoGradGuard no_grad;
      Generator g(3);
      B.copy_(randn({out, r}, &g));  // a trained B: the adapter's path is not zero
    }
    Generator g(4);
    Tensor x = randn({rows, in}, &g).requires_grad_(true);
    const Tensor upstream = randn({rows, out}, &g);
    const Tensor y = (*holder)(x);
    sum(y * upstream).backward();

    const std::vector<double> X = values(x), W = values(layer->weight), b = values(layer->bias), a = values(A),
                              bb = values(B), G = values(upstream);
    // y = X W^T + b + s (X A^T) B^T
    const std::vector<double> XA = matmul(X, transpose(a, r, in), rows, in, r);
    std::vector<double> want = matmul(X, transpose(W, out, in), rows, in, out);
    const std::vector<double> low = matmul(XA, transpose(bb, out, r), rows, r, out);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < out; ++j) want[size_t(i * out + j)] += b[size_t(j)] + s * low[size_t(i * out + j)];
    // float32 arithmetic over sums of at most 7 terms: a few ulps of the largest value.
    const double bound = 16 * std::ldexp(1.0, -24);
    CHECK(max_rel(values(y), want) <= bound);
    // dB = s G^T (X A^T), dA = s (G B)^T X, dX = G W + s (G B) A.
    std::vector<double> dB = matmul(transpose(G, rows, out), XA, out, rows, r);
    for (double& v : dB) v *= s;
    const std::vector<double> GB = matmul(G, bb, rows, out, r);
    std::vector<double> dA = matmul(transpose(GB, rows, r), X, r, rows, in);
    for (double& v : dA) v *= s;
    std::vector<double> dX = matmul(G, W, rows, out, in);
    const std::vector<double> GBA = matmul(GB, a, rows, r, in);
    for (size_t i = 0; i < dX.size(); ++i) dX[i] += s * GBA[i];
    CHECK(max_rel(values(B.grad()), dB) <= bound);
    CHECK(max_rel(values(A.grad()), dA) <= bound);
    CHECK(max_rel(values(x.grad()), dX) <= bound);
    CHECK(!layer->weight.grad().defined());  // frozen
    CHECK(!layer->bias.grad().defined());
  }
}

TEST_CASE("lora: through the Booster only the adapters change, under every data-parallel plugin",
          "[lora][booster]") {
  auto zero = [](int stage, const std::string& precision) {
    return BoosterConfig{.plugin = "low_level_zero", .plugin_options = {{"stage", stage}, {"precision", precision}}};
  };
  const std::vector<std::pair<std::string, BoosterConfig>> setups = {
      {"single", BoosterConfig{}},
      {"single bf16", BoosterConfig{.mixed_precision = "bf16"}},
      {"ddp", BoosterConfig{.plugin = "ddp"}},
      {"low_level_zero 1", zero(1, "fp32")},
      {"low_level_zero 2", zero(2, "fp32")},
      {"low_level_zero 3", zero(3, "fp32")}};
  // The reference: the single plugin, float32.
  std::map<std::string, std::vector<double>> reference;
  for (const auto& [label, config] : setups) {
    INFO(label);
    Booster booster(config);
    auto model = tiny_llama();
    std::map<std::string, std::vector<double>> before;
    for (const auto& [n, p] : model->named_parameters()) before[n] = values(p);
    const std::vector<std::string> adapted =
        booster.enable_lora(model, {.r = 4, .alpha = 8, .target_modules = {"q_proj", "v_proj", "down_proj"}});
    CHECK(adapted.size() == 6);
    std::shared_ptr<optim::Optimizer> adamw =
        optim::make_optimizer({{"type", "adamw"}, {"lr", 1e-2}}, nn::trainable_parameters(*model));
    Boosted b = booster.boost(model, adamw, loss_of);
    CHECK_THROWS_AS(booster.enable_lora(model, {}), StateError);
    Generator data(2);
    for (int step = 0; step < 3; ++step) {
      const Tensor x = randint(0, 19, {2, 6}, &data), y = randint(0, 19, {2, 6}, &data);
      b.optimizer->zero_grad();
      booster.backward(b.criterion((*b.model)(x), y), *b.optimizer);
      b.optimizer->step();
    }
    booster.plugin().with_full_parameters([&] {
      for (const auto& [n, p] : b.model->named_parameters()) {
        INFO(n);
        const bool adapter = n.find(".lora_") != std::string::npos;
        if (!adapter) {
          REQUIRE(before.count(n));
          // Frozen: the base weights are untouched (under bf16 autocast they stay float32 too).
          CHECK(values(p) == before.at(n));
          continue;
        }
        if (n.find("lora_B") != std::string::npos) CHECK(values(p) != std::vector<double>(values(p).size(), 0.0));
        if (label == "single") {
          reference[n] = values(p);
        } else if (label != "single bf16") {
          // One process: the same float32 arithmetic, flat buffers apart.
          REQUIRE(reference.count(n));
          CHECK(max_rel(values(p), reference.at(n)) <= 1e-5);
        }
      }
    });
  }
  // Only the Llama's and the GPT's shard policies split adapters (tests/mpi/test_mpi_lora_hybrid.cpp): an
  // MLP classifier is refused.
  Booster split(BoosterConfig{.plugin = "hybrid_parallel", .plugin_options = {{"tp_size", 2}}});
  CHECK_THROWS_WITH(split.enable_lora(std::make_shared<nn::MLPClassifier>(8, std::vector<int64_t>{4}, 2),
                                      {.target_modules = {"layers"}}),
                    Contains("use ddp or low_level_zero"));
}

TEST_CASE("lora: the strategies keep masters and optimizer state of the adapters only, the base in their dtype",
          "[lora][booster][amp]") {
  const std::vector<std::pair<std::string, BoosterConfig>> setups = {
      {"bf16 pure", BoosterConfig{.mixed_precision = "bf16", .mixed_precision_options = {{"pure", true}}}},
      {"fp16_naive", BoosterConfig{.mixed_precision = "fp16_naive"}},
      {"apex O2", BoosterConfig{.mixed_precision = "fp16_apex", .mixed_precision_options = {{"opt_level", "O2"}}}},
      {"apex O3", BoosterConfig{.mixed_precision = "fp16_apex", .mixed_precision_options = {{"opt_level", "O3"}}}},
      {"zero 2 bf16", BoosterConfig{.plugin = "low_level_zero", .plugin_options = {{"stage", 2}, {"precision", "bf16"}}}}};
  for (const auto& [label, config] : setups) {
    INFO(label);
    Booster booster(config);
    auto model = tiny_llama();
    booster.enable_lora(model, {.r = 2, .alpha = 4, .target_modules = {"q_proj", "v_proj"}});
    const size_t adapters = nn::trainable_parameters(*model).size();
    REQUIRE(adapters == 8);
    Boosted b = booster.boost(
        model, optim::make_optimizer({{"type", "adam"}, {"lr", 1e-3}}, nn::trainable_parameters(*model)), loss_of);
    Generator data(2);
    const Tensor x = randint(0, 19, {2, 6}, &data), y = randint(0, 19, {2, 6}, &data);
    b.optimizer->zero_grad();
    booster.backward(b.criterion((*b.model)(x), y), *b.optimizer);
    b.optimizer->step();
    // The stepped optimizer's parameters and state: the adapters alone.
    const optim::Optimizer& stepped = b.optimizer->stepped_optimizer();
    size_t held = 0;
    for (const optim::ParamGroup& g : stepped.param_groups()) held += g.params.size();
    CHECK(held == adapters);
    for (const auto& [key, t] : stepped.state_dict().tensors) {
      size_t i = 0;
      std::string name;
      REQUIRE(optim::parse_state_key(key, i, name));
      CHECK(i < adapters);
    }
    // Float32 masters (the strategy's or ZeRO's): one per adapter, none of the base (apex O3 keeps none).
    size_t masters = 0;
    for (const auto& [key, t] : booster.precision().state_dict().tensors) masters += key.rfind("master_weights.", 0) == 0;
    for (const auto& [key, t] : stepped.state_dict().tensors) masters += key.find(optim::kMasterWeight) != std::string::npos;
    CHECK(masters == (label == "apex O3" ? 0 : adapters));
    // The base stays in the strategy's 16-bit storage, with no gradient.
    for (const auto& [n, p] : model->named_parameters()) {
      INFO(n);
      if (p.requires_grad()) continue;
      if (n.find("norm") == std::string::npos) CHECK(p.dtype() != DType::Float32);
      CHECK_FALSE(p.grad().defined());
    }
  }
}

TEST_CASE("lora: boost refuses an optimizer that holds the frozen base", "[lora][booster]") {
  Booster booster(BoosterConfig{});
  auto model = tiny_llama();
  booster.enable_lora(model, {});
  std::shared_ptr<optim::Optimizer> all = optim::make_optimizer({{"type", "sgd"}, {"lr", 0.1}}, model->parameters());
  CHECK_THROWS_WITH(booster.boost(model, all, loss_of),
                    Contains("a frozen base weight") && Contains("nn::trainable_parameters"));
}

TEST_CASE("lora: the base digest names the frozen weights' bytes, and not the adapters'", "[lora][booster]") {
  auto a = tiny_llama(), b = tiny_llama(), c = tiny_llama();
  nn::apply_lora(*a, {.seed = 1});
  nn::apply_lora(*b, {.seed = 2});  // other adapters, the same base
  nn::apply_lora(*c, {.seed = 1});
  const std::string digest = Booster::base_digest(*a);
  CHECK(digest.size() == 16);
  CHECK(Booster::base_digest(*b) == digest);
  {
    NoGradGuard no_grad;
    Tensor w = c->named_parameters().front().second;  // the embedding: one element changed by one ulp
    float* first = w.data<float>();
    first[0] = std::nextafter(first[0], 1.0f);
  }
  CHECK(Booster::base_digest(*c) != digest);
}
