// The scalers of loss_scaler.h. Their rules are the ones of the classes they stand for: TorchLossScaler
// shares update_rule with GradScaler, HysteresisLossScaler is a DynamicGradScaler.
#include "booster/mixed_precision/loss_scaler.h"

#include <cmath>

#include "booster/common/error.h"

namespace booster::mixed_precision {

// ------------------------------------------------------------------------------------------ constant

nlohmann::json ConstantLossScaler::state_dict() const {
  return {{"loss_scale", scale_}, {"skipped_steps", skipped_steps_}};
}

void ConstantLossScaler::load_state_dict(const nlohmann::json& state) {
  for (const char* key : {"loss_scale", "skipped_steps"})
    BOOSTER_CHECK(state.contains(key) && state.at(key).is_number(), CheckpointError,
                  "ConstantLossScaler.load_state_dict: missing or non-numeric key '", key, "' in ", state.dump());
  scale_ = state.at("loss_scale").get<double>();
  skipped_steps_ = state.at("skipped_steps").get<int64_t>();
}

// ------------------------------------------------------------------------------------- torch-style

TorchLossScaler::TorchLossScaler(const GradScalerOptions& options, double min_scale)
    : options_(options), min_scale_(min_scale), scale_(float(options.init_scale)) {
  // The same checks, and messages, as GradScaler.
  GradScaler check(options);
  (void)check;
}

void TorchLossScaler::update_rule(float& scale, int64_t& growth_tracker, bool found_inf,
                                  const GradScalerOptions& options) {
  if (found_inf) {
    scale = scale * float(options.backoff_factor);
    growth_tracker = 0;
    return;
  }
  const int64_t successful = growth_tracker + 1;
  if (successful == options.growth_interval) {
    const float grown = scale * float(options.growth_factor);
    if (std::isfinite(grown)) scale = grown;  // torch keeps the old scale when growing overflows
    growth_tracker = 0;
  } else {
    growth_tracker = successful;
  }
}

void TorchLossScaler::update(bool found_inf) {
  if (!options_.enabled) return;
  update_rule(scale_, growth_tracker_, found_inf, options_);
  BOOSTER_CHECK(double(scale_) >= min_scale_, TrainingError, "the loss scale fell to ", double(scale_),
                ", below its floor min_scale = ", min_scale_,
                ": gradients overflow even at the smallest allowed scale, so the run has diverged; lower the "
                "learning rate or use bf16");
}

nlohmann::json TorchLossScaler::state_json(float scale, int64_t growth_tracker, const GradScalerOptions& options) {
  return {{"scale", double(scale)},
          {"growth_factor", options.growth_factor},
          {"backoff_factor", options.backoff_factor},
          {"growth_interval", options.growth_interval},
          {"_growth_tracker", growth_tracker}};
}

nlohmann::json TorchLossScaler::state_dict() const {
  if (!options_.enabled) return nlohmann::json::object();
  return TorchLossScaler::state_json(scale_, growth_tracker_, options_);
}

void TorchLossScaler::load_state_dict(const nlohmann::json& state) {
  if (!options_.enabled) return;
  GradScaler loaded(options_);
  loaded.load_state_dict(state);  // torch's checks and messages
  options_ = loaded.options();
  scale_ = float(loaded.get_scale());
  growth_tracker_ = loaded.growth_tracker();
}

}  // namespace booster::mixed_precision
