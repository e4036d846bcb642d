// Checkpoints of several processes through the real `booster` binary: ranks that resume from one
// step when their views of the root differ (Note [Ranks resume from one step] in
// core/booster/booster/state.cpp), keep_last beside a damaged step (Note [Falling back from a damaged
// checkpoint]), and train.async_checkpoint under ddp and ZeRO-3 on two processes (Note [Asynchronous
// checkpoints] in core/booster/trainer/async_save.h). The multi-process tests skip without mpirun.
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
#include "skip.h"

namespace fs = std::filesystem;
using nlohmann::json;
using testing::read_text;
using testing::RunResult;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_mpi_checkpoints"); }

const char* kEnv = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1";

RunResult run_booster(const std::string& args, const std::string& env = "") {
  return testing::run_booster_in(scratch_dir(), args, std::string(kEnv) + " " + env);
}

// Why a multi-process test cannot run here, or "".
std::string why_no_mpi(const char* plugin = "ddp") {
  if (!testing::have_mpirun()) return "no mpirun (apt-get install openmpi-bin)";
  if (!fs::exists(fs::path(BOOSTER_LIB_DIR) / ("libbooster_plugin_" + std::string(plugin) + ".so")))
    return std::string("the ") + plugin + " plugin is not built";
  return "";
}

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
