// Fused neural-network kernel families: softmax, normalisation, dropout, attention and losses.
//
// Contract shared by every kernel here (see also kernels/elementwise.h): the op allocates every
// output with its final shape and dtype, makes the inputs contiguous, and passes the geometry the
// kernel needs ([outer, dim, inner] for softmax, [rows, cols] for layer_norm, [N, C, L] for
// batch_norm, [batch, L, E] for attention, [N, C, D] for the losses). Kernels compute in float32 for
// float16/bfloat16 (float64 for float64) and round once to the output dtype. Saved statistics
// (mean, rstd, attention probabilities, log-sum-exp) are stored in that compute type, never in 16
// bits. Kernels know nothing of autograd or autocast; a CUDA backend registers the same families.
#pragma once

#include <cstdint>

#include "booster/kernels/dispatch.h"
#include "booster/tensor/tensor.h"

namespace booster::kernels {

// ----------------------------------------------------------------------------------------- softmax
// x, out: contiguous, viewed as [outer, dim_size, inner]; softmax (or log-softmax) over dim_size.
BOOSTER_DECLARE_KERNEL(softmax_kernel, void(const Tensor& x, int64_t outer, int64_t dim_size, int64_t inner,
                                            bool log, Tensor& out));
// From the forward output y and the incoming gradient g (same geometry):
//   softmax:     dx = y * (g - sum(g * y))
//   log_softmax: dx = g - exp(y) * sum(g)
BOOSTER_DECLARE_KERNEL(softmax_backward_kernel, void(const Tensor& grad, const Tensor& y, int64_t outer,
                                                     int64_t dim_size, int64_t inner, bool log, Tensor& dx));

// -------------------------------------------------------------------------------------- layer norm
// x, out: contiguous [rows, cols]; weight/bias: [cols] or undefined. mean, rstd: [rows] in the
// compute type (float32, or float64 for float64 x).
BOOSTER_DECLARE_KERNEL(layer_norm_kernel, void(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                               int64_t rows, int64_t cols, double eps, Tensor& out,
                                               Tensor& mean, Tensor& rstd));
// dx: [rows, cols] like x; dweight/dbias: [cols] in x's dtype, or undefined when not wanted.
BOOSTER_DECLARE_KERNEL(layer_norm_backward_kernel,
                       void(const Tensor& grad, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                            const Tensor& weight, int64_t rows, int64_t cols, Tensor& dx, Tensor& dweight,
                            Tensor& dbias));

// -------------------------------------------------------------------------------------- batch norm
// x, out: contiguous [N, C, L] (L = 1 for 2-D input); weight/bias: [C] or undefined.
// training: statistics of the batch; save_mean/save_rstd get the batch mean and 1/sqrt(biased var +
//   eps), and batch_var_unbiased (undefined when not wanted) the unbiased variance for running stats.
// eval: running_mean/running_var [C] are used; save_mean/save_rstd get them as mean and rstd.
// save_*, batch_var_unbiased: [C] in the compute type.
BOOSTER_DECLARE_KERNEL(batch_norm_kernel,
                       void(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                            const Tensor& running_var, bool training, double eps, Tensor& out, Tensor& save_mean,
                            Tensor& save_rstd, Tensor& batch_var_unbiased));
// training: the statistics depend on x, so dx has the two extra terms of the batch-statistics
// gradient; eval: dx = g * weight * rstd. dweight/dbias may be undefined.
BOOSTER_DECLARE_KERNEL(batch_norm_backward_kernel,
                       void(const Tensor& grad, const Tensor& x, const Tensor& weight, const Tensor& save_mean,
                            const Tensor& save_rstd, bool training, Tensor& dx, Tensor& dweight, Tensor& dbias));

// ----------------------------------------------------------------------------------------- dropout
// out = keep ? x * scale : 0, with keep a bool tensor of x's shape (all contiguous). Also the backward.
BOOSTER_DECLARE_KERNEL(masked_scale_kernel, void(const Tensor& x, const Tensor& keep, double scale, Tensor& out));

// --------------------------------------------------------------------------------------- attention
// Which keys query i of batch b attends (booster::AttentionMask, checked by the op):
//   (!causal || j <= offset + i) && (window == 0 || offset + i - j < window)
//   && (!segments || segments[b / (B / G), j] == segments[b / (B / G), offset + i])
// segments: int64 contiguous [G, S] on the kernel's device, or undefined; B a multiple of G.
struct AttentionMaskArgs {
  bool causal = false;
  int64_t offset = 0;
  int64_t window = 0;
  Tensor segments;
  // Only the top-left causal triangle (or nothing): the kernels' fast row bound suffices.
  bool simple() const { return offset == 0 && window == 0 && !segments.defined(); }
};
// q [B, L, E], k [B, S, E], v [B, S, Ev], out [B, L, Ev], all contiguous, one dtype.
// probs [B, L, S] in the compute type receives softmax(q k^T * scale + mask), kept for backward;
// masked entries are 0 in it, so the backward needs no mask. Every query sees at least one key.
BOOSTER_DECLARE_KERNEL(attention_kernel, void(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const AttentionMaskArgs& mask, double scale, Tensor& out,
                                              Tensor& probs));
// dq/dk/dv like q/k/v (any of them undefined when not wanted).
BOOSTER_DECLARE_KERNEL(attention_backward_kernel,
                       void(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& probs, double scale, Tensor& dq, Tensor& dk, Tensor& dv));

// Fused (flash) attention, for the backends that have it (the op asks `has` and checks the rest):
// float16/bfloat16, head size E of 16, 32 or 64 for q, k and v alike. q/out [B, H, L, E] (or [B, L, E])
// and k/v [B, H, S, E], each with its own strides, the last 1 and the others multiples of 8 elements
// (16-byte aligned rows). lse [B, H, L] float32 contiguous receives log(sum_j exp(scale q_i . k_j))
// over the keys row i sees; the probabilities are never stored. mask as attention_kernel's, its segments
// [B, S] (one row per batch index of q, shared by the heads).
BOOSTER_DECLARE_KERNEL(flash_attention_kernel, void(const Tensor& q, const Tensor& k, const Tensor& v,
                                                    const AttentionMaskArgs& mask, double scale, Tensor& out,
                                                    Tensor& lse));
// grad_out and out like q; dq, dk, dv like q, k, v (all three written, with their own strides).
BOOSTER_DECLARE_KERNEL(flash_attention_backward_kernel,
                       void(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& out, const Tensor& lse, const AttentionMaskArgs& mask, double scale,
                            Tensor& dq, Tensor& dk, Tensor& dv));

// ------------------------------------------------------------------------------------------ losses
// How per-element losses are combined; mirrors booster::Reduction (ops.h) without depending on it.
enum class LossReduction : uint8_t { None, Mean, Sum };

// logits [N, C, D] contiguous (D = product of the extra dims, 1 for [N, C]); target int64 [N, D].
// Per element: (1 - s) * (-log p[target]) + s / C * (-sum_c log p[c]), 0 where target ==
// ignore_index. out: [N, D] for None, else a scalar (Mean divides by the number of non-ignored
// targets). lse [N, D] (compute type) receives log-sum-exp per row; count (scalar, compute type)
// the number of non-ignored targets. Throws IndexError for a target outside [0, C).
BOOSTER_DECLARE_KERNEL(cross_entropy_kernel,
                       void(const Tensor& logits, const Tensor& target, int64_t ignore_index, double label_smoothing,
                            LossReduction reduction, Tensor& out, Tensor& lse, Tensor& count));
// dlogits = (softmax - (1 - s) onehot - s / C) * g (g / count for Mean; g[n, d] for None); 0 on
// ignored rows. grad: out's shape.
BOOSTER_DECLARE_KERNEL(cross_entropy_backward_kernel,
                       void(const Tensor& grad, const Tensor& logits, const Tensor& target, const Tensor& lse,
                            const Tensor& count, int64_t ignore_index, double label_smoothing,
                            LossReduction reduction, Tensor& dlogits));
// The fused classifier (backends that have it; the op asks `has`): logits [N, C] with unit column
// stride and any row stride (padded rows), float32/float16/bfloat16, read as they are and computed in
// float32; target int64 [N]. out (float32, [N] for None, else a scalar), lse [N] and count as
// cross_entropy_kernel, in float32. Label smoothing and ignore_index as there.
BOOSTER_DECLARE_KERNEL(classifier_loss_kernel,
                       void(const Tensor& logits, const Tensor& target, int64_t ignore_index, double label_smoothing,
                            LossReduction reduction, Tensor& out, Tensor& lse, Tensor& count));
// grad: float32, out's shape. dlogits: [N, C] in the logits' dtype, unit column stride, its own row stride.
BOOSTER_DECLARE_KERNEL(classifier_loss_backward_kernel,
                       void(const Tensor& grad, const Tensor& logits, const Tensor& target, const Tensor& lse,
                            const Tensor& count, int64_t ignore_index, double label_smoothing,
                            LossReduction reduction, Tensor& dlogits));
// log_probs [N, C, D]; per element -log_probs[target], 0 where ignored. out/count as cross_entropy.
BOOSTER_DECLARE_KERNEL(nll_loss_kernel, void(const Tensor& log_probs, const Tensor& target, int64_t ignore_index,
                                             LossReduction reduction, Tensor& out, Tensor& count));
BOOSTER_DECLARE_KERNEL(nll_loss_backward_kernel,
                       void(const Tensor& grad, const Tensor& target, const Tensor& count, int64_t ignore_index,
                            LossReduction reduction, Tensor& dlog_probs));
// input, target: contiguous, same shape and dtype. out: input's shape for None, else a scalar.
BOOSTER_DECLARE_KERNEL(mse_loss_kernel,
                       void(const Tensor& input, const Tensor& target, LossReduction reduction, Tensor& out));
// dinput = 2 (input - target) * g (g / numel for Mean); dtarget = -dinput (undefined when not wanted).
BOOSTER_DECLARE_KERNEL(mse_loss_backward_kernel,
                       void(const Tensor& grad, const Tensor& input, const Tensor& target, LossReduction reduction,
                            Tensor& dinput, Tensor& dtarget));

}  // namespace booster::kernels
