// "fp16_apex": NVIDIA apex.amp's optimization levels, as properties (apex/amp/frontend.py):
//
//   level  cast_model_type  patch_torch_functions  keep_batchnorm_fp32  master_weights  loss_scale
//   O0     float32          false                  null                 false           1.0
//   O1     null             true                   null                 null            "dynamic"
//   O2     float16          false                  true                 true            "dynamic"
//   O3     float16          false                  false                false           1.0
//
// Any property may be overridden by an option of the same name, with apex's consistency checks (O1
// patches functions instead of casting weights, so it refuses cast_model_type other than float32,
// keep_batchnorm_fp32 and master_weights, and only O1 may set patch_torch_functions; a null override
// is no override, as in amp.initialize). Here:
//   cast_model_type float16      -> the model is converted (batch norm kept float32 when
//                                   keep_batchnorm_fp32), inputs go in as float16, outputs come out
//                                   float32;
//   patch_torch_functions        -> the forward and criterion run under float16 autocast;
//   master_weights               -> float32 masters (Note [Master weights]); without them a converted
//                                   model is stepped directly in float16 (O3);
//   loss_scale "dynamic"         -> apex's LossScaler: start at min(max_loss_scale, 2^16), halve on
//                                   overflow (not below min_loss_scale) and skip the step, double after
//                                   2000 clean steps (not above max_loss_scale, default 2^24);
//   loss_scale <number>          -> a static scale: gradients are unscaled, never checked, never skipped.
// Floor: a backoff due while the dynamic scale is already at its floor (min_loss_scale, or 2^-24 when
// unset) throws TrainingError (Note [The mixed-precision step]).
// The properties become a PrecisionRecipe (precision_strategy.h), with apex's LossScaler behind the
// LossScaler interface; the step is the SDK's.
#include <cmath>
#include <limits>
#include <optional>

#include "booster/nn/normalization.h"
#include "booster/ops/ops.h"
#include "booster/mixed_precision/precision_strategy.h"

namespace booster::mixed_precision {
namespace {

const std::vector<std::string> kOptLevels = {"O0", "O1", "O2", "O3"};

struct ApexProperties {
  std::optional<DType> cast_model_type;  // nullopt: apex's None (do not cast)
  bool patch_torch_functions = false;
  std::optional<bool> keep_batchnorm_fp32;
  std::optional<bool> master_weights;
  bool dynamic = true;
  double static_scale = 1.0;
};

ApexProperties level_properties(const std::string& level) {
  ApexProperties p;
  if (level == "O0") {
    p.cast_model_type = DType::Float32;
    p.master_weights = false;
    p.dynamic = false;
  } else if (level == "O1") {
    p.patch_torch_functions = true;
  } else if (level == "O2") {
    p.cast_model_type = DType::Float16;
    p.keep_batchnorm_fp32 = true;
    p.master_weights = true;
  } else {  // O3
    p.cast_model_type = DType::Float16;
    p.keep_batchnorm_fp32 = false;
    p.master_weights = false;
    p.dynamic = false;
  }
  return p;
}

// apex's LossScaler (apex/amp/scaler.py). Static, it divides the gradients but never checks them.
class ApexLossScaler final : public LossScaler {
 public:
  ApexLossScaler(bool dynamic, double static_scale, std::optional<double> min_scale, double max_scale)
      : dynamic_(dynamic), min_scale_(min_scale), max_scale_(max_scale),
        scale_(dynamic ? std::min(max_scale, 65536.0) : static_scale) {}
  double scale() const override { return scale_; }
  bool skips_non_finite() const override { return dynamic_; }
  void update(bool overflow) override {
    if (!dynamic_) return;
    if (overflow) {
      const double floor = min_scale_.value_or(std::ldexp(1.0, -24));
      BOOSTER_CHECK(scale_ > floor, TrainingError, "fp16_apex: gradients overflowed with the loss scale already at "
                    "its floor ", floor, "; the run has diverged (lower the learning rate, or use bf16)");
      scale_ = min_scale_ ? std::max(*min_scale_, scale_ / 2.0) : scale_ / 2.0;
      unskipped_ = 0;
    } else {
      unskipped_ += 1;
    }
    if (unskipped_ == kScaleWindow) {
      scale_ = std::min(max_scale_, scale_ * 2.0);
      unskipped_ = 0;
    }
  }
  // apex's amp.state_dict() per scaler: {"loss_scale", "unskipped"}.
  nlohmann::json state_dict() const override { return {{"loss_scale", scale_}, {"unskipped", unskipped_}}; }
  void load_state_dict(const nlohmann::json& s) override {
    BOOSTER_CHECK(s.contains("loss_scale") && s.contains("unskipped"), CheckpointError,
                  "fp16_apex.load_state_dict: expected keys loss_scale and unskipped in ", s.dump());
    scale_ = s.at("loss_scale").get<double>();
    unskipped_ = s.at("unskipped").get<int64_t>();
  }

 private:
  static constexpr int64_t kScaleWindow = 2000;
  bool dynamic_;
  std::optional<double> min_scale_;
  double max_scale_;
  double scale_;
  int64_t unskipped_ = 0;
};

std::unique_ptr<MixedPrecision> make_fp16_apex(const nlohmann::json& options) {
  OptionReader r("fp16_apex", options);
  const nlohmann::json level = r.raw("opt_level", "O1");
  const bool known = level.is_string() &&
                     std::find(kOptLevels.begin(), kOptLevels.end(), level.get<std::string>()) != kOptLevels.end();
  BOOSTER_CHECK(known, ConfigError, "mixed precision 'fp16_apex': unexpected opt_level ", level.dump(),
                "; options are 'O0', 'O1', 'O2', 'O3' (the prefix is the letter O, not the number zero)");
  const std::string opt_level = level.get<std::string>();
  ApexProperties p = level_properties(opt_level);
  const bool o1 = opt_level == "O1";

  // As amp.initialize: an override that is null is no override.
  const nlohmann::json cast = r.raw("cast_model_type", nullptr);
  if (!cast.is_null()) {
    if (cast == false) {
      p.cast_model_type.reset();
    } else {
      BOOSTER_CHECK(cast.is_string() && (cast == "float16" || cast == "float32"), ConfigError,
                    "mixed precision 'fp16_apex': option 'cast_model_type' must be \"float16\", \"float32\", false "
                    "or null, got ", cast.dump());
      p.cast_model_type = cast == "float16" ? DType::Float16 : DType::Float32;
    }
    BOOSTER_CHECK(!o1 || cast == false || cast == "float32", ConfigError,
                  "fp16_apex: O1 inserts casts around Torch functions rather than model weights, so with O1, the "
                  "model weights themselves should remain FP32. If you wish to cast the model to a different type, "
                  "use opt_level='O2' or 'O3'. cast_model_type was ", cast.dump());
  }
  if (const std::optional<bool> patch = r.optional_flag("patch_torch_functions")) {
    BOOSTER_CHECK(o1 || !*patch, ConfigError, "fp16_apex: currently, patch_torch_functions=True should only be set "
                  "by selecting opt_level='O1'.");
    p.patch_torch_functions = *patch;
  }
  if (const std::optional<bool> bn = r.optional_flag("keep_batchnorm_fp32")) {
    BOOSTER_CHECK(!o1, ConfigError, "fp16_apex: with opt_level O1, batchnorm functions are automatically patched "
                  "to run in FP32, so keep_batchnorm_fp32 should be None. keep_batchnorm_fp32 was ", *bn);
    p.keep_batchnorm_fp32 = bn;
  }
  if (const std::optional<bool> mw = r.optional_flag("master_weights")) {
    BOOSTER_CHECK(!o1, ConfigError, "fp16_apex: it doesn't make sense to use master_weights with O1. With O1, "
                  "your model weights themselves should be FP32.");
    p.master_weights = mw;
  }

  const nlohmann::json ls = r.raw("loss_scale", p.dynamic ? nlohmann::json("dynamic") : nlohmann::json(p.static_scale));
  if (ls == "dynamic") {
    p.dynamic = true;
  } else {
    BOOSTER_CHECK(ls.is_number() && ls.get<double>() > 0, ConfigError,
                  "mixed precision 'fp16_apex': option 'loss_scale' must be \"dynamic\" or a positive number, got ",
                  ls.dump());
    p.dynamic = false;
    p.static_scale = ls.get<double>();
  }
  const std::optional<double> min_loss_scale = r.optional_number("min_loss_scale", 0.0, std::numeric_limits<double>::max(), true);
  const double max_loss_scale = r.number("max_loss_scale", 16777216.0, 0.0, 3.4e38, true);
  r.finish();
  BOOSTER_CHECK(!min_loss_scale || *min_loss_scale <= max_loss_scale, ConfigError,
                "mixed precision 'fp16_apex': min_loss_scale ", min_loss_scale.value_or(0),
                " must not exceed max_loss_scale ", max_loss_scale);
  nlohmann::json j;
  j["opt_level"] = opt_level;
  j["cast_model_type"] = p.cast_model_type ? nlohmann::json(dtype_name(*p.cast_model_type)) : nlohmann::json();
  j["patch_torch_functions"] = p.patch_torch_functions;
  j["keep_batchnorm_fp32"] = p.keep_batchnorm_fp32 ? nlohmann::json(*p.keep_batchnorm_fp32) : nlohmann::json();
  j["master_weights"] = p.master_weights ? nlohmann::json(*p.master_weights) : nlohmann::json();
  j["loss_scale"] = p.dynamic ? nlohmann::json("dynamic") : nlohmann::json(p.static_scale);
  j["min_loss_scale"] = min_loss_scale ? nlohmann::json(*min_loss_scale) : nlohmann::json();
  j["max_loss_scale"] = max_loss_scale;

  // The properties as a recipe.
  PrecisionRecipe recipe;
  const bool cast16 = p.cast_model_type == DType::Float16;
  if (cast16) {
    recipe.model_dtype = DType::Float16;
    if (p.keep_batchnorm_fp32.value_or(false))
      recipe.convert_if = [](const nn::Module& m) { return !nn::is_batch_norm(m); };
    recipe.master_weights = p.master_weights.value_or(false);
  }
  if (p.patch_torch_functions) recipe.autocast_dtype = DType::Float16;
  recipe.scaler = std::make_shared<ApexLossScaler>(p.dynamic, p.static_scale, min_loss_scale, max_loss_scale);
  return std::make_unique<PrecisionStrategy>(r, j, std::move(recipe));
}

const Registrar fp16_apex_registrar("fp16_apex", make_fp16_apex);

}  // namespace
}  // namespace booster::mixed_precision
