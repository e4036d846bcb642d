// CPU float8 quantize/dequantize (kernels/float8.h): real rounding to the OCP formats, element by
// element through the scalar conversions of tensor/float8.h (numerics first; the CPU path emulates
// what fp8 GEMMs on a GPU see).
#include "booster/backends/cpu/convert.h"
#include "booster/backends/cpu/loops.h"
#include "booster/kernels/float8.h"

namespace booster::cpu {
namespace {

// Decoding is a lookup: 256 values per format, built once from the exact conversions.
struct DecodeTable {
  float value[256];
  explicit DecodeTable(float (*decode)(uint8_t)) {
    for (int b = 0; b < 256; ++b) value[b] = decode(uint8_t(b));
  }
};

template <class F>
void dispatch_float8(DType t, const char* op, F&& f) {
  static const DecodeTable e4m3(&fp8::e4m3fn_to_float), e5m2(&fp8::e5m2_to_float);
  switch (t) {
    case DType::Float8E4M3FN:
      return f([](float v, bool sat) { return fp8::float_to_e4m3fn(v, sat); }, e4m3.value);
    case DType::Float8E5M2: return f([](float v, bool sat) { return fp8::float_to_e5m2(v, sat); }, e5m2.value);
    default: BOOSTER_FAIL(DTypeError, op, ": expected float8_e4m3fn or float8_e5m2, got ", t);
  }
}

void cpu_float8_quantize(const Tensor& src, Tensor& dst, float scale, bool saturate) {
  uint8_t* d = static_cast<uint8_t*>(dst.data_ptr());
  dispatch_float8(dst.dtype(), "to_float8", [&](auto encode, auto) {
    BOOSTER_DISPATCH_FLOATING(src.dtype(), "to_float8", [&] {
      const scalar_t* s = src.data<scalar_t>();
      parallel_for(src.numel(), 2, [&](int64_t b, int64_t e) {
        float block[kConvertBlock];
        for (int64_t i0 = b; i0 < e; i0 += kConvertBlock) {
          const int64_t m = std::min(kConvertBlock, e - i0);
          load_block(s + i0, block, m);
          for (int64_t i = 0; i < m; ++i) d[i0 + i] = encode(block[i] * scale, saturate);
        }
      });
    });
  });
}

void cpu_float8_dequantize(const Tensor& src, Tensor& dst, float scale_inv) {
  const uint8_t* s = static_cast<const uint8_t*>(src.data_ptr());
  dispatch_float8(src.dtype(), "from_float8", [&](auto, auto decode) {
    BOOSTER_DISPATCH_FLOATING(dst.dtype(), "from_float8", [&] {
      scalar_t* d = dst.data<scalar_t>();
      parallel_for(src.numel(), 2, [&](int64_t b, int64_t e) {
        float block[kConvertBlock];
        for (int64_t i0 = b; i0 < e; i0 += kConvertBlock) {
          const int64_t m = std::min(kConvertBlock, e - i0);
          for (int64_t i = 0; i < m; ++i) block[i] = decode[s[i0 + i]] * scale_inv;
          store_block(block, d + i0, m);
        }
      });
    });
  });
}

}  // namespace
}  // namespace booster::cpu

namespace booster::kernels {
BOOSTER_REGISTER_CPU_KERNEL(float8_quantize_kernel, &cpu::cpu_float8_quantize);
BOOSTER_REGISTER_CPU_KERNEL(float8_dequantize_kernel, &cpu::cpu_float8_dequantize);
}  // namespace booster::kernels
