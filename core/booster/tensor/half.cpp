#include "booster/tensor/half.h"

#if defined(__F16C__) || defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace booster {

void half_to_float(const Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) dst[i] = float(src[i]);
}

void float_to_half(const float* src, Half* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
#endif
  for (; i < n; ++i) dst[i] = Half(src[i]);
}

void bf16_to_float(const BFloat16* src, float* dst, int64_t n) {
  // A shift per element; the compiler vectorizes this loop.
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = uint32_t(s[i]) << 16;
}

void float_to_bf16(const float* src, BFloat16* dst, int64_t n) {
  const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t x = s[i];
    const bool nan = (x & 0x7fffffffu) > 0x7f800000u;
    const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1)) >> 16;
    d[i] = nan ? uint16_t((x >> 16) | 0x0040) : uint16_t(rounded);
  }
}

}  // namespace booster
