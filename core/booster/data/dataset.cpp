#include "booster/data/dataset.h"

#include <cstring>
#include <system_error>

#include "booster/common/error.h"
#include "booster/common/input_file.h"

namespace booster::data {

Dataset::~Dataset() = default;

namespace {

// Stacks same-shaped, same-dtype tensors along a new first dimension.
Tensor stack_items(const std::vector<Tensor>& items, const char* what) {
  const Tensor& first = items.front();
  Shape shape = first.shape();
  shape.insert(shape.begin(), int64_t(items.size()));
  Tensor out = Tensor::empty(shape, first.dtype());
  const size_t item_bytes = first.nbytes();
  char* dst = static_cast<char*>(out.data_ptr());
  for (size_t k = 0; k < items.size(); ++k) {
    const Tensor& t = items[k];
    BOOSTER_CHECK(t.shape() == first.shape() && t.dtype() == first.dtype(), ShapeError,
                  "Dataset::get_batch: item ", k, " has ", what, " of shape ", t.shape(), " and dtype ",
                  t.dtype(), " but item 0 has shape ", first.shape(), " and dtype ", first.dtype(),
                  "; every item of a batch must have the same shape and dtype");
    const Tensor c = t.cpu().contiguous();
    std::memcpy(dst + k * item_bytes, c.data_ptr(), item_bytes);
  }
  return out;
}

}  // namespace

Batch Dataset::get_batch(const std::vector<int64_t>& indices) const {
  BOOSTER_CHECK(!indices.empty(), ValueError, "Dataset::get_batch: no indices; a batch needs at least one");
  std::vector<Tensor> xs, ys;
  xs.reserve(indices.size());
  ys.reserve(indices.size());
  for (int64_t i : indices) {
    BOOSTER_CHECK(i >= 0 && i < size(), IndexError, "Dataset::get_batch: index ", i,
                  " is out of range for a data set of size ", size());
    Batch b = get(i);
    xs.push_back(std::move(b.x));
    ys.push_back(std::move(b.y));
  }
  return {stack_items(xs, "x"), stack_items(ys, "y")};
}

Tensor gather_rows(const Tensor& src, const std::vector<int64_t>& indices, const char* who) {
  const int64_t n = src.size(0);
  Shape shape = src.shape();
  shape[0] = int64_t(indices.size());
  Tensor out = Tensor::empty(shape, src.dtype());
  const size_t row_bytes = n == 0 ? 0 : src.nbytes() / size_t(n);
  const char* from = static_cast<const char*>(src.data_ptr());
  char* to = static_cast<char*>(out.data_ptr());
  for (size_t k = 0; k < indices.size(); ++k) {
    const int64_t i = indices[k];
    BOOSTER_CHECK(i >= 0 && i < n, IndexError, who, ": index ", i, " is out of range for ", n,
                  " rows; expected 0 <= index < ", n);
    std::memcpy(to + k * row_bytes, from + size_t(i) * row_bytes, row_bytes);
  }
  return out;
}

TensorDataset::TensorDataset(Tensor x, Tensor y) {
  BOOSTER_CHECK(x.defined() && y.defined(), ValueError, "TensorDataset: x and y must be defined tensors");
  BOOSTER_CHECK(x.dim() >= 1 && y.dim() >= 1, ShapeError, "TensorDataset: x of shape ", x.shape(),
                " and y of shape ", y.shape(), " need a first (sample) dimension");
  BOOSTER_CHECK(x.size(0) == y.size(0), ShapeError, "TensorDataset: x has ", x.size(0), " rows (shape ",
                x.shape(), ") but y has ", y.size(0), " (shape ", y.shape(), "); they must match");
  // Data sets hold data, not graphs: detach so a batch never drags autograd history along.
  x_ = x.detach().cpu().contiguous();
  y_ = y.detach().cpu().contiguous();
  size_ = x_.size(0);
}

Batch TensorDataset::get(int64_t i) const {
  BOOSTER_CHECK(i >= 0 && i < size_, IndexError, "TensorDataset::get: index ", i,
                " is out of range for a data set of size ", size_);
  return {x_.select(0, i), y_.select(0, i)};
}

Batch TensorDataset::get_batch(const std::vector<int64_t>& indices) const {
  return {gather_rows(x_, indices, "TensorDataset::get_batch"), gather_rows(y_, indices, "TensorDataset::get_batch")};
}

// Note [A data file that is not a file] (dataset.h).
void check_data_file(const std::filesystem::path& path, const std::string& who, const std::string& fix) {
  // One check for every input (Note [Inputs that are not files] in booster/common/input_file.h).
  std::string what = who;
  while (!what.empty() && what.back() == ' ') what.pop_back();
  check_input_file<DataError>(path, what, fix);
}

}  // namespace booster::data
