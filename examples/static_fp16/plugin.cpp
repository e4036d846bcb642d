// An example precision plugin: float16 autocast with a fixed loss scale (apex's and DeepSpeed's static
// loss_scale). It is the recipe only; the SDK's PrecisionStrategy does the step. mixed_precision/README.md
// walks through it. Select it as "mixed_precision": {"name": "static_fp16", "loss_scale": 1024}.
#include "booster/mixed_precision/precision_strategy.h"
#include "booster/plugin/abi.h"

namespace {

using namespace booster;
using namespace booster::mixed_precision;

std::unique_ptr<MixedPrecision> make_static_fp16(const nlohmann::json& options) {
  OptionReader reader("static_fp16", options);
  // float16's largest finite value is 65504: a larger scale overflows any loss of 1 or more.
  const double loss_scale = reader.number("loss_scale", 1024.0, 0.0, 65504.0, /*min_exclusive=*/true);

  PrecisionRecipe recipe;
  recipe.autocast_dtype = DType::Float16;  // forward and criterion under float16 autocast
  recipe.scaler = std::make_shared<ConstantLossScaler>(loss_scale);  // skips non-finite steps
  return std::make_unique<PrecisionStrategy>(reader, nlohmann::json{{"loss_scale", loss_scale}}, recipe);
}

}  // namespace

BOOSTER_EXPORT_PRECISION_PLUGIN("static_fp16", make_static_fp16)
