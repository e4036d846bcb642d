// How a test says it could not run. Catch2 2.13 has no SKIP, so skip_test(reason) records the
// reason and the test returns (or `continue`s past the part it cannot run). When the run ends with no
// failed assertion, the listener in catch_main.cpp prints "BOOSTER_TEST_SKIPPED: <reason>", which the
// SKIP_REGULAR_EXPRESSION set in tests/CMakeLists.txt turns into CTest's "Skipped"; report_skips.sh
// (CTEST_CUSTOM_POST_TEST) lists every skipped test with its reason under the summary.
//
// A test that skipped part of its work still fails if anything it did run failed: the marker is only
// printed for a clean run (CTest would otherwise let the skip hide the failure).
#pragma once

#include <string>
#include <vector>

// Global names: the test helpers live in two namespaces called `testing` (::testing and
// booster::testing), and a test file may see both.
inline std::vector<std::string>& skipped_test_reasons() {
  static std::vector<std::string> reasons;
  return reasons;
}

// Records why (part of) the current test did not run; the caller returns or continues.
inline void skip_test(const std::string& reason) { skipped_test_reasons().push_back(reason); }
