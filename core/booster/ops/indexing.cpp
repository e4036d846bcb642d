// Joining and indexing: cat, stack, split, chunk (views), embedding, gather, index_select.
// Kernels in backends/cpu/indexing.cpp; the dispatch stubs of kernels/indexing.h are defined here.
#include <algorithm>

#include "booster/autocast/autocast.h"
#include "booster/autograd/autograd.h"
#include "booster/kernels/elementwise.h"
#include "booster/kernels/indexing.h"
#include "booster/common/error_context.h"
#include "booster/ops/ops.h"
#include "booster/ops/ops_impl.h"

namespace booster::kernels {
BOOSTER_DEFINE_KERNEL(index_select_kernel);
BOOSTER_DEFINE_KERNEL(index_add_kernel);
BOOSTER_DEFINE_KERNEL(gather_kernel);
BOOSTER_DEFINE_KERNEL(scatter_add_kernel);
}  // namespace booster::kernels

namespace booster {

using autograd::grads;

namespace {

void check_index_dtype(const Tensor& index, const char* op) {
  BOOSTER_CHECK(index.dtype() == DType::Int64 || index.dtype() == DType::Int32, DTypeError, op,
                ": indices must be int64 or int32, got ", index.dtype());
}

// Every index in [0, size); the first offender is named. (Kernels may run in parallel regions and so
// never throw; the check is one pass over the indices, which are few next to the data they move.)
void check_index_range(const Tensor& index, int64_t size, const char* op, const char* what) {
  Tensor idx = index.detach().contiguous();
  if (!idx.device().is_cpu()) idx = idx.to(Device::cpu());
  BOOSTER_DISPATCH_INDEX(idx.dtype(), op, [&] {
    const scalar_t* p = static_cast<const scalar_t*>(idx.data_ptr());
    for (int64_t i = 0; i < idx.numel(); ++i) {
      const int64_t v = int64_t(p[i]);
      BOOSTER_CHECK(v >= 0 && v < size, IndexError, op, ": index ", v, " is out of range for ", what, " of size ",
                    size, " (expected 0 to ", size - 1, ")");
    }
  });
}

// a.index_select(dim, index) on detached tensors.
Tensor index_select_raw(const Tensor& a, int64_t dim, const Tensor& index) {
  Tensor src = a.contiguous();
  Tensor idx = index.contiguous();
  Shape s = a.shape();
  s[size_t(dim)] = idx.numel();
  Tensor out = Tensor::empty(s, a.dtype(), a.device());
  if (out.numel() > 0) kernels::index_select_kernel(a.device())(src, dim, idx, out);
  return out;
}

// zeros(shape) with src's rows added at index along dim (16-bit floats accumulate in float32).
Tensor index_add_into_zeros(const Shape& shape, DType dtype, int64_t dim, const Tensor& index, const Tensor& src) {
  const DType acc = is_low_precision(dtype) ? DType::Float32 : dtype;
  Tensor out = zeros(shape, acc, src.device());
  Tensor s = (src.dtype() == acc ? src : src.to(acc)).contiguous();
  kernels::index_add_kernel(src.device())(out, dim, index.contiguous(), s);
  return acc == dtype ? out : out.to(dtype);
}

}  // namespace

// --------------------------------------------------------------------------- joining

Tensor cat(const std::vector<Tensor>& tensors_in, int64_t dim_in) {
  BOOSTER_OP_CONTEXT("cat");  // Note [Error context]
  BOOSTER_CHECK(!tensors_in.empty(), ValueError, "cat: expected a non-empty list of tensors");
  std::vector<Tensor> tensors = tensors_in;
  autocast::apply(autocast::Op::Cat, tensors);
  // As PyTorch, 1-D empty tensors are skipped (the legacy way to start a running cat).
  const Tensor* ref = nullptr;
  for (const Tensor& t : tensors)
    if (!(t.dim() == 1 && t.numel() == 0)) {
      ref = &t;
      break;
    }
  if (ref == nullptr) ref = &tensors[0];
  BOOSTER_CHECK(ref->dim() > 0, ShapeError, "cat: zero-dimensional tensors cannot be concatenated; unsqueeze them "
                "or use stack");
  const int64_t dim = wrap_dim(dim_in, ref->dim(), "cat");
  DType dt = tensors[0].dtype();
  for (const Tensor& t : tensors) dt = promote_types(dt, t.dtype());
  Shape out_shape = ref->shape();
  out_shape[size_t(dim)] = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    check_same_device(*ref, t, "cat");
    if (t.dim() == 1 && t.numel() == 0) continue;
    bool match = t.dim() == ref->dim();
    for (int64_t d = 0; match && d < t.dim(); ++d)
      match = d == dim || t.shape()[size_t(d)] == ref->shape()[size_t(d)];
    BOOSTER_CHECK(match, ShapeError, "cat: tensor ", i, " has shape ", t.shape(), " but the first has shape ",
                  ref->shape(), "; sizes must match except in dimension ", dim);
    out_shape[size_t(dim)] += t.shape()[size_t(dim)];
  }
  Tensor out = Tensor::empty(out_shape, dt, ref->device());
  std::vector<int64_t> offsets;
  int64_t off = 0;
  for (const Tensor& t : tensors) {
    offsets.push_back(off);
    if (t.dim() == 1 && t.numel() == 0) continue;
    const int64_t len = t.shape()[size_t(dim)];
    if (len > 0) {
      Tensor dst = make_view(out, t.shape(), out.strides(), out.offset() + off * out.strides()[size_t(dim)]);
      kernels::copy_kernel(out.device())(t.detach(), dst);  // converts to the promoted dtype on the way
    }
    off += len;
  }
  if (autograd::needs_grad(tensors)) {
    std::vector<Shape> shapes;
    std::vector<DType> dtypes;
    for (const Tensor& t : tensors) {
      shapes.push_back(t.shape());
      dtypes.push_back(t.dtype());
    }
    autograd::record(out, "CatBackward", tensors, [shapes, dtypes, offsets, dim](const Tensor& g) {
      grads r(shapes.size());
      for (size_t i = 0; i < shapes.size(); ++i) {
        if (!is_floating(dtypes[i]) || (shapes[i].size() == 1 && shapes[i][0] == 0)) continue;
        Tensor piece = g.narrow(dim, offsets[i], shapes[i][size_t(dim)]);
        r[i] = piece.dtype() == dtypes[i] ? piece : piece.to(dtypes[i]);
      }
      return r;
    });
  }
  return out;
}

Tensor stack(const std::vector<Tensor>& tensors_in, int64_t dim_in) {
  BOOSTER_OP_CONTEXT("stack");
  BOOSTER_CHECK(!tensors_in.empty(), ValueError, "stack: expected a non-empty list of tensors");
  std::vector<Tensor> tensors = tensors_in;
  autocast::apply(autocast::Op::Stack, tensors);
  const int64_t dim = wrap_dim(dim_in, tensors[0].dim() + 1, "stack");
  std::vector<Tensor> parts;
  parts.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    BOOSTER_CHECK(tensors[i].shape() == tensors[0].shape(), ShapeError, "stack: tensor ", i, " has shape ",
                  tensors[i].shape(), " but tensor 0 has shape ", tensors[0].shape(), "; all must have one shape");
    parts.push_back(tensors[i].unsqueeze(dim));
  }
  return cat(parts, dim);
}

std::vector<Tensor> split(const Tensor& a, int64_t split_size, int64_t dim_in) {
  BOOSTER_OP_CONTEXT("split");
  BOOSTER_CHECK(a.dim() > 0, ShapeError, "split: expected a tensor with at least 1 dim, got a scalar");
  const int64_t dim = wrap_dim(dim_in, a.dim(), "split");
  const int64_t n = a.shape()[size_t(dim)];
  BOOSTER_CHECK(split_size > 0 || (split_size == 0 && n == 0), ValueError, "split: split_size must be positive, got ",
                split_size, " for dimension ", dim, " of size ", n);
  std::vector<Tensor> pieces;
  if (n == 0) {
    pieces.push_back(a.narrow(dim, 0, 0));
    return pieces;
  }
  for (int64_t start = 0; start < n; start += split_size) pieces.push_back(a.narrow(dim, start, std::min(split_size, n - start)));
  return pieces;
}

std::vector<Tensor> chunk(const Tensor& a, int64_t chunks, int64_t dim_in) {
  BOOSTER_OP_CONTEXT("chunk");
  BOOSTER_CHECK(chunks > 0, ValueError, "chunk: the number of chunks must be positive, got ", chunks);
  BOOSTER_CHECK(a.dim() > 0, ShapeError, "chunk: expected a tensor with at least 1 dim, got a scalar");
  const int64_t dim = wrap_dim(dim_in, a.dim(), "chunk");
  const int64_t n = a.shape()[size_t(dim)];
  if (n == 0) return std::vector<Tensor>(size_t(chunks), a.narrow(dim, 0, 0));
  // As torch.chunk: pieces of ceil(n / chunks), so there may be fewer than `chunks`.
  return split(a, (n + chunks - 1) / chunks, dim);
}

// --------------------------------------------------------------------------- indexing

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  BOOSTER_OP_CONTEXT("embedding");
  BOOSTER_CHECK(weight.dim() == 2, ShapeError, "embedding: weight must be 2-D [num_embeddings, dim], got shape ",
                weight.shape());
  check_index_dtype(indices, "embedding");
  check_same_device(weight, indices, "embedding");
  const int64_t V = weight.shape()[0], D = weight.shape()[1];
  check_index_range(indices, V, "embedding", "an embedding table");
  Tensor flat = indices.detach().reshape({-1});
  Tensor rows = index_select_raw(weight.detach(), 0, flat);
  Shape s = indices.shape();
  s.push_back(D);
  Tensor out = make_view(rows, s, contiguous_strides(s), 0);
  autograd::record(out, "EmbeddingBackward", {weight}, [flat, V, D, dt = weight.dtype()](const Tensor& g) {
    // Rows of the gradient added into a dense zero gradient of the weight's shape.
    return grads{index_add_into_zeros({V, D}, dt, 0, flat, g.reshape({-1, D}))};
  });
  return out;
}

Tensor index_select(const Tensor& a, int64_t dim_in, const Tensor& index) {
  BOOSTER_OP_CONTEXT("index_select");
  BOOSTER_CHECK(a.dim() > 0, ShapeError, "index_select: expected a tensor with at least 1 dim, got a scalar");
  const int64_t dim = wrap_dim(dim_in, a.dim(), "index_select");
  check_index_dtype(index, "index_select");
  check_same_device(a, index, "index_select");
  BOOSTER_CHECK(index.dim() <= 1, ShapeError, "index_select: index must be 0-D or 1-D, got shape ", index.shape());
  check_index_range(index, a.shape()[size_t(dim)], "index_select", str("dimension ", dim).c_str());
  Tensor flat = index.detach().reshape({-1});
  Tensor out = index_select_raw(a.detach(), dim, flat);
  autograd::record(out, "IndexSelectBackward", {a}, [flat, dim, shape = a.shape(), dt = a.dtype()](const Tensor& g) {
    return grads{index_add_into_zeros(shape, dt, dim, flat, g)};
  });
  return out;
}

Tensor gather(const Tensor& a, int64_t dim_in, const Tensor& index) {
  BOOSTER_OP_CONTEXT("gather");
  check_index_dtype(index, "gather");
  check_same_device(a, index, "gather");
  BOOSTER_CHECK(index.dim() == a.dim(), ShapeError, "gather: index shape ", index.shape(),
                " must have as many dims as the input shape ", a.shape());
  const int64_t dim = wrap_dim(dim_in, a.dim(), "gather");
  for (int64_t d = 0; d < a.dim(); ++d)
    BOOSTER_CHECK(d == dim || index.shape()[size_t(d)] <= a.shape()[size_t(d)], ShapeError, "gather: index shape ",
                  index.shape(), " exceeds the input shape ", a.shape(), " in dimension ", d);
  const int64_t n = a.dim() == 0 ? 1 : a.shape()[size_t(dim)];
  check_index_range(index, n, "gather", str("dimension ", dim).c_str());
  Tensor out = Tensor::empty(index.shape(), a.dtype(), a.device());
  if (a.dim() == 0) {
    NoGradGuard ng;
    out.copy_(a);
  } else if (out.numel() > 0) {
    kernels::gather_kernel(a.device())(a.detach(), dim, index.detach(), out);
  }
  autograd::record(out, "GatherBackward", {a}, [idx = index.detach(), dim, shape = a.shape(), dt = a.dtype()](const Tensor& g) {
    if (shape.empty()) return grads{g.reshape({})};
    const DType acc = is_low_precision(dt) ? DType::Float32 : dt;
    Tensor ga = zeros(shape, acc, g.device());
    Tensor src = g.dtype() == acc ? g : g.to(acc);
    kernels::scatter_add_kernel(g.device())(ga, dim, idx, src);
    return grads{acc == dt ? ga : ga.to(dt)};
  });
  return out;
}

}  // namespace booster
