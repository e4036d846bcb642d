// MixedPrecision: the interface every precision strategy implements, and the registry that builds one
// from a name and a JSON object of options.
//
// Note [The mixed-precision step]
// A strategy owns everything precision-specific in one training step, so the loop reads the same for
// every strategy:
//
//   auto mp = mixed_precision::create("fp16", {{"init_scale", 1024}});
//   auto [model, optimizer, criterion] = mp->configure(model, optimizer, criterion);
//   for (batch : loader) {
//     optimizer->zero_grad();
//     Tensor loss = criterion((*model)(batch.x), batch.y);   // forward under autocast where needed
//     mp->backward(loss, *optimizer);                        // scaled backward
//     mp->clip_grad_norm(*optimizer, 1.0);                   // optional; unscales first
//     mp->step(*optimizer);                                  // steps, or skips on inf/NaN
//     if (!mp->step_was_skipped()) scheduler.step();         // as Accelerate: a skipped step is no step
//   }
//
// configure() may convert the model (fp16_naive: the whole model in float16), wrap it (a Module whose
// forward opens an AutocastGuard), wrap the criterion likewise, and replace the optimizer (one that
// keeps float32 master weights). Always use what it returns. The optimizer passed in must have been
// built over the model's parameters while they were float32; configure() reads its type, groups and
// options, so a strategy that needs master weights can rebuild it over them.
//
// Skipping: a strategy that scales the loss checks every gradient for inf/NaN in the same pass that
// unscales them (fused_unscale_and_check). A step with a non-finite gradient leaves parameters and
// optimizer state untouched and lowers the scale. A scale that would have to fall below the
// strategy's floor throws TrainingError: gradients that overflow at the smallest allowed scale mean
// the run has diverged, and training on would only produce garbage.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "booster/autocast/autocast.h"
#include "booster/config/option_reader.h"
#include "booster/nn/kv_cache.h"
#include "booster/nn/loss.h"
#include "booster/nn/module.h"
#include "booster/optim/optimizer.h"
#include "booster/tensor/tensor.h"

namespace booster::mixed_precision {

using nn::Criterion;

// What one step did, for logging and for the loop.
struct StepStats {
  double loss_scale = 1.0;                                       // the scale the backward used
  bool skipped = false;                                          // inf/NaN found: no update
  double grad_norm = std::numeric_limits<double>::quiet_NaN();  // L2 of the unscaled gradients, when
                                                                 // clip_grad_norm computed it
  int64_t num_zeros = -1;                                        // zero gradient elements, when counted
};

// Checkpointable strategy state: json (scaler counters) plus tensors (master weights).
struct MixedPrecisionState {
  nlohmann::json meta = nlohmann::json::object();
  std::map<std::string, Tensor> tensors;
};

struct Configured {
  nn::ModulePtr model;
  std::shared_ptr<optim::Optimizer> optimizer;
  Criterion criterion;
};

class MixedPrecision {
 public:
  virtual ~MixedPrecision() = default;

  // The registered name ("fp16", ...) and every option with the value in use.
  virtual std::string name() const = 0;
  virtual nlohmann::json options() const = 0;

  // Converts/wraps model, optimizer and criterion (see Note [The mixed-precision step]). Call once.
  virtual Configured configure(nn::ModulePtr model, std::shared_ptr<optim::Optimizer> optimizer,
                               Criterion criterion) = 0;

  // Backward of the loss, scaled by loss_scale(). `optimizer` is the one configure() returned.
  virtual void backward(const Tensor& loss, optim::Optimizer& optimizer);
  // Divides the gradients by the loss scale (at most once per step; later calls in the same step are
  // no-ops, unlike GradScaler::unscale_, which the loop need not know about).
  virtual void unscale_gradients(optim::Optimizer& optimizer);
  // Unscales, then scales every gradient down so that their joint L2 norm is at most max_norm
  // (torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6) when below 1). Returns the
  // norm before clipping (inf when a gradient is not finite; nothing is clipped then).
  virtual double clip_grad_norm(optim::Optimizer& optimizer, double max_norm);
  // Steps the optimizer unless a gradient is inf/NaN, then updates the loss scale.
  virtual void step(optim::Optimizer& optimizer);

  // Whether the last step() skipped the update; an LR scheduler must not advance then.
  bool step_was_skipped() const { return stats_.skipped; }
  const StepStats& last_step_stats() const { return stats_; }
  // The scale the next backward() multiplies the loss by (1 for unscaled strategies).
  virtual double loss_scale() const { return 1.0; }

  virtual MixedPrecisionState state_dict() const { return {}; }
  virtual void load_state_dict(const MixedPrecisionState& state) {}

  // Note [Agreeing on found_inf]
  // Under data parallelism every rank must skip the same steps, or their weights part ways. A plugin
  // installs a reducer (an all-reduce of the flag with Max over its process group) and strategies that
  // check gradients pass their local verdict through agree_on_found_inf() right after the fused
  // unscale-and-check pass. Every rank calls it exactly once per check, so it may be a collective.
  // Without a reducer the local verdict stands. PrecisionStrategy (precision_strategy.h) makes this call
  // for every strategy built on it, so a recipe cannot forget it.
  using FoundInfReducer = std::function<bool(bool local_found_inf)>;
  virtual void set_found_inf_reducer(FoundInfReducer reducer) { found_inf_reducer_ = std::move(reducer); }
  // Note [Agreeing on amax]
  // fp8 scaling under data parallelism: the same plugin installs a reducer that replaces each value by
  // its maximum over the ranks (in place), and the fp8 strategy passes every scale's amax of the step
  // through it once per step, so all ranks keep one set of scales (Transformer Engine reduces amax over
  // the data-parallel group the same way) and a checkpoint's scales are every rank's.
  using AmaxReducer = std::function<void(std::vector<float>& values)>;
  virtual void set_amax_reducer(AmaxReducer reducer) { amax_reducer_ = std::move(reducer); }

 protected:
  bool agree_on_found_inf(bool local_found_inf) const {
    return found_inf_reducer_ ? found_inf_reducer_(local_found_inf) : local_found_inf;
  }
  FoundInfReducer found_inf_reducer_;
  void agree_on_amax(std::vector<float>& values) const {
    if (amax_reducer_) amax_reducer_(values);
  }
  AmaxReducer amax_reducer_;

  // Per-step bookkeeping shared by the strategies: unscaled/clipped already this step?
  StepStats stats_;
  bool unscaled_this_step_ = false;
  double pending_grad_norm_ = std::numeric_limits<double>::quiet_NaN();
};

// A strategy that forwards every call to `inner`: the base of wrappers that hook the step (a data
// parallel plugin waits for its gradient all-reduce before the inner strategy unscales and steps; see
// Note [Who drives the step] in booster/plugin/parallel_plugin.h). Override what you hook and call the base.
class PrecisionDecorator : public MixedPrecision {
 public:
  explicit PrecisionDecorator(std::shared_ptr<MixedPrecision> inner);

  std::string name() const override { return inner_->name(); }
  nlohmann::json options() const override { return inner_->options(); }
  Configured configure(nn::ModulePtr model, std::shared_ptr<optim::Optimizer> optimizer,
                       Criterion criterion) override;
  void backward(const Tensor& loss, optim::Optimizer& optimizer) override { inner_->backward(loss, optimizer); }
  void unscale_gradients(optim::Optimizer& optimizer) override { inner_->unscale_gradients(optimizer); }
  double clip_grad_norm(optim::Optimizer& optimizer, double max_norm) override {
    return inner_->clip_grad_norm(optimizer, max_norm);
  }
  // Steps through the inner strategy and takes over its statistics (step_was_skipped() reads them).
  void step(optim::Optimizer& optimizer) override;
  double loss_scale() const override { return inner_->loss_scale(); }
  MixedPrecisionState state_dict() const override { return inner_->state_dict(); }
  void load_state_dict(const MixedPrecisionState& state) override { inner_->load_state_dict(state); }
  void set_found_inf_reducer(FoundInfReducer reducer) override { inner_->set_found_inf_reducer(std::move(reducer)); }
  void set_amax_reducer(AmaxReducer reducer) override { inner_->set_amax_reducer(std::move(reducer)); }

  const std::shared_ptr<MixedPrecision>& inner() const { return inner_; }

 protected:
  std::shared_ptr<MixedPrecision> inner_;
};

// ------------------------------------------------------------------------------------------ registry
using Factory = std::function<std::unique_ptr<MixedPrecision>(const nlohmann::json& options)>;

// Registers a strategy under `name` (ValueError when taken). Strategies in mixed_precision/ register
// themselves when the core library loads.
void register_strategy(const std::string& name, Factory factory);
// Registered names, sorted (aliases included).
std::vector<std::string> registered_strategies();
// Builds a strategy. A name that is not built in is looked up as a precision plugin
// (libbooster_precision_<name>.so on the plugin search path, or a path to a .so; see
// booster/plugin/loader.h), whose strategy stays bound to its library (Note [Plugin lifetime]).
// ConfigError listing the built-in names and the directories searched when neither has it;
// PluginError for a file that is not a plugin or has another ABI version; and from the strategy,
// ConfigError for unknown option names and out-of-range values.
std::unique_ptr<MixedPrecision> create(const std::string& name,
                                       const nlohmann::json& options = nlohmann::json::object());

// One strategy create() can build: built in (file empty) or a precision plugin found on the plugin
// search path (its file; found by file name, not loaded).
struct StrategyInfo {
  std::string name;
  std::string file;
};
// Built-in strategies, then the precision plugins on the search path whose names no built-in takes;
// each sorted by name.
std::vector<StrategyInfo> available_strategies();
// The strategy of a precision plugin (name or path), wrapped so every call goes through the plugin
// boundary (exceptions become host errors) and the library stays loaded while the strategy or anything
// its configure() returned lives. create() calls this for names that are not built in.
std::unique_ptr<MixedPrecision> create_from_plugin(const std::string& name_or_path, const nlohmann::json& options);

// Registers a factory from a static initializer: static Registrar r("fp16", make_fp16);
struct Registrar {
  Registrar(const std::string& name, Factory factory) { register_strategy(name, std::move(factory)); }
};

// The options reader of a strategy: config::OptionReader (the one parallel plugins use too), with
// messages that start "mixed precision '<strategy>': ".
class OptionReader : public config::OptionReader {
 public:
  OptionReader(std::string strategy, const nlohmann::json& options)
      : config::OptionReader("mixed precision", std::move(strategy), options) {}
  const std::string& strategy() const { return name(); }
};

// ----------------------------------------------------------------------------------- building blocks

// A module whose forward runs `inner` under autocast to `dtype`. It adopts the inner module's
// parameters, buffers and children under their own names, so state_dict keys do not change.
// With cast_io, floating inputs are cast to `input_dtype` and outputs to float32 first (for models
// held entirely in 16 bits: the loss is then computed and scaled in float32).
// Around a decoder (nn::CausalLM) it is one too: generation's cached forward runs under the same
// autocast and casts as forward (causal_lm() is null when the inner module cannot generate).
class PrecisionModule : public nn::Module, public nn::CausalLM {
 public:
  struct Options {
    bool autocast = false;
    DType autocast_dtype = DType::Float16;
    std::shared_ptr<const autocast::PolicyTable> table;  // null: default table
    std::shared_ptr<autocast::LinearOverride> linear_override;  // null: none (autocast only)
    bool cast_io = false;
    DType input_dtype = DType::Float32;
  };
  PrecisionModule(nn::ModulePtr inner, Options options);
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return inner_->name(); }
  const nn::ModulePtr& inner() const { return inner_; }

  nn::CausalLM* causal_lm() override { return inner_->causal_lm() ? this : nullptr; }
  Tensor forward_cached(const Tensor& idx, nn::KVCache& cache) override;
  nn::KVCache make_kv_cache(int64_t capacity) const override;
  int64_t max_positions() const override;
  int64_t vocab_size() const override;
  bool has_kv_cache() const override;

 private:
  nn::CausalLM& inner_lm() const;
  // forward's body: the input cast, `run` under autocast, the output cast.
  Tensor run_wrapped(const Tensor& x, const std::function<Tensor(const Tensor&)>& run);
  nn::ModulePtr inner_;
  Options options_;
};

// The criterion run under autocast to `dtype` (losses are float32 ops in the policy table); an empty
// criterion stays empty.
Criterion autocast_criterion(Criterion criterion, DType dtype,
                             std::shared_ptr<const autocast::PolicyTable> table = nullptr);

// The torch-style configuration shared by the autocast strategies (fp16, bf16, plugins): the model's
// forward and the criterion run under autocast to `dtype`; parameters and optimizer stay as they are.
Configured configure_autocast(nn::ModulePtr model, std::shared_ptr<optim::Optimizer> optimizer, Criterion criterion,
                              DType dtype);

// loss * scale, computed in float32 when the loss is float16/bfloat16 (as torch's GradScaler.scale,
// whose float32 scale tensor promotes the product): a 16-bit loss times 2^16 would overflow.
Tensor scale_loss(const Tensor& loss, double scale);

// Gradient buffers of an optimizer: one 1-D tensor per flat buffer of every group, after bringing
// every gradient into them (a gradient that backward created outside the buffer, after a module's
// zero_grad set it to None, is copied in; see Note [Flat buffers]), so an in-place pass sees them all.
std::vector<Tensor> flat_grads(optim::Optimizer& optimizer);

// Note [Fused gradient passes]
// Unscaling and the inf/NaN check read every gradient once, together: dst = src * inv_scale for each
// span, and found_inf is set when any *source* element is inf or NaN (as torch's
// _amp_foreach_non_finite_check_and_unscale_). src is float32, float16 or bfloat16; dst is float32 or
// src itself. The inner loops are branch-free (the check ORs exponent bits) so they vectorize, and
// spans longer than cpu::kParallelGrain are split across threads.
struct GradSpan {
  Tensor src;  // 1-D contiguous
  Tensor dst;  // same numel; float32, or src itself (in place)
};
bool fused_unscale_and_check(const std::vector<GradSpan>& spans, float inv_scale);
// L2 norm of all elements of all tensors (accumulated in double across chunks).
double grad_norm_l2(const std::vector<Tensor>& grads);
// grads *= factor, in place.
void scale_grads(const std::vector<Tensor>& grads, float factor);
// torch.nn.utils.clip_grad_norm_: scales grads by max_norm / (norm + 1e-6) when that is below 1 and the
// norm is finite; returns the L2 norm before clipping.
double clip_grads(const std::vector<Tensor>& grads, double max_norm);
// Number of elements equal to zero.
int64_t count_zeros(const std::vector<Tensor>& grads);

}  // namespace booster::mixed_precision
