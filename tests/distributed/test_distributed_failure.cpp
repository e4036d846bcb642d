// A rank that fails brings the whole MPI job down with a non-zero exit instead of leaving the other
// ranks blocked in a collective (Note [Failing ranks]), and so does a rank that stalls, once the
// collective's timeout has passed (Note [Collective timeouts]). The test runs `mpirun -np 2` on this
// same binary, selecting a hidden helper test case; rank 1 fails or stalls while rank 0 waits in
// all_reduce. A `timeout` around mpirun turns a hang into exit status 124/137, which the test reports
// as a hang.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <time.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "booster/distributed/mpi_process_group.h"
#include "booster/distributed/process_group.h"
#include "booster/nn/container.h"
#include "booster/nn/loss.h"
#include "booster/nn/models.h"
#include "booster/nn/pipeline.h"
#include "booster/ops/ops.h"
#include "run_booster.h"
#include "skip.h"

using namespace booster;
using namespace booster::distributed;

namespace {

struct JobResult {
  int status = -1;  // exit status of `timeout mpirun ...`
  double seconds = 0;  // how long it ran
  std::string output;
};

// Runs the helper test case under mpirun with `ranks` ranks; BOOSTER_FAILURE_MODE tells rank 1 how to
// fail. `env` is more VAR=value settings for every rank.
JobResult run_job(const std::string& mode, const std::string& env = "", int ranks = 2) {
  const std::string log = std::string(BOOSTER_BIN_DIR) + "/test_distributed_failure." + mode + ".log";
  const std::string command =
      "BOOSTER_FAILURE_MODE=" + mode + " " + env +
      " OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1"
      " timeout -k 5 60 mpirun -np " + std::to_string(ranks) + " --oversubscribe " BOOSTER_BIN_DIR
      "/test_distributed_failure '[.failure_helper]' > " + log + " 2>&1";
  const auto start = std::chrono::steady_clock::now();
  const int raw = std::system(command.c_str());
  JobResult result;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  result.output = text.str();
  return result;
}

using testing::have_mpirun;

double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

// These tests start an MPI job: without MPI in the build or mpirun on the PATH they are skipped.
bool skip_without_mpi() {
  if (mpi_built() && have_mpirun()) return false;
  skip_test(!mpi_built() ? "this build has no MPI" : "no mpirun (apt-get install openmpi-bin)");
  return true;
}

}  // namespace

// Not run by itself (hidden tag): the program each rank of run_job executes.
TEST_CASE("failure helper: rank 1 fails while rank 0 waits in all_reduce", "[.failure_helper]") {
  ProcessGroup& pg = init_process_group("mpi");
  const char* env = std::getenv("BOOSTER_FAILURE_MODE");
  const std::string mode = env ? env : "ok";
  Tensor t = full({1024}, 1.0);
  pg.all_reduce(t);  // both ranks are up and talking
  if (mode == "p2p_stall") {
    // Rank 1 stops; rank 0 waits for a message from it (Note [Point-to-point]).
    if (pg.rank() == 1) raise(SIGSTOP);
    Tensor message = zeros({16});
    try {
      pg.recv(message, 1)->wait();
    } catch (const DistributedError& e) {
      std::fprintf(stderr, "rank %d: %s\n", pg.rank(), e.what());
      throw;
    }
    return;
  }
  if (mode == "pipeline_exit" || mode == "pipeline_stall") {
    // A two-stage pipeline (nn::pp::PipelineStage): the last stage exits or stops in its criterion at
    // the second step's second micro-batch, while the first stage waits for a gradient from it.
    auto mlp = std::make_shared<nn::MLPClassifier>(4, std::vector<int64_t>{8}, 2, "relu", 1);
    auto part = std::make_shared<nn::Sequential>();
    for (size_t i = pg.rank() == 0 ? 0 : 2; i < (pg.rank() == 0 ? 2 : mlp->layers->size()); ++i)
      part->push_back(std::to_string(i), (*mlp->layers)[i]);
    int calls = 0;
    auto criterion = [&](const Tensor& out, const Tensor& y) {
      if (++calls == 4) {
        if (mode == "pipeline_exit") std::exit(3);
        raise(SIGSTOP);
      }
      return cross_entropy(out, y);
    };
    nn::pp::PipelineStage stage(part, pg, {nn::pp::Schedule::OneFOneB, 2});
    const Tensor x = full({4, 4}, 0.5), y = zeros({4}, DType::Int64);
    try {
      for (int step = 0; step < 3; ++step) stage.train_step(x, y, criterion);
    } catch (const DistributedError& e) {
      std::fprintf(stderr, "rank %d: %s\n", pg.rank(), e.what());
      throw;
    }
    return;
  }
  if (mode == "subgroup_stall") {
    // World ranks 1 and 2 form a subgroup (its ranks 0 and 1); world rank 2 stops before its
    // all_reduce, so world rank 1 times out in it. Rank 0 is not in it and waits in the world barrier.
    std::shared_ptr<ProcessGroup> sub = pg.new_group({1, 2}, "sub");
    if (pg.rank() == 2) raise(SIGSTOP);
    if (sub) {
      Tensor t = full({1}, 1.0);
      try {
        sub->all_reduce(t);
      } catch (const DistributedError& e) {
        std::fprintf(stderr, "rank %d: %s\n", pg.rank(), e.what());
        throw;
      }
    }
    pg.barrier();
    return;
  }
  if (mode == "stall_one_of_three") {
    // Rank 2 stops. Rank 1 comes 2.5 s late: inside its wait when rank 0 times out (3 s), and its own
    // deadline (5.5 s) comes after rank 0's census (3 to 5 s), so rank 0 hears of it only by its answer.
    if (pg.rank() == 2) raise(SIGSTOP);
    if (pg.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  }
  if (pg.rank() == 1) {
    if (mode == "throw") {
      // An exception nobody catches: std::terminate, as when it escapes main.
      std::thread([] { throw DistributedError("rank 1 lost its training data"); }).join();
    } else if (mode == "exit") {
      std::exit(3);  // a main that caught its error and returns non-zero
    } else if (mode == "stall") {
      raise(SIGSTOP);  // alive but stopped: mpirun sees nothing wrong
    } else if (mode == "late") {
      std::this_thread::sleep_for(std::chrono::seconds(2));  // a slow rank, well within the timeout
    }
  }
  const double wall_start = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  const double cpu_start = process_cpu_seconds();
  try {
    pg.all_reduce(t);  // with a failed rank 1, rank 0 would wait here forever
  } catch (const DistributedError& e) {
    std::fprintf(stderr, "rank %d: %s\n", pg.rank(), e.what());  // one line (Catch wraps what it prints)
    throw;
  }
  const double cpu = process_cpu_seconds() - cpu_start;
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count() - wall_start;
  if (mode == "late" && pg.rank() == 0)
    std::printf("rank 0 waited %.2f s in all_reduce and used %.3f s of CPU\n", wall, cpu);
  REQUIRE(t.tolist()[0] == double(pg.size() * pg.size()));
}

TEST_CASE("distributed: an uncaught exception on one rank ends the job with an error, not a hang",
          "[distributed][mpi]") {
  if (skip_without_mpi()) return;
  const JobResult job = run_job("throw");
  INFO(job.output);
  REQUIRE(job.status != 0);
  REQUIRE(job.status != 124);  // timeout: the job hung
  REQUIRE(job.status != 137);
  REQUIRE_THAT(job.output, Catch::Contains("rank 1 of 2: uncaught exception: rank 1 lost its training data"));
  REQUIRE_THAT(job.output, Catch::Contains("aborting the MPI job"));
}

TEST_CASE("distributed: a non-zero exit on one rank ends the job with an error, not a hang",
          "[distributed][mpi]") {
  if (skip_without_mpi()) return;
  const JobResult job = run_job("exit");
  INFO(job.output);
  REQUIRE(job.status != 0);
  REQUIRE(job.status != 124);
  REQUIRE(job.status != 137);
  REQUIRE_THAT(job.output, Catch::Contains("rank 1 of 2 exits with status 3"));
}

TEST_CASE("distributed: the same job without a failure exits 0", "[distributed][mpi]") {
  if (skip_without_mpi()) return;
  const JobResult job = run_job("ok");
  INFO(job.output);
  REQUIRE(job.status == 0);
  REQUIRE_THAT(job.output, !Catch::Contains("aborting"));
}

// Note [Collective timeouts]: rank 1 is stopped (SIGSTOP) before the second all_reduce; mpirun sees no
// failure, so without a timeout rank 0 waits for ever (the `timeout 60` around mpirun reports 124).
TEST_CASE("distributed: a stalled rank ends the job after the collective timeout, naming the rank",
          "[distributed][mpi]") {
  if (skip_without_mpi()) return;
  const double timeout_s = 3;
  const JobResult job = run_job("stall", "BOOSTER_COLLECTIVE_TIMEOUT_S=3");
  INFO(job.output);
  INFO("the job ran " << job.seconds << " s");
  REQUIRE(job.status != 0);
  REQUIRE(job.status != 124);  // timeout: the job hung
  REQUIRE(job.status != 137);
  // Not a speed check: that the job ended at all is the status above (`timeout 60` reports 124), and
  // a job that ended before the collective timeout could have elapsed was not ended by it, on any machine.
  CHECK(job.seconds >= timeout_s);
  REQUIRE_THAT(job.output, Catch::Contains("all_reduce on group \"world\" (2 ranks) timed out after 3."));
  REQUIRE_THAT(job.output, Catch::Contains(" s on rank 0: rank 1 did not arrive"));
  REQUIRE_THAT(job.output, Catch::Contains("rank 0 waited"));
  REQUIRE_THAT(job.output, Catch::Contains("BOOSTER_COLLECTIVE_TIMEOUT_S (now 3.0 s)"));
}

TEST_CASE("distributed: a receive whose sender stalled ends the job after the timeout, naming the peer",
          "[distributed][mpi]") {
  if (skip_without_mpi()) return;
  const JobResult job = run_job("p2p_stall", "BOOSTER_COLLECTIVE_TIMEOUT_S=2");
  INFO(job.output);
  REQUIRE(job.status != 0);
  REQUIRE(job.status != 124);  // timeout: the job hung
  REQUIRE(job.status != 137);
  CHECK(job.seconds >= 2);
  REQUIRE_THAT(job.output, Catch::Contains("send/recv on group \"world\" (2 ranks) timed out after 2."));
  REQUIRE_THAT(job.output, Catch::Contains(" s on rank 0: rank 1 (or another peer of the batch) did not post the "
                                           "matching send or receive. It was a point-to-point batch of the group"));
}

// A pipeline stage that dies or stops mid-step (the next stage's neighbour waiting for its gradient)
// ends the job: at once when it exits, after the timeout, naming it, when it stalls.
TEST_CASE("distributed: a pipeline stage that exits mid-step ends the job with an error, not a hang",
          "[distributed][mpi]") {
  if (skip_without_mpi()) return;
  const JobResult job = run_job("pipeline_exit");
  INFO(job.output);
  REQUIRE(job.status != 0);
  REQUIRE(job.status != 124);  // timeout: the job hung
  REQUIRE(job.status != 137);
  REQUIRE_THAT(job.output, Catch::Contains("rank 1 of 2 exits with status 3"));
}

TEST_CASE("distributed: a pipeline stage that stalls mid-step ends the job after the timeout, naming it",
          "[distributed][mpi]") {
  if (skip_without_mpi()) return;
  const JobResult job = run_job("pipeline_stall", "BOOSTER_COLLECTIVE_TIMEOUT_S=2");
  INFO(job.output);
  REQUIRE(job.status != 0);
  REQUIRE(job.status != 124);
  REQUIRE(job.status != 137);
  REQUIRE_THAT(job.output, Catch::Contains("rank 1 (or another peer of the batch) did not post the matching send"));
}

// Note [Collective timeouts], the census: rank 0 times out first; rank 1, which arrived late, is still
// waiting and answers; rank 2 is stopped and does not.
TEST_CASE("distributed: the timeout names the stalled rank among three, and the ranks that waited",
          "[distributed][mpi]") {
  if (skip_without_mpi()) return;
  const JobResult job = run_job("stall_one_of_three", "BOOSTER_COLLECTIVE_TIMEOUT_S=3", 3);
  INFO(job.output);
  INFO("the job ran " << job.seconds << " s");
  REQUIRE(job.status != 0);
  REQUIRE(job.status != 124);
  REQUIRE(job.status != 137);
  CHECK(job.seconds >= 3);  // ended by the timeout, not before it (as above)
  REQUIRE_THAT(job.output, Catch::Contains("all_reduce on group \"world\" (3 ranks) timed out after 3."));
  REQUIRE_THAT(job.output, Catch::Contains(" s on rank 0: rank 2 did not arrive"));
  REQUIRE_THAT(job.output, Catch::Contains("ranks 0, 1 waited"));
}

// A subgroup's timeout names processes by world rank (the numbers the launcher, the other ranks'
// messages and a kill by rank use), with the subgroup's own numbers beside them.
TEST_CASE("distributed: a subgroup's timeout names world ranks, and the group's beside them", "[distributed][mpi]") {
  if (skip_without_mpi()) return;
  const JobResult job = run_job("subgroup_stall", "BOOSTER_COLLECTIVE_TIMEOUT_S=3", 3);
  INFO(job.output);
  REQUIRE(job.status != 0);
  REQUIRE(job.status != 124);
  REQUIRE(job.status != 137);
  REQUIRE_THAT(job.output, Catch::Contains("all_reduce on group \"sub\" (2 ranks) timed out after 3."));
  REQUIRE_THAT(job.output, Catch::Contains(" s on world rank 1 (rank 0 of the group): world rank 2 (rank 1 of the "
                                           "group) did not arrive"));
  REQUIRE_THAT(job.output, Catch::Contains("world rank 1 (rank 0 of the group) waited"));
}

// Note [Collective timeouts], "Waiting": a rank waiting for a late one sleeps between polls instead of
// spinning a core (MPI_Waitall spins at 100%). A resource check, not a speed check: rank 1 sleeps 2 s
// before it joins, so rank 0 waits at least that long on any machine (the lower bound below), and a
// spinning wait would use about all of it in CPU time; a sleeping one uses a small fraction whatever
// the processor's speed (polls are time-based).
TEST_CASE("distributed: a rank waiting for a late one does not burn a core", "[distributed][mpi]") {
  if (skip_without_mpi()) return;
  const JobResult job = run_job("late");
  INFO(job.output);
  REQUIRE(job.status == 0);
  double wall = 0, cpu = 0;
  const size_t at = job.output.find("rank 0 waited ");
  REQUIRE(at != std::string::npos);
  REQUIRE(std::sscanf(job.output.c_str() + at, "rank 0 waited %lf s in all_reduce and used %lf s of CPU", &wall,
                      &cpu) == 2);
  CHECK(wall > 1.5);
  CHECK(cpu < 0.3 * wall);
}

TEST_CASE("distributed: collective timeouts come from the group, the process default or the environment",
          "[distributed]") {
  ProcessGroup& pg = init_process_group("local");
  const auto before = default_collective_timeout();
  // Without BOOSTER_COLLECTIVE_TIMEOUT_S in the test's environment this is torch's 30 minutes.
  if (std::getenv("BOOSTER_COLLECTIVE_TIMEOUT_S") == nullptr) CHECK(before.count() == 1800.0);
  CHECK(pg.timeout() == before);
  set_default_collective_timeout(std::chrono::milliseconds(2500));
  CHECK(default_collective_timeout().count() == 2.5);
  CHECK(pg.timeout().count() == 2.5);
  pg.set_timeout(std::chrono::seconds(7));
  CHECK(pg.timeout().count() == 7.0);
  CHECK(default_collective_timeout().count() == 2.5);
  CHECK_THROWS_AS(pg.set_timeout(std::chrono::seconds(0)), ValueError);
  CHECK_THROWS_WITH(set_default_collective_timeout(std::chrono::duration<double>(-1)),
                    Catch::Contains("expected a positive number of seconds"));
  set_default_collective_timeout(before);
}

// `booster train` applies train.collective_timeout_s before the first collective: with it set, a bad
// BOOSTER_COLLECTIVE_TIMEOUT_S is never read; without it, the first collective refuses the variable.
TEST_CASE("distributed: booster train applies train.collective_timeout_s to the process group",
          "[distributed][mpi][cli]") {
  if (skip_without_mpi()) return;
  const std::string base = std::string(BOOSTER_SOURCE_DIR) + "/tests/bad_configs/base.json";
  auto train = [&](const std::string& set) {
    const std::string log = std::string(BOOSTER_BIN_DIR) + "/test_distributed_failure.train.log";
    const std::string command =
        "BOOSTER_COLLECTIVE_TIMEOUT_S=soon OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
        "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout -k 5 120 mpirun -np 2 --oversubscribe " BOOSTER_BIN_DIR
        "/booster train --config " + base + " --plugin ddp " + set + " > " + log + " 2>&1";
    const int raw = std::system(command.c_str());
    std::ifstream in(log);
    std::stringstream text;
    text << in.rdbuf();
    return std::pair{WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw), text.str()};
  };
  const auto [bad_status, bad_output] = train("");
  INFO(bad_output);
  CHECK(bad_status != 0);
  CHECK_THAT(bad_output, Catch::Contains("BOOSTER_COLLECTIVE_TIMEOUT_S is \"soon\""));
  const auto [status, output] = train("--set train.collective_timeout_s=90");
  INFO(output);
  CHECK(status == 0);
}
