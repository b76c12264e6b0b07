// Line charts to SVG: see plot.h for what is drawn and the data rules.
#include "tools/plot.h"

#include "engine/error.h"
#include "tools/train/run_dir.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <limits>
#include <optional>
#include <utility>

namespace cw {

namespace {

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

constexpr double kLeft = 78, kRight = 24, kGap = 16, kBottom = 52;  // margins around the plot areas
constexpr double kCharWidth = 6.6;                                   // of 12 px sans-serif, roughly

// Maps [lo, hi] onto pixels [p_lo, p_hi] (p_hi < p_lo for a y axis, which grows upwards).
struct Axis {
  double lo = 0, hi = 1, p_lo = 0, p_hi = 1;
  double operator()(double v) const { return p_lo + (v - lo) / (hi - lo) * (p_hi - p_lo); }
};

// Widens an empty (or numerically empty) range: a constant gets 5% of its value on each side, a
// constant zero +-1; no data at all gives [0, 1].
void widen_if_empty(double& lo, double& hi) {
  if (lo > hi) {
    lo = 0;
    hi = 1;
    return;
  }
  const double mag = std::max(std::abs(lo), std::abs(hi));
  if (hi - lo > 1e-9 * mag) return;
  const double centre = 0.5 * (lo + hi), half = centre == 0 ? 1.0 : 0.05 * std::abs(centre);
  lo = centre - half;
  hi = centre + half;
}

// nice_ticks for an axis of `pixels` length, a tick per `spacing` pixels or so, but at least two
// ticks, so that the axis' scale can be read off it.
std::vector<double> axis_ticks(double lo, double hi, double pixels, double spacing) {
  std::vector<double> t;
  for (int n = std::max(2, static_cast<int>(pixels / spacing)); t.size() < 2 && n <= 50; ++n) t = nice_ticks(lo, hi, n);
  return t;
}

bool finite(double x, double y) { return std::isfinite(x) && std::isfinite(y); }

std::string escape(const std::string& text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

using Point = std::pair<double, double>;  // pixels

// Keeps at most the first, lowest, highest and last point of each pixel column, in order.
std::vector<Point> thin(const std::vector<Point>& run) {
  std::vector<Point> out;
  for (size_t i = 0; i < run.size();) {
    size_t j = i, lo = i, hi = i;
    for (; j < run.size() && std::floor(run[j].first) == std::floor(run[i].first); ++j) {
      if (run[j].second < run[lo].second) lo = j;
      if (run[j].second > run[hi].second) hi = j;
    }
    std::array<size_t, 4> keep{i, lo, hi, j - 1};
    std::sort(keep.begin(), keep.end());
    for (size_t k = 0; k < 4; ++k)
      if (k == 0 || keep[k] != keep[k - 1]) out.push_back(run[keep[k]]);
    i = j;
  }
  return out;
}

// The finite points of a series in pixels, split into runs at the gaps.
std::vector<std::vector<Point>> runs_of(const Series& s, const Axis& ax, const Axis& ay, double plot_width) {
  std::vector<std::vector<Point>> runs(1);
  for (size_t i = 0; i < s.x.size(); ++i) {
    if (finite(s.x[i], s.y[i])) {
      runs.back().emplace_back(ax(s.x[i]), ay(s.y[i]));
    } else if (!runs.back().empty()) {
      runs.emplace_back();
    }
  }
  if (runs.back().empty()) runs.pop_back();
  for (auto& run : runs)
    if (static_cast<double>(run.size()) > 4 * plot_width) run = thin(run);
  return runs;
}

std::string colour(uint32_t rgb) { return fmt::format("#{:06x}", rgb & 0xFFFFFF); }

void validate(const Chart& chart) {
  if (chart.panels.empty()) fail("chart: no panels", "give the chart at least one Panel");
  if (chart.width < 300 || chart.width > 16384)
    fail(fmt::format("chart: width {} is outside 300..16384", chart.width), "set Chart::width within those bounds");
  for (const Panel& p : chart.panels) {
    if (p.height < 80 || p.height > 4096)
      fail(fmt::format("chart: panel '{}' height {} is outside 80..4096", p.y_label, p.height),
           "set Panel::height within those bounds");
    for (const Series& s : p.series)
      if (s.x.size() != s.y.size())
        fail(fmt::format("chart: series '{}' has {} x values but {} y values", s.label, s.x.size(), s.y.size()),
             "give every point both coordinates (use NaN for a missing y)");
  }
}

// The labels of the x ticks, centred under them at height y.
std::string x_tick_labels(const Axis& ax, const std::vector<double>& ticks, const std::vector<std::string>& labels,
                          double y) {
  std::string svg;
  for (size_t i = 0; i < ticks.size(); ++i)
    svg += fmt::format("<text class=\"xtick\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>\n", ax(ticks[i]),
                       y, escape(labels[i]));
  return svg;
}

// One panel: grid, frame, y ticks, series, legend; x tick labels when it is the bottom one.
void render_panel(std::string& svg, const Panel& panel, const Axis& ax, double top, bool bottom,
                  const std::vector<XTick>& given_x_ticks) {
  const double left = ax.p_lo, right = ax.p_hi, width = right - left, height = panel.height;
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (const Series& s : panel.series)
    for (size_t i = 0; i < s.x.size(); ++i)
      if (finite(s.x[i], s.y[i])) lo = std::min(lo, s.y[i]), hi = std::max(hi, s.y[i]);
  const bool empty = lo > hi;
  if (panel.y_from_zero && !empty) lo = std::min(lo, 0.0), hi = std::max(hi, 0.0);
  widen_if_empty(lo, hi);
  const double pad = 0.04 * (hi - lo);
  const Axis ay{lo - pad, hi + pad, top + height, top};

  svg += "<g class=\"panel\">\n";
  std::vector<double> xt;
  for (const XTick& t : given_x_ticks) xt.push_back(t.x);
  if (given_x_ticks.empty()) xt = axis_ticks(ax.lo, ax.hi, width, 90);
  const std::vector<double> yt = axis_ticks(ay.lo, ay.hi, height, 40);
  std::string grid, marks;
  for (double t : xt) {
    grid += fmt::format("M{:.1f} {:.1f}V{:.1f}", ax(t), top, top + height);
    if (bottom) marks += fmt::format("M{:.1f} {:.1f}v5", ax(t), top + height);
  }
  for (double t : yt) {
    grid += fmt::format("M{:.1f} {:.1f}H{:.1f}", left, ay(t), right);
    marks += fmt::format("M{:.1f} {:.1f}h-5", left, ay(t));
  }
  svg += fmt::format("<path d=\"{}\" stroke=\"#e4e4e4\"/>\n<path d=\"{}\" stroke=\"#444\"/>\n", grid, marks);
  const std::vector<std::string> yl = format_tick_labels(yt);
  for (size_t i = 0; i < yt.size(); ++i)
    svg += fmt::format("<text class=\"ytick\" x=\"{:.1f}\" y=\"{:.1f}\" dy=\"0.35em\" text-anchor=\"end\">{}</text>\n",
                       left - 8, ay(yt[i]), escape(yl[i]));
  if (bottom) {
    std::vector<std::string> xl;
    for (const XTick& t : given_x_ticks) xl.push_back(t.label);
    if (given_x_ticks.empty()) xl = format_tick_labels(xt);
    svg += x_tick_labels(ax, xt, xl, top + height + 20);
  }
  svg += fmt::format("<text class=\"ylabel\" transform=\"translate(16 {:.1f}) rotate(-90)\" dy=\"0.7em\" "
                     "text-anchor=\"middle\">{}</text>\n",
                     top + height / 2, escape(panel.y_label));
  if (empty)
    svg += fmt::format("<text class=\"no-data\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" fill=\"#888\">no data"
                       "</text>\n",
                       left + width / 2, top + height / 2);

  std::vector<Point> ink;  // what the legend should not cover: the points, and along the lines
  for (const Series& s : panel.series) {
    for (const std::vector<Point>& run : runs_of(s, ax, ay, width)) {
      std::string points;
      for (size_t i = 0; i < run.size(); ++i) {
        points += fmt::format("{}{:.1f},{:.1f}", i ? " " : "", run[i].first, run[i].second);
        ink.push_back(run[i]);
        if (i == 0) continue;
        const auto [x0, y0] = run[i - 1];
        const int steps = static_cast<int>(std::hypot(run[i].first - x0, run[i].second - y0) / 6);
        for (int k = 1; k < steps; ++k)
          ink.emplace_back(x0 + (run[i].first - x0) * k / steps, y0 + (run[i].second - y0) * k / steps);
      }
      if (run.size() >= 2)
        svg += fmt::format("<polyline class=\"series\" points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.6\" "
                           "stroke-linejoin=\"round\" stroke-linecap=\"round\"/>\n",
                           points, colour(s.rgb));
      if (run.size() == 1 || s.markers)
        for (const Point& p : run)
          svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3.5\" fill=\"{}\" stroke=\"white\"/>\n", p.first,
                             p.second, colour(s.rgb));
    }
  }
  svg += fmt::format("<rect class=\"frame\" x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"none\" "
                     "stroke=\"#444\"/>\n",
                     left, top, width, height);

  std::vector<const Series*> entries;
  size_t longest = 0;
  for (const Series& s : panel.series)
    if (!s.label.empty()) entries.push_back(&s), longest = std::max(longest, s.label.size());
  if (!entries.empty()) {
    const double w = 44 + kCharWidth * static_cast<double>(longest), h = 8 + 18 * static_cast<double>(entries.size());
    // The inside corner with the fewest points under it; top right first on a tie.
    const std::array<Point, 4> corners{{{right - 8 - w, top + 8},
                                        {left + 8, top + 8},
                                        {right - 8 - w, top + height - 8 - h},
                                        {left + 8, top + height - 8 - h}}};
    Point best = corners[0];
    size_t best_count = std::numeric_limits<size_t>::max();
    for (const Point& c : corners) {
      const size_t n = static_cast<size_t>(std::count_if(ink.begin(), ink.end(), [&](const Point& p) {
        return p.first >= c.first && p.first <= c.first + w && p.second >= c.second && p.second <= c.second + h;
      }));
      if (n < best_count) best = c, best_count = n;
    }
    const auto [x, y] = best;
    svg += fmt::format("<g class=\"legend\">\n<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" "
                       "fill=\"white\" fill-opacity=\"0.85\" stroke=\"#bbb\"/>\n",
                       x, y, w, h);
    for (size_t i = 0; i < entries.size(); ++i) {
      const double cy = y + 13 + 18 * static_cast<double>(i);
      svg += fmt::format("<path d=\"M{:.1f} {:.1f}h22\" stroke=\"{}\" stroke-width=\"2\"/>\n", x + 8, cy,
                         colour(entries[i]->rgb));
      if (entries[i]->markers)
        svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3.5\" fill=\"{}\" stroke=\"white\"/>\n", x + 19, cy,
                           colour(entries[i]->rgb));
      svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" dy=\"0.35em\">{}</text>\n", x + 36, cy,
                         escape(entries[i]->label));
    }
    svg += "</g>\n";
  }
  svg += "</g>\n";
}

// The document's opening, a white background, and the title (if any) centred on title_x.
std::string svg_start(int width, double height, const std::string& title, double title_x) {
  std::string svg = fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1:.0f}\" viewBox=\"0 0 {0} {1:.0f}\" "
      "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" font-size=\"12\" fill=\"#222\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n",
      width, height);
  if (!title.empty())
    svg += fmt::format("<text class=\"title\" x=\"{:.1f}\" y=\"28\" text-anchor=\"middle\" font-size=\"16\" "
                       "font-weight=\"bold\">{}</text>\n",
                       title_x, escape(title));
  return svg;
}

}  // namespace

// ---- charts ------------------------------------------------------------------------------------

std::string render_svg(const Chart& chart) {
  validate(chart);
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (const Panel& p : chart.panels)
    for (const Series& s : p.series)
      for (size_t i = 0; i < s.x.size(); ++i)
        if (finite(s.x[i], s.y[i])) lo = std::min(lo, s.x[i]), hi = std::max(hi, s.x[i]);
  for (const XTick& t : chart.x_ticks)
    if (std::isfinite(t.x)) lo = std::min(lo, t.x), hi = std::max(hi, t.x);
  widen_if_empty(lo, hi);
  const Axis ax{lo, hi, kLeft, chart.width - kRight};

  const double title_height = chart.title.empty() ? 16 : 44;
  double height = title_height + kBottom;
  for (const Panel& p : chart.panels) height += p.height;
  height += kGap * static_cast<double>(chart.panels.size() - 1);

  std::string svg = svg_start(chart.width, height, chart.title, (ax.p_lo + ax.p_hi) / 2);
  double top = title_height;
  for (size_t i = 0; i < chart.panels.size(); ++i) {
    render_panel(svg, chart.panels[i], ax, top, i + 1 == chart.panels.size(), chart.x_ticks);
    top += chart.panels[i].height + kGap;
  }
  svg += fmt::format("<text class=\"xlabel\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>\n</svg>\n",
                     (ax.p_lo + ax.p_hi) / 2, height - 10, escape(chart.x_label));
  return svg;
}

void write_svg(const std::string& path, const Chart& chart) { write_text_atomic(path, render_svg(chart)); }

// ---- stacked bars ------------------------------------------------------------------------------

std::string format_amount(double v) {
  if (!std::isfinite(v)) return fmt::format("{}", v);
  if (v == 0) return "0";
  if (std::abs(v) >= 100) {
    const long long n = std::llround(v);
    const std::string digits = std::to_string(n < 0 ? -n : n);
    std::string out = n < 0 ? "-" : "";
    for (size_t i = 0; i < digits.size(); ++i) {
      if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
      out += digits[i];
    }
    return out;
  }
  return trim_zeros(fmt::format("{:.{}f}", v, std::max(0, 2 - decade_of(std::abs(v)))));
}

namespace {
void validate(const BarChart& chart) {
  if (chart.categories.empty()) fail("bar chart: no categories", "name at least one category");
  if (chart.bars.empty()) fail("bar chart: no bars", "give the chart at least one Bar");
  if (chart.width < 300 || chart.width > 16384)
    fail(fmt::format("bar chart: width {} is outside 300..16384", chart.width), "set BarChart::width within those bounds");
  for (const Bar& b : chart.bars) {
    if (b.values.size() != chart.categories.size())
      fail(fmt::format("bar chart: bar '{}' has {} values for {} categories", b.label, b.values.size(),
                       chart.categories.size()),
           "give every bar one value a category");
    for (size_t i = 0; i < b.values.size(); ++i)
      if (!std::isfinite(b.values[i]) || b.values[i] < 0)
        fail(fmt::format("bar chart: bar '{}' has {} for '{}'", b.label, b.values[i], chart.categories[i]),
             "give finite values >= 0");
  }
}

double text_width(const std::string& text) { return kCharWidth * static_cast<double>(text.size()); }
}  // namespace

std::string render_svg(const BarChart& chart) {
  validate(chart);
  constexpr double kBarHeight = 26, kBarGap = 14, kLegendRow = 20;
  std::vector<double> totals;
  std::vector<std::string> total_labels;
  double longest_label = 0, longest_total = 0, max_total = 0;
  for (const Bar& b : chart.bars) {
    double t = 0;
    for (double v : b.values) t += v;
    totals.push_back(t);
    total_labels.push_back(format_amount(t));
    max_total = std::max(max_total, t);
    longest_label = std::max(longest_label, text_width(b.label));
    longest_total = std::max(longest_total, text_width(total_labels.back()));
  }
  const double width = chart.width;
  const double left = std::clamp(longest_label + 24, kLeft, 0.45 * width);
  const double right = width - kRight - longest_total - 8;
  const Axis ax{0, max_total > 0 ? max_total : 1, left, std::max(right, left + 100)};

  // The legend under the title, its entries left to right, wrapping at the plot's right edge.
  const double title_height = chart.title.empty() ? 16 : 44;
  std::vector<Point> entry_at;
  double x = left, y = title_height;
  for (const std::string& c : chart.categories) {
    const double w = 18 + text_width(c) + 18;
    if (x > left && x + w > ax.p_hi) x = left, y += kLegendRow;
    entry_at.emplace_back(x, y);
    x += w;
  }
  const double top = y + kLegendRow + 6;
  const double plot_height = kBarGap + static_cast<double>(chart.bars.size()) * (kBarHeight + kBarGap);
  const double height = top + plot_height + kBottom;

  std::string svg = svg_start(chart.width, height, chart.title, width / 2);
  svg += "<g class=\"legend\">\n";
  for (size_t i = 0; i < chart.categories.size(); ++i)
    svg += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"12\" height=\"12\" fill=\"{}\"/>\n"
                       "<text x=\"{:.1f}\" y=\"{:.1f}\" dy=\"0.35em\">{}</text>\n",
                       entry_at[i].first, entry_at[i].second + 4, colour(chart_palette(i)), entry_at[i].first + 18,
                       entry_at[i].second + 10, escape(chart.categories[i]));
  svg += "</g>\n";

  // Grid and ticks along x.
  const std::vector<double> xt = axis_ticks(ax.lo, ax.hi, ax.p_hi - ax.p_lo, 90);
  std::string grid, marks;
  for (double t : xt) {
    grid += fmt::format("M{:.1f} {:.1f}V{:.1f}", ax(t), top, top + plot_height);
    marks += fmt::format("M{:.1f} {:.1f}v5", ax(t), top + plot_height);
  }
  svg += fmt::format("<path d=\"{}\" stroke=\"#e4e4e4\"/>\n<path d=\"{}\" stroke=\"#444\"/>\n", grid, marks);
  svg += x_tick_labels(ax, xt, format_tick_labels(xt), top + plot_height + 20);

  for (size_t b = 0; b < chart.bars.size(); ++b) {
    const Bar& bar = chart.bars[b];
    const double y0 = top + kBarGap + static_cast<double>(b) * (kBarHeight + kBarGap), mid = y0 + kBarHeight / 2;
    svg += fmt::format("<text class=\"bar-label\" x=\"{:.1f}\" y=\"{:.1f}\" dy=\"0.35em\" text-anchor=\"end\">{}</text>\n",
                       left - 8, mid, escape(bar.label));
    double at = 0;
    for (size_t c = 0; c < bar.values.size(); ++c) {
      const double v = bar.values[c], x0 = ax(at), w = ax(at + v) - x0;
      at += v;
      if (v == 0) continue;
      const std::string value = format_amount(v);
      svg += fmt::format("<rect class=\"segment\" x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{:.1f}\" "
                         "fill=\"{}\"><title>{}: {}</title></rect>\n",
                         x0, y0, w, kBarHeight, colour(chart_palette(c)), escape(chart.categories[c]), escape(value));
      if (w >= text_width(value) + 8)
        svg += fmt::format("<text class=\"segment-value\" x=\"{:.1f}\" y=\"{:.1f}\" dy=\"0.35em\" "
                           "text-anchor=\"middle\" fill=\"white\">{}</text>\n",
                           x0 + w / 2, mid, escape(value));
    }
    svg += fmt::format("<text class=\"total\" x=\"{:.1f}\" y=\"{:.1f}\" dy=\"0.35em\" font-weight=\"bold\">{}</text>\n",
                       ax(totals[b]) + 6, mid, escape(total_labels[b]));
  }
  svg += fmt::format("<rect class=\"frame\" x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"none\" "
                     "stroke=\"#444\"/>\n",
                     ax.p_lo, top, ax.p_hi - ax.p_lo, plot_height);
  svg += fmt::format("<text class=\"xlabel\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>\n</svg>\n",
                     (ax.p_lo + ax.p_hi) / 2, height - 10, escape(chart.x_label));
  return svg;
}

void write_svg(const std::string& path, const BarChart& chart) { write_text_atomic(path, render_svg(chart)); }

// ---- heat maps ---------------------------------------------------------------------------------

uint32_t heat_colour(double t) {
  constexpr std::array<uint32_t, 3> kStops{0xF8696B, 0xFFEB84, 0x63BE7B};  // light red, yellow, green
  t = std::isfinite(t) ? std::clamp(t, 0.0, 1.0) : 0.0;
  const size_t i = t < 0.5 ? 0 : 1;
  const double f = t < 0.5 ? 2 * t : 2 * t - 1;
  uint32_t rgb = 0;
  for (const int shift : {16, 8, 0}) {
    const double a = (kStops[i] >> shift) & 0xFF, b = (kStops[i + 1] >> shift) & 0xFF;
    rgb |= static_cast<uint32_t>(std::lround(a + (b - a) * f)) << shift;
  }
  return rgb;
}

namespace {
void validate(const HeatMap& map) {
  if (map.columns.empty() || map.rows.empty())
    fail(fmt::format("heat map: {} columns and {} rows", map.columns.size(), map.rows.size()),
         "give at least one column and one row label");
  if (map.width < 300 || map.width > 16384)
    fail(fmt::format("heat map: width {} is outside 300..16384", map.width), "set HeatMap::width within those bounds");
  if (!(std::isfinite(map.lo) && std::isfinite(map.hi) && map.lo < map.hi))
    fail(fmt::format("heat map: the scale [{}, {}] is empty", map.lo, map.hi), "give finite lo < hi");
  if (map.values.size() != map.rows.size())
    fail(fmt::format("heat map: {} rows of values for {} row labels", map.values.size(), map.rows.size()),
         "give one row of values a row label");
  for (size_t r = 0; r < map.values.size(); ++r)
    if (map.values[r].size() != map.columns.size())
      fail(fmt::format("heat map: row '{}' has {} values for {} columns", map.rows[r], map.values[r].size(),
                       map.columns.size()),
           "give every row one value a column");
}
}  // namespace

std::string render_svg(const HeatMap& map) {
  validate(map);
  constexpr double kScaleWidth = 16, kScaleGap = 14, kMaxCellHeight = 60, kMinCellHeight = 24;
  double longest_row = 0;
  for (const std::string& r : map.rows) longest_row = std::max(longest_row, text_width(r));
  const std::string lo_label = format_amount(map.lo) + map.unit, hi_label = format_amount(map.hi) + map.unit;
  const double width = map.width;
  const double left = std::clamp(longest_row + 40, kLeft, 0.4 * width);
  const double right = width - kRight - kScaleGap - kScaleWidth - 8 - std::max(text_width(lo_label), text_width(hi_label));
  const double cell_w = std::max(right - left, 100.0) / static_cast<double>(map.columns.size());
  const double cell_h = std::clamp(cell_w * 0.6, kMinCellHeight, kMaxCellHeight);
  const double title_height = map.title.empty() ? 16 : 44;
  const double top = title_height, grid_h = cell_h * static_cast<double>(map.rows.size());
  const double grid_right = left + cell_w * static_cast<double>(map.columns.size());
  const double height = top + grid_h + kBottom;

  std::string svg = svg_start(map.width, height, map.title, (left + grid_right) / 2);
  for (size_t r = 0; r < map.rows.size(); ++r) {
    const double y = top + cell_h * static_cast<double>(r);
    svg += fmt::format("<text class=\"ytick\" x=\"{:.1f}\" y=\"{:.1f}\" dy=\"0.35em\" text-anchor=\"end\">{}</text>\n",
                       left - 8, y + cell_h / 2, escape(map.rows[r]));
    for (size_t c = 0; c < map.columns.size(); ++c) {
      const double x = left + cell_w * static_cast<double>(c), v = map.values[r][c];
      const bool known = std::isfinite(v);
      const std::string value = known ? format_amount(v) + map.unit : "-";
      svg += fmt::format("<rect class=\"cell\" x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"{}\" "
                         "stroke=\"white\"><title>{}, {}: {}</title></rect>\n",
                         x, y, cell_w, cell_h, known ? colour(heat_colour((v - map.lo) / (map.hi - map.lo))) : "#dddddd",
                         escape(map.rows[r]), escape(map.columns[c]), escape(value));
      if (text_width(value) + 4 <= cell_w)
        svg += fmt::format("<text class=\"cell-value\" x=\"{:.1f}\" y=\"{:.1f}\" dy=\"0.35em\" text-anchor=\"middle\">{}"
                           "</text>\n",
                           x + cell_w / 2, y + cell_h / 2, escape(value));
    }
  }
  for (size_t c = 0; c < map.columns.size(); ++c)
    svg += fmt::format("<text class=\"xtick\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>\n",
                       left + cell_w * (static_cast<double>(c) + 0.5), top + grid_h + 20, escape(map.columns[c]));
  svg += fmt::format("<text class=\"ylabel\" transform=\"translate(16 {:.1f}) rotate(-90)\" dy=\"0.7em\" "
                     "text-anchor=\"middle\">{}</text>\n",
                     top + grid_h / 2, escape(map.y_label));
  // The colour bar: the scale's three stops as a gradient, lo at the foot.
  const double sx = grid_right + kScaleGap;
  svg += fmt::format("<defs><linearGradient id=\"heat-scale\" x1=\"0\" y1=\"1\" x2=\"0\" y2=\"0\">"
                     "<stop offset=\"0\" stop-color=\"{}\"/><stop offset=\"0.5\" stop-color=\"{}\"/>"
                     "<stop offset=\"1\" stop-color=\"{}\"/></linearGradient></defs>\n"
                     "<rect class=\"scale\" x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" "
                     "fill=\"url(#heat-scale)\" stroke=\"#444\"/>\n",
                     colour(heat_colour(0)), colour(heat_colour(0.5)), colour(heat_colour(1)), sx, top, kScaleWidth, grid_h);
  svg += fmt::format("<text class=\"scale-label\" x=\"{:.1f}\" y=\"{:.1f}\" dy=\"0.7em\">{}</text>\n", sx + kScaleWidth + 6,
                     top, escape(hi_label));
  svg += fmt::format("<text class=\"scale-label\" x=\"{:.1f}\" y=\"{:.1f}\">{}</text>\n", sx + kScaleWidth + 6,
                     top + grid_h, escape(lo_label));
  svg += fmt::format("<text class=\"xlabel\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>\n</svg>\n",
                     (left + grid_right) / 2, height - 10, escape(map.x_label));
  return svg;
}

void write_svg(const std::string& path, const HeatMap& map) { write_text_atomic(path, render_svg(map)); }

Chart run_chart(const std::string& metrics_path, const std::string& title) {
  std::ifstream in(metrics_path);
  if (!in) fail(fmt::format("cannot read metrics log '{}'", metrics_path), "check that the run directory exists");
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  // A field as a number: null (how a NaN loss is logged) is NaN, anything else not a number is absent.
  const auto field = [&](const nlohmann::json& r, const char* key) -> std::optional<double> {
    const auto it = r.find(key);
    if (it == r.end() || !(it->is_number() || it->is_null())) return std::nullopt;
    return it->is_null() ? kNaN : it->get<double>();
  };
  Series train{"train loss", {}, {}, chart_palette(0), false}, eval{"eval loss", {}, {}, chart_palette(1), true};
  Series lr{"", {}, {}, chart_palette(2), false}, rss{"", {}, {}, chart_palette(4), false};
  Series device{"device, in use after the step", {}, {}, chart_palette(3), false};
  Series device_peak{"device, peak so far", {}, {}, chart_palette(5), false};
  std::string line;
  while (std::getline(in, line)) {
    const nlohmann::json r = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!r.is_object()) continue;
    const std::optional<double> tokens = field(r, "tokens");
    if (!tokens) continue;
    const auto add = [&](Series& s, const char* key) {
      if (const std::optional<double> v = field(r, key)) s.x.push_back(*tokens), s.y.push_back(*v);
    };
    add(train, "loss");
    add(eval, "eval_loss");
    add(lr, "lr");
    add(rss, "rss_mib");
    add(device, "device_mib");
    add(device_peak, "device_peak_mib");
  }
  Chart chart{title, "tokens seen", {}, 960, {}};
  chart.panels.push_back({"loss (nats per token)", {train}, 320});
  if (!eval.x.empty()) chart.panels[0].series.push_back(eval);
  if (!lr.x.empty()) chart.panels.push_back({"learning rate", {lr}, 130});
  // Memory: the host's RSS, and on a GPU the caching pool's bytes (in use after each step, and the
  // peak so far), in one panel, in GiB once any reaches 1 GiB.
  std::vector<Series> memory;
  for (Series* s : {&rss, &device, &device_peak})
    if (!s->x.empty()) memory.push_back(std::move(*s));
  if (!memory.empty()) {
    double top = 0;
    for (const Series& s : memory)
      for (double v : s.y)
        if (std::isfinite(v)) top = std::max(top, v);
    const bool gib = top >= 1024;
    if (gib)
      for (Series& s : memory)
        for (double& v : s.y) v /= 1024;
    const bool host_only = memory.size() == 1 && memory[0].label.empty();
    if (!host_only && memory[0].label.empty()) memory[0].label = "host (RSS)";
    const std::string unit = gib ? "GiB" : "MiB";
    chart.panels.push_back({(host_only ? "host memory (" : "memory (") + unit + ")", memory, 130, true});
  }
  return chart;
}

uint32_t chart_palette(size_t i) {
  static constexpr uint32_t kColours[] = {0x1F77B4, 0xFF7F0E, 0x2CA02C, 0xD62728,
                                          0x9467BD, 0x8C564B, 0xE377C2, 0x17BECF};
  return kColours[i % 8];
}

// ---- numbers -----------------------------------------------------------------------------------

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
  double step_min = INFINITY, step_max = 0, max_abs = 0;
  for (size_t i = 0; i < ticks.size(); ++i) {
    max_abs = std::max(max_abs, std::abs(ticks[i]));
    if (i == 0) continue;
    const double d = std::abs(ticks[i] - ticks[i - 1]);
    step_min = std::min(step_min, d);
    step_max = std::max(step_max, d);
  }
  if (ticks.size() < 2 || !(step_min > 0) || step_max > step_min * 1.001) {  // nothing to keep consistent
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

}  // namespace cw
