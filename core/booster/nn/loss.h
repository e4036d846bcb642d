// Losses as modules (torch.nn.CrossEntropyLoss, torch.nn.MSELoss) and the Criterion type every
// training driver takes: any callable (output, target) -> loss converts to it (a lambda, or a loss
// module by reference: `Criterion c = std::ref(cross_entropy_module);`; modules are not copyable).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "booster/nn/module.h"
#include "booster/ops/ops.h"

namespace booster::nn {

// loss = criterion(model output, target)
using Criterion = std::function<Tensor(const Tensor& output, const Tensor& target)>;

struct CrossEntropyLossOptions {
  Reduction reduction = Reduction::Mean;
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;
};

// input [N, C] or [N, C, d...] logits, target int64 class indices [N] or [N, d...], as torch.
class CrossEntropyLoss : public Module {
 public:
  explicit CrossEntropyLoss(CrossEntropyLossOptions options = {});
  Tensor forward(const Tensor& input, const Tensor& target) const;
  Tensor operator()(const Tensor& input, const Tensor& target) const { return forward(input, target); }
  std::string name() const override { return "CrossEntropyLoss"; }
  std::string extra_repr() const override;
  const CrossEntropyLossOptions options;
};

// The targets of `target` (integer class indices) that are not ignore_index: what a mean cross-entropy
// divides by, and what the token mean of a global batch counts (Note [The token mean of a global batch]
// in booster/trainer/trainer.cpp). Read on the host: a device tensor is copied back once.
int64_t count_targets(const Tensor& target, int64_t ignore_index = -100);

class MSELoss : public Module {
 public:
  explicit MSELoss(Reduction reduction = Reduction::Mean) : reduction(reduction) {}
  Tensor forward(const Tensor& input, const Tensor& target) const;
  Tensor operator()(const Tensor& input, const Tensor& target) const { return forward(input, target); }
  std::string name() const override { return "MSELoss"; }
  const Reduction reduction;
};

}  // namespace booster::nn
