// PEFT adapters through the `booster` program: a LoRA run on the tiny Hugging Face Llama and GPT-2
// (tests/fixtures/hf/) exports its adapters with `booster export --format peft` in PEFT's names, shapes
// and config fields, bit for bit the checkpoint's, and init_from (the library's, and booster train's
// lora.init_from) reads them back bit for bit;
// `--format hf --merge-lora` writes a plain model whose adapted weights are W + s B A computed here in
// float64; `booster generate --adapter DIR` (a PEFT directory made by tests/fixtures/peft/
// make_peft_fixture.py, or the export) gives the greedy tokens of the merged model, as does generate
// of the LoRA checkpoint itself; misuse is one line and a non-zero exit. A GPT-2 trained with
// hybrid_parallel tp 2 exports the single process's adapters within SGD's roundoff bound.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/checkpoint/safetensors.h"
#include "booster/nn/hf.h"
#include "booster/nn/lora.h"
#include "booster/nn/peft.h"
#include "roundoff.h"
#include "run_booster.h"
#include "skip.h"

namespace fs = std::filesystem;
using nlohmann::json;
using testing::RunResult;
using Catch::Contains;
using namespace booster;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_peft"); }
fs::path base_dir(const std::string& family) { return fs::path(BOOSTER_FIXTURE_DIR) / "hf" / family; }
fs::path fixture_adapter(const std::string& family) { return fs::path(BOOSTER_FIXTURE_DIR) / "peft" / family; }

const char* kEnv = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1";
RunResult run_cli(const std::string& args) { return testing::run_booster_in(scratch_dir(), args, kEnv); }

fs::path token_file() {
  const fs::path p = scratch_dir() / "tokens.bin";
  if (fs::exists(p)) return p;
  std::vector<uint16_t> ids;
  for (int i = 0; i < 2048; ++i) ids.push_back(uint16_t((i * 7 + (i / 48) * 3) % 48));
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(ids.data()), std::streamsize(ids.size() * 2));
  return p;
}

json targets_of(const std::string& family) {
  return family == "gpt2" ? json{"c_attn", "c_proj"} : json{"q_proj", "v_proj", "down_proj"};
}

// How a run of lora_run trains: its name, the plugin (null: the default single process), the targets
// (null: targets_of the family), how often it checkpoints, and the launcher before "booster train".
struct RunSetup {
  std::string name;
  json plugin = nullptr;
  json targets = nullptr;
  int checkpoint_every = 4;
  std::string launcher;
};

// A LoRA run of 4 SGD steps on the family's fixture; its run directory.
fs::path lora_run(const std::string& family, bool lora = true, const RunSetup& setup = {}) {
  const std::string run = setup.name.empty() ? (lora ? "lora_" : "full_") + family : setup.name;
  fs::remove_all(scratch_dir() / run);
  json c = {{"model", {{"type", "hf"}, {"path", base_dir(family).string()}}},
            {"optimizer", {{"type", "sgd"}, {"lr", 0.5}}},
            {"data", {{"type", "tokens"}, {"path", token_file().string()}, {"dtype", "uint16"}, {"seq_len", 8},
                      {"batch_size", 4}, {"shuffle", false}}},
            {"train", {{"max_steps", 4}, {"log_every", 1}, {"seed", 3}, {"checkpoint_every", setup.checkpoint_every},
                       {"keep_last", 0}, {"run_dir", (scratch_dir() / run).string()}}}};
  if (lora)
    c["lora"] = {{"r", 4}, {"alpha", 6}, {"target_modules", setup.targets.is_null() ? targets_of(family) : setup.targets}};
  if (!setup.plugin.is_null()) c["plugin"] = setup.plugin;
  const fs::path config = scratch_dir() / (run + ".json");
  std::ofstream(config) << c.dump(2);
  const RunResult r = run_cli(setup.launcher + "train --config " + config.string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  return scratch_dir() / run;
}

fs::path step4(const fs::path& run) { return run / "checkpoints" / "step-00000004"; }

bool bit_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(), a.nbytes()) == 0;
}

void check_one_line_error(const RunResult& r, const std::vector<std::string>& must_contain) {
  INFO("stderr: " << r.err);
  CHECK(r.exit_code != 0);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  for (const std::string& s : must_contain) CHECK_THAT(r.err, Contains(s));
}

// The greedy tokens of `model_args` (--hf DIR [--adapter DIR] or --checkpoint DIR) after a fixed prompt.
std::string greedy(const std::string& model_args) {
  const RunResult r = run_cli("generate " + model_args + " --prompt-ids \"3 5 7 11\" --temperature 0 -n 12");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  return testing::last_line(r.out);
}

// The base with a PEFT directory's adapters merged by the library, saved as a Hugging Face directory.
fs::path merged_with_library(const std::string& family, const fs::path& adapter) {
  const fs::path out = scratch_dir() / ("merged_lib_" + family);
  fs::remove_all(out);
  const nn::ModulePtr model = nn::load_pretrained(base_dir(family));
  const nn::LoraConfig lora = nn::LoraConfig::from_peft(adapter);
  nn::apply_lora(*model, lora);
  const nn::ModulePtr plain = nn::load_pretrained(base_dir(family));
  plain->load_state_dict(nn::merge_lora(*model, lora));
  nn::save_pretrained(*plain, out);
  return out;
}

}  // namespace

TEST_CASE("booster export --format peft writes a LoRA run's adapters as PEFT does and init_from reads them back",
          "[cli][peft][lora]") {
  for (const std::string family : {"llama", "gpt2"}) {
    INFO(family);
    const fs::path run = lora_run(family);
    const fs::path out = scratch_dir() / ("peft_" + family);
    fs::remove_all(out);
    const RunResult e = run_cli("export --checkpoint " + run.string() + " --format peft --out " + out.string());
    INFO(e.err);
    REQUIRE(e.exit_code == 0);
    CHECK(json::parse(testing::last_line(e.out)).at("files") == json{"adapter_config.json", "adapter_model.safetensors"});
    const json c = json::parse(testing::read_text(out / "adapter_config.json"));
    CHECK(c.at("peft_type") == "LORA");
    CHECK(c.at("task_type") == "CAUSAL_LM");
    CHECK(c.at("r") == 4);
    CHECK(c.at("lora_alpha") == 6);
    CHECK(c.at("lora_dropout") == 0.0);
    CHECK(c.at("target_modules") == targets_of(family));
    CHECK(c.at("use_rslora") == false);
    CHECK(c.at("bias") == "none");
    CHECK(c.at("inference_mode") == true);
    CHECK(c.at("modules_to_save").is_null());
    CHECK(c.at("fan_in_fan_out") == (family == "gpt2"));  // GPT-2's Conv1D
    CHECK(c.at("base_model_name_or_path") == base_dir(family).string());
    // The same field names as the adapter PEFT wrote for the fixture.
    const json fixture = json::parse(testing::read_text(fixture_adapter(family) / "adapter_config.json"));
    for (const auto& [key, v] : fixture.items()) CHECK(c.contains(key));
    CHECK(c.size() == fixture.size());

    // PEFT's names and shapes; the checkpoint's values bit for bit.
    const checkpoint::SafetensorsFile written = checkpoint::read_safetensors(out / "adapter_model.safetensors");
    CHECK(written.metadata == checkpoint::Metadata{{"format", "pt"}});
    const checkpoint::TensorMap trained = checkpoint::load_model(step4(run) / "model");
    REQUIRE(written.tensors.size() == trained.size());
    const nn::ModulePtr base = nn::load_pretrained(base_dir(family));
    for (const auto& [name, t] : trained) {
      INFO(name);
      const std::string key = "base_model.model." + nn::hf_tensor_name(*base, name).name;
      REQUIRE(written.tensors.count(key));
      CHECK(bit_equal(written.tensors.at(key), t));
      CHECK(t.shape()[name.find("lora_A") != std::string::npos ? 0 : 1] == 4);
    }
    if (family == "llama") {
      CHECK(written.tensors.at("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight").shape() == Shape{4, 16});
      CHECK(written.tensors.at("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight").shape() == Shape{16, 4});
    } else {
      CHECK(written.tensors.at("base_model.model.transformer.h.0.attn.c_attn.lora_A.weight").shape() == Shape{4, 16});
      CHECK(written.tensors.at("base_model.model.transformer.h.0.attn.c_attn.lora_B.weight").shape() == Shape{48, 4});
      CHECK(written.tensors.at("base_model.model.transformer.h.1.mlp.c_proj.lora_A.weight").shape() == Shape{4, 64});
    }
    // init_from of the export: the checkpoint's adapters, bit for bit.
    const nn::ModulePtr again = nn::load_pretrained(base_dir(family));
    nn::apply_lora(*again, nn::LoraConfig::from_json({{"init_from", out.string()}}));
    const auto sd = again->state_dict();
    for (const auto& [name, t] : trained) {
      REQUIRE(sd.count(name));
      CHECK(bit_equal(sd.at(name), t));
    }
    // booster train with lora.init_from the export (r, alpha, targets from it) starts from those adapters:
    // one SGD step of lr 1e-30 moves no float32 weight above 1e-20 (far below half a unit of roundoff),
    // so its checkpoint holds them bit for bit.
    const fs::path resumed = scratch_dir() / ("init_from_" + family);
    fs::remove_all(resumed);
    const json c2 = {{"model", {{"type", "hf"}, {"path", base_dir(family).string()}}},
                     {"lora", {{"init_from", out.string()}}},
                     {"optimizer", {{"type", "sgd"}, {"lr", 1e-30}}},
                     {"data", {{"type", "tokens"}, {"path", token_file().string()}, {"dtype", "uint16"}, {"seq_len", 8},
                               {"batch_size", 4}, {"shuffle", false}}},
                     {"train", {{"max_steps", 1}, {"seed", 5}, {"checkpoint_every", 1}, {"run_dir", resumed.string()}}}};
    std::ofstream(scratch_dir() / ("init_from_" + family + ".json")) << c2.dump(2);
    const RunResult t = run_cli("train --config " + (scratch_dir() / ("init_from_" + family + ".json")).string());
    INFO(t.err);
    REQUIRE(t.exit_code == 0);
    const checkpoint::TensorMap started = checkpoint::load_model(resumed / "checkpoints" / "step-00000001" / "model");
    CHECK(started.size() == trained.size());
    for (const auto& [name, t0] : trained) {
      REQUIRE(started.count(name));
      CHECK(bit_equal(started.at(name), t0));
    }
  }
}

// Both sides round the same float64 value of W + s B A to float32 (the test sums the r products in
// another order: 1e-16 relative), so they agree to within one float32 unit, at a tie.
TEST_CASE("booster export --merge-lora writes a plain model with W + s B A merged", "[cli][peft][lora]") {
  for (const std::string family : {"llama", "gpt2"}) {
    INFO(family);
    const fs::path run = lora_run(family);
    const fs::path out = scratch_dir() / ("merged_" + family);
    fs::remove_all(out);
    const RunResult e =
        run_cli("export --checkpoint " + run.string() + " --format hf --merge-lora --out " + out.string());
    INFO(e.err);
    REQUIRE(e.exit_code == 0);
    const checkpoint::TensorMap merged = checkpoint::load_model(out);
    const checkpoint::TensorMap base = checkpoint::load_model(base_dir(family));
    CHECK(merged.size() == base.size());
    for (const auto& [key, t] : merged) CHECK(key.find("lora") == std::string::npos);
    CHECK_NOTHROW(nn::load_pretrained(out));  // a plain Hugging Face model
    const checkpoint::TensorMap trained = checkpoint::load_model(step4(run) / "model");
    const nn::ModulePtr names = nn::load_pretrained(base_dir(family));
    const double s = 6.0 / 4.0;
    int adapted = 0;
    for (const auto& [name, A] : trained) {
      if (name.find(".lora_A.weight") == std::string::npos) continue;
      const std::string module = name.substr(0, name.size() - std::string(".lora_A.weight").size());
      const Tensor B = trained.at(module + ".lora_B.weight");
      const nn::HfTensorName w = nn::hf_tensor_name(*names, module + ".weight");
      INFO(w.name);
      const std::vector<double> a = A.tolist(), b = B.tolist(), w0 = base.at(w.name).tolist(), got = merged.at(w.name).tolist();
      const int64_t r = A.shape()[0], in = A.shape()[1], out_features = B.shape()[0];
      REQUIRE(int64_t(got.size()) == in * out_features);
      double worst = 0;
      for (int64_t o = 0; o < out_features; ++o)
        for (int64_t i = 0; i < in; ++i) {
          double delta = 0;
          for (int64_t k = r - 1; k >= 0; --k) delta += b[o * r + k] * a[k * in + i];
          // Hugging Face's GPT-2 stores the Conv1D weight [in, out]: element (i, o).
          const int64_t at = w.transposed ? i * out_features + o : o * in + i;
          const double want = double(float(w0[at] + s * delta));
          worst = std::max(worst, std::abs(got[at] - want) / std::max(std::abs(want), 1e-30));
        }
      CHECK(worst <= std::ldexp(1.0, -23));
      ++adapted;
    }
    CHECK(adapted == 6);  // two layers of three adapted Linears
    // The merge changed the adapted weights.
    const std::string probe = family == "gpt2" ? "transformer.h.0.attn.c_attn.weight" : "model.layers.0.self_attn.q_proj.weight";
    CHECK_FALSE(bit_equal(merged.at(probe), base.at(probe)));
    // --dtype bfloat16 says so in config.json.
    const fs::path bf16 = scratch_dir() / ("merged_bf16_" + family);
    fs::remove_all(bf16);
    REQUIRE(run_cli("export --checkpoint " + run.string() + " --merge-lora --dtype bfloat16 --out " + bf16.string())
                .exit_code == 0);
    CHECK(json::parse(testing::read_text(bf16 / "config.json")).at("torch_dtype") == "bfloat16");
  }
}

TEST_CASE("booster generate --adapter gives the merged model's greedy tokens", "[cli][peft][lora]") {
  for (const std::string family : {"llama", "gpt2"}) {
    INFO(family);
    // PEFT's own files (the fixture) against the library's merge of them.
    const std::string with_adapter =
        greedy("--hf " + base_dir(family).string() + " --adapter " + fixture_adapter(family).string());
    CHECK(with_adapter == greedy("--hf " + merged_with_library(family, fixture_adapter(family)).string()));
    CHECK(with_adapter != greedy("--hf " + base_dir(family).string()));  // the adapter changes the tokens
    // A LoRA run: its checkpoint, its merged export, and the base with its exported adapter agree.
    const fs::path run = lora_run(family);
    const fs::path peft = scratch_dir() / ("gen_peft_" + family), merged = scratch_dir() / ("gen_merged_" + family);
    fs::remove_all(peft);
    fs::remove_all(merged);
    REQUIRE(run_cli("export --checkpoint " + run.string() + " --format peft --out " + peft.string()).exit_code == 0);
    REQUIRE(run_cli("export --checkpoint " + run.string() + " --merge-lora --out " + merged.string()).exit_code == 0);
    const std::string from_checkpoint = greedy("--checkpoint " + run.string());
    CHECK(from_checkpoint == greedy("--hf " + merged.string()));
    CHECK(from_checkpoint == greedy("--hf " + base_dir(family).string() + " --adapter " + peft.string()));
  }
}

TEST_CASE("booster export and generate: PEFT misuse is one line and a non-zero exit", "[cli][peft][lora]") {
  const fs::path full = lora_run("llama", /*lora=*/false);
  const fs::path lora = lora_run("llama");
  const fs::path out = scratch_dir() / "misuse_out";
  check_one_line_error(run_cli("export --checkpoint " + full.string() + " --format peft --out " + out.string()),
                       {"--format peft", "without LoRA", "--format hf"});
  check_one_line_error(run_cli("export --checkpoint " + full.string() + " --merge-lora --out " + out.string()),
                       {"--merge-lora", "without LoRA"});
  check_one_line_error(run_cli("export --checkpoint " + lora.string() + " --format hf --out " + out.string()),
                       {"adapters only", "--format peft", "--merge-lora"});
  check_one_line_error(run_cli("export --checkpoint " + lora.string() + " --format onnx --out " + out.string()),
                       {"--format onnx", "peft"});
  // An adapter directory without adapter_config.json, and the GPT-2's adapter on the Llama.
  const fs::path broken = scratch_dir() / "broken_adapter";
  fs::remove_all(broken);
  fs::create_directories(broken);
  fs::copy_file(fixture_adapter("llama") / "adapter_model.safetensors", broken / "adapter_model.safetensors");
  check_one_line_error(run_cli("generate --hf " + base_dir("llama").string() + " --adapter " + broken.string() +
                               " --prompt-ids \"1 2\" -n 2"),
                       {"has no adapter_config.json", "adapter_model.safetensors"});
  check_one_line_error(run_cli("generate --hf " + base_dir("llama").string() + " --adapter " +
                               fixture_adapter("gpt2").string() + " --prompt-ids \"1 2\" -n 2"),
                       {"target_modules"});
}

// A base of booster's own (model.type llama) has no weights file: export and generate rebuild it from
// train.seed, as train built it, and the digest the run recorded tells another seed apart.
TEST_CASE("a LoRA run on a model built from train.seed exports and generates alike, another seed is refused",
          "[cli][peft][lora]") {
  const fs::path run = scratch_dir() / "lora_own";
  fs::remove_all(run);
  json c = {{"model", {{"type", "llama"}, {"vocab_size", 48}, {"hidden_size", 16}, {"intermediate_size", 32},
                       {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                       {"max_position_embeddings", 32}}},
            {"lora", {{"r", 2}, {"alpha", 4}, {"target_modules", {"q_proj", "o_proj"}}}},
            {"optimizer", {{"type", "sgd"}, {"lr", 0.5}}},
            {"data", {{"type", "tokens"}, {"path", token_file().string()}, {"dtype", "uint16"}, {"seq_len", 8},
                      {"batch_size", 4}, {"shuffle", false}}},
            {"train", {{"max_steps", 4}, {"seed", 7}, {"checkpoint_every", 4}, {"run_dir", run.string()}}}};
  std::ofstream(scratch_dir() / "lora_own.json") << c.dump(2);
  REQUIRE(run_cli("train --config " + (scratch_dir() / "lora_own.json").string()).exit_code == 0);
  const fs::path merged = scratch_dir() / "lora_own_merged", peft = scratch_dir() / "lora_own_peft";
  fs::remove_all(merged);
  fs::remove_all(peft);
  REQUIRE(run_cli("export --checkpoint " + run.string() + " --merge-lora --out " + merged.string()).exit_code == 0);
  REQUIRE(run_cli("export --checkpoint " + run.string() + " --format peft --out " + peft.string()).exit_code == 0);
  CHECK(json::parse(testing::read_text(peft / "adapter_config.json")).at("base_model_name_or_path").is_null());
  CHECK(greedy("--checkpoint " + run.string()) == greedy("--hf " + merged.string()));
  c["train"]["seed"] = 8;
  std::ofstream(scratch_dir() / "lora_own_seed8.json") << c.dump(2);
  check_one_line_error(run_cli("export --checkpoint " + run.string() + " --merge-lora --out " +
                               (scratch_dir() / "lora_own_seed8").string() + " --config " +
                               (scratch_dir() / "lora_own_seed8.json").string()),
                       {"was trained on a base of digest", "--config FILE"});
}

// The GPT's shard policy splits the adapters with their Linears (Note [LoRA under tensor parallelism] in
// nn/lora.cpp: c_attn's B by its q, k and v rows, c_fc's B by rows, both c_proj's A by columns), and the
// hybrid checkpoint gathers them under the whole model's names, so the PEFT export of a GPT-2 trained
// with tp 2 is the single process's: the same adapter_config.json, the same tensors within SGD's bound
// (Note [Roundoff bounds] step 3 in tests/roundoff.h). Each weight's path sum_t lr |g_t| is read off the
// single run's checkpoints at every step: under SGD lr g_t = w_{t-1} - w_t, with B starting at zero and
// A unmoved by the first step (its gradient is s B^T dy x^T = 0 while B is 0).
TEST_CASE("booster export --format peft of a GPT-2 trained with tp 2 gives the single process's files",
          "[cli][peft][lora][mpi]") {
  if (const std::string why = testing::why_no_mpi("hybrid_parallel"); !why.empty()) return skip_test(why);
  const json targets = {"c_attn", "c_proj", "c_fc"};
  const fs::path one = lora_run("gpt2", true, {.name = "gpt2_tp1", .targets = targets, .checkpoint_every = 1});
  const fs::path two = lora_run("gpt2", true,
                                {.name = "gpt2_tp2",
                                 .plugin = {{"name", "hybrid_parallel"}, {"tp_size", 2}, {"pp_size", 1}},
                                 .targets = targets,
                                 .launcher = "run -n 2 -- booster "});
  std::map<std::string, fs::path> peft;
  for (const fs::path& run : {one, two}) {
    const fs::path out = scratch_dir() / ("peft_" + run.filename().string());
    fs::remove_all(out);
    const RunResult e = run_cli("export --checkpoint " + run.string() + " --format peft --out " + out.string());
    INFO(e.err);
    REQUIRE(e.exit_code == 0);
    peft[run.filename().string()] = out;
  }
  CHECK(testing::read_text(peft.at("gpt2_tp1") / "adapter_config.json") ==
        testing::read_text(peft.at("gpt2_tp2") / "adapter_config.json"));
  const checkpoint::TensorMap want = checkpoint::read_safetensors(peft.at("gpt2_tp1") / "adapter_model.safetensors").tensors;
  const checkpoint::TensorMap got = checkpoint::read_safetensors(peft.at("gpt2_tp2") / "adapter_model.safetensors").tensors;
  REQUIRE(got.size() == want.size());
  CHECK(want.size() == 2 * 4 * 2);  // 2 blocks, 4 adapted Linears, A and B

  // The path of each weight, from the single run's checkpoints after steps 1 .. 4.
  std::vector<checkpoint::TensorMap> steps;
  for (int t = 1; t <= 4; ++t)
    steps.push_back(checkpoint::load_model(one / "checkpoints" / ("step-0000000" + std::to_string(t)) / "model"));
  namespace ro = ::testing::roundoff;
  // One gradient's relative roundoff: GPT-2's forward (width 16, 2 layers, 2 heads, 8 positions, 48 tokens,
  // batch 4) with four adapted outputs per block each adding B's sum over r, twice (forward and backward),
  // and the weight gradients' sums over the batch's 32 positions.
  const double forward = ro::gpt_forward_length(16, 2, 2, 8, 48, 4) + 2 * 4 * (4 + 1);
  const double eps = ro::reduction_bound({2 * forward, 4 * 8});
  const nn::ModulePtr base = nn::load_pretrained(base_dir("gpt2"));
  double worst = 0;
  for (const auto& [name, trained] : steps.back()) {
    INFO(name);
    const std::string key = "base_model.model." + nn::hf_tensor_name(*base, name).name;
    REQUIRE(want.count(key));
    REQUIRE(got.count(key));
    CHECK(bit_equal(want.at(key), trained));  // the export holds the checkpoint's values
    REQUIRE(got.at(key).shape() == trained.shape());
    const bool is_b = name.find("lora_B") != std::string::npos;
    const std::vector<double> w = trained.tolist(), g = got.at(key).tolist();
    std::vector<double> path(w.size(), 0.0), prev = is_b ? std::vector<double>(w.size(), 0.0) : steps[0].at(name).tolist();
    for (const checkpoint::TensorMap& s : steps) {
      const std::vector<double> now = s.at(name).tolist();
      for (size_t i = 0; i < w.size(); ++i) path[i] += std::abs(now[i] - prev[i]);
      prev = now;
    }
    for (size_t i = 0; i < w.size(); ++i) {
      // SGD's bound, plus each step's own rounding of the updated weight in either run.
      const double bound = ro::sgd_bound(path[i], eps) + 4 * 2 * ro::kUnit * std::abs(w[i]);
      worst = std::max(worst, std::abs(g[i] - w[i]) / std::max(bound, 1e-300));
      if (std::abs(g[i] - w[i]) > bound) {
        FAIL_CHECK("element " << i << ": " << g[i] << " against " << w[i] << ", bound " << bound);
        break;
      }
    }
  }
  INFO("largest difference over its bound: " << worst);
  CHECK(worst <= 1.0);
}
