// The precision doctor's verdict: from the per-module statistics of a few steps (tracer.h), what would
// overflow or underflow in which module under the run's number format, and what to use instead.
//
// Note [What the doctor recommends]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The findings compare each module's tensors with the range of the format the strategy computes in:
//   * forward outputs that overflow it (float16 above 65504): the strategy cannot hold them, bf16 can;
//   * gradients that overflow it at the loss scale the steps ran at: the scaler will skip steps;
//   * gradients that underflow to zero at that scale (they are lost, not just imprecise), worst module
//     first, with what bfloat16 would lose of the same tensor;
//   * skipped steps, with the first non-finite tensor of each (Note [The first non-finite tensor]);
//   * under fp8, per Linear layer: the static scales that map the largest input and weight to e4m3's
//     448 and the largest output gradient to e5m2's 57344, and the fraction of values that scaling
//     still leaves below the format's smallest subnormal (read off the exponent histogram), so a layer
//     too wide for 8 bits can be excluded.
// Under float32 the same tables say whether bf16 or fp16 would hold the run's values. The
// recommendation is the one sentence that matters most: a forward overflow, then lost gradients
// (over 1% of a tensor: switch; over 0.1%: raise the scale or switch), else that the format is fine.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/diagnostics/tracer.h"

namespace booster::diagnostics {

struct SkippedStep {
  int64_t step = 0;                         // 1-based
  double loss_scale = 1.0;                  // after the step's backoff
  std::optional<NonFinite> first_nonfinite;  // none found: the inf/NaN came from another rank or a plugin
  nlohmann::json to_json() const;           // {"step", "loss_scale", "first_nonfinite": {...} | null}
};

struct DoctorInput {
  // The format the strategy computes in: "float32", "float16", "bfloat16" or "fp8".
  std::string format = "float32";
  std::string precision;    // the strategy's name, for the messages
  double loss_scale = 1.0;  // the scale of the last step (gradient statistics are taken as scaled)
  int64_t steps = 0;
  std::vector<ModuleStats> modules;
  std::vector<SkippedStep> skipped;
};

struct Diagnosis {
  std::string recommendation;         // one sentence to act on
  std::vector<std::string> findings;  // each a sentence, most important first
  // Under fp8: {"layers.0": {"input": s, "weight": s, "grad_output": s, "input_below_e4m3": f, ...}}.
  nlohmann::json fp8_scales = nlohmann::json::object();
};

// The "float16" ... "fp8" of DoctorInput::format for a resolved config's mixed_precision and plugin
// sections (low_level_zero keeps its own "precision").
std::string compute_format(const nlohmann::json& mixed_precision, const nlohmann::json& plugin);

// What a 16-bit `format` (compute_format's) buys on `device` ("cpu", "cuda:0", ...): "" where it computes
// natively (a GPU; bfloat16 GEMMs through oneDNN on a CPU with bfloat16 instructions), otherwise a
// sentence saying that it saves memory there but not time, and why. `booster check` and the doctor say it.
std::string cpu_time_note(const std::string& format, const std::string& device);

Diagnosis diagnose(const DoctorInput& input);

// The report's JSON: {"precision", "format", "loss_scale", "steps", "modules": [...], "skipped_steps":
// [...], "findings": [...], "recommendation": "...", "fp8_scales": {...}}.
nlohmann::json doctor_report(const DoctorInput& input, const Diagnosis& diagnosis);

// The per-module table for people: per module and tensor, max |x|, the binades it spans, and the
// percentages that overflow / underflow in each format.
std::string format_table(const std::vector<ModuleStats>& modules);

}  // namespace booster::diagnostics
