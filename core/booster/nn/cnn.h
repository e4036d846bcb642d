// CNNClassifier: the convolutional image classifier behind `"model": {"type": "cnn"}`.
//
//   features:   for each c in channels: Conv2d(prev, c, 3, padding 1) [-> BatchNorm2d(c)] -> ReLU -> MaxPool2d(2)
//   classifier: Flatten -> Linear(c_last * h * w, hidden) -> ReLU [-> Dropout] -> Linear(hidden, classes)
// Inputs [N, in_channels, height, width], or flat [N, in_channels * height * width] (Fashion-MNIST's
// rows), which are viewed as images. torch's default init, deterministic from the seed.
#pragma once

#include <memory>
#include <vector>

#include "booster/nn/container.h"
#include "booster/nn/module.h"

namespace booster::nn {

struct CNNConfig {
  int64_t in_channels = 1, height = 28, width = 28;
  std::vector<int64_t> channels = {32, 64};
  int64_t hidden = 128;
  int64_t classes = 10;
  bool batch_norm = true;
  double dropout = 0.0;
};

class CNNClassifier : public Module {
 public:
  explicit CNNClassifier(const CNNConfig& config, uint64_t seed = 0);
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "CNNClassifier"; }

  const CNNConfig config;
  std::shared_ptr<Sequential> features, classifier;
};

}  // namespace booster::nn
