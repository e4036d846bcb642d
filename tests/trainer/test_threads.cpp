// Threads per process (Note [Threads per process] in booster/common/threads.h): the count chosen for
// given config values and environment variables, the trainer's start line naming it, and kernels that
// give the same result on 1 and 2 threads. Speed is measured by bench/threads.sh, never here.
#include <catch2/catch.hpp>

#include <map>
#include <string>

#include "booster/common/threads.h"
#include "booster/ops/ops.h"
#include "booster/tensor/random.h"
#include "run_booster.h"

using namespace booster;

namespace {

ThreadChoice choose(std::optional<int64_t> configured, const std::map<std::string, std::string>& env, int cores) {
  return choose_threads(
      configured,
      [&](const char* name) -> const char* {
        const auto it = env.find(name);
        return it == env.end() ? nullptr : it->second.c_str();
      },
      cores);
}

}  // namespace

TEST_CASE("the thread count: train.threads, then OMP_NUM_THREADS, then cores per local process", "[threads]") {
  CHECK(choose(std::nullopt, {}, 8).threads == 8);
  CHECK(choose(std::nullopt, {}, 8).source == "cores");
  // A user's OMP_NUM_THREADS wins over the cores and the launcher's local size.
  CHECK(choose(std::nullopt, {{"OMP_NUM_THREADS", "3"}, {"LOCAL_WORLD_SIZE", "4"}}, 8).threads == 3);
  CHECK(choose(std::nullopt, {{"OMP_NUM_THREADS", "4,1"}}, 8).threads == 4);  // nested list: the outer level
  CHECK(choose(std::nullopt, {{"OMP_NUM_THREADS", "3"}}, 8).source == "OMP_NUM_THREADS");
  // train.threads wins over everything.
  CHECK(choose(5, {{"OMP_NUM_THREADS", "3"}, {"LOCAL_WORLD_SIZE", "4"}}, 8).threads == 5);
  CHECK(choose(5, {}, 8).source == "train.threads");
  // Launchers' local sizes share the cores (torchrun, OpenMPI, MPICH), at least one thread each.
  CHECK(choose(std::nullopt, {{"LOCAL_WORLD_SIZE", "4"}}, 8).threads == 2);
  CHECK(choose(std::nullopt, {{"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}, 8).threads == 4);
  CHECK(choose(std::nullopt, {{"MPI_LOCALNRANKS", "3"}}, 8).threads == 2);
  CHECK(choose(std::nullopt, {{"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}, 2).threads == 1);
  CHECK(choose(std::nullopt, {{"LOCAL_WORLD_SIZE", "4"}}, 8).source == "cores / local processes");
  // Values OpenMP would ignore are ignored: empty, zero, not a number.
  CHECK(choose(std::nullopt, {{"OMP_NUM_THREADS", ""}, {"LOCAL_WORLD_SIZE", "x"}}, 6).threads == 6);
  CHECK(choose(std::nullopt, {{"OMP_NUM_THREADS", "0"}}, 6).threads == 6);
  CHECK_THROWS_AS(choose(0, {}, 8), ConfigError);
  CHECK(usable_cores() >= 1);
}

TEST_CASE("configure_threads applies train.threads to the CPU kernels", "[threads]") {
  const int before = num_threads();
  CHECK(configure_threads(1).threads == 1);
  CHECK(num_threads() == 1);
  CHECK(configure_threads(3).threads == 3);
  CHECK(num_threads() == 3);
  configure_threads(before);
}

TEST_CASE("row-wise kernels give the same bits on 1 and 2 threads", "[threads]") {
  // Above the parallel grain (Note [The parallel grain]), so 2 threads split the work.
  Generator g(3);
  const Tensor a = randn({512, 256}, &g), b = randn({512, 256}, &g), w = randn({256}, &g);
  auto run = [&](int threads) {
    configure_threads(threads);
    std::vector<std::vector<double>> r;
    for (const Tensor& t : {add(mul(a, b), a), softmax(a, -1), layer_norm(a, {256}, w, Tensor()), gelu(b)})
      r.push_back(t.tolist());
    return r;
  };
  const int before = num_threads();
  const auto one = run(1), two = run(2);
  configure_threads(before);
  CHECK(one == two);
}

TEST_CASE("the trainer's start line names the thread count", "[threads][cli]") {
  const auto dir = std::filesystem::temp_directory_path() / "booster_test_threads";
  std::filesystem::remove_all(dir);
  const std::string config = R"({
    "model": {"type": "mlp", "in": 8, "hidden": [16], "classes": 3},
    "optimizer": {"type": "adamw", "lr": 0.01},
    "criterion": {"type": "cross_entropy"},
    "data": {"type": "synthetic", "num_samples": 64, "num_test_samples": 16, "num_features": 8,
             "num_classes": 3, "batch_size": 32},
    "train": {"epochs": 1, "log_every": 1, "seed": 1, "run_dir": null}
  })";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "c.json") << config;
  for (const int threads : {1, 2}) {
    const auto r = testing::run_booster_in(dir, "train --config c.json --set train.threads=" + std::to_string(threads));
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(r.err.find(", threads " + std::to_string(threads) + ",") != std::string::npos);
  }
  // Refused like any bad value of a key.
  const auto bad = testing::run_booster_in(dir, "train --config c.json --set train.threads=0");
  CHECK(bad.exit_code != 0);
  CHECK(bad.err.find("train.threads") != std::string::npos);
  std::filesystem::remove_all(dir);
}
