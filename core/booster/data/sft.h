// Instruction data for supervised fine-tuning (the `booster` command's data type "sft"): a JSONL file of
// conversations, rendered by a template of plain strings, tokenized, cut or padded to seq_len, with the
// loss on the response (assistant) tokens only: every other target is kIgnoreIndex, which the
// cross-entropy skips. A training step's loss is the mean over the response tokens of the whole global
// batch, whatever its split into micro-batches and ranks (Note [The token mean of a global batch] in
// booster/trainer/trainer.cpp; config::DataSplits::token_mean_ignore_index asks the Trainer for it).
//
// Note [SFT records]
// ~~~~~~~~~~~~~~~~~~
// Each non-blank line of the file is one JSON object, in one of two forms:
//     {"prompt": "...", "response": "...", "system": "..."}          (system optional)
//     {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}
// The first is the conversation [system?, user: prompt, assistant: response]. Other keys are ignored
// (data sets carry ids and sources). A line that is not JSON, not an object, has both forms or neither,
// a field that is missing or not a string, an unknown role or no assistant turn is a DataError naming
// the file, the line and the fix.
//
// Note [SFT templates]
// ~~~~~~~~~~~~~~~~~~~~
// data.template is an object of plain strings (no Jinja), every key optional:
//     {"system": "{content}\n\n", "user": "### Instruction:\n{content}\n\n",
//      "assistant": "### Response:\n{content}", "bos": true, "eos": true}
// (the defaults shown). Each of system, user, assistant holds "{content}" exactly once, where the turn's
// text goes. A conversation is its turns' renderings in order. The loss covers the assistant turns'
// {content} and the text after it; the text before it (a "[/INST]"-like header) and the system and user
// turns are prompt. "bos": the tokenizer's beginning-of-sentence id first (when it has one); "eos": its
// end-of-sentence id after each assistant turn, trained, so the model learns to stop. (SentencePiece
// reads "</s>" written in a template as text, not as the id: use "eos".) Each run of prompt text and
// each assistant turn's trained text is encoded as one string, so the mask is exact at their borders.
// A template that is not an object, an unknown key, a value of the wrong type or a string without
// "{content}" (or with it twice) is a ConfigError naming 'data.template.<key>'.
//
// Note [SFT samples]
// ~~~~~~~~~~~~~~~~~~
// A record's ids t_0 .. t_{L-1} give one sample of seq_len T: x[i] = t_i and y[i] = t_{i+1} when t_{i+1}
// is a response token, else kIgnoreIndex. A record of more than T + 1 ids is cut to T + 1 (counted in
// truncated()); one shorter is padded: x with pad_id, y with kIgnoreIndex, so a causal model's earlier
// positions do not see the padding and the loss does not count it. A record with no response target
// left within T is left out (counted in dropped()): it would add nothing to the loss.
//
// Note [Packing SFT records]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// With SftOptions::packing (data.packing) a sample holds several records: greedily in file order (next
// fit: a record goes into the current sequence when its positions fit in what is left, else it starts
// the next one; no reordering, so the samples follow the file). A record takes min(L - 1, T) positions,
// its ids but the last, which is only ever a target; a longer record is cut and counted as above and
// fills a sequence alone. x is then the packed input [2, T] of Note [Packed sequences] in
// booster/nn/packing.h: its ids and each position's record number in the sequence (0, 1, ...; the
// padding at the end one more), from which a model restarts the positions at each record and keeps
// attention within it; y as above. A record's targets and logits are those it has alone, so with the
// loss the token mean of the global batch the packed run's loss is the records' one by one.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/data/dataset.h"

namespace booster::data {

class Tokenizer;

// The target of a position the loss skips: cross_entropy's default ignore_index, as PyTorch's.
inline constexpr int64_t kIgnoreIndex = -100;

// Note [SFT templates].
struct ChatTemplate {
  std::string system = "{content}\n\n";
  std::string user = "### Instruction:\n{content}\n\n";
  std::string assistant = "### Response:\n{content}";
  bool bos = true;
  bool eos = true;
};

// The template of data.template (`where` names it in messages); ConfigError naming the key.
ChatTemplate chat_template_from_json(const nlohmann::json& j, const std::string& where = "data.template");

struct ChatTurn {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};
using Conversation = std::vector<ChatTurn>;

// One line of an sft file (Note [SFT records]); nullopt-like empty conversation for a blank line.
// DataError "sft data: FILE line N: ..." for a bad one.
Conversation parse_sft_record(std::string_view line, const std::string& file, int64_t line_number);
// Every record of the JSONL file `path`, in order. DataError naming the file for one that cannot be
// read or holds no record, and naming the line for a bad record.
std::vector<Conversation> read_sft_file(const std::string& path);

// What the data needs of a tokenizer: text to ids, and its special ids (-1: none).
struct SftTokenizer {
  std::function<std::vector<int>(std::string_view)> encode;
  int64_t bos_id = -1;
  int64_t eos_id = -1;
  int64_t vocab_size = 0;
  std::string name;  // its file, for messages
};
// Any tokenizer open_tokenizer() opens (a SentencePiece .model or a tokenizer.json).
SftTokenizer sft_tokenizer(std::shared_ptr<const Tokenizer> tokenizer);

// A conversation's ids, and for each whether it is a response token (Note [SFT templates]).
struct RenderedConversation {
  std::vector<int64_t> ids;
  std::vector<uint8_t> response;
};
RenderedConversation render_conversation(const Conversation& turns, const ChatTemplate& tmpl,
                                         const SftTokenizer& tokenizer);

struct SftOptions {
  int64_t seq_len = 128;
  int64_t pad_id = 0;  // any id the model has: padded positions are never targets
  bool packing = false;  // several records per sample (Note [Packing SFT records])
};

// Samples of rendered conversations (Note [SFT samples]): x and y int64 [T]; packed, x [2, T] (Note
// [Packing SFT records]).
class SftDataset : public Dataset {
 public:
  // `name` stands for the records' file in messages. DataError naming it when no record keeps a
  // response token within seq_len.
  SftDataset(const std::vector<Conversation>& records, const ChatTemplate& tmpl, const SftTokenizer& tokenizer,
             SftOptions options, std::string name);

  int64_t size() const override { return size_; }
  Batch get(int64_t i) const override;
  Batch get_batch(const std::vector<int64_t>& indices) const override;

  int64_t seq_len() const { return options_.seq_len; }
  int64_t records() const { return records_; }            // records given
  int64_t truncated() const { return truncated_; }        // records cut to seq_len + 1 ids
  int64_t dropped() const { return dropped_; }            // records left out: no response target within seq_len
  int64_t response_tokens() const { return response_tokens_; }  // targets the loss counts, all samples
  int64_t packed_records() const { return packed_records_; }    // records in packed samples (packing)
  const std::string& name() const { return name_; }
  // "N records, K truncated at seq_len T, ..." for the run's log.
  std::string describe() const;

 private:
  SftOptions options_;
  std::string name_;
  std::vector<int64_t> x_, y_;  // size_ * seq_len each (x_ twice that, packed: ids then record numbers)
  int64_t size_ = 0, records_ = 0, truncated_ = 0, dropped_ = 0, response_tokens_ = 0, packed_records_ = 0;
};

}  // namespace booster::data
