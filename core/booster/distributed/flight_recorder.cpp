// The flight recorder: the ring (flight_recorder_impl.h), its dump, and the analysis of the ranks'
// dumps (flight_recorder.h). Note [Flight recorder] in README.md.
#include "booster/distributed/flight_recorder.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <regex>
#include <sstream>
#include <thread>
#include <tuple>

#include "booster/common/error.h"
#include "booster/common/json_text.h"
#include "booster/distributed/collective_timeout_impl.h"

namespace booster::distributed {

namespace fs = std::filesystem;
using nlohmann::json;

namespace detail {

namespace {

// Note [Flight recorder], "Signals": everything a dump touches is here, preallocated, so that a
// fatal-signal handler can write it with async-signal-safe calls only (open, write, rename, mkdir,
// clock_gettime): no allocation, no stdio, no locks.

struct Fields {
  uint64_t seq = 0;
  int64_t start_ns = 0, end_ns = 0;  // steady clock; end 0 while it runs
  uint64_t bytes = 0;
  int32_t group = -1;  // index into g_groups
  int32_t peer = -1;
  int8_t op = 0;
  int8_t dtype = -1;  // DType, -1: none (a barrier)
  int8_t state = 0;   // FlightState
};

// Note [Flight recorder], "Signals": a slot of the ring is a seqlock. A writer (under g_mutex) stores
// id 0, fences, writes the fields and publishes the id (release); a reader without the mutex loads the
// id (acquire), copies the fields, fences and loads the id again, dropping the entry if it changed.
struct Entry {
  std::atomic<uint64_t> id{0};  // 1, 2, ... over the process; 0: an empty slot, or one being written
  Fields f;
};

// A copy of an entry, as a dump reads it.
struct Snapshot {
  uint64_t id = 0;  // 0: empty, or torn (dropped)
  Fields f;
};

// Note [Flight recorder], "Counters": how far the group got, whatever the ring still holds.
// Completions out of order wait in `done` (bit s % kDoneWindow: #s completed, for
// completed_through < s <= completed_through + kDoneWindow) until the ones before them complete.
constexpr uint64_t kDoneWindow = 1024;

struct Group {
  char backend[8] = {};
  char name[64] = {};  // truncated past 63 bytes
  int size = 0, rank = 0;
  int instance = 0;           // earlier groups of this process with the same backend, name and members
  const int* world = nullptr;  // world rank of each rank (size of them), never freed; null: the world
  // Written under g_mutex; atomic so that a signal handler may read them without it.
  std::atomic<uint64_t> last_started{0};       // the highest seq started
  std::atomic<uint64_t> completed_through{0};  // the highest seq such that every seq <= it completed
  uint64_t done[kDoneWindow / 64] = {};
};

constexpr size_t kMaxGroups = 256;  // later groups are recorded as group -1 ("?")
constexpr size_t kPathMax = 4096;

std::mutex g_mutex;  // writers of the ring and the group table
Entry g_ring[kFlightRingSize];
uint64_t g_next_id = 0;
Group g_groups[kMaxGroups];
std::atomic<int> g_group_count{0};  // published after the group is filled
std::atomic<int> g_world_rank{-1};  // -1: not known yet (the file is then rank-unknown-<pid>.json)

// The dump directory, as set_flight_dump_dir or BOOSTER_FLIGHT_DIR gave it.
std::mutex g_dir_mutex;
char g_dir[kPathMax] = {};
std::atomic<bool> g_dir_known{false};  // set or read from the environment

// One dump at a time; a signal that finds one running does not write.
std::atomic<bool> g_dumping{false};
Snapshot g_snapshot[kFlightRingSize];
char g_path[kPathMax], g_tmp_path[kPathMax];
char g_signal_path[kPathMax];  // the file a signal's dump wrote, for its message

int64_t steady_ns(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

int64_t clock_ns(clockid_t clock) {
  timespec t{};
  clock_gettime(clock, &t);
  return int64_t(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

const char* state_name(int8_t state) {
  switch (FlightState(state)) {
    case FlightState::Started: return "started";
    case FlightState::Completed: return "completed";
    case FlightState::TimedOut: return "timed_out";
  }
  return "?";
}

// ------------------------------------------------------------------------ async-signal-safe writing

// Appends to a fixed buffer and write(2)s it out when full.
class Writer {
 public:
  explicit Writer(int fd) : fd_(fd) {}
  bool ok() const { return ok_; }
  void raw(const char* s, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      if (used_ == sizeof buf_) flush();
      buf_[used_++] = s[i];
    }
  }
  void put(const char* s) { raw(s, std::strlen(s)); }
  void num(int64_t v) {
    char text[24];
    size_t n = 0;
    const bool negative = v < 0;
    uint64_t u = negative ? uint64_t(0) - uint64_t(v) : uint64_t(v);
    do {
      text[n++] = char('0' + u % 10);
      u /= 10;
    } while (u);
    if (negative) text[n++] = '-';
    while (n) raw(&text[--n], 1);
  }
  void unum(uint64_t u) {
    char text[24];
    size_t n = 0;
    do {
      text[n++] = char('0' + u % 10);
      u /= 10;
    } while (u);
    while (n) raw(&text[--n], 1);
  }
  // A JSON string: quotes, backslashes and control characters escaped.
  void str(const char* s) {
    raw("\"", 1);
    for (; *s; ++s) {
      const unsigned char c = static_cast<unsigned char>(*s);
      if (c == '"' || c == '\\') {
        raw("\\", 1);
        raw(s, 1);
      } else if (c < 0x20) {
        const char hex[] = "0123456789abcdef";
        const char esc[6] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15]};
        raw(esc, 6);
      } else {
        raw(s, 1);
      }
    }
    raw("\"", 1);
  }
  void flush() {
    size_t done = 0;
    while (done < used_) {
      const ssize_t n = ::write(fd_, buf_ + done, used_ - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        ok_ = false;
        break;
      }
      done += size_t(n);
    }
    used_ = 0;
  }

 private:
  int fd_;
  bool ok_ = true;
  size_t used_ = 0;
  char buf_[4096];
};

// dst = a + b + c (each may be null), cut to fit; false when it did not fit.
bool join(char* dst, const char* a, const char* b = nullptr, const char* c = nullptr) {
  size_t n = 0;
  for (const char* part : {a, b, c}) {
    for (; part && *part; ++part) {
      if (n + 1 >= kPathMax) {
        dst[n] = '\0';
        return false;
      }
      dst[n++] = *part;
    }
  }
  dst[n] = '\0';
  return true;
}

// mkdir -p of g_path's directory part (g_path is "<dir>/rank-N.json").
void make_parents(char* path) {
  for (char* p = path + 1; *p; ++p) {
    if (*p != '/') continue;
    *p = '\0';
    ::mkdir(path, 0777);  // EEXIST and the like: the open below reports what matters
    *p = '/';
  }
}

void format_uint(char* out, uint64_t u) {
  char text[24];
  size_t n = 0;
  do {
    text[n++] = char('0' + u % 10);
    u /= 10;
  } while (u);
  size_t i = 0;
  while (n) out[i++] = text[--n];
  out[i] = '\0';
}

// Copies the ring into g_snapshot (the seqlock's read side, Entry), leaving out entries being written.
void take_snapshot() {
  for (size_t i = 0; i < kFlightRingSize; ++i) {
    const Entry& e = g_ring[i];
    Snapshot& s = g_snapshot[i];
    const uint64_t id = e.id.load(std::memory_order_acquire);
    std::memcpy(static_cast<void*>(&s.f), &e.f, sizeof s.f);
    std::atomic_thread_fence(std::memory_order_acquire);
    s.id = id != 0 && e.id.load(std::memory_order_relaxed) == id ? id : 0;
  }
}

// Tests: the ring as a fatal-signal handler reads it.
std::vector<std::array<uint64_t, 3>> snapshot_unlocked() {
  while (g_dumping.exchange(true, std::memory_order_acquire)) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  take_snapshot();
  std::vector<std::array<uint64_t, 3>> out;
  uint64_t newest = 0;
  for (const Snapshot& e : g_snapshot) newest = std::max(newest, e.id);
  const uint64_t oldest = newest > kFlightRingSize ? newest - kFlightRingSize + 1 : 1;
  for (uint64_t id = oldest; id <= newest && newest > 0; ++id) {
    const Snapshot& e = g_snapshot[id % kFlightRingSize];
    if (e.id != id) continue;  // torn or reused since
    out.push_back({e.id, e.f.seq, e.f.bytes});
  }
  g_dumping.store(false, std::memory_order_release);
  return out;
}

// The record, written to g_dir/rank-<r>.json through a temporary file. Async-signal-safe when
// `from_signal` (the ring is then read without its lock: an entry written at that moment is left out).
// `dir`: the directory (a copy taken under g_dir_mutex; a signal passes g_dir itself, as it cannot
// lock). `written` (kPathMax bytes) receives the file's path before the next dump may reuse g_path.
bool write_dump(const char* reason, const char* dir, char* written, bool from_signal) {
  if (g_dumping.exchange(true, std::memory_order_acquire)) {
    if (from_signal) return false;  // a dump is running (maybe in the thread this signal interrupted)
    while (g_dumping.exchange(true, std::memory_order_acquire)) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  bool ok = false;
  int groups = 0;
  if (from_signal) {
    take_snapshot();
    groups = g_group_count.load(std::memory_order_acquire);
  } else {
    std::lock_guard<std::mutex> lock(g_mutex);
    take_snapshot();
    groups = g_group_count.load(std::memory_order_acquire);
  }
  // Note [Flight recorder], "Dumping": a process that does not know its world rank yet names itself by
  // its pid, rather than writing over another rank's file.
  const int world_rank = g_world_rank.load();
  char rank_text[40], pid_text[24];
  format_uint(pid_text, uint64_t(::getpid()));
  if (world_rank >= 0) {
    format_uint(rank_text, uint64_t(world_rank));
  } else {
    std::memcpy(rank_text, "unknown-", 8);
    format_uint(rank_text + 8, uint64_t(::getpid()));
  }
  if (dir[0] && join(g_path, dir, "/rank-", rank_text) && join(g_path, g_path, ".json") &&
      join(g_tmp_path, g_path, ".tmp.", pid_text)) {
    make_parents(g_path);
    const int fd = ::open(g_tmp_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) {
      Writer w(fd);
      const int64_t now_steady = clock_ns(CLOCK_MONOTONIC), now_wall = clock_ns(CLOCK_REALTIME);
      w.put("{\"format\": \"booster-flight-recorder\", \"version\": 2, \"world_rank\": ");
      if (world_rank >= 0) w.num(world_rank);
      else w.put("null");
      w.put(", \"pid\": ");
      w.num(::getpid());
      w.put(", \"reason\": ");
      w.str(reason);
      // Entries' times are steady-clock nanoseconds; this pair, read at the dump, turns them into wall time.
      w.put(", \"clock\": {\"steady_ns\": ");
      w.num(now_steady);
      w.put(", \"wall_ns\": ");
      w.num(now_wall);
      w.put("},\n \"groups\": [");
      for (int g = 0; g < groups && g < int(kMaxGroups); ++g) {
        const Group& group = g_groups[g];
        w.put(g ? ",\n  {\"index\": " : "\n  {\"index\": ");
        w.num(g);
        w.put(", \"backend\": ");
        w.str(group.backend);
        w.put(", \"name\": ");
        w.str(group.name);
        w.put(", \"instance\": ");
        w.num(group.instance);
        w.put(", \"size\": ");
        w.num(group.size);
        w.put(", \"rank\": ");
        w.num(group.rank);
        w.put(", \"last_started\": ");
        w.unum(group.last_started.load(std::memory_order_relaxed));
        w.put(", \"completed_through\": ");
        w.unum(group.completed_through.load(std::memory_order_relaxed));
        w.put(", \"world_ranks\": [");
        for (int r = 0; r < group.size; ++r) {
          if (r) w.put(", ");
          w.num(group.world ? group.world[r] : r);
        }
        w.put("]}");
      }
      w.put("],\n \"entries\": [");
      // Oldest first: the ring's slots in id order.
      uint64_t newest = 0;
      for (const Snapshot& s : g_snapshot) newest = std::max(newest, s.id);
      const uint64_t oldest = newest > kFlightRingSize ? newest - kFlightRingSize + 1 : 1;
      bool first = true;
      for (uint64_t id = oldest; id <= newest && newest > 0; ++id) {
        if (g_snapshot[id % kFlightRingSize].id != id) continue;  // being written (a signal mid-write)
        const Fields& e = g_snapshot[id % kFlightRingSize].f;
        const bool known = e.group >= 0 && e.group < groups;
        w.put(first ? "\n  {\"id\": " : ",\n  {\"id\": ");
        first = false;
        w.unum(id);
        w.put(", \"seq\": ");
        w.unum(e.seq);
        w.put(", \"op\": ");
        w.str(collective_name(CollectiveOp(e.op)));
        w.put(", \"group\": ");
        w.str(known ? g_groups[e.group].name : "?");
        w.put(", \"group_index\": ");
        w.num(known ? e.group : -1);
        w.put(", \"group_size\": ");
        w.num(known ? g_groups[e.group].size : 0);
        w.put(", \"rank\": ");
        w.num(known ? g_groups[e.group].rank : -1);
        w.put(", \"peer\": ");
        w.num(e.peer);
        w.put(", \"bytes\": ");
        w.unum(e.bytes);
        w.put(", \"dtype\": ");
        if (e.dtype >= 0) w.str(dtype_name(DType(e.dtype)));
        else w.put("null");
        w.put(", \"state\": ");
        w.str(state_name(e.state));
        w.put(", \"start_ns\": ");
        w.num(e.start_ns);
        w.put(", \"end_ns\": ");
        if (e.end_ns) w.num(e.end_ns);
        else w.put("null");
        w.put("}");
      }
      w.put("]}\n");
      w.flush();
      ok = w.ok() && ::fsync(fd) == 0;
      ok = ::close(fd) == 0 && ok;
      ok = ok && ::rename(g_tmp_path, g_path) == 0;
      if (!ok) ::unlink(g_tmp_path);
    }
  }
  join(written, g_path);
  g_dumping.store(false, std::memory_order_release);
  return ok;
}

// ------------------------------------------------------------------------ fatal signals

constexpr int kFatalSignals[] = {SIGSEGV, SIGABRT, SIGBUS, SIGFPE};
struct sigaction g_previous[4];
std::atomic<bool> g_in_fatal_handler{false};

// Note [Flight recorder], "Signals". Chains to the handler that was there before (OpenMPI's backtrace,
// or the default: a core dump). A fault the kernel raised (si_code > 0) repeats when this returns and
// reaches that handler with its own siginfo (the faulting address); a signal a process sent (kill,
// raise, abort: si_code <= 0) would not repeat, so it is raised again, pending until this returns.
// A second entry (another fatal signal, or a handler that chains back to this one) takes the default
// action at once, so two handlers that chain to each other cannot bounce a fault forever.
void on_fatal_signal(int signal, siginfo_t* info, void*) {
  const int saved_errno = errno;
  if (g_in_fatal_handler.exchange(true)) {
    struct sigaction fallback {};
    fallback.sa_handler = SIG_DFL;
    sigemptyset(&fallback.sa_mask);
    sigaction(signal, &fallback, nullptr);
    if (info == nullptr || info->si_code <= 0) raise(signal);
    errno = saved_errno;
    return;
  }
  const char* name = signal == SIGSEGV ? "fatal signal SIGSEGV"
                     : signal == SIGABRT ? "fatal signal SIGABRT"
                     : signal == SIGBUS  ? "fatal signal SIGBUS"
                                         : "fatal signal SIGFPE";
  if (write_dump(name, g_dir, g_signal_path, /*from_signal=*/true)) {
    const char* parts[] = {"booster: ", name, "; flight record written to ", g_signal_path, "\n"};
    for (const char* part : parts) (void)!::write(STDERR_FILENO, part, std::strlen(part));
  }
  for (size_t i = 0; i < 4; ++i)
    if (kFatalSignals[i] == signal) sigaction(signal, &g_previous[i], nullptr);
  if (info == nullptr || info->si_code <= 0) raise(signal);
  errno = saved_errno;
}

bool is_ours(const struct sigaction& a) {
  return (a.sa_flags & SA_SIGINFO) != 0 && a.sa_sigaction == &on_fatal_signal;
}

// Installs the handler for each fatal signal where it is not the current one (a handler installed
// since, and restored, may have replaced it), keeping the one it replaces to chain to.
void install_fatal_handlers() {
  struct sigaction action {};
  action.sa_sigaction = &on_fatal_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  for (size_t i = 0; i < 4; ++i) {
    struct sigaction current {};
    sigaction(kFatalSignals[i], nullptr, &current);
    if (!is_ours(current)) sigaction(kFatalSignals[i], &action, &g_previous[i]);
  }
}

// BOOSTER_FLIGHT_DIR, read once unless set_flight_dump_dir came first.
void read_environment_once() {
  if (g_dir_known.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(g_dir_mutex);
  if (g_dir_known.load()) return;
  if (const char* dir = std::getenv("BOOSTER_FLIGHT_DIR"); dir && *dir) {
    join(g_dir, dir);
    install_fatal_handlers();
  }
  g_dir_known.store(true, std::memory_order_release);
}

}  // namespace

void flight_set_world_rank(int rank) { g_world_rank.store(rank); }

std::vector<std::array<uint64_t, 3>> flight_snapshot_unlocked_for_testing() { return snapshot_unlocked(); }

int flight_register_group(const char* backend, const std::string& name, int size, int rank,
                          const std::vector<int>& world_of) {
  read_environment_once();
  if (world_of.empty()) g_world_rank.store(rank);  // the world itself: its ranks are world ranks
  std::lock_guard<std::mutex> lock(g_mutex);
  const int index = g_group_count.load();
  if (index >= int(kMaxGroups)) return -1;
  Group& g = g_groups[index];
  std::snprintf(g.backend, sizeof g.backend, "%s", backend);
  std::snprintf(g.name, sizeof g.name, "%s", name.c_str());
  g.size = size;
  g.rank = rank;
  g.last_started.store(0, std::memory_order_relaxed);
  g.completed_through.store(0, std::memory_order_relaxed);
  std::fill(std::begin(g.done), std::end(g.done), uint64_t(0));
  if (!world_of.empty()) {
    int* world = new int[world_of.size()];  // kept for the process's life: a signal may read it
    std::copy(world_of.begin(), world_of.end(), world);
    g.world = world;
  } else {
    g.world = nullptr;
  }
  g.instance = 0;
  for (int i = 0; i < index; ++i) {
    const Group& o = g_groups[i];
    if (std::strcmp(o.backend, g.backend) || std::strcmp(o.name, g.name) || o.size != g.size) continue;
    bool same = true;
    for (int r = 0; r < size && same; ++r) same = (o.world ? o.world[r] : r) == (g.world ? g.world[r] : r);
    g.instance += same;
  }
  g_group_count.store(index + 1, std::memory_order_release);
  return index;
}

FlightId flight_start(int group, CollectiveOp op, uint64_t seq, Clock::time_point start, size_t bytes, int peer,
                      const DType* dtype) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const uint64_t id = ++g_next_id;
  if (seq > 0 && group >= 0 && group < g_group_count.load(std::memory_order_relaxed)) {
    std::atomic<uint64_t>& last = g_groups[group].last_started;
    if (seq > last.load(std::memory_order_relaxed)) last.store(seq, std::memory_order_relaxed);
  }
  Entry& slot = g_ring[id % kFlightRingSize];
  slot.id.store(0, std::memory_order_relaxed);  // the seqlock (Entry): a reader now drops the slot
  std::atomic_thread_fence(std::memory_order_release);
  Fields& e = slot.f;
  e.seq = seq;
  e.start_ns = steady_ns(start);
  e.end_ns = 0;
  e.bytes = bytes;
  e.group = group;
  e.peer = peer;
  e.op = int8_t(op);
  e.dtype = dtype ? int8_t(*dtype) : int8_t(-1);
  e.state = int8_t(FlightState::Started);
  slot.id.store(id, std::memory_order_release);
  return FlightId{id, group, seq};
}

void flight_end(const FlightId& id, FlightState state) {
  if (id.id == 0) return;
  const int64_t now = steady_ns(Clock::now());
  std::lock_guard<std::mutex> lock(g_mutex);
  if (state == FlightState::Completed && id.seq > 0 && id.group >= 0 &&
      id.group < g_group_count.load(std::memory_order_relaxed)) {
    // Note [Flight recorder], "Counters": marked done, then completed_through moved past every done one.
    Group& g = g_groups[id.group];
    uint64_t through = g.completed_through.load(std::memory_order_relaxed);
    if (id.seq > through && id.seq - through <= kDoneWindow) {
      g.done[(id.seq % kDoneWindow) / 64] |= uint64_t(1) << (id.seq % 64);
      for (;;) {
        const uint64_t next = through + 1, bit = uint64_t(1) << (next % 64);
        uint64_t& word = g.done[(next % kDoneWindow) / 64];
        if (!(word & bit)) break;
        word &= ~bit;
        through = next;
      }
      g.completed_through.store(through, std::memory_order_relaxed);
    }
    // Past the window (more than kDoneWindow later collectives completed first): not counted, so
    // completed_through stays behind it, and the analysis says "unknown" rather than "completed".
  }
  Entry& slot = g_ring[id.id % kFlightRingSize];
  if (slot.id.load(std::memory_order_relaxed) != id.id || slot.f.state != int8_t(FlightState::Started)) return;
  slot.id.store(0, std::memory_order_relaxed);  // the seqlock, as in flight_start
  std::atomic_thread_fence(std::memory_order_release);
  slot.f.end_ns = now;
  slot.f.state = int8_t(state);
  slot.id.store(id.id, std::memory_order_release);
}

void flight_dump_on_timeout(const Collective& what, const std::string& group) {
  flight_end(what.flight, FlightState::TimedOut);
  const std::string reason =
      what.op == CollectiveOp::SendRecv
          ? str("send/recv with rank ", what.peer, " on group \"", group, "\" timed out")
          : str(collective_name(what.op), " #", what.seq, " on group \"", group, "\" timed out");
  const fs::path file = dump_flight_record(reason);
  if (!file.empty()) std::fprintf(stderr, "booster: flight record written to %s\n", file.c_str());
}

void flight_reset_for_testing() {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (Entry& e : g_ring) {
      e.id.store(0);
      e.f = Fields{};
    }
    g_next_id = 0;
    g_world_rank.store(-1);
    for (Group& g : g_groups) {
      g.last_started.store(0);
      g.completed_through.store(0);
      std::fill(std::begin(g.done), std::end(g.done), uint64_t(0));
    }
    g_group_count.store(0);
  }
  std::lock_guard<std::mutex> lock(g_dir_mutex);
  g_dir[0] = '\0';
  g_dir_known.store(false);
}

}  // namespace detail

void set_flight_dump_dir(const fs::path& dir) {
  std::lock_guard<std::mutex> lock(detail::g_dir_mutex);
  BOOSTER_CHECK(dir.string().size() + 32 < detail::kPathMax, ValueError, "set_flight_dump_dir: the path ",
                dir.string().substr(0, 80), "... is longer than ", detail::kPathMax - 32, " bytes");
  detail::join(detail::g_dir, dir.string().c_str());
  detail::g_dir_known.store(true, std::memory_order_release);
  if (!dir.empty()) detail::install_fatal_handlers();
}

fs::path flight_dump_dir() {
  detail::read_environment_once();
  std::lock_guard<std::mutex> lock(detail::g_dir_mutex);
  return fs::path(detail::g_dir);
}

fs::path dump_flight_record(const std::string& reason) {
  detail::read_environment_once();
  // Copies, so that set_flight_dump_dir and other dumps may run meanwhile.
  std::string dir;
  {
    std::lock_guard<std::mutex> lock(detail::g_dir_mutex);
    dir = detail::g_dir;
  }
  if (dir.empty()) return {};
  std::vector<char> written(detail::kPathMax, '\0');
  if (!detail::write_dump(reason.c_str(), dir.c_str(), written.data(), /*from_signal=*/false)) {
    std::fprintf(stderr, "booster: could not write the flight record to %s: %s\n", written.data(),
                 std::strerror(errno));
    return {};
  }
  return fs::path(written.data());
}

// ---------------------------------------------------------------------------------------- reading

namespace {

[[noreturn]] void malformed(const fs::path& file, const std::string& what) {
  BOOSTER_FAIL(DataError, file.string(), " is not a flight record: ", what,
               " (booster writes these files on a collective timeout; was it cut short or edited?)");
}

// Note [Reading a flight record]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A record is read as any JSON file is (Note [One JSON reader] in booster/common/json_text.h): depth
// 64, at most kMaxRecordBytes. Then every field that the analysis or `booster flight` reads is checked
// here, once, before anything is printed, so a field of the wrong type is a DataError naming the file
// and the field ("groups[0].size is "2", not an integer"), never nlohmann's type_error halfway
// through the output. Integers read into an int are checked to fit one.
constexpr size_t kMaxRecordBytes = size_t(256) << 20;  // 256 groups of a 100 000-rank world, and more

// Checks of one JSON value, naming its path in the record.
class FieldCheck {
 public:
  FieldCheck(const fs::path& file) : file_(file) {}

  // The member `key` of object `parent` (at `path`), which must be there.
  const json& need(const json& parent, const std::string& path, const char* key) const {
    if (!parent.contains(key)) malformed(file_, str(join(path, key), " is missing"));
    return parent[key];
  }
  void integer(const json& v, const std::string& path, int64_t lo = INT32_MIN, int64_t hi = INT32_MAX) const {
    if (!v.is_number_integer()) wrong(v, path, "an integer");
    if (v.is_number_unsigned() ? v.get<uint64_t>() > uint64_t(hi) : (v.get<int64_t>() < lo || v.get<int64_t>() > hi))
      wrong(v, path, str("an integer from ", lo, " to ", hi));
  }
  void int64(const json& v, const std::string& path) const {
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)))
      wrong(v, path, "an integer");
  }
  void count(const json& v, const std::string& path) const {
    if (!v.is_number_unsigned()) wrong(v, path, "an integer of at least 0");
  }
  void string(const json& v, const std::string& path) const {
    if (!v.is_string()) wrong(v, path, "a string");
  }
  void object(const json& v, const std::string& path) const {
    if (!v.is_object()) wrong(v, path, "an object");
  }
  void array(const json& v, const std::string& path) const {
    if (!v.is_array()) wrong(v, path, "a list");
  }
  [[noreturn]] void wrong(const json& v, const std::string& path, const std::string& want) const {
    std::string shown = v.dump();
    if (shown.size() > 40) shown = shown.substr(0, 40) + "...";
    malformed(file_, str(path, " is ", shown, ", not ", want));
  }
  static std::string join(const std::string& path, const char* key) { return path.empty() ? key : path + "." + key; }

 private:
  const fs::path& file_;
};

// Checks the fields the analysis and `booster flight` read (Note [Reading a flight record]).
void validate(const json& doc, const fs::path& file) {
  const FieldCheck c(file);
  if (!doc.is_object()) malformed(file, "not a JSON object");
  if (doc.value("format", json()) != "booster-flight-recorder") malformed(file, "no \"format\": \"booster-flight-recorder\"");
  const json& world_rank = c.need(doc, "", "world_rank");
  if (!world_rank.is_null()) c.integer(world_rank, "world_rank", 0);
  if (doc.contains("reason")) c.string(doc["reason"], "reason");
  if (doc.contains("pid")) c.int64(doc["pid"], "pid");
  const json& clock = c.need(doc, "", "clock");
  c.object(clock, "clock");
  c.int64(c.need(clock, "clock", "steady_ns"), "clock.steady_ns");
  c.int64(c.need(clock, "clock", "wall_ns"), "clock.wall_ns");
  const json& groups = c.need(doc, "", "groups");
  c.array(groups, "groups");
  for (size_t i = 0; i < groups.size(); ++i) {
    const json& g = groups[i];
    const std::string at = str("groups[", i, "]");
    c.object(g, at);
    c.int64(c.need(g, at, "index"), at + ".index");
    c.string(c.need(g, at, "backend"), at + ".backend");
    c.string(c.need(g, at, "name"), at + ".name");
    const json& size = c.need(g, at, "size");
    c.integer(size, at + ".size", 1);
    c.integer(c.need(g, at, "rank"), at + ".rank");
    if (g.contains("instance")) c.integer(g["instance"], at + ".instance");
    c.count(c.need(g, at, "last_started"), at + ".last_started");
    c.count(c.need(g, at, "completed_through"), at + ".completed_through");
    const json& world_ranks = c.need(g, at, "world_ranks");
    c.array(world_ranks, at + ".world_ranks");
    if (world_ranks.size() != size.get<size_t>())
      malformed(file, str(at, ".world_ranks holds ", world_ranks.size(), " ranks, where ", at, ".size is ", size.dump()));
    for (const json& w : world_ranks)
      if (!w.is_number_integer() || w.get<int64_t>() < 0 || w.get<int64_t>() > INT32_MAX)
        malformed(file, str(at, ".world_ranks holds ", w.dump().substr(0, 40), ", not a rank"));
  }
  const json& entries = c.need(doc, "", "entries");
  c.array(entries, "entries");
  for (size_t i = 0; i < entries.size(); ++i) {
    const json& e = entries[i];
    const std::string at = str("entries[", i, "]");
    c.object(e, at);
    c.count(c.need(e, at, "seq"), at + ".seq");
    c.string(c.need(e, at, "op"), at + ".op");
    c.int64(c.need(e, at, "group_index"), at + ".group_index");
    c.string(c.need(e, at, "state"), at + ".state");
    c.int64(c.need(e, at, "start_ns"), at + ".start_ns");
    if (e.contains("peer")) c.integer(e["peer"], at + ".peer");
    if (e.contains("end_ns") && !e["end_ns"].is_null()) c.int64(e["end_ns"], at + ".end_ns");
  }
}

}  // namespace

std::vector<json> load_flight_records(const fs::path& dir) {
  std::error_code ec;
  BOOSTER_CHECK(fs::is_directory(dir, ec), DataError, "no flight records: ", dir.string(),
                " is not a directory (booster train writes <run_dir>/flight/rank-N.json when a collective times out "
                "or a rank crashes)");
  // rank-<world rank>.json, and rank-unknown-<pid>.json of a process that did not know its rank yet.
  static const std::regex kName(R"(rank-(unknown-)?(\d+)\.json)");
  std::vector<std::tuple<bool, long long, fs::path>> files;  // (unknown, rank or pid, file)
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (!entry.is_regular_file() || !std::regex_match(name, m, kName)) continue;
    if (m[2].length() > 9) malformed(entry.path(), "the number in its name is not a rank or pid");
    files.emplace_back(m[1].matched, std::stoll(m[2]), entry.path());
  }
  BOOSTER_CHECK(!files.empty(), DataError, "no flight records in ", dir.string(),
                ": no rank-N.json (no collective timed out and no rank crashed, or the run had no run_dir)");
  std::sort(files.begin(), files.end());
  std::vector<json> records;
  for (const auto& [unknown, rank, file] : files) {
    json doc;
    try {
      // Note [Reading a flight record].
      doc = read_json_file(file.string(), "flight record", data_limits(kMaxRecordBytes, "a flight record's limit"));
    } catch (const JsonSyntaxError& e) {
      malformed(file, "not valid JSON (" + e.detail() + ")");
    } catch (const ConfigError& e) {
      throw DataError(e.what());
    }
    validate(doc, file);
    if (unknown != doc["world_rank"].is_null() || (!unknown && doc["world_rank"].get<long long>() != rank))
      malformed(file, str("it says world rank ", doc["world_rank"].dump()));
    records.push_back(std::move(doc));
  }
  return records;
}

// ---------------------------------------------------------------------------------------- analysis

namespace {

// One rank's view of one group.
struct RankView {
  const json* record = nullptr;
  std::map<uint64_t, const json*> collectives;  // by seq
  std::vector<const json*> p2p;                 // point-to-point batches not completed
  uint64_t started = 0;                         // the group's last_started: the highest seq it started
  uint64_t through = 0;                         // the group's completed_through
};

std::string seconds_text(double s) {
  char text[32];
  std::snprintf(text, sizeof text, s < 10 ? "%.1f" : "%.0f", s);
  return text;
}

// "12:00:03.123 UTC" for steady-clock `ns` of `record`.
std::string wall_text(const json& record, int64_t ns) {
  const json& clock = record.at("clock");
  const int64_t wall = clock.value("wall_ns", int64_t(0)) - (clock.value("steady_ns", int64_t(0)) - ns);
  const time_t secs = time_t(wall / 1'000'000'000);
  std::tm utc{};
  gmtime_r(&secs, &utc);
  char text[48];
  std::snprintf(text, sizeof text, "%04d-%02d-%02d %02d:%02d:%02d.%03d UTC", utc.tm_year + 1900, utc.tm_mon + 1,
                utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec, int((wall / 1'000'000) % 1000));
  return text;
}

// How long `e` ran: to its end, or to the dump.
std::string how_long(const json& record, const json& e) {
  const int64_t start = e.at("start_ns").get<int64_t>();
  if (e.value("state", "") == "timed_out" && e.value("end_ns", json()).is_number())
    return str("after ", seconds_text(double(e["end_ns"].get<int64_t>() - start) * 1e-9), " s; started ",
               wall_text(record, start));
  const int64_t now = record.at("clock").value("steady_ns", start);
  return str("for ", seconds_text(double(now - start) * 1e-9), " s when its record was written, since ",
             wall_text(record, start));
}

}  // namespace

std::string rank_list_text(const std::vector<int>& ranks) { return detail::rank_names(ranks, {}); }

int record_world_rank(const json& record) {
  if (record.at("world_rank").is_number_integer()) return record["world_rank"].get<int>();
  // rank-unknown-<pid>.json: the rank its groups give it, if any.
  for (const json& g : record.at("groups")) {
    const int rank = g.at("rank").get<int>();
    if (rank >= 0 && size_t(rank) < g.at("world_ranks").size()) return g["world_ranks"][size_t(rank)].get<int>();
  }
  return -1;
}

namespace {

std::string op_seq(const json& e) { return str(e.at("op").get<std::string>(), " #", e.at("seq").get<uint64_t>()); }

}  // namespace

std::vector<FlightGroupFinding> analyze_flight_records(const std::vector<json>& records) {
  // A group is the same on every rank by backend, name, members and instance (Note [Flight recorder]).
  struct GroupKey {
    std::string backend, name;
    int instance;
    std::vector<int> world;
    bool operator<(const GroupKey& o) const {
      return std::tie(backend, name, instance, world) < std::tie(o.backend, o.name, o.instance, o.world);
    }
  };
  std::map<int, const json*> by_rank;
  for (const json& r : records) {
    const int rank = record_world_rank(r);
    if (rank >= 0) by_rank[rank] = &r;  // else: it has no group to place it in
  }
  std::vector<GroupKey> order;
  std::map<GroupKey, std::map<int, std::pair<const json*, const json*>>> where;  // world rank -> (record, group)
  for (const auto& [rank, r] : by_rank) {
    for (const json& g : r->at("groups")) {
      GroupKey key{g.at("backend").get<std::string>(), g.at("name").get<std::string>(), g.value("instance", 0),
                   g.at("world_ranks").get<std::vector<int>>()};
      if (!where.count(key)) order.push_back(key);
      where[key][rank] = {r, &g};
    }
  }

  std::vector<FlightGroupFinding> findings;
  for (const GroupKey& key : order) {
    FlightGroupFinding f;
    f.group = key.name;
    f.backend = key.backend;
    f.size = int(key.world.size());
    bool is_world = true;
    for (int r = 0; r < f.size; ++r) is_world = is_world && key.world[size_t(r)] == r;
    const std::vector<int> world_of = is_world ? std::vector<int>{} : key.world;
    auto names = [&](const std::vector<int>& ranks) { return detail::rank_names(ranks, world_of); };

    std::vector<RankView> views(size_t(f.size));
    // Looked up once: a key holds the group's members, and comparing it per rank made a group of
    // 10^6 ranks take 10^12 steps.
    const std::map<int, std::pair<const json*, const json*>>& members = where.at(key);
    std::vector<int> no_file, no_group;  // missing ranks: without a record, with one that lacks the group
    for (int g = 0; g < f.size; ++g) {
      const int world = key.world[size_t(g)];
      auto found = members.find(world);
      if (found == members.end()) {
        f.missing.push_back(g);
        (by_rank.count(world) ? no_group : no_file).push_back(g);
        continue;
      }
      RankView& v = views[size_t(g)];
      v.record = found->second.first;
      const json& group = *found->second.second;
      const int64_t index = group.at("index").get<int64_t>();
      v.started = group.at("last_started").get<uint64_t>();
      v.through = group.at("completed_through").get<uint64_t>();
      for (const json& e : v.record->at("entries")) {
        if (e.at("group_index").get<int64_t>() != index) continue;
        const uint64_t seq = e.at("seq").get<uint64_t>();
        if (seq == 0) {
          if (e.at("state").get<std::string>() != "completed") v.p2p.push_back(&e);
          continue;
        }
        v.collectives[seq] = &e;
      }
    }
    // Note [Flight recorder], "Counters": each rank's first collective not completed is the one after
    // its completed_through; the group's is the lowest of them. Whether a rank completed, started or
    // never started it comes from its counters, never from the ring's leaving it out.
    uint64_t first = 0;
    for (const RankView& v : views) {
      if (!v.record) continue;
      first = first ? std::min(first, v.through + 1) : v.through + 1;
    }
    std::vector<std::string> parts;
    std::map<std::string, std::vector<int>> op_ranks;  // the ops named at `first`
    std::vector<std::pair<int, std::string>> later;    // what ranks that completed it do since
    bool anyone_started = false;
    for (int g = 0; g < f.size; ++g) {
      const RankView& v = views[size_t(g)];
      if (!v.record) continue;
      auto at = v.collectives.find(first);
      if (at != v.collectives.end()) {
        anyone_started = true;
        op_ranks[at->second->at("op").get<std::string>()].push_back(g);
        if (f.op.empty()) f.op = at->second->at("op").get<std::string>();
        if (at->second->at("state").get<std::string>() == "completed" || v.through >= first) f.completed.push_back(g);
        else f.waiting.push_back(g);
      } else if (v.through >= first) {
        anyone_started = true;  // its entry has left the ring; its counter says it completed
        f.completed.push_back(g);
      } else if (v.started >= first) {
        anyone_started = true;  // started, not known to have completed, and its entry is gone
        f.unknown.push_back(g);
      } else {
        f.not_started.push_back(g);
      }
    }
    const std::string head = str("group \"", f.group, "\" (", f.backend, ", ", f.size, f.size == 1 ? " rank" : " ranks", ")");
    // Where a rank stands after #first: the collective it waits in, else its last completed.
    auto stands = [&](int g) -> std::string {
      const RankView& v = views[size_t(g)];
      for (const auto& [seq, e] : v.collectives)
        if (seq > first && e->at("state").get<std::string>() != "completed")
          return str("waits in ", op_seq(*e), " (", how_long(*v.record, *e), ")");
      if (v.collectives.empty() || v.collectives.rbegin()->first < v.through)
        return str("its last completed is #", v.through, " (its record no longer holds it)");
      return str("its last completed is #", v.collectives.rbegin()->first, " ",
                 v.collectives.rbegin()->second->at("op").get<std::string>());
    };
    if (!anyone_started) {
      f.seq = 0;
      f.not_started.clear();  // every rank is past the last collective: none is behind
      const RankView* last = nullptr;  // the rank that got furthest
      for (const RankView& v : views)
        if (v.record && v.started > 0 && (!last || v.started > last->started)) last = &v;
      if (!last) {
        parts.push_back("no collective recorded");
      } else {
        auto at = last->collectives.find(last->started);
        parts.push_back(str("nothing pending: ", f.missing.empty() ? "every rank" : "every rank that left a record",
                            " completed every collective it started, up to #", last->started,
                            at != last->collectives.end() ? " " + at->second->at("op").get<std::string>() : ""));
      }
    } else {
      f.seq = first;
      f.ops_disagree = op_ranks.size() > 1;
      if (f.ops_disagree) {
        std::string which;
        for (const auto& [op, ranks] : op_ranks) which += str(which.empty() ? "" : ", ", names(ranks), " ", op);
        parts.push_back(str("the ranks disagree on collective #", first, ": ", which,
                            " (do all ranks run the same collectives in the same order?)"));
      }
      // The ranks still in it, one clause per op and state.
      std::map<std::string, std::vector<int>> in_it;
      for (int g : f.waiting) {
        const json& e = *views[size_t(g)].collectives.at(first);
        in_it[str(e.at("state").get<std::string>() == "timed_out" ? "timed out in " : "wait in ", op_seq(e))]
            .push_back(g);
      }
      for (const auto& [what, ranks] : in_it) {
        std::string clause = str(names(ranks), " ", what);
        if (ranks.size() == 1) {
          const RankView& v = views[size_t(ranks.front())];
          const json& e = *v.collectives.at(first);
          clause = str(names(ranks), " ", what.substr(0, 4) == "wait" ? "waits in " : "timed out in ", op_seq(e), " (",
                       how_long(*v.record, e), ")");
        }
        parts.push_back(clause);
      }
      if (!f.unknown.empty()) {
        // Note [Flight recorder], "Counters": started, not counted completed, and its entry is gone.
        std::map<uint64_t, std::vector<int>> by_through;
        for (int g : f.unknown) by_through[views[size_t(g)].through].push_back(g);
        for (const auto& [through, ranks] : by_through)
          parts.push_back(str(names(ranks), ": unknown (", ranks.size() == 1 ? "its record no longer holds #" :
                              "their records no longer hold #", first, "; started, and completed only through #",
                              through, ")"));
      }
      if (!f.not_started.empty()) {
        // Grouped by where they stand, so "ranks 1, 3 never started it, their last completed is #56 broadcast".
        std::map<std::string, std::vector<int>> by_stand;
        for (int g : f.not_started) by_stand[stands(g)].push_back(g);
        for (const auto& [stand, ranks] : by_stand)
          parts.push_back(str(names(ranks), " never started it, ",
                              stand.rfind("its last", 0) == 0 && ranks.size() > 1 ? "their" + stand.substr(3) : stand));
      }
      if (!f.completed.empty()) {
        std::map<std::string, std::vector<int>> by_stand;
        for (int g : f.completed) by_stand[stands(g)].push_back(g);
        for (const auto& [stand, ranks] : by_stand)
          parts.push_back(str(names(ranks), " completed it; ",
                              stand.rfind("its last", 0) == 0 && ranks.size() > 1 ? "their" + stand.substr(3) : stand));
      }
    }
    // One clause per reason, whatever the number of ranks.
    if (no_file.size() == 1)
      parts.push_back(str(names(no_file), " left no record (no rank-", key.world[size_t(no_file.front())],
                          ".json: stopped, hung or killed before it could write one)"));
    else if (!no_file.empty())
      parts.push_back(str(names(no_file), " left no record (no rank-N.json: stopped, hung or killed before they could "
                          "write one)"));
    if (!no_group.empty())
      parts.push_back(str(names(no_group), " left no record (", no_group.size() == 1 ? "its record does" : "their records do",
                          " not have the group)"));
    f.text = head + ": ";
    for (size_t i = 0; i < parts.size(); ++i) f.text += (i ? "; " : "") + parts[i];
    // Point-to-point batches are not numbered: each rank's unfinished ones, on lines of their own.
    for (int g = 0; g < f.size; ++g)
      for (const json* e : views[size_t(g)].p2p)
        f.text += str("\n  ", names({g}), " ", e->at("state").get<std::string>() == "timed_out" ? "timed out in" : "waits in",
                      " send/recv with ", names({e->value("peer", -1)}), " (", how_long(*views[size_t(g)].record, *e), ")");
    findings.push_back(std::move(f));
  }
  return findings;
}

}  // namespace booster::distributed
