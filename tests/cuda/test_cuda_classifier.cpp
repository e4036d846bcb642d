// The GPU classifier path: a linear layer whose output rows are padded (lm_head, vocab 50257 -> rows
// 50304 apart) feeding the fused cross-entropy, which reads 16-bit logits as they lie under autocast.
// References: the CPU float64 cross-entropy and linear on the same rounded values.
#include <catch2/catch.hpp>

#include "cuda_skip.h"
#include "roundoff.h"

#include <cmath>
#include <vector>

#include "booster/autocast/autocast.h"
#include "booster/backends/cuda/cuda.h"
#include "booster/ops/ops.h"
#include "booster/tensor/random.h"

using namespace booster;

namespace {

using testing::skip_without_gpu;
namespace ro = ::testing::roundoff;

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
    // Higham's GEMM bound, element by element: a float32-accumulated dot product of k terms errs by
    // gamma_{k+1}(u32) (|A| |B| + |bias|) in any order or split (TF32 is off, checked), and the
    // result rounds to the dtype at most twice (a split GEMM's first part, then the sum), each within
    // u of a partial sum bounded by the same magnitude: relative to the largest reference element,
    // (gamma_{k+1}(u32) + gamma_2(u)) max M / max |ref|, M the float64 magnitudes below.
    REQUIRE_FALSE(cuda::allow_tf32());
    const double u = dt == DType::Float32 ? ro::kUnit : ro::kUnitBFloat16;
    const Tensor ax = abs(xr.detach()), aw = abs(wr.detach()), ag = abs(gy.cpu().to(DType::Float64));
    auto bound = [&](const Tensor& magnitude, const Tensor& ref, double k) {
      const double m = max(magnitude).item(), r = max(abs(ref.detach())).item();
      return (ro::gamma(k + 1, ro::kUnit) + ro::gamma(2, u)) * m / r;
    };
    CHECK(max_rel(y, yr) <= bound(add(matmul(ax, aw.t()), abs(br.detach())), yr, 24 + 1));
    CHECK(max_rel(x.grad(), xr.grad()) <= bound(matmul(ag, aw), xr.grad(), 77));
    CHECK(max_rel(w.grad(), wr.grad()) <= bound(matmul(ag.reshape({15, 77}).t(), ax.reshape({15, 24})), wr.grad(), 15));
    // bfloat16: the column sum as a GEMM with ones.
    CHECK(max_rel(b.grad(), br.grad()) <= bound(sum(ag.reshape({15, 77}), {0}), br.grad(), 15));
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
      // The loss, in float32 from the exact 16-bit logits: the sums over the 1001 classes and the 36
      // rows (roundoff.h's order term) and a chain of 8 roundings per row (x - max, exp, log, the
      // smoothing's mean and weights), each relative to the row's terms: the loss and the logits' scale.
      const double logit_scale = max(abs(lr.detach())).item();
      const double loss_bound = (ro::reduction_bound({double(vocab), double(N)}) + ro::gamma(8, ro::kUnit)) *
                                (std::abs(loss_ref.item()) + logit_scale);
      CHECK(std::abs(loss.item() - loss_ref.item()) <= loss_bound);
      // dlogits: (softmax - target) / rows in float32, rounded once to the 16-bit dtype (u relative to
      // the largest); the float32 softmax errs by its sum's order term and by exp's argument x - lse,
      // rounded within u32 (|x| + |lse|) <= 2 u32 (max |x| + log V) and a few roundings more.
      const double u = dt == DType::BFloat16 ? ro::kUnitBFloat16 : ro::kUnitFloat16;
      const double softmax_error = ro::reduction_bound({double(vocab)}) +
                                   ro::gamma(4 + 2 * (logit_scale + std::log(double(vocab))), ro::kUnit);
      CHECK(max_rel(logits.grad(), lr.grad()) <= u + softmax_error);
      // The ignored row has a zero gradient.
      CHECK(max(abs(logits.grad().cpu().to(DType::Float64).select(0, 3))).item() == 0.0);
    }
  }
}
