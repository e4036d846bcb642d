#include "booster/mixed_precision/dynamic_grad_scaler.h"

#include <algorithm>
#include <cmath>

#include "booster/common/error.h"

namespace booster::mixed_precision {

DynamicGradScaler::DynamicGradScaler(const DynamicGradScalerOptions& o)
    : options_(o), scale_(o.initial_scale), hysteresis_tracker_(o.hysteresis) {
  BOOSTER_CHECK(o.initial_scale > 0.0, ValueError, "DynamicGradScaler: initial_scale must be > 0, got ", o.initial_scale);
  BOOSTER_CHECK(o.min_scale > 0.0, ValueError, "DynamicGradScaler: min_scale must be > 0, got ", o.min_scale);
  BOOSTER_CHECK(o.min_scale <= o.initial_scale, ValueError, "DynamicGradScaler: min_scale ", o.min_scale,
                " must be <= initial_scale ", o.initial_scale);
  BOOSTER_CHECK(o.max_scale >= o.initial_scale, ValueError, "DynamicGradScaler: max_scale ", o.max_scale,
                " must be >= initial_scale ", o.initial_scale);
  BOOSTER_CHECK(o.growth_factor > 1.0, ValueError, "DynamicGradScaler: growth_factor must be > 1, got ",
                o.growth_factor);
  BOOSTER_CHECK(o.backoff_factor > 0.0 && o.backoff_factor < 1.0, ValueError,
                "DynamicGradScaler: backoff_factor must be in (0, 1), got ", o.backoff_factor);
  BOOSTER_CHECK(o.growth_interval > 0, ValueError, "DynamicGradScaler: growth_interval must be > 0, got ",
                o.growth_interval);
  BOOSTER_CHECK(o.hysteresis > 0, ValueError, "DynamicGradScaler: hysteresis must be > 0, got ", o.hysteresis);
}

void DynamicGradScaler::update(bool found_inf) {
  if (found_inf) {
    growth_tracker_ = 0;
    hysteresis_tracker_ -= 1;
    if (hysteresis_tracker_ <= 0) {
      BOOSTER_CHECK(scale_ > options_.min_scale, TrainingError, "DynamicGradScaler: gradients overflowed with the "
                    "loss scale already at its floor min_scale = ", options_.min_scale,
                    "; the run has diverged (lower the learning rate, or use bf16)");
      scale_ = std::max(scale_ * options_.backoff_factor, options_.min_scale);
    }
  } else {
    growth_tracker_ += 1;
    if (growth_tracker_ == options_.growth_interval) {
      growth_tracker_ = 0;
      hysteresis_tracker_ = options_.hysteresis;
      scale_ = std::min(scale_ * options_.growth_factor, options_.max_scale);
    }
  }
}

nlohmann::json DynamicGradScaler::state_dict() const {
  return {{"scale", scale_}, {"growth_tracker", growth_tracker_}, {"hysteresis_tracker", hysteresis_tracker_}};
}

void DynamicGradScaler::load_state_dict(const nlohmann::json& state) {
  for (const char* key : {"scale", "growth_tracker", "hysteresis_tracker"})
    BOOSTER_CHECK(state.contains(key) && state.at(key).is_number(), CheckpointError,
                  "DynamicGradScaler.load_state_dict: missing or non-numeric key '", key, "' in ", state.dump());
  scale_ = state.at("scale").get<double>();
  growth_tracker_ = state.at("growth_tracker").get<int64_t>();
  hysteresis_tracker_ = state.at("hysteresis_tracker").get<int64_t>();
}

}  // namespace booster::mixed_precision
