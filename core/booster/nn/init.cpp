#include "booster/nn/init.h"

#include <algorithm>

#include "booster/autograd/autograd.h"
#include "booster/ops/ops.h"
#include "booster/tensor/deferred.h"

namespace booster::nn::init {

namespace {

// Fills t with draw() through a float64 host buffer, converting dtype and device as copy_ does, so the
// numbers drawn do not depend on t's dtype. A contiguous t is filled a chunk at a time: building a
// model then takes its parameters' memory, not three times its largest tensor's (a full float64 copy
// beside it), which for a Llama's embedding is gigabytes.
template <class Draw>
void fill_from(const Tensor& t, Draw&& draw) {
  NoGradGuard no_grad;
  const int64_t n = t.numel();
  constexpr int64_t kChunk = int64_t(1) << 20;  // 8 MB of float64
  if (!t.is_contiguous() || n <= kChunk) {
    Tensor host = Tensor::empty(t.shape(), DType::Float64);
    double* p = host.data<double>();
    for (int64_t i = 0; i < n; ++i) p[i] = draw();
    Tensor dst = t;
    dst.copy_(host);
    return;
  }
  const Tensor flat = t.view({n});
  Tensor host = Tensor::empty({kChunk}, DType::Float64);
  double* p = host.data<double>();
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t len = std::min(kChunk, n - start);
    for (int64_t i = 0; i < len; ++i) p[i] = draw();
    Tensor dst = flat.narrow(0, start, len);
    dst.copy_(host.narrow(0, 0, len));
  }
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
