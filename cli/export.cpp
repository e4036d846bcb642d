// `booster export`: a training checkpoint's model as a Hugging Face model directory.
//
//   booster export --checkpoint runs/a/checkpoints/step-00000100 --format hf --out my-model
//                  [--max-shard-size 5GB] [--config FILE]
//
// The checkpoint (a step directory, or a checkpoint root whose `latest` names one) holds the model's
// weights under model/ but not its architecture: that comes from the run's config.json, found beside
// the checkpoint root (<run_dir>/config.json for <run_dir>/checkpoints/step-N, as `booster train`
// lays a run out) or given with --config (the training config). The checkpoint's checksums are checked
// first, as a resume checks them (--no-verify skips that). The model is built from its `model`
// section without allocating it, the weights are loaded into it, and nn::save_pretrained writes
// config.json and the safetensors in Hugging Face's names (booster/nn/hf.h). A model of type "hf"
// takes its architecture, and the rest of its config.json, from the Hugging Face directory it was
// trained from. What was written goes to stdout as one line of JSON.
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

#include "booster/booster/booster.h"
#include "booster/checkpoint/checksums.h"
#include "booster/checkpoint/safetensors.h"
#include "booster/common/error.h"
#include "booster/config/config.h"
#include "booster/nn/hf.h"
#include "booster/nn/models.h"
#include "booster/tensor/deferred.h"
#include "commands.h"
#include "options.h"

namespace po = boost::program_options;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace booster::cli {
namespace {

// The step directory of --checkpoint: itself when it holds model/, else the one its `latest` names.
fs::path step_directory(const fs::path& given) {
  BOOSTER_CHECK(fs::exists(given), ConfigError, "--checkpoint ", given.string(), " does not exist");
  if (fs::is_directory(given / "model")) return given;
  const std::optional<fs::path> step = Booster::find_state(given);
  BOOSTER_CHECK(step && fs::is_directory(*step / "model"), ConfigError, "--checkpoint ", given.string(),
                " is neither a checkpoint step directory (step-N with model/) nor a checkpoint directory holding one");
  return *step;
}

// The run's config: --config, else the first config.json with a "model" section beside the checkpoint.
json run_config(const fs::path& step, const std::string& given) {
  if (!given.empty()) return config::load_file(given);
  for (const fs::path& dir : {step, step.parent_path(), step.parent_path().parent_path()}) {
    const fs::path file = dir / "config.json";
    if (!fs::exists(file)) continue;
    const json c = config::load_file(file.string());
    if (c.is_object() && c.contains("model") && c["model"].is_object()) return c;
  }
  BOOSTER_FAIL(ConfigError, "no config.json with a \"model\" section beside the checkpoint ", step.string(),
               " (booster train writes <run_dir>/config.json); pass the run's config with --config FILE");
}

}  // namespace

int export_model(const std::vector<std::string>& args) {
  po::options_description desc(
      "usage: booster export --checkpoint DIR --format hf --out OUT [--max-shard-size 5GB] [--config FILE]\n\n"
      "Writes a checkpoint's model as a Hugging Face model directory (config.json and model.safetensors, or\n"
      "shards with model.safetensors.index.json) that transformers' from_pretrained loads.\n\noptions");
  desc.add_options()
      ("help,h", "show this help")
      ("checkpoint", po::value<std::string>()->value_name("DIR"),
       "a checkpoint step directory (step-N), or a checkpoint directory (its latest step)")
      ("format", po::value<std::string>()->default_value("hf")->value_name("hf"), "the output format: hf")
      ("out,o", po::value<std::string>()->value_name("DIR"), "the directory to write")
      ("max-shard-size", po::value<std::string>()->default_value("5GB")->value_name("SIZE"),
       "split the weights into shards of at most SIZE (e.g. 2GB, 500MB), as transformers does")
      ("config,c", po::value<std::string>()->value_name("FILE"),
       "the run's config (default: the config.json booster train wrote beside the checkpoint)")
      ("no-verify", "export without checking the checkpoint's files against its checksums");
  po::variables_map vm;
  if (!parse_options("export", desc, args, vm, {"checkpoint", "out"})) return kExitOk;
  const std::string format = vm["format"].as<std::string>();
  BOOSTER_CHECK(format == "hf", ConfigError, "--format ", format, ": the only export format is hf (Hugging Face)");
  nn::SavePretrainedOptions options;
  options.max_shard_bytes = nn::parse_byte_size(vm["max-shard-size"].as<std::string>());
  const fs::path step = step_directory(vm["checkpoint"].as<std::string>());
  if (!vm.count("no-verify")) checkpoint::verify_checksums(step);  // a damaged file is refused, naming it
  const fs::path out = vm["out"].as<std::string>();

  const json given = run_config(step, vm.count("config") ? vm["config"].as<std::string>() : std::string());
  json model_config = config::resolve(given, config::training_schema()).at("model");
  model_config.erase("init_from");
  nn::ModulePtr model;
  {
    LazyInitGuard lazy;  // the checkpoint's weights replace every tensor: allocate each once, when loaded
    if (model_config.value("type", std::string()) == "hf") {
      const fs::path hf_dir = model_config.value("path", std::string());
      // A relative model.path is relative to where `booster train` ran, which may not be here.
      BOOSTER_CHECK(fs::exists(hf_dir / "config.json"), ConfigError, "the checkpoint's model is the Hugging Face model ",
                    hf_dir.string(), ", whose config.json is missing",
                    hf_dir.is_relative() ? " here (" + fs::current_path().string() + "); the path is relative to the "
                                           "directory booster train ran in, so run export there, or"
                                         : "; it gives the model's architecture:",
                    " pass the run's config with --config FILE, its model.path the directory's path now");
      options.base_config = config::load_file((hf_dir / "config.json").string());
      json overrides = model_config;
      overrides.erase("type");
      overrides.erase("path");
      model = nn::model_from_hf_config(options.base_config, overrides);
    } else {
      model = nn::make_model(model_config, 0);
    }
  }
  model->load_state_dict(checkpoint::load_model(step / "model"));
  nn::save_pretrained(*model, out, options);

  std::cerr << "booster: wrote " << out.string() << " (" << nn::hf_config_of(*model).at("model_type").get<std::string>()
            << ", " << model->num_parameters() << " parameters) from " << step.string() << "\n";
  json files = json::array();
  for (const auto& e : fs::directory_iterator(out)) files.push_back(e.path().filename().string());
  std::sort(files.begin(), files.end());
  std::cout << json{{"out", out.string()}, {"checkpoint", step.string()}, {"format", format}, {"files", files},
                    {"parameters", model->num_parameters()}}
                   .dump()
            << std::endl;
  return kExitOk;
}

}  // namespace booster::cli
