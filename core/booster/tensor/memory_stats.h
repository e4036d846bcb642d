// Live tensor memory of this process, per device type: what the allocators count as they hand out and
// take back storage, and the high-water mark since the last reset (torch.cuda.memory_stats and
// reset_peak_memory_stats do the same for CUDA). The Trainer writes the peaks into metrics.jsonl and
// the run's summary (Note [Peak memory of a run] in trainer.cpp).
#pragma once

#include <cstdint>

#include "booster/tensor/dtype.h"

namespace booster {

// Bytes as the allocator hands them out: a request rounds up to the allocator's block size (64 bytes
// on the CPU; on CUDA 512 bytes up to 1 MiB and 2 MiB above), so an n-byte tensor counts its rounded
// size. Counters are per process and per device type (every GPU of a process together).
struct MemoryStats {
  int64_t in_use = 0;         // held by live storages now
  int64_t peak = 0;           // the most held at once since the last reset
  int64_t reserved = 0;       // CUDA: held from cudaMalloc (in use + cached); 0 on the CPU
  int64_t peak_reserved = 0;  // CUDA: its peak since the last reset; 0 on the CPU
};

MemoryStats memory_stats(DeviceType device);
// The peaks become what is held now.
void reset_peak_memory_stats(DeviceType device);

}  // namespace booster
