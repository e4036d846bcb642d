// bfloat16 GEMMs through oneDNN (booster/backends/onednn/onednn.h) and through the widening OpenBLAS
// path, each against a float64 product of the same bfloat16 operands, over every operand layout the
// GEMM kernel passes (transposed, strided, broadcast over the batch), alpha and beta; and the ops that
// run on them (linear forward and both backward products, batched attention products) agree between
// the two paths. Where this CPU has no bfloat16 instructions the oneDNN half says it was skipped.
#include <catch2/catch.hpp>

#include <array>
#include <cmath>

#include "booster/backends/onednn/onednn.h"
#include "booster/common/cpu_features.h"
#include "booster/kernels/gemm.h"
#include "booster/ops/ops.h"
#include "booster/tensor/random.h"
#include "roundoff.h"
#include "skip.h"

using namespace booster;

namespace {

// Restores the path in use when it goes out of scope.
struct PathGuard {
  explicit PathGuard(bool on) : previous(onednn::set_bf16_gemm(on)) {}
  ~PathGuard() { onednn::set_bf16_gemm(previous); }
  bool previous;
};

Tensor bf16_randn(const Shape& shape, uint64_t seed) {
  Generator g(seed);
  return randn(shape, &g).to(DType::BFloat16);
}

struct Case {
  int64_t batch, m, n, k;
  bool trans_a, trans_b, broadcast_b;
  double alpha, beta;
};

// C = alpha op(A) op(B) + beta C0 in bfloat16 by the kernel, and the largest |C - C64| in units of
// its bound: accumulation in float32 over k terms, gamma_k(2^-24) sum_l |a_il b_lj| (+ one rounding
// of alpha and beta's terms), then one rounding to bfloat16, 2^-8 |C64| (Note [Roundoff bounds] 5).
double worst_ratio(const Case& c, uint64_t seed) {
  const Tensor a = c.trans_a ? bf16_randn({c.batch, c.k, c.m}, seed) : bf16_randn({c.batch, c.m, c.k}, seed);
  const Shape b_shape = c.trans_b ? Shape{c.broadcast_b ? 1 : c.batch, c.n, c.k} : Shape{c.broadcast_b ? 1 : c.batch, c.k, c.n};
  Tensor b = bf16_randn(b_shape, seed + 1);
  if (c.broadcast_b) b = b.expand({c.batch, b_shape[1], b_shape[2]});
  const Tensor c0 = bf16_randn({c.batch, c.m, c.n}, seed + 2);
  Tensor out = c0.clone();
  kernels::GemmArgs args;
  args.trans_a = c.trans_a;
  args.trans_b = c.trans_b;
  args.alpha = c.alpha;
  args.beta = c.beta;
  kernels::gemm_kernel(Device::cpu())(args, a, b, out);

  const Tensor a64 = c.trans_a ? a.to(DType::Float64).transpose(1, 2) : a.to(DType::Float64);
  const Tensor b64 = c.trans_b ? b.to(DType::Float64).transpose(1, 2) : b.to(DType::Float64);
  const Tensor want = add(mul(matmul(a64, b64), c.alpha), mul(c0.to(DType::Float64), c.beta));
  const Tensor magnitude = add(mul(matmul(abs(a64), abs(b64)), std::abs(c.alpha)), mul(abs(c0.to(DType::Float64)), std::abs(c.beta)));
  const std::vector<double> got = out.to(DType::Float64).tolist(), w = want.tolist(), mag = magnitude.tolist();
  const double u32 = std::ldexp(1.0, -24), u16 = std::ldexp(1.0, -8);
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double bound = ::testing::roundoff::gamma(double(c.k) + 2, u32) * mag[i] + u16 * std::abs(w[i]) + 1e-300;
    worst = std::max(worst, std::abs(got[i] - w[i]) / bound);
  }
  return worst;
}

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {1, 1, 1, 1, false, false, false, 1.0, 0.0},      {1, 7, 5, 3, false, false, false, 1.0, 0.0},
      {1, 64, 96, 128, false, false, false, 1.0, 0.0},  {1, 33, 65, 129, true, false, false, 1.0, 0.0},
      {1, 33, 65, 129, false, true, false, 1.0, 0.0},   {1, 33, 65, 129, true, true, false, 1.0, 0.0},
      {3, 17, 9, 40, false, true, true, 1.0, 0.0},      {4, 16, 16, 64, false, false, false, 0.125, 0.0},
      {2, 31, 47, 300, true, false, false, 0.5, 1.0},   {2, 8, 8, 8, false, false, true, 1.0, 2.0},
      {1, 256, 512, 768, false, true, false, 1.0, 0.0}, {1, 768, 256, 512, true, false, false, 1.0, 1.0},
  };
  return all;
}

}  // namespace

TEST_CASE("bfloat16 GEMMs widened to float32 stay within bfloat16 and float32 roundoff of float64", "[ops][onednn]") {
  PathGuard off(false);
  REQUIRE_FALSE(onednn::bf16_gemm_enabled());
  uint64_t seed = 10;
  for (const Case& c : cases()) {
    INFO("batch " << c.batch << " m " << c.m << " n " << c.n << " k " << c.k << " trans " << c.trans_a << c.trans_b
                  << " broadcast " << c.broadcast_b << " alpha " << c.alpha << " beta " << c.beta);
    CHECK(worst_ratio(c, seed += 3) <= 1.0);
  }
}

TEST_CASE("bfloat16 GEMMs through oneDNN stay within bfloat16 and float32 roundoff of float64", "[ops][onednn]") {
  if (!onednn::built()) return skip_test("this build has no oneDNN (libdnnl-dev)");
  if (!cpu::has_bf16_instructions() || cpu::isa_level() != cpu::IsaLevel::Avx512)
    return skip_test(std::string("no bfloat16 instructions at the selected kernel level (") +
                     cpu::bf16_instructions_name() + ", " + cpu::isa_name(cpu::isa_level()) + ")");
  PathGuard on(true);
  REQUIRE(onednn::bf16_gemm_enabled());
  uint64_t seed = 10;
  for (const Case& c : cases()) {
    INFO("batch " << c.batch << " m " << c.m << " n " << c.n << " k " << c.k << " trans " << c.trans_a << c.trans_b
                  << " broadcast " << c.broadcast_b << " alpha " << c.alpha << " beta " << c.beta);
    CHECK(worst_ratio(c, seed += 3) <= 1.0);
  }
  // The path is taken, not fallen back from: a direct call computes and says so.
  const Tensor a = bf16_randn({1, 4, 8}, 1), b = bf16_randn({1, 8, 4}, 2);
  Tensor out = Tensor::empty({1, 4, 4}, DType::BFloat16);
  kernels::GemmOperand oa{a.data_ptr(), false, 8, 32, 4, 8}, ob{b.data_ptr(), false, 4, 32, 8, 4};
  CHECK(onednn::gemm_bf16(oa, ob, out.data_ptr(), 4, 16, 1, 4, 4, 8, 1.0, 0.0));
  CHECK(onednn::bf16_gemm_description().rfind("oneDNN", 0) == 0);
}

TEST_CASE("BOOSTER_ONEDNN-style switch: linear and attention products agree on both bfloat16 paths", "[ops][onednn]") {
  if (!onednn::built() || !cpu::has_bf16_instructions() || cpu::isa_level() != cpu::IsaLevel::Avx512)
    return skip_test("the oneDNN bfloat16 path cannot run here; the widening path is the only one");
  // The forward, the input gradient and the weight gradient of a linear layer, and a batched
  // attention-shaped product, on each path: both within roundoff of float64 (checked above), so of each
  // other within twice the bound; compared relative to the magnitude of the sums.
  const Tensor x = bf16_randn({24, 96}, 5), w = bf16_randn({80, 96}, 6), g = bf16_randn({24, 80}, 7);
  const Tensor q = bf16_randn({2, 4, 16, 32}, 8), kk = bf16_randn({2, 4, 16, 32}, 9);
  auto run = [&](bool on) {
    PathGuard path(on);
    return std::vector<Tensor>{matmul(x, w.transpose(0, 1)), matmul(g, w), matmul(g.transpose(0, 1), x),
                               matmul(q, kk.transpose(2, 3))};
  };
  const std::vector<Tensor> one = run(true), other = run(false);
  const std::vector<Tensor> mags = {matmul(abs(x.to(DType::Float64)), abs(w.to(DType::Float64)).transpose(0, 1)),
                                    matmul(abs(g.to(DType::Float64)), abs(w.to(DType::Float64))),
                                    matmul(abs(g.to(DType::Float64)).transpose(0, 1), abs(x.to(DType::Float64))),
                                    matmul(abs(q.to(DType::Float64)), abs(kk.to(DType::Float64)).transpose(2, 3))};
  const std::vector<double> ks = {96, 80, 24, 32};
  const double u32 = std::ldexp(1.0, -24), u16 = std::ldexp(1.0, -8);
  for (size_t i = 0; i < one.size(); ++i) {
    const std::vector<double> p = one[i].to(DType::Float64).tolist(), r = other[i].to(DType::Float64).tolist(),
                              m = mags[i].tolist();
    double worst = 0;
    for (size_t j = 0; j < p.size(); ++j)
      worst = std::max(worst, std::abs(p[j] - r[j]) / (2 * (::testing::roundoff::gamma(ks[i], u32) * m[j] + u16 * std::abs(r[j])) + 1e-300));
    INFO("product " << i);
    CHECK(worst <= 1.0);
  }
}

namespace {

// The largest error of a bfloat16 attention (forward and the three input gradients) against float64
// arithmetic on the same bfloat16 values, in units of its bound (Note [Attention through oneDNN]).
// With u = 2^-24 (float32 sums), w ~ 2^-8 (a bfloat16 rounding) and gamma_n = n u / (1 - n u):
//   scores s = scale q.k in float32: |ds_ij| <= gamma_{E+1} scale sum_e |q_ie k_je| <= D_i (the row's max);
//   P = softmax(s) in float32: |dP_ij| <= e_i P_ij with e_i = 2 D_i + gamma_{S+8} (exp, sum, division);
//   O = P V: each P rounded to bfloat16 (w, oneDNN path only), float32 sums, O rounded (w):
//     |dO| <= (w + e_i + gamma_S) sum_j P_ij |V_jd| + w |O|;
//   dV = P^T dO likewise: (w + e_max + gamma_L) sum_i P_ij |dO_id| + w |dV|;
//   dS = P (dP - rowdot(dP, P)) with dP = dO V^T in float32 (a_ij = sum |dO_i| |V_j| >= |dP_ij|,
//   A_i = sum_j P_ij a_ij): |d dS_ij| <= P_ij (e_i + gamma_{S+Ev}) (a_ij + 2 A_i) = f_ij, then dS rounded
//   to bfloat16 (w |dS|, oneDNN path only);
//   dQ = scale dS K: scale sum_j (f_ij + (w + gamma_S) |dS_ij|) |K_jd| + w |dQ|; dK = scale dS^T Q likewise.
double attention_worst_ratio(int64_t B, int64_t L, int64_t S, int64_t E, int64_t Ev, bool causal, uint64_t seed) {
  const Tensor q = bf16_randn({B, L, E}, seed), k = bf16_randn({B, S, E}, seed + 1), v = bf16_randn({B, S, Ev}, seed + 2),
               g = bf16_randn({B, L, Ev}, seed + 3);
  Tensor qa = q.detach().requires_grad_(), ka = k.detach().requires_grad_(), va = v.detach().requires_grad_();
  const double scale = 1.0 / std::sqrt(double(E));
  Tensor out = scaled_dot_product_attention(qa, ka, va, causal);
  out.backward(g);
  const std::vector<double> Q = q.to(DType::Float64).tolist(), K = k.to(DType::Float64).tolist(),
                            V = v.to(DType::Float64).tolist(), G = g.to(DType::Float64).tolist();
  const std::vector<double> O = out.to(DType::Float64).tolist(), dQ = qa.grad().to(DType::Float64).tolist(),
                            dK = ka.grad().to(DType::Float64).tolist(), dV = va.grad().to(DType::Float64).tolist();
  // w as gamma_1 of bfloat16, so that two roundings of one term, (1 + 2^-8)^2 - 1, stay within 2 w.
  const double u = std::ldexp(1.0, -24), w = std::ldexp(1.0, -8) / (1 - std::ldexp(1.0, -8));
  auto gamma = [&](double n) { return ::testing::roundoff::gamma(n, u); };
  double worst = 0;
  auto check = [&](double got, double want, double bound) { worst = std::max(worst, std::abs(got - want) / (bound + 1e-300)); };
  for (int64_t b = 0; b < B; ++b) {
    const double* q0 = &Q[size_t(b * L * E)];
    const double* k0 = &K[size_t(b * S * E)];
    const double* v0 = &V[size_t(b * S * Ev)];
    const double* g0 = &G[size_t(b * L * Ev)];
    std::vector<double> P(static_cast<size_t>(L * S), 0.0), e(static_cast<size_t>(L)), dS(P), f(P);
    double e_max = 0;
    for (int64_t i = 0; i < L; ++i) {
      const int64_t valid = causal ? std::min(i + 1, S) : S;
      double mx = -1e300, sum = 0, D = 0;
      std::vector<double> s(static_cast<size_t>(S));
      for (int64_t j = 0; j < valid; ++j) {
        double dot = 0, mag = 0;
        for (int64_t c = 0; c < E; ++c) dot += q0[i * E + c] * k0[j * E + c], mag += std::abs(q0[i * E + c] * k0[j * E + c]);
        s[size_t(j)] = scale * dot;
        D = std::max(D, gamma(double(E) + 1) * scale * mag);
        mx = std::max(mx, s[size_t(j)]);
      }
      for (int64_t j = 0; j < valid; ++j) sum += std::exp(s[size_t(j)] - mx);
      for (int64_t j = 0; j < valid; ++j) P[size_t(i * S + j)] = std::exp(s[size_t(j)] - mx) / sum;
      e[size_t(i)] = 2 * D + gamma(double(S) + 8);
      e_max = std::max(e_max, e[size_t(i)]);
    }
    for (int64_t i = 0; i < L; ++i)
      for (int64_t d = 0; d < Ev; ++d) {
        double o = 0, m = 0;
        for (int64_t j = 0; j < S; ++j) o += P[size_t(i * S + j)] * v0[j * Ev + d], m += P[size_t(i * S + j)] * std::abs(v0[j * Ev + d]);
        check(O[size_t((b * L + i) * Ev + d)], o, (w + e[size_t(i)] + gamma(double(S))) * m + w * std::abs(o));
      }
    for (int64_t j = 0; j < S; ++j)
      for (int64_t d = 0; d < Ev; ++d) {
        double dv = 0, m = 0;
        for (int64_t i = 0; i < L; ++i) dv += P[size_t(i * S + j)] * g0[i * Ev + d], m += P[size_t(i * S + j)] * std::abs(g0[i * Ev + d]);
        check(dV[size_t((b * S + j) * Ev + d)], dv, (w + e_max + gamma(double(L))) * m + w * std::abs(dv));
      }
    for (int64_t i = 0; i < L; ++i) {
      std::vector<double> dP(static_cast<size_t>(S)), a(dP);
      double rowdot = 0, A = 0;
      for (int64_t j = 0; j < S; ++j) {
        double x = 0, m = 0;
        for (int64_t d = 0; d < Ev; ++d) x += g0[i * Ev + d] * v0[j * Ev + d], m += std::abs(g0[i * Ev + d] * v0[j * Ev + d]);
        dP[size_t(j)] = x, a[size_t(j)] = m;
        rowdot += x * P[size_t(i * S + j)], A += m * P[size_t(i * S + j)];
      }
      for (int64_t j = 0; j < S; ++j) {
        const double p = P[size_t(i * S + j)];
        dS[size_t(i * S + j)] = p * (dP[size_t(j)] - rowdot);
        f[size_t(i * S + j)] = p * (e[size_t(i)] + gamma(double(S + Ev))) * (a[size_t(j)] + 2 * A);
      }
    }
    for (int64_t i = 0; i < L; ++i)
      for (int64_t c = 0; c < E; ++c) {
        double x = 0, m = 0;
        for (int64_t j = 0; j < S; ++j) {
          const double ds = dS[size_t(i * S + j)];
          x += ds * k0[j * E + c];
          m += (f[size_t(i * S + j)] + (w + gamma(double(S))) * std::abs(ds)) * std::abs(k0[j * E + c]);
        }
        check(dQ[size_t((b * L + i) * E + c)], scale * x, scale * m + w * std::abs(scale * x));
      }
    for (int64_t j = 0; j < S; ++j)
      for (int64_t c = 0; c < E; ++c) {
        double x = 0, m = 0;
        for (int64_t i = 0; i < L; ++i) {
          const double ds = dS[size_t(i * S + j)];
          x += ds * q0[i * E + c];
          m += (f[size_t(i * S + j)] + (w + gamma(double(L))) * std::abs(ds)) * std::abs(q0[i * E + c]);
        }
        check(dK[size_t((b * S + j) * E + c)], scale * x, scale * m + w * std::abs(scale * x));
      }
  }
  return worst;
}

}  // namespace

TEST_CASE("bfloat16 attention on both paths stays within bfloat16 and float32 roundoff of float64",
          "[ops][onednn][attention]") {
  // Note [Attention through oneDNN]: every product batched through oneDNN where it runs, each head
  // widened to float32 sgemm where it does not; both within the bound of attention_worst_ratio.
  const bool can = onednn::built() && cpu::has_bf16_instructions() && cpu::isa_level() == cpu::IsaLevel::Avx512;
  for (bool on : {true, false}) {
    if (on && !can) {
      skip_test("the oneDNN bfloat16 path cannot run here; the widening path is checked alone");
      continue;
    }
    PathGuard path(on);
    REQUIRE(onednn::bf16_gemm_enabled() == on);
    uint64_t seed = 50;
    for (bool causal : {false, true})
      for (auto [B, L, S, E, Ev] : std::vector<std::array<int64_t, 5>>{{3, 13, 13, 24, 16}, {2, 9, 17, 32, 40}, {8, 64, 64, 64, 64}}) {
        INFO((on ? "oneDNN" : "widened") << " causal " << causal << " B " << B << " L " << L << " S " << S << " E " << E
                                         << " Ev " << Ev);
        CHECK(attention_worst_ratio(B, L, S, E, Ev, causal, seed += 4) <= 1.0);
      }
  }
}
