// Math functions written so that loops calling them vectorize (see Note [Vectorizable exp]).
//
// The build compiles with -fno-trapping-math (see CMakeLists.txt): under GCC's default, the select in
// exp_f32's clamp may not be computed speculatively and loops calling it stay scalar.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "booster/backends/cpu/isa.h"

namespace booster::cpu {
inline namespace BOOSTER_CPU_ISA_NS {  // Note [One namespace per ISA build]

// Note [Vectorizable exp]
// std::exp is a library call the compiler cannot vectorize (without -ffast-math), and the softmax
// and loss kernels are bound by it. exp_f32 is Cephes' expf polynomial written without branches, so
// loops calling it vectorize: clamp x to [-104, 89], reduce x = n ln2 + r, a degree-6 polynomial for
// e^r, and 2^n applied as two factors 2^(n/2) 2^(n - n/2) so that both stay normal floats. The
// product then underflows to 0 (exp(-inf) = 0) and overflows to +inf exactly where expf does; NaN
// stays NaN. Relative error below 1e-7 (checked over [-104, 88.7] in steps of 7e-4).
// float64 keeps std::exp (float64 is the reference precision).
inline float exp_f32(float x) {
  const float xc = std::min(std::max(x, -104.0f), 89.0f);  // NaN passes through both
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float r = xc - n * 0.693359375f - n * -2.12194440e-4f;  // ln2 split in two for precision
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t ni = int32_t(n), n1 = ni >> 1, n2 = ni - n1;
  return p * std::bit_cast<float>((n1 + 127) << 23) * std::bit_cast<float>((n2 + 127) << 23);
}
template <class A>
inline A exp_acc(A x) {
  if constexpr (std::is_same_v<A, float>) {
    return exp_f32(x);
  } else {
    return std::exp(x);
  }
}

// Note [GELU through exp]
// GELU (tanh) is 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3), and 0.5 (1 + tanh(u)) is
// the logistic function of 2u, so GELU = x / (1 + exp(-2u)). With exp_acc that loop vectorizes,
// where std::tanh (glibc's tanhf, through expm1f) is a scalar call that took a third of the GPT
// training step. exp(-2u) overflows to +inf for very negative x, giving -0 as tanh's form does.
// The derivative: with s = 1 / (1 + exp(-2u)), d/dx = s + 2 x s (1 - s) du/dx.
template <class A>
inline A gelu_tanh_sigmoid(A x) {  // s = 0.5 (1 + tanh(u))
  constexpr A kSqrt2OverPi = A(0.7978845608028654);
  const A u = kSqrt2OverPi * (x + A(0.044715) * x * x * x);
  return A(1) / (A(1) + exp_acc(A(-2) * u));
}
template <class A>
inline A gelu_tanh(A x) {
  return x * gelu_tanh_sigmoid(x);
}
template <class A>
inline A gelu_tanh_backward(A g, A x) {
  constexpr A kSqrt2OverPi = A(0.7978845608028654);
  const A s = gelu_tanh_sigmoid(x);
  const A du = kSqrt2OverPi * (A(1) + A(3 * 0.044715) * x * x);
  return g * (s + A(2) * x * s * (A(1) - s) * du);
}

}  // namespace BOOSTER_CPU_ISA_NS
}  // namespace booster::cpu
