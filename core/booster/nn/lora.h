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
// A [r, in], B [out, r].
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "booster/nn/module.h"

namespace booster::nn {

struct LoraConfig {
  int64_t r = 8;                                            // the adapters' rank, >= 1
  double alpha = 8.0;                                       // lora_alpha: the scale's numerator, > 0
  double dropout = 0.0;                                     // lora_dropout on the adapter's input, in [0, 1)
  std::vector<std::string> target_modules = {"q_proj", "v_proj"};  // Linear names (the last path part)
  bool use_rslora = false;                                  // s = alpha / sqrt(r) instead of alpha / r
  uint64_t seed = 0;                                        // the draws of A's init and of the dropout

  // alpha / r, or alpha / sqrt(r) with use_rslora.
  double scaling() const;
  // ValueError naming the field for r < 1, alpha <= 0 or not finite, dropout outside [0, 1), no target.
  void validate() const;
};

// Attaches adapters to `model`'s target Linears and freezes everything else (see above). Returns the
// module paths adapted, in pre-order. ConfigError when no Linear matches, naming the Linear names there
// are; StateError for a model that has adapters already.
std::vector<std::string> apply_lora(Module& model, const LoraConfig& config);

// The parameters that require grad, in parameters() order: what the optimizer of an adapted model
// holds (the frozen base needs no gradient, optimizer state or master weight).
std::vector<Tensor> trainable_parameters(const Module& model);

}  // namespace booster::nn
