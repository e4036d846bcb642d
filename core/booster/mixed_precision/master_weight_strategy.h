// The step shared by strategies that hold the model in 16 bits with float32 master weights
// (fp16_naive, bf16 with pure=true): gradients are gathered into the masters (unscaled and checked in
// one pass) at most once per step, clipping and the zero count work on the master gradients, and a
// step with an inf/NaN gradient (when the strategy checks) drops the master gradients instead of
// stepping. See Note [Master weights].
#pragma once

#include "booster/mixed_precision/mixed_precision.h"
#include "booster/mixed_precision/master_weight_optimizer.h"

namespace booster::mixed_precision {

class MasterWeightStrategy : public MixedPrecision {
 public:
  void backward(const Tensor& loss, optim::Optimizer& optimizer) override;
  void unscale_gradients(optim::Optimizer& optimizer) override;
  double clip_grad_norm(optim::Optimizer& optimizer, double max_norm) override;
  void step(optim::Optimizer& optimizer) override;
  double loss_scale() const override { return current_scale(); }

  MixedPrecisionState state_dict() const override;
  void load_state_dict(const MixedPrecisionState& state) override;

 protected:
  // model_dtype: the dtype the model is held in; skip_on_overflow: check gradients and skip steps.
  MasterWeightStrategy(DType model_dtype, bool skip_on_overflow, bool count_zeros)
      : model_dtype_(model_dtype), skip_on_overflow_(skip_on_overflow), count_zeros_(count_zeros) {}

  // Converts the model to model_dtype (modules for which convert_if is false keep float32), builds the
  // master-weight optimizer, and wraps the model so inputs go in as model_dtype and outputs come out as
  // float32 (the loss, and its scaling, in float32).
  Configured configure_masters(nn::ModulePtr model, std::shared_ptr<optim::Optimizer> optimizer,
                               Criterion criterion, const nn::ModuleFilter& convert_if = nullptr);

  virtual double current_scale() const { return 1.0; }
  // Called once per step after the update (or the skip); scaled strategies update their scaler.
  virtual void update_scale(bool found_inf) {}
  virtual nlohmann::json scaler_state() const { return nlohmann::json::object(); }
  virtual void load_scaler_state(const nlohmann::json& state) {}

  MasterWeightOptimizer& masters_of(optim::Optimizer& optimizer) const;

  DType model_dtype_;
  bool skip_on_overflow_;
  bool count_zeros_;
  std::shared_ptr<MasterWeightOptimizer> optimizer_;

 private:
  void gather(optim::Optimizer& optimizer);
  bool gathered_ = false;
  bool found_inf_ = false;
};

}  // namespace booster::mixed_precision
