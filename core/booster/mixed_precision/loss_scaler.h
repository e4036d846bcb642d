// LossScaler: the one interface behind every loss scale a precision strategy can use, and the three
// scalers the SDK provides. A scaler only keeps the scale and its update rule; the strategy base
// (precision_strategy.h) multiplies the loss, unscales and checks the gradients, agrees on found_inf
// across ranks and skips the step, then calls update() once with the step's verdict.
//
//   ConstantLossScaler   a fixed scale (apex's and DeepSpeed's static loss_scale).
//   TorchLossScaler      torch.cuda.amp.GradScaler's rule (Note in grad_scaler.h), float32 scale.
//   HysteresisLossScaler Megatron-LM's / ColossalAI's DynamicGradScaler (Note [Hysteresis]).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>

#include "booster/mixed_precision/dynamic_grad_scaler.h"
#include "booster/mixed_precision/grad_scaler.h"

namespace booster::mixed_precision {

class LossScaler {
 public:
  virtual ~LossScaler() = default;
  // The factor the next backward multiplies the loss by.
  virtual double scale() const = 0;
  // Whether gradients are checked for inf/NaN and a step with one is skipped. A scaler that does not
  // check still has its gradients divided by scale() (apex's static loss_scale).
  virtual bool skips_non_finite() const { return true; }
  // Called once per step, after the step (or the skip). May throw TrainingError when the scale would
  // have to fall below its floor (Note [The mixed-precision step]).
  virtual void update(bool found_inf) = 0;
  // The scaler's state, stored as the strategy state's meta["scaler"].
  virtual nlohmann::json state_dict() const = 0;
  virtual void load_state_dict(const nlohmann::json& state) = 0;
};

// A fixed scale. It counts the steps it skipped (state: {"loss_scale", "skipped_steps"}); loading
// restores the scale of the checkpoint.
class ConstantLossScaler final : public LossScaler {
 public:
  explicit ConstantLossScaler(double scale, bool skips_non_finite = true)
      : scale_(scale), skips_non_finite_(skips_non_finite) {}
  double scale() const override { return scale_; }
  bool skips_non_finite() const override { return skips_non_finite_; }
  void update(bool found_inf) override { skipped_steps_ += found_inf; }
  int64_t skipped_steps() const { return skipped_steps_; }
  nlohmann::json state_dict() const override;
  void load_state_dict(const nlohmann::json& state) override;

 private:
  double scale_;
  bool skips_non_finite_;
  int64_t skipped_steps_ = 0;
};

// torch.cuda.amp.GradScaler's update rule (GradScalerOptions: init_scale 2^16, growth_factor 2,
// backoff_factor 0.5, growth_interval 2000) with its float32 scale and its state_dict keys. Disabled
// (enabled = false) it is GradScaler(enabled=False): scale 1, nothing checked, state {}.
// min_scale is a floor torch does not have: an update that leaves the scale below it throws
// TrainingError, since every step then overflows (0 disables it).
class TorchLossScaler final : public LossScaler {
 public:
  explicit TorchLossScaler(const GradScalerOptions& options = {}, double min_scale = 0.0);
  double scale() const override { return options_.enabled ? double(scale_) : 1.0; }
  bool skips_non_finite() const override { return options_.enabled; }
  void update(bool found_inf) override;
  int64_t growth_tracker() const { return growth_tracker_; }
  const GradScalerOptions& options() const { return options_; }
  nlohmann::json state_dict() const override;
  void load_state_dict(const nlohmann::json& state) override;

  // The rule itself (torch's _amp_update_scale_), shared with GradScaler::update.
  static void update_rule(float& scale, int64_t& growth_tracker, bool found_inf, const GradScalerOptions& options);
  // torch's state_dict keys: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker.
  static nlohmann::json state_json(float scale, int64_t growth_tracker, const GradScalerOptions& options);

 private:
  GradScalerOptions options_;
  double min_scale_;
  float scale_;
  int64_t growth_tracker_ = 0;
};

// DynamicGradScaler (min_scale, max_scale, hysteresis; Note [Hysteresis]) behind the interface. Its
// state is DynamicGradScaler's: {"scale", "growth_tracker", "hysteresis_tracker"}.
class HysteresisLossScaler final : public LossScaler {
 public:
  explicit HysteresisLossScaler(const DynamicGradScalerOptions& options = {}) : scaler_(options) {}
  double scale() const override { return scaler_.scale(); }
  void update(bool found_inf) override { scaler_.update(found_inf); }
  const DynamicGradScaler& scaler() const { return scaler_; }
  nlohmann::json state_dict() const override { return scaler_.state_dict(); }
  void load_state_dict(const nlohmann::json& state) override { scaler_.load_state_dict(state); }

 private:
  DynamicGradScaler scaler_;
};

}  // namespace booster::mixed_precision
