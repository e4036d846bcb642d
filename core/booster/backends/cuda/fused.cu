// CUDA fused multi-tensor kernels (kernels/fused.h): unscale + inf/NaN check into a device flag,
// sums of squares for the gradient norm, zero counts, and the Adam/AdamW and SGD updates. Each takes
// a whole flat span per launch; results that the host needs (found_inf, the norm) stay on the device
// until the caller reads them once per step.
#include "booster/backends/cuda/common.cuh"
#include "booster/kernels/fused.h"

namespace booster::cuda {
namespace {

template <class T>
const dev_t<T>* cptr(const Tensor& t) {
  return static_cast<const dev_t<T>*>(t.data_ptr());
}

template <class F>
void dispatch_grad(const Tensor& t, F&& f) {
  switch (t.dtype()) {
    case DType::Float32: return f(float{});
    case DType::Float16: return f(Half{});
    case DType::BFloat16: return f(BFloat16{});
    default: BOOSTER_FAIL(DTypeError, "gradient pass: expected float32, float16 or bfloat16, got ", t.dtype());
  }
}

__device__ __forceinline__ bool nonfinite(float v) { return (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u; }

template <class S, class D>
__global__ void unscale_kernel(const S* src, D* dst, int64_t n, float inv_scale, bool write, int* found) {
  bool bad = false;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = load_as<float>(src[i]);
    bad |= nonfinite(v);
    if (write) dst[i] = store_as<D>(v * inv_scale);
  }
  if (__any_sync(0xffffffffu, bad) && (threadIdx.x & 31) == 0) *found = 1;
}

void cuda_unscale_check(const Tensor& src, const Tensor& dst, float inv_scale, Tensor& found) {
  const int dev = device_of(src);
  const int64_t n = src.numel();
  if (n == 0) return;
  const bool in_place = src.data_ptr() == dst.data_ptr();
  BOOSTER_CHECK(in_place || dst.dtype() == DType::Float32, DTypeError,
                "fused_unscale_and_check: destination must be float32 or the source itself, got ", dst.dtype());
  int* flag = static_cast<int*>(found.data_ptr());
  dispatch_grad(src, [&](auto tag) {
    using S = dev_t<decltype(tag)>;
    const S* ps = cptr<decltype(tag)>(src);
    if (in_place) {
      unscale_kernel<S, S><<<grid_for(dev, n), 256, 0, stream(dev)>>>(ps, const_cast<S*>(ps), n, inv_scale,
                                                                  inv_scale != 1.0f, flag);
    } else {
      unscale_kernel<S, float><<<grid_for(dev, n), 256, 0, stream(dev)>>>(ps, static_cast<float*>(dst.data_ptr()), n,
                                                                      inv_scale, true, flag);
    }
    BOOSTER_CUDA_CHECK_LAUNCH();
  });
}

template <class S>
__global__ void sum_squares_kernel(const S* x, int64_t n, double* acc) {
  __shared__ float shared[32];
  float s = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = load_as<float>(x[i]);
    s += v * v;
  }
  s = block_sum(s, shared);
  if (threadIdx.x == 0) atomicAdd(acc, double(s));
}

void cuda_sum_squares(const Tensor& t, Tensor& acc) {
  const int dev = device_of(t);
  const int64_t n = t.numel();
  if (n == 0) return;
  dispatch_grad(t, [&](auto tag) {
    using S = dev_t<decltype(tag)>;
    sum_squares_kernel<S><<<grid_for(dev, n), 256, 0, stream(dev)>>>(cptr<decltype(tag)>(t), n,
                                                                 static_cast<double*>(acc.data_ptr()));
    BOOSTER_CUDA_CHECK_LAUNCH();
  });
}

template <class S>
__global__ void count_zeros_kernel(const S* x, int64_t n, unsigned long long* acc) {
  __shared__ int64_t shared[32];
  int64_t c = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    c += load_as<float>(x[i]) == 0.0f;
  c = block_sum(c, shared);
  if (threadIdx.x == 0) atomicAdd(acc, static_cast<unsigned long long>(c));
}

void cuda_count_zeros(const Tensor& t, Tensor& acc) {
  const int dev = device_of(t);
  const int64_t n = t.numel();
  if (n == 0) return;
  dispatch_grad(t, [&](auto tag) {
    using S = dev_t<decltype(tag)>;
    count_zeros_kernel<S><<<grid_for(dev, n), 256, 0, stream(dev)>>>(
        cptr<decltype(tag)>(t), n, static_cast<unsigned long long*>(acc.data_ptr()));
    BOOSTER_CUDA_CHECK_LAUNCH();
  });
}

// The CPU's adam_update (backends/cpu/optimizers.cpp) element by element, same order of operations.
template <class P, class S>
__global__ void adam_kernel(P* p, const P* g, S* m, S* v, S* vmax, int64_t n, S beta1, S beta2, S omb1, S omb2,
                            S wd, S decay, S neg_step, S bc2_sqrt, S eps, bool decoupled, bool use_wd) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    S pv = load_as<S>(p[i]);
    S gv = load_as<S>(g[i]);
    if (!decoupled && use_wd) gv = gv + wd * pv;
    const S mv = m[i] * beta1 + omb1 * gv;
    S vv = v[i] * beta2 + omb2 * gv * gv;
    m[i] = mv;
    v[i] = vv;
    if (vmax) {
      const S vm = vmax[i];
      vv = (vv < vm || vm != vm) ? vm : vv;  // torch.maximum: NaN stays (fmax would drop it)
      vmax[i] = vv;
    }
    if (decoupled) pv = pv * decay;
    const S denom = sqrt(vv) / bc2_sqrt + eps;
    p[i] = store_as<P>(pv + neg_step * mv / denom);
  }
}

void cuda_adam(const kernels::AdamStep& s, Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
               Tensor& max_exp_avg_sq) {
  const int dev = device_of(param);
  const int64_t n = param.numel();
  if (n == 0) return;
  BOOSTER_DISPATCH_FLOATING(param.dtype(), "Adam.step", [&] {
    using P = dev_t<scalar_t>;
    using S = acc_t<scalar_t>;
    S* vmax = max_exp_avg_sq.defined() ? static_cast<S*>(max_exp_avg_sq.data_ptr()) : nullptr;
    adam_kernel<P, S><<<grid_for(dev, n), 256, 0, stream(dev)>>>(
        static_cast<P*>(param.data_ptr()), static_cast<const P*>(grad.data_ptr()), static_cast<S*>(exp_avg.data_ptr()),
        static_cast<S*>(exp_avg_sq.data_ptr()), vmax, n, S(s.beta1), S(s.beta2), S(s.one_minus_beta1),
        S(s.one_minus_beta2), S(s.weight_decay), S(s.decay), S(s.neg_step_size), S(s.bias_correction2_sqrt), S(s.eps),
        s.decoupled, s.weight_decay != 0.0);
    BOOSTER_CUDA_CHECK_LAUNCH();
  });
}

// The CPU's sgd_update (backends/cpu/optimizers.cpp) element by element, same order of operations. buf is
// null without momentum; `first` sets buf = d (torch clones the first direction, without dampening).
template <class P, class S>
__global__ void sgd_kernel(P* p, const P* g, S* buf, int64_t n, S neg_lr, S wd, S momentum, S omd, bool use_wd,
                           bool nesterov, bool first) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const S pv = load_as<S>(p[i]);
    S d = load_as<S>(g[i]);
    if (use_wd) d = d + wd * pv;
    if (buf) {
      const S b = first ? d : buf[i] * momentum + omd * d;
      buf[i] = b;
      d = nesterov ? d + momentum * b : b;
    }
    p[i] = store_as<P>(pv + neg_lr * d);
  }
}

void cuda_sgd(const kernels::SGDStep& s, Tensor& param, const Tensor& grad, Tensor& momentum_buffer) {
  const int dev = device_of(param);
  const int64_t n = param.numel();
  if (n == 0) return;
  BOOSTER_DISPATCH_FLOATING(param.dtype(), "SGD.step", [&] {
    using P = dev_t<scalar_t>;
    using S = acc_t<scalar_t>;
    S* buf = momentum_buffer.defined() ? static_cast<S*>(momentum_buffer.data_ptr()) : nullptr;
    sgd_kernel<P, S><<<grid_for(dev, n), 256, 0, stream(dev)>>>(
        static_cast<P*>(param.data_ptr()), static_cast<const P*>(grad.data_ptr()), buf, n, S(s.neg_lr),
        S(s.weight_decay), S(s.momentum), S(s.one_minus_dampening), s.weight_decay != 0.0, s.nesterov, s.first);
    BOOSTER_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace
}  // namespace booster::cuda

namespace booster::kernels {
BOOSTER_REGISTER_CUDA_KERNEL(unscale_check_kernel, cuda::cuda_unscale_check);
BOOSTER_REGISTER_CUDA_KERNEL(sum_squares_kernel, cuda::cuda_sum_squares);
BOOSTER_REGISTER_CUDA_KERNEL(count_zeros_kernel, cuda::cuda_count_zeros);
BOOSTER_REGISTER_CUDA_KERNEL(adam_kernel, cuda::cuda_adam);
BOOSTER_REGISTER_CUDA_KERNEL(sgd_kernel, cuda::cuda_sgd);
}  // namespace booster::kernels
