// The default CheckpointIO: one process's view of model, optimizer and scheduler, written by rank 0.
#include <fstream>

#include "booster/plugin/parallel_plugin.h"
#include "booster/common/json_text.h"
#include "booster/checkpoint/atomic_file.h"
#include "booster/checkpoint/safetensors.h"

namespace booster {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {
constexpr const char* kOptimizerTensorsFile = "optimizer.safetensors";
constexpr const char* kOptimizerMetaFile = "optimizer.json";

json read_json(const fs::path& file, const char* what) {
  BOOSTER_CHECK(fs::exists(file), CheckpointError, what, ": ", file.string(), " does not exist");
  try {
    // Note [One JSON reader] (booster/common/json_text.h).
    return parse_json_text(checkpoint::read_text_file(file), std::string(what) + ": " + file.string(),
                           checkpoint_limits());
  } catch (const JsonSyntaxError& e) {
    BOOSTER_FAIL(CheckpointError, what, ": ", file.string(), " is not valid JSON (", e.detail(),
                 "); the file is truncated or corrupt");
  } catch (const ConfigError& e) {
    throw CheckpointError(e.what());
  }
}
}  // namespace

void CheckpointIO::save_model(const nn::Module& model, const fs::path& path, uint64_t max_shard_bytes) const {
  nn::StateDict state = model.state_dict();  // every rank: a sharded model may gather here
  if (writes()) checkpoint::save_model(path, state, max_shard_bytes);
  group_.barrier();
}

void CheckpointIO::load_model(nn::Module& model, const fs::path& path) const {
  model.load_state_dict(checkpoint::load_model(path));
}

void CheckpointIO::save_optimizer(const optim::Optimizer& optimizer, const fs::path& path) const {
  optim::OptimizerState state = optimizer.state_dict();  // collective for sharded optimizers
  // The index: which parameter each "state.<i>" is (Note [Resuming under another precision]).
  json names = json::array();
  for (const optim::ParamGroup& g : optimizer.param_groups())
    for (const Tensor& p : g.params) names.push_back(p.name());
  state.meta["param_names"] = names;
  if (writes()) {
    fs::create_directories(path);
    checkpoint::write_safetensors(path / kOptimizerTensorsFile, state.tensors);
    checkpoint::write_text_file_atomically(path / kOptimizerMetaFile, state.meta.dump(1) + "\n");
  }
  group_.barrier();
}

void CheckpointIO::load_optimizer(optim::Optimizer& optimizer, const fs::path& path) const {
  optim::OptimizerState state;
  state.meta = read_json(path / kOptimizerMetaFile, "load_optimizer");
  const fs::path tensors = path / kOptimizerTensorsFile;
  BOOSTER_CHECK(fs::exists(tensors), CheckpointError, "load_optimizer: ", tensors.string(), " does not exist");
  state.tensors = checkpoint::read_safetensors(tensors).tensors;
  optimizer.load_state_dict(state);
}

void CheckpointIO::save_lr_scheduler(const optim::LRScheduler& scheduler, const fs::path& path) const {
  if (writes()) {
    if (path.has_parent_path()) fs::create_directories(path.parent_path());
    checkpoint::write_text_file_atomically(path, scheduler.state_dict().dump(1) + "\n");
  }
  group_.barrier();
}

void CheckpointIO::load_lr_scheduler(optim::LRScheduler& scheduler, const fs::path& path) const {
  scheduler.load_state_dict(read_json(path, "load_lr_scheduler"));
}

}  // namespace booster
