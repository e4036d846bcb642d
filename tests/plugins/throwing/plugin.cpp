// A precision plugin whose factory throws: a booster ConfigError for a bad option, and a plain
// std::runtime_error otherwise. The host must see the first as ConfigError and the second as a
// PluginError naming the plugin.
#include <stdexcept>

#include "booster/mixed_precision/mixed_precision.h"
#include "booster/plugin/abi.h"

namespace {
std::unique_ptr<booster::mixed_precision::MixedPrecision> make_throwing(const nlohmann::json& options) {
  if (options.contains("bad_option"))
    BOOSTER_FAIL(ConfigError, "mixed precision 'throwing': unknown option 'bad_option'");
  throw std::runtime_error("the throwing plugin always throws");
}
}  // namespace

BOOSTER_EXPORT_PRECISION_PLUGIN("throwing", make_throwing)
