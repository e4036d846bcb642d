// "bf16": bfloat16 has float32's exponent range, so gradients neither underflow nor overflow where
// float32's would not: no loss scaling, and no step is ever skipped.
//   pure = false (default): torch autocast to bfloat16 (float32 parameters, gradients and optimizer).
//   pure = true: the model itself in bfloat16 (Lightning's "bf16-true") with float32 master weights in
//                the optimizer (Note [Master weights]), so small updates are not rounded away.
#include "booster/mixed_precision/master_weight_strategy.h"

namespace booster::mixed_precision {
namespace {

class Bf16 final : public MasterWeightStrategy {
 public:
  explicit Bf16(const nlohmann::json& options) : MasterWeightStrategy(DType::BFloat16, false, false) {
    OptionReader r("bf16", options);
    pure_ = r.flag("pure", false);
    r.finish();
  }

  std::string name() const override { return "bf16"; }
  nlohmann::json options() const override { return {{"pure", pure_}}; }

  Configured configure(nn::ModulePtr model, std::shared_ptr<optim::Optimizer> optimizer,
                       Criterion criterion) override {
    if (pure_) return configure_masters(std::move(model), std::move(optimizer), std::move(criterion));
    return configure_autocast(std::move(model), std::move(optimizer), std::move(criterion), DType::BFloat16);
  }

  // Autocast: the plain unscaled step of the base; pure: the master-weight step.
  void backward(const Tensor& loss, optim::Optimizer& optimizer) override {
    if (pure_) MasterWeightStrategy::backward(loss, optimizer);
    else MixedPrecision::backward(loss, optimizer);
  }
  void unscale_gradients(optim::Optimizer& optimizer) override {
    if (pure_) MasterWeightStrategy::unscale_gradients(optimizer);
    else MixedPrecision::unscale_gradients(optimizer);
  }
  double clip_grad_norm(optim::Optimizer& optimizer, double max_norm) override {
    return pure_ ? MasterWeightStrategy::clip_grad_norm(optimizer, max_norm)
                 : MixedPrecision::clip_grad_norm(optimizer, max_norm);
  }
  void step(optim::Optimizer& optimizer) override {
    if (pure_) MasterWeightStrategy::step(optimizer);
    else MixedPrecision::step(optimizer);
  }
  MixedPrecisionState state_dict() const override {
    return pure_ ? MasterWeightStrategy::state_dict() : MixedPrecisionState{};
  }
  void load_state_dict(const MixedPrecisionState& state) override {
    if (pure_) MasterWeightStrategy::load_state_dict(state);
  }

 private:
  bool pure_ = false;
};

const Registrar bf16_registrar("bf16", [](const nlohmann::json& o) { return std::make_unique<Bf16>(o); });

}  // namespace
}  // namespace booster::mixed_precision
