// Every JSON file the project reads goes through the one reader with the config's depth limit (Note [One
// JSON reader] in booster/common/json_text.h): 200 000 nested `[` (under 1 MB, the issue's hostile input,
// which crashed nlohmann's recursive parse, copy and destruction with SIGSEGV) in each file is a typed error that
// names the file and the nesting, from each reader's public function, and the process goes on. The
// readers given larger size limits than a config's still read their legitimately large files: a
// tokenizer.json past a config's 16 MB and with more array items than a config may hold.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
#include <vector>
#include <string>

#include <nlohmann/json.hpp>

#include "booster/checkpoint/checkpoint.h"
#include "booster/checkpoint/checksums.h"
#include "booster/checkpoint/safetensors.h"
#include "booster/common/error.h"
#include "booster/config/config.h"
#include "booster/common/json_text.h"
#include "booster/data/bpe_tokenizer.h"
#include "booster/data/sft.h"
#include "booster/data/tokens.h"
#include "booster/distributed/flight_recorder.h"
#include "booster/nn/hf.h"
#include "booster/nn/peft.h"
#include "run_booster.h"
#include "skip.h"

namespace fs = std::filesystem;
using nlohmann::json;
using namespace booster;
using Catch::Contains;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_json_limits"); }

// The hostile text: 200 000 arrays nested in one another, valid JSON of 400 kB (nlohmann::json::parse
// of it ends in SIGSEGV).
const std::string& deep() {
  static const std::string text = std::string(200'000, '[') + std::string(200'000, ']');
  return text;
}

void write(const fs::path& file, const std::string& text) {
  fs::create_directories(file.parent_path());
  std::ofstream(file, std::ios::binary) << text;
}

// A fresh directory of the scratch directory.
fs::path fresh(const std::string& name) {
  const fs::path dir = scratch_dir() / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// `read` throws an E whose message names `file` and the nesting limit.
template <class E>
void check_refused(const std::function<void()>& read, const std::string& file) {
  try {
    read();
    FAIL("no error");
  } catch (const E& e) {
    INFO(e.what());
    CHECK_THAT(e.what(), Contains(file) && Contains("nested more than 64 deep"));
  }
}

}  // namespace

TEST_CASE("a config file nested 200000 deep is a ConfigError naming it", "[config][json_limits][hardening]") {
  const fs::path file = fresh("config") / "deep.json";
  write(file, deep());
  check_refused<ConfigError>([&] { config::load_file(file.string()); }, "deep.json");
}

TEST_CASE("an HF config.json nested 200000 deep is a ConfigError naming it", "[config][json_limits][hardening]") {
  const fs::path dir = fresh("hf");
  write(dir / "config.json", deep());
  check_refused<ConfigError>([&] { nn::load_pretrained(dir); }, (dir / "config.json").string());
}

TEST_CASE("a safetensors header nested 200000 deep is a CheckpointError naming the file",
          "[config][json_limits][hardening]") {
  const fs::path file = fresh("safetensors") / "model.safetensors";
  std::string bytes(8, '\0');
  const uint64_t n = deep().size();
  for (int i = 0; i < 8; ++i) bytes[size_t(i)] = char((n >> (8 * i)) & 0xff);
  write(file, bytes + deep());
  check_refused<CheckpointError>([&] { checkpoint::read_safetensors(file); }, file.string());
  check_refused<CheckpointError>([&] { checkpoint::load_model(file.parent_path()); }, file.string());
}

TEST_CASE("a safetensors header with a tensor named twice names the duplicate", "[config][json_limits][hardening]") {
  const fs::path file = fresh("duplicate") / "model.safetensors";
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[size_t(i)] = char((header.size() >> (8 * i)) & 0xff);
  write(file, bytes + header + std::string(4, '\0'));
  try {
    checkpoint::read_safetensors(file);
    FAIL("no error");
  } catch (const CheckpointError& e) {
    CHECK_THAT(e.what(), Contains(file.string()) && Contains("the key \"a\" is given twice"));
  }
}

TEST_CASE("a model index nested 200000 deep is a CheckpointError naming it", "[config][json_limits][hardening]") {
  const fs::path dir = fresh("index");
  write(dir / "model.safetensors.index.json", deep());
  check_refused<CheckpointError>([&] { checkpoint::load_model(dir); }, "model.safetensors.index.json");
}

TEST_CASE("a tokenizer.json or tokenizer_config.json nested 200000 deep is a DataError naming it",
          "[config][json_limits][hardening]") {
  const fs::path dir = fresh("tokenizer");
  write(dir / "tokenizer.json", deep());
  check_refused<DataError>([&] { data::ByteLevelBPETokenizer((dir / "tokenizer.json").string()); }, "tokenizer.json");
  check_refused<DataError>([&] { data::ByteLevelBPETokenizer(deep(), "given.json"); }, "given.json");
  // A good tokenizer.json beside a hostile tokenizer_config.json.
  const fs::path good = fresh("tokenizer_config");
  fs::copy_file(fs::path(BOOSTER_FIXTURE_DIR) / "bpe" / "gpt2" / "tokenizer.json", good / "tokenizer.json");
  write(good / "tokenizer_config.json", deep());
  check_refused<DataError>([&] { data::ByteLevelBPETokenizer((good / "tokenizer.json").string()); },
                           "tokenizer_config.json");
}

TEST_CASE("a tokenizer.json past a config's size and item limits still reads", "[config][json_limits]") {
  // The fixture with an array of 70 000 items (more than a config's 65 536, fewer than a real
  // tokenizer's merges) and a 17 MB string (more than a config's 16 MB) in fields it ignores.
  json t = json::parse(testing::read_text(fs::path(BOOSTER_FIXTURE_DIR) / "bpe" / "gpt2" / "tokenizer.json"));
  t["padding_items"] = json(std::vector<int>(70'000, 1));
  t["padding_note"] = std::string(17'000'000, 'x');
  const fs::path file = fresh("big_tokenizer") / "tokenizer.json";
  write(file, t.dump());
  REQUIRE(fs::file_size(file) > 16'000'000);
  const data::ByteLevelBPETokenizer reference((fs::path(BOOSTER_FIXTURE_DIR) / "bpe" / "gpt2" / "tokenizer.json").string());
  const data::ByteLevelBPETokenizer big(file.string());
  CHECK(big.vocab_size() == reference.vocab_size());
  CHECK(big.encode("hello world") == reference.encode("hello world"));
}

TEST_CASE("a trainer_state.json or checksums.json nested 200000 deep is a CheckpointError naming it",
          "[config][json_limits][hardening]") {
  const fs::path step = fresh("checkpoint") / "step-00000001";
  write(step / "trainer_state.json", deep());
  check_refused<CheckpointError>([&] { checkpoint::load_checkpoint(step); }, "trainer_state.json");
  const fs::path sums = fresh("checksums");
  write(sums / "checksums.json", deep());
  check_refused<CheckpointError>([&] { checkpoint::verify_checksums(sums); }, "checksums.json");
}

TEST_CASE("a token file description nested 200000 deep is a DataError naming it", "[config][json_limits][hardening]") {
  const fs::path dir = fresh("tokens");
  write(dir / "tokens.bin", std::string(8, '\0'));
  write(dir / "tokens.bin.json", deep());
  check_refused<DataError>([&] { data::read_token_description((dir / "tokens.bin").string()); }, "tokens.bin.json");
}

TEST_CASE("an adapter_config.json nested 200000 deep is a ConfigError naming it", "[config][json_limits][hardening]") {
  const fs::path dir = fresh("peft");
  write(dir / "adapter_config.json", deep());
  check_refused<ConfigError>([&] { nn::read_peft_config(dir); }, "adapter_config.json");
}

TEST_CASE("booster generate refuses a generation_config.json nested 200000 deep in one line",
          "[config][json_limits][hardening][cli]") {
  const fs::path dir = fresh("generation");
  for (const auto& e : fs::directory_iterator(fs::path(BOOSTER_FIXTURE_DIR) / "hf" / "gpt2"))
    fs::copy_file(e.path(), dir / e.path().filename());
  write(dir / "generation_config.json", deep());
  const testing::RunResult r =
      testing::run_booster_in(scratch_dir(), "generate --hf " + dir.string() + " --prompt-ids \"1 2\" -n 2");
  INFO(r.err);
  CHECK(r.exit_code == 2);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK_THAT(r.err, Contains("generation_config.json") && Contains("nested more than 64 deep"));
}

TEST_CASE("an SFT line nested 200000 deep is a DataError naming the file and line", "[config][json_limits][hardening]") {
  check_refused<DataError>([&] { data::parse_sft_record(deep(), "chat.jsonl", 7); }, "chat.jsonl line 7");
  // A good line still reads.
  CHECK(data::parse_sft_record(R"({"prompt": "a", "response": "b"})", "chat.jsonl", 8).size() > 0);
}

TEST_CASE("booster plot takes a metrics line nested 200000 deep for no record", "[config][json_limits][hardening][cli]") {
  const fs::path dir = fresh("plot");
  write(dir / "metrics.jsonl", deep() + "\n");
  const testing::RunResult r = testing::run_booster_in(
      scratch_dir(), "plot --out " + (dir / "loss.png").string() + " " + (dir / "metrics.jsonl").string());
  INFO(r.err);
  CHECK(r.exit_code == 2);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK_THAT(r.err, Contains("metrics.jsonl") && Contains("line 1"));
}

TEST_CASE("a flight record nested 200000 deep is a DataError naming it", "[config][json_limits][hardening]") {
  const fs::path dir = fresh("flight");
  write(dir / "rank-0.json", deep());
  check_refused<DataError>([&] { distributed::load_flight_records(dir); }, "rank-0.json");
  // Through the command: one line, exit 1.
  const testing::RunResult r = testing::run_booster_in(scratch_dir(), "flight " + dir.string());
  INFO(r.err);
  CHECK(r.exit_code == 1);
  CHECK(r.out.empty());
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK_THAT(r.err, Contains("rank-0.json") && Contains("nested more than 64 deep"));
}

TEST_CASE("a hybrid_layout.json nested 200000 deep is refused at resume, naming it",
          "[config][json_limits][hardening][cli][hybrid]") {
  if (!testing::have_plugin("hybrid_parallel")) {
    skip_test("the hybrid_parallel plugin is not built");
    return;
  }
  const fs::path dir = fresh("hybrid");
  const std::string train = "train --config " + std::string(BOOSTER_SOURCE_DIR) +
                            "/examples/configs/gpt_char.json -p hybrid_parallel --set train.max_steps=2 "
                            "--set train.eval_every=0 --set train.run_dir=null --set train.checkpoint_every=1 ";
  testing::RunResult r = testing::run_booster_in(dir, train + "--set train.checkpoint_dir=ck", "OMP_NUM_THREADS=1");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const fs::path step = dir / "ck" / "step-00000001";
  REQUIRE(fs::exists(step / "optimizer" / "hybrid_layout.json"));
  write(step / "optimizer" / "hybrid_layout.json", deep());
  checkpoint::write_checksums(step);  // the file is what its checksum says: only its text is wrong
  r = testing::run_booster_in(dir, train + "--set train.checkpoint_dir=ck2 --resume ck/step-00000001",
                              "OMP_NUM_THREADS=1");
  INFO(r.err);
  CHECK(r.exit_code != 0);
  CHECK(r.exit_code < 128);
  CHECK_THAT(r.err, Contains("hybrid_layout.json") && Contains("nested more than 64 deep"));
}

TEST_CASE("a metrics.jsonl record nested 200000 deep is set aside at resume, not continued",
          "[config][json_limits][hardening][cli]") {
  const fs::path dir = fresh("metrics_resume");
  const std::string train = "train --config " + std::string(BOOSTER_SOURCE_DIR) +
                            "/tests/bad_configs/base.json --set train.max_steps=2 --set train.log_every=1 "
                            "--set train.run_dir=run --set train.checkpoint_every=1 --set train.checkpoint_dir=ck ";
  testing::RunResult r = testing::run_booster_in(dir, train, "OMP_NUM_THREADS=1");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  // A record of step 1 whose extra field is 200 000 arrays deep, then a good one (a last line that does
  // not read is a torn write, dropped without a word).
  std::ofstream(dir / "run" / "metrics.jsonl", std::ios::app)
      << R"({"kind": "train", "step": 1, "x": )" << deep() << "}\n" << R"({"kind": "note", "step": 1})" << "\n";
  r = testing::run_booster_in(dir, train + "--resume ck/step-00000001", "OMP_NUM_THREADS=1");
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("1 line(s) of run/metrics.jsonl are not metrics records"));
  CHECK(testing::read_text(dir / "run" / "metrics.jsonl").find("[[[[") == std::string::npos);
}
