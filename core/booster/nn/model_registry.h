// Models by name: make_model() builds one from a JSON config's `model` section. The built-ins (mlp,
// linear, gpt) register themselves; a program adds its own with register_model(), and a user's shared
// library adds models that a config selects with "library" (Note [Model libraries]).
//
//   nn::register_model("residual_mlp", [](const nlohmann::json& cfg, uint64_t seed) -> nn::ModulePtr {
//     return std::make_shared<ResidualMLP>(cfg.at("in").get<int64_t>(), ..., seed);
//   });
//   auto model = nn::make_model({{"type", "residual_mlp"}, {"in", 32}}, /*seed=*/0);
//   auto mine = nn::make_model({{"type", "my_net"}, {"library", "my_models"}, {"width", 64}}, 0);
//
// Note [Model libraries]
// ~~~~~~~~~~~~~~~~~~~~~~
// A model library is a shared library `libbooster_model_<name>.so`, found by name on the plugin search
// path or given by path (Note [Finding a plugin] in booster/plugin/loader.h), exactly as plugins are.
// It exports the plugin identity (ABI version, kind "model", name) and one entry point,
// booster_register_models, which receives a ModelRegistrar and adds its models to it:
//
//   void register_models(booster::nn::ModelRegistrar& models) {
//     models.add("my_net", [](const nlohmann::json& cfg, uint64_t seed) { return make_my_net(cfg, seed); });
//   }
//   BOOSTER_MODEL_LIBRARY("my_models", register_models)
//
// The host checks the ABI version before calling anything (a library of another version or kind is a
// PluginError naming the file), calls the entry point on every make_model() that names the library,
// and builds the model with the factory registered under `type`. The factory gets the model section
// without "library" (its own keys are not in the schema: the factory checks them, best with
// config::OptionReader, whose ConfigError names the key). Exceptions from the factory reach the host as
// host error types (anything else as PluginError naming the library), and the model is handed out
// through a shared_ptr that also holds the library (Note [Plugin lifetime]): the library stays loaded
// while the model, or any copy of that pointer, lives. Library models are not added to the process's
// registry, so two configs may name two libraries that both call their model "net".
//
// ABI: ModelRegistrar and ModelFactory are part of the plugin interface (Note [Plugin ABI]).
#pragma once

#include <boost/config.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "booster/nn/module.h"
#include "booster/plugin/abi.h"

namespace booster::nn {

// Builds a model from its config section and a seed (the same seed gives the same weights).
using ModelFactory = std::function<ModulePtr(const nlohmann::json& cfg, uint64_t seed)>;

// Adds `factory` under `name`. ValueError when the name is empty or taken (the built-ins' names are
// taken from the start).
void register_model(const std::string& name, ModelFactory factory);
// Whether make_model() knows `name` without a library.
bool has_model(const std::string& name);
// Every registered name: the built-ins first, then in registration order.
std::vector<std::string> registered_models();
// The built-in names only (mlp, linear, gpt): the ones the config schema checks key by key.
std::vector<std::string> builtin_models();

// Builds a model from {"type": NAME, ...} (seed: the weights' seed). With "library": LIB, the model
// NAME of that model library (Note [Model libraries]); otherwise a registered model.
//   mlp:    in, hidden (list), classes, [activation = "relu"]
//   linear: in, classes, [bias = true]   (a linear classifier: logistic regression)
//   gpt:    vocab_size, context, width, layers, heads, [dropout = 0.0]
// ConfigError for an unknown type (listing the registered names, or the library's), unknown or missing
// keys and bad values, naming the key and what is allowed; PluginError for a library that cannot be
// found or loaded, or is of another kind or ABI version.
ModulePtr make_model(const nlohmann::json& cfg, uint64_t seed);

// What a model library's entry point receives: it adds each of its models by name.
class BOOST_SYMBOL_VISIBLE ModelRegistrar {
 public:
  virtual ~ModelRegistrar() = default;
  virtual void add(const std::string& name, ModelFactory factory) = 0;
};

// A model library's entry point, exported as booster_register_models.
using ModelLibraryEntry = void(ModelRegistrar& models);

// The names of the models a model library provides (loads it, calls its entry point; the library is
// unloaded again unless something else holds it). PluginError as for make_model.
std::vector<std::string> library_models(const std::string& library);

}  // namespace booster::nn

// A model library (Note [Model libraries]): `RegisterModels` is any function
//   void RegisterModels(booster::nn::ModelRegistrar& models)
// and NameString the library's name (its file is libbooster_model_<NameString>.so).
#define BOOSTER_MODEL_LIBRARY_WITH_ABI(NameString, RegisterModels, AbiVersion)                    \
  namespace booster_plugin_exports {                                                              \
  static void entry_register_models(::booster::nn::ModelRegistrar& models) { (RegisterModels)(models); } \
  }                                                                                               \
  BOOSTER_EXPORT_PLUGIN_IDENTITY(model, NameString, AbiVersion)                                   \
  BOOST_DLL_ALIAS(booster_plugin_exports::entry_register_models, booster_register_models)
#define BOOSTER_MODEL_LIBRARY(NameString, RegisterModels) \
  BOOSTER_MODEL_LIBRARY_WITH_ABI(NameString, RegisterModels, BOOSTER_PLUGIN_ABI_VERSION)
