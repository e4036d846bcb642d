// Strided N-d loops for CPU kernels: coalesce dims, run an inner 1-D loop, split across threads.
//
//   cpu::strided_loop<3>(out.shape(), {a.strides(), b.strides(), out.strides()},
//       [&](int64_t n, const int64_t* off, const int64_t* st) { ... n elements, offsets, strides ... });
//
// Offsets and strides are in elements. The inner callback sees the longest run the geometry allows,
// so contiguous tensors get one call per thread chunk with all strides 1 (the compiler vectorizes the
// body when it tests for that case).
#pragma once

#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "booster/tensor/tensor.h"

#include "booster/backends/cpu/isa.h"

namespace booster::cpu {
inline namespace BOOSTER_CPU_ISA_NS {  // Note [One namespace per ISA build]

// Note [The parallel grain]
// Work below the grain (elements, or elements times a per-element cost) stays on the calling thread:
// opening a parallel region costs a wake-up and a barrier, and on a busy machine the barrier waits for
// whichever thread the kernel has descheduled. Every CPU kernel splits through num_threads_for, so this
// is the one place the decision is made (PyTorch's at::parallel_for has the same rule with 32,768).
// BOOSTER_PARALLEL_GRAIN overrides the default (read once; bench/threads.sh measures values of it).
inline constexpr int64_t kParallelGrain = 32768;

inline int64_t parallel_grain() {
  static const int64_t grain = [] {
    const char* v = std::getenv("BOOSTER_PARALLEL_GRAIN");
    const long long g = v ? std::atoll(v) : 0;
    return g > 0 ? int64_t(g) : kParallelGrain;
  }();
  return grain;
}

inline int num_threads_for(int64_t work) {
  const int64_t grain = parallel_grain();
  if (work < grain || omp_in_parallel()) return 1;
  return int(std::min<int64_t>(omp_get_max_threads(), (work + grain - 1) / grain));
}

// Runs f(begin, end) over [0, n) split into contiguous chunks, one per thread.
template <class F>
void parallel_for(int64_t n, int64_t grain_cost_per_item, F&& f) {
  const int nt = num_threads_for(n * std::max<int64_t>(grain_cost_per_item, 1));
  if (nt <= 1) {
    f(int64_t(0), n);
    return;
  }
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    const int64_t chunk = (n + nt - 1) / nt;
    const int64_t b = std::min<int64_t>(n, t * chunk), e = std::min<int64_t>(n, b + chunk);
    if (b < e) f(b, e);
  }
}

template <size_t N>
struct Geometry {
  std::vector<int64_t> sizes;                  // coalesced, innermost last
  std::array<std::vector<int64_t>, N> strides;
};

template <size_t N>
Geometry<N> coalesce(const Shape& shape, const std::array<const Shape*, N>& strides) {
  Geometry<N> g;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    if (!g.sizes.empty()) {
      bool mergeable = true;
      for (size_t k = 0; k < N; ++k) mergeable &= g.strides[k].back() == (*strides[k])[d] * shape[d];
      if (mergeable) {
        g.sizes.back() *= shape[d];
        for (size_t k = 0; k < N; ++k) g.strides[k].back() = (*strides[k])[d];
        continue;
      }
    }
    g.sizes.push_back(shape[d]);
    for (size_t k = 0; k < N; ++k) g.strides[k].push_back((*strides[k])[d]);
  }
  if (g.sizes.empty()) {  // a scalar or all-ones shape: one element
    g.sizes.push_back(1);
    for (size_t k = 0; k < N; ++k) g.strides[k].push_back(0);
  }
  return g;
}

template <size_t N, class F>
void strided_loop(const Shape& shape, const std::array<const Shape*, N>& strides, F&& f) {
  const int64_t total = numel_of(shape);
  if (total == 0) return;
  const Geometry<N> g = coalesce<N>(shape, strides);
  const int64_t nd = int64_t(g.sizes.size());
  const int64_t inner = g.sizes[nd - 1];
  std::array<int64_t, N> inner_stride;
  for (size_t k = 0; k < N; ++k) inner_stride[k] = g.strides[k][nd - 1];

  // Rows = product of the outer dims; each row is one inner run. A single long row is cut in pieces.
  const int64_t rows = total / inner;
  if (rows == 1) {
    parallel_for(inner, 1, [&](int64_t b, int64_t e) {
      std::array<int64_t, N> off;
      for (size_t k = 0; k < N; ++k) off[k] = b * inner_stride[k];
      f(e - b, off.data(), inner_stride.data());
    });
    return;
  }
  parallel_for(rows, inner, [&](int64_t rb, int64_t re) {
    // Coordinates of row rb in the outer dims.
    std::vector<int64_t> idx(size_t(nd - 1), 0);
    int64_t r = rb;
    for (int64_t d = nd - 2; d >= 0; --d) {
      idx[size_t(d)] = r % g.sizes[size_t(d)];
      r /= g.sizes[size_t(d)];
    }
    std::array<int64_t, N> off{};
    for (size_t k = 0; k < N; ++k)
      for (int64_t d = 0; d < nd - 1; ++d) off[k] += idx[size_t(d)] * g.strides[k][size_t(d)];
    for (int64_t row = rb; row < re; ++row) {
      f(inner, off.data(), inner_stride.data());
      // Advance the odometer.
      for (int64_t d = nd - 2; d >= 0; --d) {
        const size_t ud = size_t(d);
        if (++idx[ud] < g.sizes[ud]) {
          for (size_t k = 0; k < N; ++k) off[k] += g.strides[k][ud];
          break;
        }
        for (size_t k = 0; k < N; ++k) off[k] -= (g.sizes[ud] - 1) * g.strides[k][ud];
        idx[ud] = 0;
      }
    }
  });
}

}  // namespace BOOSTER_CPU_ISA_NS
}  // namespace booster::cpu
