// Fused passes over flat gradient buffers (Note [Fused gradient passes] in mixed_precision.h).
#include <atomic>
#include <cmath>
#include <cstring>

#include "booster/backends/cpu/convert.h"
#include "booster/backends/cpu/loops.h"
#include "booster/kernels/elementwise.h"
#include "booster/kernels/fused.h"
#include "booster/ops/ops.h"
#include "booster/mixed_precision/mixed_precision.h"

namespace booster::mixed_precision {

namespace {

// Branch-free "is inf or NaN": all exponent bits set. ORed over a run, so the loop vectorizes.
inline uint32_t nonfinite_bit(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return uint32_t((u & 0x7f800000u) == 0x7f800000u);
}

template <class S, class D>
uint32_t unscale_run(const S* __restrict src, D* __restrict dst, int64_t n, float inv_scale) {
  uint32_t bad = 0;
  if constexpr (cpu::is_16bit_float_v<S> && std::is_same_v<D, float>) {
    // 16-bit gradients into float32 masters: one bulk conversion into dst, then the loop below on
    // float32 in place (converting element by element keeps it scalar; Note [16-bit kernels compute
    // in float32 blocks]).
    cpu::load_block(src, dst, n);
    for (int64_t i = 0; i < n; ++i) {
      bad |= nonfinite_bit(dst[i]);
      dst[i] *= inv_scale;
    }
    return bad;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float v = float(src[i]);
    bad |= nonfinite_bit(v);
    dst[i] = D(v * inv_scale);
  }
  return bad;
}

// In place: src and dst alias, so no __restrict.
template <class S>
uint32_t unscale_inplace_run(S* data, int64_t n, float inv_scale) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = float(data[i]);
    bad |= nonfinite_bit(v);
    data[i] = S(v * inv_scale);
  }
  return bad;
}

template <class S>
uint32_t check_run(const S* src, int64_t n) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= nonfinite_bit(float(src[i]));
  return bad;
}

void check_span(const Tensor& t, const char* what) {
  BOOSTER_CHECK(t.defined() && t.is_contiguous() && t.dim() == 1, ValueError, "fused_unscale_and_check: ", what,
                " must be a defined 1-D contiguous tensor");
  BOOSTER_CHECK(t.dtype() == DType::Float32 || is_low_precision(t.dtype()), DTypeError,
                "fused_unscale_and_check: ", what, " must be float32, float16 or bfloat16, got ", t.dtype());
}

template <class S>
bool unscale_span(const S* src, const GradSpan& span, float inv_scale) {
  std::atomic<uint32_t> found{0};
  const int64_t n = span.src.numel();
  const bool in_place = span.dst.data_ptr() == span.src.data_ptr();
  const bool identity = inv_scale == 1.0f;
  cpu::parallel_for(n, 1, [&](int64_t b, int64_t e) {
    uint32_t bad;
    if (in_place) {
      bad = identity ? check_run(src + b, e - b) : unscale_inplace_run(const_cast<S*>(src) + b, e - b, inv_scale);
    } else if (span.dst.dtype() == DType::Float32) {
      bad = unscale_run(src + b, span.dst.data<float>() + b, e - b, inv_scale);
    } else {
      BOOSTER_FAIL(DTypeError, "fused_unscale_and_check: destination must be float32 or the source itself, got ",
                   span.dst.dtype());
    }
    if (bad) found.store(1, std::memory_order_relaxed);
  });
  return found.load() != 0;
}

// Sum of squares of a run in float32 lanes, returned in double (chunks are short enough that float32
// lanes lose nothing that matters for a clipping threshold).
template <class S>
double sum_squares_run(const S* x, int64_t n) {
  constexpr int kLanes = 16;
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float v = float(x[i + l]);
      acc[l] += v * v;
    }
  double total = 0;
  for (; i < n; ++i) total += double(float(x[i])) * double(float(x[i]));
  for (int l = 0; l < kLanes; ++l) total += acc[l];
  return total;
}

template <class F>
void dispatch_grad(const Tensor& t, F&& f) {
  switch (t.dtype()) {
    case DType::Float32: return f(t.data<float>());
    case DType::Float16: return f(t.data<Half>());
    case DType::BFloat16: return f(t.data<BFloat16>());
    default: BOOSTER_FAIL(DTypeError, "gradient pass: expected float32, float16 or bfloat16, got ", t.dtype());
  }
}

constexpr int64_t kNormChunk = 1 << 14;

// Note [Gradient passes on a device]
// Tensors on a GPU go through the fused kernels of kernels/fused.h: every span is one launch that ORs
// into (or adds to) one device scalar, and the host reads that scalar once, so a step costs one sync.
bool on_device(const Tensor& t) { return t.defined() && !t.device().is_cpu(); }

bool device_unscale_and_check(const std::vector<GradSpan>& spans, float inv_scale) {
  const Device dev = spans.front().src.device();
  Tensor found = zeros({}, DType::Int32, dev);
  for (const GradSpan& span : spans) {
    check_span(span.src, "source");
    check_span(span.dst, "destination");
    BOOSTER_CHECK(span.src.numel() == span.dst.numel(), ShapeError, "fused_unscale_and_check: source has ",
                  span.src.numel(), " elements but destination ", span.dst.numel());
    kernels::unscale_check_kernel(dev)(span.src, span.dst, inv_scale, found);
  }
  return found.item() != 0;
}

double device_sum_squares(const std::vector<Tensor>& grads) {
  Tensor acc = zeros({}, DType::Float64, grads.front().device());
  for (const Tensor& g : grads) kernels::sum_squares_kernel(g.device())(g.contiguous(), acc);
  return acc.item();
}

}  // namespace

bool fused_unscale_and_check(const std::vector<GradSpan>& spans, float inv_scale) {
  if (!spans.empty() && on_device(spans.front().src)) return device_unscale_and_check(spans, inv_scale);
  bool found = false;
  for (const GradSpan& span : spans) {
    check_span(span.src, "source");
    check_span(span.dst, "destination");
    BOOSTER_CHECK(span.src.numel() == span.dst.numel(), ShapeError, "fused_unscale_and_check: source has ",
                  span.src.numel(), " elements but destination ", span.dst.numel());
    // Unscaling writes in place without bumping versions: a gradient that never arrived must not
    // start to count as arrived (Note [Flat buffers]).
    dispatch_grad(span.src, [&](auto* src) { found |= unscale_span(src, span, inv_scale); });
  }
  return found;
}

double grad_norm_l2(const std::vector<Tensor>& grads) {
  if (!grads.empty() && on_device(grads.front())) return std::sqrt(device_sum_squares(grads));
  double total = 0;
  for (const Tensor& g : grads) {
    if (g.numel() == 0) continue;
    dispatch_grad(g, [&](auto* x) {
      const int64_t n = g.numel();
      const int64_t chunks = (n + kNormChunk - 1) / kNormChunk;
      std::vector<double> partial(size_t(chunks), 0.0);
      cpu::parallel_for(chunks, kNormChunk, [&](int64_t b, int64_t e) {
        for (int64_t c = b; c < e; ++c) {
          const int64_t lo = c * kNormChunk, hi = std::min(n, lo + kNormChunk);
          partial[size_t(c)] = sum_squares_run(x + lo, hi - lo);
        }
      });
      for (double p : partial) total += p;  // fixed order: the same norm on any thread count
    });
  }
  return std::sqrt(total);
}

double clip_grads(const std::vector<Tensor>& grads, double max_norm) {
  const double norm = grad_norm_l2(grads);
  const double coef = max_norm / (norm + 1e-6);
  if (std::isfinite(norm) && coef < 1.0) scale_grads(grads, float(coef));
  return norm;
}

void scale_grads(const std::vector<Tensor>& grads, float factor) {
  for (const Tensor& g : grads) {
    if (on_device(g)) {  // in place, without bumping the version (as the CPU loop)
      Tensor out = g;
      kernels::unary_kernel(g.device())(kernels::UnaryOp::MulScalar, g, out, double(factor), 0.0);
      continue;
    }
    dispatch_grad(g, [&](auto* x) {
      using S = std::remove_pointer_t<decltype(x)>;
      cpu::parallel_for(g.numel(), 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) x[i] = S(float(x[i]) * factor);
      });
    });
  }
}

int64_t count_zeros(const std::vector<Tensor>& grads) {
  int64_t zeros = 0;
  if (!grads.empty() && on_device(grads.front())) {
    Tensor acc = booster::zeros({}, DType::Int64, grads.front().device());
    for (const Tensor& g : grads) kernels::count_zeros_kernel(g.device())(g.contiguous(), acc);
    return int64_t(acc.item());
  }
  for (const Tensor& g : grads) {
    dispatch_grad(g, [&](auto* x) {
      std::atomic<int64_t> count{0};
      cpu::parallel_for(g.numel(), 1, [&](int64_t b, int64_t e) {
        int64_t local = 0;
        for (int64_t i = b; i < e; ++i) local += float(x[i]) == 0.0f;
        count.fetch_add(local, std::memory_order_relaxed);
      });
      zeros += count.load();
    });
  }
  return zeros;
}

}  // namespace booster::mixed_precision
