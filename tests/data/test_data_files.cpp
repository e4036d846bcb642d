// Data from files a user has: the .npy/.npz, safetensors and CSV readers against files NumPy wrote
// (tests/fixtures/file_data/, made by make_file_data_fixtures.py) and bytes written out here by hand,
// and the data sets built from them (splits, normalization, dtypes) with their errors.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/checkpoint/safetensors.h"
#include "booster/common/error.h"
#include "booster/config/config.h"
#include "booster/config/training.h"
#include "booster/data/csv.h"
#include "booster/data/file_dataset.h"
#include "booster/data/npy.h"

using namespace booster;
using namespace booster::data;
using Catch::Matchers::Contains;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

const std::string kDir = std::string(BOOSTER_FIXTURE_DIR) + "/file_data/";

json fixture_values() {
  std::ifstream in(kDir + "values.json");
  return json::parse(in);
}

fs::path scratch(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("booster_test_data_files_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir / name;
}

fs::path write_bytes(const std::string& name, const std::string& bytes) {
  const fs::path p = scratch(name);
  std::ofstream(p, std::ios::binary) << bytes;
  return p;
}

// A .npy file from its parts, as the format defines it (Note [The .npy format]), for headers NumPy
// would not write.
std::string npy_bytes(const std::string& header, const std::string& data, int major = 1) {
  std::string out = std::string("\x93NUMPY", 6) + char(major) + char(0);
  if (major == 1) out += std::string{char(header.size() & 0xFF), char(header.size() >> 8)};
  else out += std::string{char(header.size() & 0xFF), char((header.size() >> 8) & 0xFF), 0, 0};
  return out + header + data;
}

// A safetensors file from its parts (Note [The safetensors format]), for U8 which booster's writer
// has no tensor type for.
std::string safetensors_bytes(const json& header, const std::string& data) {
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char((uint64_t(text.size()) >> (8 * i)) & 0xFF);
  return out + text + data;
}

}  // namespace

// ------------------------------------------------------------------------------------------ .npy

TEST_CASE("npy: arrays NumPy saved read back with their dtype, shape and values", "[data][files]") {
  const json v = fixture_values();
  const Array x = read_npy(kDir + "blobs_x.npy");
  CHECK(x.dtype == ArrayDType::Float32);
  CHECK(x.shape == Shape{120, 4});
  for (int r = 0; r < 3; ++r)
    for (int c = 0; c < 4; ++c) CHECK(x.at(r * 4 + c) == v["blobs_x_first_rows"][r][c].get<double>());
  const Array y = read_npy(kDir + "blobs_y.npy");
  CHECK(y.dtype == ArrayDType::Int64);
  CHECK(y.shape == Shape{120});
  for (int i = 0; i < 10; ++i) CHECK(y.at(i) == v["blobs_y_first"][i].get<double>());

  const Array pixels = read_npy(kDir + "pixels_u1.npy");
  CHECK(pixels.dtype == ArrayDType::UInt8);
  CHECK(pixels.shape == Shape{6, 2, 3});
  for (int i = 0; i < 36; ++i) CHECK(pixels.at(i) == double((i * 7) % 256));
  const Tensor as_float = to_tensor(pixels, DType::Float32, "pixels");
  CHECK(as_float.shape() == Shape{6, 2, 3});
  CHECK(as_float.to_vector<float>()[5] == 35.0f);

  const Array labels = read_npy(kDir + "labels_i4.npy");
  CHECK(labels.dtype == ArrayDType::Int32);
  CHECK(to_tensor(labels, DType::Int64, "labels").to_vector<int64_t>() == std::vector<int64_t>{0, 1, 2, 1, 0, 2});
  const Array f8 = read_npy(kDir + "values_f8.npy");
  CHECK(f8.dtype == ArrayDType::Float64);
  CHECK(to_tensor(f8, DType::Float64, "f8").to_vector<double>() == std::vector<double>{0.5, -1.25, 1e-3, 3.0});
  CHECK(read_npy(kDir + "scalar_shape_1.npy").shape == Shape{1});
}

TEST_CASE("npy: write_npy writes what the reader (and NumPy's format) expects", "[data][files]") {
  const Tensor t = from_vector(std::vector<double>{1.5, -2.0, 3.25, 0.0, 7.0, 8.5}, {2, 3}, DType::Float64);
  const fs::path p = scratch("written.npy");
  write_npy(p, t);
  std::ifstream in(p, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(bytes.substr(0, 8) == std::string("\x93NUMPY\x01\x00", 8));
  CHECK(bytes.find("{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), }") != std::string::npos);
  CHECK((bytes.size() - 6 * 8) % 64 == 0);  // the data starts 64-byte aligned
  const Array back = read_npy(p);
  CHECK(back.shape == Shape{2, 3});
  CHECK(to_tensor(back, DType::Float64, "back").to_vector<double>() == t.to_vector<double>());
  write_npy(p, from_vector(std::vector<int64_t>{4, 5, 6}, {3}, DType::Int64));
  CHECK(read_npy(p).shape == Shape{3});  // numpy writes (3,) for one dimension
}

TEST_CASE("npy: headers written by hand: versions 2.0, Python 2 longs, spacing", "[data][files]") {
  const std::string four_floats("\x00\x00\x80\x3f\x00\x00\x00\x40\x00\x00\x40\x40\x00\x00\x80\x40", 16);
  const Array v2 = parse_npy(reinterpret_cast<const uint8_t*>(npy_bytes("{'descr':'<f4','fortran_order':False,'shape':(2,2)}\n", four_floats, 2).data()),
                             npy_bytes("{'descr':'<f4','fortran_order':False,'shape':(2,2)}\n", four_floats, 2).size(), "v2");
  CHECK(v2.shape == Shape{2, 2});
  CHECK(v2.at(3) == 4.0);
  const std::string longs = npy_bytes("{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (4L,), }   \n", four_floats);
  CHECK(parse_npy(reinterpret_cast<const uint8_t*>(longs.data()), longs.size(), "longs").shape == Shape{4});
}

TEST_CASE("npy: what the reader refuses, with the file and what to do", "[data][files]") {
  CHECK_THROWS_AS(read_npy(kDir + "no_such.npy"), DataError);
  CHECK_THROWS_WITH(read_npy(kDir + "no_such.npy"), Contains("no_such.npy") && Contains("does not exist"));
  const fs::path not_npy = write_bytes("text.npy", "just some text, not an array\n");
  CHECK_THROWS_WITH(read_npy(not_npy), Contains(not_npy.string()) && Contains("magic"));
  CHECK_THROWS_WITH(read_npy(kDir + "fortran.npy"), Contains("fortran.npy") && Contains("Fortran") &&
                                                        Contains("ascontiguousarray"));
  CHECK_THROWS_WITH(read_npy(kDir + "big_endian.npy"), Contains("'>f4'") && Contains("big-endian"));
  CHECK_THROWS_WITH(read_npy(kDir + "bool.npy"), Contains("'|b1'") && Contains("not supported") && Contains("'<f4'"));
  CHECK_THROWS_WITH(read_npy(kDir + "float16.npy"), Contains("'<f2'") && Contains("supported"));
  // Truncated: the header promises more data than follows; and too much data.
  std::ifstream in(kDir + "blobs_x.npy", std::ios::binary);
  std::string whole((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const fs::path cut = write_bytes("cut.npy", whole.substr(0, whole.size() - 5));
  CHECK_THROWS_WITH(read_npy(cut), Contains("truncated") && Contains("[120, 4]"));
  const fs::path longer = write_bytes("longer.npy", whole + "xyz");
  CHECK_THROWS_WITH(read_npy(longer), Contains("not what its header says"));
  const fs::path bad_header = write_bytes("bad_header.npy", npy_bytes("{'descr': '<f4', 'shape': (2,), }\n", std::string(8, '\0')));
  CHECK_THROWS_WITH(read_npy(bad_header), Contains("not a valid .npy header") && Contains("fortran_order"));
  const fs::path bad_version = write_bytes("v9.npy", npy_bytes("{}", "", 9));
  CHECK_THROWS_WITH(read_npy(bad_version), Contains("version 9.0"));
  // Whole-number floats become labels; fractional ones are refused as labels.
  const Array f8 = read_npy(kDir + "values_f8.npy");
  CHECK_THROWS_WITH(to_tensor(f8, DType::Int64, "values_f8.npy"), Contains("values_f8.npy") && Contains("0.5") &&
                                                                      Contains("whole number"));
}

// ------------------------------------------------------------------------------------------ .npz

TEST_CASE("npz: stored (savez) and deflated (savez_compressed) archives read as the .npy files", "[data][files]") {
  const Array x = read_npy(kDir + "blobs_x.npy"), y = read_npy(kDir + "blobs_y.npy");
  const auto stored = read_npz(kDir + "blobs.npz");
  REQUIRE(stored.size() == 2);
  CHECK(stored.at("x").bytes == x.bytes);
  CHECK(stored.at("x").shape == x.shape);
  CHECK(stored.at("y").bytes == y.bytes);
  const auto deflated = read_npz(kDir + "blobs_compressed.npz");
  REQUIRE(deflated.count("inputs") == 1);
  CHECK(deflated.at("inputs").dtype == ArrayDType::Float64);
  CHECK(deflated.at("labels").dtype == ArrayDType::Int32);
  const Tensor a = to_tensor(deflated.at("inputs"), DType::Float32, "inputs"), b = to_tensor(x, DType::Float32, "x");
  CHECK(a.to_vector<float>() == b.to_vector<float>());
  CHECK(to_tensor(deflated.at("labels"), DType::Int64, "l").to_vector<int64_t>() ==
        to_tensor(y, DType::Int64, "y").to_vector<int64_t>());
}

TEST_CASE("npz: a damaged archive names the file and the member", "[data][files]") {
  std::ifstream in(kDir + "blobs_compressed.npz", std::ios::binary);
  std::string whole((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK_THROWS_WITH(read_npz(write_bytes("empty.npz", "")), Contains("not a readable .npz"));
  CHECK_THROWS_WITH(read_npz(write_bytes("head.npz", whole.substr(0, 200))), Contains("head.npz") && Contains("zip"));
  // Flip a byte inside the first member's deflated data: zlib or the CRC notices.
  std::string flipped = whole;
  flipped[100] = char(flipped[100] ^ 0x5A);
  CHECK_THROWS_WITH(read_npz(write_bytes("flipped.npz", flipped)), Contains("flipped.npz member 'inputs.npy'"));
}

// ------------------------------------------------------------------------------------------ safetensors

TEST_CASE("safetensors data: F32/I64 from booster's writer and U8 written by hand", "[data][files]") {
  const fs::path p = scratch("data.safetensors");
  checkpoint::write_safetensors(p, {{"x", from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {3, 2})},
                                    {"y", from_vector(std::vector<int64_t>{0, 1, 1}, {3}, DType::Int64)}});
  LabeledArrays a = read_labeled_arrays({FileFormat::Safetensors, p.string(), "", "x", "y", {}});
  CHECK(a.x.shape == Shape{3, 2});
  CHECK(a.y.dtype == ArrayDType::Int64);

  const std::string pixels = {char(0), char(128), char(255), char(1)};
  const std::string labels("\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00", 16);
  const fs::path u8 = write_bytes("u8.safetensors",
                                  safetensors_bytes({{"images", {{"dtype", "U8"}, {"shape", {2, 2}}, {"data_offsets", {0, 4}}}},
                                                     {"labels", {{"dtype", "I64"}, {"shape", {2}}, {"data_offsets", {4, 20}}}}},
                                                    pixels + labels));
  LabeledArrays b = read_labeled_arrays({FileFormat::Safetensors, u8.string(), "", "images", "labels", {}});
  CHECK(b.x.dtype == ArrayDType::UInt8);
  CHECK(to_tensor(b.x, DType::Float32, "u8").to_vector<float>() == std::vector<float>{0, 128, 255, 1});
  CHECK(to_tensor(b.y, DType::Int64, "labels").to_vector<int64_t>() == std::vector<int64_t>{1, 0});
  // Names that are not there list what is; an unsupported dtype names itself.
  CHECK_THROWS_WITH(read_labeled_arrays({FileFormat::Safetensors, u8.string(), "", "x", "y", {}}),
                    Contains("no tensor 'x'") && Contains("'images', 'labels'"));
  const fs::path f16 = write_bytes("f16.safetensors",
                                   safetensors_bytes({{"x", {{"dtype", "F16"}, {"shape", {1}}, {"data_offsets", {0, 2}}}},
                                                      {"y", {{"dtype", "I64"}, {"shape", {1}}, {"data_offsets", {2, 10}}}}},
                                                     std::string(10, '\0')));
  CHECK_THROWS_WITH(read_labeled_arrays({FileFormat::Safetensors, f16.string(), "", "x", "y", {}}),
                    Contains("F16") && Contains("U8"));
  CHECK_THROWS_AS(read_labeled_arrays({FileFormat::Safetensors, write_bytes("junk.safetensors", "junk").string(), "", "x", "y", {}}),
                  DataError);
}

// ------------------------------------------------------------------------------------------ CSV

TEST_CASE("csv: the NumPy-written table, the label column by name or index, header detection", "[data][files]") {
  const Array x = read_npy(kDir + "blobs_x.npy"), y = read_npy(kDir + "blobs_y.npy");
  CsvOptions by_name;
  by_name.label_name = "label";
  const CsvTable t = read_csv(kDir + "blobs.csv", by_name);
  CHECK(t.features.shape == Shape{120, 4});
  CHECK(t.feature_names == std::vector<std::string>{"f0", "f1", "f2", "f3"});
  CHECK(t.label_name == "label");
  CHECK(to_tensor(t.features, DType::Float32, "csv").to_vector<float>() == to_tensor(x, DType::Float32, "x").to_vector<float>());
  CHECK(to_tensor(t.labels, DType::Int64, "csv").to_vector<int64_t>() == to_tensor(y, DType::Int64, "y").to_vector<int64_t>());
  CsvOptions by_index;
  by_index.label_index = 2;
  CHECK(read_csv(kDir + "blobs.csv", by_index).labels.bytes == t.labels.bytes);

  // No header; the last column by default; quotes, spaces, CRLF and blank lines.
  const fs::path plain = write_bytes("plain.csv", "1, 2.5, 0\r\n\"3\",-4e-1,1\r\n\r\n5,6,+2\n");
  const CsvTable p = read_csv(plain);
  CHECK(p.feature_names.empty());
  CHECK(to_tensor(p.features, DType::Float64, "p").to_vector<double>() == std::vector<double>{1, 2.5, 3, -0.4, 5, 6});
  CHECK(to_tensor(p.labels, DType::Int64, "p").to_vector<int64_t>() == std::vector<int64_t>{0, 1, 2});
  CsvOptions semicolon;
  semicolon.delimiter = ';';
  semicolon.header = true;
  CHECK(read_csv(write_bytes("semi.csv", "1;2\n3;4\n"), semicolon).features.shape == Shape{1, 1});  // "1;2" taken as names
}

TEST_CASE("csv: a non-numeric cell names the row and column, as do ragged rows and a missing label column", "[data][files]") {
  const fs::path bad = write_bytes("bad.csv", "a,b,label\n1,2,0\n3,oops,1\n");
  REQUIRE_THROWS_AS(read_csv(bad), DataError);
  CHECK_THROWS_WITH(read_csv(bad), Contains("bad.csv") && Contains("row 3") && Contains("column 1") &&
                                       Contains("(\"b\")") && Contains("\"oops\""));
  CHECK_THROWS_WITH(read_csv(write_bytes("ragged.csv", "1,2,0\n3,4\n")), Contains("row 2") && Contains("2 cells"));
  const fs::path good = write_bytes("good.csv", "a,b,label\n1,2,0\n");
  CsvOptions by_name;
  by_name.label_name = "target";
  CHECK_THROWS_WITH(read_csv(good, by_name), Contains("no column \"target\"") && Contains("label"));
  CHECK_THROWS_WITH(read_csv(write_bytes("noheader.csv", "1,2\n"), by_name), Contains("no header row"));
  CsvOptions far;
  far.label_index = 7;
  CHECK_THROWS_WITH(read_csv(good, far), Contains("label column 7 does not exist"));
  CHECK_THROWS_WITH(read_csv(write_bytes("one.csv", "1\n2\n")), Contains("1 column"));
  CHECK_THROWS_WITH(read_csv(write_bytes("header_only.csv", "a,b\n")), Contains("no data rows"));
  CHECK_THROWS_WITH(read_csv(scratch("none.csv")), Contains("does not exist"));
}

// ------------------------------------------------------------------------------------------ data sets

TEST_CASE("file data: x and y of different lengths, labels out of range, named with the file", "[data][files]") {
  FileDataOptions o;
  o.train = {FileFormat::Npy, kDir + "blobs_x.npy", kDir + "labels_i4.npy", "x", "y", {}};
  CHECK_THROWS_WITH(load_file_data(o), Contains("blobs_x.npy has 120 rows") && Contains("labels_i4.npy has 6"));
  o.train = {FileFormat::Npy, kDir + "blobs_x.npy", kDir + "blobs_y.npy", "x", "y", {}};
  o.num_classes = 2;
  REQUIRE_THROWS_AS(load_file_data(o), DataError);
  CHECK_THROWS_WITH(load_file_data(o), Contains("blobs_y.npy has label 2 at row") && Contains("[0, 2)"));
  o.num_classes = 3;
  CHECK(load_file_data(o).train->size() == 120);
  // Labels need one per row.
  o.train = {FileFormat::Npy, kDir + "labels_i4.npy", kDir + "pixels_u1.npy", "x", "y", {}};
  CHECK_THROWS_WITH(load_file_data(o), Contains("pixels_u1.npy has shape [6, 2, 3]") && Contains("[N] or [N, 1]"));
}

TEST_CASE("file data: a seeded test_fraction split, test files, and the npz and csv forms agree", "[data][files]") {
  FileDataOptions o;
  o.train = {FileFormat::Npy, kDir + "blobs_x.npy", kDir + "blobs_y.npy", "x", "y", {}};
  o.test_fraction = 0.25;
  o.seed = 3;
  const FileData a = load_file_data(o), b = load_file_data(o);
  CHECK(a.train->size() == 90);
  CHECK(a.test->size() == 30);
  CHECK(a.test->x().to_vector<float>() == b.test->x().to_vector<float>());  // same seed, same rows
  o.seed = 4;
  CHECK(load_file_data(o).test->x().to_vector<float>() != a.test->x().to_vector<float>());
  // Every row lands in exactly one split: the sums add up.
  const double total = fixture_values()["blobs_x_sum"].get<double>();
  double sum = 0;
  for (float v : a.train->x().to_vector<float>()) sum += v;
  for (float v : a.test->x().to_vector<float>()) sum += v;
  CHECK(sum == Approx(total).epsilon(1e-5));

  FileDataOptions files;
  files.train = o.train;
  files.test = ArrayFiles{FileFormat::Npy, kDir + "blobs_test_x.npy", kDir + "blobs_test_y.npy", "x", "y", {}};
  const FileData t = load_file_data(files);
  CHECK(t.test->size() == 30);
  const json v = fixture_values();
  for (int i = 0; i < 10; ++i) CHECK(t.test->y().to_vector<int64_t>()[size_t(i)] == v["blobs_test_y_first"][i].get<int64_t>());
  files.test_fraction = 0.1;
  CHECK_THROWS_AS(load_file_data(files), ValueError);
  files.test_fraction = 0.0;

  FileDataOptions npz;
  npz.train = {FileFormat::Npz, kDir + "blobs_compressed.npz", "", "inputs", "labels", {}};
  FileDataOptions csv;
  csv.train = {FileFormat::Csv, kDir + "blobs.csv", "", "x", "y", {}};
  csv.train.csv.label_name = "label";
  const FileData from_npz = load_file_data(npz), from_csv = load_file_data(csv), from_npy = load_file_data(files);
  CHECK(from_npz.train->x().to_vector<float>() == from_npy.train->x().to_vector<float>());
  CHECK(from_csv.train->x().to_vector<float>() == from_npy.train->x().to_vector<float>());
  CHECK(from_csv.train->y().to_vector<int64_t>() == from_npy.train->y().to_vector<int64_t>());
  CHECK(from_npy.train->y().dtype() == DType::Int64);
}

TEST_CASE("file data: standardize uses the training split's statistics, scale divides", "[data][files]") {
  FileDataOptions o;
  o.train = {FileFormat::Npy, kDir + "blobs_x.npy", kDir + "blobs_y.npy", "x", "y", {}};
  o.test = ArrayFiles{FileFormat::Npy, kDir + "blobs_test_x.npy", kDir + "blobs_test_y.npy", "x", "y", {}};
  o.normalize = Normalize::Standardize;
  const FileData d = load_file_data(o);
  const json v = fixture_values();
  const std::vector<float> x = d.train->x().to_vector<float>();
  for (int j = 0; j < 4; ++j) {
    double mean = 0, sq = 0;
    for (int r = 0; r < 120; ++r) mean += x[size_t(r * 4 + j)];
    mean /= 120;
    for (int r = 0; r < 120; ++r) sq += (x[size_t(r * 4 + j)] - mean) * (x[size_t(r * 4 + j)] - mean);
    CHECK(mean == Approx(0.0).margin(1e-6));
    CHECK(std::sqrt(sq / 120) == Approx(1.0).epsilon(1e-5));
  }
  // The test split with the training statistics (NumPy's mean and population std).
  const Array raw_test = read_npy(kDir + "blobs_test_x.npy");
  const double expected = (raw_test.at(1) - v["blobs_x_mean"][1].get<double>()) / v["blobs_x_std"][1].get<double>();
  CHECK(d.test->x().to_vector<float>()[1] == Approx(expected).epsilon(1e-5));

  FileDataOptions pixels;
  pixels.train = {FileFormat::Npy, kDir + "pixels_u1.npy", kDir + "labels_i4.npy", "x", "y", {}};
  pixels.normalize = Normalize::Scale;
  const FileData p = load_file_data(pixels);
  CHECK(p.train->x().dtype() == DType::Float32);
  CHECK(p.train->x().shape() == Shape{6, 2, 3});
  CHECK(p.train->x().to_vector<float>()[1] == Approx(7.0 / 255.0));
  pixels.normalize = Normalize::None;
  pixels.x_dtype = DType::Int64;
  CHECK(load_file_data(pixels).train->x().to_vector<int64_t>()[2] == 14);
}

// ------------------------------------------------------------------------------------------ configs

namespace {
json npy_config() {
  return {{"model", {{"type", "mlp"}, {"in", 4}, {"hidden", {8}}, {"classes", 3}}},
          {"optimizer", {{"type", "adam"}, {"lr", 0.01}}},
          {"data", {{"type", "npy"}, {"x", kDir + "blobs_x.npy"}, {"y", kDir + "blobs_y.npy"}, {"test_fraction", 0.2}}}};
}
}  // namespace

TEST_CASE("file data configs: resolve fills the defaults and checks the files against the model", "[data][files][config]") {
  const json resolved = config::resolve(npy_config());
  CHECK(resolved["data"]["normalize"] == "none");
  CHECK(resolved["data"]["x_dtype"] == "float32");
  CHECK(resolved["data"]["path"].is_null());
  const config::DataSplits split = config::make_datasets(resolved["data"], 0);
  CHECK(split.train->size() == 96);
  CHECK(split.test->size() == 24);
  CHECK_THAT(split.description, Contains("blobs_x.npy"));

  json c = npy_config();
  c["model"]["in"] = 5;
  REQUIRE_THROWS_AS(config::resolve(c), DataError);
  CHECK_THROWS_WITH(config::resolve(c), Contains("'model.in' is 5") && Contains("blobs_x.npy") && Contains("[4]"));
  c = npy_config();
  c["model"]["classes"] = 2;
  CHECK_THROWS_WITH(config::resolve(c), Contains("label 2") && Contains("blobs_y.npy"));
  c = npy_config();
  c["data"]["x"] = kDir + "missing_x.npy";
  CHECK_THROWS_WITH(config::resolve(c), Contains("missing_x.npy") && Contains("does not exist"));
  c = npy_config();
  c["data"]["path"] = kDir + "blobs.npz";
  CHECK_THROWS_WITH(config::resolve(c), Contains("'data.path'") && Contains("both set"));
  c = npy_config();
  c["data"].erase("y");
  CHECK_THROWS_AS(config::resolve(c), ConfigError);
  c = npy_config();
  c["data"]["test_x"] = kDir + "blobs_test_x.npy";
  CHECK_THROWS_WITH(config::resolve(c), Contains("test_y"));
  c = npy_config();
  c["data"]["targets"] = "values";
  CHECK_THROWS_WITH(config::resolve(c), Contains("'data.targets'") && Contains("mse"));
  c = npy_config();
  c["data"]["normalize"] = "standardise";
  CHECK_THROWS_WITH(config::resolve(c), Contains("did you mean 'standardize'"));
  c = npy_config();
  c["model"] = {{"type", "gpt"}, {"vocab_size", 256}, {"context", 8}, {"width", 8}, {"layers", 1}, {"heads", 2}};
  CHECK_THROWS_WITH(config::resolve(c), Contains("needs token data"));

  // npz, safetensors and csv through the config too.
  c = npy_config();
  c["data"] = {{"type", "npy"}, {"path", kDir + "blobs_compressed.npz"}, {"x_key", "inputs"}, {"y_key", "labels"},
               {"normalize", "standardize"}};
  CHECK(config::make_datasets(config::resolve(c)["data"], 0).train->size() == 120);
  c["data"] = {{"type", "csv"}, {"path", kDir + "blobs.csv"}, {"label_column", "label"}, {"test_fraction", 0.5}};
  CHECK(config::make_datasets(config::resolve(c)["data"], 0).test->size() == 60);
  c["data"]["label_column"] = 1.5;
  CHECK_THROWS_WITH(config::resolve(c), Contains("'data.label_column'"));
  c["data"]["label_column"] = "label";
  c["data"]["delimiter"] = ";;";
  CHECK_THROWS_WITH(config::resolve(c), Contains("'data.delimiter'"));
  const fs::path st = scratch("config.safetensors");
  checkpoint::write_safetensors(st, {{"x", to_tensor(read_npy(kDir + "blobs_x.npy"), DType::Float32, "x")},
                                     {"y", to_tensor(read_npy(kDir + "blobs_y.npy"), DType::Int64, "y")}});
  c["data"] = {{"type", "safetensors"}, {"path", st.string()}};
  CHECK(config::make_datasets(config::resolve(c)["data"], 0).train->size() == 120);
}

TEST_CASE("file data: an inf or NaN in x or in float targets is refused by sample and element unless allowed",
          "[data][files][nonfinite]") {
  // x [5, 2, 3] float32 with a NaN at sample 3, element 4 (index [3, 1, 1]) and an inf after it.
  std::vector<float> xv(30);
  for (size_t i = 0; i < xv.size(); ++i) xv[i] = float(i) * 0.5f - 3.0f;
  xv[3 * 6 + 4] = NAN;
  xv[29] = INFINITY;
  const fs::path x = scratch("nonfinite_x.npy"), y = scratch("nonfinite_y.npy");
  write_npy(x, from_vector(xv, {5, 2, 3}));
  write_npy(y, from_vector(std::vector<int64_t>{0, 1, 2, 0, 1}, {5}));
  FileDataOptions o;
  o.train = {FileFormat::Npy, x.string(), y.string(), "x", "y", {}};
  REQUIRE_THROWS_AS(load_file_data(o), DataError);
  CHECK_THROWS_WITH(load_file_data(o), Contains("nonfinite_x.npy: sample 3, element 4 (index [3, 1, 1]) is nan") &&
                                           Contains("data.allow_nonfinite"));
  o.allow_nonfinite = true;
  const FileData kept = load_file_data(o);
  CHECK(std::isnan(kept.train->x().to_vector<float>()[22]));
  CHECK(std::isinf(kept.train->x().to_vector<float>()[29]));

  // Only the inf: the first non-finite value is what is named. Samples of one value name no element.
  xv[3 * 6 + 4] = 1.0f;
  write_npy(x, from_vector(xv, {5, 6}));
  o.allow_nonfinite = false;
  CHECK_THROWS_WITH(load_file_data(o), Contains("nonfinite_x.npy: sample 4, element 5 (index [4, 5]) is inf"));
  write_npy(x, from_vector(xv, {30}));
  write_npy(y, from_vector(std::vector<int64_t>(30, 0), {30}));
  CHECK_THROWS_WITH(load_file_data(o), Contains("nonfinite_x.npy: sample 29 is inf;"));

  // A float64 value float32 cannot hold becomes inf: named with the value the file holds.
  std::vector<double> big(6, 1.0);
  big[2] = 1e300;
  write_npy(x, from_vector(big, {3, 2}, DType::Float64));
  write_npy(y, from_vector(std::vector<double>{0, 1, 2}, {3}, DType::Float64));
  CHECK_THROWS_WITH(load_file_data(o), Contains("sample 1, element 0 (index [1, 0]) is 1e+300, which float32 cannot "
                                                "hold (inf)"));
  o.x_dtype = DType::Float64;  // as float64 it is finite
  CHECK(load_file_data(o).train->size() == 3);

  // Float targets are checked too; class labels were always whole numbers (a NaN label is not one).
  write_npy(y, from_vector(std::vector<double>{0, -INFINITY, 2}, {3}, DType::Float64));
  CHECK_THROWS_WITH(load_file_data(o), Contains("element 1 is -inf, not a whole number"));
  o.integer_labels = false;
  CHECK_THROWS_WITH(load_file_data(o), Contains("nonfinite_y.npy: sample 1 is -inf"));
  o.allow_nonfinite = true;
  CHECK(std::isinf(load_file_data(o).train->y().to_vector<float>()[1]));

  // A CSV cell "nan" (from_chars reads it) and a test split file are named the same way.
  o = FileDataOptions{};
  o.train = {FileFormat::Csv, write_bytes("nonfinite.csv", "a,b,label\n1,2,0\n3,nan,1\n").string(), "", "x", "y", {}};
  CHECK_THROWS_WITH(load_file_data(o), Contains("nonfinite.csv (features): sample 1, element 1 (index [1, 1]) is nan"));
  o.train = {FileFormat::Npy, kDir + "blobs_x.npy", kDir + "blobs_y.npy", "x", "y", {}};
  write_npy(x, from_vector(std::vector<float>{1, 2, 3, 4, 5, 6, 7, NAN}, {2, 4}));
  write_npy(y, from_vector(std::vector<int64_t>{0, 1}, {2}));
  o.test = ArrayFiles{FileFormat::Npy, x.string(), y.string(), "x", "y", {}};
  CHECK_THROWS_WITH(load_file_data(o), Contains("nonfinite_x.npy: sample 1, element 3 (index [1, 3]) is nan"));

  // Through the config: the key is known, false by default, and true keeps the data.
  json c = npy_config();
  CHECK(config::resolve(c)["data"]["allow_nonfinite"] == false);
  c["data"]["test_fraction"] = 0.0;
  c["data"]["test_x"] = x.string();
  c["data"]["test_y"] = y.string();
  REQUIRE_THROWS_AS(config::resolve(c), DataError);
  CHECK_THROWS_WITH(config::resolve(c), Contains("nonfinite_x.npy: sample 1, element 3"));
  c["data"]["allow_nonfinite"] = true;
  CHECK(config::make_datasets(config::resolve(c)["data"], 0).test->size() == 2);
  c["data"]["allow_nonfinte"] = true;
  CHECK_THROWS_WITH(config::resolve(c), Contains("did you mean 'allow_nonfinite'"));
}
