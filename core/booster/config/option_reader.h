// OptionReader: the one way a strategy or a plugin reads its JSON options, with type and range checks.
// Every read names a valid option; finish() refuses a key that no read named, listing the valid ones.
// Every problem is a ConfigError that starts with what is reading ("mixed precision 'fp16': ...",
// "plugin 'ddp': ...") and names the option, the value and what is allowed.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace booster::config {

class OptionReader {
 public:
  // `kind` and `name` start every message: "<kind> '<name>': option 'x' ...". Null options are {}.
  OptionReader(std::string kind, std::string name, const nlohmann::json& options);

  double number(const std::string& key, double fallback, double min, double max, bool min_exclusive = false,
                bool max_exclusive = false);
  int64_t integer(const std::string& key, int64_t fallback, int64_t min, int64_t max);
  bool flag(const std::string& key, bool fallback);
  // Options whose absence and null mean "no override" (apex's None): nullopt then. optional_flag also
  // takes Python's spellings "True" and "False" (configs written from argparse values).
  std::optional<bool> optional_flag(const std::string& key);
  std::optional<double> optional_number(const std::string& key, double min, double max, bool min_exclusive = false,
                                        bool max_exclusive = false);
  std::string choice(const std::string& key, const std::string& fallback, const std::vector<std::string>& choices);
  // The raw value (or fallback) for options with their own syntax; the caller validates it.
  nlohmann::json raw(const std::string& key, const nlohmann::json& fallback);
  bool has(const std::string& key) const { return options_.contains(key); }
  // ConfigError for a key no read named.
  void finish() const;

  const std::string& kind() const { return kind_; }
  const std::string& name() const { return name_; }

 private:
  std::string prefix() const;

  std::string kind_, name_;
  nlohmann::json options_;
  std::vector<std::string> valid_;
};

}  // namespace booster::config
