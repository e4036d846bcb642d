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
#include "booster/ops/ops.h"
#include "booster/tensor/grad_mode.h"

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

// transformers' repetition_penalty, written out here from its definition (not the library's code): before
// each choice, the logit of every id already in the sequence is divided by the penalty when positive and
// multiplied when negative; greedy then takes the highest.
TEST_CASE("cli generate: --repetition-penalty and --num-samples as transformers defines them", "[cli][generate]") {
  const fs::path dir = fs::path(BOOSTER_FIXTURE_DIR) / "hf" / "llama";
  booster::nn::ModulePtr model = booster::nn::load_pretrained(dir);
  const double penalty = 1.8;
  std::vector<int64_t> seq = {1, 2, 3}, want;
  {
    booster::NoGradGuard no_grad;
    model->eval();
    for (int step = 0; step < 12; ++step) {
      const booster::Tensor logits = (*model)(booster::from_vector(seq, {1, int64_t(seq.size())}));
      std::vector<double> z = logits.select(1, int64_t(seq.size()) - 1).reshape({-1}).tolist();
      std::vector<bool> seen(z.size(), false);
      for (int64_t id : seq) seen[size_t(id)] = true;
      for (size_t i = 0; i < z.size(); ++i)
        if (seen[i]) z[i] = z[i] > 0 ? z[i] / penalty : z[i] * penalty;
      const int64_t next = int64_t(std::max_element(z.begin(), z.end()) - z.begin());
      want.push_back(next);
      seq.push_back(next);
    }
  }
  const std::string cmd = "generate --hf " + dir.string() + " --prompt-ids \"1 2 3\" --temperature 0 -n 12";
  const RunResult r = run_booster(cmd + " --repetition-penalty 1.8");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(ids_of_line(testing::last_line(r.out)) == want);
  CHECK(ids_of_line(testing::last_line(run_booster(cmd).out)) != want);  // the penalty changed the choice
  check_refused(cmd + " --repetition-penalty 0", "--repetition-penalty 0");

  // N samples: sample i is the run seeded S + i.
  const std::string sample = "generate --hf " + dir.string() + " --prompt-ids \"1\" --temperature 1.5 -n 8";
  const RunResult three = run_booster(sample + " --seed 7 --num-samples 3");
  INFO(three.err);
  REQUIRE(three.exit_code == 0);
  std::vector<std::string> lines;
  std::istringstream in(three.out);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  REQUIRE(lines.size() == 3);
  for (int i = 0; i < 3; ++i) CHECK(lines[size_t(i)] == testing::last_line(run_booster(sample + " --seed " + std::to_string(7 + i)).out));
  CHECK(lines[0] != lines[1]);
  CHECK_THAT(three.err, Contains("sample 3: generated 8 tokens"));
  check_refused(sample + " --num-samples 0", "--num-samples 0");
}

// A Hugging Face directory's tokenizer.model is used without --tokenizer, and the prompt starts with
// BOS as its tokenizer_config.json says (add_bos_token); --stop ends at a text; a checkpoint with a
// damaged file is refused (its checksums), --no-verify loads it.
TEST_CASE("cli generate: --hf's own tokenizer with its BOS, --stop, and checksums", "[cli][generate][hf]") {
  if (!have("spm_train")) {
    skip_test("spm_train (Debian's sentencepiece) is missing");
    return;
  }
  const fs::path dir = scratch_dir() / "llama_tok";
  fs::remove_all(dir);
  fs::copy(fs::path(BOOSTER_FIXTURE_DIR) / "hf" / "llama", dir);
  const fs::path text = scratch_dir() / "corpus_hf.txt", prefix = scratch_dir() / "tok_hf";
  {
    std::ofstream out(text);
    for (int i = 0; i < 200; ++i) out << "a b c d e f " << i % 5 << "\n";
  }
  // At most 30 ids, below the fixture's 48, with BOS 1 and EOS 2 (SentencePiece's defaults).
  REQUIRE(std::system(("spm_train --input=" + text.string() + " --model_prefix=" + prefix.string() +
                       " --vocab_size=30 --model_type=bpe --hard_vocab_limit=false >" + prefix.string() + ".log 2>&1").c_str()) == 0);
  fs::copy_file(prefix.string() + ".model", dir / "tokenizer.model");
  const std::string cmd = "generate --hf " + dir.string() + " --prompt \"a b\" --temperature 0 --ignore-eos";
  RunResult r = run_booster(cmd + " -n 6");
  INFO(r.err);
  if (r.err.find("built without SentencePiece") != std::string::npos) {
    skip_test("this booster was built without SentencePiece (libsentencepiece-dev)");
    return;
  }
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("(BOS first, as its tokenizer adds it)"));
  CHECK(r.out.rfind("a b", 0) == 0);
  std::ofstream(dir / "tokenizer_config.json") << R"({"add_bos_token": false})";
  r = run_booster(cmd + " -n 6");
  REQUIRE(r.exit_code == 0);
  CHECK(r.err.find("BOS first") == std::string::npos);
  // --stop: the text is cut where the stop text has come (it is printed), or runs to -n.
  const RunResult full = run_booster(cmd + " -n 16");
  REQUIRE(full.exit_code == 0);
  const std::string continuation = full.out.substr(3, 4);  // a few characters of what came after "a b"
  if (continuation.find_first_not_of(" \n") != std::string::npos) {
    const std::string stop = continuation.substr(continuation.find_first_not_of(" \n"), 1);
    const RunResult stopped = run_booster(cmd + " -n 16 --stop \"" + stop + "\"");
    INFO(stopped.err);
    REQUIRE(stopped.exit_code == 0);
    CHECK_THAT(stopped.err, Contains("stopped at the --stop text"));
    CHECK(stopped.out.size() < full.out.size());
    CHECK(full.out.rfind(stopped.out.substr(0, stopped.out.size() - 1), 0) == 0);  // a prefix of the full text
  }
  check_refused("generate --hf " + (fs::path(BOOSTER_FIXTURE_DIR) / "hf" / "llama").string() +
                    " --prompt-ids 1 --stop x", "--stop needs a tokenizer");

  // Checksums: a damaged weight file is refused, naming it.
  const fs::path run = trained_run();
  const fs::path damaged = scratch_dir() / "damaged_run";
  fs::remove_all(damaged);
  fs::copy(run, damaged, fs::copy_options::recursive);
  // The last float of the file: its lowest mantissa byte (a small change), then its top byte (0xff:
  // the exponent of an inf or NaN, so the logits become NaN).
  auto damage = [&](std::streamoff from_end, char byte) {
    std::fstream f(damaged / "checkpoints" / "step-00000004" / "model" / "model.safetensors",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(from_end, std::ios::end);
    f.put(byte);
  };
  damage(-4, '\x5a');
  const std::string step = (damaged / "checkpoints" / "step-00000004").string();
  check_refused("generate --checkpoint " + step + " --prompt-ids 1 -n 2", "model.safetensors", 1);
  CHECK(run_booster("generate --checkpoint " + step + " --prompt-ids 1 -n 2 --no-verify").exit_code == 0);
  damage(-1, '\xff');
  damage(-2, '\xff');
  // Refused instead of sampled: after the line that names the model, one error line.
  const RunResult nan = run_booster("generate --checkpoint " + step + " --prompt-ids 1 -n 2 --no-verify");
  INFO(nan.err);
  CHECK(nan.exit_code == 1);
  CHECK(nan.out.empty());
  CHECK_THAT(testing::last_line(nan.err), Contains("booster: error: generate: the logits of new token 1") &&
                                              Contains("hold NaN or inf"));
}
