// The rendezvous without MPI (distributed/rendezvous.h, Note [Rendezvous without MPI]): ranks from
// torchrun's or booster's variables, and rank 0's blob handed to every rank through a file and through
// TCP, run here as threads of one process (each thread a rank); timeouts and bad settings.
#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "collective_timeout.h"  // a rank left waiting fails within a minute
#include "booster/common/error.h"
#include "booster/distributed/rendezvous.h"
#include "local_sockets.h"
#include "run_booster.h"

namespace fs = std::filesystem;
using namespace booster;
using namespace booster::distributed;
using std::chrono::duration;

using testing::connect_local;
using testing::free_port;

namespace {

const std::vector<const char*> kVariables = {"BOOSTER_RANK", "BOOSTER_WORLD_SIZE", "BOOSTER_LOCAL_RANK", "RANK",
                                             "WORLD_SIZE", "LOCAL_RANK", "BOOSTER_NCCL_ID_FILE", "MASTER_ADDR",
                                             "MASTER_PORT"};

// Sets exactly `values` of the rendezvous variables for the test's lifetime, and restores them after.
class EnvGuard {
 public:
  explicit EnvGuard(const std::map<std::string, std::string>& values) {
    for (const char* name : kVariables) {
      if (const char* v = std::getenv(name)) saved_[name] = v;
      ::unsetenv(name);
    }
    for (const auto& [name, value] : values) ::setenv(name.c_str(), value.c_str(), 1);
  }
  ~EnvGuard() {
    for (const char* name : kVariables) ::unsetenv(name);
    for (const auto& [name, value] : saved_) ::setenv(name.c_str(), value.c_str(), 1);
  }

 private:
  std::map<std::string, std::string> saved_;
};

std::string config_error(const std::map<std::string, std::string>& values, bool spec) {
  EnvGuard env(values);
  try {
    spec ? (void)rendezvous_from_environment() : (void)ranks_from_environment();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no error)";
}

std::vector<uint8_t> id_blob() {
  std::vector<uint8_t> blob(128);  // the size of ncclUniqueId
  for (size_t i = 0; i < blob.size(); ++i) blob[i] = uint8_t(i * 7 + 3);
  return blob;
}

// Runs `world` ranks as threads; each returns its blob, or the message of what it threw.
struct Outcome {
  std::vector<uint8_t> blob;
  std::string error;
  std::string type;
};

// Each rank waits timeout_s, or its own entry of `timeouts` when given.
std::vector<Outcome> run_ranks(const RendezvousSpec& spec, int world, const std::vector<int>& ranks, double timeout_s,
                               const std::vector<double>& timeouts = {}) {
  std::vector<Outcome> out(ranks.size());
  std::vector<std::thread> threads;
  for (size_t k = 0; k < ranks.size(); ++k)
    threads.emplace_back([&, k] {
      try {
        out[k].blob = share_from_rank0(spec, ranks[k], world, ranks[k] == 0 ? id_blob() : std::vector<uint8_t>{},
                                       duration<double>(timeouts.empty() ? timeout_s : timeouts[k]));
      } catch (const ConfigError& e) {
        out[k] = {{}, e.what(), "ConfigError"};
      } catch (const DistributedError& e) {
        out[k] = {{}, e.what(), "DistributedError"};
      } catch (const std::exception& e) {
        out[k] = {{}, e.what(), "other"};
      }
    });
  for (std::thread& t : threads) t.join();
  return out;
}

std::vector<int> all_ranks(int world) {
  std::vector<int> r(size_t(world), 0);
  for (int i = 0; i < world; ++i) r[size_t(i)] = i;
  return r;
}

fs::path scratch() {
  const fs::path dir = testing::scratch_dir("test_rendezvous");
  fs::create_directories(dir);
  return dir;
}

RendezvousSpec tcp_spec(int port, const std::string& address = "127.0.0.1") {
  RendezvousSpec spec;
  spec.kind = RendezvousSpec::Kind::Tcp;
  spec.address = address;
  spec.port = port;
  spec.source = "MASTER_ADDR/MASTER_PORT";
  return spec;
}

RendezvousSpec file_spec(const fs::path& path) {
  RendezvousSpec spec;
  spec.kind = RendezvousSpec::Kind::File;
  spec.file = path.string();
  spec.source = "BOOSTER_NCCL_ID_FILE";
  return spec;
}

}  // namespace

TEST_CASE("ranks come from torchrun's RANK, WORLD_SIZE and LOCAL_RANK, or booster's own", "[distributed][rendezvous]") {
  {
    EnvGuard env({});
    CHECK_FALSE(ranks_from_environment().has_value());
  }
  {
    EnvGuard env({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}});
    const std::optional<EnvRanks> r = ranks_from_environment();
    REQUIRE(r);
    CHECK(r->rank == 3);
    CHECK(r->world_size == 4);
    CHECK(r->local_rank == 1);
  }
  {
    // booster's variables win over torchrun's; the local rank defaults to the rank.
    EnvGuard env({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"BOOSTER_RANK", "1"}, {"BOOSTER_WORLD_SIZE", "2"}});
    const std::optional<EnvRanks> r = ranks_from_environment();
    REQUIRE(r);
    CHECK(r->rank == 1);
    CHECK(r->world_size == 2);
    CHECK(r->local_rank == 1);
  }
}

TEST_CASE("a missing or bad rank variable is a ConfigError naming it", "[distributed][rendezvous]") {
  CHECK_THAT(config_error({{"WORLD_SIZE", "2"}}, false), Catch::Contains("WORLD_SIZE is set but RANK is not"));
  CHECK_THAT(config_error({{"WORLD_SIZE", "2"}, {"RANK", "2"}}, false),
             Catch::Contains("RANK is \"2\"; expected this process's rank from 0 to 1"));
  CHECK_THAT(config_error({{"WORLD_SIZE", "two"}, {"RANK", "0"}}, false), Catch::Contains("WORLD_SIZE is \"two\""));
  CHECK_THAT(config_error({{"BOOSTER_WORLD_SIZE", "2"}, {"BOOSTER_RANK", "-1"}}, false),
             Catch::Contains("BOOSTER_RANK is \"-1\""));
  CHECK_THAT(config_error({{"BOOSTER_RANK", "0"}}, false), Catch::Contains("BOOSTER_RANK is set without"));
}

TEST_CASE("the rendezvous is a file, or MASTER_ADDR and MASTER_PORT, and a bad port is a ConfigError",
          "[distributed][rendezvous]") {
  {
    EnvGuard env({{"MASTER_ADDR", "node01"}, {"MASTER_PORT", "29500"}});
    const std::optional<RendezvousSpec> s = rendezvous_from_environment();
    REQUIRE(s);
    CHECK(s->kind == RendezvousSpec::Kind::Tcp);
    CHECK(s->address == "node01");
    CHECK(s->port == 29500);
  }
  {
    EnvGuard env({{"MASTER_ADDR", "node01"}, {"MASTER_PORT", "29500"}, {"BOOSTER_NCCL_ID_FILE", "/shared/id"}});
    const std::optional<RendezvousSpec> s = rendezvous_from_environment();
    REQUIRE(s);
    CHECK(s->kind == RendezvousSpec::Kind::File);
    CHECK(s->file == "/shared/id");
  }
  {
    EnvGuard env({});
    CHECK_FALSE(rendezvous_from_environment().has_value());
  }
  for (const std::string port : {"0", "65536", "http", "29500x", "-1"})
    CHECK_THAT(config_error({{"MASTER_ADDR", "node01"}, {"MASTER_PORT", port}}, true),
               Catch::Contains("MASTER_PORT is \"" + port + "\"; expected a port number from 1 to 65535"));
  CHECK_THAT(config_error({{"MASTER_ADDR", "node01"}}, true), Catch::Contains("MASTER_PORT is not"));
  CHECK_THAT(config_error({{"MASTER_PORT", "29500"}}, true), Catch::Contains("MASTER_ADDR is not"));
}

TEST_CASE("rank 0's blob reaches every rank through a shared file, which is gone afterwards",
          "[distributed][rendezvous]") {
  const fs::path path = scratch() / "nccl_id";
  fs::remove(path);
  for (const Outcome& o : run_ranks(file_spec(path), 4, all_ranks(4), 30)) {
    INFO(o.error);
    CHECK(o.blob == id_blob());
  }
  CHECK_FALSE(fs::exists(path));
  for (int r = 1; r < 4; ++r) CHECK_FALSE(fs::exists(path.string() + ".ack." + std::to_string(r)));
  // Again on the same path: nothing of the first exchange is in the way.
  for (const Outcome& o : run_ranks(file_spec(path), 2, all_ranks(2), 30)) CHECK(o.blob == id_blob());
}

TEST_CASE("waiting on the file past the timeout is a DistributedError naming what did not come",
          "[distributed][rendezvous]") {
  const fs::path path = scratch() / "nccl_id_timeout";
  fs::remove(path);
  // A peer without rank 0.
  std::vector<Outcome> o = run_ranks(file_spec(path), 3, {2}, 0.3);
  CHECK(o[0].type == "DistributedError");
  CHECK_THAT(o[0].error, Catch::Contains("rendezvous: rank 2 waited 0.3 s for rank 0 to write " + path.string() +
                                         " (BOOSTER_NCCL_ID_FILE)"));
  // Rank 0 and rank 1 without rank 2: rank 0 names rank 2 and leaves a marker that it gave up; rank 1,
  // which read the blob, fails too rather than go on with a job that will not start (it waits longer
  // than rank 0 here, so that it is the marker that ends its wait, not its own timeout).
  o = run_ranks(file_spec(path), 3, {0, 1}, 0.5, {0.5, 30});
  CHECK(o[0].type == "DistributedError");
  CHECK_THAT(o[0].error, Catch::Contains("rank 0 waited 0.5 s for ranks [2] of 3 to read " + path.string()));
  CHECK(o[1].type == "DistributedError");
  CHECK_THAT(o[1].error, Catch::Contains("rank 0 gave up waiting for the other ranks"));
  // The next job writes over the marker.
  for (const Outcome& next : run_ranks(file_spec(path), 2, all_ranks(2), 30)) {
    INFO(next.error);
    CHECK(next.blob == id_blob());
  }
  CHECK_FALSE(fs::exists(path));
  // A file already there (another job's) is refused by rank 0.
  std::ofstream(path) << "old";
  o = run_ranks(file_spec(path), 2, {0}, 0.3);
  CHECK(o[0].type == "ConfigError");
  CHECK_THAT(o[0].error, Catch::Contains(path.string() + " exists already"));
  fs::remove(path);
}

TEST_CASE("rank 0's blob reaches every rank over TCP", "[distributed][rendezvous]") {
  const int port = free_port();
  // Peers start first and retry until rank 0 listens.
  std::vector<int> ranks = {3, 1, 2, 0};
  for (const Outcome& o : run_ranks(tcp_spec(port), 4, ranks, 30)) {
    INFO(o.error);
    CHECK(o.blob == id_blob());
  }
  // By host name too, and the port is free again at once.
  for (const Outcome& o : run_ranks(tcp_spec(port, "localhost"), 2, all_ranks(2), 30)) {
    INFO(o.error);
    CHECK(o.blob == id_blob());
  }
}

TEST_CASE("waiting over TCP past the timeout is a DistributedError naming what did not come",
          "[distributed][rendezvous]") {
  const int port = free_port();
  std::vector<Outcome> o = run_ranks(tcp_spec(port), 2, {1}, 0.3);
  CHECK(o[0].type == "DistributedError");
  CHECK_THAT(o[0].error, Catch::Contains("rendezvous: rank 1 waited 0.3 s for rank 0 at 127.0.0.1:" +
                                         std::to_string(port) + " (MASTER_ADDR/MASTER_PORT)"));
  o = run_ranks(tcp_spec(port), 3, {0, 2}, 0.5);
  CHECK(o[0].type == "DistributedError");
  CHECK_THAT(o[0].error, Catch::Contains("rendezvous: rank 0 waited 0.5 s on port " + std::to_string(port) +
                                         " (MASTER_ADDR/MASTER_PORT) for ranks [1] of 3 to connect"));
  CHECK(o[1].blob == id_blob());  // rank 2 had its blob
}

TEST_CASE("a connect that gets no answer ends at the timeout, not the kernel's minutes of retries",
          "[distributed][rendezvous]") {
  // A listener that never accepts, with its queue of one connection full: the kernel drops further
  // connection requests, as a firewall does, so a blocking connect would wait for its retries (~2 min).
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(listener, 0) == 0);
  socklen_t len = sizeof a;
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len);
  std::vector<int> fillers;
  for (int k = 0; k < 2; ++k) {
    fillers.push_back(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0));
    ::connect(fillers.back(), reinterpret_cast<sockaddr*>(&a), sizeof a);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  // The rank runs apart; a wait far beyond its timeout means the connect ignored it (then the thread
  // is left to finish on its own, with state of its own).
  struct State {
    std::mutex mutex;
    std::condition_variable done;
    bool finished = false;
    Outcome outcome;
  };
  auto state = std::make_shared<State>();
  const RendezvousSpec spec = tcp_spec(ntohs(a.sin_port));
  std::thread rank([state, spec] {
    Outcome o;
    try {
      share_from_rank0(spec, 1, 2, {}, duration<double>(1.5));
      o.type = "none";
    } catch (const DistributedError& e) {
      o = {{}, e.what(), "DistributedError"};
    } catch (const std::exception& e) {
      o = {{}, e.what(), "other"};
    }
    std::lock_guard<std::mutex> lock(state->mutex);
    state->outcome = o;
    state->finished = true;
    state->done.notify_all();
  });
  bool finished;
  {
    std::unique_lock<std::mutex> lock(state->mutex);
    finished = state->done.wait_for(lock, std::chrono::seconds(30), [&] { return state->finished; });
  }
  if (finished) {
    rank.join();
  } else {
    rank.detach();
  }
  for (int fd : fillers) ::close(fd);
  ::close(listener);
  REQUIRE(finished);
  CHECK(state->outcome.type == "DistributedError");
  CHECK_THAT(state->outcome.error, Catch::Contains("rendezvous: rank 1 waited 1.5 s for rank 0 at 127.0.0.1:") &&
                                       Catch::Contains("no answer to connect before the timeout"));
}

TEST_CASE("an address that does not resolve, a port in use or another world size is a ConfigError",
          "[distributed][rendezvous]") {
  std::vector<Outcome> o = run_ranks(tcp_spec(free_port(), "no-such-host.invalid"), 2, {1}, 5);
  CHECK(o[0].type == "ConfigError");
  CHECK_THAT(o[0].error, Catch::Contains("MASTER_ADDR \"no-such-host.invalid\" cannot be resolved"));

  // A port another socket holds.
  const int fd = ::socket(AF_INET6, SOCK_STREAM, 0);
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_any;
  const int zero = 0;
  ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(fd, 1) == 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int busy = ntohs(a.sin6_port);
  o = run_ranks(tcp_spec(busy), 2, {0}, 5);
  ::close(fd);
  CHECK(o[0].type == "ConfigError");
  CHECK_THAT(o[0].error, Catch::Contains("rank 0 cannot listen on port " + std::to_string(busy)) &&
                             Catch::Contains("choose another MASTER_PORT"));

  // A peer told another world size.
  const int port = free_port();
  std::vector<Outcome> mixed(2);
  std::thread zero_thread([&] {
    try {
      share_from_rank0(tcp_spec(port), 0, 2, id_blob(), duration<double>(10));
    } catch (const ConfigError& e) {
      mixed[0].error = e.what();
    }
  });
  std::thread one_thread([&] {
    try {
      share_from_rank0(tcp_spec(port), 1, 3, {}, duration<double>(2));
    } catch (const std::exception& e) {
      mixed[1].error = e.what();
    }
  });
  zero_thread.join();
  one_thread.join();
  CHECK_THAT(mixed[0].error, Catch::Contains("rank 1 was started with a world size of 3 and rank 0 with 2"));
}

TEST_CASE("rank 0 listens on the address MASTER_ADDR names, and one not of this machine is a ConfigError",
          "[distributed][rendezvous]") {
  // 192.0.2.1 (TEST-NET-1, RFC 5737) is no address of this machine: rank 0 cannot be running there.
  std::vector<Outcome> o = run_ranks(tcp_spec(free_port(), "192.0.2.1"), 2, {0}, 1);
  CHECK(o[0].type == "ConfigError");
  CHECK_THAT(o[0].error, Catch::Contains("MASTER_ADDR \"192.0.2.1\" (MASTER_ADDR/MASTER_PORT) is not an address of "
                                         "this machine") &&
                             Catch::Contains("rank 0 must run on MASTER_ADDR's host"));
  // Bound to 127.0.0.1 only: the port is still free on this machine's other addresses.
  const int port = free_port();
  std::vector<Outcome> served;
  std::thread zero([&] { served = run_ranks(tcp_spec(port), 2, {0}, 2); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const int fd = ::socket(AF_INET6, SOCK_STREAM, 0);
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  a.sin6_port = htons(uint16_t(port));
  const bool v6_free = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  if (fd >= 0) ::close(fd);
  zero.join();
  if (fd >= 0) CHECK(v6_free);  // a listener on every interface would hold [::1]:port too
  CHECK(served[0].type == "DistributedError");  // nobody came
}

TEST_CASE("two jobs with different ids on one file or one port do not take each other's blob",
          "[distributed][rendezvous]") {
  const auto spec_of = [](RendezvousSpec spec, const std::string& job) {
    spec.job = job;
    return spec;
  };
  for (const bool tcp : {false, true}) {
    INFO((tcp ? "TCP" : "file"));
    const fs::path path = scratch() / "nccl_id_two_jobs";
    fs::remove(path);
    const RendezvousSpec base = tcp ? tcp_spec(free_port()) : file_spec(path);
    // Job A's rank 0 is waiting for its peer.
    Outcome a0;
    std::thread zero([&] {
      try {
        a0.blob = share_from_rank0(spec_of(base, "A"), 0, 2, id_blob(), duration<double>(30));
      } catch (const std::exception& e) {
        a0.error = e.what();
      }
    });
    if (!tcp)
      while (!fs::exists(path)) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    // Job B's rank 1 must not take job A's blob.
    std::vector<Outcome> b = run_ranks(spec_of(base, "B"), 2, {1}, 1.0);
    CHECK(b[0].type == "DistributedError");
    CHECK_THAT(b[0].error, Catch::Contains("another job") && Catch::Contains("job \"B\", world size 2"));
    if (!tcp) {
      // Job B's rank 0 finds the file claimed.
      b = run_ranks(spec_of(base, "B"), 2, {0}, 1.0);
      CHECK(b[0].type == "ConfigError");
      CHECK_THAT(b[0].error, Catch::Contains("exists already"));
    }
    // Job A's own peer gets it, and job A ends.
    std::vector<Outcome> a1 = run_ranks(spec_of(base, "A"), 2, {1}, 30);
    zero.join();
    INFO(a0.error << a1[0].error);
    CHECK(a1[0].blob == id_blob());
    CHECK(a0.blob == id_blob());
    CHECK_FALSE(fs::exists(path));
  }
}

TEST_CASE("the job id comes from TORCHELASTIC_RUN_ID, SLURM_JOB_ID or BOOSTER_RUN_ID", "[distributed][rendezvous]") {
  EnvGuard env({{"MASTER_ADDR", "node01"}, {"MASTER_PORT", "29500"}});
  ::setenv("SLURM_JOB_ID", "123", 1);
  ::unsetenv("TORCHELASTIC_RUN_ID");
  const std::optional<RendezvousSpec> s = rendezvous_from_environment();
  ::unsetenv("SLURM_JOB_ID");
  REQUIRE(s);
  CHECK(s->job == "123");
}

TEST_CASE("a world of one needs no rendezvous", "[distributed][rendezvous]") {
  CHECK(share_from_rank0(tcp_spec(1, "no-such-host.invalid"), 0, 1, id_blob(), duration<double>(1)) == id_blob());
  CHECK_THROWS_AS(share_from_rank0(tcp_spec(1), 2, 2, {}, duration<double>(1)), ValueError);
}

TEST_CASE("over TCP, strays with the public magic and another job's rank do not stop rank 0",
          "[distributed][rendezvous]") {
  const int port = free_port();
  std::vector<Outcome> zero_out;
  std::thread zero([&] { zero_out = run_ranks(tcp_spec(port), 2, {0}, 20); });
  // The hello's magic followed by garbage (a world size of 0x7f7f7f7f): not this job's.
  const int stray = connect_local(port);
  REQUIRE(stray >= 0);
  char garbage[24];
  std::memset(garbage, 0x7f, sizeof garbage);
  std::memcpy(garbage, "BOOSTRD1", 8);
  CHECK(::send(stray, garbage, sizeof garbage, MSG_NOSIGNAL) == ssize_t(sizeof garbage));
  // Another job's rank with another world size is told "another job".
  RendezvousSpec other = tcp_spec(port);
  other.job = "other";
  std::vector<Outcome> o = run_ranks(other, 3, {1}, 5);
  CHECK(o[0].type == "DistributedError");
  CHECK_THAT(o[0].error, Catch::Contains("of another job, not this one (job \"other\", world size 3)"));
  // The job's own rank 1 gets the blob.
  o = run_ranks(tcp_spec(port), 2, {1}, 20);
  zero.join();
  ::close(stray);
  INFO(zero_out[0].error << o[0].error);
  CHECK(o[0].blob == id_blob());
  CHECK(zero_out[0].blob == id_blob());
}

TEST_CASE("over TCP, connections that say nothing do not hold up rank 0", "[distributed][rendezvous]") {
  // Three idle connections before the ranks come: each used to hold rank 0 for 10 s, one after another,
  // past the 8 s timeout.
  const int port = free_port();
  std::vector<Outcome> zero_out;
  std::thread zero([&] { zero_out = run_ranks(tcp_spec(port), 3, {0}, 8); });
  std::vector<int> idle;
  for (int k = 0; k < 3; ++k) idle.push_back(connect_local(port));
  std::vector<Outcome> o = run_ranks(tcp_spec(port), 3, {1, 2}, 8);
  zero.join();
  for (const int fd : idle) {
    CHECK(fd >= 0);
    ::close(fd);
  }
  INFO(zero_out[0].error << o[0].error << o[1].error);
  CHECK(zero_out[0].blob == id_blob());
  CHECK(o[0].blob == id_blob());
  CHECK(o[1].blob == id_blob());
}
