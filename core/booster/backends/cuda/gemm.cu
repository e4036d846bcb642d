// CUDA GEMM through cuBLAS (cublasGemmStridedBatchedEx): float16/bfloat16 operands on tensor cores with
// float32 accumulation, float32 in full precision or TF32 (cuda::set_allow_tf32), float64 in float64.
//
// Note [cuBLAS row-major operands]
// cuBLAS is column-major. A row-major matrix X [r, c] with row stride ld is, read column-major, X^T
// with leading dim ld, so the row-major C = op(A) op(B) is computed as the column-major
// C^T = op(B)^T op(A)^T: B is passed first, m and n swap, and each operand keeps the layout it has
// (Note [GEMM operand layouts] in booster/kernels/gemm.h: unit column stride -> N, unit row stride
// -> T). Only an operand with no unit stride is copied.
#include "booster/backends/cuda/common.cuh"
#include "booster/kernels/elementwise.h"
#include "booster/kernels/gemm.h"

namespace booster::cuda {
namespace {

using kernels::GemmArgs;

void gemm_rowmajor_c(const GemmArgs& args, const Tensor& a, const Tensor& b, Tensor& c, int dev) {
  const int64_t batch = c.shape()[0], m = c.shape()[1], n = c.shape()[2];
  const int64_t k = args.trans_a ? a.shape()[1] : a.shape()[2];
  if (m == 0 || n == 0 || batch == 0) return;
  const int64_t ldc = m == 1 ? std::max<int64_t>(n, 1) : c.strides()[1];
  Tensor a_copy, b_copy;
  const kernels::GemmOperand oa = kernels::gemm_operand(a, args.trans_a, a_copy),
                             ob = kernels::gemm_operand(b, args.trans_b, b_copy);
  const DType dt = c.dtype();
  const cudaDataType_t type = cuda_type(dt, "gemm");
  cublasHandle_t h = cublas_handle(dev);
  if (k == 0) {  // C = beta C: cuBLAS needs k >= 1; an empty inner product is zero
    if (args.beta == 0) {
      Tensor cz = c;
      kernels::fill_kernel(c.device())(cz, 0.0);
    } else {
      Tensor cz = c;
      kernels::unary_kernel(c.device())(kernels::UnaryOp::MulScalar, c, cz, args.beta, 0.0);
    }
    return;
  }
  const double alpha_d = args.alpha, beta_d = args.beta;
  const float alpha_f = float(args.alpha), beta_f = float(args.beta);
  const void* alpha = dt == DType::Float64 ? static_cast<const void*>(&alpha_d) : &alpha_f;
  const void* beta = dt == DType::Float64 ? static_cast<const void*>(&beta_d) : &beta_f;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  if (dt == DType::Float64) compute = CUBLAS_COMPUTE_64F;
  else if (dt == DType::Float32 && allow_tf32()) compute = CUBLAS_COMPUTE_32F_FAST_TF32;
  // Under BOOSTER_CUDA_PROFILE each GEMM shape also gets a row of its own (cuBLAS time only).
  const bool detail = profiling();
  double t0 = 0;
  if (detail) {
    synchronize(dev);
    t0 = profile_clock();
  }
  BOOSTER_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      h, ob.trans ? CUBLAS_OP_T : CUBLAS_OP_N, oa.trans ? CUBLAS_OP_T : CUBLAS_OP_N, int(n), int(m), int(k), alpha,
      ob.data, type, int(ob.ld), ob.batch_stride, oa.data, type, int(oa.ld), oa.batch_stride, beta, c.data_ptr(), type,
      int(ldc), c.strides()[0], int(batch), compute, CUBLAS_GEMM_DEFAULT));
  if (detail) {
    synchronize(dev);
    const std::string key = str("  cublas ", dtype_name(dt), " b", batch, " m", m, " n", n, " k", k, oa.trans ? " At" : "",
                                ob.trans ? " Bt" : "", a_copy.defined() ? " A-copied" : "",
                                b_copy.defined() ? " B-copied" : "", args.beta != 0 ? " beta" : "");
    profile_add(key.c_str(), profile_clock() - t0);
  }
}

void cuda_gemm(const GemmArgs& args, const Tensor& a, const Tensor& b, Tensor& c) {
  kernels::check_gemm(args, a, b, c, "cuBLAS");
  const int dev = device_of(c);
  if (kernels::gemm_output_in_place(c)) {
    gemm_rowmajor_c(args, a, b, c, dev);
    return;
  }
  Tensor tmp = Tensor::empty(c.shape(), c.dtype(), c.device());
  if (args.beta != 0) kernels::copy_kernel(c.device())(c, tmp);
  gemm_rowmajor_c(args, a, b, tmp, dev);
  kernels::copy_kernel(c.device())(tmp, c);
}

}  // namespace
}  // namespace booster::cuda

namespace booster::kernels {
BOOSTER_REGISTER_CUDA_KERNEL(gemm_kernel, cuda::cuda_gemm);
}  // namespace booster::kernels
