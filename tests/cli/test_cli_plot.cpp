// `booster plot`: the PNG it writes is a valid PNG (decoded here with zlib, independently of the writer:
// signature, chunk CRCs, IHDR, inflated IDAT size and filter bytes) that shows each run in its colour,
// the right way up; bad inputs exit 2 with one line.
#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "run_booster.h"

namespace fs = std::filesystem;

namespace {

fs::path scratch_dir() { return testing::scratch_dir("test_cli_plot"); }

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct RunResult {
  int exit_code = -1;
  std::string err;
};

RunResult run_booster(const std::string& args) {
  const fs::path err = scratch_dir() / "stderr.txt";
  const std::string cmd = std::string(BOOSTER_BIN_DIR) + "/booster " + args + " >/dev/null 2>" + err.string();
  const int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, read_bytes(err)};
}

// A metrics file as booster train writes it: train records with `loss` = f(step), and an eval record
// that the plot must ignore (its "loss" of 99 is no training loss).
fs::path write_run(const std::string& name, double (*loss)(int)) {
  const fs::path dir = scratch_dir() / name;
  fs::create_directories(dir);
  std::ofstream out(dir / "metrics.jsonl");
  for (int step = 10; step <= 200; step += 10) {
    out << R"({"kind":"train","step":)" << step << R"(,"loss":)" << loss(step)
        << R"(,"lr":0.001,"loss_scale":null,"skipped":0,"samples_per_second":1000,"time":1})" << "\n";
    if (step % 100 == 0) out << R"({"kind":"eval","step":)" << step << R"(,"loss":99,"test_loss":99,"test_accuracy":0.5})" << "\n";
  }
  return dir / "metrics.jsonl";
}

uint32_t be32(const std::string& s, size_t at) {
  return uint32_t(uint8_t(s[at])) << 24 | uint32_t(uint8_t(s[at + 1])) << 16 | uint32_t(uint8_t(s[at + 2])) << 8 |
         uint32_t(uint8_t(s[at + 3]));
}

struct Image {
  uint32_t width = 0, height = 0;
  std::vector<uint8_t> rgb;  // width * height * 3
  bool has(int x, int y, uint8_t r, uint8_t g, uint8_t b) const {
    const uint8_t* p = &rgb[(size_t(y) * width + size_t(x)) * 3];
    return p[0] == r && p[1] == g && p[2] == b;
  }
};

// Decodes an 8-bit RGB PNG with filter 0 rows, checking everything on the way.
Image decode_png(const std::string& png) {
  REQUIRE(png.size() > 8);
  REQUIRE(png.compare(0, 8, std::string("\x89PNG\r\n\x1a\n", 8)) == 0);
  Image image;
  std::string idat;
  std::vector<std::string> types;
  size_t at = 8;
  while (at < png.size()) {
    REQUIRE(at + 12 <= png.size());
    const uint32_t length = be32(png, at);
    REQUIRE(at + 12 + length <= png.size());
    const std::string type = png.substr(at + 4, 4);
    const std::string data = png.substr(at + 8, length);
    const uint32_t crc = be32(png, at + 8 + length);
    INFO("chunk " << type);
    CHECK(crc == uint32_t(crc32(0L, reinterpret_cast<const Bytef*>(png.data() + at + 4), uInt(4 + length))));
    types.push_back(type);
    if (type == "IHDR") {
      REQUIRE(length == 13);
      image.width = be32(data, 0);
      image.height = be32(data, 4);
      CHECK(uint8_t(data[8]) == 8);   // bit depth
      CHECK(uint8_t(data[9]) == 2);   // colour type RGB
      CHECK(uint8_t(data[10]) == 0);  // deflate
      CHECK(uint8_t(data[11]) == 0);  // filter method
      CHECK(uint8_t(data[12]) == 0);  // no interlace
    } else if (type == "IDAT") {
      idat += data;
    }
    at += 12 + length;
  }
  REQUIRE(at == png.size());
  REQUIRE(types.size() >= 3);
  CHECK(types.front() == "IHDR");
  CHECK(types.back() == "IEND");

  const size_t row_bytes = size_t(image.width) * 3;
  const size_t expected = (row_bytes + 1) * image.height;
  std::vector<uint8_t> raw(expected + 16);  // room to notice a stream longer than expected
  uLongf raw_size = uLongf(raw.size());
  REQUIRE(uncompress(raw.data(), &raw_size, reinterpret_cast<const Bytef*>(idat.data()), uLong(idat.size())) == Z_OK);
  REQUIRE(raw_size == expected);
  image.rgb.reserve(row_bytes * image.height);
  for (uint32_t y = 0; y < image.height; ++y) {
    const uint8_t* row = &raw[y * (row_bytes + 1)];
    REQUIRE(row[0] == 0);  // filter type None
    image.rgb.insert(image.rgb.end(), row + 1, row + 1 + row_bytes);
  }
  return image;
}

double falling(int step) { return 3.0 - step / 100.0; }
double rising(int step) { return 1.0 + step / 100.0; }

}  // namespace

TEST_CASE("booster plot writes a decodable PNG with one coloured curve per run", "[cli][plot]") {
  const fs::path a = write_run("falling", falling), b = write_run("rising", rising);
  const fs::path png = scratch_dir() / "loss.png";
  RunResult r = run_booster("plot --out " + png.string() + " --width 640 --height 400 " + a.string() + " " + b.string());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const Image image = decode_png(read_bytes(png));
  CHECK(image.width == 640);
  CHECK(image.height == 400);

  // The first run is drawn in (31, 119, 180), the second in (255, 127, 14). Only the curves and the
  // legend (top right) use these colours, so the left third of the image holds curve pixels alone: the
  // falling run starts high (small y), the rising one low.
  auto mean_y_left = [&](uint8_t r_, uint8_t g_, uint8_t b_, size_t& count) {
    double sum = 0;
    count = 0;
    for (uint32_t y = 0; y < image.height; ++y)
      for (uint32_t x = 0; x < image.width / 3; ++x)
        if (image.has(int(x), int(y), r_, g_, b_)) sum += y, ++count;
    return count ? sum / double(count) : -1.0;
  };
  size_t blue = 0, orange = 0;
  const double blue_y = mean_y_left(31, 119, 180, blue);
  const double orange_y = mean_y_left(255, 127, 14, orange);
  CHECK(blue > 50);
  CHECK(orange > 50);
  CHECK(blue_y < image.height / 2.0);
  CHECK(orange_y > image.height / 2.0);
  // Axis ink (black) and the white background are there; the eval records' loss of 99 did not stretch
  // the axis (else both curves would be squeezed into a thin band at the bottom).
  size_t black = 0;
  for (size_t i = 0; i < image.rgb.size(); i += 3) black += image.rgb[i] == 0 && image.rgb[i + 1] == 0 && image.rgb[i + 2] == 0;
  CHECK(black > 500);
  CHECK(image.has(int(image.width) - 1, int(image.height) - 1, 255, 255, 255));
  CHECK(blue_y < image.height * 0.4);
}

TEST_CASE("booster plot mistakes exit 2 with one line naming the problem", "[cli][plot]") {
  const fs::path good = write_run("good", falling);
  const fs::path broken = scratch_dir() / "broken.jsonl";
  std::ofstream(broken) << R"({"kind":"train","step":1,"loss":2})" << "\n" << "not json\n";
  const fs::path empty = scratch_dir() / "empty.jsonl";
  std::ofstream(empty) << R"({"kind":"eval","step":1,"test_loss":2})" << "\n";
  const std::string out = " --out " + (scratch_dir() / "x.png").string() + " ";
  for (const auto& [args, expect] : std::vector<std::pair<std::string, std::string>>{
           {"plot " + good.string(), "needs --out"},
           {"plot" + out, "at least one metrics file"},
           {"plot" + out + "/nonexistent/metrics.jsonl", "/nonexistent/metrics.jsonl"},
           {"plot" + out + broken.string(), "line 2 is not a JSON object"},
           {"plot" + out + empty.string(), "has no record with a numeric 'loss'"},
           {"plot" + out + "--key nope " + good.string(), "numeric 'nope'"},
           {"plot" + out + "--width 10 " + good.string(), "expected --width in [320, 8192]"},
           {"plot --out /nonexistent/dir/x.png " + good.string(), "cannot write '/nonexistent/dir/x.png'"},
       }) {
    INFO(args);
    const RunResult r = run_booster(args);
    INFO(r.err);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find(expect) != std::string::npos);
    CHECK(r.err.rfind("booster: error: ", 0) == 0);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  }
}

namespace {

// A doctor report (the last line of `booster doctor`) with `n` modules; the first has half of its
// parameter gradients underflowing float16 and inf/NaN values when `bad`, the rest are clean.
fs::path write_report(const std::string& name, int n, bool bad) {
  auto stats = [](double f16_underflow, int nonfinite) {
    const std::string formats = R"("bfloat16":{"overflow":0,"underflow":0,"subnormal":0},)"
                                R"("e4m3":{"overflow":0,"underflow":0,"subnormal":0},)"
                                R"("e5m2":{"overflow":0,"underflow":0,"subnormal":0},)";
    return std::string(R"({"count":100,"max_abs":2.0,"zeros":0,"nonfinite":)") + std::to_string(nonfinite) + "," +
           formats + R"("float16":{"overflow":0,"underflow":)" + std::to_string(f16_underflow) +
           R"(,"subnormal":0},"exponents":{"min":-30,"counts":[50,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,50]}})";
  };
  const fs::path file = scratch_dir() / (name + ".txt");
  std::ofstream out(file);
  out << "precision doctor: a table for people first\n";
  out << R"({"precision":"fp16","format":"float16","loss_scale":65536,"steps":3,"modules":[)";
  for (int i = 0; i < n; ++i) {
    const bool first_bad = bad && i == 0;
    out << (i ? "," : "") << R"({"module":"layers.)" << i << R"(","type":"Linear","output":)" << stats(0.0, 0)
        << R"(,"param_grad":)" << stats(first_bad ? 0.5 : 0.0, first_bad ? 3 : 0) << "}";
  }
  out << R"(],"skipped_steps":[],"findings":[],"recommendation":"x","fp8_scales":{}})" << "\n";
  return file;
}

// Pixels that are strongly red: the heat colours of large fractions.
size_t red_pixels(const Image& image) {
  size_t n = 0;
  for (size_t i = 0; i < image.rgb.size(); i += 3) n += image.rgb[i] > 150 && image.rgb[i + 1] < 80 && image.rgb[i + 2] < 80;
  return n;
}

size_t pixels_of(const Image& image, uint8_t r, uint8_t g, uint8_t b) {
  size_t n = 0;
  for (size_t i = 0; i < image.rgb.size(); i += 3) n += image.rgb[i] == r && image.rgb[i + 1] == g && image.rgb[i + 2] == b;
  return n;
}

}  // namespace

// A run with no record of the key (stopped before its first logged step) is skipped with a warning,
// not the end of the plot; evaluation keys come from the "eval" records.
TEST_CASE("booster plot skips a run without records and plots evaluation keys", "[cli][plot]") {
  const fs::path good = write_run("good_with_eval", falling);
  std::ofstream(good, std::ios::app) << R"({"kind":"eval","step":5,"test_loss":1.5,"test_accuracy":0.6})" << "\n"
                                     << R"({"kind":"eval","step":10,"test_loss":1.2,"test_accuracy":0.7})" << "\n";
  const fs::path stopped = scratch_dir() / "stopped.jsonl";
  std::ofstream(stopped) << "";
  const fs::path png = scratch_dir() / "skip.png";
  RunResult r = run_booster("plot --out " + png.string() + " " + good.string() + " " + stopped.string());
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.err, Catch::Contains("warning: plot: skipping '" + stopped.string() + "'"));
  CHECK_THAT(r.err, Catch::Contains("(1 run,"));
  CHECK(fs::file_size(png) > 0);
  for (const std::string key : {"test_accuracy", "test_loss"}) {
    INFO(key);
    r = run_booster("plot --key " + key + " --out " + png.string() + " " + good.string());
    CHECK(r.exit_code == 0);
    CHECK_THAT(r.err, !Catch::Contains("skipping"));
  }
}

TEST_CASE("booster plot --doctor draws a row per module and colours what leaves a format's range", "[cli][plot]") {
  const fs::path png = scratch_dir() / "doctor.png";
  auto draw = [&](const fs::path& report) {
    const RunResult r = run_booster("plot --doctor " + report.string() + " --out " + png.string());
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    return decode_png(read_bytes(png));
  };
  const Image clean2 = draw(write_report("clean2", 2, false));
  const Image clean4 = draw(write_report("clean4", 4, false));
  const Image bad2 = draw(write_report("bad2", 2, true));
  CHECK(clean2.width >= 960);
  // Two more modules, two more rows of equal height.
  CHECK(clean4.height > clean2.height);
  CHECK((clean4.height - clean2.height) % 2 == 0);
  CHECK(bad2.height == clean2.height);
  // The legend's darkest swatch is red in every picture; a module losing half its gradients adds a
  // cell half of it (at least 20 x 6 pixels).
  CHECK(red_pixels(bad2) >= red_pixels(clean2) + 120);
  CHECK(red_pixels(clean2) == red_pixels(clean4));
  // Every module has forward outputs (a blue bar) and gradients (an orange one); more rows, more ink.
  CHECK(pixels_of(clean2, 31, 119, 180) > 50);
  CHECK(pixels_of(clean2, 255, 127, 14) > 50);
  CHECK(pixels_of(clean4, 31, 119, 180) > pixels_of(clean2, 31, 119, 180));

  // A file without a report, and a report with metrics files too.
  const fs::path none = scratch_dir() / "none.txt";
  std::ofstream(none) << "nothing here\n{\"kind\":\"train\"}\n";
  RunResult r = run_booster("plot --doctor " + none.string() + " --out " + png.string());
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("holds no doctor report") != std::string::npos);
  r = run_booster("plot --doctor " + none.string() + " --out " + png.string() + " " + none.string());
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--doctor draws one report") != std::string::npos);
}
