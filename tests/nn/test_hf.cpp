// Hugging Face checkpoints in and out (booster/nn/hf.h): tiny GPT-2s and Llamas written as
// transformers lays them out (tests/fixtures/make_hf_fixtures.py: F32, F16 and BF16, tied and untied,
// grouped-query, one file and a sharded index) give the logits of a PyTorch implementation of Hugging
// Face's formulas; under a LazyInitGuard nothing is read until used and a shard reads only its part;
// hf -> booster -> hf gives the same files byte for byte; every malformed directory is one ConfigError
// that lists all of its problems.
#include <catch2/catch.hpp>

#include <atomic>
#include <cmath>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <unistd.h>

#include "fixture.h"

#include "booster/checkpoint/safetensors.h"
#include "booster/nn/hf.h"
#include "booster/nn/llama.h"
#include "booster/nn/models.h"
#include "booster/nn/shard_policy.h"
#include "booster/ops/ops.h"
#include "booster/tensor/deferred.h"
#include "booster/tensor/grad_mode.h"

using namespace booster;
using Catch::Contains;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

const json& reference() {
  static const json j = testing::load_fixture_json("hf/reference.json");
  return j;
}

fs::path fixture_dir(const std::string& name) { return fs::path(BOOSTER_FIXTURE_DIR) / "hf" / name; }

struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    path = fs::temp_directory_path() / ("booster_test_hf_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ignored;
    if (!std::getenv("BOOSTER_KEEP_TEST_DIRS")) fs::remove_all(path, ignored);
  }
  fs::path operator/(const std::string& name) const { return path / name; }
};

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

Tensor ids_of(const json& f) {
  std::vector<double> ids;
  for (const auto& v : f.at("input")) ids.push_back(v.get<double>());
  return from_vector(ids, f.at("batch").get<Shape>(), DType::Float64).to(DType::Int64);
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (double v : t.tolist()) m = std::max(m, std::abs(v));
  return m;
}

// A fixture directory copied, so a test can break it.
fs::path copy_fixture(const TempDir& tmp, const std::string& name) {
  const fs::path dst = tmp / name;
  fs::copy(fixture_dir(name), dst, fs::copy_options::recursive);
  return dst;
}

std::string config_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  FAIL("no ConfigError");
  return "";
}

const char* const kCases[] = {"gpt2", "gpt2_f16", "gpt2_untied_bf16", "llama", "llama_tied_bf16"};

}  // namespace

// Float32 roundoff bound (as test_llama's): each of the forward's reductions in series (per layer the
// attention's q k^T and weights x v, each projection, the MLP's two, then lm_head; the longest has K = 64
// terms, GPT-2's mlp.c_proj) contributes about sqrt(K) u relative error of the values it makes, and the
// norms bring the activations back to about 1 before each. Two layers of at most 6 reductions plus the
// head is 13 in series: 13 sqrt(64) u = 6.2e-6 of the largest logit. The file's 16-bit weights are exact
// in float32 on both sides, so F16 and BF16 directories meet the same bound. (Measured: 1e-6 to 2.5e-6
// against bounds of 1.4e-5 to 1.6e-5.)
TEST_CASE("hf: tiny GPT-2s and Llamas from Hugging Face files give the reference logits", "[hf][nn]") {
  const double bound = 13.0 * std::sqrt(64.0) * std::ldexp(1.0, -24);
  for (const char* name : kCases) {
    INFO(name);
    const json& f = reference().at(name);
    for (const bool lazy : {false, true}) {
      INFO("under a LazyInitGuard: " << lazy);
      nn::ModulePtr model;
      if (lazy) {
        LazyInitGuard guard;
        model = nn::load_pretrained(fixture_dir(name));
        for (const Tensor& t : model->parameters()) CHECK(is_deferred(t));  // nothing read yet
      } else {
        model = nn::load_pretrained(fixture_dir(name));
        for (const Tensor& t : model->parameters()) CHECK_FALSE(is_deferred(t));
      }
      for (const Tensor& t : model->parameters()) CHECK(t.dtype() == DType::Float32);
      model->eval();
      NoGradGuard no_grad;
      const Tensor logits = (*model)(ids_of(f));
      const Tensor want = testing::tensor_from_json(f.at("logits"));
      REQUIRE(logits.shape() == want.shape());
      const double scale = max_abs(want);
      INFO("max difference " << testing::max_abs_diff(logits, want) << ", bound " << bound * scale);
      CHECK(testing::max_abs_diff(logits, want) <= bound * scale);
    }
  }
}

// GPT-2's checkpoints on Hugging Face's hub were saved from GPT2Model: "h.0.attn.c_attn.weight",
// "wte.weight", no "transformer." (and attn.bias buffers); transformers loads them into GPT2LMHeadModel,
// and so must load_pretrained (Note [A base model's names]). A LlamaModel's files lack "model." alike.
TEST_CASE("hf: files saved from the base model (no transformer. or model. prefix) give the reference logits",
          "[hf][nn]") {
  const double bound = 13.0 * std::sqrt(64.0) * std::ldexp(1.0, -24);
  TempDir tmp;
  for (const auto& [name, prefix] : {std::pair{"gpt2_f16", "transformer."}, std::pair{"llama_tied_bf16", "model."},
                                     std::pair{"llama", "model."}}) {
    INFO(name);
    const fs::path dir = copy_fixture(tmp, name);
    checkpoint::TensorMap stripped;
    for (const auto& [key, t] : checkpoint::load_model(dir)) {
      REQUIRE((key.rfind(prefix, 0) == 0 || key == "lm_head.weight"));
      stripped[key.rfind(prefix, 0) == 0 ? key.substr(std::string(prefix).size()) : key] = t;
    }
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().extension() != ".json" || e.path().filename() == "model.safetensors.index.json") fs::remove(e.path());
    // The untied Llama keeps lm_head.weight as it is (a base model has none; this one is a head model's
    // file without the prefix on the base model's names).
    checkpoint::save_model(dir, stripped, std::string(name) == "llama" ? 4000 : checkpoint::kDefaultMaxShardBytes);
    const json& f = reference().at(name);
    const nn::ModulePtr model = nn::load_pretrained(dir);
    model->eval();
    NoGradGuard no_grad;
    const Tensor logits = (*model)(ids_of(f));
    const Tensor want = testing::tensor_from_json(f.at("logits"));
    REQUIRE(logits.shape() == want.shape());
    CHECK(testing::max_abs_diff(logits, want) <= bound * max_abs(want));
  }
  // Problems name the tensors as the file does.
  const fs::path dir = copy_fixture(tmp, "gpt2");
  checkpoint::TensorMap t;
  for (const auto& [key, v] : checkpoint::read_safetensors(dir / "model.safetensors").tensors) t[key.substr(12)] = v;
  t.erase("h.1.ln_2.bias");
  t["wpe.weight"] = zeros({15, 16});
  t["h.0.attn.extra"] = zeros({3});
  checkpoint::write_safetensors(dir / "model.safetensors", t);
  const std::string what = config_error_of([&] { nn::load_pretrained(dir); });
  CHECK_THAT(what, Contains("3 problems"));
  CHECK_THAT(what, Contains("missing transformer.h.1.ln_2.bias [16]"));
  CHECK_THAT(what, Contains("wpe.weight has shape [15, 16], expected [16, 16]"));
  CHECK_THAT(what, !Contains("transformer.wpe.weight"));
  CHECK_THAT(what, Contains("unexpected h.0.attn.extra [3] F32"));
}

TEST_CASE("hf: the families' models, names and configs", "[hf][nn]") {
  const nn::ModulePtr gpt2 = nn::load_pretrained(fixture_dir("gpt2"));
  const auto* gpt = dynamic_cast<const nn::GPT*>(gpt2.get());
  REQUIRE(gpt != nullptr);
  CHECK(gpt->config.tie_word_embeddings);  // GPT-2's default: config.json does not say
  CHECK(gpt->lm_head->weight.is_same(gpt->wte->weight));
  CHECK(gpt2->state_dict().count("lm_head.weight") == 0);
  CHECK(gpt->config.layer_norm_eps == 1e-5);
  CHECK(gpt->config.dropout == 0.0);  // config.json's *_pdrop are not applied unless asked
  const nn::ModulePtr with_dropout = nn::load_pretrained(fixture_dir("gpt2"), {{"dropout", 0.1}});
  CHECK(dynamic_cast<const nn::GPT&>(*with_dropout).config.dropout == 0.1);

  const nn::ModulePtr llama = nn::load_pretrained(fixture_dir("llama"));
  const auto& l = dynamic_cast<const nn::Llama&>(*llama);
  CHECK(l.config.num_key_value_heads == 2);
  CHECK_FALSE(l.config.tie_word_embeddings);
  const nn::ModulePtr checkpointed =
      nn::make_model({{"type", "hf"}, {"path", fixture_dir("llama_tied_bf16").string()}, {"activation_checkpointing", true}}, 0);
  CHECK(dynamic_cast<const nn::Llama&>(*checkpointed).config.activation_checkpointing);
  CHECK(dynamic_cast<const nn::Llama&>(*checkpointed).config.tie_word_embeddings);

  // The sharded directory really is one: four shards and an index.
  CHECK(fs::exists(fixture_dir("llama") / "model.safetensors.index.json"));
  CHECK_FALSE(fs::exists(fixture_dir("llama") / "model.safetensors"));

  // What save_pretrained writes into config.json.
  const json c = nn::hf_config_of(*gpt2);
  CHECK(c.at("model_type") == "gpt2");
  CHECK(c.at("architectures") == json::array({"GPT2LMHeadModel"}));
  CHECK(c.at("n_embd") == 16);
  CHECK(c.at("torch_dtype") == "float32");
  const json lc = nn::hf_config_of(*llama);
  CHECK(lc.at("architectures") == json::array({"LlamaForCausalLM"}));
  CHECK(lc.at("num_key_value_heads") == 2);

  CHECK(nn::parse_byte_size("5GB") == 5000000000ull);
  CHECK(nn::parse_byte_size("2 GiB") == 2147483648ull);
  CHECK(nn::parse_byte_size("100kb") == 100000ull);
  CHECK(nn::parse_byte_size("4096") == 4096ull);
  CHECK_THROWS_AS(nn::parse_byte_size("lots"), ConfigError);
  CHECK_THROWS_AS(nn::parse_byte_size("0"), ConfigError);
}

// A tensor-parallel shard of a deferred weight (shard_of -> select_ranges) reads its rows from the
// file and leaves the whole unallocated; it equals the eager model's slice, for a plain weight and for a
// Conv1D weight the file stores transposed.
TEST_CASE("hf: a shard of a deferred weight reads only its part and equals the eager slice", "[hf][nn]") {
  for (const char* name : {"llama", "gpt2_untied_bf16"}) {
    INFO(name);
    const nn::ModulePtr eager = nn::load_pretrained(fixture_dir(name));
    nn::ModulePtr lazy;
    {
      LazyInitGuard guard;
      lazy = nn::load_pretrained(fixture_dir(name));
    }
    const auto eager_params = eager->named_parameters();
    const auto lazy_params = lazy->named_parameters();
    REQUIRE(eager_params.size() == lazy_params.size());
    for (size_t i = 0; i < eager_params.size(); ++i) {
      const Tensor& whole = lazy_params[i].second;
      if (whole.dim() != 2) continue;
      INFO(lazy_params[i].first);
      for (int64_t dim : {0, 1}) {
        for (int rank = 0; rank < 2; ++rank) {
          const Tensor part = nn::shard_of(whole, nn::ShardSpec{dim, 1}, rank, 2);
          const int64_t n = whole.size(dim) / 2;
          CHECK(testing::max_abs_diff(part, eager_params[i].second.narrow(dim, rank * n, n)) == 0.0);
        }
      }
      CHECK(is_deferred(whole));  // the whole was never allocated
    }
  }
}

TEST_CASE("hf: hf -> booster -> hf gives the same files, byte for byte", "[hf][nn]") {
  for (const char* name : {"gpt2", "llama"}) {
    INFO(name);
    TempDir out;
    const json& f = reference().at(name);
    nn::SavePretrainedOptions options;
    if (f.at("max_shard_bytes").is_number()) options.max_shard_bytes = f.at("max_shard_bytes").get<uint64_t>();
    const nn::ModulePtr model = nn::load_pretrained(fixture_dir(name));
    nn::save_pretrained(*model, out.path, options);
    std::set<std::string> theirs, ours;
    for (const auto& e : fs::directory_iterator(fixture_dir(name))) theirs.insert(e.path().filename().string());
    for (const auto& e : fs::directory_iterator(out.path)) ours.insert(e.path().filename().string());
    CHECK(ours == theirs);
    for (const std::string& file : theirs) {
      if (file == "config.json") continue;  // ours is written from the model (compared below)
      INFO(file);
      CHECK(read_bytes(out / file) == read_bytes(fixture_dir(name) / file));
    }
    const json config = json::parse(read_bytes(out / "config.json"));
    const json original = json::parse(read_bytes(fixture_dir(name) / "config.json"));
    const json ours_config = nn::hf_config_of(*model);
    for (const auto& [key, value] : ours_config.items())
      if (original.contains(key) && key != "resid_pdrop" && key != "embd_pdrop" && key != "attn_pdrop") {
        INFO(key);
        CHECK(config.at(key) == original.at(key));
      }

    // And the export loads again into the same model.
    const nn::ModulePtr again = nn::load_pretrained(out.path);
    NoGradGuard no_grad;
    CHECK(testing::max_abs_diff((*again)(ids_of(f)), (*model)(ids_of(f))) == 0.0);
  }
}

TEST_CASE("hf: a 16-bit directory exports as float32 with the same values", "[hf][nn]") {
  TempDir out;
  const nn::ModulePtr model = nn::load_pretrained(fixture_dir("llama_tied_bf16"));
  nn::SavePretrainedOptions options;
  options.base_config = {{"bos_token_id", 1}, {"model_type", "bert"}};
  nn::save_pretrained(*model, out.path, options);
  const json config = json::parse(read_bytes(out / "config.json"));
  CHECK(config.at("torch_dtype") == "float32");
  CHECK(config.at("bos_token_id") == 1);       // kept from the base
  CHECK(config.at("model_type") == "llama");   // the model's own keys win
  const checkpoint::TensorMap theirs = checkpoint::load_model(fixture_dir("llama_tied_bf16"));
  const checkpoint::TensorMap ours = checkpoint::load_model(out.path);
  REQUIRE(ours.size() == theirs.size());
  CHECK(ours.count("lm_head.weight") == 0);  // tied: the embedding only
  for (const auto& [name, t] : theirs) {
    INFO(name);
    CHECK(ours.at(name).dtype() == DType::Float32);
    CHECK(testing::max_abs_diff(ours.at(name), t.to(DType::Float32)) == 0.0);
  }
}

TEST_CASE("hf: a GPT's tied lm_head and layer-norm epsilon, and the defaults are unchanged", "[hf][nn]") {
  nn::GPTConfig c;
  c.vocab_size = 32, c.context = 8, c.width = 16, c.layers = 1, c.heads = 2;
  nn::GPT plain(c, 7);
  CHECK(plain.state_dict().count("lm_head.weight") == 1);
  CHECK_FALSE(plain.lm_head->weight.is_same(plain.wte->weight));
  c.tie_word_embeddings = true;
  c.layer_norm_eps = 1e-3;
  nn::GPT tied(c, 7);
  CHECK(tied.lm_head->weight.is_same(tied.wte->weight));
  CHECK(tied.state_dict().count("lm_head.weight") == 0);
  CHECK(tied.num_parameters() == plain.num_parameters() - 32 * 16);
  // Everything before lm_head is drawn as in the untied model.
  CHECK(testing::max_abs_diff(tied.wte->weight, plain.wte->weight) == 0.0);
  CHECK(testing::max_abs_diff(tied.blocks->children()[0]->parameters()[0], plain.blocks->children()[0]->parameters()[0]) == 0.0);
}

TEST_CASE("hf: every malformed directory is one ConfigError listing all of its problems", "[hf][nn]") {
  TempDir tmp;
  SECTION("missing, unexpected, misshapen and badly typed tensors, all in one message") {
    const fs::path dir = copy_fixture(tmp, "gpt2");
    checkpoint::TensorMap t = checkpoint::read_safetensors(dir / "model.safetensors").tensors;
    t.erase("transformer.h.1.ln_2.bias");
    t["transformer.h.0.attn.extra"] = zeros({3});
    t["transformer.wpe.weight"] = zeros({15, 16});
    t["transformer.ln_f.weight"] = zeros({16}, DType::Int32);
    t["transformer.h.0.attn.bias"] = zeros({1, 1, 16, 16});  // a known buffer: ignored
    checkpoint::write_safetensors(dir / "model.safetensors", t);
    const std::string what = config_error_of([&] { nn::load_pretrained(dir); });
    CHECK_THAT(what, Contains("4 problems"));
    CHECK_THAT(what, Contains("missing transformer.h.1.ln_2.bias [16]"));
    CHECK_THAT(what, Contains("unexpected transformer.h.0.attn.extra [3] F32"));
    CHECK_THAT(what, Contains("transformer.wpe.weight has shape [15, 16], expected [16, 16]"));
    CHECK_THAT(what, Contains("transformer.ln_f.weight is I32, not F32, F16 or BF16"));
    CHECK_THAT(what, !Contains("attn.bias"));
    CHECK(what.find('\n') == std::string::npos);
  }
  SECTION("a Conv1D weight stored as a Linear's [out, in] is misshapen") {
    const fs::path dir = copy_fixture(tmp, "gpt2");
    checkpoint::TensorMap t = checkpoint::read_safetensors(dir / "model.safetensors").tensors;
    t["transformer.h.0.attn.c_attn.weight"] = t["transformer.h.0.attn.c_attn.weight"].transpose(0, 1).contiguous();
    checkpoint::write_safetensors(dir / "model.safetensors", t);
    CHECK_THAT(config_error_of([&] { nn::load_pretrained(dir); }),
               Contains("transformer.h.0.attn.c_attn.weight has shape [48, 16], expected [16, 48]"));
  }
  SECTION("an untied model without lm_head.weight") {
    const fs::path dir = copy_fixture(tmp, "llama");
    json config = json::parse(read_bytes(dir / "config.json"));
    config["tie_word_embeddings"] = true;  // the file has lm_head.weight: ignored when tied
    std::ofstream(dir / "config.json") << config.dump();
    CHECK_NOTHROW(nn::load_pretrained(dir));
    const fs::path tied = copy_fixture(tmp, "llama_tied_bf16");
    json untied = json::parse(read_bytes(tied / "config.json"));
    untied["tie_word_embeddings"] = false;
    std::ofstream(tied / "config.json") << untied.dump();
    CHECK_THAT(config_error_of([&] { nn::load_pretrained(tied); }), Contains("missing lm_head.weight [48, 16]"));
  }
  SECTION("a head_dim that is not a positive integer, or not hidden_size / num_attention_heads") {
    const fs::path dir = copy_fixture(tmp, "llama");
    const json base = json::parse(read_bytes(dir / "config.json"));
    const int64_t head_dim = base.at("hidden_size").get<int64_t>() / base.at("num_attention_heads").get<int64_t>();
    auto with_head_dim = [&](const json& v) {
      json c = base;
      c["head_dim"] = v;
      std::ofstream(dir / "config.json") << c.dump();
    };
    for (const json& bad : {json(std::to_string(head_dim)), json(double(head_dim) + 0.5), json(-head_dim)}) {
      INFO(bad.dump());
      with_head_dim(bad);
      CHECK_THAT(config_error_of([&] { nn::load_pretrained(dir); }),
                 Contains("\"head_dim\" must be a positive integer, got " + bad.dump()));
    }
    with_head_dim(2 * head_dim);
    CHECK_THAT(config_error_of([&] { nn::load_pretrained(dir); }), Contains("\"head_dim\" is " + std::to_string(2 * head_dim)));
    with_head_dim(head_dim);
    CHECK_NOTHROW(nn::load_pretrained(dir));
  }
  SECTION("rope_scaling: null and the default type are plain RoPE, linear scales, an incomplete llama3 is refused") {
    const fs::path dir = copy_fixture(tmp, "llama");
    const json base = json::parse(read_bytes(dir / "config.json"));
    NoGradGuard no_grad;
    const Tensor ids = from_vector(std::vector<double>{1, 5, 9, 3, 7}, {1, 5}, DType::Float64).to(DType::Int64);
    const Tensor want = (*nn::load_pretrained(dir))(ids);
    for (const json& scaling : {json(nullptr), json{{"rope_type", "default"}}, json{{"type", "default"}},
                                json{{"rope_type", "llama3"}, {"factor", 8.0}}, json{{"type", "linear"}, {"factor", 2.0}}}) {
      INFO(scaling.dump());
      json c = base;
      c["rope_scaling"] = scaling;
      std::ofstream(dir / "config.json") << c.dump();
      const bool plain_rope = scaling.is_null() || scaling.value("rope_type", scaling.value("type", "")) == "default";
      if (plain_rope) {
        CHECK(testing::max_abs_diff((*nn::load_pretrained(dir))(ids), want) == 0.0);
      } else if (scaling.contains("type")) {  // linear: the angles change (values: tests/nn/test_families.cpp)
        CHECK(testing::max_abs_diff((*nn::load_pretrained(dir))(ids), want) > 0.0);
      } else {  // llama3 needs its three other keys
        CHECK_THAT(config_error_of([&] { nn::load_pretrained(dir); }), Contains("needs \"low_freq_factor\""));
      }
    }
  }
  SECTION("no config.json, an unknown model_type, a feature the family lacks") {
    const fs::path dir = copy_fixture(tmp, "gpt2");
    json relu = json::parse(std::ifstream(dir / "config.json"));  // sizes that agree with the weights
    relu["activation_function"] = "relu";
    fs::remove(dir / "config.json");
    CHECK_THAT(config_error_of([&] { nn::load_pretrained(dir); }), Contains("no config.json"));
    std::ofstream(dir / "config.json") << R"({"model_type": "bert", "vocab_size": 48})";
    CHECK_THAT(config_error_of([&] { nn::load_pretrained(dir); }), Contains("model_type \"bert\" is not a family"));
    std::ofstream(dir / "config.json") << relu.dump();
    CHECK_THAT(config_error_of([&] { nn::load_pretrained(dir); }), Contains("\"activation_function\" is \"relu\""));
    std::ofstream(dir / "config.json") << R"({"model_type": "gpt2", )";
    CHECK_THAT(config_error_of([&] { nn::load_pretrained(dir); }), Contains("not valid JSON"));
    CHECK_THAT(config_error_of([&] { nn::load_pretrained(tmp / "nowhere"); }), Contains("is not a directory"));
  }
  SECTION("no weights, and an index naming a shard that is missing") {
    const fs::path dir = copy_fixture(tmp, "llama");
    fs::remove(dir / "model-00002-of-00004.safetensors");
    const std::string what = config_error_of([&] { nn::load_pretrained(dir); });
    CHECK_THAT(what, Contains("the index names shard model-00002-of-00004.safetensors"));
    CHECK_THAT(what, Contains("which is missing"));
    CHECK_THAT(what, !Contains("missing model."));  // its tensors are not listed again one by one
    fs::remove(dir / "model.safetensors.index.json");
    CHECK_THAT(config_error_of([&] { nn::load_pretrained(dir); }), Contains("holds neither model.safetensors nor"));
  }
  SECTION("an option the model type does not take") {
    CHECK_THAT(config_error_of([&] {
                 nn::make_model({{"type", "hf"}, {"path", fixture_dir("llama").string()}, {"dropout", 0.1}}, 0);
               }),
               Contains("'model.dropout' is not an option of a Hugging Face llama model"));
    CHECK_THAT(config_error_of([&] { nn::make_model({{"type", "hf"}}, 0); }), Contains("'model.path' must name"));
  }
  SECTION("save_pretrained refuses a model without a Hugging Face family") {
    nn::MLPClassifier mlp(4, {8}, 2);
    CHECK_THAT(config_error_of([&] { nn::save_pretrained(mlp, tmp / "out"); }), Contains("has no Hugging Face format"));
  }
}
