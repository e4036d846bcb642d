// The model of a LoRA run's checkpoint, for `booster export` and `booster generate`: the checkpoint
// holds the adapters only (Note [Adapter-only checkpoints] in booster/booster/state.cpp), so the base
// comes from the run's model section as `booster train` built it, and the adapters from model/.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>

#include <nlohmann/json.hpp>

#include "booster/nn/lora.h"
#include "booster/nn/module.h"

namespace booster::cli {

// The LoRA settings checkpoint step `step` recorded (trainer_state.json's "lora": {"config"}), nullopt
// for a checkpoint of a whole model.
std::optional<nn::LoraConfig> checkpoint_lora(const std::filesystem::path& step);

// The base model of `model_config` (a training config's model section) with its weights, as `booster
// train` builds it: a Hugging Face directory's (type "hf"), model.init_from's, else the initial weights
// of `seed` (train.seed).
nn::ModulePtr base_model(nlohmann::json model_config, uint64_t seed, bool verify);

// base_model, the adapters of `lora` applied and the checkpoint's trained adapters loaded (their float32
// masters where the run kept them). CheckpointError when the base differs from the one the run trained
// on (trainer_state.json's base_digest; naming both digests) or the checkpoint lacks an adapter.
nn::ModulePtr lora_checkpoint_model(const std::filesystem::path& step, const nlohmann::json& model_config, uint64_t seed,
                                    const nn::LoraConfig& lora, bool verify);

}  // namespace booster::cli
