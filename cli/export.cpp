// `booster export`: a training checkpoint's model as a Hugging Face model directory.
//
//   booster export --checkpoint runs/a/checkpoints/step-00000100 --format hf --out my-model
//                  [--dtype float32|bfloat16|float16] [--max-shard-size 5GB] [--config FILE]
//
// The checkpoint (a step directory, or a checkpoint root whose `latest` names one) holds the model's
// weights under model/ but not its architecture: that comes from the run's config.json, found beside
// the checkpoint root (<run_dir>/config.json for <run_dir>/checkpoints/step-N, as `booster train`
// lays a run out) or given with --config (the training config). The checkpoint's checksums are checked
// first, as a resume checks them (--no-verify skips that). The model is built from its `model`
// section without allocating it, the weights are loaded into it, and nn::save_pretrained writes
// config.json and the safetensors in Hugging Face's names (booster/nn/hf.h). A model of type "hf"
// takes its architecture, and the rest of its config.json, from the Hugging Face directory it was
// trained from. The float32 master weights a ZeRO or 16-bit strategy saved beside a 16-bit model are
// what is exported (the model file holds only their rounding); --dtype chooses what is written
// (float32 by default) and config.json's torch_dtype says it. The tokenizer files of the Hugging Face
// directory (or the run's data.tokenizer, as tokenizer.model) are copied along. What was written goes
// to stdout as one line of JSON.
//
// A LoRA run's checkpoint holds its adapters only (Note [Adapter-only checkpoints] in
// booster/booster/state.cpp) and says so in trainer_state.json. Of it:
//   booster export --checkpoint DIR --format peft --out OUT      the adapters as a PEFT directory
//                                                                 (adapter_config.json, adapter_model.safetensors;
//                                                                 booster/nn/peft.h), which PEFT's
//                                                                 PeftModel.from_pretrained and lora.init_from read
//   booster export --checkpoint DIR --format hf --merge-lora --out OUT
//                                                                 the base with W + s B A merged (in float64,
//                                                                 then --dtype), no adapter tensors: a plain model
// The base of the merge is built as `booster train` built it (the Hugging Face directory of model.path,
// model.init_from, or train.seed's initial weights) and checked against the digest the run recorded.
//
// Note [Export never destroys what it writes over]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// --out is refused when it lies inside any checkpoint (a step directory, a checkpoint root, the
// checkpoint being read, a step-* under a checkpoints/ directory: see inside_checkpoint), when it holds
// the checkpoint being read, and when it is a directory that is not empty, unless --overwrite. Every
// format writes into a fresh hidden sibling, `.<name>.export-<pid>`, which takes --out's place only
// once everything is written: a failure midway removes it and leaves --out as it was; with --overwrite
// the old directory is renamed aside, the new one renamed in, and only then is the old one (with the
// files the export did not rewrite) removed.
#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <regex>
#include <string>
#include <vector>

#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

#include "booster/booster/booster.h"
#include "booster/checkpoint/atomic_file.h"
#include "booster/checkpoint/checkpoint.h"
#include "booster/checkpoint/checksums.h"
#include "booster/checkpoint/safetensors.h"
#include "booster/common/error.h"
#include "booster/config/config.h"
#include "booster/nn/hf.h"
#include "booster/nn/models.h"
#include "booster/nn/peft.h"
#include "booster/tensor/deferred.h"
#include "commands.h"
#include "lora_checkpoint.h"
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

// Why `dir` is (part of) a checkpoint, or "" (Note [Export never destroys what it writes over]).
std::string checkpoint_kind(const fs::path& dir) {
  std::error_code ec;
  if (fs::exists(dir / checkpoint::kTrainerStateFileName, ec)) return "a checkpoint step (it holds trainer_state.json)";
  if (fs::exists(fs::symlink_status(dir / checkpoint::kChecksumsFileName, ec)))
    return "a checkpoint step (it holds checksums.json)";
  if (fs::exists(fs::symlink_status(dir / checkpoint::kLatestFileName, ec)))
    return "a checkpoint directory (it holds `latest`)";
  static const std::regex step_name(R"(step-\d{8}.*)");
  if (std::regex_match(dir.filename().string(), step_name) && dir.parent_path().filename() == "checkpoints")
    return "a checkpoint step directory";
  if (fs::is_directory(dir, ec) && !checkpoint::list_checkpoints(dir).empty())
    return "a checkpoint directory (it holds step-XXXXXXXX directories)";
  return "";
}

bool is_within(const fs::path& inner, const fs::path& outer) {
  auto i = inner.begin(), o = outer.begin();
  for (; o != outer.end(); ++i, ++o)
    if (i == inner.end() || *i != *o) return false;
  return true;
}

// The directory an export writes (Note [Export never destroys what it writes over]): checks --out,
// then hands out a fresh sibling to write into, which commit() puts in --out's place.
class OutputDirectory {
 public:
  OutputDirectory(const fs::path& given, const fs::path& step, bool overwrite) : given_(given) {
    out_ = fs::weakly_canonical(fs::absolute(given));
    if (out_.filename().empty()) out_ = out_.parent_path();  // "dir/" names dir
    const fs::path checkpoint = fs::weakly_canonical(fs::absolute(step));
    BOOSTER_CHECK(!is_within(out_, checkpoint), ConfigError, "--out ", given.string(),
                  " is inside the checkpoint being exported, ", checkpoint.string(),
                  "; writing there would change the checkpoint: choose a directory outside it");
    for (fs::path dir = out_;; dir = dir.parent_path()) {
      const std::string kind = checkpoint_kind(dir);
      BOOSTER_CHECK(kind.empty(), ConfigError, "--out ", given.string(), dir == out_ ? " is " : " is inside ",
                    dir == out_ ? "" : dir.string() + ", ", kind,
                    "; writing there would change a checkpoint: choose a directory outside every checkpoint");
      if (dir == dir.root_path() || dir.parent_path() == dir) break;
    }
    BOOSTER_CHECK(!is_within(checkpoint, out_), ConfigError, "--out ", given.string(),
                  " holds the checkpoint being exported, ", checkpoint.string(),
                  "; choose a directory outside it");
    std::error_code ec;
    if (fs::exists(fs::symlink_status(out_, ec))) {
      BOOSTER_CHECK(fs::is_directory(out_, ec), ConfigError, "--out ", given.string(),
                    " exists and is not a directory; an export writes a directory: choose another --out");
      size_t entries = 0;
      std::string first;
      for (const auto& e : fs::directory_iterator(out_)) {
        if (entries++ == 0) first = e.path().filename().string();
      }
      replace_ = entries > 0;
      BOOSTER_CHECK(!replace_ || overwrite, ConfigError, "--out ", given.string(), " is not empty (", entries,
                    entries == 1 ? " entry: '" : " entries, e.g. '", first,
                    "'); choose a new or empty directory, or pass --overwrite to replace it (its files are removed "
                    "once the export has succeeded)");
    }
    fs::create_directories(out_.parent_path());
    const std::string tag = std::to_string(::getpid());
    std::string hidden(".");
    hidden += out_.filename().string();
    tmp_ = out_.parent_path() / (hidden + ".export-" + tag);
    old_ = out_.parent_path() / (hidden + ".export-old-" + tag);
    fs::remove_all(tmp_);
  }
  OutputDirectory(const OutputDirectory&) = delete;
  OutputDirectory& operator=(const OutputDirectory&) = delete;
  ~OutputDirectory() {
    std::error_code ec;
    if (!committed_) fs::remove_all(tmp_, ec);
  }

  // Where to write.
  const fs::path& path() const { return tmp_; }
  // --out as given, for messages.
  const fs::path& given() const { return given_; }

  // Puts what was written in --out's place; the old directory's files go only now.
  void commit() {
    fs::create_directories(tmp_);
    checkpoint::sync_directory(tmp_);
    std::error_code ec;
    if (replace_) {
      fs::remove_all(old_, ec);
      fs::rename(out_, old_);
      fs::rename(tmp_, out_);
      committed_ = true;
      fs::remove_all(old_);
    } else {
      if (fs::exists(fs::symlink_status(out_, ec))) fs::remove(out_);  // empty
      fs::rename(tmp_, out_);
      committed_ = true;
    }
    checkpoint::sync_directory(out_.parent_path());
  }

  // The names of the files written, sorted (after commit()).
  json files() const {
    json names = json::array();
    for (const auto& e : fs::directory_iterator(out_)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  fs::path given_, out_, tmp_, old_;
  bool replace_ = false, committed_ = false;
};

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

// The files beside a Hugging Face model's weights that a user of the exported model needs to run it:
// its tokenizer and generation settings, those that exist.
std::vector<fs::path> tokenizer_files_of(const fs::path& hf_dir) {
  std::vector<fs::path> files;
  for (const char* name : {"tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                           "generation_config.json"})
    if (fs::is_regular_file(hf_dir / name)) files.push_back(hf_dir / name);
  return files;
}

// --format peft or --format hf --merge-lora of a LoRA run's checkpoint (see the top).
int export_lora(const fs::path& step, const json& resolved, const nn::LoraConfig& lora, const std::string& format,
                OutputDirectory& output, DType dtype, const std::string& dtype_arg, nn::SavePretrainedOptions options,
                bool verify) {
  const fs::path& out = output.path();
  const json& model_config = resolved.at("model");
  const uint64_t seed = resolved.at("train").at("seed").get<uint64_t>();
  const bool hf = model_config.value("type", std::string()) == "hf";
  const fs::path hf_dir = hf ? fs::path(model_config.value("path", std::string())) : fs::path();
  if (hf)
    BOOSTER_CHECK(fs::exists(hf_dir / "config.json"), ConfigError, "the checkpoint's base is the Hugging Face model ",
                  hf_dir.string(), ", whose config.json is missing here; pass the run's config with --config FILE, its "
                  "model.path the directory's path now");
  const nn::ModulePtr model = lora_checkpoint_model(step, model_config, seed, lora, verify);
  json summary = {{"out", output.given().string()}, {"checkpoint", step.string()}, {"format", format}, {"dtype", dtype_arg}};
  if (format == "peft") {
    nn::save_peft_adapter(*model, lora, out, {.base_model_name_or_path = hf ? hf_dir.string() : "", .dtype = dtype});
    int64_t adapters = 0;
    for (const Tensor& p : nn::trainable_parameters(*model)) adapters += p.numel();
    summary["parameters"] = adapters;
    output.commit();
    std::cerr << "booster: wrote the LoRA adapters of " << step.string() << " as a PEFT directory " << output.given().string()
              << " (r " << lora.r << ", " << adapters << " parameters, " << dtype_arg << ")\n";
  } else {
    const nn::StateDict merged = nn::merge_lora(*model, lora);
    nn::ModulePtr plain;
    {
      LazyInitGuard lazy;  // the merged weights replace every tensor
      plain = base_model(model_config, seed, verify);
    }
    plain->load_state_dict(merged);
    if (dtype != DType::Float32) plain->to(dtype);
    if (hf) options.base_config = config::load_file((hf_dir / "config.json").string());
    nn::save_pretrained(*plain, out, options);
    if (hf)
      for (const fs::path& file : tokenizer_files_of(hf_dir)) fs::copy_file(file, out / file.filename(), fs::copy_options::overwrite_existing);
    summary["parameters"] = plain->num_parameters();
    summary["merged_lora"] = true;
    output.commit();
    std::cerr << "booster: wrote " << output.given().string() << " (the base with the LoRA adapters of " << step.string()
              << " merged, " << plain->num_parameters() << " parameters, " << dtype_arg << ")\n";
  }
  summary["files"] = output.files();
  std::cout << summary.dump() << std::endl;
  return kExitOk;
}

}  // namespace

int export_model(const std::vector<std::string>& args) {
  po::options_description desc(
      "usage: booster export --checkpoint DIR --format hf --out OUT [--dtype float32] [--max-shard-size 5GB]\n"
      "                     [--config FILE] [--merge-lora] [--overwrite]\n"
      "       booster export --checkpoint DIR --format peft --out OUT [--dtype float32] [--overwrite]\n\n"
      "Writes a checkpoint's model as a Hugging Face model directory (config.json and model.safetensors, or\n"
      "shards with model.safetensors.index.json) that transformers' from_pretrained loads; a LoRA run's\n"
      "adapters as a PEFT adapter directory (--format peft), or its model with the adapters merged\n"
      "(--merge-lora).\n\noptions");
  desc.add_options()
      ("help,h", "show this help")
      ("checkpoint", po::value<std::string>()->value_name("DIR"),
       "a checkpoint step directory (step-N), or a checkpoint directory (its latest step)")
      ("format", po::value<std::string>()->default_value("hf")->value_name("hf|peft"),
       "the output format: hf (a Hugging Face model) or peft (a LoRA run's adapters)")
      ("merge-lora", "with --format hf, of a LoRA run: the base model with the adapters merged (W + s B A)")
      ("out,o", po::value<std::string>()->value_name("DIR"), "the directory to write")
      ("max-shard-size", po::value<std::string>()->default_value("5GB")->value_name("SIZE"),
       "split the weights into shards of at most SIZE (e.g. 2GB, 500MB), as transformers does")
      ("config,c", po::value<std::string>()->value_name("FILE"),
       "the run's config (default: the config.json booster train wrote beside the checkpoint)")
      ("dtype", po::value<std::string>()->default_value("float32")->value_name("DTYPE"),
       "the weights' dtype: float32 (the float32 master weights where the run kept them), bfloat16 or float16")
      ("overwrite", "replace --out when it is a directory that is not empty (never one inside a checkpoint)")
      ("no-verify", "export without checking the checkpoint's files against its checksums");
  po::variables_map vm;
  if (!parse_options("export", desc, args, vm, {"checkpoint", "out"})) return kExitOk;
  const std::string format = vm["format"].as<std::string>();
  BOOSTER_CHECK(format == "hf" || format == "peft", ConfigError, "--format ", format,
                ": the export formats are hf (Hugging Face) and peft (a LoRA run's adapters)");
  nn::SavePretrainedOptions options;
  options.max_shard_bytes = nn::parse_byte_size(vm["max-shard-size"].as<std::string>());
  // A run directory stands for its checkpoints/ (checkpoint::checkpoints_of_run).
  const fs::path step = step_directory(checkpoint::checkpoints_of_run(vm["checkpoint"].as<std::string>()));
  if (!vm.count("no-verify")) checkpoint::verify_checksums(step);  // a damaged file is refused, naming it
  OutputDirectory output(vm["out"].as<std::string>(), step, vm.count("overwrite") > 0);
  const fs::path& out = output.path();
  const std::string dtype_arg = vm["dtype"].as<std::string>();
  BOOSTER_CHECK(dtype_arg == "float32" || dtype_arg == "bfloat16" || dtype_arg == "float16", ConfigError, "--dtype ",
                dtype_arg, ": the weights are written as float32, bfloat16 or float16");
  const DType dtype = dtype_arg == "float32" ? DType::Float32 : dtype_arg == "bfloat16" ? DType::BFloat16 : DType::Float16;

  const json given = run_config(step, vm.count("config") ? vm["config"].as<std::string>() : std::string());
  const json resolved = config::resolve(given, config::training_schema());
  const std::optional<nn::LoraConfig> lora = checkpoint_lora(step);
  BOOSTER_CHECK(lora || (format == "hf" && !vm.count("merge-lora")), ConfigError,
                format == "peft" ? "--format peft" : "--merge-lora", ": the checkpoint ", step.string(),
                " is of a run without LoRA (its trainer_state.json has no \"lora\"); export it with --format hf");
  BOOSTER_CHECK(!lora || format == "peft" || vm.count("merge-lora"), ConfigError, "the checkpoint ", step.string(),
                " holds a LoRA run's adapters only; export them with --format peft, or the model with the adapters "
                "merged with --format hf --merge-lora");
  if (lora) return export_lora(step, resolved, *lora, format, output, dtype, dtype_arg, options, !vm.count("no-verify"));
  json model_config = resolved.at("model");
  model_config.erase("init_from");
  nn::ModulePtr model;
  std::vector<fs::path> tokenizer_files;
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
      for (const fs::path& file : tokenizer_files_of(hf_dir)) tokenizer_files.push_back(file);
    } else {
      model = nn::make_model(model_config, 0);
    }
  }
  // The model file's weights, each replaced by its float32 master where the run kept one.
  bool masters = false;
  const nn::StateDict weights = Booster::read_trained_weights(step, &masters);
  model->load_state_dict(weights);
  if (dtype != DType::Float32) model->to(dtype);
  if (tokenizer_files.empty()) {
    const json data = given.value("data", json::object());
    if (data.is_object() && data.contains("tokenizer") && data.at("tokenizer").is_string()) {
      const fs::path tok = data.at("tokenizer").get<std::string>();
      if (fs::is_regular_file(tok)) tokenizer_files.push_back(tok);
    }
  }
  nn::save_pretrained(*model, out, options);
  for (const fs::path& file : tokenizer_files) {
    // A SentencePiece model is tokenizer.model under any name it had in the run.
    const fs::path name = file.extension() == ".model" ? fs::path("tokenizer.model") : file.filename();
    fs::copy_file(file, out / name, fs::copy_options::overwrite_existing);
  }

  output.commit();
  std::cerr << "booster: wrote " << output.given().string() << " (" << nn::hf_config_of(*model).at("model_type").get<std::string>()
            << ", " << model->num_parameters() << " parameters, " << dtype_arg
            << (masters ? ", from the float32 master weights" : "") << ") from " << step.string() << "\n";
  std::cout << json{{"out", output.given().string()}, {"checkpoint", step.string()}, {"format", format},
                    {"files", output.files()},
                    {"parameters", model->num_parameters()}, {"dtype", dtype_arg},
                    {"master_weights", masters}}
                   .dump()
            << std::endl;
  return kExitOk;
}

}  // namespace booster::cli
