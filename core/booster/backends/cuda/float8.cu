// CUDA float8 (kernels/float8.h): quantize and dequantize through CUDA's fp8 conversions, and the
// scaled float8 GEMM through cuBLASLt on GPUs with float8 tensor cores (sm_89+).
//
// Note [CUDA float8 conversions]
// __nv_cvt_float_to_fp8 rounds to nearest even and saturates (__NV_SATFINITE) or overflows to NaN
// (e4m3fn) / infinity (e5m2) (__NV_NOSAT) as Note [Float8 formats] says; its results equal the CPU
// conversions for every float32 bit pattern except NaNs, for which it gives 0x7f whatever the sign. So
// a NaN is encoded here as the CPU does (its sign kept: 0x7f/0xff for e4m3fn, 0x7e/0xfe for e5m2), and
// decoded NaNs likewise become float32 quiet NaNs of the same sign, so both backends agree bit for bit.
//
// Note [cuBLASLt float8 layout]
// Float8 GEMMs take only the "TN" layout: both operands contiguous along k. float8_mm's a [n, k] and
// b [m, k] (row-major, k contiguous) are exactly that. cuBLASLt is column-major and computes
// D = op(A) op(B); out [n, m] row-major is out^T [m, n] column-major = b [m, k] . a^T [k, n], so
// cuBLASLt's A is b (stored k x m, leading dim k, op T), its B is a (stored k x n, op N), and D is m x n
// with leading dim m. Each scale pointer holds 1 / that operand's scale (cuBLASLt multiplies an operand
// by its scale), on the device.
#include <cuda_fp8.h>

#include "booster/backends/cuda/common.cuh"
#include "booster/kernels/float8.h"
#include "booster/ops/ops.h"

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

template <class T>
__global__ void quantize_kernel(const T* src, uint8_t* dst, int64_t n, float scale, __nv_saturation_t saturate,
                                __nv_fp8_interpretation_t kind) {
  const uint8_t nan = kind == __NV_E4M3 ? 0x7f : 0x7e;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = load_as<float>(src[i]) * scale;
    // Note [CUDA float8 conversions]: NaN keeps its sign, as on the CPU.
    dst[i] = isnan(v) ? uint8_t((__float_as_uint(v) >> 24) & 0x80) | nan : __nv_cvt_float_to_fp8(v, saturate, kind);
  }
}

template <class T>
__global__ void dequantize_kernel(const uint8_t* src, T* dst, int64_t n, float scale_inv,
                                  __nv_fp8_interpretation_t kind) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint8_t b = src[i];
    float v = __half2float(__half(__nv_cvt_fp8_to_halfraw(b, kind)));
    if (isnan(v)) v = __uint_as_float(b & 0x80 ? 0xffc00000u : 0x7fc00000u);
    dst[i] = store_as<T>(v * scale_inv);
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

bool cuda_float8_gemm(const Tensor& a, const Tensor& b, float scale_a, float scale_b, Tensor& out) {
  const int dev = device_of(out);
  const int64_t n = a.size(0), m = b.size(0), k = a.size(1);
  // Float8 tensor cores, and cuBLASLt's float8 alignment: every dimension (so every leading dimension)
  // a multiple of 16.
  if (compute_capability(dev) < 89 || n % 16 != 0 || m % 16 != 0 || k % 16 != 0 || n == 0 || m == 0 || k == 0)
    return false;
  const cudaDataType_t out_type = cuda_type(out.dtype(), "float8_mm");
  // Note [cuBLASLt float8 layout]: cuBLASLt's A is b, its B is a; the scales are 1 / each operand's.
  const std::vector<float> host_scales = {1.0f / scale_b, 1.0f / scale_a};
  const Tensor scales = from_vector(host_scales, {2}).to(out.device());
  const float* scale_ptr = static_cast<const float*>(scales.data_ptr());
  const float* lt_a_scale = scale_ptr;
  const float* lt_b_scale = scale_ptr + 1;

  LtDescriptors d;
  BOOSTER_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  BOOSTER_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa)));
  BOOSTER_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb)));
  BOOSTER_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &lt_a_scale, sizeof(lt_a_scale)));
  BOOSTER_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &lt_b_scale, sizeof(lt_b_scale)));
  BOOSTER_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.a, lt_float8_type(b.dtype()), uint64_t(k), uint64_t(m), k));
  BOOSTER_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.b, lt_float8_type(a.dtype()), uint64_t(k), uint64_t(n), k));
  BOOSTER_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.c, out_type, uint64_t(m), uint64_t(n), m));

  size_t workspace_bytes = size_t(32) << 20;
  void* workspace = cublas_workspace(dev, workspace_bytes);
  BOOSTER_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&d.preference));
  BOOSTER_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                            &workspace_bytes, sizeof(workspace_bytes)));
  cublasLtHandle_t handle = cublaslt_handle(dev);
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  BOOSTER_CUBLAS_CHECK(
      cublasLtMatmulAlgoGetHeuristic(handle, d.op, d.a, d.b, d.c, d.c, d.preference, 1, &heuristic, &found));
  if (found == 0) return false;  // no float8 kernel for this combination: float8_mm dequantizes instead
  const float alpha = 1.0f, beta = 0.0f;
  BOOSTER_CUBLAS_CHECK(cublasLtMatmul(handle, d.op, &alpha, b.data_ptr(), d.a, a.data_ptr(), d.b, &beta,
                                      out.data_ptr(), d.c, out.data_ptr(), d.c, &heuristic.algo, workspace,
                                      workspace_bytes, stream(dev)));
  // `scales` is freed to the stream-ordered caching allocator: a later kernel reusing its block runs
  // after this GEMM on the same stream.
  return true;
}

}  // namespace
}  // namespace booster::cuda

namespace booster::kernels {
BOOSTER_REGISTER_CUDA_KERNEL(float8_quantize_kernel, cuda::cuda_float8_quantize);
BOOSTER_REGISTER_CUDA_KERNEL(float8_dequantize_kernel, cuda::cuda_float8_dequantize);
BOOSTER_REGISTER_CUDA_KERNEL(float8_gemm_kernel, cuda::cuda_float8_gemm);
}  // namespace booster::kernels
