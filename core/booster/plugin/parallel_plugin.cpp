// The host side of the parallel plugin boundary: create_plugin() loads a plugin library, calls its
// factory, and wraps what it made in a proxy through which every call crosses the boundary (exceptions
// become host errors, Note [Plugin ABI]) and everything it hands out keeps the library loaded (Note
// [Plugin lifetime]). The precision-plugin counterpart is precision_plugin.cpp.
#include "booster/plugin/parallel_plugin.h"

#include "booster/booster/single_process.h"
#include "booster/plugin/loader.h"

namespace booster {

using nlohmann::json;
using plugin::call_into;

namespace {

// A plugin from a library: every call crosses the boundary through call_into (Note [Plugin ABI]), and
// what configure() returns is bound to the library (Note [Plugin lifetime]).
class PluginProxy final : public ParallelPlugin {
 public:
  PluginProxy(std::shared_ptr<plugin::Plugin> library, std::shared_ptr<ParallelPlugin> plugin)
      : library_(std::move(library)), plugin_(std::move(plugin)) {}

  // Defined before its uses: they deduce their return types from it.
  template <class F>
  decltype(auto) call(const char* what, F&& f) const {
    return call_into(*library_, what, std::forward<F>(f));
  }

  std::string name() const override { return call("name()", [&] { return plugin_->name(); }); }
  std::string version() const override { return call("version()", [&] { return plugin_->version(); }); }
  json options() const override { return call("options()", [&] { return plugin_->options(); }); }
  std::vector<std::string> supported_devices() const override {
    return call("supported_devices()", [&] { return plugin_->supported_devices(); });
  }
  std::vector<std::string> supported_precisions() const override {
    return call("supported_precisions()", [&] { return plugin_->supported_precisions(); });
  }
  bool control_precision() const override { return call("control_precision()", [&] { return plugin_->control_precision(); }); }
  bool control_device() const override { return call("control_device()", [&] { return plugin_->control_device(); }); }
  bool support_no_sync() const override { return call("support_no_sync()", [&] { return plugin_->support_no_sync(); }); }
  bool control_checkpoint_io() const override {
    return call("control_checkpoint_io()", [&] { return plugin_->control_checkpoint_io(); });
  }
  bool take_deferred_parameters() const override {
    return call("take_deferred_parameters()", [&] { return plugin_->take_deferred_parameters(); });
  }
  ParallelLayout layout() const override { return call("layout()", [&] { return plugin_->layout(); }); }

  TrainingParts shard(TrainingParts parts) override {
    return bind(call("shard()", [&] { return plugin_->shard(std::move(parts)); }));
  }
  TrainingParts configure(TrainingParts parts) override {
    return bind(call("configure()", [&] { return plugin_->configure(std::move(parts)); }));
  }
  double train_step(const Tensor& x, const Tensor& y, const nn::Criterion& criterion,
                    const std::function<void(const Tensor&)>& backward) override {
    return call("train_step()", [&] { return plugin_->train_step(x, y, criterion, backward); });
  }
  std::shared_ptr<data::DataLoader> prepare_dataloader(data::DatasetPtr dataset,
                                                       const data::DataLoaderOptions& options) override {
    return plugin::bind(library_, call("prepare_dataloader()", [&] { return plugin_->prepare_dataloader(dataset, options); }));
  }
  void set_gradient_sync(bool enabled) override {
    call("set_gradient_sync()", [&] { plugin_->set_gradient_sync(enabled); });
  }
  std::shared_ptr<CheckpointIO> checkpoint_io() override {
    return plugin::bind(library_, call("checkpoint_io()", [&] { return plugin_->checkpoint_io(); }));
  }
  void with_full_parameters(const std::function<void()>& fn) override {
    call("with_full_parameters()", [&] { plugin_->with_full_parameters(fn); });
  }
  distributed::ProcessGroup& process_group() override {
    return call("process_group()", [&]() -> distributed::ProcessGroup& { return plugin_->process_group(); });
  }

 private:
  // What the plugin made stays bound to its library (Note [Plugin lifetime]).
  TrainingParts bind(TrainingParts out) const {
    out.model = plugin::bind_module(library_, std::move(out.model));
    out.optimizer = plugin::bind(library_, std::move(out.optimizer));
    out.dataloader = plugin::bind(library_, std::move(out.dataloader));
    out.scheduler = plugin::bind(library_, std::move(out.scheduler));
    out.precision = plugin::bind(library_, std::move(out.precision));
    if (out.criterion) {
      auto held = plugin::bind(library_, std::make_shared<nn::Criterion>(std::move(out.criterion)));
      out.criterion = [held](const Tensor& output, const Tensor& target) { return (*held)(output, target); };
    }
    return out;
  }

  std::shared_ptr<plugin::Plugin> library_;
  std::shared_ptr<ParallelPlugin> plugin_;  // bound to library_ as well
};

}  // namespace

std::shared_ptr<ParallelPlugin> create_plugin(const std::string& name_or_path, const json& options) {
  const json opts = options.is_null() ? json::object() : options;
  if (name_or_path.empty()) return std::make_shared<SingleProcessPlugin>(opts);
  std::shared_ptr<plugin::Plugin> library = plugin::load(plugin::kParallelKind, name_or_path);
  auto* factory = reinterpret_cast<ParallelFactory*>(library->symbol("booster_create_parallel"));
  plugin::count_factory_call(plugin::kParallelKind);
  ParallelPlugin* raw = call_into(*library, "booster_create_parallel", [&] { return factory(opts); });
  BOOSTER_CHECK(raw != nullptr, PluginError, "parallel plugin '", library->name(), "' (", library->file().string(),
                ") returned no plugin");
  std::shared_ptr<ParallelPlugin> created = plugin::bind(library, std::shared_ptr<ParallelPlugin>(raw));
  return std::make_shared<PluginProxy>(std::move(library), std::move(created));
}

}  // namespace booster
