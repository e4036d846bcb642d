// Activation checkpointing: run a module's forward without keeping its activations, and recompute
// them in backward (torch.utils.checkpoint). Trades one more forward of the module for the memory of
// everything it would have saved for backward.
//
//   x = nn::checkpoint(*block, x);                     // in a forward: functional, names unchanged
//   auto wrapped = std::make_shared<nn::Checkpoint>(block);  // or as a module (parameters under "module.")
//
// Note [Recomputing in backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Forward runs under NoGradGuard and keeps only the input. Its node's backward runs the module again
// with grad mode on, under the autocast state forward had, with every random generator the forward
// drew from (the default one and the module's own, Module::named_generators) set back to its state at
// forward time, then restored, so dropout draws the same masks and the random streams after the step
// are those of a plain run. Backward of the recomputed graph accumulates the parameters' gradients
// (their grad-ready hooks fire as usual, so data-parallel reduction still overlaps) and returns the
// input's. The recomputed ops are the forward's, in the same dtypes and order, so the gradients equal
// the plain run's bit for bit. The packed layout the forward ran under (current_sequence_layout(),
// Note [Packed sequences] in packing.h) is held by the node and installed again for the recompute, so
// packed documents stay apart in it as in the forward.
// Outside grad mode (evaluation, NoGradGuard) it is a plain forward.
#pragma once

#include "booster/nn/module.h"

namespace booster::nn {

Tensor checkpoint(Module& module, const Tensor& x);

class Checkpoint : public Module {
 public:
  explicit Checkpoint(ModulePtr module);
  Tensor forward(const Tensor& x) override { return checkpoint(*module, x); }
  std::string name() const override { return "Checkpoint"; }
  const ModulePtr module;
};

}  // namespace booster::nn
