// The op table's shared parts. tests/engine/test_backend_ops.cpp holds the table (a row per op and
// shape) and its runners; this header states what a row is and the tolerances it compares with, and
// declares the two helpers beside it: running one row (backend_ops_run.cpp: against the CPU in f64,
// against finite differences, the contract) and selecting rows and repeating one run from its line
// (test_backend_ops_rerun.cpp).
#pragma once

#include "engine/engine.h"
#include "engine/error.h"
#include "engine/memory.h"
#include "engine/random.h"
#include "engine/tensor.h"

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace cw::test::op_table {

// ---- Tolerances (relative L2 error against f64) ----
struct Tol {
  double f32, bf16;  // for runs in f32 and in bf16 (the CPU f32 runner uses f32)
};
// f32 arithmetic (6e-8 relative per operation) over reductions of up to a few thousand terms, f32
// transcendental functions within a few ulps: errors near 1e-6.
constexpr double kF32Tol = 1e-5;
// bf16 keeps 8 significant bits: rounding an output once costs up to 2^-9 (2e-3) relative; the
// tensor-core attention and the LM head also round P, dS or the logits to bf16 before a product.
// 2e-2 leaves a margin of five to ten.
constexpr double kBf16Tol = 2e-2;
constexpr Tol kDefaultTol{kF32Tol, kBf16Tol};
// f32 results of bf16 runs computed from exactly representable inputs with f32 sums (rstd, rmsnorm
// d_w, embedding d_table, an f32 gradient sum): f32-level errors.
constexpr Tol kF32ResultTol{kF32Tol, kF32Tol};
// linear d_W (f32) of bf16 runs: products of bf16 values are exact in f32, only the f32 accumulation
// remains; loose on purpose (a bf16 rounding would be ~1e-3).
constexpr Tol kLinearDwTol{kF32Tol, 1e-3};
// attention lse (f32): a log-sum-exp of f32 scores; the tensor-core paths use approximate base-2
// exponentials (2 ulp), cuDNN its own: 1e-4 still catches any masking or scaling mistake (O(1)).
constexpr Tol kLseTol{kF32Tol, 1e-4};
constexpr Tol kExact{0, 0};
// AdamW: the GPU computes in f32, the CPU in f64 rounded once: a few f32 ulps.
constexpr Tol kAdamWTol{1e-6, 1e-6};
// Its bf16 compute copy: the master rounded to bf16; an ulp apart (2^-8) where the f32 masters
// straddle a rounding boundary.
constexpr Tol kBf16CopyTol{1e-2, 1e-2};
// The finite-difference runner's inputs with a gradient, in elements (4 forwards each).
constexpr int64_t kFdMaxElements = 3000;

// ---- Rows ----
enum class Role { input, output, saved, state, cotangent, grad };
// How the backward treats a gradient buffer: by the call's GradMode (overwrite or add), by the
// opposite mode, always adds (parameter gradients, d_k/d_v), or always writes (an output of a fused
// backward, not a gradient).
enum class Acc { mode, flipped, adds, writes };
// An arg's dtype for a run in compute dtype dt: dt; accum_dtype(dt); i32; bf16.
enum class Dt { compute, accum, i32, bf16 };

// Fills the host tensor (f64, or i32 for Dt::i32; the whole store) with an arg's values.
using Init = std::function<void(const Tensor& host, uint64_t seed, uint64_t stream)>;

struct Arg {
  std::string name;
  Role role;
  std::vector<int64_t> shape;  // empty for a gradient or cotangent: the shape of `of`
  Dt dt = Dt::compute;
  std::string of;        // cotangent: its output; grad: its input (empty for Acc::writes)
  Acc acc = Acc::mode;
  Init init;             // inputs, state, cotangents; default standard normal
  int64_t store = 0;     // > 0: the op sees [0, shape[1]) of a store this long along dim 1
  std::optional<Tol> tol;
  bool any_float = false;  // the op takes it in any float dtype its backend computes in (no dtype breach)
  bool implicit = false;   // a cotangent the op assumes rather than reads (no breach: it never sees it)
  // A saved result the reference's backward takes from its own forward, not the tested side's
  // (compare_run): where the backward recomputes what the saved value summarised, a tested value
  // rounded elsewhere makes the reference inconsistent (lm_head's lse, below).
  bool reference_keeps_own = false;

  Arg& normal(double mean, double std) {
    init = [=](const Tensor& t, uint64_t seed, uint64_t stream) { fill_normal(t, seed, stream, mean, std); };
    return *this;
  }
  Arg& with(Init f) { init = std::move(f); return *this; }
  Arg& in_store(int64_t len) { store = len; return *this; }
  Arg& tolerance(Tol t) { tol = t; return *this; }
  Arg& dtype(Dt d) { dt = d; return *this; }
  Arg& any_float_dtype() { any_float = true; return *this; }
  Arg& implicit_in_op() { implicit = true; return *this; }
  Arg& own_in_reference() { reference_keeps_own = true; return *this; }
};

// The tensors of one run, by name (a name no arg has is an error naming it).
struct Tensors {
  std::map<std::string, Tensor> by_name;
  const Tensor& operator()(const std::string& name) const {
    const auto it = by_name.find(name);
    CW_CHECK(it != by_name.end(), "test_backend_ops: no tensor named '{}' in this row", name);
    return it->second;
  }
};
using Forward = std::function<void(const Tensors&, Arena& scratch)>;
using Backward = std::function<void(const Tensors&, GradMode, Arena& scratch)>;

// A kernel family and the settings that force it (GPU runs only).
struct Variant {
  std::string name;
  AttentionKernel kernel = AttentionKernel::automatic;
  bool deterministic = false;
  bool repeatable_backward = true;  // false: the backward may sum in any order (f32 atomics)
};
inline const Variant kCuda{"cuda"};

// A call the op must refuse (a forbidden alias), with the reason.
struct Misuse {
  std::string what;
  std::function<void(const Tensors&, Arena& scratch)> call;
};

struct Row {
  std::string name;  // op and shape: "rmsnorm N=37 C=203"
  std::string op;    // the word every error of the op names: "rmsnorm"
  std::vector<Arg> args;
  Forward forward;
  Backward backward;  // empty: no backward (an update op)
  Tol tol = kDefaultTol;
  std::vector<DType> gpu_dtypes{DType::f32, DType::bf16};
  bool cpu = true;  // false: a large shape only the GPU runner takes
  std::vector<Variant> variants{kCuda};
  // With the variant's settings in force: why it cannot run on these (device) tensors, "" if it can.
  std::function<std::string(const Tensors&)> unsupported;
  bool takes_scratch = false;  // the op checks that its scratch arena is on the operands' device
  std::vector<Misuse> misuses;
  // Where an output is a sum of terms the kernel rounds apart (lora_linear: the bf16 base product
  // plus the adapter's term from a bf16 u = x A^T), its rounding error is bounded by the terms'
  // magnitudes, not the sum's, which may cancel: the norm sum ||t_1|| + ||t_2|| of the named output
  // (0: no such bound), computed from the reference's f64 operands. The comparison then divides the
  // error by the larger of that and the reference's own norm.
  std::function<double(const Tensors& ref, const std::string& name)> term_scale;

  const Arg* find(const std::string& n) const {
    for (const Arg& a : args)
      if (a.name == n) return &a;
    return nullptr;
  }
};

// Every row of the op table, in order (test_backend_ops.cpp).
std::vector<Row> build_table();

// ---- Runners, selections and rerun lines (test_backend_ops_rerun.cpp) ----
// The names of the runners (doctest cases in test_backend_ops.cpp): a rerun line names its runner for -tc.
constexpr const char* kFdRunner = "backend ops: cpu f64 against finite differences";
constexpr const char* kCpuF32Runner = "backend ops: cpu f32 against cpu f64";
constexpr const char* kCpuContractRunner = "backend ops: cpu contract, every operand checked before any backend runs";
constexpr const char* kCudaContractRunner = "backend ops: cuda contract, every operand checked before any backend runs";
constexpr const char* kCudaRunner = "backend ops: cuda against cpu f64";

// The variables that select rows and repeat a run (documented at the top of test_backend_ops_rerun.cpp).
constexpr const char* kSeedVar = "CW_TEST_SEED";
constexpr const char* kOpsVar = "CW_TEST_OPS";
constexpr const char* kRowVar = "CW_TEST_ROW";
constexpr const char* kDtypeVar = "CW_TEST_DTYPE";
constexpr const char* kVariantVar = "CW_TEST_VARIANT";
constexpr const char* kMaxElementsVar = "CW_TEST_MAX_ELEMENTS";
constexpr const char* kMinElementsVar = "CW_TEST_MIN_ELEMENTS";
constexpr const char* kTraceVar = "CW_TEST_TRACE";
constexpr const char* kPoisonVar = "CW_TEST_POISON_SCRATCH";

// CW_TEST_POISON_SCRATCH=1: GPU runs fill their scratch arena's first block with NaN bytes before
// every call (backend_ops_run.cpp, poison_scratch).
bool poison_scratch_on();

// Reads a variable: its value, or nullptr where it is unset (std::getenv, or a parsed rerun line).
using VarLookup = std::function<const char*(const char*)>;

// The largest operand of a row (its whole K/V store where it has one), in elements.
int64_t largest_operand(const Row& row);

// What one run takes: rows, tested dtypes and GPU variants. Empty fields take everything.
struct Selection {
  std::string contains;  // CW_TEST_OPS: rows whose name contains this text
  std::string row;       // CW_TEST_ROW: the row of exactly this name
  std::string dtype;     // CW_TEST_DTYPE: f64, f32 or bf16 (the dtype the runner tests)
  std::string variant;   // CW_TEST_VARIANT: the GPU variant of exactly this name (the GPU runner only)
  int64_t max_elements = 0;  // CW_TEST_MAX_ELEMENTS: rows whose largest operand holds at most this many
  int64_t min_elements = 0;  // CW_TEST_MIN_ELEMENTS: rows whose largest operand holds more than this many

  // Read through `get`; a value that is no dtype or no number is an error naming its variable.
  static Selection from(const VarLookup& get);
  static Selection from_env();
  bool operator==(const Selection&) const = default;

  bool takes(const Row& r) const;
  bool takes(DType dt) const;
  bool takes(const Variant& v) const;
};

// The rows of `all` the selection takes. A row or variant name that matches nothing is an error
// (a mistyped rerun would otherwise pass by running nothing).
std::vector<Row> select_rows(std::vector<Row> all, const Selection& s);
// The rows this run takes (the selection of the environment).
const std::vector<Row>& table();
// The seed of this run: CW_TEST_SEED, else a fresh one.
uint64_t run_seed();

// One runner's run of one row: what a rerun line says.
struct Rerun {
  uint64_t seed = 0;
  std::string runner, row, dtype, variant;  // variant: "" for the CPU runners
  bool poison = false;                      // CW_TEST_POISON_SCRATCH=1
  bool operator==(const Rerun&) const = default;
  Selection selection() const {
    Selection s;
    s.row = row, s.dtype = dtype, s.variant = variant;
    return s;
  }
};

// This test binary as the rerun line names it: relative to the working directory when below it.
std::string test_binary();
// The one line that repeats a runner's run of one row, to paste into a shell.
std::string rerun_line(const Rerun& r, const std::string& binary);
// The rerun line of a runner's run of a row, as context for every check of the run (printed as the
// run starts with CW_TEST_TRACE=1).
std::string rerun_of(const char* runner, const Row& row, DType dt, const Variant* variant, uint64_t seed);

// ---- Running a row (backend_ops_run.cpp) ----
// What a runner ran and skipped.
struct Outcome {
  int runs = 0;
  std::map<std::string, std::pair<int, std::string>> skipped;  // what -> (count, an example reason)
  std::string summary(const char* what) const;
};
// Sees what a comparing run drew for its row (the test that a rerun draws what the whole table drew).
using DrawObserver = std::function<void(const Row&, const std::vector<OwnedTensor>& values)>;

// The row in dtype dt on `device` (with the variant's settings on a GPU) against the CPU in f64, as
// the runner `runner`.
void compare_run(const char* runner, const Row& row, Device device, DType dt, const Variant& variant, uint64_t seed,
                 Outcome& outcome, const DrawObserver& observe = {});
// The row in f64 on the CPU against finite differences; accumulate mode adds what overwrite writes.
void fd_run(const Row& row, uint64_t seed, Outcome& outcome);
// Every operand of the row broken one way at a time, the scratch arena on the other kind of device,
// the row's misuses: each call must throw a cw::Error naming the op.
void contract_run(const char* runner, const Row& row, Device device, DType dt, uint64_t seed, Outcome& outcome);
// The end of a runner: what it ran and skipped; an empty run fails unless a selection narrowed it.
void report(const Outcome& outcome, const char* runner);

}  // namespace cw::test::op_table
