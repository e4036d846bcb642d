// `booster run --hostfile FILE` (cli/hostfile.h, Note [Hostfiles under booster run]): the parser on its
// own, the checks booster run makes before mpirun starts, a 2-process run on a hostfile of localhost, a
// restart on the slots a shrunk hostfile leaves, and scripts/slurm_hostfile.sh with made-up Slurm
// variables (no Slurm here).
#include <catch2/catch.hpp>

#include "skip.h"

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "../../cli/hostfile.h"
#include "run_booster.h"

namespace fs = std::filesystem;
using booster::cli::Hostfile;
using booster::cli::parse_hostfile;
using booster::cli::read_hostfile;
using nlohmann::json;
using testing::have_mpirun;
using testing::kNoMpirun;
using testing::RunResult;

namespace {


fs::path scratch_dir() { return testing::scratch_dir("test_cli_hostfile"); }

RunResult run_booster(const std::string& args, const std::string& env = "") {
  return testing::run_booster_in(scratch_dir(), args, "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 " + env);
}

// A dry run needs no mpirun: any program path will do (BOOSTER_MPIRUN is not checked).
RunResult dry_run(const std::string& args) { return run_booster("run --dry-run " + args, "BOOSTER_MPIRUN=/bin/true"); }

fs::path write_hostfile(const std::string& name, const std::string& text) {
  const fs::path p = scratch_dir() / name;
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
  return p;
}

std::string error_of(const std::string& text, const std::string& name = "hosts") {
  try {
    parse_hostfile(text, name);
  } catch (const booster::ConfigError& e) {
    return e.what();
  }
  return "(no error)";
}

size_t count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

// The ddp run of test_cli_elastic: saves every 5 steps into its own run directory (removed first).
fs::path ddp_config(const std::string& name) {
  const fs::path run_dir = scratch_dir() / (name + "_run");
  fs::remove_all(run_dir);
  json config = json::parse(R"({
    "model": {"type": "mlp", "in": 8, "hidden": [16], "classes": 3},
    "optimizer": {"type": "adamw", "lr": 0.01},
    "data": {"type": "synthetic", "num_samples": 512, "num_test_samples": 64, "num_features": 8,
             "num_classes": 3, "batch_size": 16},
    "train": {"epochs": 2, "max_steps": 24, "log_every": 4, "seed": 3, "checkpoint_every": 5},
    "plugin": "ddp"
  })");
  config["train"]["run_dir"] = run_dir.string();
  const fs::path p = scratch_dir() / (name + ".json");
  std::ofstream(p) << config.dump(2);
  return p;
}

double final_loss(const RunResult& r) { return json::parse(testing::last_line(r.out)).at("final_loss").get<double>(); }

// scripts/slurm_hostfile.sh under the given environment; its stdout and stderr.
RunResult slurm_hostfile(const std::string& env) {
  const fs::path out = scratch_dir() / "slurm_out.txt", err = scratch_dir() / "slurm_err.txt";
  fs::create_directories(scratch_dir());
  const std::string cmd = "env -u SLURM_JOB_NODELIST -u SLURM_NODELIST -u SLURM_TASKS_PER_NODE " + env + " " +
                          std::string(BOOSTER_SOURCE_DIR) + "/scripts/slurm_hostfile.sh >" + out.string() + " 2>" +
                          err.string();
  const int status = std::system(cmd.c_str());
  RunResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = testing::read_text(out);
  r.err = testing::read_text(err);
  return r;
}

}  // namespace

TEST_CASE("a hostfile's hosts and slots, with comments, blank lines and spaces around =", "[cli][run][hostfile]") {
  const Hostfile h = parse_hostfile("# the cluster\n\nnode01 slots=4  # first\n  node02 slots = 2 max_slots=8\n"
                                    "node03 slots=1\n",
                                    "hosts");
  REQUIRE(h.entries.size() == 3);
  CHECK(h.entries[0].host == "node01");
  CHECK(h.entries[0].line == 3);
  CHECK(h.entries[1].host == "node02");
  CHECK(h.entries[1].slots == 2);
  CHECK(h.total_slots() == 7);
  // A host once per slot, as mpirun takes it (the total is then mpirun's business).
  CHECK(parse_hostfile("node01\nnode01\n", "h").entries.size() == 2);
  // OpenMPI's other spellings of the count; username and port are ssh's business.
  CHECK(parse_hostfile("a count=2 username=me port=22\nb cpu=3\nc slots=1 max-slots=1\n", "h").total_slots() == 6);
  // Without slots= mpirun counts the host's cores, which booster run cannot know: no total.
  CHECK_FALSE(parse_hostfile("node01 slots=4\nnode02\n", "h").total_slots().has_value());
}

TEST_CASE("a host listed again with a slot count is refused, as mpirun refuses it", "[cli][run][hostfile]") {
  // mpirun: "A hostfile was provided that contains multiple definitions of the slot count".
  for (const char* text : {"node01 slots=1\nnode02 slots=2\nnode01 slots=1\n", "node01\nnode02 slots=2\nnode01 slots=3\n",
                           "node01 max_slots=2\nnode02 slots=2\nnode01\n"}) {
    INFO(text);
    CHECK_THAT(error_of(text), Catch::Contains("hostfile hosts:3: 'node01' is listed again (first on line 1) and a slot "
                                               "count is given; mpirun takes one line `node01 slots=N`"));
  }
}

TEST_CASE("a malformed hostfile line is a ConfigError naming file:line", "[cli][run][hostfile]") {
  CHECK_THAT(error_of("node01 slots=2\n\nnode02 slotz=3\n"), Catch::Contains("hostfile hosts:3: unknown key 'slotz'"));
  CHECK_THAT(error_of("# c\nnode01 slots=x0\n"), Catch::Contains("hosts:2: slots=x0 is not a number of slots"));
  CHECK_THAT(error_of("node01 slots=two\n"), Catch::Contains("hosts:1: slots=two is not a number of slots"));
  CHECK_THAT(error_of("node01 slots=-1\n"), Catch::Contains("hosts:1: slots=-1 is not a number of slots"));
  CHECK_THAT(error_of("node01 4\n"), Catch::Contains("hosts:1: '4' after the host name is not KEY=VALUE"));
  CHECK_THAT(error_of("node01 slots=\n"), Catch::Contains("hosts:1: 'slots=' after the host name is not KEY=VALUE"));
  CHECK_THAT(error_of("slots=2\n"), Catch::Contains("hosts:1: 'slots=2' is not a host name"));
  CHECK_THAT(error_of("node01 max_slots=x\n"), Catch::Contains("hosts:1: max_slots=x is not a number"));
  CHECK_THAT(error_of("# only a comment\n\n"), Catch::Contains("hostfile hosts lists no host"));
  CHECK_THAT(error_of(""), Catch::Contains("lists no host"));
}

TEST_CASE("a hostfile takes the keys and aliases of OpenMPI's hostfile lexer, and no others", "[cli][run][hostfile]") {
  const Hostfile h = parse_hostfile("a slots=1 user_name=me user-name=me username=me port=22\n"
                                    "b cpu=2 slots_max=4 boards=1 sockets=2 cores=8 cpu_set=0-3\n"
                                    "c count=3 max_count=3 cpu_max=5 cpu-max=5 max-cpu=5 count-max=5 slots-max=5\n"
                                    "d slots=1 sockets_per_board=1 cores-per-socket=2 cpu-set=1\n",
                                    "h");
  CHECK(h.entries.size() == 4);
  CHECK(h.total_slots() == 7);
  // `user=` is no key of OpenMPI's, and `slot=` a rankfile's, not a hostfile's: mpirun refuses both.
  CHECK_THAT(error_of("node01 slots=2 user=me\n"), Catch::Contains("hosts:1: unknown key 'user'"));
  CHECK_THAT(error_of("node01 slot=2\n"), Catch::Contains("hosts:1: unknown key 'slot'"));
  CHECK_THAT(error_of("node01 cores=many\n"), Catch::Contains("hosts:1: cores=many is not a number"));
}

TEST_CASE("slots=0 is allowed, max_slots below slots is a ConfigError and max_slots alone gives the slots",
          "[cli][run][hostfile]") {
  CHECK(parse_hostfile("node01 slots=0\nnode02 slots=2\n", "h").total_slots() == 2);
  CHECK_THAT(error_of("node01 slots=4 max_slots=2\n"),
             Catch::Contains("hosts:1: max_slots=2 is less than slots=4; expected max_slots of at least slots"));
  CHECK_THAT(error_of("node01 max-slots=1 slots=3\n"), Catch::Contains("hosts:1: max-slots=1 is less than slots=3"));
  const Hostfile h = parse_hostfile("node01 max_slots=3\nnode02 slots=2 max_slots=2\n", "h");
  REQUIRE(h.entries.size() == 2);
  CHECK(h.entries[0].slots == 3);
  CHECK(h.total_slots() == 5);
}

TEST_CASE("a ^host line excludes the host and adds no slots", "[cli][run][hostfile]") {
  // ^node02 removes node02's slots from any line, and adds none of its own.
  Hostfile h = parse_hostfile("node01 slots=2\nnode02 slots=4\n^node02\nnode03 slots=1\n", "h");
  REQUIRE(h.entries.size() == 2);
  CHECK(h.entries[0].host == "node01");
  CHECK(h.entries[1].host == "node03");
  CHECK(h.total_slots() == 3);
  // An excluded host that no line lists changes nothing (and is no host without slots=).
  h = parse_hostfile("node01 slots=2\n^node09\n", "h");
  CHECK(h.total_slots() == 2);
  CHECK_THAT(error_of("^node01\n"), Catch::Contains("hostfile hosts lists no host"));
  CHECK_THAT(error_of("node01 slots=1\n^node02 slots=2\n"),
             Catch::Contains("hosts:2: '^node02 slots=2' is not a host to exclude; expected `^HOST` alone"));
}

TEST_CASE("// and /* */ comments in a hostfile are stripped as OpenMPI does", "[cli][run][hostfile]") {
  const Hostfile h = parse_hostfile("// the cluster\nnode01 slots=2 // the first\n/* node02 slots=8\n"
                                    "   node03 slots=8 */\nnode04 slots=1 /* one */\n/**/ node05 slots=3\n",
                                    "h");
  REQUIRE(h.entries.size() == 3);
  CHECK(h.entries[0].host == "node01");
  CHECK(h.entries[1].host == "node04");
  CHECK(h.entries[1].line == 5);
  CHECK(h.entries[2].host == "node05");
  CHECK(h.entries[2].line == 6);
  CHECK(h.total_slots() == 6);
  // Line numbers count the lines inside a comment.
  CHECK_THAT(error_of("/* a\nb\n*/\nnode01 slotz=1\n"), Catch::Contains("hosts:4: unknown key 'slotz'"));
}

TEST_CASE("a hostfile that cannot be read is a ConfigError naming it", "[cli][run][hostfile]") {
  const fs::path missing = scratch_dir() / "no_such_hostfile";
  fs::remove(missing);
  CHECK_THROWS_MATCHES(read_hostfile(missing.string()), booster::ConfigError,
                       Catch::Message("booster run: cannot read the hostfile '" + missing.string() +
                                      "' (No such file or directory); give --hostfile a file with a line `HOST "
                                      "slots=N` per machine"));
  fs::create_directories(scratch_dir());
  CHECK_THROWS_WITH(read_hostfile(scratch_dir().string()), Catch::Contains("is a directory"));
}

TEST_CASE("booster run refuses a missing or malformed hostfile before mpirun starts, exit 2",
          "[cli][run][hostfile]") {
  const fs::path missing = scratch_dir() / "missing_hosts";
  fs::remove(missing);
  RunResult r = dry_run("-n 2 --hostfile " + missing.string() + " -- echo hi");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Catch::Contains("booster run: cannot read the hostfile '" + missing.string() + "'"));
  CHECK(r.out.empty());

  const fs::path bad = write_hostfile("bad_hosts", "localhost slots=2\nnode2 slots=2 gpus=4\n");
  r = dry_run("-n 2 --hostfile " + bad.string() + " -- echo hi");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Catch::Contains("hostfile " + bad.string() + ":2: unknown key 'gpus'"));
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK(r.out.empty());
}

TEST_CASE("booster run refuses -n beyond the hostfile's slots unless oversubscribing is asked for",
          "[cli][run][hostfile]") {
  const fs::path hosts = write_hostfile("two_slots", "# one machine\nlocalhost slots=2\n");
  RunResult r = dry_run("-n 3 --hostfile " + hosts.string() + " -- echo hi");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Catch::Contains("booster run: -n 3 is more than the 2 slots the hostfile '" + hosts.string() +
                                    "' lists (1 host); give -n 2 or less"));
  CHECK(r.out.empty());

  r = dry_run("-n 3 --hostfile " + hosts.string() + " --mpirun-arg --oversubscribe -- echo hi");
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.out, Catch::Contains("-np 3 ") && Catch::Contains(" --hostfile " + hosts.string() + " --oversubscribe"));

  // Only an exact --oversubscribe (or OVERSUBSCRIBE among --map-by's modifiers) asks for it:
  // --nooversubscribe and NOOVERSUBSCRIBE ask for the opposite.
  for (const std::string asks : {"--mpirun-arg --nooversubscribe", "--mpirun-arg --map-by --mpirun-arg slot:NOOVERSUBSCRIBE",
                                 "--mpirun-arg --not-oversubscribe"}) {
    r = dry_run("-n 3 --hostfile " + hosts.string() + " " + asks + " -- echo hi");
    INFO(asks);
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Catch::Contains("-n 3 is more than the 2 slots"));
  }
  for (const std::string asks : {"--mpirun-arg -oversubscribe", "--mpirun-arg --map-by --mpirun-arg slot:OVERSUBSCRIBE",
                                 "--mpirun-arg --map-by=ppr:2:node:oversubscribe"}) {
    r = dry_run("-n 3 --hostfile " + hosts.string() + " " + asks + " -- echo hi");
    INFO(asks << ": " << r.err);
    CHECK(r.exit_code == 0);
  }

  // Within the slots: the hostfile's slots count, not this machine's cores, so no --oversubscribe is added
  // even where 2 is more than the cores.
  r = dry_run("-n 2 --hostfile " + hosts.string() + " -- echo hi");
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.out, Catch::Contains("-np 2 ") && !Catch::Contains("--oversubscribe"));

  // Hosts without slots=: the total is mpirun's to count, so -n is not checked.
  const fs::path unknown = write_hostfile("no_slots", "localhost\n");
  r = dry_run("-n 8 --hostfile " + unknown.string() + " -- echo hi");
  CHECK(r.exit_code == 0);
}

TEST_CASE("booster run -n 2 --hostfile with localhost slots=2 runs a ddp job", "[cli][run][hostfile][mpi]") {
  if (const std::string why = testing::why_no_mpi(); !why.empty()) return skip_test(why);
  const fs::path hosts = write_hostfile("localhost_hosts", "localhost slots=2\n");
  RunResult r = run_booster("run -n 2 --hostfile " + hosts.string() + " -- booster train --config " +
                            ddp_config("hostfile").string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const json summary = json::parse(testing::last_line(r.out));
  CHECK(summary["processes"] == 2);
  CHECK(summary["steps"] == 24);

  // A hostfile from a pipe (bash's --hostfile <(...)) reaches mpirun through a private copy in $TMPDIR,
  // removed afterwards: each rank lists that directory.
  const fs::path tmp = scratch_dir() / "pipe_tmp";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  const std::string script = "cd " + scratch_dir().string() + " && TMPDIR=" + tmp.string() +
                             " OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 bash -c '" + std::string(BOOSTER_BIN_DIR) +
                             "/booster run -n 2 --hostfile <(echo localhost slots=2) -- ls " + tmp.string() +
                             "' >pipe_out.txt 2>pipe_err.txt";
  const int status = std::system(script.c_str());
  const std::string out = testing::read_text(scratch_dir() / "pipe_out.txt");
  INFO(out << testing::read_text(scratch_dir() / "pipe_err.txt"));
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(count(out, "booster-hostfile-") == 2);
  bool left = false;
  for (const auto& entry : fs::directory_iterator(tmp))
    left = left || entry.path().filename().string().rfind("booster-hostfile-", 0) == 0;
  CHECK_FALSE(left);
}

TEST_CASE("booster run reads a shrunk hostfile again at a restart and goes on on the slots left",
          "[cli][run][hostfile][elastic][mpi]") {
  if (const std::string why = testing::why_no_mpi(); !why.empty()) return skip_test(why);
  RunResult whole = run_booster("run -n 2 -- booster train --config " + ddp_config("whole").string());
  REQUIRE(whole.exit_code == 0);

  // The last rank dies after step 12 (a lost node); before the restart the hostfile loses a slot, as a
  // cluster's health check would rewrite it.
  const fs::path hosts = write_hostfile("shrinking_hosts", "localhost slots=2\n");
  const fs::path once = scratch_dir() / "shrunk_once";
  fs::remove(once);
  const std::string env = "BOOSTER_TEST_KILL_AT_STEP=12:" + once.string() +
                          " BOOSTER_TEST_BEFORE_RESTART='echo localhost slots=1 >" + hosts.string() + "'";
  RunResult r = run_booster("run -n 2 --hostfile " + hosts.string() + " --max-restarts 1 --min-processes 1 -- " +
                                "booster train --config " + ddp_config("shrunk").string(),
                            env);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Catch::Contains("; on 1 process instead of 2 (1 slot left), data.batch_size 16 -> 32 keeps the "
                                    "global batch of 32; resuming from the newest valid checkpoint"));
  CHECK_THAT(r.err, Catch::Contains("resumed on 1 process (ddp) from a checkpoint of 2 (ddp)"));
  const json summary = json::parse(testing::last_line(r.out));
  CHECK(summary["processes"] == 1);
  CHECK(summary["steps"] == 24);
  CHECK(final_loss(r) == Approx(final_loss(whole)).epsilon(1e-5));  // another summation order

  // A hostfile that went bad meanwhile ends the job with its error, not a restart on a guess.
  write_hostfile("shrinking_hosts", "localhost slots=2\n");
  fs::remove(once);
  const std::string broken = "BOOSTER_TEST_KILL_AT_STEP=12:" + once.string() +
                             " BOOSTER_TEST_BEFORE_RESTART='echo localhost slots=none >" + hosts.string() + "'";
  r = run_booster("run -n 2 --hostfile " + hosts.string() + " --max-restarts 1 --min-processes 1 -- " +
                      "booster train --config " + ddp_config("broken").string(),
                  broken);
  INFO(r.err);
  CHECK(r.exit_code == 137);
  CHECK_THAT(r.err, Catch::Contains("booster run: error: cannot restart: hostfile " + hosts.string() +
                                    ":1: slots=none is not a number of slots"));
}

TEST_CASE("scripts/slurm_hostfile.sh turns Slurm's node list and tasks per node into a hostfile",
          "[cli][run][hostfile][slurm]") {
  RunResult r = slurm_hostfile("SLURM_JOB_NODELIST='node[01-03,05],gpu7' SLURM_TASKS_PER_NODE='2(x3),1,4'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out == "node01 slots=2\nnode02 slots=2\nnode03 slots=2\nnode05 slots=1\ngpu7 slots=4\n");
  // What it prints is a hostfile booster run takes: 11 slots.
  const fs::path hosts = write_hostfile("slurm_hosts", r.out);
  CHECK(read_hostfile(hosts.string()).total_slots() == 11);
  CHECK(dry_run("-n 11 --hostfile " + hosts.string() + " -- echo hi").exit_code == 0);
  RunResult over = dry_run("-n 12 --hostfile " + hosts.string() + " -- echo hi");
  CHECK(over.exit_code == 2);
  CHECK_THAT(over.err, Catch::Contains("-n 12 is more than the 11 slots"));

  // Several bracket groups, zero padding, and the older SLURM_NODELIST.
  r = slurm_hostfile("SLURM_NODELIST='r[1-2]-n[09-10]' SLURM_TASKS_PER_NODE='1(x4)'");
  CHECK(r.exit_code == 0);
  CHECK(r.out == "r1-n09 slots=1\nr1-n10 slots=1\nr2-n09 slots=1\nr2-n10 slots=1\n");
}

TEST_CASE("scripts/slurm_hostfile.sh refuses missing or mismatched Slurm variables, exit 2",
          "[cli][run][hostfile][slurm]") {
  for (const auto& [env, expect] : std::vector<std::pair<std::string, std::string>>{
           {"SLURM_TASKS_PER_NODE=2", "SLURM_JOB_NODELIST is not set"},
           {"SLURM_JOB_NODELIST=a", "SLURM_TASKS_PER_NODE is not set"},
           {"SLURM_JOB_NODELIST=a,b SLURM_TASKS_PER_NODE=1", "gives 1 node(s) but SLURM_JOB_NODELIST 'a,b' lists 2"},
           {"SLURM_JOB_NODELIST='a[1-' SLURM_TASKS_PER_NODE=1", "has an unclosed '['"},
           {"SLURM_JOB_NODELIST='a[x]' SLURM_TASKS_PER_NODE=1", "has 'x' in brackets"},
           {"SLURM_JOB_NODELIST='a[3-1]' SLURM_TASKS_PER_NODE=1", "runs backwards"},
           {"SLURM_JOB_NODELIST=a SLURM_TASKS_PER_NODE='2(y3)'", "has '2(y3)'; expected counts like 2(x3),1"}}) {
    INFO(env);
    RunResult r = slurm_hostfile(env);
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Catch::StartsWith("slurm_hostfile.sh: error: ") && Catch::Contains(expect));
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    CHECK(r.out.empty());
  }
}
