#include "booster/nn/cnn.h"

#include "booster/nn/activation.h"
#include "booster/nn/conv.h"
#include "booster/nn/dropout.h"
#include "booster/nn/linear.h"

namespace booster::nn {

CNNClassifier::CNNClassifier(const CNNConfig& c, uint64_t seed) : config(c) {
  BOOSTER_CHECK(c.in_channels > 0 && c.height > 0 && c.width > 0 && c.hidden > 0 && c.classes > 0 && !c.channels.empty(),
                ValueError, "CNNClassifier: in_channels, height, width, hidden and classes must be positive and "
                "channels non-empty");
  Generator gen(seed);
  features = register_module("features", std::make_shared<Sequential>());
  int64_t prev = c.in_channels, h = c.height, w = c.width;
  for (int64_t out : c.channels) {
    BOOSTER_CHECK(out > 0, ValueError, "CNNClassifier: channels must be positive, got ", c.channels);
    BOOSTER_CHECK(h >= 2 && w >= 2, ValueError, "CNNClassifier: ", c.channels.size(), " blocks halve a ", c.height, "x",
                  c.width, " image below 1x1; use fewer channels entries or a larger image");
    features->push_back(std::make_shared<Conv2d>(prev, out, Pair{3, 3}, Pair{1, 1}, Pair{1, 1}, Pair{1, 1}, 1, true, &gen));
    if (c.batch_norm) features->push_back(std::make_shared<BatchNorm2d>(out));
    features->push_back(std::make_shared<ReLU>());
    features->push_back(std::make_shared<MaxPool2d>(Pair{2, 2}));
    prev = out;
    h /= 2;
    w /= 2;
  }
  classifier = register_module("classifier", std::make_shared<Sequential>());
  classifier->push_back(std::make_shared<Flatten>());
  classifier->push_back(std::make_shared<Linear>(prev * h * w, c.hidden, true, &gen));
  classifier->push_back(std::make_shared<ReLU>());
  if (c.dropout > 0.0) classifier->push_back(std::make_shared<Dropout>(c.dropout, std::make_shared<Generator>(seed + 1)));
  classifier->push_back(std::make_shared<Linear>(c.hidden, c.classes, true, &gen));
  set_tensor_names();
}

Tensor CNNClassifier::forward(const Tensor& x) {
  const int64_t pixels = config.in_channels * config.height * config.width;
  Tensor images = x;
  if (x.dim() == 2) {
    BOOSTER_CHECK(x.size(1) == pixels, ShapeError, "CNNClassifier: a flat input needs ", pixels, " features (",
                  config.in_channels, "x", config.height, "x", config.width, "), got shape ", x.shape());
    images = x.reshape({x.size(0), config.in_channels, config.height, config.width});
  }
  BOOSTER_CHECK(images.dim() == 4 && images.size(1) == config.in_channels && images.size(2) == config.height &&
                    images.size(3) == config.width,
                ShapeError, "CNNClassifier: expected [N, ", config.in_channels, ", ", config.height, ", ", config.width,
                "] or [N, ", pixels, "], got shape ", x.shape());
  return (*classifier)((*features)(images));
}

}  // namespace booster::nn
