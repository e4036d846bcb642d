// Fused multi-tensor kernels of the mixed-precision step and the optimizers, registered per device
// (backends/cpu/grad_passes.cpp and optimizers.cpp, backends/cuda/fused.cu). Every kernel takes whole
// flat spans, one call each (apex's multi_tensor_apply idea: a flat buffer is the list of tensors
// already laid end to end); results the host needs accumulate in a scalar on the span's device.
#pragma once

#include <cstdint>
#include <vector>

#include "booster/kernels/dispatch.h"
#include "booster/tensor/tensor.h"

namespace booster::kernels {

// dst = src * inv_scale (dst float32, or src itself: in place; inv_scale 1 in place only checks), and
// ORs "some element of src was inf or NaN" into *found (a device int32 flag, 0 or 1). src/dst 1-D
// contiguous float32/float16/bfloat16 spans of one numel.
BOOSTER_DECLARE_KERNEL(unscale_check_kernel,
                       void(const Tensor& src, const Tensor& dst, float inv_scale, Tensor& found));
// Adds the sum of squares of `t` (1-D contiguous float32/float16/bfloat16) into acc (a device float64
// scalar).
BOOSTER_DECLARE_KERNEL(sum_squares_kernel, void(const Tensor& t, Tensor& acc));
// Adds the number of zero elements of `t` into acc (a device int64 scalar).
BOOSTER_DECLARE_KERNEL(count_zeros_kernel, void(const Tensor& t, Tensor& acc));

// One Adam/AdamW update over a run of a flat buffer: param, grad (param's dtype), exp_avg, exp_avg_sq
// and max_exp_avg_sq (undefined without amsgrad) in the compute type; all 1-D contiguous, same numel.
// Scalars as torch computes them, in double; each backend rounds them to the compute type.
struct AdamStep {
  double beta1, beta2, one_minus_beta1, one_minus_beta2;
  double weight_decay;   // L2 (Adam), applied when weight_decay != 0 and !decoupled
  double decay;          // 1 - lr * weight_decay (AdamW), applied when decoupled
  double neg_step_size;  // -lr / (1 - beta1^t)
  double bias_correction2_sqrt;
  double eps;
  bool decoupled = false;
  bool amsgrad = false;
};
BOOSTER_DECLARE_KERNEL(adam_kernel, void(const AdamStep& s, Tensor& param, const Tensor& grad, Tensor& exp_avg,
                                         Tensor& exp_avg_sq, Tensor& max_exp_avg_sq));

// One SGD update over a run of a flat buffer: param, grad (param's dtype) and momentum_buffer (the
// compute type; undefined without momentum), all 1-D contiguous, same numel. As torch:
// d = g + weight_decay p; with momentum, buf = d on the first step (`first`), else
// buf = momentum buf + (1 - dampening) d, and d = nesterov ? d + momentum buf : buf; p += neg_lr d.
struct SGDStep {
  double neg_lr, weight_decay, momentum, one_minus_dampening;
  bool nesterov = false;
  bool first = false;
};
BOOSTER_DECLARE_KERNEL(sgd_kernel, void(const SGDStep& s, Tensor& param, const Tensor& grad, Tensor& momentum_buffer));

}  // namespace booster::kernels
