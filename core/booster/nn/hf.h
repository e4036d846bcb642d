// Hugging Face checkpoints in and out: a model directory as transformers' save_pretrained writes it
// (config.json, and model.safetensors or model.safetensors.index.json with its shards) becomes a
// booster model, and a booster model becomes such a directory again.
//
//   nn::ModulePtr model = nn::load_pretrained("TinyLlama-1.1B");           // weights loaded
//   auto same = nn::make_model({{"type", "hf"}, {"path", "TinyLlama-1.1B"}}, seed);   // the config's way
//   nn::save_pretrained(*model, "out/");                                    // config.json + safetensors
//
// The families: config.json's model_type "llama", "mistral" and "qwen2" (nn::Llama, whose names are
// Hugging Face's; llama.h's decoder_families(), Note [Decoder families] in llama.cpp) and "gpt2" (nn::GPT with tied embeddings; its names and GPT-2's Conv1D layout are mapped by a table,
// Note [Hugging Face names] in hf.cpp). Weights stored as F32, F16 or BF16 become float32 parameters
// (a strategy converts them later). Under a LazyInitGuard the model stays deferred and each parameter
// reads its tensor from the file only when allocated, a tensor-parallel shard only its own part (Note
// [Weights from a file] in booster/tensor/deferred.cpp): under hybrid_parallel (tp, pp) `booster train`
// with {"type": "hf"} reads on each rank only the parts of the weights that rank holds, and under
// low_level_zero stage 3 only the rank's shard (Note [ZeRO-3 shards from the parameters]).
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "booster/checkpoint/safetensors.h"
#include "booster/nn/module.h"

namespace booster::nn {

// The model of Hugging Face model directory `dir`, its weights loaded (deferred under a LazyInitGuard).
// `overrides` may set "activation_checkpointing" (both families) and "dropout" (gpt2: the one rate of
// nn::GPT; config.json's *_pdrop are not applied, so fine-tuning runs without dropout unless set).
// One ConfigError for: no config.json, an unknown model_type or a config the family cannot express
// (a rope_scaling other than linear and llama3, biases in a Llama, another activation; another
// architecture such as gemma or phi, by name), an index naming a shard that is missing, and, listed
// together, every tensor that is missing, unexpected, misshapen or of a dtype other than F32/F16/BF16
// (name, expected shape, found shape or dtype). Known non-parameter buffers (GPT-2's attn.bias and
// attn.masked_bias, Llama's rotary_emb.inv_freq, a tied lm_head.weight) are ignored. A file saved from
// the base model, whose names lack "transformer." (gpt2) or "model." (llama), as the GPT-2 checkpoints
// on Hugging Face's hub do, loads as transformers loads it (Note [A base model's names] in hf.cpp).
ModulePtr load_pretrained(const std::filesystem::path& dir, const nlohmann::json& overrides = nlohmann::json::object(),
                          uint64_t seed = 0);

// The model a Hugging Face config.json describes, with initial (not pretrained) weights: what
// load_pretrained builds before it attaches the file's tensors. `booster export` builds a checkpoint's
// model this way before loading the checkpoint's weights into it.
ModulePtr model_from_hf_config(const nlohmann::json& hf_config, const nlohmann::json& overrides = nlohmann::json::object(),
                               uint64_t seed = 0);

// make_model's factory for {"type": "hf", "path": DIR, "activation_checkpointing"?, "dropout"?}.
ModulePtr make_hf(const nlohmann::json& config, uint64_t seed);

struct SavePretrainedOptions {
  // Past this many bytes of tensor data the weights are split into model-0000K-of-0000N.safetensors
  // with an index (Note [Sharded model files]); transformers' default "5GB".
  uint64_t max_shard_bytes = checkpoint::kDefaultMaxShardBytes;
  // Keys of this config.json (the one a model was loaded from: bos_token_id, ...) kept in the written
  // one; the model's own keys (model_type, sizes, torch_dtype, ...) replace theirs.
  nlohmann::json base_config = nlohmann::json::object();
};

// Writes a whole nn::Llama or nn::GPT (not a tensor- or pipeline-parallel part of one) into `out_dir` as
// Hugging Face lays a model out: config.json (model_type, architectures, the sizes, torch_dtype of the
// parameters) and the weights in Hugging Face's names and shapes (GPT-2's Conv1D weights transposed back),
// sharded past max_shard_bytes. ConfigError for any other model.
void save_pretrained(const Module& model, const std::filesystem::path& out_dir, const SavePretrainedOptions& options = {});

// The config.json save_pretrained writes for `model` (without base_config).
nlohmann::json hf_config_of(const Module& model);

// The Hugging Face name of tensor `name` of a whole nn::Llama or nn::GPT, and whether Hugging Face stores
// it transposed (GPT-2's Conv1D weights): save_pretrained's mapping, which names a Linear's LoRA adapters
// too (nn/peft.h: "blocks.0.attn.c_attn.lora_A.weight" -> "transformer.h.0.attn.c_attn.lora_A.weight").
// ConfigError for any other model.
struct HfTensorName {
  std::string name;
  bool transposed = false;
};
HfTensorName hf_tensor_name(const Module& model, const std::string& name);

// "5GB" (10^9 bytes, as transformers counts), "500MB", "2GiB", "100KB", "4096" (bytes) -> bytes;
// ConfigError naming the text otherwise.
uint64_t parse_byte_size(const std::string& text);

}  // namespace booster::nn
