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
//     the next step's end with a CheckpointError ("stop").
//   * One process only: the synchronous path's barriers make the commit wait for every rank's files,
//     and a background thread cannot call collectives beside the training loop's; the Trainer refuses
//     async_checkpoint on several processes with a ConfigError. (N copies of a one-process run that
//     only the launcher's rank 0 saves are one process here.)
// The snapshot costs the copy to host memory and the serialisation (a memcpy of the state); the
// write, fsyncs and checksums, the bulk of a save, leave the step.
// Test hook: BOOSTER_TEST_ASYNC_SAVE_SLEEP_MS=N makes the background writer sleep N ms after the
// step's first file, so a test can kill the process in the middle of a background write.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "booster/checkpoint/atomic_file.h"

namespace booster::trainer {

class AsyncSave {
 public:
  struct Outcome {
    int64_t step = 0;
    std::filesystem::path dir;  // the committed step directory (when no error)
    std::string error;          // why it failed; "" when committed
    double seconds = 0.0;       // the background write and commit
  };
  AsyncSave() = default;
  ~AsyncSave();  // waits for the save in flight; an error is dropped (the run ended on another)
  AsyncSave(const AsyncSave&) = delete;
  AsyncSave& operator=(const AsyncSave&) = delete;

  // Writes `files` (captured by a WriteCapture) and commits `root/step-N/` on a background thread.
  // The previous save must have been collected (wait() or poll()).
  void start(std::filesystem::path root, int64_t step, int keep_last, std::vector<checkpoint::WriteCapture::File> files);
  bool in_flight() const { return thread_.joinable(); }
  // Waits for the save in flight and says how it ended; null when none is in flight.
  std::optional<Outcome> wait();
  // wait() if the save in flight has finished, else null at once.
  std::optional<Outcome> poll();

 private:
  std::thread thread_;
  std::atomic<bool> finished_{false};
  Outcome outcome_;
};

}  // namespace booster::trainer
