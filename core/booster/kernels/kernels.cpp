// The one definition of every kernel family's dispatch stub; backends register into them.
#include "booster/kernels/elementwise.h"
#include "booster/kernels/float8.h"
#include "booster/kernels/gemm.h"
#include "booster/kernels/tensor_stats.h"

namespace booster::kernels {

BOOSTER_DEFINE_KERNEL(copy_kernel);
BOOSTER_DEFINE_KERNEL(fill_kernel);
BOOSTER_DEFINE_KERNEL(binary_kernel);
BOOSTER_DEFINE_KERNEL(unary_kernel);
BOOSTER_DEFINE_KERNEL(unary_backward_kernel);
BOOSTER_DEFINE_KERNEL(where_kernel);
BOOSTER_DEFINE_KERNEL(reduce_kernel);
BOOSTER_DEFINE_KERNEL(gemm_kernel);
BOOSTER_DEFINE_KERNEL(fixed_order_gemm_kernel);
BOOSTER_DEFINE_KERNEL(float8_quantize_kernel);
BOOSTER_DEFINE_KERNEL(float8_dequantize_kernel);
BOOSTER_DEFINE_KERNEL(float8_gemm_kernel);
BOOSTER_DEFINE_KERNEL(tensor_stats_kernel);

}  // namespace booster::kernels
