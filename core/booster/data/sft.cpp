// Instruction data (sft.h): JSONL records, their template rendering with the response mask, and the
// samples the loss sees only the responses of.
#include "booster/data/sft.h"

#include <algorithm>
#include <cstring>
#include <fstream>

#include "booster/common/error.h"
#include "booster/common/json_text.h"
#include "booster/data/tokenizer.h"

namespace booster::data {

using nlohmann::json;

namespace {

constexpr std::string_view kContent = "{content}";
const char* const kTemplateKeys = "'system', 'user', 'assistant', 'bos', 'eos'";

// The template string's text before and after its one "{content}".
std::pair<std::string, std::string> split_template(const std::string& s) {
  const size_t at = s.find(kContent);
  return {s.substr(0, at), s.substr(at + kContent.size())};
}

}  // namespace

ChatTemplate chat_template_from_json(const json& j, const std::string& where) {
  ChatTemplate t;
  if (j.is_null()) return t;
  BOOSTER_CHECK(j.is_object(), ConfigError, "'", where, "' is ", j.dump(),
                "; expected an object of plain strings such as {\"user\": \"[INST] {content} [/INST]\", "
                "\"assistant\": \" {content}\"} (keys ",
                kTemplateKeys, ", all optional)");
  for (const auto& [key, value] : j.items()) {
    const std::string path = "'" + where + "." + key + "'";
    if (key == "bos" || key == "eos") {
      BOOSTER_CHECK(value.is_boolean(), ConfigError, path, " is ", value.dump(), "; expected true or false");
      (key == "bos" ? t.bos : t.eos) = value.get<bool>();
      continue;
    }
    std::string* field = key == "system" ? &t.system : key == "user" ? &t.user : key == "assistant" ? &t.assistant : nullptr;
    BOOSTER_CHECK(field != nullptr, ConfigError, path, " is not a template key; expected one of ", kTemplateKeys);
    BOOSTER_CHECK(value.is_string(), ConfigError, path, " is ", value.dump(),
                  "; expected a string holding {content} where the turn's text goes");
    const std::string s = value.get<std::string>();
    const size_t first = s.find(kContent);
    BOOSTER_CHECK(first != std::string::npos, ConfigError, path, " is ", value.dump(),
                  ", which has no {content}: the turn's text would be lost; put {content} where it goes");
    BOOSTER_CHECK(s.find(kContent, first + 1) == std::string::npos, ConfigError, path, " is ", value.dump(),
                  ", which has {content} more than once; keep one");
    *field = s;
  }
  return t;
}

Conversation parse_sft_record(std::string_view line, const std::string& file, int64_t line_number) {
  if (line.find_first_not_of(" \t\r\n") == std::string_view::npos) return {};
  const std::string at = str("sft data: ", file, " line ", line_number, ": ");
  json j;
  try {
    // The config's depth (Note [One JSON reader] in booster/common/json_text.h); a line as long as it
    // is: the file's size is the data set's.
    j = parse_json_text(line, str("sft data: ", file, " line ", line_number),
                        data_limits(line.size(), "a line of the file"));
  } catch (const JsonSyntaxError& e) {
    BOOSTER_FAIL(DataError, at, "not JSON (", e.detail(), "); each line must be one JSON object");
  } catch (const ConfigError& e) {
    throw DataError(e.what());
  }
  BOOSTER_CHECK(j.is_object(), DataError, at, "a JSON ", j.type_name(),
                ", not an object; expected {\"prompt\", \"response\"} or {\"messages\": [...]}");
  auto text = [&](const json& o, const char* key, const std::string& what) {
    BOOSTER_CHECK(o.contains(key), DataError, at, what, " has no \"", key, "\"");
    BOOSTER_CHECK(o.at(key).is_string(), DataError, at, what, "'s \"", key, "\" is ", o.at(key).type_name(),
                  ", not a string");
    return o.at(key).get<std::string>();
  };
  Conversation turns;
  const bool pair = j.contains("prompt") || j.contains("response");
  if (j.contains("messages")) {
    BOOSTER_CHECK(!pair, DataError, at,
                  "has both \"messages\" and \"prompt\"/\"response\"; give one form of the record");
    const json& messages = j.at("messages");
    BOOSTER_CHECK(messages.is_array() && !messages.empty(), DataError, at, "\"messages\" is ",
                  messages.is_array() ? "empty" : messages.type_name(),
                  "; expected a list of {\"role\", \"content\"} turns");
    for (size_t k = 0; k < messages.size(); ++k) {
      const json& m = messages[k];
      const std::string what = str("message ", k);
      BOOSTER_CHECK(m.is_object(), DataError, at, what, " is a JSON ", m.type_name(),
                    "; expected {\"role\", \"content\"}");
      ChatTurn turn{text(m, "role", what), text(m, "content", what)};
      BOOSTER_CHECK(turn.role == "system" || turn.role == "user" || turn.role == "assistant", DataError, at, what,
                    " has role \"", turn.role, "\"; expected \"system\", \"user\" or \"assistant\"");
      turns.push_back(std::move(turn));
    }
    BOOSTER_CHECK(std::any_of(turns.begin(), turns.end(), [](const ChatTurn& t) { return t.role == "assistant"; }),
                  DataError, at, "the conversation has no \"assistant\" turn, so nothing in it is trained on; "
                  "add the response or leave the record out");
    return turns;
  }
  BOOSTER_CHECK(pair, DataError, at,
                "has neither \"messages\" nor \"prompt\" and \"response\"; expected {\"prompt\": ..., \"response\": "
                "...} or {\"messages\": [{\"role\", \"content\"}, ...]}");
  if (j.contains("system")) turns.push_back({"system", text(j, "system", "the record")});
  turns.push_back({"user", text(j, "prompt", "the record")});
  turns.push_back({"assistant", text(j, "response", "the record")});
  return turns;
}

std::vector<Conversation> read_sft_file(const std::string& path) {
  check_data_file(path, "sft data: ", "set data.path to a JSONL file of records");
  std::ifstream in(path, std::ios::binary);
  BOOSTER_CHECK(in.good(), DataError, "sft data: cannot open '", path, "'; set data.path to a JSONL file of records");
  std::vector<Conversation> records;
  std::string line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    Conversation c = parse_sft_record(line, path, ++n);
    if (!c.empty()) records.push_back(std::move(c));
  }
  BOOSTER_CHECK(!records.empty(), DataError, "sft data: ", path,
                " holds no record; expected one JSON object per line ({\"prompt\", \"response\"} or {\"messages\"})");
  return records;
}

SftTokenizer sft_tokenizer(std::shared_ptr<const Tokenizer> tokenizer) {
  SftTokenizer t;
  t.bos_id = tokenizer->bos_id();
  t.eos_id = tokenizer->eos_id();
  t.vocab_size = tokenizer->vocab_size();
  t.name = tokenizer->path();
  t.encode = [tokenizer](std::string_view text) { return tokenizer->encode(text); };
  return t;
}

RenderedConversation render_conversation(const Conversation& turns, const ChatTemplate& tmpl,
                                         const SftTokenizer& tokenizer) {
  RenderedConversation out;
  std::string prompt;  // prompt text not yet encoded
  auto add = [&](const std::string& text, bool response) {
    if (text.empty()) return;
    for (const int id : tokenizer.encode(text)) {
      out.ids.push_back(id);
      out.response.push_back(response ? 1 : 0);
    }
  };
  if (tmpl.bos && tokenizer.bos_id >= 0) {
    out.ids.push_back(tokenizer.bos_id);
    out.response.push_back(0);
  }
  for (const ChatTurn& turn : turns) {
    const std::string& form = turn.role == "system" ? tmpl.system : turn.role == "user" ? tmpl.user : tmpl.assistant;
    const auto [before, after] = split_template(form);
    if (turn.role != "assistant") {
      prompt += before + turn.content + after;
      continue;
    }
    prompt += before;
    add(prompt, false);
    prompt.clear();
    add(turn.content + after, true);
    if (tmpl.eos && tokenizer.eos_id >= 0) {
      out.ids.push_back(tokenizer.eos_id);
      out.response.push_back(1);
    }
  }
  add(prompt, false);  // turns after the last response: context only
  return out;
}

SftDataset::SftDataset(const std::vector<Conversation>& records, const ChatTemplate& tmpl,
                       const SftTokenizer& tokenizer, SftOptions options, std::string name)
    : options_(options), name_(std::move(name)) {
  BOOSTER_CHECK(options_.seq_len >= 1, ValueError, "SftDataset: seq_len is ", options_.seq_len, "; expected >= 1");
  const int64_t T = options_.seq_len;
  records_ = int64_t(records.size());
  // Note [Packing SFT records]: the row being filled, its ids, document ids and targets.
  std::vector<int64_t> row_x, row_seg, row_y;
  int64_t row_documents = 0;
  auto close_row = [&] {
    if (row_documents == 0) return;
    row_x.resize(size_t(T), options_.pad_id);
    row_seg.resize(size_t(T), row_documents);  // the padding: a document of its own
    row_y.resize(size_t(T), kIgnoreIndex);
    x_.insert(x_.end(), row_x.begin(), row_x.end());
    x_.insert(x_.end(), row_seg.begin(), row_seg.end());
    y_.insert(y_.end(), row_y.begin(), row_y.end());
    row_x.clear(), row_seg.clear(), row_y.clear();
    row_documents = 0;
    ++size_;
  };
  for (const Conversation& record : records) {
    const RenderedConversation r = render_conversation(record, tmpl, tokenizer);
    const int64_t L = int64_t(r.ids.size());
    if (L > T + 1) ++truncated_;
    std::vector<int64_t> x(size_t(T), options_.pad_id), y(size_t(T), kIgnoreIndex);
    int64_t targets = 0;
    for (int64_t i = 0; i < std::min(L, T); ++i) x[size_t(i)] = r.ids[size_t(i)];
    for (int64_t i = 0; i + 1 < std::min(L, T + 1); ++i)
      if (r.response[size_t(i + 1)]) {
        y[size_t(i)] = r.ids[size_t(i + 1)];
        ++targets;
      }
    if (targets == 0) {
      ++dropped_;
      continue;
    }
    response_tokens_ += targets;
    if (options_.packing) {
      // Its positions: every id but the last (which only is a target), at most T.
      const int64_t n = std::min(L - 1, T);
      if (int64_t(row_x.size()) + n > T) close_row();
      row_x.insert(row_x.end(), x.begin(), x.begin() + n);
      row_y.insert(row_y.end(), y.begin(), y.begin() + n);
      row_seg.insert(row_seg.end(), size_t(n), row_documents);
      ++row_documents;
      ++packed_records_;
      continue;
    }
    x_.insert(x_.end(), x.begin(), x.end());
    y_.insert(y_.end(), y.begin(), y.end());
    ++size_;
  }
  close_row();
  BOOSTER_CHECK(size_ > 0, DataError, "sft data: ", name_, ": none of its ", records_,
                " records has a response token within data.seq_len ", T,
                "; raise data.seq_len or shorten the prompts");
}

Batch SftDataset::get(int64_t i) const {
  Batch b = get_batch({i});
  const Shape x_shape = options_.packing ? Shape{2, options_.seq_len} : Shape{options_.seq_len};
  return {b.x.reshape(x_shape), b.y.reshape({options_.seq_len})};
}

Batch SftDataset::get_batch(const std::vector<int64_t>& indices) const {
  const int64_t b = int64_t(indices.size()), T = options_.seq_len, rows = options_.packing ? 2 : 1;
  Tensor x = Tensor::empty(options_.packing ? Shape{b, 2, T} : Shape{b, T}, DType::Int64);
  Tensor y = Tensor::empty({b, T}, DType::Int64);
  for (int64_t k = 0; k < b; ++k) {
    const int64_t i = indices[size_t(k)];
    BOOSTER_CHECK(i >= 0 && i < size_, IndexError, "SftDataset::get_batch: index ", i,
                  " is out of range for a data set of size ", size_, " (", name_, ")");
    std::memcpy(x.data<int64_t>() + k * rows * T, x_.data() + i * rows * T, size_t(rows * T) * sizeof(int64_t));
    std::memcpy(y.data<int64_t>() + k * T, y_.data() + i * T, size_t(T) * sizeof(int64_t));
  }
  return {x, y};
}

std::string SftDataset::describe() const {
  std::string s = str(name_, ": ", records_, " records, ", size_, " samples of seq_len ", options_.seq_len, ", ",
                      response_tokens_, " response tokens");
  if (truncated_ > 0)
    s += str("; ", truncated_, " records truncated at seq_len ", options_.seq_len, " (their tail is not trained on)");
  if (dropped_ > 0) s += str("; ", dropped_, " records left out: no response token within seq_len");
  if (options_.packing) s += str("; ", packed_records_, " records packed into the ", size_, " samples");
  return s;
}

}  // namespace booster::data
