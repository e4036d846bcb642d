// The model registry and make_model(): registered models by name, and models from a user's model
// library loaded through the plugin loader (Note [Model libraries] in model_registry.h).
#include "booster/nn/model_registry.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "booster/common/error.h"
#include "booster/common/error_context.h"
#include "booster/common/fatal_signal.h"
#include "booster/plugin/loader.h"

namespace booster::nn {

using nlohmann::json;

namespace {

struct Registry {
  std::mutex mu;
  std::vector<std::pair<std::string, ModelFactory>> models;  // registration order
  std::vector<std::string> builtins;             // in their order (register_builtin_model)
  std::map<std::string, double> builtin_order;
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: registration may run during static init
  return *r;
}

std::string quoted(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "\"" : ", \"") + n + "\"";
  return s;
}

// A loaded model library and the models its entry point added. The factories are code of the library:
// `library` is declared first so it is released last.
struct LoadedLibrary {
  std::shared_ptr<plugin::Plugin> library;
  std::vector<std::pair<std::string, ModelFactory>> models;
};

class CollectingRegistrar final : public ModelRegistrar {
 public:
  explicit CollectingRegistrar(std::vector<std::pair<std::string, ModelFactory>>& out) : out_(out) {}
  void add(const std::string& name, ModelFactory factory) override {
    BOOSTER_CHECK(!name.empty() && factory, ValueError, "model library: add() needs a name and a factory");
    const bool taken = std::any_of(out_.begin(), out_.end(), [&](const auto& m) { return m.first == name; });
    BOOSTER_CHECK(!taken, ValueError, "model library: the model \"", name, "\" is added twice");
    out_.emplace_back(name, std::move(factory));
  }

 private:
  std::vector<std::pair<std::string, ModelFactory>>& out_;
};

// "model library 'NAME' (FILE)", for messages.
std::string describe(const plugin::Plugin& library) {
  return "model library '" + library.name() + "' (" + library.file().string() + ")";
}

// What a model a library made shares with each of its modules: the library, kept loaded while any of
// them lives (Note [Plugin lifetime]), and each module's label for the fatal-signal handler (Note
// [Naming the code that crashed]), taken back when the last module is gone.
class LibraryModelOwner {
 public:
  LibraryModelOwner(std::shared_ptr<plugin::Plugin> library, const Module& model, const std::string& type)
      : library_(std::move(library)) {
    const std::string of = "model \"" + type + "\" of " + describe(*library_);
    const auto modules = model.named_modules();  // pre-order: the outer modules first
    labels_.reserve(modules.size());             // no reallocation: the handler holds c_str()s
    for (const auto& [path, module] : modules)
      labels_.emplace_back(module, path.empty() ? of : "module '" + path + "' (" + module->name() + ") of " + of);
    for (const auto& [module, label] : labels_) register_crash_module(module, label.c_str());
  }
  ~LibraryModelOwner() {
    for (const auto& [module, label] : labels_) unregister_crash_module(module);
  }
  LibraryModelOwner(const LibraryModelOwner&) = delete;
  LibraryModelOwner& operator=(const LibraryModelOwner&) = delete;

 private:
  std::shared_ptr<plugin::Plugin> library_;  // declared first: released last
  std::vector<std::pair<const Module*, std::string>> labels_;
};

LoadedLibrary load_library(const std::string& name_or_path) {
  LoadedLibrary loaded;
  loaded.library = plugin::load(plugin::kModelKind, name_or_path);
  auto* entry = reinterpret_cast<ModelLibraryEntry*>(loaded.library->symbol(plugin::entry_point(plugin::kModelKind)));
  CollectingRegistrar registrar(loaded.models);
  // Note [Naming the code that crashed] (booster/common/fatal_signal.h): a crash in the library's code
  // names it.
  install_fatal_signal_reporter();
  const std::string site = "the entry point booster_register_models of " + describe(*loaded.library);
  {
    const CrashSiteScope calling(site.c_str());
    plugin::call_into(*loaded.library, "booster_register_models", [&] { entry(registrar); });
  }
  BOOSTER_CHECK(!loaded.models.empty(), PluginError, "model library '", loaded.library->name(), "' (",
                loaded.library->file().string(), ") registered no models");
  return loaded;
}

std::vector<std::string> names_of(const std::vector<std::pair<std::string, ModelFactory>>& models) {
  std::vector<std::string> names;
  for (const auto& [name, _] : models) names.push_back(name);
  return names;
}

ModulePtr make_library_model(const json& cfg, const std::string& type, uint64_t seed) {
  const json& library_json = cfg.at("library");
  BOOSTER_CHECK(library_json.is_string() && !library_json.get<std::string>().empty(), ConfigError,
                "make_model: \"library\" must be the name or path of a model library, got ", library_json.dump());
  LoadedLibrary loaded = load_library(library_json.get<std::string>());
  const plugin::Plugin& library = *loaded.library;
  auto it = std::find_if(loaded.models.begin(), loaded.models.end(), [&](const auto& m) { return m.first == type; });
  BOOSTER_CHECK(it != loaded.models.end(), ConfigError, "make_model: model library '", library.name(), "' (",
                library.file().string(), ") has no model \"", type, "\"; it provides ", quoted(names_of(loaded.models)));
  json own = cfg;
  own.erase("library");
  plugin::count_factory_call(plugin::kModelKind);
  const std::string site = "the factory of model \"" + type + "\" of " + describe(library);
  ModulePtr model;
  {
    const CrashSiteScope calling(site.c_str());  // Note [Naming the code that crashed]
    model = plugin::call_into(library, "the factory of model \"" + type + "\"", [&] { return it->second(own, seed); });
  }
  BOOSTER_CHECK(model != nullptr, PluginError, "model library '", library.name(), "' (", library.file().string(),
                ") returned no model for \"", type, "\"");
  // Note [Plugin lifetime]: the model, and each module below it, keeps its library loaded (as
  // plugin::bind_module does), through an owner that also names its modules in a crash.
  auto owner = std::make_shared<const LibraryModelOwner>(loaded.library, *model, type);
  model->share_children_with(owner);
  struct Keeper {
    std::shared_ptr<const LibraryModelOwner> owner;  // declared first: released after the model
    ModulePtr model;
  };
  Module* raw = model.get();
  return ModulePtr(std::make_shared<Keeper>(Keeper{std::move(owner), std::move(model)}), raw);
}

}  // namespace

namespace detail {
// Called by models.cpp and register_model_family (families.h) for the built-ins, when the library loads.
// `order` places the name among the built-ins (smaller first), whatever order the files' statics run in.
void register_builtin_model(const std::string& name, ModelFactory factory, double order) {
  register_model(name, std::move(factory));
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  size_t at = 0;
  while (at < r.builtins.size() && r.builtin_order[r.builtins[at]] <= order) ++at;
  r.builtin_order[name] = order;
  r.builtins.insert(r.builtins.begin() + std::ptrdiff_t(at), name);
  // The built-ins first (registered_models()), in that order.
  auto it = std::find_if(r.models.begin(), r.models.end(), [&](const auto& m) { return m.first == name; });
  auto entry = std::move(*it);
  r.models.erase(it);
  r.models.insert(r.models.begin() + std::ptrdiff_t(at), std::move(entry));
}
}  // namespace detail

void register_model(const std::string& name, ModelFactory factory) {
  BOOSTER_CHECK(!name.empty(), ValueError, "register_model: the name is empty");
  BOOSTER_CHECK(factory != nullptr, ValueError, "register_model(\"", name, "\"): the factory is empty");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const bool taken = std::any_of(r.models.begin(), r.models.end(), [&](const auto& m) { return m.first == name; });
  BOOSTER_CHECK(!taken, ValueError, "register_model: a model \"", name, "\" is registered already; registered: ",
                quoted(names_of(r.models)));
  r.models.emplace_back(name, std::move(factory));
}

bool has_model(const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return std::any_of(r.models.begin(), r.models.end(), [&](const auto& m) { return m.first == name; });
}

std::vector<std::string> registered_models() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return names_of(r.models);
}

std::vector<std::string> builtin_models() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.builtins;
}

std::vector<std::string> library_models(const std::string& library) { return names_of(load_library(library).models); }

ModulePtr make_model(const json& cfg, uint64_t seed) {
  BOOSTER_CHECK(cfg.is_object(), ConfigError, "make_model: expected a JSON object, got ", cfg.dump());
  BOOSTER_CHECK(cfg.contains("type") && cfg["type"].is_string(), ConfigError,
                "make_model: missing string key \"type\"; allowed types are ", quoted(registered_models()),
                ", or a model of a library (\"library\")");
  const std::string type = cfg["type"].get<std::string>();
  // Note [Error context]: an allocation that fails while the model is built names it.
  const ErrorContextScope building(ErrorContextFrame::Kind::Building, type.c_str());
  if (cfg.contains("library")) return make_library_model(cfg, type, seed);

  ModelFactory factory;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = std::find_if(r.models.begin(), r.models.end(), [&](const auto& m) { return m.first == type; });
    if (it != r.models.end()) factory = it->second;
  }
  BOOSTER_CHECK(factory != nullptr, ConfigError, "make_model: unknown model type \"", type, "\"; allowed types are ",
                quoted(registered_models()),
                ", or a model of a library: set \"library\" to its name or path");
  return factory(cfg, seed);
}

}  // namespace booster::nn
