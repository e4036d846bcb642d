// What `booster train` reports about a run, where a new user would be misled (issue 33): the precision a
// plugin that controls it runs in (low_level_zero's fp16, not the Booster's identity "fp32") and the
// warm-up of its loss scale (Note [The loss scale's warm-up] in core/booster/trainer/trainer.cpp); the
// loss of a data-parallel run, which is the global batch's and so the same curve at any number of
// processes (Note [The loss of a data-parallel step]); and evaluation, which must not change training
// (Note [Forwards that do not train] in core/booster/mixed_precision/float8.h).
#include <catch2/catch.hpp>

#include "skip.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "roundoff.h"
#include "run_booster.h"
#include "trajectory.h"

namespace fs = std::filesystem;
using nlohmann::json;
using Catch::Contains;
using testing::RunResult;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_reporting"); }

const char* kEnv = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1";

RunResult run_booster(const std::string& args) { return testing::run_booster_in(scratch_dir(), args, kEnv); }

// `booster train` of `config` on `processes` processes (1: directly; more: booster run -n) with extra
// arguments.
RunResult train(const json& config, const std::string& name, int processes, const std::string& args) {
  const fs::path file = scratch_dir() / (name + ".json");
  std::ofstream(file) << config.dump(2);
  const std::string command = "train --config " + file.string() + " " + args;
  if (processes == 1) return run_booster(command);
  return run_booster("run -n " + std::to_string(processes) + " -- " + std::string(BOOSTER_BIN_DIR) + "/booster " +
                     command);
}

// A small synthetic classification run (8 global batches of 32 an epoch) that trains in a second.
json synthetic_config() {
  return json::parse(R"({
    "model": {"type": "mlp", "in": 8, "hidden": [16], "classes": 3},
    "optimizer": {"type": "adamw", "lr": 0.01},
    "criterion": {"type": "cross_entropy"},
    "data": {"type": "synthetic", "num_samples": 256, "num_test_samples": 64, "num_features": 8,
             "num_classes": 3, "batch_size": 32},
    "train": {"epochs": 2, "log_every": 1, "seed": 3, "run_dir": null}
  })");
}

json summary_of(const RunResult& r) { return json::parse(testing::last_line(r.out)); }

// The records of one kind in a run directory's metrics.jsonl.
std::vector<json> records(const fs::path& run_dir, const std::string& kind) {
  std::vector<json> out;
  std::istringstream in(testing::read_text(run_dir / "metrics.jsonl"));
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && json::parse(line).at("kind") == kind) out.push_back(json::parse(line));
  return out;
}

// step -> loss of the progress output's log lines ("step N/T | epoch E | loss L | ...").
std::map<long long, double> logged_losses(const std::string& err) {
  std::map<long long, double> out;
  std::istringstream in(err);
  for (std::string line; std::getline(in, line);) {
    long long step = 0, total = 0, epoch = 0;
    double loss = 0;
    if (std::sscanf(line.c_str(), "step %lld/%lld | epoch %lld | loss %lf", &step, &total, &epoch, &loss) == 4)
      out[step] = loss;
  }
  return out;
}

// Whether two files hold the same bytes (a Catch comparison would print both).
bool same_bytes(const fs::path& a, const fs::path& b) {
  INFO(a.string() << " and " << b.string());
  REQUIRE(fs::exists(a));
  REQUIRE(fs::exists(b));
  return testing::read_text(a) == testing::read_text(b);
}

}  // namespace

// ------------------------------------------------------------------------------------ the precision

// low_level_zero controls precision: the Booster's strategy is the identity ("fp32"), and the model
// trains in the plugin's fp16 from ColossalAI's loss scale of 2^32, whose first ~17 steps overflow. A
// short run that said "fp32" and skipped every step looked like ZeRO not learning.
TEST_CASE("low_level_zero names the precision it runs in and the warm-up of its loss scale", "[cli][zero][amp]") {
  json c = synthetic_config();
  c["train"]["run_dir"] = (scratch_dir() / "zero_fp16").string();
  fs::remove_all(scratch_dir() / "zero_fp16");
  RunResult r = train(c, "zero_fp16", 1, "--plugin low_level_zero --set train.epochs=10 --set train.max_steps=40");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const std::string zero_fp16 = "fp16 (low_level_zero's own)";
  // The start line, the summary and every train record name it.
  CHECK_THAT(r.err, Contains("precision " + zero_fp16 + ", plugin low_level_zero"));
  CHECK_THAT(r.err, !Contains("precision fp32"));
  json summary = summary_of(r);
  CHECK(summary["mixed_precision"] == zero_fp16);
  const std::vector<json> train_records = records(scratch_dir() / "zero_fp16", "train");
  REQUIRE(train_records.size() == 40);
  for (const json& record : train_records) CHECK(record.value("precision", json()) == zero_fp16);
  // The warm-up is said at the start: 16 halvings from 2^32 to 2^16, after the first overflow that
  // hysteresis 2 forgives.
  CHECK_THAT(r.err, Contains("booster: the loss scale starts at 2^32 and halves on each overflowing step after the "
                             "first 1 (hysteresis 2): the first ~17 steps may be skipped; set plugin.initial_scale "
                             "to start lower"));
  CHECK(r.err.find("the loss scale starts at") < r.err.find("step      1"));
  // ... and is about what happened: this model's gradients fit float16 from a scale of 2^17.
  const int64_t skipped = summary["skipped_steps"].get<int64_t>();
  CHECK(skipped >= 12);
  CHECK(skipped <= 17);
  CHECK(summary["final_loss_scale"].get<double>() < 4294967296.0);

  // Started within float16's range, or not scaled at all, there is no warm-up to announce.
  r = train(c, "zero_low", 1, "--plugin low_level_zero --set plugin.initial_scale=32768 --set train.max_steps=4 "
                              "--set train.run_dir=null");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, !Contains("loss scale starts"));
  CHECK(summary_of(r)["mixed_precision"] == zero_fp16);
  r = train(c, "zero_bf16", 1, "--plugin low_level_zero --set plugin.precision=bf16 --set train.max_steps=4 "
                               "--set train.run_dir=null");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("precision bf16 (low_level_zero's own)") && !Contains("loss scale starts"));
  CHECK(summary_of(r)["mixed_precision"] == "bf16 (low_level_zero's own)");

  // The Booster's own strategies are named as before; fp16 from 2^22 warms up too, and says its setting.
  r = train(c, "fp16_high", 1, "--mixed-precision fp16 --set mixed_precision.init_scale=4194304 --set "
                               "train.max_steps=4 --set train.run_dir=null");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("precision fp16, plugin single"));
  CHECK_THAT(r.err, Contains("the loss scale starts at 2^22 and halves on each overflowing step: the first ~6 steps "
                             "may be skipped; set mixed_precision.init_scale to start lower"));
  CHECK(summary_of(r)["mixed_precision"] == "fp16");
  r = train(c, "fp16", 1, "--mixed-precision fp16 --set train.max_steps=4 --set train.run_dir=null");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, !Contains("loss scale starts"));
}

// ------------------------------------------------------------------------------------ the loss

// Note [The loss of a data-parallel step]: the same run at -n 1 (batches of 32) and under ddp at -n 2
// (16 per rank: the same samples make each step, test_cli_resume_layouts) must log the same losses.
// Rank 0's own share (16 of the 32 samples) differs from the batch's mean by a few percent here; the
// global mean differs only by float32 roundoff, which Note [Roundoff bounds] (tests/roundoff.h) bounds:
// the loss of step t is L(w_{t-1}), so two runs differ by
//   |L| * reduction_bound(forward)            the batch mean summed in another order, at equal weights,
//   + |g_t| * |w'_{t-1} - w_{t-1}|            to first order, through the weights' difference,
// where |w' - w| <= sgd_bound along the reference's path to step t - 1 and |g_t| = |w_t - w_{t-1}| / lr
// (SGD without momentum at a constant lr), both measured from the reference's checkpoints.
TEST_CASE("a data-parallel run reports the global batch's loss, the same at any world size",
          "[cli][mpi][roundoff]") {
  if (!testing::have_mpirun()) {
    skip_test("no mpirun (apt-get install openmpi-bin)");
    return;
  }
  namespace ro = ::testing::roundoff;
  json c = synthetic_config();
  c["optimizer"] = {{"type", "sgd"}, {"lr", 0.1}};
  const double lr = 0.1;
  const fs::path dir = scratch_dir() / "world_sizes";
  fs::remove_all(dir);
  RunResult one = train(c, "one", 1, "--set train.run_dir=" + (dir / "one").string() +
                                        " --set train.checkpoint_every=1 --set train.keep_last=0");
  INFO(one.err);
  REQUIRE(one.exit_code == 0);
  for (const std::string plugin : {"ddp", "low_level_zero --set plugin.precision=fp32"}) {
    INFO(plugin);
    const fs::path run = dir / (plugin.substr(0, 3) + "_two");
    RunResult two = train(c, "two", 2, "-p " + plugin + " --set data.batch_size=16 --set train.run_dir=" + run.string());
    INFO(two.err);
    REQUIRE(two.exit_code == 0);

    const std::vector<json> a = records(dir / "one", "train"), b = records(run, "train");
    REQUIRE(a.size() == 16);
    REQUIRE(b.size() == 16);
    const double forward = ro::mlp_forward_length({8, 16}, 3, 32);
    const double gradient = ro::reduction_bound({2 * forward, 32});
    std::map<std::string, booster::Tensor> initial;
    for (const auto& [name, t] : booster::nn::make_model(c.at("model"), 3)->state_dict()) initial[name] = t;
    testing::Weights before = testing::flat_weights(initial);
    double path = 0.0;  // sum_{s < t} |w_s - w_{s-1}|: the reference's path to w_{t-1}
    double last_bound = 0.0;
    for (int t = 1; t <= 16; ++t) {
      const testing::Weights now = testing::weights_at(testing::step_path(dir / "one" / "checkpoints", t));
      const double move = testing::l2_distance(now, before);
      const double loss = a[size_t(t - 1)].at("loss").get<double>();
      last_bound = std::abs(loss) * ro::reduction_bound({forward}) + move / lr * ro::sgd_bound(path, gradient);
      const double difference = std::abs(b[size_t(t - 1)].at("loss").get<double>() - loss);
      INFO("step " << t << ": loss " << loss << ", |difference| " << difference << ", bound " << last_bound);
      CHECK(b[size_t(t - 1)].at("step") == t);
      CHECK(difference <= last_bound);
      path += move;
      before = now;
    }
    // The summary's final_loss is the last step's, and the log lines print the same losses.
    CHECK(std::abs(summary_of(two)["final_loss"].get<double>() - summary_of(one)["final_loss"].get<double>()) <=
          last_bound);
    const std::map<long long, double> lines_one = logged_losses(one.err), lines_two = logged_losses(two.err);
    REQUIRE(lines_one.size() == 16);
    REQUIRE(lines_two.size() == 16);
    for (const auto& [step, loss] : lines_one) {
      INFO("step " << step);
      CHECK(std::abs(lines_two.at(step) - loss) <= 1.0001e-4);  // printed with 4 decimals
    }
  }
}

// ------------------------------------------------------------------------------------ evaluation

// Evaluation must leave every strategy's state as it found it: the same run evaluated after every
// step and only at its end trains the same weights, bit for bit, and ends in the same strategy state.
// Under fp8 with delayed scaling the evaluation's amaxes used to enter the next step's scale.
TEST_CASE("evaluating during training changes nothing the run saves, under fp8, fp16 and bf16", "[cli][amp]") {
  json c = synthetic_config();
  c["model"]["hidden"] = {16, 16};  // two fp8 layers (the classifier's last Linear stays bf16)
  c["train"]["checkpoint_every"] = 16;
  for (const std::string precision :
       {"fp8", "fp8 --set mixed_precision.amax_compute_algo=most_recent", "fp8 --set mixed_precision.scaling=current",
        "fp16", "bf16", "bf16 --set mixed_precision.pure=true"}) {
    INFO(precision);
    std::map<int, fs::path> saved;
    for (const int eval_every : {1, 1000}) {  // after every step; only at the end
      const fs::path checkpoints = scratch_dir() / ("eval_" + std::to_string(eval_every));
      fs::remove_all(checkpoints);
      RunResult r = train(c, "eval", 1, "--mixed-precision " + precision + " --set train.eval_every=" +
                                            std::to_string(eval_every) + " --set train.checkpoint_dir=" +
                                            checkpoints.string());
      INFO(r.err);
      REQUIRE(r.exit_code == 0);
      size_t evaluations = 0;
      for (size_t at = r.err.find("eval  step"); at != std::string::npos; at = r.err.find("eval  step", at + 1))
        ++evaluations;
      CHECK(evaluations == (eval_every == 1 ? 16u : 1u));
      saved[eval_every] = checkpoints / "step-00000016";
    }
    CHECK(same_bytes(saved[1] / "model" / "model.safetensors", saved[1000] / "model" / "model.safetensors"));
    // The optimizer's and the strategy's state too (a loss scale, fp8's scales and amax histories).
    for (const char* file : {"optimizer.safetensors", "precision.safetensors", "precision.json"}) {
      INFO(file);
      if (!fs::exists(saved[1000] / "optimizer" / file)) continue;
      CHECK(same_bytes(saved[1] / "optimizer" / file, saved[1000] / "optimizer" / file));
    }
  }
}

// A resume under the precision the checkpoint was saved with continues it without a word about a
// change of precision ("resumed under X from a checkpoint of Y" is for a resume that switched), for
// strategies whose labels carry options (fp16_apex O1, bf16 pure, fp8) and a plugin's own precision.
TEST_CASE("a resume under the same precision says nothing of a precision change", "[cli][resume]") {
  const std::string configs = std::string(BOOSTER_SOURCE_DIR) + "/examples/configs/";
  for (const std::string name : {"fashion_mnist_fp16", "fashion_mnist_apex_O1", "fashion_mnist_bf16_pure",
                                 "fashion_mnist_fp8", "fashion_mnist_zero1_fp16"}) {
    INFO(name);
    const fs::path first = scratch_dir() / ("same_precision_" + name), second = first.string() + "_resumed";
    fs::remove_all(first);
    fs::remove_all(second);
    const std::string common = "train --config " + configs + name + ".json --set train.max_steps=4 " +
                               "--set train.checkpoint_every=2 --set train.eval_every=0 --set train.run_dir=";
    const RunResult a = run_booster(common + first.string());
    REQUIRE(a.exit_code == 0);
    const RunResult b = run_booster(common + second.string() + " --resume " + (first / "checkpoints" / "step-00000002").string());
    INFO(b.err);
    REQUIRE(b.exit_code == 0);
    CHECK_THAT(b.err, Contains("resumed from"));
    CHECK_THAT(b.err, !Contains("resumed under"));
  }
}
