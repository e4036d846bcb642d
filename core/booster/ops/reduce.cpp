// STUB: to be implemented (each throws NotImplementedError until then).
#include "booster/ops/ops.h"

namespace booster {

Tensor sum(const Tensor&, const std::vector<int64_t>&, bool) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }
Tensor mean(const Tensor&, const std::vector<int64_t>&, bool) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }
Tensor max(const Tensor&, int64_t, bool) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }
Tensor max(const Tensor&) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }
Tensor argmax(const Tensor&, int64_t, bool) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }
Tensor var(const Tensor&, const std::vector<int64_t>&, bool, bool) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }

}  // namespace booster
