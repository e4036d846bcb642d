// Training checkpoints: everything needed to resume a run, committed atomically, pruned safely.
//
//   checkpoint::TrainingState state;
//   state.step = step;
//   state.model = model->state_dict();
//   state.optimizer = optimizer->state_dict();
//   state.scheduler = scheduler.state_dict();
//   state.dataloader = loader.state_dict();
//   state.rng["default"] = default_generator().state();
//   state.extra = {{"strategy", "fp16_o1"}, {"scaler", scaler.state_dict()}, {"model_config", cfg}};
//   checkpoint::save_checkpoint("runs/a/checkpoints", state, {.keep_last = 3});
//   ...
//   auto resumed = checkpoint::load_checkpoint("runs/a/checkpoints", {.expect_extra = {{"strategy", "fp16_o1"}}});
//   model->load_state_dict(resumed.model);   // names any key or shape that does not match
//
// Note [Checkpoint directory layout]
//   <root>/latest                      "step-00001200\n", replaced atomically after each commit
//   <root>/step-00001200/              one committed checkpoint
//       model.safetensors              or model-0000i-of-0000N.safetensors + model.safetensors.index.json
//       optimizer.safetensors          the optimizer's state tensors (absent if there is no optimizer)
//       trainer_state.json             {"format": "booster-checkpoint", "version": 1, "step": ...,
//                                       "optimizer": <OptimizerState::meta>, "scheduler": ..., "dataloader": ...,
//                                       "rng": {"<name>": [u64, ...]}, "extra": {...}}
//   <root>/step-00001300.tmp/          a save in progress, or one that crashed: never loaded
//   <root>/lock                        flock()ed by the program saving into the root (RootLock)
// A save writes every file into `step-N.tmp/`, fsyncs them and the directory, then renames it to
// `step-N/`: that rename is the commit point (Note [Atomic checkpoint writes]). Only after it is
// `latest` updated and are old checkpoints pruned to keep_last, so a crash at any moment leaves the
// previous checkpoint loadable. Only names `step-` + 8 digits count as checkpoints (and, for the moment
// of a replace on some file systems, `step-N.replaced/`: Note [Replacing a checkpoint]).
// One process saves into a root at a time (rank 0 under data parallelism): a save removes the `.tmp`
// directories it finds, taking them for leftovers of crashed saves. A program that saves into a root
// over its whole run holds a RootLock on it, so a second one started on the same root is refused
// instead of deleting the first one's save in progress.
//
// Note [Replacing a checkpoint]
// A save of a step that already has a committed `step-N/` replaces it: the newest save belongs to the
// run the user is continuing (a run resumed from an earlier checkpoint reaching a step it had saved
// before, or a later run sharing the root), and keeping the old one would let `latest` resume another
// trajectory. Keeping the old one beside the new under another name is no better: names are steps.
// At every instant `latest` must name a complete checkpoint, so the old directory is never removed
// before the new one stands in its place:
//  * where the file system has renameat2(RENAME_EXCHANGE) (ext4, xfs, btrfs, tmpfs, ...), `step-N.tmp/`
//    and `step-N/` swap names in one atomic step: `step-N/` is the whole old checkpoint until then and
//    the whole new one after. The old one, now `step-N.tmp/`, is removed after; a crash before that
//    leaves it as a leftover that the next save clears.
//  * elsewhere (NFS, Lustre, ...), `step-N/` is renamed `step-N.replaced/`, then `step-N.tmp/` to
//    `step-N/`, then `.replaced` is removed. Between the two renames there is no `step-N/`; so a
//    `step-N.replaced/` with no `step-N/` beside it still is the committed checkpoint of step N:
//    list_checkpoints and resolve_checkpoint return it (for `latest`, and for `<root>/step-N` named
//    explicitly), and the next save renames it back before
//    anything else. A crash between the renames thus resumes from the old checkpoint, as a crash before
//    any commit does. (A reader other than this library that follows `latest` literally finds no
//    `step-N/` for that moment; only the RENAME_EXCHANGE path avoids that.)
//
// Note [Cleanup after the commit]
// Once `step-N/` is the new checkpoint, `latest` is pointed at it before anything is removed, and every
// removal after that (the replaced copy, pruned checkpoints, leftovers of earlier saves) is only a
// warning when it fails: the checkpoint is saved, and a run must not die because, say, NFS keeps a
// `.nfsXXXX` file of a still-open file in a directory (ENOTEMPTY). What stays behind has a name no
// reader takes for a checkpoint (`.tmp`, or `.replaced` beside its `step-N/`), and the next save tries
// again. A pruned checkpoint is renamed to `step-N.tmp/` before its removal for the same reason: a
// removal that stops half way must not leave a half checkpoint under a committed name.
// BOOSTER_TEST_CLEANUP_FAILS=1 makes every such removal fail with ENOTEMPTY.
//
// Test hooks (tests/checkpoint/test_checkpoint.cpp, tests/cli/test_cli_resume.cpp): with BOOSTER_TEST_CRASH_AT set to
// one of the points below, the saving process calls std::abort(), as a crash would, at that point:
//   before_commit         everything is written and synced into `step-N.tmp/`, nothing is committed
//   between_renames       (portable replace only) the old `step-N/` is `step-N.replaced/`, the new one
//                         is still `step-N.tmp/`
//   before_old_removed    `step-N/` is the new checkpoint and `latest` names it; the replaced one is
//                         not removed yet
//   before_prune          `latest` names `step-N/`; older checkpoints are not pruned yet
// BOOSTER_TEST_NO_RENAME_EXCHANGE=1 makes a replace take the portable path, as on a file system without
// RENAME_EXCHANGE.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "booster/checkpoint/safetensors.h"
#include "booster/nn/module.h"
#include "booster/optim/optimizer.h"

namespace booster::checkpoint {

// Bumped whenever trainer_state.json or the file set changes. Version 2 added checksums.json (Note
// [Checkpoint checksums]); version 1 still loads, unverified.
inline constexpr int kCheckpointFormatVersion = 2;
inline constexpr const char* kTrainerStateFileName = "trainer_state.json";
inline constexpr const char* kOptimizerFileName = "optimizer.safetensors";
inline constexpr const char* kLatestFileName = "latest";
inline constexpr const char* kLockFileName = "lock";
// The suffix of a committed checkpoint caught between the renames of a replace (Note [Replacing a
// checkpoint]).
inline constexpr const char* kReplacedSuffix = ".replaced";

// The pieces of a run that a checkpoint holds. Null JSON and an empty optimizer mean "not saved".
struct TrainingState {
  int64_t step = 0;
  nn::StateDict model;
  optim::OptimizerState optimizer;                    // meta null: no optimizer
  nlohmann::json scheduler;                           // LRScheduler::state_dict()
  nlohmann::json dataloader;                          // DataLoader::state_dict()
  std::map<std::string, std::vector<uint64_t>> rng;   // name -> Generator::state()
  nlohmann::json extra = nlohmann::json::object();    // scaler state, strategy name, model config, ...
};

struct SaveOptions {
  // Committed checkpoints to keep, the new one included; 0 keeps all.
  int keep_last = 0;
  uint64_t max_shard_bytes = kDefaultMaxShardBytes;
};

// Saves `state` as `<root>/step-XXXXXXXX/` (Note [Checkpoint directory layout]) and returns that path.
// Saving a step that already exists replaces it (Note [Replacing a checkpoint]). Leftover `.tmp`
// directories of crashed saves are removed first.
std::filesystem::path save_checkpoint(const std::filesystem::path& root, const TrainingState& state,
                                      const SaveOptions& options = {});

// The two halves of a save, for writers of their own layout inside a step directory (`booster train`
// writes through the Booster). begin_checkpoint creates `root`, clears the leftovers of interrupted
// saves (restoring a checkpoint caught between the renames of a replace) and returns an empty
// `<root>/step-N.tmp/` to write into. commit_checkpoint, once every file in it is written and synced
// (sync_directory), renames it to `step-N/` (replacing one that exists), points `latest` at it and
// prunes to keep_last (0 keeps all; the new one is never pruned). Returns `step-N/`.
std::filesystem::path begin_checkpoint(const std::filesystem::path& root, int64_t step);
std::filesystem::path commit_checkpoint(const std::filesystem::path& root, int64_t step, int keep_last);

struct LoadOptions {
  // Every key here must be in the checkpoint's `extra` with an equal value, e.g. {"strategy": "bf16"}:
  // resuming with another strategy is a CheckpointError naming the key and both values.
  nlohmann::json expect_extra = nlohmann::json::object();
  // Check every file against checksums.json before reading it (Note [Checkpoint checksums]).
  bool verify = true;
};

// Loads a checkpoint: `path` is one checkpoint directory (it holds trainer_state.json) or a root, in
// which case the one named by `latest` is loaded (or, without `latest`, the highest committed step).
// Missing files, corrupt files, a format version other than kCheckpointFormatVersion and unmet
// expectations are CheckpointErrors naming the file and the problem. Model keys and shapes are checked
// when the caller hands `model` to Module::load_state_dict.
TrainingState load_checkpoint(const std::filesystem::path& path, const LoadOptions& options = {});

// An exclusive lock on a checkpoint root for as long as it lives: flock() on `<root>/lock`, which the
// kernel releases when the process ends, crash or not. Creates `root` if needed. CheckpointError
// naming the root and the holder's hostname:pid when another process (or another RootLock) holds it.
// Where the file system cannot flock, a warning on stderr and no lock (Note [Locking a checkpoint root]).
class RootLock {
 public:
  explicit RootLock(const std::filesystem::path& root);
  ~RootLock();
  RootLock(const RootLock&) = delete;
  RootLock& operator=(const RootLock&) = delete;

 private:
  int fd_ = -1;
};

// Committed checkpoints under `root`, ascending by step (Note [Replacing a checkpoint] for the
// `.replaced` directories that count).
std::vector<std::pair<int64_t, std::filesystem::path>> list_checkpoints(const std::filesystem::path& root);
// The checkpoint directory load_checkpoint(path) would read. A `<root>/step-N` that does not exist
// while `<root>/step-N.replaced/` does resolves to the latter (Note [Replacing a checkpoint]).
std::filesystem::path resolve_checkpoint(const std::filesystem::path& path);

// True when `root` does not exist, or holds nothing but the lock file and the `.tmp` leftovers of
// saves interrupted before their commit: where `resume: "latest"` starts afresh. A `latest` file (even
// one naming a missing step) or anything else makes it false, so the resume reports it instead.
bool holds_no_checkpoint(const std::filesystem::path& root);

}  // namespace booster::checkpoint
