// DataParallelPlugin: the base of data-parallel plugins (ddp, low_level_zero), after ColossalAI's
// DPPluginBase. Every rank holds a copy (or a shard) of the model and trains on its own part of the
// data; what they share lives here once:
//   * the process group: the default group until configure() binds the model's device's (Note [A group
//     per device] in booster/distributed/process_group.h; same rank and size), and the layout it gives;
//   * prepare_dataloader(): a DistributedSampler per rank, one code path for every such plugin (Note
//     [Data-parallel loaders]);
//   * checkpoint_io(): the default CheckpointIO over that group (rank 0 writes);
//   * install_found_inf_reducer(): every rank skips a step when any rank saw inf/NaN (Note [Agreeing on
//     found_inf] in booster/distributed/bucket.h);
//   * broadcast_from_rank0(): every rank starts from rank 0's parameters and buffers;
//   * the declarations most data-parallel plugins make (cpu, and cuda where NCCL is built; any strategy;
//     no_sync supported), each overridable.
// A plugin defines name(), configure() and, if it has any, options() (and set_gradient_sync() when
// skipping synchronisation needs work of its own). plugins/README.md walks through plugins/ddp.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "booster/plugin/parallel_plugin.h"

namespace booster {

// Note [Data-parallel loaders]: the loader of replica `replica` of `replicas` (a DistributedSampler's
// share of `dataset`; `options.batch_size` per replica). Every data-parallel plugin's
// prepare_dataloader() is this; a plugin whose replicas span several ranks (hybrid_parallel) passes
// its data-parallel size and rank. `plugin` names it in errors.
std::shared_ptr<data::DataLoader> data_parallel_loader(data::DatasetPtr dataset, const data::DataLoaderOptions& options,
                                                       int replicas, int replica, const std::string& plugin);

class BOOST_SYMBOL_VISIBLE DataParallelPlugin : public ParallelPlugin {
 public:
  // ---------------------------------------------------------------- declarations (defaults)
  std::string version() const override { return "1.0"; }
  // cpu always; cuda when this build has NCCL.
  std::vector<std::string> supported_devices() const override;
  bool support_no_sync() const override { return true; }
  ParallelLayout layout() const override { return {.data = group().size()}; }

  // ---------------------------------------------------------------- shared work
  // Note [Data-parallel loaders]: this rank's share of `dataset` through a DistributedSampler.
  std::shared_ptr<data::DataLoader> prepare_dataloader(data::DatasetPtr dataset,
                                                       const data::DataLoaderOptions& options) override;
  // Stores the flag for gradient_sync(); IncompatibleError for false when !support_no_sync(). A plugin
  // that acts on it overrides this and calls it first.
  void set_gradient_sync(bool enabled) override;
  std::shared_ptr<CheckpointIO> checkpoint_io() override { return std::make_shared<CheckpointIO>(group()); }
  distributed::ProcessGroup& process_group() override { return group(); }

 protected:
  // The group of the model's device once bind_process_group() ran, the default group before.
  distributed::ProcessGroup& group() const { return group_ ? *group_ : distributed::default_process_group(); }
  // Takes the group of the device `model`'s parameters and buffers are on (all on one device, else
  // DeviceError naming the plugin). Called by configure().
  distributed::ProcessGroup& bind_process_group(const nn::Module& model);
  bool process_group_bound() const { return group_ != nullptr; }
  // Makes `precision` agree on found_inf across group(), so an overflow on one rank skips the step on all.
  void install_found_inf_reducer(mixed_precision::MixedPrecision& precision) const;
  // Every rank takes rank 0's parameters and module buffers (nothing to do on one rank).
  void broadcast_from_rank0(nn::Module& model) const;
  // The last set_gradient_sync() (true until the first).
  bool gradient_sync() const { return gradient_sync_; }

 private:
  distributed::ProcessGroup* group_ = nullptr;
  bool gradient_sync_ = true;
};

}  // namespace booster
