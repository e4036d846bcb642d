#include "booster/booster/build_info.h"

#include "booster/backends/cuda/cuda.h"
#include "booster/backends/onednn/onednn.h"
#include "booster/common/cpu_features.h"

namespace booster {

nlohmann::json build_info() {
  nlohmann::json cuda_info;
  cuda_info["compiled"] = cuda::is_compiled();
  const int n = cuda::device_count();
  cuda_info["device_count"] = n;
  nlohmann::json names = nlohmann::json::array();
  for (int i = 0; i < n; ++i) names.push_back(cuda::device_name(i));
  cuda_info["devices"] = names;
  cuda_info["reason"] = cuda::unavailable_reason();
#if defined(BOOSTER_WITH_NCCL)
  const bool nccl = true;
#else
  const bool nccl = false;
#endif
#if defined(BOOSTER_WITH_MPI)
  const bool mpi = true;
#else
  const bool mpi = false;
#endif
  return {{"cuda", cuda_info},
          {"nccl", nccl},
          {"mpi", mpi},
          {"cpu_kernels", cpu::isa_description()},
          {"bf16_gemm", onednn::bf16_gemm_description()},
          {"conv", onednn::conv_description()}};
}

std::string build_info_line() {
  const nlohmann::json info = build_info();
  const auto& c = info["cuda"];
  std::string line = "CUDA: ";
  if (!c["compiled"].get<bool>()) {
    line += "not compiled in";
  } else {
    const int n = c["device_count"].get<int>();
    line += "compiled in, ";
    if (n == 0) {
      line += "no device (" + c["reason"].get<std::string>() + ")";
    } else {
      line += std::to_string(n) + (n == 1 ? " device (" : " devices (");
      for (int i = 0; i < n; ++i) line += (i ? ", " : "") + c["devices"][size_t(i)].get<std::string>();
      line += ")";
    }
  }
  line += std::string("; NCCL: ") + (info["nccl"].get<bool>() ? "yes" : "no");
  line += std::string("; MPI: ") + (info["mpi"].get<bool>() ? "yes" : "no");
  return line;
}

}  // namespace booster
