// CUDA neural-network kernels (kernels/nn.h): softmax, layer norm, masked scale's neighbours,
// attention and the losses. Rows are reduced by one block each in float (double for float64);
// saved statistics stay in that compute type.
#include <limits>

#include "booster/backends/cuda/common.cuh"
#include "booster/kernels/elementwise.h"
#include "booster/kernels/nn.h"

namespace booster::cuda {
namespace {

using kernels::LossReduction;

template <class T>
const dev_t<T>* cptr(const Tensor& t) {
  return static_cast<const dev_t<T>*>(t.data_ptr());
}
template <class T>
dev_t<T>* mptr(const Tensor& t) {
  return static_cast<dev_t<T>*>(t.data_ptr());
}

int row_threads(int64_t n) { return n >= 2048 ? 512 : n >= 512 ? 256 : n >= 128 ? 128 : 32; }

// ------------------------------------------------------------------------------------------ softmax
// Rows (inner == 1): a block per row. rows_valid(i) > 0 masks the row's tail (causal attention).
template <class T, class O>
__global__ void softmax_rows_kernel(const T* x, O* y, int64_t rows, int64_t n, bool log, int64_t causal_period) {
  using C = comp_t<T>;
  __shared__ C shared[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * n;
    O* yr = y + r * n;
    const int64_t valid = causal_period > 0 ? min(n, r % causal_period + 1) : n;
    C mx = -INFINITY;
    for (int64_t i = threadIdx.x; i < valid; i += blockDim.x) mx = max(mx, load_as<C>(xr[i]));
    mx = block_max(mx, shared);
    C s = 0;
    for (int64_t i = threadIdx.x; i < valid; i += blockDim.x) s += exp(load_as<C>(xr[i]) - mx);
    s = block_sum(s, shared);
    const C lse = mx + ::log(s), inv = C(1) / s;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const C v = i < valid ? load_as<C>(xr[i]) : C(0);
      yr[i] = store_as<O>(i >= valid ? C(0) : log ? v - lse : exp(v - mx) * inv);
    }
  }
}

// Attention's softmax: in place on the compute-type scores, and the same probabilities rounded to the
// input dtype into `low` for the P V product (one pass instead of a softmax and a cast).
template <class C, class L>
__global__ void softmax_rows_dual_kernel(C* p, L* low, int64_t rows, int64_t n, int64_t causal_period) {
  __shared__ C shared[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    C* pr = p + r * n;
    L* lr = low + r * n;
    const int64_t valid = causal_period > 0 ? min(n, r % causal_period + 1) : n;
    C mx = -INFINITY;
    for (int64_t i = threadIdx.x; i < valid; i += blockDim.x) mx = max(mx, pr[i]);
    mx = block_max(mx, shared);
    C s = 0;
    for (int64_t i = threadIdx.x; i < valid; i += blockDim.x) s += exp(pr[i] - mx);
    s = block_sum(s, shared);
    const C inv = C(1) / s;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const C v = i < valid ? exp(pr[i] - mx) * inv : C(0);
      pr[i] = v;
      lr[i] = store_as<L>(v);
    }
  }
}

// [outer, dim, inner] with inner > 1: a thread per (outer, inner) walks dim (coalesced over inner).
template <class T>
__global__ void softmax_inner_kernel(const T* x, T* y, int64_t outer, int64_t dim, int64_t inner, bool log) {
  using C = comp_t<T>;
  const int64_t total = outer * inner;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t o = t / inner, i = t % inner;
    const T* xr = x + o * dim * inner + i;
    T* yr = y + o * dim * inner + i;
    C mx = -INFINITY;
    for (int64_t d = 0; d < dim; ++d) mx = max(mx, load_as<C>(xr[d * inner]));
    C s = 0;
    for (int64_t d = 0; d < dim; ++d) s += exp(load_as<C>(xr[d * inner]) - mx);
    const C lse = mx + ::log(s);
    for (int64_t d = 0; d < dim; ++d) {
      const C v = load_as<C>(xr[d * inner]);
      yr[d * inner] = store_as<T>(log ? v - lse : exp(v - mx) / s);
    }
  }
}

void cuda_softmax(const Tensor& x, int64_t outer, int64_t dim, int64_t inner, bool log, Tensor& out) {
  const int dev = device_of(out);
  if (x.numel() == 0) return;
  BOOSTER_DISPATCH_FLOATING(x.dtype(), "softmax", [&] {
    using T = dev_t<scalar_t>;
    if (inner == 1) {
      softmax_rows_kernel<T, T><<<unsigned(std::min<int64_t>(outer, 1 << 20)), row_threads(dim), 0, stream(dev)>>>(
          cptr<scalar_t>(x), mptr<scalar_t>(out), outer, dim, log, 0);
    } else {
      softmax_inner_kernel<T><<<grid_for(dev, outer * inner), 256, 0, stream(dev)>>>(
          cptr<scalar_t>(x), mptr<scalar_t>(out), outer, dim, inner, log);
    }
    BOOSTER_CUDA_CHECK_LAUNCH();
  });
}

// softmax: dx = y (g - sum(g y)); log_softmax: dx = g - exp(y) sum(g). Rows and inner layouts.
template <class T, class Y>
__global__ void softmax_backward_kernel(const T* g, const Y* y, T* dx, int64_t outer, int64_t dim, int64_t inner,
                                        bool log, int64_t causal_period) {
  using C = comp_t<Y>;
  __shared__ C shared[32];
  if (inner == 1) {
    for (int64_t r = blockIdx.x; r < outer; r += gridDim.x) {
      const T* gr = g + r * dim;
      const Y* yr = y + r * dim;
      T* dr = dx + r * dim;
      const int64_t valid = causal_period > 0 ? min(dim, r % causal_period + 1) : dim;
      C s = 0;
      for (int64_t i = threadIdx.x; i < valid; i += blockDim.x)
        s += log ? load_as<C>(gr[i]) : load_as<C>(gr[i]) * load_as<C>(yr[i]);
      s = block_sum(s, shared);
      for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
        const C gv = load_as<C>(gr[i]), yv = load_as<C>(yr[i]);
        dr[i] = store_as<T>(i >= valid ? C(0) : log ? gv - exp(yv) * s : yv * (gv - s));
      }
    }
    return;
  }
  const int64_t total = outer * inner;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t o = t / inner, i = t % inner, base = o * dim * inner + i;
    C s = 0;
    for (int64_t d = 0; d < dim; ++d) {
      const C gv = load_as<C>(g[base + d * inner]);
      s += log ? gv : gv * load_as<C>(y[base + d * inner]);
    }
    for (int64_t d = 0; d < dim; ++d) {
      const C gv = load_as<C>(g[base + d * inner]), yv = load_as<C>(y[base + d * inner]);
      dx[base + d * inner] = store_as<T>(log ? gv - exp(yv) * s : yv * (gv - s));
    }
  }
}

void cuda_softmax_backward(const Tensor& grad, const Tensor& y, int64_t outer, int64_t dim, int64_t inner, bool log,
                           Tensor& dx) {
  const int dev = device_of(dx);
  if (dx.numel() == 0) return;
  BOOSTER_DISPATCH_FLOATING(dx.dtype(), "softmax_backward", [&] {
    using T = dev_t<scalar_t>;
    const unsigned blocks = inner == 1 ? unsigned(std::min<int64_t>(outer, 1 << 20)) : grid_for(dev, outer * inner);
    softmax_backward_kernel<T, T><<<blocks, inner == 1 ? row_threads(dim) : 256, 0, stream(dev)>>>(
        cptr<scalar_t>(grad), cptr<scalar_t>(y), mptr<scalar_t>(dx), outer, dim, inner, log, 0);
    BOOSTER_CUDA_CHECK_LAUNCH();
  });
}

// --------------------------------------------------------------------------------------- layer norm
template <class T>
__global__ void layer_norm_kernel(const T* x, const T* w, const T* b, int64_t rows, int64_t cols, comp_t<T> eps, T* y,
                                  comp_t<T>* mean, comp_t<T>* rstd) {
  using C = comp_t<T>;
  __shared__ C shared[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * cols;
    C s = 0;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) s += load_as<C>(xr[i]);
    const C mu = block_sum(s, shared) / C(cols);
    C ss = 0;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
      const C d = load_as<C>(xr[i]) - mu;
      ss += d * d;
    }
    const C rs = C(1) / sqrt(block_sum(ss, shared) / C(cols) + eps);
    if (threadIdx.x == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
    T* yr = y + r * cols;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
      C v = (load_as<C>(xr[i]) - mu) * rs;
      if (w) v *= load_as<C>(w[i]);
      if (b) v += load_as<C>(b[i]);
      yr[i] = store_as<T>(v);
    }
  }
}

void cuda_layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, int64_t rows, int64_t cols, double eps,
                     Tensor& out, Tensor& mean, Tensor& rstd) {
  const int dev = device_of(out);
  if (rows == 0) return;
  BOOSTER_DISPATCH_FLOATING(x.dtype(), "layer_norm", [&] {
    using T = dev_t<scalar_t>;
    using C = comp_t<T>;
    layer_norm_kernel<T><<<unsigned(std::min<int64_t>(rows, 1 << 20)), row_threads(cols), 0, stream(dev)>>>(
        cptr<scalar_t>(x), weight.defined() ? cptr<scalar_t>(weight) : nullptr,
        bias.defined() ? cptr<scalar_t>(bias) : nullptr, rows, cols, C(eps), mptr<scalar_t>(out),
        static_cast<C*>(mean.data_ptr()), static_cast<C*>(rstd.data_ptr()));
    BOOSTER_CUDA_CHECK_LAUNCH();
  });
}

// dx = rstd (g w - mean(g w) - xhat mean(g w xhat)), a block per row.
template <class T>
__global__ void layer_norm_dx_kernel(const T* g, const T* x, const comp_t<T>* mean, const comp_t<T>* rstd, const T* w,
                                     int64_t rows, int64_t cols, T* dx) {
  using C = comp_t<T>;
  __shared__ C shared[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* gr = g + r * cols;
    const T* xr = x + r * cols;
    const C mu = mean[r], rs = rstd[r];
    C s1 = 0, s2 = 0;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
      const C gw = load_as<C>(gr[i]) * (w ? load_as<C>(w[i]) : C(1));
      s1 += gw;
      s2 += gw * (load_as<C>(xr[i]) - mu) * rs;
    }
    s1 = block_sum(s1, shared) / C(cols);
    s2 = block_sum(s2, shared) / C(cols);
    T* dr = dx + r * cols;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
      const C gw = load_as<C>(gr[i]) * (w ? load_as<C>(w[i]) : C(1));
      dr[i] = store_as<T>(rs * (gw - s1 - (load_as<C>(xr[i]) - mu) * rs * s2));
    }
  }
}

// Column partial sums of g * xhat (dweight) and g (dbias): blocks of 32 columns x 8 row lanes,
// rows split over blockIdx.y into partials [splits, cols] added in order by layer_norm_dwdb_finish.
template <class T>
__global__ void layer_norm_dwdb_kernel(const T* g, const T* x, const comp_t<T>* mean, const comp_t<T>* rstd,
                                       int64_t rows, int64_t cols, comp_t<T>* pdw, comp_t<T>* pdb) {
  using C = comp_t<T>;
  __shared__ C tw[8][33], tb[8][33];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  C aw = 0, ab = 0;
  if (c < cols)
    for (int64_t r = int64_t(blockIdx.y) * 8 + threadIdx.y; r < rows; r += int64_t(gridDim.y) * 8) {
      const C gv = load_as<C>(g[r * cols + c]);
      aw += gv * (load_as<C>(x[r * cols + c]) - mean[r]) * rstd[r];
      ab += gv;
    }
  tw[threadIdx.y][threadIdx.x] = aw;
  tb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    for (int y = 1; y < 8; ++y) {
      aw += tw[y][threadIdx.x];
      ab += tb[y][threadIdx.x];
    }
    pdw[int64_t(blockIdx.y) * cols + c] = aw;
    pdb[int64_t(blockIdx.y) * cols + c] = ab;
  }
}

template <class T>
__global__ void layer_norm_dwdb_finish(const comp_t<T>* pdw, const comp_t<T>* pdb, int splits, int64_t cols, T* dw,
                                       T* db) {
  using C = comp_t<T>;
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  C aw = 0, ab = 0;
  for (int s = 0; s < splits; ++s) {
    aw += pdw[int64_t(s) * cols + c];
    ab += pdb[int64_t(s) * cols + c];
  }
  if (dw) dw[c] = store_as<T>(aw);
  if (db) db[c] = store_as<T>(ab);
}

void cuda_layer_norm_backward(const Tensor& grad, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                              const Tensor& weight, int64_t rows, int64_t cols, Tensor& dx, Tensor& dweight,
                              Tensor& dbias) {
  const int dev = device_of(x);
  BOOSTER_DISPATCH_FLOATING(x.dtype(), "layer_norm_backward", [&] {
    using T = dev_t<scalar_t>;
    using C = comp_t<T>;
    const C* pm = static_cast<const C*>(mean.data_ptr());
    const C* pr = static_cast<const C*>(rstd.data_ptr());
    if (dx.defined() && rows > 0) {
      layer_norm_dx_kernel<T><<<unsigned(std::min<int64_t>(rows, 1 << 20)), row_threads(cols), 0, stream(dev)>>>(
          cptr<scalar_t>(grad), cptr<scalar_t>(x), pm, pr, weight.defined() ? cptr<scalar_t>(weight) : nullptr, rows,
          cols, mptr<scalar_t>(dx));
      BOOSTER_CUDA_CHECK_LAUNCH();
    }
    if ((dweight.defined() || dbias.defined()) && cols > 0) {
      const int64_t col_blocks = (cols + 31) / 32;
      const int splits = int(std::max<int64_t>(
          1, std::min<int64_t>({int64_t(sm_count(dev)) * 4 / col_blocks, (rows + 7) / 8, 256})));
      const DType ct = std::is_same_v<C, double> ? DType::Float64 : DType::Float32;
      Tensor part = Tensor::empty({2, int64_t(splits), cols}, ct, x.device());
      C* pdw = static_cast<C*>(part.data_ptr());
      C* pdb = pdw + int64_t(splits) * cols;
      layer_norm_dwdb_kernel<T><<<dim3(unsigned(col_blocks), unsigned(splits)), dim3(32, 8), 0, stream(dev)>>>(
          cptr<scalar_t>(grad), cptr<scalar_t>(x), pm, pr, rows, cols, pdw, pdb);
      BOOSTER_CUDA_CHECK_LAUNCH();
      layer_norm_dwdb_finish<T><<<unsigned((cols + 255) / 256), 256, 0, stream(dev)>>>(
          pdw, pdb, splits, cols, dweight.defined() ? mptr<scalar_t>(dweight) : nullptr,
          dbias.defined() ? mptr<scalar_t>(dbias) : nullptr);
      BOOSTER_CUDA_CHECK_LAUNCH();
    }
  });
}

// ---------------------------------------------------------------------------------------- attention
// Note [CUDA attention]
// Three cuBLAS calls and a row kernel per direction, in the layout of the CPU kernel: scores
// S = scale Q K^T are written in the compute type straight into `probs` (16-bit inputs, float32
// output, float32 accumulation), softmax runs in place with the causal mask, and out = P V reads P
// rounded to the input dtype (as PyTorch's math path does), so the big GEMMs all run on tensor cores.

// Row-major batched C[b] = alpha op(A[b]) op(B[b]) + beta C[b] on dense [batch, r, c] matrices
// (Note [cuBLAS row-major operands]); A and B share a type, C may be wider.
void rowmajor_gemm(int dev, bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const void* A, DType at,
                   int64_t lda, int64_t sa, const void* B, int64_t ldb, int64_t sb, double beta, void* C, DType ct,
                   int64_t ldc, int64_t sc, int64_t batch) {
  const double ad = alpha, bd = beta;
  const float af = float(alpha), bf = float(beta);
  const bool f64 = ct == DType::Float64;
  cublasComputeType_t compute = f64 ? CUBLAS_COMPUTE_64F
                                    : (at == DType::Float32 && allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                                            : CUBLAS_COMPUTE_32F);
  BOOSTER_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      cublas_handle(dev), tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, int(N), int(M), int(K),
      f64 ? static_cast<const void*>(&ad) : &af, B, cuda_type(at, "attention"), int(ldb), sb, A, cuda_type(at, "attention"), int(lda), sa,
      f64 ? static_cast<const void*>(&bd) : &bf, C, cuda_type(ct, "attention"), int(ldc), sc, int(batch), compute,
      CUBLAS_GEMM_DEFAULT));
}

DType compute_dtype(DType t) { return t == DType::Float64 ? DType::Float64 : DType::Float32; }

// f(float{}) or f(double{}) for a compute dtype (attention's probabilities are never 16-bit).
template <class F>
void with_compute_type(DType ct, F&& f) {
  if (ct == DType::Float64) f(double{});
  else f(float{});
}

// probs (compute type) rounded to the input dtype, or probs itself when they agree.
Tensor probs_as(const Tensor& probs, DType dt) {
  if (probs.dtype() == dt) return probs;
  Tensor p = Tensor::empty(probs.shape(), dt, probs.device());
  kernels::copy_kernel(probs.device())(probs, p);
  return p;
}

// Sets the scores a query may not attend to -inf (kernels::AttentionMaskArgs, Note [Attention masks] in
// ops/nn_functional.cpp), so the row softmax after it gives them probability 0. A block per row.
template <class C>
__global__ void attention_mask_kernel(C* p, int64_t rows, int64_t L, int64_t S, bool causal, int64_t offset,
                                      int64_t window, const int64_t* seg, int64_t group) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t pos = offset + r % L;
    const int64_t* sr = seg ? seg + (r / L / group) * S : nullptr;
    for (int64_t j = threadIdx.x; j < S; j += blockDim.x) {
      const bool keep = (!causal || j <= pos) && (window == 0 || pos - j < window) && (!sr || sr[j] == sr[pos]);
      if (!keep) p[r * S + j] = C(-INFINITY);
    }
  }
}

void cuda_attention(const Tensor& q, const Tensor& k, const Tensor& v, const kernels::AttentionMaskArgs& mask,
                    double scale, Tensor& out, Tensor& probs) {
  const int dev = device_of(out);
  const int64_t B = q.size(0), L = q.size(1), E = q.size(2), S = k.size(1), Ev = v.size(2);
  const DType dt = q.dtype(), ct = compute_dtype(dt);
  if (B == 0 || L == 0) return;
  if (S == 0) {
    kernels::fill_kernel(out.device())(out, 0.0);
    return;
  }
  rowmajor_gemm(dev, false, true, L, S, E, scale, q.data_ptr(), dt, E, L * E, k.data_ptr(), E, S * E, 0.0,
                probs.data_ptr(), ct, S, L * S, B);
  // The causal mask of the CPU kernel is top-left aligned: query i sees keys j <= i. Any other mask is
  // written into the scores first and the softmax runs over whole rows.
  const unsigned rows_grid = unsigned(std::min<int64_t>(B * L, 1 << 20));
  const bool is_causal = mask.causal && mask.simple();
  Tensor pl = probs;
  with_compute_type(ct, [&](auto tag) {
    using C = decltype(tag);
    C* p = static_cast<C*>(probs.data_ptr());
    if (!mask.simple()) {
      const int64_t* seg = mask.segments.defined() ? static_cast<const int64_t*>(mask.segments.data_ptr()) : nullptr;
      const int64_t group = seg ? B / mask.segments.size(0) : 1;
      attention_mask_kernel<C><<<rows_grid, row_threads(S), 0, stream(dev)>>>(p, B * L, L, S, mask.causal, mask.offset,
                                                                             mask.window, seg, group);
      BOOSTER_CUDA_CHECK_LAUNCH();
    }
    if (dt == ct) {
      softmax_rows_kernel<C, C><<<rows_grid, row_threads(S), 0, stream(dev)>>>(p, p, B * L, S, false,
                                                                              is_causal ? L : 0);
    } else {
      pl = Tensor::empty(probs.shape(), dt, probs.device());
      if (dt == DType::Float16)
        softmax_rows_dual_kernel<C, __half><<<rows_grid, row_threads(S), 0, stream(dev)>>>(
            p, static_cast<__half*>(pl.data_ptr()), B * L, S, is_causal ? L : 0);
      else
        softmax_rows_dual_kernel<C, __nv_bfloat16><<<rows_grid, row_threads(S), 0, stream(dev)>>>(
            p, static_cast<__nv_bfloat16*>(pl.data_ptr()), B * L, S, is_causal ? L : 0);
    }
    BOOSTER_CUDA_CHECK_LAUNCH();
  });
  rowmajor_gemm(dev, false, false, L, Ev, S, 1.0, pl.data_ptr(), dt, S, L * S, v.data_ptr(), Ev, S * Ev, 0.0,
                out.data_ptr(), dt, Ev, L * Ev, B);
}

// dS = P (dP - rowsum(dP P)) from dP (compute type) into dS (the input dtype; may alias dP when
// that is the compute type too).
template <class C, class O>
__global__ void attention_ds_kernel(const C* P, const C* dP, O* dS, int64_t rows, int64_t S) {
  __shared__ C shared[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const C* pr = P + r * S;
    const C* dr = dP + r * S;
    O* out = dS + r * S;
    C dot = 0;
    for (int64_t j = threadIdx.x; j < S; j += blockDim.x) dot += dr[j] * pr[j];
    dot = block_sum(dot, shared);
    for (int64_t j = threadIdx.x; j < S; j += blockDim.x) out[j] = store_as<O>(pr[j] * (dr[j] - dot));
  }
}

void cuda_attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& probs, double scale, Tensor& dq, Tensor& dk, Tensor& dv) {
  const int dev = device_of(q);
  const int64_t B = q.size(0), L = q.size(1), E = q.size(2), S = k.size(1), Ev = v.size(2);
  const DType dt = q.dtype(), ct = compute_dtype(dt);
  auto zero = [](Tensor& t) {
    if (t.defined()) kernels::fill_kernel(t.device())(t, 0.0);
  };
  if (B == 0) return;
  if (L == 0 || S == 0) {
    zero(dq);
    zero(dk);
    zero(dv);
    return;
  }
  const Tensor pl = probs_as(probs, dt);
  if (dv.defined())  // dV = P^T dO
    rowmajor_gemm(dev, true, false, S, Ev, L, 1.0, pl.data_ptr(), dt, S, L * S, grad_out.data_ptr(), Ev, L * Ev, 0.0,
                  dv.data_ptr(), dt, Ev, S * Ev, B);
  if (!dq.defined() && !dk.defined()) return;
  Tensor dp = Tensor::empty({B, L, S}, ct, q.device());  // dP = dO V^T
  rowmajor_gemm(dev, false, true, L, S, Ev, 1.0, grad_out.data_ptr(), dt, Ev, L * Ev, v.data_ptr(), Ev, S * Ev, 0.0,
                dp.data_ptr(), ct, S, L * S, B);
  Tensor dsl = dt == ct ? dp : Tensor::empty({B, L, S}, dt, q.device());  // dS, rounded once to dt
  with_compute_type(ct, [&](auto tag) {
    using C = decltype(tag);
    const unsigned grid = unsigned(std::min<int64_t>(B * L, 1 << 20));
    const C* pp = static_cast<const C*>(probs.data_ptr());
    const C* pdp = static_cast<const C*>(dp.data_ptr());
    if (dt == ct)
      attention_ds_kernel<C, C><<<grid, row_threads(S), 0, stream(dev)>>>(pp, pdp, static_cast<C*>(dsl.data_ptr()),
                                                                          B * L, S);
    else if (dt == DType::Float16)
      attention_ds_kernel<C, __half><<<grid, row_threads(S), 0, stream(dev)>>>(
          pp, pdp, static_cast<__half*>(dsl.data_ptr()), B * L, S);
    else
      attention_ds_kernel<C, __nv_bfloat16><<<grid, row_threads(S), 0, stream(dev)>>>(
          pp, pdp, static_cast<__nv_bfloat16*>(dsl.data_ptr()), B * L, S);
    BOOSTER_CUDA_CHECK_LAUNCH();
  });
  if (dq.defined())  // dQ = scale dS K
    rowmajor_gemm(dev, false, false, L, E, S, scale, dsl.data_ptr(), dt, S, L * S, k.data_ptr(), E, S * E, 0.0,
                  dq.data_ptr(), dt, E, L * E, B);
  if (dk.defined())  // dK = scale dS^T Q
    rowmajor_gemm(dev, true, false, S, E, L, scale, dsl.data_ptr(), dt, S, L * S, q.data_ptr(), E, L * E, 0.0,
                  dk.data_ptr(), dt, E, S * E, B);
}

// ------------------------------------------------------------------------------------------- losses
// Targets are checked on the host (one copy of the int64 targets, as the CPU backend checks them
// before its parallel loops); the number of valid targets is then known there too.
int64_t count_valid_targets(const char* op, const Tensor& target, int64_t C, int64_t ignore_index) {
  const std::vector<int64_t> t = target.to_vector<int64_t>();
  int64_t valid = 0;
  for (size_t i = 0; i < t.size(); ++i) {
    if (t[i] == ignore_index) continue;
    BOOSTER_CHECK(t[i] >= 0 && t[i] < C, IndexError, op, ": target ", t[i], " at position ", i,
                  " is out of bounds for ", C, " classes (expected 0 <= target < ", C, ", or ignore_index ",
                  ignore_index, ")");
    ++valid;
  }
  return valid;
}

// A block per (n, d) row of C logits D apart: loss (None) or per-row loss into rowloss, lse.
// ld: elements between the rows of consecutive n (C * D when contiguous; more for padded rows).
template <class T>
__global__ void cross_entropy_kernel(const T* x, const int64_t* target, int64_t rows, int64_t C, int64_t D,
                                     int64_t ld, int64_t ignore_index, comp_t<T> on, comp_t<T> spc,
                                     comp_t<T>* rowloss, comp_t<T>* lse) {
  using A = comp_t<T>;
  __shared__ A shared[32];
  for (int64_t e = blockIdx.x; e < rows; e += gridDim.x) {
    const int64_t t = target[e];
    if (t == ignore_index) {
      if (threadIdx.x == 0) {
        lse[e] = 0;
        rowloss[e] = 0;
      }
      continue;
    }
    const T* xr = x + (e / D) * ld + e % D;
    A mx = -INFINITY;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) mx = max(mx, load_as<A>(xr[c * D]));
    mx = block_max(mx, shared);
    A s = 0, sx = 0;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const A v = load_as<A>(xr[c * D]);
      s += exp(v - mx);
      sx += v;
    }
    s = block_sum(s, shared);
    if (spc != A(0)) sx = block_sum(sx, shared);
    if (threadIdx.x == 0) {
      const A l = mx + log(s);
      lse[e] = l;
      A loss = on * (l - load_as<A>(xr[t * D]));
      if (spc != A(0)) loss += spc * (A(C) * l - sx);
      rowloss[e] = loss;
    }
  }
}

// out = sum(rowloss) (/ divisor), one block, fixed order.
template <class A, class T>
__global__ void sum_rows_kernel(const A* rowloss, int64_t rows, double divisor, T* out) {
  __shared__ A shared[32];
  A s = 0;
  for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) s += rowloss[i];
  s = block_sum(s, shared);
  if (threadIdx.x == 0) out[0] = store_as<T>(double(s) / divisor);
}

template <class T, class A>
__global__ void cast_rows_kernel(const A* rowloss, int64_t rows, T* out) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < rows; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = store_as<T>(rowloss[i]);
}

template <class T, class A>
void finish_loss(int dev, const A* rowloss, int64_t rows, LossReduction reduction, double valid, Tensor& out) {
  T* po = static_cast<T*>(out.data_ptr());
  if (reduction == LossReduction::None) {
    if (rows > 0) cast_rows_kernel<T, A><<<grid_for(dev, rows), 256, 0, stream(dev)>>>(rowloss, rows, po);
  } else {
    // Mean over no valid target is 0/0 = nan, as PyTorch.
    sum_rows_kernel<A, T><<<1, 1024, 0, stream(dev)>>>(rowloss, rows, reduction == LossReduction::Mean ? valid : 1.0,
                                                       po);
  }
  BOOSTER_CUDA_CHECK_LAUNCH();
}

void cuda_cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index, double label_smoothing,
                        LossReduction reduction, Tensor& out, Tensor& lse, Tensor& count) {
  const int dev = device_of(logits);
  const int64_t N = logits.size(0), C = logits.size(1), D = logits.size(2), rows = N * D;
  const int64_t valid = count_valid_targets("cross_entropy", target, C, ignore_index);
  BOOSTER_DISPATCH_FLOATING(logits.dtype(), "cross_entropy", [&] {
    using T = dev_t<scalar_t>;
    using A = comp_t<T>;
    Tensor rowloss = Tensor::empty({std::max<int64_t>(rows, 1)}, lse.dtype(), logits.device());
    A* pr = static_cast<A*>(rowloss.data_ptr());
    if (rows > 0) {
      cross_entropy_kernel<T><<<unsigned(std::min<int64_t>(rows, 1 << 20)), row_threads(C), 0, stream(dev)>>>(
          cptr<scalar_t>(logits), target.data<int64_t>(), rows, C, D, C * D, ignore_index, A(1 - label_smoothing),
          A(label_smoothing / double(C)), pr, static_cast<A*>(lse.data_ptr()));
      BOOSTER_CUDA_CHECK_LAUNCH();
    }
    finish_loss<T, A>(dev, pr, rows, reduction, double(valid), out);
    Tensor cnt = count;
    kernels::fill_kernel(count.device())(cnt, double(valid));
  });
}

// The factor d(loss)/d(row e) from the incoming gradient g (device), as the CPU's LossGradScale.
template <class T, class A>
__device__ __forceinline__ A loss_grad_scale(const T* g, LossReduction reduction, const A* count, int64_t e,
                                             A numel) {
  switch (reduction) {
    case LossReduction::None: return load_as<A>(g[e]);
    case LossReduction::Sum: return load_as<A>(g[0]);
    case LossReduction::Mean: return load_as<A>(g[0]) / (count ? count[0] : numel);
  }
  return A(0);
}

// G: the incoming gradient's type (the loss's dtype). ld / ldd: row strides of x / dx (C * D when
// contiguous).
template <class T, class G = T>
__global__ void cross_entropy_backward_kernel(const G* g, const T* x, const int64_t* target, const comp_t<T>* lse,
                                              const comp_t<T>* count, int64_t rows, int64_t C, int64_t D,
                                              int64_t ld, int64_t ldd, int64_t ignore_index, comp_t<T> on,
                                              comp_t<T> spc, LossReduction reduction, T* dx) {
  using A = comp_t<T>;
  for (int64_t e = blockIdx.x; e < rows; e += gridDim.x) {
    const int64_t t = target[e];
    const T* xr = x + (e / D) * ld + e % D;
    T* dr = dx + (e / D) * ldd + e % D;
    if (t == ignore_index) {
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) dr[c * D] = store_as<T>(A(0));
      continue;
    }
    const A k = loss_grad_scale<G, A>(g, reduction, count, e, A(1)), l = lse[e];
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      A d = k * (exp(load_as<A>(xr[c * D]) - l) - spc);
      if (c == t) d -= k * on;
      dr[c * D] = store_as<T>(d);
    }
  }
}

void cuda_cross_entropy_backward(const Tensor& grad, const Tensor& logits, const Tensor& target, const Tensor& lse,
                                 const Tensor& count, int64_t ignore_index, double label_smoothing,
                                 LossReduction reduction, Tensor& dlogits) {
  const int dev = device_of(logits);
  const int64_t N = logits.size(0), C = logits.size(1), D = logits.size(2), rows = N * D;
  if (rows == 0) return;
  BOOSTER_DISPATCH_FLOATING(logits.dtype(), "cross_entropy_backward", [&] {
    using T = dev_t<scalar_t>;
    using A = comp_t<T>;
    cross_entropy_backward_kernel<T><<<unsigned(std::min<int64_t>(rows, 1 << 20)), row_threads(C), 0, stream(dev)>>>(
        cptr<scalar_t>(grad), cptr<scalar_t>(logits), target.data<int64_t>(), static_cast<const A*>(lse.data_ptr()),
        static_cast<const A*>(count.data_ptr()), rows, C, D, C * D, C * D, ignore_index, A(1 - label_smoothing),
        A(label_smoothing / double(C)), reduction, mptr<scalar_t>(dlogits));
    BOOSTER_CUDA_CHECK_LAUNCH();
  });
}

// Note [Fused classifier]
// The cross-entropy of [N, C] logits read as they lie: any dtype, computed in float32, rows any
// distance apart (the lm_head's padded rows), the loss in float32. Backward writes dlogits in the
// logits' dtype, in one pass from the logits and the saved log-sum-exp, so the probabilities are never
// stored and no float32 copy of the logits is made. The values are those of widening the logits to
// float32 first (as autocast does) and rounding dlogits once, since widening is exact.

// f.template operator()<T>() for the device type of float32, float16 or bfloat16 logits.
template <class F>
void with_classifier_type(DType dt, F&& f) {
  switch (dt) {
    case DType::Float32: return f.template operator()<float>();
    case DType::Float16: return f.template operator()<__half>();
    case DType::BFloat16: return f.template operator()<__nv_bfloat16>();
    default:
      BOOSTER_FAIL(DTypeError, "cross_entropy: the fused classifier takes float32, float16 or bfloat16 logits, got ", dt);
  }
}

void cuda_classifier_loss(const Tensor& logits, const Tensor& target, int64_t ignore_index, double label_smoothing,
                          LossReduction reduction, Tensor& out, Tensor& lse, Tensor& count) {
  const int dev = device_of(logits);
  const int64_t N = logits.size(0), C = logits.size(1);
  const int64_t valid = count_valid_targets("cross_entropy", target, C, ignore_index);
  Tensor rowloss = Tensor::empty({std::max<int64_t>(N, 1)}, DType::Float32, logits.device());
  float* pr = static_cast<float*>(rowloss.data_ptr());
  with_classifier_type(logits.dtype(), [&]<class T>() {
    if (N == 0) return;
    cross_entropy_kernel<T><<<unsigned(std::min<int64_t>(N, 1 << 20)), row_threads(C), 0, stream(dev)>>>(
        static_cast<const T*>(logits.data_ptr()), target.data<int64_t>(), N, C, 1, logits.stride(0), ignore_index,
        float(1 - label_smoothing), float(label_smoothing / double(C)), pr, static_cast<float*>(lse.data_ptr()));
    BOOSTER_CUDA_CHECK_LAUNCH();
  });
  finish_loss<float, float>(dev, pr, N, reduction, double(valid), out);
  kernels::fill_kernel(count.device())(count, double(valid));
}

void cuda_classifier_loss_backward(const Tensor& grad, const Tensor& logits, const Tensor& target, const Tensor& lse,
                                   const Tensor& count, int64_t ignore_index, double label_smoothing,
                                   LossReduction reduction, Tensor& dlogits) {
  const int dev = device_of(logits);
  const int64_t N = logits.size(0), C = logits.size(1);
  if (N == 0) return;
  with_classifier_type(logits.dtype(), [&]<class T>() {
    cross_entropy_backward_kernel<T, float><<<unsigned(std::min<int64_t>(N, 1 << 20)), row_threads(C), 0, stream(dev)>>>(
        static_cast<const float*>(grad.data_ptr()), static_cast<const T*>(logits.data_ptr()), target.data<int64_t>(),
        static_cast<const float*>(lse.data_ptr()), static_cast<const float*>(count.data_ptr()), N, C, 1,
        logits.stride(0), dlogits.stride(0), ignore_index, float(1 - label_smoothing),
        float(label_smoothing / double(C)), reduction, static_cast<T*>(dlogits.data_ptr()));
    BOOSTER_CUDA_CHECK_LAUNCH();
  });
}

void cuda_nll_loss(const Tensor& log_probs, const Tensor& target, int64_t ignore_index, LossReduction reduction,
                   Tensor& out, Tensor& count) {
  const int dev = device_of(log_probs);
  const int64_t N = log_probs.size(0), C = log_probs.size(1), D = log_probs.size(2), rows = N * D;
  const int64_t valid = count_valid_targets("nll_loss", target, C, ignore_index);
  BOOSTER_DISPATCH_FLOATING(log_probs.dtype(), "nll_loss", [&] {
    using T = dev_t<scalar_t>;
    using A = comp_t<T>;
    Tensor rowloss = Tensor::empty({std::max<int64_t>(rows, 1)}, count.dtype(), log_probs.device());
    A* pr = static_cast<A*>(rowloss.data_ptr());
    const T* px = cptr<scalar_t>(log_probs);
    const int64_t* pt = target.data<int64_t>();
    const Shape shape{rows};
    const Shape st{1};
    launch_elementwise<1>(dev, shape, {&st}, [=] __device__(const int64_t(&o)[1]) {
      const int64_t i = o[0], t = pt[i];
      pr[i] = t == ignore_index ? A(0) : -load_as<A>(px[(i / D) * C * D + t * D + i % D]);
    });
    finish_loss<T, A>(dev, pr, rows, reduction, double(valid), out);
    Tensor cnt = count;
    kernels::fill_kernel(count.device())(cnt, double(valid));
  });
}

void cuda_nll_loss_backward(const Tensor& grad, const Tensor& target, const Tensor& count, int64_t ignore_index,
                            LossReduction reduction, Tensor& dlog_probs) {
  const int dev = device_of(dlog_probs);
  const int64_t N = dlog_probs.size(0), C = dlog_probs.size(1), D = dlog_probs.size(2), rows = N * D;
  kernels::fill_kernel(dlog_probs.device())(dlog_probs, 0.0);
  BOOSTER_DISPATCH_FLOATING(dlog_probs.dtype(), "nll_loss_backward", [&] {
    using T = dev_t<scalar_t>;
    using A = comp_t<T>;
    T* pd = mptr<scalar_t>(dlog_probs);
    const T* pg = cptr<scalar_t>(grad);
    const A* pc = static_cast<const A*>(count.data_ptr());
    const int64_t* pt = target.data<int64_t>();
    const Shape shape{rows};
    const Shape st{1};
    launch_elementwise<1>(dev, shape, {&st}, [=] __device__(const int64_t(&o)[1]) {
      const int64_t i = o[0], t = pt[i];
      if (t != ignore_index) pd[(i / D) * C * D + t * D + i % D] = store_as<T>(-loss_grad_scale<T, A>(pg, reduction, pc, i, A(1)));
    });
  });
}

void cuda_mse_loss(const Tensor& input, const Tensor& target, LossReduction reduction, Tensor& out) {
  const int dev = device_of(input);
  const int64_t n = input.numel();
  BOOSTER_DISPATCH_FLOATING(input.dtype(), "mse_loss", [&] {
    using T = dev_t<scalar_t>;
    using A = comp_t<T>;
    Tensor rowloss = Tensor::empty({std::max<int64_t>(n, 1)}, compute_dtype(input.dtype()), input.device());
    A* pr = static_cast<A*>(rowloss.data_ptr());
    const T* px = cptr<scalar_t>(input);
    const T* pt = cptr<scalar_t>(target);
    const Shape shape{n};
    const Shape st{1};
    launch_elementwise<1>(dev, shape, {&st}, [=] __device__(const int64_t(&o)[1]) {
      const A d = load_as<A>(px[o[0]]) - load_as<A>(pt[o[0]]);
      pr[o[0]] = d * d;
    });
    finish_loss<T, A>(dev, pr, n, reduction, double(n), out);
  });
}

void cuda_mse_loss_backward(const Tensor& grad, const Tensor& input, const Tensor& target, LossReduction reduction,
                            Tensor& dinput, Tensor& dtarget) {
  const int dev = device_of(input);
  const int64_t n = input.numel();
  BOOSTER_DISPATCH_FLOATING(input.dtype(), "mse_loss_backward", [&] {
    using T = dev_t<scalar_t>;
    using A = comp_t<T>;
    const T* px = cptr<scalar_t>(input);
    const T* pt = cptr<scalar_t>(target);
    const T* pg = cptr<scalar_t>(grad);
    T* pdi = dinput.defined() ? mptr<scalar_t>(dinput) : nullptr;
    T* pdt = dtarget.defined() ? mptr<scalar_t>(dtarget) : nullptr;
    const A numel = A(n);
    const Shape shape{n};
    const Shape st{1};
    launch_elementwise<1>(dev, shape, {&st}, [=] __device__(const int64_t(&o)[1]) {
      const int64_t i = o[0];
      const A d = A(2) * loss_grad_scale<T, A>(pg, reduction, nullptr, i, numel) * (load_as<A>(px[i]) - load_as<A>(pt[i]));
      if (pdi) pdi[i] = store_as<T>(d);
      if (pdt) pdt[i] = store_as<T>(-d);
    });
  });
}

}  // namespace
}  // namespace booster::cuda

namespace booster::kernels {
BOOSTER_REGISTER_CUDA_KERNEL(softmax_kernel, cuda::cuda_softmax);
BOOSTER_REGISTER_CUDA_KERNEL(softmax_backward_kernel, cuda::cuda_softmax_backward);
BOOSTER_REGISTER_CUDA_KERNEL(layer_norm_kernel, cuda::cuda_layer_norm);
BOOSTER_REGISTER_CUDA_KERNEL(layer_norm_backward_kernel, cuda::cuda_layer_norm_backward);
BOOSTER_REGISTER_CUDA_KERNEL(attention_kernel, cuda::cuda_attention);
BOOSTER_REGISTER_CUDA_KERNEL(attention_backward_kernel, cuda::cuda_attention_backward);
BOOSTER_REGISTER_CUDA_KERNEL(cross_entropy_kernel, cuda::cuda_cross_entropy);
BOOSTER_REGISTER_CUDA_KERNEL(cross_entropy_backward_kernel, cuda::cuda_cross_entropy_backward);
BOOSTER_REGISTER_CUDA_KERNEL(classifier_loss_kernel, cuda::cuda_classifier_loss);
BOOSTER_REGISTER_CUDA_KERNEL(classifier_loss_backward_kernel, cuda::cuda_classifier_loss_backward);
BOOSTER_REGISTER_CUDA_KERNEL(nll_loss_kernel, cuda::cuda_nll_loss);
BOOSTER_REGISTER_CUDA_KERNEL(nll_loss_backward_kernel, cuda::cuda_nll_loss_backward);
BOOSTER_REGISTER_CUDA_KERNEL(mse_loss_kernel, cuda::cuda_mse_loss);
BOOSTER_REGISTER_CUDA_KERNEL(mse_loss_backward_kernel, cuda::cuda_mse_loss_backward);
}  // namespace booster::kernels
