// The compatibility matrix (Note [Compatibility rules] in compat.h).
#include "booster/booster/compat.h"

#include <algorithm>
#include <map>
#include <sstream>

#include "booster/common/error.h"

namespace booster::compat {

namespace {

bool contains(const std::vector<std::string>& list, const std::string& item) {
  return std::find(list.begin(), list.end(), item) != list.end();
}

std::string join(const std::vector<std::string>& list) {
  std::string out;
  for (const std::string& s : list) out += (out.empty() ? "" : ", ") + s;
  return out;
}

Verdict reject(std::string reason, std::string instead) { return {false, std::move(reason), std::move(instead)}; }

}  // namespace

PrecisionTraits precision_traits(const std::string& name) {
  // name -> (casts or scales, tensor parallel, pipeline parallel)
  static const std::map<std::string, PrecisionTraits> kBuiltIn = {
      {"fp32", {"fp32", false, true, true}},
      {"no", {"no", false, true, true}},
      // fp16 and bf16 across pipeline stages: autocast wraps each stage, and the loss scale is the same on
      // every stage because found_inf is agreed over the world (plugins/hybrid_parallel).
      {"fp16", {"fp16", true, true, true}},
      {"bf16", {"bf16", true, true, true}},
      {"fp16_naive", {"fp16_naive", true, true, true}},
      {"fp16_apex", {"fp16_apex", true, false, false}},
      // Per-tensor scales of sharded layers or of a pipeline's stages would need their amax agreed
      // across the shards and stages, which nothing does yet.
      {"fp8", {"fp8", true, false, false}},
  };
  auto it = kBuiltIn.find(name);
  if (it != kBuiltIn.end()) return it->second;
  return {name, true, false, false, true};
}

PluginTraits PluginTraits::of(const ParallelPlugin& plugin) {
  return {plugin.name(), plugin.supported_devices(), plugin.supported_precisions(), plugin.control_precision(),
          plugin.layout()};
}

std::string Verdict::message(const std::string& precision, const std::string& plugin, const std::string& device) const {
  return "mixed precision '" + precision + "' with plugin '" + plugin + "' on " + device + ": " + reason +
         (instead.empty() ? "" : "; " + instead);
}

Verdict check(const std::string& precision, const PluginTraits& plugin, const std::string& device) {
  const PrecisionTraits traits = precision_traits(precision);
  const std::string device_type = device.substr(0, device.find(':'));
  if (plugin.devices.empty()) return reject(plugin.name + " declares no device it runs on", "fix the plugin");
  if (!contains(plugin.devices, device_type))
    return reject(plugin.name + " runs on " + join(plugin.devices) + " only",
                  "set device to " + plugin.devices.front() + " or choose a plugin that supports " + device_type);
  if (plugin.control_precision && traits.scales_loss_or_casts)
    return reject(precision + " is not compatible with " + plugin.name + ": " + plugin.name +
                      " manages precision itself (its own float32 master weights and loss scaler)",
                  "set its precision option instead, e.g. \"plugin\": {\"name\": \"" + plugin.name +
                      "\", \"precision\": \"" + (precision == "bf16" || precision == "fp8" ? "bf16" : "fp16") +
                      "\"}, and leave mixed_precision at fp32");
  if (!contains(plugin.precisions, "*") && !contains(plugin.precisions, precision) &&
      !(precision == "no" && contains(plugin.precisions, "fp32")))
    return reject(plugin.name + " does not support it (it supports " + join(plugin.precisions) + ")",
                  "use one of those");
  if (plugin.layout.tensor > 1 && !traits.tensor_parallel && precision == "fp8")
    return reject("not usable with tensor parallelism: fp8's per-tensor scales would need the amax of every "
                  "shard of a layer agreed across the tensor-parallel group",
                  "use bf16");
  if (plugin.layout.tensor > 1 && !traits.tensor_parallel && traits.from_plugin)
    return reject("not usable with tensor parallelism: a precision plugin declares no support for it, and what "
                  "it keeps per tensor (scales, casts, master copies) cannot be checked to hold when each rank "
                  "holds a shard of a layer",
                  "use fp16 (torch-style autocast) or bf16, which run on shards");
  if (plugin.layout.tensor > 1 && !traits.tensor_parallel)
    return reject("not usable with tensor parallelism: apex-style O2/O3 cast the whole model and keep master "
                  "copies of whole layers, while each rank holds a shard",
                  "use fp16 (torch-style autocast) or bf16");
  if (plugin.layout.pipeline > 1 && !traits.pipeline_parallel)
    return reject("not usable with pipeline parallelism: the strategy keeps state over the whole model "
                  "(apex-style master copies and opt levels, fp8 scaling histories, a precision plugin's own) "
                  "that the stages would have to agree on",
                  "use bf16, fp16 or fp16_naive (their loss scale and skipped steps are agreed across the "
                  "stages), or fp32");
  return {};
}

void require_compatible(const std::string& precision, const PluginTraits& plugin, const std::string& device) {
  const Verdict verdict = check(precision, plugin, device);
  BOOSTER_CHECK(verdict.compatible, IncompatibleError, verdict.message(precision, plugin.name, device));
}

Matrix build_matrix(const std::vector<std::string>& precisions, const std::vector<PluginTraits>& plugins,
                    const std::string& device) {
  // The hybrid columns: a plugin that accepts every strategy, split 2 ways along one axis.
  PluginTraits tensor_parallel{"tensor parallel", {"cpu", "cuda"}, {"*"}, false, {1, 2, 1}};
  PluginTraits pipeline_parallel{"pipeline parallel", {"cpu", "cuda"}, {"*"}, false, {1, 1, 2}};
  std::vector<PluginTraits> columns = plugins;
  columns.push_back(tensor_parallel);
  columns.push_back(pipeline_parallel);

  Matrix m;
  m.precisions = precisions;
  for (const PluginTraits& p : columns) m.columns.push_back(p.name);
  for (const std::string& precision : precisions) {
    std::vector<Verdict>& row = m.cells.emplace_back();
    for (const PluginTraits& p : columns) row.push_back(check(precision, p, device));
  }
  return m;
}

std::string format_matrix(const Matrix& m) {
  // Reasons are numbered in order of first appearance; equal reasons share a number.
  std::vector<std::string> reasons;
  auto cell_text = [&](const Verdict& v) -> std::string {
    if (v.compatible) return "yes";
    const std::string text = v.reason + (v.instead.empty() ? "" : "; " + v.instead);
    auto it = std::find(reasons.begin(), reasons.end(), text);
    if (it == reasons.end()) it = reasons.insert(reasons.end(), text);
    return "no (" + std::to_string(it - reasons.begin() + 1) + ")";
  };
  std::vector<std::vector<std::string>> text(m.precisions.size());
  for (size_t r = 0; r < m.precisions.size(); ++r)
    for (const Verdict& v : m.cells[r]) text[r].push_back(cell_text(v));

  size_t first_width = std::string("precision").size();
  for (const std::string& p : m.precisions) first_width = std::max(first_width, p.size());
  std::vector<size_t> widths;
  for (size_t c = 0; c < m.columns.size(); ++c) {
    size_t w = m.columns[c].size();
    for (const auto& row : text) w = std::max(w, row[c].size());
    widths.push_back(w);
  }
  std::ostringstream out;
  auto pad = [](const std::string& s, size_t w) { return s + std::string(w - s.size(), ' '); };
  std::string header = pad("precision", first_width);
  for (size_t c = 0; c < m.columns.size(); ++c) header += "  " + pad(m.columns[c], widths[c]);
  out << header.substr(0, header.find_last_not_of(' ') + 1) << "\n";
  for (size_t r = 0; r < m.precisions.size(); ++r) {
    std::string line = pad(m.precisions[r], first_width);
    for (size_t c = 0; c < m.columns.size(); ++c) line += "  " + pad(text[r][c], widths[c]);
    out << line.substr(0, line.find_last_not_of(' ') + 1) << "\n";
  }
  if (!reasons.empty()) out << "\n";
  for (size_t i = 0; i < reasons.size(); ++i) out << "(" << i + 1 << ") " << reasons[i] << "\n";
  return out.str();
}

}  // namespace booster::compat
