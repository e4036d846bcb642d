// Module: the base of every layer and model, with PyTorch's torch.nn.Module semantics.
//
// A module owns named parameters (leaf tensors that require grad), named buffers (state that is saved
// but not trained, e.g. BatchNorm's running statistics) and named child modules, each kept in
// registration order. Names are dotted from the root, as in PyTorch: "blocks.0.attn.c_attn.weight".
//
// Note [Module tensors keep their handles]
// Layers hold their parameters as Tensor members (Linear::weight) and the module keeps a second
// handle to the same TensorImpl in its registry. Everything that changes a parameter in place
// (to(dtype), to(device), load_state_dict) therefore mutates the TensorImpl (its storage, dtype,
// strides) instead of installing a new Tensor, so that every handle ever handed out, the layer's
// member, named_parameters()' result and an optimizer's parameter list, keeps seeing the current
// values. Converting dtype or device allocates new storage: an optimizer that captured raw pointers or
// views of the old storage (flat buffers) must be created after to(), as in PyTorch.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "booster/common/error_context.h"
#include "booster/tensor/random.h"
#include "booster/tensor/tensor.h"

namespace booster::nn {

using StateDict = std::map<std::string, Tensor>;

class Module;
class CausalLM;  // kv_cache.h
using ModulePtr = std::shared_ptr<Module>;

// Watches the module calls of one thread (the precision doctor's tracer, booster/diagnostics/tracer.h).
// While one is installed, Module::operator() hands it each call instead of calling forward() itself.
class ModuleCallObserver {
 public:
  virtual ~ModuleCallObserver() = default;
  // Must return module.forward(input) (with autograd nodes of its own around it, if it likes), calling
  // forward exactly once.
  virtual Tensor call(Module& module, const Tensor& input) = 0;
};
// The calling thread's observer (null: none); set it with ModuleCallObserverScope.
ModuleCallObserver* module_call_observer();
// Installs `observer` on the calling thread for the scope's lifetime, restoring the previous one after.
class ModuleCallObserverScope {
 public:
  explicit ModuleCallObserverScope(ModuleCallObserver* observer);
  ~ModuleCallObserverScope();
  ModuleCallObserverScope(const ModuleCallObserverScope&) = delete;
  ModuleCallObserverScope& operator=(const ModuleCallObserverScope&) = delete;

 private:
  ModuleCallObserver* previous_;
};
// Chooses the modules whose own parameters and buffers a conversion touches (see Module::to).
using ModuleFilter = std::function<bool(const Module&)>;

class Module {
 public:
  Module() = default;
  virtual ~Module() = default;
  // Modules are held by shared_ptr and registered by identity; copying one would alias its tensors.
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // Single-input forward. The base throws NotImplementedError naming the module.
  virtual Tensor forward(const Tensor& x);
  // forward(x), with the module on the error context stack (Note [Error context]), so an error deep
  // inside names the module: call children as (*child)(x), as in PyTorch. A shape, dtype, index,
  // value or device error thrown inside gets the module's path in front (Note [Errors name the
  // module]): "layers.0 (Linear): expected input [..., 8], got shape [16, 10]".
  Tensor operator()(const Tensor& x) {
    const ErrorContextScope context(ErrorContextFrame::Kind::Module, this);
    try {
      if (hooks_ && !hooks_->empty()) [[unlikely]]
        return call_with_hooks(x);
      return call_forward(x);
    } catch (const Error&) {
      rethrow_naming_module();
    }
  }

  // --- forward hooks (torch's register_forward_pre_hook / register_forward_hook) ---
  // operator() calls every pre hook with the input before forward and every hook with the input and
  // the output after it, in registration order; a hook may return a replacement output (an undefined
  // tensor keeps the output), which the later hooks see. They run around an installed
  // ModuleCallObserver's call too. An exception from forward skips the hooks after it. A hook may
  // remove itself or others while it runs; that takes effect from the next call. Returns the handle
  // remove_forward_hook takes.
  using ForwardPreHook = std::function<void(Module& module, const Tensor& input)>;
  using ForwardHook = std::function<Tensor(Module& module, const Tensor& input, const Tensor& output)>;
  int64_t register_forward_pre_hook(ForwardPreHook hook);
  int64_t register_forward_hook(ForwardHook hook);
  // False when this module has no hook with that handle (removed already).
  bool remove_forward_hook(int64_t handle);

  // The class name, as PyTorch prints it: "Linear", "LayerNorm", "GPT", ...
  virtual std::string name() const { return "Module"; }
  // What nn::generate runs (kv_cache.h): this module when it is a CausalLM (nn::GPT, nn::Llama); a
  // wrapper that boost() returns (a precision strategy's) answers for the model inside it, so its
  // cached forward runs under the wrapper's settings; nullptr when the module cannot generate. A
  // wrapper that can never generate may throw IncompatibleError saying why and what to do instead.
  virtual CausalLM* causal_lm();
  // The layer's settings for repr(), e.g. "in_features=784, out_features=10, bias=true".
  virtual std::string extra_repr() const { return ""; }
  // The module tree as PyTorch prints it:
  //   MLPClassifier(
  //     (layers): Sequential(
  //       (0): Linear(in_features=784, out_features=10, bias=true)
  //   ...
  std::string repr() const;

  // --- registries (registration order; recurse walks children depth-first, self first) ---
  std::vector<std::pair<std::string, Tensor>> named_parameters(bool recurse = true) const;
  std::vector<Tensor> parameters(bool recurse = true) const;
  std::vector<std::pair<std::string, Tensor>> named_buffers(bool recurse = true) const;
  std::vector<Tensor> buffers(bool recurse = true) const;
  std::vector<std::pair<std::string, ModulePtr>> named_children() const;
  std::vector<ModulePtr> children() const;
  // This module (under the name "") and every descendant, pre-order, each once.
  std::vector<std::pair<std::string, const Module*>> named_modules() const;
  // Calls fn on every descendant and then on this module (post-order, as torch.nn.Module.apply), e.g.
  // to re-initialise weights by layer type.
  void apply(const std::function<void(Module&)>& fn);
  // The random generators this module's forward draws from, other than the default one (a dropout's
  // own generator), by dotted name, each once (first name wins): what a checkpoint must save so a
  // resumed run draws the same numbers. Subclasses report theirs through own_generators().
  std::vector<std::pair<std::string, Generator*>> named_generators() const;
  virtual std::vector<std::pair<std::string, Generator*>> own_generators() const { return {}; }
  // Total number of parameter elements.
  int64_t num_parameters() const;
  // The direct child registered as `name`; throws IndexError naming the children that exist.
  ModulePtr child(const std::string& name) const;
  // Replaces every registered child, at every depth, by a handle that also owns `owner`, released after
  // the child is destroyed: a module tree made by a plugin library keeps the library loaded while any
  // handle to one of its modules lives (Note [Plugin lifetime] in booster/plugin/loader.h).
  void share_children_with(const std::shared_ptr<const void>& owner);

  // Names every parameter and buffer (Tensor::set_name) by its dotted path below this module, so
  // messages from ops and optimizers say "blocks.0.attn.c_attn.weight". Models call it once built.
  void set_tensor_names();

  // --- mode ---
  void train(bool on = true);  // this module and every descendant
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // --- conversion (see Note [Module tensors keep their handles]) ---
  // Converts floating parameters, their gradients and floating buffers; integer buffers
  // (num_batches_tracked) keep their dtype, as in PyTorch.
  void to(DType dtype);
  // As to(dtype), but only for the tensors owned directly by modules for which convert_if(module) is
  // true. Mixed precision O2 keeps batch norm in float32:
  //   model.to(DType::Float16, [](const Module& m) { return !is_batch_norm(m); });
  void to(DType dtype, const ModuleFilter& convert_if);
  // Moves every parameter, gradient and buffer (floating or not).
  void to(Device device);

  // --- checkpoints ---
  // Parameters and buffers by dotted name. The tensors are detached but share storage with the
  // module's (as PyTorch's state_dict), so clone them to keep a snapshot.
  StateDict state_dict() const;
  // Copies values into the existing tensors (under NoGradGuard, converting dtype and device).
  // strict: keys missing from `sd` and keys of `sd` the module does not have are errors. Shape
  // mismatches are always errors. Every problem is reported by name in one CheckpointError, and
  // nothing is copied unless all keys pass.
  void load_state_dict(const StateDict& sd, bool strict = true);

  // Clears (set_to_none) or zeroes every parameter's gradient.
  void zero_grad(bool set_to_none = true);

  // torch's add_module: registers a child from outside the module, e.g. an adapter attached to a
  // layer (nn/lora.h). Its parameters are then this module's, under "<name>.".
  void add_module(const std::string& name, ModulePtr module) { add_child(name, std::move(module)); }

 protected:
  // Registers a parameter under `name` (no dots) and returns the handle the layer keeps. The tensor
  // becomes a leaf that requires grad (unless requires_grad is false) named `name`.
  Tensor register_parameter(const std::string& name, Tensor t, bool requires_grad = true);
  // Registers a buffer (saved in state_dict, never trained).
  Tensor register_buffer(const std::string& name, Tensor t);
  // Registers a child module and returns it, typed.
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> module) {
    add_child(name, module);
    return module;
  }

 private:
  Tensor call_forward(const Tensor& x) {
    if (ModuleCallObserver* observer = module_call_observer()) return observer->call(*this, x);
    return forward(x);
  }
  Tensor call_with_hooks(const Tensor& x);
  // Inside operator()'s handler: rethrows the error in flight with this module's path in front, once
  // (the innermost module names it; Note [Errors name the module]).
  [[noreturn]] void rethrow_naming_module() const;
  struct ForwardHooks {
    std::vector<std::pair<int64_t, ForwardPreHook>> pre;
    std::vector<std::pair<int64_t, ForwardHook>> post;
    bool empty() const { return pre.empty() && post.empty(); }
  };
  std::unique_ptr<ForwardHooks> hooks_;

  void add_child(const std::string& name, ModulePtr module);
  void check_new_name(const std::string& name, const char* what) const;
  void collect_modules(const std::string& prefix, std::vector<std::pair<std::string, const Module*>>& out) const;
  // Converts this module's own tensors (not its children's).
  void convert_own(DType dtype);
  void move_own(Device device);

  std::vector<std::pair<std::string, Tensor>> params_;
  std::vector<std::pair<std::string, Tensor>> buffers_;
  std::vector<std::pair<std::string, ModulePtr>> children_;
  bool training_ = true;
};

}  // namespace booster::nn
