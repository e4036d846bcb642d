#include "booster/booster/single_process.h"

#include "booster/distributed/local_process_group.h"

namespace booster {

SingleProcessPlugin::SingleProcessPlugin(const nlohmann::json& options)
    : group_(std::make_unique<distributed::LocalProcessGroup>()) {
  BOOSTER_CHECK(options.is_null() || (options.is_object() && options.empty()), ConfigError,
                "plugin 'single' takes no options, got ", options.dump());
}

std::shared_ptr<data::DataLoader> SingleProcessPlugin::prepare_dataloader(data::DatasetPtr dataset,
                                                                          const data::DataLoaderOptions& options) {
  return std::make_shared<data::DataLoader>(std::move(dataset), options);
}

std::shared_ptr<CheckpointIO> SingleProcessPlugin::checkpoint_io() { return std::make_shared<CheckpointIO>(*group_); }

distributed::ProcessGroup& SingleProcessPlugin::process_group() { return *group_; }

}  // namespace booster
