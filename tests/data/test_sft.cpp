// Instruction data (booster/data/sft.h): the template's rendering and the response mask checked by hand,
// the masked cross-entropy of a tiny Llama against a float64 reference summed over the response
// positions only, truncation and padding, and every bad record and bad template with its message.
// A byte tokenizer (id = byte, bos 1, eos 2) stands in for SentencePiece so that every id is known here.
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/common/error.h"
#include "booster/config/training.h"
#include "booster/data/sft.h"
#include "booster/nn/model_registry.h"
#include "booster/ops/ops.h"
#include "run_booster.h"
#include "sft_bytes.h"

using namespace booster;
using namespace booster::data;
using Catch::Contains;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

fs::path scratch(const std::string& name) { return testing::scratch_dir("test_sft") / name; }

SftTokenizer byte_tokenizer() { return ::testing::byte_sft_tokenizer(); }

std::vector<int64_t> bytes_of(const std::string& s) {
  std::vector<int64_t> ids;
  for (const char c : s) ids.push_back(int64_t(uint8_t(c)));
  return ids;
}

fs::path write_lines(const std::string& name, const std::vector<std::string>& lines) {
  const fs::path p = scratch(name);
  std::ofstream out(p);
  for (const std::string& l : lines) out << l << "\n";
  return p;
}

template <class E>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  FAIL("no error was thrown");
  return "";
}

const ChatTemplate kTemplate =
    chat_template_from_json({{"system", "S:{content}|"}, {"user", "U:{content}|"}, {"assistant", "A:{content}!"}});

}  // namespace

TEST_CASE("sft: a prompt and response render as the template says, the mask exactly the response", "[data][sft]") {
  const Conversation c = parse_sft_record(R"({"prompt": "hi", "response": "yo", "id": 7})", "f.jsonl", 1);
  const RenderedConversation r = render_conversation(c, kTemplate, byte_tokenizer());
  // bos, then "U:hi|A:" (prompt), "yo!" and eos (response).
  std::vector<int64_t> ids = {1};
  for (int64_t id : bytes_of("U:hi|A:yo!")) ids.push_back(id);
  ids.push_back(2);
  CHECK(r.ids == ids);
  CHECK(r.response == std::vector<uint8_t>{0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1});

  // As a sample of 16: x the ids then pads (0); y the next id where it is a response token.
  const SftDataset d({c}, kTemplate, byte_tokenizer(), {.seq_len = 16}, "f.jsonl");
  REQUIRE(d.size() == 1);
  const Batch b = d.get(0);
  REQUIRE(b.x.shape() == Shape{16});
  std::vector<int64_t> x(ids), y(16, kIgnoreIndex);
  x.resize(16, 0);
  for (int t = 7; t < 11; ++t) y[size_t(t)] = ids[size_t(t + 1)];  // targets 'y', 'o', '!', eos
  CHECK(std::vector<int64_t>(b.x.data<int64_t>(), b.x.data<int64_t>() + 16) == x);
  CHECK(std::vector<int64_t>(b.y.data<int64_t>(), b.y.data<int64_t>() + 16) == y);
  CHECK(d.response_tokens() == 4);
  CHECK(d.truncated() == 0);

  // Without bos and eos, and with a system turn in the prompt form.
  const ChatTemplate plain = chat_template_from_json({{"user", "U:{content}|"}, {"assistant", "A:{content}!"},
                                                     {"system", "S:{content}|"}, {"bos", false}, {"eos", false}});
  const RenderedConversation p = render_conversation(
      parse_sft_record(R"({"system": "be", "prompt": "hi", "response": "yo"})", "f.jsonl", 1), plain, byte_tokenizer());
  CHECK(p.ids == bytes_of("S:be|U:hi|A:yo!"));
  CHECK(p.response == std::vector<uint8_t>{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1});
}

TEST_CASE("sft: a conversation of several turns trains on every assistant turn and nothing else", "[data][sft]") {
  const Conversation c = parse_sft_record(
      R"({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},)"
      R"( {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},)"
      R"( {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"}]})",
      "f.jsonl", 1);
  REQUIRE(c.size() == 6);
  const RenderedConversation r = render_conversation(c, kTemplate, byte_tokenizer());
  // bos S:s|U:a|A: b! eos U:c|A: d! eos U:e|
  std::vector<int64_t> ids = {1};
  std::vector<uint8_t> mask = {0};
  auto add = [&](const std::string& s, bool response) {
    for (int64_t id : bytes_of(s)) ids.push_back(id), mask.push_back(response);
  };
  add("S:s|U:a|A:", false);
  add("b!", true);
  ids.push_back(2), mask.push_back(1);
  add("U:c|A:", false);
  add("d!", true);
  ids.push_back(2), mask.push_back(1);
  add("U:e|", false);
  CHECK(r.ids == ids);
  CHECK(r.response == mask);
}

TEST_CASE("sft: the masked loss of a tiny Llama equals a float64 sum over the response positions only",
          "[data][sft]") {
  // Prompts of varied lengths, one record long enough to be cut at seq_len 24, one whose response lies
  // wholly past it (left out).
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"a", "one"}, {"what is two", "2"}, {"say hello", "hello"}, {"abcdefghij", "klmnopqrstuvwxyz0123"},
      {"q", "r"},   {"a prompt far longer than the whole of seq_len allows", "lost"}};
  std::vector<std::string> lines;
  for (const auto& [p, r] : pairs) lines.push_back(json{{"prompt", p}, {"response", r}}.dump());
  const fs::path file = write_lines("varied.jsonl", lines);
  const std::vector<Conversation> records = read_sft_file(file.string());
  REQUIRE(records.size() == pairs.size());
  const int64_t T = 24;
  const SftDataset d(records, kTemplate, byte_tokenizer(), {.seq_len = T}, file.string());
  CHECK(d.records() == 6);
  CHECK(d.size() == 5);
  CHECK(d.truncated() == 2);  // "abcdefghij" (38 ids: bos, 15 of prompt, 21 of response, eos) and the long prompt
  CHECK(d.dropped() == 1);
  CHECK_THAT(d.describe(), Contains("2 records truncated at seq_len 24"));
  CHECK_THAT(d.describe(), Contains("1 records left out"));

  const json model_cfg = {{"type", "llama"},          {"vocab_size", 256},         {"hidden_size", 16},
                          {"intermediate_size", 24},  {"num_hidden_layers", 1},    {"num_attention_heads", 2},
                          {"num_key_value_heads", 2}, {"max_position_embeddings", 32}};
  const nn::ModulePtr model = nn::make_model(model_cfg, 5);
  const Batch b = d.get_batch({0, 1, 2, 3, 4});
  const Tensor logits = model->forward(b.x);
  REQUIRE(logits.shape() == Shape{5, T, 256});
  const nn::Criterion criterion =
      config::make_criterion({{"type", "cross_entropy"}, {"label_smoothing", 0.0}, {"ignore_index", -100}});
  const double loss = criterion(logits, b.y).to(DType::Float64).item<double>();

  // The reference: targets from the strings (response positions t with t + 1 in [start, end) of the
  // record's ids), cross-entropy in float64 from the logits, summed and divided by their number.
  const Tensor lg = logits.to(DType::Float64).contiguous();
  const double* L = lg.data<double>();
  const int64_t* x = b.x.data<int64_t>();
  double sum = 0;
  int64_t count = 0;
  for (int64_t k = 0; k < 5; ++k) {
    const auto& [prompt, response] = pairs[size_t(k)];
    std::vector<int64_t> ids = {1};
    for (int64_t id : bytes_of("U:" + prompt + "|A:" + response + "!")) ids.push_back(id);
    ids.push_back(2);
    const int64_t start = 1 + int64_t(prompt.size()) + 5;  // bos, "U:", prompt, "|A:"
    for (int64_t t = 0; t < T; ++t) {
      if (t < int64_t(ids.size())) CHECK(x[k * T + t] == ids[size_t(t)]);
      if (t + 1 < start || t + 1 >= int64_t(ids.size())) continue;
      const double* row = L + (k * T + t) * 256;
      double m = row[0];
      for (int c = 1; c < 256; ++c) m = std::max(m, row[c]);
      double z = 0;
      for (int c = 0; c < 256; ++c) z += std::exp(row[c] - m);
      sum += m + std::log(z) - row[ids[size_t(t + 1)]];
      ++count;
    }
  }
  CHECK(count == d.response_tokens());
  // "one!" and eos, "2!" and eos, "hello!" and eos, ids 16..24 of the cut one, "r!" and eos.
  CHECK(count == 5 + 3 + 7 + 9 + 3);
  // float32 logits and a float32 log-softmax over 256 classes: a few ulps of a value near log(256).
  CHECK(loss == Approx(sum / double(count)).epsilon(1e-5));

  // An unmasked loss over the same positions differs: the mask matters.
  Tensor all_y = b.y.clone();
  int64_t* py = all_y.data<int64_t>();
  for (int64_t i = 0; i < 5 * T; ++i)
    if (py[i] == kIgnoreIndex) py[i] = 0;
  CHECK(std::abs(criterion(logits, all_y).to(DType::Float64).item<double>() - loss) > 1e-3);
}

TEST_CASE("sft: a bad record is a DataError naming the file, the line and the fix", "[data][sft]") {
  struct Case {
    std::string line;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {R"({"prompt": "a", "response": )", {"not JSON", "one JSON object"}},
      {R"(["a", "b"])", {"array, not an object"}},
      {R"({"prompt": "a"})", {"has no \"response\""}},
      {R"({"response": "a"})", {"has no \"prompt\""}},
      {R"({"prompt": "a", "response": 3})", {"\"response\" is number, not a string"}},
      {R"({"question": "a", "answer": "b"})", {"neither \"messages\" nor \"prompt\" and \"response\""}},
      {R"({"messages": [{"role": "user", "content": "a"}], "prompt": "a", "response": "b"})", {"give one form"}},
      {R"({"messages": []})", {"\"messages\" is empty"}},
      {R"({"messages": [{"role": "tool", "content": "a"}, {"role": "assistant", "content": "b"}]})",
       {"message 0 has role \"tool\"", "expected \"system\", \"user\" or \"assistant\""}},
      {R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]})", {"message 1 has no \"content\""}},
      {R"({"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]})",
       {"no \"assistant\" turn"}},
  };
  for (const Case& c : cases) {
    INFO(c.line);
    // A good line, a blank one, then the bad one: line 3.
    const fs::path file = write_lines("bad.jsonl", {R"({"prompt": "a", "response": "b"})", "", c.line});
    const std::string what = error_of<DataError>([&] { read_sft_file(file.string()); });
    CHECK_THAT(what, Contains(file.string() + " line 3: "));
    for (const std::string& e : c.expect) CHECK_THAT(what, Contains(e));
  }
  const fs::path empty = write_lines("empty.jsonl", {"", "  "});
  CHECK_THAT(error_of<DataError>([&] { read_sft_file(empty.string()); }), Contains("holds no record"));
  CHECK_THAT(error_of<DataError>([&] { read_sft_file(scratch("absent.jsonl").string()); }),
             Contains("cannot open"));
  // A file whose every response lies past seq_len.
  const std::vector<Conversation> one = {parse_sft_record(R"({"prompt": "abcdef", "response": "b"})", "f", 1)};
  CHECK_THAT(error_of<DataError>([&] { SftDataset(one, kTemplate, byte_tokenizer(), {.seq_len = 4}, "f"); }),
             Contains("raise data.seq_len"));
}

TEST_CASE("sft: a bad template is a ConfigError naming its key", "[data][sft]") {
  struct Case {
    json tmpl;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {{{"assistant", "[/INST]"}}, {"'data.template.assistant'", "has no {content}"}},
      {{{"user", "{content}{content}"}}, {"'data.template.user'", "more than once"}},
      {{{"System", "{content}"}}, {"'data.template.System' is not a template key", "'system'"}},
      {{{"user", 3}}, {"'data.template.user' is 3", "a string"}},
      {{{"eos", "yes"}}, {"'data.template.eos'", "true or false"}},
      {json::array({"x"}), {"'data.template' is [\"x\"]", "expected an object"}},
  };
  for (const Case& c : cases) {
    INFO(c.tmpl.dump());
    const std::string what = error_of<ConfigError>([&] { chat_template_from_json(c.tmpl); });
    for (const std::string& e : c.expect) CHECK_THAT(what, Contains(e));
  }
  // The defaults, and a key given keeps the others' defaults.
  const ChatTemplate d = chat_template_from_json(json::object());
  CHECK(d.user == "### Instruction:\n{content}\n\n");
  CHECK(d.bos);
  const ChatTemplate m = chat_template_from_json({{"user", "[INST] {content} [/INST]"}});
  CHECK(m.user == "[INST] {content} [/INST]");
  CHECK(m.assistant == ChatTemplate{}.assistant);
}
