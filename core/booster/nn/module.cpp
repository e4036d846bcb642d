#include "booster/nn/module.h"

#include <algorithm>
#include <atomic>
#include <set>
#include <sstream>

#include "booster/autograd/autograd.h"
#include "booster/common/error.h"
#include "booster/nn/kv_cache.h"

namespace booster::nn {

namespace {

std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

// Makes `handle` hold `value`'s data (storage, geometry, dtype) without replacing its TensorImpl, so
// every other handle to it sees the change (Note [Module tensors keep their handles]).
void replace_data(const Tensor& handle, const Tensor& value) {
  TensorImpl* impl = handle.impl();
  impl->storage = value.storage();
  impl->shape = value.shape();
  impl->strides = value.strides();
  impl->offset = value.offset();
  impl->numel = value.numel();
  impl->dtype = value.dtype();
  ++impl->version;
}

void convert_tensor(const Tensor& t, DType dtype) {
  if (!is_floating(t.dtype()) || t.dtype() == dtype) return;
  NoGradGuard no_grad;
  replace_data(t, t.detach().to(dtype));
  if (const Tensor g = t.grad(); g.defined() && g.dtype() != dtype) replace_data(g, g.detach().to(dtype));
}

void move_tensor(const Tensor& t, Device device) {
  if (t.device() == device) return;
  NoGradGuard no_grad;
  replace_data(t, t.detach().to(device));
  if (const Tensor g = t.grad(); g.defined() && g.device() != device) replace_data(g, g.detach().to(device));
}

// The first 20 keys, quoted, and how many more: a checkpoint of 1.23 M stray tensors made a 37 MB line.
std::string list_keys(const std::vector<std::string>& keys) {
  constexpr size_t kShown = 20;
  std::string s;
  for (size_t i = 0; i < keys.size() && i < kShown; ++i) s += (s.empty() ? "\"" : ", \"") + keys[i] + "\"";
  if (keys.size() > kShown) s += str(" and ", keys.size() - kShown, " more (", keys.size(), " in all)");
  return s;
}

thread_local ModuleCallObserver* t_module_call_observer = nullptr;

}  // namespace

ModuleCallObserver* module_call_observer() { return t_module_call_observer; }

ModuleCallObserverScope::ModuleCallObserverScope(ModuleCallObserver* observer) : previous_(t_module_call_observer) {
  t_module_call_observer = observer;
}

ModuleCallObserverScope::~ModuleCallObserverScope() { t_module_call_observer = previous_; }

CausalLM* Module::causal_lm() { return dynamic_cast<CausalLM*>(this); }

std::string Module::repr() const {
  std::string out = name() + "(" + extra_repr();
  if (children_.empty()) return out + ")";
  out += "\n";
  for (const auto& [child_name, child] : children_) {
    std::string body = child->repr();
    // Indent the child's lines by two spaces.
    for (size_t pos = body.find('\n'); pos != std::string::npos; pos = body.find('\n', pos + 1)) body.insert(pos + 1, "  ");
    out += "  (" + child_name + "): " + body + "\n";
  }
  return out + ")";
}

// Note [Error context]: a module frame reads "'layers.0' (Linear) of MLPClassifier", the path found
// below the outermost module being run (only when a message is written).
namespace {
std::string describe_module(const void* module_ptr, const void* root_ptr) {
  const auto* module = static_cast<const Module*>(module_ptr);
  const auto* root = static_cast<const Module*>(root_ptr);
  if (!root || root == module) return module->name();
  for (const auto& [path, m] : root->named_modules())
    if (m == module) return "'" + path + "' (" + module->name() + ") of " + root->name();
  return module->name() + " (called from " + root->name() + ")";
}
[[maybe_unused]] const bool kModuleDescriberSet = (set_module_describer(&describe_module), true);
}  // namespace

// Note [Errors name the module]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// An op's error names the op and the values ("linear: bfloat16 input, float32 weight"), but in a model
// of many Linears the user needs to know which one. So Module::operator() catches a ShapeError,
// DTypeError, IndexError, ValueError, DeviceError or NotImplementedError thrown inside its forward and
// rethrows it with the module's dotted path below the outermost module being run and its class in
// front: "layers.0 (Linear): linear: bfloat16 input, float32 weight" (a message that starts with the
// class's own name, "Linear: expected input ...", loses that repetition). The innermost module does it,
// while the frames of its ancestors are still on the error context stack (Note [Error context]); the
// error it throws is of a type derived from the original one (ShapeError stays a ShapeError) and from
// ModuleNamedError, which the ancestors' handlers rethrow untouched. On the success path this costs
// nothing: the try block is free, and the path is built only in the handler. Other errors (out of
// memory, which names the module itself; distributed failures; configuration) pass unchanged.
namespace {
struct ModuleNamedError {
  virtual ~ModuleNamedError() = default;
};
template <class E>
class NamedError final : public E, public ModuleNamedError {
 public:
  explicit NamedError(const std::string& message) : E(message) {}
};

// "layers.0 (Linear): " for `module` below the outermost module on the stack, "GPT: " for that one.
std::string module_prefix(const Module& module) {
  const ErrorContextStack& s = error_context_stack();
  const Module* root = nullptr;
  for (size_t i = 0; i < std::min(s.depth, kMaxErrorContextDepth) && !root; ++i)
    if (s.frames[i].kind == ErrorContextFrame::Kind::Module) root = static_cast<const Module*>(s.frames[i].what);
  if (root && root != &module)
    for (const auto& [path, m] : root->named_modules())
      if (m == &module) return path + " (" + module.name() + "): ";
  return module.name() + ": ";
}

template <class E>
[[noreturn]] void throw_named(const Module& module, const E& error) {
  std::string message = error.what();
  if (const std::string own = module.name() + ": "; message.rfind(own, 0) == 0) message.erase(0, own.size());
  throw NamedError<E>(module_prefix(module) + message);
}
}  // namespace

void Module::rethrow_naming_module() const {
  try {
    throw;
  } catch (const ModuleNamedError&) {
    throw;
  } catch (const ShapeError& e) {
    throw_named(*this, e);
  } catch (const DTypeError& e) {
    throw_named(*this, e);
  } catch (const IndexError& e) {
    throw_named(*this, e);
  } catch (const ValueError& e) {
    throw_named(*this, e);
  } catch (const DeviceError& e) {
    throw_named(*this, e);
  } catch (const NotImplementedError& e) {
    throw_named(*this, e);
  }
}

Tensor Module::forward(const Tensor&) {
  BOOSTER_FAIL(NotImplementedError, name(), ".forward: this module does not take a single tensor input");
}

// ------------------------------------------------------------------------------------------ registration

void Module::check_new_name(const std::string& name, const char* what) const {
  BOOSTER_CHECK(!name.empty() && name.find('.') == std::string::npos, ValueError, this->name(),
                ": cannot register ", what, " \"", name, "\": names must be non-empty and contain no '.'");
  auto taken = [&](const auto& list) {
    return std::any_of(list.begin(), list.end(), [&](const auto& e) { return e.first == name; });
  };
  BOOSTER_CHECK(!taken(params_) && !taken(buffers_) && !taken(children_), ValueError, this->name(),
                ": cannot register ", what, " \"", name, "\": the name is already taken");
}

Tensor Module::register_parameter(const std::string& name, Tensor t, bool requires_grad) {
  check_new_name(name, "parameter");
  BOOSTER_CHECK(t.defined(), ValueError, this->name(), ": parameter \"", name, "\" is undefined");
  BOOSTER_CHECK(t.is_leaf(), AutogradError, this->name(), ": parameter \"", name,
                "\" must be a leaf tensor; pass a detached tensor");
  t.requires_grad_(requires_grad);
  t.set_name(name);
  params_.emplace_back(name, t);
  return t;
}

Tensor Module::register_buffer(const std::string& name, Tensor t) {
  check_new_name(name, "buffer");
  BOOSTER_CHECK(t.defined(), ValueError, this->name(), ": buffer \"", name, "\" is undefined");
  t.set_name(name);
  buffers_.emplace_back(name, t);
  return t;
}

void Module::add_child(const std::string& name, ModulePtr module) {
  check_new_name(name, "module");
  BOOSTER_CHECK(module != nullptr, ValueError, this->name(), ": child module \"", name, "\" is null");
  children_.emplace_back(name, std::move(module));
}

void Module::share_children_with(const std::shared_ptr<const void>& owner) {
  struct Keeper {
    std::shared_ptr<const void> owner;  // declared first: released after the module
    ModulePtr module;
  };
  for (auto& [name, c] : children_) {
    c->share_children_with(owner);
    Module* raw = c.get();
    c = ModulePtr(std::make_shared<Keeper>(Keeper{owner, std::move(c)}), raw);
  }
}

// ------------------------------------------------------------------------------------------ registries

void Module::collect_modules(const std::string& prefix,
                             std::vector<std::pair<std::string, const Module*>>& out) const {
  // A module shared under two names is listed once, under the first (PyTorch's remove_duplicate).
  for (const auto& [n, m] : out)
    if (m == this) return;
  out.emplace_back(prefix, this);
  for (const auto& [name, child] : children_) child->collect_modules(join(prefix, name), out);
}

std::vector<std::pair<std::string, const Module*>> Module::named_modules() const {
  std::vector<std::pair<std::string, const Module*>> out;
  collect_modules("", out);
  return out;
}

std::vector<std::pair<std::string, Generator*>> Module::named_generators() const {
  std::vector<std::pair<std::string, Generator*>> out;
  std::set<const Generator*> seen;
  for (const auto& [prefix, m] : named_modules())
    for (const auto& [name, gen] : m->own_generators())
      if (gen != nullptr && seen.insert(gen).second) out.emplace_back(join(prefix, name), gen);
  return out;
}

std::vector<std::pair<std::string, Tensor>> Module::named_parameters(bool recurse) const {
  if (!recurse) return params_;
  std::vector<std::pair<std::string, Tensor>> out;
  std::set<const TensorImpl*> seen;  // a tensor shared by two modules (weight tying) is listed once
  for (const auto& [prefix, m] : named_modules())
    for (const auto& [name, t] : m->params_)
      if (seen.insert(t.impl()).second) out.emplace_back(join(prefix, name), t);
  return out;
}

std::vector<Tensor> Module::parameters(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [name, t] : named_parameters(recurse)) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, Tensor>> Module::named_buffers(bool recurse) const {
  if (!recurse) return buffers_;
  std::vector<std::pair<std::string, Tensor>> out;
  std::set<const TensorImpl*> seen;
  for (const auto& [prefix, m] : named_modules())
    for (const auto& [name, t] : m->buffers_)
      if (seen.insert(t.impl()).second) out.emplace_back(join(prefix, name), t);
  return out;
}

std::vector<Tensor> Module::buffers(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [name, t] : named_buffers(recurse)) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, ModulePtr>> Module::named_children() const { return children_; }

std::vector<ModulePtr> Module::children() const {
  std::vector<ModulePtr> out;
  for (const auto& [name, m] : children_) out.push_back(m);
  return out;
}

ModulePtr Module::child(const std::string& name) const {
  for (const auto& [n, m] : children_)
    if (n == name) return m;
  std::vector<std::string> names;
  for (const auto& [n, m] : children_) names.push_back(n);
  BOOSTER_FAIL(IndexError, this->name(), ": no child module \"", name, "\"; children are [", list_keys(names), "]");
}

void Module::apply(const std::function<void(Module&)>& fn) {
  for (auto& [name, child] : children_) child->apply(fn);
  fn(*this);
}

int64_t Module::num_parameters() const {
  int64_t n = 0;
  for (const auto& [name, t] : named_parameters()) n += t.numel();
  return n;
}

void Module::set_tensor_names() {
  for (const auto& [name, t] : named_parameters()) t.set_name(name);
  for (const auto& [name, t] : named_buffers()) t.set_name(name);
}

// ------------------------------------------------------------------------------------------ forward hooks

namespace {
std::atomic<int64_t> g_next_hook_handle{1};
}  // namespace

int64_t Module::register_forward_pre_hook(ForwardPreHook hook) {
  BOOSTER_CHECK(hook != nullptr, ValueError, name(), ".register_forward_pre_hook: the hook is empty");
  if (!hooks_) hooks_ = std::make_unique<ForwardHooks>();
  const int64_t handle = g_next_hook_handle.fetch_add(1);
  hooks_->pre.emplace_back(handle, std::move(hook));
  return handle;
}

int64_t Module::register_forward_hook(ForwardHook hook) {
  BOOSTER_CHECK(hook != nullptr, ValueError, name(), ".register_forward_hook: the hook is empty");
  if (!hooks_) hooks_ = std::make_unique<ForwardHooks>();
  const int64_t handle = g_next_hook_handle.fetch_add(1);
  hooks_->post.emplace_back(handle, std::move(hook));
  return handle;
}

bool Module::remove_forward_hook(int64_t handle) {
  if (!hooks_) return false;
  auto drop = [handle](auto& list) {
    const auto it = std::find_if(list.begin(), list.end(), [handle](const auto& entry) { return entry.first == handle; });
    if (it == list.end()) return false;
    list.erase(it);
    return true;
  };
  return drop(hooks_->pre) || drop(hooks_->post);
}

Tensor Module::call_with_hooks(const Tensor& x) {
  // Copies: a hook may add or remove hooks while it runs.
  const std::vector<std::pair<int64_t, ForwardPreHook>> pre = hooks_->pre;
  const std::vector<std::pair<int64_t, ForwardHook>> post = hooks_->post;
  for (const auto& [handle, hook] : pre) hook(*this, x);
  Tensor out = call_forward(x);
  for (const auto& [handle, hook] : post) {
    Tensor replaced = hook(*this, x, out);
    if (replaced.defined()) out = std::move(replaced);
  }
  return out;
}

// ------------------------------------------------------------------------------------------ mode

void Module::train(bool on) {
  training_ = on;
  for (auto& [name, child] : children_) child->train(on);
}

// ------------------------------------------------------------------------------------------ conversion

void Module::convert_own(DType dtype) {
  for (auto& [name, t] : params_) convert_tensor(t, dtype);
  for (auto& [name, t] : buffers_) convert_tensor(t, dtype);
}

void Module::move_own(Device device) {
  for (auto& [name, t] : params_) move_tensor(t, device);
  for (auto& [name, t] : buffers_) move_tensor(t, device);
}

void Module::to(DType dtype) {
  BOOSTER_CHECK(is_floating(dtype), DTypeError, name(), ".to: expected a floating dtype, got ", dtype,
                "; modules convert only their floating parameters and buffers");
  convert_own(dtype);
  for (auto& [name, child] : children_) child->to(dtype);
}

void Module::to(DType dtype, const ModuleFilter& convert_if) {
  BOOSTER_CHECK(is_floating(dtype), DTypeError, name(), ".to: expected a floating dtype, got ", dtype,
                "; modules convert only their floating parameters and buffers");
  if (convert_if(*this)) convert_own(dtype);
  for (auto& [name, child] : children_) child->to(dtype, convert_if);
}

void Module::to(Device device) {
  move_own(device);
  for (auto& [name, child] : children_) child->to(device);
}

// ------------------------------------------------------------------------------------------ checkpoints

StateDict Module::state_dict() const {
  StateDict sd;
  for (const auto& [name, t] : named_parameters()) sd.emplace(name, t.detach());
  for (const auto& [name, t] : named_buffers()) sd.emplace(name, t.detach());
  return sd;
}

void Module::load_state_dict(const StateDict& sd, bool strict) {
  std::vector<std::pair<std::string, Tensor>> own = named_parameters();
  for (auto& entry : named_buffers()) own.push_back(std::move(entry));

  std::vector<std::string> missing, unexpected, mismatched;
  std::set<std::string> own_names;
  for (const auto& [name, t] : own) {
    own_names.insert(name);
    auto it = sd.find(name);
    if (it == sd.end()) {
      missing.push_back(name);
    } else if (!it->second.defined() || it->second.shape() != t.shape()) {
      mismatched.push_back(str(name, " (checkpoint ",
                               it->second.defined() ? str(it->second.shape()) : std::string("undefined"),
                               ", model ", t.shape(), ")"));
    }
  }
  for (const auto& [name, t] : sd)
    if (!own_names.count(name)) unexpected.push_back(name);

  const bool key_errors = strict && (!missing.empty() || !unexpected.empty());
  if (key_errors || !mismatched.empty()) {
    std::ostringstream msg;
    msg << name() << ".load_state_dict: the state dict does not match the model";
    if (strict && !missing.empty()) msg << "; missing keys: " << list_keys(missing);
    if (strict && !unexpected.empty()) msg << "; unexpected keys: " << list_keys(unexpected);
    if (!mismatched.empty()) msg << "; shape mismatch for: " << list_keys(mismatched);
    if (key_errors) msg << " (pass strict=false to ignore missing and unexpected keys)";
    throw CheckpointError(msg.str());
  }

  NoGradGuard no_grad;
  for (const auto& [name, t] : own) {
    auto it = sd.find(name);
    if (it == sd.end() || it->second.is_same(t)) continue;
    Tensor dst = t;
    dst.copy_(it->second);
  }
}

void Module::zero_grad(bool set_to_none) {
  for (const auto& [name, t] : named_parameters()) {
    if (!t.grad().defined()) continue;
    if (set_to_none) {
      t.set_grad(Tensor());
    } else {
      Tensor g = t.grad();
      NoGradGuard no_grad;
      g.zero_();
    }
  }
}

}  // namespace booster::nn
