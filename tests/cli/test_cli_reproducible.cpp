// `train.reproducible` through the `booster` command (Note [Reproducible training across world sizes] in
// booster/booster/reproducible.h): `booster train` on 1 process and `booster run -n 2` and `-n 4` (the
// global batch kept: data.batch_size 32, 16, 8) write the same checkpoint bytes and log the same losses;
// a run stopped on 4 or 2 processes and resumed on 2 or 1 ends on the bytes of the uninterrupted run, and
// so does a job whose rank was killed and that `booster run --max-restarts` brought back on 1 process;
// `booster check` names the world sizes; a world size the chunks do not allow is refused with them.
// The plain runs are the control: without `reproducible` the 2-process run ends on other bytes.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "run_booster.h"
#include "skip.h"

namespace fs = std::filesystem;
using nlohmann::json;
using testing::RunResult;

namespace {

fs::path scratch() { return testing::scratch_dir("test_cli_reproducible"); }

// 12 steps of AdamW on a global batch of 32 rows in 8 chunks (2 micro-batches a step), an epoch boundary
// (a new shuffle) at step 8. No lr schedule: a run stopped by max_steps 6 may then resume to 12.
fs::path write_config(bool reproducible) {
  json c = json::parse(R"({
    "model": {"type": "mlp", "in": 8, "hidden": [16], "classes": 3},
    "optimizer": {"type": "adamw", "lr": 0.01, "weight_decay": 0.01},
    "data": {"type": "synthetic", "num_samples": 256, "num_test_samples": 32, "num_features": 8,
             "num_classes": 3, "batch_size": 16, "drop_last": true},
    "train": {"epochs": 2, "max_steps": 12, "log_every": 1, "seed": 3, "keep_last": 0, "checkpoint_every": 6,
              "grad_accumulation": 2, "reproducible_chunks": 8},
    "plugin": "ddp"
  })");
  c["train"]["reproducible"] = reproducible;
  const fs::path p = scratch() / (reproducible ? "reproducible.json" : "plain.json");
  std::ofstream(p) << c.dump(2);
  return p;
}

// `booster train` on `processes` processes (through `booster run` above one) into run directory `name`.
// `run_options` go to `booster run` (--max-restarts), `env` before it (the trainer's kill hook).
RunResult train(const fs::path& config, int processes, const std::string& name, const std::string& extra = "",
                const std::string& run_options = "", const std::string& env = "") {
  const std::string batch = std::to_string(16 / processes);
  const std::string args = "train --config " + config.string() + " --set data.batch_size=" + batch +
                           " --set train.run_dir=" + (scratch() / name).string() + " " + extra +
                           (processes == 1 ? " --set plugin=single" : "");
  fs::remove_all(scratch() / name);
  return testing::run_booster_in(scratch() / ("out_" + name),
                                 processes == 1 ? args
                                                : "run -n " + std::to_string(processes) + " " + run_options +
                                                      " -- booster " + args,
                                 "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 " + env);
}

// The tensors of step 12 (model, optimizer and the strategy's state) and the train records' losses.
std::string bytes_of(const std::string& name) {
  const fs::path step = scratch() / name / "checkpoints" / "step-00000012";
  std::string out;
  for (const char* file : {"model/model.safetensors", "optimizer/optimizer.safetensors"}) {
    REQUIRE(fs::exists(step / file));
    out += testing::read_text(step / file);
  }
  return out;
}
std::string losses_of(const std::string& name) {
  std::ifstream in(scratch() / name / "metrics.jsonl");
  std::string line, out;
  while (std::getline(in, line)) {
    const json r = json::parse(line);
    if (r.value("kind", "") == "train") out += r.at("loss").dump() + " ";
  }
  return out;
}

}  // namespace

TEST_CASE("reproducible booster train writes the same bytes on 1, 2 and 4 processes", "[cli][reproducible][mpi]") {
  if (const std::string why = testing::why_no_mpi("ddp"); !why.empty()) {
    skip_test(why);
    return;
  }
  const fs::path config = write_config(true);
  const RunResult one = train(config, 1, "one");
  INFO(one.err);
  REQUIRE(one.exit_code == 0);
  for (const int processes : {2, 4}) {
    const std::string name = "n" + std::to_string(processes);
    const RunResult r = train(config, processes, name);
    INFO(processes << " processes: " << r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(bytes_of(name) == bytes_of("one"));
    CHECK(losses_of(name) == losses_of("one"));
  }
  // Stopped at step 6 on 4 and on 2 processes, resumed on 2 and on 1.
  for (const auto& [before, after] : {std::pair{4, 2}, std::pair{2, 1}}) {
    const std::string first = "stop" + std::to_string(before), second = "resume" + std::to_string(after);
    const RunResult stopped = train(config, before, first, "--set train.max_steps=6");
    INFO(stopped.err);
    REQUIRE(stopped.exit_code == 0);
    const RunResult resumed =
        train(config, after, second, "--set train.resume=" + (scratch() / first / "checkpoints").string());
    INFO(resumed.err);
    REQUIRE(resumed.exit_code == 0);
    CHECK(bytes_of(second) == bytes_of("one"));
  }
  // An elastic restart on fewer processes (Note [Restarting a failed job] in cli/run.cpp): the last of 2
  // ranks is killed after step 8, and the job comes back on 1 process (one slot left) from step 6 with
  // the global batch kept.
  const fs::path once = scratch() / "killed_once";
  fs::remove(once);
  const RunResult elastic = train(config, 2, "elastic", "", "--max-restarts 1 --min-processes 1",
                                  "BOOSTER_TEST_KILL_AT_STEP=8:" + once.string() + " BOOSTER_TEST_MAX_PROCESSES=1");
  INFO(elastic.err);
  REQUIRE(elastic.exit_code == 0);
  CHECK_THAT(elastic.err, Catch::Contains("on 1 process instead of 2"));
  CHECK(bytes_of("elastic") == bytes_of("one"));
  // The control: the plain data-parallel run sums in another order.
  const fs::path plain = write_config(false);
  REQUIRE(train(plain, 1, "plain1").exit_code == 0);
  REQUIRE(train(plain, 2, "plain2").exit_code == 0);
  CHECK(bytes_of("plain2") != bytes_of("plain1"));
}

TEST_CASE("booster check names the world sizes of a reproducible config, and refuses others", "[cli][reproducible]") {
  const fs::path config = write_config(true);
  const RunResult check = testing::run_booster_in(scratch() / "check", "check --config " + config.string());
  INFO(check.err);
  REQUIRE(check.exit_code == 0);
  CHECK_THAT(check.err, Catch::Contains("reproducible: the global batch of 32 rows is cut into 8 chunks of 4 rows") &&
                            Catch::Contains("1 (data.batch_size 16), 2 (data.batch_size 8), 4 (data.batch_size 4), "
                                            "8 (data.batch_size 2)"));
  const RunResult three = testing::run_booster_in(scratch() / "check3", "check --config " + config.string() + " -n 3 "
                                                  "--set data.batch_size=4");
  CHECK(three.exit_code == 2);
  CHECK_THAT(three.err, Catch::Contains("3 processes do not divide the 8 reproducible chunks") &&
                            Catch::Contains("run on 1, 2, 4 or 8 processes"));
  const RunResult zero2 = testing::run_booster_in(
      scratch() / "check_zero2", "check --config " + config.string() +
                                     " --set 'plugin={\"name\": \"low_level_zero\", \"stage\": 2, \"precision\": \"bf16\"}'");
  CHECK(zero2.exit_code == 2);
  CHECK_THAT(zero2.err, Catch::Contains("low_level_zero stage 2") && Catch::Contains("use stage 1"));
}
