// Private helpers of the CPU neural-network kernels (softmax.cpp, layer_norm.cpp, batch_norm.cpp,
// dropout.cpp, attention.cpp, loss.cpp).
//
// The build compiles with -fno-trapping-math (see CMakeLists.txt): under GCC's default, the select in
// exp_f32's clamp may not be computed speculatively and loops calling it stay scalar.
//
// Note [Repeatable sums]
// Where a kernel reduces across rows (dweight, dbias, a loss's mean), each thread sums its own
// contiguous chunk and the partial sums are added in chunk order, so a run is repeatable for a given
// thread count.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "booster/backends/cpu/convert.h"
#include "booster/backends/cpu/loops.h"
#include "booster/backends/cpu/vec_math.h"
#include "booster/kernels/nn.h"

namespace booster::cpu {
inline namespace BOOSTER_CPU_ISA_NS {  // Note [One namespace per ISA build]

template <class T>
const T* cptr(const Tensor& t) {
  return static_cast<const T*>(t.data_ptr());
}
template <class T>
T* mptr(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// Like parallel_for, but f(chunk, begin, end) also learns its chunk index so it can write a partial
// result into its own slot. Returns the number of chunks.
template <class F>
int parallel_chunks(int64_t n, int64_t cost_per_item, F&& f) {
  const int nt = num_threads_for(n * std::max<int64_t>(cost_per_item, 1));
  if (nt <= 1) {
    f(0, int64_t(0), n);
    return 1;
  }
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    const int64_t chunk = (n + nt - 1) / nt;
    const int64_t b = std::min<int64_t>(n, t * chunk), e = std::min<int64_t>(n, b + chunk);
    if (b < e) f(t, b, e);
  }
  return nt;
}

// Sum over [0, n) of f(begin, end) computed per chunk, partials added in chunk order.
template <class F>
double parallel_sum(int64_t n, int64_t cost_per_item, F&& f) {
  const int max_chunks = std::max(1, num_threads_for(n * std::max<int64_t>(cost_per_item, 1)));
  std::vector<double> partial(size_t(max_chunks), 0.0);
  parallel_chunks(n, cost_per_item, [&](int c, int64_t b, int64_t e) { partial[size_t(c)] = f(b, e); });
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

}  // namespace BOOSTER_CPU_ISA_NS
}  // namespace booster::cpu
