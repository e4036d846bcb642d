// SentencePieceTokenizer over Debian's libsentencepiece (tokenizer.h). Built when CMake finds the
// library; sentencepiece_stub.cpp takes its place otherwise.
#include <sentencepiece_processor.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "booster/common/error.h"
#include "booster/data/dataset.h"
#include "booster/data/tokenizer.h"

namespace booster::data {

struct SentencePieceTokenizer::Impl {
  sentencepiece::SentencePieceProcessor processor;
};

SentencePieceTokenizer::SentencePieceTokenizer(const std::string& model_path)
    : impl_(std::make_unique<Impl>()), path_(model_path) {
  // The library's own message for a missing file is terse; say which key or flag names it.
  check_data_file(model_path, "tokenizer: ", "give a SentencePiece .model file (spm_train --model_prefix=P writes P.model)");
  std::ifstream probe(model_path, std::ios::binary);
  BOOSTER_CHECK(probe.good(), DataError, "tokenizer: cannot open ", model_path, ": ", std::strerror(errno),
                "; give a SentencePiece .model file (spm_train --model_prefix=P writes P.model)");
  const sentencepiece::util::Status status = impl_->processor.Load(model_path);
  // The library's status names its own source lines and protobuf calls: not for a user.
  BOOSTER_CHECK(status.ok(), DataError, "tokenizer: ", model_path,
                " is not a SentencePiece model (it does not parse as one); give the .model file spm_train wrote, "
                "not the .vocab");
  BOOSTER_CHECK(impl_->processor.GetPieceSize() > 0, DataError, "tokenizer: ", model_path,
                " has an empty vocabulary; retrain it with spm_train");
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

int64_t SentencePieceTokenizer::vocab_size() const { return impl_->processor.GetPieceSize(); }
int64_t SentencePieceTokenizer::eos_id() const { return impl_->processor.eos_id(); }
int64_t SentencePieceTokenizer::bos_id() const { return impl_->processor.bos_id(); }

std::vector<int> SentencePieceTokenizer::encode(std::string_view text) const {
  std::vector<int> ids;
  const sentencepiece::util::Status status = impl_->processor.Encode(text, &ids);
  BOOSTER_CHECK(status.ok(), DataError, "tokenizer ", path_, ": cannot encode ", text.size(), " bytes of text (",
                status.ToString(), ")");
  return ids;
}

std::string SentencePieceTokenizer::decode(const std::vector<int>& ids) const {
  std::string text;
  const sentencepiece::util::Status status = impl_->processor.Decode(ids, &text);
  BOOSTER_CHECK(status.ok(), DataError, "tokenizer ", path_, ": cannot decode ", ids.size(), " ids (",
                status.ToString(), "); are they ids of this model (vocabulary ", vocab_size(), ")?");
  return text;
}

// Note [Encoding a text] in tokenizer.h.
std::vector<uint32_t> SentencePieceTokenizer::encode_lines(std::string_view text, bool eos) const {
  std::vector<uint32_t> out;
  out.reserve(text.size() / 3);  // a few bytes per token for a trained model: one growth at most, usually
  const int64_t end_id = eos ? eos_id() : -1;
  std::vector<int> ids;
  size_t begin = 0;
  while (begin < text.size()) {
    size_t newline = text.find('\n', begin);
    if (newline == std::string_view::npos) newline = text.size();
    ids.clear();
    const sentencepiece::util::Status status = impl_->processor.Encode(text.substr(begin, newline - begin), &ids);
    BOOSTER_CHECK(status.ok(), DataError, "tokenizer ", path_, ": cannot encode the line at byte offset ", begin,
                  " (", status.ToString(), ")");
    out.insert(out.end(), ids.begin(), ids.end());
    if (end_id >= 0) out.push_back(uint32_t(end_id));
    begin = newline + 1;
  }
  return out;
}

}  // namespace booster::data
