// Tensor statistics for the precision doctor (tensor_stats.h).
#include "booster/diagnostics/tensor_stats.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "booster/common/error.h"
#include "booster/kernels/fused.h"
#include "booster/kernels/tensor_stats.h"
#include "booster/ops/ops.h"
#include "booster/tensor/float8.h"
#include "booster/tensor/half.h"

namespace booster::diagnostics {

namespace {

enum class Class { Zero, Subnormal, Normal, Overflow };

// What rounding the non-negative finite float32 `a` to `format` gives (Note [Range of a format]).
Class classify(Format format, float a) {
  switch (format) {
    case Format::Float16: {
      const uint16_t h = float_to_half_bits(a) & 0x7fff;
      return h >= 0x7c00 ? Class::Overflow : h == 0 ? Class::Zero : h < 0x0400 ? Class::Subnormal : Class::Normal;
    }
    case Format::BFloat16: {
      const uint16_t b = float_to_bf16_bits(a) & 0x7fff;
      return b >= 0x7f80 ? Class::Overflow : b == 0 ? Class::Zero : b < 0x0080 ? Class::Subnormal : Class::Normal;
    }
    case Format::E4M3: {
      const uint8_t b = fp8::float_to_e4m3fn(a, /*saturate=*/false) & 0x7f;
      return b == fp8::kE4M3NaN ? Class::Overflow : b == 0 ? Class::Zero : b < 0x08 ? Class::Subnormal : Class::Normal;
    }
    case Format::E5M2: {
      const uint8_t b = fp8::float_to_e5m2(a, /*saturate=*/false) & 0x7f;
      return b >= fp8::kE5M2Inf ? Class::Overflow : b == 0 ? Class::Zero : b < 0x04 ? Class::Subnormal : Class::Normal;
    }
  }
  return Class::Normal;
}

// The smallest float32 bit pattern in [0, inf) for which pred holds (pred is monotone in the bits).
template <class Pred>
uint32_t first_bits_where(Pred pred) {
  uint32_t lo = 0, hi = 0x7f800000u;
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (pred(bits_float(mid))) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

struct RangeBits {
  uint32_t overflow_from, underflow_upto, normal_from;
};

const std::array<RangeBits, kNumFormats>& range_bits() {
  static const std::array<RangeBits, kNumFormats> ranges = [] {
    std::array<RangeBits, kNumFormats> r{};
    for (Format f : kFormats) {
      RangeBits& b = r[size_t(f)];
      b.overflow_from = first_bits_where([f](float a) { return classify(f, a) == Class::Overflow; });
      b.underflow_upto = first_bits_where([f](float a) { return classify(f, a) != Class::Zero; }) - 1;
      b.normal_from = first_bits_where([f](float a) { return classify(f, a) >= Class::Normal; });
    }
    return r;
  }();
  return ranges;
}

}  // namespace

const char* format_name(Format format) {
  switch (format) {
    case Format::Float16: return "float16";
    case Format::BFloat16: return "bfloat16";
    case Format::E4M3: return "e4m3";
    case Format::E5M2: return "e5m2";
  }
  return "?";
}

float format_max(Format format) {
  switch (format) {
    case Format::Float16: return 65504.0f;
    case Format::BFloat16: return bf16_bits_to_float(0x7f7f);
    case Format::E4M3: return 448.0f;
    case Format::E5M2: return 57344.0f;
  }
  return 0.0f;
}

const FormatRange& format_range(Format format) {
  static const std::array<FormatRange, kNumFormats> ranges = [] {
    std::array<FormatRange, kNumFormats> out{};
    for (Format f : kFormats) {
      const RangeBits& b = range_bits()[size_t(f)];
      out[size_t(f)] = {bits_float(b.overflow_from), bits_float(b.underflow_upto), bits_float(b.normal_from)};
    }
    return out;
  }();
  return ranges[size_t(format)];
}

void TensorStats::merge(const TensorStats& o) {
  count += o.count;
  nonfinite += o.nonfinite;
  zeros += o.zeros;
  max_abs = std::max(max_abs, o.max_abs);
  for (size_t f = 0; f < formats.size(); ++f) {
    formats[f].overflow += o.formats[f].overflow;
    formats[f].underflow += o.formats[f].underflow;
    formats[f].subnormal += o.formats[f].subnormal;
  }
  for (size_t e = 0; e < exponents.size(); ++e) exponents[e] += o.exponents[e];
}

nlohmann::json TensorStats::to_json() const {
  const double n = count > 0 ? double(count) : 1.0;
  nlohmann::json out = {{"count", count}, {"max_abs", max_abs}, {"nonfinite", nonfinite}, {"zeros", zeros}};
  for (Format f : kFormats) {
    const FormatCounts& c = in(f);
    out[format_name(f)] = {{"overflow", double(c.overflow) / n},
                           {"underflow", double(c.underflow) / n},
                           {"subnormal", double(c.subnormal) / n}};
  }
  int first = 0, last = kExponentBins - 1;
  while (first <= last && exponents[size_t(first)] == 0) ++first;
  while (last >= first && exponents[size_t(last)] == 0) --last;
  nlohmann::json counts = nlohmann::json::array();
  for (int e = first; e <= last; ++e) counts.push_back(exponents[size_t(e)]);
  out["exponents"] = {{"min", first <= last ? first - 127 : 0}, {"counts", counts}};
  return out;
}

namespace {

// The statistics on the tensor's own device, where one is registered (kernels/tensor_stats.h): one
// pass there and one small copy back, instead of the whole tensor copied to the host.
std::optional<TensorStats> device_stats(const Tensor& t) {
  if (t.device().is_cpu() || !kernels::tensor_stats_kernel.has(t.device().type)) return std::nullopt;
  kernels::StatsThresholds th{};
  for (size_t f = 0; f < range_bits().size(); ++f) {
    th.overflow_from[f] = range_bits()[f].overflow_from;
    th.underflow_upto[f] = range_bits()[f].underflow_upto;
    th.normal_from[f] = range_bits()[f].normal_from;
  }
  const Tensor values = t.detach().to(DType::Float32).contiguous().reshape({-1});
  Tensor counts = zeros({kernels::kStatsSlots}, DType::Int64, t.device());
  kernels::tensor_stats_kernel(t.device())(values, th, counts);
  const std::vector<int64_t> c = counts.to_vector<int64_t>();
  TensorStats s;
  s.count = values.numel();
  s.nonfinite = c[kernels::kStatsNonfinite];
  s.zeros = c[kernels::kStatsZeros];
  s.max_abs = bits_float(uint32_t(c[kernels::kStatsMaxBits]));
  for (int e = 0; e < TensorStats::kExponentBins; ++e) s.exponents[size_t(e)] = c[size_t(kernels::kStatsExponents + e)];
  for (size_t f = 0; f < s.formats.size(); ++f) {
    s.formats[f].overflow = c[kernels::kStatsFormats + 3 * f];
    s.formats[f].underflow = c[kernels::kStatsFormats + 3 * f + 1];
    s.formats[f].subnormal = c[kernels::kStatsFormats + 3 * f + 2];
  }
  return s;
}

}  // namespace

TensorStats tensor_stats(const Tensor& t) {
  BOOSTER_CHECK(is_floating(t.dtype()), DTypeError, "tensor_stats: needs a floating tensor, got ", t.dtype());
  TensorStats s;
  if (t.numel() == 0) return s;
  if (std::optional<TensorStats> on_device = device_stats(t)) return *on_device;
  const Tensor values = t.detach().to(DType::Float32).cpu().contiguous();
  const auto* bits = reinterpret_cast<const uint32_t*>(values.data<float>());
  const int64_t n = values.numel();
  const std::array<RangeBits, kNumFormats>& ranges = range_bits();
  uint32_t max_bits = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t a = bits[i] & 0x7fffffffu;
    if (a >= 0x7f800000u) {
      ++s.nonfinite;
      continue;
    }
    if (a == 0) {
      ++s.zeros;
      continue;
    }
    max_bits = std::max(max_bits, a);
    ++s.exponents[a >> 23];
    for (size_t f = 0; f < ranges.size(); ++f) {
      const RangeBits& r = ranges[f];
      s.formats[f].overflow += a >= r.overflow_from;
      s.formats[f].underflow += a <= r.underflow_upto;
      s.formats[f].subnormal += a > r.underflow_upto && a < r.normal_from;
    }
  }
  s.count = n;
  s.max_abs = bits_float(max_bits);
  return s;
}

float max_abs(const Tensor& t) {
  if (t.numel() == 0) return 0.0f;
  if (std::optional<TensorStats> on_device = device_stats(t)) return on_device->max_abs;
  const Tensor values = t.detach().to(DType::Float32).cpu().contiguous();
  const auto* bits = reinterpret_cast<const uint32_t*>(values.data<float>());
  uint32_t max_bits = 0;
  for (int64_t i = 0, n = values.numel(); i < n; ++i) {
    const uint32_t a = bits[i] & 0x7fffffffu;
    if (a < 0x7f800000u) max_bits = std::max(max_bits, a);
  }
  return bits_float(max_bits);
}

bool all_finite(const Tensor& t) {
  if (t.numel() == 0) return true;
  // The fused inf/NaN pass of the mixed-precision step, on the tensor's device: no float32 copy.
  if (const DType d = t.dtype(); d == DType::Float32 || d == DType::Float16 || d == DType::BFloat16) {
    const Tensor values = t.detach().contiguous().reshape({-1});
    Tensor found = zeros({}, DType::Int32, t.device());
    kernels::unscale_check_kernel(t.device())(values, values, 1.0f, found);
    return found.item() == 0;
  }
  const Tensor values = t.detach().to(DType::Float32).cpu().contiguous();
  const auto* bits = reinterpret_cast<const uint32_t*>(values.data<float>());
  uint32_t worst = 0;
  for (int64_t i = 0, n = values.numel(); i < n; ++i) worst = std::max(worst, bits[i] & 0x7fffffffu);
  return worst < 0x7f800000u;
}

}  // namespace booster::diagnostics
