// Checkpoints of `booster train` (Note [Booster state] in booster/booster/state.cpp), run as a user
// runs them: resuming from step k gives the same bytes at step n as a run that was never interrupted,
// for every mixed-precision strategy; a checkpoint that does not fit, or is damaged, is refused with one
// line naming the problem; a save that dies before its commit leaves the previous checkpoint usable.
#include <catch2/catch.hpp>

#include "skip.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/checkpoint/checkpoint.h"
#include "booster/checkpoint/checksums.h"
#include "booster/checkpoint/safetensors.h"
#include "roundoff.h"
#include "run_booster.h"
#include "trajectory.h"
#include "booster/tensor/tensor.h"

namespace fs = std::filesystem;
using nlohmann::json;

using testing::read_text;
using testing::RunResult;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_resume"); }

RunResult run_booster(const std::string& args, const std::string& env = "") {
  return testing::run_booster_in(scratch_dir(), args, env);
}

fs::path write_config(const std::string& name, const json& config) {
  const fs::path p = scratch_dir() / name;
  std::ofstream(p) << config.dump(2);
  return p;
}

// 12 steps: 8 per epoch (256 samples / 32), so step 5 is inside the first epoch and the run crosses an
// epoch boundary (a new shuffle) after it. Cosine schedule over the whole run; AdamW has state.
json mlp_config(const json& mixed_precision) {
  json c = json::parse(R"({
    "model": {"type": "mlp", "in": 8, "hidden": [16], "classes": 3},
    "optimizer": {"type": "adamw", "lr": 0.01},
    "data": {"type": "synthetic", "num_samples": 256, "num_test_samples": 64, "num_features": 8,
             "num_classes": 3, "batch_size": 32},
    "lr_scheduler": {"type": "cosine"},
    "train": {"epochs": 2, "max_steps": 12, "log_every": 4, "seed": 3, "run_dir": null, "keep_last": 0}
  })");
  c["mixed_precision"] = mixed_precision;
  return c;
}

fs::path step_dir(const fs::path& root, int step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08d", step);
  return root / name;
}

// Everything a run's end state is made of, as saved.
std::string final_state(const fs::path& root, int step) {
  const fs::path dir = step_dir(root, step);
  REQUIRE(fs::exists(dir / "model" / "model.safetensors"));
  return read_text(dir / "model" / "model.safetensors") + read_text(dir / "optimizer" / "optimizer.safetensors") +
         read_text(dir / "optimizer" / "optimizer.json") + read_text(dir / "scheduler.json") +
         read_text(dir / "optimizer" / "precision.safetensors") + read_text(dir / "optimizer" / "precision.json");
}

// Leaves only the checkpoint of `step` in `root`, as if the run had died right after saving it.
void keep_only(const fs::path& root, int step) {
  for (const auto& entry : fs::directory_iterator(root))
    if (entry.path().filename() != step_dir(root, step).filename()) fs::remove_all(entry.path());
  std::ofstream(root / "latest") << step_dir(root, step).filename().string() << "\n";
}

// metrics.jsonl of a run, without what depends on the clock.
std::vector<json> metrics_records(const fs::path& run_dir) {
  std::vector<json> records;
  std::ifstream in(run_dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    json record = json::parse(line);
    record.erase("time");
    record.erase("samples_per_second");
    // Peak memory counts from each process's fit(): a resumed one starts from what loading left live.
    for (const char* key : {"peak_tensor_bytes", "peak_tensor_bytes_per_rank", "peak_reserved_bytes",
                            "peak_reserved_bytes_per_rank"})
      record.erase(key);
    records.push_back(record);
  }
  return records;
}

size_t count_kind(const std::vector<json>& records, const std::string& kind) {
  return size_t(std::count_if(records.begin(), records.end(), [&](const json& r) { return r["kind"] == kind; }));
}

// Trains `config` uninterrupted and interrupted at step `at` (5: inside the first epoch; 8: its last
// step, with the end-of-epoch evaluation), resumed from its checkpoint, and checks that both end with
// the same bytes and wrote the same metrics records (Note [What a step's checkpoint holds]).
// `launcher` runs the command: "" for one process, "run -n 2 -- booster " for two.
void check_resume_is_exact(const std::string& name, const json& config, const std::string& launcher = "", int at = 5) {
  INFO(name << " resumed at step " << at);
  const fs::path whole = scratch_dir() / ("whole_" + name), parts = scratch_dir() / ("parts_" + name);
  const fs::path whole_run = scratch_dir() / ("whole_run_" + name), parts_run = scratch_dir() / ("parts_run_" + name);
  for (const fs::path& p : {whole, parts, whole_run, parts_run}) fs::remove_all(p);
  const fs::path cfg = write_config(name + ".json", config);
  const std::string train = launcher + "train --config " + cfg.string() + " --set train.checkpoint_every=";
  RunResult a = run_booster(train + "12 --set train.checkpoint_dir=" + whole.string() + " --set train.run_dir=" +
                            whole_run.string());
  INFO(a.err);
  REQUIRE(a.exit_code == 0);
  RunResult b = run_booster(train + std::to_string(at) + " --set train.checkpoint_dir=" + parts.string() +
                            " --set train.run_dir=" + parts_run.string());
  INFO(b.err);
  REQUIRE(b.exit_code == 0);
  keep_only(parts, at);
  RunResult c = run_booster(train + "12 --set train.checkpoint_dir=" + parts.string() + " --set train.run_dir=" +
                            parts_run.string() + " --resume " + step_dir(parts, at).string());
  INFO(c.err);
  REQUIRE(c.exit_code == 0);
  const json summary = json::parse(c.out);
  CHECK(summary["resumed_from"] == step_dir(parts, at).string());
  CHECK(summary["steps"] == 12);
  CHECK(summary["final_loss"] == json::parse(a.out)["final_loss"]);
  CHECK(summary["skipped_steps"] == json::parse(a.out)["skipped_steps"]);
  CHECK(summary["test_loss"] == json::parse(a.out)["test_loss"]);
  CHECK(final_state(parts, 12) == final_state(whole, 12));
  // No evaluation or log record repeated or lost across the interruption.
  const std::vector<json> want = metrics_records(whole_run), got = metrics_records(parts_run);
  CHECK(count_kind(want, "train") > 0);
  CHECK(count_kind(want, "eval") > 0);
  CHECK(got == want);
}

}  // namespace

TEST_CASE("resuming from step 5 gives the same bytes at step 12 for every strategy", "[cli][checkpoint][amp]") {
  check_resume_is_exact("fp32", mlp_config("fp32"));
  check_resume_is_exact("fp16", mlp_config("fp16"));
  // The scale overflows at first: skipped steps and a lowered scale must come back from the checkpoint.
  check_resume_is_exact("fp16_skipping", mlp_config({{"name", "fp16"}, {"init_scale", 4194304}}));
  check_resume_is_exact("bf16", mlp_config("bf16"));
  check_resume_is_exact("bf16_pure", mlp_config({{"name", "bf16"}, {"pure", true}}));
  check_resume_is_exact("fp16_naive", mlp_config("fp16_naive"));
  check_resume_is_exact("apex_O1", mlp_config({{"name", "fp16_apex"}, {"opt_level", "O1"}}));
  check_resume_is_exact("apex_O2", mlp_config({{"name", "fp16_apex"}, {"opt_level", "O2"}}));
  check_resume_is_exact("apex_O3", mlp_config({{"name", "fp16_apex"}, {"opt_level", "O3"}}));
  // A short amax history, so that the scales at step 12 depend on what the checkpoint carried.
  check_resume_is_exact("fp8_delayed", mlp_config({{"name", "fp8"}, {"amax_history_len", 3}, {"lm_head", true}}));
  check_resume_is_exact("fp8_current", mlp_config({{"name", "fp8"}, {"scaling", "current"}}));
}

TEST_CASE("resuming at an epoch's last step repeats no evaluation and drops no metrics record", "[cli][checkpoint]") {
  // Step 8 ends the first epoch: its evaluation (eval_every 0: after each epoch) belongs to it.
  json config = mlp_config("fp16");
  check_resume_is_exact("epoch_end", config, "", 8);
  // With eval_every 4 the evaluation at step 8 comes from the step, not from the epoch's end.
  config["train"]["eval_every"] = 4;
  check_resume_is_exact("epoch_end_eval_every", config, "", 8);
  check_resume_is_exact("eval_every", config, "", 4);
  // 3 micro-batches per step: 2 steps per epoch and 2 batches left over, never used; resumed at the
  // first epoch's end (step 2), and inside the second epoch (step 3).
  config = mlp_config("fp32");
  config["train"]["grad_accumulation"] = 3;
  config["train"]["epochs"] = 6;
  check_resume_is_exact("accumulation_epoch_end", config, "", 2);
  check_resume_is_exact("accumulation", config, "", 3);
  // The same with dropout: a micro-batch left over at the epoch's end would draw from the dropout
  // generator if it were computed, so the resumed run must skip it as the whole run does.
  const fs::path text = scratch_dir() / "short_corpus.txt";
  std::ofstream(text) << "the quick brown fox 0. the quick brown fox 1. the quick brown fox 2. ";
  json gpt = json::parse(R"({
    "model": {"type": "gpt", "vocab_size": 256, "context": 16, "width": 16, "layers": 1, "heads": 2, "dropout": 0.1},
    "optimizer": {"type": "adamw", "lr": 0.01},
    "data": {"type": "text", "context": 16, "batch_size": 7, "test_fraction": 0.3},
    "train": {"epochs": 6, "max_steps": 12, "log_every": 1, "seed": 5, "run_dir": null, "keep_last": 0,
              "grad_accumulation": 2}
  })");
  gpt["data"]["path"] = text.string();  // 48 train bytes: 32 windows in 5 batches, 2 steps per epoch
  check_resume_is_exact("gpt_accumulation_epoch_end", gpt, "", 4);
}

TEST_CASE("resuming a GPT with dropout is exact: the random generator comes back too", "[cli][checkpoint]") {
  const fs::path text = scratch_dir() / "corpus.txt";
  {
    std::ofstream out(text);
    for (int i = 0; i < 40; ++i) out << "the quick brown fox jumps over the lazy dog " << i << ". ";
  }
  json c = json::parse(R"({
    "model": {"type": "gpt", "vocab_size": 256, "context": 16, "width": 16, "layers": 1, "heads": 2, "dropout": 0.1},
    "optimizer": {"type": "adamw", "lr": 0.01},
    "data": {"type": "text", "context": 16, "batch_size": 8},
    "train": {"max_steps": 12, "log_every": 4, "seed": 5, "run_dir": null, "keep_last": 0}
  })");
  c["data"]["path"] = text.string();
  check_resume_is_exact("gpt_dropout", c);
}

TEST_CASE("resume latest: starts afresh when nothing is saved, continues from the newest otherwise", "[cli][checkpoint]") {
  const fs::path root = scratch_dir() / "latest";
  fs::remove_all(root);
  const fs::path cfg = write_config("latest.json", mlp_config("fp16"));
  const std::string args = "train --config " + cfg.string() + " --set train.checkpoint_every=4 --set train.keep_last=2 "
                           "--set train.checkpoint_dir=" + root.string() + " --resume latest";
  RunResult first = run_booster(args);
  INFO(first.err);
  REQUIRE(first.exit_code == 0);
  CHECK(json::parse(first.out)["resumed_from"].is_null());
  // keep_last 2: steps 8 and 12 stay, 4 was pruned after 12 was committed.
  CHECK_FALSE(fs::exists(step_dir(root, 4)));
  CHECK(fs::exists(step_dir(root, 8)));
  CHECK(fs::exists(step_dir(root, 12)));
  CHECK(read_text(root / "latest") == "step-00000012\n");
  // Asked again, the run is already complete: it resumes at its last step and trains no more.
  RunResult again = run_booster(args);
  INFO(again.err);
  REQUIRE(again.exit_code == 0);
  CHECK(json::parse(again.out)["resumed_from"] == step_dir(root, 12).string());
  CHECK(json::parse(again.out)["steps"] == 12);
  // ... and reports the run's end as the checkpoint recorded it.
  CHECK(json::parse(again.out)["final_loss"] == json::parse(first.out)["final_loss"]);
  CHECK(json::parse(again.out)["test_loss"] == json::parse(first.out)["test_loss"]);
  CHECK(json::parse(again.out)["test_loss"].is_number());
}

// A step that lost its checksums.json after the save (its format writes one) is damaged like a step
// with a file that fails them: --resume latest falls back past it with one warning, the save of its
// step keeps it beside as step-N.damaged, and the run ends on the uninterrupted run's bytes.
TEST_CASE("resume latest falls back past a step whose checksums.json was removed", "[cli][checkpoint]") {
  const fs::path whole = scratch_dir() / "lost_checksums_whole", root = scratch_dir() / "lost_checksums";
  fs::remove_all(whole);
  fs::remove_all(root);
  const fs::path cfg = write_config("lost_checksums.json", mlp_config("fp32"));
  const std::string train = "train --config " + cfg.string() + " --set train.checkpoint_every=4 --set train.checkpoint_dir=";
  REQUIRE(run_booster(train + whole.string()).exit_code == 0);
  // A run that died after saving step 8, whose newest step then lost its checksums.json.
  REQUIRE(run_booster(train + root.string()).exit_code == 0);
  fs::remove_all(step_dir(root, 12));
  std::ofstream(root / "latest", std::ios::trunc) << "step-00000008\n";
  REQUIRE(fs::remove(step_dir(root, 8) / "checksums.json"));

  const RunResult r = run_booster(train + root.string() + " --resume latest");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Catch::Contains("booster: warning: " + step_dir(root, 8).string() + " has no checksums.json") &&
                        Catch::Contains("resuming from " + step_dir(root, 4).string() + " instead"));
  CHECK_THAT(r.err, Catch::Contains("resumed from " + step_dir(root, 4).string() + " at step 4"));
  CHECK(fs::is_directory(root / "step-00000008.damaged"));
  CHECK_FALSE(fs::exists(root / "step-00000008.damaged" / "checksums.json"));
  CHECK(final_state(root, 12) == final_state(whole, 12));
}

TEST_CASE("a save that replaces an existing step, killed at any point, leaves latest resumable", "[cli][checkpoint]") {
  // Note [Replacing a checkpoint]: a run resumed from step 5 saves step 10 again, over the one an
  // earlier run left, which `latest` names; killed at each point of the replace, both ways of it.
  const fs::path whole = scratch_dir() / "replace_whole";
  fs::remove_all(whole);
  const fs::path cfg = write_config("replace.json", mlp_config("fp16"));
  const std::string base = "train --config " + cfg.string() + " --set train.checkpoint_every=5 --set train.checkpoint_dir=";
  REQUIRE(run_booster(base + whole.string()).exit_code == 0);
  for (const auto& [point, env] : std::vector<std::pair<std::string, std::string>>{
           {"before_commit", ""},
           {"before_old_removed", ""},
           {"before_prune", ""},
           {"between_renames", "BOOSTER_TEST_NO_RENAME_EXCHANGE=1"},
           {"before_old_removed", "BOOSTER_TEST_NO_RENAME_EXCHANGE=1"}}) {
    INFO(point << " " << env);
    const fs::path root = scratch_dir() / "replace";
    fs::remove_all(root);
    REQUIRE(run_booster(base + root.string()).exit_code == 0);
    fs::remove_all(step_dir(root, 12));
    std::ofstream(root / "latest") << "step-00000010\n";
    RunResult crashed = run_booster(base + root.string() + " --set train.keep_last=1 --resume " + step_dir(root, 5).string(),
                                    "ulimit -c 0; " + env + " BOOSTER_TEST_CRASH_AT=" + point);
    REQUIRE(crashed.exit_code == 128 + SIGABRT);
    // Between the renames there is no step-00000010/: named explicitly, it is read from its stand-in.
    const std::string resume = point == "between_renames" ? step_dir(root, 10).string() + "/" : "latest";
    RunResult resumed = run_booster(base + root.string() + " --resume " + resume);
    INFO(resumed.err);
    REQUIRE(resumed.exit_code == 0);
    const fs::path from = json::parse(resumed.out)["resumed_from"].get<std::string>();
    CHECK(from.filename().string().rfind("step-00000010", 0) == 0);  // or its stand-in, step-00000010.replaced
    CHECK(final_state(root, 12) == final_state(whole, 12));
    CHECK(read_text(root / "latest") == "step-00000012\n");
    for (const auto& entry : fs::directory_iterator(root))
      CHECK(std::regex_match(entry.path().filename().string(), std::regex(R"(latest|lock|step-\d{8})")));
  }
}

TEST_CASE("a save that dies before its commit leaves the previous checkpoint loadable", "[cli][checkpoint]") {
  const fs::path root = scratch_dir() / "crash", whole = scratch_dir() / "crash_whole";
  fs::remove_all(root);
  fs::remove_all(whole);
  const fs::path cfg = write_config("crash.json", mlp_config("fp16"));
  const std::string base = "train --config " + cfg.string() + " --set train.checkpoint_every=5 --set train.checkpoint_dir=";
  REQUIRE(run_booster(base + whole.string()).exit_code == 0);
  REQUIRE(run_booster(base + root.string()).exit_code == 0);
  keep_only(root, 5);
  // Resumed at 5, the save at step 10 aborts between writing and the rename.
  RunResult crashed = run_booster(base + root.string() + " --resume latest", "ulimit -c 0; BOOSTER_TEST_CRASH_AT=before_commit");
  CHECK(crashed.exit_code != 0);
  CHECK(fs::exists(root / "step-00000010.tmp"));
  CHECK_FALSE(fs::exists(step_dir(root, 10)));
  CHECK(read_text(root / "latest") == "step-00000005\n");
  // The next start picks up step 5 again, clears the leftover and ends where the whole run ended.
  RunResult resumed = run_booster(base + root.string() + " --resume latest");
  INFO(resumed.err);
  REQUIRE(resumed.exit_code == 0);
  CHECK(json::parse(resumed.out)["resumed_from"] == step_dir(root, 5).string());
  CHECK_FALSE(fs::exists(root / "step-00000010.tmp"));
  CHECK(final_state(root, 12) == final_state(whole, 12));
}

TEST_CASE("a checkpoint that does not fit or is damaged is refused with one line naming the problem", "[cli][checkpoint]") {
  const fs::path root = scratch_dir() / "refuse";
  fs::remove_all(root);
  const json config = mlp_config("fp16");
  const fs::path cfg = write_config("refuse.json", config);
  REQUIRE(run_booster("train --config " + cfg.string() + " --set train.checkpoint_every=5 --set train.checkpoint_dir=" +
                      root.string())
              .exit_code == 0);
  const fs::path ckpt = step_dir(root, 5);
  auto resume_fails_with = [&](const std::string& extra, const std::string& expect, const fs::path& from) {
    RunResult r = run_booster("train --config " + cfg.string() + " --resume " + from.string() + " " + extra);
    INFO(extra << " -> " << r.err);
    CHECK(r.exit_code == 1);
    CHECK(r.err.rfind("booster: error: ", 0) == 0);
    CHECK(r.err.find(expect) != std::string::npos);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    CHECK(r.out.empty());
  };
  // fp16 -> bf16 or fp16_naive resumes (Note [Resuming under another precision]); apex O3 has no
  // float32 weights to continue.
  resume_fails_with("--mixed-precision fp16_apex --set mixed_precision.opt_level=O3",
                    "was saved with mixed_precision \"fp16\" but this run has \"fp16_apex O3\", and this run's "
                    "parameter 'layers.0.weight' is float16 and its strategy keeps no float32 master weights", ckpt);
  resume_fails_with("--set 'model.hidden=[8]'", "was saved with model.hidden [16] but this run has [8]", ckpt);
  resume_fails_with("--set lr_scheduler.type=none", "was saved with lr_scheduler.type \"cosine\" but this run has \"none\"", ckpt);
  resume_fails_with("", "does not exist", root / "step-00000099");
  // Note [Settings a resume must keep]
  resume_fails_with("--set train.seed=4", "was saved with train.seed 3 but this run has 4; a resume continues the saved run: resume with --set train.seed=3", ckpt);
  resume_fails_with("--set data.batch_size=16", "was saved with data.batch_size 32 but this run has 16", ckpt);
  resume_fails_with("--set train.grad_accumulation=2", "was saved with train.grad_accumulation 1 but this run has 2", ckpt);
  resume_fails_with("--set data.shuffle=false", "was saved with data.shuffle true but this run has false", ckpt);
  resume_fails_with("--set data.drop_last=true", "was saved with data.drop_last false but this run has true", ckpt);
  resume_fails_with("--set data.num_samples=512", "was saved with data.num_samples 256 but this run has 512", ckpt);
  resume_fails_with("--set criterion.label_smoothing=0.1",
                    "was saved with criterion.label_smoothing 0.0 but this run has 0.1", ckpt);
  // The optimizer's and the schedule's settings come back from the checkpoint: another value would be ignored.
  resume_fails_with("--set optimizer.lr=0.001",
                    "was saved with optimizer.lr 0.01 but this run has 0.001; a resume continues the saved run: "
                    "resume with --set optimizer.lr=0.01", ckpt);
  resume_fails_with("--set lr_scheduler.eta_min=0.001", "was saved with lr_scheduler.eta_min 0.0 but this run has 0.001", ckpt);
  // The scaler's options are not in its saved state (only the scale and its trackers are).
  resume_fails_with("--set mixed_precision.growth_interval=1000",
                    "was saved with mixed_precision.growth_interval 2000 but this run has 1000; a resume continues "
                    "the saved run: resume with --set mixed_precision.growth_interval=2000", ckpt);
  resume_fails_with("--set mixed_precision.backoff_factor=0.25",
                    "was saved with mixed_precision.backoff_factor 0.5 but this run has 0.25", ckpt);
  // The cosine's length is the run's (T_max null): a longer run would climb back up the cosine.
  resume_fails_with("--set train.max_steps=14", "was saved with train.max_steps 12 but this run has 14", ckpt);
  resume_fails_with("--set train.max_steps=null --set train.epochs=3",
                    "was saved with train.max_steps 12 but this run has 24, and its lr schedule spans the saved run's "
                    "steps; a resume continues the saved run: resume with --set train.max_steps=12 (or fewer)", ckpt);
  {
    // A checkpoint from before the settings were recorded is accepted, saying what it cannot check.
    const fs::path old = scratch_dir() / "old_format";
    fs::remove_all(old);
    fs::copy(ckpt, old, fs::copy_options::recursive);
    json state = json::parse(read_text(old / "trainer_state.json"));
    REQUIRE(state.erase("settings") == 1);
    std::ofstream(old / "trainer_state.json", std::ios::trunc) << state.dump();
    booster::checkpoint::write_checksums(old);  // as that version saved it
    RunResult r = run_booster("train --config " + cfg.string() + " --resume " + old.string() + " --set train.seed=4");
    INFO(r.err);
    CHECK(r.exit_code == 0);
    CHECK_THAT(r.err, Catch::Contains("predates the record of criterion, data, lr_scheduler, mixed_precision, "
                                      "model, optimizer, plugin, train.grad_accumulation, train.max_steps, train.seed; they are not checked"));
  }
  {
    // A checkpoint of a version that did not have an option yet (here optimizer.weight_decay and
    // data.drop_last, as if added since with their defaults) resumes, naming each once as unchecked.
    const fs::path old = scratch_dir() / "older_version";
    fs::remove_all(old);
    fs::copy(ckpt, old, fs::copy_options::recursive);
    json state = json::parse(read_text(old / "trainer_state.json"));
    REQUIRE(state["settings"]["optimizer"].erase("weight_decay") == 1);
    REQUIRE(state["settings"]["data"].erase("drop_last") == 1);
    std::ofstream(old / "trainer_state.json", std::ios::trunc) << state.dump();
    booster::checkpoint::write_checksums(old);  // as that version saved it
    RunResult r = run_booster("train --config " + cfg.string() + " --resume " + old.string());
    INFO(r.err);
    CHECK(r.exit_code == 0);
    CHECK_THAT(r.err, Catch::Contains("predates the record of data.drop_last, optimizer.weight_decay; they are not "
                                      "checked"));
    CHECK(r.err.find("=null") == std::string::npos);
    // The keys it does record are still checked.
    resume_fails_with("--set optimizer.lr=0.001", "was saved with optimizer.lr 0.01 but this run has 0.001", old);
  }

  // Damage copies of the checkpoint, one file each.
  auto damaged_copy = [&](const std::string& name) {
    const fs::path copy = scratch_dir() / ("damaged_" + name);
    fs::remove_all(copy);
    fs::copy(ckpt, copy, fs::copy_options::recursive);
    return copy;
  };
  {
    const fs::path copy = damaged_copy("model");
    const fs::path file = copy / "model" / "model.safetensors";
    const std::string bytes = read_text(file);
    std::ofstream(file, std::ios::binary | std::ios::trunc).write(bytes.data(), std::streamsize(bytes.size() / 2));
    resume_fails_with("", "model.safetensors", copy);
  }
  {
    const fs::path copy = damaged_copy("optimizer");
    const fs::path file = copy / "optimizer" / "optimizer.safetensors";
    std::string bytes = read_text(file);
    bytes[0] = char(0xff), bytes[1] = char(0xff), bytes[5] = char(0x7f);  // a header length past the end
    std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
    resume_fails_with("", "optimizer.safetensors", copy);
  }
  {
    const fs::path copy = damaged_copy("state");
    std::ofstream(copy / "trainer_state.json", std::ios::trunc) << "{\"format\": \"booster-train\", \"step";
    resume_fails_with("", "trainer_state.json has 33 bytes, not the", copy);
    // Unverified, the reader still names the damage.
    resume_fails_with("--no-verify", "is not valid JSON", copy);
  }
  {
    const fs::path copy = damaged_copy("missing");
    fs::remove(copy / "optimizer" / "precision.json");
    resume_fails_with("", "precision.json", copy);
  }
}

TEST_CASE("a resume may extend a run whose lr schedule does not span it", "[cli][checkpoint]") {
  // Note [Settings a resume must keep]: with a constant lr, 12 steps then 4 more are 16 steps.
  const fs::path whole = scratch_dir() / "extend_whole", parts = scratch_dir() / "extend_parts";
  fs::remove_all(whole);
  fs::remove_all(parts);
  json config = mlp_config("fp32");
  config["lr_scheduler"] = {{"type", "none"}};
  config["train"]["epochs"] = 3;
  const fs::path cfg = write_config("extend.json", config);
  const std::string train = "train --config " + cfg.string() + " --set train.checkpoint_every=4 --set train.checkpoint_dir=";
  RunResult a = run_booster(train + whole.string() + " --set train.max_steps=16");
  INFO(a.err);
  REQUIRE(a.exit_code == 0);
  REQUIRE(run_booster(train + parts.string()).exit_code == 0);
  RunResult b = run_booster(train + parts.string() + " --set train.max_steps=16 --resume latest");
  INFO(b.err);
  REQUIRE(b.exit_code == 0);
  CHECK(json::parse(b.out)["resumed_from"] == step_dir(parts, 12).string());
  CHECK(final_state(parts, 16) == final_state(whole, 16));
}

TEST_CASE("a resume may shorten a run whose lr schedule spans it: the shorter run is an exact prefix",
          "[cli][checkpoint]") {
  // Note [Settings a resume must keep]: the cosine restored from step 5 keeps its 12 steps.
  const fs::path whole = scratch_dir() / "shorten_whole", parts = scratch_dir() / "shorten_parts";
  fs::remove_all(whole);
  fs::remove_all(parts);
  const fs::path cfg = write_config("shorten.json", mlp_config("fp32"));
  const std::string train = "train --config " + cfg.string() + " --set train.checkpoint_dir=";
  REQUIRE(run_booster(train + whole.string() + " --set train.checkpoint_every=4").exit_code == 0);
  REQUIRE(run_booster(train + parts.string() + " --set train.checkpoint_every=5").exit_code == 0);
  keep_only(parts, 5);
  RunResult b = run_booster(train + parts.string() + " --set train.checkpoint_every=4 --set train.max_steps=8 --resume " +
                            step_dir(parts, 5).string());
  INFO(b.err);
  REQUIRE(b.exit_code == 0);
  CHECK(json::parse(b.out)["steps"] == 8);
  CHECK(final_state(parts, 8) == final_state(whole, 8));
}

TEST_CASE("a run refuses a checkpoint directory that another one is saving into", "[cli][checkpoint]") {
  const fs::path root = scratch_dir() / "locked";
  fs::remove_all(root);
  const fs::path cfg = write_config("locked.json", mlp_config("fp32"));
  const std::string args = "train --config " + cfg.string() + " --set train.checkpoint_every=4 --set train.checkpoint_dir=" +
                           root.string();
  {
    const booster::checkpoint::RootLock other_run(root);
    RunResult r = run_booster(args);
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Catch::StartsWith("booster: error: ") && Catch::Contains("is in use by another process"));
    CHECK_FALSE(fs::exists(step_dir(root, 4)));
  }
  RunResult r = run_booster(args);
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK(fs::exists(step_dir(root, 12)));
}

TEST_CASE("a run saves into a checkpoint directory whose file system cannot flock, with one warning",
          "[cli][checkpoint]") {
  // Note [Locking a checkpoint root]: the hook makes flock() fail with ENOSYS, as Lustre noflock does.
  const fs::path root = scratch_dir() / "noflock";
  fs::remove_all(root);
  const fs::path cfg = write_config("noflock.json", mlp_config("fp32"));
  RunResult r = run_booster("train --config " + cfg.string() + " --set train.checkpoint_every=4 --set train.checkpoint_dir=" +
                                root.string(),
                            "BOOSTER_TEST_FLOCK_ERRNO=" + std::to_string(ENOSYS));
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK(fs::exists(step_dir(root, 12)));
  const std::string warning = "booster: warning: the checkpoint directory " + root.string() +
                              " cannot be locked on this file system";
  CHECK_THAT(r.err, Catch::Contains(warning) && Catch::Contains("no two runs may use it at once"));
  CHECK(r.err.find(warning) == r.err.rfind(warning));  // one line, not one per save
}

using testing::have_mpirun;
using testing::have_plugin;

TEST_CASE("a resume refuses plugin options that change the numbers and accepts those that change only speed",
          "[cli][checkpoint]") {
  // Note [Settings a resume must keep]: one process of ddp trains as its plugin options say.
  if (!have_plugin("ddp")) {
    skip_test("the ddp plugin is not built");
    return;
  }
  const fs::path root = scratch_dir() / "plugin_options";
  fs::remove_all(root);
  json config = mlp_config("fp32");
  config["plugin"] = "ddp";
  const fs::path cfg = write_config("plugin_options.json", config);
  const std::string train = "train --config " + cfg.string() + " --set train.checkpoint_dir=" + root.string() +
                            " --set train.checkpoint_every=5 --set train.max_steps=5";
  RunResult saved = run_booster(train);
  INFO(saved.err);
  REQUIRE(saved.exit_code == 0);
  RunResult refused = run_booster(train + " --resume latest --set plugin.find_unused_parameters=true");
  CHECK(refused.exit_code == 1);
  CHECK_THAT(refused.err, Catch::Contains("was saved with plugin.find_unused_parameters false but this run has true; "
                                          "a resume continues the saved run: resume with --set "
                                          "plugin.find_unused_parameters=false"));
  RunResult accepted = run_booster(train + " --resume latest --set plugin.bucket_cap_mb=50 --set plugin.progress_thread=false");
  INFO(accepted.err);
  CHECK(accepted.exit_code == 0);
  CHECK(json::parse(accepted.out)["resumed_from"] == step_dir(root, 5).string());

  if (!have_plugin("low_level_zero")) {
    skip_test("low_level_zero half: the plugin is not built");
    return;
  }
  const fs::path zero_root = scratch_dir() / "plugin_options_zero";
  fs::remove_all(zero_root);
  config["plugin"] = {{"name", "low_level_zero"}, {"precision", "fp16"}};
  const fs::path zero_cfg = write_config("plugin_options_zero.json", config);
  const std::string zero_train = "train --config " + zero_cfg.string() + " --set train.checkpoint_dir=" +
                                 zero_root.string() + " --set train.checkpoint_every=5 --set train.max_steps=5";
  RunResult zero_saved = run_booster(zero_train);
  INFO(zero_saved.err);
  REQUIRE(zero_saved.exit_code == 0);
  RunResult zero_refused = run_booster(zero_train + " --resume latest --set plugin.growth_interval=10");
  CHECK(zero_refused.exit_code == 1);
  CHECK_THAT(zero_refused.err, Catch::Contains("was saved with plugin.growth_interval 1000 but this run has 10"));
  // max_norm is the plugin's train.max_grad_norm, which may change; the buckets change only speed.
  RunResult zero_accepted = run_booster(zero_train + " --resume latest --set plugin.max_norm=1.0 --set "
                                                     "plugin.overlap_communication=false --set plugin.reduce_bucket_size_in_m=4");
  INFO(zero_accepted.err);
  CHECK(zero_accepted.exit_code == 0);
}


// Two ranks (each 128 of the 256 samples, 4 batches per epoch): step 5 is inside the second epoch.
TEST_CASE("resuming ddp and low_level_zero on 2 ranks gives the same bytes", "[cli][checkpoint][mpi]") {
  if (!have_mpirun()) {
    skip_test("no mpirun (apt-get install openmpi-bin)");
    return;
  }
  const std::string two_ranks = "run -n 2 -- booster ";
  for (const auto& [name, mixed_precision, plugin] : std::vector<std::tuple<std::string, json, json>>{
           {"ddp_fp32", "fp32", "ddp"},
           {"ddp_fp16", "fp16", "ddp"},
           {"ddp_apex_O2", {{"name", "fp16_apex"}, {"opt_level", "O2"}}, "ddp"},
           // Every rank keeps the scales of the largest amax any rank saw (Note [Agreeing on amax]).
           {"ddp_fp8", {{"name", "fp8"}, {"amax_history_len", 2}}, "ddp"},
           {"zero1_fp16", "fp32", {{"name", "low_level_zero"}, {"stage", 1}, {"precision", "fp16"}}},
           {"zero2_bf16", "fp32", {{"name", "low_level_zero"}, {"stage", 2}, {"precision", "bf16"}}}}) {
    const std::string plugin_name = plugin.is_string() ? plugin.get<std::string>() : plugin.at("name").get<std::string>();
    if (!have_plugin(plugin_name)) {
      skip_test(name + ": plugin " + plugin_name + " is not built");
      continue;
    }
    json c = mlp_config(mixed_precision);
    c["plugin"] = plugin;
    c["train"]["epochs"] = 3;
    check_resume_is_exact(name, c, two_ranks);
  }
}

TEST_CASE("grad_accumulation 2 with batch 16 trains as batch 32 does", "[cli][train][roundoff]") {
  // Note [Gradient accumulation]: the mean of two half-batch mean losses has the gradient of the whole
  // batch's mean loss, so parameters agree up to float32 rounding of the sums (SGD: no scale-free step
  // to magnify it). The shuffle's permutation does not depend on the batch size, so the micro-batches
  // are the two halves of the big batch.
  const fs::path big = scratch_dir() / "accum_big", small = scratch_dir() / "accum_small";
  fs::remove_all(big);
  fs::remove_all(small);
  json config = mlp_config("fp32");
  config["optimizer"] = {{"type", "sgd"}, {"lr", 0.1}, {"momentum", 0.9}};
  const fs::path cfg = write_config("accum.json", config);
  const std::string common = "train --config " + cfg.string() + " --set train.checkpoint_every=1 ";
  RunResult a = run_booster(common + "--set data.batch_size=32 --set train.checkpoint_dir=" + big.string());
  INFO(a.err);
  REQUIRE(a.exit_code == 0);
  RunResult b = run_booster(common + "--set data.batch_size=16 --set train.grad_accumulation=2 --set train.checkpoint_dir=" +
                            small.string());
  INFO(b.err);
  REQUIRE(b.exit_code == 0);
  CHECK(json::parse(b.out)["steps"] == 12);
  // Note [Roundoff bounds] (tests/roundoff.h): SGD with momentum 0.9 along the big run's own path; the
  // gradient's reductions are the MLP's (Linears of 8 and 16 inputs, 3 classes) and the 32 rows.
  namespace ro = ::testing::roundoff;
  const double path = testing::checkpoint_path(big, 12, config.at("model"), config.at("train").at("seed").get<uint64_t>());
  const double bound =
      ro::sgd_bound(path, ro::reduction_bound({2 * ro::mlp_forward_length({8, 16}, 3, 32), 32}), 0.9);
  const double difference = testing::l2_distance(testing::weights_at(step_dir(small, 12)), testing::weights_at(step_dir(big, 12)));
  INFO("|difference| " << difference << ", bound " << bound);
  CHECK(difference <= bound);
  // A step needs as many batches as it accumulates.
  RunResult c = run_booster("train --config " + cfg.string() + " --set data.batch_size=128 --set train.grad_accumulation=3");
  CHECK(c.exit_code == 2);
  CHECK_THAT(c.err, Catch::Contains("train.grad_accumulation"));
}

TEST_CASE("model.init_from starts from a saved model's weights, and refuses one of another shape", "[cli][checkpoint]") {
  const fs::path first = scratch_dir() / "init_first", second = scratch_dir() / "init_second";
  fs::remove_all(first);
  fs::remove_all(second);
  json config = mlp_config("fp32");
  config["optimizer"] = {{"type", "sgd"}, {"lr", 0.1}};
  const fs::path cfg = write_config("init_from.json", config);
  RunResult a = run_booster("train --config " + cfg.string() + " --set train.checkpoint_every=12 --set train.checkpoint_dir=" +
                            first.string());
  INFO(a.err);
  REQUIRE(a.exit_code == 0);
  const fs::path saved = step_dir(first, 12) / "model";
  // One step with a learning rate far below half an ulp of every weight: the weights stay as loaded.
  RunResult b = run_booster("train --config " + cfg.string() + " --set model.init_from=" + saved.string() +
                            " --set optimizer.lr=1e-30 --set train.max_steps=1 --set train.checkpoint_every=1"
                            " --set train.checkpoint_dir=" + second.string());
  INFO(b.err);
  REQUIRE(b.exit_code == 0);
  const auto want = booster::checkpoint::load_model(saved);
  const auto got = booster::checkpoint::load_model(step_dir(second, 1) / "model");
  REQUIRE(want.size() == got.size());
  for (const auto& [name, w] : want) {
    INFO(name);
    const booster::Tensor g = got.at(name);
    REQUIRE(g.numel() == w.numel());
    CHECK(std::memcmp(g.data<float>(), w.data<float>(), sizeof(float) * size_t(w.numel())) == 0);
  }
  // Without init_from the same one step starts elsewhere (the check above can fail).
  CHECK(json::parse(b.out)["final_loss"] != json::parse(
      run_booster("train --config " + cfg.string() + " --set optimizer.lr=1e-30 --set train.max_steps=1").out)["final_loss"]);
  RunResult c = run_booster("train --config " + cfg.string() + " --set model.hidden=[17] --set model.init_from=" + saved.string());
  CHECK(c.exit_code != 0);
  CHECK_THAT(c.err, Catch::Contains("model.init_from") && Catch::Contains("shape"));
  RunResult d = run_booster("train --config " + cfg.string() + " --set model.init_from=/nonexistent/model.safetensors");
  CHECK(d.exit_code == 2);
  CHECK_THAT(d.err, Catch::Contains("model.init_from") && Catch::Contains("does not exist"));
}

namespace {

// Starts `booster <args>` in the background, sends `signal` once it has logged a step on stderr (so it
// is mid-run), and returns what it printed and its status.
// `every_process`: the signal goes to every process whose command line holds `every_process` (the
// launcher, mpirun and each rank: what Slurm and Kubernetes do to a job), not only to the one started.
RunResult interrupt_booster(const std::string& args, int signal, const std::string& every_process = "") {
  const std::string kill = every_process.empty() ? "kill -" + std::to_string(signal) + " $pid"
                                                 : "for p in $(pgrep -f " + every_process +
                                                       "); do [ $p = $$ ] || [ $p = $PPID ] || kill -" +
                                                       std::to_string(signal) + " $p; done";  // not this shell
  return testing::run_booster_interrupted(scratch_dir(), args, testing::wait_for_line("step "), kill);
}

// Long enough (3000 small steps, a few seconds) that the signal arrives mid-run.
json long_config() {
  json c = mlp_config("fp32");
  c["model"]["hidden"] = {256, 256};
  c["lr_scheduler"] = {{"type", "none"}};
  c["train"]["epochs"] = 800;
  c["train"]["max_steps"] = 3000;
  c["train"]["log_every"] = 10;
  return c;
}

// Interrupts a run with `signal` through `launcher`, resumes it with --resume latest and checks that it
// ends with the same bytes as a run that was never interrupted.
void check_interrupted_resume(const std::string& name, const std::string& launcher, int signal, const json& config,
                              bool every_process = false) {
  const fs::path whole = scratch_dir() / ("sig_whole_" + name), parts = scratch_dir() / ("sig_parts_" + name);
  const fs::path run = scratch_dir() / ("sig_run_" + name);
  for (const fs::path& p : {whole, parts, run}) fs::remove_all(p);
  const fs::path cfg = write_config("sig_" + name + ".json", config);
  const std::string train = launcher + "train --config " + cfg.string() + " --set train.checkpoint_every=3000 ";
  RunResult stopped = interrupt_booster(train + "--set train.checkpoint_dir=" + parts.string() +
                                            " --set train.run_dir=" + run.string(), signal,
                                        every_process ? cfg.string() : "");
  INFO(stopped.err);
  REQUIRE(stopped.exit_code == 128 + signal);
  CHECK_THAT(stopped.err, !Catch::Contains("interrupted again"));
  const std::vector<std::pair<int64_t, fs::path>> saved = booster::checkpoint::list_checkpoints(parts);
  REQUIRE(saved.size() == 1);
  const int64_t at = saved.front().first;
  // The summary says the run was interrupted, where, and what it saved.
  const json summary = json::parse(testing::last_line(stopped.out));
  CHECK(summary["interrupted"] == (signal == SIGINT ? "SIGINT" : "SIGTERM"));
  CHECK(summary["steps"] == at);
  CHECK(summary["last_checkpoint"] == saved.front().second.string());
  CHECK(at > 0);
  CHECK(at < 3000);
  CHECK_THAT(stopped.err, Catch::Contains("stopped by") && Catch::Contains("after step " + std::to_string(at) +
                                                                           " of 3000; saved " + saved.front().second.string()) &&
                              Catch::Contains("--resume"));

  RunResult resumed = run_booster(train + "--set train.checkpoint_dir=" + parts.string() + " --set train.run_dir=" +
                                  run.string() + " --resume latest");
  INFO(resumed.err);
  REQUIRE(resumed.exit_code == 0);
  CHECK(json::parse(resumed.out)["resumed_from"] == saved.front().second.string());
  RunResult a = run_booster(train + "--set train.checkpoint_dir=" + whole.string() + " --set train.run_dir=null");
  REQUIRE(a.exit_code == 0);
  CHECK(final_state(parts, 3000) == final_state(whole, 3000));
  CHECK(json::parse(resumed.out)["final_loss"] == json::parse(a.out)["final_loss"]);
}

}  // namespace

TEST_CASE("SIGTERM mid-run saves and exits 143, and --resume latest ends with the same bytes", "[cli][checkpoint][signal]") {
  check_interrupted_resume("sigterm", "", SIGTERM, long_config());
}

TEST_CASE("Ctrl-C mid-run saves and exits 130, and resuming ends with the same bytes (fp16, dropout)",
          "[cli][checkpoint][signal]") {
  json c = long_config();
  c["mixed_precision"] = "fp16";
  c["model"] = {{"type", "gpt"}, {"vocab_size", 16}, {"context", 8}, {"width", 16}, {"layers", 1}, {"heads", 2},
                {"dropout", 0.1}};
  c["data"] = {{"type", "text"}, {"path", (scratch_dir() / "text.txt").string()}, {"context", 8},
               {"batch_size", 8}, {"test_fraction", 0.1}};
  c["model"]["vocab_size"] = 256;
  std::ofstream(scratch_dir() / "text.txt") << std::string(2000, 'a') + "the quick brown fox jumps over the lazy dog\n";
  check_interrupted_resume("sigint_gpt", "", SIGINT, c);
}

TEST_CASE("Ctrl-C under booster run -n 2 stops every rank after the same step and the resume is exact",
          "[cli][checkpoint][signal][mpi]") {
  if (!have_mpirun() || !have_plugin("ddp")) {
    skip_test(!have_mpirun() ? "no mpirun (apt-get install openmpi-bin)" : "the ddp plugin is not built");
    return;
  }
  json c = long_config();
  c["plugin"] = "ddp";
  check_interrupted_resume("ddp", "run -n 2 -- booster ", SIGINT, c);
}

// A cluster's preemption: SIGTERM to every process of the job at once, which the launchers also
// forward. Each rank gets it two or three times within a moment; that is one stop request, so every
// rank stops after the same step and saves (Note [Stopping on a signal]).
TEST_CASE("SIGTERM to every process of a booster run -n 2 job is one request: every rank saves",
          "[cli][checkpoint][signal][mpi]") {
  if (!have_mpirun() || !have_plugin("ddp")) {
    skip_test(!have_mpirun() ? "no mpirun (apt-get install openmpi-bin)" : "the ddp plugin is not built");
    return;
  }
  json c = long_config();
  c["plugin"] = "ddp";
  check_interrupted_resume("ddp_preempted", "run -n 2 -- booster ", SIGTERM, c, /*every_process=*/true);
}

TEST_CASE("an interrupted run with nowhere to save says so and exits 130", "[cli][signal]") {
  json c = long_config();
  c["train"]["run_dir"] = nullptr;
  const fs::path cfg = write_config("sig_nowhere.json", c);
  RunResult r = interrupt_booster("train --config " + cfg.string(), SIGINT);
  INFO(r.err);
  CHECK(r.exit_code == 130);
  CHECK_THAT(r.err, Catch::Contains("stopped by SIGINT after step") &&
                        Catch::Contains("nothing was saved: there is no run or checkpoint directory"));
}

TEST_CASE("device: cuda without a GPU is one line, and an unknown device is a config error", "[cli][device]") {
  const fs::path cfg = write_config("device.json", mlp_config("fp32"));
  if (!std::getenv("BOOSTER_EXPECT_GPU")) {
    RunResult r = run_booster("train --config " + cfg.string() + " --device cuda");
    INFO(r.err);
    CHECK(r.exit_code == 1);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    CHECK_THAT(r.err, Catch::StartsWith("booster: error: device \"cuda\": no CUDA GPU was found"));
  }
  RunResult bad = run_booster("train --config " + cfg.string() + " --device tpu");
  CHECK(bad.exit_code == 2);
  CHECK_THAT(bad.err, Catch::Contains("'device' is \"tpu\"; expected \"cpu\", \"cuda\" or \"cuda:N\""));
  RunResult check = run_booster("check --config " + cfg.string());
  CHECK(check.exit_code == 0);
  CHECK_THAT(check.err, Catch::Contains("compatible: mixed precision 'fp32' with plugin 'single' on cpu"));
  CHECK(json::parse(check.out)["device"] == "cpu");
  if (!std::getenv("BOOSTER_EXPECT_GPU")) {
    RunResult no_gpu = run_booster("check --config " + cfg.string() + " --device cuda:1");
    CHECK(no_gpu.exit_code == 1);
    CHECK_THAT(no_gpu.err, Catch::Contains("device \"cuda:1\": no CUDA GPU was found"));
  }
  RunResult cpu = run_booster("train --config " + cfg.string() + " --set device=cpu");
  CHECK(cpu.exit_code == 0);
  CHECK(json::parse(cpu.out)["device"] == "cpu");
}
