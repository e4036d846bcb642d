// Hugging Face checkpoints in and out (hf.h): config.json in both directions and the matching of a
// file's tensors to a model's parameters, through each family's declaration (nn/families.h; no family
// is named here).
//
// Note [Hugging Face names]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A family is a booster model plus a table in its declaration (nn/gpt_family.cpp, nn/llama_family.cpp):
// booster name prefix -> Hugging Face name prefix (first match wins), the parameters Hugging Face
// stores transposed, and the tensors of its files that are not parameters. Llama's names are Hugging Face's already (nn::Llama is built that way), so its table is
// the identity. GPT-2's (nn::GPT keeps nanoGPT's names):
//
//   wte.weight, wpe.weight          transformer.wte.weight, transformer.wpe.weight
//   blocks.N.<rest>                 transformer.h.N.<rest>   (ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj)
//   ln_f.<rest>                     transformer.ln_f.<rest>
//   lm_head.weight                  lm_head.weight           (absent when tied: wte's tensor, listed once)
//
// GPT-2's four projections are Conv1D modules whose weight is [in, out], the transpose of a Linear's
// [out, in]: they are transposed on the way in (lazily: the deferred record reads element (r, c) from
// (c, r), Note [Weights from a file]) and back on the way out, so hf -> booster -> hf gives the same
// bytes. GPT-2 files also carry attn.bias (the causal mask) and attn.masked_bias, buffers transformers
// recomputes, older Llama files rotary_emb.inv_freq; these are ignored, as is a lm_head.weight that a
// tied model does not use.
//
// Note [A base model's names]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A file saved from the base model (GPT2Model, LlamaModel) rather than the LM-head model names its
// tensors without the base model's prefix: "h.0.attn.c_attn.weight", "wte.weight", not
// "transformer.h.0...". The GPT-2 checkpoints Hugging Face hosts (gpt2, gpt2-medium, distilgpt2, ...)
// are laid out that way. transformers' from_pretrained loads them into GPT2LMHeadModel all the same
// (base_model_prefix: a checkpoint none of whose names start with the prefix is the base model's), so
// does load_pretrained: when no tensor of the directory starts with the family's prefix ("transformer."
// or "model."), every name but lm_head's (which is outside the base model, as transformers matches it)
// is read with the prefix added. Messages name the tensors as the file does.
#include "booster/nn/hf.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <vector>

#include "booster/checkpoint/atomic_file.h"
#include "booster/common/error.h"
#include "booster/common/input_file.h"
#include "booster/common/json_text.h"
#include "booster/nn/families.h"
#include "booster/nn/llama.h"
#include "booster/nn/model_size.h"
#include "booster/tensor/deferred.h"

namespace booster::nn {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// ------------------------------------------------------------------------------------------ name tables

// The family of a whole model (its declaration, families.h), or the ConfigError naming the model.
const ModelFamily& family_of_model(const Module& model) {
  const ModelFamily* family = family_of(model);
  BOOSTER_CHECK(family != nullptr && !family->hf_model_type.empty(), ConfigError, "save_pretrained: a ", model.name(),
                " has no Hugging Face format; a whole nn::Llama (model_type llama) or nn::GPT (gpt2) has");
  return *family;
}

std::string hf_name(const ModelFamily& f, const std::string& name) {
  for (const auto& [booster, hf] : f.names)
    if (name.compare(0, booster.size(), booster) == 0) return hf + name.substr(booster.size());
  BOOSTER_FAIL(ConfigError, "the ", f.hf_model_type, " name table has no Hugging Face name for parameter '", name, "'");
}

bool is_conv1d(const ModelFamily& f, const std::string& name) {
  return std::any_of(f.conv1d.begin(), f.conv1d.end(), [&](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  });
}

// ------------------------------------------------------------------------------------------ config.json

json read_json_file(const fs::path& file, const std::string& what) {
  // Not opened with an ifstream: a FIFO would block the open (Note [Inputs that are not files]).
  BOOSTER_CHECK(fs::exists(file), ConfigError, what, ": cannot read ", file.string());
  check_input_file<ConfigError>(file, what + ":", "give a JSON file");
  // The config's limits (Note [One JSON reader] in booster/common/json_text.h).
  return booster::read_json_file(file.string(), what + ": the file", JsonLimits{});
}

}  // namespace

// Reads config.json's keys with Hugging Face's defaults, naming the file in every complaint.
const json* HfConfigReader::find(const char* key) const {
  auto it = c.find(key);
  return it == c.end() || it->is_null() ? nullptr : &*it;
}

int64_t HfConfigReader::positive(const char* key, std::optional<int64_t> fallback) const {
  const json* v = find(key);
  BOOSTER_CHECK(v != nullptr || fallback, ConfigError, where, " has no \"", key, "\"");
  if (v == nullptr) return *fallback;
  BOOSTER_CHECK(v->is_number_integer() && v->get<int64_t>() > 0, ConfigError, where, ": \"", key,
                "\" must be a positive integer, got ", v->dump());
  return v->get<int64_t>();
}

double HfConfigReader::number(const char* key, double fallback) const {
  const json* v = find(key);
  if (v == nullptr) return fallback;
  BOOSTER_CHECK(v->is_number() && std::isfinite(v->get<double>()) && v->get<double>() > 0.0, ConfigError, where,
                ": \"", key, "\" must be a positive number, got ", v->dump());
  return v->get<double>();
}

bool HfConfigReader::boolean(const char* key, bool fallback) const {
  const json* v = find(key);
  if (v == nullptr) return fallback;
  BOOSTER_CHECK(v->is_boolean(), ConfigError, where, ": \"", key, "\" must be true or false, got ", v->dump());
  return v->get<bool>();
}

std::string HfConfigReader::text(const char* key, const std::string& fallback) const {
  const json* v = find(key);
  if (v == nullptr) return fallback;
  BOOSTER_CHECK(v->is_string(), ConfigError, where, ": \"", key, "\" must be a string, got ", v->dump());
  return v->get<std::string>();
}

void HfConfigReader::refuse_unless(bool ok, const char* key, const std::string& supported) const {
  BOOSTER_CHECK(ok, ConfigError, where, ": \"", key, "\" is ", c.at(key).dump(), ", which booster's ",
                c.value("model_type", std::string()), " does not implement (it supports ", supported, ")");
}

namespace {

// The overrides an hf model section may add: "activation_checkpointing", and the family's own
// (hf_overrides: the GPT's "dropout", whose value its from_hf checks).
json read_overrides(const json& o, const ModelFamily& family) {
  BOOSTER_CHECK(o.is_object(), ConfigError, "hf model: the overrides must be an object, got ", o.dump());
  std::string own;
  for (const std::string& key : family.hf_overrides) own += " and \"" + key + "\"";
  for (const auto& [key, v] : o.items()) {
    if (key == "activation_checkpointing") {
      BOOSTER_CHECK(v.is_boolean(), ConfigError, "'model.activation_checkpointing' must be true or false, got ", v.dump());
    } else {
      BOOSTER_CHECK(std::find(family.hf_overrides.begin(), family.hf_overrides.end(), key) != family.hf_overrides.end(),
                    ConfigError, "'model.", key, "' is not an option of a Hugging Face ", family.hf_model_type,
                    " model; it takes \"path\", \"activation_checkpointing\"", own);
    }
  }
  return o;
}

// The family config.json names, or a ConfigError refusing it by name.
const ModelFamily& hf_family(const json& c, const std::string& where) {
  BOOSTER_CHECK(c.is_object(), ConfigError, where, " is not a JSON object");
  const HfConfigReader r{c, where};
  // Without model_type, the class in "architectures" names the family (as transformers' AutoConfig does
  // for old files).
  std::string type = r.text("model_type", "");
  if (const json* arch = r.find("architectures"); type.empty() && arch && arch->is_array() && !arch->empty() &&
                                                   arch->front().is_string())
    if (const ModelFamily* f = find_hf_family(arch->front().get<std::string>())) type = f->hf_model_type;
  BOOSTER_CHECK(!type.empty(), ConfigError, where, " has no \"model_type\" (nor an \"architectures\" class booster ",
                "knows); booster reads \"llama\", \"mistral\", \"qwen2\" and \"gpt2\"");
  const ModelFamily* family = find_hf_family(type);
  if (family == nullptr || family->hf_model_type != type || !family->from_hf) refuse_family(where, type);
  return *family;
}

ModulePtr from_config(const json& c, const std::string& where, const json& overrides, uint64_t seed) {
  const ModelFamily& family = hf_family(c, where);
  return family.from_hf(HfConfigReader{c, where}, read_overrides(overrides, family), seed);
}

// ------------------------------------------------------------------------------------------ weight files

struct FileTensor {
  fs::path file;
  checkpoint::SafetensorsEntry entry;
};

// Every tensor of the directory's weights by name. Shards the index names that do not exist are
// problems; the tensors it places there are collected in `unreadable` (not reported again as missing).
std::map<std::string, FileTensor> index_weights(const fs::path& dir, std::vector<std::string>& problems,
                                                std::set<std::string>& unreadable) {
  std::map<std::string, FileTensor> out;
  auto add_file = [&](const fs::path& file, const std::set<std::string>* only) {
    for (checkpoint::SafetensorsEntry& e : checkpoint::read_safetensors_header(file).entries)
      if (only == nullptr || only->count(e.name)) {
        const std::string name = e.name;
        out[name] = FileTensor{file, std::move(e)};
      }
  };
  const fs::path single = dir / checkpoint::kModelFileName, index_file = dir / checkpoint::kModelIndexFileName;
  if (fs::exists(single)) {
    add_file(single, nullptr);
    return out;
  }
  BOOSTER_CHECK(fs::exists(index_file), ConfigError, "hf model ", dir.string(), ": holds neither ",
                checkpoint::kModelFileName, " nor ", checkpoint::kModelIndexFileName,
                " (booster reads safetensors weights, not pytorch_model.bin)");
  const json index = read_json_file(index_file, "hf model " + dir.string());
  BOOSTER_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(), ConfigError,
                "hf model ", dir.string(), ": ", index_file.string(), " has no \"weight_map\" object");
  std::map<std::string, std::set<std::string>> by_shard;
  for (const auto& [name, shard] : index["weight_map"].items()) {
    const std::string file = shard.is_string() ? shard.get<std::string>() : std::string();
    BOOSTER_CHECK(!file.empty() && file.find('/') == std::string::npos && file != "." && file != "..", ConfigError,
                  "hf model ", dir.string(), ": the weight_map entry of '", name, "' is ", shard.dump(),
                  ", not a file name in the model's directory");
    by_shard[file].insert(name);
  }
  for (const auto& [shard, names] : by_shard) {
    if (!fs::exists(dir / shard)) {
      problems.push_back(str("the index names shard ", shard, " (", names.size(), " tensors, e.g. ", *names.begin(),
                             "), which is missing"));
      unreadable.insert(names.begin(), names.end());
      continue;
    }
    add_file(dir / shard, &names);
    for (const std::string& name : names)
      if (!out.count(name)) {
        problems.push_back(str("the index places ", name, " in ", shard, ", which does not hold it"));
        unreadable.insert(name);
      }
  }
  return out;
}

// The tensors of a base model's file under the LM-head model's names (Note [A base model's names]):
// the family's prefix added to every name but lm_head's, and to the names of unreadable shards'
// tensors, when no name has it. Entries keep the names the file uses.
std::map<std::string, FileTensor> with_base_prefix(const ModelFamily& family, std::map<std::string, FileTensor> weights,
                                                   std::set<std::string>& unreadable) {
  const std::string& prefix = family.base_prefix;
  auto prefixed = [&](const std::string& name) { return name.compare(0, prefix.size(), prefix) == 0; };
  const bool has_prefix = std::any_of(weights.begin(), weights.end(), [&](const auto& kv) { return prefixed(kv.first); }) ||
                          std::any_of(unreadable.begin(), unreadable.end(), prefixed);
  if (has_prefix || (weights.empty() && unreadable.empty())) return weights;
  auto renamed_one = [&](const std::string& name) { return name.rfind("lm_head.", 0) == 0 ? name : prefix + name; };
  std::map<std::string, FileTensor> out;
  for (auto& [name, t] : weights) out.emplace(renamed_one(name), std::move(t));
  std::set<std::string> renamed;
  for (const std::string& name : unreadable) renamed.insert(renamed_one(name));
  unreadable = std::move(renamed);
  return out;
}

std::optional<DType> weight_dtype(const std::string& name) {
  if (name == "F32") return DType::Float32;
  if (name == "F16") return DType::Float16;
  if (name == "BF16") return DType::BFloat16;
  return std::nullopt;
}

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (const std::string& p : parts) out += (out.empty() ? "" : sep) + p;
  return out;
}

}  // namespace

// ------------------------------------------------------------------------------------------ in

ModulePtr model_from_hf_config(const json& hf_config, const json& overrides, uint64_t seed) {
  check_hf_sizes(hf_config, "Hugging Face config");  // Note [Sizes before building] (model_size.h)
  return from_config(hf_config, "Hugging Face config", overrides, seed);
}

ModulePtr load_pretrained(const fs::path& dir, const json& overrides, uint64_t seed) {
  BOOSTER_CHECK(fs::is_directory(dir), ConfigError, "hf model ", dir.string(),
                " is not a directory; give a Hugging Face model directory (config.json and model.safetensors)");
  const fs::path config_file = dir / "config.json";
  BOOSTER_CHECK(fs::exists(config_file), ConfigError, "hf model ", dir.string(),
                ": no config.json (a Hugging Face model directory holds config.json and model.safetensors)");
  const json config = read_json_file(config_file, "hf model " + dir.string());
  hf_family(config, config_file.string());  // an architecture booster lacks is named before any file is read
  {
    // Note [Sizes before building] (model_size.h): config.json's sizes against the weights' headers and
    // the limits, before a layer is built.
    std::vector<std::string> ignored;
    std::set<std::string> missing;
    std::map<std::string, std::vector<int64_t>> shapes;
    for (const auto& [name, t] : index_weights(dir, ignored, missing)) shapes[t.entry.name] = t.entry.shape;
    for (const std::string& name : missing) shapes.emplace(name, std::vector<int64_t>{});
    check_hf_sizes(config, config_file.string(), &shapes);
  }
  ModulePtr model;
  {
    LazyInitGuard lazy;  // nothing allocated: every parameter is about to point at the file instead
    model = from_config(config, config_file.string(), overrides, seed);
  }
  const ModelFamily& family = family_of_model(*model);
  const bool is_tied = family.tied && family.tied(*model);
  const std::regex buffers(family.buffers.empty() ? std::string("$^") : family.buffers);

  std::vector<std::string> problems;
  std::set<std::string> unreadable, used;
  const std::map<std::string, FileTensor> weights =
      with_base_prefix(family, index_weights(dir, problems, unreadable), unreadable);
  std::vector<std::pair<Tensor, DeferredFileTensor>> sources;
  for (const auto& [name, t] : model->named_parameters()) {
    const std::string hf = hf_name(family, name);
    const bool transposed = is_conv1d(family, name);
    Shape expected = t.shape();
    if (transposed) std::swap(expected[0], expected[1]);
    const auto it = weights.find(hf);
    if (it == weights.end()) {
      if (!unreadable.count(hf)) problems.push_back(str("missing ", hf, " ", expected));
      continue;
    }
    used.insert(hf);
    const checkpoint::SafetensorsEntry& e = it->second.entry;
    const std::optional<DType> dtype = weight_dtype(e.dtype);
    if (!dtype) problems.push_back(str(e.name, " is ", e.dtype, ", not F32, F16 or BF16"));
    if (e.shape != expected) problems.push_back(str(e.name, " has shape ", e.shape, ", expected ", expected));
    if (dtype && e.shape == expected)
      sources.emplace_back(t, DeferredFileTensor{it->second.file, e.begin, *dtype, e.shape, transposed});
  }
  for (const auto& [hf, ft] : weights) {
    const bool ignored = std::regex_match(hf, buffers) || (is_tied && hf == "lm_head.weight");
    if (!used.count(hf) && !ignored)
      problems.push_back(str("unexpected ", ft.entry.name, " ", ft.entry.shape, " ", ft.entry.dtype));
  }
  // The first 20 problems and a count: a file of 1.23 M stray tensors made a 37 MB line.
  constexpr size_t kShown = 20;
  const size_t total = problems.size();
  if (total > kShown) {
    const size_t more = problems.size() - kShown;
    problems.resize(kShown);
    problems.push_back(str("and ", more, " more"));
  }
  BOOSTER_CHECK(problems.empty(), ConfigError, "hf model ", dir.string(), ": the weights do not fit the ",
                family.hf_model_type, " model its config.json describes (", total,
                total == 1 ? " problem): " : " problems): ", join(problems, "; "));

  for (auto& [t, source] : sources)
    BOOSTER_CHECK(defer_from_file(t, std::move(source)), StateError, "load_pretrained: parameter ", t.name(),
                  " was allocated while the model was built");
  if (!LazyInitGuard::enabled()) {
    for (const Tensor& t : model->parameters()) materialize(t);
    for (const Tensor& t : model->buffers()) materialize(t);
  }
  return model;
}

ModulePtr make_hf(const json& cfg, uint64_t seed) {
  BOOSTER_CHECK(cfg.is_object() && cfg.contains("path") && cfg["path"].is_string(), ConfigError,
                "'model.path' must name a Hugging Face model directory for model type \"hf\", got ",
                cfg.is_object() && cfg.contains("path") ? cfg["path"].dump() : std::string("nothing"));
  json overrides = cfg;
  overrides.erase("type");
  overrides.erase("path");
  return load_pretrained(cfg["path"].get<std::string>(), overrides, seed);
}

// ------------------------------------------------------------------------------------------ out

json hf_config_of(const Module& model) {
  const ModelFamily& family = family_of_model(model);
  const std::vector<Tensor> params = model.parameters();
  const DType dtype = params.empty() ? DType::Float32 : params.front().dtype();
  json out = family.to_hf(model);
  out["torch_dtype"] = dtype == DType::Float16 ? "float16" : dtype == DType::BFloat16 ? "bfloat16" : "float32";
  return out;
}

HfTensorName hf_tensor_name(const Module& model, const std::string& name) {
  const ModelFamily& family = family_of_model(model);
  return {hf_name(family, name), is_conv1d(family, name)};
}

void save_pretrained(const Module& model, const fs::path& out_dir, const SavePretrainedOptions& options) {
  const ModelFamily& family = family_of_model(model);
  checkpoint::TensorMap tensors;
  for (const auto& [name, t] : model.named_parameters()) {
    Tensor value = t.detach();
    if (is_conv1d(family, name)) value = value.transpose(0, 1).contiguous();
    tensors.emplace(hf_name(family, name), value);
  }
  checkpoint::save_model(out_dir, tensors, options.max_shard_bytes);
  json config = options.base_config.is_object() ? options.base_config : json::object();
  config.update(hf_config_of(model));
  checkpoint::write_text_file_atomically(out_dir / "config.json", config.dump(2) + "\n");
}

uint64_t parse_byte_size(const std::string& text) {
  std::string t;
  for (char c : text)
    if (!std::isspace(static_cast<unsigned char>(c))) t += char(std::toupper(static_cast<unsigned char>(c)));
  static const std::regex pattern(R"((\d+(?:\.\d+)?)((?:[KMGT]I?)?B)?)");
  std::smatch m;
  BOOSTER_CHECK(std::regex_match(t, m, pattern), ConfigError, "the size '", text,
                "' is not a number of bytes with an optional unit (B, KB, MB, GB, TB, or KiB .. TiB), e.g. 5GB");
  const std::string unit = m[2].str();
  double scale = 1.0;
  if (unit.size() >= 2) {
    const int power = int(std::string("KMGT").find(unit[0])) + 1;
    scale = std::pow(unit[1] == 'I' ? 1024.0 : 1000.0, power);
  }
  // strtod, not stod: 400 digits are infinity here (refused below), not std::out_of_range.
  const double bytes = std::strtod(m[1].str().c_str(), nullptr) * scale;
  BOOSTER_CHECK(bytes >= 1.0, ConfigError, "the size '", text, "' must be at least one byte");
  BOOSTER_CHECK(bytes < 1.8e19, ConfigError, "the size '", text.size() > 40 ? text.substr(0, 40) + "..." : text,
                "' is more bytes than a file can hold (2^64); give a size such as 5GB");
  return uint64_t(bytes);
}

}  // namespace booster::nn
