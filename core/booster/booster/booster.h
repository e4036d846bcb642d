// Booster: the user's entry point. It injects a mixed-precision strategy and a parallelism plugin into
// an ordinary training loop, so switching either is a change of config, not of code.
//
//   Booster booster(BoosterConfig{.mixed_precision = "fp16", .plugin = "ddp"});  // or from_json(...)
//   auto [model, optimizer, criterion, loader, scheduler] =           // use only these from here on
//       booster.boost(net, adamw, loss_fn, train_loader, cosine);     // the parts you built
//   for (data::Batch& batch : *loader) {
//     optimizer->zero_grad();
//     Tensor loss = criterion((*model)(batch.x), batch.y);
//     booster.backward(loss, *optimizer);
//     optimizer->step();      // skipped (parameters untouched) when a gradient is inf/NaN
//     scheduler->step();      // does not advance after a skipped step, as Accelerate
//   }
//
// Note [Booster lifecycle]
// * Construction resolves everything that can be wrong before any work starts: the plugin is loaded
//   (PluginError: not found, not a plugin, another ABI version), the strategy is created (ConfigError
//   for unknown or out-of-range options), and the combination is checked against the compatibility
//   matrix (IncompatibleError naming the combination, why and what to use instead). A Booster may also
//   be handed these already built (BoosterComponents, Note [Built once]).
// * boost() is called once per model. The strategy configures model, optimizer and criterion first
//   (unless the plugin controls precision), then the plugin configures every part (Note [Parallel
//   plugins] in booster/plugin/parallel_plugin.h). Use only what boost() returns.
// * The optimizer the user built stays the source of hyperparameters: a scheduler built on it edits
//   its param groups, and the boosted optimizer copies lr and the other options into the optimizer
//   that actually steps (a MasterWeightOptimizer, a ZeRO shard optimizer) before every step.
// * With no plugin the Booster runs the built-in single-process plugin, the same code the `single`
//   plugin library exports, so nothing depends on finding a shared library.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "booster/nn/hf.h"  // SavePretrainedOptions
#include "booster/nn/lora.h"  // LoraConfig
#include "booster/plugin/parallel_plugin.h"
#include "booster/tensor/random.h"

namespace booster {

namespace reproducible {
class GradientTree;
}

struct BoosterConfig {
  // A registered strategy name ("fp32", "fp16", "bf16", "fp16_naive", "fp16_apex", ...) or a precision
  // plugin's name or path, with the strategy's options.
  std::string mixed_precision = "fp32";
  nlohmann::json mixed_precision_options = nlohmann::json::object();
  // A parallel plugin's name or path ("single", "ddp", "low_level_zero", ...); empty: single process.
  std::string plugin;
  nlohmann::json plugin_options = nlohmann::json::object();
  // Where the model trains: "cpu", "cuda" or "cuda:N". boost() moves the model there and makes the
  // dataloader hand out batches there.
  std::string device = "cpu";
  // The same bytes at every world size that divides `reproducible_chunks` (Note [Reproducible training
  // across world sizes] in booster/booster/reproducible.h): train with Booster::reproducible_step. The
  // chunks the global batch is cut into; 0: reproducible::default_chunks of the batch.
  bool reproducible = false;
  int64_t reproducible_chunks = 0;

  // {"mixed_precision": "fp16" or {"name": "fp16", <options>}, "plugin": "ddp" or {"name": "ddp",
  // <options>}, "device": "cpu", "reproducible": false, "reproducible_chunks": 0}; every key optional. ConfigError naming the key for anything else.
  // The sections are read by config::parse_named_section, the one parser of their shape.
  static BoosterConfig from_json(const nlohmann::json& config);
  // The strategy and plugin `booster run --mixed-precision NAME --plugin NAME` chose for this process,
  // as Accelerate's Accelerator() reads `accelerate launch`'s choices (Note [Switching by launcher]
  // in booster/config/booster_sections.cpp): kMixedPrecisionVariable and kPluginVariable, defaults where
  // unset; an unknown name is the ConfigError a config's section gives, naming the variable.
  static BoosterConfig from_env();
  nlohmann::json to_json() const;
};
inline constexpr const char* kMixedPrecisionVariable = "BOOSTER_MIXED_PRECISION";
inline constexpr const char* kPluginVariable = "BOOSTER_PLUGIN";

// The device named by `name` ("cpu", "cuda", "cuda:1"): ConfigError when it names none, DeviceError
// (one line: none was found, or which exist) when it is a GPU this process cannot use.
Device require_device(const std::string& name);

// Note [Built once]
// A plugin may open libraries, read the environment or start threads, and a strategy may be a plugin's
// too, so a run builds each once and hands the same objects on: BoosterComponents holds a config with
// the plugin and the strategy built from it, checked together against the compatibility matrix. Its
// constructor is the one place that check is made. Booster(BoosterConfig) builds them with
// BoosterComponents::create; a training config is resolved by config::resolve_run, which builds them
// while checking the `mixed_precision` and `plugin` sections (its errors name JSON paths) and passes
// them on, so `booster train` builds each once (tests count the factory calls, plugin::factory_calls).
struct BoosterComponents {
  // Checks the combination (compat::require_compatible: IncompatibleError) of `plugin` and the strategy
  // named config.mixed_precision on config.device.
  BoosterComponents(BoosterConfig config, std::shared_ptr<ParallelPlugin> plugin,
                    std::shared_ptr<mixed_precision::MixedPrecision> precision);
  // Creates the plugin (create_plugin: PluginError, ConfigError for its options), then the strategy
  // (mixed_precision::create: ConfigError), each once, then checks them as the constructor does.
  static BoosterComponents create(const BoosterConfig& config);

  BoosterConfig config;
  std::shared_ptr<ParallelPlugin> plugin;
  std::shared_ptr<mixed_precision::MixedPrecision> precision;
};

// Where a loop stands in its gradient accumulation (Note [Gradient accumulation in a loop]): what
// Booster::accumulate() shares with the boosted optimizer and scheduler, which it gates.
struct AccumulationState {
  int64_t steps = 1;           // micro-steps per optimizer step in the current cycle
  int64_t micro = 0;           // the open micro-step's place in its cycle (the next one's while none is open)
  bool open = false;           // a Booster::Accumulate guard lives
  bool backward_done = false;  // the open micro-step ran a backward
  bool stepped = false;        // the open micro-step stepped the optimizer
  // True while a guard holds back the optimizer step (and the scheduler's, and clipping).
  bool holds_step() const { return open && micro != steps - 1; }
  // True while a guard keeps the gradients of the cycle's backwards (zero_grad does nothing).
  bool holds_gradients() const { return open && !stepped && (micro > 0 || backward_done); }
};

// The optimizer a boosted loop uses: zero_grad() and step() as torch's, with the strategy deciding
// whether the step happens (Note [The mixed-precision step]).
class BoostedOptimizer {
 public:
  // `accumulation` (the Booster's): gates zero_grad() and step() inside Booster::accumulate(); null:
  // never gated.
  BoostedOptimizer(std::shared_ptr<optim::Optimizer> user, std::shared_ptr<optim::Optimizer> stepped,
                   std::shared_ptr<mixed_precision::MixedPrecision> precision,
                   std::shared_ptr<AccumulationState> accumulation = nullptr);

  // Inside Booster::accumulate(), does nothing once a backward of the cycle ran and until its step
  // (the gradients being accumulated stay).
  void zero_grad(bool set_to_none = true);
  // Copies the user optimizer's options (lr, ...) into the stepped optimizer, then steps through the
  // strategy: skipped when a gradient is inf/NaN. Inside Booster::accumulate(), does nothing but on the
  // cycle's last micro-step (not counted in steps()).
  void step();
  bool step_was_skipped() const { return precision_->step_was_skipped(); }
  // Calls of step() so far, skipped ones included (saved and restored by Booster::save_state).
  int64_t steps() const { return steps_; }
  void set_steps(int64_t steps) { steps_ = steps; }

  double lr(size_t group = 0) const { return user_->lr(group); }
  void set_lr(double lr) { user_->set_lr(lr); }
  std::vector<optim::ParamGroup>& param_groups() { return user_->param_groups(); }

  // The state of the optimizer that steps (for a sharded optimizer, every rank must call: it gathers).
  optim::OptimizerState state_dict() const;
  void load_state_dict(const optim::OptimizerState& state);

  // The optimizer the user passed to boost() (build a scheduler on it) and the one that steps.
  optim::Optimizer& user_optimizer() const { return *user_; }
  optim::Optimizer& stepped_optimizer() const { return *stepped_; }
  const std::shared_ptr<mixed_precision::MixedPrecision>& precision() const { return precision_; }

  // Hyperparameters (lr, ...) from the user's optimizer into the stepped one, and back after loading.
  void copy_options_to_stepped() const;
  void copy_options_from_stepped();

 private:

  std::shared_ptr<optim::Optimizer> user_;
  std::shared_ptr<optim::Optimizer> stepped_;
  std::shared_ptr<mixed_precision::MixedPrecision> precision_;
  std::shared_ptr<AccumulationState> accumulation_;
  int64_t steps_ = 0;
};

// The LR scheduler of a boosted loop: step() does nothing after a skipped optimizer step, nor inside
// Booster::accumulate() but on the cycle's last micro-step.
class BoostedScheduler {
 public:
  BoostedScheduler(std::shared_ptr<optim::LRScheduler> scheduler,
                   std::shared_ptr<mixed_precision::MixedPrecision> precision,
                   std::shared_ptr<const AccumulationState> accumulation = nullptr);
  void step();
  const std::vector<double>& get_last_lr() const { return scheduler_->get_last_lr(); }
  nlohmann::json state_dict() const { return scheduler_->state_dict(); }
  void load_state_dict(const nlohmann::json& state) { scheduler_->load_state_dict(state); }
  optim::LRScheduler& scheduler() { return *scheduler_; }

 private:
  std::shared_ptr<optim::LRScheduler> scheduler_;
  std::shared_ptr<mixed_precision::MixedPrecision> precision_;
  std::shared_ptr<const AccumulationState> accumulation_;
};

// What boost() returns; absent inputs stay null/empty.
struct Boosted {
  nn::ModulePtr model;
  std::shared_ptr<BoostedOptimizer> optimizer;
  nn::Criterion criterion;
  std::shared_ptr<data::DataLoader> dataloader;
  std::shared_ptr<BoostedScheduler> scheduler;
};

// Options of Booster::save_state and load_state.
struct SaveStateOptions {
  int keep_last = 0;            // committed checkpoints to keep, the new one included; 0 keeps all
  std::optional<int64_t> step;  // the directory's step; step() by default
  // false: write every file into `step-N.tmp/` (or into a checkpoint::WriteCapture active on this
  // thread) but leave the commit (checkpoint::commit_checkpoint) to the caller: the Trainer's
  // asynchronous checkpoints (Note [Asynchronous checkpoints] in trainer/async_save.h). On several
  // processes every rank returns without the closing barrier; the commit must wait for every rank's files.
  bool commit = true;
};
struct LoadStateOptions {
  // Starts error messages ("load_state", "train.resume").
  std::string context = "load_state";
  // How a user restores a saved setting, appended to the refusal: where = "optimizer.lr", saved = its
  // saved value. Default: "resume with the saved value, or start afresh".
  std::function<std::string(const std::string& where, const nlohmann::json& saved)> restore_hint;
  // A setting holding the run's length in steps (the Trainer's "train.max_steps"): a resume may make
  // it smaller (an exact prefix of the saved run) but not larger. Empty: none.
  std::string run_length_setting;
  // Check every file against the checkpoint's checksums.json before reading it (Note [Checkpoint
  // checksums]); false loads a damaged checkpoint as it is.
  bool verify = true;
  // Resuming on another number of processes or another plugin (Note [Resuming across layouts] in
  // state.cpp): the settings as compared across world sizes, e.g. a per-rank batch size made the
  // global one. Null: a checkpoint of another world size or plugin is refused.
  std::function<nlohmann::json(const nlohmann::json& settings, int world_size)> portable_settings;
  // The resume setting that holds the mixed-precision strategy ("mixed_precision" for the Trainer's
  // command). Set, a checkpoint of another strategy resumes: its float32 weights and optimizer state
  // carry over, the strategy's own state starts afresh (Note [Resuming under another precision]), and
  // that setting (and a plugin's "precision") is left uncompared. Empty: refused.
  std::string precision_setting;
};
struct LoadedState {
  std::filesystem::path dir;            // the step directory read
  int64_t step = 0;
  std::vector<std::string> unchecked;   // settings the checkpoint predates (not compared)
  // Set when the checkpoint was saved under another world size or plugin: what that changes, one
  // line for the user ("resumed on 2 processes (ddp) from a checkpoint of 1 (single): ...").
  std::string layout_change;
  // Set when the checkpoint was saved under another mixed-precision strategy: what carries over and
  // what does not, one line.
  std::string precision_change;
};

class Booster {
 public:
  // BoosterComponents::create(config), then as below.
  explicit Booster(BoosterConfig config = {});
  // Runs with components already built and checked (Note [Built once]).
  explicit Booster(BoosterComponents components);
  ~Booster();
  Booster(const Booster&) = delete;
  Booster& operator=(const Booster&) = delete;

  // Injects precision and parallelism (Note [Booster lifecycle]). Every argument but the model is
  // optional. Call once.
  Boosted boost(nn::ModulePtr model, std::shared_ptr<optim::Optimizer> optimizer = nullptr,
                nn::Criterion criterion = nullptr, std::shared_ptr<data::DataLoader> dataloader = nullptr,
                std::shared_ptr<optim::LRScheduler> scheduler = nullptr);

  // The scaled backward of the strategy; under data parallelism the gradient all-reduce starts here.
  // Inside accumulate(n), backpropagates loss / n.
  void backward(const Tensor& loss, BoostedOptimizer& optimizer);
  // One training step's forward and backward over the batch (x, y) (ColossalAI's execute_pipeline):
  // under a plugin that cuts the model into pipeline stages, its micro-batches flow through the stages
  // (ParallelPlugin::train_step); otherwise criterion(model(x), y), then backward(loss * loss_factor).
  // The loss of each micro-batch is multiplied by loss_factor before its backward (1 / accumulation
  // steps when accumulating; inside accumulate(n) it is divided by n as well). Returns the batch's loss
  // (unscaled) on every rank. Pass the boosted parts. Collective under a pipeline.
  double execute_pipeline(const Tensor& x, const Tensor& y, nn::Module& model, const nn::Criterion& criterion,
                          BoostedOptimizer& optimizer, double loss_factor = 1.0);
  // One optimizer step's forward and backward under BoosterConfig::reproducible (Note [Reproducible
  // training across world sizes] in booster/booster/reproducible.h): (x, y) are this rank's rows of the
  // step's global batch as a DistributedSampler deals them (the micro-batches of the step concatenated).
  // They are cut into the rank's chunks, each chunk's gradient of criterion / K is computed on its own,
  // and the chunks of every rank are summed in one fixed tree, so the gradients the optimizer steps with
  // (and the loss returned, the global batch's mean over chunks) are the same bytes at every supported
  // world size. Then call clip_grad_norm (if wanted) and optimizer.step() as usual. Collective.
  // StateError without reproducible or inside accumulate(); ConfigError for a batch the chunks do not
  // divide (reproducible::check_sizes).
  double reproducible_step(const Tensor& x, const Tensor& y, nn::Module& model, const nn::Criterion& criterion,
                           BoostedOptimizer& optimizer);
  // The chunks of a global batch of `global_rows` rows under this config (BoosterConfig::reproducible_chunks
  // or the default), checked against the world size (ConfigError).
  int64_t reproducible_chunks(int64_t global_rows);
  // Bytes this rank received in the last reproducible_step's gradient exchange (0 on one process).
  int64_t reproducible_received_bytes() const;

  // Unscales first, then clips the joint L2 norm of all gradients to max_norm; returns the norm before
  // clipping (inf when a gradient is inf/NaN: the step will be skipped). Inside accumulate() on a
  // micro-step that does not step, does nothing and returns NaN (the gradients are not complete yet).
  double clip_grad_norm(BoostedOptimizer& optimizer, double max_norm);

  // While the returned guard lives, backward accumulates gradients without communication (gradient
  // accumulation); the first backward after it communicates the sum. IncompatibleError when the plugin
  // cannot (support_no_sync() false).
  class NoSync {
   public:
    explicit NoSync(ParallelPlugin& plugin);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    ParallelPlugin& plugin_;
  };
  [[nodiscard]] NoSync no_sync();

  // Note [Gradient accumulation in a loop]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // One optimizer step over n micro-batches, written the same for every plugin (Accelerate's
  // accelerator.accumulate(model)): open one guard per micro-batch around the usual loop body.
  //
  //   for (data::Batch& batch : *loader) {
  //     auto micro_step = booster.accumulate(4);  // this batch is one of 4 per optimizer step
  //     optimizer->zero_grad();                   // only before the cycle's first backward
  //     Tensor loss = criterion((*model)(batch.x), batch.y);
  //     booster.backward(loss, *optimizer);       // backpropagates loss / 4
  //     optimizer->step();                        // only at the 4th micro-batch
  //     scheduler->step();                        // likewise
  //   }
  //
  // While a guard lives, backward divides the loss by n, so the accumulated gradient is that of the
  // micro-batches' mean loss, as one batch of all of them would give; every micro-step but the
  // cycle's last skips the gradient synchronisation where the plugin can (support_no_sync(): ddp,
  // low_level_zero stage 1), and where it cannot (ZeRO-2/3, which add each backward into the shard;
  // hybrid_parallel, which reduces once before the step) backward accumulates as it is. optimizer.step(),
  // scheduler.step() and clip_grad_norm() act only on the cycle's last micro-step; zero_grad() acts
  // only while no backward of the cycle has run (at the cycle's start, or after its step), so it may
  // be called at the top of the body or after step(). The cycle is counted by the guards, not by the
  // loader: a loader whose length n does not divide carries the rest into the next epoch. Outside a
  // guard nothing is gated. The Trainer's gradient accumulation is this (Note [Gradient accumulation]
  // in booster/trainer/trainer.cpp).
  class Accumulate {
   public:
    // ValueError for steps < 1; StateError inside another guard, or for another n in mid-cycle.
    Accumulate(Booster& booster, int64_t steps);
    ~Accumulate();
    Accumulate(const Accumulate&) = delete;
    Accumulate& operator=(const Accumulate&) = delete;
    // True on the cycle's last micro-step: the optimizer steps and gradients are synchronised.
    bool sync() const { return sync_; }
    // This micro-step's place in its cycle, 0 to steps - 1.
    int64_t micro_step() const { return micro_; }

   private:
    Booster& booster_;
    int64_t micro_;
    bool sync_;
    bool gradient_sync_off_ = false;  // this guard turned the plugin's gradient sync off
  };
  [[nodiscard]] Accumulate accumulate(int64_t steps);
  const AccumulationState& accumulation() const { return *accumulation_; }
  // Ends an unfinished accumulation cycle without an optimizer step, as a loop does after a micro-batch
  // failed: the next accumulate() starts a new cycle (zero the gradients first, or they carry over).
  // StateError while a guard is open.
  void abandon_accumulation();

  // A loader for this process over `dataset` (each rank its own part under data parallelism).
  std::shared_ptr<data::DataLoader> prepare_dataloader(data::DatasetPtr dataset, const data::DataLoaderOptions& options);

  // Checkpoint IO through the plugin (collective under several processes: every rank calls).
  // save_optimizer also saves the strategy's state (Note [Precision state beside the optimizer]).
  void save_model(const nn::Module& model, const std::filesystem::path& dir,
                  uint64_t max_shard_bytes = 5'000'000'000ull) const;
  void load_model(nn::Module& model, const std::filesystem::path& path) const;
  // LoRA adapters (nn/lora.h) on `model` before boost(), as ColossalAI's enable_lora: the target Linears
  // get lora_A and lora_B, everything else is frozen; build the optimizer over
  // nn::trainable_parameters(*model), so it holds (and a strategy keeps masters of) the adapters only.
  // Returns the module paths adapted. StateError after boost(); IncompatibleError under a plugin that
  // splits layers (hybrid_parallel with tp_size or pp_size above 1) for a model other than the Llama
  // family and the GPT, whose shard policies alone split adapters (Note [LoRA under tensor parallelism],
  // nn/lora.cpp).
  std::vector<std::string> enable_lora(const nn::ModulePtr& model, const nn::LoraConfig& config);
  // The LoRA config enable_lora applied (nullopt without LoRA).
  const std::optional<nn::LoraConfig>& lora() const { return lora_; }
  // Note [Adapter-only checkpoints] (state.cpp): a digest of the frozen base weights boost() was given,
  // 16 hex digits ("" before boost() or without LoRA). base_digest(model) computes it for any model: the
  // names, dtypes, shapes and bytes of its parameters that do not require grad, in parameters() order.
  const std::string& lora_base_digest() const { return lora_base_digest_; }
  static std::string base_digest(const nn::Module& model);
  // The adapters of a LoRA checkpoint step directory into the boosted model (what `booster eval` of a
  // LoRA run evaluates): its model/ only, after the checks load_state makes of its "lora" (the same LoRA
  // settings, the same base digest). CheckpointError naming what differs. Collective.
  void load_adapters(const std::filesystem::path& step_dir, const std::string& context = "load_adapters");

  // The model boost() was given as a Hugging Face directory (nn::save_pretrained: config.json and the
  // weights in Hugging Face's names), from a user's own loop under any plugin: the parameters a plugin
  // sharded or split (ZeRO-3, tensor and pipeline parallel) are gathered as save_model gathers them, and
  // rank 0 writes. The weights keep the dtype they train in (a pure bf16 model: bfloat16, and
  // torch_dtype says so); the float32 masters of a 16-bit strategy are in save_state's checkpoints,
  // which `booster export` turns into a directory. ConfigError for a model that is no Hugging Face
  // family (nn::GPT, nn::Llama), StateError before boost(). Collective: every rank calls.
  void save_pretrained(const std::filesystem::path& dir, const nn::SavePretrainedOptions& options = {}) const;
  void save_optimizer(const BoostedOptimizer& optimizer, const std::filesystem::path& dir) const;
  // precision_state false: the optimizer only, the strategy keeping its fresh state (a resume under
  // another strategy, Note [Resuming under another precision] in state.cpp).
  void load_optimizer(BoostedOptimizer& optimizer, const std::filesystem::path& dir, bool precision_state = true) const;
  void save_lr_scheduler(const BoostedScheduler& scheduler, const std::filesystem::path& file) const;
  void load_lr_scheduler(BoostedScheduler& scheduler, const std::filesystem::path& file) const;

  // ---- the whole training state (Note [Booster state] in booster/booster/state.cpp), as Accelerate's
  // save_state/load_state.
  //
  //   booster.register_state("ema", [&] { return json(ema); }, [&](const json& j) { ema = j; });
  //   if (resume) booster.load_state("runs/a/checkpoints");      // the newest checkpoint under the root
  //   for (...) { ...; optimizer->step(); if (booster.step() % 100 == 0) booster.save_state("runs/a/checkpoints"); }
  //
  // save_state writes everything boost() returned (model, optimizer with the strategy's state,
  // scheduler, the dataloader's position and epoch), every random generator (the default one, those of
  // the model's dropouts and the registered ones) and the registered state into `<root>/step-N/`
  // (N = step() unless options.step says otherwise), committed atomically, then points `<root>/latest`
  // at it and prunes to keep_last (Note [Checkpoint directory layout] in checkpoint/README.md). The first save
  // into a root takes its lock (checkpoint::RootLock) for the Booster's life, so a second program saving
  // into it is refused. Collective: every rank calls; rank 0 writes.
  std::filesystem::path save_state(const std::filesystem::path& root, const SaveStateOptions& options = {});
  // Takes the lock of a root save_state will write into now rather than at the first save, so a second
  // program started on it is refused at once (the Trainer does at its start). No-op off rank 0.
  void lock_state_root(const std::filesystem::path& root);

  // Restores what save_state wrote: `path` is a step directory or a root (its `latest`). Refused with a
  // CheckpointError naming both sides, before any tensor is read, when a setting of set_resume_settings
  // differs from the saved one, or the checkpoint is of another strategy, plugin or world size and
  // `options` does not allow that move; files that are missing, truncated or corrupt are
  // CheckpointErrors naming the file. Collective.
  LoadedState load_state(const std::filesystem::path& path, const LoadStateOptions& options = {});
  // The step directory load_state(path) would read; nullopt when `path` does not exist or is a root
  // that holds nothing yet (checkpoint::holds_no_checkpoint). Of a root, the newest step that passes
  // its checksums (Note [Falling back from a damaged checkpoint] in state.cpp): each newer one that does
  // not, or a `latest` naming a step that is gone, adds a line to `passed_over` (file and tensor); a root
  // where no step passes, or that holds something but no checkpoint, is a CheckpointError naming it.
  // `verify` false: the step `latest` names, unchecked (--no-verify).
  static std::optional<std::filesystem::path> find_state(const std::filesystem::path& path,
                                                         std::vector<std::string>* passed_over = nullptr,
                                                         bool verify = true);
  // The float32 master weights a checkpoint step directory saved beside its model, by parameter name:
  // a ZeRO optimizer's "state.<i>.master_weight" and a precision strategy's "master_weights.<g>.<j>"
  // (pure bf16, fp16_naive, apex O2/O3), named through optimizer.json's param_names. Empty when the
  // model itself holds the float32 weights (fp32, the autocast strategies) or the step has no
  // optimizer. What export writes instead of a 16-bit model (Note [Resuming under another precision]).
  static nn::StateDict read_master_weights(const std::filesystem::path& step_dir);
  // The trained weights of a checkpoint step directory, as a whole model's state dict: its model/
  // files, each parameter replaced by its float32 master where the run kept one. What export, generate
  // and eval load; `used_masters` (when given) says whether any master was taken. CheckpointError for
  // a master whose parameter the model lacks or shapes otherwise.
  static nn::StateDict read_trained_weights(const std::filesystem::path& step_dir, bool* used_masters = nullptr);

  // Optimizer steps taken so far (BoostedOptimizer::steps of the boosted optimizer; 0 without one).
  int64_t step() const;

  // Extra state a checkpoint carries: JSON, or named tensors (saved in extra.safetensors). `load` is
  // called by load_state with what `save` returned; a checkpoint without the name is a CheckpointError.
  void register_state(const std::string& name, std::function<nlohmann::json()> save,
                      std::function<void(const nlohmann::json&)> load);
  void register_tensors(const std::string& name, std::function<nn::StateDict()> save,
                        std::function<void(const nn::StateDict&)> load);
  // Forgets a registered state or tensors (no-op for an unknown name).
  void unregister_state(const std::string& name) { registered_.erase(name); }
  // A random generator to save and restore beside the default one and those the model's dropouts use.
  void register_generator(const std::string& name, Generator& generator);
  // Settings a resume must keep (Note [Settings a resume must keep] in state.cpp): saved with the state
  // and compared key by key on load_state.
  void set_resume_settings(nlohmann::json settings) { resume_settings_ = std::move(settings); }
  // The model passed to boost() (the whole model, where a plugin split it across ranks); null before.
  const nn::ModulePtr& user_model() const { return user_model_; }
  // What boost() returned (empty before).
  const Boosted& boosted() const { return parts_; }

  const BoosterConfig& config() const { return config_; }
  ParallelPlugin& plugin() { return *plugin_; }
  // The strategy that drives backward and step (after boost(), possibly the plugin's wrapper).
  mixed_precision::MixedPrecision& precision() { return *precision_; }
  distributed::ProcessGroup& process_group() { return plugin_->process_group(); }

 private:
  int process_group_rank() const;

  BoosterConfig config_;
  std::shared_ptr<ParallelPlugin> plugin_;
  std::shared_ptr<mixed_precision::MixedPrecision> precision_;
  std::shared_ptr<CheckpointIO> checkpoint_io_;
  bool boosted_ = false;
  // Shared with the boosted optimizer and scheduler (Note [Gradient accumulation in a loop]).
  std::shared_ptr<AccumulationState> accumulation_ = std::make_shared<AccumulationState>();
  // reproducible_step's sums, made at its first call.
  std::unique_ptr<reproducible::GradientTree> reproducible_tree_;

  // Booster state (state.cpp).
  struct RegisteredState {
    std::function<nlohmann::json()> save_json;
    std::function<void(const nlohmann::json&)> load_json;
    std::function<nn::StateDict()> save_tensors;
    std::function<void(const nn::StateDict&)> load_tensors;
  };
  std::map<std::string, Generator*> generators() const;
  // A checkpoint of another strategy, read whole and checked, ready to load (Note [Resuming under
  // another precision] in state.cpp).
  struct HandOver {
    nn::StateDict model;
    optim::OptimizerState optimizer;  // without master weights
    std::vector<Tensor> weights;      // float32, per optimizer parameter index
  };
  // The step every rank of several loads (Note [Ranks resume from one step] in state.cpp): a collective.
  std::optional<std::filesystem::path> agree_on_state(const std::filesystem::path& path, const LoadStateOptions& options);
  HandOver read_hand_over(const std::filesystem::path& dir, const std::string& refusal) const;
  void apply_hand_over(HandOver& handover);
  void check_state_name(const std::string& name) const;

  Boosted parts_;
  nn::ModulePtr user_model_;  // the model passed to boost(), for its generators
  // Note [Per-rank state of a split model] (booster.cpp): true when the plugin splits the model across
  // ranks; a file name of this rank's own ("precision.rank-3.safetensors").
  bool splits_model() const;
  std::string rank_file(const std::string& name, const std::string& extension) const;
  std::map<std::string, RegisteredState> registered_;
  std::map<std::string, Generator*> registered_generators_;
  nlohmann::json resume_settings_ = nlohmann::json::object();
  std::map<std::filesystem::path, std::shared_ptr<void>> root_locks_;
  // LoRA (Note [Adapter-only checkpoints] in state.cpp): the config, the base's digest (made in boost())
  // and the adapters as a module tree of their own, whose state dict is what a checkpoint's model/ holds.
  std::optional<nn::LoraConfig> lora_;
  std::string lora_base_digest_;
  nn::ModulePtr adapter_view() const;
  void check_lora_state(const nlohmann::json& state, const std::filesystem::path& dir, const std::string& context) const;
};

}  // namespace booster
