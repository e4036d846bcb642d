// The `ddp` parallel plugin: data parallelism as torch's DistributedDataParallel. Every rank holds the
// whole model, trains on its own part of each batch, and the gradients are averaged across ranks
// before every optimizer step.
//
//   Booster booster(BoosterConfig{.mixed_precision = "fp16", .plugin = "ddp"});
//   {"plugin": {"name": "ddp", "bucket_cap_mb": 25, "broadcast_buffers": true}}
//
// Options (ConfigError for unknown keys and bad values):
//   bucket_cap_mb           MiB per gradient bucket (default 25, as torch)
//   broadcast_buffers       make every rank use rank 0's module buffers (BatchNorm statistics) before
//                           each backward (default true, as torch, which does it before each forward)
//   find_unused_parameters  agree across ranks on which parameters got no gradient, so every optimizer
//                           skips those (default false, as torch; see Note [Gradient buckets])
//   progress_thread         a thread polls the buckets in flight while backward computes, so they
//                           advance during the GEMMs and not only between layers (default true:
//                           without it OpenMPI's all-reduce hardly overlaps backward at all, see
//                           Note [Progress thread] and bench/README.md; false polls from the hooks only).
//                           A model on a GPU needs no polling (NCCL runs on the GPU): ignored there.
//                           There NCCL shares the compute stream, so its all-reduces do not overlap
//                           backward (Note [Gradient buckets], "Progress").
//
// Devices: the model's (all its parameters and buffers on one device). On the CPU the collectives go
// through the default group (mpi under mpirun); on CUDA through this process's NCCL group, which needs
// a build with NCCL (Note [A group per device]). Before configure() the plugin answers rank, size and
// layout from the default group: they are the same.
//
// What configure() does:
//  * broadcasts the parameters (the optimizer's flat buffers, and the float32 masters of a
//    master-weight optimizer) and the module buffers from rank 0, so every rank starts equal;
//  * hands the flat gradient buffers to a GradientBucketer (booster/distributed/bucket.h), which
//    all-reduces (Avg) them in buckets launched from the grad-ready hooks while backward still runs;
//  * wraps the precision strategy (Note [Who drives the step] in booster/plugin/parallel_plugin.h) in a
//    DataParallelPrecision that completes the reduction around the inner strategy's calls, and installs
//    the found_inf reducer so an overflow seen by one rank makes every rank skip (Note [Agreeing on
//    found_inf]).
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "booster/config/option_reader.h"
#include "booster/distributed/bucket.h"
#include "booster/mixed_precision/master_weight_optimizer.h"
#include "booster/plugin/data_parallel.h"  // DataParallelPlugin: group, sampler, checkpoint IO, found_inf

namespace booster::plugins::ddp {

using distributed::GradientBucketer;
using nlohmann::json;

struct DdpOptions {
  double bucket_cap_mb = 25.0;
  bool broadcast_buffers = true;
  bool find_unused_parameters = false;
  bool progress_thread = true;

  json to_json() const {
    return {{"bucket_cap_mb", bucket_cap_mb},
            {"broadcast_buffers", broadcast_buffers},
            {"find_unused_parameters", find_unused_parameters},
            {"progress_thread", progress_thread}};
  }

  static DdpOptions parse(const json& options) {
    config::OptionReader r("plugin", "ddp", options);
    DdpOptions o;
    o.bucket_cap_mb = r.number("bucket_cap_mb", o.bucket_cap_mb, 0.0, 1e6, /*min_exclusive=*/true);  // MiB
    o.broadcast_buffers = r.flag("broadcast_buffers", o.broadcast_buffers);
    o.find_unused_parameters = r.flag("find_unused_parameters", o.find_unused_parameters);
    o.progress_thread = r.flag("progress_thread", o.progress_thread);
    r.finish();
    return o;
  }
};

// The precision strategy under data parallelism: the inner strategy's calls, with the gradient
// reduction finished before anything reads gradients (Note [Who drives the step]).
class DataParallelPrecision final : public mixed_precision::PrecisionDecorator,
                                    public distributed::GradientBucketerOwner {
 public:
  DataParallelPrecision(std::shared_ptr<mixed_precision::MixedPrecision> inner,
                        std::shared_ptr<GradientBucketer> bucketer, distributed::ProcessGroup& group,
                        std::vector<Tensor> module_buffers)
      : PrecisionDecorator(std::move(inner)),
        bucketer_(std::move(bucketer)),
        group_(group),
        module_buffers_(std::move(module_buffers)) {}

  void backward(const Tensor& loss, optim::Optimizer& optimizer) override {
    // A second backward without a step in between (accumulation without no_sync) would add into
    // gradients that are still being reduced.
    bucketer_->wait();
    // torch broadcasts buffers before each forward; after this forward is the same for the next one.
    for (Tensor& b : module_buffers_) group_.broadcast(b, 0);
    inner_->backward(loss, optimizer);
    bucketer_->finish_backward();
  }
  void unscale_gradients(optim::Optimizer& optimizer) override {
    bucketer_->wait();
    inner_->unscale_gradients(optimizer);
  }
  double clip_grad_norm(optim::Optimizer& optimizer, double max_norm) override {
    bucketer_->wait();
    return inner_->clip_grad_norm(optimizer, max_norm);
  }
  void step(optim::Optimizer& optimizer) override {
    bucketer_->wait();
    PrecisionDecorator::step(optimizer);
  }
  const GradientBucketer& gradient_bucketer() const override { return *bucketer_; }

 private:
  std::shared_ptr<GradientBucketer> bucketer_;
  distributed::ProcessGroup& group_;
  std::vector<Tensor> module_buffers_;  // broadcast from rank 0 (empty without broadcast_buffers)
};

// What DataParallelPlugin does not: the gradient buckets and the parameter broadcast of configure().
// The declarations (cpu and cuda with NCCL, any strategy, no_sync), the process group, the
// DistributedSampler of prepare_dataloader() and the checkpoint IO are the base's.
class DdpPlugin final : public DataParallelPlugin {
 public:
  explicit DdpPlugin(const json& options) : options_(DdpOptions::parse(options)) {}

  std::string name() const override { return "ddp"; }
  json options() const override { return options_.to_json(); }

  TrainingParts configure(TrainingParts parts) override {
    BOOSTER_CHECK(parts.model != nullptr, ValueError, "plugin 'ddp': configure() needs a model");
    BOOSTER_CHECK(parts.precision != nullptr, ValueError, "plugin 'ddp': configure() needs a precision strategy");
    BOOSTER_CHECK(bucketer_ == nullptr, StateError, "plugin 'ddp': configure() was called twice; make one plugin "
                  "per model");
    distributed::ProcessGroup& pg = bind_process_group(*parts.model);

    // The gradient buffers to reduce: the optimizer's (for a master-weight optimizer these hold the
    // low-precision model gradients), or our own over the model's parameters when there is none.
    std::vector<const optim::FlatBuffer*> buffers;
    if (parts.optimizer) {
      for (size_t g = 0; g < parts.optimizer->param_groups().size(); ++g)
        for (const optim::FlatBuffer* fb : parts.optimizer->flat_buffers(g)) buffers.push_back(fb);
    } else {
      own_buffers_ = bind_model_parameters(*parts.model);
      for (const optim::FlatBuffer& fb : own_buffers_) buffers.push_back(&fb);
    }

    broadcast_parameters(pg, *parts.model, buffers, parts.optimizer.get());
    std::vector<Tensor> module_buffers = parts.model->buffers();
    for (Tensor& b : module_buffers) pg.broadcast(b, 0);
    if (!options_.broadcast_buffers) module_buffers.clear();

    distributed::GradientBucketerOptions bucket_options;
    bucket_options.bucket_cap_mb = options_.bucket_cap_mb;
    bucket_options.find_unused_parameters = options_.find_unused_parameters;
    bucket_options.progress_thread = options_.progress_thread;
    bucket_options.op = distributed::ReduceOp::Avg;
    bucketer_ = std::make_shared<GradientBucketer>(pg, std::move(buffers), bucket_options);
    bucketer_->set_sync(gradient_sync());

    install_found_inf_reducer(*parts.precision);
    parts.precision = std::make_shared<DataParallelPrecision>(std::move(parts.precision), bucketer_, pg,
                                                              std::move(module_buffers));
    return parts;
  }

  void set_gradient_sync(bool enabled) override {
    DataParallelPlugin::set_gradient_sync(enabled);
    if (bucketer_) bucketer_->set_sync(enabled);
  }

 private:
  // One flat buffer per dtype over the model's trainable parameters (the optimizer-less case).
  static std::vector<optim::FlatBuffer> bind_model_parameters(const nn::Module& model) {
    std::vector<std::vector<Tensor>> by_dtype;
    std::vector<DType> dtypes;
    for (const Tensor& p : model.parameters()) {
      if (!p.requires_grad() || !is_floating(p.dtype())) continue;
      size_t k = 0;
      while (k < dtypes.size() && dtypes[k] != p.dtype()) ++k;
      if (k == dtypes.size()) {
        dtypes.push_back(p.dtype());
        by_dtype.emplace_back();
      }
      by_dtype[k].push_back(p);
    }
    std::vector<optim::FlatBuffer> out;
    out.reserve(by_dtype.size());
    for (auto& params : by_dtype) out.emplace_back(std::move(params));
    return out;
  }

  // Every rank takes rank 0's parameters: one broadcast per flat buffer, plus the float32 masters of a
  // master-weight optimizer (made from each rank's own model before we ran) and any model parameter
  // outside the buffers (frozen ones the optimizer was not given).
  static void broadcast_parameters(distributed::ProcessGroup& pg, const nn::Module& model,
                                   const std::vector<const optim::FlatBuffer*>& buffers,
                                   const optim::Optimizer* optimizer) {
    std::set<const TensorImpl*> covered;
    for (const optim::FlatBuffer* fb : buffers) {
      pg.broadcast(distributed::BufferSpan::of(fb->data(), "ddp broadcast"), 0);
      for (const Tensor& p : fb->params()) {
        covered.insert(p.impl());
        p.bump_version();  // cached casts of the old values (autocast) must not be reused
      }
    }
    if (const auto* mw = dynamic_cast<const mixed_precision::MasterWeightOptimizer*>(optimizer)) {
      for (size_t g = 0; g < mw->inner().param_groups().size(); ++g)
        for (const optim::FlatBuffer* fb : mw->inner().flat_buffers(g)) {
          pg.broadcast(distributed::BufferSpan::of(fb->data(), "ddp broadcast"), 0);
          for (const Tensor& p : fb->params()) p.bump_version();
        }
    }
    for (Tensor p : model.parameters()) {
      if (covered.count(p.impl())) continue;
      pg.broadcast(p, 0);
    }
  }

  DdpOptions options_;
  std::vector<optim::FlatBuffer> own_buffers_;
  std::shared_ptr<GradientBucketer> bucketer_;
};

std::unique_ptr<ParallelPlugin> make_ddp_plugin(const json& options) { return std::make_unique<DdpPlugin>(options); }

}  // namespace booster::plugins::ddp

BOOSTER_EXPORT_PARALLEL_PLUGIN("ddp", booster::plugins::ddp::make_ddp_plugin)
