// booster run's job secret (Note [Job secret under booster run] in cli/run.cpp): every launch hands its
// ranks one fresh random BOOSTER_JOB_SECRET, which appears on no command line, and a secret the user set
// is passed on unchanged.
#include <catch2/catch.hpp>

#include <regex>
#include <string>

#include "run_booster.h"
#include "skip.h"

using namespace testing;

namespace {

// The S= and P= lines every rank of one `booster run -n 2` printed: its secret and mpirun's command line.
RunResult launch(const std::filesystem::path& dir, const std::string& env = "") {
  return run_booster_in(dir,
                        "run -n 2 -- sh -c 'echo \"S=$BOOSTER_JOB_SECRET\"; "
                        "echo \"P=$(tr \"\\0\" \" \" < /proc/$PPID/cmdline)\"'",
                        env);
}

std::vector<std::string> values(const std::string& text, const std::string& key) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(key, 0) == 0) out.push_back(line.substr(key.size()));
  return out;
}

}  // namespace

TEST_CASE("booster run hands every rank the same fresh secret, on no command line", "[cli][run][secret]") {
  if (!have_mpirun()) return skip_test(kNoMpirun);
  const auto dir = scratch_dir("run_secret");
  const RunResult a = launch(dir / "a"), b = launch(dir / "b");
  REQUIRE(a.exit_code == 0);
  REQUIRE(b.exit_code == 0);
  const auto sa = values(a.out, "S="), sb = values(b.out, "S=");
  REQUIRE(sa.size() == 2);
  REQUIRE(sb.size() == 2);
  CHECK(sa[0] == sa[1]);  // both ranks of a job
  CHECK(std::regex_match(sa[0], std::regex("[0-9a-f]{64}")));
  CHECK(sa[0] != sb[0]);  // a fresh one per launch
  for (const std::string& line : values(a.out, "P=")) {
    CHECK_THAT(line, Catch::Contains("-x BOOSTER_JOB_SECRET"));
    CHECK(line.find(sa[0]) == std::string::npos);  // the value is in no argv
  }
  // --dry-run prints no secret.
  const RunResult dry = run_booster_in(dir / "dry", "run --dry-run -n 2 -- true", "BOOSTER_MPIRUN=/bin/true");
  CHECK(dry.out.find("BOOSTER_JOB_SECRET") == std::string::npos);
}

TEST_CASE("booster run passes on a secret the user set", "[cli][run][secret]") {
  if (!have_mpirun()) return skip_test(kNoMpirun);
  const auto dir = scratch_dir("run_user_secret");
  const RunResult r = launch(dir, "BOOSTER_JOB_SECRET=mine");
  REQUIRE(r.exit_code == 0);
  CHECK(values(r.out, "S=") == std::vector<std::string>{"mine", "mine"});
}
