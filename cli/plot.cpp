// `booster plot --out FILE.png RUN.jsonl [RUN2.jsonl ...]`: the loss curves of one or several runs in
// one PNG, so strategies can be compared by eye.
//
// The drawing (canvas, font, PNG) is in canvas.h; `--doctor` is plot_doctor.cpp.
//
// Note [The plot's layout]
// ~~~~~~~~~~~~~~~~~~~~~~~~
//   +--------------------------------------------------+
//   | loss                                   [legend]  |   title (the plotted key) above the frame
//   |  2.5 +-----------------------------------------+ |   y ticks and labels left of the frame,
//   |      |\__                          -- run a    | |   "nice" values (1, 2 or 5 x 10^k), 4-8 of them
//   |  2.0 +   \___                      -- run b    | |   x ticks and labels below it
//   |      |       \_______________                  | |   one coloured polyline per run, clipped to the
//   |      +----+----+----+----+----+----------------+ |   frame; the legend lists each run's name in
//   |           100  200  300  400  500         step   |   its colour, top right inside the frame
//   +--------------------------------------------------+
// A run's name is its file's stem, or, for a run directory's metrics.jsonl, the directory's name.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

#include "booster/common/error.h"
#include "booster/common/input_file.h"
#include "booster/common/json_text.h"
#include "canvas.h"
#include "commands.h"

namespace booster::cli {

namespace fs = std::filesystem;
namespace po = boost::program_options;
using nlohmann::json;

namespace {

using namespace draw;

// ------------------------------------------------------------------------------------------ data
struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (step, value)
};

std::string run_name(const fs::path& file) {
  if (file.filename() == "metrics.jsonl") {
    const fs::path dir = fs::absolute(file).parent_path();
    if (!dir.filename().empty()) return dir.filename().string();
  }
  return file.stem().string();
}

// The most a metrics file or a doctor report may hold (a million logged steps are about 200 MB).
constexpr uint64_t kMaxPlotInputBytes = uint64_t(1) << 30;

// The records of a metrics file (Note [What booster train prints] in booster/trainer/progress.h) that have a
// finite `key`: "eval" records for the evaluation keys (test_*, val_*: test_loss, test_accuracy, val_loss,
// val_ppl), "train" records for the others. Empty when there is none (a run stopped before its first
// logged step).
Series read_series(const fs::path& file, const std::string& key) {
  BOOSTER_CHECK(fs::exists(file), ConfigError, "plot: cannot open '", file.string(), "'; expected a metrics.jsonl file");
  // Note [Inputs that are not files]: a pipe (<(ssh host cat metrics.jsonl)) is read as it comes, a device
  // or a FIFO nobody writes to is refused.
  std::istringstream in(read_input_text<ConfigError>(file, "plot:", "expected a metrics.jsonl file", kMaxPlotInputBytes));
  Series s;
  s.name = run_name(file);
  const bool evaluation_key = key.rfind("test_", 0) == 0 || key.rfind("val_", 0) == 0;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    // Note [One JSON reader] (booster/common/json_text.h): a hostile line is not a record.
    const json record = try_parse_json_text(line, data_limits(line.size(), "a line of the file"));
    BOOSTER_CHECK(record.is_object(), ConfigError, "plot: '", file.string(), "' line ", number,
                  " is not a JSON object; expected one record per line as booster train writes them");
    if (record.value("kind", "train") != (evaluation_key ? "eval" : "train")) continue;
    const auto step = record.find("step");
    const auto value = record.find(key);
    if (step == record.end() || value == record.end() || !step->is_number() || !value->is_number()) continue;
    const double v = value->get<double>();
    if (std::isfinite(v)) s.points.emplace_back(step->get<double>(), v);
  }
  return s;
}

// ------------------------------------------------------------------------------------------ axes
// Tick values covering [lo, hi]: multiples of 1, 2 or 5 x 10^k, about `target` of them.
std::vector<double> nice_ticks(double lo, double hi, int target) {
  const double span = hi - lo;
  const double raw = span / std::max(target, 1);
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  double step = magnitude;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * magnitude >= raw) {
      step = m * magnitude;
      break;
    }
  std::vector<double> ticks;
  for (double t = std::ceil(lo / step - 1e-9) * step; t <= hi + step * 1e-9; t += step)
    ticks.push_back(std::abs(t) < step * 1e-9 ? 0.0 : t);
  return ticks;
}

std::string tick_label(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

void render(Canvas& canvas, const std::vector<Series>& runs, const std::string& key) {
  constexpr int kScale = 2;  // font pixels: 10x14 letters
  const int char_h = text_height(kScale);
  double x_lo = std::numeric_limits<double>::infinity(), x_hi = -x_lo, y_lo = x_lo, y_hi = -x_lo;
  for (const Series& s : runs)
    for (const auto& [x, y] : s.points) {
      x_lo = std::min(x_lo, x), x_hi = std::max(x_hi, x);
      y_lo = std::min(y_lo, y), y_hi = std::max(y_hi, y);
    }
  // A single point or a flat line still gets an axis with some room.
  if (x_hi - x_lo <= 0) x_lo -= 1, x_hi += 1;
  if (y_hi - y_lo <= 0) {
    const double pad = std::max(std::abs(y_hi) * 0.1, 1e-3);
    y_lo -= pad, y_hi += pad;
  }
  const double y_pad = 0.05 * (y_hi - y_lo);
  y_lo -= y_pad, y_hi += y_pad;
  const std::vector<double> x_ticks = nice_ticks(x_lo, x_hi, 6);
  const std::vector<double> y_ticks = nice_ticks(y_lo, y_hi, 6);

  int y_label_width = 0;
  for (double t : y_ticks) y_label_width = std::max(y_label_width, text_width(tick_label(t), kScale));
  const Canvas::Rect frame{y_label_width + 24, char_h + 24, canvas.width() - 24, canvas.height() - 2 * char_h - 28};
  BOOSTER_CHECK(frame.x1 - frame.x0 > 40 && frame.y1 - frame.y0 > 40, ConfigError, "plot: a ", canvas.width(), "x",
                canvas.height(), " image leaves no room for the axes; use --width and --height of at least 320x240");
  auto px = [&](double x) { return frame.x0 + (x - x_lo) / (x_hi - x_lo) * (frame.x1 - frame.x0); };
  auto py = [&](double y) { return frame.y1 - (y - y_lo) / (y_hi - y_lo) * (frame.y1 - frame.y0); };

  // Grid, ticks and tick labels.
  for (double t : x_ticks) {
    const int x = int(std::lround(px(t)));
    canvas.vline(x, frame.y0, frame.y1, kGrid);
    canvas.vline(x, frame.y1, frame.y1 + 5, kBlack);
    const std::string label = tick_label(t);
    draw_text(canvas, x - text_width(label, kScale) / 2, frame.y1 + 10, label, kBlack, kScale);
  }
  for (double t : y_ticks) {
    const int y = int(std::lround(py(t)));
    canvas.hline(frame.x0, frame.x1, y, kGrid);
    canvas.hline(frame.x0 - 5, frame.x0, y, kBlack);
    const std::string label = tick_label(t);
    draw_text(canvas, frame.x0 - 10 - text_width(label, kScale), y - char_h / 2, label, kBlack, kScale);
  }
  // Axis labels: the plotted key above the y axis, "step" under the x axis.
  draw_text(canvas, frame.x0 - 10 - text_width(key, kScale) / 2 > 4 ? frame.x0 - text_width(key, kScale) / 2 : 4,
            frame.y0 - char_h - 10, key, kBlack, kScale);
  draw_text(canvas, (frame.x0 + frame.x1 - text_width("step", kScale)) / 2, frame.y1 + 16 + char_h, "step", kBlack,
            kScale);

  // The curves, then the frame over their ends.
  for (size_t i = 0; i < runs.size(); ++i) {
    const Color color = kPalette[i % kPalette.size()];
    const auto& points = runs[i].points;
    if (points.size() == 1) canvas.line(px(points[0].first), py(points[0].second), px(points[0].first),
                                        py(points[0].second), color, 5, frame);
    for (size_t k = 1; k < points.size(); ++k)
      canvas.line(px(points[k - 1].first), py(points[k - 1].second), px(points[k].first), py(points[k].second), color,
                  2, frame);
  }
  canvas.hline(frame.x0, frame.x1, frame.y0, kBlack);
  canvas.hline(frame.x0, frame.x1, frame.y1, kBlack);
  canvas.vline(frame.x0, frame.y0, frame.y1, kBlack);
  canvas.vline(frame.x1, frame.y0, frame.y1, kBlack);

  // Legend: top right inside the frame, a colour swatch and the run's name per line, on white.
  int name_width = 0;
  for (const Series& s : runs) name_width = std::max(name_width, text_width(s.name, kScale));
  const int line_h = char_h + 8, swatch = 24;
  const int legend_w = swatch + 8 + name_width + 16, legend_h = int(runs.size()) * line_h + 8;
  const int lx = std::max(frame.x1 - legend_w - 8, frame.x0 + 8), ly = frame.y0 + 8;
  canvas.fill_rect(lx, ly, std::min(lx + legend_w, frame.x1 - 1), std::min(ly + legend_h, frame.y1 - 1), kWhite);
  canvas.hline(lx, std::min(lx + legend_w, frame.x1 - 1), ly, kGrid);
  canvas.hline(lx, std::min(lx + legend_w, frame.x1 - 1), std::min(ly + legend_h, frame.y1 - 1), kGrid);
  for (size_t i = 0; i < runs.size(); ++i) {
    const int y = ly + 8 + int(i) * line_h;
    if (y + char_h >= frame.y1) break;  // more runs than fit: the curves still show
    const Color color = kPalette[i % kPalette.size()];
    canvas.fill_rect(lx + 8, y + char_h / 2 - 1, lx + 8 + swatch, y + char_h / 2 + 1, color);
    draw_text(canvas, lx + 8 + swatch + 8, y, runs[i].name, color, kScale);
  }
}

}  // namespace

int plot(const std::vector<std::string>& args) {
  po::options_description desc(
      "usage: booster plot --out FILE.png RUN.jsonl [RUN2.jsonl ...]\n"
      "       booster plot --doctor REPORT --out FILE.png\n\n"
      "Draws the training loss (or another logged value) of one or several runs against the step, one\n"
      "coloured line per run, from the metrics.jsonl files that booster train writes into its run\n"
      "directory (train.run_dir). A run is named after its file, or its directory for metrics.jsonl.\n\noptions");
  desc.add_options()("help,h", "show this help")("out,o", po::value<std::string>()->value_name("FILE.png"),
                                                  "the PNG to write")(
      "key,k", po::value<std::string>()->default_value("loss")->value_name("KEY"),
      "the value to plot: loss, lr, loss_scale, samples_per_second, skipped, or an evaluation's test_loss, "
      "test_accuracy, val_loss, val_ppl")(
      "width", po::value<int>()->default_value(960), "image width in pixels")(
      "height", po::value<int>()->default_value(600), "image height in pixels")(
      "doctor", po::value<std::string>()->value_name("REPORT"),
      "instead of loss curves, the per-module overflow/underflow picture of a booster doctor report (its "
      "stdout saved to a file)");
  po::options_description hidden;
  hidden.add_options()("runs", po::value<std::vector<std::string>>()->composing());
  po::options_description all;
  all.add(desc).add(hidden);
  po::positional_options_description positional;
  positional.add("runs", -1);
  po::variables_map vm;
  po::store(po::command_line_parser(args).options(all).positional(positional).run(), vm);
  po::notify(vm);
  if (vm.count("help")) {
    std::cout << desc;
    return kExitOk;
  }
  BOOSTER_CHECK(vm.count("out"), ConfigError, "'booster plot' needs --out FILE.png (see booster plot --help)");
  if (vm.count("doctor")) {
    BOOSTER_CHECK(!vm.count("runs"), ConfigError, "plot: --doctor draws one report; give no metrics files with it");
    return plot_doctor(vm["doctor"].as<std::string>(), vm["out"].as<std::string>(), vm["width"].as<int>());
  }
  BOOSTER_CHECK(vm.count("runs"), ConfigError,
                "'booster plot' needs at least one metrics file, e.g. runs/<name>/metrics.jsonl");
  const int width = vm["width"].as<int>(), height = vm["height"].as<int>();
  BOOSTER_CHECK(width >= 320 && height >= 240 && width <= 8192 && height <= 8192, ConfigError, "plot: ", width, "x",
                height, " is not a size to draw; expected --width in [320, 8192] and --height in [240, 8192]");
  const std::string key = vm["key"].as<std::string>();

  // A run without a record of the key (one that stopped before its first logged step) is left out with a
  // warning; with none left there is nothing to draw.
  std::vector<Series> runs;
  std::vector<std::string> files = vm["runs"].as<std::vector<std::string>>(), empty;
  for (const std::string& file : files) {
    Series s = read_series(file, key);
    if (s.points.empty()) {
      empty.push_back(file);
      continue;
    }
    runs.push_back(std::move(s));
  }
  BOOSTER_CHECK(!runs.empty(), ConfigError, "plot: ", files.size() == 1 ? "'" + files[0] + "' has" : "none of the runs has",
                " no record with a numeric '", key, "'; expected lines like {\"kind\": \"train\", \"step\": 10, \"",
                key, "\": ...} (or an \"eval\" record for test_loss, test_accuracy, val_loss, val_ppl)");
  for (const std::string& file : empty)
    std::cerr << "booster: warning: plot: skipping '" << file << "': it has no record with a numeric '" << key
              << "' (a run that stopped before its first logged step?)\n";
  Canvas canvas(width, height);
  render(canvas, runs, key);
  const std::string png = encode_png(canvas);
  const fs::path out = vm["out"].as<std::string>();
  std::ofstream file(out, std::ios::binary);
  BOOSTER_CHECK(file.good(), ConfigError, "plot: cannot write '", out.string(), "'");
  file.write(png.data(), std::streamsize(png.size()));
  file.close();
  BOOSTER_CHECK(file.good(), ConfigError, "plot: writing '", out.string(), "' failed");
  std::cerr << "booster: wrote " << out.string() << " (" << runs.size() << (runs.size() == 1 ? " run, " : " runs, ")
            << width << "x" << height << ")\n";
  return kExitOk;
}

}  // namespace booster::cli
