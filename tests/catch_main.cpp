// The one Catch2 main shared by every test executable, with the listener that reports skips.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include <iostream>
#include <set>

#include "skip.h"

namespace {

// Prints the marker CTest's SKIP_REGULAR_EXPRESSION looks for, once per reason, after a run in which
// some test called skip_test and nothing failed (skip.h).
struct SkipListener : Catch::TestEventListenerBase {
  using TestEventListenerBase::TestEventListenerBase;

  void testRunEnded(const Catch::TestRunStats& stats) override {
    const bool failed = stats.totals.assertions.failed > 0 || stats.totals.testCases.failed > 0;
    std::set<std::string> seen;
    for (const std::string& reason : skipped_test_reasons()) {
      if (!seen.insert(reason).second) continue;
      // A failed run is reported as failed; the reason still shows beside the failure.
      std::cout << (failed ? "skipped part of a failed run: " : "BOOSTER_TEST_SKIPPED: ") << reason << std::endl;
    }
  }
};

}  // namespace

CATCH_REGISTER_LISTENER(SkipListener)
