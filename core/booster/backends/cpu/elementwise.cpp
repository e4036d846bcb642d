// CPU elementwise kernels: binary, unary, unary-backward, where.
//
// Each op is a small functor; one template per family runs it over the strided geometry, with a
// contiguous fast path the compiler vectorizes. 16-bit floats compute in float32 (acc_t), converted a
// block at a time (Note [16-bit kernels compute in float32 blocks]).
#include <cmath>

#include "booster/backends/cpu/convert.h"
#include "booster/backends/cpu/loops.h"
#include "booster/backends/cpu/vec_math.h"
#include "booster/kernels/elementwise.h"

namespace booster::cpu {
namespace {

using kernels::BinaryOp;
using kernels::UnaryBackwardOp;
using kernels::UnaryOp;

// Note [Flattened loop bodies]
// The per-run loop bodies below are marked flatten: everything they call (the op's lambda, and what
// that calls, such as gelu_tanh_backward and exp_f32) is inlined into them, so the loops vectorize.
// Left to GCC's heuristics, gelu_tanh_backward stayed out of line (called per element, through the PLT
// since this is a shared library) and the GELU backward alone took 10% of the float32 GPT step.

// Note [NaN propagation]
// Every kernel propagates NaN as PyTorch's does, so that NaN data or a diverging step reaches the
// loss and the non-finite checks fire instead of training on silently. Selects are written with the
// comparison that is false for NaN on the side that keeps x: relu is x < 0 ? 0 : x (torch.relu is
// clamp_min(x, 0): NaN stays NaN, -0 stays -0), its backward y <= 0 ? 0 : g (torch's
// threshold_backward: a NaN output passes the gradient), abs clears the sign (abs(-0) = 0), clamp
// returns a NaN first, maximum/minimum test for NaN explicitly, and so do the AMSGrad maximum
// (optimizers.cpp) and CUDA's clamp of a batch-norm variance at 0. std::max(a, b) and the vector max instructions return one particular
// operand when the other is NaN (x86's maxps the second), so a max that must keep NaN never relies
// on operand order: the reductions (reduce.cpp) carry a NaN flag; softmax, log_softmax, the
// cross-entropy and attention may let their row maximum drop a NaN because exp(NaN - max) still
// makes the row's sum, and so every output of the row, NaN (as torch). The compiler keeps these
// semantics in every ISA copy: the build never uses -ffast-math or -ffinite-math-only. The
// references are PyTorch's (tests/fixtures/nonfinite.json, checked at every BOOSTER_CPU_ISA level by
// test_ops_nn).

// out[i] = f(x[i], y[i]) for n contiguous 16-bit elements: x (and y unless it is one broadcast value)
// loaded into float32 blocks (Note [16-bit kernels compute in float32 blocks]).
template <class T, class O, class F>
[[gnu::flatten]] void binary_blocks(const T* x, const T* y, bool y_scalar, O* z, int64_t n, F& f) {
  float xb[kConvertBlock], yb[kConvertBlock], zb[kConvertBlock];
  const float yv = y_scalar ? float(y[0]) : 0.0f;
  for (int64_t i0 = 0; i0 < n; i0 += kConvertBlock) {
    const int64_t m = std::min(kConvertBlock, n - i0);
    load_block(x + i0, xb, m);
    if (y_scalar) std::fill_n(yb, m, yv);
    else load_block(y + i0, yb, m);
    if constexpr (std::is_same_v<O, T>) {
      for (int64_t i = 0; i < m; ++i) zb[i] = f(xb[i], yb[i]);
      store_block(zb, z + i0, m);
    } else {
      for (int64_t i = 0; i < m; ++i) z[i0 + i] = O(f(xb[i], yb[i]));
    }
  }
}

// Runs out[i] = f(a[i], b[i]) with A/B loaded as acc type.
template <class T, class O, class F>
void binary_loop(const Tensor& a, const Tensor& b, Tensor& out, F f) {
  const T* pa = static_cast<const T*>(a.data_ptr());
  const T* pb = static_cast<const T*>(b.data_ptr());
  O* po = static_cast<O*>(out.data_ptr());
  strided_loop<3>(out.shape(), {&a.strides(), &b.strides(), &out.strides()},
                  [&](int64_t n, const int64_t* off, const int64_t* st) __attribute__((flatten)) {
                    const T* x = pa + off[0];
                    const T* y = pb + off[1];
                    O* z = po + off[2];
                    using A = acc_t<T>;
                    if constexpr (is_16bit_float_v<T>) {
                      if (st[0] == 1 && (st[1] == 1 || st[1] == 0) && st[2] == 1)
                        return binary_blocks(x, y, st[1] == 0, z, n, f);
                      if (st[0] == 0 && st[1] == 1 && st[2] == 1) {
                        auto swapped = [&f](A yv, A xv) { return f(xv, yv); };
                        return binary_blocks(y, x, true, z, n, swapped);
                      }
                    }
                    if (st[0] == 1 && st[1] == 1 && st[2] == 1) {
                      for (int64_t i = 0; i < n; ++i) z[i] = O(f(A(x[i]), A(y[i])));
                    } else if (st[0] == 1 && st[1] == 0 && st[2] == 1) {
                      const A yv = A(y[0]);
                      for (int64_t i = 0; i < n; ++i) z[i] = O(f(A(x[i]), yv));
                    } else if (st[0] == 0 && st[1] == 1 && st[2] == 1) {
                      const A xv = A(x[0]);
                      for (int64_t i = 0; i < n; ++i) z[i] = O(f(xv, A(y[i])));
                    } else {
                      for (int64_t i = 0; i < n; ++i) z[i * st[2]] = O(f(A(x[i * st[0]]), A(y[i * st[1]])));
                    }
                  });
}

void cpu_binary(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& out, double alpha) {
  BOOSTER_DISPATCH_ALL(a.dtype(), "binary", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const A al = A(alpha);
    auto arith = [&](auto f) { binary_loop<T, T>(a, b, out, f); };
    auto compare = [&](auto f) { binary_loop<T, bool>(a, b, out, f); };
    if constexpr (std::is_same_v<T, bool>) {
      switch (op) {
        case BinaryOp::Eq: return compare([](A x, A y) { return x == y; });
        case BinaryOp::Ne: return compare([](A x, A y) { return x != y; });
        case BinaryOp::Mul: return arith([](A x, A y) { return bool(x && y); });
        case BinaryOp::Add: return arith([](A x, A y) { return bool(x || y); });
        default: BOOSTER_FAIL(DTypeError, "binary op ", int(op), " is not defined for bool tensors");
      }
    } else {
      switch (op) {
        case BinaryOp::Add:
          if (alpha == 1.0) return arith([](A x, A y) { return x + y; });
          return arith([al](A x, A y) { return x + al * y; });
        case BinaryOp::Sub:
          if (alpha == 1.0) return arith([](A x, A y) { return x - y; });
          return arith([al](A x, A y) { return x - al * y; });
        case BinaryOp::Mul: return arith([](A x, A y) { return x * y; });
        case BinaryOp::Div:
          if constexpr (std::is_integral_v<A>) {
            return arith([](A x, A y) { return y == 0 ? A(0) : A(x / y); });
          } else {
            return arith([](A x, A y) { return x / y; });
          }
        case BinaryOp::Pow: return arith([](A x, A y) { return A(std::pow(x, y)); });
        case BinaryOp::Maximum:
          return arith([](A x, A y) { return (x != x || y != y) ? A(NAN) : (x > y ? x : y); });
        case BinaryOp::Minimum:
          return arith([](A x, A y) { return (x != x || y != y) ? A(NAN) : (x < y ? x : y); });
        case BinaryOp::Eq: return compare([](A x, A y) { return x == y; });
        case BinaryOp::Ne: return compare([](A x, A y) { return x != y; });
        case BinaryOp::Lt: return compare([](A x, A y) { return x < y; });
        case BinaryOp::Le: return compare([](A x, A y) { return x <= y; });
        case BinaryOp::Gt: return compare([](A x, A y) { return x > y; });
        case BinaryOp::Ge: return compare([](A x, A y) { return x >= y; });
      }
    }
  });
}

template <class T, class O, class F>
void unary_loop(const Tensor& a, Tensor& out, F f) {
  const T* pa = static_cast<const T*>(a.data_ptr());
  O* po = static_cast<O*>(out.data_ptr());
  strided_loop<2>(out.shape(), {&a.strides(), &out.strides()},
                  [&](int64_t n, const int64_t* off, const int64_t* st) __attribute__((flatten)) {
    const T* x = pa + off[0];
    O* z = po + off[1];
    using A = acc_t<T>;
    if constexpr (is_16bit_float_v<T>) {
      if (st[0] == 1 && st[1] == 1) {  // Note [16-bit kernels compute in float32 blocks]
        float xb[kConvertBlock], zb[kConvertBlock];
        for (int64_t i0 = 0; i0 < n; i0 += kConvertBlock) {
          const int64_t m = std::min(kConvertBlock, n - i0);
          load_block(x + i0, xb, m);
          if constexpr (std::is_same_v<O, T>) {
            for (int64_t i = 0; i < m; ++i) zb[i] = f(xb[i]);
            store_block(zb, z + i0, m);
          } else {
            for (int64_t i = 0; i < m; ++i) z[i0 + i] = O(f(xb[i]));
          }
        }
        return;
      }
    }
    if (st[0] == 1 && st[1] == 1) {
      for (int64_t i = 0; i < n; ++i) z[i] = O(f(A(x[i])));
    } else {
      for (int64_t i = 0; i < n; ++i) z[i * st[1]] = O(f(A(x[i * st[0]])));
    }
  });
}

constexpr double kInvSqrt2 = 0.7071067811865476;

void cpu_unary(UnaryOp op, const Tensor& a, Tensor& out, double p0, double p1) {
  BOOSTER_DISPATCH_ALL(a.dtype(), "unary", [&] {
    using T = scalar_t;
    if constexpr (std::is_same_v<T, bool>) {
      BOOSTER_FAIL(DTypeError, "unary op ", int(op), " is not defined for bool tensors");
    } else {
      using A = acc_t<T>;
      const A s0 = A(p0), s1 = A(p1);
      auto run = [&](auto f) { unary_loop<T, T>(a, out, f); };
      switch (op) {
        case UnaryOp::Neg: return run([](A x) { return -x; });
        case UnaryOp::Exp: return run([](A x) { return A(std::exp(x)); });
        case UnaryOp::Log: return run([](A x) { return A(std::log(x)); });
        case UnaryOp::Sqrt: return run([](A x) { return A(std::sqrt(x)); });
        case UnaryOp::Rsqrt: return run([](A x) { return A(1 / std::sqrt(x)); });
        case UnaryOp::Abs:
          return run([](A x) {
            if constexpr (std::is_floating_point_v<A>) return A(std::abs(x));  // abs(-0) = 0, as torch
            else return x < 0 ? A(-x) : x;
          });
        // x < 0 ? 0 : x keeps NaN and -0, as torch.relu (Note [NaN propagation]).
        case UnaryOp::Relu: return run([](A x) { return x < A(0) ? A(0) : x; });
        case UnaryOp::Sign: return run([](A x) { return A((x > 0) - (x < 0)); });
        case UnaryOp::GeluErf:
          return run([](A x) { return A(0.5 * x * (1 + std::erf(x * A(kInvSqrt2)))); });
        case UnaryOp::GeluTanh:
          return run([](A x) { return gelu_tanh(x); });  // Note [GELU through exp]
        case UnaryOp::Tanh: return run([](A x) { return A(std::tanh(x)); });
        case UnaryOp::Sigmoid: return run([](A x) { return A(1 / (1 + std::exp(-x))); });
        case UnaryOp::Silu: return run([](A x) { return A(x / (1 + std::exp(-x))); });
        case UnaryOp::AddScalar: return run([s0](A x) { return x + s0; });
        case UnaryOp::MulScalar: return run([s0](A x) { return x * s0; });
        case UnaryOp::RSubScalar: return run([s0](A x) { return s0 - x; });
        case UnaryOp::RDivScalar: return run([s0](A x) { return s0 / x; });
        case UnaryOp::PowScalar:
          if (p0 == 2.0) return run([](A x) { return x * x; });
          return run([s0](A x) { return A(std::pow(x, s0)); });
        case UnaryOp::Clamp: {
          const bool has_lo = !std::isnan(p0), has_hi = !std::isnan(p1);
          return run([=](A x) {
            if (x != x) return x;
            if (has_lo && x < s0) x = s0;
            if (has_hi && x > s1) x = s1;
            return x;
          });
        }
        case UnaryOp::IsFinite:
          return unary_loop<T, bool>(a, out, [](A x) {
            if constexpr (std::is_integral_v<A>) return true;
            else return bool(std::isfinite(x));
          });
      }
    }
  });
}

void cpu_unary_backward(UnaryBackwardOp op, const Tensor& grad, const Tensor& saved, Tensor& out, double p0,
                        double p1) {
  BOOSTER_DISPATCH_FLOATING(grad.dtype(), "unary_backward", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    auto run = [&](auto f) { binary_loop<T, T>(grad, saved, out, f); };
    switch (op) {
      // torch's threshold_backward(g, y, 0): a NaN output passes the gradient (Note [NaN propagation]).
      case UnaryBackwardOp::Relu: return run([](A g, A y) { return y <= 0 ? A(0) : g; });
      case UnaryBackwardOp::Tanh: return run([](A g, A y) { return g * (1 - y * y); });
      case UnaryBackwardOp::Sigmoid: return run([](A g, A y) { return g * y * (1 - y); });
      case UnaryBackwardOp::Silu:
        return run([](A g, A x) {
          const A s = A(1 / (1 + std::exp(-x)));
          return g * s * (1 + x * (1 - s));
        });
      case UnaryBackwardOp::GeluErf:
        return run([](A g, A x) {
          const A cdf = A(0.5 * (1 + std::erf(x * A(kInvSqrt2))));
          const A pdf = A(std::exp(-0.5 * x * x) * 0.3989422804014327);
          return g * (cdf + x * pdf);
        });
      case UnaryBackwardOp::GeluTanh:
        return run([](A g, A x) { return gelu_tanh_backward(g, x); });
      case UnaryBackwardOp::ClampMask: {
        const bool has_lo = !std::isnan(p0), has_hi = !std::isnan(p1);
        const A lo = A(p0), hi = A(p1);
        return run([=](A g, A x) { return ((!has_lo || x >= lo) && (!has_hi || x <= hi)) ? g : A(0); });
      }
    }
  });
}

void cpu_where(const Tensor& cond, const Tensor& a, const Tensor& b, Tensor& out) {
  BOOSTER_DISPATCH_ALL(out.dtype(), "where", [&] {
    using T = scalar_t;
    const bool* pc = cond.data<bool>();
    const T* pa = static_cast<const T*>(a.data_ptr());
    const T* pb = static_cast<const T*>(b.data_ptr());
    T* po = static_cast<T*>(out.data_ptr());
    strided_loop<4>(out.shape(), {&cond.strides(), &a.strides(), &b.strides(), &out.strides()},
                    [&](int64_t n, const int64_t* off, const int64_t* st) {
                      for (int64_t i = 0; i < n; ++i)
                        po[off[3] + i * st[3]] = pc[off[0] + i * st[0]] ? pa[off[1] + i * st[1]] : pb[off[2] + i * st[2]];
                    });
  });
}

}  // namespace
}  // namespace booster::cpu

namespace booster::kernels {
BOOSTER_REGISTER_CPU_KERNEL(binary_kernel, &cpu::cpu_binary);
BOOSTER_REGISTER_CPU_KERNEL(unary_kernel, &cpu::cpu_unary);
BOOSTER_REGISTER_CPU_KERNEL(unary_backward_kernel, &cpu::cpu_unary_backward);
BOOSTER_REGISTER_CPU_KERNEL(where_kernel, &cpu::cpu_where);
}  // namespace booster::kernels
