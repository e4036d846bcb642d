// Reductions: sum, mean, max, argmax, var. Each: autocast, checks, kernel (backends/cpu/reduce.cpp),
// backward.
#include <algorithm>
#include <cmath>

#include "booster/autocast/autocast.h"
#include "booster/autograd/autograd.h"
#include "booster/kernels/elementwise.h"
#include "booster/common/error_context.h"
#include "booster/ops/ops.h"

namespace booster {

using autograd::grads;
using kernels::ReduceOp;

namespace {

// Wrapped, sorted, unique dims; empty means every dim.
std::vector<int64_t> normalize_dims(const std::vector<int64_t>& dims, int64_t ndim, const char* op) {
  std::vector<int64_t> out;
  if (dims.empty()) {
    for (int64_t d = 0; d < ndim; ++d) out.push_back(d);
    return out;
  }
  for (int64_t d : dims) {
    const int64_t w = wrap_dim(d, ndim, op);
    BOOSTER_CHECK(std::find(out.begin(), out.end(), w) == out.end(), IndexError, op, ": dim ", w,
                  " appears more than once in dims ", dims);
    out.push_back(w);
  }
  std::sort(out.begin(), out.end());
  if (ndim == 0) out.clear();  // dim 0 / -1 of a scalar is the scalar itself
  return out;
}

Shape keepdim_shape(const Shape& s, const std::vector<int64_t>& dims) {
  Shape k = s;
  for (int64_t d : dims) k[size_t(d)] = 1;
  return k;
}

Shape squeezed_shape(const Shape& s, const std::vector<int64_t>& dims) {
  Shape q;
  for (size_t d = 0; d < s.size(); ++d)
    if (std::find(dims.begin(), dims.end(), int64_t(d)) == dims.end()) q.push_back(s[d]);
  return q;
}

int64_t count_of(const Shape& s, const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= s[size_t(d)];
  return n;
}

// Runs the kernel into a keepdim-shaped output of `out_dtype`, then drops the dims unless keepdim.
Tensor reduce_raw(ReduceOp op, const Tensor& a, const std::vector<int64_t>& dims, bool keepdim, DType out_dtype) {
  Tensor out = Tensor::empty(keepdim_shape(a.shape(), dims), out_dtype, a.device());
  kernels::reduce_kernel(a.device())(op, a.detach(), dims, out);
  if (keepdim) return out;
  const Shape s = squeezed_shape(a.shape(), dims);
  return make_view(out, s, contiguous_strides(s), 0);
}

// The gradient of a reduced output brought back to the input's shape (a broadcast view, no copy).
Tensor expand_back(const Tensor& g, const Shape& in_shape, const std::vector<int64_t>& dims, bool keepdim) {
  Tensor k = g;
  if (!keepdim)
    for (int64_t d : dims) k = k.unsqueeze(d);  // dims are sorted: each lands where it was
  return k.expand(in_shape);
}

// Sums of integers and bools are int64 (as torch.sum).
DType sum_dtype(DType t) { return is_floating(t) ? t : DType::Int64; }

}  // namespace

Tensor sum(const Tensor& a_in, const std::vector<int64_t>& dims_in, bool keepdim) {
  BOOSTER_OP_CONTEXT("sum");  // Note [Error context]
  Tensor a = a_in;
  autocast::apply(autocast::Op::Sum, {&a});
  const std::vector<int64_t> dims = normalize_dims(dims_in, a.dim(), "sum");
  Tensor out = reduce_raw(ReduceOp::Sum, a, dims, keepdim, sum_dtype(a.dtype()));
  autograd::record(out, "SumBackward", {a}, [in_shape = a.shape(), dims, keepdim](const Tensor& g) {
    return grads{expand_back(g, in_shape, dims, keepdim)};
  });
  return out;
}

Tensor mean(const Tensor& a_in, const std::vector<int64_t>& dims_in, bool keepdim) {
  BOOSTER_OP_CONTEXT("mean");
  Tensor a = a_in;
  autocast::apply(autocast::Op::Mean, {&a});
  BOOSTER_CHECK(is_floating(a.dtype()), DTypeError, "mean: expected a floating input, got ", a.dtype(),
                "; convert with .to(DType::Float32) first");
  const std::vector<int64_t> dims = normalize_dims(dims_in, a.dim(), "mean");
  const int64_t n = count_of(a.shape(), dims);
  // As PyTorch on the CPU: the sum (accumulated in float32 for 16-bit inputs) rounded to the input
  // dtype, then divided by the count.
  Tensor out;
  {
    NoGradGuard ng;
    out = reduce_raw(ReduceOp::Sum, a, dims, keepdim, a.dtype());
    Tensor count = full({}, double(n), a.dtype(), a.device());
    kernels::binary_kernel(out.device())(kernels::BinaryOp::Div, out, count.expand(out.shape()), out, 1.0);
  }
  autograd::record(out, "MeanBackward", {a}, [in_shape = a.shape(), dims, keepdim, n](const Tensor& g) {
    return grads{expand_back(mul(g, 1.0 / double(n)), in_shape, dims, keepdim)};
  });
  return out;
}

Tensor max(const Tensor& a, int64_t dim_in, bool keepdim) {
  BOOSTER_OP_CONTEXT("max");
  const int64_t dim = wrap_dim(dim_in, a.dim(), "max");
  if (a.dim() == 0) return a.clone();
  BOOSTER_CHECK(a.shape()[size_t(dim)] > 0, IndexError, "max: cannot reduce dimension ", dim, " of size 0 (shape ",
                a.shape(), "): the maximum of no elements is undefined");
  const std::vector<int64_t> dims{dim};
  Tensor out = reduce_raw(ReduceOp::Max, a, dims, keepdim, a.dtype());
  if (autograd::needs_grad({&a})) {
    // The gradient goes to the first maximal element of each slice, as torch.max(dim): a one-hot mask
    // (position == argmax) broadcast against the gradient.
    Tensor idx = reduce_raw(ReduceOp::Argmax, a, dims, /*keepdim=*/true, DType::Int64);
    autograd::record(out, "MaxBackward", {a}, [in_shape = a.shape(), dim, keepdim, idx](const Tensor& g) {
      Shape pos_shape(in_shape.size(), 1);
      pos_shape[size_t(dim)] = in_shape[size_t(dim)];
      Tensor first_max = eq(arange(in_shape[size_t(dim)]).reshape(pos_shape).to(idx.device()), idx);
      Tensor gk = keepdim ? g : g.unsqueeze(dim);
      return grads{where(first_max, gk, zeros({}, g.dtype(), g.device())).expand(in_shape)};
    });
  }
  return out;
}

Tensor max(const Tensor& a) {
  BOOSTER_OP_CONTEXT("max");
  BOOSTER_CHECK(a.numel() > 0, IndexError, "max: the input of shape ", a.shape(),
                " has no elements; the maximum of no elements is undefined");
  std::vector<int64_t> dims = normalize_dims({}, a.dim(), "max");
  Tensor out = reduce_raw(ReduceOp::Max, a, dims, /*keepdim=*/false, a.dtype());
  autograd::record(out, "MaxAllBackward", {a}, [a = a.detach(), o = out.detach()](const Tensor& g) {
    // Ties share the gradient evenly, as torch.max() does; a NaN maximum is shared by the NaNs
    // (torch's evenly_distribute_backward).
    Tensor is_max = std::isnan(o.item()) ? ne(a, a) : eq(a, o);
    const double ties = sum(is_max).item();
    Tensor share = ties > 0 ? mul(g, 1.0 / ties) : zeros_like(g);
    return grads{where(is_max, share, zeros({}, g.dtype(), g.device()))};
  });
  return out;
}

Tensor argmax(const Tensor& a, int64_t dim_in, bool keepdim) {
  BOOSTER_OP_CONTEXT("argmax");
  const int64_t dim = wrap_dim(dim_in, a.dim(), "argmax");
  if (a.dim() == 0) return zeros({}, DType::Int64, a.device());
  BOOSTER_CHECK(a.shape()[size_t(dim)] > 0, IndexError, "argmax: cannot reduce dimension ", dim,
                " of size 0 (shape ", a.shape(), ")");
  return reduce_raw(ReduceOp::Argmax, a, {dim}, keepdim, DType::Int64);
}

Tensor var(const Tensor& a_in, const std::vector<int64_t>& dims_in, bool unbiased, bool keepdim) {
  BOOSTER_OP_CONTEXT("var");
  Tensor a = a_in;
  autocast::apply(autocast::Op::Var, {&a});
  BOOSTER_CHECK(is_floating(a.dtype()), DTypeError, "var: expected a floating input, got ", a.dtype());
  const std::vector<int64_t> dims = normalize_dims(dims_in, a.dim(), "var");
  const int64_t n = count_of(a.shape(), dims);
  const double denom = double(n) - (unbiased ? 1.0 : 0.0);
  // Two passes in the compute dtype (float32 for 16-bit inputs): mean, then squared deviations.
  const DType compute = is_low_precision(a.dtype()) ? DType::Float32 : a.dtype();
  Tensor out, centered;
  {
    NoGradGuard ng;
    Tensor x = a.to(compute);
    centered = sub(x, mean(x, dims, /*keepdim=*/true));
    Tensor sq = sum(mul(centered, centered), dims, keepdim);
    out = mul(sq, denom > 0 ? 1.0 / denom : NAN).to(a.dtype());
  }
  autograd::record(out, "VarBackward", {a}, [centered, dims, keepdim, denom, dt = a.dtype()](const Tensor& g) {
    // d var / d x = 2 (x - mean) / (n - correction)
    Tensor gk = expand_back(g.to(centered.dtype()), centered.shape(), dims, keepdim);
    return grads{mul(mul(centered, gk), 2.0 / denom).to(dt)};
  });
  return out;
}

}  // namespace booster
