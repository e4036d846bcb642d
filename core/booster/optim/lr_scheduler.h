// Learning-rate schedulers with torch.optim.lr_scheduler's (1.13) semantics.
//
// A scheduler writes each param group's "lr" option. As in torch, construction records every group's
// "initial_lr" (when absent) and performs the initial step, so after construction last_epoch() == 0
// and the groups hold the schedule's first value; call step() once after each optimizer.step().
// StepLR and CosineAnnealingLR use torch's recursive ("chainable") formulas, reading the groups'
// current lr, so they reproduce torch's values exactly, including its floating-point drift.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "booster/optim/optimizer.h"

namespace booster::optim {

class LRScheduler {
 public:
  virtual ~LRScheduler() = default;
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;

  // Advances one epoch/iteration and writes the new lr into every param group.
  void step();
  const std::vector<double>& get_last_lr() const { return last_lr_; }
  int64_t last_epoch() const { return last_epoch_; }
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  virtual std::string name() const = 0;

  // {"type", "base_lrs", "last_epoch", "step_count", "last_lr", <hyperparameters>}
  nlohmann::json state_dict() const;
  // CheckpointError when the type or the number of groups differ; restores the counters and the
  // hyperparameters (the groups' lr comes back with the optimizer's own state).
  void load_state_dict(const nlohmann::json& state);

 protected:
  // last_epoch = -1 starts a schedule; another value resumes one and needs "initial_lr" in every group.
  LRScheduler(Optimizer& optimizer, int64_t last_epoch);
  // Derived constructors call this last (get_lr is virtual): torch's _initial_step().
  void initial_step() { step(); }
  // The lr of every group for the current last_epoch_.
  virtual std::vector<double> get_lr() const = 0;
  virtual nlohmann::json hyperparams() const = 0;
  virtual void load_hyperparams(const nlohmann::json& j) = 0;
  // The groups' current lr values.
  std::vector<double> group_lrs() const;

  Optimizer& optimizer_;
  std::vector<double> base_lrs_;
  std::vector<double> last_lr_;
  int64_t last_epoch_ = -1;
  int64_t step_count_ = 0;
};

// Multiplies the lr by gamma every step_size steps.
class StepLR : public LRScheduler {
 public:
  StepLR(Optimizer& optimizer, int64_t step_size, double gamma = 0.1, int64_t last_epoch = -1);
  std::string name() const override { return "StepLR"; }

 protected:
  std::vector<double> get_lr() const override;
  nlohmann::json hyperparams() const override;
  void load_hyperparams(const nlohmann::json& j) override;

 private:
  int64_t step_size_;
  double gamma_;
};

// Cosine annealing from the base lr to eta_min over T_max steps (then back up, periodically), with
// torch 1.13's recursive update:
//   lr_t = eta_min + (lr_{t-1} - eta_min) * (1 + cos(pi t / T_max)) / (1 + cos(pi (t - 1) / T_max))
// and its special cases at t = 0 and t = T_max + 1 (mod 2 T_max).
class CosineAnnealingLR : public LRScheduler {
 public:
  CosineAnnealingLR(Optimizer& optimizer, int64_t T_max, double eta_min = 0.0, int64_t last_epoch = -1);
  std::string name() const override { return "CosineAnnealingLR"; }

 protected:
  std::vector<double> get_lr() const override;
  nlohmann::json hyperparams() const override;
  void load_hyperparams(const nlohmann::json& j) override;

 private:
  int64_t T_max_;
  double eta_min_;
};

// Linear warmup, then a decay to a minimum (HF's get_{cosine,linear}_schedule_with_warmup as a
// LambdaLR, with a floor). With s = last_epoch(), W = warmup_steps, T = total_steps:
//   s <  W:  f = start_factor + (1 - start_factor) * s / W
//   s >= W:  p = min(1, (s - W) / max(1, T - W))
//            cosine:   f = m + (1 - m) * (1 + cos(pi p)) / 2
//            linear:   f = m + (1 - m) * (1 - p)
//            constant: f = 1
//   lr = base_lr * f,  m = min_lr_ratio, or min_lr / base_lr per group when min_lr is given.
// So the lr is base_lr * start_factor at construction (0 by default), reaches base_lr at s = W, and
// stays at the minimum from s = T on.
struct LinearWarmupOptions {
  int64_t warmup_steps = 0;
  int64_t total_steps = 0;
  std::string decay = "cosine";  // "cosine", "linear" or "constant"
  double min_lr_ratio = 0.0;     // minimum as a fraction of each group's base lr ...
  double min_lr = -1.0;          // ... or as a value (>= 0 selects it; not both)
  double start_factor = 0.0;     // warmup starts at base_lr * start_factor
};

class LinearWarmup : public LRScheduler {
 public:
  LinearWarmup(Optimizer& optimizer, const LinearWarmupOptions& options, int64_t last_epoch = -1);
  std::string name() const override { return "LinearWarmup"; }
  // The multiplier f of the formula above for step s and a minimum ratio m.
  double factor(int64_t s, double min_ratio) const;

 protected:
  std::vector<double> get_lr() const override;
  nlohmann::json hyperparams() const override;
  void load_hyperparams(const nlohmann::json& j) override;

 private:
  static void check(const LinearWarmupOptions& o);
  LinearWarmupOptions o_;
};

// {"type": "step", "step_size", "gamma"} | {"type": "cosine", "T_max", "eta_min"} |
// {"type": "linear_warmup", "warmup_steps", "total_steps", "decay", "min_lr_ratio" | "min_lr",
//  "start_factor"}; class names (StepLR, ...) are accepted as types. Unknown types or keys, missing
// required keys and wrong value types are ConfigErrors naming the valid ones.
std::unique_ptr<LRScheduler> make_scheduler(const nlohmann::json& cfg, Optimizer& optimizer);

}  // namespace booster::optim
