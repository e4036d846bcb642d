#include "booster/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <vector>

#include "booster/checkpoint/atomic_file.h"
#include "booster/common/error.h"
#include "booster/common/input_file.h"
#include "booster/common/json_text.h"

namespace booster::checkpoint {

namespace fs = std::filesystem;
using json = nlohmann::json;

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host would need byte swaps");

namespace {

// The reference implementation refuses larger headers; so do we, before allocating one.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DTypeName {
  DType dtype;
  const char* name;
};
constexpr DTypeName kDTypeNames[] = {
    {DType::Float64, "F64"}, {DType::Float32, "F32"}, {DType::Float16, "F16"}, {DType::BFloat16, "BF16"},
    {DType::Int64, "I64"},   {DType::Int32, "I32"},   {DType::Bool, "BOOL"},
    {DType::Float8E4M3FN, "F8_E4M3"}, {DType::Float8E5M2, "F8_E5M2"},
};

// Every dtype name the format has that read_safetensors_raw passes through, with its item size.
struct RawDTypeName {
  const char* name;
  size_t itemsize;
};
constexpr RawDTypeName kRawDTypeNames[] = {
    {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8}, {"I32", 4},
    {"I16", 2}, {"I8", 1},  {"U8", 1},  {"U16", 2},  {"U32", 4}, {"U64", 8}, {"BOOL", 1},
    {"F8_E4M3", 1}, {"F8_E5M2", 1},
};

std::string supported_dtype_names() {
  std::string s;
  for (const auto& d : kDTypeNames) s += (s.empty() ? "" : ", ") + std::string(d.name);
  return s;
}

// A read-only file with positioned reads that check they stay inside the file.
class FileReader {
 public:
  explicit FileReader(const fs::path& path) : path_(path) {
    // A FIFO would block a plain open (Note [Inputs that are not files]).
    InputFile file = open_input_file<CheckpointError>(path, "safetensors file", "give a .safetensors file");
    size_ = file.size();
    fd_ = file.release();
  }
  ~FileReader() { ::close(fd_); }
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;

  uint64_t size() const { return size_; }

  void read_at(uint64_t offset, void* dst, uint64_t nbytes) const {
    BOOSTER_CHECK(offset <= size_ && nbytes <= size_ - offset, CheckpointError, "corrupt safetensors file ",
                  path_.string(), ": read of ", nbytes, " bytes at offset ", offset, " passes its end (",
                  size_, " bytes)");
    char* p = static_cast<char*>(dst);
    while (nbytes > 0) {
      const size_t chunk = size_t(std::min<uint64_t>(nbytes, uint64_t(1) << 30));
      const ssize_t n = ::pread(fd_, p, chunk, off_t(offset));
      if (n < 0 && errno == EINTR) continue;
      BOOSTER_CHECK(n > 0, CheckpointError, "cannot read ", path_.string(), " at offset ", offset, ": ",
                    n == 0 ? std::string("the file shrank while being read") : std::strerror(errno));
      p += n;
      offset += uint64_t(n);
      nbytes -= uint64_t(n);
    }
  }

 private:
  fs::path path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// One tensor's entry in the header, validated on its own (the tiling is checked across entries).
struct Entry {
  std::string name;
  DType dtype;             // when read as tensors
  std::string dtype_name;  // as in the file
  Shape shape;
  uint64_t begin, end;
};

// `raw`: any dtype of kRawDTypeNames (read_safetensors_raw), else only those booster has tensors of.
Entry parse_entry(const fs::path& path, const std::string& name, const json& e, bool raw) {
  auto fail = [&](const std::string& what) -> Entry {
    BOOSTER_FAIL(CheckpointError, "corrupt safetensors file ", path.string(), ": tensor '", name, "' ", what);
  };
  if (!e.is_object()) return fail("is not a JSON object");
  for (const auto& [key, value] : e.items())
    if (key != "dtype" && key != "shape" && key != "data_offsets")
      return fail("has the unknown field '" + key + "' (expected dtype, shape, data_offsets)");
  if (!e.contains("dtype") || !e["dtype"].is_string()) return fail("has no string field 'dtype'");
  if (!e.contains("shape") || !e["shape"].is_array()) return fail("has no array field 'shape'");
  if (!e.contains("data_offsets") || !e["data_offsets"].is_array() || e["data_offsets"].size() != 2)
    return fail("has no field 'data_offsets' of two integers");

  Entry entry;
  entry.name = name;
  const std::string dtype = e["dtype"].get<std::string>();
  entry.dtype_name = dtype;
  uint64_t nbytes = 0;
  if (raw) {
    const auto known = std::find_if(std::begin(kRawDTypeNames), std::end(kRawDTypeNames),
                                    [&](const RawDTypeName& d) { return dtype == d.name; });
    if (known == std::end(kRawDTypeNames)) return fail("has dtype '" + dtype + "', which is not a safetensors dtype");
    nbytes = known->itemsize;
  } else {
    const auto known = std::find_if(std::begin(kDTypeNames), std::end(kDTypeNames),
                                    [&](const DTypeName& d) { return dtype == d.name; });
    if (known == std::end(kDTypeNames))
      return fail("has dtype '" + dtype + "', which booster does not support (supported: " +
                  supported_dtype_names() + ")");
    entry.dtype = known->dtype;
    nbytes = itemsize(entry.dtype);
  }

  // numel * itemsize, computed without overflow: every factor is bounded by the file size anyway.
  bool overflow = false;
  for (const json& d : e["shape"]) {
    if (!d.is_number_unsigned()) return fail("has a shape entry that is not a non-negative integer: " + d.dump());
    const uint64_t size = d.get<uint64_t>();
    if (size > uint64_t(std::numeric_limits<int64_t>::max())) return fail("has a shape entry too large: " + d.dump());
    entry.shape.push_back(int64_t(size));
    if (size != 0 && nbytes > std::numeric_limits<uint64_t>::max() / size) overflow = true;
    else nbytes *= size;
  }
  const json& offsets = e["data_offsets"];
  if (!offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned())
    return fail("has data_offsets that are not non-negative integers: " + offsets.dump());
  entry.begin = offsets[0].get<uint64_t>();
  entry.end = offsets[1].get<uint64_t>();
  if (entry.end < entry.begin) return fail("has data_offsets that end before they begin: " + offsets.dump());
  if (overflow || nbytes != entry.end - entry.begin)
    return fail(str("has shape ", entry.shape, " of ", dtype, " (", overflow ? "overflowing" : std::to_string(nbytes),
                    " bytes) but data_offsets ", offsets.dump(), " span ", entry.end - entry.begin, " bytes"));
  return entry;
}

}  // namespace

const char* safetensors_dtype_name(DType dtype) {
  for (const auto& d : kDTypeNames)
    if (d.dtype == dtype) return d.name;
  BOOSTER_FAIL(CheckpointError, "safetensors: no dtype name for ", dtype);
}

DType dtype_from_safetensors_name(const std::string& name) {
  for (const auto& d : kDTypeNames)
    if (name == d.name) return d.dtype;
  BOOSTER_FAIL(CheckpointError, "safetensors: unsupported dtype '", name, "' (supported: ", supported_dtype_names(), ")");
}

void write_safetensors(const fs::path& path, const TensorMap& tensors, const Metadata& metadata) {
  // Bring every tensor to contiguous host memory first: saved by value, whatever its strides or device.
  std::vector<std::pair<const std::string*, Tensor>> data;
  data.reserve(tensors.size());
  nlohmann::ordered_json header = nlohmann::ordered_json::object();  // keys in the reference writer's order
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {  // std::map: sorted by name, as the reference writer
    BOOSTER_CHECK(!name.empty() && name != "__metadata__", CheckpointError, "write_safetensors ", path.string(),
                  ": invalid tensor name '", name, "'");
    BOOSTER_CHECK(t.defined(), CheckpointError, "write_safetensors ", path.string(), ": tensor '", name,
                  "' is undefined");
    Tensor host = t.device().is_cpu() ? t.contiguous() : t.cpu().contiguous();
    const uint64_t nbytes = host.nbytes();
    auto& entry = header[name];
    entry["dtype"] = safetensors_dtype_name(host.dtype());
    entry["shape"] = host.shape();
    entry["data_offsets"] = {offset, offset + nbytes};
    offset += nbytes;
    data.emplace_back(&name, std::move(host));
  }

  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {  // names or metadata that are not valid UTF-8
    BOOSTER_FAIL(CheckpointError, "write_safetensors ", path.string(), ": cannot encode the header: ", e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = uint8_t(uint64_t(text.size()) >> (8 * i));

  write_file_atomically(path, [&](FileWriter& out) {
    out.write(length, 8);
    out.write(text);
    for (const auto& [name, t] : data) out.write(t.data_ptr(), t.nbytes());
  });
}

namespace {

// The validated header of a file: its entries sorted by offset (tiling the data), where the data
// starts, and the metadata.
struct Header {
  std::vector<Entry> entries;
  uint64_t data_start = 0;
  Metadata metadata;
};

Header read_header(const FileReader& file, const fs::path& path, bool raw) {
  const std::string where = "corrupt safetensors file " + path.string() + ": ";
  BOOSTER_CHECK(file.size() >= 8, CheckpointError, where, "it has ", file.size(),
                " bytes, fewer than the 8 of the header length");
  uint8_t length_bytes[8];
  file.read_at(0, length_bytes, 8);
  uint64_t header_size = 0;
  for (int i = 0; i < 8; ++i) header_size |= uint64_t(length_bytes[i]) << (8 * i);
  BOOSTER_CHECK(header_size <= kMaxHeaderBytes, CheckpointError, where, "the header length ", header_size,
                " exceeds the limit of ", kMaxHeaderBytes, " bytes");
  BOOSTER_CHECK(header_size <= file.size() - 8, CheckpointError, where, "the header length ", header_size,
                " passes the end of the file (", file.size(), " bytes); the file is truncated or not safetensors");
  const uint64_t data_start = 8 + header_size;
  const uint64_t data_size = file.size() - data_start;

  std::string text(size_t(header_size), '\0');
  file.read_at(8, text.data(), header_size);
  json header;
  try {
    // The config's depth (Note [One JSON reader] in booster/common/json_text.h); the size is checked
    // above. A duplicate tensor name is refused as one, naming both places.
    header = parse_json_text(text, where + "the header",
                             data_limits(kMaxHeaderBytes, "a safetensors header's limit"));
  } catch (const ConfigError& e) {
    throw CheckpointError(e.what());
  }
  BOOSTER_CHECK(header.is_object(), CheckpointError, where, "the header is not a JSON object");

  Header result;
  result.data_start = data_start;
  std::vector<Entry>& entries = result.entries;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      BOOSTER_CHECK(value.is_object(), CheckpointError, where, "__metadata__ is not an object");
      for (const auto& [key, v] : value.items()) {
        BOOSTER_CHECK(v.is_string(), CheckpointError, where, "__metadata__ value of '", key,
                      "' is not a string: ", v.dump());
        result.metadata[key] = v.get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(path, name, value, raw));
  }

  // The spans must tile [0, data_size): sorted by begin, each starts where the previous ended.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expected_begin = 0;
  for (const Entry& e : entries) {
    BOOSTER_CHECK(e.begin >= expected_begin, CheckpointError, where, "tensor '", e.name, "' at data_offsets [",
                  e.begin, ", ", e.end, "] overlaps the tensor before it (which ends at ", expected_begin, ")");
    BOOSTER_CHECK(e.begin == expected_begin, CheckpointError, where, "a gap of unused bytes [", expected_begin,
                  ", ", e.begin, ") before tensor '", e.name, "'");
    BOOSTER_CHECK(e.end <= data_size, CheckpointError, where, "tensor '", e.name, "' at data_offsets [", e.begin,
                  ", ", e.end, "] passes the end of the data (", data_size,
                  " bytes); the file is truncated");
    expected_begin = e.end;
  }
  BOOSTER_CHECK(expected_begin == data_size, CheckpointError, where, data_size - expected_begin,
                " bytes of trailing data after the last tensor");
  return result;
}

}  // namespace

SafetensorsFile read_safetensors(const fs::path& path) {
  FileReader file(path);
  const std::string where = "corrupt safetensors file " + path.string() + ": ";
  Header header = read_header(file, path, /*raw=*/false);
  const uint64_t data_start = header.data_start;
  SafetensorsFile result;
  result.metadata = std::move(header.metadata);
  for (const Entry& e : header.entries) {
    Tensor t = Tensor::empty(e.shape, e.dtype);
    file.read_at(data_start + e.begin, t.data_ptr(), e.end - e.begin);
    if (e.dtype == DType::Bool) {  // any other byte would be undefined behaviour as a C++ bool
      const auto* bytes = static_cast<const uint8_t*>(t.data_ptr());
      for (int64_t i = 0; i < t.numel(); ++i)
        BOOSTER_CHECK(bytes[i] <= 1, CheckpointError, where, "BOOL tensor '", e.name, "' holds the byte ",
                      int(bytes[i]), " at element ", i, " (must be 0 or 1)");
    }
    result.tensors.emplace(e.name, std::move(t));
  }
  return result;
}

std::vector<TensorSpan> safetensors_spans(const fs::path& path) {
  FileReader file(path);
  const Header header = read_header(file, path, /*raw=*/true);
  std::vector<TensorSpan> spans;
  spans.reserve(header.entries.size());
  for (const Entry& e : header.entries)
    spans.push_back({e.name, header.data_start + e.begin, header.data_start + e.end});
  return spans;
}

SafetensorsHeader read_safetensors_header(const fs::path& path) {
  FileReader file(path);
  Header header = read_header(file, path, /*raw=*/true);
  SafetensorsHeader out;
  out.metadata = std::move(header.metadata);
  for (const Entry& e : header.entries)
    out.entries.push_back({e.name, e.dtype_name, e.shape, header.data_start + e.begin, header.data_start + e.end});
  return out;
}

std::map<std::string, RawTensor> read_safetensors_raw(const fs::path& path) {
  FileReader file(path);
  const Header header = read_header(file, path, /*raw=*/true);
  std::map<std::string, RawTensor> out;
  for (const Entry& e : header.entries) {
    RawTensor t;
    t.dtype = e.dtype_name;
    t.shape = e.shape;
    t.bytes.resize(size_t(e.end - e.begin));
    file.read_at(header.data_start + e.begin, t.bytes.data(), e.end - e.begin);
    out.emplace(e.name, std::move(t));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------- models

namespace {

const std::regex kShardName(R"(model-\d{5}-of-\d{5}\.safetensors)");

std::string shard_name(size_t index, size_t count) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return buf;
}

// Removes model files of an earlier save that the save just completed does not use.
void remove_stale_model_files(const fs::path& dir, const std::set<std::string>& keep) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool model_file = name == kModelFileName || name == kModelIndexFileName ||
                            std::regex_match(name, kShardName);
    if (model_file && !keep.count(name)) fs::remove(entry.path(), ec);
  }
}

TensorMap load_sharded(const fs::path& index_path) {
  const std::string where = "model index " + index_path.string() + ": ";
  json index;
  try {
    // Note [One JSON reader]: an index lists a name per tensor, no bigger than a header.
    index = booster::read_json_file(index_path.string(), "model index",
                                    data_limits(kMaxHeaderBytes, "a safetensors header's limit"));
  } catch (const ConfigError& e) {
    throw CheckpointError(e.what());
  }
  BOOSTER_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
                CheckpointError, where, "no \"weight_map\" object");
  std::map<std::string, std::set<std::string>> names_by_shard;
  for (const auto& [name, file] : index["weight_map"].items()) {
    BOOSTER_CHECK(file.is_string(), CheckpointError, where, "weight_map entry '", name, "' is not a file name");
    const std::string shard = file.get<std::string>();
    // Only plain names: an index must not make us read files outside its directory.
    BOOSTER_CHECK(!shard.empty() && shard.find('/') == std::string::npos && shard != "." && shard != "..",
                  CheckpointError, where, "weight_map entry '", name, "' names '", shard,
                  "', which is not a file name in the index's directory");
    names_by_shard[shard].insert(name);
  }

  TensorMap out;
  uint64_t total = 0;
  for (const auto& [shard, names] : names_by_shard) {
    const fs::path shard_path = index_path.parent_path() / shard;
    BOOSTER_CHECK(fs::exists(shard_path), CheckpointError, where, "shard ", shard_path.string(), " is missing");
    SafetensorsFile file = read_safetensors(shard_path);
    for (auto& [name, t] : file.tensors) {
      BOOSTER_CHECK(names.count(name), CheckpointError, where, "shard ", shard, " holds tensor '", name,
                    "', which the weight_map does not place there (a shard from another save?)");
      total += t.nbytes();
      out.emplace(name, std::move(t));
    }
    for (const std::string& name : names)
      BOOSTER_CHECK(out.count(name), CheckpointError, where, "tensor '", name, "' is missing from shard ", shard);
  }
  if (index.contains("metadata") && index["metadata"].is_object() && index["metadata"].contains("total_size")) {
    const json& declared = index["metadata"]["total_size"];
    BOOSTER_CHECK(declared.is_number_unsigned() && declared.get<uint64_t>() == total, CheckpointError, where,
                  "metadata.total_size is ", declared.dump(), " but the shards hold ", total, " bytes");
  }
  return out;
}

}  // namespace

void save_model(const fs::path& dir, const TensorMap& state_dict, uint64_t max_shard_bytes) {
  BOOSTER_CHECK(max_shard_bytes > 0, ValueError, "save_model: max_shard_bytes must be positive");
  std::error_code ec;
  fs::create_directories(dir, ec);
  BOOSTER_CHECK(fs::is_directory(dir), CheckpointError, "save_model: cannot create directory ", dir.string(),
                ec ? ": " + ec.message() : std::string());
  const Metadata metadata = {{"format", "pt"}};

  // Greedy split in name order, as transformers' shard_checkpoint.
  std::vector<TensorMap> shards(1);
  uint64_t current = 0, total = 0;
  for (const auto& [name, t] : state_dict) {
    BOOSTER_CHECK(t.defined(), CheckpointError, "save_model: tensor '", name, "' is undefined");
    const uint64_t nbytes = t.nbytes();
    if (current > 0 && current + nbytes > max_shard_bytes) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().emplace(name, t);
    current += nbytes;
    total += nbytes;
  }

  if (shards.size() == 1) {
    write_safetensors(dir / kModelFileName, state_dict, metadata);
    remove_stale_model_files(dir, {kModelFileName});
    return;
  }
  json weight_map = json::object();
  std::set<std::string> written = {kModelIndexFileName};
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string file = shard_name(i, shards.size());
    write_safetensors(dir / file, shards[i], metadata);
    for (const auto& [name, t] : shards[i]) weight_map[name] = file;
    written.insert(file);
  }
  const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  write_text_file_atomically(dir / kModelIndexFileName, index.dump(2) + "\n");
  remove_stale_model_files(dir, written);
}

TensorMap load_model(const fs::path& path) {
  if (fs::is_directory(path)) {
    if (fs::exists(path / kModelFileName)) return read_safetensors(path / kModelFileName).tensors;
    if (fs::exists(path / kModelIndexFileName)) return load_sharded(path / kModelIndexFileName);
    BOOSTER_FAIL(CheckpointError, "load_model: ", path.string(), " holds neither ", kModelFileName, " nor ",
                 kModelIndexFileName);
  }
  BOOSTER_CHECK(fs::exists(path), CheckpointError, "load_model: ", path.string(), " does not exist");
  const std::string name = path.filename().string();
  if (name.size() > 11 && name.compare(name.size() - 11, 11, ".index.json") == 0) return load_sharded(path);
  return read_safetensors(path).tensors;
}

}  // namespace booster::checkpoint
