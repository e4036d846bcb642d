// The doctor's per-tensor statistics (diagnostics/tensor_stats.h) in one pass on the tensor's device,
// so a statistics step on a GPU reads each traced tensor there instead of copying it to the host.
// Registered by CUDA (backends/cuda/tensor_stats.cu); the CPU computes them in tensor_stats.cpp.
#pragma once

#include <cstdint>

#include "booster/kernels/dispatch.h"
#include "booster/tensor/tensor.h"

namespace booster::kernels {

// Per format (float16, bfloat16, e4m3, e5m2), as float32 bit patterns of |x|: overflow at or above
// overflow_from, underflow to zero at or below underflow_upto, subnormal between it and normal_from.
struct StatsThresholds {
  uint32_t overflow_from[4], underflow_upto[4], normal_from[4];
};

// The layout of the counts: non-finite, zeros, the largest finite |x| (float32 bits), the 255 bins of
// the float32 exponent field of the finite nonzero values, then per format overflow, underflow and
// subnormal counts.
inline constexpr int kStatsNonfinite = 0, kStatsZeros = 1, kStatsMaxBits = 2, kStatsExponents = 3,
                     kStatsFormats = kStatsExponents + 255, kStatsSlots = kStatsFormats + 3 * 4;

// Adds the statistics of `values` (1-D contiguous float32) into `counts` (int64 [kStatsSlots], on the
// same device; the max slot takes the larger).
BOOSTER_DECLARE_KERNEL(tensor_stats_kernel,
                       void(const Tensor& values, const StatsThresholds& thresholds, Tensor& counts));

}  // namespace booster::kernels
