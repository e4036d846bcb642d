// The OCP 8-bit floats as storage types: float8_e4m3fn and float8_e5m2.
//
// Note [Float8 formats]
//   e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits. No infinity; S.1111.111 is NaN (one pattern
//           per sign), so the top binade reaches 448 = 1.75 * 2^8. Smallest subnormal 2^-9.
//   e5m2:   1 sign, 5 exponent (bias 15), 2 mantissa bits, IEEE-like: S.11111.00 is infinity, the
//           other all-ones exponents NaN. Largest finite 57344 = 1.75 * 2^15, smallest subnormal 2^-16.
// Converting from float32 (and so from float16/bfloat16, which widen to float32 exactly) rounds to
// nearest, ties to even, as if the exponent were unbounded; a result above the largest finite value
// overflows. Without saturation it becomes NaN (e4m3fn) or infinity (e5m2), as PyTorch's .to(); with
// saturation it becomes the largest finite value of that sign, infinities included (CUDA's
// __NV_SATFINITE, Transformer Engine's casts). NaN stays NaN in either mode, keeping its sign.
// Float8 tensors hold data: they convert to and from the other dtypes and move (copy, save, send),
// and computation happens after widening, as for PyTorch's float8 dtypes.
#pragma once

#include <cstdint>

#include "booster/tensor/half.h"

namespace booster {

namespace fp8 {

// Bit patterns of the formats (sign bit clear).
inline constexpr uint8_t kE4M3Max = 0x7e, kE4M3NaN = 0x7f;
inline constexpr uint8_t kE5M2Max = 0x7b, kE5M2Inf = 0x7c, kE5M2NaN = 0x7e;

// Exact decoding (every float8 value is a float32 value).
template <int kExp, int kMan, bool kFiniteOnly>
inline float bits_to_float(uint8_t b) {
  constexpr int kBias = (1 << (kExp - 1)) - 1;
  const uint32_t sign = uint32_t(b & 0x80) << 24;
  const uint32_t exp = (b >> kMan) & ((1u << kExp) - 1);
  const uint32_t man = b & ((1u << kMan) - 1);
  if constexpr (kFiniteOnly) {
    if ((b & 0x7f) == 0x7f) return bits_float(sign | 0x7fc00000u);
  } else if (exp == (1u << kExp) - 1) {
    return bits_float(sign | (man == 0 ? 0x7f800000u : 0x7fc00000u));
  }
  if (exp == 0) {  // zero or subnormal: man * 2^(1 - bias - kMan), exact in float32
    const float v = float(man) * bits_float(uint32_t(127 + 1 - kBias - kMan) << 23);
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 127 - kBias) << 23) | (man << (23 - kMan)));
}

// float32 -> float8, round to nearest even (Note [Float8 formats]).
template <int kExp, int kMan, bool kFiniteOnly>
inline uint8_t float_to_bits(float f, bool saturate) {
  constexpr int kBias = (1 << (kExp - 1)) - 1;
  constexpr int kEmin = 1 - kBias;  // exponent of the smallest normal
  constexpr uint32_t kMaxBits = kFiniteOnly ? kE4M3Max : kE5M2Max;
  constexpr uint32_t kOverflow = kFiniteOnly ? kE4M3NaN : kE5M2Inf;
  const uint32_t x = float_bits(f);
  const uint8_t sign = uint8_t((x >> 24) & 0x80);
  const uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | (kFiniteOnly ? kE4M3NaN : kE5M2NaN);
  const uint8_t overflow = sign | uint8_t(saturate ? kMaxBits : kOverflow);
  if (a == 0x7f800000u) return overflow;
  if (a < 0x00800000u) return sign;  // zero, or a float32 subnormal: far below half the smallest float8
  const int e = int(a >> 23) - 127;
  if (e > kBias + 1) return overflow;  // at least twice the top binade: no rounding brings it back
  // The significand with its implicit bit (24 bits) keeps kMan bits below the point, fewer for a
  // result that is subnormal in the float8 format; the dropped bits decide the rounding.
  const uint32_t sig = (a & 0x7fffffu) | 0x800000u;
  const int shift = 23 - kMan + (e < kEmin ? kEmin - e : 0);
  if (shift > 25) return sign;  // below a quarter of the smallest subnormal
  uint32_t q = sig >> shift;
  const uint32_t rest = sig & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (q & 1))) ++q;
  // Normal results carry the implicit bit in q, which adds the one to the exponent field; a rounding
  // carry moves into the exponent the same way, and subnormals become the smallest normal.
  const uint32_t bits = (uint32_t(e < kEmin ? 0 : e - kEmin) << kMan) + q;
  return bits > kMaxBits ? overflow : sign | uint8_t(bits);
}

inline float e4m3fn_to_float(uint8_t b) { return bits_to_float<4, 3, true>(b); }
inline float e5m2_to_float(uint8_t b) { return bits_to_float<5, 2, false>(b); }
inline uint8_t float_to_e4m3fn(float f, bool saturate) { return float_to_bits<4, 3, true>(f, saturate); }
inline uint8_t float_to_e5m2(float f, bool saturate) { return float_to_bits<5, 2, false>(f, saturate); }

}  // namespace fp8

// Construction from float rounds without saturating, as PyTorch's .to(torch.float8_*).
struct Float8E4M3FN {
  uint8_t bits = 0;
  Float8E4M3FN() = default;
  Float8E4M3FN(float f) : bits(fp8::float_to_e4m3fn(f, false)) {}  // NOLINT: implicit like a builtin float
  operator float() const { return fp8::e4m3fn_to_float(bits); }
  static Float8E4M3FN from_bits(uint8_t b) {
    Float8E4M3FN v;
    v.bits = b;
    return v;
  }
  static constexpr float kMax = 448.0f;
};

struct Float8E5M2 {
  uint8_t bits = 0;
  Float8E5M2() = default;
  Float8E5M2(float f) : bits(fp8::float_to_e5m2(f, false)) {}  // NOLINT
  operator float() const { return fp8::e5m2_to_float(bits); }
  static Float8E5M2 from_bits(uint8_t b) {
    Float8E5M2 v;
    v.bits = b;
    return v;
  }
  static constexpr float kMax = 57344.0f;
};

}  // namespace booster
