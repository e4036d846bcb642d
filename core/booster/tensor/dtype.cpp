#include "booster/tensor/dtype.h"

#include <algorithm>
#include <cctype>

namespace booster {

DType dtype_from_string(const std::string& raw) {
  std::string s = raw;
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  if (s == "float64" || s == "double" || s == "fp64") return DType::Float64;
  if (s == "float32" || s == "float" || s == "fp32") return DType::Float32;
  if (s == "float16" || s == "half" || s == "fp16") return DType::Float16;
  if (s == "bfloat16" || s == "bf16") return DType::BFloat16;
  if (s == "int64" || s == "long") return DType::Int64;
  if (s == "int32" || s == "int") return DType::Int32;
  if (s == "bool") return DType::Bool;
  if (s == "float8_e4m3fn" || s == "e4m3fn" || s == "e4m3" || s == "fp8_e4m3") return DType::Float8E4M3FN;
  if (s == "float8_e5m2" || s == "e5m2" || s == "fp8_e5m2") return DType::Float8E5M2;
  BOOSTER_FAIL(DTypeError, "unknown dtype '", raw,
               "'; expected one of float64, float32, float16, bfloat16, int64, int32, bool, float8_e4m3fn, "
               "float8_e5m2");
}

namespace detail {
void fail_dtype(const char* op, DType t) {
  if (is_float8(t))
    BOOSTER_FAIL(DTypeError, op, ": not supported for ", t,
                 " (float8 tensors hold data only: convert with .to(DType::Float32) or to bfloat16 first)");
  BOOSTER_FAIL(DTypeError, op, ": not supported for ", t);
}
}  // namespace detail

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  BOOSTER_CHECK(!is_float8(a) && !is_float8(b), DTypeError, "no type promotion between ", a, " and ", b,
                ": convert the float8 tensor with .to() first");
  auto rank = [](DType t) {
    switch (t) {
      case DType::Bool: return 0;
      case DType::Int32: return 1;
      case DType::Int64: return 2;
      case DType::Float16:
      case DType::BFloat16: return 3;
      case DType::Float32: return 4;
      case DType::Float64: return 5;
      case DType::Float8E4M3FN:
      case DType::Float8E5M2: return -1;  // refused above
    }
    return 0;
  };
  if (is_low_precision(a) && is_low_precision(b)) return DType::Float32;  // float16 + bfloat16
  return rank(a) >= rank(b) ? a : b;
}

Device device_from_string(const std::string& s) {
  if (s == "cpu") return Device::cpu();
  if (s == "cuda") return Device::cuda(0);
  if (s.rfind("cuda:", 0) == 0) {
    try {
      size_t used = 0;
      int idx = std::stoi(s.substr(5), &used);
      if (used == s.size() - 5 && idx >= 0) return Device::cuda(idx);
    } catch (const std::exception&) {
    }
  }
  BOOSTER_FAIL(DeviceError, "unknown device '", s, "'; expected cpu, cuda or cuda:N");
}

}  // namespace booster
