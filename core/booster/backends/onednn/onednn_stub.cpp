// The oneDNN paths where the build has no oneDNN (libdnnl-dev not installed): never taken.
#include "booster/backends/onednn/onednn.h"

namespace booster::onednn {

bool built() { return false; }
bool bf16_gemm_enabled() { return false; }
bool set_bf16_gemm(bool) { return false; }
std::string bf16_gemm_description() {
  return "widened to float32 (OpenBLAS sgemm); this build has no oneDNN (install libdnnl-dev and rebuild)";
}
bool gemm_bf16(const kernels::GemmOperand&, const kernels::GemmOperand&, void*, int64_t, int64_t, int64_t, int64_t,
               int64_t, int64_t, double, double, bool) {
  return false;
}

bool conv_enabled() { return false; }
bool conv_bf16_enabled() { return false; }
bool set_conv(bool) { return false; }
std::string conv_description() {
  return "gather + GEMM; this build has no oneDNN (install libdnnl-dev and rebuild)";
}
bool conv_forward(const ConvShape&, ConvType, const void*, const void*, const void*, void*) { return false; }
bool conv_backward_data(const ConvShape&, ConvType, const void*, const void*, void*) { return false; }
bool conv_backward_weights(const ConvShape&, ConvType, const void*, const void*, void*, void*) { return false; }
int64_t max_pool_workspace_bytes(const ConvShape&, ConvType) { return -1; }
bool max_pool_forward(const ConvShape&, ConvType, const void*, void*, void*) { return false; }
bool max_pool_backward(const ConvShape&, ConvType, const void*, const void*, void*) { return false; }

}  // namespace booster::onednn
