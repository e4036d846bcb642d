// The "tcp" process group (distributed/tcp_process_group.h, Note [TCP process group]): N ranks run as
// N threads of this process, each with its own group, meeting over TCP on 127.0.0.1 (or a file).
// References are not the group's code: exact integer sums, float64 sums with a derived bound, the
// mpi backend's semantics (Avg divides first, 16-bit values combine in float32 and round each step).
#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <sys/socket.h>
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

#include "booster/common/error.h"
#include "booster/distributed/process_group.h"
#include "booster/distributed/rendezvous.h"
#include "booster/distributed/tcp_process_group.h"
#include "booster/tensor/half.h"
#include "booster/tensor/tensor.h"
#include "run_booster.h"

using namespace booster;
using namespace booster::distributed;
using std::chrono::duration;
using Clock = std::chrono::steady_clock;

namespace {

// A port nobody listens on now (the kernel's choice for a socket bound to port 0, released).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

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

using Body = std::function<void(ProcessGroup& group, int rank)>;

// Runs `world` ranks as threads: each makes its group (rendezvous at 127.0.0.1:<a free port>) and runs
// `body`; returns what each ended with.
std::vector<Outcome> run_world(int world, const Body& body, double connect_timeout_s = 30,
                               const RendezvousSpec* spec_in = nullptr) {
  const RendezvousSpec spec = spec_in ? *spec_in : tcp_spec(free_port());
  std::vector<Outcome> out(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      Outcome& o = out[size_t(r)];
      const auto start = Clock::now();
      try {
        std::shared_ptr<ProcessGroup> group = make_tcp_process_group(r, world, spec, duration<double>(connect_timeout_s));
        body(*group, r);
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
            if (in_place && m) std::memcpy(out.data() + size_t(rank * m) * itemsize(dtype), mine.data(), mine.size() - 1);
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
