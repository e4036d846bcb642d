// Neural-network functions: softmax, log_softmax, layer_norm, batch_norm, dropout and scaled
// dot-product attention. Each one: autocast, checks, one fused kernel (kernels/nn.h), and a fused
// backward kernel recorded for autograd. Saved statistics stay in float32 (float64 for float64).
#include <atomic>
#include <cmath>
#include <cstdint>

#include "booster/autocast/autocast.h"
#include "booster/autograd/autograd.h"
#include "booster/kernels/nn.h"
#include "booster/common/error_context.h"
#include "booster/ops/ops.h"

namespace booster {

using autograd::grads;

namespace {

// The dtype kernels save statistics in: float64 for float64, float32 otherwise.
DType stats_dtype(DType t) { return t == DType::Float64 ? DType::Float64 : DType::Float32; }

void check_floating(const Tensor& t, const char* op, const char* what) {
  BOOSTER_CHECK(is_floating(t.dtype()), DTypeError, op, ": expected a floating ", what,
                " (float64, float32, float16, bfloat16), got ", t.dtype());
}

// An incoming gradient as the backward kernels want it: contiguous, in the forward's dtype.
Tensor grad_as(const Tensor& g, DType dtype) {
  Tensor r = g.dtype() == dtype ? g : g.to(dtype);
  return r.contiguous();
}

// A parameter converted to x's dtype, differentiably (a float32 weight on float64 x in gradcheck).
Tensor param_as(const Tensor& p, DType dtype) { return !p.defined() || p.dtype() == dtype ? p : p.to(dtype); }

// ----------------------------------------------------------------------------------------- softmax

Tensor softmax_common(const Tensor& a_in, int64_t dim, bool log) {
  BOOSTER_OP_CONTEXT(log ? "log_softmax" : "softmax");  // Note [Error context]
  const char* name = log ? "log_softmax" : "softmax";
  Tensor a = a_in;
  autocast::apply(log ? autocast::Op::LogSoftmax : autocast::Op::Softmax, {&a});
  check_floating(a, name, "input");
  // A 0-d tensor takes dim 0 or -1, as torch.softmax does.
  const int64_t d = wrap_dim(dim, std::max<int64_t>(a.dim(), 1), name);
  int64_t outer = 1, inner = 1;
  const int64_t size = a.dim() == 0 ? 1 : a.size(d);
  for (int64_t i = 0; i < d; ++i) outer *= a.size(i);
  for (int64_t i = d + 1; i < a.dim(); ++i) inner *= a.size(i);

  const Tensor x = a.detach().contiguous();
  Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
  if (out.numel() > 0) kernels::softmax_kernel(a.device())(x, outer, size, inner, log, out);
  autograd::record(out, log ? "LogSoftmaxBackward" : "SoftmaxBackward", {a},
                   [y = out.detach(), outer, size, inner, log](const Tensor& g) {
                     const Tensor gc = grad_as(g, y.dtype());
                     Tensor dx = Tensor::empty(y.shape(), y.dtype(), y.device());
                     if (dx.numel() > 0)
                       kernels::softmax_backward_kernel(y.device())(gc, y, outer, size, inner, log, dx);
                     return grads{dx};
                   });
  return out;
}

}  // namespace

Tensor softmax(const Tensor& a, int64_t dim) { return softmax_common(a, dim, /*log=*/false); }
Tensor log_softmax(const Tensor& a, int64_t dim) { return softmax_common(a, dim, /*log=*/true); }

// -------------------------------------------------------------------------------------- layer norm

Tensor layer_norm(const Tensor& x_in, const Shape& normalized_shape, const Tensor& weight_in, const Tensor& bias_in,
                  double eps) {
  BOOSTER_OP_CONTEXT("layer_norm");
  Tensor x = x_in, weight = weight_in, bias = bias_in;
  autocast::apply(autocast::Op::LayerNorm, {&x, &weight, &bias});
  check_floating(x, "layer_norm", "input");
  const int64_t nd = int64_t(normalized_shape.size());
  bool trailing_match = nd >= 1 && nd <= x.dim();
  for (int64_t i = 0; trailing_match && i < nd; ++i)
    trailing_match = x.size(x.dim() - nd + i) == normalized_shape[size_t(i)];
  BOOSTER_CHECK(trailing_match, ShapeError, "layer_norm: normalized_shape ", normalized_shape,
                " must be non-empty and equal the last dims of the input shape ", x.shape());
  for (const Tensor* p : std::initializer_list<const Tensor*>{&weight, &bias})
    BOOSTER_CHECK(!p->defined() || p->shape() == normalized_shape, ShapeError, "layer_norm: ",
                  p == &weight ? "weight" : "bias", " of shape ", p->shape(), " must have normalized_shape ",
                  normalized_shape);
  BOOSTER_CHECK(eps >= 0, ValueError, "layer_norm: eps must be >= 0, got ", eps);
  weight = param_as(weight, x.dtype());
  bias = param_as(bias, x.dtype());

  const int64_t cols = numel_of(normalized_shape);
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  const Tensor xc = x.detach().contiguous();
  const Tensor wc = weight.defined() ? weight.detach().contiguous() : Tensor();
  const Tensor bc = bias.defined() ? bias.detach().contiguous() : Tensor();
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  Tensor mean = Tensor::empty({rows}, stats_dtype(x.dtype()), x.device());
  Tensor rstd = Tensor::empty({rows}, stats_dtype(x.dtype()), x.device());
  if (out.numel() > 0) kernels::layer_norm_kernel(x.device())(xc, wc, bc, rows, cols, eps, out, mean, rstd);

  if (autograd::needs_grad({&x, &weight, &bias})) {
    const bool gx = x.requires_grad(), gw = weight.defined() && weight.requires_grad(),
               gb = bias.defined() && bias.requires_grad();
    autograd::record(out, "LayerNormBackward", {x, weight, bias},
                     [xc, wc, mean, rstd, rows, cols, gx, gw, gb, ns = normalized_shape](const Tensor& g) {
                       const Tensor gc = grad_as(g, xc.dtype());
                       Tensor dx = gx ? Tensor::empty(xc.shape(), xc.dtype(), xc.device()) : Tensor();
                       Tensor dw = gw ? Tensor::empty(ns, xc.dtype(), xc.device()) : Tensor();
                       Tensor db = gb ? Tensor::empty(ns, xc.dtype(), xc.device()) : Tensor();
                       if (rows == 0) {
                         NoGradGuard ng;
                         for (Tensor* t : {&dx, &dw, &db})
                           if (t->defined()) t->zero_();
                       } else {
                         kernels::layer_norm_backward_kernel(xc.device())(gc, xc, mean, rstd, wc, rows, cols, dx, dw,
                                                                          db);
                       }
                       return grads{dx, dw, db};
                     });
  }
  return out;
}

// -------------------------------------------------------------------------------------- batch norm

Tensor batch_norm(const Tensor& x_in, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight_in,
                  const Tensor& bias_in, bool training, double momentum, double eps) {
  BOOSTER_OP_CONTEXT("batch_norm");
  Tensor x = x_in, weight = weight_in, bias = bias_in;
  autocast::apply(autocast::Op::BatchNorm, {&x, &weight, &bias});
  check_floating(x, "batch_norm", "input");
  BOOSTER_CHECK(x.dim() == 2 || x.dim() == 3, ShapeError, "batch_norm: expected input of shape [N, C] or [N, C, L], got ",
                x.shape());
  const int64_t N = x.size(0), C = x.size(1), L = x.dim() == 3 ? x.size(2) : 1;
  BOOSTER_CHECK(running_mean.defined() == running_var.defined(), ValueError,
                "batch_norm: running_mean and running_var must be both defined or both undefined");
  for (const Tensor* p : std::initializer_list<const Tensor*>{&running_mean, &running_var, &weight, &bias})
    BOOSTER_CHECK(!p->defined() || p->shape() == Shape{C}, ShapeError, "batch_norm: ",
                  p == &running_mean ? "running_mean" : p == &running_var ? "running_var" : p == &weight ? "weight" : "bias",
                  " of shape ", p->shape(), " must have shape [", C, "] (the input's channels, shape ", x.shape(), ")");
  const bool use_batch_stats = training || !running_mean.defined();
  BOOSTER_CHECK(!use_batch_stats || N * L > 1, ValueError,
                "batch_norm: expected more than 1 value per channel when using batch statistics, got input shape ",
                x.shape());
  BOOSTER_CHECK(eps >= 0, ValueError, "batch_norm: eps must be >= 0, got ", eps);
  weight = param_as(weight, x.dtype());
  bias = param_as(bias, x.dtype());

  const DType sdt = stats_dtype(x.dtype());
  const Tensor xc = x.detach().contiguous().view({N, C, L});
  const Tensor wc = weight.defined() ? weight.detach().contiguous() : Tensor();
  const Tensor bc = bias.defined() ? bias.detach().contiguous() : Tensor();
  Tensor rm, rv;
  if (!use_batch_stats) {
    rm = running_mean.detach().to(sdt).contiguous();
    rv = running_var.detach().to(sdt).contiguous();
  }
  const bool update_running = training && running_mean.defined();
  Tensor out = Tensor::empty({N, C, L}, x.dtype(), x.device());
  Tensor save_mean = Tensor::empty({C}, sdt, x.device());
  Tensor save_rstd = Tensor::empty({C}, sdt, x.device());
  Tensor var_unbiased = update_running ? Tensor::empty({C}, sdt, x.device()) : Tensor();
  if (C > 0)
    kernels::batch_norm_kernel(x.device())(xc, wc, bc, rm, rv, use_batch_stats, eps, out, save_mean, save_rstd,
                                           var_unbiased);
  if (update_running) {
    // running = (1 - momentum) running + momentum batch, with the unbiased variance (as PyTorch).
    NoGradGuard ng;
    Tensor(running_mean).mul_(1 - momentum).add_(save_mean, momentum);
    Tensor(running_var).mul_(1 - momentum).add_(var_unbiased, momentum);
  }
  out = out.view(x.shape());

  if (autograd::needs_grad({&x, &weight, &bias})) {
    const bool gx = x.requires_grad(), gw = weight.defined() && weight.requires_grad(),
               gb = bias.defined() && bias.requires_grad();
    autograd::record(out, "BatchNormBackward", {x, weight, bias},
                     [xc, wc, save_mean, save_rstd, use_batch_stats, gx, gw, gb, shape = x.shape()](const Tensor& g) {
                       const Tensor gc = grad_as(g, xc.dtype()).view(xc.shape());
                       const int64_t C = xc.size(1);
                       Tensor dx = gx ? Tensor::empty(xc.shape(), xc.dtype(), xc.device()) : Tensor();
                       Tensor dw = gw ? Tensor::empty({C}, xc.dtype(), xc.device()) : Tensor();
                       Tensor db = gb ? Tensor::empty({C}, xc.dtype(), xc.device()) : Tensor();
                       if (C > 0)
                         kernels::batch_norm_backward_kernel(xc.device())(gc, xc, wc, save_mean, save_rstd,
                                                                          use_batch_stats, dx, dw, db);
                       return grads{gx ? dx.view(shape) : Tensor(), dw, db};
                     });
  }
  return out;
}

// ----------------------------------------------------------------------------------------- dropout

Tensor dropout(const Tensor& a, double p, bool training, Generator* gen) {
  BOOSTER_OP_CONTEXT("dropout");
  BOOSTER_CHECK(p >= 0.0 && p <= 1.0, ValueError, "dropout: probability p must be in [0, 1], got ", p);
  if (!training || p == 0.0) return a;
  check_floating(a, "dropout", "input");
  // Note [Dropout masks]
  // The mask is drawn on the host from the generator, one uniform float per element in row-major
  // order, so a seeded Generator gives the same mask on every machine, thread count and device.
  // Element i is kept when u_i >= p; kept elements are scaled by 1 / (1 - p).
  const int64_t n = a.numel();
  Tensor keep = Tensor::empty(a.shape(), DType::Bool, Device::cpu());
  bool* pk = keep.data<bool>();
  if (p == 1.0) {
    std::fill_n(pk, n, false);
  } else {
    Generator& g = gen ? *gen : default_generator();
    const float pf = float(p);
    for (int64_t i = 0; i < n; ++i) pk[i] = g.uniform_float() >= pf;
  }
  keep = keep.to(a.device());
  const double scale = p == 1.0 ? 0.0 : 1.0 / (1.0 - p);
  Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
  kernels::masked_scale_kernel(a.device())(a.detach().contiguous(), keep, scale, out);
  autograd::record(out, "DropoutBackward", {a}, [keep, scale](const Tensor& g) {
    const Tensor gc = g.contiguous();
    Tensor dx = Tensor::empty(gc.shape(), gc.dtype(), gc.device());
    kernels::masked_scale_kernel(gc.device())(gc, keep, scale, dx);
    return grads{dx};
  });
  return out;
}

// --------------------------------------------------------------------------------------- attention

namespace {

std::atomic<bool> flash_enabled{true};

// Rows the flash kernels can read and write in place: unit stride along E, every other stride a
// multiple of 8 elements and the data 16-byte aligned.
bool flash_layout(const Tensor& t) {
  if (t.stride(t.dim() - 1) != 1 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    if (t.size(d) > 1 && t.stride(d) % 8 != 0) return false;
  return true;
}

bool use_flash(const Tensor& q, const Tensor& k, const Tensor& v, int64_t L, int64_t S, int64_t E, int64_t Ev) {
  if (!flash_enabled.load(std::memory_order_relaxed) || !q.device().is_cuda() ||
      !kernels::flash_attention_kernel.has(DeviceType::CUDA))
    return false;
  if ((q.dtype() != DType::Float16 && q.dtype() != DType::BFloat16) || E != Ev || (E != 16 && E != 32 && E != 64 && E != 128))
    return false;
  if ((q.dim() != 3 && q.dim() != 4) || q.size(0) == 0 || L == 0 || S == 0 || L > INT32_MAX || S > INT32_MAX)
    return false;
  const int64_t bh = q.dim() == 4 ? q.size(0) * q.size(1) : q.size(0);
  return bh <= 65535 && flash_layout(q) && flash_layout(k) && flash_layout(v);
}

// An uninitialized tensor of t's shape laid out [B, L, H, E] (heads of one position side by side), as
// the [B, H, L, E] view; [B, L, E] stays contiguous.
Tensor empty_heads_last(const Tensor& t) {
  if (t.dim() == 3) return Tensor::empty(t.shape(), t.dtype(), t.device());
  return Tensor::empty({t.size(0), t.size(2), t.size(1), t.size(3)}, t.dtype(), t.device()).transpose(1, 2);
}

Tensor flash_attention(const Tensor& q, const Tensor& k, const Tensor& v, const kernels::AttentionMaskArgs& mask,
                       double scale) {
  const Tensor qd = q.detach(), kd = k.detach(), vd = v.detach();
  const int64_t H = q.dim() == 4 ? q.size(1) : 1, L = q.size(q.dim() - 2);
  Tensor out = empty_heads_last(q);
  Tensor lse = Tensor::empty({q.size(0), H, L}, DType::Float32, q.device());
  kernels::flash_attention_kernel(q.device())(qd, kd, vd, mask, scale, out, lse);
  if (autograd::needs_grad({&q, &k, &v})) {
    const bool gq = q.requires_grad(), gk = k.requires_grad(), gv = v.requires_grad();
    autograd::record(out, "ScaledDotProductAttentionBackward", {q, k, v},
                     [qd, kd, vd, o = out.detach(), lse, mask, scale, gq, gk, gv](const Tensor& g) {
                       Tensor gc = g.dtype() == qd.dtype() ? g : g.to(qd.dtype());
                       if (!flash_layout(gc)) gc = gc.contiguous();
                       Tensor dq = empty_heads_last(qd), dk = empty_heads_last(kd), dv = empty_heads_last(vd);
                       kernels::flash_attention_backward_kernel(qd.device())(gc, qd, kd, vd, o, lse, mask, scale,
                                                                             dq, dk, dv);
                       return grads{gq ? dq : Tensor(), gk ? dk : Tensor(), gv ? dv : Tensor()};
                     });
  }
  return out;
}

}  // namespace

void set_flash_attention_enabled(bool enabled) { flash_enabled.store(enabled, std::memory_order_relaxed); }
bool flash_attention_enabled() { return flash_enabled.load(std::memory_order_relaxed); }

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool is_causal,
                                    std::optional<double> scale) {
  return scaled_dot_product_attention(q, k, v, is_causal, scale, AttentionMask{});
}

// Note [Attention masks]
// ~~~~~~~~~~~~~~~~~~~~~~
// A sliding window and packed documents restrict the causal mask further (AttentionMask in ops.h).
// The window follows Hugging Face's sliding_window_overlay (transformers' masking_utils): key j is kept
// when j > i - sliding_window, i.e. i - j < window, so a query sees itself and window - 1 keys before it
// (older transformers releases built Mistral's mask with torch.triu(..., -sliding_window), one key
// more; the current convention, which flash-attn's window_size = (window - 1, 0) matches, is the one
// here). Segments give each position a document id; with is_causal a query attends the earlier keys
// of its own document only, as if each document were a sequence of its own (SFT packing). The mask is
// evaluated inside the unfused kernels, row by row, from these three numbers and the ids: no [L, S]
// mask tensor is made. Masked probabilities are exactly 0, so the backward (which reads the saved
// probabilities) needs no mask. Since query i always sees key offset + i (same document, distance 0),
// no row is empty and the softmax never divides by zero. The fused (flash) kernels evaluate the same
// predicate per score and skip the key tiles (forward) and query tiles (backward) that the causal mask
// and the window leave wholly masked, so a window of w costs O(L w), not O(L S).
Tensor scaled_dot_product_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, bool is_causal,
                                    std::optional<double> scale_opt, const AttentionMask& mask) {
  BOOSTER_OP_CONTEXT("scaled_dot_product_attention");
  const char* name = "scaled_dot_product_attention";
  Tensor q = q_in, k = k_in, v = v_in;
  autocast::apply(autocast::Op::Attention, {&q, &k, &v});
  check_floating(q, name, "query");
  BOOSTER_CHECK(q.dtype() == k.dtype() && q.dtype() == v.dtype(), DTypeError, name,
                ": query, key and value must share a dtype, got ", q.dtype(), ", ", k.dtype(), " and ", v.dtype());
  BOOSTER_CHECK(q.device() == k.device() && q.device() == v.device(), DeviceError, name,
                ": query, key and value must be on one device, got ", q.device(), ", ", k.device(), " and ",
                v.device());
  BOOSTER_CHECK(q.dim() >= 2 && k.dim() == q.dim() && v.dim() == q.dim(), ShapeError, name,
                ": expected query, key and value of shape [..., L, E] with the same number of dims, got ", q.shape(),
                ", ", k.shape(), " and ", v.shape());
  const int64_t nd = q.dim();
  const Shape batch(q.shape().begin(), q.shape().end() - 2);
  BOOSTER_CHECK(Shape(k.shape().begin(), k.shape().end() - 2) == batch &&
                    Shape(v.shape().begin(), v.shape().end() - 2) == batch,
                ShapeError, name, ": batch dims of query ", q.shape(), ", key ", k.shape(), " and value ", v.shape(),
                " must be equal");
  const int64_t L = q.size(nd - 2), E = q.size(nd - 1), S = k.size(nd - 2), Ev = v.size(nd - 1);
  BOOSTER_CHECK(k.size(nd - 1) == E, ShapeError, name, ": key's last dim ", k.size(nd - 1),
                " must equal query's embedding size ", E, " (query ", q.shape(), ", key ", k.shape(), ")");
  BOOSTER_CHECK(v.size(nd - 2) == S, ShapeError, name, ": value's length ", v.size(nd - 2),
                " must equal key's length ", S, " (key ", k.shape(), ", value ", v.shape(), ")");
  const double scale = scale_opt ? *scale_opt : 1.0 / std::sqrt(double(E));
  kernels::AttentionMaskArgs margs{is_causal, mask.query_offset, mask.window, Tensor()};
  if (mask.any()) {
    BOOSTER_CHECK(mask.window >= 0 && mask.query_offset >= 0 && mask.query_offset + L <= S, ShapeError, name,
                  ": a mask needs window >= 0 and query_offset >= 0 with query_offset + L <= S (every query at a key ",
                  "position), got window ", mask.window, ", query_offset ", mask.query_offset, ", L ", L, " and S ", S);
    if (mask.segments.defined()) {
      const Tensor& sg = mask.segments;
      BOOSTER_CHECK(sg.dtype() == DType::Int64 || sg.dtype() == DType::Int32, DTypeError, name,
                    ": segments must be int32 or int64 document ids, got ", sg.dtype());
      BOOSTER_CHECK(nd >= 3 && sg.dim() == 2 && sg.size(0) == q.size(0) && sg.size(1) == S, ShapeError, name,
                    ": segments must be [B, S] = [", nd >= 3 ? q.size(0) : 0, ", ", S,
                    "] for query ", q.shape(), " (B its first dim), got ", sg.shape());
      margs.segments = sg.detach().to(q.device(), DType::Int64).contiguous();
    }
  }
  if (use_flash(q, k, v, L, S, E, Ev)) return flash_attention(q, k, v, margs, scale);
  const int64_t B = numel_of(batch);

  const Tensor qc = q.detach().contiguous().view({B, L, E});
  const Tensor kc = k.detach().contiguous().view({B, S, E});
  const Tensor vc = v.detach().contiguous().view({B, S, Ev});
  Tensor out = Tensor::empty({B, L, Ev}, q.dtype(), q.device());
  Tensor probs = Tensor::empty({B, L, S}, stats_dtype(q.dtype()), q.device());
  if (out.numel() > 0) kernels::attention_kernel(q.device())(qc, kc, vc, margs, scale, out, probs);
  Shape out_shape = batch;
  out_shape.push_back(L);
  out_shape.push_back(Ev);
  out = out.view(out_shape);

  if (autograd::needs_grad({&q, &k, &v})) {
    const bool gq = q.requires_grad(), gk = k.requires_grad(), gv = v.requires_grad();
    autograd::record(out, "ScaledDotProductAttentionBackward", {q, k, v},
                     [qc, kc, vc, probs, scale, gq, gk, gv, qs = q.shape(), ks = k.shape(), vs = v.shape()](
                         const Tensor& g) {
                       const Tensor gc = grad_as(g, qc.dtype()).view({qc.size(0), qc.size(1), vc.size(2)});
                       Tensor dq = gq ? Tensor::empty(qc.shape(), qc.dtype(), qc.device()) : Tensor();
                       Tensor dk = gk ? Tensor::empty(kc.shape(), kc.dtype(), kc.device()) : Tensor();
                       Tensor dv = gv ? Tensor::empty(vc.shape(), vc.dtype(), vc.device()) : Tensor();
                       if (gc.numel() > 0 && probs.numel() > 0) {
                         kernels::attention_backward_kernel(qc.device())(gc, qc, kc, vc, probs, scale, dq, dk, dv);
                       } else {  // an empty length: the gradients are zero (or empty)
                         NoGradGuard ng;
                         for (Tensor* t : {&dq, &dk, &dv})
                           if (t->defined()) t->zero_();
                       }
                       return grads{gq ? dq.view(qs) : Tensor(), gk ? dk.view(ks) : Tensor(),
                                    gv ? dv.view(vs) : Tensor()};
                     });
  }
  return out;
}

}  // namespace booster
