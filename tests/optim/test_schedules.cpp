// The schedules against each other in fp64: seco must equal full to 1e-12 (per tensor relative L2),
// its loss to 1e-14; spaco with t = k must equal seco; spaco with t < k is a seeded estimator whose
// documented unbiasedness claim is checked over many seeds; seco's activation memory does not grow
// with the sequence length.
#include "engine/cpu/attention.h"
#include "engine/ops/lm_head_loss.h"
#include "optim/schedule.h"
#include "tests/support.h"

#include <cmath>

using namespace cw;

namespace {
constexpr double kLossTol = 1e-14;  // the same sum of per-token losses, grouped differently

struct Case {
  const char* name;
  int64_t B = 1, T = 24, chunk = 8, bwd_chunk = 0, kv_heads = 2;
  bool tied = false;
  int ignore = 0;  // 0 none; 1 scattered -100 labels; 2 scattered plus a whole unsupervised chunk
  const char* preset = "tiny";  // tiny-qwen2: q/k/v biases; tiny-qwen3: per-head q/k norms
};

LlamaConfig config_for(const Case& c) {
  LlamaConfig cfg = LlamaConfig::preset(c.preset);
  cfg.num_key_value_heads = c.kv_heads;
  cfg.tie_word_embeddings = c.tied;
  return cfg;
}

Batch batch_for(const Case& c, const LlamaConfig& cfg, uint64_t seed) {
  Batch b = random_batch(c.B, c.T, cfg.vocab_size, seed);
  int32_t* lab = b.labels.tensor.ptr<int32_t>();
  if (c.ignore >= 1)
    for (int64_t i = 0; i < c.B * c.T; i += 3) lab[i] = kIgnoreLabel;
  if (c.ignore >= 2)  // positions [8, 16) of every sequence carry no loss: a whole chunk at chunk = 8
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t t = 8; t < 16 && t < c.T; ++t) lab[b * c.T + t] = kIgnoreLabel;
  return b;
}

// The case's model in f64 with `layers` layers (0: the preset's), parameters drawn from `seed`
// (init scale 0.1), and the case's batch drawn from seed + 1.
struct F64Setup {
  LlamaConfig cfg;
  LlamaModel model;
  Batch batch;
  F64Setup(const Case& c, int64_t layers, uint64_t seed)
      : cfg(with_layers(config_for(c), layers)), model(cfg, DType::f64), batch(batch_for(c, cfg, seed + 1)) {
    init_parameters(model.params(), seed, cfg.initializer_range, 0.1);
  }
  static LlamaConfig with_layers(LlamaConfig cfg, int64_t layers) {
    if (layers > 0) cfg.num_hidden_layers = layers;
    return cfg;
  }
};

struct Result {
  double loss;
  StepStats stats;
};

Result run(const ScheduleOptions& o, LlamaModel& model, const Batch& batch, ParamSet& grads) {
  grads.zero();
  auto s = Schedule::create(o);
  StepStats st = s->step(model, batch, grads);
  return {st.loss, st};
}

// seco, or spaco backpropagating 4 of the chunks (sample seed 5), in chunks of `chunk` (reverse chunks of
// bwd_chunk; 0: the same).
ScheduleOptions chunked(const char* name, int64_t chunk, int64_t bwd_chunk = 0) {
  ScheduleOptions o;
  o.kind = parse_schedule_kind(name);
  o.chunk = chunk;
  o.bwd_chunk = bwd_chunk;
  if (o.kind == ScheduleKind::spaco) o.keep = 4, o.seed = 5;
  return o;
}

// Two steps of one schedule built from `o` (the second reuses its store), each step's gradient (into
// `grads`) and loss the same bits as `want`'s; each step's statistics are returned.
std::vector<StepStats> two_steps_same_bits(const ScheduleOptions& o, LlamaModel& model, const Batch& batch,
                                           ParamSet& grads, const ParamSet& want_grads, const Result& want);

// Worst per-tensor relative L2 difference.
double max_rel(const ParamSet& a, const ParamSet& b, std::string* worst_report = nullptr) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const test::Worst w = test::compare(a[i], b[i]);
    if (w.rel >= worst) {
      worst = w.rel;
      if (worst_report) *worst_report = a.specs()[i].name + ": " + w.str();
    }
  }
  return worst;
}

std::vector<StepStats> two_steps_same_bits(const ScheduleOptions& o, LlamaModel& model, const Batch& batch,
                                           ParamSet& grads, const ParamSet& want_grads, const Result& want) {
  auto s = Schedule::create(o);
  std::vector<StepStats> steps;
  for (int step = 0; step < 2; ++step) {
    grads.zero();
    steps.push_back(s->step(model, batch, grads));
    CHECK(max_rel(grads, want_grads) == 0.0);
    CHECK(steps.back().loss == want.loss);
  }
  return steps;
}
}  // namespace

TEST_CASE("seco equals full backprop in fp64 across chunkings, batches, GQA ratios, ties and labels") {
  const Case cases[] = {
      {"chunk divides T", 1, 24, 8},
      {"chunk does not divide T", 1, 24, 7},
      {"chunk of one token", 1, 12, 1},
      {"one chunk: no prefill, a forward and backward", 1, 24, 24},
      {"last chunk shorter, not prefilled", 1, 24, 10},
      {"fwd chunk != bwd chunk", 1, 24, 7, 5},
      {"bwd chunk larger than fwd", 1, 24, 3, 10},
      {"batch of 3", 3, 20, 6},
      {"GQA ratio 1 (MHA)", 2, 24, 7, 0, 4},
      {"GQA ratio 4", 2, 24, 7, 0, 1},
      {"tied embeddings", 2, 24, 7, 0, 2, true},
      {"ignored labels", 2, 24, 8, 0, 2, false, 1},
      {"a whole unsupervised chunk", 2, 24, 8, 0, 2, true, 2},
      {"sequence past llama3 original context", 1, 64, 7, 5},
  };
  for (const Case& c : cases) {
    INFO("case: ", std::string(c.name));
    const LlamaConfig cfg = config_for(c);
    LlamaModel model(cfg, DType::f64);
    init_parameters(model.params(), 11, cfg.initializer_range, 0.1);
    const Batch batch = batch_for(c, cfg, 12);
    ParamSet g_full(cfg, DType::f64), g_seco(cfg, DType::f64);
    ScheduleOptions full, seco;
    seco.kind = ScheduleKind::seco;
    seco.chunk = c.chunk;
    seco.bwd_chunk = c.bwd_chunk;
    const Result rf = run(full, model, batch, g_full);
    const Result rs = run(seco, model, batch, g_seco);
    std::string report;
    const double rel = max_rel(g_seco, g_full, &report);
    INFO("worst tensor ", report);
    MESSAGE(std::string(c.name), ": max_rel_err=", rel, ", loss rel err=", std::abs(rs.loss - rf.loss) / rf.loss);
    CHECK(rel <= test::kSameMathF64Tol);
    CHECK(std::abs(rs.loss - rf.loss) <= kLossTol * std::abs(rf.loss));
  }
}

TEST_CASE("the fused Q/K/V projection equals three GEMMs in fp64: full backprop and seco, loss and gradients") {
  // model/layer.h: with Wq, Wk, Wv back to back one GEMM projects all three and one pair of GEMMs
  // backprops them; RoPE reads and writes the fused rows' q and k columns in place. Qwen2's biases are
  // added to the fused rows and their gradients summed from them; Qwen3's per-head norms work on
  // packed copies of the q and k columns.
  for (const auto& [preset, kv_heads] : {std::pair<const char*, int64_t>{"tiny", 2}, {"tiny", 4}, {"tiny-qwen2", 2},
                                         {"tiny-qwen3", 2}}) {
    Case c{"fused", 2, 24, 7, 0, kv_heads};
    c.preset = preset;
    INFO("preset ", preset, ", kv heads ", kv_heads);
    const LlamaConfig cfg = config_for(c);
    LlamaModel model(cfg, DType::f64);
    init_parameters(model.params(), 21, cfg.initializer_range, 0.1);
    const Batch batch = batch_for(c, cfg, 22);
    for (const char* name : {"full", "seco"}) {
      INFO("schedule ", name);
      ScheduleOptions o;
      o.kind = parse_schedule_kind(name);
      o.chunk = c.chunk;
      ParamSet g_fused(cfg, DType::f64), g_three(cfg, DType::f64);
      Result fused{}, three{};
      {
        const SettingScope<bool> on(fused_qkv, set_fused_qkv, true);
        fused = run(o, model, batch, g_fused);
      }
      {
        const SettingScope<bool> off(fused_qkv, set_fused_qkv, false);
        three = run(o, model, batch, g_three);
      }
      std::string report;
      const double rel = max_rel(g_fused, g_three, &report);
      INFO("worst tensor ", report);
      CHECK(rel <= test::kSameMathF64Tol);
      CHECK(rel > 0);  // the fused path ran: its sums round differently
      CHECK(std::abs(fused.loss - three.loss) <= kLossTol * std::abs(three.loss));
    }
  }
}

TEST_CASE("seco and spaco with the K/V store offloaded (window of layers) equal the store on the device, bitwise") {
  // On the CPU the residency's "device" slots are host memory and its copies memcpy at the call, so
  // the offload schedule (what moves where, when) runs exactly: any missed or stale copy changes bits.
  Case c{"offload", 2, 40, 7, 5, 2, false, 1};
  F64Setup f(c, 4, 21);
  ParamSet g_full(f.cfg, DType::f64), g_dev(f.cfg, DType::f64), g_off(f.cfg, DType::f64);
  ScheduleOptions full;
  run(full, f.model, f.batch, g_full);
  for (const char* name : {"seco", "spaco"}) {
    ScheduleOptions o = chunked(name, c.chunk, c.bwd_chunk);
    const Result on_device = run(o, f.model, f.batch, g_dev);
    for (int64_t window : {1, 2, 3}) {
      INFO(name, " offload_window ", window);
      o.offload_window = window;
      // A second step on the same store (reset between steps) gives the same bits.
      const StepStats st = two_steps_same_bits(o, f.model, f.batch, g_off, g_dev, on_device).front();
      // The device holds the window's layers; the host every layer; copies happened.
      CHECK(st.kv_bytes * 4 == st.kv_host_bytes * static_cast<size_t>(window));
      CHECK(st.kv_bytes_moved > 0);
      o.offload_window = 0;
    }
    if (o.kind == ScheduleKind::seco) CHECK(max_rel(g_dev, g_full) <= test::kSameMathF64Tol);
  }
  ScheduleOptions bad;
  bad.offload_window = 2;  // full keeps no store across chunks
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("offload_window applies to schedules seco and spaco"), Error);
}

TEST_CASE("seco and spaco with saved attention outputs equal them without; offloaded too, bitwise") {
  // The prefill's attention output of a query equals the recompute's when the chunks are the same,
  // so reading it back changes no bit; with other backward chunks it is the same math (1e-12).
  Case c{"saved", 2, 40, 7, 0, 2, false, 1};
  F64Setup f(c, 4, 31);
  ParamSet g_full(f.cfg, DType::f64), g_plain(f.cfg, DType::f64), g_saved(f.cfg, DType::f64);
  ScheduleOptions full;
  run(full, f.model, f.batch, g_full);
  for (const char* name : {"seco", "spaco"}) {
    ScheduleOptions o = chunked(name, c.chunk);
    for (int64_t window : {0, 1, 2, 3}) {
      INFO(name, " offload_window ", window);
      o.offload_window = window;
      o.save_attention = false;
      const Result plain = run(o, f.model, f.batch, g_plain);
      o.save_attention = true;
      two_steps_same_bits(o, f.model, f.batch, g_saved, g_plain, plain);
    }
    if (o.kind == ScheduleKind::seco) CHECK(max_rel(g_saved, g_full) <= test::kSameMathF64Tol);
  }
  // Backward chunks other than the prefill's: the saved rows are re-split.
  ScheduleOptions o;
  o.kind = ScheduleKind::seco;
  o.chunk = 7;
  o.bwd_chunk = 5;
  o.save_attention = true;
  for (int64_t window : {0, 2}) {
    o.offload_window = window;
    run(o, f.model, f.batch, g_saved);
    CHECK(max_rel(g_saved, g_full) <= test::kSameMathF64Tol);
  }
  // One reverse chunk: no prefill, so no saved outputs to read: its forward computes and saves them.
  o.chunk = 7;
  o.bwd_chunk = 40;
  for (int64_t window : {0, 2}) {
    INFO("one reverse chunk, offload_window ", window);
    o.offload_window = window;
    run(o, f.model, f.batch, g_saved);
    CHECK(max_rel(g_saved, g_full) <= test::kSameMathF64Tol);
  }
  // Offloaded, the recompute reads only the chunk's saved rows instead of the K/V prefix, which
  // outweighs writing the outputs once many chunks attend a long prefix (here 24 chunks).
  const Batch long_batch = random_batch(1, 96, f.cfg.vocab_size, 33);
  o.chunk = o.bwd_chunk = 4;
  o.offload_window = 2;
  o.save_attention = false;
  const Result plain = run(o, f.model, long_batch, g_plain);
  o.save_attention = true;
  const Result saved = run(o, f.model, long_batch, g_saved);
  MESSAGE("bytes moved over 96 tokens in chunks of 4: ", plain.stats.kv_bytes_moved, " without saved outputs, ",
          saved.stats.kv_bytes_moved, " with");
  CHECK(saved.stats.kv_bytes_moved < plain.stats.kv_bytes_moved);
  CHECK(max_rel(g_saved, g_plain) == 0.0);
  ScheduleOptions bad;
  bad.save_attention = true;  // full recomputes nothing
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("save_attention applies to schedules seco and spaco"), Error);
}

TEST_CASE("seco and spaco with saved layer inputs equal them without; offloaded too, bitwise") {
  // The prefill's layer inputs equal the reverse chunk's forward's when the chunks are the same, and
  // each layer recomputed from its saved input runs the same operations on the same values as the
  // chunk's forward did: the same bits. With other backward chunks, the same math (1e-12).
  Case c{"saved inputs", 2, 40, 7, 0, 2, false, 1};
  F64Setup f(c, 3, 37);
  ParamSet g_full(f.cfg, DType::f64), g_plain(f.cfg, DType::f64), g_in(f.cfg, DType::f64);
  ScheduleOptions full;
  run(full, f.model, f.batch, g_full);
  for (const char* name : {"seco", "spaco"})
    for (const bool saved : {false, true})
      for (const RecomputeMode recompute : {RecomputeMode::none, RecomputeMode::selective})
        for (int64_t window : {0, 1, 2}) {
          INFO(name, " save_attention ", saved, " recompute ", recompute_name(recompute), " offload_window ", window);
          ScheduleOptions o = chunked(name, c.chunk);
          o.save_attention = saved;
          o.recompute = recompute;
          o.offload_window = window;
          const Result plain = run(o, f.model, f.batch, g_plain);
          o.save_inputs = true;
          for (const StepStats& st : two_steps_same_bits(o, f.model, f.batch, g_in, g_plain, plain)) {
            // One layer's activations at a time, and no chunk's residual stream.
            CHECK(st.activation_high_water < plain.stats.activation_high_water);
            if (window > 0) CHECK(st.kv_host_bytes > plain.stats.kv_host_bytes);
          }
          if (o.kind == ScheduleKind::seco) CHECK(max_rel(g_in, g_full) <= test::kSameMathF64Tol);
        }
  // Backward chunks other than the prefill's: the saved rows are re-split.
  ScheduleOptions o;
  o.kind = ScheduleKind::seco;
  o.chunk = 7;
  o.bwd_chunk = 5;
  o.save_inputs = true;
  for (const bool saved : {false, true})
    for (int64_t window : {0, 2}) {
      INFO("bwd_chunk 5, save_attention ", saved, ", offload_window ", window);
      o.save_attention = saved;
      o.offload_window = window;
      run(o, f.model, f.batch, g_in);
      CHECK(max_rel(g_in, g_full) <= test::kSameMathF64Tol);
    }
  // One reverse chunk of all T: the prefill covers it, the backward reads it all from the store.
  o.bwd_chunk = 40;
  o.offload_window = 0;
  run(o, f.model, f.batch, g_in);
  CHECK(max_rel(g_in, g_full) <= test::kSameMathF64Tol);
  ScheduleOptions bad;
  bad.save_inputs = true;  // full has no prefill
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("save_inputs applies to schedules seco and spaco"), Error);
  bad.kind = ScheduleKind::seco;
  bad.stream_kv = true;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("streamed K/V store"), Error);
}

TEST_CASE("seco and spaco with the K/V store streamed in key blocks equal full backprop (f64, 1e-12)") {
  // The store in host homes of chunk-sized blocks, three device slots (the CPU's are host memory):
  // attention runs block by block and merges, so the sums differ from one call's only in rounding.
  Case c{"streamed", 2, 37, 8, 0, 2, false, 1};  // 5 blocks, the last of 5 tokens
  F64Setup f(c, 3, 41);
  ParamSet g_full(f.cfg, DType::f64), g(f.cfg, DType::f64), g_spaco(f.cfg, DType::f64);
  ScheduleOptions full;
  const Result rf = run(full, f.model, f.batch, g_full);
  for (const bool saved : {false, true})
    for (const RecomputeMode recompute : {RecomputeMode::none, RecomputeMode::selective, RecomputeMode::full}) {
      INFO("saved outputs ", saved, ", recompute ", recompute_name(recompute));
      ScheduleOptions o;
      o.kind = ScheduleKind::seco;
      o.chunk = c.chunk;
      o.stream_kv = true;
      o.save_attention = saved;
      o.recompute = recompute;
      auto s = Schedule::create(o);
      for (int step = 0; step < 2; ++step) {  // the second step reuses the store
        g.zero();
        const StepStats st = s->step(f.model, f.batch, g);
        CHECK(max_rel(g, g_full) <= test::kSameMathF64Tol);
        CHECK(std::abs(st.loss - rf.loss) <= kLossTol * std::abs(rf.loss));
        // Three blocks of 8 tokens on the "device", the whole store in host homes.
        CHECK(st.kv_host_bytes > 0);
        CHECK(st.kv_bytes * 5 <= st.kv_host_bytes * 3);
      }
    }
  // spaco visiting some chunks: the same estimate as with the store on the device.
  ScheduleOptions sp;
  sp.kind = ScheduleKind::spaco;
  sp.chunk = c.chunk;
  sp.keep = 2;
  sp.seed = 3;
  const Result plain = run(sp, f.model, f.batch, g_spaco);
  sp.stream_kv = true;
  const Result streamed = run(sp, f.model, f.batch, g);
  CHECK(max_rel(g, g_spaco) <= test::kSameMathF64Tol);
  CHECK(std::abs(streamed.loss - plain.loss) <= kLossTol * std::abs(plain.loss));
  // One chunk: one block, no prefix.
  ScheduleOptions one;
  one.kind = ScheduleKind::seco;
  one.chunk = 64;
  one.stream_kv = true;
  run(one, f.model, f.batch, g);
  CHECK(max_rel(g, g_full) <= test::kSameMathF64Tol);
  // The chunks must be the blocks; the two offloads do not combine.
  ScheduleOptions bad = one;
  bad.chunk = 8;
  bad.bwd_chunk = 4;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("bwd_chunk"), Error);
  bad.bwd_chunk = 0;
  bad.offload_window = 2;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("offload_window"), Error);
}

TEST_CASE("seco and spaco with layer recompute inside each chunk equal them without, bitwise") {
  // recompute = full keeps only each layer's input of the chunk and recomputes the layer before its
  // backward (with saved attention outputs, without attending again); selective drops the MLP's
  // intermediates. The same operations on the same inputs: the same bits.
  Case c{"recompute", 2, 40, 7, 5, 2, false, 1};
  F64Setup f(c, 3, 41);
  ParamSet g_plain(f.cfg, DType::f64), g_rec(f.cfg, DType::f64);
  for (const char* name : {"seco", "spaco"}) {
    for (const bool saved : {false, true}) {
      for (const int64_t window : {0, 2}) {
        ScheduleOptions o = chunked(name, c.chunk, c.bwd_chunk);
        o.save_attention = saved;
        o.offload_window = window;
        const Result plain = run(o, f.model, f.batch, g_plain);
        for (const RecomputeMode mode : {RecomputeMode::full, RecomputeMode::selective}) {
          INFO(name, " recompute ", recompute_name(mode), " save_attention ", saved, " offload_window ", window);
          o.recompute = mode;
          const Result rec = run(o, f.model, f.batch, g_rec);
          CHECK(max_rel(g_rec, g_plain) == 0.0);
          CHECK(rec.loss == plain.loss);
          // Fewer activations kept: a full recompute keeps one layer's at a time.
          if (mode == RecomputeMode::full) CHECK(rec.stats.activation_high_water < plain.stats.activation_high_water);
        }
      }
    }
  }
  ScheduleOptions o;
  o.kind = ScheduleKind::seco;
  CHECK(o.recompute_mode() == RecomputeMode::none);
  o.kind = ScheduleKind::checkpointed;
  CHECK(o.recompute_mode() == RecomputeMode::full);
}

TEST_CASE("checkpointed with offloaded layer inputs equals checkpointed, bitwise") {
  Case c{"offload inputs", 2, 24, 0};
  F64Setup f(c, 5, 23);
  ParamSet g_kept(f.cfg, DType::f64), g_off(f.cfg, DType::f64);
  ScheduleOptions o;
  o.kind = ScheduleKind::checkpointed;
  const Result kept = run(o, f.model, f.batch, g_kept);
  o.offload = true;
  const Result off = run(o, f.model, f.batch, g_off);
  CHECK(max_rel(g_off, g_kept) == 0.0);
  CHECK(off.loss == kept.loss);
}

TEST_CASE("spaco with t = k reproduces seco; with t < k it is seeded and inexact") {
  const Case c{"spaco", 2, 24, 6, 0, 2, false, 1};
  const LlamaConfig cfg = config_for(c);
  LlamaModel model(cfg, DType::f64);
  init_parameters(model.params(), 13, cfg.initializer_range, 0.1);
  const Batch batch = batch_for(c, cfg, 14);
  ParamSet g_seco(cfg, DType::f64), g_a(cfg, DType::f64), g_b(cfg, DType::f64), g_c(cfg, DType::f64);
  ScheduleOptions seco;
  seco.kind = ScheduleKind::seco;
  seco.chunk = 6;
  const Result rs = run(seco, model, batch, g_seco);
  ScheduleOptions all = seco;
  all.kind = ScheduleKind::spaco;
  all.keep = 4;  // k = 24 / 6
  const Result ra = run(all, model, batch, g_a);
  CHECK(max_rel(g_a, g_seco) <= test::kSameMathF64Tol);
  CHECK(std::abs(ra.loss - rs.loss) <= kLossTol * rs.loss);
  CHECK(ra.stats.chunks_visited == 4);

  ScheduleOptions some = all;
  some.keep = 2;
  some.seed = 99;
  const Result r1 = run(some, model, batch, g_b);
  run(some, model, batch, g_c);
  CHECK(r1.stats.chunks_visited == 2);
  CHECK(max_rel(g_b, g_c) == 0.0);              // deterministic for a seed
  CHECK(max_rel(g_b, g_seco) > 1e-3);           // and not the exact gradient
  CHECK(std::abs(r1.loss - rs.loss) <= kLossTol * rs.loss);  // the reported loss is exact
  some.seed = 100;
  run(some, model, batch, g_c);
  CHECK(max_rel(g_b, g_c) > 0.0);               // another seed, another sample (k=4, t=2: 6 subsets)
}

namespace {
// Mean of `samples` spaco estimates against `target`: returns ||mean - target||^2 divided by its
// expectation under unbiasedness, sum_j var_j / S. About 1 when unbiased; large when biased.
double bias_ratio(const ScheduleOptions& o, LlamaModel& model, const Batch& batch, const ParamSet& target, int samples) {
  const LlamaConfig& cfg = model.config();
  const int64_t n = target.numel();
  std::vector<double> sum(static_cast<size_t>(n), 0.0), sum_sq(static_cast<size_t>(n), 0.0);
  ParamSet g(cfg, DType::f64);
  auto s = Schedule::create(o);
  for (int k = 0; k < samples; ++k) {
    g.zero();
    s->step(model, batch, g, 0, static_cast<uint64_t>(k));
    const double* x = g.flat().ptr<double>();
    for (int64_t j = 0; j < n; ++j) {
      sum[j] += x[j];
      sum_sq[j] += x[j] * x[j];
    }
  }
  double err2 = 0, var_over_s = 0;
  const double* t = target.flat().ptr<double>();
  for (int64_t j = 0; j < n; ++j) {
    const double mean = sum[j] / samples;
    const double var = std::max(0.0, sum_sq[j] / samples - mean * mean) * samples / (samples - 1.0);
    err2 += (mean - t[j]) * (mean - t[j]);
    var_over_s += var / samples;
  }
  return err2 / var_over_s;
}
}  // namespace

TEST_CASE("spaco is unbiased for the chunk-local gradient (statistical, many seeds)") {
  // Labels only in some chunks, so the stratified variant is exercised meaningfully.
  const Case c{"stat", 1, 24, 4, 0, 2, false, 2};
  const LlamaConfig cfg = config_for(c);
  LlamaModel model(cfg, DType::f64);
  init_parameters(model.params(), 15, cfg.initializer_range, 0.1);
  const Batch batch = batch_for(c, cfg, 16);
  // The target: every chunk backpropagated with its relay dropped = sum_i g_i^0.
  ScheduleOptions exact_local;
  exact_local.kind = ScheduleKind::spaco;
  exact_local.chunk = 4;
  exact_local.drop_relay = true;
  ParamSet local(cfg, DType::f64);
  run(exact_local, model, batch, local);
  ParamSet full_grad(cfg, DType::f64);
  run(ScheduleOptions{}, model, batch, full_grad);
  REQUIRE(max_rel(local, full_grad) > 1e-2);  // the cross-chunk terms matter here

  const int samples = 300;
  ScheduleOptions est = exact_local;
  est.keep = 2;  // t = 2 of k = 6
  est.seed = 5;
  const double unbiased = bias_ratio(est, model, batch, local, samples);
  MESSAGE("spaco t=2/k=6, drop_relay, scale_loss: bias ratio ", unbiased, " (about 1 when unbiased)");
  CHECK(unbiased < 3.0);
  est.stratified = true;
  const double stratified = bias_ratio(est, model, batch, local, samples);
  MESSAGE("stratified: bias ratio ", stratified);
  CHECK(stratified < 3.0);
  // The same test rejects a biased estimator: without the k/t loss scaling the mean is t/k of the target.
  est.stratified = false;
  est.scale_loss = false;
  const double biased = bias_ratio(est, model, batch, local, samples);
  MESSAGE("without loss scaling: bias ratio ", biased);
  CHECK(biased > 50.0);
}

TEST_CASE("spaco's relay scaling multiplies exactly the relayed term (t = 2: one hop)") {
  // With t = 2 visited chunks i < j, chunk i's backward sees the loss term A and the relay R from j:
  // relay kept gives A + R, drop_relay A, scale_relay A + f R with f = k/t (or the cap). Backprop is
  // linear in the relayed dK/dV, so scale_relay = drop + f (kept - drop) up to rounding.
  const Case c{"relay", 1, 24, 4};
  const LlamaConfig cfg = config_for(c);
  LlamaModel model(cfg, DType::f64);
  init_parameters(model.params(), 21, cfg.initializer_range, 0.1);
  const Batch batch = batch_for(c, cfg, 22);
  ScheduleOptions kept;
  kept.kind = ScheduleKind::spaco;
  kept.chunk = 4;  // k = 6
  kept.keep = 2;
  kept.seed = 3;
  ScheduleOptions dropped = kept, scaled = kept, capped = kept;
  dropped.drop_relay = true;
  scaled.scale_relay = true;
  capped.scale_relay = true;
  capped.relay_cap = 2.0;
  ParamSet g_kept(cfg, DType::f64), g_drop(cfg, DType::f64), g(cfg, DType::f64), want(cfg, DType::f64);
  run(kept, model, batch, g_kept);
  run(dropped, model, batch, g_drop);
  REQUIRE(max_rel(g_kept, g_drop) > 1e-3);  // the relay matters
  for (const auto& [o, f] : {std::pair{scaled, 3.0}, std::pair{capped, 2.0}}) {
    run(o, model, batch, g);
    for (size_t i = 0; i < g.size(); ++i) {
      const double* k = g_kept[i].ptr<double>();
      const double* d = g_drop[i].ptr<double>();
      double* w = want[i].ptr<double>();
      for (int64_t n = 0; n < g[i].numel(); ++n) w[n] = d[n] + f * (k[n] - d[n]);
    }
    CAPTURE(f);
    CHECK(max_rel(g, want) <= test::kSameMathF64Tol);
  }
}

TEST_CASE("seco activation memory is bounded by one chunk, whatever T") {
  const LlamaConfig cfg = LlamaConfig::preset("tiny");
  LlamaModel model(cfg, DType::f64);
  init_parameters(model.params(), 17, cfg.initializer_range);
  ScheduleOptions seco;
  seco.kind = ScheduleKind::seco;
  seco.chunk = 8;
  size_t first = 0, kv_prev = 0;
  for (int64_t T : {32, 64, 128, 256}) {
    const Batch batch = random_batch(1, T, cfg.vocab_size, 18);
    ParamSet g(cfg, DType::f64);
    auto s = Schedule::create(seco);
    const StepStats st = s->step(model, batch, g);
    MESSAGE("T=", T, ": activation high-water ", st.activation_high_water, " bytes, K/V store ", st.kv_bytes, " bytes");
    // The CPU attention's scratch holds 8-row blocks of scores against all T keys, and the step keeps
    // every token's loss (f64, model/llama.h LossRows, summed once at the end): O(T) but tiny next to
    // the activations; everything else is O(chunk). Allow exactly those terms and nothing more.
    const size_t score_rows = cpu::attention_scratch_bytes(8, T, DType::f64, true) + size_t(T) * sizeof(double);
    if (first == 0) first = st.activation_high_water - score_rows;
    CHECK(st.activation_high_water - score_rows <= first);
    CHECK(st.kv_bytes > kv_prev);  // the store is what grows
    kv_prev = st.kv_bytes;
  }
  // The full schedule's activations grow with T.
  ScheduleOptions full;
  ParamSet g(cfg, DType::f64);
  const StepStats big = Schedule::create(full)->step(model, random_batch(1, 256, cfg.vocab_size, 19), g);
  CHECK(big.activation_high_water > 10 * first);
}

TEST_CASE("one backward chunk keeps one layer's dK, dV for all layers; the gradients are those of many chunks") {
  // Full backprop and seco whose reverse sweep is one chunk (one chunk, or a chunked prefill with
  // bwd_chunk = T) read each layer's dK, dV back within that layer's backward: the store then holds
  // one layer's accumulators (model/kv_store.h). Checked against seco in chunks, whose store holds all.
  const LlamaConfig cfg = LlamaConfig::preset("tiny");
  LlamaModel model(cfg, DType::f64);
  init_parameters(model.params(), 23, cfg.initializer_range, 0.1);
  const int64_t T = 24;
  const Batch batch = random_batch(2, T, cfg.vocab_size, 24);
  ScheduleOptions chunked;
  chunked.kind = ScheduleKind::seco, chunked.chunk = 6;
  ParamSet g_ref(cfg, DType::f64);
  const Result ref = run(chunked, model, batch, g_ref);
  const size_t row = size_t(cfg.num_key_value_heads * cfg.head_dim) * 8;  // f64 K or V of one token
  const size_t layers = size_t(cfg.num_hidden_layers), tokens = size_t(2 * T);
  CHECK(ref.stats.kv_bytes == layers * tokens * row * 4);  // K, V, dK, dV of every layer
  ScheduleOptions full, full_chunk_set, one_chunk, prefill_then_one, one_saved;
  full_chunk_set.chunk = 6;  // chunk is seco's and spaco's: full backprop is one chunk whatever it says
  one_chunk.kind = ScheduleKind::seco, one_chunk.chunk = T;
  prefill_then_one.kind = ScheduleKind::seco, prefill_then_one.chunk = 6, prefill_then_one.bwd_chunk = T;
  one_saved = one_chunk, one_saved.save_attention = true;  // nothing prefilled: the chunk attends itself
  CHECK_FALSE(chunked.layer_local_kv_grads(T, cfg.num_hidden_layers));
  ScheduleOptions windowed = one_chunk, streamed = one_chunk;
  windowed.offload_window = 1, streamed.stream_kv = true;
  CHECK_FALSE(windowed.layer_local_kv_grads(T, cfg.num_hidden_layers));  // the store's layers leave the device
  CHECK_FALSE(streamed.layer_local_kv_grads(T, cfg.num_hidden_layers));
  windowed.offload_window = cfg.num_hidden_layers;  // a window of every layer is the store on the device
  CHECK(windowed.layer_local_kv_grads(T, cfg.num_hidden_layers));
  for (const ScheduleOptions& o : {full, full_chunk_set, one_chunk, prefill_then_one, one_saved}) {
    CHECK(o.layer_local_kv_grads(T, cfg.num_hidden_layers));
    INFO(schedule_name(o.kind), " chunk ", o.chunk, " bwd_chunk ", o.bwd_chunk);
    ParamSet g(cfg, DType::f64);
    const Result r = run(o, model, batch, g);
    std::string report;
    CHECK(max_rel(g, g_ref, &report) <= test::kSameMathF64Tol);
    const size_t outputs = o.save_attention ? layers * tokens * size_t(cfg.num_attention_heads) * (size_t(cfg.head_dim) + 1) * 8 : 0;
    CHECK(r.stats.kv_bytes == layers * tokens * row * 2 + tokens * row * 2 + outputs);  // K, V of all; dK, dV of one
  }
  // A store built so refuses a backward that is not one chunk of all the tokens.
  KVStore kv(cfg, 1, T, DType::f64, {.with_grads = true, .layer_local_grads = true});
  CHECK_THROWS_WITH_AS(kv.begin_layer(0, KVStore::Use::backward, 12, T), doctest::Contains("one backward chunk"), Error);
  CHECK_THROWS_AS(KVStore(cfg, 1, T, DType::f64, {.with_grads = true, .offload_window = 1, .layer_local_grads = true}),
                  Error);  // offloaded
}

TEST_CASE("checkpointed and tiled-MLP schedules equal full backprop in fp64; they keep less") {
  const LlamaConfig cfg = LlamaConfig::preset("tiny");  // F = 40, C = 24: automatic shards = 2
  LlamaModel model(cfg, DType::f64);
  init_parameters(model.params(), 31, cfg.initializer_range, 0.1);
  Batch batch = random_batch(2, 24, cfg.vocab_size, 32);
  for (int64_t i = 0; i < 2 * 24; i += 5) batch.labels.tensor.ptr<int32_t>()[i] = kIgnoreLabel;
  ParamSet g_full(cfg, DType::f64);
  const Result rf = run(ScheduleOptions{}, model, batch, g_full);
  struct Variant {
    const char* name;
    ScheduleOptions o;
  };
  auto opts = [](const char* name, int64_t shards, int64_t chunk = 0) {
    ScheduleOptions o;
    o.kind = parse_schedule_kind(name);
    o.mlp_shards = shards;
    o.chunk = chunk;
    return o;
  };
  auto selective = [&](int64_t shards) {
    ScheduleOptions o = opts("checkpointed", shards);
    o.recompute = RecomputeMode::selective;
    return o;
  };
  const Variant variants[] = {
      {"checkpointed (layer inputs only)", opts("checkpointed", 1)},
      {"checkpointed + tiled MLP, 3 shards", opts("checkpointed", 3)},
      {"full + tiled MLP, automatic shards", opts("full", 0)},
      {"full + tiled MLP, 7 shards (uneven)", opts("full", 7)},
      {"seco + tiled MLP, 2 shards", opts("seco", 2, 7)},
      {"checkpointed, selective recompute (MLP intermediates)", selective(1)},
      {"checkpointed, selective recompute, 3 shards", selective(3)},
  };
  for (const Variant& v : variants) {
    INFO(std::string(v.name));
    ParamSet g(cfg, DType::f64);
    const Result r = run(v.o, model, batch, g);
    std::string report;
    const double rel = max_rel(g, g_full, &report);
    MESSAGE(std::string(v.name), ": max_rel_err=", rel, " (", report, "), activation high-water ",
            r.stats.activation_high_water, " bytes vs full ", rf.stats.activation_high_water);
    CHECK(rel <= test::kSameMathF64Tol);
    CHECK(std::abs(r.loss - rf.loss) <= kLossTol * rf.loss);
  }
  // What they keep: checkpointing drops every layer's activations but one at a time; tiling drops
  // the [N, F] intermediates. Measured at a length where activations dominate the arena.
  const Batch longer = random_batch(1, 256, cfg.vocab_size, 33);
  ParamSet g(cfg, DType::f64);
  const size_t full_hw = run(ScheduleOptions{}, model, longer, g).stats.activation_high_water;
  const size_t ckpt_hw = run(opts("checkpointed", 1), model, longer, g).stats.activation_high_water;
  const size_t tiled_hw = run(opts("full", 4), model, longer, g).stats.activation_high_water;
  const size_t selective_hw = run(selective(1), model, longer, g).stats.activation_high_water;
  MESSAGE("T=256 activation high-water: full ", full_hw, ", checkpointed ", ckpt_hw, ", tiled MLP x4 ", tiled_hw,
          ", selective ", selective_hw);
  CHECK(ckpt_hw < full_hw);
  CHECK(tiled_hw < full_hw);
  CHECK(selective_hw < full_hw);
  ScheduleOptions offload_without_checkpointing;
  offload_without_checkpointing.offload = true;
  CHECK_THROWS_AS(offload_without_checkpointing.validate(), Error);
  CHECK_THROWS_WITH_AS(parse_recompute_mode("selective-ish"),
                       doctest::Contains("schedule.recompute must be one of auto | full | selective | none"), Error);
}

// ---- LoRA (model/lora.h): adapters on a frozen base ----
namespace {
LoraConfig lora_config(const char* targets, double dropout) {
  LoraConfig l;
  l.rank = 3;
  l.alpha = 6.0;
  l.dropout = dropout;
  l.targets = targets;
  l.seed = 17;
  return l;
}

// A tiny GQA model with adapters: base from HF's rule (norms jittered), A from PEFT's and B random
// (PEFT's zero B would make A's gradient zero and hide a wrong one).
LlamaModel lora_model(const LoraConfig& l, int kv_heads = 2) {
  LlamaConfig cfg = LlamaConfig::preset("tiny");
  cfg.num_key_value_heads = kv_heads;
  LlamaModel m(cfg, DType::f64, Device::host(), nullptr, l);
  init_parameters(m.params(), 31, cfg.initializer_range, 0.1);
  init_lora_parameters(m.adapters(), l.seed, 0.1);
  return m;
}
}  // namespace

TEST_CASE("lora: seco, spaco with all chunks and checkpointed equal full backprop in fp64 (q_proj,v_proj; all-linear)") {
  // seco's relay is exact through the frozen k_proj/v_proj and their adapters: the K/V gradient read
  // back from the store enters x through W and the adapter, and the adapter accumulates its own. With
  // dropout the masks follow the tokens' positions, so the prefill, the recompute and full agree.
  for (const char* targets : {"q_proj,v_proj", "all-linear"})
    for (const double dropout : {0.0, 0.2}) {
      CAPTURE(std::string(targets));
      CAPTURE(dropout);
      LlamaModel model = lora_model(lora_config(targets, dropout));
      const Batch batch = batch_for(Case{"lora", 2, 24, 7, 0, 2, false, 1}, model.config(), 41);
      ParamSet g_full = ParamSet::like(model.adapters(), DType::f64), g = ParamSet::like(model.adapters(), DType::f64);
      ScheduleOptions full;
      const Result rf = run(full, model, batch, g_full);
      ScheduleOptions seco, seco_split, spaco, ckpt, tiled, selective, saved;
      seco.kind = ScheduleKind::seco, seco.chunk = 7;
      seco_split = seco, seco_split.bwd_chunk = 5;
      spaco.kind = ScheduleKind::spaco, spaco.chunk = 7, spaco.keep = 0, spaco.seed = 3;
      ckpt.kind = ScheduleKind::checkpointed;
      tiled.kind = ScheduleKind::checkpointed, tiled.mlp_shards = 3;  // adapters on a row shard: its dropout keys follow the rows
      selective = seco, selective.recompute = RecomputeMode::selective;
      saved = seco_split, saved.save_attention = true;
      for (const ScheduleOptions& o : {seco, seco_split, spaco, ckpt, tiled, selective, saved}) {
        const Result r = run(o, model, batch, g);
        std::string report;
        const double rel = max_rel(g, g_full, &report);
        INFO(schedule_name(o.kind), " chunk ", o.chunk, " bwd ", o.bwd_chunk, " shards ", o.mlp_shards, " recompute ",
             recompute_name(o.recompute), " save_attention ", o.save_attention, ": worst ", report);
        CHECK(rel <= test::kSameMathF64Tol);
        CHECK(std::abs(r.loss - rf.loss) <= kLossTol * std::abs(rf.loss));
      }
      // Every adapter gets a gradient (k_proj/v_proj's through the relay among them).
      for (size_t i = 0; i < g_full.size(); ++i) {
        double sum_sq = 0;
        const double* p = g_full[i].ptr<double>();
        for (int64_t k = 0; k < g_full[i].numel(); ++k) sum_sq += p[k] * p[k];
        CHECK_MESSAGE(sum_sq > 0, g_full.specs()[i].name, " has no gradient");
      }
    }
}

TEST_CASE("a sliding window: seco, spaco and their stores equal full backprop in fp64 (chunks shorter than, as long "
          "as and longer than the window; documents; LoRA)") {
  // tiny-mistral with windows of 2 to 40 keys on 24 tokens (one key, whose q and k get no gradient at
  // all, is the op's test's): seco's chunks read only each chunk's
  // window from the store, so its relay stops there; full reads all keys, masked by the op. The
  // window bites in every case but the one longer than the sequence (checked: full with and without
  // it differ).
  struct WindowCase {
    const char* name;
    int64_t window, chunk, bwd_chunk;
    bool documents = false;
  };
  const WindowCase cases[] = {
      {"chunk 3 < window 5", 5, 3, 0},          {"chunk = window", 5, 5, 0},
      {"chunk 7 > window, cut mid-chunk", 5, 7, 0}, {"forward 7, reverse 3", 5, 7, 3},
      {"forward 2, reverse 9", 5, 2, 9},        {"window of two keys", 2, 4, 0},
      {"window longer than T", 40, 7, 5},       {"documents, chunk 7 > window 5", 5, 7, 0, true},
      {"documents, chunk 4 < window 6", 6, 4, 3, true},
  };
  double worst = 0;
  for (const WindowCase& w : cases) {
    INFO(std::string(w.name));
    Case c{"window", 2, 24, w.chunk, w.bwd_chunk, 2, false, 1, "tiny-mistral"};
    LlamaConfig cfg = config_for(c);
    cfg.sliding_window = w.window;
    LlamaModel model(cfg, DType::f64);
    init_parameters(model.params(), 11, cfg.initializer_range, 0.1);
    Batch batch = batch_for(c, cfg, 12);
    if (w.documents) set_documents(batch, {{0, 9, 10, 17}, {0, 13}});
    ParamSet g_full(cfg, DType::f64), g(cfg, DType::f64);
    const Result rf = run(ScheduleOptions{}, model, batch, g_full);
    ScheduleOptions base = chunked("seco", w.chunk, w.bwd_chunk);
    std::vector<ScheduleOptions> variants(5, base);
    variants[1].save_attention = true;
    variants[2].save_inputs = true;
    variants[3].offload_window = 1;
    variants[4] = chunked("spaco", w.chunk, w.bwd_chunk), variants[4].keep = 0;  // every chunk: exact
    if (!w.documents && w.bwd_chunk == 0) variants.push_back(base), variants.back().stream_kv = true;
    for (const ScheduleOptions& o : variants) {
      INFO(schedule_name(o.kind), " save_attention ", o.save_attention, " save_inputs ", o.save_inputs,
           " offload_window ", o.offload_window, " stream_kv ", o.stream_kv);
      const Result r = run(o, model, batch, g);
      std::string report;
      const double rel = max_rel(g, g_full, &report);
      INFO("worst tensor ", report);
      CHECK(rel <= test::kSameMathF64Tol);
      CHECK(std::abs(r.loss - rf.loss) <= kLossTol * std::abs(rf.loss));
      worst = std::max(worst, rel);
    }
    LlamaConfig unwindowed = cfg;
    unwindowed.sliding_window = 0;
    unwindowed.family = ModelFamily::llama;
    LlamaModel plain(unwindowed, DType::f64);
    init_parameters(plain.params(), 11, cfg.initializer_range, 0.1);
    ParamSet g_plain(unwindowed, DType::f64);
    run(ScheduleOptions{}, plain, batch, g_plain);
    if (w.window < c.T) CHECK(max_rel(g_plain, g_full) > 1e-3);
  }
  MESSAGE("sliding window: seco, spaco (every chunk), saved outputs / inputs, offloaded and streamed stores against "
          "full: max_rel_err=", worst);
  // LoRA: the adapters' gradients through the windowed relay.
  LoraConfig l = lora_config("all-linear", 0.0);
  LlamaModel model(LlamaConfig::preset("tiny-mistral"), DType::f64, Device::host(), nullptr, l);
  init_parameters(model.params(), 31, model.config().initializer_range, 0.1);
  init_lora_parameters(model.adapters(), l.seed, 0.1);
  const Batch batch = batch_for(Case{"lora", 2, 24, 7, 0, 2, false, 1}, model.config(), 41);
  ParamSet g_full = ParamSet::like(model.adapters(), DType::f64), g = ParamSet::like(model.adapters(), DType::f64);
  const Result rf = run(ScheduleOptions{}, model, batch, g_full);
  for (const ScheduleOptions& o : {chunked("seco", 3), chunked("seco", 7, 4)}) {
    const Result r = run(o, model, batch, g);
    CHECK(max_rel(g, g_full) <= test::kSameMathF64Tol);
    CHECK(std::abs(r.loss - rf.loss) <= kLossTol * std::abs(rf.loss));
  }
}

TEST_CASE("gemma 2: every schedule equals full backprop in fp64 (a sliding and a global layer, capped scores and "
          "logits, post-norms; documents; LoRA)") {
  // tiny-gemma2: layer 0 attends through a window of 5 keys, layer 1 all earlier keys, both with
  // capped scores, norms on each sub-block's output, gelu. seco's relay stops at the window in layer
  // 0 only; a recompute for the backward runs W_down's product for the post-norm's backward.
  struct GemmaCase {
    const char* name;
    int64_t chunk, bwd_chunk;
    bool documents = false;
  };
  const GemmaCase cases[] = {
      {"chunk 3 < window 5", 3, 0},
      {"chunk 7 > window, forward 7, reverse 3", 7, 3},
      {"forward 2, reverse 9", 2, 9},
      {"documents, chunk 7 > window 5", 7, 0, true},
  };
  double worst = 0;
  for (const GemmaCase& gc : cases) {
    INFO(std::string(gc.name));
    const Case c{"gemma2", 2, 24, gc.chunk, gc.bwd_chunk, 2, true, 1, "tiny-gemma2"};
    const LlamaConfig cfg = config_for(c);
    LlamaModel model(cfg, DType::f64);
    init_parameters(model.params(), 11, cfg.initializer_range, 0.1);
    Batch batch = batch_for(c, cfg, 12);
    if (gc.documents) set_documents(batch, {{0, 9, 10, 17}, {0, 13}});
    ParamSet g_full(cfg, DType::f64), g(cfg, DType::f64);
    const Result rf = run(ScheduleOptions{}, model, batch, g_full);
    const ScheduleOptions base = chunked("seco", gc.chunk, gc.bwd_chunk);
    std::vector<ScheduleOptions> variants(5, base);
    variants[1].save_attention = true;
    variants[2].save_inputs = true;
    variants[3].offload_window = 1;
    variants[4] = chunked("spaco", gc.chunk, gc.bwd_chunk), variants[4].keep = 0;  // every chunk: exact
    if (!gc.documents && gc.bwd_chunk == 0) variants.push_back(base), variants.back().stream_kv = true;
    ScheduleOptions selective = chunked("seco", gc.chunk, gc.bwd_chunk);
    selective.recompute = RecomputeMode::selective;
    variants.push_back(selective);
    // The whole-sequence schedules: layers recomputed (the MLP's output too, for its post-norm), the
    // MLP in row shards, selective recompute.
    ScheduleOptions checkpointed;
    checkpointed.kind = ScheduleKind::checkpointed;
    variants.push_back(checkpointed);
    ScheduleOptions tiled;
    tiled.mlp_shards = 3;
    variants.push_back(tiled);
    ScheduleOptions checkpointed_selective = checkpointed;
    checkpointed_selective.recompute = RecomputeMode::selective;
    checkpointed_selective.mlp_shards = 2;
    variants.push_back(checkpointed_selective);
    for (const ScheduleOptions& o : variants) {
      INFO(schedule_name(o.kind), " save_attention ", o.save_attention, " save_inputs ", o.save_inputs,
           " offload_window ", o.offload_window, " stream_kv ", o.stream_kv, " mlp_shards ", o.mlp_shards);
      const Result r = run(o, model, batch, g);
      std::string report;
      const double rel = max_rel(g, g_full, &report);
      INFO("worst tensor ", report);
      CHECK(rel <= test::kSameMathF64Tol);
      CHECK(std::abs(r.loss - rf.loss) <= kLossTol * std::abs(rf.loss));
      worst = std::max(worst, rel);
    }
  }
  MESSAGE("gemma 2: seco, spaco (every chunk), saved outputs / inputs, offloaded and streamed stores, selective "
          "recompute, checkpointed, tiled MLP against full: max_rel_err=", worst);
  // LoRA: the adapters' gradients through the post-norms and the sliding layer's relay.
  LoraConfig l = lora_config("all-linear", 0.0);
  LlamaModel model(LlamaConfig::preset("tiny-gemma2"), DType::f64, Device::host(), nullptr, l);
  init_parameters(model.params(), 31, model.config().initializer_range, 0.1);
  init_lora_parameters(model.adapters(), l.seed, 0.1);
  const Batch batch = batch_for(Case{"lora", 2, 24, 7, 0, 2, true, 1, "tiny-gemma2"}, model.config(), 41);
  ParamSet g_full = ParamSet::like(model.adapters(), DType::f64), g = ParamSet::like(model.adapters(), DType::f64);
  const Result rf = run(ScheduleOptions{}, model, batch, g_full);
  for (const ScheduleOptions& o : {chunked("seco", 3), chunked("seco", 7, 4)}) {
    const Result r = run(o, model, batch, g);
    CHECK(max_rel(g, g_full) <= test::kSameMathF64Tol);
    CHECK(std::abs(r.loss - rf.loss) <= kLossTol * std::abs(rf.loss));
  }
}

TEST_CASE("lora: a frozen MLP keeps gate and up, not h2 and act; the step keeps that much less") {
  // h2 and act feed only the MLP's weight gradients; frozen without adapters it has none. (The
  // gradients themselves are checked above and by gradcheck against finite differences.)
  LlamaModel qv = lora_model(lora_config("q_proj,v_proj", 0.0));
  LlamaModel qv_down = lora_model(lora_config("q_proj,v_proj,down_proj", 0.0));
  const LlamaConfig& cf = qv.config();
  CHECK(qv.lora().freezes_mlp());
  CHECK_FALSE(qv_down.lora().freezes_mlp());
  CHECK_FALSE(LoraConfig{}.freezes_mlp());  // full-parameter training trains the MLP
  ActivationPolicy keep_all, frozen;
  frozen.mlp_frozen = true;
  const int64_t N = 64;
  CHECK(mlp_kept(keep_all, cf, N) == MlpKept::all);
  CHECK(mlp_kept(frozen, cf, N) == MlpKept::products);
  ActivationPolicy recomputed = frozen;
  recomputed.recompute_mlp = true;
  CHECK(mlp_kept(recomputed, cf, N) == MlpKept::input);  // a recomputed MLP needs its input h2
  const size_t dropped = size_t(cf.num_hidden_layers) * size_t(N) * size_t(cf.hidden_size + cf.intermediate_size) * 8;
  CHECK(ChunkActivations::bytes(cf, 1, N, DType::f64, keep_all) - ChunkActivations::bytes(cf, 1, N, DType::f64, frozen) ==
        dropped);
  // One full-backprop step at T = 256: the adapters on down_proj need act (and so keep h2 too).
  const Batch batch = random_batch(1, 256, cf.vocab_size, 5);
  ParamSet g_qv = ParamSet::like(qv.adapters(), DType::f64), g_qv_down = ParamSet::like(qv_down.adapters(), DType::f64);
  const size_t hw_qv = run(ScheduleOptions{}, qv, batch, g_qv).stats.activation_high_water;
  const size_t hw_qv_down = run(ScheduleOptions{}, qv_down, batch, g_qv_down).stats.activation_high_water;
  const size_t at_256 = dropped / size_t(N) * 256;
  MESSAGE("T=256 activation high-water: LoRA q,v ", hw_qv, " bytes, q,v,down ", hw_qv_down, " (h2 and act: ", at_256, ")");
  CHECK(hw_qv + at_256 * 9 / 10 <= hw_qv_down);
}

TEST_CASE("lora: a step needs the adapters' gradient table; full parameter gradients are refused") {
  LlamaModel model = lora_model(lora_config("q_proj", 0.0));
  const Batch batch = random_batch(1, 8, model.config().vocab_size, 2);
  ParamSet wrong(model.config(), DType::f64);
  auto s = Schedule::create(ScheduleOptions{});
  CHECK_THROWS_WITH_AS(s->step(model, batch, wrong), doctest::Contains("trainable parameters"), Error);
}

TEST_CASE("lora: dropout masks follow the step and the token, not the chunking; off outside a step") {
  LlamaModel model = lora_model(lora_config("all-linear", 0.3));
  const Batch batch = random_batch(2, 20, model.config().vocab_size, 3);
  Arena arena;
  const double off = batch_loss(model, batch, 0, arena);
  double round0 = 0, round0_chunked = 0, round1 = 0;
  {
    DropoutRoundScope masks(model, 0);
    round0 = batch_loss(model, batch, 0, arena);
    round0_chunked = batch_loss(model, batch, 6, arena);  // prefill chunks of 6: the same masks per token
  }
  {
    DropoutRoundScope masks(model, 1);
    round1 = batch_loss(model, batch, 0, arena);
  }
  CHECK(model.dropout_round() == std::nullopt);  // restored
  CHECK(std::abs(round0_chunked - round0) <= kLossTol * round0);
  CHECK(std::abs(round0 - off) > 1e-6 * off);
  CHECK(std::abs(round1 - round0) > 1e-6 * off);
  CHECK(batch_loss(model, batch, 0, arena) == off);
}
