// CPU batch norm over (N, C, L), forward (training and eval) and backward (kernels/nn.h).
//
// Rows (or channels) are processed while in cache and split across threads; per-channel statistics
// accumulate in double (Note [Batch-norm sums in double]); reductions across rows add per-chunk
// partials in chunk order (Note [Repeatable sums] in nn_common.h).
#include "booster/backends/cpu/nn_common.h"

namespace booster::cpu {
namespace {

// Note [Batch-norm channel loops]
// x is [N, C, L]. A channel's M = N * L elements are N runs of L contiguous values, C * L apart.
// Work is split over channels; with L == 1 (x [N, C]) a run is a single value, so instead a thread
// takes a block of adjacent channels and walks the rows, keeping the inner loop contiguous.
constexpr int64_t kChannelBlock = 64;

// Note [Batch-norm sums in double]
// A channel's sums run over M = N * L values (100k and more for images), and a float32 running sum
// errs by up to about M u of its terms: the normalised output's error grew with M (1.6e-6 at 6.4k values,
// 4.9e-6 at 100k). The sums of the mean and variance and the backward's sum(g) and sum(g (x - mean))
// therefore accumulate in double for every dtype, as PyTorch's CPU kernel does; terms are widened as they
// are read and the loops stay vectorised (8 doubles a vector on AVX-512 instead of 16 floats, on a pass
// that is bound by memory). The per-element passes (the output, dx) stay in the compute type.
using Sum = double;

// f(c0, c1) gets a block of channels; per-channel sums over the batch are the caller's business.
template <class F>
void for_channel_blocks(int64_t N, int64_t C, int64_t L, F&& f) {
  const int64_t bs = L == 1 ? kChannelBlock : 1;
  const int64_t blocks = (C + bs - 1) / bs;
  parallel_for(blocks, N * L * bs * 3, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) f(b * bs, std::min(C, (b + 1) * bs));
  });
}


// For c in [c0, c1): sum_a[c - c0] = sum over n, l of term_a(c, i), and likewise sum_b, where i is
// the flat index of x[n, c, l]. One pass over the channels' data for both sums.
template <class A, class Fa, class Fb>
void channel_sums(int64_t N, int64_t C, int64_t L, int64_t c0, int64_t c1, A* sum_a, A* sum_b, Fa&& term_a,
                  Fb&& term_b) {
  std::fill(sum_a, sum_a + (c1 - c0), A(0));
  std::fill(sum_b, sum_b + (c1 - c0), A(0));
  for (int64_t n = 0; n < N; ++n) {
    if (L == 1) {
      for (int64_t c = c0; c < c1; ++c) {
        sum_a[c - c0] += term_a(c, n * C + c);
        sum_b[c - c0] += term_b(c, n * C + c);
      }
    } else {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t base = (n * C + c) * L;
        A sa = 0, sb = 0;
        #pragma omp simd reduction(+ : sa, sb)
        for (int64_t l = 0; l < L; ++l) {
          sa += term_a(c, base + l);
          sb += term_b(c, base + l);
        }
        sum_a[c - c0] += sa;
        sum_b[c - c0] += sb;
      }
    }
  }
}

// y[n, c, l] = a[c] * u[n, c, l] + b[c] * x[n, c, l] + d[c]; u may be null (then a is unused).
template <class T, class A>
void channel_affine(const T* u, const T* x, int64_t N, int64_t C, int64_t L, const A* a, const A* b, const A* d,
                    T* y) {
  if (L == 1) {
    parallel_for(N, C * 2, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const int64_t base = n * C;
        if (u)
          for (int64_t c = 0; c < C; ++c) y[base + c] = T(a[c] * A(u[base + c]) + b[c] * A(x[base + c]) + d[c]);
        else
          for (int64_t c = 0; c < C; ++c) y[base + c] = T(b[c] * A(x[base + c]) + d[c]);
      }
    });
    return;
  }
  parallel_for(N * C, L * 2, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t c = r % C, base = r * L;
      const A ac = u ? a[c] : A(0), bc = b[c], dc = d[c];
      if (u)
        for (int64_t l = 0; l < L; ++l) y[base + l] = T(ac * A(u[base + l]) + bc * A(x[base + l]) + dc);
      else
        for (int64_t l = 0; l < L; ++l) y[base + l] = T(bc * A(x[base + l]) + dc);
    }
  });
}

template <class T>
void batch_norm_impl(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                     const Tensor& running_var, bool training, double eps, Tensor& out, Tensor& save_mean,
                     Tensor& save_rstd, Tensor& batch_var_unbiased) {
  using A = acc_t<T>;
  const int64_t N = x.size(0), C = x.size(1), L = x.size(2), M = N * L;
  const T* px = cptr<T>(x);
  A* sm = mptr<A>(save_mean);
  A* sr = mptr<A>(save_rstd);
  A* vu = batch_var_unbiased.defined() ? mptr<A>(batch_var_unbiased) : nullptr;
  // The mean as shift + deviation (training: the channel's first value and the mean of x - shift), so
  // that x - mean is computed as (x - shift) - deviation: the float32 mean alone would round it by u
  // |mean|, far above u |x - mean| for data far from zero.
  std::vector<A> base(static_cast<size_t>(C)), deviation(static_cast<size_t>(C), A(0));
  if (training) {
    for_channel_blocks(N, C, L, [&](int64_t c0, int64_t c1) {
      // One pass with the data shifted by the channel's first value: sums of d and d^2, d = x - shift,
      // give mean and variance without the cancellation of raw sums of x^2 (shift ~ mean).
      // Sums in double (Note [Batch-norm sums in double]); d = x - shift is exact in double.
      Sum shift[kChannelBlock], sd[kChannelBlock], sd2[kChannelBlock];
      for (int64_t c = c0; c < c1; ++c) shift[c - c0] = Sum(A(px[c * L]));
      channel_sums(
          N, C, L, c0, c1, sd, sd2, [&](int64_t c, int64_t i) { return Sum(A(px[i])) - shift[c - c0]; },
          [&](int64_t c, int64_t i) {
            const Sum d = Sum(A(px[i])) - shift[c - c0];
            return d * d;
          });
      for (int64_t c = c0; c < c1; ++c) {
        const Sum s1 = sd[c - c0], s2 = sd2[c - c0], m = Sum(M);
        const Sum m2 = std::max(s2 - s1 * s1 / m, Sum(0));  // sum of squared deviations
        base[size_t(c)] = A(shift[c - c0]);
        deviation[size_t(c)] = A(s1 / m);
        sm[c] = A(shift[c - c0] + s1 / m);
        sr[c] = A(Sum(1) / std::sqrt(m2 / m + eps));
        if (vu) vu[c] = M > 1 ? A(m2 / Sum(M - 1)) : std::numeric_limits<A>::quiet_NaN();
      }
    });
  } else {
    const A* rm = cptr<A>(running_mean);
    const A* rv = cptr<A>(running_var);
    for (int64_t c = 0; c < C; ++c) {
      sm[c] = base[size_t(c)] = rm[c];
      sr[c] = A(1) / std::sqrt(rv[c] + A(eps));
    }
  }
  // ((x - base) - deviation) * (rstd * w) + b. Not folded into x * scale + (b - mean * scale): for data
  // far from zero x * scale is large, and its rounding would cost every output u |x * scale|, not u |y|.
  const T* pw = weight.defined() ? cptr<T>(weight) : nullptr;
  const T* pb = bias.defined() ? cptr<T>(bias) : nullptr;
  std::vector<A> scale(static_cast<size_t>(C)), offset(static_cast<size_t>(C));
  for (int64_t c = 0; c < C; ++c) {
    scale[size_t(c)] = sr[c] * (pw ? A(pw[c]) : A(1));
    offset[size_t(c)] = pb ? A(pb[c]) : A(0);
  }
  T* y = mptr<T>(out);
  const A* sc = scale.data();
  const A* of = offset.data();
  const A* bs = base.data();
  const A* dv = deviation.data();
  if (L == 1) {
    parallel_for(N, C * 2, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t c = 0; c < C; ++c) y[n * C + c] = T(((A(px[n * C + c]) - bs[c]) - dv[c]) * sc[c] + of[c]);
    });
    return;
  }
  parallel_for(N * C, L * 2, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t c = r % C, row = r * L;
      const A b0 = bs[c], d = dv[c], k = sc[c], o = of[c];
      for (int64_t l = 0; l < L; ++l) y[row + l] = T(((A(px[row + l]) - b0) - d) * k + o);
    }
  });
}

void cpu_batch_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                    const Tensor& running_var, bool training, double eps, Tensor& out, Tensor& save_mean,
                    Tensor& save_rstd, Tensor& batch_var_unbiased) {
  BOOSTER_DISPATCH_FLOATING(x.dtype(), "batch_norm", [&] {
    batch_norm_impl<scalar_t>(x, weight, bias, running_mean, running_var, training, eps, out, save_mean, save_rstd,
                              batch_var_unbiased);
  });
}

template <class T>
void batch_norm_backward_impl(const Tensor& grad, const Tensor& x, const Tensor& weight, const Tensor& save_mean,
                              const Tensor& save_rstd, bool training, Tensor& dx, Tensor& dweight, Tensor& dbias) {
  using A = acc_t<T>;
  const int64_t N = x.size(0), C = x.size(1), L = x.size(2), M = N * L;
  const T* px = cptr<T>(x);
  const T* pg = cptr<T>(grad);
  const A* sm = cptr<A>(save_mean);
  const A* sr = cptr<A>(save_rstd);
  const T* pw = weight.defined() ? cptr<T>(weight) : nullptr;
  // Per channel: sum(g) and sum(g * (x - mean)), in double (Note [Batch-norm sums in double]).
  std::vector<Sum> sum_g(static_cast<size_t>(C)), sum_gxc(static_cast<size_t>(C));
  for_channel_blocks(N, C, L, [&](int64_t c0, int64_t c1) {
    channel_sums(
        N, C, L, c0, c1, sum_g.data() + c0, sum_gxc.data() + c0, [&](int64_t, int64_t i) { return Sum(A(pg[i])); },
        [&](int64_t c, int64_t i) { return Sum(A(pg[i])) * (Sum(A(px[i])) - Sum(sm[c])); });
  });
  if (dweight.defined()) {
    T* p = mptr<T>(dweight);
    for (int64_t c = 0; c < C; ++c) p[c] = T(A(sum_gxc[size_t(c)] * Sum(sr[c])));
  }
  if (dbias.defined()) {
    T* p = mptr<T>(dbias);
    for (int64_t c = 0; c < C; ++c) p[c] = T(A(sum_g[size_t(c)]));
  }
  if (!dx.defined()) return;
  // training: dx = w rstd (g - sum_g / M - xhat * sum_gxc rstd / M), written as a g + b x + d.
  // eval: the statistics are constants, dx = w rstd g.
  std::vector<A> ka(static_cast<size_t>(C)), kb(static_cast<size_t>(C)), kd(static_cast<size_t>(C));
  for (int64_t c = 0; c < C; ++c) {
    const size_t u = size_t(c);
    const Sum w = pw ? Sum(A(pw[c])) : Sum(1), rs = sr[c];
    ka[u] = A(w * rs);
    if (training) {
      const Sum b = -w * rs * rs * rs * sum_gxc[u] / Sum(M);
      kb[u] = A(b);
      kd[u] = A(-w * rs * sum_g[u] / Sum(M) - b * Sum(sm[c]));
    } else {
      kb[u] = 0;
      kd[u] = 0;
    }
  }
  channel_affine<T, A>(pg, px, N, C, L, ka.data(), kb.data(), kd.data(), mptr<T>(dx));
}

void cpu_batch_norm_backward(const Tensor& grad, const Tensor& x, const Tensor& weight, const Tensor& save_mean,
                             const Tensor& save_rstd, bool training, Tensor& dx, Tensor& dweight, Tensor& dbias) {
  BOOSTER_DISPATCH_FLOATING(x.dtype(), "batch_norm_backward", [&] {
    batch_norm_backward_impl<scalar_t>(grad, x, weight, save_mean, save_rstd, training, dx, dweight, dbias);
  });
}

}  // namespace
}  // namespace booster::cpu

namespace booster::kernels {
BOOSTER_REGISTER_CPU_KERNEL(batch_norm_kernel, &cpu::cpu_batch_norm);
BOOSTER_REGISTER_CPU_KERNEL(batch_norm_backward_kernel, &cpu::cpu_batch_norm_backward);
}  // namespace booster::kernels
