// A resume under another precision (Note [Resuming under another precision] in
// booster/booster/state.cpp), checked value for value: whichever place the saved run kept its float32
// weights (the model itself, the precision SDK's masters, a ZeRO optimizer's per-parameter masters),
// the resumed run holds exactly those as its float32 weights, its 16-bit model holds their rounding,
// and the optimizer's moments are the saved ones. The resumed run is saved again at once and both
// checkpoints are read back through the safetensors reader, so the comparison goes through the file
// format, not through the code under test.
#include <unistd.h>

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/booster/booster.h"
#include "booster/checkpoint/atomic_file.h"
#include "booster/checkpoint/checkpoint.h"
#include "booster/checkpoint/safetensors.h"
#include "booster/data/synthetic.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/optim/optimizer.h"

using namespace booster;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr int64_t kIn = 12, kClasses = 3, kBatch = 16;

struct Setup {
  std::string label;  // what the resume line names
  BoosterConfig config;
  // Where the float32 weights are in its checkpoint: "model", "precision" (master_weights.0.<i>) or
  // "optimizer" (state.<i>.master_weight).
  std::string weights_in;
  DType param_dtype = DType::Float32;
};

Setup fp32() { return {"fp32", BoosterConfig{}, "model"}; }
Setup torch_fp16() { return {"fp16", BoosterConfig{.mixed_precision = "fp16"}, "model"}; }
Setup naive() { return {"fp16_naive", BoosterConfig{.mixed_precision = "fp16_naive"}, "precision", DType::Float16}; }
Setup zero(const std::string& precision, DType dtype, int stage = 2) {
  BoosterConfig c;
  c.plugin = "low_level_zero";
  c.plugin_options = {{"precision", precision}, {"stage", stage}, {"initial_scale", 65536}};
  return {"low_level_zero (" + precision + ")", c, "optimizer", dtype};
}

// With two_groups, the optimizer holds the biases first in a group of their own (another lr, no weight
// decay) and the weights second, so a parameter's place in its group differs from its global index.
Boosted boost_mlp(Booster& booster, bool two_groups = false) {
  auto model = std::make_shared<nn::MLPClassifier>(kIn, std::vector<int64_t>{24}, kClasses, "relu", 7);
  std::shared_ptr<optim::Optimizer> optimizer;
  if (two_groups) {
    std::vector<Tensor> weights, biases;
    for (const auto& [name, p] : model->named_parameters()) (name.ends_with("bias") ? biases : weights).push_back(p);
    optimizer = std::make_shared<optim::AdamW>(
        std::vector<optim::ParamGroup>{{biases, {{"lr", 5e-3}, {"weight_decay", 0.0}}}, {weights, json::object()}},
        json{{"lr", 1e-2}, {"weight_decay", 0.1}});
  } else {
    optimizer = std::make_shared<optim::AdamW>(model->parameters(), json{{"lr", 1e-2}});
  }
  data::DataLoaderOptions o;
  o.batch_size = kBatch;
  o.prefetch = 0;
  auto loader = std::make_shared<data::DataLoader>(data::synthetic_classification(4 * kBatch, kIn, kClasses, 3), o);
  return booster.boost(model, optimizer, [](const Tensor& out, const Tensor& y) { return cross_entropy(out, y); },
                       loader);
}

void train(Booster& booster, Boosted& b, int steps) {
  int done = 0;
  for (data::Batch& batch : *b.dataloader) {
    b.optimizer->zero_grad();
    booster.backward(b.criterion((*b.model)(batch.x), batch.y), *b.optimizer);
    b.optimizer->step();
    if (++done == steps) return;
  }
}

std::map<std::string, Tensor> read(const fs::path& file) {
  if (!fs::exists(file)) return {};
  return checkpoint::read_safetensors(file).tensors;
}

std::vector<std::string> param_names(const fs::path& step_dir) {
  const json meta = json::parse(checkpoint::read_text_file(step_dir / "optimizer" / "optimizer.json"));
  return meta.at("param_names").get<std::vector<std::string>>();
}

// The float32 weights of a checkpoint, by optimizer index, read from where `setup` keeps them (the
// precision SDK's masters by group and place in the group).
std::vector<std::vector<double>> float32_weights(const fs::path& step_dir, const Setup& setup) {
  const std::vector<std::string> names = param_names(step_dir);
  const json meta = json::parse(checkpoint::read_text_file(step_dir / "optimizer" / "optimizer.json"));
  std::vector<std::string> group_key;  // "<g>.<j>" of each global index
  for (size_t g = 0; g < meta.at("param_groups").size(); ++g)
    for (size_t j = 0; j < meta.at("param_groups")[g].at("params").size(); ++j)
      group_key.push_back(std::to_string(g) + "." + std::to_string(j));
  REQUIRE(group_key.size() == names.size());
  const auto model = checkpoint::load_model(step_dir / "model");
  const auto optimizer = read(step_dir / "optimizer" / "optimizer.safetensors");
  const auto precision = read(step_dir / "optimizer" / "precision.safetensors");
  std::vector<std::vector<double>> out;
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string key = setup.weights_in == "model"       ? names[i]
                            : setup.weights_in == "precision" ? "master_weights." + group_key[i]
                                                              : "state." + std::to_string(i) + ".master_weight";
    const auto& from = setup.weights_in == "model" ? model : setup.weights_in == "precision" ? precision : optimizer;
    INFO(key);
    REQUIRE(from.count(key));
    REQUIRE(from.at(key).dtype() == DType::Float32);
    out.push_back(from.at(key).tolist());
  }
  return out;
}

// Every optimizer moment of a checkpoint ("state.<i>.exp_avg", ...), masters left out.
std::map<std::string, std::vector<double>> moments(const fs::path& step_dir) {
  std::map<std::string, std::vector<double>> out;
  for (const auto& [key, t] : read(step_dir / "optimizer" / "optimizer.safetensors"))
    if (key.find("master_weight") == std::string::npos) out[key] = t.tolist();
  return out;
}

}  // namespace

TEST_CASE("hand-over: the float32 weights and moments of one precision are exactly the next one's",
          "[booster][checkpoint][amp]") {
  const fs::path dir = fs::temp_directory_path() / ("booster_test_hand_over_" + std::to_string(getpid()));
  const std::vector<std::pair<Setup, Setup>> changes = {
      {naive(), fp32()},
      {fp32(), naive()},
      {naive(), zero("fp16", DType::Float16)},
      {zero("bf16", DType::BFloat16), naive()},
      {zero("fp16", DType::Float16), zero("bf16", DType::BFloat16)},
      {zero("fp16", DType::Float16), torch_fp16()},
      // Stage 3 keeps the parameters sharded: they are gathered for the hand-over and sharded again.
      {naive(), zero("bf16", DType::BFloat16, 3)},
      {zero("fp16", DType::Float16, 3), fp32()},
  };
  int n = 0;
  for (const auto& [from, to] : changes) {
    INFO(from.label << " -> " << to.label);
    const fs::path saved_root = dir / ("saved_" + std::to_string(n)), again_root = dir / ("again_" + std::to_string(n));
    ++n;
    Booster first(from.config);
    Boosted a = boost_mlp(first);
    train(first, a, 3);
    const fs::path saved = first.save_state(saved_root);

    Booster second(to.config);
    Boosted b = boost_mlp(second);
    // No settings are compared here, so across plugins they need no translating.
    const LoadedState loaded =
        second.load_state(saved_root, {.portable_settings = [](const json& settings, int) { return settings; },
                                       .precision_setting = "mixed_precision"});
    CHECK(loaded.step == 3);
    CHECK(loaded.precision_change == "resumed under " + to.label + " from a checkpoint of " + from.label +
                                         ": float32 weights and optimizer state carry over; the strategy's own "
                                         "state (loss scale, fp8 scaling) starts afresh");
    const fs::path again = second.save_state(again_root);

    // The float32 weights, wherever each side keeps them, are the same values.
    const auto expected = float32_weights(saved, from);
    CHECK(float32_weights(again, to) == expected);
    // The model holds their rounding to its dtype.
    const std::vector<std::string> names = param_names(again);
    const auto model = checkpoint::load_model(again / "model");
    for (size_t i = 0; i < names.size(); ++i) {
      INFO(names[i]);
      const Tensor& p = model.at(names[i]);
      CHECK(p.dtype() == to.param_dtype);
      const Tensor rounded = from_vector(std::vector<float>(expected[i].begin(), expected[i].end()), p.shape())
                                 .to(to.param_dtype);
      CHECK(p.tolist() == rounded.tolist());
    }
    CHECK(moments(again) == moments(saved));
    CHECK(!moments(saved).empty());
  }
  fs::remove_all(dir);
}

// Several parameter groups: each parameter's float32 weight and moments follow it by its global index
// whatever group it is in, and each group keeps its own hyperparameters.
TEST_CASE("hand-over: parameters of several groups keep their own weights, moments and options",
          "[booster][checkpoint][amp]") {
  const fs::path dir = fs::temp_directory_path() / ("booster_test_hand_over_groups_" + std::to_string(getpid()));
  const std::vector<std::pair<Setup, Setup>> changes = {{naive(), fp32()},
                                                        {fp32(), naive()},
                                                        {naive(), zero("fp16", DType::Float16)},
                                                        {zero("bf16", DType::BFloat16, 3), naive()}};
  int n = 0;
  for (const auto& [from, to] : changes) {
    INFO(from.label << " -> " << to.label);
    const fs::path saved_root = dir / ("saved_" + std::to_string(n)), again_root = dir / ("again_" + std::to_string(n));
    ++n;
    Booster first(from.config);
    Boosted a = boost_mlp(first, true);
    train(first, a, 3);
    const fs::path saved = first.save_state(saved_root);
    Booster second(to.config);
    Boosted b = boost_mlp(second, true);
    second.load_state(saved_root, {.portable_settings = [](const json& settings, int) { return settings; },
                                   .precision_setting = "mixed_precision"});
    const fs::path again = second.save_state(again_root);
    // By name: the biases are optimizer parameters 0 and 1 (group 0), the weights 2 and 3 (group 1).
    const std::vector<std::string> names = param_names(again);
    REQUIRE(names == param_names(saved));
    CHECK(names.front().ends_with("bias"));
    const auto want = float32_weights(saved, from), got = float32_weights(again, to);
    for (size_t i = 0; i < names.size(); ++i) {
      INFO(names[i]);
      CHECK(got[i] == want[i]);
    }
    CHECK(moments(again) == moments(saved));
    const json groups_saved = json::parse(checkpoint::read_text_file(saved / "optimizer" / "optimizer.json")).at("param_groups");
    const json groups_again = json::parse(checkpoint::read_text_file(again / "optimizer" / "optimizer.json")).at("param_groups");
    REQUIRE(groups_again.size() == 2);
    for (size_t g = 0; g < 2; ++g) {
      CHECK(groups_again[g].at("lr") == groups_saved[g].at("lr"));
      CHECK(groups_again[g].at("weight_decay") == groups_saved[g].at("weight_decay"));
      CHECK(groups_again[g].at("params") == groups_saved[g].at("params"));
    }
    CHECK(groups_again[0].at("weight_decay") == 0.0);
  }
  fs::remove_all(dir);
}

TEST_CASE("hand-over: a strategy that cannot continue float32 weights is refused before anything loads",
          "[booster][checkpoint][amp]") {
  const fs::path dir = fs::temp_directory_path() / ("booster_test_hand_over_refused_" + std::to_string(getpid()));
  Booster first(BoosterConfig{.mixed_precision = "fp16_naive"});
  Boosted a = boost_mlp(first);
  train(first, a, 2);
  first.save_state(dir);

  Booster o3(BoosterConfig{.mixed_precision = "fp16_apex", .mixed_precision_options = {{"opt_level", "O3"}}});
  Boosted b = boost_mlp(o3);
  const std::vector<double> before = b.model->parameters().front().tolist();
  CHECK_THROWS_WITH(o3.load_state(dir, {.precision_setting = "mixed_precision"}),
                    Catch::Contains("was saved with mixed_precision \"fp16_naive\" but this run has \"fp16_apex O3\", "
                                    "and this run's parameter 'layers.0.weight' is float16 and its strategy keeps no "
                                    "float32 master weights"));
  CHECK(b.model->parameters().front().tolist() == before);
  // Without a precision setting to leave uncompared, any change of strategy is refused.
  Booster plain;
  Boosted c = boost_mlp(plain);
  CHECK_THROWS_WITH(plain.load_state(dir), Catch::Contains("was saved with mixed_precision \"fp16_naive\" but this run "
                                                           "has \"fp32\"; resume with the same strategy"));
  fs::remove_all(dir);
}
