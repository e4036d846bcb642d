// FlatBuffer: a list of parameters (one dtype, one device) living in one contiguous storage, with
// their gradients in a second one.
//
// Note [Flat buffers]
// Optimizers, gradient unscaling, all-reduce buckets and ZeRO partitions all want "every parameter" as
// one span: a fused optimizer step is then one loop, an inf check one pass, a bucket an offset and a
// length. Binding parameters does this without changing who owns them:
//
//  * values: one storage of sum(numel) elements is allocated, each parameter's values copied in, and
//    each parameter's TensorImpl repointed (storage, offset, contiguous strides) into it. Every handle
//    the model holds shares that TensorImpl, so the model computes with the flat memory from then on.
//  * gradients: a second storage of the same size, zeroed; each parameter that requires grad gets a
//    contiguous view of its slice as .grad. autograd's AccumulateGrad adds into an existing .grad in
//    place, so backward writes straight into the flat gradient buffer.
//  * binding is idempotent: parameters that already lie adjacent, in order, in one storage (because
//    they were bound before, by another optimizer or a data-parallel plugin) are reused, not copied;
//    likewise their gradients.
//
// The one semantic difference with PyTorch: zero_grad(set_to_none=true) cannot drop a flat-bound
// gradient (the memory is shared), so it zeroes the buffer (one memset) and gives each parameter a
// fresh gradient view. A parameter that then receives no gradient would see zeros where PyTorch sees
// None, and an optimizer that used those zeros would still move it (Adam's momentum, weight decay).
// To keep PyTorch's behaviour we track arrival instead: every gradient view starts at version 0 and
// every in-place write (AccumulateGrad's add_, copy_, ...) bumps its version, so sync_grads() reports
// "got a gradient since the last zero_grad" as version != 0. A gradient the user replaced with another
// tensor (set_grad, or a zero_grad elsewhere that set it to None followed by a backward) is copied into
// the flat buffer and counts as arrived; an undefined gradient counts as none. Optimizers skip
// parameters that got none, exactly as torch skips `p.grad is None`. (Writes through raw pointers that
// do not bump the version are not seen; kernels that write gradients must call bump_version().)
//
// Consequences for callers: zero gradients with optimizer.zero_grad(). A module's zero_grad that sets
// .grad to None still works (the next backward creates a separate gradient, which step() copies into
// the buffer) but costs that copy every step. A parameter that was a view into some larger tensor is
// copied out of it when bound: other views of the old storage no longer alias it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "booster/tensor/tensor.h"

namespace booster::optim {

class FlatBuffer {
 public:
  FlatBuffer() = default;
  // Binds `params` (at least one; one floating dtype, one device, no duplicates).
  explicit FlatBuffer(std::vector<Tensor> params);

  size_t size() const { return params_.size(); }
  const std::vector<Tensor>& params() const { return params_; }
  DType dtype() const { return data_.dtype(); }
  Device device() const { return data_.device(); }
  int64_t numel() const { return offsets_.empty() ? 0 : offsets_.back(); }
  // Start of parameter i within data()/grad(); offsets()[size()] == numel().
  const std::vector<int64_t>& offsets() const { return offsets_; }
  int64_t offset(size_t i) const { return offsets_[i]; }

  // 1-D views of every value / every gradient (no autograd history).
  const Tensor& data() const { return data_; }
  const Tensor& grad() const { return grad_; }
  template <class T>
  std::span<T> data_span() const { return {data_.data<T>(), size_t(numel())}; }
  template <class T>
  std::span<T> grad_span() const { return {grad_.data<T>(), size_t(numel())}; }

  // False when binding found the values already flat and reused them (nothing was copied).
  bool copied_values() const { return copied_values_; }

  // Zeroes the gradient buffer (one memset) and gives every parameter that requires grad a fresh
  // gradient view, so nothing counts as arrived until backward (or the user) writes one.
  void zero_grad();
  // Brings every parameter's gradient into the flat buffer and returns, per parameter, whether one
  // arrived since the last zero_grad (see Note [Flat buffers]).
  std::vector<char> sync_grads();
  // Throws StateError when a parameter no longer points into the buffer (e.g. module.to() ran after
  // the optimizer was made).
  void check_bound(const char* who) const;

 private:
  Tensor grad_view(size_t i) const;
  bool is_grad_view(const Tensor& g, size_t i) const;

  std::vector<Tensor> params_;
  std::vector<int64_t> offsets_;
  Tensor data_, grad_;
  bool copied_values_ = false;
};

}  // namespace booster::optim
