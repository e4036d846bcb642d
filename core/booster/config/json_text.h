// Reading JSON that a person wrote (a config file, a --set value) without trusting it.
//
// Note [Reading config text]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// nlohmann's parser accepts what a config must not hold, and some of it crashes or hides a mistake
// later: nesting 100 000 deep overflows the stack in the recursive dump and copy that every later step
// does; a key given twice silently keeps the last; `1e400` fails without a file or key; a key with
// "\u0000" in it cuts every message that names it; a 75 MB file takes minutes before the first error.
// parse_json_text builds the document through its own SAX handler, which refuses each of these at the
// point it is read, with the source, line and column and the JSON path: duplicate keys name both
// positions, nesting stops at `max_depth`, an array at `max_items` (16 MB holds a list of 5 000 000
// layers, most of a second to read, where kMaxModelDepth allows 4096), text longer than `max_bytes` is
// refused before parsing, and no string may contain NUL (no key may contain any control character).
// Comments are allowed, as in config files before.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "booster/common/error.h"

namespace booster::config {

// The most layers a config's model may have (Note [The depth limit] in schema.cpp).
inline constexpr int64_t kMaxModelDepth = 4096;

struct JsonLimits {
  size_t max_bytes = 16'000'000;  // a config is small; data belongs in the files it names
  int max_depth = 64;                   // objects and arrays open at once
  size_t max_items = 65536;             // items of one array (Note [The depth limit] in schema.cpp)
};

// The text is not JSON at all (as opposed to JSON that breaks a rule above, which is a ConfigError):
// `--set key=adamw` takes such a value as a plain string.
class JsonSyntaxError : public ConfigError {
 public:
  using ConfigError::ConfigError;
};

// Parses `text`; `source` names it in messages ("config file 'a.json'", "--set 'model.hidden=...'").
// Throws JsonSyntaxError for malformed JSON and ConfigError for the rules of Note [Reading config text].
nlohmann::json parse_json_text(std::string_view text, const std::string& source, const JsonLimits& limits = {});

// Reads and parses a config file (size checked before reading): ConfigError naming the file.
nlohmann::json read_json_file(const std::string& path, const JsonLimits& limits = {});

}  // namespace booster::config
