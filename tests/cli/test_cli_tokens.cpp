// Token data through the `booster` program: `booster tokenize` with a SentencePiece model trained here
// by spm_train (its ids checked against spm_encode's, an implementation not ours), then `booster check`
// and `booster train` of the GPT on the token files, whose evaluations report val_loss and val_ppl;
// every malformed input is one line on stderr and a non-zero exit.
#include <catch2/catch.hpp>

#include "skip.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "roundoff.h"
#include "run_booster.h"
#include "trajectory.h"

namespace fs = std::filesystem;
using Catch::Contains;
using nlohmann::json;
using testing::read_text;
using testing::RunResult;

namespace {

const fs::path kCorpus = "/usr/share/common-licenses/GPL-3";

fs::path scratch_dir() { return testing::scratch_dir("test_cli_tokens"); }

RunResult run_booster(const std::string& args) { return testing::run_booster_in(scratch_dir(), args); }

bool have(const char* program) { return std::system(("command -v " + std::string(program) + " >/dev/null 2>&1").c_str()) == 0; }

// False when the program's tokenizer is the stub of a build without libsentencepiece.
bool tokenizer_built() {
  static const bool built =
      testing::run_booster_in(scratch_dir() / "probe", "tokenize --model /nonexistent.model --in x --out y")
          .err.find("built without SentencePiece") == std::string::npos;
  return built;
}

// Why the tests cannot run here, or "" when they can.
std::string missing_tools() {
  if (!have("spm_train") || !have("spm_encode")) return "spm_train/spm_encode (Debian's sentencepiece) are missing";
  if (!tokenizer_built()) return "this booster was built without SentencePiece (libsentencepiece-dev)";
  if (!fs::exists(kCorpus)) return kCorpus.string() + " is missing";
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

// spm_encode's ids of a text file, each line followed by </s>: what `booster tokenize` must write.
std::vector<uint32_t> spm_encode_ids(const fs::path& model, const fs::path& text) {
  const fs::path out = scratch_dir() / "spm_encode.txt";
  REQUIRE(std::system(("spm_encode --model=" + model.string() + " --output_format=id --extra_options=eos <" +
                       text.string() + " >" + out.string())
                          .c_str()) == 0);
  std::ifstream in(out);
  std::vector<uint32_t> ids;
  uint32_t id = 0;
  while (in >> id) ids.push_back(id);
  return ids;
}

// The ids of a flat little-endian token file of `width` bytes each.
std::vector<uint32_t> read_token_file(const fs::path& p, int width) {
  const std::string bytes = read_text(p);
  REQUIRE(bytes.size() % size_t(width) == 0);
  std::vector<uint32_t> ids;
  for (size_t k = 0; k < bytes.size(); k += size_t(width)) {
    uint32_t v = 0;
    for (int b = 0; b < width; ++b) v |= uint32_t(uint8_t(bytes[k + size_t(b)])) << (8 * b);
    ids.push_back(v);
  }
  return ids;
}

fs::path write_config(const std::string& name, const json& config) {
  const fs::path p = scratch_dir() / name;
  std::ofstream(p) << config.dump(2);
  return p;
}

json gpt_tokens_config(const fs::path& train, const fs::path& val, const std::string& run) {
  return {{"model", {{"type", "gpt"}, {"vocab_size", 300}, {"context", 32}, {"width", 32}, {"layers", 1}, {"heads", 2}}},
          {"optimizer", {{"type", "adamw"}, {"lr", 0.003}}},
          {"data", {{"type", "tokens"}, {"path", train.string()}, {"val_path", val.string()}, {"seq_len", 32},
                    {"batch_size", 8}, {"eval_batch_size", 64}}},
          {"train", {{"max_steps", 6}, {"eval_every", 3}, {"log_every", 1}, {"seed", 3},
                     {"run_dir", (scratch_dir() / run).string()}}}};
}

// A failure as the program must report it: a non-zero exit and exactly one line on stderr.
void check_one_line_error(const RunResult& r, int exit_code, const std::vector<std::string>& must_contain) {
  INFO("stderr: " << r.err);
  CHECK(r.exit_code == exit_code);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK(r.err.rfind("booster: error: ", 0) == 0);
  for (const std::string& s : must_contain) CHECK_THAT(r.err, Contains(s));
}

}  // namespace

TEST_CASE("booster tokenize writes spm_encode's ids, and booster train on them reports val_loss and val_ppl",
          "[cli][tokens]") {
  if (const std::string why = missing_tools(); !why.empty()) {
    skip_test(why);
    return;
  }
  const fs::path model = tokenizer_model();
  const std::vector<uint32_t> reference = spm_encode_ids(model, kCorpus);
  REQUIRE(reference.size() > 2000);

  const fs::path train = scratch_dir() / "gpl.bin";
  const RunResult r = run_booster("tokenize --model " + model.string() + " --in " + kCorpus.string() + " --out " +
                                  train.string() + " --val-fraction 0.1");
  INFO("stderr: " << r.err);
  REQUIRE(r.exit_code == 0);
  const json summary = json::parse(testing::last_line(r.out));
  const fs::path val = scratch_dir() / "gpl.val.bin";  // OUT with the extension .val.bin
  CHECK(summary["val"]["path"] == val.string());
  CHECK(summary["dtype"] == "uint16");  // 300 ids fit
  CHECK(summary["vocab_size"] == 300);
  const size_t n_val = size_t(double(reference.size()) * 0.1);
  CHECK(summary["train"]["tokens"] == reference.size() - n_val);
  CHECK(summary["val"]["tokens"] == n_val);
  CHECK_THAT(r.err, Contains(train.string()) && Contains(std::to_string(reference.size() - n_val) + " uint16 tokens"));
  // The files hold spm_encode's ids: the first 90% and the rest.
  std::vector<uint32_t> written = read_token_file(train, 2);
  const std::vector<uint32_t> written_val = read_token_file(val, 2);
  CHECK(written_val.size() == n_val);
  written.insert(written.end(), written_val.begin(), written_val.end());
  CHECK(written == reference);

  // uint32 when asked, and without a validation file when no fraction is given.
  const fs::path wide = scratch_dir() / "gpl32.bin";
  REQUIRE(run_booster("tokenize -m " + model.string() + " -i " + kCorpus.string() + " -o " + wide.string() +
                      " --dtype uint32")
              .exit_code == 0);
  CHECK(read_token_file(wide, 4) == reference);
  CHECK(!fs::exists(scratch_dir() / "gpl32.val.bin"));

  // check, then train: the evaluations report val_loss and val_ppl = exp(val_loss).
  const fs::path config = write_config("tokens.json", gpt_tokens_config(train, val, "run"));
  const RunResult checked = run_booster("check --config " + config.string());
  INFO("check stderr: " << checked.err);
  CHECK(checked.exit_code == 0);
  const RunResult trained = run_booster("train --config " + config.string());
  INFO("train stderr: " << trained.err);
  REQUIRE(trained.exit_code == 0);
  const json result = json::parse(testing::last_line(trained.out));
  CHECK(result["steps"] == 6);
  REQUIRE(result["val_loss"].is_number());
  REQUIRE(result["val_ppl"].is_number());
  CHECK(result["val_ppl"].get<double>() == Approx(std::exp(result["val_loss"].get<double>())).epsilon(1e-12));
  // Untrained, a 300-way prediction costs about log(300); six steps cannot have made it much better.
  CHECK(result["val_loss"].get<double>() > 3.0);
  CHECK(result["val_loss"].get<double>() < 7.0);
  CHECK(result["tokens_per_second"].is_number());
  CHECK_THAT(trained.err, Contains("val ppl"));
  std::istringstream metrics(read_text(scratch_dir() / "run" / "metrics.jsonl"));
  std::string line;
  int evals = 0;
  while (std::getline(metrics, line)) {
    const json record = json::parse(line);
    if (record["kind"] != "eval") continue;
    ++evals;
    CHECK(record["val_ppl"].get<double>() == Approx(std::exp(record["val_loss"].get<double>())).epsilon(1e-12));
    CHECK(record["val_loss"] == record["test_loss"]);
    CHECK(record["samples"] == int64_t(n_val - 1) / 32);  // every val sample, each once
  }
  CHECK(evals == 2);  // steps 3 and 6
}

TEST_CASE("booster tokenize and token data: malformed inputs are one line and a non-zero exit", "[cli][tokens]") {
  const std::string why = missing_tools();
  const fs::path dir = scratch_dir();
  std::ofstream(dir / "corrupt.model", std::ios::binary) << "not a sentencepiece model\n";
  std::ofstream(dir / "text.txt") << "a few words\n";

  // Usage mistakes: exit 2.
  check_one_line_error(run_booster("tokenize --in " + (dir / "text.txt").string() + " --out x.bin"), 2, {"--model"});
  check_one_line_error(run_booster("tokenize --model m --in " + (dir / "text.txt").string()), 2, {"--out"});
  check_one_line_error(run_booster("tokenize --model m --in t --out o --val-fraction 1.5"), 2, {"--val-fraction 1.5"});
  check_one_line_error(run_booster("tokenize --model m --in t --out o --bogus"), 2, {"bogus"});
  // A missing or corrupt model: exit 1, naming the file (in a build without SentencePiece, the stub's error).
  const std::vector<std::string> corrupt_says = {(dir / "corrupt.model").string(),
                                                 tokenizer_built() ? "not a SentencePiece model" : "without SentencePiece"};
  check_one_line_error(run_booster("tokenize --model " + (dir / "absent.model").string() + " --in " +
                                   (dir / "text.txt").string() + " --out " + (dir / "o.bin").string()),
                       1, {(dir / "absent.model").string()});
  check_one_line_error(run_booster("tokenize --model " + (dir / "corrupt.model").string() + " --in " +
                                   (dir / "text.txt").string() + " --out " + (dir / "o.bin").string()),
                       1, corrupt_says);

  // Token files that are not: each refused by check and by train, naming the file and the offset.
  std::string odd(201, '\x05');
  std::ofstream(dir / "odd.bin", std::ios::binary) << odd;
  std::string good;
  for (int k = 0; k < 400; ++k) good += std::string{char(k % 250), '\0'};
  std::ofstream(dir / "good.bin", std::ios::binary) << good;
  std::string lying(1024, '\0');
  const int32_t header[3] = {20240520, 1, 1000};
  std::memcpy(lying.data(), header, sizeof header);
  lying += std::string(200, '\x01');  // 100 tokens, not 1000
  std::ofstream(dir / "lying.bin", std::ios::binary) << lying;
  std::string past = good;
  past[2 * 77] = char(0x2c), past[2 * 77 + 1] = char(0x01);  // token 77 is 300, past a 300-id vocabulary
  std::ofstream(dir / "past.bin", std::ios::binary) << past;
  struct Case {
    std::string file;
    std::vector<std::string> expect;
  };
  for (const Case& c : {Case{"odd.bin", {"odd.bin", "201 bytes", "byte offset 200"}},
                        Case{"lying.bin", {"lying.bin", "says 1000 tokens", "byte offset 8"}},
                        Case{"past.bin", {"past.bin", "token id 300", "token offset 77", "byte offset 154"}}}) {
    INFO(c.file);
    for (const bool as_val : {false, true}) {
      const fs::path config = write_config("bad_" + c.file + ".json",
                                           gpt_tokens_config(as_val ? dir / "good.bin" : dir / c.file,
                                                             as_val ? dir / c.file : dir / "good.bin", "bad_run"));
      check_one_line_error(run_booster("check --config " + config.string()), 1, c.expect);
      check_one_line_error(run_booster("train --config " + config.string()), 1, c.expect);
    }
  }
  // Text data with a tokenizer that is not one.
  json text = gpt_tokens_config(dir / "good.bin", dir / "good.bin", "text_run");
  text["data"] = {{"type", "text"}, {"path", (dir / "text.txt").string()}, {"context", 4},
                  {"tokenizer", (dir / "corrupt.model").string()}};
  check_one_line_error(run_booster("train --config " + write_config("bad_text.json", text).string()), 1, corrupt_says);

  // A good tokenizer with a vocabulary larger than the model's: a config mistake, exit 2.
  if (!why.empty()) {
    skip_test(why);
    return;
  }
  const std::string model = tokenizer_model().string();
  // A missing text, an unknown dtype, a validation share of less than one token.
  check_one_line_error(run_booster("tokenize --model " + model + " --in " + (dir / "absent.txt").string() + " --out o.bin"),
                       1, {(dir / "absent.txt").string()});
  check_one_line_error(run_booster("tokenize --model " + model + " --in " + (dir / "text.txt").string() +
                                   " --out o.bin --dtype uint8"),
                       2, {"\"uint8\""});
  check_one_line_error(run_booster("tokenize --model " + model + " --in " + (dir / "text.txt").string() +
                                   " --out o.bin --val-fraction 0.01"),
                       1, {"less than one token"});
  text["data"]["tokenizer"] = model;
  text["model"]["vocab_size"] = 256;
  check_one_line_error(run_booster("check --config " + write_config("small_vocab.json", text).string()), 2,
                       {"'model.vocab_size' is 256", "300 ids"});
}

TEST_CASE("token data resumes across world sizes: 2 ranks for 3 steps, then 1 for 3, as 1 for 6", "[cli][tokens][mpi][roundoff]") {
  if (const std::string why = missing_tools(); !why.empty()) {
    skip_test(why);
    return;
  }
  if (!testing::have_mpirun()) {
    skip_test("mpirun is missing: the two-rank half of this test cannot run");
    return;
  }
  const fs::path model = tokenizer_model();
  const fs::path train = scratch_dir() / "layout.bin", val = scratch_dir() / "layout.val.bin";
  REQUIRE(run_booster("tokenize --model " + model.string() + " --in " + kCorpus.string() + " --out " + train.string() +
                      " --val-fraction 0.1")
              .exit_code == 0);
  // SGD, so the only difference between the layouts is the order in which two ranks' gradients are
  // summed (Note [Resuming across layouts]); shuffled, so a wrong resume position would show.
  json c = gpt_tokens_config(train, val, "layout_one");
  c["optimizer"] = {{"type", "sgd"}, {"lr", 0.1}};
  c["data"]["batch_size"] = 16;
  c["train"]["checkpoint_every"] = 1;  // every step of the reference: the path of the bound below
  c["train"]["keep_last"] = 0;
  const fs::path config = write_config("layout.json", c);
  const std::string env = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1";
  const RunResult one = testing::run_booster_in(scratch_dir(), "train --config " + config.string(), env);
  REQUIRE(one.exit_code == 0);
  const std::string bin = std::string(BOOSTER_BIN_DIR) + "/booster";
  const std::string two_dir = (scratch_dir() / "layout_two").string();
  const RunResult two = testing::run_booster_in(
      scratch_dir(),
      "run -n 2 -- " + bin + " train --config " + config.string() + " --plugin ddp --set data.batch_size=8" +
          " --set train.max_steps=3 --set train.run_dir=" + two_dir,
      env);
  INFO("two ranks: " << two.err);
  REQUIRE(two.exit_code == 0);
  const RunResult resumed = testing::run_booster_in(
      scratch_dir(), "train --config " + config.string() + " --set train.run_dir=" + two_dir + " --resume latest", env);
  INFO("resumed: " << resumed.err);
  REQUIRE(resumed.exit_code == 0);
  CHECK_THAT(resumed.err, Contains("from a checkpoint of 2 (ddp)"));
  const json b = json::parse(testing::last_line(resumed.out));
  CHECK(b["steps"] == 6);
  // float32 sums of two halves instead of one whole: the weights end within the SGD bound of Note
  // [Roundoff bounds] (tests/roundoff.h) along the single run's path, for this GPT's reductions
  // (width 32, 1 layer, 2 heads, context 32, vocabulary 300, 16 sequences).
  namespace ro = ::testing::roundoff;
  const fs::path one_ckpt = scratch_dir() / "layout_one" / "checkpoints", two_ckpt = fs::path(two_dir) / "checkpoints";
  const double path = testing::checkpoint_path(one_ckpt, 6, c.at("model"), 3);
  const double bound = ro::sgd_bound(path, ro::reduction_bound({2 * ro::gpt_forward_length(32, 1, 2, 32, 300, 16), 16 * 32}));
  const double d = testing::l2_distance(testing::weights_at(testing::step_path(two_ckpt, 6)),
                                        testing::weights_at(testing::step_path(one_ckpt, 6)));
  INFO("|difference| " << d << ", bound " << bound);
  CHECK(d <= bound);
}

// An output that names one of the inputs, however spelled, would overwrite the text or the tokenizer
// (or one output the other): refused before anything is written, the files left as they were.
TEST_CASE("booster tokenize refuses an output that is its input text or tokenizer and leaves them intact",
          "[cli][tokens][errors]") {
  const std::string why = missing_tools();
  if (!why.empty()) {
    skip_test(why);
    return;
  }
  const fs::path dir = scratch_dir() / "same_file";
  fs::create_directories(dir);
  fs::copy_file(tokenizer_model(), dir / "tok.model", fs::copy_options::overwrite_existing);
  fs::copy_file(kCorpus, dir / "text.txt", fs::copy_options::overwrite_existing);
  const std::string text = read_text(dir / "text.txt"), tok = read_text(dir / "tok.model");
  auto run_in_dir = [&](const std::string& args) {
    return testing::run_booster_in(dir, "tokenize --model tok.model --in text.txt " + args);
  };
  check_one_line_error(run_in_dir("--out ./text.txt"), 2, {"--out ./text.txt", "--in text", "overwrite the text"});
  check_one_line_error(run_in_dir("--out " + (dir / "tok.model").string()), 2, {"--model tokenizer", "overwrite"});
  check_one_line_error(run_in_dir("--out train.bin --val-fraction 0.1 --val-out text.txt"), 2,
                       {"--val-out text.txt", "overwrite the text"});
  check_one_line_error(run_in_dir("--out train.bin --val-fraction 0.1 --val-out ./train.bin"), 2,
                       {"--val-out ./train.bin", "same file as --out"});
  // An output whose description (OUT.json) would overwrite an input.
  fs::copy_file(dir / "text.txt", dir / "notes.json", fs::copy_options::overwrite_existing);
  check_one_line_error(testing::run_booster_in(dir, "tokenize --model tok.model --in notes.json --out notes"), 2,
                       {"--out's description notes.json", "overwrite the text"});
  CHECK(read_text(dir / "notes.json") == text);
  CHECK(read_text(dir / "text.txt") == text);
  CHECK(read_text(dir / "tok.model") == tok);
  CHECK_FALSE(fs::exists(dir / "train.bin"));
  // Distinct files are written as before.
  const RunResult ok = run_in_dir("--out train.bin --val-fraction 0.1");
  INFO(ok.err);
  CHECK(ok.exit_code == 0);
  CHECK(fs::exists(dir / "train.bin"));
  CHECK(fs::exists(dir / "train.val.bin"));
  CHECK(read_text(dir / "text.txt") == text);
}

// Note [Token file descriptions]: tokenize describes what it wrote, and check and train hold token data
// to it; a headerless uint32 file read as uint16 is caught by its bytes.
TEST_CASE("booster tokenize describes its files, and check and train refuse tokens read as another dtype",
          "[cli][tokens][dtype]") {
  const fs::path dir = scratch_dir() / "dtype";
  fs::create_directories(dir);
  // A headerless uint32 file, written by another tool, declared uint16: refused before any step.
  std::string wide;
  for (uint32_t k = 0; k < 2000; ++k) {
    const uint32_t id = (k * 37) % 300;
    wide += std::string{char(id & 0xFF), char(id >> 8), '\0', '\0'};
  }
  std::ofstream(dir / "wide.bin", std::ios::binary) << wide;
  json c = gpt_tokens_config(dir / "wide.bin", dir / "wide.bin", "dtype_run");
  c["data"].erase("val_path");
  const fs::path headerless = write_config("dtype_headerless.json", c);
  check_one_line_error(run_booster("check --config " + headerless.string()), 2,
                       {(dir / "wide.bin").string(), "looks like uint32", "data.dtype: \"uint32\""});
  check_one_line_error(run_booster("train --config " + headerless.string()), 2, {"looks like uint32"});
  c["data"]["dtype"] = "uint32";
  CHECK(run_booster("check --config " + write_config("dtype_headerless_ok.json", c).string()).exit_code == 0);

  if (const std::string why = missing_tools(); !why.empty()) {
    skip_test(why);
    return;
  }
  const fs::path model = tokenizer_model();
  const fs::path train = dir / "gpl.bin", val = dir / "gpl.val.bin";
  const RunResult r = run_booster("tokenize --model " + model.string() + " --in " + kCorpus.string() + " --out " +
                                  train.string() + " --val-fraction 0.1");
  INFO("stderr: " << r.err);
  REQUIRE(r.exit_code == 0);
  const json summary = json::parse(testing::last_line(r.out));
  for (const auto& [file, tokens] : {std::pair{train, summary["train"]["tokens"]}, {val, summary["val"]["tokens"]}}) {
    const json d = json::parse(read_text(file.string() + ".json"));
    CHECK(d["dtype"] == "uint16");
    CHECK(d["tokens"] == tokens);
    CHECK(d["vocab_size"] == 300);
    CHECK(d["tokenizer"]["path"] == model.string());
    CHECK(d["tokenizer"]["kind"] == "sentencepiece");
  }
  // uint16 files declared uint32 (the file or the validation file): a config mistake naming both dtypes.
  json declared = gpt_tokens_config(train, val, "dtype_run");
  declared["data"]["dtype"] = "uint32";
  const fs::path wrong = write_config("dtype_wrong.json", declared);
  check_one_line_error(run_booster("check --config " + wrong.string()), 2,
                       {train.string(), "holds uint16 tokens", "data.dtype is \"uint32\"", "set data.dtype: \"uint16\""});
  check_one_line_error(run_booster("train --config " + wrong.string()), 2, {"set data.dtype: \"uint16\""});
  // And uint32 files declared uint16.
  REQUIRE(run_booster("tokenize --model " + model.string() + " --in " + kCorpus.string() + " --out " +
                      (dir / "gpl32.bin").string() + " --dtype uint32")
              .exit_code == 0);
  json wide_declared = gpt_tokens_config(dir / "gpl32.bin", val, "dtype_run");
  const fs::path narrow = write_config("dtype_narrow.json", wide_declared);
  check_one_line_error(run_booster("check --config " + narrow.string()), 2,
                       {"gpl32.bin", "holds uint32 tokens", "data.dtype is \"uint16\"", "set data.dtype: \"uint32\""});
  // A model smaller than the tokenizer the description names.
  json small = gpt_tokens_config(train, val, "dtype_run");
  small["model"]["vocab_size"] = 256;
  check_one_line_error(run_booster("check --config " + write_config("dtype_small_vocab.json", small).string()), 2,
                       {model.string() + " of 300 ids", "vocabulary of 256"});
}

// Note [Token shards]: tokenize concatenates its inputs; token data reads shards as one and holds out
// the end of the last as validation.
TEST_CASE("booster tokenize of several files, and training on shards with val_fraction", "[cli][tokens][shards]") {
  if (const std::string why = missing_tools(); !why.empty()) {
    skip_test(why);
    return;
  }
  const fs::path dir = scratch_dir() / "shards";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path model = tokenizer_model();
  // The GPL in two files, cut at a line; the second without its final newline.
  const std::string text = read_text(kCorpus);
  const size_t cut = text.find('\n', text.size() / 2) + 1;
  std::ofstream(dir / "a.txt", std::ios::binary) << text.substr(0, cut);
  std::ofstream(dir / "b.txt", std::ios::binary) << text.substr(cut, text.size() - cut - 1);
  const std::vector<uint32_t> reference = spm_encode_ids(model, kCorpus);
  for (const std::string& ins : {"--in " + (dir / "a.txt").string() + " --in " + (dir / "b.txt").string(),
                                 "--in " + (dir / "a.txt").string() + " " + (dir / "b.txt").string()}) {
    INFO(ins);
    const RunResult r =
        run_booster("tokenize --model " + model.string() + " " + ins + " --out " + (dir / "both.bin").string());
    INFO("stderr: " << r.err);
    REQUIRE(r.exit_code == 0);
    // Each line's ids and </s>, the files one after the other: the whole GPL's ids.
    CHECK(read_token_file(dir / "both.bin", 2) == reference);
    const json summary = json::parse(testing::last_line(r.out));
    CHECK(summary["inputs"] == json::array({(dir / "a.txt").string(), (dir / "b.txt").string()}));
    CHECK(json::parse(read_text(dir / "both.bin.json"))["tokens"] == reference.size());
  }
  // An input that is missing is named before anything is encoded or written.
  check_one_line_error(run_booster("tokenize --model " + model.string() + " --in " + (dir / "a.txt").string() +
                                   " --in " + (dir / "absent.txt").string() + " --out " + (dir / "never.bin").string()),
                       1, {(dir / "absent.txt").string()});
  CHECK_FALSE(fs::exists(dir / "never.bin"));

  // Two shards, trained on as one with the end of the last held out.
  for (const char* part : {"a", "b"})
    REQUIRE(run_booster("tokenize --model " + model.string() + " --in " + (dir / (std::string(part) + ".txt")).string() +
                        " --out " + (dir / ("shard_" + std::string(part) + ".bin")).string())
                .exit_code == 0);
  const int64_t n_b = int64_t(read_token_file(dir / "shard_b.bin", 2).size());
  json c = gpt_tokens_config(dir / "unused", dir / "unused", "shards_run");
  c["data"].erase("val_path");
  c["data"]["path"] = (dir / "shard_*.bin").string();
  c["data"]["val_fraction"] = 0.1;
  c["train"]["max_steps"] = 2;
  c["train"]["eval_every"] = 2;
  const fs::path config = write_config("shards.json", c);
  const RunResult checked = run_booster("check --config " + config.string());
  INFO("check stderr: " << checked.err);
  CHECK(checked.exit_code == 0);
  const RunResult trained = run_booster("train --config " + config.string());
  INFO("train stderr: " << trained.err);
  REQUIRE(trained.exit_code == 0);
  CHECK_THAT(trained.err, Contains("shard_a.bin") && Contains("shard_b.bin"));
  std::istringstream metrics(read_text(scratch_dir() / "shards_run" / "metrics.jsonl"));
  std::string line;
  int evals = 0;
  while (std::getline(metrics, line)) {
    const json record = json::parse(line);
    if (record["kind"] != "eval") continue;
    ++evals;
    CHECK(record["samples"] == (int64_t(double(n_b) * 0.1) - 1) / 32);  // the last tenth of shard_b
  }
  CHECK(evals == 1);

  // Mistakes: a glob that matches nothing, val_fraction beside val_path.
  json nothing = c;
  nothing["data"]["path"] = (dir / "shard_*.tokens").string();
  check_one_line_error(run_booster("check --config " + write_config("shards_nothing.json", nothing).string()), 2,
                       {(dir / "shard_*.tokens").string(), "matches no file"});
  json both = c;
  both["data"]["val_path"] = (dir / "shard_b.bin").string();
  check_one_line_error(run_booster("check --config " + write_config("shards_both.json", both).string()), 2,
                       {"'data.val_fraction'", "'data.val_path'"});
}
