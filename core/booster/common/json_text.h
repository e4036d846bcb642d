// The one JSON reader: every JSON text the project reads (a config, a --set value, an HF config.json,
// a safetensors header, a checkpoint's state, a flight record) is parsed here, without trusting it.
// It lives in common/ so that every layer (distributed/, nn/, checkpoint/, config/) can use it.
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
// layers, most of a second to read, where a config allows 4096), text longer than `max_bytes` is
// refused before parsing, and no string may contain NUL (no key may contain any control character).
// Comments are allowed, as in config files before.
//
// Note [One JSON reader]
// ~~~~~~~~~~~~~~~~~~~~~~
// Every file the project reads as JSON goes through parse_json_text (read_json_file for a file on
// its own), not nlohmann::json::parse: 200 000 `[` in a 1 MB config.json, safetensors header or
// flight record otherwise build a document whose every later copy, dump and destruction recurses
// that deep (SIGSEGV). nlohmann's SAX parser itself keeps its nesting on a heap stack, so the builder
// refusing the 65th open bracket stops the document before anything recurses, as a linear pre-scan
// would. The depth limit is the same for every file (no file the project reads nests past a dozen
// levels); the size and item limits are the config's unless a file is legitimately bigger: data_limits
// (below) for the readers that take one, each saying why at its call.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "booster/common/error.h"

namespace booster {

struct JsonLimits {
  size_t max_bytes = 16'000'000;  // a config is small; data belongs in the files it names
  int max_depth = 64;                   // objects and arrays open at once
  size_t max_items = 65536;             // items of one array (Note [The depth limit] in schema.cpp)
  // Refuse NUL in strings and control characters in keys. Data files written by other programs
  // (a tokenizer's vocabulary, a safetensors header's metadata) may hold them.
  bool plain_strings = true;
  const char* size_advice = "data belongs in the files a config names";  // why the size limit holds
  const char* items_advice = "a config never needs that: data belongs in the files a config names";  // likewise
};

// The limits for a JSON file that holds data, not settings (Note [One JSON reader]): the config's
// depth, at most `max_bytes`, arrays of any length up to that, any characters in strings and keys.
inline JsonLimits data_limits(size_t max_bytes, const char* size_advice) {
  JsonLimits limits;
  limits.max_bytes = max_bytes;
  limits.max_items = max_bytes;
  limits.plain_strings = false;
  limits.size_advice = size_advice;
  return limits;
}

// The text is not JSON at all (as opposed to JSON that breaks a rule above, which is a ConfigError):
// `--set key=adamw` takes such a value as a plain string.
class JsonSyntaxError : public ConfigError {
 public:
  JsonSyntaxError(const std::string& what, std::string detail) : ConfigError(what), detail_(std::move(detail)) {}
  // The parser's words alone ("parse error at line 3, column 5: ..."), for a reader's own message.
  const std::string& detail() const { return detail_; }

 private:
  std::string detail_;
};

// Parses `text`; `source` names it in messages ("config file 'a.json'", "--set 'model.hidden=...'").
// Throws JsonSyntaxError for malformed JSON and ConfigError for the rules of Note [Reading config text].
nlohmann::json parse_json_text(std::string_view text, const std::string& source, const JsonLimits& limits = {});

// Reads and parses a config file (size checked before reading): ConfigError naming the file.
nlohmann::json read_json_file(const std::string& path, const JsonLimits& limits = {});

// Reads and parses any JSON file (Note [One JSON reader]); `what` names it in messages
// ("Hugging Face config", "tokenizer file"), as "<what> '<path>'". ConfigError (JsonSyntaxError for
// text that is not JSON) naming the file; a reader whose errors are of another type catches and
// rethrows it.
nlohmann::json read_json_file(const std::string& path, const std::string& what, const JsonLimits& limits);

// parse_json_text and read_json_file for a reader to which an unreadable file is not an error (a
// later loader reports it): a discarded value (is_discarded()) where they would throw ConfigError.
nlohmann::json try_parse_json_text(std::string_view text, const JsonLimits& limits);
nlohmann::json try_read_json_file(const std::string& path, const JsonLimits& limits);

// The limits of the JSON files a checkpoint holds (trainer_state.json, checksums.json, optimizer.json,
// a model index): data_limits at 256 MB, as checkpoint::read_text_file's callers bounded them before.
inline JsonLimits checkpoint_limits() { return data_limits(size_t(256) << 20, "a checkpoint file's limit"); }

// parse_json_text for a reader whose errors are of type E (a checkpoint's CheckpointError, a data
// set's DataError): text that is not JSON as E(not_json + the parser's words), a broken limit as
// E(its message).
template <class E>
nlohmann::json parse_json_as(std::string_view text, const std::string& source, const std::string& not_json,
                             const JsonLimits& limits) {
  try {
    return parse_json_text(text, source, limits);
  } catch (const JsonSyntaxError& e) {
    throw E(not_json + e.detail());
  } catch (const ConfigError& e) {
    throw E(e.what());
  }
}

}  // namespace booster
