// The CUDA backend's public face: whether it was compiled in, whether a GPU is there, and the typed
// error every failed CUDA, cuBLAS or NCCL call throws. Safe to call in any build and on any machine:
// without CUDA compiled in, or without a driver or GPU, is_available() is false and device_count() 0.
#pragma once

#include <cstdint>
#include <string>

#include "booster/common/error.h"

namespace booster {

// A failed CUDA runtime or cuBLAS call; the message names the call, its error and file:line.
// (NCCL failures throw DistributedError, as MPI failures do.)
class CudaError : public DeviceError {
 public:
  using DeviceError::DeviceError;
};

namespace cuda {

// True when this build has the CUDA backend.
bool is_compiled();
// Number of visible GPUs (0 without CUDA, driver or device; never throws).
int device_count();
inline bool is_available() { return device_count() > 0; }
// The reason no GPU is usable ("" when one is): for messages and skipped tests.
std::string unavailable_reason();
// "NVIDIA H100 80GB HBM3" or "" when there is none.
std::string device_name(int index = 0);
// The backend's stream of device `index` as an opaque cudaStream_t (for code outside the backend that
// queues work on it, such as the NCCL process group); makes `index` the current device.
void* stream_handle(int index = 0);
// Blocks until all work queued on the backend's stream of `index` has finished.
void synchronize(int index = 0);
// Bytes held by live CUDA storages, the peak since the last reset, and bytes cached in free lists.
size_t bytes_in_use();
size_t peak_bytes();
void reset_peak_bytes();
size_t cached_bytes();
// Bytes the caching allocator holds from cudaMalloc (in use and cached) and their peak since the last
// reset_peak_bytes() (which resets both peaks), as torch.cuda.memory_reserved / max_memory_reserved.
size_t reserved_bytes();
size_t peak_reserved_bytes();
// The kernel-family time table gathered under BOOSTER_CUDA_PROFILE=1 (Note [CUDA kernel profile]),
// largest first, and a reset.
std::string profile_report();
void reset_profile();
// Lets float32 GEMMs use TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32). Off by default,
// as in PyTorch since 1.12.
void set_allow_tf32(bool allow);
bool allow_tf32();
// How many float8 GEMMs (float8_mm) cuBLASLt's float8 kernels have run in this process; the others
// fell back to the dequantized float32 GEMM (tests check which path ran).
int64_t float8_gemm_count();

}  // namespace cuda
}  // namespace booster
