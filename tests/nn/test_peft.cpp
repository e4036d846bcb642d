// PEFT adapter directories (booster/nn/peft.h): adapters written in PEFT's exact files by
// tests/fixtures/peft/make_peft_fixture.py (PyTorch, from PEFT's formulas and save format) for the tiny
// Llama and GPT-2 (Conv1D, fan_in_fan_out, rsLoRA) of tests/fixtures/hf/ load and give the reference's
// logits; save_peft_adapter writes the same bytes PEFT wrote and init_from reads them back bit for bit;
// merge_lora equals the reference's float64 merge; an adapter of another base, a directory without
// adapter_config.json, another peft_type and a config contradicting the adapter are named errors.
#include <catch2/catch.hpp>

#include <cstring>
#include <cmath>
#include <fstream>

#include "fixture.h"
#include "run_booster.h"

#include "booster/checkpoint/safetensors.h"
#include "booster/nn/hf.h"
#include "booster/nn/lora.h"
#include "booster/nn/peft.h"
#include "booster/ops/ops.h"
#include "booster/tensor/grad_mode.h"

using namespace booster;
using Catch::Contains;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

const json& reference() {
  static const json j = booster::testing::load_fixture_json("peft/reference.json");
  return j;
}

fs::path adapter_dir(const std::string& name) { return fs::path(BOOSTER_FIXTURE_DIR) / "peft" / name; }
fs::path base_dir(const std::string& name) { return fs::path(BOOSTER_FIXTURE_DIR) / "hf" / name; }

// A fresh directory under this process's scratch directory.
fs::path fresh_dir(const std::string& name) {
  const fs::path dir = ::testing::scratch_dir("test_peft") / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string read_bytes(const fs::path& p) { return ::testing::read_text(p); }

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

bool bit_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(), a.nbytes()) == 0;
}

// The base model with the fixture's adapter applied through LoraConfig::init_from.
nn::ModulePtr adapted(const std::string& name) {
  nn::ModulePtr model = nn::load_pretrained(base_dir(name));
  nn::apply_lora(*model, nn::LoraConfig::from_peft(adapter_dir(name)));
  model->eval();
  return model;
}

fs::path copy_adapter(const fs::path& tmp, const std::string& name) {
  const fs::path dst = tmp / name;
  fs::copy(adapter_dir(name), dst, fs::copy_options::recursive);
  return dst;
}

void write_json(const fs::path& file, const json& j) {
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out << j.dump(2);
}

template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "(no error of the expected type)";
}

const char* const kCases[] = {"llama", "gpt2"};

}  // namespace

// The bound: test_hf.cpp's for these models (13 float32 reductions of length <= 64 in series, relative to
// the largest logit, two summation orders), with the adapter's branch in an adapted layer adding two
// reductions (A over the layer's input width, at most 64, then B over r) beside W x: at most 2 more per
// layer, 17 in series.
TEST_CASE("peft: a PEFT adapter on the tiny Llama and GPT-2 gives the reference logits", "[peft][lora][nn]") {
  const double bound = 17.0 * std::sqrt(64.0) * std::ldexp(1.0, -24);
  for (const char* name : kCases) {
    INFO(name);
    const json& f = reference().at(name);
    const nn::LoraAdapter adapter = nn::read_peft_adapter(adapter_dir(name));
    CHECK(adapter.config.scaling() == f.at("scaling").get<double>());
    CHECK(adapter.fan_in_fan_out == (std::string(name) == "gpt2"));
    CHECK(adapter.base_model_name_or_path == "tests/fixtures/hf/" + std::string(name));
    const nn::ModulePtr model = adapted(name);
    NoGradGuard no_grad;
    const Tensor logits = (*model)(ids_of(f));
    const Tensor want = booster::testing::tensor_from_json(f.at("logits"));
    REQUIRE(logits.shape() == want.shape());
    const double scale = max_abs(want);
    INFO("max difference " << booster::testing::max_abs_diff(logits, want) << ", bound " << bound * scale);
    CHECK(booster::testing::max_abs_diff(logits, want) <= bound * scale);
    // The adapter matters: the base alone is far from the reference.
    const nn::ModulePtr base = nn::load_pretrained(base_dir(name));
    base->eval();
    CHECK(booster::testing::max_abs_diff((*base)(ids_of(f)), want) > 100 * bound * scale);
  }
}

TEST_CASE("peft: save_peft_adapter writes the bytes PEFT wrote and init_from reads them back", "[peft][lora][nn]") {
  const fs::path tmp = fresh_dir("case1");
  for (const char* name : kCases) {
    INFO(name);
    const nn::ModulePtr model = adapted(name);
    const nn::LoraConfig lora = nn::LoraConfig::from_peft(adapter_dir(name));
    const fs::path out = tmp / name;
    nn::save_peft_adapter(*model, lora, out, {.base_model_name_or_path = "tests/fixtures/hf/" + std::string(name)});
    // Key names, shapes, dtypes, metadata and every config field as PEFT writes them: the same bytes.
    CHECK(read_bytes(out / "adapter_model.safetensors") == read_bytes(adapter_dir(name) / "adapter_model.safetensors"));
    CHECK(read_bytes(out / "adapter_config.json") == read_bytes(adapter_dir(name) / "adapter_config.json"));
    // init_from of what was written gives the same adapters, bit for bit.
    const nn::ModulePtr again = nn::load_pretrained(base_dir(name));
    nn::LoraConfig from_written = nn::LoraConfig::from_json({{"init_from", out.string()}});
    nn::apply_lora(*again, from_written);
    int adapters = 0;
    const auto mine = model->state_dict();
    for (const auto& [key, t] : again->state_dict()) {
      REQUIRE(mine.count(key));
      CHECK(bit_equal(t, mine.at(key)));
      adapters += key.find(".lora_") != std::string::npos;
    }
    CHECK(adapters == int(nn::read_peft_adapter(out).tensors.size()));
  }
}

// The reference merges in float64 and rounds once to float32, as merge_lora does; the two float64 values
// differ by the order of a sum of r products (1e-16 relative), so the float32 results are equal, or one
// float32 unit apart where that value lies at a rounding tie.
TEST_CASE("peft: merge_lora equals the reference's merge and loads as a plain model", "[peft][lora][nn]") {
  const fs::path tmp = fresh_dir("case2");
  for (const char* name : kCases) {
    INFO(name);
    const nn::ModulePtr model = adapted(name);
    const nn::StateDict merged = nn::merge_lora(*model, nn::LoraConfig::from_peft(adapter_dir(name)));
    for (const auto& [key, t] : merged) CHECK(key.find("lora_") == std::string::npos);
    const nn::ModulePtr plain = nn::load_pretrained(base_dir(name));
    plain->load_state_dict(merged);  // strict: exactly the base model's tensors
    nn::save_pretrained(*plain, tmp / name);
    const checkpoint::TensorMap written = checkpoint::load_model(tmp / name);
    const checkpoint::SafetensorsFile want =
        checkpoint::read_safetensors(fs::path(BOOSTER_FIXTURE_DIR) / "peft" / (std::string(name) + "_merged.safetensors"));
    REQUIRE(!want.tensors.empty());
    for (const auto& [key, w] : want.tensors) {
      INFO(key);
      REQUIRE(written.count(key));
      const Tensor got = written.at(key);
      CHECK(booster::testing::max_abs_diff(got, w) <= std::ldexp(1.0, -23) * max_abs(w));
    }
    // Every other tensor is the base's, unchanged.
    const checkpoint::TensorMap base = checkpoint::load_model(base_dir(name));
    for (const auto& [key, t] : written)
      if (!want.tensors.count(key)) CHECK(bit_equal(t, base.at(key)));
    // The merged model computes what the adapted one does.
    const json& f = reference().at(name);
    plain->eval();
    NoGradGuard no_grad;
    const Tensor want_logits = booster::testing::tensor_from_json(f.at("logits"));
    CHECK(booster::testing::max_abs_diff((*plain)(ids_of(f)), want_logits) <=
          17.0 * std::sqrt(64.0) * std::ldexp(1.0, -24) * max_abs(want_logits));
  }
}

TEST_CASE("peft: the adapter's settings fill the config and a contradiction is named", "[peft][lora][nn]") {
  const std::string dir = adapter_dir("llama").string();
  const nn::LoraConfig filled = nn::LoraConfig::from_json({{"init_from", dir}, {"dropout", 0.1}, {"seed", 3}});
  CHECK(filled.r == 4);
  CHECK(filled.alpha == 8.0);
  CHECK(filled.dropout == 0.1);  // the run's own
  CHECK(filled.target_modules == std::vector<std::string>{"q_proj", "v_proj", "down_proj"});
  CHECK(filled.init_from == dir);
  CHECK(filled.seed == 3);
  // Without init_from, absent keys keep LoraConfig's defaults.
  const nn::LoraConfig plain = nn::LoraConfig::from_json({{"r", 16}, {"init_from", nullptr}});
  CHECK(plain.r == 16);
  CHECK(plain.alpha == nn::LoraConfig{}.alpha);
  CHECK(plain.init_from.empty());
  // Equal values may be repeated, the targets in any order.
  CHECK_NOTHROW(nn::LoraConfig::from_json(
      {{"init_from", dir}, {"r", 4}, {"alpha", 8}, {"target_modules", {"down_proj", "q_proj", "v_proj"}}}));
  CHECK_THAT(message_of<ConfigError>([&] { nn::LoraConfig::from_json({{"init_from", dir}, {"r", 8}}); }),
                       Contains("r is 8") && Contains("has r 4") && Contains("adapter_config.json"));
  CHECK_THAT(message_of<ConfigError>([&] { nn::LoraConfig::from_json({{"init_from", dir}, {"use_rslora", true}}); }),
                       Contains("use_rslora is true") && Contains("has use_rslora false"));
  CHECK_THAT(message_of<ConfigError>([&] { nn::LoraConfig::from_json({{"init_from", dir}, {"target_modules", {"q_proj"}}}); }),
                       Contains("target_modules is [\"q_proj\"]") && Contains("\"down_proj\""));
  CHECK_THAT(message_of<ConfigError>([&] { nn::LoraConfig::from_json({{"rank", 8}}); }), Contains("'lora.rank'"));
  // In C++ every setting must equal the adapter's (the defaults r 8, alpha 8 do not).
  nn::LoraConfig by_hand;
  by_hand.init_from = dir;
  const nn::ModulePtr model = nn::load_pretrained(base_dir("llama"));
  CHECK_THAT(message_of<ConfigError>([&] { nn::apply_lora(*model, by_hand); }), Contains("r is 8") && Contains("has r 4"));
}

TEST_CASE("peft: an adapter of another base, a missing config, another peft_type are named errors",
          "[peft][lora][nn]") {
  const fs::path tmp = fresh_dir("case3");
  SECTION("an A of another width and a layer the model lacks are named, with both shapes") {
    const fs::path dir = copy_adapter(tmp, "llama");
    checkpoint::TensorMap t = checkpoint::read_safetensors(dir / "adapter_model.safetensors").tensors;
    t["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] = zeros({4, 20});
    t["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = zeros({4, 16});
    t["base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight"] = zeros({16, 4});
    checkpoint::write_safetensors(dir / "adapter_model.safetensors", t, {{"format", "pt"}});
    const nn::ModulePtr model = nn::load_pretrained(base_dir("llama"));
    CHECK_THAT(message_of<CheckpointError>([&] { nn::apply_lora(*model, nn::LoraConfig::from_peft(dir)); }),
        Contains("model.layers.0.self_attn.q_proj.lora_A.weight: the model's is [4, 16], the file's [4, 20]") &&
            Contains("no adapter for base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight") &&
            Contains("another base model"));
  }
  SECTION("the GPT-2's adapter on the Llama: no Linear of those names") {
    const nn::ModulePtr model = nn::load_pretrained(base_dir("llama"));
    CHECK_THROWS_AS(nn::apply_lora(*model, nn::LoraConfig::from_peft(adapter_dir("gpt2"))), ConfigError);
  }
  SECTION("a missing adapter_config.json names the directory and what it holds") {
    const fs::path dir = copy_adapter(tmp, "llama");
    fs::remove(dir / "adapter_config.json");
    CHECK_THAT(message_of<ConfigError>([&] { nn::read_peft_adapter(dir); }),
                         Contains("has no adapter_config.json") && Contains("adapter_model.safetensors"));
  }
  SECTION("a missing adapter_model.safetensors") {
    const fs::path dir = copy_adapter(tmp, "llama");
    fs::remove(dir / "adapter_model.safetensors");
    CHECK_THAT(message_of<CheckpointError>([&] { nn::read_peft_adapter(dir); }), Contains("has no adapter_model.safetensors"));
  }
  SECTION("peft_type other than LORA") {
    const fs::path dir = copy_adapter(tmp, "llama");
    json c = json::parse(read_bytes(dir / "adapter_config.json"));
    c["peft_type"] = "PREFIX_TUNING";
    write_json(dir / "adapter_config.json", c);
    CHECK_THAT(message_of<ConfigError>([&] { nn::read_peft_config(dir); }),
                         Contains("peft_type is \"PREFIX_TUNING\"") && Contains("LoRA adapters"));
  }
  SECTION("settings booster does not implement") {
    const fs::path dir = copy_adapter(tmp, "llama");
    json c = json::parse(read_bytes(dir / "adapter_config.json"));
    c["use_dora"] = true;
    write_json(dir / "adapter_config.json", c);
    CHECK_THAT(message_of<ConfigError>([&] { nn::read_peft_config(dir); }), Contains("use_dora"));
    c["use_dora"] = false;
    c["target_modules"] = "all-linear";
    write_json(dir / "adapter_config.json", c);
    CHECK_THAT(message_of<ConfigError>([&] { nn::read_peft_config(dir); }), Contains("target_modules"));
  }
  SECTION("an A whose rank is not the config's r") {
    const fs::path dir = copy_adapter(tmp, "llama");
    json c = json::parse(read_bytes(dir / "adapter_config.json"));
    c["r"] = 2;
    write_json(dir / "adapter_config.json", c);
    CHECK_THAT(message_of<CheckpointError>([&] { nn::read_peft_adapter(dir); }), Contains("says r 2"));
  }
}
