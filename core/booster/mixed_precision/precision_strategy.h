// PrecisionStrategy: the precision-plugin SDK. A strategy is a recipe (PrecisionRecipe: which dtypes,
// whether float32 master weights, which LossScaler); this base does everything else once, for every
// built-in strategy and every plugin: configure(), the scaled backward, the step bookkeeping and the
// checkpointable state. mixed_precision/README.md walks through writing a plugin with it.
//
// Note [The step the base owns]
// Per step (Note [The mixed-precision step] in mixed_precision.h):
//   backward   loss * scale (scale_loss), at most once per step;
//   unscale    once per step, whoever asks first (unscale_gradients, clip_grad_norm or step): one
//              fused pass divides the gradients by the scale and checks them for inf/NaN (with master
//              weights, the pass that moves the 16-bit gradients into the float32 masters), then the
//              local verdict goes through agree_on_found_inf() exactly once, so every rank of a data
//              parallel run skips the same steps. A strategy cannot forget it: it never sees the pass;
//   clip       on the unscaled gradients (the masters' when there are masters); inf when found_inf;
//   step       steps, or skips on found_inf (a skipped master step drops the master gradients), fills
//              StepStats (the scale the backward used), then LossScaler::update(found_inf);
//   state      meta["scaler"] = the scaler's state; with masters, tensors "master_weights.<g>.<i>".
// Without a scaler nothing is scaled, checked or agreed on (fp32, bf16): the reducer is not called.
// A scaler that does not skip (apex's static loss_scale) has its gradients divided, never checked.
//
// Note [A backward the scaler did not see]
// A loop that calls loss.backward() where it should call booster.backward(loss, optimizer) makes
// unscaled gradients, which step() would divide by the scale: the step silently moves the weights
// by 1/scale of what it should (and float16 gradients underflow unscaled). So under a scaler, step()
// looks for gradients when no scaled backward came since the last step: non-zero ones mean a backward
// the strategy did not see, and it warns once (stderr) naming the call to use.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "booster/mixed_precision/loss_scaler.h"
#include "booster/mixed_precision/master_weight_optimizer.h"
#include "booster/mixed_precision/mixed_precision.h"

namespace booster::mixed_precision {

// What a strategy is. The defaults are full float32: model, optimizer and criterion used as given.
struct PrecisionRecipe {
  // Run the model's forward and the criterion under autocast to this dtype (torch AMP).
  std::optional<DType> autocast_dtype;
  // Convert the model to this dtype (modules for which convert_if is false keep float32); inputs then
  // go in as this dtype and outputs come out as float32, so the loss and its scaling are float32.
  std::optional<DType> model_dtype;
  nn::ModuleFilter convert_if;
  // With model_dtype: keep float32 master weights in the optimizer (Note [Master weights]). Without,
  // the converted parameters are stepped directly by a fresh optimizer of the user's type (apex O3).
  bool master_weights = false;
  // The loss scale; null: the loss is not scaled and gradients are not checked.
  std::shared_ptr<LossScaler> scaler;
  // Count the zero elements of the unscaled gradients into StepStats::num_zeros each step.
  bool count_zeros = false;
  // With autocast_dtype: computes the linear layers it chooses its own way (the fp8 GEMMs).
  std::shared_ptr<autocast::LinearOverride> linear_override;
};

class PrecisionStrategy : public MixedPrecision {
 public:
  // `options`: every option with the value in use (what options() returns).
  PrecisionStrategy(std::string name, nlohmann::json options, PrecisionRecipe recipe);
  // Reads nothing more: finishes `options` (ConfigError for a key no read named) and takes the
  // strategy's name from it. `values` is what options() returns.
  PrecisionStrategy(const OptionReader& options, nlohmann::json values, PrecisionRecipe recipe);

  std::string name() const override { return name_; }
  nlohmann::json options() const override { return options_; }
  Configured configure(nn::ModulePtr model, std::shared_ptr<optim::Optimizer> optimizer,
                       Criterion criterion) override;

  void backward(const Tensor& loss, optim::Optimizer& optimizer) override;
  void unscale_gradients(optim::Optimizer& optimizer) override;
  double clip_grad_norm(optim::Optimizer& optimizer, double max_norm) override;
  void step(optim::Optimizer& optimizer) override;
  double loss_scale() const override { return recipe_.scaler ? recipe_.scaler->scale() : 1.0; }

  MixedPrecisionState state_dict() const override;
  void load_state_dict(const MixedPrecisionState& state) override;

  const PrecisionRecipe& recipe() const { return recipe_; }
  const LossScaler* scaler() const { return recipe_.scaler.get(); }

 private:
  bool uses_masters() const { return recipe_.model_dtype && recipe_.master_weights; }
  MasterWeightOptimizer& masters_of(optim::Optimizer& optimizer) const;
  // The unscaled gradients: the master gradients, or the optimizer's flat gradient buffers.
  std::vector<Tensor> unscaled_grads(optim::Optimizer& optimizer);

  std::string name_;
  nlohmann::json options_;
  PrecisionRecipe recipe_;
  std::shared_ptr<MasterWeightOptimizer> masters_;  // set by configure() when uses_masters()
  bool found_inf_ = false;                          // this step's agreed verdict, once unscaled
  bool scaled_backward_ = false;  // a backward() since the last step (Note [A backward the scaler did not see])
  bool warned_unseen_backward_ = false;
};

}  // namespace booster::mixed_precision
