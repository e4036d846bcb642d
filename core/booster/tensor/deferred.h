// Deferred (lazy) initialization: building a model without allocating its weights, so that a plugin
// that splits it across ranks (hybrid_parallel) allocates only this rank's part, after ColossalAI's
// LazyInitContext and PyTorch's deferred init. Note [Deferred storage] in deferred.cpp.
//
//   std::shared_ptr<nn::GPT> model;
//   {
//     booster::LazyInitGuard lazy;                  // tensors made here take no memory yet
//     model = std::make_shared<nn::GPT>(config, seed);
//   }
//   auto optimizer = std::make_shared<optim::AdamW>(model->parameters(), options);
//   booster.boost(model, optimizer, ...);            // only this rank's part is allocated
//
// The values are those the same code gives without the guard, bit for bit, and the generators end in
// the same state. A deferred tensor allocates and fills itself on first use, so code that touches the
// whole model still works: it only loses the saving.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <vector>

#include "booster/tensor/random.h"
#include "booster/tensor/tensor.h"

namespace booster {

// While one is alive on this thread, Tensor::empty (and every creation op built on it: zeros, ones,
// full, a module's parameters) returns tensors whose memory is deferred. Guards nest.
class LazyInitGuard {
 public:
  LazyInitGuard();
  ~LazyInitGuard();
  LazyInitGuard(const LazyInitGuard&) = delete;
  LazyInitGuard& operator=(const LazyInitGuard&) = delete;
  static bool enabled();

 private:
  bool previous_;
};

// While one is alive on this thread, deferred tensors stand for their shapes only, for code that counts
// or splits a model without using its values (`booster check`, config/model_check.cpp): a random
// initialization records zeros and draws nothing (the generator does not move), and select_ranges of a
// deferred tensor is a deferred tensor of the slice's shape, so a model of any size is split without
// memory. Use it inside a LazyInitGuard; never for a model that trains.
class ShapesOnlyGuard {
 public:
  ShapesOnlyGuard();
  ~ShapesOnlyGuard();
  ShapesOnlyGuard(const ShapesOnlyGuard&) = delete;
  ShapesOnlyGuard& operator=(const ShapesOnlyGuard&) = delete;

 private:
  bool previous_;
};

// One tensor of a safetensors file, read when the deferred tensor it stands for is allocated (Note
// [Weights from a file] in deferred.cpp). The file's header is the caller's to have checked.
struct DeferredFileTensor {
  std::filesystem::path path;
  uint64_t offset = 0;           // absolute offset of the tensor's first byte in the file
  DType dtype = DType::Float32;  // as stored: Float32, Float16 or BFloat16
  Shape shape;                   // as stored
  // A 2-D tensor stored as its transpose (GPT-2's Conv1D weights, [in, out] for a Linear's [out, in]):
  // element (r, c) of the tensor is element (c, r) of the file's.
  bool transposed = false;
};

// How a deferred storage's values are made when it is allocated: a constant, draws from a generator
// in row-major order (the generator's state when the draws were made), or a tensor of a file, converted
// to `dtype`.
struct DeferredInit {
  enum class Kind { Fill, Uniform, Normal, File };
  Kind kind = Kind::Fill;
  double a = 0.0, b = 0.0;  // Fill: value; Uniform: [low, high); Normal: mean, std
  Generator generator;
  DType dtype = DType::Float32;
  std::shared_ptr<const DeferredFileTensor> file;  // File only
};

// True when t's memory is not allocated yet (made under a LazyInitGuard and not used since).
bool is_deferred(const Tensor& t);
// Allocates and fills a deferred tensor's storage now; nothing for any other tensor.
void materialize(const Tensor& t);

// Record t's values when t is deferred and spans its whole storage: a constant (defer_fill), or draws
// from `gen`, which moves past them now (without making them) exactly as the eager fill moves it.
// False otherwise: the caller fills t eagerly. Used by
// init::uniform_/normal_ and Tensor::fill_.
bool defer_fill(const Tensor& t, double value);
bool defer_uniform(const Tensor& t, double low, double high, Generator& gen);
bool defer_normal(const Tensor& t, double mean, double std, Generator& gen);

// Record that a deferred t spanning its storage holds `source` (a tensor of a file, of t's numel and,
// transposes undone, t's shape): nothing is read now, and allocating t, or select_ranges of it, reads
// only the bytes it needs. False when t is not such a tensor (the caller reads the file eagerly).
bool defer_from_file(const Tensor& t, DeferredFileTensor source);

// Forgets the recorded values of a deferred t spanning its storage (t is about to be overwritten whole).
void discard_deferred_values(const Tensor& t);
// t on `device`, still deferred with the same recorded values, when t is deferred and spans its
// storage; an undefined tensor otherwise (Tensor::to copies then).
Tensor deferred_to(const Tensor& t, Device device);

// Elements [start, start + dst.numel()) of t in row-major order, written into `dst` (1-D, contiguous,
// any floating dtype and device) as copying them through t's dtype would write them; for a deferred
// tensor spanning its storage, made from its initializer without allocating the whole (a file's tensor
// reads only those elements), in chunks, so the staging memory stays small whatever the span.
void copy_span(const Tensor& t, int64_t start, const Tensor& dst);

// A digest of the values a deferred t spanning its storage will take (its initializer: kind, constants,
// generator state; or the file tensor's name, offset, dtype, shape and layout), so that ranks can check
// they recorded the same values without making them. 0 for any other tensor.
uint64_t deferred_digest(const Tensor& t);

// Elements [start, start + length) along `dim` for each start (ranges that do not overlap),
// concatenated along `dim`, as a new contiguous tensor; for a deferred tensor spanning its storage,
// made from its initializer without allocating the whole. Anything else: the same from the values.
Tensor select_ranges(const Tensor& t, int64_t dim, const std::vector<int64_t>& starts, int64_t length);

}  // namespace booster
