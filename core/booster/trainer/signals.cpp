// Note [Stopping on a signal] (signals.h).
#include "booster/trainer/signals.h"

#include <time.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>

#include "booster/common/error.h"
#include "booster/ops/ops.h"

namespace booster::trainer {

namespace {

volatile std::sig_atomic_t g_requested = 0;
volatile std::sig_atomic_t g_announce = 1;
volatile std::sig_atomic_t g_in_loop = 0;  // a training loop runs: it stops after its step
std::atomic<int> g_depth{0};               // StopOnSignal objects alive (nested: Note [Stopping on a signal])
struct sigaction g_previous_int, g_previous_term, g_previous_usr1;
// SIGHUP and the three launcher signals (Note [Signals under booster run] in cli/run.cpp), and what was
// installed for them before.
constexpr int kLauncherOffset = 4;  // SIGRTMIN + 4, + 5, + 6: clear of the few low ones libraries take
constexpr int kLauncherOriginals[] = {SIGINT, SIGTERM, SIGHUP};
volatile std::sig_atomic_t g_launcher_base = 0;
struct sigaction g_previous_more[4];
// When the first request arrived (CLOCK_MONOTONIC, ns). Copies of one request (a job's SIGTERM sent to
// every process and forwarded again by the launcher, a terminal's Ctrl-C to the process group) arrive
// within this window and are the same request; a signal after it is the user asking again.
std::atomic<int64_t> g_first_ns{0};
constexpr int64_t kSameRequestNs = 1'000'000'000;
static_assert(std::atomic<int64_t>::is_always_lock_free, "the signal handler needs a lock-free clock");

int64_t monotonic_ns() {
  timespec now{};
  ::clock_gettime(CLOCK_MONOTONIC, &now);  // async-signal-safe
  return int64_t(now.tv_sec) * 1'000'000'000 + now.tv_nsec;
}

void on_signal(int signal) {
  // booster run's stop request stands for the signal booster run got.
  if (g_launcher_base != 0 && signal >= g_launcher_base && signal < g_launcher_base + 3)
    signal = kLauncherOriginals[signal - g_launcher_base];
  if (g_requested != 0) {
    if (monotonic_ns() - g_first_ns.load() < kSameRequestNs) return;  // a copy of the same request
    // The second one: leave now. Only async-signal-safe calls here.
    const char message[] = "\nbooster: interrupted again; exiting without saving\n";
    [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, message, sizeof message - 1);
    ::_exit(128 + signal);
  }
  g_first_ns.store(monotonic_ns());
  g_requested = signal;
  if (!g_announce) return;
  if (g_in_loop) {
    const char message[] = "\nbooster: stopping after this step and saving a checkpoint (interrupt again to exit now)\n";
    [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, message, sizeof message - 1);
  } else {
    const char message[] = "\nbooster: stopping before the first step or once the last is saved (interrupt again to "
                           "exit now)\n";
    [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, message, sizeof message - 1);
  }
}

}  // namespace

StopOnSignal::StopOnSignal(bool announce) {
  if (g_depth.fetch_add(1) > 0) return;  // nested: the outer one's handlers and request stand
  g_requested = 0;
  g_announce = announce;
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // a blocking read or collective goes on; the loop checks after the step
  sigaction(SIGINT, &action, &g_previous_int);
  sigaction(SIGTERM, &action, &g_previous_term);
  sigaction(SIGUSR1, &action, &g_previous_usr1);
  g_launcher_base = SIGRTMIN + kLauncherOffset;
  for (int k = 0; k < 4; ++k) sigaction(k == 0 ? SIGHUP : g_launcher_base + k - 1, &action, &g_previous_more[k]);
}

StopOnSignal::~StopOnSignal() {
  if (g_depth.fetch_sub(1) > 1) return;
  sigaction(SIGINT, &g_previous_int, nullptr);
  sigaction(SIGTERM, &g_previous_term, nullptr);
  sigaction(SIGUSR1, &g_previous_usr1, nullptr);
  for (int k = 0; k < 4; ++k) sigaction(k == 0 ? SIGHUP : g_launcher_base + k - 1, &g_previous_more[k], nullptr);
  g_in_loop = 0;
}

void StopOnSignal::set_in_loop(bool in_loop) { g_in_loop = in_loop; }

int StopOnSignal::requested() const { return g_requested; }

int StopOnSignal::agreed(distributed::ProcessGroup& group) const {
  if (group.size() == 1) return requested();
  Tensor flag = full({1}, double(requested()), DType::Float32, group.device());
  group.all_reduce(flag, distributed::ReduceOp::Max);
  return int(flag.item());
}

int StopOnSignal::launcher_signal(int original) {
  for (int k = 0; k < 3; ++k)
    if (kLauncherOriginals[k] == original) return SIGRTMIN + kLauncherOffset + k;
  return 0;
}

const char* StopOnSignal::signal_name(int signal) {
  switch (signal) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGHUP: return "SIGHUP";
    case SIGUSR1: return "SIGUSR1";
    default: return "a signal";
  }
}

}  // namespace booster::trainer
