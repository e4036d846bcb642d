// `booster run -n N [mpirun options] -- COMMAND ...`: starts COMMAND as N processes with mpirun, the
// way `accelerate launch` or `colossalai run` start a distributed run.
//
// Note [booster run]
// ~~~~~~~~~~~~~~~~~~
// Launching is mpirun's job (Note [Process groups]); this command only fills in what every run on one
// machine needs and users keep forgetting:
//  * -np N, and --oversubscribe when N is more than the cores this process may use (OpenMPI refuses to
//    start more ranks than slots otherwise);
//  * OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 when running as root (containers, CI),
//    which OpenMPI otherwise refuses;
//  * OPENBLAS_NUM_THREADS and OMP_NUM_THREADS = cores / N (at least 1), so N ranks do not each start a
//    thread per core and fight over them; a value the user already exported wins. They are exported to
//    the ranks with -x (OpenMPI's option), so they reach ranks on other hosts too.
// Options between -n and `--` go to mpirun unchanged (e.g. --hostfile FILE, --bind-to none). A command
// that starts with `booster` runs this very executable, so `booster run -n 2 -- booster train ...` uses
// the same build. mpirun is looked up as $BOOSTER_MPIRUN, then `mpirun` on PATH, then the MPIEXEC_EXECUTABLE
// CMake found at build time. --dry-run prints the command line instead of running it. Ctrl-C and SIGTERM
// stop a training run cleanly on every rank (Note [Signals under booster run]).
#include <fcntl.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "booster/common/error.h"
#include "commands.h"

namespace booster::cli {

namespace fs = std::filesystem;

namespace {

constexpr const char* kRunUsage =
    "usage: booster run -n N [--dry-run] [mpirun options] -- COMMAND [ARGS ...]\n"
    "\n"
    "Starts COMMAND as N processes with mpirun, e.g.\n"
    "  booster run -n 2 -- booster train --config examples/configs/synthetic_ddp.json\n"
    "\n"
    "It adds -np N, --oversubscribe when N exceeds the cores, OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1 as root,\n"
    "and OPENBLAS_NUM_THREADS = OMP_NUM_THREADS = cores / N unless already set. Options before `--` other\n"
    "than -n and --dry-run go to mpirun unchanged; a COMMAND `booster` is this executable.\n"
    "\n"
    "options:\n"
    "  -n, --nproc N   number of processes (ranks)\n"
    "  --dry-run       print the environment and the mpirun command line instead of running it\n"
    "  -h, --help      show this help\n";

// The cores this process may run on (its affinity mask: a container's or taskset's limit counts).
int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

std::string find_on_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  if (!path) return {};
  std::string dirs = path;
  size_t start = 0;
  while (start <= dirs.size()) {
    const size_t end = std::min(dirs.find(':', start), dirs.size());
    const fs::path candidate = fs::path(dirs.substr(start, end - start)) / name;
    if (end > start && ::access(candidate.c_str(), X_OK) == 0) return candidate.string();
    start = end + 1;
  }
  return {};
}

std::string find_mpirun() {
  if (const char* forced = std::getenv("BOOSTER_MPIRUN"); forced && *forced) return forced;
  if (std::string found = find_on_path("mpirun"); !found.empty()) return found;
#ifdef BOOSTER_MPIEXEC
  if (::access(BOOSTER_MPIEXEC, X_OK) == 0) return BOOSTER_MPIEXEC;
#endif
  BOOSTER_FAIL(DistributedError, "booster run: mpirun was not found on PATH; install OpenMPI (Debian: openmpi-bin) or set "
               "BOOSTER_MPIRUN to its path");
}

// Quotes for a POSIX shell, only where needed, so a dry run can be pasted.
std::string shell_quote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-+=/.,:@%") ==
                        std::string::npos)
    return s;
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

int parse_count(const std::string& text) {
  size_t used = 0;
  long n = 0;
  try {
    n = std::stol(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  BOOSTER_CHECK(used == text.size() && n >= 1 && n <= 4096, ConfigError, "booster run: -n is '", text,
                "'; expected a number of processes from 1 to 4096");
  return int(n);
}

// What the command line and this machine give (gathered once, so plan_launch is a pure function).
struct LaunchContext {
  std::string mpirun;  // the launcher's path
  std::string self;    // this executable, for a command `booster`
  int cores = 1;
  bool as_root = false;
  std::set<std::string> user_env;  // thread variables the user exported (left alone)
};

// What will be started: environment additions and mpirun's argv.
struct LaunchPlan {
  bool help = false;
  bool dry_run = false;
  int nproc = 0;
  std::vector<std::pair<std::string, std::string>> env;
  std::vector<std::string> argv;
};

LaunchPlan plan_launch(const std::vector<std::string>& args, const LaunchContext& context) {
  LaunchPlan plan;
  std::vector<std::string> mpirun_options;
  size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") break;
    if (a == "-h" || a == "--help") {
      plan.help = true;
      return plan;
    }
    if (a == "--dry-run") {
      plan.dry_run = true;
    } else if (a == "-n" || a == "--nproc" || a == "-np") {
      BOOSTER_CHECK(i + 1 < args.size(), ConfigError, "booster run: ", a, " needs a number of processes");
      plan.nproc = parse_count(args[++i]);
    } else if (a.rfind("--nproc=", 0) == 0) {
      plan.nproc = parse_count(a.substr(8));
    } else {
      mpirun_options.push_back(a);
    }
  }
  BOOSTER_CHECK(plan.nproc > 0, ConfigError, "booster run: -n N is missing (see booster run --help)");
  BOOSTER_CHECK(i < args.size() && i + 1 < args.size(), ConfigError,
                "booster run: no command after `--`; e.g. booster run -n ", plan.nproc,
                " -- booster train --config FILE");
  std::vector<std::string> command(args.begin() + long(i) + 1, args.end());
  if (command.front() == "booster") command.front() = context.self;

  const int threads = std::max(1, context.cores / plan.nproc);
  if (context.as_root) {
    plan.env.emplace_back("OMPI_ALLOW_RUN_AS_ROOT", "1");
    plan.env.emplace_back("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
  }
  std::vector<std::string> exported;
  for (const char* name : {"OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"}) {
    if (!context.user_env.count(name)) plan.env.emplace_back(name, std::to_string(threads));
    exported.push_back(name);
  }

  plan.argv = {context.mpirun, "-np", std::to_string(plan.nproc)};
  if (plan.nproc > context.cores) plan.argv.push_back("--oversubscribe");
  for (const std::string& name : exported) {
    plan.argv.push_back("-x");
    plan.argv.push_back(name);
  }
  plan.argv.insert(plan.argv.end(), mpirun_options.begin(), mpirun_options.end());
  plan.argv.insert(plan.argv.end(), command.begin(), command.end());
  return plan;
}

// Note [Signals under booster run]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// mpirun answers SIGINT and SIGTERM by killing the job: SIGTERM to every rank a second later and
// SIGKILL a second after that, too soon for the ranks to finish a step and save (Note [Stopping on a
// signal]). It passes SIGUSR1 on to every rank, though. So booster run starts mpirun as its child, in a
// process group of its own (a terminal's Ctrl-C then reaches booster run alone), and turns the first
// SIGINT or SIGTERM into SIGUSR1 for mpirun to forward: every rank stops after the same step and saves.
// A second one sends mpirun SIGTERM, which ends the job at once. booster run exits with mpirun's status,
// or 128 + the signal it got when the job stopped on it. The child's stdin, when it is a terminal, is
// /dev/null: a process outside the terminal's foreground group that read it would be stopped.
volatile std::sig_atomic_t g_stop_signal = 0;
volatile std::sig_atomic_t g_signals = 0;

void on_stop_signal(int signal) {
  if (g_stop_signal == 0) g_stop_signal = signal;
  g_signals = g_signals + 1;
}

int supervise(const std::vector<char*>& argv) {
  const pid_t child = ::fork();
  BOOSTER_CHECK(child >= 0, DistributedError, "booster run: cannot start '", argv[0], "': fork: ", std::strerror(errno));
  if (child == 0) {
    ::setpgid(0, 0);
    if (::isatty(STDIN_FILENO)) {
      const int null = ::open("/dev/null", O_RDONLY);
      if (null >= 0) ::dup2(null, STDIN_FILENO);
    }
    ::execvp(argv[0], argv.data());
    std::fprintf(stderr, "booster: error: booster run: cannot start '%s': %s\n", argv[0], std::strerror(errno));
    ::_exit(kExitRuntimeError);
  }
  ::setpgid(child, child);  // as the child does: whichever runs first
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  int forwarded = 0;  // signals passed on so far
  int status = 0;
  while (true) {
    const pid_t done = ::waitpid(child, &status, 0);
    if (done == child) break;
    if (done < 0 && errno != EINTR)
      BOOSTER_FAIL(DistributedError, "booster run: waiting for mpirun: ", std::strerror(errno));
    for (; forwarded < g_signals; ++forwarded) {
      if (forwarded == 0) {
        std::fprintf(stderr, "\nbooster run: %s: asking every rank to stop after this step and save "
                     "(again to end the job at once)\n", g_stop_signal == SIGINT ? "SIGINT" : "SIGTERM");
        ::kill(child, SIGUSR1);
      } else {
        ::kill(child, SIGTERM);
      }
    }
  }
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  return code != 0 && g_stop_signal != 0 ? 128 + g_stop_signal : code;
}

}  // namespace

int run(const std::vector<std::string>& args) {
  LaunchContext context;
  context.cores = usable_cores();
  context.as_root = ::geteuid() == 0;
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  context.self = ec ? "booster" : self.string();
  for (const char* name : {"OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"})
    if (std::getenv(name)) context.user_env.insert(name);
  // Only look for mpirun when it will be needed (--help works without it).
  bool wants_help = false;
  for (const std::string& a : args) {
    if (a == "--") break;
    wants_help = wants_help || a == "-h" || a == "--help";
  }
  if (wants_help) {
    std::cout << kRunUsage;
    return kExitOk;
  }
  context.mpirun = find_mpirun();
  const LaunchPlan plan = plan_launch(args, context);

  if (plan.dry_run) {
    std::string line;
    for (const auto& [name, value] : plan.env) line += name + "=" + shell_quote(value) + " ";
    for (size_t k = 0; k < plan.argv.size(); ++k) line += (k ? " " : "") + shell_quote(plan.argv[k]);
    std::cout << line << "\n";
    return kExitOk;
  }
  for (const auto& [name, value] : plan.env) ::setenv(name.c_str(), value.c_str(), /*overwrite=*/1);
  std::vector<char*> argv;
  for (const std::string& a : plan.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::cout.flush();
  std::cerr.flush();
  return supervise(argv);
}

}  // namespace booster::cli
