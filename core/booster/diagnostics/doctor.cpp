// The precision doctor's findings and recommendation (doctor.h, Note [What the doctor recommends]).
#include "booster/diagnostics/doctor.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "booster/backends/onednn/onednn.h"

namespace booster::diagnostics {

using nlohmann::json;

namespace {

constexpr double kSwitchFraction = 1e-2;  // gradients lost above this: use another format
constexpr double kNotableFraction = 1e-3;  // above this: worth a finding

std::string printf_string(const char* fmt, double a) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, a);
  return buf;
}

std::string percent(double fraction) {
  if (fraction == 0.0) return "0%";
  if (fraction < 1e-4) return printf_string("%.2g%%", fraction * 100.0);
  return printf_string("%.2f%%", fraction * 100.0);
}

std::string number(double v) { return printf_string("%.6g", v); }

std::string name_of(const ModuleStats& m) {
  return (m.path.empty() ? std::string("the model") : m.path) + " (" + m.type + ")";
}

// "the outputs", "the input gradients", ... of a module.
std::string plural(Role role) { return std::string("the ") + role_name(role) + "s"; }

std::optional<Format> format_of(const std::string& name) {
  if (name == "float16") return Format::Float16;
  if (name == "bfloat16") return Format::BFloat16;
  return std::nullopt;
}

double fraction(int64_t n, const TensorStats& s) { return s.count > 0 ? double(n) / double(s.count) : 0.0; }

struct Worst {
  double fraction = 0.0;
  const ModuleStats* module = nullptr;
  Role role = Role::Output;
  explicit operator bool() const { return module != nullptr && fraction > 0.0; }
};

// The module and tensor with the largest fraction `measure` gives, over `roles`; a tie goes to the
// deeper module (a layer rather than the container that returns its output).
template <class Measure>
Worst worst(const std::vector<ModuleStats>& modules, std::initializer_list<Role> roles, Measure measure) {
  Worst w;
  auto depth = [](const ModuleStats& m) { return m.path.empty() ? 0 : 1 + std::count(m.path.begin(), m.path.end(), '.'); };
  for (const ModuleStats& m : modules)
    for (Role role : roles) {
      const TensorStats& s = m[role];
      if (s.empty()) continue;
      const double f = measure(s);
      if (f > w.fraction || (f == w.fraction && f > 0.0 && w.module && depth(m) > depth(*w.module))) w = {f, &m, role};
    }
  return w;
}

constexpr std::initializer_list<Role> kGradients{Role::OutputGradient, Role::InputGradient, Role::ParameterGradient};

// The fraction of a tensor's finite nonzero values below 2^floor_log2 (from the exponent histogram).
double fraction_below_binade(const TensorStats& s, int floor_log2) {
  int64_t below = 0;
  for (int e = 0; e < TensorStats::kExponentBins; ++e)
    if (e - 127 < floor_log2) below += s.exponents[size_t(e)];
  return fraction(below, s);
}

// Under fp8 scaling that maps amax to the format's largest value, the values that surely still fall
// below half its smallest subnormal (2^-9 for e4m3, 2^-16 for e5m2) and so round to zero: x * scale <
// 2^(smallest - 1) for every x below 2^floor(smallest - 1 - log2 scale). A lower bound: the histogram
// cannot split the binade that holds the threshold.
double fp8_underflow_after_scaling(const TensorStats& s, float amax, Format format) {
  if (s.empty() || amax <= 0.0f) return 0.0;
  const double scale = double(format_max(format)) / double(amax);
  const int smallest_log2 = format == Format::E4M3 ? -9 : -16;
  return fraction_below_binade(s, int(std::floor(double(smallest_log2) - 1.0 - std::log2(scale))));
}

bool is_linear(const ModuleStats& m) { return m.type.find("Linear") != std::string::npos; }

}  // namespace

json SkippedStep::to_json() const {
  return {{"step", step},
          {"loss_scale", loss_scale},
          {"first_nonfinite", first_nonfinite ? first_nonfinite->to_json() : json(nullptr)}};
}

std::string compute_format(const json& mixed_precision, const json& plugin) {
  std::string name = mixed_precision.value("name", std::string("fp32"));
  if (plugin.value("name", std::string()) == "low_level_zero") name = plugin.value("precision", name);
  if (name == "fp8") return "fp8";
  if (name.find("bf16") != std::string::npos) return "bfloat16";
  if (name == "fp16_apex" && mixed_precision.value("opt_level", std::string("O1")) == "O0") return "float32";
  if (name.find("fp16") != std::string::npos) return "float16";
  return "float32";
}

std::string cpu_time_note(const std::string& format, const std::string& device) {
  if (device.rfind("cpu", 0) != 0) return "";
  if (format == "float16")
    return "float16 saves memory on the CPU but not time: OpenBLAS has no float16 GEMM, so every product is "
           "widened to float32 (bf16 runs on the CPU's bfloat16 instructions where it has them)";
  if ((format == "bfloat16" || format == "fp8") && !onednn::bf16_gemm_enabled())
    return "bfloat16 saves memory here but not time: its GEMMs are " + onednn::bf16_gemm_description();
  return "";
}

Diagnosis diagnose(const DoctorInput& in) {
  Diagnosis d;
  const std::vector<ModuleStats>& modules = in.modules;
  const std::string scale = number(in.loss_scale);
  std::optional<std::string> forward_overflow, lost_gradients, raise_scale;

  // The format the strategy computes in; under float32 the 16-bit formats it could move to.
  std::vector<Format> formats;
  if (auto f = format_of(in.format)) {
    formats = {*f};
  } else if (in.format == "fp8") {
    formats = {Format::BFloat16};  // what runs outside the fp8 GEMMs
  } else {
    formats = {Format::BFloat16, Format::Float16};
  }
  for (Format f : formats) {
    const std::string fname = format_name(f);
    const bool current = in.format == fname;
    const std::string other = f == Format::Float16 ? "bfloat16" : "float16";
    const Format other_format = f == Format::Float16 ? Format::BFloat16 : Format::Float16;
    auto overflow = [f](const TensorStats& s) { return fraction(s.in(f).overflow, s); };
    auto underflow = [f](const TensorStats& s) { return fraction(s.in(f).underflow, s); };

    if (const Worst w = worst(modules, {Role::Output}, overflow)) {
      const TensorStats& s = (*w.module)[w.role];
      const std::string text = fname + ": " + percent(w.fraction) + " of " + plural(w.role) + " of " +
                               name_of(*w.module) + " exceed " + number(format_max(f)) + " (max |x| " +
                               number(s.max_abs) + ")" +
                               (s.in(other_format).overflow == 0 ? "; " + other + " keeps them" : std::string());
      d.findings.push_back(text);
      if (!forward_overflow) forward_overflow = text;
    }
    if (const Worst w = worst(modules, kGradients, overflow)) {
      d.findings.push_back(fname + ": " + percent(w.fraction) + " of " + plural(w.role) + " of " + name_of(*w.module) +
                           " overflow at scale " + scale + (current ? "; those steps are skipped" : std::string()));
    }
    if (const Worst w = worst(modules, kGradients, underflow); w && w.fraction >= kNotableFraction) {
      const TensorStats& s = (*w.module)[w.role];
      const double other_loses = fraction(s.in(other_format).underflow, s);
      const std::string text = fname + ": " + percent(w.fraction) + " of " + plural(w.role) + " of " +
                               name_of(*w.module) + " underflow to zero at scale " + scale + "; " + other +
                               (other_loses == 0.0 ? " keeps them" : " loses " + percent(other_loses));
      d.findings.push_back(text);
      // Only float16 has somewhere to go (bfloat16 holds every float16 value): under bfloat16 the
      // finding stands alone and the verdict below states the fraction.
      const bool can_switch = current && f == Format::Float16;
      if (can_switch && w.fraction >= kSwitchFraction && other_loses < w.fraction / 10 && !lost_gradients)
        lost_gradients = text;
      else if (can_switch && !raise_scale)
        raise_scale = text;
    }
  }

  if (!in.skipped.empty()) {
    std::string text = std::to_string(in.skipped.size()) + " of " + std::to_string(in.steps) + " steps were skipped";
    const SkippedStep& first = in.skipped.front();
    text += first.first_nonfinite ? "; the first non-finite tensor of step " + std::to_string(first.step) + " was " +
                                        first.first_nonfinite->describe()
                                  : "; no traced tensor of step " + std::to_string(first.step) +
                                        " was non-finite on this rank";
    d.findings.push_back(text);
  }

  if (in.format == "fp8") {
    for (const ModuleStats& m : modules) {
      if (!is_linear(m) || m[Role::Output].empty()) continue;
      json layer = json::object();
      if (m.input_max_abs > 0) layer["input"] = double(format_max(Format::E4M3)) / m.input_max_abs;
      if (m.parameter_max_abs > 0) layer["weight"] = double(format_max(Format::E4M3)) / m.parameter_max_abs;
      const TensorStats& g = m[Role::OutputGradient];
      if (g.max_abs > 0) {
        layer["grad_output"] = double(format_max(Format::E5M2)) / g.max_abs;
        const double lost = fp8_underflow_after_scaling(g, g.max_abs, Format::E5M2);
        layer["grad_output_below_e5m2"] = lost;
        if (lost >= kSwitchFraction)
          d.findings.push_back("fp8: scaled to e5m2's 57344, at least " + percent(lost) +
                               " of the output gradients of " + name_of(m) +
                               " still underflow; keep it in bf16 (mixed_precision.exclude)");
      }
      d.fp8_scales[m.path] = layer;
    }
  }

  const std::string p = in.precision.empty() ? in.format : in.precision;
  if (in.format == "float16" && forward_overflow) {
    d.recommendation = "use bf16: " + *forward_overflow;
  } else if (lost_gradients) {
    d.recommendation = "use bf16: " + *lost_gradients;
  } else if (raise_scale) {
    d.recommendation = "raise the initial loss scale or use bf16: " + *raise_scale;
  } else if (in.format == "float32") {
    const Worst bf16_loss = worst(modules, kGradients, [](const TensorStats& s) {
      return fraction(s.in(Format::BFloat16).underflow + s.in(Format::BFloat16).overflow, s);
    });
    d.recommendation = bf16_loss.fraction < kNotableFraction
                           ? "bf16 would hold every value of these steps (at most " + percent(bf16_loss.fraction) +
                                 " of any tensor out of range): mixed_precision \"bf16\" should train as fp32 does"
                           : "stay in fp32: bf16 would lose " + percent(bf16_loss.fraction) + " of " +
                                 plural(bf16_loss.role) + " of " + name_of(*bf16_loss.module);
  } else if (in.format == "fp8") {
    d.recommendation = "fp8: the per-layer static scales in fp8_scales map each Linear's largest input and weight "
                       "to e4m3's 448 and its largest output gradient to e5m2's 57344";
  } else {
    const Worst w = worst(modules, kGradients, [&](const TensorStats& s) {
      return fraction(s.in(*format_of(in.format)).underflow, s);
    });
    d.recommendation = p + " is fine here: no forward overflow, and at most " + percent(w.fraction) +
                       " of any module's gradients underflow" + (in.loss_scale != 1.0 ? " at scale " + scale : "");
  }
  if (!in.skipped.empty() && in.format == "float16" && !forward_overflow && !lost_gradients &&
      int64_t(in.skipped.size()) * 10 > in.steps)
    d.recommendation = "use bf16, which needs no loss scale: " + d.findings.back();
  return d;
}

json doctor_report(const DoctorInput& in, const Diagnosis& d) {
  json modules = json::array();
  for (const ModuleStats& m : in.modules)
    if (!m.empty()) modules.push_back(m.to_json());
  json skipped = json::array();
  for (const SkippedStep& s : in.skipped) skipped.push_back(s.to_json());
  return {{"precision", in.precision}, {"format", in.format},           {"loss_scale", in.loss_scale},
          {"steps", in.steps},         {"modules", modules},            {"skipped_steps", skipped},
          {"findings", d.findings},    {"recommendation", d.recommendation}, {"fp8_scales", d.fp8_scales}};
}

std::string format_table(const std::vector<ModuleStats>& modules) {
  size_t width = 6;
  for (const ModuleStats& m : modules)
    if (!m.empty()) width = std::max(width, (m.path.empty() ? std::string("(model)") : m.path).size() + m.type.size() + 3);
  char line[512];
  std::string out;
  std::snprintf(line, sizeof line, "%-*s %-18s %10s %13s %17s %17s %11s %11s\n", int(width), "module", "tensor",
                "max|x|", "log2 range", "float16 ovf/unf", "bfloat16 ovf/unf", "e4m3 ovf", "e5m2 ovf");
  out += line;
  for (const ModuleStats& m : modules) {
    if (m.empty()) continue;
    const std::string name = (m.path.empty() ? std::string("(model)") : m.path) + " (" + m.type + ")";
    bool first = true;
    for (Role role : kRoles) {
      const TensorStats& s = m[role];
      if (s.empty()) continue;
      int lo = 0, hi = -1;
      for (int e = 0; e < TensorStats::kExponentBins; ++e)
        if (s.exponents[size_t(e)] > 0) {
          if (hi < lo) lo = e;
          hi = e;
        }
      const std::string range = hi >= lo ? std::to_string(lo - 127) + ".." + std::to_string(hi - 127) : "-";
      auto pair = [&](Format f) {
        return percent(fraction(s.in(f).overflow, s)) + "/" + percent(fraction(s.in(f).underflow, s));
      };
      std::snprintf(line, sizeof line, "%-*s %-18s %10.3g %13s %17s %17s %11s %11s%s\n", int(width),
                    first ? name.c_str() : "", role_name(role), double(s.max_abs), range.c_str(),
                    pair(Format::Float16).c_str(), pair(Format::BFloat16).c_str(),
                    percent(fraction(s.in(Format::E4M3).overflow, s)).c_str(),
                    percent(fraction(s.in(Format::E5M2).overflow, s)).c_str(),
                    s.nonfinite > 0 ? ("  " + std::to_string(s.nonfinite) + " inf/NaN").c_str() : "");
      out += line;
      first = false;
    }
  }
  return out;
}

}  // namespace booster::diagnostics
