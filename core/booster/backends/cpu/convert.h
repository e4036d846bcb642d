// Bulk conversion between a storage type and its compute type, for CPU kernels.
//
// Note [16-bit kernels compute in float32 blocks]
// float16/bfloat16 kernels load a block of elements into float32 with one bulk conversion (F16C for
// float16, a shift for bfloat16; both vectorized, see tensor/half.cpp), compute on the float32 block
// with the same loop body the float32 kernel uses (so it vectorizes), and round the block back with
// one bulk conversion. Converting element by element instead (Half's operator float in the loop body)
// keeps the loop scalar: a float16 GELU ran 8x slower than the float32 one that way. Blocks of
// kConvertBlock elements stay in L1 and live on the stack.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "booster/tensor/dtype.h"
#include "booster/tensor/half.h"

#include "booster/backends/cpu/isa.h"

namespace booster::cpu {
inline namespace BOOSTER_CPU_ISA_NS {  // Note [One namespace per ISA build]

inline constexpr int64_t kConvertBlock = 512;

// dst[i] = A(src[i]) for n contiguous elements.
template <class T, class A>
inline void load_block(const T* src, A* dst, int64_t n) {
  if constexpr (std::is_same_v<T, Half> && std::is_same_v<A, float>) half_to_float(src, dst, n);
  else if constexpr (std::is_same_v<T, BFloat16> && std::is_same_v<A, float>) bf16_to_float(src, dst, n);
  else for (int64_t i = 0; i < n; ++i) dst[i] = A(src[i]);
}

// dst[i] = T(src[i]) for n contiguous elements (round to nearest even for 16-bit floats).
template <class A, class T>
inline void store_block(const A* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, Half> && std::is_same_v<A, float>) float_to_half(src, dst, n);
  else if constexpr (std::is_same_v<T, BFloat16> && std::is_same_v<A, float>) float_to_bf16(src, dst, n);
  else for (int64_t i = 0; i < n; ++i) dst[i] = T(src[i]);
}

template <class T>
inline constexpr bool is_16bit_float_v = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;

}  // namespace BOOSTER_CPU_ISA_NS
}  // namespace booster::cpu
