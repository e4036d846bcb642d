// CPU losses: cross-entropy (with ignore_index and label smoothing), NLL and MSE, forward and
// backward (kernels/nn.h).
//
// Rows (or channels) are processed while in cache with float32 (float64) accumulators and split across
// threads; reductions across rows add per-chunk partials in chunk order (Note [Repeatable sums] in
// nn_common.h).
#include "booster/backends/cpu/nn_common.h"

namespace booster::cpu {
namespace {

using kernels::LossReduction;

// Counts the targets that are not ignore_index and throws IndexError for one outside [0, C).
// Runs before any parallel region: an exception must not cross an OpenMP region.
int64_t count_valid_targets(const char* op, const Tensor& target, int64_t C, int64_t ignore_index) {
  const int64_t* pt = target.data<int64_t>();
  int64_t valid = 0;
  for (int64_t i = 0; i < target.numel(); ++i) {
    const int64_t t = pt[i];
    if (t == ignore_index) continue;
    BOOSTER_CHECK(t >= 0 && t < C, IndexError, op, ": target ", t, " at position ", i,
                  " is out of bounds for ", C, " classes (expected 0 <= target < ", C, ", or ignore_index ",
                  ignore_index, ")");
    ++valid;
  }
  return valid;
}

// The scale d(loss)/d(element e) for the incoming gradient g.
template <class T, class A>
struct LossGradScale {
  const T* g;
  LossReduction reduction;
  A divisor;  // count (cross_entropy, nll) or numel (mse) for Mean
  A at(int64_t e) const {
    switch (reduction) {
      case LossReduction::None: return A(g[e]);
      case LossReduction::Sum: return A(g[0]);
      case LossReduction::Mean: return A(g[0]) / divisor;
    }
    return 0;
  }
};

// Note [Cross-entropy geometry]
// logits are [N, C, D]: the C class scores of element (n, d) are D apart. With D == 1 they are a
// contiguous row; the stride is then a compile-time 1 so the row loops vectorize.
template <int64_t kStride, class T, class A>
A ce_forward_row(const T* x, int64_t C, int64_t D, int64_t t, A on, A smooth_per_class, A& lse_out) {
  const int64_t st = kStride > 0 ? kStride : D;
  A mx = -std::numeric_limits<A>::infinity();
  #pragma omp simd reduction(max : mx)
  for (int64_t c = 0; c < C; ++c) mx = std::max(mx, A(x[c * st]));
  A s = 0, sum_x = 0;
  #pragma omp simd reduction(+ : s, sum_x)
  for (int64_t c = 0; c < C; ++c) {
    s += exp_acc(A(x[c * st]) - mx);
    sum_x += A(x[c * st]);
  }
  const A lse = mx + std::log(s);
  lse_out = lse;
  // -log p[t] = lse - x[t];  -sum_c log p[c] = C lse - sum_c x[c].
  A loss = on * (lse - A(x[t * st]));
  if (smooth_per_class != A(0)) loss += smooth_per_class * (A(C) * lse - sum_x);
  return loss;
}

template <class T>
void cross_entropy_impl(const Tensor& logits, const Tensor& target, int64_t ignore_index, double label_smoothing,
                        LossReduction reduction, Tensor& out, Tensor& lse, Tensor& count) {
  using A = acc_t<T>;
  const int64_t N = logits.size(0), C = logits.size(1), D = logits.size(2), rows = N * D;
  const int64_t valid = count_valid_targets("cross_entropy", target, C, ignore_index);
  const T* px = cptr<T>(logits);
  const int64_t* pt = target.data<int64_t>();
  A* pl = mptr<A>(lse);
  const A on = A(1 - label_smoothing), spc = A(label_smoothing / double(C));
  auto row_loss = [&](int64_t e) -> A {
    const int64_t t = pt[e];
    if (t == ignore_index) {
      pl[e] = 0;
      return 0;
    }
    const T* x = px + (e / D) * C * D + e % D;
    return D == 1 ? ce_forward_row<1>(x, C, D, t, on, spc, pl[e]) : ce_forward_row<0>(x, C, D, t, on, spc, pl[e]);
  };
  if (reduction == LossReduction::None) {
    T* po = mptr<T>(out);
    parallel_for(rows, C * 3, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) po[i] = T(row_loss(i));
    });
  } else {
    const double total = parallel_sum(rows, C * 3, [&](int64_t b, int64_t e) {
      double s = 0;
      for (int64_t i = b; i < e; ++i) s += double(row_loss(i));
      return s;
    });
    // Mean over no valid target is 0/0 = nan, as PyTorch.
    *mptr<T>(out) = T(reduction == LossReduction::Mean ? total / double(valid) : total);
  }
  *mptr<A>(count) = A(valid);
}

void cpu_cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index, double label_smoothing,
                       LossReduction reduction, Tensor& out, Tensor& lse, Tensor& count) {
  BOOSTER_DISPATCH_FLOATING(logits.dtype(), "cross_entropy", [&] {
    cross_entropy_impl<scalar_t>(logits, target, ignore_index, label_smoothing, reduction, out, lse, count);
  });
}

template <class T>
void cross_entropy_backward_impl(const Tensor& grad, const Tensor& logits, const Tensor& target, const Tensor& lse,
                                 const Tensor& count, int64_t ignore_index, double label_smoothing,
                                 LossReduction reduction, Tensor& dlogits) {
  using A = acc_t<T>;
  const int64_t N = logits.size(0), C = logits.size(1), D = logits.size(2), rows = N * D;
  const T* px = cptr<T>(logits);
  const int64_t* pt = target.data<int64_t>();
  const A* pl = cptr<A>(lse);
  T* pd = mptr<T>(dlogits);
  const LossGradScale<T, A> scale{cptr<T>(grad), reduction, *cptr<A>(count)};
  const A on = A(1 - label_smoothing), spc = A(label_smoothing / double(C));
  parallel_for(rows, C * 3, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t base = (i / D) * C * D + i % D, t = pt[i];
      const T* x = px + base;
      T* d = pd + base;
      if (t == ignore_index) {
        for (int64_t c = 0; c < C; ++c) d[c * D] = T(0);
        continue;
      }
      const A k = scale.at(i), l = pl[i];
      if (D == 1) {
        for (int64_t c = 0; c < C; ++c) d[c] = T(k * (exp_acc(A(x[c]) - l) - spc));
      } else {
        for (int64_t c = 0; c < C; ++c) d[c * D] = T(k * (exp_acc(A(x[c * D]) - l) - spc));
      }
      d[t * D] = T(A(d[t * D]) - k * on);
    }
  });
}

void cpu_cross_entropy_backward(const Tensor& grad, const Tensor& logits, const Tensor& target, const Tensor& lse,
                                const Tensor& count, int64_t ignore_index, double label_smoothing,
                                LossReduction reduction, Tensor& dlogits) {
  BOOSTER_DISPATCH_FLOATING(logits.dtype(), "cross_entropy_backward", [&] {
    cross_entropy_backward_impl<scalar_t>(grad, logits, target, lse, count, ignore_index, label_smoothing,
                                          reduction, dlogits);
  });
}

void cpu_nll_loss(const Tensor& log_probs, const Tensor& target, int64_t ignore_index, LossReduction reduction,
                  Tensor& out, Tensor& count) {
  BOOSTER_DISPATCH_FLOATING(log_probs.dtype(), "nll_loss", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const int64_t N = log_probs.size(0), C = log_probs.size(1), D = log_probs.size(2), rows = N * D;
    const int64_t valid = count_valid_targets("nll_loss", target, C, ignore_index);
    const T* px = cptr<T>(log_probs);
    const int64_t* pt = target.data<int64_t>();
    auto elem = [&](int64_t i) -> A {
      const int64_t t = pt[i];
      return t == ignore_index ? A(0) : -A(px[(i / D) * C * D + t * D + i % D]);
    };
    if (reduction == LossReduction::None) {
      T* po = mptr<T>(out);
      parallel_for(rows, 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) po[i] = T(elem(i));
      });
    } else {
      double total = 0;
      for (int64_t i = 0; i < rows; ++i) total += double(elem(i));
      *mptr<T>(out) = T(reduction == LossReduction::Mean ? total / double(valid) : total);
    }
    *mptr<A>(count) = A(valid);
  });
}

void cpu_nll_loss_backward(const Tensor& grad, const Tensor& target, const Tensor& count, int64_t ignore_index,
                           LossReduction reduction, Tensor& dlog_probs) {
  BOOSTER_DISPATCH_FLOATING(dlog_probs.dtype(), "nll_loss_backward", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const int64_t N = dlog_probs.size(0), C = dlog_probs.size(1), D = dlog_probs.size(2), rows = N * D;
    const int64_t* pt = target.data<int64_t>();
    T* pd = mptr<T>(dlog_probs);
    const LossGradScale<T, A> scale{cptr<T>(grad), reduction, *cptr<A>(count)};
    std::fill_n(pd, dlog_probs.numel(), T(0));
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t t = pt[i];
      if (t != ignore_index) pd[(i / D) * C * D + t * D + i % D] = T(-scale.at(i));
    }
  });
}

void cpu_mse_loss(const Tensor& input, const Tensor& target, LossReduction reduction, Tensor& out) {
  BOOSTER_DISPATCH_FLOATING(input.dtype(), "mse_loss", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const T* px = cptr<T>(input);
    const T* pt = cptr<T>(target);
    const int64_t n = input.numel();
    if (reduction == LossReduction::None) {
      T* po = mptr<T>(out);
      parallel_for(n, 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          const A d = A(px[i]) - A(pt[i]);
          po[i] = T(d * d);
        }
      });
      return;
    }
    const double total = parallel_sum(n, 1, [&](int64_t b, int64_t e) {
      A s = 0;
      _Pragma("omp simd reduction(+ : s)")  // inside a macro argument: no #pragma
      for (int64_t i = b; i < e; ++i) {
        const A d = A(px[i]) - A(pt[i]);
        s += d * d;
      }
      return double(s);
    });
    *mptr<T>(out) = T(reduction == LossReduction::Mean ? total / double(n) : total);
  });
}

void cpu_mse_loss_backward(const Tensor& grad, const Tensor& input, const Tensor& target, LossReduction reduction,
                           Tensor& dinput, Tensor& dtarget) {
  BOOSTER_DISPATCH_FLOATING(input.dtype(), "mse_loss_backward", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const T* px = cptr<T>(input);
    const T* pt = cptr<T>(target);
    const int64_t n = input.numel();
    const LossGradScale<T, A> scale{cptr<T>(grad), reduction, A(n)};
    T* pdi = dinput.defined() ? mptr<T>(dinput) : nullptr;
    T* pdt = dtarget.defined() ? mptr<T>(dtarget) : nullptr;
    parallel_for(n, 2, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const A d = A(2) * scale.at(i) * (A(px[i]) - A(pt[i]));
        if (pdi) pdi[i] = T(d);
        if (pdt) pdt[i] = T(-d);
      }
    });
  });
}

}  // namespace
}  // namespace booster::cpu

namespace booster::kernels {
BOOSTER_REGISTER_CPU_KERNEL(cross_entropy_kernel, &cpu::cpu_cross_entropy);
BOOSTER_REGISTER_CPU_KERNEL(cross_entropy_backward_kernel, &cpu::cpu_cross_entropy_backward);
BOOSTER_REGISTER_CPU_KERNEL(nll_loss_kernel, &cpu::cpu_nll_loss);
BOOSTER_REGISTER_CPU_KERNEL(nll_loss_backward_kernel, &cpu::cpu_nll_loss_backward);
BOOSTER_REGISTER_CPU_KERNEL(mse_loss_kernel, &cpu::cpu_mse_loss);
BOOSTER_REGISTER_CPU_KERNEL(mse_loss_backward_kernel, &cpu::cpu_mse_loss_backward);
}  // namespace booster::kernels
