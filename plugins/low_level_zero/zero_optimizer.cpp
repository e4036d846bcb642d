#include "zero_optimizer.h"

#include <cmath>
#include <cstdint>
#include <optional>
#include <set>

#include "booster/autograd/autograd.h"
#include "booster/ops/ops.h"
#include "booster/tensor/storage.h"
#include "booster/mixed_precision/master_weight_optimizer.h"

namespace booster::zero {

using distributed::ReduceOp;
using nlohmann::json;

namespace {

// Elements [start, start + length) of a contiguous tensor, as a 1-D view.
Tensor span(const Tensor& t, int64_t start, int64_t length) {
  return make_view(t, {length}, {1}, t.offset() + start);
}

Tensor zeroed(int64_t numel, DType dtype, Device device) { return zeros({numel}, dtype, device); }

// The one device of the parameters of `groups` (the CPU when there are none); DeviceError when they
// are spread over several.
Device device_of(const std::vector<optim::ParamGroup>& groups) {
  std::optional<Device> device;
  for (const optim::ParamGroup& g : groups)
    for (const Tensor& t : g.params) {
      BOOSTER_CHECK(!device || *device == t.device(), DeviceError, "low_level_zero: parameter '", t.name(),
                    "' is on ", t.device(), " but others are on ", *device, "; move the whole model to one device");
      device = t.device();
    }
  return device.value_or(Device::cpu());
}

// Calls f(j, lo, hi) for every parameter j that overlaps [begin, end) of the flat buffer, with the
// overlap [lo, hi) in flat-buffer elements.
template <class F>
void for_each_piece(const std::vector<int64_t>& offsets, int64_t begin, int64_t end, F&& f) {
  for (size_t j = 0; j + 1 < offsets.size(); ++j) {
    const int64_t lo = std::max(offsets[j], begin), hi = std::min(offsets[j + 1], end);
    if (lo < hi) f(j, lo, hi);
  }
}

bool parse_state_key(const std::string& key, size_t& index, std::string& name) {
  if (key.rfind("state.", 0) != 0) return false;
  const size_t dot = key.find('.', 6);
  if (dot == std::string::npos || dot == 6) return false;
  try {
    index = std::stoul(key.substr(6, dot - 6));
  } catch (...) {
    return false;
  }
  name = key.substr(dot + 1);
  return !name.empty();
}

using optim::kMasterWeight;

}  // namespace

ZeroOptimizer::ZeroOptimizer(const optim::Optimizer& original, nn::Module& model, distributed::ProcessGroup& group,
                             const ZeroOptions& options)
    : Optimizer(original.name(), original.defaults()),
      group_(group),
      options_(options),
      device_(device_of(original.param_groups())) {
  BOOSTER_CHECK(original.param_groups().empty() || device_ == group_.device(), DeviceError,
                "low_level_zero: the model is on ", device_, " but the process group (", group_.backend(),
                ") works on ", group_.device(), "; take the group of the model's device (process_group_for)");
  const int64_t world = group_.size();
  const DType dtype = options_.working_dtype;
  NoGradGuard no_grad;

  size_t index = 0;
  for (const optim::ParamGroup& g : original.param_groups()) {
    Partition p;
    p.params = g.params;
    p.first_index = index;
    index += g.params.size();
    p.offsets.assign(1, 0);
    for (const Tensor& t : g.params) {
      BOOSTER_CHECK(t.dtype() == DType::Float32, DTypeError, "low_level_zero: parameter '", t.name(), "' is ",
                    t.dtype(), "; build the optimizer over the float32 model (the plugin converts it to ", dtype,
                    " itself)");
      p.offsets.push_back(p.offsets.back() + t.numel());
    }
    p.numel = p.offsets.back();
    p.padded = (p.numel + world - 1) / world * world;
    p.shard = p.padded / world;
    parts_.push_back(std::move(p));
  }

  // 16-bit training: float32 masters of this rank's shard, taken before the model loses precision.
  if (dtype != DType::Float32) {
    for (Partition& p : parts_) {
      p.master = zeroed(p.shard, DType::Float32, device_);
      const int64_t begin = shard_offset(size_t(&p - parts_.data()));
      for_each_piece(p.offsets, begin, begin + p.shard, [&](size_t j, int64_t lo, int64_t hi) {
        span(p.master, lo - begin, hi - lo).copy_(span(p.params[j], lo - p.offsets[j], hi - lo));
      });
    }
    model.to(dtype);
  }

  // Bind each group's parameters into one padded buffer (as FlatBuffer binds, plus the padding the
  // shards need), and give each a gradient slot: stage 1 for the whole run, stage 2 per backward.
  for (size_t g = 0; g < parts_.size(); ++g) {
    Partition& p = parts_[g];
    p.flat_params = zeroed(p.padded, dtype, device_);
    if (options_.stage == 1) p.flat_grads = zeroed(p.padded, dtype, device_);
    for (size_t j = 0; j < p.params.size(); ++j) {
      Tensor& t = p.params[j];
      const Shape strides = contiguous_strides(t.shape());
      make_view(p.flat_params, t.shape(), strides, p.offsets[j]).copy_(t);
      TensorImpl* impl = t.impl();
      impl->storage = p.flat_params.storage();
      impl->strides = strides;
      impl->offset = p.offsets[j];
      t.bump_version();
      t.set_grad(Tensor());
      if (options_.stage == 1 && t.requires_grad())
        t.set_grad(make_view(p.flat_grads, t.shape(), strides, p.offsets[j]));
    }
    // Float32 training: the master is this rank's slice of the model's own buffer.
    if (dtype == DType::Float32) p.master = span(p.flat_params, shard_offset(g), p.shard);
    p.master.requires_grad_(true);
    p.master.set_grad(zeroed(p.shard, DType::Float32, device_));
  }

  // The inner optimizer binds the masters and their gradients where they are (nothing is copied).
  std::vector<optim::ParamGroup> master_groups, model_groups;
  for (size_t g = 0; g < parts_.size(); ++g) {
    master_groups.push_back({{parts_[g].master}, original.param_groups()[g].options});
    model_groups.push_back({parts_[g].params, original.param_groups()[g].options});
  }
  inner_ = mixed_precision::rebuild_optimizer(original, std::move(master_groups));
  if (options_.stage == 1) {
    // The base binds the model's parameters and the P-element gradient buffer (reused, not copied),
    // so zero_grad() clears it.
    add_groups(std::move(model_groups));
  } else {
    // No full gradient buffer may outlive a backward: the groups are kept for their options only.
    for (optim::ParamGroup& mg : model_groups) {
      mg.options = complete_options(mg.options);
      steps_.resize(steps_.size() + mg.params.size(), 0);
      groups_.push_back(std::move(mg));
      segments_.emplace_back();
    }
  }
  if (dtype == DType::Float16) scaler_.emplace(options_.scaler);

  if (bucketed()) {
    self_ = std::make_shared<ZeroOptimizer*>(this);
    for (size_t g = 0; g < parts_.size(); ++g) {
      Partition& p = parts_[g];
      p.bucket_of.assign(p.params.size(), 0);
      // Backward produces the last parameters' gradients first, so buckets are cut from the end.
      for (size_t j = p.params.size(); j-- > 0;) {
        if (p.buckets.empty() || p.buckets.back().end - p.buckets.back().begin >= options_.bucket_numel) {
          Partition::Bucket b;
          b.end = p.offsets[j + 1];
          b.last = j;
          p.buckets.push_back(std::move(b));
        }
        Partition::Bucket& b = p.buckets.back();
        b.first = j;
        b.begin = p.offsets[j];
        p.bucket_of[j] = p.buckets.size() - 1;
      }
      p.hook_index.assign(p.params.size(), SIZE_MAX);
      for (size_t j = 0; j < p.params.size(); ++j) {
        if (!p.params[j].requires_grad()) continue;
        std::weak_ptr<ZeroOptimizer*> self = self_;
        p.params[j].register_grad_ready_hook([self, g, j](Tensor&) {
          if (auto alive = self.lock()) (*alive)->on_grad_ready(g, j);
        });
        p.hook_index[j] = p.params[j].impl()->grad_ready_hooks.size() - 1;
      }
    }
  }
}

// The hooks are code of this plugin library; the model may outlive both the optimizer and the
// library (Note [Plugin lifetime]), so they leave with the optimizer. Nothing else removes hooks, so
// ours are still where we put them.
ZeroOptimizer::~ZeroOptimizer() {
  for (Partition& p : parts_)
    for (size_t j = 0; j < p.hook_index.size(); ++j) {
      std::vector<GradReadyHook>& hooks = p.params[j].impl()->grad_ready_hooks;
      if (p.hook_index[j] < hooks.size()) hooks.erase(hooks.begin() + std::ptrdiff_t(p.hook_index[j]));
    }
}

Tensor ZeroOptimizer::shard_of(const Tensor& flat, const Partition& p) const {
  return span(flat, int64_t(group_.rank()) * p.shard, p.shard);
}

// ------------------------------------------------------------------------------------------ backward

void ZeroOptimizer::prepare_backward() {
  if (options_.stage != 2) return;
  if (bucketed()) {
    for (Partition& p : parts_) {
      for (const Tensor& t : p.params) t.set_grad(Tensor());  // autograd allocates each as it comes
      for (Partition::Bucket& b : p.buckets) {
        b.waiting = 0;
        for (size_t j = b.first; j <= b.last; ++j) b.waiting += p.params[j].requires_grad();
        b.buffer = Tensor();
        b.work = nullptr;
      }
    }
    in_backward_ = true;
    return;
  }
  for (Partition& p : parts_) {
    if (p.flat_grads.defined()) continue;
    p.flat_grads = zeroed(p.padded, options_.working_dtype, device_);
    for (size_t j = 0; j < p.params.size(); ++j) {
      const Tensor& t = p.params[j];
      if (t.requires_grad())
        t.set_grad(make_view(p.flat_grads, t.shape(), contiguous_strides(t.shape()), p.offsets[j]));
    }
  }
}

void ZeroOptimizer::finish_backward() {
  if (!sync_enabled_) {
    unreduced_ = true;  // stage 1: the local sum waits in the gradient buffer
    return;
  }
  reduce_pending();
}

void ZeroOptimizer::reduce_pending() {
  if (options_.stage == 1) {
    // Gradients that backward created outside the buffer (after a module's zero_grad set them to
    // None) are copied in first.
    for (auto& segs : segments_)
      for (Segment& seg : segs) seg.flat.sync_grads();
  }
  // The buffer holds what backward added since the last reduction (stage 1 clears it once reduced,
  // stage 2 makes it per backward), so a second reduction before step() adds into the shard.
  const bool accumulate = have_grads_;
  bool found = false;
  for (Partition& p : parts_) {
    if (bucketed()) {
      found |= reduce_buckets(p, accumulate);
      continue;
    }
    if (!p.flat_grads.defined()) continue;  // stage 2 without prepare_backward(): nothing arrived
    found |= reduce_partition(p, accumulate);
    if (options_.stage == 2) {
      for (const Tensor& t : p.params) t.set_grad(Tensor());
      p.flat_grads = Tensor();  // the full-size buffer goes back to the allocator now
    } else {
      p.flat_grads.fill_(0.0);  // consumed by the reduction (divided in place); the next backward adds from zero
    }
  }
  in_backward_ = false;
  local_found_inf_ = accumulate ? (local_found_inf_ || found) : found;
  have_grads_ = true;
  unreduced_ = false;
  agreed_ = false;
  clipped_ = false;
}

// The buffer is scratch once reduced (stage 2 frees it, stage 1 clears it), so the reduce-scatter may
// divide it in place before summing (Note [Averages divide first]).
bool ZeroOptimizer::reduce_partition(Partition& p, bool accumulate) {
  Tensor grad = p.master.grad();
  bool found = false;
  if (options_.working_dtype == DType::Float32) {
    // Unscaled and never skipped: the reduction lands in the master gradient itself.
    if (!accumulate) {
      group_.reduce_scatter_consuming(grad, p.flat_grads, ReduceOp::Avg);
    } else {
      Tensor part = Tensor::empty({p.shard}, DType::Float32, device_);
      group_.reduce_scatter_consuming(part, p.flat_grads, ReduceOp::Avg);
      grad.add_(part);
    }
  } else {
    Tensor part = Tensor::empty({p.shard}, options_.working_dtype, device_);
    group_.reduce_scatter_consuming(part, p.flat_grads, ReduceOp::Avg);
    const float inv_scale = float(1.0 / loss_scale());
    if (!accumulate) {
      found = mixed_precision::fused_unscale_and_check({{part, grad}}, inv_scale);
    } else {
      Tensor wide = Tensor::empty({p.shard}, DType::Float32, device_);
      found = mixed_precision::fused_unscale_and_check({{part, wide}}, inv_scale);
      grad.add_(wide);
    }
  }
  grad.bump_version();  // raw writes: the inner optimizer sees the gradient as arrived
  return found;
}

// Note [ZeRO-2 buckets]
// Stage 2 must not hold a full-size gradient buffer (that is stage 1). With overlap, no parameter has
// a gradient slot when backward starts: autograd allocates each parameter's gradient as it produces
// it, and the grad-ready hook copies it into its bucket (adjacent whole parameters, about
// bucket_numel elements, cut from the end of the flat buffer because backward runs from the last
// layer) and frees it. When a bucket's last gradient arrives, its all-reduce (Avg) starts while
// backward goes on; after backward each rank waits for the buckets and unscales the part of each that
// lies in its shard into master.grad(), then drops the bucket. So a rank holds the gradients of the
// buckets in flight, not of the model. A bucket is all-reduced rather than reduce-scattered because
// its elements belong to the shards of one or two ranks, not to every rank in equal parts; that
// moves twice the bytes of the one reduce-scatter the non-overlapped path makes after backward.
// Buckets whose gradients did not all arrive (unused parameters) are reduced after backward in
// bucket order; as with torch's DDP, every rank must use the same parameters in the same order.
void ZeroOptimizer::on_grad_ready(size_t g, size_t j) {
  if (!in_backward_) return;  // a backward not driven through the strategy (no_sync is stage 1 only)
  Partition& p = parts_[g];
  Partition::Bucket& b = p.buckets[p.bucket_of[j]];
  const Tensor& t = p.params[j];
  const Tensor grad = t.grad();
  if (!grad.defined() || b.work) return;
  if (!b.buffer.defined()) b.buffer = zeroed(b.end - b.begin, options_.working_dtype, device_);
  span(b.buffer, p.offsets[j] - b.begin, t.numel()).copy_(grad.reshape({-1}));
  t.set_grad(Tensor());
  if (--b.waiting == 0) b.work = group_.all_reduce_async(distributed::BufferSpan::of(b.buffer), ReduceOp::Avg);
}

bool ZeroOptimizer::reduce_buckets(Partition& p, bool accumulate) {
  const DType dtype = options_.working_dtype;
  for (Partition::Bucket& b : p.buckets) {
    if (b.work) continue;
    if (!b.buffer.defined()) b.buffer = zeroed(b.end - b.begin, dtype, device_);
    for (size_t j = b.first; j <= b.last; ++j) {  // gradients set outside backward's hooks
      const Tensor& t = p.params[j];
      if (!t.grad().defined()) continue;
      span(b.buffer, p.offsets[j] - b.begin, t.numel()).add_(t.grad().reshape({-1}));
      t.set_grad(Tensor());
    }
    b.work = group_.all_reduce_async(distributed::BufferSpan::of(b.buffer), ReduceOp::Avg);
  }
  Tensor grad = p.master.grad();
  Tensor dst = accumulate ? zeroed(p.shard, DType::Float32, device_) : grad;
  const int64_t begin = int64_t(group_.rank()) * p.shard, end = begin + p.shard;
  std::vector<mixed_precision::GradSpan> spans;
  for (Partition::Bucket& b : p.buckets) {
    b.work->wait();
    const int64_t lo = std::max(b.begin, begin), hi = std::min(b.end, end);
    if (lo < hi) spans.push_back({span(b.buffer, lo - b.begin, hi - lo), span(dst, lo - begin, hi - lo)});
  }
  const float inv_scale = dtype == DType::Float32 ? 1.0f : float(1.0 / loss_scale());
  const bool found = mixed_precision::fused_unscale_and_check(spans, inv_scale);
  if (accumulate) grad.add_(dst);
  grad.bump_version();
  for (Partition::Bucket& b : p.buckets) {
    b.buffer = Tensor();
    b.work = nullptr;
  }
  return found;
}

void ZeroOptimizer::set_gradient_sync(bool enabled) {
  BOOSTER_CHECK(enabled || options_.stage == 1, IncompatibleError,
                "low_level_zero: stage 2 cannot turn gradient synchronisation off (no_sync): it keeps "
                "gradients only for this rank's shard, so there is no full buffer to accumulate a local sum "
                "in; use stage 1 for no_sync, or run synced backwards (each adds into the shard)");
  sync_enabled_ = enabled;
}

// ---------------------------------------------------------------------------------------------- step

bool ZeroOptimizer::agreed_found_inf() {
  if (!scaler_) return false;  // bfloat16 and float32 train unscaled and never skip, as ColossalAI
  if (!agreed_) {
    // Note [Agreeing on found_inf]: an inf in one rank's shard must make every rank skip.
    Tensor flag = full({1}, local_found_inf_ ? 1.0 : 0.0, DType::Float32, device_);
    group_.all_reduce(flag, ReduceOp::Max);
    // On a GPU item() copies through the allocator, which synchronizes the stream the all-reduce was
    // queued on (Note [When a collective's result is there]); every host read here goes that way.
    found_inf_ = flag.item() != 0.0;
    agreed_ = true;
  }
  return found_inf_;
}

double ZeroOptimizer::clip_grad_norm(double max_norm) {
  BOOSTER_CHECK(max_norm > 0.0, ValueError, "low_level_zero: clip_grad_norm: max_norm must be > 0, got ", max_norm);
  if (unreduced_) reduce_pending();
  if (agreed_found_inf()) {
    grad_norm_ = std::numeric_limits<double>::infinity();
    clipped_ = true;
    return grad_norm_;
  }
  std::vector<Tensor> grads;
  for (Partition& p : parts_) grads.push_back(p.master.grad());
  // The shards partition the gradient (padding is zero), so the squared norms add up.
  const double local = mixed_precision::grad_norm_l2(grads);
  Tensor sum_of_squares = full({1}, local * local, DType::Float64, device_);
  group_.all_reduce(sum_of_squares, ReduceOp::Sum);
  const double norm = std::sqrt(sum_of_squares.item());
  const double coef = max_norm / (norm + 1e-6);  // torch.nn.utils.clip_grad_norm_
  if (std::isfinite(norm) && coef < 1.0) mixed_precision::scale_grads(grads, float(coef));
  grad_norm_ = norm;
  clipped_ = true;
  return norm;
}

void ZeroOptimizer::forward_options() const {
  for (size_t g = 0; g < groups_.size(); ++g) inner_->param_groups()[g].options = groups_[g].options;
}

void ZeroOptimizer::step() {
  if (unreduced_) reduce_pending();
  if (!have_grads_) {  // no backward since the last step: nothing to update (on every rank alike)
    stats_ = {};
    stats_.loss_scale = loss_scale();
    return;
  }
  const double scale_used = loss_scale();
  const bool skip = agreed_found_inf();
  if (options_.max_norm > 0.0 && !clipped_) clip_grad_norm(options_.max_norm);
  if (!skip) {
    forward_options();
    inner_->step();
    for (Partition& p : parts_) {
      Tensor mine = shard_of(p.flat_params, p);
      if (options_.working_dtype != DType::Float32) mine.copy_(p.master);  // round to the working dtype
      group_.all_gather(p.flat_params, mine);
      for (const Tensor& t : p.params) t.bump_version();
    }
  }
  inner_->zero_grad();
  stats_ = {};
  stats_.loss_scale = scale_used;
  stats_.skipped = skip;
  stats_.grad_norm = grad_norm_;
  end_step();
  if (scaler_) scaler_->update(skip);  // may throw TrainingError at the scale's floor
}

void ZeroOptimizer::zero_grad(bool set_to_none) {
  optim::Optimizer::zero_grad(set_to_none);
  inner_->zero_grad(set_to_none);
  unreduced_ = false;
  end_step();
}

void ZeroOptimizer::end_step() {
  have_grads_ = false;
  local_found_inf_ = false;
  agreed_ = false;
  found_inf_ = false;
  clipped_ = false;
  grad_norm_ = std::numeric_limits<double>::quiet_NaN();
}

json ZeroOptimizer::scaler_state() const { return scaler_ ? scaler_->state_dict() : json::object(); }

void ZeroOptimizer::load_scaler_state(const json& state) {
  if (scaler_ && state.is_object() && !state.empty()) scaler_->load_state_dict(state);
}

// --------------------------------------------------------------------------------------- checkpoints

optim::OptimizerState ZeroOptimizer::state_dict() const {
  forward_options();
  const optim::OptimizerState shards = inner_->state_dict();  // this rank's shards, keyed by group
  optim::OptimizerState out;
  out.meta["type"] = inner_->name();
  out.meta["state"] = json::object();
  json groups = json::array();

  // Gathers one shard-sized float32 tensor of every rank into the full buffer and splits it into
  // per-parameter tensors named state.<i>.<name>.
  auto gather = [&](const Partition& p, const Tensor& shard, const std::string& name) {
    Tensor full = Tensor::empty({p.padded}, shard.dtype(), device_);
    group_.all_gather(full, shard);
    for (size_t j = 0; j < p.params.size(); ++j) {
      const Shape& shape = p.params[j].shape();
      out.tensors["state." + std::to_string(p.first_index + j) + "." + name] =
          make_view(full, shape, contiguous_strides(shape), p.offsets[j]);
    }
  };

  for (size_t g = 0; g < parts_.size(); ++g) {
    const Partition& p = parts_[g];
    json o = groups_[g].options;
    json ids = json::array();
    for (size_t j = 0; j < p.params.size(); ++j) ids.push_back(p.first_index + j);
    o["params"] = ids;
    groups.push_back(o);

    const std::string key = std::to_string(g);
    const json& state = shards.meta.at("state");
    const int64_t step = state.contains(key) ? state.at(key).value("step", int64_t(0)) : 0;
    if (step > 0) {
      for (size_t j = 0; j < p.params.size(); ++j)
        out.meta["state"][std::to_string(p.first_index + j)] = {{"step", step}};
      // The map is sorted, so every rank gathers the same names in the same order.
      const std::string prefix = "state." + key + ".";
      for (const auto& [k, t] : shards.tensors)
        if (k.rfind(prefix, 0) == 0) gather(p, t.contiguous(), k.substr(prefix.size()));
    }
    if (options_.working_dtype != DType::Float32) gather(p, p.master, kMasterWeight);
  }
  out.meta["param_groups"] = groups;
  out.meta["zero"] = {{"stage", options_.stage},
                      {"precision", dtype_name(options_.working_dtype)},
                      {"world_size", group_.size()}};
  return out;
}

void ZeroOptimizer::load_state_dict(const optim::OptimizerState& state) {
  const json& meta = state.meta;
  const std::string type = inner_->name();
  BOOSTER_CHECK(meta.is_object() && meta.contains("param_groups") && meta.at("param_groups").is_array(),
                CheckpointError, "low_level_zero: optimizer state has no 'param_groups' list");
  if (meta.contains("type"))
    BOOSTER_CHECK(meta.at("type") == type, CheckpointError, "low_level_zero: optimizer state was saved by ",
                  meta.at("type").dump(), ", not ", type);
  const json& saved_groups = meta.at("param_groups");
  BOOSTER_CHECK(saved_groups.size() == parts_.size(), CheckpointError, "low_level_zero: optimizer state has ",
                saved_groups.size(), " parameter groups, this optimizer ", parts_.size());
  const json empty = json::object();
  const json& saved_state = meta.contains("state") ? meta.at("state") : empty;

  // Names of the saved tensors per parameter index.
  std::map<size_t, std::set<std::string>> names_of;
  for (const auto& [key, t] : state.tensors) {
    size_t i = 0;
    std::string name;
    BOOSTER_CHECK(parse_state_key(key, i, name), CheckpointError, "low_level_zero: unexpected key '", key,
                  "' in the optimizer state (expected state.<index>.<name>)");
    names_of[i].insert(name);
  }

  optim::OptimizerState inner_state;
  inner_state.meta["type"] = type;
  inner_state.meta["state"] = json::object();
  json inner_groups = json::array();
  NoGradGuard no_grad;
  std::vector<Tensor> master_shards(parts_.size());
  for (size_t g = 0; g < parts_.size(); ++g) {
    Partition& p = parts_[g];
    const json& sg = saved_groups[g];
    BOOSTER_CHECK(sg.is_object() && sg.contains("params") && sg.at("params").size() == p.params.size(),
                  CheckpointError, "low_level_zero: parameter group ", g, " of the optimizer state does not have ",
                  p.params.size(), " parameters");
    json o = sg;
    o["params"] = json::array({g});
    inner_groups.push_back(o);

    // ZeRO steps a group as one shard: every parameter must have taken the same number of steps.
    int64_t step = -1;
    for (size_t j = 0; j < p.params.size(); ++j) {
      const std::string key = std::to_string(p.first_index + j);
      const int64_t s = saved_state.contains(key) ? saved_state.at(key).value("step", int64_t(0)) : 0;
      BOOSTER_CHECK(step < 0 || s == step, CheckpointError, "low_level_zero: parameters of group ", g,
                    " took different numbers of steps (", step, " and ", s, " for parameter ", key,
                    "); ZeRO steps all parameters of a group together");
      step = s;
    }
    if (step > 0) inner_state.meta["state"][std::to_string(g)] = {{"step", step}};

    // Every parameter of the group must carry the same state names (checked below).
    std::set<std::string> names;
    for (size_t j = 0; j < p.params.size(); ++j) names.merge(std::set<std::string>(names_of[p.first_index + j]));
    const int64_t begin = shard_offset(g);
    for (const std::string& name : names) {
      Tensor shard = zeroed(p.shard, DType::Float32, device_);
      for (size_t j = 0; j < p.params.size(); ++j) {
        const std::string key = "state." + std::to_string(p.first_index + j) + "." + name;
        auto it = state.tensors.find(key);
        BOOSTER_CHECK(it != state.tensors.end(), CheckpointError, "low_level_zero: optimizer state has no '", key,
                      "' although other parameters of group ", g, " have '", name,
                      "'; ZeRO keeps one state per group, so every parameter needs it");
        BOOSTER_CHECK(it->second.numel() == p.params[j].numel(), CheckpointError, "low_level_zero: '", key,
                      "' has shape ", it->second.shape(), " but the parameter has shape ", p.params[j].shape());
      }
      for_each_piece(p.offsets, begin, begin + p.shard, [&](size_t j, int64_t lo, int64_t hi) {
        const Tensor src = state.tensors.at("state." + std::to_string(p.first_index + j) + "." + name).contiguous();
        span(shard, lo - begin, hi - lo).copy_(span(src, lo - p.offsets[j], hi - lo));
      });
      if (name == kMasterWeight) {
        master_shards[g] = shard;
      } else {
        inner_state.tensors["state." + std::to_string(g) + "." + name] = shard;
      }
    }
  }
  inner_state.meta["param_groups"] = inner_groups;
  inner_->load_state_dict(inner_state);  // validates names and options; nothing changes on error

  for (size_t g = 0; g < parts_.size(); ++g) {
    Partition& p = parts_[g];
    groups_[g].options = inner_->param_groups()[g].options;
    if (master_shards[g].defined()) {
      // The true weights: every rank reads all of them, so the model is set without communication.
      for (size_t j = 0; j < p.params.size(); ++j) {
        Tensor t = p.params[j];
        t.copy_(state.tensors.at("state." + std::to_string(p.first_index + j) + "." + kMasterWeight).reshape(t.shape()));
      }
    }
    if (options_.working_dtype != DType::Float32) {
      // Without saved masters (a float32 or unsharded checkpoint) they come from the model.
      if (master_shards[g].defined()) p.master.copy_(master_shards[g]);
      else p.master.copy_(shard_of(p.flat_params, p));
    }
    for (const Tensor& t : p.params) t.bump_version();
  }
}

}  // namespace booster::zero
