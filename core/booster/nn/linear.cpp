#include "booster/nn/linear.h"

#include <cmath>

#include "booster/nn/init.h"
#include "booster/ops/ops.h"

namespace booster::nn {

Linear::Linear(int64_t in, int64_t out, bool with_bias, Generator* gen)
    : in_features(in), out_features(out) {
  BOOSTER_CHECK(in > 0 && out > 0, ValueError, "Linear: in_features and out_features must be positive, got ",
                in, " and ", out);
  Generator& g = gen ? *gen : default_generator();
  const double bound = 1.0 / std::sqrt(double(in));
  weight = register_parameter("weight", Tensor::empty({out, in}));
  init::uniform_(weight, -bound, bound, g);
  if (with_bias) {
    bias = register_parameter("bias", Tensor::empty({out}));
    init::uniform_(bias, -bound, bound, g);
  }
}

Linear::Linear(Tensor w, Tensor b) {
  BOOSTER_CHECK(w.defined() && w.dim() == 2 && w.size(0) > 0 && w.size(1) > 0, ShapeError,
                "Linear: expected a weight [out_features, in_features], got ", w.defined() ? str(w.shape()) : "none");
  BOOSTER_CHECK(!b.defined() || (b.dim() == 1 && b.size(0) == w.size(0)), ShapeError, "Linear: bias of shape ",
                b.defined() ? str(b.shape()) : "", " does not match the weight's ", w.size(0), " output features");
  in_features = w.size(1);
  out_features = w.size(0);
  weight = register_parameter("weight", std::move(w));
  if (b.defined()) bias = register_parameter("bias", std::move(b));
}

Tensor Linear::forward(const Tensor& x) {
  BOOSTER_CHECK(x.dim() >= 1 && x.size(-1) == in_features, ShapeError, "Linear: expected input [..., ",
                in_features, "], got shape ", x.shape());
  return linear(x, weight, bias, output_row_multiple);
}

std::string Linear::extra_repr() const {
  return str("in_features=", in_features, ", out_features=", out_features, ", bias=", bias.defined() ? "True" : "False");
}

}  // namespace booster::nn
