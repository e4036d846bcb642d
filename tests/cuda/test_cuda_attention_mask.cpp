// The CUDA attention under a mask (AttentionMask: a sliding window, packed documents, a query offset;
// Note [Attention masks] in ops/nn_functional.cpp): forward and gradients against the CPU float64 op on
// the same rounded inputs (tests/nn/test_families.cpp checks that op against an explicit masked softmax
// over every pair and against finite differences), through the fused (flash) kernels for 16-bit inputs
// and the unfused kernel (float32, or fused attention disabled). Skipped without a GPU.
#include <catch2/catch.hpp>

#include "cuda_skip.h"
#include "roundoff.h"

#include <cmath>
#include <vector>

#include "booster/autograd/autograd.h"
#include "booster/backends/cuda/cuda.h"
#include "booster/ops/ops.h"
#include "booster/tensor/random.h"

using namespace booster;

namespace {

// |got - ref|_2 / |ref|_2 over every element.
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
  return std::sqrt(num / den);
}

}  // namespace

// Bounds: Note [Flash attention tolerance] (tests/cuda/test_cuda_attention.cpp) for the 16-bit types,
// 2u for the output and 16u for the gradients (the unfused path rounds P and dS to the storage type);
// for float32 the same with u = gamma(E + 2 S) of float32 (the score, softmax and P V sums of E and S
// terms, Note [Roundoff bounds] step 5) in place of one rounding.
TEST_CASE("cuda attention: a window, documents and an offset equal the CPU float64 op", "[cuda][attention]") {
  if (::testing::skip_without_gpu()) return;
  const int64_t B = 2, H = 4, E = 32;
  struct Case {
    int64_t L, S, window, offset;
    bool segments;
  };
  for (const Case& c : {Case{70, 70, 16, 0, false}, Case{70, 70, 0, 0, true}, Case{70, 70, 5, 0, true},
                        Case{10, 40, 8, 30, false}}) {
    for (DType dt : {DType::Float32, DType::BFloat16, DType::Float16}) {
      for (bool flash : {true, false}) {
        set_flash_attention_enabled(flash);
        INFO(dt << " L " << c.L << " S " << c.S << " window " << c.window << " offset " << c.offset
                << (c.segments ? " documents" : "") << (flash ? " flash enabled" : ""));
        Generator g(uint64_t(c.L + c.window));
        auto leaf = [&](Shape s) { return randn(s, &g).to(dt).to(Device::cuda()).requires_grad_(true); };
        Tensor q = leaf({B, H, c.L, E}), k = leaf({B, H, c.S, E}), v = leaf({B, H, c.S, E});
        AttentionMask m;
        m.window = c.window;
        m.query_offset = c.offset;
        if (c.segments) {  // documents of 20, 30 and 20 positions, and of 35 and 35
          std::vector<double> ids;
          for (int64_t j = 0; j < c.S; ++j) ids.push_back(j < 20 ? 0 : j < 50 ? 1 : 2);
          for (int64_t j = 0; j < c.S; ++j) ids.push_back(j < 35 ? 4 : 3);
          m.segments = from_vector(ids, {B, c.S}, DType::Float64).to(DType::Int64).to(Device::cuda());
        }
        Tensor out = scaled_dot_product_attention(q, k, v, true, std::nullopt, m);
        const Tensor grad_out = randn(out.shape(), &g).to(dt).to(Device::cuda());
        out.backward(grad_out);

        auto host = [](const Tensor& t) { return t.detach().cpu().to(DType::Float64).requires_grad_(true); };
        Tensor qr = host(q), kr = host(k), vr = host(v);
        AttentionMask mr = m;
        if (m.segments.defined()) mr.segments = m.segments.cpu();
        Tensor ref = scaled_dot_product_attention(qr, kr, vr, true, std::nullopt, mr);
        ref.backward(grad_out.cpu().to(DType::Float64));

        const double u = dt == DType::BFloat16 ? std::ldexp(1.0, -8)
                         : dt == DType::Float16 ? std::ldexp(1.0, -11)
                                                : ::testing::roundoff::gamma(double(E + 2 * c.S), ::testing::roundoff::kUnit);
        CHECK(rel_error(out, ref) <= 2 * u);
        CHECK(rel_error(q.grad(), qr.grad()) <= 16 * u);
        CHECK(rel_error(k.grad(), kr.grad()) <= 16 * u);
        CHECK(rel_error(v.grad(), vr.grad()) <= 16 * u);
      }
    }
  }
  set_flash_attention_enabled(true);
}
