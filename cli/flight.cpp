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

  // Which ranks wrote, and which of the world did not.
  std::set<int> have;
  int world = 0;
  for (const nlohmann::json& r : records) {
    have.insert(r.at("world_rank").get<int>());
    for (const nlohmann::json& g : r.at("groups")) world = std::max(world, int(g.at("size").get<int64_t>()));
  }
  world = std::max(world, *have.rbegin() + 1);
  auto list = [](const std::vector<int>& ranks) {
    std::string out;
    for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
    return out;
  };
  std::vector<int> got(have.begin(), have.end()), absent;
  for (int r = 0; r < world; ++r)
    if (!have.count(r)) absent.push_back(r);
  std::cout << "booster flight: " << dir.string() << ": records of " << (got.size() == 1 ? "rank " : "ranks ")
            << list(got) << " (world of " << world;
  if (!absent.empty()) std::cout << "; no record from " << (absent.size() == 1 ? "rank " : "ranks ") << list(absent);
  std::cout << ")\n";
  for (const nlohmann::json& r : records)
    std::cout << "  rank " << r.at("world_rank").get<int>() << " wrote it on: " << r.value("reason", "?") << "\n";
  for (const distributed::FlightGroupFinding& f : distributed::analyze_flight_records(records))
    std::cout << f.text << "\n";
  return kExitOk;
}

}  // namespace booster::cli
