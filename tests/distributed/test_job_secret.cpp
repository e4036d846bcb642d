// The job secret of the tcp group and the TCP rendezvous (Note [Job secret] in distributed/README.md):
// strangers who reach MASTER_PORT, played by a thread of this test speaking the wire protocol (a wrong
// secret, a replayed answer to an old nonce, another job's rank on the same port, a hello claiming another
// world size), are refused, and the job forms anyway with the same result bytes as without them. The
// reference for "unaffected" is the same job run alone.
#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "collective_timeout.h"  // a rank left waiting fails within a minute
#include "booster/common/error.h"
#include "booster/distributed/process_group.h"
#include "booster/distributed/rendezvous.h"
#include "booster/distributed/socket_impl.h"
#include "booster/distributed/tcp_process_group.h"
#include "local_sockets.h"

using namespace booster;
using namespace booster::distributed;
using std::chrono::duration;
using Clock = std::chrono::steady_clock;
using testing::connect_local;
using testing::free_port;

namespace {

// The tcp group's hello to rank 0, as tcp_process_group.cpp lays it out.
struct TcpHello {
  char magic[8];
  uint64_t token;
  int32_t rank;
  int32_t world_size;
  int32_t port;
  int32_t unused;
};
static_assert(sizeof(TcpHello) == 32);

RendezvousSpec secret_spec(int port, const std::string& secret) {
  RendezvousSpec spec;
  spec.kind = RendezvousSpec::Kind::Tcp;
  spec.address = "127.0.0.1";
  spec.port = port;
  spec.source = "MASTER_ADDR/MASTER_PORT";
  spec.secret = secret;
  return spec;
}

// One rank of the job: makes its group and returns its result bytes (a broadcast of rank 0's vector and an
// all_reduce of every rank's), or the error it ended with as "error: ...".
std::string job_rank(const RendezvousSpec& spec, int rank, int world) {
  try {
    auto g = make_tcp_process_group(rank, world, spec, duration<double>(20));
    std::vector<float> model(50890);  // the size of a small model's broadcast
    for (size_t i = 0; i < model.size(); ++i) model[i] = rank == 0 ? float(i) * 0.25f : -1.0f;
    g->broadcast(BufferSpan{model.data(), int64_t(model.size()), DType::Float32, Device::cpu()}, 0);
    std::vector<float> grad(1000);
    for (size_t i = 0; i < grad.size(); ++i) grad[i] = float(rank + 1) * 0.1f + float(i);
    g->all_reduce(grad.data(), int64_t(grad.size()), DType::Float32, ReduceOp::Sum);
    std::string bytes(reinterpret_cast<const char*>(model.data()), model.size() * sizeof(float));
    bytes.append(reinterpret_cast<const char*>(grad.data()), grad.size() * sizeof(float));
    return bytes;
  } catch (const std::exception& e) {
    return std::string("error: ") + e.what();
  }
}

// The job alone: the reference result of every rank.
std::vector<std::string> job_alone(int world, const std::string& secret) {
  const RendezvousSpec spec = secret_spec(free_port(), secret);
  std::vector<std::string> out(static_cast<size_t>(world));
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r) ts.emplace_back([&, r] { out[size_t(r)] = job_rank(spec, r, world); });
  for (auto& t : ts) t.join();
  return out;
}

// The job with `stranger` run against its rank 0 before the other ranks start.
std::vector<std::string> job_with(int world, const RendezvousSpec& spec, const std::function<void()>& stranger) {
  std::vector<std::string> out(static_cast<size_t>(world));
  std::thread zero([&] { out[0] = job_rank(spec, 0, world); });
  stranger();
  std::vector<std::thread> ts;
  for (int r = 1; r < world; ++r) ts.emplace_back([&, r] { out[size_t(r)] = job_rank(spec, r, world); });
  for (auto& t : ts) t.join();
  zero.join();
  return out;
}

TcpHello hello_for(const RendezvousSpec& spec, int rank, int world) {
  TcpHello h{};
  std::memcpy(h.magic, "BOOSTTCP", 8);
  h.token = net::job_token(spec, world);  // public: anyone computes it
  h.rank = rank;
  h.world_size = world;
  h.port = 1;
  return h;
}

// A stranger at `port` that sends `hello` and, challenged, answers with `secret`: what rank 0 said.
net::SecretResult stranger_proves(int port, const TcpHello& hello, const std::string& secret) {
  const int fd = connect_local(port);
  REQUIRE(fd >= 0);
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  REQUIRE(net::send_all(fd, &hello, sizeof hello, deadline));
  char head[8] = {};
  REQUIRE(net::recv_all(fd, head, sizeof head, deadline));
  REQUIRE(std::string(head, 8) == "BOOSTTCN");  // challenged, not taken on its token
  const net::SecretResult r = net::prove_secret(fd, secret, &hello, sizeof hello, deadline);
  ::close(fd);
  return r;
}

void check_same(const std::vector<std::string>& got, const std::vector<std::string>& want) {
  REQUIRE(got.size() == want.size());
  for (size_t r = 0; r < got.size(); ++r) {
    INFO("rank " << r << ": " << got[r].substr(0, 300));
    CHECK(got[r].rfind("error: ", 0) != 0);
    CHECK(got[r] == want[r]);  // the same bytes as the job alone
  }
}

// Captures std::cerr while alive.
struct CaptureCerr {
  std::ostringstream text;
  std::streambuf* old;
  CaptureCerr() : old(std::cerr.rdbuf(text.rdbuf())) {}
  ~CaptureCerr() { std::cerr.rdbuf(old); }
};

}  // namespace

TEST_CASE("job secret: a stranger with a wrong secret is refused, logged, and the job is unaffected",
          "[distributed][tcp][secret]") {
  const std::vector<std::string> alone = job_alone(2, "s3cret-of-the-job");
  const RendezvousSpec spec = secret_spec(free_port(), "s3cret-of-the-job");
  std::vector<std::string> got;
  std::string log;
  {
    CaptureCerr capture;
    got = job_with(2, spec, [&] {
      CHECK(stranger_proves(spec.port, hello_for(spec, 1, 2), "a-guess") == net::SecretResult::kRefused);
      CHECK(stranger_proves(spec.port, hello_for(spec, 1, 2), "") == net::SecretResult::kRefused);
    });
    log = capture.text.str();
  }
  check_same(got, alone);
  CHECK_THAT(log, Catch::Contains("dropped a connection from 127.0.0.1 that says it is rank 1 of 2: it did not prove "
                                  "it knows this job's secret"));
}

TEST_CASE("job secret: a hello claiming another world size or rank does not end rank 0", "[distributed][tcp][secret]") {
  const std::vector<std::string> alone = job_alone(2, "k");
  const RendezvousSpec spec = secret_spec(free_port(), "k");
  CaptureCerr capture;
  const auto got = job_with(2, spec, [&] {
    // Without a secret these end rank 0 with a ConfigError (another WORLD_SIZE, a rank out of range).
    CHECK(stranger_proves(spec.port, hello_for(spec, 1, 3), "x") == net::SecretResult::kRefused);
    CHECK(stranger_proves(spec.port, hello_for(spec, 7, 2), "x") == net::SecretResult::kRefused);
  });
  check_same(got, alone);
}

TEST_CASE("job secret: a replayed answer to an old nonce is refused", "[distributed][tcp][secret]") {
  const std::string secret = "replay-me";
  // Capture: this test plays rank 0 for a real rank 1 and records its hello and its answer to nonce N1.
  const int fake_port = free_port();
  const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(uint16_t(fake_port));
  const int one = 1;
  ::setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(listener, 4) == 0);
  std::string victim;
  std::thread real([&] { victim = job_rank(secret_spec(fake_port, secret), 1, 2); });
  const int fd = ::accept(listener, nullptr, nullptr);
  REQUIRE(fd >= 0);
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  TcpHello hello{};
  REQUIRE(net::recv_all(fd, &hello, sizeof hello, deadline));
  uint8_t nonce[32];
  net::random_nonce(nonce);
  REQUIRE(net::send_all(fd, "BOOSTTCN", 8, deadline));
  REQUIRE(net::send_all(fd, nonce, sizeof nonce, deadline));
  char answer[64];
  REQUIRE(net::recv_all(fd, answer, sizeof answer, deadline));
  char no[33] = {'N'};
  REQUIRE(net::send_all(fd, no, sizeof no, deadline));
  real.join();
  ::close(fd);
  ::close(listener);
  CHECK_THAT(victim, Catch::Contains("was refused by the rank 0 at 127.0.0.1:"));

  // Replay against the real job: the same hello, the captured answer to a new nonce.
  const std::vector<std::string> alone = job_alone(2, secret);
  const RendezvousSpec spec = secret_spec(free_port(), secret);
  CaptureCerr capture;
  const auto got = job_with(2, spec, [&] {
    const int s = connect_local(spec.port);
    REQUIRE(s >= 0);
    const auto until = Clock::now() + std::chrono::seconds(10);
    hello.token = net::job_token(spec, 2);
    REQUIRE(net::send_all(s, &hello, sizeof hello, until));
    char head[8 + 32];
    REQUIRE(net::recv_all(s, head, sizeof head, until));
    CHECK(std::memcmp(head + 8, nonce, 32) != 0);  // a fresh nonce
    REQUIRE(net::send_all(s, answer, sizeof answer, until));
    char reply[33] = {};
    CHECK((!net::recv_all(s, reply, sizeof reply, until) || reply[0] == 'N'));
    ::close(s);
  });
  check_same(got, alone);
}

TEST_CASE("job secret: a second job's rank on the same port is refused and both jobs are told so",
          "[distributed][tcp][secret]") {
  const std::vector<std::string> alone = job_alone(2, "job-one");
  const RendezvousSpec spec = secret_spec(free_port(), "job-one");
  RendezvousSpec other = spec;
  other.secret = "job-two";
  std::string second;
  CaptureCerr capture;
  const auto got = job_with(2, spec, [&] { second = job_rank(other, 1, 2); });
  check_same(got, alone);
  CHECK_THAT(second, Catch::Contains("was refused by the rank 0 at 127.0.0.1:"));
  CHECK_THAT(second, Catch::Contains("another job secret"));
  // A rank with no secret at all meets "another job" (its token differs).
  RendezvousSpec none = spec;
  none.secret = "";
  std::string bare;
  const auto again = job_with(2, spec, [&] { bare = job_rank(none, 1, 2); });
  (void)again;
  CHECK_THAT(bare, Catch::Contains("of another job, not this one"));
}

TEST_CASE("job secret: three ranks and a split prove it on every mesh link", "[distributed][tcp][secret]") {
  const RendezvousSpec spec = secret_spec(free_port(), "mesh");
  std::vector<std::string> errors(3);
  std::vector<int64_t> sums(3), sub(3);
  std::vector<std::thread> ts;
  for (int r = 0; r < 3; ++r)
    ts.emplace_back([&, r] {
      try {
        auto g = make_tcp_process_group(r, 3, spec, duration<double>(20));
        int64_t x = r + 1;
        g->all_reduce(&x, 1, DType::Int64);
        sums[size_t(r)] = x;
        auto s = g->split(r % 2, r, "halves");
        int64_t y = r + 1;
        s->all_reduce(&y, 1, DType::Int64);
        sub[size_t(r)] = y;
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  CHECK(errors == std::vector<std::string>(3));
  CHECK(sums == std::vector<int64_t>{6, 6, 6});
  CHECK(sub == std::vector<int64_t>{4, 2, 4});
}

TEST_CASE("job secret: the rendezvous that carries NCCL's id refuses a stranger and hands out the blob",
          "[distributed][tcp][secret]") {
  const RendezvousSpec spec = secret_spec(free_port(), "nccl-id");
  const std::vector<uint8_t> blob = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<uint8_t> got0, got1;
  CaptureCerr capture;
  std::thread zero([&] { got0 = share_from_rank0(spec, 0, 2, blob, duration<double>(20)); });
  {
    // The rendezvous hello: magic, rank, world size, token.
    struct {
      char magic[8];
      int32_t rank;
      int32_t world_size;
      uint64_t token;
    } hello{};
    std::memcpy(hello.magic, "BOOSTRD1", 8);
    hello.rank = 1;
    hello.world_size = 2;
    hello.token = net::job_token(spec, 2);
    const int fd = connect_local(spec.port);
    REQUIRE(fd >= 0);
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    REQUIRE(net::send_all(fd, &hello, sizeof hello, deadline));
    char head[8];
    REQUIRE(net::recv_all(fd, head, sizeof head, deadline));
    CHECK(std::string(head, 8) == "BOOSTRDN");
    CHECK(net::prove_secret(fd, "wrong", &hello, sizeof hello, deadline) == net::SecretResult::kRefused);
    ::close(fd);
  }
  std::thread one([&] { got1 = share_from_rank0(spec, 1, 2, {}, duration<double>(20)); });
  one.join();
  zero.join();
  CHECK(got0 == blob);
  CHECK(got1 == blob);
  CHECK_THAT(capture.text.str(), Catch::Contains("rendezvous: dropped a connection"));
}

TEST_CASE("job secret: read from BOOSTER_JOB_SECRET or a file, which must be a non-empty regular file",
          "[distributed][secret]") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("booster-secret-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  ::unsetenv("BOOSTER_JOB_SECRET");
  ::unsetenv("BOOSTER_JOB_SECRET_FILE");
  CHECK(job_secret_from_environment().empty());
  std::ofstream(dir / "s") << "abc123\n";
  ::setenv("BOOSTER_JOB_SECRET_FILE", (dir / "s").c_str(), 1);
  CHECK(job_secret_from_environment() == "abc123");
  ::setenv("BOOSTER_JOB_SECRET", "direct", 1);
  CHECK(job_secret_from_environment() == "direct");
  ::unsetenv("BOOSTER_JOB_SECRET");
  std::ofstream(dir / "empty") << "\n";
  ::setenv("BOOSTER_JOB_SECRET_FILE", (dir / "empty").c_str(), 1);
  CHECK_THROWS_WITH(job_secret_from_environment(), Catch::Contains("is empty"));
  ::setenv("BOOSTER_JOB_SECRET_FILE", dir.c_str(), 1);
  CHECK_THROWS_AS(job_secret_from_environment(), ConfigError);
  ::unsetenv("BOOSTER_JOB_SECRET_FILE");
  fs::remove_all(dir);
}

TEST_CASE("job secret: without one, a non-loopback MASTER_ADDR warns once and loopback stays quiet",
          "[distributed][secret]") {
  RendezvousSpec spec = secret_spec(29500, "");
  CaptureCerr capture;
  net::warn_without_secret(spec, "tcp group");  // loopback: as before, no warning
  spec.address = "localhost";
  net::warn_without_secret(spec, "tcp group");
  CHECK(capture.text.str().empty());
  spec.secret = "s";
  spec.address = "10.1.2.3";
  net::warn_without_secret(spec, "tcp group");  // a secret: no warning
  CHECK(capture.text.str().empty());
  spec.secret = "";
  net::warn_without_secret(spec, "tcp group");
  net::warn_without_secret(spec, "rendezvous");
  const std::string text = capture.text.str();
  CHECK_THAT(text, Catch::Contains("tcp group: warning: no job secret, and MASTER_ADDR 10.1.2.3"));
  CHECK(text.find("warning") == text.rfind("warning"));  // once
}
