// CPU GEMM through OpenBLAS.
//
// Operands are passed as they lie (Note [GEMM operand layouts] in booster/kernels/gemm.h).
// float16/bfloat16 operands are converted once per call into thread-local float32 scratch that
// keeps its capacity between calls (no allocation in steady state), multiplied with sgemm, and the
// result is rounded to the 16-bit type once; bfloat16 goes to oneDNN instead where the CPU computes
// it natively (booster/backends/onednn/onednn.h).
#include <cblas.h>

#include <algorithm>
#include <vector>

#include "booster/backends/cpu/convert.h"
#include "booster/backends/onednn/onednn.h"
#include "booster/backends/cpu/loops.h"
#include "booster/kernels/elementwise.h"
#include "booster/kernels/gemm.h"

namespace booster::cpu {
namespace {

using kernels::GemmArgs;

using kernels::GemmOperand;

CBLAS_TRANSPOSE blas_trans(const GemmOperand& op) { return op.trans ? CblasTrans : CblasNoTrans; }

// Per-thread float32 scratch for 16-bit operands; grows, never shrinks.
float* scratch(int slot, int64_t n) {
  thread_local std::vector<float> buffers[3];
  std::vector<float>& b = buffers[slot];
  if (int64_t(b.size()) < n) b.resize(size_t(n));
  return b.data();
}

// Packs a 16-bit operand into float32 scratch (rows of stored_cols, ld = stored_cols), one matrix when it
// is broadcast over the batch, all of them otherwise.
template <class T>
GemmOperand widen(const GemmOperand& op, int64_t batch, int slot) {
  const int64_t nmat = op.batch_stride == 0 ? 1 : batch;
  const int64_t per = op.stored_rows * op.stored_cols;
  float* dst = scratch(slot, std::max<int64_t>(nmat * per, 1));
  const T* src = static_cast<const T*>(op.data);
  parallel_for(nmat * op.stored_rows, op.stored_cols, [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const int64_t b = r / op.stored_rows, i = r % op.stored_rows;
      load_block(src + b * op.batch_stride + i * op.ld, dst + b * per + i * op.stored_cols, op.stored_cols);
    }
  });
  GemmOperand w = op;
  w.data = dst;
  w.ld = std::max<int64_t>(op.stored_cols, 1);
  w.batch_stride = nmat == 1 ? 0 : per;
  return w;
}

void blas_gemm(const float* a, const GemmOperand& oa, const float* b, const GemmOperand& ob, float* c, int64_t ldc,
               int64_t m, int64_t n, int64_t k, double alpha, double beta) {
  cblas_sgemm(CblasRowMajor, blas_trans(oa), blas_trans(ob), int(m), int(n), int(k), float(alpha), a, int(oa.ld), b, int(ob.ld),
              float(beta), c, int(ldc));
}

void blas_gemm(const double* a, const GemmOperand& oa, const double* b, const GemmOperand& ob, double* c,
               int64_t ldc, int64_t m, int64_t n, int64_t k, double alpha, double beta) {
  cblas_dgemm(CblasRowMajor, blas_trans(oa), blas_trans(ob), int(m), int(n), int(k), alpha, a, int(oa.ld), b, int(ob.ld), beta,
              c, int(ldc));
}

// C (row-major, unit column stride) = alpha op(A) op(B) + beta C over the batch.
template <class T>
void gemm_rowmajor_c(const GemmArgs& args, const Tensor& a, const Tensor& b, Tensor& c) {
  const int64_t batch = c.shape()[0], m = c.shape()[1], n = c.shape()[2];
  const int64_t k = args.trans_a ? a.shape()[1] : a.shape()[2];
  const int64_t ldc = m == 1 ? std::max<int64_t>(n, 1) : c.strides()[1];
  const int64_t c_bs = c.strides()[0];
  if (m == 0 || n == 0) return;
  Tensor a_copy, b_copy;
  GemmOperand oa = kernels::gemm_operand(a, args.trans_a, a_copy), ob = kernels::gemm_operand(b, args.trans_b, b_copy);

  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    for (int64_t i = 0; i < batch; ++i) {
      blas_gemm(static_cast<const T*>(oa.data) + i * oa.batch_stride, oa,
                static_cast<const T*>(ob.data) + i * ob.batch_stride, ob, static_cast<T*>(c.data_ptr()) + i * c_bs,
                ldc, m, n, k, args.alpha, args.beta);
    }
  } else {
    if constexpr (std::is_same_v<T, BFloat16>) {  // Note [bfloat16 GEMMs through oneDNN]
      if (onednn::gemm_bf16(oa, ob, c.data_ptr(), ldc, c_bs, batch, m, n, k, args.alpha, args.beta)) return;
    }
    const GemmOperand wa = widen<T>(oa, batch, 0), wb = widen<T>(ob, batch, 1);
    float* cf = scratch(2, m * n);
    T* pc = static_cast<T*>(c.data_ptr());
    for (int64_t i = 0; i < batch; ++i) {
      T* ci = pc + i * c_bs;
      if (args.beta != 0)
        parallel_for(m, n, [&](int64_t rb, int64_t re) {
          for (int64_t r = rb; r < re; ++r) load_block(ci + r * ldc, cf + r * n, n);
        });
      blas_gemm(static_cast<const float*>(wa.data) + i * wa.batch_stride, wa,
                static_cast<const float*>(wb.data) + i * wb.batch_stride, wb, cf, n, m, n, k, args.alpha, args.beta);
      // Rounding the result is a pass over C like the widening: both threads take part.
      parallel_for(m, n, [&](int64_t rb, int64_t re) {
        for (int64_t r = rb; r < re; ++r) store_block(cf + r * n, ci + r * ldc, n);
      });
    }
  }
}

void cpu_gemm(const GemmArgs& args, const Tensor& a, const Tensor& b, Tensor& c) {
  kernels::check_gemm(args, a, b, c, "BLAS");
  BOOSTER_DISPATCH_FLOATING(c.dtype(), "gemm", [&] {
    using T = scalar_t;
    if (kernels::gemm_output_in_place(c)) {
      gemm_rowmajor_c<T>(args, a, b, c);
      return;
    }
    // C of another layout: compute into a row-major buffer, then copy back.
    Tensor tmp = Tensor::empty(c.shape(), c.dtype(), c.device());
    if (args.beta != 0) kernels::copy_kernel(c.device())(c, tmp);
    gemm_rowmajor_c<T>(args, a, b, tmp);
    kernels::copy_kernel(c.device())(tmp, c);
  });
}

}  // namespace
}  // namespace booster::cpu

namespace booster::kernels {
BOOSTER_REGISTER_CPU_KERNEL(gemm_kernel, &cpu::cpu_gemm);
}  // namespace booster::kernels
