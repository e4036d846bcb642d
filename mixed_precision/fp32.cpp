// "fp32" (alias "no"): full precision. The model, optimizer and criterion are used as given, the loss is
// not scaled and no step is ever skipped.
#include "booster/mixed_precision/mixed_precision.h"

namespace booster::mixed_precision {
namespace {

class Fp32 final : public MixedPrecision {
 public:
  Fp32(std::string name, const nlohmann::json& options) : name_(std::move(name)) {
    OptionReader(name_, options).finish();
  }
  std::string name() const override { return name_; }
  nlohmann::json options() const override { return nlohmann::json::object(); }
  Configured configure(nn::ModulePtr model, std::shared_ptr<optim::Optimizer> optimizer,
                       Criterion criterion) override {
    return {std::move(model), std::move(optimizer), std::move(criterion)};
  }

 private:
  std::string name_;
};

const Registrar fp32_registrar("fp32", [](const nlohmann::json& o) { return std::make_unique<Fp32>("fp32", o); });
const Registrar no_registrar("no", [](const nlohmann::json& o) { return std::make_unique<Fp32>("no", o); });

}  // namespace
}  // namespace booster::mixed_precision
