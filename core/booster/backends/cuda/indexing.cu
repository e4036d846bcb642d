// CUDA indexing kernels (kernels/indexing.h): index_select, index_add, gather, scatter_add.
// Indices were range-checked by the op. The accumulating kernels use atomicAdd, so the order in which
// duplicate indices add up is not fixed (as PyTorch's CUDA index_add_/scatter_add_).
#include "booster/backends/cuda/common.cuh"
#include "booster/kernels/indexing.h"

namespace booster::cuda {
namespace {

template <class T>
__device__ __forceinline__ void atomic_add(T* p, T v) {
  if constexpr (std::is_same_v<T, int64_t>) {
    atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
  } else if constexpr (std::is_same_v<T, bool>) {
    if (v) *p = true;
  } else {
    atomicAdd(p, v);
  }
}

// Geometry of a contiguous tensor around `dim`: [outer, size, inner].
struct Around {
  int64_t outer = 1, size = 1, inner = 1;
};
Around around(const Shape& s, int64_t dim) {
  Around g;
  for (int64_t d = 0; d < int64_t(s.size()); ++d) {
    if (d < dim) g.outer *= s[size_t(d)];
    else if (d == dim) g.size = s[size_t(d)];
    else g.inner *= s[size_t(d)];
  }
  return g;
}

void cuda_index_select(const Tensor& a, int64_t dim, const Tensor& index, Tensor& out) {
  const int dev = device_of(out);
  const Around ga = around(a.shape(), dim);
  const int64_t n = index.numel(), inner = ga.inner, asize = ga.size;
  BOOSTER_DISPATCH_ALL(a.dtype(), "index_select", [&] {
    using T = dev_t<scalar_t>;
    const T* pa = static_cast<const T*>(a.data_ptr());
    T* po = static_cast<T*>(out.data_ptr());
    BOOSTER_DISPATCH_INDEX(index.dtype(), "index_select", [&] {
      const scalar_t* pi = static_cast<const scalar_t*>(index.data_ptr());
      const Shape shape{out.numel()};
      const Shape st{1};
      launch_elementwise<1>(dev, shape, {&st}, [=] __device__(const int64_t(&o)[1]) {
        const int64_t e = o[0], in = e % inner, rest = e / inner, i = rest % n, ou = rest / n;
        po[e] = pa[(ou * asize + int64_t(pi[i])) * inner + in];
      });
    });
  });
}

void cuda_index_add(Tensor& out, int64_t dim, const Tensor& index, const Tensor& src) {
  const int dev = device_of(out);
  const Around go = around(out.shape(), dim);
  const int64_t n = index.numel(), inner = go.inner, osize = go.size;
  BOOSTER_DISPATCH_ALL(out.dtype(), "index_add", [&] {
    using T = dev_t<scalar_t>;
    const T* ps = static_cast<const T*>(src.data_ptr());
    T* po = static_cast<T*>(out.data_ptr());
    BOOSTER_DISPATCH_INDEX(index.dtype(), "index_add", [&] {
      const scalar_t* pi = static_cast<const scalar_t*>(index.data_ptr());
      const Shape shape{src.numel()};
      const Shape st{1};
      launch_elementwise<1>(dev, shape, {&st}, [=] __device__(const int64_t(&o)[1]) {
        const int64_t e = o[0], in = e % inner, rest = e / inner, i = rest % n, ou = rest / n;
        atomic_add(po + (ou * osize + int64_t(pi[i])) * inner + in, ps[e]);
      });
    });
  });
}

// Offsets over index's shape: a (or out) with the dim's stride zeroed, index, and the other operand.
void cuda_gather(const Tensor& a, int64_t dim, const Tensor& index, Tensor& out) {
  const int dev = device_of(out);
  Shape a_st = a.strides();
  const int64_t dim_stride = a_st[size_t(dim)];
  a_st[size_t(dim)] = 0;
  BOOSTER_DISPATCH_ALL(a.dtype(), "gather", [&] {
    using T = dev_t<scalar_t>;
    const T* pa = static_cast<const T*>(a.data_ptr());
    T* po = static_cast<T*>(out.data_ptr());
    BOOSTER_DISPATCH_INDEX(index.dtype(), "gather", [&] {
      const scalar_t* pi = static_cast<const scalar_t*>(index.data_ptr());
      launch_elementwise<3>(dev, index.shape(), {&a_st, &index.strides(), &out.strides()},
                            [=] __device__(const int64_t(&o)[3]) {
                              po[o[2]] = pa[o[0] + int64_t(pi[o[1]]) * dim_stride];
                            });
    });
  });
}

void cuda_scatter_add(Tensor& out, int64_t dim, const Tensor& index, const Tensor& src) {
  const int dev = device_of(out);
  Shape o_st = out.strides();
  const int64_t dim_stride = o_st[size_t(dim)];
  o_st[size_t(dim)] = 0;
  BOOSTER_DISPATCH_ALL(out.dtype(), "scatter_add", [&] {
    using T = dev_t<scalar_t>;
    const T* ps = static_cast<const T*>(src.data_ptr());
    T* po = static_cast<T*>(out.data_ptr());
    BOOSTER_DISPATCH_INDEX(index.dtype(), "scatter_add", [&] {
      const scalar_t* pi = static_cast<const scalar_t*>(index.data_ptr());
      launch_elementwise<3>(dev, index.shape(), {&o_st, &index.strides(), &src.strides()},
                            [=] __device__(const int64_t(&o)[3]) {
                              atomic_add(po + o[0] + int64_t(pi[o[1]]) * dim_stride, ps[o[2]]);
                            });
    });
  });
}

}  // namespace
}  // namespace booster::cuda

namespace booster::kernels {
BOOSTER_REGISTER_CUDA_KERNEL(index_select_kernel, cuda::cuda_index_select);
BOOSTER_REGISTER_CUDA_KERNEL(index_add_kernel, cuda::cuda_index_add);
BOOSTER_REGISTER_CUDA_KERNEL(gather_kernel, cuda::cuda_gather);
BOOSTER_REGISTER_CUDA_KERNEL(scatter_add_kernel, cuda::cuda_scatter_add);
}  // namespace booster::kernels
