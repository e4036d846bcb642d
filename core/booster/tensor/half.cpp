// Bulk float16/bfloat16 <-> float32 conversions, with the loop picked at run time for the CPU
// (Note [CPU kernels per ISA level]): F16C (8 wide) or AVX-512 (16 wide) for float16; the bfloat16
// loops are plain C++ compiled three times so they vectorize at each width. Every path rounds to
// nearest even and keeps subnormals, infinities and NaN exactly as the portable soft:: conversions.
#include "booster/tensor/half.h"

#include "booster/common/cpu_features.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define BOOSTER_TARGET(isa) __attribute__((target(isa)))
#define BOOSTER_HAS_X86_PATHS 1
#endif

namespace booster {

namespace {

using HalfToFloat = void (*)(const Half*, float*, int64_t);
using FloatToHalf = void (*)(const float*, Half*, int64_t);
using Bf16ToFloat = void (*)(const BFloat16*, float*, int64_t);
using FloatToBf16 = void (*)(const float*, BFloat16*, int64_t);

void half_to_float_soft(const Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = soft::half_bits_to_float(src[i].bits);
}
void float_to_half_soft(const float* src, Half* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i].bits = soft::float_to_half_bits(src[i]);
}

// The bfloat16 loops, inlined into one function per ISA level.
[[gnu::always_inline]] inline void bf16_to_float_body(const BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = uint32_t(s[i]) << 16;
}
[[gnu::always_inline]] inline void float_to_bf16_body(const float* src, BFloat16* dst, int64_t n) {
  const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t x = s[i];
    const bool nan = (x & 0x7fffffffu) > 0x7f800000u;
    const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1)) >> 16;
    d[i] = nan ? uint16_t((x >> 16) | 0x0040) : uint16_t(rounded);
  }
}
void bf16_to_float_baseline(const BFloat16* src, float* dst, int64_t n) { bf16_to_float_body(src, dst, n); }
void float_to_bf16_baseline(const float* src, BFloat16* dst, int64_t n) { float_to_bf16_body(src, dst, n); }

#if defined(BOOSTER_HAS_X86_PATHS)
#define BOOSTER_AVX2 "avx2,fma,f16c,bmi,bmi2"
#define BOOSTER_AVX512 "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2"

BOOSTER_TARGET(BOOSTER_AVX2) void half_to_float_avx2(const Half* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i].bits);
}
BOOSTER_TARGET(BOOSTER_AVX2) void float_to_half_avx2(const float* src, Half* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i].bits = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}
BOOSTER_TARGET(BOOSTER_AVX512) void half_to_float_avx512(const Half* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  half_to_float_avx2(src + i, dst + i, n - i);
}
BOOSTER_TARGET(BOOSTER_AVX512) void float_to_half_avx512(const float* src, Half* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  float_to_half_avx2(src + i, dst + i, n - i);
}
// Note: AVX-512 BF16's VCVTNEPS2BF16 is not used: it flushes subnormal inputs to zero, where this
// library (and PyTorch's CPU conversion) keeps them; the integer loop below is exact and vectorizes.
BOOSTER_TARGET(BOOSTER_AVX2) void bf16_to_float_avx2(const BFloat16* src, float* dst, int64_t n) {
  bf16_to_float_body(src, dst, n);
}
BOOSTER_TARGET(BOOSTER_AVX2) void float_to_bf16_avx2(const float* src, BFloat16* dst, int64_t n) {
  float_to_bf16_body(src, dst, n);
}
BOOSTER_TARGET(BOOSTER_AVX512) void bf16_to_float_avx512(const BFloat16* src, float* dst, int64_t n) {
  bf16_to_float_body(src, dst, n);
}
BOOSTER_TARGET(BOOSTER_AVX512) void float_to_bf16_avx512(const float* src, BFloat16* dst, int64_t n) {
  float_to_bf16_body(src, dst, n);
}
#endif

struct Conversions {
  HalfToFloat half_to_float = half_to_float_soft;
  FloatToHalf float_to_half = float_to_half_soft;
  Bf16ToFloat bf16_to_float = bf16_to_float_baseline;
  FloatToBf16 float_to_bf16 = float_to_bf16_baseline;
};

Conversions pick() {
  Conversions c;
#if defined(BOOSTER_HAS_X86_PATHS)
  switch (cpu::isa_level()) {
    case cpu::IsaLevel::Avx512:
      c = {half_to_float_avx512, float_to_half_avx512, bf16_to_float_avx512, float_to_bf16_avx512};
      break;
    case cpu::IsaLevel::Avx2:
      c = {half_to_float_avx2, float_to_half_avx2, bf16_to_float_avx2, float_to_bf16_avx2};
      break;
    case cpu::IsaLevel::Baseline:
      break;
  }
#endif
  return c;
}

const Conversions& conversions() {
  static const Conversions c = pick();
  return c;
}

}  // namespace

void half_to_float(const Half* src, float* dst, int64_t n) { conversions().half_to_float(src, dst, n); }
void float_to_half(const float* src, Half* dst, int64_t n) { conversions().float_to_half(src, dst, n); }
void bf16_to_float(const BFloat16* src, float* dst, int64_t n) { conversions().bf16_to_float(src, dst, n); }
void float_to_bf16(const float* src, BFloat16* dst, int64_t n) { conversions().float_to_bf16(src, dst, n); }

}  // namespace booster
