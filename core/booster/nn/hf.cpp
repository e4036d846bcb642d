// Hugging Face checkpoints in and out (hf.h): the families' name tables, config.json in both
// directions, and the matching of a file's tensors to a model's parameters.
//
// Note [Hugging Face names]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A family is a booster model plus a table: booster name prefix -> Hugging Face name prefix (first
// match wins), the parameters Hugging Face stores transposed, and the tensors of its files that are not
// parameters. Llama's names are Hugging Face's already (nn::Llama is built that way), so its table is
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
#include "booster/common/json_text.h"
#include "booster/nn/llama.h"
#include "booster/nn/models.h"
#include "booster/tensor/deferred.h"

namespace booster::nn {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// ------------------------------------------------------------------------------------------ name tables

struct NameRule {
  std::string booster, hf;  // name prefixes
};

struct Family {
  std::string model_type, architecture;
  std::string base_prefix;  // the base model's name in the LM-head model (Note [A base model's names])
  std::vector<NameRule> names;
  std::vector<std::string> conv1d;  // booster-name suffixes of weights stored [in, out]
  std::regex buffers;               // tensors of the files that are not parameters
};

const Family& gpt2_family() {
  static const Family family{
      "gpt2",
      "GPT2LMHeadModel",
      "transformer.",
      {{"wte.", "transformer.wte."},
       {"wpe.", "transformer.wpe."},
       {"blocks.", "transformer.h."},
       {"ln_f.", "transformer.ln_f."},
       {"lm_head.", "lm_head."}},
      {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"},
      std::regex(R"(transformer\.h\.\d+\.attn\.(masked_)?bias)")};
  return family;
}

// Llama, Mistral and Qwen2 (llama.h's decoder_families(): Note [Decoder families]) share one table.
const Family& llama_family(const std::string& model_type) {
  static const std::map<std::string, Family> families = [] {
    std::map<std::string, Family> out;
    for (const DecoderFamily& f : decoder_families())
      out.emplace(f.model_type, Family{f.model_type, f.architecture, "model.", {{"", ""}}, {},
                                       std::regex(R"(model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq)")});
    return out;
  }();
  return families.at(model_type);
}

const Family& family_of(const Module& model) {
  if (dynamic_cast<const GPT*>(&model)) return gpt2_family();
  if (auto* llama = dynamic_cast<const Llama*>(&model)) return llama_family(llama->config.model_type);
  BOOSTER_FAIL(ConfigError, "save_pretrained: a ", model.name(),
               " has no Hugging Face format; a whole nn::Llama (model_type llama) or nn::GPT (gpt2) has");
}

std::string hf_name(const Family& f, const std::string& name) {
  for (const NameRule& rule : f.names)
    if (name.compare(0, rule.booster.size(), rule.booster) == 0) return rule.hf + name.substr(rule.booster.size());
  BOOSTER_FAIL(ConfigError, "the ", f.model_type, " name table has no Hugging Face name for parameter '", name, "'");
}

bool is_conv1d(const Family& f, const std::string& name) {
  return std::any_of(f.conv1d.begin(), f.conv1d.end(), [&](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  });
}

bool tied(const Module& model) {
  if (auto* gpt = dynamic_cast<const GPT*>(&model)) return gpt->config.tie_word_embeddings;
  if (auto* llama = dynamic_cast<const Llama*>(&model)) return llama->config.tie_word_embeddings;
  return false;
}

// ------------------------------------------------------------------------------------------ config.json

json read_json_file(const fs::path& file, const std::string& what) {
  std::ifstream in(file, std::ios::binary);
  BOOSTER_CHECK(in.good(), ConfigError, what, ": cannot read ", file.string());
  // The config's limits (Note [One JSON reader] in booster/common/json_text.h).
  return booster::read_json_file(file.string(), what + ": the file", JsonLimits{});
}

// Reads config.json's keys with Hugging Face's defaults, naming the file in every complaint.
struct ConfigReader {
  const json& c;
  std::string where;

  const json* find(const char* key) const {
    auto it = c.find(key);
    return it == c.end() || it->is_null() ? nullptr : &*it;
  }
  int64_t positive(const char* key, std::optional<int64_t> fallback = std::nullopt) const {
    const json* v = find(key);
    BOOSTER_CHECK(v != nullptr || fallback, ConfigError, where, " has no \"", key, "\"");
    if (v == nullptr) return *fallback;
    BOOSTER_CHECK(v->is_number_integer() && v->get<int64_t>() > 0, ConfigError, where, ": \"", key,
                  "\" must be a positive integer, got ", v->dump());
    return v->get<int64_t>();
  }
  double number(const char* key, double fallback) const {
    const json* v = find(key);
    if (v == nullptr) return fallback;
    BOOSTER_CHECK(v->is_number() && std::isfinite(v->get<double>()) && v->get<double>() > 0.0, ConfigError, where,
                  ": \"", key, "\" must be a positive number, got ", v->dump());
    return v->get<double>();
  }
  bool boolean(const char* key, bool fallback) const {
    const json* v = find(key);
    if (v == nullptr) return fallback;
    BOOSTER_CHECK(v->is_boolean(), ConfigError, where, ": \"", key, "\" must be true or false, got ", v->dump());
    return v->get<bool>();
  }
  std::string text(const char* key, const std::string& fallback) const {
    const json* v = find(key);
    if (v == nullptr) return fallback;
    BOOSTER_CHECK(v->is_string(), ConfigError, where, ": \"", key, "\" must be a string, got ", v->dump());
    return v->get<std::string>();
  }
  // A feature the family does not implement: refused rather than silently computed differently.
  void refuse_unless(bool ok, const char* key, const std::string& supported) const {
    BOOSTER_CHECK(ok, ConfigError, where, ": \"", key, "\" is ", c.at(key).dump(), ", which booster's ",
                  c.value("model_type", std::string()), " does not implement (it supports ", supported, ")");
  }
};

// The overrides a config section may add to a Hugging Face model.
struct Overrides {
  std::optional<bool> activation_checkpointing;
  std::optional<double> dropout;
};

Overrides read_overrides(const json& o, const std::string& model_type) {
  BOOSTER_CHECK(o.is_object(), ConfigError, "hf model: the overrides must be an object, got ", o.dump());
  Overrides out;
  for (const auto& [key, v] : o.items()) {
    if (key == "activation_checkpointing") {
      BOOSTER_CHECK(v.is_boolean(), ConfigError, "'model.activation_checkpointing' must be true or false, got ", v.dump());
      out.activation_checkpointing = v.get<bool>();
    } else if (key == "dropout" && model_type == "gpt2") {
      BOOSTER_CHECK(v.is_number() && v.get<double>() >= 0.0 && v.get<double>() < 1.0, ConfigError,
                    "'model.dropout' must be a number in [0, 1), got ", v.dump());
      out.dropout = v.get<double>();
    } else {
      BOOSTER_FAIL(ConfigError, "'model.", key, "' is not an option of a Hugging Face ", model_type,
                   " model; it takes \"path\", \"activation_checkpointing\"",
                   model_type == "gpt2" ? " and \"dropout\"" : "");
    }
  }
  return out;
}

ModulePtr gpt2_from_config(const ConfigReader& r, const Overrides& o, uint64_t seed) {
  GPTConfig g;
  g.vocab_size = r.positive("vocab_size", 50257);
  g.context = r.positive("n_positions", 1024);
  g.width = r.positive("n_embd", 768);
  g.layers = r.positive("n_layer", 12);
  g.heads = r.positive("n_head", 12);
  g.layer_norm_eps = r.number("layer_norm_epsilon", 1e-5);
  g.tie_word_embeddings = r.boolean("tie_word_embeddings", true);
  const std::string act = r.text("activation_function", "gelu_new");
  if (r.find("activation_function"))
    r.refuse_unless(act == "gelu_new" || act == "gelu_pytorch_tanh", "activation_function",
                    "\"gelu_new\", GELU's tanh approximation");
  if (const json* n_inner = r.find("n_inner"))
    r.refuse_unless(*n_inner == 4 * g.width, "n_inner", "null, i.e. 4 n_embd");
  if (r.find("scale_attn_by_inverse_layer_idx"))
    r.refuse_unless(!r.boolean("scale_attn_by_inverse_layer_idx", false), "scale_attn_by_inverse_layer_idx", "false");
  if (r.find("scale_attn_weights")) r.refuse_unless(r.boolean("scale_attn_weights", true), "scale_attn_weights", "true");
  BOOSTER_CHECK(g.width % g.heads == 0, ConfigError, r.where, ": n_embd ", g.width, " is not divisible by n_head ", g.heads);
  g.dropout = o.dropout.value_or(0.0);
  g.activation_checkpointing = o.activation_checkpointing.value_or(false);
  return std::make_shared<GPT>(g, seed);
}

ModulePtr llama_from_config(const ConfigReader& r, const Overrides& o, const DecoderFamily& family, uint64_t seed) {
  json cfg = {{"type", family.model_type}};
  cfg["vocab_size"] = r.positive("vocab_size");
  cfg["hidden_size"] = r.positive("hidden_size");
  cfg["intermediate_size"] = r.positive("intermediate_size");
  cfg["num_hidden_layers"] = r.positive("num_hidden_layers");
  cfg["num_attention_heads"] = r.positive("num_attention_heads");
  cfg["num_key_value_heads"] = r.positive("num_key_value_heads", cfg["num_attention_heads"].get<int64_t>());
  cfg["max_position_embeddings"] = r.positive("max_position_embeddings", family.default_max_positions);
  cfg["rms_norm_eps"] = r.number("rms_norm_eps", 1e-6);
  cfg["rope_theta"] = r.number("rope_theta", family.default_rope_theta);
  cfg["tie_word_embeddings"] = r.boolean("tie_word_embeddings", false);
  // rope_scaling and the family's own keys as config.json writes them (null kept: "no window");
  // make_llama checks them (an unsupported rope_type is refused there, naming what is supported).
  if (const json* scaling = r.find("rope_scaling")) cfg["rope_scaling"] = *scaling;
  for (const auto& [key, fallback] : family.extra_keys)
    if (r.c.contains(key)) cfg[key] = r.c.at(key);
  if (r.find("hidden_act")) r.refuse_unless(r.text("hidden_act", "silu") == "silu", "hidden_act", "\"silu\"");
  if (r.find("attention_bias")) r.refuse_unless(!r.boolean("attention_bias", false), "attention_bias", "false");
  if (r.find("mlp_bias")) r.refuse_unless(!r.boolean("mlp_bias", false), "mlp_bias", "false");
  if (r.find("head_dim"))
    r.refuse_unless(cfg["num_attention_heads"].get<int64_t>() * r.positive("head_dim") == cfg["hidden_size"].get<int64_t>(),
                    "head_dim", "hidden_size / num_attention_heads");
  if (o.activation_checkpointing) cfg["activation_checkpointing"] = *o.activation_checkpointing;
  try {
    return make_llama(cfg, seed);
  } catch (const ConfigError& e) {
    BOOSTER_FAIL(ConfigError, r.where, ": ", e.what());
  }
}

ModulePtr from_config(const json& c, const std::string& where, const json& overrides, uint64_t seed) {
  BOOSTER_CHECK(c.is_object(), ConfigError, where, " is not a JSON object");
  const ConfigReader r{c, where};
  // Without model_type, the class in "architectures" names the family (as transformers' AutoConfig does
  // for old files).
  std::string type = r.text("model_type", "");
  if (const json* arch = r.find("architectures"); type.empty() && arch && arch->is_array() && !arch->empty() &&
                                                   arch->front().is_string()) {
    const std::string name = arch->front().get<std::string>();
    if (name == "GPT2LMHeadModel") type = "gpt2";
    for (const DecoderFamily& f : decoder_families())
      if (f.architecture == name) type = f.model_type;
  }
  BOOSTER_CHECK(!type.empty(), ConfigError, where, " has no \"model_type\" (nor an \"architectures\" class booster ",
                "knows); booster reads \"llama\", \"mistral\", \"qwen2\" and \"gpt2\"");
  const DecoderFamily* family = find_decoder_family(type);
  if (type != "gpt2" && family == nullptr) refuse_family(where, type);
  const Overrides o = read_overrides(overrides, type);
  return type == "gpt2" ? gpt2_from_config(r, o, seed) : llama_from_config(r, o, *family, seed);
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
std::map<std::string, FileTensor> with_base_prefix(const Family& family, std::map<std::string, FileTensor> weights,
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
  return from_config(hf_config, "Hugging Face config", overrides, seed);
}

ModulePtr load_pretrained(const fs::path& dir, const json& overrides, uint64_t seed) {
  BOOSTER_CHECK(fs::is_directory(dir), ConfigError, "hf model ", dir.string(),
                " is not a directory; give a Hugging Face model directory (config.json and model.safetensors)");
  const fs::path config_file = dir / "config.json";
  BOOSTER_CHECK(fs::exists(config_file), ConfigError, "hf model ", dir.string(),
                ": no config.json (a Hugging Face model directory holds config.json and model.safetensors)");
  const json config = read_json_file(config_file, "hf model " + dir.string());
  ModulePtr model;
  {
    LazyInitGuard lazy;  // nothing allocated: every parameter is about to point at the file instead
    model = from_config(config, config_file.string(), overrides, seed);
  }
  const Family& family = family_of(*model);
  const bool is_tied = tied(*model);

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
    const bool ignored = std::regex_match(hf, family.buffers) || (is_tied && hf == "lm_head.weight");
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
                family.model_type, " model its config.json describes (", total,
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
  const std::vector<Tensor> params = model.parameters();
  const DType dtype = params.empty() ? DType::Float32 : params.front().dtype();
  const std::string torch_dtype = dtype == DType::Float16 ? "float16" : dtype == DType::BFloat16 ? "bfloat16" : "float32";
  if (auto* gpt = dynamic_cast<const GPT*>(&model)) {
    const GPTConfig& g = gpt->config;
    return {{"architectures", {"GPT2LMHeadModel"}},
            {"model_type", "gpt2"},
            {"vocab_size", g.vocab_size},
            {"n_positions", g.context},
            {"n_embd", g.width},
            {"n_layer", g.layers},
            {"n_head", g.heads},
            {"n_inner", nullptr},
            {"layer_norm_epsilon", g.layer_norm_eps},
            {"activation_function", "gelu_new"},
            {"tie_word_embeddings", g.tie_word_embeddings},
            {"resid_pdrop", g.dropout},
            {"embd_pdrop", g.dropout},
            {"attn_pdrop", 0.0},  // nn::GPT applies no dropout to the attention weights
            {"torch_dtype", torch_dtype}};
  }
  if (auto* llama = dynamic_cast<const Llama*>(&model)) {
    const LlamaConfig& c = llama->config;
    const DecoderFamily* family = find_decoder_family(c.model_type);
    BOOSTER_CHECK(family != nullptr, ConfigError, "save_pretrained: a Llama of model_type \"", c.model_type,
                  "\", which has no Hugging Face family");
    json rope_scaling = nullptr;
    if (c.rope_scaling.type == "linear") rope_scaling = {{"rope_type", "linear"}, {"factor", c.rope_scaling.factor}};
    if (c.rope_scaling.type == "llama3")
      rope_scaling = {{"rope_type", "llama3"},
                      {"factor", c.rope_scaling.factor},
                      {"low_freq_factor", c.rope_scaling.low_freq_factor},
                      {"high_freq_factor", c.rope_scaling.high_freq_factor},
                      {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
    json out = {{"architectures", {family->architecture}},
            {"model_type", c.model_type},
            {"vocab_size", c.vocab_size},
            {"hidden_size", c.hidden_size},
            {"intermediate_size", c.intermediate_size},
            {"num_hidden_layers", c.num_hidden_layers},
            {"num_attention_heads", c.num_attention_heads},
            {"num_key_value_heads", c.num_key_value_heads},
            {"max_position_embeddings", c.max_position_embeddings},
            {"rms_norm_eps", c.rms_norm_eps},
            {"rope_theta", c.rope_theta},
            {"rope_scaling", rope_scaling},
            {"hidden_act", "silu"},
            {"tie_word_embeddings", c.tie_word_embeddings},
            {"torch_dtype", torch_dtype}};
    if (c.model_type == "llama") out["attention_bias"] = false, out["mlp_bias"] = false;
    // The family's own keys (Note [Qwen2's window layers]): the window as config.json writes it.
    for (const auto& [key, fallback] : family->extra_keys) {
      if (key == "sliding_window") out[key] = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
      if (key == "use_sliding_window") out[key] = c.sliding_window > 0;
      if (key == "max_window_layers") out[key] = c.max_window_layers;
    }
    return out;
  }
  family_of(model);  // throws the ConfigError naming the model
  return json();
}

HfTensorName hf_tensor_name(const Module& model, const std::string& name) {
  const Family& family = family_of(model);
  return {hf_name(family, name), is_conv1d(family, name)};
}

void save_pretrained(const Module& model, const fs::path& out_dir, const SavePretrainedOptions& options) {
  const Family& family = family_of(model);
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
