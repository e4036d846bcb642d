// LoRA through `booster train` (Note [The lora section] in booster/config/lora_section.cpp, Note
// [Adapter-only checkpoints] in booster/booster/state.cpp), run as a user runs it: the section's
// mistakes are one line naming the key; `booster check` counts the trainable parameters (the count
// here is worked out by hand from the Llama's shapes); a checkpoint holds the adapters, their optimizer
// state and master weights only, and resuming from it gives the same bytes as a run never interrupted,
// under fp32, pure bf16, apex O2 and ZeRO-3 on 2 processes; a resume on another base (another
// model.init_from) is refused naming both digests, as are another LoRA config and a full checkpoint.
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/checkpoint/safetensors.h"
#include "roundoff.h"
#include "run_booster.h"

namespace fs = std::filesystem;
using nlohmann::json;
using testing::read_text;
using testing::RunResult;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_lora"); }

const char* kEnv = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1";

RunResult run_booster(const std::string& args) { return testing::run_booster_in(scratch_dir(), args, kEnv); }

fs::path token_file() {
  const fs::path p = scratch_dir() / "tokens.bin";
  if (fs::exists(p)) return p;
  fs::create_directories(scratch_dir());
  std::vector<uint16_t> ids;
  for (int i = 0; i < 4096; ++i) ids.push_back(uint16_t((i * 7 + (i / 48) * 3) % 48));
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(ids.data()), std::streamsize(ids.size() * 2));
  return p;
}

// A Llama of hidden 32, 4 query heads of 8 over 2 key/value heads, 2 layers; 6 steps of AdamW on a
// cosine schedule, so the optimizer has state and the learning rate changes at every step.
json lora_config(const json& mixed_precision = "fp32", const json& plugin = "single") {
  return {{"model", {{"type", "llama"}, {"vocab_size", 64}, {"hidden_size", 32}, {"intermediate_size", 48},
                     {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}}},
          {"lora", {{"r", 4}, {"alpha", 8}, {"target_modules", {"q_proj", "v_proj"}}}},
          {"optimizer", {{"type", "adamw"}, {"lr", 0.01}}},
          {"lr_scheduler", {{"type", "cosine"}}},
          {"data", {{"type", "tokens"}, {"path", token_file().string()}, {"dtype", "uint16"}, {"seq_len", 8},
                    {"batch_size", 4}}},
          {"mixed_precision", mixed_precision},
          {"plugin", plugin},
          {"train", {{"max_steps", 6}, {"log_every", 3}, {"seed", 3}, {"run_dir", nullptr}, {"keep_last", 0}}}};
}

fs::path write_config(const std::string& name, const json& config) {
  const fs::path p = scratch_dir() / name;
  std::ofstream(p) << config.dump(2);
  return p;
}

fs::path step_dir(const fs::path& root, int step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08d", step);
  return root / name;
}

std::set<std::string> tensor_names(const fs::path& file) {
  std::set<std::string> names;
  for (const auto& [name, t] : booster::checkpoint::read_safetensors(file).tensors) names.insert(name);
  return names;
}

// The adapters of the config above: lora_A and lora_B of q_proj and v_proj in both layers.
std::set<std::string> adapter_names() {
  std::set<std::string> names;
  for (int layer = 0; layer < 2; ++layer)
    for (const char* proj : {"q_proj", "v_proj"})
      for (const char* ab : {"lora_A", "lora_B"})
        names.insert("model.layers." + std::to_string(layer) + ".self_attn." + proj + "." + ab + ".weight");
  return names;
}

// One line on stderr, exit 2, naming what `must_contain` says.
void check_refused(const RunResult& r, const std::vector<std::string>& must_contain) {
  INFO("stderr: " << r.err);
  CHECK(r.exit_code != 0);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  for (const std::string& s : must_contain) CHECK(r.err.find(s) != std::string::npos);
}

// Everything a run's end state is made of, as saved.
std::string final_state(const fs::path& dir) {
  std::string all;
  for (const char* file : {"model/model.safetensors", "optimizer/optimizer.safetensors", "optimizer/optimizer.json",
                           "optimizer/precision.safetensors", "optimizer/precision.json", "scheduler.json"})
    all += read_text(dir / file);
  return all;
}

// Trains `config` 6 steps uninterrupted, and again saving at step 3, whose checkpoint (the later one
// removed) a third run resumes from: the same bytes at step 6.
// Returns the uninterrupted run's last checkpoint.
fs::path check_resume_is_exact(const std::string& name, const json& config, const std::string& launcher = "") {
  INFO(name);
  const fs::path whole = scratch_dir() / ("whole_" + name), parts = scratch_dir() / ("parts_" + name);
  fs::remove_all(whole);
  fs::remove_all(parts);
  const std::string train = launcher + "train --config " + write_config(name + ".json", config).string();
  RunResult a = run_booster(train + " --set train.checkpoint_every=6 --set train.checkpoint_dir=" + whole.string());
  INFO(a.err);
  REQUIRE(a.exit_code == 0);
  RunResult b = run_booster(train + " --set train.checkpoint_every=3 --set train.checkpoint_dir=" + parts.string());
  INFO(b.err);
  REQUIRE(b.exit_code == 0);
  // As if the run had died right after step 3's save.
  fs::remove_all(step_dir(parts, 6));
  std::ofstream(parts / "latest") << step_dir(parts, 3).filename().string() << "\n";
  RunResult c = run_booster(train + " --set train.checkpoint_every=6 --set train.checkpoint_dir=" + parts.string() +
                            " --resume " + step_dir(parts, 3).string());
  INFO(c.err);
  REQUIRE(c.exit_code == 0);
  const json got = json::parse(c.out.substr(c.out.rfind('{'))), want = json::parse(a.out.substr(a.out.rfind('{')));
  CHECK(got["resumed_from"] == step_dir(parts, 3).string());
  CHECK(got["final_loss"] == want["final_loss"]);
  CHECK(final_state(step_dir(parts, 6)) == final_state(step_dir(whole, 6)));
  return step_dir(whole, 6);
}

}  // namespace

TEST_CASE("lora section: each mistake is one line naming the key", "[cli][lora]") {
  auto refused = [](const std::string& name, const json& lora, const std::vector<std::string>& want) {
    json c = lora_config();
    c["lora"] = lora;
    check_refused(run_booster("check --config " + write_config(name + ".json", c).string()), want);
  };
  refused("r0", {{"r", 0}}, {"'lora.r'", "0"});
  refused("alpha0", {{"alpha", 0}}, {"'lora.alpha'"});
  refused("dropout1", {{"dropout", 1.0}}, {"'lora.dropout'"});
  refused("rank", {{"rank", 8}}, {"unknown key 'lora.rank'", "'r'"});
  refused("no_targets", {{"target_modules", json::array()}}, {"'lora.target_modules' is []"});
  refused("dotted", {{"target_modules", {"self_attn.q_proj"}}}, {"'lora.target_modules[0]'", "last part"});
  refused("twice", {{"target_modules", {"q_proj", "q_proj"}}}, {"'lora.target_modules[1]'", "twice"});
  // A name the model has no Linear of: the names it has.
  refused("absent", {{"target_modules", {"query"}}}, {"'lora.target_modules'", "q_proj", "down_proj"});
  refused("not_object", 8, {"'lora'"});
  // The same mistake stops train before it starts.
  json c = lora_config();
  c["lora"]["target_modules"] = {"query"};
  check_refused(run_booster("train --config " + write_config("absent_train.json", c).string()),
                {"'lora.target_modules'", "q_proj"});
}

TEST_CASE("booster check counts the parameters LoRA trains", "[cli][lora]") {
  // Per layer: q_proj A [4, 32] + B [32, 4], v_proj A [4, 32] + B [16, 4] (2 key/value heads of 8) =
  // 448; 2 layers: 896. The base: embeddings 64 x 32, per layer q 32x32, k and v 16x32, o 32x32, gate,
  // up and down 48x32, two norms of 32 (7,744), the final norm 32 and the head 64 x 32: 19,616.
  RunResult r = run_booster("check --config " + write_config("count.json", lora_config()).string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.err.find("lora: 4 Linears adapted (q_proj, v_proj), 896 trainable of 20,512 parameters (4.37%)") !=
        std::string::npos);
  CHECK(json::parse(r.out)["lora"]["alpha"] == 8.0);
  // Left out, the section is null and check says nothing of LoRA.
  json full = lora_config();
  full.erase("lora");
  r = run_booster("check --config " + write_config("full.json", full).string());
  REQUIRE(r.exit_code == 0);
  CHECK(json::parse(r.out)["lora"].is_null());
  CHECK(r.err.find("lora:") == std::string::npos);
}

TEST_CASE("a LoRA checkpoint holds the adapters only and resumes to the same bytes", "[cli][lora][checkpoint]") {
  const fs::path fp32 = check_resume_is_exact("fp32", lora_config());
  // The model file: the 8 adapters; the optimizer: their state only, named.
  CHECK(tensor_names(fp32 / "model" / "model.safetensors") == adapter_names());
  const json meta = json::parse(read_text(fp32 / "optimizer" / "optimizer.json"));
  std::set<std::string> named;
  for (const json& n : meta.at("param_names")) named.insert(n.get<std::string>());
  CHECK(named == adapter_names());
  for (const std::string& key : tensor_names(fp32 / "optimizer" / "optimizer.safetensors")) {
    INFO(key);
    CHECK(std::regex_match(key, std::regex(R"(state\.[0-7]\.(exp_avg|exp_avg_sq|step))")));
  }
  const json state = json::parse(read_text(fp32 / "trainer_state.json"));
  CHECK(std::regex_match(state.at("lora").at("base_digest").get<std::string>(), std::regex("[0-9a-f]{16}")));
  CHECK(state.at("lora").at("config").at("r") == 4);

  // Strategies that keep float32 masters keep them of the adapters only (8 tensors), not of the base.
  for (const auto& [name, precision] :
       std::vector<std::pair<std::string, json>>{{"bf16_pure", {{"name", "bf16"}, {"pure", true}}},
                                                 {"apex_O2", {{"name", "fp16_apex"}, {"opt_level", "O2"}}}}) {
    const fs::path dir = check_resume_is_exact(name, lora_config(precision));
    INFO(name);
    CHECK(tensor_names(dir / "model" / "model.safetensors") == adapter_names());
    const std::set<std::string> masters = tensor_names(dir / "optimizer" / "precision.safetensors");
    size_t master_count = 0;
    for (const std::string& key : masters) master_count += key.rfind("master_weights.", 0) == 0;
    CHECK(master_count == 8);
    // The base is the same digest under every strategy: it is taken before the strategy converts it.
    CHECK(json::parse(read_text(dir / "trainer_state.json")).at("lora").at("base_digest") ==
          state.at("lora").at("base_digest"));
  }
}

TEST_CASE("a LoRA checkpoint of ZeRO-3 in bf16 on 2 processes resumes to the same bytes", "[cli][lora][checkpoint][mpi]") {
  const json zero3 = {{"name", "low_level_zero"}, {"stage", 3}, {"precision", "bf16"}};
  const fs::path dir = check_resume_is_exact("zero3", lora_config("fp32", zero3), "run -n 2 -- booster ");
  CHECK(tensor_names(dir / "model" / "model.safetensors") == adapter_names());
  size_t masters = 0;
  for (const std::string& key : tensor_names(dir / "optimizer" / "optimizer.safetensors"))
    masters += key.find(".master_weight") != std::string::npos;
  CHECK(masters == 8);
}

TEST_CASE("a LoRA checkpoint is refused on another base, LoRA config or a full run", "[cli][lora][checkpoint]") {
  // Two bases: one full step from seeds 3 (the LoRA run's) and 4.
  json full = lora_config();
  full.erase("lora");
  full["train"]["max_steps"] = 1;
  const fs::path full_cfg = write_config("base.json", full);
  for (int seed : {3, 4}) {
    const fs::path root = scratch_dir() / ("base" + std::to_string(seed));
    fs::remove_all(root);
    RunResult r = run_booster("train --config " + full_cfg.string() + " --set train.seed=" + std::to_string(seed) +
                              " --set train.checkpoint_every=1 --set train.checkpoint_dir=" + root.string());
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
  }
  const fs::path root = scratch_dir() / "adapters_on_base1";
  fs::remove_all(root);
  const std::string train = "train --config " + write_config("on_base.json", lora_config()).string() +
                            " --set train.checkpoint_every=3 --set train.max_steps=3 --set train.checkpoint_dir=" +
                            root.string();
  const std::string base1 = " --set model.init_from=" + step_dir(scratch_dir() / "base3", 1).string() + "/model";
  const std::string base2 = " --set model.init_from=" + step_dir(scratch_dir() / "base4", 1).string() + "/model";
  RunResult r = run_booster(train + base1);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const std::string digest =
      json::parse(read_text(step_dir(root, 3) / "trainer_state.json")).at("lora").at("base_digest").get<std::string>();
  const std::string resume = " --resume " + step_dir(root, 3).string();
  // The same base resumes.
  CHECK(run_booster(train + base1 + resume).exit_code == 0);
  // Another base: both digests named.
  r = run_booster(train + base2 + resume);
  check_refused(r, {"digest is \"" + digest + "\"", "but this run's base has \""});
  // Another LoRA config: the key.
  check_refused(run_booster(train + base1 + resume + " --set lora.alpha=16"),
                {"lora.alpha 8.0", "this run has 16", "--set lora.alpha=8.0"});
  // A full run from the adapters' checkpoint, and a LoRA run from a full checkpoint.
  check_refused(run_booster(train + base1 + resume + " --set lora=null"), {"holds LoRA adapters only"});
  check_refused(run_booster(train + " --set train.max_steps=1 --resume " + step_dir(scratch_dir() / "base3", 1).string()),
                {"checkpoint of the whole model", "model.init_from="});
}

TEST_CASE("lora.init_from starts the adapters from a PEFT directory, its settings where the config has none",
          "[cli][lora][peft]") {
  // The PEFT fixture (tests/fixtures/peft/make_peft_fixture.py): r 4, alpha 8, q_proj, v_proj and
  // down_proj of the tiny Hugging Face Llama (hidden 16, 2 key/value heads of 4, intermediate 32, 2
  // layers). Per layer: q A [4, 16] + B [16, 4] (128), v A [4, 16] + B [8, 4] (96), down A [4, 32] +
  // B [16, 4] (192): 416; 2 layers: 832, beside the base's 6,224.
  const std::string fixtures = BOOSTER_FIXTURE_DIR;
  json c = lora_config();
  c["model"] = {{"type", "hf"}, {"path", fixtures + "/hf/llama"}};
  c["lora"] = {{"init_from", fixtures + "/peft/llama"}};
  const fs::path cfg = write_config("peft.json", c);
  RunResult r = run_booster("check --config " + cfg.string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.err.find("lora: 6 Linears adapted (down_proj, q_proj, v_proj), 832 trainable of 7,056") != std::string::npos);
  const fs::path root = scratch_dir() / "from_peft";
  fs::remove_all(root);
  r = run_booster("train --config " + cfg.string() + " --set train.max_steps=1 --set train.checkpoint_every=1 --set "
                  "train.checkpoint_dir=" + root.string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const json saved = json::parse(read_text(step_dir(root, 1) / "trainer_state.json")).at("lora").at("config");
  CHECK(saved.at("r") == 4);
  CHECK(saved.at("alpha") == 8.0);
  // A setting that differs from the adapter's is refused naming both.
  c["lora"]["r"] = 8;
  r = run_booster("train --config " + write_config("peft_r8.json", c).string());
  check_refused(r, {"lora.r", "8", "4"});
}

TEST_CASE("booster eval of a LoRA checkpoint gives the validation loss its run reported", "[cli][lora][checkpoint]") {
  json c = lora_config();
  c["data"]["val_path"] = token_file().string();
  const fs::path cfg = write_config("eval.json", c), root = scratch_dir() / "eval";
  fs::remove_all(root);
  RunResult r = run_booster("train --config " + cfg.string() + " --set train.checkpoint_every=6 --set "
                            "train.checkpoint_dir=" + root.string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const json trained = json::parse(r.out.substr(r.out.rfind('{')));
  r = run_booster("eval --config " + cfg.string() + " --checkpoint " + step_dir(root, 6).string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const json evaluated = json::parse(r.out.substr(r.out.rfind('{')));
  CHECK(evaluated.at("lora_adapters") == true);
  CHECK(evaluated.at("val_loss") == trained.at("val_loss"));
  // Without the run's lora section there is no model to put the adapters on.
  check_refused(run_booster("eval --config " + cfg.string() + " --checkpoint " + step_dir(root, 6).string() +
                            " --set lora=null"),
                {"holds LoRA adapters only", "lora section"});
}

TEST_CASE("a LoRA checkpoint resumes under another precision and on another layout", "[cli][lora][checkpoint]") {
  // The digest is of the base as given, before a strategy converts it, so neither move changes it; the
  // adapters and their state carry over (Note [Resuming under another precision], [Resuming across layouts]).
  const fs::path root = scratch_dir() / "moves";
  fs::remove_all(root);
  const std::string train = "train --config " + write_config("moves.json", lora_config()).string() +
                            " --set train.checkpoint_dir=" + root.string();
  RunResult r = run_booster(train + " --set train.checkpoint_every=3");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const std::string step3 = step_dir(root, 3).string();
  r = run_booster(train + " --set mixed_precision='{\"name\":\"bf16\",\"pure\":true}' --resume " + step3);
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK(r.err.find("resumed under") != std::string::npos);
  r = run_booster("run -n 2 -- booster " + train + " --set data.batch_size=2 --set "
                  "plugin='{\"name\":\"low_level_zero\",\"stage\":2,\"precision\":\"fp32\"}' --resume " + step3);
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK(r.err.find("resumed on 2 processes") != std::string::npos);
}

TEST_CASE("a LoRA checkpoint of hybrid_parallel tp 2 and pp 2 evaluates on 1 process", "[cli][lora][checkpoint][mpi]") {
  // The adapters are saved gathered under the whole model's names and the digest is the whole base's
  // (Note [LoRA under tensor parallelism] in nn/lora.cpp), so one process takes them up. (A hybrid run
  // resumes on its own layout only: its optimizer state is per rank.) The validation loss is the run's
  // within the roundoff of the model's reductions (Note [Roundoff bounds] in tests/roundoff.h): the split
  // model sums in another order.
  for (const auto& [name, plugin] : std::vector<std::pair<std::string, json>>{
           {"hybrid_tp", {{"name", "hybrid_parallel"}, {"tp_size", 2}, {"pp_size", 1}}},
           {"hybrid_pp", {{"name", "hybrid_parallel"}, {"tp_size", 1}, {"pp_size", 2}, {"num_microbatches", 2}}}}) {
    INFO(name);
    const fs::path root = scratch_dir() / name;
    fs::remove_all(root);
    json c = lora_config("fp32", plugin);
    c["lora"]["target_modules"] = {"q_proj", "o_proj", "up_proj", "down_proj"};  // both splits
    c["data"]["val_path"] = token_file().string();
    const fs::path cfg = write_config(name + ".json", c);
    RunResult r = run_booster("run -n 2 -- booster train --config " + cfg.string() +
                              " --set train.checkpoint_every=6 --set train.checkpoint_dir=" + root.string());
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    const json trained = json::parse(r.out.substr(r.out.rfind('{')));
    r = run_booster("eval --config " + cfg.string() + " --set plugin=single --checkpoint " + step_dir(root, 6).string());
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    const json evaluated = json::parse(r.out.substr(r.out.rfind('{')));
    CHECK(evaluated.at("lora_adapters") == true);
    const double got = evaluated.at("val_loss").get<double>(), want = trained.at("val_loss").get<double>();
    namespace ro = ::testing::roundoff;
    const double bound = ro::reduction_bound({ro::llama_forward_length(32, 2, 4, 48, 8, 64, 511)}) * std::abs(want);
    INFO(got << " against " << want << ", bound " << bound);
    CHECK(std::abs(got - want) <= bound);
  }
}
