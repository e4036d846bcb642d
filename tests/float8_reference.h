// The float64 reference of float8_mm (booster/ops/ops.h) for the CPU and CUDA tests: the operands'
// float8 values are decoded exactly, multiplied and summed in float64, and divided by the scales.
#pragma once

#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "booster/ops/ops.h"

namespace testing {

// Checks float8_mm(a, b, sa, sb, out_dtype) on a's device against the float64 product. The float32
// accumulation of k exact products errs by at most k u sum|a_i b_i| (u = 2^-24, any order of the sums);
// a bfloat16 output adds one rounding of half a unit in the last place (2^-9 relative). On a GPU,
// cuBLASLt's float8 kernels (fast accumulation off) add within chunks of the sum in the tensor cores'
// narrower accumulator (about 13 mantissa bits on Hopper) before promoting to float32: 2^-10 of
// sum|a_i b_i| more, still far below what a wrong scale or a transposed operand would give.
inline void check_float8_mm(const booster::Tensor& a, const booster::Tensor& b, float sa, float sb,
                            booster::DType out_dtype) {
  using namespace booster;
  const Tensor got_t = float8_mm(a, b, sa, sb, out_dtype);
  REQUIRE(got_t.dtype() == out_dtype);
  REQUIRE(got_t.shape() == Shape{a.size(0), b.size(0)});
  const std::vector<double> got = got_t.to(DType::Float64).to(Device::cpu()).to_vector<double>();
  const std::vector<double> qa = from_float8(a).to(DType::Float64).to(Device::cpu()).to_vector<double>();
  const std::vector<double> qb = from_float8(b).to(DType::Float64).to(Device::cpu()).to_vector<double>();
  const int64_t n = a.size(0), m = b.size(0), k = a.size(1);
  const double scale = double(sa) * double(sb);
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < m; ++j) {
      double acc = 0, magnitude = 0;
      for (int64_t l = 0; l < k; ++l) {
        const double p = qa[size_t(i * k + l)] * qb[size_t(j * k + l)];
        acc += p;
        magnitude += std::abs(p);
      }
      const double want = acc / scale;
      double tol = double(k + 2) * 0x1p-24 * magnitude / scale;
      if (!a.device().is_cpu()) tol += 0x1p-10 * magnitude / scale;
      if (out_dtype == DType::BFloat16) tol += 0x1p-8 * std::abs(want) + 0x1p-8 * tol;
      const double g = got[size_t(i * m + j)];
      if (!(std::abs(g - want) <= tol) && bad++ < 5)
        FAIL_CHECK("float8_mm [" << i << ", " << j << "]: got " << g << ", float64 reference " << want << " (bound "
                                 << tol << ")");
    }
  CHECK(bad == 0);
}

}  // namespace testing
