// Internals shared by the CUDA backend's translation units (never included outside backends/cuda):
// the checked-call macros, the backend's stream and cuBLAS handle, device-side element types and a
// strided offset calculator for elementwise loops.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "booster/backends/cuda/cuda.h"
#include "booster/tensor/tensor.h"

namespace booster::cuda {

// Note [Checked CUDA calls]
// Every CUDA runtime and cuBLAS call goes through BOOSTER_CUDA_CHECK / BOOSTER_CUBLAS_CHECK, and every
// kernel launch is followed by BOOSTER_CUDA_CHECK_LAUNCH(): a failure throws CudaError naming the call
// as written, the library's error string, and file:line. Launches are asynchronous, so an error that
// happens while a kernel runs surfaces at the next checked call (typically the next synchronizing copy).
[[noreturn]] void throw_cuda_error(const char* call, cudaError_t err, const char* file, int line);
[[noreturn]] void throw_cublas_error(const char* call, cublasStatus_t st, const char* file, int line);

#define BOOSTER_CUDA_CHECK(call)                                                           \
  do {                                                                                     \
    const cudaError_t booster_err_ = (call);                                               \
    if (booster_err_ != cudaSuccess) [[unlikely]]                                          \
      ::booster::cuda::throw_cuda_error(#call, booster_err_, __FILE__, __LINE__);          \
  } while (0)
#define BOOSTER_CUDA_CHECK_LAUNCH() BOOSTER_CUDA_CHECK(cudaGetLastError())
#define BOOSTER_CUBLAS_CHECK(call)                                                         \
  do {                                                                                     \
    const cublasStatus_t booster_st_ = (call);                                             \
    if (booster_st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                 \
      ::booster::cuda::throw_cublas_error(#call, booster_st_, __FILE__, __LINE__);         \
  } while (0)

// The one stream per device every kernel, copy and cuBLAS call of the backend is queued on (so
// operations are ordered without events, and the caching allocator can reuse a freed block at once).
cudaStream_t stream(int device);
// Makes `device` current on this thread (cheap when it already is). Note [CUDA device routing].
void set_device(int device);
// Waits for the streams of every device the backend has used (and touches no other device).
void synchronize_started();
cublasHandle_t cublas_handle(int device);
cublasLtHandle_t cublaslt_handle(int device);
// Scratch for cuBLASLt (workspace), grown on demand and kept.
void* cublas_workspace(int device, size_t& bytes);
int sm_count(int device);
// The cuBLAS data type of a floating dtype; DTypeError naming `op` for any other.
inline cudaDataType_t cuda_type(DType t, const char* op) {
  switch (t) {
    case DType::Float32: return CUDA_R_32F;
    case DType::Float64: return CUDA_R_64F;
    case DType::Float16: return CUDA_R_16F;
    case DType::BFloat16: return CUDA_R_16BF;
    default: BOOSTER_FAIL(DTypeError, op, ": expected a floating dtype, got ", t);
  }
}

// ------------------------------------------------------------------------------ kernel profile
// Note [CUDA kernel profile]
// With BOOSTER_CUDA_PROFILE=1 in the environment, every kernel family registered through
// BOOSTER_REGISTER_CUDA_KERNEL synchronizes the stream before and after it runs and adds the elapsed
// time to its family's total (cuda::profile_report() prints the table). Synchronizing serializes host
// and device, so the totals are device time per family plus launch overhead; steps run slower while
// profiling. Off (the default), the wrapper costs one well-predicted branch.
bool profiling();
void profile_add(const char* family, double seconds);
double profile_clock();

template <auto Fn> struct Timed;
template <class R, class... A, R (*Fn)(A...)>
struct Timed<Fn> {
  static inline const char* family = "?";
  static R call(A... a) {
    if (!profiling()) return Fn(a...);
    synchronize_started();
    const double t0 = profile_clock();
    if constexpr (std::is_void_v<R>) {
      Fn(a...);
      synchronize_started();
      profile_add(family, profile_clock() - t0);
    } else {
      R r = Fn(a...);
      synchronize_started();
      profile_add(family, profile_clock() - t0);
      return r;
    }
  }
};

#define BOOSTER_REGISTER_CUDA_KERNEL(kname, fn)                                                            \
  [[maybe_unused]] static const bool booster_cuda_family_##kname = (::booster::cuda::Timed<fn>::family = #kname, true); \
  BOOSTER_REGISTER_KERNEL(kname, CUDA, &::booster::cuda::Timed<fn>::call)

// ------------------------------------------------------------------------------ device element types
// booster::Half / BFloat16 are host types with the IEEE bit layouts of __half / __nv_bfloat16.
template <class T> struct DevType { using type = T; };
template <> struct DevType<Half> { using type = __half; };
template <> struct DevType<BFloat16> { using type = __nv_bfloat16; };
template <class T> using dev_t = typename DevType<T>::type;

// The type a kernel computes in, as the CPU backend's acc_t: float for 16-bit floats, the type itself
// otherwise (integer division stays integer division).
template <class T> struct CompType { using type = T; };
template <> struct CompType<float> { using type = float; };
template <> struct CompType<__half> { using type = float; };
template <> struct CompType<__nv_bfloat16> { using type = float; };
template <class T> using comp_t = typename CompType<T>::type;

template <class C, class T>
__device__ __forceinline__ C load_as(T v) {
  if constexpr (std::is_same_v<T, __half>) return C(__half2float(v));
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return C(__bfloat162float(v));
  else return C(v);
}
template <class T, class C>
__device__ __forceinline__ T store_as(C v) {
  if constexpr (std::is_same_v<T, __half>) return __float2half_rn(float(v));
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(float(v));
  else if constexpr (std::is_same_v<T, bool>) return v != C(0);
  else return T(v);
}

// ------------------------------------------------------------------------------ strided offsets
// Up to kMaxDims dims (after merging dims that are contiguous in every operand) and NT operands.
inline constexpr int kMaxDims = 10;

template <int NT>
struct OffsetCalc {
  int ndim = 0;
  int64_t sizes[kMaxDims];
  int64_t strides[NT][kMaxDims];
  bool contiguous = true;  // every operand is dense row-major: offsets are the linear index

  bool small = false;       // every size, stride and offset fits 32 bits: cheaper index arithmetic

  __device__ __forceinline__ void get(int64_t linear, int64_t (&off)[NT]) const {
#pragma unroll
    for (int t = 0; t < NT; ++t) off[t] = 0;
    if (contiguous) {
#pragma unroll
      for (int t = 0; t < NT; ++t) off[t] = linear;
      return;
    }
    if (small) {
      // 64-bit division is emulated in software on the GPU (tens of instructions); 32-bit is not.
      uint32_t l = uint32_t(linear);
      uint32_t o[NT];
#pragma unroll
      for (int t = 0; t < NT; ++t) o[t] = 0;
      for (int d = ndim - 1; d >= 0; --d) {
        const uint32_t size = uint32_t(sizes[d]);
        const uint32_t q = l / size, i = l - q * size;
        l = q;
#pragma unroll
        for (int t = 0; t < NT; ++t) o[t] += i * uint32_t(strides[t][d]);
      }
#pragma unroll
      for (int t = 0; t < NT; ++t) off[t] = int64_t(o[t]);
      return;
    }
    for (int d = ndim - 1; d >= 0; --d) {
      const int64_t i = linear % sizes[d];
      linear /= sizes[d];
#pragma unroll
      for (int t = 0; t < NT; ++t) off[t] += i * strides[t][d];
    }
  }
};

// Operands share `shape` (broadcast ones have stride 0). Merges adjacent dims that are contiguous
// in every operand, drops size-1 dims; throws ShapeError past kMaxDims.
template <int NT>
OffsetCalc<NT> make_offset_calc(const Shape& shape, const Shape* const (&strides)[NT]) {
  OffsetCalc<NT> c;
  std::vector<int64_t> sz;
  std::vector<std::array<int64_t, NT>> st;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    std::array<int64_t, NT> s;
    for (int t = 0; t < NT; ++t) s[t] = (*strides[t])[d];
    if (!sz.empty()) {
      bool merge = true;
      for (int t = 0; t < NT; ++t) merge &= st.back()[t] == s[t] * shape[d];
      if (merge) {
        sz.back() *= shape[d];
        st.back() = s;
        continue;
      }
    }
    sz.push_back(shape[d]);
    st.push_back(s);
  }
  BOOSTER_CHECK(int(sz.size()) <= kMaxDims, ShapeError, "CUDA elementwise: more than ", kMaxDims,
                " non-mergeable dims in shape ", shape);
  c.ndim = int(sz.size());
  c.contiguous = c.ndim <= 1;
  for (int t = 0; t < NT && c.ndim == 1; ++t) c.contiguous &= st[0][t] == 1;
  for (int d = 0; d < c.ndim; ++d) {
    c.sizes[d] = sz[size_t(d)];
    for (int t = 0; t < NT; ++t) c.strides[t][d] = st[size_t(d)][t];
  }
  if (c.ndim == 0) c.contiguous = true;
  // 32-bit arithmetic when the element count and every operand's largest offset stay below 2^31
  // (strides are non-negative here: views never have negative strides).
  int64_t total = 1;
  for (int d = 0; d < c.ndim; ++d) total *= c.sizes[d];
  c.small = total < (int64_t(1) << 31);
  for (int t = 0; t < NT; ++t) {
    int64_t extent = 0;
    for (int d = 0; d < c.ndim; ++d) {
      c.small &= c.strides[t][d] >= 0;
      extent += (c.sizes[d] - 1) * c.strides[t][d];
    }
    c.small &= extent < (int64_t(1) << 31);
  }
  return c;
}

template <int NT, class F>
__global__ void elementwise_kernel(int64_t n, OffsetCalc<NT> calc, F f) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[NT];
    calc.get(i, off);
    f(off);
  }
}

// Blocks for a grid-stride loop over n elements on `device` (at most 32 per SM of that device).
inline unsigned grid_for(int device, int64_t n, int threads = 256) {
  const int64_t blocks = (n + threads - 1) / threads;
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(sm_count(device)) * 32)));
}

// Runs f(offsets) for every element of `shape` (offsets in elements, one per operand) on the stream.
template <int NT, class F>
void launch_elementwise(int device, const Shape& shape, const Shape* const (&strides)[NT], F f) {
  const int64_t n = numel_of(shape);
  if (n == 0) return;
  const OffsetCalc<NT> calc = make_offset_calc<NT>(shape, strides);
  elementwise_kernel<NT><<<grid_for(device, n), 256, 0, stream(device)>>>(n, calc, f);
  BOOSTER_CUDA_CHECK_LAUNCH();
}

// Device of a tensor on the backend (and makes it current).
inline int device_of(const Tensor& t) {
  set_device(t.device().index);
  return t.device().index;
}

// ------------------------------------------------------------------------------ block reductions
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <class T>
__device__ __forceinline__ T warp_max(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
template <class T>
__device__ T block_sum(T v, T* shared /* 32 elements */) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int nw = blockDim.x >> 5;
  v = lane < nw ? shared[lane] : T(0);
  return warp_sum(v);
}
template <class T>
__device__ T block_max(T v, T* shared) {
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int nw = blockDim.x >> 5;
  v = lane < nw ? shared[lane] : T(-INFINITY);
  return warp_max(v);
}

}  // namespace booster::cuda
