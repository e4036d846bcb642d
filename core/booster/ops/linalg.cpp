// STUB: to be implemented (each throws NotImplementedError until then).
#include "booster/ops/ops.h"

namespace booster {

Tensor matmul(const Tensor&, const Tensor&) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }
Tensor linear(const Tensor&, const Tensor&, const Tensor&) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }
Tensor bmm(const Tensor&, const Tensor&) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }

}  // namespace booster
