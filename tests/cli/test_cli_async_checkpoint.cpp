// train.async_checkpoint through the real `booster` binary (Note [Asynchronous checkpoints] in
// core/booster/trainer/async_save.h): the same files as a synchronous save, a failed background save
// that the run survives, and a process killed in the middle of a background write. The same on several
// processes (ddp, ZeRO-3, tensor parallel) is in test_cli_mpi_checkpoints.cpp.
#include <catch2/catch.hpp>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "run_booster.h"

namespace fs = std::filesystem;
using nlohmann::json;
using testing::read_text;
using testing::RunResult;

using testing::files_of;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_async_checkpoint"); }

RunResult run_booster(const std::string& args, const std::string& env = "") {
  return testing::run_booster_in(scratch_dir(), args, env);
}

json small_config() {
  return json::parse(R"({
    "model": {"type": "mlp", "in": 8, "hidden": [16], "classes": 3},
    "optimizer": {"type": "adamw", "lr": 0.01},
    "data": {"type": "synthetic", "num_samples": 256, "num_test_samples": 64, "num_features": 8,
             "num_classes": 3, "batch_size": 32},
    "train": {"epochs": 2, "max_steps": 12, "log_every": 4, "seed": 3, "run_dir": null, "keep_last": 0,
              "checkpoint_every": 4}
  })");
}

// `booster train` of the small config into checkpoint root `root`, with `extra` --set options.
std::string train_args(const fs::path& root, const std::string& extra = "") {
  const fs::path cfg = scratch_dir() / "small.json";
  std::ofstream(cfg, std::ios::trunc) << small_config().dump();
  return "train --config " + cfg.string() + " --set train.checkpoint_dir=" + root.string() + " " + extra;
}

fs::path step_dir(const fs::path& root, int step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08d", step);
  return root / name;
}

// run_booster with no file allowed to grow past 1 KiB: a write past it fails with EFBIG, as a full disk
// fails one (SIGXFSZ ignored, so the write fails instead of killing the process). stdout and stderr go
// through pipes to files outside the limit.
RunResult run_booster_limited(const std::string& args) {
  const fs::path dir = scratch_dir();
  const std::string cmd = "cd " + dir.string() + " && ( ( (trap '' XFSZ; ulimit -f 1; " + BOOSTER_BIN_DIR +
                          "/booster " + args + " 2>&1 1>&3; echo $? > rc.txt) | cat > err.txt ) 3>&1 | cat > out.txt )";
  RunResult r;
  if (std::system(cmd.c_str()) != 0) return r;
  r.exit_code = std::stoi(read_text(dir / "rc.txt"));
  r.out = read_text(dir / "out.txt");
  r.err = read_text(dir / "err.txt");
  return r;
}

}  // namespace

TEST_CASE("async checkpoints: every file of every step equals a synchronous run's", "[cli][checkpoint][async]") {
  const fs::path sync_root = scratch_dir() / "bytes_sync", async_root = scratch_dir() / "bytes_async";
  fs::remove_all(sync_root);
  fs::remove_all(async_root);
  const RunResult sync = run_booster(train_args(sync_root));
  INFO(sync.err);
  REQUIRE(sync.exit_code == 0);
  const RunResult async = run_booster(train_args(async_root, "--set train.async_checkpoint=true"));
  INFO(async.err);
  REQUIRE(async.exit_code == 0);
  CHECK_THAT(async.err, Catch::Contains("in the background"));
  const json sync_summary = json::parse(testing::last_line(sync.out)),
             async_summary = json::parse(testing::last_line(async.out));
  CHECK(async_summary.at("final_loss") == sync_summary.at("final_loss"));
  CHECK(read_text(async_root / "latest") == "step-00000012\n");

  const std::map<std::string, std::string> expected = files_of(sync_root), got = files_of(async_root);
  for (int step : {4, 8, 12}) CHECK(fs::is_directory(step_dir(async_root, step)));
  CHECK(expected.size() > 12);  // three steps of several files each, and `latest`
  REQUIRE(got.size() == expected.size());
  for (const auto& [name, bytes] : expected) {
    INFO(name);
    REQUIRE(got.count(name) == 1);
    CHECK(got.at(name) == bytes);
  }
}

TEST_CASE("async checkpoints: a failed background save is a warning, and a failed last save fails the run",
          "[cli][checkpoint][async]") {
  const fs::path root = scratch_dir() / "failing";
  fs::remove_all(root);
  // Step 4 saved with room to spare.
  const RunResult first = run_booster(train_args(root, "--set train.max_steps=4 --set train.async_checkpoint=true"));
  INFO(first.err);
  REQUIRE(first.exit_code == 0);
  REQUIRE(fs::is_directory(step_dir(root, 4)));
  // Then no file may grow past 1 KiB: the saves of steps 8 and 12 fail in the background. Step 8's is a
  // warning and training goes on; step 12's is the run's last, so the run fails, naming the step a
  // resume starts from (Note [The run's last save] in trainer.cpp): its end is saved nowhere.
  const RunResult resumed = run_booster_limited(train_args(root, "--set train.async_checkpoint=true --resume latest"));
  INFO(resumed.err);
  CHECK(resumed.exit_code == 1);
  CHECK_THAT(resumed.err, Catch::Contains("warning: the background checkpoint of step 8 failed") &&
                              Catch::Contains("File too large") &&
                              Catch::Contains("error: the background checkpoint of step 12, the run's last, failed") &&
                              Catch::Contains("the end of the run is saved nowhere"));
  CHECK(resumed.out.find("\"steps\"") == std::string::npos);  // no summary of a finished run
  CHECK(read_text(root / "latest") == "step-00000004\n");
  CHECK_FALSE(fs::exists(step_dir(root, 8)));
  CHECK_FALSE(fs::exists(step_dir(root, 12)));

  // train.on_save_error "stop": the first failure ends the run, exit 1, naming the step.
  const RunResult stopped = run_booster_limited(
      train_args(root, "--set train.async_checkpoint=true --set train.on_save_error=stop --resume latest"));
  INFO(stopped.err);
  CHECK(stopped.exit_code == 1);
  CHECK_THAT(stopped.err, Catch::Contains("background checkpoint of step 8 failed") &&
                              Catch::Contains("on_save_error"));
  CHECK(read_text(root / "latest") == "step-00000004\n");

  // A failure before the last save is a warning only: the run ends with its last step committed.
  const RunResult middle = run_booster(train_args(root, "--set train.async_checkpoint=true --resume latest"),
                                       "BOOSTER_TEST_ASYNC_SAVE_FAIL_RANK=0:8");
  INFO(middle.err);
  CHECK(middle.exit_code == 0);
  CHECK_THAT(middle.err, Catch::Contains("warning: the background checkpoint of step 8 failed"));
  CHECK(json::parse(testing::last_line(middle.out)).at("steps") == 12);
  CHECK(read_text(root / "latest") == "step-00000012\n");
  CHECK_FALSE(fs::exists(step_dir(root, 8)));
}

// The synchronous counterpart: a failed save always stops the run, naming the step that failed and
// how to go on (here nothing of the resumed run is committed, so running it again resumes as it did).
TEST_CASE("a failed synchronous save stops the run, naming its step and how to go on", "[cli][checkpoint]") {
  const fs::path root = scratch_dir() / "failing_sync";
  fs::remove_all(root);
  const RunResult first = run_booster(train_args(root, "--set train.max_steps=4"));
  INFO(first.err);
  REQUIRE(first.exit_code == 0);
  const RunResult resumed = run_booster_limited(train_args(root, "--resume latest"));
  INFO(resumed.err);
  CHECK(resumed.exit_code == 1);
  CHECK_THAT(resumed.err, Catch::Contains("booster: error: the checkpoint of step 8 failed: cannot write") &&
                              Catch::Contains("File too large") &&
                              Catch::Contains("no checkpoint of this run is committed; run it again once the cause "
                                              "is fixed"));
  CHECK(read_text(root / "latest") == "step-00000004\n");
}

TEST_CASE("async checkpoints: kill -9 during a background write leaves latest loadable", "[cli][checkpoint][async]") {
  const fs::path root = scratch_dir() / "killed", dir = scratch_dir() / "killed_run";
  fs::remove_all(root);
  fs::remove_all(dir);
  const RunResult first = run_booster(train_args(root, "--set train.max_steps=4 --set train.async_checkpoint=true"));
  INFO(first.err);
  REQUIRE(first.exit_code == 0);
  // The test hook BOOSTER_TEST_ASYNC_SAVE_SLEEP_MS holds the background writer after step 8's first
  // file; the run then waits for it at step 12's save, and is killed there.
  fs::create_directories(dir);
  const std::string cmd = "cd " + dir.string() + " && (BOOSTER_TEST_ASYNC_SAVE_SLEEP_MS=600000 " +
                          std::string(BOOSTER_BIN_DIR) + "/booster " +
                          train_args(root, "--set train.async_checkpoint=true --resume latest") +
                          " >out.txt 2>err.txt & echo $! > pid.txt)";
  REQUIRE(std::system(cmd.c_str()) == 0);
  const fs::path tmp = root / "step-00000008.tmp";
  bool writing = false;
  for (int i = 0; i < 1200 && !writing; ++i) {  // up to 2 minutes on a loaded machine
    std::error_code ec;
    if (fs::is_directory(tmp)) {
      for (const auto& entry : fs::recursive_directory_iterator(tmp, ec))
        writing |= entry.is_regular_file() && entry.path().filename().string().find(".tmp-") == std::string::npos;
    }
    if (!writing) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const pid_t pid = std::stoi(read_text(dir / "pid.txt"));
  ::kill(pid, SIGKILL);
  INFO(read_text(dir / "err.txt"));
  REQUIRE(writing);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  CHECK(read_text(root / "latest") == "step-00000004\n");
  CHECK_FALSE(fs::exists(step_dir(root, 8)));

  const RunResult resumed = run_booster(train_args(root, "--set train.async_checkpoint=true --resume latest"));
  INFO(resumed.err);
  CHECK(resumed.exit_code == 0);
  CHECK_THAT(resumed.err, Catch::Contains("resumed from " + step_dir(root, 4).string()));
  CHECK(read_text(root / "latest") == "step-00000012\n");
  CHECK(fs::is_directory(step_dir(root, 8)));
  CHECK_FALSE(fs::exists(tmp));
}
