// Tensor: shared storage + shape + strides + offset + dtype + device, plus its autograd state.
//
// A Tensor is a cheap handle (one shared_ptr). Copies alias; clone() copies data. Views share the
// storage and are differentiable. Arithmetic lives in booster/ops/ops.h.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "booster/tensor/dtype.h"
#include "booster/tensor/storage.h"

namespace booster {

using Shape = std::vector<int64_t>;

class Tensor;
namespace autograd {
class Node;
}

// Called after a leaf's .grad has been updated by backward (the parameter's gradient is ready).
using GradReadyHook = std::function<void(Tensor& param)>;

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape shape;
  Shape strides;       // in elements
  int64_t offset = 0;  // in elements
  int64_t numel = 0;
  DType dtype = DType::Float32;
  // Bumped by every in-place write; lets caches (autocast casts) see stale copies.
  uint64_t version = 0;

  // --- autograd ---
  bool requires_grad = false;
  std::shared_ptr<TensorImpl> grad;                 // .grad of a leaf
  std::shared_ptr<autograd::Node> grad_fn;          // producer of a non-leaf
  std::weak_ptr<autograd::Node> grad_accumulator;   // shared sink of a leaf's gradients
  std::vector<GradReadyHook> grad_ready_hooks;
  std::string name;  // optional, used in messages (parameter names)
};

int64_t numel_of(const Shape& s);
Shape contiguous_strides(const Shape& s);
// Wraps a possibly negative dim into [0, ndim); throws IndexError naming the op otherwise.
int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op);
std::string shape_str(const Shape& s);

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // Uninitialized tensor of the given shape.
  static Tensor empty(const Shape& shape, DType dtype = DType::Float32, Device device = Device::cpu());

  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const { return impl_->shape; }
  const Shape& strides() const { return impl_->strides; }
  int64_t dim() const { return int64_t(impl_->shape.size()); }
  int64_t size(int64_t d) const;
  int64_t stride(int64_t d) const;
  int64_t offset() const { return impl_->offset; }
  int64_t numel() const { return impl_->numel; }
  DType dtype() const { return impl_->dtype; }
  Device device() const { return impl_->storage->device(); }
  size_t nbytes() const { return size_t(numel()) * itemsize(dtype()); }
  bool is_contiguous() const;
  bool is_same(const Tensor& o) const { return impl_ == o.impl_; }
  const std::shared_ptr<Storage>& storage() const { return impl_->storage; }

  void* data_ptr() const {
    return static_cast<char*>(impl_->storage->data()) + impl_->offset * int64_t(itemsize(dtype()));
  }
  // Typed pointer to the first element; throws DTypeError when T does not match.
  template <class T>
  T* data() const {
    BOOSTER_CHECK(dtype_of<T>::value == dtype(), DTypeError, "data<", dtype_name(dtype_of<T>::value),
                  ">() called on a ", dtype(), " tensor");
    return static_cast<T*>(data_ptr());
  }

  // --- views (share storage; differentiable) ---
  Tensor view(const Shape& shape) const;     // needs compatible strides; -1 infers one size
  Tensor reshape(const Shape& shape) const;  // a view when possible, else a copy
  Tensor flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor t() const { return transpose(0, 1); }
  Tensor permute(const Shape& dims) const;
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor select(int64_t dim, int64_t index) const;  // removes dim
  Tensor unsqueeze(int64_t dim) const;
  Tensor squeeze(int64_t dim) const;
  Tensor squeeze() const;
  Tensor expand(const Shape& shape) const;  // -1 keeps a size
  Tensor expand_as(const Tensor& o) const { return expand(o.shape()); }

  // --- copies ---
  Tensor contiguous() const;  // itself when already contiguous
  Tensor clone() const;
  Tensor to(DType dtype) const;  // itself when already that dtype; differentiable
  Tensor to(Device device) const;
  Tensor to(Device device, DType dtype) const { return to(device).to(dtype); }
  Tensor cpu() const { return to(Device::cpu()); }
  // Same storage, no autograd history, requires_grad false.
  Tensor detach() const;

  // --- scalars and printing ---
  double item() const;  // one-element tensor as double
  template <class T>
  T item() const { return static_cast<T>(item()); }
  std::vector<double> tolist() const;  // flattened values as doubles (tests, printing)
  template <class T>
  std::vector<T> to_vector() const;     // flattened, converted to T
  std::string str() const;

  // --- in-place (not recorded by autograd; bump the version) ---
  Tensor& zero_();
  Tensor& fill_(double value);
  Tensor& copy_(const Tensor& src);  // broadcasts src, converts dtype and device
  Tensor& mul_(double s);
  Tensor& add_(const Tensor& other, double alpha = 1.0);
  void bump_version() const { ++impl_->version; }
  uint64_t version() const { return impl_->version; }

  // --- autograd ---
  bool requires_grad() const { return impl_ && impl_->requires_grad; }
  Tensor& requires_grad_(bool flag = true);
  bool is_leaf() const { return impl_->grad_fn == nullptr; }
  Tensor grad() const { return Tensor(impl_->grad); }
  void set_grad(const Tensor& g) const { impl_->grad = g.impl_; }
  const std::shared_ptr<autograd::Node>& grad_fn() const { return impl_->grad_fn; }
  // Backpropagates from this tensor. Without `gradient`, the tensor must hold one element.
  void backward(const Tensor& gradient = Tensor(), bool retain_graph = false) const;
  // Runs `hook` each time backward has finished accumulating into this leaf's .grad.
  void register_grad_ready_hook(GradReadyHook hook) const;
  const std::string& name() const { return impl_->name; }
  void set_name(std::string n) const { impl_->name = std::move(n); }

  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }

 private:
  std::shared_ptr<TensorImpl> impl_;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);

// A view of `base` with the given geometry (no checks, no autograd). For ops and kernels.
Tensor make_view(const Tensor& base, Shape shape, Shape strides, int64_t offset);

}  // namespace booster
