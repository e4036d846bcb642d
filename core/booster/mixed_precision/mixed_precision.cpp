// The MixedPrecision base (the unscaled step), the strategy registry, option reading, and the module
// and criterion wrappers strategies hand back from configure().
#include "booster/mixed_precision/mixed_precision.h"

#include <algorithm>
#include <cmath>
#include <mutex>

#include "booster/autograd/autograd.h"
#include "booster/ops/ops.h"
#include "booster/plugin/abi.h"
#include "booster/plugin/loader.h"

namespace booster::mixed_precision {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------- the unscaled step

void MixedPrecision::backward(const Tensor& loss, optim::Optimizer& /*optimizer*/) {
  unscaled_this_step_ = false;
  loss.backward();
}

void MixedPrecision::unscale_gradients(optim::Optimizer& /*optimizer*/) { unscaled_this_step_ = true; }

double MixedPrecision::clip_grad_norm(optim::Optimizer& optimizer, double max_norm) {
  BOOSTER_CHECK(max_norm > 0.0, ValueError, name(), ": clip_grad_norm: max_norm must be > 0, got ", max_norm);
  unscale_gradients(optimizer);
  pending_grad_norm_ = clip_grads(flat_grads(optimizer), max_norm);
  return pending_grad_norm_;
}

void MixedPrecision::step(optim::Optimizer& optimizer) {
  optimizer.step();
  stats_ = StepStats{};
  stats_.loss_scale = loss_scale();
  stats_.grad_norm = pending_grad_norm_;
  pending_grad_norm_ = std::numeric_limits<double>::quiet_NaN();
  unscaled_this_step_ = false;
}

// ------------------------------------------------------------------------------------------ registry

namespace {

std::map<std::string, Factory>& registry() {
  static std::map<std::string, Factory> r;
  return r;
}
std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace

void register_strategy(const std::string& name, Factory factory) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  BOOSTER_CHECK(!registry().count(name), ValueError, "mixed precision: strategy '", name,
                "' is registered twice");
  registry()[name] = std::move(factory);
}

std::vector<std::string> registered_strategies() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::vector<std::string> names;
  for (const auto& [n, f] : registry()) names.push_back(n);
  return names;
}

std::unique_ptr<MixedPrecision> create(const std::string& name, const json& options) {
  Factory factory;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto it = registry().find(name);
    if (it != registry().end()) factory = it->second;
  }
  const json opts = options.is_null() ? json::object() : options;
  if (factory) return factory(opts);
  // Not built in: a precision plugin of that name, or at that path.
  if (plugin::is_path(name) || !plugin::find_or_empty(plugin::kPrecisionKind, name).empty())
    return create_from_plugin(name, opts);
  BOOSTER_FAIL(ConfigError, "mixed precision: unknown strategy '", name, "'; the built-in strategies are: ",
               join(registered_strategies()), ", and no precision plugin ",
               plugin::file_name(plugin::kPrecisionKind, name), " was found in ", plugin::describe_search_path(),
               " (set BOOSTER_PLUGIN_PATH, or give the path to the plugin's .so)");
}

std::vector<StrategyInfo> available_strategies() {
  std::vector<StrategyInfo> out;
  const std::vector<std::string> built_in = registered_strategies();
  for (const std::string& n : built_in) out.push_back({n, ""});
  for (const plugin::Found& f : plugin::list(plugin::kPrecisionKind))
    if (std::find(built_in.begin(), built_in.end(), f.name) == built_in.end()) out.push_back({f.name, f.file.string()});
  return out;
}

// ------------------------------------------------------------------------------------- option reader

// ------------------------------------------------------------------------------------------- wrappers

PrecisionModule::PrecisionModule(nn::ModulePtr inner, Options options)
    : inner_(std::move(inner)), options_(std::move(options)) {
  BOOSTER_CHECK(inner_ != nullptr, ValueError, "PrecisionModule: the model is null");
  // Adopt the inner module's registries under the same names (see the header): the tensors and
  // children are shared, so conversions and state_dict act on the inner model itself.
  for (const auto& [n, p] : inner_->named_parameters(false)) register_parameter(n, p, p.requires_grad());
  for (const auto& [n, b] : inner_->named_buffers(false)) register_buffer(n, b);
  for (const auto& [n, c] : inner_->named_children()) register_module(n, c);
  set_tensor_names();
  train(inner_->is_training());
}

Tensor PrecisionModule::run_wrapped(const Tensor& x, const std::function<Tensor(const Tensor&)>& run) {
  // train()/eval() reach the adopted children but not the inner module's own flag.
  if (inner_->is_training() != is_training()) inner_->train(is_training());
  Tensor input = x;
  if (options_.cast_io && is_floating(x.dtype())) input = x.to(options_.input_dtype);
  Tensor out;
  {
    autocast::AutocastGuard guard(options_.autocast, options_.autocast_dtype, options_.table,
                                  options_.linear_override);
    out = run(input);
  }
  if (options_.cast_io && is_floating(out.dtype())) out = out.to(DType::Float32);
  return out;
}

Tensor PrecisionModule::forward(const Tensor& x) {
  // Through operator(): the inner module's forward hooks (ZeRO-3's) run.
  return run_wrapped(x, [&](const Tensor& in) { return (*inner_)(in); });
}

nn::CausalLM& PrecisionModule::inner_lm() const {
  nn::CausalLM* lm = inner_->causal_lm();
  BOOSTER_CHECK(lm != nullptr, IncompatibleError, "generate: the model (", inner_->name(),
                ") has no key/value-cache forward; nn::generate takes a decoder that implements nn::CausalLM "
                "(nn::GPT, nn::Llama)");
  return *lm;
}

Tensor PrecisionModule::forward_cached(const Tensor& idx, nn::KVCache& cache) {
  nn::CausalLM& lm = inner_lm();
  return run_wrapped(idx, [&](const Tensor& in) { return lm.forward_cached(in, cache); });
}

nn::KVCache PrecisionModule::make_kv_cache(int64_t capacity) const { return inner_lm().make_kv_cache(capacity); }
int64_t PrecisionModule::max_positions() const { return inner_lm().max_positions(); }
int64_t PrecisionModule::vocab_size() const { return inner_lm().vocab_size(); }
bool PrecisionModule::has_kv_cache() const { return inner_lm().has_kv_cache(); }

Criterion autocast_criterion(Criterion criterion, DType dtype, std::shared_ptr<const autocast::PolicyTable> table) {
  if (!criterion) return criterion;  // none given: none returned
  return [criterion = std::move(criterion), dtype, table](const Tensor& output, const Tensor& target) {
    autocast::AutocastGuard guard(true, dtype, table);
    return criterion(output, target);
  };
}

Configured configure_autocast(nn::ModulePtr model, std::shared_ptr<optim::Optimizer> optimizer, Criterion criterion,
                              DType dtype) {
  PrecisionModule::Options mo;
  mo.autocast = true;
  mo.autocast_dtype = dtype;
  return {std::make_shared<PrecisionModule>(std::move(model), mo), std::move(optimizer),
          autocast_criterion(std::move(criterion), dtype)};
}

Tensor scale_loss(const Tensor& loss, double scale) {
  const Tensor wide = is_low_precision(loss.dtype()) ? loss.to(DType::Float32) : loss;
  return scale == 1.0 ? wide : mul(wide, scale);
}

std::vector<Tensor> flat_grads(optim::Optimizer& optimizer) {
  std::vector<Tensor> out;
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g)
    for (const optim::FlatBuffer* fb : optimizer.flat_buffers(g)) {
      // The optimizer owns its (non-const) buffers and hands them out read-only; syncing is what its
      // own step() does first, and is idempotent (a synced gradient stays "arrived").
      const_cast<optim::FlatBuffer*>(fb)->sync_grads();
      out.push_back(fb->grad());
    }
  return out;
}

// ---------------------------------------------------------------------------------- PrecisionDecorator
PrecisionDecorator::PrecisionDecorator(std::shared_ptr<MixedPrecision> inner) : inner_(std::move(inner)) {
  BOOSTER_CHECK(inner_ != nullptr, ValueError, "PrecisionDecorator: the inner strategy is null");
}

Configured PrecisionDecorator::configure(nn::ModulePtr model, std::shared_ptr<optim::Optimizer> optimizer,
                                         Criterion criterion) {
  return inner_->configure(std::move(model), std::move(optimizer), std::move(criterion));
}

void PrecisionDecorator::step(optim::Optimizer& optimizer) {
  inner_->step(optimizer);
  stats_ = inner_->last_step_stats();
}

}  // namespace booster::mixed_precision
