// Runs the `booster` program from a test, as a user would, and captures what it printed.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

namespace testing {

struct RunResult {
  int exit_code = -1;  // 128 + signal when a signal ended it
  std::string out, err;
};

inline std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// `build/bin/booster <args>` through the shell, in `dir` (where its stdout/stderr files go too, and
// any runs/ directory a train run makes); `env` (e.g. "OMP_NUM_THREADS=1") goes before the program.
// Under scripts/perturb.sh (BOOSTER_PERTURB_THREADS=N) the thread counts a test sets are replaced by N,
// so the programs it starts sum in the orders the script asks for.
inline std::string perturbed_env(std::string env) {
  const char* threads = std::getenv("BOOSTER_PERTURB_THREADS");
  if (!threads || !*threads) return env;
  for (const std::string key : {"OMP_NUM_THREADS=", "OPENBLAS_NUM_THREADS="}) {
    const size_t at = env.find(key);
    if (at == std::string::npos) {
      env = key + threads + " " + env;
      continue;
    }
    const size_t value = at + key.size(), stop = env.find(' ', value);
    env.replace(value, (stop == std::string::npos ? env.size() : stop) - value, threads);
  }
  return env;
}

inline RunResult run_booster_in(const std::filesystem::path& dir, const std::string& args, std::string env = "") {
  env = perturbed_env(env);
  std::filesystem::create_directories(dir);
  const std::filesystem::path out = dir / "stdout.txt", err = dir / "stderr.txt";
  const std::string cmd = "cd " + dir.string() + " && " + env + " " + std::string(BOOSTER_BIN_DIR) + "/booster " + args +
                          " >" + out.string() + " 2>" + err.string();
  const int status = std::system(cmd.c_str());
  RunResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  r.out = read_text(out);
  r.err = read_text(err);
  return r;
}

// A bash loop that returns once `dir`'s stderr.txt holds a line starting with `marker`, polling every
// `pause` seconds, at most `tries` times.
inline std::string wait_for_line(const std::string& marker, int tries = 1200, double pause = 0.05) {
  return "for i in $(seq 1 " + std::to_string(tries) + "); do grep -q \"^" + marker +
         "\" stderr.txt 2>/dev/null && break; sleep " + std::to_string(pause) + "; done; ";
}

// Starts `env booster <args>` in the background in `dir`, runs the bash snippet `wait` (wait_for_line,
// a sleep), then `kill` (a snippet that signals it; the process is $pid), waits for it to end, and
// returns what it printed and its exit status. The output files are removed first, so a line an earlier
// run left cannot end the wait.
inline RunResult run_booster_interrupted(const std::filesystem::path& dir, const std::string& args,
                                         const std::string& wait, const std::string& kill, const std::string& env = "") {
  std::filesystem::create_directories(dir);
  const std::string script = "cd " + dir.string() + " || exit 99; rm -f stdout.txt stderr.txt; " + env + " " +
                             std::string(BOOSTER_BIN_DIR) + "/booster " + args + " >stdout.txt 2>stderr.txt & pid=$!; " +
                             wait + kill + "; wait $pid; exit $?";
  const int status = std::system(("bash -c '" + script + "'").c_str());
  RunResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = read_text(dir / "stdout.txt");
  r.err = read_text(dir / "stderr.txt");
  return r;
}

// A scratch directory of one test program (`name`, e.g. "test_cli_resume") for this process, created.
inline std::filesystem::path scratch_dir(const std::string& name) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("booster_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir;
}

// True when mpirun is on the PATH (multi-process tests skip without it).
inline bool have_mpirun() { return std::system("command -v mpirun >/dev/null 2>&1") == 0; }
// The skip reason without it.
inline constexpr const char* kNoMpirun = "no mpirun (apt-get install openmpi-bin)";

// True when the parallel plugin `name` ("ddp", "low_level_zero") was built beside the core.
inline bool have_plugin(const std::string& name) {
  return std::filesystem::exists(std::filesystem::path(BOOSTER_LIB_DIR) / ("libbooster_plugin_" + name + ".so"));
}

// Why a multi-process test of `plugin` cannot run here ("" when it can).
inline std::string why_no_mpi(const std::string& plugin = "ddp") {
  if (!have_mpirun()) return kNoMpirun;
  if (!have_plugin(plugin)) return "the " + plugin + " plugin is not built";
  return "";
}

// Every file under `root` but the run's lock (its host and pid), by its path relative to it, with its
// bytes: what two checkpoint roots are compared by.
inline std::map<std::string, std::string> files_of(const std::filesystem::path& root) {
  std::map<std::string, std::string> out;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(root))
    if (entry.is_regular_file() && entry.path() != root / "lock")
      out[std::filesystem::relative(entry.path(), root).string()] = read_text(entry.path());
  return out;
}

// The last non-empty line of a program's stdout (booster train's summary, booster doctor's report).
inline std::string last_line(const std::string& out) {
  std::istringstream in(out);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return last;
}

}  // namespace testing
