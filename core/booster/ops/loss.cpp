// Losses: cross_entropy (one fused log-softmax + nll + label-smoothing kernel), nll_loss, mse_loss.
// Each reduces inside its kernel, so none depends on the generic reductions.
#include "booster/autocast/autocast.h"
#include "booster/autograd/autograd.h"
#include "booster/kernels/nn.h"
#include "booster/common/error_context.h"
#include "booster/ops/ops.h"
#include "booster/ops/ops_impl.h"

namespace booster {

using autograd::grads;
using kernels::LossReduction;

Reduction reduction_from_string(const std::string& s) {
  if (s == "none") return Reduction::None;
  if (s == "mean") return Reduction::Mean;
  if (s == "sum") return Reduction::Sum;
  BOOSTER_FAIL(ValueError, "reduction: unknown reduction '", s, "'; expected one of 'none', 'mean', 'sum'");
}

namespace {

LossReduction to_kernel(Reduction r) {
  switch (r) {
    case Reduction::None: return LossReduction::None;
    case Reduction::Mean: return LossReduction::Mean;
    case Reduction::Sum: return LossReduction::Sum;
  }
  return LossReduction::Mean;
}

DType stats_dtype(DType t) { return t == DType::Float64 ? DType::Float64 : DType::Float32; }

// Classification input [N, C, d...] (or [C]) and int64 target [N, d...] (or []), checked; the
// geometry [N, C, D] the kernels use.
struct ClassGeometry {
  int64_t N, C, D;
};

ClassGeometry check_classification(const char* op, const Tensor& input, const Tensor& target) {
  BOOSTER_CHECK(is_floating(input.dtype()), DTypeError, op, ": expected floating input, got ", input.dtype());
  BOOSTER_CHECK(target.dtype() == DType::Int64, DTypeError, op, ": expected an int64 target of class indices, got ",
                target.dtype());
  BOOSTER_CHECK(input.dim() >= 1, ShapeError, op, ": expected input of shape [N, C] or [N, C, d...], got a 0-d tensor");
  check_same_device(input, target, op);
  Shape expected;
  if (input.dim() >= 2) {
    expected.push_back(input.size(0));
    for (int64_t i = 2; i < input.dim(); ++i) expected.push_back(input.size(i));
  }
  BOOSTER_CHECK(target.shape() == expected, ShapeError, op, ": target of shape ", target.shape(),
                " does not match input of shape ", input.shape(), "; expected target shape ", expected);
  if (input.dim() == 1) return {1, input.size(0), 1};
  int64_t D = 1;
  for (int64_t i = 2; i < input.dim(); ++i) D *= input.size(i);
  return {input.size(0), input.size(1), D};
}

Shape loss_shape(Reduction r, const Tensor& target) { return r == Reduction::None ? target.shape() : Shape{}; }

// Note [Fused classifier] (backends/cuda/nn.cu): [N, C] logits with unit column stride on a backend
// that has the fused kernel, float32 or 16-bit where autocast would widen them to float32 anyway.
bool use_fused_classifier(const Tensor& logits, const Tensor& target) {
  if (!logits.device().is_cuda() || !kernels::classifier_loss_kernel.has(DeviceType::CUDA)) return false;
  if (logits.dim() != 2 || target.dim() != 1 || target.dtype() != DType::Int64 || logits.stride(1) != 1 ||
      logits.stride(0) < logits.size(1) || target.size(0) != logits.size(0) || target.device() != logits.device())
    return false;
  if (logits.dtype() == DType::Float32) return true;
  return is_low_precision(logits.dtype()) &&
         autocast::current_policy(autocast::Op::CrossEntropy) == autocast::CastPolicy::Float32;
}

Tensor fused_classifier_loss(const Tensor& logits, const Tensor& target, Reduction reduction, int64_t ignore_index,
                             double label_smoothing) {
  const Tensor x = logits.detach(), t = target.detach().contiguous();
  const int64_t N = x.size(0), C = x.size(1);
  Tensor out = Tensor::empty(loss_shape(reduction, target), DType::Float32, x.device());
  Tensor lse = Tensor::empty({N}, DType::Float32, x.device());
  Tensor count = Tensor::empty({}, DType::Float32, x.device());
  const LossReduction kr = to_kernel(reduction);
  kernels::classifier_loss_kernel(x.device())(x, t, ignore_index, label_smoothing, kr, out, lse, count);
  autograd::record(out, "CrossEntropyBackward", {logits},
                   [x, t, lse, count, ignore_index, label_smoothing, kr, N, C](const Tensor& grad) {
                     const Tensor gc = (grad.dtype() == DType::Float32 ? grad : grad.to(DType::Float32)).contiguous();
                     // dlogits rows as far apart as the logits' (the padded rows a GEMM reads fast).
                     const int64_t ld = x.stride(0);
                     Tensor dx = Tensor::empty({N, ld}, x.dtype(), x.device());
                     if (ld != C) dx = make_view(dx, {N, C}, {ld, 1}, 0);
                     kernels::classifier_loss_backward_kernel(x.device())(gc, x, t, lse, count, ignore_index,
                                                                          label_smoothing, kr, dx);
                     return grads{dx};
                   });
  return out;
}

}  // namespace

Tensor cross_entropy(const Tensor& logits_in, const Tensor& target, Reduction reduction, int64_t ignore_index,
                     double label_smoothing) {
  BOOSTER_OP_CONTEXT("cross_entropy");  // Note [Error context]
  Tensor logits = logits_in;
  BOOSTER_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, ValueError,
                "cross_entropy: label_smoothing must be in [0, 1], got ", label_smoothing);
  if (use_fused_classifier(logits, target))
    return fused_classifier_loss(logits, target, reduction, ignore_index, label_smoothing);
  autocast::apply(autocast::Op::CrossEntropy, {&logits});
  const ClassGeometry g = check_classification("cross_entropy", logits, target);
  const Tensor x = logits.detach().contiguous().view({g.N, g.C, g.D});
  const Tensor t = target.detach().contiguous();
  Tensor out = Tensor::empty(loss_shape(reduction, target), logits.dtype(), logits.device());
  Tensor lse = Tensor::empty({g.N * g.D}, stats_dtype(logits.dtype()), logits.device());
  Tensor count = Tensor::empty({}, stats_dtype(logits.dtype()), logits.device());
  const LossReduction kr = to_kernel(reduction);
  kernels::cross_entropy_kernel(logits.device())(x, t, ignore_index, label_smoothing, kr, out, lse, count);
  autograd::record(out, "CrossEntropyBackward", {logits},
                   [x, t, lse, count, ignore_index, label_smoothing, kr, shape = logits.shape()](const Tensor& grad) {
                     const Tensor gc = (grad.dtype() == x.dtype() ? grad : grad.to(x.dtype())).contiguous();
                     Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
                     kernels::cross_entropy_backward_kernel(x.device())(gc, x, t, lse, count, ignore_index,
                                                                        label_smoothing, kr, dx);
                     return grads{dx.view(shape)};
                   });
  return out;
}

Tensor nll_loss(const Tensor& log_probs_in, const Tensor& target, Reduction reduction, int64_t ignore_index) {
  BOOSTER_OP_CONTEXT("nll_loss");
  Tensor log_probs = log_probs_in;
  autocast::apply(autocast::Op::NllLoss, {&log_probs});
  const ClassGeometry g = check_classification("nll_loss", log_probs, target);
  const Tensor x = log_probs.detach().contiguous().view({g.N, g.C, g.D});
  const Tensor t = target.detach().contiguous();
  Tensor out = Tensor::empty(loss_shape(reduction, target), log_probs.dtype(), log_probs.device());
  Tensor count = Tensor::empty({}, stats_dtype(log_probs.dtype()), log_probs.device());
  const LossReduction kr = to_kernel(reduction);
  kernels::nll_loss_kernel(log_probs.device())(x, t, ignore_index, kr, out, count);
  autograd::record(out, "NllLossBackward",
                   {log_probs}, [t, count, ignore_index, kr, geo = x.shape(), dtype = x.dtype(), device = x.device(),
                                 shape = log_probs.shape()](const Tensor& grad) {
                     const Tensor gc = (grad.dtype() == dtype ? grad : grad.to(dtype)).contiguous();
                     Tensor dx = Tensor::empty(geo, dtype, device);
                     kernels::nll_loss_backward_kernel(device)(gc, t, count, ignore_index, kr, dx);
                     return grads{dx.view(shape)};
                   });
  return out;
}

Tensor mse_loss(const Tensor& input_in, const Tensor& target_in, Reduction reduction) {
  BOOSTER_OP_CONTEXT("mse_loss");
  Tensor input = input_in, target = target_in;
  autocast::apply(autocast::Op::MseLoss, {&input, &target});
  BOOSTER_CHECK(is_floating(input.dtype()) && is_floating(target.dtype()), DTypeError,
                "mse_loss: expected floating input and target, got ", input.dtype(), " and ", target.dtype());
  check_same_device(input, target, "mse_loss");
  // Broadcasting as torch.nn.functional.mse_loss (which warns); the dtype is the promoted one.
  const Shape s = broadcast_shapes(input.shape(), target.shape(), "mse_loss");
  const DType dt = promote_types(input.dtype(), target.dtype());
  if (input.dtype() != dt) input = input.to(dt);
  if (target.dtype() != dt) target = target.to(dt);
  const Tensor xi = input.detach().expand(s).contiguous();
  const Tensor xt = target.detach().expand(s).contiguous();
  Tensor out = Tensor::empty(reduction == Reduction::None ? s : Shape{}, dt, input.device());
  const LossReduction kr = to_kernel(reduction);
  kernels::mse_loss_kernel(input.device())(xi, xt, kr, out);
  if (autograd::needs_grad({&input, &target})) {
    const bool gi = input.requires_grad(), gt = target.requires_grad();
    autograd::record(out, "MseLossBackward", {input, target},
                     [xi, xt, kr, gi, gt, si = input.shape(), st = target.shape()](const Tensor& grad) {
                       const Tensor gc = (grad.dtype() == xi.dtype() ? grad : grad.to(xi.dtype())).contiguous();
                       Tensor di = gi ? Tensor::empty(xi.shape(), xi.dtype(), xi.device()) : Tensor();
                       Tensor dt = gt ? Tensor::empty(xi.shape(), xi.dtype(), xi.device()) : Tensor();
                       kernels::mse_loss_backward_kernel(xi.device())(gc, xi, xt, kr, di, dt);
                       return grads{gi ? autograd::sum_to(di, si) : Tensor(), gt ? autograd::sum_to(dt, st) : Tensor()};
                     });
  }
  return out;
}

}  // namespace booster
