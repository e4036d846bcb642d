// What the precision doctor measures of one tensor: its largest magnitude, how many of its values are
// not finite or zero, how many would overflow or underflow in each 16- and 8-bit float format, and a
// histogram of their binary exponents. Statistics of several tensors (one module over several steps)
// merge by adding.
//
// Note [Range of a format]
// A value x is judged by what rounding it to the format (nearest, ties to even, not saturating) gives:
//   overflow   the result is infinite or NaN (e4m3fn has no infinity: above 464 it is NaN);
//   underflow  x is not zero but the result is (|x| at most half the smallest subnormal);
//   subnormal  the result is not zero but below the smallest normal number (precision is being lost).
// Rounding is monotone in |x|, so each class is a range of |x| whose ends are found once per format by
// bisection over the float32 bit patterns with the library's own converters, and a tensor is then
// classified by comparing the bits of |x| (as unsigned integers, which order as the magnitudes do).
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "booster/tensor/tensor.h"

namespace booster::diagnostics {

enum class Format : uint8_t { Float16, BFloat16, E4M3, E5M2 };
inline constexpr int kNumFormats = 4;
inline constexpr std::array<Format, kNumFormats> kFormats{Format::Float16, Format::BFloat16, Format::E4M3,
                                                          Format::E5M2};
// "float16", "bfloat16", "e4m3", "e5m2"
const char* format_name(Format format);
// The largest finite value of the format.
float format_max(Format format);

// The magnitudes that land in each class of Note [Range of a format], as float32 values.
struct FormatRange {
  float overflow_from;   // |x| >= this overflows
  float underflow_upto;  // 0 < |x| <= this becomes zero
  float normal_from;     // underflow_upto < |x| < this is subnormal
};
const FormatRange& format_range(Format format);

struct FormatCounts {
  int64_t overflow = 0;
  int64_t underflow = 0;
  int64_t subnormal = 0;
};

struct TensorStats {
  // Bins of the float32 exponent field: bin e holds the finite nonzero values with floor(log2|x|) =
  // e - 127, bin 0 the float32 subnormals (below 2^-126).
  static constexpr int kExponentBins = 255;

  int64_t count = 0;      // values seen
  int64_t nonfinite = 0;  // inf or NaN
  int64_t zeros = 0;
  float max_abs = 0.0f;   // of the finite values
  std::array<FormatCounts, kNumFormats> formats{};
  std::array<int64_t, kExponentBins> exponents{};

  void merge(const TensorStats& other);
  bool empty() const { return count == 0; }
  const FormatCounts& in(Format format) const { return formats[size_t(format)]; }
  // {"count", "max_abs", "nonfinite", "zeros", "float16": {"overflow", "underflow", "subnormal"} as
  // fractions of count, ..., "exponents": {"min": e, "counts": [...]}} with the histogram trimmed to
  // its nonzero bins (e = floor(log2|x|) of the first; -127 stands for every float32 subnormal).
  nlohmann::json to_json() const;
};

// The statistics of a tensor of any floating dtype on any device (read as float32 on the CPU).
TensorStats tensor_stats(const Tensor& t);
// The largest finite magnitude of a floating tensor (0 for an empty one).
float max_abs(const Tensor& t);
// True when no value of the floating tensor is inf or NaN.
bool all_finite(const Tensor& t);

}  // namespace booster::diagnostics
