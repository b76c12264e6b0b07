// Line charts as SVG: the tick chooser and number labels, then the document read back as text:
// well-formed (balanced tags, escaped text), polyline points equal to the data mapped through the
// axes that the tick labels state, gaps at NaN/inf, degenerate data, thinning, the legend's corner,
// the file, and a run's chart from its metrics log; stacked bars; heat maps held to their table.
#include "tools/plot.h"

#include "engine/error.h"
#include "tests/support.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr uint32_t kBlue = 0x1F77B4, kOrange = 0xFF7F0E;
// Pixel coordinates are written with one decimal; an axis fitted through two rounded ticks adds as much.
constexpr double kTol = 0.15;

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

// "" when every tag is closed in order, the text between tags holds no stray '<' or '>' and every
// '&' starts an entity; else what is wrong.
std::string well_formed(const std::string& svg) {
  if (svg.rfind("<?xml", 0) != 0) return "no XML declaration";
  std::vector<std::string> open;
  size_t pos = svg.find("?>") + 2;
  bool root_seen = false;
  while (pos < svg.size()) {
    const size_t lt = svg.find('<', pos);
    const std::string text = svg.substr(pos, lt == std::string::npos ? std::string::npos : lt - pos);
    if (text.find('>') != std::string::npos) return "stray '>' in text: " + text;
    for (size_t a = text.find('&'); a != std::string::npos; a = text.find('&', a + 1))
      if (!std::regex_search(text.substr(a), std::regex("^&(amp|lt|gt|quot|#[0-9]+);"))) return "bare '&' in " + text;
    if (lt == std::string::npos) break;
    if (open.empty() && root_seen) return "content after the root element";
    const size_t gt = svg.find('>', lt);
    if (gt == std::string::npos) return "unterminated tag";
    const std::string tag = svg.substr(lt + 1, gt - lt - 1);
    if (tag.find('<') != std::string::npos) return "'<' inside tag " + tag;
    if (std::count(tag.begin(), tag.end(), '"') % 2 != 0) return "unbalanced quotes in " + tag;
    const std::string name = tag.substr(tag[0] == '/' ? 1 : 0, tag.find_first_of(" /", 1) - (tag[0] == '/' ? 1 : 0));
    if (tag[0] == '/') {
      if (open.empty() || open.back() != name) return "</" + name + "> closes " + (open.empty() ? "nothing" : open.back());
      open.pop_back();
    } else if (tag.back() != '/') {
      open.push_back(name);
    }
    root_seen = true;
    pos = gt + 1;
  }
  if (!open.empty()) return "<" + open.back() + "> never closed";
  return root_seen ? "" : "no root element";
}

double attr(const std::string& tag, const std::string& name) {
  std::smatch m;
  const std::regex re(" " + name + "=\"([^\"]*)\"");
  REQUIRE_MESSAGE(std::regex_search(tag, m, re), tag, " has no ", name);
  return std::stod(m[1]);
}

std::vector<std::string> tags(const std::string& svg, const std::string& start) {
  std::vector<std::string> out;
  for (size_t p = svg.find(start); p != std::string::npos; p = svg.find(start, p + 1))
    out.push_back(svg.substr(p, svg.find('>', p) - p + 1));
  return out;
}

using Points = std::vector<std::pair<double, double>>;

std::vector<Points> polylines(const std::string& svg) {
  std::vector<Points> out;
  for (const std::string& tag : tags(svg, "<polyline")) {
    // Not a regex: std::regex recurses per character and overflows the stack on long point lists.
    const size_t begin = tag.find("points=\"");
    REQUIRE(begin != std::string::npos);
    std::istringstream in(tag.substr(begin + 8, tag.find('"', begin + 8) - begin - 8));
    Points pts;
    std::string pair;
    while (in >> pair) pts.emplace_back(std::stod(pair), std::stod(pair.substr(pair.find(',') + 1)));
    out.push_back(pts);
  }
  return out;
}

Points circles(const std::string& svg) {
  Points out;
  for (const std::string& tag : tags(svg, "<circle")) out.emplace_back(attr(tag, "cx"), attr(tag, "cy"));
  return out;
}

// A tick label back to its number: "1.5M" -> 1.5e6, "2e-4" -> 2e-4, "3.0" -> 3.
double label_value(const std::string& label) {
  char* end = nullptr;
  double v = std::strtod(label.c_str(), &end);
  const std::string suffix(end);
  if (suffix == "k") v *= 1e3;
  if (suffix == "M") v *= 1e6;
  if (suffix == "G") v *= 1e9;
  if (suffix == "T") v *= 1e12;
  REQUIRE_MESSAGE((suffix.empty() || suffix == "k" || suffix == "M" || suffix == "G" || suffix == "T"), label);
  return v;
}

// The ticks of one axis ("xtick" or "ytick") as (value, pixel), in document order.
Points ticks(const std::string& svg, const std::string& cls, const std::string& coord) {
  Points out;
  const std::regex re("<text class=\"" + cls + "\"[^>]*>([^<]*)</text>");
  for (std::sregex_iterator it(svg.begin(), svg.end(), re), end; it != end; ++it)
    out.emplace_back(label_value((*it)[1]), attr(it->str(), coord));
  return out;
}

// The pixel of a value on an axis, fitted through its first and last tick; checks that every tick
// lies on that line and that the ticks step evenly by a nice amount.
struct AxisMap {
  double a = 0, b = 0;
  double operator()(double v) const { return a * v + b; }
};
AxisMap axis_from_ticks(const Points& t) {
  REQUIRE(t.size() >= 2);
  AxisMap m;
  m.a = (t.back().second - t.front().second) / (t.back().first - t.front().first);
  m.b = t.front().second - m.a * t.front().first;
  for (size_t i = 0; i < t.size(); ++i) {
    CHECK(std::abs(m(t[i].first) - t[i].second) < 0.11);
    if (i > 0) {
      CHECK(is_nice_step(t[i].first - t[i - 1].first));
      CHECK((t[i].first - t[i - 1].first) == doctest::Approx(t[1].first - t[0].first));
    }
  }
  return m;
}

cw::Chart one_panel(std::vector<cw::Series> series, std::string title = "chart") {
  return cw::Chart{std::move(title), "tokens", {cw::Panel{"loss", std::move(series), 300}}, 960, {}};
}

struct Frame {
  double x, y, w, h;
};
std::vector<Frame> frames(const std::string& svg) {
  std::vector<Frame> out;
  for (const std::string& tag : tags(svg, "<rect class=\"frame\""))
    out.push_back({attr(tag, "x"), attr(tag, "y"), attr(tag, "width"), attr(tag, "height")});
  return out;
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
  CHECK(cw::format_tick_labels({7.5}) == V{"7.5"});
  // Ticks finer than three significant digits still get labels that differ.
  const std::vector<std::string> fine = cw::format_tick_labels(cw::nice_ticks(1.0e6, 1.01e6, 6));
  REQUIRE(fine.size() >= 2);
  for (size_t i = 1; i < fine.size(); ++i) CHECK(fine[i] != fine[i - 1]);
  CHECK(fine.front() == "1M");
}

TEST_CASE("well_formed (the test's checker) catches broken documents") {
  const std::string head = "<?xml version=\"1.0\"?>\n";
  CHECK(well_formed(head + "<svg><g><rect/></g><text>a &amp; b</text></svg>\n") == "");
  CHECK(well_formed(head + "<svg><g></svg>") != "");
  CHECK(well_formed(head + "<svg><g></g>") != "");
  CHECK(well_formed(head + "<svg><text>a < b</text></svg>") != "");
  CHECK(well_formed(head + "<svg><text>a & b</text></svg>") != "");
  CHECK(well_formed(head + "<svg x=\"1></svg>") != "");
}

TEST_CASE("render_svg: a well-formed document with title, labels and legend as text") {
  cw::Series train{"train loss", {}, {}, kBlue, false}, eval{"eval loss", {}, {}, kOrange, true};
  for (int i = 1; i <= 200; ++i) {
    train.x.push_back(i * 5e6);
    train.y.push_back(3.0 + 8.0 * std::exp(-i / 15.0));
    if (i % 40 == 0) eval.x.push_back(i * 5e6), eval.y.push_back(3.1 + 8.0 * std::exp(-i / 15.0));
  }
  cw::Chart chart = one_panel({train, eval}, "tiny / seco: <loss> & \"lr\"");
  chart.panels.push_back({"learning rate", {cw::Series{"", train.x, std::vector<double>(200, 3e-4), 0x2CA02C, false}}, 120});
  const std::string svg = cw::render_svg(chart);
  INFO(svg.substr(0, 600));
  CHECK(well_formed(svg) == "");
  CHECK(svg.find("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"960\"") != std::string::npos);
  CHECK(svg.find(">tiny / seco: &lt;loss&gt; &amp; &quot;lr&quot;</text>") != std::string::npos);
  CHECK(svg.find(">tokens</text>") != std::string::npos);
  CHECK(svg.find(">loss</text>") != std::string::npos);
  CHECK(svg.find(">learning rate</text>") != std::string::npos);
  CHECK(tags(svg, "<g class=\"legend\"").size() == 1);  // the lr panel's series has no label
  CHECK(svg.find(">train loss</text>") != std::string::npos);
  CHECK(svg.find(">eval loss</text>") != std::string::npos);
  CHECK(svg.find("stroke=\"#1f77b4\"") != std::string::npos);
  CHECK(svg.find("fill=\"#ff7f0e\"") != std::string::npos);
  CHECK(frames(svg).size() == 2);
  CHECK(polylines(svg).size() == 3);          // train, eval, lr
  CHECK(circles(svg).size() == 5 + 1);        // the eval markers and the legend's
  CHECK(ticks(svg, "xtick", "x").size() >= 4);  // under the bottom panel only
  CHECK(svg.find("nan") == std::string::npos);
  CHECK(svg.find("inf") == std::string::npos);
}

TEST_CASE("render_svg: polyline points are the data mapped through the axes the tick labels state") {
  cw::Series s{"", {}, {}, kBlue, false};
  for (int i = 0; i <= 20; ++i) s.x.push_back(1e6 + i * 2.5e5), s.y.push_back(2.0 + 0.01 * i * i);
  const std::string svg = cw::render_svg(one_panel({s}));
  REQUIRE(well_formed(svg) == "");
  const AxisMap mx = axis_from_ticks(ticks(svg, "xtick", "x")), my = axis_from_ticks(ticks(svg, "ytick", "y"));
  CHECK(mx.a > 0);
  CHECK(my.a < 0);  // y grows upwards
  const std::vector<Points> lines = polylines(svg);
  REQUIRE(lines.size() == 1);
  REQUIRE(lines[0].size() == s.x.size());
  const std::vector<Frame> f = frames(svg);
  REQUIRE(f.size() == 1);
  for (size_t i = 0; i < s.x.size(); ++i) {
    INFO("point ", i);
    CHECK(std::abs(lines[0][i].first - mx(s.x[i])) < kTol);
    CHECK(std::abs(lines[0][i].second - my(s.y[i])) < kTol);
    CHECK(lines[0][i].first >= f[0].x - 0.05);
    CHECK(lines[0][i].first <= f[0].x + f[0].w + 0.05);
    CHECK(lines[0][i].second >= f[0].y);
    CHECK(lines[0][i].second <= f[0].y + f[0].h);
  }
  // The x range is the data's, end to end.
  CHECK(lines[0].front().first == doctest::Approx(f[0].x));
  CHECK(lines[0].back().first == doctest::Approx(f[0].x + f[0].w));
}

TEST_CASE("render_svg: NaN and inf break the line; a lone point between gaps is a dot") {
  const cw::Series s{"", {0, 1, 2, 3, 4, 5, 6, 7}, {1, 2, kNaN, 3, 4, INFINITY, 5, -INFINITY}, kBlue, false};
  const std::string svg = cw::render_svg(one_panel({s}));
  REQUIRE(well_formed(svg) == "");
  const AxisMap mx = axis_from_ticks(ticks(svg, "xtick", "x")), my = axis_from_ticks(ticks(svg, "ytick", "y"));
  const std::vector<Points> lines = polylines(svg);
  REQUIRE(lines.size() == 2);
  REQUIRE(lines[0].size() == 2);
  REQUIRE(lines[1].size() == 2);
  CHECK(std::abs(lines[0][1].first - mx(1)) < kTol);
  CHECK(std::abs(lines[1][0].first - mx(3)) < kTol);
  CHECK(std::abs(lines[1][1].second - my(4)) < kTol);
  const Points dots = circles(svg);
  REQUIRE(dots.size() == 1);
  CHECK(std::abs(dots[0].first - mx(6)) < kTol);
  CHECK(std::abs(dots[0].second - my(5)) < kTol);
  // A non-finite x is a gap too.
  CHECK(polylines(cw::render_svg(one_panel({cw::Series{"", {0, kNaN, 2, 3}, {1, 1, 2, 3}, kBlue, false}})))[0].size() == 2);
}

TEST_CASE("render_svg: single point, constant, all-NaN and empty data give a chart") {
  const std::string single = cw::render_svg(one_panel({cw::Series{"one", {5}, {7}, kOrange, false}}));
  CHECK(well_formed(single) == "");
  CHECK(polylines(single).empty());
  CHECK(circles(single).size() == 1);
  const Points yt = ticks(single, "ytick", "y");
  REQUIRE(!yt.empty());
  CHECK(yt.front().first <= 7);
  CHECK(yt.back().first >= 7);

  const std::string constant = cw::render_svg(one_panel({cw::Series{"", {0, 1, 2, 3}, {2, 2, 2, 2}, kBlue, false}}));
  CHECK(well_formed(constant) == "");
  const std::vector<Points> lines = polylines(constant);
  REQUIRE(lines.size() == 1);
  const AxisMap my = axis_from_ticks(ticks(constant, "ytick", "y"));
  for (const auto& p : lines[0]) CHECK(std::abs(p.second - my(2)) < kTol);
  CHECK(std::abs(lines[0][0].second - (frames(constant)[0].y + frames(constant)[0].h / 2)) < kTol);  // centred

  for (const cw::Chart& c : {one_panel({cw::Series{"nan", {0, 1}, {kNaN, INFINITY}, kBlue, false}}), one_panel({}),
                             one_panel({cw::Series{"empty", {}, {}, kBlue, false}})}) {
    const std::string svg = cw::render_svg(c);
    CHECK(well_formed(svg) == "");
    CHECK(svg.find(">no data</text>") != std::string::npos);
    CHECK(polylines(svg).empty());
    CHECK(ticks(svg, "ytick", "y").size() >= 2);
  }
  CHECK(cw::render_svg(one_panel({cw::Series{"", {0, 1}, {0, 1}, kBlue, false}})).find("no data") == std::string::npos);
}

TEST_CASE("render_svg: a short panel over a narrow range still labels two ticks") {
  // 262..331 MiB in 80 px: room for two ticks at most, and a step of 50 would leave only "300".
  cw::Chart chart = one_panel({cw::Series{"", {0, 1, 2}, {262, 331, 300}, kBlue, false}});
  chart.panels[0].height = 80;
  const std::string svg = cw::render_svg(chart);
  const Points yt = ticks(svg, "ytick", "y");
  CHECK(yt.size() >= 2);
  CHECK(std::abs(polylines(svg)[0][1].second - axis_from_ticks(yt)(331)) < kTol);
}

TEST_CASE("render_svg: bad input is a clear error") {
  CHECK_THROWS_WITH_AS(cw::render_svg(one_panel({cw::Series{"train", {0, 1, 2}, {1, 2}, kBlue, false}})),
                       doctest::Contains("series 'train' has 3 x values but 2 y values"), cw::Error);
  CHECK_THROWS_WITH_AS(cw::render_svg(cw::Chart{"t", "x", {}, 960, {}}), doctest::Contains("no panels"), cw::Error);
  cw::Chart narrow = one_panel({});
  narrow.width = 100;
  CHECK_THROWS_WITH_AS(cw::render_svg(narrow), doctest::Contains("width 100"), cw::Error);
  cw::Chart flat = one_panel({});
  flat.panels[0].height = 10;
  CHECK_THROWS_WITH_AS(cw::render_svg(flat), doctest::Contains("height 10"), cw::Error);
}

TEST_CASE("render_svg: a long series is thinned per pixel column, keeping its extremes") {
  cw::Series s{"", {}, {}, kBlue, false};
  std::mt19937 rng(5);
  std::normal_distribution<double> noise(0.0, 0.1);
  for (int i = 0; i < 200000; ++i) s.x.push_back(i), s.y.push_back(3 + noise(rng));
  s.y[123456] = 10;  // a spike
  s.y[7] = -5;
  const std::string svg = cw::render_svg(one_panel({s}));
  CHECK(well_formed(svg) == "");
  CHECK(svg.size() < 200000);
  const std::vector<Points> lines = polylines(svg);
  REQUIRE(lines.size() == 1);
  CHECK(lines[0].size() <= 4 * 860);
  const AxisMap my = axis_from_ticks(ticks(svg, "ytick", "y"));
  double top = 1e9, bottom = -1e9;
  for (const auto& p : lines[0]) top = std::min(top, p.second), bottom = std::max(bottom, p.second);
  CHECK(std::abs(top - my(10)) < kTol);
  CHECK(std::abs(bottom - my(-5)) < kTol);
}

TEST_CASE("render_svg: the legend goes in the inside corner with the least data under it") {
  const auto legend_x = [](const cw::Series& s) {
    const std::string svg = cw::render_svg(one_panel({s}));
    const size_t legend = svg.find("<g class=\"legend\">");
    REQUIRE(legend != std::string::npos);
    const std::vector<std::string> box = tags(svg.substr(legend), "<rect");
    return attr(box[0], "x") < 480 ? "left" : "right";
  };
  // Falling, like a loss: top right is free. Rising: top left is.
  CHECK(std::string(legend_x(cw::Series{"falling", {0, 1, 2, 3}, {4, 3, 2, 1}, kBlue, false})) == "right");
  CHECK(std::string(legend_x(cw::Series{"rising", {0, 1, 2, 3}, {1, 2, 3, 4}, kBlue, false})) == "left");
}

TEST_CASE("write_svg writes the rendered document atomically and names the file on failure") {
  cw::test::TempDir dir("plot");
  const std::string path = dir.file("loss.svg");
  const cw::Chart chart = one_panel({cw::Series{"train", {0, 1, 2}, {3, 2, 1}, kBlue, false}});
  cw::write_svg(path, chart);
  CHECK(cw::test::read_text(path) == cw::render_svg(chart));
  for (const auto& e : std::filesystem::directory_iterator(dir.path)) CHECK(e.path().filename() == "loss.svg");
  const std::string missing = dir.file("no/such/dir/chart.svg");
  CHECK_THROWS_WITH_AS(cw::write_svg(missing, chart), doctest::Contains(missing.c_str()), cw::Error);
}

TEST_CASE("run_chart: loss, eval loss, learning rate and host memory from metrics.jsonl") {
  cw::test::TempDir dir("plot-run");
  const std::string path = dir.file("metrics.jsonl");
  {
    std::ofstream out(path);
    out << R"({"step":1,"loss":5.0,"lr":1e-4,"tokens":100,"rss_mib":1500.0,"skipped":false})" << "\n"
        << R"({"step":1,"memory_weights":1234})" << "\n"
        << R"({"step":2,"loss":null,"lr":2e-4,"tokens":200,"rss_mib":1600.0,"skipped":true})" << "\n"
        << R"({"step":3,"loss":4.0,"lr":3e-4,"tokens":300,"rss_mib":2048.0})" << "\n"
        << R"({"step":3,"eval_loss":4.2,"tokens":300})" << "\n"
        << "\n"
        << R"({"step":4,"loss":3.5,"lr":)";  // torn by a writer still at work
  }
  const cw::Chart c = cw::run_chart(path, "run");
  CHECK(c.title == "run");
  CHECK(c.x_label == "tokens seen");
  REQUIRE(c.panels.size() == 3);
  REQUIRE(c.panels[0].series.size() == 2);
  const cw::Series& train = c.panels[0].series[0];
  CHECK(train.label == "train loss");
  CHECK(train.x == std::vector<double>{100, 200, 300});
  REQUIRE(train.y.size() == 3);
  CHECK(train.y[0] == 5.0);
  CHECK(std::isnan(train.y[1]));  // a skipped step's NaN loss is a gap
  CHECK(c.panels[0].series[1].label == "eval loss");
  CHECK(c.panels[0].series[1].markers);
  CHECK(c.panels[0].series[1].y == std::vector<double>{4.2});
  CHECK(c.panels[1].y_label == "learning rate");
  CHECK(c.panels[1].series[0].y == std::vector<double>{1e-4, 2e-4, 3e-4});
  CHECK(c.panels[2].y_label == "host memory (GiB)");
  CHECK(c.panels[2].series[0].y.back() == 2.0);
  CHECK(well_formed(cw::render_svg(c)) == "");

  // A GPU run's log: the device's pool beside the host's memory, one panel, each series labelled.
  {
    std::ofstream out(path);
    out << R"({"step":1,"loss":5.0,"tokens":100,"rss_mib":900.0,"device_mib":30000.0,"device_peak_mib":31000.0})"
        << "\n"
        << R"({"step":2,"loss":4.0,"tokens":200,"rss_mib":950.0,"device_mib":30000.0,"device_peak_mib":32768.0})"
        << "\n";
  }
  const cw::Chart gpu = cw::run_chart(path, "gpu run");
  REQUIRE(gpu.panels.size() == 2);
  CHECK(gpu.panels[1].y_label == "memory (GiB)");
  REQUIRE(gpu.panels[1].series.size() == 3);
  CHECK(gpu.panels[1].series[0].label == "host (RSS)");
  CHECK(gpu.panels[1].series[1].label == "device, in use after the step");
  CHECK(gpu.panels[1].series[2].y.back() == 32.0);
  CHECK(gpu.panels[1].y_from_zero);
  CHECK(well_formed(cw::render_svg(gpu)) == "");

  // An older log with loss only: one panel, no legend entry for a missing eval.
  {
    std::ofstream out(path);
    out << R"({"step":1,"loss":5.0,"tokens":100})" << "\n";
  }
  const cw::Chart lean = cw::run_chart(path, "run");
  REQUIRE(lean.panels.size() == 1);
  CHECK(lean.panels[0].series.size() == 1);
  CHECK_THROWS_WITH_AS(cw::run_chart(dir.file("absent.jsonl"), "run"), doctest::Contains("absent.jsonl"), cw::Error);
}

}  // TEST_SUITE

// ---- stacked bars ----

namespace {
// The class="segment" rectangles in order: x, width.
std::vector<std::pair<double, double>> segments(const std::string& svg) {
  std::vector<std::pair<double, double>> out;
  for (const std::string& t : tags(svg, "<rect class=\"segment\"")) out.emplace_back(attr(t, "x"), attr(t, "width"));
  return out;
}
}  // namespace

TEST_CASE("format_amount: thousands apart from 100 up, three significant digits below") {
  CHECK(cw::format_amount(3259.4) == "3,259");
  CHECK(cw::format_amount(1234567) == "1,234,567");
  CHECK(cw::format_amount(100) == "100");
  CHECK(cw::format_amount(999.6) == "1,000");
  CHECK(cw::format_amount(42.26) == "42.3");
  CHECK(cw::format_amount(0.5) == "0.5");
  CHECK(cw::format_amount(9.999) == "10");
  CHECK(cw::format_amount(0) == "0");
  CHECK(cw::format_amount(-2500) == "-2,500");
}

TEST_CASE("render_svg (bars): segments proportional to the values, stacked in order, totals and legend as text") {
  cw::BarChart chart;
  chart.title = "a <step> & its \"parts\"";
  chart.x_label = "ms a step";
  chart.categories = {"attention", "matmul", "idle"};
  chart.bars = {{"ours", {600, 300, 100}}, {"the peer's", {1200, 300, 0}}};
  const std::string svg = cw::render_svg(chart);
  INFO(svg.substr(0, 800));
  CHECK(well_formed(svg) == "");
  CHECK(svg.find(">a &lt;step&gt; &amp; its &quot;parts&quot;</text>") != std::string::npos);
  for (const char* text : {">ours</text>", ">the peer's</text>", ">attention</text>", ">matmul</text>", ">idle</text>",
                           ">ms a step</text>", ">1,000</text>", ">1,500</text>"})
    CHECK_MESSAGE(svg.find(text) != std::string::npos, text);
  // Five segments (a zero is not drawn): each starts where the one before it ends, widths in proportion.
  const auto s = segments(svg);
  REQUIRE(s.size() == 5);
  const double per_ms = s[0].second / 600;
  CHECK(s[1].first == doctest::Approx(s[0].first + s[0].second).epsilon(1e-4));
  CHECK(s[2].first == doctest::Approx(s[1].first + s[1].second).epsilon(1e-4));
  CHECK(s[1].second == doctest::Approx(300 * per_ms).epsilon(1e-3));
  CHECK(s[2].second == doctest::Approx(100 * per_ms).epsilon(1e-3));
  CHECK(s[3].first == doctest::Approx(s[0].first).epsilon(1e-6));  // every bar starts at 0
  CHECK(s[3].second == doctest::Approx(1200 * per_ms).epsilon(1e-3));
  CHECK(s[4].second == doctest::Approx(300 * per_ms).epsilon(1e-3));
  // The axis the tick labels state: the tick at 1k is 1000 ms from the tick at 0.
  const std::regex tick("<text class=\"xtick\" x=\"([0-9.]+)\"[^>]*>([^<]*)</text>");
  std::map<std::string, double> at;
  for (std::sregex_iterator it(svg.begin(), svg.end(), tick), end; it != end; ++it) at[(*it)[2]] = std::stod((*it)[1]);
  REQUIRE(at.count("0"));
  REQUIRE(at.count("1k"));
  CHECK(at["0"] == doctest::Approx(s[0].first).epsilon(1e-3));
  CHECK(at["1k"] - at["0"] == doctest::Approx(1000 * per_ms).epsilon(1e-3));
  // Wide segments carry their value; the colours are the palette's, by category.
  CHECK(svg.find("class=\"segment-value\"") != std::string::npos);
  CHECK(svg.find(">600</text>") != std::string::npos);
  CHECK(svg == cw::render_svg(chart));  // the same document every time
}

TEST_CASE("render_svg (bars): bad input is a clear error") {
  cw::BarChart chart{"t", "ms", {"a", "b"}, {{"x", {1, 2}}}};
  CHECK_NOTHROW(cw::render_svg(chart));
  cw::BarChart none = chart;
  none.bars.clear();
  CHECK_THROWS_WITH_AS(cw::render_svg(none), doctest::Contains("no bars"), cw::Error);
  cw::BarChart nocat = chart;
  nocat.categories.clear();
  CHECK_THROWS_WITH_AS(cw::render_svg(nocat), doctest::Contains("no categories"), cw::Error);
  cw::BarChart count = chart;
  count.bars[0].values = {1};
  CHECK_THROWS_WITH_AS(cw::render_svg(count), doctest::Contains("'x' has 1 values for 2 categories"), cw::Error);
  cw::BarChart negative = chart;
  negative.bars[0].values = {1, -2};
  CHECK_THROWS_WITH_AS(cw::render_svg(negative), doctest::Contains("for 'b'"), cw::Error);
  cw::BarChart nan = chart;
  nan.bars[0].values = {kNaN, 1};
  CHECK_THROWS_AS(cw::render_svg(nan), cw::Error);
  cw::BarChart narrow = chart;
  narrow.width = 100;
  CHECK_THROWS_WITH_AS(cw::render_svg(narrow), doctest::Contains("width 100"), cw::Error);
}

// ---- heat maps ----

TEST_CASE("heat_colour: light red, yellow, green at 0, 0.5, 1; linear between; clamped") {
  CHECK(cw::heat_colour(0) == 0xF8696B);
  CHECK(cw::heat_colour(0.5) == 0xFFEB84);
  CHECK(cw::heat_colour(1) == 0x63BE7B);
  CHECK(cw::heat_colour(-3) == cw::heat_colour(0));
  CHECK(cw::heat_colour(7) == cw::heat_colour(1));
  // A quarter: halfway from light red to yellow in each channel (0xF8 + 0xFF = 503 -> 252, ...).
  CHECK(cw::heat_colour(0.25) == 0xFCAA78);
  CHECK(cw::heat_colour(0.75) == 0xB1D580);
}

TEST_CASE("render_svg (heat map): a cell a value in the table's place, coloured on the scale, its number in it") {
  cw::HeatMap map;
  map.title = "passkey <retrieval>";
  map.x_label = "prompt length";
  map.y_label = "depth";
  map.columns = {"1K", "2K", "4K"};
  map.rows = {"0%", "50%", "100%"};
  map.values = {{100, 80, 0}, {100, 60, 20}, {kNaN, 40, 100.0 / 3}};
  map.lo = 0;
  map.hi = 100;
  map.unit = "%";
  const std::string svg = cw::render_svg(map);
  INFO(svg.substr(0, 800));
  CHECK(well_formed(svg) == "");
  CHECK(svg.find(">passkey &lt;retrieval&gt;</text>") != std::string::npos);
  for (const char* text : {">prompt length</text>", ">depth</text>"})
    CHECK_MESSAGE(svg.find(text) != std::string::npos, text);

  // The cells row by row, a grid of equal cells; each filled with its value's colour.
  const std::vector<std::string> cells = tags(svg, "<rect class=\"cell\"");
  REQUIRE(cells.size() == 9);
  const double x0 = attr(cells[0], "x"), y0 = attr(cells[0], "y"), w = attr(cells[0], "width"), h = attr(cells[0], "height");
  CHECK(w > 0);
  CHECK(h <= 60);
  const std::regex fill(" fill=\"(#[0-9a-f]{6})\"");
  std::map<std::pair<long, long>, std::string> text_at;  // a cell's number, by its centre (tenths of a pixel)
  const std::regex value("<text class=\"cell-value\" x=\"([0-9.]+)\" y=\"([0-9.]+)\"[^>]*>([^<]*)</text>");
  for (std::sregex_iterator it(svg.begin(), svg.end(), value), end; it != end; ++it)
    text_at[{std::lround(10 * std::stod((*it)[1])), std::lround(10 * std::stod((*it)[2]))}] = (*it)[3];
  const std::vector<std::vector<std::string>> written = {{"100%", "80%", "0%"}, {"100%", "60%", "20%"}, {"-", "40%", "33.3%"}};
  for (size_t r = 0; r < 3; ++r)
    for (size_t c = 0; c < 3; ++c) {
      CAPTURE(r);
      CAPTURE(c);
      const std::string& cell = cells[r * 3 + c];
      CHECK(std::abs(attr(cell, "x") - (x0 + w * double(c))) < kTol);
      CHECK(std::abs(attr(cell, "y") - (y0 + h * double(r))) < kTol);
      CHECK(attr(cell, "width") == w);
      CHECK(attr(cell, "height") == h);
      std::smatch m;
      REQUIRE(std::regex_search(cell, m, fill));
      const double v = map.values[r][c];
      CHECK(m[1] == (std::isfinite(v) ? fmt::format("#{:06x}", cw::heat_colour(v / 100)) : std::string("#dddddd")));
      const auto centre = std::make_pair(std::lround(10 * (attr(cell, "x") + w / 2)), std::lround(10 * (attr(cell, "y") + h / 2)));
      // Centres from the rounded rectangle may differ from the text's by a tenth.
      std::string got;
      for (const auto& [at, text] : text_at)
        if (std::abs(at.first - centre.first) <= 1 && std::abs(at.second - centre.second) <= 1) got = text;
      CHECK(got == written[r][c]);
    }
  // Column labels under the columns' centres, row labels beside the rows' centres, in order.
  const std::regex xtick("<text class=\"xtick\" x=\"([0-9.]+)\"[^>]*>([^<]*)</text>");
  std::vector<std::pair<double, std::string>> xt;
  for (std::sregex_iterator it(svg.begin(), svg.end(), xtick), end; it != end; ++it) xt.emplace_back(std::stod((*it)[1]), (*it)[2]);
  REQUIRE(xt.size() == 3);
  for (size_t c = 0; c < 3; ++c) {
    CHECK(xt[c].second == map.columns[c]);
    CHECK(std::abs(xt[c].first - (x0 + w * (double(c) + 0.5))) < kTol);
  }
  const std::regex ytick("<text class=\"ytick\" x=\"[0-9.]+\" y=\"([0-9.]+)\"[^>]*>([^<]*)</text>");
  std::vector<std::pair<double, std::string>> yt;
  for (std::sregex_iterator it(svg.begin(), svg.end(), ytick), end; it != end; ++it) yt.emplace_back(std::stod((*it)[1]), (*it)[2]);
  REQUIRE(yt.size() == 3);
  for (size_t r = 0; r < 3; ++r) {
    CHECK(yt[r].second == map.rows[r]);
    CHECK(std::abs(yt[r].first - (y0 + h * (double(r) + 0.5))) < kTol);
  }
  // The scale: its ends labelled, right of the grid.
  const std::vector<std::string> scale = tags(svg, "<rect class=\"scale\"");
  REQUIRE(scale.size() == 1);
  CHECK(attr(scale[0], "x") > x0 + 3 * w);
  CHECK(svg.find("class=\"scale-label\"") != std::string::npos);
  CHECK(svg.find(">100%</text>\n<text class=\"scale-label\"") != std::string::npos);  // hi, then lo
  CHECK(svg == cw::render_svg(map));  // the same document every time
}

TEST_CASE("render_svg (heat map): bad input is a clear error") {
  cw::HeatMap map;
  map.columns = {"a", "b"};
  map.rows = {"x"};
  map.values = {{0.5, 1}};
  CHECK_NOTHROW(cw::render_svg(map));
  cw::HeatMap empty = map;
  empty.columns.clear();
  CHECK_THROWS_WITH_AS(cw::render_svg(empty), doctest::Contains("0 columns and 1 rows"), cw::Error);
  cw::HeatMap rows = map;
  rows.values.push_back({1, 2});
  CHECK_THROWS_WITH_AS(cw::render_svg(rows), doctest::Contains("2 rows of values for 1 row labels"), cw::Error);
  cw::HeatMap short_row = map;
  short_row.values[0] = {1};
  CHECK_THROWS_WITH_AS(cw::render_svg(short_row), doctest::Contains("row 'x' has 1 values for 2 columns"), cw::Error);
  cw::HeatMap scale = map;
  scale.lo = 1;
  CHECK_THROWS_WITH_AS(cw::render_svg(scale), doctest::Contains("the scale [1, 1] is empty"), cw::Error);
  cw::HeatMap narrow = map;
  narrow.width = 100;
  CHECK_THROWS_WITH_AS(cw::render_svg(narrow), doctest::Contains("width 100"), cw::Error);
}
