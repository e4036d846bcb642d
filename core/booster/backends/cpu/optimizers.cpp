// CPU fused optimizer updates (kernels/fused.h): torch.optim.Adam/AdamW and SGD (1.13), one pass
// per run of a flat buffer.
//
// Each update covers elements [0, n) of flat spans: parameter P (float, double, Half, BFloat16),
// gradient P, state S = acc_t<P>. Every scalar arrives already rounded to S, as torch rounds its
// Python-double hyperparameters to the tensor's dtype, and each formula keeps torch's order of
// operations (mul_ then add_, addcmul_, addcdiv_), so float32 results agree with torch to rounding
// (this file is built with -ffp-contract=off: no fused multiply-adds in any ISA build). Option
// switches are template parameters, so the loop body has no branches and the compiler vectorizes it
// for float and double (`omp simd`: element-wise, no reassociation, so vector and scalar code give
// the same bits).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "booster/backends/cpu/isa.h"
#include "booster/backends/cpu/loops.h"
#include "booster/kernels/fused.h"
#include "booster/tensor/half.h"

namespace booster::cpu {
namespace {

// Runs f.template operator()<B0, B1, B2>() with the runtime flags as compile-time constants.
template <class F>
void with_flags(bool b0, bool b1, bool b2, F&& f) {
  auto lvl2 = [&]<bool X, bool Y>() {
    if (b2) f.template operator()<X, Y, true>();
    else f.template operator()<X, Y, false>();
  };
  auto lvl1 = [&]<bool X>() {
    if (b1) lvl2.template operator()<X, true>();
    else lvl2.template operator()<X, false>();
  };
  if (b0) lvl1.template operator()<true>();
  else lvl1.template operator()<false>();
}

inline void to_float(const Half* s, float* d, int64_t n) { half_to_float(s, d, n); }
inline void to_float(const BFloat16* s, float* d, int64_t n) { bf16_to_float(s, d, n); }
inline void from_float(const float* s, Half* d, int64_t n) { float_to_half(s, d, n); }
inline void from_float(const float* s, BFloat16* d, int64_t n) { float_to_bf16(s, d, n); }

// Calls update(p, g, offset, len) over [0, n). float and double spans pass straight through; 16-bit
// parameters and gradients are widened to float block by block (vectorized conversions), updated
// there, and the parameters rounded back, so the update loops only ever see float or double.
template <class P, class F>
void in_compute_precision(P* p, const P* g, int64_t n, F&& update) {
  if constexpr (std::is_same_v<P, float> || std::is_same_v<P, double>) {
    update(p, g, int64_t(0), n);
  } else {
    constexpr int64_t kBlock = 1024;
    alignas(64) float pf[kBlock], gf[kBlock];
    for (int64_t b = 0; b < n; b += kBlock) {
      const int64_t len = std::min(kBlock, n - b);
      to_float(p + b, pf, len);
      to_float(g + b, gf, len);
      update(pf, static_cast<const float*>(gf), b, len);
      from_float(pf, p + b, len);
    }
  }
}

// Elements per parallel chunk cost: an optimizer touches ~5 streams per element.
inline constexpr int64_t kOptimizerCostPerElement = 4;

template <class S>
struct SGDCoeffs {
  S neg_lr, weight_decay, momentum, one_minus_dampening;
};

// kFirst: the momentum buffer is set to d (torch clones the first gradient).
template <bool kWeightDecay, bool kMomentum, bool kNesterov, class P, class S>
void sgd_update(P* __restrict p, const P* __restrict g, S* __restrict buf, int64_t n, const SGDCoeffs<S> c,
                bool first) {
  if constexpr (kMomentum) {
    if (first) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const S pv = S(p[i]);
        S d = S(g[i]);
        if constexpr (kWeightDecay) d = d + c.weight_decay * pv;
        buf[i] = d;
        if constexpr (kNesterov) d = d + c.momentum * d;
        p[i] = P(pv + c.neg_lr * d);
      }
      return;
    }
  }
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const S pv = S(p[i]);
    S d = S(g[i]);
    if constexpr (kWeightDecay) d = d + c.weight_decay * pv;
    if constexpr (kMomentum) {
      const S b = buf[i] * c.momentum + c.one_minus_dampening * d;
      buf[i] = b;
      if constexpr (kNesterov) d = d + c.momentum * b;
      else d = b;
    }
    p[i] = P(pv + c.neg_lr * d);
  }
}

template <class S>
struct AdamCoeffs {
  S beta1, beta2, one_minus_beta1, one_minus_beta2;
  S weight_decay;       // L2 (Adam)
  S decay;              // 1 - lr * weight_decay (AdamW)
  S neg_step_size;      // -lr / (1 - beta1^t)
  S bias_correction2_sqrt;
  S eps;
};

// std::sqrt keeps the loop it sits in scalar: without -fno-math-errno GCC must be able to set errno
// for negative inputs. The Adam loop is therefore cut in blocks: a vectorized pass for the moments,
// a square-root pass with explicit vector instructions, and a vectorized pass for the parameters.
// Every value is computed exactly as in one scalar loop (IEEE sqrt is correctly rounded).
template <class S>
inline void sqrt_inplace(S* __restrict d, int64_t n) {
  int64_t i = 0;
#if defined(__AVX__)
  if constexpr (std::is_same_v<S, float>) {
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, _mm256_sqrt_ps(_mm256_loadu_ps(d + i)));
  } else if constexpr (std::is_same_v<S, double>) {
    for (; i + 4 <= n; i += 4) _mm256_storeu_pd(d + i, _mm256_sqrt_pd(_mm256_loadu_pd(d + i)));
  }
#endif
  for (; i < n; ++i) d[i] = std::sqrt(d[i]);
}

template <bool kDecoupled, bool kWeightDecay, bool kAmsgrad, class P, class S>
void adam_update(P* __restrict p, const P* __restrict g, S* __restrict m, S* __restrict v, S* __restrict vmax,
                 int64_t n, const AdamCoeffs<S> c) {
  constexpr int64_t kBlock = 512;  // the scratch row stays in L1
  alignas(64) S root[kBlock];
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const int64_t len = std::min(kBlock, n - b0);
    P* __restrict pb = p + b0;
    const P* __restrict gb = g + b0;
    S* __restrict mb = m + b0;
    S* __restrict vb = v + b0;
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) {
      S gv = S(gb[i]);
      if constexpr (!kDecoupled && kWeightDecay) gv = gv + c.weight_decay * S(pb[i]);
      const S mv = mb[i] * c.beta1 + c.one_minus_beta1 * gv;
      S vv = vb[i] * c.beta2 + c.one_minus_beta2 * gv * gv;
      mb[i] = mv;
      vb[i] = vv;
      if constexpr (kAmsgrad) {
        // torch.maximum: a NaN in either stays (std::max would drop a NaN vv; Note [NaN propagation]
        // in elementwise.cpp).
        const S vm = vmax[b0 + i];
        vv = (vv < vm || vm != vm) ? vm : vv;
        vmax[b0 + i] = vv;
      }
      root[i] = vv;
    }
    sqrt_inplace(root, len);
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) {
      S pv = S(pb[i]);
      if constexpr (kDecoupled) pv = pv * c.decay;
      const S denom = root[i] / c.bias_correction2_sqrt + c.eps;
      pb[i] = P(pv + c.neg_step_size * mb[i] / denom);
    }
  }
}

void cpu_adam(const kernels::AdamStep& s, Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
              Tensor& max_exp_avg_sq) {
  BOOSTER_DISPATCH_FLOATING(param.dtype(), "Adam.step", [&] {
    using P = scalar_t;
    using S = acc_t<P>;
    const AdamCoeffs<S> c{S(s.beta1), S(s.beta2),         S(s.one_minus_beta1),         S(s.one_minus_beta2),
                          S(s.weight_decay), S(s.decay), S(s.neg_step_size), S(s.bias_correction2_sqrt),
                          S(s.eps)};
    P* p = param.data<P>();
    const P* g = grad.data<P>();
    S* m = exp_avg.data<S>();
    S* v = exp_avg_sq.data<S>();
    S* vmax = s.amsgrad ? max_exp_avg_sq.data<S>() : nullptr;
    with_flags(s.decoupled, s.weight_decay != 0.0, s.amsgrad, [&]<bool kDecoupled, bool kWD, bool kAms>() {
      parallel_for(param.numel(), kOptimizerCostPerElement, [&](int64_t lo, int64_t hi) {
        in_compute_precision(p + lo, g + lo, hi - lo, [&](auto* pc, const auto* gc, int64_t at, int64_t len) {
          const int64_t o = lo + at;
          adam_update<kDecoupled, kWD, kAms>(pc, gc, m + o, v + o, vmax ? vmax + o : nullptr, len, c);
        });
      });
    });
  });
}

void cpu_sgd(const kernels::SGDStep& s, Tensor& param, const Tensor& grad, Tensor& momentum_buffer) {
  BOOSTER_DISPATCH_FLOATING(param.dtype(), "SGD.step", [&] {
    using P = scalar_t;
    using S = acc_t<P>;
    const SGDCoeffs<S> c{S(s.neg_lr), S(s.weight_decay), S(s.momentum), S(s.one_minus_dampening)};
    P* p = param.data<P>();
    const P* g = grad.data<P>();
    S* b = s.momentum != 0.0 ? momentum_buffer.data<S>() : nullptr;
    with_flags(s.weight_decay != 0.0, s.momentum != 0.0, s.nesterov, [&]<bool kWD, bool kMom, bool kNest>() {
      parallel_for(param.numel(), kOptimizerCostPerElement, [&](int64_t lo, int64_t hi) {
        in_compute_precision(p + lo, g + lo, hi - lo, [&](auto* pc, const auto* gc, int64_t at, int64_t len) {
          sgd_update<kWD, kMom, kNest>(pc, gc, b ? b + lo + at : nullptr, len, c, s.first);
        });
      });
    });
  });
}

}  // namespace
}  // namespace booster::cpu

namespace booster::kernels {
BOOSTER_REGISTER_CPU_KERNEL(adam_kernel, &cpu::cpu_adam);
BOOSTER_REGISTER_CPU_KERNEL(sgd_kernel, &cpu::cpu_sgd);
}  // namespace booster::kernels
