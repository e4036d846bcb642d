// CUDA elementwise kernels: copy (with dtype conversion), fill, binary, unary, unary backward, where
// and masked scale. Same contracts and formulas as backends/cpu/elementwise.cpp: compute in float for
// 16-bit floats, round once to the output type. One kernel per dtype with the op chosen at run time
// (a uniform branch): it keeps the number of instantiations, and so CI's compile time, small.
#include "booster/backends/cuda/common.cuh"
#include "booster/kernels/elementwise.h"
#include "booster/kernels/nn.h"

namespace booster::cuda {
namespace {

using kernels::BinaryOp;
using kernels::UnaryBackwardOp;
using kernels::UnaryOp;

template <class C>
__device__ __forceinline__ C gelu_tanh_s(C x) {  // 0.5 (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3)
  const C u = C(0.7978845608028654) * (x + C(0.044715) * x * x * x);
  return C(1) / (C(1) + exp(C(-2) * u));
}

// One element from S to D: through float for the float types, through double where float64 or an
// integer is involved (exact), and bool as "nonzero".
template <class D, class S>
__device__ __forceinline__ D convert(S v) {
  if constexpr (std::is_same_v<S, D>) return v;
  else if constexpr (std::is_same_v<D, bool>) return load_as<double>(v) != 0.0;
  else if constexpr (std::is_same_v<S, double> || std::is_same_v<D, double> || std::is_integral_v<S> ||
                     std::is_integral_v<D>)
    return store_as<D>(load_as<double>(v));
  else return store_as<D>(load_as<float>(v));
}

void cuda_copy_impl(const Tensor& src, Tensor& dst);

// Under BOOSTER_CUDA_PROFILE each kind of copy (dtypes, layout, size) also gets a row of its own.
void cuda_copy(const Tensor& src, Tensor& dst) {
  if (!profiling()) return cuda_copy_impl(src, dst);
  synchronize(dst.device().index);
  const double t0 = profile_clock();
  cuda_copy_impl(src, dst);
  synchronize(dst.device().index);
  const std::string key = str("  copy ", src.dtype(), "->", dst.dtype(), src.is_contiguous() ? "" : " strided-src",
                              dst.is_contiguous() ? "" : " strided-dst", " ", src.shape());
  profile_add(key.c_str(), profile_clock() - t0);
}

void cuda_copy_impl(const Tensor& src, Tensor& dst) {
  const int dev = device_of(dst);
  BOOSTER_DISPATCH_ALL(src.dtype(), "copy", [&] {
    using S = dev_t<scalar_t>;
    const S* ps = static_cast<const S*>(src.data_ptr());
    BOOSTER_DISPATCH_ALL(dst.dtype(), "copy", [&] {
      using D = dev_t<scalar_t>;
      D* pd = static_cast<D*>(dst.data_ptr());
      launch_elementwise<2>(dev, dst.shape(), {&src.strides(), &dst.strides()},
                            [=] __device__(const int64_t(&o)[2]) {
                              const S v = ps[o[0]];
                              D* out = pd + o[1];
                              *out = convert<D>(v);
                            });
    });
  });
}

// A host double as the device element type (16-bit floats rounded to nearest even on the host).
template <class D>
D host_value(double value) {
  if constexpr (std::is_same_v<D, __half>) return D(__half_raw{Half(float(value)).bits});
  else if constexpr (std::is_same_v<D, __nv_bfloat16>) return D(__nv_bfloat16_raw{BFloat16(float(value)).bits});
  else return D(value);
}

void cuda_fill(Tensor& dst, double value) {
  const int dev = device_of(dst);
  BOOSTER_DISPATCH_ALL(dst.dtype(), "fill", [&] {
    using D = dev_t<scalar_t>;
    D* pd = static_cast<D*>(dst.data_ptr());
    const D v = host_value<D>(value);
    launch_elementwise<1>(dev, dst.shape(), {&dst.strides()}, [=] __device__(const int64_t(&o)[1]) { pd[o[0]] = v; });
  });
}

template <class C>
__device__ __forceinline__ C binary_apply(BinaryOp op, C x, C y, C alpha) {
  switch (op) {
    case BinaryOp::Add: return x + alpha * y;
    case BinaryOp::Sub: return x - alpha * y;
    case BinaryOp::Mul: return x * y;
    case BinaryOp::Div:
      if constexpr (std::is_integral_v<C>) return y == 0 ? C(0) : C(x / y);
      else return x / y;
    case BinaryOp::Pow:
      if constexpr (std::is_integral_v<C>) return C(pow(double(x), double(y)));
      else return pow(x, y);
    case BinaryOp::Maximum:
      if constexpr (std::is_integral_v<C>) return x > y ? x : y;
      else return (x != x || y != y) ? C(NAN) : (x > y ? x : y);
    case BinaryOp::Minimum:
      if constexpr (std::is_integral_v<C>) return x < y ? x : y;
      else return (x != x || y != y) ? C(NAN) : (x < y ? x : y);
    default: return C(0);
  }
}

__device__ __forceinline__ bool compare_apply(BinaryOp op, auto x, auto y) {
  switch (op) {
    case BinaryOp::Eq: return x == y;
    case BinaryOp::Ne: return x != y;
    case BinaryOp::Lt: return x < y;
    case BinaryOp::Le: return x <= y;
    case BinaryOp::Gt: return x > y;
    case BinaryOp::Ge: return x >= y;
    default: return false;
  }
}

template <class T>
__device__ __forceinline__ bool is_finite_value(T v) {
  if constexpr (std::is_integral_v<T>) return true;
  else return isfinite(load_as<float>(v)) || (std::is_same_v<T, double> && isfinite(double(load_as<double>(v))));
}

bool is_comparison(BinaryOp op) { return op >= BinaryOp::Eq; }

void cuda_binary(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& out, double alpha) {
  const int dev = device_of(out);
  BOOSTER_DISPATCH_ALL(a.dtype(), "binary", [&] {
    using T = dev_t<scalar_t>;
    using C = comp_t<T>;
    const T* pa = static_cast<const T*>(a.data_ptr());
    const T* pb = static_cast<const T*>(b.data_ptr());
    const Shape* const st[3] = {&a.strides(), &b.strides(), &out.strides()};
    if constexpr (std::is_same_v<T, bool>) {
      BOOSTER_CHECK(op == BinaryOp::Eq || op == BinaryOp::Ne || op == BinaryOp::Mul || op == BinaryOp::Add, DTypeError,
                    "binary op ", int(op), " is not defined for bool tensors");
    }
    if (is_comparison(op)) {
      bool* po = static_cast<bool*>(out.data_ptr());
      launch_elementwise<3>(dev, out.shape(), st, [=] __device__(const int64_t(&o)[3]) {
        po[o[2]] = compare_apply(op, load_as<C>(pa[o[0]]), load_as<C>(pb[o[1]]));
      });
      return;
    }
    T* po = static_cast<T*>(out.data_ptr());
    if constexpr (std::is_same_v<T, bool>) {
      launch_elementwise<3>(dev, out.shape(), st, [=] __device__(const int64_t(&o)[3]) {
        po[o[2]] = op == BinaryOp::Mul ? (pa[o[0]] && pb[o[1]]) : (pa[o[0]] || pb[o[1]]);
      });
    } else {
      const C al = C(alpha);
      launch_elementwise<3>(dev, out.shape(), st, [=] __device__(const int64_t(&o)[3]) {
        po[o[2]] = store_as<T>(binary_apply<C>(op, load_as<C>(pa[o[0]]), load_as<C>(pb[o[1]]), al));
      });
    }
  });
}

template <class C>
__device__ __forceinline__ C unary_apply(UnaryOp op, C x, C s0, C s1, bool has_lo, bool has_hi) {
  if constexpr (std::is_integral_v<C>) {
    switch (op) {
      case UnaryOp::Neg: return -x;
      case UnaryOp::Abs: return x < 0 ? C(-x) : x;
      case UnaryOp::Relu: return x < C(0) ? C(0) : x;
      case UnaryOp::Sign: return C((x > 0) - (x < 0));
      case UnaryOp::AddScalar: return x + s0;
      case UnaryOp::MulScalar: return x * s0;
      case UnaryOp::RSubScalar: return s0 - x;
      case UnaryOp::RDivScalar: return x == 0 ? C(0) : C(s0 / x);
      case UnaryOp::PowScalar: return C(pow(double(x), double(s0)));
      case UnaryOp::Clamp:
        if (has_lo && x < s0) x = s0;
        if (has_hi && x > s1) x = s1;
        return x;
      default: return C(unary_apply<double>(op, double(x), double(s0), double(s1), has_lo, has_hi));
    }
  } else {
    switch (op) {
      case UnaryOp::Neg: return -x;
      case UnaryOp::Exp: return exp(x);
      case UnaryOp::Log: return log(x);
      case UnaryOp::Sqrt: return sqrt(x);
      case UnaryOp::Rsqrt: return C(1) / sqrt(x);
      case UnaryOp::Abs:  // abs(-0) = 0, as torch and the CPU
        if constexpr (std::is_same_v<C, float>) return fabsf(x);
        else return fabs(x);
      case UnaryOp::Relu: return x < C(0) ? C(0) : x;  // NaN, -0 stay: Note [NaN propagation] (cpu/elementwise.cpp)
      case UnaryOp::Sign: return C((x > 0) - (x < 0));
      case UnaryOp::GeluErf: return C(0.5) * x * (C(1) + erf(x * C(0.7071067811865476)));
      case UnaryOp::GeluTanh: return x * gelu_tanh_s(x);
      case UnaryOp::Tanh: return tanh(x);
      case UnaryOp::Sigmoid: return C(1) / (C(1) + exp(-x));
      case UnaryOp::Silu: return x / (C(1) + exp(-x));
      case UnaryOp::AddScalar: return x + s0;
      case UnaryOp::MulScalar: return x * s0;
      case UnaryOp::RSubScalar: return s0 - x;
      case UnaryOp::RDivScalar: return s0 / x;
      case UnaryOp::PowScalar: return s0 == C(2) ? x * x : pow(x, s0);
      case UnaryOp::Clamp:
        if (x != x) return x;
        if (has_lo && x < s0) x = s0;
        if (has_hi && x > s1) x = s1;
        return x;
      default: return x;
    }
  }
}

void cuda_unary(UnaryOp op, const Tensor& a, Tensor& out, double p0, double p1) {
  const int dev = device_of(out);
  BOOSTER_DISPATCH_ALL(a.dtype(), "unary", [&] {
    using T = dev_t<scalar_t>;
    using C = comp_t<T>;
    if constexpr (std::is_same_v<T, bool>) {
      BOOSTER_FAIL(DTypeError, "unary op ", int(op), " is not defined for bool tensors");
    } else {
      const T* pa = static_cast<const T*>(a.data_ptr());
      const Shape* const st[2] = {&a.strides(), &out.strides()};
      if (op == UnaryOp::IsFinite) {
        bool* po = static_cast<bool*>(out.data_ptr());
        launch_elementwise<2>(dev, out.shape(), st, [=] __device__(const int64_t(&o)[2]) {
          const T v = pa[o[0]];
          bool* out = po + o[1];
          *out = is_finite_value(v);
        });
        return;
      }
      T* po = static_cast<T*>(out.data_ptr());
      const C s0 = C(p0), s1 = C(p1);
      const bool has_lo = !std::isnan(p0), has_hi = !std::isnan(p1);
      launch_elementwise<2>(dev, out.shape(), st, [=] __device__(const int64_t(&o)[2]) {
        po[o[1]] = store_as<T>(unary_apply<C>(op, load_as<C>(pa[o[0]]), s0, s1, has_lo, has_hi));
      });
    }
  });
}

void cuda_unary_backward(UnaryBackwardOp op, const Tensor& grad, const Tensor& saved, Tensor& out, double p0,
                         double p1) {
  const int dev = device_of(out);
  BOOSTER_DISPATCH_FLOATING(grad.dtype(), "unary_backward", [&] {
    using T = dev_t<scalar_t>;
    using C = comp_t<T>;
    const T* pg = static_cast<const T*>(grad.data_ptr());
    const T* ps = static_cast<const T*>(saved.data_ptr());
    T* po = static_cast<T*>(out.data_ptr());
    const bool has_lo = !std::isnan(p0), has_hi = !std::isnan(p1);
    const C lo = C(p0), hi = C(p1);
    launch_elementwise<3>(dev, out.shape(), {&grad.strides(), &saved.strides(), &out.strides()},
                          [=] __device__(const int64_t(&o)[3]) {
                            const C g = load_as<C>(pg[o[0]]), x = load_as<C>(ps[o[1]]);
                            C r;
                            switch (op) {
                              case UnaryBackwardOp::Relu: r = x <= 0 ? C(0) : g; break;  // x is the output; NaN passes g
                              case UnaryBackwardOp::Tanh: r = g * (C(1) - x * x); break;
                              case UnaryBackwardOp::Sigmoid: r = g * x * (C(1) - x); break;
                              case UnaryBackwardOp::Silu: {
                                const C s = C(1) / (C(1) + exp(-x));
                                r = g * s * (C(1) + x * (C(1) - s));
                                break;
                              }
                              case UnaryBackwardOp::GeluErf: {
                                const C cdf = C(0.5) * (C(1) + erf(x * C(0.7071067811865476)));
                                const C pdf = exp(C(-0.5) * x * x) * C(0.3989422804014327);
                                r = g * (cdf + x * pdf);
                                break;
                              }
                              case UnaryBackwardOp::GeluTanh: {
                                // d/dx [x s(u)] = s + x * 2 s (1 - s) * du/dx, s = 0.5 (1 + tanh u)
                                const C s = gelu_tanh_s(x);
                                const C du = C(0.7978845608028654) * (C(1) + C(3 * 0.044715) * x * x);
                                r = g * (s + x * C(2) * s * (C(1) - s) * du);
                                break;
                              }
                              case UnaryBackwardOp::ClampMask:
                                r = ((!has_lo || x >= lo) && (!has_hi || x <= hi)) ? g : C(0);
                                break;
                              default: r = C(0);
                            }
                            po[o[2]] = store_as<T>(r);
                          });
  });
}

void cuda_where(const Tensor& cond, const Tensor& a, const Tensor& b, Tensor& out) {
  const int dev = device_of(out);
  BOOSTER_DISPATCH_ALL(out.dtype(), "where", [&] {
    using T = dev_t<scalar_t>;
    const bool* pc = static_cast<const bool*>(cond.data_ptr());
    const T* pa = static_cast<const T*>(a.data_ptr());
    const T* pb = static_cast<const T*>(b.data_ptr());
    T* po = static_cast<T*>(out.data_ptr());
    launch_elementwise<4>(dev, out.shape(), {&cond.strides(), &a.strides(), &b.strides(), &out.strides()},
                          [=] __device__(const int64_t(&o)[4]) { po[o[3]] = pc[o[0]] ? pa[o[1]] : pb[o[2]]; });
  });
}

void cuda_masked_scale(const Tensor& x, const Tensor& keep, double scale, Tensor& out) {
  const int dev = device_of(out);
  BOOSTER_DISPATCH_FLOATING(x.dtype(), "masked_scale", [&] {
    using T = dev_t<scalar_t>;
    using C = comp_t<T>;
    const T* px = static_cast<const T*>(x.data_ptr());
    const bool* pk = static_cast<const bool*>(keep.data_ptr());
    T* po = static_cast<T*>(out.data_ptr());
    const C s = C(scale);
    launch_elementwise<3>(dev, out.shape(), {&x.strides(), &keep.strides(), &out.strides()},
                          [=] __device__(const int64_t(&o)[3]) {
                            po[o[2]] = store_as<T>(pk[o[1]] ? load_as<C>(px[o[0]]) * s : C(0));
                          });
  });
}

}  // namespace
}  // namespace booster::cuda

namespace booster::kernels {
BOOSTER_REGISTER_CUDA_KERNEL(copy_kernel, cuda::cuda_copy);
BOOSTER_REGISTER_CUDA_KERNEL(fill_kernel, cuda::cuda_fill);
BOOSTER_REGISTER_CUDA_KERNEL(binary_kernel, cuda::cuda_binary);
BOOSTER_REGISTER_CUDA_KERNEL(unary_kernel, cuda::cuda_unary);
BOOSTER_REGISTER_CUDA_KERNEL(unary_backward_kernel, cuda::cuda_unary_backward);
BOOSTER_REGISTER_CUDA_KERNEL(where_kernel, cuda::cuda_where);
BOOSTER_REGISTER_CUDA_KERNEL(masked_scale_kernel, cuda::cuda_masked_scale);
}  // namespace booster::kernels
