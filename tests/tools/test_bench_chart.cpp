// tools/bench_chart.h: the benchmark table read back (comments, empty cells, commas in the source),
// its errors naming file and line, token labels, and the chart: powers-of-two x ticks, series in
// order, one legend, the device's memory line; `chunkwise chart` writes either kind of picture.
#include "tools/bench_chart.h"

#include "engine/error.h"
#include "tests/support.h"

#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <iterator>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

namespace {
std::string write(const cw::test::TempDir& dir, const std::string& name, const std::string& text) {
  const std::string path = dir.file(name);
  std::ofstream(path) << text;
  return path;
}

const char* kHeader = "series,tokens,tokens_per_s,peak_gib,source\n";

// The labels of the x ticks, in order.
std::vector<std::string> x_tick_labels(const std::string& svg) {
  std::vector<std::string> out;
  const std::regex re("<text class=\"xtick\"[^>]*>([^<]*)</text>");
  for (std::sregex_iterator it(svg.begin(), svg.end(), re), end; it != end; ++it) out.push_back((*it)[1]);
  return out;
}
}  // namespace

TEST_CASE("bench chart: the table's rows, comments skipped, empty cells as NaN, commas kept in the source") {
  cw::test::TempDir dir("bench-chart");
  const std::string path = write(dir, "t.csv",
                                 std::string("# a comment\n\n") + kHeader +
                                     "peer,16384,31470,20.3,docs/performance.md, the peer table\n"
                                     "  seco , 32768 ,,26.87,cold step\n"
                                     "seco,131072,8861,,\n");
  const std::vector<cw::BenchPoint> p = cw::read_bench_points(path);
  REQUIRE(p.size() == 3);
  CHECK(p[0].series == "peer");
  CHECK(p[0].tokens == 16384);
  CHECK(p[0].tokens_per_s == 31470);
  CHECK(p[0].peak_gib == doctest::Approx(20.3));
  CHECK(p[0].source == "docs/performance.md, the peer table");
  CHECK(p[1].series == "seco");
  CHECK(p[1].tokens == 32768);
  CHECK(std::isnan(p[1].tokens_per_s));
  CHECK(p[1].peak_gib == doctest::Approx(26.87));
  CHECK(std::isnan(p[2].peak_gib));
  CHECK(p[2].source.empty());
}

TEST_CASE("bench chart: a malformed table is one error naming the file and the line") {
  cw::test::TempDir dir("bench-chart-bad");
  struct Bad {
    std::string text, says;
  };
  const std::vector<Bad> cases = {
      {"tokens,series\n", ":1: the header is 'tokens,series'"},
      {std::string(kHeader) + "a,16384,1,2,x\nb,16K,1,2,x\n", ":3: tokens '16K' is not a number"},
      {std::string(kHeader) + "a,0,1,2,x\n", ":2: tokens '0' is not a positive integer"},
      {std::string(kHeader) + "a,100.5,1,2,x\n", ":2: tokens '100.5' is not a positive integer"},
      {std::string(kHeader) + "a,1024,-3,2,x\n", ":2: tokens_per_s '-3' is not a number >= 0"},
      {std::string(kHeader) + "a,1024,nan,2,x\n", ":2: tokens_per_s 'nan'"},
      {std::string(kHeader) + "a,1024,5\n", ":2: 3 fields, expected"},
      {std::string(kHeader) + ",1024,5,1,x\n", ":2: the series is empty"},
      {std::string(kHeader), "has no rows"},
      {"# only a comment\n", "has no header"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string path = write(dir, "bad" + std::to_string(i) + ".csv", cases[i].text);
    INFO(cases[i].text);
    CHECK_THROWS_WITH_AS(cw::read_bench_points(path), doctest::Contains(cases[i].says.c_str()), cw::Error);
    CHECK_THROWS_WITH_AS(cw::read_bench_points(path), doctest::Contains(path.c_str()), cw::Error);
  }
  CHECK_THROWS_WITH_AS(cw::read_bench_points(dir.file("absent.csv")), doctest::Contains("absent.csv"), cw::Error);
}

TEST_CASE("bench chart: token labels in K and M") {
  CHECK(cw::token_label(16384) == "16K");
  CHECK(cw::token_label(524288) == "512K");
  CHECK(cw::token_label(1048576) == "1M");
  CHECK(cw::token_label(1572864) == "1.5M");
  CHECK(cw::token_label(1536) == "1.54k");  // not a whole number of K: compact (decimal SI)
}

TEST_CASE("bench chart: a tick at every power of two, series in order of appearance, one legend, the device line") {
  std::vector<cw::BenchPoint> p = {{"peer", 131072, 9346, 45.3, ""},
                                   {"seco", 524288, 2007, 43.9, ""},
                                   {"peer", 16384, 31470, 20.3, ""},
                                   {"seco", 32768, std::nan(""), 26.87, ""}};
  const cw::Chart c = cw::bench_chart(p, "t", 79.2);
  REQUIRE(c.panels.size() == 2);
  std::vector<std::string> labels;
  for (const cw::XTick& t : c.x_ticks) labels.push_back(t.label);
  CHECK(labels == std::vector<std::string>{"16K", "32K", "64K", "128K", "256K", "512K"});
  CHECK(c.x_ticks.front().x == 14);
  const cw::Panel& speed = c.panels[0];
  const cw::Panel& memory = c.panels[1];
  REQUIRE(speed.series.size() == 2);
  CHECK(speed.series[0].label == "peer");
  CHECK(speed.series[1].label == "seco");
  // Sorted by tokens, on the log2 axis; a missing tokens/s is left out of that panel only.
  CHECK(speed.series[0].x == std::vector<double>{14, 17});
  CHECK(speed.series[0].y == std::vector<double>{31470, 9346});
  CHECK(speed.series[1].x == std::vector<double>{19});
  REQUIRE(memory.series.size() == 3);
  CHECK(memory.series[1].x == std::vector<double>{15, 19});
  CHECK(memory.series[0].label.empty());
  CHECK(memory.series[0].rgb == speed.series[0].rgb);
  CHECK(memory.series[2].label == "the device's memory (79.2 GiB)");
  CHECK(memory.series[2].y == std::vector<double>{79.2, 79.2});
  CHECK(speed.y_from_zero);
  CHECK(memory.y_from_zero);
}

TEST_CASE("chunkwise chart: a table or a run's metrics log to SVG, the ticks as labelled") {
  cw::test::TempDir dir("bench-chart-write");
  const std::string table = write(dir, "t.csv", std::string(kHeader) + "a,16384,100,10,x\na,65536,50,12,x\n");
  const std::string out = dir.file("t.svg");
  cw::write_chart(table, out, "", 80);
  std::ifstream in(out);
  const std::string svg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(x_tick_labels(svg) == std::vector<std::string>{"16K", "32K", "64K"});
  // Both panels' y ranges reach down to zero (memory 10-12 GiB, speed 50-100 tokens/s).
  const std::regex ytick("<text class=\"ytick\"[^>]*>0</text>");
  CHECK(std::distance(std::sregex_iterator(svg.begin(), svg.end(), ytick), std::sregex_iterator()) == 2);
  CHECK(svg.find("speed and memory against tokens") != std::string::npos);
  CHECK(svg.find("the device&#39;s memory") == std::string::npos);  // quotes are not entities here
  CHECK(svg.find("the device's memory (80.0 GiB)") != std::string::npos);

  const std::string run = dir.file("run");
  std::filesystem::create_directories(run);
  write(dir, "run/metrics.jsonl", "{\"tokens\": 100, \"loss\": 3.5}\n{\"tokens\": 200, \"loss\": 3.1}\n");
  cw::write_chart(run, dir.file("loss.svg"), "my run");
  std::ifstream lin(dir.file("loss.svg"));
  const std::string loss((std::istreambuf_iterator<char>(lin)), std::istreambuf_iterator<char>());
  CHECK(loss.find("my run") != std::string::npos);
  CHECK_THROWS_WITH_AS(cw::write_chart(table, "", ""), doctest::Contains("--out"), cw::Error);
  CHECK_THROWS_WITH_AS(cw::write_chart(dir.file("nothing"), dir.file("x.svg"), ""), doctest::Contains("nothing"),
                       cw::Error);
}

TEST_CASE("bench chart: docs/long_context.svg is the drawing of docs/long_context.csv (redraw it after editing)") {
  const std::filesystem::path docs = std::filesystem::path(CW_SOURCE_ROOT) / "docs";
  std::ifstream committed(docs / "long_context.svg");
  REQUIRE(committed);
  const std::string svg((std::istreambuf_iterator<char>(committed)), std::istreambuf_iterator<char>());
  const cw::Chart chart = cw::bench_chart(cw::read_bench_points((docs / "long_context.csv").string()),
                                          "Llama-3.2-1B on one H100: seco against HF + Liger", 79.2);
  CHECK_MESSAGE(svg == cw::render_svg(chart),
                "run: chunkwise chart docs/long_context.csv --out docs/long_context.svg --device-gib 79.2 "
                "--title \"Llama-3.2-1B on one H100: seco against HF + Liger\"");
}

TEST_CASE("step-time table: categories from the header, a bar a row, comments skipped") {
  cw::test::TempDir dir("step-time");
  const std::string path = write(dir, "s.csv", "# where the time goes\nrun, attention ,matmul\n\nours,10,2.5\n# between\npeer, 20 ,0\n");
  const cw::BarChart chart = cw::step_time_chart(path, "t");
  CHECK(chart.title == "t");
  CHECK(chart.x_label == "ms a step");
  CHECK(chart.categories == std::vector<std::string>{"attention", "matmul"});
  REQUIRE(chart.bars.size() == 2);
  CHECK(chart.bars[0].label == "ours");
  CHECK(chart.bars[0].values == std::vector<double>{10, 2.5});
  CHECK(chart.bars[1].label == "peer");
  CHECK(chart.bars[1].values == std::vector<double>{20, 0});
}

TEST_CASE("step-time table: a malformed table is one error naming the file and the line") {
  cw::test::TempDir dir("step-time-bad");
  struct Bad {
    std::string text, says;
  };
  const std::vector<Bad> cases = {
      {"run\n", ":1: the header is 'run'"},
      {"name,a\n", ":1: the header is 'name,a'"},
      {"run,a,\n", ":1: category 2 has no name"},
      {"run,a,b\nx,1\n", ":2: 2 fields, expected 3"},
      {"run,a,b\nx,1,2,3\n", ":2: 4 fields, expected 3"},
      {"run,a\nx,-1\n", ":2: a '-1' is not a number >= 0"},
      {"run,a\nx,1ms\n", ":2: a '1ms' is not a number >= 0"},
      {"run,a\nx,\n", ":2: 'a' is empty"},
      {"run,a\n,1\n", ":2: the run is empty"},
      {"run,a\n", "has no rows"},
      {"# nothing\n", "has no header"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string path = write(dir, "bad" + std::to_string(i) + ".csv", cases[i].text);
    INFO(cases[i].text);
    CHECK_THROWS_WITH_AS(cw::step_time_chart(path, ""), doctest::Contains(cases[i].says.c_str()), cw::Error);
    CHECK_THROWS_WITH_AS(cw::step_time_chart(path, ""), doctest::Contains(path.c_str()), cw::Error);
  }
  CHECK_THROWS_WITH_AS(cw::step_time_chart(dir.file("absent.csv"), ""), doctest::Contains("absent.csv"), cw::Error);
}

TEST_CASE("chunkwise chart: a step-time table (header run,...) is drawn as stacked bars") {
  cw::test::TempDir dir("step-time-write");
  const std::string table = write(dir, "s.csv", "run,attention,matmul\nours,10,2\npeer,20,2\n");
  cw::write_chart(table, dir.file("s.svg"), "");
  std::ifstream in(dir.file("s.svg"));
  const std::string svg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(svg.find("where a step&#39;s time goes") == std::string::npos);
  CHECK(svg.find("where a step's time goes") != std::string::npos);
  const std::regex segment("<rect class=\"segment\"");
  CHECK(std::distance(std::sregex_iterator(svg.begin(), svg.end(), segment), std::sregex_iterator()) == 4);
  CHECK(svg.find(">12</text>") != std::string::npos);  // the totals
  CHECK(svg.find(">22</text>") != std::string::npos);
}

TEST_CASE("step-time charts: docs/step_time_*.svg are the drawings of their tables (redraw them after editing)") {
  const std::filesystem::path docs = std::filesystem::path(CW_SOURCE_ROOT) / "docs";
  const std::vector<std::pair<std::string, std::string>> pictures = {
      {"step_time_64k", "Llama-3.2-1B, 64K tokens, one H100: where a step's time goes"},
      {"step_time_lora_64k", "Llama-3.1-8B LoRA, 64K tokens, one H100: where a step's time goes"}};
  for (const auto& [name, title] : pictures) {
    std::ifstream committed(docs / (name + ".svg"));
    REQUIRE(committed);
    const std::string svg((std::istreambuf_iterator<char>(committed)), std::istreambuf_iterator<char>());
    const std::string redraw = "run: chunkwise chart docs/" + name + ".csv --out docs/" + name + ".svg --title \"" + title + "\"";
    CHECK_MESSAGE(svg == cw::render_svg(cw::step_time_chart((docs / (name + ".csv")).string(), title)), redraw);
  }
}
