#include "booster/nn/normalization.h"

#include "booster/autograd/autograd.h"
#include "booster/ops/ops.h"

namespace booster::nn {

LayerNorm::LayerNorm(Shape shape, double eps_, bool affine) : normalized_shape(std::move(shape)), eps(eps_) {
  BOOSTER_CHECK(!normalized_shape.empty(), ValueError, "LayerNorm: normalized_shape must not be empty");
  for (int64_t d : normalized_shape)
    BOOSTER_CHECK(d > 0, ValueError, "LayerNorm: normalized_shape must be positive, got ", normalized_shape);
  if (affine) {
    weight = register_parameter("weight", ones(normalized_shape));
    bias = register_parameter("bias", zeros(normalized_shape));
  }
}

Tensor LayerNorm::forward(const Tensor& x) { return layer_norm(x, normalized_shape, weight, bias, eps); }

BatchNorm1d::BatchNorm1d(int64_t c, double eps_, double momentum_, bool affine, bool track_running_stats)
    : num_features(c), eps(eps_), momentum(momentum_) {
  BOOSTER_CHECK(c > 0, ValueError, "BatchNorm1d: num_features must be positive, got ", c);
  BOOSTER_CHECK(momentum >= 0.0 && momentum <= 1.0, ValueError, "BatchNorm1d: momentum must be in [0, 1], got ",
                momentum);
  if (affine) {
    weight = register_parameter("weight", ones({c}));
    bias = register_parameter("bias", zeros({c}));
  }
  if (track_running_stats) {
    running_mean = register_buffer("running_mean", zeros({c}));
    running_var = register_buffer("running_var", ones({c}));
    num_batches_tracked = register_buffer("num_batches_tracked", zeros({}, DType::Int64));
  }
}

Tensor BatchNorm1d::forward(const Tensor& x) {
  BOOSTER_CHECK(x.dim() == 2 || x.dim() == 3, ShapeError, "BatchNorm1d: expected input [N, C] or [N, C, L], got shape ",
                x.shape());
  BOOSTER_CHECK(x.size(1) == num_features, ShapeError, "BatchNorm1d: expected ", num_features,
                " channels in dim 1, got shape ", x.shape());
  const bool tracking = running_mean.defined();
  if (is_training() && tracking) {
    NoGradGuard no_grad;
    num_batches_tracked.fill_(num_batches_tracked.item() + 1);
  }
  // Without running statistics there is nothing to use in eval, so batch statistics are used always.
  const bool use_batch_stats = is_training() || !tracking;
  return batch_norm(x, running_mean, running_var, weight, bias, use_batch_stats, momentum, eps);
}

std::string LayerNorm::extra_repr() const {
  return str(normalized_shape, ", eps=", eps, ", elementwise_affine=", weight.defined() ? "True" : "False");
}

std::string BatchNorm1d::extra_repr() const {
  return str(num_features, ", eps=", eps, ", momentum=", momentum, ", affine=", weight.defined() ? "True" : "False",
             ", track_running_stats=", running_mean.defined() ? "True" : "False");
}

bool is_batch_norm(const Module& m) { return dynamic_cast<const BatchNorm1d*>(&m) != nullptr; }

}  // namespace booster::nn
