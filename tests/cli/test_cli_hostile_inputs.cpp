// Hostile inputs through the `booster` program, each made in a scratch directory (nothing large is
// committed): sizes a model cannot have (Note [Sizes before building] in nn/model_size.h) and inputs
// that are not files or never end (Note [Inputs that are not files] in common/input_file.h). Each used
// to hang, grow without end or fail in the allocator; each runs under `timeout -s KILL 20`, so a
// regression fails as exit 137 in seconds instead of hanging the suite, and must end in one line naming
// the field or the file.
#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "run_booster.h"

namespace fs = std::filesystem;
using testing::RunResult;
using Catch::Contains;
using nlohmann::json;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_hostile_inputs"); }

// Every run is bounded: a hang is killed after 20 s (exit 137).
// SIGKILL: booster defers SIGTERM until a step ends, which a hung open() never reaches.
const char* kEnv = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout -s KILL 20";

RunResult run_cli(const std::string& args) { return testing::run_booster_in(scratch_dir(), args, kEnv); }

// Ended on its own (not by the timeout) with exit `code` and one line on stderr naming each of `parts`.
void check_refused(const RunResult& r, int code, const std::vector<std::string>& parts) {
  INFO("stderr: " << r.err);
  CHECK(r.exit_code == code);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK(r.err.rfind("booster: error: ", 0) == 0);
  for (const std::string& p : parts) CHECK_THAT(r.err, Contains(p));
}

// A copy of the Hugging Face fixture `name` in the scratch directory, as `copy`.
fs::path hf_copy(const std::string& name, const std::string& copy) {
  const fs::path dir = scratch_dir() / copy;
  fs::remove_all(dir);
  fs::copy(fs::path(BOOSTER_FIXTURE_DIR) / "hf" / name, dir, fs::copy_options::recursive);
  return dir;
}

// `dir`/config.json with `key` set to `value`.
void set_config_key(const fs::path& dir, const std::string& key, const json& value) {
  json c = json::parse(std::ifstream(dir / "config.json"));
  c[key] = value;
  std::ofstream(dir / "config.json") << c.dump(2);
}

fs::path make_fifo(const fs::path& path) {
  fs::remove(path);
  REQUIRE(::mkfifo(path.c_str(), 0600) == 0);
  return path;
}

// A sparse file of `bytes` (no disk used): a regular file past a reader's limit.
fs::path sparse_file(const fs::path& path, uintmax_t bytes) {
  std::ofstream(path).put('x');
  fs::resize_file(path, bytes);
  return path;
}

RunResult generate_hf(const fs::path& dir) { return run_cli("generate --hf " + dir.string() + " --prompt-ids '1 2' -n 2"); }

// 512 uint16 token ids below the fixtures' vocabulary of 48.
fs::path token_file() {
  const fs::path p = scratch_dir() / "tokens.bin";
  std::vector<uint16_t> ids;
  for (int i = 0; i < 512; ++i) ids.push_back(uint16_t((i * 7) % 48));
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(ids.data()), std::streamsize(ids.size() * 2));
  return p;
}

fs::path train_config(const std::string& name, const json& model) {
  const json c = {{"model", model},
                  {"optimizer", {{"type", "sgd"}, {"lr", 0.05}}},
                  {"data", {{"type", "tokens"}, {"path", token_file().string()}, {"dtype", "uint16"}, {"seq_len", 8},
                            {"batch_size", 4}}},
                  {"train", {{"max_steps", 1}, {"seed", 3}}}};
  const fs::path p = scratch_dir() / name;
  std::ofstream(p) << c.dump(2);
  return p;
}

const fs::path kTokenizer = fs::path(BOOSTER_FIXTURE_DIR) / "bpe" / "gpt2" / "tokenizer.json";

}  // namespace

// ------------------------------------------------------------------------------------ sizes

TEST_CASE("an hf config.json with vocab_size 10^12 is refused against its weights before building", "[cli][hostile]") {
  // It used to build the embedding deferred and skip 10^12 x 16 draws for minutes.
  const fs::path dir = hf_copy("llama_tied_bf16", "vocab");
  set_config_key(dir, "vocab_size", int64_t(1'000'000'000'000));
  check_refused(generate_hf(dir), 2,
                {(dir / "config.json").string(), "\"vocab_size\" is 1000000000000", "model.embed_tokens.weight [48, 16]",
                 "48 rows"});
}

TEST_CASE("an hf config.json with num_hidden_layers 10^6 is refused against its weights before building",
          "[cli][hostile]") {
  // It used to build a million layers, memory growing with nothing printed.
  const fs::path dir = hf_copy("llama", "layers");
  set_config_key(dir, "num_hidden_layers", 1'000'000);
  check_refused(generate_hf(dir), 2, {"\"num_hidden_layers\" is 1000000", "the weights hold 2 layers"});
  // GPT-2's keys too.
  const fs::path gpt = hf_copy("gpt2", "gpt_layers");
  set_config_key(gpt, "n_layer", 1'000'000);
  check_refused(generate_hf(gpt), 2, {"\"n_layer\" is 1000000", "the weights hold 2 layers"});
}

TEST_CASE("model.hf whose config.json says hidden_size 2^40 is refused by booster check and train", "[cli][hostile]") {
  const fs::path dir = hf_copy("llama", "hidden");
  set_config_key(dir, "hidden_size", int64_t(1) << 40);
  const fs::path cfg = train_config("hf_hidden.json", {{"type", "hf"}, {"path", dir.string()}});
  for (const char* command : {"check", "train"}) {
    INFO(command);
    check_refused(run_cli(std::string(command) + " --config " + cfg.string()), 2,
                  {"\"hidden_size\" is 1099511627776", "model.embed_tokens.weight [48, 16]", "16 columns"});
  }
}

TEST_CASE("a booster llama config with hidden_size 2^40 is refused by name and limit, not by the allocator",
          "[cli][hostile]") {
  json model = {{"type", "llama"},          {"vocab_size", 48},         {"hidden_size", int64_t(1) << 40},
                {"intermediate_size", 32},  {"num_hidden_layers", 2},   {"num_attention_heads", 4},
                {"max_position_embeddings", 32}};
  // Before: "out of host memory: cannot allocate 4294967296.0 PiB ... while building model 'llama'".
  check_refused(run_cli("check --config " + train_config("hidden.json", model).string()), 2,
                {"'model.hidden_size' is 1099511627776", "limit of 16777216"});
  // Sizes each within the width limit whose product is not: the parameter count, named with the sizes.
  model["hidden_size"] = 1 << 24;
  model["vocab_size"] = 1 << 24;
  model["num_attention_heads"] = 1 << 12;
  check_refused(run_cli("check --config " + train_config("product.json", model).string()), 2,
                {"'model.vocab_size' 16777216", "'model.hidden_size' 16777216", "limit of 2^40"});
  // An MLP's widths too.
  const json mlp = {{"type", "mlp"}, {"in", int64_t(1) << 40}, {"hidden", {4}}, {"classes", 2}};
  const json c = {{"model", mlp},
                  {"optimizer", {{"type", "sgd"}, {"lr", 0.05}}},
                  {"data", {{"type", "synthetic"}, {"num_features", int64_t(1) << 40}, {"num_classes", 2}}}};
  std::ofstream(scratch_dir() / "mlp.json") << c.dump();
  const RunResult r = run_cli("check --config " + (scratch_dir() / "mlp.json").string());
  INFO(r.err);
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Contains("limit of 16777216"));
}

// ------------------------------------------------------------------------------------ endless inputs

TEST_CASE("a FIFO as an hf config.json is refused, not waited on", "[cli][hostile]") {
  const fs::path dir = hf_copy("llama_tied_bf16", "fifo_config");
  fs::remove(dir / "config.json");
  make_fifo(dir / "config.json");
  check_refused(generate_hf(dir), 2, {(dir / "config.json").string(), "is a FIFO"});
}

TEST_CASE("a FIFO as model.safetensors is refused, not waited on", "[cli][hostile]") {
  const fs::path dir = hf_copy("llama_tied_bf16", "fifo_weights");
  make_fifo(dir / "model.safetensors");
  check_refused(generate_hf(dir), 1, {(dir / "model.safetensors").string(), "is a FIFO"});
}

TEST_CASE("run --hostfile a FIFO nobody writes to is refused after 10 s, not waited on", "[cli][hostile]") {
  const fs::path fifo = make_fifo(scratch_dir() / "hosts_fifo");
  check_refused(run_cli("run -n 2 --hostfile " + fifo.string() + " --dry-run -- true"), 2,
                {"the hostfile " + fifo.string() + " is a FIFO (named pipe) that nothing was written to for 10 s"});
}

TEST_CASE("run --hostfile a pipe that never ends is refused past 1 MiB", "[cli][hostile]") {
  // `yes` writes for ever: the hostfile used to grow in memory until the machine ran out.
  const fs::path fifo = make_fifo(scratch_dir() / "hosts_yes");
  const RunResult r = testing::run_booster_in(
      scratch_dir(), "run -n 2 --hostfile " + fifo.string() + " --dry-run -- true",
      "(timeout 30 sh -c 'yes localhost slots=1 > " + fifo.string() + "' >/dev/null 2>&1 &); " + kEnv);
  check_refused(r, 2, {"the hostfile " + fifo.string() + " is a FIFO (named pipe) that gave more than its limit of 1.0 MiB"});
  // A pipe that ends is read as a file is (bash's --hostfile <(...)).
  const RunResult ok = testing::run_booster_in(
      scratch_dir(), "run -n 2 --hostfile " + fifo.string() + " --dry-run -- true",
      "(timeout 30 sh -c 'echo localhost slots=2 > " + fifo.string() + "' >/dev/null 2>&1 &); " + kEnv);
  INFO(ok.err);
  CHECK(ok.exit_code == 0);
}

TEST_CASE("run --hostfile /dev/zero or a hostfile past 1 MiB is refused before it is read", "[cli][hostile]") {
  // /dev/zero used to be read into memory until the machine ran out.
  check_refused(run_cli("run -n 2 --hostfile /dev/zero --dry-run -- true"), 2,
                {"the hostfile /dev/zero is a character device"});
  const fs::path big = sparse_file(scratch_dir() / "big_hosts", uintmax_t(2) << 20);
  check_refused(run_cli("run -n 2 --hostfile " + big.string() + " --dry-run -- true"), 2,
                {big.string() + " is 2.0 MiB, more than its limit of 1.0 MiB"});
}

TEST_CASE("tokenize --in a FIFO nobody writes to is refused after 10 s, not waited on", "[cli][hostile]") {
  const fs::path fifo = make_fifo(scratch_dir() / "text_fifo");
  const fs::path out = scratch_dir() / "fifo.bin";
  check_refused(run_cli("tokenize --model " + kTokenizer.string() + " --in " + fifo.string() + " --out " + out.string()),
                1, {"--in " + fifo.string() + " is a FIFO (named pipe) that nothing was written to for 10 s"});
  CHECK_FALSE(fs::exists(out));
  // A pipe that is written to and ends is tokenized (--in <(zcat corpus.gz)).
  const RunResult ok = testing::run_booster_in(
      scratch_dir(), "tokenize --model " + kTokenizer.string() + " --in " + fifo.string() + " --out " + out.string(),
      "(timeout 30 sh -c 'echo hello world > " + fifo.string() + "' >/dev/null 2>&1 &); " + kEnv);
  INFO(ok.err);
  CHECK(ok.exit_code == 0);
  CHECK(fs::exists(out));
}

TEST_CASE("tokenize --in /dev/zero or a text past 1 GiB is refused before it is read", "[cli][hostile]") {
  check_refused(run_cli("tokenize --model " + kTokenizer.string() + " --in /dev/zero --out " +
                        (scratch_dir() / "zero.bin").string()),
                1, {"--in /dev/zero is a character device"});
  const fs::path big = sparse_file(scratch_dir() / "big.txt", uintmax_t(3) << 29);
  check_refused(run_cli("tokenize --model " + kTokenizer.string() + " --in " + big.string() + " --out " +
                        (scratch_dir() / "big.bin").string()),
                1, {big.string() + " is 1.5 GiB, more than its limit of 1.0 GiB"});
  // Two texts under the limit each, past it together.
  const fs::path half = sparse_file(scratch_dir() / "half.txt", uintmax_t(600) << 20);
  check_refused(run_cli("tokenize --model " + kTokenizer.string() + " --in " + half.string() + " " + half.string() +
                        " --out " + (scratch_dir() / "halves.bin").string()),
                1, {"the --in texts total 1.2 GiB", "more than the limit of 1.0 GiB"});
  fs::remove(big);
  fs::remove(half);
}

TEST_CASE("plot of /dev/zero is refused, and plot of a pipe reads it", "[cli][hostile]") {
  // /dev/zero used to be read as one endless line.
  const fs::path png = scratch_dir() / "plot.png";
  check_refused(run_cli("plot --out " + png.string() + " /dev/zero"), 2, {"plot: /dev/zero is a character device"});
  check_refused(run_cli("plot --doctor /dev/zero --out " + png.string()), 2, {"plot: /dev/zero is a character device"});
  const fs::path fifo = make_fifo(scratch_dir() / "metrics_fifo");
  const fs::path records = scratch_dir() / "metrics_records.jsonl";
  std::ofstream(records) << R"({"kind":"train","step":1,"loss":2})" << "\n" << R"({"kind":"train","step":2,"loss":1.5})" << "\n";
  const RunResult ok = testing::run_booster_in(
      scratch_dir(), "plot --out " + png.string() + " " + fifo.string(),
      "(timeout 30 sh -c 'cat " + records.string() + " > " + fifo.string() + "' >/dev/null 2>&1 &); " + kEnv);
  INFO(ok.err);
  CHECK(ok.exit_code == 0);
  CHECK(fs::exists(png));
}
