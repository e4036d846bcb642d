// CPU copy (with dtype conversion, float8 included) and fill.
#include <cstring>

#include "booster/backends/cpu/loops.h"
#include "booster/kernels/elementwise.h"

namespace booster::cpu {
namespace {

template <class S, class D>
void copy_typed(const Tensor& src, Tensor& dst) {
  const S* s = static_cast<const S*>(src.data_ptr());
  D* d = static_cast<D*>(dst.data_ptr());
  strided_loop<2>(dst.shape(), {&src.strides(), &dst.strides()}, [&](int64_t n, const int64_t* off, const int64_t* st) {
    const S* sp = s + off[0];
    D* dp = d + off[1];
    if (st[0] == 1 && st[1] == 1) {
      if constexpr (std::is_same_v<S, D>) {
        std::memcpy(dp, sp, size_t(n) * sizeof(S));
      } else if constexpr (std::is_same_v<S, Half> && std::is_same_v<D, float>) {
        half_to_float(sp, dp, n);
      } else if constexpr (std::is_same_v<S, float> && std::is_same_v<D, Half>) {
        float_to_half(sp, dp, n);
      } else if constexpr (std::is_same_v<S, BFloat16> && std::is_same_v<D, float>) {
        bf16_to_float(sp, dp, n);
      } else if constexpr (std::is_same_v<S, float> && std::is_same_v<D, BFloat16>) {
        float_to_bf16(sp, dp, n);
      } else {
        for (int64_t i = 0; i < n; ++i) dp[i] = static_cast<D>(static_cast<acc_t<S>>(sp[i]));
      }
    } else {
      for (int64_t i = 0; i < n; ++i) dp[i * st[1]] = static_cast<D>(static_cast<acc_t<S>>(sp[i * st[0]]));
    }
  });
}

// bool targets take "nonzero", like PyTorch's .to(torch.bool).
template <class S>
void copy_to_bool(const Tensor& src, Tensor& dst) {
  const S* s = static_cast<const S*>(src.data_ptr());
  bool* d = static_cast<bool*>(dst.data_ptr());
  strided_loop<2>(dst.shape(), {&src.strides(), &dst.strides()}, [&](int64_t n, const int64_t* off, const int64_t* st) {
    for (int64_t i = 0; i < n; ++i) d[off[1] + i * st[1]] = static_cast<acc_t<S>>(s[off[0] + i * st[0]]) != acc_t<S>(0);
  });
}

void cpu_copy(const Tensor& src, Tensor& dst) {
  BOOSTER_DISPATCH_STORAGE(src.dtype(), "copy", [&] {
    using S = scalar_t;
    if (dst.dtype() == DType::Bool) return copy_to_bool<S>(src, dst);
    BOOSTER_DISPATCH_STORAGE(dst.dtype(), "copy", [&] {
      if constexpr (!std::is_same_v<scalar_t, bool>) copy_typed<S, scalar_t>(src, dst);
    });
  });
}

void cpu_fill(Tensor& dst, double value) {
  BOOSTER_DISPATCH_STORAGE(dst.dtype(), "fill", [&] {
    const scalar_t v = static_cast<scalar_t>(static_cast<acc_t<scalar_t>>(value));
    scalar_t* d = static_cast<scalar_t*>(dst.data_ptr());
    strided_loop<1>(dst.shape(), {&dst.strides()}, [&](int64_t n, const int64_t* off, const int64_t* st) {
      scalar_t* p = d + off[0];
      if (st[0] == 1) std::fill(p, p + n, v);
      else for (int64_t i = 0; i < n; ++i) p[i * st[0]] = v;
    });
  });
}

}  // namespace
}  // namespace booster::cpu

namespace booster::kernels {
BOOSTER_REGISTER_CPU_KERNEL(copy_kernel, &cpu::cpu_copy);
BOOSTER_REGISTER_CPU_KERNEL(fill_kernel, &cpu::cpu_fill);
}  // namespace booster::kernels
