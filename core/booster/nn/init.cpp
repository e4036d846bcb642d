#include "booster/nn/init.h"

#include "booster/autograd/autograd.h"
#include "booster/ops/ops.h"
#include "booster/tensor/deferred.h"

namespace booster::nn::init {

namespace {

// Fills a float64 host buffer with draw() and copies it into t (converting dtype and device), so the
// numbers drawn do not depend on t's dtype.
template <class Draw>
void fill_from(const Tensor& t, Draw&& draw) {
  Tensor host = Tensor::empty(t.shape(), DType::Float64);
  double* p = host.data<double>();
  for (int64_t i = 0; i < host.numel(); ++i) p[i] = draw();
  NoGradGuard no_grad;
  Tensor dst = t;
  dst.copy_(host);
}

}  // namespace

void uniform_(const Tensor& t, double low, double high, Generator& gen) {
  if (defer_uniform(t, low, high, gen)) return t.bump_version();  // Note [Deferred storage]
  fill_from(t, [&] { return low + (high - low) * gen.uniform(); });
}

void normal_(const Tensor& t, double mean, double std, Generator& gen) {
  if (defer_normal(t, mean, std, gen)) return t.bump_version();
  fill_from(t, [&] { return mean + std * gen.normal(); });
}

void zeros_(const Tensor& t) {
  NoGradGuard no_grad;
  Tensor dst = t;
  dst.zero_();
}

void ones_(const Tensor& t) {
  NoGradGuard no_grad;
  Tensor dst = t;
  dst.fill_(1.0);
}

int64_t fan_in(const Tensor& weight) {
  BOOSTER_CHECK(weight.dim() >= 2, ShapeError, "fan_in: expected a weight of at least 2 dims, got shape ",
                weight.shape());
  int64_t receptive = 1;
  for (int64_t d = 2; d < weight.dim(); ++d) receptive *= weight.size(d);
  return weight.size(1) * receptive;
}

}  // namespace booster::nn::init
