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

}  // namespace booster::kernels
