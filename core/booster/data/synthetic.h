// Small data sets that need no download: learnable gaussian blobs, and character windows of a text
// file for language modelling (the CLI's "synthetic" and text data options).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "booster/data/dataset.h"

namespace booster::data {

// n points in `features` dimensions from `classes` gaussian blobs: x float32 [n, features], y int64 [n]
// with balanced labels (sample i has class i % classes). Each class has a center drawn from N(0, 1)
// per coordinate, each point is its center plus N(0, 0.5^2) noise, so a linear model separates them
// well but not trivially in few dimensions. The same seed gives the same data everywhere.
std::shared_ptr<TensorDataset> synthetic_classification(int64_t n, int64_t features, int64_t classes,
                                                        uint64_t seed = 0);

// Every window of `context` bytes of a text, for next-character prediction: item i is
// x = bytes[i, i + context) and y = bytes[i + 1, i + context + 1), both int64 [context].
// The vocabulary is the 256 byte values.
class CharDataset : public Dataset {
 public:
  static constexpr int64_t kVocabSize = 256;

  CharDataset(std::string text, int64_t context);

  int64_t size() const override { return int64_t(text_.size()) - context_; }
  Batch get(int64_t i) const override;
  Batch get_batch(const std::vector<int64_t>& indices) const override;  // writes the windows directly

  int64_t context() const { return context_; }
  int64_t vocab_size() const { return kVocabSize; }
  const std::string& text() const { return text_; }

 private:
  std::string text_;
  int64_t context_;
};

// A CharDataset over the bytes of `text_file`; DataError naming the file when it cannot be read or is
// not longer than `context` bytes.
std::shared_ptr<CharDataset> char_dataset(const std::string& text_file, int64_t context);

}  // namespace booster::data
