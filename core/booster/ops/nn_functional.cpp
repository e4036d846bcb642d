// STUB: to be implemented (each throws NotImplementedError until then).
#include "booster/ops/ops.h"

namespace booster {

Tensor softmax(const Tensor&, int64_t) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }
Tensor log_softmax(const Tensor&, int64_t) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }
Tensor layer_norm(const Tensor&, const Shape&, const Tensor&, const Tensor&, double) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }
Tensor batch_norm(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool, double, double) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }
Tensor dropout(const Tensor&, double, bool, Generator*) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }
Tensor scaled_dot_product_attention(const Tensor&, const Tensor&, const Tensor&, bool, std::optional<double>) { BOOSTER_FAIL(NotImplementedError, __func__, ": not implemented yet"); }

}  // namespace booster
