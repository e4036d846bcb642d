// "fp16": PyTorch's automatic mixed precision. Parameters, gradients and optimizer state stay float32;
// the forward (and the criterion) run under autocast to float16; a GradScaler scales the loss, and
// unscales and checks the gradients in one fused pass before the optimizer may step.
//
// Options: init_scale (65536), growth_factor (2), backoff_factor (0.5), growth_interval (2000),
// enabled (true), and min_scale (2^-24): the floor below which the scale may not fall (see Note [The
// mixed-precision step]); torch has no floor, but a scale that small means every step overflows.
#include <cmath>

#include "booster/mixed_precision/mixed_precision.h"
#include "booster/mixed_precision/grad_scaler.h"

namespace booster::mixed_precision {
namespace {

class Fp16Autocast final : public MixedPrecision {
 public:
  explicit Fp16Autocast(const nlohmann::json& options) {
    OptionReader r("fp16", options);
    GradScalerOptions o;
    o.init_scale = r.number("init_scale", o.init_scale, 0.0, 3.4e38, true);
    o.growth_factor = r.number("growth_factor", o.growth_factor, 1.0, 1e9, true);
    o.backoff_factor = r.number("backoff_factor", o.backoff_factor, 0.0, 1.0, true, true);
    o.growth_interval = r.integer("growth_interval", o.growth_interval, 1, int64_t(1) << 40);
    o.enabled = r.flag("enabled", o.enabled);
    min_scale_ = r.number("min_scale", std::ldexp(1.0, -24), 0.0, 3.4e38);
    r.finish();
    BOOSTER_CHECK(min_scale_ <= o.init_scale, ConfigError, "mixed precision 'fp16': min_scale ", min_scale_,
                  " must not exceed init_scale ", o.init_scale);
    scaler_ = GradScaler(o);
  }

  std::string name() const override { return "fp16"; }
  nlohmann::json options() const override {
    const GradScalerOptions& o = scaler_.options();
    return {{"init_scale", o.init_scale},         {"growth_factor", o.growth_factor},
            {"backoff_factor", o.backoff_factor}, {"growth_interval", o.growth_interval},
            {"enabled", o.enabled},               {"min_scale", min_scale_}};
  }

  Configured configure(nn::ModulePtr model, std::shared_ptr<optim::Optimizer> optimizer,
                       Criterion criterion) override {
    return configure_autocast(std::move(model), std::move(optimizer), std::move(criterion), DType::Float16);
  }

  double loss_scale() const override { return scaler_.get_scale(); }

  void set_found_inf_reducer(FoundInfReducer reducer) override { scaler_.set_found_inf_reducer(std::move(reducer)); }

  void backward(const Tensor& loss, optim::Optimizer& optimizer) override {
    unscaled_this_step_ = false;
    scaler_.scale(loss).backward();
  }

  void unscale_gradients(optim::Optimizer& optimizer) override {
    if (!scaler_.unscaled(optimizer)) scaler_.unscale_(optimizer);
  }

  double clip_grad_norm(optim::Optimizer& optimizer, double max_norm) override {
    MixedPrecision::clip_grad_norm(optimizer, max_norm);
    if (scaler_.found_inf(optimizer)) pending_grad_norm_ = std::numeric_limits<double>::infinity();
    return pending_grad_norm_;
  }

  void step(optim::Optimizer& optimizer) override {
    const double used_scale = scaler_.get_scale();
    const bool stepped = scaler_.step(optimizer);
    scaler_.update();
    stats_ = StepStats{};
    stats_.loss_scale = used_scale;
    stats_.skipped = !stepped;
    stats_.grad_norm = pending_grad_norm_;
    pending_grad_norm_ = std::numeric_limits<double>::quiet_NaN();
    BOOSTER_CHECK(!scaler_.is_enabled() || scaler_.get_scale() >= min_scale_, TrainingError,
                  "fp16: the loss scale fell to ", scaler_.get_scale(), ", below its floor min_scale = ", min_scale_,
                  ": gradients overflow even at the smallest allowed scale, so the run has diverged; lower the "
                  "learning rate or use bf16");
  }

  MixedPrecisionState state_dict() const override {
    MixedPrecisionState s;
    s.meta["scaler"] = scaler_.state_dict();
    return s;
  }
  void load_state_dict(const MixedPrecisionState& state) override {
    BOOSTER_CHECK(state.meta.contains("scaler"), CheckpointError, "fp16.load_state_dict: no 'scaler' entry in ",
                  state.meta.dump());
    scaler_.load_state_dict(state.meta.at("scaler"));
  }

  const GradScaler& scaler() const { return scaler_; }

 private:
  GradScaler scaler_;
  double min_scale_ = 0;
};

const Registrar fp16_registrar("fp16", [](const nlohmann::json& o) { return std::make_unique<Fp16Autocast>(o); });

}  // namespace
}  // namespace booster::mixed_precision
