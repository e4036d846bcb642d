// The caches of compiled primitives and memoized plans, each reused with one key's shape while every
// other argument changes in turn: oneDNN's bfloat16 GEMM primitives (keyed by transposes, leading
// dimensions, batch strides, alpha, beta and the result type), oneDNN's convolution and pooling
// primitives (direction, type, bias, stride, padding, dilation, groups, kernel), the gather index of
// the convolution fallback (ops/conv.cpp, by geometry), and autocast's cast cache (a weight's cast, by
// tensor, version and dtype). A key that left an argument out would hand the second call the first
// call's primitive; every result is checked against a float64 loop written here, so it would fail.
// Each sequence returns to its first variant at the end, so an entry overwritten by a later variant
// is seen too.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "roundoff.h"
#include "skip.h"

#include "booster/autocast/autocast.h"
#include "booster/backends/onednn/onednn.h"
#include "booster/common/cpu_features.h"
#include "booster/kernels/gemm.h"
#include "booster/ops/ops.h"
#include "booster/tensor/grad_mode.h"
#include "booster/tensor/random.h"

using namespace booster;
namespace ro = ::testing::roundoff;

namespace {

struct GemmPathGuard {
  explicit GemmPathGuard(bool on) : previous(onednn::set_bf16_gemm(on)) {}
  ~GemmPathGuard() { onednn::set_bf16_gemm(previous); }
  bool previous;
};
struct ConvPathGuard {
  explicit ConvPathGuard(bool on) : previous(onednn::set_conv(on)) {}
  ~ConvPathGuard() { onednn::set_conv(previous); }
  bool previous;
};

// ------------------------------------------------------------------------------------ bfloat16 GEMM

// One problem of a fixed shape (batch 2, m 12, n 10, k 24) with everything else free.
struct GemmVariant {
  const char* what;
  bool trans_a = false, trans_b = false, broadcast_b = false, float32_result = false;
  int64_t pad_a = 0, pad_b = 0, pad_c = 0, pad_c_batch = 0;  // extra leading-dimension / batch-stride room
  double alpha = 1.0, beta = 0.0;
};

constexpr int64_t kBatch = 2, kM = 12, kN = 10, kK = 24;

// The largest |C - C64| of oneDNN's gemm_bf16 in units of its bound (tests/ops/test_onednn.cpp's:
// gamma_{k+2}(u32) sum |a b| plus one rounding to the result type), from the stored operands.
double gemm_worst(const GemmVariant& v, uint64_t seed) {
  Generator g(seed);
  // Stored matrices: A is m x k (k x m transposed), B k x n (n x k), each row ld apart.
  const int64_t a_rows = v.trans_a ? kK : kM, a_cols = v.trans_a ? kM : kK;
  const int64_t b_rows = v.trans_b ? kN : kK, b_cols = v.trans_b ? kK : kN;
  const int64_t lda = a_cols + v.pad_a, ldb = b_cols + v.pad_b, ldc = kN + v.pad_c;
  const int64_t b_batches = v.broadcast_b ? 1 : kBatch;
  const Tensor a = randn({kBatch, a_rows, lda}, &g).to(DType::BFloat16);
  const Tensor b = randn({b_batches, b_rows, ldb}, &g).to(DType::BFloat16);
  const int64_t c_batch = kM * ldc + v.pad_c_batch;
  const DType c_type = v.float32_result ? DType::Float32 : DType::BFloat16;
  Tensor c = randn({kBatch * c_batch}, &g).to(c_type);
  const std::vector<double> A = a.to(DType::Float64).tolist(), Bv = b.to(DType::Float64).tolist(),
                            C0 = c.to(DType::Float64).tolist();
  const kernels::GemmOperand oa{a.data_ptr(), v.trans_a, lda, a_rows * lda, a_rows, a_cols};
  const kernels::GemmOperand ob{b.data_ptr(), v.trans_b, ldb, v.broadcast_b ? 0 : b_rows * ldb, b_rows, b_cols};
  REQUIRE(onednn::gemm_bf16(oa, ob, c.data_ptr(), ldc, c_batch, kBatch, kM, kN, kK, v.alpha, v.beta, v.float32_result));
  const std::vector<double> C = c.to(DType::Float64).tolist();
  const double u_out = v.float32_result ? ro::kUnit : std::ldexp(1.0, -8);
  double worst = 0;
  for (int64_t p = 0; p < kBatch; ++p) {
    const int64_t pb = v.broadcast_b ? 0 : p;
    for (int64_t i = 0; i < kM; ++i)
      for (int64_t j = 0; j < kN; ++j) {
        double s = 0, mag = 0;
        for (int64_t l = 0; l < kK; ++l) {
          const double x = v.trans_a ? A[size_t((p * a_rows + l) * lda + i)] : A[size_t((p * a_rows + i) * lda + l)];
          const double y = v.trans_b ? Bv[size_t((pb * b_rows + j) * ldb + l)] : Bv[size_t((pb * b_rows + l) * ldb + j)];
          s += x * y;
          mag += std::abs(x * y);
        }
        const size_t at = size_t(p * c_batch + i * ldc + j);
        const double want = v.alpha * s + v.beta * C0[at];
        const double bound = ro::gamma(double(kK) + 2, ro::kUnit) * (std::abs(v.alpha) * mag + std::abs(v.beta * C0[at])) +
                             u_out * std::abs(want) + 1e-300;
        worst = std::max(worst, std::abs(C[at] - want) / bound);
      }
  }
  // The room between rows and batches is never written.
  for (int64_t p = 0; p < kBatch; ++p)
    for (int64_t i = 0; i < kM; ++i)
      for (int64_t j = kN; j < (i + 1 < kM ? ldc : c_batch - i * ldc); ++j) {
        const size_t at = size_t(p * c_batch + i * ldc + j);
        if (C[at] != C0[at]) worst = std::max(worst, 1e9);
      }
  return worst;
}

// ------------------------------------------------------------------------------------------- conv2d

struct ConvVariant {
  const char* what;
  int64_t cout = 6, groups = 1, kh = 3, kw = 3, sh = 1, sw = 1, ph = 1, pw = 1, dh = 1, dw = 1;
  bool bias = true;
};
constexpr int64_t kN2 = 2, kC = 4, kH = 9, kW = 9;

// y = conv2d(x, w, b) and the gradients of sum(y * r) by a float64 loop over every tap.
struct ConvReference {
  std::vector<double> y, dx, dw, db;
  std::vector<double> ymag, dxmag, dwmag;  // sum of |terms|, for the bounds
};

ConvReference conv_reference(const ConvVariant& v, const std::vector<double>& X, const std::vector<double>& Wt,
                             const std::vector<double>& Bs, const std::vector<double>& R, int64_t oh, int64_t ow) {
  const int64_t cin = kC / v.groups, cog = v.cout / v.groups;
  ConvReference r;
  r.y.assign(size_t(kN2 * v.cout * oh * ow), 0.0);
  r.ymag = r.y;
  r.dx.assign(size_t(kN2 * kC * kH * kW), 0.0);
  r.dxmag = r.dx;
  r.dw.assign(size_t(v.cout * cin * v.kh * v.kw), 0.0);
  r.dwmag = r.dw;
  r.db.assign(size_t(v.cout), 0.0);
  for (int64_t n = 0; n < kN2; ++n)
    for (int64_t o = 0; o < v.cout; ++o)
      for (int64_t i = 0; i < oh; ++i)
        for (int64_t j = 0; j < ow; ++j) {
          const size_t yi = size_t(((n * v.cout + o) * oh + i) * ow + j);
          double s = v.bias ? Bs[size_t(o)] : 0.0, mag = std::abs(s);
          const double g = R[yi];
          r.db[size_t(o)] += g;
          for (int64_t ci = 0; ci < cin; ++ci)
            for (int64_t a = 0; a < v.kh; ++a)
              for (int64_t b = 0; b < v.kw; ++b) {
                const int64_t y = i * v.sh - v.ph + a * v.dh, x = j * v.sw - v.pw + b * v.dw;
                if (y < 0 || y >= kH || x < 0 || x >= kW) continue;
                const int64_t c = (o / cog) * cin + ci;
                const size_t xi = size_t(((n * kC + c) * kH + y) * kW + x);
                const size_t wi = size_t(((o * cin + ci) * v.kh + a) * v.kw + b);
                s += X[xi] * Wt[wi];
                mag += std::abs(X[xi] * Wt[wi]);
                r.dx[xi] += g * Wt[wi];
                r.dxmag[xi] += std::abs(g * Wt[wi]);
                r.dw[wi] += g * X[xi];
                r.dwmag[wi] += std::abs(g * X[xi]);
              }
          r.y[yi] = s;
          r.ymag[yi] = mag;
        }
  return r;
}

// The largest |got - want| / bound over one tensor: a float32 (bfloat16: float32 accumulation, then one
// rounding to bfloat16) sum of `terms` terms, gamma_{terms+2} of the magnitude plus the result rounding.
double worst_of(const Tensor& got, const std::vector<double>& want, const std::vector<double>& mag, double terms,
                double u_out) {
  const std::vector<double> g = got.to(DType::Float64).tolist();
  REQUIRE(g.size() == want.size());
  double worst = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double bound = ro::gamma(terms + 2, ro::kUnit) * mag[i] + u_out * std::abs(want[i]) + 1e-300;
    worst = std::max(worst, std::abs(g[i] - want[i]) / bound);
  }
  return worst;
}

double conv_worst(const ConvVariant& v, DType dtype, uint64_t seed) {
  Generator g(seed);
  const Tensor x = randn({kN2, kC, kH, kW}, &g).to(dtype).requires_grad_(true);
  const Tensor w = randn({v.cout, kC / v.groups, v.kh, v.kw}, &g).to(dtype).requires_grad_(true);
  const Tensor b = v.bias ? randn({v.cout}, &g).to(dtype).requires_grad_(true) : Tensor();
  const Tensor y = conv2d(x, w, b, {v.sh, v.sw}, {v.ph, v.pw}, {v.dh, v.dw}, v.groups);
  const int64_t oh = y.size(2), ow = y.size(3);
  const Tensor r = randn(y.shape(), &g).to(dtype);
  sum(mul(y, r)).backward();
  const ConvReference ref = conv_reference(v, x.to(DType::Float64).tolist(), w.to(DType::Float64).tolist(),
                                           v.bias ? b.to(DType::Float64).tolist() : std::vector<double>(),
                                           r.to(DType::Float64).tolist(), oh, ow);
  const double u_out = dtype == DType::BFloat16 ? std::ldexp(1.0, -8) : dtype == DType::Float64 ? 0.0 : ro::kUnit;
  const double taps = double(kC / v.groups * v.kh * v.kw);
  double worst = worst_of(y, ref.y, ref.ymag, taps, u_out);
  worst = std::max(worst, worst_of(x.grad(), ref.dx, ref.dxmag, double(v.cout * v.kh * v.kw), u_out));
  worst = std::max(worst, worst_of(w.grad(), ref.dw, ref.dwmag, double(kN2 * oh * ow), u_out));
  return worst;
}

std::vector<ConvVariant> conv_variants() {
  // Every variant has the same images; the first nine (but for the kernel-shape one) the same output
  // size 9 x 9, so a key without the argument that differs would find the first variant's entry.
  std::vector<ConvVariant> v(9);
  v[0].what = "3x3, stride 1, padding 1, bias";
  v[1].what = "no bias";
  v[1].bias = false;
  v[2].what = "stride 2 with padding 5 (same output size)";
  v[2].sh = v[2].sw = 2, v[2].ph = v[2].pw = 5;
  v[3].what = "dilation 2 with padding 2 (same output size)";
  v[3].dh = v[3].dw = 2, v[3].ph = v[3].pw = 2;
  v[4].what = "groups 2";
  v[4].groups = 2;
  v[5].what = "a 3x1 kernel, width padding 0 (same output size)";
  v[5].kw = 1, v[5].pw = 0;
  v[6].what = "stride 2 in height only, height padding 5";
  v[6].sh = 2, v[6].ph = 5;
  v[7].what = "dilation 2 in width only, width padding 2";
  v[7].dw = 2, v[7].pw = 2;
  v[8] = v[0];
  v[8].what = "the first variant again";
  // Pairs that differ in one argument only with the same output size (so a key that left it out finds
  // the pair's first entry even where the output size is part of the key): a 1x1 kernel at stride 3 and
  // 4 (3 x 3 outputs), then stride 4 in width only; a 3x3 kernel at stride 4 without and with dilation
  // 2 (2 x 2); at stride 5 without and with padding 1 (2 x 2).
  auto add = [&](const char* what, int64_t k, int64_t sh, int64_t sw, int64_t p, int64_t d) {
    ConvVariant c;
    c.what = what;
    c.kh = c.kw = k, c.sh = sh, c.sw = sw, c.ph = c.pw = p, c.dh = c.dw = d;
    v.push_back(c);
  };
  add("1x1, stride 3", 1, 3, 3, 0, 1);
  add("1x1, stride 4", 1, 4, 4, 0, 1);
  add("1x1, stride 4 in height, 3 in width", 1, 4, 3, 0, 1);
  add("3x3, stride 4", 3, 4, 4, 0, 1);
  add("3x3, stride 4, dilation 2", 3, 4, 4, 0, 2);
  add("3x3, stride 5", 3, 5, 5, 0, 1);
  add("3x3, stride 5, padding 1", 3, 5, 5, 1, 1);
  return v;
}

}  // namespace

TEST_CASE("primitive caches: a bfloat16 GEMM shape reused with every other argument changed", "[ops][onednn][cache]") {
  if (!onednn::built()) return skip_test("this build has no oneDNN (libdnnl-dev)");
  if (!cpu::has_bf16_instructions() || cpu::isa_level() != cpu::IsaLevel::Avx512)
    return skip_test(std::string("no bfloat16 instructions at the selected kernel level (") +
                     cpu::bf16_instructions_name() + ", " + cpu::isa_name(cpu::isa_level()) + ")");
  GemmPathGuard on(true);
  std::vector<GemmVariant> variants(12);
  variants[0].what = "plain";
  variants[1].what = "A transposed", variants[1].trans_a = true;
  variants[2].what = "B transposed", variants[2].trans_b = true;
  variants[3].what = "both transposed", variants[3].trans_a = variants[3].trans_b = true;
  variants[4].what = "B broadcast over the batch", variants[4].broadcast_b = true;
  variants[5].what = "alpha 0.375", variants[5].alpha = 0.375;
  variants[6].what = "beta 1", variants[6].beta = 1.0;
  variants[7].what = "alpha 2, beta -0.5", variants[7].alpha = 2.0, variants[7].beta = -0.5;
  variants[8].what = "float32 result", variants[8].float32_result = true;
  variants[9].what = "wider rows of A and B", variants[9].pad_a = 3, variants[9].pad_b = 5;
  variants[10].what = "wider rows and batches of C", variants[10].pad_c = 4, variants[10].pad_c_batch = 7;
  variants[11] = variants[0];
  variants[11].what = "plain again";
  uint64_t seed = 100;
  for (const GemmVariant& v : variants) {
    INFO(v.what);
    CHECK(gemm_worst(v, ++seed) <= 1.0);
  }
}

TEST_CASE("primitive caches: a convolution shape reused with every other argument changed", "[ops][onednn][conv][cache]") {
  // oneDNN's primitives (float32 on any x86-64 CPU, bfloat16 where its GEMMs run), then the gather path
  // with its geometry-keyed index (oneDNN off, and float64, which never takes oneDNN).
  struct Path {
    const char* what;
    bool onednn;
    DType dtype;
  };
  std::vector<Path> paths = {{"oneDNN float32", true, DType::Float32}, {"gather float32", false, DType::Float32},
                             {"gather float64", true, DType::Float64}};
  const bool bf16 = onednn::conv_bf16_enabled();
  if (bf16) paths.push_back({"oneDNN bfloat16", true, DType::BFloat16});
  for (const Path& p : paths) {
    ConvPathGuard guard(p.onednn);
    if (p.onednn && p.dtype != DType::Float64) REQUIRE(onednn::conv_enabled() == onednn::built());
    uint64_t seed = 200;
    for (const ConvVariant& v : conv_variants()) {
      INFO(p.what << ": " << v.what);
      CHECK(conv_worst(v, p.dtype, ++seed) <= 1.0);
    }
  }
  if (!bf16) WARN("bfloat16 convolutions through oneDNN not checked here: " << onednn::conv_description());
}

TEST_CASE("primitive caches: a max-pooling shape reused with stride, padding and the convolution of its shape",
          "[ops][onednn][conv][cache]") {
  // Pooling shares the convolution cache: a 3x3 pool of stride 1 and padding 1 has the shape of the 3x3
  // convolution above (cout = c, groups 1). The reference is the window maximum by a loop.
  ConvPathGuard on(true);
  Generator g(7);
  const Tensor x = randn({kN2, kC, kH, kW}, &g);
  const std::vector<double> X = x.to(DType::Float64).tolist();
  struct Pool {
    int64_t k, s, p;
  };
  for (const Pool& pool : {Pool{3, 1, 1}, Pool{3, 2, 1}, Pool{3, 1, 0}, Pool{2, 1, 1}, Pool{3, 1, 1}}) {
    INFO("kernel " << pool.k << " stride " << pool.s << " padding " << pool.p);
    // The convolution of the same shape first, so a pooling key without its kind would find it.
    const Tensor w = randn({kC, kC, pool.k, pool.k}, &g);
    (void)conv2d(x, w, Tensor(), {pool.s, pool.s}, {pool.p, pool.p});
    const Tensor y = max_pool2d(x, {pool.k, pool.k}, {pool.s, pool.s}, {pool.p, pool.p});
    const int64_t oh = (kH + 2 * pool.p - pool.k) / pool.s + 1, ow = (kW + 2 * pool.p - pool.k) / pool.s + 1;
    REQUIRE(y.shape() == Shape{kN2, kC, oh, ow});
    const std::vector<double> Y = y.to(DType::Float64).tolist();
    int64_t bad = 0;
    for (int64_t n = 0; n < kN2; ++n)
      for (int64_t c = 0; c < kC; ++c)
        for (int64_t i = 0; i < oh; ++i)
          for (int64_t j = 0; j < ow; ++j) {
            double m = -INFINITY;
            for (int64_t a = 0; a < pool.k; ++a)
              for (int64_t b = 0; b < pool.k; ++b) {
                const int64_t yy = i * pool.s - pool.p + a, xx = j * pool.s - pool.p + b;
                if (yy >= 0 && yy < kH && xx >= 0 && xx < kW) m = std::max(m, X[size_t(((n * kC + c) * kH + yy) * kW + xx)]);
              }
            if (Y[size_t(((n * kC + c) * oh + i) * ow + j)] != m) ++bad;
          }
    CHECK(bad == 0);
  }
}

TEST_CASE("primitive caches: autocast's cast of a weight follows its version and the autocast dtype", "[amp][autocast][cache]") {
  // linear(x, w) under autocast casts the float32 weight once per (weight, version, dtype). The cached
  // cast must not survive an in-place update of the weight (an optimizer step) nor serve another dtype.
  Generator g(3);
  Tensor w = randn({8, 16}, &g).requires_grad_(true);
  const Tensor x = randn({4, 16}, &g);
  auto check = [&](DType dtype, const char* what) {
    INFO(what);
    const Tensor y = linear(x, w);
    REQUIRE(y.dtype() == dtype);
    // Reference: the operands rounded to the autocast dtype, exact products summed in float64, one
    // rounding of the float32 sum (16 terms) and then of the result to the dtype.
    const std::vector<double> X = x.to(dtype).to(DType::Float64).tolist(), Wv = w.to(dtype).to(DType::Float64).tolist();
    const std::vector<double> Y = y.to(DType::Float64).tolist();
    const double u = dtype == DType::BFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    for (int64_t i = 0; i < 4; ++i)
      for (int64_t o = 0; o < 8; ++o) {
        double s = 0, mag = 0;
        for (int64_t l = 0; l < 16; ++l) {
          s += X[size_t(i * 16 + l)] * Wv[size_t(o * 16 + l)];
          mag += std::abs(X[size_t(i * 16 + l)] * Wv[size_t(o * 16 + l)]);
        }
        const double got = Y[size_t(i * 8 + o)];
        CHECK(std::abs(got - s) <= ro::gamma(18, ro::kUnit) * mag + u * std::abs(s));
      }
  };
  autocast::AutocastGuard outer(true, DType::Float16);
  check(DType::Float16, "float16");
  {
    NoGradGuard no_grad;
    w.mul_(-3.0);  // an optimizer step: the version moves
  }
  check(DType::Float16, "float16 after the weight changed in place");
  {
    autocast::AutocastGuard inner(true, DType::BFloat16);
    check(DType::BFloat16, "bfloat16 inside float16");
  }
  check(DType::Float16, "float16 again");
}
