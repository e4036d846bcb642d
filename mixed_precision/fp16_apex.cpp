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
#include <cmath>
#include <optional>

#include "booster/nn/normalization.h"
#include "booster/ops/ops.h"
#include "booster/mixed_precision/master_weight_strategy.h"

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

// apex's LossScaler (apex/amp/scaler.py).
class ApexLossScaler {
 public:
  ApexLossScaler() = default;
  ApexLossScaler(bool dynamic, double static_scale, std::optional<double> min_scale, double max_scale)
      : dynamic_(dynamic), min_scale_(min_scale), max_scale_(max_scale),
        scale_(dynamic ? std::min(max_scale, 65536.0) : static_scale) {}
  double scale() const { return scale_; }
  bool dynamic() const { return dynamic_; }
  void update(bool overflow) {
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
  nlohmann::json state_dict() const { return {{"loss_scale", scale_}, {"unskipped", unskipped_}}; }
  void load_state_dict(const nlohmann::json& s) {
    BOOSTER_CHECK(s.contains("loss_scale") && s.contains("unskipped"), CheckpointError,
                  "fp16_apex.load_state_dict: expected keys loss_scale and unskipped in ", s.dump());
    scale_ = s.at("loss_scale").get<double>();
    unskipped_ = s.at("unskipped").get<int64_t>();
  }

 private:
  static constexpr int64_t kScaleWindow = 2000;
  bool dynamic_ = true;
  std::optional<double> min_scale_;
  double max_scale_ = 16777216.0;
  double scale_ = 65536.0;
  int64_t unskipped_ = 0;
};

// A boolean override: nullopt when absent or null (no override).
std::optional<bool> read_optional_bool(OptionReader& r, const std::string& key) {
  const nlohmann::json v = r.raw(key, nullptr);
  if (v.is_null()) return std::nullopt;
  if (v.is_boolean()) return v.get<bool>();
  // apex accepts the strings "True" and "False" (from argparse).
  if (v.is_string() && (v == "True" || v == "False")) return v == "True";
  BOOSTER_FAIL(ConfigError, "mixed precision 'fp16_apex': option '", key, "' must be true, false or null, got ",
               v.dump());
}

class Fp16Apex final : public MasterWeightStrategy {
 public:
  explicit Fp16Apex(const nlohmann::json& options) : MasterWeightStrategy(DType::Float16, true, false) {
    OptionReader r("fp16_apex", options);
    const nlohmann::json level = r.raw("opt_level", "O1");
    const bool known = level.is_string() &&
                       std::find(kOptLevels.begin(), kOptLevels.end(), level.get<std::string>()) != kOptLevels.end();
    BOOSTER_CHECK(known, ConfigError, "mixed precision 'fp16_apex': unexpected opt_level ", level.dump(),
                  "; options are 'O0', 'O1', 'O2', 'O3' (the prefix is the letter O, not the number zero)");
    opt_level_ = level.get<std::string>();
    p_ = level_properties(opt_level_);
    const bool o1 = opt_level_ == "O1";

    // As amp.initialize: an override that is null is no override.
    const nlohmann::json cast = r.raw("cast_model_type", nullptr);
    if (!cast.is_null()) {
      if (cast == false) {
        p_.cast_model_type.reset();
      } else {
        BOOSTER_CHECK(cast.is_string() && (cast == "float16" || cast == "float32"), ConfigError,
                      "mixed precision 'fp16_apex': option 'cast_model_type' must be \"float16\", \"float32\", false "
                      "or null, got ", cast.dump());
        p_.cast_model_type = cast == "float16" ? DType::Float16 : DType::Float32;
      }
      BOOSTER_CHECK(!o1 || cast == false || cast == "float32", ConfigError,
                    "fp16_apex: O1 inserts casts around Torch functions rather than model weights, so with O1, the "
                    "model weights themselves should remain FP32. If you wish to cast the model to a different type, "
                    "use opt_level='O2' or 'O3'. cast_model_type was ", cast.dump());
    }
    const nlohmann::json patch = r.raw("patch_torch_functions", nullptr);
    if (!patch.is_null()) {
      BOOSTER_CHECK(patch.is_boolean(), ConfigError, "mixed precision 'fp16_apex': option 'patch_torch_functions' "
                    "must be true, false or null, got ", patch.dump());
      BOOSTER_CHECK(o1 || !patch.get<bool>(), ConfigError, "fp16_apex: currently, patch_torch_functions=True should "
                    "only be set by selecting opt_level='O1'.");
      p_.patch_torch_functions = patch.get<bool>();
    }
    if (const std::optional<bool> bn = read_optional_bool(r, "keep_batchnorm_fp32")) {
      BOOSTER_CHECK(!o1, ConfigError, "fp16_apex: with opt_level O1, batchnorm functions are automatically patched "
                    "to run in FP32, so keep_batchnorm_fp32 should be None. keep_batchnorm_fp32 was ", *bn);
      p_.keep_batchnorm_fp32 = bn;
    }
    if (const std::optional<bool> mw = read_optional_bool(r, "master_weights")) {
      BOOSTER_CHECK(!o1, ConfigError, "fp16_apex: it doesn't make sense to use master_weights with O1. With O1, "
                    "your model weights themselves should be FP32.");
      p_.master_weights = mw;
    }

    const nlohmann::json ls = r.raw("loss_scale", p_.dynamic ? nlohmann::json("dynamic") : nlohmann::json(p_.static_scale));
    if (ls == "dynamic") {
      p_.dynamic = true;
    } else {
      BOOSTER_CHECK(ls.is_number() && ls.get<double>() > 0, ConfigError,
                    "mixed precision 'fp16_apex': option 'loss_scale' must be \"dynamic\" or a positive number, got ",
                    ls.dump());
      p_.dynamic = false;
      p_.static_scale = ls.get<double>();
    }
    const nlohmann::json min_ls = r.raw("min_loss_scale", nullptr);
    BOOSTER_CHECK(min_ls.is_null() || (min_ls.is_number() && min_ls.get<double>() > 0), ConfigError,
                  "mixed precision 'fp16_apex': option 'min_loss_scale' must be null or a positive number, got ",
                  min_ls.dump());
    if (!min_ls.is_null()) min_loss_scale_ = min_ls.get<double>();
    max_loss_scale_ = r.number("max_loss_scale", 16777216.0, 0.0, 3.4e38, true);
    r.finish();
    BOOSTER_CHECK(!min_loss_scale_ || *min_loss_scale_ <= max_loss_scale_, ConfigError,
                  "mixed precision 'fp16_apex': min_loss_scale ", min_loss_scale_.value_or(0),
                  " must not exceed max_loss_scale ", max_loss_scale_);
    scaler_ = ApexLossScaler(p_.dynamic, p_.static_scale, min_loss_scale_, max_loss_scale_);
    skip_on_overflow_ = p_.dynamic;
  }

  std::string name() const override { return "fp16_apex"; }
  nlohmann::json options() const override {
    nlohmann::json j;
    j["opt_level"] = opt_level_;
    j["cast_model_type"] = p_.cast_model_type ? nlohmann::json(dtype_name(*p_.cast_model_type)) : nlohmann::json();
    j["patch_torch_functions"] = p_.patch_torch_functions;
    j["keep_batchnorm_fp32"] = p_.keep_batchnorm_fp32 ? nlohmann::json(*p_.keep_batchnorm_fp32) : nlohmann::json();
    j["master_weights"] = p_.master_weights ? nlohmann::json(*p_.master_weights) : nlohmann::json();
    j["loss_scale"] = p_.dynamic ? nlohmann::json("dynamic") : nlohmann::json(p_.static_scale);
    j["min_loss_scale"] = min_loss_scale_ ? nlohmann::json(*min_loss_scale_) : nlohmann::json();
    j["max_loss_scale"] = max_loss_scale_;
    return j;
  }

  Configured configure(nn::ModulePtr model, std::shared_ptr<optim::Optimizer> optimizer,
                       Criterion criterion) override {
    const bool cast16 = p_.cast_model_type == DType::Float16;
    const bool keep_bn = p_.keep_batchnorm_fp32.value_or(false);
    const nn::ModuleFilter convert_if = [keep_bn](const nn::Module& m) { return !(keep_bn && nn::is_batch_norm(m)); };
    use_masters_ = cast16 && p_.master_weights.value_or(false);
    Configured c;
    if (use_masters_) {
      c = configure_masters(model, optimizer, criterion, convert_if);
    } else if (cast16) {
      // O3: the converted parameters are stepped directly, by a fresh optimizer of the same kind.
      std::vector<optim::ParamGroup> groups;
      if (optimizer) groups = optimizer->param_groups();
      model->to(DType::Float16, convert_if);
      if (optimizer) c.optimizer = rebuild_optimizer(*optimizer, std::move(groups));
      c.model = model;
      c.criterion = criterion;
    } else {
      c = {model, optimizer, criterion};
    }
    if (cast16 || p_.patch_torch_functions) {
      PrecisionModule::Options mo;
      mo.cast_io = cast16;
      mo.input_dtype = DType::Float16;
      mo.autocast = p_.patch_torch_functions;
      mo.autocast_dtype = DType::Float16;
      c.model = std::make_shared<PrecisionModule>(model, mo);
    }
    if (p_.patch_torch_functions) c.criterion = autocast_criterion(c.criterion, DType::Float16);
    return c;
  }

  // Without master weights: unscale and check the optimizer's own flat gradients in place.
  void backward(const Tensor& loss, optim::Optimizer& optimizer) override {
    if (use_masters_) return MasterWeightStrategy::backward(loss, optimizer);
    unscaled_ = false;
    scale_loss(loss, scaler_.scale()).backward();
  }
  void unscale_gradients(optim::Optimizer& optimizer) override {
    if (use_masters_) return MasterWeightStrategy::unscale_gradients(optimizer);
    if (unscaled_) return;
    std::vector<GradSpan> spans;
    for (const Tensor& g : flat_grads(optimizer)) spans.push_back({g, g});
    found_inf_ = agree_on_found_inf(fused_unscale_and_check(spans, float(1.0 / scaler_.scale()))) && scaler_.dynamic();
    unscaled_ = true;
  }
  double clip_grad_norm(optim::Optimizer& optimizer, double max_norm) override {
    if (use_masters_) return MasterWeightStrategy::clip_grad_norm(optimizer, max_norm);
    MixedPrecision::clip_grad_norm(optimizer, max_norm);  // calls unscale_gradients first
    if (found_inf_) pending_grad_norm_ = std::numeric_limits<double>::infinity();
    return pending_grad_norm_;
  }
  void step(optim::Optimizer& optimizer) override {
    if (use_masters_) return MasterWeightStrategy::step(optimizer);
    unscale_gradients(optimizer);
    stats_ = StepStats{};
    stats_.loss_scale = scaler_.scale();
    stats_.skipped = found_inf_;
    stats_.grad_norm = pending_grad_norm_;
    if (!found_inf_) optimizer.step();
    pending_grad_norm_ = std::numeric_limits<double>::quiet_NaN();
    unscaled_ = false;
    scaler_.update(found_inf_);
  }

  MixedPrecisionState state_dict() const override {
    if (use_masters_) return MasterWeightStrategy::state_dict();
    MixedPrecisionState s;
    s.meta["scaler"] = scaler_.state_dict();
    return s;
  }
  void load_state_dict(const MixedPrecisionState& state) override {
    if (use_masters_) return MasterWeightStrategy::load_state_dict(state);
    BOOSTER_CHECK(state.meta.contains("scaler"), CheckpointError, "fp16_apex.load_state_dict: no 'scaler' in ",
                  state.meta.dump());
    scaler_.load_state_dict(state.meta.at("scaler"));
  }

 protected:
  double current_scale() const override { return scaler_.scale(); }
  void update_scale(bool found_inf) override { scaler_.update(found_inf); }
  nlohmann::json scaler_state() const override { return scaler_.state_dict(); }
  void load_scaler_state(const nlohmann::json& state) override { scaler_.load_state_dict(state); }

 private:
  std::string opt_level_;
  ApexProperties p_;
  std::optional<double> min_loss_scale_;
  double max_loss_scale_ = 16777216.0;
  ApexLossScaler scaler_;
  bool use_masters_ = false;
  bool unscaled_ = false;
  bool found_inf_ = false;
};

const Registrar fp16_apex_registrar("fp16_apex", [](const nlohmann::json& o) { return std::make_unique<Fp16Apex>(o); });

}  // namespace
}  // namespace booster::mixed_precision
