// The hybrid_parallel example configs as a user runs them (`booster check`, then `booster run -n N --
// booster train`): each passes check, trains, and ends where one process ends on the same batches
// (float32 sums in another order: 1e-5 relative on the final loss, and on the saved model of the
// layout with two data-parallel replicas, whose ranks report their replica's loss); the model it saves
// is the single-process file; a resume under the same layout continues bit for bit (with dropout, and
// with fp16_naive's per-rank masters), and under another layout is refused naming the setting.
#include <catch2/catch.hpp>

#include "skip.h"

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "booster/checkpoint/safetensors.h"
#include "run_booster.h"

namespace fs = std::filesystem;
using nlohmann::json;
using testing::RunResult;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_hybrid"); }

using testing::have_mpirun;

std::string config(const std::string& name) { return std::string(BOOSTER_SOURCE_DIR) + "/examples/configs/" + name; }

// `booster train` of an example config on `processes` processes, a few steps, no run directory.
RunResult train(int processes, const std::string& file, const std::string& args) {
  const std::string command = "train --config " + config(file) +
                              " --set train.max_steps=6 --set train.eval_every=3 --set train.run_dir=null " + args;
  const char* env = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1";
  if (processes == 1) return testing::run_booster_in(scratch_dir(), command, env);
  return testing::run_booster_in(scratch_dir(), "run -n " + std::to_string(processes) + " -- " +
                                                    std::string(BOOSTER_BIN_DIR) + "/booster " + command, env);
}

double final_loss(const RunResult& r) { return json::parse(testing::last_line(r.out)).at("final_loss").get<double>(); }

// The largest L2-relative difference of a tensor of two saved models, the key third of attention's
// c_attn bias left out: its exact gradient is zero (softmax does not change when every score of a
// query moves alike), so AdamW steps it on rounding noise (as tests/mpi/test_mpi_hybrid.cpp explains).
double model_difference(const fs::path& a, const fs::path& b) {
  const auto ma = booster::checkpoint::load_model(a), mb = booster::checkpoint::load_model(b);
  REQUIRE(ma.size() == mb.size());
  double worst = 0.0;
  for (const auto& [name, ta] : ma) {
    REQUIRE(mb.count(name));
    const std::vector<double> va = ta.tolist(), vb = mb.at(name).tolist();
    REQUIRE(va.size() == vb.size());
    const bool key_bias = name.size() > 16 && name.compare(name.size() - 16, 16, "attn.c_attn.bias") == 0;
    double diff = 0.0, scale = 0.0;
    for (size_t i = 0; i < va.size(); ++i) {
      if (key_bias && i >= va.size() / 3 && i < 2 * va.size() / 3) continue;
      diff += (va[i] - vb[i]) * (va[i] - vb[i]);
      scale += vb[i] * vb[i];
    }
    worst = std::max(worst, std::sqrt(diff / std::max(scale, 1e-300)));
  }
  return worst;
}

}  // namespace

TEST_CASE("hybrid configs pass booster check and train as one process does", "[cli][mpi][hybrid]") {
  if (!have_mpirun()) {
    skip_test("no mpirun (apt-get install openmpi-bin)");
    return;
  }
  // Checked for a world size its grid does not divide: refused, naming the pairs that fit.
  const RunResult misfit = testing::run_booster_in(scratch_dir(), "check --config " + config("gpt_char_hybrid.json") + " -n 2");
  CHECK(misfit.exit_code != 0);
  CHECK_THAT(misfit.err, Catch::Contains("tp_size 2 x pp_size 2 does not divide the world size 2") &&
                             Catch::Contains("pairs that fit: 1x1, 1x2, 2x1"));
  const fs::path dir16 = scratch_dir() / "single16", dir32 = scratch_dir() / "single32";
  const RunResult single = train(1, "gpt_char.json", "--set train.checkpoint_every=6 --set train.checkpoint_dir=" + dir16.string());
  REQUIRE(single.exit_code == 0);
  // dp 2 x tp 2: two replicas of 16 make one step of the single process's 32.
  const RunResult single32 = train(1, "gpt_char.json", "--set data.batch_size=32 --set train.checkpoint_every=6 --set train.checkpoint_dir=" +
                                                                  dir32.string());
  REQUIRE(single32.exit_code == 0);
  struct Run {
    const char* file;
    int processes;
  };
  for (const Run& run : {Run{"gpt_char_tp2.json", 2}, Run{"gpt_char_pp2.json", 2}, Run{"gpt_char_hybrid.json", 4},
                         Run{"gpt_char_dp2_tp2.json", 4}}) {
    INFO(run.file);
    const RunResult check = testing::run_booster_in(
        scratch_dir(), "check --config " + config(run.file) + " -n " + std::to_string(run.processes));
    INFO(check.err);
    CHECK(check.exit_code == 0);
    CHECK_THAT(check.err, Catch::Contains("compatible: mixed precision 'fp32' with plugin 'hybrid_parallel'"));
    const bool replicas = std::string(run.file) == "gpt_char_dp2_tp2.json";
    const fs::path saved = scratch_dir() / (std::string("model_") + run.file);
    const RunResult r = train(run.processes, run.file,
                                "--set train.checkpoint_every=6 --set train.checkpoint_dir=" + saved.string());
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    const fs::path reference = replicas ? dir32 : dir16;
    if (!replicas) CHECK(std::abs(final_loss(r) - final_loss(single)) <= 1e-5 * final_loss(single));
    CHECK(model_difference(saved / "step-00000006" / "model", reference / "step-00000006" / "model") <= 1e-5);
  }
}

TEST_CASE("a hybrid checkpoint is the single-process model and resumes bit for bit under its layout",
          "[cli][mpi][hybrid][checkpoint]") {
  if (!have_mpirun()) {
    skip_test("no mpirun (apt-get install openmpi-bin)");
    return;
  }
  const fs::path dir = scratch_dir() / "resume";
  fs::remove_all(dir);
  const std::string whole = (dir / "whole").string(), part = (dir / "part").string(), one = (dir / "one").string();
  // With dropout, so each stage's own generator must come back (Note [Per-rank state of a split model]).
  const std::string dropout = "--set model.dropout=0.1 ";
  RunResult r =
      train(4, "gpt_char_hybrid.json", dropout + "--set train.checkpoint_every=3 --set train.checkpoint_dir=" + whole);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  r = train(1, "gpt_char.json", dropout + "--set train.checkpoint_every=3 --set train.checkpoint_dir=" + one);
  REQUIRE(r.exit_code == 0);
  // The same tensors, names and shapes as one process's model file.
  const auto hybrid = booster::checkpoint::load_model(fs::path(whole) / "step-00000006" / "model");
  const auto single = booster::checkpoint::load_model(fs::path(one) / "step-00000006" / "model");
  REQUIRE(hybrid.size() == single.size());
  for (const auto& [name, t] : single) {
    INFO(name);
    REQUIRE(hybrid.count(name));
    CHECK(hybrid.at(name).shape() == t.shape());
  }
  // Resumed at step 3 under the same layout: the same bytes at step 6.
  r = train(4, "gpt_char_hybrid.json", dropout + "--set train.checkpoint_every=3 --set train.checkpoint_dir=" + part +
                                            " --resume " + whole + "/step-00000003");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const auto resumed = booster::checkpoint::load_model(fs::path(part) / "step-00000006" / "model");
  for (const auto& [name, t] : hybrid) {
    INFO(name);
    const std::vector<double> a = t.tolist(), b = resumed.at(name).tolist();
    CHECK(a == b);
  }
  // With fp16_naive, whose float32 masters are each rank's own part (Note [Per-rank state of a split
  // model]): the resumed run ends on the same bytes too.
  const std::string naive = "--mixed-precision fp16_naive --set train.checkpoint_every=3 --set train.checkpoint_dir=";
  r = train(4, "gpt_char_hybrid.json", naive + (dir / "naive").string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  r = train(4, "gpt_char_hybrid.json",
            naive + (dir / "naive_part").string() + " --resume " + (dir / "naive").string() + "/step-00000003");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const auto naive_whole = booster::checkpoint::load_model(dir / "naive" / "step-00000006" / "model");
  const auto naive_resumed = booster::checkpoint::load_model(dir / "naive_part" / "step-00000006" / "model");
  for (const auto& [name, t] : naive_whole) {
    INFO(name);
    CHECK(t.tolist() == naive_resumed.at(name).tolist());
  }
  // zero_stage 1 on two data-parallel ranks: each holds the masters of the parameters it steps.
  const std::string zero = "-p hybrid_parallel --set plugin.zero_stage=1 --set data.batch_size=8 " + naive;
  r = train(2, "gpt_char.json", zero + (dir / "zero").string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  r = train(2, "gpt_char.json", zero + (dir / "zero_part").string() + " --resume " + (dir / "zero").string() +
                                    "/step-00000003");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const auto zero_whole = booster::checkpoint::load_model(dir / "zero" / "step-00000006" / "model");
  const auto zero_resumed = booster::checkpoint::load_model(dir / "zero_part" / "step-00000006" / "model");
  for (const auto& [name, t] : zero_whole) {
    INFO(name);
    CHECK(t.tolist() == zero_resumed.at(name).tolist());
  }
  // Another layout of the same world size is refused, naming the setting that differs.
  r = train(4, "gpt_char_dp2_tp2.json", dropout + "--set plugin.num_microbatches=4 --set train.checkpoint_dir=" +
                                            (dir / "other").string() + " --resume " + whole + "/step-00000003");
  CHECK(r.exit_code != 0);
  CHECK_THAT(r.err, Catch::Contains("was saved with plugin.pp_size 2 but this run has 1"));
}
