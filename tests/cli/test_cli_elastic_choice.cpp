// Which world size `booster run --max-restarts K --min-processes M` picks when a restart finds fewer slots
// (cli/run.cpp, Note [Restarting a failed job]): the MOST processes, from M up to the slots left, that
// divide the global batch; the slots left are the fewer of the re-read hostfile's and the lost-node hook's,
// never more than -n. The other elastic tests had one valid choice each (4 -> 2 of 2 slots, 2 -> 1), so
// picking the fewest, the first slot count, or one that does not divide the batch passed them. Here
// several counts are valid and the test checks the one chosen, the batch size it is given and the
// processes the restarted job really ran on (its summary line).
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "run_booster.h"
#include "skip.h"

namespace fs = std::filesystem;
using nlohmann::json;
using testing::RunResult;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_elastic_choice"); }

RunResult run_booster(const std::string& args, const std::string& env = "") {
  return testing::run_booster_in(scratch_dir(), args, "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 " + env);
}

// A short ddp run of `batch` samples per process that saves every 2 steps; its collectives time out in
// 30 s, so a rank left waiting fails the test with a message instead of hanging it.
fs::path config(const std::string& name, int batch) {
  const fs::path run_dir = scratch_dir() / (name + "_run");
  fs::remove_all(run_dir);
  json c = json::parse(R"({
    "model": {"type": "mlp", "in": 8, "hidden": [8], "classes": 3},
    "optimizer": {"type": "sgd", "lr": 0.05},
    "data": {"type": "synthetic", "num_samples": 240, "num_test_samples": 24, "num_features": 8, "num_classes": 3},
    "train": {"epochs": 1, "max_steps": 6, "log_every": 2, "seed": 5, "checkpoint_every": 2,
              "collective_timeout_s": 30},
    "plugin": "ddp"
  })");
  c["data"]["batch_size"] = batch;
  c["train"]["run_dir"] = run_dir.string();
  const fs::path p = scratch_dir() / (name + ".json");
  std::ofstream(p) << c.dump(2);
  return p;
}

// The last rank dies after step 3, once; `more` adds the hooks that shrink the slots.
std::string killed_once(const std::string& name, const std::string& more) {
  const fs::path once = scratch_dir() / (name + "_once");
  fs::remove(once);
  return "BOOSTER_TEST_KILL_AT_STEP=3:" + once.string() + " " + more;
}

fs::path write_hostfile(const std::string& name, const std::string& text) {
  const fs::path p = scratch_dir() / name;
  std::ofstream(p) << text;
  return p;
}

int processes_run(const RunResult& r) { return json::parse(testing::last_line(r.out)).at("processes").get<int>(); }

}  // namespace

TEST_CASE("elastic choice: 3 slots left of 4 and a global batch of 8 restart on 2, not 3 or 1", "[cli][run][elastic][mpi]") {
  if (const std::string why = testing::why_no_mpi(); !why.empty()) return skip_test(why);
  // Valid: 1 and 2 divide 8 (3 does not). The most that divide is 2.
  const RunResult r = run_booster("run -n 4 --max-restarts 1 --min-processes 1 -- booster train --config " +
                                      config("eight", 2).string(),
                                  killed_once("eight", "BOOSTER_TEST_MAX_PROCESSES=3"));
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Catch::Contains("; on 2 processes instead of 4 (3 slots left), data.batch_size 2 -> 4 keeps the "
                                    "global batch of 8"));
  CHECK(processes_run(r) == 2);
}

TEST_CASE("elastic choice: 3 slots left of 4 and a global batch of 12 restart on all 3", "[cli][run][elastic][mpi]") {
  if (const std::string why = testing::why_no_mpi(); !why.empty()) return skip_test(why);
  // Valid: 1, 2 and 3 divide 12: the most, 3.
  const RunResult r = run_booster("run -n 4 --max-restarts 1 --min-processes 1 -- booster train --config " +
                                      config("twelve", 3).string(),
                                  killed_once("twelve", "BOOSTER_TEST_MAX_PROCESSES=3"));
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Catch::Contains("; on 3 processes instead of 4 (3 slots left), data.batch_size 3 -> 4 keeps the "
                                    "global batch of 12"));
  CHECK(processes_run(r) == 3);
}

TEST_CASE("elastic choice: the slots left are the fewer of the re-read hostfile's and the lost node's, at most -n",
          "[cli][run][elastic][hostfile][mpi]") {
  if (const std::string why = testing::why_no_mpi(); !why.empty()) return skip_test(why);
  const fs::path hosts = write_hostfile("hosts_choice", "localhost slots=4\n");
  {
    // The hostfile drops to 2 slots, the hook allows 3: 2 are left (global 12: 3 would divide it too).
    INFO("hostfile 2, hook 3");
    const RunResult r = run_booster(
        "run -n 4 --hostfile " + hosts.string() + " --max-restarts 1 --min-processes 1 -- booster train --config " +
            config("both", 3).string(),
        killed_once("both", "BOOSTER_TEST_MAX_PROCESSES=3 BOOSTER_TEST_BEFORE_RESTART='echo localhost slots=2 >" +
                                hosts.string() + "'"));
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK_THAT(r.err, Catch::Contains("; on 2 processes instead of 4 (2 slots left), data.batch_size 3 -> 6"));
    CHECK(processes_run(r) == 2);
  }
  {
    // The other way round, the hostfile drops to 3 slots, the hook allows 2: 2 are left (global 12: 3
    // would divide it too, so a launcher that ignores the hook under a hostfile picks 3).
    INFO("hostfile 3, hook 2");
    write_hostfile("hosts_choice", "localhost slots=4\n");
    const RunResult r = run_booster(
        "run -n 4 --hostfile " + hosts.string() + " --max-restarts 1 --min-processes 1 -- booster train --config " +
            config("hook_fewer", 3).string(),
        killed_once("hook_fewer", "BOOSTER_TEST_MAX_PROCESSES=2 BOOSTER_TEST_BEFORE_RESTART='echo localhost slots=3 >" +
                                      hosts.string() + "'"));
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK_THAT(r.err, Catch::Contains("; on 2 processes instead of 4 (2 slots left), data.batch_size 3 -> 6"));
    CHECK(processes_run(r) == 2);
  }
  {
    // The hostfile grows to 6 slots meanwhile: the job restarts as it was, on 4, with its batch size.
    INFO("hostfile 6");
    write_hostfile("hosts_choice", "localhost slots=4\n");
    const RunResult r = run_booster(
        "run -n 4 --hostfile " + hosts.string() + " --max-restarts 1 --min-processes 1 -- booster train --config " +
            config("grown", 3).string(),
        killed_once("grown", "BOOSTER_TEST_BEFORE_RESTART='echo localhost slots=6 >" + hosts.string() + "'"));
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK_THAT(r.err, Catch::Contains("booster run: restart 1 of 1 after exit status 137"));
    CHECK_THAT(r.err, !Catch::Contains(" instead of 4"));
    CHECK_THAT(r.err, !Catch::Contains("data.batch_size 3 ->"));
    CHECK(processes_run(r) == 4);
  }
}

TEST_CASE("elastic choice: no count from --min-processes to the slots left divides the batch: refused, not one below",
          "[cli][run][elastic][mpi]") {
  if (const std::string why = testing::why_no_mpi(); !why.empty()) return skip_test(why);
  // 3 slots, --min-processes 3, global 8: 3 does not divide 8 and 2 is below the minimum.
  const RunResult r = run_booster("run -n 4 --max-restarts 1 --min-processes 3 -- booster train --config " +
                                      config("none", 2).string(),
                                  killed_once("none", "BOOSTER_TEST_MAX_PROCESSES=3"));
  INFO(r.err);
  CHECK(r.exit_code == 137);
  CHECK_THAT(r.err, Catch::Contains("booster run: error: cannot restart on 3 to 3 processes: none divides the global "
                                    "batch of 8 (data.batch_size 2 x 4 processes)"));
}
