// `booster run -n N [options] -- COMMAND ...`: starts COMMAND as N processes with mpirun, the way
// `accelerate launch` or `colossalai run` start a distributed run.
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
//    the ranks with -x (OpenMPI's option), so they reach ranks on other hosts too;
//  * --mixed-precision NAME and --plugin NAME export BOOSTER_MIXED_PRECISION and BOOSTER_PLUGIN the same
//    way, which `booster train` and BoosterConfig::from_env() read (Note [Switching by launcher] in
//    booster/config/booster_sections.cpp); the names are checked here, once, before anything starts.
// Only the options the usage lists are taken before `--`: an unknown one is a usage error, not an mpirun
// option that silently changes how the job fails (--timeout); --hostfile and --bind-to are passed
// on, anything else of mpirun's with --mpirun-arg, one word each. A command that starts with `booster`
// runs this very executable, so `booster run -n 2 -- booster train ...` uses the same build. mpirun is
// looked up as $BOOSTER_MPIRUN, then `mpirun` on PATH, then the MPIEXEC_EXECUTABLE CMake found at build
// time. --dry-run prints the command line instead of running it. Ctrl-C, SIGTERM and SIGHUP stop a
// training run cleanly on every rank (Note [Signals under booster run]); what the job prints comes
// through booster run (Note [What booster run prints]). --max-restarts restarts a failed job
// (Note [Restarting a failed job]). --hostfile is read here too: a malformed one, or -n beyond the
// slots it lists, is refused before mpirun starts (Note [Hostfiles under booster run] in hostfile.h).
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/random.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "booster/common/error.h"
#include "booster/common/sha256.h"
#include "booster/config/config.h"
#include "booster/trainer/signals.h"
#include "commands.h"
#include "hostfile.h"

namespace booster::cli {

namespace fs = std::filesystem;

namespace {

constexpr const char* kRunUsage =
    "usage: booster run -n N [--mixed-precision NAME] [--plugin NAME] [--hostfile FILE] [--bind-to POLICY]\n"
    "                   [--mpirun-arg ARG ...] [--max-restarts K [--min-processes M]] [--dry-run]\n"
    "                   -- COMMAND [ARGS ...]\n"
    "\n"
    "Starts COMMAND as N processes with mpirun, e.g.\n"
    "  booster run -n 2 -- booster train --config examples/configs/fashion_mnist_ddp.json\n"
    "  booster run -n 2 --mixed-precision bf16 --plugin ddp -- my_program   # BoosterConfig::from_env()\n"
    "\n"
    "It adds -np N, --oversubscribe when N exceeds the cores, OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1 as root,\n"
    "and OPENBLAS_NUM_THREADS = OMP_NUM_THREADS = cores / N unless already set; a COMMAND `booster` is this\n"
    "executable. Ctrl-C, SIGTERM or SIGHUP asks every rank to stop after the same step and save; a second\n"
    "one ends the job at once. An error every rank reports is printed once.\n"
    "\n"
    "options (only these go before `--`):\n"
    "  -n, --nproc N            number of processes (ranks)\n"
    "  --mixed-precision NAME   every process gets BOOSTER_MIXED_PRECISION=NAME: the strategy of booster\n"
    "                           train (as its --mixed-precision) and of BoosterConfig::from_env()\n"
    "                           (`booster precisions` lists them)\n"
    "  --plugin NAME            every process gets BOOSTER_PLUGIN=NAME: the parallel plugin, likewise\n"
    "                           (`booster plugins` lists them)\n"
    "  --hostfile FILE          the machines to start the processes on, a line `HOST slots=N` each (mpirun\n"
    "                           --hostfile); -n must not exceed the slots unless oversubscribing is asked\n"
    "                           for (--mpirun-arg --oversubscribe); read again at each restart\n"
    "  --bind-to POLICY         none, core, socket, ...: how processes are bound to cores (mpirun --bind-to)\n"
    "  --mpirun-arg ARG         pass ARG to mpirun unchanged; once per word, e.g. --mpirun-arg --tag-output\n"
    "  --max-restarts K         restart the job when it fails at run time (a rank died, a collective timed\n"
    "                           out, a non-zero exit but 2), at most K times; booster train resumes from the\n"
    "                           newest checkpoint (--resume latest). Default 0\n"
    "  --min-processes M        when fewer than N slots are left at a restart, restart on as few as M\n"
    "                           processes, raising data.batch_size to keep the global batch. Default N\n"
    "  --dry-run                print the environment and the mpirun command line instead of running it\n"
    "  -h, --help               show this help\n";

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

int parse_count(const std::string& text, const char* option = "-n", long lowest = 1,
                const char* what = "a number of processes") {
  size_t used = 0;
  long n = 0;
  try {
    n = std::stol(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  BOOSTER_CHECK(used == text.size() && n >= lowest && n <= 4096, ConfigError, "booster run: ", option, " is '", text,
                "'; expected ", what, " from ", lowest, " to 4096");
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
  int max_restarts = 0;
  int min_processes = 0;  // --min-processes (0: not given, i.e. nproc)
  std::string mixed_precision, plugin;  // --mixed-precision, --plugin ("": not given)
  std::vector<std::pair<std::string, std::string>> env;
  std::vector<std::string> argv;
  std::string program;  // the command's first word (`booster` already replaced by this executable)
  std::vector<std::string> mpirun_options;  // --hostfile, --bind-to, --mpirun-arg
  std::string hostfile;                     // --hostfile's path ("": none)
  std::vector<std::string> command;         // after `--`, `booster` replaced
};

// The options before `--`, as the usage lists them; each but --dry-run takes a value.
const std::vector<std::string> kRunOptions = {"-n", "--nproc", "--mixed-precision", "--plugin", "--hostfile",
                                              "--bind-to", "--mpirun-arg", "--max-restarts", "--min-processes",
                                              "--dry-run", "--help"};

// A word before `--` that is none of kRunOptions: a usage error naming it (Note [booster run]).
[[noreturn]] void refuse_option(const std::string& word, int nproc) {
  if (word.empty() || word[0] != '-')
    BOOSTER_FAIL(ConfigError, "booster run: '", word, "' comes before `--`; the command goes after it, e.g. booster run -n ",
                 std::max(nproc, 2), " -- booster train --config FILE");
  std::string msg = "booster run: unknown option '" + word + "'";
  if (auto guess = config::nearest(word.substr(0, word.find('=')), kRunOptions)) msg += " (did you mean '" + *guess + "'?)";
  BOOSTER_FAIL(ConfigError, msg, "; before `--` booster run takes -n N, --mixed-precision NAME, --plugin NAME, ",
               "--hostfile FILE, --bind-to POLICY, --mpirun-arg ARG, --max-restarts K, --min-processes M and ",
               "--dry-run (see booster run --help); give an ",
               "option of mpirun's with --mpirun-arg, one word each: --mpirun-arg ", word);
}

// Fills plan.env and plan.argv to start plan.command as `nproc` processes.
void fill_launch(LaunchPlan& plan, const LaunchContext& context, int nproc) {
  plan.env.clear();
  const int threads = std::max(1, context.cores / nproc);
  if (context.as_root) {
    plan.env.emplace_back("OMPI_ALLOW_RUN_AS_ROOT", "1");
    plan.env.emplace_back("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
  }
  std::vector<std::string> exported;
  for (const char* name : {"OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"}) {
    if (!context.user_env.count(name)) plan.env.emplace_back(name, std::to_string(threads));
    exported.push_back(name);
  }
  // The launcher's choices (Note [Switching by launcher]): set, unlike the thread counts, even when the
  // user exported others, since they were asked for on this command line.
  for (const auto& [variable, value] : {std::pair{kMixedPrecisionVariable, plan.mixed_precision},
                                        std::pair{kPluginVariable, plan.plugin}}) {
    if (value.empty()) continue;
    plan.env.emplace_back(variable, value);
    exported.push_back(variable);
  }

  plan.argv = {context.mpirun, "-np", std::to_string(nproc)};
  // A hostfile's slots are mpirun's count, not this machine's cores (Note [Hostfiles under booster run]).
  if (nproc > context.cores && plan.hostfile.empty()) plan.argv.push_back("--oversubscribe");
  // mpirun passes these stop requests on to every rank (Note [Signals under booster run]).
  std::string forwarded;
  for (const int signal : {SIGINT, SIGTERM, SIGHUP})
    forwarded += (forwarded.empty() ? "" : ",") + std::to_string(trainer::StopOnSignal::launcher_signal(signal));
  plan.argv.insert(plan.argv.end(), {"--mca", "ess_base_forward_signals", forwarded});
  // A job restarted when a rank dies ends at once (Note [Restarting a failed job]).
  if (plan.max_restarts > 0) plan.argv.insert(plan.argv.end(), {"--mca", "odls_base_sigkill_timeout", "0"});
  for (const std::string& name : exported) {
    plan.argv.push_back("-x");
    plan.argv.push_back(name);
  }
  plan.argv.insert(plan.argv.end(), plan.mpirun_options.begin(), plan.mpirun_options.end());
  plan.argv.insert(plan.argv.end(), plan.command.begin(), plan.command.end());
}

LaunchPlan plan_launch(const std::vector<std::string>& args, const LaunchContext& context) {
  LaunchPlan plan;
  std::vector<std::string>& mpirun_options = plan.mpirun_options;
  bool min_given = false;
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
      continue;
    }
    // An option with a value: `--name value` or `--name=value`.
    std::string name = a, value;
    const size_t equals = a.find('=');
    const bool inline_value = a.rfind("--", 0) == 0 && equals != std::string::npos;
    if (inline_value) name = a.substr(0, equals);
    if (name == "-np") name = "-n";  // mpirun's spelling
    if (name == "--nproc") name = "-n";
    if (std::find(kRunOptions.begin(), kRunOptions.end(), name) == kRunOptions.end() || name == "--help" ||
        name == "--dry-run")
      refuse_option(a, plan.nproc);
    if (inline_value) {
      value = a.substr(equals + 1);
    } else {
      BOOSTER_CHECK(i + 1 < args.size() && args[i + 1] != "--", ConfigError, "booster run: ", a, " needs a value",
                    name == "-n" ? " (a number of processes)" : "");
      value = args[++i];
    }
    if (name == "-n") {
      plan.nproc = parse_count(value);
    } else if (name == "--max-restarts") {
      plan.max_restarts = parse_count(value, "--max-restarts", 0, "a number of restarts");
    } else if (name == "--min-processes") {
      plan.min_processes = parse_count(value, "--min-processes");
      min_given = true;
    } else if (name == "--mixed-precision") {
      plan.mixed_precision = value;
    } else if (name == "--plugin") {
      plan.plugin = value;
    } else if (name == "--mpirun-arg") {
      mpirun_options.push_back(value);
    } else {  // --hostfile, --bind-to: mpirun's own options of that name
      if (name == "--hostfile") plan.hostfile = value;
      mpirun_options.push_back(name);
      mpirun_options.push_back(value);
    }
  }
  BOOSTER_CHECK(plan.nproc > 0, ConfigError, "booster run: -n N is missing (see booster run --help)");
  BOOSTER_CHECK(i < args.size() && i + 1 < args.size(), ConfigError,
                "booster run: no command after `--`; e.g. booster run -n ", plan.nproc,
                " -- booster train --config FILE");
  BOOSTER_CHECK(!min_given || plan.min_processes <= plan.nproc, ConfigError, "booster run: --min-processes ",
                plan.min_processes, " is more than -n ", plan.nproc, "; expected at most the processes it starts with");
  if (!min_given) plan.min_processes = plan.nproc;
  plan.command.assign(args.begin() + long(i) + 1, args.end());
  if (plan.command.front() == "booster") plan.command.front() = context.self;
  plan.program = plan.command.front();
  fill_launch(plan, context, plan.nproc);
  return plan;
}

// Note [Signals under booster run]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// mpirun answers SIGINT, SIGTERM and SIGHUP by killing the job: SIGTERM to every rank a second later and
// SIGKILL a second after that, too soon for the ranks to finish a step and save (Note [Stopping on a
// signal]). It passes on the signals its ess_base_forward_signals parameter lists, though. So booster
// run starts mpirun as its child, in a process group of its own (a terminal's Ctrl-C then reaches
// booster run alone), and turns the first SIGINT, SIGTERM or SIGHUP into the real-time signal
// StopOnSignal::launcher_signal gives for it, which mpirun forwards to every rank and the rank takes as
// the original: every rank stops after the same step, saves, and says "stopped by SIGINT", as one
// process would. A second one sends mpirun SIGTERM, which ends the job at once. booster run exits with
// mpirun's status, or 128 + the signal it got when the job stopped on it. The child's stdin, when it is
// a terminal, is /dev/null: a process outside the terminal's foreground group that read it would be
// stopped.
volatile std::sig_atomic_t g_stop_signal = 0;
volatile std::sig_atomic_t g_signals = 0;

void on_stop_signal(int signal) {
  if (g_stop_signal == 0) g_stop_signal = signal;
  g_signals = g_signals + 1;
}

const char* stop_signal_name(int signal) {
  switch (signal) {
    case SIGINT: return "Ctrl-C (SIGINT)";
    case SIGTERM: return "SIGTERM";
    case SIGHUP: return "SIGHUP";
    default: return "a signal";
  }
}

// Note [What booster run prints]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// mpirun copies every rank's stdout and stderr to its own and adds banners of its own. booster run
// reads both through pipes and passes them on as they come, except:
//  * an error several ranks report alike ("booster: rank R of N: error: MSG", Note [Errors of several
//    processes] in main.cpp) is printed once, the first copy: a config mistake that every rank makes is
//    one line, as it is for one process. Different errors each keep their own line;
//  * mpirun's banners about a rank's non-zero exit ("Primary job terminated normally, but ...", "mpirun
//    detected that one or more processes exited with non-zero status ...", MPI_ABORT's and their
//    "N more processes have sent help message" lines) when the command is booster, whose ranks said why
//    on lines of their own, or when a stop was asked for (the ranks then exit 128 + the signal on
//    purpose); and its "Forwarding signal" line for the stop request booster run sent. Every other
//    banner (a rank killed by a signal, a program not found) passes;
//  * stdout is copied whole. When it cannot be written (a full disk, a closed pipe) booster run says so
//    on stderr once, goes on reading the job's output so the job is not blocked, and exits 1 where the
//    job succeeded: a lost summary is a failed run, as it is for one process.
// A line is held back only while it may still be one of those (it starts like one and its newline has
// not come); any other is passed on at once, so a progress bar's redraw is not delayed.
class Relay {
 public:
  explicit Relay(bool booster_command) : booster_command_(booster_command) {}

  void stop_requested() { stop_requested_ = true; }
  bool stdout_failed() const { return stdout_error_ != 0; }

  void out(const char* data, size_t n) {
    if (stdout_error_ != 0) return;
    if (const int error = write_all(STDOUT_FILENO, data, n); error != 0) {
      stdout_error_ = error;
      err_line(str("booster run: error: cannot write the job's output to stdout (", std::strerror(error),
                   "); the job goes on, its output is lost\n"));
    }
  }

  // The first error line the job printed (a rank's "fatal signal" line naming the model library that
  // crashed counts: Note [Naming the code that crashed] in booster/common/fatal_signal.h), else
  // mpirun's line about a rank that died of a signal ("": neither): the reason a restart names (Note
  // [Restarting a failed job]).
  std::string failure() const { return first_error_.empty() ? died_ : first_error_; }

  void err(const char* data, size_t n) {
    scan(data, n);
    for (size_t i = 0; i < n;) {
      const char* newline = static_cast<const char*>(std::memchr(data + i, '\n', n - i));
      const size_t end = newline ? size_t(newline - data) + 1 : n;
      if (passing_) {
        write_all(STDERR_FILENO, data + i, end - i);
        passing_ = newline == nullptr;
      } else {
        pending_.append(data + i, end - i);
        if (newline) {
          std::string line;
          line.swap(pending_);
          take_line(line);
        } else if (!in_banner_ && !may_be_held(pending_)) {
          err_line(pending_);
          pending_.clear();
          passing_ = true;
        }
      }
      i = end;
    }
  }

  // The job has ended: whatever is held is passed on.
  void finish() {
    err_line(banner_ + pending_);
    banner_.clear();
    pending_.clear();
    in_banner_ = passing_ = false;
  }

 private:
  static constexpr size_t kRuleLength = 74;   // OpenMPI's banners open and close with a line of dashes
  static constexpr int kMaxBannerLines = 40;  // a longer "banner" is a program's own dashes: passed on

  static int write_all(int fd, const char* data, size_t n) {
    while (n > 0) {
      const ssize_t written = ::write(fd, data, n);
      if (written < 0) {
        if (errno == EINTR) continue;
        return errno;
      }
      data += written;
      n -= size_t(written);
    }
    return 0;
  }
  static void err_line(const std::string& text) { write_all(STDERR_FILENO, text.data(), text.size()); }
  static bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }
  static bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

  // Keeps the lines that explain a failure, whether passed on or dropped.
  void scan(const char* data, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      if (data[i] == '\r') {  // a progress bar's redraw: only what follows counts
        scanned_.clear();
      } else if (data[i] != '\n') {
        if (scanned_.size() < 2000) scanned_ += data[i];
      } else {
        const bool fatal_signal = starts_with(scanned_, "booster: ") && contains(scanned_, ": fatal signal ") &&
                                  contains(scanned_, " of model library '");
        if (first_error_.empty() && (contains(scanned_, "error:") || fatal_signal)) first_error_ = scanned_;
        if (died_.empty() && contains(scanned_, "exited on signal")) died_ = scanned_;
        scanned_.clear();
      }
    }
  }
  static bool is_rule(const std::string& line) {
    return line.size() == kRuleLength + 1 && line.find_first_not_of('-') == kRuleLength;  // dashes, then '\n'
  }

  // Whether a line that starts with `partial` may be one that is dropped.
  static bool may_be_held(const std::string& partial) {
    for (const std::string prefix : {"-", "mpirun: ", "[", "booster: rank "})
      if (starts_with(partial, prefix) || starts_with(prefix, partial)) return true;
    return false;
  }

  bool drop_banner(const std::string& banner) const {
    const bool explained = booster_command_ || stop_requested_;
    if (contains(banner, "terminated normally, but") || contains(banner, "exited with non-zero status")) return explained;
    if (contains(banner, "MPI_ABORT was invoked")) return booster_command_;
    return false;
  }

  // One whole line of mpirun's stderr, its newline included.
  void take_line(const std::string& line) {
    if (in_banner_) {
      banner_ += line;
      if (is_rule(line)) {
        if (!drop_banner(banner_)) err_line(banner_);
        banner_.clear();
        in_banner_ = false;
      } else if (++banner_lines_ > kMaxBannerLines) {
        err_line(banner_);
        banner_.clear();
        in_banner_ = false;
      }
      return;
    }
    if (is_rule(line)) {
      in_banner_ = true;
      banner_ = line;
      banner_lines_ = 0;
      return;
    }
    if (stop_requested_ && starts_with(line, "mpirun: Forwarding signal ")) return;
    // "[host:pid] 1 more process has sent help message help-mpi-api.txt / mpi-abort", then "[host:pid]
    // Set MCA parameter "orte_base_help_aggregate" to 0 to see all help / error messages".
    if (starts_with(line, "[") && contains(line, "sent help message")) {
      dropped_aggregate_ = booster_command_ && contains(line, "mpi-abort");
      if (dropped_aggregate_) return;
    } else if (starts_with(line, "[") && contains(line, "orte_base_help_aggregate")) {
      if (dropped_aggregate_) return;
    } else if (starts_with(line, "[") && contains(line, "ORTE_ERROR_LOG") && contains(line, "show_help.c")) {
      if (booster_command_) return;  // mpirun failing to show one of those banners when ranks abort together
    } else if (starts_with(line, "booster: rank ")) {
      const size_t at = line.find(": error: ");
      if (at != std::string::npos && !errors_.insert(line.substr(at)).second) return;  // said already
    }
    err_line(line);
  }

  const bool booster_command_;
  bool stop_requested_ = false;
  int stdout_error_ = 0;
  std::string pending_;     // the start of a line that may be dropped, until its newline
  bool passing_ = false;    // the current line is being passed on as it comes
  bool in_banner_ = false;  // between the opening and the closing rule of a banner
  std::string banner_;
  int banner_lines_ = 0;
  bool dropped_aggregate_ = false;
  std::set<std::string> errors_;  // error messages printed, without their rank
  std::string scanned_;           // the line scan() is reading
  std::string first_error_, died_;
};

int supervise(const std::vector<char*>& argv, Relay& relay) {
  int out_pipe[2], err_pipe[2];
  BOOSTER_CHECK(::pipe2(out_pipe, O_CLOEXEC) == 0 && ::pipe2(err_pipe, O_CLOEXEC) == 0, DistributedError,
                "booster run: cannot make a pipe: ", std::strerror(errno));
  const pid_t child = ::fork();
  BOOSTER_CHECK(child >= 0, DistributedError, "booster run: cannot start '", argv[0], "': fork: ", std::strerror(errno));
  if (child == 0) {
    ::setpgid(0, 0);
    if (::isatty(STDIN_FILENO)) {
      const int null = ::open("/dev/null", O_RDONLY);
      if (null >= 0) ::dup2(null, STDIN_FILENO);
    }
    ::dup2(out_pipe[1], STDOUT_FILENO);  // dup2 clears O_CLOEXEC on the copies
    ::dup2(err_pipe[1], STDERR_FILENO);
    ::execvp(argv[0], argv.data());
    std::fprintf(stderr, "booster: error: booster run: cannot start '%s': %s\n", argv[0], std::strerror(errno));
    ::_exit(kExitRuntimeError);
  }
  ::setpgid(child, child);  // as the child does: whichever runs first
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  for (const int signal : {SIGINT, SIGTERM, SIGHUP}) sigaction(signal, &action, nullptr);
  ::signal(SIGPIPE, SIG_IGN);  // a closed stdout is a write error (Relay::out), not the end of booster run

  std::vector<pollfd> fds = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  for (const pollfd& fd : fds) ::fcntl(fd.fd, F_SETFL, ::fcntl(fd.fd, F_GETFL) | O_NONBLOCK);
  int forwarded = 0;  // signals passed on so far
  int status = 0;
  bool exited = false;
  auto forward_signals = [&] {
    for (; forwarded < g_signals && !exited; ++forwarded) {
      if (forwarded == 0) {
        std::fprintf(stderr, "\nbooster run: %s: asking every rank to stop after this step and save "
                     "(again to end the job at once)\n", stop_signal_name(g_stop_signal));
        relay.stop_requested();
        ::kill(child, trainer::StopOnSignal::launcher_signal(g_stop_signal));
      } else {
        ::kill(child, SIGTERM);
      }
    }
  };
  std::chrono::steady_clock::time_point exited_at;
  char buffer[65536];
  while (fds[0].fd >= 0 || fds[1].fd >= 0) {
    const int ready = ::poll(fds.data(), fds.size(), 100);
    if (ready < 0 && errno != EINTR) BOOSTER_FAIL(DistributedError, "booster run: poll: ", std::strerror(errno));
    forward_signals();
    for (size_t k = 0; k < fds.size(); ++k) {
      if (fds[k].fd < 0) continue;
      // One read per pipe and round, so a flood on one still leaves time for the other and for signals.
      const ssize_t n = ::read(fds[k].fd, buffer, sizeof buffer);
      if (n > 0) {
        k == 0 ? relay.out(buffer, size_t(n)) : relay.err(buffer, size_t(n));
      } else if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {  // the end
        ::close(fds[k].fd);
        fds[k].fd = -1;
      }
    }
    if (!exited && ::waitpid(child, &status, WNOHANG) == child) {
      exited = true;
      exited_at = std::chrono::steady_clock::now();
    }
    // mpirun has exited; a process it left behind may hold the pipes open: what it writes within two
    // seconds is passed on.
    if (exited && std::chrono::steady_clock::now() - exited_at > std::chrono::seconds(2)) break;
  }
  for (const pollfd& fd : fds)
    if (fd.fd >= 0) ::close(fd.fd);
  while (!exited) {
    const pid_t done = ::waitpid(child, &status, 0);
    if (done == child) break;
    forward_signals();
    if (done < 0 && errno != EINTR) BOOSTER_FAIL(DistributedError, "booster run: waiting for mpirun: ", std::strerror(errno));
  }
  relay.finish();
  int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  if (code != 0 && g_stop_signal != 0) code = 128 + g_stop_signal;
  if (code == 0 && relay.stdout_failed()) code = kExitRuntimeError;
  return code;
}

// Note [Restarting a failed job]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With --max-restarts K, booster run starts the job again when it fails at run time: a rank died (mpirun
// then exits 128 + the signal), a collective timed out, or the job exited non-zero otherwise. Exit status 2
// is a config or usage mistake, which a restart would only repeat: never restarted; nor is a job stopped
// by a signal booster run was sent, nor one whose stdout could not be written. Each restart prints one
// line with its number, the exit status and the job's first error line (else mpirun's line naming the
// rank that died of a signal). A `booster train` command gets --resume latest unless it names a
// --resume, so it goes on from the newest checkpoint that passes its checksums (Note [Falling back from
// a damaged checkpoint] in booster/booster/state.cpp); a run without a fixed checkpoint directory
// (train.run_dir null or with {time}, and no train.checkpoint_dir) starts over, and the line says so.
// After K restarts the last failure is booster run's, with its exit status.
//
// A node that is lost leaves fewer slots. booster run learns how many are left by reading --hostfile
// again before each restart (a cluster's health check, or the user, drops the lost node's line); the
// test hook BOOSTER_TEST_MAX_PROCESSES=k makes it believe that at most k are left, and
// BOOSTER_TEST_BEFORE_RESTART=CMD runs CMD with /bin/sh before the slots are counted (a test rewrites the
// hostfile there, at a known moment). A hostfile that can no longer be read, or is malformed, ends the
// job with that error instead of a restart.
// With --min-processes M the job is then restarted on the most processes, from M to the slots left, that
// divide the global batch (data.batch_size x processes): a checkpoint of single, ddp or low_level_zero
// resumes at any number of processes when the global batch is the same (Note [Resuming across layouts]),
// so booster run adds --set data.batch_size=B that keeps it (train.grad_accumulation is a setting a
// resume must keep, and the saved data position counts batches, so it cannot change instead).
//
// A restart waits for the job to end, and mpirun ends a job that lost a rank as it ends one on a signal:
// SIGTERM to the ranks left a second later, SIGKILL a second after that (odls_base_sigkill_timeout 1).
// Those ranks wait in a collective for the dead one, so they can neither finish the step nor save: the
// two seconds were most of a restart (bench/README.md, "Elastic restarts"). With --max-restarts,
// booster run passes --mca odls_base_sigkill_timeout 0, and the job ends as soon as mpirun notices.
// A stop asked for with Ctrl-C is unchanged: it reaches the ranks as a forwarded signal, not as a kill.
namespace restart {

// The value of `name` (long or short form) in a booster train command, or nullopt; all of them when
// `all` is given.
std::optional<std::string> option_value(const std::vector<std::string>& command, const std::string& name,
                                        const std::string& short_name, std::vector<std::string>* all = nullptr) {
  std::optional<std::string> found;
  for (size_t k = 2; k < command.size(); ++k) {
    const std::string& a = command[k];
    std::optional<std::string> value;
    if ((a == name || a == short_name) && k + 1 < command.size()) value = command[++k];
    else if (a.rfind(name + "=", 0) == 0) value = a.substr(name.size() + 1);
    if (!value) continue;
    found = value;
    if (all) all->push_back(*value);
  }
  return found;
}

bool is_train(const std::vector<std::string>& command, const std::string& self) {
  std::error_code ec;
  return command.size() >= 2 && command[1] == "train" &&
         (command[0] == self || fs::equivalent(command[0], self, ec));
}

// The config a booster train command runs, before resolving (its file and its --set); null when it cannot
// be read (the job itself then says why).
nlohmann::json train_config(const std::vector<std::string>& command) {
  try {
    const std::optional<std::string> path = option_value(command, "--config", "-c");
    if (!path) return nullptr;
    nlohmann::json config = config::load_file(*path);
    std::vector<std::string> sets;
    option_value(command, "--set", "-s", &sets);
    for (const std::string& s : sets) config::apply_override(config, s);
    return config;
  } catch (const std::exception&) {
    return nullptr;
  }
}

// The parallel plugin the job runs: train's --plugin, else booster run's own --plugin or an exported
// BOOSTER_PLUGIN, else the config's, else the single-process one.
std::string plugin_of(const std::vector<std::string>& command, const std::string& run_plugin,
                      const nlohmann::json& config) {
  if (const std::optional<std::string> p = option_value(command, "--plugin", "-p")) return *p;
  if (!run_plugin.empty()) return run_plugin;
  if (const char* env = std::getenv(kPluginVariable); env && *env) return env;
  if (config.is_object() && config.contains("plugin")) {
    const nlohmann::json& p = config.at("plugin");
    if (p.is_string()) return p.get<std::string>();
    if (p.is_object() && p.contains("name") && p.at("name").is_string()) return p.at("name").get<std::string>();
  }
  return "single";
}

// Whether `--resume latest` finds this run's checkpoints again: a fixed checkpoint directory.
bool resumable(const nlohmann::json& config) {
  if (!config.is_object() || !config.contains("train") || !config.at("train").is_object()) return true;
  const nlohmann::json& train = config.at("train");
  if (train.contains("checkpoint_dir") && train.at("checkpoint_dir").is_string()) return true;
  const nlohmann::json run_dir = train.contains("run_dir") ? train.at("run_dir") : nlohmann::json(config::kDefaultRunDir);
  return run_dir.is_string() && run_dir.get<std::string>().find("{time}") == std::string::npos;
}

std::string exit_status(int code) {
  std::string text = "exit status " + std::to_string(code);
  if (code > 128 && code < 128 + 65) {
    const char* name = ::strsignal(code - 128);
    text += " (signal " + std::to_string(code - 128) + (name ? std::string(", ") + name : std::string()) + ")";
  }
  return text;
}

std::string reason(int code, std::string failure) {
  // mpirun's line ends with a full stop, which would end the restart line mid-sentence (".; resuming").
  while (!failure.empty() && (failure.back() == '.' || failure.back() == ' ')) failure.pop_back();
  return exit_status(code) + (failure.empty() ? std::string() : ": " + failure);
}

// The slots left after a failure: BOOSTER_TEST_MAX_PROCESSES (a test hook: a lost node), else all; no
// more than `hostfile` lists when it is given and can be read again (ConfigError when it cannot).
int slots_left(int nproc, const std::string& hostfile) {
  if (const char* hook = std::getenv("BOOSTER_TEST_BEFORE_RESTART"); hook && *hook) (void)std::system(hook);
  int slots = nproc;
  if (!hostfile.empty())
    if (const std::optional<int> listed = read_hostfile(hostfile).total_slots()) slots = std::min(slots, *listed);
  const char* hook = std::getenv("BOOSTER_TEST_MAX_PROCESSES");
  if (!hook || !*hook) return slots;
  return std::clamp(std::atoi(hook), 0, slots);
}

}  // namespace restart

// Note [Hostfiles under booster run], continued: the hostfile mpirun reads. A regular file is passed on as
// it is, and read again at each restart; anything else (a pipe, e.g. --hostfile <(scontrol show ...))
// can be read only once, so booster run passes mpirun a private copy, removed when booster run ends, and
// the copy's slots stay those of every restart.
struct HostfileForMpirun {
  std::string copy;  // the private copy's path ("": none)
  HostfileForMpirun() = default;
  HostfileForMpirun(const HostfileForMpirun&) = delete;
  HostfileForMpirun& operator=(const HostfileForMpirun&) = delete;
  ~HostfileForMpirun() {
    if (!copy.empty()) ::unlink(copy.c_str());
  }
};

// Whether the mpirun options ask for oversubscribing: the word --oversubscribe (or -oversubscribe), or
// OVERSUBSCRIBE among --map-by's modifiers; exact words, so --nooversubscribe and NOOVERSUBSCRIBE do not.
bool oversubscribing(const std::vector<std::string>& mpirun_options) {
  const auto lower = [](std::string word) {
    std::transform(word.begin(), word.end(), word.begin(), [](unsigned char c) { return char(std::tolower(c)); });
    return word;
  };
  for (size_t i = 0; i < mpirun_options.size(); ++i) {
    const std::string word = lower(mpirun_options[i]);
    if (word == "--oversubscribe" || word == "-oversubscribe") return true;
    std::string map_by;
    for (const char* option : {"--map-by", "-map-by"}) {
      const std::string prefix = std::string(option) + "=";
      if (word == option && i + 1 < mpirun_options.size()) map_by = lower(mpirun_options[i + 1]);
      if (word.rfind(prefix, 0) == 0) map_by = word.substr(prefix.size());
    }
    std::replace(map_by.begin(), map_by.end(), ',', ':');
    std::string modifier;
    std::istringstream modifiers(map_by);
    while (std::getline(modifiers, modifier, ':'))
      if (modifier == "oversubscribe") return true;
  }
  return false;
}

// Reads plan.hostfile and refuses -n beyond its slots (Note [Hostfiles under booster run]); `contents`
// gets the file's text.
void check_hostfile(const LaunchPlan& plan, std::string& contents) {
  const Hostfile hosts = read_hostfile(plan.hostfile, &contents);
  const std::optional<int> slots = hosts.total_slots();
  BOOSTER_CHECK(!slots || plan.nproc <= *slots || oversubscribing(plan.mpirun_options), ConfigError,
                "booster run: -n ", plan.nproc, " is more than the ", slots.value_or(0),
                *slots == 1 ? " slot" : " slots", " the hostfile '", plan.hostfile, "' lists (",
                hosts.entries.size(), hosts.entries.size() == 1 ? " host" : " hosts", "); give -n ",
                slots.value_or(0), " or less, add slots to the hostfile, or oversubscribe with --mpirun-arg ",
                "--oversubscribe");
}

// A private copy of a hostfile that is not a regular file, for mpirun: plan's --hostfile then names it.
void copy_hostfile_for_mpirun(LaunchPlan& plan, const std::string& contents, HostfileForMpirun& copy) {
  std::error_code ec;
  if (fs::is_regular_file(plan.hostfile, ec)) return;
  const char* tmp = std::getenv("TMPDIR");
  std::string path = std::string(tmp && *tmp ? tmp : "/tmp") + "/booster-hostfile-XXXXXX";
  const int fd = ::mkstemp(path.data());
  BOOSTER_CHECK(fd >= 0, IOError, "booster run: cannot copy the hostfile '", plan.hostfile, "' to ", path, " (",
                std::strerror(errno), "); write it to a file and give that to --hostfile");
  copy.copy = path;
  size_t done = 0;
  while (done < contents.size()) {
    const ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += size_t(n);
  }
  const bool written = done == contents.size();
  ::close(fd);
  BOOSTER_CHECK(written, IOError, "booster run: cannot copy the hostfile '", plan.hostfile, "' to ", path,
                "; write it to a file and give that to --hostfile");
  for (size_t k = 0; k + 1 < plan.mpirun_options.size(); ++k)
    if (plan.mpirun_options[k] == "--hostfile" && plan.mpirun_options[k + 1] == plan.hostfile)
      plan.mpirun_options[k + 1] = path;
}

// Note [Job secret under booster run]
// Every start of the job (each restart too, so that a straggler of the last attempt cannot join the next)
// gets a fresh secret of 32 random bytes, hex, in BOOSTER_JOB_SECRET, which the tcp group and the TCP
// rendezvous prove with a challenge-response (Note [Job secret] in distributed/README.md). It goes in
// booster run's environment and mpirun passes it on with `-x BOOSTER_JOB_SECRET` (to other hosts too),
// so its value is on no command line (`ps` shows the name only; /proc/<pid>/environ is the owner's). A
// secret the user set (BOOSTER_JOB_SECRET or BOOSTER_JOB_SECRET_FILE) is kept and passed on instead.
// --dry-run prints neither.
std::string fresh_job_secret() {
  uint8_t bytes[32];
  size_t done = 0;
  while (done < sizeof bytes) {
    const ssize_t n = ::getrandom(bytes + done, sizeof bytes - done, 0);
    if (n < 0 && errno == EINTR) continue;
    BOOSTER_CHECK(n > 0, IOError, "booster run: no random bytes for the job secret (getrandom: ", std::strerror(errno),
                  "); set BOOSTER_JOB_SECRET to a random value yourself");
    done += size_t(n);
  }
  return common::to_hex(bytes, sizeof bytes);
}

// The variable that carries the job's secret to the ranks, setting a fresh one when the user gave none.
std::string secret_for_attempt(bool user_secret) {
  if (user_secret) return std::getenv("BOOSTER_JOB_SECRET") ? "BOOSTER_JOB_SECRET" : "BOOSTER_JOB_SECRET_FILE";
  ::setenv("BOOSTER_JOB_SECRET", fresh_job_secret().c_str(), /*overwrite=*/1);
  return "BOOSTER_JOB_SECRET";
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
  LaunchPlan plan = plan_launch(args, context);
  // The names are checked here, once, rather than by every rank (the same ConfigError as a config's).
  if (!plan.mixed_precision.empty()) config::name_section(plan.mixed_precision, "mixed_precision");
  if (!plan.plugin.empty()) config::name_section(plan.plugin, "plugin");
  std::string hostfile_text;
  if (!plan.hostfile.empty()) check_hostfile(plan, hostfile_text);

  if (plan.dry_run) {
    std::string line;
    for (const auto& [name, value] : plan.env) line += name + "=" + shell_quote(value) + " ";
    for (size_t k = 0; k < plan.argv.size(); ++k) line += (k ? " " : "") + shell_quote(plan.argv[k]);
    std::cout << line << "\n";
    return kExitOk;
  }
  HostfileForMpirun hostfile_copy;
  if (!plan.hostfile.empty()) {
    copy_hostfile_for_mpirun(plan, hostfile_text, hostfile_copy);
    fill_launch(plan, context, plan.nproc);
  }
  const bool booster_command = plan.program == context.self || fs::equivalent(plan.program, context.self, ec);
  const bool train = restart::is_train(plan.command, context.self);
  const nlohmann::json train_config = train && plan.max_restarts > 0 ? restart::train_config(plan.command) : nullptr;
  LaunchPlan attempt = plan;
  const bool user_secret = std::getenv("BOOSTER_JOB_SECRET") || std::getenv("BOOSTER_JOB_SECRET_FILE");
  for (int restarts = 0;; ++restarts) {
    for (const auto& [name, value] : attempt.env) ::setenv(name.c_str(), value.c_str(), /*overwrite=*/1);
    // Note [Job secret under booster run]
    std::vector<std::string> launch = attempt.argv;
    launch.insert(launch.begin() + 1, {"-x", secret_for_attempt(user_secret)});
    std::vector<char*> argv;
    for (const std::string& a : launch) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    std::cout.flush();
    std::cerr.flush();
    // booster explains its own failures (Note [What booster run prints]).
    Relay relay(booster_command);
    const int code = supervise(argv, relay);
    // Note [Restarting a failed job]
    if (code == kExitOk || plan.max_restarts == 0 || g_stop_signal != 0 || relay.stdout_failed()) return code;
    if (code == kExitUsageError) {
      std::cerr << "booster run: not restarted: exit status 2 is a config or usage error, which a restart would "
                   "repeat\n";
      return code;
    }
    const std::string why = restart::reason(code, relay.failure());
    if (restarts == plan.max_restarts) {
      std::cerr << "booster run: error: the job failed after " << restarts << (restarts == 1 ? " restart" : " restarts")
                << " (--max-restarts " << plan.max_restarts << "), giving up: " << why << "\n";
      return code;
    }
    std::string line = "booster run: restart " + std::to_string(restarts + 1) + " of " +
                       std::to_string(plan.max_restarts) + " after " + why;
    attempt = plan;
    // Fewer slots left: as many processes as divide the global batch, down to --min-processes.
    int slots = plan.nproc;
    try {
      // A private copy of a pipe's hostfile is not read again.
      slots = restart::slots_left(plan.nproc, hostfile_copy.copy.empty() ? plan.hostfile : std::string());
    } catch (const ConfigError& e) {  // the hostfile, read again (Note [Hostfiles under booster run])
      std::string what = e.what();
      if (what.rfind("booster run: ", 0) == 0) what.erase(0, 13);
      std::cerr << line << "\nbooster run: error: cannot restart: " << what << "\n";
      return code;
    }
    int processes = plan.nproc;
    if (slots < plan.nproc) {
      if (slots < plan.min_processes) {
        std::cerr << line << "\nbooster run: error: only " << slots << (slots == 1 ? " slot is" : " slots are")
                  << " left for the " << plan.nproc << " processes and --min-processes is " << plan.min_processes
                  << "; cannot restart (give --min-processes " << std::max(slots, 1) << " to go on with fewer)\n";
        return code;
      }
      std::string batch_change;
      if (train) {
        // Only data-parallel checkpoints resume on another number of processes (Note [Resuming across
        // layouts]); single's processes are copies, hybrid's layout is fixed.
        const std::string plugin = restart::plugin_of(plan.command, plan.plugin, train_config);
        if (plugin != "ddp" && plugin != "low_level_zero") {
          std::cerr << line << "\nbooster run: error: only " << slots << (slots == 1 ? " slot is" : " slots are")
                    << " left for the " << plan.nproc << " processes, and a checkpoint of plugin '" << plugin
                    << "' resumes only on as many processes as saved it (ddp and low_level_zero resume on fewer); "
                    << "cannot restart\n";
          return code;
        }
        const nlohmann::json& data = train_config.is_object() && train_config.contains("data") ? train_config.at("data")
                                                                                             : nlohmann::json();
        const int64_t batch = data.is_object() && data.contains("batch_size") && data.at("batch_size").is_number_integer()
                                  ? data.at("batch_size").get<int64_t>()
                                  : 128;  // the schema's default
        const int64_t global = batch * plan.nproc;
        processes = 0;
        for (int n = slots; n >= plan.min_processes && processes == 0; --n)
          if (global % n == 0) processes = n;
        if (processes == 0) {
          std::cerr << line << "\nbooster run: error: cannot restart on " << plan.min_processes << " to " << slots
                    << " processes: none divides the global batch of " << global << " (data.batch_size " << batch
                    << " x " << plan.nproc << " processes), which a resume must keep; lower --min-processes or "
                    << "choose a batch size they divide\n";
          return code;
        }
        const int64_t new_batch = global / processes;
        attempt.command.push_back("--set");
        attempt.command.push_back("data.batch_size=" + std::to_string(new_batch));
        batch_change = ", data.batch_size " + std::to_string(batch) + " -> " + std::to_string(new_batch) +
                       " keeps the global batch of " + std::to_string(global);
      } else {
        processes = slots;
      }
      line += "; on " + std::to_string(processes) + (processes == 1 ? " process" : " processes") + " instead of " +
              std::to_string(plan.nproc) + " (" + std::to_string(slots) + (slots == 1 ? " slot" : " slots") +
              " left)" + batch_change;
    }
    if (train) {
      if (restart::option_value(plan.command, "--resume", "-r")) {
        line += "; booster train resumes as its --resume says";
      } else if (restart::resumable(train_config)) {
        attempt.command.push_back("--resume");
        attempt.command.push_back("latest");
        line += "; resuming from the newest valid checkpoint (--resume latest)";
      } else {
        line += "; starting over: the run has no fixed checkpoint directory (set train.run_dir without {time}, "
                "or train.checkpoint_dir, to resume)";
      }
    }
    std::cerr << line << "\n";
    // A stop asked for while this restart was planned: no new job to start and kill.
    if (g_stop_signal != 0) return 128 + g_stop_signal;
    fill_launch(attempt, context, processes);
  }
}

}  // namespace booster::cli
