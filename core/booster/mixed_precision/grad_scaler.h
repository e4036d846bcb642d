// GradScaler: torch.cuda.amp.GradScaler (1.13) for float32 parameters whose gradients come from a
// float16 autocast forward.
//
// Rules (torch/cuda/amp/grad_scaler.py and the _amp_update_scale_ kernel):
//  * scale(loss) = loss * scale. unscale_(optimizer) divides that optimizer's gradients by the scale
//    and records whether any was inf/NaN, at most once between update()s; step(optimizer) unscales
//    first if the user did not, then steps unless an inf/NaN was recorded; update() then
//      - on inf: scale *= backoff_factor, growth tracker = 0;
//      - else:   tracker += 1, and when it reaches growth_interval: scale *= growth_factor (kept only
//                when the product is finite) and tracker = 0.
//  * The scale is a float32 value, as torch's one-element float32 tensor, so every product rounds the
//    same way.
//  * Disabled, every call is a pass-through (scale(loss) is loss, step() always steps).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>

#include "booster/optim/optimizer.h"

namespace booster::mixed_precision {

struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  bool enabled = true;
};

class GradScaler {
 public:
  explicit GradScaler(const GradScalerOptions& options = {});

  Tensor scale(const Tensor& loss) const;
  void unscale_(optim::Optimizer& optimizer);
  // Returns whether the optimizer stepped.
  bool step(optim::Optimizer& optimizer);
  void update();
  void update(double new_scale);

  bool is_enabled() const { return options_.enabled; }
  double get_scale() const { return options_.enabled ? double(scale_) : 1.0; }
  int64_t growth_tracker() const { return growth_tracker_; }
  // Whether unscale_ found an inf/NaN in this optimizer's gradients since the last update().
  bool found_inf(const optim::Optimizer& optimizer) const;
  // Applied to the flag unscale_ computes (Note [Agreeing on found_inf] in mixed_precision.h).
  void set_found_inf_reducer(std::function<bool(bool)> reducer) { found_inf_reducer_ = std::move(reducer); }
  bool unscaled(const optim::Optimizer& optimizer) const;
  const GradScalerOptions& options() const { return options_; }

  // torch's keys: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker ({} disabled).
  nlohmann::json state_dict() const;
  void load_state_dict(const nlohmann::json& state);

 private:
  enum class Stage { Ready, Unscaled, Stepped };
  struct PerOptimizer {
    Stage stage = Stage::Ready;
    bool has_inf_check = false;
    bool found_inf = false;
  };

  GradScalerOptions options_;
  float scale_;
  int64_t growth_tracker_ = 0;
  std::map<const optim::Optimizer*, PerOptimizer> per_optimizer_;
  std::function<bool(bool)> found_inf_reducer_;
};

}  // namespace booster::mixed_precision
