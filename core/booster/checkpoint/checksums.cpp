// Note [Checkpoint checksums] (checksums.h).
#include "booster/checkpoint/checksums.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/checkpoint/atomic_file.h"
#include "booster/checkpoint/safetensors.h"
#include "booster/common/error.h"
#include "booster/common/input_file.h"
#include "booster/common/json_text.h"

namespace booster::checkpoint {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kFormat = "booster-checksums";
constexpr int kVersion = 1;
constexpr const char* kEscape =
    "resume from another checkpoint of the directory (or point model.init_from at another step's model), or pass "
    "--no-verify (LoadStateOptions::verify = false) to load it unverified";

// A whole file mapped read-only.
class MappedFile {
 public:
  explicit MappedFile(const fs::path& path) {
    // A FIFO must not block the open (Note [Inputs that are not files]).
    InputFile file = open_input_file<CheckpointError>(path, "checkpoint file", "");
    size_ = size_t(file.size());
    const int fd = file.release();
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      const int err = errno;
      ::close(fd);
      BOOSTER_CHECK(p != MAP_FAILED, CheckpointError, "cannot read ", path.string(), ": ", std::strerror(err));
      data_ = static_cast<const unsigned char*>(p);
    } else {
      ::close(fd);
    }
  }
  ~MappedFile() {
    if (data_) ::munmap(const_cast<unsigned char*>(data_), size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  size_t size() const { return size_; }
  uint32_t crc(uint64_t begin, uint64_t end) const { return crc32c(data_ + begin, size_t(end - begin)); }

 private:
  const unsigned char* data_ = nullptr;
  size_t size_ = 0;
};

std::string hex(uint32_t crc) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", crc);
  return buf;
}

bool is_safetensors(const fs::path& p) { return p.extension() == ".safetensors"; }

json file_entry(const fs::path& path) {
  const MappedFile file(path);
  json entry = {{"bytes", file.size()}};
  if (!is_safetensors(path)) {
    entry["crc32c"] = hex(file.crc(0, file.size()));
    return entry;
  }
  const std::vector<TensorSpan> spans = safetensors_spans(path);
  const uint64_t header_bytes = spans.empty() ? file.size() : spans.front().begin;
  entry["header_bytes"] = header_bytes;
  entry["header_crc32c"] = hex(file.crc(0, header_bytes));
  json tensors = json::object();
  for (const TensorSpan& span : spans) tensors[span.name] = hex(file.crc(span.begin, span.end));
  entry["tensors"] = std::move(tensors);
  return entry;
}

// The regular files below `dir`, relative, in a fixed order; the checksums file itself left out.
std::vector<fs::path> files_below(const fs::path& dir) {
  std::vector<fs::path> out;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    const fs::path relative = entry.path().lexically_relative(dir);
    if (relative == kChecksumsFileName) continue;
    out.push_back(relative);
  }
  std::sort(out.begin(), out.end());
  return out;
}

[[noreturn]] void fail_file(const fs::path& file, const std::string& what) {
  BOOSTER_FAIL(CheckpointError, "checkpoint file ", file.string(), " ", what,
               ": it changed or was damaged after it was saved; ", kEscape);
}

void verify_file(const fs::path& dir, const std::string& name, const json& expected) {
  const fs::path path = dir / name;
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) fail_file(path, "is missing (" + std::string(kChecksumsFileName) + " lists it)");
  const MappedFile file(path);
  const uint64_t bytes = expected.at("bytes").get<uint64_t>();
  if (file.size() != bytes)
    fail_file(path, "has " + std::to_string(file.size()) + " bytes, not the " + std::to_string(bytes) + " saved");
  if (!expected.contains("tensors")) {
    const std::string got = hex(file.crc(0, file.size()));
    if (got != expected.at("crc32c").get<std::string>())
      fail_file(path, "fails its checksum (crc32c " + got + ", saved " + expected.at("crc32c").get<std::string>() + ")");
    return;
  }
  const uint64_t header_bytes = expected.at("header_bytes").get<uint64_t>();
  const std::string header_crc = hex(file.crc(0, std::min<uint64_t>(header_bytes, file.size())));
  if (header_crc != expected.at("header_crc32c").get<std::string>())
    fail_file(path, "fails the checksum of its header (crc32c " + header_crc + ", saved " +
                        expected.at("header_crc32c").get<std::string>() + ")");
  // The header is the one saved, so its spans are the saved ones.
  const json& tensors = expected.at("tensors");
  const std::vector<TensorSpan> spans = safetensors_spans(path);
  if (spans.size() != tensors.size())
    fail_file(path, "holds " + std::to_string(spans.size()) + " tensors, not the " + std::to_string(tensors.size()) + " saved");
  for (const TensorSpan& span : spans) {
    const auto it = tensors.find(span.name);
    if (it == tensors.end()) fail_file(path, "holds tensor '" + span.name + "', which was not saved");
    const std::string got = hex(file.crc(span.begin, span.end));
    if (got != it->get<std::string>())
      fail_file(path, "fails the checksum of tensor '" + span.name + "' (crc32c " + got + ", saved " +
                          it->get<std::string>() + ")");
  }
}

}  // namespace

// Note [CRC-32C]: the Castagnoli polynomial (reflected 0x82F63B78), as iSCSI, ext4 and Btrfs use. x86-64
// CPUs since 2008 compute it in hardware (SSE4.2 `crc32`, one 8-byte word per cycle, ~8 GB/s per core,
// several times zlib's table-driven CRC-32); elsewhere a slice-by-8 table does it. Chosen at run time,
// so the build does not depend on the CPU it was built on.
namespace {

struct Crc32cTables {
  uint32_t t[8][256];
  Crc32cTables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int k = 1; k < 8; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFF];
  }
};

uint32_t crc32c_table(uint32_t crc, const unsigned char* p, size_t n) {
  static const Crc32cTables tables;
  const auto& t = tables.t;
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);  // little-endian hosts only, as the rest of booster
    word ^= crc;
    crc = t[7][word & 0xFF] ^ t[6][(word >> 8) & 0xFF] ^ t[5][(word >> 16) & 0xFF] ^ t[4][(word >> 24) & 0xFF] ^
          t[3][(word >> 32) & 0xFF] ^ t[2][(word >> 40) & 0xFF] ^ t[1][(word >> 48) & 0xFF] ^ t[0][word >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFF];
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t crc, const unsigned char* p, size_t n) {
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = __builtin_ia32_crc32di(c, word);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = uint32_t(c);
  while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}
#endif

using Crc32cFn = uint32_t (*)(uint32_t, const unsigned char*, size_t);

Crc32cFn pick_crc32c() {
#if defined(__x86_64__)
  // BOOSTER_CPU_ISA=baseline (Note [CPU kernels per ISA level]) takes the portable path, so tests cover it.
  const char* isa = std::getenv("BOOSTER_CPU_ISA");
  const bool baseline = isa && std::string(isa) == "baseline";
  if (!baseline && __builtin_cpu_supports("sse4.2")) return crc32c_sse42;
#endif
  return crc32c_table;
}

}  // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  static const Crc32cFn fn = pick_crc32c();
  return ~fn(~crc, static_cast<const unsigned char*>(data), size);
}

void write_checksums(const fs::path& dir) {
  json files = json::object();
  for (const fs::path& file : files_below(dir)) files[file.generic_string()] = file_entry(dir / file);
  const json manifest = {{"format", kFormat}, {"version", kVersion}, {"algorithm", "crc32c"}, {"files", files}};
  write_text_file_atomically(dir / kChecksumsFileName, manifest.dump(1) + "\n");
}

namespace {

// Whether `name` (a manifest entry, relative to the step) is `below` or inside it; everything when
// `below` is empty.
bool is_below(const std::string& name, const std::string& below) {
  if (below.empty() || below == ".") return true;
  return name == below || (name.size() > below.size() && name.compare(0, below.size(), below) == 0 &&
                           name[below.size()] == '/');
}

}  // namespace

ChecksumStatus verify_checksums(const fs::path& dir, const fs::path& below_path) {
  std::string below = below_path.lexically_normal().generic_string();
  while (!below.empty() && below.back() == '/') below.pop_back();
  const fs::path manifest_file = dir / kChecksumsFileName;
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(manifest_file, ec))) return ChecksumStatus::Absent;
  json manifest;
  try {
    // Note [One JSON reader] (booster/common/json_text.h).
    manifest = parse_json_text(read_text_file(manifest_file, size_t(256) << 20),
                               "checkpoint file " + manifest_file.string(), checkpoint_limits());
  } catch (const JsonSyntaxError& e) {
    BOOSTER_FAIL(CheckpointError, "checkpoint file ", manifest_file.string(), " is not valid JSON (", e.detail(),
                 "); it was damaged after it was saved; ", kEscape);
  } catch (const ConfigError& e) {
    BOOSTER_FAIL(CheckpointError, e.what(), "; it was damaged after it was saved; ", kEscape);
  }
  BOOSTER_CHECK(manifest.is_object() && manifest.value("format", json()) == kFormat &&
                    manifest.value("version", json()) == kVersion && manifest.value("algorithm", json()) == "crc32c" &&
                    manifest.contains("files") && manifest.at("files").is_object(),
                CheckpointError, "checkpoint file ", manifest_file.string(), " is not a booster-checksums version ",
                kVersion, " file with crc32c; ", kEscape);
  // Every file the step holds is covered: a file the manifest does not list would be read unverified
  // (its entry removed, or the file added after the save).
  const json& files = manifest.at("files");
  for (const fs::path& file : files_below(dir)) {
    const std::string name = file.generic_string();
    if (!is_below(name, below) || files.contains(name)) continue;
    BOOSTER_FAIL(CheckpointError, "checkpoint file ", (dir / file).string(), " is not covered by ",
                 manifest_file.string(), " (its entry was removed, or the file was added after the save), so it "
                 "cannot be verified; ", kEscape);
  }
  try {
    for (const auto& [name, expected] : files.items())
      if (is_below(name, below)) verify_file(dir, name, expected);
  } catch (const json::exception& e) {
    BOOSTER_FAIL(CheckpointError, "checkpoint file ", manifest_file.string(), " is malformed (", e.what(),
                 "); it was damaged after it was saved; ", kEscape);
  }
  return ChecksumStatus::Verified;
}

}  // namespace booster::checkpoint
