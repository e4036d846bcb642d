// Tokenizers: the interface `booster tokenize`, text data's `tokenizer` key and `booster generate` use,
// and open_tokenizer() choosing the implementation by file: a Hugging Face tokenizer.json (byte-level
// BPE: GPT-2, Llama 3, Qwen2; bpe_tokenizer.h) or a SentencePiece .model.
//
// A SentencePiece tokenizer (Llama's format: a .model file made by spm_train), through Debian's
// libsentencepiece. Used by `booster tokenize` and by text data with a `tokenizer` key. The library is a
// private dependency of libbooster_core: this header does not include it, so a program built against an
// installed booster needs no SentencePiece headers. A build without it has a stub whose constructor
// throws NotImplementedError saying what to install.
//
// Note [Encoding a text]
// ~~~~~~~~~~~~~~~~~~~~~~
// encode_lines() encodes a text line by line, as `spm_encode` does, each line's ids followed by the
// model's end-of-sentence id (`</s>`, when the model has one) so that line ends survive tokenization
// (SentencePiece's normalization would otherwise fold a newline into a space). The result is the ids of
// `spm_encode --output_format=id --extra_options=eos`, concatenated: an external reference the tests
// compare against. A last line without a newline counts as a line; the empty string after a final
// newline does not.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace booster::data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t eos_id() const = 0;  // -1 when the model has none
  virtual int64_t bos_id() const = 0;  // -1 when the model has none
  virtual const std::string& path() const = 0;
  // The ids of one piece of text, without bos/eos.
  virtual std::vector<int> encode(std::string_view text) const = 0;
  virtual std::string decode(const std::vector<int>& ids) const = 0;
  // Note [Encoding a text]; `eos` false leaves the end-of-sentence ids out.
  virtual std::vector<uint32_t> encode_lines(std::string_view text, bool eos = true) const = 0;
};

// A file ending in .json is a Hugging Face tokenizer.json (ByteLevelBPETokenizer), anything else a
// SentencePiece model. Errors as the constructors throw them.
std::unique_ptr<Tokenizer> open_tokenizer(const std::string& path);

class SentencePieceTokenizer : public Tokenizer {
 public:
  // Loads `model_path`. DataError naming the file when it is missing or not a SentencePiece model.
  explicit SentencePieceTokenizer(const std::string& model_path);
  ~SentencePieceTokenizer();
  SentencePieceTokenizer(const SentencePieceTokenizer&) = delete;
  SentencePieceTokenizer& operator=(const SentencePieceTokenizer&) = delete;

  int64_t vocab_size() const override;
  int64_t eos_id() const override;
  int64_t bos_id() const override;
  const std::string& path() const override { return path_; }
  std::vector<int> encode(std::string_view text) const override;
  std::string decode(const std::vector<int>& ids) const override;
  std::vector<uint32_t> encode_lines(std::string_view text, bool eos = true) const override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string path_;
};

}  // namespace booster::data
