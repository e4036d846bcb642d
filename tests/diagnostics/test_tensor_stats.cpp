// The precision doctor's per-tensor statistics (diagnostics/tensor_stats.h) against the four formats'
// definitions: the overflow, underflow and subnormal thresholds in closed form (largest finite value,
// smallest subnormal and smallest normal, with round-to-nearest-even ties), and the counts of a tensor
// whose every value's class is known by construction.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <vector>

#include "booster/diagnostics/tensor_stats.h"
#include "booster/ops/ops.h"

using namespace booster;
using namespace booster::diagnostics;

namespace {

float next_up(float x) { return std::nextafter(x, std::numeric_limits<float>::infinity()); }

}  // namespace

TEST_CASE("tensor_stats: each format's thresholds follow from its definition", "[diagnostics]") {
  // float16: max 65504 = (2 - 2^-10) 2^15; the midpoint to 2^16 ties to even (the infinity), so 65520
  // overflows. Smallest subnormal 2^-24: 2^-25 ties to zero. Smallest normal 2^-14: 2^-14 - 2^-25 ties
  // to it (even mantissa).
  const FormatRange& h = format_range(Format::Float16);
  CHECK(h.overflow_from == 65520.0f);
  CHECK(h.underflow_upto == std::ldexp(1.0f, -25));
  CHECK(h.normal_from == std::ldexp(1.0f, -14) - std::ldexp(1.0f, -25));
  // bfloat16: max (2 - 2^-7) 2^127, overflow from the midpoint (2 - 2^-8) 2^127; subnormals from 2^-133;
  // normals from 2^-126.
  const FormatRange& b = format_range(Format::BFloat16);
  CHECK(b.overflow_from == std::ldexp(2.0f - std::ldexp(1.0f, -8), 127));
  CHECK(b.underflow_upto == std::ldexp(1.0f, -134));
  CHECK(b.normal_from == std::ldexp(1.0f, -126) - std::ldexp(1.0f, -134));
  // e4m3fn: max 448 (mantissa 110); the midpoint 464 to the next step (480, the NaN pattern) ties to
  // 448's even mantissa, so only values above 464 overflow. Subnormals from 2^-9, normals from 2^-6.
  const FormatRange& e4 = format_range(Format::E4M3);
  CHECK(e4.overflow_from == next_up(464.0f));
  CHECK(e4.underflow_upto == std::ldexp(1.0f, -10));
  CHECK(e4.normal_from == std::ldexp(1.0f, -6) - std::ldexp(1.0f, -10));
  // e5m2: max 57344 (mantissa 11); the midpoint 61440 to 65536 (infinity) ties to even: infinity.
  // Subnormals from 2^-16, normals from 2^-14.
  const FormatRange& e5 = format_range(Format::E5M2);
  CHECK(e5.overflow_from == 61440.0f);
  CHECK(e5.underflow_upto == std::ldexp(1.0f, -17));
  CHECK(e5.normal_from == std::ldexp(1.0f, -14) - std::ldexp(1.0f, -17));
  CHECK(format_max(Format::Float16) == 65504.0f);
  CHECK(format_max(Format::E4M3) == 448.0f);
  CHECK(format_max(Format::E5M2) == 57344.0f);
  CHECK(format_max(Format::BFloat16) == std::ldexp(2.0f - std::ldexp(1.0f, -7), 127));
}

TEST_CASE("tensor_stats: counts, largest magnitude and exponent histogram of a known tensor", "[diagnostics]") {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  // value      float16         bfloat16   e4m3        e5m2        floor(log2|x|)
  // 0          zero
  // 1          normal          normal     normal      normal      0
  // -3         normal          normal     normal      normal      1
  // 70000      overflow        normal     overflow    overflow    16
  // 500        normal          normal     overflow    normal      8
  // 2^-26      underflow       normal     underflow   underflow   -26
  // 1e-6       subnormal       normal     underflow   underflow   -20
  // 1e-3       normal          normal     subnormal   normal      -10
  // inf, nan   not finite
  const std::vector<float> v{0.0f, 1.0f, -3.0f, 70000.0f, 500.0f, std::ldexp(1.0f, -26), 1e-6f, 1e-3f, inf, nan};
  const TensorStats s = tensor_stats(from_vector(v, {2, 5}));
  CHECK(s.count == 10);
  CHECK(s.nonfinite == 2);
  CHECK(s.zeros == 1);
  CHECK(s.max_abs == 70000.0f);
  CHECK(s.in(Format::Float16).overflow == 1);
  CHECK(s.in(Format::Float16).underflow == 1);
  CHECK(s.in(Format::Float16).subnormal == 1);
  CHECK(s.in(Format::BFloat16).overflow == 0);
  CHECK(s.in(Format::BFloat16).underflow == 0);
  CHECK(s.in(Format::BFloat16).subnormal == 0);
  CHECK(s.in(Format::E4M3).overflow == 2);
  CHECK(s.in(Format::E4M3).underflow == 2);
  CHECK(s.in(Format::E4M3).subnormal == 1);
  CHECK(s.in(Format::E5M2).overflow == 1);
  CHECK(s.in(Format::E5M2).underflow == 2);
  CHECK(s.in(Format::E5M2).subnormal == 0);
  // The histogram: one value in each of the bins of exponents 0, 1, 16, 8, -26, -20, -10.
  int64_t total = 0;
  for (int64_t c : s.exponents) total += c;
  CHECK(total == 7);
  for (int e : {0, 1, 16, 8, -26, -20, -10}) CHECK(s.exponents[size_t(e + 127)] == 1);
  const nlohmann::json j = s.to_json();
  CHECK(j["exponents"]["min"] == -26);
  CHECK(j["exponents"]["counts"].size() == 16 + 26 + 1);
  CHECK(j["float16"]["overflow"].get<double>() == 0.1);

  // Merging adds; the statistics of 16-bit storage are those of its values.
  TensorStats twice = s;
  twice.merge(s);
  CHECK(twice.count == 20);
  CHECK(twice.in(Format::E4M3).overflow == 4);
  CHECK(twice.max_abs == 70000.0f);
  const TensorStats half = tensor_stats(from_vector(std::vector<float>{1.0f, 1e-6f, 60000.0f}, {3}).to(DType::Float16));
  CHECK(half.in(Format::Float16).subnormal == 1);  // 1e-6 stored as a float16 subnormal
  CHECK(half.in(Format::Float16).overflow == 0);
  CHECK(half.in(Format::E4M3).overflow == 1);
  CHECK(max_abs(from_vector(std::vector<float>{-2.0f, inf, 1.0f}, {3})) == 2.0f);
  CHECK_FALSE(all_finite(from_vector(std::vector<float>{1.0f, nan}, {2})));
  CHECK(all_finite(from_vector(std::vector<float>{1.0f, -1e30f}, {2})));
}
