// Gradients against central finite differences in float64 (the reference is arithmetic, not our code).
//
//   REQUIRE(gradcheck([](const std::vector<Tensor>& x) { return sum(mul(x[0], x[1])); }, {a, b}));
//
// f maps float64 inputs to any output; a random projection w makes it scalar: L = sum(w * f(x)).
// For each input element, (L(x + h) - L(x - h)) / 2h is compared with the analytic gradient.
#pragma once

#include <functional>
#include <iostream>
#include <vector>

#include "booster/autograd/autograd.h"
#include "booster/ops/ops.h"

namespace booster::testing {

struct GradcheckOptions {
  double eps = 1e-6;
  double atol = 1e-5;
  double rtol = 1e-4;
  uint64_t seed = 1234;
};

inline bool gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f, std::vector<Tensor> inputs,
                      GradcheckOptions opt = {}) {
  for (auto& x : inputs)
    if (x.defined() && is_floating(x.dtype())) x = x.detach().to(DType::Float64).contiguous().clone().requires_grad_();

  Tensor out = f(inputs);
  Generator gen(opt.seed);
  const Tensor w = randn(out.shape(), &gen, DType::Float64);
  auto loss_of = [&](const std::vector<Tensor>& xs) {
    NoGradGuard ng;
    return sum(mul(f(xs), w)).item();
  };
  sum(mul(out, w)).backward();

  bool ok = true;
  for (size_t k = 0; k < inputs.size(); ++k) {
    Tensor& x = inputs[k];
    if (!x.defined() || !x.requires_grad()) continue;
    const Tensor analytic = x.grad().defined() ? x.grad() : zeros_like(x);
    const auto an = analytic.tolist();
    double* p = x.data<double>();
    for (int64_t i = 0; i < x.numel(); ++i) {
      const double orig = p[i];
      p[i] = orig + opt.eps;
      const double lp = loss_of(inputs);
      p[i] = orig - opt.eps;
      const double lm = loss_of(inputs);
      p[i] = orig;
      const double numeric = (lp - lm) / (2 * opt.eps);
      if (std::abs(numeric - an[size_t(i)]) > opt.atol + opt.rtol * std::abs(numeric)) {
        std::cerr << "gradcheck: input " << k << " element " << i << ": analytic " << an[size_t(i)]
                  << " vs numeric " << numeric << "\n";
        ok = false;
      }
    }
  }
  return ok;
}

}  // namespace booster::testing
