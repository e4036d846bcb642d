// The hybrid_parallel example configs as a user runs them (`booster check`, then `booster run -n N --
// booster train`): each passes check, trains, and ends where one process ends on the same batches,
// within bounds derived from float32 roundoff (tests/roundoff.h): tight under plain SGD, and under the
// configs' own AdamW on the first step's loss and by Adam's largest possible drift; the model it saves
// is the single-process file; a resume under the same layout continues bit for bit (with dropout, and
// with fp16_naive's per-rank masters), and under another layout is refused naming the setting.
#include <catch2/catch.hpp>

#include "skip.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <vector>
#include <string>

#include <nlohmann/json.hpp>

#include "booster/checkpoint/safetensors.h"
#include "roundoff.h"
#include "run_booster.h"
#include "trajectory.h"

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

// The train records of a run's metrics.jsonl, in step order.
std::vector<json> train_records(const fs::path& run_dir) {
  std::ifstream in(run_dir / "metrics.jsonl");
  std::vector<json> out;
  for (std::string line; std::getline(in, line);) {
    const json rec = json::parse(line);
    if (rec.at("kind") == "train") out.push_back(rec);
  }
  return out;
}

using testing::l2_distance;
using testing::weights_at;

// The reductions of the example GPT (gpt_char.json: width C 128, 2 layers, head size 32, context T 64,
// vocabulary V 256) on B sequences, as Note [Roundoff bounds] counts them. Forward, per block: layer
// norm (2C), c_attn (C), scores (C / heads), softmax and att . v (2T), c_proj (C), layer norm (2C),
// c_fc (C), mlp c_proj (4C); then ln_f (2C), lm_head (C), log-sum-exp (V) and the mean over B T. A
// weight's gradient runs the forward chain, the same chain back (the transposed products have the
// lengths of the forward ones) and its own sum over the B T positions.
constexpr double kWidth = 128, kLayers = 2, kHeads = 4, kContext = 64, kVocab = 256;
double forward_lengths(double batch) {
  const double block = 2 * kWidth + kWidth + kWidth / kHeads + 2 * kContext + kWidth + 2 * kWidth + kWidth + 4 * kWidth;
  return kLayers * block + 2 * kWidth + kWidth + kVocab + batch * kContext;
}
double loss_bound(double batch) { return ::testing::roundoff::reduction_bound({forward_lengths(batch)}); }
double gradient_bound(double batch) {
  return ::testing::roundoff::reduction_bound({2 * forward_lengths(batch), batch * kContext});
}

}  // namespace

// The layouts of the example configs, each against the single process on the same global batch.
struct Layout {
  const char* file;
  int processes;
  bool replicas;  // dp 2: two replicas of 16 make one step of the single process's 32
};
const Layout kLayouts[] = {{"gpt_char_tp2.json", 2, false},
                           {"gpt_char_pp2.json", 2, false},
                           {"gpt_char_hybrid.json", 4, false},
                           {"gpt_char_dp2_tp2.json", 4, true}};

TEST_CASE("hybrid configs pass booster check and train as one process does", "[cli][mpi][hybrid][roundoff]") {
  if (!have_mpirun()) {
    skip_test("no mpirun (apt-get install openmpi-bin)");
    return;
  }
  namespace ro = ::testing::roundoff;
  // Checked for a world size its grid does not divide: refused, naming the pairs that fit.
  const RunResult misfit = testing::run_booster_in(scratch_dir(), "check --config " + config("gpt_char_hybrid.json") + " -n 2");
  CHECK(misfit.exit_code != 0);
  CHECK_THAT(misfit.err, Catch::Contains("tp_size 2 x pp_size 2 does not divide the world size 2") &&
                             Catch::Contains("pairs that fit: 1x1, 1x2, 2x1"));
  // Plain SGD (lr 0.5 under the configs' cosine schedule), each step saved: the tight comparison. The
  // path sum_t lr_t |g_t| of sgd_bound is the reference's own steps, |w_t - w_{t-1}|, from the model
  // it starts from (model seed 0, as `booster train` builds it).
  const std::string sgd = "--set 'optimizer={\"type\": \"sgd\", \"lr\": 0.5}' --set train.checkpoint_every=1 --set train.keep_last=0 ";
  const json model = json::parse(R"({"type": "gpt", "vocab_size": 256, "context": 64, "width": 128, "layers": 2,
                                      "heads": 4})");
  for (int batch : {16, 32}) {
    INFO("single process, batch " << batch);
    const fs::path dir = scratch_dir() / ("sgd_single" + std::to_string(batch));
    fs::remove_all(dir);
    const RunResult r = train(1, "gpt_char.json", sgd + "--set data.batch_size=" + std::to_string(batch) +
                                                       " --set train.checkpoint_dir=" + dir.string());
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
  }
  for (const Layout& layout : kLayouts) {
    INFO(layout.file << " under SGD");
    const int batch = layout.replicas ? 32 : 16;
    const fs::path reference = scratch_dir() / ("sgd_single" + std::to_string(batch));
    const fs::path saved = scratch_dir() / (std::string("sgd_") + layout.file);
    fs::remove_all(saved);
    const RunResult r = train(layout.processes, layout.file, sgd + "--set train.checkpoint_dir=" + saved.string());
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    const double path = testing::checkpoint_path(reference, 6, model, 0);
    const double d = l2_distance(weights_at(saved / "step-00000006"), weights_at(reference / "step-00000006"));
    const double bound = ro::sgd_bound(path, gradient_bound(batch));
    INFO("difference " << d << ", bound " << bound << " (path " << path << ")");
    CHECK(d <= bound);
    // Not vacuous: another batch (the single process on 16 against 32 sequences) lands far outside it.
    CHECK(l2_distance(weights_at(scratch_dir() / "sgd_single16" / "step-00000006"),
                      weights_at(scratch_dir() / "sgd_single32" / "step-00000006")) >= 10 * bound);
  }

  // The configs as they are (AdamW, betas 0.9 / 0.95, cosine from 3e-3), every step logged.
  const fs::path dir16 = scratch_dir() / "single16", dir32 = scratch_dir() / "single32";
  const std::string logged = "--set train.log_every=1 --set train.checkpoint_every=6 ";
  fs::remove_all(dir16);
  fs::remove_all(dir32);
  RunResult single = train(1, "gpt_char.json", logged + "--set train.run_dir=" + (dir16 / "run").string() +
                                                   " --set train.checkpoint_dir=" + dir16.string());
  REQUIRE(single.exit_code == 0);
  single = train(1, "gpt_char.json", logged + "--set data.batch_size=32 --set train.run_dir=" + (dir32 / "run").string() +
                                         " --set train.checkpoint_dir=" + dir32.string());
  REQUIRE(single.exit_code == 0);
  for (const Layout& layout : kLayouts) {
    INFO(layout.file);
    const RunResult check = testing::run_booster_in(
        scratch_dir(), "check --config " + config(layout.file) + " -n " + std::to_string(layout.processes));
    INFO(check.err);
    CHECK(check.exit_code == 0);
    CHECK_THAT(check.err, Catch::Contains("compatible: mixed precision 'fp32' with plugin 'hybrid_parallel'"));
    const fs::path saved = scratch_dir() / (std::string("model_") + layout.file);
    fs::remove_all(saved);
    const RunResult r = train(layout.processes, layout.file, logged + "--set train.run_dir=" + (saved / "run").string() +
                                                                " --set train.checkpoint_dir=" + saved.string());
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    const fs::path& reference = layout.replicas ? dir32 : dir16;
    const std::vector<json> got = train_records(saved / "run"), want = train_records(reference / "run");
    REQUIRE(got.size() == 6);
    REQUIRE(want.size() == 6);
    // The first step's loss is computed before any update: forward roundoff only. (With two replicas
    // rank 0 reports its replica's loss, another batch than the single process's.)
    if (!layout.replicas) {
      const double l1 = got[0].at("loss").get<double>(), r1 = want[0].at("loss").get<double>();
      CHECK(std::abs(l1 - r1) <= 2 * loss_bound(16) * r1);
    }
    // Each weight within Adam's largest drift (near-zero gradients may flip sign: Note [Roundoff bounds]).
    std::vector<double> lrs;
    for (const json& rec : want) lrs.push_back(rec.at("lr").get<double>());
    const testing::Weights got_w = weights_at(saved / "step-00000006"), want_w = weights_at(reference / "step-00000006");
    REQUIRE(got_w.size() == want_w.size());
    double largest = 0.0;
    for (size_t i = 0; i < got_w.size(); ++i) largest = std::max(largest, std::abs(got_w[i] - want_w[i]));
    INFO("largest weight difference " << largest);
    CHECK(largest <= ro::adam_drift_bound(lrs, 0.9, 0.95));
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

// More pipeline stages than the model has layers to give: a middle stage would hold no parameters. Every
// rank refuses alike with a config error (exit 2) that names the stage, instead of one rank stopping in
// its optimizer ("empty parameter list") while the others wait.
TEST_CASE("hybrid: a pipeline stage left without layers is a config error on every rank", "[cli][hybrid]") {
  if (!have_mpirun()) {
    skip_test("no mpirun (apt-get install openmpi-bin)");
    return;
  }
  const RunResult r = train(4, "gpt_char.json", "--plugin hybrid_parallel --set plugin.pp_size=4 --set model.layers=1");
  INFO(r.err);
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Catch::Contains("would hold no parameters") && Catch::Contains("use a pp_size of at most"));
  CHECK_THAT(r.err, !Catch::Contains("empty parameter list"));
}

// optimizer.json's param_names are the parameters' whole module paths, as the model file names them,
// also where a layer is built alone (the CNN's) or the plugin makes the parameter (a tensor-parallel
// shard): bare "weight" and "bias" would name no parameter of the model file.
TEST_CASE("optimizer.json names every parameter by its module path: the CNN and a tp 2 rank",
          "[cli][hybrid][checkpoint]") {
  auto names_of = [](const fs::path& dir) {
    std::vector<std::string> all;
    for (const auto& entry : fs::recursive_directory_iterator(dir))
      if (entry.path().filename() == "optimizer.json") {
        const json meta = json::parse(std::ifstream(entry.path()));
        for (const json& n : meta.at("param_names")) all.push_back(n.get<std::string>());
      }
    return all;
  };
  auto check_paths = [](const std::vector<std::string>& names, const std::string& first_prefix) {
    REQUIRE_FALSE(names.empty());
    for (const std::string& n : names) {
      INFO(n);
      CHECK(n.find('.') != std::string::npos);
    }
    CHECK(names.front().rfind(first_prefix, 0) == 0);
  };
  const fs::path cnn_dir = scratch_dir() / "names_cnn";
  fs::remove_all(cnn_dir);
  {
    const RunResult r = testing::run_booster_in(
        scratch_dir(), "train --config " + config("fashion_mnist_cnn.json") +
                           " --set train.max_steps=1 --set train.checkpoint_every=1 --set train.eval_every=0 "
                           "--set train.run_dir=" + cnn_dir.string(),
        "OMP_NUM_THREADS=1");
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    check_paths(names_of(cnn_dir), "features.0.");
  }
  if (!have_mpirun()) return skip_test("the tp 2 half needs mpirun (openmpi-bin)");
  const fs::path tp_dir = scratch_dir() / "names_tp2";
  fs::remove_all(tp_dir);
  const RunResult r = train(2, "gpt_char_tp2.json", "--set train.max_steps=1 --set train.checkpoint_every=1 "
                                                    "--set train.run_dir=" + tp_dir.string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const std::vector<std::string> names = names_of(tp_dir);
  check_paths(names, "wte.");
  CHECK(std::find(names.begin(), names.end(), "blocks.0.attn.c_attn.weight") != names.end());
}
