// Note [TCP process group] in this folder's README.md: the bootstrap through rank 0, the full mesh of
// sockets, the worker thread whose one poll loop moves every frame, the ring collectives, timeouts and
// peers that go away.
#include "booster/distributed/tcp_process_group.h"

#include <ifaddrs.h>
#include <sys/eventfd.h>
#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <list>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include "booster/common/error.h"
#include "booster/distributed/collective_timeout_impl.h"
#include "booster/distributed/flight_recorder_impl.h"
#include "booster/distributed/reduce_impl.h"
#include "booster/distributed/socket_impl.h"

namespace booster::distributed {

namespace {

using detail::Clock;
using detail::Collective;
using detail::collective_name;
using detail::CollectiveOp;
using detail::divide_by;
using detail::reduce_into;
using detail::rank_names;
using detail::Seconds;
using net::Socket;

// ---------------------------------------------------------------------------------------- wire

constexpr char kHelloMagic[8] = {'B', 'O', 'O', 'S', 'T', 'T', 'C', 'P'};  // a peer's hello to rank 0
constexpr char kMeshMagic[8] = {'B', 'O', 'O', 'S', 'T', 'T', 'C', 'M'};   // a mesh link's hello
constexpr char kTableMagic[8] = {'B', 'O', 'O', 'S', 'T', 'T', 'C', 'T'};  // rank 0's table
constexpr char kOtherJob[8] = {'B', 'O', 'O', 'S', 'T', 'T', 'C', 'J'};    // rank 0's answer to another job
constexpr char kChallenge[8] = {'B', 'O', 'O', 'S', 'T', 'T', 'C', 'N'};  // a nonce follows (Note [Job secret])

// What a rank says first on a new connection: to rank 0 (with the port of its own listener), or on a
// mesh link.
struct Hello {
  char magic[8];
  uint64_t token;
  int32_t rank;
  int32_t world_size;
  int32_t port;
  int32_t unused;
};

// Every message on a link is a frame: this header, then `bytes` bytes.
enum Channel : uint32_t { kCollective = 0, kPointToPoint = 1 };
struct FrameHeader {
  uint32_t channel;
  uint32_t tag;  // collectives: the collective's sequence number (low 32 bits); point-to-point: the tag
  uint64_t bytes;
};
static_assert(sizeof(FrameHeader) == 16);

// Collective data moves in frames of at most this many bytes, so a rank reduces one frame while the
// next arrives.
constexpr size_t kSegmentBytes = size_t(1) << 20;
// A link is read for at most this many bytes before the poll loop turns to the others.
constexpr size_t kReadBudget = size_t(8) << 20;

struct Endpoint {
  std::string host;
  int port = 0;
};

std::string where(const Endpoint& e) {
  return e.host.find(':') != std::string::npos ? "[" + e.host + "]:" + std::to_string(e.port)
                                               : e.host + ":" + std::to_string(e.port);
}

// ---------------------------------------------------------------------------------------- bootstrap

// The connector's half of Note [Job secret] on `fd`, after `hello` went: reads the challenge and proves
// the secret. False when the connection ended (try again); DistributedError when the other end refused
// the proof or could not prove the secret itself.
bool prove_to_acceptor(int fd, const Hello& hello, const std::string& secret, const std::string& at,
                       Clock::time_point deadline, const std::string& who) {
  char head[8];
  if (!net::recv_all(fd, head, sizeof head, deadline)) return false;
  if (std::memcmp(head, kChallenge, sizeof kChallenge) != 0) return false;
  const net::SecretResult r = net::prove_secret(fd, secret, &hello, sizeof hello, deadline);
  BOOSTER_CHECK(r != net::SecretResult::kRefused, DistributedError, who, ": rank ", hello.rank, " was refused by ",
                at, ": the process there has another job secret (another job on this port, or the ranks were "
                "given different BOOSTER_JOB_SECRET values); start every rank with the same secret");
  BOOSTER_CHECK(r != net::SecretResult::kImpostor, DistributedError, who, ": the process at ", at,
                " that rank ", hello.rank, " reached did not prove it knows this job's secret; it is not one of "
                "this job's ranks");
  return r == net::SecretResult::kProved;
}

// The acceptor's half of Note [Job secret] on `peer`, whose `hello` was read: true when it proved the
// secret (or there is none); else it is logged, and the caller drops it.
bool accept_proof(const Socket& peer, const Hello& hello, const std::string& secret, Clock::time_point deadline,
                  const std::string& who) {
  if (secret.empty()) return true;
  const bool ok = net::send_all(peer.fd, kChallenge, sizeof kChallenge, deadline) &&
                  net::check_peer_secret(peer.fd, secret, &hello, sizeof hello, deadline);
  if (!ok) net::log_dropped(peer.fd, who, hello.rank, hello.world_size);
  return ok;
}

// Connects to `to` (any of its addresses), retrying until the deadline; sends `hello`. An invalid
// socket with `error` set when time ran out.
Socket connect_with_hello(const Endpoint& to, const Hello& hello, const std::string& secret, Clock::time_point deadline,
                          std::string& error, const std::string& who) {
  while (Clock::now() < deadline) {
    const net::AddressList found = net::resolve(to.host, to.port, false, error);
    for (const addrinfo* a = found.get(); a; a = a->ai_next) {
      Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
      if (s.fd < 0) net::check_descriptors(errno, who);
      if (s.fd < 0) continue;
      if (!net::connect_before(s.fd, a->ai_addr, a->ai_addrlen, deadline, error)) continue;
      net::set_nodelay(s.fd);
      if (!net::send_all(s.fd, &hello, sizeof hello, deadline)) {
        error = "the connection ended before the hello went";
        continue;
      }
      if (!secret.empty() && !prove_to_acceptor(s.fd, hello, secret, where(to), deadline, who)) {
        error = "the connection ended during the job secret's challenge";
        continue;
      }
      return s;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // it may not listen yet
  }
  if (error.empty()) error = "no answer";
  return Socket();
}

// A listener on `host` (a numeric address of this machine), a port the kernel picks.
Socket listen_on_host(const std::string& host, int backlog, const std::string& who) {
  std::string error;
  const net::AddressList found = net::resolve(host, 0, true, error);
  BOOSTER_CHECK(found, DistributedError, who, ": cannot use this rank's address ", host, " (", error, ")");
  const int fd = net::listen_at(found->ai_addr, found->ai_addrlen, backlog);
  if (fd < 0) net::check_descriptors(errno, who);
  BOOSTER_CHECK(fd >= 0, DistributedError, who, ": cannot listen on ", host, " (", std::strerror(errno), ")");
  return Socket(fd);
}

// Rank 0's listener for a file rendezvous: every interface, a port the kernel picks; and the names
// the others may reach it by (net::file_rendezvous_hosts: its non-loopback IPv4 addresses first, then
// this host's name, loopback last).
Socket listen_for_file_rendezvous(int backlog, std::vector<std::string>& hosts) {
  Socket s(::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (s.fd < 0) net::check_descriptors(errno, "tcp group");
  if (s.fd >= 0) {
    const int zero = 0;
    ::setsockopt(s.fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);  // IPv4 peers too
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    if (::bind(s.fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) s.reset();
  }
  if (s.fd < 0) {
    s = Socket(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    BOOSTER_CHECK(s.fd >= 0 && ::bind(s.fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0, DistributedError,
                  "tcp group: rank 0 cannot listen (", std::strerror(errno), ")");
  }
  BOOSTER_CHECK(::listen(s.fd, std::max(backlog, 16)) == 0, DistributedError, "tcp group: listen: ",
                std::strerror(errno));
  char name[256] = {};
  const bool named = ::gethostname(name, sizeof name - 1) == 0 && name[0];
  std::vector<std::string> addresses;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) == 0) {
    for (ifaddrs* i = list; i; i = i->ifa_next) {
      if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
      sockaddr_storage st{};
      std::memcpy(&st, i->ifa_addr, sizeof(sockaddr_in));
      addresses.push_back(net::numeric_host(st));
    }
    ::freeifaddrs(list);
  }
  hosts = net::file_rendezvous_hosts(named ? name : "", addresses);
  return s;
}

// The ranks of [first, end) not in `have`: "ranks 2, 3".
std::string missing(const std::vector<bool>& have, int first, int end) {
  std::vector<int> out;
  for (int r = first; r < end; ++r)
    if (!have[size_t(r)]) out.push_back(r);
  return rank_names(out, {});
}

// The full mesh among `size` ranks (Note [TCP process group], "mesh"): this rank connects to every
// lower rank from `first_lower` on and accepts every higher rank on `listener`; links[j] ends as the
// link to rank j. Each link's hello carries `token`, so a stray connection is dropped.
void build_mesh(int rank, int size, const std::vector<Endpoint>& ends, Socket& listener, int first_lower,
                uint64_t token, const std::string& secret, Clock::time_point deadline, Seconds timeout,
                std::vector<Socket>& links, const std::string& who) {
  Hello hello{};
  std::memcpy(hello.magic, kMeshMagic, sizeof kMeshMagic);
  hello.token = token;
  hello.rank = rank;
  hello.world_size = size;
  for (int j = first_lower; j < rank; ++j) {
    std::string error;
    links[size_t(j)] = connect_with_hello(ends[size_t(j)], hello, secret, deadline, error, who);
    BOOSTER_CHECK(links[size_t(j)].fd >= 0, DistributedError, who, ": rank ", rank, " could not connect to rank ",
                  j, " at ", where(ends[size_t(j)]), " within ", net::seconds(timeout), " (last: ", error,
                  "); is rank ", j, " running, and can this host reach it?");
  }
  std::vector<bool> have(size_t(size), false);
  int waiting = size - 1 - rank;
  net::HelloAcceptor acceptor({listener.fd}, sizeof(Hello), who);
  while (waiting > 0) {
    Hello got{};
    Socket peer = acceptor.next(&got, deadline);
    BOOSTER_CHECK(peer.fd >= 0, DistributedError, who, ": rank ", rank, " waited ", net::seconds(timeout), " for ",
                  missing(have, rank + 1, size), " of ", size, " to connect to it; are they running?");
    if (std::memcmp(got.magic, kMeshMagic, sizeof kMeshMagic) != 0 || got.token != token ||
        got.world_size != size || got.rank <= rank || got.rank >= size || have[size_t(got.rank)])
      continue;  // not one of this group's links: dropped
    if (!accept_proof(peer, got, secret, deadline, who)) continue;
    net::set_nodelay(peer.fd);
    have[size_t(got.rank)] = true;
    links[size_t(got.rank)] = std::move(peer);
    --waiting;
  }
}

// FNV-1a of a subgroup's identity (its parent's token, the split's number and the color), so that two
// splits running at once never take each other's links.
uint64_t mix(uint64_t h, uint64_t v) {
  for (int k = 0; k < 8; ++k) h = (h ^ ((v >> (8 * k)) & 0xff)) * 1099511628211ull;
  return h;
}

// ---------------------------------------------------------------------------------------- engine

// One send or receive of a frame: posted on a link, moved by the worker's poll loop.
struct Request {
  bool send = false;
  int peer = -1;
  uint32_t channel = kCollective;
  uint32_t tag = 0;
  char* data = nullptr;
  size_t bytes = 0;
  size_t progress = 0;  // sends: bytes of header and body written
  bool done = false;
  std::string error;  // set when it failed (done stays false)
  const std::string* label = nullptr;  // its operation, for messages: "all_reduce #7"
};

// A frame that arrived before its receive was posted (or is arriving).
struct Unexpected {
  uint32_t channel = 0, tag = 0;
  std::vector<char> data;
  bool complete = false;
  Request* claimed = nullptr;  // a receive posted while it was still arriving
  bool discard = false;        // its receive had another size: dropped when complete
};

struct Link {
  Socket sock;
  int peer = -1;
  bool lost = false;
  std::string lost_why;  // "closed its connection", "connection reset by peer"
  std::deque<Request*> sends;
  std::deque<Request*> posted;  // receives, in posted order
  std::list<Unexpected> unexpected;  // in arrival order
  // The frame being read.
  FrameHeader header{};
  size_t header_got = 0;
  bool in_body = false;
  size_t body_got = 0;
  char* body = nullptr;
  Request* target = nullptr;
  Unexpected* holding = nullptr;  // the unexpected (or discarded) frame being read
  bool draining = false;          // the frame's receive had another size: read into `discard`, dropped
  std::vector<char> discard;      // kDrainBytes, reused for every byte of a dropped frame
  bool broken_stream = false;     // lost for a frame it could not have sent (lost_why says which)
};

// A frame whose receive had another size is read through a buffer of this many bytes and dropped.
constexpr size_t kDrainBytes = size_t(64) << 10;

// One send or receive of a point-to-point batch (ProcessGroup::P2PSpan, which is the group's own).
struct P2PItem {
  bool send = true;
  BufferSpan buf;
  int peer = 0;
  int tag = 0;
};

// A queued operation and its completion, shared by the group's queue and its Work.
struct Op {
  Collective what;
  std::string label;  // "all_reduce #7", "a point-to-point batch"
  std::function<void(Op&)> run;  // collectives: the body, run by the worker
  bool p2p = false;
  std::vector<P2PItem> p2p_ops;
  std::vector<Request> requests;               // point-to-point: one per op
  // Completion.
  std::mutex mutex;
  std::condition_variable cv;
  bool finished = false;
  std::exception_ptr error;

  void finish(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (finished) return;
      error = std::move(e);
      finished = true;
    }
    cv.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [&] { return finished; });
    if (error) std::rethrow_exception(error);
  }
  bool is_finished() {
    std::lock_guard<std::mutex> lock(mutex);
    return finished;
  }
};

class TcpWork final : public Work {
 public:
  explicit TcpWork(std::shared_ptr<Op> op) : op_(std::move(op)) {}
  // As the mpi backend's: a dropped Work waits, and reports a failure it cannot throw.
  ~TcpWork() override {
    try {
      op_->wait();
    } catch (const std::exception& e) {
      if (!waited_)
        std::fprintf(stderr, "booster: %s dropped without wait() and failed: %s\n", op_->label.c_str(), e.what());
    }
  }
  void wait() override {
    waited_ = true;
    op_->wait();
  }
  bool is_completed() override { return op_->is_finished(); }

 private:
  std::shared_ptr<Op> op_;
  bool waited_ = false;
};

// The sockets, the queue and the worker of one group (Note [TCP process group], "progress").
class TcpComm {
 public:
  TcpComm(std::string name, int rank, int size, std::vector<int> world_of, int world_size, uint64_t token,
          std::vector<Socket> links, std::string host)
      : name_(std::move(name)),
        rank_(rank),
        size_(size),
        world_of_(std::move(world_of)),
        world_size_(world_size),
        token_(token),
        host_(std::move(host)) {
    links_.resize(size_t(size));
    for (int j = 0; j < size; ++j) {
      Link& l = links_[size_t(j)];
      l.peer = j;
      if (j == rank) continue;
      l.sock = std::move(links[size_t(j)]);
      net::set_nonblocking(l.sock.fd);
      net::set_nodelay(l.sock.fd);
    }
    wake_ = Socket(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (wake_.fd < 0) net::check_descriptors(errno, "tcp group \"" + name_ + "\"");
    BOOSTER_CHECK(wake_.fd >= 0, DistributedError, "tcp group: eventfd: ", std::strerror(errno));
    if (world_of_.empty()) detail::flight_set_world_rank(rank_);
    flight_group_ = detail::flight_register_group("tcp", name_, size_, rank_, world_of_);
    worker_ = std::thread([this] { worker_main(); });
  }

  ~TcpComm() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake();
    worker_.join();
  }

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  int world_size() const { return world_size_; }
  uint64_t token() const { return token_; }
  // The job's secret (Note [Job secret]), which a split's mesh proves too.
  const std::string& secret() const { return secret_; }
  void set_secret(std::string secret) { secret_ = std::move(secret); }
  const std::string& host() const { return host_; }
  int world_rank_of(int r) const { return world_of_.empty() ? r : world_of_[size_t(r)]; }
  uint64_t next_split() { return ++splits_; }

  // Queues a collective (numbered now, so the queue's order is the numbering on every rank) or a
  // point-to-point batch (a queue of its own, posted at the worker's next turn even while a collective
  // runs: Note [TCP process group], "progress"); DistributedError when the group is broken.
  std::shared_ptr<Op> submit(CollectiveOp kind, Seconds timeout, size_t bytes, const DType* dtype, int peer,
                             std::function<void(Op&)> run, std::vector<P2PItem> p2p = {}) {
    auto op = std::make_shared<Op>();
    op->run = std::move(run);
    op->p2p = kind == CollectiveOp::SendRecv;
    op->p2p_ops = std::move(p2p);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      BOOSTER_CHECK(!stopping_, DistributedError, collective_name(kind), ": group \"", name_, "\" is being destroyed");
      BOOSTER_CHECK(broken_.empty(), DistributedError, collective_name(kind), ": group \"", name_,
                    "\" is unusable since ", broken_);
      op->what = Collective{kind, op->p2p ? 0 : ++started_, Clock::now(), timeout, bytes};
      op->what.peer = peer;
      op->label = op->p2p ? "a point-to-point batch" : str(collective_name(kind), " #", op->what.seq);
      op->what.flight = detail::flight_start(flight_group_, op->what, dtype);
      (op->p2p ? p2p_queue_ : queue_).push_back(op);
    }
    wake();
    return op;
  }

  // ------------------------------------------------------------------ what the collectives call
  // (on the worker thread only)

  // Posts a send or receive of `bytes` at `data` for the running operation `op`.
  Request& post(Op& op, bool send, int peer, uint32_t channel, uint32_t tag, void* data, size_t bytes) {
    active_.push_back(Request{});
    Request& r = active_.back();
    fill(r, op, send, peer, channel, tag, data, bytes);
    start(r);
    return r;
  }

  // Runs the poll loop until `r` is done; DistributedError (and the group broken) when it or any other
  // request of the operation failed, at the deadline, or when the group is destroyed.
  void wait(Op& op, const Request& r) {
    while (!r.done) progress_once(op);
  }
  void wait_all(Op& op) {
    for (const Request& r : active_)
      while (!r.done) progress_once(op);
    active_.clear();
  }

  // Scratch reused from collective to collective (Note [TCP process group], "memory").
  char* scratch(size_t bytes) {
    if (scratch_.size() < bytes) scratch_.resize(bytes);
    return scratch_.data();
  }

 private:
  void wake() {
    const uint64_t one = 1;
    (void)!::write(wake_.fd, &one, sizeof one);
  }

  static void fill(Request& r, Op& op, bool send, int peer, uint32_t channel, uint32_t tag, void* data,
                   size_t bytes) {
    r.send = send;
    r.peer = peer;
    r.channel = channel;
    r.tag = tag;
    r.data = static_cast<char*>(data);
    r.bytes = bytes;
    r.label = &op.label;
  }

  std::string peer_lost(const Link& l, const std::string& label, bool before) const {
    return str(rank_names({l.peer}, world_of_), " of group \"", name_, "\" ", l.lost_why,
               before ? " before " : " during ",
               label, l.broken_stream ? "" : " (it exited or was killed)");
  }

  // Hands a posted request to its link: a send is queued (and written at once as far as the socket
  // takes it); a receive takes the first unexpected frame of its channel and tag, else waits for one.
  void start(Request& r) {
    Link& l = links_[size_t(r.peer)];
    if (r.send) {
      if (l.lost) {
        r.error = peer_lost(l, *r.label, true);
        return;
      }
      l.sends.push_back(&r);
      write_link(l);
      return;
    }
    // A receive may still take a frame that arrived before its peer closed the link (a peer that
    // finished the job's last collective and left).
    for (auto it = l.unexpected.begin(); it != l.unexpected.end(); ++it) {
      Unexpected& u = *it;
      if (u.channel != r.channel || u.tag != r.tag || u.claimed || u.discard) continue;
      if (u.data.size() != r.bytes) {
        r.error = size_mismatch(r, u.data.size());
        if (u.complete) {
          recycle(std::move(u.data));
          l.unexpected.erase(it);
        } else {
          u.discard = true;
        }
        return;
      }
      if (!u.complete) {
        u.claimed = &r;
        return;
      }
      if (r.bytes) std::memcpy(r.data, u.data.data(), r.bytes);
      r.done = true;
      recycle(std::move(u.data));
      l.unexpected.erase(it);
      return;
    }
    if (l.lost) {
      r.error = peer_lost(l, *r.label, true);
      return;
    }
    l.posted.push_back(&r);
  }

  std::string size_mismatch(const Request& r, size_t got) const {
    if (r.channel == kPointToPoint)
      return str("recv: rank ", rank_, " of group \"", name_, "\" expected ", r.bytes, " bytes from rank ", r.peer,
                 " (tag ", r.tag, ") but got ", got, "; the sender's tensor must have the receiver's size and dtype");
    return str(*r.label, " on group \"", name_, "\": ", rank_names({r.peer}, world_of_), " sent ", got,
               " bytes where rank ", rank_, " expected ", r.bytes,
               "; every rank must call it with the same sizes and dtypes");
  }

  // Buffers of unexpected frames are reused, up to kPoolBytes in all: the collectives' segments (1 MiB
  // at most) stay pooled; a large early point-to-point frame's buffer is freed once it is taken.
  static constexpr size_t kPoolBytes = size_t(16) << 20;
  std::vector<char> take_buffer(size_t bytes) {
    std::vector<char> b;
    if (!pool_.empty()) {
      b = std::move(pool_.back());
      pool_.pop_back();
      pool_bytes_ -= b.capacity();
    }
    b.resize(bytes);
    return b;
  }
  void recycle(std::vector<char>&& b) {
    if (pool_bytes_ + b.capacity() > kPoolBytes) return;
    pool_bytes_ += b.capacity();
    pool_.push_back(std::move(b));
  }

  // ------------------------------------------------------------------ the poll loop

  // Note [TCP process group], "failures": `why` (else the errno's words) says how the link ended.
  void lose(Link& l, int err, const std::string& why = "") {
    if (l.lost) return;
    l.lost = true;
    l.broken_stream = !why.empty();
    l.lost_why = !why.empty() ? why
                 : err == 0  ? "closed its connection"
                             : str("lost its connection (", std::strerror(err), ")");
    l.sock.reset();
    for (Request* r : l.sends) r->error = peer_lost(l, *r->label, false);
    for (Request* r : l.posted) r->error = peer_lost(l, *r->label, false);
    if (l.target) l.target->error = peer_lost(l, *l.target->label, false);
    for (Unexpected& u : l.unexpected)
      if (u.claimed && !u.complete) u.claimed->error = peer_lost(l, *u.claimed->label, false);
    l.sends.clear();
    l.posted.clear();
    l.target = nullptr;
    l.unexpected.remove_if([](const Unexpected& u) { return !u.complete; });
    l.holding = nullptr;
    l.draining = false;
    l.in_body = false;
    l.header_got = 0;
  }

  void write_link(Link& l) {
    while (!l.sends.empty() && !l.lost) {
      Request* r = l.sends.front();
      const FrameHeader h{r->channel, r->tag, uint64_t(r->bytes)};
      iovec iov[2];
      int count = 0;
      if (r->progress < sizeof h)
        iov[count++] = {const_cast<char*>(reinterpret_cast<const char*>(&h)) + r->progress, sizeof h - r->progress};
      const size_t body = r->progress > sizeof h ? r->progress - sizeof h : 0;
      if (r->bytes > body) iov[count++] = {r->data + body, r->bytes - body};
      msghdr m{};
      m.msg_iov = iov;
      m.msg_iovlen = size_t(count);
      const ssize_t k = ::sendmsg(l.sock.fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        lose(l, errno == EPIPE ? 0 : errno);
        return;
      }
      r->progress += size_t(k);
      if (r->progress == sizeof h + r->bytes) {
        r->done = true;
        l.sends.pop_front();
      }
    }
  }

  // The frame whose header just arrived: into its posted receive, else into an unexpected buffer.
  // False (the link lost) when the header cannot be one of this group's frames.
  bool start_body(Link& l) {
    const FrameHeader& h = l.header;
    // Note [TCP process group], "frames": a header's length is checked before anything is sized by it.
    if (h.channel > kPointToPoint || (h.channel == kCollective && h.bytes > kSegmentBytes)) {
      lose(l, EPROTO,
           h.channel > kPointToPoint
               ? str("sent a frame of unknown channel ", h.channel, ": the stream is out of step, its link was dropped")
               : str("sent a collective frame of ", h.bytes, " bytes (at most ", kSegmentBytes,
                     "): the stream is out of step, its link was dropped"));
      return false;
    }
    l.in_body = true;
    l.body_got = 0;
    l.target = nullptr;
    l.holding = nullptr;
    l.draining = false;
    for (auto it = l.posted.begin(); it != l.posted.end(); ++it) {
      Request* r = *it;
      if (r->channel != h.channel || r->tag != h.tag) continue;
      l.posted.erase(it);
      if (r->bytes == h.bytes) {
        l.target = r;
        l.body = r->data;
      } else {
        r->error = size_mismatch(*r, size_t(h.bytes));
        if (l.discard.size() < kDrainBytes) l.discard.resize(kDrainBytes);
        l.draining = true;
        l.body = l.discard.data();
      }
      return true;
    }
    std::vector<char> buffer;
    try {
      buffer = take_buffer(size_t(h.bytes));
    } catch (const std::exception& e) {  // bad_alloc, length_error: a length no buffer can hold
      l.in_body = false;
      lose(l, ENOMEM, str("sent a point-to-point frame of ", h.bytes, " bytes that this rank cannot buffer (",
                          e.what(), "); its link was dropped"));
      return false;
    }
    l.unexpected.push_back(Unexpected{h.channel, h.tag, std::move(buffer)});
    l.holding = &l.unexpected.back();
    l.body = l.holding->data.data();
    return true;
  }

  void finish_body(Link& l) {
    l.in_body = false;
    l.draining = false;
    l.header_got = 0;
    if (l.target) {
      l.target->done = true;
      l.target = nullptr;
    } else if (l.holding) {
      Unexpected* u = l.holding;
      l.holding = nullptr;
      u->complete = true;
      if (u->claimed || u->discard) {
        if (u->claimed) {
          if (!u->data.empty()) std::memcpy(u->claimed->data, u->data.data(), u->data.size());
          u->claimed->done = true;
        }
        recycle(std::move(u->data));
        l.unexpected.remove_if([u](const Unexpected& x) { return &x == u; });
      }
    }
  }

  void read_link(Link& l) {
    size_t budget = kReadBudget;
    while (!l.lost && budget > 0) {
      char* into;
      size_t want;
      if (!l.in_body) {
        into = reinterpret_cast<char*>(&l.header) + l.header_got;
        want = sizeof l.header - l.header_got;
      } else if (l.draining) {
        into = l.discard.data();
        want = std::min({size_t(l.header.bytes) - l.body_got, budget, l.discard.size()});
      } else {
        into = l.body + l.body_got;
        want = std::min<size_t>(size_t(l.header.bytes) - l.body_got, budget);
      }
      const ssize_t k = ::recv(l.sock.fd, into, want, MSG_DONTWAIT);
      if (k == 0) return lose(l, 0);
      if (k < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        return lose(l, errno == ECONNRESET ? 0 : errno);
      }
      budget -= std::min(budget, size_t(k));
      if (!l.in_body) {
        l.header_got += size_t(k);
        if (l.header_got < sizeof l.header) continue;
        if (!start_body(l)) return;
        if (l.header.bytes == 0) finish_body(l);
      } else {
        l.body_got += size_t(k);
        if (l.body_got == l.header.bytes) finish_body(l);
      }
    }
  }

  // One round of the poll loop: waits at most `timeout_ms` for a socket (or a wake-up), then writes
  // and reads every link that is ready.
  void pump(int timeout_ms) {
    fds_.clear();
    fds_.push_back({wake_.fd, POLLIN, 0});
    for (Link& l : links_) {
      if (l.peer == rank_ || l.lost) continue;
      fds_.push_back({l.sock.fd, short(POLLIN | (l.sends.empty() ? 0 : POLLOUT)), 0});
    }
    const int n = ::poll(fds_.data(), fds_.size(), timeout_ms);
    if (n <= 0) return;
    if (fds_[0].revents) {
      uint64_t v;
      (void)!::read(wake_.fd, &v, sizeof v);
    }
    size_t k = 1;
    for (Link& l : links_) {
      if (l.peer == rank_ || l.lost) continue;
      const short ev = fds_[k++].revents;
      if (!ev) continue;
      if (ev & (POLLOUT | POLLERR | POLLHUP)) write_link(l);
      if (ev & (POLLIN | POLLERR | POLLHUP)) read_link(l);
    }
  }

  // One turn of a running collective's wait: failures, the deadline, destruction, then the poll loop.
  void progress_once(Op& op) {
    for (const Request& r : active_)
      if (!r.error.empty()) fail(op, r.error);
    if (!broken_flag_.empty()) fail(op, broken_flag_, /*already=*/true);
    const Clock::time_point now = Clock::now();
    const Clock::time_point deadline = op.what.deadline();
    if (now >= deadline) time_out(op, now);
    if (stopping()) fail(op, str("group \"", name_, "\" was destroyed during ", op.label));
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count() + 1;
    pump(int(std::min<long long>(left, 100)));
    start_queued_p2p();
    service_p2p();
  }

  bool stopping() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stopping_;
  }

  // Breaks the group with `why` (the first failure is kept) and throws for `op`.
  [[noreturn]] void fail(Op& op, const std::string& why, bool already = false) {
    if (!already) break_group(why);
    if (already) BOOSTER_FAIL(DistributedError, op.label, " on group \"", name_, "\": the group is unusable since ",
                              broken_flag_);
    BOOSTER_FAIL(DistributedError, why);
  }

  // Note [TCP process group], "failures": after a timeout or a lost peer nothing more moves; every
  // request is forgotten (their buffers are the callers'), every waiting batch fails.
  void break_group(const std::string& why) {
    if (broken_flag_.empty()) {
      broken_flag_ = why;
      std::lock_guard<std::mutex> lock(mutex_);
      broken_ = why;
    }
    for (Link& l : links_) {
      l.sends.clear();
      l.posted.clear();
      l.target = nullptr;
      for (Unexpected& u : l.unexpected) u.claimed = nullptr;
      if (l.peer != rank_ && !l.lost) {
        l.lost = true;  // stop reading and writing; the socket closes with the group
        l.lost_why = "was cut off after an earlier failure";
      }
    }
    for (const std::shared_ptr<Op>& p : pending_)
      p->finish(std::make_exception_ptr(DistributedError(
          str("send/recv on group \"", name_, "\": the group is unusable since ", why))));
    pending_.clear();
  }

  [[noreturn]] void time_out(Op& op, Clock::time_point now) {
    std::vector<int> silent, not_taking;
    for (const Request& r : active_) {
      if (r.done) continue;
      if (r.send) not_taking.push_back(r.peer);
      else silent.push_back(r.peer);
    }
    auto unique = [](std::vector<int>& v) {
      std::sort(v.begin(), v.end());
      v.erase(std::unique(v.begin(), v.end()), v.end());
    };
    unique(silent);
    unique(not_taking);
    std::string who;
    if (op.p2p) {
      who = str(rank_names({op.what.peer}, world_of_),
                " (or another peer of the batch) did not post the matching send or receive");
    } else if (!silent.empty()) {
      const bool ring = op.what.op != CollectiveOp::Barrier && size_ > 2;
      who = str(rank_names(silent, world_of_), silent.size() == 1 ? " sent" : " sent", " nothing for its step",
                ring ? " (a ring waits for the rank before it, which waits for the one before that: the rank that "
                       "never arrived may be further back)"
                     : "");
    } else if (!not_taking.empty()) {
      who = str(rank_names(not_taking, world_of_), " did not take what this rank sent");
    } else {
      who = "it waited in this rank's queue behind an operation that did not finish in time";
    }
    detail::flight_dump_on_timeout(op.what, name_);
    const std::string message =
        detail::timeout_message(op.what, name_, size_, rank_, world_of_, now - op.what.start, who);
    break_group(str(op.label, " timed out on rank ", rank_));
    BOOSTER_FAIL(DistributedError, message);
  }

  // ------------------------------------------------------------------ point-to-point batches

  // Posts every batch queued since the last turn, in the order they were queued: batches carry no
  // number, so none waits behind a collective (as on mpi, whose batches are posted at the call).
  void start_queued_p2p() {
    std::deque<std::shared_ptr<Op>> batches;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      batches.swap(p2p_queue_);
    }
    for (const std::shared_ptr<Op>& op : batches) {
      if (!broken_flag_.empty()) {
        op->finish(std::make_exception_ptr(DistributedError(
            str(op->label, " on group \"", name_, "\": the group is unusable since ", broken_flag_))));
        continue;
      }
      start_p2p(op);
    }
  }

  void start_p2p(const std::shared_ptr<Op>& op) {
    op->requests.resize(op->p2p_ops.size());
    for (size_t i = 0; i < op->p2p_ops.size(); ++i) {
      const P2PItem& s = op->p2p_ops[i];
      fill(op->requests[i], *op, s.send, s.peer, kPointToPoint, uint32_t(s.tag), s.buf.data, s.buf.nbytes());
    }
    for (Request& r : op->requests) start(r);
    pending_.push_back(op);
    service_p2p();
  }

  // Finishes every batch whose requests are done, fails those with a failed request or past their
  // deadline.
  void service_p2p() {
    const Clock::time_point now = Clock::now();
    for (size_t i = 0; i < pending_.size();) {
      Op& op = *pending_[i];
      bool all_done = true, lost = false;
      std::string mismatch;
      for (const Request& r : op.requests) {
        if (!r.error.empty()) {
          // A size mismatch consumed the whole frame: the group goes on. A lost peer breaks it.
          if (r.error.rfind("recv: ", 0) == 0) {
            if (mismatch.empty()) mismatch = r.error;
          } else {
            lost = true;
            mismatch = r.error;
          }
        }
        if (!r.done) all_done = false;
      }
      if (lost) {
        std::shared_ptr<Op> keep = pending_[i];
        pending_.erase(pending_.begin() + long(i));
        break_group(mismatch);
        keep->finish(std::make_exception_ptr(DistributedError(mismatch)));
        return;  // break_group cleared the rest
      }
      if (!mismatch.empty() && complete_except_failed(op)) {
        forget(op);
        op.finish(std::make_exception_ptr(DistributedError(mismatch)));
        pending_.erase(pending_.begin() + long(i));
        continue;
      }
      if (all_done) {
        detail::flight_end(op.what.flight, detail::FlightState::Completed);
        op.finish(nullptr);
        pending_.erase(pending_.begin() + long(i));
        continue;
      }
      if (now >= op.what.deadline()) {
        std::shared_ptr<Op> keep = pending_[i];
        pending_.erase(pending_.begin() + long(i));
        detail::flight_dump_on_timeout(keep->what, name_);
        const std::string who = str(rank_names({keep->what.peer}, world_of_),
                                    " (or another peer of the batch) did not post the matching send or receive");
        const std::string message =
            detail::timeout_message(keep->what, name_, size_, rank_, world_of_, now - keep->what.start, who);
        break_group(str("a point-to-point batch timed out on rank ", rank_));
        keep->finish(std::make_exception_ptr(DistributedError(message)));
        return;
      }
      ++i;
    }
  }

  static bool complete_except_failed(const Op& op) {
    for (const Request& r : op.requests)
      if (!r.done && r.error.empty()) return false;
    return true;
  }

  // Removes a finished batch's requests from every link (none should be left; for safety).
  void forget(const Op& op) {
    for (Link& l : links_) {
      for (const Request& r : op.requests) {
        l.posted.erase(std::remove(l.posted.begin(), l.posted.end(), &r), l.posted.end());
        for (Unexpected& u : l.unexpected)
          if (u.claimed == &r) {
            u.claimed = nullptr;
            u.discard = true;
          }
      }
    }
  }

  // Nearest deadline of a waiting batch, as a poll timeout (ms, at most 1 s).
  int idle_timeout() const {
    long long ms = 1000;
    const Clock::time_point now = Clock::now();
    for (const std::shared_ptr<Op>& op : pending_)
      ms = std::min<long long>(
          ms, std::chrono::duration_cast<std::chrono::milliseconds>(op->what.deadline() - now).count() + 1);
    return int(std::max<long long>(ms, 0));
  }

  // ------------------------------------------------------------------ the worker

  void worker_main() {
    while (true) {
      std::shared_ptr<Op> op;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (stopping_) break;
        if (!queue_.empty()) {
          op = std::move(queue_.front());
          queue_.pop_front();
        }
      }
      start_queued_p2p();
      if (!op) {
        // Idle: frames still move (batches in flight, early frames of the next collective). Nothing
        // here may end the worker: whatever escapes breaks the group, and the next operation says so.
        try {
          pump(idle_timeout());
          start_queued_p2p();
          service_p2p();
        } catch (const std::exception& e) {
          break_group(str("group \"", name_, "\" failed while idle on rank ", rank_, ": ", e.what()));
        }
        continue;
      }
      if (!broken_flag_.empty()) {
        op->finish(std::make_exception_ptr(DistributedError(
            str(op->label, " on group \"", name_, "\": the group is unusable since ", broken_flag_))));
        continue;
      }
      std::exception_ptr error;
      try {
        op->run(*op);
        wait_all(*op);
        detail::flight_end(op->what.flight, detail::FlightState::Completed);
      } catch (...) {
        error = std::current_exception();
        // Whatever failed, the op's requests point into its buffers: nothing may move them any more.
        if (broken_flag_.empty()) {
          std::string why = "an operation failed";
          try {
            throw;
          } catch (const std::exception& e) {
            why = e.what();
          } catch (...) {
          }
          break_group(why);
        }
      }
      active_.clear();
      op->finish(error);
    }
    // Destroyed: what is queued or waiting fails.
    const std::string why = str("group \"", name_, "\" was destroyed");
    if (broken_flag_.empty()) break_group(why);
    for (const std::shared_ptr<Op>& p : pending_)
      p->finish(std::make_exception_ptr(DistributedError(str(p->label, ": ", why, " before it finished"))));
    pending_.clear();
    std::deque<std::shared_ptr<Op>> left;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      left.swap(queue_);
      left.insert(left.end(), p2p_queue_.begin(), p2p_queue_.end());
      p2p_queue_.clear();
    }
    for (const std::shared_ptr<Op>& p : left)
      p->finish(std::make_exception_ptr(DistributedError(str(p->label, ": ", why, " before it ran"))));
  }

  const std::string name_;
  const int rank_, size_;
  const std::vector<int> world_of_;  // world rank of each rank; empty: the world itself
  const int world_size_;
  const uint64_t token_;
  std::string secret_;
  const std::string host_;  // this rank's address on its links: a subgroup's listener binds it
  int flight_group_ = -1;
  std::atomic<uint64_t> splits_{0};

  // Shared with callers.
  std::mutex mutex_;
  bool stopping_ = false;
  std::deque<std::shared_ptr<Op>> queue_;      // collectives, in their numbers' order
  std::deque<std::shared_ptr<Op>> p2p_queue_;  // point-to-point batches not yet posted
  uint64_t started_ = 0;
  std::string broken_;  // the first failure, for submit
  Socket wake_;

  // The worker's alone.
  std::thread worker_;
  std::vector<Link> links_;
  std::deque<Request> active_;  // the running collective's requests (a deque: stable addresses)
  std::vector<std::shared_ptr<Op>> pending_;  // point-to-point batches in flight
  std::vector<pollfd> fds_;
  std::vector<char> scratch_;
  std::vector<std::vector<char>> pool_;
  size_t pool_bytes_ = 0;  // capacity held by pool_
  std::string broken_flag_;  // the first failure, for the worker
};

// ---------------------------------------------------------------------------------------- collectives

// Element offsets of the ring's chunks: chunk c is [bound(c), bound(c + 1)), sizes differing by at most
// one (some empty when numel < size).
int64_t bound(int64_t numel, int size, int c) { return int64_t((__int128(numel) * c) / size); }

// One step of a ring: sends `send_count` elements at `send` to the next rank and receives
// `recv_count` into `recv` from the previous one, in frames of kSegmentBytes; calls `on_segment(first,
// count)` as each received frame lands (so a reduction overlaps the next frame's arrival).
template <class OnSegment>
void ring_step(TcpComm& c, Op& op, const char* send, int64_t send_count, char* recv, int64_t recv_count,
               size_t item, OnSegment on_segment) {
  const int n = c.size(), r = c.rank();
  const int next = (r + 1) % n, prev = (r - 1 + n) % n;
  const uint32_t tag = uint32_t(op.what.seq);
  const int64_t per = std::max<int64_t>(1, int64_t(kSegmentBytes / item));
  std::vector<Request*> received;  // small: one pointer per frame
  for (int64_t first = 0; first < recv_count || (first == 0 && recv_count == 0); first += per) {
    const int64_t count = std::min(per, recv_count - first);
    received.push_back(&c.post(op, false, prev, kCollective, tag, recv + first * int64_t(item), size_t(count) * item));
    if (recv_count == 0) break;
  }
  for (int64_t first = 0; first < send_count || (first == 0 && send_count == 0); first += per) {
    const int64_t count = std::min(per, send_count - first);
    c.post(op, true, next, kCollective, tag, const_cast<char*>(send) + first * int64_t(item), size_t(count) * item);
    if (send_count == 0) break;
  }
  int64_t first = 0;
  for (Request* q : received) {
    c.wait(op, *q);
    const int64_t count = int64_t(q->bytes / item);
    if (count) on_segment(first, count);
    first += count;
  }
  c.wait_all(op);
}

void ring_all_reduce(TcpComm& c, Op& op, const BufferSpan& buf, ReduceOp rop) {
  const int n = c.size(), r = c.rank();
  if (rop == ReduceOp::Avg) {
    // Note [Averages divide first]: the buffer is ours to overwrite.
    if (n > 1) divide_by(buf.data, buf.numel, buf.dtype, n);
    rop = ReduceOp::Sum;
  }
  if (n == 1 || buf.numel == 0) return;
  const size_t item = itemsize(buf.dtype);
  char* base = static_cast<char*>(buf.data);
  auto at = [&](int chunk) { return base + bound(buf.numel, n, chunk) * int64_t(item); };
  auto count = [&](int chunk) { return bound(buf.numel, n, chunk + 1) - bound(buf.numel, n, chunk); };
  char* scratch = c.scratch(size_t(buf.numel / n + 1) * item);
  // Reduce-scatter: after n - 1 steps rank r holds chunk r + 1 summed over every rank.
  for (int s = 0; s < n - 1; ++s) {
    const int send_c = (r - s + n) % n, recv_c = (r - s - 1 + n) % n;
    char* dst = at(recv_c);
    ring_step(c, op, at(send_c), count(send_c), scratch, count(recv_c), item, [&](int64_t first, int64_t k) {
      reduce_into(dst + first * int64_t(item), scratch + first * int64_t(item), k, buf.dtype, rop,
                  "all_reduce");
    });
  }
  // All-gather: each finished chunk travels round the ring, so every rank ends with the same bytes.
  for (int s = 0; s < n - 1; ++s) {
    const int send_c = (r + 1 - s + n) % n, recv_c = (r - s + n) % n;
    ring_step(c, op, at(send_c), count(send_c), at(recv_c), count(recv_c), item, [](int64_t, int64_t) {});
  }
}

void ring_all_gather(TcpComm& c, Op& op, const BufferSpan& out, const BufferSpan& in) {
  const int n = c.size(), r = c.rank();
  const size_t item = itemsize(in.dtype);
  const size_t slice = size_t(in.nbytes());
  char* base = static_cast<char*>(out.data);
  if (in.data != base + size_t(r) * slice && slice) std::memmove(base + size_t(r) * slice, in.data, slice);
  for (int s = 0; s < n - 1; ++s) {
    const int send_c = (r - s + n) % n, recv_c = (r - s - 1 + n) % n;
    ring_step(c, op, base + size_t(send_c) * slice, in.numel, base + size_t(recv_c) * slice, in.numel, item,
              [](int64_t, int64_t) {});
  }
}

// Slice r of `in` reduced over ranks into `out`; `in` unchanged. Two scratch buffers alternate as the
// partial sums that travel round the ring.
void ring_reduce_scatter(TcpComm& c, Op& op, const BufferSpan& out, const BufferSpan& in, ReduceOp rop) {
  const int n = c.size(), r = c.rank();
  const size_t item = itemsize(in.dtype);
  const int64_t m = out.numel;
  const size_t slice = size_t(m) * item;
  const char* src = static_cast<const char*>(in.data);
  const ReduceOp sum_op = rop == ReduceOp::Avg ? ReduceOp::Sum : rop;
  if (n == 1) {
    if (out.data != in.data && slice) std::memmove(out.data, in.data, slice);
  } else {
    char* scratch = c.scratch(2 * slice + 1);
    const char* sending = src + size_t((r - 1 + n) % n) * slice;
    for (int s = 0; s < n - 1; ++s) {
      const int recv_c = (r - s - 2 + 2 * n) % n;
      const bool last = s == n - 2;
      char* into = last ? static_cast<char*>(out.data) : scratch + size_t(s % 2) * slice;
      const char* mine = src + size_t(recv_c) * slice;
      ring_step(c, op, sending, m, into, m, item, [&](int64_t first, int64_t k) {
        reduce_into(into + first * int64_t(item), mine + first * int64_t(item), k, in.dtype, sum_op,
                    "reduce_scatter");
      });
      sending = into;
    }
  }
  if (rop == ReduceOp::Avg && n > 1) divide_by(out.data, m, out.dtype, n);
}

// A chain from the root (pipelined in frames): each rank receives from the one before it and passes
// every frame on as it lands.
void chain_broadcast(TcpComm& c, Op& op, const BufferSpan& buf, int root) {
  const int n = c.size(), r = c.rank();
  if (n == 1 || buf.numel == 0) return;
  const int pos = (r - root + n) % n;
  const int prev = (r - 1 + n) % n, next = (r + 1) % n;
  const uint32_t tag = uint32_t(op.what.seq);
  char* base = static_cast<char*>(buf.data);
  const size_t total = buf.nbytes();
  std::vector<Request*> received;
  if (pos > 0)
    for (size_t first = 0; first < total; first += kSegmentBytes)
      received.push_back(
          &c.post(op, false, prev, kCollective, tag, base + first, std::min(kSegmentBytes, total - first)));
  size_t k = 0;
  for (size_t first = 0; first < total; first += kSegmentBytes, ++k) {
    if (pos > 0) c.wait(op, *received[k]);
    if (pos < n - 1) c.post(op, true, next, kCollective, tag, base + first, std::min(kSegmentBytes, total - first));
  }
  c.wait_all(op);
}

// Dissemination: in round k each rank tells the rank 2^k after it and hears from the one 2^k before.
void dissemination_barrier(TcpComm& c, Op& op) {
  const int n = c.size(), r = c.rank();
  const uint32_t tag = uint32_t(op.what.seq);
  for (int d = 1; d < n; d *= 2) {
    c.post(op, false, (r - d + n) % n, kCollective, tag, nullptr, 0);
    c.post(op, true, (r + d) % n, kCollective, tag, nullptr, 0);
    c.wait_all(op);
  }
}

// ---------------------------------------------------------------------------------------- group

class TcpProcessGroup final : public ProcessGroup {
 public:
  explicit TcpProcessGroup(std::unique_ptr<TcpComm> comm) : comm_(std::move(comm)) {}

  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  std::string backend() const override { return "tcp"; }
  Device device() const override { return Device::cpu(); }

  void barrier() override {
    comm_->submit(CollectiveOp::Barrier, timeout(), 0, nullptr, -1, [c = comm_.get()](Op& op) {
      dissemination_barrier(*c, op);
    })->wait();
  }

  [[noreturn]] void abort(int exit_code, const std::string& why) override {
    std::fprintf(stderr, "booster: rank %d of %d: %s\n", rank(), size(), why.c_str());
    std::fflush(stderr);
    std::_Exit(exit_code == 0 ? 1 : exit_code);
  }

  std::shared_ptr<ProcessGroup> split(int color, int key, const std::string& name) override;

 protected:
  WorkPtr all_reduce_impl(const BufferSpan& buf, ReduceOp op, bool async) override {
    check_cpu(buf, "all_reduce");
    if (buf.numel == 0) return completed_work();
    return finish(async, comm_->submit(CollectiveOp::AllReduce, timeout(), buf.nbytes(), &buf.dtype, -1,
                                       [c = comm_.get(), buf, op](Op& o) { ring_all_reduce(*c, o, buf, op); }));
  }
  WorkPtr broadcast_impl(const BufferSpan& buf, int root, bool async) override {
    check_cpu(buf, "broadcast");
    if (buf.numel == 0) return completed_work();
    return finish(async, comm_->submit(CollectiveOp::Broadcast, timeout(), buf.nbytes(), &buf.dtype, -1,
                                       [c = comm_.get(), buf, root](Op& o) { chain_broadcast(*c, o, buf, root); }));
  }
  WorkPtr all_gather_impl(const BufferSpan& out, const BufferSpan& in, bool async) override {
    check_cpu(in, "all_gather");
    if (in.numel == 0) return completed_work();
    return finish(async, comm_->submit(CollectiveOp::AllGather, timeout(), out.nbytes(), &in.dtype, -1,
                                       [c = comm_.get(), out, in](Op& o) { ring_all_gather(*c, o, out, in); }));
  }
  WorkPtr reduce_scatter_impl(const BufferSpan& out, const BufferSpan& in, ReduceOp op, bool async) override {
    check_cpu(in, "reduce_scatter");
    if (out.numel == 0) return completed_work();
    return finish(async, comm_->submit(CollectiveOp::ReduceScatter, timeout(), in.nbytes(), &in.dtype, -1,
                                       [c = comm_.get(), out, in, op](Op& o) {
                                         ring_reduce_scatter(*c, o, out, in, op);
                                       }));
  }
  // Note [Averages divide first]: `in` is scratch, so Avg divides it and sums.
  WorkPtr reduce_scatter_consuming_impl(const BufferSpan& out, const BufferSpan& in, ReduceOp op) override {
    if (op != ReduceOp::Avg || size() == 1 || out.numel == 0) return reduce_scatter_impl(out, in, op, false);
    check_cpu(in, "reduce_scatter_consuming");
    return finish(false, comm_->submit(CollectiveOp::ReduceScatter, timeout(), in.nbytes(), &in.dtype, -1,
                                       [c = comm_.get(), out, in](Op& o) {
                                         divide_by(in.data, in.numel, in.dtype, c->size());
                                         ring_reduce_scatter(*c, o, out, in, ReduceOp::Sum);
                                       }));
  }
  // Note [Point-to-point]: every op of the batch is posted by the worker at its next turn, even in the
  // middle of a collective, and it goes on; the batch's Work completes when all are done.
  WorkPtr send_recv_impl(const std::vector<P2PSpan>& ops) override {
    size_t bytes = 0;
    for (const P2PSpan& op : ops) {
      check_cpu(op.buf, op.send ? "send" : "recv");
      bytes += op.buf.nbytes();
    }
    std::vector<P2PItem> items;
    items.reserve(ops.size());
    for (const P2PSpan& op : ops) items.push_back({op.send, op.buf, op.peer, op.tag});
    const DType dtype = ops.front().buf.dtype;
    return std::make_shared<TcpWork>(
        comm_->submit(CollectiveOp::SendRecv, timeout(), bytes, &dtype, ops.front().peer, nullptr, std::move(items)));
  }

 private:
  static void check_cpu(const BufferSpan& buf, const char* op) {
    BOOSTER_CHECK(buf.device.is_cpu(), DeviceError, op, ": the tcp backend takes CPU buffers, got ", buf.device,
                  "; CUDA tensors need the nccl backend");
  }

  static WorkPtr finish(bool async, std::shared_ptr<Op> op) {
    if (async) return std::make_shared<TcpWork>(std::move(op));
    op->wait();
    return nullptr;
  }

  std::unique_ptr<TcpComm> comm_;
};

// What each rank tells the others in a split (all-gathered over the parent).
struct SplitRecord {
  int32_t color = -1;
  int32_t key = 0;
  int32_t world_rank = 0;
  int32_t port = 0;
  char host[64] = {};
};

std::shared_ptr<ProcessGroup> TcpProcessGroup::split(int color, int key, const std::string& name) {
  const int n = size(), r = rank();
  const Seconds limit = timeout();
  const auto deadline = net::deadline_after(limit);
  const std::string who = str("split of group \"", comm_->name(), "\" into \"", name, "\"");
  const uint64_t number = comm_->next_split();
  // A listener for this member's links in the new group, on the address its links here use.
  Socket listener;
  SplitRecord mine;
  mine.color = color < 0 ? -1 : color;
  mine.key = key < 0 ? r : key;
  mine.world_rank = comm_->world_rank_of(r);
  if (color >= 0 && n > 1) {
    listener = listen_on_host(comm_->host(), n, who);
    mine.port = net::port_of(net::local_address(listener.fd));
    std::snprintf(mine.host, sizeof mine.host, "%s", comm_->host().c_str());
  }
  std::vector<SplitRecord> all(static_cast<size_t>(n));
  static_assert(sizeof(SplitRecord) % 4 == 0);
  constexpr int64_t kWords = sizeof(SplitRecord) / 4;
  all_gather_impl(BufferSpan{all.data(), n * kWords, DType::Int32, Device::cpu()},
                  BufferSpan{&mine, kWords, DType::Int32, Device::cpu()}, false);
  if (color < 0) return nullptr;
  std::vector<int> members;  // parent ranks, in the new group's order: by key, ties by parent rank
  for (int p = 0; p < n; ++p)
    if (all[size_t(p)].color == color) members.push_back(p);
  std::stable_sort(members.begin(), members.end(),
                   [&](int a, int b) { return all[size_t(a)].key < all[size_t(b)].key; });
  const int sub_size = int(members.size());
  const int sub_rank = int(std::find(members.begin(), members.end(), r) - members.begin());
  std::vector<Endpoint> ends(static_cast<size_t>(sub_size));
  std::vector<int> world_of(static_cast<size_t>(sub_size));
  for (int i = 0; i < sub_size; ++i) {
    const SplitRecord& rec = all[size_t(members[size_t(i)])];
    ends[size_t(i)] = {std::string(rec.host, strnlen(rec.host, sizeof rec.host)), rec.port};
    world_of[size_t(i)] = rec.world_rank;
  }
  bool whole_world = sub_size == comm_->world_size();
  for (int i = 0; i < sub_size && whole_world; ++i) whole_world = world_of[size_t(i)] == i;
  if (whole_world) world_of.clear();
  const uint64_t token = mix(mix(comm_->token(), number), uint64_t(uint32_t(color)));
  std::vector<Socket> links(static_cast<size_t>(sub_size));
  build_mesh(sub_rank, sub_size, ends, listener, 0, token, comm_->secret(), deadline, limit, links, who);
  auto sub = std::make_unique<TcpComm>(name, sub_rank, sub_size, std::move(world_of), comm_->world_size(), token,
                                       std::move(links), comm_->host());
  sub->set_secret(comm_->secret());
  return std::make_shared<TcpProcessGroup>(std::move(sub));
}

}  // namespace

// ---------------------------------------------------------------------------------------- bootstrap

std::shared_ptr<ProcessGroup> make_tcp_process_group(int rank, int world_size, const RendezvousSpec& spec,
                                                     std::chrono::duration<double> connect_timeout) {
  BOOSTER_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, ValueError, "make_tcp_process_group: rank ", rank,
                " of ", world_size, " is out of range");
  BOOSTER_CHECK(connect_timeout.count() > 0, ValueError, "make_tcp_process_group: the timeout is ",
                connect_timeout.count(), " s; expected a positive number of seconds");
  if (spec.kind == RendezvousSpec::Kind::Tcp)
    BOOSTER_CHECK(spec.port >= 1 && spec.port <= 65535, ConfigError, "tcp group: port ", spec.port, " (", spec.source,
                  ") is not from 1 to 65535");
  const auto deadline = net::deadline_after(connect_timeout);
  const uint64_t token = net::job_token(spec, world_size);
  const std::string who = "tcp group";
  std::vector<Socket> links(static_cast<size_t>(world_size));
  std::vector<Endpoint> ends(static_cast<size_t>(world_size));
  std::string host = "127.0.0.1";
  if (world_size == 1)
    return std::make_shared<TcpProcessGroup>(
        std::make_unique<TcpComm>("world", 0, 1, std::vector<int>{}, 1, token, std::move(links), host));

  if (rank == 0) {
    net::warn_without_secret(spec, who);
    std::vector<Socket> listeners;
    if (spec.kind == RendezvousSpec::Kind::Tcp) {
      listeners = net::listen_at_master(spec, world_size, who);
    } else {
      // The port travels through the file: "port host host ...".
      std::vector<std::string> hosts;
      listeners.push_back(listen_for_file_rendezvous(world_size, hosts));
      std::string text = std::to_string(net::port_of(net::local_address(listeners[0].fd)));
      for (const std::string& h : hosts) text += " " + h;
      share_from_rank0(spec, 0, world_size, std::vector<uint8_t>(text.begin(), text.end()),
                       std::max(Seconds(0.001), Seconds(deadline - Clock::now())));
    }
    std::vector<bool> have(size_t(world_size), false);
    have[0] = true;
    int waiting = world_size - 1;
    // A connection that says nothing (a port scan) is dropped after a short wait, without holding up the
    // others; one that is not a peer's is dropped.
    std::vector<int> listener_fds;
    for (const Socket& l : listeners) listener_fds.push_back(l.fd);
    net::HelloAcceptor acceptor(listener_fds, sizeof(Hello), who);
    while (waiting > 0) {
      Hello hello{};
      Socket peer = acceptor.next(&hello, deadline);
      BOOSTER_CHECK(peer.fd >= 0, DistributedError, who, ": rank 0 waited ", net::seconds(connect_timeout), " for ",
                    missing(have, 1, world_size), " of ", world_size, " to connect (",
                    spec.kind == RendezvousSpec::Kind::Tcp ? where({spec.address, spec.port}) + ", " : std::string(),
                    spec.source, "); are they running, with the same ", spec.source, "?");
      if (std::memcmp(hello.magic, kHelloMagic, sizeof kHelloMagic) != 0) continue;
      // Only a hello whose token is this job's for the world size it claims comes from this job (which
      // then must agree on the world size): another job's peer (Note [Rendezvous without MPI], "two
      // jobs") or a stray with the public magic is told "another job", and rank 0 goes on waiting.
      if (hello.token != net::job_token(spec, hello.world_size)) {
        (void)net::send_all(peer.fd, kOtherJob, sizeof kOtherJob,
                            std::min(deadline, Clock::now() + std::chrono::seconds(1)));
        continue;
      }
      // With a secret, only a peer that proves it counts (Note [Job secret]): a stranger claiming another
      // world size or a taken rank is dropped here, before the checks below could end the job.
      if (!accept_proof(peer, hello, spec.secret, deadline, who)) continue;
      BOOSTER_CHECK(hello.world_size == world_size, ConfigError, who, ": rank ", hello.rank, " was started with a ",
                    "world size of ", hello.world_size, " and rank 0 with ", world_size,
                    "; every rank needs the same WORLD_SIZE");
      BOOSTER_CHECK(hello.rank >= 1 && hello.rank < world_size, ConfigError, who, ": a process says it is rank ",
                    hello.rank, " of ", world_size, ", out of range; every rank needs its own RANK from 0 to ",
                    world_size - 1);
      BOOSTER_CHECK(!have[size_t(hello.rank)], ConfigError, who, ": two processes say they are rank ", hello.rank,
                    " of ", world_size, "; every rank needs its own RANK");
      net::set_nodelay(peer.fd);
      ends[size_t(hello.rank)] = {net::numeric_host(net::peer_address(peer.fd)), hello.port};
      have[size_t(hello.rank)] = true;
      links[size_t(hello.rank)] = std::move(peer);
      --waiting;
    }
    listeners.clear();  // the port is free again for whatever the job starts next
    std::vector<std::string> peer_hosts;
    for (const Endpoint& e : ends) peer_hosts.push_back(e.host);
    const std::string mixed = net::mixed_loopback_error(peer_hosts, who);
    BOOSTER_CHECK(mixed.empty(), ConfigError, mixed);
    host = net::numeric_host(net::local_address(links[1].fd));
    // The table: every rank's address, so that the others can connect to each other.
    std::string table(kTableMagic, sizeof kTableMagic);
    for (int r = 0; r < world_size; ++r) {
      const Endpoint& e = ends[size_t(r)];
      table += char(e.port & 0xff);
      table += char((e.port >> 8) & 0xff);
      table += char(e.host.size());
      table += e.host;
    }
    for (int r = 1; r < world_size; ++r)
      BOOSTER_CHECK(net::send_all(links[size_t(r)].fd, table.data(), table.size(), deadline), DistributedError, who,
                    ": rank ", r, " closed its connection while rank 0 sent it the table of ranks");
  } else {
    std::vector<Endpoint> zero;  // where rank 0 may be
    if (spec.kind == RendezvousSpec::Kind::Tcp) {
      zero.push_back({spec.address, spec.port});
    } else {
      const std::vector<uint8_t> blob =
          share_from_rank0(spec, rank, world_size, {}, std::max(Seconds(0.001), Seconds(deadline - Clock::now())));
      std::istringstream in(std::string(blob.begin(), blob.end()));
      int port = 0;
      in >> port;
      for (std::string h; in >> h;) zero.push_back({h, port});
    }
    Hello hello{};
    std::memcpy(hello.magic, kHelloMagic, sizeof kHelloMagic);
    hello.token = token;
    hello.rank = rank;
    hello.world_size = world_size;
    Socket to_zero;
    Socket listener;
    std::string error = "no answer";
    while (to_zero.fd < 0 && Clock::now() < deadline) {
      for (const Endpoint& e : zero) {
        // The connection first (to learn this host's address on it), then the listener, then the hello.
        std::string resolve_error;
        const net::AddressList found = net::resolve(e.host, e.port, false, resolve_error);
        BOOSTER_CHECK(found || spec.kind != RendezvousSpec::Kind::Tcp, ConfigError, who, ": MASTER_ADDR \"",
                      spec.address, "\" cannot be resolved (", resolve_error,
                      "); set it to rank 0's host name or address");
        // Non-loopback addresses first (Note [TCP process group], "addresses"): this rank advertises the
        // address it reached rank 0 from, and the other machines must reach it there.
        std::vector<const addrinfo*> order;
        for (const addrinfo* a = found.get(); a; a = a->ai_next) order.push_back(a);
        std::stable_partition(order.begin(), order.end(), [](const addrinfo* a) {
          sockaddr_storage st{};
          std::memcpy(&st, a->ai_addr, std::min<size_t>(a->ai_addrlen, sizeof st));
          return !net::is_loopback(net::numeric_host(st));
        });
        for (const addrinfo* a : order) {
          if (to_zero.fd >= 0) break;
          Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
          if (s.fd < 0) net::check_descriptors(errno, who);
          if (s.fd < 0 || !net::connect_before(s.fd, a->ai_addr, a->ai_addrlen, deadline, error)) continue;
          net::set_nodelay(s.fd);
          host = net::numeric_host(net::local_address(s.fd));
          listener = listen_on_host(host, world_size, who);
          hello.port = net::port_of(net::local_address(listener.fd));
          char answer[8] = {};
          if (!net::send_all(s.fd, &hello, sizeof hello, deadline)) {
            error = "the connection ended before the hello went";
            continue;
          }
          // Rank 0 answers with the table once every rank is there, or at once when this is another
          // job's rank 0.
          bool answered = net::recv_all(s.fd, answer, sizeof answer, deadline);
          BOOSTER_CHECK(!answered || std::memcmp(answer, kOtherJob, sizeof kOtherJob) != 0, DistributedError, who,
                        ": rank ", rank, " reached a rank 0 at ", where(e), " of another job, not this one (",
                        net::job_name(spec, world_size), "); give each job a MASTER_PORT of its own");
          if (answered && !spec.secret.empty() && std::memcmp(answer, kChallenge, sizeof kChallenge) == 0) {
            const net::SecretResult proof = net::prove_secret(s.fd, spec.secret, &hello, sizeof hello, deadline);
            BOOSTER_CHECK(proof != net::SecretResult::kRefused, DistributedError, who, ": rank ", rank,
                          " was refused by the rank 0 at ", where(e), ": it has another job secret (another job on ",
                          "this port, or the ranks were given different BOOSTER_JOB_SECRET values); give each job ",
                          "a MASTER_PORT of its own and every rank the same secret");
            BOOSTER_CHECK(proof != net::SecretResult::kImpostor, DistributedError, who, ": the process at ",
                          where(e), " that rank ", rank, " reached as rank 0 did not prove it knows this job's ",
                          "secret; it is not this job's rank 0");
            answered = proof == net::SecretResult::kProved && net::recv_all(s.fd, answer, sizeof answer, deadline);
          }
          BOOSTER_CHECK(answered && std::memcmp(answer, kTableMagic, sizeof kTableMagic) == 0, DistributedError, who,
                        ": rank ", rank, " connected to rank 0 at ", where(e), " (", spec.source,
                        ") but rank 0 closed the connection before every rank was there",
                        answered ? " (an answer that is not booster's tcp group)" : "",
                        "; see rank 0's error (or it timed out waiting for others)");
          for (int r = 0; r < world_size; ++r) {
            uint8_t head[3];
            BOOSTER_CHECK(net::recv_all(s.fd, head, 3, deadline), DistributedError, who, ": rank ", rank,
                          " lost its connection to rank 0 while it received the table of ranks");
            std::string h(head[2], '\0');
            BOOSTER_CHECK(net::recv_all(s.fd, h.data(), h.size(), deadline), DistributedError, who, ": rank ", rank,
                          " lost its connection to rank 0 while it received the table of ranks");
            ends[size_t(r)] = {h, int(head[0]) | (int(head[1]) << 8)};
          }
          to_zero = std::move(s);
        }
        if (to_zero.fd >= 0) break;
      }
      if (to_zero.fd < 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));  // rank 0 may not listen yet
    }
    BOOSTER_CHECK(to_zero.fd >= 0, DistributedError, who, ": rank ", rank, " waited ", net::seconds(connect_timeout),
                  " for rank 0 at ", zero.empty() ? std::string("?") : where(zero.front()), " (", spec.source,
                  ", last: ", error, "); is rank 0 running, and ", spec.source, " the same on every rank?");
    links[0] = std::move(to_zero);
    build_mesh(rank, world_size, ends, listener, 1, token, spec.secret, deadline, connect_timeout, links, who);
  }
  auto comm = std::make_unique<TcpComm>("world", rank, world_size, std::vector<int>{}, world_size, token,
                                        std::move(links), host);
  comm->set_secret(spec.secret);
  return std::make_shared<TcpProcessGroup>(std::move(comm));
}

}  // namespace booster::distributed
