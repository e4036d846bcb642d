// A rank that fails brings the whole MPI job down with a non-zero exit instead of leaving the other
// ranks blocked in a collective (Note [Failing ranks]). The test runs `mpirun -np 2` on this same
// binary, selecting a hidden helper test case; rank 1 fails while rank 0 waits in all_reduce. A
// `timeout` around mpirun turns a hang into exit status 124/137, which the test reports as a hang.
#include <catch2/catch.hpp>

#include "skip.h"

#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "booster/distributed/mpi_process_group.h"
#include "booster/distributed/process_group.h"
#include "booster/ops/ops.h"

using namespace booster;
using namespace booster::distributed;

namespace {

struct JobResult {
  int status = -1;  // exit status of `timeout mpirun ...`
  std::string output;
};

// Runs the helper test case under mpirun with 2 ranks; BOOSTER_FAILURE_MODE tells rank 1 how to fail.
JobResult run_job(const std::string& mode) {
  const std::string log = std::string(BOOSTER_BIN_DIR) + "/test_distributed_failure." + mode + ".log";
  const std::string command =
      "BOOSTER_FAILURE_MODE=" + mode +
      " OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1"
      " timeout -k 5 60 mpirun -np 2 --oversubscribe " BOOSTER_BIN_DIR
      "/test_distributed_failure '[.failure_helper]' > " + log + " 2>&1";
  const int raw = std::system(command.c_str());
  JobResult result;
  result.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  result.output = text.str();
  return result;
}

bool have_mpirun() { return std::system("command -v mpirun > /dev/null 2>&1") == 0; }

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
  if (pg.rank() == 1) {
    if (mode == "throw") {
      // An exception nobody catches: std::terminate, as when it escapes main.
      std::thread([] { throw DistributedError("rank 1 lost its training data"); }).join();
    } else if (mode == "exit") {
      std::exit(3);  // a main that caught its error and returns non-zero
    }
  }
  pg.all_reduce(t);  // with a failed rank 1, rank 0 would wait here forever
  REQUIRE(t.tolist()[0] == 4.0);
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
