// Every config field a model family reads, set away from its default, against PyTorch's logits
// (tests/fixtures/families/make_field_fixtures.py): GPT-2's layer_norm_epsilon and untied head, the
// Llama's, Mistral's and Qwen2's rms_norm_eps, rope_theta, tie_word_embeddings, num_key_value_heads,
// rope_scaling and window keys. Read from config.json (load_pretrained), from make_model's keys, and run
// token by token through the KV cache. The other fixtures leave most of these at their defaults, so a
// reader that ignored one of them passed every test; the last case proves that each field moves the
// logits far past the bound, i.e. that these cases would see it ignored.
#include <catch2/catch.hpp>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "fixture.h"

#include "booster/common/error.h"
#include "booster/nn/hf.h"
#include "booster/nn/kv_cache.h"
#include "booster/nn/llama.h"
#include "booster/nn/model_registry.h"
#include "booster/ops/ops.h"
#include "booster/tensor/grad_mode.h"

using namespace booster;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

const json& reference() {
  static const json j = booster::testing::load_fixture_json("families/fields/reference.json");
  return j;
}

fs::path fixture_dir(const std::string& name) { return fs::path(BOOSTER_FIXTURE_DIR) / "families" / "fields" / name; }

Tensor ids_of(const json& f) {
  const std::vector<int64_t> v = f.at("input").get<std::vector<int64_t>>();
  return from_vector(std::vector<double>(v.begin(), v.end()), {f.at("batch")[0], f.at("batch")[1]}, DType::Float64)
      .to(DType::Int64);
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (double x : t.tolist()) m = std::max(m, std::abs(x));
  return m;
}

// As in tests/nn/test_hf.cpp (its derivation holds for these models, of the same size or smaller):
// two layers of at most 6 reductions plus the head, 13 in series, of at most 64 terms, each sqrt(n) u
// (Note [Roundoff bounds] in tests/roundoff.h); BF16 weights are exact in float32 on both sides.
double logit_bound(const Tensor& want) { return 13.0 * std::sqrt(64.0) * std::ldexp(1.0, -24) * max_abs(want); }

struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    path = fs::temp_directory_path() /
           ("booster_test_family_fields_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path, ignored);
  }
};

const char* const kCases[] = {"gpt2", "llama", "mistral", "qwen2"};

}  // namespace

TEST_CASE("family fields: config.json with every field off its default gives PyTorch's logits", "[families][hf][fields]") {
  for (const char* name : kCases) {
    INFO(name);
    const json& f = reference().at(name);
    const nn::ModulePtr model = nn::load_pretrained(fixture_dir(name));
    NoGradGuard no_grad;
    const Tensor want = booster::testing::tensor_from_json(f.at("logits"));
    const Tensor got = (*model)(ids_of(f));
    REQUIRE(got.shape() == want.shape());
    INFO("max difference " << booster::testing::max_abs_diff(got, want) << ", bound " << logit_bound(want));
    CHECK(booster::testing::max_abs_diff(got, want) <= logit_bound(want));
  }
}

TEST_CASE("family fields: the config read from config.json holds each field as written", "[families][hf][fields]") {
  for (const char* name : {"llama", "mistral", "qwen2"}) {
    INFO(name);
    const json& m = reference().at(name).at("model");
    const auto model = std::dynamic_pointer_cast<nn::Llama>(nn::load_pretrained(fixture_dir(name)));
    REQUIRE(model != nullptr);
    const nn::LlamaConfig& c = model->config;
    CHECK(c.model_type == m.at("type").get<std::string>());
    CHECK(c.rms_norm_eps == m.at("rms_norm_eps").get<double>());
    CHECK(c.rope_theta == m.at("rope_theta").get<double>());
    CHECK(c.tie_word_embeddings == m.at("tie_word_embeddings").get<bool>());
    CHECK(c.num_key_value_heads == m.at("num_key_value_heads").get<int64_t>());
    CHECK(c.max_position_embeddings == m.at("max_position_embeddings").get<int64_t>());
    if (m.contains("sliding_window")) {
      CHECK(c.sliding_window == m.at("sliding_window").get<int64_t>());
      CHECK(c.max_window_layers == m.value("max_window_layers", int64_t(0)));
    }
  }
}

TEST_CASE("family fields: make_model's keys give PyTorch's logits", "[families][fields]") {
  for (const char* name : {"llama", "mistral", "qwen2"}) {
    INFO(name);
    const json& f = reference().at(name);
    // The weights come through the Hugging Face reader (its names are make_model's); the config only
    // from make_model's keys.
    const nn::ModulePtr loaded = nn::load_pretrained(fixture_dir(name));
    const nn::ModulePtr model = nn::make_model(f.at("model"), 0);
    model->load_state_dict(loaded->state_dict());
    NoGradGuard no_grad;
    const Tensor want = booster::testing::tensor_from_json(f.at("logits"));
    const Tensor got = (*model)(ids_of(f));
    INFO("max difference " << booster::testing::max_abs_diff(got, want) << ", bound " << logit_bound(want));
    CHECK(booster::testing::max_abs_diff(got, want) <= logit_bound(want));
  }
}

TEST_CASE("family fields: one token at a time through the KV cache gives PyTorch's logits", "[families][generate][fields]") {
  // The cached path reads the window, RoPE base and scaling and the norm epsilon on its own (the query
  // offset, a window over cached keys): each position's logits against the reference's row.
  for (const char* name : kCases) {
    INFO(name);
    const json& f = reference().at(name);
    const nn::ModulePtr model = nn::load_pretrained(fixture_dir(name));
    auto* lm = dynamic_cast<nn::CausalLM*>(model.get());
    REQUIRE(lm != nullptr);
    NoGradGuard no_grad;
    const Tensor ids = ids_of(f);
    const Tensor want = booster::testing::tensor_from_json(f.at("logits"));
    const int64_t T = ids.size(1);
    nn::KVCache cache = lm->make_kv_cache(T);
    for (int64_t t = 0; t < T; ++t) {
      INFO("position " << t);
      const Tensor got = lm->forward_cached(ids.narrow(1, t, 1).contiguous(), cache);
      const Tensor row = want.narrow(1, t, 1).contiguous();
      INFO("max difference " << booster::testing::max_abs_diff(got, row) << ", bound " << logit_bound(want));
      CHECK(booster::testing::max_abs_diff(got, row) <= logit_bound(want));
    }
  }
}

TEST_CASE("family fields: each field set back to its default moves the logits far past the bound", "[families][hf][fields]") {
  // What makes the cases above able to fail: a reader that ignored a field would read its default, and
  // with the default the model is refused (a tied file read as untied lacks lm_head.weight) or its
  // logits move by more than 100 times the bound.
  for (const char* name : kCases) {
    const json& f = reference().at(name);
    json config;
    std::ifstream(fixture_dir(name) / "config.json") >> config;
    const Tensor want = booster::testing::tensor_from_json(f.at("logits"));
    for (const auto& [field, fallback] : f.at("defaults").items()) {
      INFO(name << ": " << field << " set to " << fallback.dump());
      TempDir tmp;
      fs::copy_file(fixture_dir(name) / "model.safetensors", tmp.path / "model.safetensors");
      json changed = config;
      if (fallback.is_null()) changed.erase(field);
      else changed[field] = fallback;
      std::ofstream(tmp.path / "config.json") << changed.dump();
      nn::ModulePtr model;
      try {
        model = nn::load_pretrained(tmp.path);
      } catch (const Error& e) {
        SUCCEED("refused: " << e.what());
        continue;
      }
      NoGradGuard no_grad;
      const double diff = booster::testing::max_abs_diff((*model)(ids_of(f)), want);
      INFO("max difference " << diff << ", bound " << logit_bound(want));
      CHECK(diff > 100 * logit_bound(want));
    }
  }
}
