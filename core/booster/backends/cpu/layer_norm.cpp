// CPU layer norm over the last dims, forward and backward (kernels/nn.h).
//
// Rows (or channels) are processed while in cache with float32 (float64) accumulators and split across
// threads; reductions across rows add per-chunk partials in chunk order (Note [Repeatable sums] in
// nn_common.h).
#include "booster/backends/cpu/nn_common.h"

namespace booster::cpu {
namespace {

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

}  // namespace
}  // namespace booster::cpu

namespace booster::kernels {
BOOSTER_REGISTER_CPU_KERNEL(layer_norm_kernel, &cpu::cpu_layer_norm);
BOOSTER_REGISTER_CPU_KERNEL(layer_norm_backward_kernel, &cpu::cpu_layer_norm_backward);
}  // namespace booster::kernels
