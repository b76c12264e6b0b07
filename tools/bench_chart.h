// A benchmark table as a picture: tokens/s and peak device memory against the sequence length, one
// line (with markers) per series in the same colour in both panels (the legend is the top one's), the x axis in powers of two labelled 16K, 32K, ... 1M. This is how
// the README shows seco's long-context runs beside HF + Liger's (docs/long_context.csv).
//
// The table is CSV: lines starting with '#' are comments; the first other line is the header
//   series,tokens,tokens_per_s,peak_gib,source
// and every row after it gives one run: the series' label, the tokens per sequence (a positive
// integer), tokens/s and peak device GiB (each may be empty: no point in that panel), and where the
// figure comes from (free text, may hold commas; not drawn). Series are drawn in order of first
// appearance, their points sorted by tokens. A malformed file is an error naming the file and line.
#pragma once

#include "tools/plot.h"

#include <cstdint>
#include <string>
#include <vector>

namespace cw {

struct BenchPoint {
  std::string series;
  int64_t tokens = 0;
  double tokens_per_s = 0, peak_gib = 0;  // NaN: not given
  std::string source;
};

// Reads the table; throws cw::Error naming `path` and the line on anything malformed.
std::vector<BenchPoint> read_bench_points(const std::string& path);

// The two-panel chart of the points; device_gib > 0 adds the device's memory as a grey line.
Chart bench_chart(const std::vector<BenchPoint>& points, const std::string& title, double device_gib = 0);

// A step's time by kind, two programs (or settings) side by side, as stacked bars (plot.h BarChart):
// also CSV, '#' lines comments, the header
//   run,CATEGORY,CATEGORY,...
// (at least one category) and a row a bar: its label, then milliseconds a step for each category
// (numbers >= 0). docs/step_time_64k.csv is docs/performance.md's. A malformed file is an error naming the file
// and line.
BarChart step_time_chart(const std::string& path, const std::string& title);

// `chunkwise chart INPUT --out FILE.svg`: a .csv is a benchmark table (header series,tokens,...) or a
// step's time by kind (header run,...), as above; otherwise a training run (its directory or its
// metrics.jsonl) as plot.h's run_chart. Empty title: a default.
void write_chart(const std::string& input, const std::string& out, const std::string& title, double device_gib = 0);
// The same for one or more inputs: eval results (.json, tools/eval.h) drawn together, loss by position
// as a line a result (`labels` name them, in order; none: each result's own label), or one passkey
// result as a heat map; any other input alone, as above.
void write_chart(const std::vector<std::string>& inputs, const std::string& out, const std::string& title,
                 const std::vector<std::string>& labels, double device_gib = 0);

// "16K", "512K", "1M", "1.5M": a token count for an axis (powers of two of K and M; else compact).
std::string token_label(double tokens);

}  // namespace cw
