// What the planner's auto settings choose (tools/planner/auto.cpp: resolve_auto_schedule, choose_chunk,
// choose_offload_window, longest_sequence) on its memory and time model (test_plan.cpp): the fastest
// plan that fits the device's and the host's memory, and where nothing fits, an error naming the knob.
#include "tests/support.h"
#include "tests/tools/plan_support.h"
#include "tools/plan.h"

#include "model/llama.h"
#include "optim/schedule.h"

#include <optional>
#include <tuple>
#include <utility>
#include <vector>

using namespace cw;
using namespace cw::test;

TEST_CASE("plan: a run that cannot fit says which knob to turn; auto picks the fastest chunk that fits") {
  const PlanReport full = plan_step(one_b(), 1, 65536, sched("full"), DType::bf16, 80);
  CHECK_FALSE(full.fits);
  CHECK(full.advice.find("seco") != std::string::npos);
  const PlanReport seco = plan_step(one_b(), 1, 262144, sched("seco", 32768), DType::bf16, 40);
  CHECK_FALSE(seco.fits);
  CHECK(seco.advice.find("--chunk") != std::string::npos);

  // 80 GiB at 256K: the chosen chunk fits and no fitting candidate is predicted faster; 32K does not fit.
  const ScheduleOptions base = sched("seco");
  const int64_t c = choose_chunk(one_b(), 1, 262144, base, DType::bf16, 80);
  REQUIRE(c > 0);
  ScheduleOptions chosen = base;
  chosen.chunk = c;
  const PlanReport best = plan_step(one_b(), 1, 262144, chosen, DType::bf16, 80);
  CHECK(best.fits);
  for (int64_t other : chunk_candidates()) {
    ScheduleOptions o = base;
    o.chunk = other;
    const PlanReport p = plan_step(one_b(), 1, 262144, o, DType::bf16, 80);
    if (p.fits) CHECK(best.step_s <= p.step_s * 1.01);  // tools/planner/auto.cpp: within 1%, the larger chunk
    if (p.fits && other > c) CHECK(p.step_s > best.step_s * 1.01);
  }
  ScheduleOptions too_big = base;
  too_big.chunk = 32768;
  CHECK_FALSE(plan_step(one_b(), 1, 262144, too_big, DType::bf16, 80).fits);
  CHECK(choose_chunk(one_b(), 1, 262144, base, DType::bf16, 20) == 0);  // fixed state alone is 20.7 GiB

  // The window: none needed at 64K on 80 GiB; at 256K in 40 GiB some layers must leave the device.
  CHECK(choose_offload_window(one_b(), 1, 65536, sched("seco", 4096), DType::bf16, 80) == 0);
  const int64_t w = choose_offload_window(one_b(), 1, 262144, sched("seco", 4096), DType::bf16, 40);
  CHECK(w > 0);
  CHECK(w < 16);
}

TEST_CASE("plan: the papers' budgets for Llama-3.1-8B: LoRA in 24 GiB at 16K and 64K, full parameters at 60K with the optimizer offloaded") {
  const LlamaConfig& eight_b = eight_b_config();
  const LoraConfig lora = paper_lora();
  for (const int64_t T : {int64_t(16384), int64_t(65536)}) {
    CAPTURE(T);
    const ScheduleOptions o =
        resolve_auto_schedule(eight_b, 1, T, auto_seco(), DType::bf16, 24, lora);
    const PlanReport r = plan_step(eight_b, 1, T, o, DType::bf16, 24, lora);
    MESSAGE(fmt::format("8B LoRA seco {}: chunk {}, window {}: {:.2f} GiB device, {:.2f} GiB host, {:.1f} s", T,
                        o.chunk, o.offload_window, r.peak_device_gib(), r.peak_host_gib(), r.step_s));
    CHECK(r.fits);
    CHECK(r.peak_device_gib() + 0.5 <= 24);
  }

  // Full parameters at 60K on an 80 GiB GPU: the state alone (bf16 weights, f32 master, moments and
  // gradients: 16 bytes a parameter, 120 GiB) cannot fit; with master and moments on the host it does.
  const int64_t T = 61440;
  CHECK_THROWS_WITH_AS(resolve_auto_schedule(eight_b, 1, T, auto_seco(), DType::bf16, 80),
                       doctest::Contains("--optimizer-offload"), Error);
  const ScheduleOptions o =
      resolve_auto_schedule(eight_b, 1, T, auto_seco(), DType::bf16, 80, LoraConfig{}, true);
  const PlanReport off = plan_step(eight_b, 1, T, o, DType::bf16, 80, LoraConfig{}, true);
  MESSAGE(fmt::format("8B full seco 60K, optimizer offloaded: chunk {}, window {}: {:.2f} GiB device, {:.2f} GiB host, "
                      "{:.1f} s",
                      o.chunk, o.offload_window, off.peak_device_gib(), off.peak_host_gib(), off.step_s));
  CHECK(off.fits);
  auto bytes = [](const std::vector<std::pair<std::string, size_t>>& cats, const std::string& what) {
    for (const auto& [name, b] : cats)
      if (name == what) return double(b);
    return -1.0;
  };
  const double n = double(eight_b.parameter_count());
  CHECK(bytes(off.device, "master") < 0);  // none on the device
  // The f32 state streams through the device: its slots there (3 x master, m, v of a piece), no host staging.
  CHECK(bytes(off.device, "optimizer") > 0);
  CHECK(bytes(off.device, "optimizer") < 0.01 * 8 * n);
  CHECK(bytes(off.host, "master") == doctest::Approx(4 * n));
  CHECK(bytes(off.host, "optimizer") == doctest::Approx(8 * n));
  CHECK(bytes(off.host, "staging") < 0);
  CHECK(bytes(off.device, "gradients") >= 4 * n);
  CHECK(off.schedule.find("optimizer offloaded") != std::string::npos);
}

TEST_CASE("plan: offload_window = auto streams the K/V store where no window of layers fits") {
  ScheduleOptions o = sched("seco", kAuto);
  o.offload_window = kAuto;
  // 512K tokens in 26 GiB: even one layer of the store (6 GiB at 512K) with the 20.7 GiB of weights,
  // master, moments and gradients does not fit; the streamed store does.
  const ScheduleOptions r = resolve_auto_schedule(one_b(), 1, 524288, o, DType::bf16, 26);
  CHECK(r.stream_kv);
  CHECK(r.offload_window == 0);
  CHECK(r.chunk > 0);
  CHECK(plan_step(one_b(), 1, 524288, r, DType::bf16, 26).fits);
  // Where a window fits, it is preferred (streaming runs many more, smaller attention calls).
  const ScheduleOptions w = resolve_auto_schedule(one_b(), 1, 131072, o, DType::bf16, 80);
  CHECK_FALSE(w.stream_kv);
}

TEST_CASE("plan: with recompute = auto, chunk and window = auto also choose the recompute inside a chunk") {
  // Llama-3.1-8B with LoRA at 64K in 24 GiB: keeping every activation of a chunk allows chunks of
  // 1024, whose K/V offload moves 1.8 TB a step; recomputing inside the chunk (or every layer from its
  // saved input, one layer's activations at a time) lets a longer one fit.
  const LlamaConfig& cf = eight_b_config();
  const LoraConfig lora = paper_lora();
  ScheduleOptions o = sched("seco", kAuto);
  o.offload_window = kAuto;
  const ScheduleOptions chosen = resolve_auto_schedule(cf, 1, 65536, o, DType::bf16, 24, lora);
  const double t_chosen = plan_step(cf, 1, 65536, chosen, DType::bf16, 24, lora).step_s;
  // Every activation of the chunk kept, no saved inputs, at its own fastest chunk in the same window.
  ScheduleOptions all = chosen;
  all.recompute = RecomputeMode::none;
  all.save_inputs = false;
  all.bwd_chunk = 0;
  all.chunk = choose_chunk(cf, 1, 65536, all, DType::bf16, 24, chunk_candidates(), lora);
  const double t_all = all.chunk > 0 ? plan_step(cf, 1, 65536, all, DType::bf16, 24, lora).step_s : 0;
  MESSAGE(fmt::format("chosen: recompute {} chunk {} window {} save_inputs {}: {:.1f} s; every activation kept: chunk "
                      "{}: {:.1f} s", recompute_name(chosen.recompute), chosen.chunk, chosen.offload_window, chosen.save_inputs,
                      t_chosen, all.chunk, t_all));
  CHECK(chosen.recompute != RecomputeMode::automatic);
  CHECK((chosen.recompute != RecomputeMode::none || chosen.save_inputs));
  CHECK(chosen.chunk > all.chunk);
  if (all.chunk > 0) CHECK(t_chosen < t_all);
  CHECK(plan_step(cf, 1, 65536, chosen, DType::bf16, 24, lora).fits);
  // A given recompute is kept as given.
  ScheduleOptions none = o;
  none.recompute = RecomputeMode::none;
  CHECK(resolve_auto_schedule(cf, 1, 65536, none, DType::bf16, 24, lora).recompute == RecomputeMode::none);
}

TEST_CASE("plan: chunk and window = auto also save the attention outputs where that fits and is clearly faster") {
  // Llama-3.2-1B at 128K on 80 GiB: saved outputs spare the reverse sweep its attention forward
  // (the H100 measured 12.2 s against 15.0 s), and the store's extra 4 GiB fits.
  const ScheduleOptions chosen = resolve_auto_schedule(one_b(), 1, 131072, auto_seco(), DType::bf16, 80);
  CHECK(chosen.save_attention);
  const PlanReport with = plan_step(one_b(), 1, 131072, chosen, DType::bf16, 80);
  ScheduleOptions without = chosen;
  without.save_attention = false;
  CHECK(with.fits);
  CHECK(with.step_s < 0.99 * plan_step(one_b(), 1, 131072, without, DType::bf16, 80).step_s);
  // Asked for, it stays on; a fixed chunk and window leave the schedule as given.
  ScheduleOptions asked = auto_seco();
  asked.save_attention = true;
  CHECK(resolve_auto_schedule(one_b(), 1, 131072, asked, DType::bf16, 80).save_attention);
  const ScheduleOptions fixed = sched("seco", 4096);
  CHECK_FALSE(resolve_auto_schedule(one_b(), 1, 131072, fixed, DType::bf16, 80).save_attention);
  // With the store offloaded the saved outputs live on the host too, so even a tight budget takes
  // them: 128K at chunk 4096 in 25 GiB (not in a window of one layer, which would leave its copies
  // unoverlapped).
  ScheduleOptions tight = sched("seco", 4096);
  tight.offload_window = kAuto;
  const ScheduleOptions t = resolve_auto_schedule(one_b(), 1, 131072, tight, DType::bf16, 25);
  CHECK(t.save_attention);
  CHECK((t.stream_kv || t.offload_window == 2));
  CHECK(plan_step(one_b(), 1, 131072, t, DType::bf16, 25).fits);
}

TEST_CASE("plan: auto prefills in longer chunks than the reverse sweep's where they fit and are not slower") {
  // 1B within HF+Liger's peaks, where auto keeps no layer inputs (those picks run no chunk forward in
  // the reverse sweep, so their reverse chunks are as long as the prefill's): the reverse sweep's chunk
  // as before, the prefill's 2 or 4 times it (at most 16384), predicted no slower (32K in 22.7 GiB:
  // 1.235 s against 1.258-1.271 measured).
  for (const auto& [T, gib] : {std::pair<int64_t, double>{32768, 22.7}, {65536, 30.2}, {131072, 45.3}}) {
    std::vector<AutoCandidate> weighed;
    resolve_auto_schedule(one_b(), 1, T, auto_seco(), DType::bf16, gib, {}, false, &weighed);
    std::optional<ScheduleOptions> fastest;  // of the candidates without saved inputs
    double fastest_s = 0;
    for (const AutoCandidate& c : weighed)
      if (c.fits && !c.schedule.save_inputs && (!fastest || c.step_s < fastest_s)) {
        fastest = c.schedule;
        fastest_s = c.step_s;
      }
    REQUIRE(fastest);
    const ScheduleOptions o = *fastest;
    CAPTURE(T);
    REQUIRE(o.bwd_chunk > 0);
    CHECK(o.chunk > o.bwd_chunk);
    CHECK(o.chunk <= 16384);
    CHECK(o.chunk % o.bwd_chunk == 0);
    const PlanReport longer = plan_step(one_b(), 1, T, o, DType::bf16, gib);
    ScheduleOptions same = o;
    same.chunk = o.bwd_chunk;
    same.bwd_chunk = 0;
    CHECK(longer.fits);
    CHECK(longer.step_s <= plan_step(one_b(), 1, T, same, DType::bf16, gib).step_s * 1.01);
  }
  // A chunk given by the user, or a reverse chunk of its own, is left as asked; the streamed store
  // keeps one chunk for both.
  ScheduleOptions given = sched("seco", 4096);
  given.offload_window = kAuto;
  const ScheduleOptions g = resolve_auto_schedule(one_b(), 1, 32768, given, DType::bf16, 80);
  CHECK(g.chunk == 4096);
  CHECK(g.bwd_chunk == 0);
  ScheduleOptions streamed = auto_seco();
  streamed.stream_kv = true;
  streamed.offload_window = 0;
  const ScheduleOptions st = resolve_auto_schedule(one_b(), 1, 131072, streamed, DType::bf16, 30);
  CHECK(st.bwd_chunk == 0);
}

TEST_CASE("plan: auto weighs where the K/V store lives by time, not by the least offload that fits") {
  const LlamaConfig& eight_b = eight_b_config();
  const LoraConfig lora = paper_lora();
  const MemoryBudget h100{80, 128};
  // 8B LoRA at 16K: one chunk of 16384 stays on the device (no prefill; the store keeps one layer's
  // dK, dV); it beats the chunk of 8192 and its prefill.
  const ScheduleOptions one = resolve_auto_schedule(eight_b, 1, 16384, auto_seco(), DType::bf16, h100, lora);
  CHECK(one.chunk == 16384);
  CHECK(one.offload_window == 0);
  CHECK_FALSE(one.stream_kv);
  // 1B at 128K in 40 GiB: beside the whole store fit chunks of 2048 without saved outputs; the store
  // in host memory (a window of two layers, or streamed: since the one-warp merge the blocks cost
  // about one call) frees the room for chunks of 8192 with them, predicted faster.
  const MemoryBudget forty{40, 128};
  const ScheduleOptions windowed = resolve_auto_schedule(one_b(), 1, 131072, auto_seco(), DType::bf16, forty);
  CHECK((windowed.offload_window == 2 || windowed.stream_kv));
  CHECK(windowed.save_attention);
  ScheduleOptions on_device = auto_seco();
  on_device.offload_window = 0;
  const ScheduleOptions kept = resolve_auto_schedule(one_b(), 1, 131072, on_device, DType::bf16, forty);
  CHECK(plan_step(one_b(), 1, 131072, windowed, DType::bf16, forty).step_s <
        0.99 * plan_step(one_b(), 1, 131072, kept, DType::bf16, forty).step_s);
  // In 24 GiB at 64K a window of one layer (copies and compute taking turns; 30.2 s measured) loses to
  // a placement whose copies overlap: the store streamed in blocks, or a window of two layers.
  const MemoryBudget small{24, 128};
  const ScheduleOptions tight = resolve_auto_schedule(eight_b, 1, 65536, auto_seco(), DType::bf16, small, lora);
  CHECK((tight.stream_kv || tight.offload_window >= 2));
  CHECK(plan_step(eight_b, 1, 65536, tight, DType::bf16, small, lora).step_s < 30.2 * 0.75);
  // Without a reason to offload, the store stays on the device (1B at 64K on 80 GiB).
  const ScheduleOptions roomy = resolve_auto_schedule(one_b(), 1, 65536, auto_seco(), DType::bf16, h100);
  CHECK(roomy.offload_window == 0);
  CHECK_FALSE(roomy.stream_kv);
}

TEST_CASE("plan: the host's memory bounds what is pinned there; auto keeps to it") {
  // 1M tokens on an 80 GiB GPU: saving the attention outputs would pin 162 GiB of host memory, more
  // than 90% of the GPU machine's 128 GiB; with that budget auto goes without them.
  const int64_t T = 1048576;
  const ScheduleOptions free_host = resolve_auto_schedule(one_b(), 1, T, auto_seco(), DType::bf16, 79.2);
  CHECK(free_host.save_attention);
  CHECK(plan_step(one_b(), 1, T, free_host, DType::bf16, 79.2).peak_host_gib() > 150);
  const MemoryBudget budget(79.2, 128);
  const ScheduleOptions bounded = resolve_auto_schedule(one_b(), 1, T, auto_seco(), DType::bf16, budget);
  const PlanReport r = plan_step(one_b(), 1, T, bounded, DType::bf16, budget);
  MESSAGE(fmt::format("1M in 79.2 GiB + 128 GiB host: {} ({:.1f} GiB device, {:.1f} GiB host, {:.0f} s)", r.schedule,
                      r.peak_device_gib(), r.peak_host_gib(), r.step_s));
  CHECK_FALSE(bounded.save_attention);
  CHECK(r.fits);
  CHECK(r.host_fits);
  CHECK(r.peak_host_gib() <= 0.9 * 128);
  // A plan over the host's budget says so and names the knobs.
  ScheduleOptions saved_streamed = saved(sched("seco", 16384));
  saved_streamed.stream_kv = true;
  const PlanReport over = plan_step(one_b(), 1, T, saved_streamed, DType::bf16, budget);
  CHECK(over.device_fits);
  CHECK_FALSE(over.host_fits);
  CHECK_FALSE(over.fits);
  CHECK(over.advice.find("--save-attention") != std::string::npos);
  CHECK(plan_table(over).find("(host over)") != std::string::npos);
  // Nothing fits a host too small for any offloaded store: the error names both budgets.
  CHECK_THROWS_WITH_AS(resolve_auto_schedule(one_b(), 1, T, auto_seco(), DType::bf16, MemoryBudget(79.2, 60)),
                       doctest::Contains("90% of 60.0 GiB of host memory"), Error);
}

TEST_CASE("plan: the longest sequence that fits, on the device or bounded by the host") {
  // Llama-3.2-1B, seco chunk 4096, store on the device, 79.2 GiB: about 500K tokens (515K by a fit
  // of two measured peaks); the next chunk does not fit.
  const ScheduleOptions seco = sched("seco", 4096);
  const LongestPlan l = longest_sequence(one_b(), 1, seco, DType::bf16, 79.2);
  MESSAGE(fmt::format("seco chunk 4096 on the device: {} tokens", l.T));
  CHECK(l.granule == 4096);
  CHECK(l.T % 4096 == 0);
  CHECK(l.T > 450000);
  CHECK(l.T < 540000);
  CHECK(plan_step(one_b(), 1, l.T, seco, DType::bf16, 79.2).fits);
  CHECK_FALSE(plan_step(one_b(), 1, l.T + 4096, seco, DType::bf16, 79.2).fits);
  // Streamed, the device no longer bounds it: the host's pinned store does (96 GiB a million tokens).
  ScheduleOptions streamed = sched("seco", 16384);
  streamed.stream_kv = true;
  const LongestPlan h128 = longest_sequence(one_b(), 1, streamed, DType::bf16, MemoryBudget(79.2, 128));
  const LongestPlan h256 = longest_sequence(one_b(), 1, streamed, DType::bf16, MemoryBudget(79.2, 256));
  MESSAGE(fmt::format("streamed, chunk 16384: {} tokens with 128 GiB of host, {} with 256", h128.T, h256.T));
  CHECK(h128.T > 1048576);
  CHECK(h256.T > h128.T * 19 / 10);
  const PlanReport at = plan_step(one_b(), 1, h128.T, streamed, DType::bf16, MemoryBudget(79.2, 128));
  CHECK(at.fits);
  CHECK(at.peak_host_gib() > 0.85 * 0.9 * 128);
  // auto settings are chosen again at every length; the longest is at least the fixed settings'.
  const LongestPlan a = longest_sequence(one_b(), 1, auto_seco(), DType::bf16, MemoryBudget(79.2, 128));
  CHECK(a.T >= h128.T - 16384);
  CHECK(a.schedule.chunk > 0);
  CHECK(a.schedule.chunk != kAuto);
  // Nothing fits: T = 0 (the 8B model's full-parameter state alone exceeds 16 GiB).
  CHECK(longest_sequence(eight_b_config(), 1, sched("full"), DType::bf16, 16).T == 0);
  // The limit caps the search.
  CHECK(longest_sequence(one_b(), 1, streamed, DType::bf16, MemoryBudget(79.2, 0), {}, false, 65536).T == 65536);
}

TEST_CASE("plan: auto casts the blocks from the master where memory is short and that is clearly faster") {
  // 32K within HF+Liger's 22.7 GiB: the 1.6 GiB the resident blocks free buys larger chunks.
  const ScheduleOptions tight = resolve_auto_schedule(one_b(), 1, 32768, auto_seco(), DType::bf16, 22.7);
  CHECK(tight.cast_layers);
  // Against the fastest fitting plan without the casts that auto weighed.
  std::vector<AutoCandidate> weighed;
  resolve_auto_schedule(one_b(), 1, 32768, auto_seco(), DType::bf16, 22.7, {}, false, &weighed);
  double uncast_s = 0;
  for (const AutoCandidate& a : weighed)
    if (a.fits && !a.schedule.cast_layers && (uncast_s == 0 || a.step_s < uncast_s)) uncast_s = a.step_s;
  REQUIRE(uncast_s > 0);
  CHECK(plan_step(one_b(), 1, 32768, tight, DType::bf16, 22.7).step_s < 0.99 * uncast_s);
  // With memory to spare the casts only cost time; LoRA's base and an offloaded optimizer have no
  // master on the device to cast from.
  CHECK_FALSE(resolve_auto_schedule(one_b(), 1, 32768, auto_seco(), DType::bf16, 80).cast_layers);
  LoraConfig lora;
  lora.rank = 8;
  CHECK_FALSE(resolve_auto_schedule(one_b(), 1, 32768, auto_seco(), DType::bf16, 22.7, lora).cast_layers);
  CHECK_FALSE(resolve_auto_schedule(one_b(), 1, 32768, auto_seco(), DType::bf16, 22.7, {}, true).cast_layers);
}
