// float8 casts with a scale and the scaled float8 GEMM (kernels/float8.h).
#include <cmath>

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

Tensor float8_mm(const Tensor& a, const Tensor& b, float scale_a, float scale_b, DType out_dtype) {
  BOOSTER_OP_CONTEXT("float8_mm");  // Note [Error context]
  BOOSTER_CHECK(is_float8(a.dtype()) && is_float8(b.dtype()), DTypeError,
                "float8_mm: both operands must be float8, got ", a.dtype(), " and ", b.dtype());
  BOOSTER_CHECK(!(a.dtype() == DType::Float8E5M2 && b.dtype() == DType::Float8E5M2), DTypeError,
                "float8_mm: two float8_e5m2 operands (float8 GEMMs take e4m3 x e4m3 or one e5m2); quantize one "
                "as float8_e4m3fn");
  BOOSTER_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1), ShapeError, "float8_mm: expected a [n, k] "
                "and b [m, k], got ", a.shape(), " and ", b.shape());
  BOOSTER_CHECK(a.device() == b.device(), DeviceError, "float8_mm: operands on ", a.device(), " and ", b.device());
  BOOSTER_CHECK(out_dtype == DType::Float32 || out_dtype == DType::BFloat16, DTypeError,
                "float8_mm: the output must be float32 or bfloat16, got ", out_dtype);
  BOOSTER_CHECK(scale_a > 0.0f && scale_b > 0.0f && std::isfinite(scale_a) && std::isfinite(scale_b), ValueError,
                "float8_mm: scales must be positive and finite, got ", scale_a, " and ", scale_b);
  if (kernels::float8_gemm_kernel.has(a.device().type)) {
    Tensor out = Tensor::empty({a.size(0), b.size(0)}, out_dtype, a.device());
    if (kernels::float8_gemm_kernel(a.device())(a.contiguous(), b.contiguous(), scale_a, scale_b, out)) return out;
  }
  const Tensor y = matmul(from_float8(a), from_float8(b).t()) * (1.0 / (double(scale_a) * double(scale_b)));
  return out_dtype == DType::Float32 ? y : y.to(out_dtype);
}

}  // namespace booster
