// Elementwise, copy and reduction kernel families.
//
// Contract shared by every kernel here: `out` is allocated by the caller with its final shape and
// dtype; inputs have already been expanded (stride 0 in broadcast dims) to out's shape and share one
// compute dtype, except where noted. Kernels compute in float32 for float16/bfloat16 (float64 for
// float64) and round to out's dtype (Note [Low-precision storage on the CPU]).
#pragma once

#include <vector>

#include "booster/kernels/dispatch.h"
#include "booster/tensor/tensor.h"

namespace booster::kernels {

enum class BinaryOp : uint8_t {
  Add,  // a + alpha * b
  Sub,  // a - alpha * b
  Mul, Div, Pow, Maximum, Minimum,
  // Comparisons: out is bool.
  Eq, Ne, Lt, Le, Gt, Ge,
};

enum class UnaryOp : uint8_t {
  Neg, Exp, Log, Sqrt, Rsqrt, Abs, Relu, GeluErf, GeluTanh, Tanh, Sigmoid, Sign,
  AddScalar,   // x + p0
  MulScalar,   // x * p0
  RSubScalar,  // p0 - x
  RDivScalar,  // p0 / x
  PowScalar,   // x ^ p0
  Clamp,       // clamp(x, p0, p1); NaN bounds mean "none"
  IsFinite,    // out is bool
  Silu,        // x * sigmoid(x)
};

// Gradients of unary functions: out = grad * f'(saved). `saved` is the input x or the output y,
// whichever the formula needs (noted per op).
enum class UnaryBackwardOp : uint8_t {
  Relu,      // saved = y
  GeluErf,   // saved = x
  GeluTanh,  // saved = x
  Tanh,      // saved = y: g * (1 - y^2)
  Sigmoid,   // saved = y: g * y * (1 - y)
  ClampMask, // saved = x: g where p0 <= x <= p1 else 0
  Silu,      // saved = x: g * s (1 + x (1 - s)), s = sigmoid(x)
};

// Strided copy with dtype conversion; src and dst have the same shape (src may be expanded) and device.
BOOSTER_DECLARE_KERNEL(copy_kernel, void(const Tensor& src, Tensor& dst));
BOOSTER_DECLARE_KERNEL(fill_kernel, void(Tensor& dst, double value));
BOOSTER_DECLARE_KERNEL(binary_kernel,
                       void(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& out, double alpha));
BOOSTER_DECLARE_KERNEL(unary_kernel, void(UnaryOp op, const Tensor& a, Tensor& out, double p0, double p1));
BOOSTER_DECLARE_KERNEL(unary_backward_kernel,
                       void(UnaryBackwardOp op, const Tensor& grad, const Tensor& saved, Tensor& out,
                            double p0, double p1));
// out = cond ? a : b; cond is bool, a/b/out share a dtype.
BOOSTER_DECLARE_KERNEL(where_kernel, void(const Tensor& cond, const Tensor& a, const Tensor& b, Tensor& out));

enum class ReduceOp : uint8_t { Sum, Max, Argmax };
// Reduces `a` over `dims` (sorted, unique) into `out`, whose shape is a's with those dims kept as 1.
// Sum and Max: out has a's dtype (accumulated in float32/float64); Argmax: out is int64 (first max).
BOOSTER_DECLARE_KERNEL(reduce_kernel,
                       void(ReduceOp op, const Tensor& a, const std::vector<int64_t>& dims, Tensor& out));

}  // namespace booster::kernels
