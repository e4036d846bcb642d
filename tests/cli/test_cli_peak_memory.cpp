// `booster train` reports the peak of live tensor bytes (Note [Peak memory of a run] in trainer.cpp):
// in every "train" record of metrics.jsonl and in the summary it prints last, and under `booster run
// -n 2` each rank's figure; `booster check` prints it beside its estimate. Run as a user runs it:
// through the shell, output captured to files. The figure itself is checked against the process's peak RSS in tests/tensor/test_memory_stats.cpp; here
// the lower bound is what must be live at once at an AdamW step: parameters, gradients, two moments.
#include <catch2/catch.hpp>

#include "skip.h"

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "run_booster.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_peak_memory"); }

const std::string kOneThread = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1";

// An 8 -> 64 -> 64 -> 3 MLP trained with AdamW for 4 steps, logging every 2.
constexpr int64_t kParams = 8 * 64 + 64 + 64 * 64 + 64 + 64 * 3 + 3;

fs::path write_config(const std::string& name, const fs::path& run_dir) {
  json c = json::parse(R"({
    "model": {"type": "mlp", "in": 8, "hidden": [64, 64], "classes": 3},
    "optimizer": {"type": "adamw", "lr": 0.01},
    "data": {"type": "synthetic", "num_samples": 256, "num_test_samples": 64, "num_features": 8,
             "num_classes": 3, "batch_size": 32},
    "train": {"epochs": 1, "max_steps": 4, "log_every": 2, "seed": 3, "collective_timeout_s": 60}
  })");
  c["train"]["run_dir"] = run_dir.string();
  const fs::path p = scratch_dir() / name;
  std::ofstream(p) << c.dump(2);
  return p;
}

std::vector<json> train_records(const fs::path& run_dir) {
  std::vector<json> out;
  std::ifstream in(run_dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const json r = json::parse(line);
    if (r.at("kind") == "train") out.push_back(r);
  }
  return out;
}

}  // namespace

TEST_CASE("booster train writes peak_tensor_bytes into metrics.jsonl and the summary", "[cli][peak_memory]") {
  const fs::path run_dir = scratch_dir() / "single_run";
  fs::remove_all(run_dir);
  const testing::RunResult r =
      testing::run_booster_in(scratch_dir(), "train --config " + write_config("single.json", run_dir).string(), kOneThread);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const std::vector<json> records = train_records(run_dir);
  REQUIRE(records.size() == 2);  // steps 2 and 4
  int64_t previous = 0;
  for (const json& record : records) {
    INFO(record.dump());
    REQUIRE(record.contains("peak_tensor_bytes"));
    const int64_t peak = record.at("peak_tensor_bytes").get<int64_t>();
    CHECK(peak >= 4 * 4 * kParams);
    CHECK(peak >= previous);  // the peak since the run's start only grows
    CHECK_FALSE(record.contains("peak_tensor_bytes_per_rank"));  // one process
    CHECK_FALSE(record.contains("peak_reserved_bytes"));  // CPU: no reserve
    previous = peak;
  }
  const json summary = json::parse(testing::last_line(r.out));
  INFO(summary.dump());
  REQUIRE(summary.contains("peak_tensor_bytes"));
  CHECK(summary.at("peak_tensor_bytes").get<int64_t>() >= previous);  // the end also counts the evaluation

  // booster check prints it beside its estimate, from the run directory the config names.
  const testing::RunResult check =
      testing::run_booster_in(scratch_dir(), "check --config " + (scratch_dir() / "single.json").string(), kOneThread);
  INFO(check.err);
  CHECK(check.exit_code == 0);
  CHECK_THAT(check.err, Catch::Contains("  measured: ") && Catch::Contains(" peak of live tensors by step 4 of the run in " +
                                                                           (run_dir / "metrics.jsonl").string()));

  // A record nested 200,000 deep (after the good ones) and a step that is not a number: set aside, no crash.
  {
    std::ofstream out(run_dir / "metrics.jsonl", std::ios::app);
    out << R"({"kind": "train", "step": "x", "peak_tensor_bytes": 1000})" << "\n" << std::string(200000, '[') << std::string(200000, ']') << "\n";
  }
  const testing::RunResult hostile =
      testing::run_booster_in(scratch_dir(), "check --config " + (scratch_dir() / "single.json").string(), kOneThread);
  INFO(hostile.err);
  CHECK(hostile.exit_code == 0);
  CHECK_THAT(hostile.err, Catch::Contains("  measured: 1000 bytes peak of live tensors of the run in "));
}

TEST_CASE("booster run -n 2 reports each rank's peak_tensor_bytes", "[cli][peak_memory][mpi]") {
  if (const std::string why = testing::why_no_mpi(); !why.empty()) return skip_test(why);
  const fs::path run_dir = scratch_dir() / "ddp_run";
  fs::remove_all(run_dir);
  const testing::RunResult r = testing::run_booster_in(
      scratch_dir(), "run -n 2 -- booster train --plugin ddp --config " + write_config("ddp.json", run_dir).string(),
      kOneThread);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  auto check_ranks = [](const json& j) {
    INFO(j.dump());
    REQUIRE(j.contains("peak_tensor_bytes_per_rank"));
    const std::vector<int64_t> per_rank = j.at("peak_tensor_bytes_per_rank").get<std::vector<int64_t>>();
    REQUIRE(per_rank.size() == 2);
    for (const int64_t peak : per_rank) CHECK(peak >= 4 * 4 * kParams);  // every rank holds a whole replica
    CHECK(j.at("peak_tensor_bytes").get<int64_t>() == std::max(per_rank[0], per_rank[1]));
  };
  const std::vector<json> records = train_records(run_dir);
  REQUIRE(records.size() == 2);
  for (const json& record : records) check_ranks(record);
  check_ranks(json::parse(testing::last_line(r.out)));
}
