// Token files and the samples cut from them (tokens.h; Note [Token files], Note [Token samples],
// Note [Checking token ids]).
#include "booster/data/tokens.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "booster/common/error.h"
#include "booster/common/json_text.h"
#include "booster/data/dataset.h"

namespace booster::data {

// The files are little-endian and read in place.
static_assert(std::endian::native == std::endian::little, "token files are read in place: a little-endian host");

TokenDType token_dtype_from_string(const std::string& name) {
  if (name == "uint16") return TokenDType::UInt16;
  if (name == "uint32") return TokenDType::UInt32;
  BOOSTER_FAIL(ConfigError, "token dtype \"", name, "\" is not one of \"uint16\", \"uint32\"");
}

const char* to_string(TokenDType dtype) { return dtype == TokenDType::UInt16 ? "uint16" : "uint32"; }

// ------------------------------------------------------------------------------------ descriptions
std::string token_description_path(const std::string& path) { return path + ".json"; }

std::optional<TokenFileDescription> read_token_description(const std::string& path) {
  const std::string where = token_description_path(path);
  std::error_code ec;
  if (!std::filesystem::exists(where, ec)) return std::nullopt;
  const std::string fix = "; fix it or delete it (Note [Token file descriptions]: {\"dtype\": \"uint16\" | \"uint32\"})";
  std::ifstream in(where, std::ios::binary);
  BOOSTER_CHECK(in.good(), DataError, "token data: cannot read ", where, ", the description of ", path, ": ",
                std::strerror(errno), fix);
  in.close();
  // The config's limits (Note [One JSON reader] in booster/common/json_text.h).
  nlohmann::json j;
  try {
    j = booster::read_json_file(where, "token data: the description of " + path + ", the file", JsonLimits{});
  } catch (const JsonSyntaxError&) {
    j = nlohmann::json(nlohmann::json::value_t::discarded);  // not a JSON object, below
  } catch (const ConfigError& e) {
    throw DataError(e.what() + fix);
  }
  BOOSTER_CHECK(j.is_object(), DataError, "token data: ", where, ", the description of ", path,
                ", is not a JSON object", fix);
  const nlohmann::json dtype = j.value("dtype", nlohmann::json());
  BOOSTER_CHECK(dtype == "uint16" || dtype == "uint32", DataError, "token data: ", where, ", the description of ", path,
                ", has \"dtype\" ", dtype.dump(), "; expected \"uint16\" or \"uint32\"", fix);
  TokenFileDescription d;
  d.dtype = token_dtype_from_string(dtype.get<std::string>());
  auto count = [&](const char* key, int64_t min) -> int64_t {
    const nlohmann::json v = j.value(key, nlohmann::json());
    if (v.is_null()) return -1;
    BOOSTER_CHECK(v.is_number_integer() && v.get<int64_t>() >= min, DataError, "token data: ", where,
                  ", the description of ", path, ", has \"", key, "\" ", v.dump(), "; expected an integer >= ", min, fix);
    return v.get<int64_t>();
  };
  d.tokens = count("tokens", 0);
  d.vocab_size = std::max<int64_t>(count("vocab_size", 1), 0);
  if (const nlohmann::json t = j.value("tokenizer", nlohmann::json()); t.is_object()) {
    if (t.value("path", nlohmann::json()).is_string()) d.tokenizer = t.at("path").get<std::string>();
    if (t.value("kind", nlohmann::json()).is_string()) d.tokenizer_kind = t.at("kind").get<std::string>();
  } else if (t.is_string()) {
    d.tokenizer = t.get<std::string>();
  }
  return d;
}

namespace {

void write_description(const std::string& where, const TokenFileDescription& d) {
  nlohmann::json j = {{"format", "booster.tokens"}, {"dtype", to_string(d.dtype)}};
  if (d.tokens >= 0) j["tokens"] = d.tokens;
  if (d.vocab_size > 0) j["vocab_size"] = d.vocab_size;
  if (!d.tokenizer.empty() || !d.tokenizer_kind.empty()) {
    j["tokenizer"] = nlohmann::json::object();
    if (!d.tokenizer_kind.empty()) j["tokenizer"]["kind"] = d.tokenizer_kind;
    if (!d.tokenizer.empty()) j["tokenizer"]["path"] = d.tokenizer;
  }
  std::ofstream out(where, std::ios::binary | std::ios::trunc);
  out << j.dump(2) << "\n";
  out.flush();
  BOOSTER_CHECK(out.good(), DataError, "cannot write the token file description ", where, ": ", std::strerror(errno));
}

bool is_glob(const std::string& pattern) { return pattern.find_first_of("*?[") != std::string::npos; }

}  // namespace

std::vector<std::string> token_file_paths(const std::vector<std::string>& patterns) {
  BOOSTER_CHECK(!patterns.empty(), ConfigError,
                "token data: no files; give data.path a token file, a glob (\"shards/*.bin\") or a list of them");
  std::vector<std::string> paths;
  for (const std::string& pattern : patterns) {
    std::error_code ec;
    if (!is_glob(pattern) || std::filesystem::exists(pattern, ec)) {
      paths.push_back(pattern);
      continue;
    }
    glob_t g{};
    const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
    std::vector<std::string> matches;
    if (rc == 0)
      for (size_t k = 0; k < g.gl_pathc; ++k) matches.emplace_back(g.gl_pathv[k]);
    ::globfree(&g);
    BOOSTER_CHECK(rc == 0 || rc == GLOB_NOMATCH, DataError, "token data: cannot expand the glob \"", pattern,
                  "\" (glob error ", rc, "); check that its directory is readable");
    // Byte order, whatever the locale: shard_0009 before shard_0010.
    std::sort(matches.begin(), matches.end());
    // The descriptions beside matched token files are not token files.
    std::vector<std::string> files;
    for (const std::string& m : matches) {
      const bool description = m.size() > 5 && m.ends_with(".json") &&
                               std::binary_search(matches.begin(), matches.end(), m.substr(0, m.size() - 5));
      if (!description) files.push_back(m);
    }
    BOOSTER_CHECK(!files.empty(), ConfigError, "token data: the glob \"", pattern,
                  "\" matches no file; check data.path (a glob's matches are sorted by name and read in order)");
    paths.insert(paths.end(), files.begin(), files.end());
  }
  return paths;
}

// ------------------------------------------------------------------------------------ TokenSource
namespace {

// A file's mapping or the in-memory ids: what the parts read, freed with the last part.
struct Storage {
  void* map = nullptr;
  size_t bytes = 0;
  std::vector<uint32_t> owned;
  // The mapped file's identity, to tell it from a file renamed over its path (Note [Token files cut short]).
  dev_t device = 0;
  ino_t inode = 0;
  Storage() = default;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  ~Storage() {
    if (map) ::munmap(map, bytes);
  }
};

// Every odd-index value of the first kDtypeSample zero, some even-index one not (Note [Token file
// descriptions]).
bool looks_like_uint32(const uint16_t* values, int64_t n) {
  if (n < kDtypeSampleMin || n % 2 != 0) return false;
  bool even_set = false;
  for (int64_t k = 0; k < n; k += 2) {
    if (values[k + 1] != 0) return false;
    even_set = even_set || values[k] != 0;
  }
  return even_set;
}

}  // namespace

struct TokenSource::Part {
  std::shared_ptr<const Storage> storage;
  std::string file;                    // "" for ids in memory
  const unsigned char* tokens = nullptr;  // this part's first token
  TokenDType dtype = TokenDType::UInt16;
  int64_t n = 0;                       // tokens in this part
  int64_t first = 0;                   // the offset of its first token in the file
  int64_t header_bytes = 0;            // llm.c's header; 0 for a flat file
  std::optional<TokenFileDescription> description;

  uint32_t at(int64_t k) const {
    return dtype == TokenDType::UInt16 ? reinterpret_cast<const uint16_t*>(tokens)[k]
                                       : reinterpret_cast<const uint32_t*>(tokens)[k];
  }

  // Note [Token files cut short]: DataError naming the file and the offset unless the mapped file still
  // holds this part's tokens [0, end). One stat(2); nothing for ids in memory.
  void check_present(int64_t end) const {
    if (file.empty() || storage->map == nullptr) return;
    struct stat st {};
    // Gone, or another file renamed over the path: the mapping still holds the inode it mapped, whole.
    if (::stat(file.c_str(), &st) != 0 || st.st_dev != storage->device || st.st_ino != storage->inode) return;
    const int64_t width = token_bytes(dtype), needed = header_bytes + (first + end) * width;
    if (int64_t(st.st_size) >= needed) [[likely]]
      return;
    const int64_t offset = first + end - 1;
    BOOSTER_FAIL(DataError, "token data: ", file, " was cut short while in use: it holds ", int64_t(st.st_size),
                 " bytes now, ", storage->bytes, " when it was opened, and a batch reads token offset ", offset,
                 " (byte offset ", header_bytes + offset * width,
                 "); restore the file and run again (or resume from a checkpoint). To change a token file under a "
                 "running job, write a new one and rename it over the old (booster tokenize does): the job reads the "
                 "file it opened to the end");
  }
};

namespace {

// One file mapped, its layout and (Note [Token file descriptions]) its dtype checked.
std::shared_ptr<const TokenSource::Part> map_one(const std::string& path, TokenDType dtype) {
  check_data_file(path, "token data: ", "give a token file (booster tokenize writes one)");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  BOOSTER_CHECK(fd >= 0, DataError, "token data: cannot open ", path, ": ", std::strerror(errno),
                "; set data.path (or data.val_path) to a token file (booster tokenize writes one)");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int err = errno;
    ::close(fd);
    BOOSTER_FAIL(DataError, "token data: ", path, " is not a regular file",
                 S_ISDIR(st.st_mode) ? " (a directory)" : err ? std::string(" (") + std::strerror(err) + ")" : "",
                 "; give a token file");
  }
  const int64_t bytes = int64_t(st.st_size);
  auto storage = std::make_shared<Storage>();
  if (bytes > 0) {
    void* map = ::mmap(nullptr, size_t(bytes), PROT_READ, MAP_SHARED, fd, 0);
    const int err = errno;
    ::close(fd);
    BOOSTER_CHECK(map != MAP_FAILED, DataError, "token data: cannot map ", path, " (", bytes,
                  " bytes): ", std::strerror(err));
    storage->map = map;
    storage->bytes = size_t(bytes);
    storage->device = st.st_dev;
    storage->inode = st.st_ino;
    // Samples are read at random offsets: no read-ahead of pages no sample asked for.
    ::madvise(map, size_t(bytes), MADV_RANDOM);
  } else {
    ::close(fd);
  }
  auto part = std::make_shared<TokenSource::Part>();
  part->file = path;
  const auto* base = static_cast<const unsigned char*>(storage->map);
  int32_t first = 0;
  if (bytes >= kLlmcHeaderBytes) std::memcpy(&first, base, 4);
  if (first == kLlmcMagic) {
    int32_t header[256];
    std::memcpy(header, base, sizeof header);
    BOOSTER_CHECK(header[1] == 1, DataError, "token data: ", path, " has llm.c's magic ", kLlmcMagic,
                  " but version ", header[1], " at byte offset 4; only version 1 (uint16 tokens) is known. "
                  "Rewrite it as version 1, or as a flat token file (Note [Token files])");
    const int64_t payload = bytes - kLlmcHeaderBytes;
    BOOSTER_CHECK(header[2] >= 0 && payload % 2 == 0 && int64_t(header[2]) == payload / 2, DataError,
                  "token data: ", path, " is an llm.c shard whose header (byte offset 8) says ", header[2],
                  " tokens, but the file holds ", payload, " bytes after the 1024-byte header",
                  payload % 2 == 0 ? ", " + std::to_string(payload / 2) + " uint16 tokens"
                                   : std::string(", not a whole number of uint16 tokens"),
                  "; the file is truncated or its header is wrong");
    part->dtype = TokenDType::UInt16;
    part->header_bytes = kLlmcHeaderBytes;
    part->n = header[2];
  } else {
    // Note [Token file descriptions]: what the writer said first, so a dtype mistake is named as one
    // rather than as a torn file.
    part->description = read_token_description(path);
    const std::string where = token_description_path(path);
    if (part->description) {
      const TokenFileDescription& d = *part->description;
      BOOSTER_CHECK(d.dtype == dtype, ConfigError, "token data: ", path, " holds ", to_string(d.dtype),
                    " tokens (its description ", where, " says so) but data.dtype is \"", to_string(dtype),
                    "\"; set data.dtype: \"", to_string(d.dtype), "\"");
      BOOSTER_CHECK(d.tokens < 0 || d.tokens * token_bytes(dtype) == bytes, DataError, "token data: ", path,
                    " holds ", bytes, " bytes but its description ", where, " says ", d.tokens, " ", to_string(dtype),
                    " tokens (", d.tokens * token_bytes(dtype), " bytes): the file changed after its description was "
                    "written; write both again (booster tokenize), or delete ", where, " if the file is right");
    } else if (dtype == TokenDType::UInt16 && bytes % 4 == 0) {
      const int64_t sample = std::min<int64_t>(bytes / 2, kDtypeSample);
      BOOSTER_CHECK(!looks_like_uint32(reinterpret_cast<const uint16_t*>(base), sample), ConfigError,
                    "token data: ", path, " looks like uint32 tokens read as uint16: every second uint16 of its first ",
                    sample, " is zero (the high halves of uint32 ids); set data.dtype: \"uint32\" (if it really "
                    "holds uint16 ids, write {\"dtype\": \"uint16\"} to ", where, ")");
    }
    const int64_t width = token_bytes(dtype);
    BOOSTER_CHECK(bytes % width == 0, DataError, "token data: ", path, " holds ", bytes,
                  " bytes, not a whole number of ", to_string(dtype), " tokens (", width,
                  " bytes each; the last token at byte offset ", bytes - bytes % width, " is cut short); check "
                  "data.dtype or whether the file was truncated");
    part->dtype = dtype;
    part->n = bytes / width;
  }
  part->tokens = base ? base + part->header_bytes : nullptr;
  part->storage = std::move(storage);
  return part;
}

// "a.bin", "a.bin, b.bin", or "a.bin .. z.bin (26 files)": the files in messages.
std::string name_files(const std::vector<std::string>& paths) {
  if (paths.size() == 1) return paths[0];
  if (paths.size() <= 3) {
    std::string s;
    for (size_t k = 0; k < paths.size(); ++k) s += (k ? ", " : "") + paths[k];
    return s;
  }
  return paths.front() + " .. " + paths.back() + " (" + std::to_string(paths.size()) + " files)";
}

}  // namespace

std::shared_ptr<const TokenSource> TokenSource::map_file(const std::string& path, TokenDType dtype) {
  return map_files({path}, dtype);
}

std::shared_ptr<const TokenSource> TokenSource::map_files(const std::vector<std::string>& paths, TokenDType dtype) {
  BOOSTER_CHECK(!paths.empty(), ValueError, "TokenSource::map_files: no files; give at least one token file");
  std::shared_ptr<TokenSource> s(new TokenSource());
  s->name_ = name_files(paths);
  for (const std::string& path : paths) {
    auto part = map_one(path, dtype);
    if (!s->parts_.empty()) {
      const Part& head = *s->parts_.front();
      // Note [Token shards]: one dtype for all.
      BOOSTER_CHECK(part->dtype == head.dtype, DataError, "token data: ", path, " holds ", to_string(part->dtype),
                    " tokens", part->header_bytes ? " (an llm.c shard)" : "", " but ", head.file, " holds ",
                    to_string(head.dtype), head.header_bytes ? " (an llm.c shard)" : "",
                    "; the files of one data set share one dtype");
    }
    if (part->description && part->description->vocab_size > s->described_vocab_size_) {
      const TokenFileDescription& d = *part->description;
      s->described_vocab_size_ = d.vocab_size;
      s->described_vocab_ = token_description_path(path) + " says " + path + " was tokenized by " +
                            (d.tokenizer.empty() ? std::string("a tokenizer") : d.tokenizer) + " of " +
                            std::to_string(d.vocab_size) + " ids";
    }
    s->starts_.push_back(s->n_tokens_);
    s->n_tokens_ += part->n;
    s->parts_.push_back(std::move(part));
  }
  s->dtype_ = s->parts_.front()->dtype;
  return s;
}

std::shared_ptr<const TokenSource> TokenSource::from_ids(std::vector<uint32_t> ids, std::string name) {
  std::shared_ptr<TokenSource> s(new TokenSource());
  s->name_ = std::move(name);
  s->dtype_ = TokenDType::UInt32;
  auto storage = std::make_shared<Storage>();
  storage->owned = std::move(ids);
  auto part = std::make_shared<Part>();
  part->tokens = reinterpret_cast<const unsigned char*>(storage->owned.data());
  part->dtype = TokenDType::UInt32;
  part->n = int64_t(storage->owned.size());
  part->storage = std::move(storage);
  s->n_tokens_ = part->n;
  s->starts_.push_back(0);
  s->parts_.push_back(std::move(part));
  return s;
}

TokenSource::~TokenSource() = default;

std::shared_ptr<const TokenSource> TokenSource::slice(int64_t begin, int64_t count, std::string name) const {
  BOOSTER_CHECK(begin >= 0 && count >= 0 && begin + count <= n_tokens_, IndexError, "token data: tokens [", begin,
                ", ", begin + count, ") are outside the ", n_tokens_, " tokens of ", name_);
  std::shared_ptr<TokenSource> s(new TokenSource());
  s->name_ = std::move(name);
  s->dtype_ = dtype_;
  s->described_vocab_size_ = described_vocab_size_;
  s->described_vocab_ = described_vocab_;
  for (size_t k = 0; k < parts_.size(); ++k) {
    const Part& p = *parts_[k];
    const int64_t lo = std::max(begin, starts_[k]), hi = std::min(begin + count, starts_[k] + p.n);
    if (lo >= hi) continue;
    auto part = std::make_shared<Part>(p);
    part->tokens = p.tokens + (lo - starts_[k]) * token_bytes(p.dtype);
    part->first = p.first + (lo - starts_[k]);
    part->n = hi - lo;
    s->starts_.push_back(s->n_tokens_);
    s->n_tokens_ += part->n;
    s->parts_.push_back(std::move(part));
  }
  return s;
}

bool TokenSource::llmc() const {
  return std::any_of(parts_.begin(), parts_.end(), [](const auto& p) { return p->header_bytes > 0; });
}

bool TokenSource::in_memory() const { return !parts_.empty() && parts_.front()->file.empty(); }

std::vector<std::string> TokenSource::files() const {
  std::vector<std::string> out;
  for (const auto& p : parts_)
    if (!p->file.empty() && (out.empty() || out.back() != p->file)) out.push_back(p->file);
  return out;
}

int64_t TokenSource::last_file_tokens() const { return parts_.empty() ? 0 : parts_.back()->n; }

size_t TokenSource::part_of(int64_t index) const {
  if (parts_.size() == 1) return 0;
  return size_t(std::upper_bound(starts_.begin(), starts_.end(), index) - starts_.begin()) - 1;
}

std::string TokenSource::position(int64_t index) const {
  const size_t k = part_of(index);
  const Part& p = *parts_[k];
  const int64_t offset = p.first + index - starts_[k];
  if (p.file.empty()) return "token offset " + std::to_string(offset) + " of " + name_;
  return "token offset " + std::to_string(offset) + " (byte offset " +
         std::to_string(p.header_bytes + offset * token_bytes(p.dtype)) + ") of " + p.file;
}

namespace {

// The copy loop of one dtype: widen to int64 and keep the largest id (the vocabulary check).
template <class T>
uint32_t copy_tokens(const T* src, int64_t count, int64_t* out) {
  uint32_t largest = 0;
  for (int64_t k = 0; k < count; ++k) {
    const uint32_t v = src[k];
    out[k] = int64_t(v);
    largest = std::max(largest, v);
  }
  return largest;
}

template <class T>
int64_t find_past(const T* src, int64_t count, int64_t vocab_size) {
  for (int64_t k = 0; k < count; ++k)
    if (int64_t(src[k]) >= vocab_size) return k;
  return -1;
}

}  // namespace

uint32_t TokenSource::at(int64_t index) const {
  BOOSTER_CHECK(index >= 0 && index < n_tokens_, IndexError, "token data: index ", index, " is outside the ",
                n_tokens_, " tokens of ", name_);
  const size_t k = part_of(index);
  return parts_[k]->at(index - starts_[k]);
}

uint32_t TokenSource::copy(int64_t begin, int64_t count, int64_t* out) const {
  uint32_t largest = 0;
  // A sample may span the end of one file and the start of the next (Note [Token shards]).
  for (size_t k = count > 0 ? part_of(begin) : parts_.size(); count > 0; ++k) {
    const Part& p = *parts_[k];
    const int64_t from = begin - starts_[k], n = std::min(count, p.n - from);
    largest = std::max(largest, p.dtype == TokenDType::UInt16
                                    ? copy_tokens(reinterpret_cast<const uint16_t*>(p.tokens) + from, n, out)
                                    : copy_tokens(reinterpret_cast<const uint32_t*>(p.tokens) + from, n, out));
    begin += n, count -= n, out += n;
  }
  return largest;
}

void TokenSource::check_present(const int64_t* begins, int64_t n, int64_t count) const {
  if (n <= 0 || count <= 0) return;
  if (parts_.size() == 1) {  // one stat for the batch: a truncated file loses its end
    const int64_t end = *std::max_element(begins, begins + n) + count;
    parts_[0]->check_present(end - starts_[0]);
    return;
  }
  for (int64_t i = 0; i < n; ++i)  // one stat per file a sample reads
    for (int64_t begin = begins[i], left = count, k = int64_t(part_of(begin)); left > 0; ++k) {
      const Part& p = *parts_[size_t(k)];
      const int64_t from = begin - starts_[size_t(k)], m = std::min(left, p.n - from);
      p.check_present(from + m);
      begin += m, left -= m;
    }
}

int64_t TokenSource::find_at_least(int64_t begin, int64_t count, int64_t vocab_size) const {
  for (size_t k = count > 0 ? part_of(begin) : parts_.size(); count > 0; ++k) {
    const Part& p = *parts_[k];
    const int64_t from = begin - starts_[k], n = std::min(count, p.n - from);
    const int64_t at = p.dtype == TokenDType::UInt16
                           ? find_past(reinterpret_cast<const uint16_t*>(p.tokens) + from, n, vocab_size)
                           : find_past(reinterpret_cast<const uint32_t*>(p.tokens) + from, n, vocab_size);
    if (at >= 0) return begin + at;
    begin += n, count -= n;
  }
  return -1;
}

// ------------------------------------------------------------------------------------ TokenDataset
TokenDataset::TokenDataset(std::shared_ptr<const TokenSource> source, TokenDatasetOptions options)
    : source_(std::move(source)), options_(options) {
  BOOSTER_CHECK(source_ != nullptr, ValueError, "TokenDataset: no token source");
  BOOSTER_CHECK(options_.seq_len >= 1, ConfigError, "token data: seq_len is ", options_.seq_len,
                "; it must be >= 1");
  if (options_.stride == 0) options_.stride = options_.seq_len;
  BOOSTER_CHECK(options_.stride >= 1, ConfigError, "token data: stride is ", options_.stride, "; it must be >= 1");
  BOOSTER_CHECK(options_.vocab_size >= 0, ConfigError, "token data: vocab_size is ", options_.vocab_size,
                "; it must be >= 0 (0: not checked)");
  const int64_t n = source_->size();
  BOOSTER_CHECK(n >= options_.seq_len + 1, DataError, "token data: ", source_->name(), " holds ", n,
                " tokens, too few for one sample of seq_len ", options_.seq_len, " plus its target; it needs at least ",
                options_.seq_len + 1, " (lower data.seq_len or give a longer file)");
  size_ = (n - 1 - options_.seq_len) / options_.stride + 1;
  // Note [Token file descriptions]: a tokenizer larger than the model gives ids the embedding lacks,
  // sooner or later; refused now, not at the batch that first holds one.
  BOOSTER_CHECK(options_.vocab_size == 0 || source_->described_vocab_size() <= options_.vocab_size, ConfigError,
                "token data: ", source_->described_vocab(), ", more than the model's vocabulary of ",
                options_.vocab_size, " ids; tokenize with the model's tokenizer, or give the model at least ",
                source_->described_vocab_size(), " ids");
  // Note [Checking token ids]: a small file is checked whole now; a large one batch by batch.
  if (options_.vocab_size > 0 && n * token_bytes(source_->dtype()) <= options_.eager_check_bytes &&
      source_->find_at_least(0, n, options_.vocab_size) >= 0)
    fail_vocab(0, n);
}

void TokenDataset::fail_vocab(int64_t begin, int64_t count) const {
  const int64_t at = source_->find_at_least(begin, count, options_.vocab_size);
  BOOSTER_FAIL(DataError, "token data: token id ", source_->at(at), " at ", source_->position(at),
               " is past the model's vocabulary of ", options_.vocab_size,
               " ids; tokenize with the model's tokenizer or raise the model's vocab_size");
}

Batch TokenDataset::get(int64_t i) const { return get_batch({i}); }

Batch TokenDataset::get_batch(const std::vector<int64_t>& indices) const {
  BOOSTER_CHECK(!indices.empty(), ValueError, "TokenDataset::get_batch: no indices; a batch needs at least one");
  const int64_t b = int64_t(indices.size()), T = options_.seq_len;
  Tensor x = Tensor::empty({b, T}, DType::Int64);
  Tensor y = Tensor::empty({b, T}, DType::Int64);
  int64_t* px = x.data<int64_t>();
  int64_t* py = y.data<int64_t>();
  // Note [Token files cut short]: the sample starts, in y's storage until the tokens overwrite them, so
  // the files are checked once for the batch before a token is read.
  for (int64_t k = 0; k < b; ++k) {
    const int64_t i = indices[size_t(k)];
    BOOSTER_CHECK(i >= 0 && i < size_, IndexError, "TokenDataset::get_batch: index ", i,
                  " is out of range for a data set of size ", size_, " (", source_->name(), ")");
    py[k] = i * options_.stride;
  }
  source_->check_present(py, b, T + 1);
  for (int64_t k = 0; k < b; ++k) {
    const int64_t begin = indices[size_t(k)] * options_.stride;
    // x is tokens [begin, begin + T); y the same shifted by one: copy x, then y's last token.
    const uint32_t largest = source_->copy(begin, T, px + k * T);
    std::memcpy(py + k * T, px + k * T + 1, size_t(T - 1) * sizeof(int64_t));
    const uint32_t last = source_->at(begin + T);
    py[k * T + T - 1] = int64_t(last);
    if (options_.vocab_size > 0 && int64_t(std::max(largest, last)) >= options_.vocab_size) fail_vocab(begin, T + 1);
  }
  return {x, y};
}

std::shared_ptr<TokenDataset> token_file_dataset(const std::string& path, TokenDType dtype,
                                                 TokenDatasetOptions options) {
  return std::make_shared<TokenDataset>(TokenSource::map_file(path, dtype), options);
}

std::shared_ptr<TokenDataset> token_files_dataset(const std::vector<std::string>& paths, TokenDType dtype,
                                                  TokenDatasetOptions options) {
  return std::make_shared<TokenDataset>(TokenSource::map_files(paths, dtype), options);
}

void write_token_file(const std::string& path, const std::vector<uint32_t>& ids, TokenDType dtype,
                      const TokenFileDescription& about) {
  const uint64_t limit = dtype == TokenDType::UInt16 ? 0xFFFFu : 0xFFFFFFFFu;
  std::vector<char> bytes(ids.size() * size_t(token_bytes(dtype)));
  for (size_t k = 0; k < ids.size(); ++k) {
    BOOSTER_CHECK(ids[k] <= limit, DataError, "write_token_file: token id ", ids[k], " at token offset ", k,
                  " does not fit ", to_string(dtype), " (", path, "); write uint32 tokens");
    if (dtype == TokenDType::UInt16) {
      const uint16_t v = uint16_t(ids[k]);
      std::memcpy(bytes.data() + 2 * k, &v, 2);
    } else {
      std::memcpy(bytes.data() + 4 * k, &ids[k], 4);
    }
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    BOOSTER_CHECK(out.good(), DataError, "cannot write token file ", path, " (opening ", tmp, ": ",
                  std::strerror(errno), ")");
    out.write(bytes.data(), std::streamsize(bytes.size()));
    out.flush();
    BOOSTER_CHECK(out.good(), DataError, "cannot write token file ", path, " (writing ", bytes.size(), " bytes to ",
                  tmp, ": ", std::strerror(errno), ")");
  }
  // Note [Token file descriptions]: the description is written with the file, so one left from an
  // earlier file of this name never describes this one.
  TokenFileDescription d = about;
  d.dtype = dtype;
  d.tokens = int64_t(ids.size());
  const std::string where = token_description_path(path), where_tmp = where + ".tmp";
  write_description(where_tmp, d);
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  BOOSTER_CHECK(!ec, DataError, "cannot write token file ", path, " (renaming ", tmp, ": ", ec.message(), ")");
  std::filesystem::rename(where_tmp, where, ec);
  BOOSTER_CHECK(!ec, DataError, "cannot write the token file description ", where, " (renaming ", where_tmp, ": ",
                ec.message(), ")");
}

}  // namespace booster::data
