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
// A save writes every file into `step-N.tmp/`, fsyncs them and the directory, then renames it to
// `step-N/`: that rename is the commit point (Note [Atomic checkpoint writes]). Only after it is
// `latest` updated and are old checkpoints pruned to keep_last, so a crash at any moment leaves the
// previous checkpoint loadable. Only names `step-` + 8 digits count as checkpoints.
// One process saves into a root at a time (rank 0 under data parallelism): a save removes the `.tmp`
// directories it finds, taking them for leftovers of crashed saves.
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

// Bumped whenever trainer_state.json or the file set changes incompatibly.
inline constexpr int kCheckpointFormatVersion = 1;
inline constexpr const char* kTrainerStateFileName = "trainer_state.json";
inline constexpr const char* kOptimizerFileName = "optimizer.safetensors";
inline constexpr const char* kLatestFileName = "latest";

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
// Saving a step that already exists replaces it. Leftover `.tmp` directories of crashed saves are
// removed first.
// Test hook: with the environment variable BOOSTER_TEST_ABORT_BEFORE_COMMIT=1 the process calls
// std::abort() after writing everything and before the commit rename, as a crash would.
std::filesystem::path save_checkpoint(const std::filesystem::path& root, const TrainingState& state,
                                      const SaveOptions& options = {});

struct LoadOptions {
  // Every key here must be in the checkpoint's `extra` with an equal value, e.g. {"strategy": "bf16"}:
  // resuming with another strategy is a CheckpointError naming the key and both values.
  nlohmann::json expect_extra = nlohmann::json::object();
};

// Loads a checkpoint: `path` is one checkpoint directory (it holds trainer_state.json) or a root, in
// which case the one named by `latest` is loaded (or, without `latest`, the highest committed step).
// Missing files, corrupt files, a format version other than kCheckpointFormatVersion and unmet
// expectations are CheckpointErrors naming the file and the problem. Model keys and shapes are checked
// when the caller hands `model` to Module::load_state_dict.
TrainingState load_checkpoint(const std::filesystem::path& path, const LoadOptions& options = {});

// Committed checkpoints under `root`, ascending by step.
std::vector<std::pair<int64_t, std::filesystem::path>> list_checkpoints(const std::filesystem::path& root);
// The checkpoint directory load_checkpoint(path) would read.
std::filesystem::path resolve_checkpoint(const std::filesystem::path& path);

}  // namespace booster::checkpoint
