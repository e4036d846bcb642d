// DynamicGradScaler: the loss scaler of Megatron-LM and ColossalAI, with hysteresis.
//
// Note [Hysteresis]
// One overflow in a long run is often a fluke (a single odd batch); halving the scale for it costs
// precision for the next growth_interval steps. With hysteresis h, the scale backs off only on the
// h-th overflow since the last growth (Megatron's DynamicGradScaler.update):
//   on inf:  growth_tracker = 0; hysteresis_tracker -= 1;
//            if hysteresis_tracker <= 0: scale = max(scale * backoff_factor, min_scale)
//   clean:   growth_tracker += 1; when it reaches growth_interval:
//            growth_tracker = 0; hysteresis_tracker = hysteresis; scale = min(scale * growth_factor, max_scale)
// The hysteresis tracker is restored only by a growth, never by a clean step or a backoff: once the
// budget is spent, every further overflow backs off at once until the scale grows again.
// Floor: a backoff that lands below min_scale is clamped to it (Megatron); a backoff due while the scale
// already sits at min_scale throws TrainingError (DeepSpeed's raise-at-min-scale): overflowing at the
// smallest allowed scale means the run has diverged.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>

namespace booster::mixed_precision {

struct DynamicGradScalerOptions {
  double initial_scale = 65536.0;  // 2^16
  double min_scale = 1.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 1000;
  int64_t hysteresis = 2;
  double max_scale = 4294967296.0;  // 2^32
};

class DynamicGradScaler {
 public:
  // ValueError for arguments out of range (each named, with its bound).
  explicit DynamicGradScaler(const DynamicGradScalerOptions& options = {});

  double scale() const { return scale_; }
  double inv_scale() const { return 1.0 / scale_; }
  void update(bool found_inf);

  int64_t growth_tracker() const { return growth_tracker_; }
  int64_t hysteresis_tracker() const { return hysteresis_tracker_; }
  const DynamicGradScalerOptions& options() const { return options_; }

  // {"scale", "growth_tracker", "hysteresis_tracker"} (Megatron's state_dict keys).
  nlohmann::json state_dict() const;
  void load_state_dict(const nlohmann::json& state);

 private:
  DynamicGradScalerOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;
  int64_t hysteresis_tracker_;
};

}  // namespace booster::mixed_precision
