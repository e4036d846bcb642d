// Token data for language models: a long array of token ids cut into samples of `seq_len` tokens and
// the next one, as nanoGPT and llm.c train on. The `booster` command's data type "tokens", and the
// in-memory token stream of "text" data with a tokenizer.
//
// Note [Token files]
// ~~~~~~~~~~~~~~~~~~
// Two layouts are read, both little-endian:
//   * a flat array of token ids, nothing else (nanoGPT's train.bin / val.bin), uint16 or uint32 as the
//     caller says (data.dtype);
//   * llm.c's shard: a header of 256 int32 (header[0] the magic 20240520, header[1] the version, which
//     must be 1: uint16 tokens; header[2] the number of tokens), the tokens from byte 1024 on.
// Rule: a file of at least 1024 bytes whose first int32 is 20240520 is an llm.c shard, and its dtype
// comes from the header (data.dtype is not consulted). Its header must then tell the truth: version 1,
// and exactly header[2] uint16 tokens after it; anything else is a DataError, never a silent fallback
// to a flat file. (A flat uint16 file would have to begin with tokens 54472, 308 to be taken for a
// shard; for uint32 the first token would be 20240520. Neither is a plausible vocabulary.) Every other
// file is flat and must hold a whole number of tokens.
// The file is memory-mapped, never read whole: a sample touches its own T + 1 tokens, so a data set far
// larger than memory trains in the page cache.
//
// Note [Token samples]
// ~~~~~~~~~~~~~~~~~~~~
// Sample i starts at token i * stride: x = tokens[i*stride, i*stride + T) and y = tokens[i*stride + 1,
// i*stride + T + 1), both int64 [T], as CharDataset gives the GPT and the cross-entropy criterion.
// Token files use stride = T (non-overlapping samples, nanoGPT's evaluation and llm.c's loader), so there
// are (n_tokens - 1) / T samples; text data with a tokenizer uses stride 1 (every window, as with bytes).
// The order of samples, shuffling, data-parallel shares and resuming are the DataLoader's and its
// samplers' (Note [Deterministic shuffling], Note [Data-parallel loaders]): a sample is an index.
//
// Note [Checking token ids]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A token id >= the model's vocabulary would index past the embedding. With `vocab_size` given, every
// batch checks the ids it copies (one compare per token, in the copy loop) and a bad one is a DataError
// naming the file and the token's offset; a file up to `eager_check_bytes` is also scanned whole when
// the data set is made, so `booster check` and the first step report it before any training. A larger
// file is checked batch by batch only, so nothing reads it whole.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "booster/data/dataset.h"

namespace booster::data {

enum class TokenDType { UInt16, UInt32 };

// "uint16" or "uint32"; ConfigError otherwise.
TokenDType token_dtype_from_string(const std::string& name);
const char* to_string(TokenDType dtype);
inline int64_t token_bytes(TokenDType dtype) { return dtype == TokenDType::UInt16 ? 2 : 4; }

inline constexpr int32_t kLlmcMagic = 20240520;
inline constexpr int64_t kLlmcHeaderBytes = 256 * 4;

// Token ids held somewhere: a memory-mapped file or a vector. Read-only once made, so the DataLoader's
// worker may read it while the training loop runs.
class TokenSource {
 public:
  // Maps `path` (Note [Token files]); `dtype` is the dtype of a flat file. DataError naming the file for
  // a missing or unreadable file, a size that is not a whole number of tokens, or a lying llm.c header.
  static std::shared_ptr<const TokenSource> map_file(const std::string& path, TokenDType dtype);
  // Ids already in memory (a tokenizer's output); `name` stands for the file in messages.
  static std::shared_ptr<const TokenSource> from_ids(std::vector<uint32_t> ids, std::string name);

  ~TokenSource();
  TokenSource(const TokenSource&) = delete;
  TokenSource& operator=(const TokenSource&) = delete;

  int64_t size() const { return n_tokens_; }
  TokenDType dtype() const { return dtype_; }
  bool llmc() const { return header_bytes_ > 0; }
  bool in_memory() const { return map_ == nullptr && !owned_.empty(); }
  const std::string& name() const { return name_; }
  // The byte offset of token `index` in the file (after an llm.c header).
  int64_t byte_offset(int64_t index) const { return header_bytes_ + index * token_bytes(dtype_); }
  // Token `index`, 0 <= index < size().
  uint32_t at(int64_t index) const;
  // Copies tokens [begin, begin + count) into `out` as int64 and returns the largest.
  uint32_t copy(int64_t begin, int64_t count, int64_t* out) const;
  // The first index in [begin, begin + count) whose id is >= vocab_size, or -1.
  int64_t find_at_least(int64_t begin, int64_t count, int64_t vocab_size) const;

 private:
  TokenSource() = default;
  std::string name_;
  TokenDType dtype_ = TokenDType::UInt16;
  int64_t n_tokens_ = 0;
  int64_t header_bytes_ = 0;
  const unsigned char* tokens_ = nullptr;  // the first token
  void* map_ = nullptr;                    // the mapping, when mapped
  size_t map_bytes_ = 0;
  std::vector<uint32_t> owned_;  // the ids, when in memory
};

struct TokenDatasetOptions {
  int64_t seq_len = 128;  // T: inputs per sample
  int64_t stride = 0;     // tokens between sample starts; 0: seq_len (Note [Token samples])
  // The model's vocabulary: ids must be below it (Note [Checking token ids]); 0: not checked.
  int64_t vocab_size = 0;
  // With vocab_size, a source of at most this many bytes is scanned whole when the data set is made.
  int64_t eager_check_bytes = int64_t(64) << 20;
};

// Samples of a token source (Note [Token samples]).
class TokenDataset : public Dataset {
 public:
  // DataError naming the source when it holds fewer than seq_len + 1 tokens, or (Note [Checking token
  // ids]) an id past vocab_size in a source scanned whole.
  TokenDataset(std::shared_ptr<const TokenSource> source, TokenDatasetOptions options);

  int64_t size() const override { return size_; }
  Batch get(int64_t i) const override;
  // x and y int64 [B, T], written straight from the source; DataError for an id past vocab_size.
  Batch get_batch(const std::vector<int64_t>& indices) const override;

  const TokenSource& source() const { return *source_; }
  int64_t seq_len() const { return options_.seq_len; }
  int64_t stride() const { return options_.stride; }
  int64_t vocab_size() const { return options_.vocab_size; }

 private:
  // Fails with the DataError of the first id >= vocab_size in [begin, begin + count).
  [[noreturn]] void fail_vocab(int64_t begin, int64_t count) const;

  std::shared_ptr<const TokenSource> source_;
  TokenDatasetOptions options_;
  int64_t size_ = 0;
};

// A TokenDataset over a token file (TokenSource::map_file).
std::shared_ptr<TokenDataset> token_file_dataset(const std::string& path, TokenDType dtype,
                                                 TokenDatasetOptions options);

// Writes `ids` as a flat little-endian file of `dtype` (nanoGPT's .bin), atomically enough for a data
// file: to `path`.tmp, then renamed. DataError naming the file for an id the dtype cannot hold or a
// failed write.
void write_token_file(const std::string& path, const std::vector<uint32_t>& ids, TokenDType dtype);

}  // namespace booster::data
