// `booster eval` and `booster train` with train.max_steps 0 (Note [Evaluating without training] in
// cli/train.cpp), through the program as a user runs it: the evaluation of a checkpoint is the one train
// reported at that step, to the bit (a language model's val_loss and val_ppl, a classifier's test_loss
// and test_accuracy), whether --checkpoint names the step, the checkpoint directory or the run directory;
// a Hugging Face directory evaluates with --hf; under ddp on two processes the numbers are the same; a
// damaged checkpoint is refused as init_from refuses it; and bad input is one line and a non-zero exit.
#include <catch2/catch.hpp>

#include "skip.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "run_booster.h"

namespace fs = std::filesystem;
using nlohmann::json;
using testing::RunResult;
using Catch::Contains;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_eval"); }

fs::path fixture_dir(const std::string& name) { return fs::path(BOOSTER_FIXTURE_DIR) / "hf" / name; }

// `count` uint16 token ids below 48 (the Hugging Face fixtures' vocabulary), in a learnable pattern.
fs::path token_file(const std::string& name, int count, int offset) {
  const fs::path p = scratch_dir() / name;
  if (fs::exists(p)) return p;
  std::vector<uint16_t> ids;
  for (int i = offset; i < offset + count; ++i) ids.push_back(uint16_t((i * 7 + (i / 48) * 3) % 48));
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(ids.data()), std::streamsize(ids.size() * 2));
  return p;
}

// A tiny Llama on token files with a validation file, evaluated and saved every 2 steps.
json llama_config(const std::string& run) {
  return {{"model", {{"type", "llama"}, {"vocab_size", 48}, {"hidden_size", 16}, {"intermediate_size", 32},
                     {"num_hidden_layers", 2}, {"num_attention_heads", 2}, {"num_key_value_heads", 1}}},
          {"optimizer", {{"type", "adamw"}, {"lr", 0.01}}},
          {"data", {{"type", "tokens"}, {"path", token_file("train.bin", 2048, 0).string()},
                    {"val_path", token_file("val.bin", 512, 5000).string()}, {"dtype", "uint16"}, {"seq_len", 8},
                    {"batch_size", 4}, {"eval_batch_size", 16}}},
          {"train", {{"max_steps", 4}, {"log_every", 1}, {"eval_every", 2}, {"seed", 3}, {"checkpoint_every", 2},
                     {"keep_last", 0}, {"run_dir", (scratch_dir() / run).string()}}}};
}

// An MLP on the synthetic blobs (a classifier: test_loss and test_accuracy).
json mlp_config(const std::string& run) {
  return {{"model", {{"type", "mlp"}, {"in", 20}, {"hidden", {16}}, {"classes", 4}}},
          {"optimizer", {{"type", "sgd"}, {"lr", 0.1}}},
          {"data", {{"type", "synthetic"}, {"num_samples", 256}, {"num_test_samples", 128}, {"batch_size", 32}}},
          {"train", {{"max_steps", 6}, {"log_every", 1}, {"seed", 1}, {"checkpoint_every", 6},
                     {"run_dir", (scratch_dir() / run).string()}}}};
}

fs::path write_config(const std::string& name, const json& c) {
  const fs::path p = scratch_dir() / name;
  std::ofstream(p) << c.dump(2);
  return p;
}

const char* kEnv = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1";

RunResult run_cli(const std::string& args) { return testing::run_booster_in(scratch_dir(), args, kEnv); }

json summary_of(const RunResult& r) {
  INFO("stdout: " << r.out << "\nstderr: " << r.err);
  REQUIRE(r.exit_code == 0);
  return json::parse(testing::last_line(r.out));
}

// The "eval" records of a run's metrics.jsonl, by step.
std::map<int64_t, json> eval_records(const fs::path& run_dir) {
  std::map<int64_t, json> out;
  std::istringstream in(testing::read_text(run_dir / "metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    const json record = json::parse(line, nullptr, false);
    if (record.is_object() && record.value("kind", "") == "eval") out[record.at("step").get<int64_t>()] = record;
  }
  return out;
}

// A failure as the program must report it: a non-zero exit and exactly one line on stderr.
void check_one_line_error(const RunResult& r, int exit_code, const std::vector<std::string>& must_contain) {
  INFO("stderr: " << r.err);
  CHECK(r.exit_code == exit_code);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK(r.err.rfind("booster: error: ", 0) == 0);
  for (const std::string& s : must_contain) CHECK_THAT(r.err, Contains(s));
}

// The Llama run of llama_config, trained once per test program.
fs::path trained_llama() {
  const fs::path run = scratch_dir() / "llama_run";
  if (fs::exists(run / "checkpoints" / "step-00000004" / "model")) return run;
  fs::remove_all(run);
  const json summary = summary_of(run_cli("train --config " + write_config("llama.json", llama_config("llama_run")).string()));
  REQUIRE(summary.at("steps") == 4);
  return run;
}

}  // namespace

TEST_CASE("booster eval of a checkpoint gives the val_loss and val_ppl train reported at its step",
          "[cli][eval]") {
  const fs::path run = trained_llama();
  const std::map<int64_t, json> records = eval_records(run);
  REQUIRE(records.count(2));
  REQUIRE(records.count(4));
  const std::string cfg = (scratch_dir() / "llama.json").string();

  SECTION("the step directory of step 2, an earlier step than the last") {
    const json e = summary_of(run_cli("eval --config " + cfg + " --checkpoint " + (run / "checkpoints/step-00000002").string()));
    CHECK(e.at("val_loss").get<double>() == records.at(2).at("val_loss").get<double>());
    CHECK(e.at("val_ppl").get<double>() == records.at(2).at("val_ppl").get<double>());
    CHECK(e.at("step") == 2);
    CHECK(e.at("steps") == 0);  // nothing trained
  }
  // The checkpoint directory stands for its latest step, a run directory for its checkpoints/.
  for (const fs::path& given : {run / "checkpoints", run}) {
    DYNAMIC_SECTION("--checkpoint " << given.filename().string()) {
      const RunResult r = run_cli("eval --config " + cfg + " --checkpoint " + given.string());
      const json e = summary_of(r);
      CHECK(e.at("val_loss").get<double>() == records.at(4).at("val_loss").get<double>());
      CHECK(e.at("val_ppl").get<double>() == records.at(4).at("val_ppl").get<double>());
      CHECK(e.at("test_loss").get<double>() == records.at(4).at("test_loss").get<double>());
      CHECK(e.at("step") == 4);
      CHECK(e.at("checkpoint").get<std::string>().find("step-00000004") != std::string::npos);
      CHECK(e.at("samples") == records.at(4).at("samples"));
      CHECK(!e.contains("test_accuracy"));  // a language model's summary has no accuracy
      CHECK(e.at("plugin") == "single");
      // One readable line on stderr, with the numbers.
      CHECK_THAT(r.err, Contains("booster: eval of "));
      CHECK_THAT(r.err, Contains("val loss "));
      CHECK_THAT(r.err, Contains("val ppl "));
    }
  }
  SECTION("nothing is written into the run directory") {
    const std::string before = testing::read_text(run / "metrics.jsonl");
    summary_of(run_cli("eval --config " + cfg + " --checkpoint " + run.string()));
    CHECK(testing::read_text(run / "metrics.jsonl") == before);
    CHECK(!fs::exists(run / "checkpoints" / "step-00000000"));
  }
}

TEST_CASE("booster eval of a classifier gives train's final test_loss and test_accuracy, and max_steps 0 evaluates in train",
          "[cli][eval]") {
  const fs::path run = scratch_dir() / "mlp_run";
  fs::remove_all(run);
  const fs::path cfg = write_config("mlp.json", mlp_config("mlp_run"));
  const json trained = summary_of(run_cli("train --config " + cfg.string()));
  const json e = summary_of(run_cli("eval --config " + cfg.string() + " --checkpoint " + run.string()));
  CHECK(e.at("test_loss").get<double>() == trained.at("test_loss").get<double>());
  CHECK(e.at("test_accuracy").get<double>() == trained.at("test_accuracy").get<double>());
  CHECK(!e.contains("val_ppl"));
  CHECK(e.at("step") == 6);

  // train.max_steps 0: the config's own model, evaluated without a step, and no run directory made.
  json zero = mlp_config("mlp_zero");
  zero["train"]["max_steps"] = 0;
  zero["lr_scheduler"] = {{"type", "linear_warmup"}, {"warmup_steps", 2}};  // no schedule to fit: accepted
  fs::remove_all(scratch_dir() / "mlp_zero");
  const RunResult r = run_cli("train --config " + write_config("mlp_zero.json", zero).string());
  const json z = summary_of(r);
  CHECK(z.at("steps") == 0);
  CHECK(z.at("test_accuracy").is_number());
  CHECK(z.at("test_loss").get<double>() > e.at("test_loss").get<double>());  // untrained
  CHECK(!fs::exists(scratch_dir() / "mlp_zero"));
  // With model.init_from the checkpoint's weights: the same numbers as booster eval.
  zero["model"]["init_from"] = (run / "checkpoints" / "step-00000006").string();
  const json z2 = summary_of(run_cli("train --config " + write_config("mlp_zero2.json", zero).string()));
  CHECK(z2.at("test_loss").get<double>() == e.at("test_loss").get<double>());
}

TEST_CASE("booster eval --hf evaluates a Hugging Face directory on the config's data", "[cli][eval][hf]") {
  const std::string cfg = write_config("hf.json", llama_config("hf_unused")).string();
  const RunResult r = run_cli("eval --config " + cfg + " --hf " + fixture_dir("llama").string());
  const json e = summary_of(r);
  CHECK(e.at("hf") == fixture_dir("llama").string());
  CHECK(std::isfinite(e.at("val_loss").get<double>()));
  CHECK(e.at("val_ppl").get<double>() == Approx(std::exp(e.at("val_loss").get<double>())).epsilon(1e-12));
  // The same as the config naming the directory as its model, under train.max_steps 0.
  json c = llama_config("hf_unused");
  c["model"] = {{"type", "hf"}, {"path", fixture_dir("llama").string()}};
  c["train"]["max_steps"] = 0;
  const json z = summary_of(run_cli("train --config " + write_config("hf_zero.json", c).string()));
  CHECK(z.at("val_loss").get<double>() == e.at("val_loss").get<double>());
  CHECK(!fs::exists(scratch_dir() / "hf_unused"));
}

TEST_CASE("booster eval refuses bad input with one line and a non-zero exit", "[cli][eval]") {
  const fs::path run = trained_llama();
  const std::string cfg = (scratch_dir() / "llama.json").string();
  check_one_line_error(run_cli("eval --config " + cfg + " --checkpoint " + (scratch_dir() / "no_such_dir").string()), 2,
                       {"--checkpoint", "no_such_dir", "does not exist"});
  check_one_line_error(run_cli("eval --config " + cfg + " --checkpoint " + run.string() + " --hf " +
                               fixture_dir("llama").string()),
                       2, {"--checkpoint DIR or --hf DIR, not both"});
  check_one_line_error(run_cli("eval --config " + cfg + " --hf " + (scratch_dir() / "no_such_hf").string()), 2,
                       {"--hf", "no_such_hf"});
  check_one_line_error(run_cli("eval --checkpoint " + run.string()), 2, {"needs --config FILE"});
  // A directory with no checkpoint in it.
  fs::create_directories(scratch_dir() / "empty_run");
  const RunResult empty = run_cli("eval --config " + cfg + " --checkpoint " + (scratch_dir() / "empty_run").string());
  CHECK(empty.exit_code != 0);
  check_one_line_error(empty, empty.exit_code, {"no checkpoint in"});
  // A config whose data holds nothing out.
  json no_val = llama_config("no_val");
  no_val["data"].erase("val_path");
  check_one_line_error(run_cli("eval --config " + write_config("no_val.json", no_val).string() + " --checkpoint " +
                               run.string()),
                       2, {"no held-out split", "data.val_path"});
  // A checkpoint of another model: refused while the config is resolved, as train refuses it.
  json wider = llama_config("wider");
  wider["model"]["hidden_size"] = 32;
  check_one_line_error(run_cli("eval --config " + write_config("wider.json", wider).string() + " --checkpoint " +
                               run.string()),
                       2, {"'model.init_from'", "another model"});
}

TEST_CASE("booster eval verifies the checkpoint's checksums as model.init_from does", "[cli][eval]") {
  const fs::path run = trained_llama();
  const fs::path copy = scratch_dir() / "damaged_run";
  fs::remove_all(copy);
  fs::create_directories(copy);
  fs::copy(run / "checkpoints", copy / "checkpoints", fs::copy_options::recursive);
  const fs::path model_file = copy / "checkpoints" / "step-00000004" / "model" / "model.safetensors";
  REQUIRE(fs::exists(model_file));
  {
    std::fstream f(model_file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x7f');
  }
  const std::string cfg = (scratch_dir() / "llama.json").string();
  const RunResult r = run_cli("eval --config " + cfg + " --checkpoint " + copy.string());
  CHECK(r.exit_code != 0);
  check_one_line_error(r, r.exit_code, {"model.safetensors"});
  // --no-verify reads it as it is.
  CHECK(run_cli("eval --config " + cfg + " --checkpoint " + copy.string() + " --no-verify").exit_code == 0);
}

TEST_CASE("booster eval under ddp on two processes gives the single process's numbers", "[cli][eval][mpi]") {
  if (const std::string why = testing::why_no_mpi("ddp"); !why.empty()) {
    skip_test(why);
    return;
  }
  const fs::path run = trained_llama();
  const std::string cfg = (scratch_dir() / "llama.json").string();
  const json single = summary_of(run_cli("eval --config " + cfg + " --checkpoint " + run.string()));
  const RunResult r = run_cli("run -n 2 -- " + std::string(BOOSTER_BIN_DIR) + "/booster eval --config " + cfg +
                              " --plugin ddp --checkpoint " + run.string());
  const json two = summary_of(r);
  CHECK(two.at("processes") == 2);
  CHECK(two.at("plugin") == "ddp");
  CHECK(two.at("val_loss").get<double>() == single.at("val_loss").get<double>());
  // Rank 0 alone prints the evaluation.
  CHECK(std::count(r.out.begin(), r.out.end(), '\n') == 1);
}
