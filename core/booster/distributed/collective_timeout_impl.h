// What the mpi and nccl groups share to time collectives out (Note [Collective timeouts] in
// README.md): the numbering of collectives, the back-off of a wait, the census that finds the
// ranks that did not arrive, and the message. Internal: not installed (an -impl header).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if defined(BOOSTER_WITH_MPI)
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>
#endif

#include "booster/distributed/flight_recorder_impl.h"  // CollectiveOp, collective_name, the recorder

namespace booster::distributed::detail {

using Clock = std::chrono::steady_clock;
using Seconds = std::chrono::duration<double>;

// One started collective, as its timeout names it.
struct Collective {
  CollectiveOp op = CollectiveOp::AllReduce;
  uint64_t seq = 0;  // 1, 2, ... in start order on the group: the same collective on every rank
  Clock::time_point start;
  Seconds timeout{0};
  size_t bytes = 0;  // this rank's share of the data it moves, which sets how long waiting may spin
  int peer = -1;     // SendRecv: the first peer of the batch
  FlightId flight;   // its record in the flight recorder (detail::flight_start); id 0: none
  Clock::time_point deadline() const { return start + std::chrono::duration_cast<Clock::duration>(timeout); }
};

// The flight recorder's calls for `what` (flight_recorder_impl.h): its start, and at its timeout, the
// ring marked and written (when a directory is set) naming it and `group`.
inline FlightId flight_start(int group, const Collective& what, const DType* dtype) {
  return flight_start(group, what.op, what.seq, what.start, what.bytes, what.peer, dtype);
}
void flight_dump_on_timeout(const Collective& what, const std::string& group);

// Note [Collective timeouts], "Waiting": polls back to back while the collective's data could still be
// moving (kSpinBase plus a nanosecond per byte, 1 GB/s), then sleeps between polls, each sleep twice
// the last, from kFirstSleep up to kMaxSleep.
class Backoff {
 public:
  static constexpr std::chrono::nanoseconds kSpinBase{100'000};
  static constexpr std::chrono::microseconds kFirstSleep{10};
  static constexpr std::chrono::microseconds kMaxSleep{250};

  explicit Backoff(size_t bytes = 0)
      : spin_until_(Clock::now() +
                    std::chrono::duration_cast<Clock::duration>(kSpinBase + std::chrono::nanoseconds(bytes))) {}
  // True once the loop sleeps between polls (then it also answers census queries).
  bool sleeping(Clock::time_point now) const { return now >= spin_until_; }
  void pause(Clock::time_point now) {
    if (!sleeping(now)) return;
    std::this_thread::sleep_for(sleep_);
    sleep_ = std::min(sleep_ * 2, kMaxSleep);
  }

 private:
  Clock::time_point spin_until_;
  std::chrono::microseconds sleep_ = kFirstSleep;
};

// Ranks of a group as messages name them: "rank 1", "ranks 0, 2-4" where the group is the world
// (world_of empty); in a subgroup by world rank, the group's own numbers after them: "world rank 5
// (rank 1 of the group)", so the process named is the one the launcher and the other messages name.
// world_of[r]: the world rank of group rank r.
std::string rank_names(const std::vector<int>& ranks, const std::vector<int>& world_of);

// The DistributedError message of `what`, which timed out on group rank `rank` of the `size` ranks of
// `group` after `waited`; `who` is what the census found (Census::take), or why there was none; ranks
// are named by rank_names with `world_of`.
std::string timeout_message(const Collective& what, const std::string& group, int size, int rank,
                            const std::vector<int>& world_of, Seconds waited, const std::string& who);

#if defined(BOOSTER_WITH_MPI)

// MPI_SUCCESS, or DistributedError naming `op`, the MPI `call`, this rank and MPI's error string.
void check_mpi(int code, const char* op, const char* call);
// The world rank of each rank of `comm`, or empty when `comm` holds the world's ranks in its order.
std::vector<int> world_ranks_of(MPI_Comm comm);
// Records that a collective timed out in this process: exit then aborts the job (Note [Failing ranks]).
void note_collective_timeout();

// Note [Collective timeouts], the census, on a communicator of its own.
class Census {
 public:
  // Duplicates `parent` (collective over its ranks). `mpi_mutex`, when not null, serializes every MPI
  // call (MPI without MPI_THREAD_MULTIPLE); it must outlive the census.
  Census(MPI_Comm parent, std::mutex* mpi_mutex);
  ~Census();
  Census(const Census&) = delete;
  Census& operator=(const Census&) = delete;

  // Between two polls of a wait: answers every query of a rank that timed out with this rank's state,
  // `started` collectives and the one it waits for (null: none).
  void answer(uint64_t started, const Collective* waiting);
  // For `what`, which timed out here after this rank started `started` collectives: queries every
  // other rank and listens for min(2 s, the timeout) or until all answered. Returns what it found:
  // "rank 1 did not arrive (...); rank 0 waited", or that every rank arrived.
  std::string take(uint64_t started, const Collective& what);

 private:
  struct Record;
  void send(const Record& record, int to);
  bool receive(int tag, int* from, Record* record, const char* op);

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::vector<int> world_of_;  // world_ranks_of(comm_)
  std::mutex* mpi_mutex_;
  std::mutex sends_mutex_;
  std::vector<std::pair<std::unique_ptr<Record>, MPI_Request>> sends_;  // records in flight
};

#endif

}  // namespace booster::distributed::detail
