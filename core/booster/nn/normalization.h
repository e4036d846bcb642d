// LayerNorm and BatchNorm1d (torch.nn.LayerNorm, torch.nn.BatchNorm1d).
#pragma once

#include "booster/nn/module.h"

namespace booster::nn {

class LayerNorm : public Module {
 public:
  // Normalises over the trailing dims `normalized_shape`; weight ones and bias zeros when affine.
  explicit LayerNorm(Shape normalized_shape, double eps = 1e-5, bool elementwise_affine = true);
  explicit LayerNorm(int64_t size, double eps = 1e-5, bool elementwise_affine = true)
      : LayerNorm(Shape{size}, eps, elementwise_affine) {}

  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "LayerNorm"; }
  std::string extra_repr() const override;

  const Shape normalized_shape;
  const double eps;
  Tensor weight, bias;  // normalized_shape each, undefined without elementwise_affine
};

class BatchNorm1d : public Module {
 public:
  // Buffers running_mean (zeros), running_var (ones) and num_batches_tracked (int64 0) exist only
  // with track_running_stats; weight (ones) and bias (zeros) only with affine. As PyTorch.
  explicit BatchNorm1d(int64_t num_features, double eps = 1e-5, double momentum = 0.1, bool affine = true,
                       bool track_running_stats = true);

  // x [N, C] or [N, C, L]. Training (or no running stats): batch statistics, and the running ones
  // updated with momentum; eval: the running statistics.
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "BatchNorm1d"; }
  std::string extra_repr() const override;

  const int64_t num_features;
  const double eps, momentum;
  Tensor weight, bias;
  Tensor running_mean, running_var, num_batches_tracked;
};

// True for batch-norm layers: what mixed precision O2 keeps in float32
// (model.to(DType::Float16, [](const Module& m) { return !is_batch_norm(m); })).
bool is_batch_norm(const Module& m);

}  // namespace booster::nn
