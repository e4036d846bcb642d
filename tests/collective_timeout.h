// A collective timeout of one minute for the tests that run several ranks (mpi/ programs, the TCP group's
// threads): a bug that leaves a rank waiting in a collective then fails that rank within a minute with a
// DistributedError naming the collective and the ranks that did not come, instead of hanging until
// CTest's limit with no message (issue 48, item 11). Set before main, as the process default
// (set_default_collective_timeout), so every group without a timeout of its own takes it; a test that
// sets its own (ProcessGroup::set_timeout, train.collective_timeout_s) keeps it, and an exported
// BOOSTER_COLLECTIVE_TIMEOUT_S (a longer one to debug under) wins over this one.
#pragma once

#include <chrono>
#include <cstdlib>

#include "booster/distributed/process_group.h"

namespace testing {

inline constexpr std::chrono::seconds kTestCollectiveTimeout{60};

inline bool use_test_collective_timeout() {
  const char* env = std::getenv("BOOSTER_COLLECTIVE_TIMEOUT_S");
  if (env == nullptr || *env == '\0') booster::distributed::set_default_collective_timeout(kTestCollectiveTimeout);
  return true;
}

// One definition across the program (an inline variable), initialized before main.
inline const bool kTestCollectiveTimeoutSet = use_test_collective_timeout();

}  // namespace testing
