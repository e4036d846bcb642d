// Bounds for comparing two float32 runs whose sums are ordered differently (tensor, pipeline or data
// parallel layouts, ZeRO partitions, world sizes, ISA levels, BLAS thread counts), derived from the
// unit roundoff and the reduction lengths instead of tuned on one CPU. Note [Roundoff bounds] below
// gives the derivation; each test states the reduction lengths it passes in.
//
// Note [Roundoff bounds]
// 1. One sum. A float32 sum of n terms of independent signs, in any order, has error
//    e = sum_k delta_k s_k (|delta_k| <= u = 2^-24, s_k the partial sums, each about sqrt(k) |x|). With
//    independent roundings its spread is u |x| sqrt(sum k) = u |x| n / sqrt(2), and |sum x| is about
//    |x| sqrt(n); two orders differ by sqrt(2) times one order's error, so relative to the sum the
//    difference has spread u sqrt(n). (Higham and Mary's probabilistic analysis: the deterministic
//    bound n u is reached only with correlated roundings.)
// 2. A chain. A forward and backward pass is a chain of such reductions (GEMMs of the width, norms,
//    softmax over the context, the batch sums of the weight gradients); to first order their relative
//    errors add, as independent variables: spread u sqrt(sum_d n_d). Within kLambda spreads (6: a
//    Gaussian tail of 2e-9) this holds for every quantity the tests compare. reduction_bound() is it.
// 3. SGD. w_k = w_0 - sum_t lr_t g_t, so two runs differ by sum_t lr_t dg_t, plus the gradient's change
//    through the weights' difference (H dw, growing by at most (1 + lr |H|) a step: a factor kDrift = 2
//    over the short runs compared, lr |H| < 0.1). Momentum mu keeps 1 / (1 - mu) of each gradient. So
//    |dw| <= kDrift / (1 - mu) * reduction_bound * sum_t lr_t |g_t|: sgd_bound() of the path length
//    sum_t lr_t |g_t|, which a test measures from the reference's own steps.
// 4. Adam. An update is lr m_hat / (sqrt(v_hat) + eps): a gradient that is rounding noise (its exact
//    value near zero) may change sign between the runs and move its weight by up to 2 lr |m_hat/sqrt(v_hat)|
//    a step instead of by roundoff. By Cauchy-Schwarz over the moment sums,
//      |m_hat / sqrt(v_hat)| <= (1 - b1) / (1 - b1^t) * sqrt((1 - b2^t) / (1 - b2)) * sqrt(sum_{j<t} (b1^2 / b2)^j),
//    whatever the gradients (1 at t = 1). Decoupled weight decay multiplies both runs by 1 - lr wd and
//    only shrinks the difference. adam_drift_bound() is the sum over the steps: a bound on each
//    element's difference that holds with no assumption. It is loose by design: where Adam runs are
//    compared, the tight check is on the loss curve (which near-zero gradients barely move) or on a
//    second run under SGD.
// 5. Other dtypes, worst case. The GPU tests compare float16, bfloat16 and float64 results, and
//    float32 ones against float64, where nothing was measured per case: a chain of k roundings of
//    unit u (each op's result rounded once to its dtype, each float32 evaluation within its ulps) is
//    within gamma_k = k u / (1 - k u) relative (Higham, Lemma 3.1), whatever the signs and the order:
//    gamma(). Units: float16 2^-11, bfloat16 2^-8, float32 2^-24, float64 2^-53. Sums accumulate in
//    float32 for the 16-bit dtypes (float64 for float64), so reduction_bound(lengths, unit) adds their
//    order term in the accumulator's unit. float32 GEMMs run in full float32 on CUDA unless a program
//    calls cuda::set_allow_tf32 (only bench_gpt2_cuda does); TF32 would make u 2^-11 for them, so
//    the CUDA tests that compare float32 GEMMs check that it is off.
// 6. Adam's loss curve. To first order two Adam(W) runs' losses at step t differ by g_t . dw_t. A
//    weight whose gradient may flip sign (|g_i| within its error delta_i) moves by at most D_t
//    (adam_drift_bound over the t steps) and so changes the loss by at most delta_i D_t; one whose
//    gradient keeps its sign has its update m_hat / sqrt(v_hat), of degree 0 in the gradients, moved
//    by at most 2 delta_i / |g_i| a step (gradients that vary slowly over the few steps compared), so
//    |g_i dw_i| <= delta_i D_t too. Each parameter's elements err by eps of its rms gradient, so
//    sum_i delta_i = eps sum_p sqrt(n_p) |g_p|_2 (the gradient's spread, >= |g|_1, measured from the
//    reference), and with kDrift for the growth through the Hessian:
//      |dL_t| <= kDrift eps spread_t D_t   (adam_loss_bound), plus the forward's own roundoff.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <vector>

namespace testing::roundoff {

constexpr double kUnit = 0x1p-24;  // float32 unit roundoff
constexpr double kLambda = 6.0;    // spreads allowed (step 2 of the Note)
constexpr double kDrift = 2.0;     // growth of a weight difference through the Hessian (step 3)
// The other dtypes' unit roundoffs (step 5).
constexpr double kUnitFloat16 = 0x1p-11;
constexpr double kUnitBFloat16 = 0x1p-8;
constexpr double kUnitFloat64 = 0x1p-53;

// Higham's gamma_k: the worst-case relative error of a chain of k roundings of unit u (step 5).
inline double gamma(double k, double u) { return k * u / (1.0 - k * u); }

// The relative difference of a quantity computed through reductions of these lengths, between two
// summation orders (steps 1 and 2 of Note [Roundoff bounds]).
inline double reduction_bound(std::initializer_list<double> lengths) {
  double total = 0.0;
  for (double n : lengths) total += n;
  return kLambda * kUnit * std::sqrt(total);
}

// reduction_bound for sums accumulated in another type, of unit roundoff `unit` (step 5).
inline double reduction_bound(std::initializer_list<double> lengths, double unit) {
  return reduction_bound(lengths) / kUnit * unit;
}

// The difference of the weights of two SGD runs (step 3): path = sum_t lr_t |g_t| (the reference's
// own steps), eps = reduction_bound of one gradient, mu the momentum.
inline double sgd_bound(double path, double eps, double momentum = 0.0) {
  return kDrift / (1.0 - momentum) * eps * path;
}

// The most an Adam update may move one weight at step t, over lr (step 4).
inline double adam_step_ratio(double beta1, double beta2, int t) {
  double s = 0.0;
  for (int j = 0; j < t; ++j) s += std::pow(beta1 * beta1 / beta2, j);
  return (1.0 - beta1) / (1.0 - std::pow(beta1, t)) * std::sqrt((1.0 - std::pow(beta2, t)) / (1.0 - beta2)) *
         std::sqrt(s);
}

// The most one weight of two Adam(W) runs may differ after the steps with these learning rates (step 4).
inline double adam_drift_bound(const std::vector<double>& lrs, double beta1, double beta2) {
  double bound = 0.0;
  for (size_t t = 0; t < lrs.size(); ++t) bound += 2.0 * lrs[t] * adam_step_ratio(beta1, beta2, int(t) + 1);
  return bound;
}

inline double adam_drift_bound(double lr, int steps, double beta1, double beta2) {
  return adam_drift_bound(std::vector<double>(size_t(steps), lr), beta1, beta2);
}

// sum_p sqrt(n_p) |g_p|_2 over a model's parameter gradients, each a flat list (step 6): the sum of
// the elements' errors when each parameter's err by one relative unit of its rms.
inline double gradient_spread(const std::vector<std::vector<double>>& grads) {
  double spread = 0.0;
  for (const std::vector<double>& g : grads) {
    double s = 0.0;
    for (double v : g) s += v * v;
    spread += std::sqrt(double(g.size()) * s);
  }
  return spread;
}

// The loss difference of two Adam(W) runs after the steps with these learning rates, their gradients
// within eps (relative to each parameter's rms) of each other, spread = gradient_spread of the
// reference's gradient at the step compared (step 6); the forward's own roundoff comes on top.
inline double adam_loss_bound(double eps, double spread, const std::vector<double>& lrs, double beta1, double beta2) {
  return kDrift * eps * spread * adam_drift_bound(lrs, beta1, beta2);
}

// The forward reductions of nn::GPT along the path to one logit and the mean loss (step 2), on
// `batch` sequences: per block layer norm (2C), c_attn (C), scores (C / heads), softmax and att . v
// (2T), c_proj (C), layer norm (2C), c_fc (C), the MLP's c_proj (4C); then ln_f (2C), lm_head (C),
// log-sum-exp (V) and the mean over the batch's B T positions.
inline double gpt_forward_length(double width, double layers, double heads, double context, double vocab,
                                 double batch) {
  const double block = 2 * width + width + width / heads + 2 * context + width + 2 * width + width + 4 * width;
  return layers * block + 2 * width + width + vocab + batch * context;
}

// nn::Llama's (step 2): per layer RMSNorm (C), q, k and v (C), scores (C / heads), softmax and att . v
// (2T), o_proj (C), RMSNorm (C), gate and up (C), down (the intermediate width I); then the final norm
// (C), lm_head (C), log-sum-exp (V) and the mean over the batch's B T positions.
inline double llama_forward_length(double hidden, double layers, double heads, double intermediate, double context,
                                   double vocab, double batch) {
  const double layer = hidden + hidden + hidden / heads + 2 * context + hidden + hidden + hidden + intermediate;
  return layers * layer + hidden + hidden + vocab + batch * context;
}

// An MLP classifier's: each Linear's input width, the classes (log-sum-exp) and the batch (the mean).
inline double mlp_forward_length(std::initializer_list<double> inputs, double classes, double batch) {
  double total = classes + batch;
  for (double n : inputs) total += n;
  return total;
}

}  // namespace testing::roundoff
