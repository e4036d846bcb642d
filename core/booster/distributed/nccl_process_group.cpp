#include "booster/distributed/nccl_process_group.h"

#include "booster/backends/cuda/cuda.h"

#if defined(BOOSTER_WITH_NCCL)
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>

#include "booster/distributed/mpi_process_group.h"
#if defined(BOOSTER_WITH_MPI)
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>
#endif
#endif

namespace booster::distributed {

#if !defined(BOOSTER_WITH_NCCL)

bool nccl_built() { return false; }

std::shared_ptr<ProcessGroup> make_nccl_process_group() {
  BOOSTER_FAIL(ConfigError, "backend \"nccl\" needs a build with CUDA and NCCL (",
               cuda::is_compiled() ? "NCCL was not found" : "nvcc was not found",
               " when booster was configured); train on the CPU (backend \"mpi\" or \"local\"), or rebuild "
               "booster with CUDA and NCCL");
}

#else

namespace {

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
    case DType::Bool: return ncclUint8;
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
  NcclProcessGroup() {
    BOOSTER_CHECK(cuda::is_available(), ConfigError, "backend \"nccl\" needs a GPU: ", cuda::unavailable_reason(),
                  "; train on the CPU, or run on a machine with a GPU");
    ncclUniqueId id;
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
    } else {
      BOOSTER_NCCL_CHECK(ncclGetUniqueId(&id));
    }
    device_ = rank_ % cuda::device_count();
    stream_ = static_cast<cudaStream_t>(cuda::stream_handle(device_));
    BOOSTER_NCCL_CHECK(ncclCommInitRank(&comm_, size_, id, rank_));
    BOOSTER_NCCL_CUDA_CHECK(cudaMalloc(&barrier_buf_, sizeof(float)));
  }
  ~NcclProcessGroup() override {
    if (comm_) ncclCommDestroy(comm_);
    if (barrier_buf_) cudaFree(barrier_buf_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  Device device() const override { return Device::cuda(device_); }

  void barrier() override {
    enter();
    BOOSTER_NCCL_CHECK(ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclFloat32, ncclSum, comm_, stream_));
    BOOSTER_NCCL_CUDA_CHECK(cudaStreamSynchronize(stream_));
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
    return finish(async);
  }
  WorkPtr broadcast_impl(const BufferSpan& buf, int root, bool async) override {
    if (buf.numel == 0) return completed_work();
    check_device(buf, "broadcast");
    enter();
    BOOSTER_NCCL_CHECK(ncclBroadcast(buf.data, buf.data, size_t(buf.numel), nccl_type(buf.dtype), root, comm_,
                                     stream_));
    return finish(async);
  }
  WorkPtr all_gather_impl(const BufferSpan& out, const BufferSpan& in, bool async) override {
    if (in.numel == 0) return completed_work();
    check_device(out, "all_gather");
    check_device(in, "all_gather");
    enter();
    BOOSTER_NCCL_CHECK(
        ncclAllGather(in.data, out.data, size_t(in.numel), nccl_type(in.dtype), comm_, stream_));
    return finish(async);
  }
  WorkPtr reduce_scatter_impl(const BufferSpan& out, const BufferSpan& in, ReduceOp op, bool async) override {
    if (out.numel == 0) return completed_work();
    check_device(out, "reduce_scatter");
    check_device(in, "reduce_scatter");
    enter();
    BOOSTER_NCCL_CHECK(ncclReduceScatter(in.data, out.data, size_t(out.numel), nccl_type(in.dtype), nccl_op(op),
                                         comm_, stream_));
    return finish(async);
  }

 private:
  void enter() const { cuda::stream_handle(device_); }  // makes this rank's GPU current
  void check_device(const BufferSpan& b, const char* op) const {
    BOOSTER_CHECK(b.device == Device::cuda(device_), DeviceError, op, ": the nccl backend takes buffers on cuda:",
                  device_, ", got one on ", b.device, "; use the \"mpi\" backend for CPU tensors");
  }
  // Note [NCCL process group], "Stream order": a blocking form is done once it is queued.
  WorkPtr finish(bool async) { return async ? std::make_shared<EventWork>(stream_, comm_) : nullptr; }

  int rank_ = 0, size_ = 1, device_ = 0;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  void* barrier_buf_ = nullptr;
};

}  // namespace

bool nccl_built() { return true; }

std::shared_ptr<ProcessGroup> make_nccl_process_group() { return std::make_shared<NcclProcessGroup>(); }

#endif

}  // namespace booster::distributed
