// `booster run --max-restarts K [--min-processes M]` (cli/run.cpp, Note [Restarting a failed job]): a
// job that loses a rank is restarted from its newest checkpoint and ends as an uninterrupted run does,
// under ddp, ZeRO-3 and hybrid_parallel (tp 2 x dp 2, pp 2 x dp 2), and on fewer processes (4 -> 2) within
// the bound of a resume across world sizes. A rank dies through the trainer's test hook
// BOOSTER_TEST_KILL_AT_STEP=S[:FILE] (SIGKILL on the last rank after step S; with FILE only once);
// BOOSTER_TEST_MAX_PROCESSES=k is a lost node. Where the step is drawn, it comes from Catch's
// --rng-seed (kill_step), so another seed kills elsewhere and a failure replays with the seed in INFO.
#include <catch2/catch.hpp>

#include "skip.h"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "roundoff.h"
#include "run_booster.h"
#include "trajectory.h"

namespace fs = std::filesystem;
using nlohmann::json;
using testing::have_mpirun;
using testing::kNoMpirun;
using testing::RunResult;

namespace {


fs::path scratch_dir() { return testing::scratch_dir("test_cli_elastic"); }

RunResult run_booster(const std::string& args, const std::string& env = "") {
  return testing::run_booster_in(scratch_dir(), args, "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 " + env);
}

size_t count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

// A short ddp run that saves every 5 steps.
json ddp_json() {
  return json::parse(R"({
    "model": {"type": "mlp", "in": 8, "hidden": [16], "classes": 3},
    "optimizer": {"type": "adamw", "lr": 0.01},
    "data": {"type": "synthetic", "num_samples": 512, "num_test_samples": 64, "num_features": 8,
             "num_classes": 3, "batch_size": 16},
    "train": {"epochs": 2, "max_steps": 24, "log_every": 4, "seed": 3, "checkpoint_every": 5},
    "plugin": "ddp"
  })");
}

double final_loss(const RunResult& r) { return json::parse(testing::last_line(r.out)).at("final_loss").get<double>(); }

// The step after which the last rank is killed, from first to last: the `nth` draw from Catch's
// --rng-seed (0 unless given), so the test is the same on every run with one seed and kills elsewhere
// with another.
int kill_step(int first, int last, int nth = 0) {
  std::mt19937 draw(Catch::rngSeed());
  draw.discard(uint64_t(nth));
  return first + int(draw() % uint32_t(last - first + 1));
}

// The step a restart after a kill at `killed` resumes from: the hook kills before step `killed` is
// saved, so the newest checkpoint is the one before it (0: none, the restart starts from step 0).
int resumed_step(int killed, int every) { return (killed - 1) / every * every; }

std::string step_name(int step) { return testing::step_path("", step).string(); }

// A config file `name`.json of `c` that saves into `run_dir` (removed first).
fs::path write_config(const std::string& name, json c) {
  const fs::path run_dir = scratch_dir() / (name + "_run");
  fs::remove_all(run_dir);
  c["train"]["run_dir"] = run_dir.string();
  const fs::path p = scratch_dir() / (name + ".json");
  std::ofstream(p) << c.dump(2);
  return p;
}
fs::path run_dir_of(const std::string& name) { return scratch_dir() / (name + "_run"); }

// The ddp run of ddp_json() into `name`_run.
fs::path ddp_config(const std::string& name) { return write_config(name, ddp_json()); }

// Checks what a job killed after `killed` and restarted once printed: one restart, resumed from the
// checkpoint before the kill (or from step 0 when there is none yet), and all `steps` steps done.
void check_restarted_once(const RunResult& r, const std::string& name, int killed, int every, int steps) {
  CHECK(count(r.err, "booster run: restart ") == 1);
  CHECK_THAT(r.err, Catch::Contains("booster run: restart 1 of ") &&
                        Catch::Contains(" after exit status 137 (signal 9") &&
                        Catch::Contains("; resuming from the newest valid checkpoint (--resume latest)"));
  CHECK_THAT(r.err, !Catch::Contains(".; "));  // mpirun's full stop does not end the line mid-sentence
  const int from = resumed_step(killed, every);
  if (from > 0) {
    CHECK_THAT(r.err, Catch::Contains("booster: resumed from " + (run_dir_of(name) / "checkpoints").string() + "/" +
                                      step_name(from) + " at step " + std::to_string(from)));
  } else {
    CHECK_THAT(r.err, Catch::Contains("yet; starting from step 0"));
  }
  CHECK(json::parse(testing::last_line(r.out))["steps"] == steps);
}

// Whether two checkpoints hold the same model bytes.
bool same_model(const fs::path& a, const fs::path& b) { return testing::weights_at(a) == testing::weights_at(b); }

}  // namespace

TEST_CASE("booster run --max-restarts restarts a job whose rank was killed and it ends as an uninterrupted run",
          "[cli][run][elastic][mpi]") {
  if (const std::string why = testing::why_no_mpi(); !why.empty()) return skip_test(why);
  RunResult whole = run_booster("run -n 2 -- booster train --config " + ddp_config("whole").string());
  INFO(whole.err);
  REQUIRE(whole.exit_code == 0);

  const fs::path once = scratch_dir() / "killed_once";
  fs::remove(once);
  RunResult r = run_booster("run -n 2 --max-restarts 2 -- booster train --config " + ddp_config("killed").string(),
                            "BOOSTER_TEST_KILL_AT_STEP=12:" + once.string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(count(r.err, "booster run: restart ") == 1);
  CHECK_THAT(r.err, Catch::Contains("booster run: restart 1 of 2 after exit status 137 (signal 9") &&
                        Catch::Contains("exited on signal 9") &&
                        Catch::Contains("; resuming from the newest valid checkpoint (--resume latest)"));
  CHECK_THAT(r.err, Catch::Contains("resumed from ") && Catch::Contains("step-00000010 at step 10"));
  CHECK(json::parse(testing::last_line(r.out))["steps"] == 24);
  CHECK(final_loss(r) == final_loss(whole));  // exact resume
}

// ZeRO-3 shards the parameters, the fp16 masters and AdamW's state over the ranks, and the loss scale
// moves: the restarted job must get every shard and the scale back to end on the same bytes.
TEST_CASE("booster run --max-restarts under ZeRO-3 on 2 ranks: a rank killed at a drawn step, the run ends on the "
          "same bytes",
          "[cli][run][elastic][mpi][zero]") {
  if (!have_mpirun() || !fs::exists(fs::path(BOOSTER_LIB_DIR) / "libbooster_plugin_low_level_zero.so"))
    return skip_test(!have_mpirun() ? kNoMpirun : "the low_level_zero plugin is not built");
  const int killed = kill_step(1, 23);
  INFO("--rng-seed " << Catch::rngSeed() << ": the last rank is killed after step " << killed);
  json c = ddp_json();
  c["plugin"] = {{"name", "low_level_zero"}, {"stage", 3}, {"precision", "fp16"}, {"initial_scale", 1024}};
  RunResult whole = run_booster("run -n 2 -- booster train --config " + write_config("zero3_whole", c).string());
  INFO(whole.err);
  REQUIRE(whole.exit_code == 0);

  const fs::path once = scratch_dir() / "zero3_once";
  fs::remove(once);
  RunResult r = run_booster("run -n 2 --max-restarts 1 -- booster train --config " +
                                write_config("zero3_killed", c).string(),
                            "BOOSTER_TEST_KILL_AT_STEP=" + std::to_string(killed) + ":" + once.string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  check_restarted_once(r, "zero3_killed", killed, 5, 24);
  CHECK(final_loss(r) == final_loss(whole));  // exact resume
  CHECK(json::parse(testing::last_line(r.out))["final_loss_scale"] ==
        json::parse(testing::last_line(whole.out))["final_loss_scale"]);
  const fs::path last = fs::path("checkpoints") / step_name(24);
  CHECK(same_model(run_dir_of("zero3_killed") / last, run_dir_of("zero3_whole") / last));
}

// The example tp 2 x dp 2 GPT (gpt_char_dp2_tp2.json), and pp 2 x dp 2 (gpt_char_hybrid.json with
// tp_size 1), made small: 4 processes, each rank a half of every layer, or one of the two stages, of one
// of the two replicas.
TEST_CASE("booster run --max-restarts under hybrid_parallel tp 2 x dp 2 and pp 2 x dp 2 on 4 ranks: a rank killed at "
          "a drawn step, the run ends on the same bytes",
          "[cli][run][elastic][mpi][hybrid]") {
  if (!have_mpirun() || !fs::exists(fs::path(BOOSTER_LIB_DIR) / "libbooster_plugin_hybrid_parallel.so"))
    return skip_test(!have_mpirun() ? kNoMpirun : "the hybrid_parallel plugin is not built");
  const std::string configs = std::string(BOOSTER_SOURCE_DIR) + "/examples/configs/";
  for (const auto& [name, file, plugin] : std::vector<std::tuple<std::string, std::string, json>>{
           {"tp2_dp2", "gpt_char_dp2_tp2.json", json::object()},
           {"pp2_dp2", "gpt_char_hybrid.json", {{"tp_size", 1}, {"num_microbatches", 2}}}}) {
    const int killed = kill_step(1, 15, name == "tp2_dp2" ? 0 : 1);
    INFO(name << ", --rng-seed " << Catch::rngSeed() << ": the last rank is killed after step " << killed);
    json c = json::parse(std::ifstream(configs + file));
    c["plugin"].update(plugin);
    c["model"].update(json{{"context", 16}, {"width", 32}, {"heads", 2}});
    c["data"].update(json{{"context", 16}, {"batch_size", 4}});
    c["train"].update(json{{"max_steps", 16}, {"log_every", 4}, {"eval_every", 8}, {"checkpoint_every", 4}});
    RunResult whole = run_booster("run -n 4 -- booster train --config " + write_config(name + "_whole", c).string());
    INFO(whole.err);
    REQUIRE(whole.exit_code == 0);

    const fs::path once = scratch_dir() / (name + "_once");
    fs::remove(once);
    RunResult r = run_booster("run -n 4 --max-restarts 1 -- booster train --config " +
                                  write_config(name + "_killed", c).string(),
                              "BOOSTER_TEST_KILL_AT_STEP=" + std::to_string(killed) + ":" + once.string());
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    check_restarted_once(r, name + "_killed", killed, 4, 16);
    CHECK(final_loss(r) == final_loss(whole));  // exact resume
    const fs::path last = fs::path("checkpoints") / step_name(16);
    CHECK(same_model(run_dir_of(name + "_killed") / last, run_dir_of(name + "_whole") / last));
  }
}

// A node of a 4-process ZeRO-3 job is lost: the restart runs on 2 with twice the per-rank batch, so
// every step sees the same 32 samples, summed in another order. Note [Roundoff bounds] (tests/roundoff.h)
// bounds that under SGD with momentum, along the uninterrupted run's own path: the bound that resuming
// across world sizes meets in test_cli_resume_layouts (the MLP's Linears of 8 and 16 inputs, 3 classes,
// and the sums over 32 rows), with the same config.
TEST_CASE("booster run --min-processes 2 restarts a 4-process ZeRO-3 job on 2 with the same global batch, within the "
          "bound of a resume across world sizes",
          "[cli][run][elastic][mpi][zero][roundoff]") {
  if (!have_mpirun() || !fs::exists(fs::path(BOOSTER_LIB_DIR) / "libbooster_plugin_low_level_zero.so"))
    return skip_test(!have_mpirun() ? kNoMpirun : "the low_level_zero plugin is not built");
  const int killed = kill_step(2, 12);
  INFO("--rng-seed " << Catch::rngSeed() << ": the last rank is killed after step " << killed);
  const json model = json::parse(R"({"type": "mlp", "in": 8, "hidden": [16], "classes": 3})");
  json c = json::parse(R"({
    "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.9},
    "criterion": {"type": "cross_entropy"},
    "data": {"type": "synthetic", "num_samples": 256, "num_test_samples": 64, "num_features": 8,
             "num_classes": 3, "batch_size": 8},
    "lr_scheduler": {"type": "cosine"},
    "train": {"epochs": 2, "max_steps": 13, "log_every": 1, "seed": 3, "checkpoint_every": 1, "keep_last": 0},
    "plugin": {"name": "low_level_zero", "stage": 3, "precision": "fp32"}
  })");
  c["model"] = model;
  RunResult whole = run_booster("run -n 4 -- booster train --config " + write_config("shrink_whole", c).string());
  INFO(whole.err);
  REQUIRE(whole.exit_code == 0);

  const fs::path once = scratch_dir() / "shrink_once";
  fs::remove(once);
  RunResult r = run_booster("run -n 4 --max-restarts 1 --min-processes 2 -- booster train --config " +
                                write_config("shrink_killed", c).string(),
                            "BOOSTER_TEST_KILL_AT_STEP=" + std::to_string(killed) + ":" + once.string() +
                                " BOOSTER_TEST_MAX_PROCESSES=2");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Catch::Contains("; on 2 processes instead of 4 (2 slots left), data.batch_size 8 -> 16 keeps the "
                                    "global batch of 32; resuming from the newest valid checkpoint (--resume latest)"));
  CHECK_THAT(r.err, Catch::Contains("booster: resumed on 2 processes (low_level_zero stage 3) from a checkpoint of 4 "
                                    "(low_level_zero stage 3): the same samples make each step"));
  check_restarted_once(r, "shrink_killed", killed, 1, 13);
  CHECK(json::parse(testing::last_line(r.out))["processes"] == 2);

  namespace ro = ::testing::roundoff;
  const fs::path reference = run_dir_of("shrink_whole") / "checkpoints";
  const fs::path got = run_dir_of("shrink_killed") / "checkpoints";
  // Up to the kill both ran on 4 processes: the same bytes.
  CHECK(same_model(got / step_name(killed - 1), reference / step_name(killed - 1)));
  const double path = testing::checkpoint_path(reference, 13, model, 3);
  const double bound =
      ro::sgd_bound(path, ro::reduction_bound({2 * ro::mlp_forward_length({8, 16}, 3, 32), 32}), 0.9);
  const double difference = testing::l2_distance(testing::weights_at(got / step_name(13)),
                                                 testing::weights_at(reference / step_name(13)));
  INFO("|difference| " << difference << ", bound " << bound << " (path " << path << ")");
  CHECK(difference <= bound);
}

TEST_CASE("booster run --max-restarts gives up after K restarts with the last error and its status",
          "[cli][run][elastic][mpi]") {
  if (const std::string why = testing::why_no_mpi(); !why.empty()) return skip_test(why);
  // Every attempt resumes from step 10 and dies again at step 12.
  RunResult r = run_booster("run -n 2 --max-restarts 2 -- booster train --config " + ddp_config("always").string(),
                            "BOOSTER_TEST_KILL_AT_STEP=12");
  INFO(r.err);
  CHECK(r.exit_code == 137);
  CHECK(count(r.err, "booster run: restart ") == 2);
  CHECK_THAT(r.err, Catch::Contains("booster run: restart 2 of 2 after exit status 137"));
  CHECK_THAT(r.err, Catch::Contains("booster run: error: the job failed after 2 restarts (--max-restarts 2), giving up: "
                                    "exit status 137 (signal 9"));
}

TEST_CASE("booster run --max-restarts never restarts a config error", "[cli][run][elastic][mpi]") {
  if (!have_mpirun()) return skip_test(kNoMpirun);
  json c = json::parse(R"({"model": {"type": "nope"}, "data": {"type": "synthetic"}, "train": {"run_dir": null}})");
  const fs::path p = scratch_dir() / "bad.json";
  std::ofstream(p) << c.dump();
  RunResult r = run_booster("run -n 2 --max-restarts 3 -- booster train --config " + p.string());
  INFO(r.err);
  CHECK(r.exit_code == 2);
  CHECK(count(r.err, "'model.type' is \"nope\"") == 1);  // one attempt
  CHECK_THAT(r.err, !Catch::Contains("booster run: restart"));
  CHECK_THAT(r.err, Catch::Contains("booster run: not restarted: exit status 2 is a config or usage error"));
}

TEST_CASE("booster run --min-processes restarts on fewer processes with the same global batch",
          "[cli][run][elastic][mpi]") {
  if (const std::string why = testing::why_no_mpi(); !why.empty()) return skip_test(why);
  RunResult whole = run_booster("run -n 2 -- booster train --config " + ddp_config("whole2").string());
  REQUIRE(whole.exit_code == 0);
  const fs::path once = scratch_dir() / "shrunk_once";
  fs::remove(once);
  const std::string killed = "BOOSTER_TEST_KILL_AT_STEP=12:" + once.string() + " BOOSTER_TEST_MAX_PROCESSES=1";
  RunResult r = run_booster("run -n 2 --max-restarts 1 --min-processes 1 -- booster train --config " +
                                ddp_config("shrunk").string(), killed);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Catch::Contains("; on 1 process instead of 2 (1 slot left), data.batch_size 16 -> 32 keeps the "
                                    "global batch of 32; resuming from the newest valid checkpoint"));
  CHECK_THAT(r.err, Catch::Contains("resumed on 1 process (ddp) from a checkpoint of 2 (ddp)"));
  const json summary = json::parse(testing::last_line(r.out));
  CHECK(summary["processes"] == 1);
  CHECK(summary["steps"] == 24);
  CHECK(final_loss(r) == Approx(final_loss(whole)).epsilon(1e-5));  // another summation order

  // Without --min-processes the job needs its 2 processes: no restart on 1.
  fs::remove(once);
  RunResult refused = run_booster("run -n 2 --max-restarts 1 -- booster train --config " +
                                      ddp_config("refused").string(), killed);
  INFO(refused.err);
  CHECK(refused.exit_code == 137);
  CHECK_THAT(refused.err, Catch::Contains("booster run: error: only 1 slot is left for the 2 processes and "
                                          "--min-processes is 2; cannot restart"));

  // Only data-parallel checkpoints resume on fewer processes: the single plugin's processes are copies.
  fs::remove(once);
  RunResult single = run_booster("run -n 2 --max-restarts 1 --min-processes 1 -- booster train --config " +
                                     ddp_config("single").string() + " --plugin single", killed);
  INFO(single.err);
  CHECK(single.exit_code == 137);
  CHECK_THAT(single.err, Catch::Contains("a checkpoint of plugin 'single' resumes only on as many processes as "
                                         "saved it"));
}

TEST_CASE("booster run checks --max-restarts and --min-processes", "[cli][run][elastic]") {
  for (const auto& [args, expect] : std::vector<std::pair<std::string, std::string>>{
           {"run -n 2 --max-restarts x -- echo hi", "--max-restarts is 'x'; expected a number of restarts from 0"},
           {"run -n 2 --min-processes 3 -- echo hi", "--min-processes 3 is more than -n 2"},
           {"run -n 2 --min-processes 0 -- echo hi", "--min-processes is '0'"}}) {
    INFO(args);
    RunResult r = run_booster(args);
    INFO(r.err);
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Catch::Contains(expect));
  }
  CHECK_THAT(run_booster("run --help").out, Catch::Contains("--max-restarts K") && Catch::Contains("--min-processes M"));
}

// mpirun ends a job that lost a rank by SIGTERM to the others a second later and SIGKILL a second after:
// two seconds of every restart, while those ranks wait in a collective and cannot save. A job with
// --max-restarts is ended at once (Note [Restarting a failed job]); without it mpirun's default stays.
TEST_CASE("booster run --max-restarts has mpirun end a job that lost a rank at once", "[cli][run][elastic]") {
  if (!have_mpirun()) return skip_test(kNoMpirun);
  RunResult r = run_booster("run -n 2 --max-restarts 1 --dry-run -- echo hi");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Catch::Contains(" --mca odls_base_sigkill_timeout 0 "));
  r = run_booster("run -n 2 --dry-run -- echo hi");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, !Catch::Contains("odls_base_sigkill_timeout"));
}
