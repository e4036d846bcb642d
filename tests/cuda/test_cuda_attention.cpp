// The fused (flash) attention kernels against two references that do not share their code: a plain
// float64 loop over the same rounded inputs written here (forward), and the CPU float64 op's gradients
// (which tests/ops checks against finite differences). The unfused CUDA path is held to the same
// bounds, so a regression in either shows. Inputs come with the strides the GPT gives them (views of
// one [B, T, 3 W] projection), and outputs are poisoned with NaN before each run.
#include <catch2/catch.hpp>

#include "cuda_skip.h"

#include <cmath>
#include <limits>
#include <vector>

#include "booster/autograd/autograd.h"
#include "booster/backends/cuda/cuda.h"
#include "booster/ops/ops.h"
#include "booster/tensor/random.h"

using namespace booster;

namespace {

using testing::skip_without_gpu;

double rel_error(const Tensor& got, const Tensor& ref) {
  const std::vector<double> g = got.to(DType::Float64).cpu().contiguous().tolist();
  const std::vector<double> r = ref.to(DType::Float64).cpu().contiguous().tolist();
  REQUIRE(g.size() == r.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (!std::isfinite(g[i])) return INFINITY;
    num += (g[i] - r[i]) * (g[i] - r[i]);
    den += r[i] * r[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);  // a zero reference (one key): absolute
}

// softmax(scale q k^T + mask) v per (batch, head), in float64, by plain loops. q [N, L, E], k/v [N, S, E].
std::vector<double> reference_attention(const std::vector<double>& q, const std::vector<double>& k,
                                        const std::vector<double>& v, int64_t N, int64_t L, int64_t S, int64_t E,
                                        bool causal) {
  std::vector<double> out(static_cast<size_t>(N * L * E), 0.0), p(static_cast<size_t>(S));
  const double scale = 1.0 / std::sqrt(double(E));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < L; ++i) {
      double mx = -INFINITY;
      for (int64_t j = 0; j < S; ++j) {
        double dot = 0;
        for (int64_t e = 0; e < E; ++e) dot += q[size_t((n * L + i) * E + e)] * k[size_t((n * S + j) * E + e)];
        p[size_t(j)] = (causal && j > i) ? -INFINITY : dot * scale;
        mx = std::max(mx, p[size_t(j)]);
      }
      double sum = 0;
      for (int64_t j = 0; j < S; ++j) sum += (p[size_t(j)] = std::exp(p[size_t(j)] - mx));
      for (int64_t j = 0; j < S; ++j)
        for (int64_t e = 0; e < E; ++e)
          out[size_t((n * L + i) * E + e)] += p[size_t(j)] / sum * v[size_t((n * S + j) * E + e)];
    }
  return out;
}

// Fills the device allocator's cache with NaN so that an output element the kernel never writes shows.
void poison_device_cache() {
  Tensor t = Tensor::empty({int64_t(1) << 24}, DType::Float32, Device::cuda());
  t.fill_(std::numeric_limits<double>::quiet_NaN());
  cuda::synchronize();
}

struct Case {
  int64_t B, H, L, S, E;
  bool causal;
  bool fused_qkv;  // q, k, v as head views of one [B, T, 3 H E] tensor, as the GPT makes them
};

// Note [Flash attention tolerance]
// Relative to float64 on the same rounded inputs, the forward rounds P to the storage type before
// P V and rounds the output once: about 2u in norm (u = 2^-8 bfloat16, 2^-11 float16). The gradients
// add the rounding of P for dV and of dS for dQ and dK (each an independent u), and dS = P (dP - D)
// cancels when dP is close to D, which amplifies it by a factor of a few: 16u. The unfused path rounds
// P and dS likewise, so it meets the same bounds.
void check_case(const Case& c, DType dt, bool flash) {
  set_flash_attention_enabled(flash);
  Generator g(uint64_t(c.B * 1000 + c.L * 10 + c.E + (c.causal ? 1 : 0)));
  Tensor q, k, v;
  auto leaf = [&](Shape s) { return randn(s, &g).to(dt).to(Device::cuda()).requires_grad_(true); };
  Tensor qkv;
  if (c.fused_qkv) {
    REQUIRE(c.L == c.S);
    qkv = leaf({c.B, c.L, 3 * c.H * c.E});
    const std::vector<Tensor> parts = split(qkv, c.H * c.E, 2);
    auto heads = [&](const Tensor& t) { return t.view({c.B, c.L, c.H, c.E}).transpose(1, 2); };
    q = heads(parts[0]);
    k = heads(parts[1]);
    v = heads(parts[2]);
  } else {
    q = leaf({c.B, c.H, c.L, c.E});
    k = leaf({c.B, c.H, c.S, c.E});
    v = leaf({c.B, c.H, c.S, c.E});
  }
  poison_device_cache();
  Tensor out = scaled_dot_product_attention(q, k, v, c.causal);
  const Tensor grad_out = randn(out.shape(), &g).to(dt).to(Device::cuda());
  out.backward(grad_out);

  // The same rounded values in float64 on the CPU.
  auto host = [](const Tensor& t) { return t.detach().cpu().to(DType::Float64).contiguous(); };
  const int64_t N = c.B * c.H;
  const std::vector<double> ref_out =
      reference_attention(host(q).tolist(), host(k).tolist(), host(v).tolist(), N, c.L, c.S, c.E, c.causal);
  const Tensor ref = from_vector(ref_out, {c.B, c.H, c.L, c.E});
  const double u = dt == DType::BFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  const double err_out = rel_error(out, ref);
  INFO((flash ? "flash " : "unfused ") << dt << " B " << c.B << " H " << c.H << " L " << c.L << " S " << c.S
                                       << " E " << c.E << (c.causal ? " causal" : "") << (c.fused_qkv ? " fused qkv" : ""));
  INFO("output error " << err_out << ", bound " << 2 * u);
  CHECK(err_out <= 2 * u);

  Tensor qr = host(q).requires_grad_(true), kr = host(k).requires_grad_(true), vr = host(v).requires_grad_(true);
  Tensor out_ref = scaled_dot_product_attention(qr, kr, vr, c.causal);
  CHECK(rel_error(out_ref, ref) < 1e-12);  // the CPU op is the loop above
  out_ref.backward(grad_out.cpu().to(DType::Float64));
  if (c.fused_qkv) {
    const Tensor dqkv_ref = cat({qr.grad().transpose(1, 2).reshape({c.B, c.L, c.H * c.E}),
                                 kr.grad().transpose(1, 2).reshape({c.B, c.L, c.H * c.E}),
                                 vr.grad().transpose(1, 2).reshape({c.B, c.L, c.H * c.E})},
                                2);
    const double err = rel_error(qkv.grad(), dqkv_ref);
    INFO("qkv gradient error " << err << ", bound " << 16 * u);
    CHECK(err <= 16 * u);
  } else {
    const double eq = rel_error(q.grad(), qr.grad()), ek = rel_error(k.grad(), kr.grad()),
                 ev = rel_error(v.grad(), vr.grad());
    INFO("gradient errors q " << eq << ", k " << ek << ", v " << ev << ", bound " << 16 * u);
    CHECK(eq <= 16 * u);
    CHECK(ek <= 16 * u);
    CHECK(ev <= 16 * u);
  }
  std::printf("%-8s %-9s B %lld H %lld L %4lld S %4lld E %2lld %-7s %-10s out err %.2e\n", flash ? "flash" : "unfused",
              dt == DType::BFloat16 ? "bfloat16" : "float16", (long long)c.B, (long long)c.H, (long long)c.L,
              (long long)c.S, (long long)c.E, c.causal ? "causal" : "full", c.fused_qkv ? "fused-qkv" : "separate",
              err_out);
  set_flash_attention_enabled(true);
}

}  // namespace

TEST_CASE("flash attention matches a float64 loop and the CPU gradients, causal or not, any length", "[cuda]") {
  if (skip_without_gpu()) return;
  const Case cases[] = {
      {2, 3, 100, 100, 64, true, true},    // the GPT's layout, lengths not a multiple of the 64-row tile
      {2, 2, 256, 256, 64, true, true},    // whole tiles
      {1, 2, 130, 130, 32, false, false},  // full attention
      {2, 1, 64, 200, 16, false, false},   // more keys than queries
      {1, 2, 150, 70, 64, true, false},    // causal with more queries than keys: late rows see every key
      {1, 1, 1, 1, 16, true, false},       // one row
      {1, 2, 100, 100, 128, true, true},   // Llama's head size (dynamic shared memory past 48 KiB)
      {1, 1, 70, 150, 128, false, false},  // head size 128, more keys than queries, partial tiles
  };
  for (const DType dt : {DType::BFloat16, DType::Float16})
    for (const Case& c : cases) {
      check_case(c, dt, true);
      check_case(c, dt, false);
    }
}

TEST_CASE("flash attention keeps the heads-last layout, so merging heads is a view", "[cuda]") {
  if (skip_without_gpu()) return;
  Generator g(3);
  const Tensor qkv = randn({2, 40, 3 * 4 * 16}, &g).to(DType::BFloat16).to(Device::cuda());
  const std::vector<Tensor> parts = split(qkv, 64, 2);
  auto heads = [](const Tensor& t) { return t.view({2, 40, 4, 16}).transpose(1, 2); };
  const Tensor y = scaled_dot_product_attention(heads(parts[0]), heads(parts[1]), heads(parts[2]), true);
  CHECK(y.shape() == Shape{2, 4, 40, 16});
  CHECK(y.transpose(1, 2).is_contiguous());
  // Off, the unfused kernel answers the same within the tolerance above.
  set_flash_attention_enabled(false);
  const Tensor y_unfused = scaled_dot_product_attention(heads(parts[0]), heads(parts[1]), heads(parts[2]), true);
  set_flash_attention_enabled(true);
  CHECK(rel_error(y, y_unfused) <= 4 * std::ldexp(1.0, -8));
}
