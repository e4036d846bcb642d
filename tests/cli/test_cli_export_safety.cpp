// `booster export` never destroys what it writes over (Note [Export never destroys what it writes
// over] in cli/export.cpp): an --out inside a checkpoint (its model/ directory, the step itself, the
// checkpoint root, another step) is refused and the checkpoint's bytes stay what they were; a non-empty
// --out is refused and its files untouched; --overwrite replaces it whole (a file of the old directory
// that the export does not write is gone), and a failed export leaves it as it was and no sibling behind. The same for
// --format peft and --merge-lora of a LoRA run. The runs are 4 SGD steps on the tiny Hugging Face GPT-2
// fixture (tests/fixtures/hf/gpt2).
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "run_booster.h"

namespace fs = std::filesystem;
using nlohmann::json;
using testing::RunResult;
using Catch::Contains;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_export_safety"); }

RunResult run_cli(const std::string& args) {
  return testing::run_booster_in(scratch_dir(), args, "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1");
}

fs::path token_file() {
  const fs::path p = scratch_dir() / "tokens.bin";
  if (fs::exists(p)) return p;
  std::vector<uint16_t> ids;
  for (int i = 0; i < 2048; ++i) ids.push_back(uint16_t((i * 7 + (i / 48) * 3) % 48));
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(ids.data()), std::streamsize(ids.size() * 2));
  return p;
}

// A run of 4 SGD steps on the GPT-2 fixture, LoRA or not, checkpointed at steps 2 and 4; its run directory.
fs::path trained_run(bool lora) {
  const std::string name = lora ? "lora_run" : "full_run";
  const fs::path run = scratch_dir() / name;
  if (fs::exists(run / "checkpoints" / "step-00000004" / "checksums.json")) return run;
  fs::remove_all(run);
  json c = {{"model", {{"type", "hf"}, {"path", (fs::path(BOOSTER_FIXTURE_DIR) / "hf" / "gpt2").string()}}},
            {"optimizer", {{"type", "sgd"}, {"lr", 0.5}}},
            {"data", {{"type", "tokens"}, {"path", token_file().string()}, {"dtype", "uint16"}, {"seq_len", 8},
                      {"batch_size", 4}, {"shuffle", false}}},
            {"train", {{"max_steps", 4}, {"seed", 3}, {"checkpoint_every", 2}, {"run_dir", run.string()}}}};
  if (lora) c["lora"] = {{"r", 4}, {"alpha", 6}, {"target_modules", {"c_attn"}}};
  const fs::path config = scratch_dir() / (name + ".json");
  std::ofstream(config) << c.dump(2);
  const RunResult r = run_cli("train --config " + config.string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  return run;
}

void check_one_line_error(const RunResult& r, const std::vector<std::string>& must_contain) {
  INFO("stderr: " << r.err);
  CHECK(r.exit_code == 2);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  for (const std::string& s : must_contain) CHECK_THAT(r.err, Contains(s));
}

// No hidden sibling of an export is left beside `dir`.
void check_no_leftovers(const fs::path& dir) {
  for (const auto& e : fs::directory_iterator(dir.parent_path()))
    CHECK_THAT(e.path().filename().string(), !Contains(".export-"));
}

}  // namespace

TEST_CASE("booster export refuses an --out inside a checkpoint and leaves its bytes as they were",
          "[cli][export][hardening]") {
  const fs::path run = trained_run(false);
  const fs::path checkpoints = run / "checkpoints", step = checkpoints / "step-00000004";
  const std::map<std::string, std::string> before = testing::files_of(run);
  REQUIRE(before.count("checkpoints/step-00000004/model/model.safetensors") == 1);
  struct Case {
    std::string checkpoint, out;
    std::vector<std::string> message;
  };
  const std::vector<Case> cases = {
      // The case: the checkpoint's own model/ directory.
      {step.string(), (step / "model").string(), {"inside the checkpoint being exported"}},
      {step.string(), (step / "model").string() + " --overwrite", {"inside the checkpoint being exported"}},
      {step.string(), step.string(), {"inside the checkpoint being exported"}},
      {run.string(), (step / "model").string(), {"inside the checkpoint being exported"}},
      // Another step of the same checkpoint root, a new directory in the root, the root itself.
      {step.string(), (checkpoints / "step-00000002" / "model").string(), {"trainer_state.json"}},
      {step.string(), (checkpoints / "exported").string(), {"a checkpoint directory"}},
      {step.string(), checkpoints.string() + " --overwrite", {"holds `latest`"}},
      // The run directory holds the checkpoint: --overwrite would delete it.
      {step.string(), run.string() + " --overwrite", {"holds the checkpoint being exported"}},
  };
  for (const Case& c : cases) {
    INFO(c.checkpoint << " -> " << c.out);
    const RunResult e = run_cli("export --checkpoint " + c.checkpoint + " --out " + c.out);
    check_one_line_error(e, c.message);
    CHECK_THAT(e.err, Contains("--out"));
  }
  // A link to the step's model/ directory is the directory.
  const fs::path link = scratch_dir() / "model_link";
  fs::remove(link);
  fs::create_directory_symlink(step / "model", link);
  check_one_line_error(run_cli("export --checkpoint " + step.string() + " --out " + link.string() + " --overwrite"),
                       {"inside the checkpoint being exported"});
  // A step of another run's checkpoints: refused as a checkpoint, whichever checkpoint is read.
  const fs::path other = trained_run(true) / "checkpoints" / "step-00000002";
  check_one_line_error(run_cli("export --checkpoint " + step.string() + " --out " + (other / "model").string()),
                       {"is inside", "a checkpoint"});
  check_one_line_error(run_cli("export --checkpoint " + other.string() + " --format peft --out " +
                               (step / "model").string() + " --overwrite"),
                       {"is inside", "a checkpoint"});
  check_one_line_error(run_cli("export --checkpoint " + other.string() + " --merge-lora --out " +
                               (step / "model").string()),
                       {"is inside", "a checkpoint"});
  CHECK(testing::files_of(run) == before);
  check_no_leftovers(step / "model");
  // The same checkpoint still exports where it may.
  const fs::path out = scratch_dir() / "outside";
  fs::remove_all(out);
  const RunResult ok = run_cli("export --checkpoint " + step.string() + " --out " + out.string());
  INFO(ok.err);
  CHECK(ok.exit_code == 0);
  CHECK(fs::exists(out / "model.safetensors"));
  CHECK(testing::files_of(run) == before);
}

TEST_CASE("booster export refuses a non-empty --out and --overwrite replaces it whole", "[cli][export][hardening]") {
  const fs::path run = trained_run(false), lora = trained_run(true);
  struct Case {
    std::string name, args;
    std::string written;  // a file the export writes
  };
  const std::vector<Case> cases = {
      {"hf", "--checkpoint " + run.string(), "model.safetensors"},
      {"peft", "--checkpoint " + lora.string() + " --format peft", "adapter_model.safetensors"},
      {"merged", "--checkpoint " + lora.string() + " --merge-lora", "model.safetensors"},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    const fs::path out = scratch_dir() / ("nonempty_" + c.name);
    fs::remove_all(out);
    fs::create_directories(out / "notes");
    std::ofstream(out / "keep.txt") << "mine\n";
    std::ofstream(out / c.written) << "not weights\n";
    std::ofstream(out / "notes" / "a.txt") << "a\n";
    const std::map<std::string, std::string> before = testing::files_of(out);

    check_one_line_error(run_cli("export " + c.args + " --out " + out.string()),
                         {"is not empty", "3 entries", "--overwrite"});
    CHECK(testing::files_of(out) == before);
    // An export with --overwrite that fails after --out was taken (its --config is missing) leaves it as it was.
    CHECK(run_cli("export " + c.args + " --out " + out.string() + " --overwrite --config " +
                  (scratch_dir() / "missing.json").string())
              .exit_code != 0);
    CHECK(testing::files_of(out) == before);
    check_no_leftovers(out);

    const RunResult e = run_cli("export " + c.args + " --out " + out.string() + " --overwrite");
    INFO(e.err);
    REQUIRE(e.exit_code == 0);
    CHECK(!fs::exists(out / "keep.txt"));
    CHECK(!fs::exists(out / "notes"));
    CHECK(testing::read_text(out / c.written) != "not weights\n");
    const json summary = json::parse(testing::last_line(e.out));
    CHECK(summary.at("out") == out.string());
    std::vector<std::string> listed;
    for (const auto& f : fs::directory_iterator(out)) listed.push_back(f.path().filename().string());
    std::sort(listed.begin(), listed.end());
    CHECK(summary.at("files") == json(listed));
    check_no_leftovers(out);
  }
  // An empty directory, and one that does not exist yet, need no --overwrite; a file is no directory.
  const fs::path empty = scratch_dir() / "empty_out";
  fs::remove_all(empty);
  fs::create_directories(empty);
  CHECK(run_cli("export --checkpoint " + run.string() + " --out " + empty.string()).exit_code == 0);
  CHECK(fs::exists(empty / "model.safetensors"));
  const fs::path file = scratch_dir() / "a_file";
  std::ofstream(file) << "x\n";
  check_one_line_error(run_cli("export --checkpoint " + run.string() + " --out " + file.string() + " --overwrite"),
                       {"is not a directory"});
  CHECK(testing::read_text(file) == "x\n");
}
