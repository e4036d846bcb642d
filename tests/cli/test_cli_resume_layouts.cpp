// Resuming across world sizes (Note [Resuming across layouts] in booster/booster/state.cpp), as a user
// does it: a single-process checkpoint resumed under ddp on 2 processes with half the per-rank batch,
// and a ddp checkpoint resumed by one process, each continue the uninterrupted run: the same samples
// make every step, so the parameters after the last step agree to float32 reordering (within the
// bound Note [Roundoff bounds] in tests/roundoff.h derives for SGD along the reference's path);
// the resume says so in one line; low_level_zero (stages 1, 2 and 3, 2 and 4 ranks) joins them both ways.
// Another global batch is refused naming it. A checkpoint of one strategy resumes under another
// (Note [Resuming under another precision]: fp16 -> bf16, fp16_naive -> fp16, ZeRO fp16 -> fp16, ...)
// and training goes on (the test loss keeps falling); a 16-bit model without masters (apex O3) is
// refused either way, naming why.
#include <catch2/catch.hpp>

#include "skip.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "booster/checkpoint/checkpoint.h"
#include "booster/checkpoint/checksums.h"
#include "roundoff.h"
#include "run_booster.h"
#include "trajectory.h"

namespace fs = std::filesystem;
using nlohmann::json;
using testing::RunResult;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_resume_layouts"); }

const char* kEnv = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1";

RunResult run_booster(const std::string& args) { return testing::run_booster_in(scratch_dir(), args, kEnv); }

using testing::have_mpirun;

// 256 samples, 8 global batches of 32 an epoch; SGD with momentum (whose state moves between layouts
// like Adam's, and whose steps do not amplify roundoff: Note [Roundoff bounds]) and a cosine schedule
// over 13 steps (into the second epoch, so its reshuffle counts too); a checkpoint every step: a resume
// at step 3 runs 10 more, and the reference's steps give the path its bound is measured along.
const char* kModel = R"({"type": "mlp", "in": 8, "hidden": [16], "classes": 3})";
constexpr uint64_t kSeed = 3;

fs::path write_config() {
  json c = json::parse(R"({
    "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.9},
    "criterion": {"type": "cross_entropy"},
    "data": {"type": "synthetic", "num_samples": 256, "num_test_samples": 64, "num_features": 8,
             "num_classes": 3, "batch_size": 32},
    "lr_scheduler": {"type": "cosine"},
    "train": {"epochs": 2, "max_steps": 13, "log_every": 1, "seed": 3, "run_dir": null,
              "checkpoint_every": 1, "keep_last": 0}
  })");
  c["model"] = json::parse(kModel);
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

// Whether `got` (a step-13 checkpoint) ends where the reference run in `reference` (one checkpoint a
// step) ends, within sgd_bound along the reference's path from the initial model (seed 3, as `booster
// train` builds it): this MLP's reductions are Linears of 8 and 16 inputs, 3 classes and the mean and
// weight-gradient sums over 32 rows.
bool same_trajectory(const fs::path& reference, const fs::path& got) {
  namespace ro = ::testing::roundoff;
  const double path = testing::checkpoint_path(reference, 13, json::parse(kModel), kSeed);
  const double forward = ro::mlp_forward_length({8, 16}, 3, 32);
  const double bound = ro::sgd_bound(path, ro::reduction_bound({2 * forward, 32}), 0.9);
  const double difference =
      testing::l2_distance(testing::weights_at(got), testing::weights_at(testing::step_path(reference, 13)));
  INFO(got.string() << ": |difference| " << difference << ", bound " << bound << " (path " << path << ")");
  CHECK(difference <= bound);
  return difference <= bound;
}

}  // namespace

TEST_CASE("a single-process checkpoint resumes under ddp on 2 processes and back, on the same trajectory",
          "[cli][checkpoint][mpi][roundoff]") {
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
  CHECK(same_trajectory(dir / "single", dir / "ddp" / "step-00000013"));

  // single -> ddp(2): resumed at step 3, the same step 13.
  const std::string to_ddp = (dir / "to_ddp").string();
  r = train(2, "-p ddp --set data.batch_size=16 --set train.checkpoint_dir=" + to_ddp + " --resume " + single +
                   "/step-00000003");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.err.find("booster: resumed on 2 processes (ddp) from a checkpoint of 1 (single): the same samples make "
                   "each step; gradients are averaged in another order") != std::string::npos);
  CHECK(same_trajectory(dir / "single", dir / "to_ddp" / "step-00000013"));

  // ddp(2) -> single.
  const std::string to_single = (dir / "to_single").string();
  r = train(1, "--set train.checkpoint_dir=" + to_single + " --resume " + ddp + "/step-00000003");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.err.find("booster: resumed on 1 process (single) from a checkpoint of 2 (ddp)") != std::string::npos);
  CHECK(same_trajectory(dir / "single", dir / "to_single" / "step-00000013"));

  // Another global batch (2 x 32) would see other samples per step: refused, naming it.
  r = train(2, "-p ddp --set train.checkpoint_dir=" + (dir / "other").string() + " --resume " + single +
                   "/step-00000003");
  CHECK(r.exit_code != 0);
  CHECK(r.err.find("data.global_batch_size 32 but this run has 64") != std::string::npos);
}

TEST_CASE("a low_level_zero checkpoint resumes under single, ddp and ZeRO-1/2/3 on 2 and 4 ranks, on the same "
          "trajectory",
          "[cli][checkpoint][mpi][roundoff]") {
  if (!have_mpirun()) {
    skip_test("no mpirun (apt-get install openmpi-bin)");
    return;
  }
  const fs::path dir = scratch_dir();
  const std::string zero_fp32 = "-p low_level_zero --set plugin.precision=fp32 ";
  const std::string reference = (dir / "zero_reference").string(), zero2 = (dir / "zero2").string();
  RunResult r = train(1, "--set train.checkpoint_dir=" + reference);
  REQUIRE(r.exit_code == 0);
  r = train(2, zero_fp32 + "--set plugin.stage=2 --set data.batch_size=16 --set train.checkpoint_dir=" + zero2);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  // ZeRO-2 on 2 ranks follows the single-process trajectory.
  CHECK(same_trajectory(reference, fs::path(zero2) / "step-00000013"));

  struct Resume {
    int processes;
    std::string args, from, line;
  };
  const std::string from_zero2 = zero2 + "/step-00000003", from_single = reference + "/step-00000003";
  const std::vector<Resume> resumes = {
      {1, "", from_zero2, "resumed on 1 process (single) from a checkpoint of 2 (low_level_zero stage 2)"},
      {2, "-p ddp --set data.batch_size=16 ", from_zero2,
       "resumed on 2 processes (ddp) from a checkpoint of 2 (low_level_zero stage 2)"},
      {4, zero_fp32 + "--set plugin.stage=1 --set data.batch_size=8 ", from_zero2,
       "resumed on 4 processes (low_level_zero stage 1) from a checkpoint of 2 (low_level_zero stage 2)"},
      {2, zero_fp32 + "--set plugin.stage=2 --set data.batch_size=16 ", from_single,
       "resumed on 2 processes (low_level_zero stage 2) from a checkpoint of 1 (single)"},
      // Stage 3 shards the parameters too; its checkpoints are the same files.
      {4, zero_fp32 + "--set plugin.stage=3 --set data.batch_size=8 ", from_zero2,
       "resumed on 4 processes (low_level_zero stage 3) from a checkpoint of 2 (low_level_zero stage 2)"},
      {2, zero_fp32 + "--set plugin.stage=3 --set data.batch_size=16 ", from_single,
       "resumed on 2 processes (low_level_zero stage 3) from a checkpoint of 1 (single)"},
  };
  for (size_t i = 0; i < resumes.size(); ++i) {
    const Resume& resume = resumes[i];
    INFO(resume.line);
    const fs::path out = dir / ("resumed_" + std::to_string(i));
    r = train(resume.processes, resume.args + "--set train.checkpoint_dir=" + out.string() + " --resume " + resume.from);
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(r.err.find("booster: " + resume.line + ": the same samples make each step") != std::string::npos);
    CHECK(same_trajectory(reference, out / "step-00000013"));
  }

  // And a stage-3 checkpoint resumes under one process.
  const std::string zero3 = (dir / "zero3").string();
  r = train(2, zero_fp32 + "--set plugin.stage=3 --set data.batch_size=16 --set train.checkpoint_dir=" + zero3);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(same_trajectory(reference, fs::path(zero3) / "step-00000013"));
  const fs::path from_zero3 = dir / "from_zero3";
  r = train(1, "--set train.checkpoint_dir=" + from_zero3.string() + " --resume " + zero3 + "/step-00000003");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.err.find("booster: resumed on 1 process (single) from a checkpoint of 2 (low_level_zero stage 3)") !=
        std::string::npos);
  CHECK(same_trajectory(reference, from_zero3 / "step-00000013"));

  // A checkpoint of the version before (no precision label, plugin options, portable_layout or
  // param_names; "single_process_layout": false for low_level_zero) loads as before: under its own
  // plugin and world size to the same bytes, and it moves like a new one.
  const fs::path old = dir / "old_version" / "step-00000003";
  fs::create_directories(old.parent_path());
  fs::copy(from_zero2, old, fs::copy_options::recursive);
  json state = json::parse(std::ifstream(old / "trainer_state.json"));
  for (const char* added : {"precision", "plugin_options", "portable_layout"}) REQUIRE(state.erase(added) == 1);
  state["single_process_layout"] = false;
  std::ofstream(old / "trainer_state.json", std::ios::trunc) << state.dump();
  json optimizer = json::parse(std::ifstream(old / "optimizer" / "optimizer.json"));
  REQUIRE(optimizer.erase("param_names") == 1);
  std::ofstream(old / "optimizer" / "optimizer.json", std::ios::trunc) << optimizer.dump();
  booster::checkpoint::write_checksums(old);  // as that version saved it
  const fs::path same = dir / "old_same_layout";
  r = train(2, zero_fp32 + "--set plugin.stage=2 --set data.batch_size=16 --set train.checkpoint_dir=" + same.string() +
                   " --resume " + old.string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.err.find("booster: resumed on") == std::string::npos);
  CHECK(testing::weights_at(fs::path(zero2) / "step-00000013") == testing::weights_at(same / "step-00000013"));
  const fs::path moved = dir / "old_moved";
  r = train(1, "--set train.checkpoint_dir=" + moved.string() + " --resume " + old.string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.err.find("booster: resumed on 1 process (single) from a checkpoint of 2 (low_level_zero stage 2)") !=
        std::string::npos);
  CHECK(same_trajectory(reference, moved / "step-00000013"));
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

TEST_CASE("a checkpoint resumes under another precision, masters or not, and keeps learning", "[cli][checkpoint][amp]") {
  const fs::path dir = scratch_dir();
  const std::string common =
      "--set train.epochs=2 --set train.max_steps=16 --set train.eval_every=8 --set train.checkpoint_every=8 ";
  struct Strategy {
    std::string args, label;
  };
  const Strategy fp16{"-m fp16", "fp16"}, bf16{"-m bf16", "bf16"}, fp32{"-m fp32", "fp32"}, fp8{"-m fp8", "fp8"},
      naive{"-m fp16_naive", "fp16_naive"}, o2{"-m fp16_apex --set mixed_precision.opt_level=O2", "fp16_apex O2"},
      bf16_pure{"-m bf16 --set mixed_precision.pure=true", "bf16 pure"};
  // Float32 parameters both sides; float32 masters beside a 16-bit model (fp16_naive, apex O2, pure
  // bf16) from and to float32 parameters, and between two kinds of masters.
  const std::vector<std::pair<Strategy, Strategy>> changes = {
      {fp16, bf16}, {bf16, fp16}, {fp32, fp16}, {fp8, bf16},   {naive, fp16},
      {fp16, naive}, {naive, o2}, {o2, bf16_pure}, {bf16_pure, fp32}};
  for (const auto& [from, to] : changes) {
    INFO(from.label << " -> " << to.label);
    auto file_name = [](std::string label) {
      std::replace(label.begin(), label.end(), ' ', '_');
      return label;
    };
    const fs::path first = dir / ("from_" + file_name(from.label)),
                   second = dir / ("to_" + file_name(to.label) + "_from_" + file_name(from.label));
    if (!fs::exists(first / "ckpt" / "step-00000008")) {
      RunResult r = train(1, common + from.args + " --set train.run_dir=" + first.string() +
                                 " --set train.checkpoint_dir=" + (first / "ckpt").string());
      INFO(r.err);
      REQUIRE(r.exit_code == 0);
    }
    RunResult r = train(1, common + to.args + " --set train.run_dir=" + second.string() + " --set train.checkpoint_dir=" +
                               (second / "ckpt").string() + " --resume " + (first / "ckpt" / "step-00000008").string());
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(r.err.find("booster: resumed under " + to.label + " from a checkpoint of " + from.label +
                     ": float32 weights and optimizer state carry over; the strategy's own state (loss scale, fp8 "
                     "scaling) starts afresh") != std::string::npos);
    // It continues: the test loss after step 16 is below the checkpoint's at step 8.
    CHECK(summary(r).at("test_loss").get<double>() < eval_loss_at(first, 8));
    CHECK(summary(r).at("steps") == 16);
  }
  // apex O3 steps a float16 model without masters: it cannot continue float32 weights, and its own
  // checkpoint has none to give.
  const fs::path o3 = dir / "o3";
  const std::string o3_args = "-m fp16_apex --set mixed_precision.opt_level=O3 ";
  RunResult r = train(1, common + o3_args + "--set train.run_dir=null --set train.checkpoint_dir=" + o3.string());
  REQUIRE(r.exit_code == 0);
  r = train(1, common + "-m fp32 --set train.run_dir=null --set train.checkpoint_dir=" + (dir / "x").string() +
                   " --resume " + (o3 / "step-00000008").string());
  CHECK(r.exit_code != 0);
  CHECK(r.err.find("was saved with mixed_precision \"fp16_apex O3\" but this run has \"fp32\", and its model holds "
                   "'layers.0.weight' as float16 and it saved no float32 master weights to continue from") !=
        std::string::npos);
  r = train(1, common + o3_args + "--set train.run_dir=null --set train.checkpoint_dir=" + (dir / "y").string() +
                   " --resume " + (dir / "from_fp16" / "ckpt" / "step-00000008").string());
  CHECK(r.exit_code != 0);
  CHECK(r.err.find("and this run's parameter 'layers.0.weight' is float16 and its strategy keeps no float32 master "
                   "weights") != std::string::npos);
}

TEST_CASE("a precision change across plugins carries the masters: ZeRO fp16 to fp16, fp16_naive to ZeRO bf16",
          "[cli][checkpoint][mpi][amp]") {
  if (!have_mpirun()) {
    skip_test("no mpirun (apt-get install openmpi-bin)");
    return;
  }
  const fs::path dir = scratch_dir();
  const std::string common =
      "--set train.epochs=2 --set train.max_steps=16 --set train.eval_every=8 --set train.checkpoint_every=8 ";
  const std::string zero = "-p low_level_zero --set plugin.initial_scale=65536 --set data.batch_size=16 ";
  struct Change {
    int from_processes;
    std::string from_args;
    int to_processes;
    std::string to_args, line;
  };
  const std::vector<Change> changes = {
      {2, zero, 1, "-m fp16", "resumed under fp16 from a checkpoint of low_level_zero (fp16)"},
      {1, "-m fp16_naive", 2, zero + "--set plugin.precision=bf16 --set plugin.stage=2",
       "resumed under low_level_zero (bf16) from a checkpoint of fp16_naive"},
  };
  for (size_t i = 0; i < changes.size(); ++i) {
    const Change& c = changes[i];
    INFO(c.line);
    const fs::path first = dir / ("first_" + std::to_string(i)), second = dir / ("second_" + std::to_string(i));
    RunResult r = train(c.from_processes, common + c.from_args + " --set train.run_dir=" + first.string() +
                                              " --set train.checkpoint_dir=" + (first / "ckpt").string());
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    r = train(c.to_processes, common + c.to_args + " --set train.run_dir=" + second.string() +
                                  " --set train.checkpoint_dir=" + (second / "ckpt").string() + " --resume " +
                                  (first / "ckpt" / "step-00000008").string());
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(r.err.find("booster: " + c.line) != std::string::npos);
    CHECK(summary(r).at("test_loss").get<double>() < eval_loss_at(first, 8));
  }
}

// The refusal of another global batch names a command line that restores it: data.batch_size (the
// global batch is no key of the config), and it works as written.
TEST_CASE("a resume refused for another global batch names the --set data.batch_size that restores it",
          "[cli][checkpoint]") {
  const fs::path dir = scratch_dir();
  const std::string saved = (dir / "global_saved").string(), resumed = (dir / "global_resumed").string();
  fs::remove_all(saved);
  fs::remove_all(resumed);
  // ddp on one process, then single: another layout, so the global batch is what is compared.
  RunResult r = train(1, "-p ddp --set train.max_steps=3 --set train.checkpoint_dir=" + saved);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const std::string resume = "--set train.max_steps=3 --set train.checkpoint_dir=" + resumed + " --resume " + saved +
                             "/step-00000002";
  r = train(1, "--set data.batch_size=16 " + resume);
  INFO(r.err);
  REQUIRE(r.exit_code == 1);
  CHECK_THAT(r.err, Catch::Contains("data.global_batch_size 32 but this run has 16") &&
                        Catch::Contains("resume with data.batch_size x processes = 32: --set data.batch_size=32 on 1 "
                                        "process"));
  // The --set it names, as written.
  const size_t at = r.err.find("--set ", r.err.find("data.batch_size x processes"));
  REQUIRE(at != std::string::npos);
  const std::string set = r.err.substr(at, r.err.find(' ', at + 6) - at);
  r = train(1, set + " " + resume);
  INFO(set << "\n" << r.err);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.err, Catch::Contains("resumed on 1 process (single) from a checkpoint of 1 (ddp)"));
}
