// float8 quantize/dequantize kernels (Note [Float8 formats] in tensor/float8.h). Both take contiguous
// tensors of one numel on one device.
#pragma once

#include "booster/kernels/dispatch.h"
#include "booster/tensor/tensor.h"

namespace booster::kernels {

// dst (float8) = src * scale rounded to dst's format, saturating or not; src float32, float16 or
// bfloat16 (the product is formed in float32 and rounded once to float8).
BOOSTER_DECLARE_KERNEL(float8_quantize_kernel, void(const Tensor& src, Tensor& dst, float scale, bool saturate));
// dst (float32, float16 or bfloat16) = float(src) * scale_inv, src float8.
BOOSTER_DECLARE_KERNEL(float8_dequantize_kernel, void(const Tensor& src, Tensor& dst, float scale_inv));

}  // namespace booster::kernels
