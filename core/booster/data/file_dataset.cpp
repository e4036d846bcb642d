// Data sets from .npy/.npz, .safetensors and CSV files (Note [File data] in file_dataset.h).
#include "booster/data/file_dataset.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <numeric>

#include "booster/checkpoint/safetensors.h"
#include "booster/common/error.h"
#include "booster/data/dataset.h"
#include "booster/ops/ops.h"
#include "booster/tensor/random.h"

namespace booster::data {

namespace fs = std::filesystem;

namespace {

const char* format_name(FileFormat f) {
  switch (f) {
    case FileFormat::Npy: return "npy";
    case FileFormat::Npz: return "npz";
    case FileFormat::Safetensors: return "safetensors";
    case FileFormat::Csv: return "csv";
  }
  return "?";
}

// A named array of a map read from one file; DataError listing the names there are.
template <class Map>
const typename Map::mapped_type& named(const Map& arrays, const std::string& key, const std::string& file,
                                       const char* what) {
  auto it = arrays.find(key);
  if (it == arrays.end()) {
    std::string names;
    for (const auto& [name, _] : arrays) names += (names.empty() ? "'" : ", '") + name + "'";
    BOOSTER_FAIL(DataError, file, " has no ", what, " '", key, "'; it holds ", names.empty() ? "none" : names,
                 " (set data.x_key / data.y_key to the names of the inputs and the labels)");
  }
  return it->second;
}

Array from_safetensors(const checkpoint::RawTensor& t, const std::string& where) {
  Array a;
  if (t.dtype == "F32") a.dtype = ArrayDType::Float32;
  else if (t.dtype == "F64") a.dtype = ArrayDType::Float64;
  else if (t.dtype == "U8") a.dtype = ArrayDType::UInt8;
  else if (t.dtype == "I32") a.dtype = ArrayDType::Int32;
  else if (t.dtype == "I64") a.dtype = ArrayDType::Int64;
  else
    BOOSTER_FAIL(DataError, where, " has dtype ", t.dtype,
                 ", which data sets do not take; supported: F32, F64, U8, I32, I64 (convert it before saving)");
  a.shape = t.shape;
  a.bytes = t.bytes;
  return a;
}

}  // namespace

LabeledArrays read_labeled_arrays(const ArrayFiles& files) {
  LabeledArrays out;
  switch (files.format) {
    case FileFormat::Npy:
      out.x = read_npy(files.x_path);
      out.y = read_npy(files.y_path);
      out.x_where = files.x_path;
      out.y_where = files.y_path;
      break;
    case FileFormat::Npz: {
      const std::map<std::string, Array> arrays = read_npz(files.x_path);
      out.x = named(arrays, files.x_key, files.x_path, "array");
      out.y = named(arrays, files.y_key, files.x_path, "array");
      out.x_where = files.x_path + " array '" + files.x_key + "'";
      out.y_where = files.x_path + " array '" + files.y_key + "'";
      break;
    }
    case FileFormat::Safetensors: {
      std::error_code ec;
      BOOSTER_CHECK(fs::exists(files.x_path, ec), DataError, files.x_path,
                    " does not exist; expected a .safetensors file with tensors '", files.x_key, "' and '",
                    files.y_key, "'");
      check_data_file(files.x_path, "", "expected a .safetensors file with tensors '" + files.x_key + "' and '" +
                                            files.y_key + "'");
      std::map<std::string, checkpoint::RawTensor> tensors;
      try {
        tensors = checkpoint::read_safetensors_raw(files.x_path);
      } catch (const CheckpointError& e) {
        BOOSTER_FAIL(DataError, e.what());
      }
      out.x_where = files.x_path + " tensor '" + files.x_key + "'";
      out.y_where = files.x_path + " tensor '" + files.y_key + "'";
      out.x = from_safetensors(named(tensors, files.x_key, files.x_path, "tensor"), out.x_where);
      out.y = from_safetensors(named(tensors, files.y_key, files.x_path, "tensor"), out.y_where);
      break;
    }
    case FileFormat::Csv: {
      CsvTable table = read_csv(files.x_path, files.csv);
      out.x = std::move(table.features);
      out.y = std::move(table.labels);
      out.x_where = files.x_path + " (features)";
      out.y_where = files.x_path + " (label column" + (table.label_name.empty() ? "" : " \"" + table.label_name + "\"") + ")";
      break;
    }
  }
  BOOSTER_CHECK(!out.x.shape.empty() && !out.y.shape.empty(), DataError, out.x.shape.empty() ? out.x_where : out.y_where,
                " is a scalar; expected one row per sample along the first dimension");
  BOOSTER_CHECK(out.x.shape[0] == out.y.shape[0], DataError, out.x_where, " has ", out.x.shape[0], " rows (shape ",
                out.x.shape, ") but ", out.y_where, " has ", out.y.shape[0], " (shape ", out.y.shape,
                "); x and y need one row per sample each");
  BOOSTER_CHECK(out.x.shape[0] > 0, DataError, out.x_where, " has no rows");
  return out;
}

namespace {

// The flat index of the first inf or NaN of a contiguous float tensor, or -1. Blocks are tested
// branch-free (all exponent bits set; an OR the compiler vectorizes), and only a block that has one is
// searched element by element.
template <class T, class U>
int64_t first_nonfinite_in(const T* p, int64_t n) {
  constexpr U exponent = sizeof(T) == 4 ? U(0x7f800000u) : U(0x7ff0000000000000ull);
  constexpr int64_t kBlock = 4096;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    U bad = 0;
    for (int64_t i = b; i < e; ++i) bad |= U((std::bit_cast<U>(p[i]) & exponent) == exponent);
    if (!bad) continue;
    for (int64_t i = b; i < e; ++i)
      if (!std::isfinite(p[i])) return i;
  }
  return -1;
}

int64_t first_nonfinite(const Tensor& t) {
  if (t.dtype() == DType::Float32) return first_nonfinite_in<float, uint32_t>(t.data<float>(), t.numel());
  if (t.dtype() == DType::Float64) return first_nonfinite_in<double, uint64_t>(t.data<double>(), t.numel());
  return -1;  // integers are always finite
}

// DataError naming `where`, the sample and the element of the first inf/NaN of `t` (converted from
// `array`), unless there is none (Note [File data]).
void check_finite(const Tensor& t, const Array& array, const std::string& where) {
  const int64_t i = first_nonfinite(t);
  if (i < 0) return;
  const Shape& shape = t.shape();
  const int64_t per_sample = shape.empty() || shape[0] == 0 ? 1 : t.numel() / shape[0];
  Shape index(shape.size());
  for (int64_t r = i, d = int64_t(shape.size()) - 1; d >= 0; --d) {
    index[size_t(d)] = r % shape[size_t(d)];
    r /= shape[size_t(d)];
  }
  const double in_file = array.at(i), loaded = t.dtype() == DType::Float32 ? double(t.data<float>()[i]) : t.data<double>()[i];
  const std::string value = std::isfinite(in_file) ? str(in_file, ", which ", t.dtype(), " cannot hold (", loaded, ")")
                                                   : str(in_file);
  BOOSTER_FAIL(DataError, where, ": sample ", i / per_sample,
               per_sample > 1 ? str(", element ", i % per_sample, " (index ", index, ")") : std::string(), " is ",
               value, "; a data set must be finite, or every loss is NaN (fix the file, or set "
               "data.allow_nonfinite to true to train on it as it is)");
}

// One split's tensors: x converted, y as int64 labels ([N]) or float targets.
struct SplitTensors {
  Tensor x, y;
};

SplitTensors convert(const LabeledArrays& a, const FileDataOptions& o) {
  SplitTensors s;
  s.x = to_tensor(a.x, o.x_dtype == DType::Int64 ? DType::Int64 : (o.x_dtype == DType::Float64 ? DType::Float64 : DType::Float32),
                  a.x_where);
  if (!o.allow_nonfinite) check_finite(s.x, a.x, a.x_where);
  if (o.integer_labels) {
    Shape shape = a.y.shape;
    BOOSTER_CHECK(shape.size() == 1 || (shape.size() == 2 && shape[1] == 1), DataError, a.y_where, " has shape ",
                  shape, "; class labels need one per row: [N] or [N, 1]");
    s.y = to_tensor(a.y, DType::Int64, a.y_where).reshape({shape[0]});
    if (o.num_classes) {
      const int64_t* y = s.y.data<int64_t>();
      for (int64_t i = 0; i < s.y.numel(); ++i)
        BOOSTER_CHECK(y[i] >= 0 && y[i] < *o.num_classes, DataError, a.y_where, " has label ", y[i], " at row ", i,
                      ", outside [0, ", *o.num_classes, ") for the model's ", *o.num_classes,
                      " classes; labels must be class indices 0..", *o.num_classes - 1,
                      " (set model.classes, or renumber the labels)");
    }
  } else {
    s.y = to_tensor(a.y, DType::Float32, a.y_where);
  }
  if (!o.allow_nonfinite) check_finite(s.y, a.y, a.y_where);
  return s;
}

Tensor take_rows(const Tensor& t, const std::vector<int64_t>& rows) { return gather_rows(t, rows, "file data"); }

// Per feature (every element after the first dim) mean and std of the training rows, applied to x.
void standardize(Tensor& train_x, Tensor* test_x) {
  const int64_t n = train_x.size(0), f = train_x.numel() / std::max<int64_t>(n, 1);
  std::vector<double> mean(size_t(f), 0.0), m2(size_t(f), 0.0);
  const Tensor x64 = train_x.to(DType::Float64).contiguous();
  const double* px = x64.data<double>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < f; ++j) mean[size_t(j)] += px[r * f + j];
  for (double& m : mean) m /= double(n);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < f; ++j) {
      const double d = px[r * f + j] - mean[size_t(j)];
      m2[size_t(j)] += d * d;
    }
  std::vector<double> inv_std(static_cast<size_t>(f), 1.0);
  for (int64_t j = 0; j < f; ++j) {
    const double sd = std::sqrt(m2[size_t(j)] / double(n));
    inv_std[size_t(j)] = sd > 0.0 ? 1.0 / sd : 1.0;
  }
  auto apply = [&](Tensor& x) {
    Tensor y = x.to(DType::Float64).contiguous();
    double* p = y.data<double>();
    const int64_t rows = y.size(0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < f; ++j) p[r * f + j] = (p[r * f + j] - mean[size_t(j)]) * inv_std[size_t(j)];
    x = y.to(x.dtype());
  };
  apply(train_x);
  if (test_x) apply(*test_x);
}

std::string describe(const ArrayFiles& f) {
  if (f.format == FileFormat::Npy) return f.x_path + " and " + f.y_path;
  return f.x_path;
}

}  // namespace

FileData load_file_data(const FileDataOptions& o) {
  BOOSTER_CHECK(o.test_fraction >= 0.0 && o.test_fraction < 1.0, ValueError, "file data: test_fraction ",
                o.test_fraction, " is outside [0, 1)");
  BOOSTER_CHECK(!(o.test && o.test_fraction > 0.0), ValueError,
                "file data: give test files or a test_fraction, not both");
  BOOSTER_CHECK(o.normalize == Normalize::None || is_floating(o.x_dtype), ValueError,
                "file data: normalizing needs a floating x dtype, not ", o.x_dtype);
  SplitTensors train = convert(read_labeled_arrays(o.train), o);
  std::optional<SplitTensors> test;
  if (o.test) {
    test = convert(read_labeled_arrays(*o.test), o);
    Shape a(train.x.shape().begin() + 1, train.x.shape().end()), b(test->x.shape().begin() + 1, test->x.shape().end());
    BOOSTER_CHECK(a == b, DataError, "the test split ", describe(*o.test), " has samples of shape ", b,
                  " but the training split ", describe(o.train), " has ", a);
  } else if (o.test_fraction > 0.0) {
    const int64_t n = train.x.size(0);
    const int64_t n_test = int64_t(double(n) * o.test_fraction);
    BOOSTER_CHECK(n_test > 0 && n_test < n, DataError, describe(o.train), " has ", n, " rows; a test_fraction of ",
                  o.test_fraction, " leaves ", n_test, " for the test split and ", n - n_test,
                  " for training; both need at least one");
    // The rows of a seeded permutation: the first n_test are the test split, the rest train, each in
    // file order so the split does not change the order a loader sees without shuffling.
    Generator gen(o.seed);
    const std::vector<int64_t> perm = randperm(n, &gen).to_vector<int64_t>();
    std::vector<int64_t> test_rows(perm.begin(), perm.begin() + n_test), train_rows(perm.begin() + n_test, perm.end());
    std::sort(test_rows.begin(), test_rows.end());
    std::sort(train_rows.begin(), train_rows.end());
    test = SplitTensors{take_rows(train.x, test_rows), take_rows(train.y, test_rows)};
    train = SplitTensors{take_rows(train.x, train_rows), take_rows(train.y, train_rows)};
  }

  if (o.normalize == Normalize::Standardize) {
    standardize(train.x, test ? &test->x : nullptr);
  } else if (o.normalize == Normalize::Scale) {
    BOOSTER_CHECK(o.divide_by > 0.0 && std::isfinite(o.divide_by), ValueError, "file data: divide_by ", o.divide_by,
                  " must be a positive number");
    train.x = mul(train.x, 1.0 / o.divide_by).to(train.x.dtype());
    if (test) test->x = mul(test->x, 1.0 / o.divide_by).to(test->x.dtype());
  }

  FileData out;
  out.train = std::make_shared<TensorDataset>(train.x, train.y);
  if (test) out.test = std::make_shared<TensorDataset>(test->x, test->y);
  const Shape sample(train.x.shape().begin() + 1, train.x.shape().end());
  out.description = str(format_name(o.train.format), " data from ", describe(o.train), ": ", out.train->size(), " train, ",
                        out.test ? out.test->size() : 0, " test samples of shape ", sample, " ", train.x.dtype(),
                        o.integer_labels ? ", integer labels" : ", float targets");
  return out;
}

}  // namespace booster::data
