// Element types, devices, and the dispatch macros that turn a runtime dtype into a C++ type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>

#include "booster/common/error.h"
#include "booster/tensor/float8.h"
#include "booster/tensor/half.h"

namespace booster {

// Float8E4M3FN and Float8E5M2 hold data only (Note [Float8 formats]).
enum class DType : uint8_t { Float64, Float32, Float16, BFloat16, Int64, Int32, Bool, Float8E4M3FN, Float8E5M2 };
inline constexpr int kNumDTypes = 9;

inline constexpr size_t itemsize(DType t) {
  switch (t) {
    case DType::Float64:
    case DType::Int64: return 8;
    case DType::Float32:
    case DType::Int32: return 4;
    case DType::Float16:
    case DType::BFloat16: return 2;
    case DType::Bool:
    case DType::Float8E4M3FN:
    case DType::Float8E5M2: return 1;
  }
  return 0;
}

inline constexpr const char* dtype_name(DType t) {
  switch (t) {
    case DType::Float64: return "float64";
    case DType::Float32: return "float32";
    case DType::Float16: return "float16";
    case DType::BFloat16: return "bfloat16";
    case DType::Int64: return "int64";
    case DType::Int32: return "int32";
    case DType::Bool: return "bool";
    case DType::Float8E4M3FN: return "float8_e4m3fn";
    case DType::Float8E5M2: return "float8_e5m2";
  }
  return "?";
}

// Parses "float32", "fp32", "float", "half", "fp16", "bf16", "float8_e4m3fn", "e5m2", ...; throws
// DTypeError naming the choices.
DType dtype_from_string(const std::string& s);

inline constexpr bool is_floating(DType t) {
  return t == DType::Float64 || t == DType::Float32 || t == DType::Float16 || t == DType::BFloat16;
}
inline constexpr bool is_low_precision(DType t) { return t == DType::Float16 || t == DType::BFloat16; }
// The float8 storage types. They are not is_floating: no op computes in them.
inline constexpr bool is_float8(DType t) { return t == DType::Float8E4M3FN || t == DType::Float8E5M2; }

// Type promotion as PyTorch does for tensor-tensor ops: floating beats integral beats bool; among
// floats the wider wins, and float16 with bfloat16 gives float32. A float8 dtype promotes only with
// itself (DTypeError otherwise, as PyTorch).
DType promote_types(DType a, DType b);

inline std::ostream& operator<<(std::ostream& os, DType t) { return os << dtype_name(t); }

template <class T> struct dtype_of;
template <> struct dtype_of<double> { static constexpr DType value = DType::Float64; };
template <> struct dtype_of<float> { static constexpr DType value = DType::Float32; };
template <> struct dtype_of<Half> { static constexpr DType value = DType::Float16; };
template <> struct dtype_of<BFloat16> { static constexpr DType value = DType::BFloat16; };
template <> struct dtype_of<int64_t> { static constexpr DType value = DType::Int64; };
template <> struct dtype_of<int32_t> { static constexpr DType value = DType::Int32; };
template <> struct dtype_of<bool> { static constexpr DType value = DType::Bool; };
template <> struct dtype_of<Float8E4M3FN> { static constexpr DType value = DType::Float8E4M3FN; };
template <> struct dtype_of<Float8E5M2> { static constexpr DType value = DType::Float8E5M2; };

// The type kernels compute in: float32 for the 8- and 16-bit floats and float32, float64 for float64.
template <class T> struct acc_type { using type = T; };
template <> struct acc_type<Half> { using type = float; };
template <> struct acc_type<BFloat16> { using type = float; };
template <> struct acc_type<Float8E4M3FN> { using type = float; };
template <> struct acc_type<Float8E5M2> { using type = float; };
template <class T> using acc_t = typename acc_type<T>::type;

enum class DeviceType : uint8_t { CPU = 0, CUDA = 1 };
inline constexpr int kNumDeviceTypes = 2;

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  static Device cpu() { return {DeviceType::CPU, 0}; }
  static Device cuda(int i = 0) { return {DeviceType::CUDA, i}; }
  bool is_cpu() const { return type == DeviceType::CPU; }
  bool is_cuda() const { return type == DeviceType::CUDA; }
  bool operator==(const Device&) const = default;
  std::string str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }
};
// "cpu", "cuda", "cuda:1"
Device device_from_string(const std::string& s);

namespace detail {
// The DTypeError of a dispatch that has no case for `t` (for float8: how to compute with it).
[[noreturn]] void fail_dtype(const char* op, DType t);
}  // namespace detail
inline std::ostream& operator<<(std::ostream& os, const Device& d) { return os << d.str(); }

}  // namespace booster

// BOOSTER_DISPATCH_*(dtype, "op", [&] { ... scalar_t ... }) runs the lambda with scalar_t bound.
#define BOOSTER_DTYPE_CASE(enum_value, T, ...) \
  case ::booster::DType::enum_value: {         \
    using scalar_t = T;                        \
    return __VA_ARGS__();                      \
  }

#define BOOSTER_DISPATCH_FLOATING(dtype, opname, ...)                                             \
  [&] {                                                                                           \
    switch (dtype) {                                                                              \
      BOOSTER_DTYPE_CASE(Float32, float, __VA_ARGS__)                                             \
      BOOSTER_DTYPE_CASE(Float64, double, __VA_ARGS__)                                            \
      BOOSTER_DTYPE_CASE(Float16, ::booster::Half, __VA_ARGS__)                                   \
      BOOSTER_DTYPE_CASE(BFloat16, ::booster::BFloat16, __VA_ARGS__)                              \
      default:                                                                                    \
        BOOSTER_FAIL(DTypeError, opname, ": expected a floating dtype (float64, float32, float16, " \
                     "bfloat16), got ", dtype);                                                   \
    }                                                                                             \
  }()

#define BOOSTER_DISPATCH_ALL(dtype, opname, ...)                    \
  [&] {                                                             \
    switch (dtype) {                                                \
      BOOSTER_DTYPE_CASE(Float32, float, __VA_ARGS__)               \
      BOOSTER_DTYPE_CASE(Float64, double, __VA_ARGS__)              \
      BOOSTER_DTYPE_CASE(Float16, ::booster::Half, __VA_ARGS__)     \
      BOOSTER_DTYPE_CASE(BFloat16, ::booster::BFloat16, __VA_ARGS__) \
      BOOSTER_DTYPE_CASE(Int64, int64_t, __VA_ARGS__)               \
      BOOSTER_DTYPE_CASE(Int32, int32_t, __VA_ARGS__)               \
      BOOSTER_DTYPE_CASE(Bool, bool, __VA_ARGS__)                   \
      default: break;                                               \
    }                                                               \
    ::booster::detail::fail_dtype(opname, dtype);                   \
  }()

// Every dtype, the float8 storage types included (copies and moves).
#define BOOSTER_DISPATCH_STORAGE(dtype, opname, ...)                    \
  [&] {                                                                 \
    switch (dtype) {                                                    \
      BOOSTER_DTYPE_CASE(Float8E4M3FN, ::booster::Float8E4M3FN, __VA_ARGS__) \
      BOOSTER_DTYPE_CASE(Float8E5M2, ::booster::Float8E5M2, __VA_ARGS__) \
      default: return BOOSTER_DISPATCH_ALL(dtype, opname, __VA_ARGS__); \
    }                                                                   \
  }()

#define BOOSTER_DISPATCH_INDEX(dtype, opname, ...)                                          \
  [&] {                                                                                     \
    switch (dtype) {                                                                        \
      BOOSTER_DTYPE_CASE(Int64, int64_t, __VA_ARGS__)                                       \
      BOOSTER_DTYPE_CASE(Int32, int32_t, __VA_ARGS__)                                       \
      default:                                                                              \
        BOOSTER_FAIL(DTypeError, opname, ": expected an index dtype (int64 or int32), got ", \
                     dtype);                                                                \
    }                                                                                       \
  }()
