// STUB: to be implemented (each throws NotImplementedError until then).
#include "booster/ops/ops.h"

namespace booster {

Tensor cat(const std::vector<Tensor>&, int64_t) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }
Tensor stack(const std::vector<Tensor>&, int64_t) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }
std::vector<Tensor> split(const Tensor&, int64_t, int64_t) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }
std::vector<Tensor> chunk(const Tensor&, int64_t, int64_t) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }
Tensor embedding(const Tensor&, const Tensor&) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }
Tensor gather(const Tensor&, int64_t, const Tensor&) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }
Tensor index_select(const Tensor&, int64_t, const Tensor&) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }

}  // namespace booster
