// PEFT adapter directories in and out (peft.h), LoraConfig's init_from, and merging adapters.
//
// Note [PEFT's files]
// ~~~~~~~~~~~~~~~~~~~
// Written from PEFT's source (huggingface/peft v0.13.2: config.py, tuners/lora/config.py and layer.py,
// utils/save_and_load.py, peft_model.py):
// - adapter_config.json is json.dumps(LoraConfig.to_dict(), indent=2, sort_keys=True), no newline at
//   the end, with inference_mode true (PeftModel.save_pretrained sets it) and every LoraConfig field:
//   we write v0.13.2's, at their defaults where booster has no such setting. Newer PEFTs drop fields
//   they do not know and default those they miss, so they load it too.
// - adapter_model.safetensors holds get_peft_model_state_dict(model): the model's state-dict keys that
//   contain "lora_" (bias "none"), named from the PeftModel ("base_model.model." + the base model's
//   module path), with the adapter name ("lora_A.default.weight") taken out, metadata {"format": "pt"}.
// - A is lora_A.weight = nn.Linear(in_features, r).weight, [r, in]; B is [out, r]. For a GPT-2 Conv1D,
//   whose weight is [in, out], PEFT reads in_features, out_features = weight.shape: the adapters have the
//   same layout, and fan_in_fan_out (which PEFT forces true on a Conv1D) only transposes B A when merging.
//   booster keeps GPT-2's projections as Linears ([out, in], hf.cpp transposes on the way in and out),
//   so its adapters are PEFT's unchanged and the merge adds s B A to the Linear's weight.
//
// Note [A PEFT adapter's settings]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// r, alpha, use_rslora and target_modules describe the adapter's tensors and scale: a run that starts
// from (or applies) an adapter computes what PEFT computes with it only with the adapter's values. So
// the directory decides them, and a config can only repeat them: in a config's "lora" section
// (LoraConfig::from_json) an absent key takes the adapter's value and a given one must be equal
// (target_modules as a set: PEFT saves a set), else a ConfigError names both values. A LoraConfig built
// in C++ cannot say which fields were given, so apply_lora requires all four to equal the directory's;
// LoraConfig::from_peft(dir) gives a config that does. dropout and seed are training settings, not the
// adapter's: the config's own (from_json takes the adapter's lora_dropout when "dropout" is absent).
#include "booster/nn/peft.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <sstream>

#include "booster/checkpoint/atomic_file.h"
#include "booster/common/error.h"
#include "booster/common/json_text.h"
#include "booster/nn/families.h"
#include "booster/nn/hf.h"
#include "booster/nn/llama.h"
#include "booster/nn/models.h"
#include "booster/tensor/grad_mode.h"

namespace booster::nn {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kPrefix = "base_model.model.";
const std::string kA = ".lora_A.weight", kB = ".lora_B.weight";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_adapter_name(const std::string& name) { return ends_with(name, kA) || ends_with(name, kB); }

// The name PEFT gives a tensor of `model` (without "base_model.model."): Hugging Face's for the families
// save_pretrained writes, the module path itself for any other model (PEFT's names for a plain
// torch.nn.Module).
std::string peft_name(const Module& model, const std::string& name) {
  if (family_of(model) != nullptr) return hf_tensor_name(model, name).name;  // a declared family (families.h)
  return name;
}

bool has_conv1d_targets(const Module& model) {
  const ModelFamily* family = family_of(model);
  if (family == nullptr || family->conv1d.empty()) return false;  // only GPT-2 stores Conv1D weights
  for (const auto& [name, t] : model.named_parameters())
    if (ends_with(name, kA) && hf_tensor_name(model, name.substr(0, name.size() - kA.size()) + ".weight").transposed)
      return true;
  return false;
}

std::string listing(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  std::ostringstream os;
  for (const std::string& n : names) os << (os.tellp() > 0 ? ", " : "") << n;
  return names.empty() ? std::string("nothing") : os.str();
}

std::string set_text(const std::vector<std::string>& v) {
  std::vector<std::string> sorted = v;
  std::sort(sorted.begin(), sorted.end());
  return json(sorted).dump();
}

// Note [A PEFT adapter's settings]: ConfigError when `given` differs from the adapter's value.
void check_agrees(bool same, const char* key, const std::string& given, const std::string& adapters,
                  const fs::path& dir) {
  BOOSTER_CHECK(same, ConfigError, "lora: ", key, " is ", given, " but the adapter init_from names (",
                (dir / kPeftConfigFileName).string(), ") has ", key, " ", adapters,
                "; leave lora.", key, " out to take the adapter's (in C++: LoraConfig::from_peft), or start from another adapter");
}

std::string number_text(double v) { return json(v).dump(); }

void check_agrees_with_adapter(const LoraConfig& c, const LoraConfig& a, const fs::path& dir) {
  check_agrees(c.r == a.r, "r", std::to_string(c.r), std::to_string(a.r), dir);
  check_agrees(c.alpha == a.alpha, "alpha", number_text(c.alpha), number_text(a.alpha), dir);
  check_agrees(c.use_rslora == a.use_rslora, "use_rslora", c.use_rslora ? "true" : "false",
               a.use_rslora ? "true" : "false", dir);
  const std::set<std::string> mine(c.target_modules.begin(), c.target_modules.end()),
      theirs(a.target_modules.begin(), a.target_modules.end());
  check_agrees(mine == theirs, "target_modules", set_text(c.target_modules), set_text(a.target_modules), dir);
}

}  // namespace

// ------------------------------------------------------------------------------------------ reading

LoraAdapter read_peft_config(const fs::path& dir) {
  BOOSTER_CHECK(fs::is_directory(dir), ConfigError, "lora adapter ", dir.string(),
                " is not a directory; give a PEFT adapter directory (adapter_config.json and adapter_model.safetensors)");
  const fs::path file = dir / kPeftConfigFileName;
  BOOSTER_CHECK(fs::is_regular_file(file), ConfigError, "lora adapter ", dir.string(), " has no ", kPeftConfigFileName,
                " (it holds ", listing(dir), "); a PEFT adapter directory holds adapter_config.json and "
                "adapter_model.safetensors, as PeftModel.save_pretrained writes them");
  // The config's limits (Note [One JSON reader] in booster/common/json_text.h).
  const json c = booster::read_json_file(file.string(), "lora adapter config", JsonLimits{});
  const std::string where = file.string();
  BOOSTER_CHECK(c.is_object(), ConfigError, where, " is not a JSON object");
  auto get = [&](const char* key) -> const json* {
    auto it = c.find(key);
    return it == c.end() || it->is_null() ? nullptr : &*it;
  };
  const json* type = get("peft_type");
  BOOSTER_CHECK(type && type->is_string() && type->get<std::string>() == "LORA", ConfigError, where, ": peft_type is ",
                type ? type->dump() : std::string("missing"), "; booster reads LoRA adapters (peft_type \"LORA\") only");

  LoraAdapter out;
  out.dir = dir;
  out.adapter_config = c;
  LoraConfig& lc = out.config;
  lc.init_from = dir.string();
  if (const json* r = get("r")) {
    BOOSTER_CHECK(r->is_number_integer() && r->get<int64_t>() >= 1, ConfigError, where, ": \"r\" must be an integer >= 1, got ",
                  r->dump());
    lc.r = r->get<int64_t>();
  }
  if (const json* a = get("lora_alpha")) {
    BOOSTER_CHECK(a->is_number() && std::isfinite(a->get<double>()) && a->get<double>() > 0, ConfigError, where,
                  ": \"lora_alpha\" must be a number > 0, got ", a->dump());
    lc.alpha = a->get<double>();
  }
  if (const json* d = get("lora_dropout")) {
    BOOSTER_CHECK(d->is_number() && d->get<double>() >= 0 && d->get<double>() < 1, ConfigError, where,
                  ": \"lora_dropout\" must be a number in [0, 1), got ", d->dump());
    lc.dropout = d->get<double>();
  }
  const json* targets = get("target_modules");
  BOOSTER_CHECK(targets && targets->is_array() && !targets->empty(), ConfigError, where, ": \"target_modules\" is ",
                targets ? targets->dump() : std::string("missing"),
                "; booster needs the adapted layers' names as a list (a regular expression or \"all-linear\" is not "
                "read): e.g. [\"q_proj\", \"v_proj\"]");
  lc.target_modules.clear();
  for (const json& t : *targets) {
    BOOSTER_CHECK(t.is_string() && !t.get<std::string>().empty(), ConfigError, where,
                  ": \"target_modules\" must list module names, got ", t.dump());
    lc.target_modules.push_back(t.get<std::string>());
  }
  auto boolean = [&](const char* key) {
    const json* v = get(key);
    BOOSTER_CHECK(!v || v->is_boolean(), ConfigError, where, ": \"", key, "\" must be true or false, got ", v->dump());
    return v && v->get<bool>();
  };
  lc.use_rslora = boolean("use_rslora");
  out.fan_in_fan_out = boolean("fan_in_fan_out");
  BOOSTER_CHECK(!boolean("use_dora"), ConfigError, where, ": use_dora is true; booster implements plain LoRA, not DoRA");
  if (const json* bias = get("bias"))
    BOOSTER_CHECK(bias->is_string() && bias->get<std::string>() == "none", ConfigError, where, ": bias is ", bias->dump(),
                  "; booster's adapters train no biases (bias \"none\")");
  for (const char* key : {"modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform", "layer_replication"}) {
    const json* v = get(key);
    BOOSTER_CHECK(!v || v->empty(), ConfigError, where, ": \"", key, "\" is ", v ? v->dump() : "", ", which booster's LoRA "
                  "does not implement (it adapts every target layer alike and saves nothing else)");
  }
  if (const json* base = get("base_model_name_or_path")) {
    BOOSTER_CHECK(base->is_string(), ConfigError, where, ": \"base_model_name_or_path\" must be a string or null, got ",
                  base->dump());
    out.base_model_name_or_path = base->get<std::string>();
  }
  lc.validate();
  return out;
}

LoraAdapter read_peft_adapter(const fs::path& dir) {
  LoraAdapter out = read_peft_config(dir);
  const fs::path file = dir / kPeftWeightsFileName;
  BOOSTER_CHECK(fs::is_regular_file(file), CheckpointError, "lora adapter ", dir.string(), " has no ",
                kPeftWeightsFileName, " (it holds ", listing(dir), ")",
                fs::exists(dir / "adapter_model.bin") ? "; its adapter_model.bin is a pickle, which booster does not "
                                                        "read: save it with safe_serialization=True"
                                                      : "");
  checkpoint::SafetensorsFile st = checkpoint::read_safetensors(file);
  const std::string prefix = kPrefix;
  for (auto& [key, t] : st.tensors) {
    BOOSTER_CHECK(key.compare(0, prefix.size(), prefix) == 0 && is_adapter_name(key) && t.dim() == 2, CheckpointError,
                  file.string(), ": tensor '", key, "' ", shape_str(t.shape()), " is not a LoRA matrix as PEFT names "
                  "it (base_model.model.<module>.lora_A.weight or .lora_B.weight, 2-d)");
    const bool is_a = ends_with(key, kA);
    const int64_t rank = is_a ? t.shape()[0] : t.shape()[1];
    BOOSTER_CHECK(rank == out.config.r, CheckpointError, file.string(), ": '", key, "' is ", shape_str(t.shape()),
                  " but adapter_config.json says r ", out.config.r, is_a ? " (A is [r, in])" : " (B is [out, r])");
    out.tensors.emplace(key.substr(prefix.size()), t);
  }
  BOOSTER_CHECK(!out.tensors.empty(), CheckpointError, file.string(), " holds no adapters");
  for (const auto& [name, t] : out.tensors) {
    const std::string base = name.substr(0, name.size() - kA.size());
    const std::string other = base + (ends_with(name, kA) ? kB : kA);
    BOOSTER_CHECK(out.tensors.count(other), CheckpointError, file.string(), ": '", prefix + name, "' has no '",
                  prefix + other, "'; every adapted layer needs both A and B");
  }
  return out;
}

// ------------------------------------------------------------------------------------------ loading

void load_lora_weights(Module& model, const LoraAdapter& adapter) {
  std::map<std::string, std::pair<std::string, Tensor>> mine;  // PEFT name -> booster name, parameter
  for (const auto& [name, p] : model.named_parameters())
    if (is_adapter_name(name)) mine.emplace(peft_name(model, name), std::make_pair(name, p));
  BOOSTER_CHECK(!mine.empty(), StateError, "load_lora_weights: the ", model.name(),
                " has no LoRA adapters; apply_lora first (with the adapter's LoraConfig::from_peft)");
  std::ostringstream problems;
  int count = 0;
  auto problem = [&](const std::string& text) {
    if (count++ < 12) problems << "\n  " << text;
  };
  for (const auto& [key, entry] : mine)
    if (!adapter.tensors.count(key)) problem("missing from the adapter: " + std::string(kPrefix) + key);
  for (const auto& [key, t] : adapter.tensors) {
    auto it = mine.find(key);
    if (it == mine.end())
      problem("the model has no adapter for " + std::string(kPrefix) + key + " " + shape_str(t.shape()));
    else if (it->second.second.shape() != t.shape())
      problem(std::string(kPrefix) + key + ": the model's is " + shape_str(it->second.second.shape()) + ", the file's " +
              shape_str(t.shape()));
  }
  BOOSTER_CHECK(count == 0, CheckpointError, "the LoRA adapter ", adapter.dir.string(), " does not fit the ",
                model.name(), " (", count, " problem", count == 1 ? "" : "s", count > 12 ? ", the first 12" : "",
                "; an adapter trained on another base model or other target_modules?):", problems.str());
  NoGradGuard no_grad;
  for (auto& [key, entry] : mine) entry.second.copy_(adapter.tensors.at(key));
}

// ------------------------------------------------------------------------------------------ writing

json peft_adapter_config(const Module& model, const LoraConfig& config, const PeftSaveOptions& options) {
  const json alpha = config.alpha == std::floor(config.alpha) && std::abs(config.alpha) < 1e15
                         ? json(int64_t(config.alpha))
                         : json(config.alpha);  // PEFT's lora_alpha is an int
  // Note [PEFT's files]: v0.13.2's LoraConfig fields, sorted as json.dumps(sort_keys=True) writes them.
  return json{{"alpha_pattern", json::object()},
              {"auto_mapping", nullptr},
              {"base_model_name_or_path",
               options.base_model_name_or_path.empty() ? json(nullptr) : json(options.base_model_name_or_path)},
              {"bias", "none"},
              {"fan_in_fan_out", has_conv1d_targets(model)},
              {"inference_mode", true},
              {"init_lora_weights", true},
              {"layer_replication", nullptr},
              {"layers_pattern", nullptr},
              {"layers_to_transform", nullptr},
              {"loftq_config", json::object()},
              {"lora_alpha", alpha},
              {"lora_dropout", config.dropout},
              {"megatron_config", nullptr},
              {"megatron_core", "megatron.core"},
              {"modules_to_save", nullptr},
              {"peft_type", "LORA"},
              {"r", config.r},
              {"rank_pattern", json::object()},
              {"revision", nullptr},
              {"target_modules", config.target_modules},
              {"task_type", "CAUSAL_LM"},
              {"use_dora", false},
              {"use_rslora", config.use_rslora}};
}

void save_peft_adapter(const Module& model, const LoraConfig& config, const fs::path& dir,
                       const PeftSaveOptions& options) {
  checkpoint::TensorMap tensors;
  for (const auto& [name, p] : model.named_parameters())
    if (is_adapter_name(name)) tensors.emplace(kPrefix + peft_name(model, name), p.detach().to(options.dtype));
  BOOSTER_CHECK(!tensors.empty(), StateError, "save_peft_adapter: the ", model.name(),
                " has no LoRA adapters (apply_lora adds them)");
  const json c = peft_adapter_config(model, config, options);
  fs::create_directories(dir);
  checkpoint::write_safetensors(dir / kPeftWeightsFileName, tensors, {{"format", "pt"}});
  checkpoint::write_text_file_atomically(dir / kPeftConfigFileName, c.dump(2));  // as json.dumps(indent=2)
}

// ------------------------------------------------------------------------------------------ merging

StateDict merge_lora(const Module& model, const LoraConfig& config) {
  StateDict sd = model.state_dict();
  StateDict out;
  const double s = config.scaling();
  int merged = 0;
  for (const auto& [name, t] : sd) {
    if (is_adapter_name(name)) continue;
    out.emplace(name, t);
    if (!ends_with(name, ".weight")) continue;
    const std::string base = name.substr(0, name.size() - std::string(".weight").size());
    auto a_it = sd.find(base + kA), b_it = sd.find(base + kB);
    if (a_it == sd.end() || b_it == sd.end()) continue;
    // W + s B A in float64, rounded once to W's dtype.
    const Tensor W = t.to(Device::cpu()).to(DType::Float64).contiguous();
    const Tensor A = a_it->second.to(Device::cpu()).to(DType::Float64).contiguous();
    const Tensor B = b_it->second.to(Device::cpu()).to(DType::Float64).contiguous();
    const int64_t rows = W.shape()[0], cols = W.shape()[1], r = A.shape()[0];
    BOOSTER_CHECK(W.dim() == 2 && A.shape()[1] == cols && B.shape()[0] == rows && B.shape()[1] == r, ShapeError,
                  "merge_lora: ", name, " ", shape_str(W.shape()), " with A ", shape_str(A.shape()), " and B ",
                  shape_str(B.shape()), "; expected A [r, in] and B [out, r]");
    Tensor merged_w = Tensor::empty(W.shape(), DType::Float64);
    const double *w = W.data<double>(), *a = A.data<double>(), *b = B.data<double>();
    double* m = merged_w.data<double>();
    for (int64_t o = 0; o < rows; ++o) {
      double* row = m + o * cols;
      for (int64_t i = 0; i < cols; ++i) row[i] = 0.0;
      for (int64_t k = 0; k < r; ++k) {
        const double bk = b[o * r + k];
        const double* ak = a + k * cols;
        for (int64_t i = 0; i < cols; ++i) row[i] += bk * ak[i];
      }
      for (int64_t i = 0; i < cols; ++i) row[i] = w[o * cols + i] + s * row[i];
    }
    out[name] = merged_w.to(t.dtype()).to(t.device());
    ++merged;
  }
  BOOSTER_CHECK(merged > 0, StateError, "merge_lora: the ", model.name(), " has no LoRA adapters to merge");
  return out;
}

// ------------------------------------------------------------------------------------------ LoraConfig

LoraConfig LoraConfig::from_peft(const fs::path& dir) { return read_peft_config(dir).config; }

LoraConfig LoraConfig::from_json(const json& section) {
  BOOSTER_CHECK(section.is_object(), ConfigError, "'lora' must be an object such as {\"r\": 8, \"alpha\": 16}, got ",
                section.dump());
  static const std::set<std::string> keys{"r", "alpha", "dropout", "target_modules", "use_rslora", "seed", "init_from"};
  for (const auto& [key, v] : section.items())
    BOOSTER_CHECK(keys.count(key), ConfigError, "'lora.", key, "' is not a LoRA setting; they are r, alpha, dropout, "
                  "target_modules, use_rslora, seed and init_from");
  auto given = [&](const char* key) -> const json* {
    auto it = section.find(key);
    return it == section.end() || it->is_null() ? nullptr : &*it;
  };
  LoraConfig c;
  fs::path adapter_dir;
  if (const json* init = given("init_from")) {
    BOOSTER_CHECK(init->is_string() && !init->get<std::string>().empty(), ConfigError,
                  "'lora.init_from' must be a PEFT adapter directory or null, got ", init->dump());
    adapter_dir = init->get<std::string>();
    c = from_peft(adapter_dir);
  }
  const LoraConfig adapter = c;
  if (const json* v = given("r")) {
    BOOSTER_CHECK(v->is_number_integer(), ConfigError, "'lora.r' must be an integer >= 1, got ", v->dump());
    c.r = v->get<int64_t>();
  }
  if (const json* v = given("alpha")) {
    BOOSTER_CHECK(v->is_number(), ConfigError, "'lora.alpha' must be a number > 0, got ", v->dump());
    c.alpha = v->get<double>();
  }
  if (const json* v = given("dropout")) {
    BOOSTER_CHECK(v->is_number(), ConfigError, "'lora.dropout' must be a number in [0, 1), got ", v->dump());
    c.dropout = v->get<double>();
  }
  if (const json* v = given("use_rslora")) {
    BOOSTER_CHECK(v->is_boolean(), ConfigError, "'lora.use_rslora' must be true or false, got ", v->dump());
    c.use_rslora = v->get<bool>();
  }
  if (const json* v = given("seed")) {
    BOOSTER_CHECK(v->is_number_integer() && v->get<int64_t>() >= 0, ConfigError,
                  "'lora.seed' must be an integer >= 0, got ", v->dump());
    c.seed = v->get<uint64_t>();
  }
  if (const json* v = given("target_modules")) {
    BOOSTER_CHECK(v->is_array(), ConfigError, "'lora.target_modules' must be a list of Linear names such as "
                  "[\"q_proj\", \"v_proj\"], got ", v->dump());
    c.target_modules.clear();
    for (const json& t : *v) {
      BOOSTER_CHECK(t.is_string() && !t.get<std::string>().empty(), ConfigError,
                    "'lora.target_modules' must list Linear names, got ", t.dump());
      c.target_modules.push_back(t.get<std::string>());
    }
  }
  if (!adapter_dir.empty()) check_agrees_with_adapter(c, adapter, adapter_dir);
  c.validate();
  return c;
}

// apply_lora's init_from (lora.cpp): Note [A PEFT adapter's settings], then the directory's tensors.
void load_lora_init_from(Module& model, const LoraConfig& config) {
  LoraAdapter adapter = read_peft_adapter(config.init_from);
  check_agrees_with_adapter(config, adapter.config, config.init_from);
  load_lora_weights(model, adapter);
}

}  // namespace booster::nn
