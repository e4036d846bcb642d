// Finds plugin shared libraries by name, loads them with Boost.DLL, checks their ABI version, and binds
// what they create to the library so nothing outlives it. Shared by precision and parallel plugins.
//
// Note [Finding a plugin]
// A name containing '/' or ending in ".so" is a path, loaded as is. Any other name is a file name
//   precision: libbooster_precision_<name>.so      parallel: libbooster_plugin_<name>.so
//   model library: libbooster_model_<name>.so
// looked for in each directory of BOOSTER_PLUGIN_PATH (colon-separated, in order), then in
// <dir>/booster and <dir>, where <dir> holds the libbooster_core that is loaded (an install prefix's
// lib/, or the build tree's lib/). Nothing absolute is compiled in, so a moved prefix or build tree
// finds its own plugins. The first hit wins. A name found nowhere is a PluginError listing every
// directory searched and naming BOOSTER_PLUGIN_PATH.
//
// Note [Plugin lifetime]
// Unloading a library while an object it created (or a function it holds) is alive leaves dangling
// vtables. So the loader hands out objects through shared_ptrs whose control block also owns the
// library (a shared_ptr<Plugin>): the library is closed after the last of them is destroyed, whatever
// order the host drops them in. bind() does this for any object from a plugin.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "booster/common/error.h"

namespace booster::plugin {

// A loaded plugin library whose ABI version matched. Held by shared_ptr; see Note [Plugin lifetime].
class Plugin {
 public:
  ~Plugin();
  Plugin(const Plugin&) = delete;
  Plugin& operator=(const Plugin&) = delete;

  const std::filesystem::path& file() const { return file_; }
  const std::string& kind() const { return kind_; }
  const std::string& name() const { return name_; }
  int abi_version() const { return abi_version_; }

  // The address of an exported Boost.DLL alias (e.g. "booster_create_precision"); PluginError naming the
  // file when it is absent.
  void* symbol(const std::string& alias) const;

 private:
  friend std::shared_ptr<Plugin> load(const std::string&, const std::string&);
  struct Library;
  Plugin() = default;
  std::unique_ptr<Library> library_;
  std::filesystem::path file_;
  std::string kind_, name_;
  int abi_version_ = 0;
};

// Loads a plugin of `kind` ("precision", "parallel" or "model") by name or path (Note [Finding a plugin]).
// PluginError: not found (lists the directories searched), not a booster plugin (no
// booster_plugin_abi_version export), a different ABI version (names both and the file), or a plugin
// of another kind. Loading the same file twice shares one library (the OS refcounts it).
std::shared_ptr<Plugin> load(const std::string& kind, const std::string& name_or_path);

// The symbol a library of `kind` must export besides its identity: booster_create_<kind>, or
// booster_register_models for a model library (Note [Plugin ABI] in abi.h).
std::string entry_point(const std::string& kind);
// The directories searched, in order.
std::vector<std::filesystem::path> search_path();
// The directory of the loaded libbooster_core (empty if the dynamic loader cannot say).
std::filesystem::path core_library_dir();
// The file name a plugin called `name` of `kind` has.
std::string file_name(const std::string& kind, const std::string& name);
// Whether `name_or_path` is taken as a path rather than a name.
bool is_path(const std::string& name_or_path);
// The file for `name` on the search path; PluginError listing the directories when there is none.
std::filesystem::path find(const std::string& kind, const std::string& name);
// The same, empty when not found.
std::filesystem::path find_or_empty(const std::string& kind, const std::string& name);
// "dir1, dir2, ..." for messages.
std::string describe_search_path();
// For every not-found message, library and CLI alike: "looked for <file> in <dirs> (BOOSTER_PLUGIN_PATH
// <its value, or unset>, then beside libbooster_core); set BOOSTER_PLUGIN_PATH to add directories, or
// give the path to the .so".
std::string describe_search(const std::string& kind, const std::string& name);

// One plugin file found on the search path (by its file name: it is not loaded).
struct Found {
  std::string kind;
  std::string name;
  std::filesystem::path file;
};
// Every plugin file of `kind` ("" for every kind) on the search path, the first of each name only, sorted by
// kind then name.
std::vector<Found> list(const std::string& kind = "");

// `object` (created by `plugin`) as a shared_ptr that also keeps the plugin loaded: the object is
// destroyed first, then the library reference is dropped.
template <class T>
std::shared_ptr<T> bind(std::shared_ptr<Plugin> plugin, std::shared_ptr<T> object) {
  if (!object) return object;
  struct Keeper {
    std::shared_ptr<Plugin> plugin;  // declared first: destroyed last
    std::shared_ptr<T> object;
  };
  T* raw = object.get();
  auto keeper = std::make_shared<Keeper>(Keeper{std::move(plugin), std::move(object)});
  return std::shared_ptr<T>(std::move(keeper), raw);
}

// A module tree made by `plugin`, bound as bind() does, and every child registered below it too
// (Module::share_children_with): code that holds one of its modules (PrecisionModule adopts the
// children of the model it wraps) keeps the library loaded, so no module outlives its vtable.
template <class M>
std::shared_ptr<M> bind_module(std::shared_ptr<Plugin> plugin, std::shared_ptr<M> module) {
  if (!module) return module;
  module->share_children_with(plugin);
  return bind(std::move(plugin), std::move(module));
}

// How many times this process has called a plugin factory (booster_create_<kind>) of `kind`: one per
// plugin or strategy made from a library. Tests read it to check that a run builds each once (Note
// [Built once] in booster/booster/booster.h); count_factory_call is for the two proxies that call them.
int64_t factory_calls(const std::string& kind);
void count_factory_call(const std::string& kind);

// Runs `f` (a call into a plugin) and converts what it throws into host errors: a booster error keeps
// its type and message, anything else becomes a PluginError naming the plugin.
void rethrow_as_host_error(const Plugin& plugin, const std::string& what_call);

template <class F>
decltype(auto) call_into(const Plugin& plugin, const std::string& what_call, F&& f) {
  try {
    return f();
  } catch (...) {
    rethrow_as_host_error(plugin, what_call);
    throw;  // not reached
  }
}

}  // namespace booster::plugin
