// `booster generate`: samples tokens from a trained model with nn::generate (booster/nn/generate.h).
//
//   booster generate --checkpoint runs/a/checkpoints [--config FILE] --prompt "Once" --tokenizer tok.model
//   booster generate --hf DIR --prompt-ids "1 2 3" --temperature 0 --max-new-tokens 20
//
// The model: --checkpoint is a step directory, or a checkpoint root whose `latest` names one; its weights
// are model/ (with the float32 masters a ZeRO or pure 16-bit run kept, checked against the checkpoint's
// checksums first unless --no-verify) and its architecture the "model" section it records in trainer_state.json
// (settings.model, which `booster train` saves; Note [Settings a resume must keep]), else the run's
// config.json beside the root, else --config (a training config, or a model section alone). --hf is a
// Hugging Face model directory, read by nn::load_pretrained. The prompt: --prompt TEXT, encoded with
// --tokenizer (a SentencePiece model or a tokenizer.json, as `booster tokenize` uses), or --prompt-ids,
// ids separated by spaces or commas. With a tokenizer stdout is the prompt followed by the generated
// text, and generation stops at the tokenizer's </s> (with --ignore-eos it goes on, each </s> printed as
// a line end); without one, stdout is one line: the new ids. With --hf it stops at the directory's
// eos_token_id too (generation_config.json's, else config.json's; one id or a list), as transformers'
// generate does. A sentence on stderr says how many tokens came, how fast, and why it stopped (the count,
// </s>, a --stop text, or the model's position limit). --hf DIR uses DIR's tokenizer.model, else its
// tokenizer.json, when --tokenizer is not given, and a prompt starts with BOS when the Hugging Face
// tokenizer adds one (add_bos_token in tokenizer_config.json, else the tokenizer's BOS: a SentencePiece
// model's, the one a tokenizer.json's post-processor adds), as transformers encodes it; a run of
// booster's own on `booster tokenize` data (lines without BOS) gets none. --repetition-penalty,
// --stop and --num-samples are transformers' repetition_penalty, stop_strings and
// num_return_sequences (sample i seeded S + i).
//
// A LoRA run's checkpoint holds its adapters only: its base is rebuilt from the run's model section (a
// Hugging Face directory's weights, else train.seed's initial ones; checked against the digest the run
// recorded) and the adapters loaded on it. --adapter DIR applies a PEFT adapter directory (nn/peft.h:
// adapter_config.json and adapter_model.safetensors, as PEFT saves them or `booster export --format
// peft` writes them) to the --hf or --checkpoint model: y = W x + s B A x on its target Linears, what
// generation with the merged model computes.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

#include "booster/booster/booster.h"
#include "booster/checkpoint/atomic_file.h"
#include "booster/checkpoint/checksums.h"
#include "booster/checkpoint/checkpoint.h"
#include "booster/checkpoint/safetensors.h"
#include "booster/common/error.h"
#include "booster/config/config.h"
#include "booster/common/json_text.h"
#include "booster/data/tokenizer.h"
#include "booster/nn/generate.h"
#include "booster/nn/kv_cache.h"
#include "booster/nn/models.h"
#include "booster/nn/peft.h"
#include "commands.h"
#include "lora_checkpoint.h"
#include "options.h"

namespace po = boost::program_options;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace booster::cli {
namespace {

// The model section of the run that wrote checkpoint `step`: trainer_state.json's settings.model, else the
// run's config.json (<run_dir>/config.json for <run_dir>/checkpoints/step-N), else --config.
json checkpoint_model_config(const fs::path& step, const std::string& config_file) {
  if (!config_file.empty()) {
    const json c = config::load_file(config_file);
    BOOSTER_CHECK(c.is_object(), ConfigError, "--config ", config_file, " is not a JSON object");
    const json model = c.contains("model") ? c.at("model") : c;
    BOOSTER_CHECK(model.is_object() && model.contains("type"), ConfigError, "--config ", config_file,
                  " has no \"model\" section with a \"type\"; give the training config the checkpoint was made with");
    return model;
  }
  const fs::path state_file = step / "trainer_state.json";
  if (fs::exists(state_file)) {
    const json state = try_parse_json_text(checkpoint::read_text_file(state_file), checkpoint_limits());
    if (state.is_object() && state.contains("settings") && state.at("settings").is_object() &&
        state.at("settings").contains("model") && state.at("settings").at("model").is_object())
      return state.at("settings").at("model");
  }
  for (const fs::path& dir : {step.parent_path(), step.parent_path().parent_path()}) {
    const fs::path file = dir / "config.json";
    if (dir.empty() || !fs::exists(file)) continue;
    const json c = config::load_file(file.string());
    if (c.is_object() && c.contains("model") && c.at("model").is_object()) return c.at("model");
  }
  BOOSTER_FAIL(ConfigError, "the checkpoint ", step.string(), " does not record its model (no settings.model in ",
               state_file.string(), ", no config.json beside it); pass the training config with --config FILE");
}

// `hf_source` (when given) receives the Hugging Face directory a model.type "hf" run started from.
nn::ModulePtr load_checkpoint_model(const std::string& given, const std::string& config_file, bool verify,
                                    std::string* hf_source) {
  BOOSTER_CHECK(fs::exists(given), ConfigError, "--checkpoint ", given,
                " does not exist; give a checkpoint step directory (runs/a/checkpoints/step-00000100) or its root");
  const fs::path step = checkpoint::resolve_checkpoint(checkpoint::checkpoints_of_run(given));  // a run dir: its checkpoints/
  BOOSTER_CHECK(fs::is_directory(step / "model"), CheckpointError, "--checkpoint ", step.string(),
                " has no model/ directory; it is not a booster checkpoint with weights");
  json model_config = checkpoint_model_config(step, config_file);
  model_config.erase("init_from");
  if (model_config.value("type", std::string()) == "hf" && model_config.value("path", json()).is_string()) {
    // A relative model.path is relative to where `booster train` ran, which may not be here.
    const fs::path hf_dir = model_config.at("path").get<std::string>();
    BOOSTER_CHECK(fs::is_directory(hf_dir), ConfigError, "the checkpoint's model is the Hugging Face model ",
                  hf_dir.string(), ", which is not a directory",
                  hf_dir.is_relative() ? " here (" + fs::current_path().string() + "); the path is relative to the "
                                         "directory booster train ran in, so run generate there, or"
                                       : "; it gives the model's architecture:",
                  " pass the run's config with --config FILE, its model.path the directory's path now");
  }
  if (verify) checkpoint::verify_checksums(step);  // a damaged file is refused, naming it, as export does
  if (hf_source) *hf_source = model_config.value("type", std::string()) == "hf" ? model_config.value("path", std::string()) : "";
  if (const std::optional<nn::LoraConfig> lora = checkpoint_lora(step)) {
    const json state =
        try_parse_json_text(checkpoint::read_text_file(step / "trainer_state.json"), checkpoint_limits());
    const json seed = state.is_object() ? state.value("settings", json::object()).value("train.seed", json(0)) : json(0);
    nn::ModulePtr model = lora_checkpoint_model(step, model_config, seed.is_number_unsigned() ? seed.get<uint64_t>() : 0,
                                                *lora, verify);
    model->to(DType::Float32);
    return model;
  }
  nn::ModulePtr model = nn::make_model(model_config, 0);
  // The float32 masters where the run kept them (a ZeRO or pure 16-bit run), else the model file's.
  model->load_state_dict(Booster::read_trained_weights(step));
  model->to(DType::Float32);  // a 16-bit strategy may have saved 16-bit weights; generation runs in float32
  return model;
}

// The Hugging Face directory's model, through nn::load_pretrained (hf.h), looked up in the model
// registry as make_model({"type": "hf", "path": DIR}) so this file needs nothing of hf.h.
nn::ModulePtr load_hf_model(const std::string& dir) {
  BOOSTER_CHECK(fs::is_directory(dir), ConfigError, "--hf ", dir, " is not a directory; give a Hugging Face model ",
                "directory (config.json and model.safetensors)");
  nn::ModulePtr model = nn::make_model(json{{"type", "hf"}, {"path", dir}}, 0);
  return model;
}

// The ids that end a sequence of Hugging Face model directory `dir`, as transformers' generate stops:
// generation_config.json's eos_token_id, else config.json's (an id, a list of ids, or null: none).
std::vector<int64_t> hf_eos_ids(const fs::path& dir) {
  for (const char* name : {"generation_config.json", "config.json"}) {
    const fs::path file = dir / name;
    if (!fs::exists(file)) continue;
    // The config's limits (Note [One JSON reader] in booster/common/json_text.h).
    const json c = booster::read_json_file(file.string(), "Hugging Face file", JsonLimits{});
    BOOSTER_CHECK(c.is_object(), ConfigError, file.string(), " is not a JSON object");
    if (!c.contains("eos_token_id")) continue;
    const json& eos = c.at("eos_token_id");
    std::vector<int64_t> ids;
    for (const json& id : eos.is_array() ? eos : eos.is_null() ? json::array() : json::array({eos})) {
      BOOSTER_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0, ConfigError, file.string(),
                    ": \"eos_token_id\" must be an id, a list of ids or null, got ", eos.dump(),
                    "; fix the file, or pass --ignore-eos");
      ids.push_back(id.get<int64_t>());
    }
    return ids;
  }
  return {};
}

// Whether the tokenizer of a Hugging Face directory starts a text with its BOS id: tokenizer_config.json's
// add_bos_token when it says, else yes when the SentencePiece model has a BOS id (LlamaTokenizer's
// default). Without a Hugging Face directory (a booster run on `booster tokenize` data, which encodes
// lines without BOS) no.
bool adds_bos(const std::string& hf_dir, const data::Tokenizer& tokenizer) {
  if (hf_dir.empty()) return false;
  const fs::path file = fs::path(hf_dir) / "tokenizer_config.json";
  if (fs::exists(file)) {
    const json c = config::load_file(file.string());
    if (c.is_object() && c.contains("add_bos_token")) {
      BOOSTER_CHECK(c.at("add_bos_token").is_boolean(), ConfigError, file.string(),
                    ": \"add_bos_token\" must be true or false, got ", c.at("add_bos_token").dump());
      return c.at("add_bos_token").get<bool>() && tokenizer.bos_id() >= 0;
    }
  }
  return tokenizer.bos_id() >= 0;
}

// "1 2 3" or "1,2,3" -> ids; ConfigError naming the piece that is not a non-negative integer.
std::vector<int64_t> parse_ids(const std::string& text) {
  std::string s = text;
  for (char& c : s)
    if (c == ',') c = ' ';
  std::istringstream in(s);
  std::vector<int64_t> ids;
  std::string piece;
  while (in >> piece) {
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(piece, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    BOOSTER_CHECK(used == piece.size() && v >= 0, ConfigError, "--prompt-ids: '", piece,
                  "' is not a token id (a non-negative integer); give ids separated by spaces, e.g. \"1 2 3\"");
    ids.push_back(v);
  }
  BOOSTER_CHECK(!ids.empty(), ConfigError, "--prompt-ids is empty; give at least one token id");
  return ids;
}

}  // namespace

int generate(const std::vector<std::string>& args) {
  po::options_description desc(
      "usage: booster generate (--checkpoint DIR | --hf DIR) [--adapter DIR]\n"
      "                        (--prompt TEXT --tokenizer tok.model | --prompt-ids \"1 2 3\")\n"
      "                        [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]\n"
      "                        [--repetition-penalty P] [--stop TEXT] [--num-samples N]\n\n"
      "Samples a continuation of a prompt from a trained model, one position per new token through a\n"
      "key/value cache. --temperature 0 is greedy.\n\noptions");
  desc.add_options()
      ("help,h", "show this help")
      ("checkpoint", po::value<std::string>()->value_name("DIR"),
       "a booster checkpoint: a step directory, or a checkpoint root (its latest step)")
      ("config,c", po::value<std::string>()->value_name("FILE"),
       "the training config, when the checkpoint does not record its model")
      ("hf", po::value<std::string>()->value_name("DIR"), "a Hugging Face model directory instead of --checkpoint")
      ("adapter", po::value<std::string>()->value_name("DIR"),
       "a PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) to apply to the model")
      ("prompt", po::value<std::string>()->value_name("TEXT"), "the prompt text (needs --tokenizer)")
      ("tokenizer", po::value<std::string>()->value_name("FILE"),
       "the SentencePiece .model or Hugging Face tokenizer.json of the text")
      ("prompt-ids", po::value<std::string>()->value_name("IDS"), "the prompt as token ids, e.g. \"1 2 3\"")
      ("max-new-tokens,n", po::value<int64_t>()->default_value(64)->value_name("N"), "tokens to generate at most")
      ("temperature,t", po::value<double>()->default_value(1.0)->value_name("T"),
       "divides the logits; 0 is greedy (the most probable token)")
      ("top-k", po::value<int64_t>()->default_value(0)->value_name("K"), "sample among the K most probable (0: all)")
      ("top-p", po::value<double>()->default_value(1.0)->value_name("P"),
       "sample among the most probable tokens that make up probability P (1: all)")
      ("seed", po::value<uint64_t>()->default_value(0)->value_name("S"), "the seed of the draws")
      ("repetition-penalty", po::value<double>()->default_value(1.0)->value_name("P"),
       "divide the positive logits (multiply the negative ones) of ids already in the text by P (1: off)")
      ("stop", po::value<std::vector<std::string>>()->value_name("TEXT"),
       "stop once the new text contains TEXT (it is printed); may be given several times; needs a tokenizer")
      ("num-samples", po::value<int64_t>()->default_value(1)->value_name("N"),
       "N continuations of the prompt, sample i drawn with seed S + i")
      ("no-verify", "load the checkpoint without checking its files against its checksums")
      ("device,d", po::value<std::string>()->default_value("cpu")->value_name("DEVICE"), "cpu, cuda or cuda:N")
      ("ignore-eos", "go on past the end-of-sequence ids (the tokenizer's </s>, printed as a line end, and "
                     "with --hf those of the directory's eos_token_id)")
      ("no-cache", "recompute the whole sequence for every token (slow; for comparison)");
  po::variables_map vm;
  if (!parse_options("generate", desc, args, vm)) return kExitOk;
  BOOSTER_CHECK(vm.count("checkpoint") + vm.count("hf") == 1, ConfigError,
                "'booster generate' needs one of --checkpoint DIR or --hf DIR (see booster generate --help)");
  BOOSTER_CHECK(vm.count("prompt") + vm.count("prompt-ids") == 1, ConfigError,
                "'booster generate' needs one of --prompt TEXT (with --tokenizer) or --prompt-ids \"1 2 3\"");
  // --hf DIR brings its own tokenizer when it has one: its SentencePiece tokenizer.model, else its
  // tokenizer.json (byte-level BPE).
  std::string tokenizer_file = vm.count("tokenizer") ? vm["tokenizer"].as<std::string>() : "";
  for (const char* name : {"tokenizer.model", "tokenizer.json"})
    if (tokenizer_file.empty() && vm.count("hf") && fs::is_regular_file(fs::path(vm["hf"].as<std::string>()) / name))
      tokenizer_file = (fs::path(vm["hf"].as<std::string>()) / name).string();
  BOOSTER_CHECK(!vm.count("prompt") || !tokenizer_file.empty(), ConfigError,
                "--prompt needs --tokenizer FILE to turn the text into ids",
                vm.count("hf") ? " (the --hf directory has no tokenizer.model or tokenizer.json)" : "",
                "; or give --prompt-ids");
  BOOSTER_CHECK(!vm.count("stop") || !tokenizer_file.empty(), ConfigError,
                "--stop needs a tokenizer (--tokenizer FILE) to read the new text");
  nn::GenerateOptions options;
  options.max_new_tokens = vm["max-new-tokens"].as<int64_t>();
  options.temperature = vm["temperature"].as<double>();
  options.top_k = vm["top-k"].as<int64_t>();
  options.top_p = vm["top-p"].as<double>();
  options.seed = vm["seed"].as<uint64_t>();
  options.use_cache = !vm.count("no-cache");
  options.repetition_penalty = vm["repetition-penalty"].as<double>();
  const int64_t samples = vm["num-samples"].as<int64_t>();
  BOOSTER_CHECK(std::isfinite(options.repetition_penalty) && options.repetition_penalty > 0.0, ConfigError,
                "--repetition-penalty ", options.repetition_penalty, ": expected a number > 0 (1 is off)");
  BOOSTER_CHECK(samples >= 1, ConfigError, "--num-samples ", samples, ": expected a count >= 1");
  BOOSTER_CHECK(options.max_new_tokens >= 0, ConfigError, "--max-new-tokens ", options.max_new_tokens,
                ": expected a count >= 0");
  BOOSTER_CHECK(std::isfinite(options.temperature) && options.temperature >= 0.0, ConfigError, "--temperature ",
                options.temperature, ": expected a number >= 0 (0 is greedy)");
  BOOSTER_CHECK(options.top_k >= 0, ConfigError, "--top-k ", options.top_k, ": expected a count >= 0 (0 keeps all)");
  BOOSTER_CHECK(options.top_p > 0.0 && options.top_p <= 1.0, ConfigError, "--top-p ", options.top_p,
                ": expected a probability in (0, 1] (1 keeps all)");
  const Device device = device_from_string(vm["device"].as<std::string>());

  std::unique_ptr<data::Tokenizer> tokenizer;
  if (!tokenizer_file.empty()) tokenizer = data::open_tokenizer(tokenizer_file);

  std::string hf_dir = vm.count("hf") ? vm["hf"].as<std::string>() : "";
  nn::ModulePtr model = vm.count("hf") ? load_hf_model(hf_dir)
                                       : load_checkpoint_model(vm["checkpoint"].as<std::string>(),
                                                               vm.count("config") ? vm["config"].as<std::string>() : "",
                                                               !vm.count("no-verify"), &hf_dir);
  if (vm.count("adapter")) {
    nn::LoraConfig adapter = nn::LoraConfig::from_peft(vm["adapter"].as<std::string>());
    adapter.dropout = 0.0;  // generation draws no dropout
    nn::apply_lora(*model, adapter);
  }
  std::vector<int64_t> prompt;
  bool bos = false;
  if (vm.count("prompt-ids")) {
    prompt = parse_ids(vm["prompt-ids"].as<std::string>());
  } else {
    bos = adds_bos(hf_dir, *tokenizer);
    if (bos) prompt.push_back(tokenizer->bos_id());
    for (int id : tokenizer->encode(vm["prompt"].as<std::string>())) prompt.push_back(id);
    BOOSTER_CHECK(int64_t(prompt.size()) > int64_t(bos), ConfigError, "--prompt gave no tokens; give some text");
  }
  if (vm.count("stop")) {
    const std::vector<std::string> stops = vm["stop"].as<std::vector<std::string>>();
    for (const std::string& text : stops) BOOSTER_CHECK(!text.empty(), ConfigError, "--stop is empty; give the text to stop at");
    options.stop = [stops, t = tokenizer.get()](const std::vector<int64_t>& generated) {
      const std::string text = t->decode(std::vector<int>(generated.begin(), generated.end()));
      return std::any_of(stops.begin(), stops.end(), [&](const std::string& s) { return text.find(s) != std::string::npos; });
    };
  }
  if (tokenizer && !vm.count("ignore-eos")) options.eos_id = tokenizer->eos_id();
  if (!hf_dir.empty() && !vm.count("ignore-eos")) options.more_eos_ids = hf_eos_ids(hf_dir);
  if (tokenizer) options.vocab_limit = tokenizer->vocab_size();  // a padded vocabulary's extra ids are never text

  const nn::CausalLM* lm = model->causal_lm();
  BOOSTER_CHECK(lm != nullptr, ConfigError, "the model is a ", model->name(),
                ", which cannot generate; booster generate takes a gpt or llama model");
  for (int64_t id : prompt)
    BOOSTER_CHECK(id < lm->vocab_size(), ConfigError, "prompt token id ", id, " is past the model's vocabulary of ",
                  lm->vocab_size(), " ids (0 .. ", lm->vocab_size() - 1, ")");
  BOOSTER_CHECK(int64_t(prompt.size()) < lm->max_positions(), ConfigError, "the prompt has ", prompt.size(),
                " tokens; the model takes at most ", lm->max_positions(), " positions in all, so shorten it");
  if (tokenizer)
    BOOSTER_CHECK(tokenizer->vocab_size() <= lm->vocab_size(), ConfigError, "the tokenizer ",
                  tokenizer->path(), " has ", tokenizer->vocab_size(), " ids, the model only ", lm->vocab_size(),
                  "; give the tokenizer the model was trained with");
  model->to(device);
  std::cerr << "booster: " << model->name() << " from " << (vm.count("hf") ? vm["hf"].as<std::string>() : vm["checkpoint"].as<std::string>())
            << (vm.count("adapter") ? " with the LoRA adapter " + vm["adapter"].as<std::string>() : std::string())
            << ", prompt of " << prompt.size() << " tokens" << (bos ? " (BOS first, as its tokenizer adds it)" : "") << "\n";

  for (int64_t sample = 0; sample < samples; ++sample) {
    options.seed = vm["seed"].as<uint64_t>() + uint64_t(sample);
    const auto start = std::chrono::steady_clock::now();
    const nn::GenerateResult result = nn::generate(*model, prompt, options);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    std::string why;
    switch (result.stop_reason) {
      case nn::StopReason::MaxNewTokens: why = "--max-new-tokens reached"; break;
      case nn::StopReason::EndOfSequence: why = "the end-of-sequence token"; break;
      case nn::StopReason::StopCondition: why = "the --stop text"; break;
      case nn::StopReason::MaxPositions:
        why = "the model's limit of " + std::to_string(lm->max_positions()) + " positions (prompt and new tokens)";
        break;
    }
    std::cerr << "booster: " << (samples > 1 ? "sample " + std::to_string(sample + 1) + ": " : std::string())
              << "generated " << result.tokens.size() << " tokens in " << seconds << " s ("
              << (seconds > 0 ? double(result.tokens.size()) / seconds : 0.0) << " tokens/s, "
              << (options.use_cache ? "with" : "without") << " the key/value cache); stopped at " << why << "\n";
    if (tokenizer) {
      // Each </s> ends a line, as `booster tokenize` put one after every line of the text.
      std::vector<int> line;
      for (int64_t id : prompt)
        if (!(bos && line.empty() && id == tokenizer->bos_id())) line.push_back(int(id));
      for (int64_t id : result.tokens) {
        if (id == tokenizer->eos_id()) {
          std::cout << tokenizer->decode(line) << "\n";
          line.clear();
        } else {
          line.push_back(int(id));
        }
      }
      if (!line.empty()) std::cout << tokenizer->decode(line) << "\n";
    } else {
      std::string line;
      for (int64_t id : result.tokens) line += (line.empty() ? "" : " ") + std::to_string(id);
      std::cout << line << "\n";
    }
  }
  return kExitOk;
}

}  // namespace booster::cli
