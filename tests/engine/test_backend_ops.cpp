// Every op of engine/ops on every backend, from one table (the idea of ggml's test-backend-ops).
//
// ADDING AN OP OR A KERNEL MEANS ADDING ROWS:
//   an op:     a function returning a Row (its tensors: inputs and how they are drawn, outputs, saved
//              tensors, cotangents, gradients and whether each is overwritten or added to; its
//              forward and backward calls; tolerances per dtype), called with a few shapes in
//              build_table(). Every runner below takes every row.
//   a kernel:  a Variant (its name and the settings that force it: attention kernel family,
//              determinism, cuDNN autotuning) in the variants of the rows it serves; the row's
//              `unsupported` asks the chooser whether the family takes the call, so the GPU runner
//              runs every variant the device supports and reports what it skipped and why.
//
// Runners (doctest cases; `-tc='backend ops*'` runs them all):
//   contract, cpu and cuda                every operand of every row broken one way at a time (its
//       last dimension off by one, another dtype, strided, labelled with the other kind of device)
//       and, where the op takes scratch, the arena on the other kind of device; plus the row's
//       forbidden aliases (`misuses`): each call must throw a cw::Error naming the op before any
//       backend runs (engine/ops/*.cpp check the contract once, for every backend).
//   cpu f64 against finite differences  L = sum_o <R_o, out_o> with random cotangents R_o;
//       fourth-order central differences for every input with a gradient (rows of at most
//       kFdMaxElements such inputs); then accumulate mode adds exactly what overwrite writes.
//   cpu f32 against cpu f64              every row the CPU takes.
//   cuda against cpu f64                 every (row, GPU dtype, variant) the device supports.
// Both comparing runners: inputs drawn in f64, rounded to the tested dtype and the rounded values
// widened back for the f64 reference, so both sides see the same numbers; outputs, saved tensors
// and overwritten gradients poisoned with NaN first (an unwritten element fails); gradients that are
// added to pre-filled with random values at the gradient's scale, and (after - before) compared
// with the reference gradient; the rows of a K/V store past the slice the op sees must come back
// untouched; the reference backward reads the tested side's forward results (out, lse, rstd), so
// the backward is checked on its own; every call is repeated and must give the same bits (for
// variants whose backward is not deterministic, only the forward). Relative L2 error, worst element
// reported (tests/support.h).
//
// Seeds, selection and reruns: every run draws a fresh seed, and every check logs the one line that
// repeats exactly its run of its row (test_backend_ops_rerun.cpp says how; tests/README.md lists the
// variables). tools/op-check-loop runs the GPU runner many times, under compute-sanitizer, or one
// rerun line many times.
//
// Beside this file: what a row is and the tolerances (backend_ops.h), running one row
// (backend_ops_run.cpp), selecting rows and rerun lines (test_backend_ops_rerun.cpp).
#include "tests/engine/backend_ops.h"

#include "chunkwise_config.h"
#include "engine/ops/adamw_update.h"
#include "engine/ops/attention.h"
#include "engine/ops/embedding.h"
#include "engine/ops/geglu.h"
#include "engine/ops/linear.h"
#include "engine/ops/lm_head_loss.h"
#include "engine/ops/lora_linear.h"
#include "engine/ops/residual.h"
#include "engine/ops/bias.h"
#include "engine/ops/rmsnorm.h"
#include "engine/ops/rope.h"
#include "engine/ops/swiglu.h"
#include "engine/random.h"
#include "tests/gpu_support.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace cw::test::op_table {
namespace {

// ---- Writing a row ----
Arg arg(std::string name, Role role, std::vector<int64_t> shape, Dt dt = Dt::compute, std::string of = "",
        Acc acc = Acc::mode) {
  Arg a;
  a.name = std::move(name), a.role = role, a.shape = std::move(shape), a.dt = dt, a.of = std::move(of), a.acc = acc;
  return a;
}
Arg in(std::string name, std::vector<int64_t> shape) { return arg(std::move(name), Role::input, std::move(shape)); }
Arg out(std::string name, std::vector<int64_t> shape) { return arg(std::move(name), Role::output, std::move(shape)); }
Arg saved(std::string name, std::vector<int64_t> shape) { return arg(std::move(name), Role::saved, std::move(shape), Dt::accum); }
Arg state(std::string name, std::vector<int64_t> shape) { return arg(std::move(name), Role::state, std::move(shape)); }
Arg cot(std::string name, std::string of) { return arg(std::move(name), Role::cotangent, {}, Dt::compute, std::move(of)); }
Arg grad(std::string name, std::string of, Acc acc = Acc::mode) {
  return arg(std::move(name), Role::grad, {}, acc == Acc::adds ? Dt::accum : Dt::compute, std::move(of), acc);
}


Row make_row(std::string name, std::vector<Arg> args, Forward forward, Backward backward = {}) {
  Row r;
  r.name = std::move(name), r.args = std::move(args), r.forward = std::move(forward), r.backward = std::move(backward);
  r.op = r.name.substr(0, r.name.find(' '));
  return r;
}

// Gradients and cotangents take the shape (and store) of what they belong to; every reference names
// an arg of the right role.
Row finish(Row r) {
  for (Arg& a : r.args) {
    if (a.role != Role::grad && a.role != Role::cotangent) continue;
    if (a.role == Role::grad && a.acc == Acc::writes) continue;
    const Arg* of = r.find(a.of);
    CW_CHECK(of != nullptr && (a.role == Role::grad ? of->role == Role::input : of->role == Role::output),
             "test_backend_ops row {}: {} refers to '{}', which is no {}", r.name, a.name, a.of,
             a.role == Role::grad ? "input" : "output");
    if (a.shape.empty()) {
      a.shape = of->shape;
      a.store = of->store;
    }
  }
  return r;
}
Row gpu_only(Row r) {
  r.cpu = false;
  return r;
}

// A view of `buffer`'s memory with the shape, dtype and device of `like` (for a forbidden alias; the
// op must refuse it before reading, and the memory is large enough if it did not).
Tensor alias_of(const Tensor& buffer, const Tensor& like) {
  CW_CHECK(buffer.bytes() >= like.bytes(), "test_backend_ops: {} cannot hold {}", buffer.describe(), like.describe());
  Tensor t = like;
  t.data = buffer.data;
  return t;
}

// ---- The rows of each op ----
Init ids_in(int64_t V) {  // token ids, half of them from the first 5 (repeats), the first V - 1, the last 0
  return [V](const Tensor& t, uint64_t seed, uint64_t stream) {
    Rng rng(mix64(seed ^ mix64(stream)));
    int32_t* p = t.ptr<int32_t>();
    const int64_t N = t.numel();
    for (int64_t n = 0; n < N; ++n)
      p[n] = static_cast<int32_t>(rng.below(static_cast<uint64_t>(n % 2 != 0 ? V : std::min<int64_t>(V, 5))));
    p[0] = static_cast<int32_t>(V - 1);
    p[N - 1] = 0;
  };
}

// scale: Gemma's normaliser (1: the plain lookup, a copy of the rows and exact in every dtype; another
// value rounds each product once, to the output's dtype).
Row embedding(int64_t N, int64_t V, int64_t C, double scale = 1.0) {
  return finish(make_row(fmt::format("embedding N={} V={} C={}{}", N, V, C,
                                     scale != 1.0 ? fmt::format(" scale={}", scale) : ""),
                 {in("ids", {N}).dtype(Dt::i32).with(ids_in(V)), in("table", {V, C}),
                  out("out", {N, C}).tolerance(scale == 1.0 ? kExact : kDefaultTol), cot("d_out", "out"),
                  grad("d_table", "table", Acc::adds).tolerance(kF32ResultTol)},
                 [=](const Tensors& t, Arena&) { embedding_forward(t("out"), t("ids"), t("table"), scale); },
                 [=](const Tensors& t, GradMode, Arena&) {
                   embedding_backward(t("d_table"), t("d_out"), t("ids"), scale);
                 }));
}

// with_dw false: d_w skipped (Tensor{}), a frozen norm. offset: the weight offset (1: Gemma's norm,
// x r (1 + w), its weights drawn near 0 as Gemma's are stored).
Row rmsnorm(int64_t N, int64_t C, bool with_dw = true, double offset = 0.0) {
  Row r = make_row(fmt::format("rmsnorm N={} C={}{}{}", N, C, with_dw ? "" : " (no d_w)",
                               offset != 0.0 ? fmt::format(" offset={}", offset) : ""),
                 {in("x", {N, C}), in("w", {C}).normal(1.0 - offset, 0.3), out("out", {N, C}),
                  saved("rstd", {N}).tolerance(kF32ResultTol), cot("d_out", "out"), grad("d_x", "x")},
                 [=](const Tensors& t, Arena&) { rmsnorm_forward(t("out"), {t("rstd")}, t("x"), t("w"), 1e-5, offset); },
                 [=](const Tensors& t, GradMode m, Arena& s) {
                   rmsnorm_backward(t("d_x"), with_dw ? t("d_w") : Tensor{}, t("d_out"), {t("rstd")}, t("x"), t("w"), m, s,
                                    offset);
                 });
  if (with_dw) r.args.push_back(grad("d_w", "w", Acc::adds).tolerance(kF32ResultTol));
  r = finish(r);
  r.takes_scratch = true;
  r.misuses = {{"out aliases x", [=](const Tensors& t, Arena&) {
                  rmsnorm_forward(t("x"), {t("rstd")}, t("x"), t("w"), 1e-5, offset);
                }}};
  return r;
}

// The scalings the rope rows take their tables from: llama3, and yarn, whose attention factor (here
// 0.1 ln 4 + 1) scales cos and sin, so the op is no longer a pure rotation.
const RopeScaling kRopeLlama3{RopeScaling::Type::llama3, 4.0, 1.0, 4.0, 16};
const RopeScaling kRopeYarn{.type = RopeScaling::Type::yarn, .factor = 4.0, .original_max_position = 16};

// cos and sin tables [P, D/2] (rounded to the run's accumulation dtype, as the GPU's f32 tables are).
Init rope_table(int64_t D, bool want_sin, const RopeScaling& scaling) {
  return [=](const Tensor& t, uint64_t, uint64_t) {
    OwnedTensor other = OwnedTensor::of_shape(DType::f64, shape_of(t));
    if (want_sin) rope_tables(other, t, D, 10000.0, scaling);
    else rope_tables(t, other, D, 10000.0, scaling);
  };
}

Row rope(int64_t B, int64_t T, int64_t H, int64_t D, int64_t P, int64_t pos0, const RopeScaling& scaling = kRopeLlama3) {
  Row r = finish(make_row(fmt::format("rope B={} T={} H={} D={} P={} pos0={} {}", B, T, H, D, P, pos0,
                                      rope_type_name(scaling.type)),
                 {in("x", {B, T, H, D}), in("cos", {P, D / 2}).dtype(Dt::accum).with(rope_table(D, false, scaling)),
                  in("sin", {P, D / 2}).dtype(Dt::accum).with(rope_table(D, true, scaling)), out("out", {B, T, H, D}),
                  cot("d_out", "out"), grad("d_x", "x")},
                 [=](const Tensors& t, Arena&) { rope_forward(t("out"), t("x"), t("cos"), t("sin"), pos0); },
                 [=](const Tensors& t, GradMode m, Arena&) {
                   rope_backward(t("d_x"), t("d_out"), t("cos"), t("sin"), pos0, m);
                 }));
  r.misuses = {{"d_x aliases d_out in accumulate mode", [=](const Tensors& t, Arena&) {
                  rope_backward(t("d_out"), t("d_out"), t("cos"), t("sin"), pos0, GradMode::accumulate);
                }}};
  return r;
}

// with_dx / with_dw false: that gradient skipped (Tensor{}), as for the first layer's input or a
// frozen weight.
Row linear(int64_t N, int64_t I, int64_t O, bool with_dx = true, bool with_dw = true) {
  Row r = make_row(fmt::format("linear N={} I={} O={}{}{}", N, I, O, with_dx ? "" : " (no d_x)", with_dw ? "" : " (no d_W)"),
        {in("x", {N, I}), in("W", {O, I}), out("out", {N, O}), cot("d_out", "out")},
        [](const Tensors& t, Arena&) { linear_forward(t("out"), t("x"), t("W")); },
        [=](const Tensors& t, GradMode m, Arena&) {
          linear_backward(with_dx ? t("d_x") : Tensor{}, with_dw ? t("d_W") : Tensor{}, t("d_out"), t("x"), t("W"), m);
        });
  if (with_dx) r.args.push_back(grad("d_x", "x"));
  if (with_dw) r.args.push_back(grad("d_W", "W", Acc::adds).tolerance(kLinearDwTol));
  if (O <= I)
    r.misuses.push_back({"out aliases x", [](const Tensors& t, Arena&) {
                           linear_forward(alias_of(t("x"), t("out")), t("x"), t("W"));
                         }});
  if (with_dx)
    r.misuses.push_back({"d_x aliases x", [=](const Tensors& t, Arena&) {
                           linear_backward(t("x"), with_dw ? t("d_W") : Tensor{}, t("d_out"), t("x"), t("W"),
                                           GradMode::overwrite);
                         }});
  return finish(r);
}

// A frozen linear with a LoRA adapter of rank r, scale 1.5, dropout p (the mask of a chunk of sequences
// of 3 tokens at position 5, the call's rows starting at row 2 of the chunk, as a tiled MLP's shard;
// its columns from column0 of the whole input, as a tensor-parallel rank's slice, and then its
// sequences from the batch's fifth, as a data-parallel rank's).
// with_dx / with_da / with_db false: that gradient skipped.
Row lora_linear(int64_t N, int64_t I, int64_t O, int64_t rank, double p, bool with_dx = true, bool with_da = true,
                bool with_db = true, int64_t column0 = 0) {
  const auto adapter = [=](const Tensors& t) {
    return LoraAdapter{t("A"), t("B"), 1.5, LoraDropout{p, 77, 3, 5, 2, column0, column0 ? 4 : 0}};
  };
  Row r = make_row(fmt::format("lora_linear N={} I={} O={} r={} dropout={}{}{}{}{}", N, I, O, rank, p,
                               with_dx ? "" : " (no d_x)", with_da ? "" : " (no d_A)", with_db ? "" : " (no d_B)",
                               column0 ? fmt::format(" columns from {}", column0) : ""),
        {in("x", {N, I}), in("W", {O, I}), in("A", {rank, I}), in("B", {O, rank}), out("out", {N, O}), cot("d_out", "out")},
        [=](const Tensors& t, Arena& s) { lora_linear_forward(t("out"), t("x"), t("W"), adapter(t), s); },
        [=](const Tensors& t, GradMode m, Arena& s) {
          lora_linear_backward(with_dx ? t("d_x") : Tensor{}, with_da ? t("d_A") : Tensor{}, with_db ? t("d_B") : Tensor{},
                               t("d_out"), t("x"), t("W"), adapter(t), m, s);
        });
  if (with_dx) r.args.push_back(grad("d_x", "x"));
  // out = x W^T + s (x A^T) B^T and d_x = d_out W + s (d_out B) A: each term rounded apart in bf16
  // (the base product, and u = x A^T or g = d_out B), so the error is the terms' size times 2^-9,
  // whatever their sum: with one output element the two can cancel (N = I = O = r = 1 does for about
  // 3% of seeds in bf16). The terms from the ops themselves: the base alone and the adapter over a zero W.
  r.term_scale = [=](const Tensors& t, const std::string& name) -> double {
    if (name != "out" && name != "d_x") return 0.0;
    const Tensor x = t("x"), W = t("W");
    const std::vector<int64_t> shape = name == "out" ? std::vector<int64_t>{N, O} : std::vector<int64_t>{N, I};
    OwnedTensor zero_w(DType::f64, {O, I}), base = OwnedTensor::of_shape(DType::f64, shape),
                                            adapter_term = OwnedTensor::of_shape(DType::f64, shape);
    fill(zero_w, 0.0);
    Arena s;
    const LoraAdapter only_adapter = adapter(t);
    if (name == "out") {
      linear_forward(base, x, W);
      lora_linear_forward(adapter_term, x, zero_w, only_adapter, s);
    } else {
      linear_backward(base, Tensor{}, t("d_out"), x, W, GradMode::overwrite);
      lora_linear_backward(adapter_term, Tensor{}, Tensor{}, t("d_out"), x, zero_w, only_adapter, GradMode::overwrite, s);
    }
    auto norm = [](const Tensor& v) {
      double q = 0;
      for (int64_t k = 0; k < v.numel(); ++k) q += v.ptr<double>()[k] * v.ptr<double>()[k];
      return std::sqrt(q);
    };
    return norm(base) + norm(adapter_term);
  };
  // d_A and d_B (f32) of bf16 runs come from u and g rounded to bf16 (2^-9 each): bf16-level errors.
  if (with_da) r.args.push_back(grad("d_A", "A", Acc::adds));
  if (with_db) r.args.push_back(grad("d_B", "B", Acc::adds));
  r.takes_scratch = true;
  if (O <= I)
    r.misuses.push_back({"out aliases x", [=](const Tensors& t, Arena& s) {
                           lora_linear_forward(alias_of(t("x"), t("out")), t("x"), t("W"), adapter(t), s);
                         }});
  if (with_dx)
    r.misuses.push_back({"d_x aliases x", [=](const Tensors& t, Arena& s) {
                           lora_linear_backward(t("x"), Tensor{}, Tensor{}, t("d_out"), t("x"), t("W"), adapter(t),
                                                GradMode::overwrite, s);
                         }});
  return finish(r);
}

// A linear's bias (Qwen2's q, k, v): out = x + b; d_b added, the column sums of d_out.
Row bias(int64_t N, int64_t O) {
  Row r = finish(make_row(fmt::format("bias N={} O={}", N, O),
                          {in("x", {N, O}), in("b", {O}), out("out", {N, O}), cot("d_out", "out"),
                           grad("d_b", "b", Acc::adds).tolerance(kF32ResultTol)},
                          [](const Tensors& t, Arena&) { bias_forward(t("out"), t("x"), t("b")); },
                          [](const Tensors& t, GradMode, Arena& s) { bias_backward(t("d_b"), t("d_out"), s); }));
  r.takes_scratch = true;
  return r;
}

Row swiglu(int64_t N, int64_t F) {
  Row r = finish(make_row(fmt::format("swiglu N={} F={}", N, F),
                 {in("gate", {N, F}).normal(0.0, 2.0), in("up", {N, F}), out("out", {N, F}), cot("d_out", "out"),
                  grad("d_gate", "gate"), grad("d_up", "up")},
                 [](const Tensors& t, Arena&) { swiglu_forward(t("out"), t("gate"), t("up")); },
                 [](const Tensors& t, GradMode m, Arena&) {
                   swiglu_backward(t("d_gate"), t("d_up"), t("d_out"), t("gate"), t("up"), m);
                 }));
  r.misuses = {{"d_gate and d_up are one buffer", [](const Tensors& t, Arena&) {
                  swiglu_backward(t("d_gate"), t("d_gate"), t("d_out"), t("gate"), t("up"), GradMode::overwrite);
                }}};
  return r;
}

// Gemma's gate: gelu (tanh approximation) in place of silu; gate drawn wide so the tanh saturates.
Row geglu(int64_t N, int64_t F) {
  Row r = finish(make_row(fmt::format("geglu N={} F={}", N, F),
                 {in("gate", {N, F}).normal(0.0, 2.0), in("up", {N, F}), out("out", {N, F}), cot("d_out", "out"),
                  grad("d_gate", "gate"), grad("d_up", "up")},
                 [](const Tensors& t, Arena&) { geglu_forward(t("out"), t("gate"), t("up")); },
                 [](const Tensors& t, GradMode m, Arena&) {
                   geglu_backward(t("d_gate"), t("d_up"), t("d_out"), t("gate"), t("up"), m);
                 }));
  r.misuses = {{"d_gate and d_up are one buffer", [](const Tensors& t, Arena&) {
                  geglu_backward(t("d_gate"), t("d_gate"), t("d_out"), t("gate"), t("up"), GradMode::overwrite);
                }}};
  return r;
}

// d_x by the call's mode, d_delta by the opposite one (or skipped).
Row residual(int64_t N, int64_t C, bool with_d_delta = true) {
  Row r = make_row(fmt::format("residual N={} C={}{}", N, C, with_d_delta ? "" : " (no d_delta)"),
        {in("x", {N, C}), in("delta", {N, C}), out("out", {N, C}), cot("d_out", "out"), grad("d_x", "x")},
        [](const Tensors& t, Arena&) { residual_forward(t("out"), t("x"), t("delta")); },
        [=](const Tensors& t, GradMode m, Arena&) {
          const GradMode other = m == GradMode::overwrite ? GradMode::accumulate : GradMode::overwrite;
          residual_backward(t("d_x"), m, with_d_delta ? t("d_delta") : Tensor{}, other, t("d_out"));
        });
  if (with_d_delta) r.args.push_back(grad("d_delta", "delta", Acc::flipped));
  r.misuses = {{"d_x aliases d_out in accumulate mode", [](const Tensors& t, Arena&) {
                  residual_backward(t("d_out"), GradMode::accumulate, Tensor{}, GradMode::overwrite, t("d_out"));
                }}};
  return finish(r);
}

// dst += src, dst of the compute dtype or (f32_dst) of the accumulation dtype.
Row accumulate_op(int64_t N, int64_t C, bool f32_dst) {
  Arg dst = state("dst", {N, C});
  if (f32_dst) dst.dtype(Dt::accum).tolerance(kF32ResultTol);
  return finish(make_row(fmt::format("accumulate N={} C={}{}", N, C, f32_dst ? " (dst f32)" : ""),
                 {dst, in("src", {N, C})},
                 [](const Tensors& t, Arena&) { accumulate(t("dst"), t("src")); }));
}

// Chunk against cache: c queries at [p, p + c), p = S - c; K/V (and d_K/d_V) the [0, S) slice of a
// store of T >= S positions (a larger batch stride when T > S, as the K/V store's). Unmasked: the
// keys a block wholly before the queries (any S, also below c). A sliding window (AttentionWindow):
// each query sees at most `window` keys; an unmasked block's queries sit `distance` past its first key.
struct AttnShape {
  int64_t B, c, S, H, Hkv, D, T;
  AttentionMask mask = AttentionMask::causal;
  // Packed documents (attention_forward_documents): per sequence its document starts; empty: none.
  std::vector<std::vector<int64_t>> docs = {};
  int64_t window = 0, distance = 0;
  double softcap = 0.0;  // Gemma 2's score cap (0: none)
};
std::string starts_text(const std::vector<std::vector<int64_t>>& docs) {
  std::string r;
  for (const auto& row : docs) r += fmt::format("{}[{}]", r.empty() ? "" : " ", fmt::join(row, ","));
  return r;
}
std::vector<Variant> attention_families() {
  return {{"cudnn deterministic", AttentionKernel::cudnn, true},
          {"cudnn", AttentionKernel::cudnn, false, false},
          {"flash-wgmma deterministic", AttentionKernel::flash_wgmma, true},
          {"flash-wgmma (atomic dQ)", AttentionKernel::flash_wgmma, false, false},
          {"flash-mma deterministic", AttentionKernel::flash_mma, true},
          {"flash-mma (atomic dQ)", AttentionKernel::flash_mma, false, false},
          {"flash-simt", AttentionKernel::flash_simt, true}};
}
Row attention(AttnShape a, std::vector<Variant> variants = attention_families()) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(a.D));
  const bool causal = a.mask == AttentionMask::causal;
  const bool documents = !a.docs.empty();
  const AttentionWindow window{a.window, causal ? 0 : a.distance};
  const std::string windowed = (a.window == 0 ? ""
                                : causal     ? fmt::format(" window={}", a.window)
                                             : fmt::format(" window={} distance={}", a.window, a.distance)) +
                               (a.softcap > 0 ? fmt::format(" softcap={}", a.softcap) : "");
  Row r = finish(make_row(documents ? fmt::format("attention documents {} B={} c={} S={} (p={}) H={} Hkv={} D={} T={}{}",
                                                  starts_text(a.docs), a.B, a.c, a.S, a.S - a.c, a.H, a.Hkv, a.D, a.T,
                                                  windowed)
                          : causal ? fmt::format("attention B={} c={} S={} (p={}) H={} Hkv={} D={} T={}{}", a.B, a.c, a.S,
                                               a.S - a.c, a.H, a.Hkv, a.D, a.T, windowed)
                                 : fmt::format("attention unmasked B={} c={} S={} H={} Hkv={} D={} T={}{}", a.B, a.c,
                                               a.S, a.H, a.Hkv, a.D, a.T, windowed),
                  {in("q", {a.B, a.c, a.H, a.D}), in("k", {a.B, a.S, a.Hkv, a.D}).in_store(a.T),
                   in("v", {a.B, a.S, a.Hkv, a.D}).in_store(a.T), out("out", {a.B, a.c, a.H, a.D}),
                   saved("lse", {a.B, a.H, a.c}).tolerance(kLseTol), cot("d_out", "out"), grad("d_q", "q"),
                   grad("d_k", "k", Acc::adds), grad("d_v", "v", Acc::adds)},
                  [=](const Tensors& t, Arena& s) {
                    if (documents)
                      attention_forward_documents(t("out"), {t("lse")}, t("q"), t("k"), t("v"), a.docs, scale, s,
                                                  a.window, a.softcap);
                    else
                      attention_forward(t("out"), {t("lse")}, t("q"), t("k"), t("v"), scale, s, a.mask, window,
                                        a.softcap);
                  },
                  [=](const Tensors& t, GradMode m, Arena& s) {
                    if (documents)
                      attention_backward_documents(t("d_q"), t("d_k"), t("d_v"), t("d_out"), {t("lse")}, t("q"),
                                                   t("k"), t("v"), t("out"), a.docs, scale, m, s, a.window, a.softcap);
                    else
                      attention_backward(t("d_q"), t("d_k"), t("d_v"), t("d_out"), {t("lse")}, t("q"), t("k"),
                                         t("v"), t("out"), scale, m, s, a.mask, window, a.softcap);
                  }));
  r.variants = std::move(variants);
  r.takes_scratch = true;
  r.unsupported = [mask = a.mask, docs = a.docs, window, softcap = a.softcap](const Tensors& t) -> std::string {
    // The calls the op makes: one, or with documents one per span (queries and keys of a sequence).
    auto ask = [&](const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& dq,
                   const Tensor& dout, const Tensor& dk, const Tensor& dv) {
      choose_attention_kernel(attention_call(q, k, v, o, nullptr, nullptr, nullptr, nullptr, mask, window, softcap),
                              attention_flags());
      choose_attention_kernel(attention_call(q, k, v, o, &dq, &dout, &dk, &dv, mask, window, softcap),
                              attention_flags());
    };
    try {
      if (docs.empty()) {
        ask(t("q"), t("k"), t("v"), t("out"), t("d_q"), t("d_out"), t("d_k"), t("d_v"));
      } else {
        const int64_t c = t("q").size(1), p = t("k").size(1) - c;
        for (const DocumentSpan& sp : document_spans(docs, t("q").size(0), p, c)) {
          const int64_t n = sp.q1 - sp.q0, keys = p + sp.q1 - sp.k0;
          auto rows = [&](const Tensor& x) { return x.slice(0, sp.b, 1).slice(1, sp.q0, n); };
          auto key_rows = [&](const Tensor& x) { return x.slice(0, sp.b, 1).slice(1, sp.k0, keys); };
          ask(rows(t("q")), key_rows(t("k")), key_rows(t("v")), rows(t("out")), rows(t("d_q")), rows(t("d_out")),
              key_rows(t("d_k")), key_rows(t("d_v")));
        }
      }
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  return r;
}

// Labels in [0, V): every 7th row and the rows [ignore_from, ignore_to) ignored, the first 0, the last V - 1.
Init labels_in(int64_t V, int64_t ignore_from, int64_t ignore_to) {
  return [=](const Tensor& t, uint64_t seed, uint64_t stream) {
    Rng rng(mix64(seed ^ mix64(stream)));
    int32_t* p = t.ptr<int32_t>();
    const int64_t N = t.numel();
    for (int64_t n = 0; n < N; ++n) {
      p[n] = static_cast<int32_t>(rng.below(static_cast<uint64_t>(V)));
      if (n % 7 == 3 || (n >= ignore_from && n < ignore_to)) p[n] = kIgnoreLabel;
    }
    p[0] = 0;
    if (N > 1) p[N - 1] = static_cast<int32_t>(V - 1);
  };
}

// The LM head with cross-entropy; L = sum of row_loss (the cotangent is ones, implicit in the op).
// fused: the backward is lm_head_loss_fused (loss and gradients in one pass) instead of
// lm_head_loss_backward. block_rows: the CPU's row blocks (the GPU picks its own: lm_head.cu).
// The reference's backward keeps its own lse: the GPU's is the log-sum-exp of logits rounded to
// bf16 (lm_head.cu), off by up to 2^-8 of the largest logit, and the f64 logits the reference
// recomputes against it give a softmax that does not sum to one: G = p - 1 at a confident row's
// label then errs by p times that, which nothing bounds relative to G (about 0.06% of seeds of the
// N = 7 row failed so in bf16: docs/gpu_op_checks.md). The lse's own error is the forward's check.
// softcap: Gemma 2's final-logit cap (0: none).
Row lm_head(int64_t N, int64_t C, int64_t V, bool fused, int64_t block_rows = 256, int64_t ignore_from = 0,
            int64_t ignore_to = 0, double softcap = 0.0) {
  const double norm = 0.75 * static_cast<double>(N);  // any positive normaliser
  Row r = make_row(fmt::format("lm_head_loss{} N={} C={} V={} block_rows={}{}{}", fused ? "_fused" : "", N, C, V,
                               block_rows,
                               ignore_to > ignore_from ? fmt::format(" ignoring [{}, {})", ignore_from, ignore_to) : "",
                               softcap > 0 ? fmt::format(" softcap={}", softcap) : ""),
        {in("x", {N, C}), in("W", {V, C}).normal(0.0, 2.0 / std::sqrt(static_cast<double>(C))),
         in("labels", {N}).dtype(Dt::i32).with(labels_in(V, ignore_from, ignore_to)), out("row_loss", {N}).dtype(Dt::accum),
         saved("lse", {N}).own_in_reference(),
         cot("d_row_loss", "row_loss").dtype(Dt::accum).with([](const Tensor& t, uint64_t, uint64_t) { fill(t, 1.0); })
             .implicit_in_op(),
         grad("d_x", "x"), grad("d_W", "W", Acc::adds)},
        [=](const Tensors& t, Arena& s) {
          lm_head_loss_forward(t("row_loss"), {t("lse")}, t("x"), t("W"), t("labels"), norm, s, block_rows, softcap);
        },
        [=](const Tensors& t, GradMode m, Arena& s) {
          if (fused)
            lm_head_loss_fused(t("fused_loss"), t("d_x"), t("d_W"), t("x"), t("W"), t("labels"), norm, m, s, block_rows,
                               softcap);
          else
            lm_head_loss_backward(t("d_x"), t("d_W"), {t("lse")}, t("x"), t("W"), t("labels"), norm, m, s, block_rows,
                                  softcap);
        });
  if (fused) r.args.push_back(arg("fused_loss", Role::grad, {N}, Dt::accum, "", Acc::writes));
  r.op = "lm_head";
  r.takes_scratch = true;
  r.misuses = {{"d_x aliases x", [=](const Tensors& t, Arena& s) {
                  if (fused)
                    lm_head_loss_fused(t("fused_loss"), t("x"), t("d_W"), t("x"), t("W"), t("labels"), norm,
                                       GradMode::overwrite, s, block_rows, softcap);
                  else
                    lm_head_loss_backward(t("x"), t("d_W"), {t("lse")}, t("x"), t("W"), t("labels"), norm,
                                          GradMode::overwrite, s, block_rows, softcap);
                }}};
  return finish(r);
}

// The logits alone (sampling, comparisons), capped or not: a forward only.
Row lm_head_logits_row(int64_t N, int64_t C, int64_t V, double softcap) {
  Row r = make_row(fmt::format("lm_head_logits N={} C={} V={}{}", N, C, V,
                               softcap > 0 ? fmt::format(" softcap={}", softcap) : ""),
                   {in("x", {N, C}), in("W", {V, C}).normal(0.0, 2.0 / std::sqrt(static_cast<double>(C))),
                    out("logits", {N, V})},
                   [=](const Tensors& t, Arena&) { lm_head_logits(t("logits"), t("x"), t("W"), softcap); });
  r.op = "lm_head_logits";
  return finish(r);
}

Row adamw(int64_t n) {
  Row r = make_row(fmt::format("adamw_update n={}", n),
        {state("param", {n}), state("exp_avg", {n}).normal(0.0, 0.05),
         state("exp_avg_sq", {n}).with([](const Tensor& t, uint64_t seed, uint64_t stream) {
           fill_uniform(t, seed, stream, 0.0, 0.02);
         }),
         in("grad", {n}).normal(0.0, 0.5).any_float_dtype(), out("copy", {n}).dtype(Dt::bf16).tolerance(kBf16CopyTol)},
        [](const Tensors& t, Arena&) {
          adamw_update(t("param"), t("exp_avg"), t("exp_avg_sq"), t("grad"), t("copy"), {3e-2, 0.9, 0.95, 1e-8, 0.1, 3});
        });
  r.tol = kAdamWTol;
  r.gpu_dtypes = {DType::f32};
  return finish(r);
}

}  // namespace

std::vector<Row> build_table() {
  std::vector<Row> t;
  // embedding: repeated ids (the backward sums them)
  t.push_back(embedding(9, 7, 5));
  t.push_back(embedding(37, 50, 203));
  t.push_back(gpu_only(embedding(512, 1000, 2048)));
  // embedding times Gemma's normaliser: sqrt(5) and sqrt(203) (no power of two: every product rounds;
  // the small one under finite differences), sqrt(2048) rounded to bf16 on the GPU's vector-width rows
  t.push_back(embedding(9, 7, 5, std::sqrt(5.0)));
  t.push_back(embedding(37, 50, 203, std::sqrt(203.0)));
  t.push_back(gpu_only(embedding(512, 1000, 2048, 45.25)));
  // rmsnorm: C not a multiple of 32 or 4; N = 300: several d_w row blocks, the last partial
  t.push_back(rmsnorm(5, 8));
  t.push_back(rmsnorm(3, 17));
  t.push_back(rmsnorm(37, 203));
  t.push_back(gpu_only(rmsnorm(300, 64)));
  t.push_back(gpu_only(rmsnorm(512, 2048)));
  t.push_back(rmsnorm(5, 8, false));
  t.push_back(gpu_only(rmsnorm(300, 64, false)));
  t.push_back(gpu_only(rmsnorm(512, 2048, false)));
  // rmsnorm as Qwen3's per-head q/k norm: rows of one head each (tokens x heads), C the head dim
  t.push_back(rmsnorm(24, 6));
  t.push_back(gpu_only(rmsnorm(16384, 128)));
  t.push_back(gpu_only(rmsnorm(6000, 64)));
  // rmsnorm with Gemma's weight offset, (1 + w): both GPU paths (C = 203 scalar, C = 2048 vector), frozen
  t.push_back(rmsnorm(5, 8, true, 1.0));
  t.push_back(rmsnorm(37, 203, true, 1.0));
  t.push_back(rmsnorm(5, 8, false, 1.0));
  t.push_back(gpu_only(rmsnorm(512, 2048, true, 1.0)));
  t.push_back(gpu_only(rmsnorm(300, 64, false, 1.0)));
  // rope: offsets pos0 > 0, an odd half head dim (D = 10), a realistic head
  t.push_back(rope(2, 5, 3, 8, 16, 7));
  t.push_back(rope(2, 5, 3, 8, 16, 7, kRopeYarn));
  t.push_back(rope(1, 3, 2, 10, 8, 2));
  t.push_back(rope(2, 37, 3, 10, 64, 5));
  t.push_back(gpu_only(rope(2, 37, 3, 128, 64, 5)));
  // linear: odd sizes, 1 x 1 x 1, each gradient alone, a realistic layer
  t.push_back(linear(4, 6, 3));
  t.push_back(linear(1, 1, 1));
  t.push_back(linear(5, 7, 3, true, false));
  t.push_back(linear(5, 7, 3, false, true));
  t.push_back(linear(37, 203, 61));
  t.push_back(gpu_only(linear(1024, 2048, 2048)));
  // lora_linear: tiny, rank 1, dropout (the mask regenerated in the backward), each gradient alone,
  // I not a multiple of any vector width, realistic layers with and without dropout
  t.push_back(lora_linear(4, 6, 5, 2, 0.0));
  t.push_back(lora_linear(1, 1, 1, 1, 0.0));
  t.push_back(lora_linear(5, 7, 3, 3, 0.3));
  t.push_back(lora_linear(5, 7, 3, 3, 0.3, true, false, false));
  t.push_back(lora_linear(5, 7, 3, 3, 0.3, false, true, false));
  t.push_back(lora_linear(5, 7, 3, 3, 0.0, false, false, true));
  t.push_back(lora_linear(37, 61, 48, 4, 0.25));
  t.push_back(lora_linear(37, 61, 48, 4, 0.25, true, true, true, 122));  // a TP rank's input slice
  t.push_back(gpu_only(lora_linear(1024, 2048, 2048, 8, 0.0)));
  t.push_back(gpu_only(lora_linear(1024, 2048, 512, 16, 0.1)));
  t.push_back(gpu_only(lora_linear(777, 5632, 2048, 8, 0.05)));
  // bias: one row, odd sizes, several row blocks (the last partial), Qwen2.5-7B's fused q, k, v
  t.push_back(bias(1, 1));
  t.push_back(bias(37, 203));
  t.push_back(gpu_only(bias(1000, 1152)));
  t.push_back(gpu_only(bias(4096, 4608)));
  // swiglu
  t.push_back(swiglu(3, 7));
  t.push_back(swiglu(37, 203));
  t.push_back(gpu_only(swiglu(64, 1376)));
  // geglu: odd sizes (the vector kernels' scalar tail), a realistic row
  t.push_back(geglu(3, 7));
  t.push_back(geglu(37, 203));
  t.push_back(gpu_only(geglu(64, 1376)));
  // residual and accumulate
  t.push_back(residual(2, 3));
  t.push_back(residual(37, 203));
  t.push_back(residual(37, 203, false));
  t.push_back(accumulate_op(37, 203, false));
  t.push_back(accumulate_op(37, 203, true));
  // attention. Small (finite differences): chunk against cache with GQA 2, p = 0 in a padded store, decode.
  constexpr AttentionMask causal_mask = AttentionMask::causal;
  t.push_back(attention({2, 3, 8, 4, 2, 4, 8}));
  t.push_back(attention({1, 5, 5, 2, 1, 6, 7}));
  t.push_back(attention({1, 1, 6, 2, 2, 4, 6}));
  t.push_back(attention({2, 45, 150, 8, 2, 32, 200}));
  // The GPU shapes, every head dim: p = 0 (GQA 1); c < S with 130 and 1000 no multiples of any tile
  // (GQA 4); decode; B = 2 with K/V batch stride 200 rows > S = 150 (GQA 4).
  for (const int64_t D : {6, 32, 64, 128}) {
    t.push_back(gpu_only(attention({1, 77, 77, 4, 4, D, 77})));
    t.push_back(gpu_only(attention({1, 130, 1000, 4, 1, D, 1000})));
    t.push_back(gpu_only(attention({1, 1, 300, 4, 4, D, 300})));
    t.push_back(gpu_only(attention({2, 45, 150, 8, 2, D, 200})));
  }
  // Head dims past 128 (flash-simt's larger kernels; at Gemma 2's 256 flash-mma's too): c < S, a
  // window, unmasked.
  for (const int64_t D : {136, 256}) {
    t.push_back(gpu_only(attention({1, 130, 1000, 4, 1, D, 1000})));
    t.push_back(gpu_only(attention({2, 45, 150, 8, 2, D, 200, causal_mask, {}, 40})));
    t.push_back(gpu_only(attention({1, 130, 256, 4, 1, D, 256, AttentionMask::none, {}, 200, 300})));
  }
  // Several tensor-core query and key blocks, the last partial; query blocks starting inside a key block.
  t.push_back(gpu_only(attention({1, 300, 300, 2, 2, 64, 300})));
  t.push_back(gpu_only(attention({1, 300, 300, 2, 1, 128, 300})));
  t.push_back(gpu_only(attention({1, 520, 700, 4, 2, 128, 700})));
  t.push_back(gpu_only(attention({1, 520, 700, 4, 2, 64, 700})));
  t.push_back(gpu_only(attention({1, 300, 300, 2, 1, 256, 300})));
  t.push_back(gpu_only(attention({1, 520, 700, 4, 2, 256, 700})));
  // cuDNN's cases: bottom-right causal masks at p = 123, 136, 200, a single query at 129, padded stores.
  t.push_back(gpu_only(attention({1, 96, 96, 4, 4, 64, 96})));
  t.push_back(gpu_only(attention({2, 77, 77, 8, 2, 128, 80})));
  t.push_back(gpu_only(attention({2, 50, 173, 8, 2, 64, 181})));
  t.push_back(gpu_only(attention({1, 64, 200, 2, 2, 128, 200})));
  t.push_back(gpu_only(attention({2, 100, 300, 4, 1, 64, 301})));
  t.push_back(gpu_only(attention({1, 1, 130, 4, 1, 64, 130})));
  // Packed documents: a chunk's queries split at the document starts inside it, each span against
  // its own document's keys (a document begun before the chunk, one-token documents, a start at the
  // last query; the second sequence cut elsewhere); the GPU shapes across the tile sizes.
  t.push_back(attention({2, 6, 11, 4, 2, 4, 12, causal_mask, {{0, 3, 7, 8, 10}, {0, 5}}}));
  t.push_back(attention({1, 9, 9, 2, 1, 6, 9, causal_mask, {{0, 1, 2, 6}}}));
  for (const int64_t D : {64, 128}) {
    t.push_back(gpu_only(attention({2, 200, 700, 4, 2, D, 700, causal_mask, {{0, 130, 520, 521, 600}, {0, 650}}})));
    t.push_back(gpu_only(attention({1, 300, 300, 4, 1, D, 300, causal_mask, {{0, 64, 65, 190}}})));
  }
  // Unmasked key blocks (a long prefix attended block by block): fewer keys than queries, more, one;
  // GQA 2 and 4, a padded store; the GPU shapes across the tile sizes.
  constexpr AttentionMask none = AttentionMask::none;
  t.push_back(attention({2, 5, 3, 4, 2, 4, 8, none}));
  t.push_back(attention({1, 3, 7, 2, 1, 6, 7, none}));
  t.push_back(gpu_only(attention({1, 4, 1, 2, 2, 4, 3, none})));  // one key: dQ, dK exactly 0 (no FD check)
  for (const int64_t D : {6, 64, 128}) {
    t.push_back(gpu_only(attention({1, 130, 1000, 4, 1, D, 1000, none})));
    t.push_back(gpu_only(attention({2, 300, 64, 8, 2, D, 70, none})));
  }
  t.push_back(gpu_only(attention({1, 520, 700, 4, 2, 128, 701, none})));
  t.push_back(gpu_only(attention({1, 1, 300, 4, 4, 64, 300, none})));
  // Sliding windows (the CPU and every flash family; cuDNN refuses them, which the GPU runner reports):
  // a window as long as the chunk, one cutting inside the chunk, two keys, one longer than the keys (one key,
  // whose dQ and dK are zero by the math, is tests/engine/test_attention_documents.cpp's); with
  // packed documents (a window inside a document begun before the chunk); unmasked blocks whose last
  // queries see only the block's last keys. Score blocks of 64 query rows whose key ranges slide
  // (c = 70 against a window of 9).
  t.push_back(attention({2, 3, 8, 4, 2, 4, 8, causal_mask, {}, 3}));
  t.push_back(attention({1, 7, 9, 2, 1, 6, 9, causal_mask, {}, 4}));
  t.push_back(attention({1, 5, 5, 2, 2, 4, 7, causal_mask, {}, 2}));
  t.push_back(attention({1, 4, 6, 2, 1, 4, 6, causal_mask, {}, 20}));
  t.push_back(attention({2, 70, 75, 2, 1, 4, 75, causal_mask, {}, 9}));
  t.push_back(attention({2, 6, 11, 4, 2, 4, 12, causal_mask, {{0, 3, 7, 8, 10}, {0, 5}}, 3}));
  t.push_back(attention({1, 9, 12, 2, 1, 6, 12, causal_mask, {{0, 2, 6}}, 4}));
  t.push_back(attention({2, 5, 3, 4, 2, 4, 8, none, {}, 6, 3}));
  t.push_back(attention({1, 3, 7, 2, 1, 6, 7, none, {}, 8, 9}));
  // Sliding windows on the GPU, every flash family against the CPU: W = 2 (each query itself and the
  // key before it; at W = 1 dQ and dK are zero by the math, P = 1 and dP = Delta, and the f64
  // reference holds only rounding, which a relative comparison cannot weigh); W below a tile (17) and
  // not a multiple of one (100), with the chunk after a prefix (p = 870) and GQA 4; W a multiple of
  // the tiles (64) with B = 2 in a padded store; W = 650 cutting only the last rows' oldest keys; W
  // longer than every position (a no-op); decode; packed documents (the window inside a document
  // begun before the chunk); head dims only the SIMT family takes; at 256 (Gemma 2's sliding layers)
  // the SIMT and mma families. Unmasked blocks whose windows cut
  // every tile (query i at 64 + i sees keys j > i - 37, the last row one key) and start past the
  // block's first key. No row sees nothing (its lse is -inf, which the comparison cannot weigh;
  // tests/engine/test_attention_documents.cpp covers it on the CPU).
  for (const int64_t D : {64, 128, 256}) {
    t.push_back(gpu_only(attention({1, 300, 300, 4, 2, D, 300, causal_mask, {}, 2})));
    t.push_back(gpu_only(attention({1, 300, 300, 4, 1, D, 300, causal_mask, {}, 17})));
    t.push_back(gpu_only(attention({1, 130, 1000, 4, 1, D, 1000, causal_mask, {}, 100})));
    t.push_back(gpu_only(attention({2, 200, 450, 4, 2, D, 460, causal_mask, {}, 64})));
    t.push_back(gpu_only(attention({1, 520, 700, 4, 2, D, 700, causal_mask, {}, 650})));
    t.push_back(gpu_only(attention({1, 130, 700, 4, 2, D, 700, causal_mask, {}, 5000})));
    t.push_back(gpu_only(attention({1, 1, 300, 4, 4, D, 300, causal_mask, {}, 33})));
    t.push_back(gpu_only(attention({2, 200, 700, 4, 2, D, 700, causal_mask, {{0, 130, 520, 521, 600}, {0, 650}}, 50})));
    t.push_back(gpu_only(attention({1, 100, 64, 4, 2, D, 70, none, {}, 101, 64})));
    t.push_back(gpu_only(attention({1, 130, 256, 4, 1, D, 256, none, {}, 200, 300})));
  }
  for (const int64_t D : {6, 32}) {
    t.push_back(gpu_only(attention({1, 77, 300, 4, 2, D, 300, causal_mask, {}, 40})));
    t.push_back(gpu_only(attention({2, 45, 150, 8, 2, D, 200, causal_mask, {}, 7})));
  }
  // Gemma 2's score cap (the CPU, flash-simt and, at head dims 64, 128 and 256, flash-mma; cuDNN and
  // flash-wgmma report these rows skipped with the chooser's refusal, test_attention_choice.cpp). Caps of 0.7 and 1.5
  // against scores of about unit size, so tanh is far from linear: chunk against cache with GQA,
  // p = 0, with a window, with packed documents (and a window), unmasked blocks (with a window),
  // score blocks of 64 rows.
  t.push_back(attention({2, 3, 8, 4, 2, 4, 8, causal_mask, {}, 0, 0, 0.7}));
  t.push_back(attention({1, 5, 5, 2, 1, 6, 7, causal_mask, {}, 0, 0, 1.5}));
  t.push_back(attention({1, 7, 9, 2, 1, 6, 9, causal_mask, {}, 4, 0, 0.7}));
  t.push_back(attention({2, 6, 11, 4, 2, 4, 12, causal_mask, {{0, 3, 7, 8, 10}, {0, 5}}, 0, 0, 0.7}));
  t.push_back(attention({1, 9, 12, 2, 1, 6, 12, causal_mask, {{0, 2, 6}}, 4, 0, 1.5}));
  t.push_back(attention({2, 5, 3, 4, 2, 4, 8, none, {}, 0, 0, 0.7}));
  t.push_back(attention({1, 3, 7, 2, 1, 6, 7, none, {}, 8, 9, 1.5}));
  t.push_back(attention({2, 70, 75, 2, 1, 4, 75, causal_mask, {}, 9, 0, 0.7}));
  // The cap on the GPU shapes (flash-mma and flash-simt), head dims 64, 128 and Gemma 2's 256: c < S
  // with GQA 4, packed documents with a window, unmasked blocks, decode, several tensor-core blocks
  // each way with a window; Gemma 2's own cap of 50 at D 256.
  for (const int64_t D : {64, 128, 256}) {
    t.push_back(gpu_only(attention({1, 130, 1000, 4, 1, D, 1000, causal_mask, {}, 0, 0, 1.5})));
    t.push_back(gpu_only(attention({2, 200, 700, 4, 2, D, 700, causal_mask, {{0, 130, 520, 521, 600}, {0, 650}}, 50, 0,
                                    1.5})));
    t.push_back(gpu_only(attention({2, 300, 64, 8, 2, D, 70, none, {}, 0, 0, 1.5})));
    t.push_back(gpu_only(attention({1, 1, 300, 4, 4, D, 300, causal_mask, {}, 0, 0, 0.7})));
    t.push_back(gpu_only(attention({1, 520, 700, 4, 2, D, 700, causal_mask, {}, 300, 0, 1.5})));
  }
  t.push_back(gpu_only(attention({2, 45, 150, 8, 4, 256, 200, causal_mask, {}, 0, 0, 50.0})));
  // LM head: CPU row blocks of 3 with ignored rows; one GPU block with V = 101 (no multiple of the
  // 16-byte vector); three GPU blocks (2048, 2048, 37) with the second wholly ignored; long rows.
  for (const bool fused : {false, true}) {
    t.push_back(lm_head(7, 5, 11, fused, 3));
    t.push_back(lm_head(7, 5, 11, fused, 100));
    t.push_back(lm_head(37, 64, 101, fused));
    t.push_back(gpu_only(lm_head(4133, 64, 96, fused, 256, 2048, 4096)));
    t.push_back(gpu_only(lm_head(64, 64, 20011, fused)));
    // Gemma 2's final-logit cap: 1.5 against logits of about unit size (tanh far from linear), ignored
    // rows and row blocks on the CPU; the GPU's one and three blocks; a cap of 30 (Gemma 2's)
    t.push_back(lm_head(7, 5, 11, fused, 3, 0, 0, 1.5));
    t.push_back(lm_head(37, 64, 101, fused, 256, 0, 0, 1.5));
    t.push_back(lm_head(9, 6, 13, fused, 4, 0, 0, 30.0));
    t.push_back(gpu_only(lm_head(4133, 64, 96, fused, 256, 2048, 4096, 1.5)));
  }
  t.push_back(lm_head_logits_row(7, 5, 11, 0.0));
  t.push_back(lm_head_logits_row(7, 5, 11, 1.5));
  t.push_back(gpu_only(lm_head_logits_row(300, 64, 1001, 1.5)));
  // AdamW: an odd tail; more elements than one pass of the GPU grid (4096 blocks x 256 threads)
  t.push_back(adamw(37));
  t.push_back(gpu_only(adamw((int64_t{1} << 21) + 37)));
  return t;
}

TEST_CASE("backend ops: a NaN (an element never written) fails the comparison") {
  // The premise of the poisoned outputs.
  OwnedTensor ref(DType::f64, {3, 5}), got(DType::f64, {3, 5});
  fill_normal(ref, 1, 1);
  copy_convert(got, ref);
  CHECK(compare(got, ref).rel == 0);
  got.tensor.ptr<double>()[7] = std::numeric_limits<double>::quiet_NaN();
  CHECK_FALSE(compare(got, ref).rel <= kBf16Tol);
}


TEST_CASE(kFdRunner) {
  Outcome outcome;
  if (Selection::from_env().takes(DType::f64))
    for (const Row& row : table())
      if (row.cpu) fd_run(row, run_seed(), outcome);
  report(outcome, kFdRunner);
}

TEST_CASE(kCpuF32Runner) {
  Outcome outcome;
  if (Selection::from_env().takes(DType::f32))
    for (const Row& row : table())
      if (row.cpu) compare_run(kCpuF32Runner, row, Device::host(), DType::f32, kCuda, run_seed(), outcome);
  report(outcome, kCpuF32Runner);
}

TEST_CASE(kCpuContractRunner) {
  Outcome outcome;
  const Selection s = Selection::from_env();
  for (const Row& row : table())
    if (row.cpu)
      for (const DType dt : {DType::f64, DType::f32})
        if (s.takes(dt)) contract_run(kCpuContractRunner, row, Device::host(), dt, run_seed(), outcome);
  report(outcome, kCpuContractRunner);
}

TEST_CASE(kCudaContractRunner * doctest::skip(!cw::test::gpu_ready())) {
  Outcome outcome;
  const Selection s = Selection::from_env();
  for (const Row& row : table())
    if (row.cpu)
      for (const DType dt : row.gpu_dtypes)
        if (s.takes(dt)) contract_run(kCudaContractRunner, row, gpu0(), dt, run_seed(), outcome);
  report(outcome, kCudaContractRunner);
}

TEST_CASE(kCudaRunner * doctest::skip(!cw::test::gpu_ready())) {
  Outcome outcome;
  const Selection s = Selection::from_env();
  for (const Row& row : table())
    for (const DType dt : row.gpu_dtypes)
      for (const Variant& v : row.variants)
        if (s.takes(dt) && s.takes(v)) compare_run(kCudaRunner, row, gpu0(), dt, v, run_seed(), outcome);
  report(outcome, kCudaRunner);
}

}  // namespace cw::test::op_table
