// Faults from outside the program while `booster train` runs (issue 48 items 7-9), through the binary:
// a token file cut short under a running job (Note [Token files cut short] in booster/data/tokens.h), two
// runs on one run directory (the run directory's lock in Trainer::fit), and a model library that crashes
// in its factory or its forward (Note [Naming the code that crashed] in booster/common/fatal_signal.h).
// Each run is bounded by `timeout`, so a regression fails within a minute instead of hanging.
#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/common/error.h"
#include "booster/data/tokens.h"
#include "run_booster.h"
#include "skip.h"

namespace fs = std::filesystem;
using Catch::Contains;
using nlohmann::json;
using testing::RunResult;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_faults"); }

const std::string kEnv = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1";

fs::path write_config(const std::string& name, const json& config) {
  const fs::path file = scratch_dir() / name;
  std::ofstream(file) << config.dump(2);
  return file;
}

// `n` uint16 token ids below 64 in a flat file (no description: the dtype is data.dtype's).
fs::path write_tokens(const fs::path& file, int64_t n) {
  std::mt19937 gen(7);
  std::vector<uint16_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) id = uint16_t(1 + gen() % 63);
  std::ofstream(file, std::ios::binary).write(reinterpret_cast<const char*>(ids.data()), std::streamsize(n * 2));
  return file;
}

// A tiny GPT on `tokens` that would train for a long time: the tests end it, or a fault does.
json long_gpt_run(const fs::path& tokens, const fs::path& run_dir) {
  return {{"model", {{"type", "gpt"}, {"vocab_size", 64}, {"context", 16}, {"width", 16}, {"layers", 1}, {"heads", 2}}},
          {"optimizer", {{"type", "adamw"}, {"lr", 0.001}}},
          {"criterion", {{"type", "cross_entropy"}}},
          {"data", {{"type", "tokens"}, {"path", tokens.string()}, {"dtype", "uint16"}, {"seq_len", 16}, {"batch_size", 4}}},
          {"train", {{"max_steps", 1000000}, {"epochs", 1000}, {"log_every", 1}, {"seed", 1}, {"run_dir", run_dir.string()}}}};
}

// `booster train` started in the background in `dir`; once it logged a step, `then` runs (bash; the
// trainer's pid is $pid), and the trainer's status is returned. A watchdog kills it after 60 s, so a
// trainer that should have ended does not hang the test.
RunResult train_then(const fs::path& dir, const fs::path& config, const std::string& then) {
  return testing::run_booster_interrupted(
      dir, "train --config " + config.string(), testing::wait_for_line("step ", 1200),
      "(sleep 60; kill -9 $pid 2>/dev/null) & watchdog=$!; " + then +
          "; wait $pid; rc=$?; kill $watchdog 2>/dev/null; exit $rc",
      kEnv);
}

}  // namespace

// ------------------------------------------------------------------------------ item 7: token files
TEST_CASE("a token file cut short under a mapped data set is a DataError naming the file and offset",
          "[data][faults]") {
  const fs::path file = write_tokens(scratch_dir() / "cut.bin", 4096);
  auto data = booster::data::token_file_dataset(file.string(), booster::data::TokenDType::UInt16, {.seq_len = 16});
  REQUIRE(data->size() == 255);
  data->get_batch({0, 254});  // whole: reads
  REQUIRE(::truncate(file.c_str(), 1000) == 0);  // 500 tokens left
  data->get_batch({0, 30});   // tokens [0, 497) are still there
  // Sample 31 reads tokens [496, 513): 513 - 1 = 512 is the offset it needs, past the 500 left. Without
  // the check it reads zeros (the rest of the last page), and sample 200, on a page wholly past the
  // end, is SIGBUS: the test program dies.
  CHECK_THROWS_AS(data->get_batch({200}), booster::DataError);
  CHECK_THROWS_MATCHES(data->get_batch({0, 31}), booster::DataError,
                       Catch::Matchers::Predicate<booster::DataError>([&](const booster::DataError& e) {
                         const std::string m = e.what();
                         return m.find(file.string() + " was cut short while in use: it holds 1000 bytes now, 8192") !=
                                    std::string::npos &&
                                m.find("token offset 512 (byte offset 1024)") != std::string::npos;
                       }, "names the file, its sizes and the offset"));
  // A file renamed over the path is another file: the job reads the one it mapped, whole.
  write_tokens(scratch_dir() / "cut.bin.new", 10);
  auto whole = booster::data::token_file_dataset(write_tokens(scratch_dir() / "kept.bin", 4096).string(),
                                                 booster::data::TokenDType::UInt16, {.seq_len = 16});
  fs::rename(scratch_dir() / "cut.bin.new", scratch_dir() / "kept.bin");
  CHECK(whole->get_batch({254}).x.numel() == 16);
}

TEST_CASE("a token shard cut short is named with its own offset, a sample across two shards too", "[data][faults]") {
  const fs::path a = write_tokens(scratch_dir() / "shard_a.bin", 100), b = write_tokens(scratch_dir() / "shard_b.bin", 100);
  auto data = booster::data::token_files_dataset({a.string(), b.string()}, booster::data::TokenDType::UInt16,
                                                 {.seq_len = 16});
  REQUIRE(data->size() == 12);
  REQUIRE(::truncate(b.c_str(), 40) == 0);  // 20 of b's tokens are left
  data->get_batch({0, 5, 6});  // sample 6 reads a's last 4 tokens and b's first 13
  // Sample 7 reads tokens [112, 129): b's [12, 29), of which 28 is past its 20.
  CHECK_THROWS_WITH(data->get_batch({0, 7}),
                    Contains(b.string() + " was cut short while in use: it holds 40 bytes now, 200 when it was opened, "
                                          "and a batch reads token offset 28 (byte offset 56)"));
}

TEST_CASE("booster train on a token file truncated while it trains fails naming the file", "[cli][faults]") {
  const fs::path dir = scratch_dir() / "truncated";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path tokens = write_tokens(dir / "train.bin", 400000);
  const fs::path config = write_config("truncated.json", long_gpt_run(tokens, dir / "run"));
  // 1000 bytes are left: nearly every later sample lies past them. Without the check the trainer dies of
  // SIGBUS (status 135) and says nothing of the file.
  const RunResult r = train_then(dir, config, "truncate -s 1000 " + tokens.string());
  INFO(r.err);
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("booster: error: token data: " + tokens.string() + " was cut short while in use: it holds "
                             "1000 bytes now, 800000 when it was opened, and a batch reads token offset "));
}

// ------------------------------------------------------------------------------ item 8: run_dir lock
TEST_CASE("a second run on a run directory in use is refused at once, naming the holder", "[cli][faults]") {
  const fs::path dir = scratch_dir() / "shared_run_dir";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path tokens = write_tokens(dir / "train.bin", 20000);
  const fs::path run_dir = dir / "run";
  const fs::path first = write_config("first.json", long_gpt_run(tokens, run_dir));
  json short_run = long_gpt_run(tokens, run_dir);
  short_run["train"]["max_steps"] = 3;
  const fs::path second = write_config("second.json", short_run);
  // The second run starts while the first trains, both without checkpoints; its status and stderr go
  // to files. Without the lock it trains its 3 steps into the first one's metrics.jsonl and ends 0.
  const std::string booster = std::string(BOOSTER_BIN_DIR) + "/booster";
  const RunResult r = train_then(dir, first,
                                 "echo $pid >first.pid; " + kEnv + " timeout -s KILL 60 " + booster + " train --config " +
                                     second.string() + " >second.out 2>second.err; echo $? >second.rc; kill -9 $pid");
  const std::string second_err = testing::read_text(dir / "second.err");
  INFO(r.err);
  INFO(second_err);
  CHECK(r.exit_code == 128 + SIGKILL);  // the first ran until the test ended it
  CHECK(testing::read_text(dir / "second.rc") == "1\n");
  const std::string pid = testing::read_text(dir / "first.pid");
  REQUIRE(pid.size() > 1);
  CHECK_THAT(second_err, Contains("booster: error: the run directory " + run_dir.string() +
                                  " is in use by another process (") &&
                             Contains(":" + pid.substr(0, pid.size() - 1) + ", host:pid per " +
                                      (run_dir / "lock").string() + ")"));
  // Every record of metrics.jsonl is the first run's: one per step, in order from 1.
  std::ifstream metrics(run_dir / "metrics.jsonl");
  int64_t expected = 1;
  for (std::string line; std::getline(metrics, line);) {
    const json record = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (record.is_discarded()) {  // only the line the kill cut short
      CHECK(metrics.peek() == EOF);
      continue;
    }
    if (record.value("kind", "") == "train") CHECK(record["step"] == expected++);
  }
  CHECK(expected > 1);
  // The kernel dropped the first one's lock with it: the directory is free again.
  const RunResult again = testing::run_booster_in(dir, "train --config " + second.string(), kEnv + " timeout -s KILL 60");
  INFO(again.err);
  CHECK(again.exit_code == 0);
}

// ------------------------------------------------------------------------------ item 9: crashing models
namespace {

const std::string kCrashy = std::string(BOOSTER_TEST_MODEL_DIR) + "/libbooster_model_crashy.so";

// `booster train` of the crashy library's `type` on synthetic data, on `processes` processes (1:
// directly; more: booster run -n under ddp, with a short collective timeout so no rank waits long).
RunResult train_crashy(const std::string& type, int processes, const std::string& run_args = "",
                       const json& run_dir = nullptr) {
  const fs::path dir = scratch_dir() / ("crashy_" + type + "_" + std::to_string(processes));
  fs::remove_all(dir);
  json config = {{"model", {{"type", type}, {"library", kCrashy}, {"in", 8}, {"classes", 3}}},
                 {"optimizer", {{"type", "sgd"}, {"lr", 0.1}}},
                 {"criterion", {{"type", "cross_entropy"}}},
                 {"data", {{"type", "synthetic"}, {"num_samples", 64}, {"num_test_samples", 16}, {"num_features", 8},
                           {"num_classes", 3}, {"batch_size", 8}}},
                 {"train", {{"max_steps", 2}, {"seed", 1}, {"run_dir", run_dir}, {"collective_timeout_s", 20}}}};
  if (processes > 1) config["plugin"] = "ddp";
  const fs::path file = write_config("crashy_" + type + ".json", config);
  const std::string train = "train --config " + file.string();
  if (processes == 1) return testing::run_booster_in(dir, train, kEnv + " timeout -s KILL 60");
  return testing::run_booster_in(dir, "run -n " + std::to_string(processes) + " " + run_args + "-- " + BOOSTER_BIN_DIR +
                                          "/booster " + train,
                                 kEnv + " timeout -s KILL 90");
}

}  // namespace

TEST_CASE("a model library that crashes in its factory is named, and the run ends by the signal",
          "[cli][faults][plugin]") {
  const RunResult r = train_crashy("crash_in_factory", 1);
  INFO(r.err);
  CHECK(r.exit_code == 128 + SIGSEGV);
  CHECK_THAT(r.err, Contains("booster: fatal signal SIGSEGV in the factory of model \"crash_in_factory\" of model "
                             "library 'crashy' (" + kCrashy + "); the fault is in that library's code"));
}

TEST_CASE("a model library that crashes in a module's forward is named with the module", "[cli][faults][plugin]") {
  const RunResult r = train_crashy("crash_in_forward", 1);
  INFO(r.err);
  CHECK(r.exit_code == 128 + SIGSEGV);
  // 'bad' is innermost on the stack; 'fc' ran before it and returned, and the model is outermost.
  CHECK_THAT(r.err, Contains("booster: fatal signal SIGSEGV in the forward of module 'bad' (CrashyLayer) of model "
                             "\"crash_in_forward\" of model library 'crashy' (" + kCrashy + ")"));
}

TEST_CASE("a crashing model library is named with the flight recorder's handler installed above ours",
          "[cli][faults][plugin]") {
  // A run directory turns the flight recorder on, whose handler is installed after the model is built and
  // chains to ours: both lines, and the status of the signal.
  const RunResult r = train_crashy("crash_in_forward", 1, "", "run");
  INFO(r.err);
  CHECK(r.exit_code == 128 + SIGSEGV);
  CHECK_THAT(r.err, Contains("booster: fatal signal SIGSEGV; flight record written to ") &&
                        Contains("booster: fatal signal SIGSEGV in the forward of module 'bad' (CrashyLayer)"));
}

TEST_CASE("under booster run a crashing model library is named by rank and the restart says why",
          "[cli][faults][plugin][mpi]") {
  if (!testing::have_mpirun()) return skip_test(testing::kNoMpirun);
  if (!testing::have_plugin("ddp")) return skip_test("the ddp plugin was not built");
  const std::string named = "fatal signal SIGSEGV in the forward of module 'bad' (CrashyLayer) of model "
                            "\"crash_in_forward\" of model library 'crashy' (" + kCrashy + ")";
  const RunResult r = train_crashy("crash_in_forward", 2, "--max-restarts 1 ");
  INFO(r.err);
  CHECK(r.exit_code == 128 + SIGSEGV);  // mpirun's status for a rank that died of SIGSEGV
  // Each rank's line passes through booster run, and mpirun's line says which signal ended the job.
  CHECK_THAT(r.err, Contains("booster: rank 0 of 2: " + named) && Contains("booster: rank 1 of 2: " + named) &&
                        Contains("exited on signal 11"));
  // The restart names the first rank's line as its reason, not only the signal.
  CHECK_THAT(r.err, Contains("booster run: restart 1 of 1") && Contains("(signal 11, Segmentation fault): booster: rank "));
}
