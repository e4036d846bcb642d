// CPU kernels for the fused neural-network families of kernels/nn.h.
//
// Each kernel makes one or two passes over a row (or a channel) while it is in cache, with float32
// (float64) accumulators, and splits rows across threads with cpu::parallel_for. Where a kernel also
// reduces across rows (dweight, dbias, a loss's mean), each thread sums its own contiguous chunk and
// the partial sums are added in chunk order, so a run is repeatable for a given thread count.

// The build compiles with -fno-trapping-math (see CMakeLists.txt): under GCC's default, the select in
// exp_f32's clamp may not be computed speculatively and loops calling it stay scalar.

#include <cblas.h>

#include <bit>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "booster/backends/cpu/convert.h"
#include "booster/backends/cpu/loops.h"
#include "booster/backends/cpu/vec_math.h"
#include "booster/kernels/nn.h"

namespace booster::cpu {
namespace {

using kernels::LossReduction;

template <class T>
const T* cptr(const Tensor& t) {
  return static_cast<const T*>(t.data_ptr());
}
template <class T>
T* mptr(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// Like parallel_for, but f(chunk, begin, end) also learns its chunk index so it can write a partial
// result into its own slot. Returns the number of chunks.
template <class F>
int parallel_chunks(int64_t n, int64_t cost_per_item, F&& f) {
  const int nt = num_threads_for(n * std::max<int64_t>(cost_per_item, 1));
  if (nt <= 1) {
    f(0, int64_t(0), n);
    return 1;
  }
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    const int64_t chunk = (n + nt - 1) / nt;
    const int64_t b = std::min<int64_t>(n, t * chunk), e = std::min<int64_t>(n, b + chunk);
    if (b < e) f(t, b, e);
  }
  return nt;
}

// Sum over [0, n) of f(begin, end) computed per chunk, partials added in chunk order.
template <class F>
double parallel_sum(int64_t n, int64_t cost_per_item, F&& f) {
  const int max_chunks = std::max(1, num_threads_for(n * std::max<int64_t>(cost_per_item, 1)));
  std::vector<double> partial(size_t(max_chunks), 0.0);
  parallel_chunks(n, cost_per_item, [&](int c, int64_t b, int64_t e) { partial[size_t(c)] = f(b, e); });
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

// ============================================================================================ softmax

// Note [Softmax geometry]
// The op views x as [outer, dim_size, inner]. With inner == 1 (softmax over the last dim, the common
// case) each row is contiguous and one thread owns whole rows. Otherwise the reduced elements of one
// output lane sit `inner` apart; we process a block of adjacent lanes together so the inner loops run
// over contiguous memory (and vectorize) while the running max and sum live in small lane buffers.
constexpr int64_t kLaneBlock = 256;

template <class T>
void softmax_impl(const Tensor& x, int64_t outer, int64_t dim_size, int64_t inner, bool log, Tensor& out) {
  using A = acc_t<T>;
  const T* px = cptr<T>(x);
  T* py = mptr<T>(out);
  if (inner == 1) {
    parallel_for(outer, dim_size * 4, [&](int64_t rb, int64_t re) {
      std::vector<A> e_buf(std::is_same_v<T, A> ? 0 : size_t(dim_size));
      for (int64_t r = rb; r < re; ++r) {
        const T* xr = px + r * dim_size;
        T* yr = py + r * dim_size;
        A mx = -std::numeric_limits<A>::infinity();
        #pragma omp simd reduction(max : mx)
        for (int64_t i = 0; i < dim_size; ++i) mx = std::max(mx, A(xr[i]));
        A s = 0;
        if (log) {
          #pragma omp simd reduction(+ : s)
          for (int64_t i = 0; i < dim_size; ++i) s += exp_acc(A(xr[i]) - mx);
          const A lse = mx + std::log(s);
          for (int64_t i = 0; i < dim_size; ++i) yr[i] = T(A(xr[i]) - lse);
        } else {
          // Keep exp(x - max) in full precision until it is divided (y itself when T is the acc type).
          A* e = std::is_same_v<T, A> ? reinterpret_cast<A*>(yr) : e_buf.data();
          #pragma omp simd reduction(+ : s)
          for (int64_t i = 0; i < dim_size; ++i) {
            e[i] = exp_acc(A(xr[i]) - mx);
            s += e[i];
          }
          const A inv = A(1) / s;
          for (int64_t i = 0; i < dim_size; ++i) yr[i] = T(e[i] * inv);
        }
      }
    });
    return;
  }
  const int64_t blocks = (inner + kLaneBlock - 1) / kLaneBlock;
  parallel_for(outer * blocks, dim_size * std::min(inner, kLaneBlock) * 4, [&](int64_t ub, int64_t ue) {
    std::vector<A> mx(static_cast<size_t>(kLaneBlock)), s(static_cast<size_t>(kLaneBlock));
    for (int64_t u = ub; u < ue; ++u) {
      const int64_t o = u / blocks, j0 = (u % blocks) * kLaneBlock, nl = std::min(kLaneBlock, inner - j0);
      const T* xb = px + o * dim_size * inner + j0;
      T* yb = py + o * dim_size * inner + j0;
      std::fill_n(mx.data(), nl, -std::numeric_limits<A>::infinity());
      std::fill_n(s.data(), nl, A(0));
      for (int64_t d = 0; d < dim_size; ++d)
        for (int64_t j = 0; j < nl; ++j) mx[size_t(j)] = std::max(mx[size_t(j)], A(xb[d * inner + j]));
      for (int64_t d = 0; d < dim_size; ++d)
        for (int64_t j = 0; j < nl; ++j) s[size_t(j)] += exp_acc(A(xb[d * inner + j]) - mx[size_t(j)]);
      if (log) {
        for (int64_t j = 0; j < nl; ++j) mx[size_t(j)] += std::log(s[size_t(j)]);  // now the lse
        for (int64_t d = 0; d < dim_size; ++d)
          for (int64_t j = 0; j < nl; ++j) yb[d * inner + j] = T(A(xb[d * inner + j]) - mx[size_t(j)]);
      } else {
        for (int64_t j = 0; j < nl; ++j) s[size_t(j)] = A(1) / s[size_t(j)];
        for (int64_t d = 0; d < dim_size; ++d)
          for (int64_t j = 0; j < nl; ++j)
            yb[d * inner + j] = T(exp_acc(A(xb[d * inner + j]) - mx[size_t(j)]) * s[size_t(j)]);
      }
    }
  });
}

void cpu_softmax(const Tensor& x, int64_t outer, int64_t dim_size, int64_t inner, bool log, Tensor& out) {
  BOOSTER_DISPATCH_FLOATING(x.dtype(), log ? "log_softmax" : "softmax",
                            [&] { softmax_impl<scalar_t>(x, outer, dim_size, inner, log, out); });
}

template <class T>
void softmax_backward_impl(const Tensor& grad, const Tensor& y, int64_t outer, int64_t dim_size, int64_t inner,
                           bool log, Tensor& dx) {
  using A = acc_t<T>;
  const T* pg = cptr<T>(grad);
  const T* py = cptr<T>(y);
  T* pd = mptr<T>(dx);
  if (inner == 1) {
    parallel_for(outer, dim_size * 3, [&](int64_t rb, int64_t re) {
      for (int64_t r = rb; r < re; ++r) {
        const T* g = pg + r * dim_size;
        const T* yr = py + r * dim_size;
        T* d = pd + r * dim_size;
        A s = 0;
        if (log) {
          #pragma omp simd reduction(+ : s)
          for (int64_t i = 0; i < dim_size; ++i) s += A(g[i]);
          for (int64_t i = 0; i < dim_size; ++i) d[i] = T(A(g[i]) - exp_acc(A(yr[i])) * s);
        } else {
          #pragma omp simd reduction(+ : s)
          for (int64_t i = 0; i < dim_size; ++i) s += A(g[i]) * A(yr[i]);
          for (int64_t i = 0; i < dim_size; ++i) d[i] = T(A(yr[i]) * (A(g[i]) - s));
        }
      }
    });
    return;
  }
  const int64_t blocks = (inner + kLaneBlock - 1) / kLaneBlock;
  parallel_for(outer * blocks, dim_size * std::min(inner, kLaneBlock) * 3, [&](int64_t ub, int64_t ue) {
    std::vector<A> s(static_cast<size_t>(kLaneBlock));
    for (int64_t u = ub; u < ue; ++u) {
      const int64_t o = u / blocks, j0 = (u % blocks) * kLaneBlock, nl = std::min(kLaneBlock, inner - j0);
      const int64_t base = o * dim_size * inner + j0;
      const T* g = pg + base;
      const T* yr = py + base;
      T* d = pd + base;
      std::fill_n(s.data(), nl, A(0));
      for (int64_t k = 0; k < dim_size; ++k)
        for (int64_t j = 0; j < nl; ++j)
          s[size_t(j)] += log ? A(g[k * inner + j]) : A(g[k * inner + j]) * A(yr[k * inner + j]);
      for (int64_t k = 0; k < dim_size; ++k)
        for (int64_t j = 0; j < nl; ++j) {
          const int64_t i = k * inner + j;
          d[i] = log ? T(A(g[i]) - exp_acc(A(yr[i])) * s[size_t(j)]) : T(A(yr[i]) * (A(g[i]) - s[size_t(j)]));
        }
    }
  });
}

void cpu_softmax_backward(const Tensor& grad, const Tensor& y, int64_t outer, int64_t dim_size, int64_t inner,
                          bool log, Tensor& dx) {
  BOOSTER_DISPATCH_FLOATING(y.dtype(), log ? "log_softmax_backward" : "softmax_backward",
                            [&] { softmax_backward_impl<scalar_t>(grad, y, outer, dim_size, inner, log, dx); });
}

// ========================================================================================= layer norm

template <class T>
void layer_norm_impl(const Tensor& x, const Tensor& weight, const Tensor& bias, int64_t rows, int64_t cols,
                     double eps, Tensor& out, Tensor& mean, Tensor& rstd) {
  using A = acc_t<T>;
  const T* px = cptr<T>(x);
  const T* pw = weight.defined() ? cptr<T>(weight) : nullptr;
  const T* pb = bias.defined() ? cptr<T>(bias) : nullptr;
  T* py = mptr<T>(out);
  A* pm = mptr<A>(mean);
  A* pr = mptr<A>(rstd);
  parallel_for(rows, cols * 4, [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const T* xr = px + r * cols;
      T* yr = py + r * cols;
      // Two passes (mean, then squared deviations): no cancellation for rows with a large mean.
      A s = 0;
      #pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < cols; ++i) s += A(xr[i]);
      const A mu = s / A(cols);
      A ss = 0;
      #pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < cols; ++i) {
        const A d = A(xr[i]) - mu;
        ss += d * d;
      }
      const A rs = A(1) / std::sqrt(ss / A(cols) + A(eps));
      pm[r] = mu;
      pr[r] = rs;
      if (pw && pb) {
        for (int64_t i = 0; i < cols; ++i) yr[i] = T((A(xr[i]) - mu) * rs * A(pw[i]) + A(pb[i]));
      } else if (pw) {
        for (int64_t i = 0; i < cols; ++i) yr[i] = T((A(xr[i]) - mu) * rs * A(pw[i]));
      } else if (pb) {
        for (int64_t i = 0; i < cols; ++i) yr[i] = T((A(xr[i]) - mu) * rs + A(pb[i]));
      } else {
        for (int64_t i = 0; i < cols; ++i) yr[i] = T((A(xr[i]) - mu) * rs);
      }
    }
  });
}

void cpu_layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, int64_t rows, int64_t cols,
                    double eps, Tensor& out, Tensor& mean, Tensor& rstd) {
  BOOSTER_DISPATCH_FLOATING(x.dtype(), "layer_norm", [&] {
    layer_norm_impl<scalar_t>(x, weight, bias, rows, cols, eps, out, mean, rstd);
  });
}

template <class T>
void layer_norm_backward_impl(const Tensor& grad, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                              const Tensor& weight, int64_t rows, int64_t cols, Tensor& dx, Tensor& dweight,
                              Tensor& dbias) {
  using A = acc_t<T>;
  const T* pg = cptr<T>(grad);
  const T* px = cptr<T>(x);
  const A* pm = cptr<A>(mean);
  const A* pr = cptr<A>(rstd);
  const T* pw = weight.defined() ? cptr<T>(weight) : nullptr;
  T* pdx = dx.defined() ? mptr<T>(dx) : nullptr;
  const bool want_dw = dweight.defined(), want_db = dbias.defined();
  // The weight as acc-type values (ones without one), so the row loops below have no branches.
  std::vector<A> w(static_cast<size_t>(cols), A(1));
  if (pw)
    for (int64_t i = 0; i < cols; ++i) w[size_t(i)] = A(pw[i]);
  const int max_chunks = std::max(1, num_threads_for(rows * cols * 6));
  // Per-chunk partial column sums for dweight (sum g * xhat) and dbias (sum g), always accumulated
  // (cheaper than a branch per element); only the wanted ones are stored.
  std::vector<A> part_dw(size_t(max_chunks * cols), A(0)), part_db(size_t(max_chunks * cols), A(0));
  const int chunks = parallel_chunks(rows, cols * 6, [&](int c, int64_t rb, int64_t re) {
    A* dw = part_dw.data() + size_t(c) * size_t(cols);
    A* db = part_db.data() + size_t(c) * size_t(cols);
    const A* wv = w.data();
    for (int64_t r = rb; r < re; ++r) {
      const T* g = pg + r * cols;
      const T* xr = px + r * cols;
      const A mu = pm[r], rs = pr[r];
      // dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat)), gw = g * weight; one pass for the two
      // means and the dweight/dbias columns, one to write dx.
      A sum_gw = 0, sum_gw_xhat = 0;
      #pragma omp simd reduction(+ : sum_gw, sum_gw_xhat)
      for (int64_t i = 0; i < cols; ++i) {
        const A gi = A(g[i]), xhat = (A(xr[i]) - mu) * rs, gw = gi * wv[i];
        sum_gw += gw;
        sum_gw_xhat += gw * xhat;
        dw[i] += gi * xhat;
        db[i] += gi;
      }
      if (!pdx) continue;
      const A inv_n = A(1) / A(cols);
      const A m1 = sum_gw * inv_n, m2 = sum_gw_xhat * inv_n;
      T* d = pdx + r * cols;
      for (int64_t i = 0; i < cols; ++i) d[i] = T(rs * (A(g[i]) * wv[i] - m1 - (A(xr[i]) - mu) * rs * m2));
    }
  });
  auto combine = [&](const std::vector<A>& part, Tensor& dst) {
    T* p = mptr<T>(dst);
    for (int64_t i = 0; i < cols; ++i) {
      A s = 0;
      for (int c = 0; c < chunks; ++c) s += part[size_t(c) * size_t(cols) + size_t(i)];
      p[i] = T(s);
    }
  };
  if (want_dw) combine(part_dw, dweight);
  if (want_db) combine(part_db, dbias);
}

void cpu_layer_norm_backward(const Tensor& grad, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                             const Tensor& weight, int64_t rows, int64_t cols, Tensor& dx, Tensor& dweight,
                             Tensor& dbias) {
  BOOSTER_DISPATCH_FLOATING(x.dtype(), "layer_norm_backward", [&] {
    layer_norm_backward_impl<scalar_t>(grad, x, mean, rstd, weight, rows, cols, dx, dweight, dbias);
  });
}

// ========================================================================================= batch norm

// Note [Batch-norm channel loops]
// x is [N, C, L]. A channel's M = N * L elements are N runs of L contiguous values, C * L apart.
// Work is split over channels; with L == 1 (x [N, C]) a run is a single value, so instead a thread
// takes a block of adjacent channels and walks the rows, keeping the inner loop contiguous.
constexpr int64_t kChannelBlock = 64;

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
  if (training) {
    for_channel_blocks(N, C, L, [&](int64_t c0, int64_t c1) {
      // One pass with the data shifted by the channel's first value: sums of d and d^2, d = x - shift,
      // give mean and variance without the cancellation of raw sums of x^2 (shift ~ mean).
      A shift[kChannelBlock], sd[kChannelBlock], sd2[kChannelBlock];
      for (int64_t c = c0; c < c1; ++c) shift[c - c0] = A(px[c * L]);
      channel_sums(
          N, C, L, c0, c1, sd, sd2, [&](int64_t c, int64_t i) { return A(px[i]) - shift[c - c0]; },
          [&](int64_t c, int64_t i) {
            const A d = A(px[i]) - shift[c - c0];
            return d * d;
          });
      for (int64_t c = c0; c < c1; ++c) {
        const A s1 = sd[c - c0], s2 = sd2[c - c0];
        const A m2 = std::max(s2 - s1 * s1 / A(M), A(0));  // sum of squared deviations
        sm[c] = shift[c - c0] + s1 / A(M);
        sr[c] = A(1) / std::sqrt(m2 / A(M) + A(eps));
        if (vu) vu[c] = M > 1 ? m2 / A(M - 1) : std::numeric_limits<A>::quiet_NaN();
      }
    });
  } else {
    const A* rm = cptr<A>(running_mean);
    const A* rv = cptr<A>(running_var);
    for (int64_t c = 0; c < C; ++c) {
      sm[c] = rm[c];
      sr[c] = A(1) / std::sqrt(rv[c] + A(eps));
    }
  }
  // (x - mean) * rstd * w + b folded into x * scale + shift per channel.
  const T* pw = weight.defined() ? cptr<T>(weight) : nullptr;
  const T* pb = bias.defined() ? cptr<T>(bias) : nullptr;
  std::vector<A> scale(static_cast<size_t>(C)), shift(static_cast<size_t>(C));
  for (int64_t c = 0; c < C; ++c) {
    scale[size_t(c)] = sr[c] * (pw ? A(pw[c]) : A(1));
    shift[size_t(c)] = (pb ? A(pb[c]) : A(0)) - sm[c] * scale[size_t(c)];
  }
  channel_affine<T, A>(nullptr, px, N, C, L, nullptr, scale.data(), shift.data(), mptr<T>(out));
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
  // Per channel: sum(g) and sum(g * (x - mean)).
  std::vector<A> sum_g(static_cast<size_t>(C)), sum_gxc(static_cast<size_t>(C));
  for_channel_blocks(N, C, L, [&](int64_t c0, int64_t c1) {
    channel_sums(
        N, C, L, c0, c1, sum_g.data() + c0, sum_gxc.data() + c0, [&](int64_t, int64_t i) { return A(pg[i]); },
        [&](int64_t c, int64_t i) { return A(pg[i]) * (A(px[i]) - sm[c]); });
  });
  if (dweight.defined()) {
    T* p = mptr<T>(dweight);
    for (int64_t c = 0; c < C; ++c) p[c] = T(sum_gxc[size_t(c)] * sr[c]);
  }
  if (dbias.defined()) {
    T* p = mptr<T>(dbias);
    for (int64_t c = 0; c < C; ++c) p[c] = T(sum_g[size_t(c)]);
  }
  if (!dx.defined()) return;
  // training: dx = w rstd (g - sum_g / M - xhat * sum_gxc rstd / M), written as a g + b x + d.
  // eval: the statistics are constants, dx = w rstd g.
  std::vector<A> ka(static_cast<size_t>(C)), kb(static_cast<size_t>(C)), kd(static_cast<size_t>(C));
  for (int64_t c = 0; c < C; ++c) {
    const size_t u = size_t(c);
    const A w = pw ? A(pw[c]) : A(1), rs = sr[c];
    ka[u] = w * rs;
    if (training) {
      kb[u] = -w * rs * rs * rs * sum_gxc[u] / A(M);
      kd[u] = -w * rs * sum_g[u] / A(M) - kb[u] * sm[c];
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

// ============================================================================================ dropout

void cpu_masked_scale(const Tensor& x, const Tensor& keep, double scale, Tensor& out) {
  BOOSTER_DISPATCH_FLOATING(x.dtype(), "dropout", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const T* px = cptr<T>(x);
    const bool* pk = keep.data<bool>();
    T* py = mptr<T>(out);
    const A s = A(scale);
    parallel_for(x.numel(), 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) py[i] = T(pk[i] ? A(px[i]) * s : A(0));
    });
  });
}

// ========================================================================================== attention

// Row-major C = alpha op(A) op(B) + beta C through OpenBLAS.
void blas_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, blasint(m), blasint(n),
              blasint(k), alpha, a, blasint(lda), b, blasint(ldb), beta, c, blasint(ldc));
}
void blas_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
               const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, blasint(m), blasint(n),
              blasint(k), alpha, a, blasint(lda), b, blasint(ldb), beta, c, blasint(ldc));
}

// Note [OpenBLAS inside parallel regions]
// Debian's OpenBLAS keeps its own pthread pool. When several of our OpenMP threads each call a GEMM,
// each call fans out onto that pool as well, and the spinning threads oversubscribe the cores: on 2
// cores attention ran 4-7x slower than with one BLAS thread per caller. So while our threads split
// the heads, OpenBLAS is held to one thread; a single head (or a single thread) keeps BLAS's own
// parallelism. The setting is process-wide, so it is restored as soon as the region ends.
// The OpenMP build of OpenBLAS (see Note [One thread pool] in CMakeLists.txt) needs none of this: it
// runs single-threaded inside an OpenMP region by itself, and its openblas_set_num_threads would
// call omp_set_num_threads, which would keep our own loop from forking.
class SingleThreadedBlas {
 public:
  static constexpr int kOpenMPBuild = 2;  // openblas_get_parallel(): 0 serial, 1 pthreads, 2 OpenMP
  SingleThreadedBlas() : prev_(openblas_get_parallel() == kOpenMPBuild ? 1 : openblas_get_num_threads()) {
    if (prev_ > 1) openblas_set_num_threads(1);
  }
  ~SingleThreadedBlas() {
    if (prev_ > 1) openblas_set_num_threads(prev_);
  }
  SingleThreadedBlas(const SingleThreadedBlas&) = delete;
  SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;

 private:
  int prev_;
};

// Runs body(b0, b1) over the heads [0, heads): split across threads when there are several heads
// and enough work, with BLAS single-threaded meanwhile; otherwise in one call with BLAS threaded.
template <class F>
void for_heads(int64_t heads, int64_t cost_per_head, F&& body) {
  if (heads < 2 || num_threads_for(heads * cost_per_head) < 2) {
    body(int64_t(0), heads);
    return;
  }
  SingleThreadedBlas single;
  parallel_for(heads, cost_per_head, body);
}

// Note [Attention in 16 bits]
// OpenBLAS has no float16 GEMM, so a float16/bfloat16 head is widened into per-thread float32
// scratch (allocated once per thread, reused across heads), computed in float32, and rounded once
// when the result is stored. For float32/float64 the GEMMs read and write the tensors directly.
template <class T, class A>
const A* widen(const T* src, int64_t n, std::vector<A>& scratch) {
  if constexpr (std::is_same_v<T, A>) {
    return src;
  } else {
    scratch.resize(size_t(n));
    load_block(src, scratch.data(), n);
    return scratch.data();
  }
}
// Where a GEMM should write an n-element result destined for dst.
template <class T, class A>
A* result_buffer(T* dst, int64_t n, std::vector<A>& scratch) {
  if constexpr (std::is_same_v<T, A>) {
    return dst;
  } else {
    scratch.resize(size_t(n));
    return scratch.data();
  }
}
template <class T, class A>
void store(const A* result, T* dst, int64_t n) {
  if constexpr (!std::is_same_v<T, A>) store_block(result, dst, n);
}

template <class T>
void attention_impl(const Tensor& q, const Tensor& k, const Tensor& v, bool is_causal, double scale, Tensor& out,
                    Tensor& probs) {
  using A = acc_t<T>;
  const int64_t B = q.size(0), L = q.size(1), E = q.size(2), S = k.size(1), Ev = v.size(2);
  const T* pq = cptr<T>(q);
  const T* pk = cptr<T>(k);
  const T* pv = cptr<T>(v);
  T* po = mptr<T>(out);
  A* pp = mptr<A>(probs);
  for_heads(B, L * S * (E + Ev) * 2, [&](int64_t b0, int64_t b1) {
    std::vector<A> qs, ks, vs, os;
    for (int64_t b = b0; b < b1; ++b) {
      const A* Q = widen(pq + b * L * E, L * E, qs);
      const A* K = widen(pk + b * S * E, S * E, ks);
      const A* V = widen(pv + b * S * Ev, S * Ev, vs);
      A* P = pp + b * L * S;
      if (S > 0) blas_gemm(false, true, L, S, E, A(scale), Q, E, K, E, A(0), P, S);
      for (int64_t i = 0; i < L; ++i) {
        A* row = P + i * S;
        const int64_t valid = is_causal ? std::min(i + 1, S) : S;  // keys this query may attend
        A mx = -std::numeric_limits<A>::infinity();
        #pragma omp simd reduction(max : mx)
        for (int64_t j = 0; j < valid; ++j) mx = std::max(mx, row[j]);
        A s = 0;
        #pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < valid; ++j) {
          row[j] = exp_acc(row[j] - mx);
          s += row[j];
        }
        const A inv = A(1) / s;
        for (int64_t j = 0; j < valid; ++j) row[j] *= inv;
        for (int64_t j = valid; j < S; ++j) row[j] = 0;
      }
      A* O = result_buffer(po + b * L * Ev, L * Ev, os);
      if (S > 0) {
        blas_gemm(false, false, L, Ev, S, A(1), P, S, V, Ev, A(0), O, Ev);
      } else {
        std::fill_n(O, L * Ev, A(0));
      }
      store(O, po + b * L * Ev, L * Ev);
    }
  });
}

void cpu_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool is_causal, double scale, Tensor& out,
                   Tensor& probs) {
  BOOSTER_DISPATCH_FLOATING(q.dtype(), "scaled_dot_product_attention",
                            [&] { attention_impl<scalar_t>(q, k, v, is_causal, scale, out, probs); });
}

template <class T>
void attention_backward_impl(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& probs, double scale, Tensor& dq, Tensor& dk, Tensor& dv) {
  using A = acc_t<T>;
  const int64_t B = q.size(0), L = q.size(1), E = q.size(2), S = k.size(1), Ev = v.size(2);
  const T* pg = cptr<T>(grad_out);
  const T* pq = cptr<T>(q);
  const T* pk = cptr<T>(k);
  const T* pv = cptr<T>(v);
  const A* pp = cptr<A>(probs);
  T* pdq = dq.defined() ? mptr<T>(dq) : nullptr;
  T* pdk = dk.defined() ? mptr<T>(dk) : nullptr;
  T* pdv = dv.defined() ? mptr<T>(dv) : nullptr;
  for_heads(B, L * S * (E + Ev) * 4, [&](int64_t b0, int64_t b1) {
    std::vector<A> gs, qs, ks, vs, dqs, dks, dvs, dp;
    for (int64_t b = b0; b < b1; ++b) {
      const A* P = pp + b * L * S;
      const A* dO = widen(pg + b * L * Ev, L * Ev, gs);
      if (pdv) {  // dV = P^T dO
        A* DV = result_buffer(pdv + b * S * Ev, S * Ev, dvs);
        blas_gemm(true, false, S, Ev, L, A(1), P, S, dO, Ev, A(0), DV, Ev);
        store(DV, pdv + b * S * Ev, S * Ev);
      }
      if (!pdq && !pdk) continue;
      // dP = dO V^T, then dS = P * (dP - rowsum(dP * P)) in place. Masked entries have P = 0, so dS = 0.
      const A* V = widen(pv + b * S * Ev, S * Ev, vs);
      dp.resize(size_t(L * S));
      A* dS = dp.data();
      blas_gemm(false, true, L, S, Ev, A(1), dO, Ev, V, Ev, A(0), dS, S);
      for (int64_t i = 0; i < L; ++i) {
        const A* pr = P + i * S;
        A* dr = dS + i * S;
        A dot = 0;
        #pragma omp simd reduction(+ : dot)
        for (int64_t j = 0; j < S; ++j) dot += dr[j] * pr[j];
        for (int64_t j = 0; j < S; ++j) dr[j] = pr[j] * (dr[j] - dot);
      }
      if (pdq) {  // dQ = dS K * scale
        const A* K = widen(pk + b * S * E, S * E, ks);
        A* DQ = result_buffer(pdq + b * L * E, L * E, dqs);
        blas_gemm(false, false, L, E, S, A(scale), dS, S, K, E, A(0), DQ, E);
        store(DQ, pdq + b * L * E, L * E);
      }
      if (pdk) {  // dK = dS^T Q * scale
        const A* Q = widen(pq + b * L * E, L * E, qs);
        A* DK = result_buffer(pdk + b * S * E, S * E, dks);
        blas_gemm(true, false, S, E, L, A(scale), dS, S, Q, E, A(0), DK, E);
        store(DK, pdk + b * S * E, S * E);
      }
    }
  });
}

void cpu_attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& probs, double scale, Tensor& dq, Tensor& dk, Tensor& dv) {
  BOOSTER_DISPATCH_FLOATING(q.dtype(), "scaled_dot_product_attention_backward", [&] {
    attention_backward_impl<scalar_t>(grad_out, q, k, v, probs, scale, dq, dk, dv);
  });
}

// ============================================================================================= losses

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
BOOSTER_REGISTER_CPU_KERNEL(softmax_kernel, &cpu::cpu_softmax);
BOOSTER_REGISTER_CPU_KERNEL(softmax_backward_kernel, &cpu::cpu_softmax_backward);
BOOSTER_REGISTER_CPU_KERNEL(layer_norm_kernel, &cpu::cpu_layer_norm);
BOOSTER_REGISTER_CPU_KERNEL(layer_norm_backward_kernel, &cpu::cpu_layer_norm_backward);
BOOSTER_REGISTER_CPU_KERNEL(batch_norm_kernel, &cpu::cpu_batch_norm);
BOOSTER_REGISTER_CPU_KERNEL(batch_norm_backward_kernel, &cpu::cpu_batch_norm_backward);
BOOSTER_REGISTER_CPU_KERNEL(masked_scale_kernel, &cpu::cpu_masked_scale);
BOOSTER_REGISTER_CPU_KERNEL(attention_kernel, &cpu::cpu_attention);
BOOSTER_REGISTER_CPU_KERNEL(attention_backward_kernel, &cpu::cpu_attention_backward);
BOOSTER_REGISTER_CPU_KERNEL(cross_entropy_kernel, &cpu::cpu_cross_entropy);
BOOSTER_REGISTER_CPU_KERNEL(cross_entropy_backward_kernel, &cpu::cpu_cross_entropy_backward);
BOOSTER_REGISTER_CPU_KERNEL(nll_loss_kernel, &cpu::cpu_nll_loss);
BOOSTER_REGISTER_CPU_KERNEL(nll_loss_backward_kernel, &cpu::cpu_nll_loss_backward);
BOOSTER_REGISTER_CPU_KERNEL(mse_loss_kernel, &cpu::cpu_mse_loss);
BOOSTER_REGISTER_CPU_KERNEL(mse_loss_backward_kernel, &cpu::cpu_mse_loss_backward);
}  // namespace booster::kernels
