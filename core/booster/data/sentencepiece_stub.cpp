// SentencePieceTokenizer in a build without libsentencepiece (tokenizer.h): every use is a
// NotImplementedError that says what to install. CMake compiles this file or sentencepiece.cpp.
#include "booster/common/error.h"
#include "booster/data/tokenizer.h"

namespace booster::data {

struct SentencePieceTokenizer::Impl {};

SentencePieceTokenizer::SentencePieceTokenizer(const std::string& model_path) : path_(model_path) {
  BOOSTER_FAIL(NotImplementedError, "tokenizer ", model_path,
               ": this booster was built without SentencePiece; install libsentencepiece-dev "
               "(scripts/setup.sh does) and rebuild");
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;
int64_t SentencePieceTokenizer::vocab_size() const { return 0; }
int64_t SentencePieceTokenizer::eos_id() const { return -1; }
int64_t SentencePieceTokenizer::bos_id() const { return -1; }
std::vector<int> SentencePieceTokenizer::encode(std::string_view) const { return {}; }
std::string SentencePieceTokenizer::decode(const std::vector<int>&) const { return {}; }
std::vector<uint32_t> SentencePieceTokenizer::encode_lines(std::string_view, bool) const { return {}; }

}  // namespace booster::data
