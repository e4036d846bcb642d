#include "booster/nn/dropout.h"

#include "booster/ops/ops.h"

namespace booster::nn {

Dropout::Dropout(double prob, std::shared_ptr<Generator> gen) : p(prob), gen_(std::move(gen)) {
  BOOSTER_CHECK(p >= 0.0 && p <= 1.0, ValueError, "Dropout: probability must be between 0 and 1, got ", p);
}

Tensor Dropout::forward(const Tensor& x) {
  if (!is_training() || p == 0.0) return x;
  return dropout(x, p, true, gen_.get());
}

}  // namespace booster::nn
