// float8 kernels (Note [Float8 formats] in tensor/float8.h): quantize and dequantize (contiguous tensors
// of one numel on one device), and the scaled float8 GEMM of a backend that has one.
#pragma once

#include "booster/kernels/dispatch.h"
#include "booster/tensor/tensor.h"

namespace booster::kernels {

// dst (float8) = src * scale rounded to dst's format, saturating or not; src float32, float16 or
// bfloat16 (the product is formed in float32 and rounded once to float8).
BOOSTER_DECLARE_KERNEL(float8_quantize_kernel, void(const Tensor& src, Tensor& dst, float scale, bool saturate));
// dst (float32, float16 or bfloat16) = float(src) * scale_inv, src float8.
BOOSTER_DECLARE_KERNEL(float8_dequantize_kernel, void(const Tensor& src, Tensor& dst, float scale_inv));
// out [n, m] = (a [n, k] . b [m, k]^T) / (scale_a * scale_b), a and b contiguous float8 quantized as
// fp8(x * scale) (not both e5m2), float32 accumulation, out float32 or bfloat16 (contiguous). Returns
// false, leaving out untouched, where the backend's GEMM cannot take these shapes or this device
// (float8_mm then computes it from the dequantized values). Registered by CUDA only (cuBLASLt).
BOOSTER_DECLARE_KERNEL(float8_gemm_kernel, bool(const Tensor& a, const Tensor& b, float scale_a, float scale_b,
                                                Tensor& out));

}  // namespace booster::kernels
