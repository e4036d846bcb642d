// The flight recorder (Note [Flight recorder] in this folder's README.md): every process keeps its last
// 256 collectives and point-to-point batches, of every mpi and nccl group, in a ring, and writes them to
// <dir>/rank-<world rank>.json when a collective times out or the process dies of a fatal signal. After
// a hang, analyze_flight_records over the ranks' files (`booster flight RUN_DIR`) says which collective
// the ranks disagree on and where each rank stopped, as PyTorch's Flight Recorder does.
//
//   distributed::set_flight_dump_dir(run_dir / "flight");     // `booster train` does it for its run_dir
//   ... a collective times out on rank 0 ...                   // -> run_dir/flight/rank-0.json
//   for (const auto& f : distributed::analyze_flight_records(distributed::load_flight_records(dir)))
//     std::cout << f.text << "\n";
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace booster::distributed {

// Where this process writes its record: `dir`/rank-<world rank>.json, or rank-unknown-<pid>.json while
// the process does not know its world rank (the directory is created when the record is written). An empty path turns dumps off. Without a call, BOOSTER_FLIGHT_DIR names it; with
// neither, nothing is written. Also installs the fatal-signal handlers that dump (SIGSEGV, SIGABRT,
// SIGBUS, SIGFPE), chaining to the handlers that were there before.
void set_flight_dump_dir(const std::filesystem::path& dir);
// The directory set_flight_dump_dir or BOOSTER_FLIGHT_DIR gave; empty when dumps are off.
std::filesystem::path flight_dump_dir();

// Writes this process's record now (atomically: a temporary file renamed over the last one), saying
// `reason`. Returns the file written, or an empty path when no directory is set or it could not be
// written (a dump never throws: it runs on the way to an error of its own).
std::filesystem::path dump_flight_record(const std::string& reason);

// Every rank-<world rank>.json in `dir`, ordered by world rank, then every rank-unknown-<pid>.json (a
// process that did not know its world rank yet: "world_rank" null). DataError when `dir` is missing,
// holds no such file, or a file is not a flight record (naming the file and what is wrong with it).
std::vector<nlohmann::json> load_flight_records(const std::filesystem::path& dir);

// The world rank of a record of load_flight_records: its "world_rank", else (rank-unknown-<pid>.json)
// the one its groups give it; -1 when neither says.
int record_world_rank(const nlohmann::json& record);

// "rank 1", "ranks 0, 2-4": world ranks as the findings name them, runs of ranks as ranges.
std::string rank_list_text(const std::vector<int>& ranks);

// What the ranks' records say about one group (its name, backend and member ranks): the first
// collective that did not complete on every rank, and where each member stands. Ranks are the
// group's own numbers (world ranks for the world group).
struct FlightGroupFinding {
  std::string group;    // the group's name
  std::string backend;  // "mpi", "nccl"
  int size = 0;         // ranks in the group
  uint64_t seq = 0;     // the first collective not completed on every rank; 0: none is pending
  std::string op;       // its op, as the first rank that started it names it
  std::vector<int> waiting;      // started it and did not complete it (timed out, or still in it)
  std::vector<int> completed;    // completed it (and stand later)
  std::vector<int> not_started;  // never started it
  std::vector<int> unknown;      // started it, no evidence it completed, and its entry left the ring
  std::vector<int> missing;      // left no record of the group (no file, or the group is not in it)
  bool ops_disagree = false;     // the ranks that started #seq name different ops
  std::string text;              // the finding in words, one line per group, and one per pending p2p batch
};

// One finding per group seen in `records` (load_flight_records' documents, one per rank), in the
// order the groups were first made. DataError when a record lacks a field the analysis needs.
std::vector<FlightGroupFinding> analyze_flight_records(const std::vector<nlohmann::json>& records);

}  // namespace booster::distributed
