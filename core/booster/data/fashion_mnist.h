// Fashion-MNIST from its gzip IDX files (Debian package dataset-fashion-mnist).
#pragma once

#include <memory>
#include <string>

#include "booster/data/dataset.h"

namespace booster::data {

// Where the Debian package dataset-fashion-mnist installs the four files.
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";
// The usual normalization constants (mean and std of the training pixels scaled to [0, 1]).
inline constexpr float kFashionMnistMean = 0.2860f;
inline constexpr float kFashionMnistStd = 0.3530f;

// The training (60000) or test (10000) split as x float32 [N, 784] with pixels scaled to [0, 1]
// (then (x - mean) / std when `normalize`) and y int64 [N] with labels 0..9.
// Reads <dir>/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz (or the same names without .gz).
// Throws DataError naming the file: when it is missing (and how to install it), or when it is
// truncated, corrupt, or has the wrong magic number or sizes.
std::shared_ptr<TensorDataset> load_fashion_mnist(const std::string& dir = kFashionMnistDir, bool train = true,
                                                  bool normalize = false);

}  // namespace booster::data
