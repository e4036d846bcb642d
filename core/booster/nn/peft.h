// PEFT's LoRA adapter directories in and out: what Hugging Face's PEFT writes with save_pretrained and
// loads with PeftModel.from_pretrained, so adapters trained here run there and the other way round.
//
//   nn::apply_lora(*model, nn::LoraConfig::from_peft("my-adapter"));     // adapters + PEFT's A and B
//   nn::save_peft_adapter(*model, lora, "out/", {.base_model_name_or_path = "TinyLlama-1.1B"});
//   model_without_lora->load_state_dict(nn::merge_lora(*model, lora));   // W + s B A
//
// A directory holds (Note [PEFT's files] in peft.cpp)
//   adapter_config.json        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r", "lora_alpha",
//                               "lora_dropout", "target_modules", "use_rslora", "fan_in_fan_out",
//                               "bias": "none", "base_model_name_or_path", ...}, PEFT 0.13's LoraConfig
//   adapter_model.safetensors  "base_model.model.<Hugging Face module path>.lora_A.weight" [r, in] and
//                               ".lora_B.weight" [out, r] per adapted layer (no adapter name), for a
//                               Llama "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
//                               for a GPT-2 "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"
// A GPT-2's Conv1D layers store their weight [in, out]; PEFT's adapters on them are still A [r, in] and
// B [out, r] (only its merge transposes B A), and fan_in_fan_out says the base is a Conv1D.
#pragma once

#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "booster/checkpoint/safetensors.h"
#include "booster/nn/lora.h"
#include "booster/nn/module.h"

namespace booster::nn {

inline constexpr const char* kPeftConfigFileName = "adapter_config.json";
inline constexpr const char* kPeftWeightsFileName = "adapter_model.safetensors";

// A PEFT LoRA adapter directory, read.
struct LoraAdapter {
  std::filesystem::path dir;
  LoraConfig config;                    // r, alpha, dropout, target_modules, use_rslora; init_from = dir
  bool fan_in_fan_out = false;          // the adapted layers are Conv1D (GPT-2)
  std::string base_model_name_or_path;  // empty when null
  nlohmann::json adapter_config;        // adapter_config.json as read
  // The adapters by Hugging Face name, PEFT's "base_model.model." taken off:
  // "model.layers.0.self_attn.q_proj.lora_A.weight" -> [r, in]. Empty from read_peft_config.
  checkpoint::TensorMap tensors;
};

// adapter_config.json of `dir` alone. ConfigError naming the file for: no such directory, no
// adapter_config.json (naming what the directory holds), JSON that is not an object, peft_type other
// than "LORA", a field of the wrong type or range (r, lora_alpha, lora_dropout, target_modules as a list
// of names: a regular-expression string is refused), and settings booster's LoRA does not implement
// (use_dora, bias other than "none", modules_to_save, rank_pattern / alpha_pattern, layers_to_transform,
// layer_replication), each by name.
LoraAdapter read_peft_config(const std::filesystem::path& dir);
// read_peft_config and adapter_model.safetensors: CheckpointError for a missing or damaged file, a
// name that is not "base_model.model.<path>.lora_A.weight" or ".lora_B.weight", an A whose rows or a B
// whose columns are not r, an A without its B.
LoraAdapter read_peft_adapter(const std::filesystem::path& dir);

// Copies the adapter's A and B into `model`'s adapters (apply_lora made them; their names mapped to
// Hugging Face's as save_pretrained maps them). One CheckpointError listing every tensor of the model's
// adapters that the file lacks, every tensor of the file the model has no adapter for (an adapter of
// another base or other target_modules) and every shape that differs (name, the model's shape, the
// file's). Converts the file's dtype to the parameters'.
void load_lora_weights(Module& model, const LoraAdapter& adapter);

struct PeftSaveOptions {
  std::string base_model_name_or_path;  // adapter_config.json's; empty: null
  DType dtype = DType::Float32;         // the adapters' dtype in the file
};

// The adapter_config.json save_peft_adapter writes for `model`'s adapters made with `config`.
nlohmann::json peft_adapter_config(const Module& model, const LoraConfig& config, const PeftSaveOptions& options = {});
// Writes `model`'s adapters as a PEFT directory (created if needed; each file replaced atomically).
// StateError for a model without adapters; ConfigError for a model without Hugging Face names (a whole
// nn::Llama or nn::GPT has them).
void save_peft_adapter(const Module& model, const LoraConfig& config, const std::filesystem::path& dir,
                       const PeftSaveOptions& options = {});

// The state dict of `model` without its adapters, each adapted Linear's weight W replaced by
// W + s B A, s = config.scaling(), computed in float64 and rounded once to W's dtype: what loads into
// the base model (built without LoRA) as the merged model. StateError for a model without adapters.
StateDict merge_lora(const Module& model, const LoraConfig& config);

}  // namespace booster::nn
