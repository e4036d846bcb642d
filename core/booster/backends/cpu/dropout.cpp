// CPU dropout: the kept elements scaled, the others zero (kernels/nn.h masked_scale).
#include "booster/backends/cpu/nn_common.h"

namespace booster::cpu {
namespace {

void cpu_masked_scale(const Tensor& x, const Tensor& keep, double scale, Tensor& out) {
  BOOSTER_DISPATCH_FLOATING(x.dtype(), "dropout", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const T* px = cptr<T>(x);
    const bool* pk = keep.data<bool>();
    T* py = mptr<T>(out);
    const A s = A(scale);
    parallel_for(x.numel(), 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) py[i] = T(pk[i] ? A(px[i]) * s : A(0));
    });
  });
}

}  // namespace
}  // namespace booster::cpu

namespace booster::kernels {
BOOSTER_REGISTER_CPU_KERNEL(masked_scale_kernel, &cpu::cpu_masked_scale);
}  // namespace booster::kernels
