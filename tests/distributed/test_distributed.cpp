// ProcessGroup in one process: the "local" backend's identities, the default group outside mpirun,
// argument checks shared by every backend, and MPI's singleton mode.
#include <catch2/catch.hpp>

#include "skip.h"

#include "booster/backends/cuda/cuda.h"
#include "booster/distributed/device_mesh.h"
#include "booster/distributed/local_process_group.h"
#include "booster/distributed/mpi_process_group.h"
#include "booster/distributed/nccl_process_group.h"
#include "booster/distributed/process_group.h"
#include "booster/ops/ops.h"

#include <cstdlib>

using namespace booster;
using namespace booster::distributed;

TEST_CASE("distributed: default group outside mpirun is the local group of rank 0, size 1", "[distributed]") {
  REQUIRE_FALSE(launched_by_mpi_launcher());
  ProcessGroup& pg = default_process_group();
  REQUIRE(is_initialized());
  REQUIRE(pg.backend() == "local");
  REQUIRE(pg.rank() == 0);
  REQUIRE(pg.size() == 1);
  REQUIRE(&init_process_group("auto") == &pg);
  REQUIRE(&init_process_group("local") == &pg);
  // The default group cannot change backend once made; unknown backends are configuration errors.
  REQUIRE_THROWS_AS(init_process_group("mpi"), StateError);
  REQUIRE_THROWS_WITH(init_process_group("mpi"), Catch::Contains("local") && Catch::Contains("mpi"));
  REQUIRE_THROWS_AS(init_process_group("gloo"), StateError);
}

TEST_CASE("distributed: init_process_group names the backends it knows", "[distributed]") {
  // Run before any default group exists only when this test runs alone (as CTest does); otherwise
  // the switch is refused first. Either way the call throws a typed error.
  if (!is_initialized()) {
    REQUIRE_THROWS_AS(init_process_group("gloo"), ConfigError);
    REQUIRE_THROWS_WITH(init_process_group("gloo"), Catch::Contains("\"mpi\"") &&
                                                        Catch::Contains("\"local\""));
    // Without a GPU (or NCCL in the build) the nccl backend is a configuration error that says why;
    // tests/cuda/test_cuda_nccl.cpp runs it where a GPU is present.
    if (!cuda::is_available()) REQUIRE_THROWS_AS(init_process_group("nccl"), ConfigError);
    REQUIRE_FALSE(is_initialized());
  }
  REQUIRE_THROWS_AS(init_process_group("gloo"), Error);
}

TEST_CASE("distributed: local group: collectives are identities and copies", "[distributed]") {
  LocalProcessGroup pg;
  for (DType dtype : {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16, DType::Int64}) {
    INFO(dtype_name(dtype));
    Tensor t = from_vector(std::vector<double>{1, -2, 3.5, 4}, {2, 2}, dtype);
    const auto values = t.tolist();
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
      if (op == ReduceOp::Avg && !is_floating(dtype)) continue;
      pg.all_reduce(t, op);
      REQUIRE(t.tolist() == values);
      pg.all_reduce_async(t, op)->wait();
      REQUIRE(t.tolist() == values);
    }
    pg.broadcast(t, 0);
    REQUIRE(t.tolist() == values);

    Tensor gathered = zeros({4}, dtype);
    pg.all_gather(gathered, t);
    REQUIRE(gathered.tolist() == values);
    Tensor scattered = zeros({2, 2}, dtype);
    WorkPtr w = pg.reduce_scatter_async(scattered, t);
    REQUIRE(w->is_completed());
    REQUIRE(scattered.tolist() == values);
  }
  // A shard that already is the whole output (in place) stays as it is.
  Tensor buf = from_vector(std::vector<float>{1, 2, 3}, {3});
  pg.all_gather(buf, buf);
  REQUIRE(buf.tolist() == std::vector<double>{1, 2, 3});
  pg.barrier();
}

TEST_CASE("distributed: local group: span overloads touch only the span", "[distributed]") {
  LocalProcessGroup pg;
  Tensor flat = arange(0, 10, 1, DType::Float32);
  Tensor out = zeros({10});
  const BufferSpan src = BufferSpan::of(flat).slice(2, 3);
  const BufferSpan dst = BufferSpan::of(out).slice(5, 3);
  REQUIRE(src.numel == 3);
  REQUIRE(src.nbytes() == 12);
  pg.all_gather(dst, src);
  REQUIRE(out.tolist() == std::vector<double>{0, 0, 0, 0, 0, 2, 3, 4, 0, 0});
  pg.all_reduce(flat.data<float>() + 1, 4, DType::Float32, ReduceOp::Avg);
  REQUIRE(flat.tolist() == arange(0, 10, 1, DType::Float32).tolist());
  REQUIRE_THROWS_AS(BufferSpan::of(flat).slice(8, 3), IndexError);
  REQUIRE_THROWS_AS(BufferSpan::of(flat).slice(-1, 2), IndexError);
}

TEST_CASE("distributed: argument checks are the same on every backend", "[distributed]") {
  LocalProcessGroup pg;
  Tensor m = zeros({3, 4});
  Tensor strided = m.t();
  REQUIRE_THROWS_AS(pg.all_reduce(strided), ShapeError);
  REQUIRE_THROWS_WITH(pg.all_reduce(strided),
                      Catch::Contains("all_reduce") && Catch::Contains("[4, 3]") &&
                          Catch::Contains("[1, 4]"));
  Tensor in = zeros({2, 3});
  Tensor out = zeros({7});
  REQUIRE_THROWS_AS(pg.all_gather(out, in), ShapeError);
  REQUIRE_THROWS_WITH(pg.all_gather_async(out, in),
                      Catch::Contains("all_gather_async") && Catch::Contains("7") &&
                          Catch::Contains("6"));
  REQUIRE_THROWS_AS(pg.reduce_scatter(out, in), ShapeError);
  Tensor out16 = zeros({6}, DType::Float16);
  REQUIRE_THROWS_WITH(pg.all_gather(out16, in), Catch::Contains("float16") &&
                                                    Catch::Contains("float32"));
  Tensor ints = zeros({3}, DType::Int64);
  REQUIRE_THROWS_AS(pg.all_reduce(ints, ReduceOp::Avg), DTypeError);
  REQUIRE_THROWS_AS(pg.reduce_scatter(ints, ints, ReduceOp::Avg), DTypeError);
  REQUIRE_THROWS_AS(pg.broadcast(m, 1), ValueError);
  Tensor undefined;
  REQUIRE_THROWS_AS(pg.all_reduce(undefined), ValueError);
  REQUIRE_THROWS_AS(pg.all_reduce(nullptr, 4, DType::Float32), ValueError);
  // reduce_scatter into its own input would read what it already overwrote.
  Tensor same = zeros({4});
  REQUIRE_THROWS_AS(pg.reduce_scatter(same, same), ValueError);
}

TEST_CASE("distributed: mpi backend outside mpirun is a singleton world", "[distributed]") {
  if (!mpi_built()) {
    REQUIRE_THROWS_AS(make_mpi_process_group(), ConfigError);
    skip_test("this build has no MPI");
    return;
  }
  std::shared_ptr<ProcessGroup> pg = make_mpi_process_group();
  REQUIRE(pg->backend() == "mpi");
  REQUIRE(pg->rank() == 0);
  REQUIRE(pg->size() == 1);
  REQUIRE(mpi_thread_support() != "none");
  Tensor t = from_vector(std::vector<double>{1.5, -2}, {2}, DType::BFloat16);
  pg->all_reduce(t, ReduceOp::Avg);
  REQUIRE(t.tolist() == std::vector<double>{1.5, -2});
  Tensor out = zeros({2}, DType::BFloat16);
  pg->reduce_scatter_async(out, t, ReduceOp::Sum)->wait();
  REQUIRE(out.tolist() == std::vector<double>{1.5, -2});
  pg->barrier();
}

TEST_CASE("distributed: a group's device, and the group for a model's device (Note [A group per device])",
          "[distributed]") {
  LocalProcessGroup local;
  CHECK(local.device() == Device::cpu());
  // reduce_scatter_consuming of one rank is a copy, as reduce_scatter.
  Tensor in = from_vector(std::vector<double>{1.5, -2, 4}, {3}, DType::Float16);
  Tensor out = zeros({3}, DType::Float16);
  local.reduce_scatter_consuming(out, in, ReduceOp::Avg);
  CHECK(out.tolist() == std::vector<double>{1.5, -2, 4});

  ProcessGroup& cpu_group = process_group_for(Device::cpu());
  CHECK(&cpu_group == &default_process_group());
  CHECK(cpu_group.device() == Device::cpu());
  CHECK(&process_group_for({zeros({2}), ones({1}, DType::Float16)}, "test") == &cpu_group);
  CHECK(&process_group_for(std::vector<Tensor>{}, "test") == &cpu_group);

  if (!cuda::is_available() || !nccl_built()) {
    // A CUDA model with no usable NCCL (no GPU here, or none in the build) is a configuration error
    // that says what is missing; tests/cuda/test_cuda_plugins.cpp checks the plugins' side where a GPU is present.
    CHECK_THROWS_AS(process_group_for(Device::cuda()), ConfigError);
    CHECK_THROWS_WITH(process_group_for(Device::cuda()),
                      Catch::Contains("cuda:0") && Catch::Contains("nccl") &&
                          Catch::Contains(nccl_built() ? "GPU" : "NCCL"));
    skip_test(std::string("the CUDA group needs ") + (nccl_built() ? "a GPU" : "NCCL in the build"));
    return;
  }
  ProcessGroup& gpu_group = process_group_for(Device::cuda());
  CHECK(gpu_group.backend() == "nccl");
  CHECK(gpu_group.device() == Device::cuda(0));
  CHECK(gpu_group.size() == cpu_group.size());
  CHECK(&process_group_for(Device::cuda()) == &gpu_group);  // one per process
  if (cuda::device_count() > 1) CHECK_THROWS_AS(process_group_for(Device::cuda(1)), DeviceError);
  CHECK_THROWS_AS(process_group_for({zeros({2}), zeros({2}, DType::Float32, Device::cuda())}, "test"), DeviceError);
}

namespace {

// A group that says it works on a GPU, as the nccl default group does, without needing one.
class GpuOnlyGroup final : public ProcessGroup {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "nccl"; }
  Device device() const override { return Device::cuda(0); }
  void barrier() override {}
  [[noreturn]] void abort(int, const std::string&) override { std::abort(); }

 protected:
  WorkPtr all_reduce_impl(const BufferSpan&, ReduceOp, bool) override { return completed_work(); }
  WorkPtr broadcast_impl(const BufferSpan&, int, bool) override { return completed_work(); }
  WorkPtr all_gather_impl(const BufferSpan&, const BufferSpan&, bool) override { return completed_work(); }
  WorkPtr reduce_scatter_impl(const BufferSpan&, const BufferSpan&, ReduceOp, bool) override {
    return completed_work();
  }
};

}  // namespace

TEST_CASE("distributed: a group is refused at selection for a device it does not serve (Note [A group per device])",
          "[distributed]") {
  // After init_process_group("nccl") process_group_for(cpu) meets a default group on the GPU; it must say so
  // there, with a DeviceError that names the backend and the way out, and not leave the model to fail in its
  // first collective.
  GpuOnlyGroup nccl_like;
  CHECK_THROWS_AS(check_group_serves(nccl_like, Device::cpu()), DeviceError);
  CHECK_THROWS_WITH(check_group_serves(nccl_like, Device::cpu()),
                    Catch::Contains("process_group_for(cpu)") && Catch::Contains("\"nccl\"") &&
                        Catch::Contains("init_process_group(\"auto\")") && Catch::Contains("cuda:0"));
  // Another GPU than the group's: the rank % GPUs rule.
  CHECK_THROWS_AS(check_group_serves(nccl_like, Device::cuda(1)), DeviceError);
  CHECK_THROWS_WITH(check_group_serves(nccl_like, Device::cuda(1)),
                    Catch::Contains("cuda:1") && Catch::Contains("one rank per GPU"));
  CHECK_NOTHROW(check_group_serves(nccl_like, Device::cuda(0)));
  // The CPU groups serve the CPU only.
  LocalProcessGroup local;
  CHECK_NOTHROW(check_group_serves(local, Device::cpu()));
  CHECK_THROWS_AS(check_group_serves(local, Device::cuda(0)), DeviceError);
  CHECK_NOTHROW(check_group_serves(process_group_for(Device::cpu()), Device::cpu()));
}

TEST_CASE("device mesh: coordinates put tp innermost, and sizes that do not fit say which do", "[distributed]") {
  LocalProcessGroup pg;
  const DeviceMesh one(pg, 1, 1);
  CHECK(one.coord() == MeshCoord{0, 0, 0});
  CHECK(one.tp_group().size() == 1);
  CHECK(one.dp_group().size() == 1);
  CHECK(pg.split(-1, 0, "none") == nullptr);
  CHECK(pg.new_group({0})->size() == 1);
  // The arithmetic, for a world of 8 as tp 2 x pp 2 x dp 2 (Megatron's order).
  CHECK(mesh_size_problem(8, 2, 2).empty());
  CHECK(mesh_size_problem(8, 3, 1) ==
        "tp_size 3 x pp_size 1 does not divide the world size 8 (data parallel takes the rest); tp_size x pp_size "
        "pairs that fit: 1x1, 1x2, 1x4, 1x8, 2x1, 2x2, 2x4, 4x1, 4x2, 8x1");
  CHECK_THROWS_AS(DeviceMesh(pg, 2, 1), ConfigError);
}

// The NCCL group's subgroups name their ranks by world rank in timeout messages (NCCL's split does not
// tell the members' world ranks; the group gathers {color, key, world rank} first): split_world_ranks
// orders a color's members as MPI_Comm_split and ncclCommSplit do, by key, ties by rank in the parent.
TEST_CASE("distributed: split_world_ranks orders a color's members by key, then parent rank", "[distributed]") {
  // Parent ranks 0..5 of a subgroup whose world ranks are 10..15: a tp x dp style split into colors.
  const std::vector<std::array<int, 3>> parent = {{0, 0, 10}, {1, 0, 11}, {0, 1, 12}, {1, 1, 13}, {0, 2, 14}, {1, 2, 15}};
  CHECK(split_world_ranks(parent, 0) == std::vector<int>{10, 12, 14});
  CHECK(split_world_ranks(parent, 1) == std::vector<int>{11, 13, 15});
  // Keys reverse the order; equal keys keep the parent's.
  const std::vector<std::array<int, 3>> reversed = {{0, 5, 3}, {0, 4, 7}, {0, 4, 1}, {2, 0, 9}};
  CHECK(split_world_ranks(reversed, 0) == std::vector<int>{7, 1, 3});
  CHECK(split_world_ranks(reversed, 2) == std::vector<int>{9});
  CHECK(split_world_ranks(reversed, -1).empty());
  CHECK(split_world_ranks(reversed, 5).empty());
}
