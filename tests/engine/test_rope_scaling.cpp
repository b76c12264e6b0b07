// RoPE scaling (engine/ops/rope.h): YaRN and dynamic NTK against transformers' own values
// (tests/data/rope_scaling_reference.json, written by rope_scaling_reference.py: its float32 and a
// float64 transcription of the same formulas), and what a dynamic table is: the frequencies of one
// sequence length. The rope op with yarn tables is also a row of the op table (test_backend_ops.cpp).
#include "engine/ops/rope.h"
#include "tests/support.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>

using namespace cw;
using namespace cw::test;
using nlohmann::json;

namespace {
// The float64 transcription against ours: the same formulas, libm's pow, log and cos against numpy's
// (a few ulps); an angle's rounding grows with the angle.
constexpr double kF64ReferenceTol = 1e-14;
// transformers computes in float32: inv_freq through a float32 pow, product and quotient (a few ulps
// of 2^-24); an angle p inv_freq rounds again, so its error grows with the angle.
constexpr double kHfInvFreqTol = 1e-6;
constexpr double kHfAngleTol = 5e-7;
constexpr double kHfValueTol = 1e-6;

json reference_cases() {
  std::ifstream in(std::string(CW_SOURCE_ROOT) + "/tests/data/rope_scaling_reference.json");
  REQUIRE(in.good());
  return json::parse(in).at("cases");
}

// A case's scaling as transformers resolves it ("resolved": defaults filled in, a null factor derived).
RopeScaling scaling_of(const json& r) {
  RopeScaling s;
  s.type = r.at("rope_type") == "yarn" ? RopeScaling::Type::yarn : RopeScaling::Type::dynamic;
  s.factor = r.at("factor").get<double>();
  s.original_max_position = r.at("original_max_position_embeddings").get<int64_t>();
  if (s.type == RopeScaling::Type::dynamic) return s;
  s.beta_fast = r.at("beta_fast").get<double>();
  s.beta_slow = r.at("beta_slow").get<double>();
  s.truncate = r.at("truncate").get<bool>();
  for (auto [key, slot] : {std::pair{"attention_factor", &s.attention_factor}, std::pair{"mscale", &s.mscale},
                           std::pair{"mscale_all_dim", &s.mscale_all_dim}})
    if (!r.at(key).is_null()) *slot = r.at(key).get<double>();
  return s;
}

// The worst of |got_i - want_i| / bound_i; a pass is <= 1.
struct Excess {
  double ratio = 0;
  size_t index = 0;
  double got = 0, want = 0;
  std::string str() const { return fmt::format("worst #{}: {:.17g} vs {:.17g} ({:.2f} x the bound)", index, got, want, ratio); }
};
template <class Bound>
Excess excess(const std::vector<double>& got, const std::vector<double>& want, Bound bound) {
  REQUIRE(got.size() == want.size());
  Excess e;
  for (size_t i = 0; i < got.size(); ++i)
    if (const double r = std::abs(got[i] - want[i]) / bound(i); r >= e.ratio) e = {r, i, got[i], want[i]};
  return e;
}
}  // namespace

TEST_CASE("rope scaling: yarn and dynamic inv_freq, attention factor and tables equal transformers'") {
  const json cases = reference_cases();
  CHECK(cases.size() >= 10);
  for (const json& c : cases) {
    INFO(c.at("name").get<std::string>());
    const int64_t D = c.at("head_dim"), P = c.at("rows"), half = D / 2;
    const double theta = c.at("rope_theta");
    const int64_t seq_len = c.at("seq_len").is_null() ? 0 : c.at("seq_len").get<int64_t>();
    const RopeScaling s = scaling_of(c.at("resolved"));

    const std::vector<double> inv = rope_inv_freq(D, theta, s, seq_len);
    const auto want_inv = c.at("inv_freq").get<std::vector<double>>();
    const Excess f64_inv = excess(inv, want_inv, [&](size_t i) { return kF64ReferenceTol * want_inv[i]; });
    INFO("f64 inv_freq: " << f64_inv.str());
    CHECK(f64_inv.ratio <= 1.0);
    const auto hf_inv = c.at("hf_inv_freq").get<std::vector<double>>();
    const Excess hf_inv_err = excess(inv, hf_inv, [&](size_t i) { return kHfInvFreqTol * hf_inv[i]; });
    INFO("transformers' f32 inv_freq: " << hf_inv_err.str());
    CHECK(hf_inv_err.ratio <= 1.0);
    const double a = rope_attention_factor(s);
    CHECK(a == doctest::Approx(c.at("attention_factor").get<double>()).epsilon(kF64ReferenceTol));
    CHECK(a == doctest::Approx(c.at("hf_attention_factor").get<double>()).epsilon(kF64ReferenceTol));

    // The table of P rows (dynamic: the sequence's length) at the recorded positions.
    OwnedTensor cos(DType::f64, {P, half}), sin(DType::f64, {P, half});
    rope_tables(cos, sin, D, theta, s);
    std::vector<double> got_cos, got_sin, angles;
    for (const int64_t p : c.at("positions").get<std::vector<int64_t>>())
      for (int64_t i = 0; i < half; ++i) {
        got_cos.push_back(cos.tensor.ptr<double>()[p * half + i]);
        got_sin.push_back(sin.tensor.ptr<double>()[p * half + i]);
        angles.push_back(static_cast<double>(p) * inv[static_cast<size_t>(i)]);
      }
    auto flat = [&](const char* key) {
      std::vector<double> v;
      for (const auto& row : c.at(key)) for (const double x : row) v.push_back(x);
      return v;
    };
    const auto f64_bound = [&](size_t i) { return a * (std::abs(angles[i]) + 1.0) * kF64ReferenceTol; };
    const auto hf_bound = [&](size_t i) { return a * (std::abs(angles[i]) * kHfAngleTol + kHfValueTol); };
    for (const auto& [name, got, f64_key, hf_key] :
         {std::tuple{"cos", &got_cos, "cos", "hf_cos"}, std::tuple{"sin", &got_sin, "sin", "hf_sin"}}) {
      const Excess e64 = excess(*got, flat(f64_key), f64_bound), ehf = excess(*got, flat(hf_key), hf_bound);
      INFO(name << " f64: " << e64.str() << "; transformers' f32: " << ehf.str());
      CHECK(e64.ratio <= 1.0);
      CHECK(ehf.ratio <= 1.0);
    }
  }
}

TEST_CASE("rope scaling: yarn's tables are the attention factor times a rotation; its frequencies by the ramp") {
  const RopeScaling s{.type = RopeScaling::Type::yarn, .factor = 8.0, .original_max_position = 64};
  const int64_t D = 16, P = 40, half = D / 2;
  OwnedTensor cos(DType::f64, {P, half}), sin(DType::f64, {P, half});
  rope_tables(cos, sin, D, 10000.0, s);
  const double a = 0.1 * std::log(8.0) + 1.0;
  CHECK(rope_attention_factor(s) == doctest::Approx(a).epsilon(1e-15));
  for (int64_t k = 0; k < P * half; ++k) {
    const double c = cos.tensor.ptr<double>()[k], n = sin.tensor.ptr<double>()[k];
    CHECK(c * c + n * n == doctest::Approx(a * a).epsilon(1e-14));
  }
  // The fastest frequency is kept, the slowest divided by the factor (the ramp's two ends).
  const std::vector<double> plain = rope_inv_freq(D, 10000.0, RopeScaling{});
  const std::vector<double> yarn = rope_inv_freq(D, 10000.0, s);
  CHECK(yarn.front() == plain.front());
  CHECK(yarn.back() == doctest::Approx(plain.back() / 8.0).epsilon(1e-15));
  // attention_factor given wins; mscale and mscale_all_dim count only together and non-zero.
  RopeScaling given = s;
  given.attention_factor = 1.5;
  CHECK(rope_attention_factor(given) == 1.5);
  RopeScaling half_given = s;
  half_given.mscale = 0.7;
  CHECK(rope_attention_factor(half_given) == rope_attention_factor(s));
  half_given.mscale_all_dim = 0.0;
  CHECK(rope_attention_factor(half_given) == rope_attention_factor(s));
  CHECK(rope_attention_factor(RopeScaling{RopeScaling::Type::llama3, 8.0, 1.0, 4.0, 64}) == 1.0);
}

TEST_CASE("rope scaling: a dynamic table holds the frequencies of its own length") {
  const RopeScaling dyn{.type = RopeScaling::Type::dynamic, .factor = 4.0, .original_max_position = 16};
  const int64_t D = 8, half = D / 2;
  auto table = [&](int64_t rows, const RopeScaling& s) {
    OwnedTensor cos(DType::f64, {rows, half}), sin(DType::f64, {rows, half});
    rope_tables(cos, sin, D, 10000.0, s);
    return std::vector<double>(cos.tensor.ptr<double>(), cos.tensor.ptr<double>() + rows * half);
  };
  // Up to the original length: the unscaled table.
  CHECK(table(16, dyn) == table(16, RopeScaling{}));
  CHECK(table(5, dyn) == table(5, RopeScaling{}));
  // Above it: theta (factor n / original - (factor - 1))^(D / (D - 2)), n the table's length.
  const std::vector<double> t40 = table(40, dyn), t20 = table(20, dyn);
  const double base40 = 10000.0 * std::pow(4.0 * 40 / 16 - 3.0, 8.0 / 6.0);
  CHECK(rope_inv_freq(D, 10000.0, dyn, 40)[1] == doctest::Approx(std::pow(base40, -2.0 / 8.0)).epsilon(1e-15));
  CHECK(t40[5 * half + 1] == doctest::Approx(std::cos(5.0 * std::pow(base40, -2.0 / 8.0))).epsilon(1e-14));
  CHECK(t40[5 * half + 1] != t20[5 * half + 1]);  // the same position, another length: another angle
  CHECK(t40[5 * half] == t20[5 * half]);          // frequency 0 is 1 at every base
  // Which tables serve a sequence of n tokens.
  CHECK(rope_tables_serve(dyn, 16, 10));   // both at the original frequencies
  CHECK(rope_tables_serve(dyn, 40, 40));
  CHECK_FALSE(rope_tables_serve(dyn, 40, 30));  // built for 40, asked for 30: other frequencies
  CHECK_FALSE(rope_tables_serve(dyn, 40, 10));
  CHECK_FALSE(rope_tables_serve(dyn, 16, 17));  // too short
  const RopeScaling yarn{.type = RopeScaling::Type::yarn, .factor = 4.0, .original_max_position = 16};
  CHECK(rope_tables_serve(yarn, 40, 10));  // every other scaling: any longer table
  CHECK_FALSE(rope_tables_serve(yarn, 8, 10));
  CHECK(rope_type_name(RopeScaling::Type::dynamic) == "dynamic");
  CHECK(rope_type_name(RopeScaling::Type::none) == "default");
}
