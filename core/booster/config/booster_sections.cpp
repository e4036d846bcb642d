// The `mixed_precision` and `plugin` sections of a config: the one parser of their shape, and the one
// place their strategy and plugin are built from a config (Note [Built once] in booster/booster/booster.h),
// with every error addressed to its JSON path.
#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <functional>
#include <optional>

#include "booster/booster/booster.h"
#include "booster/common/error.h"
#include "booster/config/config.h"
#include "booster/mixed_precision/mixed_precision.h"
#include "booster/plugin/loader.h"
#include "booster/plugin/parallel_plugin.h"

namespace booster::config {

// Note [The mixed_precision section]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// `"mixed_precision": "bf16"` is short for `{"name": "bf16"}`; an object carries the strategy's
// options next to its name (`{"name": "fp16", "init_scale": 1024}`). Absent, it is "fp32". The name is
// a built-in strategy, a precision plugin on the search path (`booster precisions` lists both), or the
// path to a precision plugin's .so (Note [Finding a plugin] in booster/plugin/loader.h).
// The strategies live in a registry that plugins extend at run time, so the schema table cannot list
// their options. Instead the strategy is asked: it is built once with the given options, which runs
// its own checks (types, ranges, choices: OptionReader), and its options() gives the valid keys and
// every value in use. Those checks stay the one place that knows an option; here their messages are
// only re-addressed to the JSON path (`mixed_precision.init_scale`) so a config error reads like every
// other, and a key the strategy does not list is an unknown key with the nearest valid one. The
// resolved section is {"name", every option with its value}, and resolving it again gives the same
// object, so a resolved config can be saved and run.
//
// Note [The plugin section]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Like mixed_precision: `"plugin": "ddp"` is short for `{"name": "ddp"}`, an object carries the
// plugin's options, and absent means "single" (one process, the built-in plugin, no library needed).
// A name must be "single" or a parallel plugin on the search path (`booster plugins`), or a path to
// one; the plugin, built once with the given options, checks them and lists the valid keys, as a
// strategy does. Whether the plugin works with the strategy is the compatibility matrix's call, made
// once where both are built (BoosterComponents).
namespace {

std::string quoted(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "'" : ", '") + n + "'";
  return s;
}

// What differs between the two sections.
struct SectionKind {
  std::string path;          // the section's JSON key
  std::string kind;          // "strategy", "plugin": for messages
  std::string plugin_kind;   // plugin::kPrecisionKind or kParallelKind
  std::string default_name;  // when the section is {}
};

SectionKind section_kind(const std::string& path) {
  if (path == "mixed_precision") return {path, "strategy", plugin::kPrecisionKind, kDefaultMixedPrecision};
  BOOSTER_CHECK(path == "plugin", ValueError, "config: no named section '", path, "'; expected mixed_precision or plugin");
  return {path, "plugin", plugin::kParallelKind, kDefaultPlugin};
}

// The names a section accepts besides paths: built-in strategies and precision plugins found, or
// "single" and the parallel plugins found.
std::vector<std::string> known_names(const SectionKind& s) {
  std::vector<std::string> names;
  if (s.plugin_kind == plugin::kPrecisionKind) {
    for (const auto& info : mixed_precision::available_strategies()) names.push_back(info.name);
  } else {
    names.push_back(kDefaultPlugin);
    for (const plugin::Found& found : plugin::list(plugin::kParallelKind))
      if (found.name != kDefaultPlugin) names.push_back(found.name);
  }
  return names;
}

// True when `message` names `key`: quoted, or as a whole word.
bool names_option(const std::string& message, const std::string& key) {
  if (message.find("'" + key + "'") != std::string::npos) return true;
  auto word_char = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  for (size_t at = message.find(key); at != std::string::npos; at = message.find(key, at + 1)) {
    const size_t end = at + key.size();
    if ((at == 0 || !word_char(message[at - 1])) && (end == message.size() || !word_char(message[end]))) return true;
  }
  return false;
}

// ConfigError for the first key of `options` that `valid` (a thing's options()) lacks.
void require_known_keys(const SectionKind& s, const std::string& name, const json& options, const json& valid) {
  std::vector<std::string> keys = {"name"};
  for (const auto& [key, _] : valid.items()) keys.push_back(key);
  for (const auto& [key, _] : options.items()) {
    if (valid.contains(key)) continue;
    std::string msg = "unknown key '" + s.path + "." + key + "' for " + s.kind + " \"" + name + "\"";
    if (auto guess = nearest(key, keys)) msg += "; did you mean '" + *guess + "'?";
    throw ConfigError(msg + " (valid keys of '" + s.path + "': " + quoted(keys) + ")");
  }
}

// `make(name, options)` once, with its errors addressed to the section's JSON path; a key the made
// thing does not list in options() is an unknown key.
template <class T>
std::shared_ptr<T> make_in_section(const SectionKind& s, const std::string& name, const json& options,
                                   const std::function<std::shared_ptr<T>(const json&)>& make) {
  std::shared_ptr<T> made;
  try {
    made = make(options);
  } catch (const ConfigError& e) {
    // Only on this error path: was it a key the thing does not know? Its defaults say (a second build).
    json defaults;
    try {
      defaults = make(json::object())->options();
    } catch (const Error&) {
      defaults = nullptr;
    }
    if (defaults.is_object()) require_known_keys(s, name, options, defaults);
    // The thing's own message names the option ('key', or the bare word); lead with its JSON path and
    // value.
    const std::string what = e.what();
    for (const auto& [key, value] : options.items())
      if (names_option(what, key)) throw ConfigError("'" + s.path + "." + key + "' is " + show(value) + ": " + what);
    throw ConfigError("'" + s.path + "': " + what);
  }
  require_known_keys(s, name, options, made->options());
  return made;
}

// {"name": name, every option with its value} for the resolved config.
json resolved_section(const std::string& name, const json& options) {
  json out = {{"name", name}};
  out.update(options);
  return out;
}

}  // namespace

std::pair<std::string, json> parse_named_section(const json& given, const std::string& path,
                                                 const std::string& default_name) {
  const SectionKind s = section_kind(path);
  if (given.is_null()) return {default_name, json::object()};
  json section = given.is_string() ? json{{"name", given}} : given;
  if (!section.is_object()) {
    throw ConfigError("'" + path + "' is " + show(given) + "; expected a " + s.kind +
                      " name or an object {\"name\": ..., options...}");
  }
  if (section.empty()) return {default_name, json::object()};
  if (!section.contains("name")) {
    throw ConfigError("'" + path + ".name' is missing; expected a " + s.kind + " name such as \"" + s.default_name +
                      "\" (" + show(section) + " has options but no name)");
  }
  const json& name = section.at("name");
  if (!name.is_string() || name.get<std::string>().empty()) {
    throw ConfigError("'" + path + ".name' is " + show(name) + "; expected a " + s.kind + " name or a path to a " +
                      s.plugin_kind + " plugin library");
  }
  json options = section;
  options.erase("name");
  return {name.get<std::string>(), options};
}

json name_section(const json& given, const std::string& path) {
  const SectionKind s = section_kind(path);
  const std::vector<std::string> names = known_names(s);
  std::pair<std::string, json> parsed;
  try {
    parsed = parse_named_section(given, path, s.default_name);
  } catch (const ConfigError& e) {
    // The same problems, with the names that would do.
    const std::string what = e.what();
    if (what.find("'" + path + ".name'") == std::string::npos) throw;
    const std::string head = what.substr(0, what.find("; expected"));
    throw ConfigError(head + "; expected one of " + quoted(names) + " or a path to a " + s.plugin_kind +
                      " plugin library");
  }
  const auto& [name, options] = parsed;
  const bool known = std::find(names.begin(), names.end(), name) != names.end() || plugin::is_path(name);
  if (!known) {
    std::string msg = "'" + path + ".name' is \"" + name + "\"; expected one of " + quoted(names) +
                      " or a path to a " + s.plugin_kind + " plugin library";
    if (auto guess = nearest(name, names)) msg += " (did you mean '" + *guess + "'?)";
    // Where a plugin of that name was looked for (Note [Finding a plugin]).
    msg += "; " + plugin::describe_search(s.plugin_kind, name);
    throw ConfigError(msg);
  }
  return resolved_section(name, options);
}

BoosterConfig booster_config(const json& resolved) {
  BoosterConfig out;
  std::tie(out.mixed_precision, out.mixed_precision_options) =
      parse_named_section(resolved.value("mixed_precision", json()), "mixed_precision", kDefaultMixedPrecision);
  std::string plugin_name;
  std::tie(plugin_name, out.plugin_options) =
      parse_named_section(resolved.value("plugin", json()), "plugin", kDefaultPlugin);
  // "single" is the built-in plugin: the same code as plugins/single, with no library to find.
  out.plugin = plugin_name == kDefaultPlugin ? "" : plugin_name;
  const json device = resolved.value("device", json("cpu"));
  out.device = device.is_string() ? device.get<std::string>() : "cpu";
  // Note [Reproducible training across world sizes]: the train section's switch, for the Booster.
  if (const json train = resolved.value("train", json::object()); train.is_object()) {
    out.reproducible = train.value("reproducible", false);
    if (const json k = train.value("reproducible_chunks", json()); k.is_number_integer())
      out.reproducible_chunks = k.get<int64_t>();
  }
  return out;
}

BoosterComponents build_booster(const json& config) {
  BoosterConfig booster = booster_config(config);
  const SectionKind mp = section_kind("mixed_precision");
  const SectionKind pl = section_kind("plugin");
  std::function<std::shared_ptr<mixed_precision::MixedPrecision>(const json&)> make_strategy =
      [&](const json& options) { return std::shared_ptr<mixed_precision::MixedPrecision>(
                                     mixed_precision::create(booster.mixed_precision, options)); };
  std::shared_ptr<mixed_precision::MixedPrecision> precision =
      make_in_section(mp, booster.mixed_precision, booster.mixed_precision_options, make_strategy);
  const std::string plugin_name = booster.plugin.empty() ? kDefaultPlugin : booster.plugin;
  std::function<std::shared_ptr<ParallelPlugin>(const json&)> make_plugin = [&](const json& options) {
    return create_plugin(booster.plugin, options);
  };
  std::shared_ptr<ParallelPlugin> plugin = make_in_section(pl, plugin_name, booster.plugin_options, make_plugin);
  // Every option in use, so the config saved with a run says everything it ran with.
  booster.mixed_precision_options = precision->options();
  booster.plugin_options = plugin->options();
  return BoosterComponents(std::move(booster), std::move(plugin), std::move(precision));
}

json resolved_sections(const BoosterComponents& components) {
  const BoosterConfig& c = components.config;
  return {{"mixed_precision", resolved_section(c.mixed_precision, c.mixed_precision_options)},
          {"plugin", resolved_section(c.plugin.empty() ? kDefaultPlugin : c.plugin, c.plugin_options)}};
}

}  // namespace booster::config

namespace booster {

// Note [Switching by launcher]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// `booster run --mixed-precision bf16 --plugin ddp -n 2 -- PROGRAM` exports BOOSTER_MIXED_PRECISION=bf16
// and BOOSTER_PLUGIN=ddp to every process (mpirun -x), as `accelerate launch --mixed_precision bf16`
// exports ACCELERATE_MIXED_PRECISION. A program built on BoosterConfig::from_env() then switches
// precision and parallelism without a change or a flag of its own; `booster train`, `check` and
// `doctor` read the variables as their --mixed-precision and --plugin (their own flags win). Each
// variable holds a name or a plugin's path, checked as a config's section is (name_section: the names
// that would do, a near miss, where plugins were looked for), with the variable named in the message.
// Unset or empty: the defaults, fp32 and the built-in single-process plugin.
BoosterConfig BoosterConfig::from_env() {
  BoosterConfig out;
  // The name a variable holds (checked), or nullopt when it is unset.
  auto read = [](const char* variable, const char* section, const char* flag) -> std::optional<std::string> {
    const char* value = std::getenv(variable);
    if (!value || !*value) return std::nullopt;
    try {
      return config::name_section(nlohmann::json(value), section).at("name").get<std::string>();
    } catch (const ConfigError& e) {
      throw ConfigError(str(variable, "=", value, " (booster run ", flag, "): ", e.what()));
    }
  };
  if (auto name = read(kMixedPrecisionVariable, "mixed_precision", "--mixed-precision")) out.mixed_precision = *name;
  if (auto name = read(kPluginVariable, "plugin", "--plugin")) out.plugin = *name == config::kDefaultPlugin ? "" : *name;
  return out;
}

}  // namespace booster
