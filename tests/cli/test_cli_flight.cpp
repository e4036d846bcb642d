// `booster flight` on records it did not write (Note [Reading a flight record] in
// core/booster/distributed/flight_recorder.cpp): a field of the wrong type is one line naming the file and
// the field, with nothing printed before it; a record of a world of 10^6 ranks is read and analysed in
// seconds (a lookup per rank of a key holding the group's members, and naming a subgroup's ranks, were
// quadratic: minutes).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "run_booster.h"

namespace fs = std::filesystem;
using nlohmann::json;
using Catch::Contains;

namespace {

// A fresh run directory with a flight/ folder, in this test's scratch directory.
fs::path fresh_run(const std::string& name) {
  const fs::path dir = testing::scratch_dir("test_cli_flight") / name;
  fs::remove_all(dir);
  fs::create_directories(dir / "run" / "flight");
  return dir;
}

// A record as booster writes one (the fields of Note [Flight recorder] in distributed/README.md): world
// rank `rank` of a world group of `world_ranks.size()` ranks whose collectives #1..#`completed` completed
// and #`completed + 1` is still running on this rank.
json record(int rank, std::vector<int> world_ranks, uint64_t completed) {
  const int64_t group_rank = std::find(world_ranks.begin(), world_ranks.end(), rank) - world_ranks.begin();
  const size_t size = world_ranks.size();
  json doc = {{"format", "booster-flight-recorder"}, {"version", 2}, {"world_rank", rank}, {"pid", 4242},
              {"reason", "a collective timed out"},
              {"clock", {{"steady_ns", int64_t(10'000'000'000)}, {"wall_ns", int64_t(1'700'000'000'000'000'000)}}},
              {"groups", json::array({{{"index", 0}, {"backend", "mpi"}, {"name", "world"}, {"instance", 0},
                                       {"size", size}, {"rank", group_rank}, {"last_started", completed + 1},
                                       {"completed_through", completed}, {"world_ranks", std::move(world_ranks)}}})},
              {"entries", json::array()}};
  for (uint64_t seq = 1; seq <= completed + 1; ++seq) {
    const int64_t start = 1'000'000'000 + int64_t(seq) * 1'000'000;
    doc["entries"].push_back({{"id", seq}, {"seq", seq}, {"op", seq % 2 ? "all_reduce" : "broadcast"},
                              {"group", "world"}, {"group_index", 0}, {"group_size", size}, {"rank", group_rank},
                              {"peer", -1}, {"bytes", 64}, {"dtype", "float32"},
                              {"state", seq <= completed ? "completed" : "started"}, {"start_ns", start},
                              {"end_ns", seq <= completed ? json(start + 500'000) : json(nullptr)}});
  }
  return doc;
}

std::vector<int> first_ranks(int n) {
  std::vector<int> ranks(size_t(n), 0);
  std::iota(ranks.begin(), ranks.end(), 0);
  return ranks;
}

void write(const fs::path& file, const json& doc) { std::ofstream(file) << doc.dump(); }

}  // namespace

TEST_CASE("booster flight: a field of the wrong type names the file and the field, and nothing else is printed",
          "[cli][flight][hardening]") {
  const fs::path dir = fresh_run("wrong_type");
  write(dir / "run" / "flight" / "rank-1.json", record(1, first_ranks(2), 3));
  const auto refused = [&](const std::function<void(json&)>& edit, const std::string& says) {
    json doc = record(0, first_ranks(2), 2);
    edit(doc);
    write(dir / "run" / "flight" / "rank-0.json", doc);
    const testing::RunResult r = testing::run_booster_in(dir, "flight run");
    INFO(says << "\n" << r.out << r.err);
    CHECK(r.exit_code == 1);
    CHECK(r.out.empty());
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    CHECK_THAT(r.err, Contains("run/flight/rank-0.json is not a flight record: " + says));
  };
  // The good pair first: the edits below are what breaks it.
  json good = record(0, first_ranks(2), 2);
  write(dir / "run" / "flight" / "rank-0.json", good);
  const testing::RunResult ok = testing::run_booster_in(dir, "flight run");
  INFO(ok.err);
  REQUIRE(ok.exit_code == 0);
  REQUIRE_THAT(ok.out, Contains("rank 0 waits in all_reduce #3"));

  refused([](json& d) { d["reason"] = 5; }, "reason is 5, not a string");
  refused([](json& d) { d["pid"] = "x"; }, "pid is \"x\", not an integer");
  refused([](json& d) { d["clock"]["wall_ns"] = "noon"; }, "clock.wall_ns is \"noon\", not an integer");
  refused([](json& d) { d["groups"][0]["size"] = "2"; }, "groups[0].size is \"2\", not an integer");
  refused([](json& d) { d["groups"][0]["name"] = 7; }, "groups[0].name is 7, not a string");
  refused([](json& d) { d["groups"][0]["rank"] = int64_t(1) << 40; },
          "groups[0].rank is 1099511627776, not an integer from");
  refused([](json& d) { d["groups"][0].erase("backend"); }, "groups[0].backend is missing");
  refused([](json& d) { d["entries"][1]["state"] = 3; }, "entries[1].state is 3, not a string");
  refused([](json& d) { d["entries"][0]["op"] = nullptr; }, "entries[0].op is null, not a string");
  refused([](json& d) { d["entries"][0]["peer"] = int64_t(1) << 40; }, "entries[0].peer is 1099511627776");
  refused([](json& d) { d["entries"][2]["seq"] = -3; }, "entries[2].seq is -3, not an integer of at least 0");
}

// The world group and a subgroup of the same 10^6 ranks in reverse order (named by world rank through
// its member list), one record: every step is linear or n log n in the ranks. Tests never time; a
// quadratic step takes minutes, which the 60 s limit turns into a failure with a message.
TEST_CASE("booster flight: a record of a world of a million ranks is read in seconds", "[cli][flight][hardening]") {
  constexpr int kRanks = 1'000'000;
  const fs::path dir = fresh_run("million");
  json doc = record(0, first_ranks(kRanks), 56);
  std::vector<int> reversed = first_ranks(kRanks);
  std::reverse(reversed.begin(), reversed.end());
  json sub = doc["groups"][0];
  sub["index"] = 1;
  sub["name"] = "reversed";
  sub["rank"] = kRanks - 1;
  sub["last_started"] = 0;
  sub["completed_through"] = 0;
  sub["world_ranks"] = reversed;
  doc["groups"].push_back(std::move(sub));
  write(dir / "run" / "flight" / "rank-0.json", doc);

  const testing::RunResult r = testing::run_booster_in(dir, "flight run", "timeout -k 5 60");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);  // 124: the 60 s limit
  CHECK_THAT(r.out, Contains("records of rank 0 (world of 1000000; no record from ranks 1-999999)"));
  CHECK_THAT(r.out, Contains("group \"world\" (mpi, 1000000 ranks): rank 0 waits in all_reduce #57"));
  CHECK_THAT(r.out, Contains("ranks 1-999999 left no record (no rank-N.json: stopped, hung or killed before they "
                             "could write one)"));
  CHECK_THAT(r.out, Contains("group \"reversed\" (mpi, 1000000 ranks): no collective recorded; world ranks 1-999999 "
                             "(ranks 999998, 999997, "));
  CHECK(r.out.size() < 20'000'000);
}
