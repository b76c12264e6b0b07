// What `auto` chooses: the chunk, the K/V store's place, the recompute inside a chunk, saved outputs
// and inputs, cast blocks, and the longest sequence; each by comparing plan_step's plans.
#include "tools/planner/step.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>

namespace cw {

const std::vector<int64_t>& chunk_candidates() {
  static const std::vector<int64_t> c = {1024, 2048, 4096, 8192, 16384, 32768};
  return c;
}

namespace {
// Of `candidates`, in order of growing chunks, the last that fits and is predicted within 1% of the
// fastest before it: the time model is blind to kernel efficiency at small row counts, so fewer,
// larger kernels win a near tie. nullopt where none fits.
std::optional<ScheduleOptions> longest_near_fastest(const std::vector<ScheduleOptions>& candidates,
                                                    const LlamaConfig& config, int64_t B, int64_t T, DType dtype,
                                                    const MemoryBudget& budget, const LoraConfig& lora,
                                                    bool optimizer_offload) {
  std::optional<ScheduleOptions> best;
  double best_s = 0;
  for (const ScheduleOptions& o : candidates) {
    const PlanReport r = plan_step(config, B, T, o, dtype, budget, lora, optimizer_offload);
    if (r.fits && (!best || r.step_s <= best_s * 1.01)) {
      best_s = best ? std::min(best_s, r.step_s) : r.step_s;
      best = o;
    }
  }
  return best;
}
}  // namespace

int64_t choose_chunk(const LlamaConfig& config, int64_t B, int64_t T, const ScheduleOptions& schedule, DType dtype,
                     const MemoryBudget& budget, const std::vector<int64_t>& candidates, const LoraConfig& lora,
                     bool optimizer_offload) {
  std::vector<ScheduleOptions> chunked_at;
  for (int64_t c : candidates) {
    if (c > T) continue;
    ScheduleOptions o = schedule;
    o.chunk = c;
    o.bwd_chunk = 0;
    chunked_at.push_back(o);
  }
  const auto best = longest_near_fastest(chunked_at, config, B, T, dtype, budget, lora, optimizer_offload);
  return best ? best->chunk : 0;
}

namespace {
// A prefill in longer chunks than the reverse sweep's: its GEMMs run over more rows and its
// attention and window copies in fewer calls, for little memory (a prefill chunk keeps nothing).
// From `o` (chunk c, no bwd_chunk of its own, fitting): bwd_chunk = c and, of c, 2c, 4c up to
// kLongestAutoPrefill, the longest near the fastest (longest_near_fastest). The cap is the longest
// prefill chunk measured to help; longer ones peak above their plan for no gain (docs/performance.md,
// "The rates of the planner's time model": kLongestAutoPrefill). The streamed store needs
// bwd_chunk = chunk.
constexpr int64_t kLongestAutoPrefill = 16384;

ScheduleOptions longer_prefill(const LlamaConfig& config, int64_t B, int64_t T, const ScheduleOptions& o, DType dtype,
                               const MemoryBudget& budget, const LoraConfig& lora, bool optimizer_offload) {
  if (!chunked(o) || o.stream_kv || o.bwd_chunk > 0 || o.chunk <= 0) return o;
  std::vector<ScheduleOptions> prefills{o};
  for (int64_t k : {2, 4}) {
    ScheduleOptions p = o;
    p.bwd_chunk = o.chunk;
    p.chunk = k * o.chunk;
    if (p.chunk > std::min(T, kLongestAutoPrefill)) break;
    prefills.push_back(p);
  }
  return longest_near_fastest(prefills, config, B, T, dtype, budget, lora, optimizer_offload).value_or(o);
}
}  // namespace

int64_t choose_offload_window(const LlamaConfig& config, int64_t B, int64_t T, const ScheduleOptions& schedule,
                              DType dtype, const MemoryBudget& budget, const LoraConfig& lora, bool optimizer_offload) {
  ScheduleOptions o = schedule;
  for (int64_t w = 0; w <= config.num_hidden_layers; ++w) {
    o.offload_window = w == 0 ? 0 : w;
    if (plan_step(config, B, T, o, dtype, budget, lora, optimizer_offload).fits) return w;
  }
  return -1;
}

namespace {
// The settings chosen, and where `weighed` (when given) holds them.
struct Resolved {
  ScheduleOptions schedule;
  size_t weighed_index = 0;
};

Resolved resolve_chunk_and_window(const LlamaConfig& cf, int64_t B, int64_t T, ScheduleOptions o, DType dtype,
                                  const MemoryBudget& gib, const LoraConfig& lora, bool optimizer_offload,
                                  std::vector<AutoCandidate>* weighed = nullptr) {
  const bool auto_chunk = o.chunk == kAuto, auto_window = o.offload_window == kAuto;
  CW_CHECK(chunked(o), "schedule.chunk and schedule.offload_window = auto are for schedules seco and spaco");
  auto out_of_memory = [&] {
    std::string sizes;
    for (int64_t c : chunk_candidates()) sizes += (sizes.empty() ? "" : ", ") + std::to_string(c);
    fail(fmt::format("out of memory at every chunk length ({}) in {}{}", sizes, budget_text(gib),
                     auto_window ? " with any K/V offload window or the store streamed" : ""),
         auto_window ? (gib.host_gib > 0 ? "lower the sequence length or batch, or use a machine with more device or "
                                           "host memory (the offloaded store is pinned in host memory)"
                                         : "lower the sequence length or batch, or offload the optimizer "
                                           "(--optimizer-offload)")
                     : "set the offload window (--offload-window N or auto), or lower the sequence length or batch");
  };
  if (!auto_window) {
    if (auto_chunk) o.chunk = choose_chunk(cf, B, T, o, dtype, gib, chunk_candidates(), lora, optimizer_offload);
    if (auto_chunk && o.chunk == 0) out_of_memory();
    if (auto_chunk) o = longer_prefill(cf, B, T, o, dtype, gib, lora, optimizer_offload);
    if (!weighed) return {o};
    const PlanReport r = plan_step(cf, B, T, o, dtype, gib, lora, optimizer_offload);
    weighed->push_back({o, r.fits, r.peak_device_gib(), r.peak_host_gib(), r.step_s, false});
    return {o, weighed->size() - 1};
  }
  // auto window: where the K/V store lives, with each place's fastest chunk (or the given one): on the
  // device; a window of two layers (the least memory whose copies overlap the compute; a larger
  // window moves the same bytes in more memory); of one (less memory still, its copies not
  // overlapped); streamed in chunk-sized blocks (no layer whole on the device). The fastest that fits
  // wins; an earlier one unless a later one is 1% faster (an offload adds risks the model does not
  // time, such as host memory pressure).
  std::vector<ScheduleOptions> places;
  for (const int64_t w : {int64_t(0), int64_t(2), int64_t(1)}) {
    if (w >= cf.num_hidden_layers || (w > 0 && o.stream_kv)) continue;
    ScheduleOptions p = o;
    p.offload_window = w;
    places.push_back(p);
  }
  if (!o.stream_kv && !o.save_inputs && o.bwd_chunk == 0) {
    ScheduleOptions streamed = o;
    streamed.offload_window = 0;
    streamed.stream_kv = true;
    places.push_back(streamed);
  }
  std::optional<Resolved> best;
  double best_s = 0;
  for (ScheduleOptions p : places) {
    if (auto_chunk) p.chunk = choose_chunk(cf, B, T, p, dtype, gib, chunk_candidates(), lora, optimizer_offload);
    if (p.chunk <= 0) continue;
    if (auto_chunk) p = longer_prefill(cf, B, T, p, dtype, gib, lora, optimizer_offload);
    const PlanReport r = plan_step(cf, B, T, p, dtype, gib, lora, optimizer_offload);
    if (weighed) weighed->push_back({p, r.fits, r.peak_device_gib(), r.peak_host_gib(), r.step_s, false});
    if (r.fits && (!best || r.step_s < best_s * 0.99)) {
      best = Resolved{p, weighed ? weighed->size() - 1 : 0};
      best_s = r.step_s;
    }
  }
  if (best) return *best;
  if (auto_chunk) out_of_memory();
  fail(fmt::format("out of memory with any K/V offload window or the store streamed at chunk {} in {}", o.chunk,
                   budget_text(gib)),
       "lower the chunk (--chunk N or auto), or offload the optimizer (--optimizer-offload)");
}
}  // namespace

ScheduleOptions resolve_auto_schedule(const LlamaConfig& cf, int64_t B, int64_t T, ScheduleOptions o, DType dtype,
                                      const MemoryBudget& gib, const LoraConfig& lora, bool optimizer_offload,
                                      std::vector<AutoCandidate>* weighed) {
  if (o.chunk != kAuto && o.offload_window != kAuto) return o;
  if (!chunked(o)) return resolve_chunk_and_window(cf, B, T, o, dtype, gib, lora, optimizer_offload, weighed).schedule;
  // With a planned chunk or window, what happens inside a chunk is planned too. recompute = auto:
  // keeping every activation of a chunk (none) is fastest per chunk, but recomputing inside it
  // (selective, full) lets a larger chunk fit, and a larger chunk moves fewer K/V bytes where the
  // store is offloaded. Saved attention outputs (save_attention, unless already asked for) spare the
  // reverse sweep its attention forward for store memory. Each alternative that costs memory or
  // recomputes more must be clearly (1%) faster than the one before it.
  std::vector<RecomputeMode> modes{o.recompute};
  if (o.recompute == RecomputeMode::automatic)
    modes = {RecomputeMode::none, RecomputeMode::selective, RecomputeMode::full};
  // Casting the blocks from the master as they run (cast_layers, where it applies) frees their
  // resident copy for a cast per block use.
  std::vector<bool> saves{o.save_attention};
  if (!o.save_attention) saves = {false, true};
  // Saved layer inputs (save_inputs, unless already asked for) spare the reverse sweep its chunk
  // forward, and a chunk all but one layer's activations, for store memory; not with a streamed store.
  std::vector<bool> inputs{o.save_inputs};
  if (!o.save_inputs && !o.stream_kv) inputs = {false, true};
  std::vector<bool> casts{o.cast_layers};
  if (!o.cast_layers && can_cast_layers(dtype, lora, optimizer_offload) && gib.zero3_ranks == 0) casts = {false, true};
  std::optional<Resolved> best;
  double best_s = 0;
  std::optional<Error> first_error;
  for (const bool cast : casts) {
    for (const bool save : saves) {
      for (const bool in : inputs) {
        for (const RecomputeMode mode : modes) {
          // With saved inputs every layer is recomputed from its input: none and full are the same.
          if (in && mode == RecomputeMode::full && o.recompute == RecomputeMode::automatic) continue;
          ScheduleOptions m = o;
          m.recompute = mode;
          m.save_attention = save;
          m.save_inputs = in;
          m.cast_layers = cast;
          try {
            const Resolved r = resolve_chunk_and_window(cf, B, T, m, dtype, gib, lora, optimizer_offload, weighed);
            const double s = plan_step(cf, B, T, r.schedule, dtype, gib, lora, optimizer_offload).step_s;
            if (!best || s < best_s * 0.99) {
              best = r;
              best_s = s;
            }
          } catch (const Error& e) {
            if (!first_error) first_error = e;
          }
        }
      }
    }
  }
  if (!best) throw *first_error;
  if (weighed) (*weighed)[best->weighed_index].chosen = true;
  return best->schedule;
}

LongestPlan longest_sequence(const LlamaConfig& cf, int64_t B, const ScheduleOptions& schedule, DType dtype,
                             const MemoryBudget& budget, const LoraConfig& lora, bool optimizer_offload,
                             int64_t limit) {
  LongestPlan best;
  best.granule = chunked(schedule) && schedule.chunk > 0 ? schedule.chunk : 1024;
  best.schedule = schedule;
  // Whether k granules fit, and the settings that do.
  const auto fits = [&](int64_t k, ScheduleOptions* chosen) {
    const int64_t T = k * best.granule;
    try {
      const ScheduleOptions o = resolve_auto_schedule(cf, B, T, schedule, dtype, budget, lora, optimizer_offload);
      if (!plan_step(cf, B, T, o, dtype, budget, lora, optimizer_offload).fits) return false;
      *chosen = o;
      return true;
    } catch (const Error&) {  // auto found nothing that fits
      return false;
    }
  };
  // Doubling to the first length that does not fit, then halving the gap: memory grows with T.
  const int64_t max_k = std::max<int64_t>(limit / best.granule, 1);
  int64_t good = 0, bad = 1;
  ScheduleOptions chosen;
  while (bad <= max_k && fits(bad, &chosen)) {
    good = bad;
    best.schedule = chosen;
    bad = std::min(bad * 2, max_k + 1);
    if (good == max_k) break;
  }
  if (good == max_k) bad = max_k + 1;
  while (bad - good > 1) {
    const int64_t mid = good + (bad - good) / 2;
    if (fits(mid, &chosen)) {
      good = mid;
      best.schedule = chosen;
    } else {
      bad = mid;
    }
  }
  best.T = good * best.granule;
  return best;
}

}  // namespace cw
