// The decoder families beyond Llama and the attention masks they need: the attention op under a sliding
// window, packed documents and a query offset against an explicit float64 masked softmax over every
// (query, key) pair, and its gradients against finite differences; Mistral (a window shorter than the
// sequence), Qwen2 (q/k/v biases, a window on the upper layers only) and Llama 3's RoPE scaling
// ("llama3" and "linear") against a PyTorch model written from Hugging Face's formulas
// (tests/fixtures/families/make_families_fixtures.py): logits, 3 AdamW steps, Mistral's greedy tokens
// with and without the cache; Hugging Face files in and out; the architectures refused by name.
#include <catch2/catch.hpp>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <unistd.h>

#include "fixture.h"
#include "gradcheck.h"
#include "llama_fixture.h"
#include "roundoff.h"

#include "booster/booster/booster.h"
#include "booster/common/error.h"
#include "booster/config/config.h"
#include "booster/config/memory_estimate.h"
#include "booster/nn/generate.h"
#include "booster/nn/hf.h"
#include "booster/nn/llama.h"
#include "booster/nn/model_registry.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"

using namespace booster;
using json = nlohmann::json;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;
namespace ro = ::testing::roundoff;

namespace {

// ------------------------------------------------------------------------------------- attention masks

// softmax(q k^T scale) v over the keys AttentionMask allows (its rule written out once more, as
// ops.h states it), every (query, key) pair visited, in float64. q [B, H, L, E], k/v [B, H, S, E].
std::vector<double> masked_attention_reference(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                               const AttentionMask& m) {
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), E = q.size(3), S = k.size(2);
  const std::vector<double> Q = q.tolist(), K = k.tolist(), V = v.tolist();
  std::vector<double> seg = m.segments.defined() ? m.segments.to(DType::Float64).tolist() : std::vector<double>();
  std::vector<double> out(size_t(B * H * L * E), 0.0);
  const double scale = 1.0 / std::sqrt(double(E));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < L; ++i) {
        const int64_t pos = m.query_offset + i;
        std::vector<double> w(size_t(S), 0.0);
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < S; ++j) {
          const bool keep = (!causal || j <= pos) && (m.window == 0 || pos - j < m.window) &&
                            (seg.empty() || seg[size_t(b * S + j)] == seg[size_t(b * S + pos)]);
          if (!keep) {
            w[size_t(j)] = -std::numeric_limits<double>::infinity();
            continue;
          }
          double s = 0;
          for (int64_t e = 0; e < E; ++e) s += Q[size_t(((b * H + h) * L + i) * E + e)] * K[size_t(((b * H + h) * S + j) * E + e)];
          w[size_t(j)] = s * scale;
          mx = std::max(mx, w[size_t(j)]);
        }
        double total = 0;
        for (double& x : w) total += (x = std::exp(x - mx));
        for (int64_t j = 0; j < S; ++j)
          for (int64_t e = 0; e < E; ++e)
            out[size_t(((b * H + h) * L + i) * E + e)] += w[size_t(j)] / total * V[size_t(((b * H + h) * S + j) * E + e)];
      }
  return out;
}

struct MaskCase {
  const char* what;
  bool causal;
  int64_t L, S, window, offset;
  bool segments;
};

}  // namespace

TEST_CASE("attention mask: window, documents and offset equal an explicit float64 masked softmax",
          "[attention][ops][families]") {
  const MaskCase cases[] = {
      {"window 3 on 9 positions", true, 9, 9, 3, 0, false},
      {"window 1: each query sees itself only", true, 6, 6, 1, 0, false},
      {"packed documents", true, 9, 9, 0, 0, true},
      {"packed documents and a window of 2", true, 9, 9, 2, 0, true},
      {"3 queries after 6 cached keys, window 4", true, 3, 9, 4, 6, false},
      {"a window without the causal mask", false, 7, 7, 3, 0, false},
  };
  const int64_t B = 2, H = 3, E = 8;
  for (const MaskCase& c : cases) {
    INFO(c.what);
    Generator gen(7);
    const Tensor q = randn({B, H, c.L, E}, &gen, DType::Float64), k = randn({B, H, c.S, E}, &gen, DType::Float64),
                 v = randn({B, H, c.S, E}, &gen, DType::Float64);
    AttentionMask m;
    m.window = c.window;
    m.query_offset = c.offset;
    if (c.segments) {  // documents of 3, 2 and 4 positions, and of 5 and 4 (ids need not be ordered)
      const std::vector<int64_t> ids = {0, 0, 0, 1, 1, 2, 2, 2, 2, 7, 7, 7, 7, 7, 3, 3, 3, 3};
      m.segments = from_vector(std::vector<double>(ids.begin(), ids.end()), {B, c.S}, DType::Float64).to(DType::Int32);
    }
    const std::vector<double> want = masked_attention_reference(q, k, v, c.causal, m);
    // float64: the same sums in other orders, E + S terms of size <= ~10, so far below 1e-12.
    const std::vector<double> got = scaled_dot_product_attention(q, k, v, c.causal, std::nullopt, m).tolist();
    REQUIRE(got.size() == want.size());
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
    CHECK(worst <= 1e-12);
    // float32 (the fused CPU loops): scores within gamma_E |q| |k| scale, the softmax and the weighted
    // sum add gamma_S each; |v| <= max|v| and |scores| <= 6 bound the propagation (Note [Roundoff
    // bounds], step 5, a worst case), so |out - ref| <= gamma(E + 2S + 8) (1 + 6) max|v|.
    const std::vector<double> got32 = scaled_dot_product_attention(q.to(DType::Float32), k.to(DType::Float32),
                                                                   v.to(DType::Float32), c.causal, std::nullopt, m)
                                          .tolist();
    double vmax = 0, worst32 = 0;
    for (double x : v.tolist()) vmax = std::max(vmax, std::abs(x));
    for (size_t i = 0; i < got32.size(); ++i) worst32 = std::max(worst32, std::abs(got32[i] - want[i]));
    const double bound = ro::gamma(double(E + 2 * c.S + 8), ro::kUnit) * 7.0 * vmax + 2.0 * ro::kUnit * vmax;
    INFO("float32: max difference " << worst32 << ", bound " << bound);
    CHECK(worst32 <= bound);
    // bfloat16 (oneDNN's batched products where the CPU has them, else widened to float32; Note
    // [Attention through oneDNN]) against the reference on the same rounded inputs: P and the output
    // are rounded to bfloat16 once each (2 u_bf16 of max|v|), the rest as float32 above.
    {
      auto bf = [](const Tensor& t) { return t.to(DType::BFloat16); };
      auto back = [](const Tensor& t) { return t.to(DType::Float64); };
      const std::vector<double> want16 =
          masked_attention_reference(back(bf(q)), back(bf(k)), back(bf(v)), c.causal, m);
      const std::vector<double> got16 =
          scaled_dot_product_attention(bf(q), bf(k), bf(v), c.causal, std::nullopt, m).to(DType::Float64).tolist();
      double worst16 = 0;
      for (size_t i = 0; i < got16.size(); ++i) worst16 = std::max(worst16, std::abs(got16[i] - want16[i]));
      const double bound16 = 2.0 * ro::kUnitBFloat16 * vmax + bound;
      INFO("bfloat16: max difference " << worst16 << ", bound " << bound16);
      CHECK(worst16 <= bound16);
    }
    // The gradients of q, k and v against central differences (the probabilities saved hold the mask).
    CHECK(booster::testing::gradcheck(
        [&](const std::vector<Tensor>& x) { return scaled_dot_product_attention(x[0], x[1], x[2], c.causal, std::nullopt, m); },
        {q, k, v}));
  }
}

TEST_CASE("attention mask: bad windows, offsets and segments are refused naming the fix", "[attention][ops][families]") {
  const Tensor q = zeros({1, 2, 4, 8}), k = zeros({1, 2, 4, 8});
  AttentionMask m;
  m.query_offset = 2;  // 4 queries from position 2 need 6 keys
  CHECK_THROWS_AS(scaled_dot_product_attention(q, k, k, true, std::nullopt, m), ShapeError);
  m = AttentionMask{};
  m.segments = zeros({1, 4});  // float ids
  CHECK_THROWS_AS(scaled_dot_product_attention(q, k, k, true, std::nullopt, m), DTypeError);
  m.segments = zeros({2, 4}).to(DType::Int64);  // another batch
  CHECK_THROWS_AS(scaled_dot_product_attention(q, k, k, true, std::nullopt, m), ShapeError);
}

TEST_CASE("cached attention: a key further back than the window is never read", "[attention][generate][families]") {
  // The cached form (one query, and a chunk after a prefix) equals the op over the whole sequence with
  // the window; and changing a key outside every query's window changes nothing.
  Generator gen(3);
  const int64_t B = 1, H = 4, KVH = 2, T = 10, E = 8, window = 3;
  const Tensor q = randn({B, H, T, E}, &gen, DType::Float64), k = randn({B, KVH, T, E}, &gen, DType::Float64),
               v = randn({B, KVH, T, E}, &gen, DType::Float64);
  const Tensor kr = k.unsqueeze(2).expand({B, KVH, 2, T, E}).reshape({B, H, T, E});
  const Tensor vr = v.unsqueeze(2).expand({B, KVH, 2, T, E}).reshape({B, H, T, E});
  AttentionMask m;
  m.window = window;
  const Tensor full = scaled_dot_product_attention(q, kr, vr, true, std::nullopt, m);
  for (int64_t start : {0, 4, 9}) {
    INFO("queries from position " << start);
    const int64_t L = T - start;
    const Tensor got = nn::cached_attention(q.narrow(2, start, L), k, v, start, window);
    CHECK(booster::testing::max_abs_diff(got, full.narrow(2, start, L)) <= 1e-12);
  }
  Tensor k2 = k.clone(), v2 = v.clone();
  {
    NoGradGuard no_grad;
    k2.narrow(2, 0, 1).fill_(100.0);  // key 0 is outside the window of the last 3 queries
    v2.narrow(2, 0, 1).fill_(100.0);
  }
  CHECK(booster::testing::max_abs_diff(nn::cached_attention(q.narrow(2, 7, 3), k2, v2, 7, window),
                                       nn::cached_attention(q.narrow(2, 7, 3), k, v, 7, window)) == 0.0);
}

// ------------------------------------------------------------------------------------------ families

namespace {

const json& fixtures() {
  static const json j = booster::testing::load_fixture_json("families/families.json");
  return j;
}

std::shared_ptr<nn::Llama> family_model(const json& f) {
  auto model = std::dynamic_pointer_cast<nn::Llama>(nn::make_model(f.at("model"), 0));
  REQUIRE(model != nullptr);
  booster::testing::set_llama_fixture_weights(*model, f.at("params"));
  return model;
}

Tensor ids_of(const json& flat, int64_t B, int64_t T) {
  const std::vector<int64_t> v = flat.get<std::vector<int64_t>>();
  return from_vector(std::vector<double>(v.begin(), v.end()), {B, T}, DType::Float64).to(DType::Int64);
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (double x : t.tolist()) m = std::max(m, std::abs(x));
  return m;
}

double forward_length(const nn::LlamaConfig& c, int64_t B, int64_t T) {
  return ro::llama_forward_length(double(c.hidden_size), double(c.num_hidden_layers), double(c.num_attention_heads),
                                  double(c.intermediate_size), double(T), double(c.vocab_size), double(B));
}

}  // namespace

// Note [Family fixture bounds]
// The reference is float32 PyTorch with its sums in other orders (and another libm's exp, rsqrt, cos),
// so Note [Roundoff bounds] (tests/roundoff.h) applies as in tests/nn/test_llama_train.cpp: the logits
// within eps_f = reduction_bound(llama_forward_length) of the largest logit; the loss of AdamW step s
// within eps_f |L_s| + |g_s|_1 kDrift eps_g adam_drift_bound(s steps), eps_g = reduction_bound(2 forward,
// B T) (Note [Bounds of the AdamW trajectory] there). A window or a bias does not lengthen any sum; the
// scaled RoPE table is float32 as the reference's (its angles may differ by an ulp of t inv_freq, which
// the cos/sin differences already allowed for plain RoPE cover).
TEST_CASE("families: Mistral, Qwen2 and scaled RoPE logits and 3 AdamW steps equal PyTorch's", "[families][llama][roundoff]") {
  for (const char* name : {"mistral", "qwen2", "llama3", "linear"}) {
    INFO(name);
    const json& f = fixtures().at(name);
    auto model = family_model(f);
    const int64_t B = f.at("batch")[0], T = f.at("batch")[1];
    const Tensor x = ids_of(f.at("input"), B, T), y = ids_of(f.at("target"), B, T);
    const double eps_f = ro::reduction_bound({forward_length(model->config, B, T)});
    {
      NoGradGuard no_grad;
      const Tensor want = booster::testing::tensor_from_json(f.at("logits"));
      const Tensor got = (*model)(x);
      const double bound = eps_f * max_abs(want);
      INFO("logits: max difference " << booster::testing::max_abs_diff(got, want) << ", bound " << bound);
      CHECK(booster::testing::max_abs_diff(got, want) <= bound);
    }
    const json& adamw = f.at("optimizer");
    auto optimizer = optim::make_optimizer(adamw, model->parameters());
    const double b1 = adamw.at("betas")[0], b2 = adamw.at("betas")[1], lr = adamw.at("lr");
    const double eps_g = ro::reduction_bound({2 * forward_length(model->config, B, T), double(B * T)});
    for (size_t s = 0; s < f.at("step_loss").size(); ++s) {
      optimizer->zero_grad();
      const Tensor loss = cross_entropy((*model)(x).reshape({-1, model->config.vocab_size}), y.reshape({-1}));
      loss.backward();
      optimizer->step();
      const double want = f.at("step_loss")[s], drift = s == 0 ? 0.0 : ro::adam_drift_bound(lr, int(s), b1, b2);
      const double bound = eps_f * std::abs(want) + f.at("step_grad_l1")[s].get<double>() * ro::kDrift * eps_g * drift;
      INFO("step " << s << ": loss " << loss.item() << " against " << want << ", bound " << bound);
      CHECK(std::abs(loss.item() - want) <= bound);
    }
  }
}

TEST_CASE("families: Qwen2 windows its upper layers only, Mistral every layer", "[families][llama]") {
  const auto qwen = family_model(fixtures().at("qwen2"));
  CHECK(qwen->config.attention_bias);
  CHECK(qwen->config.window_of(0) == 0);
  CHECK(qwen->config.window_of(1) == 4);
  const auto mistral = family_model(fixtures().at("mistral"));
  CHECK_FALSE(mistral->config.attention_bias);
  CHECK(mistral->config.window_of(0) == 5);
  CHECK(mistral->config.window_of(1) == 5);
  // use_sliding_window false (Qwen2's default) means no window at all, whatever sliding_window says.
  json off = fixtures().at("qwen2").at("model");
  off["use_sliding_window"] = false;
  CHECK(std::dynamic_pointer_cast<nn::Llama>(nn::make_model(off, 0))->config.sliding_window == 0);
}

TEST_CASE("families: the memory estimate counts each family's parameters as the model has them", "[families][memory]") {
  // The estimate's closed formula (Qwen2's biases included) against the built model's own count.
  for (const char* name : {"mistral", "qwen2", "llama3"}) {
    INFO(name);
    json model = fixtures().at(name).at("model");
    model["vocab_size"] = 256;  // text data without a tokenizer: one id per byte
    const json c = {{"model", model},
                    {"optimizer", {{"type", "adamw"}, {"lr", 0.01}}},
                    {"data", {{"type", "text"}, {"path", std::string(BOOSTER_SOURCE_DIR) + "/README.md"},
                              {"context", 16}, {"batch_size", 4}}}};
    const config::MemoryEstimate e = config::estimate_memory(config::resolve(c), 1);
    CHECK(e.parameters == nn::make_model(model, 0)->num_parameters());
  }
}

TEST_CASE("families: Mistral's windowed greedy tokens equal the reference, with and without the cache",
          "[families][generate]") {
  const json& f = fixtures().at("mistral");
  const auto model = family_model(f);
  const json& g = f.at("generate");
  const auto prompt = g.at("prompt").get<std::vector<int64_t>>();
  const auto expected = g.at("tokens").get<std::vector<int64_t>>();
  REQUIRE(int64_t(prompt.size() + expected.size()) > model->config.sliding_window);  // the window matters
  // Equal tokens are not luck: the reference's smallest gap between its two best logits exceeds what
  // roundoff can move two logits apart (Note [Family fixture bounds], on the whole sequence).
  {
    NoGradGuard no_grad;
    std::vector<int64_t> all = prompt;
    all.insert(all.end(), expected.begin(), expected.end());
    const int64_t T = int64_t(all.size());
    const double largest = max_abs((*model)(ids_of(json(all), 1, T)));
    CHECK(g.at("min_gap").get<double>() > 2.0 * ro::reduction_bound({forward_length(model->config, 1, T)}) * largest);
  }
  for (bool use_cache : {true, false}) {
    INFO("use_cache " << use_cache);
    const nn::GenerateResult r = nn::generate(*model, prompt,
                                              {.max_new_tokens = int64_t(expected.size()), .temperature = 0.0,
                                               .use_cache = use_cache});
    CHECK(r.tokens == expected);
  }
}

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    path = fs::temp_directory_path() /
           ("booster_test_families_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path, ignored);
  }
};

std::string config_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no ConfigError)";
}

}  // namespace

TEST_CASE("families: Hugging Face files out and back in give the same model, model_type or class", "[families][hf]") {
  const std::map<std::string, std::string> architecture = {
      {"mistral", "MistralForCausalLM"}, {"qwen2", "Qwen2ForCausalLM"}, {"llama3", "LlamaForCausalLM"}};
  for (const auto& [name, arch] : architecture) {
    INFO(name);
    const json& f = fixtures().at(name);
    const auto model = family_model(f);
    TempDir tmp;
    nn::save_pretrained(*model, tmp.path);
    std::ifstream in(tmp.path / "config.json");
    const json written = json::parse(in);
    CHECK(written.at("architectures") == json::array({arch}));
    CHECK(written.at("model_type") == f.at("model").at("type"));
    if (name == "mistral") CHECK(written.at("sliding_window") == 5);
    if (name == "qwen2") {
      CHECK(written.at("use_sliding_window") == true);
      CHECK(written.at("sliding_window") == 4);
      CHECK(written.at("max_window_layers") == 1);
    }
    if (name == "llama3") CHECK(written.at("rope_scaling") == f.at("model").at("rope_scaling"));
    // Without model_type the class in "architectures" names the family.
    json no_type = written;
    no_type.erase("model_type");
    std::ofstream(tmp.path / "config.json") << no_type.dump();
    const auto loaded = std::dynamic_pointer_cast<nn::Llama>(nn::load_pretrained(tmp.path));
    REQUIRE(loaded != nullptr);
    CHECK(loaded->config.model_type == model->config.model_type);
    CHECK(loaded->config.rope_scaling == model->config.rope_scaling);
    NoGradGuard no_grad;
    const Tensor x = ids_of(f.at("input"), f.at("batch")[0], f.at("batch")[1]);
    CHECK(booster::testing::max_abs_diff((*loaded)(x), (*model)(x)) == 0.0);
  }
}

TEST_CASE("families: other architectures and RoPE types are refused by name", "[families][hf]") {
  json base = fixtures().at("mistral").at("model");
  for (const char* type : {"gemma", "phi", "phi3", "mixtral", "qwen2_moe"}) {
    INFO(type);
    // A config.json of that model_type is refused by name, with the families booster has.
    TempDir tmp;
    json hf = {{"model_type", type}, {"vocab_size", 64}, {"hidden_size", 32}};
    std::ofstream(tmp.path / "config.json") << hf.dump();
    const std::string what = config_error_of([&] { nn::load_pretrained(tmp.path); });
    CHECK_THAT(what, Contains(std::string("model_type \"") + type + "\" is an architecture booster does not implement"));
    CHECK_THAT(what, Contains("\"mistral\", \"qwen2\""));
  }
  for (const json& scaling : {json{{"rope_type", "yarn"}, {"factor", 4.0}}, json{{"type", "dynamic"}, {"factor", 2.0}},
                              json{{"rope_type", "longrope"}}}) {
    INFO(scaling.dump());
    json c = base;
    c["rope_scaling"] = scaling;
    const std::string what = config_error_of([&] { nn::make_model(c, 0); });
    CHECK_THAT(what, Contains("is not implemented") && Contains("\"linear\"") && Contains("\"llama3\""));
  }
  json llama3 = fixtures().at("llama3").at("model");
  llama3["rope_scaling"].erase("high_freq_factor");
  CHECK_THAT(config_error_of([&] { nn::make_model(llama3, 0); }), Contains("needs \"high_freq_factor\""));
  json llama = fixtures().at("llama3").at("model");
  llama["sliding_window"] = 4;  // a Mistral key on a Llama
  CHECK_THAT(config_error_of([&] { nn::make_model(llama, 0); }), Contains("unknown key \"sliding_window\""));
}
