// LoRA (Hu et al.; PEFT's LoraConfig): low-rank adapters on a model's Linear layers, so that fine-tuning
// trains r x (in + out) numbers per layer instead of in x out.
//
//   nn::LoraConfig lora{.r = 8, .alpha = 16, .target_modules = {"q_proj", "v_proj"}};
//   nn::apply_lora(*model, lora);                        // or booster.enable_lora(model, lora)
//   auto opt = optim::make_optimizer(adamw, nn::trainable_parameters(*model));
//
// Every Linear whose name (the last part of its module path) is in target_modules gets two children,
// lora_A (in -> r) and lora_B (r -> out), and computes y = W x + b + s B A dropout(x), s = alpha / r
// (alpha / sqrt(r) with use_rslora). A starts kaiming-uniform (a = sqrt(5), PyTorch's Linear default) and
// B at zero, as PEFT starts them, so the adapted model starts equal to the base. Every other parameter
// of the model is frozen (requires_grad false): only the adapters train. The adapters' names are PEFT's
// without the base_model prefix and adapter name: "model.layers.0.self_attn.q_proj.lora_A.weight",
// A [r, in], B [out, r] (a GPT's adapters carry its booster names, "blocks.0.attn.c_attn.lora_A.weight";
// a PEFT directory names them as Hugging Face does, nn/peft.h).
//
// A PEFT adapter directory (adapter_config.json + adapter_model.safetensors, as PEFT's save_pretrained
// writes it) starts the adapters instead of PEFT's initialization when init_from names it:
//
//   booster.enable_lora(model, nn::LoraConfig::from_peft("my-adapter"));   // its r, alpha, targets, weights
//   nn::LoraConfig lora = nn::LoraConfig::from_json(config["lora"]);       // the config's "lora" section
//
// Reading, writing and merging adapters is nn/peft.h.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/distributed/process_group.h"
#include "booster/nn/module.h"

namespace booster::nn {

struct LoraConfig {
  int64_t r = 8;                                            // the adapters' rank, >= 1
  double alpha = 8.0;                                       // lora_alpha: the scale's numerator, > 0
  double dropout = 0.0;                                     // lora_dropout on the adapter's input, in [0, 1)
  std::vector<std::string> target_modules = {"q_proj", "v_proj"};  // Linear names (the last path part)
  bool use_rslora = false;                                  // s = alpha / sqrt(r) instead of alpha / r
  uint64_t seed = 0;                                        // the draws of A's init and of the dropout
  // A PEFT adapter directory whose A and B start the adapters (apply_lora loads them instead of drawing
  // A); empty: none. Its r, alpha and use_rslora must equal the fields above and its target_modules
  // must be the same set (Note [A PEFT adapter's settings] in peft.cpp): from_peft and from_json fill
  // them from the directory.
  std::string init_from;

  // alpha / r, or alpha / sqrt(r) with use_rslora.
  double scaling() const;
  // ValueError naming the field for r < 1, alpha <= 0 or not finite, dropout outside [0, 1), no target.
  void validate() const;

  // The settings of the PEFT adapter directory `dir` (its adapter_config.json: r, lora_alpha,
  // lora_dropout, target_modules, use_rslora) with init_from = dir: what continues from or applies that
  // adapter. The errors of nn::read_peft_config (peft.h).
  static LoraConfig from_peft(const std::filesystem::path& dir);
  // A config's "lora" section: {"r", "alpha", "dropout", "target_modules", "use_rslora", "seed",
  // "init_from"} (null init_from: none), every key optional. Without init_from an absent key keeps the
  // default above. With init_from (Note [A PEFT adapter's settings]) an absent or null key takes the
  // adapter's value and a given r, alpha, use_rslora or target_modules must equal the adapter's
  // (ConfigError naming both values and the file); dropout and seed are the run's own. ConfigError
  // naming 'lora.<key>' for an unknown key or a value of the wrong type, then validate().
  static LoraConfig from_json(const nlohmann::json& section);
};

// Attaches adapters to `model`'s target Linears and freezes everything else (see above). Returns the
// module paths adapted, in pre-order. ConfigError when no Linear matches, naming the Linear names there
// are; StateError for a model that has adapters already. With config.init_from, the directory's
// adapters are then loaded (nn::load_lora_weights; its errors, and a ConfigError when the config's r,
// alpha, use_rslora or target_modules differ from the directory's, naming both values).
std::vector<std::string> apply_lora(Module& model, const LoraConfig& config);

// Under tensor parallelism (Note [LoRA under tensor parallelism] in lora.cpp): gives `split`, this
// rank's piece of the adapted Linear `full` (dim 0: column-parallel, split along its output features;
// dim 1: row-parallel, split along its input features, its output all-reduced inside it), this rank's
// pieces of full's adapters (named lora_A, lora_B as in the whole model) and the adapter's hook. Does
// nothing when `full` has no adapters. `chunks` is the column split's: the output rows are that many
// equal blocks, each split alike (a GPT's fused q|k|v c_attn: 3; ShardSpec, shard_policy.h), and B's
// rows follow. A column-parallel `split` that is a tp::ColumnParallelLinear takes the replicated input
// and enters the group itself; any other (the Llama's q/k/v/gate/up) gets an input that entered it
// already. The group must outlive `split`.
void split_lora(const Module& full, Module& split, int64_t dim, distributed::ProcessGroup& group,
                int64_t chunks = 1);

// The parameters that require grad, in parameters() order: what the optimizer of an adapted model
// holds (the frozen base needs no gradient, optimizer state or master weight).
std::vector<Tensor> trainable_parameters(const Module& model);

}  // namespace booster::nn
