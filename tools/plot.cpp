// Line charts to PNG: see plot.h for what is drawn and the data rules.
#include "tools/plot.h"

#include "engine/error.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string_view>
#include <system_error>
#include <utility>

#include <unistd.h>

#if CW_HAVE_PNG
#include <png.h>
#if !defined(PNG_SIMPLIFIED_WRITE_SUPPORTED)
#error "chunkwise needs libpng >= 1.6 with the simplified write API (png_image_write_to_file)"
#endif
#endif

namespace cw {

namespace {

// ---- the built-in font -------------------------------------------------------------------------
//
// One glyph per printable ASCII character, drawn for this project: 5 columns, '#' on and '.' off.
// A glyph cell has 9 rows: rows 0..6 hold capitals and digits (baseline under row 6), lowercase
// letters have their x-height in rows 2..6, and rows 7..8 hold descenders. `top` is the cell row of
// a glyph's first listed row, so descending letters are listed from their x-height down.

constexpr int kGlyphCols = 5;
constexpr int kGlyphRows = 9;  // cell height, descenders included
constexpr int kCapRows = 7;    // height of a capital or digit: what centring a label uses
constexpr int kAdvance = 6;    // glyph width plus one column of spacing

struct Glyph {
  char ch;
  int top;
  const char* rows[kGlyphRows];  // top to bottom; unused trailing rows are null
};

constexpr Glyph kFont[] = {
    {' ', 0, {".....", ".....", ".....", ".....", ".....", ".....", "....."}},
    {'!', 0, {"..#..", "..#..", "..#..", "..#..", "..#..", ".....", "..#.."}},
    {'"', 0, {".#.#.", ".#.#.", ".#.#."}},
    {'#', 0, {".#.#.", ".#.#.", "#####", ".#.#.", "#####", ".#.#.", ".#.#."}},
    {'$', 0, {"..#..", ".####", "#.#..", ".###.", "..#.#", "####.", "..#.."}},
    {'%', 0, {"##...", "##..#", "...#.", "..#..", ".#...", "#..##", "...##"}},
    {'&', 0, {".##..", "#..#.", "#.#..", ".#...", "#.#.#", "#..#.", ".##.#"}},
    {'\'', 0, {"..#..", "..#..", ".#..."}},
    {'(', 0, {"...#.", "..#..", ".#...", ".#...", ".#...", "..#..", "...#."}},
    {')', 0, {".#...", "..#..", "...#.", "...#.", "...#.", "..#..", ".#..."}},
    {'*', 1, {"..#..", "#.#.#", ".###.", "#.#.#", "..#.."}},
    {'+', 1, {"..#..", "..#..", "#####", "..#..", "..#.."}},
    {',', 5, {".##..", ".##..", "..#..", ".#..."}},
    {'-', 3, {".###."}},
    {'.', 5, {".##..", ".##.."}},
    {'/', 1, {"....#", "...#.", "..#..", ".#...", "#...."}},
    {'0', 0, {".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."}},
    {'1', 0, {"..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."}},
    {'2', 0, {".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"}},
    {'3', 0, {"#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."}},
    {'4', 0, {"...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."}},
    {'5', 0, {"#####", "#....", "####.", "....#", "....#", "#...#", ".###."}},
    {'6', 0, {"..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."}},
    {'7', 0, {"#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."}},
    {'8', 0, {".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."}},
    {'9', 0, {".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."}},
    {':', 1, {".##..", ".##..", ".....", ".....", ".##..", ".##.."}},
    {';', 1, {".##..", ".##..", ".....", ".....", ".##..", ".##..", "..#..", ".#..."}},
    {'<', 0, {"...#.", "..#..", ".#...", "#....", ".#...", "..#..", "...#."}},
    {'=', 2, {"#####", ".....", "#####"}},
    {'>', 0, {".#...", "..#..", "...#.", "....#", "...#.", "..#..", ".#..."}},
    {'?', 0, {".###.", "#...#", "....#", "...#.", "..#..", ".....", "..#.."}},
    {'@', 0, {".###.", "#...#", "#.###", "#.#.#", "#.###", "#....", ".####"}},
    {'A', 0, {".###.", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"}},
    {'B', 0, {"####.", "#...#", "#...#", "####.", "#...#", "#...#", "####."}},
    {'C', 0, {".###.", "#...#", "#....", "#....", "#....", "#...#", ".###."}},
    {'D', 0, {"###..", "#..#.", "#...#", "#...#", "#...#", "#..#.", "###.."}},
    {'E', 0, {"#####", "#....", "#....", "####.", "#....", "#....", "#####"}},
    {'F', 0, {"#####", "#....", "#....", "####.", "#....", "#....", "#...."}},
    {'G', 0, {".###.", "#...#", "#....", "#.###", "#...#", "#...#", ".####"}},
    {'H', 0, {"#...#", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"}},
    {'I', 0, {".###.", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."}},
    {'J', 0, {"..###", "...#.", "...#.", "...#.", "...#.", "#..#.", ".##.."}},
    {'K', 0, {"#...#", "#..#.", "#.#..", "##...", "#.#..", "#..#.", "#...#"}},
    {'L', 0, {"#....", "#....", "#....", "#....", "#....", "#....", "#####"}},
    {'M', 0, {"#...#", "##.##", "#.#.#", "#.#.#", "#...#", "#...#", "#...#"}},
    {'N', 0, {"#...#", "#...#", "##..#", "#.#.#", "#..##", "#...#", "#...#"}},
    {'O', 0, {".###.", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."}},
    {'P', 0, {"####.", "#...#", "#...#", "####.", "#....", "#....", "#...."}},
    {'Q', 0, {".###.", "#...#", "#...#", "#...#", "#.#.#", "#..#.", ".##.#"}},
    {'R', 0, {"####.", "#...#", "#...#", "####.", "#.#..", "#..#.", "#...#"}},
    {'S', 0, {".####", "#....", "#....", ".###.", "....#", "....#", "####."}},
    {'T', 0, {"#####", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."}},
    {'U', 0, {"#...#", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."}},
    {'V', 0, {"#...#", "#...#", "#...#", "#...#", "#...#", ".#.#.", "..#.."}},
    {'W', 0, {"#...#", "#...#", "#...#", "#.#.#", "#.#.#", "#.#.#", ".#.#."}},
    {'X', 0, {"#...#", "#...#", ".#.#.", "..#..", ".#.#.", "#...#", "#...#"}},
    {'Y', 0, {"#...#", "#...#", ".#.#.", "..#..", "..#..", "..#..", "..#.."}},
    {'Z', 0, {"#####", "....#", "...#.", "..#..", ".#...", "#....", "#####"}},
    {'[', 0, {".###.", ".#...", ".#...", ".#...", ".#...", ".#...", ".###."}},
    {'\\', 1, {"#....", ".#...", "..#..", "...#.", "....#"}},
    {']', 0, {".###.", "...#.", "...#.", "...#.", "...#.", "...#.", ".###."}},
    {'^', 0, {"..#..", ".#.#.", "#...#"}},
    {'_', 7, {"#####"}},
    {'`', 0, {".#...", "..#..", "...#."}},
    {'a', 2, {".###.", "....#", ".####", "#...#", ".####"}},
    {'b', 0, {"#....", "#....", "#.##.", "##..#", "#...#", "#...#", "####."}},
    {'c', 2, {".###.", "#....", "#....", "#...#", ".###."}},
    {'d', 0, {"....#", "....#", ".##.#", "#..##", "#...#", "#...#", ".####"}},
    {'e', 2, {".###.", "#...#", "#####", "#....", ".###."}},
    {'f', 0, {"..##.", ".#..#", ".#...", "###..", ".#...", ".#...", ".#..."}},
    {'g', 2, {".####", "#...#", "#...#", "#...#", ".####", "....#", ".###."}},
    {'h', 0, {"#....", "#....", "#.##.", "##..#", "#...#", "#...#", "#...#"}},
    {'i', 0, {"..#..", ".....", ".##..", "..#..", "..#..", "..#..", ".###."}},
    {'j', 0, {"...#.", ".....", "..##.", "...#.", "...#.", "...#.", "...#.", "#..#.", ".##.."}},
    {'k', 0, {"#....", "#....", "#..#.", "#.#..", "##...", "#.#..", "#..#."}},
    {'l', 0, {".##..", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."}},
    {'m', 2, {"##.#.", "#.#.#", "#.#.#", "#...#", "#...#"}},
    {'n', 2, {"#.##.", "##..#", "#...#", "#...#", "#...#"}},
    {'o', 2, {".###.", "#...#", "#...#", "#...#", ".###."}},
    {'p', 2, {"####.", "#...#", "#...#", "#...#", "####.", "#....", "#...."}},
    {'q', 2, {".####", "#...#", "#...#", "#...#", ".####", "....#", "....#"}},
    {'r', 2, {"#.##.", "##..#", "#....", "#....", "#...."}},
    {'s', 2, {".####", "#....", ".###.", "....#", "####."}},
    {'t', 0, {".#...", ".#...", "###..", ".#...", ".#...", ".#..#", "..##."}},
    {'u', 2, {"#...#", "#...#", "#...#", "#..##", ".##.#"}},
    {'v', 2, {"#...#", "#...#", "#...#", ".#.#.", "..#.."}},
    {'w', 2, {"#...#", "#...#", "#.#.#", "#.#.#", ".#.#."}},
    {'x', 2, {"#...#", ".#.#.", "..#..", ".#.#.", "#...#"}},
    {'y', 2, {"#...#", "#...#", "#...#", "#...#", ".####", "....#", ".###."}},
    {'z', 2, {"#####", "...#.", "..#..", ".#...", "#####"}},
    {'{', 0, {"...#.", "..#..", "..#..", ".#...", "..#..", "..#..", "...#."}},
    {'|', 0, {"..#..", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."}},
    {'}', 0, {".#...", "..#..", "..#..", "...#.", "..#..", "..#..", ".#..."}},
    {'~', 2, {".#...", "#.#.#", "...#."}},
};

// The table is data typed by hand: check its shape at compile time so a slip (a row of 4 columns,
// a glyph out of order, one running below the cell) cannot reach a chart.
constexpr bool font_is_well_formed() {
  int index = 0;
  for (const Glyph& g : kFont) {
    if (g.ch != static_cast<char>(32 + index)) return false;
    int count = 0;
    bool ended = false;
    for (const char* row : g.rows) {
      if (row == nullptr) {
        ended = true;
        continue;
      }
      if (ended) return false;
      int length = 0;
      for (const char* p = row; *p != '\0'; ++p, ++length)
        if (*p != '#' && *p != '.') return false;
      if (length != kGlyphCols) return false;
      ++count;
    }
    if (count == 0 || g.top < 0 || g.top + count > kGlyphRows) return false;
    ++index;
  }
  return index == 95;
}
static_assert(font_is_well_formed(), "kFont must hold ASCII 32..126 in order, 5 columns, inside the cell");

const Glyph& glyph_for(char c) {
  const unsigned char u = static_cast<unsigned char>(c);
  return (u >= 32 && u <= 126) ? kFont[u - 32] : kFont['?' - 32];
}

int text_width(std::string_view text, int scale) {
  return text.empty() ? 0 : (static_cast<int>(text.size()) * kAdvance - 1) * scale;
}

// ---- the raster ----------------------------------------------------------------------------------

constexpr uint32_t kWhite = 0xFFFFFF;
constexpr uint32_t kTextColour = 0x222222;
constexpr uint32_t kFrameColour = 0x4D4D4D;
constexpr uint32_t kGridColour = 0xE8E8E8;
constexpr uint32_t kLegendBorder = 0xBBBBBB;

struct Canvas {
  int w, h;
  std::vector<uint8_t> rgb;

  Canvas(int width, int height)
      : w(width), h(height), rgb(static_cast<size_t>(width) * static_cast<size_t>(height) * 3, 0xFF) {}

  // Mixes colour into pixel (x, y) with weight a in [0, 1]; pixels off the canvas are ignored, so
  // callers can draw text that runs off an edge without checking.
  void blend(int x, int y, uint32_t colour, float a) {
    if (x < 0 || y < 0 || x >= w || y >= h || a <= 0) return;
    a = std::min(a, 1.0f);
    uint8_t* p = &rgb[(static_cast<size_t>(y) * static_cast<size_t>(w) + static_cast<size_t>(x)) * 3];
    for (int c = 0; c < 3; ++c) {
      const float src = static_cast<float>((colour >> (16 - 8 * c)) & 0xFF);
      p[c] = static_cast<uint8_t>(std::lround(static_cast<float>(p[c]) * (1 - a) + src * a));
    }
  }
  void set(int x, int y, uint32_t colour) { blend(x, y, colour, 1.0f); }

  // Fills columns [x0, x1) of rows [y0, y1).
  void fill(int x0, int y0, int x1, int y1, uint32_t colour) {
    for (int y = y0; y < y1; ++y)
      for (int x = x0; x < x1; ++x) set(x, y, colour);
  }
};

// Draws text with its cell's top-left corner at (x, y), each font pixel a scale x scale block.
// Vertical text reads bottom to top (a y-axis label): (x, y) is then the cell's bottom-left corner
// and the cell's rows run left to right.
void draw_text(Canvas& cv, int x, int y, std::string_view text, int scale, uint32_t colour,
               bool vertical = false) {
  for (size_t i = 0; i < text.size(); ++i) {
    const Glyph& g = glyph_for(text[i]);
    const int along0 = static_cast<int>(i) * kAdvance * scale;
    for (int r = 0; r < kGlyphRows && g.rows[r] != nullptr; ++r)
      for (int c = 0; c < kGlyphCols; ++c) {
        if (g.rows[r][c] != '#') continue;
        const int along = along0 + c * scale, across = (g.top + r) * scale;
        for (int dy = 0; dy < scale; ++dy)
          for (int dx = 0; dx < scale; ++dx) {
            if (vertical)
              cv.set(x + across + dy, y - 1 - along - dx, colour);
            else
              cv.set(x + along + dx, y + across + dy, colour);
          }
      }
  }
}

// Shortens text with a trailing ".." until it fits in max_width pixels.
std::string fit_text(std::string text, int scale, int max_width) {
  if (text_width(text, scale) <= max_width) return text;
  while (!text.empty() && text_width(text + "..", scale) > max_width) text.pop_back();
  return text.empty() ? text : text + "..";
}

// Anti-aliasing coverage of one series over the inner plot area, combined by maximum: where a
// polyline's segments overlap at a joint the pixel keeps the larger coverage instead of being
// blended twice.
struct Mask {
  int x0, y0, w, h;  // the area on the canvas
  std::vector<float> a;

  Mask(int left, int top, int width, int height)
      : x0(left), y0(top), w(width), h(height), a(static_cast<size_t>(width) * static_cast<size_t>(height), 0.0f) {}
  void clear() { std::fill(a.begin(), a.end(), 0.0f); }
  float& at(int x, int y) {
    return a[static_cast<size_t>(y - y0) * static_cast<size_t>(w) + static_cast<size_t>(x - x0)];
  }
  bool inside(int x, int y) const { return x >= x0 && y >= y0 && x < x0 + w && y < y0 + h; }
  void cover(int x, int y, float c) {
    if (c > 0 && inside(x, y)) at(x, y) = std::max(at(x, y), std::min(c, 1.0f));
  }
};

double distance_to_segment(double px, double py, double ax, double ay, double bx, double by) {
  const double dx = bx - ax, dy = by - ay, len2 = dx * dx + dy * dy;
  double t = len2 > 0 ? ((px - ax) * dx + (py - ay) * dy) / len2 : 0.0;
  t = std::clamp(t, 0.0, 1.0);
  // Pixel distances cannot overflow, so a plain sqrt does (std::hypot's care costs ~3x here).
  const double ex = px - (ax + t * dx), ey = py - (ay + t * dy);
  return std::sqrt(ex * ex + ey * ey);
}

// A segment of half-width hw (canvas coordinates, pixel centres at +0.5). Coverage falls from 1 to
// 0 over the pixel-wide band around the segment's edge: a cheap box-filter approximation.
// Only pixels that can be within reach are visited: walking along the major axis, a pixel within
// r = hw + 0.5 of the segment lies within 2r of the segment's point at the clamped walk position
// (the clamp is 1-Lipschitz and the slope is at most 1), so each step looks at 4r + 3 pixels.
void stamp_segment(Mask& m, double ax, double ay, double bx, double by, double hw) {
  const double r = hw + 0.5;
  const bool shallow = std::abs(bx - ax) >= std::abs(by - ay);
  // Walk along u (the major axis), look across v.
  double au = shallow ? ax : ay, av = shallow ? ay : ax, bu = shallow ? bx : by, bv = shallow ? by : bx;
  if (au > bu) {
    std::swap(au, bu);
    std::swap(av, bv);
  }
  const int u_lo_limit = shallow ? m.x0 : m.y0, u_hi_limit = shallow ? m.x0 + m.w : m.y0 + m.h;
  const int u_first = std::max(static_cast<int>(std::floor(au - r)), u_lo_limit);
  const int u_last = std::min(static_cast<int>(std::floor(bu + r)), u_hi_limit - 1);
  const double du = bu - au, dv = bv - av;
  for (int u = u_first; u <= u_last; ++u) {
    const double t = du > 0 ? std::clamp((u + 0.5 - au) / du, 0.0, 1.0) : 0.0;
    const double vc = av + t * dv;
    const int v_first = static_cast<int>(std::floor(vc - 2 * r - 1));
    const int v_last = static_cast<int>(std::floor(vc + 2 * r + 1));
    for (int v = v_first; v <= v_last; ++v) {
      const int x = shallow ? u : v, y = shallow ? v : u;
      if (!m.inside(x, y)) continue;
      const double d = distance_to_segment(x + 0.5, y + 0.5, ax, ay, bx, by);
      m.cover(x, y, static_cast<float>(hw + 0.5 - d));
    }
  }
}

void stamp_disc(Mask& m, double cx, double cy, double radius) {
  const int x_first = static_cast<int>(std::floor(cx - radius - 1)), x_last = static_cast<int>(std::ceil(cx + radius + 1));
  const int y_first = static_cast<int>(std::floor(cy - radius - 1)), y_last = static_cast<int>(std::ceil(cy + radius + 1));
  for (int y = y_first; y <= y_last; ++y)
    for (int x = x_first; x <= x_last; ++x)
      m.cover(x, y, static_cast<float>(radius + 0.5 - distance_to_segment(x + 0.5, y + 0.5, cx, cy, cx, cy)));
}

struct Point {
  double x, y;
};

// A dense polyline (a loss logged every step, 100k points over 900 px) drawn segment by segment
// costs seconds and paints the same pixels over and over. Consecutive points in one pixel column
// are reduced to the first, the lowest, the highest and the last of them, in their original order
// (the "M4" reduction): the polyline through those reaches the same extremes in every column, so
// the picture differs only in the anti-aliased fringe inside an already solid band (about 10x
// faster at 100k points). Sparse series, one point a column, pass through unchanged.
std::vector<Point> reduce_per_column(const std::vector<Point>& pts) {
  std::vector<Point> out;
  size_t i = 0;
  while (i < pts.size()) {
    const double column = std::floor(pts[i].x);
    size_t j = i, lo = i, hi = i;
    for (; j < pts.size() && std::floor(pts[j].x) == column; ++j) {
      if (pts[j].y < pts[lo].y) lo = j;
      if (pts[j].y > pts[hi].y) hi = j;
    }
    // Indices first, min/max in the order they occurred, last; repeats dropped.
    size_t keep[4] = {i, std::min(lo, hi), std::max(lo, hi), j - 1};
    for (int k = 0; k < 4; ++k)
      if (k == 0 || keep[k] != keep[k - 1]) out.push_back(pts[keep[k]]);
    i = j;
  }
  return out;
}

void composite(Canvas& cv, const Mask& m, uint32_t colour) {
  for (int y = 0; y < m.h; ++y)
    for (int x = 0; x < m.w; ++x) {
      const float a = m.a[static_cast<size_t>(y) * static_cast<size_t>(m.w) + static_cast<size_t>(x)];
      if (a > 0) cv.blend(m.x0 + x, m.y0 + y, colour, a);
    }
}

// ---- numbers -----------------------------------------------------------------------------------

// m * 10^k, computed as a division for negative k so that e.g. 3 x 10^-1 is the double nearest
// 0.3 rather than 3 * 0.1 = 0.30000000000000004.
double times_pow10(double m, int k) { return k >= 0 ? m * std::pow(10.0, k) : m / std::pow(10.0, -k); }

// floor(log10(a)) for a > 0, corrected where log10 rounds across an integer (log10(1e-4) may come
// out as -4.0000000000000001 or 1e15 as 14.999999999999998).
int decade_of(double a) {
  int e = static_cast<int>(std::floor(std::log10(a)));
  if (times_pow10(1, e) > a) --e;
  if (times_pow10(1, e + 1) <= a) ++e;
  return e;
}

std::string trim_zeros(std::string s) {
  if (s.find('.') == std::string::npos) return s;
  while (s.back() == '0') s.pop_back();
  if (s.back() == '.') s.pop_back();
  return s;
}

// Decimals needed to show multiples of `step` in units of `unit`.
int decimals_for(double step, double unit) {
  return std::clamp(static_cast<int>(std::ceil(std::log10(unit / step) - 1e-9)), 0, 12);
}

struct SiUnit {
  double scale;
  const char* suffix;
};
constexpr SiUnit kSiUnits[] = {{1e12, "T"}, {1e9, "G"}, {1e6, "M"}, {1e3, "k"}, {1, ""}};

const SiUnit& si_unit_for(double a) {
  for (const SiUnit& u : kSiUnits)
    if (a >= u.scale) return u;
  return kSiUnits[4];
}

// ---- layout ------------------------------------------------------------------------------------

struct Axis {
  double lo = 0, hi = 1;  // the data range mapped onto the pixel range, y already log10 for log_y
  double p_lo = 0, p_hi = 1;  // canvas coordinates of lo and hi
  double to_pixel(double v) const { return p_lo + (v - lo) / (hi - lo) * (p_hi - p_lo); }
  double to_data(double p) const { return lo + (p - p_lo) / (p_hi - p_lo) * (hi - lo); }
};

// Widens an empty (or numerically empty) range: a constant series gets 5% of its value on each
// side, a constant zero +-1.
void widen_if_empty(double& lo, double& hi) {
  const double mag = std::max(std::abs(lo), std::abs(hi));
  if (hi - lo > 1e-9 * mag && hi > lo) return;
  const double centre = 0.5 * (lo + hi), half = centre == 0 ? 1.0 : 0.05 * std::abs(centre);
  lo = centre - half;
  hi = centre + half;
}

bool drawable(double x, double y, bool log_y) {
  return std::isfinite(x) && std::isfinite(y) && (!log_y || y > 0);
}

void validate(const std::vector<Series>& series, const ChartOptions& opt, const std::string& what) {
  if (opt.width < 200 || opt.height < 150 || opt.width > 16384 || opt.height > 16384)
    fail(fmt::format("{}: size {}x{} is outside 200x150..16384x16384", what, opt.width, opt.height),
         "set ChartOptions width and height within those bounds");
  for (const Series& s : series)
    if (s.x.size() != s.y.size())
      fail(fmt::format("{}: series '{}' has {} x values but {} y values", what, s.label, s.x.size(), s.y.size()),
           "give every point both coordinates (use NaN for a missing y)");
}

ChartImage render(const std::vector<Series>& series, const ChartOptions& opt, const std::string& what) {
  const int W = opt.width, H = opt.height;
  // Everything scales by whole pixels so the bitmap font stays crisp: 1 up to 1919x1079, 2 from
  // 1920x1080, and so on.
  const int s = std::max(1, std::min(W / 960, H / 540));
  const int text_h = kGlyphRows * s, cap_h = kCapRows * s, title_scale = 2 * s;
  const int tick_len = 5 * s, gap = 4 * s;

  // Data ranges over the drawable points, in plotted coordinates (log10 y for a log axis).
  const auto ty = [&](double y) { return opt.log_y ? std::log10(y) : y; };
  double x_lo = INFINITY, x_hi = -INFINITY, y_lo = INFINITY, y_hi = -INFINITY;
  for (const Series& sr : series)
    for (size_t i = 0; i < sr.x.size(); ++i)
      if (drawable(sr.x[i], sr.y[i], opt.log_y)) {
        x_lo = std::min(x_lo, sr.x[i]);
        x_hi = std::max(x_hi, sr.x[i]);
        y_lo = std::min(y_lo, ty(sr.y[i]));
        y_hi = std::max(y_hi, ty(sr.y[i]));
      }
  if (!(x_lo <= x_hi)) {  // nothing drawable: an empty chart with a unit range
    x_lo = 0, x_hi = 1, y_lo = 0, y_hi = 1;
  }
  if (!std::isfinite(x_hi - x_lo) || !std::isfinite(y_hi - y_lo))
    fail(fmt::format("{}: the data range overflows a double (values near +-1.8e308)", what),
         "scale the values before plotting");
  widen_if_empty(x_lo, x_hi);
  widen_if_empty(y_lo, y_hi);
  // Headroom above and below the data so the curve never runs along the frame.
  const double y_pad = 0.05 * (y_hi - y_lo);
  y_lo -= y_pad;
  y_hi += y_pad;

  // Vertical layout: title, plot, tick labels, x-axis label.
  const int top = opt.title.empty() ? 12 * s : 10 * s + kGlyphRows * title_scale + 8 * s;
  const int bottom = tick_len + gap + text_h + (opt.x_label.empty() ? 0 : 6 * s + text_h) + 8 * s;
  // The frame is drawn on rows `frame_top` and `frame_bottom`; the data area is between them.
  const int frame_top = top, frame_bottom = H - 1 - bottom;
  Axis ya;
  ya.lo = y_lo, ya.hi = y_hi;
  ya.p_lo = frame_bottom, ya.p_hi = frame_top + 1;

  // Y ticks about every 40 px; labels need their cap height plus a little between neighbours.
  std::vector<double> y_ticks;
  std::vector<std::string> y_labels;
  for (int count = std::max(2, (frame_bottom - frame_top) / (40 * s));; --count) {
    y_ticks = opt.log_y ? log_ticks(std::pow(10.0, y_lo), std::pow(10.0, y_hi), count) : nice_ticks(y_lo, y_hi, count);
    bool crowded = false;
    for (size_t i = 1; i < y_ticks.size(); ++i)
      if (std::abs(ya.to_pixel(ty(y_ticks[i])) - ya.to_pixel(ty(y_ticks[i - 1]))) < cap_h + 6 * s) crowded = true;
    if (!crowded || count <= 2) break;
  }
  y_labels = format_tick_labels(y_ticks);
  int y_label_w = 0;
  for (const std::string& l : y_labels) y_label_w = std::max(y_label_w, text_width(l, s));

  // Horizontal layout: y-axis label, tick labels, plot, a right margin that the last x tick label
  // may reach into (labels are kept on the canvas below).
  const int left = 8 * s + (opt.y_label.empty() ? 0 : text_h + 8 * s) + y_label_w + gap + tick_len;
  const int frame_left = left, frame_right = W - 1 - 24 * s;
  if (frame_right - frame_left < 40 * s || frame_bottom - frame_top < 40 * s)
    fail(fmt::format("{}: {}x{} leaves no room for the plot after the labels", what, W, H),
         "make the chart larger or the tick labels shorter");
  // A few pixels of air between the frame and the first and last x, so markers there are whole.
  const double x_air = 8.0 * s;
  Axis xa;
  xa.lo = x_lo, xa.hi = x_hi;
  xa.p_lo = frame_left + 1 + x_air, xa.p_hi = frame_right - x_air;

  // X ticks: start at one per ~90 px and drop one at a time until neighbouring labels are apart.
  std::vector<double> x_ticks;
  std::vector<std::string> x_labels;
  const double x_vis_lo = xa.to_data(frame_left + 1), x_vis_hi = xa.to_data(frame_right);
  for (int count = std::max(2, (frame_right - frame_left) / (90 * s));; --count) {
    x_ticks = nice_ticks(x_vis_lo, x_vis_hi, count);
    x_labels = format_tick_labels(x_ticks);
    bool crowded = false;
    for (size_t i = 1; i < x_ticks.size(); ++i) {
      const double apart = xa.to_pixel(x_ticks[i]) - xa.to_pixel(x_ticks[i - 1]);
      if (apart < 0.5 * (text_width(x_labels[i], s) + text_width(x_labels[i - 1], s)) + 14 * s) crowded = true;
    }
    if (!crowded || count <= 2) break;
  }

  Canvas cv(W, H);
  const int in_x0 = frame_left + 1, in_y0 = frame_top + 1;
  const int in_w = frame_right - frame_left - 1, in_h = frame_bottom - frame_top - 1;

  // Grid first, under the data.
  std::vector<int> y_rows, x_cols;
  for (double t : y_ticks) y_rows.push_back(static_cast<int>(std::floor(ya.to_pixel(ty(t)))));
  for (double t : x_ticks) x_cols.push_back(static_cast<int>(std::floor(xa.to_pixel(t))));
  for (int r : y_rows)
    if (r > frame_top && r < frame_bottom) cv.fill(in_x0, r, in_x0 + in_w, r + s, kGridColour);
  for (int c : x_cols)
    if (c > frame_left && c < frame_right) cv.fill(c, in_y0, c + s, in_y0 + in_h, kGridColour);

  // Series, each through its own coverage mask. `ink` remembers where any series drew, for
  // placing the legend.
  Mask line(in_x0, in_y0, in_w, in_h), rim(in_x0, in_y0, in_w, in_h), dot(in_x0, in_y0, in_w, in_h);
  std::vector<uint8_t> ink(static_cast<size_t>(in_w) * static_cast<size_t>(in_h), 0);
  const double half_width = 1.0 * s, marker_r = 3.5 * s;
  for (const Series& sr : series) {
    line.clear();
    rim.clear();
    dot.clear();
    const size_t n = sr.x.size();
    // Each run of drawable points between gaps becomes one polyline.
    std::vector<Point> run;
    for (size_t i = 0; i <= n; ++i) {
      if (i < n && drawable(sr.x[i], sr.y[i], opt.log_y)) {
        run.push_back({xa.to_pixel(sr.x[i]), ya.to_pixel(ty(sr.y[i]))});
        continue;
      }
      if (run.size() == 1) {
        // An isolated point (between gaps, or a one-point series) has no segment: a dot the
        // line's width keeps it visible.
        stamp_disc(line, run[0].x, run[0].y, half_width + 0.5 * s);
      } else if (run.size() > 1) {
        const std::vector<Point> pts = reduce_per_column(run);
        for (size_t j = 0; j + 1 < pts.size(); ++j) stamp_segment(line, pts[j].x, pts[j].y, pts[j + 1].x, pts[j + 1].y, half_width);
      }
      if (sr.markers)
        for (const Point& p : run) {
          stamp_disc(rim, p.x, p.y, marker_r + 1.25 * s);
          stamp_disc(dot, p.x, p.y, marker_r);
        }
      run.clear();
    }
    composite(cv, line, sr.rgb);
    if (sr.markers) {
      composite(cv, rim, kWhite);
      composite(cv, dot, sr.rgb);
    }
    for (size_t i = 0; i < ink.size(); ++i)
      if (line.a[i] > 0.25f || rim.a[i] > 0.25f) ink[i] = 1;
  }

  // Frame, tick marks and tick labels.
  cv.fill(frame_left, frame_top, frame_right + 1, frame_top + s, kFrameColour);
  cv.fill(frame_left, frame_bottom - s + 1, frame_right + 1, frame_bottom + 1, kFrameColour);
  cv.fill(frame_left, frame_top, frame_left + s, frame_bottom + 1, kFrameColour);
  cv.fill(frame_right - s + 1, frame_top, frame_right + 1, frame_bottom + 1, kFrameColour);
  for (size_t i = 0; i < y_ticks.size(); ++i) {
    const int r = y_rows[i];
    if (r < frame_top || r > frame_bottom) continue;
    cv.fill(frame_left - tick_len, r, frame_left, r + s, kFrameColour);
    const int lx = frame_left - tick_len - gap - text_width(y_labels[i], s);
    const int ly = std::clamp(r - cap_h / 2, 0, H - text_h);
    draw_text(cv, lx, ly, y_labels[i], s, kTextColour);
  }
  for (size_t i = 0; i < x_ticks.size(); ++i) {
    const int c = x_cols[i];
    if (c < frame_left || c > frame_right) continue;
    cv.fill(c, frame_bottom + 1, c + s, frame_bottom + 1 + tick_len, kFrameColour);
    const int w = text_width(x_labels[i], s);
    const int lx = std::clamp(c - w / 2, 0, W - w);
    draw_text(cv, lx, frame_bottom + 1 + tick_len + gap, x_labels[i], s, kTextColour);
  }

  // Legend: the labelled series, in the inside corner with the least ink under it (top right
  // first: loss curves start high on the left and flatten low on the right).
  std::vector<const Series*> entries;
  for (const Series& sr : series)
    if (!sr.label.empty()) entries.push_back(&sr);
  if (!entries.empty()) {
    const int pad = 6 * s, sample_w = 24 * s, row_h = text_h + 4 * s, inset = 8 * s;
    const int max_label_w = std::max(10 * s, in_w - 2 * inset - 2 * pad - sample_w - pad);
    std::vector<std::string> texts;
    int label_w = 0;
    for (const Series* e : entries) {
      texts.push_back(fit_text(e->label, s, max_label_w));
      label_w = std::max(label_w, text_width(texts.back(), s));
    }
    const int box_w = pad + sample_w + pad + label_w + pad;
    const int box_h = std::min(pad * 2 + static_cast<int>(entries.size()) * row_h - 4 * s, in_h - 2 * inset);
    const int xs[2] = {in_x0 + in_w - inset - box_w, in_x0 + inset};
    const int ys[2] = {in_y0 + inset, in_y0 + in_h - inset - box_h};
    int best_x = xs[0], best_y = ys[0];
    long best_ink = -1;
    for (int yi = 0; yi < 2; ++yi)
      for (int xi = 0; xi < 2; ++xi) {
        long count = 0;
        for (int y = std::max(ys[yi], in_y0); y < std::min(ys[yi] + box_h, in_y0 + in_h); ++y)
          for (int x = std::max(xs[xi], in_x0); x < std::min(xs[xi] + box_w, in_x0 + in_w); ++x)
            count += ink[static_cast<size_t>(y - in_y0) * static_cast<size_t>(in_w) + static_cast<size_t>(x - in_x0)];
        if (best_ink < 0 || count < best_ink) {
          best_ink = count;
          best_x = xs[xi];
          best_y = ys[yi];
        }
      }
    cv.fill(best_x, best_y, best_x + box_w, best_y + box_h, kLegendBorder);
    cv.fill(best_x + s, best_y + s, best_x + box_w - s, best_y + box_h - s, kWhite);
    Mask sample(best_x, best_y, box_w, box_h), sample_rim(best_x, best_y, box_w, box_h),
        sample_dot(best_x, best_y, box_w, box_h);
    for (size_t i = 0; i < entries.size(); ++i) {
      const int row_top = best_y + pad + static_cast<int>(i) * row_h;
      if (row_top + cap_h > best_y + box_h) break;  // more entries than fit in the plot
      // On a pixel boundary, so the 2 px sample line is two full rows rather than one full and two
      // half-covered ones.
      const double mid = row_top + (cap_h + s) / 2;
      sample.clear();
      sample_rim.clear();
      sample_dot.clear();
      stamp_segment(sample, best_x + pad, mid, best_x + pad + sample_w, mid, half_width);
      composite(cv, sample, entries[i]->rgb);
      if (entries[i]->markers) {
        stamp_disc(sample_rim, best_x + pad + 0.5 * sample_w, mid, marker_r + 1.25 * s);
        stamp_disc(sample_dot, best_x + pad + 0.5 * sample_w, mid, marker_r);
        composite(cv, sample_rim, kWhite);
        composite(cv, sample_dot, entries[i]->rgb);
      }
      draw_text(cv, best_x + pad + sample_w + pad, row_top, texts[i], s, kTextColour);
    }
  }

  // Title over the plot, axis labels centred on their axes.
  const int plot_mid_x = (frame_left + frame_right) / 2, plot_mid_y = (frame_top + frame_bottom) / 2;
  if (!opt.title.empty()) {
    const std::string t = fit_text(opt.title, title_scale, W - 16 * s);
    const int w = text_width(t, title_scale);
    draw_text(cv, std::clamp(plot_mid_x - w / 2, 8 * s, std::max(8 * s, W - 8 * s - w)), 10 * s, t, title_scale,
              kTextColour);
  }
  if (!opt.x_label.empty()) {
    const std::string t = fit_text(opt.x_label, s, W - 16 * s);
    const int w = text_width(t, s);
    draw_text(cv, std::clamp(plot_mid_x - w / 2, 8 * s, std::max(8 * s, W - 8 * s - w)),
              frame_bottom + 1 + tick_len + gap + text_h + 6 * s, t, s, kTextColour);
  }
  if (!opt.y_label.empty()) {
    const std::string t = fit_text(opt.y_label, s, H - 16 * s);
    const int w = text_width(t, s);
    draw_text(cv, 8 * s, std::clamp(plot_mid_y + w / 2, 8 * s + w, H - 8 * s), t, s, kTextColour, /*vertical=*/true);
  }

  return ChartImage{W, H, std::move(cv.rgb)};
}

}  // namespace

// ---- public API ----------------------------------------------------------------------------------

std::vector<double> nice_ticks(double lo, double hi, int max_count) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) return {};
  if (lo > hi) std::swap(lo, hi);
  max_count = std::max(max_count, 2);
  const double span = hi - lo;
  if (span <= 0) return {lo};
  if (!std::isfinite(span)) return {};
  // Start a decade below the step that would give max_count ticks and walk up 1, 2, 5, 10, ...:
  // the first step that fits is the finest that does.
  for (int k = decade_of(span / max_count) - 1; k < 400; ++k)
    for (const int m : {1, 2, 5}) {
      const double step = times_pow10(m, k);
      // The tolerance keeps a bound that is itself a multiple (0.3 / 0.1 = 2.9999999999999996).
      const double first = std::ceil(lo / step - 1e-9), last = std::floor(hi / step + 1e-9);
      if (last - first + 1 > max_count) continue;
      std::vector<double> ticks;
      for (double i = first; i <= last; ++i) {
        const double t = times_pow10(i * m, k);
        ticks.push_back(std::abs(t) < 1e-9 * step ? 0.0 : t);
      }
      return ticks;
    }
  return {};
}

std::vector<double> log_ticks(double lo, double hi, int max_count) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) return {};
  if (lo > hi) std::swap(lo, hi);
  if (lo <= 0) return nice_ticks(lo, hi, max_count);
  max_count = std::max(max_count, 2);
  const int e_lo = decade_of(lo), e_hi = decade_of(hi);
  const auto in_range = [&](double v) { return v >= lo * (1 - 1e-9) && v <= hi * (1 + 1e-9); };
  static const std::vector<int> kMantissas[] = {{1}, {1, 2, 5}, {1, 2, 3, 4, 5, 6, 7, 8, 9}};
  std::vector<double> best;
  for (const std::vector<int>& mantissas : kMantissas) {
    std::vector<double> ticks;
    for (int e = e_lo; e <= e_hi; ++e)
      for (const int m : mantissas)
        if (in_range(times_pow10(m, e))) ticks.push_back(times_pow10(m, e));
    if (static_cast<int>(ticks.size()) > max_count) {
      if (!best.empty()) break;
      // Even the powers of ten alone are too many: keep every n-th decade.
      for (int every = 2;; ++every) {
        std::vector<double> thinned;
        for (int e = e_lo; e <= e_hi; ++e)
          if (((e % every) + every) % every == 0 && in_range(times_pow10(1, e))) thinned.push_back(times_pow10(1, e));
        if (static_cast<int>(thinned.size()) <= max_count && !thinned.empty()) return thinned;
        if (every > e_hi - e_lo + 1) return thinned;
      }
    }
    best = std::move(ticks);
    if (best.size() >= 3) break;
  }
  if (best.size() < 2) return nice_ticks(lo, hi, max_count);  // less than a factor of ~1.3 apart
  return best;
}

std::string format_compact(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (v == 0) return "0";
  // Near the bottom of the double range 10^(2 - e) overflows; such values only need to be legible.
  if (std::abs(v) < 1e-290) return fmt::format("{:.2g}", v);
  // Round to three significant digits first, so 999999 becomes "1M" and not "1000k".
  const int e0 = decade_of(std::abs(v));
  const double r = times_pow10(std::round(times_pow10(v, 2 - e0)), e0 - 2);
  const double a = std::abs(r);
  if (a >= 1e-3 && a < 1e15) {
    const SiUnit& u = si_unit_for(a);
    const double m = r / u.scale;
    const int decimals = std::max(0, 2 - decade_of(std::abs(m)));
    return trim_zeros(fmt::format("{:.{}f}", m, decimals)) + u.suffix;
  }
  const int e = decade_of(a);
  return fmt::format("{}e{}", trim_zeros(fmt::format("{:.2f}", times_pow10(r, -e))), e);
}

std::vector<std::string> format_tick_labels(const std::vector<double>& ticks) {
  std::vector<std::string> labels;
  if (ticks.size() < 2) {
    for (double t : ticks) labels.push_back(format_compact(t));
    return labels;
  }
  double step_min = INFINITY, step_max = 0, max_abs = 0;
  for (size_t i = 0; i < ticks.size(); ++i) {
    max_abs = std::max(max_abs, std::abs(ticks[i]));
    if (i == 0) continue;
    const double d = std::abs(ticks[i] - ticks[i - 1]);
    step_min = std::min(step_min, d);
    step_max = std::max(step_max, d);
  }
  if (!(step_min > 0) || step_max > step_min * 1.001) {  // log ticks: each stands alone
    for (double t : ticks) labels.push_back(format_compact(t));
    return labels;
  }
  const double step = step_min;
  // Tiny or huge magnitudes read best in scientific notation, all of them alike.
  const bool scientific = max_abs < 1e-2 || max_abs >= 1e15;
  for (double t : ticks) {
    const double a = std::abs(t);
    if (t == 0 && (scientific || max_abs >= 1e3)) {
      labels.push_back("0");  // "0.0M" would read oddly beside 500k and 1M
    } else if (scientific) {
      const int e = decade_of(a);
      labels.push_back(fmt::format("{}e{}", trim_zeros(fmt::format("{:.{}f}", times_pow10(t, -e), decimals_for(step, times_pow10(1, e)))), e));
    } else if (a >= 1e3) {
      const SiUnit& u = si_unit_for(a);
      labels.push_back(trim_zeros(fmt::format("{:.{}f}", t / u.scale, decimals_for(step, u.scale))) + u.suffix);
    } else {
      labels.push_back(fmt::format("{:.{}f}", t, decimals_for(step, 1)));
    }
  }
  return labels;
}

uint32_t chart_palette(size_t i) {
  static constexpr uint32_t kColours[] = {0x1F77B4, 0xFF7F0E, 0x2CA02C, 0xD62728,
                                          0x9467BD, 0x8C564B, 0xE377C2, 0x17BECF};
  return kColours[i % 8];
}

bool png_output_available() { return CW_HAVE_PNG != 0; }

ChartImage render_line_chart(const std::vector<Series>& series, const ChartOptions& opt) {
  validate(series, opt, "line chart");
  return render(series, opt, "line chart");
}

void write_line_chart(const std::string& png_path, const std::vector<Series>& series, const ChartOptions& opt) {
  const std::string what = fmt::format("chart {}", png_path);
  validate(series, opt, what);
#if CW_HAVE_PNG
  namespace fs = std::filesystem;
  const fs::path parent = fs::path(png_path).parent_path();
  std::error_code ec;
  if (!parent.empty() && !fs::is_directory(parent, ec))
    fail(fmt::format("cannot write {}: directory {} does not exist", what, parent.string()),
         "create the directory first or choose another path");
  const ChartImage img = render(series, opt, what);
  const std::string tmp = fmt::format("{}.tmp-{}", png_path, static_cast<long>(::getpid()));
  // The simplified API reports errors through image.message instead of longjmp, so no setjmp
  // frame has to be kept clear of C++ objects.
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  image.width = static_cast<png_uint_32>(img.width);
  image.height = static_cast<png_uint_32>(img.height);
  image.format = PNG_FORMAT_RGB;
  if (!png_image_write_to_file(&image, tmp.c_str(), 0, img.rgb.data(), 0, nullptr)) {
    const std::string message = image.message;
    png_image_free(&image);
    fs::remove(tmp, ec);
    fail(fmt::format("cannot write {}: libpng: {}", what, message), "check that the directory is writable and has space");
  }
  png_image_free(&image);
  fs::rename(tmp, png_path, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    fail(fmt::format("cannot write {}: renaming {} over it failed: {}", what, tmp, ec.message()),
         "check that the path is not a directory and the directory is writable");
  }
#else
  (void)series;
  (void)opt;
  fail(fmt::format("cannot write {}: this build has no PNG output (chunkwise was built without libpng)", what),
       "install libpng-dev (apt-get install libpng-dev) and reconfigure the build");
#endif
}

}  // namespace cw
