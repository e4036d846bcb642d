// Resuming across world sizes (Note [Resuming across layouts] in booster/booster/state.cpp), as a user
// does it: a single-process checkpoint resumed under ddp on 2 processes with half the per-rank batch,
// and a ddp checkpoint resumed by one process, each continue the uninterrupted run: the same samples
// make every step, so the parameters after the last step agree to float32 reordering (1e-5 relative);
// the resume says so in one line. Another global batch, and a sharded (low_level_zero) checkpoint
// under another plugin, are refused naming what differs. A checkpoint of one float32-parameter strategy
// resumes under another (fp16 -> bf16, ...) and training goes on (the test loss keeps falling); one with
// master weights (fp16_naive) is refused.
#include <catch2/catch.hpp>

#include "skip.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "booster/checkpoint/checkpoint.h"
#include "run_booster.h"

namespace fs = std::filesystem;
using nlohmann::json;
using testing::RunResult;

namespace {

fs::path scratch_dir() {
  fs::path dir = fs::temp_directory_path() / ("booster_test_cli_resume_layouts_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir;
}

const char* kEnv = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1";

RunResult run_booster(const std::string& args) { return testing::run_booster_in(scratch_dir(), args, kEnv); }

bool have_mpirun() { return std::system("command -v mpirun >/dev/null 2>&1") == 0; }

// 256 samples, 8 global batches of 32 an epoch; AdamW and a cosine schedule over 6 steps; a checkpoint
// every 3.
fs::path write_config() {
  const json c = json::parse(R"({
    "model": {"type": "mlp", "in": 8, "hidden": [16], "classes": 3},
    "optimizer": {"type": "adamw", "lr": 0.01},
    "criterion": {"type": "cross_entropy"},
    "data": {"type": "synthetic", "num_samples": 256, "num_test_samples": 64, "num_features": 8,
             "num_classes": 3, "batch_size": 32},
    "lr_scheduler": {"type": "cosine"},
    "train": {"epochs": 1, "max_steps": 6, "log_every": 1, "seed": 3, "run_dir": null,
              "checkpoint_every": 3, "keep_last": 0}
  })");
  const fs::path p = scratch_dir() / "layouts.json";
  std::ofstream(p) << c.dump(2);
  return p;
}

// `booster train` on `processes` processes (1: directly; more: booster run -n) with extra arguments.
RunResult train(int processes, const std::string& args) {
  const std::string command = "train --config " + write_config().string() + " " + args;
  if (processes == 1) return run_booster(command);
  return run_booster("run -n " + std::to_string(processes) + " -- " + std::string(BOOSTER_BIN_DIR) + "/booster " +
                     command);
}

// The largest relative difference between two checkpoints' models, over every value.
double max_relative_difference(const fs::path& a, const fs::path& b) {
  const auto ma = booster::checkpoint::load_model(a / "model"), mb = booster::checkpoint::load_model(b / "model");
  REQUIRE(ma.size() == mb.size());
  double worst = 0.0;
  for (const auto& [name, ta] : ma) {
    REQUIRE(mb.count(name));
    const std::vector<double> va = ta.tolist(), vb = mb.at(name).tolist();
    REQUIRE(va.size() == vb.size());
    for (size_t i = 0; i < va.size(); ++i)
      worst = std::max(worst, std::abs(va[i] - vb[i]) / std::max(std::abs(va[i]), 1e-3));
  }
  return worst;
}

}  // namespace

TEST_CASE("a single-process checkpoint resumes under ddp on 2 processes and back, on the same trajectory",
          "[cli][checkpoint][mpi]") {
  if (!have_mpirun()) {
    skip_test("no mpirun (apt-get install openmpi-bin)");
    return;
  }
  const fs::path dir = scratch_dir();
  const std::string single = (dir / "single").string(), ddp = (dir / "ddp").string();
  // The two uninterrupted runs: one process with batches of 32, two with 16 each.
  RunResult r = train(1, "--set train.checkpoint_dir=" + single);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  r = train(2, "-p ddp --set data.batch_size=16 --set train.checkpoint_dir=" + ddp);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  // Both runs see the same samples per step: they end on the same parameters.
  CHECK(max_relative_difference(dir / "single" / "step-00000006", dir / "ddp" / "step-00000006") < 1e-5);

  // single -> ddp(2): resumed at step 3, the same step 6.
  const std::string to_ddp = (dir / "to_ddp").string();
  r = train(2, "-p ddp --set data.batch_size=16 --set train.checkpoint_dir=" + to_ddp + " --resume " + single +
                   "/step-00000003");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.err.find("booster: resumed on 2 processes (ddp) from a checkpoint of 1 (single): the same samples make "
                   "each step; gradients are averaged in another order") != std::string::npos);
  CHECK(max_relative_difference(dir / "single" / "step-00000006", dir / "to_ddp" / "step-00000006") < 1e-5);

  // ddp(2) -> single.
  const std::string to_single = (dir / "to_single").string();
  r = train(1, "--set train.checkpoint_dir=" + to_single + " --resume " + ddp + "/step-00000003");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.err.find("booster: resumed on 1 process (single) from a checkpoint of 2 (ddp)") != std::string::npos);
  CHECK(max_relative_difference(dir / "ddp" / "step-00000006", dir / "to_single" / "step-00000006") < 1e-5);

  // Another global batch (2 x 32) would see other samples per step: refused, naming it.
  r = train(2, "-p ddp --set train.checkpoint_dir=" + (dir / "other").string() + " --resume " + single +
                   "/step-00000003");
  CHECK(r.exit_code != 0);
  CHECK(r.err.find("data.global_batch_size 32 but this run has 64") != std::string::npos);
}

TEST_CASE("a sharded checkpoint still needs its plugin and world size", "[cli][checkpoint][mpi]") {
  if (!have_mpirun()) {
    skip_test("no mpirun (apt-get install openmpi-bin)");
    return;
  }
  const fs::path dir = scratch_dir();
  const std::string zero = (dir / "zero").string();
  RunResult r = train(2, "-p low_level_zero --set data.batch_size=16 --set train.max_steps=3 --set train.checkpoint_dir=" + zero);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  r = train(1, "--set train.checkpoint_dir=" + (dir / "from_zero").string() + " --resume " + zero + "/step-00000003");
  INFO(r.err);
  CHECK(r.exit_code != 0);
  // low_level_zero manages precision itself, so its strategy differs first.
  CHECK(r.err.find("was saved with mixed_precision \"low_level_zero\" but this run has \"fp32\"") != std::string::npos);
  // The other way: a single checkpoint into low_level_zero on 2 processes.
  const std::string single = (dir / "single3").string();
  r = train(1, "--set train.max_steps=3 --set train.checkpoint_dir=" + single);
  REQUIRE(r.exit_code == 0);
  r = train(2, "-p low_level_zero --set data.batch_size=16 --set train.checkpoint_dir=" + (dir / "to_zero").string() +
                   " --resume " + single + "/step-00000003");
  INFO(r.err);
  CHECK(r.exit_code != 0);
  CHECK(r.err.find("was saved with mixed_precision \"fp32\" but this run has \"low_level_zero\"") != std::string::npos);
}

namespace {

json summary(const RunResult& r) { return json::parse(testing::last_line(r.out)); }

// The test loss of the "eval" record at `step` in a run directory's metrics.jsonl.
double eval_loss_at(const fs::path& run_dir, int step) {
  std::ifstream in(run_dir / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const json record = json::parse(line);
    if (record.at("kind") == "eval" && record.at("step") == step) return record.at("test_loss").get<double>();
  }
  FAIL("no eval record at step " << step << " in " << run_dir);
  return 0.0;
}

}  // namespace

TEST_CASE("a checkpoint resumes under another float32-parameter strategy and keeps learning", "[cli][checkpoint][amp]") {
  const fs::path dir = scratch_dir();
  const std::string common =
      "--set train.epochs=2 --set train.max_steps=16 --set train.eval_every=8 --set train.checkpoint_every=8 ";
  const std::vector<std::pair<std::string, std::string>> changes = {
      {"fp16", "bf16"}, {"bf16", "fp16"}, {"fp32", "fp16"}, {"fp8", "bf16"}};
  for (const auto& [from, to] : changes) {
    INFO(from << " -> " << to);
    const fs::path first = dir / ("from_" + from), second = dir / ("to_" + to + "_from_" + from);
    RunResult r = train(1, common + "-m " + from + " --set train.run_dir=" + first.string() +
                               " --set train.checkpoint_dir=" + (first / "ckpt").string());
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    r = train(1, common + "-m " + to + " --set train.run_dir=" + second.string() + " --set train.checkpoint_dir=" +
                     (second / "ckpt").string() + " --resume " + (first / "ckpt" / "step-00000008").string());
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(r.err.find("booster: resumed under " + to + " from a checkpoint of " + from +
                     ": float32 weights and optimizer state carry over; the strategy's own state (loss scale, fp8 "
                     "scaling) starts afresh") != std::string::npos);
    // It continues: the test loss after step 16 is below the checkpoint's at step 8.
    CHECK(summary(r).at("test_loss").get<double>() < eval_loss_at(first, 8));
    CHECK(summary(r).at("steps") == 16);
  }
  // fp16_naive keeps float32 masters beside a float16 model: refused either way, naming why.
  const fs::path naive = dir / "naive";
  RunResult r = train(1, common + "-m fp16_naive --set train.run_dir=null --set train.checkpoint_dir=" + naive.string());
  REQUIRE(r.exit_code == 0);
  r = train(1, common + "-m bf16 --set train.run_dir=null --set train.checkpoint_dir=" + (dir / "x").string() +
                   " --resume " + (naive / "step-00000008").string());
  CHECK(r.exit_code != 0);
  CHECK(r.err.find("was saved with mixed_precision \"fp16_naive\" but this run has \"bf16\", and fp16_naive saved "
                   "float32 master weights") != std::string::npos);
  r = train(1, common + "-m fp16_naive --set train.run_dir=null --set train.checkpoint_dir=" + (dir / "y").string() +
                   " --resume " + (dir / "from_fp16" / "ckpt" / "step-00000008").string());
  CHECK(r.exit_code != 0);
  CHECK(r.err.find("and this run's strategy keeps float32 master weights") != std::string::npos);
}
