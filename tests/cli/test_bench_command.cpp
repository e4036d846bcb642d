// `booster bench`: its JSON line (fields, the GFLOP/s arithmetic, the memory counter), the comparison
// with the hand-written loop, its usage errors, and the memory target of issue 7 (the GPT step's peak
// tensor memory under bf16 autocast is at most float32's). Nothing here asserts a time.
#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "run_booster.h"

namespace fs = std::filesystem;
using nlohmann::json;

using testing::RunResult;

namespace {

// Runs `build/bin/booster bench <args>` with one thread, as a user would.
RunResult run_bench(const std::string& args) {
  return testing::run_booster_in(fs::temp_directory_path() / ("booster_test_bench_" + std::to_string(::getpid())),
                                 "bench " + args, "OMP_NUM_THREADS=1");
}

json one_json_line(const RunResult& r) {
  INFO("stdout: " << r.out << "\nstderr: " << r.err);
  REQUIRE(r.exit_code == 0);
  REQUIRE(std::count(r.out.begin(), r.out.end(), '\n') == 1);
  return json::parse(r.out);
}

// Parameter counts written out from the layer shapes, not read from our modules.
constexpr int64_t kMlpParams = (784 * 1024 + 1024) + (1024 * 1024 + 1024) + (1024 * 10 + 10);
constexpr int64_t kGptBlockParams = 2 * 256 + (256 * 768 + 768) + (256 * 256 + 256) + 2 * 256 +
                                    (256 * 1024 + 1024) + (1024 * 256 + 256);
constexpr int64_t kGptParams = 256 * 256 + 128 * 256 + 4 * kGptBlockParams + 2 * 256 + 256 * 256;

}  // namespace

TEST_CASE("booster bench prints one JSON line whose figures agree with each other", "[cli][bench]") {
  const json r = one_json_line(run_bench("--workload mlp --steps 2 --warmup 1"));
  CHECK(r.at("workload") == "mlp");
  CHECK(r.at("precision") == "fp32");
  CHECK(r.at("loop") == "booster");
  CHECK(r.at("params").get<int64_t>() == kMlpParams);
  CHECK(r.at("items_per_step").get<int64_t>() == 256);
  const double ms = r.at("ms_per_step").get<double>();
  REQUIRE(ms > 0);
  CHECK(r.at("gflops").get<double>() == Approx(6.0 * double(kMlpParams) * 256 / (ms / 1e3) / 1e9).epsilon(1e-9));
  CHECK(r.at("cpu_ms_per_step").get<double>() > 0);
  CHECK(r.at("min_ms_per_step").get<double>() <= ms);
  // Parameters, gradients and AdamW's two moments are live through every step: 16 bytes a parameter.
  CHECK(r.at("peak_tensor_bytes").get<int64_t>() >= 16 * kMlpParams);
  CHECK(r.at("peak_rss_bytes").get<int64_t>() >= r.at("peak_tensor_bytes").get<int64_t>());
}

TEST_CASE("booster bench: the hand-written loop and the comparison with it", "[cli][bench]") {
  const json hand = one_json_line(run_bench("--workload mlp --precision bf16 --steps 1 --warmup 0 --hand-written"));
  CHECK(hand.at("loop") == "hand_written");
  CHECK(hand.at("precision") == "bf16");

  const json cmp = one_json_line(run_bench("--workload mlp --steps 2 --warmup 1 --compare-hand-written"));
  const double boosted = cmp.at("ms_per_step").get<double>(), written = cmp.at("hand_written_ms_per_step").get<double>();
  REQUIRE(written > 0);
  CHECK(cmp.at("booster_overhead").get<double>() == Approx(boosted / written - 1.0).margin(1e-12));
  CHECK(std::isfinite(cmp.at("booster_cpu_overhead").get<double>()));
  CHECK_FALSE(cmp.contains("peak_tensor_bytes"));  // two models in one process: not reported
}

TEST_CASE("booster bench: usage mistakes are one line and exit code 2", "[cli][bench]") {
  RunResult r = run_bench("--workload foo");
  CHECK(r.exit_code == 2);
  CHECK(r.err == "booster: error: booster bench: unknown workload 'foo'; expected mlp, cnn or gpt\n");
  r = run_bench("--steps 3");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("needs --workload mlp|cnn|gpt") != std::string::npos);
  r = run_bench("--workload mlp --hand-written --plugin single");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("takes no --plugin") != std::string::npos);
  r = run_bench("--workload mlp --steps 0");
  CHECK(r.exit_code == 2);
}

TEST_CASE("GPT step: peak tensor memory under bf16 autocast is at most float32's", "[cli][bench][amp]") {
  const json fp32 = one_json_line(run_bench("--workload gpt --precision fp32 --steps 1 --warmup 1"));
  const json bf16 = one_json_line(run_bench("--workload gpt --precision bf16 --steps 1 --warmup 1"));
  CHECK(fp32.at("params").get<int64_t>() == kGptParams);
  CHECK(fp32.at("items_per_step").get<int64_t>() == 8 * 128);
  INFO("fp32 peak " << fp32.at("peak_tensor_bytes") << " bytes, bf16 peak " << bf16.at("peak_tensor_bytes"));
  CHECK(bf16.at("peak_tensor_bytes").get<int64_t>() <= fp32.at("peak_tensor_bytes").get<int64_t>());
}
