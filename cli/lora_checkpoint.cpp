// The model of a LoRA run's checkpoint (lora_checkpoint.h).
#include "lora_checkpoint.h"

#include <sstream>

#include "booster/booster/booster.h"
#include "booster/checkpoint/atomic_file.h"
#include "booster/checkpoint/checkpoint.h"
#include "booster/common/error.h"
#include "booster/common/json_text.h"
#include "booster/nn/models.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace booster::cli {

namespace {

json trainer_state(const fs::path& step) {
  const fs::path file = step / "trainer_state.json";
  if (!fs::exists(file)) return json::object();
  // Note [One JSON reader] (booster/common/json_text.h).
  const json state = try_parse_json_text(checkpoint::read_text_file(file), checkpoint_limits());
  return state.is_object() ? state : json::object();
}

}  // namespace

std::optional<nn::LoraConfig> checkpoint_lora(const fs::path& step) {
  const json state = trainer_state(step);
  if (!state.contains("lora") || !state.at("lora").is_object()) return std::nullopt;
  try {
    return nn::LoraConfig::from_json(state.at("lora").value("config", json::object()));
  } catch (const Error& e) {
    BOOSTER_FAIL(CheckpointError, (step / "trainer_state.json").string(), ": its \"lora\" config: ", e.what());
  }
}

nn::ModulePtr base_model(json model_config, uint64_t seed, bool verify) {
  const json init_from = model_config.value("init_from", json());
  model_config.erase("init_from");
  nn::ModulePtr model = nn::make_model(model_config, seed);  // type "hf" reads the directory's weights
  if (init_from.is_string())
    model->load_state_dict(checkpoint::load_weights(init_from.get<std::string>(), {.verify = verify}));
  return model;
}

nn::ModulePtr lora_checkpoint_model(const fs::path& step, const json& model_config, uint64_t seed,
                                    const nn::LoraConfig& lora, bool verify) {
  nn::ModulePtr model = base_model(model_config, seed, verify);
  nn::LoraConfig settings = lora;
  settings.init_from.clear();  // the checkpoint's adapters replace the start
  nn::apply_lora(*model, settings);
  const json saved = trainer_state(step).value("lora", json::object()).value("base_digest", json());
  const std::string digest = Booster::base_digest(*model);
  BOOSTER_CHECK(!saved.is_string() || saved.get<std::string>() == digest, CheckpointError, "the checkpoint ",
                step.string(), " was trained on a base of digest ", saved.dump(), ", but the run's model section gives "
                "one of digest \"", digest, "\" (another model.path, model.init_from or seed?); pass the run's "
                "config with --config FILE");
  const nn::StateDict trained = Booster::read_trained_weights(step);
  std::ostringstream missing;
  for (const auto& [name, p] : model->named_parameters())
    if (p.requires_grad() && !trained.count(name)) missing << (missing.tellp() > 0 ? ", " : "") << name;
  BOOSTER_CHECK(missing.tellp() == 0, CheckpointError, "the checkpoint ", step.string(), " lacks the adapters ",
                missing.str(), "; is it of this LoRA run?");
  model->load_state_dict(trained, /*strict=*/false);
  return model;
}

}  // namespace booster::cli
