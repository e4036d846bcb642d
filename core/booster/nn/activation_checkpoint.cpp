// Note [Recomputing in backward] (activation_checkpoint.h).
#include "booster/nn/activation_checkpoint.h"

#include <optional>

#include "booster/autocast/autocast.h"
#include "booster/autograd/autograd.h"
#include "booster/nn/packing.h"

namespace booster::nn {

namespace {

struct SavedRng {
  Generator* gen;
  std::vector<uint64_t> state;
};

std::vector<SavedRng> save_rng(const Module& module) {
  std::vector<SavedRng> out{{&default_generator(), default_generator().state()}};
  for (const auto& [name, gen] : module.named_generators()) out.push_back({gen, gen->state()});
  return out;
}

// Grad mode on for the recompute (backward closures run with it off), and back after.
struct GradModeOn {
  bool prev = autograd::grad_mode_enabled();
  GradModeOn() { autograd::set_grad_mode(true); }
  ~GradModeOn() { autograd::set_grad_mode(prev); }
};

}  // namespace

Tensor checkpoint(Module& module, const Tensor& x) {
  const std::vector<Tensor> params = module.parameters();
  const bool grads_needed = autograd::grad_mode_enabled() && (x.requires_grad() || autograd::needs_grad(params));
  if (!grads_needed) return module(x);

  const std::vector<SavedRng> rng_at_forward = save_rng(module);
  const autocast::State autocast_at_forward = autocast::state();
  // The packed layout the forward runs under (Note [Packed sequences] in packing.h), installed again
  // for the recompute: backward runs outside the model's forward, where the thread holds none.
  std::optional<SequenceLayout> layout_at_forward;
  if (const SequenceLayout* layout = current_sequence_layout()) layout_at_forward = *layout;
  Tensor out;
  {
    autograd::NoGradGuard no_grad;
    out = module(x);
  }
  // The node hangs on the input; a leaf stand-in when the input itself needs no gradient but the
  // parameters do.
  const Tensor input = x.requires_grad() ? x : x.detach().requires_grad_();
  Module* m = &module;
  autograd::record(out, "CheckpointBackward", {input},
                   [m, saved = x.detach(), rng_at_forward, autocast_at_forward, layout_at_forward](const Tensor& g) {
                     // Recompute with the forward's random state and autocast, then put the streams back.
                     std::vector<SavedRng> now;
                     for (const SavedRng& r : rng_at_forward) {
                       now.push_back({r.gen, r.gen->state()});
                       r.gen->set_state(r.state);
                     }
                     Tensor leaf = saved.detach().requires_grad_();
                     Tensor recomputed;
                     {
                       GradModeOn grad_on;
                       std::optional<SequenceLayoutScope> packed;
                       if (layout_at_forward) packed.emplace(*layout_at_forward);
                       autocast::AutocastGuard ac(autocast_at_forward.enabled, autocast_at_forward.dtype,
                                                  autocast_at_forward.table, autocast_at_forward.linear_override);
                       recomputed = (*m)(leaf);
                     }
                     for (const SavedRng& r : now) r.gen->set_state(r.state);
                     autograd::backward(recomputed, g.to(recomputed.dtype()), /*retain_graph=*/false);
                     return autograd::grads{leaf.grad()};
                   });
  return out;
}

Checkpoint::Checkpoint(ModulePtr wrapped) : module(std::move(wrapped)) {
  BOOSTER_CHECK(module != nullptr, ValueError, "Checkpoint: the module is null");
  register_module("module", module);
}

}  // namespace booster::nn
