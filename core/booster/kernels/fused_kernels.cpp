// The one definition of each fused multi-tensor kernel's dispatch stub (declared in kernels/fused.h).
#include "booster/kernels/fused.h"

namespace booster::kernels {

BOOSTER_DEFINE_KERNEL(unscale_check_kernel);
BOOSTER_DEFINE_KERNEL(sum_squares_kernel);
BOOSTER_DEFINE_KERNEL(count_zeros_kernel);
BOOSTER_DEFINE_KERNEL(adam_kernel);
BOOSTER_DEFINE_KERNEL(sgd_kernel);

}  // namespace booster::kernels
