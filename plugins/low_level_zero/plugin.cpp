// low_level_zero: ZeRO stages 1, 2 and 3 (ColossalAI's LowLevelZeroPlugin, plus DeepSpeed's stage 3) over
// the process group of the
// model's device (Note [A group per device]: the default group on the CPU, NCCL on CUDA).
// The plugin controls precision: the model is trained in `precision` (fp16, bf16 or fp32) with float32
// master weights and optimizer state sharded across ranks (Note [ZeRO partitions] in
// README.md), and the Booster's own mixed precision must be the identity ("fp32").
//
// Options (ColossalAI's names and defaults):
//   stage            1 | 2 | 3                (1)
//   precision        "fp16" | "bf16" | "fp32" ("fp16")
//   initial_scale    fp16 loss scale          (2^32)    min_scale (1)      max_scale (2^32)
//   growth_factor    (2)   backoff_factor (0.5)   growth_interval (1000)   hysteresis (2)
//   max_norm         clip the whole gradient to this L2 norm in every step; 0: no clipping (0)
//   overlap_communication   stage 2: reduce gradients in buckets while backward runs (true)
//   reduce_bucket_size_in_m bucket size in 2^20 elements (12)
#include <algorithm>
#include <cmath>

#include "booster/autograd/autograd.h"
#include "booster/config/option_reader.h"
#include "booster/plugin/data_parallel.h"  // DataParallelPlugin: group, sampler, checkpoint IO, broadcast
#include "booster/tensor/deferred.h"
#include "zero_optimizer.h"

namespace booster::zero {
namespace {

using nlohmann::json;

// ---------------------------------------------------------------------------------------------- options

struct PluginOptions {
  ZeroOptions zero;
  std::string precision = "fp16";
  double bucket_m = 12.0;
};

PluginOptions read_options(const json& options) {
  config::OptionReader r("plugin", "low_level_zero", options);
  PluginOptions o;
  o.zero.stage = int(r.integer("stage", 1, 1, 3));
  o.precision = r.choice("precision", "fp16", {"fp16", "bf16", "fp32"});
  o.zero.working_dtype = o.precision == "fp16"   ? DType::Float16
                         : o.precision == "bf16" ? DType::BFloat16
                                                 : DType::Float32;
  mixed_precision::DynamicGradScalerOptions& s = o.zero.scaler;
  const double big = 3.4e38;
  s.initial_scale = r.number("initial_scale", 4294967296.0, 0.0, big, true);  // 2^32, as ColossalAI
  s.min_scale = r.number("min_scale", 1.0, 0.0, big, true);
  s.growth_factor = r.number("growth_factor", 2.0, 1.0, 1e9, true);
  s.backoff_factor = r.number("backoff_factor", 0.5, 0.0, 1.0, true, true);
  s.growth_interval = r.integer("growth_interval", 1000, 1, int64_t(1) << 40);
  s.hysteresis = r.integer("hysteresis", 2, 1, int64_t(1) << 40);
  s.max_scale = r.number("max_scale", 4294967296.0, 0.0, big, true);
  o.zero.max_norm = r.number("max_norm", 0.0, 0.0, big);
  o.zero.overlap = r.flag("overlap_communication", true);
  o.bucket_m = r.number("reduce_bucket_size_in_m", 12.0, 0.0, 1e6, true);
  o.zero.bucket_numel = std::max<int64_t>(1, int64_t(o.bucket_m * double(1 << 20)));
  r.finish();
  BOOSTER_CHECK(s.min_scale <= s.initial_scale && s.initial_scale <= s.max_scale, ConfigError,
                "plugin 'low_level_zero': the scales must satisfy min_scale <= initial_scale <= max_scale, got ", s.min_scale,
                ", ", s.initial_scale, ", ", s.max_scale);
  return o;
}

json options_json(const PluginOptions& o) {
  const mixed_precision::DynamicGradScalerOptions& s = o.zero.scaler;
  return {{"stage", o.zero.stage},           {"precision", o.precision},
          {"initial_scale", s.initial_scale}, {"min_scale", s.min_scale},
          {"growth_factor", s.growth_factor}, {"backoff_factor", s.backoff_factor},
          {"growth_interval", s.growth_interval}, {"hysteresis", s.hysteresis},
          {"max_scale", s.max_scale},         {"max_norm", o.zero.max_norm},
          {"overlap_communication", o.zero.overlap}, {"reduce_bucket_size_in_m", o.bucket_m}};
}

// ------------------------------------------------------------------------------------ the precision

// The strategy that replaces the Booster's (Note [Who drives the step]): scales the loss, and leaves
// reduction, unscaling, clipping and the sharded step to the ZeroOptimizer.
class ZeroPrecision final : public mixed_precision::MixedPrecision {
 public:
  ZeroPrecision(std::shared_ptr<ZeroOptimizer> optimizer, json options)
      : optimizer_(std::move(optimizer)), options_(std::move(options)) {}

  std::string name() const override { return "low_level_zero"; }
  json options() const override { return options_; }
  mixed_precision::Configured configure(nn::ModulePtr, std::shared_ptr<optim::Optimizer>,
                                        mixed_precision::Criterion) override {
    BOOSTER_FAIL(StateError, "low_level_zero: its precision is configured by the plugin's configure(), not again");
  }

  void backward(const Tensor& loss, optim::Optimizer& optimizer) override {
    ZeroOptimizer& z = zero_of(optimizer);
    z.prepare_backward();
    mixed_precision::scale_loss(loss, z.loss_scale()).backward();
    z.finish_backward();
  }
  // Gradients are unscaled as they are reduced (at the end of the synced backward).
  void unscale_gradients(optim::Optimizer& optimizer) override { zero_of(optimizer); }
  double clip_grad_norm(optim::Optimizer& optimizer, double max_norm) override {
    return zero_of(optimizer).clip_grad_norm(max_norm);
  }
  void step(optim::Optimizer& optimizer) override {
    ZeroOptimizer& z = zero_of(optimizer);
    z.step();
    stats_ = z.last_step_stats();
  }
  double loss_scale() const override { return optimizer_->loss_scale(); }

  // The scaler; the masters travel with the optimizer's (gathered) state.
  mixed_precision::MixedPrecisionState state_dict() const override {
    mixed_precision::MixedPrecisionState s;
    s.meta["scaler"] = optimizer_->scaler_state();
    return s;
  }
  void load_state_dict(const mixed_precision::MixedPrecisionState& state) override {
    if (state.meta.contains("scaler")) optimizer_->load_scaler_state(state.meta.at("scaler"));
  }
  // found_inf is agreed over the plugin's own group (ZeroOptimizer::agreed_found_inf).
  void set_found_inf_reducer(FoundInfReducer) override {}

 private:
  ZeroOptimizer& zero_of(optim::Optimizer& optimizer) const {
    BOOSTER_CHECK(&optimizer == optimizer_.get(), StateError,
                  "low_level_zero: pass the optimizer that configure() returned (it holds this rank's shard), "
                  "got a '", optimizer.name(), "' optimizer that is not it");
    return *optimizer_;
  }

  std::shared_ptr<ZeroOptimizer> optimizer_;
  json options_;
};

// ------------------------------------------------------------------------------------------ checkpoints

// The optimizer the plugin's configure() made, shared with its checkpoint IO (which the Booster takes
// before configure).
struct OptimizerSlot {
  std::shared_ptr<ZeroOptimizer> zero;
};

// Runs fn with every parameter gathered, then `after` (taking the shards from what fn wrote), then
// releases them; when fn throws, the shards stay as they were and the parameters are released all
// the same.
void run_gathered(ZeroOptimizer& zero, const std::function<void()>& fn, void (ZeroOptimizer::*after)()) {
  zero.gather_all();
  try {
    fn();
  } catch (...) {
    zero.release_all();
    throw;
  }
  if (after) (zero.*after)();
  zero.release_all();
}

// Stage 3 (Note [ZeRO-3: parameters by module]): the model's parameters are gathered whole for the
// default IO's single-process files, and the shards taken from what a load wrote.
class Zero3CheckpointIO final : public CheckpointIO {
 public:
  Zero3CheckpointIO(distributed::ProcessGroup& group, std::shared_ptr<OptimizerSlot> slot)
      : CheckpointIO(group), slot_(std::move(slot)) {}
  void save_model(const nn::Module& model, const std::filesystem::path& path, uint64_t max_shard_bytes) const override {
    with_full(nullptr, [&] { CheckpointIO::save_model(model, path, max_shard_bytes); });
  }
  void load_model(nn::Module& model, const std::filesystem::path& path) const override {
    with_full(&ZeroOptimizer::take_shards_from_parameters, [&] { CheckpointIO::load_model(model, path); });
  }

 private:
  void with_full(void (ZeroOptimizer::*after)(), const std::function<void()>& fn) const {
    ZeroOptimizer* zero = slot_->zero.get();
    if (!zero) return fn();
    run_gathered(*zero, fn, after);
  }
  std::shared_ptr<OptimizerSlot> slot_;
};

// ------------------------------------------------------------------------------------------ the plugin

// What DataParallelPlugin does not: the sharded optimizer and the precision it controls. The process
// group, the DistributedSampler of prepare_dataloader(), the devices and the layout are the base's.
class LowLevelZeroPlugin final : public DataParallelPlugin {
 public:
  explicit LowLevelZeroPlugin(const json& options) : options_(read_options(options)) {}

  std::string name() const override { return "low_level_zero"; }
  std::string version() const override { return "0.1.0"; }
  json options() const override { return options_json(options_); }

  // The plugin controls precision: the Booster's strategy must be the identity.
  std::vector<std::string> supported_precisions() const override { return {"fp32"}; }
  bool control_precision() const override { return true; }
  bool support_no_sync() const override { return options_.zero.stage == 1; }
  // Stage 3 reads each rank's shard of a deferred model straight from its initializers (Note [ZeRO-3
  // shards from the parameters] in zero_optimizer.cpp).
  bool take_deferred_parameters() const override { return options_.zero.stage == 3; }
  // Stage 3 gathers the parameters for the files; they are a single process's either way.
  std::shared_ptr<CheckpointIO> checkpoint_io() override {
    if (options_.zero.stage != 3) return DataParallelPlugin::checkpoint_io();
    return std::make_shared<Zero3CheckpointIO>(group(), slot_);
  }
  void with_full_parameters(const std::function<void()>& fn) override {
    if (!optimizer_) return fn();
    run_gathered(*optimizer_, fn, &ZeroOptimizer::take_shards_from_parameters);
  }

  TrainingParts configure(TrainingParts parts) override {
    BOOSTER_CHECK(parts.model != nullptr, ValueError, "low_level_zero: configure needs a model");
    BOOSTER_CHECK(!configured_, StateError, "low_level_zero: configure() was called twice; boost once per plugin");
    distributed::ProcessGroup& pg = bind_process_group(*parts.model);
    configured_ = true;
    broadcast_or_agree(*parts.model);
    const DType dtype = options_.zero.working_dtype;
    if (parts.optimizer) {
      optimizer_ = std::make_shared<ZeroOptimizer>(*parts.optimizer, parts.model, pg, options_.zero);
      slot_->zero = optimizer_;
      // The user's optimizer stays the source of lr & co. for schedulers (the Booster keeps it), but
      // its full-size copies of values and gradients would undo the sharding: give them back.
      parts.optimizer->release_buffers();
      optimizer_->set_gradient_sync(gradient_sync());
      parts.optimizer = optimizer_;
      parts.precision = std::make_shared<ZeroPrecision>(optimizer_, options());
    } else if (dtype != DType::Float32) {
      parts.model->to(dtype);  // inference only: the model in the working precision, no optimizer
    }
    if (dtype != DType::Float32) {
      // Inputs go in as the working dtype; outputs come out as float32, so the loss (and its scaling)
      // is computed in float32, as fp16_naive does.
      mixed_precision::PrecisionModule::Options mo;
      mo.cast_io = true;
      mo.input_dtype = dtype;
      parts.model = std::make_shared<mixed_precision::PrecisionModule>(parts.model, mo);
    }
    return parts;
  }

  void set_gradient_sync(bool enabled) override {
    BOOSTER_CHECK(enabled || options_.zero.stage == 1, IncompatibleError, "low_level_zero: no_sync is not "
                  "supported with stage ", options_.zero.stage, ": gradients are kept only for this "
                  "rank's shard, so there is no full buffer to accumulate a local sum in; use stage 1");
    DataParallelPlugin::set_gradient_sync(enabled);
    if (optimizer_) optimizer_->set_gradient_sync(enabled);
  }

 private:
  // Checkpoints: laid out as a single process's (Note [Resuming across layouts]): the base's default
  // IO, which for stage 3 gathers the sharded parameters first (Zero3CheckpointIO); the optimizer's
  // state_dict() gathers the shards (every rank calls it) and rank 0 writes it into one file.
  // Note [One model on every rank, deferred]
  // Data parallelism starts from rank 0's weights, broadcast. A parameter stage 3 left deferred is not
  // broadcast (that would allocate it whole): every rank reads its own shard from the initializer it
  // recorded, so the ranks must have recorded the same ones. A digest of every parameter's record (0
  // for the allocated ones, so it covers which are which) must agree across the group, or every rank
  // stops with the same ValueError; then the allocated ones and the buffers are broadcast as usual.
  void broadcast_or_agree(nn::Module& model) const {
    distributed::ProcessGroup& pg = group();
    if (pg.size() == 1) return;
    autograd::NoGradGuard no_grad;
    uint64_t digest = 0;
    std::vector<Tensor> allocated;
    for (const Tensor& t : model.parameters()) {
      const uint64_t d = deferred_digest(t);
      digest = (digest ^ d) * 0x100000001b3ull + 1;
      if (d == 0) allocated.push_back(t);
    }
    // Max of (hi, lo, -hi, -lo) in one all-reduce: the largest and smallest halves across the group.
    const double hi = double(digest >> 32), lo = double(digest & 0xffffffffull);
    Tensor v = Tensor::empty({4}, DType::Float64);
    double* q = v.data<double>();
    q[0] = hi, q[1] = lo, q[2] = -hi, q[3] = -lo;
    v = v.to(pg.device());
    pg.all_reduce(v, distributed::ReduceOp::Max);
    const Tensor r = v.to(Device::cpu());
    const double* m = r.data<double>();
    BOOSTER_CHECK(m[0] == -m[2] && m[1] == -m[3], ValueError, "plugin 'low_level_zero': the ranks built different "
                  "models (their deferred parameters' initializers or weight files differ); build the model from the "
                  "same seed and files on every rank");
    for (Tensor t : allocated) pg.broadcast(t, 0);
    for (Tensor t : model.buffers()) pg.broadcast(t, 0);
  }

  PluginOptions options_;
  std::shared_ptr<ZeroOptimizer> optimizer_;
  std::shared_ptr<OptimizerSlot> slot_ = std::make_shared<OptimizerSlot>();
  bool configured_ = false;
};

std::unique_ptr<ParallelPlugin> make_low_level_zero(const json& options) {
  return std::make_unique<LowLevelZeroPlugin>(options);
}

}  // namespace
}  // namespace booster::zero

BOOSTER_EXPORT_PARALLEL_PLUGIN("low_level_zero", booster::zero::make_low_level_zero)
