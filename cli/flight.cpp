// `booster flight RUN_DIR`: after a hang or a crash, reads the flight records the ranks wrote
// (<run_dir>/flight/rank-N.json, Note [Flight recorder] in booster/distributed/README.md) and says, per
// group, which collective the ranks did not all complete and where each rank stopped.
//
//   $ booster flight runs/gpt
//   booster flight: runs/gpt/flight: records of rank 0 (world of 2; no record from rank 1)
//   group "world" (mpi, 2 ranks): rank 0 timed out in all_reduce #57 (timed out after 3.0 s); rank 1 left
//   no record (no rank-1.json: stopped, hung or killed before it could write one)
//
// The findings go to stdout, one line per group (and one per unfinished point-to-point batch); exit 0.
// A directory without records, or a file that is not one, is a DataError (exit 1).
#include <filesystem>
#include <iostream>
#include <sstream>
#include <set>
#include <string>
#include <vector>

#include <boost/program_options.hpp>

#include "booster/common/error.h"
#include "booster/distributed/flight_recorder.h"
#include "commands.h"
#include "options.h"

namespace po = boost::program_options;

namespace booster::cli {

namespace {

// "rank 1", "ranks 1-999999, 1000001": the ranks below `world` that are not in `have`, as ranges, so
// that a world of 10^6 ranks (or a record named rank-999999999.json) never lists each number.
std::string absent_ranks(const std::set<int>& have, int64_t world) {
  std::string out;
  int64_t count = 0, next = 0;
  auto add = [&](int64_t first, int64_t last) {
    if (first > last) return;
    count += last - first + 1;
    out += (out.empty() ? "" : ", ") + std::to_string(first);
    if (last > first) out += (last == first + 1 ? ", " : "-") + std::to_string(last);
  };
  for (int r : have) {
    add(next, int64_t(r) - 1);
    next = int64_t(r) + 1;
  }
  add(next, int64_t(world) - 1);
  return out.empty() ? out : (count == 1 ? "rank " : "ranks ") + out;
}

}  // namespace

int flight(const std::vector<std::string>& args) {
  po::options_description desc(
      "usage: booster flight RUN_DIR\n\n"
      "Reads the flight records of a run's ranks (RUN_DIR/flight/rank-N.json, written when a collective\n"
      "times out or a rank crashes) and prints, per process group, the first collective that did not\n"
      "complete on every rank and where each rank stopped. RUN_DIR may also be the flight directory.\n\noptions");
  desc.add_options()("help,h", "show this help");
  po::options_description hidden;
  hidden.add_options()("dir", po::value<std::vector<std::string>>(), "");
  po::options_description all;
  all.add(desc).add(hidden);
  po::positional_options_description positional;
  positional.add("dir", -1);
  po::variables_map vm;
  po::store(po::command_line_parser(args).options(all).positional(positional).run(), vm);
  po::notify(vm);
  if (vm.count("help")) {
    std::cout << desc;
    return kExitOk;
  }
  const std::vector<std::string> dirs = vm.count("dir") ? vm["dir"].as<std::vector<std::string>>() : std::vector<std::string>{};
  BOOSTER_CHECK(dirs.size() == 1, ConfigError, "'booster flight' takes one run directory, got ", dirs.size(),
                " (see booster flight --help)");

  namespace fs = std::filesystem;
  fs::path dir = dirs.front();
  std::error_code ec;
  if (fs::is_directory(dir / "flight", ec)) dir /= "flight";  // a run directory
  const std::vector<nlohmann::json> records = distributed::load_flight_records(dir);

  // Which ranks wrote, and which of the world did not. The whole text is made before any of it is
  // printed: a record that fails the analysis prints nothing partial.
  std::set<int> have;
  int64_t world = 0;
  for (const nlohmann::json& r : records) {
    if (const int rank = distributed::record_world_rank(r); rank >= 0) have.insert(rank);
    for (const nlohmann::json& g : r.at("groups")) world = std::max(world, g.at("size").get<int64_t>());
  }
  if (!have.empty()) world = std::max(world, int64_t(*have.rbegin()) + 1);  // a rank of INT32_MAX does not overflow
  const std::vector<int> got(have.begin(), have.end());
  const std::string absent = absent_ranks(have, world);
  size_t unknown = 0;  // rank-unknown-<pid>.json files
  for (const nlohmann::json& r : records) unknown += r.at("world_rank").is_null();
  std::ostringstream out;
  out << "booster flight: " << dir.string() << ": records of "
      << (got.empty() ? "ranks none" : distributed::rank_list_text(got)) << " (world of " << world;
  if (!absent.empty()) out << "; no record from " << absent;
  if (unknown) out << "; " << unknown << " from a process that did not know its rank";
  out << ")\n";
  // A rank-unknown-<pid>.json is named by its pid, and by the rank its groups give it where they do.
  for (const nlohmann::json& r : records) {
    const int rank = distributed::record_world_rank(r);
    if (r.at("world_rank").is_null())
      out << "  rank unknown (rank-unknown-" << r.value("pid", int64_t(0)) << ".json"
          << (rank >= 0 ? "; rank " + std::to_string(rank) + " by its groups" : std::string()) << ")";
    else
      out << "  rank " << rank;
    out << " wrote it on: " << r.value("reason", "?") << "\n";
  }
  for (const distributed::FlightGroupFinding& f : distributed::analyze_flight_records(records)) out << f.text << "\n";
  std::cout << out.str();
  return kExitOk;
}

}  // namespace booster::cli
