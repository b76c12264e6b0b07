// Running one row of the op table (tests/engine/backend_ops.h): against the CPU in f64 (inputs drawn
// in f64 and rounded to the tested dtype, results poisoned first, added-to gradients pre-filled, the
// store past the op's slice untouched, every call repeated for the same bits), against finite
// differences, and the contract every op checks before any backend runs.
#include "tests/engine/backend_ops.h"

#include "chunkwise_config.h"

#include "engine/random.h"
#include "tests/engine/fd_check.h"
#include "tests/gpu_support.h"

#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

namespace cw::test::op_table {
namespace {

// ---- Running a row ----
DType resolve(Dt d, DType compute) {
  switch (d) {
    case Dt::compute: return compute;
    case Dt::accum: return accum_dtype(compute);
    case Dt::i32: return DType::i32;
    case Dt::bf16: return DType::bf16;
  }
  return compute;
}

std::vector<int64_t> store_shape(const Arg& a) {
  std::vector<int64_t> s = a.shape;
  if (a.store > 0) s[1] = a.store;
  return s;
}

// Whether element e (row-major in the whole store) is one the op sees.
bool in_view(const Arg& a, int64_t e) {
  if (a.store == 0) return true;
  int64_t inner = 1;
  for (size_t d = 2; d < a.shape.size(); ++d) inner *= a.shape[d];
  return (e / inner) % a.store < a.shape[1];
}

OwnedTensor alloc(Device device, DType dt, const std::vector<int64_t>& shape) {
  OwnedTensor t;
  const int64_t n = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
  t.buffer = Buffer(static_cast<size_t>(n) * dtype_size(dt), device);
  t.tensor = Tensor::packed(t.buffer.data(), dt, device, shape);
  return t;
}

OwnedTensor fetch64(const Tensor& t) {
  OwnedTensor h = OwnedTensor::of_shape(DType::f64, shape_of(t));
  copy_convert(h, t);
  return h;
}

// One row's tensors on one device in one compute dtype: per arg its whole store, and the views.
struct Instance {
  std::vector<OwnedTensor> store;
  Tensors t;
};
Instance make_instance(const Row& row, Device device, DType dt) {
  Instance in;
  for (const Arg& a : row.args) {
    OwnedTensor s = alloc(device, resolve(a.dt, dt), store_shape(a));
    in.t.by_name[a.name] = a.store > 0 ? s.tensor.slice(1, 0, a.shape[1]) : s.tensor;
    in.store.push_back(std::move(s));
  }
  return in;
}

// An arg's values (whole store) drawn in f64 and rounded to `dt`: what both sides get.
OwnedTensor draw(const Arg& a, DType dt, uint64_t seed, uint64_t stream) {
  OwnedTensor v = OwnedTensor::of_shape(dt == DType::i32 ? DType::i32 : DType::f64, store_shape(a));
  if (a.init) a.init(v, seed, stream);
  else fill_normal(v, seed, stream);
  if (dt == DType::f32 || dt == DType::bf16) {
    OwnedTensor r = OwnedTensor::of_shape(dt, store_shape(a));
    copy_convert(r, v);
    copy_convert(v, r);
  }
  return v;
}

bool is_fwd_result(Role r) { return r == Role::output || r == Role::saved; }
bool is_given(Role r) { return r == Role::input || r == Role::state || r == Role::cotangent; }

// The values of a row's given operands (inputs, state, cotangents; empty for the others) for a run
// in compute dtype dt: operand i draws from (seed, i), nothing else.
std::vector<OwnedTensor> draw_given(const Row& row, DType dt, uint64_t seed) {
  std::vector<OwnedTensor> values(row.args.size());
  for (size_t i = 0; i < row.args.size(); ++i)
    if (is_given(row.args[i].role)) values[i] = draw(row.args[i], resolve(row.args[i].dt, dt), seed, i);
  return values;
}

bool adds_in(Acc a, GradMode m) {
  switch (a) {
    case Acc::adds: return true;
    case Acc::writes: return false;
    case Acc::mode: return m == GradMode::accumulate;
    case Acc::flipped: return m == GradMode::overwrite;
  }
  return false;
}
const char* mode_name(GradMode m) { return m == GradMode::overwrite ? "overwrite" : "accumulate"; }

double rms(const Tensor& t) {
  double s = 0;
  for (int64_t i = 0; i < t.numel(); ++i) s += t.ptr<double>()[i] * t.ptr<double>()[i];
  return std::sqrt(s / static_cast<double>(std::max<int64_t>(t.numel(), 1)));
}

// terms: Row::term_scale's norm of the terms the output sums (0: none); the error is relative to the
// larger of it and the reference's norm.
void expect_close(const std::string& what, const Tensor& got, const Tensor& ref, double tol, double terms = 0) {
  Worst w = compare(got, ref);
  double ref_norm = 0;
  if (terms > 0) {  // the term-scaled rows' references are f64
    for (int64_t i = 0; i < ref.numel(); ++i) ref_norm += ref.ptr<double>()[i] * ref.ptr<double>()[i];
    ref_norm = std::sqrt(ref_norm);
  }
  const bool by_terms = terms > ref_norm && ref_norm > 0;
  if (by_terms) w.rel *= ref_norm / terms;
  INFO(what, ": ", w.str(), by_terms ? fmt::format(" of the terms' norm {:.6g} (the sum's {:.6g})", terms, ref_norm) : "",
       " (tolerance ", tol, ")");
  CHECK(w.rel <= tol);  // NaN (an element never written) fails
}

void poison_results(const Row& row, Instance& in) {
  for (size_t i = 0; i < row.args.size(); ++i)
    if (is_fwd_result(row.args[i].role)) fill(in.store[i], std::numeric_limits<double>::quiet_NaN());
}

// With CW_TEST_POISON_SCRATCH=1, a GPU arena's first block (the 256 MiB a GPU arena adds first, where
// the next call's scratch starts) and cuBLASLt's workspace all 0xff bytes; queued on the stream the
// op runs on.
void poison_scratch(Arena& scratch) {
  if (!poison_scratch_on() || scratch.device().is_cpu()) return;
  constexpr int64_t kFirstBlockWords = (int64_t{256} << 20) / 4;
  ArenaScope scope(scratch);
  fill(scratch.alloc(DType::i32, {kFirstBlockWords}), -1.0);
#if CW_HAVE_CUDA
  fill(gpu::cublas_workspace(scratch.device().index), -1.0);
#endif
}

// The backward in `mode`: the buffers it overwrites poisoned, those it adds to set to `prefill`
// (zeros when null). Returns per gradient arg what the call wrote (whole store, f64): the buffer
// after, less the pre-fill where it adds. Store rows past the op's slice must come back as they were
// (and are then zero in the result).
std::vector<OwnedTensor> backward_pass(const Row& row, Instance& in, GradMode mode,
                                       const std::vector<OwnedTensor>* prefill, Arena& scratch) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (size_t i = 0; i < row.args.size(); ++i) {
    const Arg& a = row.args[i];
    if (a.role != Role::grad) continue;
    if (!adds_in(a.acc, mode)) fill(in.store[i], nan);
    else if (prefill != nullptr) copy_convert(in.store[i], (*prefill)[i]);
    else fill(in.store[i], 0.0);
  }
  poison_scratch(scratch);
  row.backward(in.t, mode, scratch);
  CHECK(scratch.in_use() == 0);  // scratch handed back as found
  std::vector<OwnedTensor> written(row.args.size());
  for (size_t i = 0; i < row.args.size(); ++i) {
    const Arg& a = row.args[i];
    if (a.role != Role::grad) continue;
    written[i] = fetch64(in.store[i]);
    double* w = written[i].tensor.ptr<double>();
    const bool adds = adds_in(a.acc, mode);
    int64_t touched = 0;
    for (int64_t e = 0; e < written[i].tensor.numel(); ++e) {
      if (adds && prefill != nullptr) w[e] -= (*prefill)[i].tensor.ptr<double>()[e];
      if (in_view(a, e)) continue;
      touched += adds ? w[e] != 0.0 : !std::isnan(w[e]);
      w[e] = 0.0;
    }
    INFO(a.name, " (", mode_name(mode), "): ", touched, " elements of the store past the op's slice changed");
    CHECK(touched == 0);
  }
  return written;
}

double tol_for(const Row& row, const Arg& a, DType dt) {
  const Tol t = a.tol.value_or(row.tol);
  return dt == DType::bf16 ? t.bf16 : t.f32;
}

// Random values at the scale of each reference gradient, rounded to the tested dtype.
std::vector<OwnedTensor> prefills(const Row& row, const std::vector<OwnedTensor>& G, DType dt, uint64_t seed) {
  std::vector<OwnedTensor> P(row.args.size());
  for (size_t i = 0; i < row.args.size(); ++i) {
    const Arg& a = row.args[i];
    if (a.role != Role::grad) continue;
    const double scale = rms(G[i]) > 0 ? rms(G[i]) : 1.0;
    Arg fill_arg = a;
    fill_arg.normal(0.0, scale);
    P[i] = draw(fill_arg, resolve(a.dt, dt), seed, 1000 + i);
  }
  return P;
}

// The settings a GPU variant forces, for one scope.
class VariantScope {
 public:
  explicit VariantScope(const Variant& v) : det_(v.deterministic), kernel_(v.kernel) {}

 private:
  DeterminismScope det_;
  AttentionKernelScope kernel_;
};

}  // namespace

std::string Outcome::summary(const char* what) const {
  std::string s = fmt::format("{}: {} runs", what, runs);
  for (const auto& [k, v] : skipped) s += fmt::format("\n  skipped {} x {}: e.g. {}", v.first, k, v.second);
  return s;
}

// The row in dtype dt on `device` (with the variant's settings on a GPU) against the CPU in f64, as
// the runner `runner`.
void compare_run(const char* runner, const Row& row, Device device, DType dt, const Variant& variant, uint64_t seed,
                 Outcome& outcome, const DrawObserver& observe) {
  const std::string where =
      fmt::format("{} {}{}", device_name(device), dtype_name(dt), device.is_cpu() ? "" : " " + variant.name);
  const std::string rerun = rerun_of(runner, row, dt, device.is_cpu() ? nullptr : &variant, seed);
  INFO(row.name, " | ", where, " | seed ", seed);
  INFO(rerun);
  std::optional<VariantScope> scope;
  if (!device.is_cpu()) scope.emplace(variant);
  Instance ref = make_instance(row, Device::host(), DType::f64), tst = make_instance(row, device, dt);
  if (!device.is_cpu() && row.unsupported) {
    if (const std::string why = row.unsupported(tst.t); !why.empty()) {
      auto& s = outcome.skipped[fmt::format("{} {}", variant.name, dtype_name(dt))];
      if (s.first++ == 0) s.second = why;
      return;
    }
  }
  ++outcome.runs;
  Arena ref_scratch, scratch(device);
  const size_t n = row.args.size();

  // forward
  const std::vector<OwnedTensor> values = draw_given(row, dt, seed);
  if (observe) observe(row, values);
  std::vector<OwnedTensor> got(n);
  for (size_t i = 0; i < n; ++i) {
    if (!is_given(row.args[i].role)) continue;
    copy_convert(ref.store[i], values[i]);
    copy_convert(tst.store[i], values[i]);
  }
  poison_results(row, ref);
  poison_results(row, tst);
  row.forward(ref.t, ref_scratch);
  poison_scratch(scratch);
  row.forward(tst.t, scratch);
  CHECK(scratch.in_use() == 0);
  for (size_t i = 0; i < n; ++i) {
    const Arg& a = row.args[i];
    if (!is_fwd_result(a.role) && a.role != Role::state) continue;
    got[i] = fetch64(tst.store[i]);
    expect_close(a.name + " (forward)", got[i], ref.store[i], tol_for(row, a, dt),
                 row.term_scale ? row.term_scale(ref.t, a.name) : 0.0);
  }
  // the same call again: the same bits (state restored first)
  for (size_t i = 0; i < n; ++i)
    if (row.args[i].role == Role::state) copy_convert(tst.store[i], values[i]);
  poison_results(row, tst);
  poison_scratch(scratch);
  row.forward(tst.t, scratch);
  for (size_t i = 0; i < n; ++i)
    if (got[i].tensor.data != nullptr) {
      INFO(row.args[i].name, ": a second forward gives the same bits");
      CHECK(same_bits(fetch64(tst.store[i]), got[i]));
    }
  if (!row.backward) return;

  // backward: the reference reads the tested side's forward results (the backward is checked given
  // them; their own errors were checked above), but for those it keeps its own (Arg::reference_keeps_own)
  for (size_t i = 0; i < n; ++i)
    if (is_fwd_result(row.args[i].role) && !row.args[i].reference_keeps_own) copy_convert(ref.store[i], got[i]);
  const std::vector<OwnedTensor> G = backward_pass(row, ref, GradMode::overwrite, nullptr, ref_scratch);
  const std::vector<OwnedTensor> P = prefills(row, G, dt, seed);
  for (const GradMode mode : {GradMode::overwrite, GradMode::accumulate}) {
    const std::vector<OwnedTensor> W = backward_pass(row, tst, mode, &P, scratch);
    std::vector<OwnedTensor> again;
    if (variant.repeatable_backward || device.is_cpu()) again = backward_pass(row, tst, mode, &P, scratch);
    for (size_t i = 0; i < n; ++i) {
      const Arg& a = row.args[i];
      if (a.role != Role::grad) continue;
      expect_close(fmt::format("{} ({}{})", a.name, mode_name(mode), adds_in(a.acc, mode) ? ": what it added" : ""), W[i],
                   G[i], tol_for(row, a, dt),
                   row.term_scale ? row.term_scale(ref.t, a.name) : 0.0);
      if (!again.empty()) {
        INFO(a.name, " (", mode_name(mode), "): a second backward gives the same bits");
        CHECK(same_bits(again[i], W[i]));
      }
    }
  }
}

// The row in f64 on the CPU against finite differences; accumulate mode adds what overwrite writes.
void fd_run(const Row& row, uint64_t seed, Outcome& outcome) {
  const std::string rerun = rerun_of(kFdRunner, row, DType::f64, nullptr, seed);
  INFO(row.name, " | cpu f64 | seed ", seed);
  INFO(rerun);
  if (!row.backward) {
    auto& s = outcome.skipped["rows without a backward"];
    if (s.first++ == 0) s.second = row.name;
    return;
  }
  int64_t elements = 0;
  for (const Arg& a : row.args)
    if (a.role == Role::grad && a.acc != Acc::writes)
      elements += std::accumulate(a.shape.begin(), a.shape.end(), int64_t{1}, std::multiplies<>());
  if (elements > kFdMaxElements) {
    auto& s = outcome.skipped["rows too large for finite differences"];
    if (s.first++ == 0) s.second = row.name;
    return;
  }
  ++outcome.runs;
  Instance x = make_instance(row, Device::host(), DType::f64);
  Arena scratch;
  const std::vector<OwnedTensor> values = draw_given(row, DType::f64, seed);
  for (size_t i = 0; i < row.args.size(); ++i)
    if (is_given(row.args[i].role)) copy_convert(x.store[i], values[i]);
  poison_results(row, x);
  row.forward(x.t, scratch);
  const std::vector<OwnedTensor> G = backward_pass(row, x, GradMode::overwrite, nullptr, scratch);
  const std::vector<OwnedTensor> P = prefills(row, G, DType::f64, seed);
  for (const GradMode mode : {GradMode::overwrite, GradMode::accumulate}) {
    const std::vector<OwnedTensor> W = backward_pass(row, x, mode, &P, scratch);
    for (size_t i = 0; i < row.args.size(); ++i)
      if (row.args[i].role == Role::grad)
        expect_close(fmt::format("{} ({}) against the backward from zero", row.args[i].name, mode_name(mode)), W[i], G[i],
                     kSameMathF64Tol);
  }
  const auto loss = [&] {
    row.forward(x.t, scratch);
    double s = 0;
    for (const Arg& a : row.args)
      if (a.role == Role::cotangent) s += inner(x.t(a.name), x.t(a.of));
    return s;
  };
  for (size_t i = 0; i < row.args.size(); ++i) {
    const Arg& g = row.args[i];
    if (g.role != Role::grad || g.acc == Acc::writes) continue;
    size_t j = 0;
    while (row.args[j].name != g.of) ++j;
    std::vector<int64_t> offsets;
    for (int64_t e = 0; e < x.store[j].tensor.numel(); ++e)
      if (in_view(row.args[j], e)) offsets.push_back(e);
    const std::vector<double> numeric = numeric_gradient(x.store[j].tensor.ptr<double>(), offsets, loss);
    OwnedTensor num(DType::f64, {static_cast<int64_t>(offsets.size())}), ana(DType::f64, {static_cast<int64_t>(offsets.size())});
    for (size_t k = 0; k < offsets.size(); ++k) {
      num.tensor.ptr<double>()[k] = numeric[k];
      ana.tensor.ptr<double>()[k] = G[i].tensor.ptr<double>()[offsets[k]];
    }
    expect_close(fmt::format("{} against finite differences", g.name), ana, num, kFiniteDifferenceTol);
  }
}

namespace {

// ---- The contract: every operand checked before any backend runs ----
enum class Breach { shape, dtype, layout, device };
const char* breach_name(Breach b) {
  switch (b) {
    case Breach::shape: return "last dimension off by one";
    case Breach::dtype: return "another dtype";
    case Breach::layout: return "strided";
    case Breach::device: return "on the other kind of device";
  }
  return "?";
}
// What the error must say besides the op's name ("" for a shape: an op may first notice it as a
// mismatch of another operand, an odd head dim or an id past a shorter table, all naming the op).
std::string breach_word(Breach b, Device device) {
  switch (b) {
    case Breach::shape: return "";
    case Breach::dtype: return "dtype";
    case Breach::layout: return "must be";  // "must be contiguous" or, for K/V, "must be packed"
    case Breach::device: return device_name(device);
  }
  return "";
}
Device other_kind(Device d) { return d.is_cpu() ? Device::gpu(0) : Device::host(); }

// `t` broken one way: a fresh tensor, or (device) the same memory labelled with the other kind of
// device (the op must refuse it before anything reads it). Empty where this way cannot break it
// (a tensor of size-1 dimensions is contiguous whatever its strides).
std::optional<std::pair<OwnedTensor, Tensor>> broken(const Tensor& t, Breach b) {
  std::vector<int64_t> shape = shape_of(t);
  DType dt = t.dtype;
  switch (b) {
    // one shorter, or one longer where that would leave no elements (an empty tensor without data
    // reads as an optional gradient not given)
    case Breach::shape: shape.back() += shape.back() > 1 ? -1 : 1; break;
    case Breach::dtype: dt = dt == DType::f64 ? DType::f32 : DType::f64; break;
    case Breach::device: {
      Tensor v = t;
      v.device = other_kind(t.device);
      return std::pair{OwnedTensor{}, v};
    }
    case Breach::layout: {
      OwnedTensor mem = alloc(t.device, dt, {2 * t.numel()});
      Tensor v = Tensor::packed(mem.tensor.data, dt, t.device, shape);
      for (int d = 0; d < v.ndim; ++d) v.stride[d] *= 2;
      if (v.contiguous()) return std::nullopt;
      return std::pair{std::move(mem), v};
    }
  }
  OwnedTensor mem = alloc(t.device, dt, shape);
  const Tensor v = mem.tensor;
  return std::pair{std::move(mem), v};
}

// The row's calls (forward, then backward) on `t`: the error they throw, "" if none.
std::string error_of(const Row& row, const Tensors& t, Arena& scratch) {
  try {
    row.forward(t, scratch);
    if (row.backward) row.backward(t, GradMode::overwrite, scratch);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_refused(const std::string& error, const Row& row, const std::string& word) {
  INFO("error: ", error);
  CHECK_MESSAGE(!error.empty(), "the op accepted it");
  CHECK(error.find(row.op) != std::string::npos);
  CHECK(error.find(word) != std::string::npos);
}

}  // namespace

// Every operand of the row broken each way, one at a time, on `device` in dtype dt; the scratch arena
// on the other kind of device; the row's misuses. The other operands hold valid values (ids and
// labels in range), so each call fails for the broken operand alone.
void contract_run(const char* runner, const Row& row, Device device, DType dt, uint64_t seed, Outcome& outcome) {
  const std::string where = fmt::format("{} {}", device_name(device), dtype_name(dt));
  const std::string rerun = rerun_of(runner, row, dt, nullptr, seed);
  INFO(row.name, " | ", where, " | seed ", seed);
  INFO(rerun);
  std::optional<VariantScope> scope;  // the default settings (attention kernel auto), whatever the environment
  if (!device.is_cpu()) scope.emplace(kCuda);
  Instance in = make_instance(row, device, dt);
  // A row this backend runs for no operands (compare_run skips it too) refuses every call for that
  // reason first, not for the broken operand.
  if (!device.is_cpu() && row.unsupported) {
    if (const std::string why = row.unsupported(in.t); !why.empty()) {
      auto& s = outcome.skipped[fmt::format("contract {}", dtype_name(dt))];
      if (s.first++ == 0) s.second = why;
      return;
    }
  }
  const std::vector<OwnedTensor> values = draw_given(row, dt, seed);
  for (size_t i = 0; i < row.args.size(); ++i)
    if (is_given(row.args[i].role)) copy_convert(in.store[i], values[i]);
  Arena scratch(device);
  for (const Arg& a : row.args) {
    if (a.implicit) continue;
    for (const Breach b : {Breach::shape, Breach::dtype, Breach::layout, Breach::device}) {
      if (b == Breach::dtype && a.any_float) continue;
      auto bad = broken(in.t(a.name), b);
      if (!bad) continue;
      INFO(a.name, ": ", breach_name(b), " (", bad->second.describe(), ")");
      Tensors t = in.t;
      t.by_name[a.name] = bad->second;
      expect_refused(error_of(row, t, scratch), row, breach_word(b, other_kind(device)));
      ++outcome.runs;
    }
  }
  if (row.takes_scratch) {
    INFO("the scratch arena on ", device_name(other_kind(device)));
    Arena elsewhere(other_kind(device));  // never allocates: the op refuses it first
    expect_refused(error_of(row, in.t, elsewhere), row, "scratch");
    ++outcome.runs;
  }
  for (const Misuse& m : row.misuses) {
    INFO("misuse: ", m.what);
    std::string error;
    try {
      m.call(in.t, scratch);
    } catch (const Error& e) {
      error = e.what();
    }
    expect_refused(error, row, "alias");
    ++outcome.runs;
  }
}

// The end of a runner: what it ran and skipped; an empty run fails unless a selection narrowed it.
void report(const Outcome& outcome, const char* runner) {
  MESSAGE(outcome.summary(runner));
  if (Selection::from_env() == Selection{}) CHECK(outcome.runs > 0);
  else if (outcome.runs == 0) MESSAGE(runner, ": the selection leaves this runner nothing to run");
}

}  // namespace cw::test::op_table
