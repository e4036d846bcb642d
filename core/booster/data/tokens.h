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
//
// Note [Token file descriptions]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A flat file says nothing of its dtype: uint32 ids below 65536 read as uint16 are the ids with a zero
// after each, and a model trains on them without complaint (half its targets are 0). So the writer
// (write_token_file, `booster tokenize`) puts a description beside the file, at `<file>.json`
// (token_description_path):
//     {"format": "booster.tokens", "dtype": "uint16", "tokens": 12345, "vocab_size": 8000,
//      "tokenizer": {"kind": "sentencepiece", "path": "tok.model"}}
// Only "dtype" is required. When a flat file has one, map_file checks it: another data.dtype is a
// ConfigError naming both dtypes and the fix, another number of tokens a DataError (the file was
// rewritten without its description), and a vocab_size above the model's vocabulary is refused by
// TokenDataset (a ConfigError naming the tokenizer). An llm.c shard's header is its description.
// A flat file without one, read as uint16, whose sample (its first kDtypeSample uint16 values, at least
// kDtypeSampleMin of them, a whole number of uint32) has every odd-index value zero and some even-index
// value not zero is refused as "looks like uint32". Real uint16 ids almost never alternate with zero
// hundreds of times over; a file of zeros, or one with zeros here and there, passes. A genuine uint16
// file that trips it gets a description {"dtype": "uint16"} beside it, which the message says.
//
// Note [Token shards]
// ~~~~~~~~~~~~~~~~~~~
// A data set may be several files (data.path as a list, or a glob: shards_0000.bin, shards_0001.bin,
// ...): their tokens, concatenated in the order given (a glob's matches sorted by name), are one stream
// of tokens, so a sample may span the end of one file and the start of the next, as if the files had
// been written as one. Each file is mapped on its own, none copied. All share one dtype (an llm.c shard
// is uint16: mixed with flat uint32 files it is refused). A pattern that names an existing file is that
// file; one with *, ? or [ is a glob, and a glob that matches nothing is a ConfigError naming it; a
// glob's matches that are descriptions of other matches (`x.bin.json` beside `x.bin`) are left out.
// A source's slice (slice()) shares the mappings: data.val_fraction holds out the tail of the last file
// as validation, nanoGPT's split of one file, without a copy.
//
// Note [Token files cut short]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A mapped file truncated while a job reads it (`> train.bin`, `truncate`, a copy over it) makes every
// read of a page past its new end SIGBUS: the job would die without naming the file. So before a batch
// reads any token, get_batch stats each file it reads and compares the size with the end it needs; a
// file cut short is a DataError naming it, the offset the batch reads, and its size then and now. One
// stat(2) per batch for a one-file source (a truncated file loses its end, so the batch's furthest
// sample stands for all), one per sample and file otherwise: about 2 us (measured) against a step's
// milliseconds. A file renamed over the path, or deleted, is not this file: the mapping holds the inode
// it mapped, whole, and reads on (the stat compares device and inode). A truncation in the microseconds
// between the stat and the copy still faults; turning the fault itself into the error would need a
// process-wide SIGBUS handler shared with the flight recorder's and the user's, for that window alone.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
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

// What the writer of a flat token file says of it (Note [Token file descriptions]).
struct TokenFileDescription {
  TokenDType dtype = TokenDType::UInt16;
  int64_t tokens = -1;            // -1: not said
  int64_t vocab_size = 0;         // the tokenizer's vocabulary; 0: not said
  std::string tokenizer;          // the tokenizer's file; "": not said
  std::string tokenizer_kind;     // "sentencepiece"; "": not said
};

// `<path>.json`: where a token file's description lies.
std::string token_description_path(const std::string& path);
// The description beside `path`, or nullopt when there is none. DataError naming the description for
// one that cannot be read or lacks a valid "dtype".
std::optional<TokenFileDescription> read_token_description(const std::string& path);

// The sample the uint32 heuristic reads (Note [Token file descriptions]): the first kDtypeSample uint16
// values, and no verdict on fewer than kDtypeSampleMin.
inline constexpr int64_t kDtypeSample = 65536;
inline constexpr int64_t kDtypeSampleMin = 256;

// The token files that `patterns` name, in order (Note [Token shards]): a pattern naming an existing file
// is that file; one with *, ? or [ is expanded, its matches sorted, descriptions of other matches left
// out. ConfigError naming the pattern when a glob matches nothing or there are no patterns.
std::vector<std::string> token_file_paths(const std::vector<std::string>& patterns);

// Token ids held somewhere: memory-mapped files or a vector. Read-only once made, so the DataLoader's
// worker may read it while the training loop runs.
class TokenSource {
 public:
  // Maps `path` (Note [Token files]); `dtype` is the dtype of a flat file. DataError naming the file for
  // a missing or unreadable file, a size that is not a whole number of tokens, or a lying llm.c header;
  // ConfigError for a dtype its description or its bytes contradict (Note [Token file descriptions]).
  static std::shared_ptr<const TokenSource> map_file(const std::string& path, TokenDType dtype);
  // Several files as one stream of tokens, in order (Note [Token shards]), each mapped as map_file maps
  // it. DataError for files of different dtypes; ValueError for no files.
  static std::shared_ptr<const TokenSource> map_files(const std::vector<std::string>& paths, TokenDType dtype);
  // Ids already in memory (a tokenizer's output); `name` stands for the file in messages.
  static std::shared_ptr<const TokenSource> from_ids(std::vector<uint32_t> ids, std::string name);

  ~TokenSource();
  TokenSource(const TokenSource&) = delete;
  TokenSource& operator=(const TokenSource&) = delete;

  // Tokens [begin, begin + count) of this source as a source of their own, sharing its files (no copy);
  // `name` stands for it in messages.
  std::shared_ptr<const TokenSource> slice(int64_t begin, int64_t count, std::string name) const;

  int64_t size() const { return n_tokens_; }
  TokenDType dtype() const { return dtype_; }
  // Whether any of its files is an llm.c shard.
  bool llmc() const;
  bool in_memory() const;
  const std::string& name() const { return name_; }
  // The files, in order (one for map_file; none in memory).
  std::vector<std::string> files() const;
  // How many tokens the last file gives this source.
  int64_t last_file_tokens() const;
  // Token `index`'s place for a message: "FILE at token offset K (byte offset B)", offsets within FILE.
  std::string position(int64_t index) const;
  // The largest vocabulary the files' descriptions give (0: none says), and the sentence saying where it
  // comes from, for a message.
  int64_t described_vocab_size() const { return described_vocab_size_; }
  const std::string& described_vocab() const { return described_vocab_; }
  // Token `index`, 0 <= index < size().
  uint32_t at(int64_t index) const;
  // Copies tokens [begin, begin + count) into `out` as int64 and returns the largest.
  uint32_t copy(int64_t begin, int64_t count, int64_t* out) const;
  // DataError naming the file and the offset when a mapped file no longer holds tokens [begins[k],
  // begins[k] + count) for some k < n (Note [Token files cut short]).
  void check_present(const int64_t* begins, int64_t n, int64_t count) const;
  // The first index in [begin, begin + count) whose id is >= vocab_size, or -1.
  int64_t find_at_least(int64_t begin, int64_t count, int64_t vocab_size) const;

  // One stretch of tokens of one file (or of the in-memory ids); private to tokens.cpp.
  struct Part;

 private:
  TokenSource() = default;
  // The index in parts_ of the part holding token `index`.
  size_t part_of(int64_t index) const;

  std::string name_;
  TokenDType dtype_ = TokenDType::UInt16;
  int64_t n_tokens_ = 0;
  std::vector<std::shared_ptr<const Part>> parts_;  // in order
  std::vector<int64_t> starts_;                     // parts_[k]'s first index in this source
  int64_t described_vocab_size_ = 0;
  std::string described_vocab_;
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
  // ids]) an id past vocab_size in a source scanned whole; ConfigError when the files' descriptions give
  // a vocabulary larger than vocab_size (Note [Token file descriptions]).
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
// A TokenDataset over several token files as one (TokenSource::map_files, Note [Token shards]).
std::shared_ptr<TokenDataset> token_files_dataset(const std::vector<std::string>& paths, TokenDType dtype,
                                                  TokenDatasetOptions options);

// Writes `ids` as a flat little-endian file of `dtype` (nanoGPT's .bin) and its description beside it
// (Note [Token file descriptions]: the dtype, the number of tokens and what `about` says of the
// tokenizer), atomically enough for a data file: each to a .tmp, then renamed. DataError naming the file
// for an id the dtype cannot hold or a failed write.
void write_token_file(const std::string& path, const std::vector<uint32_t>& ids, TokenDType dtype,
                      const TokenFileDescription& about = {});

}  // namespace booster::data
