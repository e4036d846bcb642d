// Model families declared once (Note [Model families] in families.cpp): a family is one ModelFamily
// value, registered by a static next to the family's code (nn/gpt_family.cpp, nn/llama_family.cpp),
// and everything that used to ask "is this the GPT?" reads the declaration instead: make_model's
// registration, the Hugging Face reader and writer (hf.cpp), the config schema, `booster check` and its
// memory estimate, and the tensor-parallel split of the parameters (shard_policy.h).
//
//   const nn::ModelFamily* gpt = nn::find_model_family("gpt");          // by make_model's "type"
//   const nn::ModelFamily* same = nn::find_hf_family("gpt2");            // by config.json's model_type
//   const nn::ModelFamily* of = nn::family_of(*model);                   // by the built model
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "booster/nn/model_registry.h"
#include "booster/nn/module.h"
#include "booster/nn/shard_policy.h"

namespace booster::nn {

// One make_model key of a family whose keys are declared as data (the GPT's): its kind and bounds, the
// default the config schema fills in, whether make_model requires it, and the config.json key that
// carries it with Hugging Face's default ("": not read from config.json).
struct FamilyKey {
  enum class Kind { Integer, Number, Boolean };
  std::string name;
  Kind kind = Kind::Integer;
  nlohmann::json default_value;  // the schema's default
  bool required = false;         // make_model refuses a config without it
  // Integer: >= min, and at most the schema's depth limit when `depth`; Number: in [min, max).
  double min = 0, max = std::numeric_limits<double>::infinity();
  bool depth = false;
  std::string help;  // the schema's line
  std::string hf_key;
  nlohmann::json hf_default;
};

// How one Linear of a repeated layer splits under tensor parallelism: the dimension of its weight that
// is divided (0: column-parallel, output features; 1: row-parallel, input features) into `chunks`
// blocks each split alike (3: a fused [q; k; v]). A bias follows a column split's rows and stays whole
// under a row split; LoRA's B follows a column split, A a row split (Note [LoRA under tensor
// parallelism] in lora.cpp).
struct LinearSplit {
  std::string path;  // under the layer: "attn.c_attn", "self_attn.q_proj"
  int64_t dim = 0;
  int64_t chunks = 1;
};

// The sizes the memory estimate counts (Note [Memory estimate] in config/memory_estimate.cpp), read
// from a make_model config or a config.json by the family.
struct TransformerSizes {
  std::string layout;  // "gpt" (GPT-2's blocks) or "llama" (RMSNorm, GQA, SwiGLU)
  int64_t vocab = 0, width = 0, layers = 0, heads = 0, kv_heads = 0, intermediate = 0, positions = 0;
  bool tied = false, checkpointing = false;
  bool qkv_bias = false;
};

// Reads config.json's keys with Hugging Face's defaults, naming the file in every complaint (hf.cpp's
// reader, shared with the families' config.json hooks).
struct HfConfigReader {
  const nlohmann::json& c;
  std::string where;

  const nlohmann::json* find(const char* key) const;
  int64_t positive(const char* key, std::optional<int64_t> fallback = std::nullopt) const;
  double number(const char* key, double fallback) const;
  bool boolean(const char* key, bool fallback) const;
  std::string text(const char* key, const std::string& fallback) const;
  // A feature the family does not implement: refused rather than silently computed differently.
  void refuse_unless(bool ok, const char* key, const std::string& supported) const;
};

struct ModelFamily {
  // ---- identity
  std::string type;           // make_model's "type" ("gpt", "llama", "mistral", "qwen2")
  std::string module_name;    // Module::name() of the built model: its shard policy's key ("GPT", "Llama")
  std::string hf_model_type;  // config.json's model_type ("gpt2", "llama", ...)
  std::string architecture;   // config.json's architectures[0] ("GPT2LMHeadModel", ...)
  // Where make_model lists the type among the built-ins (registered_models(): smaller first).
  double listing_order = 0;

  // ---- config keys
  std::vector<FamilyKey> keys;  // declared as data (the GPT); empty for a family with its own parser
  // Pairs of keys (a, b) where b must divide a ("width" by "heads"), checked by the schema too.
  std::vector<std::pair<std::string, std::string>> divisible;
  // The key of the longest sequence, checked by the schema against the data's ("context"); empty: the
  // built model says (CausalLM::max_positions, checked by booster check's model check).
  std::string context_key;
  ModelFactory make;            // make_model's factory for `type`
  // make_model's config of the model a config.json describes (a ConfigError names the file), and the
  // config.json of a built model (save_pretrained's).
  std::function<ModulePtr(const HfConfigReader&, const nlohmann::json& overrides, uint64_t seed)> from_hf;
  std::function<nlohmann::json(const Module&)> to_hf;
  // Overrides an hf model section may add beyond "path" and "activation_checkpointing" ("dropout").
  std::vector<std::string> hf_overrides;
  // The memory estimate's sizes from a make_model section, or from the config.json of an hf section's
  // directory when hf_config is set (nullopt: not readable).
  std::function<std::optional<TransformerSizes>(const nlohmann::json& model, const nlohmann::json* hf_config)> sizes;

  // ---- the built model
  std::function<bool(const Module&)> owns;  // whether a whole model is of this family
  std::function<bool(const Module&)> tied;  // its lm_head is the embedding's tensor

  // ---- Hugging Face tensor names (Note [Hugging Face names] in hf.cpp)
  std::string base_prefix;                                  // the base model's prefix in the LM-head model
  std::vector<std::pair<std::string, std::string>> names;   // booster prefix -> HF prefix (first match)
  std::vector<std::string> conv1d;                          // booster-name suffixes stored [in, out]
  std::string buffers;                                      // regex: tensors of the files that are not parameters

  // ---- tensor parallelism (Note [Shard policies] in shard_policy.cpp)
  std::string layer_prefix;                 // of layer i's names: layer_prefix + i + "."
  std::vector<LinearSplit> layer_splits;    // the Linears of a layer and their split
  std::string embedding, head;              // vocabulary-parallel parameters (the head skipped when tied)
  ShardPolicy shard_policy;                 // registered under module_name
};

// Adds a family (its make_model type, its shard policy) when the library loads: called by a static
// next to the family. ValueError for a type or Hugging Face model_type registered already.
void register_model_family(ModelFamily family);
// Every registered family, in listing order.
std::vector<const ModelFamily*> model_families();
// The family of make_model's `type`, of config.json's model_type or architecture, of a built model;
// nullptr when none.
const ModelFamily* find_model_family(const std::string& type);
const ModelFamily* find_hf_family(const std::string& model_type_or_architecture);
const ModelFamily* family_of(const Module& model);

// make_model's check of a config against a family's declared keys: ConfigError for an unknown key
// (listing the allowed ones), a missing required one, a value of the wrong kind or out of bounds, or
// sizes that do not divide (`divisible`).
void check_family_keys(const ModelFamily& family, const nlohmann::json& cfg);

// The parameters a family splits under tensor parallelism (ShardedModel::shards) for a model of
// `layers` layers whose parameters are `names`: each layer's Linears by the family's table, biases and
// LoRA adapters following their weight, the embedding and (unless tied) the head vocabulary-parallel.
std::map<std::string, ShardSpec> family_shards(const ModelFamily& family, const Module& model, int64_t layers);

// The sub-module at dotted `path` under `module` ("attn.c_attn"), or nullptr.
ModulePtr submodule(const ModulePtr& module, const std::string& path);
// LoRA adapters of a layer's Linears moved onto their tensor-parallel split, each by the family's
// table (split_lora in lora.h): `full` the whole model's layer, `split` this rank's.
void split_layer_lora(const ModelFamily& family, const ModulePtr& full, const ModulePtr& split,
                      distributed::ProcessGroup& group);

}  // namespace booster::nn
