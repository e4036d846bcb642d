// Which user code a crash happened in: a record of the call into a model library in progress (its
// factory, its entry point) and of the modules a library made, read by a fatal-signal handler that
// writes one line naming them before the process dies as it would have.
//
// Note [Naming the code that crashed]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A model library (Note [Model libraries] in booster/nn/model_registry.h) is a user's code running
// inside the process: a bad pointer in its factory or forward ends the run with status 139 and nothing
// said, and the user cannot tell their code from ours. So make_model keeps two records, both written
// before and read only by the handler:
//   * CrashSiteScope: the call into a library in progress (a global, so a fault on any thread, an
//     OpenMP worker of the library's op included, sees it), restored when the call returns or throws;
//   * register_crash_module: each module of a model a library made, with its label ("module 'blocks.0'
//     (MyBlock) of model "my_net" of model library 'mine' (/path/libbooster_model_mine.so)"). The
//     module being run needs no record of its own: Module::operator() already pushes a frame for it on
//     the thread's error context stack (Note [Error context]), so the handler walks that stack from
//     the innermost frame out and names the first module a library made. A fault on another thread
//     (an OpenMP worker) looks at the stack of the thread that built the model, and says "while" it
//     ran rather than "in" it.
// The handler (install_fatal_signal_reporter, SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) is
// async-signal-safe: it reads fixed arrays and string pointers that outlive their records and writes
// with write(2) only, then hands the signal on to the handler it replaced (the flight recorder's,
// OpenMPI's, or the default: a core dump and status 128 + signal), as the flight recorder chains. A
// fault the kernel raised repeats when the handler returns and reaches that handler with its own
// siginfo; a signal a process sent (abort, kill) is raised again. Its line is
//   booster: fatal signal SIGSEGV in the forward of module 'fc' (Linear) of model "crashy" of model
//   library 'crashy' (/path/libbooster_model_crashy.so); ...
// with "rank R of N: " after "booster: " under several processes (OpenMPI's rank variables). `booster
// run` passes it on with mpirun's own line on the signal, and a restart names it as its reason (the
// Relay in cli/run.cpp). The handler writes only where a record applies: other crashes are as before.
#pragma once

#include <cstddef>

namespace booster {

// While it lives, a fatal signal names `what` ("the factory of model "x" of model library 'y' (FILE)"),
// which must outlive the scope. Nested scopes restore the outer one.
class CrashSiteScope {
 public:
  explicit CrashSiteScope(const char* what);
  ~CrashSiteScope();
  CrashSiteScope(const CrashSiteScope&) = delete;
  CrashSiteScope& operator=(const CrashSiteScope&) = delete;

 private:
  const char* previous_;
};

// `module` (an nn::Module a library made) is named `label` by the handler until unregistered; the label
// must outlive the registration. Registers the calling thread as the one whose stack a fault on another
// thread consults. Past kMaxCrashModules registered modules, the rest are not named (their library's
// outer modules still are: register outer modules first).
inline constexpr size_t kMaxCrashModules = 4096;
void register_crash_module(const void* module, const char* label);
void unregister_crash_module(const void* module);

// Installs the handler for SIGSEGV, SIGBUS, SIGFPE, SIGILL and SIGABRT where it is not the current one,
// keeping the one it replaces to hand the signal on to; and an alternate signal stack for the calling
// thread when it has none, so a stack overflow in a library's forward is named too.
void install_fatal_signal_reporter();

// What the handler would write for a fault on the calling thread now, e.g. " in the forward of ...";
// "" when no record applies. Async-signal-safe; for tests and the handler. Returns the length written
// to `out` (at most `size` - 1 characters and a NUL).
size_t describe_crash_site(char* out, size_t size);

}  // namespace booster
