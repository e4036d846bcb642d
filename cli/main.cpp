// The `booster` program: parses the command line, dispatches to a subcommand, and turns every error
// into one readable line on stderr and an exit code (2: usage or config mistake, 1: runtime failure).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <new>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <boost/program_options.hpp>

#include "booster/booster/build_info.h"
#include "booster/booster/reproducible.h"
#include "booster/checkpoint/atomic_file.h"
#include "booster/checkpoint/checkpoint.h"
#include "booster/common/error.h"
#include "booster/config/config.h"
#include "booster/common/json_text.h"
#include "booster/config/memory_estimate.h"
#include "booster/diagnostics/doctor.h"
#include "booster/distributed/device_mesh.h"
#include "booster/distributed/mpi_process_group.h"
#include "booster/trainer/signals.h"
#include "booster/trainer/trainer.h"
#include "commands.h"
#include "options.h"

namespace po = boost::program_options;

namespace {

// Kept equal to project(booster VERSION ...) in CMakeLists.txt.
constexpr const char* kVersion = "0.1.0";

constexpr const char* kUsage =
    "usage: booster <command> [options]\n"
    "\n"
    "Train neural networks from a JSON config; switch precision and parallelism in the config.\n"
    "\n"
    "commands:\n"
    "  train       train a model: booster train --config FILE [--set key.path=value ...]\n"
    "  eval        loss and perplexity (or accuracy) on the held-out data: booster eval --config FILE --checkpoint DIR\n"
    "  check       validate a config, print it with every default filled in, and estimate its memory\n"
    "  run         start a command as N processes: booster run -n N -- booster train ...\n"
    "  doctor      name the layers whose values leave a format's range, and what to use instead\n"
    "  plot        draw the loss curves of runs: booster plot --out FILE.png RUN.jsonl ...\n"
    "  precisions  list the mixed-precision strategies with their options and defaults\n"
    "  plugins     list the parallel plugins with their devices, precisions and options\n"
    "  compat      print the compatibility matrix of strategies and plugins [--device cpu|cuda]\n"
    "  bench       time training steps: booster bench --workload mlp|gpt [--precision NAME]\n"
    "  tokenize    encode a text with a SentencePiece model: booster tokenize --model M --in TEXT --out FILE\n"
    "  generate    sample from a trained model: booster generate --checkpoint DIR --prompt-ids \"1 2 3\"\n"
    "  export      write a checkpoint's model for Hugging Face: booster export --checkpoint DIR --format hf --out OUT\n"
    "  flight      after a hang or crash, name the collective the ranks stopped in: booster flight RUN_DIR\n"
    "\n"
    "options:\n"
    "  -h, --help     show this help (or `booster <command> --help`)\n"
    "  --version      show the version and the build options\n"
    "\n"
    "example:\n"
    "  booster train --config examples/configs/fashion_mnist_mlp.json --set train.epochs=1\n"
    "  booster train --config examples/configs/fashion_mnist_mlp.json --mixed-precision bf16\n"
    "  booster plot --out loss.png runs/*/metrics.jsonl\n";

// A message as one readable line: control characters escaped, and any run of more than 200 characters
// without a space (a 10 MB value echoed back) cut to its ends, so the line stays short whatever the input.
std::string one_line(const std::string& message) {
  std::string escaped;
  for (const char c : message) {
    if (static_cast<unsigned char>(c) < 0x20 && c != '\n') {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", unsigned(static_cast<unsigned char>(c)));
      escaped += buf;
    } else {
      escaped += c;
    }
  }
  std::string out;
  size_t i = 0;
  while (i < escaped.size()) {
    size_t end = escaped.find(' ', i);
    if (end == std::string::npos) end = escaped.size();
    const size_t length = end - i;
    if (length > 200) {
      out += escaped.substr(i, 80) + "...[" + std::to_string(length - 120) + " characters]..." +
             escaped.substr(end - 40, 40);
    } else {
      out += escaped.substr(i, length);
    }
    if (end < escaped.size()) out += ' ';
    i = end + 1;
  }
  return out;
}

// Note [Errors of several processes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under a launcher every rank that fails prints its own error, and the launcher copies the ranks'
// output to one terminal as it arrives. So an error is written with one write (std::cerr is unbuffered:
// `<<` piece by piece let two ranks' pieces run together on one line) and, when the job has several
// processes, names its rank as the library's other per-rank lines do: "booster: rank 1 of 2: error:
// ...". `booster run` prints each distinct message once (Note [What booster run prints] in run.cpp).
void print_line(const std::string& line) {
  const std::string text = line + "\n";
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fflush(stderr);
}

// The processes of the job this one belongs to, from the launcher's variables (1 without one).
int job_size() { return booster::distributed::job_place_from_launcher().size; }

void print_error(const std::string& message) {
  std::string head = "booster: ";
  if (const int size = job_size(); size > 1)
    head += "rank " + std::to_string(booster::trainer::process_rank()) + " of " + std::to_string(size) + ": ";
  print_line(head + "error: " + one_line(message));
}

// A mistake on the command line: exit code 2 like a config mistake.
struct UsageError : booster::Error {
  using booster::Error::Error;
};

// The version and what this build can do: the CUDA backend (compiled in, and the devices found), NCCL,
// MPI (multi-process runs), the build type.
void print_version() {
  const nlohmann::json info = booster::build_info();
  const nlohmann::json& cuda = info.at("cuda");
  std::cout << "booster " << kVersion << "\n";
  if (!cuda.at("compiled").get<bool>()) {
    std::cout << "  CUDA: off (not compiled in)\n";
  } else {
    const int64_t devices = cuda.value("device_count", int64_t(0));
    std::cout << "  CUDA: on, " << devices << (devices == 1 ? " device" : " devices");
    for (const auto& name : cuda.value("devices", nlohmann::json::array())) std::cout << " (" << name.get<std::string>() << ")";
    const std::string reason = cuda.value("reason", "");
    if (!reason.empty()) std::cout << "; " << reason;
    std::cout << "\n";
  }
  std::cout << "  CPU kernels: " << info.value("cpu_kernels", std::string("?")) << "\n";
  std::cout << "  bfloat16 GEMMs: " << info.value("bf16_gemm", std::string("?")) << "\n";
  std::cout << "  convolutions: " << info.value("conv", std::string("?")) << "\n";
  std::cout << "  NCCL: " << (info.value("nccl", false) ? "on" : "off") << "\n"
            << "  MPI: " << (info.value("mpi", false) ? "on (booster run -n N starts N processes)" : "off (one process only)")
            << "\n"
#ifdef NDEBUG
            << "  build: release\n";
#else
            << "  build: debug\n";
#endif
}

// Options shared by the subcommands that read a config.
po::options_description config_options(const std::string& command) {
  po::options_description desc("usage: booster " + command + " --config FILE" +
                               (command == "eval" ? " [--checkpoint DIR | --hf DIR]" : "") +
                               " [--set key.path=value ...]\n\noptions");
  desc.add_options()
      ("help,h", "show this help")
      ("config,c", po::value<std::string>()->value_name("FILE"), "the JSON config (see examples/configs/)")
      ("set,s", po::value<std::vector<std::string>>()->composing()->value_name("KEY=VALUE"),
       "override one config value, e.g. --set optimizer.lr=3e-4 (repeatable; the value is parsed as "
       "JSON, else taken as a string)")
      ("mixed-precision,m", po::value<std::string>()->value_name("NAME"),
       "train with this mixed-precision strategy and its default options (replaces the whole "
       "mixed_precision section; `booster precisions` lists them, or give the path to a precision "
       "plugin's .so; for options use --set mixed_precision.KEY=VALUE after it)")
      ("plugin,p", po::value<std::string>()->value_name("NAME"),
       "run with this parallel plugin and its default options (replaces the whole plugin section; "
       "`booster plugins` lists them, or give the path to a plugin's .so; options: --set "
       "plugin.KEY=VALUE after it)")
      ("device,d", po::value<std::string>()->value_name("DEVICE"),
       "train on this device: cpu, cuda or cuda:N (same as --set device=...)")
      ("no-verify", "resume without checking the checkpoint's files against its checksums (same as --set "
       "train.verify_checkpoints=false)");
  if (command == "eval")
    desc.add_options()
        ("checkpoint", po::value<std::string>()->value_name("DIR"),
         "evaluate a checkpoint's model: a step directory, a checkpoint directory (its latest step), or a run "
         "directory (its checkpoints/)")
        ("hf", po::value<std::string>()->value_name("DIR"), "evaluate a Hugging Face model directory instead");
  else
    desc.add_options()("resume,r", po::value<std::string>()->value_name("latest|DIR"),
                       "continue from a checkpoint: \"latest\" in train.checkpoint_dir, or a checkpoint directory "
                       "(same as --set train.resume=...)");
  if (command == "doctor")
    desc.add_options()("steps,n", po::value<int64_t>()->default_value(20)->value_name("N"),
                       "training steps to watch (each one traced, from the config's initial model)");
  if (command == "check")
    desc.add_options()("nproc,n", po::value<int>()->value_name("N"),
                       "estimate the memory per rank for N processes (default: the processes of this run, "
                       "1 outside booster run)");
  return desc;
}

// The world size `booster check` estimates for: --nproc, else that of an mpirun that started it.
int check_world_size(const po::variables_map& vm) {
  if (vm.count("nproc")) {
    const int n = vm["nproc"].as<int>();
    if (n < 1) throw UsageError("--nproc " + std::to_string(n) + ": expected at least 1 process");
    return n;
  }
  return booster::distributed::job_place_from_launcher().size;
}

// Note [Memory estimate] in booster/config/memory_estimate.h: the table on stderr, and a warning when
// all ranks of this machine would need more than it has available.
void print_memory_estimate(const nlohmann::json& config, int world_size) {
  const booster::config::MemoryEstimate estimate = booster::config::estimate_memory(config, world_size);
  std::cerr << booster::config::format_memory_estimate(estimate);
  const booster::config::HostMemory host = booster::config::host_memory();
  if (host.available < 0) return;
  std::cerr << "  machine: " << booster::config::format_bytes(double(host.available)) << " available of "
            << booster::config::format_bytes(double(host.total)) << " (/proc/meminfo)\n";
  const double needed = double(estimate.total_bytes()) * world_size;
  if (needed > double(host.available)) {
    std::cerr << "booster: warning: " << world_size << (world_size == 1 ? " rank needs " : " ranks on one machine need ")
              << booster::config::format_bytes(needed) << ", more than the "
              << booster::config::format_bytes(double(host.available))
              << " available; lower data.batch_size or the model's size, use a 16-bit strategy, shard with "
                 "low_level_zero, or spread the ranks over machines\n";
  }
}

// Beside the estimate, the peak a run of this config measured (Note [Peak memory of a run] in
// trainer.cpp): the last "train" record of train.run_dir's metrics.jsonl that has one. Nothing when
// there is no such file; a file that is not a regular one, or over 64 MiB, is not read.
void print_measured_peak(const nlohmann::json& config) {
  const nlohmann::json run_dir = config.at("train").value("run_dir", nlohmann::json());
  if (!run_dir.is_string() || run_dir.get<std::string>().find("{time}") != std::string::npos) return;
  const std::filesystem::path file = std::filesystem::path(run_dir.get<std::string>()) / "metrics.jsonl";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(file, ec) || std::filesystem::file_size(file, ec) > (uintmax_t(64) << 20))
    return;
  std::ifstream in(file);
  nlohmann::json last;
  for (std::string line; std::getline(in, line);) {
    // Through the bounded reader: a record nested 200,000 deep is set aside, not a crash.
    nlohmann::json record = booster::try_parse_json_text(line, booster::data_limits(line.size() + 1, "the file's size"));
    if (record.is_object() && record.value("kind", "") == "train" && record.contains("peak_tensor_bytes") &&
        record.at("peak_tensor_bytes").is_number())
      last = std::move(record);
  }
  if (last.is_null()) return;
  std::cerr << "  measured: " << booster::config::format_bytes(last.at("peak_tensor_bytes").get<double>())
            << " peak of live tensors";
  if (last.contains("peak_tensor_bytes_per_rank"))
    std::cerr << " (the most of " << last.at("peak_tensor_bytes_per_rank").size() << " ranks)";
  const nlohmann::json step = last.value("step", nlohmann::json());
  if (step.is_number_integer()) std::cerr << " by step " << step.get<int64_t>();
  std::cerr << " of the run in " << file.string() << "\n";
}

// Parses `args` (after the subcommand); returns false when --help was printed.
// `booster eval`'s weights as overrides of the config (Note [Evaluating without training] in train.cpp),
// after the user's own so they win: train.max_steps 0, no resume, and the checkpoint's model as
// model.init_from (verified against its checksums as init_from is) or the Hugging Face directory as the
// model. Returns where the weights came from, for the summary.
nlohmann::json eval_overrides(const po::variables_map& vm, std::vector<std::string>& overrides) {
  if (vm.count("checkpoint") && vm.count("hf"))
    throw UsageError("'booster eval' takes --checkpoint DIR or --hf DIR, not both");
  overrides.push_back("train.max_steps=0");
  overrides.push_back("train.resume=null");
  nlohmann::json evaluated = nlohmann::json::object();
  if (vm.count("checkpoint")) {
    const std::filesystem::path given = vm["checkpoint"].as<std::string>();
    if (!std::filesystem::exists(given))
      throw booster::ConfigError("--checkpoint " + given.string() + " does not exist; give a checkpoint step directory "
                                 "(runs/a/checkpoints/step-00000100), a checkpoint directory or a run directory");
    // A run directory stands for its checkpoints/, a checkpoint directory for its latest step.
    const std::filesystem::path step =
        booster::checkpoint::resolve_checkpoint(booster::checkpoint::checkpoints_of_run(given));
    if (!std::filesystem::is_directory(step / "model"))
      throw booster::CheckpointError("--checkpoint " + step.string() +
                                     " has no model/ directory; it is not a booster checkpoint with weights");
    evaluated["checkpoint"] = step.string();
    const nlohmann::json state = booster::try_parse_json_text(
        booster::checkpoint::read_text_file(step / booster::checkpoint::kTrainerStateFileName),
        booster::checkpoint_limits());
    // A LoRA run's checkpoint holds the adapters only: the base is the config's, the adapters load after
    // boost() (Note [Adapter-only checkpoints] in booster/booster/state.cpp).
    if (state.is_object() && state.value("lora", nlohmann::json()).is_object()) evaluated["lora_adapters"] = true;
    else overrides.push_back("model.init_from=" + nlohmann::json(step.string()).dump());
    if (state.is_object() && state.value("step", nlohmann::json()).is_number_integer()) evaluated["step"] = state.at("step");
  } else if (vm.count("hf")) {
    const std::string dir = vm["hf"].as<std::string>();
    if (!std::filesystem::is_directory(dir))
      throw booster::ConfigError("--hf " + dir + " is not a directory; give a Hugging Face model directory (config.json "
                                 "and model.safetensors)");
    overrides.push_back("model=" + nlohmann::json{{"type", "hf"}, {"path", dir}}.dump());
    evaluated["hf"] = dir;
  }
  return evaluated;
}

bool parse_config_args(const std::string& command, const std::vector<std::string>& args, std::string& config_path,
                       std::vector<std::string>& overrides, int* world_size = nullptr, int64_t* steps = nullptr,
                       nlohmann::json* evaluated = nullptr) {
  po::options_description desc = config_options(command);
  po::variables_map vm;
  const po::parsed_options parsed = po::command_line_parser(args).options(desc).run();
  po::store(parsed, vm);
  po::notify(vm);
  if (vm.count("help")) {
    std::cout << desc;
    return false;
  }
  // A word that is no option's value would be dropped without a word (`--set a=1 b=2` sets only a).
  booster::cli::refuse_positional(command, parsed);
  if (!vm.count("config")) throw UsageError("'booster " + command + "' needs --config FILE (see booster " + command + " --help)");
  config_path = vm["config"].as<std::string>();
  if (world_size) *world_size = check_world_size(vm);
  if (steps) {
    *steps = vm["steps"].as<int64_t>();
    if (*steps < 1) throw UsageError("--steps " + std::to_string(*steps) + ": expected at least 1 step");
  }
  // What `booster run --mixed-precision NAME --plugin NAME` set for its processes counts as these
  // options do (Note [Switching by launcher] in booster/config/booster_sections.cpp); the command's own win.
  for (const auto& [option, variable, key] : {std::tuple{"mixed-precision", booster::kMixedPrecisionVariable, "mixed_precision"},
                                              std::tuple{"plugin", booster::kPluginVariable, "plugin"}}) {
    const char* value = std::getenv(variable);
    if (!vm.count(option) && value && *value) overrides.push_back(std::string(key) + "=" + nlohmann::json(value).dump());
  }
  // --mixed-precision NAME goes first, so --set mixed_precision.KEY=VALUE can add options to it.
  if (vm.count("mixed-precision")) overrides.push_back("mixed_precision=" + vm["mixed-precision"].as<std::string>());
  if (vm.count("plugin")) overrides.push_back("plugin=" + vm["plugin"].as<std::string>());
  if (vm.count("device")) overrides.push_back("device=" + nlohmann::json(vm["device"].as<std::string>()).dump());
  if (vm.count("resume")) overrides.push_back("train.resume=" + nlohmann::json(vm["resume"].as<std::string>()).dump());
  if (vm.count("no-verify")) overrides.push_back("train.verify_checkpoints=false");
  if (vm.count("set"))
    for (const std::string& s : vm["set"].as<std::vector<std::string>>()) overrides.push_back(s);
  if (evaluated) *evaluated = eval_overrides(vm, overrides);
  return true;
}

int run(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    std::cerr << kUsage;
    return booster::cli::kExitUsageError;
  }
  const std::string command = args.front();
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (command == "-h" || command == "--help" || command == "help") {
    std::cout << kUsage;
    return booster::cli::kExitOk;
  }
  if (command == "--version" || command == "version") {
    print_version();
    return booster::cli::kExitOk;
  }
  if (command == "train" || command == "check" || command == "doctor" || command == "eval") {
    std::string config_path;
    std::vector<std::string> overrides;
    int world_size = 1;
    int64_t steps = 0;
    nlohmann::json evaluated;
    if (!parse_config_args(command, rest, config_path, overrides, command == "check" ? &world_size : nullptr,
                           command == "doctor" ? &steps : nullptr, command == "eval" ? &evaluated : nullptr))
      return booster::cli::kExitOk;
    // A run's SIGINT, SIGTERM or SIGUSR1 is a stop request from here on, while the ranks start (data,
    // model, checkpoint) and as they end, not only in the loop: Note [Stopping on a signal].
    std::optional<booster::trainer::StopOnSignal> stop;
    if (command != "check") stop.emplace(/*announce=*/booster::trainer::process_rank() == 0);
    // Resolving builds the strategy and the plugin, once; train hands them to its Booster.
    booster::config::ResolvedRun resolved = booster::config::load_run(config_path, overrides);
    const nlohmann::json& config = resolved.config;
    if (command == "check") {
      // A library model's input and classes against the data: one forward, as train's first step.
      if (const std::string skipped = booster::config::trial_forward(config); !skipped.empty())
        std::cerr << "booster: " << skipped << "\n";
      // Note [The lora section]: what the adapters train (or the target a model lacks, refused).
      if (const auto lora = booster::config::lora_summary(config)) std::cerr << "booster: " << lora->describe() << "\n";
      // resolve() has run the compatibility matrix: reaching here means the combination works.
      std::cerr << "booster: compatible: mixed precision '" << config.at("mixed_precision").at("name").get<std::string>()
                << "' with plugin '" << config.at("plugin").at("name").get<std::string>() << "' on "
                << config.at("device").get<std::string>() << "\n";
      // A plugin that lays the ranks out as a grid needs a world size its grid divides.
      const nlohmann::json& plugin = config.at("plugin");
      if (plugin.at("name") == "hybrid_parallel") {
        const std::string problem = booster::distributed::mesh_size_problem(
            world_size, plugin.value("tp_size", 1), plugin.value("pp_size", 1));
        if (!problem.empty())
          throw booster::ConfigError("plugin 'hybrid_parallel' on " + std::to_string(world_size) + " processes: " +
                                     problem + "; check with -n N for the N processes you will start");
      }
      // Note [Reproducible training across world sizes]: whether, and at which world sizes.
      std::cerr << "booster: " << booster::reproducible::describe_config(config, world_size) << "\n";
      print_memory_estimate(config, world_size);
      print_measured_peak(config);
      const std::string format = booster::diagnostics::compute_format(config.at("mixed_precision"), config.at("plugin"));
      if (const std::string note = booster::diagnostics::cpu_time_note(format, config.at("device").get<std::string>());
          !note.empty())
        std::cerr << "booster: note: " << note << "\n";
      std::cout << config.dump(2) << "\n";
      return booster::cli::kExitOk;
    }
    const int code = command == "doctor" ? booster::cli::doctor(config, std::move(resolved.booster), steps)
                     : command == "eval"   ? booster::cli::run_training(config, std::move(resolved.booster),
                                                                        {.evaluated = evaluated})
                                           : booster::cli::train(config, std::move(resolved.booster));
    // A signal after the Trainer last looked (its summary was being printed): the run is complete, and
    // still a stop was asked for, so the status says so. Only this rank may have got it (the ranks no
    // longer agree on anything here): a rank other than 0, whose errors the handler below leaves to rank
    // 0, says so itself.
    if (const int signal = stop->requested(); signal != 0 && code == booster::cli::kExitOk) {
      const std::string what = std::string("stopped by ") + booster::trainer::StopOnSignal::signal_name(signal) +
                               " as the run ended; it is complete";
      if (const int rank = booster::trainer::process_rank(); rank != 0)
        print_line("booster: rank " + std::to_string(rank) + ": " + what);
      throw booster::InterruptedError(signal, what);
    }
    return code;
  }
  if (command == "precisions") {
    if (!rest.empty()) {
      if (rest.front() == "-h" || rest.front() == "--help") {
        std::cout << "usage: booster precisions\n\nLists every registered mixed-precision strategy with its options "
                     "and their defaults.\n";
        return booster::cli::kExitOk;
      }
      throw UsageError("'booster precisions' takes no arguments, got '" + rest.front() + "'");
    }
    return booster::cli::precisions();
  }
  if (command == "plot") return booster::cli::plot(rest);
  if (command == "run") return booster::cli::run(rest);
  if (command == "plugins") {
    if (!rest.empty()) {
      if (rest.front() == "-h" || rest.front() == "--help") {
        std::cout << "usage: booster plugins\n\nLists every parallel plugin on the plugin search path with its "
                     "version, file, devices, precisions and options.\n";
        return booster::cli::kExitOk;
      }
      throw UsageError("'booster plugins' takes no arguments, got '" + rest.front() + "'");
    }
    return booster::cli::plugins();
  }
  if (command == "compat") {
    std::string device = "cpu";
    for (size_t i = 0; i < rest.size(); ++i) {
      if (rest[i] == "-h" || rest[i] == "--help") {
        std::cout << "usage: booster compat [--device cpu|cuda]\n\nPrints which mixed-precision strategy works "
                     "with which parallel plugin, with the reason and what to use instead for each that does not.\n";
        return booster::cli::kExitOk;
      }
      if (rest[i] == "--device" && i + 1 < rest.size()) device = rest[++i];
      else throw UsageError("'booster compat' takes only --device cpu|cuda, got '" + rest[i] + "'");
    }
    // Any other name would print a matrix of "no" for a device nothing runs on.
    try {
      booster::device_from_string(device);
    } catch (const booster::DeviceError&) {
      throw UsageError("'booster compat' --device is '" + device + "'; expected cpu, cuda or cuda:N");
    }
    return booster::cli::compat(device);
  }
  if (command == "bench") return booster::cli::bench(rest);
  if (command == "tokenize") return booster::cli::tokenize(rest);
  if (command == "generate") return booster::cli::generate(rest);
  if (command == "export") return booster::cli::export_model(rest);
  if (command == "flight") return booster::cli::flight(rest);
  std::string msg = "unknown command '" + command + "'";
  if (auto guess = booster::config::nearest(command, {"train", "eval", "check", "doctor", "run", "plot", "precisions", "plugins", "compat", "bench", "tokenize", "generate", "export", "flight"})) msg += "; did you mean '" + *guess + "'?";
  throw UsageError(msg + " (see booster --help)");
}

}  // namespace

int main(int argc, char** argv) {
  // Every failure is one line: what was wrong and, where we know it, what would be right.
  try {
    return run(argc, argv);
  } catch (const UsageError& e) {
    print_error(e.what());
    return booster::cli::kExitUsageError;
  } catch (const po::error& e) {
    print_error(std::string(e.what()) + " (see booster --help)");
    return booster::cli::kExitUsageError;
  } catch (const booster::InterruptedError& e) {
    // Stopped by SIGINT/SIGTERM after saving: the status a shell gives a process the signal ended.
    if (booster::trainer::process_rank() == 0) print_line("booster: " + one_line(e.what()));
    booster::distributed::finalize_mpi_for_agreed_exit();  // every rank stops here, by agreement
    return e.exit_code();
  } catch (const booster::IncompatibleError& e) {
    print_error(e.what());
    return booster::cli::kExitUsageError;
  } catch (const booster::ConfigError& e) {
    print_error(e.what());
    return booster::cli::kExitUsageError;
  } catch (const std::bad_alloc&) {
    // An allocation outside the tensor allocator (which says what it allocated): "std::bad_alloc" alone
    // names neither the problem nor the fix.
    print_error("out of host memory (a buffer the sizes in the config ask for does not fit); lower the "
                "model's or the data's sizes or data.batch_size (booster check --config FILE estimates the "
                "memory per rank)");
    return booster::cli::kExitRuntimeError;
  } catch (const std::exception& e) {
    print_error(e.what());
    return booster::cli::kExitRuntimeError;
  } catch (...) {
    print_error("unknown failure");
    return booster::cli::kExitRuntimeError;
  }
}
