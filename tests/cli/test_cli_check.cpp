// `booster check` on the Llama family, Hugging Face directories and token data, through the program as a
// user runs it (Note [Checking a model before it trains] in core/booster/config/model_check.cpp):
// check refuses what `booster train` would refuse, with train's own one-line message and exit code 2
// (the Llama shard policy's refusals under hybrid_parallel, the sizes make_llama refuses, a Hugging Face
// directory without config.json or weights); a typo in a llama, hf or tokens key gets "did you mean";
// and the memory estimate counts a Llama's parameters as nn::Llama does.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/config/config.h"
#include "booster/nn/hf.h"
#include "booster/nn/llama.h"
#include "booster/nn/model_registry.h"
#include "booster/tensor/deferred.h"
#include "run_booster.h"

namespace fs = std::filesystem;
using nlohmann::json;
using testing::RunResult;
using Catch::Contains;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_check"); }

fs::path fixture_dir(const std::string& name) { return fs::path(BOOSTER_FIXTURE_DIR) / "hf" / name; }

// 4096 uint16 token ids below 48 (the Hugging Face fixtures' vocabulary).
fs::path token_file() {
  const fs::path p = scratch_dir() / "tokens.bin";
  if (fs::exists(p)) return p;
  std::vector<uint16_t> ids;
  for (int i = 0; i < 4096; ++i) ids.push_back(uint16_t((i * 7 + (i / 48) * 3) % 48));
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(ids.data()), std::streamsize(ids.size() * 2));
  return p;
}

// A Llama of 4 query heads over 2 key/value heads, 3 layers: tp 2 splits it, tp 4 would split a
// key/value head.
json llama_model() {
  return {{"type", "llama"},         {"vocab_size", 64},         {"hidden_size", 32},
          {"intermediate_size", 48}, {"num_hidden_layers", 3},   {"num_attention_heads", 4},
          {"num_key_value_heads", 2}};
}

fs::path write_config(const std::string& name, const json& model) {
  const json c = {{"model", model},
                  {"optimizer", {{"type", "sgd"}, {"lr", 0.05}}},
                  {"data", {{"type", "tokens"}, {"path", token_file().string()}, {"dtype", "uint16"}, {"seq_len", 8},
                            {"batch_size", 4}, {"shuffle", false}}},
                  {"train", {{"max_steps", 2}, {"log_every", 1}, {"seed", 3}, {"run_dir", nullptr}}}};
  const fs::path p = scratch_dir() / name;
  std::ofstream(p) << c.dump(2);
  return p;
}

const char* kEnv = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1";

RunResult run_cli(const std::string& args) { return testing::run_booster_in(scratch_dir(), args, kEnv); }

// A refusal as check must give it: exit code 2 and exactly one line on stderr, the error (no
// "compatible" verdict or memory table before it).
void check_refused(const RunResult& r, const std::vector<std::string>& must_contain) {
  INFO("stderr: " << r.err);
  CHECK(r.exit_code == 2);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK(r.err.rfind("booster: error: ", 0) == 0);
  for (const std::string& s : must_contain) CHECK_THAT(r.err, Contains(s));
}

// `booster check` (for `processes` processes, -n) and `booster train` (one process) of the same config and
// arguments: check refuses with exactly the line train refuses with.
void check_refused_as_train(const fs::path& cfg, const std::string& args, const std::vector<std::string>& must_contain,
                            int processes = 1) {
  const RunResult check = run_cli("check --config " + cfg.string() + " " + args + " -n " + std::to_string(processes));
  check_refused(check, must_contain);
  const RunResult train = run_cli("train --config " + cfg.string() + " " + args);
  INFO("train stderr: " << train.err);
  CHECK(train.exit_code == 2);
  CHECK(train.err == check.err);
}

// "memory per rank (world size 1, 27,360 parameters):" -> 27360.
int64_t estimated_parameters(const std::string& err) {
  const std::string marker = "memory per rank (world size ";
  const size_t at = err.find(marker);
  REQUIRE(at != std::string::npos);
  const size_t comma = err.find(", ", at);
  const size_t end = err.find(" parameters", comma);
  REQUIRE((comma != std::string::npos && end != std::string::npos));
  std::string digits;
  for (char ch : err.substr(comma + 2, end - comma - 2))
    if (ch != ',') digits += ch;
  return std::stoll(digits);
}

// The bytes of a line of the memory table ("  activations  llama, ...  238.0 KiB").
double table_bytes(const std::string& err, const std::string& what) {
  std::istringstream in(err);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("  " + what, 0) != 0) continue;
    std::istringstream words(line);
    std::vector<std::string> w;
    for (std::string s; words >> s;) w.push_back(s);
    REQUIRE(w.size() >= 2);
    const std::string unit = w.back();
    const double value = std::stod(w[w.size() - 2]);
    const double scale = unit == "KiB" ? 1024.0 : unit == "MiB" ? 1024.0 * 1024 : unit == "GiB" ? 1024.0 * 1024 * 1024 : 1.0;
    return value * scale;
  }
  FAIL("no line '" << what << "' in: " << err);
  return 0;
}

// A model's parameters as the library builds it (deferred: counted, never allocated).
int64_t built_parameters(const json& model) {
  booster::LazyInitGuard lazy;
  return booster::nn::make_model(model, 0)->num_parameters();
}

}  // namespace

TEST_CASE("booster check refuses the Llama splits the shard policy refuses, with train's message and exit code 2",
          "[cli][check][llama][hybrid]") {
  const fs::path cfg = write_config("llama.json", llama_model());
  const std::string hybrid = "-p hybrid_parallel ";

  // tp 4 would split the 2 key/value heads: the Llama shard policy's refusal, word for word as train's.
  check_refused_as_train(cfg, hybrid + "--set plugin.tp_size=4",
                         {"shard policy 'Llama': tensor parallel size 4", "the key/value heads (2)",
                          "each rank must hold whole key/value heads", "tp sizes that work for this model: [1, 2]"}, 4);
  // Under 4 processes train stops with the same reason.
  if (testing::have_mpirun()) {
    const RunResult r = run_cli("run -n 4 -- " + std::string(BOOSTER_BIN_DIR) + "/booster train --config " + cfg.string() +
                                " " + hybrid + "--set plugin.tp_size=4");
    INFO(r.err);
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Contains("each rank must hold whole key/value heads"));
  }
  // tp 2 splits whole heads: check passes and prints the resolved plugin.
  {
    const RunResult r = run_cli("check --config " + cfg.string() + " " + hybrid + "--set plugin.tp_size=2 -n 2");
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(json::parse(r.out).at("plugin").at("tp_size") == 2);
  }
  // Tied embeddings cannot be cut into pipeline stages.
  check_refused_as_train(cfg, hybrid + "--set plugin.pp_size=2 --set model.tie_word_embeddings=true",
                         {"shard policy 'Llama': tie_word_embeddings", "use pp_size 1"}, 2);
  // stage_layers that do not add up to the 3 layers.
  check_refused_as_train(cfg, hybrid + "--set plugin.pp_size=2 --set 'plugin.stage_layers=[2,2]'",
                         {"stage_layers [2, 2]", "together the model's 3"}, 2);
  // The pipeline cut: 3 layers reach 5 stages (the first holds the embedding, the last the head), not 6,
  // where a middle stage would hold nothing to train.
  CHECK(run_cli("check --config " + cfg.string() + " " + hybrid + "--set plugin.pp_size=5 -n 5").exit_code == 0);
  check_refused_as_train(cfg, hybrid + "--set plugin.pp_size=6",
                         {"pp_size 6", "pipeline stage 4 of 6 would hold no parameters", "3 layers",
                          "at most the layers + 2 (5)"}, 6);

  // The sizes make_llama refuses, refused by check before its verdict, as train refuses them.
  check_refused_as_train(cfg, "--set model.num_key_value_heads=3",
                         {"\"num_attention_heads\" 4 must be divisible by \"num_key_value_heads\" 3"});
  check_refused_as_train(cfg, "--set model.hidden_size=30", {"\"hidden_size\" 30 must be divisible by \"num_attention_heads\" 4"});
  check_refused_as_train(cfg, "--set model.hidden_size=36", {"= 9 must be even", "rotary"});
  // Sequences longer than the model's positions.
  check_refused_as_train(cfg, "--set model.max_position_embeddings=4",
                         {"'data.seq_len' is 8", "at most 4 positions", "'model.max_position_embeddings'"});
}

TEST_CASE("checking a 1.1B-parameter Llama split tp 2 x pp 2 takes no memory for its weights", "[check][llama][hybrid]") {
  // The model and every stage's part stand for their shapes (ShapesOnlyGuard): nothing drawn, nothing
  // allocated, however large the model, where the split of slices used to allocate a quarter of the
  // model (a 7B Llama: 6.7 GB and three minutes) before train had started any process.
  json model = {{"type", "llama"},         {"vocab_size", 32000},         {"hidden_size", 2048},
                {"intermediate_size", 5632}, {"num_hidden_layers", 16},   {"num_attention_heads", 16},
                {"num_key_value_heads", 16}, {"max_position_embeddings", 2048}};
  json c = json::parse(std::ifstream(write_config("llama_1b.json", model)));
  c["plugin"] = {{"name", "hybrid_parallel"}, {"tp_size", 2}, {"pp_size", 2}};
  const size_t before = booster::cpu_bytes_in_use();
  booster::reset_cpu_peak_bytes();
  const json resolved = booster::config::resolve(c);  // runs check_model: builds the model and splits it
  CHECK(resolved.at("plugin").at("tp_size") == 2);
  CHECK(booster::cpu_peak_bytes() - before < size_t(1) << 20);  // the weights would be 4.4 GB
}

TEST_CASE("booster check reads a Hugging Face directory's config.json and names missing files as train does",
          "[cli][check][hf]") {
  // The fixture itself passes, its sizes read from config.json.
  {
    const RunResult r = run_cli("check --config " +
                                write_config("hf.json", {{"type", "hf"}, {"path", fixture_dir("llama").string()}}).string());
    INFO(r.err);
    CHECK(r.exit_code == 0);
  }
  // No config.json.
  const fs::path no_config = scratch_dir() / "no_config";
  fs::remove_all(no_config);
  fs::copy(fixture_dir("llama"), no_config, fs::copy_options::recursive);
  fs::remove(no_config / "config.json");
  check_refused_as_train(write_config("no_config.json", {{"type", "hf"}, {"path", no_config.string()}}), "",
                         {no_config.string(), "no config.json"});
  // config.json without weights.
  const fs::path no_weights = scratch_dir() / "no_weights";
  fs::remove_all(no_weights);
  fs::create_directories(no_weights);
  fs::copy(fixture_dir("llama") / "config.json", no_weights / "config.json");
  check_refused_as_train(write_config("no_weights.json", {{"type", "hf"}, {"path", no_weights.string()}}), "",
                         {"holds neither model.safetensors nor model.safetensors.index.json"});
  // An index naming a shard that is not there.
  const fs::path no_shard = scratch_dir() / "no_shard";
  fs::remove_all(no_shard);
  fs::copy(fixture_dir("llama"), no_shard, fs::copy_options::recursive);
  fs::remove(no_shard / "model-00002-of-00004.safetensors");
  check_refused_as_train(write_config("no_shard.json", {{"type", "hf"}, {"path", no_shard.string()}}), "",
                         {"model-00002-of-00004.safetensors", "which is missing"});
  // Under hybrid_parallel the directory's Llama goes through the same shard policy: its 2 key/value
  // heads do not split 4 ways.
  check_refused_as_train(write_config("hf_tp.json", {{"type", "hf"}, {"path", fixture_dir("llama").string()}}),
                         "-p hybrid_parallel --set plugin.tp_size=4",
                         {"shard policy 'Llama': tensor parallel size 4", "the key/value heads (2)"}, 4);
}

TEST_CASE("booster check catches a typo in a llama, hf or tokens key with did you mean", "[cli][check][llama][hf]") {
  const fs::path cfg = write_config("llama_keys.json", llama_model());
  check_refused_as_train(cfg, "--set model.num_key_value_head=2",
                         {"unknown key 'model.num_key_value_head'; did you mean 'num_key_value_heads'?"});
  check_refused(run_cli("check --config " + cfg.string() + " --set model.rope_theata=500000"),
                {"unknown key 'model.rope_theata'; did you mean 'rope_theta'?"});
  check_refused(run_cli("check --config " + cfg.string() + " --set model.tie_word_embeddings=yes"),
                {"'model.tie_word_embeddings' is \"yes\"; expected a boolean"});
  check_refused(run_cli("check --config " + cfg.string() + " --set data.seq_length=16"),
                {"unknown key 'data.seq_length'; did you mean 'seq_len'?"});
  const fs::path hf = write_config("hf_keys.json", {{"type", "hf"}, {"path", fixture_dir("llama").string()}});
  check_refused(run_cli("check --config " + hf.string() + " --set model.activation_checkpoint=true"),
                {"unknown key 'model.activation_checkpoint'; did you mean 'activation_checkpointing'?"});
  // A gpt2 directory's dropout is a key of the table; a Llama directory refuses it as train does.
  check_refused_as_train(hf, "--set model.dropout=0.1", {"'model.dropout' is not an option of a Hugging Face llama model"});

  // The resolved config shows the defaults the run uses: key/value heads as many as the query heads when
  // not given, Hugging Face's LlamaConfig defaults; an hf model without dropout unless set.
  json given = llama_model();
  given.erase("num_key_value_heads");
  RunResult r = run_cli("check --config " + write_config("llama_defaults.json", given).string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const json model = json::parse(r.out).at("model");
  CHECK(model.at("num_key_value_heads") == 4);
  CHECK(model.at("max_position_embeddings") == 2048);
  CHECK(model.at("rope_theta") == 10000.0);
  CHECK(model.at("rms_norm_eps") == 1e-6);
  CHECK(model.at("tie_word_embeddings") == false);
  r = run_cli("check --config " + hf.string());
  REQUIRE(r.exit_code == 0);
  CHECK(json::parse(r.out).at("model") ==
        json{{"type", "hf"}, {"path", fixture_dir("llama").string()}, {"activation_checkpointing", false}, {"init_from", nullptr}});
}

TEST_CASE("booster check's memory estimate counts a Llama's parameters as nn::Llama does", "[cli][check][llama][memory]") {
  struct Case {
    const char* what;
    json changes;
  };
  const std::vector<Case> cases = {
      {"grouped-query, untied", json::object()},
      {"multi-head, tied", {{"num_key_value_heads", 4}, {"tie_word_embeddings", true}}},
      {"multi-query, wider", {{"hidden_size", 64}, {"intermediate_size", 172}, {"num_attention_heads", 8},
                              {"num_key_value_heads", 1}, {"num_hidden_layers", 2}, {"vocab_size", 100}}},
      {"checkpointed", {{"activation_checkpointing", true}}},
  };
  double plain_activations = 0;
  for (const Case& c : cases) {
    INFO(c.what);
    json model = llama_model();
    model.update(c.changes);
    const RunResult r = run_cli("check --config " + write_config("llama_memory.json", model).string());
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(estimated_parameters(r.err) == built_parameters(model));
    // Its activations are estimated too, and no model was built to count it.
    CHECK_THAT(r.err, Contains("activations      llama, batch 4 x 8 tokens"));
    CHECK_THAT(r.err, !Contains("was built (deferred)"));
    const double activations = table_bytes(r.err, "activations");
    CHECK(activations > 0);
    if (c.changes.empty()) plain_activations = activations;
    if (c.changes.contains("activation_checkpointing")) {
      CHECK_THAT(r.err, Contains("layers checkpointed"));
      CHECK(activations < plain_activations);
    }
  }
  // A Hugging Face directory is counted from its config.json, as the model load_pretrained builds.
  for (const char* family : {"llama", "llama_tied_bf16", "gpt2", "gpt2_untied_bf16"}) {
    INFO(family);
    const json model = {{"type", "hf"}, {"path", fixture_dir(family).string()}};
    const RunResult r = run_cli("check --config " + write_config("hf_memory.json", model).string());
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(estimated_parameters(r.err) == built_parameters(model));
    CHECK_THAT(r.err, !Contains("was built (deferred)"));
    CHECK_THAT(r.err, !Contains("not estimated"));
  }
  // Under hybrid_parallel tp 2 a rank holds half.
  const RunResult r = run_cli("check --config " + write_config("llama_tp.json", llama_model()).string() +
                              " -p hybrid_parallel --set plugin.tp_size=2 -n 2");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const int64_t n = built_parameters(llama_model());
  CHECK(estimated_parameters(r.err) == n);
  CHECK(table_bytes(r.err, "parameters") == Approx(double((n + 1) / 2 * 4)).epsilon(0.01));
}

// ------------------------------------------------------------------------------ models from a library
// A model from a model library (tests/models/toy) on synthetic data of `features` and `classes`.
namespace {
const std::string kToy = std::string(BOOSTER_TEST_MODEL_DIR) + "/libbooster_model_toy.so";

fs::path write_toy_config(const std::string& name, int64_t features, int64_t classes, const json& plugin) {
  const json c = {{"model", {{"type", "toy_mlp"}, {"library", kToy}, {"in", 8}, {"hidden", 16}, {"classes", 3}}},
                  {"optimizer", {{"type", "sgd"}, {"lr", 0.05}}},
                  {"plugin", plugin},
                  {"data", {{"type", "synthetic"}, {"num_samples", 64}, {"num_test_samples", 16},
                            {"num_features", features}, {"num_classes", classes}, {"batch_size", 16}}},
                  {"train", {{"max_steps", 2}, {"seed", 3}, {"run_dir", nullptr}}}};
  const fs::path p = scratch_dir() / name;
  std::ofstream(p) << c.dump(2);
  return p;
}
}  // namespace

// hybrid_parallel looks the model's shard policy up by its class at boost(); check (and train, which
// resolves the config first) find it missing before any process starts, with the plugin's message.
TEST_CASE("booster check: a library model without a shard policy under tp or pp is refused as train refuses it",
          "[cli][check][models]") {
  for (const json& plugin : {json{{"name", "hybrid_parallel"}, {"tp_size", 2}},
                             json{{"name", "hybrid_parallel"}, {"pp_size", 2}}}) {
    INFO(plugin.dump());
    const fs::path cfg = write_toy_config("toy_split.json", 8, 3, plugin);
    check_refused_as_train(cfg, "", {"needs a shard policy for the model 'ToyMLP'", "register_shard_policy"}, 2);
  }
  // Data parallel only: nothing is split, so no policy is needed.
  const RunResult r =
      run_cli("check --config " + write_toy_config("toy_dp.json", 8, 3, {{"name", "hybrid_parallel"}}).string() + " -n 2");
  INFO(r.err);
  CHECK(r.exit_code == 0);
}

// Note [A trial forward of a library model] (core/booster/config/model_check.cpp): a library model's
// input width and classes are its own keys, so check runs one forward on two samples and reports the
// mismatch with the error (type, exit code, words) train's first step gives; the layer is named by its
// path (Note [Errors name the module]).
TEST_CASE("booster check: a library model whose input or classes do not fit the data fails as train's first step",
          "[cli][check][models]") {
  // 10 features for a model of 8 inputs: fc1 refuses the batch (2 rows in check, 16 in train).
  const fs::path wide = write_toy_config("toy_wide.json", 10, 3, {{"name", "single"}});
  const RunResult check = run_cli("check --config " + wide.string());
  const RunResult train = run_cli("train --config " + wide.string());
  INFO("check: " << check.err << "\ntrain: " << train.err);
  CHECK(check.exit_code == 1);
  CHECK(train.exit_code == check.exit_code);
  CHECK(std::count(check.err.begin(), check.err.end(), '\n') == 1);
  CHECK(check.err == "booster: error: fc1 (Linear): expected input [..., 8], got shape [2, 10]\n");
  CHECK_THAT(train.err, Contains("booster: error: fc1 (Linear): expected input [..., 8], got shape [16, 10]\n"));
  // 5 classes for a model of 3 outputs: the criterion refuses the largest target, which check includes.
  const fs::path classes = write_toy_config("toy_classes.json", 8, 5, {{"name", "single"}});
  const RunResult check_classes = run_cli("check --config " + classes.string());
  const RunResult train_classes = run_cli("train --config " + classes.string());
  INFO("check: " << check_classes.err << "\ntrain: " << train_classes.err);
  CHECK(check_classes.exit_code == 1);
  CHECK(train_classes.exit_code == check_classes.exit_code);
  CHECK(std::count(check_classes.err.begin(), check_classes.err.end(), '\n') == 1);
  for (const RunResult* r : {&check_classes, &train_classes})
    CHECK_THAT(r->err, Contains("booster: error: cross_entropy: target ") && Contains("is out of bounds for 3 classes"));
  // A library model that fits passes, printing the config.
  const RunResult fits = run_cli("check --config " + write_toy_config("toy_fits.json", 8, 3, {{"name", "single"}}).string());
  INFO(fits.err);
  CHECK(fits.exit_code == 0);
  CHECK_THAT(fits.out, Contains("\"toy_mlp\""));
}

TEST_CASE("booster check: a library model too large for this machine's memory is not built for the trial forward",
          "[cli][check][models]") {
  // The toy model's 780 bytes of parameters against 1000 bytes available (a test hook standing in for
  // MemAvailable): more than half, so check counts it deferred and says it skipped the forward, where
  // building it would take the memory a large model needs. The data does not fit the model (10
  // features for 8 inputs), which only the skipped forward would have found.
  const fs::path wide = write_toy_config("toy_wide_big.json", 10, 3, {{"name", "single"}});
  const RunResult skipped =
      testing::run_booster_in(scratch_dir(), "check --config " + wide.string(), std::string(kEnv) + " BOOSTER_TEST_MEM_AVAILABLE=1000");
  INFO(skipped.err);
  CHECK(skipped.exit_code == 0);
  CHECK_THAT(skipped.err, Contains("booster: the trial forward of the library model was skipped: its parameters take "
                                   "780 bytes, more than half of the 1000 bytes this machine has available"));
  const RunResult ran =
      testing::run_booster_in(scratch_dir(), "check --config " + wide.string(), std::string(kEnv) + " BOOSTER_TEST_MEM_AVAILABLE=2000");
  CHECK(ran.exit_code == 1);
  CHECK_THAT(ran.err, Contains("fc1 (Linear): expected input [..., 8], got shape [2, 10]"));
}

