// CPU indexing kernels: index_select (embedding's row copy), index_add (its gradient), gather and
// scatter_add.
#include <cstring>

#include "booster/backends/cpu/loops.h"
#include "booster/kernels/indexing.h"

namespace booster::cpu {
namespace {

// a viewed as [outer, n, inner] around dim (a contiguous).
struct AroundDim {
  int64_t outer = 1, n = 1, inner = 1;
  AroundDim(const Shape& s, int64_t dim) {
    for (int64_t d = 0; d < int64_t(s.size()); ++d) {
      if (d < dim) outer *= s[size_t(d)];
      else if (d == dim) n = s[size_t(d)];
      else inner *= s[size_t(d)];
    }
  }
};

void cpu_index_select(const Tensor& a, int64_t dim, const Tensor& index, Tensor& out) {
  const AroundDim g(a.shape(), dim);
  const int64_t len = index.numel();
  const size_t row_bytes = size_t(g.inner) * itemsize(a.dtype());
  const char* src = static_cast<const char*>(a.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  BOOSTER_DISPATCH_INDEX(index.dtype(), "index_select", [&] {
    const scalar_t* idx = static_cast<const scalar_t*>(index.data_ptr());
    // Each (outer, i) pair is one row copy of `inner` elements.
    parallel_for(g.outer * len, g.inner, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const int64_t o = r / len, i = r % len;
        std::memcpy(dst + size_t(r) * row_bytes, src + size_t(o * g.n + int64_t(idx[i])) * row_bytes, row_bytes);
      }
    });
  });
}

void cpu_index_add(Tensor& out, int64_t dim, const Tensor& index, const Tensor& src) {
  const AroundDim g(out.shape(), dim);
  const int64_t len = index.numel();
  BOOSTER_DISPATCH_ALL(out.dtype(), "index_add", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    T* po = static_cast<T*>(out.data_ptr());
    const T* ps = static_cast<const T*>(src.data_ptr());
    BOOSTER_DISPATCH_INDEX(index.dtype(), "index_add", [&] {
      const scalar_t* idx = static_cast<const scalar_t*>(index.data_ptr());
      // Repeated indices write the same row, so threads split the columns, never the indices.
      constexpr int64_t kCols = 512;
      const int64_t nblocks = (g.inner + kCols - 1) / kCols;
      parallel_for(g.outer * nblocks, len * std::min(kCols, g.inner), [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
          const int64_t o = t / nblocks, c0 = (t % nblocks) * kCols, cn = std::min(kCols, g.inner - c0);
          for (int64_t i = 0; i < len; ++i) {
            T* dst = po + (o * g.n + int64_t(idx[i])) * g.inner + c0;
            const T* s = ps + (o * len + i) * g.inner + c0;
            for (int64_t j = 0; j < cn; ++j) dst[j] = T(A(dst[j]) + A(s[j]));
          }
        }
      });
    });
  });
}

// a's strides with dim's stride zeroed: the base address of each gather, before the index moves it.
Shape strides_without(const Tensor& a, int64_t dim) {
  Shape st = a.strides();
  st[size_t(dim)] = 0;
  return st;
}

void cpu_gather(const Tensor& a, int64_t dim, const Tensor& index, Tensor& out) {
  const Shape a_st = strides_without(a, dim);
  const int64_t dim_stride = a.strides()[size_t(dim)];
  BOOSTER_DISPATCH_ALL(a.dtype(), "gather", [&] {
    using T = scalar_t;
    const T* pa = static_cast<const T*>(a.data_ptr());
    T* po = static_cast<T*>(out.data_ptr());
    BOOSTER_DISPATCH_INDEX(index.dtype(), "gather", [&] {
      using I = scalar_t;
      const I* pi = static_cast<const I*>(index.data_ptr());
      strided_loop<3>(index.shape(), {&a_st, &index.strides(), &out.strides()},
                      [&](int64_t n, const int64_t* off, const int64_t* st) {
                        for (int64_t k = 0; k < n; ++k)
                          po[off[2] + k * st[2]] = pa[off[0] + k * st[0] + int64_t(pi[off[1] + k * st[1]]) * dim_stride];
                      });
    });
  });
}

void cpu_scatter_add(Tensor& out, int64_t dim, const Tensor& index, const Tensor& src) {
  const Shape o_st = strides_without(out, dim);
  const int64_t dim_stride = out.strides()[size_t(dim)];
  const Shape& shape = index.shape();
  const size_t nd = shape.size();
  if (index.numel() == 0) return;
  BOOSTER_DISPATCH_ALL(out.dtype(), "scatter_add", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    T* po = static_cast<T*>(out.data_ptr());
    const T* ps = static_cast<const T*>(src.data_ptr());
    BOOSTER_DISPATCH_INDEX(index.dtype(), "scatter_add", [&] {
      const scalar_t* pi = static_cast<const scalar_t*>(index.data_ptr());
      // Serial: different index entries may hit the same output element.
      std::vector<int64_t> pos(nd, 0);
      int64_t oo = 0, io = 0, so = 0;
      for (int64_t k = 0, total = index.numel(); k < total; ++k) {
        T& dst = po[oo + int64_t(pi[io]) * dim_stride];
        dst = T(A(dst) + A(ps[so]));
        for (size_t d = nd; d-- > 0;) {
          oo += o_st[d];
          io += index.strides()[d];
          so += src.strides()[d];
          if (++pos[d] < shape[d]) break;
          oo -= shape[d] * o_st[d];
          io -= shape[d] * index.strides()[d];
          so -= shape[d] * src.strides()[d];
          pos[d] = 0;
        }
      }
    });
  });
}

}  // namespace
}  // namespace booster::cpu

namespace booster::kernels {
BOOSTER_REGISTER_CPU_KERNEL(index_select_kernel, &cpu::cpu_index_select);
BOOSTER_REGISTER_CPU_KERNEL(index_add_kernel, &cpu::cpu_index_add);
BOOSTER_REGISTER_CPU_KERNEL(gather_kernel, &cpu::cpu_gather);
BOOSTER_REGISTER_CPU_KERNEL(scatter_add_kernel, &cpu::cpu_scatter_add);
}  // namespace booster::kernels
