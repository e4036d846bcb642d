// Fused attention for float16/bfloat16 on the GPU, FlashAttention-2's algorithm on the tensor cores
// (mma.sync m16n8k16, float32 accumulation): scores never reach device memory. The forward keeps
// only the log-sum-exp of each row; the backward recomputes the probabilities from it. q, k, v, out
// and the gradients are read and written with their own strides, so the heads of a fused qkv
// projection need no transposing copies. Note [Flash attention fragments] says how the tiles map to
// the tensor-core fragments.
#include "booster/backends/cuda/common.cuh"
#include "booster/kernels/nn.h"

namespace booster::cuda {
namespace {

// Note [Flash attention fragments]
// A block of 4 warps takes 64 rows (forward: queries, 16 per warp; backward: keys, 16 per warp) and
// walks the other side in tiles of 64. Every product is mma.m16n8k16 with these per-lane fragments
// (g = lane / 4, t = lane % 4; each 32-bit register holds two adjacent 16-bit values, lower index in
// the low half):
//   A (16 x 16, row-major): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16 x 8, k x n):      b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C (16 x 8, float):      c0, c1 = (g, 2t), (g, 2t+1); c2, c3 = (g+8, 2t), (g+8, 2t+1)
// So an A operand is read from a row-major tile, and a B operand from a tile stored n-major (B^T
// row-major): K for Q K^T, V^T for P V. The C fragments of two adjacent n-tiles are the A fragment
// of the next product's 16-wide k-step, which is how P (and dS) go from one product to the next
// without shared memory. Shared-memory rows are padded by 8 elements (16 bytes), which spreads the
// 8 rows a fragment load touches over all 32 banks.
constexpr int kTile = 64;
constexpr int kThreads = 128;
constexpr int kPad = 8;
constexpr float kLog2e = 1.4426950408889634f;

template <class T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <class T> __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1);
template <> __device__ __forceinline__ void mma<__half>(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma<__nv_bfloat16>(float c[4], const uint32_t a[4], uint32_t b0,
                                                               uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t ld32(const void* p) { return *static_cast<const uint32_t*>(p); }

// The A fragment of a 16-wide k-step made of the C fragments of two adjacent n-tiles, rounded to T
// (Note [Flash attention fragments]).
template <class T>
__device__ __forceinline__ void c_to_a(const float (&lo)[4], const float (&hi)[4], uint32_t (&a)[4]) {
  a[0] = pack2<T>(lo[0], lo[1]);
  a[1] = pack2<T>(lo[2], lo[3]);
  a[2] = pack2<T>(hi[0], hi[1]);
  a[3] = pack2<T>(hi[2], hi[3]);
}

// acc (16 x 64) += A (this warp's 16 rows x E, fragments in registers) times tile^T, for a row-major
// [64][E + kPad] tile: the warp's rows against each of the tile's 64 rows (Q K^T, K Q^T, V dO^T).
template <class T, int E>
__device__ __forceinline__ void mma_rows(float (&acc)[kTile / 8][4], const uint32_t (&af)[E / 16][4],
                                         const T (*tile)[E + kPad], int g, int t) {
#pragma unroll
  for (int kk = 0; kk < E / 16; ++kk)
#pragma unroll
    for (int nt = 0; nt < kTile / 8; ++nt)
      mma<T>(acc[nt], af[kk], ld32(&tile[nt * 8 + g][kk * 16 + 2 * t]), ld32(&tile[nt * 8 + g][kk * 16 + 2 * t + 8]));
}

// acc (16 x E) += C (16 x 64, C fragments rounded to T) times B, for B [64][E] stored transposed as a
// [E][64 + kPad] tile (P V, P^T dO, dS^T Q).
template <class T, int E>
__device__ __forceinline__ void mma_cols(float (&acc)[E / 8][4], const float (&c)[kTile / 8][4],
                                         const T (*tile_t)[kTile + kPad], int g, int t) {
#pragma unroll
  for (int kk = 0; kk < kTile / 16; ++kk) {
    uint32_t a[4];
    c_to_a<T>(c[2 * kk], c[2 * kk + 1], a);
#pragma unroll
    for (int dt = 0; dt < E / 8; ++dt)
      mma<T>(acc[dt], a, ld32(&tile_t[dt * 8 + g][kk * 16 + 2 * t]), ld32(&tile_t[dt * 8 + g][kk * 16 + 2 * t + 8]));
  }
}

// Where a [batch, heads, length, E] operand lives: element strides of batch, head and position (the
// head dimension is contiguous).
struct Operand {
  void* ptr;
  int64_t sb, sh, st;
};
Operand operand(const Tensor& t) {
  if (t.dim() == 4) return {t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
  return {t.data_ptr(), t.stride(0), 0, t.stride(1)};  // [batch, length, E]: one head
}

template <class T>
__device__ __forceinline__ const T* row_ptr(const Operand& o, int b, int h, int64_t pos) {
  return static_cast<const T*>(o.ptr) + b * o.sb + h * o.sh + pos * o.st;
}

// rows x E tile from global (rows past `limit` read as zeros) into shared memory, row-major with
// stride E + kPad; 16-byte loads.
template <class T, int E>
__device__ __forceinline__ void load_rows(T (*dst)[E + kPad], const Operand& o, int b, int h, int64_t r0, int64_t limit) {
  constexpr int kVec = 8, kPerRow = E / kVec;
  for (int i = threadIdx.x; i < kTile * kPerRow; i += kThreads) {
    const int r = i / kPerRow, c = (i % kPerRow) * kVec;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r0 + r < limit) v = *reinterpret_cast<const uint4*>(row_ptr<T>(o, b, h, r0 + r) + c);
    *reinterpret_cast<uint4*>(&dst[r][c]) = v;
  }
}
// The same tile transposed: dst[e][r], stride kTile + kPad.
template <class T, int E>
__device__ __forceinline__ void load_rows_transposed(T (*dst)[kTile + kPad], const Operand& o, int b, int h,
                                                     int64_t r0, int64_t limit) {
  constexpr int kVec = 8, kPerRow = E / kVec;
  for (int i = threadIdx.x; i < kTile * kPerRow; i += kThreads) {
    const int r = i / kPerRow, c = (i % kPerRow) * kVec;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r0 + r < limit) v = *reinterpret_cast<const uint4*>(row_ptr<T>(o, b, h, r0 + r) + c);
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int j = 0; j < kVec; ++j) dst[c + j][r] = e[j];
  }
}

struct Geometry {
  int H, L, S;
  float scale_log2;  // softmax scale * log2(e): the kernels work in base 2
  bool causal;       // query i sees keys j <= offset + i
  int offset;        // query i sits at key position offset + i (kernels::AttentionMaskArgs)
  int window;        // > 0: query i sees keys j with offset + i - j < window
  const int64_t* seg;  // [B, S] document ids (batch b's row b), or null: a query sees its document only

  // Whether query `row` of batch b may not attend key `col` (Note [Attention masks] in
  // ops/nn_functional.cpp). Rows past L are never stored; their document id is read clamped.
  __device__ __forceinline__ bool masked(int b, int row, int col) const {
    const int pos = offset + row;
    if (col >= S || (causal && col > pos) || (window > 0 && pos - col >= window)) return true;
    return seg != nullptr && seg[int64_t(b) * S + col] != seg[int64_t(b) * S + min(pos, S - 1)];
  }
  // The key tiles query tile [q0, q0 + 64) may see: [first, end).
  __device__ __forceinline__ int first_key(int q0) const {
    return window > 0 ? max(0, offset + q0 - window + 1) / kTile * kTile : 0;
  }
  __device__ __forceinline__ int key_end(int q0) const { return causal ? min(S, offset + q0 + kTile) : S; }
  // The query tiles key tile [k0, k0 + 64) is seen by: [first, end).
  __device__ __forceinline__ int first_query(int k0) const { return causal ? max(0, k0 - offset) / kTile * kTile : 0; }
  __device__ __forceinline__ int query_end(int k0) const {
    return window > 0 ? min(L, max(0, k0 + kTile + window - 1 - offset)) : L;
  }
};

// ------------------------------------------------------------------------------------------ forward
// grid (ceil(L / 64), B * H). lse: [B, H, L] float32, natural log of sum_j exp(scale q_i . k_j).
// Shared memory is dynamic: at E = 128 the three tiles take 52 KiB, past the 48 KiB a static
// allocation may use.
template <class T, int E>
struct ForwardShared {
  T q[kTile][E + kPad];   // Q tile, row-major
  T k[kTile][E + kPad];   // K tile, row-major: B operand of S = Q K^T
  T vt[E][kTile + kPad];  // V^T: B operand of O += P V
};

template <class T, int E>
__global__ void __launch_bounds__(kThreads) flash_forward(Operand q, Operand k, Operand v, Operand out, float* lse,
                                                          Geometry geo) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<ForwardShared<T, E>*>(smem_raw);
  auto& sQ = sm.q;
  auto& sK = sm.k;
  auto& sVt = sm.vt;
  const int b = blockIdx.y / geo.H, h = blockIdx.y % geo.H;
  const int q0 = blockIdx.x * kTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int row0 = q0 + warp * 16 + g, row1 = row0 + 8;  // this lane's two query rows

  load_rows<T, E>(sQ, q, b, h, q0, geo.L);
  __syncthreads();
  uint32_t qf[E / 16][4];
#pragma unroll
  for (int kk = 0; kk < E / 16; ++kk) {
    const int r = warp * 16 + g, c = kk * 16 + 2 * t;
    qf[kk][0] = ld32(&sQ[r][c]);
    qf[kk][1] = ld32(&sQ[r + 8][c]);
    qf[kk][2] = ld32(&sQ[r][c + 8]);
    qf[kk][3] = ld32(&sQ[r + 8][c + 8]);
  }
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float o[E / 8][4] = {};

  const int key_end = geo.key_end(q0);
  for (int k0 = geo.first_key(q0); k0 < key_end; k0 += kTile) {
    __syncthreads();
    load_rows<T, E>(sK, k, b, h, k0, geo.S);
    load_rows_transposed<T, E>(sVt, v, b, h, k0, geo.S);
    __syncthreads();
    float s[kTile / 8][4] = {};
    mma_rows<T, E>(s, qf, sK, g, t);
    // Scale into base 2, mask, and the running maximum of each of the two rows.
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int nt = 0; nt < kTile / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = k0 + nt * 8 + 2 * t + (e & 1), row = e < 2 ? row0 : row1;
        s[nt][e] = geo.masked(b, row, col) ? -INFINITY : s[nt][e] * geo.scale_log2;
        mx[e / 2] = fmaxf(mx[e / 2], s[nt][e]);
      }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    }
    float corr[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      // A row with every key so far masked keeps max -inf: subtract 0 instead, so exp2 gives 0, not NaN.
      const float base = mx[i] == -INFINITY ? 0.f : mx[i];
      corr[i] = exp2f(m[i] - base);
      m[i] = mx[i];
      l[i] *= corr[i];
#pragma unroll
      for (int nt = 0; nt < kTile / 8; ++nt) {
        s[nt][2 * i] = exp2f(s[nt][2 * i] - base);
        s[nt][2 * i + 1] = exp2f(s[nt][2 * i + 1] - base);
        l[i] += s[nt][2 * i] + s[nt][2 * i + 1];
      }
    }
#pragma unroll
    for (int dt = 0; dt < E / 8; ++dt) {
      o[dt][0] *= corr[0];
      o[dt][1] *= corr[0];
      o[dt][2] *= corr[1];
      o[dt][3] *= corr[1];
    }
    // o += P V, P rounded to T as the A operand.
    mma_cols<T, E>(o, s, sVt, g, t);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
  const float inv[2] = {l[0] > 0.f ? 1.f / l[0] : 0.f, l[1] > 0.f ? 1.f / l[1] : 0.f};
  const int rows[2] = {row0, row1};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (rows[i] >= geo.L) continue;
    T* dst = static_cast<T*>(out.ptr) + b * out.sb + h * out.sh + int64_t(rows[i]) * out.st;
#pragma unroll
    for (int dt = 0; dt < E / 8; ++dt)
      *reinterpret_cast<uint32_t*>(dst + dt * 8 + 2 * t) = pack2<T>(o[dt][2 * i] * inv[i], o[dt][2 * i + 1] * inv[i]);
    if (t == 0)
      lse[(int64_t(b) * geo.H + h) * geo.L + rows[i]] =
          l[i] > 0.f ? (m[i] + log2f(l[i])) / kLog2e : -INFINITY;
  }
}

// ----------------------------------------------------------------------------------------- backward
// delta[b, h, i] = sum_e dO[i, e] O[i, e] (float32), one warp per row.
template <class T, int E>
__global__ void flash_backward_delta(Operand dout, Operand out, float* delta, int H, int L, int64_t rows) {
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const int b = int(row / (int64_t(H) * L)), h = int(row / L % H);
  const int64_t i = row % L;
  const T* go = row_ptr<T>(dout, b, h, i);
  const T* oo = row_ptr<T>(out, b, h, i);
  float acc = 0.f;
  for (int e = lane; e < E; e += 32) acc += load_as<float>(go[e]) * load_as<float>(oo[e]);
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) delta[row] = acc;
}

// grid (ceil(S / 64), B * H): a block owns 64 keys (16 per warp), accumulates their dK and dV over
// every query tile that sees them, and adds its share of dQ into dq_acc (float32 [B, H, L, E]) with
// atomics. lse2 / delta: [B, H, L] float32 (lse2 in base 2).
template <class T, int E>
struct BackwardShared {
  T q[kTile][E + kPad];       // Q tile, row-major: B operand of S^T = K Q^T
  T qt[E][kTile + kPad];      // Q^T: B operand of dK += dS^T Q
  T dout[kTile][E + kPad];    // dO: B operand of dP^T = V dO^T
  T doutt[E][kTile + kPad];   // dO^T: B operand of dV += P^T dO
  T kt[E][kTile + kPad];      // K^T: B operand of dQ += dS K
  T ds[kTile][kTile + kPad];  // dS [query][key]: A operand of dQ += dS K
  float lse2[kTile], delta[kTile];
};

template <class T, int E>
__global__ void __launch_bounds__(kThreads) flash_backward(Operand q, Operand k, Operand v, Operand dout,
                                                           const float* lse, const float* delta, float* dq_acc,
                                                           Operand dk, Operand dv, Geometry geo) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<BackwardShared<T, E>*>(smem_raw);
  const int b = blockIdx.y / geo.H, h = blockIdx.y % geo.H;
  const int k0 = blockIdx.x * kTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int key0 = k0 + warp * 16 + g, key1 = key0 + 8;  // this lane's two key rows

  // This warp's 16 rows of K and of V as A fragments, straight from global memory (once per block).
  uint32_t kf[E / 16][4], vf[E / 16][4];
  {
    const T* kr0 = row_ptr<T>(k, b, h, min(key0, geo.S - 1));
    const T* kr1 = row_ptr<T>(k, b, h, min(key1, geo.S - 1));
    const T* vr0 = row_ptr<T>(v, b, h, min(key0, geo.S - 1));
    const T* vr1 = row_ptr<T>(v, b, h, min(key1, geo.S - 1));
    const bool in0 = key0 < geo.S, in1 = key1 < geo.S;
#pragma unroll
    for (int kk = 0; kk < E / 16; ++kk) {
      const int c = kk * 16 + 2 * t;
      kf[kk][0] = in0 ? ld32(kr0 + c) : 0u;
      kf[kk][1] = in1 ? ld32(kr1 + c) : 0u;
      kf[kk][2] = in0 ? ld32(kr0 + c + 8) : 0u;
      kf[kk][3] = in1 ? ld32(kr1 + c + 8) : 0u;
      vf[kk][0] = in0 ? ld32(vr0 + c) : 0u;
      vf[kk][1] = in1 ? ld32(vr1 + c) : 0u;
      vf[kk][2] = in0 ? ld32(vr0 + c + 8) : 0u;
      vf[kk][3] = in1 ? ld32(vr1 + c + 8) : 0u;
    }
  }
  load_rows_transposed<T, E>(sm.kt, k, b, h, k0, geo.S);
  float dkacc[E / 8][4] = {}, dvacc[E / 8][4] = {};
  const int64_t bh = int64_t(b) * geo.H + h;

  // Causal: query tiles before the one holding query k0 see none of these keys; with a window, nor do
  // the tiles past the last query whose window reaches them.
  const int q_end = geo.query_end(k0);
  for (int q0 = geo.first_query(k0); q0 < q_end; q0 += kTile) {
    __syncthreads();
    load_rows<T, E>(sm.q, q, b, h, q0, geo.L);
    load_rows_transposed<T, E>(sm.qt, q, b, h, q0, geo.L);
    load_rows<T, E>(sm.dout, dout, b, h, q0, geo.L);
    load_rows_transposed<T, E>(sm.doutt, dout, b, h, q0, geo.L);
    for (int i = threadIdx.x; i < kTile; i += kThreads) {
      const bool in = q0 + i < geo.L;
      sm.lse2[i] = in ? lse[bh * geo.L + q0 + i] * kLog2e : INFINITY;
      sm.delta[i] = in ? delta[bh * geo.L + q0 + i] : 0.f;
    }
    __syncthreads();

    // S^T (16 keys x 64 queries) = K Q^T, then P^T = exp2(scale S^T - lse2[query]) with the mask.
    float p[kTile / 8][4] = {};
    mma_rows<T, E>(p, kf, sm.q, g, t);
#pragma unroll
    for (int nt = 0; nt < kTile / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = nt * 8 + 2 * t + (e & 1), key = e < 2 ? key0 : key1;
        const bool masked = q0 + qc >= geo.L || geo.masked(b, q0 + qc, key);
        p[nt][e] = masked ? 0.f : exp2f(p[nt][e] * geo.scale_log2 - sm.lse2[qc]);
      }
    // dV += P^T dO.
    mma_cols<T, E>(dvacc, p, sm.doutt, g, t);
    // dP^T = V dO^T; dS^T = P^T (dP^T - delta[query]) (the gradient of the scaled scores).
    float ds[kTile / 8][4] = {};
    mma_rows<T, E>(ds, vf, sm.dout, g, t);
#pragma unroll
    for (int nt = 0; nt < kTile / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) ds[nt][e] = p[nt][e] * (ds[nt][e] - sm.delta[nt * 8 + 2 * t + (e & 1)]);
    // dK += dS^T Q (scaled at the end), and dS stored [query][key] for dQ.
    mma_cols<T, E>(dkacc, ds, sm.qt, g, t);
#pragma unroll
    for (int nt = 0; nt < kTile / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        sm.ds[nt * 8 + 2 * t + (e & 1)][warp * 16 + g + (e < 2 ? 0 : 8)] = store_as<T>(ds[nt][e]);
    __syncthreads();
    // dQ (this warp: 16 queries x E) += scale dS K, added into dq_acc.
    float dqacc[E / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) {
      const int r = warp * 16 + g, c = kk * 16 + 2 * t;
      const uint32_t a[4] = {ld32(&sm.ds[r][c]), ld32(&sm.ds[r + 8][c]), ld32(&sm.ds[r][c + 8]),
                             ld32(&sm.ds[r + 8][c + 8])};
#pragma unroll
      for (int dt = 0; dt < E / 8; ++dt)
        mma<T>(dqacc[dt], a, ld32(&sm.kt[dt * 8 + g][c]), ld32(&sm.kt[dt * 8 + g][c + 8]));
    }
    const float scale = geo.scale_log2 / kLog2e;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = q0 + warp * 16 + g + 8 * i;
      if (row >= geo.L) continue;
      float* dst = dq_acc + (bh * geo.L + row) * E;
#pragma unroll
      for (int dt = 0; dt < E / 8; ++dt) {
        atomicAdd(dst + dt * 8 + 2 * t, scale * dqacc[dt][2 * i]);
        atomicAdd(dst + dt * 8 + 2 * t + 1, scale * dqacc[dt][2 * i + 1]);
      }
    }
  }
  const float scale = geo.scale_log2 / kLog2e;
  const int keys[2] = {key0, key1};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (keys[i] >= geo.S) continue;
    T* dkr = static_cast<T*>(dk.ptr) + b * dk.sb + h * dk.sh + int64_t(keys[i]) * dk.st;
    T* dvr = static_cast<T*>(dv.ptr) + b * dv.sb + h * dv.sh + int64_t(keys[i]) * dv.st;
#pragma unroll
    for (int dt = 0; dt < E / 8; ++dt) {
      *reinterpret_cast<uint32_t*>(dkr + dt * 8 + 2 * t) =
          pack2<T>(scale * dkacc[dt][2 * i], scale * dkacc[dt][2 * i + 1]);
      *reinterpret_cast<uint32_t*>(dvr + dt * 8 + 2 * t) = pack2<T>(dvacc[dt][2 * i], dvacc[dt][2 * i + 1]);
    }
  }
}

// dq (any strides, last 1) = dq_acc (float32 [B, H, L, E]) rounded once.
template <class T, int E>
__global__ void flash_backward_dq(const float* dq_acc, Operand dq, int H, int L, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int e = int(i % E);
  const int64_t row = i / E;
  const int b = int(row / (int64_t(H) * L)), h = int(row / L % H);
  T* dst = static_cast<T*>(dq.ptr) + b * dq.sb + h * dq.sh + (row % L) * dq.st;
  dst[e] = store_as<T>(dq_acc[i]);
}

Geometry geometry(const Tensor& q, const Tensor& k, const kernels::AttentionMaskArgs& mask, double scale) {
  const int nd = int(q.dim());
  const int64_t* seg = mask.segments.defined() ? static_cast<const int64_t*>(mask.segments.data_ptr()) : nullptr;
  return {nd == 4 ? int(q.size(1)) : 1, int(q.size(nd - 2)), int(k.size(nd - 2)), float(scale * kLog2e), mask.causal,
          int(mask.offset), int(std::min<int64_t>(mask.window, INT32_MAX)), seg};
}

// f.template operator()<T, E>() for the tensor's 16-bit dtype and a head size of 16, 32, 64 or 128
// (128: Llama's, and most large models').
template <class F>
void with_flash_types(DType dt, int64_t E, F&& f) {
  auto by_size = [&]<class T>() {
    switch (E) {
      case 16: return f.template operator()<T, 16>();
      case 32: return f.template operator()<T, 32>();
      case 64: return f.template operator()<T, 64>();
      case 128: return f.template operator()<T, 128>();
      default: BOOSTER_FAIL(ShapeError, "flash attention: head size ", E, " is not 16, 32, 64 or 128");
    }
  };
  if (dt == DType::Float16) by_size.template operator()<__half>();
  else if (dt == DType::BFloat16) by_size.template operator()<__nv_bfloat16>();
  else BOOSTER_FAIL(DTypeError, "flash attention: expected float16 or bfloat16, got ", dt);
}

void cuda_flash_attention(const Tensor& q, const Tensor& k, const Tensor& v, const kernels::AttentionMaskArgs& mask,
                          double scale, Tensor& out, Tensor& lse) {
  const int dev = device_of(q);
  const int64_t E = q.size(-1), batch = q.size(0);
  const Geometry geo = geometry(q, k, mask, scale);
  if (batch == 0 || geo.L == 0) return;
  with_flash_types(q.dtype(), E, [&]<class T, int D>() {
    constexpr int kSmem = int(sizeof(ForwardShared<T, D>));
    if constexpr (kSmem > 48 * 1024)  // over the default limit: allow it (per device, so on every call)
      BOOSTER_CUDA_CHECK(cudaFuncSetAttribute(flash_forward<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    const dim3 grid(unsigned((geo.L + kTile - 1) / kTile), unsigned(batch * geo.H));
    flash_forward<T, D><<<grid, kThreads, kSmem, stream(dev)>>>(operand(q), operand(k), operand(v), operand(out),
                                                               static_cast<float*>(lse.data_ptr()), geo);
    BOOSTER_CUDA_CHECK_LAUNCH();
  });
}

void cuda_flash_attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Tensor& out, const Tensor& lse, const kernels::AttentionMaskArgs& mask,
                                   double scale, Tensor& dq, Tensor& dk, Tensor& dv) {
  const int dev = device_of(q);
  const int64_t E = q.size(-1), batch = q.size(0);
  const Geometry geo = geometry(q, k, mask, scale);
  if (batch == 0 || geo.L == 0 || geo.S == 0) return;
  const int64_t rows = batch * geo.H * geo.L;
  Tensor delta = Tensor::empty({rows}, DType::Float32, q.device());
  Tensor dq_acc = Tensor::empty({rows * E}, DType::Float32, q.device());
  BOOSTER_CUDA_CHECK(cudaMemsetAsync(dq_acc.data_ptr(), 0, size_t(rows * E) * sizeof(float), stream(dev)));
  with_flash_types(q.dtype(), E, [&]<class T, int D>() {
    flash_backward_delta<T, D><<<unsigned((rows + 7) / 8), 256, 0, stream(dev)>>>(
        operand(grad_out), operand(out), static_cast<float*>(delta.data_ptr()), geo.H, geo.L, rows);
    BOOSTER_CUDA_CHECK_LAUNCH();
    // Over the default 48 KiB of shared memory: allow it (per device, so on every call; it is cheap).
    constexpr int kSmem = int(sizeof(BackwardShared<T, D>));
    BOOSTER_CUDA_CHECK(cudaFuncSetAttribute(flash_backward<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    const dim3 grid(unsigned((geo.S + kTile - 1) / kTile), unsigned(batch * geo.H));
    flash_backward<T, D><<<grid, kThreads, kSmem, stream(dev)>>>(
        operand(q), operand(k), operand(v), operand(grad_out), static_cast<const float*>(lse.data_ptr()),
        static_cast<const float*>(delta.data_ptr()), static_cast<float*>(dq_acc.data_ptr()), operand(dk),
        operand(dv), geo);
    BOOSTER_CUDA_CHECK_LAUNCH();
    const int64_t n = rows * D;
    flash_backward_dq<T, D><<<unsigned((n + 255) / 256), 256, 0, stream(dev)>>>(
        static_cast<const float*>(dq_acc.data_ptr()), operand(dq), geo.H, geo.L, n);
    BOOSTER_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace
}  // namespace booster::cuda

namespace booster::kernels {
BOOSTER_REGISTER_CUDA_KERNEL(flash_attention_kernel, cuda::cuda_flash_attention);
BOOSTER_REGISTER_CUDA_KERNEL(flash_attention_backward_kernel, cuda::cuda_flash_attention_backward);
}  // namespace booster::kernels
