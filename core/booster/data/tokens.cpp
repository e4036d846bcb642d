// Token files and the samples cut from them (tokens.h; Note [Token files], Note [Token samples],
// Note [Checking token ids]).
#include "booster/data/tokens.h"

#include <fcntl.h>
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

#include "booster/common/error.h"
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

// ------------------------------------------------------------------------------------ TokenSource
std::shared_ptr<const TokenSource> TokenSource::map_file(const std::string& path, TokenDType dtype) {
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
  std::shared_ptr<TokenSource> s(new TokenSource());
  s->name_ = path;
  if (bytes > 0) {
    void* map = ::mmap(nullptr, size_t(bytes), PROT_READ, MAP_SHARED, fd, 0);
    const int err = errno;
    ::close(fd);
    BOOSTER_CHECK(map != MAP_FAILED, DataError, "token data: cannot map ", path, " (", bytes,
                  " bytes): ", std::strerror(err));
    s->map_ = map;
    s->map_bytes_ = size_t(bytes);
    // Samples are read at random offsets: no read-ahead of pages no sample asked for.
    ::madvise(map, size_t(bytes), MADV_RANDOM);
  } else {
    ::close(fd);
  }
  const auto* base = static_cast<const unsigned char*>(s->map_);
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
    s->dtype_ = TokenDType::UInt16;
    s->header_bytes_ = kLlmcHeaderBytes;
    s->n_tokens_ = header[2];
  } else {
    const int64_t width = token_bytes(dtype);
    BOOSTER_CHECK(bytes % width == 0, DataError, "token data: ", path, " holds ", bytes,
                  " bytes, not a whole number of ", to_string(dtype), " tokens (", width,
                  " bytes each; the last token at byte offset ", bytes - bytes % width, " is cut short); check "
                  "data.dtype or whether the file was truncated");
    s->dtype_ = dtype;
    s->n_tokens_ = bytes / width;
  }
  s->tokens_ = base ? base + s->header_bytes_ : nullptr;
  return s;
}

std::shared_ptr<const TokenSource> TokenSource::from_ids(std::vector<uint32_t> ids, std::string name) {
  std::shared_ptr<TokenSource> s(new TokenSource());
  s->name_ = std::move(name);
  s->dtype_ = TokenDType::UInt32;
  s->owned_ = std::move(ids);
  s->n_tokens_ = int64_t(s->owned_.size());
  s->tokens_ = reinterpret_cast<const unsigned char*>(s->owned_.data());
  return s;
}

TokenSource::~TokenSource() {
  if (map_) ::munmap(map_, map_bytes_);
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
  if (dtype_ == TokenDType::UInt16) return reinterpret_cast<const uint16_t*>(tokens_)[index];
  return reinterpret_cast<const uint32_t*>(tokens_)[index];
}

uint32_t TokenSource::copy(int64_t begin, int64_t count, int64_t* out) const {
  if (dtype_ == TokenDType::UInt16) return copy_tokens(reinterpret_cast<const uint16_t*>(tokens_) + begin, count, out);
  return copy_tokens(reinterpret_cast<const uint32_t*>(tokens_) + begin, count, out);
}

int64_t TokenSource::find_at_least(int64_t begin, int64_t count, int64_t vocab_size) const {
  const int64_t k = dtype_ == TokenDType::UInt16
                        ? find_past(reinterpret_cast<const uint16_t*>(tokens_) + begin, count, vocab_size)
                        : find_past(reinterpret_cast<const uint32_t*>(tokens_) + begin, count, vocab_size);
  return k < 0 ? -1 : begin + k;
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
  // Note [Checking token ids]: a small file is checked whole now; a large one batch by batch.
  if (options_.vocab_size > 0 && n * token_bytes(source_->dtype()) <= options_.eager_check_bytes &&
      source_->find_at_least(0, n, options_.vocab_size) >= 0)
    fail_vocab(0, n);
}

void TokenDataset::fail_vocab(int64_t begin, int64_t count) const {
  const int64_t at = source_->find_at_least(begin, count, options_.vocab_size);
  BOOSTER_FAIL(DataError, "token data: ", source_->name(), " has token id ", source_->at(at), " at token offset ", at,
               source_->in_memory() ? std::string()
                                    : " (byte offset " + std::to_string(source_->byte_offset(at)) + ")",
               ", past the model's vocabulary of ", options_.vocab_size,
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
  for (int64_t k = 0; k < b; ++k) {
    const int64_t i = indices[size_t(k)];
    BOOSTER_CHECK(i >= 0 && i < size_, IndexError, "TokenDataset::get_batch: index ", i,
                  " is out of range for a data set of size ", size_, " (", source_->name(), ")");
    const int64_t begin = i * options_.stride;
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

void write_token_file(const std::string& path, const std::vector<uint32_t>& ids, TokenDType dtype) {
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
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  BOOSTER_CHECK(!ec, DataError, "cannot write token file ", path, " (renaming ", tmp, ": ", ec.message(), ")");
}

}  // namespace booster::data
