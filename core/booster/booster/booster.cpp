// The Booster (Note [Booster lifecycle] in booster.h).
#include "booster/booster/booster.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>

#include "booster/backends/cuda/cuda.h"
#include "booster/booster/compat.h"
#include "booster/booster/reproducible.h"
#include "booster/checkpoint/atomic_file.h"
#include "booster/checkpoint/checkpoint.h"
#include "booster/checkpoint/safetensors.h"
#include "booster/config/config.h"
#include "booster/common/json_text.h"
#include "booster/ops/ops.h"
#include "booster/tensor/deferred.h"

namespace booster {

using nlohmann::json;

// ------------------------------------------------------------------------------------ BoosterConfig
BoosterConfig BoosterConfig::from_json(const json& config) {
  BOOSTER_CHECK(config.is_object(), ConfigError, "booster config must be a JSON object, got ", config.dump());
  for (const auto& [key, value] : config.items())
    BOOSTER_CHECK(key == "mixed_precision" || key == "plugin" || key == "device" || key == "reproducible" ||
                      key == "reproducible_chunks",
                  ConfigError, "booster config: unknown key '", key,
                  "'; the keys are mixed_precision, plugin, device, reproducible, reproducible_chunks");
  BoosterConfig out;
  if (config.contains("mixed_precision"))
    std::tie(out.mixed_precision, out.mixed_precision_options) =
        config::parse_named_section(config.at("mixed_precision"), "mixed_precision", out.mixed_precision);
  if (config.contains("plugin"))
    std::tie(out.plugin, out.plugin_options) = config::parse_named_section(config.at("plugin"), "plugin", out.plugin);
  if (config.contains("device")) {
    BOOSTER_CHECK(config.at("device").is_string(), ConfigError, "booster config 'device' must be a string such as ",
                  "\"cpu\" or \"cuda\", got ", config.at("device").dump());
    out.device = config.at("device").get<std::string>();
  }
  if (config.contains("reproducible")) {
    BOOSTER_CHECK(config.at("reproducible").is_boolean(), ConfigError, "booster config 'reproducible' must be true "
                  "or false, got ", config.at("reproducible").dump());
    out.reproducible = config.at("reproducible").get<bool>();
  }
  if (config.contains("reproducible_chunks")) {
    const json& k = config.at("reproducible_chunks");
    BOOSTER_CHECK(k.is_number_integer() && k.get<int64_t>() >= 0, ConfigError, "booster config 'reproducible_chunks' "
                  "must be a power of two (0: chosen from the batch), got ", k.dump());
    out.reproducible_chunks = k.get<int64_t>();
  }
  return out;
}

json BoosterConfig::to_json() const {
  json mp = mixed_precision_options;
  mp["name"] = mixed_precision;
  json pl = plugin_options;
  pl["name"] = plugin.empty() ? "single" : plugin;
  json out = {{"mixed_precision", mp}, {"plugin", pl}, {"device", device}};
  if (reproducible) {  // absent by default, so the default config reads as it always did
    out["reproducible"] = true;
    out["reproducible_chunks"] = reproducible_chunks;
  }
  return out;
}

// ------------------------------------------------------------------------- BoostedOptimizer/Scheduler
BoostedOptimizer::BoostedOptimizer(std::shared_ptr<optim::Optimizer> user, std::shared_ptr<optim::Optimizer> stepped,
                                   std::shared_ptr<mixed_precision::MixedPrecision> precision,
                                   std::shared_ptr<AccumulationState> accumulation)
    : user_(std::move(user)),
      stepped_(std::move(stepped)),
      precision_(std::move(precision)),
      accumulation_(std::move(accumulation)) {}

void BoostedOptimizer::zero_grad(bool set_to_none) {
  if (accumulation_ && accumulation_->holds_gradients()) return;  // Note [Gradient accumulation in a loop]
  stepped_->zero_grad(set_to_none);
}

void BoostedOptimizer::copy_options_to_stepped() const {
  if (user_ == stepped_) return;
  std::vector<optim::ParamGroup>& from = user_->param_groups();
  std::vector<optim::ParamGroup>& to = stepped_->param_groups();
  BOOSTER_CHECK(from.size() == to.size(), StateError, "boosted optimizer: the optimizer passed to boost() has ",
                from.size(), " param groups but the one that steps has ", to.size(),
                "; add param groups before boost(), not after");
  for (size_t g = 0; g < from.size(); ++g) to[g].options = from[g].options;
}

void BoostedOptimizer::step() {
  if (accumulation_ && accumulation_->holds_step()) return;  // Note [Gradient accumulation in a loop]
  copy_options_to_stepped();
  precision_->step(*stepped_);
  ++steps_;
  if (accumulation_ && accumulation_->open) accumulation_->stepped = true;
}

optim::OptimizerState BoostedOptimizer::state_dict() const {
  copy_options_to_stepped();  // the saved lr is the one the scheduler set
  return stepped_->state_dict();
}

void BoostedOptimizer::load_state_dict(const optim::OptimizerState& state) {
  stepped_->load_state_dict(state);
  copy_options_from_stepped();
}

void BoostedOptimizer::copy_options_from_stepped() {
  // The loaded hyperparameters become the user's too, or the next step would copy the old ones back.
  if (user_ == stepped_) return;
  std::vector<optim::ParamGroup>& to = user_->param_groups();
  const std::vector<optim::ParamGroup>& from = stepped_->param_groups();
  for (size_t g = 0; g < std::min(from.size(), to.size()); ++g) to[g].options = from[g].options;
}

BoostedScheduler::BoostedScheduler(std::shared_ptr<optim::LRScheduler> scheduler,
                                   std::shared_ptr<mixed_precision::MixedPrecision> precision,
                                   std::shared_ptr<const AccumulationState> accumulation)
    : scheduler_(std::move(scheduler)), precision_(std::move(precision)), accumulation_(std::move(accumulation)) {}

void BoostedScheduler::step() {
  if (accumulation_ && accumulation_->holds_step()) return;  // Note [Gradient accumulation in a loop]
  if (!precision_->step_was_skipped()) scheduler_->step();
}

// ------------------------------------------------------------------------------ BoosterComponents
Device require_device(const std::string& name) {
  Device device;
  try {
    device = device_from_string(name);
  } catch (const Error&) {
    BOOSTER_FAIL(ConfigError, "device \"", name, "\" is not a device; use \"cpu\", \"cuda\" or \"cuda:N\"");
  }
  if (device.is_cuda()) {
    BOOSTER_CHECK(cuda::is_available(), DeviceError, "device \"", name, "\": no CUDA GPU was found (",
                  cuda::unavailable_reason(), "); use device \"cpu\"");
    BOOSTER_CHECK(device.index < cuda::device_count(), DeviceError, "device \"", name, "\": this machine has ",
                  cuda::device_count(), cuda::device_count() == 1 ? " CUDA GPU" : " CUDA GPUs", " (cuda:0",
                  cuda::device_count() > 1 ? " to cuda:" + std::to_string(cuda::device_count() - 1) : std::string(),
                  "); choose one of them");
  }
  return device;
}

BoosterComponents::BoosterComponents(BoosterConfig config_in, std::shared_ptr<ParallelPlugin> plugin_in,
                                     std::shared_ptr<mixed_precision::MixedPrecision> precision_in)
    : config(std::move(config_in)), plugin(std::move(plugin_in)), precision(std::move(precision_in)) {
  BOOSTER_CHECK(plugin != nullptr && precision != nullptr, ValueError, "BoosterComponents: ",
                plugin ? "the precision strategy" : "the plugin", " is null");
  // The combination first: it is wrong on any machine. Then whether this one has the device.
  compat::require_compatible(config.mixed_precision, compat::PluginTraits::of(*plugin), config.device);
  require_device(config.device);
}

BoosterComponents BoosterComponents::create(const BoosterConfig& config) {
  std::shared_ptr<ParallelPlugin> plugin = create_plugin(config.plugin, config.plugin_options);
  std::shared_ptr<mixed_precision::MixedPrecision> precision =
      mixed_precision::create(config.mixed_precision, config.mixed_precision_options);
  return BoosterComponents(config, std::move(plugin), std::move(precision));
}

// ------------------------------------------------------------------------------------------ Booster
namespace {
constexpr const char* kPrecisionTensorsFile = "precision.safetensors";
constexpr const char* kPrecisionMetaFile = "precision.json";
}  // namespace

int Booster::process_group_rank() const { return plugin_->process_group().rank(); }

// Note [Per-rank state of a split model]
// Under a plugin that splits the model (tensor or pipeline parallel) or lays its checkpoints out its
// own way on several processes (hybrid_parallel's ZeRO-1: each rank's strategy holds the masters of
// the parameters it steps), each rank's strategy holds the state of its own part (float32 masters of
// its shards, stage or parameters), and each stage's dropout draws from its own generator: rank 0's
// alone would restore the others wrongly. So each rank saves these beside the shared files, as
// <name>.rank-<r>.<ext>, and loads its own.
bool Booster::splits_model() const {
  const ParallelLayout layout = plugin_->layout();
  return layout.tensor * layout.pipeline > 1 ||
         (plugin_->control_checkpoint_io() && plugin_->process_group().size() > 1);
}

std::string Booster::rank_file(const std::string& name, const std::string& extension) const {
  return name + ".rank-" + std::to_string(process_group_rank()) + extension;
}

Booster::Booster(BoosterConfig config) : Booster(BoosterComponents::create(config)) {}

Booster::Booster(BoosterComponents components)
    : config_(std::move(components.config)),
      plugin_(std::move(components.plugin)),
      precision_(std::move(components.precision)) {
  checkpoint_io_ = plugin_->checkpoint_io();
  BOOSTER_CHECK(checkpoint_io_ != nullptr, PluginError, "plugin '", plugin_->name(), "' returned no checkpoint IO");
  if (config_.reproducible)  // Note [Reproducible training across world sizes]: refused before any work
    reproducible::check_layout(plugin_->name(), plugin_->layout(), plugin_->options(), config_.mixed_precision);
}

Booster::~Booster() = default;

Boosted Booster::boost(nn::ModulePtr model, std::shared_ptr<optim::Optimizer> optimizer, nn::Criterion criterion,
                       std::shared_ptr<data::DataLoader> dataloader, std::shared_ptr<optim::LRScheduler> scheduler) {
  BOOSTER_CHECK(model != nullptr, ValueError, "Booster::boost: the model is required (got null)");
  BOOSTER_CHECK(!boosted_, StateError, "Booster::boost: this Booster has boosted a model already; make one Booster "
                "per model");
  boosted_ = true;
  if (config_.reproducible) reproducible::check_model(*model);
  const std::shared_ptr<optim::Optimizer> user_optimizer = optimizer;
  user_model_ = model;
  // The model goes to the device first: a strategy converts it there, master weights are made there
  // and a plugin communicates from there. The optimizer's parameters are the model's, moved in place.
  const Device device = require_device(config_.device);
  if (!device.is_cpu()) {
    model->to(device);
    if (optimizer) optimizer->rebind();  // its flat buffers were made where the model was
    if (dataloader) dataloader->set_device(device);
  }

  TrainingParts parts{std::move(model), std::move(optimizer), std::move(criterion), std::move(dataloader),
                      std::move(scheduler), precision_};
  // A plugin that splits the model takes this rank's part first, so the strategy sees only that.
  parts = plugin_->shard(std::move(parts));
  BOOSTER_CHECK(parts.model != nullptr, PluginError, "plugin '", plugin_->name(), "' shard() returned no model");
  // Messages and checkpoints (optimizer.json's param_names) name parameters by their module path. A
  // parameter that has none, or only its last part (a layer built alone, a tensor-parallel shard made by
  // the plugin), takes its path in the model now; one named otherwise (a pipeline stage's parameters
  // keep the whole model's paths) keeps its name.
  for (const auto& [path, t] : parts.model->named_parameters()) {
    const std::string name = t.name();
    if (name.empty() || (path.size() > name.size() && path.compare(path.size() - name.size(), name.size(), name) == 0 &&
                         path[path.size() - name.size() - 1] == '.'))
      t.set_name(path);
  }
  // A model built under a LazyInitGuard (booster/tensor/deferred.h) takes its memory now: only the part
  // this rank holds, where the plugin split it (moved to the device above, it was still deferred). A
  // plugin that shards parameters itself (ZeRO-3) allocates its shard of them in configure().
  if (!plugin_->take_deferred_parameters())
    for (const Tensor& t : parts.model->parameters()) materialize(t);
  for (const Tensor& t : parts.model->buffers()) materialize(t);
  if (lora_) {
    // Note [Adapter-only checkpoints]: the base as given, before a strategy converts it.
    // Under a plugin that splits layers, of the whole model (so any layout resumes it), which that
    // allocates where it was built deferred.
    const ParallelLayout layout = plugin_->layout();
    lora_base_digest_ = base_digest(layout.tensor > 1 || layout.pipeline > 1 ? *user_model_ : *parts.model);
    if (parts.optimizer)
      for (const optim::ParamGroup& g : parts.optimizer->param_groups())
        for (const Tensor& p : g.params)
          BOOSTER_CHECK(p.requires_grad(), ValueError, "Booster::boost: the optimizer holds '", p.name(),
                        "', a frozen base weight of the LoRA model; build it over nn::trainable_parameters(*model) "
                        "so the base gets no gradient, optimizer state or master weight");
  }
  if (!plugin_->control_precision()) {
    // A strategy that keeps master weights needs an optimizer to rebuild; without one it still
    // converts or wraps model and criterion.
    mixed_precision::Configured c = precision_->configure(parts.model, parts.optimizer, parts.criterion);
    parts.model = std::move(c.model);
    parts.optimizer = std::move(c.optimizer);
    parts.criterion = std::move(c.criterion);
  }
  parts = plugin_->configure(std::move(parts));
  BOOSTER_CHECK(parts.model != nullptr && parts.precision != nullptr, PluginError, "plugin '", plugin_->name(),
                "' configure() returned no ", parts.model ? "precision strategy" : "model");
  precision_ = parts.precision;

  // An optimizer that a strategy or plugin rebuilt (master weights, shards) now does the stepping; the
  // user's keeps only its param groups, whose options a scheduler edits and the boosted optimizer
  // forwards. Its flat copies of values and gradients would otherwise stay allocated for nothing.
  if (user_optimizer && parts.optimizer && parts.optimizer != user_optimizer) user_optimizer->release_buffers();

  Boosted out;
  out.model = parts.model;
  out.criterion = parts.criterion;
  out.dataloader = parts.dataloader;
  if (parts.optimizer)
    out.optimizer = std::make_shared<BoostedOptimizer>(user_optimizer ? user_optimizer : parts.optimizer,
                                                       parts.optimizer, precision_, accumulation_);
  if (parts.scheduler) out.scheduler = std::make_shared<BoostedScheduler>(parts.scheduler, precision_, accumulation_);
  parts_ = out;
  return out;
}

void Booster::backward(const Tensor& loss, BoostedOptimizer& optimizer) {
  AccumulationState& a = *accumulation_;
  if (a.open) a.backward_done = true;
  precision_->backward(a.open && a.steps > 1 ? mul(loss, 1.0 / double(a.steps)) : loss, optimizer.stepped_optimizer());
}

double Booster::execute_pipeline(const Tensor& x, const Tensor& y, nn::Module& model, const nn::Criterion& criterion,
                                 BoostedOptimizer& optimizer, double loss_factor) {
  BOOSTER_CHECK(criterion != nullptr, ValueError, "Booster::execute_pipeline: the criterion is empty");
  AccumulationState& a = *accumulation_;
  if (a.open) {
    a.backward_done = true;
    if (a.steps > 1) loss_factor *= 1.0 / double(a.steps);
  }
  auto backward = [&](const Tensor& loss) {
    precision_->backward(loss_factor == 1.0 ? loss : mul(loss, loss_factor), optimizer.stepped_optimizer());
  };
  if (plugin_->layout().pipeline > 1) return plugin_->train_step(x, y, criterion, backward);
  const Tensor loss = criterion(model(x), y);
  backward(loss);
  return loss.item();
}

int64_t Booster::reproducible_chunks(int64_t global_rows) {
  const int64_t chunks =
      config_.reproducible_chunks > 0 ? config_.reproducible_chunks : reproducible::default_chunks(global_rows);
  reproducible::check_sizes(chunks, global_rows, plugin_->process_group().size(), "reproducible training");
  return chunks;
}

int64_t Booster::reproducible_received_bytes() const {
  return reproducible_tree_ ? reproducible_tree_->received_bytes() : 0;
}

// Note [Reproducible training across world sizes] in reproducible.h.
double Booster::reproducible_step(const Tensor& x, const Tensor& y, nn::Module& model, const nn::Criterion& criterion,
                                  BoostedOptimizer& optimizer) {
  BOOSTER_CHECK(config_.reproducible, StateError, "Booster::reproducible_step: this Booster is not reproducible; set "
                "BoosterConfig::reproducible (train.reproducible)");
  BOOSTER_CHECK(!accumulation_->open, StateError, "Booster::reproducible_step: called inside accumulate(); a "
                "reproducible step cuts the step's rows into chunks itself: pass all of them at once");
  BOOSTER_CHECK(criterion != nullptr, ValueError, "Booster::reproducible_step: the criterion is empty");
  BOOSTER_CHECK(x.dim() >= 1 && y.dim() >= 1 && x.size(0) == y.size(0), ShapeError, "Booster::reproducible_step: x ",
                shape_str(x.shape()), " and y ", shape_str(y.shape()), " must have the same number of rows");
  distributed::ProcessGroup& group = plugin_->process_group();
  const int world = group.size();
  const int64_t rows = x.size(0);
  const int64_t chunks = reproducible_chunks(rows * int64_t(world));
  const int64_t local = chunks / world;  // this rank's chunks: c = rank + world * m
  const int64_t chunk_rows = rows / local;
  if (!reproducible_tree_) reproducible_tree_ = std::make_unique<reproducible::GradientTree>(model.parameters());
  reproducible::GradientTree& tree = *reproducible_tree_;
  reproducible::ValueTree losses;
  tree.clear();
  optimizer.zero_grad();
  const bool quiet = plugin_->support_no_sync();
  if (quiet) plugin_->set_gradient_sync(false);
  try {
    Tensor picked = Tensor::empty({chunk_rows}, DType::Int64);
    for (int64_t t = 0; t < local; ++t) {
      const int64_t m = reproducible::leaf(t, local);  // local chunk m: rows m, m + local, m + 2 local, ...
      for (int64_t j = 0; j < chunk_rows; ++j) picked.data<int64_t>()[j] = m + j * local;
      picked.bump_version();
      const Tensor index = picked.to(x.device());
      const Tensor loss = criterion(model(index_select(x, 0, index)), index_select(y, 0, index.to(y.device())));
      losses.push(loss.item());
      precision_->backward(mul(loss, 1.0 / double(chunks)), optimizer.stepped_optimizer());
      tree.push_gradients();
    }
    tree.combine_ranks(group);
    losses.combine_ranks(group);
    // Every rank holds G now. ddp (and one process) step with what the gradients hold while sync is
    // off; ZeRO-1 reduce-scatters them at its step anyway, so rank 0 hands its averaging reduction
    // world * G and the others zeros: exact in any order.
    const bool plugin_reduces = plugin_->name() == "low_level_zero";
    tree.write_gradients(plugin_reduces ? double(world) : 1.0, /*zeros_elsewhere=*/plugin_reduces, group.rank());
    if (quiet && !plugin_reduces) plugin_->set_gradient_sync(true);
    if (quiet && plugin_reduces) {
      plugin_->set_gradient_sync(true);
      // A backward that reaches no parameter: the plugin reduces what the gradients hold (ddp's
      // finish_backward launches every bucket, ZeRO-1 reduce-scatters its buffer).
      Tensor nothing = zeros({1}, DType::Float32, x.device());
      nothing.requires_grad_(true);
      precision_->backward(sum(nothing), optimizer.stepped_optimizer());
    }
  } catch (...) {
    if (quiet) plugin_->set_gradient_sync(true);
    throw;
  }
  return losses.total() / double(chunks);
}

double Booster::clip_grad_norm(BoostedOptimizer& optimizer, double max_norm) {
  // Note [Gradient accumulation in a loop]: the gradients are not complete before the cycle's last
  // micro-step, and unscaling them there would mix scaled and unscaled ones.
  if (accumulation_->holds_step()) return std::numeric_limits<double>::quiet_NaN();
  return precision_->clip_grad_norm(optimizer.stepped_optimizer(), max_norm);
}

Booster::NoSync::NoSync(ParallelPlugin& plugin) : plugin_(plugin) {
  BOOSTER_CHECK(plugin_.support_no_sync(), IncompatibleError, "no_sync: plugin '", plugin_.name(),
                "' cannot skip gradient synchronisation; accumulate gradients without no_sync(), or use a plugin "
                "that supports it (single, ddp, low_level_zero stage 1)");
  plugin_.set_gradient_sync(false);
}

Booster::NoSync::~NoSync() {
  try {
    plugin_.set_gradient_sync(true);
  } catch (...) {
    // A destructor must not throw; the next synced backward reports a broken plugin.
  }
}

Booster::NoSync Booster::no_sync() { return NoSync(*plugin_); }

Booster::Accumulate::Accumulate(Booster& booster, int64_t steps) : booster_(booster) {
  AccumulationState& a = *booster_.accumulation_;
  BOOSTER_CHECK(steps >= 1, ValueError, "Booster::accumulate: steps is ", steps,
                "; give the micro-batches per optimizer step, 1 or more");
  BOOSTER_CHECK(!a.open, StateError, "Booster::accumulate: a micro-step's guard is open already; open one per "
                "micro-batch, each ending before the next begins");
  BOOSTER_CHECK(a.micro == 0 || a.steps == steps, StateError, "Booster::accumulate: ", steps,
                " steps asked in the middle of a cycle of ", a.steps, " (", a.micro,
                " micro-steps done); change the number only after a cycle's optimizer step");
  micro_ = a.micro;
  sync_ = micro_ == steps - 1;
  // Every micro-step but the last accumulates locally where the plugin can skip its communication;
  // elsewhere each backward accumulates as it is (Note [Gradient accumulation in a loop]).
  if (!sync_ && booster_.plugin_->support_no_sync()) {
    booster_.plugin_->set_gradient_sync(false);
    gradient_sync_off_ = true;
  }
  a.steps = steps;
  a.open = true;
  a.backward_done = false;
  a.stepped = false;
}

void Booster::abandon_accumulation() {
  AccumulationState& a = *accumulation_;
  BOOSTER_CHECK(!a.open, StateError, "Booster::abandon_accumulation: a micro-step's guard is open; call it after "
                "the guard's scope ends");
  a.micro = 0;
}

Booster::Accumulate::~Accumulate() {
  AccumulationState& a = *booster_.accumulation_;
  a.open = false;
  a.micro = sync_ ? 0 : micro_ + 1;
  if (!gradient_sync_off_) return;
  try {
    booster_.plugin_->set_gradient_sync(true);
  } catch (...) {
    // A destructor must not throw; the next synced backward reports a broken plugin.
  }
}

Booster::Accumulate Booster::accumulate(int64_t steps) { return Accumulate(*this, steps); }

std::shared_ptr<data::DataLoader> Booster::prepare_dataloader(data::DatasetPtr dataset,
                                                              const data::DataLoaderOptions& options) {
  BOOSTER_CHECK(dataset != nullptr, ValueError, "Booster::prepare_dataloader: the data set is null");
  std::shared_ptr<data::DataLoader> loader = plugin_->prepare_dataloader(std::move(dataset), options);
  loader->set_device(require_device(config_.device));
  return loader;
}

void Booster::save_model(const nn::Module& model, const std::filesystem::path& dir, uint64_t max_shard_bytes) const {
  checkpoint_io_->save_model(model, dir, max_shard_bytes);
}
void Booster::load_model(nn::Module& model, const std::filesystem::path& path) const {
  checkpoint_io_->load_model(model, path);
}

std::vector<std::string> Booster::enable_lora(const nn::ModulePtr& model, const nn::LoraConfig& config) {
  BOOSTER_CHECK(!boosted_, StateError, "enable_lora: call it before boost(), on the model boost() is then given");
  BOOSTER_CHECK(model != nullptr, ValueError, "enable_lora: the model is null");
  // Under tp and pp the Llama's and the GPT's shard policies split the adapters with their Linears
  // (Note [LoRA under tensor parallelism] in nn/lora.cpp); the other policies do not yet.
  const ParallelLayout layout = plugin_->layout();
  const bool splits_adapters = model->name() == "Llama" || model->name() == "GPT";
  BOOSTER_CHECK((layout.tensor <= 1 && layout.pipeline <= 1) || splits_adapters, IncompatibleError,
                "enable_lora: plugin '", plugin_->name(), "' splits layers (tp ", layout.tensor, ", pp ",
                layout.pipeline, "), and only the Llama's and the GPT's shard policies split adapters; the model "
                "is a ", model->name(), "; use ddp or low_level_zero, or tp_size and pp_size 1");
  std::vector<std::string> adapted = nn::apply_lora(*model, config);
  lora_ = config;
  return adapted;
}

// Note [Adapter-only checkpoints] (state.cpp). A 64-bit multiply-xorshift over 8-byte words (bytes past
// the last whole word padded with zeros); names, dtypes and shapes are hashed too, so a renamed or
// reshaped base differs even where its bytes agree.
std::string Booster::base_digest(const nn::Module& model) {
  uint64_t h = 0x9e3779b97f4a7c15ull;
  auto mix = [&h](uint64_t w) {
    h ^= w + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
  };
  auto bytes = [&](const void* data, size_t n) {
    const unsigned char* b = static_cast<const unsigned char*>(data);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t w;
      std::memcpy(&w, b + i, 8);
      mix(w);
    }
    uint64_t tail = 0;
    std::memcpy(&tail, b + i, n - i);
    mix(tail ^ (uint64_t(n) << 56));
  };
  for (const auto& [name, p] : model.named_parameters()) {
    if (p.requires_grad()) continue;
    materialize(p);
    const std::string head = name + "|" + dtype_name(p.dtype()) + "|" + str(p.shape());
    bytes(head.data(), head.size());
    const Tensor c = p.to(Device::cpu()).contiguous();
    bytes(c.data_ptr(), c.nbytes());
  }
  char out[17];
  std::snprintf(out, sizeof out, "%016llx", static_cast<unsigned long long>(h));
  return out;
}

// Note [save_pretrained through the plugin]: the plugin's checkpoint IO already knows how to make one
// process's file of a sharded or split model (it is what save_model writes), so the weights go through
// it into a scratch directory beside `dir`; rank 0 then builds an empty model of the same family from
// the user's model's Hugging Face config, loads the file into it and writes the directory. One path for
// every plugin, at the cost of writing the weights twice.
void Booster::save_pretrained(const std::filesystem::path& dir, const nn::SavePretrainedOptions& options) const {
  BOOSTER_CHECK(boosted_ && user_model_ && parts_.model, StateError,
                "save_pretrained: call boost() first; it saves the model boost() was given");
  const nlohmann::json hf_config = nn::hf_config_of(*user_model_);  // ConfigError for another kind of model
  const std::filesystem::path scratch = dir.string() + ".booster-weights";
  const bool writer = process_group_rank() == 0;
  if (writer) std::filesystem::remove_all(scratch);
  save_model(*parts_.model, scratch);  // collective: gathers shards and parts
  if (writer) {
    nn::ModulePtr whole;
    {
      LazyInitGuard lazy;  // every tensor is replaced by the file's
      whole = nn::model_from_hf_config(hf_config);
    }
    const checkpoint::TensorMap weights = checkpoint::load_model(scratch);
    whole->load_state_dict(weights);
    // The weights' own dtype when they are all one 16-bit type (a pure bf16 or fp16 model).
    std::optional<DType> dtype;
    for (const auto& [name, t] : weights)
      if (is_floating(t.dtype())) dtype = !dtype || *dtype == t.dtype() ? t.dtype() : DType::Float32;
    if (dtype && *dtype != DType::Float32) whole->to(*dtype);
    nn::save_pretrained(*whole, dir, options);
    std::filesystem::remove_all(scratch);
  }
  plugin_->process_group().barrier();
}
// Note [Precision state beside the optimizer]
// A strategy's state (loss scale and growth counters, float32 master weights) belongs with the
// optimizer's: resuming the optimizer without it would restart the scale at 2^16 and rebuild masters
// from rounded 16-bit weights. So save_optimizer also writes precision.json (with the strategy's name,
// so another strategy's checkpoint is refused) and precision.safetensors.
void Booster::save_optimizer(const BoostedOptimizer& optimizer, const std::filesystem::path& dir) const {
  optimizer.copy_options_to_stepped();  // the saved lr is the one the scheduler set
  checkpoint_io_->save_optimizer(optimizer.stepped_optimizer(), dir);
  const mixed_precision::MixedPrecisionState state = precision_->state_dict();
  if (splits_model()) checkpoint::write_safetensors(dir / rank_file("precision", ".safetensors"), state.tensors);
  if (process_group_rank() == 0) {
    if (!splits_model()) checkpoint::write_safetensors(dir / kPrecisionTensorsFile, state.tensors);
    const json meta = {{"strategy", precision_->name()}, {"state", state.meta}};
    checkpoint::write_text_file_atomically(dir / kPrecisionMetaFile, meta.dump(1) + "\n");
  }
  plugin_->process_group().barrier();
}

void Booster::load_optimizer(BoostedOptimizer& optimizer, const std::filesystem::path& dir, bool precision_state) const {
  const std::filesystem::path meta_file = dir / kPrecisionMetaFile;
  BOOSTER_CHECK(std::filesystem::exists(meta_file), CheckpointError, "load_optimizer: ", meta_file.string(),
                " does not exist; the directory must be one Booster::save_optimizer wrote");
  json meta;
  try {
    // Note [One JSON reader] (booster/common/json_text.h).
    meta = parse_json_text(checkpoint::read_text_file(meta_file), "load_optimizer: " + meta_file.string(),
                           checkpoint_limits());
  } catch (const JsonSyntaxError& e) {
    BOOSTER_FAIL(CheckpointError, "load_optimizer: ", meta_file.string(), " is not valid JSON (", e.detail(),
                 "); the file is truncated or corrupt");
  } catch (const ConfigError& e) {
    throw CheckpointError(e.what());
  }
  const std::string saved = meta.value("strategy", "");
  BOOSTER_CHECK(!precision_state || saved == precision_->name(), CheckpointError, "load_optimizer: ", dir.string(),
                " was saved with mixed precision '", saved, "' but this Booster uses '", precision_->name(),
                "'; resume with the same strategy");
  checkpoint_io_->load_optimizer(optimizer.stepped_optimizer(), dir);
  if (!precision_state) {
    optimizer.copy_options_from_stepped();
    return;
  }
  mixed_precision::MixedPrecisionState state;
  state.meta = meta.value("state", json::object());
  state.tensors =
      checkpoint::read_safetensors(dir / (splits_model() ? rank_file("precision", ".safetensors") : kPrecisionTensorsFile))
          .tensors;
  precision_->load_state_dict(state);
  optimizer.copy_options_from_stepped();
}
void Booster::save_lr_scheduler(const BoostedScheduler& scheduler, const std::filesystem::path& file) const {
  checkpoint_io_->save_lr_scheduler(const_cast<BoostedScheduler&>(scheduler).scheduler(), file);
}
void Booster::load_lr_scheduler(BoostedScheduler& scheduler, const std::filesystem::path& file) const {
  checkpoint_io_->load_lr_scheduler(scheduler.scheduler(), file);
}

}  // namespace booster
