// Normalizations under 16-bit autocast compute in float32, as PyTorch's do: layer_norm is on autocast's
// float32 list (its 16-bit inputs are upcast, its output is float32), and Hugging Face's LlamaRMSNorm
// upcasts its input to float32, normalizes, rounds back to the input's dtype and multiplies by the
// float32 weight (a float32 product). Each is compared with a reference computed here in float64 from
// the exact stored inputs and then rounded as the definition rounds (the 16-bit rounding written out,
// not the library's converter), with a float32 bound: a normalization computed in 16 bits anywhere
// (its squares, its statistics or its output) misses it by whole 16-bit ulps.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "roundoff.h"

#include "booster/autocast/autocast.h"
#include "booster/nn/llama.h"
#include "booster/nn/normalization.h"
#include "booster/ops/ops.h"
#include "booster/tensor/grad_mode.h"

using namespace booster;
namespace ro = ::testing::roundoff;

namespace {

constexpr int64_t kRows = 6, kWidth = 384;

// Round v to a binary significand of p bits (float16: 11, bfloat16: 8), ties to even; the values here
// are normal in both formats.
double round_significand(double v, int p) {
  if (v == 0.0) return 0.0;
  const double scale = std::ldexp(1.0, p - 1 - std::ilogb(v));
  return std::nearbyint(v * scale) / scale;
}
int significand_bits(DType d) { return d == DType::BFloat16 ? 8 : 11; }

// Rows of mean 2.5 and spread about 1 (the statistics matter: a 16-bit mean loses the spread's digits),
// a different pattern per row.
std::vector<double> input_values() {
  std::vector<double> v(static_cast<size_t>(kRows * kWidth));
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t i = 0; i < kWidth; ++i)
      v[size_t(r * kWidth + i)] = 2.5 + std::sin(0.37 * double(i) + double(r)) + 0.25 * std::cos(1.3 * double(i * (r + 1)));
  return v;
}
std::vector<double> weight_values() {
  std::vector<double> w(static_cast<size_t>(kWidth));
  for (int64_t i = 0; i < kWidth; ++i) w[size_t(i)] = 0.75 + 0.5 * std::sin(0.11 * double(i));
  return w;
}

// x as the test feeds it (the 16-bit dtype, or float32) and the exact values it holds.
std::pair<Tensor, std::vector<double>> stored(DType dtype) {
  const Tensor x = from_vector(input_values(), {kRows, kWidth}, DType::Float64).to(dtype);
  return {x, x.to(DType::Float64).tolist()};
}

const char* name_of(DType d) { return d == DType::Float16 ? "float16" : d == DType::BFloat16 ? "bfloat16" : "float32"; }

}  // namespace

TEST_CASE("autocast: layer_norm computes in float32 from 16-bit and float32 inputs", "[amp][autocast][norm]") {
  for (DType autocast_dtype : {DType::Float16, DType::BFloat16}) {
    for (DType input_dtype : {autocast_dtype, DType::Float32}) {
      INFO("autocast " << name_of(autocast_dtype) << ", input " << name_of(input_dtype));
      nn::LayerNorm norm(kWidth, 1e-5);
      const std::vector<double> w = weight_values();
      std::vector<double> b(static_cast<size_t>(kWidth));
      for (int64_t i = 0; i < kWidth; ++i) b[size_t(i)] = 0.1 * std::cos(0.23 * double(i));
      {
        NoGradGuard no_grad;
        norm.weight.copy_(from_vector(w, {kWidth}, DType::Float64).to(DType::Float32));
        norm.bias.copy_(from_vector(b, {kWidth}, DType::Float64).to(DType::Float32));
      }
      const std::vector<double> wf = norm.weight.to(DType::Float64).tolist(), bf = norm.bias.to(DType::Float64).tolist();
      const auto [x, xs] = stored(input_dtype);
      Tensor y;
      {
        autocast::AutocastGuard guard(true, autocast_dtype);
        y = norm(x);
      }
      CHECK(y.dtype() == DType::Float32);  // torch: layer_norm's output under autocast is float32
      const std::vector<double> got = y.to(DType::Float64).tolist();
      // A float32 evaluation: the mean and the variance are sums of kWidth terms, then a few roundings.
      const double rel = ro::reduction_bound({double(kWidth), double(kWidth)}) + ro::gamma(8, ro::kUnit);
      double worst = 0;
      for (int64_t r = 0; r < kRows; ++r) {
        double mean = 0, var = 0;
        for (int64_t i = 0; i < kWidth; ++i) mean += xs[size_t(r * kWidth + i)];
        mean /= double(kWidth);
        for (int64_t i = 0; i < kWidth; ++i) var += std::pow(xs[size_t(r * kWidth + i)] - mean, 2);
        var /= double(kWidth);  // biased, as torch
        for (int64_t i = 0; i < kWidth; ++i) {
          const size_t k = size_t(r * kWidth + i);
          const double xhat = (xs[k] - mean) / std::sqrt(var + 1e-5);
          const double want = xhat * wf[size_t(i)] + bf[size_t(i)];
          // x - mean cancels: its error is relative to |x| + |mean|, not to the difference.
          const double bound =
              rel * ((std::abs(xs[k]) + std::abs(mean)) / std::sqrt(var + 1e-5) * std::abs(wf[size_t(i)]) + std::abs(bf[size_t(i)]));
          worst = std::max(worst, std::abs(got[k] - want) / bound);
        }
      }
      INFO("worst error / bound " << worst);
      CHECK(worst <= 1.0);
    }
  }
}

TEST_CASE("autocast: RMSNorm upcasts, rounds back to the input dtype, and scales in float32", "[amp][autocast][norm]") {
  for (DType autocast_dtype : {DType::Float16, DType::BFloat16}) {
    for (DType input_dtype : {autocast_dtype, DType::Float32}) {
      INFO("autocast " << name_of(autocast_dtype) << ", input " << name_of(input_dtype));
      const double eps = 1e-5;
      nn::RMSNorm norm(kWidth, eps);
      {
        NoGradGuard no_grad;
        norm.weight.copy_(from_vector(weight_values(), {kWidth}, DType::Float64).to(DType::Float32));
      }
      const std::vector<double> wf = norm.weight.to(DType::Float64).tolist();
      const auto [x, xs] = stored(input_dtype);
      Tensor y;
      {
        autocast::AutocastGuard guard(true, autocast_dtype);
        y = norm(x);
      }
      // weight (float32) * normalized (the input's dtype): promoted to float32, as torch's type promotion.
      CHECK(y.dtype() == DType::Float32);
      const std::vector<double> got = y.to(DType::Float64).tolist();
      // The float32 normalization's relative error: the mean of squares (a sum of kWidth terms), rsqrt and
      // a product.
      const double rel = ro::reduction_bound({double(kWidth)}) + ro::gamma(6, ro::kUnit);
      const bool rounds = input_dtype != DType::Float32;
      const int p = significand_bits(input_dtype);
      int64_t bad = 0, near_tie = 0;
      double worst = 0;
      for (int64_t r = 0; r < kRows; ++r) {
        double ms = 0;
        for (int64_t i = 0; i < kWidth; ++i) ms += xs[size_t(r * kWidth + i)] * xs[size_t(r * kWidth + i)];
        ms /= double(kWidth);
        for (int64_t i = 0; i < kWidth; ++i) {
          const size_t k = size_t(r * kWidth + i);
          const double n64 = xs[k] / std::sqrt(ms + eps);
          const double w = wf[size_t(i)];
          if (!rounds) {
            const double want = w * n64;
            worst = std::max(worst, std::abs(got[k] - want) / (rel * std::abs(want)));
            continue;
          }
          // float32's normalized value lies within rel of n64; rounded to the 16-bit dtype it is the
          // rounding of n64, or (only when a rounding boundary lies that close) its neighbour. Then
          // one float32 product with the weight.
          const double d = rel * std::abs(n64);
          const double lo = round_significand(n64 - d, p), hi = round_significand(n64 + d, p);
          if (lo != hi) ++near_tie;
          const double tol = 2 * ro::kUnit;
          const bool ok = std::abs(got[k] - w * lo) <= tol * std::abs(w * lo) ||
                          std::abs(got[k] - w * hi) <= tol * std::abs(w * hi);
          if (!ok) ++bad;
        }
      }
      if (rounds) {
        INFO(bad << " of " << kRows * kWidth << " elements off the 16-bit rounding of the float64 value; "
                 << near_tie << " within float32 roundoff of a rounding boundary");
        CHECK(bad == 0);
        CHECK(near_tie < kRows * kWidth / 10);  // the boundaries are rare, so the check is a strong one
      } else {
        INFO("worst error / bound " << worst);
        CHECK(worst <= 1.0);
      }
    }
  }
}
