// CPU scaled dot-product attention, causal or not, with an optional sliding window and packed documents
// (Note [Attention masks] in ops/nn_functional.cpp), forward and backward (kernels/nn.h).
//
// Rows (or channels) are processed while in cache with float32 (float64) accumulators and split across
// threads; reductions across rows add per-chunk partials in chunk order (Note [Repeatable sums] in
// nn_common.h).
#include <cblas.h>

#include "booster/backends/cpu/nn_common.h"
#include "booster/backends/cpu/convert.h"
#include "booster/backends/onednn/onednn.h"

namespace booster::cpu {
namespace {

// Row-major C = alpha op(A) op(B) + beta C through OpenBLAS.
void blas_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, blasint(m), blasint(n),
              blasint(k), alpha, a, blasint(lda), b, blasint(ldb), beta, c, blasint(ldc));
}
void blas_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
               const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, blasint(m), blasint(n),
              blasint(k), alpha, a, blasint(lda), b, blasint(ldb), beta, c, blasint(ldc));
}

// Note [OpenBLAS inside parallel regions]
// Debian's OpenBLAS keeps its own pthread pool. When several of our OpenMP threads each call a GEMM,
// each call fans out onto that pool as well, and the spinning threads oversubscribe the cores: on 2
// cores attention ran 4-7x slower than with one BLAS thread per caller. So while our threads split
// the heads, OpenBLAS is held to one thread; a single head (or a single thread) keeps BLAS's own
// parallelism. The setting is process-wide, so it is restored as soon as the region ends.
// The OpenMP build of OpenBLAS (see Note [One thread pool] in CMakeLists.txt) needs none of this: it
// runs single-threaded inside an OpenMP region by itself, and its openblas_set_num_threads would
// call omp_set_num_threads, which would keep our own loop from forking.
class SingleThreadedBlas {
 public:
  static constexpr int kOpenMPBuild = 2;  // openblas_get_parallel(): 0 serial, 1 pthreads, 2 OpenMP
  SingleThreadedBlas() : prev_(openblas_get_parallel() == kOpenMPBuild ? 1 : openblas_get_num_threads()) {
    if (prev_ > 1) openblas_set_num_threads(1);
  }
  ~SingleThreadedBlas() {
    if (prev_ > 1) openblas_set_num_threads(prev_);
  }
  SingleThreadedBlas(const SingleThreadedBlas&) = delete;
  SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;

 private:
  int prev_;
};

// Runs body(b0, b1) over the heads [0, heads): split across threads when there are several heads
// and enough work, with BLAS single-threaded meanwhile; otherwise in one call with BLAS threaded.
template <class F>
void for_heads(int64_t heads, int64_t cost_per_head, F&& body) {
  if (heads < 2 || num_threads_for(heads * cost_per_head) < 2) {
    body(int64_t(0), heads);
    return;
  }
  SingleThreadedBlas single;
  parallel_for(heads, cost_per_head, body);
}

// Note [Attention in 16 bits]
// OpenBLAS has no float16 GEMM, so a float16/bfloat16 head is widened into per-thread float32
// scratch (allocated once per thread, reused across heads), computed in float32, and rounded once
// when the result is stored. For float32/float64 the GEMMs read and write the tensors directly.
template <class T, class A>
const A* widen(const T* src, int64_t n, std::vector<A>& scratch) {
  if constexpr (std::is_same_v<T, A>) {
    return src;
  } else {
    scratch.resize(size_t(n));
    load_block(src, scratch.data(), n);
    return scratch.data();
  }
}
// Where a GEMM should write an n-element result destined for dst.
template <class T, class A>
A* result_buffer(T* dst, int64_t n, std::vector<A>& scratch) {
  if constexpr (std::is_same_v<T, A>) {
    return dst;
  } else {
    scratch.resize(size_t(n));
    return scratch.data();
  }
}
template <class T, class A>
void store(const A* result, T* dst, int64_t n) {
  if constexpr (!std::is_same_v<T, A>) store_block(result, dst, n);
}

// Softmax of one row of scores in place over the `valid` keys it may attend; the rest become 0.
template <class A>
void softmax_row(A* row, int64_t valid, int64_t S) {
  A mx = -std::numeric_limits<A>::infinity();
  #pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < valid; ++j) mx = std::max(mx, row[j]);
  A s = 0;
  #pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < valid; ++j) {
    row[j] = exp_acc(row[j] - mx);
    s += row[j];
  }
  const A inv = A(1) / s;
  for (int64_t j = 0; j < valid; ++j) row[j] *= inv;
  for (int64_t j = valid; j < S; ++j) row[j] = 0;
}

// The keys row i of head b may attend (kernels::AttentionMaskArgs; Note [Attention masks] in
// nn_functional.cpp): the range [lo, hi) of the causal and window bounds, and within it, with segments,
// the keys of the query's document. softmax_row over that range, the rest 0.
struct RowMask {
  const kernels::AttentionMaskArgs& m;
  int64_t L, S, group;  // group: heads per segments row
  const int64_t* seg;
  RowMask(const kernels::AttentionMaskArgs& mask, int64_t B, int64_t L_, int64_t S_)
      : m(mask), L(L_), S(S_), group(1), seg(mask.segments.defined() ? mask.segments.data<int64_t>() : nullptr) {
    if (seg) group = B / mask.segments.size(0);
  }
  // Softmax of row r (= b * L + i) of scores in place under the mask.
  template <class A>
  void softmax(A* row, int64_t r) const {
    const int64_t i = r % L, pos = m.offset + i;
    if (m.simple()) return softmax_row(row, m.causal ? std::min(i + 1, S) : S, S);
    const int64_t hi = m.causal ? std::min(pos + 1, S) : S, lo = m.window > 0 ? std::max<int64_t>(0, pos - m.window + 1) : 0;
    if (seg) {
      const int64_t* sr = seg + (r / L / group) * S;
      for (int64_t j = lo; j < hi; ++j)
        if (sr[j] != sr[pos]) row[j] = -std::numeric_limits<A>::infinity();  // exp gives 0
    }
    for (int64_t j = 0; j < lo; ++j) row[j] = 0;
    softmax_row(row + lo, hi - lo, S - lo);
  }
};

// Note [Attention through oneDNN]
// Where bfloat16 GEMMs run through oneDNN (Note [bfloat16 GEMMs through oneDNN]), a bfloat16 attention
// runs its six products there as well, each one batched matmul over every head (oneDNN threads it),
// instead of widening each head to float32 for sgemm. The scores Q K^T and dP = dO V^T come out in
// float32, unrounded, for the softmax and its gradient; the products with the probabilities P and with
// dS multiply bfloat16 by bfloat16 only, so P and dS are rounded once to bfloat16 first (into per-thread
// scratch that grows and is reused), as PyTorch's bfloat16 attention holds them. That adds one bfloat16
// rounding of each factor, 2^-8 relative, to sums whose results are rounded to bfloat16 anyway; probs,
// saved for the backward, stays float32. A problem oneDNN refuses goes back to the widening path.

// Per-thread scratch of the oneDNN path, by slot; grows, never shrinks.
template <class E>
E* attention_scratch(int slot, int64_t n) {
  thread_local std::vector<E> buffers[2];
  std::vector<E>& b = buffers[slot];
  if (b.size() < size_t(n)) b.resize(size_t(n));
  return b.data();
}

// Contiguous [batch, rows, cols] bfloat16 or float32 matrices as a GEMM operand, op(X) = X or X^T.
kernels::GemmOperand heads(const void* data, bool trans, int64_t rows, int64_t cols) {
  return kernels::GemmOperand{data, trans, cols, rows * cols, rows, cols};
}

bool attention_onednn(const Tensor& q, const Tensor& k, const Tensor& v, const kernels::AttentionMaskArgs& mask,
                      double scale, Tensor& out, Tensor& probs) {
  const int64_t B = q.size(0), L = q.size(1), E = q.size(2), S = k.size(1), Ev = v.size(2);
  if (B == 0 || L == 0 || S == 0 || E == 0 || Ev == 0) return false;
  float* P = mptr<float>(probs);
  if (!onednn::gemm_bf16(heads(q.data_ptr(), false, L, E), heads(k.data_ptr(), true, S, E), P, S, L * S, B, L, S, E,
                         scale, 0.0, /*float32_result=*/true))
    return false;
  BFloat16* P16 = attention_scratch<BFloat16>(0, B * L * S);
  const RowMask rows(mask, B, L, S);
  parallel_for(B * L, S * 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      rows.softmax(P + r * S, r);
      store_block(P + r * S, P16 + r * S, S);
    }
  });
  return onednn::gemm_bf16(heads(P16, false, L, S), heads(v.data_ptr(), false, S, Ev), out.data_ptr(), Ev, L * Ev, B, L,
                           Ev, S, 1.0, 0.0);
}

bool attention_backward_onednn(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& probs, double scale, Tensor& dq, Tensor& dk, Tensor& dv) {
  const int64_t B = q.size(0), L = q.size(1), E = q.size(2), S = k.size(1), Ev = v.size(2);
  if (B == 0 || L == 0 || S == 0 || E == 0 || Ev == 0) return false;
  const float* P = cptr<float>(probs);
  BFloat16* P16 = attention_scratch<BFloat16>(0, B * L * S);
  // dS is rounded into P16's buffer once dV no longer needs P16; its float32 form has a slot of its own.
  float* dS = dq.defined() || dk.defined() ? attention_scratch<float>(1, B * L * S) : nullptr;
  const kernels::GemmOperand dO = heads(grad_out.data_ptr(), false, L, Ev);
  if (dv.defined()) {  // dV = P^T dO
    parallel_for(B * L, S, [&](int64_t r0, int64_t r1) { store_block(P + r0 * S, P16 + r0 * S, (r1 - r0) * S); });
    if (!onednn::gemm_bf16(heads(P16, true, L, S), dO, dv.data_ptr(), Ev, S * Ev, B, S, Ev, L, 1.0, 0.0)) return false;
  }
  if (!dS) return true;
  // dP = dO V^T, then dS = P * (dP - rowsum(dP * P)); masked entries have P = 0, so dS = 0.
  if (!onednn::gemm_bf16(dO, heads(v.data_ptr(), true, S, Ev), dS, S, L * S, B, L, S, Ev, 1.0, 0.0,
                         /*float32_result=*/true))
    return false;
  parallel_for(B * L, S * 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* pr = P + r * S;
      float* dr = dS + r * S;
      float dot = 0;
      #pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < S; ++j) dot += dr[j] * pr[j];
      for (int64_t j = 0; j < S; ++j) dr[j] = pr[j] * (dr[j] - dot);
      store_block(dr, P16 + r * S, S);
    }
  });
  if (dq.defined() &&  // dQ = dS K * scale
      !onednn::gemm_bf16(heads(P16, false, L, S), heads(k.data_ptr(), false, S, E), dq.data_ptr(), E, L * E, B, L, E, S,
                         scale, 0.0))
    return false;
  if (dk.defined() &&  // dK = dS^T Q * scale
      !onednn::gemm_bf16(heads(P16, true, L, S), heads(q.data_ptr(), false, L, E), dk.data_ptr(), E, S * E, B, S, E, L,
                         scale, 0.0))
    return false;
  return true;
}

template <class T>
void attention_impl(const Tensor& q, const Tensor& k, const Tensor& v, const kernels::AttentionMaskArgs& mask,
                    double scale, Tensor& out, Tensor& probs) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    if (onednn::bf16_gemm_enabled() && attention_onednn(q, k, v, mask, scale, out, probs)) return;
  }
  using A = acc_t<T>;
  const int64_t B = q.size(0), L = q.size(1), E = q.size(2), S = k.size(1), Ev = v.size(2);
  const T* pq = cptr<T>(q);
  const T* pk = cptr<T>(k);
  const T* pv = cptr<T>(v);
  T* po = mptr<T>(out);
  A* pp = mptr<A>(probs);
  const RowMask rows(mask, B, L, S);
  for_heads(B, L * S * (E + Ev) * 2, [&](int64_t b0, int64_t b1) {
    std::vector<A> qs, ks, vs, os;
    for (int64_t b = b0; b < b1; ++b) {
      const A* Q = widen(pq + b * L * E, L * E, qs);
      const A* K = widen(pk + b * S * E, S * E, ks);
      const A* V = widen(pv + b * S * Ev, S * Ev, vs);
      A* P = pp + b * L * S;
      if (S > 0) blas_gemm(false, true, L, S, E, A(scale), Q, E, K, E, A(0), P, S);
      for (int64_t i = 0; i < L; ++i) rows.softmax(P + i * S, b * L + i);  // over the keys this query may attend
      A* O = result_buffer(po + b * L * Ev, L * Ev, os);
      if (S > 0) {
        blas_gemm(false, false, L, Ev, S, A(1), P, S, V, Ev, A(0), O, Ev);
      } else {
        std::fill_n(O, L * Ev, A(0));
      }
      store(O, po + b * L * Ev, L * Ev);
    }
  });
}

void cpu_attention(const Tensor& q, const Tensor& k, const Tensor& v, const kernels::AttentionMaskArgs& mask,
                   double scale, Tensor& out, Tensor& probs) {
  BOOSTER_DISPATCH_FLOATING(q.dtype(), "scaled_dot_product_attention",
                            [&] { attention_impl<scalar_t>(q, k, v, mask, scale, out, probs); });
}

template <class T>
void attention_backward_impl(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& probs, double scale, Tensor& dq, Tensor& dk, Tensor& dv) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    if (onednn::bf16_gemm_enabled() && attention_backward_onednn(grad_out, q, k, v, probs, scale, dq, dk, dv)) return;
  }
  using A = acc_t<T>;
  const int64_t B = q.size(0), L = q.size(1), E = q.size(2), S = k.size(1), Ev = v.size(2);
  const T* pg = cptr<T>(grad_out);
  const T* pq = cptr<T>(q);
  const T* pk = cptr<T>(k);
  const T* pv = cptr<T>(v);
  const A* pp = cptr<A>(probs);
  T* pdq = dq.defined() ? mptr<T>(dq) : nullptr;
  T* pdk = dk.defined() ? mptr<T>(dk) : nullptr;
  T* pdv = dv.defined() ? mptr<T>(dv) : nullptr;
  for_heads(B, L * S * (E + Ev) * 4, [&](int64_t b0, int64_t b1) {
    std::vector<A> gs, qs, ks, vs, dqs, dks, dvs, dp;
    for (int64_t b = b0; b < b1; ++b) {
      const A* P = pp + b * L * S;
      const A* dO = widen(pg + b * L * Ev, L * Ev, gs);
      if (pdv) {  // dV = P^T dO
        A* DV = result_buffer(pdv + b * S * Ev, S * Ev, dvs);
        blas_gemm(true, false, S, Ev, L, A(1), P, S, dO, Ev, A(0), DV, Ev);
        store(DV, pdv + b * S * Ev, S * Ev);
      }
      if (!pdq && !pdk) continue;
      // dP = dO V^T, then dS = P * (dP - rowsum(dP * P)) in place. Masked entries have P = 0, so dS = 0.
      const A* V = widen(pv + b * S * Ev, S * Ev, vs);
      dp.resize(size_t(L * S));
      A* dS = dp.data();
      blas_gemm(false, true, L, S, Ev, A(1), dO, Ev, V, Ev, A(0), dS, S);
      for (int64_t i = 0; i < L; ++i) {
        const A* pr = P + i * S;
        A* dr = dS + i * S;
        A dot = 0;
        #pragma omp simd reduction(+ : dot)
        for (int64_t j = 0; j < S; ++j) dot += dr[j] * pr[j];
        for (int64_t j = 0; j < S; ++j) dr[j] = pr[j] * (dr[j] - dot);
      }
      if (pdq) {  // dQ = dS K * scale
        const A* K = widen(pk + b * S * E, S * E, ks);
        A* DQ = result_buffer(pdq + b * L * E, L * E, dqs);
        blas_gemm(false, false, L, E, S, A(scale), dS, S, K, E, A(0), DQ, E);
        store(DQ, pdq + b * L * E, L * E);
      }
      if (pdk) {  // dK = dS^T Q * scale
        const A* Q = widen(pq + b * L * E, L * E, qs);
        A* DK = result_buffer(pdk + b * S * E, S * E, dks);
        blas_gemm(true, false, S, E, L, A(scale), dS, S, Q, E, A(0), DK, E);
        store(DK, pdk + b * S * E, S * E);
      }
    }
  });
}

void cpu_attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& probs, double scale, Tensor& dq, Tensor& dk, Tensor& dv) {
  BOOSTER_DISPATCH_FLOATING(q.dtype(), "scaled_dot_product_attention_backward", [&] {
    attention_backward_impl<scalar_t>(grad_out, q, k, v, probs, scale, dq, dk, dv);
  });
}

}  // namespace
}  // namespace booster::cpu

namespace booster::kernels {
BOOSTER_REGISTER_CPU_KERNEL(attention_kernel, &cpu::cpu_attention);
BOOSTER_REGISTER_CPU_KERNEL(attention_backward_kernel, &cpu::cpu_attention_backward);
}  // namespace booster::kernels
