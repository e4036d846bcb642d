// The oneDNN path where the build has no oneDNN (libdnnl-dev not installed): never taken.
#include "booster/backends/onednn/onednn.h"

namespace booster::onednn {

bool built() { return false; }
bool bf16_gemm_enabled() { return false; }
bool set_bf16_gemm(bool) { return false; }
std::string bf16_gemm_description() {
  return "widened to float32 (OpenBLAS sgemm); this build has no oneDNN (install libdnnl-dev and rebuild)";
}
bool gemm_bf16(const kernels::GemmOperand&, const kernels::GemmOperand&, void*, int64_t, int64_t, int64_t, int64_t,
               int64_t, int64_t, double, double) {
  return false;
}

}  // namespace booster::onednn
