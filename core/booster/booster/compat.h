// The compatibility matrix: which mixed-precision strategy works with which parallelism plugin and
// device, built from what strategies and plugins declare, and enforced before any work starts.
//
// Note [Compatibility rules]
// A combination (strategy, plugin, device) is rejected, in this order, when
//   1. the plugin does not list the device;
//   2. the plugin controls precision itself (low_level_zero keeps its own float32 masters and loss
//      scaler) and the Booster's strategy is anything but the identity (fp32);
//   3. the plugin does not list the strategy (nor "*");
//   4. the plugin splits layers across ranks (tensor parallel) and the strategy is not known to work
//      with that: apex-style fp16 (its O2/O3 whole-model casts and master copies assume each rank holds
//      whole layers), fp8 (per-tensor scales of a sharded layer would need one amax over its shards) and
//      any precision plugin (it declares no tensor-parallel support, and what it keeps per tensor cannot
//      be checked to hold for a shard);
//   5. the plugin splits the model into pipeline stages and the strategy keeps state over the whole
//      model that stages would have to agree on (apex-style, fp8, a precision plugin): fp32, fp16,
//      bf16 and fp16_naive run there (their scale and skipped steps are agreed across the world).
// Each rejection is an IncompatibleError whose message names the combination, the reason and what to
// use instead. ColossalAI documents or warns about these; here they are errors.
#pragma once

#include <string>
#include <vector>

#include "booster/plugin/parallel_plugin.h"

namespace booster::compat {

// What the matrix needs to know of a strategy.
struct PrecisionTraits {
  std::string name;
  bool scales_loss_or_casts = true;  // false only for the identity (fp32, "no")
  bool tensor_parallel = true;       // works when layers are split across ranks
  bool pipeline_parallel = false;    // works across pipeline stages
  bool from_plugin = false;          // a precision plugin's strategy (its traits are assumed, not known)
};
// The traits of a strategy by name: built-ins from a table, anything else (a precision plugin) is
// taken as a mixed-precision strategy that supports neither tensor nor pipeline parallelism.
PrecisionTraits precision_traits(const std::string& name);

// What the matrix needs to know of a plugin (its declarations, read once).
struct PluginTraits {
  std::string name;
  std::vector<std::string> devices;
  std::vector<std::string> precisions;
  bool control_precision = false;
  ParallelLayout layout;
  static PluginTraits of(const ParallelPlugin& plugin);
};

struct Verdict {
  bool compatible = true;
  std::string reason;   // why not (empty when compatible)
  std::string instead;  // what to use instead
  // "'fp16' with plugin 'low_level_zero' on cpu: <reason>; <instead>"
  std::string message(const std::string& precision, const std::string& plugin, const std::string& device) const;
};

Verdict check(const std::string& precision, const PluginTraits& plugin, const std::string& device);
// Throws IncompatibleError with Verdict::message when check() rejects the combination.
void require_compatible(const std::string& precision, const PluginTraits& plugin, const std::string& device);

// The matrix: one row per strategy, one column per plugin, plus the tensor- and pipeline-parallel
// columns of a hybrid plugin (data x tensor x pipeline) so those rules show before such a plugin exists.
struct Matrix {
  std::vector<std::string> precisions;
  std::vector<std::string> columns;
  std::vector<std::vector<Verdict>> cells;  // [precision][column]
};
Matrix build_matrix(const std::vector<std::string>& precisions, const std::vector<PluginTraits>& plugins,
                    const std::string& device = "cpu");
// A fixed-width table with "yes"/"no (n)" cells and the numbered reasons below it.
std::string format_matrix(const Matrix& matrix);

}  // namespace booster::compat
