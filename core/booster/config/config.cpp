// Validation and defaults for JSON configs (Note [Config errors] in config.h).
#include "booster/config/config.h"
#include "booster/common/json_text.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include "booster/common/error.h"
#include "booster/distributed/process_group.h"

namespace booster::config {

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Bool: return "a boolean";
    case Kind::Int: return "an integer";
    case Kind::Number: return "a number";
    case Kind::String: return "a string";
    case Kind::Object: return "an object";
    case Kind::Array: return "an array";
    case Kind::Any: return "any value";
  }
  return "?";
}

std::string show(const json& value) {
  std::string s = value.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  // One row of the Levenshtein table at a time.
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t above = row[j];
      size_t substitute = diagonal + (a[i - 1] == b[j - 1] ? 0 : 1);
      row[j] = std::min({above + 1, row[j - 1] + 1, substitute});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::optional<std::string> nearest(const std::string& word, const std::vector<std::string>& candidates) {
  std::optional<std::string> best;
  size_t best_distance = 0;
  for (const auto& c : candidates) {
    size_t d = edit_distance(word, c);
    if (!best || d < best_distance) {
      best = c;
      best_distance = d;
    }
  }
  // A plausible typo changes at most about a third of the word (at least 2 edits allowed), or the
  // word is a prefix of the candidate ("lr_sched" for "lr_scheduler").
  if (!best) return std::nullopt;
  size_t allowed = std::max<size_t>(2, std::max(word.size(), best->size()) / 3);
  if (best_distance <= allowed) return best;
  for (const auto& c : candidates)
    if (word.size() >= 3 && c.rfind(word, 0) == 0) return c;
  return std::nullopt;
}

namespace {

std::string join_path(const std::string& parent, const std::string& key) {
  return parent.empty() ? key : parent + "." + key;
}

std::string quoted_list(const std::vector<std::string>& names) {
  std::string s;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i) s += ", ";
    s += "'" + names[i] + "'";
  }
  return s;
}

[[noreturn]] void unknown_key(const std::string& path, const std::string& key,
                              const std::vector<std::string>& valid) {
  std::string msg = "unknown key '" + join_path(path, key) + "'";
  if (auto guess = nearest(key, valid)) msg += "; did you mean '" + *guess + "'?";
  msg += " (valid keys" + (path.empty() ? std::string() : " of '" + path + "'") + ": " +
         quoted_list(valid) + ")";
  throw ConfigError(msg);
}

bool kind_matches(Kind kind, const json& v) {
  switch (kind) {
    case Kind::Bool: return v.is_boolean();
    case Kind::Int:
      // Past INT64_MAX nlohmann keeps the number unsigned; every integer option is read as an int64.
      if (v.is_number_unsigned()) return v.get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max());
      if (v.is_number_integer()) return true;
      // 3.0 is an integer; 3.5 and 1e30 are not.
      return v.is_number_float() && std::isfinite(v.get<double>()) &&
             v.get<double>() == std::floor(v.get<double>()) && std::abs(v.get<double>()) < 9.0e15;
    case Kind::Number: return v.is_number();
    case Kind::String: return v.is_string();
    case Kind::Object: return v.is_object();
    case Kind::Array: return v.is_array();
    case Kind::Any: return true;
  }
  return false;
}

std::string range_text(const Field& f) {
  std::ostringstream os;
  auto num = [](double d) {
    std::ostringstream s;
    s << d;
    return s.str();
  };
  if (f.min && f.max) {
    os << "in " << (f.min_exclusive ? "(" : "[") << num(*f.min) << ", " << num(*f.max) << (f.max_exclusive ? ")" : "]");
  } else if (f.min) {
    os << (f.min_exclusive ? "> " : ">= ") << num(*f.min);
  } else if (f.max) {
    os << (f.max_exclusive ? "< " : "<= ") << num(*f.max);
  }
  return os.str();
}

void check_number_range(const Field& f, const std::string& path, const json& v) {
  double d = v.get<double>();
  bool ok = std::isfinite(d);
  if (f.min) ok = ok && (f.min_exclusive ? d > *f.min : d >= *f.min);
  if (f.max) ok = ok && (f.max_exclusive ? d < *f.max : d <= *f.max);
  if (!ok) {
    throw ConfigError("'" + path + "' is " + show(v) + "; expected " +
                      (f.item_kind == Kind::Int || f.kind == Kind::Int ? "an integer " : "a number ") +
                      (f.min || f.max ? range_text(f) : "that is finite"));
  }
}

// Checks one value against its field and returns it normalized (integral floats become integers).
json check_value(const Field& f, const std::string& path, const json& v) {
  if (v.is_null() && f.nullable) return v;
  if (!kind_matches(f.kind, v)) {
    std::string allowed = kind_name(f.kind);
    if (f.nullable) allowed += " or null";
    if (f.min || f.max) allowed += " " + range_text(f);
    if (!f.choices.empty()) allowed += ", one of " + quoted_list(f.choices);
    throw ConfigError("'" + path + "' is " + show(v) + "; expected " + allowed);
  }
  if (f.kind == Kind::Int) {
    json n = v.is_number_integer() ? v : json(int64_t(v.get<double>()));
    check_number_range(f, path, n);
    return n;
  }
  if (f.kind == Kind::Number) {
    check_number_range(f, path, v);
    return v;
  }
  if (f.kind == Kind::String && !f.choices.empty()) {
    const auto s = v.get<std::string>();
    if (std::find(f.choices.begin(), f.choices.end(), s) == f.choices.end()) {
      std::string msg = "'" + path + "' is " + show(v) + "; expected one of " + quoted_list(f.choices);
      if (auto guess = nearest(s, f.choices)) msg += " (did you mean '" + *guess + "'?)";
      throw ConfigError(msg);
    }
    return v;
  }
  if (f.kind == Kind::Array) {
    if (f.length && v.size() != *f.length) {
      throw ConfigError("'" + path + "' is " + show(v) + "; expected an array of " + std::to_string(*f.length) +
                        " items, got " + std::to_string(v.size()));
    }
    if (f.max_length && v.size() > *f.max_length) {
      throw ConfigError("'" + path + "' has " + std::to_string(v.size()) + " items, past " + f.max_length_name + " of " +
                        std::to_string(*f.max_length) + "; check the list (a generated config gone wrong?)");
    }
    json out = json::array();
    Field item = f;
    item.kind = f.item_kind;
    item.nullable = false;
    item.length.reset();
    item.max_length.reset();
    for (size_t i = 0; i < v.size(); ++i) {
      std::string item_path = path + "[" + std::to_string(i) + "]";
      if (!kind_matches(f.item_kind, v[i])) {
        std::string allowed = kind_name(f.item_kind);
        if (f.min || f.max) allowed += " " + range_text(f);
        throw ConfigError("'" + item_path + "' is " + show(v[i]) + "; expected " + allowed);
      }
      out.push_back(check_value(item, item_path, v[i]));
    }
    return out;
  }
  return v;
}

// Validates `given` against `fields` (the keys of one object) into `out`, filling defaults.
void check_fields(const std::vector<const Field*>& fields, const std::string& path, const json& given, json& out) {
  std::vector<std::string> valid;
  for (const Field* f : fields) valid.push_back(f->key);
  for (const auto& [key, value] : given.items()) {
    auto it = std::find_if(fields.begin(), fields.end(), [&](const Field* f) { return f->key == key; });
    if (it == fields.end()) unknown_key(path, key, valid);
    out[key] = check_value(**it, join_path(path, key), value);
  }
  for (const Field* f : fields) {
    if (out.contains(f->key)) continue;
    if (!f->default_value) {
      throw ConfigError("'" + join_path(path, f->key) + "' is missing; expected " + kind_name(f->kind) +
                        (f->help.empty() ? "" : " (" + f->help + ")"));
    }
    out[f->key] = *f->default_value;
  }
}

json resolve_section(const Section& s, const json& given) {
  if (s.custom_resolve) return s.custom_resolve(given);
  if (!given.is_object()) {
    throw ConfigError("'" + s.name + "' is " + show(given) + "; expected an object" +
                      (s.help.empty() ? "" : " (" + s.help + ")"));
  }
  std::vector<const Field*> fields;
  for (const auto& f : s.common) fields.push_back(&f);
  json out = json::object();
  if (!s.discriminator.empty()) {
    std::vector<std::string> names;
    for (const auto& [name, _] : s.variants) names.push_back(name);
    std::string path = join_path(s.name, s.discriminator);
    std::string variant;
    if (!given.contains(s.discriminator)) {
      if (s.default_variant.empty()) {
        throw ConfigError("'" + path + "' is missing; expected one of " + quoted_list(names));
      }
      variant = s.default_variant;
    } else {
      const json& v = given.at(s.discriminator);
      if (!v.is_string()) throw ConfigError("'" + path + "' is " + show(v) + "; expected one of " + quoted_list(names));
      variant = v.get<std::string>();
    }
    auto it = std::find_if(s.variants.begin(), s.variants.end(), [&](const auto& p) { return p.first == variant; });
    if (it == s.variants.end() && s.resolve_other_variant) {
      // A variant of a run-time registry: the table checks the common fields, the hook the rest.
      json common_given = json::object(), rest = json::object();
      for (const auto& [key, value] : given.items()) {
        if (key == s.discriminator) continue;
        const bool is_common = std::any_of(s.common.begin(), s.common.end(), [&](const Field& f) { return f.key == key; });
        (is_common ? common_given : rest)[key] = value;
      }
      out[s.discriminator] = variant;
      check_fields(fields, s.name, common_given, out);
      out.update(s.resolve_other_variant(variant, rest));
      return out;
    }
    if (it == s.variants.end()) {
      std::string msg = "'" + path + "' is \"" + variant + "\"; expected one of " + quoted_list(names);
      if (auto guess = nearest(variant, names)) msg += " (did you mean '" + *guess + "'?)";
      throw ConfigError(msg);
    }
    out[s.discriminator] = variant;
    // The discriminator stays a valid key for suggestions ("tpye" -> "type").
    Field disc;
    disc.key = s.discriminator;
    disc.kind = Kind::String;
    disc.choices = names;
    disc.default_value = variant;
    for (const auto& f : it->second) fields.push_back(&f);
    json rest = given;
    rest.erase(s.discriminator);
    std::vector<const Field*> with_disc = fields;
    with_disc.insert(with_disc.begin(), &disc);
    check_fields(with_disc, s.name, rest, out);
    if (s.finish_variant) s.finish_variant(variant, out);
    return out;
  }
  check_fields(fields, s.name, given, out);
  return out;
}

}  // namespace

json resolve(const json& config, const std::vector<Section>& schema) {
  if (!config.is_object()) throw ConfigError("the config is " + show(config) + "; expected a JSON object");
  std::vector<std::string> valid;
  for (const auto& s : schema) valid.push_back(s.name);
  for (const auto& [key, _] : config.items()) {
    if (std::find(valid.begin(), valid.end(), key) == valid.end()) unknown_key("", key, valid);
  }
  json out = json::object();
  for (const auto& s : schema) {
    if (config.contains(s.name)) {
      out[s.name] = resolve_section(s, config.at(s.name));
    } else if (s.optional) {
      out[s.name] = s.when_absent ? *s.when_absent : resolve_section(s, json::object());
    } else {
      throw ConfigError("section '" + s.name + "' is missing" + (s.help.empty() ? "" : " (" + s.help + ")"));
    }
  }
  return out;
}

ResolvedRun resolve_run(const json& config) {
  // The table checks every section, the names of mixed_precision and plugin included; then the two are
  // built, once, which checks their options and the combination (Note [Built once]).
  json resolved = resolve(config, training_schema());
  // The run's collective timeout holds from here (Note [Collective timeouts]): building the plugin may
  // make the process group, and under torchrun's variables the ranks meet then, for at most that long.
  if (const json& timeout = resolved.at("train").at("collective_timeout_s"); timeout.is_number())
    distributed::set_default_collective_timeout(std::chrono::duration<double>(timeout.get<double>()));
  BoosterComponents booster = build_booster(resolved);
  resolved.update(resolved_sections(booster));
  check_training_config(resolved);
  return {std::move(resolved), std::move(booster)};
}

json resolve(const json& config) { return resolve_run(config).config; }

json load_file(const std::string& path) { return read_json_file(path, config_text_limits()); }

void apply_override(json& config, const std::string& assignment) {
  auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) {
    throw ConfigError("--set '" + assignment + "': expected key.path=value, e.g. --set optimizer.lr=3e-4");
  }
  std::string path = assignment.substr(0, eq);
  std::string text = assignment.substr(eq + 1);
  json value;
  try {
    value = parse_json_text(text, "--set '" + path + "=" + (text.size() > 40 ? text.substr(0, 40) + "...'" : text + "'"),
                            config_text_limits());
  } catch (const JsonSyntaxError&) {
    value = text;  // `adamw`, `/data/dir`: a plain string
  }

  std::vector<std::string> keys;
  std::stringstream ss(path);
  for (std::string k; std::getline(ss, k, '.');) {
    if (k.empty()) throw ConfigError("--set '" + assignment + "': empty key in path '" + path + "'");
    keys.push_back(k);
  }
  if (!config.is_object()) config = json::object();
  json* node = &config;
  std::string walked;
  for (size_t i = 0; i + 1 < keys.size(); ++i) {
    walked = join_path(walked, keys[i]);
    json& child = (*node)[keys[i]];
    if (child.is_null()) child = json::object();
    // "mixed_precision": "fp16" is short for {"name": "fp16"} (Note [The mixed_precision section]), so
    // --set mixed_precision.init_scale=8 adds an option to it.
    if (i == 0 && (keys[0] == "mixed_precision" || keys[0] == "plugin") && child.is_string()) child = json{{"name", child}};
    if (!child.is_object()) {
      throw ConfigError("--set '" + assignment + "': '" + walked + "' is " + show(child) +
                        ", not an object, so it has no key '" + keys[i + 1] + "'");
    }
    node = &child;
  }
  (*node)[keys.back()] = value;
}

ResolvedRun load_run(const std::string& path, const std::vector<std::string>& overrides) {
  json config = load_file(path);
  for (const auto& assignment : overrides) apply_override(config, assignment);
  return resolve_run(config);
}

json load(const std::string& path, const std::vector<std::string>& overrides) { return load_run(path, overrides).config; }

}  // namespace booster::config
