// Hugging Face models through the `booster` program: `booster train` with {"type": "hf"} (a tiny
// Llama from a sharded index, a tiny tied GPT-2) on token data, on one process and under
// `booster run -n 2 -- booster train -p hybrid_parallel --set plugin.tp_size=2` and with pp_size=2 (which
// load each rank's part straight from the files) ending where one process ends; `booster export` of the checkpoints,
// which load again with the trained weights in Hugging Face's names and layout; and malformed inputs
// as one line and a non-zero exit.
#include <catch2/catch.hpp>

#include "skip.h"

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/checkpoint/safetensors.h"
#include "booster/nn/hf.h"
#include "booster/ops/ops.h"
#include "roundoff.h"
#include "run_booster.h"
#include "trajectory.h"

namespace fs = std::filesystem;
using nlohmann::json;
using testing::RunResult;
using Catch::Contains;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_hf"); }

fs::path fixture_dir(const std::string& name) { return fs::path(BOOSTER_FIXTURE_DIR) / "hf" / name; }

// 2048 uint16 token ids below the fixtures' vocabulary of 48, in a pattern a model can learn.
fs::path token_file() {
  const fs::path p = scratch_dir() / "tokens.bin";
  if (fs::exists(p)) return p;
  std::vector<uint16_t> ids;
  for (int i = 0; i < 2048; ++i) ids.push_back(uint16_t((i * 7 + (i / 48) * 3) % 48));
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(ids.data()), std::streamsize(ids.size() * 2));
  return p;
}

fs::path write_config(const std::string& name, const json& model, const std::string& run) {
  const json c = {{"model", model},
                  {"optimizer", {{"type", "sgd"}, {"lr", 0.05}}},
                  {"data", {{"type", "tokens"}, {"path", token_file().string()}, {"dtype", "uint16"}, {"seq_len", 8},
                            {"batch_size", 4}, {"shuffle", false}}},
                  {"train", {{"max_steps", 4}, {"log_every", 1}, {"seed", 3}, {"checkpoint_every", 4},
                             {"run_dir", (scratch_dir() / run).string()}}}};
  const fs::path p = scratch_dir() / name;
  std::ofstream(p) << c.dump(2);
  return p;
}

const char* kEnv = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1";

RunResult run_cli(const std::string& args) { return testing::run_booster_in(scratch_dir(), args, kEnv); }

double final_loss(const RunResult& r) { return json::parse(testing::last_line(r.out)).at("final_loss").get<double>(); }

fs::path step4(const std::string& run) { return scratch_dir() / run / "checkpoints" / "step-00000004"; }

// A failure as the program must report it: a non-zero exit and exactly one line on stderr.
void check_one_line_error(const RunResult& r, int exit_code, const std::vector<std::string>& must_contain) {
  INFO("stderr: " << r.err);
  CHECK(r.exit_code == exit_code);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK(r.err.rfind("booster: error: ", 0) == 0);
  for (const std::string& s : must_contain) CHECK_THAT(r.err, Contains(s));
}

double max_diff(const booster::Tensor& a, const booster::Tensor& b) {
  const std::vector<double> va = a.tolist(), vb = b.tolist();
  REQUIRE(va.size() == vb.size());
  double m = 0;
  for (size_t i = 0; i < va.size(); ++i) m = std::max(m, std::abs(va[i] - vb[i]));
  return m;
}

// The exported directory holds the checkpoint's weights, in Hugging Face's names (GPT-2's Conv1D
// weights transposed back), and loads again as a model with exactly those values.
void check_export(const fs::path& out, const fs::path& checkpoint_model, const std::string& family) {
  const booster::checkpoint::TensorMap trained = booster::checkpoint::load_model(checkpoint_model);
  const booster::checkpoint::TensorMap exported = booster::checkpoint::load_model(out);
  CHECK(exported.size() == trained.size());
  const booster::nn::ModulePtr model = booster::nn::load_pretrained(out);
  const auto params = model->named_parameters();
  REQUIRE(params.size() == trained.size());
  for (const auto& [name, t] : params) {
    INFO(name);
    REQUIRE(trained.count(name));
    CHECK(max_diff(t, trained.at(name)) == 0.0);
  }
  if (family == "gpt2") {
    CHECK(exported.count("lm_head.weight") == 0);  // tied
    const booster::Tensor c_attn = exported.at("transformer.h.0.attn.c_attn.weight");
    CHECK(c_attn.shape() == booster::Shape{16, 48});
    CHECK(max_diff(c_attn, trained.at("blocks.0.attn.c_attn.weight").transpose(0, 1)) == 0.0);
  } else {
    CHECK(exported.count("lm_head.weight") == 1);
  }
  // And it differs from the fixture it started from: the export is of the trained weights.
  const booster::checkpoint::TensorMap start = booster::checkpoint::load_model(fixture_dir(family));
  const std::string name = family == "gpt2" ? "transformer.wte.weight" : "model.embed_tokens.weight";
  CHECK(max_diff(exported.at(name), start.at(name)) > 0.0);
}

}  // namespace

TEST_CASE("booster train with model.type hf, then booster export, on one process", "[cli][hf]") {
  for (const std::string family : {"llama", "gpt2"}) {
    INFO(family);
    const std::string run = "single_" + family;
    fs::remove_all(scratch_dir() / run);
    const fs::path config = write_config(run + ".json", {{"type", "hf"}, {"path", fixture_dir(family).string()}}, run);
    const RunResult r = run_cli("train --config " + config.string());
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(std::isfinite(final_loss(r)));
    const fs::path out = scratch_dir() / ("export_" + family);
    fs::remove_all(out);
    // A tiny shard limit: the export is an index and shards.
    const RunResult e = run_cli("export --checkpoint " + step4(run).string() + " --format hf --out " + out.string() +
                                " --max-shard-size 8000B");
    INFO(e.err);
    REQUIRE(e.exit_code == 0);
    const json summary = json::parse(testing::last_line(e.out));
    CHECK(summary.at("out") == out.string());
    CHECK(fs::exists(out / "config.json"));
    CHECK(fs::exists(out / "model.safetensors.index.json"));
    const json hf_config = json::parse(testing::read_text(out / "config.json"));
    CHECK(hf_config.at("model_type") == family);
    CHECK(hf_config.at("bos_token_id") == json::parse(testing::read_text(fixture_dir(family) / "config.json")).at("bos_token_id"));
    check_export(out, step4(run) / "model", family);
    // A damaged checkpoint is refused, naming the file; --no-verify exports it as it is.
    const fs::path damaged = scratch_dir() / ("damaged_" + family) / "checkpoints" / "step-00000004";
    fs::remove_all(damaged.parent_path().parent_path());
    fs::create_directories(damaged.parent_path());
    fs::copy(step4(run), damaged, fs::copy_options::recursive);
    fs::copy_file(scratch_dir() / run / "config.json", damaged.parent_path().parent_path() / "config.json");
    {
      std::fstream f(damaged / "model" / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(-1, std::ios::end);
      f.put('\x7f');
    }
    check_one_line_error(run_cli("export --checkpoint " + damaged.string() + " --out " + (out.string() + "_damaged")), 1,
                         {"model.safetensors"});
    CHECK(run_cli("export --checkpoint " + damaged.string() + " --out " + (out.string() + "_damaged") + " --no-verify")
              .exit_code == 0);
    // The checkpoint root works too (its latest step), and the export trains again as model.type hf.
    const fs::path again = scratch_dir() / ("export_root_" + family);
    fs::remove_all(again);
    REQUIRE(run_cli("export --checkpoint " + (scratch_dir() / run / "checkpoints").string() + " --out " + again.string())
                .exit_code == 0);
    CHECK(fs::exists(again / "model.safetensors"));
    const fs::path config2 = write_config(run + "_again.json", {{"type", "hf"}, {"path", again.string()}}, run + "_again");
    fs::remove_all(scratch_dir() / (run + "_again"));
    CHECK(run_cli("train --config " + config2.string() + " --set train.max_steps=1 --set train.checkpoint_every=0").exit_code == 0);
  }
}

TEST_CASE("booster train with model.type hf under hybrid_parallel tp 2 ends where one process ends", "[cli][hf][mpi][roundoff]") {
  if (!testing::have_mpirun()) {
    skip_test("no mpirun (apt-get install openmpi-bin)");
    return;
  }
  for (const std::string family : {"llama", "gpt2"}) {
    INFO(family);
    const std::string one = "tp_one_" + family, two = "tp_two_" + family;
    fs::remove_all(scratch_dir() / one);
    fs::remove_all(scratch_dir() / two);
    const json model = {{"type", "hf"}, {"path", fixture_dir(family).string()}};
    // Every step saved: the path the bound is measured along.
    const RunResult single = run_cli("train --config " + write_config(one + ".json", model, one).string() +
                                     " --set train.checkpoint_every=1 --set train.keep_last=0");
    INFO(single.err);
    REQUIRE(single.exit_code == 0);
    // Note [Roundoff bounds] (tests/roundoff.h): SGD runs whose sums differ in order end within
    // sgd_bound along the single run's path; the fixtures' reductions on 4 sequences of 8.
    namespace ro = ::testing::roundoff;
    const double forward = family == "gpt2" ? ro::gpt_forward_length(16, 2, 2, 8, 48, 4)
                                            : ro::llama_forward_length(16, 2, 4, 32, 8, 48, 4);
    const double bound = ro::sgd_bound(testing::checkpoint_path(scratch_dir() / one / "checkpoints", 4, model, 3),
                                       ro::reduction_bound({2 * forward, 4 * 8}));
    auto same_end = [&](const std::string& run) {
      const double d = testing::l2_distance(testing::weights_at(step4(run)), testing::weights_at(step4(one)));
      INFO(run << ": |difference| " << d << ", bound " << bound);
      CHECK(d <= bound);
    };
    const RunResult tp = run_cli("run -n 2 -- " + std::string(BOOSTER_BIN_DIR) + "/booster train --config " +
                                 write_config(two + ".json", model, two).string() +
                                 " -p hybrid_parallel --set plugin.tp_size=2");
    INFO(tp.err);
    REQUIRE(tp.exit_code == 0);
    // Float32 sums in another order (the split GEMMs' partial sums and the vocabulary-parallel loss).
    same_end(two);
    // The hybrid checkpoint is the single-process model file: it exports as one process's does.
    const fs::path out = scratch_dir() / ("export_tp_" + family);
    fs::remove_all(out);
    const RunResult e = run_cli("export --checkpoint " + step4(two).string() + " --format hf --out " + out.string());
    INFO(e.err);
    REQUIRE(e.exit_code == 0);
    check_export(out, step4(two) / "model", family);
    // Two pipeline stages: each reads only its own layers. A tied GPT-2 cannot be cut (its embedding and
    // head are one tensor) and is refused, saying so.
    const std::string pp = "pp_two_" + family;
    fs::remove_all(scratch_dir() / pp);
    const RunResult staged = run_cli("run -n 2 -- " + std::string(BOOSTER_BIN_DIR) + "/booster train --config " +
                                     write_config(pp + ".json", model, pp).string() +
                                     " -p hybrid_parallel --set plugin.pp_size=2");
    INFO(staged.err);
    if (family == "gpt2") {
      CHECK(staged.exit_code == 2);
      CHECK_THAT(staged.err, Contains("tie_word_embeddings shares one tensor"));
    } else {
      REQUIRE(staged.exit_code == 0);
      same_end(pp);
    }
  }
}

TEST_CASE("booster train and export: malformed Hugging Face inputs are one line and a non-zero exit", "[cli][hf]") {
  const fs::path broken = scratch_dir() / "broken_gpt2";
  fs::remove_all(broken);
  fs::copy(fixture_dir("gpt2"), broken, fs::copy_options::recursive);
  booster::checkpoint::TensorMap t = booster::checkpoint::read_safetensors(broken / "model.safetensors").tensors;
  t.erase("transformer.ln_f.bias");
  t["transformer.wpe.weight"] = booster::zeros({15, 16});
  booster::checkpoint::write_safetensors(broken / "model.safetensors", t);
  check_one_line_error(
      run_cli("train --config " + write_config("broken.json", {{"type", "hf"}, {"path", broken.string()}}, "broken").string()),
      2, {"missing transformer.ln_f.bias [16]", "transformer.wpe.weight has shape [15, 16], expected [16, 16]"});
  check_one_line_error(
      run_cli("train --config " +
              write_config("nowhere.json", {{"type", "hf"}, {"path", (scratch_dir() / "nowhere").string()}}, "nowhere").string()),
      2, {"nowhere", "is not a directory"});
  check_one_line_error(
      run_cli("train --config " +
              write_config("option.json", {{"type", "hf"}, {"path", fixture_dir("llama").string()}, {"dropout", 0.1}}, "option")
                  .string()),
      2, {"'model.dropout' is not an option of a Hugging Face llama model"});

  check_one_line_error(run_cli("export --checkpoint " + scratch_dir().string()), 2, {"needs --out"});
  check_one_line_error(run_cli("export --checkpoint " + (scratch_dir() / "none").string() + " --out x"), 2,
                       {"does not exist"});
  check_one_line_error(run_cli("export --checkpoint " + fixture_dir("gpt2").string() + " --out x --format onnx"), 2,
                       {"--format onnx", "hf"});
  check_one_line_error(run_cli("export --checkpoint " + fixture_dir("gpt2").string() + " --out x --max-shard-size big"), 2,
                       {"'big'"});
  // A step directory with no run config beside it.
  const fs::path lone = scratch_dir() / "lone" / "step-00000001";
  fs::create_directories(lone / "model");
  check_one_line_error(run_cli("export --checkpoint " + lone.string() + " --out x"), 2, {"--config"});
}

// A run of an hf model whose model.path is relative (to the directory train ran in): export and
// generate from another directory name that, and the fix; --config with the path as it is now works.
TEST_CASE("booster export and generate of a run whose relative hf model.path is elsewhere say so and how to fix it",
          "[cli][hf]") {
  const fs::path run_in = scratch_dir() / "relative";
  fs::remove_all(run_in);
  fs::create_directories(run_in);
  fs::copy(fixture_dir("llama"), run_in / "base", fs::copy_options::recursive);
  json c = json::parse(testing::read_text(write_config("relative.json", {{"type", "hf"}, {"path", "base"}}, "relative_run")));
  c["train"]["run_dir"] = "run";
  std::ofstream(run_in / "config.json.in") << c.dump(2);
  const RunResult r = testing::run_booster_in(run_in, "train --config config.json.in", kEnv);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const fs::path checkpoints = run_in / "run" / "checkpoints";
  const fs::path out = scratch_dir() / "relative_export";
  fs::remove_all(out);
  // From the scratch directory (not run_in), "base" is not there.
  check_one_line_error(run_cli("export --checkpoint " + checkpoints.string() + " --out " + out.string()), 2,
                       {"Hugging Face model base", "relative to the directory booster train ran in", "--config"});
  check_one_line_error(run_cli("generate --checkpoint " + checkpoints.string() + " --prompt-ids \"1 2\" -n 2"), 2,
                       {"Hugging Face model base", "relative to the directory booster train ran in", "--config"});
  // The fix the message names.
  c["model"]["path"] = (run_in / "base").string();
  std::ofstream(scratch_dir() / "relative_fixed.json") << c.dump(2);
  const RunResult e = run_cli("export --checkpoint " + checkpoints.string() + " --out " + out.string() +
                              " --config " + (scratch_dir() / "relative_fixed.json").string());
  INFO(e.err);
  CHECK(e.exit_code == 0);
  CHECK(fs::exists(out / "model.safetensors"));
  const RunResult g = run_cli("generate --checkpoint " + checkpoints.string() + " --prompt-ids \"1 2\" -n 2 --config " +
                              (scratch_dir() / "relative_fixed.json").string());
  INFO(g.err);
  CHECK(g.exit_code == 0);
  // And from the directory train ran in, as it is.
  CHECK(testing::run_booster_in(run_in, "generate --checkpoint run/checkpoints --prompt-ids \"1 2\" -n 2", kEnv).exit_code == 0);
}

// A ZeRO or pure-bf16 run keeps float32 masters beside a bf16 model file; the export writes the masters
// bit for bit (read from the checkpoint's optimizer files through the safetensors reader, not through the
// code under test), with torch_dtype float32, or their rounding with --dtype bfloat16; the tokenizer
// files of the source directory come along.
TEST_CASE("booster export writes the float32 masters of a ZeRO or pure bf16 run, --dtype chooses", "[cli][hf]") {
  const fs::path source = scratch_dir() / "llama_with_tokenizer";
  fs::remove_all(source);
  fs::copy(fixture_dir("llama"), source, fs::copy_options::recursive);
  std::ofstream(source / "tokenizer_config.json") << R"({"add_bos_token": true})";
  std::ofstream(source / "generation_config.json") << R"({"eos_token_id": 2})";
  struct Case {
    std::string name, flags;
    fs::path masters;  // the checkpoint file (under optimizer/) that holds them
  };
  for (const Case& c : {Case{"zero_bf16", "-p low_level_zero --set plugin.stage=2 --set plugin.precision=bf16",
                             "optimizer.safetensors"},
                        Case{"pure_bf16", "--mixed-precision bf16 --set mixed_precision.pure=true",
                             "precision.safetensors"}}) {
    INFO(c.name);
    const std::string run = "masters_" + c.name;
    fs::remove_all(scratch_dir() / run);
    const fs::path config = write_config(run + ".json", {{"type", "hf"}, {"path", source.string()}}, run);
    const RunResult r = run_cli("train --config " + config.string() + " " + c.flags);
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    // The masters, by parameter name, straight from the files.
    const json meta = json::parse(testing::read_text(step4(run) / "optimizer" / "optimizer.json"));
    const std::vector<std::string> names = meta.at("param_names").get<std::vector<std::string>>();
    const auto saved = booster::checkpoint::read_safetensors(step4(run) / "optimizer" / c.masters).tensors;
    std::map<std::string, booster::Tensor> masters;
    for (const auto& [key, t] : saved) {
      const std::string suffix = key.substr(key.rfind('.') + 1);
      if (c.name == "zero_bf16" && key.size() > 14 && key.compare(key.size() - 14, 14, ".master_weight") == 0)
        masters[names.at(std::stoul(key.substr(6, key.find('.', 6) - 6)))] = t;  // state.<i>.master_weight
      if (c.name == "pure_bf16" && key.rfind("master_weights.0.", 0) == 0) masters[names.at(std::stoul(suffix))] = t;
    }
    REQUIRE(masters.size() == names.size());
    const booster::checkpoint::TensorMap model_file = booster::checkpoint::load_model(step4(run) / "model");
    for (const auto& [name, t] : model_file) CHECK(t.dtype() == booster::DType::BFloat16);

    const fs::path out = scratch_dir() / ("export_masters_" + c.name);
    fs::remove_all(out);
    const RunResult e = run_cli("export --checkpoint " + step4(run).string() + " --out " + out.string());
    INFO(e.err);
    REQUIRE(e.exit_code == 0);
    CHECK(json::parse(testing::last_line(e.out)).at("master_weights") == true);
    CHECK(json::parse(testing::read_text(out / "config.json")).at("torch_dtype") == "float32");
    const booster::nn::ModulePtr exported = booster::nn::load_pretrained(out);
    double worst_rounding = 0;
    for (const auto& [name, t] : exported->named_parameters()) {
      INFO(name);
      REQUIRE(masters.count(name));
      CHECK(t.dtype() == booster::DType::Float32);
      CHECK(max_diff(t, masters.at(name)) == 0.0);
      worst_rounding = std::max(worst_rounding, max_diff(model_file.at(name), masters.at(name)));
    }
    CHECK(worst_rounding > 0.0);  // the model file's bf16 weights are not what was exported
    for (const char* file : {"tokenizer_config.json", "generation_config.json"})
      CHECK(testing::read_text(out / file) == testing::read_text(source / file));

    const fs::path out16 = scratch_dir() / ("export_masters_bf16_" + c.name);
    fs::remove_all(out16);
    REQUIRE(run_cli("export --checkpoint " + step4(run).string() + " --out " + out16.string() + " --dtype bfloat16")
                .exit_code == 0);
    CHECK(json::parse(testing::read_text(out16 / "config.json")).at("torch_dtype") == "bfloat16");
    const booster::checkpoint::TensorMap written = booster::checkpoint::load_model(out16);  // a Llama: the same names
    CHECK(written.size() == masters.size());
    for (const auto& [name, t] : written) {
      INFO(name);
      REQUIRE(masters.count(name));
      CHECK(t.dtype() == booster::DType::BFloat16);
      CHECK(max_diff(t, masters.at(name).to(booster::DType::BFloat16)) == 0.0);
    }
    check_one_line_error(run_cli("export --checkpoint " + step4(run).string() + " --out " + out16.string() + "_x --dtype int8"),
                         2, {"--dtype int8"});
  }
}

// examples/finetune_hf.cpp, the fine-tuning loop a user writes around boost(): it trains the tiny
// Llama, saves it with save_pretrained (the source's extra config.json keys kept) and generates; the
// saved directory loads again and differs from the one it started from. Under bf16 too.
TEST_CASE("the finetune_hf example fine-tunes a Hugging Face model, saves it and generates", "[cli][hf][examples]") {
  for (const std::string precision : {"fp32", "bf16"}) {
    INFO(precision);
    const fs::path out = scratch_dir() / ("finetuned_" + precision);
    fs::remove_all(out);
    const std::string cmd = "cd " + scratch_dir().string() + " && OMP_NUM_THREADS=1 " + std::string(BOOSTER_BIN_DIR) +
                            "/finetune_hf " + fixture_dir("llama").string() + " " + token_file().string() + " " +
                            out.string() + " 6 " + precision + " >finetune.out 2>finetune.err";
    const int status = std::system(cmd.c_str());
    const std::string printed = testing::read_text(scratch_dir() / "finetune.out");
    INFO(printed << testing::read_text(scratch_dir() / "finetune.err"));
    REQUIRE(status == 0);
    CHECK_THAT(printed, Contains("step   5") && Contains("greedy continuation of 1 2 3:"));
    const json saved = json::parse(testing::read_text(out / "config.json"));
    CHECK(saved.at("bos_token_id") == json::parse(testing::read_text(fixture_dir("llama") / "config.json")).at("bos_token_id"));
    CHECK(saved.at("torch_dtype") == "float32");  // bf16 autocast trains float32 weights
    const booster::checkpoint::TensorMap tuned = booster::checkpoint::load_model(out);
    const booster::checkpoint::TensorMap start = booster::checkpoint::load_model(fixture_dir("llama"));
    CHECK(tuned.size() == start.size());
    CHECK(max_diff(tuned.at("model.embed_tokens.weight"), start.at("model.embed_tokens.weight")) > 0.0);
  }
}
