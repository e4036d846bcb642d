// The `single` parallel plugin: one process, no communication (booster/booster/single_process.h).
// Loading it is what a config's "plugin": "single" does; a Booster with no plugin runs the same code
// without loading anything.
#include "booster/booster/single_process.h"

namespace {
std::unique_ptr<booster::ParallelPlugin> make_single(const nlohmann::json& options) {
  return std::make_unique<booster::SingleProcessPlugin>(options);
}
}  // namespace

BOOSTER_EXPORT_PARALLEL_PLUGIN("single", make_single)
