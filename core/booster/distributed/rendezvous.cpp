// Note [Rendezvous without MPI] in distributed/README.md: the file and TCP exchanges of rank 0's blob.
#include "booster/distributed/rendezvous.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <thread>

#include "booster/common/error.h"
#include "booster/distributed/socket_impl.h"

namespace booster::distributed {

namespace fs = std::filesystem;

namespace {

using namespace net;

constexpr char kMagic[8] = {'B', 'O', 'O', 'S', 'T', 'R', 'D', '1'};  // file and TCP framing
constexpr char kGaveUp[8] = {'B', 'O', 'O', 'S', 'T', 'R', 'D', 'X'};  // a file rank 0 gave up on
constexpr size_t kMaxBlob = size_t(1) << 20;
constexpr auto kPoll = std::chrono::milliseconds(20);

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

std::optional<long> whole_number(const char* text) {
  if (!text) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || errno != 0) return std::nullopt;
  return v;
}

int number_variable(const char* name, long lowest, long highest, const char* what) {
  const char* text = env(name);
  const std::optional<long> v = whole_number(text);
  BOOSTER_CHECK(v && *v >= lowest && *v <= highest, ConfigError, name, " is \"", text ? text : "", "\"; expected ",
                what, " from ", lowest, " to ", highest);
  return int(*v);
}

std::string missing_ranks(const std::set<int>& arrived, int world_size) {
  std::vector<int> missing;
  for (int r = 1; r < world_size; ++r)
    if (!arrived.count(r)) missing.push_back(r);
  return str(missing);
}

// ------------------------------------------------------------------------------------------ file

std::string header(uint64_t token, size_t n) {
  std::string h(kMagic, sizeof kMagic);
  for (int k = 0; k < 8; ++k) h += char((token >> (8 * k)) & 0xff);
  for (int k = 0; k < 8; ++k) h += char((uint64_t(n) >> (8 * k)) & 0xff);
  return h;
}

bool gave_up(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[sizeof kGaveUp] = {};
  return in.read(magic, sizeof magic) && std::memcmp(magic, kGaveUp, sizeof kGaveUp) == 0;
}

// The blob of a complete file at `path` of the job `token`, or nullopt when there is none (yet), rank 0
// gave up on it, or it is another job's (then `other_job` is set).
std::optional<std::vector<uint8_t>> read_blob_file(const fs::path& path, uint64_t token, bool& other_job) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.size() < 24 || text.compare(0, sizeof kMagic, kMagic, sizeof kMagic) != 0) return std::nullopt;
  uint64_t file_token = 0, n = 0;
  for (int k = 0; k < 8; ++k) file_token |= uint64_t(uint8_t(text[sizeof kMagic + size_t(k)])) << (8 * k);
  for (int k = 0; k < 8; ++k) n |= uint64_t(uint8_t(text[16 + size_t(k)])) << (8 * k);
  if (text.size() != 24 + n) return std::nullopt;
  if (file_token != token) {
    other_job = true;
    return std::nullopt;
  }
  return std::vector<uint8_t>(text.begin() + 24, text.end());
}

// A rank's acknowledgement, named by the job's token so that another job's ranks are not counted.
fs::path ack_path(const fs::path& path, uint64_t token, int rank) {
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(token));
  return fs::path(path.string() + ".ack." + hex + "." + std::to_string(rank));
}

// Creates `path` with `bytes`, mode 0600, only when no file is there (O_EXCL): false when one is.
bool claim_file(const fs::path& path, const std::string& bytes, const std::string& what) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0 && errno == EEXIST) return false;
  BOOSTER_CHECK(fd >= 0, ConfigError, "rendezvous: cannot create ", path.string(), " (", std::strerror(errno), "); ",
                what, " must name a file in a directory every rank can write");
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t k = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(path.c_str());
      BOOSTER_FAIL(ConfigError, "rendezvous: cannot write ", path.string(), " (", std::strerror(err), "); ", what,
                   " must name a file in a directory every rank can write");
    }
    done += size_t(k);
  }
  ::close(fd);
  return true;
}

// Writes `bytes` to `path` whole or not at all: a temporary beside it, renamed over it.
void write_atomically(const fs::path& path, const std::string& bytes, const std::string& what) {
  const fs::path tmp = path.string() + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), std::streamsize(bytes.size()));
    out.flush();
    BOOSTER_CHECK(out.good(), ConfigError, "rendezvous: cannot write ", tmp.string(), " (", std::strerror(errno),
                  "); ", what, " must name a file in a directory every rank can write");
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) fs::remove(tmp);
  BOOSTER_CHECK(!ec, ConfigError, "rendezvous: cannot rename ", tmp.string(), " to ", path.string(), " (",
                ec.message(), "); ", what, " must name a file in a directory every rank can write");
}

// Note [Rendezvous without MPI], "file": rank 0 refuses a file with a blob that is there already
// (another job's, which a peer may have read), writes the blob atomically and waits for an
// acknowledgement file of every other rank, then removes them and the file last; a peer reads the file,
// acknowledges it and waits until the file is gone, i.e. until rank 0 of this job took its
// acknowledgement. So nobody leaves with a stale blob, and a finished job leaves no file behind. When
// rank 0 times out it replaces the blob with a marker that it gave up: a peer that acknowledged fails
// too, one that is still waiting goes on waiting, and the next job's rank 0 writes over the marker.
std::vector<uint8_t> share_through_file(const RendezvousSpec& spec, int rank, int world_size,
                                        const std::vector<uint8_t>& blob, std::chrono::duration<double> timeout) {
  const fs::path path = spec.file;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout);
  const uint64_t token = job_token(spec, world_size);
  std::error_code ec;
  if (rank == 0) {
    for (int r = 1; r < world_size; ++r) fs::remove(ack_path(path, token, r), ec);  // a crashed job's
    std::string bytes = header(token, blob.size());
    bytes.append(blob.begin(), blob.end());
    // The file is claimed whole or not at all; a marker that an earlier rank 0 gave up is taken over.
    bool claimed = claim_file(path, bytes, spec.source);
    if (!claimed && gave_up(path)) {
      fs::remove(path, ec);
      claimed = claim_file(path, bytes, spec.source);
    }
    BOOSTER_CHECK(claimed, ConfigError, "rendezvous: ", spec.source, " ", path.string(), " exists already (another ",
                  "job's, or left by an earlier one?); remove it, or give each job a file of its own (e.g. with ",
                  "$SLURM_JOB_ID in its name)");
    std::set<int> arrived;
    while (true) {
      for (int r = 1; r < world_size; ++r)
        if (!arrived.count(r) && fs::exists(ack_path(path, token, r), ec)) arrived.insert(r);
      if (int(arrived.size()) == world_size - 1) break;
      if (Clock::now() > deadline) {
        write_atomically(path, std::string(kGaveUp, sizeof kGaveUp), spec.source);
        for (int r = 1; r < world_size; ++r) fs::remove(ack_path(path, token, r), ec);
        BOOSTER_FAIL(DistributedError, "rendezvous: rank 0 waited ", seconds(timeout), " for ranks ",
                     missing_ranks(arrived, world_size), " of ", world_size, " to read ", path.string(), " (",
                     spec.source, "); are they running, with the same file on a file system they share?");
      }
      std::this_thread::sleep_for(kPoll);
    }
    for (int r = 1; r < world_size; ++r) fs::remove(ack_path(path, token, r), ec);
    fs::remove(path, ec);
    return blob;
  }
  std::optional<std::vector<uint8_t>> got;
  bool other_job = false;
  while (!(got = read_blob_file(path, token, other_job))) {
    BOOSTER_CHECK(Clock::now() <= deadline, DistributedError, "rendezvous: rank ", rank, " waited ", seconds(timeout),
                  " for rank 0 to write ", path.string(), " (", spec.source, ")",
                  other_job ? "; it held another job's id, not this one's (" + job_name(spec, world_size) +
                                  "): give each job a file of its own (e.g. with $SLURM_JOB_ID in its name)"
                            : std::string("; is rank 0 running, with the same file on a file system they share?"));
    std::this_thread::sleep_for(kPoll);
  }
  write_atomically(ack_path(path, token, rank), "ack\n", spec.source);
  while (fs::exists(path, ec)) {
    BOOSTER_CHECK(!gave_up(path), DistributedError, "rendezvous: rank ", rank, " read ", path.string(), " (",
                  spec.source, ") but rank 0 gave up waiting for the other ranks; see rank 0's error");
    BOOSTER_CHECK(Clock::now() <= deadline, DistributedError, "rendezvous: rank ", rank, " read ", path.string(),
                  " (", spec.source, ") but waited ", seconds(timeout), " for rank 0 to take it back; a file left by "
                  "an earlier job? remove it and start again");
    std::this_thread::sleep_for(kPoll);
  }
  return *got;
}

// ------------------------------------------------------------------------------------------- TCP

// The hello a peer sends: magic, its rank, the world size it was told, its job's token.
struct Hello {
  char magic[8];
  int32_t rank;
  int32_t world_size;
  uint64_t token;
};

constexpr char kOtherJob[8] = {'B', 'O', 'O', 'S', 'T', 'R', 'D', 'J'};  // rank 0's answer to another job
constexpr char kChallenge[8] = {'B', 'O', 'O', 'S', 'T', 'R', 'D', 'N'};  // a nonce follows (Note [Job secret])

std::string where(const RendezvousSpec& spec) {
  return spec.address + ":" + std::to_string(spec.port) + " (" + spec.source + ")";
}

std::vector<uint8_t> serve_tcp(const RendezvousSpec& spec, int world_size, const std::vector<uint8_t>& blob,
                               std::chrono::duration<double> timeout) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout);
  // Bound to the address MASTER_ADDR names (ConfigError when it is not this machine's or the port is taken).
  warn_without_secret(spec, "rendezvous");
  const std::vector<Socket> listeners = listen_at_master(spec, world_size, "rendezvous");
  std::vector<int> listener_fds;
  for (const Socket& l : listeners) listener_fds.push_back(l.fd);
  std::set<int> served;
  const uint64_t n = blob.size();
  // A connection that says nothing (a port scan) is dropped after a short wait, without holding up the
  // others; one that is not a peer's is dropped.
  HelloAcceptor acceptor(listener_fds, sizeof(Hello), "rendezvous");
  while (int(served.size()) < world_size - 1) {
    Hello hello{};
    Socket peer = acceptor.next(&hello, deadline);
    BOOSTER_CHECK(peer.fd >= 0, DistributedError, "rendezvous: rank 0 waited ", seconds(timeout), " on port ",
                  spec.port, " (", spec.source, ") for ranks ", missing_ranks(served, world_size), " of ", world_size,
                  " to connect; are they running, with MASTER_ADDR naming this host?");
    if (std::memcmp(hello.magic, kMagic, sizeof kMagic) != 0) continue;
    // Only a hello whose token is this job's for the world size it claims comes from this job (which
    // then must agree on the world size): another job's peer (Note [Rendezvous without MPI], "two jobs")
    // or a stray with the public magic is told "another job", and rank 0 goes on waiting.
    if (hello.token != job_token(spec, hello.world_size)) {
      (void)send_all(peer.fd, kOtherJob, sizeof kOtherJob, std::min(deadline, Clock::now() + std::chrono::seconds(1)));
      continue;
    }
    // With a secret, only a peer that proves it counts (Note [Job secret]); a stranger is dropped before
    // the checks below could end the job.
    if (!spec.secret.empty()) {
      const bool proved = send_all(peer.fd, kChallenge, sizeof kChallenge, deadline) &&
                          check_peer_secret(peer.fd, spec.secret, &hello, sizeof hello, deadline);
      if (!proved) {
        log_dropped(peer.fd, "rendezvous", hello.rank, hello.world_size);
        continue;
      }
    }
    BOOSTER_CHECK(hello.world_size == world_size, ConfigError, "rendezvous: rank ", hello.rank, " was started with a ",
                  "world size of ", hello.world_size, " and rank 0 with ", world_size,
                  "; every rank needs the same WORLD_SIZE");
    BOOSTER_CHECK(hello.rank >= 1 && hello.rank < world_size && !served.count(hello.rank), ConfigError,
                  "rendezvous: two processes say they are rank ", hello.rank, " of ", world_size,
                  " (or it is out of range); every rank needs its own RANK");
    if (!send_all(peer.fd, kMagic, sizeof kMagic, deadline) || !send_all(peer.fd, &n, sizeof n, deadline) ||
        !send_all(peer.fd, blob.data(), blob.size(), deadline))
      continue;  // it went away: it may connect again
    // Its acknowledgement, so that rank 0 returns only once the blob has arrived.
    char ack = 0;
    if (!recv_all(peer.fd, &ack, 1, deadline) || ack != 'k') continue;
    served.insert(hello.rank);
  }
  return blob;
}

std::vector<uint8_t> fetch_tcp(const RendezvousSpec& spec, int rank, int world_size,
                               std::chrono::duration<double> timeout) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout);
  std::string error;
  const AddressList found = resolve(spec.address, spec.port, false, error);
  BOOSTER_CHECK(found, ConfigError, "rendezvous: MASTER_ADDR \"", spec.address, "\" cannot be resolved (", error,
                "); set it to rank 0's host name or address");
  std::string last_error = "no answer";
  while (Clock::now() < deadline) {
    for (const addrinfo* a = found.get(); a; a = a->ai_next) {
      Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
      if (s.fd < 0) check_descriptors(errno, "rendezvous");
      if (s.fd < 0) continue;
      if (!connect_before(s.fd, a->ai_addr, a->ai_addrlen, deadline, last_error)) continue;
      set_nodelay(s.fd);
      Hello hello{};
      std::memcpy(hello.magic, kMagic, sizeof kMagic);
      hello.rank = rank;
      hello.world_size = world_size;
      hello.token = job_token(spec, world_size);
      char magic[sizeof kMagic];
      uint64_t n = 0;
      bool answered = send_all(s.fd, &hello, sizeof hello, deadline) && recv_all(s.fd, magic, sizeof magic, deadline);
      BOOSTER_CHECK(!answered || std::memcmp(magic, kOtherJob, sizeof kOtherJob) != 0, DistributedError,
                    "rendezvous: rank ", rank, " reached a rank 0 at ", where(spec), " of another job, not this one (",
                    job_name(spec, world_size), "); give each job a MASTER_PORT of its own");
      if (answered && !spec.secret.empty() && std::memcmp(magic, kChallenge, sizeof kChallenge) == 0) {
        const SecretResult proof = prove_secret(s.fd, spec.secret, &hello, sizeof hello, deadline);
        BOOSTER_CHECK(proof != SecretResult::kRefused, DistributedError, "rendezvous: rank ", rank,
                      " was refused by the rank 0 at ", where(spec), ": it has another job secret (another job on ",
                      "this port, or the ranks were given different BOOSTER_JOB_SECRET values); give each job a ",
                      "MASTER_PORT of its own and every rank the same secret");
        BOOSTER_CHECK(proof != SecretResult::kImpostor, DistributedError, "rendezvous: the process at ", where(spec),
                      " that rank ", rank, " reached as rank 0 did not prove it knows this job's secret; it is not ",
                      "this job's rank 0");
        answered = proof == SecretResult::kProved && recv_all(s.fd, magic, sizeof magic, deadline);
      }
      if (!answered || std::memcmp(magic, kMagic, sizeof kMagic) != 0 || !recv_all(s.fd, &n, sizeof n, deadline) ||
          n > kMaxBlob) {
        last_error = "the connection ended before the id came";
        continue;
      }
      std::vector<uint8_t> blob(n);
      if (!recv_all(s.fd, blob.data(), n, deadline) || !send_all(s.fd, "k", 1, deadline)) {
        last_error = "the connection ended before the id came";
        continue;
      }
      return blob;
    }
    std::this_thread::sleep_for(kPoll * 5);  // rank 0 may not listen yet
  }
  BOOSTER_FAIL(DistributedError, "rendezvous: rank ", rank, " waited ", seconds(timeout), " for rank 0 at ",
               where(spec), " (last: ", last_error, "); is rank 0 running, and MASTER_ADDR/MASTER_PORT the same on "
               "every rank?");
}

}  // namespace

std::optional<EnvRanks> ranks_from_environment() {
  const bool booster = env("BOOSTER_WORLD_SIZE") != nullptr;
  if (!booster && !env("WORLD_SIZE")) {
    BOOSTER_CHECK(!env("BOOSTER_RANK"), ConfigError, "BOOSTER_RANK is set without BOOSTER_WORLD_SIZE; set both");
    return std::nullopt;
  }
  const char* size_name = booster ? "BOOSTER_WORLD_SIZE" : "WORLD_SIZE";
  const char* rank_name = booster ? "BOOSTER_RANK" : "RANK";
  const char* local_name = booster ? "BOOSTER_LOCAL_RANK" : "LOCAL_RANK";
  EnvRanks ranks;
  ranks.world_size = number_variable(size_name, 1, 1 << 20, "the number of processes");
  BOOSTER_CHECK(env(rank_name), ConfigError, size_name, " is set but ", rank_name, " is not; set each process's ",
                rank_name, " (0 to ", ranks.world_size - 1, ")");
  ranks.rank = number_variable(rank_name, 0, ranks.world_size - 1, "this process's rank");
  ranks.local_rank = env(local_name) ? number_variable(local_name, 0, 1 << 20, "the rank on this machine") : ranks.rank;
  return ranks;
}

namespace {

std::string job_from_environment() {
  for (const char* name : {"TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "BOOSTER_RUN_ID"})
    if (const char* v = env(name)) return v;
  return "";
}

}  // namespace

std::optional<RendezvousSpec> rendezvous_from_environment() {
  RendezvousSpec spec;
  if (const char* file = env("BOOSTER_NCCL_ID_FILE")) {
    spec.kind = RendezvousSpec::Kind::File;
    spec.file = file;
    spec.source = "BOOSTER_NCCL_ID_FILE";
    spec.job = job_from_environment();
    spec.secret = job_secret_from_environment();
    return spec;
  }
  const char* address = env("MASTER_ADDR");
  const char* port = env("MASTER_PORT");
  if (!address && !port) return std::nullopt;
  BOOSTER_CHECK(address, ConfigError, "MASTER_PORT is set but MASTER_ADDR is not; set MASTER_ADDR to rank 0's host");
  BOOSTER_CHECK(port, ConfigError, "MASTER_ADDR is set but MASTER_PORT is not; set MASTER_PORT to a free port on "
                "rank 0's host (e.g. 29500)");
  spec.kind = RendezvousSpec::Kind::Tcp;
  spec.address = address;
  spec.port = number_variable("MASTER_PORT", 1, 65535, "a port number");
  spec.source = "MASTER_ADDR/MASTER_PORT";
  spec.job = job_from_environment();
  spec.secret = job_secret_from_environment();
  return spec;
}

std::string job_secret_from_environment() {
  if (const char* secret = env("BOOSTER_JOB_SECRET")) return secret;
  const char* file = env("BOOSTER_JOB_SECRET_FILE");
  if (!file) return "";
  std::error_code ec;
  const auto status = fs::status(file, ec);
  BOOSTER_CHECK(!ec && fs::is_regular_file(status), ConfigError, "BOOSTER_JOB_SECRET_FILE names '", file,
                "', which ", ec ? "cannot be read (" + ec.message() + ")" : std::string("is not a regular file"),
                "; point it at a file holding the job's secret, or set BOOSTER_JOB_SECRET");
  std::ifstream in(file, std::ios::binary);
  std::string text(4097, '\0');
  in.read(text.data(), std::streamsize(text.size()));
  BOOSTER_CHECK(!in.bad(), ConfigError, "BOOSTER_JOB_SECRET_FILE '", file, "' cannot be read");
  text.resize(size_t(in.gcount()));
  BOOSTER_CHECK(text.size() <= 4096, ConfigError, "BOOSTER_JOB_SECRET_FILE '", file,
                "' is over 4 KiB; a secret of 32 random bytes (64 hex digits) is enough");
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  BOOSTER_CHECK(!text.empty(), ConfigError, "BOOSTER_JOB_SECRET_FILE '", file,
                "' is empty; write the job's secret into it (e.g. 64 hex digits from /dev/urandom)");
  return text;
}

std::vector<uint8_t> share_from_rank0(const RendezvousSpec& spec, int rank, int world_size,
                                      const std::vector<uint8_t>& blob, std::chrono::duration<double> timeout) {
  BOOSTER_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, ValueError, "share_from_rank0: rank ", rank,
                " of ", world_size, " is out of range");
  BOOSTER_CHECK(rank != 0 || blob.size() <= kMaxBlob, ValueError, "share_from_rank0: the blob is ", blob.size(),
                " bytes; at most ", kMaxBlob);
  BOOSTER_CHECK(timeout.count() > 0, ValueError, "share_from_rank0: the timeout is ", timeout.count(),
                " s; expected a positive number of seconds");
  if (spec.kind == RendezvousSpec::Kind::Tcp)
    BOOSTER_CHECK(spec.port >= 1 && spec.port <= 65535, ConfigError, "rendezvous: port ", spec.port, " (",
                  spec.source, ") is not from 1 to 65535");
  if (world_size == 1) return blob;
  if (spec.kind == RendezvousSpec::Kind::File) return share_through_file(spec, rank, world_size, blob, timeout);
  return rank == 0 ? serve_tcp(spec, world_size, blob, timeout) : fetch_tcp(spec, rank, world_size, timeout);
}

}  // namespace booster::distributed
