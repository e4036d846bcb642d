#include "booster/distributed/nccl_process_group.h"

#include "booster/backends/cuda/cuda.h"

#if defined(BOOSTER_WITH_NCCL)
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <optional>
#include <thread>
#include <vector>

#include "booster/distributed/collective_timeout_impl.h"
#include "booster/distributed/flight_recorder_impl.h"
#include "booster/distributed/mpi_process_group.h"
#include "booster/distributed/rendezvous.h"
#if defined(BOOSTER_WITH_MPI)
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>
#endif
#endif

namespace booster::distributed {

#if !defined(BOOSTER_WITH_NCCL)

bool nccl_built() { return false; }

std::shared_ptr<ProcessGroup> make_nccl_process_group(ProcessGroup*) {
  BOOSTER_FAIL(ConfigError, "backend \"nccl\" needs a build with CUDA and NCCL (",
               cuda::is_compiled() ? "NCCL was not found" : "nvcc was not found",
               " when booster was configured); train on the CPU (backend \"mpi\" or \"local\"), or rebuild "
               "booster with CUDA and NCCL");
}

#else

namespace {

using detail::Backoff;
using detail::Clock;
using detail::Collective;
using detail::CollectiveOp;
using detail::Seconds;

#define BOOSTER_NCCL_CHECK(call)                                                                       \
  do {                                                                                                 \
    const ncclResult_t booster_r_ = (call);                                                            \
    if (booster_r_ != ncclSuccess) [[unlikely]]                                                        \
      BOOSTER_FAIL(DistributedError, #call, " failed: ", ncclGetErrorString(booster_r_), " at ", __FILE__, \
                   ":", __LINE__);                                                                     \
  } while (0)
#define BOOSTER_NCCL_CUDA_CHECK(call)                                                                  \
  do {                                                                                                 \
    const cudaError_t booster_e_ = (call);                                                             \
    if (booster_e_ != cudaSuccess) [[unlikely]]                                                        \
      BOOSTER_FAIL(CudaError, #call, " failed: ", cudaGetErrorName(booster_e_), " (",                   \
                   cudaGetErrorString(booster_e_), ") at ", __FILE__, ":", __LINE__);                  \
  } while (0)

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::Float32: return ncclFloat32;
    case DType::Float64: return ncclFloat64;
    case DType::Float16: return ncclFloat16;
    case DType::BFloat16: return ncclBfloat16;
    case DType::Int64: return ncclInt64;
    case DType::Int32: return ncclInt32;
    case DType::Bool:
    case DType::Float8E4M3FN:
    case DType::Float8E5M2: return ncclUint8;  // moved as bytes; reductions refused
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Avg: return ncclAvg;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
  }
  return ncclSum;
}

// Asks NCCL whether a collective already queued on `comm` has failed while running (Note [When a
// collective's result is there], "Errors"); `what` names the caller.
void check_async_error(ncclComm_t comm, const char* what) {
  ncclResult_t async = ncclSuccess;
  BOOSTER_NCCL_CHECK(ncclCommGetAsyncError(comm, &async));
  BOOSTER_CHECK(async == ncclSuccess, DistributedError, what, ": an NCCL collective failed on the GPU: ",
                ncclGetErrorString(async), "; the communicator is unusable (a rank may have died)");
}

// Note [NCCL process group], "Stream order": the event marks the collective on the stream.
class EventWork final : public Work {
 public:
  EventWork(cudaStream_t stream, ncclComm_t comm) : stream_(stream), comm_(comm) {
    BOOSTER_NCCL_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    BOOSTER_NCCL_CUDA_CHECK(cudaEventRecord(event_, stream));
  }
  // Destroying a pending event is allowed: CUDA releases it once it completes.
  ~EventWork() override {
    if (event_) cudaEventDestroy(event_);
  }
  void wait() override {
    check_async_error(comm_, "Work::wait");
    BOOSTER_NCCL_CUDA_CHECK(cudaStreamWaitEvent(stream_, event_, 0));
  }
  bool is_completed() override { return cudaEventQuery(event_) == cudaSuccess; }

 private:
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  cudaEvent_t event_ = nullptr;
};

class NcclProcessGroup final : public ProcessGroup {
 public:
  explicit NcclProcessGroup(ProcessGroup* bootstrap) {
    BOOSTER_CHECK(cuda::is_available(), ConfigError, "backend \"nccl\" needs a GPU: ", cuda::unavailable_reason(),
                  "; train on the CPU, or run on a machine with a GPU");
    ncclUniqueId id;
    int local_rank = -1;  // from the environment (Note [Rendezvous without MPI]); -1: not known
    if (launched_by_mpi_launcher()) {
      // Note [NCCL process group]: NCCL is there; MPI, which hands out the id, is what is missing.
      BOOSTER_CHECK(mpi_built(), ConfigError, "backend \"nccl\" under an MPI launcher needs MPI to hand "
                    "NCCL's unique id to every rank, and this build has no MPI (OpenMPI was not found when booster "
                    "was configured; without it each rank would be a world of its own); rebuild booster with "
                    "OpenMPI (libopenmpi-dev), or run a single process without the launcher");
#if defined(BOOSTER_WITH_MPI)
      ensure_mpi_initialized();  // once per process, shared with the mpi group (Note [A group per device])
      MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
      MPI_Comm_size(MPI_COMM_WORLD, &size_);
      if (rank_ == 0) BOOSTER_NCCL_CHECK(ncclGetUniqueId(&id));
      const int rc = MPI_Bcast(&id, int(sizeof(id)), MPI_BYTE, 0, MPI_COMM_WORLD);
      BOOSTER_CHECK(rc == MPI_SUCCESS, DistributedError, "init_process_group: MPI_Bcast of the NCCL id failed on rank ",
                    rank_, " (MPI error ", rc, ")");
#endif
    } else if (bootstrap != nullptr && bootstrap->size() > 1) {
      // A CPU group over the same ranks (tcp under torchrun's variables) hands rank 0's id to the others.
      rank_ = bootstrap->rank();
      size_ = bootstrap->size();
      const std::optional<EnvRanks> env = ranks_from_environment();
      local_rank = env ? env->local_rank : -1;
      if (rank_ == 0) BOOSTER_NCCL_CHECK(ncclGetUniqueId(&id));
      static_assert(sizeof id % sizeof(int64_t) == 0, "ncclUniqueId travels as int64 words");
      bootstrap->broadcast(BufferSpan{&id, int64_t(sizeof id / sizeof(int64_t)), DType::Int64, Device::cpu()}, 0);
    } else if (const std::optional<EnvRanks> env = ranks_from_environment(); env && env->world_size > 1) {
      // Note [Rendezvous without MPI]: rank and size from torchrun's (or booster's) variables, the id
      // from rank 0 through a shared file or TCP.
      const std::optional<RendezvousSpec> spec = rendezvous_from_environment();
      BOOSTER_CHECK(spec.has_value(), ConfigError, "backend \"nccl\" with ", env->world_size, " processes from the ",
                    "environment (WORLD_SIZE or BOOSTER_WORLD_SIZE) needs a way to hand NCCL's unique id to every ",
                    "rank: set BOOSTER_NCCL_ID_FILE to a path on a file system every rank shares, or MASTER_ADDR and ",
                    "MASTER_PORT to rank 0's host and a free port there");
      rank_ = env->rank;
      size_ = env->world_size;
      local_rank = env->local_rank;
      std::vector<uint8_t> blob(sizeof id);
      if (rank_ == 0) {
        BOOSTER_NCCL_CHECK(ncclGetUniqueId(&id));
        std::memcpy(blob.data(), &id, sizeof id);
      }
      blob = share_from_rank0(*spec, rank_, size_, blob, default_collective_timeout());
      BOOSTER_CHECK(blob.size() == sizeof id, DistributedError, "init_process_group: rank 0 sent an NCCL id of ",
                    blob.size(), " bytes; expected ", sizeof id, " (every rank must run the same booster build)");
      std::memcpy(&id, blob.data(), sizeof id);
    } else {
      BOOSTER_NCCL_CHECK(ncclGetUniqueId(&id));
    }
    // The GPU: the rank on this machine when the environment says it (LOCAL_RANK), else the rank.
    device_ = (local_rank >= 0 ? local_rank : rank_) % cuda::device_count();
    stream_ = static_cast<cudaStream_t>(cuda::stream_handle(device_));
    BOOSTER_NCCL_CHECK(ncclCommInitRank(&comm_, size_, id, rank_));
    // Note [Flight recorder]: the world group's rank names this process's record from now on, not
    // only once its first collective registers the group (a subgroup is split from a world group).
    detail::flight_set_world_rank(rank_);
    BOOSTER_NCCL_CUDA_CHECK(cudaMalloc(&barrier_buf_, sizeof(float)));
#if defined(BOOSTER_WITH_MPI)
    // Note [Collective timeouts], "nccl": the watchdog thread takes and answers the census, so MPI must
    // take calls from any thread. Every rank decides alike (same launcher, same MPI library).
    if (launched_by_mpi_launcher() && mpi_thread_support() == "multiple") census_.emplace(MPI_COMM_WORLD, nullptr);
#endif
    watchdog_ = std::thread([this] { watch(); });
  }
  // A subgroup: `comm` comes from ncclCommSplit of a group on `device`. No census (the MPI side has no
  // matching subcommunicator): a timeout names this rank by its world rank (split() sets world_of_),
  // not the ranks that did not arrive, and still ends the job.
  NcclProcessGroup(ncclComm_t comm, int device, std::string name) : device_(device), comm_(comm), name_(std::move(name)) {
    stream_ = static_cast<cudaStream_t>(cuda::stream_handle(device_));
    BOOSTER_NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
    BOOSTER_NCCL_CHECK(ncclCommCount(comm_, &size_));
    BOOSTER_NCCL_CUDA_CHECK(cudaMalloc(&barrier_buf_, sizeof(float)));
    watchdog_ = std::thread([this] { watch(); });
  }
  ~NcclProcessGroup() override {
    {
      std::lock_guard<std::mutex> lock(watch_mutex_);
      stop_ = true;
    }
    watch_cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    for (Pending& p : pending_) cudaEventDestroy(p.event);
    for (cudaEvent_t e : spare_events_) cudaEventDestroy(e);
    if (comm_ && !timed_out_.load()) ncclCommDestroy(comm_);
    if (barrier_buf_) cudaFree(barrier_buf_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  Device device() const override { return Device::cuda(device_); }

  // ncclCommSplit: collective over this group, as ProcessGroup::split.
  std::shared_ptr<ProcessGroup> split(int color, int key, const std::string& name) override {
    if (key < 0) key = rank_;
    // The members' world ranks, for the subgroup's messages (NCCL's split does not tell them): every
    // rank's {color, key, world rank}, gathered over this group first.
    Tensor mine = Tensor::empty({3}, DType::Float64);
    mine.data<double>()[0] = color, mine.data<double>()[1] = key;
    mine.data<double>()[2] = world_of_.empty() ? rank_ : world_of_[size_t(rank_)];
    Tensor all = Tensor::empty({3 * int64_t(size_)}, DType::Float64, device());
    all_gather(all, mine.to(device()));
    const Tensor host = all.to(Device::cpu());
    std::vector<std::array<int, 3>> parent(static_cast<size_t>(size_));
    for (int r = 0; r < size_; ++r)
      for (int i = 0; i < 3; ++i) parent[size_t(r)][size_t(i)] = int(host.data<double>()[3 * r + i]);
    enter();
    ncclComm_t sub = nullptr;
    BOOSTER_NCCL_CHECK(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &sub, nullptr));
    if (sub == nullptr) return nullptr;
    auto group = std::make_shared<NcclProcessGroup>(sub, device_, name);
    group->world_of_ = split_world_ranks(parent, color);
    return group;
  }

  // Blocks the host until the stream has run the barrier, polling with back-off rather than in
  // cudaStreamSynchronize, which cannot time out (Note [Collective timeouts], "nccl").
  void barrier() override {
    enter();
    BOOSTER_NCCL_CHECK(ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclFloat32, ncclSum, comm_, stream_));
    const Collective what = track(CollectiveOp::Barrier, 0, nullptr);
    Backoff backoff;
    for (;;) {
      const cudaError_t state = cudaStreamQuery(stream_);
      if (state == cudaSuccess) break;
      if (state != cudaErrorNotReady) BOOSTER_NCCL_CUDA_CHECK(state);
      check_async_error(comm_, "barrier");
      const Clock::time_point now = Clock::now();
      if (now >= what.deadline() && !timed_out_.exchange(true)) {
        // This thread reports it; the watchdog stays quiet (timed_out_ is set).
        detail::flight_dump_on_timeout(what, name_);
        ncclCommAbort(comm_);
        BOOSTER_FAIL(DistributedError, timeout_message(what, now));
      }
      backoff.pause(now);
    }
    detail::flight_end(what.flight, detail::FlightState::Completed);  // the watchdog may see it later too
    check_async_error(comm_, "barrier");
  }

  [[noreturn]] void abort(int exit_code, const std::string& why) override {
    std::fprintf(stderr, "booster: rank %d of %d aborts: %s\n", rank_, size_, why.c_str());
    std::fflush(stderr);
    if (comm_) ncclCommAbort(comm_);
#if defined(BOOSTER_WITH_MPI)
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized) MPI_Abort(MPI_COMM_WORLD, exit_code == 0 ? 1 : exit_code);
#endif
    std::_Exit(exit_code == 0 ? 1 : exit_code);
  }

 protected:
  WorkPtr all_reduce_impl(const BufferSpan& buf, ReduceOp op, bool async) override {
    if (buf.numel == 0) return completed_work();
    check_device(buf, "all_reduce");
    enter();
    BOOSTER_NCCL_CHECK(ncclAllReduce(buf.data, buf.data, size_t(buf.numel), nccl_type(buf.dtype), nccl_op(op),
                                     comm_, stream_));
    track(CollectiveOp::AllReduce, buf.nbytes(), &buf.dtype);
    return finish(async);
  }
  WorkPtr broadcast_impl(const BufferSpan& buf, int root, bool async) override {
    if (buf.numel == 0) return completed_work();
    check_device(buf, "broadcast");
    enter();
    BOOSTER_NCCL_CHECK(ncclBroadcast(buf.data, buf.data, size_t(buf.numel), nccl_type(buf.dtype), root, comm_,
                                     stream_));
    track(CollectiveOp::Broadcast, buf.nbytes(), &buf.dtype);
    return finish(async);
  }
  WorkPtr all_gather_impl(const BufferSpan& out, const BufferSpan& in, bool async) override {
    if (in.numel == 0) return completed_work();
    check_device(out, "all_gather");
    check_device(in, "all_gather");
    enter();
    BOOSTER_NCCL_CHECK(
        ncclAllGather(in.data, out.data, size_t(in.numel), nccl_type(in.dtype), comm_, stream_));
    track(CollectiveOp::AllGather, out.nbytes(), &in.dtype);
    return finish(async);
  }
  WorkPtr reduce_scatter_impl(const BufferSpan& out, const BufferSpan& in, ReduceOp op, bool async) override {
    if (out.numel == 0) return completed_work();
    check_device(out, "reduce_scatter");
    check_device(in, "reduce_scatter");
    enter();
    BOOSTER_NCCL_CHECK(ncclReduceScatter(in.data, out.data, size_t(out.numel), nccl_type(in.dtype), nccl_op(op),
                                         comm_, stream_));
    track(CollectiveOp::ReduceScatter, in.nbytes(), &in.dtype);
    return finish(async);
  }

  // Note [Point-to-point]: one NCCL group, so sends and receives between two ranks cannot deadlock.
  // NCCL has no tags: a pair's messages match in the order they were posted.
  WorkPtr send_recv_impl(const std::vector<P2PSpan>& ops) override {
    size_t bytes = 0;
    for (const P2PSpan& op : ops) {
      check_device(op.buf, op.send ? "send" : "recv");
      bytes += op.buf.nbytes();
    }
    enter();
    BOOSTER_NCCL_CHECK(ncclGroupStart());
    for (const P2PSpan& op : ops) {
      if (op.send)
        BOOSTER_NCCL_CHECK(ncclSend(op.buf.data, size_t(op.buf.numel), nccl_type(op.buf.dtype), op.peer, comm_, stream_));
      else
        BOOSTER_NCCL_CHECK(ncclRecv(op.buf.data, size_t(op.buf.numel), nccl_type(op.buf.dtype), op.peer, comm_, stream_));
    }
    BOOSTER_NCCL_CHECK(ncclGroupEnd());
    track(CollectiveOp::SendRecv, bytes, &ops.front().buf.dtype, ops.front().peer);
    return finish(true);
  }

 private:
  void enter() const {
    BOOSTER_CHECK(!timed_out_.load(), DistributedError, "the nccl group is unusable since a collective timed out");
    cuda::stream_handle(device_);  // makes this rank's GPU current
  }
  void check_device(const BufferSpan& b, const char* op) const {
    BOOSTER_CHECK(b.device == Device::cuda(device_), DeviceError, op, ": the nccl backend takes buffers on cuda:",
                  device_, ", got one on ", b.device, "; use the \"mpi\" backend for CPU tensors");
  }
  // Note [NCCL process group], "Stream order": a blocking form is done once it is queued.
  WorkPtr finish(bool async) { return async ? std::make_shared<EventWork>(stream_, comm_) : nullptr; }

  // ------------------------------------------------------------ Note [Collective timeouts], "nccl"
  struct Pending {
    cudaEvent_t event;  // recorded on the stream right after the collective
    Collective what;
  };

  // Numbers the collective just queued (a point-to-point batch is not numbered), records it (Note
  // [Flight recorder]; `dtype` null for a barrier) and hands it to the watchdog.
  Collective track(CollectiveOp op, size_t bytes, const DType* dtype, int peer = -1) {
    Collective what{op, op == CollectiveOp::SendRecv ? 0 : started_.fetch_add(1) + 1, Clock::now(), timeout(), bytes};
    what.peer = peer;
    // Registered at the first collective: a subgroup learns its world ranks after it is made (split()).
    std::call_once(flight_once_, [&] { flight_group_ = detail::flight_register_group("nccl", name_, size_, rank_, world_of_); });
    what.flight = detail::flight_start(flight_group_, what, dtype);
    std::lock_guard<std::mutex> lock(pending_mutex_);
    cudaEvent_t event = nullptr;
    if (spare_events_.empty()) {
      BOOSTER_NCCL_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    } else {
      event = spare_events_.back();
      spare_events_.pop_back();
    }
    BOOSTER_NCCL_CUDA_CHECK(cudaEventRecord(event, stream_));
    pending_.push_back(Pending{event, what});
    return what;
  }

  std::string timeout_message(const Collective& what, Clock::time_point now) {
    std::string who = "which ranks did not arrive is unknown (the census needs an MPI launcher and MPI_THREAD_MULTIPLE)";
#if defined(BOOSTER_WITH_MPI)
    if (launched_by_mpi_launcher()) detail::note_collective_timeout();
    if (census_ && what.op != CollectiveOp::SendRecv) who = census_->take(started_.load(), what);
#endif
    if (what.op == CollectiveOp::SendRecv)
      who = str(detail::rank_names({what.peer}, world_of_),
                " (or another peer of the batch) did not post the matching send or receive");
    if (size_ == 1) who = "the GPU did not finish it (this is the only rank)";
    return detail::timeout_message(what, name_, size_, rank_, world_of_, now - what.start, who);
  }

  // The watchdog thread: every 100 ms, forgets the collectives the GPU has finished (they finish in
  // stream order), answers census queries, and ends the job when the oldest unfinished one is past its
  // deadline: a host thread may be blocked in a CUDA synchronization that only ncclCommAbort releases,
  // so it cannot be told by an exception (torch's watchdog tears the process down likewise).
  void watch() {
    cudaSetDevice(device_);
    std::unique_lock<std::mutex> stop_lock(watch_mutex_);
    while (!watch_cv_.wait_for(stop_lock, std::chrono::milliseconds(100), [this] { return stop_; })) {
      if (timed_out_.load()) continue;  // a barrier reported it
      std::optional<Collective> oldest;
      {
        std::lock_guard<std::mutex> lock(pending_mutex_);
        while (!pending_.empty() && cudaEventQuery(pending_.front().event) == cudaSuccess) {
          // Note [Flight recorder]: a collective of this group is completed when the watchdog sees it so.
          detail::flight_end(pending_.front().what.flight, detail::FlightState::Completed);
          spare_events_.push_back(pending_.front().event);
          pending_.pop_front();
        }
        if (!pending_.empty()) oldest = pending_.front().what;
      }
#if defined(BOOSTER_WITH_MPI)
      if (census_) {
        try {
          census_->answer(started_.load(), oldest && oldest->op != CollectiveOp::SendRecv ? &*oldest : nullptr);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "booster: rank %d: the nccl watchdog could not answer a census: %s\n", rank_, e.what());
        }
      }
#endif
      const Clock::time_point now = Clock::now();
      if (oldest && now >= oldest->deadline() && !timed_out_.exchange(true)) {
        stop_lock.unlock();
        detail::flight_dump_on_timeout(*oldest, name_);
        abort(1, timeout_message(*oldest, now));  // ncclCommAbort, then MPI_Abort or exit
      }
    }
  }

  int rank_ = 0, size_ = 1, device_ = 0;
  // World rank of each rank, for messages; empty: named by this group's ranks (the world group). A
  // subgroup learns its members' world ranks in split().
  std::vector<int> world_of_;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  std::string name_ = "world";
  void* barrier_buf_ = nullptr;
  std::atomic<uint64_t> started_{0};
  std::atomic<bool> timed_out_{false};
  std::once_flag flight_once_;
  int flight_group_ = -1;  // detail::flight_register_group, at the first collective
  std::mutex pending_mutex_;
  std::deque<Pending> pending_;             // collectives the GPU may not have finished, oldest first
  std::vector<cudaEvent_t> spare_events_;   // finished ones' events, for reuse
#if defined(BOOSTER_WITH_MPI)
  std::optional<detail::Census> census_;
#endif
  std::mutex watch_mutex_;
  std::condition_variable watch_cv_;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace

bool nccl_built() { return true; }

std::shared_ptr<ProcessGroup> make_nccl_process_group(ProcessGroup* bootstrap) {
  return std::make_shared<NcclProcessGroup>(bootstrap);
}

#endif

}  // namespace booster::distributed
