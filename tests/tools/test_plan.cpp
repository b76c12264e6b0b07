// The planner (tools/planner/planner.h) and `chunkwise plan` (tools/plan.h): its memory and time model
// against the peaks and step times `chunkwise bench` recorded on an H100, and the plan's outputs. (What
// auto chooses on that model: test_plan_auto.cpp; its replay of the arena against a CPU step's:
// tests/tools/planner/test_arena_replay.cpp.)
#include "tests/support.h"
#include "tests/tools/plan_support.h"
#include "tools/plan.h"

#include "engine/engine.h"
#include "model/llama.h"
#include "model/shard.h"
#include "optim/schedule.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

using namespace cw;
using namespace cw::test;

namespace {
// The bar for the memory model: every recorded peak within 10%.
constexpr double kPeakTol = 0.10;
// Step time from FLOPs and fixed throughputs: a loose check (kernels' rates vary with shape).
constexpr double kStepTimeTol = 0.25;

struct Recorded {
  const char* source;  // its record: docs/performance.md's section, the run's date, length and settings
  ScheduleOptions schedule;
  int64_t T;
  double peak_gib, tokens_per_s;
  // cuDNN ran chunks' earlier keys apart (engine.h, cudnn_split_prefix): the rows "earlier keys apart" and later.
  bool prefix_apart = false;
};

// Llama-3.2-1B shape, batch 1, bf16; `chunkwise bench` peak_gib (the caching pool's peak) and tokens/s,
// median of 3 steps after 1 warm-up, on an H100 80GB HBM3. The seco steps were recorded while seco
// still prefilled its last reverse chunk (until 2026-11-27): the plan now counts one chunk's forward
// less (a quarter of the prefill at 16K in chunks of 4096), well inside the time tolerance. Each is a
// row of docs/performance.md, "Memory and the planner" (the recorded 1B runs), labelled by its date,
// length and settings.
const Recorded kRecorded[] = {
    {"Memory and the planner, 1B: 2026-11-21, 4K, full", sched("full"), 4096, 27.1, 47791},
    {"Memory and the planner, 1B: 2026-11-21, 8K, full", sched("full"), 8192, 32.8, 49913},
    {"Memory and the planner, 1B: 2026-11-21, 16K, checkpointed, selective, 4 MLP shards",
     sched("checkpointed", 0, "selective", 4), 16384, 31.3, 40343},
    {"Memory and the planner, 1B: 2026-11-21, 32K, checkpointed, selective, 4 MLP shards",
     sched("checkpointed", 0, "selective", 4), 32768, 43.8, 30703},
    {"Memory and the planner, 1B: 2026-11-21, 16K, checkpointed, full recompute",
     sched("checkpointed"), 16384, 26.0, 28635},
    {"Memory and the planner, 1B: 2026-11-21, 16K, checkpointed, inputs offloaded",
     sched("checkpointed", 0, "full", 1, true), 16384, 25.0, 28786},
    {"Memory and the planner, 1B: 2026-11-21, 32K, checkpointed, full recompute",
     sched("checkpointed"), 32768, 32.0, 19347},
    {"Memory and the planner, 1B: 2026-11-24, 16K, seco chunk 4096", sched("seco", 4096), 16384, 28.3, 31414},
    {"Memory and the planner, 1B: 2026-11-24, 32K, seco chunk 4096", sched("seco", 4096), 32768, 29.8, 22919},
    {"Memory and the planner, 1B: 2026-11-24, 64K, seco chunk 4096", sched("seco", 4096), 65536, 33.3, 14972},
    {"Memory and the planner, 1B: 2026-11-24, 128K, seco chunk 4096", sched("seco", 4096), 131072, 39.8, 8746},
    {"Memory and the planner, 1B: 2026-11-24, 256K, seco chunk 8192", sched("seco", 8192), 262144, 58.6, 4884},
    {"Memory and the planner, 1B: 2026-11-25, 16K, seco chunk 4096, saved attention",
     saved(sched("seco", 4096)), 16384, 29.3, 34618},
    {"Memory and the planner, 1B: 2026-11-25, 64K, seco chunk 4096, saved attention",
     saved(sched("seco", 4096)), 65536, 37.4, 17686},
    {"Memory and the planner, 1B: 2026-11-25, 128K, seco chunk 4096, saved attention",
     saved(sched("seco", 4096)), 131072, 48.0, 10601},
    {"Memory and the planner, 1B: 2026-11-25, 32K, seco chunk 4096, saved attention, window 2, recompute full",
     saved(sched("seco", 4096, "full"), 2), 32768, 22.64, 19885},
    {"Memory and the planner, 1B: 2026-11-25, 64K, seco chunk 8192, saved attention, window 2, recompute full",
     saved(sched("seco", 8192, "full"), 2), 65536, 24.53, 14434},
    {"Memory and the planner, 1B: 2026-11-25, 128K, seco chunk 4096, saved attention, window 2",
     saved(sched("seco", 4096), 2), 131072, 30.31, 9561},
    {"Memory and the planner, 1B: 2026-11-25, 512K, seco chunk 8192, window 2 (one step, warm-up 0)", [] {
       ScheduleOptions o = sched("seco", 8192);
       o.offload_window = 2;
       return o;
     }(), 524288, 43.37, 2090},
    // Recorded without the last chunk's prefill (from 2026-11-27 on).
    {"Memory and the planner, 1B: 2026-11-27, 16K, seco, one chunk of 16384",
     sched("seco", 16384), 16384, 45.00, 43729},
    {"Memory and the planner, 1B: 2026-11-27, 16K, seco, one chunk, selective, 4 MLP shards",
     sched("seco", 16384, "selective", 4), 16384, 31.25, 40112},
    {"Memory and the planner, 1B: 2026-11-27, 32K, seco chunk 4096, saved attention",
     saved(sched("seco", 4096)), 32768, 31.82, 26792},
    {"Memory and the planner, 1B: 2026-11-27, 64K, seco chunk 4096", sched("seco", 4096), 65536, 33.26, 15289},
    {"Memory and the planner, 1B: 2026-11-27, 64K, spaco chunk 4096, 2 of 16 chunks", [] {
       ScheduleOptions o = sched("spaco", 4096);
       o.keep = 2;
       return o;
     }(), 65536, 32.75, 46191},
    // Streamed runs before the one-warp merge: blocks then cost 1.2-2.4x one call.
    {"Memory and the planner, 1B: 2026-11-27, 128K, seco chunk 4096, saved attention, "
     "store streamed (the first merge kernel)",
     [] {
       ScheduleOptions o = saved(sched("seco", 4096));
       o.stream_kv = true;
       return o;
     }(), 131072, 26.90, 8861},
    {"Memory and the planner, 1B: 2026-11-27, 512K, seco chunk 16384, store streamed (one step, warm-up 0)", [] {
       ScheduleOptions o = sched("seco", 16384);
       o.stream_kv = true;
       return o;
     }(), 524288, 43.90, 2007},
    // Runs within HF+Liger's peak (the planner's picks of their day) and the 256K trace.
    {"Memory and the planner, 1B: 2026-11-27, 32K, seco chunk 2048, selective, saved attention, streamed", [] {
       ScheduleOptions o = saved(sched("seco", 2048, "selective"));
       o.stream_kv = true;
       return o;
     }(), 32768, 22.31, 16367},
    {"Memory and the planner, 1B: 2026-11-27, 64K, seco chunk 4096, saved attention, window 2",
     saved(sched("seco", 4096, "none"), 2), 65536, 28.53, 17221},
    {"Memory and the planner, 1B: 2026-11-27, 128K, seco chunk 2048, saved attention",
     saved(sched("seco", 2048, "none")), 131072, 45.03, 10191},
    {"Memory and the planner, 1B: 2026-11-27, 256K, seco chunk 8192, "
     "saved attention (workspace budget a quarter of free memory)",
     saved(sched("seco", 8192)), 262144, 74.06, 5520},
    // The streamed store with the one-warp merge; 256K with every backward on cuDNN but the
    // store-filling one (the workspace budget raised to the plan's).
    {"Memory and the planner, 1B: 2026-11-27, 128K, seco chunk 4096, saved attention, store streamed (one-warp merge)",
     [] {
       ScheduleOptions o = saved(sched("seco", 4096));
       o.stream_kv = true;
       return o;
     }(), 131072, 26.90, 9695},
    {"Memory and the planner, 1B: 2026-11-27, 128K, seco chunk 4096, saved attention", saved(sched("seco", 4096)),
     131072, 48.03, 10505},
    {"Memory and the planner, 1B: 2026-11-27, 256K, seco chunk 8192, saved attention (budget raised to the plan's)",
     saved(sched("seco", 8192)), 262144, 74.75, 5782},
    // cuDNN with the earlier keys apart, seco within HF+Liger's memory (the planner's picks).
    {"Memory and the planner, 1B: 2026-11-27, 32K, seco chunk 4096, saved attention, window 2, recompute full, "
     "earlier keys apart",
     saved(sched("seco", 4096, "full"), 2), 32768, 22.64, 25615, true},
    {"Memory and the planner, 1B: 2026-11-27, 128K, seco chunk 2048, saved attention, earlier keys apart",
     saved(sched("seco", 2048, "none")), 131072, 45.28, 11185, true},
    // The prefill in longer chunks than the reverse sweep (bwd_chunk).
    {"Memory and the planner, 1B: 2026-11-27, 32K, seco prefill 16384, reverse 4096, selective, saved, window 2, "
     "cast-layers", [] {
       ScheduleOptions o = saved(sched("seco", 16384, "selective"), 2);
       o.bwd_chunk = 4096;
       o.cast_layers = true;
       return o;
     }(), 32768, 22.30, 26533, true},
    {"Memory and the planner, 1B: 2026-11-27, 64K, seco prefill 16384, reverse 4096, saved, window 2", [] {
       ScheduleOptions o = saved(sched("seco", 16384, "none"), 2);
       o.bwd_chunk = 4096;
       return o;
     }(), 65536, 28.53, 19338, true},
};

// Every run above was recorded while the K/V store kept dK, dV for every layer. Since then a store on
// the device whose reverse sweep is one chunk of all T tokens keeps one layer's (model/kv_store.h):
// the expected peak is the measured one less the other L - 1 layers' f32 dK, dV.
double layer_local_saving_gib(const LlamaConfig& cf, int64_t T, const ScheduleOptions& o) {
  if (!o.layer_local_kv_grads(T, cf.num_hidden_layers)) return 0;
  return double(cf.num_hidden_layers - 1) * double(T * cf.num_key_value_heads * cf.head_dim) * 2 * 4 /
         double(1ull << 30);
}
}  // namespace

TEST_CASE("plan: predicted peaks and step times against the recorded H100 runs") {
  double worst_peak = 0, worst_time = 0;
  for (const Recorded& r : kRecorded) {
    const test::SettingScope<bool> engine(cudnn_split_prefix, set_cudnn_split_prefix, r.prefix_apart);  // the run's
    const PlanReport p = plan_step(one_b(), 1, r.T, r.schedule, DType::bf16, 80);
    const double dropped = layer_local_saving_gib(one_b(), r.T, r.schedule);
    const double peak_err = p.peak_device_gib() / (r.peak_gib - dropped) - 1;
    const double time_err = p.step_s / (double(r.T) / r.tokens_per_s) - 1;
    MESSAGE(fmt::format("{}: peak {:.2f} GiB predicted, {:.1f} measured{} ({:+.1f}%); step {:.3f} s predicted, "
                        "{:.3f} measured ({:+.1f}%)",
                        r.source, p.peak_device_gib(), r.peak_gib,
                        dropped > 0 ? fmt::format(" less {:.2f} of dK, dV", dropped) : "", 100 * peak_err, p.step_s,
                        double(r.T) / r.tokens_per_s, 100 * time_err));
    CHECK_MESSAGE(std::abs(peak_err) <= kPeakTol, r.source);
    CHECK_MESSAGE(std::abs(time_err) <= kStepTimeTol, r.source);
    CHECK(p.fits);
    worst_peak = std::max(worst_peak, std::abs(peak_err));
    worst_time = std::max(worst_time, std::abs(time_err));
  }
  MESSAGE(fmt::format("worst peak error {:.1f}%, worst step-time error {:.1f}%", 100 * worst_peak, 100 * worst_time));
}

TEST_CASE("plan: the K/V store moves to pinned host memory with an offload window") {
  const ScheduleOptions all = sched("seco", 4096);
  ScheduleOptions windowed = all;
  windowed.offload_window = 2;
  const PlanReport a = plan_step(one_b(), 1, 131072, all, DType::bf16, 80);
  const PlanReport w = plan_step(one_b(), 1, 131072, windowed, DType::bf16, 80);
  // 16 layers x 128K tokens x (bf16 K, V + f32 dK, dV) x 8 heads x 64 = 12 GiB in all.
  const double kv_gib = 16.0 * 131072 * 2 * (2 + 4) * 8 * 64 / double(1 << 30);
  CHECK(a.peak_host_gib() == 0);
  CHECK(w.peak_host_gib() == doctest::Approx(kv_gib));
  CHECK(a.peak_device_gib() - w.peak_device_gib() == doctest::Approx(kv_gib * 14 / 16).epsilon(0.01));
}

TEST_CASE("plan: saved attention outputs cost store memory and save the reverse sweep's attention forward") {
  ScheduleOptions plain = sched("seco", 4096);
  plain.offload_window = 2;
  ScheduleOptions saved = plain;
  saved.save_attention = true;
  const PlanReport a = plan_step(one_b(), 1, 131072, plain, DType::bf16, 80);
  const PlanReport s = plan_step(one_b(), 1, 131072, saved, DType::bf16, 80);
  // 16 layers x 128K tokens x (bf16 O over 32 heads x 64 + f32 lse over 32 heads) = 8.25 GiB more host.
  const double out_gib = 16.0 * 131072 * (32 * 64 * 2 + 32 * 4) / double(1 << 30);
  CHECK(s.peak_host_gib() - a.peak_host_gib() == doctest::Approx(out_gib));
  auto seconds = [](const PlanReport& r, const std::string& what) {
    for (const auto& [name, t] : r.time)
      if (name == what) return t;
    return -1.0;
  };
  // Attention passes over the reverse tokens: forward + backward (2.5) -> backward only; the prefill
  // keeps its one forward over the chunks before the last, whose forward in the sweep attends in
  // both: (4.5 all - last) -> (3.5 all) (query-key pairs: all of them, the last chunk's).
  double all = 0, last = 0;
  for (int64_t p = 0; p < 131072; p += 4096) {
    last = 4096.0 * double(p) + 4096.0 * 4097.0 / 2;
    all += last;
  }
  CHECK(seconds(s, "attention") == doctest::Approx(seconds(a, "attention") * 3.5 * all / (4.5 * all - last)));
  CHECK(s.step_s < a.step_s);
  CHECK(s.schedule.find("save-attention") != std::string::npos);
}

TEST_CASE("plan: packed documents cut attention's work to their causal squares; memory stays") {
  const int64_t T = 65536;
  auto seconds = [](const PlanReport& r, const std::string& what) {
    for (const auto& [name, t] : r.time)
      if (name == what) return t;
    return -1.0;
  };
  std::vector<int64_t> eighths;
  for (int64_t s = 0; s < T; s += 8192) eighths.push_back(s);
  // Full backprop attends all T queries in each pass: its attention time is proportional to the
  // pairs, 8 x 8192 x 8193 / 2 against 65536 x 65537 / 2.
  const ScheduleOptions full = sched("full");
  const double ratio = 8.0 * 8192.0 * 8193.0 / (65536.0 * 65537.0);
  const PlanReport one = plan_step(one_b(), 1, T, full, DType::bf16, 80);
  const PlanReport whole = plan_step(one_b(), 1, T, full, DType::bf16, 80, {}, false, {{0}});
  CHECK(whole.flops == doctest::Approx(one.flops));  // one document of the whole sequence: causal
  const PlanReport docs = plan_step(one_b(), 1, T, full, DType::bf16, 80, {}, false, {eighths});
  CHECK(seconds(docs, "attention") == doctest::Approx(seconds(one, "attention") * ratio));
  CHECK(docs.peak_device_bytes == one.peak_device_bytes);
  // Two sequences, one causal and one in eighths: the mean of the two.
  const PlanReport mixed = plan_step(one_b(), 2, T, full, DType::bf16, 80, {}, false, {{0}, eighths});
  const PlanReport two = plan_step(one_b(), 2, T, full, DType::bf16, 80);
  CHECK(seconds(mixed, "attention") == doctest::Approx(seconds(two, "attention") * (1 + ratio) / 2));
  // SeCO's prefill stops before the last chunk: its pairs are the documents' parts before it.
  const ScheduleOptions seco = sched("seco", 4096);
  const PlanReport seco_one = plan_step(one_b(), 1, T, seco, DType::bf16, 80);
  const PlanReport seco_docs = plan_step(one_b(), 1, T, seco, DType::bf16, 80, {}, false, {eighths});
  CHECK(seconds(seco_docs, "attention") < seconds(seco_one, "attention") * 0.2);
  CHECK(seco_docs.step_s < seco_one.step_s);
  CHECK(seco_docs.peak_device_bytes == seco_one.peak_device_bytes);
  CHECK_THROWS_WITH_AS(plan_step(one_b(), 2, T, full, DType::bf16, 80, {}, false, {{0}}),
                       doctest::Contains("document starts for 1 sequences, the batch has 2"), Error);
}

TEST_CASE("plan: Gemma 2's sliding layers take W T pairs, its global layers T^2 / 2; its post-norms' elementwise "
          "work is counted") {
  // gemma2-9b: 42 layers, the even 21 sliding through 4096 keys, the odd 21 global. At 64K full
  // backprop's attention is the global layers' pairs plus the sliding layers' windowed pairs; the same
  // model with every layer global takes twice the global layers'.
  const int64_t T = 65536, W = 4096;
  auto seconds = [](const PlanReport& r, const std::string& what) {
    for (const auto& [name, t] : r.time)
      if (name == what) return t;
    return -1.0;
  };
  const LlamaConfig gemma = LlamaConfig::preset("gemma2-9b");
  LlamaConfig global = gemma;
  global.sliding_layers.assign(global.sliding_layers.size(), false);
  const double ratio = (double(W) * double(W + 1) / 2 + double(T - W) * double(W)) / (double(T) * double(T + 1) / 2);
  const ScheduleOptions full = sched("full");
  const PlanReport mixed = plan_step(gemma, 1, T, full, DType::bf16, 1000);
  const PlanReport all_global = plan_step(global, 1, T, full, DType::bf16, 1000);
  CHECK(seconds(mixed, "attention") == doctest::Approx(seconds(all_global, "attention") * (1 + ratio) / 2));
  // seco's reverse chunks add dK, dV only within a sliding layer's window, every earlier key in a global
  // one: half the layers each way.
  const ScheduleOptions seco = sched("seco", 4096);
  LlamaConfig all_sliding = gemma;
  all_sliding.sliding_layers.assign(all_sliding.sliding_layers.size(), true);
  const double adds = seconds(plan_step(gemma, 1, T, seco, DType::bf16, 1000), "kv grad adds");
  const double adds_global = seconds(plan_step(global, 1, T, seco, DType::bf16, 1000), "kv grad adds");
  const double adds_sliding = seconds(plan_step(all_sliding, 1, T, seco, DType::bf16, 1000), "kv grad adds");
  CHECK(adds_sliding < 0.25 * adds_global);  // 31 of 136 chunk-lengths of keys: 2 c a chunk against (k + 1) c
  CHECK(adds == doctest::Approx((adds_global + adds_sliding) / 2));
  // The post-norms: two more norms a layer (6 C more of its 16 C + 6 F elementwise elements).
  LlamaConfig llama_block = gemma;
  llama_block.family = ModelFamily::llama;
  llama_block.mlp_gate = MlpGate::silu;
  llama_block.post_norms = llama_block.scale_embeddings = false;
  llama_block.norm_weight_offset = llama_block.query_pre_attn_scalar = 0.0;
  llama_block.attn_logit_softcapping = llama_block.final_logit_softcapping = 0.0;
  llama_block.sliding_window = 0;
  llama_block.sliding_layers.clear();
  const PlanReport plain = plan_step(llama_block, 1, T, full, DType::bf16, 1000);
  const double C = double(gemma.hidden_size), F = double(gemma.intermediate_size);
  CHECK(seconds(mixed, "elementwise") == doctest::Approx(seconds(plain, "elementwise") * (22 * C + 6 * F) / (16 * C + 6 * F)));
}

TEST_CASE("plan: a sliding window cuts attention's work to W T pairs; the K/V store and its memory stay") {
  // mistral-7b (W = 4096) against the same shapes without the window: at 64K full backprop's attention
  // is in proportion to the pairs, 4096 x 4097 / 2 + (T - 4096) 4096 against T (T + 1) / 2; seco's
  // K/V store is the same.
  const int64_t T = 65536, W = 4096;
  auto seconds = [](const PlanReport& r, const std::string& what) {
    for (const auto& [name, t] : r.time)
      if (name == what) return t;
    return -1.0;
  };
  const LlamaConfig mistral = LlamaConfig::preset("mistral-7b");
  LlamaConfig unwindowed = mistral;
  unwindowed.sliding_window = 0;
  unwindowed.family = ModelFamily::llama;
  const double ratio = (double(W) * double(W + 1) / 2 + double(T - W) * double(W)) / (double(T) * double(T + 1) / 2);
  const ScheduleOptions full = sched("full");
  const PlanReport windowed = plan_step(mistral, 1, T, full, DType::bf16, 1000);
  const PlanReport plain = plan_step(unwindowed, 1, T, full, DType::bf16, 1000);
  CHECK(seconds(windowed, "attention") == doctest::Approx(seconds(plain, "attention") * ratio));
  const ScheduleOptions seco = sched("seco", 4096);
  const PlanReport seco_windowed = plan_step(mistral, 1, T, seco, DType::bf16, 1000);
  const PlanReport seco_plain = plan_step(unwindowed, 1, T, seco, DType::bf16, 1000);
  // The store keeps every token's K and V whatever the window; only the attention calls' scratch
  // (against W + c keys rather than all earlier ones) shrinks.
  auto kv_bytes = [](const PlanReport& r) {
    for (const auto& [name, bytes] : r.device)
      if (name == "kv") return bytes;
    return size_t{0};
  };
  CHECK(kv_bytes(seco_windowed) > 0);
  CHECK(kv_bytes(seco_windowed) == kv_bytes(seco_plain));
  CHECK(seco_windowed.peak_device_bytes <= seco_plain.peak_device_bytes);
  CHECK(seco_windowed.step_s < seco_plain.step_s);
  // The CLI takes the preset and says what the window means for a GPU run.
  PlanOptions o;
  o.model = "mistral-7b";
  o.seq = 32768;
  o.schedule.kind = ScheduleKind::seco;
  o.schedule.chunk = kAuto;
  o.device_memory_gib = 141;
  std::ostringstream out;
  run_plan(o, out);
  INFO(out.str());
  CHECK(out.str().find("sliding window: 4096 keys a query") != std::string::npos);
  CHECK(out.str().find("on the GPU our flash kernels honour it") != std::string::npos);
}

TEST_CASE("plan: the CLI's table and JSON") {
  test::TempDir dir("plan");
  PlanOptions o;
  o.seq = 65536;
  o.schedule.kind = ScheduleKind::seco;
  o.schedule.chunk = kAuto;
  o.device_memory_gib = 80;
  o.json = dir.file("plan.json");
  std::ostringstream out;
  CHECK(run_plan(o, out) == 0);
  CHECK(out.str().find("kv") != std::string::npos);
  CHECK(out.str().find("fits in 80.0 GiB") != std::string::npos);
  std::ifstream f(o.json);
  const nlohmann::json j = nlohmann::json::parse(f);
  for (const char* key : {"peak_device_gib", "peak_host_gib", "step_s", "categories", "fits", "chunk"})
    CHECK_MESSAGE(j.contains(key), key);
  CHECK(j["categories"]["device"].contains("activations"));
  CHECK(j["chunk"].get<int64_t>() > 0);
  // --documents: the same chunk and memory, attention over documents of 8192 (a faster step).
  PlanOptions d = o;
  d.documents = "8192";
  d.json = dir.file("documents.json");
  std::ostringstream documents;
  CHECK(run_plan(d, documents) == 0);
  CHECK(documents.str().find("documents: 8192 (8 in the first sequence)") != std::string::npos);
  std::ifstream fd(d.json);
  const nlohmann::json jd = nlohmann::json::parse(fd);
  CHECK(jd["peak_device_gib"] == j["peak_device_gib"]);
  CHECK(jd["step_s"].get<double>() < j["step_s"].get<double>());

  o.seq = 262144;  // 40 GiB: no chunk fits with the whole K/V store (24 GiB) on the device
  o.device_memory_gib = 40;
  o.json.clear();
  std::ostringstream none;
  CHECK_THROWS_WITH_AS(run_plan(o, none), doctest::Contains("--offload-window"), Error);
  o.schedule.offload_window = kAuto;
  std::ostringstream windowed;
  CHECK(run_plan(o, windowed) == 0);
  CHECK(windowed.str().find("host") != std::string::npos);
  CHECK(windowed.str().find("auto weighed") == std::string::npos);  // the alternatives only on --explain
  o.explain = true;
  std::ostringstream explained;
  CHECK(run_plan(o, explained) == 0);
  const std::string e = explained.str();
  const size_t list = e.find("auto weighed");
  REQUIRE(list != std::string::npos);
  int chosen = 0, rows = 0;
  std::string chosen_settings;
  std::istringstream lines(e.substr(list));
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("  * seco", 0) == 0) {
      ++chosen, ++rows;
      chosen_settings = line.substr(4, line.find("  ", 4) - 4);
    } else if (line.rfind("    seco", 0) == 0) {
      ++rows;
    }
  }
  CHECK(chosen == 1);
  CHECK(rows >= 4);  // at least the four places of the store for one recompute mode
  const std::string header = e.substr(0, e.find('\n'));
  CHECK(header.find("tokens, " + chosen_settings) != std::string::npos);  // the plan shown is the one marked
  o.explain = false;

  o.seq = 65536;
  o.device_memory_gib = 80;
  o.schedule.offload_window = 0;
  o.schedule.chunk = 4096;
  o.schedule.kind = ScheduleKind::full;
  o.json.clear();
  std::ostringstream refused;
  CHECK(run_plan(o, refused) == 1);  // full backprop at 64K cannot fit in 80 GiB
  CHECK(refused.str().find("DOES NOT FIT") != std::string::npos);

  o.longest = true;  // --longest: --seq is replaced by the longest that fits, and that plan is shown
  std::ostringstream longest;
  CHECK(run_plan(o, longest) == 0);
  CHECK(longest.str().rfind("longest: ", 0) == 0);
  CHECK(longest.str().find("fits in 80.0 GiB") != std::string::npos);
  o.device_memory_gib = 4;  // not even 1024 tokens of the 1B model's state
  std::ostringstream nothing;
  CHECK_THROWS_WITH_AS(run_plan(o, nothing), doctest::Contains("not even 1024 tokens fit in 4.0 GiB"), Error);
}

TEST_CASE("plan: LoRA keeps the base's compute weights only; master, moments and gradients are the adapters'") {
  const LlamaConfig& eight_b = eight_b_config();
  const LoraConfig lora = paper_lora();
  const ScheduleOptions o = sched("seco", 4096);
  const PlanReport full = plan_step(eight_b, 1, 16384, o, DType::bf16, 80);
  const PlanReport adapted = plan_step(eight_b, 1, 16384, o, DType::bf16, 80, lora);
  auto gib = [](const PlanReport& r, const std::string& what) {
    for (const auto& [name, bytes] : r.device)
      if (name == what) return double(bytes) / double(1 << 30);
    return -1.0;
  };
  // q and v adapters of 32 layers: 32 x 8 x ((4096 + 4096) + (4096 + 1024)) = 3.4 M values.
  const double adapter_gib = 32.0 * 8 * (4096 + 4096 + 4096 + 1024) / double(1 << 30);
  MESSAGE(fmt::format("8B seco 16K: full {:.2f} GiB, LoRA r8 q,v {:.2f} GiB", full.peak_device_gib(),
                      adapted.peak_device_gib()));
  CHECK(gib(adapted, "master") == doctest::Approx(4 * adapter_gib).epsilon(0.01));
  CHECK(gib(adapted, "optimizer") == doctest::Approx(8 * adapter_gib).epsilon(0.01));
  CHECK(gib(adapted, "gradients") == doctest::Approx(4 * adapter_gib).epsilon(0.01));
  CHECK(gib(adapted, "weights") == doctest::Approx(gib(full, "weights") + 2 * adapter_gib).epsilon(0.001));
  CHECK(gib(full, "master") - gib(adapted, "master") > 29);  // 8 B parameters' f32 master weights gone
  CHECK(adapted.fits);
  CHECK_FALSE(full.fits);
  CHECK(adapted.step_s < full.step_s);  // no weight gradients for the base
  CHECK(adapted.schedule.find("lora rank 8 on q_proj,v_proj") != std::string::npos);
  // Dropout keeps a masked copy of an adapted linear's input in the scratch (down_proj's: [N, F]): at
  // chunk 8192 it no longer fits the arena's slack, and the activations grow by a 256 MiB block or more.
  // (With one attention graph: the split call's scratch moves the slack; cudnn_split_prefix.)
  const test::SettingScope<bool> one_graph(cudnn_split_prefix, set_cudnn_split_prefix, false);
  LoraConfig dropped = lora;
  dropped.targets = "all-linear";
  dropped.dropout = 0.1;
  LoraConfig plain = dropped;
  plain.dropout = 0;
  const ScheduleOptions wide = sched("seco", 8192);
  CHECK(gib(plan_step(eight_b, 1, 16384, wide, DType::bf16, 80, dropped), "activations") >=
        gib(plan_step(eight_b, 1, 16384, wide, DType::bf16, 80, plain), "activations") + 0.25);
}

TEST_CASE("plan: predicted peaks and step times against the recorded Llama-3.1-8B runs") {
  // `chunkwise bench` on an H100 80GB HBM3, 2026-11-27: the rows of docs/performance.md, "Memory and
  // the planner" (the recorded 8B runs), labelled by their length and settings. LoRA rank 8, alpha 16
  // on q_proj, v_proj unless full parameters; the options are what the planner picked.
  const LlamaConfig& eight_b = eight_b_config();
  const LoraConfig lora = paper_lora();
  struct Run {
    const char* what;
    ScheduleOptions schedule;
    int64_t T;
    double device_gib;
    bool lora, optimizer_offload;
    double peak_gib, tokens_per_s;
    // Recorded while a kept MLP still kept h2 and act under LoRA on q, v (before MlpKept::products):
    // the expected peak is the measured one less those tensors, L x c x (C + F) bf16 values.
    bool kept_h2_act = false;
    // Recorded after the store kept one layer's dK, dV for one backward chunk (nothing to subtract).
    bool layer_local_recorded = false;
    // A first step (warm-up 0) while the host's other GPU ran another benchmark: its peak is the
    // step's, its time is not a steady state's (printed, not checked).
    bool time_not_steady = false;
  };
  ScheduleOptions one_slot = saved(sched("seco", 2048, "selective"), 1);
  const Run runs[] = {
      {"LoRA 16K, chunk 4096", sched("seco", 4096), 16384, 80, true, false, 39.05, 9082, true},
      {"LoRA 16K, one chunk, selective", sched("seco", 16384, "selective"), 16384, 80, true, false, 60.74, 10810},
      {"LoRA 64K, chunk 4096", sched("seco", 4096), 65536, 80, true, false, 58.08, 4414, true},
      {"LoRA 64K, chunk 4096, saved attention", saved(sched("seco", 4096, "none")), 65536, 80, true, false, 74.33,
       5009, true},
      {"LoRA 64K in 24 GiB, chunk 2048, saved attention, window 1 (copies not overlapped)", one_slot, 65536, 24, true,
       false, 21.33, 2171},
      {"full parameters 60K, chunk 2048, optimizer offloaded", sched("seco", 2048, "none"), 61440, 80, false, true,
       77.12, 3226},
      // The planner's later picks, the frozen MLP keeping gate and up.
      {"LoRA 16K, one chunk, no recompute (the frozen MLP keeping gate and up)", sched("seco", 16384, "none"), 16384,
       80, true, false, 75.80, 12491, false, true},
      {"LoRA 64K, chunk 4096, saved attention (the frozen MLP keeping gate and up)", saved(sched("seco", 4096, "none")),
       65536, 80, true, false, 70.33, 5007, false, true},
      {"LoRA 256K, chunk 8192, saved attention, window 2 (one step, warm-up 0; 256 GiB host)",
       saved(sched("seco", 8192, "none"), 2), 262144, 80, true, false, 65.73, 1097, false, true, true},
      // 64K in 24 GiB with the recalibrated window (copies overlapping compute); 256K planned for a
      // 120 GiB host (no saved outputs; one step, warm-up 0: its time is a first step's).
      {"LoRA 64K in 24 GiB, chunk 8192, recompute full, saved attention, window 2",
       saved(sched("seco", 8192, "full"), 2), 65536, 24, true, false, 22.84, 4562, false, true},
      {"LoRA 256K, chunk 8192, window 2 (one step, warm-up 0; planned for a 120 GiB host)",
       [] {
         ScheduleOptions o = sched("seco", 8192, "none");
         o.offload_window = 2;
         return o;
       }(),
       262144, 80, true, false, 61.67, 1136, false, true, true},
  };
  for (const Run& r : runs) {
    const PlanReport p = plan_step(eight_b, 1, r.T, r.schedule, DType::bf16, r.device_gib,
                                   r.lora ? lora : LoraConfig{}, r.optimizer_offload);
    const double dropped = (r.kept_h2_act ? double(eight_b.num_hidden_layers) * double(r.schedule.chunk) *
                                                double(eight_b.hidden_size + eight_b.intermediate_size) * 2 /
                                                double(1ull << 30)
                                          : 0.0) +
                           (r.layer_local_recorded ? 0.0 : layer_local_saving_gib(eight_b, r.T, r.schedule));
    const double expected = r.peak_gib - dropped;
    const double peak_err = p.peak_device_gib() / expected - 1;
    const double time_err = p.step_s / (double(r.T) / r.tokens_per_s) - 1;
    MESSAGE(fmt::format("8B {}: peak {:.2f} GiB predicted, {:.2f} measured{} ({:+.1f}%); step {:.2f} s predicted, "
                        "{:.2f} measured ({:+.1f}%)",
                        r.what, p.peak_device_gib(), r.peak_gib,
                        dropped > 0 ? fmt::format(" less {:.2f} of h2, act, dK, dV", dropped) : "", 100 * peak_err,
                        p.step_s, double(r.T) / r.tokens_per_s, 100 * time_err));
    CHECK_MESSAGE(std::abs(peak_err) <= kPeakTol, r.what);
    if (!r.time_not_steady) CHECK_MESSAGE(std::abs(time_err) <= kStepTimeTol, r.what);
    CHECK_MESSAGE(p.fits, r.what);
  }
}

TEST_CASE("plan --tp: one GPU's share against the measured TP 2 peaks; the longest context it predicts") {
  // docs/performance.md, "Data and tensor parallelism" (tensor parallelism under seco): chunk 4096,
  // the pool's peak per GPU in train's memory report: 19.11 GiB at 64K and 22.62 at 128K with TP 2
  // (33.26 and 39.78 on one GPU).
  const LlamaConfig shard = tp_shard_config(one_b(), 2);
  const struct {
    int64_t T;
    double peak_gib;
  } tp2[] = {{65536, 19.11}, {131072, 22.62}};
  for (const auto& r : tp2) {
    const PlanReport p = plan_step(shard, 1, r.T, sched("seco", 4096), DType::bf16, 80);
    MESSAGE(fmt::format("TP 2 at {}: {:.2f} GiB per GPU predicted, {:.2f} measured", r.T, p.peak_device_gib(),
                        r.peak_gib));
    CHECK(std::abs(p.peak_device_gib() / r.peak_gib - 1) <= kPeakTol);
  }
  // The longest context with the store on the device: TP 2 at least 1.8x one GPU (the bar TP was built to).
  PlanOptions o;
  o.schedule = sched("seco", 4096);
  o.device_memory_gib = 79.2;
  o.longest = true;
  std::ostringstream one, two;
  CHECK(run_plan(o, one) == 0);
  o.tp = 2;
  CHECK(run_plan(o, two) == 0);
  auto longest = [](const std::string& text) {
    const size_t at = text.find("longest: ");
    REQUIRE(at != std::string::npos);
    return std::stoll(text.substr(at + 9));
  };
  const int64_t t1 = longest(one.str()), t2 = longest(two.str());
  MESSAGE("longest seco context, chunk 4096, store on the device: one GPU ", t1, ", with TP 2 ", t2, " tokens");
  CHECK(two.str().rfind("tensor parallel: one GPU of 2", 0) == 0);
  CHECK(double(t2) >= 1.8 * double(t1));
  o.tp = 3;  // 32 heads do not split 3 ways
  std::ostringstream bad;
  CHECK_THROWS_WITH_AS(run_plan(o, bad), doctest::Contains("--tp"), Error);
}

TEST_CASE("plan: the K/V offload's bytes moved a step against the recorded runs, and its copies in the step time") {
  struct Moved {
    const char* source;
    ScheduleOptions schedule;
    int64_t T;
    double gib;
  };
  // Recorded before seco stopped prefilling its last reverse chunk (2026-11-27): those steps moved
  // that chunk's prefill bytes too, 1/32 and 1/64 of the prefill's here, inside the tolerance. (A
  // 16K run of 4 chunks, recorded then, no longer describes the schedule; the CPU case below
  // measures the current one exactly.)
  const std::vector<Moved> runs = {
      {"The rates of the planner's time model, kPcieBytesPerS: 2026-11-25, the 128K trace (saved outputs, window 2)",
       saved(sched("seco", 4096), 2), 131072, 420.0},
      {"The longest sequence: 2026-11-25, 512K, window of 2 layers, chunk 8192", [] {
         ScheduleOptions o = sched("seco", 8192);
         o.offload_window = 2;
         return o;
       }(), 524288, 3561.0},
  };
  for (const Moved& m : runs) {
    INFO(m.source);
    const PlanReport r = plan_step(one_b(), 1, m.T, m.schedule, DType::bf16, 80);
    const double gib = r.kv_moved_bytes / double(1ull << 30);
    MESSAGE(fmt::format("{}: predicted {:.1f} GiB moved, recorded {:.1f}", m.source, gib, m.gib));
    CHECK(std::abs(gib - m.gib) <= 0.10 * m.gib);
  }
  // Without offload nothing moves; where the copies outlast the compute they set the step time.
  CHECK(plan_step(one_b(), 1, 131072, sched("seco", 4096), DType::bf16, 80).kv_moved_bytes == 0);
  const LlamaConfig& eight_b = eight_b_config();
  const LoraConfig lora = paper_lora();
  ScheduleOptions small = sched("seco", 1024);
  small.offload_window = 1;
  const PlanReport r = plan_step(eight_b, 1, 65536, small, DType::bf16, 24, lora);
  const double copies_s = r.kv_moved_bytes / 49e9;
  CHECK(r.step_s == doctest::Approx(std::max(copies_s, r.step_s)));
  CHECK(r.step_s >= copies_s * 0.999);
}

TEST_CASE("plan: the K/V offload's bytes moved against a seco step on the CPU, which moves them the same way") {
  // The store's host homes and device slots are the same code on the CPU (host slots): its byte count
  // is the schedule's own, for any shape, saved outputs or not, one reverse chunk or many. The model
  // assumes a layer leaves its slot between its uses (a window well below the layer count, as on
  // the GPU, 2 of 16); a window of nearly every layer keeps some resident and moves less.
  LlamaConfig cfg = LlamaConfig::preset("tiny");
  cfg.num_hidden_layers = 8;
  LlamaModel model(cfg, DType::f32);
  init_parameters(model.params(), 3, cfg.initializer_range);
  ParamSet grads(cfg, DType::f32);
  struct Case {
    int64_t B, T, chunk, bwd_chunk, window;
    bool saved, streamed = false;
  };
  for (const Case c : {Case{1, 96, 8, 8, 2, true}, Case{1, 96, 8, 8, 2, false}, Case{2, 64, 16, 8, 1, true},
                       Case{1, 64, 8, 16, 2, false}, Case{1, 48, 48, 48, 2, true}, Case{1, 50, 12, 12, 2, true},
                       Case{1, 96, 8, 8, 0, true, true}, Case{1, 96, 8, 8, 0, false, true},
                       Case{2, 50, 12, 12, 0, true, true}}) {
    ScheduleOptions o = sched("seco", c.chunk);
    o.bwd_chunk = c.bwd_chunk;
    o.offload_window = c.window;
    o.save_attention = c.saved;
    o.stream_kv = c.streamed;
    const Batch batch = random_batch(c.B, c.T, cfg.vocab_size, 9);
    grads.zero();
    const StepStats st = Schedule::create(o)->step(model, batch, grads);
    const double predicted = plan_step(cfg, c.B, c.T, o, DType::f32, 80).kv_moved_bytes;
    const double moved = double(st.kv_bytes_moved);
    MESSAGE(fmt::format("B {} T {} chunk {} bwd {} window {}{}{}: {:.0f} bytes moved, {:.0f} predicted ({:+.1f}%)",
                        c.B, c.T, c.chunk, c.bwd_chunk, c.window, c.saved ? " saved" : "", c.streamed ? " streamed" : "",
                        moved, predicted, 100 * (predicted / moved - 1)));
    CHECK(std::abs(predicted / moved - 1) <= 0.10);
  }
}

TEST_CASE("plan: with the K/V store streamed, device memory does not grow with T (at most 2 MB per 1K)") {
  ScheduleOptions o = sched("seco", 4096);
  o.stream_kv = true;
  o.save_attention = true;
  const PlanReport a = plan_step(one_b(), 1, 131072, o, DType::bf16, 80);
  const PlanReport b = plan_step(one_b(), 1, 1048576, o, DType::bf16, 80);
  const double mb_per_1k = (double(b.peak_device_bytes) - double(a.peak_device_bytes)) / double(1 << 20) /
                           ((1048576.0 - 131072.0) / 1024.0);
  MESSAGE(fmt::format("128K: {:.2f} GiB, 1M: {:.2f} GiB on the device ({:.3f} MB per 1K tokens), {:.1f} GiB host",
                      a.peak_device_gib(), b.peak_device_gib(), mb_per_1k, b.peak_host_gib()));
  CHECK(mb_per_1k <= 2.0);
  CHECK(b.peak_host_gib() > 100);  // the whole store (with saved outputs) in host memory
  CHECK(b.schedule.find("stream-kv") != std::string::npos);
}

TEST_CASE("plan: it reports the largest attention backward's workspace it counted (the engine's budget is raised to it)") {
  // llama-3.2-1b: 32 query heads on 8 K/V heads of 64 dims: cuDNN stages the per-query-head dK and
  // dV of every key the call sees in bf16, 8 KiB a key. On the device the first reverse chunk sees
  // the whole store; streamed, one chunk-sized key block.
  const PlanReport device = plan_step(one_b(), 1, 262144, saved(sched("seco", 8192)), DType::bf16, 80);
  CHECK(device.attention_workspace_bytes == size_t(262144) * 8192 + 256);
  ScheduleOptions streamed = sched("seco", 4096);
  streamed.stream_kv = true;
  CHECK(plan_step(one_b(), 1, 262144, streamed, DType::bf16, 80).attention_workspace_bytes == size_t(4096) * 8192 + 256);
  // Without GQA nothing is staged.
  LlamaConfig mha = one_b();
  mha.num_key_value_heads = mha.num_attention_heads;
  CHECK(plan_step(mha, 1, 65536, sched("seco", 4096), DType::bf16, 80).attention_workspace_bytes == 256);
  // The engine takes it as a floor (a CPU device has no budget).
  raise_attention_workspace_budget(Device::host(), int64_t(device.attention_workspace_bytes));
  CHECK(attention_workspace_budget(Device::host()) == 0);
}

TEST_CASE("plan: selective recompute's forward runs the MLP on [N, F] scratch (measured on the H100)") {
  // docs/performance.md, "Memory and the planner" (the peaks the arena's replay is held to): 32K, chunk
  // 4096, window 2, saved outputs, CW_ARENA_LOG=1; the run's arena added a block for the forward's
  // gate, up and act that the plan's replay once lacked; peaks 22.30 (selective, cast-layers), 23.89
  // (selective), 25.80 (cast-layers), 27.39 GiB (neither).
  struct Case {
    bool selective, cast;
    double peak_gib;
  };
  for (const Case& c : {Case{true, true, 22.30}, Case{true, false, 23.89}, Case{false, true, 25.80},
                        Case{false, false, 27.39}}) {
    ScheduleOptions o = saved(sched("seco", 4096, c.selective ? "selective" : "none"), 2);
    o.cast_layers = c.cast;
    const PlanReport p = plan_step(one_b(), 1, 32768, o, DType::bf16, 80);
    CAPTURE(c.selective);
    CAPTURE(c.cast);
    CHECK(p.peak_device_gib() == doctest::Approx(c.peak_gib).epsilon(0.003));
  }
}

TEST_CASE("plan: saved layer inputs, measured on the H100 within HF+Liger's peaks") {
  // docs/performance.md, "Memory and the planner" (the peaks the arena's replay is held to): seco,
  // window 2, saved attention outputs, saved inputs; the prefill and the reverse sweep in the same
  // chunks. Peaks as measured; auto picks them at each length (the fastest measured: 32K chunk 16384
  // 1.112 s against 1.140 at 8192; 64K 32768 3.249 against 3.263 at 16384; 128K 32768 10.77 against
  // 10.81 at 16384 and 10.93-10.96 at 65536).
  struct Case {
    int64_t T, chunk;
    bool cast;
    double peak_gib, cap_gib;
  };
  for (const Case& c : {Case{32768, 8192, true, 21.55, 23.2}, Case{32768, 16384, true, 22.56, 23.2},
                        Case{65536, 16384, false, 25.53, 30.7}, Case{65536, 32768, false, 28.53, 30.7},
                        Case{131072, 16384, false, 27.81, 45.8}, Case{131072, 32768, false, 30.81, 45.8}}) {
    CAPTURE(c.T);
    CAPTURE(c.chunk);
    ScheduleOptions o = saved(sched("seco", c.chunk), 2);
    o.save_inputs = true;
    o.cast_layers = c.cast;
    const PlanReport p = plan_step(one_b(), 1, c.T, o, DType::bf16, c.cap_gib);
    CHECK(p.fits);
    // Within 1% (the replay counts 0.25 GiB more at the chunks of 32768: a block the run reuses).
    CHECK(p.peak_device_gib() == doctest::Approx(c.peak_gib).epsilon(0.01));
    CHECK(p.peak_device_gib() >= c.peak_gib - 0.01);
  }
  for (const auto& [T, gib, chunk] : {std::tuple<int64_t, double, int64_t>{32768, 23.2, 16384}, {65536, 30.7, 32768},
                                      {131072, 45.8, 32768}}) {
    CAPTURE(T);
    const ScheduleOptions o = resolve_auto_schedule(one_b(), 1, T, auto_seco(), DType::bf16, gib);
    CHECK(o.save_inputs);
    CHECK(o.save_attention);
    CHECK(o.chunk == chunk);
    CHECK((o.bwd_chunk == 0 || o.bwd_chunk == o.chunk));
    // The same chunks without saved inputs keep a chunk's every activation: they do not fit.
    ScheduleOptions without = o;
    without.save_inputs = false;
    CHECK_FALSE(plan_step(one_b(), 1, T, without, DType::bf16, gib).fits);
  }
  // Not with a streamed store (its blocks keep no inputs); applies to seco and spaco only.
  ScheduleOptions streamed = sched("seco", 4096);
  streamed.stream_kv = true;
  streamed.save_inputs = true;
  CHECK_THROWS_AS(plan_step(one_b(), 1, 32768, streamed, DType::bf16, 80), Error);
}

namespace {
// The tiny model with its blocks cast from an f64 master as they run (model/layer_cast.h), on the CPU
// in f32: the same casts as a bf16 run on a GPU, counted.
struct CastModel {
  LlamaConfig cfg;
  ParamSet master;
  LlamaModel model;
  explicit CastModel(const LlamaConfig& c)
      : cfg(c), master(c, DType::f64), model(c, DType::f32, Device::host(), nullptr, {}, /*cast_layers=*/true) {
    init_parameters(master, 5, cfg.initializer_range);
    copy_params_by_name(model.params(), master);
    model.cast_layers_from(master);
  }
};
}  // namespace

TEST_CASE("plan: cast_layers keeps two blocks' bf16 weights instead of every block's; its casts are a step's on the CPU") {
  // Memory: Llama-3.2-1B's blocks are 16 x 116 MiB of bf16 weights; two slots of one block stay.
  ScheduleOptions o = sched("seco", 4096);
  const PlanReport resident = plan_step(one_b(), 1, 32768, o, DType::bf16, 80);
  o.cast_layers = true;
  const PlanReport cast = plan_step(one_b(), 1, 32768, o, DType::bf16, 80);
  const double block = double(LayerCast::slot_bytes_for(one_b(), DType::bf16));
  const double saved = double(resident.peak_device_bytes) - double(cast.peak_device_bytes);
  MESSAGE(fmt::format("cast_layers at 32K: {:.2f} GiB less, {:.0f} casts, {:.3f} s more", saved / double(1ull << 30), cast.layer_casts,
                      cast.step_s - resident.step_s));
  CHECK(std::abs(saved - (16 - LayerCast::kSlots) * block) <= 3.0 * double(2 << 20));  // pool blocks round to 2 MiB
  CHECK(cast.step_s > resident.step_s);
  CHECK(resident.layer_casts == 0);
  CHECK(cast.schedule.find("cast-layers") != std::string::npos);
  CHECK_THROWS_WITH_AS(plan_step(one_b(), 1, 4096, o, DType::f32, 80), doctest::Contains("--dtype bf16"), Error);
  // A plan that does not fit names the knob, and how much it frees.
  o.cast_layers = false;
  const PlanReport tight = plan_step(one_b(), 1, 32768, o, DType::bf16, 22.7);
  CHECK_FALSE(tight.fits);
  CHECK(tight.advice.find("--cast-layers frees 1.6 GiB") != std::string::npos);

  // The count: every pass of a chunk through the blocks casts each block, but for the two its slots
  // still hold when a reverse chunk's backward follows its forward.
  LlamaConfig cfg = LlamaConfig::preset("tiny");
  cfg.num_hidden_layers = 4;
  CastModel m(cfg);
  ParamSet grads(cfg, m.model.trainable_table(), DType::f32);
  struct Case {
    const char* name;
    int64_t B, T, chunk, bwd_chunk, keep;
    const char* recompute;
  };
  for (const Case c : {Case{"seco", 2, 24, 8, 0, 0, "none"}, Case{"seco", 1, 40, 8, 16, 0, "full"},
                       Case{"seco", 1, 30, 8, 0, 0, "selective"}, Case{"spaco", 1, 48, 8, 0, 2, "none"},
                       Case{"full", 2, 16, 0, 0, 0, "none"}, Case{"checkpointed", 1, 16, 0, 0, 0, "full"}}) {
    ScheduleOptions s = sched(c.name, c.chunk, c.recompute);
    s.bwd_chunk = c.bwd_chunk;
    s.keep = c.keep;
    s.cast_layers = true;
    m.model.master_changed();  // as after an optimizer step: no block carries over
    const int64_t before = m.model.layer_cast()->casts();
    grads.zero();
    Schedule::create(s)->step(m.model, random_batch(c.B, c.T, cfg.vocab_size, 3), grads);
    const double planned = plan_step(cfg, c.B, c.T, s, DType::bf16, 80).layer_casts;
    CAPTURE(describe_schedule(s));
    CHECK(double(m.model.layer_cast()->casts() - before) == planned);
  }
}

TEST_CASE("plan: the replayed arena's blocks are listed, and add up to its activations (CW_ARENA_LOG)") {
  ScheduleOptions o = saved(sched("seco", 4096, "selective"), 2);
  const PlanReport r = plan_step(one_b(), 1, 32768, o, DType::bf16, 80);
  REQUIRE_FALSE(r.arena_blocks.empty());
  double mib = 0;
  for (size_t i = 0; i < r.arena_blocks.size(); ++i) {
    size_t index = 0;
    double block = 0;
    REQUIRE(std::sscanf(r.arena_blocks[i].c_str(), "arena block %zu: %lf MiB", &index, &block) == 2);
    CHECK(index == i);
    mib += block;
  }
  size_t activations = 0;
  for (const auto& [name, bytes] : r.device)
    if (name == "activations") activations = bytes;
  // The pool rounds each block to 2 MiB.
  CHECK(std::abs(mib - double(activations) / double(1 << 20)) <= 2.0 * double(r.arena_blocks.size()));
}
