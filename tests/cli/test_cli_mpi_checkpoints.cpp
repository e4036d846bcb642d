// Checkpoints of several processes through the real `booster` binary: ranks that resume from one
// step when their views of the root differ (Note [Ranks resume from one step] in
// core/booster/booster/state.cpp), keep_last beside a damaged step (Note [Falling back from a damaged
// checkpoint]), and train.async_checkpoint under ddp and ZeRO-3 on two processes (Note [Asynchronous
// checkpoints] in core/booster/trainer/async_save.h). The multi-process tests skip without mpirun.
#include <catch2/catch.hpp>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "run_booster.h"
#include "skip.h"

namespace fs = std::filesystem;
using nlohmann::json;
using testing::read_text;
using testing::RunResult;

using testing::files_of;
using testing::why_no_mpi;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_mpi_checkpoints"); }

const char* kEnv = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1";

RunResult run_booster(const std::string& args, const std::string& env = "") {
  return testing::run_booster_in(scratch_dir(), args, std::string(kEnv) + " " + env);
}

// Why a multi-process test cannot run here, or "".
json small_config() {
  return json::parse(R"({
    "model": {"type": "mlp", "in": 8, "hidden": [16], "classes": 3},
    "optimizer": {"type": "adamw", "lr": 0.01},
    "data": {"type": "synthetic", "num_samples": 256, "num_test_samples": 64, "num_features": 8,
             "num_classes": 3, "batch_size": 32},
    "train": {"epochs": 2, "max_steps": 6, "log_every": 2, "seed": 3, "run_dir": null, "keep_last": 0,
              "checkpoint_every": 2}
  })");
}

fs::path config_file() {
  const fs::path cfg = scratch_dir() / "small.json";
  std::ofstream(cfg, std::ios::trunc) << small_config().dump();
  return cfg;
}

// `train` of the small config into checkpoint root `root`, with `extra` options.
std::string train_args(const fs::path& root, const std::string& extra = "") {
  return "train --config " + config_file().string() + " --set train.checkpoint_dir=" + root.string() + " " + extra;
}

// The same on two processes: `booster run -n 2 -- booster train ...`.
std::string two_ranks(const std::string& args) { return "run -n 2 -- " + std::string(BOOSTER_BIN_DIR) + "/booster " + args; }

// On two processes, each rank with its own checkpoint root `<prefix>_<rank>` (a per-host copy).
std::string two_ranks_own_roots(const fs::path& prefix, const std::string& extra) {
  return "run -n 2 -- bash -c 'exec " + std::string(BOOSTER_BIN_DIR) + "/booster train --config " +
         config_file().string() + " --set train.checkpoint_dir=" + prefix.string() + "_$OMPI_COMM_WORLD_RANK " + extra + "'";
}

fs::path step_dir(const fs::path& root, int step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08d", step);
  return root / name;
}

// Flips a bit inside the last tensor of a step's model file, so the step fails its checksums.
void damage(const fs::path& step) {
  const fs::path file = step / "model" / "model.safetensors";
  std::string bytes = read_text(file);
  bytes[bytes.size() - 20] ^= 0x40;
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
}

}  // namespace

// Note [Falling back from a damaged checkpoint]: a resume that went back past a damaged step leaves it
// on disk; until a save of its step moves it aside, it must not count toward keep_last (fewer good
// steps would be kept) nor be pruned.
TEST_CASE("keep_last counts no damaged step and never prunes one", "[cli][checkpoint][resume]") {
  const fs::path root = scratch_dir() / "keep_last_damaged";
  fs::remove_all(root);
  const RunResult first = run_booster(train_args(root));
  INFO(first.err);
  REQUIRE(first.exit_code == 0);
  damage(step_dir(root, 6));
  const std::string damaged_bytes = read_text(step_dir(root, 6) / "model" / "model.safetensors");
  // Resumed from step 4, saving every step with keep_last 2, stopping at step 5.
  const RunResult resumed = run_booster(
      train_args(root, "--set train.max_steps=5 --set train.checkpoint_every=1 --set train.keep_last=2 --resume latest"));
  INFO(resumed.err);
  REQUIRE(resumed.exit_code == 0);
  CHECK_THAT(resumed.err, Catch::Contains("resumed from " + step_dir(root, 4).string() + " at step 4"));
  CHECK(read_text(root / "latest") == "step-00000005\n");
  CHECK(fs::is_directory(step_dir(root, 5)));
  CHECK(fs::is_directory(step_dir(root, 4)));  // two good steps kept
  CHECK_FALSE(fs::exists(step_dir(root, 2)));
  REQUIRE(fs::is_directory(step_dir(root, 6)));  // the damaged step, as it was
  CHECK(read_text(step_dir(root, 6) / "model" / "model.safetensors") == damaged_bytes);

  // Saving step 6 again moves the damaged one aside; it still neither counts nor goes.
  const RunResult again =
      run_booster(train_args(root, "--set train.checkpoint_every=1 --set train.keep_last=2 --resume latest"));
  INFO(again.err);
  REQUIRE(again.exit_code == 0);
  CHECK(read_text(root / "latest") == "step-00000006\n");
  CHECK(fs::is_directory(step_dir(root, 5)));
  CHECK(fs::is_directory(step_dir(root, 6)));
  CHECK_FALSE(fs::exists(step_dir(root, 4)));
  REQUIRE(fs::is_directory(root / "step-00000006.damaged"));
  CHECK(read_text(root / "step-00000006.damaged" / "model" / "model.safetensors") == damaged_bytes);
}

// Note [Ranks resume from one step]: per-host copies of a root where rank 1's copy of the newest step
// is damaged. Each rank alone would load another step; they agree on the older one.
TEST_CASE("ranks resume from the same step when one rank's copy of the newest is damaged",
          "[cli][checkpoint][resume][mpi]") {
  if (const std::string why = why_no_mpi(); !why.empty()) {
    skip_test(why);
    return;
  }
  const fs::path shared = scratch_dir() / "agree", copies = scratch_dir() / "agree_copy";
  fs::remove_all(shared);
  for (int r : {0, 1}) fs::remove_all(copies.string() + "_" + std::to_string(r));
  const RunResult first = run_booster(two_ranks(train_args(shared, "--set plugin=ddp --set train.max_steps=4")));
  INFO(first.err);
  REQUIRE(first.exit_code == 0);
  REQUIRE(read_text(shared / "latest") == "step-00000004\n");
  const fs::path root0 = copies.string() + "_0", root1 = copies.string() + "_1";
  for (const fs::path& copy : {root0, root1}) {
    fs::copy(shared, copy, fs::copy_options::recursive);
    fs::remove(copy / "lock");
  }

  SECTION("one rank's newest step is damaged: every rank resumes from the older one") {
    damage(step_dir(root1, 4));
    const RunResult resumed = run_booster(two_ranks_own_roots(copies, "--set plugin=ddp --resume latest"));
    INFO(resumed.err);
    CHECK(resumed.exit_code == 0);
    CHECK_THAT(resumed.err, Catch::Contains("resumed from " + step_dir(root0, 2).string() + " at step 2"));
    CHECK_THAT(resumed.err, Catch::Contains(step_dir(root0, 4).string() + " passes its checksums, but rank 1 of 2 "
                                            "has no step newer than 2"));
    CHECK_THAT(resumed.err, Catch::Contains("rank 1: checkpoint file " + (step_dir(root1, 4) / "model").string()));
    CHECK(json::parse(testing::last_line(resumed.out)).at("steps") == 6);
  }
  SECTION("rank 0's newest step is damaged: rank 1 passes over its good copy and says so") {
    damage(step_dir(root0, 4));
    const RunResult resumed = run_booster(two_ranks_own_roots(copies, "--set plugin=ddp --resume latest"));
    INFO(resumed.err);
    CHECK(resumed.exit_code == 0);
    CHECK_THAT(resumed.err, Catch::Contains("resumed from " + step_dir(root0, 2).string() + " at step 2"));
    CHECK_THAT(resumed.err, Catch::Contains("warning: checkpoint file " + (step_dir(root0, 4) / "model").string()));
    CHECK_THAT(resumed.err, Catch::Contains("rank 1: " + step_dir(root1, 4).string() + " passes its checksums, but "
                                            "rank 0 of 2 has no step newer than 2"));
  }
  SECTION("a rank with no step that passes stops every rank, naming it") {
    damage(step_dir(root1, 2));
    damage(step_dir(root1, 4));
    const RunResult refused = run_booster(two_ranks_own_roots(copies, "--set plugin=ddp --resume latest"));
    INFO(refused.err);
    CHECK(refused.exit_code == 1);
    CHECK_THAT(refused.err, Catch::Contains("rank 1 of 2") && Catch::Contains("passes its checksums") &&
                                Catch::Contains("every rank must resume from the same step"));
    CHECK_THAT(refused.err, !Catch::Contains("resumed from"));
  }
  SECTION("a rank whose root is empty while the other's holds steps stops every rank") {
    fs::remove_all(root1);
    const RunResult refused = run_booster(two_ranks_own_roots(copies, "--set plugin=ddp --resume latest"));
    INFO(refused.err);
    CHECK(refused.exit_code == 1);
    CHECK_THAT(refused.err, Catch::Contains("rank 1 of 2 finds no checkpoint in " + root1.string()));
    CHECK_THAT(refused.err, !Catch::Contains("resumed from"));
  }
}

namespace {

// The processes below `pid` (its children, theirs, ...), read from /proc.
std::vector<pid_t> descendants_of(pid_t pid) {
  std::map<pid_t, std::vector<pid_t>> children;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = read_text(entry.path() / "stat");
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    int parent = 0;
    if (std::sscanf(stat.c_str() + close + 1, " %*c %d", &parent) == 1) children[parent].push_back(std::stoi(name));
  }
  std::vector<pid_t> out, todo = {pid};
  while (!todo.empty()) {
    const pid_t p = todo.back();
    todo.pop_back();
    for (pid_t c : children[p]) {
      out.push_back(c);
      todo.push_back(c);
    }
  }
  return out;
}

// The process of rank `rank` among the descendants of `pid` (OMPI_COMM_WORLD_RANK in its environment); 0: none.
pid_t rank_process(pid_t pid, int rank) {
  const std::string wanted = "OMPI_COMM_WORLD_RANK=" + std::to_string(rank);
  for (pid_t p : descendants_of(pid)) {
    const std::string comm = read_text("/proc/" + std::to_string(p) + "/comm");
    if (comm.rfind("booster", 0) != 0) continue;
    std::string env = read_text("/proc/" + std::to_string(p) + "/environ");
    for (char& c : env)
      if (c == '\0') c = '\n';
    if (("\n" + env + "\n").find("\n" + wanted + "\n") != std::string::npos) return p;
  }
  return 0;
}

}  // namespace

// Note [Asynchronous checkpoints] on several processes: each rank writes its files on its thread, rank 0
// commits once all are written; the files are a synchronous run's, byte for byte.
TEST_CASE("async checkpoints on 2 ranks (ddp, ZeRO-3, tensor parallel) equal a synchronous run's files",
          "[cli][checkpoint][async][mpi]") {
  struct Case {
    const char* plugin;
    std::string args;
  };
  const std::string gpt = "train --config " + std::string(BOOSTER_SOURCE_DIR) +
                          "/examples/configs/gpt_char_tp2.json --set train.max_steps=4 --set train.eval_every=0 "
                          "--set train.run_dir=null --set train.checkpoint_every=2 --set train.checkpoint_dir=";
  for (const Case& c : {Case{"ddp", "--set plugin=ddp"},
                        Case{"low_level_zero", "-p low_level_zero --set plugin.stage=3 --set plugin.precision=fp32"},
                        Case{"hybrid_parallel", ""}}) {
    INFO(c.plugin);
    if (const std::string why = why_no_mpi(c.plugin); !why.empty()) {
      skip_test(why);
      continue;
    }
    const bool tensor_parallel = std::string(c.plugin) == "hybrid_parallel";
    const fs::path sync_root = scratch_dir() / ("bytes_sync_" + std::string(c.plugin)),
                   async_root = scratch_dir() / ("bytes_async_" + std::string(c.plugin));
    fs::remove_all(sync_root);
    fs::remove_all(async_root);
    auto args = [&](const fs::path& root, const std::string& extra) {
      return two_ranks(tensor_parallel ? gpt + root.string() + " " + extra : train_args(root, c.args + " " + extra));
    };
    const RunResult sync = run_booster(args(sync_root, ""));
    INFO(sync.err);
    REQUIRE(sync.exit_code == 0);
    const RunResult async = run_booster(args(async_root, "--set train.async_checkpoint=true"));
    INFO(async.err);
    REQUIRE(async.exit_code == 0);
    CHECK_THAT(async.err, Catch::Contains("in the background"));
    CHECK(json::parse(testing::last_line(async.out)).at("final_loss") ==
          json::parse(testing::last_line(sync.out)).at("final_loss"));
    const int last = tensor_parallel ? 4 : 6;
    CHECK(read_text(async_root / "latest") == read_text(sync_root / "latest"));
    CHECK(fs::is_directory(step_dir(async_root, last)));
    const std::map<std::string, std::string> expected = files_of(sync_root), got = files_of(async_root);
    CHECK(expected.size() > 6);
    REQUIRE(got.size() == expected.size());
    for (const auto& [name, bytes] : expected) {
      INFO(name);
      REQUIRE(got.count(name) == 1);
      CHECK(got.at(name) == bytes);
    }
  }
}

// A background write that fails on one rank: every rank learns it, the step never commits, `latest`
// stays at the previous step; "warn" goes on, "stop" stops every rank.
TEST_CASE("async checkpoints on 2 ranks: a write failing on one rank is reported and latest stays",
          "[cli][checkpoint][async][mpi]") {
  if (const std::string why = why_no_mpi(); !why.empty()) {
    skip_test(why);
    return;
  }
  const fs::path root = scratch_dir() / "async_fail";
  fs::remove_all(root);
  const std::string async = "--set plugin=ddp --set train.async_checkpoint=true ";
  const RunResult warned =
      run_booster(two_ranks(train_args(root, async)), "BOOSTER_TEST_ASYNC_SAVE_FAIL_RANK=1:4");
  INFO(warned.err);
  CHECK(warned.exit_code == 0);
  CHECK_THAT(warned.err, Catch::Contains("warning: the background checkpoint of step 4 failed: rank 1 of 2: cannot "
                                         "write " + (root / "step-00000004.tmp").string()) &&
                             Catch::Contains("BOOSTER_TEST_ASYNC_SAVE_FAIL_RANK") &&
                             Catch::Contains("latest still names " + step_dir(root, 2).string()));
  CHECK(json::parse(testing::last_line(warned.out)).at("steps") == 6);
  CHECK(read_text(root / "latest") == "step-00000006\n");
  CHECK_FALSE(fs::exists(step_dir(root, 4)));

  // The run's last save failing fails every rank whatever on_save_error says: its end is saved
  // nowhere (Note [The run's last save] in trainer.cpp).
  fs::remove_all(root);
  const RunResult last =
      run_booster(two_ranks(train_args(root, async)), "BOOSTER_TEST_ASYNC_SAVE_FAIL_RANK=1:6");
  INFO(last.err);
  CHECK(last.exit_code == 1);
  CHECK_THAT(last.err, Catch::Contains(" of 2: error: the background checkpoint of step 6, the run's last, failed: "
                                       "rank 1 of 2: cannot write") &&
                           Catch::Contains("latest still names " + step_dir(root, 4).string()));
  CHECK(read_text(root / "latest") == "step-00000004\n");
  CHECK_FALSE(fs::exists(step_dir(root, 6)));

  // train.on_save_error "stop": every rank stops at the failure of step 4, exit 1.
  fs::remove_all(root);
  const RunResult stopped = run_booster(two_ranks(train_args(root, async + "--set train.on_save_error=stop")),
                                        "BOOSTER_TEST_ASYNC_SAVE_FAIL_RANK=1:4");
  INFO(stopped.err);
  CHECK(stopped.exit_code == 1);
  // Both ranks stop with the same error (booster run prints a message all ranks give once).
  CHECK_THAT(stopped.err, Catch::Contains(" of 2: error: the background checkpoint of step 4 failed: rank 1 of 2: "
                                          "cannot write") &&
                              Catch::Contains("on_save_error"));
  CHECK(read_text(root / "latest") == "step-00000002\n");
  CHECK_FALSE(fs::exists(step_dir(root, 4)));
}

TEST_CASE("async checkpoints on 2 ranks: kill -9 of a rank mid-write leaves latest loadable",
          "[cli][checkpoint][async][mpi]") {
  if (const std::string why = why_no_mpi(); !why.empty()) {
    skip_test(why);
    return;
  }
  const fs::path root = scratch_dir() / "async_killed", dir = scratch_dir() / "async_killed_run";
  fs::remove_all(root);
  fs::remove_all(dir);
  const std::string async = "--set plugin=ddp --set train.async_checkpoint=true ";
  const RunResult first = run_booster(two_ranks(train_args(root, async + "--set train.max_steps=4")));
  INFO(first.err);
  REQUIRE(first.exit_code == 0);
  // BOOSTER_TEST_ASYNC_SAVE_SLEEP_MS holds every rank's writer of step 6 (after rank 0's first file);
  // rank 1 is killed there.
  fs::create_directories(dir);
  const std::string cmd = "cd " + dir.string() + " && (" + kEnv + " BOOSTER_TEST_ASYNC_SAVE_SLEEP_MS=60000 " +
                          std::string(BOOSTER_BIN_DIR) + "/booster " +
                          two_ranks(train_args(root, async + "--resume latest")) + " >out.txt 2>err.txt & echo $! > pid.txt)";
  REQUIRE(std::system(cmd.c_str()) == 0);
  const fs::path tmp = root / "step-00000006.tmp";
  bool writing = false;
  for (int i = 0; i < 1200 && !writing; ++i) {  // up to 2 minutes on a loaded machine
    std::error_code ec;
    if (fs::is_directory(tmp))
      for (const auto& entry : fs::recursive_directory_iterator(tmp, ec))
        writing |= entry.is_regular_file() && entry.path().filename().string().find(".tmp-") == std::string::npos;
    if (!writing) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const pid_t launcher = std::stoi(read_text(dir / "pid.txt"));
  const pid_t rank1 = rank_process(launcher, 1);
  const std::vector<pid_t> tree = descendants_of(launcher);
  if (rank1 > 0) ::kill(rank1, SIGKILL);
  INFO(read_text(dir / "err.txt"));
  // The launcher ends the job; whatever is left of it goes too.
  for (int i = 0; i < 300 && fs::exists("/proc/" + std::to_string(launcher)); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  for (pid_t p : tree) ::kill(p, SIGKILL);
  ::kill(launcher, SIGKILL);
  REQUIRE(writing);
  REQUIRE(rank1 > 0);
  CHECK(read_text(root / "latest") == "step-00000004\n");
  CHECK_FALSE(fs::exists(step_dir(root, 6)));

  const RunResult resumed = run_booster(two_ranks(train_args(root, async + "--resume latest")));
  INFO(resumed.err);
  CHECK(resumed.exit_code == 0);
  CHECK_THAT(resumed.err, Catch::Contains("resumed from " + step_dir(root, 4).string() + " at step 4"));
  CHECK(read_text(root / "latest") == "step-00000006\n");
  CHECK_FALSE(fs::exists(tmp));
}

// A stop (SIGTERM through booster run) while a background save is in flight: every rank waits for it,
// and the stop's own save, so the message names a committed step and `latest` names it.
TEST_CASE("async checkpoints on 2 ranks: SIGTERM waits for the save in flight and names a committed step",
          "[cli][checkpoint][async][mpi][signal]") {
  if (const std::string why = why_no_mpi(); !why.empty()) {
    skip_test(why);
    return;
  }
  const fs::path root = scratch_dir() / "async_stopped", dir = scratch_dir() / "async_stopped_run";
  fs::remove_all(root);
  // Every background write takes 2 s; the signal comes right after step 2, whose save is in flight.
  const RunResult r = testing::run_booster_interrupted(
      dir, two_ranks(train_args(root, "--set plugin=ddp --set train.async_checkpoint=true")),
      testing::wait_for_line("step      2/6"), "kill -TERM $pid",
      std::string(kEnv) + " BOOSTER_TEST_ASYNC_SAVE_SLEEP_MS=2000");
  INFO(r.err);
  CHECK(r.exit_code == 128 + SIGTERM);
  CHECK_THAT(r.err, Catch::Contains("saved step      2 | " + step_dir(root, 2).string()));
  const std::string marker = "stopped by SIGTERM after step ";
  const size_t at = r.err.find(marker);
  REQUIRE(at != std::string::npos);
  const int step = std::atoi(r.err.c_str() + at + marker.size());
  CHECK(step >= 2);  // the stop lands after step 2 (at once) or a later one (after step 2's save)
  CHECK_THAT(r.err, Catch::Contains("; saved " + step_dir(root, step).string()));
  char latest[32];
  std::snprintf(latest, sizeof latest, "step-%08d\n", step);
  CHECK(read_text(root / "latest") == latest);
  for (const auto& entry : fs::directory_iterator(root)) CHECK(entry.path().extension() != ".tmp");
}
