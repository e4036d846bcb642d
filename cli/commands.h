// The subcommands of the `booster` program, called by main.cpp once the command line is parsed.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/booster/booster.h"  // BoosterComponents
#include "booster/trainer/trainer.h"

namespace booster::cli {

// Exit codes: 0 success, 1 a runtime failure, 2 a usage or config mistake.
inline constexpr int kExitOk = 0;
inline constexpr int kExitRuntimeError = 1;
inline constexpr int kExitUsageError = 2;

// Trains from a resolved config with the strategy and plugin built while resolving it
// (booster::config::resolve_run; Note [Built once]): progress on stderr, one line of JSON with the
// summary on stdout. Throws booster errors; main.cpp turns them into one line and an exit code.
int train(const nlohmann::json& config, BoosterComponents components);

// What `booster doctor` changes in train's run (train.cpp): the Trainer's options, whether to evaluate,
// the trainer before fit(), and what to print after it (its return value is the exit code; without it,
// train's summary line).
struct TrainingHooks {
  std::function<void(TrainerOptions&)> adjust;
  bool evaluate = true;
  std::function<void(Trainer&)> before_fit;
  std::function<int(Booster&, Trainer&, const FitResult&, bool is_rank0)> after_fit;
  // Added to the summary of a run of train.max_steps 0, which evaluates without training (Note
  // [Evaluating without training] in train.cpp): where the weights came from ({"checkpoint", "step"}
  // or {"hf"}), as `booster eval` found them.
  nlohmann::json evaluated;
};
int run_training(const nlohmann::json& config, BoosterComponents components, const TrainingHooks& hooks);

// `booster doctor --config FILE [--steps N]` (doctor.cpp): N steps of the config's run with per-module
// statistics; the per-module table, the findings and the recommendation, and a last stdout line of JSON
// (Note [What the doctor recommends] in booster/diagnostics/doctor.h).
int doctor(const nlohmann::json& config, BoosterComponents components, int64_t steps);

// Prints every registered mixed-precision strategy (built-in or plugin), one block each: the name,
// then each option with its default, as `booster precisions` shows them.
int precisions();
// The strategies `booster precisions` and `booster compat` list (precisions.cpp): the built-in ones, then
// each precision plugin on the search path that loads, with the options it reports. A plugin library
// that fails to load is reported on `errors` and skipped, so one broken file hides none of the others
// (as `booster plugins` does for parallel plugins).
struct ListedStrategy {
  std::string name;
  std::string file;  // empty for a built-in strategy
  nlohmann::json options;
};
std::vector<ListedStrategy> list_strategies(std::ostream& errors);

// `booster plot --out FILE.png RUN.jsonl ...` (plot.cpp): loss curves of runs as a PNG. `args` follow
// the subcommand.
int plot(const std::vector<std::string>& args);
// `booster plot --doctor REPORT --out FILE.png` (plot_doctor.cpp, Note [The doctor's picture]): the
// per-module overflow/underflow picture of a `booster doctor` report, at least `width` pixels wide.
int plot_doctor(const std::string& report, const std::string& out, int width);

// `booster run -n N [mpirun options] -- COMMAND ...` (run.cpp, Note [booster run]): execs mpirun, so
// it returns only for --help, --dry-run, or by throwing.
int run(const std::vector<std::string>& args);

// `booster plugins`: every parallel plugin on the search path with its version, file, devices,
// precisions and options. `booster compat`: the compatibility matrix of every strategy and plugin.
int plugins();
int compat(const std::string& device);

// `booster tokenize --model tok.model --in text.txt --out train.bin [--val-fraction F]` (tokenize.cpp): a
// text to token files with a SentencePiece model. `args` follow the subcommand.
int tokenize(const std::vector<std::string>& args);

// `booster generate (--checkpoint DIR | --hf DIR) (--prompt TEXT --tokenizer M | --prompt-ids IDS)` (generate.cpp):
// samples a continuation from a trained model through nn::generate. `args` follow the subcommand.
int generate(const std::vector<std::string>& args);

// `booster export --checkpoint DIR --format hf --out OUT` (export.cpp): a checkpoint's model as a
// Hugging Face model directory (booster/nn/hf.h). `args` follow the subcommand.
int export_model(const std::vector<std::string>& args);

// `booster flight RUN_DIR` (flight.cpp): the ranks' flight records (RUN_DIR/flight/rank-N.json) read
// back, and per process group the first collective not completed on every rank, with where each rank
// stopped (Note [Flight recorder] in booster/distributed/README.md). `args` follow the subcommand.
int flight(const std::vector<std::string>& args);

// `booster bench --workload mlp|gpt ...` (bench.cpp): times training steps, prints one line of JSON.
// `args` follow the subcommand.
int bench(const std::vector<std::string>& args);

}  // namespace booster::cli
