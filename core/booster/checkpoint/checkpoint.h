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
// The directory layout, the commit and what a replace or an interrupted save leaves behind (Note
// [Checkpoint directory layout], Note [Replacing a checkpoint], Note [Cleanup after the commit]) are in
// this folder's README.md.
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
// A step that failed its checksums when a new checkpoint of its step was committed, kept under this
// suffix (and "-2", "-3", ... after it) rather than replaced (Note [Falling back from a damaged checkpoint]).
inline constexpr const char* kDamagedSuffix = ".damaged";

// verify_checksums over a whole committed step, where a step whose format version writes checksums.json
// but that has none lost it after its save and fails as a damaged file does (CheckpointError): so
// `latest` falls back past it, a save of its step keeps it as step-N.damaged, and keep_last neither
// counts nor prunes it (Note [Falling back from a damaged checkpoint]). A step that predates checksums
// passes.
void verify_step(const std::filesystem::path& dir);

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

// The weights `model.init_from` names (Note [Weights from a checkpoint] in checkpoint.cpp): a
// .safetensors file, a model index, a directory holding a model (Hugging Face's, or a checkpoint's
// `model/`), or a checkpoint step directory (its `model/` is read, or its own model files for the
// layout of save_checkpoint). Inside a checkpoint, the model files are first checked against the
// step's checksums.json as a resume checks them, and every model file must be listed there: a damaged
// or unlisted one is a CheckpointError naming the file (and tensor). A step of a format that records
// checksums but has no checksums.json is refused; an older one loads with one warning on stderr
// (`warn`). Files outside any checkpoint carry no checksums and load as load_model reads them.
struct LoadWeightsOptions {
  bool verify = true;  // false: read the files as they are (--no-verify)
  bool warn = true;    // print the warning about a checkpoint that predates checksums (rank 0 only)
};
TensorMap load_weights(const std::filesystem::path& path, const LoadWeightsOptions& options = {});
// The name and shape of each tensor load_weights(path) would return, from the files' headers alone
// (nothing verified, no weights read): what `booster check` compares a model with before train loads it.
std::map<std::string, Shape> weight_shapes(const std::filesystem::path& path);

// A checkpoint as a user names it on a command line: a run directory (`booster train`'s train.run_dir,
// holding checkpoints/ and no checkpoint of its own) stands for its checkpoints/; any other path is
// itself. `booster eval`, `export` and `generate` resolve --checkpoint through it.
std::filesystem::path checkpoints_of_run(const std::filesystem::path& path);

// An exclusive lock on a checkpoint root for as long as it lives: flock() on `<root>/lock`, which the
// kernel releases when the process ends, crash or not. Creates `root` if needed. CheckpointError
// naming the root and the holder's hostname:pid when another process (or another RootLock) holds it.
// Where the file system cannot flock, a warning on stderr and no lock (Note [Locking a checkpoint root]).
// `what` names the directory in those messages: the Trainer locks its run directory the same way.
class RootLock {
 public:
  explicit RootLock(const std::filesystem::path& root, const std::string& what = "checkpoint directory");
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

// The step directories of `root` a resume may load, best first: the one `latest` names (when it names
// one that exists), then every committed step from the newest down (Note [Falling back from a damaged
// checkpoint] in booster/booster/state.cpp).
std::vector<std::filesystem::path> checkpoint_candidates(const std::filesystem::path& root);

// True when `root` does not exist, or holds nothing but the lock file and the `.tmp` leftovers of
// saves interrupted before their commit: where `resume: "latest"` starts afresh. A `latest` file (even
// one naming a missing step) or anything else makes it false, so the resume reports it instead.
bool holds_no_checkpoint(const std::filesystem::path& root);

}  // namespace booster::checkpoint
