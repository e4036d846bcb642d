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

// The relative difference of a quantity computed through reductions of these lengths, between two
// summation orders (steps 1 and 2 of Note [Roundoff bounds]).
inline double reduction_bound(std::initializer_list<double> lengths) {
  double total = 0.0;
  for (double n : lengths) total += n;
  return kLambda * kUnit * std::sqrt(total);
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
