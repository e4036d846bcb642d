// Checkpoint IO: the safetensors format (checked by an independent Python reader), sharded model files
// as Hugging Face lays them out, atomic commits that survive a crash, pruning, and clear errors for
// every file that is missing, truncated, corrupt or from another run.
#include <catch2/catch.hpp>

#include "skip.h"
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "booster/checkpoint/atomic_file.h"
#include "booster/checkpoint/checkpoint.h"
#include "booster/checkpoint/checksums.h"
#include "booster/checkpoint/safetensors.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"

using namespace booster;
using namespace booster::checkpoint;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// A fresh directory under /tmp, removed when the test ends (unless BOOSTER_KEEP_TEST_DIRS is set).
struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    path = fs::temp_directory_path() /
           ("booster_test_checkpoint_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    if (!std::getenv("BOOSTER_KEEP_TEST_DIRS")) {
      std::error_code ignored;
      fs::remove_all(path, ignored);
    }
  }
  fs::path operator/(const std::string& name) const { return path / name; }
};

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

// The header of a safetensors file, parsed here by hand (not by the library's reader).
json header_of(const std::string& bytes) {
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(bytes[size_t(i)])) << (8 * i);
  return json::parse(bytes.substr(8, n));
}
// Rewrites the header (keeping the data), for building corrupt files.
std::string with_header(const std::string& bytes, const json& header) {
  uint64_t old_n = 0;
  for (int i = 0; i < 8; ++i) old_n |= uint64_t(uint8_t(bytes[size_t(i)])) << (8 * i);
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char(uint64_t(text.size()) >> (8 * i));
  return out + text + bytes.substr(8 + old_n);
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  Tensor ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}

bool same_maps(const TensorMap& a, const TensorMap& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end() || !same_bytes(t, it->second)) return false;
  }
  return true;
}

// One tensor of every dtype, a 0-d one and an empty one, with values that survive each dtype exactly.
TensorMap every_dtype() {
  TensorMap m;
  m["f32"] = from_vector(std::vector<float>{1.5f, -2.25f, 0.1f, 3e38f, -0.0f, 7.0f}, {2, 3});
  m["f64"] = from_vector(std::vector<double>{0.1, -1e300, 2.5}, {3});
  m["f16"] = from_vector(std::vector<float>{0.5f, -65504.f, 6.1035156e-05f, 1.0f}, {2, 2}, DType::Float16);
  m["bf16"] = from_vector(std::vector<float>{1.0f, -3.0e38f, 0.0078125f}, {3, 1}, DType::BFloat16);
  m["i64"] = from_vector(std::vector<int64_t>{-9007199254740993LL, 0, 42}, {3});
  m["i32"] = from_vector(std::vector<int64_t>{-7, 2147483647}, {2}, DType::Int32);
  m["bool"] = from_vector(std::vector<int64_t>{1, 0, 0, 1}, {4}, DType::Bool);
  m["scalar"] = scalar_tensor(3.25, DType::Float32);
  m["empty"] = zeros({0, 4}, DType::Float32);
  return m;
}

// Runs a shell command, returning its exit status and stdout.
std::pair<int, std::string> run_command(const std::string& cmd) {
  std::string out;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) return {-1, out};
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  const int status = ::pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out};
}

// A Python interpreter with numpy, or "" (the test then skips with a warning). BOOSTER_PYTHON wins.
std::string python_with_numpy() {
  std::vector<std::string> candidates = {"python3", "/usr/bin/python3"};
  if (const char* p = std::getenv("BOOSTER_PYTHON")) candidates.insert(candidates.begin(), p);
  for (const auto& py : candidates)
    if (std::system((py + " -c 'import numpy' >/dev/null 2>&1").c_str()) == 0) return py;
  return "";
}

// The reader's output: name -> (dtype, shape text, values).
struct ReaderTensor {
  std::string dtype, shape;
  std::vector<double> values;
};
std::map<std::string, ReaderTensor> parse_reader_output(const std::string& out) {
  std::map<std::string, ReaderTensor> result;
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind("metadata ", 0) == 0) continue;
    std::istringstream fields(line);
    std::string name, sum, values;
    ReaderTensor t;
    fields >> name >> t.dtype >> t.shape >> sum >> values;
    REQUIRE(values.rfind("values=", 0) == 0);
    std::istringstream list(values.substr(7));
    std::string v;
    while (std::getline(list, v, ',')) t.values.push_back(std::stod(v));
    result[name] = t;
  }
  return result;
}

std::string shape_text(const Shape& s) {
  if (s.empty()) return "scalar";
  std::string out;
  for (int64_t d : s) {
    if (!out.empty()) out += ',';
    out += std::to_string(d);
  }
  return out;
}

// The path of this test executable, for re-running it as a child process.
std::string self_exe() { return fs::read_symlink("/proc/self/exe").string(); }

const json kTinyMlp = {{"type", "mlp"}, {"in", 6}, {"hidden", {8}}, {"classes", 3}};

}  // namespace

// ------------------------------------------------------------------------------------------ safetensors

TEST_CASE("safetensors: every dtype, 0-d and empty tensors round trip bit for bit", "[checkpoint]") {
  TempDir dir;
  const TensorMap tensors = every_dtype();
  write_safetensors(dir / "t.safetensors", tensors, {{"format", "pt"}, {"note", "héllo"}});
  SafetensorsFile back = read_safetensors(dir / "t.safetensors");
  CHECK(same_maps(tensors, back.tensors));
  CHECK(back.tensors.at("scalar").dim() == 0);
  CHECK(back.tensors.at("empty").shape() == Shape{0, 4});
  CHECK(back.metadata == Metadata{{"format", "pt"}, {"note", "héllo"}});
  // No temporary file is left beside it.
  CHECK(std::distance(fs::directory_iterator(dir.path), fs::directory_iterator()) == 1);

  // An empty map is a valid file too (a header of "{}" and no data).
  write_safetensors(dir / "empty.safetensors", {});
  CHECK(read_bytes(dir / "empty.safetensors").size() == 16);
  CHECK(read_safetensors(dir / "empty.safetensors").tensors.empty());
}

TEST_CASE("safetensors: the file is laid out as the format specifies", "[checkpoint]") {
  TempDir dir;
  const TensorMap tensors = every_dtype();
  write_safetensors(dir / "t.safetensors", tensors);
  const std::string bytes = read_bytes(dir / "t.safetensors");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(bytes[size_t(i)])) << (8 * i);
  CHECK(n % 8 == 0);  // the data starts 8-byte aligned
  CHECK(bytes[8] == '{');
  const json header = header_of(bytes);
  CHECK_FALSE(header.contains("__metadata__"));  // none given, none written
  // Offsets are contiguous in name order and each span holds the tensor's raw little-endian bytes.
  uint64_t expected = 0;
  for (const auto& [name, t] : tensors) {
    const json& e = header.at(name);
    CHECK(e.at("shape").get<Shape>() == t.shape());
    CHECK(e.at("data_offsets")[0].get<uint64_t>() == expected);
    expected += t.nbytes();
    CHECK(e.at("data_offsets")[1].get<uint64_t>() == expected);
    CHECK(std::memcmp(bytes.data() + 8 + n + e.at("data_offsets")[0].get<uint64_t>(), t.data_ptr(), t.nbytes()) == 0);
  }
  CHECK(bytes.size() == 8 + n + expected);
  CHECK(header.at("f32").at("dtype") == "F32");
  CHECK(header.at("f64").at("dtype") == "F64");
  CHECK(header.at("f16").at("dtype") == "F16");
  CHECK(header.at("bf16").at("dtype") == "BF16");
  CHECK(header.at("i64").at("dtype") == "I64");
  CHECK(header.at("i32").at("dtype") == "I32");
  CHECK(header.at("bool").at("dtype") == "BOOL");
  CHECK(header.at("scalar").at("shape") == json::array());
}

TEST_CASE("safetensors: non-contiguous tensors are saved by value", "[checkpoint]") {
  TempDir dir;
  Tensor base = arange(0.0, 24.0, 1.0, DType::Float32).reshape({4, 6});
  TensorMap views = {{"transposed", base.t()},
                     {"strided", base.slice(1, 1, 6, 2)},
                     {"expanded", base.select(0, 2).unsqueeze(0).expand({3, 6})},
                     {"offset", base.narrow(0, 2, 2)}};
  write_safetensors(dir / "v.safetensors", views);
  SafetensorsFile back = read_safetensors(dir / "v.safetensors");
  for (const auto& [name, view] : views) {
    INFO(name);
    CHECK(back.tensors.at(name).shape() == view.shape());
    CHECK(back.tensors.at(name).tolist() == view.tolist());
  }
}

TEST_CASE("safetensors: invalid names and undefined tensors are refused", "[checkpoint]") {
  TempDir dir;
  REQUIRE_THROWS_WITH(write_safetensors(dir / "a.safetensors", {{"__metadata__", zeros({1})}}),
                      Catch::Contains("invalid tensor name '__metadata__'"));
  REQUIRE_THROWS_WITH(write_safetensors(dir / "a.safetensors", {{"w", Tensor()}}),
                      Catch::Contains("tensor 'w' is undefined"));
  REQUIRE_THROWS_AS(write_safetensors(dir / "a.safetensors", {{std::string("bad\xff"), zeros({1})}}),
                    CheckpointError);
  CHECK_FALSE(fs::exists(dir / "a.safetensors"));
}

TEST_CASE("safetensors: each kind of corruption is a CheckpointError naming the file and the problem",
          "[checkpoint]") {
  TempDir dir;
  const fs::path good = dir / "good.safetensors";
  write_safetensors(good, {{"a", from_vector(std::vector<float>{1, 2, 3, 4}, {2, 2})},
                           {"b", from_vector(std::vector<int64_t>{1, 0}, {2}, DType::Bool)}});
  const std::string bytes = read_bytes(good);
  const json header = header_of(bytes);
  const fs::path bad = dir / "bad.safetensors";

  auto expect_error = [&](const std::string& content, const std::string& phrase) {
    write_bytes(bad, content);
    INFO(phrase);
    REQUIRE_THROWS_AS(read_safetensors(bad), CheckpointError);
    REQUIRE_THROWS_WITH(read_safetensors(bad), Catch::Contains(bad.string()) && Catch::Contains(phrase));
  };
  expect_error("", "fewer than the 8");
  expect_error(std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + bytes.substr(8), "exceeds the limit");
  expect_error(bytes.substr(0, 8) + "{", "passes the end of the file");
  {
    std::string s = bytes;
    s[8] = '[';
    expect_error(s, "not valid JSON");
  }
  json h = header;
  h["a"]["dtype"] = "U8";
  expect_error(with_header(bytes, h), "dtype 'U8', which booster does not support");
  h = header;
  h["a"]["shape"] = {3, 2};
  expect_error(with_header(bytes, h), "tensor 'a' has shape [3, 2]");
  h = header;
  h["a"]["shape"] = {-2, -2};
  expect_error(with_header(bytes, h), "not a non-negative integer");
  h = header;
  h["a"]["shape"] = {uint64_t(1) << 62, 8};
  expect_error(with_header(bytes, h), "overflowing");
  h = header;
  h["b"]["data_offsets"] = {8, 10};  // inside a's span [0, 16)
  expect_error(with_header(bytes, h), "overlaps");
  h = header;
  h["a"]["extra"] = 1;
  expect_error(with_header(bytes, h), "unknown field 'extra'");
  h = header;
  h["__metadata__"] = {{"k", 1}};
  expect_error(with_header(bytes, h), "__metadata__ value of 'k' is not a string");
  expect_error(bytes + "junk", "4 bytes of trailing data");
  expect_error(bytes.substr(0, bytes.size() - 1), "truncated");
  {
    std::string s = bytes;
    s[s.size() - 1] = 2;  // b's last element
    expect_error(s, "BOOL tensor 'b' holds the byte 2");
  }
  h = header;
  h.erase("a");  // b now starts at 16 with nothing before it
  expect_error(with_header(bytes, h), "gap of unused bytes [0, 16)");
  REQUIRE_THROWS_WITH(read_safetensors(dir / "missing.safetensors"),
                      Catch::Contains("cannot open") && Catch::Contains("missing.safetensors"));
}

TEST_CASE("safetensors: truncations and random header corruption throw CheckpointError, never crash",
          "[checkpoint]") {
  TempDir dir;
  const fs::path good = dir / "good.safetensors";
  write_safetensors(good, every_dtype(), {{"format", "pt"}});
  const std::string bytes = read_bytes(good);
  const fs::path bad = dir / "bad.safetensors";
  int truncations = 0;
  for (size_t len = 0; len < bytes.size(); len += 97) {
    write_bytes(bad, bytes.substr(0, len));
    INFO("truncated to " << len << " of " << bytes.size() << " bytes");
    REQUIRE_THROWS_AS(read_safetensors(bad), CheckpointError);
    ++truncations;
  }
  CHECK(truncations > 3);

  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(bytes[size_t(i)])) << (8 * i);
  std::mt19937_64 rng(1234);
  int thrown = 0, flips = 400;
  for (int i = 0; i < flips; ++i) {
    std::string s = bytes;
    const size_t at = size_t(rng() % (8 + n));
    const char old = s[at];
    while (s[at] == old) s[at] = char(rng() & 0xff);
    write_bytes(bad, s);
    // Some flips leave a valid file (a letter of a name); every other one must be a CheckpointError.
    try {
      read_safetensors(bad);
    } catch (const CheckpointError&) {
      ++thrown;
    }
  }
  CHECK(thrown > flips / 2);
  for (int byte = 0; byte < 8; ++byte) {
    std::string s = bytes;
    s[size_t(byte)] = char(s[size_t(byte)] ^ 0x40);
    write_bytes(bad, s);
    INFO("length byte " << byte);
    REQUIRE_THROWS_AS(read_safetensors(bad), CheckpointError);
  }
}

TEST_CASE("safetensors: an independent reader (Python json + numpy) reads what booster writes",
          "[checkpoint]") {
  const std::string python = python_with_numpy();
  if (python.empty()) {
    skip_test("no python3 with numpy (apt-get install python3-numpy) to run tests/safetensors_reader.py");
    return;
  }
  TempDir dir;
  const TensorMap tensors = every_dtype();
  write_safetensors(dir / "t.safetensors", tensors, {{"format", "pt"}});
  const std::string cmd = python + " " + BOOSTER_SOURCE_DIR "/tests/safetensors_reader.py " +
                          (dir / "t.safetensors").string();
  auto [status, out] = run_command(cmd);
  INFO(cmd << "\n" << out);
  REQUIRE(status == 0);
  CHECK(out.find("metadata format=pt") != std::string::npos);
  const auto seen = parse_reader_output(out);
  REQUIRE(seen.size() == tensors.size());
  const std::map<std::string, std::string> dtype_names = {{"f32", "F32"},  {"f64", "F64"}, {"f16", "F16"},
                                                          {"bf16", "BF16"}, {"i64", "I64"}, {"i32", "I32"},
                                                          {"bool", "BOOL"}, {"scalar", "F32"}, {"empty", "F32"}};
  for (const auto& [name, t] : tensors) {
    INFO(name);
    const ReaderTensor& r = seen.at(name);
    CHECK(r.dtype == dtype_names.at(name));
    CHECK(r.shape == shape_text(t.shape()));
    if (t.dtype() == DType::Int64) {  // beyond 2^53: compare as integers
      auto expected = t.to_vector<int64_t>();
      std::istringstream line(out.substr(out.find(name + " I64")));
      std::string a, b, c, d, values;
      line >> a >> b >> c >> d >> values;
      std::vector<int64_t> got;
      std::istringstream list(values.substr(7));
      std::string v;
      while (std::getline(list, v, ',')) got.push_back(std::stoll(v));
      CHECK(got == expected);
    } else {
      CHECK(r.values == t.tolist());
    }
  }

  // The reader's own checks are live: it refuses a file with trailing garbage.
  write_bytes(dir / "bad.safetensors", read_bytes(dir / "t.safetensors") + "x");
  auto [bad_status, bad_out] = run_command(python + " " + BOOSTER_SOURCE_DIR "/tests/safetensors_reader.py " +
                                           (dir / "bad.safetensors").string() + " 2>/dev/null");
  CHECK(bad_status == 1);
}

// ------------------------------------------------------------------------------------------ models

TEST_CASE("save_model: shards plus model.safetensors.index.json as Hugging Face, loading equal to one file",
          "[checkpoint]") {
  TempDir dir;
  nn::StateDict sd = nn::make_model({{"type", "mlp"}, {"in", 20}, {"hidden", {16, 12}}, {"classes", 5}}, 3)
                         ->state_dict();
  // Bytes: layers.0.weight 1280, .bias 64, layers.2.weight 768, .bias 48, layers.4.weight 240, .bias 20.
  save_model(dir / "single", sd);
  save_model(dir / "sharded", sd, /*max_shard_bytes=*/1000);
  CHECK(fs::exists(dir / "single" / "model.safetensors"));
  CHECK_FALSE(fs::exists(dir / "single" / "model.safetensors.index.json"));
  CHECK_FALSE(fs::exists(dir / "sharded" / "model.safetensors"));

  // Greedy in name order: [0.bias], then 0.weight alone (it exceeds the limit by itself), then
  // [2.bias, 2.weight, 4.bias] (48 + 768 + 20 = 836 <= 1000), and 4.weight (240) overflows into a fourth.
  const json index = json::parse(read_bytes(dir / "sharded" / "model.safetensors.index.json"));
  CHECK(index.at("metadata").at("total_size") == 1280 + 64 + 768 + 48 + 240 + 20);
  const json expected_map = {{"layers.0.bias", "model-00001-of-00004.safetensors"},
                             {"layers.0.weight", "model-00002-of-00004.safetensors"},
                             {"layers.2.bias", "model-00003-of-00004.safetensors"},
                             {"layers.2.weight", "model-00003-of-00004.safetensors"},
                             {"layers.4.bias", "model-00003-of-00004.safetensors"},
                             {"layers.4.weight", "model-00004-of-00004.safetensors"}};
  CHECK(index.at("weight_map") == expected_map);
  for (int i = 1; i <= 4; ++i) {
    const fs::path shard = dir / "sharded" / ("model-0000" + std::to_string(i) + "-of-00004.safetensors");
    REQUIRE(fs::exists(shard));
    CHECK(read_safetensors(shard).metadata.at("format") == "pt");
  }

  CHECK(same_maps(load_model(dir / "single"), load_model(dir / "sharded")));
  CHECK(same_maps(load_model(dir / "sharded" / "model.safetensors.index.json"), sd));
  CHECK(same_maps(load_model(dir / "single" / "model.safetensors"), sd));

  const std::string python = python_with_numpy();
  if (!python.empty()) {
    auto [status, out] = run_command(python + " " + BOOSTER_SOURCE_DIR "/tests/safetensors_reader.py " +
                                     (dir / "sharded").string());
    INFO(out);
    CHECK(status == 0);
    CHECK(out.find("metadata shards=4") != std::string::npos);
    CHECK(parse_reader_output(out).size() == sd.size());
  } else {
    skip_test("the independent reader's half: no python3 with numpy (apt-get install python3-numpy)");
  }

  // Saving the other layout into the same directory removes the stale files of the first.
  save_model(dir / "sharded", sd);
  CHECK(fs::exists(dir / "sharded" / "model.safetensors"));
  CHECK_FALSE(fs::exists(dir / "sharded" / "model.safetensors.index.json"));
  CHECK_FALSE(fs::exists(dir / "sharded" / "model-00001-of-00004.safetensors"));
  save_model(dir / "single", sd, 1000);
  CHECK_FALSE(fs::exists(dir / "single" / "model.safetensors"));
  CHECK(same_maps(load_model(dir / "single"), sd));
}

TEST_CASE("load_model: a missing, foreign or mis-indexed shard is named", "[checkpoint]") {
  TempDir dir;
  nn::StateDict sd = nn::make_model(kTinyMlp, 1)->state_dict();
  save_model(dir / "m", sd, 40);
  const fs::path index = dir / "m" / "model.safetensors.index.json";
  const json original = json::parse(read_bytes(index));
  const std::string shard = original.at("weight_map").at("layers.0.weight");

  json moved = original;
  moved["weight_map"]["layers.0.weight"] = original.at("weight_map").at("layers.2.weight");
  write_bytes(index, moved.dump());
  REQUIRE_THROWS_WITH(load_model(dir / "m"), Catch::Contains("'layers.0.weight' is missing from shard"));

  write_bytes(index, original.dump());
  const std::string first_shard = original.at("weight_map").at("layers.0.bias");
  const std::string last_shard = original.at("weight_map").at("layers.2.weight");
  const std::string last_bytes = read_bytes(dir / "m" / last_shard);
  fs::copy_file(dir / "m" / first_shard, dir / "m" / last_shard, fs::copy_options::overwrite_existing);
  REQUIRE_THROWS_WITH(load_model(dir / "m"), Catch::Contains("holds tensor 'layers.0.bias', which the weight_map"));
  write_bytes(dir / "m" / last_shard, last_bytes);

  json escaping = original;
  escaping["weight_map"]["layers.0.weight"] = "../other.safetensors";
  write_bytes(index, escaping.dump());
  REQUIRE_THROWS_WITH(load_model(dir / "m"), Catch::Contains("not a file name in the index's directory"));

  json wrong_total = original;
  wrong_total["metadata"]["total_size"] = 1;
  write_bytes(index, wrong_total.dump());
  REQUIRE_THROWS_WITH(load_model(dir / "m"), Catch::Contains("total_size is 1"));

  write_bytes(index, original.dump());
  fs::remove(dir / "m" / shard);
  REQUIRE_THROWS_WITH(load_model(dir / "m"), Catch::Contains(shard) && Catch::Contains("is missing"));
  REQUIRE_THROWS_WITH(load_model(dir.path), Catch::Contains("holds neither model.safetensors nor"));
}

// ------------------------------------------------------------------------------------------ checkpoints

namespace {

// A small training state with every piece filled in, after one real optimizer step.
struct Run {
  nn::ModulePtr model = nn::make_model(kTinyMlp, 7);
  std::unique_ptr<optim::AdamW> optimizer =
      std::make_unique<optim::AdamW>(model->parameters(), json{{"lr", 0.01}});
  Generator gen{99};

  Run() { train_step(); }
  void train_step() {
    optimizer->zero_grad();
    Tensor x = randn({4, 6}, &gen);
    sum((*model)(x)).backward();
    optimizer->step();
  }
  TrainingState state(int64_t step) const {
    TrainingState s;
    s.step = step;
    s.model = model->state_dict();
    s.optimizer = optimizer->state_dict();
    s.scheduler = {{"last_epoch", step}, {"base_lrs", {0.01}}};
    s.dataloader = {{"epoch", 1}, {"batches_consumed", step}, {"seed", 5}};
    s.rng["default"] = gen.state();
    s.extra = {{"strategy", "fp16_o1"}, {"scaler", {{"scale", 65536.0}, {"growth_tracker", 3}}},
               {"model_config", kTinyMlp}};
    return s;
  }
};

}  // namespace

TEST_CASE("checkpoint: every piece of the training state round trips", "[checkpoint]") {
  TempDir dir;
  Run run;
  const TrainingState saved = run.state(12);
  const fs::path committed = save_checkpoint(dir.path, saved);
  CHECK(committed == dir / "step-00000012");
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "trainer_state.json"})
    CHECK(fs::exists(committed / f));
  CHECK(read_bytes(dir / "latest") == "step-00000012\n");

  const TrainingState loaded = load_checkpoint(dir.path, {.expect_extra = {{"strategy", "fp16_o1"}}});
  CHECK(loaded.step == 12);
  CHECK(same_maps(loaded.model, saved.model));
  CHECK(loaded.optimizer.meta == saved.optimizer.meta);
  CHECK(same_maps(loaded.optimizer.tensors, saved.optimizer.tensors));
  CHECK_FALSE(loaded.optimizer.tensors.empty());
  CHECK(loaded.scheduler == saved.scheduler);
  CHECK(loaded.dataloader == saved.dataloader);
  CHECK(loaded.rng == saved.rng);  // uint64 words exactly, beyond 2^53
  CHECK(loaded.extra == saved.extra);

  // The state restores into a fresh optimizer and generator that then continue identically.
  Run resumed;
  resumed.gen.manual_seed(12345);  // so that only set_state can bring it back in step
  resumed.model->load_state_dict(loaded.model);
  resumed.optimizer->load_state_dict(loaded.optimizer);
  resumed.gen.set_state(loaded.rng.at("default"));
  CHECK(resumed.gen.next_u64() == Generator(run.gen).next_u64());

  // A checkpoint without optimizer writes no optimizer file and loads an empty one.
  TrainingState bare;
  bare.step = 13;
  bare.model = saved.model;
  save_checkpoint(dir.path, bare);
  CHECK_FALSE(fs::exists(dir / "step-00000013" / "optimizer.safetensors"));
  const TrainingState bare_loaded = load_checkpoint(dir / "step-00000013");
  CHECK(bare_loaded.optimizer.meta.is_null());
  CHECK(bare_loaded.optimizer.tensors.empty());
}

TEST_CASE("checkpoint: a model loaded into a fresh model gives the same outputs", "[checkpoint]") {
  TempDir dir;
  nn::ModulePtr trained = nn::make_model(kTinyMlp, 1);
  nn::ModulePtr fresh = nn::make_model(kTinyMlp, 2);
  Generator gen(5);
  Tensor x = randn({3, 6}, &gen);
  REQUIRE((*trained)(x).tolist() != (*fresh)(x).tolist());  // else the test proves nothing

  TrainingState state;
  state.step = 1;
  state.model = trained->state_dict();
  save_checkpoint(dir.path, state, {.max_shard_bytes = 64});  // sharded, to cover that path too
  REQUIRE(fs::exists(dir / "step-00000001" / "model.safetensors.index.json"));
  fresh->load_state_dict(load_checkpoint(dir.path).model);
  CHECK((*trained)(x).tolist() == (*fresh)(x).tolist());
}

TEST_CASE("checkpoint: loading into a model of another shape names the mismatched key", "[checkpoint]") {
  TempDir dir;
  TrainingState state;
  state.model = nn::make_model(kTinyMlp, 1)->state_dict();
  save_checkpoint(dir.path, state);
  nn::ModulePtr wider = nn::make_model({{"type", "mlp"}, {"in", 6}, {"hidden", {9}}, {"classes", 3}}, 1);
  REQUIRE_THROWS_AS(wider->load_state_dict(load_checkpoint(dir.path).model), CheckpointError);
  REQUIRE_THROWS_WITH(wider->load_state_dict(load_checkpoint(dir.path).model),
                      Catch::Contains("layers.0.weight (checkpoint [8, 6], model [9, 6])"));
}

TEST_CASE("checkpoint: keep_last prunes only committed checkpoints and never the newest", "[checkpoint]") {
  TempDir dir;
  Run run;
  for (int64_t step = 1; step <= 5; ++step) save_checkpoint(dir.path, run.state(step * 10), {.keep_last = 2});
  auto steps = [&] {
    std::vector<int64_t> out;
    for (const auto& [step, path] : list_checkpoints(dir.path)) out.push_back(step);
    return out;
  };
  CHECK(steps() == std::vector<int64_t>{40, 50});
  CHECK(load_checkpoint(dir.path).step == 50);

  // A crashed save's directory is not a checkpoint: it neither counts against keep_last nor loads.
  fs::create_directory(dir / "step-00000060.tmp");
  CHECK(steps() == std::vector<int64_t>{40, 50});
  CHECK(load_checkpoint(dir.path).step == 50);

  // Saving an older step (a rewind) keeps it even though it sorts first; latest names it.
  save_checkpoint(dir.path, run.state(45), {.keep_last = 2});
  CHECK(steps() == std::vector<int64_t>{45, 50});
  CHECK(load_checkpoint(dir.path).step == 45);
  CHECK_FALSE(fs::exists(dir / "step-00000060.tmp"));  // leftovers are cleared by the next save

  // Re-saving an existing step replaces it; keep_last = 1 leaves exactly the new one.
  save_checkpoint(dir.path, run.state(50), {.keep_last = 1});
  CHECK(steps() == std::vector<int64_t>{50});
  CHECK(load_checkpoint(dir.path).step == 50);
  CHECK(std::distance(fs::directory_iterator(dir.path), fs::directory_iterator()) == 2);  // step + latest
}

// Run only as a child process by the crash test below (hidden: "[.]").
TEST_CASE("checkpoint crash child: save with the abort hook", "[.][checkpoint_crash_child]") {
  const char* root = std::getenv("BOOSTER_TEST_CHECKPOINT_ROOT");
  REQUIRE(root != nullptr);
  Run run;
  save_checkpoint(root, run.state(2), {.keep_last = 1});
  FAIL("save_checkpoint returned although BOOSTER_TEST_CRASH_AT=before_commit");
}

TEST_CASE("checkpoint: a save killed before its commit leaves the previous checkpoint loadable", "[checkpoint]") {
  TempDir dir;
  Run run;
  const TrainingState first = run.state(1);
  save_checkpoint(dir.path, first, {.keep_last = 1});

  const std::string cmd = "ulimit -c 0; BOOSTER_TEST_CRASH_AT=before_commit BOOSTER_TEST_CHECKPOINT_ROOT='" +
                          dir.path.string() + "' '" + self_exe() +
                          "' 'checkpoint crash child: save with the abort hook' >/dev/null 2>&1";
  const int status = std::system(cmd.c_str());
  INFO(cmd);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 128 + SIGABRT);  // the shell reports the child's SIGABRT

  // The child wrote its files (the crash came after them) but committed nothing.
  CHECK(fs::exists(dir / "step-00000002.tmp" / "trainer_state.json"));
  CHECK_FALSE(fs::exists(dir / "step-00000002"));
  CHECK(read_bytes(dir / "latest") == "step-00000001\n");
  REQUIRE(list_checkpoints(dir.path).size() == 1);
  const TrainingState loaded = load_checkpoint(dir.path);
  CHECK(loaded.step == 1);
  CHECK(same_maps(loaded.model, first.model));

  // The next save succeeds, clears the leftover and prunes the old checkpoint only after committing.
  save_checkpoint(dir.path, run.state(2), {.keep_last = 1});
  CHECK_FALSE(fs::exists(dir / "step-00000002.tmp"));
  CHECK_FALSE(fs::exists(dir / "step-00000001"));
  CHECK(load_checkpoint(dir.path).step == 2);
}

// Run only as a child process by the replace test below (hidden: "[.]"): replaces step 5 with a state
// trained one step further than Run's.
TEST_CASE("checkpoint crash child: replace step 5", "[.][checkpoint_crash_child]") {
  const char* root = std::getenv("BOOSTER_TEST_CHECKPOINT_ROOT");
  REQUIRE(root != nullptr);
  Run further;
  further.train_step();
  save_checkpoint(root, further.state(5), {.keep_last = 1});
  FAIL("save_checkpoint returned although BOOSTER_TEST_CRASH_AT was set");
}

TEST_CASE("checkpoint: a replace of a step killed at any point leaves latest naming a whole checkpoint",
          "[checkpoint]") {
  // Note [Replacing a checkpoint]: both ways of replacing, killed at each of their points.
  struct Case {
    const char* point;
    bool rename_exchange;
    bool new_one_committed;  // the crash came after the commit
  };
  for (const Case& c : {Case{"before_commit", true, false}, Case{"before_old_removed", true, true},
                        Case{"before_prune", true, true}, Case{"before_commit", false, false},
                        Case{"between_renames", false, false}, Case{"before_old_removed", false, true},
                        Case{"before_prune", false, true}}) {
    INFO(c.point << (c.rename_exchange ? " with RENAME_EXCHANGE" : " with the portable replace"));
    TempDir dir;
    const Run old_run;
    Run further;
    further.train_step();
    REQUIRE_FALSE(same_maps(old_run.state(5).model, further.state(5).model));  // else nothing is shown
    save_checkpoint(dir.path, old_run.state(4));
    save_checkpoint(dir.path, old_run.state(5));

    const std::string cmd = std::string("ulimit -c 0; BOOSTER_TEST_CRASH_AT=") + c.point +
                            (c.rename_exchange ? "" : " BOOSTER_TEST_NO_RENAME_EXCHANGE=1") +
                            " BOOSTER_TEST_CHECKPOINT_ROOT='" + dir.path.string() + "' '" + self_exe() +
                            "' 'checkpoint crash child: replace step 5' >/dev/null 2>&1";
    const int status = std::system(cmd.c_str());
    REQUIRE(WIFEXITED(status));
    REQUIRE(WEXITSTATUS(status) == 128 + SIGABRT);

    // The way of replacing asked for was the one taken: the old copy lies under its name.
    if (std::string(c.point) == "before_old_removed") {
      CHECK(fs::is_directory(dir / (c.rename_exchange ? "step-00000005.tmp" : "step-00000005.replaced")));
      CHECK_FALSE(fs::exists(dir / (c.rename_exchange ? "step-00000005.replaced" : "step-00000005.tmp")));
    }
    // `latest` leads to a whole step 5: the old one up to the commit, the new one after it.
    const TrainingState& expected = (c.new_one_committed ? further : old_run).state(5);
    const TrainingState loaded = load_checkpoint(dir.path);
    CHECK(loaded.step == 5);
    // Named explicitly, step 5 reads the same (from its stand-in while only step-00000005.replaced/ exists).
    CHECK(same_maps(load_checkpoint(dir / "step-00000005").model, expected.model));
    CHECK(same_maps(loaded.model, expected.model));
    CHECK(same_maps(loaded.optimizer.tensors, expected.optimizer.tensors));
    std::vector<int64_t> steps;
    for (const auto& [step, path] : list_checkpoints(dir.path)) steps.push_back(step);
    CHECK(steps == std::vector<int64_t>{4, 5});  // the child's keep_last 1 had not pruned yet

    // The next save puts everything in order: no leftover, step 5 as loaded above.
    save_checkpoint(dir.path, further.state(6), {.keep_last = 2});
    CHECK(same_maps(load_checkpoint(dir / "step-00000005").model, expected.model));
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir.path)) names.push_back(entry.path().filename().string());
    std::sort(names.begin(), names.end());
    CHECK(names == std::vector<std::string>{"latest", "step-00000005", "step-00000006"});
  }
}

TEST_CASE("checkpoint: removals after the commit that fail are warnings, and latest follows the commit at once",
          "[checkpoint]") {
  // Note [Cleanup after the commit]: as with NFS's .nfsXXXX files, every removal after the commit fails.
  for (const bool rename_exchange : {true, false}) {
    INFO((rename_exchange ? "with RENAME_EXCHANGE" : "with the portable replace"));
    TempDir dir;
    const Run old_run;
    Run further;
    further.train_step();
    save_checkpoint(dir.path, old_run.state(4));
    save_checkpoint(dir.path, old_run.state(5));
    save_checkpoint(dir.path, old_run.state(6));
    REQUIRE(read_bytes(dir / "latest") == "step-00000006\n");

    // A rewind: step 5 again, replacing the saved one; keep_last 2 prunes step 4.
    REQUIRE(::setenv("BOOSTER_TEST_CLEANUP_FAILS", "1", 1) == 0);
    if (!rename_exchange) REQUIRE(::setenv("BOOSTER_TEST_NO_RENAME_EXCHANGE", "1", 1) == 0);
    CHECK_NOTHROW(save_checkpoint(dir.path, further.state(5), {.keep_last = 2}));
    REQUIRE(::unsetenv("BOOSTER_TEST_CLEANUP_FAILS") == 0);
    REQUIRE(::unsetenv("BOOSTER_TEST_NO_RENAME_EXCHANGE") == 0);
    CHECK(read_bytes(dir / "latest") == "step-00000005\n");
    CHECK(same_maps(load_checkpoint(dir.path).model, further.state(5).model));
    // What could not be removed lies under names that are not checkpoints: the replaced copy (under the
    // name its way of replacing gives it), and step 4, pruned by a rename before its removal.
    auto names = [&] {
      std::vector<std::string> out;
      for (const auto& entry : fs::directory_iterator(dir.path)) out.push_back(entry.path().filename().string());
      std::sort(out.begin(), out.end());
      return out;
    };
    CHECK(names() == std::vector<std::string>{"latest", "step-00000004.tmp", "step-00000005",
                                              rename_exchange ? "step-00000005.tmp" : "step-00000005.replaced",
                                              "step-00000006"});
    std::vector<int64_t> steps;
    for (const auto& [step, path] : list_checkpoints(dir.path)) steps.push_back(step);
    CHECK(steps == std::vector<int64_t>{5, 6});

    // The next save clears them.
    save_checkpoint(dir.path, further.state(7), {.keep_last = 2});
    CHECK(names() == std::vector<std::string>{"latest", "step-00000006", "step-00000007"});
  }
}

TEST_CASE("checkpoint: a root is locked by one holder at a time, and free again when it is gone", "[checkpoint]") {
  TempDir dir;
  {
    RootLock held(dir / "root");
    CHECK(fs::is_directory(dir / "root"));
    char host[256] = {};
    REQUIRE(::gethostname(host, sizeof host - 1) == 0);
    REQUIRE_THROWS_WITH(RootLock(dir / "root"),
                        Catch::Contains("is in use by another process (" + std::string(host) + ":" +
                                        std::to_string(::getpid()) + ", host:pid per ") &&
                            Catch::Contains("give this run its own checkpoint directory"));
    // So is another process.
    const std::string cmd = "flock --nonblock '" + (dir / "root" / "lock").string() + "' true";
    CHECK(std::system(cmd.c_str()) != 0);
  }
  RootLock again(dir / "root");  // released with its holder
}

TEST_CASE("checkpoint: a root on a file system that cannot flock is used unlocked, other lock errors throw",
          "[checkpoint]") {
  // Note [Locking a checkpoint root]: Lustre noflock (ENOSYS), NFSv3 without lockd (ENOLCK), FUSE.
  TempDir dir;
  const RootLock held(dir / "root");
  for (const int unsupported : {ENOSYS, ENOLCK, EOPNOTSUPP, EINVAL}) {
    INFO(std::strerror(unsupported));
    REQUIRE(::setenv("BOOSTER_TEST_FLOCK_ERRNO", std::to_string(unsupported).c_str(), 1) == 0);
    CHECK_NOTHROW(RootLock(dir / "root"));
  }
  REQUIRE(::setenv("BOOSTER_TEST_FLOCK_ERRNO", std::to_string(EIO).c_str(), 1) == 0);
  CHECK_THROWS_WITH(RootLock(dir / "root"), Catch::Contains("cannot lock ") && Catch::Contains(std::strerror(EIO)));
  REQUIRE(::unsetenv("BOOSTER_TEST_FLOCK_ERRNO") == 0);
  CHECK_THROWS_WITH(RootLock(dir / "root"), Catch::Contains("is in use by another process"));
}

TEST_CASE("checkpoint: missing files, corrupt files, another version or strategy are named", "[checkpoint]") {
  TempDir dir;
  Run run;
  const fs::path ckpt = save_checkpoint(dir.path, run.state(3));

  REQUIRE_THROWS_WITH(load_checkpoint(dir.path, {.expect_extra = {{"strategy", "bf16"}}}),
                      Catch::Contains("was saved with strategy = \"fp16_o1\" but this run uses strategy = \"bf16\""));
  REQUIRE_THROWS_WITH(load_checkpoint(dir.path, {.expect_extra = {{"plugin", "ddp"}}}),
                      Catch::Contains("does not record \"plugin\""));

  SECTION("optimizer file missing") {
    fs::remove(ckpt / "optimizer.safetensors");
    REQUIRE_THROWS_WITH(load_checkpoint(dir.path), Catch::Contains("optimizer.safetensors is missing"));
  }
  // The checksums catch each damage below first (Note [Checkpoint checksums]); unverified, the
  // structural checks behind them still name it.
  const LoadOptions unverified{.verify = false};
  SECTION("model file missing") {
    fs::remove(ckpt / "model.safetensors");
    REQUIRE_THROWS_WITH(load_checkpoint(dir.path), Catch::Contains("model.safetensors is missing"));
    REQUIRE_THROWS_WITH(load_checkpoint(dir.path, unverified), Catch::Contains("holds neither model.safetensors"));
  }
  SECTION("model file truncated") {
    const std::string bytes = read_bytes(ckpt / "model.safetensors");
    write_bytes(ckpt / "model.safetensors", bytes.substr(0, bytes.size() / 2));
    REQUIRE_THROWS_WITH(load_checkpoint(dir.path), Catch::Contains("model.safetensors has ") &&
                                                       Catch::Contains(" bytes, not the ") && Catch::Contains("--no-verify"));
    REQUIRE_THROWS_WITH(load_checkpoint(dir.path, unverified),
                        Catch::Contains("model.safetensors") && Catch::Contains("truncated"));
  }
  SECTION("another format version") {
    json state = json::parse(read_bytes(ckpt / "trainer_state.json"));
    state["version"] = 99;
    write_bytes(ckpt / "trainer_state.json", state.dump());
    REQUIRE_THROWS_WITH(load_checkpoint(dir.path), Catch::Contains("trainer_state.json has "));
    REQUIRE_THROWS_WITH(load_checkpoint(dir.path, unverified),
                        Catch::Contains("format version 99; this build reads versions 1 to 2"));
  }
  SECTION("trainer_state.json corrupt or missing") {
    write_bytes(ckpt / "trainer_state.json", "{\"format\": ");
    REQUIRE_THROWS_WITH(load_checkpoint(ckpt, unverified), Catch::Contains("trainer_state.json: not valid JSON"));
    fs::remove(ckpt / "trainer_state.json");
    REQUIRE_THROWS_WITH(load_checkpoint(ckpt), Catch::Contains("trainer_state.json"));
    REQUIRE_THROWS_WITH(load_checkpoint(ckpt, unverified), Catch::Contains("trainer_state.json"));
  }
  SECTION("a flipped bit in a tensor, and a checkpoint without checksums") {
    std::string bytes = read_bytes(ckpt / "model.safetensors");
    bytes[bytes.size() - 3] ^= 0x01;  // inside the last tensor's data (names sort; offsets follow)
    write_bytes(ckpt / "model.safetensors", bytes);
    REQUIRE_THROWS_WITH(load_checkpoint(dir.path), Catch::Contains("model.safetensors fails the checksum of tensor '"));
    CHECK_NOTHROW(load_checkpoint(dir.path, unverified));
    fs::remove(ckpt / "checksums.json");
    REQUIRE_THROWS_WITH(load_checkpoint(dir.path), Catch::Contains("has no checksums.json"));
    // A version 1 checkpoint (before checksums) loads unverified.
    json state = json::parse(read_bytes(ckpt / "trainer_state.json"));
    state["version"] = 1;
    write_bytes(ckpt / "trainer_state.json", state.dump());
    CHECK_NOTHROW(load_checkpoint(dir.path));
  }
  SECTION("latest names a checkpoint that is gone") {
    fs::remove_all(ckpt);
    REQUIRE_THROWS_WITH(load_checkpoint(dir.path), Catch::Contains("names step-00000003, which does not exist"));
  }
  SECTION("an empty directory") {
    TempDir empty;
    REQUIRE_THROWS_WITH(load_checkpoint(empty.path), Catch::Contains("no checkpoint in"));
  }
}

TEST_CASE("atomic writes: a failed write leaves the old file and no temporary", "[checkpoint]") {
  TempDir dir;
  write_text_file_atomically(dir / "f.txt", "old");
  REQUIRE_THROWS_AS(write_file_atomically(dir / "f.txt",
                                          [](FileWriter& out) {
                                            out.write("partial new content");
                                            throw CheckpointError("simulated failure while writing");
                                          }),
                    CheckpointError);
  CHECK(read_bytes(dir / "f.txt") == "old");
  CHECK(std::distance(fs::directory_iterator(dir.path), fs::directory_iterator()) == 1);
  REQUIRE_THROWS_WITH(write_text_file_atomically(dir / "no" / "such" / "dir.txt", "x"),
                      Catch::Contains("cannot create") && Catch::Contains("dir.txt.tmp-"));
}

TEST_CASE("checkpoint checksums: CRC-32C has its published check value and matches a bitwise CRC", "[checkpoint]") {
  using booster::checkpoint::crc32c;
  // The check value of CRC-32C (Castagnoli; RFC 3720, appendix B.4) over the ASCII digits 1..9.
  const std::string digits = "123456789";
  CHECK(crc32c(digits.data(), digits.size()) == 0xE3069283u);
  // Continuing over pieces gives the CRC of the whole.
  CHECK(crc32c(digits.data() + 4, 5, crc32c(digits.data(), 4)) == 0xE3069283u);
  // 32 zero bytes and 32 bytes of 0xFF: RFC 3720, B.4.
  const std::string zeros(32, '\0'), ones(32, char(0xFF));
  CHECK(crc32c(zeros.data(), zeros.size()) == 0x8A9136AAu);
  CHECK(crc32c(ones.data(), ones.size()) == 0x62A8AB43u);
  // Against the definition, one bit at a time, for every length and alignment up to 40 bytes (the
  // 8-byte words of the fast paths and their tails).
  auto bitwise = [](const unsigned char* p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; ++i) {
      c ^= p[i];
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1u) ? 0x82F63B78u : 0u);
    }
    return ~c;
  };
  unsigned char buffer[64];
  for (int i = 0; i < 64; ++i) buffer[i] = static_cast<unsigned char>(i * 37 + 11);
  for (size_t offset = 0; offset < 8; ++offset)
    for (size_t n = 0; n <= 40; ++n) {
      INFO("offset " << offset << ", length " << n);
      CHECK(crc32c(buffer + offset, n) == bitwise(buffer + offset, n));
    }
}

TEST_CASE("checkpoint checksums: a large file is summed whole and a flipped bit in it is found", "[checkpoint]") {
  // 21 MB + 5 bytes, checked against one pass over the whole; then a flipped bit is found.
  TempDir dir;
  std::string bytes(21'000'005, '\0');
  uint64_t x = 88172645463325252ull;
  for (char& c : bytes) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    c = char(x);
  }
  write_bytes(dir.path / "blob.bin", bytes);
  booster::checkpoint::write_checksums(dir.path);
  const json manifest = json::parse(read_bytes(dir.path / "checksums.json"));
  char want[9];
  std::snprintf(want, sizeof want, "%08x", booster::checkpoint::crc32c(bytes.data(), bytes.size()));
  CHECK(manifest["files"]["blob.bin"]["crc32c"] == want);
  CHECK(manifest["files"]["blob.bin"]["bytes"] == bytes.size());
  CHECK(booster::checkpoint::verify_checksums(dir.path) == booster::checkpoint::ChecksumStatus::Verified);
  bytes[12'345'678] ^= 0x40;
  write_bytes(dir.path / "blob.bin", bytes);
  CHECK_THROWS_WITH(booster::checkpoint::verify_checksums(dir.path), Catch::Contains("blob.bin fails its checksum"));
}

// issue 38, item 4: checksums.json covers every file of a step, and model.init_from's reader
// (load_weights) verifies the model files it reads from a checkpoint (Note [Weights from a checkpoint]).
TEST_CASE("checkpoint checksums: a file checksums.json does not list is refused, and below limits the check",
          "[checkpoint]") {
  TempDir dir;
  Run run;
  const fs::path step = save_checkpoint(dir.path, run.state(3));
  CHECK(verify_checksums(step) == ChecksumStatus::Verified);
  // An unlisted file in a subfolder, then at the top.
  fs::create_directories(step / "extra");
  write_bytes(step / "extra" / "notes.txt", "added after the save");
  REQUIRE_THROWS_WITH(verify_checksums(step), Catch::Contains((step / "extra" / "notes.txt").string()) &&
                                                  Catch::Contains("is not covered by") && Catch::Contains("--no-verify"));
  REQUIRE_THROWS_WITH(load_checkpoint(dir.path), Catch::Contains("is not covered by"));
  // `below` checks only what lies there: the model file alone passes, the folder of the extra file not.
  CHECK(verify_checksums(step, "model.safetensors") == ChecksumStatus::Verified);
  REQUIRE_THROWS_WITH(verify_checksums(step, "extra"), Catch::Contains("notes.txt"));
  fs::remove_all(step / "extra");
  // An entry removed: the file it covered is refused, though undamaged.
  json manifest = json::parse(read_bytes(step / "checksums.json"));
  manifest["files"].erase("optimizer.safetensors");
  write_bytes(step / "checksums.json", manifest.dump());
  REQUIRE_THROWS_WITH(load_checkpoint(dir.path), Catch::Contains((step / "optimizer.safetensors").string()) &&
                                                     Catch::Contains("is not covered by"));
  CHECK(verify_checksums(step, "model.safetensors") == ChecksumStatus::Verified);
  CHECK_NOTHROW(load_checkpoint(dir.path, {.verify = false}));
}

TEST_CASE("checkpoint: load_weights verifies a checkpoint's model files, and reads other weights as they are",
          "[checkpoint]") {
  TempDir dir;
  Run run;
  const TrainingState state = run.state(5);
  const fs::path step = save_checkpoint(dir.path, state);  // the model beside the optimizer
  const fs::path file = step / "model.safetensors";
  CHECK(same_maps(load_weights(step), state.model));
  CHECK(same_maps(load_weights(file), state.model));

  std::string bytes = read_bytes(file);
  bytes[bytes.size() - 3] ^= 0x01;  // inside the last tensor's data
  write_bytes(file, bytes);
  for (const fs::path& from : {step, file}) {
    INFO(from);
    REQUIRE_THROWS_AS(load_weights(from), CheckpointError);
    REQUIRE_THROWS_WITH(load_weights(from), Catch::Contains(file.string()) &&
                                                Catch::Contains("fails the checksum of tensor '"));
    CHECK_NOTHROW(load_weights(from, {.verify = false}));
  }

  // Its checksums removed: the format records them, so it is refused; a version 1 step loads.
  fs::remove(step / "checksums.json");
  REQUIRE_THROWS_WITH(load_weights(step), Catch::Contains("has no checksums.json"));
  json trainer_state = json::parse(read_bytes(step / "trainer_state.json"));
  trainer_state["version"] = 1;
  write_bytes(step / "trainer_state.json", trainer_state.dump());
  CHECK_NOTHROW(load_weights(step, {.warn = false}));

  // A Hugging Face Trainer checkpoint has a trainer_state.json of its own and no checksums: read as is.
  TempDir hf;
  save_model(hf.path, state.model);
  write_bytes(hf / "trainer_state.json", R"({"global_step": 10, "log_history": []})");
  CHECK(same_maps(load_weights(hf.path), state.model));
  CHECK(same_maps(load_weights(hf / "model.safetensors"), state.model));
}
