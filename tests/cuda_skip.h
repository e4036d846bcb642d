// How a CUDA test stands down on a machine without a usable GPU: it records why (skip_test, so
// CTest reports it as Skipped with the reason) and returns.
#pragma once

#include <catch2/catch.hpp>

#include "booster/backends/cuda/cuda.h"
#include "skip.h"

namespace testing {

inline bool skip_without_gpu() {
  namespace cuda = booster::cuda;
  if (cuda::is_available()) return false;
  skip_test(cuda::is_compiled() ? cuda::unavailable_reason() : "no CUDA backend in this build");
  return true;
}

}  // namespace testing
