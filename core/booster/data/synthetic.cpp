#include "booster/data/synthetic.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>

#include "booster/common/error.h"
#include "booster/data/dataset.h"
#include "booster/tensor/random.h"

namespace booster::data {

std::shared_ptr<TensorDataset> synthetic_classification(int64_t n, int64_t features, int64_t classes,
                                                        uint64_t seed) {
  BOOSTER_CHECK(n >= 1 && features >= 1 && classes >= 1, ValueError, "synthetic_classification: n = ", n,
                ", features = ", features, ", classes = ", classes, "; each must be >= 1");
  constexpr double kNoise = 0.5;
  Generator gen(seed);
  std::vector<double> centers(size_t(classes * features));
  for (double& c : centers) c = gen.normal();

  Tensor x = Tensor::empty({n, features}, DType::Float32);
  Tensor y = Tensor::empty({n}, DType::Int64);
  float* px = x.data<float>();
  int64_t* py = y.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t label = i % classes;
    py[i] = label;
    const double* center = centers.data() + label * features;
    float* row = px + i * features;
    for (int64_t f = 0; f < features; ++f) row[f] = float(center[f] + kNoise * gen.normal());
  }
  return std::make_shared<TensorDataset>(std::move(x), std::move(y));
}

CharDataset::CharDataset(std::string text, int64_t context) : text_(std::move(text)), context_(context) {
  BOOSTER_CHECK(context >= 1, ValueError, "CharDataset: context = ", context, " must be >= 1");
  BOOSTER_CHECK(int64_t(text_.size()) > context, DataError, "CharDataset: the text has ", text_.size(),
                " bytes, too few for one window of context ", context, " plus its target; it needs at least ",
                context + 1);
}

namespace {

// Writes window i (x) and window i + 1 (y) of `text` as int64 byte values.
inline void write_window(const std::string& text, int64_t i, int64_t context, int64_t* x, int64_t* y) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(text.data()) + i;
  for (int64_t k = 0; k < context; ++k) {
    x[k] = bytes[k];
    y[k] = bytes[k + 1];
  }
}

}  // namespace

Batch CharDataset::get(int64_t i) const {
  BOOSTER_CHECK(i >= 0 && i < size(), IndexError, "CharDataset::get: index ", i,
                " is out of range for a data set of size ", size());
  Tensor x = Tensor::empty({context_}, DType::Int64);
  Tensor y = Tensor::empty({context_}, DType::Int64);
  write_window(text_, i, context_, x.data<int64_t>(), y.data<int64_t>());
  return {x, y};
}

Batch CharDataset::get_batch(const std::vector<int64_t>& indices) const {
  const int64_t b = int64_t(indices.size());
  Tensor x = Tensor::empty({b, context_}, DType::Int64);
  Tensor y = Tensor::empty({b, context_}, DType::Int64);
  int64_t* px = x.data<int64_t>();
  int64_t* py = y.data<int64_t>();
  for (int64_t k = 0; k < b; ++k) {
    const int64_t i = indices[size_t(k)];
    BOOSTER_CHECK(i >= 0 && i < size(), IndexError, "CharDataset::get_batch: index ", i,
                  " is out of range for a data set of size ", size());
    write_window(text_, i, context_, px + k * context_, py + k * context_);
  }
  return {x, y};
}

std::shared_ptr<CharDataset> char_dataset(const std::string& text_file, int64_t context) {
  check_data_file(text_file, "char_dataset: ", "pass the path of a readable text file");
  std::ifstream in(text_file, std::ios::binary);
  BOOSTER_CHECK(in.good(), DataError, "char_dataset: cannot open ", text_file, ": ", std::strerror(errno),
                "; pass the path of a readable text file");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  BOOSTER_CHECK(!in.bad(), DataError, "char_dataset: error while reading ", text_file);
  BOOSTER_CHECK(int64_t(text.size()) > context, DataError, "char_dataset: ", text_file, " has ", text.size(),
                " bytes, too few for one window of context ", context, "; it needs at least ", context + 1);
  return std::make_shared<CharDataset>(std::move(text), context);
}

}  // namespace booster::data
