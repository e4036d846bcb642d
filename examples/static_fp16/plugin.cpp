// An example precision plugin: float16 autocast with a static loss scale.
//
// The forward (and the criterion) run under autocast to float16, as the built-in "fp16"; parameters,
// gradients and optimizer state stay float32. The loss is multiplied by a fixed `loss_scale` (default
// 1024) before backward; gradients are divided by it and checked for inf/NaN in one fused pass, and a
// step with a non-finite gradient is skipped. Unlike a dynamic GradScaler the scale never changes:
// pick one small enough never to overflow and large enough to keep small gradients out of float16's
// subnormals. (apex's "static" loss_scale, DeepSpeed's "loss_scale": N.)
//
// Built as build/lib/libbooster_precision_static_fp16.so (examples/CMakeLists.txt) and selected by
// name, e.g. from a config: "mixed_precision": {"name": "static_fp16", "loss_scale": 1024}. It uses
// only the public MixedPrecision building blocks, as any user's plugin would.
#include <cmath>
#include <limits>

#include "booster/mixed_precision/mixed_precision.h"
#include "booster/plugin/abi.h"

namespace {

using namespace booster;
using namespace booster::mixed_precision;

class StaticFp16 final : public MixedPrecision {
 public:
  explicit StaticFp16(const nlohmann::json& options) {
    OptionReader r("static_fp16", options);
    // float16's largest finite value is 65504: a larger scale overflows any loss of 1 or more.
    loss_scale_ = r.number("loss_scale", 1024.0, 0.0, 65504.0, true);
    r.finish();
  }

  std::string name() const override { return "static_fp16"; }
  nlohmann::json options() const override { return {{"loss_scale", loss_scale_}}; }

  Configured configure(nn::ModulePtr model, std::shared_ptr<optim::Optimizer> optimizer,
                       Criterion criterion) override {
    return configure_autocast(std::move(model), std::move(optimizer), std::move(criterion), DType::Float16);
  }

  double loss_scale() const override { return loss_scale_; }

  void backward(const Tensor& loss, optim::Optimizer& optimizer) override {
    unscaled_this_step_ = false;
    found_inf_ = false;
    scale_loss(loss, loss_scale_).backward();
  }

  // Divides every gradient by the scale in place and records whether any was inf/NaN, once per step.
  void unscale_gradients(optim::Optimizer& optimizer) override {
    if (unscaled_this_step_) return;
    std::vector<GradSpan> spans;
    for (const Tensor& g : flat_grads(optimizer)) spans.push_back({g, g});
    found_inf_ = fused_unscale_and_check(spans, float(1.0 / loss_scale_));
    unscaled_this_step_ = true;
  }

  double clip_grad_norm(optim::Optimizer& optimizer, double max_norm) override {
    MixedPrecision::clip_grad_norm(optimizer, max_norm);
    if (found_inf_) pending_grad_norm_ = std::numeric_limits<double>::infinity();
    return pending_grad_norm_;
  }

  void step(optim::Optimizer& optimizer) override {
    unscale_gradients(optimizer);
    if (!found_inf_) optimizer.step();
    else ++skipped_steps_;
    stats_ = StepStats{};
    stats_.loss_scale = loss_scale_;
    stats_.skipped = found_inf_;
    stats_.grad_norm = pending_grad_norm_;
    pending_grad_norm_ = std::numeric_limits<double>::quiet_NaN();
    unscaled_this_step_ = false;
    found_inf_ = false;
  }

  MixedPrecisionState state_dict() const override {
    MixedPrecisionState s;
    s.meta = {{"loss_scale", loss_scale_}, {"skipped_steps", skipped_steps_}};
    return s;
  }
  void load_state_dict(const MixedPrecisionState& state) override {
    BOOSTER_CHECK(state.meta.contains("loss_scale") && state.meta.contains("skipped_steps"), CheckpointError,
                  "static_fp16.load_state_dict: expected 'loss_scale' and 'skipped_steps', got ", state.meta.dump());
    loss_scale_ = state.meta.at("loss_scale").get<double>();
    skipped_steps_ = state.meta.at("skipped_steps").get<int64_t>();
  }

 private:
  double loss_scale_ = 1024.0;
  bool found_inf_ = false;
  int64_t skipped_steps_ = 0;
};

std::unique_ptr<MixedPrecision> make_static_fp16(const nlohmann::json& options) {
  return std::make_unique<StaticFp16>(options);
}

}  // namespace

BOOSTER_EXPORT_PRECISION_PLUGIN("static_fp16", make_static_fp16)
