// Model families declared once (booster/nn/families.h): the registry finds the GPT and the Llama
// family by make_model's type, config.json's model_type or class and the built model; a GPT-2
// directory made by PyTorch (tests/fixtures/make_hf_fixtures.py, untied, BF16) goes through the
// declaration's names and transposed Conv1D weights and back with every tensor's values; config.json's
// missing keys take GPT2Config's defaults; the tensor-parallel shards are Megatron's split of a block,
// written out here; make_model's messages for the declared keys are the ones the GPT always gave.
#include <catch2/catch.hpp>

#include <atomic>
#include <fstream>
#include <set>
#include <sstream>
#include <unistd.h>

#include "fixture.h"

#include "booster/checkpoint/safetensors.h"
#include "booster/config/config.h"
#include "booster/nn/families.h"
#include "booster/nn/hf.h"
#include "booster/nn/llama.h"
#include "booster/nn/models.h"
#include "booster/tensor/deferred.h"

using namespace booster;
using Catch::Contains;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

fs::path fixture_dir(const std::string& name) { return fs::path(BOOSTER_FIXTURE_DIR) / "hf" / name; }

struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    path = fs::temp_directory_path() /
           ("booster_test_model_families_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path, ignored);
  }
};

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  FAIL("no exception");
  return "";
}

}  // namespace

TEST_CASE("model families: registered once, found by type, by config.json and by the built model", "[families][nn]") {
  std::vector<std::string> types;
  for (const nn::ModelFamily* f : nn::model_families()) types.push_back(f->type);
  CHECK(types == std::vector<std::string>{"gpt", "llama", "mistral", "qwen2"});

  const nn::ModelFamily* gpt = nn::find_model_family("gpt");
  REQUIRE(gpt != nullptr);
  CHECK(nn::find_hf_family("gpt2") == gpt);
  CHECK(nn::find_hf_family("GPT2LMHeadModel") == gpt);
  CHECK(nn::find_hf_family("Qwen2ForCausalLM") == nn::find_model_family("qwen2"));
  CHECK(nn::find_model_family("gpt2") == nullptr);  // make_model's type is "gpt"
  CHECK(nn::find_hf_family("gemma") == nullptr);

  const nn::ModulePtr g = nn::make_model(
      {{"type", "gpt"}, {"vocab_size", 16}, {"context", 8}, {"width", 8}, {"layers", 1}, {"heads", 2}}, 0);
  CHECK(nn::family_of(*g) == gpt);
  const nn::ModulePtr q = nn::make_model({{"type", "qwen2"}, {"vocab_size", 16}, {"hidden_size", 8},
                                          {"intermediate_size", 16}, {"num_hidden_layers", 1},
                                          {"num_attention_heads", 2}}, 0);
  CHECK(nn::family_of(*q) == nn::find_model_family("qwen2"));
  const nn::ModulePtr mlp = nn::make_model({{"type", "mlp"}, {"in", 4}, {"hidden", {3}}, {"classes", 2}}, 0);
  CHECK(nn::family_of(*mlp) == nullptr);
  CHECK_THROWS_WITH(nn::save_pretrained(*mlp, "unused"), Contains("a MLPClassifier has no Hugging Face format"));

  // Every family's split table names Linears its layers have (a typo would leave a weight unsplit).
  for (const nn::ModelFamily* f : nn::model_families()) {
    INFO(f->type);
    const nn::ModulePtr m = f->type == "gpt" ? g : nn::make_model({{"type", f->type}, {"vocab_size", 16}, {"hidden_size", 8},
                                                                   {"intermediate_size", 16}, {"num_hidden_layers", 1},
                                                                   {"num_attention_heads", 2}}, 0);
    std::set<std::string> names;
    for (const auto& [name, t] : m->named_parameters()) names.insert(name);
    for (const nn::LinearSplit& s : f->layer_splits) CHECK(names.count(f->layer_prefix + "0." + s.path + ".weight") == 1);
    CHECK(names.count(f->embedding) == 1);
    CHECK(names.count(f->head) == 1);
  }
}

// GPT2Config's defaults (transformers' configuration_gpt2.py): vocab_size 50257, n_positions 1024,
// n_embd 768, n_layer 12, n_head 12, layer_norm_epsilon 1e-5, tie_word_embeddings true.
TEST_CASE("model families: a GPT-2 config.json's missing keys take GPT2Config's defaults", "[families][nn]") {
  LazyInitGuard lazy;  // 124M parameters, never allocated
  const nn::ModulePtr m = nn::model_from_hf_config({{"model_type", "gpt2"}});
  const auto* gpt = dynamic_cast<const nn::GPT*>(m.get());
  REQUIRE(gpt != nullptr);
  CHECK(gpt->config.vocab_size == 50257);
  CHECK(gpt->config.context == 1024);
  CHECK(gpt->config.width == 768);
  CHECK(gpt->config.layers == 12);
  CHECK(gpt->config.heads == 12);
  CHECK(gpt->config.layer_norm_eps == 1e-5);
  CHECK(gpt->config.tie_word_embeddings);
  CHECK(m->num_parameters() == 124439808);  // GPT-2 small, as Hugging Face counts it
  // Only by its architecture, as old files name it.
  const nn::ModulePtr by_class = nn::model_from_hf_config({{"architectures", {"GPT2LMHeadModel"}}, {"n_layer", 2}});
  CHECK(dynamic_cast<const nn::GPT&>(*by_class).config.layers == 2);
  // The overrides a gpt2 directory takes, and the one a llama's does not.
  CHECK(error_of([] { nn::model_from_hf_config({{"model_type", "gpt2"}}, {{"dropout", 1.5}}); }) ==
        "'model.dropout' must be a number in [0, 1), got 1.5");
  CHECK(error_of([] {
          nn::model_from_hf_config({{"model_type", "llama"}, {"vocab_size", 8}, {"hidden_size", 8},
                                    {"intermediate_size", 8}, {"num_hidden_layers", 1}, {"num_attention_heads", 2}},
                                   {{"dropout", 0.1}});
        }) == "'model.dropout' is not an option of a Hugging Face llama model; it takes \"path\", "
              "\"activation_checkpointing\"");
  CHECK_THAT(error_of([] { nn::model_from_hf_config({{"model_type", "gpt2"}}, {{"flash", true}}); }),
             Contains("it takes \"path\", \"activation_checkpointing\" and \"dropout\""));
}

// The untied BF16 GPT-2 of tests/fixtures/make_hf_fixtures.py (transformers' layout: Conv1D weights
// [in, out], a separate lm_head.weight) read and written back: every tensor under its own name and
// shape with its values (BF16 is exact in float32, so equal, not close), the config's keys as the
// file has them; and the export is a fixed point (written again, the same bytes).
TEST_CASE("model families: an untied BF16 GPT-2 directory goes out with every tensor's values", "[families][nn]") {
  const fs::path src = fixture_dir("gpt2_untied_bf16");
  TempDir out, again;
  const nn::ModulePtr model = nn::load_pretrained(src);
  nn::save_pretrained(*model, out.path);
  const checkpoint::SafetensorsFile theirs = checkpoint::read_safetensors(src / "model.safetensors");
  const checkpoint::SafetensorsFile ours = checkpoint::read_safetensors(out.path / "model.safetensors");
  std::set<std::string> their_names, our_names;
  for (const auto& [name, t] : theirs.tensors)
    if (name.find(".attn.bias") == std::string::npos && name.find(".attn.masked_bias") == std::string::npos)
      their_names.insert(name);
  for (const auto& [name, t] : ours.tensors) our_names.insert(name);
  CHECK(our_names == their_names);
  CHECK(our_names.count("lm_head.weight") == 1);
  CHECK(our_names.count("transformer.h.1.mlp.c_fc.weight") == 1);
  for (const std::string& name : their_names) {
    INFO(name);
    if (!ours.tensors.count(name)) continue;
    const Tensor& a = theirs.tensors.at(name);
    const Tensor& b = ours.tensors.at(name);
    CHECK(a.dtype() == DType::BFloat16);
    CHECK(b.dtype() == DType::Float32);
    REQUIRE(a.shape() == b.shape());
    CHECK(booster::testing::max_abs_diff(a.to(DType::Float32), b) == 0.0);
  }
  const json config = json::parse(read_bytes(out.path / "config.json"));
  const json original = json::parse(read_bytes(src / "config.json"));
  for (const auto& [key, value] : config.items())
    if (original.contains(key) && key != "torch_dtype" && key.find("pdrop") == std::string::npos) {
      INFO(key);
      CHECK(value == original.at(key));
    }
  CHECK(config.at("torch_dtype") == "float32");
  CHECK(config.at("tie_word_embeddings") == false);

  nn::save_pretrained(*nn::load_pretrained(out.path), again.path);
  for (const char* file : {"model.safetensors", "config.json"}) {
    INFO(file);
    CHECK(read_bytes(again.path / file) == read_bytes(out.path / file));
  }
}

// Megatron-LM's split of a GPT-2 block (and booster's before the declaration): the embedding and an
// untied head by vocabulary rows; c_attn's [q; k; v] rows each split (chunks 3) with its bias;
// attn.c_proj and mlp.c_proj by input columns, their biases whole; mlp.c_fc by rows with its bias.
TEST_CASE("model families: the GPT's tensor-parallel shards are Megatron's split of a block", "[families][nn]") {
  const nn::ModelFamily& family = *nn::find_model_family("gpt");
  const nn::ModulePtr gpt = nn::make_model(
      {{"type", "gpt"}, {"vocab_size", 16}, {"context", 8}, {"width", 8}, {"layers", 2}, {"heads", 2}}, 0);
  std::map<std::string, std::pair<int64_t, int64_t>> want = {{"wte.weight", {0, 1}}, {"lm_head.weight", {0, 1}}};
  for (const std::string b : {"blocks.0.", "blocks.1."}) {
    want[b + "attn.c_attn.weight"] = {0, 3};
    want[b + "attn.c_attn.bias"] = {0, 3};
    want[b + "attn.c_proj.weight"] = {1, 1};
    want[b + "mlp.c_fc.weight"] = {0, 1};
    want[b + "mlp.c_fc.bias"] = {0, 1};
    want[b + "mlp.c_proj.weight"] = {1, 1};
  }
  std::map<std::string, std::pair<int64_t, int64_t>> got;
  for (const auto& [name, spec] : nn::family_shards(family, *gpt, 2)) got[name] = {spec.dim, spec.chunks};
  CHECK(got == want);

  // Tied (GPT-2's own files): the head is the embedding's tensor, listed once.
  nn::GPTConfig tied_config;
  tied_config.vocab_size = 16, tied_config.context = 8, tied_config.width = 8, tied_config.layers = 2;
  tied_config.heads = 2, tied_config.tie_word_embeddings = true;
  const nn::GPT tied(tied_config, 0);
  want.erase("lm_head.weight");
  got.clear();
  for (const auto& [name, spec] : nn::family_shards(family, tied, 2)) got[name] = {spec.dim, spec.chunks};
  CHECK(got == want);
}

// The messages make_model gave for a GPT's keys before they were declared as data, word for word.
TEST_CASE("model families: make_model checks the GPT's declared keys with the same messages", "[families][nn]") {
  const json ok = {{"type", "gpt"}, {"vocab_size", 16}, {"context", 8}, {"width", 8}, {"layers", 1}, {"heads", 2}};
  auto with = [&](const char* key, const json& value) {
    json c = ok;
    c[key] = value;
    return error_of([&] { nn::make_model(c, 0); });
  };
  CHECK(with("colour", 1) ==
        "make_model: unknown key \"colour\" for model type \"gpt\"; allowed keys are \"type\", \"vocab_size\", "
        "\"context\", \"width\", \"layers\", \"heads\", \"dropout\", \"activation_checkpointing\"");
  json missing = ok;
  missing.erase("heads");
  CHECK(error_of([&] { nn::make_model(missing, 0); }) ==
        "make_model: missing key \"heads\" for model type \"gpt\"; required keys are \"vocab_size\", \"context\", "
        "\"width\", \"layers\", \"heads\"");
  CHECK(with("layers", 0) == "make_model: \"layers\" must be a positive integer, got 0");
  CHECK(with("context", 2.5) == "make_model: \"context\" must be a positive integer, got 2.5");
  CHECK(with("heads", 3) == "make_model: \"width\" 8 must be divisible by \"heads\" 3");
  CHECK(with("dropout", 1.0) == "make_model: \"dropout\" must be a number in [0, 1), got 1.0");
  CHECK(with("activation_checkpointing", 1) == "make_model: \"activation_checkpointing\" must be true or false, got 1");
  json full = ok;
  full["dropout"] = 0.25;
  full["activation_checkpointing"] = true;
  const auto m = nn::make_model(full, 0);
  const nn::GPTConfig& c = dynamic_cast<const nn::GPT&>(*m).config;
  CHECK(c.dropout == 0.25);
  CHECK(c.activation_checkpointing);
  CHECK(c.width == 8);
}

// The schema's checks ask for a family, not for "gpt": every decoder family needs token data (a Llama
// on a classifier's data used to pass booster check and fail at its first batch), and the GPT's
// declared context and divisibility are checked against the data and its keys.
TEST_CASE("model families: booster check asks the family, not the type name", "[families][config]") {
  const json synthetic = {{"type", "synthetic"}, {"num_features", 8}, {"num_classes", 3}, {"batch_size", 4}};
  const json optimizer = {{"type", "sgd"}, {"lr", 0.1}};
  for (const char* type : {"gpt", "llama", "mistral", "qwen2"}) {
    INFO(type);
    json model = std::string(type) == "gpt"
                     ? json{{"type", "gpt"}, {"vocab_size", 256}, {"context", 8}, {"width", 8}, {"layers", 1}, {"heads", 2}}
                     : json{{"type", type}, {"vocab_size", 256}, {"hidden_size", 8}, {"intermediate_size", 16},
                            {"num_hidden_layers", 1}, {"num_attention_heads", 2}};
    CHECK_THAT(error_of([&] { config::resolve({{"model", model}, {"optimizer", optimizer}, {"data", synthetic}}); }),
               Contains(std::string("'model.type' \"") + type + "\" needs token data"));
  }
  const json gpt = {{"type", "gpt"}, {"vocab_size", 256}, {"context", 8}, {"width", 10}, {"layers", 1}, {"heads", 4}};
  const json tokens = {{"type", "text"}, {"path", "/usr/share/common-licenses/GPL-3"}, {"context", 8}};
  CHECK_THAT(error_of([&] { config::resolve({{"model", gpt}, {"optimizer", optimizer}, {"data", tokens}}); }),
             Contains("is not divisible by") && Contains("heads"));
  json long_data = tokens;
  long_data["context"] = 9;
  json fine = gpt;
  fine["width"] = 8;
  CHECK(error_of([&] { config::resolve({{"model", fine}, {"optimizer", optimizer}, {"data", long_data}}); }) ==
        "'data.context' is 9 but 'model.context' is 8; the model cannot see more tokens than its context");
}
