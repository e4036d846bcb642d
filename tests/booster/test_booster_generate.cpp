// What boost() returns for a decoder generates (nn::generate) under every precision strategy and the
// single-process plugins, its cached forward running under the strategy's autocast and casts: greedy
// tokens through the key/value cache equal those of recomputing the whole sequence through the same
// boosted model's forward, and where the strategy computes in float32 they equal the unboosted
// model's. ZeRO-3 on one rank, with tied embeddings (a GPT-2 and a tied Llama: lm_head reads the
// embedding's weight, Note [ZeRO-3: tied parameters]), trains as the single plugin does and generates.
// Booster::save_pretrained writes, under each plugin and strategy, a directory that loads back as the
// trained model, bit for bit, in the dtype it trained in.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "booster/booster/booster.h"
#include "booster/nn/generate.h"
#include "booster/nn/hf.h"
#include "booster/nn/llama.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/grad_mode.h"

using namespace booster;
using Catch::Contains;
using nlohmann::json;

namespace {

// Weights scaled up from the 0.02 init, so logits spread over several units and greedy choices are not
// near-ties that a 16-bit strategy's roundoff could flip between the cached and the full forward.
void sharpen(nn::Module& model, double factor) {
  NoGradGuard no_grad;
  for (Tensor& p : model.parameters())
    if (p.dim() >= 2) p.mul_(factor);
}

std::shared_ptr<nn::Module> tiny_llama(bool tied) {
  nn::LlamaConfig c;
  c.vocab_size = 19;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 24;
  c.rope_theta = 100.0;
  c.tie_word_embeddings = tied;
  auto m = std::make_shared<nn::Llama>(c, 5);
  sharpen(*m, 10.0);
  return m;
}

std::shared_ptr<nn::Module> tiny_gpt2() {  // tied, as every GPT-2 from the hub
  nn::GPTConfig c;
  c.vocab_size = 17;
  c.context = 24;
  c.width = 16;
  c.layers = 2;
  c.heads = 2;
  c.tie_word_embeddings = true;
  auto m = std::make_shared<nn::GPT>(c, 3);
  sharpen(*m, 10.0);
  return m;
}

struct ModelCase {
  std::string name;
  std::function<std::shared_ptr<nn::Module>()> make;
};
const std::vector<ModelCase>& models() {
  static const std::vector<ModelCase> m = {{"llama", [] { return tiny_llama(false); }},
                                           {"tied llama", [] { return tiny_llama(true); }},
                                           {"tied gpt-2", tiny_gpt2}};
  return m;
}

struct StrategyCase {
  std::string name;
  BoosterConfig config;
  bool float32 = false;  // computes in float32: the tokens are the unboosted model's
};

std::vector<StrategyCase> strategies() {
  auto zero = [](int stage, const std::string& precision) {
    return BoosterConfig{.plugin = "low_level_zero", .plugin_options = {{"stage", stage}, {"precision", precision}}};
  };
  return {{"fp32", BoosterConfig{}, true},
          {"fp16", BoosterConfig{.mixed_precision = "fp16"}},
          {"bf16", BoosterConfig{.mixed_precision = "bf16"}},
          {"fp16_naive", BoosterConfig{.mixed_precision = "fp16_naive"}},
          {"fp16_apex O2", BoosterConfig{.mixed_precision = "fp16_apex", .mixed_precision_options = {{"opt_level", "O2"}}}},
          {"ddp", BoosterConfig{.plugin = "ddp"}, true},
          {"ddp fp16", BoosterConfig{.mixed_precision = "fp16", .plugin = "ddp"}},
          {"low_level_zero stage 1", zero(1, "fp32"), true},
          {"low_level_zero stage 3", zero(3, "fp32"), true},
          {"low_level_zero stage 3 bf16", zero(3, "bf16")},
          {"hybrid_parallel tp 1 pp 1", BoosterConfig{.plugin = "hybrid_parallel"}, true}};
}

const std::vector<int64_t> kPrompt = {1, 5, 2, 16, 3};

Boosted boost_for_generation(Booster& booster, const std::shared_ptr<nn::Module>& model) {
  std::shared_ptr<optim::Optimizer> opt = optim::make_optimizer({{"type", "adamw"}, {"lr", 1e-3}}, model->parameters());
  return booster.boost(model, opt);
}

Tensor loss_of(const Tensor& logits, const Tensor& y) {
  return cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
}

}  // namespace

TEST_CASE("generate after boost: every strategy's cached tokens equal its recomputed ones", "[generate][booster]") {
  for (const ModelCase& m : models()) {
    std::vector<int64_t> plain;
    {
      auto model = m.make();
      plain = nn::generate(*model, kPrompt, {.max_new_tokens = 14, .temperature = 0.0}).tokens;
    }
    for (const StrategyCase& s : strategies()) {
      INFO(m.name << " under " << s.name);
      Booster booster(s.config);
      Boosted b = boost_for_generation(booster, m.make());
      const nn::GenerateResult cached = nn::generate(*b.model, kPrompt, {.max_new_tokens = 14, .temperature = 0.0});
      const nn::GenerateResult full =
          nn::generate(*b.model, kPrompt, {.max_new_tokens = 14, .temperature = 0.0, .use_cache = false});
      CHECK(cached.tokens.size() == 14);
      CHECK(cached.tokens == full.tokens);
      if (s.float32) CHECK(cached.tokens == plain);
      // The model is left as it was: a training step still runs (ZeRO-3 released what generation gathered).
      const Tensor x = from_vector(std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8}, {2, 4});
      b.optimizer->zero_grad();
      const Tensor loss = loss_of((*b.model)(x), x);
      booster.backward(loss, *b.optimizer);
      b.optimizer->step();
      CHECK(std::isfinite(loss.item()));
    }
  }
}

TEST_CASE("generate after boost: a model that is no decoder is refused without contradicting itself",
          "[generate][booster][errors]") {
  Booster booster(BoosterConfig{.mixed_precision = "bf16"});
  auto mlp = std::make_shared<nn::MLPClassifier>(8, std::vector<int64_t>{6}, 3, "relu", 1);
  Boosted b = booster.boost(mlp, optim::make_optimizer({{"type", "sgd"}, {"lr", 0.1}}, mlp->parameters()));
  CHECK_THROWS_AS(nn::generate(*b.model, {1, 2}), IncompatibleError);
  CHECK_THROWS_WITH(nn::generate(*b.model, {1, 2}),
                    Contains("has no key/value-cache forward") && Contains("nn::CausalLM"));
}

// Note [ZeRO-3: tied parameters]: before it, step 1 of a tied model under stage 3 threw "a tensor's
// memory is released" (lm_head read the embedding's weight after the embedding released it).
TEST_CASE("zero stage 3 on one rank trains tied models as the single plugin does", "[zero][booster][llama]") {
  for (const ModelCase& m : models()) {
    INFO(m.name);
    const json sgd = {{"type", "sgd"}, {"lr", 0.05}, {"momentum", 0.9}};
    Booster single(BoosterConfig{});
    auto model_a = m.make();
    Boosted a = single.boost(model_a, optim::make_optimizer(sgd, model_a->parameters()), loss_of);
    Booster zero3(BoosterConfig{.plugin = "low_level_zero", .plugin_options = {{"stage", 3}, {"precision", "fp32"}}});
    auto model_b = m.make();
    Boosted b = zero3.boost(model_b, optim::make_optimizer(sgd, model_b->parameters()), loss_of);
    Generator data(11);
    for (int step = 0; step < 4; ++step) {
      const Tensor x = randint(0, 17, {3, 8}, &data), y = randint(0, 17, {3, 8}, &data);
      a.optimizer->zero_grad();
      const Tensor la = a.criterion((*a.model)(x), y);
      single.backward(la, *a.optimizer);
      a.optimizer->step();
      b.optimizer->zero_grad();
      const Tensor lb = b.criterion((*b.model)(x), y);
      zero3.backward(lb, *b.optimizer);
      b.optimizer->step();
      INFO("step " << step << ": " << la.item() << " against " << lb.item());
      // One rank: the same float32 arithmetic on flat shards instead of the parameters (the tied
      // gradient is the same two terms summed in the same order), so the same values up to a few ulps.
      CHECK(std::abs(la.item() - lb.item()) <= 1e-6 * std::abs(la.item()));
    }
    // The weights after the steps, the tied one included (read whole through the plugin).
    std::map<std::string, Tensor> want;
    for (const auto& [n, p] : model_a->named_parameters()) want[n] = p.detach().clone();
    zero3.plugin().with_full_parameters([&] {
      for (const auto& [n, p] : b.model->named_parameters()) {
        INFO(n);
        REQUIRE(want.count(n));
        double worst = 0;
        const std::vector<double> got = p.tolist(), ref = want.at(n).tolist();
        for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - ref[i]) / (1 + std::abs(ref[i])));
        CHECK(worst <= 1e-5);
      }
    });
  }
}

TEST_CASE("save_pretrained from a loop writes the trained model under every plugin and strategy",
          "[booster][hf]") {
  const std::filesystem::path root = std::filesystem::temp_directory_path() /
                                     ("booster_test_save_pretrained_" + std::to_string(::getpid()));
  for (const ModelCase& m : models()) {
    for (const StrategyCase& s : strategies()) {
      INFO(m.name << " under " << s.name);
      Booster booster(s.config);
      Boosted b = boost_for_generation(booster, m.make());
      const Tensor x = from_vector(std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8}, {2, 4});
      for (int step = 0; step < 2; ++step) {
        b.optimizer->zero_grad();
        booster.backward(loss_of((*b.model)(x), x), *b.optimizer);
        b.optimizer->step();
      }
      const std::filesystem::path dir = root / "out";
      std::filesystem::remove_all(dir);
      booster.save_pretrained(dir);
      CHECK(!std::filesystem::exists(dir.string() + ".booster-weights"));
      const nn::ModulePtr loaded = nn::load_pretrained(dir);
      std::map<std::string, Tensor> got;
      for (const auto& [n, p] : loaded->named_parameters()) got[n] = p;
      booster.plugin().with_full_parameters([&] {
        const auto trained = b.model->named_parameters();
        CHECK(trained.size() == got.size());
        for (const auto& [n, p] : trained) {
          INFO(n);
          REQUIRE(got.count(n));
          // load_pretrained reads into float32: a 16-bit model's values are exactly representable.
          CHECK(p.to(DType::Float32).tolist() == got.at(n).tolist());
        }
      });
      const json config = json::parse(std::ifstream(dir / "config.json"));
      const DType trained_dtype = b.model->parameters().front().dtype();
      CHECK(config.at("torch_dtype") == (trained_dtype == DType::BFloat16  ? "bfloat16"
                                         : trained_dtype == DType::Float16 ? "float16"
                                                                            : "float32"));
    }
  }
  std::filesystem::remove_all(root);
  Booster unboosted(BoosterConfig{});
  CHECK_THROWS_AS(unboosted.save_pretrained(root), StateError);
}
