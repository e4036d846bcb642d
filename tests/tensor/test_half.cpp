// float16 and bfloat16 conversions against references written here from the IEEE-754 definitions:
// every one of the 65536 bit patterns going up (to float), and going down (from float) every value's
// neighbourhood: each midpoint between adjacent representable values (the ties) and the floats just
// beside it, plus the named edge cases. Both the hardware (F16C) path and the portable soft:: path,
// the bulk converters, and Tensor.to(), which must all round the same way.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "booster/ops/ops.h"
#include "booster/tensor/half.h"

using namespace booster;

namespace {

constexpr int kPatterns = 1 << 16;

// ------------------------------------------------------------------ references from the definitions

// binary16: sign * 2^(e - 15) * (1 + m / 1024) for 0 < e < 31; m * 2^-24 for e = 0; inf or NaN for e = 31.
double ref_half_value(uint16_t h) {
  const int sign = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  double v;
  if (e == 0x1f)
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  else if (e == 0)
    v = std::ldexp(double(m), -24);
  else
    v = std::ldexp(1.0 + double(m) / 1024.0, e - 15);
  return sign ? -v : v;
}

// bfloat16 is the top half of a binary32.
float ref_bf16_value(uint16_t b) {
  const uint32_t bits = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

bool is_half_nan(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }
bool is_bf16_nan(uint16_t b) { return (b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0; }

// Round-to-nearest-even from a double `a` >= 0 to the pattern among the non-negative `values` (sorted,
// values[k] is pattern k's value, the last one the first value past the finite range, i.e. where
// infinity starts): the nearest, and on a tie the even pattern.
uint16_t round_nearest_even(double a, const std::vector<double>& values) {
  // The largest k with values[k] <= a.
  size_t lo = 0, hi = values.size() - 1;
  if (a >= values[hi]) return uint16_t(hi);
  while (hi - lo > 1) {
    const size_t mid = (lo + hi) / 2;
    (values[mid] <= a ? lo : hi) = mid;
  }
  const double below = a - values[lo], above = values[lo + 1] - a;
  if (below < above) return uint16_t(lo);
  if (above < below) return uint16_t(lo + 1);
  return uint16_t(lo % 2 == 0 ? lo : lo + 1);
}

// Values of the non-negative finite half patterns 0x0000..0x7bff, then 2^16 standing for 0x7c00 (inf):
// a value rounds to infinity exactly when it would round to 2^16 with unbounded exponent.
const std::vector<double>& half_ladder() {
  static const std::vector<double> v = [] {
    std::vector<double> out;
    for (uint32_t h = 0; h < 0x7c00; ++h) out.push_back(ref_half_value(uint16_t(h)));
    out.push_back(65536.0);
    return out;
  }();
  return v;
}

const std::vector<double>& bf16_ladder() {
  static const std::vector<double> v = [] {
    std::vector<double> out;
    for (uint32_t b = 0; b < 0x7f80; ++b) out.push_back(ref_bf16_value(uint16_t(b)));
    out.push_back(std::ldexp(1.0, 128));
    return out;
  }();
  return v;
}

uint16_t ref_float_to_half(float f) {
  if (std::isnan(f)) return 0x7e00;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  return sign | round_nearest_even(std::fabs(double(f)), half_ladder());
}

uint16_t ref_float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  return sign | round_nearest_even(std::fabs(double(f)), bf16_ladder());
}

uint32_t bits_of(float f) { return float_bits(f); }

// The same float, or both NaN.
bool same_float(float got, double want) {
  if (std::isnan(want)) return std::isnan(got);
  return float_bits(got) == float_bits(float(want)) && double(got) == want;
}

// Every float a conversion down should be checked on: each representable value, the midpoints between
// neighbours (exact ties), and the floats one ulp either side of each, for both signs.
std::vector<float> probe_floats(const std::vector<double>& ladder) {
  std::vector<float> out;
  for (size_t k = 0; k + 1 < ladder.size(); ++k) {
    const float value = float(ladder[k]);
    const float mid = float((ladder[k] + ladder[k + 1]) / 2);  // exact: one more bit than the format
    REQUIRE(double(mid) == (ladder[k] + ladder[k + 1]) / 2);
    for (float f : {value, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
      out.push_back(f);
      out.push_back(-f);
    }
  }
  return out;
}

float float_from_bits(uint32_t u) { return bits_float(u); }

}  // namespace

// ------------------------------------------------------------------------------------------ float16 up

TEST_CASE("float16 -> float: all 65536 patterns, hardware and portable paths", "[half]") {
#if defined(__F16C__)
  INFO("half_bits_to_float uses F16C");
#else
  WARN("this build has no F16C: half_bits_to_float is the portable path");
#endif
  int nan_count = 0;
  for (int p = 0; p < kPatterns; ++p) {
    const uint16_t h = uint16_t(p);
    const double want = ref_half_value(h);
    const float fast = half_bits_to_float(h), soft_value = soft::half_bits_to_float(h);
    INFO("pattern 0x" << std::hex << p);
    REQUIRE(same_float(fast, want));
    REQUIRE(same_float(soft_value, want));
    REQUIRE(same_float(float(Half::from_bits(h)), want));
    if (is_half_nan(h)) {
      ++nan_count;
      // The payload's low 9 bits survive in both paths (F16C also sets the quiet bit).
      REQUIRE(((bits_of(fast) >> 13) & 0x1ff) == (h & 0x1ffu));
      REQUIRE(((bits_of(soft_value) >> 13) & 0x1ff) == (h & 0x1ffu));
      REQUIRE(std::signbit(fast) == bool(h & 0x8000));
    } else {
      REQUIRE(std::signbit(fast) == bool(h & 0x8000));  // -0 stays -0
    }
  }
  REQUIRE(nan_count == 2 * 1023);
  // Spot values of the definition itself, so a wrong reference cannot pass unnoticed.
  REQUIRE(ref_half_value(0x3c00) == 1.0);
  REQUIRE(ref_half_value(0x7bff) == 65504.0);
  REQUIRE(ref_half_value(0x0400) == std::ldexp(1.0, -14));
  REQUIRE(ref_half_value(0x0001) == std::ldexp(1.0, -24));
  REQUIRE(ref_half_value(0xc000) == -2.0);
  REQUIRE(ref_half_value(0x3555) == Approx(1.0 / 3).epsilon(1e-3));
}

TEST_CASE("float16 bulk converters agree with the scalar path on all patterns", "[half]") {
  std::vector<Half> all(kPatterns);
  for (int p = 0; p < kPatterns; ++p) all[size_t(p)] = Half::from_bits(uint16_t(p));
  // Offsets and odd lengths exercise both the vector body and the scalar tail.
  for (int offset : {0, 3}) {
    const int64_t n = kPatterns - offset - (offset ? 2 : 0);
    std::vector<float> up(static_cast<size_t>(n));
    half_to_float(all.data() + offset, up.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t h = uint16_t(i + offset);
      INFO("pattern 0x" << std::hex << h);
      REQUIRE(same_float(up[size_t(i)], ref_half_value(h)));
    }
    // Down again: every non-NaN pattern comes back bit for bit (the round trip is the identity).
    std::vector<Half> down(static_cast<size_t>(n));
    float_to_half(up.data(), down.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t h = uint16_t(i + offset);
      INFO("pattern 0x" << std::hex << h);
      if (is_half_nan(h))
        REQUIRE(is_half_nan(down[size_t(i)].bits));
      else
        REQUIRE(down[size_t(i)].bits == h);
    }
  }
}

// ------------------------------------------------------------------------------------------ float16 down

TEST_CASE("float -> float16 rounds to nearest even at every tie and its neighbours", "[half]") {
  const std::vector<float> probes = probe_floats(half_ladder());
  REQUIRE(probes.size() > 200000);
  std::vector<Half> bulk(probes.size());
  float_to_half(probes.data(), bulk.data(), int64_t(probes.size()));
  for (size_t i = 0; i < probes.size(); ++i) {
    const float f = probes[i];
    const uint16_t want = ref_float_to_half(f);
    INFO("float " << f << " (bits 0x" << std::hex << bits_of(f) << ")");
    REQUIRE(float_to_half_bits(f) == want);
    REQUIRE(soft::float_to_half_bits(f) == want);
    REQUIRE(Half(f).bits == want);
    REQUIRE(bulk[i].bits == want);
  }
  // A sweep of floats across and beyond the half range (every 4099th pattern): both paths agree with
  // the reference between the ladder's probes too.
  for (uint64_t u = 0; u < 0x80000000ull; u += 4099) {
    const float f = float_from_bits(uint32_t(u));
    if (std::isnan(f)) continue;
    INFO("float bits 0x" << std::hex << u);
    const uint16_t want = ref_float_to_half(f);
    REQUIRE(float_to_half_bits(f) == want);
    REQUIRE(soft::float_to_half_bits(f) == want);
  }
}

TEST_CASE("float16 edge cases going down", "[half]") {
  auto both = [](float f) {
    const uint16_t hw = float_to_half_bits(f), sw = soft::float_to_half_bits(f);
    REQUIRE(hw == sw);
    return hw;
  };
  const float two_m24 = std::ldexp(1.0f, -24), two_m14 = std::ldexp(1.0f, -14);
  REQUIRE(both(65504.0f) == 0x7bff);                                  // largest finite
  REQUIRE(both(65519.99f) == 0x7bff);                                 // still rounds down to it
  REQUIRE(both(std::nextafter(65520.0f, 0.0f)) == 0x7bff);            // the largest that does
  REQUIRE(both(65520.0f) == 0x7c00);                                  // the tie goes to "even" = inf
  REQUIRE(both(70000.0f) == 0x7c00);
  REQUIRE(both(1e30f) == 0x7c00);
  REQUIRE(both(-65520.0f) == 0xfc00);
  REQUIRE(both(INFINITY) == 0x7c00);
  REQUIRE(both(-INFINITY) == 0xfc00);
  REQUIRE(both(two_m14) == 0x0400);                                   // smallest normal
  REQUIRE(both(std::nextafter(two_m14, 0.0f)) == 0x0400);             // rounds up into it
  REQUIRE(both(two_m24) == 0x0001);                                   // smallest subnormal
  REQUIRE(both(two_m24 / 2) == 0x0000);                               // 2^-25: tie to even, i.e. 0
  REQUIRE(both(std::nextafter(two_m24 / 2, 1.0f)) == 0x0001);         // just above rounds up
  REQUIRE(both(-two_m24 / 2) == 0x8000);                              // to -0
  REQUIRE(both(1.5f * two_m24) == 0x0002);                            // tie between 1 and 2 ulps: even
  REQUIRE(both(2.5f * two_m24) == 0x0002);
  REQUIRE(both(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);              // tie: 1 (even)
  REQUIRE(both(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3c02);          // tie: 1 + 2^-9 (even)
  REQUIRE(both(1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20)) == 0x3c01);
  REQUIRE(both(-0.0f) == 0x8000);
  REQUIRE(both(0.0f) == 0x0000);
  for (uint32_t nan_bits : {0x7fc00000u, 0x7f800001u, 0xffc00000u, 0x7fa00000u, 0x7fbfffffu}) {
    const float nan = float_from_bits(nan_bits);
    // Hardware and software may keep different payloads: compare classes, not bits.
    for (uint16_t got : {float_to_half_bits(nan), soft::float_to_half_bits(nan)}) {
      INFO("NaN bits 0x" << std::hex << nan_bits << " -> 0x" << got);
      REQUIRE(is_half_nan(got));
      REQUIRE((got & 0x0200) != 0);  // quiet
    }
  }
}

TEST_CASE("float16 round trip float -> half -> float is the identity on every half value", "[half]") {
  for (int p = 0; p < kPatterns; ++p) {
    const uint16_t h = uint16_t(p);
    if (is_half_nan(h)) continue;
    const float f = half_bits_to_float(h);
    INFO("pattern 0x" << std::hex << p);
    REQUIRE(float_to_half_bits(f) == h);
    REQUIRE(soft::float_to_half_bits(soft::half_bits_to_float(h)) == h);
    REQUIRE(Half(float(Half::from_bits(h))).bits == h);
  }
}

// ------------------------------------------------------------------------------------------ bfloat16

TEST_CASE("bfloat16 -> float on all patterns, scalar and bulk", "[half]") {
  std::vector<BFloat16> all(kPatterns);
  for (int p = 0; p < kPatterns; ++p) all[size_t(p)] = BFloat16::from_bits(uint16_t(p));
  std::vector<float> bulk(kPatterns);
  bf16_to_float(all.data(), bulk.data(), kPatterns);
  for (int p = 0; p < kPatterns; ++p) {
    const uint16_t b = uint16_t(p);
    INFO("pattern 0x" << std::hex << p);
    const float want = ref_bf16_value(b);
    REQUIRE(bits_of(bf16_bits_to_float(b)) == bits_of(want));
    REQUIRE(bits_of(float(BFloat16::from_bits(b))) == bits_of(want));
    REQUIRE(bits_of(bulk[size_t(p)]) == bits_of(want));
    // Round trip.
    if (!is_bf16_nan(b)) {
      REQUIRE(float_to_bf16_bits(want) == b);
      REQUIRE(BFloat16(want).bits == b);
    }
  }
  std::vector<BFloat16> down(kPatterns);
  float_to_bf16(bulk.data(), down.data(), kPatterns);
  for (int p = 0; p < kPatterns; ++p) {
    if (is_bf16_nan(uint16_t(p)))
      REQUIRE(is_bf16_nan(down[size_t(p)].bits));
    else
      REQUIRE(down[size_t(p)].bits == uint16_t(p));
  }
}

TEST_CASE("float -> bfloat16 rounds to nearest even at every tie and its neighbours", "[half]") {
  const std::vector<float> probes = probe_floats(bf16_ladder());
  std::vector<BFloat16> bulk(probes.size());
  float_to_bf16(probes.data(), bulk.data(), int64_t(probes.size()));
  for (size_t i = 0; i < probes.size(); ++i) {
    const float f = probes[i];
    const uint16_t want = ref_float_to_bf16(f);
    INFO("float " << f << " (bits 0x" << std::hex << bits_of(f) << ")");
    REQUIRE(float_to_bf16_bits(f) == want);
    REQUIRE(bulk[i].bits == want);
  }
}

TEST_CASE("bfloat16 edge cases going down", "[half]") {
  const float largest = ref_bf16_value(0x7f7f);
  REQUIRE(double(largest) == Approx(3.3895e38).epsilon(1e-4));
  REQUIRE(float_to_bf16_bits(largest) == 0x7f7f);
  REQUIRE(float_to_bf16_bits(std::numeric_limits<float>::max()) == 0x7f80);  // past the last tie: inf
  REQUIRE(float_to_bf16_bits(float_from_bits(0x7f7f7fffu)) == 0x7f7f);       // just below the tie
  REQUIRE(float_to_bf16_bits(float_from_bits(0x7f7f8000u)) == 0x7f80);       // the tie goes to even: inf
  REQUIRE(float_to_bf16_bits(-INFINITY) == 0xff80);
  // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: even is 1; 1 + 3 * 2^-8 goes up to 1 + 2^-6.
  REQUIRE(float_to_bf16_bits(1.0f + std::ldexp(1.0f, -8)) == 0x3f80);
  REQUIRE(float_to_bf16_bits(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3f82);
  REQUIRE(float_to_bf16_bits(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)) == 0x3f81);
  REQUIRE(float_to_bf16_bits(-0.0f) == 0x8000);
  REQUIRE(float_to_bf16_bits(float_from_bits(0x00000001u)) == 0x0000);  // float subnormals keep rounding
  REQUIRE(float_to_bf16_bits(float_from_bits(0x00008000u)) == 0x0000);  // tie to even
  REQUIRE(float_to_bf16_bits(float_from_bits(0x00018000u)) == 0x0002);
  // A NaN whose payload sits only in the dropped bits must not become infinity; NaNs come out quiet.
  for (uint32_t nan_bits : {0x7f800001u, 0x7fc00000u, 0xff800001u, 0x7fffffffu, 0x7f80ffffu}) {
    const float nan = float_from_bits(nan_bits);
    for (uint16_t got : {float_to_bf16_bits(nan), BFloat16(nan).bits}) {
      INFO("NaN bits 0x" << std::hex << nan_bits << " -> 0x" << got);
      REQUIRE(is_bf16_nan(got));
      REQUIRE((got & 0x0040) != 0);
      REQUIRE(bool(got & 0x8000) == bool(nan_bits & 0x80000000u));
    }
    BFloat16 bulk_out;
    float_to_bf16(&nan, &bulk_out, 1);
    REQUIRE(is_bf16_nan(bulk_out.bits));
  }
}

// ------------------------------------------------------------------------------------------ tensors

TEST_CASE("Tensor.to(Float16/BFloat16) rounds like the scalar conversions", "[half]") {
  const float two_m24 = std::ldexp(1.0f, -24);
  std::vector<float> edges = {0.0f,
                              -0.0f,
                              1.0f,
                              1.0f + std::ldexp(1.0f, -11),
                              1.0f + 3 * std::ldexp(1.0f, -11),
                              1.0f + std::ldexp(1.0f, -8),
                              1.0f + 3 * std::ldexp(1.0f, -8),
                              65504.0f,
                              65519.99f,
                              65520.0f,
                              -70000.0f,
                              std::ldexp(1.0f, -14),
                              two_m24,
                              two_m24 / 2,
                              std::nextafter(two_m24 / 2, 1.0f),
                              1.5f * two_m24,
                              3.0e38f,
                              std::numeric_limits<float>::max(),
                              INFINITY,
                              -INFINITY,
                              NAN};
  // Enough values that a vectorized body runs, not only a scalar tail.
  for (int k = 0; k < 40; ++k) edges.push_back(edges[size_t(k % 21)] * -1.0f);
  const int64_t n = int64_t(edges.size());
  Tensor t = from_vector(edges, {n});
  const Tensor h = t.to(DType::Float16), b = t.to(DType::BFloat16);
  REQUIRE(h.dtype() == DType::Float16);
  REQUIRE(b.dtype() == DType::BFloat16);
  const Half* hp = h.data<Half>();
  const BFloat16* bp = b.data<BFloat16>();
  for (int64_t i = 0; i < n; ++i) {
    const float f = edges[size_t(i)];
    INFO("value " << f);
    if (std::isnan(f)) {
      REQUIRE(is_half_nan(hp[i].bits));
      REQUIRE(is_bf16_nan(bp[i].bits));
      continue;
    }
    REQUIRE(hp[i].bits == ref_float_to_half(f));
    REQUIRE(bp[i].bits == ref_float_to_bf16(f));
  }
  // And back up: every half pattern as a tensor converts to the reference floats.
  Tensor all = Tensor::empty({kPatterns}, DType::Float16);
  Half* ap = all.data<Half>();
  for (int p = 0; p < kPatterns; ++p) ap[p] = Half::from_bits(uint16_t(p));
  const std::vector<float> up = all.to(DType::Float32).to_vector<float>();
  for (int p = 0; p < kPatterns; ++p) {
    INFO("pattern 0x" << std::hex << p);
    REQUIRE(same_float(up[size_t(p)], ref_half_value(uint16_t(p))));
  }
}
