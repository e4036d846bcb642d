// Fused passes over flat gradient buffers (Note [Fused gradient passes] in mixed_precision.h): checks
// here, one kernel per span (kernels/fused.h) on any device, one read of the result per pass.
#include <cmath>

#include "booster/kernels/elementwise.h"
#include "booster/kernels/fused.h"
#include "booster/mixed_precision/mixed_precision.h"
#include "booster/ops/ops.h"

namespace booster::mixed_precision {

namespace {

void check_span(const Tensor& t, const char* what) {
  BOOSTER_CHECK(t.defined() && t.is_contiguous() && t.dim() == 1, ValueError, "fused_unscale_and_check: ", what,
                " must be a defined 1-D contiguous tensor");
  BOOSTER_CHECK(t.dtype() == DType::Float32 || is_low_precision(t.dtype()), DTypeError,
                "fused_unscale_and_check: ", what, " must be float32, float16 or bfloat16, got ", t.dtype());
}

}  // namespace

bool fused_unscale_and_check(const std::vector<GradSpan>& spans, float inv_scale) {
  if (spans.empty()) return false;
  const Device dev = spans.front().src.device();
  Tensor found = zeros({}, DType::Int32, dev);
  for (const GradSpan& span : spans) {
    check_span(span.src, "source");
    check_span(span.dst, "destination");
    BOOSTER_CHECK(span.src.numel() == span.dst.numel(), ShapeError, "fused_unscale_and_check: source has ",
                  span.src.numel(), " elements but destination ", span.dst.numel());
    // Unscaling writes in place without bumping versions: a gradient that never arrived must not
    // start to count as arrived (Note [Flat buffers]).
    kernels::unscale_check_kernel(dev)(span.src, span.dst, inv_scale, found);
  }
  return found.item() != 0;
}

double grad_norm_l2(const std::vector<Tensor>& grads) {
  if (grads.empty()) return 0.0;
  Tensor acc = zeros({}, DType::Float64, grads.front().device());
  for (const Tensor& g : grads) kernels::sum_squares_kernel(g.device())(g.contiguous(), acc);
  return std::sqrt(acc.item());
}

double clip_grads(const std::vector<Tensor>& grads, double max_norm) {
  const double norm = grad_norm_l2(grads);
  const double coef = max_norm / (norm + 1e-6);
  if (std::isfinite(norm) && coef < 1.0) scale_grads(grads, float(coef));
  return norm;
}

void scale_grads(const std::vector<Tensor>& grads, float factor) {
  for (const Tensor& g : grads) {
    // In place, without bumping the version. The kernel computes in float32 (16-bit gradients too)
    // and rounds once.
    Tensor out = g;
    kernels::unary_kernel(g.device())(kernels::UnaryOp::MulScalar, g, out, double(factor), 0.0);
  }
}

int64_t count_zeros(const std::vector<Tensor>& grads) {
  if (grads.empty()) return 0;
  Tensor acc = zeros({}, DType::Int64, grads.front().device());
  for (const Tensor& g : grads) kernels::count_zeros_kernel(g.device())(g.contiguous(), acc);
  return int64_t(acc.item());
}

}  // namespace booster::mixed_precision
