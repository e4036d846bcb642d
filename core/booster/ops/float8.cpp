// float8 casts with a scale (kernels/float8.h).
#include "booster/common/error_context.h"
#include "booster/kernels/float8.h"
#include "booster/ops/ops.h"

namespace booster {

Tensor to_float8(const Tensor& x, DType dtype, float scale, bool saturate) {
  BOOSTER_OP_CONTEXT("to_float8");  // Note [Error context]
  BOOSTER_CHECK(is_float8(dtype), DTypeError, "to_float8: target must be float8_e4m3fn or float8_e5m2, got ", dtype);
  BOOSTER_CHECK(x.dtype() == DType::Float32 || is_low_precision(x.dtype()), DTypeError,
                "to_float8: input must be float32, float16 or bfloat16, got ", x.dtype());
  const Tensor src = x.contiguous();
  Tensor out = Tensor::empty(x.shape(), dtype, x.device());
  kernels::float8_quantize_kernel(x.device())(src, out, scale, saturate);
  return out;
}

Tensor from_float8(const Tensor& q, float scale_inv, DType out_dtype) {
  BOOSTER_OP_CONTEXT("from_float8");  // Note [Error context]
  BOOSTER_CHECK(is_float8(q.dtype()), DTypeError, "from_float8: input must be float8_e4m3fn or float8_e5m2, got ",
                q.dtype());
  BOOSTER_CHECK(out_dtype == DType::Float32 || is_low_precision(out_dtype), DTypeError,
                "from_float8: output must be float32, float16 or bfloat16, got ", out_dtype);
  const Tensor src = q.contiguous();
  Tensor out = Tensor::empty(q.shape(), out_dtype, q.device());
  kernels::float8_dequantize_kernel(q.device())(src, out, scale_inv);
  return out;
}

}  // namespace booster
