// A test plugin built for a plugin ABI version the host does not have: loading it must fail with a
// PluginError naming both versions and the file, before its factory is ever called (the factory
// aborts, so a host that called it would crash the test).
#include <cstdlib>

#include "booster/mixed_precision/mixed_precision.h"
#include "booster/plugin/abi.h"

namespace {
booster::mixed_precision::MixedPrecision* never_called(const nlohmann::json&) { std::abort(); }
}  // namespace

BOOSTER_EXPORT_PLUGIN_WITH_ABI(precision, "bad_abi", never_called, BOOSTER_PLUGIN_ABI_VERSION + 1000)
