// Matrix multiplication kernels.
#pragma once

#include "booster/kernels/dispatch.h"
#include "booster/tensor/tensor.h"

namespace booster::kernels {

// C[b] = alpha * op(A[b]) @ op(B[b]) + beta * C[b] for b in [0, batch), row-major.
// A, B, C are 3-D [batch, rows, cols] tensors whose last dim is contiguous (or, with trans, whose
// second-to-last is), same dtype. A batch stride of 0 broadcasts. op(X) = X^T when trans_X.
// float16/bfloat16 are computed in float32 and rounded once at the end.
struct GemmArgs {
  bool trans_a = false;
  bool trans_b = false;
  double alpha = 1.0;
  double beta = 0.0;
};
BOOSTER_DECLARE_KERNEL(gemm_kernel, void(const GemmArgs& args, const Tensor& a, const Tensor& b, Tensor& c));

// C[i] = A[i % G] @ B[i] for i in [0, batch): A [G, M, K], B [batch, K, N], C [batch, M, N], all
// contiguous and of one dtype. Every element of C is its dot product summed in one fixed order (k = 0,
// 1, ..., K - 1, from zero), whatever its row, column, tile or thread, so equal rows of A times equal
// columns of B give equal elements, bit for bit (Note [Position-independent rounding] in
// ops/conv.cpp). float16/bfloat16 are computed in float32 and rounded once. Optional: CPU only.
BOOSTER_DECLARE_KERNEL(fixed_order_gemm_kernel, void(const Tensor& a, const Tensor& b, Tensor& c));

// ---------------------------------------------------------------- shared by the BLAS backends
// Note [GEMM operand layouts]
// BLAS libraries take a row-major matrix as (pointer, leading dim) plus a transpose flag, so any
// operand whose logical op(X) [rows, cols] has unit stride along one of its two dims is passed as it
// lies: unit column stride -> not transposed with ld = row stride; unit row stride -> transposed with
// ld = column stride. A transposed weight or gradient therefore costs nothing. Only an operand with no
// unit stride (a strided slice) is copied. (cuBLAS, being column-major, then swaps the operands:
// Note [cuBLAS row-major operands].)

// One operand op(X[b]) of a batched row-major GEMM as a BLAS library sees it.
struct GemmOperand {
  const void* data = nullptr;
  bool trans = false;        // the stored matrix is op(X)^T
  int64_t ld = 1;            // leading dim of the stored row-major matrix
  int64_t batch_stride = 0;  // elements; 0 broadcasts one matrix over the batch
  int64_t stored_rows = 0, stored_cols = 0;  // the stored matrix: stored_rows x stored_cols, ld apart
};

// op(x) for a 3-D x (x^T per batch when `trans`) as a GemmOperand; copies x into `keep_alive` (same
// device) only when neither layout fits.
GemmOperand gemm_operand(const Tensor& x, bool trans, Tensor& keep_alive);

// The sizes of C = op(A) op(B), after checking ranks, dtypes and shapes (ShapeError, DTypeError) and
// that they fit the int arguments of `library` ("BLAS", "cuBLAS"; ValueError).
struct GemmDims {
  int64_t m = 0, n = 0, k = 0;
};
GemmDims check_gemm(const GemmArgs& args, const Tensor& a, const Tensor& b, const Tensor& c, const char* library);

// True when C can be written in place: each batch matrix row-major with unit column stride, and
// batch matrices that do not alias each other. Otherwise a backend computes into a fresh C and copies.
bool gemm_output_in_place(const Tensor& c);

}  // namespace booster::kernels
