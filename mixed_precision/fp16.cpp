// "fp16": PyTorch's automatic mixed precision. Parameters, gradients and optimizer state stay float32;
// the forward (and the criterion) run under autocast to float16; torch's GradScaler rule
// (TorchLossScaler) scales the loss, and the base unscales and checks the gradients in one fused pass
// before the optimizer may step (Note [The step the base owns]).
//
// Options: init_scale (65536), growth_factor (2), backoff_factor (0.5), growth_interval (2000),
// enabled (true), and min_scale (2^-24): the floor below which the scale may not fall (see Note [The
// mixed-precision step]); torch has no floor, but a scale that small means every step overflows.
#include <cmath>

#include "booster/mixed_precision/precision_strategy.h"

namespace booster::mixed_precision {
namespace {

std::unique_ptr<MixedPrecision> make_fp16(const nlohmann::json& options) {
  OptionReader r("fp16", options);
  GradScalerOptions o;
  o.init_scale = r.number("init_scale", o.init_scale, 0.0, 3.4e38, true);
  o.growth_factor = r.number("growth_factor", o.growth_factor, 1.0, 1e9, true);
  o.backoff_factor = r.number("backoff_factor", o.backoff_factor, 0.0, 1.0, true, true);
  o.growth_interval = r.integer("growth_interval", o.growth_interval, 1, int64_t(1) << 40);
  o.enabled = r.flag("enabled", o.enabled);
  const double min_scale = r.number("min_scale", std::ldexp(1.0, -24), 0.0, 3.4e38);
  r.finish();
  BOOSTER_CHECK(min_scale <= o.init_scale, ConfigError, "mixed precision 'fp16': min_scale ", min_scale,
                " must not exceed init_scale ", o.init_scale);
  const nlohmann::json values = {{"init_scale", o.init_scale},         {"growth_factor", o.growth_factor},
                                 {"backoff_factor", o.backoff_factor}, {"growth_interval", o.growth_interval},
                                 {"enabled", o.enabled},               {"min_scale", min_scale}};
  PrecisionRecipe recipe;
  recipe.autocast_dtype = DType::Float16;
  recipe.scaler = std::make_shared<TorchLossScaler>(o, min_scale);
  return std::make_unique<PrecisionStrategy>(r, values, std::move(recipe));
}

const Registrar fp16_registrar("fp16", make_fp16);

}  // namespace
}  // namespace booster::mixed_precision
