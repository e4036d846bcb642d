// The crash-site records and the fatal-signal handler that names them (Note [Naming the code that
// crashed] in fatal_signal.h).
#include "booster/common/fatal_signal.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "booster/common/error_context.h"

namespace booster {

namespace {

std::atomic<const char*> g_site{nullptr};  // CrashSiteScope's call in progress

struct CrashModule {
  std::atomic<const void*> module{nullptr};  // null: a free slot
  std::atomic<const char*> label{nullptr};
};
CrashModule g_modules[kMaxCrashModules];
std::mutex g_modules_mutex;                              // registration only; the handler reads without it
std::atomic<const ErrorContextStack*> g_host_stack{nullptr};  // the thread that registered the modules

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
constexpr size_t kNumSignals = sizeof kSignals / sizeof kSignals[0];
struct sigaction g_previous[kNumSignals];
std::mutex g_install_mutex;
std::atomic<bool> g_in_handler{false};
char g_rank_prefix[64] = {};  // "rank R of N: " under several processes, read from the environment

const char* signal_name(int signal) {
  switch (signal) {
    case SIGSEGV: return "SIGSEGV";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGILL: return "SIGILL";
    case SIGABRT: return "SIGABRT";
    default: return "a fatal signal";
  }
}

// Appends `s` to out[0, size - 1) at *at; async-signal-safe.
void append(char* out, size_t size, size_t* at, const char* s) {
  for (; s && *s && *at + 1 < size; ++s) out[(*at)++] = *s;
  out[*at] = '\0';
}

const char* label_of(const void* module) {
  for (const CrashModule& m : g_modules)
    if (m.module.load(std::memory_order_acquire) == module) return m.label.load(std::memory_order_acquire);
  return nullptr;
}

// The label of the innermost module on `stack` that a library made, or null.
const char* innermost_library_module(const ErrorContextStack* stack) {
  if (stack == nullptr) return nullptr;
  for (size_t i = stack->depth < kMaxErrorContextDepth ? stack->depth : kMaxErrorContextDepth; i-- > 0;)
    if (stack->frames[i].kind == ErrorContextFrame::Kind::Module)
      if (const char* label = label_of(stack->frames[i].what)) return label;
  return nullptr;
}

void write_text(const char* s) {
  for (size_t n = std::strlen(s); n > 0;) {
    const ssize_t w = ::write(STDERR_FILENO, s, n);
    if (w <= 0) return;
    s += w, n -= size_t(w);
  }
}

void on_fatal_signal(int signal, siginfo_t* info, void*) {
  const int saved_errno = errno;
  size_t slot = 0;
  while (slot < kNumSignals && kSignals[slot] != signal) ++slot;
  if (g_in_handler.exchange(true) || slot == kNumSignals) {
    // A second fault while reporting the first: the default action, at once.
    struct sigaction fallback {};
    fallback.sa_handler = SIG_DFL;
    sigemptyset(&fallback.sa_mask);
    sigaction(signal, &fallback, nullptr);
    if (info == nullptr || info->si_code <= 0) raise(signal);
    errno = saved_errno;
    return;
  }
  char site[1024];
  if (describe_crash_site(site, sizeof site) > 0) {
    write_text("booster: ");
    write_text(g_rank_prefix);
    write_text("fatal signal ");
    write_text(signal_name(signal));
    write_text(site);
    write_text("; the fault is in that library's code or in what it called (run the command under gdb for a "
               "backtrace)\n");
  }
  // Hand it on (Note [Naming the code that crashed]). g_in_handler stays set: a handler that chains
  // back here (ours installed again above one that had ours below it) meets the default action.
  sigaction(signal, &g_previous[slot], nullptr);
  if (info == nullptr || info->si_code <= 0) raise(signal);
  errno = saved_errno;
}

bool is_ours(const struct sigaction& a) {
  return (a.sa_flags & SA_SIGINFO) != 0 && a.sa_sigaction == &on_fatal_signal;
}

}  // namespace

CrashSiteScope::CrashSiteScope(const char* what) : previous_(g_site.exchange(what)) {}
CrashSiteScope::~CrashSiteScope() { g_site.store(previous_); }

void register_crash_module(const void* module, const char* label) {
  if (module == nullptr || label == nullptr) return;
  std::lock_guard<std::mutex> lock(g_modules_mutex);
  g_host_stack.store(&error_context_stack());
  for (CrashModule& m : g_modules)
    if (m.module.load() == nullptr) {
      m.label.store(label, std::memory_order_release);
      m.module.store(module, std::memory_order_release);
      return;
    }
}

void unregister_crash_module(const void* module) {
  if (module == nullptr) return;
  std::lock_guard<std::mutex> lock(g_modules_mutex);
  for (CrashModule& m : g_modules)
    if (m.module.load() == module) {
      m.module.store(nullptr, std::memory_order_release);
      m.label.store(nullptr, std::memory_order_release);
    }
}

size_t describe_crash_site(char* out, size_t size) {
  if (out == nullptr || size == 0) return 0;
  size_t at = 0;
  out[0] = '\0';
  if (const char* site = g_site.load()) {
    append(out, size, &at, " in ");
    append(out, size, &at, site);
    return at;
  }
  const ErrorContextStack* own = &error_context_stack();
  if (const char* label = innermost_library_module(own)) {
    append(out, size, &at, " in the forward of ");
    append(out, size, &at, label);
  } else if (const ErrorContextStack* host = g_host_stack.load(); host != own) {
    if (const char* hosts = innermost_library_module(host)) {
      append(out, size, &at, " while the forward of ");
      append(out, size, &at, hosts);
      append(out, size, &at, " ran");
    }
  }
  return at;
}

void install_fatal_signal_reporter() {
  std::lock_guard<std::mutex> lock(g_install_mutex);
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (rank && size && std::strlen(rank) < 20 && std::strlen(size) < 20 && std::strcmp(size, "1") != 0) {
    size_t at = 0;
    for (const char* part : {"rank ", rank, " of ", size, ": "}) append(g_rank_prefix, sizeof g_rank_prefix, &at, part);
  }
  // A stack overflow leaves no stack for the handler: give the first installing thread (the one that
  // runs the model) one of its own, unless it has one.
  static char alternate[64 * 1024];
  static bool alternate_given = false;
  stack_t current {};
  if (!alternate_given && sigaltstack(nullptr, &current) == 0 && (current.ss_flags & SS_DISABLE) != 0) {
    stack_t ours {};
    ours.ss_sp = alternate;
    ours.ss_size = sizeof alternate;
    alternate_given = sigaltstack(&ours, nullptr) == 0;
  }
  struct sigaction action {};
  action.sa_sigaction = &on_fatal_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  for (size_t i = 0; i < kNumSignals; ++i) {
    struct sigaction now {};
    sigaction(kSignals[i], nullptr, &now);
    if (!is_ours(now)) sigaction(kSignals[i], &action, &g_previous[i]);
  }
}

}  // namespace booster
