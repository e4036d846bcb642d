// STUB: to be implemented (each throws NotImplementedError until then).
#include "booster/ops/ops.h"

namespace booster {

Reduction reduction_from_string(const std::string&) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }
Tensor cross_entropy(const Tensor&, const Tensor&, Reduction, int64_t, double) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }
Tensor nll_loss(const Tensor&, const Tensor&, Reduction, int64_t) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }
Tensor mse_loss(const Tensor&, const Tensor&, Reduction) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }

}  // namespace booster
