// Socket helpers that the TCP rendezvous (rendezvous.cpp) and the tcp process group
// (tcp_process_group.cpp) share: an owning descriptor, deadline-bounded connect / send / receive, the
// job token, and a listener bound to the address MASTER_ADDR names. Internal: not installed (an -impl
// header).
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <iostream>
#include <mutex>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "booster/common/error.h"
#include "booster/common/sha256.h"
#include "booster/distributed/rendezvous.h"

namespace booster::distributed::net {

using Clock = std::chrono::steady_clock;

inline std::string seconds(std::chrono::duration<double> d) {
  std::ostringstream os;
  os << d.count() << " s";
  return os.str();
}

inline Clock::time_point deadline_after(std::chrono::duration<double> timeout) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout);
}

// The job's token (Note [Rendezvous without MPI], "two jobs"): FNV-1a of its id and world size, and
// whether it has a secret (so that a rank without one meets "another job", not a failed proof). Public:
// anyone computes it; only the secret's challenge-response (Note [Job secret]) keeps strangers out.
inline uint64_t job_token(const RendezvousSpec& spec, int world_size) {
  uint64_t h = 1469598103934665603ull;
  for (const char c : spec.job + "/" + std::to_string(world_size) + (spec.secret.empty() ? "" : "/secret"))
    h = (h ^ uint8_t(c)) * 1099511628211ull;
  return h;
}

inline std::string job_name(const RendezvousSpec& spec, int world_size) {
  return (spec.job.empty() ? std::string("no job id") : "job \"" + spec.job + "\"") + ", world size " +
         std::to_string(world_size);
}

// An owned file descriptor, closed when it goes.
struct Socket {
  int fd = -1;
  explicit Socket(int f = -1) : fd(f) {}
  Socket(Socket&& o) noexcept : fd(o.fd) { o.fd = -1; }
  Socket& operator=(Socket&& o) noexcept {
    if (this != &o) {
      reset();
      fd = o.fd;
      o.fd = -1;
    }
    return *this;
  }
  Socket(const Socket&) = delete;
  ~Socket() { reset(); }
  void reset() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

// Note [TCP process group], "descriptors": a call that cannot get a descriptor (or the memory for a
// socket) fails the bootstrap at once with the cause, rather than being retried at full CPU until a
// timeout that blames the peers.
inline bool out_of_descriptors(int err) { return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM; }

inline void check_descriptors(int err, const std::string& who) {
  BOOSTER_CHECK(!out_of_descriptors(err), DistributedError, who, ": too many open files",
                err == EMFILE ? std::string() : " (" + std::string(std::strerror(err)) + ")",
                ": the tcp group needs about world_size descriptors per group (and per subgroup); raise ulimit -n");
}

// Waits until `fd` is ready for `events` or the deadline passes (false).
inline bool wait_ready(int fd, short events, Clock::time_point deadline) {
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, int(std::min<long long>(left, 1000)));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return false;
  }
}

// Sends or receives all `n` bytes before the deadline; false when the peer went away or time ran out.
// Never SIGPIPE (MSG_NOSIGNAL).
inline bool send_all(int fd, const void* data, size_t n, Clock::time_point deadline) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    if (!wait_ready(fd, POLLOUT, deadline)) return false;
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (k <= 0) return false;
    p += k;
    n -= size_t(k);
  }
  return true;
}

inline bool recv_all(int fd, void* data, size_t n, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    if (!wait_ready(fd, POLLIN, deadline)) return false;
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (k <= 0) return false;
    p += k;
    n -= size_t(k);
  }
  return true;
}

inline bool set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  return flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0;
}

// Accepts connections on `listeners` and reads the fixed-size hello each sends first, without letting
// one that says nothing hold up the others (Note [TCP process group], "bootstrap"): every connection
// accepted and not yet identified waits in the poll set with its own short deadline while accepting
// goes on, at most kMaxPending of them (the oldest is dropped for a new one).
class HelloAcceptor {
 public:
  static constexpr size_t kMaxPending = 64;

  HelloAcceptor(std::vector<int> listeners, size_t hello_bytes, std::string who,
                std::chrono::duration<double> per_connection = std::chrono::seconds(2))
      : listeners_(std::move(listeners)),
        hello_bytes_(hello_bytes),
        who_(std::move(who)),
        per_connection_(std::chrono::duration_cast<Clock::duration>(per_connection)) {
    for (const int fd : listeners_) set_nonblocking(fd);
  }

  // The next connection whose hello came whole (its bytes copied to `hello`), non-blocking; an invalid
  // Socket when the deadline passed first. DistributedError when no descriptor is left.
  Socket next(void* hello, Clock::time_point deadline) {
    while (true) {
      for (auto it = pending_.begin(); it != pending_.end(); ++it)
        if (it->have == hello_bytes_) {
          std::memcpy(hello, it->got.data(), hello_bytes_);
          Socket s = std::move(it->sock);
          pending_.erase(it);
          return s;
        }
      const Clock::time_point now = Clock::now();
      for (auto it = pending_.begin(); it != pending_.end();) it = it->until <= now ? pending_.erase(it) : it + 1;
      if (now >= deadline) return Socket();
      Clock::time_point wake = deadline;
      for (const Pending& p : pending_) wake = std::min(wake, p.until);
      fds_.clear();
      for (const int fd : listeners_) fds_.push_back({fd, POLLIN, 0});
      for (const Pending& p : pending_) fds_.push_back({p.sock.fd, POLLIN, 0});
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(wake - now).count() + 1;
      const int n = ::poll(fds_.data(), fds_.size(), int(std::min<long long>(ms, 1000)));
      if (n <= 0) continue;
      // The hellos first (the indices of fds_ are pending_'s before any accept), then new connections.
      for (size_t i = 0; i < pending_.size(); ++i)
        if (fds_[listeners_.size() + i].revents) read_hello(pending_[i]);
      for (auto it = pending_.begin(); it != pending_.end();) it = it->sock.fd < 0 ? pending_.erase(it) : it + 1;
      if (std::any_of(pending_.begin(), pending_.end(), [&](const Pending& p) { return p.have == hello_bytes_; }))
        continue;  // returned first: a new connection must not push it out
      for (size_t i = 0; i < listeners_.size(); ++i)
        if (fds_[i].revents) accept_all(listeners_[i], now);
    }
  }

 private:
  struct Pending {
    Socket sock;
    std::vector<char> got;
    size_t have = 0;
    Clock::time_point until;
  };

  void read_hello(Pending& p) {
    while (p.have < hello_bytes_) {
      const ssize_t k = ::recv(p.sock.fd, p.got.data() + p.have, hello_bytes_ - p.have, MSG_DONTWAIT);
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (k <= 0) {
        p.sock.reset();  // it went away before it said who it is: dropped
        return;
      }
      p.have += size_t(k);
    }
  }

  void accept_all(int listener, Clock::time_point now) {
    while (true) {
      const int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        check_descriptors(errno, who_);
        return;  // EAGAIN: none left (anything else: the next poll says)
      }
      if (pending_.size() >= kMaxPending) pending_.pop_front();
      pending_.push_back(Pending{Socket(fd), std::vector<char>(hello_bytes_), 0, now + per_connection_});
    }
  }

  const std::vector<int> listeners_;
  const size_t hello_bytes_;
  const std::string who_;
  const Clock::duration per_connection_;
  std::deque<Pending> pending_;
  std::vector<pollfd> fds_;
};

inline void set_nodelay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// Connects `fd` to `address` before the deadline: non-blocking, so that a firewall that drops the
// packets (where a blocking connect waits minutes for the kernel's retries) costs no more than the
// time left. False with `error` set when it is refused or time runs out; `fd` stays non-blocking.
inline bool connect_before(int fd, const sockaddr* address, socklen_t length, Clock::time_point deadline,
                           std::string& error) {
  if (!set_nonblocking(fd)) {
    error = std::strerror(errno);
    return false;
  }
  if (::connect(fd, address, length) == 0) return true;
  if (errno != EINPROGRESS && errno != EINTR) {
    error = std::strerror(errno);
    return false;
  }
  if (!wait_ready(fd, POLLOUT, deadline)) {
    error = "no answer to connect before the timeout (a firewall dropping packets?)";
    return false;
  }
  int so_error = 0;
  socklen_t len = sizeof so_error;
  if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len) != 0) so_error = errno;
  if (so_error != 0) {
    error = std::strerror(so_error);
    return false;
  }
  return true;
}

using AddressList = std::unique_ptr<addrinfo, void (*)(addrinfo*)>;

// The addresses of `host`:`port` (numeric_host: `host` is an address, no name lookup); null with
// `error` set when it does not resolve.
inline AddressList resolve(const std::string& host, int port, bool numeric_host, std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (numeric_host) hints.ai_flags = AI_NUMERICHOST;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const int gai = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found);
  if (gai != 0 || !found) {
    error = ::gai_strerror(gai);
    if (found) ::freeaddrinfo(found);
    return AddressList(nullptr, ::freeaddrinfo);
  }
  return AddressList(found, ::freeaddrinfo);
}

// The numeric host and the port of a socket address.
inline std::string numeric_host(const sockaddr_storage& a) {
  char text[INET6_ADDRSTRLEN] = {};
  if (a.ss_family == AF_INET6) {
    const auto* a6 = reinterpret_cast<const sockaddr_in6*>(&a);
    // An IPv4 peer of a dual-stack socket: its plain IPv4 form.
    if (IN6_IS_ADDR_V4MAPPED(&a6->sin6_addr)) {
      in_addr v4{};
      std::memcpy(&v4, &a6->sin6_addr.s6_addr[12], 4);
      ::inet_ntop(AF_INET, &v4, text, sizeof text);
    } else {
      ::inet_ntop(AF_INET6, &a6->sin6_addr, text, sizeof text);
    }
  } else {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&a)->sin_addr, text, sizeof text);
  }
  return text;
}

inline int port_of(const sockaddr_storage& a) {
  return a.ss_family == AF_INET6 ? ntohs(reinterpret_cast<const sockaddr_in6*>(&a)->sin6_port)
                                 : ntohs(reinterpret_cast<const sockaddr_in*>(&a)->sin_port);
}

// The local (getsockname) or remote (getpeername) address of a connected socket.
inline sockaddr_storage local_address(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  return a;
}

inline sockaddr_storage peer_address(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  ::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len);
  return a;
}

// A listening socket bound to `address` with `port` (0: the kernel picks one), SO_REUSEADDR so that a
// port a finished job left in TIME_WAIT is free at once. -1 with errno set when bind fails.
inline int listen_at(const sockaddr* address, socklen_t length, int backlog) {
  Socket s(::socket(address->sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (s.fd < 0) return -1;
  const int one = 1;
  ::setsockopt(s.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(s.fd, address, length) != 0 || ::listen(s.fd, std::max(backlog, 16)) != 0) return -1;
  const int fd = s.fd;
  s.fd = -1;
  return fd;
}

// Note [TCP process group], "addresses": a loopback address (127.0.0.0/8, ::1) reaches this machine
// only.
inline bool is_loopback(const std::string& host) { return host.rfind("127.", 0) == 0 || host == "::1"; }

// The names rank 0 hands out through a rendezvous file, in the order peers try them: this machine's
// non-loopback addresses first, then its host name (which Debian resolves to 127.0.1.1), loopback
// addresses last; so a peer on rank 0's own machine reaches it, and advertises itself, by an address
// the other machines reach too.
inline std::vector<std::string> file_rendezvous_hosts(const std::string& host_name,
                                                      const std::vector<std::string>& addresses) {
  std::vector<std::string> hosts;
  for (const std::string& a : addresses)
    if (!is_loopback(a)) hosts.push_back(a);
  if (!host_name.empty()) hosts.push_back(host_name);
  for (const std::string& a : addresses)
    if (is_loopback(a)) hosts.push_back(a);
  if (hosts.empty()) hosts.push_back("127.0.0.1");
  return hosts;
}

// Empty when the peers' addresses (hosts[r] for rank r >= 1, as rank 0 saw them) can form a mesh; else
// the reason they cannot: some ranks reached rank 0 over loopback and others over the network, and the
// others cannot reach a loopback address.
inline std::string mixed_loopback_error(const std::vector<std::string>& hosts, const std::string& who) {
  std::vector<size_t> loop, remote;
  for (size_t r = 1; r < hosts.size(); ++r) (is_loopback(hosts[r]) ? loop : remote).push_back(r);
  if (loop.empty() || remote.empty()) return "";
  const auto names = [&](const std::vector<size_t>& ranks) {
    std::string text = ranks.size() == 1 ? "rank " : "ranks ";
    for (size_t k = 0; k < ranks.size(); ++k)
      text += (k ? ", " : "") + std::to_string(ranks[k]) + " (" + hosts[ranks[k]] + ")";
    return text;
  };
  return who + ": " + names(loop) + " reached rank 0 over a loopback address, which " + names(remote) +
         " on other machines cannot reach; set MASTER_ADDR to an address of rank 0's host that the other "
         "machines reach (not localhost, nor a name that resolves to 127.x there)";
}

// Rank 0's listeners at MASTER_ADDR:MASTER_PORT (`spec`, Kind::Tcp): bound to the addresses MASTER_ADDR
// names (every one of them that is this machine's, so that a name resolving to a loopback and a network
// address serves both), not to every interface, so that the port is reachable only where the job said
// (Note [Rendezvous without MPI]). ConfigError when the name does not resolve, names no address of this
// machine ("rank 0 must run on MASTER_ADDR's host"), or the port is in use. `who` starts messages.
inline std::vector<Socket> listen_at_master(const RendezvousSpec& spec, int backlog, const std::string& who) {
  std::string error;
  const AddressList found = resolve(spec.address, spec.port, false, error);
  BOOSTER_CHECK(found, ConfigError, who, ": MASTER_ADDR \"", spec.address, "\" cannot be resolved (", error,
                "); set it to rank 0's host name or address");
  std::vector<Socket> listeners;
  std::vector<std::string> bound;
  int last = 0;
  for (const addrinfo* a = found.get(); a; a = a->ai_next) {
    const std::string key(reinterpret_cast<const char*>(a->ai_addr), a->ai_addrlen);
    if (std::find(bound.begin(), bound.end(), key) != bound.end()) continue;  // listed twice
    const int fd = listen_at(a->ai_addr, a->ai_addrlen, backlog);
    if (fd >= 0) {
      listeners.emplace_back(fd);
      bound.push_back(key);
      continue;
    }
    check_descriptors(errno, who);
    if (errno == EADDRNOTAVAIL) {  // not this machine's: the others may be
      if (last == 0) last = errno;
      continue;
    }
    last = errno;
    listeners.clear();
    break;
  }
  if (!listeners.empty()) return listeners;
  BOOSTER_CHECK(last != EADDRNOTAVAIL, ConfigError, who, ": MASTER_ADDR \"", spec.address, "\" (", spec.source,
                ") is not an address of this machine, so rank 0 cannot listen there; rank 0 must run on "
                "MASTER_ADDR's host (or set MASTER_ADDR to this host's name or address)");
  BOOSTER_FAIL(ConfigError, who, ": rank 0 cannot listen on port ", spec.port, " (", spec.source, "): ",
               std::strerror(last),
               last == EADDRINUSE ? "; another program (or job) uses it: choose another MASTER_PORT"
                                  : "; choose another MASTER_PORT");
}

// Note [Job secret]
// With a secret (RendezvousSpec::secret), a connection is used only after both ends proved they know it,
// without sending it: after the fixed-size hello, the acceptor sends a fresh random nonce nA; the
// connector answers with its own nonce nC and HMAC-SHA256(secret, "C" | hello | nA | nC); the acceptor
// checks it (in constant time) and answers 'Y' and HMAC(secret, "A" | hello | nA | nC), or 'N'. The hello
// (magic, token, rank, world size, port) is inside both MACs, so a proof made for one rank, world size or
// direction fits no other, and a captured answer fits no later nonce (a replay fails). A connection that
// fails is dropped and logged and the acceptor goes on waiting for the real peer until its timeout; a
// connector told 'N' fails at once (another job's rank 0 on this port, or ranks given different
// secrets). The acceptor gives one connection at most kProofWait to answer, so a stranger that stalls
// delays the job by that much per try, no more. Without a secret the hello is checked by its token only,
// as before; a job listening on a non-loopback address without one warns once (warn_without_secret).
constexpr size_t kNonceBytes = 32;
constexpr auto kProofWait = std::chrono::seconds(2);

inline void random_nonce(uint8_t* out) {
  size_t done = 0;
  while (done < kNonceBytes) {
    const ssize_t n = ::getrandom(out + done, kNonceBytes - done, 0);
    if (n < 0 && errno == EINTR) continue;
    BOOSTER_CHECK(n > 0, DistributedError, "tcp group: no random bytes for the job secret's nonce (getrandom: ",
                  std::strerror(errno), ")");
    done += size_t(n);
  }
}

inline common::Sha256Digest secret_proof(const std::string& secret, char direction, const void* hello,
                                         size_t hello_bytes, const uint8_t* nonce_a, const uint8_t* nonce_c) {
  std::string message = "booster job secret ";
  message += direction;
  message.append(static_cast<const char*>(hello), hello_bytes);
  message.append(reinterpret_cast<const char*>(nonce_a), kNonceBytes);
  message.append(reinterpret_cast<const char*>(nonce_c), kNonceBytes);
  return common::hmac_sha256(secret, message);
}

// The acceptor's half, on a connection whose `hello` was read: true when the peer proved it knows
// `secret`. Never throws for the peer's behaviour.
inline bool check_peer_secret(int fd, const std::string& secret, const void* hello, size_t hello_bytes,
                              Clock::time_point deadline) {
  deadline = std::min(deadline, Clock::now() + std::chrono::duration_cast<Clock::duration>(kProofWait));
  uint8_t nonce_a[kNonceBytes], answer[kNonceBytes + 32];
  random_nonce(nonce_a);
  if (!send_all(fd, nonce_a, sizeof nonce_a, deadline) || !recv_all(fd, answer, sizeof answer, deadline))
    return false;
  common::Sha256Digest got{};
  std::memcpy(got.data(), answer + kNonceBytes, got.size());
  const bool ok =
      common::digests_equal(got, secret_proof(secret, 'C', hello, hello_bytes, nonce_a, answer));
  char reply[1 + 32] = {ok ? 'Y' : 'N'};
  if (ok) {
    const common::Sha256Digest mine = secret_proof(secret, 'A', hello, hello_bytes, nonce_a, answer);
    std::memcpy(reply + 1, mine.data(), mine.size());
  }
  return send_all(fd, reply, sizeof reply, deadline) && ok;
}

// The connector's half, after it sent `hello`: kProved, kRefused (the acceptor said 'N'), kImpostor (it
// answered 'Y' without the proof), or kLost (the connection ended or time ran out).
enum class SecretResult { kProved, kRefused, kImpostor, kLost };
inline SecretResult prove_secret(int fd, const std::string& secret, const void* hello, size_t hello_bytes,
                                 Clock::time_point deadline) {
  uint8_t nonce_a[kNonceBytes], answer[kNonceBytes + 32];
  if (!recv_all(fd, nonce_a, sizeof nonce_a, deadline)) return SecretResult::kLost;
  random_nonce(answer);
  const common::Sha256Digest mine = secret_proof(secret, 'C', hello, hello_bytes, nonce_a, answer);
  std::memcpy(answer + kNonceBytes, mine.data(), mine.size());
  char reply[1 + 32];
  if (!send_all(fd, answer, sizeof answer, deadline) || !recv_all(fd, reply, sizeof reply, deadline))
    return SecretResult::kLost;
  if (reply[0] != 'Y') return SecretResult::kRefused;
  common::Sha256Digest got{};
  std::memcpy(got.data(), reply + 1, got.size());
  return common::digests_equal(got, secret_proof(secret, 'A', hello, hello_bytes, nonce_a, answer))
             ? SecretResult::kProved
             : SecretResult::kImpostor;
}

// Logs a connection dropped for failing the proof (Note [Job secret]); the job goes on.
inline void log_dropped(int fd, const std::string& who, int claimed_rank, int claimed_world) {
  std::cerr << who + ": dropped a connection from " + numeric_host(peer_address(fd)) + " that says it is rank " +
                   std::to_string(claimed_rank) + " of " + std::to_string(claimed_world) +
                   ": it did not prove it knows this job's secret (BOOSTER_JOB_SECRET); waiting on for the "
                   "job's own ranks\n";
}

// Once per process: a job on a non-loopback MASTER_ADDR without a secret lets anyone who reaches the
// port join it (Note [Job secret]).
inline void warn_without_secret(const RendezvousSpec& spec, const std::string& who) {
  if (!spec.secret.empty() || spec.kind != RendezvousSpec::Kind::Tcp) return;
  if (is_loopback(spec.address) || spec.address == "localhost") return;
  static std::once_flag once;
  std::call_once(once, [&] {
    std::cerr << who + ": warning: no job secret, and MASTER_ADDR " + spec.address +
                     " is reachable from other machines: anyone who reaches port " + std::to_string(spec.port) +
                     " can join this job; start it with booster run, or set BOOSTER_JOB_SECRET (or "
                     "BOOSTER_JOB_SECRET_FILE) to the same random value on every rank\n";
  });
}

}  // namespace booster::distributed::net
