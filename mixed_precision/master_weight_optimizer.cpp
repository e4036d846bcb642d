#include "booster/mixed_precision/master_weight_optimizer.h"

#include "booster/autograd/autograd.h"
#include "booster/mixed_precision/mixed_precision.h"

namespace booster::mixed_precision {

std::unique_ptr<optim::Optimizer> rebuild_optimizer(const optim::Optimizer& original, std::vector<optim::ParamGroup> groups) {
  const std::string type = original.name();
  if (type == "SGD") return std::make_unique<optim::SGD>(std::move(groups), original.defaults());
  if (type == "Adam") return std::make_unique<optim::Adam>(std::move(groups), original.defaults());
  if (type == "AdamW") return std::make_unique<optim::AdamW>(std::move(groups), original.defaults());
  BOOSTER_FAIL(IncompatibleError, "master weights: cannot rebuild a '", type,
               "' optimizer over converted parameters; supported: SGD, Adam, AdamW");
}

MasterWeightOptimizer::MasterWeightOptimizer(const optim::Optimizer& original,
                                             const std::function<void()>& convert_model)
    : Optimizer(original.name(), original.defaults()) {
  std::vector<optim::ParamGroup> master_groups, model_groups;
  for (const optim::ParamGroup& g : original.param_groups()) {
    std::vector<Tensor> masters;
    for (const Tensor& p : g.params) {
      BOOSTER_CHECK(is_floating(p.dtype()), DTypeError, "master weights: parameter '", p.name(),
                    "' is ", p.dtype(), "; expected a floating parameter");
      Tensor m = p.detach().to(DType::Float32).clone();
      m.requires_grad_(p.requires_grad());
      m.set_name(p.name());
      masters.push_back(m);
    }
    master_groups.push_back({masters, g.options});
    model_groups.push_back({g.params, g.options});
    masters_.push_back(std::move(masters));
  }
  convert_model();
  inner_ = rebuild_optimizer(original, std::move(master_groups));
  // The inner optimizer bound the masters (repointing them into its flat buffers); masters_ holds the
  // same TensorImpls, so it sees the flat memory.
  add_groups(std::move(model_groups));
}

void MasterWeightOptimizer::forward_options() const {
  for (size_t g = 0; g < groups_.size(); ++g) inner_->param_groups()[g].options = groups_[g].options;
}

bool MasterWeightOptimizer::one_span(size_t g) const {
  bind_deferred();  // Note [Deferred binding]
  return segments_[g].size() == 1 && inner_->flat_buffers(g).size() == 1 &&
         segments_[g][0].flat.numel() == inner_->flat_buffers(g)[0]->numel();
}

size_t MasterWeightOptimizer::first_index(size_t g) const {
  size_t n = 0;
  for (size_t k = 0; k < g; ++k) n += groups_[k].params.size();
  return n;
}

bool MasterWeightOptimizer::gather_grads(float inv_scale) {
  bind_deferred();  // Note [Deferred binding]
  std::vector<GradSpan> spans;
  for (size_t g = 0; g < groups_.size(); ++g) {
    // Which model gradients arrived since zero_grad (Note [Flat buffers]): only those masters count
    // as having a gradient, so the inner optimizer skips parameters that got none, as torch does.
    std::vector<char> arrived_by_param(groups_[g].params.size(), 0);
    for (Segment& seg : segments_[g]) {
      seg.flat.check_bound("master weights");
      const std::vector<char> arrived = seg.flat.sync_grads();
      // A segment holds the group's parameters of one dtype; seg.index gives their global indices,
      // and the group's parameters are numbered consecutively from its first one.
      for (size_t i = 0; i < arrived.size(); ++i) arrived_by_param[seg.index[i] - first_index(g)] = arrived[i];
    }
    if (one_span(g)) {
      spans.push_back({segments_[g][0].flat.grad(), inner_->flat_buffers(g)[0]->grad()});
    } else {
      for (size_t j = 0; j < groups_[g].params.size(); ++j) {
        const Tensor& p = groups_[g].params[j];
        if (!p.requires_grad() || !p.grad().defined()) continue;
        spans.push_back({p.grad().reshape({-1}), masters_[g][j].grad().reshape({-1})});
      }
    }
    for (size_t j = 0; j < masters_[g].size(); ++j)
      if (arrived_by_param[j] && masters_[g][j].grad().defined()) masters_[g][j].grad().bump_version();
  }
  return fused_unscale_and_check(spans, inv_scale);
}

std::vector<Tensor> MasterWeightOptimizer::master_grads() {
  std::vector<Tensor> out;
  for (size_t g = 0; g < groups_.size(); ++g)
    for (const optim::FlatBuffer* fb : inner_->flat_buffers(g)) out.push_back(fb->grad());
  return out;
}

void MasterWeightOptimizer::step_masters() {
  forward_options();
  inner_->step();
  copy_masters_to_model();
  inner_->zero_grad();
}

void MasterWeightOptimizer::drop_master_grads() { inner_->zero_grad(); }

void MasterWeightOptimizer::copy_masters_to_model() {
  bind_deferred();  // Note [Deferred binding]
  NoGradGuard no_grad;
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (one_span(g)) {
      Tensor model_flat = segments_[g][0].flat.data();
      model_flat.copy_(inner_->flat_buffers(g)[0]->data());
    } else {
      for (size_t j = 0; j < groups_[g].params.size(); ++j) {
        Tensor p = groups_[g].params[j];
        p.copy_(masters_[g][j]);
      }
    }
    for (const Tensor& p : groups_[g].params) p.bump_version();
  }
}

void MasterWeightOptimizer::step() {
  gather_grads(1.0f);
  step_masters();
}

optim::OptimizerState MasterWeightOptimizer::state_dict() const {
  forward_options();
  return inner_->state_dict();
}

void MasterWeightOptimizer::load_state_dict(const optim::OptimizerState& state) {
  inner_->load_state_dict(state);
  for (size_t g = 0; g < groups_.size(); ++g) groups_[g].options = inner_->param_groups()[g].options;
}

}  // namespace booster::mixed_precision
