// Indexing kernels: row selection, gathers and their scatter-add adjoints.
//
// Contract: indices are int64 or int32 and already checked to lie in range by the op (kernels do not
// throw: they may run inside parallel regions). Outputs are allocated by the caller; accumulating
// kernels add into what `out` already holds.
#pragma once

#include "booster/kernels/dispatch.h"
#include "booster/tensor/tensor.h"

namespace booster::kernels {

// out = a.index_select(dim, index): a contiguous, index 1-D, out contiguous with a's shape except
// out.shape[dim] = index.numel().
BOOSTER_DECLARE_KERNEL(index_select_kernel, void(const Tensor& a, int64_t dim, const Tensor& index, Tensor& out));
// out[..., index[i], ...] += src[..., i, ...] along dim: out and src contiguous, index 1-D.
BOOSTER_DECLARE_KERNEL(index_add_kernel, void(Tensor& out, int64_t dim, const Tensor& index, const Tensor& src));
// out[i...] = a[i... with i_dim replaced by index[i...]]: index and out have the same shape, any strides.
BOOSTER_DECLARE_KERNEL(gather_kernel, void(const Tensor& a, int64_t dim, const Tensor& index, Tensor& out));
// out[i... with i_dim replaced by index[i...]] += src[i...]: the adjoint of gather.
BOOSTER_DECLARE_KERNEL(scatter_add_kernel, void(Tensor& out, int64_t dim, const Tensor& index, const Tensor& src));

}  // namespace booster::kernels
