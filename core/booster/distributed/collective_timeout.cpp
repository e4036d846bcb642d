#include "booster/distributed/collective_timeout_impl.h"

#include <cstdio>
#include <optional>

#include "booster/common/error.h"

namespace booster::distributed::detail {

namespace {

// How long a timed-out rank listens for the others' records, at most (and at most the timeout).
constexpr Seconds kCensusGrace{2.0};

// "rank 1", "ranks 0, 1", "ranks 0, 2-4".
std::string rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (i > 0) out += ", ";
    out += std::to_string(ranks[i]);
    if (j > i) out += (j == i + 1 ? ", " : "-") + std::to_string(ranks[j]);
    i = j + 1;
  }
  return out;
}

std::string format_seconds(double s) {
  char text[32];
  std::snprintf(text, sizeof text, s < 10 ? "%.1f" : "%.0f", s);
  return text;
}

}  // namespace

const char* collective_name(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::AllReduce: return "all_reduce";
    case CollectiveOp::Broadcast: return "broadcast";
    case CollectiveOp::AllGather: return "all_gather";
    case CollectiveOp::ReduceScatter: return "reduce_scatter";
    case CollectiveOp::Barrier: return "barrier";
    case CollectiveOp::SendRecv: return "send/recv";
  }
  return "a collective";
}

std::string rank_names(const std::vector<int>& ranks, const std::vector<int>& world_of) {
  if (world_of.empty()) return rank_list(ranks);
  // (world rank, group rank), sorted: the group's numbers in the order of the world ranks listed. One
  // sort, not a scan per rank, so that a group of 10^6 ranks is named in well under a second.
  std::vector<std::pair<int, int>> pairs;
  pairs.reserve(ranks.size());
  for (int r : ranks) pairs.emplace_back(r >= 0 && size_t(r) < world_of.size() ? world_of[size_t(r)] : r, r);
  std::sort(pairs.begin(), pairs.end());
  std::vector<int> sorted;
  sorted.reserve(pairs.size());
  std::string own;
  for (const auto& [w, r] : pairs) {
    sorted.push_back(w);
    own += str(own.empty() ? "" : ", ", r);
  }
  return str("world ", rank_list(sorted), " (", ranks.size() == 1 ? "rank " : "ranks ", own, " of the group)");
}

std::string timeout_message(const Collective& what, const std::string& group, int size, int rank,
                            const std::vector<int>& world_of, Seconds waited, const std::string& who) {
  const std::string which = what.op == CollectiveOp::SendRecv ? std::string("It was a point-to-point batch of the group")
                                                                : str("It was collective #", what.seq, " of the group");
  return str(collective_name(what.op), " on group \"", group, "\" (", size, " ranks) timed out after ",
             format_seconds(waited.count()), " s on ", rank_names({rank}, world_of), ": ", who, ". ", which,
             ", which is unusable now. Raise train.collective_timeout_s or "
             "BOOSTER_COLLECTIVE_TIMEOUT_S (now ", format_seconds(what.timeout.count()),
             " s) if a step legitimately takes longer");
}

#if defined(BOOSTER_WITH_MPI)

// What one rank tells another in a census (Note [Collective timeouts]).
struct Census::Record {
  uint64_t started = 0;      // collectives this rank has started on the group
  uint64_t waiting_seq = 0;  // the one it waits for (0: none)
  int32_t waiting_op = 0;
  int32_t is_query = 0;      // 1: from a rank that timed out, which sent it to everyone
};

namespace {

// Queries and answers travel apart, so a thread answering queries never takes an answer that the
// census of another thread of this rank waits for.
constexpr int kQueryTag = 1;
constexpr int kAnswerTag = 2;

std::unique_lock<std::mutex> maybe_lock(std::mutex* m) {
  return m ? std::unique_lock<std::mutex>(*m) : std::unique_lock<std::mutex>();
}

}  // namespace

Census::Census(MPI_Comm parent, std::mutex* mpi_mutex) : mpi_mutex_(mpi_mutex) {
  auto lock = maybe_lock(mpi_mutex_);
  check_mpi(MPI_Comm_dup(parent, &comm_), "init_process_group", "MPI_Comm_dup");
  check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "init_process_group", "MPI_Comm_set_errhandler");
  check_mpi(MPI_Comm_rank(comm_, &rank_), "init_process_group", "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm_, &size_), "init_process_group", "MPI_Comm_size");
  world_of_ = world_ranks_of(comm_);
}

std::vector<int> world_ranks_of(MPI_Comm comm) {
  MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  int size = 0, world_size = 0;
  check_mpi(MPI_Comm_size(comm, &size), "init_process_group", "MPI_Comm_size");
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &world_size), "init_process_group", "MPI_Comm_size");
  check_mpi(MPI_Comm_group(comm, &group), "init_process_group", "MPI_Comm_group");
  check_mpi(MPI_Comm_group(MPI_COMM_WORLD, &world), "init_process_group", "MPI_Comm_group");
  std::vector<int> mine(static_cast<size_t>(size)), out(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) mine[size_t(r)] = r;
  check_mpi(MPI_Group_translate_ranks(group, size, mine.data(), world, out.data()), "init_process_group",
            "MPI_Group_translate_ranks");
  MPI_Group_free(&group);
  MPI_Group_free(&world);
  if (size == world_size && out == mine) return {};
  return out;
}

Census::~Census() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  for (auto& [record, request] : sends_)
    if (request != MPI_REQUEST_NULL) MPI_Request_free(&request);
  MPI_Comm_free(&comm_);
}

// Sends `record` to `to` without waiting for it to arrive (a stopped rank never takes it).
void Census::send(const Record& record, int to) {
  std::lock_guard<std::mutex> guard(sends_mutex_);
  std::erase_if(sends_, [&](auto& entry) {  // forget the records that have left
    int done = 0;
    auto lock = maybe_lock(mpi_mutex_);
    MPI_Test(&entry.second, &done, MPI_STATUS_IGNORE);
    return done != 0;
  });
  sends_.emplace_back(std::make_unique<Record>(record), MPI_REQUEST_NULL);
  auto lock = maybe_lock(mpi_mutex_);
  check_mpi(MPI_Isend(sends_.back().first.get(), int(sizeof(Record)), MPI_BYTE, to,
                      record.is_query ? kQueryTag : kAnswerTag, comm_, &sends_.back().second),
            collective_name(CollectiveOp(record.waiting_op)), "MPI_Isend");
}

// The next record with `tag` sent to this rank, if one is there (a matched probe, so any thread may
// call it).
bool Census::receive(int tag, int* from, Record* record, const char* op) {
  int flag = 0;
  MPI_Message message;
  MPI_Status status;
  auto lock = maybe_lock(mpi_mutex_);
  check_mpi(MPI_Improbe(MPI_ANY_SOURCE, tag, comm_, &flag, &message, &status), op, "MPI_Improbe");
  if (!flag) return false;
  check_mpi(MPI_Mrecv(record, int(sizeof(Record)), MPI_BYTE, &message, MPI_STATUS_IGNORE), op, "MPI_Mrecv");
  *from = status.MPI_SOURCE;
  return true;
}

void Census::answer(uint64_t started, const Collective* waiting) {
  const char* op = waiting ? collective_name(waiting->op) : "census";
  int from = 0;
  Record query;
  while (receive(kQueryTag, &from, &query, op))
    send(Record{started, waiting ? waiting->seq : 0, waiting ? int32_t(waiting->op) : 0, 0}, from);
}

std::string Census::take(uint64_t started, const Collective& what) {
  const char* op = collective_name(what.op);
  const Clock::time_point begin = Clock::now();
  for (int r = 0; r < size_; ++r)
    if (r != rank_) send(Record{started, what.seq, int32_t(what.op), 1}, r);
  std::vector<std::optional<Record>> heard(size_);
  int answers = 0;
  const Seconds grace = std::min(kCensusGrace, what.timeout);
  const Clock::time_point listen_until = begin + std::chrono::duration_cast<Clock::duration>(grace);
  for (Backoff backoff; answers < size_ - 1 && Clock::now() < listen_until; backoff.pause(Clock::now())) {
    int from = 0;
    Record record;
    while (receive(MPI_ANY_TAG, &from, &record, op)) {
      if (!heard[from]) ++answers;
      heard[from] = record;
    }
  }

  std::vector<int> arrived{rank_}, silent, behind;
  std::string where;  // what the ranks that are behind wait for
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    if (!heard[r]) {
      silent.push_back(r);
    } else if (heard[r]->started >= what.seq) {
      arrived.push_back(r);
    } else {
      behind.push_back(r);
      where += str(where.empty() ? "" : "; ", rank_names({r}, world_of_), " still waits in ",
                   collective_name(CollectiveOp(heard[r]->waiting_op)), " #", heard[r]->waiting_seq);
    }
  }
  std::sort(arrived.begin(), arrived.end());
  if (silent.empty() && behind.empty())
    return "every rank started it, but it did not complete (a rank stopped making progress inside it, or the "
           "network failed)";
  std::string who;
  if (!silent.empty())
    who = str(rank_names(silent, world_of_), " did not arrive (no answer within ", format_seconds(grace.count()),
              " s: stopped, hung, or busy outside collectives)");
  if (!behind.empty())
    who += str(who.empty() ? "" : "; ", rank_names(behind, world_of_), " did not arrive (", where,
               "; do all ranks run the same collectives in the same order?)");
  return who + str("; ", rank_names(arrived, world_of_), " waited");
}

#endif

}  // namespace booster::distributed::detail
