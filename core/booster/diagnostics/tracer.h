// The precision doctor's tracer: watches the calls of a model's modules (through Module::operator())
// and the gradients flowing back through them, to gather per-module range statistics
// (tensor_stats.h) and to name the first tensor of a step that became inf or NaN.
//
// Note [The first non-finite tensor]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A step's tensors are ordered as they were made: the forward outputs in the order the modules
// returned (a child before its parent), then the backward's gradients in the order autograd delivered
// them: the gradient of a module's output arrives before those of its parameters, which come before
// that of its input. Each traced tensor costs one fused finiteness check that sets a flag on its
// device (no host synchronization: the flags are read once, and only when asked, after a skipped
// step); parameter gradients are looked at only then too (before the next zero_grad), so a clean step
// pays one read of each module's output and gradients. A parameter gradient is placed just before its
// module's input gradient;
// for a module without one (the first layer, whose input needs none) just after its output
// gradient when it has no children, else after every gradient seen. Under data parallelism the
// gradients are averaged across ranks, so a rank may find its parameter gradients non-finite because
// another rank's activations overflowed: it names the parameter gradient, the other rank the cause.
// Modules recomputed under activation checkpointing add no forward statistics a second time. Under
// low_level_zero the gradients move into the optimizer's shards during backward, so the parameters'
// own gradients (what parameter gradients are read from) hold zeros: there the module input and
// output gradients are what to read.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/diagnostics/tensor_stats.h"
#include "booster/nn/module.h"

namespace booster::diagnostics {

// Which tensor of a module: its forward output, or a gradient flowing back through it.
enum class Role : uint8_t { Output, OutputGradient, InputGradient, ParameterGradient };
inline constexpr int kNumRoles = 4;
inline constexpr std::array<Role, kNumRoles> kRoles{Role::Output, Role::OutputGradient, Role::InputGradient,
                                                    Role::ParameterGradient};
// "output", "output gradient", "input gradient", "parameter gradient"
const char* role_name(Role role);
// The JSON keys: "output", "output_grad", "input_grad", "param_grad"
const char* role_key(Role role);

struct ModuleStats {
  std::string path;  // dotted below the traced root; "" is the root itself
  std::string type;  // the class name, as Module::name()
  std::array<TensorStats, kNumRoles> roles{};
  float input_max_abs = 0.0f;      // of the forward inputs (a suggested fp8 input scale)
  float parameter_max_abs = 0.0f;  // of its own parameters, on statistics steps

  const TensorStats& operator[](Role role) const { return roles[size_t(role)]; }
  bool empty() const;
  // Adds another's statistics of the same module (another step).
  void merge(const ModuleStats& other);
  // {"module", "type", "input_max_abs", "parameter_max_abs", "output": TensorStats::to_json(), ...};
  // roles without values are left out.
  nlohmann::json to_json() const;
};

// The first tensor of a step that held inf or NaN (Note [The first non-finite tensor]).
struct NonFinite {
  std::string module;  // dotted path; "" the root
  std::string type;
  bool backward = false;
  Role tensor = Role::Output;
  std::string parameter;  // for a parameter gradient: the parameter's dotted name

  // "the output of layers.2 (Linear) in forward", "the parameter gradient layers.0.weight of layers.0
  // (Linear) in backward"
  std::string describe() const;
  // {"module", "type", "pass": "forward"|"backward", "tensor": role_key, "parameter" (if any)}
  nlohmann::json to_json() const;
};

class Tracer {
 public:
  // Traces `root` and its descendants, named as root.named_modules() names them. `root` must outlive
  // the tracer; graphs recorded while it traced may outlive it (their nodes then do nothing).
  explicit Tracer(const nn::Module& root);
  ~Tracer();
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  // Starts a step: forgets the last step's tensors. With `statistics`, every traced tensor of the step
  // is added to the per-module statistics (read on the host); without, each costs a fused finiteness
  // check on its device.
  void begin_step(bool statistics);
  // Traces the module calls of this thread (forward, and the backward of what they record) while the
  // returned scope lives: one around each micro-batch's forward and backward.
  [[nodiscard]] std::unique_ptr<nn::ModuleCallObserverScope> observe();
  // After the step's last backward, before the optimizer step: on a statistics step, adds the
  // parameter gradients (as they are: scaled by the loss scale) and the parameters' magnitudes.
  void end_step();
  // The step's first non-finite tensor, or none. Reads the parameter gradients, so call it before they
  // are zeroed (after a skipped step they still hold what backward made).
  std::optional<NonFinite> first_nonfinite() const;

  // Statistics over the statistics steps since construction or reset_statistics(), one per module in
  // named_modules() order.
  const std::vector<ModuleStats>& modules() const;
  int64_t statistics_steps() const;
  void reset_statistics();
  // {"steps": statistics_steps(), "modules": [ModuleStats::to_json() of the modules with values]}
  nlohmann::json statistics_json() const;

 private:
  struct State;
  std::shared_ptr<State> state_;  // the graph's nodes hold it weakly
};

}  // namespace booster::diagnostics
