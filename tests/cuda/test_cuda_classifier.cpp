// The GPU classifier path: a linear layer whose output rows are padded (lm_head, vocab 50257 -> rows
// 50304 apart) feeding the fused cross-entropy, which reads 16-bit logits as they lie under autocast.
// References: the CPU float64 cross-entropy and linear on the same rounded values.
#include <catch2/catch.hpp>

#include "cuda_skip.h"

#include <cmath>
#include <vector>

#include "booster/autocast/autocast.h"
#include "booster/backends/cuda/cuda.h"
#include "booster/ops/ops.h"
#include "booster/tensor/random.h"

using namespace booster;

namespace {

using testing::skip_without_gpu;

// max |got - ref| over max |ref|, on the CPU in float64.
double max_rel(const Tensor& got, const Tensor& ref) {
  const std::vector<double> g = got.detach().cpu().to(DType::Float64).contiguous().tolist();
  const std::vector<double> r = ref.detach().cpu().to(DType::Float64).contiguous().tolist();
  REQUIRE(g.size() == r.size());
  double err = 0, scale = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (!std::isfinite(g[i])) return INFINITY;
    err = std::max(err, std::abs(g[i] - r[i]));
    scale = std::max(scale, std::abs(r[i]));
  }
  return err / scale;
}

}  // namespace

TEST_CASE("a linear layer with padded output rows, split GEMMs and a GEMM bias gradient matches float64", "[cuda]") {
  if (skip_without_gpu()) return;
  Generator g(11);
  for (const DType dt : {DType::Float32, DType::BFloat16}) {
    const Tensor x = randn({3, 5, 24}, &g).to(dt).to(Device::cuda()).requires_grad_(true);
    const Tensor w = randn({77, 24}, &g).to(dt).to(Device::cuda()).requires_grad_(true);
    const Tensor b = randn({77}, &g).to(dt).to(Device::cuda()).requires_grad_(true);
    const Tensor y = linear(x, w, b, 64);  // 77 features: an aligned GEMM for 64, another for 13
    CHECK(y.shape() == Shape{3, 5, 77});
    CHECK(y.strides() == Shape{5 * 128, 128, 1});  // rows round_up(77, 64) = 128 apart
    const Tensor gy = randn({3, 5, 77}, &g).to(dt).to(Device::cuda());
    y.backward(gy);
    // The float64 CPU reference on the same rounded values.
    const Tensor xr = x.detach().cpu().to(DType::Float64).requires_grad_(true);
    const Tensor wr = w.detach().cpu().to(DType::Float64).requires_grad_(true);
    const Tensor br = b.detach().cpu().to(DType::Float64).requires_grad_(true);
    const Tensor yr = linear(xr, wr, br);
    yr.backward(gy.cpu().to(DType::Float64));
    // One rounding of a float32-accumulated dot product of 24 (or 15) terms: u of the dtype suffices
    // with a factor of 4 for the accumulation (TF32 is off: allow_tf32 defaults to false).
    const double u = dt == DType::Float32 ? 1e-6 : std::ldexp(1.0, -8);
    CHECK(max_rel(y, yr) <= 4 * u);
    CHECK(max_rel(x.grad(), xr.grad()) <= 4 * u);
    CHECK(max_rel(w.grad(), wr.grad()) <= 4 * u);
    CHECK(max_rel(b.grad(), br.grad()) <= 4 * u);  // bfloat16: the column sum as a GEMM with ones
  }
  // On the CPU the rows stay contiguous.
  const Tensor yc = linear(randn({2, 8}), randn({77, 8}), Tensor(), 64);
  CHECK(yc.is_contiguous());
}

TEST_CASE("the fused classifier reads padded 16-bit logits under autocast and matches float64", "[cuda]") {
  if (skip_without_gpu()) return;
  Generator g(12);
  const int64_t N = 37, vocab = 1001;  // vocab not a multiple of 8
  for (const DType dt : {DType::BFloat16, DType::Float16}) {
    for (const double smoothing : {0.0, 0.1}) {
      // 16-bit logits whose rows lie 1024 apart, as the padded lm_head writes them.
      Tensor logits = (randn({N, 1024}, &g) * 3.0).to(dt).to(Device::cuda()).narrow(1, 0, vocab);
      logits.requires_grad_(true);
      Tensor target = randint(0, vocab, {N}, &g);
      target.data<int64_t>()[3] = -100;  // one ignored row
      target = target.to(Device::cuda());
      Tensor loss;
      {
        autocast::AutocastGuard ac(true, dt);
        loss = cross_entropy(logits, target, Reduction::Mean, -100, smoothing);
      }
      CHECK(logits.dtype() == dt);
      CHECK(logits.stride(0) == 1024);
      CHECK(loss.dtype() == DType::Float32);  // as autocast's float32 policy for losses gives
      loss.backward();
      REQUIRE(logits.grad().defined());
      CHECK(logits.grad().dtype() == dt);
      // Reference: float64 on the CPU from the same 16-bit logits.
      const Tensor lr = logits.detach().cpu().to(DType::Float64).requires_grad_(true);
      const Tensor loss_ref = cross_entropy(lr, target.cpu(), Reduction::Mean, -100, smoothing);
      loss_ref.backward();
      INFO(dt << ", label smoothing " << smoothing);
      // The loss: float32 sums over 1001 classes and 36 rows, relative error a few 1e-7.
      CHECK(std::abs(loss.item() - loss_ref.item()) <= 1e-5 * std::abs(loss_ref.item()));
      // dlogits: one rounding to the 16-bit dtype of a float32 value: u relative to the largest.
      const double u = dt == DType::BFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
      CHECK(max_rel(logits.grad(), lr.grad()) <= u);
      // The ignored row has a zero gradient.
      CHECK(max(abs(logits.grad().cpu().to(DType::Float64).select(0, 3))).item() == 0.0);
    }
  }
}
