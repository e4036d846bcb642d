// The CPU process groups' host arithmetic (reduce_impl.h): element-wise combination and Avg's division.
#include "booster/distributed/reduce_impl.h"

#include <algorithm>
#include <type_traits>

#include "booster/common/error.h"
#include "booster/tensor/half.h"

namespace booster::distributed::detail {

namespace {

template <class T>
void reduce_plain(T* dst, const T* src, int64_t n, ReduceOp op) {
  if (op == ReduceOp::Max) {
    for (int64_t i = 0; i < n; ++i) dst[i] = src[i] > dst[i] ? src[i] : dst[i];
  } else if (op == ReduceOp::Min) {
    for (int64_t i = 0; i < n; ++i) dst[i] = src[i] < dst[i] ? src[i] : dst[i];
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
  }
}

template <class Half16>
void to_float(const Half16* in, float* out, int64_t n) {
  if constexpr (std::is_same_v<Half16, Half>) half_to_float(in, out, n);
  else bf16_to_float(in, out, n);
}

template <class Half16>
void from_float(const float* in, Half16* out, int64_t n) {
  if constexpr (std::is_same_v<Half16, Half>) float_to_half(in, out, n);
  else float_to_bf16(in, out, n);
}

// Widen a block to float32, combine, round back.
template <class Half16>
void reduce_16bit(Half16* dst, const Half16* src, int64_t n, ReduceOp op) {
  constexpr int64_t kBlock = 256;
  float a[kBlock], b[kBlock];
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t m = std::min(kBlock, n - start);
    to_float(src + start, a, m);
    to_float(dst + start, b, m);
    reduce_plain(b, a, m, op);
    from_float(b, dst + start, m);
  }
}

template <class T>
void divide_plain(T* p, int64_t n, int divisor) {
  const T d = T(divisor);
  for (int64_t i = 0; i < n; ++i) p[i] /= d;
}

template <class Half16>
void divide_16bit(Half16* p, int64_t n, int divisor) {
  constexpr int64_t kBlock = 1024;
  float tmp[kBlock];
  const float d = float(divisor);
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t m = std::min(kBlock, n - start);
    to_float(p + start, tmp, m);
    for (int64_t i = 0; i < m; ++i) tmp[i] /= d;
    from_float(tmp, p + start, m);
  }
}

}  // namespace

void reduce_into(void* dst, const void* src, int64_t n, DType dtype, ReduceOp op, const char* who) {
  switch (dtype) {
    case DType::Float32: return reduce_plain(static_cast<float*>(dst), static_cast<const float*>(src), n, op);
    case DType::Float64: return reduce_plain(static_cast<double*>(dst), static_cast<const double*>(src), n, op);
    case DType::Int32: return reduce_plain(static_cast<int32_t*>(dst), static_cast<const int32_t*>(src), n, op);
    case DType::Int64: return reduce_plain(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), n, op);
    case DType::Float16: return reduce_16bit(static_cast<Half*>(dst), static_cast<const Half*>(src), n, op);
    case DType::BFloat16:
      return reduce_16bit(static_cast<BFloat16*>(dst), static_cast<const BFloat16*>(src), n, op);
    default: BOOSTER_FAIL(DTypeError, who, ": cannot reduce ", dtype, "; use an integer or floating dtype");
  }
}

void divide_by(void* data, int64_t n, DType dtype, int divisor) {
  switch (dtype) {
    case DType::Float32: return divide_plain(static_cast<float*>(data), n, divisor);
    case DType::Float64: return divide_plain(static_cast<double*>(data), n, divisor);
    case DType::Float16: return divide_16bit(static_cast<Half*>(data), n, divisor);
    case DType::BFloat16: return divide_16bit(static_cast<BFloat16*>(data), n, divisor);
    default: BOOSTER_FAIL(DTypeError, "all_reduce: avg of ", dtype, " is not supported");
  }
}

}  // namespace booster::distributed::detail
