// The "tcp" process group (distributed/tcp_process_group.h, Note [TCP process group]): N ranks run as
// N threads of this process, each with its own group, meeting over TCP on 127.0.0.1 (or a file).
// References are not the group's code: exact integer sums, float64 sums with a derived bound, the
// mpi backend's semantics (Avg divides first, 16-bit values combine in float32 and round each step).
#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "collective_timeout.h"  // a rank left waiting fails within a minute
#include "booster/common/error.h"
#include "booster/distributed/process_group.h"
#include "booster/distributed/rendezvous.h"
#include "booster/distributed/socket_impl.h"
#include "booster/distributed/tcp_process_group.h"
#include "booster/tensor/half.h"
#include "booster/tensor/tensor.h"
#include "local_sockets.h"
#include "run_booster.h"

using namespace booster;
using namespace booster::distributed;
using std::chrono::duration;
using Clock = std::chrono::steady_clock;

using testing::connect_local;
using testing::free_port;

namespace {

RendezvousSpec tcp_spec(int port, const std::string& address = "127.0.0.1", const std::string& job = "") {
  RendezvousSpec spec;
  spec.kind = RendezvousSpec::Kind::Tcp;
  spec.address = address;
  spec.port = port;
  spec.source = "MASTER_ADDR/MASTER_PORT";
  spec.job = job;
  return spec;
}

// What one rank's thread ended with.
struct Outcome {
  std::string error;  // empty: none
  std::string type;   // "ConfigError", "DistributedError", "other"
  double seconds = 0;  // from the start of its body to its end
};

using OwnedBody = std::function<void(std::shared_ptr<ProcessGroup>& group, int rank)>;

// Runs one thread per entry of `ranks`, rank ranks[k] of worlds[k] meeting through specs[k]; the body owns
// its group (it may destroy it). Returns what each ended with.
std::vector<Outcome> run_ranks(const std::vector<RendezvousSpec>& specs, const std::vector<int>& ranks,
                               const std::vector<int>& worlds, const OwnedBody& body, double connect_timeout_s) {
  std::vector<Outcome> out(ranks.size());
  std::vector<std::thread> threads;
  for (size_t k = 0; k < ranks.size(); ++k)
    threads.emplace_back([&, k] {
      Outcome& o = out[k];
      const auto start = Clock::now();
      try {
        std::shared_ptr<ProcessGroup> group =
            make_tcp_process_group(ranks[k], worlds[k], specs[k], duration<double>(connect_timeout_s));
        body(group, ranks[k]);
      } catch (const ConfigError& e) {
        o = {e.what(), "ConfigError"};
      } catch (const DistributedError& e) {
        o = {e.what(), "DistributedError"};
      } catch (const std::exception& e) {
        o = {e.what(), "other"};
      }
      o.seconds = std::chrono::duration<double>(Clock::now() - start).count();
    });
  for (std::thread& t : threads) t.join();
  return out;
}

using Body = std::function<void(ProcessGroup& group, int rank)>;

// Runs `world` ranks as threads: each makes its group (rendezvous at 127.0.0.1:<a free port>) and runs
// `body`; returns what each ended with.
std::vector<Outcome> run_world(int world, const Body& body, double connect_timeout_s = 30,
                               const RendezvousSpec* spec_in = nullptr) {
  const RendezvousSpec spec = spec_in ? *spec_in : tcp_spec(free_port());
  std::vector<int> ranks(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) ranks[size_t(r)] = r;
  return run_ranks(std::vector<RendezvousSpec>(ranks.size(), spec), ranks, std::vector<int>(ranks.size(), world),
                   [&](std::shared_ptr<ProcessGroup>& group, int rank) { body(*group, rank); }, connect_timeout_s);
}

void require_clean(const std::vector<Outcome>& out) {
  for (size_t r = 0; r < out.size(); ++r) {
    INFO("rank " << r << ": " << out[r].error);
    REQUIRE(out[r].error.empty());
  }
}

// ---------------------------------------------------------------------------------------- values

const std::vector<DType> kDTypes = {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16, DType::Int32,
                                    DType::Int64};
const std::vector<ReduceOp> kOps = {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min};

bool floating(DType d) { return d != DType::Int32 && d != DType::Int64; }

// Small whole numbers, exact in every dtype, as are their sums over 4 ranks.
double value(int rank, int64_t i) { return double(int64_t((i * 7 + rank * 13 + i * rank) % 17) - 8); }

// A buffer of `n` elements of `dtype` holding `v(i)`, as raw bytes.
std::vector<char> make_buffer(DType dtype, int64_t n, const std::function<double(int64_t)>& v) {
  std::vector<char> b(size_t(n) * itemsize(dtype) + 1);
  for (int64_t i = 0; i < n; ++i) {
    const double x = v(i);
    switch (dtype) {
      case DType::Float32: reinterpret_cast<float*>(b.data())[i] = float(x); break;
      case DType::Float64: reinterpret_cast<double*>(b.data())[i] = x; break;
      case DType::Float16: reinterpret_cast<Half*>(b.data())[i] = Half(float(x)); break;
      case DType::BFloat16: reinterpret_cast<BFloat16*>(b.data())[i] = BFloat16(float(x)); break;
      case DType::Int32: reinterpret_cast<int32_t*>(b.data())[i] = int32_t(x); break;
      case DType::Int64: reinterpret_cast<int64_t*>(b.data())[i] = int64_t(x); break;
      default: FAIL("dtype");
    }
  }
  return b;
}

double read(const std::vector<char>& b, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::Float32: return reinterpret_cast<const float*>(b.data())[i];
    case DType::Float64: return reinterpret_cast<const double*>(b.data())[i];
    case DType::Float16: return float(reinterpret_cast<const Half*>(b.data())[i]);
    case DType::BFloat16: return float(reinterpret_cast<const BFloat16*>(b.data())[i]);
    case DType::Int32: return reinterpret_cast<const int32_t*>(b.data())[i];
    case DType::Int64: return double(reinterpret_cast<const int64_t*>(b.data())[i]);
    default: return 0;
  }
}

// x rounded to `dtype` (the division of Avg happens in the buffer's dtype).
double round_to(DType dtype, double x) {
  switch (dtype) {
    case DType::Float32: return float(x);
    case DType::Float16: return float(Half(float(x)));
    case DType::BFloat16: return float(BFloat16(float(x)));
    default: return x;
  }
}

// op over ranks of value(rank, i), as the mpi backend defines it: Avg sums values divided first.
double reference(ReduceOp op, DType dtype, int world, int64_t i) {
  double acc = op == ReduceOp::Max ? -1e300 : op == ReduceOp::Min ? 1e300 : 0;
  for (int r = 0; r < world; ++r) {
    const double x = op == ReduceOp::Avg ? round_to(dtype, value(r, i) / world) : value(r, i);
    acc = op == ReduceOp::Max ? std::max(acc, x) : op == ReduceOp::Min ? std::min(acc, x) : acc + x;
  }
  return acc;
}

// Avg with a world size that is not a power of two rounds each quotient, and the sum rounds in turn:
// a few units in the last place of the dtype, relative to the largest value (8).
double tolerance(ReduceOp op, DType dtype, int world) {
  if (op != ReduceOp::Avg || (world & (world - 1)) == 0) return 0;
  const double eps = dtype == DType::Float16 ? 1.0 / 1024 : dtype == DType::BFloat16 ? 1.0 / 128
                     : dtype == DType::Float32 ? 1.0 / (1 << 23) : 1.0 / (1ll << 52);
  return 8 * 4 * world * eps;
}

const std::vector<int64_t> kSizes = {0, 1, 2, 3, 5, 1000, 300001};  // < world, and over a 1 MiB frame

// Every rank's bytes of `b` equal rank 0's.
struct Gathered {
  std::mutex mutex;
  std::map<int, std::vector<char>> bytes;
  void put(int rank, const std::vector<char>& b) {
    std::lock_guard<std::mutex> lock(mutex);
    bytes[rank] = b;
  }
  bool identical() {
    for (auto& [r, b] : bytes)
      if (b != bytes.begin()->second) return false;
    return true;
  }
};

}  // namespace

TEST_CASE("all_reduce of every dtype and op on 1 to 4 ranks matches the reference, with the same bytes on every rank",
          "[distributed][tcp]") {
  for (int world = 1; world <= 4; ++world) {
    std::mutex mutex;
    std::vector<std::string> failures;
    std::map<std::string, Gathered> results;
    require_clean(run_world(world, [&](ProcessGroup& g, int rank) {
      REQUIRE(g.backend() == "tcp");
      REQUIRE(g.device() == Device::cpu());
      REQUIRE(g.rank() == rank);
      REQUIRE(g.size() == world);
      for (DType dtype : kDTypes)
        for (ReduceOp op : kOps) {
          if (op == ReduceOp::Avg && !floating(dtype)) continue;
          for (int64_t n : kSizes) {
            std::vector<char> b = make_buffer(dtype, n, [&](int64_t i) { return value(rank, i); });
            g.all_reduce(b.data(), n, dtype, op);
            const std::string what = str(dtype, " ", reduce_op_name(op), " n=", n);
            for (int64_t i = 0; i < n; ++i) {
              const double want = reference(op, dtype, world, i), got = read(b, dtype, i);
              if (std::abs(got - want) > tolerance(op, dtype, world)) {
                std::lock_guard<std::mutex> lock(mutex);
                failures.push_back(str("world ", world, " rank ", rank, " ", what, " [", i, "]: ", got, " != ", want));
                break;
              }
            }
            Gathered* gathered;
            {
              std::lock_guard<std::mutex> lock(mutex);
              gathered = &results[what];
            }
            gathered->put(rank, b);
          }
        }
    }));
    INFO("world " << world);
    CHECK(failures == std::vector<std::string>{});
    for (auto& [what, g] : results) {
      INFO(what);
      CHECK(g.identical());
    }
  }
}

TEST_CASE("float64 sums of random values are within the bound of their reference", "[distributed][tcp]") {
  const int world = 3;
  const int64_t n = 100003;
  auto v = [](int rank, int64_t i) {
    std::mt19937_64 gen(uint64_t(rank) * 1000003 + uint64_t(i));
    return std::uniform_real_distribution<double>(-1, 1)(gen);
  };
  std::mutex mutex;
  int bad = 0;
  require_clean(run_world(world, [&](ProcessGroup& g, int rank) {
    std::vector<double> b(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) b[size_t(i)] = v(rank, i);
    g.all_reduce(b.data(), n, DType::Float64, ReduceOp::Sum);
    for (int64_t i = 0; i < n; ++i) {
      long double want = 0, magnitude = 0;
      for (int r = 0; r < world; ++r) {
        want += v(r, i);
        magnitude += std::abs(v(r, i));
      }
      // Each of the world - 1 additions rounds once: at most (world - 1) * 2^-53 of the sum of magnitudes.
      const long double bound = (world - 1) * std::ldexp(1.0L, -53) * magnitude * 1.0001L;
      if (std::abs((long double)b[size_t(i)] - want) > bound) {
        std::lock_guard<std::mutex> lock(mutex);
        ++bad;
      }
    }
  }));
  CHECK(bad == 0);
}

TEST_CASE("reduce_scatter, all_gather and broadcast of every dtype on 1 to 4 ranks", "[distributed][tcp]") {
  for (int world = 1; world <= 4; ++world) {
    std::mutex mutex;
    std::vector<std::string> failures;
    auto fail = [&](const std::string& f) {
      std::lock_guard<std::mutex> lock(mutex);
      failures.push_back(f);
    };
    require_clean(run_world(world, [&](ProcessGroup& g, int rank) {
      for (DType dtype : kDTypes)
        for (int64_t m : {int64_t(0), int64_t(1), int64_t(3), int64_t(70001)}) {
          const int64_t total = m * world;
          // reduce_scatter: slice `rank` of the op over ranks; `in` unchanged.
          for (ReduceOp op : kOps) {
            if (op == ReduceOp::Avg && !floating(dtype)) continue;
            const std::vector<char> original = make_buffer(dtype, total, [&](int64_t i) { return value(rank, i); });
            std::vector<char> in = original;
            std::vector<char> out = make_buffer(dtype, m, [](int64_t) { return 99.0; });
            g.reduce_scatter(BufferSpan{out.data(), m, dtype}, BufferSpan{in.data(), total, dtype}, op);
            if (in != original) fail(str("reduce_scatter changed in: world ", world, " ", dtype));
            // Avg of reduce_scatter sums and divides last (in is unchanged), as on mpi.
            for (int64_t i = 0; i < m; ++i) {
              const int64_t at = rank * m + i;
              double want = reference(op == ReduceOp::Avg ? ReduceOp::Sum : op, dtype, world, at);
              if (op == ReduceOp::Avg) want = round_to(dtype, want / world);
              if (std::abs(read(out, dtype, i) - want) > tolerance(op, dtype, world)) {
                fail(str("reduce_scatter world ", world, " rank ", rank, " ", dtype, " ", reduce_op_name(op), " m=", m,
                         " [", i, "]: ", read(out, dtype, i), " != ", want));
                break;
              }
            }
            // The consuming form divides first, as all_reduce's Avg does.
            if (op == ReduceOp::Avg) {
              std::vector<char> scratch = original;
              g.reduce_scatter_consuming(BufferSpan{out.data(), m, dtype}, BufferSpan{scratch.data(), total, dtype},
                                         op);
              for (int64_t i = 0; i < m; ++i) {
                const double want = reference(ReduceOp::Avg, dtype, world, rank * m + i);
                if (std::abs(read(out, dtype, i) - want) > tolerance(op, dtype, world)) {
                  fail(str("reduce_scatter_consuming world ", world, " ", dtype, " [", i, "]"));
                  break;
                }
              }
            }
          }
          // all_gather, into a separate buffer and in place.
          for (const bool in_place : {false, true}) {
            std::vector<char> out = make_buffer(dtype, total, [](int64_t) { return 99.0; });
            std::vector<char> mine = make_buffer(dtype, m, [&](int64_t i) { return value(rank, i); });
            if (in_place && m)
              std::memcpy(out.data() + size_t(rank * m) * itemsize(dtype), mine.data(), mine.size() - 1);
            const BufferSpan in = in_place ? BufferSpan{out.data() + size_t(rank * m) * itemsize(dtype), m, dtype}
                                           : BufferSpan{mine.data(), m, dtype};
            g.all_gather(BufferSpan{out.data(), total, dtype}, in);
            for (int64_t i = 0; i < total; ++i)
              if (read(out, dtype, i) != value(int(i / std::max<int64_t>(m, 1)), i % std::max<int64_t>(m, 1))) {
                fail(str("all_gather world ", world, " ", dtype, " m=", m, " in_place=", in_place, " [", i, "]"));
                break;
              }
          }
          // broadcast from every root.
          for (int root = 0; root < world; ++root) {
            std::vector<char> b = make_buffer(dtype, total + 5, [&](int64_t i) { return value(rank, i); });
            g.broadcast(BufferSpan{b.data(), total + 5, dtype}, root);
            for (int64_t i = 0; i < total + 5; ++i)
              if (read(b, dtype, i) != value(root, i)) {
                fail(str("broadcast world ", world, " root ", root, " ", dtype, " [", i, "]"));
                break;
              }
          }
        }
      g.barrier();
    }));
    INFO("world " << world);
    CHECK(failures == std::vector<std::string>{});
  }
}

TEST_CASE("Avg divides first: a float16 average whose sum overflows stays finite", "[distributed][tcp]") {
  std::vector<double> got(2);
  require_clean(run_world(2, [&](ProcessGroup& g, int rank) {
    // 60000 + 60000 overflows float16 (max 65504); their average, 60000, does not.
    Half h[3] = {Half(60000.0f), Half(-60000.0f), Half(1.0f)};
    g.all_reduce(h, 3, DType::Float16, ReduceOp::Avg);
    got[size_t(rank)] = float(h[0]);
    CHECK(float(h[1]) == -60000.0f);
    CHECK(float(h[2]) == 1.0f);
    // The sum does overflow, which the Avg would have without dividing first.
    Half s[1] = {Half(60000.0f)};
    g.all_reduce(s, 1, DType::Float16, ReduceOp::Sum);
    CHECK(std::isinf(float(s[0])));
  }));
  CHECK(got == std::vector<double>{60000.0, 60000.0});
}

TEST_CASE("async collectives queued several at once complete when waited in reverse", "[distributed][tcp]") {
  const int world = 3;
  std::mutex mutex;
  int bad = 0;
  require_clean(run_world(world, [&](ProcessGroup& g, int rank) {
    constexpr int kOps = 6;
    std::vector<std::vector<int64_t>> bufs(kOps);
    std::vector<WorkPtr> works;
    for (int k = 0; k < kOps; ++k) {
      bufs[size_t(k)].assign(size_t(1000 * (k + 1)), int64_t(rank + k));
      works.push_back(g.all_reduce_async(BufferSpan{bufs[size_t(k)].data(), int64_t(bufs[size_t(k)].size()),
                                                    DType::Int64},
                                         ReduceOp::Sum));
    }
    std::vector<int64_t> gathered(size_t(world) * 10), mine(10, int64_t(rank));
    works.push_back(g.all_gather_async(BufferSpan{gathered.data(), int64_t(gathered.size()), DType::Int64},
                                       BufferSpan{mine.data(), 10, DType::Int64}));
    for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();
    for (auto& w : works) CHECK(w->is_completed());
    std::lock_guard<std::mutex> lock(mutex);
    for (int k = 0; k < kOps; ++k)
      for (int64_t x : bufs[size_t(k)])
        if (x != int64_t(0 + 1 + 2 + 3 * k)) ++bad;
    for (size_t i = 0; i < gathered.size(); ++i)
      if (gathered[i] != int64_t(i / 10)) ++bad;
  }));
  CHECK(bad == 0);
}

namespace {

Tensor filled_int64(int64_t n, int64_t base) {
  Tensor t = Tensor::empty({n}, DType::Int64);
  int64_t* p = t.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) p[i] = base + i;
  return t;
}

bool holds(const Tensor& t, int64_t base) {
  const int64_t* p = t.data<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i)
    if (p[i] != base + i) return false;
  return true;
}

using Kind = ProcessGroup::P2POp::Kind;

}  // namespace

TEST_CASE("point-to-point: sends meet receives of their tag in posted order, batches posted in any order",
          "[distributed][tcp]") {
  require_clean(run_world(2, [&](ProcessGroup& g, int rank) {
    if (rank == 0) {
      // Tags 5, 7, 5, and a batch of its own afterwards.
      g.batch_send_recv({{Kind::Send, filled_int64(10, 100), 1, 5},
                         {Kind::Send, filled_int64(20, 200), 1, 7},
                         {Kind::Send, filled_int64(30, 300), 1, 5}})
          ->wait();
      g.send(filled_int64(5, 500), 1, 9)->wait();
      Tensor back = Tensor::empty({4}, DType::Int64);
      g.recv(back, 1, 0)->wait();
      CHECK(holds(back, 40));
    } else {
      // Tag 9 first (sent last), then tag 7, then both tag 5 messages: the first tag-5 receive gets
      // the first tag-5 send.
      Tensor nine = Tensor::empty({5}, DType::Int64), seven = Tensor::empty({20}, DType::Int64);
      Tensor five_a = Tensor::empty({10}, DType::Int64), five_b = Tensor::empty({30}, DType::Int64);
      WorkPtr w = g.batch_send_recv({{Kind::Recv, nine, 0, 9}, {Kind::Recv, seven, 0, 7}});
      WorkPtr v = g.batch_send_recv({{Kind::Recv, five_a, 0, 5}, {Kind::Recv, five_b, 0, 5}});
      v->wait();
      w->wait();
      CHECK(holds(nine, 500));
      CHECK(holds(seven, 200));
      CHECK(holds(five_a, 100));
      CHECK(holds(five_b, 300));
      g.send(filled_int64(4, 40), 0, 0)->wait();
    }
  }));
}

TEST_CASE("point-to-point: two ranks that send each other 64 MB at once do not deadlock", "[distributed][tcp]") {
  const int64_t n = (int64_t(64) << 20) / 8;
  require_clean(run_world(2, [&](ProcessGroup& g, int rank) {
    const int other = 1 - rank;
    Tensor out = filled_int64(n, 1000 * rank), in = Tensor::empty({n}, DType::Int64);
    g.batch_send_recv({{Kind::Send, out, other, 0}, {Kind::Recv, in, other, 0}})->wait();
    CHECK(holds(in, 1000 * other));
    // Also as two separate calls, the send first on both sides.
    WorkPtr s = g.send(out, other, 1);
    WorkPtr r = g.recv(in, other, 1);
    s->wait();
    r->wait();
    CHECK(holds(in, 1000 * other));
  }));
}

TEST_CASE("point-to-point: a send posted long before its receive, and a receive long before its send",
          "[distributed][tcp]") {
  require_clean(run_world(2, [&](ProcessGroup& g, int rank) {
    if (rank == 0) {
      g.send(filled_int64(300000, 7), 1, 3)->wait();  // buffered by rank 1 before it asks for it
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      g.send(filled_int64(1000, 9), 1, 4)->wait();
      // A collective still runs after the batches.
      int64_t x = 1;
      g.all_reduce(&x, 1, DType::Int64);
      CHECK(x == 2);
    } else {
      Tensor late = Tensor::empty({1000}, DType::Int64);
      WorkPtr early = g.recv(late, 0, 4);  // posted before rank 0 sends
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      Tensor first = Tensor::empty({300000}, DType::Int64);
      g.recv(first, 0, 3)->wait();
      CHECK(holds(first, 7));
      early->wait();
      CHECK(holds(late, 9));
      int64_t x = 1;
      g.all_reduce(&x, 1, DType::Int64);
      CHECK(x == 2);
    }
  }));
}

TEST_CASE("point-to-point: a receive of another size fails naming both sizes, and the group goes on",
          "[distributed][tcp]") {
  std::vector<std::string> errors(2);
  require_clean(run_world(2, [&](ProcessGroup& g, int rank) {
    if (rank == 0) {
      g.send(filled_int64(8, 0), 1, 2)->wait();
    } else {
      Tensor small = Tensor::empty({4}, DType::Int64);
      try {
        g.recv(small, 0, 2)->wait();
      } catch (const DistributedError& e) {
        errors[1] = e.what();
      }
    }
    int64_t x = rank;
    g.all_reduce(&x, 1, DType::Int64);
    CHECK(x == 1);
  }));
  CHECK_THAT(errors[1], Catch::Contains("expected 32 bytes from rank 0 (tag 2) but got 64"));
}

TEST_CASE("split and new_group make subgroups that run at the same time", "[distributed][tcp]") {
  const int world = 4;
  require_clean(run_world(world, [&](ProcessGroup& g, int rank) {
    // Even and odd ranks, each ordered by descending world rank.
    std::shared_ptr<ProcessGroup> half = g.split(rank % 2, world - rank, "half");
    REQUIRE(half);
    CHECK(half->backend() == "tcp");
    CHECK(half->size() == 2);
    CHECK(half->rank() == (rank >= 2 ? 0 : 1));
    // Both subgroups run collectives at once, large enough to interleave on the wire.
    std::vector<int64_t> v(200000, int64_t(rank));
    half->all_reduce(v.data(), int64_t(v.size()), DType::Int64);
    const int64_t want = rank % 2 == 0 ? 0 + 2 : 1 + 3;
    CHECK(std::all_of(v.begin(), v.end(), [&](int64_t x) { return x == want; }));
    std::vector<int64_t> both(2), mine{int64_t(rank)};
    half->all_gather(BufferSpan{both.data(), 2, DType::Int64}, BufferSpan{mine.data(), 1, DType::Int64});
    CHECK(both == (rank % 2 == 0 ? std::vector<int64_t>{2, 0} : std::vector<int64_t>{3, 1}));
    // A negative color joins none.
    std::shared_ptr<ProcessGroup> some = g.split(rank == 0 ? -1 : 0, 0, "some");
    CHECK((some == nullptr) == (rank == 0));
    if (some) {
      CHECK(some->size() == 3);
      CHECK(some->rank() == rank - 1);  // ties by rank
      int64_t x = 1;
      some->all_reduce(&x, 1, DType::Int64);
      CHECK(x == 3);
    }
    // new_group in the listed order; a subgroup of a subgroup.
    std::shared_ptr<ProcessGroup> pair = g.new_group({3, 1}, "pair");
    CHECK((pair != nullptr) == (rank == 1 || rank == 3));
    if (pair) {
      CHECK(pair->rank() == (rank == 3 ? 0 : 1));
      std::shared_ptr<ProcessGroup> solo = pair->split(pair->rank(), 0, "solo");
      REQUIRE(solo);
      CHECK(solo->size() == 1);
      int64_t x = 5;
      solo->all_reduce(&x, 1, DType::Int64);
      CHECK(x == 5);
    }
    // The parent still works afterwards.
    int64_t x = 1;
    g.all_reduce(&x, 1, DType::Int64);
    CHECK(x == world);
  }));
}

TEST_CASE("a rank that never calls: the others fail with a DistributedError naming it within about the timeout",
          "[distributed][tcp]") {
  const int world = 3;
  std::atomic<int> finished{0};
  std::vector<std::string> later(world);
  // Every rank keeps its group (its links open) until the others are done, so each error is the
  // rank's own timeout, not a peer closing its links.
  auto hold = [&] {
    ++finished;
    const auto until = Clock::now() + std::chrono::seconds(30);
    while (finished.load() < world && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  };
  std::vector<Outcome> out = run_world(world, [&](ProcessGroup& g, int rank) {
    g.set_timeout(duration<double>(0.5));
    if (rank == 2) {
      while (finished.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      hold();
      return;
    }
    std::vector<float> v(1000, 1.0f);
    try {
      g.all_reduce(v.data(), 1000, DType::Float32);
    } catch (const DistributedError&) {
      // The group is unusable afterwards, naming the first failure.
      try {
        g.barrier();
      } catch (const DistributedError& e) {
        later[size_t(rank)] = e.what();
      }
      hold();
      throw;
    }
    hold();
  });
  CHECK(out[2].error.empty());
  for (int r : {0, 1}) {
    INFO("rank " << r << ": " << out[r].error);
    CHECK(out[r].type == "DistributedError");
    CHECK_THAT(out[r].error, Catch::Contains("all_reduce on group \"world\" (3 ranks) timed out after") &&
                                 Catch::Contains("It was collective #1 of the group") &&
                                 Catch::Contains("BOOSTER_COLLECTIVE_TIMEOUT_S (now 0.5 s)"));
    CHECK(out[r].seconds < 0.5 + 10);  // generous slack: no timing beyond "it did not hang"
    CHECK_THAT(later[size_t(r)], Catch::Contains("barrier: group \"world\" is unusable since all_reduce #1 timed out"));
  }
  // Rank 0 waits for rank 2 in the ring: the rank that sent nothing. Rank 1 waits for rank 0, which
  // sent its first step and then nothing: the message says the late rank may be further back.
  CHECK_THAT(out[0].error, Catch::Contains("rank 2 sent nothing"));
  CHECK_THAT(out[1].error, Catch::Contains("rank 0 sent nothing") && Catch::Contains("may be further back"));
}

TEST_CASE("a peer whose group is destroyed mid-collective: the others fail at once naming it", "[distributed][tcp]") {
  const int world = 3;
  std::atomic<int> calling{0};
  std::vector<Outcome> out = run_ranks(
      std::vector<RendezvousSpec>(3, tcp_spec(free_port())), {0, 1, 2}, {world, world, world},
      [&](std::shared_ptr<ProcessGroup>& g, int rank) {
        g->set_timeout(duration<double>(120));  // far beyond the test: a failure must come from the closing
        if (rank == 2) {
          // The others are in all_reduce #1 (or about to be) when this rank's group goes.
          while (calling.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
          g.reset();
          return;
        }
        std::vector<float> v(1 << 20, 1.0f);
        ++calling;
        g->all_reduce(v.data(), int64_t(v.size()), DType::Float32);
      },
      30);
  CHECK(out[2].error.empty());
  for (int r : {0, 1}) {
    INFO("rank " << r << ": " << out[r].error);
    CHECK(out[r].type == "DistributedError");
    CHECK(out[r].seconds < 60);
  }
  // "during" when rank 0 was waiting already; "before" if the closing came first (a loaded machine).
  CHECK_THAT(out[0].error, Catch::Contains("rank 2 of group \"world\" closed its connection") &&
                               Catch::Contains("all_reduce #1 (it exited or was killed)"));
}

TEST_CASE("a group destroyed with operations queued fails them", "[distributed][tcp]") {
  std::vector<std::string> errors;
  std::mutex mutex;
  require_clean(run_ranks(
      std::vector<RendezvousSpec>(2, tcp_spec(free_port())), {0, 1}, {2, 2},
      [&](std::shared_ptr<ProcessGroup>& g, int rank) {
        if (rank == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(500));
          return;  // never calls
        }
        std::vector<std::vector<float>> bufs(3, std::vector<float>(100, 1.0f));
        std::vector<WorkPtr> works;
        for (auto& b : bufs) works.push_back(g->all_reduce_async(BufferSpan{b.data(), 100, DType::Float32}));
        g.reset();
        for (WorkPtr& w : works) {
          try {
            w->wait();
            errors.push_back("(none)");
          } catch (const DistributedError& e) {
            std::lock_guard<std::mutex> lock(mutex);
            errors.push_back(e.what());
          }
        }
      },
      30));
  REQUIRE(errors.size() == 3);
  // The first may have started or not.
  CHECK_THAT(errors[0], Catch::Contains("all_reduce #1") && Catch::Contains("was destroyed"));
  CHECK_THAT(errors[1], Catch::Contains("all_reduce #2: group \"world\" was destroyed before it ran"));
  CHECK_THAT(errors[2], Catch::Contains("all_reduce #3: group \"world\" was destroyed before it ran"));
}

TEST_CASE("the bootstrap: ranks that do not come, another job, another world size, two rank 1s, a MASTER_ADDR "
          "elsewhere",
          "[distributed][tcp]") {
  const OwnedBody nothing = [](std::shared_ptr<ProcessGroup>&, int) {};
  // Rank 2 never comes.
  RendezvousSpec spec = tcp_spec(free_port());
  std::vector<Outcome> o = run_ranks({spec, spec}, {0, 1}, {3, 3}, nothing, 0.5);
  CHECK(o[0].type == "DistributedError");
  CHECK_THAT(o[0].error, Catch::Contains("tcp group: rank 0 waited 0.5 s for rank 2 of 3 to connect (127.0.0.1:"));
  CHECK(o[1].type == "DistributedError");  // rank 0 gave up: its connection closed
  CHECK_THAT(o[1].error, Catch::Contains("rank 0 closed the connection before every rank was there"));

  // A rank of another job (another job id) is told so at once; rank 0 goes on waiting for its own.
  const int port = free_port();
  o = run_ranks({tcp_spec(port, "127.0.0.1", "a"), tcp_spec(port, "127.0.0.1", "b")}, {0, 1}, {2, 2}, nothing, 1.5);
  CHECK(o[1].type == "DistributedError");
  CHECK_THAT(o[1].error, Catch::Contains("reached a rank 0 at 127.0.0.1:" + std::to_string(port) +
                                         " of another job, not this one (job \"b\", world size 2)"));
  CHECK(o[1].seconds < 1.4);
  CHECK(o[0].type == "DistributedError");
  CHECK_THAT(o[0].error, Catch::Contains("for rank 1 of 2 to connect"));

  // Another world size; two processes that say they are rank 1.
  spec = tcp_spec(free_port());
  o = run_ranks({spec, spec}, {0, 1}, {2, 3}, nothing, 3);
  CHECK(o[0].type == "ConfigError");
  CHECK_THAT(o[0].error, Catch::Contains("rank 1 was started with a world size of 3 and rank 0 with 2"));
  spec = tcp_spec(free_port());
  o = run_ranks({spec, spec, spec}, {0, 1, 1}, {3, 3, 3}, nothing, 3);
  CHECK(o[0].type == "ConfigError");
  CHECK_THAT(o[0].error, Catch::Contains("two processes say they are rank 1 of 3"));

  // MASTER_ADDR names no address of this machine (TEST-NET-1): rank 0 is not running there.
  spec = tcp_spec(free_port(), "192.0.2.1");
  o = run_ranks({spec}, {0}, {2}, nothing, 3);
  CHECK(o[0].type == "ConfigError");
  CHECK_THAT(o[0].error, Catch::Contains("is not an address of this machine") &&
                             Catch::Contains("rank 0 must run on MASTER_ADDR's host"));
}

TEST_CASE("the rendezvous by host name, and through a file", "[distributed][tcp]") {
  for (const bool file : {false, true}) {
    INFO((file ? "file" : "localhost"));
    RendezvousSpec spec = tcp_spec(free_port(), "localhost");
    if (file) {
      const std::filesystem::path dir = testing::scratch_dir("test_tcp_process_group");
      std::filesystem::create_directories(dir);
      spec = RendezvousSpec{};
      spec.kind = RendezvousSpec::Kind::File;
      spec.file = (dir / "rendezvous").string();
      spec.source = "BOOSTER_NCCL_ID_FILE";
      std::filesystem::remove(spec.file);
    }
    std::vector<int64_t> sums(3);
    require_clean(run_world(3, [&](ProcessGroup& g, int rank) {
      int64_t x = rank + 1;
      g.all_reduce(&x, 1, DType::Int64);
      sums[size_t(rank)] = x;
    }, 30, &spec));
    CHECK(sums == std::vector<int64_t>{6, 6, 6});
  }
}

TEST_CASE("benchmark: all_reduce of 16 MB float32 on 2 ranks", "[.][benchmark][tcp]") {
  const int64_t n = (int64_t(16) << 20) / 4;
  std::vector<double> rates(2);
  require_clean(run_world(2, [&](ProcessGroup& g, int rank) {
    std::vector<float> v(static_cast<size_t>(n), 1.0f);
    g.all_reduce(v.data(), n, DType::Float32);  // warm up
    constexpr int kIters = 20;
    g.barrier();
    const auto start = Clock::now();
    for (int k = 0; k < kIters; ++k) g.all_reduce(v.data(), n, DType::Float32);
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    rates[size_t(rank)] = double(n) * 4 * kIters / s / 1e9;
  }));
  WARN("all_reduce 16 MB float32, 2 ranks (threads): " << rates[0] << " GB/s (buffer bytes / time)");
}

TEST_CASE("a frame that arrived before its sender left is still received", "[distributed][tcp]") {
  std::vector<bool> got(2, false);
  require_clean(run_ranks(
      std::vector<RendezvousSpec>(2, tcp_spec(free_port())), {0, 1}, {2, 2},
      [&](std::shared_ptr<ProcessGroup>& g, int rank) {
        if (rank == 1) {
          g->send(filled_int64(1000, 3), 0, 0)->wait();
          g.reset();  // gone: its link closes
          return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the close has arrived too
        Tensor t = Tensor::empty({1000}, DType::Int64);
        g->recv(t, 1, 0)->wait();
        got[0] = holds(t, 3);
      },
      30));
  CHECK(got[0]);
}

TEST_CASE("point-to-point: a batch does not wait behind an async collective queued before it", "[distributed][tcp]") {
  // As on mpi, whose batches are posted at the call: rank 0's all_reduce needs rank 1, which calls it only
  // after its receive of rank 0's send, which rank 0 queued after the all_reduce.
  std::vector<std::vector<float>> sums(2);
  require_clean(run_world(2, [&](ProcessGroup& g, int rank) {
    g.set_timeout(duration<double>(20));
    std::vector<float> x(1000, float(rank + 1));
    if (rank == 0) {
      WorkPtr w = g.all_reduce_async(BufferSpan{x.data(), 1000, DType::Float32});
      g.send(filled_int64(10, 4), 1, 0)->wait();
      w->wait();
    } else {
      Tensor y = Tensor::empty({10}, DType::Int64);
      g.recv(y, 0, 0)->wait();
      CHECK(holds(y, 4));
      g.all_reduce(x.data(), 1000, DType::Float32);
    }
    sums[size_t(rank)] = x;
  }));
  CHECK(sums[0] == std::vector<float>(1000, 3.0f));
  CHECK(sums[1] == std::vector<float>(1000, 3.0f));
}

TEST_CASE("the bootstrap: strays with the public magic and another job's rank do not stop the job forming",
          "[distributed][tcp]") {
  const int port = free_port();
  const RendezvousSpec spec = tcp_spec(port);
  std::vector<Outcome> job(2);
  std::vector<int64_t> sums(2);
  const OwnedBody sum = [&](std::shared_ptr<ProcessGroup>& g, int rank) {
    int64_t x = rank + 1;
    g->all_reduce(&x, 1, DType::Int64);
    sums[size_t(rank)] = x;
  };
  std::thread zero([&] { job[0] = run_ranks({spec}, {0}, {2}, sum, 20)[0]; });
  // The hello's magic followed by garbage (a world size of 0x7f7f7f7f): not this job's.
  const int stray = connect_local(port);
  REQUIRE(stray >= 0);
  char garbage[32];
  std::memset(garbage, 0x7f, sizeof garbage);
  std::memcpy(garbage, "BOOSTTCP", 8);
  CHECK(::send(stray, garbage, sizeof garbage, MSG_NOSIGNAL) == ssize_t(sizeof garbage));
  // Another job's rank with another world size is told "another job".
  std::vector<Outcome> other =
      run_ranks({tcp_spec(port, "127.0.0.1", "other")}, {1}, {3}, [](std::shared_ptr<ProcessGroup>&, int) {}, 5);
  CHECK(other[0].type == "DistributedError");
  CHECK_THAT(other[0].error, Catch::Contains("of another job, not this one (job \"other\", world size 3)"));
  // The job's own rank 1 comes, and the job forms.
  job[1] = run_ranks({spec}, {1}, {2}, sum, 20)[0];
  zero.join();
  ::close(stray);
  require_clean(job);
  CHECK(sums == std::vector<int64_t>{3, 3});
}

TEST_CASE("the bootstrap: connections that say nothing do not hold up the job", "[distributed][tcp]") {
  // Three idle connections before the ranks come: each used to hold rank 0 for 10 s, one after another,
  // past the 8 s connect timeout.
  const int port = free_port();
  const RendezvousSpec spec = tcp_spec(port);
  std::vector<Outcome> job(3);
  std::vector<int64_t> sums(3);
  const OwnedBody sum = [&](std::shared_ptr<ProcessGroup>& g, int rank) {
    int64_t x = rank + 1;
    g->all_reduce(&x, 1, DType::Int64);
    sums[size_t(rank)] = x;
  };
  std::thread zero([&] { job[0] = run_ranks({spec}, {0}, {3}, sum, 8)[0]; });
  std::vector<int> idle;
  for (int k = 0; k < 3; ++k) idle.push_back(connect_local(port));
  std::vector<Outcome> rest = run_ranks({spec, spec}, {1, 2}, {3, 3}, sum, 8);
  zero.join();
  for (const int fd : idle) {
    CHECK(fd >= 0);
    ::close(fd);
  }
  job[1] = rest[0];
  job[2] = rest[1];
  require_clean(job);
  CHECK(sums == std::vector<int64_t>{6, 6, 6});
}

TEST_CASE("the bootstrap: running out of file descriptors is a DistributedError saying so", "[distributed][tcp]") {
  // In a child process with a low descriptor limit, so that this one is not starved: 6 ranks need about
  // 40 descriptors, 12 are left.
  int pipe_fds[2];
  REQUIRE(::pipe(pipe_fds) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(pipe_fds[0]);
    ::alarm(120);  // never a hang: SIGALRM ends the child
    // Only stdin, stdout, stderr and the pipe stay open: the limit caps descriptor numbers.
    std::vector<int> open_fds;
    for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd"))
      open_fds.push_back(std::atoi(entry.path().filename().c_str()));
    for (const int fd : open_fds)
      if (fd > 2 && fd != pipe_fds[1]) ::close(fd);
    const int out = ::dup2(pipe_fds[1], 3);
    if (pipe_fds[1] != 3) ::close(pipe_fds[1]);
    pipe_fds[1] = out;
    const rlimit limit{rlim_t(4 + 12), rlim_t(4 + 12)};
    ::setrlimit(RLIMIT_NOFILE, &limit);
    std::string report;
    for (const Outcome& o : run_world(6, [](ProcessGroup& g, int) {
           g.set_timeout(duration<double>(5));
           int64_t x = 1;
           g.all_reduce(&x, 1, DType::Int64);
         }, 5))
      report += o.type + ": " + o.error + "\n";
    (void)!::write(pipe_fds[1], report.data(), report.size());
    ::_exit(0);
  }
  ::close(pipe_fds[1]);
  std::string report;
  char chunk[4096];
  for (ssize_t k; (k = ::read(pipe_fds[0], chunk, sizeof chunk)) != 0;)
    if (k > 0) report.append(chunk, size_t(k));
  ::close(pipe_fds[0]);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  INFO(report);
  CHECK(WIFEXITED(status));
  CHECK_THAT(report, Catch::Contains("DistributedError: tcp group") && Catch::Contains("too many open files") &&
                         Catch::Contains("raise ulimit -n"));
}

TEST_CASE("addresses: a file rendezvous lists loopback last, and a table mixing loopback with the network is "
          "refused",
          "[distributed][tcp]") {
  // Debian resolves the host name to 127.0.1.1: the network addresses go first, loopback last.
  CHECK(net::file_rendezvous_hosts("node1", {"127.0.0.1", "10.0.0.5", "192.168.1.7"}) ==
        std::vector<std::string>{"10.0.0.5", "192.168.1.7", "node1", "127.0.0.1"});
  CHECK(net::file_rendezvous_hosts("", {}) == std::vector<std::string>{"127.0.0.1"});
  CHECK(net::is_loopback("127.0.1.1"));
  CHECK(net::is_loopback("::1"));
  CHECK_FALSE(net::is_loopback("10.0.0.5"));
  // Rank 0 saw ranks 1 and 3 on loopback (its own machine) and rank 2 over the network: rank 2 could
  // not reach them.
  const std::string mixed = net::mixed_loopback_error({"", "127.0.0.1", "10.0.0.6", "127.0.1.1"}, "tcp group");
  CHECK_THAT(mixed, Catch::Contains("tcp group: ranks 1 (127.0.0.1), 3 (127.0.1.1) reached rank 0 over a loopback "
                                    "address, which rank 2 (10.0.0.6) on other machines cannot reach") &&
                        Catch::Contains("set MASTER_ADDR to an address of rank 0's host that the other machines "
                                        "reach"));
  CHECK(net::mixed_loopback_error({"", "127.0.0.1", "127.0.0.1"}, "tcp group").empty());  // one machine
  CHECK(net::mixed_loopback_error({"", "10.0.0.5", "10.0.0.6"}, "tcp group").empty());
  CHECK(net::mixed_loopback_error({""}, "tcp group").empty());
}

namespace {

// Rank 1 of a world of 2 played by hand: it says hello to rank 0 at `port` and reads the table, then
// `send`s raw bytes on its link. -1 when rank 0 did not answer.
int fake_rank1(const RendezvousSpec& spec) {
  const int fd = connect_local(spec.port);
  if (fd < 0) return -1;
  struct {
    char magic[8];
    uint64_t token;
    int32_t rank, world_size, port, unused;
  } hello{{'B', 'O', 'O', 'S', 'T', 'T', 'C', 'P'}, net::job_token(spec, 2), 1, 2, 1, 0};
  static_assert(sizeof hello == 32);
  const auto deadline = net::deadline_after(duration<double>(10));
  if (!net::send_all(fd, &hello, sizeof hello, deadline)) return -1;
  // "BOOSTTCT", then per rank: port (2 bytes), host length, host.
  char magic[8];
  if (!net::recv_all(fd, magic, 8, deadline)) return -1;
  for (int r = 0; r < 2; ++r) {
    unsigned char head[3];
    if (!net::recv_all(fd, head, 3, deadline)) return -1;
    std::string host(head[2], '\0');
    if (!net::recv_all(fd, host.data(), host.size(), deadline)) return -1;
  }
  return fd;
}

struct RawHeader {
  uint32_t channel, tag;
  uint64_t bytes;
};

}  // namespace

TEST_CASE("a frame header with a length no frame can have loses that peer's link, naming it", "[distributed][tcp]") {
  for (const bool collective : {false, true}) {
    INFO((collective ? "a collective frame of 2 MiB" : "a point-to-point frame of 2^50 bytes while idle"));
    const RendezvousSpec spec = tcp_spec(free_port());
    std::string error = "(none)";
    std::thread zero([&] {
      try {
        std::shared_ptr<ProcessGroup> g = make_tcp_process_group(0, 2, spec, duration<double>(10));
        g->set_timeout(duration<double>(10));
        if (!collective) std::this_thread::sleep_for(std::chrono::milliseconds(300));  // it arrives while idle
        int64_t x = 1;
        g->all_reduce(&x, 1, DType::Int64);
      } catch (const DistributedError& e) {
        error = e.what();
      }
    });
    const int fd = fake_rank1(spec);
    CHECK(fd >= 0);
    const RawHeader bad = collective ? RawHeader{0, 1, uint64_t(2) << 20} : RawHeader{1, 0, uint64_t(1) << 50};
    if (fd >= 0) CHECK(::send(fd, &bad, sizeof bad, MSG_NOSIGNAL) == ssize_t(sizeof bad));
    zero.join();
    if (fd >= 0) ::close(fd);
    CHECK_THAT(error, Catch::Contains("rank 1 of group \"world\" sent a") &&
                          Catch::Contains(collective ? "collective frame of 2097152 bytes (at most 1048576)"
                                                     : "point-to-point frame of 1125899906842624 bytes") &&
                          Catch::Contains("all_reduce #1"));
  }
}
