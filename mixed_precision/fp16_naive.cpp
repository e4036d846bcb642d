// "fp16_naive": ColossalAI's naive AMP / Megatron's float16 optimizer. The whole model is float16;
// a MasterWeightOptimizer keeps float32 masters (Note [Master weights]); a DynamicGradScaler with
// hysteresis (HysteresisLossScaler, Note [Hysteresis]) scales the float32 loss, and the gathered
// gradients are unscaled and checked in the same pass that moves them into the masters.
//
// Options: initial_scale (2^16), min_scale (1), growth_factor (2), backoff_factor (0.5),
// growth_interval (1000), hysteresis (2), max_scale (2^32), log_num_zeros_in_grad (false: when true,
// each step's statistics count the zero elements of the unscaled master gradients).
#include "booster/mixed_precision/precision_strategy.h"

namespace booster::mixed_precision {
namespace {

DynamicGradScalerOptions read_scaler_options(OptionReader& r) {
  DynamicGradScalerOptions o;
  const double big = 3.4e38;
  o.initial_scale = r.number("initial_scale", o.initial_scale, 0.0, big, true);
  o.min_scale = r.number("min_scale", o.min_scale, 0.0, big, true);
  o.growth_factor = r.number("growth_factor", o.growth_factor, 1.0, 1e9, true);
  o.backoff_factor = r.number("backoff_factor", o.backoff_factor, 0.0, 1.0, true, true);
  o.growth_interval = r.integer("growth_interval", o.growth_interval, 1, int64_t(1) << 40);
  o.hysteresis = r.integer("hysteresis", o.hysteresis, 1, int64_t(1) << 40);
  o.max_scale = r.number("max_scale", o.max_scale, 0.0, big, true);
  BOOSTER_CHECK(o.min_scale <= o.initial_scale, ConfigError, "mixed precision '", r.strategy(), "': min_scale ",
                o.min_scale, " must be <= initial_scale ", o.initial_scale);
  BOOSTER_CHECK(o.max_scale >= o.initial_scale, ConfigError, "mixed precision '", r.strategy(), "': max_scale ",
                o.max_scale, " must be >= initial_scale ", o.initial_scale);
  return o;
}

std::unique_ptr<MixedPrecision> make_fp16_naive(const nlohmann::json& options) {
  OptionReader r("fp16_naive", options);
  const DynamicGradScalerOptions o = read_scaler_options(r);
  PrecisionRecipe recipe;
  recipe.model_dtype = DType::Float16;
  recipe.master_weights = true;
  recipe.count_zeros = r.flag("log_num_zeros_in_grad", false);
  r.finish();
  recipe.scaler = std::make_shared<HysteresisLossScaler>(o);
  const nlohmann::json values = {{"initial_scale", o.initial_scale},     {"min_scale", o.min_scale},
                                 {"growth_factor", o.growth_factor},     {"backoff_factor", o.backoff_factor},
                                 {"growth_interval", o.growth_interval}, {"hysteresis", o.hysteresis},
                                 {"max_scale", o.max_scale},             {"log_num_zeros_in_grad", recipe.count_zeros}};
  return std::make_unique<PrecisionStrategy>(r, values, std::move(recipe));
}

const Registrar fp16_naive_registrar("fp16_naive", make_fp16_naive);

}  // namespace
}  // namespace booster::mixed_precision
