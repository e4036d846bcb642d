// AsyncSave (async_save.h): Note [Asynchronous checkpoints].
#include "booster/trainer/async_save.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "booster/checkpoint/checkpoint.h"
#include "booster/common/error.h"
#include "booster/distributed/process_group.h"
#include "booster/ops/ops.h"

namespace booster::trainer {

namespace fs = std::filesystem;

namespace {
// `step-N.tmp/`, where begin_checkpoint put the step's files (Note [Checkpoint directory layout]).
fs::path tmp_dir_of(const fs::path& root, int64_t step) {
  char name[40];
  std::snprintf(name, sizeof name, "step-%08lld.tmp", static_cast<long long>(step));
  return root / name;
}

fs::path step_dir_of(const fs::path& root, int64_t step) {
  char name[40];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
  return root / name;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Test hook (async_save.h): BOOSTER_TEST_ASYNC_SAVE_FAIL_RANK=R:S fails rank R's write of step S.
bool fail_here_if_testing(int rank, int64_t step) {
  const char* hook = std::getenv("BOOSTER_TEST_ASYNC_SAVE_FAIL_RANK");
  if (!hook || !*hook) return false;
  const std::string spec = hook;
  const size_t colon = spec.find(':');
  return colon != std::string::npos && std::atoi(spec.substr(0, colon).c_str()) == rank &&
         std::atoll(spec.substr(colon + 1).c_str()) == step;
}
}  // namespace

AsyncSave::~AsyncSave() { join(); }

bool AsyncSave::several() const { return group_ && group_->size() > 1; }

void AsyncSave::join() {
  if (thread_.joinable()) thread_.join();
}

void AsyncSave::run(std::function<void()> work) {
  finished_ = false;
  thread_ = std::thread([this, work = std::move(work)] {
    try {
      work();
    } catch (const std::exception& e) {
      outcome_.error = e.what();
    } catch (...) {
      outcome_.error = "an unknown error";
    }
    finished_ = true;
  });
}

void AsyncSave::start(fs::path root, int64_t step, int keep_last, std::vector<checkpoint::WriteCapture::File> files) {
  BOOSTER_CHECK(phase_ == Phase::Idle && !thread_.joinable(), StateError, "AsyncSave::start: the save of step ",
                outcome_.step, " is still in flight; collect it first");
  outcome_ = Outcome{};
  outcome_.step = step;
  root_ = std::move(root);
  keep_last_ = keep_last;
  started_ = now_seconds();
  phase_ = Phase::Writing;
  const bool commit = !several();  // several processes: rank 0 commits once every rank has written
  const int rank = group_ ? group_->rank() : 0;
  run([this, step, keep_last, commit, rank, files = std::move(files)] {
    // Test hook (async_save.h): a pause after the first file, to kill the process mid-write.
    const char* hook = std::getenv("BOOSTER_TEST_ASYNC_SAVE_SLEEP_MS");
    const long sleep_ms = hook ? std::strtol(hook, nullptr, 10) : 0;
    BOOSTER_CHECK(!fail_here_if_testing(rank, step), CheckpointError, "cannot write ", tmp_dir_of(root_, step).string(),
                  ": the test hook BOOSTER_TEST_ASYNC_SAVE_FAIL_RANK fails this write");
    for (size_t i = 0; i < files.size(); ++i) {
      checkpoint::write_captured({files[i]});
      if (i == 0 && sleep_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
    }
    if (files.empty() && sleep_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
    // Each file's directory is synced as it is written; the step's own holds the new folders. On
    // several processes a rank that wrote nothing may see no `step-N.tmp/` (rank 0 made it).
    const fs::path tmp = tmp_dir_of(root_, step);
    if (commit || fs::exists(tmp)) checkpoint::sync_directory(tmp);
    if (commit) outcome_.dir = checkpoint::commit_checkpoint(root_, step, keep_last);
  });
}

std::pair<bool, int> AsyncSave::agree(bool done, bool failed) {
  const int world = group_->size();
  Tensor t = from_vector(std::vector<int64_t>{done ? 1 : 0, failed ? group_->rank() : world}, {2}).to(group_->device());
  group_->all_reduce(t, distributed::ReduceOp::Min);
  const Tensor host = t.cpu().contiguous();
  const int64_t* v = host.data<int64_t>();
  return {v[0] == 1, v[1] < world ? int(v[1]) : -1};
}

std::string AsyncSave::broadcast_text(const std::string& text, int root) {
  Tensor length = from_vector(std::vector<int64_t>{int64_t(text.size())}, {1}).to(group_->device());
  group_->broadcast(length, root);
  const int64_t n = length.cpu().contiguous().data<int64_t>()[0];
  if (n == 0) return "";
  std::vector<int64_t> bytes(size_t(n), 0);
  if (group_->rank() == root)
    for (size_t i = 0; i < text.size(); ++i) bytes[i] = static_cast<unsigned char>(text[i]);
  Tensor t = from_vector(bytes, {n}).to(group_->device());
  group_->broadcast(t, root);
  const Tensor host = t.cpu().contiguous();
  std::string out(size_t(n), ' ');
  for (int64_t i = 0; i < n; ++i) out[size_t(i)] = char(host.data<int64_t>()[i]);
  return out;
}

std::optional<AsyncSave::Outcome> AsyncSave::collect(bool wait) {
  if (phase_ == Phase::Idle) return std::nullopt;
  if (!several()) {
    if (!wait && !finished_) return std::nullopt;
    join();
    phase_ = Phase::Idle;
    outcome_.seconds = now_seconds() - started_;
    return outcome_;
  }
  // Note [Asynchronous checkpoints]: every rank makes the same calls; only the main thread runs them.
  // A wait repeats the exchange every 10 ms rather than joining first, so no rank sits in one
  // collective for a long write (the collective timeout stays a sign of a lost rank).
  for (;;) {
    if (std::optional<Outcome> done = exchange_once()) return done;
    if (!wait) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

std::optional<AsyncSave::Outcome> AsyncSave::exchange_once() {
  const int rank = group_->rank();
  if (phase_ == Phase::Writing) {
    const bool done = finished_;
    const auto [all_done, failed] = agree(done, done && !outcome_.error.empty());
    if (!all_done) return std::nullopt;
    join();
    if (failed >= 0) {
      const std::string why = broadcast_text(outcome_.error, failed);
      outcome_.error = "rank " + std::to_string(failed) + " of " + std::to_string(group_->size()) + ": " + why;
      outcome_.seconds = now_seconds() - started_;
      phase_ = Phase::Idle;
      return outcome_;
    }
    phase_ = Phase::Committing;
    if (rank == 0) {
      const int64_t step = outcome_.step;
      run([this, step] { outcome_.dir = checkpoint::commit_checkpoint(root_, step, keep_last_); });
    }
    return std::nullopt;
  }
  // Committing: rank 0's thread; the others wait for its word.
  const bool done = rank != 0 || finished_;
  const auto [all_done, failed] = agree(done, rank == 0 && done && !outcome_.error.empty());
  if (!all_done) return std::nullopt;
  join();
  if (failed >= 0) {
    const std::string why = broadcast_text(outcome_.error, 0);
    outcome_.error = "rank 0 of " + std::to_string(group_->size()) + ", committing: " + why;
  } else {
    outcome_.dir = step_dir_of(root_, outcome_.step);
  }
  outcome_.seconds = now_seconds() - started_;
  phase_ = Phase::Idle;
  return outcome_;
}

}  // namespace booster::trainer
