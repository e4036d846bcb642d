// `booster doctor` and the diagnostics of `booster train`, run as a user runs them: the report's last
// stdout line is JSON whose per-module counts are those of the run's shapes; a loss scale too large for
// float16 makes every step skip, and both commands name the first non-finite tensor (the gradient of
// the model's output, where the scaled loss gradient is cast to float16) on stderr, in the report and
// in metrics.jsonl; train.diagnostics.every writes per-module records; bad settings exit 2.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "run_booster.h"

namespace fs = std::filesystem;
using nlohmann::json;
using testing::RunResult;
using Catch::Contains;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_doctor"); }

RunResult run_booster(const std::string& args, const std::string& env = "") {
  return testing::run_booster_in(scratch_dir(), args, env);
}

fs::path write_config(const std::string& name, const json& config) {
  fs::path p = scratch_dir() / name;
  std::ofstream(p) << config.dump(2);
  return p;
}

// 8 features, one hidden layer of 16, 3 classes; batches of 32.
json synthetic_config() {
  return json::parse(R"({
    "model": {"type": "mlp", "in": 8, "hidden": [16], "classes": 3},
    "optimizer": {"type": "adamw", "lr": 0.01},
    "criterion": {"type": "cross_entropy"},
    "data": {"type": "synthetic", "num_samples": 256, "num_test_samples": 64, "num_features": 8,
             "num_classes": 3, "batch_size": 32},
    "train": {"epochs": 1, "log_every": 1, "seed": 1}
  })");
}

json last_line(const std::string& out) { return json::parse(testing::last_line(out)); }

const json& module_in(const json& report, const std::string& path) {
  for (const json& m : report.at("modules"))
    if (m.at("module") == path) return m;
  FAIL("no module " << path << " in the report");
  static const json none;
  return none;
}

std::vector<json> records(const fs::path& metrics, const std::string& kind) {
  std::vector<json> out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty() && json::parse(line).at("kind") == kind) out.push_back(json::parse(line));
  return out;
}

}  // namespace

TEST_CASE("booster doctor: per-module statistics of every step, counted by the run's shapes", "[cli][diagnostics]") {
  const fs::path config = write_config("doctor_fp16.json", synthetic_config());
  const RunResult r = run_booster("doctor --config " + config.string() + " --steps 3 -m fp16");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("recommendation: ") != std::string::npos);
  CHECK(r.out.find("layers.0 (Linear)") != std::string::npos);
  const json report = last_line(r.out);
  CHECK(report.at("precision") == "fp16");
  CHECK(report.at("format") == "float16");
  CHECK(report.at("steps") == 3);
  CHECK(report.at("skipped_steps").empty());
  CHECK(report.at("recommendation").get<std::string>().rfind("fp16 is fine here", 0) == 0);
  // 3 steps of 32 rows: layer 0 outputs 32 x 16 values per step, the classifier 32 x 3; layer 0's
  // parameter gradients 8 x 16 + 16 per step; its input (the data) needs no gradient.
  const json& first = module_in(report, "layers.0");
  CHECK(first.at("type") == "Linear");
  CHECK(first.at("output").at("count") == 3 * 32 * 16);
  CHECK(first.at("output_grad").at("count") == 3 * 32 * 16);
  CHECK(first.at("param_grad").at("count") == 3 * (8 * 16 + 16));
  CHECK_FALSE(first.contains("input_grad"));
  const json& last = module_in(report, "layers.2");
  CHECK(last.at("output").at("count") == 3 * 32 * 3);
  CHECK(last.at("input_grad").at("count") == 3 * 32 * 16);
  // The histogram holds every finite nonzero value.
  for (const json& m : report.at("modules"))
    for (const char* role : {"output", "output_grad", "input_grad", "param_grad"}) {
      if (!m.contains(role)) continue;
      const json& s = m.at(role);
      int64_t binned = 0;
      for (const json& c : s.at("exponents").at("counts")) binned += c.get<int64_t>();
      CHECK(binned + s.at("zeros").get<int64_t>() + s.at("nonfinite").get<int64_t>() == s.at("count").get<int64_t>());
    }
  // No files: the doctor writes nothing.
  CHECK_FALSE(fs::exists(scratch_dir() / "runs"));

  // More steps than the config's one epoch of 8 batches: the doctor runs them all.
  const RunResult longer = run_booster("doctor --config " + config.string() + " --steps 12 -m fp16");
  INFO(longer.err);
  REQUIRE(longer.exit_code == 0);
  CHECK(last_line(longer.out).at("steps") == 12);
  CHECK(module_in(last_line(longer.out), "layers.0").at("output").at("count") == 12 * 32 * 16);
}

TEST_CASE("booster doctor and train name the first non-finite tensor of every skipped step", "[cli][diagnostics]") {
  // A scale of 1e30 makes the scaled loss gradient overflow float16 where autocast's float16 logits get
  // it: the gradient of the model's output. The scaler halves it each step, never far enough here.
  json c = synthetic_config();
  c["mixed_precision"] = {{"name", "fp16"}, {"init_scale", 1e30}};
  const fs::path config = write_config("doctor_overflow.json", c);
  const RunResult doctor = run_booster("doctor --config " + config.string() + " --steps 3");
  INFO(doctor.err);
  REQUIRE(doctor.exit_code == 0);
  const json report = last_line(doctor.out);
  REQUIRE(report.at("skipped_steps").size() == 3);
  const json expected_first = {{"module", ""}, {"type", "MLPClassifier"}, {"pass", "backward"}, {"tensor", "output_grad"}};
  for (const json& s : report.at("skipped_steps")) CHECK(s.at("first_nonfinite") == expected_first);
  CHECK(report.at("recommendation").get<std::string>().rfind("use bf16, which needs no loss scale: 3 of 3 steps", 0) == 0);
  CHECK(doctor.err.find("step      1 skipped (inf/NaN gradients; loss scale now 5e+29): first non-finite: the output "
                        "gradient of the model (MLPClassifier) in backward") != std::string::npos);

  // train: the same line on stderr, and a record per skipped step in metrics.jsonl; every 2 steps a
  // diagnostics record.
  const fs::path run_dir = scratch_dir() / "train_overflow";
  const RunResult train = run_booster("train --config " + config.string() + " --set train.max_steps=4 --set train.run_dir=" +
                                      run_dir.string() + " --set 'train.diagnostics={\"every\": 2}'");
  INFO(train.err);
  REQUIRE(train.exit_code == 0);
  CHECK(train.err.find("step      4 skipped (inf/NaN gradients; loss scale now 6.25e+28): first non-finite: the "
                       "output gradient of the model (MLPClassifier) in backward") != std::string::npos);
  const std::vector<json> skipped = records(run_dir / "metrics.jsonl", "skipped");
  REQUIRE(skipped.size() == 4);
  for (size_t i = 0; i < skipped.size(); ++i) {
    CHECK(skipped[i].at("step") == int64_t(i + 1));
    CHECK(skipped[i].at("first_nonfinite") == expected_first);
  }
  const std::vector<json> diagnostics = records(run_dir / "metrics.jsonl", "diagnostics");
  REQUIRE(diagnostics.size() == 2);
  CHECK(diagnostics[0].at("step") == 2);
  CHECK(diagnostics[1].at("step") == 4);
  // Each record holds one step's statistics: layer 0's 32 x 16 outputs.
  for (const json& d : diagnostics) CHECK(module_in(d, "layers.0").at("output").at("count") == 32 * 16);

  // Off: skipped steps are counted but not named.
  const fs::path quiet_dir = scratch_dir() / "train_quiet";
  const RunResult quiet = run_booster("train --config " + config.string() + " --set train.max_steps=2 --set train.run_dir=" +
                                      quiet_dir.string() + " --set train.diagnostics.name_nonfinite=false");
  INFO(quiet.err);
  REQUIRE(quiet.exit_code == 0);
  CHECK(quiet.err.find("first non-finite") == std::string::npos);
  CHECK(records(quiet_dir / "metrics.jsonl", "skipped").empty());
  CHECK(last_line(quiet.out).at("skipped_steps") == 2);
}

TEST_CASE("booster doctor and train.diagnostics: bad settings exit 2 with one line", "[cli][diagnostics]") {
  const fs::path config = write_config("doctor_bad.json", synthetic_config());
  RunResult r = run_booster("doctor --config " + config.string() + " --steps 0");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--steps 0: expected at least 1 step") != std::string::npos);
  r = run_booster("train --config " + config.string() + " --set train.diagnostics.every=-1");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("'train.diagnostics.every' is -1; expected a whole number of steps >= 0") != std::string::npos);
  r = run_booster("train --config " + config.string() + " --set train.diagnostics.evry=5");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("'train.diagnostics.evry' is not a diagnostics setting") != std::string::npos);
  r = run_booster("train --config " + config.string() + " --set train.diagnostics=5");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("'train.diagnostics' is 5; expected {") != std::string::npos);
}

// Under ZeRO stage 3 a module's parameters exist only while it runs: the doctor reports every module
// all the same (one process: the plugin at world size 1 shards nothing away but releases as on many).
TEST_CASE("booster doctor runs under low_level_zero stage 3, whose parameters are released between uses",
          "[cli][diagnostics]") {
  const fs::path cfg = write_config("doctor_zero3.json", synthetic_config());
  const RunResult r = run_booster("doctor --config " + cfg.string() +
                                  " -p low_level_zero --set plugin.stage=3 --set plugin.precision=bf16 --steps 2");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const json report = last_line(r.out);
  CHECK(module_in(report, "layers.0").at("output").at("count") == 2 * 32 * 16);
  CHECK(report.at("recommendation").get<std::string>().find("low_level_zero") != std::string::npos);
  // The precision that ran, named as the start line and train's summary name it.
  CHECK(report.at("precision") == "bf16 (low_level_zero's own)");
  CHECK(r.out.rfind("precision doctor: bf16 (low_level_zero's own) (", 0) == 0);
  CHECK(r.err.find("precision bf16 (low_level_zero's own)") != std::string::npos);
}

// Issue: on a CPU a 16-bit format may save memory and not time. check and the doctor say so where the
// GEMMs widen to float32 (float16 always; bfloat16 when oneDNN's path is off: switched off here, so the
// case runs on any CPU), and say nothing for float32 or where bfloat16 runs natively.
TEST_CASE("booster check and doctor say where a 16-bit format saves memory but not time on the CPU",
          "[cli][diagnostics][onednn]") {
  const fs::path cfg = write_config("doctor_cpu_note.json", synthetic_config());
  const std::string not_time = "saves memory here but not time";
  {
    const RunResult r = run_booster("check --config " + cfg.string() + " --mixed-precision bf16", "BOOSTER_ONEDNN=0");
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK_THAT(r.err, Contains("booster: note: bfloat16 " + not_time) && Contains("BOOSTER_ONEDNN=0"));
  }
  {
    const RunResult r = run_booster("doctor --config " + cfg.string() + " --mixed-precision bf16 --steps 1",
                                    "BOOSTER_ONEDNN=0");
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK_THAT(r.out, Contains("note: bfloat16 " + not_time));
  }
  {
    const RunResult r = run_booster("check --config " + cfg.string() + " --mixed-precision fp16");
    REQUIRE(r.exit_code == 0);
    CHECK_THAT(r.err, Contains("booster: note: float16 saves memory on the CPU but not time"));
  }
  {
    const RunResult r = run_booster("check --config " + cfg.string());
    REQUIRE(r.exit_code == 0);
    CHECK_THAT(r.err, !Contains("booster: note:"));
  }
  const RunResult version = run_booster("--version");
  if (version.out.find("bfloat16 GEMMs: oneDNN") != std::string::npos) {
    const RunResult r = run_booster("check --config " + cfg.string() + " --mixed-precision bf16");
    REQUIRE(r.exit_code == 0);
    CHECK_THAT(r.err, !Contains(not_time));
  }
}
