#include "tools/bench_chart.h"

#include "engine/error.h"
#include "tools/eval.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>

namespace cw {

namespace {
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\r"), b = s.find_last_not_of(" \t\r");
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

// A number field: empty is NaN; anything else must parse whole and be finite and >= 0.
double number_field(const std::string& text, const std::string& where, const char* name) {
  if (text.empty()) return kNaN;
  size_t used = 0;
  double v = kNaN;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || !std::isfinite(v) || v < 0)
    fail(fmt::format("{}: {} '{}' is not a number >= 0", where, name, text), "write a plain number, or leave it empty");
  return v;
}

// A line of a table that is neither blank nor a comment ('#'), trimmed, and "path:line" to name it in errors.
struct TableRow {
  std::string text, where;
};

// The rows of the table at `path`, read once; `what` names the table when it cannot be read.
std::vector<TableRow> table_rows(const std::string& path, const char* what) {
  std::ifstream in(path);
  if (!in) fail(fmt::format("cannot read {} '{}'", what, path), "check the path");
  std::vector<TableRow> rows;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n)
    if (std::string t = trim(line); !t.empty() && t[0] != '#') rows.push_back({std::move(t), fmt::format("{}:{}", path, n)});
  return rows;
}

std::vector<BenchPoint> bench_points(const std::string& path, const std::vector<TableRow>& rows) {
  const std::string header = "series,tokens,tokens_per_s,peak_gib,source";
  std::vector<BenchPoint> points;
  bool header_seen = false;
  for (const auto& [t, where] : rows) {
    if (!header_seen) {
      if (t != header) fail(fmt::format("{}: the header is '{}'", where, t), "make the first line '" + header + "'");
      header_seen = true;
      continue;
    }
    std::vector<std::string> f;
    std::stringstream ss(t);
    for (std::string cell; f.size() < 4 && std::getline(ss, cell, ',');) f.push_back(trim(cell));
    std::string rest;
    std::getline(ss, rest);
    if (f.size() < 4)
      fail(fmt::format("{}: {} fields, expected {}", where, f.size(), header), "give every row all five columns");
    BenchPoint p;
    p.series = f[0];
    if (p.series.empty()) fail(fmt::format("{}: the series is empty", where), "name the series the row belongs to");
    const double tokens = number_field(f[1], where, "tokens");
    if (!(tokens >= 1) || tokens != std::floor(tokens))
      fail(fmt::format("{}: tokens '{}' is not a positive integer", where, f[1]), "give the tokens per sequence");
    p.tokens = static_cast<int64_t>(tokens);
    p.tokens_per_s = number_field(f[2], where, "tokens_per_s");
    p.peak_gib = number_field(f[3], where, "peak_gib");
    p.source = trim(rest);
    points.push_back(std::move(p));
  }
  if (!header_seen) fail(fmt::format("benchmark table '{}' has no header", path), "make the first line '" + header + "'");
  if (points.empty()) fail(fmt::format("benchmark table '{}' has no rows", path), "add a row per measured run");
  return points;
}
}  // namespace

std::string token_label(double tokens) {
  const double k = tokens / 1024, m = tokens / (1024 * 1024);
  if (m >= 1 && m * 2 == std::floor(m * 2)) return fmt::format("{}M", m);
  if (k >= 1 && k == std::floor(k)) return fmt::format("{}K", k);
  return format_compact(tokens);
}

Chart bench_chart(const std::vector<BenchPoint>& points, const std::string& title, double device_gib) {
  Chart chart;
  chart.title = title;
  chart.x_label = "tokens per sequence";
  Panel speed{"tokens/s", {}, 260, true}, memory{"peak device memory (GiB)", {}, 260, true};
  std::vector<std::string> order;
  std::map<std::string, std::vector<const BenchPoint*>> by_series;
  double lo = std::numeric_limits<double>::infinity(), hi = 0;
  for (const BenchPoint& p : points) {
    if (!by_series.count(p.series)) order.push_back(p.series);
    by_series[p.series].push_back(&p);
    lo = std::min(lo, double(p.tokens)), hi = std::max(hi, double(p.tokens));
  }
  for (size_t i = 0; i < order.size(); ++i) {
    auto& pts = by_series[order[i]];
    std::stable_sort(pts.begin(), pts.end(), [](const BenchPoint* a, const BenchPoint* b) { return a->tokens < b->tokens; });
    // One legend (the top panel's): a series has the same colour in both panels.
    Series s{order[i], {}, {}, chart_palette(i), true}, m{"", {}, {}, chart_palette(i), true};
    // A point missing from a panel is left out there, not drawn as a gap: the line joins the others.
    for (const BenchPoint* p : pts) {
      if (std::isfinite(p->tokens_per_s)) s.x.push_back(std::log2(double(p->tokens))), s.y.push_back(p->tokens_per_s);
      if (std::isfinite(p->peak_gib)) m.x.push_back(std::log2(double(p->tokens))), m.y.push_back(p->peak_gib);
    }
    speed.series.push_back(std::move(s));
    memory.series.push_back(std::move(m));
  }
  if (device_gib > 0)
    memory.series.push_back(Series{fmt::format("the device's memory ({:.1f} GiB)", device_gib),
                                   {std::log2(lo), std::log2(hi)}, {device_gib, device_gib}, 0x999999, false});
  // A tick at every power of two over the range (every other one past a dozen).
  const int first = static_cast<int>(std::floor(std::log2(lo))), last = static_cast<int>(std::ceil(std::log2(hi)));
  const int every = last - first > 12 ? 2 : 1;
  for (int e = first; e <= last; e += every) chart.x_ticks.push_back({double(e), token_label(std::ldexp(1.0, e))});
  chart.panels = {std::move(speed), std::move(memory)};
  return chart;
}

namespace {
// The fields of a CSV line, trimmed.
std::vector<std::string> fields_of(const std::string& line) {
  std::vector<std::string> f;
  std::stringstream ss(line);
  for (std::string cell; std::getline(ss, cell, ',');) f.push_back(trim(cell));
  if (!line.empty() && line.back() == ',') f.emplace_back();
  return f;
}

BarChart step_time_bars(const std::string& path, const std::vector<TableRow>& rows, const std::string& title) {
  BarChart chart;
  chart.title = title;
  chart.x_label = "ms a step";
  bool header_seen = false;
  for (const auto& [t, where] : rows) {
    const std::vector<std::string> f = fields_of(t);
    if (!header_seen) {
      if (f.size() < 2 || f[0] != "run")
        fail(fmt::format("{}: the header is '{}'", where, t), "make the first line 'run,CATEGORY,...' (one category at least)");
      for (size_t i = 1; i < f.size(); ++i) {
        if (f[i].empty()) fail(fmt::format("{}: category {} has no name", where, i), "name every category in the header");
        chart.categories.push_back(f[i]);
      }
      header_seen = true;
      continue;
    }
    if (f.size() != chart.categories.size() + 1)
      fail(fmt::format("{}: {} fields, expected {} (the run and one a category)", where, f.size(), chart.categories.size() + 1),
           "give every row the header's columns");
    Bar bar{f[0], {}};
    if (bar.label.empty()) fail(fmt::format("{}: the run is empty", where), "name the run the row measures");
    for (size_t i = 1; i < f.size(); ++i) {
      const double v = number_field(f[i], where, chart.categories[i - 1].c_str());
      if (std::isnan(v)) fail(fmt::format("{}: '{}' is empty", where, chart.categories[i - 1]), "write 0 for none");
      bar.values.push_back(v);
    }
    chart.bars.push_back(std::move(bar));
  }
  if (!header_seen) fail(fmt::format("step-time table '{}' has no header", path), "make the first line 'run,CATEGORY,...'");
  if (chart.bars.empty()) fail(fmt::format("step-time table '{}' has no rows", path), "add a row per measured run");
  return chart;
}

// A step-time table's header: "run," and its categories.
bool step_time_header(const std::vector<TableRow>& rows) { return !rows.empty() && rows[0].text.rfind("run,", 0) == 0; }
}  // namespace

std::vector<BenchPoint> read_bench_points(const std::string& path) {
  return bench_points(path, table_rows(path, "benchmark table"));
}

BarChart step_time_chart(const std::string& path, const std::string& title) {
  return step_time_bars(path, table_rows(path, "step-time table"), title);
}

void write_chart(const std::string& input, const std::string& out, const std::string& title, double device_gib) {
  namespace fs = std::filesystem;
  if (out.empty()) fail("chunkwise chart needs --out FILE.svg", "name the picture to write");
  if (fs::path(input).extension() == ".csv") {
    const std::vector<TableRow> rows = table_rows(input, "table");
    if (step_time_header(rows))
      write_svg(out, step_time_bars(input, rows, title.empty() ? "where a step's time goes" : title));
    else
      write_svg(out, bench_chart(bench_points(input, rows), title.empty() ? "speed and memory against tokens" : title,
                                 device_gib));
    return;
  }
  const std::string metrics = fs::is_directory(input) ? (fs::path(input) / "metrics.jsonl").string() : input;
  write_svg(out, run_chart(metrics, title.empty() ? "training against tokens seen" : title));
}

void write_chart(const std::vector<std::string>& inputs, const std::string& out, const std::string& title,
                 const std::vector<std::string>& labels, double device_gib) {
  if (inputs.empty()) fail("chunkwise chart needs an input", "give a table, a run directory or eval results (.json)");
  if (is_eval_result(inputs[0])) {
    for (const std::string& in : inputs)
      if (!is_eval_result(in))
        fail(fmt::format("chunkwise chart: '{}' is not an eval result (.json of chunkwise eval) like '{}'", in, inputs[0]),
             "draw eval results together, and a table or a run alone");
    write_eval_chart(inputs, labels, out, title);
    return;
  }
  if (inputs.size() > 1)
    fail(fmt::format("chunkwise chart: {} inputs, and '{}' is not an eval result", inputs.size(), inputs[0]),
         "draw several eval results (.json of chunkwise eval) together, and a table or a run alone");
  if (!labels.empty()) fail("chunkwise chart: --label names eval results", "leave it out for a table or a run");
  write_chart(inputs[0], out, title, device_gib);
}

}  // namespace cw
