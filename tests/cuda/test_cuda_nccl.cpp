// The NCCL process group on CUDA tensors at world size 1 (one GPU, no launcher): every collective runs
// through NCCL on the backend's stream, blocking and async, and leaves the values a one-rank world
// must have. Multi-GPU runs need a machine with several GPUs. Skipped, with the reason, without a GPU
// or without NCCL in the build.
#include <catch2/catch.hpp>

#include "booster/backends/cuda/cuda.h"
#include "booster/booster/build_info.h"
#include "booster/distributed/device_mesh.h"
#include "booster/distributed/nccl_process_group.h"
#include "booster/ops/ops.h"
#include "skip.h"

using namespace booster;
using namespace booster::distributed;

namespace {

bool skip_without_nccl() {
  if (cuda::is_available() && nccl_built()) return false;
  skip_test(!nccl_built() ? "no NCCL in this build" : cuda::unavailable_reason());
  return true;
}

}  // namespace

TEST_CASE("nccl: collectives at world size 1 on CUDA tensors", "[cuda][nccl]") {
  if (skip_without_nccl()) {
    CHECK_THROWS_AS(make_nccl_process_group(), ConfigError);
    return;
  }
  auto pg = make_nccl_process_group();
  CHECK(pg->backend() == "nccl");
  CHECK(pg->rank() == 0);
  CHECK(pg->size() == 1);
  CHECK(pg->device() == Device::cuda(0));
  for (DType dt : {DType::Float32, DType::Float16, DType::BFloat16, DType::Float64}) {
    INFO(dtype_name(dt));
    const std::vector<double> values{1, -2, 3.5, 4};
    Tensor t = from_vector(values, {2, 2}, dt).to(Device::cuda());
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
      pg->all_reduce(t, op);
      CHECK(t.cpu().tolist() == values);
    }
    pg->broadcast(t, 0);
    CHECK(t.cpu().tolist() == values);
    Tensor gathered = zeros({4}, dt, Device::cuda());
    pg->all_gather(gathered, t);
    CHECK(gathered.cpu().tolist() == values);
    Tensor scattered = zeros({4}, dt, Device::cuda());
    pg->reduce_scatter(scattered, gathered);
    CHECK(scattered.cpu().tolist() == values);
    WorkPtr w = pg->all_reduce_async(t);
    w->wait();  // orders the stream after the collective; the copy to the host below waits for it
    CHECK(t.cpu().tolist() == values);
    CHECK(w->is_completed());
    Tensor scratch = gathered.clone();
    pg->reduce_scatter_consuming(scattered, scratch, ReduceOp::Avg);
    CHECK(scattered.cpu().tolist() == values);
  }
  pg->barrier();
  // CPU tensors belong to the mpi backend: the message says so.
  Tensor host = ones({3});
  CHECK_THROWS_AS(pg->all_reduce(host), DeviceError);
}

// Note [A group per device]: init_process_group("nccl") after process_group_for(cuda) made the NCCL group
// takes that group (a second communicator over the same ranks would be a second NCCL world), and then the
// CPU has no group, which process_group_for(cpu) says at once.
TEST_CASE("nccl: the default nccl group is the one process_group_for(cuda) made, and the CPU then has none",
          "[cuda][nccl]") {
  if (skip_without_nccl()) {
    if (!is_initialized()) {
      CHECK_THROWS_AS(init_process_group("nccl"), ConfigError);
      CHECK_FALSE(is_initialized());  // a failed nccl group leaves no default group behind
    }
    return;
  }
  REQUIRE_FALSE(is_initialized());  // this binary makes no default group before
  ProcessGroup& lazy = process_group_for(Device::cuda());
  ProcessGroup& world = init_process_group("nccl");
  CHECK(&world == &lazy);
  CHECK(&default_process_group() == &lazy);
  CHECK(&process_group_for(Device::cuda()) == &lazy);
  CHECK_THROWS_AS(process_group_for(Device::cpu()), DeviceError);
  CHECK_THROWS_WITH(process_group_for(Device::cpu()), Catch::Contains("\"nccl\"") && Catch::Contains("auto"));
  // The shared group still works after the other owner took it.
  Tensor t = full({3}, 2.0, DType::Float32, Device::cuda());
  world.all_reduce(t, ReduceOp::Avg);
  CHECK(t.cpu().tolist() == std::vector<double>{2, 2, 2});
}

TEST_CASE("nccl: split makes a subgroup through ncclCommSplit, and a negative color none", "[cuda][nccl]") {
  if (skip_without_nccl()) return;
  auto pg = make_nccl_process_group();
  std::shared_ptr<ProcessGroup> sub = pg->split(3, 0, "sub");
  REQUIRE(sub != nullptr);
  CHECK(sub->backend() == "nccl");
  CHECK(sub->size() == 1);
  CHECK(sub->device() == pg->device());
  Tensor t = from_vector(std::vector<double>{2, -1}, {2}, DType::Float32).to(Device::cuda());
  sub->all_reduce(t);
  CHECK(t.cpu().tolist() == std::vector<double>{2, -1});
  sub->barrier();
  CHECK(pg->split(-1, 0, "none") == nullptr);
  const DeviceMesh mesh(*pg, 1, 1);
  CHECK(mesh.tp_group().backend() == "nccl");
}
