// GradientBucketer: averages the gradients held in flat buffers across a process group, in buckets
// that are launched as non-blocking all-reduces from the parameters' grad-ready hooks while backward
// still runs (what torch's DistributedDataParallel Reducer does). Written for the ddp plugin and
// reusable by any plugin that all-reduces whole gradients.
//
// Note [Gradient buckets]
// * A bucket is a span of one flat gradient buffer (Note [Flat buffers]): an offset and a length, so
//   launching it is one all_reduce_async on a BufferSpan, with no copy in or out.
// * Buckets are cut in REVERSE parameter order, as torch's DDP does: backward produces the gradients of
//   the last layers first, so the first bucket to fill is the one holding the last parameters. Each
//   bucket holds at most bucket_cap_mb MiB (a larger parameter gets a bucket of its own); the first
//   bucket is capped at 1 MiB (torch's _DEFAULT_FIRST_BUCKET_BYTES) so communication starts early.
// * Launch order: every rank must issue the same collectives in the same order (Note [Process groups]),
//   and the order in which hooks fire is not guaranteed to be the same everywhere. So a bucket whose
//   gradients are all ready is launched only once every bucket before it has been launched; the hook
//   that completes bucket k launches k and every ready bucket after it.
// * Progress: OpenMPI has no progress thread (Note [MPI progress]); each later hook polls the oldest
//   bucket still in flight (one cheap MPI_Testall), which moves every outstanding collective along.
//   Hooks run only between layers, so with progress_thread a thread of ours also polls during the
//   layers' GEMMs (Note [Progress thread] in bucket.cpp); measured, that is what makes the buckets
//   overlap backward at all (bench/README.md, ddp section). A group on a GPU (NCCL) needs neither: its
//   collectives are queued on the compute stream and run on the GPU (Note [NCCL process group]).
//   Being on that one stream, a bucket's all-reduce runs after the backward kernels queued before it
//   and before those queued after it: on a GPU the buckets do not overlap backward (torch runs NCCL
//   on a stream of its own for that); launched from the hooks they only interleave with its kernels.
// * A parameter that gets no gradient in a backward (an unused branch, or one only some ranks take)
//   never completes its bucket. finish_backward(), called once after every backward on every rank,
//   launches whatever is left, in order, so no rank waits for a collective another rank never starts.
//   What such a parameter contributes is the zeros (or the no_sync sum) in its slot.
// * Arrival: the optimizer skips a parameter whose gradient did not arrive since zero_grad (Note [Flat
//   buffers]), and that is a per-rank fact. After the reduction every rank holds the same gradients, so
//   it must also make the same choice: by default every bucketed parameter then counts as arrived on
//   every rank (a parameter no rank used is stepped with a zero gradient). With find_unused_parameters,
//   the ranks also all-reduce (Max) one flag per parameter, and a parameter no rank used stays
//   not-arrived everywhere, so every optimizer skips it, as torch skips a None gradient. (On a GPU
//   group the flags are copied to the device and read back after the reduction: two small copies,
//   each a host sync, per step; torch's reducer copies its local_used_map likewise.)
// * no_sync (set_sync(false)): hooks launch nothing and gradients accumulate in the flat buffers; the
//   next backward with sync on all-reduces the accumulated sums.
// * wait() blocks until every launched bucket is reduced (on a GPU group: until the reductions are
//   ordered before everything queued later, Note [When a collective's result is there] in
//   process_group.h; host reads of the gradients go through copies that synchronize). Callers wait before anything
//   reads the gradients (unscale, clipping, the optimizer step) and before the next backward writes
//   into them.
#pragma once

#include <boost/config.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "booster/distributed/process_group.h"
#include "booster/optim/flat_buffer.h"

namespace booster::distributed {

struct GradientBucketerOptions {
  double bucket_cap_mb = 25.0;  // MiB per bucket, as torch's bucket_cap_mb
  ReduceOp op = ReduceOp::Avg;
  bool find_unused_parameters = false;  // see Note [Gradient buckets], "Arrival"
  bool progress_thread = false;         // poll buckets in flight from a thread (Note [Progress thread])
};

// What the bucketer did, for tests (does communication really overlap backward?) and benchmarks.
struct GradientBucketStats {
  int64_t synced_backwards = 0;   // finish_backward() calls with sync on
  int64_t launched_in_hooks = 0;  // buckets launched from grad-ready hooks, i.e. while backward ran
  int64_t launched_at_finish = 0; // buckets launched by finish_backward()
  int64_t last_launched_in_hooks = 0;   // the same two, for the last synced backward only
  int64_t last_launched_at_finish = 0;
  double wait_seconds = 0.0;      // time spent blocked in wait()
};

class GradientBucketer {
 public:
  // One bucket: elements [begin, end) of buffers[buffer]'s gradient, holding parameters `params`
  // (indices into that buffer, in launch order, i.e. reverse parameter order).
  struct Bucket {
    size_t buffer = 0;
    int64_t begin = 0, end = 0;
    std::vector<size_t> params;
  };

  // Registers a grad-ready hook on every parameter of `buffers` that requires grad. The buffers (and
  // `group`) must outlive the bucketer; hooks left on parameters after it is destroyed do nothing.
  GradientBucketer(ProcessGroup& group, std::vector<const optim::FlatBuffer*> buffers,
                   GradientBucketerOptions options = {});
  ~GradientBucketer();
  GradientBucketer(const GradientBucketer&) = delete;
  GradientBucketer& operator=(const GradientBucketer&) = delete;

  const std::vector<Bucket>& buckets() const;
  const GradientBucketerOptions& options() const;

  // false: gradients accumulate locally (no_sync); true: the next backward synchronises them.
  void set_sync(bool enabled);
  bool sync() const;

  // Call once after every backward, on every rank: with sync on, launches the buckets the hooks did
  // not (in order) and readies the hooks for the next backward. With sync off it does nothing.
  void finish_backward();
  // Blocks until every launched bucket is reduced and marks the reduced gradients as arrived. No-op
  // when nothing is in flight.
  void wait();
  // True while some launched bucket has not been waited for.
  bool in_flight() const;

  const GradientBucketStats& stats() const;
  void reset_stats();

 private:
  struct State;
  std::shared_ptr<State> state_;  // hooks hold it weakly
};

// Implemented by objects that synchronise gradients through a GradientBucketer (the ddp plugin's
// precision wrapper), so tests and benchmarks can read its statistics through a base pointer:
//   dynamic_cast<const GradientBucketerOwner*>(parts.precision.get())->gradient_bucketer().stats()
class BOOST_SYMBOL_VISIBLE GradientBucketerOwner {
 public:
  virtual ~GradientBucketerOwner();
  virtual const GradientBucketer& gradient_bucketer() const = 0;
};

// A reducer for MixedPrecision::set_found_inf_reducer (Note [Agreeing on found_inf]): true on every
// rank of `group` when any rank saw inf/NaN (a one-element all-reduce with Max, on the group's device). Its code lives in the
// core library, so it stays valid after the plugin that installed it is unloaded.
std::function<bool(bool)> found_inf_on_any_rank(ProcessGroup& group);
// A reducer for MixedPrecision::set_amax_reducer (Note [Agreeing on amax]): each value becomes its
// maximum over the ranks of `group` (one all-reduce with Max; NaN wins as the flag of a bad amax).
std::function<void(std::vector<float>&)> max_on_all_ranks(ProcessGroup& group);

}  // namespace booster::distributed
