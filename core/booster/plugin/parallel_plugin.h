// ParallelPlugin: the interface every parallelism plugin implements (single, ddp, low_level_zero, ...),
// the objects it works on, the macro a plugin library exports itself with, and create_plugin(), which
// loads one. A guide to writing one: plugins/README.md.
//
// Note [Parallel plugins]
// A parallel plugin is a shared library `libbooster_plugin_<name>.so` (plugins/<name>/ in this repo)
// found on the plugin search path (Note [Finding a plugin] in booster/plugin/loader.h) and loaded by
// the Booster when its config names it. It declares what it supports (devices, the Booster's mixed
// precision strategies, its parallel layout, whether it controls precision, device, checkpoint IO and
// whether it can skip gradient synchronisation); the compatibility matrix (booster/booster/compat.h)
// is built from these declarations and rejects a bad combination before any work starts.
//
// At boost() the Booster first lets its mixed-precision strategy configure model, optimizer and
// criterion (unless the plugin controls precision), then hands every part to the plugin's configure(),
// which may wrap or replace any of them. Only the model is required; every other part may be null.
//
// Note [Who drives the step]
// TrainingParts::precision is the object the Booster calls for backward(), clip_grad_norm() and the
// optimizer step, so that the user's loop is the same for every combination. A plugin hooks the step
// by wrapping it (ddp: a PrecisionDecorator that waits for the gradient all-reduce before the inner
// strategy unscales and steps, and installs the found_inf reducer of Note [Agreeing on found_inf]),
// or by replacing it (low_level_zero, which controls precision: a strategy of its own that scales the
// loss, reduce-scatters gradients, steps its shard and all-gathers parameters).
//
// ABI: any change to this header that a compiled plugin could not survive bumps
// BOOSTER_PLUGIN_ABI_VERSION (Note [Plugin ABI]).
#pragma once

#include <boost/config.hpp>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "booster/common/error.h"
#include "booster/data/dataloader.h"
#include "booster/data/dataset.h"
#include "booster/distributed/process_group.h"
#include "booster/mixed_precision/mixed_precision.h"
#include "booster/nn/loss.h"
#include "booster/nn/module.h"
#include "booster/optim/lr_scheduler.h"
#include "booster/optim/optimizer.h"
#include "booster/plugin/abi.h"

namespace booster {

// The objects of a training loop as they pass through boost(). Only `model` is required.
struct TrainingParts {
  nn::ModulePtr model;
  std::shared_ptr<optim::Optimizer> optimizer;
  nn::Criterion criterion;
  std::shared_ptr<data::DataLoader> dataloader;
  std::shared_ptr<optim::LRScheduler> scheduler;
  // Drives backward, clipping and the optimizer step (Note [Who drives the step]). Never null.
  std::shared_ptr<mixed_precision::MixedPrecision> precision;
};

// How many ways a plugin splits the work. The compatibility matrix reads tensor and pipeline to apply
// the rules of strategies that cannot work with them (apex-style with tensor parallel, apex-style and
// fp8 with pipeline parallel).
struct ParallelLayout {
  int data = 1;
  int tensor = 1;
  int pipeline = 1;
};

// Saving and loading of what a plugin may lay out its own way. Under several processes every rank
// calls each function (they may be collectives); the default writes on rank 0 only. Files are the
// formats of booster/checkpoint: safetensors for tensors (sharded with a Hugging Face index above
// max_shard_bytes), JSON for the rest, each written atomically (a temporary file, then rename).
class BOOST_SYMBOL_VISIBLE CheckpointIO {
 public:
  // `group` decides who writes (rank 0) and synchronises the ranks around writes.
  explicit CheckpointIO(distributed::ProcessGroup& group) : group_(group) {}
  virtual ~CheckpointIO() = default;

  // Model weights: `path` is a directory that gets model.safetensors, or shards plus
  // model.safetensors.index.json above max_shard_bytes (Hugging Face's layout). load_model also takes
  // a .safetensors file; keys and shapes must match the model (CheckpointError names the first that
  // does not).
  virtual void save_model(const nn::Module& model, const std::filesystem::path& path,
                          uint64_t max_shard_bytes) const;
  virtual void load_model(nn::Module& model, const std::filesystem::path& path) const;
  // Optimizer state as one process holds it (a sharded optimizer gathers in its state_dict()):
  // `path` is a directory with optimizer.safetensors and optimizer.json.
  virtual void save_optimizer(const optim::Optimizer& optimizer, const std::filesystem::path& path) const;
  virtual void load_optimizer(optim::Optimizer& optimizer, const std::filesystem::path& path) const;
  // The scheduler's state_dict() as JSON.
  virtual void save_lr_scheduler(const optim::LRScheduler& scheduler, const std::filesystem::path& path) const;
  virtual void load_lr_scheduler(optim::LRScheduler& scheduler, const std::filesystem::path& path) const;

 protected:
  bool writes() const { return group_.rank() == 0; }
  distributed::ProcessGroup& group_;
};

// Note [Optional slots]
// Every slot says whether it is required (pure virtual: a plugin must define it) or optional (it has a
// default, written here inline so a plugin compiled against the header gets it without a core symbol).
// The defaults describe a single-process, CPU-only plugin that changes nothing: override what differs.
// Whether a slot is pure or has a default does not change the vtable (same slots, same order), so a
// default added here needs no ABI bump; adding, removing or reordering a slot does (Note [Plugin ABI]).
// A data-parallel plugin derives from DataParallelPlugin (booster/plugin/data_parallel.h) instead,
// which fills in the slots every data-parallel plugin shares.
class BOOST_SYMBOL_VISIBLE ParallelPlugin {
 public:
  virtual ~ParallelPlugin() = default;

  // ---------------------------------------------------------------- identity
  // Required: the name users select it by (the one it is exported with).
  virtual std::string name() const = 0;
  // Optional: default "0".
  virtual std::string version() const { return "0"; }
  // Optional: every option with the value in use. Default: none. The config's `plugin` section takes
  // exactly these keys (Note [The plugin section]), so a plugin with options must list them.
  virtual nlohmann::json options() const { return nlohmann::json::object(); }

  // ---------------------------------------------------------------- declarations
  // What the compatibility matrix (booster/booster/compat.h) reads before any work starts.
  // Optional: devices it runs on, "cpu" and/or "cuda". Default: {"cpu"}.
  virtual std::vector<std::string> supported_devices() const { return {"cpu"}; }
  // Optional: the Booster mixed-precision strategies it accepts, by registered name ("fp32", "fp16",
  // ...); "*" accepts any strategy, precision plugins included. A plugin that controls precision lists
  // only "fp32" (the identity) and takes its precision as an option. Default: {"*"}.
  virtual std::vector<std::string> supported_precisions() const { return {"*"}; }
  // Optional: true when the plugin replaces the Booster's strategy with its own (then the Booster's must
  // be "fp32"). Default: false.
  virtual bool control_precision() const { return false; }
  // Optional: true when the plugin moves the model to its device itself. Default: false.
  virtual bool control_device() const { return false; }
  // Optional: true when set_gradient_sync(false) works (Booster::no_sync). Default: false.
  virtual bool support_no_sync() const { return false; }
  // Optional: true when checkpoint_io() lays files out its own way (not as one process would); its
  // checkpoints then resume only under the same plugin and world size (Note [Resuming across layouts]
  // in booster/booster/state.cpp). Default: false.
  virtual bool control_checkpoint_io() const { return false; }
  // Optional: true when configure() takes the model's parameters still deferred (built under a
  // LazyInitGuard, booster/tensor/deferred.h) and allocates only this rank's part of them itself
  // (ZeRO-3 reads its shard straight from the initializer or file). Otherwise boost() allocates what
  // shard() returned, whole, before configure(). Default: false.
  virtual bool take_deferred_parameters() const { return false; }
  // Optional: how many ways it splits the work. Default: one process.
  virtual ParallelLayout layout() const { return {}; }

  // ---------------------------------------------------------------- work
  // Optional: called once by Booster::boost() before the mixed-precision strategy configures the parts.
  // A plugin that splits the model across ranks (tensor or pipeline parallel) replaces the model with
  // this rank's part here, the optimizer with one over that part's parameters (same type, groups and
  // options) and, where the part's output is split, the criterion; so the strategy converts and wraps
  // only what this rank holds. Default: the parts unchanged.
  virtual TrainingParts shard(TrainingParts parts) { return parts; }
  // Required. Called once by Booster::boost(). `parts.precision` has configured model, optimizer and
  // criterion already unless control_precision(). Returns what the training loop uses from then on.
  virtual TrainingParts configure(TrainingParts parts) = 0;
  // Optional: a loader over `dataset` for this process: a data-parallel plugin gives each rank its own
  // part (a DistributedSampler), so `options.batch_size` is per rank. Default: the whole data set.
  virtual std::shared_ptr<data::DataLoader> prepare_dataloader(data::DatasetPtr dataset,
                                                               const data::DataLoaderOptions& options) {
    return std::make_shared<data::DataLoader>(std::move(dataset), options);
  }
  // Optional: while false, backward accumulates gradients locally with no communication
  // (Booster::no_sync); the next backward with sync enabled communicates the accumulated sum. Default:
  // nothing to skip for true; IncompatibleError for false (support_no_sync() is false by default).
  virtual void set_gradient_sync(bool enabled) {
    BOOSTER_CHECK(enabled, IncompatibleError, "plugin '", name(), "' cannot skip gradient synchronisation (no_sync)");
  }
  // Optional: how to save and load model, optimizer and scheduler under this plugin. Default: the
  // CheckpointIO above over process_group() (rank 0 writes).
  virtual std::shared_ptr<CheckpointIO> checkpoint_io() { return std::make_shared<CheckpointIO>(process_group()); }
  // Optional: one training step's forward and backward over the batch (x, y), for a plugin whose model is
  // cut into pipeline stages (layout().pipeline > 1), where model(x) is not the whole model's output
  // (Booster::execute_pipeline calls it). `criterion` is the configured one; `backward` is called with
  // every loss to backpropagate (the strategy's backward, which scales it). Returns the batch's loss on
  // every rank. Collective. Default: IncompatibleError (nothing is pipelined).
  virtual double train_step(const Tensor& x, const Tensor& y, const nn::Criterion& criterion,
                            const std::function<void(const Tensor&)>& backward) {
    (void)x, (void)y, (void)criterion, (void)backward;
    BOOSTER_FAIL(IncompatibleError, "plugin '", name(), "' does not cut the model into pipeline stages; train with ",
                 "criterion(model(x), y) and booster.backward(loss, optimizer)");
  }
  // Optional: runs `fn` while every parameter of the configured model holds its whole value, for code
  // that reads or writes parameters outside a forward (a resume under another precision). A plugin
  // that shards parameters (ZeRO stage 3) gathers them first and afterwards takes its shards from what
  // `fn` left there. Collective. Default: fn().
  virtual void with_full_parameters(const std::function<void()>& fn) { fn(); }
  // Required: the processes this plugin runs over (for rank-0-only logging and checkpoint writes).
  virtual distributed::ProcessGroup& process_group() = 0;
};

// What a parallel plugin library exports as booster_create_parallel: a new plugin built from its
// options (ConfigError for unknown or bad ones), owned by the caller, which binds it to the library.
using ParallelFactory = ParallelPlugin*(const nlohmann::json& options);

// A parallel plugin by name or path (Note [Finding a plugin] in booster/plugin/loader.h), created with
// `options`, every call forwarded through the plugin boundary (exceptions become host errors) and bound
// to its library (Note [Plugin lifetime]). "" gives the built-in single-process plugin (the code the
// `single` library exports) with no library. Defined in parallel_plugin.cpp.
std::shared_ptr<ParallelPlugin> create_plugin(const std::string& name_or_path,
                                              const nlohmann::json& options = nlohmann::json::object());

}  // namespace booster

// A parallel plugin: `MakePlugin` is any function
//   std::unique_ptr<booster::ParallelPlugin> MakePlugin(const nlohmann::json& options)
// and the plugin is selected by NameString, e.g. from a config's "plugin": {"name": NameString, ...}.
#define BOOSTER_EXPORT_PARALLEL_PLUGIN(NameString, MakePlugin)                                      \
  namespace booster_plugin_exports {                                                                \
  static ::booster::ParallelPlugin* create_parallel(const nlohmann::json& options) {                \
    return (MakePlugin)(options).release();                                                         \
  }                                                                                                 \
  }                                                                                                 \
  BOOSTER_EXPORT_PLUGIN_WITH_ABI(parallel, NameString, booster_plugin_exports::create_parallel,      \
                                 BOOSTER_PLUGIN_ABI_VERSION)
