// A user's precision plugin, built out of tree against an installed booster: bfloat16 autocast with
// the loss multiplied by a constant `loss_scale` (default 1) and the gradients divided by it before
// the step, e.g. to keep tiny gradients of a bf16 activation path away from bfloat16's coarse ulp.
//   "mixed_precision": {"name": "scaled_bf16", "loss_scale": 8}
#include <booster/booster.h>

using namespace booster;
using namespace booster::mixed_precision;

namespace {

class ScaledBf16 final : public MixedPrecision {
 public:
  explicit ScaledBf16(const nlohmann::json& options) {
    OptionReader reader("scaled_bf16", options);
    scale_ = reader.number("loss_scale", 1.0, 0.0, 1e30, /*min_exclusive=*/true);
    reader.finish();
  }
  std::string name() const override { return "scaled_bf16"; }
  nlohmann::json options() const override { return {{"loss_scale", scale_}}; }
  Configured configure(nn::ModulePtr model, std::shared_ptr<optim::Optimizer> optimizer, Criterion criterion) override {
    return configure_autocast(std::move(model), std::move(optimizer), std::move(criterion), DType::BFloat16);
  }
  double loss_scale() const override { return scale_; }
  void backward(const Tensor& loss, optim::Optimizer&) override { scale_loss(loss, scale_).backward(); }
  void step(optim::Optimizer& optimizer) override {
    scale_grads(flat_grads(optimizer), float(1.0 / scale_));
    optimizer.step();
  }

 private:
  double scale_ = 1.0;
};

std::unique_ptr<MixedPrecision> make(const nlohmann::json& options) { return std::make_unique<ScaledBf16>(options); }

}  // namespace

BOOSTER_EXPORT_PRECISION_PLUGIN("scaled_bf16", make)
