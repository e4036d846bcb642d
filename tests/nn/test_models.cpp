// Models by name: the registry behind make_model (built-ins, a program's own models) and model
// libraries loaded like plugins (tests/models/toy, tests/models/bad_abi, built into build/test_models/):
// the ABI and kind checks, errors crossing the boundary, the library's lifetime, and the config schema
// that lets a library model's keys through while it keeps the built-ins strict.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "plugin_path_guard.h"
#include "booster/autograd/autograd.h"
#include "booster/common/error.h"
#include "booster/config/config.h"
#include "booster/nn/linear.h"
#include "booster/nn/model_registry.h"
#include "booster/nn/models.h"
#include "booster/ops/ops.h"
#include "booster/plugin/loader.h"

using namespace booster;
using Catch::Matchers::Contains;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

const std::string kToy = std::string(BOOSTER_TEST_MODEL_DIR) + "/libbooster_model_toy.so";
const std::string kBadAbi = std::string(BOOSTER_TEST_MODEL_DIR) + "/libbooster_model_bad_abi.so";

bool is_mapped(const std::string& file) {
  std::ifstream maps("/proc/self/maps");
  const std::string canonical = fs::canonical(file).string();
  std::string line;
  while (std::getline(maps, line))
    if (line.find(canonical) != std::string::npos) return true;
  return false;
}

using testing::PluginPathGuard;

json toy(const std::string& library = kToy) {
  return {{"type", "toy_mlp"}, {"library", library}, {"in", 6}, {"hidden", 5}, {"classes", 3}};
}

json run_config(const json& model) {
  return {{"model", model},
          {"optimizer", {{"type", "sgd"}, {"lr", 0.1}}},
          {"data", {{"type", "synthetic"}, {"num_features", 6}, {"num_classes", 3}}}};
}

}  // namespace

TEST_CASE("models: the built-ins are registered, and a program registers its own", "[models]") {
  const std::vector<std::string> builtins = nn::builtin_models();
  CHECK(builtins == std::vector<std::string>{"mlp", "linear", "gpt", "cnn", "llama", "mistral", "qwen2", "hf"});
  const std::vector<std::string> all = nn::registered_models();
  REQUIRE(all.size() >= builtins.size());
  CHECK(std::vector<std::string>(all.begin(), all.begin() + std::ptrdiff_t(builtins.size())) == builtins);

  auto linear = nn::make_model({{"type", "linear"}, {"in", 4}, {"classes", 3}}, 1);
  CHECK(linear->num_parameters() == 4 * 3 + 3);
  CHECK_THROWS_WITH(nn::make_model({{"type", "linear"}, {"in", 4}, {"classes", 3}, {"hidden", {2}}}, 1),
                    Contains("\"hidden\"") && Contains("\"linear\""));

  if (!nn::has_model("two_layer_test_net")) {
    nn::register_model("two_layer_test_net", [](const json& cfg, uint64_t seed) -> nn::ModulePtr {
      return std::make_shared<nn::MLPClassifier>(cfg.at("in").get<int64_t>(), std::vector<int64_t>{3}, 2, "relu", seed);
    });
  }
  CHECK(nn::has_model("two_layer_test_net"));
  CHECK(nn::make_model({{"type", "two_layer_test_net"}, {"in", 5}}, 0)->num_parameters() == 5 * 3 + 3 + 3 * 2 + 2);
  CHECK_THROWS_AS(nn::register_model("mlp", [](const json&, uint64_t) { return nn::ModulePtr(); }), ValueError);
  CHECK_THROWS_WITH(nn::register_model("two_layer_test_net", [](const json&, uint64_t) { return nn::ModulePtr(); }),
                    Contains("registered already"));
  // An unknown type lists every registered name and says how to use a library.
  CHECK_THROWS_WITH(nn::make_model({{"type", "resnet"}}, 0), Contains("\"resnet\"") && Contains("\"mlp\"") &&
                                                                 Contains("\"two_layer_test_net\"") && Contains("library"));
  // The schema keeps a registered model's keys as given and checks the built-ins' strictly.
  json c = run_config({{"type", "two_layer_test_net"}, {"in", 6}, {"anything", "goes"}});
  CHECK(config::resolve(c)["model"]["anything"] == "goes");
  CHECK_THROWS_WITH(config::resolve(run_config({{"type", "mlp"}, {"in", 6}, {"classes", 3}, {"anything", 1}})),
                    Contains("unknown key 'model.anything'"));
  CHECK_THROWS_WITH(config::resolve(run_config({{"type", "resnt"}})),
                    Contains("'model.type' is \"resnt\"") && Contains("'model.library'"));
}

TEST_CASE("models: a model library's model, built by path and by name on the search path", "[models][plugin]") {
  const uint64_t calls = uint64_t(plugin::factory_calls(plugin::kModelKind));
  nn::ModulePtr a = nn::make_model(toy(), 7), b = nn::make_model(toy(), 7);
  CHECK(uint64_t(plugin::factory_calls(plugin::kModelKind)) == calls + 2);
  CHECK(a->name() == "ToyMLP");
  CHECK(a->num_parameters() == 6 * 5 + 5 + 5 * 3 + 3);
  CHECK(a->parameters()[0].tolist() == b->parameters()[0].tolist());  // the seed reaches the factory
  CHECK(a->named_parameters()[0].first == "fc1.weight");
  Tensor out = (*a)(ones({2, 6}));
  CHECK(out.shape() == Shape{2, 3});
  CHECK(nn::library_models(kToy) == std::vector<std::string>{"toy_mlp", "throws", "nothing", "toy_nested"});

  PluginPathGuard path(BOOSTER_TEST_MODEL_DIR);
  CHECK(nn::make_model(toy("toy"), 1)->name() == "ToyMLP");
  // Options the factory does not know are its ConfigError, carried across as one.
  json extra = toy();
  extra["hiden"] = 3;
  REQUIRE_THROWS_AS(nn::make_model(extra, 0), ConfigError);
  CHECK_THROWS_WITH(nn::make_model(extra, 0), Contains("hiden"));
}

TEST_CASE("models: library errors: not found, wrong ABI, wrong kind, missing model, throwing factory",
          "[models][plugin]") {
  {
    PluginPathGuard path("/first/place");
    REQUIRE_THROWS_AS(nn::make_model(toy("no_such_models"), 0), PluginError);
    CHECK_THROWS_WITH(nn::make_model(toy("no_such_models"), 0),
                      Contains("libbooster_model_no_such_models.so") && Contains("/first/place") &&
                          Contains("BOOSTER_PLUGIN_PATH"));
    // The schema says the same, addressed to the key.
    REQUIRE_THROWS_AS(config::resolve(run_config(toy("no_such_models"))), ConfigError);
    CHECK_THROWS_WITH(config::resolve(run_config(toy("no_such_models"))),
                      Contains("'model.library'") && Contains("/first/place"));
  }
  // Built for another ABI version: refused before its entry point runs (it aborts).
  REQUIRE_THROWS_AS(nn::make_model(toy(kBadAbi), 0), PluginError);
  CHECK_THROWS_WITH(nn::make_model(toy(kBadAbi), 0),
                    Contains(kBadAbi) && Contains("ABI version " + std::to_string(BOOSTER_PLUGIN_ABI_VERSION + 1000)) &&
                        Contains("ABI version " + std::to_string(BOOSTER_PLUGIN_ABI_VERSION) + ";"));
  CHECK_THROWS_AS(config::resolve(run_config(toy(kBadAbi))), PluginError);
  // A plugin of another kind.
  const std::string precision_plugin = std::string(BOOSTER_LIB_DIR) + "/libbooster_precision_static_fp16.so";
  CHECK_THROWS_WITH(nn::make_model(toy(precision_plugin), 0), Contains("is a precision plugin") && Contains("not a model library"));
  CHECK_THROWS_WITH(plugin::load(plugin::kPrecisionKind, kToy), Contains("is a model library ('toy')"));
  // A model the library does not have: ConfigError listing what it has.
  json other = toy();
  other["type"] = "toy_mpl";
  CHECK_THROWS_WITH(nn::make_model(other, 0), Contains("no model \"toy_mpl\"") && Contains("\"toy_mlp\", \"throws\""));
  CHECK_THROWS_WITH(config::resolve(run_config(other)), Contains("'model.type' is \"toy_mpl\"") && Contains("did you mean 'toy_mlp'"));
  // A factory that throws a non-booster exception: PluginError naming the library; no model: PluginError.
  json throws = {{"type", "throws"}, {"library", kToy}};
  REQUIRE_THROWS_AS(nn::make_model(throws, 0), PluginError);
  CHECK_THROWS_WITH(nn::make_model(throws, 0), Contains("'toy'") && Contains("the toy factory always throws"));
  CHECK_THROWS_WITH(nn::make_model({{"type", "nothing"}, {"library", kToy}}, 0), Contains("returned no model"));
  CHECK_THROWS_WITH(nn::make_model({{"type", "toy_mlp"}, {"library", 3}}, 0), Contains("\"library\""));
  CHECK_THROWS_WITH(config::resolve(run_config({{"type", "toy_mlp"}, {"library", ""}})), Contains("'model.library' is \"\""));
}

TEST_CASE("models: the library stays loaded while its model lives, and unloads after", "[models][plugin]") {
  REQUIRE_FALSE(is_mapped(kToy));
  {
    nn::ModulePtr model = nn::make_model(toy(), 3);
    REQUIRE(is_mapped(kToy));
    nn::ModulePtr copy = model;
    model.reset();
    REQUIRE(is_mapped(kToy));
    NoGradGuard no_grad;
    CHECK((*copy)(ones({1, 6})).shape() == Shape{1, 3});  // the library's forward runs
  }
  CHECK_FALSE(is_mapped(kToy));
  // A child of a class of the library's own, held after the model is gone (as PrecisionModule holds the
  // children it adopts), keeps the library too: its destructor is the library's code.
  {
    nn::ModulePtr block = nn::make_model({{"type", "toy_nested"}, {"library", kToy}, {"in", 6}}, 3)->child("block0");
    CHECK(block->name() == "ToyBlock");
    REQUIRE(is_mapped(kToy));
    NoGradGuard no_grad;
    CHECK((*block)(ones({1, 6})).shape() == Shape{1, 16});
  }
  CHECK_FALSE(is_mapped(kToy));
  // Resolving a config loads the library to check it and lets it go again.
  const json resolved = config::resolve(run_config(toy()));
  CHECK(resolved["model"]["library"] == kToy);
  CHECK(resolved["model"]["hidden"] == 5);
  CHECK(resolved["model"]["init_from"].is_null());
  CHECK_FALSE(is_mapped(kToy));
}
