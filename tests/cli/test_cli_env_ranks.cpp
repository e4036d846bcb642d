// `booster train` under torchrun-style variables without an MPI launcher (Note [Rendezvous without MPI]
// in distributed/README.md): refused with a ConfigError, exit 2, rather than N processes each training
// alone on all the data into one run directory.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "run_booster.h"

namespace fs = std::filesystem;
using nlohmann::json;
using testing::RunResult;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_env_ranks"); }

// A small CPU run; its run directory is removed first so that a refused run can be seen to write nothing.
fs::path cpu_config(const std::string& name) {
  const fs::path run_dir = scratch_dir() / (name + "_run");
  fs::remove_all(run_dir);
  json config = json::parse(R"({
    "model": {"type": "mlp", "in": 8, "hidden": [16], "classes": 3},
    "optimizer": {"type": "adamw", "lr": 0.01},
    "data": {"type": "synthetic", "num_samples": 64, "num_test_samples": 16, "num_features": 8,
             "num_classes": 3, "batch_size": 16},
    "train": {"epochs": 1, "max_steps": 2, "log_every": 1, "seed": 3}
  })");
  config["train"]["run_dir"] = run_dir.string();
  const fs::path p = scratch_dir() / (name + ".json");
  fs::create_directories(p.parent_path());
  std::ofstream(p) << config.dump(2);
  return p;
}

// Runs booster with the launcher variables of this test's own environment removed, and `env` set.
RunResult train(const fs::path& config, const std::string& env) {
  return testing::run_booster_in(scratch_dir(), "train --config " + config.string(),
                                 "env -u OMPI_COMM_WORLD_SIZE -u PMIX_RANK -u PMI_SIZE -u PMI_RANK -u WORLD_SIZE "
                                 "-u RANK -u BOOSTER_WORLD_SIZE -u BOOSTER_RANK OMP_NUM_THREADS=1 " + env);
}

}  // namespace

TEST_CASE("booster train under WORLD_SIZE of several processes without an MPI launcher is refused, exit 2",
          "[cli][train][rendezvous]") {
  const fs::path config = cpu_config("torchrun");
  RunResult r = train(config, "WORLD_SIZE=4 RANK=1 LOCAL_RANK=1");
  INFO(r.out << r.err);
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Catch::Contains("WORLD_SIZE=4 is set but no MPI launcher started this process: booster train "
                                    "on 4 processes needs `booster run -n 4` (mpirun)"));
  CHECK(r.out.empty());
  CHECK_FALSE(fs::exists(scratch_dir() / "torchrun_run"));

  r = train(config, "BOOSTER_WORLD_SIZE=2 BOOSTER_RANK=0");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Catch::Contains("BOOSTER_WORLD_SIZE=2 is set but no MPI launcher started this process"));

  // A world of one trains as before.
  r = train(config, "WORLD_SIZE=1 RANK=0");
  INFO(r.err);
  CHECK(r.exit_code == 0);
}
