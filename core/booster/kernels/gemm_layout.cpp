// The device-neutral half of the GEMM kernels: how a strided tensor becomes a BLAS operand
// (Note [GEMM operand layouts] in gemm.h) and the argument checks both backends share.
#include <algorithm>
#include <cstdint>

#include "booster/kernels/elementwise.h"
#include "booster/kernels/gemm.h"

namespace booster::kernels {
namespace {

// Describes `m` (a 3-D logical view [batch, rows, cols]) as a GemmOperand, or returns false.
bool describe(const Tensor& m, GemmOperand& op) {
  const int64_t rows = m.shape()[1], cols = m.shape()[2];
  int64_t rs = m.strides()[1], cs = m.strides()[2];
  // The stride of a size-1 dim is free: pick the one that makes a layout fit (a lone row or column
  // with any stride is a valid BLAS matrix).
  if (rows == 1) rs = cs == 1 ? std::max<int64_t>(cols, 1) : 1;
  if (cols == 1) cs = rs == 1 ? std::max<int64_t>(rows, 1) : 1;
  op.data = m.data_ptr();
  op.batch_stride = m.shape()[0] == 1 ? 0 : m.strides()[0];
  if (cs == 1 && rs >= std::max<int64_t>(cols, 1)) {
    op.trans = false;
    op.ld = rs;
    op.stored_rows = rows;
    op.stored_cols = cols;
    return true;
  }
  if (rs == 1 && cs >= std::max<int64_t>(rows, 1)) {
    op.trans = true;
    op.ld = cs;
    op.stored_rows = cols;
    op.stored_cols = rows;
    return true;
  }
  return false;
}

}  // namespace

GemmOperand gemm_operand(const Tensor& x, bool trans, Tensor& keep_alive) {
  Tensor m = trans ? make_view(x, {x.shape()[0], x.shape()[2], x.shape()[1]},
                               {x.strides()[0], x.strides()[2], x.strides()[1]}, x.offset())
                   : x;
  GemmOperand op;
  if (describe(m, op)) return op;
  keep_alive = Tensor::empty(m.shape(), m.dtype(), m.device());
  copy_kernel(m.device())(m, keep_alive);
  describe(keep_alive, op);
  return op;
}

GemmDims check_gemm(const GemmArgs& args, const Tensor& a, const Tensor& b, const Tensor& c, const char* library) {
  BOOSTER_CHECK(a.dim() == 3 && b.dim() == 3 && c.dim() == 3, ShapeError, "gemm: expected 3-D operands, got ",
                a.shape(), ", ", b.shape(), " and ", c.shape());
  BOOSTER_CHECK(a.dtype() == b.dtype() && a.dtype() == c.dtype(), DTypeError, "gemm: operands must share a dtype, got ",
                a.dtype(), ", ", b.dtype(), " and ", c.dtype());
  GemmDims d;
  d.k = args.trans_a ? a.shape()[1] : a.shape()[2];
  d.m = args.trans_a ? a.shape()[2] : a.shape()[1];
  const int64_t kb = args.trans_b ? b.shape()[2] : b.shape()[1];
  d.n = args.trans_b ? b.shape()[1] : b.shape()[2];
  BOOSTER_CHECK(d.k == kb && c.shape()[1] == d.m && c.shape()[2] == d.n, ShapeError, "gemm: op(A) [", d.m, ", ", d.k,
                "] times op(B) [", kb, ", ", d.n, "] does not give C ", c.shape());
  BOOSTER_CHECK(d.k <= INT32_MAX && d.m <= INT32_MAX && d.n <= INT32_MAX, ValueError, "gemm: dims ", d.m, ", ", d.n,
                ", ", d.k, " exceed ", library, "'s int range");
  return d;
}

bool gemm_output_in_place(const Tensor& c) {
  const bool unit_cols = c.strides()[2] == 1 || c.shape()[2] == 1;
  const bool rows_apart = c.shape()[1] == 1 || c.strides()[1] >= c.shape()[2];
  const bool batches_apart = c.shape()[0] == 1 || c.strides()[0] != 0;
  return unit_cols && rows_apart && batches_apart;
}

}  // namespace booster::kernels
