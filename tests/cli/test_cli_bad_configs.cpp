// The corpus of bad configs and flags (tests/bad_configs/cases.json): the real `booster` binary answers
// each with a non-zero exit and one line naming the mistake (Note [Config errors]).
#include <catch2/catch.hpp>

#include "skip.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "booster/plugin/abi.h"
#include "booster/plugin/loader.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const fs::path kCorpus = fs::path(BOOSTER_SOURCE_DIR) / "tests" / "bad_configs";

}  // namespace

TEST_CASE("every bad config and flag exits non-zero with its one-line message", "[cli][config]") {
  const json cases = json::parse(read_text(kCorpus / "cases.json"));
  REQUIRE(cases.size() >= 40);
  std::set<std::string> plugins;
  for (const auto& found : booster::plugin::list(booster::plugin::kParallelKind)) plugins.insert(found.name);
  const fs::path scratch = fs::temp_directory_path() / ("booster_test_bad_configs_" + std::to_string(::getpid()));
  fs::create_directories(scratch);
  std::set<std::string> used_files;
  int ran = 0;
  for (const json& c : cases) {
    std::string command = std::string(BOOSTER_BIN_DIR) + "/booster " + c.at("command").get<std::string>();
    if (!c.at("config").is_null()) {
      const fs::path config = kCorpus / c.at("config").get<std::string>();
      REQUIRE(fs::exists(config));
      used_files.insert(c.at("config").get<std::string>());
      command += " --config " + config.string();
    }
    command += " " + c.at("args").get<std::string>();
    INFO(command);
    if (c.contains("requires_plugin") && !plugins.count(c.at("requires_plugin").get<std::string>())) {
      skip_test("plugin " + c.at("requires_plugin").get<std::string>() + " is not built: " + command);
      continue;
    }
    const fs::path out = scratch / "stdout.txt", err = scratch / "stderr.txt";
    const int status = std::system(("cd " + scratch.string() + " && " + command + " >" + out.string() + " 2>" + err.string()).c_str());
    const std::string error = read_text(err);
    INFO("stderr: " << error);
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == c.at("exit").get<int>());
    CHECK(error.rfind("booster: error: ", 0) == 0);
    CHECK(std::count(error.begin(), error.end(), '\n') == 1);
    CHECK(error.find(c.at("expect").get<std::string>()) != std::string::npos);
    CHECK(read_text(out).empty());
    ++ran;
  }
  CHECK(ran >= 40);
  // Every mistake file in the folder is used by a case (base.json is the valid starting point).
  for (const auto& entry : fs::directory_iterator(kCorpus)) {
    const std::string name = entry.path().filename().string();
    if (entry.path().extension() == ".json" && name != "cases.json") {
      INFO(name);
      CHECK(used_files.count(name) + (name == "base.json") >= 1);
    }
  }
}

TEST_CASE("the corpus' base config is valid", "[cli][config]") {
  const std::string cmd = std::string(BOOSTER_BIN_DIR) + "/booster check --config " + (kCorpus / "base.json").string() +
                          " >/dev/null 2>&1";
  CHECK(std::system(cmd.c_str()) == 0);
}
