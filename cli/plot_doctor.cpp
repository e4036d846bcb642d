// `booster plot --doctor REPORT --out FILE.png`: the precision doctor's report (the last JSON line of
// `booster doctor`, or a file holding only it) as one picture of where each module's values sit
// against each format's range.
//
// Note [The doctor's picture]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
//   precision doctor: fp16 (float16), loss scale 65536, 20 steps
//                        forward outputs          gradients            log2 of abs(x)  -40 .. 20
//                     f16  bf16 e4m3 e5m2    f16  bf16 e4m3 e5m2       |  :    :    :  |
//   layers.0 (linear)  [ ]  [ ]  [#]  [ ]     [#]  [ ]  [#]  [ ]  !     | ===  ---       |
//   layers.1 (relu)    ...
// One row per module with values. Each format's cell is split: the upper half coloured by the fraction
// that overflows, the lower by the fraction that underflows to zero (white none; pale to dark red from
// 1e-6 to all, on a log scale); gradients take the worst of the output, input and parameter
// gradients. A black "!" marks a module with inf/NaN values. On the right, the span of |x| in binades
// (the exponent histogram's first and last bins): forward outputs as a blue bar, gradients as an
// orange one below it, against dotted lines at float16's smallest subnormal (2^-24) and largest value
// (2^16), the range a float16 run must keep its values in.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "booster/common/error.h"
#include "booster/common/input_file.h"
#include "booster/common/json_text.h"
#include "canvas.h"
#include "commands.h"

namespace booster::cli {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace draw;

namespace {

constexpr const char* kFormatKeys[] = {"float16", "bfloat16", "e4m3", "e5m2"};
constexpr const char* kFormatLabels[] = {"f16", "bf16", "e4m3", "e5m2"};
constexpr const char* kGradientRoles[] = {"output_grad", "input_grad", "param_grad"};
constexpr Color kForward{31, 119, 180};
constexpr Color kBackward{255, 127, 14};
constexpr int kLog2Lo = -40, kLog2Hi = 20;

// The report: the last line of the file that parses as a JSON object with "modules".
json read_report(const fs::path& file) {
  BOOSTER_CHECK(fs::exists(file), ConfigError, "plot: cannot open '", file.string(),
                "'; expected the output of booster doctor (its last line is the report)");
  // Note [Inputs that are not files]: a pipe (<(booster doctor ...)) is read as it comes, a device or a
  // FIFO nobody writes to is refused.
  std::istringstream in(read_input_text<ConfigError>(file, "plot:", "expected the output of booster doctor",
                                                     uint64_t(1) << 30));
  std::string line;
  json report;
  while (std::getline(in, line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    // Note [One JSON reader] (booster/common/json_text.h).
    json j = try_parse_json_text(line, data_limits(line.size(), "a line of the file"));
    if (j.is_object() && j.contains("modules") && j.at("modules").is_array()) report = std::move(j);
  }
  BOOSTER_CHECK(report.is_object(), ConfigError, "plot: '", file.string(),
                "' holds no doctor report; expected a line of JSON with \"modules\", as booster doctor prints last");
  return report;
}

double fraction(const json& stats, const char* format, const char* what) {
  if (!stats.is_object() || !stats.contains(format)) return 0.0;
  return stats.at(format).value(what, 0.0);
}

// White for 0, then pale to dark red from 1e-6 to 1 on a log scale.
Color heat(double f) {
  if (!(f > 0.0)) return kWhite;
  const double t = std::clamp((std::log10(f) + 6.0) / 6.0, 0.0, 1.0);
  auto mix = [t](int a, int b) { return uint8_t(std::lround(a + (b - a) * t)); };
  return {mix(253, 165), mix(219, 15), mix(199, 21)};
}

// [first, last] binade of a statistics' exponent histogram, or none.
bool binades(const json& stats, int& lo, int& hi) {
  if (!stats.is_object() || !stats.contains("exponents")) return false;
  const json& e = stats.at("exponents");
  const json& counts = e.at("counts");
  if (counts.empty()) return false;
  lo = e.at("min").get<int>();
  hi = lo + int(counts.size()) - 1;
  return true;
}

std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

int plot_doctor(const std::string& report_path, const std::string& out_path, int width) {
  const fs::path report_file = report_path, out = out_path;
  const json report = read_report(report_file);
  std::vector<const json*> modules;
  for (const json& m : report.at("modules"))
    if (m.is_object()) modules.push_back(&m);
  BOOSTER_CHECK(!modules.empty(), ConfigError, "plot: the doctor report in '", report_file.string(),
                "' has no module statistics to draw");

  constexpr int s = 1;  // font scale for cells and labels
  const int char_w = (kGlyphWidth + 1) * s, row_h = 22, cell_w = 30, group_gap = 18, margin = 16;
  size_t label_chars = 0;
  std::vector<std::string> labels;
  for (const json* m : modules) {
    std::string path = m->value("module", std::string());
    labels.push_back(lower((path.empty() ? "(model)" : path) + " (" + m->value("type", std::string("?")) + ")"));
    label_chars = std::max(label_chars, labels.back().size());
  }
  const int label_w = int(label_chars) * char_w + 10;
  const int groups_x = margin + label_w;
  const int group_w = 4 * cell_w;
  const int marker_x = groups_x + 2 * group_w + group_gap + 6;
  const int range_x0 = marker_x + 16;
  const int range_x1 = std::max(range_x0 + 240, width - margin);
  const int image_w = range_x1 + margin;
  const int header_h = 3 * 2 * kGlyphHeight + 36;
  const int image_h = header_h + int(modules.size()) * row_h + margin + 2 * kGlyphHeight * 2;
  BOOSTER_CHECK(image_h <= 16384 && image_w <= 16384, ConfigError, "plot: ", modules.size(),
                " modules do not fit one picture; draw fewer (edit the report's \"modules\")");
  Canvas canvas(image_w, image_h);

  // Title.
  char title[256];
  std::snprintf(title, sizeof title, "precision doctor: %s (%s), loss scale %g, %lld steps",
                report.value("precision", std::string("?")).c_str(), report.value("format", std::string("?")).c_str(),
                report.value("loss_scale", 1.0), static_cast<long long>(report.value("steps", int64_t(0))));
  draw_text(canvas, margin, margin, lower(title), kBlack, 2);

  // Column heads.
  const int head_y = margin + 2 * kGlyphHeight + 12;
  const int sub_y = head_y + kGlyphHeight + 6;
  const int group_x[2] = {groups_x, groups_x + group_w + group_gap};
  const char* group_names[2] = {"forward outputs", "gradients"};
  for (int g = 0; g < 2; ++g) {
    draw_text(canvas, group_x[g], head_y, group_names[g], kBlack, s);
    for (int f = 0; f < 4; ++f) draw_text(canvas, group_x[g] + f * cell_w + 2, sub_y, kFormatLabels[f], kBlack, s);
  }
  auto log2_x = [&](double e) { return range_x0 + (e - kLog2Lo) / double(kLog2Hi - kLog2Lo) * (range_x1 - range_x0); };
  draw_text(canvas, range_x0, head_y, "log2 of abs(x): blue outputs, orange gradients", kBlack, s);
  for (int e = kLog2Lo; e <= kLog2Hi; e += 10) {
    const std::string t = std::to_string(e);
    draw_text(canvas, int(log2_x(e)) - text_width(t, s) / 2, sub_y, t, kBlack, s);
  }

  // Rows.
  const int rows_y = header_h;
  const int rows_end = rows_y + int(modules.size()) * row_h;
  for (int e = kLog2Lo; e <= kLog2Hi; e += 10) canvas.vline(int(log2_x(e)), rows_y, rows_end, kGrid);
  for (int y = rows_y; y < rows_end; y += 4) {
    canvas.set(int(log2_x(-24)), y, kBlack);  // float16's smallest subnormal
    canvas.set(int(log2_x(16)), y, kBlack);   // float16 overflows at 2^16
  }
  for (size_t r = 0; r < modules.size(); ++r) {
    const json& m = *modules[r];
    const int y0 = rows_y + int(r) * row_h;
    if (r % 2 == 1) canvas.fill_rect(margin, y0, image_w - margin, y0 + row_h - 1, {246, 246, 246});
    draw_text(canvas, margin, y0 + (row_h - kGlyphHeight) / 2, labels[r], kBlack, s);
    bool nonfinite = false;
    for (int g = 0; g < 2; ++g) {
      std::vector<const json*> stats;
      if (g == 0) {
        if (m.contains("output")) stats.push_back(&m.at("output"));
      } else {
        for (const char* role : kGradientRoles)
          if (m.contains(role)) stats.push_back(&m.at(role));
      }
      for (int f = 0; f < 4; ++f) {
        double over = 0.0, under = 0.0;
        for (const json* st : stats) {
          over = std::max(over, fraction(*st, kFormatKeys[f], "overflow"));
          under = std::max(under, fraction(*st, kFormatKeys[f], "underflow"));
        }
        const int x0 = group_x[g] + f * cell_w + 1, x1 = x0 + cell_w - 3;
        const int top = y0 + 2, mid = y0 + row_h / 2, bottom = y0 + row_h - 3;
        if (stats.empty()) continue;
        canvas.fill_rect(x0, top, x1, mid - 1, heat(over));
        canvas.fill_rect(x0, mid, x1, bottom, heat(under));
        canvas.hline(x0, x1, top, kGrid), canvas.hline(x0, x1, bottom, kGrid);
        canvas.vline(x0, top, bottom, kGrid), canvas.vline(x1, top, bottom, kGrid);
      }
      for (const json* st : stats) nonfinite = nonfinite || st->value("nonfinite", int64_t(0)) > 0;
      // The span of binades.
      int lo = 0, hi = 0;
      bool any = false;
      int span_lo = 0, span_hi = 0;
      for (const json* st : stats)
        if (binades(*st, lo, hi)) {
          span_lo = any ? std::min(span_lo, lo) : lo;
          span_hi = any ? std::max(span_hi, hi) : hi;
          any = true;
        }
      if (any) {
        const int bar_y = y0 + 4 + g * 8;
        const double a = std::clamp(double(span_lo), double(kLog2Lo), double(kLog2Hi));
        const double b = std::clamp(double(span_hi + 1), double(kLog2Lo), double(kLog2Hi));
        canvas.fill_rect(int(log2_x(a)), bar_y, std::max(int(log2_x(a)), int(log2_x(b)) - 1), bar_y + 5,
                         g == 0 ? kForward : kBackward);
      }
    }
    if (nonfinite) draw_text(canvas, marker_x, y0 + (row_h - kGlyphHeight * 2) / 2, "!", kBlack, 2);
  }

  // Legend of the heat scale.
  const int legend_y = rows_end + 10;
  draw_text(canvas, margin, legend_y, "cell: upper half overflow, lower half underflow to zero,", kBlack, s);
  int x = margin + text_width("cell: upper half overflow, lower half underflow to zero, ", s);
  for (const double f : {1e-6, 1e-4, 1e-2, 1.0}) {
    canvas.fill_rect(x, legend_y - 1, x + 14, legend_y + kGlyphHeight, heat(f));
    char label[16];
    std::snprintf(label, sizeof label, "%g", f);
    draw_text(canvas, x + 18, legend_y, label, kBlack, s);
    x += 18 + text_width(label, s) + 12;
  }
  draw_text(canvas, x, legend_y, "! inf/nan, dotted: float16 range", kBlack, s);

  const std::string png = encode_png(canvas);
  std::ofstream file(out, std::ios::binary);
  BOOSTER_CHECK(file.good(), ConfigError, "plot: cannot write '", out.string(), "'");
  file.write(png.data(), std::streamsize(png.size()));
  file.close();
  BOOSTER_CHECK(file.good(), ConfigError, "plot: writing '", out.string(), "' failed");
  std::cerr << "booster: wrote " << out.string() << " (" << modules.size() << " modules, " << image_w << "x" << image_h
            << ")\n";
  return kExitOk;
}

}  // namespace booster::cli
