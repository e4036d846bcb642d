// The tracer behind the precision doctor and the naming of skipped steps' causes (tracer.h).
#include "booster/diagnostics/tracer.h"

#include <algorithm>
#include <limits>
#include <unordered_map>

#include "booster/autograd/autograd.h"
#include "booster/common/error_context.h"
#include "booster/kernels/fused.h"
#include "booster/ops/ops.h"

namespace booster::diagnostics {

const char* role_name(Role role) {
  switch (role) {
    case Role::Output: return "output";
    case Role::OutputGradient: return "output gradient";
    case Role::InputGradient: return "input gradient";
    case Role::ParameterGradient: return "parameter gradient";
  }
  return "?";
}

const char* role_key(Role role) {
  switch (role) {
    case Role::Output: return "output";
    case Role::OutputGradient: return "output_grad";
    case Role::InputGradient: return "input_grad";
    case Role::ParameterGradient: return "param_grad";
  }
  return "?";
}

bool ModuleStats::empty() const {
  return std::all_of(roles.begin(), roles.end(), [](const TensorStats& s) { return s.empty(); });
}

void ModuleStats::merge(const ModuleStats& other) {
  for (size_t r = 0; r < roles.size(); ++r) roles[r].merge(other.roles[r]);
  input_max_abs = std::max(input_max_abs, other.input_max_abs);
  parameter_max_abs = std::max(parameter_max_abs, other.parameter_max_abs);
}

nlohmann::json ModuleStats::to_json() const {
  nlohmann::json out = {{"module", path}, {"type", type}, {"input_max_abs", input_max_abs}};
  if (parameter_max_abs > 0.0f) out["parameter_max_abs"] = parameter_max_abs;
  for (Role role : kRoles)
    if (!(*this)[role].empty()) out[role_key(role)] = (*this)[role].to_json();
  return out;
}

std::string NonFinite::describe() const {
  std::string what = std::string("the ") + role_name(tensor);
  if (!parameter.empty()) what += " " + parameter;
  return what + " of " + (module.empty() ? std::string("the model") : module) + " (" + type + ") in " +
         (backward ? "backward" : "forward");
}

nlohmann::json NonFinite::to_json() const {
  nlohmann::json out = {{"module", module},
                        {"type", type},
                        {"pass", backward ? "backward" : "forward"},
                        {"tensor", role_key(tensor)}};
  if (!parameter.empty()) out["parameter"] = parameter;
  return out;
}

namespace {
constexpr double kNever = std::numeric_limits<double>::infinity();
}  // namespace

struct Tracer::State final : nn::ModuleCallObserver {
  struct Traced {
    const nn::Module* module;
    bool leaf;  // no children
  };
  // A traced tensor of the current step, and where its finiteness is: a slot of `flags` (filled on the
  // tensor's device, read only when asked) or known on the host.
  struct Event {
    int module;
    Role role;
    int64_t slot = -1;
    bool bad = false;  // when slot < 0
  };

  std::vector<Traced> traced;
  std::unordered_map<const nn::Module*, int> index;
  std::vector<ModuleStats> stats;
  int64_t statistics_steps = 0;

  // The current step (Note [The first non-finite tensor]).
  bool statistics = false;
  std::vector<Event> forward_events, backward_events;
  Tensor flags;  // int32 per slot, on the device of the step's first checked tensor
  int64_t slots_used = 0;
  struct CheckedKey {
    const void* data;
    int64_t numel;
    DType dtype;
    uint64_t version;  // a tensor changed in place since is checked again
    bool operator==(const CheckedKey&) const = default;
  };
  struct CheckedHash {
    size_t operator()(const CheckedKey& k) const {
      return std::hash<const void*>()(k.data) ^ (size_t(k.numel) * 0x9e3779b97f4a7c15ull) ^ size_t(k.dtype) ^
             (size_t(k.version) << 17);
    }
  };
  struct Checked {
    std::weak_ptr<Storage> storage;
    int64_t slot = -1;
  };
  std::unordered_map<CheckedKey, Checked, CheckedHash> checked;  // this step's checked tensors

  NonFinite describe(int m, bool backward, Role role) const {
    return NonFinite{stats[size_t(m)].path, stats[size_t(m)].type, backward, role, {}};
  }

  // Records `t` as an event: on a statistics step its statistics say whether it is finite; else one
  // fused check ORs "has inf/NaN" into a flag on its device without waiting for it (no host sync per
  // tensor on a GPU).
  void record(std::vector<Event>& events, int m, Role role, const Tensor& t) {
    Event e{m, role};
    if (statistics) {
      TensorStats s = tensor_stats(t);
      e.bad = s.nonfinite > 0;
      stats[size_t(m)].roles[size_t(role)].merge(s);
    } else if (const DType d = t.dtype(); (d == DType::Float32 || d == DType::Float16 || d == DType::BFloat16) &&
                                          t.numel() > 0 && (!flags.defined() || flags.device() == t.device())) {
      // A container returns its last child's output, and a module's input gradient is the previous
      // module's output gradient: the same values, checked once. The storage must be the same one still
      // alive (freed memory may hold another tensor by now).
      Checked& seen = checked[CheckedKey{t.data_ptr(), t.numel(), d, t.version()}];
      const bool fresh = seen.storage.lock() != t.storage();
      if (fresh) seen = {t.storage(), slots_used};
      e.slot = seen.slot;
      if (fresh) {
        take_slot(t.device());
        const Tensor values = t.detach().contiguous().reshape({-1});
        Tensor flag = flags.narrow(0, e.slot, 1);
        kernels::unscale_check_kernel(t.device())(values, values, 1.0f, flag);
      }
    } else {
      e.bad = !all_finite(t);
    }
    events.push_back(e);
  }

  int64_t take_slot(Device device) {
    if (!flags.defined()) flags = zeros({1024}, DType::Int32, device);
    if (slots_used == flags.numel()) {
      Tensor grown = zeros({2 * flags.numel()}, DType::Int32, device);
      grown.narrow(0, 0, flags.numel()).copy_(flags);
      flags = grown;
    }
    return slots_used++;
  }

  Tensor call(nn::Module& module, const Tensor& input) override {
    const auto it = index.find(&module);
    if (it == index.end()) return module.forward(input);
    const int m = it->second;
    // A module run again inside a backward (activation checkpointing) is not a new forward.
    const bool recomputing = innermost_error_context(ErrorContextFrame::Kind::Backward) != nullptr;
    const bool floating_input = input.defined() && is_floating(input.dtype());
    Tensor x = input;
    if (floating_input && x.requires_grad()) x = watch_gradient(x, m, Role::InputGradient);
    Tensor out = module.forward(x);
    if (!out.defined() || !is_floating(out.dtype())) return out;
    if (!recomputing) {
      if (statistics && floating_input) {
        ModuleStats& s = stats[size_t(m)];
        s.input_max_abs = std::max(s.input_max_abs, max_abs(input));
      }
      record(forward_events, m, Role::Output, out);
    }
    if (out.requires_grad()) out = watch_gradient(out, m, Role::OutputGradient);
    return out;
  }

  // An identity whose backward shows the gradient to record().
  Tensor watch_gradient(const Tensor& t, int m, Role role) {
    Tensor watched = t.detach();
    std::weak_ptr<State> self = weak_self;
    autograd::record(watched, "TraceBackward", {t}, [self, m, role](const Tensor& g) {
      if (const std::shared_ptr<State> state = self.lock())
        if (g.defined() && is_floating(g.dtype())) state->record(state->backward_events, m, role, g);
      return autograd::grads{g};
    });
    return watched;
  }

  // Where a non-finite parameter gradient of module m stands among backward_events (Note [The first
  // non-finite tensor]).
  double parameter_position(int m) const {
    double output_gradient = -1.0;
    for (size_t i = 0; i < backward_events.size(); ++i) {
      if (backward_events[i].module != m) continue;
      if (backward_events[i].role == Role::InputGradient) return double(i) - 0.5;
      if (backward_events[i].role == Role::OutputGradient && output_gradient < 0) output_gradient = double(i);
    }
    if (output_gradient >= 0 && traced[size_t(m)].leaf) return output_gradient + 0.5;
    return kNever;
  }

  std::weak_ptr<State> weak_self;
};

Tracer::Tracer(const nn::Module& root) : state_(std::make_shared<State>()) {
  state_->weak_self = state_;
  for (const auto& [path, module] : root.named_modules()) {
    state_->index.emplace(module, int(state_->traced.size()));
    state_->traced.push_back({module, module->named_children().empty()});
    ModuleStats s;
    s.path = path;
    s.type = module->name();
    state_->stats.push_back(std::move(s));
  }
}

Tracer::~Tracer() = default;

void Tracer::begin_step(bool statistics) {
  State& s = *state_;
  s.statistics = statistics;
  s.forward_events.clear();
  s.backward_events.clear();
  if (s.slots_used > 0) s.flags.zero_();
  s.slots_used = 0;
  s.checked.clear();
  if (statistics) ++s.statistics_steps;
}

std::unique_ptr<nn::ModuleCallObserverScope> Tracer::observe() {
  return std::make_unique<nn::ModuleCallObserverScope>(state_.get());
}

void Tracer::end_step() {
  State& s = *state_;
  if (!s.statistics) return;
  for (size_t m = 0; m < s.traced.size(); ++m) {
    ModuleStats& stats = s.stats[m];
    for (const auto& [name, p] : s.traced[m].module->named_parameters(/*recurse=*/false)) {
      if (!is_floating(p.dtype())) continue;
      // A parameter ZeRO-3 holds only while its module runs has no values now (Note [Released storage]);
      // a deferred one (not this rank's part) is not read, so that it stays unallocated.
      if (!p.storage()->released()) stats.parameter_max_abs = std::max(stats.parameter_max_abs, max_abs(p));
      if (const Tensor g = p.grad(); g.defined()) stats.roles[size_t(Role::ParameterGradient)].merge(tensor_stats(g));
    }
  }
}

std::optional<NonFinite> Tracer::first_nonfinite() const {
  const State& s = *state_;
  // One read of the step's flags.
  std::vector<int32_t> flags;
  if (s.slots_used > 0) flags = s.flags.narrow(0, 0, s.slots_used).cpu().to_vector<int32_t>();
  auto bad = [&](const State::Event& e) { return e.slot >= 0 ? flags[size_t(e.slot)] != 0 : e.bad; };
  for (const State::Event& e : s.forward_events)
    if (bad(e)) return s.describe(e.module, false, e.role);

  std::optional<NonFinite> first;
  double first_position = kNever;
  bool found = false;
  for (size_t i = 0; i < s.backward_events.size(); ++i)
    if (bad(s.backward_events[i])) {
      first = s.describe(s.backward_events[i].module, true, s.backward_events[i].role);
      first_position = double(i);
      found = true;
      break;
    }
  for (size_t m = 0; m < s.traced.size(); ++m) {
    for (const auto& [name, p] : s.traced[m].module->named_parameters(/*recurse=*/false)) {
      const Tensor g = p.grad();
      if (!g.defined() || !is_floating(g.dtype()) || all_finite(g)) continue;
      const double position = s.parameter_position(int(m));
      // A tie (two modules after every gradient) goes to the first in module order.
      if (!found || position < first_position) {
        first = s.describe(int(m), true, Role::ParameterGradient);
        const std::string& path = s.stats[m].path;
        first->parameter = path.empty() ? name : path + "." + name;
        first_position = position;
        found = true;
      }
      break;  // the module's first non-finite parameter names it
    }
  }
  return first;
}

const std::vector<ModuleStats>& Tracer::modules() const { return state_->stats; }

int64_t Tracer::statistics_steps() const { return state_->statistics_steps; }

void Tracer::reset_statistics() {
  State& s = *state_;
  s.statistics_steps = 0;
  for (ModuleStats& m : s.stats) {
    m.roles = {};
    m.input_max_abs = 0.0f;
    m.parameter_max_abs = 0.0f;
  }
}

nlohmann::json Tracer::statistics_json() const {
  nlohmann::json modules = nlohmann::json::array();
  for (const ModuleStats& m : state_->stats)
    if (!m.empty()) modules.push_back(m.to_json());
  return {{"steps", state_->statistics_steps}, {"modules", modules}};
}

}  // namespace booster::diagnostics
