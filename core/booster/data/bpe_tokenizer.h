// A Hugging Face tokenizer.json with a byte-level BPE model, as GPT-2, Llama 3 and Qwen2 ship it: the
// text is split at added (special) tokens, each other stretch pre-tokenized by the model's split pattern,
// each piece's UTF-8 bytes mapped to GPT-2's printable byte characters, and the piece's symbols merged
// pair by pair in the order of `model.merges` (the lowest rank first); with Qwen2's NFC normalizer each
// stretch is put in NFC first (Note [NFC] in bpe_tokenizer.cpp). Written from the file format; whatever
// of the format it does not apply (another model type, another normalizer, an unknown pre-tokenizer or
// split pattern, BPE dropout, an added token's lstrip) is a ConfigError naming the field, never a
// silently different tokenization.
//
// Note [Split patterns]
// ~~~~~~~~~~~~~~~~~~~~~
// The patterns are Oniguruma regexes with Unicode classes and a lookahead, which std::regex cannot run.
// The three known ones (GPT-2's, implied by ByteLevel with use_regex true; Llama 3's and Qwen2's, given
// as a Split) are recognized by their exact text and run by a hand-written scanner that tries each
// alternative in the regex's order with the regex's backtracking (bpe_tokenizer.cpp). \p{L} and \p{N}
// are Unicode's general categories (unicode_tables_impl.h), \s Unicode's White_Space property.
//
// Note [Special ids]
// ~~~~~~~~~~~~~~~~~~
// tokenizer.json does not name an end-of-sequence token. eos_id() is tokenizer_config.json's eos_token
// when that file lies beside tokenizer.json, else the first added token among <|endoftext|>,
// <|end_of_text|> and </s>. bos_id() is the token the post-processor puts first (Llama 3's
// <|begin_of_text|>), -1 when it adds none (GPT-2, Qwen2): generation puts it before a prompt when it is
// there. encode() adds neither.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "booster/data/tokenizer.h"

namespace booster::data {

class ByteLevelBPETokenizer : public Tokenizer {
 public:
  // Reads a tokenizer.json file. DataError when it is missing or not JSON; ConfigError naming the field
  // for what it cannot apply.
  explicit ByteLevelBPETokenizer(const std::string& path);
  // From the parsed text of a tokenizer.json; `path` names it in messages.
  ByteLevelBPETokenizer(std::string_view json_text, const std::string& path);
  ~ByteLevelBPETokenizer() override;
  ByteLevelBPETokenizer(const ByteLevelBPETokenizer&) = delete;
  ByteLevelBPETokenizer& operator=(const ByteLevelBPETokenizer&) = delete;

  int64_t vocab_size() const override;  // the largest id (vocabulary or added token) + 1
  int64_t eos_id() const override;      // Note [Special ids]
  int64_t bos_id() const override;
  const std::string& path() const override { return path_; }
  std::vector<int> encode(std::string_view text) const override;
  // Text bytes of the ids; an added token gives its content. IndexError for an id that is no token.
  // decode(encode(x)) == x for any bytes x, with NFC: == x in NFC.
  std::string decode(const std::vector<int>& ids) const override;
  // Note [Encoding a text] (tokenizer.h): each line without its newline, then the eos id, as for
  // SentencePiece, so one line is one document.
  std::vector<uint32_t> encode_lines(std::string_view text, bool eos = true) const override;

  // The pieces the pre-tokenizer splits a text (without added tokens; normalized) into, for tests.
  std::vector<std::string> pre_tokenize(std::string_view text) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string path_;
};

}  // namespace booster::data
