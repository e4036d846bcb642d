// `booster run --max-restarts K [--min-processes M]` (cli/run.cpp, Note [Restarting a failed job]): a
// job that loses a rank is restarted from its newest checkpoint and ends as an uninterrupted run does.
// A rank dies through the trainer's test hook BOOSTER_TEST_KILL_AT_STEP=S[:FILE] (SIGKILL on the last
// rank after step S; with FILE only once); BOOSTER_TEST_MAX_PROCESSES=k is a lost node.
#include <catch2/catch.hpp>

#include "skip.h"

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "run_booster.h"

namespace fs = std::filesystem;
using nlohmann::json;
using testing::have_mpirun;
using testing::RunResult;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_elastic"); }

const char* kNoMpirun = "no mpirun (apt-get install openmpi-bin)";

bool have_ddp() { return fs::exists(fs::path(BOOSTER_LIB_DIR) / "libbooster_plugin_ddp.so"); }

RunResult run_booster(const std::string& args, const std::string& env = "") {
  return testing::run_booster_in(scratch_dir(), args, "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 " + env);
}

size_t count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

// A short ddp run that saves every 5 steps into `run_dir` (removed first).
fs::path ddp_config(const std::string& name) {
  const fs::path run_dir = scratch_dir() / (name + "_run");
  fs::remove_all(run_dir);
  const json c = json::parse(R"({
    "model": {"type": "mlp", "in": 8, "hidden": [16], "classes": 3},
    "optimizer": {"type": "adamw", "lr": 0.01},
    "data": {"type": "synthetic", "num_samples": 512, "num_test_samples": 64, "num_features": 8,
             "num_classes": 3, "batch_size": 16},
    "train": {"epochs": 2, "max_steps": 24, "log_every": 4, "seed": 3, "checkpoint_every": 5},
    "plugin": "ddp"
  })");
  json config = c;
  config["train"]["run_dir"] = run_dir.string();
  const fs::path p = scratch_dir() / (name + ".json");
  std::ofstream(p) << config.dump(2);
  return p;
}

double final_loss(const RunResult& r) { return json::parse(testing::last_line(r.out)).at("final_loss").get<double>(); }

}  // namespace

TEST_CASE("booster run --max-restarts restarts a job whose rank was killed and it ends as an uninterrupted run",
          "[cli][run][elastic][mpi]") {
  if (!have_mpirun() || !have_ddp()) return skip_test(!have_mpirun() ? kNoMpirun : "the ddp plugin is not built");
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

TEST_CASE("booster run --max-restarts gives up after K restarts with the last error and its status",
          "[cli][run][elastic][mpi]") {
  if (!have_mpirun() || !have_ddp()) return skip_test(!have_mpirun() ? kNoMpirun : "the ddp plugin is not built");
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
  if (!have_mpirun() || !have_ddp()) return skip_test(!have_mpirun() ? kNoMpirun : "the ddp plugin is not built");
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
