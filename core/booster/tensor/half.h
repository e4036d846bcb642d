// float16 and bfloat16 as real storage types.
//
// Note [Low-precision storage on the CPU]
// Values are stored as 16-bit patterns and converted with round-to-nearest-even, keeping subnormals,
// infinities and NaN as IEEE-754 does. Every kernel loads them into float32, computes there, and rounds
// the result back, so overflow, underflow and rounding on the CPU are the ones a GPU would show. That is
// what lets loss scaling be tested without a GPU. float16 uses F16C where the compiler targets it.
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace booster {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Portable conversions, always compiled so tests can check them on machines with F16C too.
namespace soft {

// IEEE binary16 -> binary32, exact.
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp == 0) {
    if (man == 0) return bits_float(sign);
    // subnormal: value = man * 2^-24
    float v = float(man) * bits_float(0x33800000u);  // 2^-24
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112) << 23) | (man << 13));
}

// binary32 -> binary16, round to nearest even, overflow to inf, NaN stays NaN.
inline uint16_t float_to_half_bits(float f) {
  uint32_t x = float_bits(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | (x > 0x7f800000u ? 0x7e00 : 0x7c00);
  if (x >= 0x477ff000u) return sign | 0x7c00;  // rounds to >= 65520 -> inf
  if (x < 0x38800000u) {                       // below smallest normal half: subnormal or zero
    // Adding 0.5 (2^-1) aligns the half-subnormal ulp (2^-24) to the float ulp so the FPU rounds.
    float v = bits_float(x) + 0.5f;
    return sign | uint16_t(float_bits(v) - 0x3f000000u);
  }
  const uint32_t odd = (x >> 13) & 1;
  x += 0xc8000fffu + odd;  // rebias exponent (-112 << 23) and round to nearest even
  return sign | uint16_t(x >> 13);
}

}  // namespace soft

inline float half_bits_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return soft::half_bits_to_float(h);
#endif
}

inline uint16_t float_to_half_bits(float f) {
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  return soft::float_to_half_bits(f);
#endif
}

inline float bf16_bits_to_float(uint16_t b) { return bits_float(uint32_t(b) << 16); }

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x0040);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1);
  return uint16_t(x >> 16);
}

struct Half {
  uint16_t bits = 0;
  Half() = default;
  Half(float f) : bits(float_to_half_bits(f)) {}  // NOLINT: implicit like a builtin float type
  operator float() const { return half_bits_to_float(bits); }
  static Half from_bits(uint16_t b) {
    Half h;
    h.bits = b;
    return h;
  }
};

struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  BFloat16(float f) : bits(float_to_bf16_bits(f)) {}  // NOLINT
  operator float() const { return bf16_bits_to_float(bits); }
  static BFloat16 from_bits(uint16_t b) {
    BFloat16 h;
    h.bits = b;
    return h;
  }
};

// Bulk conversions (vectorized where the CPU allows). Defined in half.cpp.
void half_to_float(const Half* src, float* dst, int64_t n);
void float_to_half(const float* src, Half* dst, int64_t n);
void bf16_to_float(const BFloat16* src, float* dst, int64_t n);
void float_to_bf16(const float* src, BFloat16* dst, int64_t n);

}  // namespace booster
