// Hostile inputs through the `booster` program, each made in a scratch directory (nothing large is
// committed): inputs that are not files or never end (Note [Inputs that are not files] in
// common/input_file.h). Each used
// to hang, grow without end or fail in the allocator; each runs under `timeout 20`, so a regression
// fails as exit 124 in seconds instead of hanging the suite, and must end in one line naming the
// field or the file.
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

// Every run is bounded: a hang is exit 124 after 20 s.
const char* kEnv = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout 20";

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

const fs::path kTokenizer = fs::path(BOOSTER_FIXTURE_DIR) / "bpe" / "gpt2" / "tokenizer.json";

}  // namespace

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
