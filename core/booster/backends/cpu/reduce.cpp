// CPU reductions: sum, max, argmax over any set of dims.
//
// Note [Reduction geometry]
// The input's dims are split into kept dims (they index the output) and reduced dims, each group
// coalesced where the strides allow. Three loops then cover every case:
//   - row:    the innermost reduced dim is a run (contiguous when it has stride 1); one task per output
//             element reduces its runs with lane accumulators the compiler vectorizes;
//   - column: the innermost kept dim is contiguous in input and output (e.g. summing a [N, D] gradient
//             over N); each task owns a block of output columns and adds whole contiguous row pieces
//             into a block of accumulators, so memory is read once, in order;
//   - full:   a single output over one long run; threads reduce chunks into partials merged in order
//             (deterministic for a given thread count).
// float16/bfloat16 are converted block-wise to float32 (bulk converters) and accumulated there; integer
// and bool sums accumulate in int64. The output may be the input dtype, float32 (16-bit inputs, so a
// mean rounds once) or int64 (integer sums), chosen by the caller through out's dtype.
#include <cmath>
#include <limits>

#include "booster/backends/cpu/convert.h"
#include "booster/backends/cpu/loops.h"
#include "booster/kernels/elementwise.h"

namespace booster::cpu {
namespace {

using kernels::ReduceOp;

template <class T>
using reduce_acc_t = std::conditional_t<std::is_integral_v<T>, int64_t, acc_t<T>>;

template <class A>
struct SumOp {
  static constexpr A identity() { return A(0); }
  static A combine(A acc, A x) { return acc + x; }
};

template <class A>
struct MaxOp {
  static constexpr A identity() {
    if constexpr (std::is_floating_point_v<A>) return -std::numeric_limits<A>::infinity();
    else return std::numeric_limits<A>::lowest();
  }
  // NaN wins and stays (nothing compares greater than a NaN accumulator), as torch.max. A select the
  // compiler turns into compare + blend, so the lane loop vectorizes.
  static A combine(A acc, A x) {
    if constexpr (std::is_floating_point_v<A>) return ((x > acc) | (x != x)) ? x : acc;
    else return x > acc ? x : acc;
  }
};

constexpr int kLanes = 16;      // independent accumulators: lets the compiler vectorize a reduction

template <class Op, class A>
inline A reduce_lanes(const A* x, int64_t n, A init) {
  A lanes[kLanes];
  for (int j = 0; j < kLanes; ++j) lanes[j] = Op::identity();
  int64_t i = 0;
  if constexpr (std::is_same_v<Op, MaxOp<A>> && std::is_floating_point_v<A>) {
    // An ordered max (one compare + blend per lane) and a separate NaN flag: the NaN-propagating select
    // in MaxOp::combine does not vectorize.
    int32_t nan[kLanes] = {};
    for (; i + kLanes <= n; i += kLanes)
      for (int j = 0; j < kLanes; ++j) {
        const A v = x[i + j];
        lanes[j] = v > lanes[j] ? v : lanes[j];
        nan[j] |= int32_t(v != v);
      }
    int32_t any_nan = 0;
    for (int j = 0; j < kLanes; ++j) any_nan |= nan[j];
    if (any_nan) return std::numeric_limits<A>::quiet_NaN();
  } else {
    for (; i + kLanes <= n; i += kLanes)
      for (int j = 0; j < kLanes; ++j) lanes[j] = Op::combine(lanes[j], x[i + j]);
  }
  A r = init;
  for (int j = 0; j < kLanes; ++j) r = Op::combine(r, lanes[j]);
  for (; i < n; ++i) r = Op::combine(r, x[i]);
  return r;
}

// Reduces n elements at x with stride s into acc.
template <class Op, class T, class A>
inline A reduce_run(const T* x, int64_t n, int64_t s, A acc) {
  if (s == 1) {
    if constexpr (std::is_same_v<T, A>) {
      return reduce_lanes<Op, A>(x, n, acc);
    } else {
      A buf[kConvertBlock];
      for (int64_t b = 0; b < n; b += kConvertBlock) {
        const int64_t m = std::min(kConvertBlock, n - b);
        load_block<T, A>(x + b, buf, m);
        acc = reduce_lanes<Op, A>(buf, m, acc);
      }
      return acc;
    }
  }
  for (int64_t i = 0; i < n; ++i) acc = Op::combine(acc, A(x[i * s]));
  return acc;
}

struct Dims {
  std::vector<int64_t> sizes, in_strides, out_strides;  // outermost first
  int64_t count() const {
    int64_t n = 1;
    for (int64_t s : sizes) n *= s;
    return n;
  }
  void push(int64_t size, int64_t in_stride, int64_t out_stride) {
    if (!sizes.empty() && in_strides.back() == in_stride * size && out_strides.back() == out_stride * size) {
      sizes.back() *= size;
      in_strides.back() = in_stride;
      out_strides.back() = out_stride;
      return;
    }
    sizes.push_back(size);
    in_strides.push_back(in_stride);
    out_strides.push_back(out_stride);
  }
};

// Calls f(in_offset, out_offset) for every index of `d` in [begin, end) (row-major order).
template <class F>
void for_each_index(const Dims& d, int64_t begin, int64_t end, F&& f) {
  const size_t nd = d.sizes.size();
  if (nd == 0) {
    if (begin < end) f(int64_t(0), int64_t(0));
    return;
  }
  // Called once per output element by the row loop: no heap allocation for ordinary ranks.
  int64_t small[8];
  std::vector<int64_t> large;
  int64_t* idx = small;
  if (nd > 8) {
    large.resize(nd);
    idx = large.data();
  }
  int64_t r = begin, in_off = 0, out_off = 0;
  for (size_t k = nd; k-- > 0;) {
    idx[k] = r % d.sizes[k];
    r /= d.sizes[k];
    in_off += idx[k] * d.in_strides[k];
    out_off += idx[k] * d.out_strides[k];
  }
  for (int64_t i = begin; i < end; ++i) {
    f(in_off, out_off);
    for (size_t k = nd; k-- > 0;) {
      in_off += d.in_strides[k];
      out_off += d.out_strides[k];
      if (++idx[k] < d.sizes[k]) break;
      in_off -= d.sizes[k] * d.in_strides[k];
      out_off -= d.sizes[k] * d.out_strides[k];
      idx[k] = 0;
    }
  }
}

template <class Op, class T, class O>
void reduce_typed(const Tensor& a, const std::vector<int64_t>& dims, Tensor& out) {
  using A = reduce_acc_t<T>;
  const T* in = static_cast<const T*>(a.data_ptr());
  O* po = static_cast<O*>(out.data_ptr());
  if (out.numel() == 0) return;

  std::vector<bool> reduced(size_t(a.dim()), false);
  for (int64_t d : dims) reduced[size_t(d)] = true;
  Dims kept, red;
  for (int64_t d = 0; d < a.dim(); ++d) {
    const int64_t size = a.shape()[size_t(d)];
    if (size == 1) continue;
    if (reduced[size_t(d)]) red.push(size, a.strides()[size_t(d)], 0);
    else kept.push(size, a.strides()[size_t(d)], out.strides()[size_t(d)]);
  }
  const int64_t red_count = red.count();

  if (red.sizes.empty() || a.numel() == 0) {  // nothing to reduce: each output sees 0 or 1 element
    for_each_index(kept, 0, kept.count(), [&](int64_t io, int64_t oo) {
      po[oo] = O(red_count == 0 || a.numel() == 0 ? Op::identity() : A(in[io]));
    });
    return;
  }

  // Column case: the innermost kept dim is contiguous in both input and output.
  const bool column = !kept.sizes.empty() && kept.in_strides.back() == 1 && kept.out_strides.back() == 1 &&
                      red.in_strides.back() != 1;
  if (column) {
    constexpr int64_t kCols = 256;
    const int64_t ncols = kept.sizes.back();
    Dims outer = kept;
    outer.sizes.pop_back();
    outer.in_strides.pop_back();
    outer.out_strides.pop_back();
    const int64_t nblocks = (ncols + kCols - 1) / kCols;
    const int64_t tasks = outer.count() * nblocks;
    parallel_for(tasks, std::min(kCols, ncols) * red_count, [&](int64_t tb, int64_t te) {
      A acc[kCols];
      A buf[kCols];
      for (int64_t t = tb; t < te; ++t) {
        const int64_t c0 = (t % nblocks) * kCols, cn = std::min(kCols, ncols - c0);
        for_each_index(outer, t / nblocks, t / nblocks + 1, [&](int64_t io, int64_t oo) {
          for (int64_t j = 0; j < cn; ++j) acc[j] = Op::identity();
          for_each_index(red, 0, red_count, [&](int64_t ro, int64_t) {
            const T* row = in + io + ro + c0;
            if constexpr (std::is_same_v<T, A>) {
              for (int64_t j = 0; j < cn; ++j) acc[j] = Op::combine(acc[j], row[j]);
            } else {
              load_block<T, A>(row, buf, cn);
              for (int64_t j = 0; j < cn; ++j) acc[j] = Op::combine(acc[j], buf[j]);
            }
          });
          O* o = po + oo + c0;
          for (int64_t j = 0; j < cn; ++j) o[j] = O(acc[j]);
        });
      }
    });
    return;
  }

  // The innermost reduced dim is the run; the others are walked around it.
  const int64_t run_n = red.sizes.back(), run_s = red.in_strides.back();
  Dims red_outer = red;
  red_outer.sizes.pop_back();
  red_outer.in_strides.pop_back();
  red_outer.out_strides.pop_back();
  const int64_t nout = kept.count();

  if (nout == 1 && red_outer.sizes.empty()) {  // full reduction of one run: partials per thread
    const int nt = num_threads_for(run_n);
    std::vector<A> partial(size_t(nt), Op::identity());
    parallel_for(run_n, 1, [&](int64_t b, int64_t e) {
      partial[nt == 1 ? 0 : size_t(omp_get_thread_num())] = reduce_run<Op>(in + b * run_s, e - b, run_s, Op::identity());
    });
    A r = Op::identity();
    for (A p : partial) r = Op::combine(r, p);
    for_each_index(kept, 0, 1, [&](int64_t, int64_t oo) { po[oo] = O(r); });
    return;
  }

  parallel_for(nout, red_count, [&](int64_t ob, int64_t oe) {
    for_each_index(kept, ob, oe, [&](int64_t io, int64_t oo) {
      A acc = Op::identity();
      for_each_index(red_outer, 0, red_outer.count(),
                     [&](int64_t ro, int64_t) { acc = reduce_run<Op>(in + io + ro, run_n, run_s, acc); });
      po[oo] = O(acc);
    });
  });
}

// First index of the maximum along the one reduced dim (NaN counts as the maximum, as torch.argmax).
template <class T>
void argmax_typed(const Tensor& a, int64_t dim, Tensor& out) {
  using A = reduce_acc_t<T>;
  const T* in = static_cast<const T*>(a.data_ptr());
  int64_t* po = out.data<int64_t>();
  const int64_t n = a.shape()[size_t(dim)], s = a.strides()[size_t(dim)];
  Dims kept;
  for (int64_t d = 0; d < a.dim(); ++d)
    if (d != dim && a.shape()[size_t(d)] != 1) kept.push(a.shape()[size_t(d)], a.strides()[size_t(d)], out.strides()[size_t(d)]);
  parallel_for(kept.count(), n, [&](int64_t ob, int64_t oe) {
    for_each_index(kept, ob, oe, [&](int64_t io, int64_t oo) {
      const T* x = in + io;
      A best = A(x[0]);
      int64_t arg = 0;
      for (int64_t i = 1; i < n; ++i) {
        const A v = A(x[i * s]);
        if constexpr (std::is_floating_point_v<A>) {
          if (best != best) break;
          if (v > best || v != v) best = v, arg = i;
        } else {
          if (v > best) best = v, arg = i;
        }
      }
      po[oo] = arg;
    });
  });
}

template <class Op, class T>
void reduce_to(const Tensor& a, const std::vector<int64_t>& dims, Tensor& out) {
  const DType od = out.dtype();
  if (od == a.dtype()) return reduce_typed<Op, T, T>(a, dims, out);
  if constexpr (std::is_integral_v<T>) {
    if (od == DType::Int64) return reduce_typed<Op, T, int64_t>(a, dims, out);
  } else if constexpr (!std::is_same_v<T, acc_t<T>>) {
    if (od == DType::Float32) return reduce_typed<Op, T, float>(a, dims, out);
  }
  BOOSTER_FAIL(DTypeError, "reduce: cannot reduce ", a.dtype(), " into ", od);
}

void cpu_reduce(ReduceOp op, const Tensor& a, const std::vector<int64_t>& dims, Tensor& out) {
  BOOSTER_DISPATCH_ALL(a.dtype(), "reduce", [&] {
    using T = scalar_t;
    using A = reduce_acc_t<T>;
    switch (op) {
      case ReduceOp::Sum: return reduce_to<SumOp<A>, T>(a, dims, out);
      case ReduceOp::Max: return reduce_to<MaxOp<A>, T>(a, dims, out);
      case ReduceOp::Argmax:
        BOOSTER_CHECK(dims.size() == 1, ValueError, "argmax: reduces exactly one dim, got ", dims);
        return argmax_typed<T>(a, dims[0], out);
    }
  });
}

}  // namespace
}  // namespace booster::cpu

namespace booster::kernels {
BOOSTER_REGISTER_CPU_KERNEL(reduce_kernel, &cpu::cpu_reduce);
}  // namespace booster::kernels
