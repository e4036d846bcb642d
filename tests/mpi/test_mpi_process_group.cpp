// The MPI ProcessGroup under `mpirun -np 2` (every TEST_CASE runs on every rank, in the same order).
// Values depend on the rank so that a collective that drops, repeats or misorders a rank's data fails.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "booster/distributed/device_mesh.h"
#include "booster/distributed/mpi_process_group.h"
#include "booster/distributed/process_group.h"
#include "booster/ops/ops.h"
#include "booster/optim/flat_buffer.h"

using namespace booster;
using namespace booster::distributed;

namespace {

ProcessGroup& group() { return init_process_group("mpi"); }

// Element i of rank r: small values that every dtype holds exactly (halves, |x| < 64).
double value_of(int r, int64_t i, DType dtype) {
  const double base = double(i % 7 - 3) * (r + 1);
  return dtype == DType::Int64 ? base + 1000 * r : base + 0.5 * r;
}

std::vector<double> rank_values(int r, int64_t n, DType dtype, int64_t first = 0) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = value_of(r, first + i, dtype);
  return v;
}

Tensor rank_tensor(int r, const Shape& shape, DType dtype) {
  return from_vector(rank_values(r, numel_of(shape), dtype), shape, dtype);
}

// op over ranks of value_of(r, first + i), computed in double and rounded to `dtype` once.
std::vector<double> expected(ReduceOp op, int64_t n, DType dtype, int world, int64_t first = 0) {
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    double acc = value_of(0, first + i, dtype);
    for (int r = 1; r < world; ++r) {
      const double x = value_of(r, first + i, dtype);
      acc = op == ReduceOp::Max ? std::max(acc, x) : op == ReduceOp::Min ? std::min(acc, x) : acc + x;
    }
    out[size_t(i)] = op == ReduceOp::Avg ? acc / world : acc;
  }
  return from_vector(out, {n}, dtype).tolist();
}

const std::vector<DType> kReduceDTypes = {DType::Float32, DType::Float64, DType::BFloat16,
                                          DType::Float16, DType::Int64};

}  // namespace

TEST_CASE("mpi group: rank and size come from mpirun", "[mpi]") {
  ProcessGroup& pg = group();
  REQUIRE(pg.backend() == "mpi");
  REQUIRE(launched_by_mpi_launcher());
  REQUIRE(pg.size() == std::atoi(std::getenv("OMPI_COMM_WORLD_SIZE")));
  REQUIRE(pg.rank() == std::atoi(std::getenv("OMPI_COMM_WORLD_RANK")));
  REQUIRE(pg.size() >= 2);
  REQUIRE(&default_process_group() == &pg);
  REQUIRE((mpi_thread_support() == "multiple" || mpi_thread_support() == "serialized" ||
           mpi_thread_support() == "funneled" || mpi_thread_support() == "single"));
  // Everyone agrees on the ranks: gather each rank's own number.
  Tensor mine = full({1}, pg.rank(), DType::Int64);
  Tensor all = zeros({pg.size()}, DType::Int64);
  pg.all_gather(all, mine);
  for (int r = 0; r < pg.size(); ++r) REQUIRE(all.tolist()[size_t(r)] == r);
}

TEST_CASE("mpi all_reduce: sum, avg, max, min on every dtype give exact results", "[mpi]") {
  ProcessGroup& pg = group();
  for (DType dtype : kReduceDTypes) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
      if (op == ReduceOp::Avg && dtype == DType::Int64) continue;
      INFO(dtype_name(dtype) << " " << reduce_op_name(op));
      Tensor t = rank_tensor(pg.rank(), {3, 5}, dtype);
      const uint64_t version = t.version();
      pg.all_reduce(t, op);
      REQUIRE(t.shape() == Shape{3, 5});
      REQUIRE(t.tolist() == expected(op, 15, dtype, pg.size()));
      REQUIRE(t.version() > version);
    }
  }
}

TEST_CASE("mpi all_reduce: 16-bit sums are combined in float32 and rounded to nearest even", "[mpi]") {
  ProcessGroup& pg = group();
  // 1 + 1.5 * 2^-10 lies halfway between two float16 neighbours of 1 (spacing 2^-10): round to even
  // gives 1 + 2^-9. Summing the raw bits, or truncating, gives something else.
  Tensor h = full({4}, pg.rank() == 0 ? 1.0 : (pg.rank() == 1 ? 1.5 / 1024 : 0.0), DType::Float16);
  pg.all_reduce(h);
  for (double x : h.tolist()) REQUIRE(x == 1.0 + 2.0 / 1024);
  // bfloat16 keeps 8 significant bits: 1 + 2^-8 + 2^-9 rounds to 1 + 2^-7 (ties to even).
  Tensor b = full({4}, pg.rank() == 0 ? 1.0 : (pg.rank() == 1 ? 1.5 / 256 : 0.0), DType::BFloat16);
  pg.all_reduce(b);
  for (double x : b.tolist()) REQUIRE(x == 1.0 + 2.0 / 256);
}

TEST_CASE("mpi broadcast from root 1 reaches every rank, every dtype", "[mpi]") {
  ProcessGroup& pg = group();
  for (DType dtype : {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16, DType::Int64,
                      DType::Int32}) {
    INFO(dtype_name(dtype));
    Tensor t = rank_tensor(pg.rank(), {4, 3}, dtype);
    pg.broadcast(t, 1);
    REQUIRE(t.tolist() == from_vector(rank_values(1, 12, dtype), {12}, dtype).tolist());
  }
  Tensor flags = full({5}, pg.rank() == 1 ? 1.0 : 0.0, DType::Bool);
  pg.broadcast(flags, 1);
  REQUIRE(flags.tolist() == std::vector<double>(5, 1.0));
}

TEST_CASE("mpi all_gather: ranks' inputs one after another, also in place", "[mpi]") {
  ProcessGroup& pg = group();
  const int world = pg.size();
  for (DType dtype : {DType::Float32, DType::BFloat16, DType::Int64}) {
    INFO(dtype_name(dtype));
    Tensor in = rank_tensor(pg.rank(), {2, 3}, dtype);
    Tensor out = zeros({world * 2, 3}, dtype);
    pg.all_gather(out, in);
    std::vector<double> want;
    for (int r = 0; r < world; ++r) {
      auto part = from_vector(rank_values(r, 6, dtype), {6}, dtype).tolist();
      want.insert(want.end(), part.begin(), part.end());
    }
    REQUIRE(out.tolist() == want);
    REQUIRE(in.tolist() == from_vector(rank_values(pg.rank(), 6, dtype), {6}, dtype).tolist());

    // In place: each rank's shard already sits at its slice of the full buffer (ZeRO's gather).
    Tensor full_buffer = zeros({world * 6}, dtype);
    Tensor shard = full_buffer.narrow(0, pg.rank() * 6, 6);
    shard.copy_(in.reshape({6}));
    pg.all_gather(full_buffer, shard);
    REQUIRE(full_buffer.tolist() == want);
  }
}

TEST_CASE("mpi reduce_scatter: each rank gets the reduction of its slice", "[mpi]") {
  ProcessGroup& pg = group();
  const int world = pg.size();
  const int64_t n = 5;
  for (DType dtype : kReduceDTypes) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
      if (op == ReduceOp::Avg && dtype == DType::Int64) continue;
      INFO(dtype_name(dtype) << " " << reduce_op_name(op));
      Tensor in = rank_tensor(pg.rank(), {world, n}, dtype);
      const auto in_before = in.tolist();
      Tensor out = zeros({n}, dtype);
      pg.reduce_scatter(out, in, op);
      REQUIRE(out.tolist() == expected(op, n, dtype, world, pg.rank() * n));
      REQUIRE(in.tolist() == in_before);
    }
  }
}

TEST_CASE("mpi non-blocking collectives overlap and all complete", "[mpi]") {
  ProcessGroup& pg = group();
  const int world = pg.size();
  const int64_t n = 1 << 18;  // large enough that the collectives are still running during compute
  Tensor a = rank_tensor(pg.rank(), {n}, DType::Float32);
  Tensor b = rank_tensor(pg.rank(), {n}, DType::Float64);
  Tensor c = rank_tensor(pg.rank(), {n}, DType::BFloat16);
  Tensor d = rank_tensor(pg.rank(), {7}, DType::Int64);
  Tensor g_in = rank_tensor(pg.rank(), {n / 4}, DType::Float32);
  Tensor g_out = zeros({world * (n / 4)}, DType::Float32);
  Tensor rs_in = rank_tensor(pg.rank(), {world * 8}, DType::Float64);
  Tensor rs_out = zeros({8}, DType::Float64);

  std::vector<WorkPtr> works;
  works.push_back(pg.all_reduce_async(a, ReduceOp::Sum));
  works.push_back(pg.all_reduce_async(b, ReduceOp::Avg));  // Avg divides before it starts
  works.push_back(pg.all_reduce_async(c, ReduceOp::Max));
  works.push_back(pg.broadcast_async(d, 1));
  works.push_back(pg.all_gather_async(g_out, g_in));
  works.push_back(pg.reduce_scatter_async(rs_out, rs_in, ReduceOp::Sum));

  // Compute while the collectives run (the host thread is free).
  double acc = 0;
  for (int i = 0; i < 2000000; ++i) acc += std::sqrt(double(i));
  REQUIRE(acc > 0);
  (void)works[0]->is_completed();  // polling is allowed before wait
  wait_all(works);
  for (const WorkPtr& w : works) REQUIRE(w->is_completed());
  works[1]->wait();  // idempotent

  REQUIRE(a.tolist() == expected(ReduceOp::Sum, n, DType::Float32, world));
  REQUIRE(b.tolist() == expected(ReduceOp::Avg, n, DType::Float64, world));
  REQUIRE(c.tolist() == expected(ReduceOp::Max, n, DType::BFloat16, world));
  REQUIRE(d.tolist() == from_vector(rank_values(1, 7, DType::Int64), {7}, DType::Int64).tolist());
  for (int r = 0; r < world; ++r) {
    auto got = g_out.narrow(0, r * (n / 4), n / 4).tolist();
    REQUIRE(got == from_vector(rank_values(r, n / 4, DType::Float32), {n / 4}).tolist());
  }
  REQUIRE(rs_out.tolist() == expected(ReduceOp::Sum, 8, DType::Float64, world, pg.rank() * 8));
}

TEST_CASE("mpi a dropped Work is waited for, and keeps its tensor alive", "[mpi]") {
  ProcessGroup& pg = group();
  Tensor keep;
  {
    Tensor t = rank_tensor(pg.rank(), {1000}, DType::Float32);
    keep = t;
    pg.all_reduce_async(t);  // result discarded: the Work's destructor waits
  }
  REQUIRE(keep.tolist() == expected(ReduceOp::Sum, 1000, DType::Float32, pg.size()));
}

TEST_CASE("mpi span overloads reduce a bucket of a flat buffer and nothing else", "[mpi]") {
  ProcessGroup& pg = group();
  const int64_t n = 100;
  Tensor flat = rank_tensor(pg.rank(), {n}, DType::Float32);
  const auto before = flat.tolist();
  const BufferSpan bucket = BufferSpan::of(flat).slice(10, 30);
  pg.all_reduce(bucket, ReduceOp::Sum);
  const auto sums = expected(ReduceOp::Sum, n, DType::Float32, pg.size());
  const auto after = flat.tolist();
  for (int64_t i = 0; i < n; ++i) {
    INFO("element " << i);
    REQUIRE(after[size_t(i)] == (i >= 10 && i < 40 ? sums[size_t(i)] : before[size_t(i)]));
  }
  // Pointer + count + dtype, non-blocking span and a span all_gather into a bigger buffer.
  Tensor raw = rank_tensor(pg.rank(), {8}, DType::Float64);
  pg.all_reduce(raw.data<double>(), 8, DType::Float64, ReduceOp::Max);
  REQUIRE(raw.tolist() == expected(ReduceOp::Max, 8, DType::Float64, pg.size()));
  Tensor half_bucket = rank_tensor(pg.rank(), {64}, DType::Float16);
  WorkPtr w = pg.all_reduce_async(BufferSpan::of(half_bucket).slice(0, 32), ReduceOp::Avg);
  w->wait();
  const auto avg = expected(ReduceOp::Avg, 64, DType::Float16, pg.size());
  const auto mine = from_vector(rank_values(pg.rank(), 64, DType::Float16), {64}, DType::Float16).tolist();
  const auto got = half_bucket.tolist();
  for (size_t i = 0; i < 64; ++i) REQUIRE(got[i] == (i < 32 ? avg[i] : mine[i]));
}

TEST_CASE("mpi barrier waits for the slowest rank", "[mpi]") {
  // No clock: rank 0 enters the barrier only after it has seen every other rank arrive at it (a file
  // each) and has left a file of its own; the others look for that file once the barrier lets them
  // go. A barrier that released them before rank 0 arrived would let them look too early.
  ProcessGroup& pg = group();
  Tensor job = full({1}, pg.rank() == 0 ? double(::getpid()) : 0.0, DType::Float64);
  pg.broadcast(job, 0);
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("booster_barrier_" + std::to_string(int64_t(job.item())));
  const auto arrived = [&](int rank) { return dir / ("arrived_" + std::to_string(rank)); };
  if (pg.rank() == 0) std::filesystem::create_directories(dir);
  pg.barrier();  // line up: the directory exists
  if (pg.rank() == 0) {
    // A rank that never arrives fails the test within a minute instead of hanging it.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    for (int r = 1; r < pg.size(); ++r)
      while (!std::filesystem::exists(arrived(r))) {
        if (std::chrono::steady_clock::now() > deadline) FAIL("rank " << r << " never reached the barrier in 60 s");
        std::this_thread::yield();
      }
    std::ofstream(dir / "rank0_entered") << "";
  } else {
    std::ofstream(arrived(pg.rank())) << "";
  }
  pg.barrier();
  const bool rank0_was_there = std::filesystem::exists(dir / "rank0_entered");
  pg.barrier();  // everyone has looked
  if (pg.rank() == 0) std::filesystem::remove_all(dir);
  REQUIRE(rank0_was_there);
}

TEST_CASE("mpi collectives reject bad arguments with typed errors naming op and shapes", "[mpi]") {
  ProcessGroup& pg = group();
  const int world = pg.size();
  // Every check fires before any MPI call, identically on every rank, so nothing hangs.
  Tensor m = zeros({3, 4});
  Tensor strided = m.t();
  REQUIRE_THROWS_AS(pg.all_reduce(strided), ShapeError);
  REQUIRE_THROWS_WITH(pg.all_reduce(strided), Catch::Contains("all_reduce") &&
                                                  Catch::Contains("[4, 3]") &&
                                                  Catch::Contains("contiguous"));
  REQUIRE_THROWS_WITH(pg.broadcast_async(strided, 0), Catch::Contains("broadcast_async"));

  Tensor in = zeros({2, 3});
  Tensor wrong_out = zeros({world * 6 + 1});
  REQUIRE_THROWS_AS(pg.all_gather(wrong_out, in), ShapeError);
  REQUIRE_THROWS_WITH(pg.all_gather(wrong_out, in),
                      Catch::Contains("all_gather") && Catch::Contains(std::to_string(world * 6 + 1)) &&
                          Catch::Contains(std::to_string(world * 6)));
  Tensor rs_out = zeros({4});
  REQUIRE_THROWS_AS(pg.reduce_scatter(rs_out, in), ShapeError);
  REQUIRE_THROWS_WITH(pg.reduce_scatter_async(rs_out, in),
                      Catch::Contains("reduce_scatter_async") && Catch::Contains("6"));
  Tensor out64 = zeros({world * 6}, DType::Float64);
  REQUIRE_THROWS_AS(pg.all_gather(out64, in), DTypeError);

  Tensor ints = zeros({4}, DType::Int64);
  REQUIRE_THROWS_AS(pg.all_reduce(ints, ReduceOp::Avg), DTypeError);
  Tensor flags = zeros({4}, DType::Bool);
  REQUIRE_THROWS_AS(pg.all_reduce(flags), DTypeError);
  REQUIRE_THROWS_AS(pg.broadcast(m, world), ValueError);
  REQUIRE_THROWS_WITH(pg.broadcast(m, -1), Catch::Contains("root -1"));

  Tensor buf = zeros({world * 4});
  Tensor overlapping_out = buf.narrow(0, 0, 4);
  REQUIRE_THROWS_AS(pg.reduce_scatter(overlapping_out, buf), ValueError);
  REQUIRE_THROWS_AS(BufferSpan::of(buf).slice(2, world * 4), IndexError);

  // The group still works after the rejected calls.
  Tensor ok = full({2}, 1.0);
  pg.all_reduce(ok);
  REQUIRE(ok.tolist() == std::vector<double>(2, double(world)));
}

TEST_CASE("mpi large buffers all-reduce correctly, blocking and not", "[mpi]") {
  ProcessGroup& pg = group();
  const int64_t n = 3'000'001;
  Tensor a = rank_tensor(pg.rank(), {n}, DType::Float32);
  Tensor b = a.clone();
  pg.all_reduce(a, ReduceOp::Avg);
  pg.all_reduce_async(b, ReduceOp::Avg)->wait();
  const auto want = expected(ReduceOp::Avg, n, DType::Float32, pg.size());
  REQUIRE(a.tolist() == want);
  REQUIRE(b.tolist() == want);
}

TEST_CASE("mpi all_reduce of one bucket of a flat gradient buffer", "[mpi]") {
  ProcessGroup& pg = group();
  Tensor w = zeros({3, 4});
  Tensor b = zeros({4});
  w.requires_grad_();
  b.requires_grad_();
  optim::FlatBuffer flat({w, b});
  // Gradients as backward would leave them: rank-dependent values in the flat gradient storage.
  Tensor grads = flat.grad();
  grads.copy_(rank_tensor(pg.rank(), {flat.numel()}, DType::Float32));
  const auto before = flat.grad().tolist();
  // The bucket holding `b` only (as a data-parallel plugin reduces buckets as they become ready).
  const BufferSpan bucket = BufferSpan::of(flat.grad()).slice(flat.offset(1), b.numel());
  pg.all_reduce_async(bucket, ReduceOp::Avg)->wait();
  const auto avg = expected(ReduceOp::Avg, flat.numel(), DType::Float32, pg.size());
  const auto after = flat.grad().tolist();
  for (int64_t i = 0; i < flat.numel(); ++i)
    REQUIRE(after[size_t(i)] == (i >= flat.offset(1) ? avg[size_t(i)] : before[size_t(i)]));
  REQUIRE(b.grad().tolist() == std::vector<double>(avg.begin() + flat.offset(1), avg.end()));
}

// Note [Averages divide first]: a float16 average whose sum overflows. Rank r holds 40000 + 8000 r
// (multiples of 32, float16's spacing there, so every value and the 2-rank mean 44000 are exact); the
// sum 88000 is past float16's largest finite value 65504, so summing first gives inf.
TEST_CASE("mpi avg divides before summing: a float16 mean whose sum overflows comes out finite and right",
          "[mpi]") {
  ProcessGroup& pg = group();
  const int world = pg.size();
  constexpr int64_t n = 600;  // more than one block of the 16-bit reduction
  auto rank_row = [&](int r) {
    std::vector<double> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[size_t(i)] = i % 3 == 0 ? 40000.0 + 8000.0 * (r % 2) : double(i % 7) - 3.0 + r;
    return v;
  };
  // The mean over ranks in float64, rounded to float16 once.
  std::vector<double> mean(static_cast<size_t>(n), 0.0);
  for (int r = 0; r < world; ++r)
    for (int64_t i = 0; i < n; ++i) mean[size_t(i)] += rank_row(r)[size_t(i)] / world;
  const std::vector<double> want = from_vector(mean, {n}, DType::Float16).tolist();
  REQUIRE(want[0] == 44000.0);
  // One rounding per element apart at most when the world size is not a power of two.
  auto close = [&](const std::vector<double>& got) {
    for (int64_t i = 0; i < n; ++i)
      if (std::abs(got[size_t(i)] - want[size_t(i)]) > std::abs(want[size_t(i)]) * std::ldexp(1.0, -10)) return false;
    return true;
  };

  Tensor blocking = from_vector(rank_row(pg.rank()), {n}, DType::Float16);
  pg.all_reduce(blocking, ReduceOp::Avg);
  CHECK(close(blocking.tolist()));
  Tensor async = from_vector(rank_row(pg.rank()), {n}, DType::Float16);
  pg.all_reduce_async(BufferSpan::of(async), ReduceOp::Avg)->wait();
  CHECK(close(async.tolist()));
  if (world == 2) CHECK(async.tolist() == want);  // dividing by 2 is exact

  // reduce_scatter keeps its input, so it cannot divide first; with the input as scratch it does.
  Tensor in = Tensor::empty({world * n}, DType::Float16);
  for (int r = 0; r < world; ++r) in.narrow(0, r * n, n).copy_(from_vector(rank_row(pg.rank()), {n}, DType::Float16));
  const std::vector<double> in_before = in.tolist();
  Tensor out = zeros({n}, DType::Float16);
  pg.reduce_scatter(out, in, ReduceOp::Avg);
  CHECK(in.tolist() == in_before);
  Tensor consumed_out = zeros({n}, DType::Float16);
  pg.reduce_scatter_consuming(consumed_out, in, ReduceOp::Avg);
  CHECK(close(consumed_out.tolist()));
  // Sum through the consuming form is the plain sum (nothing divided).
  Tensor small = from_vector(std::vector<double>(size_t(world * 4), 1.5 + pg.rank()), {world * 4}, DType::Float32);
  Tensor summed = zeros({4});
  pg.reduce_scatter_consuming(summed, small, ReduceOp::Sum);
  double sum = 0;
  for (int r = 0; r < world; ++r) sum += 1.5 + r;
  CHECK(summed.tolist() == std::vector<double>(4, sum));
}

TEST_CASE("mpi group: its device is the CPU, and it is the group for CPU models", "[mpi]") {
  ProcessGroup& pg = group();
  CHECK(pg.device() == Device::cpu());
  CHECK(&process_group_for(Device::cpu()) == &pg);
  CHECK(&process_group_for({zeros({2}), ones({3})}, "test") == &pg);
  CHECK(&process_group_for(std::vector<Tensor>{}, "test") == &pg);
}

TEST_CASE("mpi split and new_group: subgroups run their own collectives, others get none", "[mpi]") {
  ProcessGroup& pg = group();
  const int world = pg.size(), me = pg.rank();
  // Reversed order: the subgroup's rank 0 is the world's last rank.
  std::shared_ptr<ProcessGroup> all = pg.split(7, world - 1 - me, "reversed");
  REQUIRE(all != nullptr);
  CHECK(all->size() == world);
  CHECK(all->rank() == world - 1 - me);
  Tensor t = from_vector(std::vector<double>{double(me)}, {1}, DType::Float32);
  all->broadcast(t, 0);  // the subgroup's root is the world's last rank
  CHECK(t.item() == world - 1);
  // A world collective between subgroup ones does not get mixed up with them.
  Tensor w = from_vector(std::vector<double>{1.0}, {1}, DType::Float32);
  pg.all_reduce(w);
  CHECK(w.item() == world);

  // Only the last rank joins; the others get nullptr.
  std::shared_ptr<ProcessGroup> last = pg.new_group({world - 1}, "last");
  if (me == world - 1) {
    REQUIRE(last != nullptr);
    CHECK(last->size() == 1);
    CHECK(last->rank() == 0);
    Tensor x = from_vector(std::vector<double>{5.0}, {1}, DType::Float32);
    last->all_reduce(x);
    CHECK(x.item() == 5.0);
  } else {
    CHECK(last == nullptr);
  }
  CHECK_THROWS_AS(pg.new_group({0, 0}), ValueError);
  CHECK_THROWS_AS(pg.new_group({world}), ValueError);
}

TEST_CASE("mpi device mesh: every layout of the world gives each rank its tp, pp and dp groups", "[mpi]") {
  ProcessGroup& pg = group();
  const int world = pg.size(), me = pg.rank();
  for (int tp = 1; tp <= world; ++tp)
    for (int pp = 1; tp * pp <= world; ++pp) {
      if (world % (tp * pp) != 0) continue;
      INFO("tp " << tp << ", pp " << pp << " on " << world << " ranks");
      const DeviceMesh mesh(pg, tp, pp);
      const int dp = world / (tp * pp);
      CHECK(mesh.dp_size() == dp);
      CHECK(mesh.rank_of(mesh.coord()) == me);
      CHECK(mesh.tp_group().size() == tp);
      CHECK(mesh.pp_group().size() == pp);
      CHECK(mesh.dp_group().size() == dp);
      CHECK(mesh.tp_group().rank() == mesh.coord().tp);
      CHECK(mesh.pp_group().rank() == mesh.coord().pp);
      CHECK(mesh.dp_group().rank() == mesh.coord().dp);
      // Summing the world ranks along each axis gives the members that rank_of names.
      for (int axis = 0; axis < 3; ++axis) {
        ProcessGroup& g = axis == 0 ? mesh.tp_group() : axis == 1 ? mesh.pp_group() : mesh.dp_group();
        Tensor s = from_vector(std::vector<double>{double(me)}, {1}, DType::Float64);
        g.all_reduce(s);
        double want = 0;
        for (int i = 0; i < g.size(); ++i) {
          MeshCoord c = mesh.coord();
          (axis == 0 ? c.tp : axis == 1 ? c.pp : c.dp) = i;
          want += mesh.rank_of(c);
        }
        CHECK(s.item() == want);
      }
    }
  CHECK_THROWS_WITH(DeviceMesh(pg, world + 1, 1), Catch::Contains("does not divide the world size") &&
                                                      Catch::Contains("pairs that fit: 1x1"));
}

// Note [Point-to-point]. Every rank sends to the next and receives from the previous (a ring), all
// ranks posting their send before their receive: the batch starts both, so nothing deadlocks.
TEST_CASE("mpi point-to-point: a ring of sends and receives delivers each rank's data, every dtype", "[mpi]") {
  ProcessGroup& pg = group();
  const int world = pg.size(), rank = pg.rank();
  const int next = (rank + 1) % world, previous = (rank + world - 1) % world;
  for (DType dtype : {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16, DType::Int64, DType::Int32}) {
    INFO(dtype);
    Tensor mine = rank_tensor(rank, {3, 5}, dtype);
    Tensor got = zeros({3, 5}, dtype);
    WorkPtr w = pg.batch_send_recv({{ProcessGroup::P2POp::Kind::Send, mine, next, 0},
                                    {ProcessGroup::P2POp::Kind::Recv, got, previous, 0}});
    w->wait();
    CHECK(got.tolist() == rank_tensor(previous, {3, 5}, dtype).tolist());
    CHECK(mine.tolist() == rank_tensor(rank, {3, 5}, dtype).tolist());  // a send leaves its tensor alone
  }
  // The single-op forms, the send posted and waited for after the receive was posted: also no deadlock.
  Tensor big = rank_tensor(rank, {1 << 18}, DType::Float32);  // past MPI's eager limit: a rendezvous
  Tensor into = zeros({1 << 18});
  WorkPtr r = pg.recv(into, previous, 5);
  WorkPtr s = pg.send(big, next, 5);
  s->wait();
  r->wait();
  CHECK(into.tolist() == rank_tensor(previous, {1 << 18}, DType::Float32).tolist());
  CHECK(r->is_completed());
}

TEST_CASE("mpi point-to-point: tags pick the message, whatever order the receives are posted in", "[mpi]") {
  ProcessGroup& pg = group();
  if (pg.size() < 2) return;
  const int rank = pg.rank();
  if (rank == 0) {
    Tensor a = full({4}, 1.0), b = full({4}, 2.0);
    wait_all({pg.send(a, 1, 10), pg.send(b, 1, 20)});
  } else if (rank == 1) {
    Tensor b = zeros({4}), a = zeros({4});
    WorkPtr wb = pg.recv(b, 0, 20);  // posted first, for the message sent second
    WorkPtr wa = pg.recv(a, 0, 10);
    wait_all({wb, wa});
    CHECK(a.tolist() == std::vector<double>(4, 1.0));
    CHECK(b.tolist() == std::vector<double>(4, 2.0));
  }
  // The same tag twice: the messages arrive in the order sent.
  if (rank == 0) {
    Tensor first = full({2}, 3.0), second = full({2}, 4.0);
    wait_all({pg.send(first, 1), pg.send(second, 1)});
  } else if (rank == 1) {
    Tensor first = zeros({2}), second = zeros({2});
    wait_all({pg.recv(first, 0), pg.recv(second, 0)});
    CHECK(first.tolist() == std::vector<double>(2, 3.0));
    CHECK(second.tolist() == std::vector<double>(2, 4.0));
  }
  pg.barrier();
}

TEST_CASE("mpi point-to-point: bad peers, tags and tensors are refused, a short message is an error", "[mpi]") {
  ProcessGroup& pg = group();
  const int world = pg.size(), rank = pg.rank();
  Tensor t = zeros({4});
  REQUIRE_THROWS_AS(pg.send(t, rank), ValueError);
  REQUIRE_THROWS_WITH(pg.send(t, rank), Catch::Contains("peer " + std::to_string(rank)) &&
                                            Catch::Contains("must be another rank"));
  REQUIRE_THROWS_AS(pg.recv(t, world), ValueError);
  REQUIRE_THROWS_AS(pg.recv(t, -1), ValueError);
  REQUIRE_THROWS_WITH(pg.send(t, (rank + 1) % world, 40000), Catch::Contains("tag 40000"));
  Tensor strided = zeros({3, 4}).t();
  REQUIRE_THROWS_AS(pg.send(strided, (rank + 1) % world), ShapeError);
  REQUIRE_THROWS_AS(pg.batch_send_recv({{ProcessGroup::P2POp::Kind::Send, Tensor(), 0, 0}}), ValueError);
  REQUIRE(pg.batch_send_recv({})->is_completed());
  if (world < 2) return;
  // Rank 0 sends 3 elements where rank 1 expects 4: the stale tail would be a silent error.
  if (rank == 0) {
    Tensor three = full({3}, 1.0);
    pg.send(three, 1, 7)->wait();
  } else if (rank == 1) {
    Tensor four = zeros({4});
    WorkPtr w = pg.recv(four, 0, 7);
    REQUIRE_THROWS_AS(w->wait(), DistributedError);
  }
  pg.barrier();
}
