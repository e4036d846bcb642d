// CUDA reductions: sum, max, argmax over any set of dims (kernels/elementwise.h contract; output dtype
// as on the CPU: the input's, float32 for 16-bit inputs, or int64 for integer sums).
//
// Note [CUDA reduction geometry]
// As on the CPU (Note [Reduction geometry]) the dims split into kept and reduced ones. Two kernels:
//   - block per output: a block of threads strides over one output's reduced elements (coalesced when
//     the innermost reduced dim is contiguous: row sums, softmax-like shapes, full reductions);
//   - whole: a contiguous input reduced to one value is split over many blocks into partials, which a
//     second one-block pass combines in a fixed order (deterministic);
//   - columns: the input is [R, N] row-major and the leading R rows are summed (bias gradients,
//     sum_to): threads own columns, so each warp reads contiguous row pieces; the rows are split over
//     blockIdx.y into float partials that a second small pass adds in a fixed order (deterministic).
#include <limits>

#include "booster/backends/cuda/common.cuh"
#include "booster/kernels/elementwise.h"

namespace booster::cuda {
namespace {

using kernels::ReduceOp;

template <class T>
using racc_t = std::conditional_t<std::is_integral_v<T>, int64_t, comp_t<T>>;

struct ReduceGeometry {
  int nkept = 0, nred = 0;
  int64_t kept_sizes[kMaxDims], kept_in_strides[kMaxDims], kept_out_strides[kMaxDims];
  int64_t red_sizes[kMaxDims], red_strides[kMaxDims];
  int64_t red_numel = 1;
};

// Full reductions of at least this many elements take two passes (flat_partial_kernel).
constexpr int64_t kFlatReduceMin = 4096;

template <class A>
__device__ __forceinline__ A max_combine(A acc, A x) {
  if constexpr (std::is_floating_point_v<A>) return ((x > acc) | (x != x)) ? x : acc;
  else return x > acc ? x : acc;
}

template <class A>
__device__ __forceinline__ A lowest() {
  if constexpr (std::is_floating_point_v<A>) return -INFINITY;
  else return std::numeric_limits<A>::lowest();
}

template <class T, class O>
__global__ void reduce_block_kernel(ReduceOp op, const T* in, O* out, int64_t nout, ReduceGeometry g) {
  using A = racc_t<T>;
  __shared__ A shared[32];
  __shared__ int64_t shared_idx[32];
  for (int64_t o = blockIdx.x; o < nout; o += gridDim.x) {
    int64_t base = 0, out_off = 0, rem = o;
    for (int d = g.nkept - 1; d >= 0; --d) {
      const int64_t i = rem % g.kept_sizes[d];
      rem /= g.kept_sizes[d];
      base += i * g.kept_in_strides[d];
      out_off += i * g.kept_out_strides[d];
    }
    A acc = op == ReduceOp::Sum ? A(0) : lowest<A>();
    int64_t acc_idx = 0;
    for (int64_t r = threadIdx.x; r < g.red_numel; r += blockDim.x) {
      int64_t off = base, rr = r;
      for (int d = g.nred - 1; d >= 0; --d) {
        off += (rr % g.red_sizes[d]) * g.red_strides[d];
        rr /= g.red_sizes[d];
      }
      const A x = load_as<A>(in[off]);
      if (op == ReduceOp::Sum) acc += x;
      else if (op == ReduceOp::Max) acc = max_combine(acc, x);
      else if ((x > acc || (x != x && acc == acc))) {  // argmax: first max, NaN counts as the max
        acc = x;
        acc_idx = r;
      }
    }
    if (op == ReduceOp::Sum) {
      acc = block_sum(acc, shared);
    } else if (op == ReduceOp::Max) {
      // NaN propagates through max_combine; a warp shuffle max would drop it, so reduce in shared.
      for (int s = 16; s > 0; s >>= 1) acc = max_combine(acc, __shfl_xor_sync(0xffffffffu, acc, s));
      __syncthreads();
      if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = acc;
      __syncthreads();
      if (threadIdx.x == 0)
        for (int w = 1; w < int(blockDim.x >> 5); ++w) acc = max_combine(acc, shared[w]);
    } else {
      __syncthreads();
      if (threadIdx.x < 32) {
        shared[threadIdx.x] = lowest<A>();
        shared_idx[threadIdx.x] = INT64_MAX;
      }
      __syncthreads();
      // Serialise per warp through shared memory: (value, index) with first-index tie breaking.
      for (int t = 0; t < int(blockDim.x); t += 32) {
        if (int(threadIdx.x) >= t && int(threadIdx.x) < t + 32) {
          const int slot = threadIdx.x - t;
          shared[slot] = acc;
          shared_idx[slot] = acc_idx;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
          for (int s = 0; s < 32 && t + s < int(blockDim.x); ++s) {
            const A v = shared[s];
            const int64_t vi = shared_idx[s];
            if (t + s == 0) { acc = v; acc_idx = vi; continue; }
            const bool v_nan = v != v, a_nan = acc != acc;
            if ((v_nan && !a_nan) || (!a_nan && v > acc) || ((v == acc || (v_nan && a_nan)) && vi < acc_idx)) {
              acc = v;
              acc_idx = vi;
            }
          }
        }
        __syncthreads();
      }
    }
    if (threadIdx.x == 0) {
      if (op == ReduceOp::Argmax) out[out_off] = O(acc_idx);
      else out[out_off] = store_as<O>(acc);
    }
    __syncthreads();
  }
}

// One block's share of a whole contiguous input (grid-stride), into partial[blockIdx.x]: the first
// pass of a full reduction (Note [CUDA reduction geometry]). Sum or Max; NaN propagates through Max.
template <class T>
__global__ void flat_partial_kernel(ReduceOp op, const T* in, int64_t n, racc_t<T>* partial) {
  using A = racc_t<T>;
  __shared__ A shared[32];
  A acc = op == ReduceOp::Sum ? A(0) : lowest<A>();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const A x = load_as<A>(in[i]);
    acc = op == ReduceOp::Sum ? acc + x : max_combine(acc, x);
  }
  if (op == ReduceOp::Sum) {
    acc = block_sum(acc, shared);
  } else {
    for (int s = 16; s > 0; s >>= 1) acc = max_combine(acc, __shfl_xor_sync(0xffffffffu, acc, s));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0)
      for (int w = 1; w < int(blockDim.x >> 5); ++w) acc = max_combine(acc, shared[w]);
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// Sums rows [R, N] (row-major) into partial[split][N] (float or int64 accumulators).
template <class T>
__global__ void column_sum_kernel(const T* in, int64_t rows, int64_t cols, racc_t<T>* partial) {
  using A = racc_t<T>;
  __shared__ A tile[8][33];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  A acc = A(0);
  if (c < cols)
    for (int64_t r = int64_t(blockIdx.y) * 8 + threadIdx.y; r < rows; r += int64_t(gridDim.y) * 8)
      acc += load_as<A>(in[r * cols + c]);
  tile[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    for (int y = 1; y < 8; ++y) acc += tile[y][threadIdx.x];
    partial[int64_t(blockIdx.y) * cols + c] = acc;
  }
}

template <class A, class O>
__global__ void sum_partials_kernel(const A* partial, int splits, int64_t cols, O* out) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  A acc = A(0);
  for (int s = 0; s < splits; ++s) acc += partial[int64_t(s) * cols + c];
  out[c] = store_as<O>(acc);
}

template <class T, class O>
void reduce_typed(ReduceOp op, const Tensor& a, const std::vector<int64_t>& dims, Tensor& out, int dev) {
  using A = racc_t<T>;
  const T* in = static_cast<const T*>(a.data_ptr());
  O* po = static_cast<O*>(out.data_ptr());
  const int64_t nout = out.numel();
  if (nout == 0) return;
  std::vector<bool> reduced(size_t(a.dim()), false);
  for (int64_t d : dims) reduced[size_t(d)] = true;

  // Column case: contiguous input, reduced dims are a prefix, contiguous output.
  int64_t prefix = 0;
  while (prefix < a.dim() && reduced[size_t(prefix)]) ++prefix;
  bool columns = op == ReduceOp::Sum && a.is_contiguous() && out.is_contiguous() && prefix == int64_t(dims.size()) &&
                 prefix > 0 && prefix < a.dim();
  if (columns) {
    int64_t rows = 1;
    for (int64_t d = 0; d < prefix; ++d) rows *= a.shape()[size_t(d)];
    const int64_t cols = a.numel() / std::max<int64_t>(rows, 1);
    columns = cols >= 32 && rows >= 64;
    if (columns) {
      const int64_t col_blocks = (cols + 31) / 32;
      const int64_t want = std::max<int64_t>(1, int64_t(sm_count(dev)) * 4 / col_blocks);
      const int splits = int(std::min<int64_t>({want, (rows + 7) / 8, 256}));
      Tensor partial = Tensor::empty({int64_t(splits), cols}, std::is_integral_v<A> ? DType::Int64 : DType::Float32,
                                     a.device());
      A* pp = static_cast<A*>(partial.data_ptr());
      column_sum_kernel<T><<<dim3(unsigned(col_blocks), unsigned(splits)), dim3(32, 8), 0, stream(dev)>>>(
          in, rows, cols, pp);
      BOOSTER_CUDA_CHECK_LAUNCH();
      sum_partials_kernel<A, O><<<unsigned((cols + 255) / 256), 256, 0, stream(dev)>>>(pp, splits, cols, po);
      BOOSTER_CUDA_CHECK_LAUNCH();
      return;
    }
  }

  // A whole contiguous input to one value (max(abs(x)) for a float8 scale, sum() of a tensor): a block
  // per output would leave one SM to read it all, so blocks reduce pieces into partials and one block
  // combines them, in a fixed order.
  if (op != ReduceOp::Argmax && nout == 1 && a.is_contiguous() && a.numel() >= kFlatReduceMin) {
    const int64_t n = a.numel();
    const int64_t blocks = std::min<int64_t>(int64_t(sm_count(dev)) * 4, (n + 2047) / 2048);
    Tensor partial = Tensor::empty({blocks}, dtype_of<A>::value, a.device());
    A* pp = static_cast<A*>(partial.data_ptr());
    flat_partial_kernel<T><<<unsigned(blocks), 256, 0, stream(dev)>>>(op, in, n, pp);
    BOOSTER_CUDA_CHECK_LAUNCH();
    ReduceGeometry pg;
    pg.nred = 1;
    pg.red_sizes[0] = blocks;
    pg.red_strides[0] = 1;
    pg.red_numel = blocks;
    reduce_block_kernel<A, O><<<1, 256, 0, stream(dev)>>>(op, pp, po, 1, pg);
    BOOSTER_CUDA_CHECK_LAUNCH();
    return;
  }

  ReduceGeometry g;
  std::vector<int64_t> ks, kis, kos, rs, rst;
  for (int64_t d = 0; d < a.dim(); ++d) {
    const int64_t size = a.shape()[size_t(d)];
    if (size == 1) continue;
    if (reduced[size_t(d)]) {
      rs.push_back(size);
      rst.push_back(a.strides()[size_t(d)]);
    } else {
      ks.push_back(size);
      kis.push_back(a.strides()[size_t(d)]);
      kos.push_back(out.strides()[size_t(d)]);
    }
  }
  BOOSTER_CHECK(ks.size() <= size_t(kMaxDims) && rs.size() <= size_t(kMaxDims), ShapeError,
                "CUDA reduce: too many dims in ", a.shape());
  g.nkept = int(ks.size());
  g.nred = int(rs.size());
  for (int i = 0; i < g.nkept; ++i) {
    g.kept_sizes[i] = ks[size_t(i)];
    g.kept_in_strides[i] = kis[size_t(i)];
    g.kept_out_strides[i] = kos[size_t(i)];
  }
  for (int i = 0; i < g.nred; ++i) {
    g.red_sizes[i] = rs[size_t(i)];
    g.red_strides[i] = rst[size_t(i)];
    g.red_numel *= rs[size_t(i)];
  }
  const int threads = g.red_numel >= 1024 ? 512 : g.red_numel >= 128 ? 128 : 32;
  const unsigned blocks = unsigned(std::min<int64_t>(nout, 65535 * 16));
  reduce_block_kernel<T, O><<<blocks, threads, 0, stream(dev)>>>(op, in, po, nout, g);
  BOOSTER_CUDA_CHECK_LAUNCH();
}

void cuda_reduce(ReduceOp op, const Tensor& a, const std::vector<int64_t>& dims, Tensor& out) {
  const int dev = device_of(out);
  BOOSTER_DISPATCH_ALL(a.dtype(), "reduce", [&] {
    using T = dev_t<scalar_t>;
    if (op == ReduceOp::Argmax) {
      BOOSTER_CHECK(out.dtype() == DType::Int64, DTypeError, "argmax: output must be int64, got ", out.dtype());
      if constexpr (!std::is_same_v<T, bool>) reduce_typed<T, int64_t>(op, a, dims, out, dev);
      else BOOSTER_FAIL(DTypeError, "argmax is not defined for bool tensors");
    } else if (out.dtype() == a.dtype()) {
      reduce_typed<T, T>(op, a, dims, out, dev);
    } else if (out.dtype() == DType::Float32) {
      reduce_typed<T, float>(op, a, dims, out, dev);
    } else if (out.dtype() == DType::Int64) {
      reduce_typed<T, int64_t>(op, a, dims, out, dev);
    } else {
      BOOSTER_FAIL(DTypeError, "reduce: cannot reduce ", a.dtype(), " into ", out.dtype());
    }
  });
}

}  // namespace
}  // namespace booster::cuda

namespace booster::kernels {
BOOSTER_REGISTER_CUDA_KERNEL(reduce_kernel, cuda::cuda_reduce);
}  // namespace booster::kernels
