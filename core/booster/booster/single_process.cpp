#include "booster/booster/single_process.h"

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "booster/distributed/local_process_group.h"
#include "booster/trainer/main_process.h"

namespace booster {

namespace {

// Note [One process, started N times]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// `booster run -n 2` with the single plugin starts two processes that know nothing of each other: each
// trains the whole model on all the data, the same work twice, and both write the same run directory.
// Nothing fails, so the launcher's process count (its variables; the plugin's group is this process
// alone) is checked once per process and the main process says so, once.
void warn_if_started_several_times() {
  static std::once_flag once;
  std::call_once(once, [] {
    const int processes = distributed::job_place_from_launcher().size;
    if (processes <= 1 || !is_main_process()) return;
    const std::string n = std::to_string(processes);
    const std::string line =
        "booster: warning: plugin 'single' runs each process on its own, and this job started " + n +
        ": every process does the same work (the whole model on all the data, " + n +
        " times over); use plugin ddp, low_level_zero or hybrid_parallel to share it, or start one process\n";
    std::fwrite(line.data(), 1, line.size(), stderr);
    std::fflush(stderr);
  });
}

}  // namespace

SingleProcessPlugin::SingleProcessPlugin(const nlohmann::json& options)
    : group_(std::make_unique<distributed::LocalProcessGroup>()) {
  BOOSTER_CHECK(options.is_null() || (options.is_object() && options.empty()), ConfigError,
                "plugin 'single' takes no options, got ", options.dump());
  warn_if_started_several_times();
}

std::shared_ptr<data::DataLoader> SingleProcessPlugin::prepare_dataloader(data::DatasetPtr dataset,
                                                                          const data::DataLoaderOptions& options) {
  return std::make_shared<data::DataLoader>(std::move(dataset), options);
}

std::shared_ptr<CheckpointIO> SingleProcessPlugin::checkpoint_io() { return std::make_shared<CheckpointIO>(*group_); }

distributed::ProcessGroup& SingleProcessPlugin::process_group() { return *group_; }

}  // namespace booster
