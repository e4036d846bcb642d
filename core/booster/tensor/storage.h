// Storage: one reference-counted allocation on one device. Tensors are views into it.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

#include "booster/tensor/dtype.h"

namespace booster {

struct DeferredInit;  // booster/tensor/deferred.h

// Each device type registers one allocator. The CPU one caches freed blocks by size so training
// loops, which allocate the same shapes every step, stop calling malloc after the first step.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t nbytes) = 0;
  virtual void deallocate(void* p, size_t nbytes) = 0;
  // The same on device `index` of this allocator's device type; allocators of one device (the CPU)
  // ignore the index. Storage calls these, so a CUDA allocator knows which GPU a block belongs to.
  virtual void* allocate_on(int index, size_t nbytes) { return allocate(nbytes); }
  virtual void deallocate_on(int index, void* p, size_t nbytes) { deallocate(p, nbytes); }
  // Copies between this device and host memory; same-device copies when both are on the device.
  virtual void copy_to_host(void* dst, const void* src, size_t nbytes) = 0;
  virtual void copy_from_host(void* dst, const void* src, size_t nbytes) = 0;
  virtual void copy_device(void* dst, const void* src, size_t nbytes) = 0;
  virtual void memset_zero(void* dst, size_t nbytes) = 0;
  // Returns cached blocks to the system.
  virtual void empty_cache() {}
};

Allocator& allocator_for(Device d);
void register_allocator(DeviceType t, Allocator* a);
bool has_allocator(DeviceType t);

// Bytes currently held by live CPU storages and the peak since the last reset (for memory benchmarks).
size_t cpu_bytes_in_use();
size_t cpu_peak_bytes();
void reset_cpu_peak_bytes();

class Storage {
 public:
  // Allocates nbytes on device (uninitialized).
  Storage(size_t nbytes, Device device);
  // Holds no memory until first used (Note [Deferred storage] in deferred.cpp).
  struct Deferred {};
  Storage(size_t nbytes, Device device, Deferred);
  // Wraps memory owned elsewhere; `release` runs when the last view goes away.
  Storage(void* data, size_t nbytes, Device device, std::function<void(void*)> release);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  // StateError while released (Note [Released storage]); a deferred storage is allocated and filled.
  void* data() const {
    if (released_) [[unlikely]]
      return on_released();
    return data_;
  }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

  // Note [Released storage]: ZeRO-3 keeps a module's parameters as views of one storage whose memory
  // exists only while the module runs. release() gives the memory back to the allocator; the Storage
  // and every view of it live on, and any read or write through them is a StateError until
  // materialize() allocates it again (uninitialized: the owner fills it). Only memory from the
  // allocator can be released (StateError for wrapped memory). Neither is thread-safe.
  // A deferred storage is materialized with its recorded values, and released without them.
  void release();
  void materialize();
  bool released() const { return released_; }

  // Not allocated yet; allocated (and filled from deferred_init(), if any) on first use.
  bool deferred() const { return deferred_; }
  const std::shared_ptr<const DeferredInit>& deferred_init() const { return init_; }
  void set_deferred_init(std::shared_ptr<const DeferredInit> init);

 private:
  void* on_released() const;
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
  std::function<void(void*)> release_;  // empty: memory came from allocator_for(device_)
  bool released_ = false;
  bool deferred_ = false;
  std::shared_ptr<const DeferredInit> init_;
};

}  // namespace booster
