// CUDA batch normalisation (kernels/nn.h: batch_norm_kernel, batch_norm_backward_kernel) with the CPU
// kernel's semantics (backends/cpu/batch_norm.cpp), computing in float32 for 16-bit inputs (float64 for
// float64) and rounding once to the output dtype.
//
// Note [CUDA batch norm]
// x is [N, C, L] contiguous: channel c owns N runs of L elements, C * L apart. Every per-channel
// reduction runs in two launches. The first writes partial states [splits, C, lanes] in double (Note
// [CUDA batch-norm sums in double]); the second folds one channel's partials per block, in a fixed order (so results do not
// depend on timing), and turns them into per-channel coefficients. Two layouts feed the first:
//  * long runs (L >= 32): grid (C, splits), 2-D blocks with threadIdx.x along l (coalesced) and
//    threadIdx.y along n; the splits cut n, and l as well when N alone gives too few blocks (a small
//    batch of large images). One partial per (split, channel): lanes = 1.
//  * short runs (L < 32, including 2-D input, L = 1): x is an [N, C * L] matrix whose column c * L + l
//    belongs to channel c; blocks of 32 columns x 8 rows read along columns (coalesced), the splits
//    cut the rows. One partial per (split, column): lanes = L.
// Batch statistics use Welford's update and Chan's merge of (count, mean, M2), so the variance never
// suffers the cancellation of sum(x^2) - sum(x)^2 / M (the CPU kernel shifts by the channel's first
// value for the same reason). The outputs then fold into one multiply-add per element, as on the CPU:
//   forward   y  = scale * x + shift,        scale = rstd * w, shift = b - mean * scale
//   backward  dx = a * g + b * x + d          (training; eval: a = w * rstd, b = d = 0)
// from sum(g) and sum(g * (x - mean)) per channel, which also give dbias and dweight.
//
// Note [CUDA batch-norm sums in double]
// A thread accumulates in the compute type, but over at most kPerThread elements: the plan adds
// splits until no thread runs longer (within the grid's 65,535 splits: 33M rows of 2-D input). Every state is widened to double before threads are merged, and
// the partials, their folding and the per-channel coefficients are double, so the error of a channel's
// statistics does not grow with its M = N * L values (a float32 running state errs by up to about M u;
// on the CPU, Note [Batch-norm sums in double]). The per-element work stays in the compute type: no
// double arithmetic per element, which GPUs without fast float64 would pay for.
#include <limits>

#include "booster/backends/cuda/common.cuh"
#include "booster/kernels/nn.h"

namespace booster::cuda {
namespace {

template <class T>
const dev_t<T>* cptr(const Tensor& t) {
  return static_cast<const dev_t<T>*>(t.data_ptr());
}
template <class T>
dev_t<T>* mptr(const Tensor& t) {
  return t.defined() ? static_cast<dev_t<T>*>(t.data_ptr()) : nullptr;
}
template <class C>
C* cmptr(const Tensor& t) {
  return t.defined() ? static_cast<C*>(t.data_ptr()) : nullptr;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------- partial states
// Plain aggregates (no default member initializers), so they can live in __shared__ arrays.

// Welford's running (count, mean, M2 = sum of squared deviations).
template <class C>
struct Welford {
  C n, mean, m2;
  using Wide = Welford<double>;

  __device__ static Welford identity() { return {C(0), C(0), C(0)}; }
  __device__ void push(C x) {
    n += C(1);
    const C d = x - mean;
    mean += d / n;
    m2 += d * (x - mean);
  }
  // Chan et al.'s pairwise combination.
  __device__ static Welford merge(const Welford& a, const Welford& b) {
    if (b.n == C(0)) return a;
    if (a.n == C(0)) return b;
    const C n = a.n + b.n, d = b.mean - a.mean, fb = b.n / n;
    return {n, a.mean + d * fb, a.m2 + b.m2 + d * d * a.n * fb};
  }
  __device__ Welford shfl_xor(int lane_mask) const {
    return {__shfl_xor_sync(0xffffffffu, n, lane_mask), __shfl_xor_sync(0xffffffffu, mean, lane_mask),
            __shfl_xor_sync(0xffffffffu, m2, lane_mask)};
  }
  __device__ Wide wide() const { return {double(n), double(mean), double(m2)}; }
};

// sum(g) and sum(g * (x - mean)) of one channel.
template <class C>
struct GradSums {
  C g, gxc;
  using Wide = GradSums<double>;

  __device__ static GradSums identity() { return {C(0), C(0)}; }
  __device__ static GradSums merge(const GradSums& a, const GradSums& b) { return {a.g + b.g, a.gxc + b.gxc}; }
  __device__ GradSums shfl_xor(int lane_mask) const {
    return {__shfl_xor_sync(0xffffffffu, g, lane_mask), __shfl_xor_sync(0xffffffffu, gxc, lane_mask)};
  }
  __device__ Wide wide() const { return {double(g), double(gxc)}; }
};

// What the first launch accumulates from element i of channel c.
template <class T>
struct BatchStatsOp {
  using C = comp_t<T>;
  using State = Welford<C>;
  const T* x;
  __device__ void push(State& s, int64_t i, int64_t /*c*/) const { s.push(load_as<C>(x[i])); }
};

template <class T>
struct GradSumsOp {
  using C = comp_t<T>;
  using State = GradSums<C>;
  const T* g;
  const T* x;
  const C* mean;
  __device__ void push(State& s, int64_t i, int64_t c) const {
    const C gv = load_as<C>(g[i]);
    s.g += gv;
    s.gxc += gv * (load_as<C>(x[i]) - mean[c]);
  }
};

// Merges the states of the whole block (any 2-D shape of a multiple of 32 threads, at most 1024);
// the result is valid in thread (0, 0).
template <class S>
__device__ S block_merge(S v, S* shared /* 32 states */) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = S::merge(v, v.shfl_xor(o));
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warps = (blockDim.x * blockDim.y) >> 5;
  __syncthreads();  // the previous use of `shared` (a loop over channels) is done
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? shared[lane] : S::identity();
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = S::merge(v, v.shfl_xor(o));
  }
  return v;
}

// Long runs: block (c, y) takes channel c, rows n = sn * blockDim.y + threadIdx.y (step s_n *
// blockDim.y) and columns [l0, l0 + l_chunk) of each row, where y = sl * s_n + sn. Writes part[y, c].
template <class Op>
__global__ void channel_partials_rows_kernel(Op op, int64_t N, int64_t C, int64_t L, int64_t s_n, int64_t l_chunk,
                                             typename Op::State::Wide* part) {
  using S = typename Op::State;
  using W = typename S::Wide;
  __shared__ W shared[32];
  const int64_t c = blockIdx.x, y = blockIdx.y;
  const int64_t sn = y % s_n, sl = y / s_n;
  const int64_t l0 = sl * l_chunk, l1 = min(L, l0 + l_chunk);
  S s = S::identity();
  for (int64_t n = sn * blockDim.y + threadIdx.y; n < N; n += s_n * blockDim.y) {
    const int64_t base = (n * C + c) * L;
    for (int64_t l = l0 + threadIdx.x; l < l1; l += blockDim.x) op.push(s, base + l, c);
  }
  const W merged = block_merge(s.wide(), shared);  // Note [CUDA batch-norm sums in double]
  if (threadIdx.x == 0 && threadIdx.y == 0) part[y * C + c] = merged;
}

// Short runs: block (bx, y) of 32 x 8 threads takes columns bx * 32 + threadIdx.x of the [N, C * L]
// matrix and rows y * 8 + threadIdx.y (step gridDim.y * 8). Writes part[y, column].
template <class Op>
__global__ void channel_partials_columns_kernel(Op op, int64_t N, int64_t L, int64_t cols,
                                                typename Op::State::Wide* part) {
  using S = typename Op::State;
  using W = typename S::Wide;
  __shared__ W rows[8][32];
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x;
  S s = S::identity();
  if (col < cols) {
    const int64_t c = col / L;
    for (int64_t n = int64_t(blockIdx.y) * 8 + threadIdx.y; n < N; n += int64_t(gridDim.y) * 8)
      op.push(s, n * cols + col, c);
  }
  W w = s.wide();  // Note [CUDA batch-norm sums in double]
  rows[threadIdx.y][threadIdx.x] = w;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    for (int r = 1; r < 8; ++r) w = W::merge(w, rows[r][threadIdx.x]);
    part[int64_t(blockIdx.y) * cols + col] = w;
  }
}

// A block per channel folds part[(split * C + c) * lanes + lane] over every split and lane, then
// thread 0 hands the channel's state to `finish`.
template <class S, class Finish>
__global__ void channel_finish_kernel(const S* part, int64_t C, int64_t splits, int64_t lanes, Finish finish) {
  __shared__ S shared[32];
  const int64_t per_channel = splits * lanes;
  for (int64_t c = blockIdx.x; c < C; c += gridDim.x) {
    S s = S::identity();
    for (int64_t j = threadIdx.x; j < per_channel; j += blockDim.x) {
      const int64_t split = j / lanes, lane = j - split * lanes;
      s = S::merge(s, part[(split * C + c) * lanes + lane]);
    }
    s = block_merge(s, shared);
    if (threadIdx.x == 0) finish(c, s);
  }
}

// The most elements one thread of the first launch accumulates in the compute type (Note [CUDA
// batch-norm sums in double]).
constexpr int64_t kPerThread = 64;

// How the first launch is laid out (Note [CUDA batch norm]).
struct PartialPlan {
  bool rows = false;
  dim3 grid, block;
  int64_t s_n = 1, l_chunk = 0;  // rows kernel only
  int64_t splits = 1, lanes = 1;
  int64_t states(int64_t C) const { return splits * C * lanes; }
};

PartialPlan plan_partials(int dev, int64_t N, int64_t C, int64_t L) {
  constexpr int64_t kMaxGridY = 65535;
  const int64_t target_blocks = int64_t(sm_count(dev)) * 8;
  PartialPlan p;
  if (L >= 32) {
    const int bx = L >= 256 ? 256 : L >= 128 ? 128 : L >= 64 ? 64 : 32, by = 256 / bx;
    BOOSTER_CHECK(C <= INT32_MAX, ShapeError, "batch_norm: ", C, " channels exceed the CUDA grid");
    const int64_t want = ceil_div(target_blocks, C);
    p.rows = true;
    p.s_n = std::max<int64_t>(1, std::min({want, ceil_div(N, by), kMaxGridY}));
    // Cut the rows too when the batch alone leaves the GPU idle, keeping >= 4 block widths per piece.
    int64_t s_l =
        std::max<int64_t>(1, std::min({ceil_div(want, p.s_n), L / (4 * int64_t(bx)), kMaxGridY / p.s_n}));
    // Then enough pieces that no thread takes more than kPerThread elements (l first, then n), within
    // the grid's limit.
    s_l = std::max(s_l, std::min(ceil_div(L, int64_t(bx) * kPerThread), kMaxGridY));
    const int64_t per_row = ceil_div(ceil_div(L, s_l), bx);
    const int64_t rows_per_thread = std::max<int64_t>(1, kPerThread / per_row);
    p.s_n = std::max(p.s_n, std::min(ceil_div(N, by * rows_per_thread), std::max<int64_t>(1, kMaxGridY / s_l)));
    p.l_chunk = ceil_div(L, s_l);
    p.splits = p.s_n * s_l;
    p.lanes = 1;
    p.grid = dim3(unsigned(C), unsigned(p.splits));
    p.block = dim3(unsigned(bx), unsigned(by));
  } else {
    // At least one block: with L == 0 (an empty eval batch) every partial is the identity and the
    // finish still writes each channel's result (zero weight and bias gradients, as on the CPU).
    const int64_t cols = C * L, col_blocks = std::max<int64_t>(1, ceil_div(cols, 32));
    BOOSTER_CHECK(col_blocks <= INT32_MAX, ShapeError, "batch_norm: ", cols, " columns exceed the CUDA grid");
    p.splits = std::max<int64_t>(1, std::min({ceil_div(target_blocks, col_blocks), ceil_div(N, 8), kMaxGridY}));
    p.splits = std::max(p.splits, std::min(ceil_div(N, 8 * kPerThread), kMaxGridY));  // <= kPerThread rows a thread
    p.lanes = L;
    p.grid = dim3(unsigned(col_blocks), unsigned(p.splits));
    p.block = dim3(32, 8);
  }
  return p;
}

// Partials of `op` per channel into part (p.states(C) states), then finish(c, state) per channel.
template <class Op, class Finish>
void reduce_channels(int dev, const PartialPlan& p, const Op& op, int64_t N, int64_t C, int64_t L,
                     typename Op::State::Wide* part, const Finish& finish) {
  if (p.rows)
    channel_partials_rows_kernel<Op><<<p.grid, p.block, 0, stream(dev)>>>(op, N, C, L, p.s_n, p.l_chunk, part);
  else
    channel_partials_columns_kernel<Op><<<p.grid, p.block, 0, stream(dev)>>>(op, N, L, C * L, part);
  BOOSTER_CUDA_CHECK_LAUNCH();
  channel_finish_kernel<typename Op::State::Wide, Finish>
      <<<unsigned(std::min<int64_t>(C, 1 << 20)), 128, 0, stream(dev)>>>(part, C, p.splits, p.lanes, finish);
  BOOSTER_CUDA_CHECK_LAUNCH();
}

// A scratch tensor of `states` partial states (double) followed by `extra` compute-type values.
template <class S, class C>
Tensor scratch_for(int64_t states, int64_t extra, const Tensor& like) {
  static_assert(sizeof(S) % sizeof(double) == 0);
  const int64_t extra_doubles = ceil_div(extra * int64_t(sizeof(C)), int64_t(sizeof(double)));
  return Tensor::empty({states * int64_t(sizeof(S) / sizeof(double)) + extra_doubles}, DType::Float64, like.device());
}

// ------------------------------------------------------------------------------------ coefficients
// Training: batch mean, rstd = 1 / sqrt(M2 / M + eps), the unbiased variance M2 / (M - 1) for the
// running statistics (NaN for M = 1, as the CPU), and the folded scale and shift.
// Computed in double from the double state, stored in the compute type.
template <class T>
struct TrainStatsFinish {
  using C = comp_t<T>;
  const T* w;
  const T* b;
  double m, eps;
  C* mean;
  C* rstd;
  C* var_unbiased;  // null when not wanted
  C* scale;
  C* shift;
  __device__ void operator()(int64_t c, const Welford<double>& s) const {
    const double m2 = s.m2 < 0.0 ? 0.0 : s.m2;  // NaN stays, as the CPU's std::max(m2, 0) (fmax would drop it)
    const double rs = 1.0 / sqrt(m2 / m + eps);
    mean[c] = C(s.mean);
    rstd[c] = C(rs);
    if (var_unbiased) var_unbiased[c] = m > 1.0 ? C(m2 / (m - 1.0)) : std::numeric_limits<C>::quiet_NaN();
    const double sc = rs * (w ? double(load_as<C>(w[c])) : 1.0);
    scale[c] = C(sc);
    shift[c] = C((b ? double(load_as<C>(b[c])) : 0.0) - s.mean * sc);
  }
};

// Eval: the running statistics are the mean and rstd.
template <class T>
__global__ void eval_stats_kernel(const comp_t<T>* rm, const comp_t<T>* rv, const T* w, const T* b, int64_t C,
                                  comp_t<T> eps, comp_t<T>* mean, comp_t<T>* rstd, comp_t<T>* scale,
                                  comp_t<T>* shift) {
  using Cc = comp_t<T>;
  for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < C; c += int64_t(gridDim.x) * blockDim.x) {
    const Cc mu = rm[c], rs = Cc(1) / sqrt(rv[c] + eps);
    mean[c] = mu;
    rstd[c] = rs;
    const Cc sc = rs * (w ? load_as<Cc>(w[c]) : Cc(1));
    scale[c] = sc;
    shift[c] = (b ? load_as<Cc>(b[c]) : Cc(0)) - mu * sc;
  }
}

// dweight = sum(g (x - mean)) rstd, dbias = sum(g); the dx coefficients (a, b, d) when dx is wanted.
// Computed in double from the double sums, stored in the compute type.
template <class T>
struct GradFinish {
  using C = comp_t<T>;
  const T* w;
  const C* mean;
  const C* rstd;
  double m;
  bool training;
  T* dweight;  // each null when not wanted
  T* dbias;
  C* ka;
  C* kb;
  C* kd;
  __device__ void operator()(int64_t c, const GradSums<double>& s) const {
    const double rs = double(rstd[c]);
    if (dweight) dweight[c] = store_as<T>(C(s.gxc * rs));
    if (dbias) dbias[c] = store_as<T>(C(s.g));
    if (!ka) return;
    const double wc = w ? double(load_as<C>(w[c])) : 1.0;
    ka[c] = C(wc * rs);
    if (training) {
      // dx = w rstd (g - sum_g / M - xhat rstd sum_gxc / M), written as a g + b x + d.
      const double b = -wc * rs * rs * rs * s.gxc / m;
      kb[c] = C(b);
      kd[c] = C(-wc * rs * s.g / m - b * double(mean[c]));
    } else {
      kb[c] = C(0);
      kd[c] = C(0);
    }
  }
};

// y = a[c] u + b[c] x + d[c] per element of channel c = (i / L) mod C; u null: y = b[c] x + d[c].
// I is uint32_t when every index fits (32-bit division is far cheaper than 64-bit on the GPU).
template <class T, class I>
__global__ void channel_affine_kernel(const T* u, const T* x, I total, I C, I L, const comp_t<T>* a,
                                      const comp_t<T>* b, const comp_t<T>* d, T* y) {
  using Cc = comp_t<T>;
  for (I i = I(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += I(gridDim.x) * blockDim.x) {
    const I c = (i / L) % C;
    const Cc bx = b[c] * load_as<Cc>(x[i]);
    y[i] = store_as<T>(u ? a[c] * load_as<Cc>(u[i]) + bx + d[c] : bx + d[c]);
  }
}

template <class T>
void channel_affine(int dev, const T* u, const T* x, int64_t N, int64_t C, int64_t L, const comp_t<T>* a,
                    const comp_t<T>* b, const comp_t<T>* d, T* y) {
  const int64_t total = N * C * L;
  if (total == 0) return;
  // 32-bit indices while i + the grid stride (< 2^26) stays below 2^32.
  if (total < (int64_t(1) << 31))
    channel_affine_kernel<T, uint32_t><<<grid_for(dev, total), 256, 0, stream(dev)>>>(
        u, x, uint32_t(total), uint32_t(C), uint32_t(L), a, b, d, y);
  else
    channel_affine_kernel<T, int64_t><<<grid_for(dev, total), 256, 0, stream(dev)>>>(u, x, total, C, L, a, b, d, y);
  BOOSTER_CUDA_CHECK_LAUNCH();
}

// ------------------------------------------------------------------------------------------ entries

void cuda_batch_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                     const Tensor& running_var, bool training, double eps, Tensor& out, Tensor& save_mean,
                     Tensor& save_rstd, Tensor& batch_var_unbiased) {
  const int dev = device_of(out);
  const int64_t N = x.size(0), C = x.size(1), L = x.size(2);
  if (C == 0) return;
  BOOSTER_DISPATCH_FLOATING(x.dtype(), "batch_norm", [&] {
    using T = dev_t<scalar_t>;
    using Cc = comp_t<T>;
    using S = Welford<double>;
    const T* w = weight.defined() ? cptr<scalar_t>(weight) : nullptr;
    const T* b = bias.defined() ? cptr<scalar_t>(bias) : nullptr;
    Cc* mean = cmptr<Cc>(save_mean);
    Cc* rstd = cmptr<Cc>(save_rstd);
    if (training) {
      const PartialPlan plan = plan_partials(dev, N, C, L);
      const int64_t states = plan.states(C);
      Tensor scratch = scratch_for<S, Cc>(states, 2 * C, x);
      S* part = static_cast<S*>(scratch.data_ptr());
      Cc* scale = reinterpret_cast<Cc*>(part + states);
      const TrainStatsFinish<T> finish{w,    b,    double(N * L), eps, mean, rstd, cmptr<Cc>(batch_var_unbiased),
                                       scale, scale + C};
      reduce_channels(dev, plan, BatchStatsOp<T>{cptr<scalar_t>(x)}, N, C, L, part, finish);
      channel_affine<T>(dev, nullptr, cptr<scalar_t>(x), N, C, L, nullptr, scale, scale + C, mptr<scalar_t>(out));
    } else {
      Tensor coeffs = scratch_for<double, Cc>(0, 2 * C, x);
      Cc* scale = static_cast<Cc*>(coeffs.data_ptr());
      eval_stats_kernel<T><<<grid_for(dev, C), 256, 0, stream(dev)>>>(
          static_cast<const Cc*>(running_mean.data_ptr()), static_cast<const Cc*>(running_var.data_ptr()), w, b, C,
          Cc(eps), mean, rstd, scale, scale + C);
      BOOSTER_CUDA_CHECK_LAUNCH();
      channel_affine<T>(dev, nullptr, cptr<scalar_t>(x), N, C, L, nullptr, scale, scale + C, mptr<scalar_t>(out));
    }
  });
}

void cuda_batch_norm_backward(const Tensor& grad, const Tensor& x, const Tensor& weight, const Tensor& save_mean,
                              const Tensor& save_rstd, bool training, Tensor& dx, Tensor& dweight, Tensor& dbias) {
  const int dev = device_of(x);
  const int64_t N = x.size(0), C = x.size(1), L = x.size(2);
  if (C == 0) return;
  BOOSTER_DISPATCH_FLOATING(x.dtype(), "batch_norm_backward", [&] {
    using T = dev_t<scalar_t>;
    using Cc = comp_t<T>;
    using S = GradSums<double>;
    const Cc* mean = static_cast<const Cc*>(save_mean.data_ptr());
    const Cc* rstd = static_cast<const Cc*>(save_rstd.data_ptr());
    const PartialPlan plan = plan_partials(dev, N, C, L);
    const int64_t states = plan.states(C);
    Tensor scratch = scratch_for<S, Cc>(states, dx.defined() ? 3 * C : 0, x);
    S* part = static_cast<S*>(scratch.data_ptr());
    Cc* k = dx.defined() ? reinterpret_cast<Cc*>(part + states) : nullptr;
    const GradFinish<T> finish{weight.defined() ? cptr<scalar_t>(weight) : nullptr,
                               mean,
                               rstd,
                               double(N * L),
                               training,
                               mptr<scalar_t>(dweight),
                               mptr<scalar_t>(dbias),
                               k,
                               k ? k + C : nullptr,
                               k ? k + 2 * C : nullptr};
    reduce_channels(dev, plan, GradSumsOp<T>{cptr<scalar_t>(grad), cptr<scalar_t>(x), mean}, N, C, L, part, finish);
    if (dx.defined())
      channel_affine<T>(dev, cptr<scalar_t>(grad), cptr<scalar_t>(x), N, C, L, k, k + C, k + 2 * C,
                        mptr<scalar_t>(dx));
  });
}

}  // namespace
}  // namespace booster::cuda

namespace booster::kernels {
BOOSTER_REGISTER_CUDA_KERNEL(batch_norm_kernel, cuda::cuda_batch_norm);
BOOSTER_REGISTER_CUDA_KERNEL(batch_norm_backward_kernel, cuda::cuda_batch_norm_backward);
}  // namespace booster::kernels
