// Charts written as SVG: line charts (a training run's loss curves, learning rate and memory against
// tokens seen; benchmark tables), stacked bars (where a step's time goes) and heat maps (an eval's
// accuracy over two settings). SVG is text, so there is
// no raster, no font data and no library behind it; any browser shows it, and the tests read it back
// as text.
//
// A chart is a title, one shared x axis and one or more panels stacked vertically, each with its own
// y axis: framed plot area, light grid at "nice" ticks (1/2/5 x 10^k) with compact labels such as
// 200M / 1.5G, y-axis label, and a legend of the panel's labelled series in the inside corner that
// covers the fewest points. x tick labels and the x-axis label go under the bottom panel.
//
// Data rules: points whose x or y is not finite are skipped and break the line there, so a NaN loss
// shows as a gap; a run of one finite point between gaps is drawn as a dot. A single point, a
// constant series, or no finite points at all still give a chart (the empty range is widened; a
// panel with nothing to draw says "no data"), never a division by zero. x and y of different
// lengths, no panels, or a size out of bounds throw cw::Error. A long series is thinned to at most
// four points a pixel column (first, lowest, highest, last), so the file stays small.
//
// write_svg writes `<path>.tmp-<pid>` and renames it over `path`, so a reader polling the file
// during training never sees half a picture.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace cw {

struct Series {
  std::string label;         // legend text; an empty label keeps the series out of the legend
  std::vector<double> x, y;  // same length; non-finite points are gaps
  uint32_t rgb = 0x1F77B4;   // 0xRRGGBB
  bool markers = false;      // a dot at every point as well as the line
};

struct Panel {
  std::string y_label;
  std::vector<Series> series;
  int height = 300;  // of the plot area, pixels (80..4096)
  bool y_from_zero = false;  // the y range includes 0 (quantities whose size is the point: memory, speed)
};

struct XTick {
  double x;
  std::string label;
};

struct Chart {
  std::string title, x_label;
  std::vector<Panel> panels;  // top to bottom, sharing the x axis
  int width = 960;            // pixels (300..16384)
  // Given: the x ticks and their labels (e.g. a log2 axis labelled 16K, 32K, ...), and the x range
  // spans them too; empty: "nice" ticks over the data's range.
  std::vector<XTick> x_ticks;
};

// The chart as an SVG document. Throws cw::Error on bad input (see above).
std::string render_svg(const Chart& chart);

// Renders the chart and writes it to `path` atomically; errors name the file.
void write_svg(const std::string& path, const Chart& chart);

// Horizontal stacked bars: where a step's time goes, two programs side by side. One bar a row, top to
// bottom in order, split into the categories' segments in order, each category its colour
// (chart_palette) and its entry in the legend under the title; a segment wide enough for it shows its
// value, and every bar its total after its end. One x axis from 0 with "nice" ticks and the label under
// it. Values must be finite and >= 0; no categories, no bars, a bar with another count of values than
// categories, or a width out of bounds throw cw::Error.
struct Bar {
  std::string label;
  std::vector<double> values;  // one a category, in the categories' order
};

struct BarChart {
  std::string title, x_label;
  std::vector<std::string> categories;
  std::vector<Bar> bars;
  int width = 960;  // pixels (300..16384)
};

std::string render_svg(const BarChart& chart);
void write_svg(const std::string& path, const BarChart& chart);

// A heat map: a grid of cells, a column per x label (left to right) and a row per y label (top to
// bottom), each cell filled with its value's colour on the scale from lo to hi (heat_colour) and
// its value written in it (format_amount, then the unit); a value that is not finite is a grey cell
// marked "-". A colour bar right of the grid shows the scale, lo at its foot and hi at its head. The
// cells are as wide as the width allows and at most 60 pixels high. No columns or rows, values not
// rows x columns, lo >= hi (or not finite), or a width out of bounds throw cw::Error.
struct HeatMap {
  std::string title, x_label, y_label;
  std::vector<std::string> columns, rows;   // the labels: x left to right, y top to bottom
  std::vector<std::vector<double>> values;  // [row][column]
  double lo = 0, hi = 1;                    // the scale's ends; values beyond take the end's colour
  std::string unit;                         // written after each number ("%")
  int width = 960;                          // pixels (300..16384)
};

std::string render_svg(const HeatMap& map);
void write_svg(const std::string& path, const HeatMap& map);

// The heat map's colour of t in [0, 1] (clamped): light red at 0 through yellow at 0.5 to green at 1,
// each light enough for dark text on it; linear in RGB between those three.
uint32_t heat_colour(double t);

// A value as a bar's or segment's label: whole numbers from 100 up with thousands separators
// (3259.4 -> "3,259"), three significant digits below (42.25 -> "42.3", 0.5 -> "0.5").
std::string format_amount(double v);

// The picture of a training run from its metrics log (metrics.jsonl, as tools/train writes it):
// train loss and eval loss, learning rate, and memory (host rss_mib; on a GPU also the caching pool's
// device_mib after each step and device_peak_mib), each against "tokens". A
// panel is left out when no record has its field; an unparseable line (a torn last line while the
// run is writing) is skipped. Throws cw::Error when the file cannot be read or holds no loss.
Chart run_chart(const std::string& metrics_path, const std::string& title);

// A colour for the i-th series of a chart (cycles through 8 well-separated colours).
uint32_t chart_palette(size_t i);

// Tick values at the smallest step of the form {1, 2, 5} x 10^k that puts at most max_count ticks
// (at least 2 is assumed) inside [lo, hi]; the ticks are the multiples of the step in that range.
// lo > hi is swapped; lo == hi gives {lo}; a non-finite bound gives none.
std::vector<double> nice_ticks(double lo, double hi, int max_count);

// A short label for any number: three significant digits, trailing zeros dropped, SI suffixes
// k/M/G/T from 1000 up (1500000 -> "1.5M", 2e9 -> "2G", 1234 -> "1.23k", 3.14159 -> "3.14"),
// scientific below 0.001 or from 1e15 up (0.00025 -> "2.5e-4").
std::string format_compact(double v);

// Labels for evenly spaced ticks, precise enough that neighbours differ: as many decimals as the
// step needs (plain numbers keep the same count of decimals, so 2.0 2.5 3.0; suffixed ones drop
// trailing zeros, so 500k 1M 1.5M; tiny ones are scientific, so 1e-4 2e-4). One tick alone, or
// unevenly spaced ones, use format_compact.
std::vector<std::string> format_tick_labels(const std::vector<double>& ticks);

}  // namespace cw
