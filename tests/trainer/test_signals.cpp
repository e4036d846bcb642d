// Note [Stopping on a signal]: copies of one stop request (a job's SIGTERM to every process, forwarded
// once more by the launcher) are one request, and a request after them is the user asking again.
#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <thread>

#include "booster/trainer/signals.h"

using booster::trainer::StopOnSignal;

TEST_CASE("signals: copies of one stop request within a moment are one request", "[trainer][signal]") {
  StopOnSignal stop(/*announce=*/false);
  CHECK(stop.requested() == 0);
  std::raise(SIGTERM);  // the scheduler's
  std::raise(SIGTERM);  // the launcher's forwarded copy
  std::raise(SIGUSR1);  // `booster run`'s stop request
  // Still running (a second request would have exited at once), with the first request recorded.
  CHECK(stop.requested() == SIGTERM);
}

TEST_CASE("signals: a second request after the moment exits at once without saving", "[trainer][signal]") {
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    StopOnSignal stop(/*announce=*/false);
    std::raise(SIGTERM);
    std::this_thread::sleep_for(std::chrono::milliseconds(1300));
    std::raise(SIGINT);  // the user again: exits 128 + SIGINT here
    ::_exit(0);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 128 + SIGINT);
}
