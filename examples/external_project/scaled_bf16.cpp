// A user's precision plugin, built out of tree against an installed booster with the precision SDK:
// bfloat16 autocast with the loss multiplied by a constant `loss_scale` (default 8) and the gradients
// divided by it before the step; a step with an inf/NaN gradient is skipped on every rank.
//   "mixed_precision": {"name": "scaled_bf16", "loss_scale": 8}
#include <booster/booster.h>

namespace {

using namespace booster;
using namespace booster::mixed_precision;

std::unique_ptr<MixedPrecision> make_scaled_bf16(const nlohmann::json& options) {
  OptionReader reader("scaled_bf16", options);
  const double loss_scale = reader.number("loss_scale", 8.0, 0.0, 1e30, /*min_exclusive=*/true);
  PrecisionRecipe recipe;
  recipe.autocast_dtype = DType::BFloat16;
  recipe.scaler = std::make_shared<ConstantLossScaler>(loss_scale);
  return std::make_unique<PrecisionStrategy>(reader, nlohmann::json{{"loss_scale", loss_scale}}, recipe);
}

}  // namespace

BOOSTER_EXPORT_PRECISION_PLUGIN("scaled_bf16", make_scaled_bf16)
