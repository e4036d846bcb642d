// "bf16": bfloat16 has float32's exponent range, so gradients neither underflow nor overflow where
// float32's would not: no loss scaling, and no step is ever skipped. Two recipes under one name:
//   pure = false (default): torch autocast to bfloat16 (float32 parameters, gradients and optimizer).
//   pure = true: the model itself in bfloat16 (Lightning's "bf16-true") with float32 master weights in
//                the optimizer (Note [Master weights]), so small updates are not rounded away.
#include "booster/mixed_precision/precision_strategy.h"

namespace booster::mixed_precision {
namespace {

PrecisionRecipe bf16_autocast() {
  PrecisionRecipe recipe;
  recipe.autocast_dtype = DType::BFloat16;
  return recipe;
}

PrecisionRecipe bf16_pure() {
  PrecisionRecipe recipe;
  recipe.model_dtype = DType::BFloat16;
  recipe.master_weights = true;
  return recipe;
}

std::unique_ptr<MixedPrecision> make_bf16(const nlohmann::json& options) {
  OptionReader r("bf16", options);
  const bool pure = r.flag("pure", false);
  return std::make_unique<PrecisionStrategy>(r, nlohmann::json{{"pure", pure}}, pure ? bf16_pure() : bf16_autocast());
}

const Registrar bf16_registrar("bf16", make_bf16);

}  // namespace
}  // namespace booster::mixed_precision
