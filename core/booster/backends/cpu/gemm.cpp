// CPU GEMM through OpenBLAS.
//
// Note [GEMM operand layouts]
// BLAS takes a row-major matrix as (pointer, leading dim) plus a transpose flag, so any operand whose
// logical op(X) [rows, cols] has unit stride along one of its two dims is passed as it lies: unit column
// stride -> NoTrans with ld = row stride; unit row stride -> Trans with ld = column stride. A transposed
// weight or gradient therefore costs nothing. Only an operand with no unit stride (a strided slice) is
// copied. float16/bfloat16 operands are converted once per call into thread-local float32 scratch that
// keeps its capacity between calls (no allocation in steady state), multiplied with sgemm, and the
// result is rounded to the 16-bit type once.
#include <cblas.h>

#include <algorithm>
#include <vector>

#include "booster/backends/cpu/convert.h"
#include "booster/backends/cpu/loops.h"
#include "booster/kernels/elementwise.h"
#include "booster/kernels/gemm.h"

namespace booster::cpu {
namespace {

using kernels::GemmArgs;

// One operand of a batched GEMM as BLAS sees it.
struct BlasOperand {
  const void* data = nullptr;
  CBLAS_TRANSPOSE trans = CblasNoTrans;
  int64_t ld = 1;
  int64_t batch_stride = 0;  // elements; 0 broadcasts one matrix over the batch
  int64_t phys_rows = 0, phys_cols = 0;  // the stored row-major matrix: rows x cols with leading dim ld
};

// Describes op(X) = `m` (a 3-D logical view [batch, rows, cols]) for BLAS, or returns false.
bool describe(const Tensor& m, BlasOperand& op) {
  const int64_t rows = m.shape()[1], cols = m.shape()[2];
  int64_t rs = m.strides()[1], cs = m.strides()[2];
  // The stride of a size-1 dim is free: pick the one that makes a layout fit (a lone row or column
  // with any stride is a valid BLAS matrix).
  if (rows == 1) rs = cs == 1 ? std::max<int64_t>(cols, 1) : 1;
  if (cols == 1) cs = rs == 1 ? std::max<int64_t>(rows, 1) : 1;
  op.data = m.data_ptr();
  op.batch_stride = m.shape()[0] == 1 ? 0 : m.strides()[0];
  if (cs == 1 && rs >= std::max<int64_t>(cols, 1)) {
    op.trans = CblasNoTrans;
    op.ld = rs;
    op.phys_rows = rows;
    op.phys_cols = cols;
    return true;
  }
  if (rs == 1 && cs >= std::max<int64_t>(rows, 1)) {
    op.trans = CblasTrans;
    op.ld = cs;
    op.phys_rows = cols;
    op.phys_cols = rows;
    return true;
  }
  return false;
}

// op(X) for operand x under `trans`, as a BLAS operand; copies only when no layout fits.
BlasOperand operand(const Tensor& x, bool trans, Tensor& keep_alive) {
  Tensor m = trans ? make_view(x, {x.shape()[0], x.shape()[2], x.shape()[1]},
                               {x.strides()[0], x.strides()[2], x.strides()[1]}, x.offset())
                   : x;
  BlasOperand op;
  if (describe(m, op)) return op;
  keep_alive = Tensor::empty(m.shape(), m.dtype(), m.device());
  kernels::copy_kernel(m.device())(m, keep_alive);
  describe(keep_alive, op);
  return op;
}

// Per-thread float32 scratch for 16-bit operands; grows, never shrinks.
float* scratch(int slot, int64_t n) {
  thread_local std::vector<float> buffers[3];
  std::vector<float>& b = buffers[slot];
  if (int64_t(b.size()) < n) b.resize(size_t(n));
  return b.data();
}

// Packs a 16-bit operand into float32 scratch (rows of phys_cols, ld = phys_cols), one matrix when it
// is broadcast over the batch, all of them otherwise.
template <class T>
BlasOperand widen(const BlasOperand& op, int64_t batch, int slot) {
  const int64_t nmat = op.batch_stride == 0 ? 1 : batch;
  const int64_t per = op.phys_rows * op.phys_cols;
  float* dst = scratch(slot, std::max<int64_t>(nmat * per, 1));
  const T* src = static_cast<const T*>(op.data);
  parallel_for(nmat * op.phys_rows, op.phys_cols, [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const int64_t b = r / op.phys_rows, i = r % op.phys_rows;
      load_block(src + b * op.batch_stride + i * op.ld, dst + b * per + i * op.phys_cols, op.phys_cols);
    }
  });
  BlasOperand w = op;
  w.data = dst;
  w.ld = std::max<int64_t>(op.phys_cols, 1);
  w.batch_stride = nmat == 1 ? 0 : per;
  return w;
}

void blas_gemm(const float* a, const BlasOperand& oa, const float* b, const BlasOperand& ob, float* c, int64_t ldc,
               int64_t m, int64_t n, int64_t k, double alpha, double beta) {
  cblas_sgemm(CblasRowMajor, oa.trans, ob.trans, int(m), int(n), int(k), float(alpha), a, int(oa.ld), b, int(ob.ld),
              float(beta), c, int(ldc));
}

void blas_gemm(const double* a, const BlasOperand& oa, const double* b, const BlasOperand& ob, double* c,
               int64_t ldc, int64_t m, int64_t n, int64_t k, double alpha, double beta) {
  cblas_dgemm(CblasRowMajor, oa.trans, ob.trans, int(m), int(n), int(k), alpha, a, int(oa.ld), b, int(ob.ld), beta,
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
  BlasOperand oa = operand(a, args.trans_a, a_copy), ob = operand(b, args.trans_b, b_copy);

  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    for (int64_t i = 0; i < batch; ++i) {
      blas_gemm(static_cast<const T*>(oa.data) + i * oa.batch_stride, oa,
                static_cast<const T*>(ob.data) + i * ob.batch_stride, ob, static_cast<T*>(c.data_ptr()) + i * c_bs,
                ldc, m, n, k, args.alpha, args.beta);
    }
  } else {
    const BlasOperand wa = widen<T>(oa, batch, 0), wb = widen<T>(ob, batch, 1);
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
  BOOSTER_CHECK(a.dim() == 3 && b.dim() == 3 && c.dim() == 3, ShapeError, "gemm: expected 3-D operands, got ",
                a.shape(), ", ", b.shape(), " and ", c.shape());
  BOOSTER_CHECK(a.dtype() == b.dtype() && a.dtype() == c.dtype(), DTypeError, "gemm: operands must share a dtype, got ",
                a.dtype(), ", ", b.dtype(), " and ", c.dtype());
  const int64_t k = args.trans_a ? a.shape()[1] : a.shape()[2];
  const int64_t m = args.trans_a ? a.shape()[2] : a.shape()[1];
  const int64_t kb = args.trans_b ? b.shape()[2] : b.shape()[1];
  const int64_t n = args.trans_b ? b.shape()[1] : b.shape()[2];
  BOOSTER_CHECK(k == kb && c.shape()[1] == m && c.shape()[2] == n, ShapeError, "gemm: op(A) [", m, ", ", k,
                "] times op(B) [", kb, ", ", n, "] does not give C ", c.shape());
  BOOSTER_CHECK(k <= INT32_MAX && m <= INT32_MAX && n <= INT32_MAX, ValueError, "gemm: dims ", m, ", ", n, ", ", k,
                " exceed BLAS's int range");
  BOOSTER_DISPATCH_FLOATING(c.dtype(), "gemm", [&] {
    using T = scalar_t;
    const bool c_rowmajor = c.strides()[2] == 1 || c.shape()[2] == 1;
    if (c_rowmajor && (c.shape()[1] == 1 || c.strides()[1] >= c.shape()[2])) {
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
BOOSTER_REGISTER_KERNEL(gemm_kernel, CPU, &cpu::cpu_gemm);
}  // namespace booster::kernels
