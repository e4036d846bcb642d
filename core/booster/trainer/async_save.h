// A checkpoint written and committed on a background thread (TrainerOptions::async_checkpoint).
//
// Note [Asynchronous checkpoints]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A synchronous save stalls training for its whole write. With train.async_checkpoint the Trainer
// snapshots the step instead: Booster::save_state runs at the step as always, on the main thread,
// under a checkpoint::WriteCapture (Note [Capturing a checkpoint's files] in atomic_file.h), so every
// tensor is copied to host memory and serialised into the very bytes the synchronous save writes, and
// nothing touches the disk but the creation of `step-N.tmp/` (checkpoint::begin_checkpoint). An
// AsyncSave then writes those files, syncs the directory and commits the step
// (checkpoint::commit_checkpoint: checksums, the rename, `latest`, keep_last) on a thread of its own
// while training goes on. So the files of every step equal a synchronous run's, and `latest` moves only
// at a commit: a process killed mid-write leaves a `step-N.tmp/` that the next save clears and a
// `latest` naming the previous step.
//   * At most one save is in flight: the next save, the run's end and a stop on SIGINT/SIGTERM wait
//     for it (so a stop's message names a committed step).
//   * A background save that fails (a full disk) is reported with its step and reason; the run goes on
//     and `latest` still names the previous step (train.on_save_error "warn", the default), or stops at
//     the next step's end with a CheckpointError ("stop"). The run's last save failing fails the run
//     either way (Note [The run's last save] in trainer.cpp).
//   * Several processes (ddp, low_level_zero, hybrid_parallel), as PyTorch DCP's async_save: every
//     rank snapshots at the step (save_state with commit = false, its collectives on the main thread
//     as in a synchronous save), and each rank's thread writes and syncs its own files. Only the
//     commit needs every rank's files, and only the main thread runs collectives, so the ranks agree
//     there: at each step's end while a save is in flight, one all-reduce (min) of two int64s, "my
//     write is done" and "the lowest rank whose write failed" (no collective when none is in flight).
//     Once every rank's write is done, rank 0 commits on its thread and the next step ends agree on
//     the commit's outcome the same way; a failure is the failing rank's reason, broadcast, so every
//     rank ends the save alike: `latest` at the previous step, the warning or ("stop") the error
//     naming the step, the rank and the reason on every rank. Waiting (the next save, the run's end,
//     a stop) repeats the exchange every 10 ms until the save is over, so no rank sits in one
//     collective through a long write. A rank killed mid-write ends the job before any commit, so
//     `latest` still names the previous step.
// The snapshot costs the copy to host memory and the serialisation (a memcpy of the state); the
// write, fsyncs and checksums, the bulk of a save, leave the step.
// Test hooks: BOOSTER_TEST_ASYNC_SAVE_SLEEP_MS=N makes the background writer sleep N ms after the
// step's first file (every rank), so a test can kill a process in the middle of a background write;
// BOOSTER_TEST_ASYNC_SAVE_FAIL_RANK=R:S makes rank R's background write of step S fail (as a full disk
// would), so a test sees a failure on one rank only.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "booster/checkpoint/atomic_file.h"

namespace booster::distributed {
class ProcessGroup;
}

namespace booster::trainer {

class AsyncSave {
 public:
  struct Outcome {
    int64_t step = 0;
    std::filesystem::path dir;  // the committed step directory (when no error)
    std::string error;          // why it failed ("rank R: ..." on several processes); "" when committed
    double seconds = 0.0;       // the background write and commit (this rank's write, rank 0's commit)
  };
  // `group`: the ranks that save together (Note [Asynchronous checkpoints]); one process: null or size 1.
  explicit AsyncSave(distributed::ProcessGroup* group = nullptr) : group_(group) {}
  ~AsyncSave();  // waits for this rank's thread; an error is dropped (the run ended on another)
  AsyncSave(const AsyncSave&) = delete;
  AsyncSave& operator=(const AsyncSave&) = delete;

  // Writes `files` (captured by a WriteCapture) on a background thread and commits `root/step-N/`
  // (on several processes: once every rank's write is done, through collect()). The previous save
  // must have been collected.
  void start(std::filesystem::path root, int64_t step, int keep_last, std::vector<checkpoint::WriteCapture::File> files);
  // True on every rank alike from start() until collect() returns the outcome.
  bool in_flight() const { return phase_ != Phase::Idle; }
  // How the save in flight ended; null when none is in flight, or (wait false) while it is not over.
  // On several processes every rank calls it at the same points (a collective while a save is in
  // flight): wait true repeats the exchange until the save is over.
  std::optional<Outcome> collect(bool wait);

 private:
  enum class Phase { Idle, Writing, Committing };
  void run(std::function<void()> work);  // on the thread; records an error in outcome_.error
  void join();
  bool several() const;
  // One exchange of the ranks' progress (several processes): the outcome once the save is over.
  std::optional<Outcome> exchange_once();
  // Every rank's (done, failed) -> (all done, the lowest failed rank or -1): a collective.
  std::pair<bool, int> agree(bool done, bool failed);
  std::string broadcast_text(const std::string& text, int root);

  distributed::ProcessGroup* group_ = nullptr;
  std::thread thread_;
  std::atomic<bool> finished_{false};
  Phase phase_ = Phase::Idle;
  std::filesystem::path root_;
  int keep_last_ = 0;
  double started_ = 0.0;
  Outcome outcome_;
};

}  // namespace booster::trainer
