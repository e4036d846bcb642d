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

class SentencePieceTokenizer {
 public:
  // Loads `model_path`. DataError naming the file when it is missing or not a SentencePiece model.
  explicit SentencePieceTokenizer(const std::string& model_path);
  ~SentencePieceTokenizer();
  SentencePieceTokenizer(const SentencePieceTokenizer&) = delete;
  SentencePieceTokenizer& operator=(const SentencePieceTokenizer&) = delete;

  int64_t vocab_size() const;
  int64_t eos_id() const;  // -1 when the model has none
  int64_t bos_id() const;  // -1 when the model has none
  const std::string& path() const { return path_; }

  // The ids of one piece of text, without bos/eos.
  std::vector<int> encode(std::string_view text) const;
  std::string decode(const std::vector<int>& ids) const;
  // Note [Encoding a text]; `eos` false leaves the end-of-sentence ids out.
  std::vector<uint32_t> encode_lines(std::string_view text, bool eos = true) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string path_;
};

}  // namespace booster::data
