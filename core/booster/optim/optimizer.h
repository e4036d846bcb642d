// Optimizers with PyTorch 1.13's update rules (SGD, Adam, AdamW), stepping flat parameter buffers.
//
// Parameters are bound into FlatBuffers (see Note [Flat buffers]) when they join a param group: one
// buffer per (group, dtype). Optimizer state (momentum buffers, exp_avg, ...) is flat too, so step()
// is one fused, vectorized, multi-threaded loop per run of parameters, with no temporaries.
//
// Options are JSON, as torch's param-group dicts: {"lr": 1e-3, "betas": [0.9, 0.999], ...}. Unknown
// keys are ConfigErrors naming the valid ones; values out of range are ValueErrors with torch's
// messages ("Invalid learning rate: -1").
//
// Precision: float32 and float64 parameters are updated in their own precision, with state of the
// same dtype. float16/bfloat16 parameters are updated in float32 (state kept in float32) and the result
// rounded to the parameter's dtype; mixed-precision strategies keep float32 masters instead.
#pragma once

#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "booster/optim/flat_buffer.h"
#include "booster/tensor/tensor.h"

namespace booster::optim {

struct ParamGroup {
  std::vector<Tensor> params;
  nlohmann::json options = nlohmann::json::object();  // "lr", "weight_decay", ...; missing keys take defaults
};

// Checkpointable optimizer state, laid out as torch's state_dict():
//   meta = {"type": "AdamW",
//           "state": {"<i>": {"step": n}, ...},                 // i = global parameter index
//           "param_groups": [{"lr": .., ..., "params": [0, 1, ..]}, ...]}
//   tensors = {"state.<i>.exp_avg": ..., "state.<i>.exp_avg_sq": ..., "state.<i>.momentum_buffer": ...}
// Global parameter indices count through the groups in order, as torch does. The tensors are views of
// the live state (as torch's state_dict holds references): clone them to keep a snapshot.
// The state name of a parameter's float32 master weight where the optimizer keeps it (ZeRO).
inline constexpr const char* kMasterWeight = "master_weight";
// "state.<i>.<name>" (an OptimizerState tensor key) -> i and name; false for any other key.
bool parse_state_key(const std::string& key, size_t& index, std::string& name);

struct OptimizerState {
  nlohmann::json meta;
  std::map<std::string, Tensor> tensors;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One update of every parameter that received a gradient since the last zero_grad.
  virtual void step() = 0;
  virtual std::string name() const = 0;  // "SGD", "Adam", "AdamW"

  // Zeroes every gradient (one memset per flat buffer). A flat-bound gradient cannot be set to None;
  // parameters that then receive no gradient are skipped by step() all the same (Note [Flat buffers]).
  // Virtual so an optimizer that keeps gradients elsewhere (a ZeRO shard) clears those too.
  virtual void zero_grad(bool set_to_none = true);

  // Options may be edited in place (schedulers do); params may not (use add_param_group).
  std::vector<ParamGroup>& param_groups() { return groups_; }
  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  // Completes the group's options from the defaults, validates them and binds its parameters.
  void add_param_group(ParamGroup group);
  const nlohmann::json& defaults() const { return defaults_; }

  double lr(size_t group = 0) const;
  void set_lr(double lr);  // every group

  virtual OptimizerState state_dict() const;
  // Validates group count, parameter counts and state shapes (CheckpointError naming the mismatch),
  // then restores state and every group's options.
  virtual void load_state_dict(const OptimizerState& state);
  // True when state_dict() carries float32 master weights as "state.<i>.master_weight" (kMasterWeight)
  // and load_state_dict() takes them from there (a ZeRO optimizer over 16-bit parameters). A resume
  // under another precision hands them over that way (Note [Resuming under another precision]).
  virtual bool state_holds_master_weights() const { return false; }

  // Number of steps that updated the parameter with this global index.
  int64_t param_step(size_t global_index) const { return steps_.at(global_index); }
  size_t num_params() const { return steps_.size(); }
  // The flat buffers of one group (one per dtype among its parameters).
  std::vector<const FlatBuffer*> flat_buffers(size_t group) const;
  // Frees the flat buffers and the state, keeping the groups and their options. For an optimizer
  // whose parameters another optimizer now steps (a strategy or plugin rebuilt it over converted or
  // sharded parameters, and rebound them): its options still drive that one (schedulers edit them),
  // but its copies of the values and its gradient buffer would otherwise stay allocated. Afterwards
  // step() and zero_grad() do nothing.
  void release_buffers();
  // Binds the parameters again after they moved to another device (module.to(device) after the
  // optimizer was made, as Booster::boost does): flat buffers on their new device, state moved along.
  // PyTorch's optimizers keep working across model.to(); this is what makes ours do the same.
  void rebind();

 protected:
  // `defaults` lists every option with its default; a null value marks a required option.
  Optimizer(std::string type, nlohmann::json defaults);

  // Range checks of one complete option set; throws ValueError as torch does.
  virtual void check_options(const nlohmann::json& options) const = 0;
  // Names of the per-parameter state tensors these options need ("exp_avg", ...).
  virtual std::vector<std::string> state_names(const nlohmann::json& options) const = 0;

  // Parameters of one group that share a dtype, bound into one flat buffer, with flat state.
  struct Segment {
    FlatBuffer flat;
    std::vector<size_t> index;             // global parameter index of each parameter
    std::map<std::string, Tensor> state;   // 1-D, flat.numel() elements; acc dtype (float32 for 16-bit)
    std::vector<Tensor> unbound;           // deferred parameters, bound on first use (Note [Deferred binding])
  };
  // Binds the segments whose parameters were deferred when added (Note [Deferred binding]).
  void bind_deferred() const;

  // A run of adjacent parameters that all received a gradient and have taken the same number of steps
  // (this one included): [begin, end) in elements of the segment's flat buffer.
  struct Run {
    int64_t begin, end;
    int64_t step;
    size_t first_param, end_param;  // the parameters, as indices into the segment
  };
  // Runs also break where this key changes (SGD: whether a momentum buffer exists yet).
  virtual int64_t run_key(size_t /*global_index*/) const { return 0; }

  // The state buffer `name` of a segment, allocated zeroed on first use.
  Tensor& state_buffer(Segment& seg, const std::string& name);
  // Calls update(segment, run) for every run in `group`, after syncing gradients and counting the
  // step of every parameter that got one; bumps the version of every updated parameter.
  template <class F>
  void for_each_run(size_t group, F&& update);

  // Options of a group read as typed values (the JSON was validated when the group was added).
  static double num(const nlohmann::json& o, const char* key) { return o.at(key).get<double>(); }
  static bool flag(const nlohmann::json& o, const char* key) { return o.at(key).get<bool>(); }

  // Validates a complete option set, throwing ConfigError for unknown keys and wrong types.
  nlohmann::json complete_options(const nlohmann::json& options) const;
  void add_groups(std::vector<ParamGroup> groups);

  std::string type_;
  nlohmann::json defaults_;
  std::vector<ParamGroup> groups_;
  std::vector<std::vector<Segment>> segments_;  // per group
  std::vector<int64_t> steps_;                  // per global parameter index
  bool has_unbound_ = false;
};

template <class F>
void Optimizer::for_each_run(size_t group, F&& update) {
  bind_deferred();
  BOOSTER_CHECK(groups_.size() == segments_.size(), StateError, type_, ".step: param_groups() has ", groups_.size(),
                " groups but ", segments_.size(), " were added; add groups with add_param_group()");
  for (Segment& seg : segments_[group]) {
    seg.flat.check_bound(type_.c_str());
    const std::vector<char> arrived = seg.flat.sync_grads();
    const size_t n = seg.index.size();
    for (size_t i = 0; i < n; ++i)
      if (arrived[i]) ++steps_[seg.index[i]];
    for (size_t i = 0; i < n;) {
      if (!arrived[i]) {
        ++i;
        continue;
      }
      size_t j = i + 1;
      const int64_t step = steps_[seg.index[i]], key = run_key(seg.index[i]);
      while (j < n && arrived[j] && steps_[seg.index[j]] == step && run_key(seg.index[j]) == key) ++j;
      update(seg, Run{seg.flat.offset(i), seg.flat.offset(j), step, i, j});
      for (size_t k = i; k < j; ++k) seg.flat.params()[k].bump_version();
      i = j;
    }
  }
}

// ------------------------------------------------------------------------------------------------ SGD
// torch.optim.SGD (1.13): d = g + wd * p; with momentum, buf = d on the first step that uses it, else
// buf = momentum * buf + (1 - dampening) * d, and d = nesterov ? d + momentum * buf : buf; p -= lr * d.
struct SGDOptions {
  double lr = std::numeric_limits<double>::quiet_NaN();  // required, as in torch
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  nlohmann::json to_json() const;
};

class SGD : public Optimizer {
 public:
  SGD(std::vector<Tensor> params, const SGDOptions& options);
  SGD(std::vector<Tensor> params, const nlohmann::json& options);
  SGD(std::vector<ParamGroup> groups, const nlohmann::json& defaults);
  void step() override;
  std::string name() const override { return "SGD"; }
  void load_state_dict(const OptimizerState& state) override;

 protected:
  void check_options(const nlohmann::json& o) const override;
  std::vector<std::string> state_names(const nlohmann::json& o) const override;
  int64_t run_key(size_t global_index) const override { return has_buffer_[global_index]; }

 private:
  // Per global parameter: has its momentum buffer been made? torch makes it (a copy of the update
  // direction) on the first step that uses momentum, which need not be the parameter's first step.
  std::vector<char> has_buffer_;
};

// ------------------------------------------------------------------------------------------------ Adam
// torch.optim.Adam (1.13), per parameter with its own step count t:
//   g += wd * p (L2, Adam only) | p *= 1 - lr * wd (decoupled, AdamW)
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  vmax = max(vmax, v) with amsgrad
//   p -= lr / (1 - b1^t) * m / (sqrt(v or vmax) / sqrt(1 - b2^t) + eps)
struct AdamOptions {
  double lr = 1e-3;
  std::array<double, 2> betas{0.9, 0.999};
  double eps = 1e-8;
  // NaN means the optimizer's own default, as in torch: 0 for Adam, 1e-2 for AdamW.
  double weight_decay = std::numeric_limits<double>::quiet_NaN();
  bool amsgrad = false;
  nlohmann::json to_json() const;
};

class Adam : public Optimizer {
 public:
  Adam(std::vector<Tensor> params, const AdamOptions& options = {});
  Adam(std::vector<Tensor> params, const nlohmann::json& options);
  Adam(std::vector<ParamGroup> groups, const nlohmann::json& defaults);
  void step() override;
  std::string name() const override { return decoupled_ ? "AdamW" : "Adam"; }

 protected:
  Adam(std::string type, bool decoupled, double default_weight_decay);
  void check_options(const nlohmann::json& o) const override;
  std::vector<std::string> state_names(const nlohmann::json& o) const override;

 private:
  bool decoupled_ = false;
};

class AdamW : public Adam {
 public:
  AdamW(std::vector<Tensor> params, const AdamOptions& options);
  AdamW(std::vector<Tensor> params, const nlohmann::json& options = nlohmann::json::object());
  AdamW(std::vector<ParamGroup> groups, const nlohmann::json& defaults);
};

// {"type": "sgd" | "adam" | "adamw", <options>}; unknown types or keys are ConfigErrors listing the
// valid ones.
std::unique_ptr<Optimizer> make_optimizer(const nlohmann::json& cfg, std::vector<Tensor> params);

}  // namespace booster::optim
