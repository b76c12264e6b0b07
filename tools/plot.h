// Line charts written as PNG: training loss curves (train and eval loss against tokens seen) and
// memory-over-time plots, with no plotting library behind them.
//
// The chart is rasterised here into an RGB buffer (white background, framed plot area, light grid,
// ticks at 1/2/5 x 10^k with compact labels such as 200M / 1.5G, title, axis labels, legend) and
// then encoded with libpng. Text uses a small built-in 5x7 bitmap font (ASCII 32..126; any other
// byte is drawn as '?'), scaled up by whole pixels on large images, so no font files are needed.
// Lines are 2 px wide and anti-aliased by coverage (distance from each pixel centre to the
// segment); each series is rendered into its own coverage mask and composited once, so the joints
// of a polyline are not darkened by blending the same colour twice.
//
// Data rules: points whose x or y is not finite (or, with log_y, whose y is not positive) are
// skipped and break the line there, so a NaN loss shows as a gap. A single point, a constant
// series or no drawable points at all still give a chart (the empty range is widened), never a
// division by zero. Series are drawn in order, the later on top; markers (for the few eval points)
// are discs with a white rim so they stay visible on top of another series' line. The legend,
// listing the series that have a label, goes in the inside corner of the plot with the least ink
// under it.
//
// The PNG is written to `<path>.tmp-<pid>` and renamed over `path`, so a reader (a dashboard
// polling the file during training) never sees a half-written image. Built without libpng
// (CW_HAVE_PNG=0) write_line_chart throws a cw::Error saying so; render_line_chart still works.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace cw {

struct Series {
  std::string label;        // legend text; an empty label keeps the series out of the legend
  std::vector<double> x, y;  // same length; non-finite points are gaps
  uint32_t rgb = 0x1F77B4;   // 0xRRGGBB
  bool markers = false;      // a disc at every point as well as the line
};

struct ChartOptions {
  std::string title, x_label, y_label;
  int width = 960, height = 540;  // pixels; text and lines scale by whole pixels from 1920x1080 up
  bool log_y = false;
};

// An RGB image, 3 bytes a pixel, rows top to bottom.
struct ChartImage {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;
  uint32_t pixel(int x, int y) const {
    const size_t i = (static_cast<size_t>(y) * static_cast<size_t>(width) + static_cast<size_t>(x)) * 3;
    return (uint32_t{rgb[i]} << 16) | (uint32_t{rgb[i + 1]} << 8) | uint32_t{rgb[i + 2]};
  }
};

// Renders the chart and writes it to png_path atomically. Throws cw::Error naming the file on bad
// input (x and y of different lengths, a size outside 200x150..16384x16384), on a write failure,
// and when the build has no libpng.
void write_line_chart(const std::string& png_path, const std::vector<Series>& series, const ChartOptions& opt);

// The chart as pixels, exactly what write_line_chart encodes.
ChartImage render_line_chart(const std::vector<Series>& series, const ChartOptions& opt);

// Whether this build can write PNG files (it was compiled against libpng).
bool png_output_available();

// A colour for the i-th series of a chart (cycles through 8 well-separated colours).
uint32_t chart_palette(size_t i);

// Tick values at the smallest step of the form {1, 2, 5} x 10^k that puts at most max_count ticks
// (at least 2 is assumed) inside [lo, hi]; the ticks are the multiples of the step in that range.
// lo > hi is swapped; lo == hi gives {lo}; a non-finite bound gives none.
std::vector<double> nice_ticks(double lo, double hi, int max_count);

// Ticks for a logarithmic axis on [lo, hi] (lo > 0): powers of ten, or 1/2/5 or 1..9 times them
// when the range spans too few decades for three ticks; decades are thinned when there are more
// than max_count. A range too narrow for any of these falls back to nice_ticks.
std::vector<double> log_ticks(double lo, double hi, int max_count);

// A short label for any number: three significant digits, trailing zeros dropped, SI suffixes
// k/M/G/T from 1000 up (1500000 -> "1.5M", 2e9 -> "2G", 1234 -> "1.23k", 3.14159 -> "3.14"),
// scientific below 0.001 or from 1e15 up (0.00025 -> "2.5e-4").
std::string format_compact(double v);

// Labels for one axis' ticks, precise enough that neighbours differ: evenly spaced ticks get as many
// decimals as their step needs (plain numbers keep the same count of decimals, so 2.0 2.5 3.0;
// suffixed ones drop trailing zeros, so 500k 1M 1.5M); unevenly spaced (log) ticks use
// format_compact.
std::vector<std::string> format_tick_labels(const std::vector<double>& ticks);

}  // namespace cw
