// CPU fixed_order_gemm_kernel (kernels/gemm.h): the convolution's GEMM with every output element summed
// in one order, wherever it lies (Note [Position-independent rounding] in ops/conv.cpp).
//
// Note [A GEMM that rounds alike everywhere]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// C = A B is cut into tiles of kRows rows by kCols columns, and every tile, interior or edge, runs
// through the one micro-kernel `tile`: its accumulators start at zero and take k = 0, 1, ..., K - 1 in
// turn, acc += a[r][k] * b[k][j], one vector lane per column. An edge tile is not a different code
// path: the rows of A are packed into blocks of kRows, the missing ones zero, and a partial block of
// columns is copied into a zero-padded panel first, its results copied out. Threads split the column
// panels, never a dot product. So each element meets the same instructions on the same operands in
// the same order, and equal inputs round to equal outputs at every position, whatever the BLAS
// library or the number of threads. Whether a * b + c is fused is the ISA build's choice
// (-ffp-contract): it is the same for every lane of one build, which is all the guarantee needs. The
// tile keeps kRows x kCols accumulators in registers: 4 x 64 floats in 16 zmm with AVX-512, 4 x 16 in 8
// ymm with AVX2, 4 x 8 in 8 xmm otherwise.
#include <algorithm>
#include <vector>

#include "booster/backends/cpu/convert.h"
#include "booster/backends/cpu/loops.h"
#include "booster/kernels/gemm.h"

namespace booster::cpu {
namespace {

#if defined(__AVX512F__)
constexpr int kVectorBytes = 64;
#elif defined(__AVX__)
constexpr int kVectorBytes = 32;
#else
constexpr int kVectorBytes = 16;
#endif
constexpr int kRows = 4;
constexpr int kVectorsPerRow = kVectorBytes == 64 ? 4 : 2;

template <class A>
struct TileShape {
  using Vec [[gnu::vector_size(kVectorBytes)]] = A;
  // The same vector at any element alignment: loads and stores of rows that start anywhere.
  using UnalignedVec [[gnu::vector_size(kVectorBytes), gnu::aligned(alignof(A)), gnu::may_alias]] = A;
  static constexpr int kLanes = kVectorBytes / int(sizeof(A));
  static constexpr int kCols = kLanes * kVectorsPerRow;
};

// c[r][j] = sum_k a[k][r] * b[k][j] over k = 0 .. K-1 in order, for the kRows x kCols tile; a is the
// packed block [K][kRows], b rows ldb apart, c rows ldc apart. The one code every element goes through.
template <class A>
[[gnu::noinline]] void tile(const A* a, const A* b, int64_t ldb, A* c, int64_t ldc, int64_t k) {
  using S = TileShape<A>;
  using Vec = typename S::Vec;
  using Unaligned = typename S::UnalignedVec;
  Vec acc[kRows][kVectorsPerRow] = {};
  for (int64_t p = 0; p < k; ++p) {
    Vec bv[kVectorsPerRow];
#pragma GCC unroll 8
    for (int v = 0; v < kVectorsPerRow; ++v) bv[v] = *reinterpret_cast<const Unaligned*>(b + p * ldb + v * S::kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const A ar = a[p * kRows + r];
#pragma GCC unroll 8
      for (int v = 0; v < kVectorsPerRow; ++v) acc[r][v] += ar * bv[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < kVectorsPerRow; ++v) *reinterpret_cast<Unaligned*>(c + r * ldc + v * S::kLanes) = acc[r][v];
}

// Per-thread scratch that keeps its capacity.
template <class A>
A* scratch(int slot, size_t n) {
  thread_local std::vector<A> buffers[2];
  std::vector<A>& v = buffers[slot];
  if (v.size() < n) v.resize(n);
  return v.data();
}

template <class T>
void fixed_order_gemm(const Tensor& a_t, const Tensor& b_t, Tensor& c_t) {
  using A = typename acc_type<T>::type;
  using S = TileShape<A>;
  constexpr int64_t C = S::kCols;
  const int64_t groups = a_t.size(0), m = a_t.size(1), k = a_t.size(2);
  const int64_t batch = b_t.size(0), n = b_t.size(2);
  if (batch == 0 || m == 0 || n == 0) return;
  const int64_t row_blocks = (m + kRows - 1) / kRows, col_blocks = (n + C - 1) / C;
  const T* pa = static_cast<const T*>(a_t.data_ptr());
  const T* pb = static_cast<const T*>(b_t.data_ptr());
  T* pc = static_cast<T*>(c_t.data_ptr());

  // A packed per group into row blocks [row_blocks][K][kRows], missing rows zero, in the compute type.
  std::vector<A> packed(size_t(groups * row_blocks * k * kRows), A(0));
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t p = 0; p < k; ++p)
        packed[size_t(((g * row_blocks + i / kRows) * k + p) * kRows + i % kRows)] = A(pa[(g * m + i) * k + p]);

  parallel_for(batch * col_blocks, m * k * C, [&](int64_t tb, int64_t te) {
    A* panel = scratch<A>(0, size_t(k * C));   // a partial or 16-bit column block, in the compute type
    A* out = scratch<A>(1, size_t(kRows * C));  // an edge or 16-bit tile's result
    for (int64_t t = tb; t < te; ++t) {
      const int64_t bi = t / col_blocks, j0 = t % col_blocks * C, cols = std::min<int64_t>(C, n - j0);
      const T* b = pb + bi * k * n + j0;
      T* c = pc + bi * m * n + j0;
      const A* block_a = packed.data() + size_t((bi % groups) * row_blocks * k * kRows);
      const A* panel_b = nullptr;
      int64_t ldb = n;
      if constexpr (std::is_same_v<T, A>) {
        if (cols == C) panel_b = b;
      }
      if (!panel_b) {
        for (int64_t p = 0; p < k; ++p) {
          load_block(b + p * n, panel + p * C, cols);
          std::fill(panel + p * C + cols, panel + (p + 1) * C, A(0));
        }
        panel_b = panel;
        ldb = C;
      }
      for (int64_t rb = 0; rb < row_blocks; ++rb) {
        const int64_t rows = std::min<int64_t>(kRows, m - rb * kRows);
        const A* a = block_a + rb * k * kRows;
        T* c_rows = c + rb * kRows * n;
        if constexpr (std::is_same_v<T, A>) {
          if (rows == kRows && cols == C) {
            tile<A>(a, panel_b, ldb, c_rows, n, k);
            continue;
          }
        }
        tile<A>(a, panel_b, ldb, out, C, k);
        for (int64_t r = 0; r < rows; ++r) store_block(out + r * C, c_rows + r * n, cols);
      }
    }
  });
}

void cpu_fixed_order_gemm(const Tensor& a, const Tensor& b, Tensor& c) {
  BOOSTER_CHECK(a.dim() == 3 && b.dim() == 3 && c.dim() == 3 && a.size(0) > 0 && b.size(0) % a.size(0) == 0 &&
                    b.size(1) == a.size(2) && c.size(0) == b.size(0) && c.size(1) == a.size(1) && c.size(2) == b.size(2),
                ShapeError, "fixed_order_gemm: expected A [G, M, K], B [batch, K, N], C [batch, M, N] with G dividing "
                "batch, got ", a.shape(), ", ", b.shape(), ", ", c.shape());
  BOOSTER_CHECK(a.dtype() == b.dtype() && a.dtype() == c.dtype(), DTypeError, "fixed_order_gemm: dtypes differ: ",
                a.dtype(), ", ", b.dtype(), ", ", c.dtype());
  BOOSTER_CHECK(a.is_contiguous() && b.is_contiguous() && c.is_contiguous(), ValueError,
                "fixed_order_gemm: operands must be contiguous");
  BOOSTER_DISPATCH_FLOATING(c.dtype(), "fixed_order_gemm", [&] { fixed_order_gemm<scalar_t>(a, b, c); });
}

}  // namespace
}  // namespace booster::cpu

namespace booster::kernels {
BOOSTER_REGISTER_CPU_KERNEL(fixed_order_gemm_kernel, &cpu::cpu_fixed_order_gemm);
}  // namespace booster::kernels
