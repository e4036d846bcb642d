// The recording side of the flight recorder (flight_recorder.h, Note [Flight recorder] in README.md):
// what the mpi and nccl groups call when a collective starts and ends. Internal: not installed.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "booster/tensor/dtype.h"

namespace booster::distributed::detail {

// The collectives a census record and a flight record name, by index so that a record is plain bytes.
// SendRecv is a batch of point-to-point operations: not numbered, and not a census's business (only
// its peers take part).
enum class CollectiveOp : int32_t { AllReduce, Broadcast, AllGather, ReduceScatter, Barrier, SendRecv };
const char* collective_name(CollectiveOp op);

// The ring keeps this many operations of the process, all groups together.
inline constexpr size_t kFlightRingSize = 256;

enum class FlightState : int8_t { Started, Completed, TimedOut };

// The process's world rank, which names its record (rank-<world rank>.json): set by every group's
// constructor, before its first collective (and by flight_register_group of the world group).
void flight_set_world_rank(int rank);

// Makes a group known to the recorder (once per group, not per collective): its backend ("mpi",
// "nccl"), name, size, this process's rank in it and the world rank of each of its ranks (empty: the
// world itself, in order). Returns the index its records name.
int flight_register_group(const char* backend, const std::string& name, int size, int rank,
                          const std::vector<int>& world_of);

// What flight_end takes: the operation's ring entry (`id`), and its group and number, which the
// group's counters need once the entry has left the ring.
struct FlightId {
  uint64_t id = 0;  // 0: not recorded
  int32_t group = -1;
  uint64_t seq = 0;
};

// Records that an operation started on group `group` (flight_register_group's index): `op` numbered
// `seq` in the group (0: a point-to-point batch), at `start`, moving `bytes`, with `peer` (a batch's
// first peer, else -1) and elements of `dtype` (null for a barrier); returns what flight_end takes. No
// allocation: a slot of the ring is overwritten and the group's counters moved under a mutex.
// (collective_timeout_impl.h has the form that takes a Collective, and flight_dump_on_timeout.)
FlightId flight_start(int group, CollectiveOp op, uint64_t seq, std::chrono::steady_clock::time_point start,
                      size_t bytes, int peer, const DType* dtype);
// Records the end of the operation `id`: completed, or timed out. Its entry changes only while the
// ring still holds it and it has not ended; a completed collective always moves its group's counters
// (Note [Flight recorder], "Counters"), whether or not its entry is still there.
void flight_end(const FlightId& id, FlightState state);

// Tests: the ring's entries as a fatal-signal handler reads them (without the mutex, from any thread),
// oldest first, an entry being written at that moment left out: {id, seq, bytes} each.
std::vector<std::array<uint64_t, 3>> flight_snapshot_unlocked_for_testing();

// Tests: forgets every record and group, and the directory set (BOOSTER_FLIGHT_DIR is read again).
void flight_reset_for_testing();

}  // namespace booster::distributed::detail
