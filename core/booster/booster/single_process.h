// SingleProcessPlugin: one process, no communication. What a Booster runs with no plugin, and what the
// `single` plugin library (plugins/single) exports.
#pragma once

#include <memory>

#include "booster/plugin/parallel_plugin.h"

namespace booster {

class SingleProcessPlugin final : public ParallelPlugin {
 public:
  // ConfigError for any option: the plugin has none.
  explicit SingleProcessPlugin(const nlohmann::json& options = nlohmann::json::object());

  std::string name() const override { return "single"; }
  std::string version() const override { return "1.0"; }
  nlohmann::json options() const override { return nlohmann::json::object(); }

  std::vector<std::string> supported_devices() const override { return {"cpu", "cuda"}; }
  std::vector<std::string> supported_precisions() const override { return {"*"}; }
  bool control_precision() const override { return false; }
  bool control_device() const override { return false; }
  bool support_no_sync() const override { return true; }  // nothing to skip: accumulation just works
  bool control_checkpoint_io() const override { return false; }
  ParallelLayout layout() const override { return {}; }

  TrainingParts configure(TrainingParts parts) override { return parts; }
  std::shared_ptr<data::DataLoader> prepare_dataloader(data::DatasetPtr dataset,
                                                       const data::DataLoaderOptions& options) override;
  void set_gradient_sync(bool) override {}
  std::shared_ptr<CheckpointIO> checkpoint_io() override;
  distributed::ProcessGroup& process_group() override;

 private:
  std::unique_ptr<distributed::ProcessGroup> group_;
};

}  // namespace booster
