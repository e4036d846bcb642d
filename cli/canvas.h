// What `booster plot` draws with (plot.cpp, plot_doctor.cpp): a small RGB canvas, lines, a 5x7 bitmap
// font and a PNG written with zlib (deflate for the pixels, crc32 for the chunks). Nothing to install
// beyond zlib, nothing to open but an image viewer. The font has digits, lower-case letters and a few
// signs; upper-case letters are drawn lower-case.
#pragma once

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "booster/common/error.h"

namespace booster::cli::draw {

// ------------------------------------------------------------------------------------------ canvas
struct Color {
  uint8_t r, g, b;
};
constexpr Color kWhite{255, 255, 255};
constexpr Color kBlack{0, 0, 0};
constexpr Color kGrid{225, 225, 225};
// matplotlib's "tab10" colours: distinct for up to ten runs, then they repeat.
constexpr std::array<Color, 10> kPalette{{{31, 119, 180},
                                          {255, 127, 14},
                                          {44, 160, 44},
                                          {214, 39, 40},
                                          {148, 103, 189},
                                          {140, 86, 75},
                                          {227, 119, 194},
                                          {127, 127, 127},
                                          {188, 189, 34},
                                          {23, 190, 207}}};

class Canvas {
 public:
  Canvas(int width, int height) : width_(width), height_(height), pixels_(size_t(width) * height * 3, 255) {}
  int width() const { return width_; }
  int height() const { return height_; }
  const std::vector<uint8_t>& pixels() const { return pixels_; }

  void set(int x, int y, Color c) {
    if (x < 0 || y < 0 || x >= width_ || y >= height_) return;
    uint8_t* p = &pixels_[(size_t(y) * width_ + x) * 3];
    p[0] = c.r;
    p[1] = c.g;
    p[2] = c.b;
  }
  void fill_rect(int x0, int y0, int x1, int y1, Color c) {
    for (int y = y0; y <= y1; ++y)
      for (int x = x0; x <= x1; ++x) set(x, y, c);
  }
  void hline(int x0, int x1, int y, Color c) { fill_rect(std::min(x0, x1), y, std::max(x0, x1), y, c); }
  void vline(int x, int y0, int y1, Color c) { fill_rect(x, std::min(y0, y1), x, std::max(y0, y1), c); }

  // A line `thickness` pixels wide (a square brush along Bresenham's path), drawn only inside `clip`.
  struct Rect {
    int x0, y0, x1, y1;
  };
  void line(double fx0, double fy0, double fx1, double fy1, Color c, int thickness, Rect clip) {
    // Points far outside the canvas (a huge outlier) would make Bresenham walk for ages: clamp first.
    auto clampf = [](double v) { return std::clamp(v, -1.0e5, 1.0e5); };
    int x0 = int(std::lround(clampf(fx0))), y0 = int(std::lround(clampf(fy0)));
    const int x1 = int(std::lround(clampf(fx1))), y1 = int(std::lround(clampf(fy1)));
    const int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0);
    const int sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
    int err = dx + dy;
    const int lo = -(thickness - 1) / 2, hi = thickness / 2;
    for (;;) {
      for (int oy = lo; oy <= hi; ++oy)
        for (int ox = lo; ox <= hi; ++ox) {
          const int x = x0 + ox, y = y0 + oy;
          if (x >= clip.x0 && x <= clip.x1 && y >= clip.y0 && y <= clip.y1) set(x, y, c);
        }
      if (x0 == x1 && y0 == y1) break;
      const int e2 = 2 * err;
      if (e2 >= dy) {
        err += dy;
        x0 += sx;
      }
      if (e2 <= dx) {
        err += dx;
        y0 += sy;
      }
    }
  }

 private:
  int width_, height_;
  std::vector<uint8_t> pixels_;
};

// ------------------------------------------------------------------------------------------ font
// 5x7 glyphs, one string of 7 rows x 5 columns each ('#' = ink).
struct Glyph {
  char c;
  const char* rows;
};
constexpr Glyph kFont[] = {
    {'0', ".###.#...##..###.#.###..##...#.###."}, {'1', "..#...##....#....#....#....#...###."},
    {'2', ".###.#...#....#...#...#...#...#####"}, {'3', "#####...#...#.....#.....##...#.###."},
    {'4', "...#...##..#.#.#..#.#####...#....#."}, {'5', "######....####.....#....##...#.###."},
    {'6', "..##..#...#....####.#...##...#.###."}, {'7', "#####....#...#...#...#....#....#..."},
    {'8', ".###.#...##...#.###.#...##...#.###."}, {'9', ".###.#...##...#.####....#...#..##.."},
    {'a', "...........###.....#.#####...#.####"}, {'b', "#....#....#.##.##..##...##...#####."},
    {'c', "...........###.#....#....#...#.###."}, {'d', "....#....#.##.##..###...##...#.####"},
    {'e', "...........###.#...#######.....###."}, {'f', "..##..#..#.#...###...#....#....#..."},
    {'g', "......#####...##...#.####....#.###."}, {'h', "#....#....#.##.##..##...##...##...#"},
    {'i', "..#........##....#....#....#...###."}, {'j', "...#........##....#....#.#..#..##.."},
    {'k', "#....#....#..#.#.#..##...#.#..#..#."}, {'l', ".##....#....#....#....#....#...###."},
    {'m', "..........##.#.#.#.##.#.##...##...#"}, {'n', "..........#.##.##..##...##...##...#"},
    {'o', "...........###.#...##...##...#.###."}, {'p', "..........####.#...#####.#....#...."},
    {'q', "...........#####...#.####....#....#"}, {'r', "..........#.##.##..##....#....#...."},
    {'s', "...........#####.....###.....#####."}, {'t', ".#....#...###...#....#....#..#..##."},
    {'u', "..........#...##...##...##..##.##.#"}, {'v', "..........#...##...##...#.#.#...#.."},
    {'w', "..........#...##...##.#.##.#.#.#.#."}, {'x', "..........#...#.#.#...#...#.#.#...#"},
    {'y', "..........#...##...#.####....#.###."}, {'z', "..........#####...#...#...#...#####"},
    {'.', "..........................##...##.."}, {'-', "...............#####..............."},
    {'_', "..............................#####"}, {'+', ".......#....#..#####..#....#......."},
    {'/', ".........#...#...#...#...#........."}, {'(', "...#...#...#....#....#.....#.....#."},
    {')', ".#.....#.....#....#....#...#...#..."}, {':', "......##...##........##...##......."},
    {'%', "##...##..#...#...#...#...#..##...##"}, {'=', "..........#####.....#####.........."},
    {'?', ".###.#...#....#...#...#.........#.."}, {' ', "..................................."},
    {',', "......................##....#...#.."}, {'!', "..#....#....#....#....#.........#.."},

};
constexpr int kGlyphWidth = 5, kGlyphHeight = 7;

inline const char* glyph_rows(char c) {
  if (c >= 'A' && c <= 'Z') c = char(c - 'A' + 'a');
  for (const Glyph& g : kFont)
    if (g.c == c) return g.rows;
  return glyph_rows('?');
}

// Text drawn `scale` pixels per font pixel, one font pixel between letters.
inline int text_width(const std::string& s, int scale) { return int(s.size()) * (kGlyphWidth + 1) * scale - scale; }
inline int text_height(int scale) { return kGlyphHeight * scale; }

inline void draw_text(Canvas& canvas, int x, int y, const std::string& s, Color c, int scale) {
  for (char ch : s) {
    const std::string rows = glyph_rows(ch);
    for (int gy = 0; gy < kGlyphHeight; ++gy)
      for (int gx = 0; gx < kGlyphWidth; ++gx) {
        const size_t at = size_t(gy * kGlyphWidth + gx);
        if (at < rows.size() && rows[at] == '#')
          canvas.fill_rect(x + gx * scale, y + gy * scale, x + gx * scale + scale - 1, y + gy * scale + scale - 1, c);
      }
    x += (kGlyphWidth + 1) * scale;
  }
}

// ------------------------------------------------------------------------------------------ PNG
inline void put_u32(std::string& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(char((v >> shift) & 0xff));
}

// A chunk: length, type, data, CRC-32 of type + data (PNG spec 5.3).
inline void put_chunk(std::string& out, const char* type, const std::string& data) {
  put_u32(out, uint32_t(data.size()));
  const size_t type_at = out.size();
  out.append(type, 4);
  out += data;
  const auto* bytes = reinterpret_cast<const Bytef*>(out.data() + type_at);
  put_u32(out, uint32_t(crc32(crc32(0L, Z_NULL, 0), bytes, uInt(4 + data.size()))));
}

// An 8-bit RGB, non-interlaced PNG: each row is filter byte 0 (none) + the row's pixels, deflated
// into one IDAT chunk.
inline std::string encode_png(const Canvas& canvas) {
  const size_t row_bytes = size_t(canvas.width()) * 3;
  std::string raw;
  raw.reserve((row_bytes + 1) * size_t(canvas.height()));
  for (int y = 0; y < canvas.height(); ++y) {
    raw.push_back('\0');
    raw.append(reinterpret_cast<const char*>(canvas.pixels().data() + size_t(y) * row_bytes), row_bytes);
  }
  uLongf packed_size = compressBound(uLong(raw.size()));
  std::string packed(packed_size, '\0');
  const int rc = compress2(reinterpret_cast<Bytef*>(packed.data()), &packed_size,
                           reinterpret_cast<const Bytef*>(raw.data()), uLong(raw.size()), Z_BEST_COMPRESSION);
  BOOSTER_CHECK(rc == Z_OK, ValueError, "plot: zlib compress2 failed with code ", rc);
  packed.resize(packed_size);

  std::string png = "\x89PNG\r\n\x1a\n";
  std::string header;
  put_u32(header, uint32_t(canvas.width()));
  put_u32(header, uint32_t(canvas.height()));
  header += std::string{char(8), char(2), char(0), char(0), char(0)};  // depth 8, RGB, deflate, filter 0, no interlace
  put_chunk(png, "IHDR", header);
  put_chunk(png, "IDAT", packed);
  put_chunk(png, "IEND", "");
  return png;
}

}  // namespace booster::cli::draw
