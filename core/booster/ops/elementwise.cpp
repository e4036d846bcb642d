// Elementwise ops: broadcasting binary arithmetic, comparisons, scalar forms, unary math and
// activations, where/masked_fill. Each one: autocast, checks, kernel, backward.
#include <cmath>

#include "booster/autocast/autocast.h"
#include "booster/autograd/autograd.h"
#include "booster/kernels/elementwise.h"
#include "booster/common/error_context.h"
#include "booster/ops/ops.h"
#include "booster/ops/ops_impl.h"

namespace booster {

using autograd::grads;
using autograd::sum_to;
using kernels::BinaryOp;
using kernels::UnaryBackwardOp;
using kernels::UnaryOp;

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    BOOSTER_CHECK(da == db || da == 1 || db == 1, ShapeError, op, ": shapes ", a, " and ", b,
                  " cannot be broadcast together (dimension ", i, ": ", da, " vs ", db, ")");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

void check_same_device(const Tensor& a, const Tensor& b, const char* op) {
  BOOSTER_CHECK(a.device() == b.device(), DeviceError, op, ": expected tensors on one device, got ", a.device(),
                " and ", b.device(), "; move one with .to(device)");
}

namespace {

bool is_comparison(BinaryOp op) { return op >= BinaryOp::Eq; }

// Casts, broadcasts and runs a binary kernel. Returns the output and the cast inputs (for backward).
Tensor binary_forward(BinaryOp op, const char* name, Tensor& a, Tensor& b, double alpha) {
  check_same_device(a, b, name);
  const DType dt = promote_types(a.dtype(), b.dtype());
  if (a.dtype() != dt) a = a.to(dt);
  if (b.dtype() != dt) b = b.to(dt);
  const Shape s = broadcast_shapes(a.shape(), b.shape(), name);
  Tensor out = Tensor::empty(s, is_comparison(op) ? DType::Bool : dt, a.device());
  kernels::binary_kernel(a.device())(op, a.detach().expand(s), b.detach().expand(s), out, alpha);
  return out;
}

Tensor unary_forward(UnaryOp op, const Tensor& a, double p0 = 0.0, double p1 = 0.0, DType out_dtype = DType::Bool) {
  Tensor out = Tensor::empty(a.shape(), op == UnaryOp::IsFinite ? out_dtype : a.dtype(), a.device());
  kernels::unary_kernel(a.device())(op, a.detach(), out, p0, p1);
  return out;
}

// Math functions take floats; integer and bool inputs become float32 first (as torch.exp does).
Tensor as_floating(const Tensor& a) { return is_floating(a.dtype()) ? a : a.to(DType::Float32); }

Tensor unary_backward(UnaryBackwardOp op, const Tensor& g, const Tensor& saved, double p0 = 0.0, double p1 = 0.0) {
  Tensor gg = g.dtype() == saved.dtype() ? g : g.to(saved.dtype());
  Tensor out = Tensor::empty(saved.shape(), saved.dtype(), saved.device());
  kernels::unary_backward_kernel(saved.device())(op, gg.expand(saved.shape()), saved, out, p0, p1);
  return out;
}

}  // namespace

// --------------------------------------------------------------------------- binary arithmetic

Tensor add(const Tensor& a_in, const Tensor& b_in, double alpha) {
  BOOSTER_OP_CONTEXT("add");  // Note [Error context]
  Tensor a = a_in, b = b_in;
  autocast::apply(autocast::Op::Add, {&a, &b});
  Tensor out = binary_forward(BinaryOp::Add, "add", a, b, alpha);
  autograd::record(out, "AddBackward", {a, b}, [sa = a.shape(), sb = b.shape(), alpha](const Tensor& g) {
    return grads{sum_to(g, sa), sum_to(alpha == 1.0 ? g : mul(g, alpha), sb)};
  });
  return out;
}

Tensor sub(const Tensor& a_in, const Tensor& b_in, double alpha) {
  BOOSTER_OP_CONTEXT("sub");
  Tensor a = a_in, b = b_in;
  autocast::apply(autocast::Op::Sub, {&a, &b});
  Tensor out = binary_forward(BinaryOp::Sub, "sub", a, b, alpha);
  autograd::record(out, "SubBackward", {a, b}, [sa = a.shape(), sb = b.shape(), alpha](const Tensor& g) {
    return grads{sum_to(g, sa), sum_to(mul(g, -alpha), sb)};
  });
  return out;
}

Tensor mul(const Tensor& a_in, const Tensor& b_in) {
  BOOSTER_OP_CONTEXT("mul");
  Tensor a = a_in, b = b_in;
  autocast::apply(autocast::Op::Mul, {&a, &b});
  Tensor out = binary_forward(BinaryOp::Mul, "mul", a, b, 1.0);
  if (autograd::needs_grad({&a, &b})) {
    const bool ga = a.requires_grad(), gb = b.requires_grad();
    autograd::record(out, "MulBackward", {a, b}, [a = a.detach(), b = b.detach(), ga, gb](const Tensor& g) {
      return grads{ga ? sum_to(mul(g, b), a.shape()) : Tensor(), gb ? sum_to(mul(g, a), b.shape()) : Tensor()};
    });
  }
  return out;
}

Tensor div(const Tensor& a_in, const Tensor& b_in) {
  BOOSTER_OP_CONTEXT("div");
  Tensor a = a_in, b = b_in;
  autocast::apply(autocast::Op::Div, {&a, &b});
  if (!is_floating(a.dtype()) && !is_floating(b.dtype())) {  // true division, as torch.div
    a = a.to(DType::Float32);
    b = b.to(DType::Float32);
  }
  Tensor out = binary_forward(BinaryOp::Div, "div", a, b, 1.0);
  if (autograd::needs_grad({&a, &b})) {
    const bool gb = b.requires_grad();
    autograd::record(out, "DivBackward", {a, b}, [sa = a.shape(), b = b.detach(), o = out.detach(), gb](const Tensor& g) {
      Tensor ga = div(g, b);
      return grads{sum_to(ga, sa), gb ? sum_to(neg(mul(ga, o)), b.shape()) : Tensor()};
    });
  }
  return out;
}

Tensor pow(const Tensor& a_in, const Tensor& e_in) {
  BOOSTER_OP_CONTEXT("pow");
  Tensor a = as_floating(a_in), e = e_in;
  Tensor out = binary_forward(BinaryOp::Pow, "pow", a, e, 1.0);
  if (autograd::needs_grad({&a, &e})) {
    const bool ge = e.requires_grad();
    autograd::record(out, "PowBackward", {a, e},
                     [a = a.detach(), e = e.detach(), o = out.detach(), ge](const Tensor& g) {
                       Tensor ga = mul(mul(g, e), pow(a, sub(e, ones_like(e))));
                       Tensor gexp = ge ? sum_to(mul(mul(g, o), log(a)), e.shape()) : Tensor();
                       return grads{sum_to(ga, a.shape()), gexp};
                     });
  }
  return out;
}

namespace {
// The gradients of maximum (is_max) or minimum, as derivatives.yaml writes them:
// a: where(a == b, g / 2, g).masked_fill_(a < b, 0) for maximum (a > b for minimum); b mirrored.
// Where a or b is NaN no comparison holds and both sides get g (Note [NaN propagation] in
// backends/cpu/elementwise.cpp).
grads max_min_grads(const Tensor& g, const Tensor& a, const Tensor& b, bool is_max) {
  Tensor z = zeros({}, g.dtype(), g.device());
  Tensor tie = where(eq(a, b), mul(g, 0.5), g);
  Tensor ga = where(is_max ? lt(a, b) : gt(a, b), z, tie);
  Tensor gb = where(is_max ? gt(a, b) : lt(a, b), z, tie);
  return grads{sum_to(ga, a.shape()), sum_to(gb, b.shape())};
}
}  // namespace

Tensor maximum(const Tensor& a_in, const Tensor& b_in) {
  BOOSTER_OP_CONTEXT("maximum");
  Tensor a = a_in, b = b_in;
  autocast::apply(autocast::Op::Maximum, {&a, &b});
  Tensor out = binary_forward(BinaryOp::Maximum, "maximum", a, b, 1.0);
  autograd::record(out, "MaximumBackward", {a, b}, [a = a.detach(), b = b.detach()](const Tensor& g) {
    // As PyTorch's formula: ties split the gradient evenly, the smaller side gets none, and where
    // either is NaN (no comparison holds) both get all of it.
    return max_min_grads(g, a, b, /*is_max=*/true);
  });
  return out;
}

Tensor minimum(const Tensor& a_in, const Tensor& b_in) {
  BOOSTER_OP_CONTEXT("minimum");
  Tensor a = a_in, b = b_in;
  autocast::apply(autocast::Op::Minimum, {&a, &b});
  Tensor out = binary_forward(BinaryOp::Minimum, "minimum", a, b, 1.0);
  autograd::record(out, "MinimumBackward", {a, b}, [a = a.detach(), b = b.detach()](const Tensor& g) {
    return max_min_grads(g, a, b, /*is_max=*/false);
  });
  return out;
}

#define BOOSTER_COMPARISON(fn, OP)                                  \
  Tensor fn(const Tensor& a_in, const Tensor& b_in) {               \
    Tensor a = a_in.detach(), b = b_in.detach();                    \
    return binary_forward(BinaryOp::OP, #fn, a, b, 1.0);            \
  }
BOOSTER_COMPARISON(eq, Eq)
BOOSTER_COMPARISON(ne, Ne)
BOOSTER_COMPARISON(lt, Lt)
BOOSTER_COMPARISON(le, Le)
BOOSTER_COMPARISON(gt, Gt)
BOOSTER_COMPARISON(ge, Ge)
#undef BOOSTER_COMPARISON

Tensor isfinite(const Tensor& a) { return unary_forward(UnaryOp::IsFinite, a, 0, 0, DType::Bool); }

// --------------------------------------------------------------------------- scalar forms

namespace {
// A tensor op a scalar keeps the tensor's dtype; integral tensors with a fractional scalar go float32.
Tensor scalar_operand(const Tensor& a, double s) {
  return (!is_floating(a.dtype()) && std::floor(s) != s) ? a.to(DType::Float32) : a;
}
}  // namespace

Tensor add(const Tensor& a_in, double s) {
  BOOSTER_OP_CONTEXT("add");
  Tensor a = scalar_operand(a_in, s);
  Tensor out = unary_forward(UnaryOp::AddScalar, a, s);
  autograd::record(out, "AddScalarBackward", {a}, [](const Tensor& g) { return grads{g}; });
  return out;
}

Tensor mul(const Tensor& a_in, double s) {
  BOOSTER_OP_CONTEXT("mul");
  Tensor a = scalar_operand(a_in, s);
  Tensor out = unary_forward(UnaryOp::MulScalar, a, s);
  autograd::record(out, "MulScalarBackward", {a}, [s](const Tensor& g) { return grads{mul(g, s)}; });
  return out;
}

Tensor rsub(const Tensor& a_in, double s) {
  BOOSTER_OP_CONTEXT("rsub");
  Tensor a = scalar_operand(a_in, s);
  Tensor out = unary_forward(UnaryOp::RSubScalar, a, s);
  autograd::record(out, "RSubScalarBackward", {a}, [](const Tensor& g) { return grads{neg(g)}; });
  return out;
}

Tensor rdiv(const Tensor& a_in, double s) {
  BOOSTER_OP_CONTEXT("rdiv");
  Tensor a = as_floating(a_in);
  Tensor out = unary_forward(UnaryOp::RDivScalar, a, s);
  autograd::record(out, "RDivScalarBackward", {a}, [a = a.detach(), o = out.detach()](const Tensor& g) {
    return grads{neg(div(mul(g, o), a))};  // d(s/a) = -s/a^2 = -out/a
  });
  return out;
}

Tensor pow(const Tensor& a_in, double e) {
  BOOSTER_OP_CONTEXT("pow");
  Tensor a = as_floating(a_in);
  autocast::apply(autocast::Op::Pow, {&a});
  Tensor out = unary_forward(UnaryOp::PowScalar, a, e);
  autograd::record(out, "PowScalarBackward", {a}, [a = a.detach(), e](const Tensor& g) {
    if (e == 2.0) return grads{mul(g, mul(a, 2.0))};
    return grads{mul(g, mul(pow(a, e - 1.0), e))};
  });
  return out;
}

// --------------------------------------------------------------------------- unary math

Tensor neg(const Tensor& a) {
  BOOSTER_OP_CONTEXT("neg");
  Tensor out = unary_forward(UnaryOp::Neg, a);
  autograd::record(out, "NegBackward", {a}, [](const Tensor& g) { return grads{neg(g)}; });
  return out;
}

Tensor exp(const Tensor& a_in) {
  BOOSTER_OP_CONTEXT("exp");
  Tensor a = as_floating(a_in);
  autocast::apply(autocast::Op::Exp, {&a});
  Tensor out = unary_forward(UnaryOp::Exp, a);
  autograd::record(out, "ExpBackward", {a}, [o = out.detach()](const Tensor& g) { return grads{mul(g, o)}; });
  return out;
}

Tensor log(const Tensor& a_in) {
  BOOSTER_OP_CONTEXT("log");
  Tensor a = as_floating(a_in);
  autocast::apply(autocast::Op::Log, {&a});
  Tensor out = unary_forward(UnaryOp::Log, a);
  autograd::record(out, "LogBackward", {a}, [a = a.detach()](const Tensor& g) { return grads{div(g, a)}; });
  return out;
}

Tensor sqrt(const Tensor& a_in) {
  BOOSTER_OP_CONTEXT("sqrt");
  Tensor a = as_floating(a_in);
  Tensor out = unary_forward(UnaryOp::Sqrt, a);
  autograd::record(out, "SqrtBackward", {a}, [o = out.detach()](const Tensor& g) {
    return grads{div(g, mul(o, 2.0))};
  });
  return out;
}

Tensor rsqrt(const Tensor& a_in) {
  BOOSTER_OP_CONTEXT("rsqrt");
  Tensor a = as_floating(a_in);
  Tensor out = unary_forward(UnaryOp::Rsqrt, a);
  autograd::record(out, "RsqrtBackward", {a}, [o = out.detach()](const Tensor& g) {
    return grads{mul(mul(g, pow(o, 3.0)), -0.5)};
  });
  return out;
}

Tensor abs(const Tensor& a) {
  BOOSTER_OP_CONTEXT("abs");
  Tensor out = unary_forward(UnaryOp::Abs, a);
  autograd::record(out, "AbsBackward", {a}, [a = a.detach()](const Tensor& g) {
    return grads{mul(g, unary_forward(UnaryOp::Sign, a))};
  });
  return out;
}

Tensor clamp(const Tensor& a, std::optional<double> lo, std::optional<double> hi) {
  BOOSTER_OP_CONTEXT("clamp");
  const double p0 = lo ? *lo : NAN, p1 = hi ? *hi : NAN;
  Tensor out = unary_forward(UnaryOp::Clamp, a, p0, p1);
  autograd::record(out, "ClampBackward", {a}, [a = a.detach(), p0, p1](const Tensor& g) {
    return grads{unary_backward(UnaryBackwardOp::ClampMask, g, a, p0, p1)};
  });
  return out;
}

Tensor relu(const Tensor& a) {
  BOOSTER_OP_CONTEXT("relu");
  Tensor out = unary_forward(UnaryOp::Relu, a);
  autograd::record(out, "ReluBackward", {a}, [o = out.detach()](const Tensor& g) {
    return grads{unary_backward(UnaryBackwardOp::Relu, g, o)};
  });
  return out;
}

Tensor gelu(const Tensor& a_in, const std::string& approximate) {
  BOOSTER_OP_CONTEXT("gelu");
  BOOSTER_CHECK(approximate == "none" || approximate == "tanh", ValueError,
                "gelu: approximate must be 'none' or 'tanh', got '", approximate, "'");
  Tensor a = as_floating(a_in);
  const bool tanh_form = approximate == "tanh";
  Tensor out = unary_forward(tanh_form ? UnaryOp::GeluTanh : UnaryOp::GeluErf, a);
  autograd::record(out, "GeluBackward", {a}, [a = a.detach(), tanh_form](const Tensor& g) {
    return grads{unary_backward(tanh_form ? UnaryBackwardOp::GeluTanh : UnaryBackwardOp::GeluErf, g, a)};
  });
  return out;
}

Tensor tanh(const Tensor& a_in) {
  BOOSTER_OP_CONTEXT("tanh");
  Tensor a = as_floating(a_in);
  Tensor out = unary_forward(UnaryOp::Tanh, a);
  autograd::record(out, "TanhBackward", {a}, [o = out.detach()](const Tensor& g) {
    return grads{unary_backward(UnaryBackwardOp::Tanh, g, o)};
  });
  return out;
}

Tensor sigmoid(const Tensor& a_in) {
  BOOSTER_OP_CONTEXT("sigmoid");
  Tensor a = as_floating(a_in);
  Tensor out = unary_forward(UnaryOp::Sigmoid, a);
  autograd::record(out, "SigmoidBackward", {a}, [o = out.detach()](const Tensor& g) {
    return grads{unary_backward(UnaryBackwardOp::Sigmoid, g, o)};
  });
  return out;
}

Tensor silu(const Tensor& a_in) {
  BOOSTER_OP_CONTEXT("silu");
  Tensor a = as_floating(a_in);
  Tensor out = unary_forward(UnaryOp::Silu, a);
  autograd::record(out, "SiluBackward", {a}, [a = a.detach()](const Tensor& g) {
    return grads{unary_backward(UnaryBackwardOp::Silu, g, a)};
  });
  return out;
}

// --------------------------------------------------------------------------- selection

Tensor where(const Tensor& cond, const Tensor& a_in, const Tensor& b_in) {
  BOOSTER_OP_CONTEXT("where");
  BOOSTER_CHECK(cond.dtype() == DType::Bool, DTypeError, "where: condition must be bool, got ", cond.dtype());
  Tensor a = a_in, b = b_in;
  autocast::apply(autocast::Op::Where, {&a, &b});
  check_same_device(a, b, "where");
  check_same_device(cond, a, "where");
  const DType dt = promote_types(a.dtype(), b.dtype());
  if (a.dtype() != dt) a = a.to(dt);
  if (b.dtype() != dt) b = b.to(dt);
  const Shape s = broadcast_shapes(broadcast_shapes(cond.shape(), a.shape(), "where"), b.shape(), "where");
  Tensor out = Tensor::empty(s, dt, a.device());
  kernels::where_kernel(a.device())(cond.detach().expand(s), a.detach().expand(s), b.detach().expand(s), out);
  if (autograd::needs_grad({&a, &b})) {
    autograd::record(out, "WhereBackward", {a, b}, [c = cond.detach(), sa = a.shape(), sb = b.shape()](const Tensor& g) {
      Tensor z = zeros({}, g.dtype(), g.device());
      return grads{sum_to(where(c, g, z), sa), sum_to(where(c, z, g), sb)};
    });
  }
  return out;
}

Tensor masked_fill(const Tensor& a, const Tensor& mask, double value) {
  BOOSTER_OP_CONTEXT("masked_fill");
  BOOSTER_CHECK(mask.dtype() == DType::Bool, DTypeError, "masked_fill: mask must be bool, got ", mask.dtype());
  const Shape s = broadcast_shapes(a.shape(), mask.shape(), "masked_fill");
  BOOSTER_CHECK(s == a.shape(), ShapeError, "masked_fill: mask of shape ", mask.shape(),
                " does not broadcast to the input's shape ", a.shape());
  Tensor fill = full({}, value, a.dtype(), a.device());
  Tensor out = Tensor::empty(s, a.dtype(), a.device());
  kernels::where_kernel(a.device())(mask.detach().expand(s), fill.expand(s), a.detach(), out);
  autograd::record(out, "MaskedFillBackward", {a}, [m = mask.detach()](const Tensor& g) {
    return grads{where(m, zeros({}, g.dtype(), g.device()), g)};
  });
  return out;
}

// --------------------------------------------------------------------------- operators

Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
Tensor operator-(const Tensor& a) { return neg(a); }
Tensor operator+(const Tensor& a, double s) { return add(a, s); }
Tensor operator+(double s, const Tensor& a) { return add(a, s); }
Tensor operator-(const Tensor& a, double s) { return add(a, -s); }
Tensor operator-(double s, const Tensor& a) { return rsub(a, s); }
Tensor operator*(const Tensor& a, double s) { return mul(a, s); }
Tensor operator*(double s, const Tensor& a) { return mul(a, s); }
Tensor operator/(const Tensor& a, double s) { return mul(a, 1.0 / s); }
Tensor operator/(double s, const Tensor& a) { return rdiv(a, s); }

}  // namespace booster
