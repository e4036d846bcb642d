#include "booster/nn/conv.h"

#include <cmath>

#include "booster/nn/init.h"
#include "booster/ops/ops.h"

namespace booster::nn {

namespace {
std::string pair(const Pair& p) { return str("(", p[0], ", ", p[1], ")"); }
}  // namespace

Conv2d::Conv2d(int64_t in, int64_t out, Pair kernel, Pair stride_, Pair padding_, Pair dilation_, int64_t groups_,
               bool with_bias, Generator* gen)
    : in_channels(in), out_channels(out), groups(groups_), kernel_size(kernel), stride(stride_), padding(padding_),
      dilation(dilation_) {
  BOOSTER_CHECK(in > 0 && out > 0 && kernel[0] > 0 && kernel[1] > 0, ValueError,
                "Conv2d: channels and kernel_size must be positive, got in ", in, ", out ", out, ", kernel ",
                pair(kernel));
  BOOSTER_CHECK(groups > 0 && in % groups == 0 && out % groups == 0, ValueError, "Conv2d: groups ", groups,
                " must divide in_channels ", in, " and out_channels ", out);
  Generator& g = gen ? *gen : default_generator();
  const int64_t fan_in = in / groups * kernel[0] * kernel[1];
  const double bound = 1.0 / std::sqrt(double(fan_in));
  weight = register_parameter("weight", Tensor::empty({out, in / groups, kernel[0], kernel[1]}));
  init::uniform_(weight, -bound, bound, g);
  if (with_bias) {
    bias = register_parameter("bias", Tensor::empty({out}));
    init::uniform_(bias, -bound, bound, g);
  }
}

Tensor Conv2d::forward(const Tensor& x) {
  BOOSTER_CHECK(x.dim() == 4 && x.size(1) == in_channels, ShapeError, "Conv2d: expected input [N, ", in_channels,
                ", H, W], got shape ", x.shape());
  return conv2d(x, weight, bias, stride, padding, dilation, groups);
}

std::string Conv2d::extra_repr() const {
  return str(in_channels, ", ", out_channels, ", kernel_size=", pair(kernel_size), ", stride=", pair(stride),
             ", padding=", pair(padding), ", dilation=", pair(dilation), ", groups=", groups,
             ", bias=", bias.defined() ? "True" : "False");
}

MaxPool2d::MaxPool2d(Pair kernel, Pair stride_, Pair padding_, Pair dilation_)
    : kernel_size(kernel), stride(stride_[0] == 0 && stride_[1] == 0 ? kernel : stride_), padding(padding_),
      dilation(dilation_) {}
Tensor MaxPool2d::forward(const Tensor& x) { return max_pool2d(x, kernel_size, stride, padding, dilation); }
std::string MaxPool2d::extra_repr() const {
  return str("kernel_size=", pair(kernel_size), ", stride=", pair(stride), ", padding=", pair(padding),
             ", dilation=", pair(dilation));
}

AvgPool2d::AvgPool2d(Pair kernel, Pair stride_, Pair padding_)
    : kernel_size(kernel), stride(stride_[0] == 0 && stride_[1] == 0 ? kernel : stride_), padding(padding_) {}
Tensor AvgPool2d::forward(const Tensor& x) { return avg_pool2d(x, kernel_size, stride, padding); }
std::string AvgPool2d::extra_repr() const {
  return str("kernel_size=", pair(kernel_size), ", stride=", pair(stride), ", padding=", pair(padding));
}

AdaptiveAvgPool2d::AdaptiveAvgPool2d(Pair output) : output_size(output) {}
Tensor AdaptiveAvgPool2d::forward(const Tensor& x) { return adaptive_avg_pool2d(x, output_size); }
std::string AdaptiveAvgPool2d::extra_repr() const { return str("output_size=", pair(output_size)); }

Tensor Flatten::forward(const Tensor& x) {
  const int64_t d = x.dim();
  const int64_t start = start_dim < 0 ? start_dim + d : start_dim, end = end_dim < 0 ? end_dim + d : end_dim;
  BOOSTER_CHECK(start >= 0 && end < d && start <= end, IndexError, "Flatten: dims ", start_dim, "..", end_dim,
                " do not fit an input of shape ", x.shape());
  Shape shape(x.shape().begin(), x.shape().begin() + start);
  int64_t n = 1;
  for (int64_t i = start; i <= end; ++i) n *= x.size(i);
  shape.push_back(n);
  shape.insert(shape.end(), x.shape().begin() + end + 1, x.shape().end());
  return x.reshape(shape);
}

Tensor BatchNorm2d::forward(const Tensor& x) {
  BOOSTER_CHECK(x.dim() == 4, ShapeError, "BatchNorm2d: expected input [N, C, H, W], got shape ", x.shape());
  return BatchNorm1d::forward(x.reshape({x.size(0), x.size(1), x.size(2) * x.size(3)})).reshape(x.shape());
}

}  // namespace booster::nn
