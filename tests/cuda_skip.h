// How a CUDA test stands down on a machine without a usable GPU: it says why (Catch2 WARN, shown in
// the test's output) and passes, so CI without a GPU stays green and the reason stays visible.
#pragma once

#include <catch2/catch.hpp>

#include "booster/backends/cuda/cuda.h"
#include "booster/common/build_info.h"

namespace testing {

inline bool skip_without_gpu() {
  namespace cuda = booster::cuda;
  if (cuda::is_available()) return false;
  WARN("CUDA tests skipped: " << (cuda::is_compiled() ? cuda::unavailable_reason() : "no CUDA backend in this build")
                              << " [" << booster::build_info_line() << "]");
  return true;
}

}  // namespace testing
