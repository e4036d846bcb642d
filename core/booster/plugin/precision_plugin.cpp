// The host side of the precision plugin boundary: a strategy from a plugin library, seen by the host
// as any other strategy (mixed_precision::create() calls create_from_plugin for names it does not
// know). Every call is forwarded through the boundary (booster::plugin::call_into converts exceptions
// into host errors), and the strategy and everything its configure() returns keep the library loaded (Note
// [Plugin lifetime] in booster/plugin/loader.h), so create() can keep returning a plain unique_ptr.
#include "booster/mixed_precision/mixed_precision.h"
#include "booster/plugin/abi.h"
#include "booster/plugin/loader.h"

namespace booster::mixed_precision {
namespace {

using plugin::call_into;

class PluginStrategy final : public MixedPrecision {
 public:
  PluginStrategy(std::shared_ptr<plugin::Plugin> library, std::shared_ptr<MixedPrecision> strategy)
      : library_(std::move(library)), strategy_(std::move(strategy)) {}

  std::string name() const override {
    return call_into(*library_, "name()", [&] { return strategy_->name(); });
  }
  nlohmann::json options() const override {
    return call_into(*library_, "options()", [&] { return strategy_->options(); });
  }

  Configured configure(nn::ModulePtr model, std::shared_ptr<optim::Optimizer> optimizer,
                       Criterion criterion) override {
    Configured c = call_into(*library_, "configure()", [&] {
      return strategy_->configure(std::move(model), std::move(optimizer), std::move(criterion));
    });
    // The model, optimizer and criterion may be objects (or closures) of the plugin: bind them.
    c.model = plugin::bind_module(library_, std::move(c.model));
    c.optimizer = plugin::bind(library_, std::move(c.optimizer));
    if (c.criterion) {
      auto held = plugin::bind(library_, std::make_shared<Criterion>(std::move(c.criterion)));
      c.criterion = [held, library = library_](const Tensor& output, const Tensor& target) {
        return call_into(*library, "criterion", [&] { return (*held)(output, target); });
      };
    }
    return c;
  }

  void backward(const Tensor& loss, optim::Optimizer& optimizer) override {
    call_into(*library_, "backward()", [&] { strategy_->backward(loss, optimizer); });
  }
  void unscale_gradients(optim::Optimizer& optimizer) override {
    call_into(*library_, "unscale_gradients()", [&] { strategy_->unscale_gradients(optimizer); });
  }
  double clip_grad_norm(optim::Optimizer& optimizer, double max_norm) override {
    return call_into(*library_, "clip_grad_norm()", [&] { return strategy_->clip_grad_norm(optimizer, max_norm); });
  }
  void step(optim::Optimizer& optimizer) override {
    call_into(*library_, "step()", [&] { strategy_->step(optimizer); });
    stats_ = strategy_->last_step_stats();  // step_was_skipped() reads this object's stats
  }
  void set_amax_reducer(AmaxReducer reducer) override {
    call_into(*library_, "set_amax_reducer()", [&] { strategy_->set_amax_reducer(std::move(reducer)); });
  }
  void set_found_inf_reducer(FoundInfReducer reducer) override {
    call_into(*library_, "set_found_inf_reducer()", [&] { strategy_->set_found_inf_reducer(std::move(reducer)); });
  }
  double loss_scale() const override {
    return call_into(*library_, "loss_scale()", [&] { return strategy_->loss_scale(); });
  }
  MixedPrecisionState state_dict() const override {
    return call_into(*library_, "state_dict()", [&] { return strategy_->state_dict(); });
  }
  void load_state_dict(const MixedPrecisionState& state) override {
    call_into(*library_, "load_state_dict()", [&] { strategy_->load_state_dict(state); });
  }

 private:
  std::shared_ptr<plugin::Plugin> library_;
  std::shared_ptr<MixedPrecision> strategy_;  // bound to library_ as well
};

}  // namespace

std::unique_ptr<MixedPrecision> create_from_plugin(const std::string& name_or_path, const nlohmann::json& options) {
  std::shared_ptr<plugin::Plugin> library = plugin::load(plugin::kPrecisionKind, name_or_path);
  auto* factory = reinterpret_cast<plugin::PrecisionFactory*>(library->symbol("booster_create_precision"));
  plugin::count_factory_call(plugin::kPrecisionKind);
  const nlohmann::json opts = options.is_null() ? nlohmann::json::object() : options;
  MixedPrecision* raw = call_into(*library, "booster_create_precision", [&] { return factory(opts); });
  BOOSTER_CHECK(raw != nullptr, PluginError, "precision plugin '", library->name(), "' (", library->file().string(),
                ") returned no strategy");
  // The control block is made here, in the host; deleting through the virtual destructor runs the
  // plugin's code, which bind() keeps loaded until then.
  std::shared_ptr<MixedPrecision> strategy = plugin::bind(library, std::shared_ptr<MixedPrecision>(raw));
  return std::make_unique<PluginStrategy>(std::move(library), std::move(strategy));
}

}  // namespace booster::mixed_precision
