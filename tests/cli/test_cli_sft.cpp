// `booster check` and `booster train` on instruction data (data.type "sft", booster/data/sft.h): a tiny
// Llama trains a few steps on a JSONL file of prompts and responses tokenized by a SentencePiece model
// made here by spm_train, the truncated records counted once in the log; the config mistakes are
// ConfigErrors (exit 2) naming the key, a bad record a DataError (exit 1) naming the file and line.
#include <catch2/catch.hpp>

#include "skip.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "run_booster.h"

namespace fs = std::filesystem;
using Catch::Contains;
using nlohmann::json;
using testing::RunResult;

namespace {

const fs::path kCorpus = "/usr/share/common-licenses/GPL-3";

fs::path scratch_dir() { return testing::scratch_dir("test_cli_sft"); }

RunResult run_booster(const std::string& args) { return testing::run_booster_in(scratch_dir(), args); }

bool have(const char* program) { return std::system(("command -v " + std::string(program) + " >/dev/null 2>&1").c_str()) == 0; }

// Why the training test cannot run here, or "" when it can.
std::string missing_tools() {
  if (!have("spm_train")) return "spm_train (Debian's sentencepiece) is missing";
  if (!fs::exists(kCorpus)) return kCorpus.string() + " is missing";
  const RunResult probe =
      testing::run_booster_in(scratch_dir() / "probe", "tokenize --model /nonexistent.model --in x --out y");
  if (probe.err.find("built without SentencePiece") != std::string::npos)
    return "this booster was built without SentencePiece (libsentencepiece-dev)";
  return "";
}

// A 300-piece BPE model of the GPL, trained once per test process.
fs::path tokenizer_model() {
  const fs::path prefix = scratch_dir() / "gpl";
  if (!fs::exists(prefix.string() + ".model")) {
    const std::string cmd = "spm_train --input=" + kCorpus.string() + " --model_prefix=" + prefix.string() +
                            " --vocab_size=300 --model_type=bpe >" + prefix.string() + ".log 2>&1";
    REQUIRE(std::system(cmd.c_str()) == 0);
  }
  return prefix.string() + ".model";
}

// 12 records: the 3rd, 5th and 7th with a response far past seq_len 48, the rest short.
fs::path records_file() {
  const fs::path p = scratch_dir() / "train.jsonl";
  std::ofstream out(p);
  std::string long_response;
  for (int i = 0; i < 40; ++i) long_response += "the licensee may convey the work ";
  for (int i = 0; i < 12; ++i) {
    const bool long_one = i == 2 || i == 4 || i == 6;
    if (i % 2 == 0)
      out << json{{"prompt", "What is " + std::to_string(i) + "?"},
                  {"response", long_one ? long_response : "It is " + std::to_string(i) + "."}}
                 .dump()
          << "\n";
    else
      out << json{{"messages", {{{"role", "system"}, {"content", "Be brief."}},
                                {{"role", "user"}, {"content", "Name " + std::to_string(i) + "."}},
                                {{"role", "assistant"}, {"content", "Number " + std::to_string(i) + "."}}}}}
                 .dump()
          << "\n";
  }
  return p;
}

json sft_config(const std::string& tokenizer, const fs::path& data, const std::string& run) {
  return {{"model", {{"type", "llama"},           {"vocab_size", 300},         {"hidden_size", 16},
                     {"intermediate_size", 32},   {"num_hidden_layers", 1},    {"num_attention_heads", 2},
                     {"num_key_value_heads", 2},  {"max_position_embeddings", 64}}},
          {"optimizer", {{"type", "adamw"}, {"lr", 0.01}}},
          {"data", {{"type", "sft"}, {"path", data.string()}, {"tokenizer", tokenizer}, {"seq_len", 48},
                    {"val_fraction", 0.25}, {"batch_size", 4}, {"eval_batch_size", 8},
                    {"template", {{"user", "Q: {content}\n"}, {"assistant", "A: {content}"}}}}},
          {"train", {{"max_steps", 3}, {"eval_every", 3}, {"log_every", 1}, {"seed", 2},
                     {"run_dir", (scratch_dir() / run).string()}}}};
}

fs::path write_config(const std::string& name, const json& config) {
  const fs::path p = scratch_dir() / name;
  std::ofstream(p) << config.dump(2);
  return p;
}

// A failure as the program must report it: the exit code and exactly one line on stderr.
void check_one_line_error(const RunResult& r, int exit_code, const std::vector<std::string>& must_contain) {
  INFO("stderr: " << r.err);
  CHECK(r.exit_code == exit_code);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK(r.err.rfind("booster: error: ", 0) == 0);
  for (const std::string& s : must_contain) CHECK_THAT(r.err, Contains(s));
}

}  // namespace

TEST_CASE("booster train on sft data trains a tiny llama and counts the truncated records once", "[cli][sft]") {
  const std::string why = missing_tools();
  if (!why.empty()) {
    skip_test(why);
    return;
  }
  const fs::path config = write_config("sft.json", sft_config(tokenizer_model().string(), records_file(), "run"));
  const RunResult checked = run_booster("check --config " + config.string());
  INFO("check stderr: " << checked.err);
  CHECK(checked.exit_code == 0);
  const RunResult trained = run_booster("train --config " + config.string());
  INFO("train stderr: " << trained.err);
  REQUIRE(trained.exit_code == 0);
  const json result = json::parse(testing::last_line(trained.out));
  CHECK(result["steps"] == 3);
  REQUIRE(result["val_loss"].is_number());
  // A 300-way prediction, barely trained: near log(300) = 5.7.
  CHECK(std::isfinite(result["val_loss"].get<double>()));
  CHECK(result["val_loss"].get<double>() > 3.0);
  CHECK(result["val_loss"].get<double>() < 8.0);
  // 9 training records (the last 3 are validation), 3 of them cut; said once.
  CHECK_THAT(trained.err, Contains("9 records"));
  const std::string said = "3 records truncated at seq_len 48";
  const size_t at = trained.err.find(said);
  CHECK(at != std::string::npos);
  CHECK(trained.err.find(said, at + 1) == std::string::npos);

  // Packed (Note [Packing SFT records]): the 6 short training records share sequences, each cut one
  // alone; the loss is of the same kind.
  json packed_cfg = sft_config(tokenizer_model().string(), records_file(), "packed");
  packed_cfg["data"]["packing"] = true;
  packed_cfg["data"]["batch_size"] = 1;
  const fs::path packed_config = write_config("sft_packed.json", packed_cfg);
  const RunResult packed = run_booster("train --config " + packed_config.string());
  INFO("packed train stderr: " << packed.err);
  REQUIRE(packed.exit_code == 0);
  CHECK_THAT(packed.err, Contains("9 records packed into the"));
  const json packed_result = json::parse(testing::last_line(packed.out));
  CHECK(packed_result["steps"] == 3);
  CHECK(std::isfinite(packed_result["val_loss"].get<double>()));
  CHECK(packed_result["val_loss"].get<double>() < 8.0);

  // With activation checkpointing each layer's recompute runs under the packed layout its forward had
  // (Note [Recomputing in backward]): the same gradients bit for bit, so the same validation loss. One
  // batch of all 8 samples, so that the one holding two records is trained on.
  std::vector<json> val_losses;
  for (const bool recompute : {false, true}) {
    const std::string name = recompute ? "packed_recomputed" : "packed_whole";
    json cfg = sft_config(tokenizer_model().string(), records_file(), name);
    cfg["data"]["packing"] = true;
    cfg["data"]["batch_size"] = 8;
    cfg["model"]["activation_checkpointing"] = recompute;
    const RunResult r = run_booster("train --config " + write_config(name + ".json", cfg).string());
    INFO(name << " train stderr: " << r.err);
    REQUIRE(r.exit_code == 0);
    const json result = json::parse(testing::last_line(r.out));
    CHECK(result["steps"] == 1);  // the epoch's one batch
    val_losses.push_back(result["val_loss"]);
  }
  CHECK(val_losses[1] == val_losses[0]);
}

TEST_CASE("booster check refuses sft config mistakes naming the key, and bad records naming the line", "[cli][sft]") {
  // The config mistakes are found before the tokenizer is loaded: a missing one does not matter here.
  const fs::path data = records_file();
  const std::string tok = (scratch_dir() / "absent.model").string();
  struct Case {
    std::string name;
    std::function<void(json&)> edit;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {"no_content", [](json& c) { c["data"]["template"]["assistant"] = "A:"; },
       {"'data.template.assistant'", "no {content}"}},
      {"unknown_key", [](json& c) { c["data"]["template"]["tool"] = "{content}"; },
       {"'data.template.tool' is not a template key"}},
      {"ignore_index", [](json& c) { c["criterion"] = {{"type", "cross_entropy"}, {"ignore_index", 0}}; },
       {"'criterion.ignore_index' is 0", "-100"}},
      {"both_vals", [&](json& c) { c["data"]["val_path"] = data.string(); },
       {"'data.val_fraction'", "'data.val_path'", "give one of them"}},
      {"bad_seq_len", [](json& c) { c["data"]["seq_len"] = 0; }, {"data.seq_len"}},
      {"unknown_data_key", [](json& c) { c["data"]["max_len"] = 8; }, {"data.max_len"}},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    json config = sft_config(tok, data, "bad_" + c.name);
    c.edit(config);
    check_one_line_error(run_booster("check --config " + write_config(c.name + ".json", config).string()), 2, c.expect);
  }

  const std::string why = missing_tools();
  if (!why.empty()) {
    skip_test(why);
    return;
  }
  // A bad record on line 2: the file and the line, from check and from train.
  const fs::path bad = scratch_dir() / "bad.jsonl";
  std::ofstream(bad) << R"({"prompt": "a", "response": "b"})" << "\n"
                     << R"({"messages": [{"role": "robot", "content": "x"}]})" << "\n";
  const fs::path config = write_config("bad_record.json", sft_config(tokenizer_model().string(), bad, "bad_record"));
  for (const char* command : {"check", "train"})
    check_one_line_error(run_booster(std::string(command) + " --config " + config.string()), 1,
                         {bad.string() + " line 2", "role \"robot\""});
  // The tokenizer's vocabulary must fit the model's.
  json small = sft_config(tokenizer_model().string(), data, "small");
  small["model"]["vocab_size"] = 100;
  check_one_line_error(run_booster("check --config " + write_config("small.json", small).string()), 2,
                       {"300 ids", "data.tokenizer"});
}
