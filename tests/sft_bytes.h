// A byte tokenizer for instruction-data tests (booster/data/sft.h): id = byte, bos 1, eos 2, so every id
// of a rendered record is known to a test without a tokenizer file.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "booster/data/sft.h"

namespace testing {

inline booster::data::SftTokenizer byte_sft_tokenizer(int64_t vocab_size = 256) {
  booster::data::SftTokenizer t;
  t.encode = [](std::string_view text) {
    std::vector<int> ids;
    for (const char c : text) ids.push_back(int(uint8_t(c)));
    return ids;
  };
  t.bos_id = 1;
  t.eos_id = 2;
  t.vocab_size = vocab_size;
  t.name = "bytes";
  return t;
}

}  // namespace testing
