// CPU softmax and log-softmax over one dim, forward and backward (kernels/nn.h).
//
// Rows (or channels) are processed while in cache with float32 (float64) accumulators and split across
// threads; reductions across rows add per-chunk partials in chunk order (Note [Repeatable sums] in
// nn_common.h).
#include "booster/backends/cpu/nn_common.h"

namespace booster::cpu {
namespace {

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

}  // namespace
}  // namespace booster::cpu

namespace booster::kernels {
BOOSTER_REGISTER_CPU_KERNEL(softmax_kernel, &cpu::cpu_softmax);
BOOSTER_REGISTER_CPU_KERNEL(softmax_backward_kernel, &cpu::cpu_softmax_backward);
}  // namespace booster::kernels
