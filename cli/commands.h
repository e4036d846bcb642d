// The subcommands of the `booster` program, called by main.cpp once the command line is parsed.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/booster/booster.h"  // BoosterComponents

namespace booster::cli {

// Exit codes: 0 success, 1 a runtime failure, 2 a usage or config mistake.
inline constexpr int kExitOk = 0;
inline constexpr int kExitRuntimeError = 1;
inline constexpr int kExitUsageError = 2;

// Trains from a resolved config with the strategy and plugin built while resolving it
// (booster::config::resolve_run; Note [Built once]): progress on stderr, one line of JSON with the
// summary on stdout. Throws booster errors; main.cpp turns them into one line and an exit code.
int train(const nlohmann::json& config, BoosterComponents components);

// Prints every registered mixed-precision strategy (built-in or plugin), one block each: the name,
// then each option with its default, as `booster precisions` shows them.
int precisions();

// `booster plot --out FILE.png RUN.jsonl ...` (plot.cpp): loss curves of runs as a PNG. `args` follow
// the subcommand.
int plot(const std::vector<std::string>& args);

// `booster run -n N [mpirun options] -- COMMAND ...` (run.cpp, Note [booster run]): execs mpirun, so
// it returns only for --help, --dry-run, or by throwing.
int run(const std::vector<std::string>& args);

// `booster plugins`: every parallel plugin on the search path with its version, file, devices,
// precisions and options. `booster compat`: the compatibility matrix of every strategy and plugin.
int plugins();
int compat(const std::string& device);

// `booster bench --workload mlp|gpt ...` (bench.cpp): times training steps, prints one line of JSON.
// `args` follow the subcommand.
int bench(const std::vector<std::string>& args);

}  // namespace booster::cli
