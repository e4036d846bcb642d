// Datasets: a size and an item (or a batch of items) per index, as torch.utils.data.Dataset.
//
// An item is a Batch {x, y}. A DataLoader asks for whole batches through get_batch, so a data set
// that holds its data in tensors gathers rows with one memcpy each instead of building and stacking
// one small tensor per item.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <memory>
#include <vector>

#include "booster/tensor/tensor.h"

namespace booster::data {

// An input and its target. An aggregate of two tensors, so `auto& [x, y] = batch` works.
struct Batch {
  Tensor x, y;
};

class Dataset {
 public:
  virtual ~Dataset();
  virtual int64_t size() const = 0;
  // Item i, 0 <= i < size(). Its tensors have no batch dimension.
  virtual Batch get(int64_t i) const = 0;
  // The items at `indices` stacked along a new first dimension (a contiguous copy).
  // The default calls get() per index; data sets with tensor storage override it with a gather.
  virtual Batch get_batch(const std::vector<int64_t>& indices) const;
};

using DatasetPtr = std::shared_ptr<const Dataset>;

// Rows of two tensors with the same first dimension, as torch.utils.data.TensorDataset(x, y).
class TensorDataset : public Dataset {
 public:
  // x [N, ...] and y [N, ...]; both are kept as contiguous CPU tensors (copied when they are not).
  TensorDataset(Tensor x, Tensor y);

  int64_t size() const override { return size_; }
  Batch get(int64_t i) const override;  // views of row i
  Batch get_batch(const std::vector<int64_t>& indices) const override;

  const Tensor& x() const { return x_; }
  const Tensor& y() const { return y_; }

 private:
  Tensor x_, y_;
  int64_t size_ = 0;
};

// Copies rows `indices` of the contiguous tensor `src` ([N, ...]) into a new tensor [len(indices), ...],
// one memcpy per row. Throws IndexError (naming `who`) for an index outside [0, N).
Tensor gather_rows(const Tensor& src, const std::vector<int64_t>& indices, const char* who);

// Note [A data file that is not a file]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A directory opens as an ifstream on Linux, and its size reads as 2^63 - 1: a reader that sizes its
// buffer from it throws std::bad_alloc, one that reads on gets nothing. A FIFO blocks the run forever.
// Every reader of a data file (.npy, .npz, .safetensors, CSV, text, token files, Fashion-MNIST's IDX
// files, a tokenizer's model) calls this first: a DataError "<who> <path> is a directory, not a regular
// file; <fix>" (or a FIFO, a device, a socket), naming the path; the check is booster's one for every
// input (Note [Inputs that are not files] in booster/common/input_file.h). A path that does not exist is
// left to the reader's own message.
void check_data_file(const std::filesystem::path& path, const std::string& who, const std::string& fix);

}  // namespace booster::data
