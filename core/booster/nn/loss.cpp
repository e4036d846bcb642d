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

int64_t count_targets(const Tensor& target, int64_t ignore_index) {
  BOOSTER_CHECK(!is_floating(target.dtype()), DTypeError, "count_targets: the targets are ", target.dtype(),
                "; they must be integer class indices (a loss with ignore_index)");
  const Tensor t = target.cpu().to(DType::Int64).contiguous();
  const int64_t* p = t.data<int64_t>();
  int64_t n = 0;
  for (int64_t i = 0, e = t.numel(); i < e; ++i) n += p[i] != ignore_index;
  return n;
}

Tensor MSELoss::forward(const Tensor& input, const Tensor& target) const { return mse_loss(input, target, reduction); }

}  // namespace booster::nn
