#include "booster/nn/loss.h"

namespace booster::nn {

CrossEntropyLoss::CrossEntropyLoss(CrossEntropyLossOptions o) : options(o) {
  BOOSTER_CHECK(o.label_smoothing >= 0.0 && o.label_smoothing <= 1.0, ValueError,
                "CrossEntropyLoss: label_smoothing must be in [0, 1], got ", o.label_smoothing);
}

Tensor CrossEntropyLoss::forward(const Tensor& input, const Tensor& target) const {
  return cross_entropy(input, target, options.reduction, options.ignore_index, options.label_smoothing);
}

std::string CrossEntropyLoss::extra_repr() const {
  return str("ignore_index=", options.ignore_index, ", label_smoothing=", options.label_smoothing);
}

Tensor MSELoss::forward(const Tensor& input, const Tensor& target) const { return mse_loss(input, target, reduction); }

}  // namespace booster::nn
