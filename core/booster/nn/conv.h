// Convolution, pooling and the layers around them, with torch.nn's names, defaults and parameter
// names: Conv2d, MaxPool2d, AvgPool2d, AdaptiveAvgPool2d, Flatten, BatchNorm2d. Images are NCHW.
#pragma once

#include <array>
#include <cstdint>

#include "booster/nn/module.h"
#include "booster/nn/normalization.h"

namespace booster::nn {

using Pair = std::array<int64_t, 2>;

// weight [out, in / groups, kh, kw] and bias [out], both U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with
// fan_in = in / groups * kh * kw: torch's default (kaiming_uniform with a = sqrt(5)).
class Conv2d : public Module {
 public:
  Conv2d(int64_t in_channels, int64_t out_channels, Pair kernel_size, Pair stride = {1, 1}, Pair padding = {0, 0},
         Pair dilation = {1, 1}, int64_t groups = 1, bool bias = true, Generator* gen = nullptr);
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "Conv2d"; }
  std::string extra_repr() const override;

  const int64_t in_channels, out_channels, groups;
  const Pair kernel_size, stride, padding, dilation;
  Tensor weight, bias;
};

// stride {0, 0}: the kernel size, as torch.
class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(Pair kernel_size, Pair stride = {0, 0}, Pair padding = {0, 0}, Pair dilation = {1, 1});
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "MaxPool2d"; }
  std::string extra_repr() const override;
  const Pair kernel_size, stride, padding, dilation;
};

class AvgPool2d : public Module {
 public:
  explicit AvgPool2d(Pair kernel_size, Pair stride = {0, 0}, Pair padding = {0, 0});
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "AvgPool2d"; }
  std::string extra_repr() const override;
  const Pair kernel_size, stride, padding;
};

class AdaptiveAvgPool2d : public Module {
 public:
  explicit AdaptiveAvgPool2d(Pair output_size);
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "AdaptiveAvgPool2d"; }
  std::string extra_repr() const override;
  const Pair output_size;
};

// Flattens dims start_dim..end_dim into one (torch.nn.Flatten: 1..-1).
class Flatten : public Module {
 public:
  explicit Flatten(int64_t start_dim = 1, int64_t end_dim = -1) : start_dim(start_dim), end_dim(end_dim) {}
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "Flatten"; }
  const int64_t start_dim, end_dim;
};

// BatchNorm over the channels of [N, C, H, W]: statistics over N, H and W, as torch.nn.BatchNorm2d.
// The same parameters, buffers and strategy handling as BatchNorm1d (fp16_naive keeps it in float32).
class BatchNorm2d : public BatchNorm1d {
 public:
  using BatchNorm1d::BatchNorm1d;
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "BatchNorm2d"; }
};

}  // namespace booster::nn
