// MasterWeightOptimizer: float32 master copies of low-precision model parameters, stepped by an inner
// optimizer of the user's type and options, then rounded back into the model.
//
// Note [Master weights]
// A float16/bfloat16 parameter cannot absorb an update much smaller than itself (p + lr*g == p once
// lr*g is below half an ulp of p), so training a 16-bit model directly stalls. Mixed-precision
// recipes (apex O2, Megatron, ColossalAI's naive AMP, Lightning's bf16-true with masters) therefore
// keep a float32 copy of every parameter that the optimizer updates, and round it into the model
// after each step. Here both sides are flat (Note [Flat buffers]):
//   * this optimizer binds the model's 16-bit parameters (its param groups mirror the user's
//     optimizer's groups), so zero_grad() and backward fill one 16-bit gradient buffer per group;
//   * the inner optimizer binds the float32 masters, in the same order;
//   * gather_grads(inv_scale) moves the 16-bit gradients into the master gradients, unscaling and
//     checking for inf/NaN in the same pass (fused_unscale_and_check);
//   * step_masters() steps the inner optimizer and rounds the masters back into the model.
// Param-group options (lr, ...) set on this optimizer, by the user or an LR scheduler, are forwarded
// to the inner one before each step; state_dict() is the inner optimizer's (state of the masters).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "booster/optim/optimizer.h"

namespace booster::mixed_precision {

// A new optimizer of original's type (SGD, Adam, AdamW) and defaults over `groups` (IncompatibleError
// for other types). Strategies that convert the model after the user built the optimizer use it: the
// converted parameters no longer live in the original optimizer's flat buffers.
std::unique_ptr<optim::Optimizer> rebuild_optimizer(const optim::Optimizer& original,
                                                    std::vector<optim::ParamGroup> groups);

class MasterWeightOptimizer final : public optim::Optimizer {
 public:
  // `original` was built over the model's float32 parameters: its type (SGD, Adam, AdamW), groups and
  // options are copied. `convert_model` turns the model's parameters to low precision; it is called
  // after the masters are copied and before the converted parameters are bound.
  MasterWeightOptimizer(const optim::Optimizer& original, const std::function<void()>& convert_model);

  // Unscaled step: gather_grads(1), step_masters(). Strategies that scale call the two themselves.
  void step() override;
  std::string name() const override { return inner_->name(); }

  // Model gradients * inv_scale -> master gradients; true when any model gradient is inf or NaN.
  bool gather_grads(float inv_scale);
  // Steps the masters, rounds them into the model and clears the master gradients.
  void step_masters();
  // Clears the master gradients without stepping (a skipped step).
  void drop_master_grads();
  // Rounds the masters into the model parameters (after loading masters from a checkpoint).
  void copy_masters_to_model();

  // The master gradient buffers (one per flat buffer of the inner optimizer).
  std::vector<Tensor> master_grads();
  // Master parameters per group, in the order of param_groups()[g].params.
  const std::vector<std::vector<Tensor>>& masters() const { return masters_; }
  const optim::Optimizer& inner() const { return *inner_; }

  optim::OptimizerState state_dict() const override;
  void load_state_dict(const optim::OptimizerState& state) override;

 protected:
  void check_options(const nlohmann::json&) const override {}  // validated by the inner optimizer
  std::vector<std::string> state_names(const nlohmann::json&) const override { return {}; }

 private:
  void forward_options() const;
  // True when group g is one flat buffer on each side (then a pass is one span).
  bool one_span(size_t g) const;
  // Global index of group g's first parameter.
  size_t first_index(size_t g) const;

  std::unique_ptr<optim::Optimizer> inner_;
  std::vector<std::vector<Tensor>> masters_;
};

}  // namespace booster::mixed_precision
