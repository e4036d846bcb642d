// What the `booster` program says where a user goes wrong, through the program as a user runs it:
// `check` refuses what `train` refuses (a model.init_from of another model, as a short list; a GPT
// pipeline stage left without parameters); a tensor-parallel grid on one process says how to start its
// processes; `export` and `generate` take a run directory for its checkpoints/; the example config of
// a Hugging Face model passes `check`, and an example whose data a script makes names the script.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
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

fs::path scratch_dir() { return testing::scratch_dir("test_cli_messages"); }

fs::path source_path(const std::string& relative) { return fs::path(BOOSTER_SOURCE_DIR) / relative; }

// `count` uint16 token ids below 48 (the Hugging Face fixtures' vocabulary) at `p`.
fs::path token_file(const fs::path& p, int count) {
  fs::create_directories(p.parent_path());
  std::vector<uint16_t> ids;
  for (int i = 0; i < count; ++i) ids.push_back(uint16_t((i * 7 + (i / 48) * 3) % 48));
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(ids.data()), std::streamsize(ids.size() * 2));
  return p;
}

json llama_config(const std::string& run) {
  return {{"model", {{"type", "llama"}, {"vocab_size", 48}, {"hidden_size", 16}, {"intermediate_size", 32},
                     {"num_hidden_layers", 2}, {"num_attention_heads", 2}, {"num_key_value_heads", 2}}},
          {"optimizer", {{"type", "sgd"}, {"lr", 0.05}}},
          {"data", {{"type", "tokens"}, {"path", token_file(scratch_dir() / "tokens.bin", 2048).string()},
                    {"dtype", "uint16"}, {"seq_len", 8}, {"batch_size", 4}}},
          {"train", {{"max_steps", 2}, {"log_every", 1}, {"seed", 3}, {"checkpoint_every", 2},
                     {"run_dir", (scratch_dir() / run).string()}}}};
}

fs::path write_config(const std::string& name, const json& c) {
  const fs::path p = scratch_dir() / name;
  std::ofstream(p) << c.dump(2);
  return p;
}

const char* kEnv = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1";

RunResult run_cli(const std::string& args) { return testing::run_booster_in(scratch_dir(), args, kEnv); }

// A failure as the program must report it: a non-zero exit and exactly one line on stderr, the error.
void check_one_line_error(const RunResult& r, int exit_code, const std::vector<std::string>& must_contain) {
  INFO("stderr: " << r.err);
  CHECK(r.exit_code == exit_code);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK(r.err.rfind("booster: error: ", 0) == 0);
  for (const std::string& s : must_contain) CHECK_THAT(r.err, Contains(s));
}

// A run of llama_config, trained once per test program.
fs::path trained_run() {
  const fs::path run = scratch_dir() / "run";
  if (fs::exists(run / "checkpoints" / "step-00000002" / "model")) return run;
  fs::remove_all(run);
  const RunResult r = run_cli("train --config " + write_config("llama.json", llama_config("run")).string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  return run;
}

}  // namespace

TEST_CASE("booster check refuses a model.init_from of another model with train's short message", "[cli][messages]") {
  const fs::path run = trained_run();
  json wider = llama_config("wider");
  wider["model"]["hidden_size"] = 32;
  wider["model"]["init_from"] = (run / "checkpoints" / "step-00000002").string();
  const fs::path cfg = write_config("wider.json", wider);
  const RunResult check = run_cli("check --config " + cfg.string());
  check_one_line_error(check, 2, {"'model.init_from'", "another model", "of another shape: \"model.embed_tokens.weight\" "
                                  "(saved [48, 16], model [48, 32])", "more"});
  // A short list, naming nothing a config cannot set (Module::load_state_dict's strict flag).
  CHECK(check.err.size() < 700);
  CHECK_THAT(check.err, !Contains("strict"));
  const RunResult train = run_cli("train --config " + cfg.string());
  CHECK(train.exit_code == 2);
  CHECK(train.err == check.err);
  CHECK(!fs::exists(scratch_dir() / "wider"));  // refused before the run started
}

TEST_CASE("booster check refuses a GPT pipeline stage left without parameters", "[cli][messages][hybrid]") {
  // One layer over four stages: stages 1 and 2 would get none (the plugin refuses it at boost()).
  const fs::path cfg = source_path("examples/configs/gpt_char_pp2.json");
  const RunResult r = run_cli("check --config " + cfg.string() + " --set plugin.pp_size=4 --set model.layers=1 -n 4");
  check_one_line_error(r, 2, {"pipeline stage", "of 4 would hold no parameters", "pp_size"});
  // Enough layers: accepted.
  CHECK(run_cli("check --config " + cfg.string() + " --set plugin.pp_size=4 --set model.layers=2 -n 4").exit_code == 0);
}

TEST_CASE("a tensor-parallel grid on one process says to start it with booster run -n", "[cli][messages][hybrid]") {
  const fs::path cfg = write_config("tp2.json", llama_config("tp2"));
  const RunResult train = run_cli("train --config " + cfg.string() + " -p hybrid_parallel --set plugin.tp_size=2");
  check_one_line_error(train, 2, {"does not divide the world size 1", "booster run -n 2"});
  const RunResult check = run_cli("check --config " + cfg.string() + " -p hybrid_parallel --set plugin.tp_size=2");
  CHECK(check.exit_code == 2);
  CHECK_THAT(check.err, Contains("booster run -n 2"));
}

TEST_CASE("booster export and generate take a run directory for its checkpoints/", "[cli][messages]") {
  const fs::path run = trained_run();
  const fs::path out = scratch_dir() / "exported";
  fs::remove_all(out);
  const RunResult e = run_cli("export --checkpoint " + run.string() + " --format hf --out " + out.string());
  INFO(e.err);
  REQUIRE(e.exit_code == 0);
  CHECK_THAT(json::parse(testing::last_line(e.out)).at("checkpoint").get<std::string>(), Contains("step-00000002"));
  CHECK(fs::exists(out / "config.json"));
  const RunResult g = run_cli("generate --checkpoint " + run.string() + " --prompt-ids \"1 2 3\" --max-new-tokens 2 "
                              "--temperature 0");
  INFO(g.err);
  CHECK(g.exit_code == 0);
}

TEST_CASE("the example config of a Hugging Face model passes booster check with a Hugging Face directory",
          "[cli][messages][hf]") {
  // The config's relative paths, made in the directory check runs in: a tiny Llama as models/my-llama.
  const fs::path dir = scratch_dir() / "hf_example";
  fs::remove_all(dir);
  fs::create_directories(dir / "models");
  fs::copy(fs::path(BOOSTER_FIXTURE_DIR) / "hf" / "llama", dir / "models" / "my-llama", fs::copy_options::recursive);
  const std::string check = "check --config " + source_path("examples/configs/hf_llama_finetune.json").string() +
                            " --set data.seq_len=16";  // the tiny model's 32 positions
  // Before its data is tokenized, check names the command that makes it.
  const RunResult missing = testing::run_booster_in(dir, check, kEnv);
  check_one_line_error(missing, 2, {"runs/hf_llama_finetune/data/train.bin does not exist", "booster tokenize"});
  token_file(dir / "runs/hf_llama_finetune/data/train.bin", 4096);
  token_file(dir / "runs/hf_llama_finetune/data/train.val.bin", 512);
  const RunResult r = testing::run_booster_in(dir, check, kEnv);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const json resolved = json::parse(r.out);
  CHECK(resolved.at("model").at("type") == "hf");
  CHECK(resolved.at("mixed_precision").at("name") == "bf16");
}

TEST_CASE("booster check of the fortunes example names the script that makes its data", "[cli][messages]") {
  const fs::path dir = scratch_dir() / "fortunes";  // no runs/llama_fortunes/data here
  fs::create_directories(dir);
  const RunResult r =
      testing::run_booster_in(dir, "check --config " + source_path("examples/configs/llama_fortunes.json").string(), kEnv);
  check_one_line_error(r, 2, {"runs/llama_fortunes/data/train.bin does not exist", "bash examples/llama_fortunes.sh"});
}
