#include "booster/config/option_reader.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "booster/common/error.h"

namespace booster::config {

using nlohmann::json;

namespace {

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace

OptionReader::OptionReader(std::string kind, std::string name, const json& options)
    : kind_(std::move(kind)), name_(std::move(name)), options_(options.is_null() ? json::object() : options) {
  BOOSTER_CHECK(options_.is_object(), ConfigError, prefix(), "options must be a JSON object, got ", options_.dump());
}

std::string OptionReader::prefix() const { return kind_ + " '" + name_ + "': "; }

double OptionReader::number(const std::string& key, double fallback, double min, double max, bool min_exclusive,
                            bool max_exclusive) {
  valid_.push_back(key);
  if (!options_.contains(key)) return fallback;
  const json& v = options_.at(key);
  BOOSTER_CHECK(v.is_number(), ConfigError, prefix(), "option '", key, "' must be a number, got ", v.dump());
  const double x = v.get<double>();
  const bool low_ok = min_exclusive ? x > min : x >= min;
  const bool high_ok = max_exclusive ? x < max : x <= max;
  BOOSTER_CHECK(low_ok && high_ok && !std::isnan(x), ConfigError, prefix(), "option '", key, "' = ", v.dump(),
                " is out of range; it must be ", min_exclusive ? "> " : ">= ", min, " and ",
                max_exclusive ? "< " : "<= ", max);
  return x;
}

int64_t OptionReader::integer(const std::string& key, int64_t fallback, int64_t min, int64_t max) {
  valid_.push_back(key);
  if (!options_.contains(key)) return fallback;
  const json& v = options_.at(key);
  // An int64: not an unsigned past INT64_MAX, not a float that no int64 holds exactly.
  const bool integral =
      (v.is_number_unsigned() && v.get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max())) ||
      (v.is_number_integer() && !v.is_number_unsigned()) ||
      (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>() && std::abs(v.get<double>()) < 9.0e15);
  BOOSTER_CHECK(integral, ConfigError, prefix(), "option '", key, "' must be an integer in [", min, ", ", max,
                "], got ", v.dump().substr(0, 60));
  const int64_t x = v.get<int64_t>();
  BOOSTER_CHECK(x >= min && x <= max, ConfigError, prefix(), "option '", key, "' = ", x,
                " is out of range; it must be in [", min, ", ", max, "]");
  return x;
}

bool OptionReader::flag(const std::string& key, bool fallback) {
  valid_.push_back(key);
  if (!options_.contains(key)) return fallback;
  const json& v = options_.at(key);
  BOOSTER_CHECK(v.is_boolean(), ConfigError, prefix(), "option '", key, "' must be true or false, got ", v.dump());
  return v.get<bool>();
}

std::optional<bool> OptionReader::optional_flag(const std::string& key) {
  valid_.push_back(key);
  if (!options_.contains(key) || options_.at(key).is_null()) return std::nullopt;
  const json& v = options_.at(key);
  if (v.is_boolean()) return v.get<bool>();
  BOOSTER_CHECK(v == "True" || v == "False", ConfigError, prefix(), "option '", key,
                "' must be true, false or null, got ", v.dump());
  return v == "True";
}

std::optional<double> OptionReader::optional_number(const std::string& key, double min, double max,
                                                    bool min_exclusive, bool max_exclusive) {
  if (!options_.contains(key) || options_.at(key).is_null()) {
    valid_.push_back(key);
    return std::nullopt;
  }
  return number(key, 0.0, min, max, min_exclusive, max_exclusive);
}

std::string OptionReader::choice(const std::string& key, const std::string& fallback,
                                 const std::vector<std::string>& choices) {
  valid_.push_back(key);
  if (!options_.contains(key)) return fallback;
  const json& v = options_.at(key);
  const bool ok = v.is_string() && std::find(choices.begin(), choices.end(), v.get<std::string>()) != choices.end();
  BOOSTER_CHECK(ok, ConfigError, prefix(), "option '", key, "' = ", v.dump(), " is not valid; choose one of: ",
                join(choices));
  return v.get<std::string>();
}

json OptionReader::raw(const std::string& key, const json& fallback) {
  valid_.push_back(key);
  return options_.contains(key) ? options_.at(key) : fallback;
}

void OptionReader::finish() const {
  for (auto it = options_.begin(); it != options_.end(); ++it) {
    const bool known = std::find(valid_.begin(), valid_.end(), it.key()) != valid_.end();
    BOOSTER_CHECK(known, ConfigError, prefix(), "unknown option '", it.key(), "'; ",
                  valid_.empty() ? std::string("it takes no options") : "valid options are: " + join(valid_));
  }
}

}  // namespace booster::config
