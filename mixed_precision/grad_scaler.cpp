#include "booster/mixed_precision/grad_scaler.h"

#include <cmath>

#include "booster/mixed_precision/loss_scaler.h"
#include "booster/mixed_precision/mixed_precision.h"
#include "booster/ops/ops.h"

namespace booster::mixed_precision {

GradScaler::GradScaler(const GradScalerOptions& options) : options_(options), scale_(float(options.init_scale)) {
  BOOSTER_CHECK(options.growth_factor > 1.0, ValueError, "GradScaler: growth_factor should be > 1, got ",
                options.growth_factor);
  BOOSTER_CHECK(options.backoff_factor > 0.0 && options.backoff_factor < 1.0, ValueError,
                "GradScaler: backoff_factor should be in (0, 1), got ", options.backoff_factor);
  BOOSTER_CHECK(options.growth_interval > 0, ValueError, "GradScaler: growth_interval should be > 0, got ",
                options.growth_interval);
}

Tensor GradScaler::scale(const Tensor& loss) const {
  if (!options_.enabled) return loss;
  return scale_loss(loss, double(scale_));
}

void GradScaler::unscale_(optim::Optimizer& optimizer) {
  if (!options_.enabled) return;
  PerOptimizer& st = per_optimizer_[&optimizer];
  BOOSTER_CHECK(st.stage != Stage::Unscaled, StateError,
                "unscale_() has already been called on this optimizer since the last update().");
  BOOSTER_CHECK(st.stage != Stage::Stepped, StateError, "unscale_() is being called after step().");
  // torch: inv_scale = self._scale.double().reciprocal().float()
  const float inv_scale = float(1.0 / double(scale_));
  std::vector<GradSpan> spans;
  for (const Tensor& g : flat_grads(optimizer)) spans.push_back({g, g});
  const bool local_found_inf = fused_unscale_and_check(spans, inv_scale);
  st.found_inf = found_inf_reducer_ ? found_inf_reducer_(local_found_inf) : local_found_inf;
  st.has_inf_check = true;
  st.stage = Stage::Unscaled;
}

bool GradScaler::step(optim::Optimizer& optimizer) {
  if (!options_.enabled) {
    optimizer.step();
    return true;
  }
  PerOptimizer& st = per_optimizer_[&optimizer];
  BOOSTER_CHECK(st.stage != Stage::Stepped, StateError, "step() has already been called since the last update().");
  if (st.stage == Stage::Ready) unscale_(optimizer);
  BOOSTER_CHECK(st.has_inf_check, StateError, "No inf checks were recorded for this optimizer.");
  const bool stepped = !st.found_inf;
  if (stepped) optimizer.step();
  st.stage = Stage::Stepped;
  return stepped;
}

void GradScaler::update() {
  if (!options_.enabled) return;
  bool any_check = false, found = false;
  for (const auto& [opt, st] : per_optimizer_) {
    any_check |= st.has_inf_check;
    found |= st.found_inf;
  }
  BOOSTER_CHECK(any_check, StateError, "No inf checks were recorded prior to update().");
  TorchLossScaler::update_rule(scale_, growth_tracker_, found, options_);
  per_optimizer_.clear();
}

void GradScaler::update(double new_scale) {
  if (!options_.enabled) return;
  scale_ = float(new_scale);
  per_optimizer_.clear();
}

bool GradScaler::found_inf(const optim::Optimizer& optimizer) const {
  auto it = per_optimizer_.find(&optimizer);
  return it != per_optimizer_.end() && it->second.found_inf;
}

bool GradScaler::unscaled(const optim::Optimizer& optimizer) const {
  auto it = per_optimizer_.find(&optimizer);
  return it != per_optimizer_.end() && it->second.stage != Stage::Ready;
}

nlohmann::json GradScaler::state_dict() const {
  if (!options_.enabled) return nlohmann::json::object();
  return TorchLossScaler::state_json(scale_, growth_tracker_, options_);
}

void GradScaler::load_state_dict(const nlohmann::json& state) {
  if (!options_.enabled) return;
  BOOSTER_CHECK(state.is_object() && !state.empty(), CheckpointError,
                "The source state dict is empty, possibly because it was saved from a disabled instance of "
                "GradScaler.");
  for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})
    BOOSTER_CHECK(state.contains(key) && state.at(key).is_number(), CheckpointError,
                  "GradScaler.load_state_dict: missing or non-numeric key '", key, "' in ", state.dump());
  scale_ = float(state.at("scale").get<double>());
  options_.growth_factor = state.at("growth_factor").get<double>();
  options_.backoff_factor = state.at("backoff_factor").get<double>();
  options_.growth_interval = state.at("growth_interval").get<int64_t>();
  growth_tracker_ = state.at("_growth_tracker").get<int64_t>();
}

}  // namespace booster::mixed_precision
