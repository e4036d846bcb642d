// The byte-level BPE tokenizer (booster/data/bpe_tokenizer.h) against a reference written from Hugging
// Face's tokenizer.json format (tests/fixtures/make_bpe_fixtures.py, Python's own regex engine running the
// split patterns): one small trained BPE written as GPT-2, Llama 3 and Qwen2 write theirs, and the ids of
// 400 texts of Unicode letters and marks, CJK, emoji, digits, whitespace runs, contractions and special
// tokens, Qwen2's NFC normalizer by Python's unicodedata, equal exactly; decode(encode(x)) == x (in NFC
// for Qwen2); the pre-tokenizer's pieces on hand-checked cases; the
// special ids; every part of the format it does not apply refused by name.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/common/error.h"
#include "booster/data/bpe_tokenizer.h"
#include "fixture.h"
#include "run_booster.h"

using namespace booster;
using namespace booster::data;
using Catch::Contains;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::string tokenizer_path(const std::string& family) {
  return std::string(BOOSTER_FIXTURE_DIR) + "/bpe/" + family + "/tokenizer.json";
}

json tokenizer_json(const std::string& family) {
  std::ifstream in(tokenizer_path(family));
  REQUIRE(in.good());
  return json::parse(in);
}

// A tokenizer from an edited tokenizer.json, as `family` with `edit` applied.
template <class Edit>
void check_refused(const std::string& family, Edit edit, const std::string& message) {
  json j = tokenizer_json(family);
  edit(j);
  CHECK_THROWS_AS(ByteLevelBPETokenizer(j.dump(), "edited.json"), ConfigError);
  CHECK_THROWS_WITH(ByteLevelBPETokenizer(j.dump(), "edited.json"), Contains(message));
}

std::string show(const std::string& s) { return json(s).dump(); }

}  // namespace

TEST_CASE("bpe tokenizer ids equal the reference's for gpt2, llama3 and qwen2 files", "[data][bpe]") {
  const json expected = booster::testing::load_fixture_json("bpe/expected.json");
  const auto texts = expected.at("texts").get<std::vector<std::string>>();
  REQUIRE(texts.size() >= 400);
  REQUIRE(expected.at("nfc").size() >= 50);
  for (const std::string family : {"gpt2", "llama3", "qwen2"}) {
    INFO(family);
    const ByteLevelBPETokenizer tokenizer(tokenizer_path(family));
    CHECK(tokenizer.vocab_size() == expected.at("vocab_size").at(family).get<int64_t>());
    const auto ids = expected.at("ids").at(family).get<std::vector<std::vector<int>>>();
    REQUIRE(ids.size() == texts.size());
    size_t equal = 0, round_trips = 0;
    for (size_t k = 0; k < texts.size(); ++k) {
      const std::vector<int> got = tokenizer.encode(texts[k]);
      if (got == ids[k]) {
        ++equal;
      } else {
        std::ostringstream pieces;
        for (const std::string& p : tokenizer.pre_tokenize(texts[k])) pieces << show(p) << " ";
        UNSCOPED_INFO("text " << k << " " << show(texts[k]) << ": ids " << json(got).dump() << ", reference "
                              << json(ids[k]).dump() << "; pieces " << pieces.str());
      }
      // Qwen2 gives the text back in NFC.
      const std::string key = std::to_string(k);
      const std::string& back = family == std::string("qwen2") && expected.at("nfc").contains(key)
                                    ? expected.at("nfc").at(key).get_ref<const std::string&>()
                                    : texts[k];
      if (tokenizer.decode(got) == back) ++round_trips;
    }
    CHECK(equal == texts.size());
    CHECK(round_trips == texts.size());
  }
}

TEST_CASE("bpe pre-tokenizer pieces on hand-checked cases", "[data][bpe]") {
  using Pieces = std::vector<std::string>;
  const ByteLevelBPETokenizer gpt2(tokenizer_path("gpt2"));
  const ByteLevelBPETokenizer llama3(tokenizer_path("llama3"));
  const ByteLevelBPETokenizer qwen2(tokenizer_path("qwen2"));
  // \s+(?!\S) leaves the last space of a run to the word after it.
  CHECK(gpt2.pre_tokenize("Hello   world  ") == Pieces{"Hello", "  ", " world", "  "});
  CHECK(gpt2.pre_tokenize("it's IT'S") == Pieces{"it", "'s", " IT", "'", "S"});
  CHECK(llama3.pre_tokenize("it's IT'S") == Pieces{"it", "'s", " IT", "'S"});
  CHECK(gpt2.pre_tokenize("12345 x") == Pieces{"12345", " x"});
  CHECK(llama3.pre_tokenize("12345 x") == Pieces{"123", "45", " x"});
  CHECK(qwen2.pre_tokenize("123") == Pieces{"1", "2", "3"});
  // One non-letter (not a line break) goes with the letters after it; line breaks end punctuation.
  CHECK(llama3.pre_tokenize("(word\tx") == Pieces{"(word", "\tx"});
  CHECK(llama3.pre_tokenize("a.\n\n b") == Pieces{"a", ".\n\n", " b"});
  CHECK(llama3.pre_tokenize("a \n\n  b") == Pieces{"a", " \n\n", " ", " b"});
  CHECK(gpt2.pre_tokenize("a \n\n  b") == Pieces{"a", " \n\n ", " b"});
  // Letters of every script, numbers of every kind; combining marks are neither.
  CHECK(gpt2.pre_tokenize("日本語 ٣٤ Ⅻ") == Pieces{"日本語", " ٣٤", " Ⅻ"});
  CHECK(gpt2.pre_tokenize("cafe\xCC\x81!") == Pieces{"cafe", "\xCC\x81!"});
  CHECK(gpt2.pre_tokenize("").empty());
  // Qwen2 puts the text in NFC first: e + acute composes to a letter; U+0958 is excluded from composition.
  CHECK(qwen2.pre_tokenize("cafe\xCC\x81!") == Pieces{"caf\xC3\xA9", "!"});
  CHECK(qwen2.pre_tokenize("\xE0\xA5\x98") == Pieces{"\xE0\xA4\x95", "\xE0\xA4\xBC"});
}

TEST_CASE("bpe special tokens, special ids and ignore_merges", "[data][bpe]") {
  const ByteLevelBPETokenizer gpt2(tokenizer_path("gpt2"));
  const ByteLevelBPETokenizer llama3(tokenizer_path("llama3"));
  const ByteLevelBPETokenizer qwen2(tokenizer_path("qwen2"));
  const json vocab = tokenizer_json("gpt2").at("model").at("vocab");
  const int n = int(vocab.size());
  CHECK(gpt2.eos_id() == n);
  CHECK(gpt2.bos_id() == -1);
  CHECK(llama3.bos_id() == n);  // the post-processor's first token
  CHECK(llama3.eos_id() == n + 1);
  CHECK(qwen2.eos_id() == n);
  CHECK(qwen2.bos_id() == -1);
  CHECK(gpt2.encode("<|endoftext|>") == std::vector<int>{n});
  CHECK(qwen2.encode("<|im_start|><|im_end|>") == std::vector<int>{n + 1, n + 2});
  CHECK(gpt2.decode({n}) == "<|endoftext|>");
  // Llama 3 reads a word that is a token whole, though no merge makes it; GPT-2 merges it from bytes.
  const int zebra = vocab.at("\xC4\xA0zebra").get<int>();
  CHECK(llama3.encode(" zebra") == std::vector<int>{zebra});
  CHECK(gpt2.encode(" zebra").size() > 1);
  CHECK(gpt2.decode(gpt2.encode(" zebra")) == " zebra");
  // Lines: each line's ids and then the end-of-sequence id.
  std::vector<uint32_t> lines;
  for (int id : gpt2.encode("a b")) lines.push_back(uint32_t(id));
  lines.push_back(uint32_t(n));
  for (int id : gpt2.encode("c")) lines.push_back(uint32_t(id));
  lines.push_back(uint32_t(n));
  CHECK(gpt2.encode_lines("a b\nc") == lines);
  CHECK(gpt2.encode_lines("a b\nc\n") == lines);
  // tokenizer_config.json beside the file names the end-of-sequence token.
  const fs::path dir = ::testing::scratch_dir("test_bpe_tokenizer") / "llama3";
  fs::create_directories(dir);
  fs::copy_file(tokenizer_path("llama3"), dir / "tokenizer.json", fs::copy_options::overwrite_existing);
  std::ofstream(dir / "tokenizer_config.json") << R"({"eos_token": {"content": "<|eot_id|>"}})";
  CHECK(ByteLevelBPETokenizer((dir / "tokenizer.json").string()).eos_id() == n + 3);
  // open_tokenizer chooses by the file's name.
  const auto opened = open_tokenizer(tokenizer_path("qwen2"));
  CHECK(dynamic_cast<const ByteLevelBPETokenizer*>(opened.get()) != nullptr);
}

TEST_CASE("bpe round trip of bytes that are not UTF-8", "[data][bpe]") {
  const ByteLevelBPETokenizer llama3(tokenizer_path("llama3"));
  const ByteLevelBPETokenizer gpt2(tokenizer_path("gpt2"));
  const std::string bytes =
      std::string("ab\xFF\xFE cd\xC3 \xE2\x82 e\xED\xA0\x80 \xC0\xAF") + std::string(1, '\0') + "z";
  CHECK(llama3.decode(llama3.encode(bytes)) == bytes);
  CHECK(gpt2.decode(gpt2.encode(bytes)) == bytes);
  CHECK_THROWS_AS(gpt2.decode({int(gpt2.vocab_size())}), IndexError);
  CHECK_THROWS_AS(gpt2.decode({-1}), IndexError);
}

TEST_CASE("bpe tokenizer refuses what it does not apply, by field", "[data][bpe]") {
  check_refused("gpt2", [](json& j) { j["model"]["type"] = "WordPiece"; }, "model.type");
  check_refused("gpt2", [](json& j) { j["model"]["dropout"] = 0.1; }, "model.dropout");
  check_refused("gpt2", [](json& j) { j["model"]["byte_fallback"] = true; }, "model.byte_fallback");
  check_refused("gpt2", [](json& j) { j["model"]["continuing_subword_prefix"] = "##"; },
                "model.continuing_subword_prefix");
  check_refused("qwen2", [](json& j) { j["normalizer"] = {{"type", "NFKC"}}; }, "normalizer");
  check_refused("gpt2", [](json& j) { j["normalizer"] = {{"type", "Lowercase"}}; }, "normalizer");
  check_refused("gpt2", [](json& j) { j["pre_tokenizer"] = {{"type", "Whitespace"}}; }, "pre_tokenizer.type");
  check_refused("gpt2", [](json& j) { j["pre_tokenizer"] = nullptr; }, "pre_tokenizer");
  check_refused("gpt2", [](json& j) { j["pre_tokenizer"]["add_prefix_space"] = true; },
                "pre_tokenizer.add_prefix_space");
  check_refused("llama3",
                [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\p{L}+|\\s+"; },
                "pre_tokenizer.pretokenizers[0].pattern.Regex");
  check_refused("llama3", [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; },
                "pre_tokenizer.pretokenizers[0].behavior");
  check_refused("llama3", [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["invert"] = true; },
                "pre_tokenizer.pretokenizers[0].invert");
  check_refused("llama3",
                [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"String", " "}}; },
                "pre_tokenizer.pretokenizers[0].pattern");
  check_refused("qwen2", [](json& j) { j["pre_tokenizer"]["pretokenizers"].erase(json::size_type(1)); },
                "has no ByteLevel step");
  check_refused("qwen2", [](json& j) { j["decoder"] = {{"type", "Metaspace"}}; }, "decoder");
  check_refused("gpt2", [](json& j) { j["added_tokens"][0]["lstrip"] = true; }, "added_tokens[0].lstrip");
  check_refused("gpt2", [](json& j) { j["model"]["merges"][3] = "nosuchtoken x"; }, "model.merges[3]");
  check_refused("gpt2", [](json& j) { j["model"]["merges"][5] = "abc"; }, "model.merges[5]");
  check_refused("gpt2", [](json& j) { j["model"]["vocab"].erase("a"); }, "model.vocab");
  CHECK_THROWS_AS(ByteLevelBPETokenizer("{\"model\": ", "broken.json"), DataError);
  CHECK_THROWS_AS(ByteLevelBPETokenizer("/nonexistent/tokenizer.json"), DataError);
}
