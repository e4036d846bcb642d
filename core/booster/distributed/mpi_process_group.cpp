#include "booster/distributed/mpi_process_group.h"

#if BOOSTER_WITH_MPI

// The C API only: OpenMPI's deprecated C++ bindings are not used.
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>
#include <stdlib.h>  // on_exit (glibc)

#include "booster/distributed/collective_timeout_impl.h"
#include "booster/distributed/flight_recorder_impl.h"
#include "booster/distributed/reduce_impl.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>

namespace booster::distributed {

namespace {

// ---------------------------------------------------------------------------------------- runtime

// Process-wide MPI state: initialized once, read-only afterwards.
struct MpiRuntime {
  bool we_initialized = false;  // finalize at exit only what we started
  int thread_provided = -1;
  int world_rank = 0;
  int world_size = 1;
  int node_rank = 0;  // among the ranks that share this node's memory (MPI_COMM_TYPE_SHARED)
  int node_size = 1;
  // User-defined reductions for float16 / bfloat16, indexed by reduce_slot().
  MPI_Op half_ops[3] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  MPI_Op bf16_ops[3] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  // A collective timed out (Note [Collective timeouts]): a rank may be missing, so exit aborts.
  std::atomic<bool> timed_out{false};
};

MpiRuntime g_mpi;
std::once_flag g_mpi_once;

bool mpi_finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, size_t(length));
}

using detail::Backoff;
using detail::Census;
using detail::check_mpi;
using detail::Clock;
using detail::Collective;
using detail::collective_name;
using detail::CollectiveOp;
using detail::note_collective_timeout;
using detail::Seconds;
using detail::timeout_message;

// See Note [Failing ranks]: an uncaught exception ends the whole job, not only this rank.
[[noreturn]] void abort_job_on_terminate() {
  std::string what = "std::terminate was called";
  if (std::exception_ptr e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      what = str("uncaught exception: ", ex.what());
    } catch (...) {
      what = "uncaught exception of a non-std type";
    }
  }
  std::fprintf(stderr, "booster: rank %d of %d: %s; aborting the MPI job so no rank waits for this one\n",
               g_mpi.world_rank, g_mpi.world_size, what.c_str());
  std::fflush(stderr);
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized && !mpi_finalized()) MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

// See Note [Failing ranks]: a non-zero exit aborts the job; a zero exit finalizes.
void finalize_at_exit(int status, void*) {
  if (mpi_finalized()) return;
  if (status == 0 && g_mpi.timed_out.load()) {
    // Note [Collective timeouts]: MPI_Finalize would wait for the rank that never arrived.
    std::fprintf(stderr, "booster: rank %d of %d exits after a collective timed out; aborting the MPI job\n",
                 g_mpi.world_rank, g_mpi.world_size);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  if (status != 0 && g_mpi.world_size > 1) {
    std::fprintf(stderr,
                 "booster: rank %d of %d exits with status %d; aborting the MPI job so no rank waits "
                 "for this one\n",
                 g_mpi.world_rank, g_mpi.world_size, status);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, status);
  }
  if (g_mpi.we_initialized) MPI_Finalize();
}

// ---------------------------------------------------------------------------------------- 16-bit ops

int reduce_slot(ReduceOp op) { return op == ReduceOp::Max ? 1 : op == ReduceOp::Min ? 2 : 0; }

// inout[i] = inout[i] (op) in[i] for 16-bit floats, as every CPU group combines them (reduce_impl.h).
template <class Half16, int Slot>
void reduce_16bit(void* in_v, void* inout_v, int* len, MPI_Datatype*) {
  constexpr ReduceOp kOps[3] = {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min};
  constexpr DType kDType = std::is_same_v<Half16, Half> ? DType::Float16 : DType::BFloat16;
  detail::reduce_into(inout_v, in_v, *len, kDType, kOps[Slot], "all_reduce");
}

void init_mpi_once() {
  int initialized = 0;
  check_mpi(MPI_Initialized(&initialized), "init_process_group", "MPI_Initialized");
  if (initialized && mpi_finalized())
    BOOSTER_FAIL(DistributedError, "init_process_group: MPI was already finalized in this process");
  if (!initialized) {
    // See Note [MPI progress]: OpenMPI picks a reduce-then-broadcast tree for in-place non-blocking
    // all-reduces, about twice slower than the blocking call on large buffers. Rabenseifner's
    // reduce-scatter + all-gather is as fast as the blocking one. A value the user set wins.
    setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "3", /*overwrite=*/0);
    int provided = -1;
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS)
      BOOSTER_FAIL(DistributedError, "init_process_group: MPI_Init_thread failed (error ", rc,
                   "); is this process started by mpirun, and is OpenMPI installed?");
    g_mpi.we_initialized = true;
    g_mpi.thread_provided = provided;
  } else {
    check_mpi(MPI_Query_thread(&g_mpi.thread_provided), "init_process_group", "MPI_Query_thread");
  }
  check_mpi(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "init_process_group",
            "MPI_Comm_set_errhandler");
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &g_mpi.world_rank), "init_process_group", "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &g_mpi.world_size), "init_process_group", "MPI_Comm_size");
  MPI_Comm node = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, g_mpi.world_rank, MPI_INFO_NULL, &node),
            "init_process_group", "MPI_Comm_split_type");
  check_mpi(MPI_Comm_rank(node, &g_mpi.node_rank), "init_process_group", "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(node, &g_mpi.node_size), "init_process_group", "MPI_Comm_size");
  MPI_Comm_free(&node);

  auto make_op = [](MPI_User_function* fn, MPI_Op* op) {
    check_mpi(MPI_Op_create(fn, /*commute=*/1, op), "init_process_group", "MPI_Op_create");
  };
  make_op(&reduce_16bit<Half, 0>, &g_mpi.half_ops[0]);
  make_op(&reduce_16bit<Half, 1>, &g_mpi.half_ops[1]);
  make_op(&reduce_16bit<Half, 2>, &g_mpi.half_ops[2]);
  make_op(&reduce_16bit<BFloat16, 0>, &g_mpi.bf16_ops[0]);
  make_op(&reduce_16bit<BFloat16, 1>, &g_mpi.bf16_ops[1]);
  make_op(&reduce_16bit<BFloat16, 2>, &g_mpi.bf16_ops[2]);

  std::set_terminate(&abort_job_on_terminate);
  on_exit(&finalize_at_exit, nullptr);
}

// ---------------------------------------------------------------------------------------- mapping

MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::Float32: return MPI_FLOAT;
    case DType::Float64: return MPI_DOUBLE;
    case DType::Int64: return MPI_INT64_T;
    case DType::Int32: return MPI_INT32_T;
    case DType::Float16:
    case DType::BFloat16: return MPI_UINT16_T;  // moved as bits; reduced by our own ops
    case DType::Bool:
    case DType::Float8E4M3FN:
    case DType::Float8E5M2: return MPI_UINT8_T;  // moved as bytes; reductions refused (mpi_op)
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(ReduceOp op, DType dtype) {
  if (dtype == DType::Float16) return g_mpi.half_ops[reduce_slot(op)];
  if (dtype == DType::BFloat16) return g_mpi.bf16_ops[reduce_slot(op)];
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg: return MPI_SUM;  // of values divided first, or divided afterwards
    case ReduceOp::Max: return MPI_MAX;
    case ReduceOp::Min: return MPI_MIN;
  }
  return MPI_OP_NULL;
}

// Avg's division by the world size (Note [Averages divide first]): buf /= divisor.
void divide_by(const BufferSpan& buf, int divisor) { detail::divide_by(buf.data, buf.numel, buf.dtype, divisor); }

// MPI counts are int: all_reduce and broadcast split larger buffers into pieces of this many.
constexpr int64_t kMaxChunk = int64_t(1) << 30;

int checked_count(int64_t n, const char* op) {
  BOOSTER_CHECK(n <= INT_MAX, ValueError, op, ": ", n,
                " elements per rank exceed what one MPI call takes (", INT_MAX, ")");
  return int(n);
}

std::string thread_level_name(int level) {
  if (level == MPI_THREAD_SINGLE) return "single";
  if (level == MPI_THREAD_FUNNELED) return "funneled";
  if (level == MPI_THREAD_SERIALIZED) return "serialized";
  if (level == MPI_THREAD_MULTIPLE) return "multiple";
  return "none";
}

// ---------------------------------------------------------------------------------------- waiting

// The MPI side of a group: its communicators, the sequence of its collectives and the wait loop.
// Shared by the group and its Works, since a Work may outlive its group.
class MpiComm {
 public:
  explicit MpiComm(std::string name) : name_(std::move(name)) {
    if (g_mpi.thread_provided < MPI_THREAD_MULTIPLE) mpi_mutex_.emplace();
    // A communicator of our own: collectives of the application's MPI code cannot match ours.
    check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "init_process_group", "MPI_Comm_dup");
    init();
  }
  // Takes over `comm` (a subgroup's communicator, from MPI_Comm_split).
  MpiComm(std::string name, MPI_Comm comm) : name_(std::move(name)), comm_(comm) {
    if (g_mpi.thread_provided < MPI_THREAD_MULTIPLE) mpi_mutex_.emplace();
    init();
  }
  void init() {
    check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "init_process_group", "MPI_Comm_set_errhandler");
    check_mpi(MPI_Comm_rank(comm_, &rank_), "init_process_group", "MPI_Comm_rank");
    check_mpi(MPI_Comm_size(comm_, &size_), "init_process_group", "MPI_Comm_size");
    world_of_ = detail::world_ranks_of(comm_);
    census_.emplace(comm_, mpi_mutex_ ? &*mpi_mutex_ : nullptr);
    detail::flight_set_world_rank(g_mpi.world_rank);  // Note [Flight recorder]: names its record
    flight_group_ = detail::flight_register_group("mpi", name_, size_, rank_, world_of_);
  }
  ~MpiComm() {
    census_.reset();
    if (!mpi_finalized()) MPI_Comm_free(&comm_);
  }

  MPI_Comm comm() const { return comm_; }
  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return size_; }

  // Locks the MPI mutex when MPI does not support concurrent calls from several threads.
  std::unique_lock<std::mutex> maybe_lock() {
    return mpi_mutex_ ? std::unique_lock<std::mutex>(*mpi_mutex_) : std::unique_lock<std::mutex>();
  }
  // True once a collective of the group timed out (Note [Collective timeouts]).
  bool broken() const { return broken_.load(std::memory_order_acquire); }

  // Numbers a collective about to start and records it (Note [Flight recorder]); DistributedError once
  // the group has timed out. `dtype`: of its elements, null for a barrier.
  Collective begin(CollectiveOp op, Seconds timeout, size_t bytes, const DType* dtype) {
    if (broken()) [[unlikely]]
      refuse(op);
    Collective what{op, started_.fetch_add(1) + 1, Clock::now(), timeout, bytes};
    what.flight = detail::flight_start(flight_group_, what, dtype);
    return what;
  }

  // Starts a point-to-point batch (not numbered: only its peers take part); DistributedError once the
  // group has timed out.
  Collective begin_p2p(Seconds timeout, size_t bytes, int peer, DType dtype) {
    if (broken()) [[unlikely]]
      refuse(CollectiveOp::SendRecv);
    Collective what{CollectiveOp::SendRecv, 0, Clock::now(), timeout, bytes};
    what.peer = peer;
    what.flight = detail::flight_start(flight_group_, what, &dtype);
    return what;
  }

  // True when every request has completed; `statuses` (one per request, or null) then holds theirs.
  // `what` names the collective in errors.
  bool test(std::vector<MPI_Request>& requests, const Collective& what, MPI_Status* statuses = nullptr) {
    int flag = 0;
    auto lock = maybe_lock();
    check_mpi(MPI_Testall(int(requests.size()), requests.data(), &flag, statuses ? statuses : MPI_STATUSES_IGNORE),
              collective_name(what.op), "MPI_Testall");
    return flag != 0;
  }

  // Returns when every request has completed; DistributedError at the collective's deadline (Note
  // [Collective timeouts]).
  void wait(std::vector<MPI_Request>& requests, const Collective& what, MPI_Status* statuses = nullptr) {
    if (broken()) [[unlikely]]
      refuse(what.op);
    Backoff backoff(what.bytes);
    const Clock::time_point deadline = what.deadline();
    while (!test(requests, what, statuses)) {
      const Clock::time_point now = Clock::now();
      if (now >= deadline) [[unlikely]]
        time_out(what, now);
      // A rank in a point-to-point wait answers a census as one waiting in no collective.
      if (backoff.sleeping(now))
        census_->answer(started_.load(), what.op == CollectiveOp::SendRecv ? nullptr : &what);
      backoff.pause(now);
    }
    detail::flight_end(what.flight, detail::FlightState::Completed);
  }

 private:
  [[noreturn]] void refuse(CollectiveOp op) {
    std::lock_guard<std::mutex> guard(broken_mutex_);
    BOOSTER_FAIL(DistributedError, collective_name(op), ": group \"", name_, "\" is unusable since ", broken_why_,
                 " timed out on rank ", rank_);
  }

  [[noreturn]] void time_out(const Collective& what, Clock::time_point now) {
    {
      std::lock_guard<std::mutex> guard(broken_mutex_);
      broken_why_ = str(collective_name(what.op), " #", what.seq);
      broken_.store(true, std::memory_order_release);
    }
    note_collective_timeout();
    detail::flight_dump_on_timeout(what, name_);  // before the census, which may fail in turn
    // Only the peers of a point-to-point batch take part, so there is nobody else to ask.
    const std::string who =
        what.op == CollectiveOp::SendRecv
            ? str(detail::rank_names({what.peer}, world_of_),
                  " (or another peer of the batch) did not post the matching send or receive")
            : census_->take(started_.load(), what);
    BOOSTER_FAIL(DistributedError, timeout_message(what, name_, size_, rank_, world_of_, now - what.start, who));
  }

  std::string name_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::optional<std::mutex> mpi_mutex_;  // set when MPI is not MPI_THREAD_MULTIPLE
  std::optional<Census> census_;         // Note [Collective timeouts]
  std::vector<int> world_of_;            // detail::world_ranks_of(comm_): messages name world ranks
  int flight_group_ = -1;                // detail::flight_register_group
  std::atomic<uint64_t> started_{0};
  std::atomic<bool> broken_{false};
  std::mutex broken_mutex_;
  std::string broken_why_;  // the collective that timed out
};

// ---------------------------------------------------------------------------------------- group

// What a receive of a point-to-point batch expects: its request's index, element count and type.
struct ExpectedReceive {
  size_t request = 0;
  int count = 0;
  MPI_Datatype type = MPI_DATATYPE_NULL;
  int peer = 0, tag = 0;
};

// A started non-blocking collective: its requests and the step that finishes the result (Avg), or a
// point-to-point batch and the sizes its receives must get.
class MpiWork final : public Work {
 public:
  MpiWork(std::shared_ptr<MpiComm> comm, Collective what, std::vector<MPI_Request> requests,
          std::function<void()> finish, std::vector<ExpectedReceive> receives = {})
      : comm_(std::move(comm)),
        what_(what),
        requests_(std::move(requests)),
        finish_(std::move(finish)),
        receives_(std::move(receives)),
        statuses_(receives_.empty() ? 0 : requests_.size()) {}
  ~MpiWork() override;
  void wait() override {
    if (done_) return;
    comm_->wait(requests_, what_, statuses());
    complete();
  }
  bool is_completed() override {
    if (!done_ && comm_->test(requests_, what_, statuses())) {
      detail::flight_end(what_.flight, detail::FlightState::Completed);
      complete();
    }
    return done_;
  }

 private:
  MPI_Status* statuses() { return statuses_.empty() ? nullptr : statuses_.data(); }
  void complete() {
    done_ = true;
    if (finish_) finish_();
    // A shorter message than the buffer would leave its tail stale: Note [Point-to-point].
    for (const ExpectedReceive& r : receives_) {
      int got = 0;
      check_mpi(MPI_Get_count(&statuses_[r.request], r.type, &got), "recv", "MPI_Get_count");
      BOOSTER_CHECK(got == r.count, DistributedError, "recv: rank ", comm_->rank(), " of group \"", comm_->name(),
                    "\" expected ", r.count, " elements from rank ", r.peer, " (tag ", r.tag, ") but got ", got,
                    "; the sender's tensor must have the receiver's size and dtype");
    }
  }

  std::shared_ptr<MpiComm> comm_;
  Collective what_;
  std::vector<MPI_Request> requests_;
  std::function<void()> finish_;
  std::vector<ExpectedReceive> receives_;
  std::vector<MPI_Status> statuses_;
  bool done_ = false;
};

MpiWork::~MpiWork() {
  // After a timeout the group's error has been thrown already (Note [Collective timeouts]).
  if (done_ || mpi_finalized() || comm_->broken()) return;
  try {
    wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "booster: %s dropped without wait() and failed: %s\n", collective_name(what_.op),
                 e.what());
  }
}

// Every collective is started non-blocking; a blocking form waits for it at once (Note [Collective
// timeouts]).
class MpiProcessGroup final : public ProcessGroup {
 public:
  // The timeout is read when each collective starts, so it may be set after the group exists.
  MpiProcessGroup() : comm_((ensure_mpi_initialized(), std::make_shared<MpiComm>("world"))) {}
  explicit MpiProcessGroup(std::shared_ptr<MpiComm> comm) : comm_(std::move(comm)) {}

  std::shared_ptr<ProcessGroup> split(int color, int key, const std::string& name) override {
    BOOSTER_CHECK(!comm_->broken(), DistributedError, "split: group \"", comm_->name(),
                  "\" is unusable since a collective of it timed out");
    MPI_Comm sub = MPI_COMM_NULL;
    {
      auto lock = comm_->maybe_lock();
      check_mpi(MPI_Comm_split(comm_->comm(), color < 0 ? MPI_UNDEFINED : color, key < 0 ? rank() : key, &sub),
                "split", "MPI_Comm_split");
    }
    if (sub == MPI_COMM_NULL) return nullptr;
    return std::make_shared<MpiProcessGroup>(std::make_shared<MpiComm>(name, sub));
  }

  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  std::string backend() const override { return "mpi"; }
  Device device() const override { return Device::cpu(); }

  void barrier() override {
    const Collective what = comm_->begin(CollectiveOp::Barrier, timeout(), 0, nullptr);
    std::vector<MPI_Request> requests(1);
    {
      auto lock = comm_->maybe_lock();
      check_mpi(MPI_Ibarrier(comm_->comm(), &requests.back()), "barrier", "MPI_Ibarrier");
    }
    comm_->wait(requests, what);
  }

  [[noreturn]] void abort(int exit_code, const std::string& why) override {
    std::fprintf(stderr, "booster: rank %d of %d aborts the MPI job: %s\n", rank(), size(), why.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, exit_code == 0 ? 1 : exit_code);
    std::abort();
  }

 protected:
  WorkPtr all_reduce_impl(const BufferSpan& buf, ReduceOp op, bool async) override {
    check_cpu(buf, "all_reduce");
    if (buf.numel == 0) return completed_work();
    const MPI_Datatype type = mpi_type(buf.dtype);
    const MPI_Op mop = mpi_op(op, buf.dtype);
    const char* name = async ? "all_reduce_async" : "all_reduce";
    // Note [Averages divide first]: the buffer is ours to overwrite, so Avg sums values divided first.
    if (op == ReduceOp::Avg && size() > 1) divide_by(buf, size());
    const Collective what = comm_->begin(CollectiveOp::AllReduce, timeout(), buf.nbytes(), &buf.dtype);
    std::vector<MPI_Request> requests;
    {
      auto lock = comm_->maybe_lock();
      for (int64_t start = 0; start < buf.numel; start += kMaxChunk) {
        const BufferSpan piece = buf.slice(start, std::min(kMaxChunk, buf.numel - start));
        requests.emplace_back();
        check_mpi(MPI_Iallreduce(MPI_IN_PLACE, piece.data, int(piece.numel), type, mop, comm_->comm(),
                                 &requests.back()),
                  name, "MPI_Iallreduce");
      }
    }
    return finish_or_work(async, what, std::move(requests), nullptr);
  }

  WorkPtr broadcast_impl(const BufferSpan& buf, int root, bool async) override {
    check_cpu(buf, "broadcast");
    if (buf.numel == 0) return completed_work();
    const MPI_Datatype type = mpi_type(buf.dtype);
    const char* name = async ? "broadcast_async" : "broadcast";
    const Collective what = comm_->begin(CollectiveOp::Broadcast, timeout(), buf.nbytes(), &buf.dtype);
    std::vector<MPI_Request> requests;
    {
      auto lock = comm_->maybe_lock();
      for (int64_t start = 0; start < buf.numel; start += kMaxChunk) {
        const BufferSpan piece = buf.slice(start, std::min(kMaxChunk, buf.numel - start));
        requests.emplace_back();
        check_mpi(MPI_Ibcast(piece.data, int(piece.numel), type, root, comm_->comm(), &requests.back()), name,
                  "MPI_Ibcast");
      }
    }
    return finish_or_work(async, what, std::move(requests), nullptr);
  }

  WorkPtr all_gather_impl(const BufferSpan& out, const BufferSpan& in, bool async) override {
    check_cpu(in, "all_gather");
    if (in.numel == 0) return completed_work();
    const int count = checked_count(in.numel, "all_gather");
    const MPI_Datatype type = mpi_type(in.dtype);
    // `in` as this rank's slice of `out` is MPI's in-place all-gather.
    const bool in_place = in.data == out.slice(int64_t(rank()) * in.numel, in.numel).data;
    const void* send = in_place ? MPI_IN_PLACE : in.data;
    const Collective what = comm_->begin(CollectiveOp::AllGather, timeout(), out.nbytes(), &in.dtype);
    std::vector<MPI_Request> requests(1);
    {
      auto lock = comm_->maybe_lock();
      check_mpi(MPI_Iallgather(send, count, type, out.data, count, type, comm_->comm(), &requests.back()),
                async ? "all_gather_async" : "all_gather", "MPI_Iallgather");
    }
    return finish_or_work(async, what, std::move(requests), nullptr);
  }

  WorkPtr reduce_scatter_impl(const BufferSpan& out, const BufferSpan& in, ReduceOp op,
                              bool async) override {
    check_cpu(in, "reduce_scatter");
    if (out.numel == 0) return completed_work();
    const int count = checked_count(out.numel, "reduce_scatter");
    const MPI_Datatype type = mpi_type(in.dtype);
    const MPI_Op mop = mpi_op(op, in.dtype);
    std::function<void()> finish;  // `in` must stay unchanged: Avg divides the sum
    if (op == ReduceOp::Avg) finish = [out, n = size()] { divide_by(out, n); };
    const Collective what = comm_->begin(CollectiveOp::ReduceScatter, timeout(), in.nbytes(), &in.dtype);
    std::vector<MPI_Request> requests(1);
    {
      auto lock = comm_->maybe_lock();
      check_mpi(MPI_Ireduce_scatter_block(in.data, out.data, count, type, mop, comm_->comm(), &requests.back()),
                async ? "reduce_scatter_async" : "reduce_scatter", "MPI_Ireduce_scatter_block");
    }
    return finish_or_work(async, what, std::move(requests), std::move(finish));
  }

  // Note [Point-to-point]: every op is started at once; one Work waits for them all.
  WorkPtr send_recv_impl(const std::vector<P2PSpan>& ops) override {
    size_t bytes = 0;
    for (const P2PSpan& op : ops) {
      check_cpu(op.buf, op.send ? "send" : "recv");
      checked_count(op.buf.numel, op.send ? "send" : "recv");
      bytes += op.buf.nbytes();
    }
    const Collective what = comm_->begin_p2p(timeout(), bytes, ops.front().peer, ops.front().buf.dtype);
    std::vector<MPI_Request> requests;
    std::vector<ExpectedReceive> receives;
    {
      auto lock = comm_->maybe_lock();
      for (const P2PSpan& op : ops) {
        requests.emplace_back();  // empty messages too: a send of none still matches a receive of none
        const int count = int(op.buf.numel);
        if (!op.send) receives.push_back({requests.size() - 1, count, mpi_type(op.buf.dtype), op.peer, op.tag});
        if (op.send)
          check_mpi(MPI_Isend(op.buf.data, count, mpi_type(op.buf.dtype), op.peer, op.tag, comm_->comm(),
                              &requests.back()),
                    "send", "MPI_Isend");
        else
          check_mpi(MPI_Irecv(op.buf.data, count, mpi_type(op.buf.dtype), op.peer, op.tag, comm_->comm(),
                              &requests.back()),
                    "recv", "MPI_Irecv");
      }
    }
    return std::make_shared<MpiWork>(comm_, what, std::move(requests), nullptr, std::move(receives));
  }

  // Note [Averages divide first]: `in` is scratch, so Avg divides it and sums.
  WorkPtr reduce_scatter_consuming_impl(const BufferSpan& out, const BufferSpan& in, ReduceOp op) override {
    if (op != ReduceOp::Avg || size() == 1 || out.numel == 0) return reduce_scatter_impl(out, in, op, false);
    check_cpu(in, "reduce_scatter_consuming");
    divide_by(in, size());
    return reduce_scatter_impl(out, in, ReduceOp::Sum, false);
  }

 private:
  static void check_cpu(const BufferSpan& buf, const char* op) {
    BOOSTER_CHECK(buf.device.is_cpu(), DeviceError, op, ": the mpi backend takes CPU buffers, got ",
                  buf.device, "; CUDA tensors need the nccl backend");
  }

  // A blocking form waits here (Note [Collective timeouts]); a non-blocking one hands out its Work.
  WorkPtr finish_or_work(bool async, const Collective& what, std::vector<MPI_Request> requests,
                         std::function<void()> finish) {
    if (!async) {
      comm_->wait(requests, what);
      if (finish) finish();
      return nullptr;
    }
    return std::make_shared<MpiWork>(comm_, what, std::move(requests), std::move(finish));
  }

  std::shared_ptr<MpiComm> comm_;
};

}  // namespace

void detail::check_mpi(int code, const char* op, const char* call) {
  if (code == MPI_SUCCESS) [[likely]]
    return;
  BOOSTER_FAIL(DistributedError, op, ": ", call, " failed on rank ", g_mpi.world_rank, " of ",
               g_mpi.world_size, ": ", mpi_error_string(code));
}

void detail::note_collective_timeout() { g_mpi.timed_out.store(true); }

bool mpi_built() { return true; }

void ensure_mpi_initialized() { std::call_once(g_mpi_once, init_mpi_once); }

std::shared_ptr<ProcessGroup> make_mpi_process_group() { return std::make_shared<MpiProcessGroup>(); }

std::string mpi_thread_support() { return thread_level_name(g_mpi.thread_provided); }

NodeRanks mpi_node_ranks() {
  ensure_mpi_initialized();
  return {g_mpi.node_rank, g_mpi.node_size};
}

void finalize_mpi_for_agreed_exit() {
  if (g_mpi.we_initialized && !mpi_finalized()) MPI_Finalize();
}

}  // namespace booster::distributed

#else  // !BOOSTER_WITH_MPI

namespace booster::distributed {

bool mpi_built() { return false; }

void ensure_mpi_initialized() {
  BOOSTER_FAIL(ConfigError, "MPI is needed (a process started by an MPI launcher) but booster was built without "
                            "it (OpenMPI was not found when booster was configured)");
}

std::shared_ptr<ProcessGroup> make_mpi_process_group() {
  BOOSTER_FAIL(ConfigError, "init_process_group: backend \"mpi\" needs a build with MPI (OpenMPI was "
                            "not found when booster was configured); use \"local\" for one process");
}

std::string mpi_thread_support() { return "none"; }

NodeRanks mpi_node_ranks() {
  ensure_mpi_initialized();  // throws: no MPI in this build
  return {};
}

void finalize_mpi_for_agreed_exit() {}

}  // namespace booster::distributed

#endif
