// Line charts: the tick chooser and number labels, the raster (colours present, white background,
// gaps at NaN, degenerate data), and the PNG file read back through libpng.
#include "tools/plot.h"

#include "engine/error.h"
#include "tests/support.h"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#if __has_include(<png.h>)
#include <png.h>
#define CW_TEST_CAN_READ_PNG 1
#else
#define CW_TEST_CAN_READ_PNG 0
#endif

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

void check_ticks(const std::vector<double>& got, const std::vector<double>& want) {
  INFO("got ", got.size(), " ticks, want ", want.size());
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == doctest::Approx(want[i]).epsilon(1e-12));
}

// The step between ticks is m x 10^k with m in {1, 2, 5}.
bool is_nice_step(double step) {
  const double k = std::floor(std::log10(step));
  const double m = step / std::pow(10.0, k);
  for (double nice : {1.0, 2.0, 5.0, 10.0})
    if (std::abs(m - nice) < 1e-9 * nice) return true;
  return false;
}

int64_t count_colour(const cw::ChartImage& img, uint32_t rgb) {
  int64_t n = 0;
  for (int y = 0; y < img.height; ++y)
    for (int x = 0; x < img.width; ++x) n += img.pixel(x, y) == rgb;
  return n;
}

// Columns holding at least one pixel of exactly this colour.
std::vector<int> columns_with(const cw::ChartImage& img, uint32_t rgb) {
  std::vector<int> cols;
  for (int x = 0; x < img.width; ++x)
    for (int y = 0; y < img.height; ++y)
      if (img.pixel(x, y) == rgb) {
        cols.push_back(x);
        break;
      }
  return cols;
}

bool column_has(const cw::ChartImage& img, int x, uint32_t rgb) {
  for (int y = 0; y < img.height; ++y)
    if (img.pixel(x, y) == rgb) return true;
  return false;
}

constexpr uint32_t kBlue = 0x1F77B4, kOrange = 0xFF7F0E;

// A decaying noisy train curve and a few eval points, as a training run logs them.
std::vector<cw::Series> loss_series() {
  cw::Series train{"train", {}, {}, kBlue, false}, eval{"eval", {}, {}, kOrange, true};
  std::mt19937 rng(3);
  std::normal_distribution<double> noise(0.0, 0.05);
  for (int i = 1; i <= 200; ++i) {
    const double tokens = i * 5e6, loss = 3.0 + 8.0 * std::exp(-i / 15.0);
    train.x.push_back(tokens);
    train.y.push_back(loss + noise(rng));
    if (i % 40 == 0) {
      eval.x.push_back(tokens);
      eval.y.push_back(loss + 0.05);
    }
  }
  return {train, eval};
}

cw::ChartOptions loss_options() {
  cw::ChartOptions opt;
  opt.title = "loss";
  opt.x_label = "tokens";
  opt.y_label = "loss";
  return opt;
}

}  // namespace

TEST_SUITE("plot") {

TEST_CASE("nice_ticks picks 1/2/5 x 10^k steps for typical ranges") {
  check_ticks(cw::nice_ticks(0, 1, 6), {0, 0.2, 0.4, 0.6, 0.8, 1.0});
  check_ticks(cw::nice_ticks(0, 1, 11), {0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0});
  // Tokens: a run of 1.23B tokens with room for 8 ticks steps by 200M.
  check_ticks(cw::nice_ticks(0, 1.23e9, 8), {0, 2e8, 4e8, 6e8, 8e8, 1e9, 1.2e9});
  // A loss range: the ticks lie inside it, not at its ends.
  check_ticks(cw::nice_ticks(2.13, 3.87, 5), {2.5, 3.0, 3.5});
  check_ticks(cw::nice_ticks(-7, 13, 5), {-5, 0, 5, 10});
  check_ticks(cw::nice_ticks(1e-4, 6e-4, 6), {1e-4, 2e-4, 3e-4, 4e-4, 5e-4, 6e-4});
  // Zero comes out as an exact zero, not 1e-17, so it is labelled "0".
  const std::vector<double> around_zero = cw::nice_ticks(-0.3, 0.3, 7);
  check_ticks(around_zero, {-0.3, -0.2, -0.1, 0, 0.1, 0.2, 0.3});
  CHECK(around_zero[3] == 0.0);
}

TEST_CASE("nice_ticks handles reversed, empty and non-finite ranges") {
  check_ticks(cw::nice_ticks(1, 0, 6), {0, 0.2, 0.4, 0.6, 0.8, 1.0});
  check_ticks(cw::nice_ticks(2.5, 2.5, 6), {2.5});
  CHECK(cw::nice_ticks(kNaN, 1, 5).empty());
  CHECK(cw::nice_ticks(0, INFINITY, 5).empty());
  // A max_count below 2 is read as 2.
  CHECK(cw::nice_ticks(0, 10, 0).size() <= 2);
  CHECK(!cw::nice_ticks(0, 10, 0).empty());
}

TEST_CASE("nice_ticks: random ranges give few, nice, in-range ticks") {
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (int trial = 0; trial < 2000; ++trial) {
    const double scale = std::pow(10.0, std::floor(unit(rng) * 24) - 12);
    const double lo = (unit(rng) * 2 - 1) * scale, hi = lo + unit(rng) * scale + 1e-3 * scale;
    const int max_count = 2 + static_cast<int>(unit(rng) * 12);
    const std::vector<double> t = cw::nice_ticks(lo, hi, max_count);
    INFO("lo=", lo, " hi=", hi, " max_count=", max_count);
    REQUIRE(!t.empty());
    CHECK(static_cast<int>(t.size()) <= max_count);
    const double slack = 1e-9 * (hi - lo);
    CHECK(t.front() >= lo - slack);
    CHECK(t.back() <= hi + slack);
    // At most 2.5x coarser than max_count allows, so 5 or more allowed means at least 2 shown.
    if (max_count >= 5) CHECK(t.size() >= 2);
    for (size_t i = 1; i < t.size(); ++i) {
      CHECK(is_nice_step(t[i] - t[i - 1]));
      CHECK(std::abs((t[i] - t[i - 1]) - (t[1] - t[0])) <= 1e-9 * (t[1] - t[0]));
    }
    if (t.size() >= 2) CHECK(std::abs(std::remainder(t[0], t[1] - t[0])) <= 1e-6 * (t[1] - t[0]));
  }
}

TEST_CASE("log_ticks: decades, then 1/2/5, then a linear fallback") {
  check_ticks(cw::log_ticks(1e-3, 10, 10), {1e-3, 1e-2, 1e-1, 1, 10});
  // Less than a decade: 1, 2, 5 times powers of ten.
  check_ticks(cw::log_ticks(0.15, 6, 10), {0.2, 0.5, 1, 2, 5});
  // 2.5..10.5 (a log loss axis): 1..9 x 10^k.
  check_ticks(cw::log_ticks(2.5, 10.5, 10), {3, 4, 5, 6, 7, 8, 9, 10});
  // Thirty decades into at most 8 ticks: every few decades.
  const std::vector<double> wide = cw::log_ticks(1e-10, 1e20, 8);
  CHECK(wide.size() <= 8);
  CHECK(wide.size() >= 3);
  // A narrow range falls back to evenly spaced ticks.
  const std::vector<double> narrow = cw::log_ticks(2.01, 2.09, 5);
  REQUIRE(narrow.size() >= 2);
  CHECK(narrow.front() >= 2.01);
  CHECK(narrow.back() <= 2.09);
}

TEST_CASE("format_compact: three significant digits with SI suffixes") {
  CHECK(cw::format_compact(1500000) == "1.5M");
  CHECK(cw::format_compact(2e9) == "2G");
  CHECK(cw::format_compact(1234) == "1.23k");
  CHECK(cw::format_compact(-2500) == "-2.5k");
  CHECK(cw::format_compact(999999) == "1M");
  CHECK(cw::format_compact(3e12) == "3T");
  CHECK(cw::format_compact(42) == "42");
  CHECK(cw::format_compact(3.14159) == "3.14");
  CHECK(cw::format_compact(0.25) == "0.25");
  CHECK(cw::format_compact(0.001) == "0.001");
  CHECK(cw::format_compact(2.5e-4) == "2.5e-4");
  CHECK(cw::format_compact(1e-5) == "1e-5");
  CHECK(cw::format_compact(2e15) == "2e15");
  CHECK(cw::format_compact(0) == "0");
  CHECK(cw::format_compact(kNaN) == "nan");
  CHECK(cw::format_compact(-INFINITY) == "-inf");
}

TEST_CASE("format_tick_labels: compact, distinct, consistent") {
  using V = std::vector<std::string>;
  CHECK(cw::format_tick_labels(cw::nice_ticks(0, 1.23e9, 8)) == V{"0", "200M", "400M", "600M", "800M", "1G", "1.2G"});
  CHECK(cw::format_tick_labels({2.0, 2.5, 3.0, 3.5}) == V{"2.0", "2.5", "3.0", "3.5"});
  CHECK(cw::format_tick_labels({0, 0.5, 1.0}) == V{"0.0", "0.5", "1.0"});
  CHECK(cw::format_tick_labels({0, 500, 1000, 1500}) == V{"0", "500", "1k", "1.5k"});
  CHECK(cw::format_tick_labels({0, 1e-4, 2e-4}) == V{"0", "1e-4", "2e-4"});
  CHECK(cw::format_tick_labels({1, 10, 100, 1000}) == V{"1", "10", "100", "1k"});
  // Ticks finer than three significant digits still get labels that differ.
  const std::vector<std::string> fine = cw::format_tick_labels(cw::nice_ticks(1.0e6, 1.01e6, 6));
  REQUIRE(fine.size() >= 2);
  for (size_t i = 1; i < fine.size(); ++i) CHECK(fine[i] != fine[i - 1]);
  CHECK(fine.front() == "1M");
}

TEST_CASE("render: size, white background, both series colours") {
  const cw::ChartImage img = cw::render_line_chart(loss_series(), loss_options());
  CHECK(img.width == 960);
  CHECK(img.height == 540);
  REQUIRE(img.rgb.size() == size_t{960} * 540 * 3);
  for (const auto& [x, y] : std::vector<std::pair<int, int>>{{0, 0}, {959, 0}, {0, 539}, {959, 539}})
    CHECK(img.pixel(x, y) == 0xFFFFFF);
  // Line interiors are fully covered, so the exact series colours appear; the eval series has
  // markers, so plenty of its colour too.
  CHECK(count_colour(img, kBlue) > 500);
  CHECK(count_colour(img, kOrange) > 100);
  // Text and frame: some dark pixels.
  CHECK(count_colour(img, 0x222222) > 200);
}

TEST_CASE("render: a NaN breaks the line into a gap") {
  cw::ChartOptions opt;
  const cw::Series s{"", {0, 1, 2, 3, 4}, {0, 0, kNaN, 0, 0}, kBlue, false};
  const cw::ChartImage img = cw::render_line_chart({s}, opt);
  const std::vector<int> cols = columns_with(img, kBlue);
  REQUIRE(cols.size() > 100);
  const int first = cols.front(), last = cols.back();
  // x = 2 sits halfway; x = 0.5 and 3.5 lie on drawn segments.
  CHECK_FALSE(column_has(img, (first + last) / 2, kBlue));
  CHECK(column_has(img, first + (last - first) / 8, kBlue));
  CHECK(column_has(img, last - (last - first) / 8, kBlue));
}

TEST_CASE("render: constant, single-point, all-NaN and empty data do not divide by zero") {
  cw::ChartOptions opt;
  opt.title = "degenerate";
  const cw::Series constant{"constant", {0, 1, 2, 3}, {2, 2, kNaN, 2}, kBlue, false};
  const cw::Series single{"one point", {5}, {7}, kOrange, true};
  const cw::Series nans{"all nan", {0, 1}, {kNaN, INFINITY}, 0x2CA02C, false};
  CHECK(count_colour(cw::render_line_chart({constant}, opt), kBlue) > 50);
  CHECK(count_colour(cw::render_line_chart({single}, opt), kOrange) > 10);
  CHECK(count_colour(cw::render_line_chart({constant, single, nans}, opt), kOrange) > 10);
  CHECK(count_colour(cw::render_line_chart({nans}, opt), 0x2CA02C) > 0);  // legend sample only
  CHECK_NOTHROW(cw::render_line_chart({}, opt));
  CHECK_NOTHROW(cw::render_line_chart({cw::Series{"x constant", {3, 3, 3}, {1, 2, 3}, kBlue, false}}, opt));
}

TEST_CASE("render: log_y skips values that are not positive") {
  cw::ChartOptions opt;
  opt.log_y = true;
  const cw::Series s{"", {0, 1, 2, 3, 4}, {1, 10, 0, -1, 1000}, kBlue, false};
  CHECK(count_colour(cw::render_line_chart({s}, opt), kBlue) > 50);
  CHECK_NOTHROW(cw::render_line_chart({cw::Series{"", {0, 1}, {0, -1}, kBlue, false}}, opt));
}

TEST_CASE("write_line_chart writes a PNG that reads back as the rendered image") {
  cw::test::TempDir dir("plot");
  const std::string path = dir.file("loss.png");
  const std::vector<cw::Series> series = loss_series();
  cw::ChartOptions opt = loss_options();
  opt.width = 640;
  opt.height = 400;
  if (!cw::png_output_available()) {
    CHECK_THROWS_WITH_AS(cw::write_line_chart(path, series, opt), doctest::Contains("libpng"), cw::Error);
    return;
  }
  cw::write_line_chart(path, series, opt);
  cw::write_line_chart(path, series, opt);  // replacing an existing chart works too
  // Only the chart is left: the temporary file was renamed over it.
  int files = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir.path)) ++files;
  CHECK(files == 1);

  std::ifstream in(path, std::ios::binary);
  char signature[8] = {};
  in.read(signature, 8);
  CHECK(std::string(signature, 8) == std::string("\x89PNG\r\n\x1a\n", 8));

#if CW_TEST_CAN_READ_PNG
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  REQUIRE(png_image_begin_read_from_file(&image, path.c_str()));
  CHECK(image.width == 640);
  CHECK(image.height == 400);
  image.format = PNG_FORMAT_RGB;
  std::vector<uint8_t> pixels(PNG_IMAGE_SIZE(image));
  REQUIRE(png_image_finish_read(&image, nullptr, pixels.data(), 0, nullptr));
  const cw::ChartImage want = cw::render_line_chart(series, opt);
  CHECK(pixels == want.rgb);
  const cw::ChartImage got{640, 400, pixels};
  CHECK(got.pixel(0, 0) == 0xFFFFFF);
  CHECK(count_colour(got, kBlue) > 300);
  CHECK(count_colour(got, kOrange) > 50);
#endif
}

TEST_CASE("write_line_chart errors name the file") {
  cw::test::TempDir dir("plot-errors");
  const std::string path = dir.file("bad.png");
  cw::ChartOptions opt;
  CHECK_THROWS_WITH_AS(cw::write_line_chart(path, {cw::Series{"short", {0, 1, 2}, {0, 1}, kBlue, false}}, opt),
                       doctest::Contains(path.c_str()), cw::Error);
  CHECK_THROWS_WITH_AS(cw::write_line_chart(path, {cw::Series{"short", {0, 1, 2}, {0, 1}, kBlue, false}}, opt),
                       doctest::Contains("3 x values but 2 y values"), cw::Error);
  cw::ChartOptions tiny;
  tiny.width = 50;
  CHECK_THROWS_WITH_AS(cw::write_line_chart(path, {}, tiny), doctest::Contains(path.c_str()), cw::Error);
  const std::string missing = dir.file("no/such/dir/chart.png");
  CHECK_THROWS_WITH_AS(cw::write_line_chart(missing, loss_series(), opt), doctest::Contains(missing.c_str()),
                       cw::Error);
  CHECK_FALSE(std::filesystem::exists(path));
}

}  // TEST_SUITE
