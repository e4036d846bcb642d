// `booster run`, the launcher (cli/run.cpp): what a job prints through it (Note [What booster run
// prints]), its options, its signals (Note [Signals under booster run]) and the strategy and plugin it
// hands the processes (Note [Switching by launcher]). Run as a user runs it: through the shell, output
// captured to files.
#include <catch2/catch.hpp>

#include "skip.h"

#include <sys/wait.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "run_booster.h"

namespace fs = std::filesystem;
using nlohmann::json;
using testing::have_mpirun;
using testing::kNoMpirun;
using testing::read_text;
using testing::RunResult;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_run"); }

const std::string kBin = std::string(BOOSTER_BIN_DIR) + "/booster";
const std::string kOneThread = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1";
RunResult run_booster(const std::string& args, const std::string& env = kOneThread) {
  return testing::run_booster_in(scratch_dir(), args, env);
}

// `command` through the shell in the scratch directory, its stdout and stderr captured (a redirection
// of stdout in `command` itself wins).
RunResult run_shell(const std::string& command) {
  const fs::path dir = scratch_dir(), out = dir / "shell_stdout.txt", err = dir / "shell_stderr.txt";
  fs::remove(out);
  const int status = std::system(("cd " + dir.string() + " && { " + command + " ; } >" + out.string() + " 2>" +
                                  err.string()).c_str());
  RunResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  r.out = read_text(out);
  r.err = read_text(err);
  return r;
}

fs::path write_config(const std::string& name, const json& config) {
  const fs::path p = scratch_dir() / name;
  std::ofstream(p) << config.dump(2);
  return p;
}

json small_config() {
  return json::parse(R"({
    "model": {"type": "mlp", "in": 8, "hidden": [16], "classes": 3},
    "optimizer": {"type": "adamw", "lr": 0.01},
    "data": {"type": "synthetic", "num_samples": 256, "num_test_samples": 64, "num_features": 8,
             "num_classes": 3, "batch_size": 32},
    "train": {"epochs": 1, "max_steps": 4, "log_every": 2, "seed": 3, "run_dir": null}
  })");
}

// Runs long enough to be interrupted (Note [Stopping on a signal]).
json long_config(const fs::path& run_dir) {
  json c = small_config();
  c["model"]["hidden"] = {256, 256};
  c["train"]["epochs"] = 800;
  c["train"]["max_steps"] = 3000;
  c["train"]["log_every"] = 10;
  c["train"]["run_dir"] = run_dir.string();
  c["train"]["checkpoint_every"] = 3000;
  return c;
}

using testing::have_plugin;

size_t count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// `booster <args>` started in the background, `signal` sent to it once its first step line is out,
// then waited for.
RunResult interrupt_booster(const std::string& args, int signal) {
  return testing::run_booster_interrupted(scratch_dir(), args, testing::wait_for_line("step "),
                                          "kill -" + std::to_string(signal) + " $pid", kOneThread);
}

}  // namespace

// ------------------------------------------------------------------------------------------ errors
TEST_CASE("booster run: a config error every rank makes is printed once, without mpirun's banners", "[cli][run][mpi]") {
  if (!have_mpirun()) return skip_test(kNoMpirun);
  json c = small_config();
  c["model"]["type"] = "nope";
  RunResult r = run_booster("run -n 2 -- booster train --config " + write_config("bad_model.json", c).string());
  INFO(r.err);
  CHECK(r.exit_code == 2);
  CHECK(count(r.err, "'model.type' is \"nope\"") == 1);
  CHECK(count(r.err, "error:") == 1);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK_THAT(r.err, Catch::StartsWith("booster: rank "));
  CHECK_THAT(r.err, !Catch::Contains("-----") && !Catch::Contains("mpirun") && !Catch::Contains("Primary job"));
}

// Note [Errors of several processes] in cli/main.cpp: one write per error line, naming its rank.
TEST_CASE("errors of several ranks each have a line of their own that names the rank", "[cli][run][mpi]") {
  if (!have_mpirun()) return skip_test(kNoMpirun);
  json c = small_config();
  c["data"] = {{"type", "npy"}, {"x", (scratch_dir() / "missing_x.npy").string()},
               {"y", (scratch_dir() / "missing_y.npy").string()}, {"batch_size", 32}};
  const fs::path cfg = write_config("missing_data.json", c);
  // Under mpirun itself every rank's line is there; a few times over, since the ranks race.
  const std::regex error_line("booster: rank [01] of 2: error: \\S+missing_x.npy does not exist; expected a .npy file.*");
  for (int attempt = 0; attempt < 3; ++attempt) {
    RunResult r = run_shell("OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 " + kOneThread +
                            " mpirun -np 2 --oversubscribe " + kBin + " train --config " + cfg.string());
    INFO(r.err);
    CHECK(r.exit_code == 1);
    std::vector<std::string> errors;
    for (const std::string& line : lines_of(r.err))
      if (line.find("error:") != std::string::npos) errors.push_back(line);
    REQUIRE(errors.size() == 2);
    std::sort(errors.begin(), errors.end());
    CHECK(std::regex_match(errors[0], error_line));
    CHECK(std::regex_match(errors[1], error_line));
    CHECK(errors[0].rfind("booster: rank 0 of 2: error: ", 0) == 0);
    CHECK(errors[1].rfind("booster: rank 1 of 2: error: ", 0) == 0);
  }
  // Through booster run the same message is printed once, and MPI_Abort's banner not at all.
  RunResult r = run_booster("run -n 2 -- booster train --config " + cfg.string());
  INFO(r.err);
  CHECK(r.exit_code == 1);
  CHECK(count(r.err, "error:") == 1);
  CHECK_THAT(r.err, Catch::Contains("missing_x.npy does not exist") && !Catch::Contains("MPI_ABORT") &&
                        !Catch::Contains("-----") && !Catch::Contains("help message"));
}

// A program that is not booster keeps mpirun's account of its failure: nothing else says which rank
// failed.
TEST_CASE("booster run keeps mpirun's banner for another program's failure", "[cli][run][mpi]") {
  if (!have_mpirun()) return skip_test(kNoMpirun);
  RunResult r = run_booster("run -n 2 -- sh -c 'exit 3'");
  CHECK(r.exit_code == 3);
  CHECK_THAT(r.err, Catch::Contains("non-zero"));
}

// ------------------------------------------------------------------------------------------ signals
TEST_CASE("Ctrl-C under booster run is reported as SIGINT, and the clean stop shows no mpirun banner",
          "[cli][run][signal][mpi]") {
  if (const std::string why = testing::why_no_mpi(); !why.empty()) return skip_test(why);
  for (const auto& [signal, name] : std::vector<std::pair<int, std::string>>{{SIGINT, "SIGINT"}, {SIGHUP, "SIGHUP"}}) {
    INFO(name);
    const fs::path run = scratch_dir() / ("stopped_" + name);
    fs::remove_all(run);
    json c = long_config(run);
    c["plugin"] = "ddp";
    RunResult r = interrupt_booster("run -n 2 -- booster train --config " + write_config("stopped.json", c).string(), signal);
    INFO(r.err);
    CHECK(r.exit_code == 128 + signal);
    CHECK_THAT(r.err, Catch::Contains("stopped by " + name + " after step") && Catch::Contains("; saved "));
    CHECK_THAT(r.err, !Catch::Contains("SIGUSR1") && !Catch::Contains("interrupted again"));
    CHECK_THAT(r.err, !Catch::Contains("-----") && !Catch::Contains("mpirun") && !Catch::Contains("Primary job"));
    CHECK(fs::exists(run / "checkpoints" / "latest"));
  }
}

TEST_CASE("SIGHUP stops booster train after the step and saves, as SIGTERM does", "[cli][run][signal]") {
  const fs::path run = scratch_dir() / "hangup";
  fs::remove_all(run);
  RunResult r = interrupt_booster("train --config " + write_config("hangup.json", long_config(run)).string(), SIGHUP);
  INFO(r.err);
  CHECK(r.exit_code == 128 + SIGHUP);
  CHECK_THAT(r.err, Catch::Contains("stopped by SIGHUP after step") && Catch::Contains("; saved " + run.string()) &&
                        Catch::Contains("--resume"));
  CHECK(fs::exists(run / "checkpoints" / "latest"));
}

// ------------------------------------------------------------------------------------------ plugins
// Note [One process, started N times] in booster/booster/single_process.cpp.
TEST_CASE("booster run -n 2 with the single plugin warns once that every process does the same work",
          "[cli][run][mpi]") {
  if (!have_mpirun()) return skip_test(kNoMpirun);
  const fs::path cfg = write_config("single.json", small_config());
  RunResult r = run_booster("run -n 2 -- booster train --config " + cfg.string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(count(r.err, "every process does the same work") == 1);
  CHECK(count(r.err, "booster: warning: plugin 'single' runs each process on its own, and this job started 2") == 1);
  // One process, or a plugin that shares the work: no warning.
  RunResult alone = run_booster("train --config " + cfg.string());
  REQUIRE(alone.exit_code == 0);
  CHECK_THAT(alone.err, !Catch::Contains("same work"));
  if (have_plugin("ddp")) {
    RunResult ddp = run_booster("run -n 2 -- booster train --config " + cfg.string() + " --plugin ddp");
    INFO(ddp.err);
    REQUIRE(ddp.exit_code == 0);
    CHECK_THAT(ddp.err, !Catch::Contains("same work"));
  }
}

// ------------------------------------------------------------------------------------------ options
TEST_CASE("booster run refuses an option it does not document, naming it", "[cli][run]") {
  for (const auto& [args, expect] : std::vector<std::pair<std::string, std::string>>{
           {"run -n 2 --timeout 2 --dry-run -- echo hi", "unknown option '--timeout'"},
           {"run --dry-run -n 2 --oversubscribe -- echo hi", "unknown option '--oversubscribe'"},
           {"run -n 2 --dryrun -- echo hi", "(did you mean '--dry-run'?)"},
           {"run -n 2 booster train", "'booster' comes before `--`"},
           {"run -n 2 --plugin -- echo hi", "--plugin needs a value"}}) {
    INFO(args);
    RunResult r = run_booster(args);
    INFO(r.err);
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Catch::Contains(expect));
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    CHECK(r.out.empty());
  }
  // mpirun's options go through --mpirun-arg, word by word; --hostfile (read first: test_cli_hostfile)
  // and --bind-to are passed on.
  std::ofstream(scratch_dir() / "hosts.txt") << "localhost slots=2\n";
  RunResult r = run_booster("run -n 2 --dry-run --mpirun-arg --max-restarts --mpirun-arg=2 --hostfile hosts.txt "
                            "--bind-to=none -- echo hi");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Catch::Contains(" --max-restarts 2 --hostfile hosts.txt --bind-to none echo hi\n"));
}

TEST_CASE("every example path that --help prints exists", "[cli][run]") {
  const std::regex path("examples/[A-Za-z0-9_./-]*[A-Za-z0-9_]");
  size_t paths = 0;
  for (const std::string args : {"--help", "run --help", "train --help", "check --help", "doctor --help"}) {
    INFO(args);
    RunResult r = run_booster(args);
    REQUIRE(r.exit_code == 0);
    for (auto it = std::sregex_iterator(r.out.begin(), r.out.end(), path); it != std::sregex_iterator(); ++it) {
      INFO(it->str());
      CHECK(fs::exists(fs::path(BOOSTER_SOURCE_DIR) / it->str()));
      ++paths;
    }
  }
  CHECK(paths >= 2);  // the run example and the main help's among them
  CHECK_THAT(run_booster("run --help").out, Catch::Contains("examples/configs/"));
}

// ------------------------------------------------------------------------------------------ stdout
TEST_CASE("an unwritable stdout under booster run fails the run with a message", "[cli][run][mpi]") {
  if (!have_mpirun() || !fs::exists("/dev/full")) return skip_test(!have_mpirun() ? kNoMpirun : "no /dev/full");
  const fs::path cfg = write_config("full.json", small_config());
  RunResult r = run_shell(kOneThread + " " + kBin + " run -n 1 -- booster train --config " + cfg.string() + " >/dev/full");
  INFO(r.err);
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Catch::Contains("booster run: error: cannot write the job's output to stdout (No space left on device)"));
  // The same run with a writable stdout succeeds and prints its summary.
  RunResult ok = run_booster("run -n 1 -- booster train --config " + cfg.string());
  CHECK(ok.exit_code == 0);
  CHECK(json::parse(testing::last_line(ok.out))["steps"] == 4);
}

// ------------------------------------------------------------------------------------------ switching
// Note [Switching by launcher]: the launcher's --mixed-precision and --plugin reach
// BoosterConfig::from_env() in every process; print_main prints on rank 0 only.
TEST_CASE("booster run --mixed-precision and --plugin switch a program built on BoosterConfig::from_env",
          "[cli][run][mpi]") {
  const std::string program = std::string(BOOSTER_BIN_DIR) + "/train_from_launcher";
  REQUIRE(fs::exists(program));
  // Without a launcher: the defaults, one process.
  RunResult alone = run_shell(kOneThread + " " + program + " --steps 4");
  INFO(alone.err);
  REQUIRE(alone.exit_code == 0);
  json summary = json::parse(testing::last_line(alone.out));
  CHECK(summary["mixed_precision"] == "fp32");
  CHECK(summary["plugin"] == "single");
  CHECK(summary["processes"] == 1);
  // A bad name in the variable is the config's error for it, naming the variable.
  RunResult bad = run_shell("BOOSTER_MIXED_PRECISION=bf17 " + program);
  CHECK(bad.exit_code == 2);
  CHECK_THAT(bad.err, Catch::Contains("BOOSTER_MIXED_PRECISION=bf17") && Catch::Contains("expected one of") &&
                          Catch::Contains("did you mean 'bf16'?"));
  // ... and booster run refuses it before anything starts.
  RunResult refused = run_booster("run -n 2 --mixed-precision bf17 -- " + program);
  CHECK(refused.exit_code == 2);
  CHECK_THAT(refused.err, Catch::Contains("'mixed_precision.name' is \"bf17\""));
  CHECK(std::count(refused.err.begin(), refused.err.end(), '\n') == 1);

  if (const std::string why = testing::why_no_mpi(); !why.empty()) return skip_test(why);
  RunResult r = run_booster("run --mixed-precision bf16 --plugin ddp -n 2 -- " + program + " --steps 4");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(count(r.out, "mixed precision bf16, plugin ddp, 2 processes\n") == 1);  // once, from rank 0
  summary = json::parse(testing::last_line(r.out));
  CHECK(summary["mixed_precision"] == "bf16");
  CHECK(summary["plugin"] == "ddp");
  CHECK(summary["processes"] == 2);
  CHECK(summary["steps"] == 4);
  CHECK(count(r.out, "\"final_loss\"") == 1);

  // booster train takes them as its --mixed-precision and --plugin; its own flags win.
  const fs::path cfg = write_config("switched.json", small_config());
  RunResult train = run_booster("run -n 2 --mixed-precision bf16 --plugin ddp -- booster train --config " + cfg.string());
  INFO(train.err);
  REQUIRE(train.exit_code == 0);
  CHECK_THAT(train.err, Catch::Contains("precision bf16") && Catch::Contains("plugin ddp"));
  RunResult own = run_booster("run -n 1 --mixed-precision bf16 -- booster train --config " + cfg.string() +
                              " --mixed-precision fp16");
  INFO(own.err);
  REQUIRE(own.exit_code == 0);
  CHECK_THAT(own.err, Catch::Contains("precision fp16"));
}
