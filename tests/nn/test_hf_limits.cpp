// Hostile sizes in Hugging Face inputs end in short, clear messages: a model file with 25 tensors the
// model does not have lists the first 20 and a count (a file of 1.23 M stray tensors made a 37 MB
// line), and a --max-shard-size of 400 digits is refused as more bytes than a file can hold (it was
// std::stod's out_of_range, "error: stod"); --max-new-tokens of 2^63 - 1 generates up to the model's
// limit (prompt + count wrapped negative in the key/value cache's capacity).
#include <catch2/catch.hpp>

#include <filesystem>
#include <string>

#include "booster/checkpoint/safetensors.h"
#include "booster/common/error.h"
#include "booster/nn/hf.h"
#include "booster/ops/ops.h"
#include "run_booster.h"

using namespace booster;
namespace fs = std::filesystem;
using Catch::Contains;

TEST_CASE("load_pretrained lists the first 20 unexpected tensors and a count", "[nn][hf][hardening]") {
  const fs::path dir = testing::scratch_dir("test_hf_limits") / "stray";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path fixture = fs::path(BOOSTER_FIXTURE_DIR) / "hf" / "gpt2";
  fs::copy_file(fixture / "config.json", dir / "config.json");
  checkpoint::TensorMap weights = checkpoint::load_model(fixture);
  for (int i = 0; i < 25; ++i) weights["stray." + std::to_string(100 + i)] = zeros({1});
  checkpoint::save_model(dir, weights);
  try {
    nn::load_pretrained(dir);
    FAIL("no error");
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK_THAT(what, Contains("(25 problems)") && Contains("stray.100") && Contains("stray.119") &&
                         Contains("and 5 more"));
    CHECK_THAT(what, !Contains("stray.120"));
  }
}

TEST_CASE("a byte size of 400 digits is refused as too large", "[nn][hf][hardening]") {
  CHECK(nn::parse_byte_size("5GB") == 5'000'000'000ull);
  CHECK(nn::parse_byte_size("2KiB") == 2048);
  const std::string huge(400, '9');
  try {
    nn::parse_byte_size(huge);
    FAIL("no error");
  } catch (const ConfigError& e) {
    CHECK_THAT(e.what(), Contains("more bytes than a file can hold"));
    CHECK(std::string(e.what()).size() < 200);
  }
  CHECK_THROWS_AS(nn::parse_byte_size("0B"), ConfigError);
  CHECK_THROWS_AS(nn::parse_byte_size("20000000TB"), ConfigError);
}

TEST_CASE("booster generate with --max-new-tokens near 2^63 stops at the model's limit", "[nn][hf][hardening][cli]") {
  const fs::path fixture = fs::path(BOOSTER_FIXTURE_DIR) / "hf" / "gpt2";
  for (const char* n : {"9223372036854775807", "9223372036854775790"}) {
    const testing::RunResult r = testing::run_booster_in(
        testing::scratch_dir("test_hf_limits"),
        "generate --hf " + fixture.string() + " --prompt-ids \"1 2\" --temperature 0 --max-new-tokens " + n);
    INFO(r.err);
    CHECK(r.exit_code == 0);
    CHECK_THAT(r.err, Contains("stopped at the model's limit of 16 positions"));
  }
}
