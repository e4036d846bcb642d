#include "booster/mixed_precision/master_weight_strategy.h"

#include <cmath>

#include "booster/autograd/autograd.h"
#include "booster/ops/ops.h"

namespace booster::mixed_precision {

Configured MasterWeightStrategy::configure_masters(nn::ModulePtr model, std::shared_ptr<optim::Optimizer> optimizer,
                                                   Criterion criterion, const nn::ModuleFilter& convert_if) {
  BOOSTER_CHECK(model != nullptr, ValueError, name(), ": configure needs a model");
  const DType dtype = model_dtype_;
  auto convert = [&] {
    if (convert_if) model->to(dtype, convert_if);
    else model->to(dtype);
  };
  // Without an optimizer (evaluation only) there is nothing to keep masters for: just convert.
  if (optimizer) optimizer_ = std::make_shared<MasterWeightOptimizer>(*optimizer, convert);
  else convert();
  PrecisionModule::Options mo;
  mo.cast_io = true;
  mo.input_dtype = dtype;
  return {std::make_shared<PrecisionModule>(model, mo), optimizer_, std::move(criterion)};
}

MasterWeightOptimizer& MasterWeightStrategy::masters_of(optim::Optimizer& optimizer) const {
  auto* m = dynamic_cast<MasterWeightOptimizer*>(&optimizer);
  BOOSTER_CHECK(m != nullptr && m == optimizer_.get(), StateError, name(),
                ": pass the optimizer that configure() returned (it keeps the float32 master weights), got a '",
                optimizer.name(), "' optimizer that is not it");
  return *m;
}

void MasterWeightStrategy::backward(const Tensor& loss, optim::Optimizer& optimizer) {
  masters_of(optimizer);
  gathered_ = false;
  scale_loss(loss, current_scale()).backward();
}

void MasterWeightStrategy::gather(optim::Optimizer& optimizer) {
  if (gathered_) return;
  found_inf_ = agree_on_found_inf(masters_of(optimizer).gather_grads(float(1.0 / current_scale())));
  if (!skip_on_overflow_) found_inf_ = false;
  gathered_ = true;
}

void MasterWeightStrategy::unscale_gradients(optim::Optimizer& optimizer) { gather(optimizer); }

double MasterWeightStrategy::clip_grad_norm(optim::Optimizer& optimizer, double max_norm) {
  BOOSTER_CHECK(max_norm > 0.0, ValueError, name(), ": clip_grad_norm: max_norm must be > 0, got ", max_norm);
  gather(optimizer);
  if (found_inf_) {
    pending_grad_norm_ = std::numeric_limits<double>::infinity();
    return pending_grad_norm_;
  }
  const std::vector<Tensor> grads = optimizer_->master_grads();
  const double norm = grad_norm_l2(grads);
  const double coef = max_norm / (norm + 1e-6);
  if (std::isfinite(norm) && coef < 1.0) scale_grads(grads, float(coef));
  pending_grad_norm_ = norm;
  return norm;
}

void MasterWeightStrategy::step(optim::Optimizer& optimizer) {
  MasterWeightOptimizer& opt = masters_of(optimizer);
  gather(optimizer);
  stats_ = StepStats{};
  stats_.loss_scale = current_scale();
  stats_.skipped = found_inf_;
  stats_.grad_norm = pending_grad_norm_;
  if (count_zeros_) stats_.num_zeros = count_zeros(opt.master_grads());
  if (found_inf_) opt.drop_master_grads();
  else opt.step_masters();
  pending_grad_norm_ = std::numeric_limits<double>::quiet_NaN();
  gathered_ = false;
  update_scale(found_inf_);  // may throw TrainingError at the scale's floor
}

MixedPrecisionState MasterWeightStrategy::state_dict() const {
  MixedPrecisionState s;
  s.meta["scaler"] = scaler_state();
  if (optimizer_) {
    const auto& masters = optimizer_->masters();
    for (size_t g = 0; g < masters.size(); ++g)
      for (size_t i = 0; i < masters[g].size(); ++i)
        s.tensors["master_weights." + std::to_string(g) + "." + std::to_string(i)] = masters[g][i].detach();
  }
  return s;
}

void MasterWeightStrategy::load_state_dict(const MixedPrecisionState& state) {
  BOOSTER_CHECK(optimizer_ != nullptr, StateError, name(), ".load_state_dict: call configure() first");
  if (state.meta.contains("scaler")) load_scaler_state(state.meta.at("scaler"));
  const auto& masters = optimizer_->masters();
  NoGradGuard no_grad;
  for (size_t g = 0; g < masters.size(); ++g)
    for (size_t i = 0; i < masters[g].size(); ++i) {
      const std::string key = "master_weights." + std::to_string(g) + "." + std::to_string(i);
      auto it = state.tensors.find(key);
      BOOSTER_CHECK(it != state.tensors.end(), CheckpointError, name(), ".load_state_dict: missing '", key, "'");
      BOOSTER_CHECK(it->second.shape() == masters[g][i].shape(), CheckpointError, name(), ".load_state_dict: '", key,
                    "' has shape ", it->second.shape(), ", the master weight has ", masters[g][i].shape());
      Tensor m = masters[g][i];
      m.copy_(it->second);
    }
  // The model must hold the rounding of the masters it continues from.
  optimizer_->copy_masters_to_model();
}

}  // namespace booster::mixed_precision
