// The plugin loader: search path, Boost.DLL loading, the ABI check, and error conversion at the
// boundary. See loader.h and abi.h.
#include "booster/plugin/loader.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <boost/dll/shared_library.hpp>
#include <cstdlib>
#include <map>
#include <set>
#include <system_error>

#include "booster/plugin/abi.h"

namespace booster::plugin {

namespace fs = std::filesystem;

struct Plugin::Library {
  boost::dll::shared_library library;
};

Plugin::~Plugin() = default;

void* Plugin::symbol(const std::string& alias) const {
  BOOSTER_CHECK(library_->library.has(alias), PluginError, "plugin '", name_, "' (", file_.string(),
                ") does not export '", alias, "'; a ", kind_, " plugin must export it (see booster/plugin/abi.h)");
  // A Boost.DLL alias is an exported pointer variable holding the address of the real symbol.
  return const_cast<void*>(library_->library.get<const void*>(alias));
}

namespace {

bool known_kind(const std::string& kind) {
  return kind == kPrecisionKind || kind == kParallelKind || kind == kModelKind;
}

const char* const kKindChoices = "precision, parallel or model";

std::string prefix_of(const std::string& kind) {
  if (kind == kPrecisionKind) return "libbooster_precision_";
  if (kind == kModelKind) return "libbooster_model_";
  return "libbooster_plugin_";
}

}  // namespace

std::string entry_point(const std::string& kind) {
  BOOSTER_CHECK(known_kind(kind), ValueError, "plugin: unknown kind '", kind, "'; expected ", kKindChoices);
  return kind == kModelKind ? "booster_register_models" : "booster_create_" + kind;
}

namespace {

}  // namespace

std::string file_name(const std::string& kind, const std::string& name) {
  BOOSTER_CHECK(known_kind(kind), ValueError, "plugin: unknown kind '", kind, "'; expected ", kKindChoices);
  return prefix_of(kind) + name + ".so";
}

bool is_path(const std::string& name_or_path) {
  const std::string so = ".so";
  return name_or_path.find('/') != std::string::npos ||
         (name_or_path.size() > so.size() && name_or_path.compare(name_or_path.size() - so.size(), so.size(), so) == 0);
}

fs::path core_library_dir() {
  // Note [Relocatable plugin search]: the directory of the libbooster_core that is running, asked of
  // the dynamic loader, so a build tree or install prefix that was copied or moved finds its own
  // plugins and never the original's.
  Dl_info info{};
  static const int anchor = 0;
  if (dladdr(&anchor, &info) == 0 || info.dli_fname == nullptr) return {};
  std::error_code ec;
  fs::path lib = fs::canonical(info.dli_fname, ec);
  if (ec) lib = fs::absolute(info.dli_fname, ec);
  return lib.parent_path();
}

std::vector<fs::path> search_path() {
  std::vector<fs::path> dirs;
  if (const char* env = std::getenv("BOOSTER_PLUGIN_PATH")) {
    std::string list = env;
    size_t start = 0;
    while (start <= list.size()) {
      const size_t end = std::min(list.find(':', start), list.size());
      if (end > start) dirs.emplace_back(list.substr(start, end - start));  // empty entries are skipped
      start = end + 1;
    }
  }
  const fs::path core_dir = core_library_dir();
  if (!core_dir.empty()) {
    dirs.push_back(core_dir / "booster");  // an install prefix: <prefix>/lib/booster
    dirs.push_back(core_dir);              // the build tree: build/lib
  }
  return dirs;
}

std::string describe_search_path() {
  std::string out;
  for (const fs::path& d : search_path()) out += (out.empty() ? "" : ", ") + d.string();
  return out;
}

std::string describe_search(const std::string& kind, const std::string& name) {
  const char* env = std::getenv("BOOSTER_PLUGIN_PATH");
  const std::string env_text = env ? std::string("BOOSTER_PLUGIN_PATH=") + env : "BOOSTER_PLUGIN_PATH unset";
  return "looked for " + file_name(kind, name) + " in " + describe_search_path() + " (" + env_text +
         ", then beside libbooster_core); set BOOSTER_PLUGIN_PATH to add directories, or give the path to the .so";
}

fs::path find_or_empty(const std::string& kind, const std::string& name) {
  const std::string file = file_name(kind, name);
  for (const fs::path& dir : search_path()) {
    std::error_code ec;
    const fs::path candidate = dir / file;
    if (fs::is_regular_file(candidate, ec)) return candidate;
  }
  return {};
}

fs::path find(const std::string& kind, const std::string& name) {
  fs::path file = find_or_empty(kind, name);
  BOOSTER_CHECK(!file.empty(), PluginError, "plugin: no ", kind, " plugin named '", name, "': ",
                describe_search(kind, name));
  return file;
}

std::vector<Found> list(const std::string& kind) {
  std::map<std::pair<std::string, std::string>, fs::path> found;  // first of each (kind, name) wins
  for (const fs::path& dir : search_path()) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) continue;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      const std::string file = entry.path().filename().string();
      for (const std::string k : {kPrecisionKind, kParallelKind, kModelKind}) {
        if (!kind.empty() && kind != k) continue;
        const std::string prefix = prefix_of(k);
        if (file.size() > prefix.size() + 3 && file.rfind(prefix, 0) == 0 && file.ends_with(".so")) {
          const std::string name = file.substr(prefix.size(), file.size() - prefix.size() - 3);
          found.emplace(std::make_pair(k, name), entry.path());
        }
      }
    }
  }
  std::vector<Found> out;
  for (const auto& [key, file] : found) out.push_back({key.first, key.second, file});
  return out;
}

std::shared_ptr<Plugin> load(const std::string& kind, const std::string& name_or_path) {
  BOOSTER_CHECK(known_kind(kind), ValueError, "plugin: unknown kind '", kind, "'; expected ", kKindChoices);
  const fs::path file = is_path(name_or_path) ? fs::path(name_or_path) : find(kind, name_or_path);
  std::error_code exists_ec;
  BOOSTER_CHECK(fs::exists(file, exists_ec), PluginError, "plugin: ", file.string(), " does not exist (a name with '/' ",
                "or ending in .so is a path, loaded as is; a ", kind, " plugin's name is searched for as ",
                file_name(kind, "<name>"), " in ", describe_search_path(),
                ", the directories of BOOSTER_PLUGIN_PATH first)");

  // dlopen() of a FIFO blocks until something writes to it, and of a device reads it: only regular
  // files (or symlinks to them) are opened.
  BOOSTER_CHECK(fs::is_regular_file(file, exists_ec), PluginError, "plugin: ", file.string(),
                " is not a regular file (a directory, a FIFO or a device); give the path of a plugin's .so");

  std::shared_ptr<Plugin> plugin(new Plugin());
  plugin->library_ = std::make_unique<Plugin::Library>();
  plugin->file_ = file;
  boost::dll::fs::error_code ec;
  // Local binding: two plugins may define the same internal names without clashing.
  plugin->library_->library.load(file, ec, boost::dll::load_mode::rtld_local | boost::dll::load_mode::rtld_now);
  BOOSTER_CHECK(!ec, PluginError, "plugin: cannot load ", file.string(), ": ", ec.message(),
                " (is it a shared library built for this machine, with its dependencies on the library path?)");

  boost::dll::shared_library& lib = plugin->library_->library;
  BOOSTER_CHECK(lib.has("booster_plugin_abi_version"), PluginError, file.string(),
                " is not a booster plugin: it exports no booster_plugin_abi_version (a plugin is built with one of "
                "the BOOSTER_EXPORT_*_PLUGIN macros of booster/plugin/abi.h, a model library with "
                "BOOSTER_MODEL_LIBRARY of booster/nn/model_registry.h)");
  // The version is read before anything else in the library is called (Note [Plugin ABI]).
  const int version = lib.get_alias<int()>("booster_plugin_abi_version")();
  BOOSTER_CHECK(version == BOOSTER_PLUGIN_ABI_VERSION, PluginError, "plugin: ", file.string(),
                " was built for plugin ABI version ", version, " but this booster has ABI version ",
                BOOSTER_PLUGIN_ABI_VERSION, "; rebuild the plugin against this booster");
  plugin->abi_version_ = version;
  BOOSTER_CHECK(lib.has("booster_plugin_kind") && lib.has("booster_plugin_name"), PluginError, file.string(),
                " is not a complete booster plugin: it must export booster_plugin_kind and booster_plugin_name");
  plugin->kind_ = lib.get_alias<const char*()>("booster_plugin_kind")();
  plugin->name_ = lib.get_alias<const char*()>("booster_plugin_name")();
  auto noun = [](const std::string& k) { return k == kModelKind ? std::string("model library") : k + " plugin"; };
  BOOSTER_CHECK(plugin->kind_ == kind, PluginError, "plugin: ", file.string(), " is a ", noun(plugin->kind_),
                " ('", plugin->name_, "'), not a ", noun(kind));
  BOOSTER_CHECK(lib.has(entry_point(kind)), PluginError, "plugin: ", file.string(), " ('", plugin->name_,
                "') exports no ", entry_point(kind), " entry point");
  return plugin;
}

namespace {
std::atomic<int64_t> precision_factory_calls{0};
std::atomic<int64_t> parallel_factory_calls{0};
std::atomic<int64_t> model_factory_calls{0};
std::atomic<int64_t>& factory_counter(const std::string& kind) {
  BOOSTER_CHECK(known_kind(kind), ValueError, "plugin: unknown kind '", kind, "'; expected ", kKindChoices);
  if (kind == kModelKind) return model_factory_calls;
  return kind == kPrecisionKind ? precision_factory_calls : parallel_factory_calls;
}
}  // namespace

int64_t factory_calls(const std::string& kind) { return factory_counter(kind).load(); }
void count_factory_call(const std::string& kind) { ++factory_counter(kind); }

void rethrow_as_host_error(const Plugin& plugin, const std::string& what_call) {
  // A new exception built here, in the host, so nothing thrown on carries pointers into the plugin.
  try {
    throw;
  }
#define BOOSTER_RETHROW_AS(Type) \
  catch (const Type& e) {        \
    throw Type(e.what());        \
  }
  BOOSTER_RETHROW_AS(ShapeError)
  BOOSTER_RETHROW_AS(DTypeError)
  BOOSTER_RETHROW_AS(IndexError)
  BOOSTER_RETHROW_AS(ValueError)
  BOOSTER_RETHROW_AS(DeviceError)
  BOOSTER_RETHROW_AS(AutogradError)
  BOOSTER_RETHROW_AS(StateError)
  BOOSTER_RETHROW_AS(ConfigError)
  BOOSTER_RETHROW_AS(IncompatibleError)
  BOOSTER_RETHROW_AS(PluginError)
  BOOSTER_RETHROW_AS(CheckpointError)
  BOOSTER_RETHROW_AS(DataError)
  BOOSTER_RETHROW_AS(DistributedError)
  BOOSTER_RETHROW_AS(NotImplementedError)
  BOOSTER_RETHROW_AS(TrainingError)
  BOOSTER_RETHROW_AS(OutOfMemoryError)
  BOOSTER_RETHROW_AS(Error)
#undef BOOSTER_RETHROW_AS
  catch (const std::exception& e) {
    BOOSTER_FAIL(PluginError, plugin.kind(), " plugin '", plugin.name(), "' (", plugin.file().string(), ") threw from ",
                 what_call, ": ", e.what());
  } catch (...) {
    BOOSTER_FAIL(PluginError, plugin.kind(), " plugin '", plugin.name(), "' (", plugin.file().string(),
                 ") threw a non-standard exception from ", what_call);
  }
}

}  // namespace booster::plugin
