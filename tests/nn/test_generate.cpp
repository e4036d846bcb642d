// Generation (booster/nn/generate.h) and the key/value cache under it (booster/nn/kv_cache.h): greedy
// tokens with the cache equal those of recomputing the whole prefix every step, for a GPT and a
// grouped-query Llama; the cached logits equal the full forward's within float32 roundoff, for a
// prefill, a chunk after a prefix and single steps; a tiny Llama's greedy tokens equal a PyTorch
// reference (tests/fixtures/make_generate_fixtures.py); the sampling rules (greedy ties, top-k, top-p,
// seeds) on hand-made distributions; the option checks; the cache's growth; the same on CUDA.
#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <set>

#include "cuda_skip.h"
#include "fixture.h"
#include "llama_fixture.h"

#include "booster/nn/generate.h"
#include "booster/nn/kv_cache.h"
#include "booster/nn/llama.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/tensor/grad_mode.h"

using namespace booster;
using Catch::Contains;
using json = nlohmann::json;

namespace {

// Weights scaled up from the 0.02 init, so logits spread over several units and greedy choices are not
// near-ties that roundoff could flip.
void sharpen(nn::Module& model, double factor) {
  NoGradGuard no_grad;
  for (Tensor& p : model.parameters())
    if (p.dim() >= 2) p.mul_(factor);
}

std::shared_ptr<nn::GPT> tiny_gpt() {
  nn::GPTConfig c;
  c.vocab_size = 17;
  c.context = 24;
  c.width = 16;
  c.layers = 2;
  c.heads = 2;
  auto m = std::make_shared<nn::GPT>(c, 3);
  sharpen(*m, 25.0);
  return m;
}

std::shared_ptr<nn::Llama> tiny_llama(int64_t kv_heads = 2) {
  nn::LlamaConfig c;
  c.vocab_size = 19;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = kv_heads;
  c.max_position_embeddings = 24;
  c.rope_theta = 100.0;  // large angles within 24 positions: a wrong position shows
  auto m = std::make_shared<nn::Llama>(c, 5);
  sharpen(*m, 25.0);
  return m;
}

double max_abs(const Tensor& t) {
  double m = 0.0;
  for (double v : t.tolist()) m = std::max(m, std::abs(v));
  return m;
}

Tensor ids(const std::vector<int64_t>& v) { return from_vector(v, {1, int64_t(v.size())}); }

// Note [Cached logits tolerance]
// The cached forward computes the same formulas as the full one in float32 with other summation orders:
// GEMMs of 1 or a few rows instead of T (OpenBLAS picks other kernels and blockings), attention of one
// query against all keys with the grouped heads folded into the query length, or matmul + mask +
// softmax for a chunk, instead of the fused causal kernel. As in Note [Llama fixture tolerance]
// (test_llama.cpp): two orders of a sum of K terms differ by about sqrt(K) u of the terms' magnitudes
// (u = 2^-24); a logit passes 2 L + 1 = 5 such reductions in series, the norms bringing activations back
// to about 1 before each, so the relative errors add: with K = 24 (the longest reduction: the MLP's, and
// the 24 keys) 5 sqrt(24) u = 1.5e-6 of the largest logit; 4 ulps per stage are allowed, 5.8e-6.
// (Measured: 0, bit for bit, at these sizes on this machine; the bound is for other BLAS builds and ISAs.)
double cached_bound(const Tensor& reference) { return 4.0 * 5.0 * std::sqrt(24.0) * std::ldexp(1.0, -24) * max_abs(reference); }

// The model's logits for `seq` in one forward, against prefill + a chunk + single steps through a cache.
void check_cached_logits(nn::Module& model, const std::vector<int64_t>& seq) {
  auto& lm = dynamic_cast<nn::CausalLM&>(model);
  NoGradGuard no_grad;
  model.eval();
  const int64_t T = int64_t(seq.size());
  const Tensor full = model(ids(seq));  // [1, T, V]
  nn::KVCache cache = lm.make_kv_cache(T);
  std::vector<Tensor> pieces;
  const int64_t prefill = 5, chunk = 4;  // positions 0..4 (causal from 0), 5..8 (masked chunk), then one by one
  pieces.push_back(lm.forward_cached(ids({seq.begin(), seq.begin() + prefill}), cache));
  pieces.push_back(lm.forward_cached(ids({seq.begin() + prefill, seq.begin() + prefill + chunk}), cache));
  for (int64_t t = prefill + chunk; t < T; ++t) pieces.push_back(lm.forward_cached(ids({seq[size_t(t)]}), cache));
  CHECK(cache.length() == T);
  const Tensor cached = cat(pieces, 1);
  REQUIRE(cached.shape() == full.shape());
  const double bound = cached_bound(full), diff = booster::testing::max_abs_diff(cached, full);
  INFO(model.name() << ": max |cached - full| = " << diff << ", bound " << bound);
  CHECK(diff <= bound);
  // The last position alone: what a generation step computes.
  const double last = booster::testing::max_abs_diff(cached.select(1, T - 1), full.select(1, T - 1));
  CHECK(last <= bound);
}

const json& fixtures() {
  static const json j = booster::testing::load_fixture_json("generate.json");
  return j;
}


}  // namespace

TEST_CASE("generate: cached logits equal the full forward's within float32 roundoff", "[generate][nn]") {
  const std::vector<int64_t> seq = {1, 5, 2, 16, 3, 3, 9, 0, 11, 7, 4, 12, 15, 8};
  SECTION("GPT") { check_cached_logits(*tiny_gpt(), seq); }
  SECTION("Llama, grouped-query") { check_cached_logits(*tiny_llama(2), seq); }
  SECTION("Llama, multi-query") { check_cached_logits(*tiny_llama(1), seq); }
  SECTION("Llama, one key/value head per query head") { check_cached_logits(*tiny_llama(4), seq); }
}

TEST_CASE("generate: greedy tokens with the cache equal recomputing the prefix, token for token", "[generate][nn]") {
  std::vector<std::pair<std::string, std::shared_ptr<nn::Module>>> models = {{"gpt", tiny_gpt()},
                                                                              {"llama gqa", tiny_llama(2)}};
  for (auto& [name, model] : models) {
    INFO(name);
    nn::GenerateOptions o{.max_new_tokens = 18, .temperature = 0.0};
    const nn::GenerateResult cached = nn::generate(*model, {1, 2, 3}, o);
    o.use_cache = false;
    const nn::GenerateResult plain = nn::generate(*model, {1, 2, 3}, o);
    CHECK(cached.tokens.size() == 18);
    CHECK(cached.tokens == plain.tokens);
    CHECK(cached.stop_reason == nn::StopReason::MaxNewTokens);
    // Not a constant sequence: the test would not see a wrong position otherwise.
    CHECK(std::set<int64_t>(cached.tokens.begin(), cached.tokens.end()).size() > 2);
    // Sampling reads the same logits: equal draws, equal tokens.
    o = {.max_new_tokens = 18, .temperature = 0.9, .top_k = 8, .top_p = 0.9, .seed = 11};
    const nn::GenerateResult sampled_cached = nn::generate(*model, {4}, o);
    o.use_cache = false;
    CHECK(nn::generate(*model, {4}, o).tokens == sampled_cached.tokens);
  }
}

TEST_CASE("generate: stops at the model's length limit and says so, and leaves the model's mode", "[generate][nn]") {
  auto model = tiny_llama(2);  // max_position_embeddings 24
  model->train();
  const nn::GenerateResult r = nn::generate(*model, {1, 2, 3, 4}, {.max_new_tokens = 100, .temperature = 0.0});
  CHECK(r.tokens.size() == 20);
  CHECK(r.stop_reason == nn::StopReason::MaxPositions);
  CHECK(nn::to_string(r.stop_reason) == "max_positions");
  CHECK(model->is_training());
  // Exactly filling it by the count is a stop by the count.
  CHECK(nn::generate(*model, {1, 2, 3, 4}, {.max_new_tokens = 20, .temperature = 0.0}).stop_reason ==
        nn::StopReason::MaxNewTokens);
  // The end-of-sequence id ends it, returned as the last token.
  const int64_t first = r.tokens.front();
  const nn::GenerateResult e = nn::generate(*model, {1, 2, 3, 4}, {.max_new_tokens = 10, .temperature = 0.0, .eos_id = first});
  CHECK(e.tokens == std::vector<int64_t>{first});
  CHECK(e.stop_reason == nn::StopReason::EndOfSequence);
}

TEST_CASE("generate: a tiny Llama's greedy tokens equal the PyTorch reference", "[generate][llama]") {
  for (const char* name : {"untied_gqa", "tied_mqa"}) {
    INFO(name);
    const json& f = fixtures().at(name);
    const nn::LlamaConfig config = booster::testing::llama_config_from(f.at("config"));
    nn::Llama model(config, 0);
    booster::testing::set_llama_fixture_weights(model, f.at("params"));
    const auto prompt = f.at("prompt").get<std::vector<int64_t>>();
    const auto expected = f.at("tokens").get<std::vector<int64_t>>();
    // The reference's smallest gap between the two best logits must exceed what roundoff can move two
    // logits apart (Note [Llama fixture tolerance]: 8.3e-6 of the largest logit each), or equal tokens
    // would be luck.
    {
      NoGradGuard no_grad;
      std::vector<int64_t> all = prompt;
      all.insert(all.end(), expected.begin(), expected.end());
      const double largest = max_abs(model(ids(all)));
      CHECK(f.at("margin").get<double>() > 2.0 * 8.3e-6 * largest);
    }
    for (bool use_cache : {true, false}) {
      const nn::GenerateResult r =
          nn::generate(model, prompt, {.max_new_tokens = 100, .temperature = 0.0, .use_cache = use_cache});
      CHECK(r.tokens == expected);
      CHECK(r.stop_reason == nn::StopReason::MaxPositions);  // the reference fills max_position_embeddings
    }
  }
}

TEST_CASE("generate: sampling with a seed is reproducible, and top_k 1 is greedy", "[generate][nn]") {
  auto model = tiny_gpt();
  const nn::GenerateOptions o{.max_new_tokens = 16, .temperature = 1.5, .seed = 7};
  const auto a = nn::generate(*model, {1}, o).tokens;
  CHECK(nn::generate(*model, {1}, o).tokens == a);
  nn::GenerateOptions other = o;
  other.seed = 8;
  CHECK(nn::generate(*model, {1}, other).tokens != a);  // 16 draws at temperature 1.5: equal is ~impossible
  const auto greedy = nn::generate(*model, {1}, {.max_new_tokens = 16, .temperature = 0.0}).tokens;
  CHECK(nn::generate(*model, {1}, {.max_new_tokens = 16, .temperature = 1.5, .top_k = 1, .seed = 3}).tokens == greedy);
  // vocab_limit: only ids below it come out (a tokenizer smaller than a padded vocabulary).
  for (int64_t id : nn::generate(*model, {1}, {.max_new_tokens = 40, .temperature = 2.0, .seed = 5, .vocab_limit = 4}).tokens)
    CHECK(id < 4);
  // A tiny top_p keeps only the most probable id: greedy too.
  CHECK(nn::generate(*model, {1}, {.max_new_tokens = 16, .temperature = 1.5, .top_p = 1e-6, .seed = 3}).tokens == greedy);
}

TEST_CASE("generate: greedy ties, top-k ties, the nucleus and the draw on hand-made distributions", "[generate]") {
  Generator gen(0);
  // Greedy: the lowest id among equal maxima, no draw.
  CHECK(nn::sample_next_token({0.f, 5.f, 5.f, 1.f}, {.temperature = 0.0}, gen) == 1);
  CHECK(gen.state() == Generator(0).state());

  // The nucleus: by descending probability, the shortest prefix reaching top_p, at least one id.
  const std::vector<double> p = {0.1, 0.4, 0.2, 0.3};
  CHECK(nn::top_p_set(p, 1.0) == std::vector<int64_t>{1, 3, 2, 0});
  CHECK(nn::top_p_set(p, 0.5) == std::vector<int64_t>{1, 3});
  CHECK(nn::top_p_set(p, 0.7) == std::vector<int64_t>{1, 3});  // 0.4 + 0.3 reaches 0.7 (in doubles: 0.7000...)
  CHECK(nn::top_p_set(p, 0.75) == std::vector<int64_t>{1, 3, 2});
  CHECK(nn::top_p_set(p, 0.4) == std::vector<int64_t>{1});
  CHECK(nn::top_p_set(p, 0.01) == std::vector<int64_t>{1});
  CHECK(nn::top_p_set({0.25, 0.5, 0.25}, 0.6) == std::vector<int64_t>{1, 0});  // equal probabilities: lower id first

  // Draws: logits log(p) at temperature 1, top_p 0.5 -> only ids 1 and 3, as 0.4 : 0.3.
  std::vector<float> logits;
  for (double v : p) logits.push_back(float(std::log(v)));
  const int n = 20000;
  std::map<int64_t, int> counts;
  for (int i = 0; i < n; ++i) ++counts[nn::sample_next_token(logits, {.temperature = 1.0, .top_p = 0.5}, gen)];
  CHECK(counts.size() == 2);
  const double share = double(counts[1]) / n, expected = 0.4 / 0.7;
  CHECK(std::abs(share - expected) < 4.0 * std::sqrt(expected * (1 - expected) / n));  // 4 sigma

  // top_k 2 keeps the two highest (ties with the second kept: three ids here).
  counts.clear();
  for (int i = 0; i < 3000; ++i) ++counts[nn::sample_next_token({1.f, 3.f, 2.f, 2.f, 0.f}, {.temperature = 1.0, .top_k = 2}, gen)];
  CHECK(counts.size() == 3);
  CHECK((counts.count(1) && counts.count(2) && counts.count(3)));
  // Without filters every id with probability > 0 comes out, in proportion.
  counts.clear();
  for (int i = 0; i < n; ++i) ++counts[nn::sample_next_token(logits, {.temperature = 1.0}, gen)];
  for (int64_t id = 0; id < 4; ++id) {
    const double q = p[size_t(id)];
    CHECK(std::abs(double(counts[id]) / n - q) < 4.0 * std::sqrt(q * (1 - q) / n));
  }
}

TEST_CASE("generate: bad options and prompts are refused, naming the value", "[generate][errors]") {
  auto model = tiny_llama(2);
  CHECK_THROWS_WITH(nn::generate(*model, {1}, {.temperature = -0.5}), Contains("temperature is -0.5"));
  CHECK_THROWS_WITH(nn::generate(*model, {1}, {.top_p = 0.0}), Contains("top_p is 0"));
  CHECK_THROWS_WITH(nn::generate(*model, {1}, {.top_p = 1.5}), Contains("(0, 1]"));
  CHECK_THROWS_WITH(nn::generate(*model, {1}, {.top_k = -1}), Contains("top_k is -1"));
  CHECK_THROWS_WITH(nn::generate(*model, {1}, {.max_new_tokens = -2}), Contains("max_new_tokens is -2"));
  CHECK_THROWS_AS(nn::generate(*model, {1}, {.temperature = -0.5}), ValueError);
  CHECK_THROWS_WITH(nn::generate(*model, {}, {}), Contains("prompt is empty"));
  CHECK_THROWS_WITH(nn::generate(*model, {1, 19}, {}), Contains("id 19, outside the model's vocabulary [0, 19)"));
  CHECK_THROWS_WITH(nn::generate(*model, std::vector<int64_t>(24, 1), {}), Contains("at most 24 positions"));
  nn::MLPClassifier mlp(4, {}, 2);
  CHECK_THROWS_AS(nn::generate(mlp, {1}, {}), IncompatibleError);
  // A cache past the model's positions.
  nn::KVCache cache = model->make_kv_cache(30);
  NoGradGuard no_grad;
  model->forward_cached(ids(std::vector<int64_t>(20, 1)), cache);
  CHECK_THROWS_WITH(model->forward_cached(ids(std::vector<int64_t>(5, 1)), cache),
                    Contains("positions 20 .. 24 pass max_position_embeddings 24"));
}

TEST_CASE("kv cache: preallocated, grown geometrically past the hint, contents kept", "[generate][nn]") {
  NoGradGuard no_grad;
  nn::LayerKVCache c(3);
  auto step = [&](int64_t t, float value) {
    const Tensor k = full({1, 2, t, 4}, value), v = full({1, 2, t, 4}, -value);
    return c.append(k, v);
  };
  step(2, 1.f);
  CHECK(c.capacity() == 3);
  step(1, 2.f);
  CHECK(c.capacity() == 3);  // no reallocation within the hint
  auto [k, v] = step(1, 3.f);
  CHECK(c.capacity() == 6);  // doubled, not grown by one
  step(3, 4.f);
  CHECK(c.capacity() == 12);  // 7 needed: twice 6
  CHECK(c.length() == 7);
  std::tie(k, v) = step(1, 5.f);
  REQUIRE(k.shape() == Shape{1, 2, 8, 4});
  const std::vector<double> expect = {1, 1, 2, 3, 4, 4, 4, 5};
  for (int64_t t = 0; t < 8; ++t) {
    CHECK(k.select(2, t).tolist() == std::vector<double>(8, expect[size_t(t)]));
    CHECK(v.select(2, t).tolist() == std::vector<double>(8, -expect[size_t(t)]));
  }
  CHECK_THROWS_AS(c.append(full({2, 2, 1, 4}, 0.0), full({2, 2, 1, 4}, 0.0)), ShapeError);  // another batch
}

TEST_CASE("generate: on CUDA the tokens equal the CPU's", "[generate][cuda]") {
  if (::testing::skip_without_gpu()) return;
  auto model = tiny_llama(2);
  const nn::GenerateOptions o{.max_new_tokens = 18, .temperature = 0.0};
  const auto cpu = nn::generate(*model, {1, 2, 3}, o).tokens;
  model->to(Device::cuda(0));
  CHECK(nn::generate(*model, {1, 2, 3}, o).tokens == cpu);
  auto gpt = tiny_gpt();
  const auto gpt_cpu = nn::generate(*gpt, {1, 2, 3}, o).tokens;
  gpt->to(Device::cuda(0));
  CHECK(nn::generate(*gpt, {1, 2, 3}, o).tokens == gpt_cpu);
}
