// ProcessGroup: the collectives every parallelism plugin is written against (all_reduce,
// reduce_scatter, all_gather, broadcast, barrier), blocking and non-blocking, on tensors and on raw
// buffer spans. Backends: "mpi" (CPU tensors, OpenMPI), "tcp" (CPU tensors over TCP without MPI,
// tcp_process_group.h), "nccl" (CUDA tensors, nccl_process_group.h) and "local" (one process, identities).
// The contract (launch, ordering, completion, averages, devices, failures) is Note [Process groups]
// in this folder's README.md.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "booster/tensor/tensor.h"

namespace booster::distributed {

// Note [Averages divide first]
// A 16-bit sum over N ranks overflows N times sooner than their average: loss-scaled float16
// gradients whose average is finite can sum to inf, and the step would be skipped for nothing. So
// Avg divides each rank's values by N before summing, as torch's DDP comm hook divides each bucket by
// the world size before its all-reduce and NCCL's ncclAvg pre-multiplies by 1/N. all_reduce does it
// in its own buffer (it is overwritten anyway). reduce_scatter must leave `in` unchanged, so there the
// mpi backend sums and then divides; a caller whose input is scratch (a gradient buffer it reduces
// and then clears or frees) calls reduce_scatter_consuming, which may divide `in` in place first and
// leaves it with unspecified contents. The nccl backend's ncclAvg divides first in both forms.
// Dividing first rounds differently from dividing last. The mpi backend divides each element by N in
// its dtype: one rounding per element, none with a power-of-two N unless it underflows. NCCL's
// ncclAvg multiplies by 1/N held in the buffer's dtype, so for float16/bfloat16 both 1/N and the
// product are rounded to 16 bits: up to two roundings per element before the sum (bfloat16's 1/3 is
// itself off by 2^-9 relative). With a power-of-two world size 1/N is exact and so is the product
// unless it underflows.
//
// How values from all ranks are combined.
enum class ReduceOp : uint8_t { Sum, Avg, Max, Min };
const char* reduce_op_name(ReduceOp op);

// A contiguous run of `numel` elements of one dtype on one device: a whole contiguous tensor, or a
// piece of one (a bucket of a flat gradient buffer) without making a Tensor for it.
struct BufferSpan {
  void* data = nullptr;
  int64_t numel = 0;
  DType dtype = DType::Float32;
  Device device = Device::cpu();

  // The elements of a contiguous tensor; ShapeError (naming `op`) when it is not contiguous.
  static BufferSpan of(const Tensor& t, const char* op = "BufferSpan::of");
  // Elements [start, start + length) of this span; IndexError when that is out of range.
  BufferSpan slice(int64_t start, int64_t length) const;
  size_t nbytes() const { return size_t(numel) * itemsize(dtype); }
};

// Note [When a collective's result is there]
// "mpi" and "local" run on the host: when a blocking form returns, or Work::wait() returns, the
// result is in this rank's buffers for any reader. "nccl" follows torch.distributed's NCCL backend:
// * A collective is queued on the CUDA backend's stream of the group's GPU (cuda::stream_handle), the
//   one stream every booster kernel and copy on that GPU uses. A blocking form returns once it is
//   queued; Work::wait() makes that stream wait for the collective (torch: the current stream) and
//   does not block the host; is_completed() is true once the GPU has finished it.
// * So the result is there for everything queued on that stream afterwards: every booster op on the
//   tensors, and every host read through booster (Tensor::item, tolist, to(cpu), copy_ into a CPU
//   tensor, checkpoint writes), because those copy through the allocator's copy_to_host, which
//   synchronizes the stream. Plugins read collective results on the host only through those paths.
// * It is not guaranteed to be there for any other CUDA code: a kernel on another stream, or a raw
//   cudaMemcpy (the legacy default stream does not wait for the backend's stream, which is created
//   cudaStreamNonBlocking). Before such a read call cuda::synchronize(device) (blocks the host), or
//   make the other stream wait for an event recorded on cuda::stream_handle(device).
// * Dropping a Work neither waits nor cancels: the collective still runs in stream order. Memory from
//   booster's allocator may be freed meanwhile (blocks are reused in the same stream order); memory
//   from elsewhere must outlive the collective on the GPU (cuda::synchronize).
// * Errors: a collective that cannot be queued throws DistributedError at the call. One that fails
//   while it runs (a peer gone, a network error) is reported later: by Work::wait() and barrier(),
//   which ask NCCL for the communicator's asynchronous error, or as a CudaError at the next call that
//   synchronizes. A peer that never arrives would leave the stream hanging; the group's watchdog
//   thread ends the job once the collective is past its timeout (Note [Collective timeouts], "nccl").
// * barrier() blocks the host until every rank has reached it and everything this rank queued before
//   it on the stream has run (it guards file writes).
//
// Handle of a non-blocking collective. Not thread-safe: wait for a Work from one thread.
class Work {
 public:
  // CPU backends: waits for the collective if it is still running. "nccl": does not wait (Note
  // [When a collective's result is there]).
  virtual ~Work() = default;
  // CPU backends: blocks until the collective finished on this rank and its result is in the buffers
  // (including any finishing step such as Avg's division). "nccl": orders the backend's stream after
  // the collective, so work queued on it and host reads through booster see the result; other CUDA
  // code must synchronize first (Note [When a collective's result is there]). Throws
  // DistributedError if the collective failed (as far as is known yet, on "nccl"). Idempotent.
  virtual void wait() = 0;
  // True when the collective has finished (on "nccl": on the GPU). Does not block.
  virtual bool is_completed() = 0;

  // Keeps `t` (and so its storage) alive until this Work is destroyed. Tensor forms use it.
  void keep_alive(Tensor t) { kept_.push_back(std::move(t)); }

 private:
  std::vector<Tensor> kept_;
};
using WorkPtr = std::shared_ptr<Work>;

// Waits for every Work in order (convenience for "start several, wait all").
void wait_all(const std::vector<WorkPtr>& works);

// A set of processes that run collectives together. Public methods validate their arguments (typed
// errors naming the op, shapes and dtypes) and forward to the backend's protected *_impl slots.
class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;

  // This process's index in [0, size()).
  virtual int rank() const = 0;
  // Number of processes in the group.
  virtual int size() const = 0;
  // "mpi", "tcp", "nccl", "local".
  virtual std::string backend() const = 0;
  // Where this group's buffers live: the CPU for "mpi" and "local", this rank's GPU for "nccl".
  virtual Device device() const = 0;

  // Blocking forms return with the result in the buffers on the CPU backends, and with the collective
  // queued in stream order on "nccl" (Note [When a collective's result is there]).
  // ---------------------------------------------------------------- tensors (contiguous, in place)
  // Every rank's `t` becomes op(t of every rank). Floating, int64 and int32 dtypes.
  void all_reduce(Tensor& t, ReduceOp op = ReduceOp::Sum);
  WorkPtr all_reduce_async(Tensor& t, ReduceOp op = ReduceOp::Sum);
  // Every rank's `t` becomes root's `t`. Any dtype.
  void broadcast(Tensor& t, int root);
  WorkPtr broadcast_async(Tensor& t, int root);
  // `out` (size() * in.numel() elements, any shape) becomes the ranks' `in` one after another, in rank
  // order. `in` may be this rank's slice of `out` (in place, as ZeRO gathers shards). Any dtype.
  void all_gather(Tensor& out, const Tensor& in);
  WorkPtr all_gather_async(Tensor& out, const Tensor& in);
  // `in` has size() * out.numel() elements; `out` becomes op over ranks of this rank's slice of `in`
  // (slice r = elements [r * out.numel(), (r + 1) * out.numel())). `in` is left unchanged; `out` must
  // not overlap it.
  void reduce_scatter(Tensor& out, const Tensor& in, ReduceOp op = ReduceOp::Sum);
  WorkPtr reduce_scatter_async(Tensor& out, const Tensor& in, ReduceOp op = ReduceOp::Sum);
  // As reduce_scatter, but `in` is the caller's scratch: its contents are unspecified afterwards. That
  // lets Avg divide before summing in every backend (Note [Averages divide first]).
  void reduce_scatter_consuming(Tensor& out, Tensor& in, ReduceOp op = ReduceOp::Sum);

  // ---------------------------------------------------------------- raw spans (same rules as above)
  void all_reduce(const BufferSpan& buf, ReduceOp op = ReduceOp::Sum);
  WorkPtr all_reduce_async(const BufferSpan& buf, ReduceOp op = ReduceOp::Sum);
  void all_reduce(void* data, int64_t numel, DType dtype, ReduceOp op = ReduceOp::Sum) {
    all_reduce(BufferSpan{data, numel, dtype, Device::cpu()}, op);
  }
  void broadcast(const BufferSpan& buf, int root);
  WorkPtr broadcast_async(const BufferSpan& buf, int root);
  void all_gather(const BufferSpan& out, const BufferSpan& in);
  WorkPtr all_gather_async(const BufferSpan& out, const BufferSpan& in);
  void reduce_scatter(const BufferSpan& out, const BufferSpan& in, ReduceOp op = ReduceOp::Sum);
  WorkPtr reduce_scatter_async(const BufferSpan& out, const BufferSpan& in,
                               ReduceOp op = ReduceOp::Sum);
  void reduce_scatter_consuming(const BufferSpan& out, const BufferSpan& in, ReduceOp op = ReduceOp::Sum);

  // Returns when every rank has called barrier() (on "nccl", also once this rank's queued work has run).
  virtual void barrier() = 0;

  // ---------------------------------------------------------------- point to point
  // Note [Point-to-point] in README.md. One send or receive of a batch: `tensor` contiguous, on the
  // group's device (a receive's is written), `peer` another rank of this group, 0 <= tag <= 32767.
  struct P2POp {
    enum class Kind : uint8_t { Send, Recv };
    Kind kind = Kind::Send;
    Tensor tensor;
    int peer = 0;
    int tag = 0;
  };
  // Starts every op of `ops` at once (so two ranks that send to each other cannot deadlock) and
  // returns one Work that completes when all have: a send's tensor may be reused, a receive's holds the
  // data (on "nccl": in stream order, Note [When a collective's result is there]). Only the peers take
  // part. A send matches the peer's receive of the same tag in the order each side posted them; the
  // byte counts must agree (the receive's dtype and size are the sender's). Waiting is bounded by the
  // group's timeout, as a collective's.
  WorkPtr batch_send_recv(const std::vector<P2POp>& ops);
  WorkPtr send(const Tensor& t, int dst, int tag = 0);
  WorkPtr recv(Tensor& t, int src, int tag = 0);

  // ---------------------------------------------------------------- subgroups
  // Collective over this group, as MPI_Comm_split: ranks passing the same `color` form one new group,
  // ordered by `key` (ties by rank here); a negative color joins none and gets nullptr. `name` names
  // the group in errors. The new group has this group's backend and device and its own timeout
  // setting; it is set up with a blocking call that the collective timeout does not cover ("nccl":
  // ncclCommSplit; a timeout of such a subgroup ends the job without naming the ranks that did not
  // arrive).
  virtual std::shared_ptr<ProcessGroup> split(int color, int key, const std::string& name);
  // The group of `ranks` (ranks of this group, listed in the new group's rank order), through split:
  // every rank calls it with the same list; ranks not in it get nullptr. ValueError for a rank out of
  // range or listed twice.
  std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks, const std::string& name = "subgroup");

  // Ends the whole job now with `exit_code` after printing `why` (with this rank) to stderr: the way
  // out for a rank that cannot go on while others may be waiting in a collective.
  [[noreturn]] virtual void abort(int exit_code, const std::string& why) = 0;

  // How long a collective of this group may take, from its start, before it fails with
  // DistributedError (Note [Collective timeouts]): this group's own when set_timeout was called, else
  // the process's default_collective_timeout(). A collective uses the timeout of the moment it starts.
  std::chrono::duration<double> timeout() const;
  // ValueError unless `timeout` is positive and finite.
  void set_timeout(std::chrono::duration<double> timeout);

 protected:
  // Backend slots, called with validated arguments: spans are well formed (possibly empty),
  // dtypes match, sizes fit, root is in range. With async == false they return when done (and may
  // return nullptr); with async == true they return the Work of the started collective.
  virtual WorkPtr all_reduce_impl(const BufferSpan& buf, ReduceOp op, bool async) = 0;
  virtual WorkPtr broadcast_impl(const BufferSpan& buf, int root, bool async) = 0;
  virtual WorkPtr all_gather_impl(const BufferSpan& out, const BufferSpan& in, bool async) = 0;
  virtual WorkPtr reduce_scatter_impl(const BufferSpan& out, const BufferSpan& in, ReduceOp op,
                                      bool async) = 0;
  // Optional: batch_send_recv's slot, always non-blocking. The default refuses (IncompatibleError).
  struct P2PSpan {
    bool send = true;
    BufferSpan buf;
    int peer = 0;
    int tag = 0;
  };
  virtual WorkPtr send_recv_impl(const std::vector<P2PSpan>& ops);
  // Optional: reduce_scatter_consuming's slot (blocking). The default keeps `in` (reduce_scatter_impl).
  virtual WorkPtr reduce_scatter_consuming_impl(const BufferSpan& out, const BufferSpan& in, ReduceOp op) {
    return reduce_scatter_impl(out, in, op, false);
  }

 private:
  void check_all_reduce(const BufferSpan& buf, ReduceOp op, const char* name) const;
  void check_broadcast(int root, const char* name) const;
  void check_all_gather(const BufferSpan& out, const BufferSpan& in, const char* name) const;
  void check_reduce_scatter(const BufferSpan& out, const BufferSpan& in, ReduceOp op,
                            const char* name) const;

  std::atomic<double> timeout_s_{0.0};  // 0: the process default
};

// A Work that is already complete (what the local backend and empty collectives return).
WorkPtr completed_work();

// ---------------------------------------------------------------- the default (world) group
// Creates the default group once. backend: "auto" (mpi under mpirun; tcp when torchrun's variables,
// RANK and WORLD_SIZE or BOOSTER_*, name several processes without an MPI launcher; else local), "mpi",
// "tcp" (rank, size and meeting place from the environment, Note [TCP process group] in README.md),
// "nccl" (CUDA tensors; Note [NCCL process group] in nccl_process_group.h), "local".
// Calling it again with the same backend (or "auto") returns the existing group; with another backend
// it throws StateError. "mpi" without MPI support in the build, "nccl" without NCCL or a GPU, or "tcp"
// without the variables it needs, throws ConfigError.
ProcessGroup& init_process_group(const std::string& backend = "auto");
// The default group, created with "auto" on first use.
ProcessGroup& default_process_group();
bool is_initialized();

// ---------------------------------------------------------------- collective timeouts
// The timeout of every group without its own (ProcessGroup::set_timeout), as torch's
// init_process_group(timeout=...): set_default_collective_timeout's value when it was called (the
// `booster train` command applies train.collective_timeout_s with it), else the environment variable
// BOOSTER_COLLECTIVE_TIMEOUT_S (seconds, read once), else kDefaultCollectiveTimeout. Read as each
// collective starts, so it may be set after the group exists; ConfigError (from the first collective)
// when the variable is needed and is not a positive number. Note [Collective timeouts] in
// README.md.
inline constexpr std::chrono::duration<double> kDefaultCollectiveTimeout{1800.0};
std::chrono::duration<double> default_collective_timeout();
// ValueError unless `timeout` is positive and finite.
void set_default_collective_timeout(std::chrono::duration<double> timeout);

// Note [A group per device]
// A plugin takes the group of its model's device: the CPU's is the default group (mpi under mpirun,
// tcp under torchrun's variables, else local); CUDA's is this process's one NCCL group over the same
// ranks, made on first use (under mpirun it bootstraps through MPI, which then serves both groups: MPI
// is initialized once by booster and finalized at exit, Note [MPI progress]; under torchrun's variables
// through the tcp group), or, when ranks of the job share a GPU, the staged group over the CPU group
// (Note [Staged collectives] in README.md). init_process_group("nccl") makes the default group that
// same NCCL group (or takes it, if process_group_for(cuda) made it first), so there is never a second
// communicator over the same ranks. Both groups have the same rank and size, so code that only needs
// those may use either. The NCCL group lives until the process ends, also when it is the default
// group (never destroyed: CUDA and NCCL may be gone by static destruction).
// When the default group is "nccl" there is no CPU group: process_group_for(cpu) throws DeviceError
// saying so (a CPU model would otherwise fail later, in its first collective). For a CPU model and a
// CUDA model in one process, make the default group with "auto" and let process_group_for(cuda) make
// the NCCL group.
// Throws ConfigError for a CUDA device when the NCCL group cannot be made (no NCCL in the build, no
// GPU, an MPI launcher without MPI in the build; the message says which), and DeviceError for a GPU
// other than this rank's (NCCL's rank uses GPU rank % device_count()).
ProcessGroup& process_group_for(Device device);
// The group for the device that `tensors` (a model's parameters and buffers) are on, the CPU when there
// are none. DeviceError when they are on several devices; errors name `who` (the plugin).
ProcessGroup& process_group_for(const std::vector<Tensor>& tensors, const std::string& who);
// True when this process was started by an MPI launcher (mpirun/mpiexec, srun, hydra): the launcher's
// environment variables are present.
bool launched_by_mpi_launcher();
// The job this process belongs to as its launcher numbered it, known before any group exists: an MPI
// launcher's variables (OMPI_COMM_WORLD_RANK/SIZE, PMI_RANK/SIZE), else torchrun's or booster's
// (ranks_from_environment in rendezvous.h), else rank 0 of 1. Malformed variables count as absent here
// (making the group reports them).
struct JobPlace {
  int rank = 0;
  int size = 1;
};
JobPlace job_place_from_launcher();
// This process's index among the ranks of its machine, which picks its GPU (% the GPUs it sees): MPI's
// node rank under an MPI launcher (MPI_COMM_TYPE_SHARED), else LOCAL_RANK (or BOOSTER_LOCAL_RANK), else
// 0. ConfigError for malformed variables.
int node_rank();
// process_group_for's check that `group` takes buffers on `device` (DeviceError saying what to do when
// not); public so tests can reach it without a GPU.
void check_group_serves(const ProcessGroup& group, Device device);
// The world ranks of the members of the subgroup that split(color, key) makes for `color`, in its rank
// order (by key, ties by rank in the parent, as MPI_Comm_split and ncclCommSplit order them), from every
// parent rank's {color, key, world rank} in parent rank order; empty for a negative color. The NCCL
// group names a subgroup's ranks by world rank in its messages with it.
std::vector<int> split_world_ranks(const std::vector<std::array<int, 3>>& parent, int color);

}  // namespace booster::distributed
