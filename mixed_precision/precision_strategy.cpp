// PrecisionStrategy: configure() from a recipe and the step of Note [The step the base owns].
#include "booster/mixed_precision/precision_strategy.h"

#include <cmath>
#include <cstdio>
#include <limits>

#include "booster/autograd/autograd.h"
#include "booster/ops/ops.h"

namespace booster::mixed_precision {

PrecisionStrategy::PrecisionStrategy(std::string name, nlohmann::json options, PrecisionRecipe recipe)
    : name_(std::move(name)), options_(std::move(options)), recipe_(std::move(recipe)) {
  BOOSTER_CHECK(!recipe_.master_weights || recipe_.model_dtype, ValueError, name_,
                ": master_weights needs a model_dtype to keep the model in");
}

PrecisionStrategy::PrecisionStrategy(const OptionReader& options, nlohmann::json values, PrecisionRecipe recipe)
    : PrecisionStrategy(options.strategy(), std::move(values), std::move(recipe)) {
  options.finish();
}

Configured PrecisionStrategy::configure(nn::ModulePtr model, std::shared_ptr<optim::Optimizer> optimizer,
                                        Criterion criterion) {
  const PrecisionRecipe& r = recipe_;
  if (!r.model_dtype && !r.autocast_dtype) return {std::move(model), std::move(optimizer), std::move(criterion)};
  BOOSTER_CHECK(model != nullptr, ValueError, name_, ": configure needs a model");
  Configured c{model, optimizer, criterion};
  if (r.model_dtype) {
    const DType dtype = *r.model_dtype;
    auto convert = [&] {
      if (r.convert_if) model->to(dtype, r.convert_if);
      else model->to(dtype);
    };
    if (r.master_weights) {
      // Without an optimizer (evaluation only) there is nothing to keep masters for: just convert.
      if (optimizer) masters_ = std::make_shared<MasterWeightOptimizer>(*optimizer, convert);
      else convert();
      c.optimizer = masters_;
    } else {
      // The converted parameters leave the original optimizer's flat buffers: step them with a fresh one.
      std::vector<optim::ParamGroup> groups;
      if (optimizer) groups = optimizer->param_groups();
      convert();
      if (optimizer) c.optimizer = rebuild_optimizer(*optimizer, std::move(groups));
    }
  }
  PrecisionModule::Options mo;
  mo.cast_io = r.model_dtype.has_value();
  mo.input_dtype = r.model_dtype.value_or(DType::Float32);
  mo.autocast = r.autocast_dtype.has_value();
  mo.autocast_dtype = r.autocast_dtype.value_or(DType::Float16);
  mo.linear_override = r.linear_override;
  c.model = std::make_shared<PrecisionModule>(model, mo);
  if (r.autocast_dtype) c.criterion = autocast_criterion(std::move(c.criterion), *r.autocast_dtype);
  return c;
}

MasterWeightOptimizer& PrecisionStrategy::masters_of(optim::Optimizer& optimizer) const {
  auto* m = dynamic_cast<MasterWeightOptimizer*>(&optimizer);
  BOOSTER_CHECK(m != nullptr && m == masters_.get(), StateError, name_,
                ": pass the optimizer that configure() returned (it keeps the float32 master weights), got a '",
                optimizer.name(), "' optimizer that is not it");
  return *m;
}

void PrecisionStrategy::backward(const Tensor& loss, optim::Optimizer& optimizer) {
  unscaled_this_step_ = false;
  found_inf_ = false;
  if (uses_masters()) masters_of(optimizer);  // refuses an optimizer other than configure()'s
  scaled_backward_ = true;
  // A model held in 16 bits gives its loss float32 through scale_loss even at scale 1.
  if (uses_masters() || recipe_.scaler) scale_loss(loss, loss_scale()).backward();
  else loss.backward();
}

void PrecisionStrategy::unscale_gradients(optim::Optimizer& optimizer) {
  if (unscaled_this_step_) return;
  unscaled_this_step_ = true;
  const LossScaler* scaler = recipe_.scaler.get();
  const bool checks = scaler && scaler->skips_non_finite();
  // torch: inv_scale = self._scale.double().reciprocal().float()
  const float inv_scale = float(1.0 / loss_scale());
  bool local_found_inf = false;
  if (uses_masters()) {
    // The gradients must reach the masters whatever the scale: the gather is the unscale pass.
    local_found_inf = masters_of(optimizer).gather_grads(inv_scale);
  } else if (checks || (scaler && inv_scale != 1.0f)) {
    std::vector<GradSpan> spans;
    for (const Tensor& g : flat_grads(optimizer)) spans.push_back({g, g});
    local_found_inf = fused_unscale_and_check(spans, inv_scale);
  }
  // Note [Agreeing on found_inf]: once per step, on every rank, and only where the verdict matters.
  found_inf_ = checks && agree_on_found_inf(local_found_inf);
}

std::vector<Tensor> PrecisionStrategy::unscaled_grads(optim::Optimizer& optimizer) {
  return uses_masters() ? masters_of(optimizer).master_grads() : flat_grads(optimizer);
}

double PrecisionStrategy::clip_grad_norm(optim::Optimizer& optimizer, double max_norm) {
  BOOSTER_CHECK(max_norm > 0.0, ValueError, name_, ": clip_grad_norm: max_norm must be > 0, got ", max_norm);
  unscale_gradients(optimizer);
  if (found_inf_) {
    pending_grad_norm_ = std::numeric_limits<double>::infinity();
    return pending_grad_norm_;
  }
  pending_grad_norm_ = clip_grads(unscaled_grads(optimizer), max_norm);
  return pending_grad_norm_;
}

void PrecisionStrategy::step(optim::Optimizer& optimizer) {
  // Note [A backward the scaler did not see]: looked for only when no scaled backward came.
  if (recipe_.scaler && !scaled_backward_ && !warned_unseen_backward_) {
    std::vector<Tensor> grads;
    int64_t elements = 0;
    for (const optim::ParamGroup& group : optimizer.param_groups())
      for (const Tensor& p : group.params)
        if (p.grad().defined()) {
          grads.push_back(p.grad());
          elements += p.grad().numel();
        }
    if (elements > 0 && count_zeros(grads) < elements) {
      warned_unseen_backward_ = true;
      std::fprintf(stderr,
                   "booster: warning: %s: the optimizer steps on gradients of a backward the loss scaler did not "
                   "see (loss.backward()?); call booster.backward(loss, optimizer) so the loss is scaled and the "
                   "gradients unscaled and checked for inf/NaN\n",
                   name_.c_str());
      std::fflush(stderr);
    }
  }
  scaled_backward_ = false;
  unscale_gradients(optimizer);
  stats_ = StepStats{};
  stats_.loss_scale = loss_scale();  // the scale this step's backward used
  stats_.skipped = found_inf_;
  stats_.grad_norm = pending_grad_norm_;
  if (recipe_.count_zeros) stats_.num_zeros = count_zeros(unscaled_grads(optimizer));
  if (uses_masters()) {
    MasterWeightOptimizer& m = masters_of(optimizer);
    if (found_inf_) m.drop_master_grads();
    else m.step_masters();
  } else if (!found_inf_) {
    optimizer.step();
  }
  pending_grad_norm_ = std::numeric_limits<double>::quiet_NaN();
  unscaled_this_step_ = false;
  if (recipe_.scaler) recipe_.scaler->update(found_inf_);  // may throw TrainingError at the scale's floor
}

MixedPrecisionState PrecisionStrategy::state_dict() const {
  MixedPrecisionState s;
  if (recipe_.scaler) s.meta["scaler"] = recipe_.scaler->state_dict();
  else if (uses_masters()) s.meta["scaler"] = nlohmann::json::object();
  if (masters_) {
    const auto& masters = masters_->masters();
    for (size_t g = 0; g < masters.size(); ++g)
      for (size_t i = 0; i < masters[g].size(); ++i)
        s.tensors["master_weights." + std::to_string(g) + "." + std::to_string(i)] = masters[g][i].detach();
  }
  return s;
}

void PrecisionStrategy::load_state_dict(const MixedPrecisionState& state) {
  if (uses_masters()) {
    BOOSTER_CHECK(masters_ != nullptr, StateError, name_, ".load_state_dict: call configure() first");
  } else if (recipe_.scaler) {
    BOOSTER_CHECK(state.meta.contains("scaler"), CheckpointError, name_, ".load_state_dict: no 'scaler' entry in ",
                  state.meta.dump());
  }
  if (recipe_.scaler && state.meta.contains("scaler")) recipe_.scaler->load_state_dict(state.meta.at("scaler"));
  if (!uses_masters()) return;
  const auto& masters = masters_->masters();
  NoGradGuard no_grad;
  for (size_t g = 0; g < masters.size(); ++g)
    for (size_t i = 0; i < masters[g].size(); ++i) {
      const std::string key = "master_weights." + std::to_string(g) + "." + std::to_string(i);
      auto it = state.tensors.find(key);
      BOOSTER_CHECK(it != state.tensors.end(), CheckpointError, name_, ".load_state_dict: missing '", key, "'");
      BOOSTER_CHECK(it->second.shape() == masters[g][i].shape(), CheckpointError, name_, ".load_state_dict: '", key,
                    "' has shape ", it->second.shape(), ", the master weight has ", masters[g][i].shape());
      Tensor m = masters[g][i];
      m.copy_(it->second);
    }
  // The model must hold the rounding of the masters it continues from.
  masters_->copy_masters_to_model();
}

}  // namespace booster::mixed_precision
