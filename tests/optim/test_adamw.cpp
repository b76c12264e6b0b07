// AdamW against a hand-written f64 reference, its decay selection, bias correction, save/load
// (bit-exact, resumable, validated), the gradient norm helpers and the learning-rate schedule.
#include "engine/random.h"
#include "model/safetensors.h"
#include "optim/adamw.h"
#include "optim/lr_schedule.h"
#include "tests/support.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <numbers>
#include <vector>

using namespace cw;

namespace {

using test::contains;
using test::error_of;

// One rounding per operation in a handful of operations: both computations agree to a few ulps.
constexpr double kSameFormulaTol = 1e-15;

LlamaConfig tiny(bool tied = false) {
  LlamaConfig c = LlamaConfig::preset("tiny");
  c.tie_word_embeddings = tied;
  return c;
}

ParamSet make_params(const LlamaConfig& c, DType dtype, uint64_t seed = 7) {
  ParamSet p(c, dtype);
  init_parameters(p, seed, c.initializer_range, /*norm_jitter=*/0.1);
  return p;
}

// Gradients for step `step`: every tensor gets its own stream, scale varied so that m and v differ.
void fill_grads(ParamSet& g, uint64_t step) {
  for (size_t i = 0; i < g.size(); ++i) fill_normal(g[i], 1000 + step, i, 0.0, 0.01 * static_cast<double>(i + 1));
}

ParamSet copy_of(const ParamSet& src, const LlamaConfig& c) {
  ParamSet dst(c, src.dtype());
  copy_convert(dst.flat(), src.flat());
  return dst;
}

bool same_bits(const ParamSet& a, const ParamSet& b) {
  return a.flat().bytes() == b.flat().bytes() && std::memcmp(a.flat().data, b.flat().data, a.flat().bytes()) == 0;
}

// The reference: AdamW written out for one element sequence, all in f64, from the paper's algorithm.
struct RefState {
  std::vector<double> m, v;
};

void reference_step(std::vector<double>& p, RefState& s, const std::vector<double>& g, int t, double lr,
                    const AdamWOptions& o, const std::vector<bool>& decayed) {
  if (s.m.empty()) {
    s.m.assign(p.size(), 0.0);
    s.v.assign(p.size(), 0.0);
  }
  for (size_t i = 0; i < p.size(); ++i) {
    s.m[i] = o.beta1 * s.m[i] + (1 - o.beta1) * g[i];
    s.v[i] = o.beta2 * s.v[i] + (1 - o.beta2) * g[i] * g[i];
    const double mhat = s.m[i] / (1 - std::pow(o.beta1, t));
    const double vhat = s.v[i] / (1 - std::pow(o.beta2, t));
    const double wd = decayed[i] ? o.weight_decay : 0.0;
    p[i] = p[i] - lr * (mhat / (std::sqrt(vhat) + o.eps) + wd * p[i]);
  }
}

std::vector<double> to_vector(const ParamSet& s) {
  const Tensor f = s.flat();
  return std::vector<double>(f.ptr<double>(), f.ptr<double>() + f.numel());
}

// Per element: |a - b| <= tol |b|.
void check_close(const std::vector<double>& a, const std::vector<double>& b, double tol, const char* what) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double r = std::abs(a[i] - b[i]) / std::max(std::abs(b[i]), std::numeric_limits<double>::min());
    if (a[i] != b[i] && r > worst) {
      worst = r;
      at = i;
    }
  }
  INFO(what << ": worst relative error " << worst << " at element " << at);
  CHECK(worst <= tol);
}

// Which flat elements are decayed, tensor by tensor.
std::vector<bool> decay_mask(const AdamW& opt, const ParamSet& p) {
  std::vector<bool> mask;
  for (size_t i = 0; i < p.size(); ++i) mask.insert(mask.end(), static_cast<size_t>(p[i].numel()), opt.decays(p.specs()[i]));
  return mask;
}

}  // namespace

TEST_CASE("adamw: three steps match the f64 reference element-wise") {
  const LlamaConfig c = tiny();
  for (int variant = 0; variant < 2; ++variant) {
    AdamWOptions o;
    if (variant == 1) {
      o.beta1 = 0.8;
      o.beta2 = 0.999;
      o.eps = 1e-6;
      o.weight_decay = 0.3;
      o.decay_norms = true;
      o.decay_embeddings = true;
    }
    CAPTURE(variant);
    ParamSet p = make_params(c, DType::f64), g(c, DType::f64);
    AdamW opt(p, o);
    std::vector<double> ref = to_vector(p);
    RefState rs;
    const std::vector<bool> mask = decay_mask(opt, p);
    const double lrs[3] = {1e-3, 2.5e-3, 7e-4};
    for (int t = 1; t <= 3; ++t) {
      fill_grads(g, static_cast<uint64_t>(t));
      opt.step(p, g, lrs[t - 1]);
      reference_step(ref, rs, to_vector(g), t, lrs[t - 1], o, mask);
    }
    CHECK(opt.steps() == 3);
    check_close(to_vector(p), ref, kSameFormulaTol, "params");
    check_close(to_vector(opt.exp_avg()), rs.m, kSameFormulaTol, "exp_avg");
    check_close(to_vector(opt.exp_avg_sq()), rs.v, kSameFormulaTol, "exp_avg_sq");
  }
}

TEST_CASE("adamw: f32 master weights follow the f64 run to f32 precision") {
  const LlamaConfig c = tiny();
  ParamSet p64 = make_params(c, DType::f64), g64(c, DType::f64);
  ParamSet p32(c, DType::f32), g32(c, DType::f32);
  copy_convert(p32.flat(), p64.flat());
  AdamW a64(p64), a32(p32);
  CHECK(a32.exp_avg().dtype() == DType::f32);
  for (int t = 1; t <= 3; ++t) {
    fill_grads(g64, static_cast<uint64_t>(t));
    copy_convert(g32.flat(), g64.flat());
    a64.step(p64, g64, 1e-3);
    a32.step(p32, g32, 1e-3);
  }
  const test::Worst w = test::compare(p32.flat(), p64.flat());
  INFO(w.str());
  CHECK(w.rel < 1e-6);
}

TEST_CASE("adamw: weight decay selection") {
  for (bool tied : {false, true}) {
    CAPTURE(tied);
    const LlamaConfig c = tiny(tied);
    for (int variant = 0; variant < 3; ++variant) {
      AdamWOptions o;
      o.decay_norms = variant == 1;
      o.decay_embeddings = variant == 2;
      CAPTURE(variant);
      // Zero gradients: m and v stay 0, so the update is exactly the decay term lr * wd * p.
      ParamSet p = make_params(c, DType::f64), g(c, DType::f64);
      const ParamSet before = copy_of(p, c);
      AdamW opt(p, o);
      const double lr = 0.01;
      opt.step(p, g, lr);
      for (size_t i = 0; i < p.size(); ++i) {
        const ParamSpec& s = p.specs()[i];
        const bool expect = s.is_norm() ? o.decay_norms : s.role == ParamRole::embedding ? o.decay_embeddings : true;
        CAPTURE(s.name);
        CHECK(opt.decays(s) == expect);
        const double* a = p[i].ptr<double>();
        const double* b = before[i].ptr<double>();
        bool ok = true;
        for (int64_t k = 0; k < p[i].numel(); ++k) {
          const double want = expect ? b[k] - lr * (o.weight_decay * b[k]) : b[k];
          ok = ok && a[k] == want;
        }
        CHECK(ok);
      }
      if (!tied) {
        CHECK(opt.decays(p.specs()[static_cast<size_t>(p.find("lm_head.weight"))]));
      }
    }
  }
}

TEST_CASE("adamw: the first step moves every element with a gradient by about lr") {
  const LlamaConfig c = tiny();
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(std::string(dtype_name(dt)));
    ParamSet p(c, dt), g(c, dt);
    init_parameters(p, 3, c.initializer_range);
    fill_grads(g, 1);
    // A few exact zeros: those elements must not move (no decay here).
    fill(g[1], 0.0);
    const ParamSet before = copy_of(p, c);
    AdamWOptions o;
    o.weight_decay = 0.0;
    AdamW opt(p, o);
    const double lr = 1e-3;
    opt.step(p, g, lr);
    OwnedTensor pa = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{p.numel()});
    OwnedTensor pb = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{p.numel()});
    OwnedTensor ga = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{p.numel()});
    copy_convert(pa, p.flat());
    copy_convert(pb, before.flat());
    copy_convert(ga, g.flat());
    // mhat = g and vhat = g^2 at t = 1, so |dp| = lr |g| / (|g| + eps): lr up to eps / |g|, plus
    // the rounding of p (f32: about 1e-8 absolute on weights of ~0.2).
    const double abs_tol = dt == DType::f64 ? 1e-15 : 1e-7;
    int64_t moved = 0, bad = 0;
    for (int64_t i = 0; i < p.numel(); ++i) {
      const double gi = ga.tensor.ptr<double>()[i];
      const double d = std::abs(pa.tensor.ptr<double>()[i] - pb.tensor.ptr<double>()[i]);
      if (gi == 0.0) {
        bad += d != 0.0;
        continue;
      }
      ++moved;
      const double expect = lr * std::abs(gi) / (std::abs(gi) + o.eps);
      bad += std::abs(d - expect) > abs_tol;
      if (std::abs(gi) > 1e-4) bad += std::abs(d - lr) > 1e-4 * lr + abs_tol;
    }
    CHECK(moved == p.numel() - p[1].numel());
    CHECK(bad == 0);
  }
}

TEST_CASE("adamw: save/load is bit-exact and a resumed run continues identically") {
  test::TempDir dir("adamw");
  const LlamaConfig c = tiny();
  for (DType dt : {DType::f32, DType::f64}) {
    CAPTURE(std::string(dtype_name(dt)));
    ParamSet g(c, dt);
    // Straight through: 4 steps.
    ParamSet p4 = make_params(c, dt);
    AdamW o4(p4);
    for (int t = 1; t <= 4; ++t) {
      fill_grads(g, static_cast<uint64_t>(t));
      o4.step(p4, g, 1e-3 * t);
    }
    // 2 steps, save, a fresh optimizer loads, 2 more.
    ParamSet p2 = make_params(c, dt);
    AdamW first(p2);
    for (int t = 1; t <= 2; ++t) {
      fill_grads(g, static_cast<uint64_t>(t));
      first.step(p2, g, 1e-3 * t);
    }
    const std::string path = dir.file(fmt::format("state-{}.safetensors", dtype_name(dt)));
    first.save(path);
    {
      const SafetensorsReader r(path);
      CHECK(r.metadata().at("step") == "2");
      CHECK(r.metadata().at("beta2") == "0.95");
      CHECK(r.metadata().at("decay_norms") == "false");
      CHECK(r.entries().size() == 2 * p2.size());
      CHECK(r.find("exp_avg/model.layers.1.mlp.down_proj.weight") != nullptr);
      CHECK(r.find("exp_avg_sq/lm_head.weight") != nullptr);
    }
    AdamW resumed(p2);
    resumed.load(path);
    CHECK(resumed.steps() == 2);
    CHECK(same_bits(resumed.exp_avg(), first.exp_avg()));
    CHECK(same_bits(resumed.exp_avg_sq(), first.exp_avg_sq()));
    for (int t = 3; t <= 4; ++t) {
      fill_grads(g, static_cast<uint64_t>(t));
      resumed.step(p2, g, 1e-3 * t);
    }
    CHECK(resumed.steps() == 4);
    CHECK(same_bits(p2, p4));
    CHECK(same_bits(resumed.exp_avg(), o4.exp_avg()));
    CHECK(same_bits(resumed.exp_avg_sq(), o4.exp_avg_sq()));
  }
}

TEST_CASE("adamw: load rejects incomplete or mismatched state, naming the file and tensor") {
  test::TempDir dir("adamw-bad");
  const LlamaConfig c = tiny();
  ParamSet p = make_params(c, DType::f32), g(c, DType::f32);
  AdamW opt(p);
  fill_grads(g, 1);
  opt.step(p, g, 1e-3);
  const std::map<std::string, std::string> meta = {{"step", "1"}};

  // Every tensor of a good file, less `drop`, with `reshape` stored as `replacement`.
  const auto tensors_with = [&](const std::string& drop, const std::string& reshape, const Tensor& replacement) {
    std::vector<std::pair<std::string, Tensor>> t;
    for (const char* prefix : {"exp_avg/", "exp_avg_sq/"})
      for (size_t i = 0; i < p.size(); ++i) {
        const std::string name = prefix + p.specs()[i].name;
        if (name == drop) continue;
        t.emplace_back(name, name == reshape ? replacement : opt.exp_avg()[i]);
      }
    return t;
  };
  const std::string missing = dir.file("missing.safetensors");
  write_safetensors(missing, tensors_with("exp_avg_sq/model.norm.weight", "", Tensor()), meta);
  AdamW target(p);
  std::string e = error_of([&] { target.load(missing); });
  CHECK(contains(e, "missing.safetensors"));
  CHECK(contains(e, "exp_avg_sq/model.norm.weight"));
  CHECK(target.steps() == 0);  // a failed load leaves the state as it was

  OwnedTensor wrong(DType::f32, {c.hidden_size + 1});
  const std::string shaped = dir.file("shape.safetensors");
  write_safetensors(shaped, tensors_with("", "exp_avg/model.layers.0.input_layernorm.weight", wrong), meta);
  e = error_of([&] { target.load(shaped); });
  CHECK(contains(e, "shape.safetensors"));
  CHECK(contains(e, "exp_avg/model.layers.0.input_layernorm.weight"));
  CHECK(contains(e, "[25]"));

  OwnedTensor wide = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{c.hidden_size});
  const std::string dtyped = dir.file("dtype.safetensors");
  write_safetensors(dtyped, tensors_with("", "exp_avg/model.norm.weight", wide), meta);
  e = error_of([&] { target.load(dtyped); });
  CHECK(contains(e, "exp_avg/model.norm.weight"));
  CHECK(contains(e, "F64"));

  std::vector<std::pair<std::string, Tensor>> extra = tensors_with("", "", Tensor());
  extra.emplace_back("exp_avg/lm_head.bias", wide.tensor);
  const std::string extras = dir.file("extra.safetensors");
  write_safetensors(extras, extra, meta);
  CHECK(contains(error_of([&] { target.load(extras); }), "exp_avg/lm_head.bias"));

  const std::string nostep = dir.file("nostep.safetensors");
  write_safetensors(nostep, tensors_with("", "", Tensor()), {{"beta1", "0.9"}});
  CHECK(contains(error_of([&] { target.load(nostep); }), "\"step\""));
  const std::string badstep = dir.file("badstep.safetensors");
  write_safetensors(badstep, tensors_with("", "", Tensor()), {{"step", "2x"}});
  CHECK(contains(error_of([&] { target.load(badstep); }), "2x"));

  // A state from another model (tied: no lm_head) is rejected too.
  const std::string other = dir.file("tied.safetensors");
  ParamSet pt = make_params(tiny(true), DType::f32);
  AdamW(pt).save(other);
  CHECK(contains(error_of([&] { target.load(other); }), "exp_avg/lm_head.weight"));
  CHECK(target.steps() == 0);
}

TEST_CASE("adamw: step checks its inputs; options are validated") {
  const LlamaConfig c = tiny();
  ParamSet p = make_params(c, DType::f32), g(c, DType::f32), p64(c, DType::f64), gt(tiny(true), DType::f32);
  AdamW opt(p);
  CHECK(contains(error_of([&] { opt.step(p64, g, 1e-3); }), "f64"));
  CHECK(contains(error_of([&] { opt.step(p, gt, 1e-3); }), "gradients"));
  CHECK(contains(error_of([&] { opt.step(p, g, -1.0); }), "learning rate"));
  CHECK(opt.steps() == 0);
  ParamSet pb(c, DType::bf16);
  CHECK(contains(error_of([&] { AdamW a(pb); }), "bf16"));

  const auto bad = [&](auto edit, const char* option) {
    AdamWOptions o;
    edit(o);
    CHECK(contains(error_of([&] { AdamW a(p, o); }), option));
  };
  bad([](AdamWOptions& o) { o.beta1 = 1.0; }, "optimizer.beta1");
  bad([](AdamWOptions& o) { o.beta2 = -0.1; }, "optimizer.beta2");
  bad([](AdamWOptions& o) { o.eps = 0.0; }, "optimizer.eps");
  bad([](AdamWOptions& o) { o.weight_decay = std::nan(""); }, "optimizer.weight_decay");
}

TEST_CASE("gradient norm, clipping and finiteness") {
  const LlamaConfig c = tiny();
  // A plain f64 sum of n ~ 4e4 equal-sized squares: its rounding error is bounded by n * 2^-53.
  constexpr double kSumTol = 1e-11;
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(std::string(dtype_name(dt)));
    ParamSet g(c, dt);
    fill(g.flat(), 0.5);
    const double n = static_cast<double>(g.numel());
    CHECK(grad_global_norm(g) == doctest::Approx(0.5 * std::sqrt(n)).epsilon(kSumTol));
    fill(g[3], -2.0);  // sign does not matter
    const double expect = std::sqrt(0.25 * (n - static_cast<double>(g[3].numel())) + 4.0 * static_cast<double>(g[3].numel()));
    CHECK(grad_global_norm(g) == doctest::Approx(expect).epsilon(kSumTol));

    // No clipping: disabled, or already within the bound.
    CHECK(clip_grad_norm(g, 0.0) == doctest::Approx(expect).epsilon(kSumTol));
    CHECK(clip_grad_norm(g, expect * 2) == doctest::Approx(expect).epsilon(kSumTol));
    CHECK(grad_global_norm(g) == doctest::Approx(expect).epsilon(kSumTol));
    // Clipping: returns the norm before, leaves the bound, keeps the direction.
    CHECK(clip_grad_norm(g, 1.0) == doctest::Approx(expect).epsilon(kSumTol));
    const double clipped = grad_global_norm(g);
    INFO(fmt::format("clipped norm {:.17g}", clipped));
    CHECK(std::abs(clipped - 1.0) <= (dt == DType::f64 ? kSumTol : 1e-6));
    OwnedTensor one = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{g[3].shape[0], g[3].shape[1]});
    copy_convert(one, g[3]);
    CHECK(one.tensor.ptr<double>()[0] == doctest::Approx(-2.0 / expect).epsilon(1e-6));

    CHECK(all_finite(g));
    fill(g[5].slice(0, 2, 1), std::nan(""));
    CHECK_FALSE(all_finite(g));
    // A NaN norm does not scale the gradients.
    CHECK(std::isnan(clip_grad_norm(g, 1.0)));
    copy_convert(one, g[3]);
    CHECK(one.tensor.ptr<double>()[0] == doctest::Approx(-2.0 / expect).epsilon(1e-6));
    fill(g.flat(), 1.0);
    fill(g[0].slice(0, 0, 1), std::numeric_limits<double>::infinity());
    CHECK_FALSE(all_finite(g));
  }
  ParamSet b(c, DType::bf16);
  fill(b.flat(), 1.0);
  CHECK(all_finite(b));
  fill(b[2].slice(0, 1, 1), -std::numeric_limits<double>::infinity());
  CHECK_FALSE(all_finite(b));
}

TEST_CASE("lr schedule: warmup and each decay at its boundaries") {
  LrSchedule s;
  s.peak_lr = 1e-3;
  s.min_lr = 1e-4;
  s.warmup_steps = 10;
  s.total_steps = 110;
  for (auto d : {LrSchedule::Decay::cosine, LrSchedule::Decay::linear, LrSchedule::Decay::constant}) {
    s.decay = d;
    CAPTURE(std::string(LrSchedule::name(d)));
    CHECK(s.at(1) == doctest::Approx(1e-4).epsilon(1e-15));
    CHECK(s.at(5) == doctest::Approx(5e-4).epsilon(1e-15));
    CHECK(s.at(10) == 1e-3);
    const double end = d == LrSchedule::Decay::constant ? 1e-3 : 1e-4;
    CHECK(s.at(110) == doctest::Approx(end).epsilon(1e-15));
    CHECK(s.at(500) == doctest::Approx(end).epsilon(1e-15));
    CHECK(s.at(11) <= 1e-3);
    CHECK(s.at(60) >= end);
  }
  s.decay = LrSchedule::Decay::cosine;
  CHECK(s.at(60) == doctest::Approx(5.5e-4).epsilon(1e-14));  // half way: the midpoint
  CHECK(s.at(35) == doctest::Approx(1e-4 + 9e-4 * 0.5 * (1 + std::cos(std::numbers::pi * 0.25))).epsilon(1e-14));
  s.decay = LrSchedule::Decay::linear;
  CHECK(s.at(60) == doctest::Approx(5.5e-4).epsilon(1e-14));
  CHECK(s.at(35) == doctest::Approx(1e-4 + 9e-4 * 0.75).epsilon(1e-14));

  // No warmup: the decay starts from peak at step 0. Warmup to the end: the peak, then held.
  s.warmup_steps = 0;
  s.total_steps = 4;
  CHECK(s.at(1) == doctest::Approx(1e-4 + 9e-4 * 0.75).epsilon(1e-14));
  CHECK(s.at(4) == doctest::Approx(1e-4).epsilon(1e-15));
  s.warmup_steps = 4;
  CHECK(s.at(4) == 1e-3);
  CHECK(s.at(5) == doctest::Approx(1e-4).epsilon(1e-15));
  s.warmup_steps = 8;  // the run ends during the warmup
  CHECK(s.at(4) == doctest::Approx(5e-4).epsilon(1e-15));
  CHECK(s.at(8) == 1e-3);

  CHECK(LrSchedule::parse("cosine") == LrSchedule::Decay::cosine);
  CHECK(LrSchedule::parse("linear") == LrSchedule::Decay::linear);
  CHECK(LrSchedule::parse("constant") == LrSchedule::Decay::constant);
}

TEST_CASE("lr schedule: bad options are rejected naming the option") {
  const auto edited = [](auto edit) {
    LrSchedule s;
    s.peak_lr = 1e-3;
    s.min_lr = 0;
    s.warmup_steps = 2;
    s.total_steps = 10;
    edit(s);
    return s;
  };
  const auto error_for = [&](auto edit) { return error_of([&] { (void)edited(edit).at(1); }); };
  CHECK(contains(error_for([](LrSchedule& s) { s.peak_lr = 0; }), "optimizer.lr"));
  CHECK(contains(error_for([](LrSchedule& s) { s.min_lr = 2e-3; }), "optimizer.min_lr"));
  CHECK(contains(error_for([](LrSchedule& s) { s.min_lr = -1; }), "optimizer.min_lr"));
  CHECK(contains(error_for([](LrSchedule& s) { s.warmup_steps = -1; }), "optimizer.warmup_steps"));
  CHECK(contains(error_for([](LrSchedule& s) { s.total_steps = 0; }), "train.steps"));
  // Allowed: min_lr above the peak for a constant rate (never used), warmup longer than the run.
  CHECK_NOTHROW((void)edited([](LrSchedule& s) { s.min_lr = 2e-3; s.decay = LrSchedule::Decay::constant; }).at(1));
  CHECK_NOTHROW((void)edited([](LrSchedule& s) { s.warmup_steps = 20; }).at(1));
  CHECK_NOTHROW((void)edited([](LrSchedule&) {}).at(1));
  CHECK(contains(error_of([] { LrSchedule s; (void)s.at(0); }), "steps count from 1"));
  const std::string e = error_of([] { (void)LrSchedule::parse("cosin"); });
  CHECK(contains(e, "optimizer.decay"));
  CHECK(contains(e, "cosin"));
}
