// Linear algebra: matmul (torch.matmul semantics), linear, bmm. All GEMMs go through gemm_kernel
// (backends/cpu/gemm.cpp); transposes are passed as views and become BLAS transpose flags (Note [GEMM
// operand layouts]), so no backward materializes a transposed matrix.
//
// Note [Folding batch into rows]
// x[..., k] @ W[k, n] with a 2-D right operand is one GEMM of x viewed as [rows, k], rows = the product
// of x's leading dims, rather than one GEMM per batch entry; its weight gradient x^T g is then also one
// GEMM whose inner dim runs over all rows, which sums over the batch for free. linear is the same with
// W^T.
#include "booster/autocast/autocast.h"
#include "booster/autograd/autograd.h"
#include "booster/kernels/gemm.h"
#include "booster/common/error_context.h"
#include "booster/ops/ops.h"
#include "booster/ops/ops_impl.h"

namespace booster {

using autograd::grads;

namespace {

// c[b] = op(a[b]) @ op(b[b]) (+ c[b] when accumulate) on 3-D views; no autograd.
void gemm3(const Tensor& a, const Tensor& b, Tensor& c, bool accumulate = false) {
  kernels::GemmArgs args;
  args.beta = accumulate ? 1.0 : 0.0;
  kernels::gemm_kernel(c.device())(args, a, b, c);
}

Tensor as_3d_2d(const Tensor& m) {  // [r, c] -> [1, r, c] without copying
  return make_view(m, {1, m.shape()[0], m.shape()[1]}, {0, m.strides()[0], m.strides()[1]}, m.offset());
}

// The single stride that walks t's batch dims [first, nb) (nb = t.dim() - 2) in row-major order, if
// one exists: contiguous batches, or an expanded operand's stride 0.
bool batch_stride(const Tensor& t, int64_t first, int64_t& stride) {
  stride = 0;
  int64_t expected = -1;
  for (int64_t d = t.dim() - 3; d >= first; --d) {
    const int64_t size = t.shape()[size_t(d)], st = t.strides()[size_t(d)];
    if (size == 1) continue;
    if (expected < 0) stride = st;
    else if (st != expected) return false;
    expected = st * size;
  }
  return true;
}

// t [..., c] viewed (or, when its strides forbid, copied) as [rows, c], rows = product of the leading
// dims (explicit, so empty tensors fold too).
Tensor fold_rows(const Tensor& t) {
  if (t.dim() == 2) return t;
  const int64_t c = t.dim() == 0 ? 1 : t.shape().back();
  return t.reshape({numel_of(Shape(t.shape().begin(), t.shape().end() - (t.dim() > 0 ? 1 : 0))), c});
}

void check_operands(const Tensor& a, const Tensor& b, const char* op) {
  check_same_device(a, b, op);
  BOOSTER_CHECK(a.dtype() == b.dtype(), DTypeError, op, ": expected both operands to have the same dtype, got ",
                a.dtype(), " and ", b.dtype());
  BOOSTER_CHECK(is_floating(a.dtype()), DTypeError, op, ": expected floating operands, got ", a.dtype());
}

// a @ b for a, b of at least 2 dims, on detached tensors (no autograd), broadcasting batch dims.
Tensor mm_nd(const Tensor& a, const Tensor& b) {
  const int64_t k = a.shape().back(), n = b.shape().back();
  const int64_t m = a.shape()[size_t(a.dim() - 2)];
  if (b.dim() == 2) {  // Note [Folding batch into rows]
    Tensor a2 = fold_rows(a);
    Tensor out = Tensor::empty({a2.shape()[0], n}, a.dtype(), a.device());
    Tensor c3 = as_3d_2d(out);
    gemm3(as_3d_2d(a2), as_3d_2d(b), c3);
    Shape s(a.shape().begin(), a.shape().end() - 1);
    s.push_back(n);
    return a.dim() == 2 ? out : make_view(out, s, contiguous_strides(s), 0);
  }
  const Shape ba(a.shape().begin(), a.shape().end() - 2), bb(b.shape().begin(), b.shape().end() - 2);
  Shape batch = broadcast_shapes(ba, bb, "matmul");
  Shape sa = batch, sb = batch, so = batch;
  sa.insert(sa.end(), {m, k});
  sb.insert(sb.end(), {k, n});
  so.insert(so.end(), {m, n});
  Tensor out = Tensor::empty(so, a.dtype(), a.device());
  if (out.numel() == 0) return out;
  // Note [Batched GEMM without copies]: the trailing batch dims that collapse into one stride in both
  // operands form the kernel's batch; the leading rest (e.g. the B of a [B, H, T, D] view permuted from
  // [B, T, H, D], as attention heads are) is walked here, one kernel call each, instead of copying.
  const Tensor ae = a.expand(sa), be = b.expand(sb);
  const int64_t nb = int64_t(batch.size());
  int64_t first = 0, stride_a = 0, stride_b = 0;
  // One batch dim always has a stride, so this stops at nb - 1 at the latest (0 without batch dims).
  while (!(batch_stride(ae, first, stride_a) && batch_stride(be, first, stride_b))) ++first;
  const Shape outer_batch(batch.begin(), batch.begin() + first);
  int64_t inner = 1;
  for (int64_t d = first; d < nb; ++d) inner *= batch[size_t(d)];
  const int64_t outer = numel_of(outer_batch);
  for (int64_t o = 0; o < outer; ++o) {
    int64_t off_a = ae.offset(), off_b = be.offset(), rest = o;
    for (int64_t d = first - 1; d >= 0; --d) {
      const int64_t i = rest % batch[size_t(d)];
      rest /= batch[size_t(d)];
      off_a += i * ae.strides()[size_t(d)];
      off_b += i * be.strides()[size_t(d)];
    }
    Tensor a3 = make_view(ae, {inner, m, k}, {stride_a, ae.strides()[size_t(nb)], ae.strides()[size_t(nb + 1)]}, off_a);
    Tensor b3 = make_view(be, {inner, k, n}, {stride_b, be.strides()[size_t(nb)], be.strides()[size_t(nb + 1)]}, off_b);
    Tensor c3 = make_view(out, {inner, m, n}, {m * n, n, 1}, o * inner * m * n);
    gemm3(a3, b3, c3);
  }
  return out;
}

Tensor mT(const Tensor& t) { return t.transpose(-1, -2); }

Tensor matmul_nd(const Tensor& a, const Tensor& b) {
  Tensor out = mm_nd(a.detach(), b.detach());
  if (autograd::needs_grad({&a, &b})) {
    const bool ga = a.requires_grad(), gb = b.requires_grad();
    autograd::record(out, "MatmulBackward", {a, b}, [a = a.detach(), b = b.detach(), ga, gb](const Tensor& g) {
      Tensor grad_a, grad_b;
      if (ga) grad_a = autograd::sum_to(mm_nd(g, mT(b)), a.shape());
      if (gb) {
        if (b.dim() == 2) {  // one GEMM over all folded rows: a2^T g2
          grad_b = mm_nd(fold_rows(a).t(), fold_rows(g));
        } else {
          grad_b = autograd::sum_to(mm_nd(mT(a), g), b.shape());
        }
      }
      return grads{grad_a, grad_b};
    });
  }
  return out;
}

}  // namespace

Tensor matmul(const Tensor& a_in, const Tensor& b_in) {
  BOOSTER_OP_CONTEXT("matmul");  // Note [Error context]
  Tensor a = a_in, b = b_in;
  autocast::apply(autocast::Op::Matmul, {&a, &b});
  BOOSTER_CHECK(a.dim() >= 1 && b.dim() >= 1, ShapeError, "matmul: both operands need at least 1 dim, got shapes ",
                a.shape(), " and ", b.shape());
  const int64_t ka = a.shape().back(), kb = b.dim() == 1 ? b.shape()[0] : b.shape()[size_t(b.dim() - 2)];
  BOOSTER_CHECK(ka == kb, ShapeError, "matmul: shapes ", a.shape(), " and ", b.shape(), " cannot be multiplied (",
                ka, " != ", kb, ")");
  check_operands(a, b, "matmul");
  // 1-D operands become matrices through differentiable views, as torch.matmul does.
  if (a.dim() == 1 && b.dim() == 1) return matmul_nd(a.unsqueeze(0), b.unsqueeze(1)).squeeze(-1).squeeze(-1);
  if (a.dim() == 1) return matmul_nd(a.unsqueeze(0), b).squeeze(-2);
  if (b.dim() == 1) return matmul_nd(a, b.unsqueeze(1)).squeeze(-1);
  return matmul_nd(a, b);
}

Tensor bmm(const Tensor& a_in, const Tensor& b_in) {
  BOOSTER_OP_CONTEXT("bmm");
  Tensor a = a_in, b = b_in;
  autocast::apply(autocast::Op::Bmm, {&a, &b});
  BOOSTER_CHECK(a.dim() == 3 && b.dim() == 3, ShapeError, "bmm: expected 3-D operands, got shapes ", a.shape(),
                " and ", b.shape());
  BOOSTER_CHECK(a.shape()[0] == b.shape()[0], ShapeError, "bmm: batch sizes differ: shapes ", a.shape(), " and ",
                b.shape(), " (", a.shape()[0], " != ", b.shape()[0], ")");
  BOOSTER_CHECK(a.shape()[2] == b.shape()[1], ShapeError, "bmm: shapes ", a.shape(), " and ", b.shape(),
                " cannot be multiplied (", a.shape()[2], " != ", b.shape()[1], ")");
  check_operands(a, b, "bmm");
  Tensor out = Tensor::empty({a.shape()[0], a.shape()[1], b.shape()[2]}, a.dtype(), a.device());
  gemm3(a.detach(), b.detach(), out);
  if (autograd::needs_grad({&a, &b})) {
    const bool ga = a.requires_grad(), gb = b.requires_grad();
    autograd::record(out, "BmmBackward", {a, b}, [a = a.detach(), b = b.detach(), ga, gb](const Tensor& g) {
      Tensor grad_a, grad_b;
      if (ga) {
        grad_a = Tensor::empty(a.shape(), g.dtype(), g.device());
        gemm3(g, mT(b), grad_a);
      }
      if (gb) {
        grad_b = Tensor::empty(b.shape(), g.dtype(), g.device());
        gemm3(mT(a), g, grad_b);
      }
      return grads{grad_a, grad_b};
    });
  }
  return out;
}

namespace {

// Note [Aligned GEMM pieces]
// A 16-bit GEMM whose vocabulary-sized dimension is not a multiple of 8 (GPT-2's 50257) misses
// cuBLAS's fast tensor-core kernels even when its rows are aligned: measured on an H100, the lm_head
// forward ran at 95 TFLOP/s. So on a GPU, `features` (out_features) is cut into an aligned head of
// round_down(features, 64) and a small tail, each a GEMM of its own (the tail accumulating where
// they share an output).
struct FeatureSplit {
  int64_t head = 0, tail = 0;
};
FeatureSplit split_features(const Tensor& x, int64_t features, int64_t row_multiple) {
  if (!x.device().is_cuda() || row_multiple <= 1 || features <= 64 || features % 64 == 0) return {features, 0};
  return {features / 64 * 64, features % 64};
}

// [rows, head + 64] over a [rows, features] matrix whose rows are at least that far apart (the padded
// rows of Note [Aligned GEMM pieces]), reaching into the never-read padding; undefined without room.
Tensor padded_columns(const Tensor& m, FeatureSplit sp) {
  if (m.size(0) == 0 || m.stride(1) != 1 || m.stride(0) < sp.head + 64) return Tensor();
  // The last row's padding must lie inside the storage too (a view cut from a wider tensor may end short).
  const int64_t end = m.offset() + (m.size(0) - 1) * m.stride(0) + sp.head + 64;
  if (size_t(end) * itemsize(m.dtype()) > m.storage()->nbytes()) return Tensor();
  return make_view(m, {m.size(0), sp.head + 64}, {m.stride(0), 1}, m.offset());
}

// y2 [rows, features] = x2 [rows, in] w^T (+ y2 when accumulate). Where y2's rows have room, one GEMM
// 64-aligned wide over a zero-padded copy of w (its rows padded; a copy of w costs far less than an
// odd-sized GEMM); else the aligned head and the tail as two GEMMs.
void linear_forward_gemm(const Tensor& x2, const Tensor& w, Tensor& y2, bool accumulate, FeatureSplit sp) {
  const Tensor y_padded = sp.tail == 0 ? Tensor() : padded_columns(y2, sp);
  if (sp.tail == 0 || y_padded.defined()) {
    Tensor wp = w;
    if (sp.tail != 0) {
      NoGradGuard ng;
      wp = Tensor::empty({sp.head + 64, w.size(1)}, w.dtype(), w.device());
      wp.narrow(0, 0, w.size(0)).copy_(w);
      wp.narrow(0, w.size(0), sp.head + 64 - w.size(0)).zero_();
    }
    Tensor c3 = as_3d_2d(sp.tail == 0 ? y2 : y_padded);
    gemm3(as_3d_2d(x2), as_3d_2d(wp.t()), c3, accumulate);
    return;
  }
  for (auto [start, len] : {std::pair{int64_t(0), sp.head}, std::pair{sp.head, sp.tail}}) {
    Tensor c3 = as_3d_2d(y2.narrow(1, start, len));
    gemm3(as_3d_2d(x2), as_3d_2d(w.narrow(0, start, len).t()), c3, accumulate);
  }
}

// dX = dY W over the split: the head's GEMM, then the tail's accumulated into it.
Tensor linear_input_grad(const Tensor& g2, const Tensor& w, FeatureSplit sp) {
  if (sp.tail == 0) return mm_nd(g2, w);
  Tensor dx = Tensor::empty({g2.size(0), w.size(1)}, g2.dtype(), g2.device());
  Tensor c3 = as_3d_2d(dx);
  gemm3(as_3d_2d(g2.narrow(1, 0, sp.head)), as_3d_2d(w.narrow(0, 0, sp.head)), c3);
  gemm3(as_3d_2d(g2.narrow(1, sp.head, sp.tail)), as_3d_2d(w.narrow(0, sp.head, sp.tail)), c3, true);
  return dx;
}

// dW = dY^T X. Where dY's rows have room, one GEMM 64-aligned tall over dY's padding into a taller dW
// whose first `features` rows are returned (the others depend on the padding alone); else the head's
// rows and the tail's from two GEMMs.
Tensor linear_weight_grad(const Tensor& g2, const Tensor& x2, FeatureSplit sp) {
  if (sp.tail == 0) return mm_nd(g2.t(), x2);
  const Tensor g_padded = padded_columns(g2, sp);
  if (g_padded.defined()) {
    Tensor dw = Tensor::empty({sp.head + 64, x2.size(1)}, g2.dtype(), g2.device());
    Tensor c3 = as_3d_2d(dw);
    gemm3(as_3d_2d(g_padded.t()), as_3d_2d(x2), c3);
    return dw.narrow(0, 0, g2.size(1));
  }
  Tensor dw = Tensor::empty({g2.size(1), x2.size(1)}, g2.dtype(), g2.device());
  for (auto [start, len] : {std::pair{int64_t(0), sp.head}, std::pair{sp.head, sp.tail}}) {
    Tensor c3 = as_3d_2d(dw.narrow(0, start, len));
    gemm3(as_3d_2d(g2.narrow(1, start, len).t()), as_3d_2d(x2), c3);
  }
  return dw;
}

// db = column sums of dY [rows, features]. For 16-bit dY on a GPU, a GEMM with a ones vector (float32
// accumulation, one rounding, as the reduction; float32 stays on the reduction, which TF32 GEMMs would
// round): a column sum through the reduction kernels first copies dY transposed, which cost a GPT-2
// bf16 step about 3 ms.
Tensor linear_bias_grad(const Tensor& g2) {
  if (!g2.device().is_cuda() || !is_low_precision(g2.dtype()) || g2.size(0) == 0) return sum(g2, {0});
  const Tensor ones_col = ones({g2.size(0), 1}, g2.dtype(), g2.device());
  Tensor db = Tensor::empty({g2.size(1), 1}, g2.dtype(), g2.device());
  Tensor c3 = as_3d_2d(db);
  gemm3(as_3d_2d(g2.t()), as_3d_2d(ones_col), c3);
  return db.view({g2.size(1)});
}

}  // namespace

Tensor linear(const Tensor& x_in, const Tensor& w_in, const Tensor& bias_in, int64_t row_multiple) {
  BOOSTER_OP_CONTEXT("linear");
  if (autocast::LinearOverride* o = autocast::linear_override()) {
    Tensor y = o->linear(x_in, w_in, bias_in);
    if (y.defined()) return y;
  }
  Tensor x = x_in, w = w_in, bias = bias_in;
  autocast::apply(autocast::Op::Linear, {&x, &w, &bias});
  BOOSTER_CHECK(w.dim() == 2, ShapeError, "linear: weight must be 2-D [out_features, in_features], got shape ",
                w.shape());
  BOOSTER_CHECK(x.dim() >= 1, ShapeError, "linear: input must have at least 1 dim, got shape ", x.shape());
  const int64_t in = w.shape()[1], out_features = w.shape()[0];
  BOOSTER_CHECK(x.shape().back() == in, ShapeError, "linear: input shape ", x.shape(), " and weight shape ",
                w.shape(), " cannot be multiplied (", x.shape().back(), " != ", in, ")");
  check_operands(x, w, "linear");
  if (bias.defined()) {
    BOOSTER_CHECK(bias.dim() == 1 && bias.shape()[0] == out_features, ShapeError, "linear: bias shape ",
                  bias.shape(), " does not match out_features ", out_features, " of weight shape ", w.shape());
    check_operands(x, bias, "linear");
  }

  // Note [Folding batch into rows]: one GEMM; the bias is broadcast into C first and added by beta = 1.
  const Tensor x2 = fold_rows(x.detach());
  const int64_t rows = x2.shape()[0];
  const int64_t row_stride = x.device().is_cuda() && row_multiple > 1
                                 ? (out_features + row_multiple - 1) / row_multiple * row_multiple
                                 : out_features;
  Tensor out2 = Tensor::empty({rows, row_stride}, x.dtype(), x.device());
  if (row_stride != out_features) out2 = make_view(out2, {rows, out_features}, {row_stride, 1}, 0);
  if (bias.defined()) {
    NoGradGuard ng;
    out2.copy_(bias.detach().expand(out2.shape()));
  }
  const FeatureSplit split = split_features(x, out_features, row_multiple);
  linear_forward_gemm(x2, w.detach(), out2, bias.defined(), split);
  Shape s(x.shape().begin(), x.shape().end() - 1);
  s.push_back(out_features);
  Shape st = contiguous_strides(s);
  if (row_stride != out_features)
    for (size_t d = 0; d + 1 < st.size(); ++d) st[d] = st[d] / out_features * row_stride;
  Tensor out = make_view(out2, s, st, 0);

  if (autograd::needs_grad({&x, &w, &bias})) {
    const bool gx = x.requires_grad(), gw = w.requires_grad(), gb = bias.defined() && bias.requires_grad();
    std::vector<Tensor> inputs{x, w};
    if (bias.defined()) inputs.push_back(bias);
    autograd::record(out, "LinearBackward", inputs,
                     [x2 = gw ? x2 : Tensor(), w = w.detach(), x_shape = x.shape(), gx, gw, gb,
                      has_bias = bias.defined(), split](const Tensor& g) {
                       Tensor g2 = fold_rows(g);
                       grads r(has_bias ? 3 : 2);
                       if (gx) r[0] = linear_input_grad(g2, w, split).reshape(x_shape);  // dX = dY W
                       if (gw) r[1] = linear_weight_grad(g2, x2, split);  // dW = dY^T X, over all rows
                       if (gb) r[2] = linear_bias_grad(g2);               // db = column sums of dY
                       return r;
                     });
  }
  return out;
}

}  // namespace booster
