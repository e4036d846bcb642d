// CUDA float8 (kernels/float8.h): quantize and dequantize through CUDA's fp8 conversions, and the
// scaled float8 GEMM through cuBLASLt on GPUs with float8 tensor cores (sm_89+).
//
// Note [CUDA float8 conversions]
// __nv_cvt_float_to_fp8 rounds to nearest even and saturates (__NV_SATFINITE) or overflows to NaN
// (e4m3fn) / infinity (e5m2) (__NV_NOSAT) as Note [Float8 formats] says; its results equal the CPU
// conversions for every float32 bit pattern except NaNs, for which it gives 0x7f whatever the sign. And
// GPU arithmetic on a NaN returns one canonical NaN, dropping its sign, where the CPU keeps the NaN
// operand. So NaNs are handled here by their bits, as the CPU has them: a NaN input quantizes to its
// sign with the format's NaN (0x7f/0xff for e4m3fn, 0x7e/0xfe for e5m2), a NaN made by the scaling
// (infinity times 0) to the negative one (x86's default NaN), and a float8 NaN dequantizes to the
// signed quiet NaN of the output dtype (float32 0x7fc00000, float16 0x7e00, bfloat16 0x7fc0).
//
// Note [cuBLASLt float8 layout]
// Float8 GEMMs take only the "TN" layout: both operands contiguous along k. float8_mm's a [n, k] and
// b [m, k] (row-major, k contiguous) are exactly that. cuBLASLt is column-major and computes
// D = alpha op(A) op(B); out [n, m] row-major is out^T [m, n] column-major = b [m, k] . a^T [k, n], so
// cuBLASLt's A is b (stored k x m, leading dim k, op T), its B is a (stored k x n, op N), and D is m x n
// with leading dim m. The per-tensor scales go into alpha = 1 / (scale_a scale_b), a host scalar (scale
// pointers would need the two values on the device: a copy, and a wait, per GEMM). Pointers must be 16
// bytes aligned and every size a multiple of 16; elsewhere float8_mm falls back.
#include <cuda_fp8.h>

#include <atomic>

#include "booster/backends/cuda/common.cuh"
#include "booster/kernels/float8.h"

namespace booster::cuda {
namespace {

__nv_fp8_interpretation_t interpretation(DType t, const char* op) {
  switch (t) {
    case DType::Float8E4M3FN: return __NV_E4M3;
    case DType::Float8E5M2: return __NV_E5M2;
    default: BOOSTER_FAIL(DTypeError, op, ": expected float8_e4m3fn or float8_e5m2, got ", t);
  }
}

template <class F>
void dispatch_wide(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::Float32: return f(float{});
    case DType::Float16: return f(__half{});
    case DType::BFloat16: return f(__nv_bfloat16{});
    default: BOOSTER_FAIL(DTypeError, op, ": expected float32, float16 or bfloat16, got ", t);
  }
}

// Sign and NaN-ness of an input element, from its bits (Note [CUDA float8 conversions]).
template <class T>
__device__ __forceinline__ uint32_t raw_bits(T v) {
  if constexpr (std::is_same_v<T, float>) return __float_as_uint(v);
  else if constexpr (std::is_same_v<T, __half>) return uint32_t(__half_as_ushort(v)) << 16;
  else return uint32_t(__bfloat16_as_ushort(v)) << 16;
}
template <class T>
__device__ __forceinline__ bool is_nan_bits(uint32_t bits) {
  const uint32_t a = bits & 0x7fffffffu;
  if constexpr (std::is_same_v<T, __half>) return a > 0x7c000000u;  // exponent all ones, mantissa not 0
  else return a > 0x7f800000u;                                      // float32 and bfloat16
}

// The signed quiet NaN the CPU conversions give, as T.
template <class T>
__device__ __forceinline__ T signed_nan(bool negative) {
  if constexpr (std::is_same_v<T, float>) return __uint_as_float(negative ? 0xffc00000u : 0x7fc00000u);
  else if constexpr (std::is_same_v<T, __half>) return __ushort_as_half(uint16_t(negative ? 0xfe00 : 0x7e00));
  else return __ushort_as_bfloat16(uint16_t(negative ? 0xffc0 : 0x7fc0));
}

template <class T>
__global__ void quantize_kernel(const T* src, uint8_t* dst, int64_t n, float scale, __nv_saturation_t saturate,
                                __nv_fp8_interpretation_t kind) {
  const uint8_t nan = kind == __NV_E4M3 ? 0x7f : 0x7e;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t bits = raw_bits(src[i]);
    if (is_nan_bits<T>(bits)) {
      dst[i] = uint8_t((bits >> 24) & 0x80) | nan;
      continue;
    }
    const float v = load_as<float>(src[i]) * scale;
    dst[i] = isnan(v) ? uint8_t(0x80 | nan) : __nv_cvt_float_to_fp8(v, saturate, kind);
  }
}

template <class T>
__global__ void dequantize_kernel(const uint8_t* src, T* dst, int64_t n, float scale_inv,
                                  __nv_fp8_interpretation_t kind) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint8_t b = src[i];
    const float v = __half2float(__half(__nv_cvt_fp8_to_halfraw(b, kind))) * scale_inv;
    dst[i] = isnan(v) ? signed_nan<T>(b & 0x80) : store_as<T>(v);
  }
}

void cuda_float8_quantize(const Tensor& src, Tensor& dst, float scale, bool saturate) {
  const int dev = device_of(dst);
  const int64_t n = src.numel();
  if (n == 0) return;
  const __nv_fp8_interpretation_t kind = interpretation(dst.dtype(), "to_float8");
  dispatch_wide(src.dtype(), "to_float8", [&](auto tag) {
    using T = decltype(tag);
    quantize_kernel<T><<<grid_for(dev, n), 256, 0, stream(dev)>>>(
        static_cast<const T*>(src.data_ptr()), static_cast<uint8_t*>(dst.data_ptr()), n, scale,
        saturate ? __NV_SATFINITE : __NV_NOSAT, kind);
    BOOSTER_CUDA_CHECK_LAUNCH();
  });
}

void cuda_float8_dequantize(const Tensor& src, Tensor& dst, float scale_inv) {
  const int dev = device_of(dst);
  const int64_t n = src.numel();
  if (n == 0) return;
  const __nv_fp8_interpretation_t kind = interpretation(src.dtype(), "from_float8");
  dispatch_wide(dst.dtype(), "from_float8", [&](auto tag) {
    using T = decltype(tag);
    dequantize_kernel<T><<<grid_for(dev, n), 256, 0, stream(dev)>>>(
        static_cast<const uint8_t*>(src.data_ptr()), static_cast<T*>(dst.data_ptr()), n, scale_inv, kind);
    BOOSTER_CUDA_CHECK_LAUNCH();
  });
}

// Compute capability major * 10 + minor of `device`, asked once per device.
int compute_capability(int device) {
  static int cached[64] = {};
  if (device < 0 || device >= 64) return 0;
  if (cached[device] == 0) {
    int major = 0, minor = 0;
    BOOSTER_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    BOOSTER_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    cached[device] = major * 10 + minor;
  }
  return cached[device];
}

cudaDataType_t lt_float8_type(DType t) { return t == DType::Float8E4M3FN ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

// Owns the cuBLASLt descriptors of one call.
struct LtDescriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  ~LtDescriptors() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

std::atomic<int64_t> g_float8_gemms{0};

// The largest power of two (up to 256) that `p` is aligned to.
uint32_t alignment_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t r = 256;
  while (r > 1 && a % r != 0) r >>= 1;
  return r;
}

bool cuda_float8_gemm(const Tensor& a, const Tensor& b, float scale_a, float scale_b, Tensor& out) {
  const int dev = device_of(out);
  const int64_t n = a.size(0), m = b.size(0), k = a.size(1);
  // Float8 tensor cores, and cuBLASLt's float8 alignment: every dimension (so every leading dimension)
  // a multiple of 16, every pointer 16 bytes aligned.
  if (compute_capability(dev) < 89 || n % 16 != 0 || m % 16 != 0 || k % 16 != 0 || n == 0 || m == 0 || k == 0)
    return false;
  const uint32_t align_a = alignment_of(b.data_ptr()), align_b = alignment_of(a.data_ptr()),
                 align_d = alignment_of(out.data_ptr());
  if (align_a < 16 || align_b < 16 || align_d < 16) return false;
  const cudaDataType_t out_type = cuda_type(out.dtype(), "float8_mm");

  LtDescriptors d;
  BOOSTER_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  BOOSTER_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa)));
  BOOSTER_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb)));
  // Note [cuBLASLt float8 layout]: cuBLASLt's A is b, its B is a.
  BOOSTER_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.a, lt_float8_type(b.dtype()), uint64_t(k), uint64_t(m), k));
  BOOSTER_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.b, lt_float8_type(a.dtype()), uint64_t(k), uint64_t(n), k));
  BOOSTER_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.c, out_type, uint64_t(m), uint64_t(n), m));

  size_t workspace_bytes = size_t(32) << 20;
  void* workspace = cublas_workspace(dev, workspace_bytes);
  BOOSTER_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&d.preference));
  BOOSTER_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                            &workspace_bytes, sizeof(workspace_bytes)));
  // The heuristic assumes 256-byte aligned pointers unless told what they are.
  for (const auto& [attribute, alignment] :
       {std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a}, {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d}, {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d}})
    BOOSTER_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d.preference, attribute, &alignment, sizeof(alignment)));
  cublasLtHandle_t handle = cublaslt_handle(dev);
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(handle, d.op, d.a, d.b, d.c, d.c, d.preference, 1, &heuristic, &found);
  // No float8 kernel for this combination: float8_mm dequantizes instead.
  if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && found == 0)) return false;
  BOOSTER_CUBLAS_CHECK(status);
  if (heuristic.state != CUBLAS_STATUS_SUCCESS) return false;
  const float alpha = float(1.0 / (double(scale_a) * double(scale_b))), beta = 0.0f;
  BOOSTER_CUBLAS_CHECK(cublasLtMatmul(handle, d.op, &alpha, b.data_ptr(), d.a, a.data_ptr(), d.b, &beta,
                                      out.data_ptr(), d.c, out.data_ptr(), d.c, &heuristic.algo, workspace,
                                      workspace_bytes, stream(dev)));
  ++g_float8_gemms;
  return true;
}

}  // namespace

int64_t float8_gemm_count() { return g_float8_gemms.load(); }

}  // namespace booster::cuda

namespace booster::kernels {
BOOSTER_REGISTER_CUDA_KERNEL(float8_quantize_kernel, cuda::cuda_float8_quantize);
BOOSTER_REGISTER_CUDA_KERNEL(float8_dequantize_kernel, cuda::cuda_float8_dequantize);
BOOSTER_REGISTER_CUDA_KERNEL(float8_gemm_kernel, cuda::cuda_float8_gemm);
}  // namespace booster::kernels
