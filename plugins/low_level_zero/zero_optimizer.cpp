#include "zero_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>

#include "booster/autograd/autograd.h"
#include "booster/ops/ops.h"
#include "booster/tensor/deferred.h"
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


using optim::kMasterWeight;
using optim::parse_state_key;

}  // namespace

ZeroOptimizer::ZeroOptimizer(const optim::Optimizer& original, const nn::ModulePtr& model_ptr,
                             distributed::ProcessGroup& group,
                             const ZeroOptions& options)
    : Optimizer(original.name(), original.defaults()),
      group_(group),
      options_(options),
      device_(device_of(original.param_groups())) {
  BOOSTER_CHECK(model_ptr != nullptr, ValueError, "low_level_zero: the model is null");
  nn::Module& model = *model_ptr;
  BOOSTER_CHECK(original.param_groups().empty() || device_ == group_.device(), DeviceError,
                "low_level_zero: the model is on ", device_, " but the process group (", group_.backend(),
                ") works on ", group_.device(), "; take the group of the model's device (process_group_for)");
  const int64_t world = group_.size();
  const DType dtype = options_.working_dtype;
  NoGradGuard no_grad;

  size_t index = 0;
  for (const optim::ParamGroup& g : original.param_groups()) {
    std::vector<size_t> ids;
    for (const Tensor& t : g.params) {
      BOOSTER_CHECK(t.dtype() == DType::Float32, DTypeError, "low_level_zero: parameter '", t.name(), "' is ",
                    t.dtype(), "; build the optimizer over the float32 model (the plugin converts it to ", dtype,
                    " itself)");
      ids.push_back(index++);
    }
    group_params_.push_back(std::move(ids));
  }
  if (options_.stage == 3) partition_by_module(original, model_ptr);
  else partition_by_group(original);
  for (Partition& p : parts_) {
    p.offsets.assign(1, 0);
    for (const Tensor& t : p.params) p.offsets.push_back(p.offsets.back() + t.numel());
    p.numel = p.offsets.back();
    p.padded = (p.numel + world - 1) / world * world;
    p.shard = p.padded / world;
  }

  if (options_.stage == 3) {
    bind_stage3_shards();  // Note [ZeRO-3 shards from the parameters]
    if (dtype != DType::Float32) model.to(dtype);  // what stays whole: buffers, parameters not trained
  } else if (dtype != DType::Float32) {
    // 16-bit training: float32 masters of this rank's shard, taken before the model loses precision.
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
    if (options_.stage == 3) {
      // The shard's gradient exists only from a reduction to the step (release_shard_grads): made
      // released, it takes no memory before the first backward either.
      Tensor grad;
      {
        LazyInitGuard lazy;
        grad = Tensor::empty({p.shard}, DType::Float32, device_);
      }
      grad.storage()->release();
      p.master.requires_grad_(true);
      p.master.set_grad(grad);
      continue;
    }
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
    if (dtype == DType::Float32) {
      // Float32 training: the master is this rank's slice of the model's own buffer.
      p.master = span(p.flat_params, shard_offset(g), p.shard);
    }
    p.master.requires_grad_(true);
    p.master.set_grad(zeroed(p.shard, DType::Float32, device_));
  }

  // The inner optimizer binds the masters and their gradients where they are (nothing is copied):
  // one parameter per partition, with its group's options.
  std::vector<optim::ParamGroup> master_groups, model_groups;
  for (const Partition& p : parts_) master_groups.push_back({{p.master}, original.param_groups()[p.group].options});
  for (const optim::ParamGroup& g : original.param_groups()) model_groups.push_back({g.params, g.options});
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

  if (options_.stage == 3) {
    self_ = std::make_shared<ZeroOptimizer*>(this);
    for (size_t u = 0; u < units_.size(); ++u) {
      std::weak_ptr<ZeroOptimizer*> self = self_;
      Unit& unit = units_[u];
      unit.pre_hook = unit.module->register_forward_pre_hook([self, u](nn::Module&, const Tensor&) {
        if (auto alive = self.lock()) (*alive)->unit_forward_begin(u);
      });
      unit.post_hook = unit.module->register_forward_hook([self, u](nn::Module&, const Tensor&, const Tensor& out) {
        auto alive = self.lock();
        return alive ? (*alive)->unit_forward_end(u, out) : Tensor();
      });
    }
    for (size_t k = 0; k < parts_.size(); ++k) {
      Partition& p = parts_[k];
      p.hook_index.assign(p.params.size(), SIZE_MAX);
      for (size_t j = 0; j < p.params.size(); ++j) {
        if (!p.params[j].requires_grad()) continue;
        std::weak_ptr<ZeroOptimizer*> self = self_;
        p.params[j].register_grad_ready_hook([self, k](Tensor&) {
          if (auto alive = self.lock()) (*alive)->on_grad_ready_stage3(k);
        });
        p.hook_index[j] = p.params[j].impl()->grad_ready_hooks.size() - 1;
      }
    }
  }

  if (options_.stage == 3) release_shard_grads();

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
  for (Unit& unit : units_) {
    if (const nn::ModulePtr alive = unit.owner.lock()) {
      alive->remove_forward_hook(unit.pre_hook);
      alive->remove_forward_hook(unit.post_hook);
    }
  }
  for (Partition& p : parts_)
    for (size_t j = 0; j < p.hook_index.size(); ++j) {
      std::vector<GradReadyHook>& hooks = p.params[j].impl()->grad_ready_hooks;
      if (p.hook_index[j] < hooks.size()) hooks.erase(hooks.begin() + std::ptrdiff_t(p.hook_index[j]));
    }
}

void ZeroOptimizer::partition_by_group(const optim::Optimizer& original) {
  for (size_t g = 0; g < original.param_groups().size(); ++g) {
    Partition p;
    p.params = original.param_groups()[g].params;
    p.group = g;
    p.index = group_params_[g];
    parts_.push_back(std::move(p));
  }
}

// Note [ZeRO-3: parameters by module]: a partition per module (pre-order, which is the order most
// models run them) and per group, of the module's own parameters.
void ZeroOptimizer::partition_by_module(const optim::Optimizer& original, const nn::ModulePtr& model) {
  std::map<const TensorImpl*, std::pair<size_t, size_t>> where;  // parameter -> (group, global index)
  for (size_t g = 0; g < original.param_groups().size(); ++g)
    for (size_t j = 0; j < original.param_groups()[g].params.size(); ++j)
      where[original.param_groups()[g].params[j].impl()] = {g, group_params_[g][j]};
  std::map<const TensorImpl*, size_t> owned;  // parameter -> its partition, once a module took it
  std::function<void(const nn::ModulePtr&)> visit = [&](const nn::ModulePtr& owner) {
    nn::Module& m = *owner;
    std::map<size_t, Partition> by_group;
    std::set<size_t> shared;  // partitions of parameters an earlier module owns (tied weights)
    for (const auto& [name, t] : m.named_parameters(/*recurse=*/false)) {
      if (auto o = owned.find(t.impl()); o != owned.end()) {
        shared.insert(o->second);
        continue;
      }
      auto it = where.find(t.impl());
      if (it == where.end()) continue;  // not trained: stays whole on every rank
      Partition& p = by_group[it->second.first];
      p.group = it->second.first;
      p.params.push_back(t);
      p.index.push_back(it->second.second);
      where.erase(it);
    }
    if (!by_group.empty() || !shared.empty()) {
      Unit unit;
      unit.module = &m;
      unit.owner = owner;
      for (auto& [g, p] : by_group) {
        for (const Tensor& t : p.params) owned[t.impl()] = parts_.size();
        unit.parts.push_back(parts_.size());
        parts_.push_back(std::move(p));
      }
      unit.parts.insert(unit.parts.end(), shared.begin(), shared.end());
      std::sort(unit.parts.begin(), unit.parts.end());
      units_.push_back(std::move(unit));
    }
    for (const nn::ModulePtr& child : m.children()) visit(child);
  };
  visit(model);
  // Note [ZeRO-3: tied parameters]
  for (size_t u = 0; u < units_.size(); ++u)
    for (size_t k : units_[u].parts) parts_[k].last_user = u;
  BOOSTER_CHECK(where.empty(), ValueError, "low_level_zero: stage 3 shards parameters by the module that owns them, "
                "but the optimizer has ", where.size(), " parameter(s) that are not the model's (the first is '",
                where.begin()->first ? where.begin()->first->name : std::string("?"),
                "'); build the optimizer over model->parameters()");
}

Tensor ZeroOptimizer::shard_of(const Tensor& flat, const Partition& p) const {
  return span(flat, int64_t(group_.rank()) * p.shard, p.shard);
}

// ------------------------------------------------------------------------------------------ backward

void ZeroOptimizer::prepare_backward() {
  if (options_.stage == 3) {
    for (Partition& p : parts_) {
      p.waiting = 0;
      for (const Tensor& t : p.params) {
        t.set_grad(Tensor());  // autograd allocates each as it comes; the hook takes it
        p.waiting += t.requires_grad();
      }
      p.reduced = false;
    }
    backward_found_ = false;
    in_backward_ = true;
    return;
  }
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
    bind_deferred();  // Note [Deferred binding]
    for (auto& segs : segments_)
      for (Segment& seg : segs) seg.flat.sync_grads();
  }
  // The buffer holds what backward added since the last reduction (stage 1 clears it once reduced,
  // stage 2 makes it per backward), so a second reduction before step() adds into the shard.
  const bool accumulate = have_grads_;
  bool found = false;
  if (options_.stage == 3) {
    // Partitions whose gradients did not all arrive (unused parameters) are reduced now, in order.
    for (size_t k = 0; k < parts_.size(); ++k)
      if (!parts_[k].reduced) reduce_unit_partition(k);
    found = backward_found_;
    release_all();
  }
  for (Partition& p : parts_) {
    if (options_.stage == 3) break;
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
  // Stage 3 holds the shard's gradient from its first reduction to the step only; the first one of a
  // step (accumulate false) writes every element.
  if (options_.stage == 3) grad.storage()->materialize();
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
  BOOSTER_CHECK(enabled || options_.stage == 1, IncompatibleError, "low_level_zero: stage ", options_.stage,
                " cannot turn gradient synchronisation off (no_sync): it keeps "
                "gradients only for this rank's shard, so there is no full buffer to accumulate a local sum "
                "in; use stage 1 for no_sync, or run synced backwards (each adds into the shard)");
  sync_enabled_ = enabled;
}

// ------------------------------------------------------------------------------------------- stage 3

// Note [ZeRO-3 shards from the parameters]
// At rest a rank holds its shard of each partition only (Note [ZeRO-3: parameters by module]). The
// shard is copied piece by piece from the parameters it spans (copy_span), into the float32 master and
// the working-dtype shard, and the parameters become views of the partition's flat buffer, released:
// the full buffer is never allocated here. A parameter still deferred (take_deferred_parameters: a
// model built under a LazyInitGuard, or a pretrained model whose weights wait in their files) is read
// only where it overlaps this rank's shard, so no rank ever holds the whole model, not even while
// boosting. The values are bit for bit those of the eager path: the master takes the float32 values,
// the shard their rounding to the working dtype, as model.to(dtype) would round them.
void ZeroOptimizer::bind_stage3_shards() {
  const DType dtype = options_.working_dtype;
  for (size_t k = 0; k < parts_.size(); ++k) {
    Partition& p = parts_[k];
    const int64_t begin = shard_offset(k);
    p.master = zeroed(p.shard, DType::Float32, device_);  // the padding past the last parameter stays 0
    for_each_piece(p.offsets, begin, begin + p.shard, [&](size_t j, int64_t lo, int64_t hi) {
      copy_span(p.params[j], lo - p.offsets[j], span(p.master, lo - begin, hi - lo));
    });
    if (dtype == DType::Float32) {
      p.shard_params = p.master;
    } else {
      p.shard_params = Tensor::empty({p.shard}, dtype, device_);
      p.shard_params.copy_(p.master);
    }
    {
      LazyInitGuard lazy;  // no memory until the first gather
      p.flat_params = Tensor::empty({p.padded}, dtype, device_);
    }
    p.flat_params.storage()->release();
    for (size_t j = 0; j < p.params.size(); ++j) {
      Tensor& t = p.params[j];
      TensorImpl* impl = t.impl();
      impl->storage = p.flat_params.storage();  // the whole parameter (or its record) is dropped here
      impl->strides = contiguous_strides(t.shape());
      impl->offset = p.offsets[j];
      impl->dtype = dtype;
      t.bump_version();
      t.set_grad(Tensor());
    }
  }
}

// Note [ZeRO-3: parameters by module]
void ZeroOptimizer::gather(size_t k, bool async) {
  Partition& p = parts_[k];
  if (p.gathered) {
    if (!async && p.gather_work) {
      p.gather_work->wait();
      p.gather_work = nullptr;
    }
    return;
  }
  p.flat_params.storage()->materialize();
  if (async) p.gather_work = group_.all_gather_async(p.flat_params, p.shard_params);
  else group_.all_gather(p.flat_params, p.shard_params);
  p.gathered = true;
  for (const Tensor& t : p.params) t.bump_version();
}

void ZeroOptimizer::release(size_t k) {
  Partition& p = parts_[k];
  if (!p.gathered) return;
  if (p.gather_work) {
    p.gather_work->wait();
    p.gather_work = nullptr;
  }
  p.flat_params.storage()->release();
  p.gathered = false;
}

void ZeroOptimizer::gather_all() {
  if (options_.stage != 3) return;
  for (size_t k = 0; k < parts_.size(); ++k) gather(k, /*async=*/true);
  for (size_t k = 0; k < parts_.size(); ++k) gather(k, /*async=*/false);
}

void ZeroOptimizer::release_all() {
  if (options_.stage != 3) return;
  for (size_t k = 0; k < parts_.size(); ++k) release(k);
}

void ZeroOptimizer::take_shards_from_parameters() {
  if (options_.stage != 3) return;
  NoGradGuard no_grad;
  for (Partition& p : parts_) {
    BOOSTER_CHECK(p.gathered, StateError, "low_level_zero: take_shards_from_parameters needs gathered parameters");
    p.shard_params.copy_(shard_of(p.flat_params, p));
    if (options_.working_dtype != DType::Float32) p.master.copy_(p.shard_params);
  }
}

// Starts the all-gather of unit u's partitions (none past the last unit), except those whose
// gradients this backward already reduced: their module is done.
void ZeroOptimizer::prefetch(size_t u) {
  if (u >= units_.size()) return;
  for (size_t k : units_[u].parts)
    if (!(in_backward_ && parts_[k].reduced)) gather(k, /*async=*/true);
}

void ZeroOptimizer::unit_forward_begin(size_t u) {
  for (size_t k : units_[u].parts) gather(k, /*async=*/false);
  prefetch(u + 1);  // the next module's parameters travel while this one computes
}

// Note [ZeRO-3: tied parameters]: a partition that a later module reads too (a tied lm_head) stays
// gathered until its last reader in pre-order has run.
Tensor ZeroOptimizer::unit_forward_end(size_t u, const Tensor& out) {
  for (size_t k : units_[u].parts)
    if (parts_[k].last_user <= u) release(k);
  if (!autograd::grad_mode_enabled() || !out.defined() || !out.requires_grad()) return Tensor();
  // Its backward needs the parameters again: an identity node on the output gathers them first.
  Tensor watched = out.detach();
  std::weak_ptr<ZeroOptimizer*> self = self_;
  autograd::record(watched, "ZeroGatherBackward", {out}, [self, u](const Tensor& g) {
    if (auto alive = self.lock()) (*alive)->unit_backward_begin(u);
    return autograd::grads{g};
  });
  return watched;
}

void ZeroOptimizer::unit_backward_begin(size_t u) {
  const Unit& unit = units_[u];
  for (size_t k : unit.parts) gather(k, /*async=*/false);
  if (u > 0) prefetch(u - 1);  // backward runs the modules in reverse: the previous one's are next
}

void ZeroOptimizer::on_grad_ready_stage3(size_t k) {
  if (!in_backward_) return;  // a backward not driven through the strategy
  Partition& p = parts_[k];
  if (p.reduced || --p.waiting > 0) return;
  reduce_unit_partition(k);
}

// The module's gradients, whole on every rank, are reduce-scattered into the shards at once and its
// parameters released: between its backward and the step a rank holds gradient shards only.
void ZeroOptimizer::reduce_unit_partition(size_t k) {
  Partition& p = parts_[k];
  p.flat_grads = zeroed(p.padded, options_.working_dtype, device_);
  for (size_t j = 0; j < p.params.size(); ++j) {
    const Tensor& t = p.params[j];
    if (!t.grad().defined()) continue;
    span(p.flat_grads, p.offsets[j], t.numel()).copy_(t.grad().reshape({-1}));
    t.set_grad(Tensor());
  }
  backward_found_ |= reduce_partition(p, /*accumulate=*/have_grads_);
  p.flat_grads = Tensor();
  p.reduced = true;
  release(k);
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
  if (options_.stage == 3 && !have_grads_) {  // no backward since the step: nothing to clip
    grad_norm_ = 0.0;
    clipped_ = true;
    return 0.0;
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
  for (size_t k = 0; k < parts_.size(); ++k) inner_->param_groups()[k].options = groups_[parts_[k].group].options;
}

void ZeroOptimizer::step() {
  if (unreduced_) reduce_pending();
  release_all();  // a prefetch left gathered would keep the old values (and may still be reading the shard)
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
      if (options_.stage == 3) {
        // The shard is the parameters at rest; the next forward gathers it.
        if (options_.working_dtype != DType::Float32) p.shard_params.copy_(p.master);
        continue;
      }
      Tensor mine = shard_of(p.flat_params, p);
      if (options_.working_dtype != DType::Float32) mine.copy_(p.master);  // round to the working dtype
      group_.all_gather(p.flat_params, mine);
      for (const Tensor& t : p.params) t.bump_version();
    }
  }
  if (options_.stage == 3) release_shard_grads();
  else inner_->zero_grad();
  stats_ = {};
  stats_.loss_scale = scale_used;
  stats_.skipped = skip;
  stats_.grad_norm = grad_norm_;
  end_step();
  if (scaler_) scaler_->update(skip);  // may throw TrainingError at the scale's floor
}

void ZeroOptimizer::zero_grad(bool set_to_none) {
  optim::Optimizer::zero_grad(set_to_none);
  if (options_.stage == 3) release_shard_grads();  // the next reduction writes them afresh
  else inner_->zero_grad(set_to_none);
  unreduced_ = false;
  end_step();
}

// Stage 3 (Note [ZeRO-3: parameters by module]): between steps no gradient memory is held.
void ZeroOptimizer::release_shard_grads() {
  for (Partition& p : parts_) p.master.grad().storage()->release();
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
  const optim::OptimizerState shards = inner_->state_dict();  // this rank's shards, keyed by partition
  optim::OptimizerState out;
  out.meta["type"] = inner_->name();
  out.meta["state"] = json::object();
  json groups = json::array();
  for (size_t g = 0; g < groups_.size(); ++g) {
    json o = groups_[g].options;
    o["params"] = group_params_[g];
    groups.push_back(o);
  }

  // Gathers one shard-sized tensor of every rank into the full buffer and splits it into
  // per-parameter tensors named state.<i>.<name>.
  auto gather = [&](const Partition& p, const Tensor& shard, const std::string& name) {
    Tensor full = Tensor::empty({p.padded}, shard.dtype(), device_);
    group_.all_gather(full, shard);
    for (size_t j = 0; j < p.params.size(); ++j) {
      const Shape& shape = p.params[j].shape();
      out.tensors["state." + std::to_string(p.index[j]) + "." + name] =
          make_view(full, shape, contiguous_strides(shape), p.offsets[j]);
    }
  };

  const json& state = shards.meta.at("state");
  for (size_t k = 0; k < parts_.size(); ++k) {
    const Partition& p = parts_[k];
    const std::string key = std::to_string(k);
    const int64_t step = state.contains(key) ? state.at(key).value("step", int64_t(0)) : 0;
    if (step > 0) {
      for (size_t i : p.index) out.meta["state"][std::to_string(i)] = {{"step", step}};
      // The map is sorted, so every rank gathers the same names in the same order.
      const std::string prefix = "state." + key + ".";
      for (const auto& [name, t] : shards.tensors)
        if (name.rfind(prefix, 0) == 0) gather(p, t.contiguous(), name.substr(prefix.size()));
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
  release_all();  // stage 3: the shards change below; nothing gathered may keep the old values
  const json& meta = state.meta;
  const std::string type = inner_->name();
  BOOSTER_CHECK(meta.is_object() && meta.contains("param_groups") && meta.at("param_groups").is_array(),
                CheckpointError, "low_level_zero: optimizer state has no 'param_groups' list");
  if (meta.contains("type"))
    BOOSTER_CHECK(meta.at("type") == type, CheckpointError, "low_level_zero: optimizer state was saved by ",
                  meta.at("type").dump(), ", not ", type);
  const json& saved_groups = meta.at("param_groups");
  BOOSTER_CHECK(saved_groups.size() == groups_.size(), CheckpointError, "low_level_zero: optimizer state has ",
                saved_groups.size(), " parameter groups, this optimizer ", groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    const json& sg = saved_groups[g];
    BOOSTER_CHECK(sg.is_object() && sg.contains("params") && sg.at("params").size() == group_params_[g].size(),
                  CheckpointError, "low_level_zero: parameter group ", g, " of the optimizer state does not have ",
                  group_params_[g].size(), " parameters");
  }
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
  for (size_t k = 0; k < parts_.size(); ++k) {
    Partition& p = parts_[k];
    json o = saved_groups[p.group];
    o["params"] = json::array({k});
    inner_groups.push_back(o);

    // ZeRO steps a partition as one shard: its parameters must have taken the same number of steps.
    int64_t step = -1;
    for (size_t i : p.index) {
      const std::string key = std::to_string(i);
      const int64_t s = saved_state.contains(key) ? saved_state.at(key).value("step", int64_t(0)) : 0;
      BOOSTER_CHECK(step < 0 || s == step, CheckpointError, "low_level_zero: parameters of group ", p.group,
                    " took different numbers of steps (", step, " and ", s, " for parameter ", key,
                    "); ZeRO steps the parameters of a shard together");
      step = s;
    }
    if (step > 0) inner_state.meta["state"][std::to_string(k)] = {{"step", step}};

    // Every parameter of the partition must carry the same state names (checked below).
    std::set<std::string> names;
    for (size_t i : p.index) names.merge(std::set<std::string>(names_of[i]));
    const int64_t begin = shard_offset(k);
    for (const std::string& name : names) {
      Tensor shard = zeroed(p.shard, DType::Float32, device_);
      for (size_t j = 0; j < p.params.size(); ++j) {
        const std::string key = "state." + std::to_string(p.index[j]) + "." + name;
        auto it = state.tensors.find(key);
        BOOSTER_CHECK(it != state.tensors.end(), CheckpointError, "low_level_zero: optimizer state has no '", key,
                      "' although other parameters of group ", p.group, " have '", name,
                      "'; ZeRO keeps one state per shard, so every parameter needs it");
        BOOSTER_CHECK(it->second.numel() == p.params[j].numel(), CheckpointError, "low_level_zero: '", key,
                      "' has shape ", it->second.shape(), " but the parameter has shape ", p.params[j].shape());
      }
      for_each_piece(p.offsets, begin, begin + p.shard, [&](size_t j, int64_t lo, int64_t hi) {
        const Tensor src = state.tensors.at("state." + std::to_string(p.index[j]) + "." + name).contiguous();
        span(shard, lo - begin, hi - lo).copy_(span(src, lo - p.offsets[j], hi - lo));
      });
      if (name == kMasterWeight) {
        master_shards[k] = shard;
      } else {
        inner_state.tensors["state." + std::to_string(k) + "." + name] = shard;
      }
    }
  }
  inner_state.meta["param_groups"] = inner_groups;
  inner_->load_state_dict(inner_state);  // validates names and options; nothing changes on error

  for (size_t k = 0; k < parts_.size(); ++k) groups_[parts_[k].group].options = inner_->param_groups()[k].options;
  const bool sixteen_bit = options_.working_dtype != DType::Float32;
  for (size_t k = 0; k < parts_.size(); ++k) {
    Partition& p = parts_[k];
    if (options_.stage == 3) {
      // The shards are the parameters: the saved masters round into them (float32: the master is the
      // shard); without masters (a float32 or unsharded checkpoint) they come from the shards the
      // model loaded into.
      if (master_shards[k].defined()) {
        p.master.copy_(master_shards[k]);
        if (sixteen_bit) p.shard_params.copy_(p.master);
      } else if (sixteen_bit) {
        p.master.copy_(p.shard_params);
      }
      continue;
    }
    if (master_shards[k].defined()) {
      // The true weights: every rank reads all of them, so the model is set without communication.
      for (size_t j = 0; j < p.params.size(); ++j) {
        Tensor t = p.params[j];
        t.copy_(state.tensors.at("state." + std::to_string(p.index[j]) + "." + kMasterWeight).reshape(t.shape()));
      }
    }
    if (sixteen_bit) {
      // Without saved masters (a float32 or unsharded checkpoint) they come from the model.
      if (master_shards[k].defined()) p.master.copy_(master_shards[k]);
      else p.master.copy_(shard_of(p.flat_params, p));
    }
    for (const Tensor& t : p.params) t.bump_version();
  }
}

}  // namespace booster::zero
