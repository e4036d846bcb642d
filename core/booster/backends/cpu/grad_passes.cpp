// CPU fused gradient passes (kernels/fused.h): unscale + inf/NaN check, sum of squares for the
// gradient norm, zero counts. One call per flat span; results go into a scalar the caller reads once
// (Note [Fused gradient passes] in mixed_precision/mixed_precision.h).
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#include "booster/backends/cpu/convert.h"
#include "booster/backends/cpu/isa.h"
#include "booster/backends/cpu/loops.h"
#include "booster/kernels/fused.h"

namespace booster::cpu {
namespace {

// Branch-free "is inf or NaN": all exponent bits set. ORed over a run, so the loop vectorizes.
inline uint32_t nonfinite_bit(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return uint32_t((u & 0x7f800000u) == 0x7f800000u);
}

template <class S, class D>
uint32_t unscale_run(const S* __restrict src, D* __restrict dst, int64_t n, float inv_scale) {
  uint32_t bad = 0;
  if constexpr (is_16bit_float_v<S> && std::is_same_v<D, float>) {
    // 16-bit gradients into float32 masters: one bulk conversion into dst, then the loop below on
    // float32 in place (converting element by element keeps it scalar; Note [16-bit kernels compute
    // in float32 blocks]).
    load_block(src, dst, n);
    for (int64_t i = 0; i < n; ++i) {
      bad |= nonfinite_bit(dst[i]);
      dst[i] *= inv_scale;
    }
    return bad;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float v = float(src[i]);
    bad |= nonfinite_bit(v);
    dst[i] = D(v * inv_scale);
  }
  return bad;
}

// In place: src and dst alias, so no __restrict.
template <class S>
uint32_t unscale_inplace_run(S* data, int64_t n, float inv_scale) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = float(data[i]);
    bad |= nonfinite_bit(v);
    data[i] = S(v * inv_scale);
  }
  return bad;
}

// A check alone reads the bits: a 16-bit value is inf/NaN when its exponent field is all ones, so
// nothing is converted and the loop vectorizes as for float32.
template <class S>
uint32_t check_run(const S* src, int64_t n) {
  uint32_t bad = 0;
  if constexpr (std::is_same_v<S, Half> || std::is_same_v<S, BFloat16>) {
    constexpr uint16_t exponent = std::is_same_v<S, Half> ? 0x7c00 : 0x7f80;
    for (int64_t i = 0; i < n; ++i) bad |= uint32_t((src[i].bits & exponent) == exponent);
  } else {
    for (int64_t i = 0; i < n; ++i) bad |= nonfinite_bit(float(src[i]));
  }
  return bad;
}

template <class F>
void dispatch_grad(const Tensor& t, F&& f) {
  switch (t.dtype()) {
    case DType::Float32: return f(t.data<float>());
    case DType::Float16: return f(t.data<Half>());
    case DType::BFloat16: return f(t.data<BFloat16>());
    default: BOOSTER_FAIL(DTypeError, "gradient pass: expected float32, float16 or bfloat16, got ", t.dtype());
  }
}

void cpu_unscale_check(const Tensor& src, const Tensor& dst, float inv_scale, Tensor& found) {
  const int64_t n = src.numel();
  const bool in_place = dst.data_ptr() == src.data_ptr();
  const bool identity = inv_scale == 1.0f;
  BOOSTER_CHECK(in_place || dst.dtype() == DType::Float32, DTypeError,
                "fused_unscale_and_check: destination must be float32 or the source itself, got ", dst.dtype());
  std::atomic<uint32_t> any{0};
  dispatch_grad(src, [&](auto* s) {
    using S = std::remove_pointer_t<decltype(s)>;
    parallel_for(n, 1, [&](int64_t b, int64_t e) {
      uint32_t bad;
      if (in_place) bad = identity ? check_run(s + b, e - b) : unscale_inplace_run(s + b, e - b, inv_scale);
      else bad = unscale_run<S, float>(s + b, dst.data<float>() + b, e - b, inv_scale);
      if (bad) any.store(1, std::memory_order_relaxed);
    });
  });
  if (any.load()) *found.data<int32_t>() = 1;
}

// Sum of squares of a run in float32 lanes, returned in double (chunks are short enough that float32
// lanes lose nothing that matters for a clipping threshold).
template <class S>
double sum_squares_run(const S* x, int64_t n) {
  constexpr int kLanes = 16;
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float v = float(x[i + l]);
      acc[l] += v * v;
    }
  double total = 0;
  for (; i < n; ++i) total += double(float(x[i])) * double(float(x[i]));
  for (int l = 0; l < kLanes; ++l) total += acc[l];
  return total;
}

constexpr int64_t kNormChunk = 1 << 14;

void cpu_sum_squares(const Tensor& t, Tensor& acc) {
  const int64_t n = t.numel();
  if (n == 0) return;
  dispatch_grad(t, [&](auto* x) {
    const int64_t chunks = (n + kNormChunk - 1) / kNormChunk;
    std::vector<double> partial(size_t(chunks), 0.0);
    parallel_for(chunks, kNormChunk, [&](int64_t b, int64_t e) {
      for (int64_t c = b; c < e; ++c) {
        const int64_t lo = c * kNormChunk, hi = std::min(n, lo + kNormChunk);
        partial[size_t(c)] = sum_squares_run(x + lo, hi - lo);
      }
    });
    double& total = *acc.data<double>();
    for (double p : partial) total += p;  // fixed order: the same norm on any thread count
  });
}

void cpu_count_zeros(const Tensor& t, Tensor& acc) {
  dispatch_grad(t, [&](auto* x) {
    std::atomic<int64_t> count{0};
    parallel_for(t.numel(), 1, [&](int64_t b, int64_t e) {
      int64_t local = 0;
      for (int64_t i = b; i < e; ++i) local += float(x[i]) == 0.0f;
      count.fetch_add(local, std::memory_order_relaxed);
    });
    *acc.data<int64_t>() += count.load();
  });
}

}  // namespace
}  // namespace booster::cpu

namespace booster::kernels {
BOOSTER_REGISTER_CPU_KERNEL(unscale_check_kernel, &cpu::cpu_unscale_check);
BOOSTER_REGISTER_CPU_KERNEL(sum_squares_kernel, &cpu::cpu_sum_squares);
BOOSTER_REGISTER_CPU_KERNEL(count_zeros_kernel, &cpu::cpu_count_zeros);
}  // namespace booster::kernels
