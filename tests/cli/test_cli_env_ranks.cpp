// `booster train` started as torchrun starts its processes: RANK / WORLD_SIZE / LOCAL_RANK and
// MASTER_ADDR / MASTER_PORT in the environment, no MPI launcher (Note [Rendezvous without MPI] and Note
// [TCP process group] in distributed/README.md). The processes make one job over the tcp group: it ends
// on the same bytes as the same job under mpirun, only rank 0 prints, a killed rank ends the others
// with its name instead of a hang, and a missing meeting place is a config error.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "local_sockets.h"
#include "run_booster.h"
#include "skip.h"

namespace fs = std::filesystem;
using nlohmann::json;
using testing::RunResult;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_env_ranks"); }

// Launcher variables of this test's own environment removed, one thread per process.
const char* kClean =
    "env -u OMPI_COMM_WORLD_SIZE -u OMPI_COMM_WORLD_RANK -u PMIX_RANK -u PMI_SIZE -u PMI_RANK -u WORLD_SIZE -u RANK "
    "-u LOCAL_RANK -u BOOSTER_WORLD_SIZE -u BOOSTER_RANK -u BOOSTER_LOCAL_RANK -u BOOSTER_NCCL_ID_FILE -u MASTER_ADDR "
    "-u MASTER_PORT OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1";

// A small CPU run; its run directory is removed first so that a refused run can be seen to write nothing.
fs::path cpu_config(const std::string& name, int max_steps = 4, int epochs = 4) {
  const fs::path run_dir = scratch_dir() / (name + "_run");
  fs::remove_all(run_dir);
  json config = json::parse(R"({
    "model": {"type": "mlp", "in": 8, "hidden": [16], "classes": 3},
    "optimizer": {"type": "adamw", "lr": 0.01},
    "data": {"type": "synthetic", "num_samples": 256, "num_test_samples": 32, "num_features": 8,
             "num_classes": 3, "batch_size": 16},
    "train": {"log_every": 1, "eval_every": 2, "seed": 3, "checkpoint_every": 2, "keep_last": 0,
              "collective_timeout_s": 60}
  })");
  config["train"]["epochs"] = epochs;
  config["train"]["max_steps"] = max_steps;
  config["train"]["run_dir"] = run_dir.string();
  const fs::path p = scratch_dir() / (name + ".json");
  fs::create_directories(p.parent_path());
  std::ofstream(p) << config.dump(2);
  return p;
}

// What each process of a job printed, and how it ended.
struct Job {
  std::vector<RunResult> ranks;
};

// Starts `booster <args>` as `n` processes with torchrun's variables (rank r in dir/rank-r), the
// meeting place MASTER_ADDR=127.0.0.1 and a free MASTER_PORT, `env` added; runs the bash snippet `meanwhile`
// (which may read $pid0, $pid1, ...), then waits for every process.
Job run_env_job(const fs::path& dir, int n, const std::string& args, const std::string& env = "",
                const std::string& meanwhile = "") {
  fs::remove_all(dir);
  std::string script = "cd " + dir.string() + " || exit 99; ";
  const std::string port = std::to_string(testing::free_port());
  const std::string common = std::string(kClean) + " WORLD_SIZE=" + std::to_string(n) +
                             " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port + " " + env + " ";
  for (int r = 0; r < n; ++r) {
    const std::string rank_dir = "rank-" + std::to_string(r);
    fs::create_directories(dir / rank_dir);
    script += "(cd " + rank_dir + " && exec " + common + "RANK=" + std::to_string(r) + " LOCAL_RANK=" +
              std::to_string(r) + " " + BOOSTER_BIN_DIR + "/booster " + args +
              " >stdout.txt 2>stderr.txt) & pid" + std::to_string(r) + "=$!; ";
  }
  script += (meanwhile.empty() ? ":" : meanwhile) + "; ";
  for (int r = 0; r < n; ++r)
    script += "wait $pid" + std::to_string(r) + "; echo $? >rank-" + std::to_string(r) + "/status; ";
  const fs::path file = dir / "job.sh";
  std::ofstream(file) << script;
  std::system(("bash " + file.string()).c_str());
  Job job;
  for (int r = 0; r < n; ++r) {
    const fs::path rank_dir = dir / ("rank-" + std::to_string(r));
    RunResult result;
    const std::string status = testing::read_text(rank_dir / "status");
    result.exit_code = status.empty() ? -1 : std::stoi(status);
    result.out = testing::read_text(rank_dir / "stdout.txt");
    result.err = testing::read_text(rank_dir / "stderr.txt");
    job.ranks.push_back(result);
  }
  return job;
}

std::string what_ranks_printed(const Job& job) {
  std::string all;
  for (size_t r = 0; r < job.ranks.size(); ++r)
    all += "rank " + std::to_string(r) + " exit " + std::to_string(job.ranks[r].exit_code) + "\nstdout:\n" +
           job.ranks[r].out + "stderr:\n" + job.ranks[r].err + "\n";
  return all;
}

}  // namespace

TEST_CASE("booster train under torchrun's variables trains one job, as under mpirun", "[cli][train][rendezvous]") {
  struct Case {
    const char* plugin;
    int processes;
    const char* options;
    const char* example;  // an example config, or null for the small MLP
  };
  // hybrid_parallel: tp 2 x pp 2, so tensor-parallel all-reduces, pipeline sends and subgroups.
  const Case cases[] = {
      {"ddp", 2, "--plugin ddp", nullptr},
      {"low_level_zero", 2, "--plugin low_level_zero --set plugin.stage=3 --set plugin.precision=fp32", nullptr},
      {"hybrid_parallel", 4, "--set train.eval_every=2 --set train.max_steps=4 --set train.checkpoint_every=2",
       "gpt_char_hybrid.json"},
  };
  for (const Case& c : cases) {
    DYNAMIC_SECTION(c.plugin) {
      if (const std::string why = testing::why_no_mpi(c.plugin); !why.empty()) return skip_test(why);
      const fs::path config = c.example ? fs::path(BOOSTER_SOURCE_DIR) / "examples/configs" / c.example
                                        : cpu_config(std::string("same_") + c.plugin);
      const fs::path tcp_root = scratch_dir() / (std::string("tcp_") + c.plugin);
      const fs::path mpi_root = scratch_dir() / (std::string("mpi_") + c.plugin);
      fs::remove_all(tcp_root);
      fs::remove_all(mpi_root);
      const std::string args = "train --config " + config.string() + " --set train.run_dir=null " + c.options;

      const Job job = run_env_job(scratch_dir() / (std::string("job_") + c.plugin), c.processes,
                                  args + " --set train.checkpoint_dir=" + tcp_root.string());
      INFO(what_ranks_printed(job));
      for (const RunResult& r : job.ranks) REQUIRE(r.exit_code == 0);
      // Rank 0 prints the run; the others stay silent on stdout.
      CHECK_THAT(job.ranks[0].out, Catch::Contains("\"steps\": 4") || Catch::Contains("\"steps\":4"));
      for (size_t r = 1; r < job.ranks.size(); ++r) CHECK(job.ranks[r].out.empty());

      const std::string under_mpirun = "run -n " + std::to_string(c.processes) + " -- " + BOOSTER_BIN_DIR +
                                       "/booster " + args + " --set train.checkpoint_dir=" + mpi_root.string();
      const RunResult mpi =
          testing::run_booster_in(scratch_dir() / "mpi", under_mpirun, "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1");
      INFO(mpi.out << mpi.err);
      REQUIRE(mpi.exit_code == 0);
      // Every sum is of two ranks' values, which rounds the same in either order: the same bytes.
      const auto tcp_files = testing::files_of(tcp_root), mpi_files = testing::files_of(mpi_root);
      REQUIRE(tcp_files.size() > 2);
      CHECK(tcp_files == mpi_files);
    }
  }
}

TEST_CASE("a rank killed under torchrun's variables ends the others with its name", "[cli][train][rendezvous]") {
  if (!testing::have_plugin("ddp")) return skip_test("the ddp plugin is not built");
  const fs::path config = cpu_config("killed", 100000, 100000);
  // Rank 0 prints a line per step (on stderr, not a terminal); once it has, rank 1 is killed mid-run.
  const std::string kill = "for i in $(seq 1 1200); do grep -q '^step' rank-0/stderr.txt 2>/dev/null && break; "
                           "sleep 0.05; done; kill -9 $pid1";
  const Job job = run_env_job(scratch_dir() / "job_killed", 2,
                              "train --config " + config.string() +
                                  " --plugin ddp --set train.collective_timeout_s=60 --set train.checkpoint_every=0",
                              "", kill);
  INFO(what_ranks_printed(job));
  CHECK(job.ranks[1].exit_code == 137);
  CHECK(job.ranks[0].exit_code == 1);
  CHECK_THAT(job.ranks[0].err, Catch::Contains("rank 1") && Catch::Contains("closed its connection"));
}

TEST_CASE("booster train under torchrun's variables without a meeting place is refused, exit 2",
          "[cli][train][rendezvous]") {
  const fs::path config = cpu_config("nowhere");
  const RunResult r = testing::run_booster_in(scratch_dir() / "nowhere", "train --config " + config.string(),
                                              std::string(kClean) + " WORLD_SIZE=2 RANK=1 LOCAL_RANK=1");
  INFO(r.out << r.err);
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Catch::Contains("needs a place for them to meet: set MASTER_ADDR and MASTER_PORT"));
  CHECK(r.out.empty());
  CHECK_FALSE(fs::exists(scratch_dir() / "nowhere_run"));

  // A world of one trains as before, with or without a meeting place.
  const RunResult one = testing::run_booster_in(scratch_dir() / "one", "train --config " + config.string(),
                                                std::string(kClean) + " WORLD_SIZE=1 RANK=0");
  INFO(one.err);
  CHECK(one.exit_code == 0);
}

TEST_CASE("a rank whose peers never come fails after train.collective_timeout_s, naming rank 0",
          "[cli][train][rendezvous]") {
  // The ranks meet while the config is resolved (the plugin's layout makes the group), so the config's
  // timeout must hold by then, not the 1800 s default. `timeout` ends a run that waits longer.
  const fs::path config = cpu_config("alone");
  const RunResult r = testing::run_booster_in(
      scratch_dir() / "alone", "train --config " + config.string() + " --plugin ddp --set train.collective_timeout_s=2",
      "timeout -k 5 120 " + std::string(kClean) + " WORLD_SIZE=2 RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
          std::to_string(testing::free_port()));
  INFO(r.out << r.err);
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Catch::Contains("rank 1 waited 2 s for rank 0 at 127.0.0.1:"));
}
