// The per-device-type counters of memory_stats.h, read from the CPU allocator (storage.cpp) and the
// CUDA caching allocator (backends/cuda/runtime.cu, zeros in a build without CUDA).
#include "booster/tensor/memory_stats.h"

#include "booster/backends/cuda/cuda.h"
#include "booster/tensor/storage.h"

namespace booster {

MemoryStats memory_stats(DeviceType device) {
  MemoryStats m;
  if (device == DeviceType::CUDA) {
    m.in_use = int64_t(cuda::bytes_in_use());
    m.peak = int64_t(cuda::peak_bytes());
    m.reserved = int64_t(cuda::reserved_bytes());
    m.peak_reserved = int64_t(cuda::peak_reserved_bytes());
  } else {
    m.in_use = int64_t(cpu_bytes_in_use());
    m.peak = int64_t(cpu_peak_bytes());
  }
  return m;
}

void reset_peak_memory_stats(DeviceType device) {
  if (device == DeviceType::CUDA) cuda::reset_peak_bytes();
  else reset_cpu_peak_bytes();
}

}  // namespace booster
