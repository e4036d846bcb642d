// CUDA tensor statistics (kernels/tensor_stats.h): one grid-stride pass; each block gathers its
// counts and exponent histogram in shared memory (warp-aggregated), then adds them to the int64 counts.
#include "booster/backends/cuda/common.cuh"
#include "booster/kernels/tensor_stats.h"

namespace booster::cuda {
namespace {

using kernels::kStatsExponents;
using kernels::kStatsFormats;
using kernels::kStatsMaxBits;
using kernels::kStatsNonfinite;
using kernels::kStatsSlots;
using kernels::kStatsZeros;

__global__ void tensor_stats_cuda(const float* x, int64_t n, kernels::StatsThresholds th,
                                  unsigned long long* counts) {
  __shared__ unsigned int hist[255];
  __shared__ unsigned int block_counts[3 + 12];  // nonfinite, zeros, max bits, formats
  for (int i = threadIdx.x; i < 255; i += blockDim.x) hist[i] = 0;
  if (threadIdx.x < 15) block_counts[threadIdx.x] = 0;
  __syncthreads();
  unsigned int nonfinite = 0, zeros = 0, max_bits = 0, formats[12] = {};
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t a = __float_as_uint(x[i]) & 0x7fffffffu;
    if (a >= 0x7f800000u) {
      ++nonfinite;
    } else if (a == 0) {
      ++zeros;
    } else {
      max_bits = max(max_bits, a);
      // Values of a tensor crowd into a few exponents: one shared atomic per bin per warp.
      const unsigned int bin = a >> 23;
      const unsigned int same = __match_any_sync(__activemask(), bin);
      if ((threadIdx.x & 31) == unsigned(__ffs(same) - 1)) atomicAdd(&hist[bin], unsigned(__popc(same)));
#pragma unroll
      for (int f = 0; f < 4; ++f) {
        formats[3 * f] += a >= th.overflow_from[f];
        formats[3 * f + 1] += a <= th.underflow_upto[f];
        formats[3 * f + 2] += a > th.underflow_upto[f] && a < th.normal_from[f];
      }
    }
  }
  const unsigned full = 0xffffffffu;
  nonfinite = __reduce_add_sync(full, nonfinite);
  zeros = __reduce_add_sync(full, zeros);
  max_bits = __reduce_max_sync(full, max_bits);
#pragma unroll
  for (int k = 0; k < 12; ++k) formats[k] = __reduce_add_sync(full, formats[k]);
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(&block_counts[0], nonfinite);
    atomicAdd(&block_counts[1], zeros);
    atomicMax(&block_counts[2], max_bits);
    for (int k = 0; k < 12; ++k) atomicAdd(&block_counts[3 + k], formats[k]);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 255; i += blockDim.x)
    if (hist[i]) atomicAdd(&counts[kStatsExponents + i], (unsigned long long)hist[i]);
  if (threadIdx.x == 0) {
    atomicAdd(&counts[kStatsNonfinite], (unsigned long long)block_counts[0]);
    atomicAdd(&counts[kStatsZeros], (unsigned long long)block_counts[1]);
    atomicMax(&counts[kStatsMaxBits], (unsigned long long)block_counts[2]);
    for (int k = 0; k < 12; ++k) atomicAdd(&counts[kStatsFormats + k], (unsigned long long)block_counts[3 + k]);
  }
}

void cuda_tensor_stats(const Tensor& values, const kernels::StatsThresholds& thresholds, Tensor& counts) {
  BOOSTER_CHECK(values.dtype() == DType::Float32 && values.is_contiguous() && counts.dtype() == DType::Int64 &&
                    counts.numel() == kStatsSlots,
                DTypeError, "tensor_stats: expected contiguous float32 values and int64 [", kStatsSlots, "] counts");
  const int dev = device_of(values);
  const int64_t n = values.numel();
  if (n == 0) return;
  // Threads of a block must be whole warps: the warp reductions above take every lane.
  tensor_stats_cuda<<<grid_for(dev, n), 256, 0, stream(dev)>>>(static_cast<const float*>(values.data_ptr()), n,
                                                             thresholds,
                                                             static_cast<unsigned long long*>(counts.data_ptr()));
  BOOSTER_CUDA_CHECK_LAUNCH();
}

}  // namespace
}  // namespace booster::cuda

namespace booster::kernels {
BOOSTER_REGISTER_CUDA_KERNEL(tensor_stats_kernel, cuda::cuda_tensor_stats);
}  // namespace booster::kernels
