// The flight recorder (Note [Flight recorder] in core/booster/distributed/README.md): the ring keeps the
// last 256 operations in order, a dump reads back as what was recorded (also from a fatal signal), the
// analysis names the first collective the ranks did not all complete and where each rank stands, and
// end to end: a 2-rank `booster train` whose rank 1 is stopped leaves rank 0's record, and `booster
// flight` names the collective and the stopped rank.
#include <catch2/catch.hpp>

#include <signal.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "booster/common/error.h"
#include "booster/distributed/flight_recorder.h"
#include "booster/distributed/flight_recorder_impl.h"
#include "booster/distributed/mpi_process_group.h"
#include "run_booster.h"
#include "skip.h"

using namespace booster;
using namespace booster::distributed;
using nlohmann::json;
namespace fs = std::filesystem;
namespace fr = booster::distributed::detail;

namespace {

fs::path fresh_dir(const std::string& name) {
  const fs::path dir = testing::scratch_dir("test_flight_recorder") / name;
  fs::remove_all(dir);
  return dir;
}

// Records an operation as the groups do when they start one.
fr::FlightId start(int group, fr::CollectiveOp op, uint64_t seq, size_t bytes, const DType* dtype, int peer = -1) {
  return fr::flight_start(group, op, seq, std::chrono::steady_clock::now(), bytes, peer, dtype);
}

// A hand-made record of world rank `rank`: one 2- or 3-rank world group, and `entries` as
// {seq, op, state} of that group. The group's counters say what the entries say (the ring held
// every collective since #1).
struct Op {
  uint64_t seq;
  std::string op, state;
};
json record(int rank, int world, const std::vector<Op>& ops, const std::vector<int>& members = {},
            const std::string& group = "world") {
  std::vector<int> world_ranks = members;
  if (world_ranks.empty())
    for (int r = 0; r < world; ++r) world_ranks.push_back(r);
  int group_rank = 0;
  for (size_t i = 0; i < world_ranks.size(); ++i)
    if (world_ranks[i] == rank) group_rank = int(i);
  uint64_t last_started = 0, completed_through = 0;
  std::map<uint64_t, bool> done;
  for (const Op& o : ops) {
    last_started = std::max(last_started, o.seq);
    done[o.seq] = o.state == "completed";
  }
  while (done.count(completed_through + 1) && done[completed_through + 1]) ++completed_through;
  json doc = {{"format", "booster-flight-recorder"}, {"version", 2}, {"world_rank", rank}, {"reason", "test"},
              {"clock", {{"steady_ns", int64_t(10'000'000'000)}, {"wall_ns", int64_t(1'700'000'000'000'000'000)}}},
              {"groups", json::array({{{"index", 0}, {"backend", "mpi"}, {"name", group}, {"instance", 0},
                                       {"size", world_ranks.size()}, {"rank", group_rank},
                                       {"last_started", last_started}, {"completed_through", completed_through},
                                       {"world_ranks", world_ranks}}})},
              {"entries", json::array()}};
  int64_t t = 1'000'000'000;
  for (const Op& o : ops) {
    json e = {{"id", doc["entries"].size() + 1}, {"seq", o.seq}, {"op", o.op}, {"group", group}, {"group_index", 0},
              {"group_size", world_ranks.size()}, {"rank", group_rank}, {"peer", -1}, {"bytes", 64},
              {"dtype", "float32"}, {"state", o.state}, {"start_ns", t}, {"end_ns", nullptr}};
    t += 1'000'000;
    if (o.state != "started") e["end_ns"] = t;
    doc["entries"].push_back(e);
  }
  return doc;
}

// Ops #1..#n completed, alternating all_reduce and broadcast (so #56 is a broadcast).
std::vector<Op> completed_up_to(uint64_t n) {
  std::vector<Op> ops;
  for (uint64_t s = 1; s <= n; ++s) ops.push_back({s, s % 2 ? "all_reduce" : "broadcast", "completed"});
  return ops;
}

std::vector<Op> plus(std::vector<Op> ops, const Op& more) {
  ops.push_back(more);
  return ops;
}

}  // namespace

TEST_CASE("flight recorder: the ring keeps the last 256 operations in order", "[distributed][flight]") {
  fr::flight_reset_for_testing();
  const fs::path dir = fresh_dir("ring");
  set_flight_dump_dir(dir);
  const int g = fr::flight_register_group("mpi", "world", 2, 0, {});
  const DType f32 = DType::Float32;
  for (uint64_t s = 1; s <= 300; ++s) {
    const fr::FlightId id = start(g, s % 3 ? fr::CollectiveOp::AllReduce : fr::CollectiveOp::Broadcast, s, s * 8, &f32);
    if (s < 300) fr::flight_end(id, fr::FlightState::Completed);
  }
  const fs::path file = dump_flight_record("the ring test");
  CHECK(file == dir / "rank-0.json");
  const std::vector<json> records = load_flight_records(dir);
  REQUIRE(records.size() == 1);
  const json& entries = records[0]["entries"];
  REQUIRE(entries.size() == fr::kFlightRingSize);
  for (size_t i = 0; i < entries.size(); ++i) {
    const uint64_t seq = 300 - fr::kFlightRingSize + 1 + i;  // 45 .. 300, oldest first
    INFO("entry " << i);
    CHECK(entries[i]["seq"] == seq);
    CHECK(entries[i]["bytes"] == seq * 8);
    CHECK(entries[i]["op"] == (seq % 3 ? "all_reduce" : "broadcast"));
    CHECK(entries[i]["state"] == (seq < 300 ? "completed" : "started"));
  }
  CHECK(entries.back()["end_ns"].is_null());
  fr::flight_reset_for_testing();
}

TEST_CASE("flight recorder: a dump reads back as recorded", "[distributed][flight]") {
  fr::flight_reset_for_testing();
  const fs::path dir = fresh_dir("round_trip");
  // Without a directory nothing is written.
  CHECK(dump_flight_record("no directory").empty());
  set_flight_dump_dir(dir);
  CHECK(flight_dump_dir() == dir);
  const int world = fr::flight_register_group("mpi", "world", 3, 1, {});
  const int sub = fr::flight_register_group("nccl", "tp \"a\"", 2, 0, {1, 2});
  const DType bf16 = DType::BFloat16, i64 = DType::Int64;
  const fr::FlightId a = start(world, fr::CollectiveOp::AllReduce, 1, 1000, &bf16);
  fr::flight_end(a, fr::FlightState::Completed);
  fr::flight_end(a, fr::FlightState::TimedOut);  // an end after the end changes nothing
  const fr::FlightId b = start(sub, fr::CollectiveOp::Barrier, 1, 0, nullptr);
  start(world, fr::CollectiveOp::SendRecv, 0, 48, &i64, 2);  // still running
  // What a group does at a timeout (flight_dump_on_timeout): the collective marked, the ring written.
  fr::flight_end(b, fr::FlightState::TimedOut);
  REQUIRE(dump_flight_record("barrier #1 on group \"tp \\\"a\\\"\" timed out") == dir / "rank-1.json");
  // No temporary file is left beside the record.
  CHECK(std::distance(fs::directory_iterator(dir), fs::directory_iterator()) == 1);

  const json doc = load_flight_records(dir).at(0);
  CHECK(doc["world_rank"] == 1);  // the world group's rank
  CHECK(doc["reason"] == "barrier #1 on group \"tp \\\"a\\\"\" timed out");
  REQUIRE(doc["groups"].size() == 2);
  CHECK(doc["groups"][0]["world_ranks"] == json({0, 1, 2}));
  CHECK(doc["groups"][1]["name"] == "tp \"a\"");
  CHECK(doc["groups"][1]["backend"] == "nccl");
  CHECK(doc["groups"][1]["world_ranks"] == json({1, 2}));
  const json& e = doc["entries"];
  REQUIRE(e.size() == 3);
  CHECK(e[0]["op"] == "all_reduce");
  CHECK(e[0]["dtype"] == "bfloat16");
  CHECK(e[0]["state"] == "completed");
  CHECK(e[0]["group"] == "world");
  CHECK(e[0]["group_size"] == 3);
  CHECK(e[0]["rank"] == 1);
  CHECK(e[0]["end_ns"].get<int64_t>() >= e[0]["start_ns"].get<int64_t>());
  CHECK(e[1]["op"] == "barrier");
  CHECK(e[1]["dtype"].is_null());
  CHECK(e[1]["group"] == "tp \"a\"");
  CHECK(e[1]["state"] == "timed_out");
  CHECK(e[1]["end_ns"].get<int64_t>() >= e[1]["start_ns"].get<int64_t>());
  CHECK(e[2]["op"] == "send/recv");
  CHECK(e[2]["seq"] == 0);
  CHECK(e[2]["peer"] == 2);
  CHECK(e[2]["dtype"] == "int64");
  CHECK(e[2]["state"] == "started");
  CHECK(e[2]["end_ns"].is_null());
  fr::flight_reset_for_testing();
}

// Note [Flight recorder], "Dumping": a process that does not know its world rank yet (an nccl subgroup's
// record before any world group told it) does not write rank-0.json over rank 0's record, and `booster
// flight` reads and names what it writes.
TEST_CASE("flight recorder: a process of unknown world rank writes rank-unknown-<pid>.json",
          "[distributed][flight][cli]") {
  fr::flight_reset_for_testing();
  const fs::path dir = fresh_dir("unknown_rank");
  set_flight_dump_dir(dir / "run" / "flight");
  const int g = fr::flight_register_group("nccl", "tp", 2, 1, {2, 3});
  const DType f32 = DType::Float32;
  start(g, fr::CollectiveOp::AllReduce, 1, 64, &f32);
  const std::string unknown = "rank-unknown-" + std::to_string(::getpid()) + ".json";
  REQUIRE(dump_flight_record("test") == dir / "run" / "flight" / unknown);
  CHECK_FALSE(fs::exists(dir / "run" / "flight" / "rank-0.json"));
  const json doc = load_flight_records(dir / "run" / "flight").at(0);
  CHECK(doc["world_rank"].is_null());
  CHECK(record_world_rank(doc) == 3);  // rank 1 of a group of world ranks 2, 3
  std::ofstream(dir / "run" / "flight" / "rank-2.json") << record(2, 4, plus({}, {1, "all_reduce", "completed"}), {2, 3}, "tp").dump();
  const testing::RunResult r = testing::run_booster_in(dir, "flight run");
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.out, Catch::Contains("; 1 from a process that did not know its rank)"));
  CHECK_THAT(r.out, Catch::Contains("rank unknown (" + unknown + "; rank 3 by its groups) wrote it on: test"));
  CHECK_THAT(r.out, Catch::Contains("world rank 3 (rank 1 of the group) waits in all_reduce #1"));
  // Once a group's constructor sets it, the file is named by the world rank.
  fr::flight_set_world_rank(3);
  CHECK(dump_flight_record("test") == dir / "run" / "flight" / "rank-3.json");
  fr::flight_reset_for_testing();
}

// Dumps from several threads while the directory changes: each returns the file it wrote, in one of
// the directories set, whole.
TEST_CASE("flight recorder: dumps while the directory changes return the file each wrote", "[distributed][flight]") {
  fr::flight_reset_for_testing();
  const fs::path a = fresh_dir("race_a_long_name"), b = fresh_dir("rb");
  set_flight_dump_dir(a);
  fr::flight_register_group("mpi", "world", 1, 0, {});
  std::atomic<bool> stop{false};
  std::thread setter([&] {
    for (int i = 0; !stop.load(); ++i) set_flight_dump_dir(i % 2 ? a : b);
  });
  std::vector<std::string> bad, bad_other;
  std::thread other([&] {
    for (int i = 0; i < 100; ++i) {
      const fs::path p = dump_flight_record("other");
      if (p != a / "rank-0.json" && p != b / "rank-0.json") bad_other.push_back(p.string());
    }
  });
  for (int i = 0; i < 100; ++i) {
    const fs::path p = dump_flight_record("main");
    if (p != a / "rank-0.json" && p != b / "rank-0.json") bad.push_back(p.string());
  }
  other.join();
  stop = true;
  setter.join();
  CHECK(bad.empty());
  CHECK(bad_other.empty());
  fr::flight_reset_for_testing();
}

// Note [Flight recorder], "Signals": the handler writes the record and the process still dies of the
// signal (the handler before it, here the default, runs after).
TEST_CASE("flight recorder: a fatal signal writes the record and still ends the process", "[distributed][flight]") {
  for (const int signal : {SIGSEGV, SIGABRT}) {
    const fs::path dir = fresh_dir("signal_" + std::to_string(signal));
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      std::signal(signal, SIG_DFL);  // not Catch's handler, which would report a failure from this copy
      fr::flight_reset_for_testing();
      set_flight_dump_dir(dir);
      const int g = fr::flight_register_group("mpi", "world", 2, 1, {});
      const DType f32 = DType::Float32;
      start(g, fr::CollectiveOp::AllGather, 7, 64, &f32);
      raise(signal);
      _exit(0);  // not reached: the signal ends the process
    }
    int status = 0;
    REQUIRE(waitpid(child, &status, 0) == child);
    INFO("signal " << signal);
    CHECK(WIFSIGNALED(status));
    CHECK(WTERMSIG(status) == signal);
    const json doc = load_flight_records(dir).at(0);
    CHECK(doc["reason"] == std::string("fatal signal ") + (signal == SIGSEGV ? "SIGSEGV" : "SIGABRT"));
    REQUIRE(doc["entries"].size() == 1);
    CHECK(doc["entries"][0]["op"] == "all_gather");
    CHECK(doc["entries"][0]["seq"] == 7);
  }
}

namespace {

// Waits up to `seconds` for `child`; kills it (and returns false) when it has not ended by then.
bool wait_for(pid_t child, int& status, double seconds) {
  for (int i = 0; i < int(seconds * 100); ++i) {
    if (waitpid(child, &status, WNOHANG) == child) return true;
    usleep(10000);
  }
  kill(child, SIGKILL);
  waitpid(child, &status, 0);
  return false;
}

// What a previous SA_SIGINFO handler saw, written to a file it names.
const char* g_seen_path = nullptr;
void report_siginfo(int, siginfo_t* info, void*) {
  char text[64];
  const int n = std::snprintf(text, sizeof text, "%d %lu\n", info->si_code,
                              static_cast<unsigned long>(reinterpret_cast<uintptr_t>(info->si_addr)));
  const int fd = ::open(g_seen_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  (void)!::write(fd, text, size_t(n));
  ::close(fd);
  _exit(3);
}

// Installs `handler` (SA_SIGINFO) for SIGSEGV; the handler it replaced goes to `replaced` when given.
void on_segv(void (*handler)(int, siginfo_t*, void*), struct sigaction* replaced = nullptr) {
  struct sigaction action {};
  action.sa_sigaction = handler;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_SIGINFO;
  sigaction(SIGSEGV, &action, replaced);
}

// A handler that chains back to the one it replaced, as crash reporters do.
struct sigaction g_replaced {};
void chain_back(int signal, siginfo_t*, void*) {
  sigaction(signal, &g_replaced, nullptr);
  raise(signal);
}

void fault_at(uintptr_t address) {
  volatile uintptr_t opaque = address;  // not a constant the compiler could flag as out of bounds
  *reinterpret_cast<volatile int*>(opaque) = 1;
}

}  // namespace

TEST_CASE("flight recorder: a real fault reaches the previous handler with its own address and handlers "
          "that chain to each other end the process", "[distributed][flight]") {
  {
    // A previous SA_SIGINFO handler (as OpenMPI's backtrace) sees the kernel's fault: si_code > 0 and the
    // faulting address, not a re-raised signal's.
    const fs::path dir = fresh_dir("real_fault");
    const fs::path seen = dir / "seen.txt";
    const std::string seen_path = seen.string();
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      g_seen_path = seen_path.c_str();
      on_segv(&report_siginfo);
      fr::flight_reset_for_testing();
      set_flight_dump_dir(dir);
      fault_at(0x40);
      _exit(0);
    }
    int status = 0;
    REQUIRE(wait_for(child, status, 20));
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 3);
    std::ifstream in(seen);
    int code = 0;
    unsigned long address = 0;
    in >> code >> address;
    CHECK(code > 0);  // SEGV_MAPERR: from the kernel
    CHECK(address == 0x40);
    CHECK(load_flight_records(dir).at(0)["reason"] == "fatal signal SIGSEGV");
  }
  {
    // Ours, then a handler that chains back to ours, then ours again on top (a second
    // set_flight_dump_dir): a fault must still end the process, by SIGSEGV.
    const fs::path dir = fresh_dir("chain_back");
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      std::signal(SIGSEGV, SIG_DFL);
      fr::flight_reset_for_testing();
      set_flight_dump_dir(dir);
      on_segv(&chain_back, &g_replaced);
      set_flight_dump_dir(dir);
      fault_at(0x40);
      _exit(0);
    }
    int status = 0;
    REQUIRE(wait_for(child, status, 20));
    CHECK(WIFSIGNALED(status));
    CHECK(WTERMSIG(status) == SIGSEGV);
  }
}

// Note [Flight recorder], "Signals": a fatal-signal handler reads the ring without its mutex while other
// threads write it; an entry being written is left out whole, never read half old, half new.
TEST_CASE("flight recorder: a read without the lock never sees a torn entry", "[distributed][flight]") {
  fr::flight_reset_for_testing();
  const int g = fr::flight_register_group("mpi", "world", 2, 0, {});
  const DType f32 = DType::Float32;
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> written{0};
  // Only this thread records: entry #n is collective #n, of 8n bytes.
  std::thread writer([&] {
    for (uint64_t s = 1; !stop.load(); ++s) {
      fr::flight_end(start(g, fr::CollectiveOp::AllReduce, s, s * 8, &f32), fr::FlightState::Completed);
      written.store(s);
    }
  });
  while (written.load() < 1000) std::this_thread::yield();
  size_t torn = 0, seen = 0;
  for (int i = 0; i < 600000; ++i)
    for (const auto& [id, seq, bytes] : fr::flight_snapshot_unlocked_for_testing()) {
      ++seen;
      torn += seq != id || bytes != 8 * id;
    }
  stop = true;
  writer.join();
  CHECK(seen > 0);
  CHECK(torn == 0);
  fr::flight_reset_for_testing();
}

TEST_CASE("flight analysis: a rank behind the others never started the collective they wait in",
          "[distributed][flight]") {
  const std::vector<json> records = {
      record(0, 3, plus(completed_up_to(56), {57, "all_reduce", "started"})),
      record(1, 3, completed_up_to(56)),
      record(2, 3, plus(completed_up_to(56), {57, "all_reduce", "timed_out"}))};
  const std::vector<FlightGroupFinding> findings = analyze_flight_records(records);
  REQUIRE(findings.size() == 1);
  const FlightGroupFinding& f = findings[0];
  INFO(f.text);
  CHECK(f.group == "world");
  CHECK(f.seq == 57);
  CHECK(f.op == "all_reduce");
  CHECK(f.waiting == std::vector<int>{0, 2});
  CHECK(f.not_started == std::vector<int>{1});
  CHECK(f.missing.empty());
  CHECK_FALSE(f.ops_disagree);
  CHECK_THAT(f.text, Catch::StartsWith("group \"world\" (mpi, 3 ranks): "));
  CHECK_THAT(f.text, Catch::Contains("rank 0 waits in all_reduce #57"));
  CHECK_THAT(f.text, Catch::Contains("rank 2 timed out in all_reduce #57 (after 0.0 s; started "));
  CHECK_THAT(f.text, Catch::Contains("rank 1 never started it, its last completed is #56 broadcast"));
  // Two ranks in it alike read as one clause.
  const std::vector<json> both = {record(0, 3, plus(completed_up_to(56), {57, "all_reduce", "started"})),
                                  record(1, 3, completed_up_to(56)),
                                  record(2, 3, plus(completed_up_to(56), {57, "all_reduce", "started"}))};
  CHECK_THAT(analyze_flight_records(both).at(0).text, Catch::Contains("ranks 0, 2 wait in all_reduce #57; rank 1 never "
                                                                      "started it, its last completed is #56 broadcast"));
}

TEST_CASE("flight analysis: ranks in different ops at the same sequence number disagree", "[distributed][flight]") {
  const std::vector<json> records = {record(0, 2, plus(completed_up_to(4), {5, "all_reduce", "timed_out"})),
                                     record(1, 2, plus(completed_up_to(4), {5, "broadcast", "started"}))};
  const FlightGroupFinding f = analyze_flight_records(records).at(0);
  INFO(f.text);
  CHECK(f.seq == 5);
  CHECK(f.ops_disagree);
  CHECK(f.waiting == std::vector<int>{0, 1});
  CHECK_THAT(f.text, Catch::Contains("the ranks disagree on collective #5: rank 0 all_reduce, rank 1 broadcast"));
}

TEST_CASE("flight analysis: nothing is pending when every rank completed the same collectives",
          "[distributed][flight]") {
  const std::vector<json> records = {record(0, 2, completed_up_to(10)), record(1, 2, completed_up_to(10))};
  const FlightGroupFinding f = analyze_flight_records(records).at(0);
  INFO(f.text);
  CHECK(f.seq == 0);
  CHECK(f.waiting.empty());
  CHECK(f.not_started.empty());
  CHECK(f.text == "group \"world\" (mpi, 2 ranks): nothing pending: every rank completed every collective it "
                  "started, up to #10 broadcast");
}

TEST_CASE("flight analysis: a rank that completed it stands later, and a missing rank is named",
          "[distributed][flight]") {
  // Rank 0 completed #3 and waits in #4; rank 1 still waits in #3; rank 2 wrote nothing.
  const std::vector<json> records = {
      record(0, 3, plus(completed_up_to(3), {4, "broadcast", "started"})),
      record(1, 3, plus(completed_up_to(2), {3, "all_reduce", "started"}))};
  const FlightGroupFinding f = analyze_flight_records(records).at(0);
  INFO(f.text);
  CHECK(f.seq == 3);
  CHECK(f.completed == std::vector<int>{0});
  CHECK(f.waiting == std::vector<int>{1});
  CHECK(f.missing == std::vector<int>{2});
  CHECK_THAT(f.text, Catch::Contains("rank 0 completed it; waits in broadcast #4"));
  CHECK_THAT(f.text, Catch::Contains("rank 2 left no record (no rank-2.json"));
}

TEST_CASE("flight analysis: groups of one name with other members are told apart, by world rank",
          "[distributed][flight]") {
  // Two "tp" groups: world ranks {0, 1} and {2, 3}. In the second, world rank 3 is behind.
  const std::vector<json> records = {
      record(0, 4, completed_up_to(5), {0, 1}, "tp"), record(1, 4, completed_up_to(5), {0, 1}, "tp"),
      record(2, 4, plus(completed_up_to(5), {6, "all_reduce", "started"}), {2, 3}, "tp"),
      record(3, 4, completed_up_to(5), {2, 3}, "tp")};
  const std::vector<FlightGroupFinding> findings = analyze_flight_records(records);
  REQUIRE(findings.size() == 2);
  CHECK(findings[0].seq == 0);
  CHECK(findings[1].seq == 6);
  INFO(findings[1].text);
  CHECK_THAT(findings[1].text, Catch::Contains("world rank 2 (rank 0 of the group) waits in all_reduce #6"));
  CHECK_THAT(findings[1].text, Catch::Contains("world rank 3 (rank 1 of the group) never started it"));
}

// Note [Flight recorder], "Counters": more than 256 operations after a collective that is still running
// push its entry out of the ring; the group's counters still say it did not complete.
TEST_CASE("flight analysis: a collective still running after 256 later ones is not reported completed",
          "[distributed][flight]") {
  fr::flight_reset_for_testing();
  const fs::path dir = fresh_dir("pushed_out_pending");
  set_flight_dump_dir(dir);
  const int g = fr::flight_register_group("nccl", "world", 2, 0, {});
  const DType f32 = DType::Float32;
  start(g, fr::CollectiveOp::AllReduce, 1, 64, &f32);  // never ends
  for (uint64_t s = 2; s <= 301; ++s) fr::flight_end(start(g, fr::CollectiveOp::AllReduce, s, 64, &f32), fr::FlightState::Completed);
  REQUIRE(dump_flight_record("test") == dir / "rank-0.json");
  const json mine = load_flight_records(dir).at(0);
  CHECK(mine["groups"][0]["last_started"] == 301);
  CHECK(mine["groups"][0]["completed_through"] == 0);
  CHECK(mine["entries"][0]["seq"] == 301 - fr::kFlightRingSize + 1);  // #1 has left the ring
  // Rank 1 completed #1 and everything up to #301.
  std::vector<Op> ops;
  for (uint64_t s = 1; s <= 301; ++s) ops.push_back({s, "all_reduce", "completed"});
  json other = record(1, 2, ops);
  other["groups"][0]["backend"] = "nccl";
  const FlightGroupFinding f = analyze_flight_records({mine, other}).at(0);
  INFO(f.text);
  CHECK(f.seq == 1);
  CHECK(f.unknown == std::vector<int>{0});
  CHECK(f.completed == std::vector<int>{1});
  CHECK_THAT(f.text, Catch::Contains("rank 0: unknown (its record no longer holds #1; started, and completed only "
                                     "through #0)"));
  // A collective completed out of order counts once the ones before it have.
  fr::flight_reset_for_testing();
  set_flight_dump_dir(dir);
  const int h = fr::flight_register_group("mpi", "world", 2, 0, {});
  const fr::FlightId one = start(h, fr::CollectiveOp::AllReduce, 1, 8, &f32);
  const fr::FlightId two = start(h, fr::CollectiveOp::AllReduce, 2, 8, &f32);
  fr::flight_end(two, fr::FlightState::Completed);
  REQUIRE(!dump_flight_record("test").empty());
  CHECK(load_flight_records(dir).at(0)["groups"][0]["completed_through"] == 0);
  fr::flight_end(one, fr::FlightState::Completed);
  REQUIRE(!dump_flight_record("test").empty());
  CHECK(load_flight_records(dir).at(0)["groups"][0]["completed_through"] == 2);
  fr::flight_reset_for_testing();
}

// Another group's traffic pushed every entry of the world group out of rank 0's ring: its counters still
// say it completed #1..#10 and never started #11, which rank 1 waits in.
TEST_CASE("flight analysis: a group whose entries another group pushed out is not reported as never started",
          "[distributed][flight]") {
  fr::flight_reset_for_testing();
  const fs::path dir = fresh_dir("pushed_out_group");
  set_flight_dump_dir(dir);
  const int world = fr::flight_register_group("mpi", "world", 2, 0, {});
  const int other = fr::flight_register_group("mpi", "dp", 1, 0, {0});
  const DType f32 = DType::Float32;
  for (uint64_t s = 1; s <= 10; ++s) fr::flight_end(start(world, fr::CollectiveOp::Broadcast, s, 8, &f32), fr::FlightState::Completed);
  for (uint64_t s = 1; s <= 300; ++s) fr::flight_end(start(other, fr::CollectiveOp::AllReduce, s, 8, &f32), fr::FlightState::Completed);
  REQUIRE(dump_flight_record("test") == dir / "rank-0.json");
  const json mine = load_flight_records(dir).at(0);
  for (const json& e : mine["entries"]) REQUIRE(e["group"] == "dp");
  const std::vector<FlightGroupFinding> findings =
      analyze_flight_records({mine, record(1, 2, plus(completed_up_to(10), {11, "all_reduce", "started"}))});
  const FlightGroupFinding& f = findings.at(0);
  INFO(f.text);
  CHECK(f.group == "world");
  CHECK(f.seq == 11);
  CHECK(f.waiting == std::vector<int>{1});
  CHECK(f.not_started == std::vector<int>{0});
  CHECK_THAT(f.text, Catch::Contains("rank 0 never started it, its last completed is #10 (its record no longer holds it)"));
  // Rank 0 alone: nothing pending, up to #10.
  CHECK(analyze_flight_records({mine}).at(0).text ==
        "group \"world\" (mpi, 2 ranks): nothing pending: every rank that left a record completed every collective it "
        "started, up to #10; rank 1 left no record (no rank-1.json: stopped, hung or killed before it could write one)");
  fr::flight_reset_for_testing();
}

TEST_CASE("flight records: a missing directory, no record or a malformed one is a DataError", "[distributed][flight]") {
  const fs::path dir = fresh_dir("bad");
  CHECK_THROWS_AS(load_flight_records(dir), DataError);
  fs::create_directories(dir);
  CHECK_THROWS_WITH(load_flight_records(dir), Catch::Contains("no flight records in"));
  std::ofstream(dir / "rank-0.json") << "{\"format\": \"booster-flight-recorder\", \"world_rank\": 0, ";
  CHECK_THROWS_WITH(load_flight_records(dir), Catch::Contains("rank-0.json is not a flight record: not valid JSON"));
  json doc = record(0, 2, completed_up_to(2));
  doc["entries"][1].erase("seq");
  std::ofstream(dir / "rank-0.json") << doc.dump();
  CHECK_THROWS_WITH(load_flight_records(dir), Catch::Contains("entries[1].seq is missing"));
  std::ofstream(dir / "rank-0.json") << record(1, 2, {}).dump();
  CHECK_THROWS_WITH(load_flight_records(dir), Catch::Contains("it says world rank 1"));
}

// Every way a record can be wrong is a DataError naming the file, never another exception.
TEST_CASE("flight records: a bad rank in a name or a field of the wrong type is a DataError naming the file",
          "[distributed][flight]") {
  const fs::path dir = fresh_dir("bad_types");
  fs::create_directories(dir);
  std::ofstream(dir / "rank-99999999999.json") << record(0, 2, completed_up_to(2)).dump();
  CHECK_THROWS_AS(load_flight_records(dir), DataError);
  CHECK_THROWS_WITH(load_flight_records(dir), Catch::Contains("rank-99999999999.json is not a flight record"));
  fs::remove(dir / "rank-99999999999.json");
  const auto bad = [&](const std::function<void(json&)>& edit, const std::string& says) {
    json doc = record(0, 2, plus(completed_up_to(2), {3, "all_reduce", "started"}));
    edit(doc);
    std::ofstream(dir / "rank-0.json") << doc.dump();
    INFO(says);
    try {
      analyze_flight_records(load_flight_records(dir));
      FAIL("no error");
    } catch (const DataError& e) {
      CHECK_THAT(e.what(), Catch::Contains("rank-0.json is not a flight record") && Catch::Contains(says));
    }
  };
  bad([](json& d) { d["clock"] = 5; }, "clock is 5, not an object");
  bad([](json& d) { d["clock"]["wall_ns"] = "noon"; }, "clock.wall_ns is \"noon\", not an integer");
  bad([](json& d) { d["groups"][0]["world_ranks"] = json({0, "one"}); }, "world_ranks holds \"one\", not a rank");
  bad([](json& d) { d["groups"][0]["world_ranks"] = json({0, 1.5}); }, "world_ranks holds 1.5, not a rank");
  bad([](json& d) { d["groups"][0]["instance"] = "first"; }, "groups[0].instance is \"first\", not an integer");
  bad([](json& d) { d["entries"][0]["peer"] = "none"; }, "entries[0].peer is \"none\", not an integer");
  bad([](json& d) { d["entries"][0]["end_ns"] = "later"; }, "entries[0].end_ns is \"later\", not an integer");
}

TEST_CASE("booster flight: usage and bad input exit non-zero with one line", "[distributed][flight][cli]") {
  const fs::path dir = fresh_dir("cli");
  fs::create_directories(dir / "run" / "flight");
  testing::RunResult r = testing::run_booster_in(dir, "flight");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Catch::Contains("'booster flight' takes one run directory, got 0"));
  r = testing::run_booster_in(dir, "flight run");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Catch::Contains("no flight records in run/flight"));
  std::ofstream(dir / "run" / "flight" / "rank-0.json") << "not json";
  r = testing::run_booster_in(dir, "flight run");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Catch::Contains("rank-0.json is not a flight record"));
  std::ofstream(dir / "run" / "flight" / "rank-0.json")
      << record(0, 2, plus(completed_up_to(56), {57, "all_reduce", "started"})).dump();
  std::ofstream(dir / "run" / "flight" / "rank-1.json") << record(1, 2, completed_up_to(56)).dump();
  r = testing::run_booster_in(dir, "flight run");
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.out, Catch::Contains("records of ranks 0, 1 (world of 2)"));
  CHECK_THAT(r.out, Catch::Contains("group \"world\" (mpi, 2 ranks): rank 0 waits in all_reduce #57"));
  CHECK_THAT(r.out, Catch::Contains("rank 1 never started it, its last completed is #56 broadcast"));
}

// End to end: rank 1 of a 2-rank ddp run is stopped (SIGSTOP) mid-training; rank 0 times out in its next
// collective and writes run/flight/rank-0.json before its error ends the job; `booster flight run` then
// names that collective and rank 1. Rank 1 is found by its launcher's OMPI_COMM_WORLD_RANK and a tag of
// this test in its environment; it is sent SIGCONT and SIGKILL at the end whatever happened.
TEST_CASE("booster flight: names the collective a stopped rank left the other waiting in",
          "[distributed][flight][mpi][cli]") {
  if (!mpi_built() || !testing::have_mpirun()) {
    skip_test(!mpi_built() ? "this build has no MPI" : "no mpirun (apt-get install openmpi-bin)");
    return;
  }
  const fs::path dir = fresh_dir("e2e");
  fs::create_directories(dir);
  const std::string tag = "BOOSTER_FLIGHT_TEST_TAG=" + std::to_string(::getpid());
  const std::string script =
      "cd " + dir.string() + " || exit 99; export " + tag +
      " OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1; "
      "timeout -k 5 120 mpirun -np 2 --oversubscribe " BOOSTER_BIN_DIR "/booster train --config " BOOSTER_SOURCE_DIR
      "/tests/bad_configs/base.json --plugin ddp --set train.max_steps=100000000 --set train.epochs=100000000 "
      "--set train.log_every=100 --set train.collective_timeout_s=3 "
      "--set train.run_dir=run >stdout.txt 2>stderr.txt & job=$!; "
      // Mid-training: once rank 0 has logged some steps (an evaluation after each 2-step epoch).
      "for i in $(seq 1 1200); do [ -f run/metrics.jsonl ] && [ $(wc -l < run/metrics.jsonl) -ge 20 ] && break; "
      "sleep 0.05; done; "
      "victim=; for e in /proc/[0-9]*/environ; do env=$(tr 2>/dev/null \"\\0\" \"\\n\" < $e) || continue; "
      "if echo \"$env\" | grep -qx " + tag + " && echo \"$env\" | grep -qx OMPI_COMM_WORLD_RANK=1; then "
      "victim=${e#/proc/}; victim=${victim%/environ}; fi; done; "
      "[ -n \"$victim\" ] && kill -STOP $victim; echo \"stopped: $victim\" > victim.txt; "
      // Once rank 0 has written its record (then its census listens for 2 s), rank 1 is killed, as a lost
      // rank: the launcher would otherwise resume it (SIGCONT) on its way down, and it would time out too.
      "for i in $(seq 1 1200); do grep -q \"flight record written\" stderr.txt && break; sleep 0.05; done; "
      "[ -n \"$victim\" ] && kill -KILL $victim; "
      "wait $job; status=$?; "
      "[ -n \"$victim\" ] && { kill -CONT $victim; kill -KILL $victim; } 2>/dev/null; exit $status";
  const int raw = std::system(("bash -c '" + std::regex_replace(script, std::regex("'"), "'\\''") + "'").c_str());
  const int status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  const std::string err = testing::read_text(dir / "stderr.txt");
  INFO(testing::read_text(dir / "victim.txt"));
  INFO(err);
  REQUIRE_THAT(testing::read_text(dir / "victim.txt"), Catch::Matches("stopped: [0-9]+\\s*"));
  // mpirun exits 137 itself (rank 1 died of SIGKILL); a hang would be `timeout`'s 124, and would leave
  // no error from rank 0 (below).
  CHECK(status != 0);
  CHECK(status != 124);
  // Rank 0's error names the collective: "all_reduce on group "world" (2 ranks) timed out ... collective #N".
  std::smatch m;
  REQUIRE(std::regex_search(err, m, std::regex("rank 0 of 2: error: (\\w+) on group \"world\" \\(2 ranks\\) timed out "
                                               "after [0-9.]+ s on rank 0: rank 1 did not arrive.*It was collective #"
                                               "([0-9]+) of the group")));
  const std::string op = m[1], seq = m[2];
  CHECK(fs::exists(dir / "run" / "flight" / "rank-0.json"));
  CHECK_FALSE(fs::exists(dir / "run" / "flight" / "rank-1.json"));  // stopped, then killed
  CHECK_THAT(err, Catch::Contains("booster: flight record written to run/flight/rank-0.json"));

  const testing::RunResult r = testing::run_booster_in(dir, "flight run");
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.out, Catch::Contains("records of rank 0 (world of 2; no record from rank 1)"));
  CHECK_THAT(r.out, Catch::Contains("group \"world\" (mpi, 2 ranks): rank 0 timed out in " + op + " #" + seq + " (after "));
  CHECK_THAT(r.out, Catch::Contains("rank 1 left no record (no rank-1.json: stopped, hung or killed before it could "
                                    "write one)"));
}
