#include "booster/optim/flat_buffer.h"

#include <unordered_set>

#include "booster/autograd/autograd.h"
#include "booster/tensor/storage.h"

namespace booster::optim {

namespace {

std::string describe(const Tensor& p, size_t i) {
  return p.name().empty() ? str("parameter ", i) : str("parameter ", i, " ('", p.name(), "')");
}

// Do tensors[i] (selected by `use`) lie contiguous and in order in one storage, tensors[i] starting at
// base + offsets[i]? Returns the base through `base`.
template <class Get>
bool lies_flat(size_t n, const std::vector<int64_t>& offsets, DType dtype, Get&& get, int64_t& base) {
  const Storage* storage = nullptr;
  bool first = true;
  for (size_t i = 0; i < n; ++i) {
    const Tensor t = get(i);
    if (!t.defined()) continue;  // no gradient slot needed (requires_grad false)
    if (t.dtype() != dtype || !t.is_contiguous()) return false;
    if (first) {
      storage = t.storage().get();
      base = t.offset() - offsets[i];
      first = false;
      if (base < 0) return false;
    } else if (t.storage().get() != storage || t.offset() != base + offsets[i]) {
      return false;
    }
  }
  if (first) return false;
  return int64_t(storage->nbytes()) >= (base + offsets.back()) * int64_t(itemsize(dtype));
}

}  // namespace

FlatBuffer::FlatBuffer(std::vector<Tensor> params) : params_(std::move(params)) {
  BOOSTER_CHECK(!params_.empty(), ValueError, "FlatBuffer: got an empty parameter list");
  const DType dtype = params_[0].dtype();
  const Device device = params_[0].device();
  offsets_.assign(1, 0);
  std::unordered_set<const TensorImpl*> seen;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    BOOSTER_CHECK(p.defined(), ValueError, "FlatBuffer: ", describe(p, i), " is undefined");
    BOOSTER_CHECK(is_floating(p.dtype()), DTypeError, "FlatBuffer: ", describe(p, i), " has dtype ", p.dtype(),
                  "; only floating parameters can be optimized");
    BOOSTER_CHECK(p.dtype() == dtype, DTypeError, "FlatBuffer: ", describe(p, i), " has dtype ", p.dtype(),
                  " but parameter 0 has ", dtype, "; bind one buffer per dtype");
    BOOSTER_CHECK(p.device() == device, DeviceError, "FlatBuffer: ", describe(p, i), " is on ", p.device(),
                  " but parameter 0 is on ", device, "; bind one buffer per device");
    BOOSTER_CHECK(seen.insert(p.impl()).second, ValueError, "FlatBuffer: ", describe(p, i),
                  " appears twice in the parameter list");
    offsets_.push_back(offsets_.back() + p.numel());
  }
  const int64_t total = offsets_.back();
  const size_t n = params_.size();
  NoGradGuard no_grad;

  // Values: reuse when already flat, else copy into a new storage and repoint each TensorImpl.
  int64_t base = 0;
  if (lies_flat(n, offsets_, dtype, [&](size_t i) { return params_[i]; }, base)) {
    data_ = make_view(params_[0], {total}, {1}, base);
    copied_values_ = false;
  } else {
    data_ = Tensor::empty({total}, dtype, device);
    for (size_t i = 0; i < n; ++i) {
      Tensor& p = params_[i];
      make_view(data_, p.shape(), contiguous_strides(p.shape()), offsets_[i]).copy_(p);
      TensorImpl* impl = p.impl();
      impl->storage = data_.storage();
      impl->strides = contiguous_strides(p.shape());
      impl->offset = offsets_[i];
      p.bump_version();  // caches of the old values (autocast casts) must not be reused
    }
    copied_values_ = true;
  }

  // Gradients: one slot per parameter that requires grad (or already has one).
  auto needs_slot = [&](size_t i) { return params_[i].requires_grad() || params_[i].grad().defined(); };
  int64_t grad_base = 0;
  const bool grads_flat = lies_flat(
      n, offsets_, dtype, [&](size_t i) { return needs_slot(i) ? params_[i].grad() : Tensor(); }, grad_base);
  bool every_slot_has_grad = true;
  for (size_t i = 0; i < n; ++i) every_slot_has_grad &= !needs_slot(i) || params_[i].grad().defined();
  if (grads_flat && every_slot_has_grad) {
    const Tensor any = [&] {
      for (size_t i = 0; i < n; ++i)
        if (params_[i].grad().defined()) return params_[i].grad();
      return Tensor();
    }();
    grad_ = make_view(any, {total}, {1}, grad_base);
  } else {
    grad_ = Tensor::empty({total}, dtype, device);
    allocator_for(device).memset_zero(grad_.data_ptr(), grad_.nbytes());
    for (size_t i = 0; i < n; ++i) {
      if (!needs_slot(i)) continue;
      const Tensor old = params_[i].grad();
      Tensor view = grad_view(i);
      if (old.defined()) {
        // Keep the gradient. It counts as arrived unless it is an unwritten slice of another flat
        // buffer (version 0 and smaller than its storage): then it is a zeroed slot, not a gradient.
        const bool unwritten_slot = old.version() == 0 && old.nbytes() < old.storage()->nbytes();
        grad_view(i).copy_(old);  // a scratch view takes the version bump...
        if (!unwritten_slot) view.bump_version();  // ...and the installed one only when it arrived
      }
      params_[i].set_grad(view);
    }
  }
}

Tensor FlatBuffer::grad_view(size_t i) const {
  const Tensor& p = params_[i];
  return make_view(grad_, p.shape(), contiguous_strides(p.shape()), grad_.offset() + offsets_[i]);
}

bool FlatBuffer::is_grad_view(const Tensor& g, size_t i) const {
  return g.storage() == grad_.storage() && g.offset() == grad_.offset() + offsets_[i] &&
         g.dtype() == grad_.dtype() && g.shape() == params_[i].shape() && g.is_contiguous();
}

void FlatBuffer::zero_grad() {
  if (!grad_.defined()) return;
  allocator_for(grad_.device()).memset_zero(grad_.data_ptr(), grad_.nbytes());
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor& p = params_[i];
    if (p.requires_grad() || p.grad().defined()) p.set_grad(grad_view(i));
  }
}

std::vector<char> FlatBuffer::sync_grads() {
  std::vector<char> arrived(params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor& p = params_[i];
    const Tensor g = p.grad();
    if (!g.defined()) continue;
    if (is_grad_view(g, i)) {
      arrived[i] = g.version() != 0;
      continue;
    }
    BOOSTER_CHECK(g.shape() == p.shape(), ShapeError, "optimizer: the gradient of ", describe(p, i), " has shape ",
                  g.shape(), " but the parameter has shape ", p.shape());
    NoGradGuard no_grad;
    Tensor view = grad_view(i);
    view.copy_(g);
    p.set_grad(view);
    arrived[i] = 1;
  }
  return arrived;
}

void FlatBuffer::check_bound(const char* who) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    BOOSTER_CHECK(p.storage() == data_.storage() && p.offset() == data_.offset() + offsets_[i] &&
                      p.dtype() == data_.dtype() && p.is_contiguous(),
                  StateError, who, ": ", describe(p, i),
                  " no longer lives in the optimizer's flat buffer (was the module moved with .to() or its "
                  "parameter replaced after the optimizer was made?); create the optimizer after moving the "
                  "model");
  }
}

}  // namespace booster::optim
