// Deferred initialization (deferred.h).
//
// Note [Deferred storage]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Under a LazyInitGuard, Tensor::empty makes a Storage that holds no memory (Storage::deferred()): it
// reads as released, and its first data() allocates it (Storage::materialize). What it holds then is
// decided by the last whole-storage initialization recorded before:
//  * fill_ (zeros, ones, full) records the constant;
//  * init::uniform_/normal_ record a copy of the generator and move the generator past the numbers the
//    eager fill would draw (Generator::skip_uniform/skip_normal: the raw numbers only): it ends where
//    it would have, so every later draw (the next layer's weights, dropout) is unchanged, and replaying
//    the copy gives the values, in the same row-major order, converted to the dtype the same way (a
//    float64 buffer through copy_);
//  * copy_ over the whole storage drops the record (the copy overwrites it anyway).
// Anything else (a view's init, a read, an op) allocates and fills first, then runs eagerly: a deferred
// tensor is always the tensor the eager code would have made, only later.
// select_ranges replays the record streaming, keeping only the elements a shard needs (skipping the
// rest), so a rank that holds a slice of a weight never holds the whole of it; Tensor::to(device) moves
// the record. Under a ShapesOnlyGuard a random init records zeros and leaves the generator alone, and
// select_ranges gives a deferred slice: a model is built and split for its shapes alone. Not
// thread-safe: a deferred tensor is allocated by whichever thread first uses it, so it must not be
// first used by several threads at once (kernels take their pointers before their parallel loops).
//
// Note [Weights from a file]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A pretrained model (nn::load_pretrained, hf.h) is built deferred and each parameter records, instead
// of an initializer, the tensor of a safetensors file it holds (defer_from_file): file, offset, stored
// dtype and shape, and whether it is stored transposed. Allocating it reads the tensor; select_ranges
// (a tensor-parallel shard) reads only the elements the shard keeps, through a read-only mapping of the
// file, so no rank reads, let alone holds, a weight it does not own a part of. F32, F16 and BF16 values
// are exact in float64, so going through float64 to the storage's dtype (copy_'s rounding) gives
// exactly what reading the file eagerly and converting it gives. A file that shrank since its header was
// checked is a CheckpointError naming it, never a read past its end.
#include "booster/tensor/deferred.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>

#include "booster/common/error.h"
#include "booster/common/input_file.h"
#include "booster/tensor/grad_mode.h"
#include "booster/tensor/half.h"

namespace booster {

namespace {

thread_local bool g_lazy = false;
thread_local bool g_shapes_only = false;

// The storage of t when t is deferred and covers all of it (row-major, from its first byte).
Storage* whole_deferred(const Tensor& t) {
  if (!t.defined()) return nullptr;
  Storage* s = t.storage().get();
  if (!s->deferred() || t.offset() != 0 || !t.is_contiguous() || t.nbytes() != s->nbytes()) return nullptr;
  return s;
}

// Moves `gen` past n draws of `kind` without making them (Note [Skipping normals] in random.cpp).
void skip_draws(Generator& gen, DeferredInit::Kind kind, int64_t n) {
  if (kind == DeferredInit::Kind::Normal)
    gen.skip_normal(n);
  else if (kind == DeferredInit::Kind::Uniform)
    gen.skip_uniform(n);
}

// Draws the numbers of `init` one by one, as the eager fill does.
struct Replay {
  explicit Replay(const DeferredInit& init) : init_(init), gen_(init.generator) {}
  double next() {
    switch (init_.kind) {
      case DeferredInit::Kind::Uniform: return init_.a + (init_.b - init_.a) * gen_.uniform();
      case DeferredInit::Kind::Normal: return init_.a + init_.b * gen_.normal();
      case DeferredInit::Kind::Fill:
      case DeferredInit::Kind::File: break;  // File records are read by FileValues
    }
    return init_.a;
  }
  // Moves past n values without making them.
  void skip(int64_t n) { skip_draws(gen_, init_.kind, n); }
  const DeferredInit& init_;
  Generator gen_;
};

// A file tensor's elements in the deferred tensor's row-major order, from a read-only mapping.
class FileValues {
 public:
  FileValues(const DeferredFileTensor& f, int64_t numel) : f_(f) {
    // A FIFO put where the weights were must not block the open (Note [Inputs that are not files]).
    const int fd = open_input_file<CheckpointError>(f.path, "a deferred weight's file", "").release();
    struct stat st {};
    const bool ok = ::fstat(fd, &st) == 0;
    const uint64_t need = f.offset + uint64_t(numel) * itemsize(f.dtype);
    if (!ok || uint64_t(st.st_size) < need) {
      ::close(fd);
      BOOSTER_FAIL(CheckpointError, "cannot read a deferred weight from ", f.path.string(), ": it needs bytes up to ",
                   need, " but the file has ", ok ? uint64_t(st.st_size) : 0, " (changed since it was opened?)");
    }
    size_ = size_t(st.st_size);
    map_ = size_ == 0 ? nullptr : ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    BOOSTER_CHECK(map_ != MAP_FAILED, CheckpointError, "cannot map ", f.path.string(), ": ", std::strerror(errno));
    base_ = static_cast<const uint8_t*>(map_) + f.offset;
    if (f.transposed) rows_ = f.shape.at(1), cols_ = f.shape.at(0);  // the deferred tensor is [rows, cols]
  }
  ~FileValues() {
    if (map_ != nullptr && map_ != MAP_FAILED) ::munmap(map_, size_);
  }
  FileValues(const FileValues&) = delete;
  FileValues& operator=(const FileValues&) = delete;

  // Element i (row-major) of the deferred tensor.
  double at(int64_t i) const {
    if (f_.transposed) i = (i % cols_) * rows_ + i / cols_;
    switch (f_.dtype) {
      case DType::Float16: return half_bits_to_float(load<uint16_t>(i));
      case DType::BFloat16: return bf16_bits_to_float(load<uint16_t>(i));
      default: return load<float>(i);
    }
  }

 private:
  template <typename T>
  T load(int64_t i) const {
    T v;
    std::memcpy(&v, base_ + size_t(i) * sizeof(T), sizeof(T));
    return v;
  }
  const DeferredFileTensor& f_;
  void* map_ = nullptr;
  size_t size_ = 0;
  const uint8_t* base_ = nullptr;
  int64_t rows_ = 0, cols_ = 1;
};

std::shared_ptr<DeferredInit> zeros_record(DType dtype) {
  return std::make_shared<DeferredInit>(DeferredInit{DeferredInit::Kind::Fill, 0.0, 0.0, Generator(), dtype});
}

// A contiguous tensor of `shape` whose storage is deferred, holding `init`'s values when allocated.
Tensor deferred_tensor(const Shape& shape, DType dtype, Device device, std::shared_ptr<const DeferredInit> init) {
  auto impl = std::make_shared<TensorImpl>();
  impl->numel = numel_of(shape);
  impl->storage = std::make_shared<Storage>(size_t(impl->numel) * itemsize(dtype), device, Storage::Deferred{});
  impl->storage->set_deferred_init(std::move(init));
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

bool defer_draws(const Tensor& t, DeferredInit::Kind kind, double a, double b, Generator& gen) {
  Storage* s = whole_deferred(t);
  if (s == nullptr) return false;
  if (g_shapes_only) {  // zeros stand in; the generator stays where it is
    s->set_deferred_init(zeros_record(t.dtype()));
    return true;
  }
  s->set_deferred_init(std::make_shared<DeferredInit>(DeferredInit{kind, a, b, gen, t.dtype()}));
  skip_draws(gen, kind, t.numel());
  return true;
}

// Turns the LazyInitGuard off for its scope: the tensors made while materializing or slicing (the
// result, float64 staging) must be real even when a guard is alive on this thread.
struct EagerScope {
  EagerScope() : previous(g_lazy) { g_lazy = false; }
  ~EagerScope() { g_lazy = previous; }
  bool previous;
};

}  // namespace

LazyInitGuard::LazyInitGuard() : previous_(g_lazy) { g_lazy = true; }
LazyInitGuard::~LazyInitGuard() { g_lazy = previous_; }
ShapesOnlyGuard::ShapesOnlyGuard() : previous_(g_shapes_only) { g_shapes_only = true; }
ShapesOnlyGuard::~ShapesOnlyGuard() { g_shapes_only = previous_; }
bool LazyInitGuard::enabled() { return g_lazy; }

bool is_deferred(const Tensor& t) { return t.defined() && t.storage()->deferred(); }

void materialize(const Tensor& t) {
  if (is_deferred(t)) t.storage()->materialize();
}

bool defer_fill(const Tensor& t, double value) {
  Storage* s = whole_deferred(t);
  if (s == nullptr) return false;
  s->set_deferred_init(std::make_shared<DeferredInit>(DeferredInit{DeferredInit::Kind::Fill, value, 0.0, Generator(), t.dtype()}));
  return true;
}

bool defer_uniform(const Tensor& t, double low, double high, Generator& gen) {
  return defer_draws(t, DeferredInit::Kind::Uniform, low, high, gen);
}

bool defer_normal(const Tensor& t, double mean, double std, Generator& gen) {
  return defer_draws(t, DeferredInit::Kind::Normal, mean, std, gen);
}

bool defer_from_file(const Tensor& t, DeferredFileTensor source) {
  Storage* s = whole_deferred(t);
  if (s == nullptr) return false;
  BOOSTER_CHECK(source.dtype == DType::Float32 || source.dtype == DType::Float16 || source.dtype == DType::BFloat16,
                DTypeError, "defer_from_file: ", source.path.string(), " stores ", source.dtype,
                "; only float32, float16 and bfloat16 weights are read");
  int64_t numel = 1;
  for (int64_t d : source.shape) numel *= d;
  BOOSTER_CHECK(numel == t.numel() && (!source.transposed || source.shape.size() == 2), ShapeError,
                "defer_from_file: the tensor of shape ", source.shape, " in ", source.path.string(),
                source.transposed ? " (transposed)" : "", " cannot fill a tensor of shape ", t.shape());
  auto init = std::make_shared<DeferredInit>();
  init->kind = DeferredInit::Kind::File;
  init->dtype = t.dtype();
  init->file = std::make_shared<const DeferredFileTensor>(std::move(source));
  s->set_deferred_init(std::move(init));
  return true;
}

void discard_deferred_values(const Tensor& t) {
  if (Storage* s = whole_deferred(t)) s->set_deferred_init(nullptr);
}

Tensor deferred_to(const Tensor& t, Device device) {
  Storage* s = whole_deferred(t);
  if (s == nullptr) return Tensor();
  return deferred_tensor(t.shape(), t.dtype(), device, s->deferred_init());
}

Tensor select_ranges(const Tensor& t, int64_t dim, const std::vector<int64_t>& starts, int64_t length) {
  dim = wrap_dim(dim, t.dim(), "select_ranges");
  const int64_t size = t.size(dim);
  std::vector<int64_t> sorted = starts;
  std::sort(sorted.begin(), sorted.end());
  for (size_t k = 0; k < sorted.size(); ++k) {
    const int64_t s = sorted[k];
    BOOSTER_CHECK(s >= 0 && length >= 0 && s + length <= size, IndexError, "select_ranges: [", s, ", ", s + length,
                  ") is outside dim ", dim, " of shape ", t.shape());
    BOOSTER_CHECK(k == 0 || sorted[k - 1] + length <= s, ValueError, "select_ranges: the ranges starting at ",
                  sorted[k - 1], " and ", s, " (length ", length, ") overlap");
  }
  Shape shape = t.shape();
  shape[size_t(dim)] = int64_t(starts.size()) * length;
  if (g_shapes_only && whole_deferred(t) != nullptr) {  // the slice's shape, zeros standing in
    return deferred_tensor(shape, t.dtype(), t.device(), zeros_record(t.dtype()));
  }
  EagerScope eager;
  NoGradGuard no_grad;
  Tensor out = Tensor::empty(shape, t.dtype(), t.device());
  Storage* s = whole_deferred(t);
  if (s == nullptr) {
    for (size_t k = 0; k < starts.size(); ++k) out.narrow(dim, int64_t(k) * length, length).copy_(t.narrow(dim, starts[k], length));
    return out;
  }
  const std::shared_ptr<const DeferredInit>& init = s->deferred_init();
  if (!init) return out;  // never initialized: as uninitialized as the eager tensor
  if (init->kind == DeferredInit::Kind::Fill) {
    out.fill_(init->a);
    return out;
  }
  // Where each index along `dim` lands in the output, or -1.
  std::vector<int64_t> where(size_t(size), -1);
  for (size_t k = 0; k < starts.size(); ++k)
    for (int64_t j = 0; j < length; ++j) where[size_t(starts[k] + j)] = int64_t(k) * length + j;
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= t.size(d);
  for (int64_t d = dim + 1; d < t.dim(); ++d) inner *= t.size(d);
  const int64_t out_size = shape[size_t(dim)];
  Tensor host = Tensor::empty(shape, DType::Float64);
  double* p = host.data<double>();
  if (init->kind == DeferredInit::Kind::File) {  // random access: read only the kept elements
    const FileValues file(*init->file, t.numel());
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t d = 0; d < size; ++d) {
        const int64_t w = where[size_t(d)];
        if (w < 0) continue;
        double* row = p + (o * out_size + w) * inner;
        for (int64_t i = 0; i < inner; ++i) row[i] = file.at((o * size + d) * inner + i);
      }
    out.copy_(host);
    return out;
  }
  Replay replay(*init);
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t d = 0; d < size; ++d) {
      const int64_t w = where[size_t(d)];
      if (w < 0) {  // a row the slice does not keep: its draws are made only to move past them
        replay.skip(inner);
        continue;
      }
      double* row = p + (o * out_size + w) * inner;
      for (int64_t i = 0; i < inner; ++i) row[i] = replay.next();
    }
  out.copy_(host);
  return out;
}

void copy_span(const Tensor& t, int64_t start, const Tensor& dst_view) {
  Tensor dst = dst_view;  // the same view: its values are what is written
  const int64_t n = dst.numel();
  BOOSTER_CHECK(dst.dim() == 1 && dst.is_contiguous(), ShapeError, "copy_span: the destination must be a contiguous "
                "1-D tensor, got shape ", dst.shape());
  BOOSTER_CHECK(start >= 0 && start + n <= t.numel(), IndexError, "copy_span: elements [", start, ", ", start + n,
                ") are outside a tensor of ", t.numel());
  EagerScope eager;
  NoGradGuard no_grad;
  Storage* s = whole_deferred(t);
  if (s == nullptr) {
    dst.copy_(t.contiguous().reshape({-1}).narrow(0, start, n));
    return;
  }
  const std::shared_ptr<const DeferredInit> init = s->deferred_init();
  if (!init) return;  // never initialized: as uninitialized as the eager tensor
  if (init->kind == DeferredInit::Kind::Fill) {
    dst.fill_(init->a);
    return;
  }
  std::optional<FileValues> file;
  std::optional<Replay> replay;
  if (init->kind == DeferredInit::Kind::File) {
    file.emplace(*init->file, t.numel());
  } else {
    replay.emplace(*init);
    replay->skip(start);  // the draws before the span
  }
  constexpr int64_t kChunk = int64_t(1) << 14;
  Tensor host = Tensor::empty({std::min(n, kChunk)}, DType::Float64);
  double* p = host.data<double>();
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t m = std::min(kChunk, n - c);
    for (int64_t i = 0; i < m; ++i) p[i] = file ? file->at(start + c + i) : replay->next();
    // Through t's dtype first, as the eager tensor holds them, then into dst's.
    make_view(dst, {m}, {1}, dst.offset() + c).copy_(host.narrow(0, 0, m).to(t.dtype()));
  }
}

uint64_t deferred_digest(const Tensor& t) {
  const Storage* s = whole_deferred(t);
  if (s == nullptr) return 0;
  uint64_t h = 0x9e3779b97f4a7c15ull;
  auto mix = [&h](uint64_t v) {  // splitmix64 over the running value
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h ^= h >> 30, h *= 0xbf58476d1ce4e5b9ull, h ^= h >> 27, h *= 0x94d049bb133111ebull, h ^= h >> 31;
  };
  auto bits = [](double d) {
    uint64_t u;
    std::memcpy(&u, &d, sizeof u);
    return u;
  };
  mix(uint64_t(t.numel()));
  const std::shared_ptr<const DeferredInit>& init = s->deferred_init();
  if (!init) return h;
  mix(uint64_t(init->kind) + 1);
  mix(uint64_t(init->dtype));
  mix(bits(init->a));
  mix(bits(init->b));
  if (init->kind == DeferredInit::Kind::Uniform || init->kind == DeferredInit::Kind::Normal)
    for (uint64_t w : init->generator.state()) mix(w);
  if (init->kind == DeferredInit::Kind::File) {
    const DeferredFileTensor& f = *init->file;
    // The file's name, not its directory: ranks on other hosts may read copies kept elsewhere.
    for (char c : f.path.filename().string()) mix(uint64_t(uint8_t(c)));
    mix(f.offset);
    mix(uint64_t(f.dtype));
    for (int64_t d : f.shape) mix(uint64_t(d));
    mix(f.transposed ? 1 : 0);
  }
  return h;
}

// Storage::materialize's filling of a deferred storage (declared in storage.h's terms: the storage
// has just been allocated and holds garbage).
void fill_deferred(Storage& storage, const DeferredInit& init) {
  EagerScope eager;
  NoGradGuard no_grad;
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::shared_ptr<Storage>(std::shared_ptr<Storage>(), &storage);  // not owning
  impl->numel = int64_t(storage.nbytes() / itemsize(init.dtype));
  impl->shape = {impl->numel};
  impl->strides = {1};
  impl->dtype = init.dtype;
  Tensor dst(std::move(impl));
  if (init.kind == DeferredInit::Kind::Fill) {
    dst.fill_(init.a);
    return;
  }
  Tensor host = Tensor::empty(dst.shape(), DType::Float64);
  double* p = host.data<double>();
  if (init.kind == DeferredInit::Kind::File) {
    const FileValues file(*init.file, host.numel());
    for (int64_t i = 0; i < host.numel(); ++i) p[i] = file.at(i);
    dst.copy_(host);
    return;
  }
  Replay replay(init);
  for (int64_t i = 0; i < host.numel(); ++i) p[i] = replay.next();
  dst.copy_(host);
}

}  // namespace booster
