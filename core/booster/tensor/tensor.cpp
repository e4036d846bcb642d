#include "booster/tensor/tensor.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <numeric>
#include <sstream>

#include "booster/autograd/autograd.h"
#include "booster/tensor/deferred.h"
#include "booster/common/error_context.h"
#include "booster/kernels/elementwise.h"
#include "booster/ops/ops.h"

namespace booster {

// Note: a shape such as [2^40, 2^40] has more elements than int64 counts; multiplying them out would
// be undefined behaviour and a silently wrong size, so both are checked.
int64_t numel_of(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s)
    if (__builtin_mul_overflow(n, d, &n))
      BOOSTER_FAIL(ShapeError, "shape ", s, " has more elements than a 64-bit count holds");
  return n;
}

Shape contiguous_strides(const Shape& s) {
  Shape st(s.size());
  int64_t acc = 1;
  for (size_t i = s.size(); i-- > 0;) {
    st[i] = acc;
    if (i > 0 && __builtin_mul_overflow(acc, std::max<int64_t>(s[i], 1), &acc))
      BOOSTER_FAIL(ShapeError, "shape ", s, " has more elements than a 64-bit stride addresses");
  }
  return st;
}

int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op) {
  const int64_t lo = ndim == 0 ? -1 : -ndim, hi = ndim == 0 ? 0 : ndim - 1;
  BOOSTER_CHECK(dim >= lo && dim <= hi, IndexError, op, ": dimension ", dim,
                " is out of range for a tensor of ", ndim, " dims (expected ", lo, " to ", hi, ")");
  return dim < 0 ? dim + std::max<int64_t>(ndim, 1) : dim;
}

std::string shape_str(const Shape& s) { return str(s); }

// An OutOfMemoryError for a tensor of `shape` and `dtype`, with what was running (defined below).
[[noreturn]] void throw_out_of_memory(const std::string& allocator_message, const Shape& shape, DType dtype,
                                      Device device);

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  for (int64_t d : shape)
    BOOSTER_CHECK(d >= 0, ShapeError, "empty: negative size in shape ", shape);
  size_t nbytes = itemsize(dtype);
  for (int64_t d : shape)
    if (__builtin_mul_overflow(nbytes, size_t(d), &nbytes))
      throw_out_of_memory("its size in bytes overflows 64 bits", shape, dtype, device);
  auto impl = std::make_shared<TensorImpl>();
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->numel = numel_of(shape);
  impl->dtype = dtype;
  try {
    impl->storage = LazyInitGuard::enabled() ? std::make_shared<Storage>(nbytes, device, Storage::Deferred{})
                                             : std::make_shared<Storage>(nbytes, device);
  } catch (const OutOfMemoryError& e) {
    throw_out_of_memory(e.what(), shape, dtype, device);
  }
  return Tensor(std::move(impl));
}

namespace {

// "37.3 GiB"
std::string human_bytes(double bytes) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 5) bytes /= 1024.0, ++u;
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(u == 0 ? 0 : 1);
  os << bytes << " " << units[u];
  return os.str();
}

// MemAvailable of /proc/meminfo in bytes, or -1.
double host_memory_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024.0;
  return -1.0;
}

}  // namespace

// Note [Error context]: the allocator knows only a byte count; the message gets the tensor's shape and
// dtype, what was running when it was asked for, and what to shrink.
void throw_out_of_memory(const std::string& allocator_message, const Shape& shape, DType dtype, Device device) {
  double bytes = double(itemsize(dtype));  // in double: the element count may not fit an int64
  for (int64_t d : shape) bytes *= double(d);
  std::string msg = "out of " + std::string(device.is_cuda() ? "device" : "host") + " memory: cannot allocate " +
                    human_bytes(bytes) + " for a " + dtype_name(dtype) + " tensor of shape " + shape_str(shape);
  const std::string context = describe_error_context();
  if (!context.empty()) msg += " " + context;
  msg += " (" + allocator_message;
  if (!device.is_cuda()) {
    const double available = host_memory_available();
    if (available >= 0) msg += "; " + human_bytes(available) + " available";
  }
  msg += "); ";
  if (innermost_error_context(ErrorContextFrame::Kind::Building)) {
    msg += "the model's parameters do not fit: shrink the model (its width, hidden sizes, layers, vocab_size)";
  } else if (innermost_error_context(ErrorContextFrame::Kind::Module) ||
             innermost_error_context(ErrorContextFrame::Kind::Backward)) {
    msg += "activations grow with the batch: lower data.batch_size (train.grad_accumulation keeps the effective "
           "batch), the sequence length (data.context) or the model's width, or train in bf16/fp16, which halves them";
  } else {
    msg += "shrink what this tensor holds (the batch size, the model's width), or free memory";
  }
  msg += "; `booster check` estimates a config's memory per rank";
  throw OutOfMemoryError(msg);
}

Tensor make_view(const Tensor& base, Shape shape, Shape strides, int64_t offset) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = base.storage();
  impl->numel = numel_of(shape);
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->offset = offset;
  impl->dtype = base.dtype();
  return Tensor(std::move(impl));
}

int64_t Tensor::size(int64_t d) const { return shape()[size_t(wrap_dim(d, dim(), "size"))]; }
int64_t Tensor::stride(int64_t d) const { return strides()[size_t(wrap_dim(d, dim(), "stride"))]; }

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (size_t i = shape().size(); i-- > 0;) {
    if (shape()[i] == 1) continue;
    if (strides()[i] != expected) return false;
    expected *= shape()[i];
  }
  return true;
}

// ------------------------------------------------------------------------------------------ views

namespace {

// Records the backward of a view: the gradient of `out` mapped back to `in`'s shape by `back`.
void record_view(Tensor& out, const Tensor& in, const char* name, std::function<Tensor(const Tensor&)> back) {
  if (!autograd::needs_grad({&in})) return;
  autograd::record(out, name, {in}, [back = std::move(back)](const Tensor& g) {
    return autograd::grads{back(g)};
  });
}

Shape infer_shape(Shape shape, int64_t numel, const char* op, const Shape& from) {
  int64_t infer = -1, known = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      BOOSTER_CHECK(infer < 0, ShapeError, op, ": only one dimension can be -1, got ", shape);
      infer = int64_t(i);
    } else {
      BOOSTER_CHECK(shape[i] >= 0, ShapeError, op, ": invalid size ", shape[i], " in ", shape);
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    BOOSTER_CHECK(known != 0 && numel % known == 0, ShapeError, op, ": shape ", shape,
                  " is invalid for input of shape ", from, " (", numel, " elements)");
    shape[size_t(infer)] = numel / known;
  }
  BOOSTER_CHECK(numel_of(shape) == numel, ShapeError, op, ": shape ", shape,
                " is invalid for input of shape ", from, " (", numel, " elements)");
  return shape;
}

// Strides for viewing (shape, strides) as new_shape without copying, if possible (PyTorch's
// computeStride): each run of old dims that is contiguous within itself may be re-split.
bool view_strides(const Shape& shape, const Shape& strides, const Shape& new_shape, Shape& out) {
  out.assign(new_shape.size(), 0);
  // Empty tensors and 0-d scalars have no stride constraint: any shape of the same count is a view.
  if (numel_of(shape) == 0 || shape.empty()) {
    out = contiguous_strides(new_shape);
    return true;
  }
  int64_t view_d = int64_t(new_shape.size()) - 1;
  int64_t chunk_base_stride = strides.empty() ? 1 : strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t d = int64_t(shape.size()) - 1; d >= 0; --d) {
    tensor_numel *= shape[size_t(d)];
    if (d == 0 || (shape[size_t(d) - 1] != 1 &&
                   strides[size_t(d) - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || new_shape[size_t(view_d)] == 1)) {
        out[size_t(view_d)] = view_numel * chunk_base_stride;
        view_numel *= new_shape[size_t(view_d)];
        --view_d;
      }
      if (view_numel != tensor_numel) return false;
      if (d > 0) {
        chunk_base_stride = strides[size_t(d) - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  return view_d == -1;
}

}  // namespace

Tensor Tensor::view(const Shape& new_shape) const {
  Shape s = infer_shape(new_shape, numel(), "view", shape());
  Shape st;
  BOOSTER_CHECK(view_strides(shape(), strides(), s, st), ShapeError, "view: cannot view shape ", shape(),
                " with strides ", strides(), " as ", s, "; call reshape() (which copies) instead");
  Tensor out = make_view(*this, s, st, offset());
  const Shape in_shape = shape();
  record_view(out, *this, "ViewBackward", [in_shape](const Tensor& g) { return g.reshape(in_shape); });
  return out;
}

Tensor Tensor::reshape(const Shape& new_shape) const {
  Shape s = infer_shape(new_shape, numel(), "reshape", shape());
  Shape st;
  if (view_strides(shape(), strides(), s, st)) return view(s);
  return contiguous().view(s);
}

Tensor Tensor::flatten(int64_t start_dim, int64_t end_dim) const {
  if (dim() == 0) return reshape({1});
  start_dim = wrap_dim(start_dim, dim(), "flatten");
  end_dim = wrap_dim(end_dim, dim(), "flatten");
  BOOSTER_CHECK(start_dim <= end_dim, IndexError, "flatten: start_dim ", start_dim, " > end_dim ", end_dim);
  Shape s(shape().begin(), shape().begin() + start_dim);
  int64_t m = 1;
  for (int64_t d = start_dim; d <= end_dim; ++d) m *= shape()[size_t(d)];
  s.push_back(m);
  s.insert(s.end(), shape().begin() + end_dim + 1, shape().end());
  return reshape(s);
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  d0 = wrap_dim(d0, dim(), "transpose");
  d1 = wrap_dim(d1, dim(), "transpose");
  Shape s = shape(), st = strides();
  if (dim() > 0) {
    std::swap(s[size_t(d0)], s[size_t(d1)]);
    std::swap(st[size_t(d0)], st[size_t(d1)]);
  }
  Tensor out = make_view(*this, s, st, offset());
  record_view(out, *this, "TransposeBackward", [d0, d1](const Tensor& g) { return g.transpose(d0, d1); });
  return out;
}

Tensor Tensor::permute(const Shape& dims) const {
  BOOSTER_CHECK(int64_t(dims.size()) == dim(), ShapeError, "permute: got ", dims.size(),
                " dims ", dims, " for a tensor of ", dim(), " dims");
  Shape s(dims.size()), st(dims.size()), inverse(dims.size());
  std::vector<bool> seen(dims.size(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    const int64_t d = wrap_dim(dims[i], dim(), "permute");
    BOOSTER_CHECK(!seen[size_t(d)], IndexError, "permute: dimension ", d, " repeats in ", dims);
    seen[size_t(d)] = true;
    s[i] = shape()[size_t(d)];
    st[i] = strides()[size_t(d)];
    inverse[size_t(d)] = int64_t(i);
  }
  Tensor out = make_view(*this, s, st, offset());
  record_view(out, *this, "PermuteBackward", [inverse](const Tensor& g) { return g.permute(inverse); });
  return out;
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  d = wrap_dim(d, dim(), "slice");
  BOOSTER_CHECK(step > 0, ValueError, "slice: step must be positive, got ", step);
  const int64_t n = shape()[size_t(d)];
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Shape s = shape(), st = strides();
  s[size_t(d)] = (end - start + step - 1) / step;
  st[size_t(d)] *= step;
  Tensor out = make_view(*this, s, st, offset() + start * strides()[size_t(d)]);
  const Shape in_shape = shape();
  const DType in_dtype = dtype();
  const Device dev = device();
  record_view(out, *this, "SliceBackward", [=](const Tensor& g) {
    Tensor full = zeros(in_shape, in_dtype, dev);
    full.slice(d, start, end, step).copy_(g);
    return full;
  });
  return out;
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  d = wrap_dim(d, dim(), "narrow");
  const int64_t n = shape()[size_t(d)];
  if (start < 0) start += n;
  BOOSTER_CHECK(start >= 0 && length >= 0 && start + length <= n, IndexError, "narrow: start ", start,
                " + length ", length, " exceeds size ", n, " of dimension ", d, " (shape ", shape(), ")");
  return slice(d, start, start + length);
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  d = wrap_dim(d, dim(), "select");
  const int64_t n = shape()[size_t(d)];
  BOOSTER_CHECK(index >= -n && index < n, IndexError, "select: index ", index, " is out of range for size ",
                n, " of dimension ", d, " (shape ", shape(), ")");
  if (index < 0) index += n;
  return narrow(d, index, 1).squeeze(d);
}

Tensor Tensor::unsqueeze(int64_t d) const {
  d = wrap_dim(d, dim() + 1, "unsqueeze");
  Shape s = shape(), st = strides();
  const int64_t new_stride = size_t(d) < st.size() ? st[size_t(d)] * s[size_t(d)] : 1;
  s.insert(s.begin() + d, 1);
  st.insert(st.begin() + d, new_stride);
  Tensor out = make_view(*this, s, st, offset());
  record_view(out, *this, "UnsqueezeBackward", [d](const Tensor& g) { return g.squeeze(d); });
  return out;
}

Tensor Tensor::squeeze(int64_t d) const {
  if (dim() == 0) return *this;
  d = wrap_dim(d, dim(), "squeeze");
  if (shape()[size_t(d)] != 1) return *this;
  Shape s = shape(), st = strides();
  s.erase(s.begin() + d);
  st.erase(st.begin() + d);
  Tensor out = make_view(*this, s, st, offset());
  record_view(out, *this, "SqueezeBackward", [d](const Tensor& g) { return g.unsqueeze(d); });
  return out;
}

Tensor Tensor::squeeze() const {
  Shape s;
  for (int64_t x : shape())
    if (x != 1) s.push_back(x);
  return s.size() == shape().size() ? *this : reshape(s);
}

Tensor Tensor::expand(const Shape& target) const {
  BOOSTER_CHECK(int64_t(target.size()) >= dim(), ShapeError, "expand: target shape ", target,
                " has fewer dims than the tensor's shape ", shape());
  const size_t lead = target.size() - shape().size();
  Shape s(target.size()), st(target.size());
  for (size_t i = 0; i < target.size(); ++i) {
    if (i < lead) {
      BOOSTER_CHECK(target[i] >= 0, ShapeError, "expand: -1 is not allowed for a new leading dim in ", target);
      s[i] = target[i];
      st[i] = 0;
      continue;
    }
    const int64_t cur = shape()[i - lead];
    const int64_t want = target[i] == -1 ? cur : target[i];
    BOOSTER_CHECK(cur == want || cur == 1, ShapeError, "expand: cannot expand shape ", shape(), " to ",
                  target, " (dimension ", i, ": size ", cur, " is not 1 and not ", want, ")");
    s[i] = want;
    st[i] = cur == want ? strides()[i - lead] : 0;
  }
  if (s == shape()) return *this;
  Tensor out = make_view(*this, s, st, offset());
  const Shape in_shape = shape();
  record_view(out, *this, "ExpandBackward", [in_shape](const Tensor& g) { return autograd::sum_to(g, in_shape); });
  return out;
}

// ------------------------------------------------------------------------------------------ copies

Tensor Tensor::contiguous() const { return is_contiguous() ? *this : clone(); }

Tensor Tensor::clone() const {
  BOOSTER_OP_CONTEXT("clone");  // Note [Error context]
  Tensor out = Tensor::empty(shape(), dtype(), device());
  {
    NoGradGuard ng;
    out.copy_(*this);
  }
  record_view(out, *this, "CloneBackward", [](const Tensor& g) { return g; });
  return out;
}

Tensor Tensor::to(DType dt) const {
  BOOSTER_OP_CONTEXT("to");  // Note [Error context]
  if (dt == dtype()) return *this;
  Tensor out = Tensor::empty(shape(), dt, device());
  {
    NoGradGuard ng;
    out.copy_(*this);
  }
  if (is_floating(dt)) {
    const DType in_dtype = dtype();
    record_view(out, *this, "ToDTypeBackward", [in_dtype](const Tensor& g) { return g.to(in_dtype); });
  }
  return out;
}

Tensor Tensor::to(Device dev) const {
  BOOSTER_OP_CONTEXT("to");  // Note [Error context]
  if (dev == device()) return *this;
  Tensor out = deferred_to(*this, dev);  // a deferred tensor moves its record, allocating nothing
  if (!out.defined()) {
    out = Tensor::empty(shape(), dtype(), dev);
    NoGradGuard ng;
    out.copy_(*this);
  }
  const Device in_dev = device();
  record_view(out, *this, "ToDeviceBackward", [in_dev](const Tensor& g) { return g.to(in_dev); });
  return out;
}

Tensor Tensor::detach() const {
  Tensor out = make_view(*this, shape(), strides(), offset());
  return out;
}

// ------------------------------------------------------------------------------------------ in-place

namespace {
void check_inplace(const Tensor& t, const char* op) {
  BOOSTER_CHECK(!(autograd::grad_mode_enabled() && t.requires_grad()), AutogradError, op,
                ": in-place write to a tensor that requires grad", t.name().empty() ? "" : " ('" + t.name() + "')",
                " while grad mode is on; wrap the update in NoGradGuard or use a non-in-place op");
}
}  // namespace

Tensor& Tensor::copy_(const Tensor& src) {
  check_inplace(*this, "copy_");
  Tensor s = src.detach().expand(shape());
  // Overwriting a whole deferred tensor: its recorded values would be made only to be replaced.
  if (s.storage() != storage()) discard_deferred_values(*this);
  if (s.device() == device()) {
    kernels::copy_kernel(device())(s, *this);
  } else {
    // Cross-device: move the bytes as they are, then convert on the destination device. A contiguous
    // destination of the same dtype takes the bytes directly (no second copy; and float8 tensors, which
    // no copy kernel converts, move too).
    Tensor packed = s.contiguous();
    const bool direct = is_contiguous() && packed.dtype() == dtype();
    Tensor staged = direct ? *this : Tensor::empty(shape(), packed.dtype(), device());
    if (packed.device().is_cpu()) {
      allocator_for(device()).copy_from_host(staged.data_ptr(), packed.data_ptr(), packed.nbytes());
    } else if (device().is_cpu()) {
      allocator_for(packed.device()).copy_to_host(staged.data_ptr(), packed.data_ptr(), packed.nbytes());
    } else if (packed.device().type == device().type) {
      // Two GPUs: the backend's allocator copies peer to peer, in order on both devices' streams.
      allocator_for(device()).copy_device(staged.data_ptr(), packed.data_ptr(), packed.nbytes());
    } else {
      Tensor host = packed.to(Device::cpu());
      allocator_for(device()).copy_from_host(staged.data_ptr(), host.data_ptr(), host.nbytes());
    }
    if (!direct) kernels::copy_kernel(device())(staged, *this);
  }
  bump_version();
  return *this;
}

Tensor& Tensor::zero_() { return fill_(0.0); }

Tensor& Tensor::fill_(double value) {
  check_inplace(*this, "fill_");
  if (!defer_fill(*this, value)) kernels::fill_kernel(device())(*this, value);
  bump_version();
  return *this;
}

Tensor& Tensor::mul_(double s) {
  check_inplace(*this, "mul_");
  kernels::unary_kernel(device())(kernels::UnaryOp::MulScalar, *this, *this, s, 0.0);
  bump_version();
  return *this;
}

Tensor& Tensor::add_(const Tensor& other, double alpha) {
  check_inplace(*this, "add_");
  Tensor o = other.detach();
  if (o.dtype() != dtype()) o = o.to(dtype());
  BOOSTER_CHECK(o.device() == device(), DeviceError, "add_: tensors on ", device(), " and ", o.device());
  kernels::binary_kernel(device())(kernels::BinaryOp::Add, *this, o.expand(shape()), *this, alpha);
  bump_version();
  return *this;
}

// ------------------------------------------------------------------------------------------ values

double Tensor::item() const {
  BOOSTER_CHECK(numel() == 1, ShapeError, "item: expected a tensor with one element, got shape ", shape(),
                " (", numel(), " elements)");
  Tensor h = device().is_cpu() ? *this : to(Device::cpu());
  return BOOSTER_DISPATCH_STORAGE(h.dtype(), "item", [&] { return double(*static_cast<const scalar_t*>(h.data_ptr())); });
}

std::vector<double> Tensor::tolist() const { return to_vector<double>(); }

template <class T>
std::vector<T> Tensor::to_vector() const {
  NoGradGuard ng;
  Tensor h = detach().to(Device::cpu()).to(dtype_of<T>::value).contiguous();
  const T* p = h.data<T>();
  return std::vector<T>(p, p + h.numel());
}
template std::vector<double> Tensor::to_vector<double>() const;
template std::vector<float> Tensor::to_vector<float>() const;
template std::vector<int64_t> Tensor::to_vector<int64_t>() const;
template std::vector<int32_t> Tensor::to_vector<int32_t>() const;
template std::vector<bool> Tensor::to_vector<bool>() const;

std::string Tensor::str() const {
  if (!defined()) return "tensor(undefined)";
  std::ostringstream os;
  const auto v = tolist();
  const bool integral = !is_floating(dtype());
  std::function<void(size_t, size_t&, int)> rec = [&](size_t d, size_t& pos, int indent) {
    if (d == shape().size()) {
      const double x = v[pos++];
      if (dtype() == DType::Bool) os << (x != 0 ? "True" : "False");
      else if (integral) os << int64_t(x);
      else os << std::setprecision(4) << x;
      return;
    }
    os << '[';
    const int64_t n = shape()[d];
    for (int64_t i = 0; i < n; ++i) {
      if (i) os << (d + 1 == shape().size() ? ", " : ",\n" + std::string(size_t(indent + 1), ' '));
      if (n > 12 && i == 6) {  // summarize long dims
        os << "...";
        size_t skip = size_t(n - 12) * size_t(numel_of(Shape(shape().begin() + int64_t(d) + 1, shape().end())));
        pos += skip;
        i = n - 7;
        continue;
      }
      rec(d + 1, pos, indent + 1);
    }
    os << ']';
  };
  os << "tensor(";
  size_t pos = 0;
  rec(0, pos, 7);
  if (dtype() != DType::Float32 && dtype() != DType::Int64 && dtype() != DType::Bool) os << ", dtype=" << dtype();
  if (!device().is_cpu()) os << ", device=" << device();
  if (requires_grad()) os << ", requires_grad=True";
  os << ')';
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.str(); }

// ------------------------------------------------------------------------------------------ autograd

Tensor& Tensor::requires_grad_(bool flag) {
  BOOSTER_CHECK(!flag || is_floating(dtype()), AutogradError,
                "requires_grad_: only floating tensors can require gradients, got ", dtype());
  BOOSTER_CHECK(is_leaf(), AutogradError,
                "requires_grad_: can only be set on leaf tensors; call detach() first for a non-leaf");
  impl_->requires_grad = flag;
  return *this;
}

void Tensor::backward(const Tensor& gradient, bool retain_graph) const {
  autograd::backward(*this, gradient, retain_graph);
}

void Tensor::register_grad_ready_hook(GradReadyHook hook) const {
  BOOSTER_CHECK(requires_grad() && is_leaf(), AutogradError,
                "register_grad_ready_hook: the tensor must be a leaf that requires grad");
  impl_->grad_ready_hooks.push_back(std::move(hook));
}

}  // namespace booster
