// "fp32" (alias "no"): full precision. The model, optimizer and criterion are used as given, the loss is
// not scaled and no step is ever skipped: the empty recipe.
#include "booster/mixed_precision/precision_strategy.h"

namespace booster::mixed_precision {
namespace {

std::unique_ptr<MixedPrecision> make_fp32(const std::string& name, const nlohmann::json& options) {
  return std::make_unique<PrecisionStrategy>(OptionReader(name, options), nlohmann::json::object(), PrecisionRecipe{});
}

const Registrar fp32_registrar("fp32", [](const nlohmann::json& o) { return make_fp32("fp32", o); });
const Registrar no_registrar("no", [](const nlohmann::json& o) { return make_fp32("no", o); });

}  // namespace
}  // namespace booster::mixed_precision
