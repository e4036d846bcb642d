// `booster generate` through the program: a tiny Llama trained a few steps by `booster train` with
// checkpoints, then sampled from its checkpoint; the greedy ids it prints equal nn::generate's on the
// same weights loaded by the library, from a checkpoint and from Hugging Face directories (--hf); a
// SentencePiece prompt and text (skipped without spm_train); every
// malformed input is one line on stderr and a non-zero exit.
#include <catch2/catch.hpp>

#include "skip.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "run_booster.h"

#include "booster/checkpoint/checkpoint.h"
#include "booster/checkpoint/safetensors.h"
#include "booster/data/tokens.h"
#include "booster/nn/generate.h"
#include "booster/nn/hf.h"
#include "booster/nn/models.h"

namespace fs = std::filesystem;
using Catch::Contains;
using nlohmann::json;
using testing::RunResult;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_generate"); }

RunResult run_booster(const std::string& args) { return testing::run_booster_in(scratch_dir(), args); }

const json kModel = {{"type", "llama"},           {"vocab_size", 64},          {"hidden_size", 16},
                     {"intermediate_size", 32},   {"num_hidden_layers", 2},    {"num_attention_heads", 4},
                     {"num_key_value_heads", 2},  {"max_position_embeddings", 32}};

// A run of 4 steps on a token file of a repeating pattern, checkpoints at steps 2 and 4; trained once
// per test process. Returns the run directory.
fs::path trained_run() {
  const fs::path dir = scratch_dir() / "run";
  if (fs::exists(dir / "checkpoints" / "latest")) return dir;
  fs::create_directories(dir);
  std::vector<uint32_t> ids;
  for (uint32_t i = 0; i < 4096; ++i) ids.push_back((i * 7 + i / 13) % 64);
  booster::data::write_token_file((dir / "train.bin").string(), ids, booster::data::TokenDType::UInt16);
  const json config = {
      {"model", kModel},
      {"optimizer", {{"type", "adamw"}, {"lr", 1e-2}}},
      {"criterion", {{"type", "cross_entropy"}}},
      {"data", {{"type", "tokens"}, {"path", (dir / "train.bin").string()}, {"seq_len", 16}, {"batch_size", 4}}},
      {"train",
       {{"max_steps", 4}, {"log_every", 1}, {"run_dir", dir.string()}, {"checkpoint_every", 2}, {"keep_last", 0}}}};
  std::ofstream(dir / "config.json.in") << config.dump(2);
  const RunResult r = run_booster("train --config " + (dir / "config.json.in").string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  REQUIRE(fs::exists(dir / "checkpoints" / "step-00000004" / "model"));
  return dir;
}

std::vector<int64_t> ids_of_line(const std::string& line) {
  std::istringstream in(line);
  std::vector<int64_t> ids;
  int64_t v;
  while (in >> v) ids.push_back(v);
  return ids;
}

// The library's greedy tokens for the weights of checkpoint `step`.
std::vector<int64_t> library_tokens(const fs::path& step, const std::vector<int64_t>& prompt, int64_t n) {
  booster::nn::ModulePtr model = booster::nn::make_model(kModel, 0);
  model->load_state_dict(booster::checkpoint::load_model(step / "model"));
  return booster::nn::generate(*model, prompt, {.max_new_tokens = n, .temperature = 0.0}).tokens;
}

bool have(const char* program) { return std::system(("command -v " + std::string(program) + " >/dev/null 2>&1").c_str()) == 0; }

// One line on stderr, "booster: error: ...", containing `what`, and exit code `code`.
void check_refused(const std::string& args, const std::string& what, int code = 2) {
  const RunResult r = run_booster(args);
  INFO("booster " << args << "\nstderr: " << r.err);
  CHECK(r.exit_code == code);
  CHECK(r.err.rfind("booster: error: ", 0) == 0);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK_THAT(r.err, Contains(what));
}

}  // namespace

TEST_CASE("cli generate: greedy ids from a checkpoint equal the library's", "[cli][generate]") {
  const fs::path run = trained_run();
  const RunResult r = run_booster("generate --checkpoint " + (run / "checkpoints").string() +
                                  " --prompt-ids \"1 2 3\" --temperature 0 --max-new-tokens 12");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const std::vector<int64_t> got = ids_of_line(testing::last_line(r.out));
  CHECK(got.size() == 12);
  CHECK(got == library_tokens(run / "checkpoints" / "step-00000004", {1, 2, 3}, 12));
  CHECK_THAT(r.err, Contains("generated 12 tokens"));
  CHECK_THAT(r.err, Contains("--max-new-tokens reached"));

  // An earlier step directory named explicitly, its model section from --config (a training config).
  const fs::path step2 = run / "checkpoints" / "step-00000002";
  const RunResult r2 = run_booster("generate --checkpoint " + step2.string() + " --config " +
                                   (run / "config.json.in").string() + " --prompt-ids 5,9 --temperature 0 -n 6");
  INFO(r2.err);
  REQUIRE(r2.exit_code == 0);
  CHECK(ids_of_line(testing::last_line(r2.out)) == library_tokens(step2, {5, 9}, 6));

  // Sampling: a seed gives one sequence; the cache changes nothing.
  const std::string sample = "generate --checkpoint " + (run / "checkpoints").string() +
                             " --prompt-ids \"1\" --temperature 1.2 --top-k 20 --top-p 0.9 --seed 4 -n 10";
  const RunResult a = run_booster(sample), b = run_booster(sample + " --no-cache");
  REQUIRE(a.exit_code == 0);
  REQUIRE(b.exit_code == 0);
  CHECK(testing::last_line(a.out) == testing::last_line(b.out));
  CHECK_THAT(b.err, Contains("without the key/value cache"));

  // The position limit (32) stops it and says so.
  const RunResult full = run_booster("generate --checkpoint " + (run / "checkpoints").string() +
                                     " --prompt-ids \"1 2 3\" --temperature 0 -n 100");
  REQUIRE(full.exit_code == 0);
  CHECK(ids_of_line(testing::last_line(full.out)).size() == 29);
  CHECK_THAT(full.err, Contains("the model's limit of 32 positions"));
}

TEST_CASE("cli generate: --hf reads a Hugging Face directory, and greedy ids equal the library's", "[cli][generate][hf]") {
  for (const char* name : {"llama", "gpt2"}) {
    INFO(name);
    const fs::path dir = fs::path(BOOSTER_FIXTURE_DIR) / "hf" / name;
    const RunResult r = run_booster("generate --hf " + dir.string() + " --prompt-ids \"1 2 3\" --temperature 0 -n 10");
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    booster::nn::ModulePtr model = booster::nn::load_pretrained(dir);
    const auto expected = booster::nn::generate(*model, {1, 2, 3}, {.max_new_tokens = 10, .temperature = 0.0}).tokens;
    CHECK(ids_of_line(testing::last_line(r.out)) == expected);
    CHECK(expected.size() == 10);
  }
  check_refused("generate --hf /nonexistent/hf --prompt-ids 1", "--hf /nonexistent/hf is not a directory");
}

TEST_CASE("cli generate: --hf stops at the directory's eos_token_id, as transformers does", "[cli][generate][hf]") {
  const fs::path dir = scratch_dir() / "llama_eos";
  fs::remove_all(dir);
  fs::copy(fs::path(BOOSTER_FIXTURE_DIR) / "hf" / "llama", dir);
  json config = json::parse(std::ifstream(dir / "config.json"));
  booster::nn::ModulePtr model = booster::nn::load_pretrained(dir);
  const std::vector<int64_t> all =
      booster::nn::generate(*model, {1, 2, 3}, {.max_new_tokens = 20, .temperature = 0.0}).tokens;
  REQUIRE(all.size() == 20);
  // The ids up to and including the first of `eos` (the library's tokens, cut where generate must stop).
  auto cut_at = [&](const std::vector<int64_t>& eos) {
    std::vector<int64_t> want;
    for (int64_t id : all) {
      want.push_back(id);
      if (std::find(eos.begin(), eos.end(), id) != eos.end()) break;
    }
    return want;
  };
  const std::string cmd = "generate --hf " + dir.string() + " --prompt-ids \"1 2 3\" --temperature 0 -n 20";
  auto write = [&](const fs::path& file, const json& eos) {
    json c = file.filename() == "config.json" ? config : json::object();
    c["eos_token_id"] = eos;
    std::ofstream(file) << c.dump();
  };
  // One id, then a list (the first of them to come stops it); null never stops.
  write(dir / "config.json", all[4]);
  RunResult r = run_booster(cmd);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(ids_of_line(testing::last_line(r.out)) == cut_at({all[4]}));
  CHECK_THAT(r.err, Contains("stopped at the end-of-sequence token"));
  write(dir / "config.json", json::array({999, all[8]}));
  CHECK(ids_of_line(testing::last_line(run_booster(cmd).out)) == cut_at({999, all[8]}));
  write(dir / "config.json", nullptr);
  CHECK(ids_of_line(testing::last_line(run_booster(cmd).out)) == all);
  // generation_config.json, when there, is what transformers reads.
  write(dir / "config.json", all[8]);
  write(dir / "generation_config.json", all[2]);
  CHECK(ids_of_line(testing::last_line(run_booster(cmd).out)) == cut_at({all[2]}));
  // --ignore-eos goes on.
  r = run_booster(cmd + " --ignore-eos");
  CHECK(ids_of_line(testing::last_line(r.out)) == all);
  CHECK_THAT(r.err, Contains("--max-new-tokens reached"));
  // A malformed eos_token_id names the file and the way out.
  write(dir / "generation_config.json", "2");
  check_refused(cmd, "generation_config.json: \"eos_token_id\" must be an id, a list of ids or null, got \"2\"");
}

TEST_CASE("cli generate: a text prompt through a SentencePiece tokenizer", "[cli][generate]") {
  if (!have("spm_train")) {
    skip_test("spm_train (Debian's sentencepiece) is missing");
    return;
  }
  const fs::path run = trained_run();
  const fs::path text = scratch_dir() / "corpus.txt", prefix = scratch_dir() / "tok";
  {
    std::ofstream out(text);
    for (int i = 0; i < 200; ++i) out << "the cat sat on the mat " << i % 7 << "\nhello world, said the dog\n";
  }
  const std::string cmd = "spm_train --input=" + text.string() + " --model_prefix=" + prefix.string() +
                          " --vocab_size=40 --model_type=bpe >" + prefix.string() + ".log 2>&1";
  REQUIRE(std::system(cmd.c_str()) == 0);
  const RunResult r = run_booster("generate --checkpoint " + (run / "checkpoints").string() + " --tokenizer " +
                                  prefix.string() + ".model --prompt \"hello world\" --temperature 0 -n 8");
  INFO(r.err);
  if (r.err.find("built without SentencePiece") != std::string::npos) {
    skip_test("this booster was built without SentencePiece (libsentencepiece-dev)");
    return;
  }
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.rfind("hello world", 0) == 0);  // the prompt, then the continuation
  CHECK_THAT(r.err, Contains("generated "));
  // A tokenizer with more ids than the model's vocabulary is refused.
  const std::string big = "spm_train --input=" + text.string() + " --model_prefix=" + prefix.string() +
                          "_big --vocab_size=70 --model_type=bpe --hard_vocab_limit=false >" + prefix.string() + "_big.log 2>&1";
  REQUIRE(std::system(big.c_str()) == 0);
  check_refused("generate --checkpoint " + (run / "checkpoints").string() + " --tokenizer " + prefix.string() +
                    "_big.model --prompt \"hello\"",
                "give the tokenizer the model was trained with");
}

TEST_CASE("cli generate: malformed inputs are one line and a non-zero exit", "[cli][generate][errors]") {
  const fs::path run = trained_run();
  const std::string ckpt = "generate --checkpoint " + (run / "checkpoints").string();
  check_refused("generate --checkpoint /nonexistent/ckpt --prompt-ids 1", "--checkpoint /nonexistent/ckpt does not exist");
  check_refused(ckpt + " --prompt-ids \"1 x 3\"", "'x' is not a token id");
  check_refused(ckpt + " --prompt-ids \"1 -2\"", "'-2' is not a token id");
  check_refused(ckpt + " --prompt-ids \"\"", "--prompt-ids is empty");
  check_refused(ckpt + " --prompt-ids \"1 64\"", "prompt token id 64 is past the model's vocabulary of 64 ids");
  check_refused(ckpt + " --prompt-ids 1 --temperature -0.5", "--temperature -0.5");
  check_refused(ckpt + " --prompt-ids 1 --top-p 0", "--top-p 0: expected a probability in (0, 1]");
  check_refused(ckpt + " --prompt-ids 1 --top-p 1.5", "--top-p 1.5");
  check_refused(ckpt + " --prompt-ids 1 --top-k -3", "--top-k -3");
  check_refused(ckpt + " --prompt-ids 1 --max-new-tokens -1", "--max-new-tokens -1");
  check_refused(ckpt, "needs one of --prompt TEXT");
  check_refused(ckpt + " --prompt hello", "--prompt needs --tokenizer");
  check_refused("generate --prompt-ids 1", "needs one of --checkpoint DIR or --hf DIR");
  std::string long_prompt;
  for (int i = 0; i < 32; ++i) long_prompt += "1 ";
  check_refused(ckpt + " --prompt-ids \"" + long_prompt + "\"", "at most 32 positions");
  // A directory that is no checkpoint: a runtime failure of loading (exit 1), still one line.
  fs::create_directories(scratch_dir() / "empty");
  check_refused("generate --checkpoint " + (scratch_dir() / "empty").string() + " --prompt-ids 1", "empty", 1);
}
