// The shared parts of data-parallel plugins (booster/plugin/data_parallel.h).
#include "booster/plugin/data_parallel.h"

#include "booster/autograd/autograd.h"
#include "booster/data/sampler.h"
#include "booster/distributed/bucket.h"
#include "booster/distributed/nccl_process_group.h"

namespace booster {

std::vector<std::string> DataParallelPlugin::supported_devices() const {
  if (distributed::nccl_built()) return {"cpu", "cuda"};
  return {"cpu"};
}

// Note [Data-parallel loaders]
// One code path for every data-parallel plugin, with the semantics of PyTorch's DistributedSampler as
// ColossalAI's and Accelerate's prepare_dataloader use it: the sampler (drop_last=false) pads the
// shuffled or sequential order by repeating its first indices until it divides by the world size, so
// every rank sees the same number of samples and batches (a rank that ran out early would leave the
// others waiting in a collective), and shuffles with `options.seed`, the same order on every rank.
// `options.drop_last` stays the loader's, dropping each rank's last partial batch, as
// torch.utils.data.DataLoader(drop_last=...) does over a DistributedSampler. `options.batch_size` is
// per rank. The loader's own shuffle is turned off (the sampler shuffles); its set_epoch reaches the
// sampler at each pass.
std::shared_ptr<data::DataLoader> data_parallel_loader(data::DatasetPtr dataset, const data::DataLoaderOptions& options,
                                                       int replicas, int replica, const std::string& plugin) {
  BOOSTER_CHECK(dataset != nullptr, ValueError, "plugin '", plugin, "': prepare_dataloader() got a null data set");
  auto sampler = std::make_shared<data::DistributedSampler>(dataset->size(), replicas, replica, options.shuffle,
                                                            options.seed, /*drop_last=*/false);
  data::DataLoaderOptions per_rank = options;
  per_rank.shuffle = false;
  return std::make_shared<data::DataLoader>(std::move(dataset), per_rank, std::move(sampler));
}

std::shared_ptr<data::DataLoader> DataParallelPlugin::prepare_dataloader(data::DatasetPtr dataset,
                                                                         const data::DataLoaderOptions& options) {
  return data_parallel_loader(std::move(dataset), options, group().size(), group().rank(), name());
}

void DataParallelPlugin::set_gradient_sync(bool enabled) {
  BOOSTER_CHECK(enabled || support_no_sync(), IncompatibleError, "plugin '", name(),
                "' cannot skip gradient synchronisation (no_sync)");
  gradient_sync_ = enabled;
}

distributed::ProcessGroup& DataParallelPlugin::bind_process_group(const nn::Module& model) {
  std::vector<Tensor> tensors = model.parameters();
  for (const Tensor& b : model.buffers()) tensors.push_back(b);
  group_ = &distributed::process_group_for(tensors, "plugin '" + name() + "'");
  return *group_;
}

void DataParallelPlugin::install_found_inf_reducer(mixed_precision::MixedPrecision& precision) const {
  precision.set_found_inf_reducer(distributed::found_inf_on_any_rank(group()));
  precision.set_amax_reducer(distributed::max_on_all_ranks(group()));
}

void DataParallelPlugin::broadcast_from_rank0(nn::Module& model) const {
  distributed::ProcessGroup& pg = group();
  if (pg.size() == 1) return;
  NoGradGuard no_grad;
  for (Tensor t : model.parameters()) pg.broadcast(t, 0);
  for (Tensor t : model.buffers()) pg.broadcast(t, 0);
}

}  // namespace booster
