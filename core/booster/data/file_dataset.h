// Data sets from files a user has: inputs x and labels y as NumPy arrays (two .npy files or one .npz),
// as tensors of one .safetensors file, or as a CSV table; split into train and test, normalized and
// converted into TensorDatasets. The `booster` command's data types "npy", "safetensors" and "csv".
//
// Note [File data]
// ~~~~~~~~~~~~~~~~
// x holds one sample per row of its first dimension (any shape after it: [N, features] or
// [N, 28, 28]); y holds one label per row ([N], or [N, 1]), or, for regression targets, [N, ...].
// x may be float32, float64, uint8 or int64 (int32 too) and becomes `x_dtype` (float32 by default);
// integer labels (any of those dtypes holding whole numbers) become int64 class indices, which must
// lie in [0, num_classes) when the number of classes is known. Float targets stay floats (for an mse
// criterion) when `integer_labels` is false.
// The test split is a second set of files, or the `test_fraction` of the rows chosen by a shuffle seeded
// with `seed` (the same rows on every run and every rank), or nothing.
// Normalization: none; standardize, (x - mean) / std per feature with the mean and std of the training
// split only (a constant feature keeps std 1), applied to both splits; or scale, x / divide_by (255
// maps uint8 pixels to [0, 1]).
// Non-finite values: an inf or NaN in the inputs or in float targets (as the file holds them, or a
// float64 value float32 cannot hold) is refused unless `allow_nonfinite`: a NaN input trains to a NaN
// loss at best, and a model with a ReLU in front may hide it (Note [NaN propagation] in
// booster/backends/cpu/elementwise.cpp). The check is one pass at load over each split's converted x
// and y, and names the first such value's sample and element.
// Every problem is a DataError naming the file (and the array, row or column): a missing file, a bad
// header, an unsupported dtype, x and y of different lengths, a label out of range, a value that is
// not finite.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "booster/data/csv.h"
#include "booster/data/dataset.h"
#include "booster/data/npy.h"

namespace booster::data {

enum class FileFormat { Npy, Npz, Safetensors, Csv };

// Where one split's x and y are.
struct ArrayFiles {
  FileFormat format = FileFormat::Npy;
  std::string x_path, y_path;            // Npy: the two files; the other formats: x_path is the file
  std::string x_key = "x", y_key = "y";  // Npz and Safetensors: the arrays' names
  CsvOptions csv;                        // Csv
};

enum class Normalize { None, Standardize, Scale };

struct FileDataOptions {
  ArrayFiles train;
  std::optional<ArrayFiles> test;  // the test split's files, if any
  double test_fraction = 0.0;      // without test files: this share of the rows, in [0, 1)
  uint64_t seed = 0;               // the shuffle that picks the test rows
  Normalize normalize = Normalize::None;
  double divide_by = 255.0;        // Normalize::Scale
  DType x_dtype = DType::Float32;  // Float32, Float64 or Int64 (normalizing needs a floating type)
  bool integer_labels = true;      // false: float targets are kept (regression)
  std::optional<int64_t> num_classes;  // when set, every label must lie in [0, num_classes)
  bool allow_nonfinite = false;        // keep inf/NaN inputs and targets instead of refusing the file
};

// One split's x and y as the files hold them, checked to have as many rows.
struct LabeledArrays {
  Array x, y;
  std::string x_where, y_where;  // "train_x.npy", "data.npz array 'x'": for messages
};
LabeledArrays read_labeled_arrays(const ArrayFiles& files);

struct FileData {
  std::shared_ptr<TensorDataset> train;
  std::shared_ptr<TensorDataset> test;  // null without a test split
  std::string description;              // "npy train_x.npy: 900 train, 100 test rows of [4] float32 ..."
};
FileData load_file_data(const FileDataOptions& options);

}  // namespace booster::data
