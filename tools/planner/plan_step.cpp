// plan_step: a step's settings resolved once (step.h), its memory (memory.cpp) and time
// (time_model.cpp) against the budget, and what to turn when it does not fit.
#include "engine/engine.h"
#include "engine/residency.h"
#include "model/cp_group.h"
#include "model/layer_cast.h"
#include "optim/adamw_offload.h"
#include "tools/planner/step.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace cw {

namespace {
constexpr double kDefaultDeviceGib = 80;
}  // namespace

std::string describe_schedule(const ScheduleOptions& o) {
  std::string s(schedule_name(o.kind));
  if (o.kind == ScheduleKind::checkpointed || o.recompute_mode() != RecomputeMode::none)
    s += fmt::format(" recompute {}{}", recompute_name(o.recompute_mode()), o.offload ? " offload" : "");
  if (chunked(o)) s += fmt::format(" chunk {} bwd-chunk {}", o.chunk, o.bwd_chunk > 0 ? o.bwd_chunk : o.chunk);
  if (o.mlp_shards != 1) s += fmt::format(" mlp-shards {}", o.mlp_shards);
  if (o.offload_window > 0) s += fmt::format(" offload-window {}", o.offload_window);
  if (o.save_attention) s += " save-attention";
  if (o.save_inputs) s += " save-inputs";
  if (o.stream_kv) s += " stream-kv";
  if (o.cast_layers) s += " cast-layers";
  return s;
}

double PlanReport::peak_device_gib() const { return double(peak_device_bytes) / kGiB; }
double PlanReport::peak_host_gib() const { return double(peak_host_bytes) / kGiB; }

PlanReport plan_step(const LlamaConfig& cf, int64_t B, int64_t T, const ScheduleOptions& o, DType dtype,
                     const MemoryBudget& budget, const LoraConfig& lora, bool optimizer_offload,
                     const std::vector<std::vector<int64_t>>& doc_starts, Device device) {
  CW_CHECK(B > 0 && T > 0, "plan: batch {} and sequence {} must be positive", B, T);
  CW_CHECK(doc_starts.empty() || static_cast<int64_t>(doc_starts.size()) == B,
           "plan: document starts for {} sequences, the batch has {}", doc_starts.size(), B);
  if (device.is_cpu())
    CW_CHECK(dtype == DType::f64 || dtype == DType::f32, "plan: --dtype {} (the CPU trains in f64 or f32)",
             dtype_name(dtype));
  else
    CW_CHECK(dtype == DType::bf16 || dtype == DType::f32, "plan: --dtype {} (the GPU trains in bf16 or f32)",
             dtype_name(dtype));
  const int64_t L = cf.num_hidden_layers;
  CW_CHECK(o.offload_window >= 0 && o.offload_window <= L, "plan: --offload-window {} outside [0, {}] layers",
           o.offload_window, L);
  const bool inputs = chunked(o) && o.save_inputs;
  CW_CHECK(!(inputs && o.stream_kv), "plan: --save-inputs is not kept by a streamed store (--stream-kv)");
  CW_CHECK(!o.cast_layers || (can_cast_layers(dtype, lora, optimizer_offload) && !device.is_cpu() &&
                               budget.zero3_ranks == 0),
           "plan: --cast-layers rounds bf16 blocks from the f32 master on the device: it needs --dtype bf16 on a GPU, "
           "no LoRA, the optimizer on the device and no ZeRO 3");

  // Context parallelism: the plan is one rank's (model/cp_group.h), its store of the rank's heads.
  const int64_t cp = std::max(1, budget.cp_ranks);
  if (cp > 1) {
    CW_CHECK_HINT(budget.zero3_ranks == 0 && !inputs && doc_starts.empty(),
                  "plan --cp without --zero 3, --save-inputs and --documents",
                  "plan: context parallelism with ZeRO 3, saved layer inputs or packed documents is not implemented");
    const int64_t chunk = chunked(o) && o.chunk > 0 ? std::min(o.chunk, T) : T;
    const int64_t bwd = chunked(o) && o.bwd_chunk > 0 ? std::min(o.bwd_chunk, T) : chunk;
    CW_CHECK_HINT(T % cp == 0 && chunk % cp == 0 && bwd % cp == 0, "give --seq and the chunk lengths as multiples of --cp",
                  "plan: --cp {} splits every chunk's tokens into equal parts: --seq {}, chunk {} and bwd-chunk {} "
                  "must be multiples of it", cp, T, chunk, bwd);
  }
  const LlamaConfig store = cp > 1 ? cp_attention_config(cf, cp) : cf;

  PlanReport r;
  r.schedule = describe_schedule(o);
  if (cp > 1) r.schedule += fmt::format(" context parallel {}", cp);
  r.cp = cp;
  if (lora.enabled())
    r.schedule += fmt::format(" lora rank {} on {}{}", lora.rank, fmt::join(lora.target_names(), ","),
                              lora.dropout > 0 ? fmt::format(" dropout {}", lora.dropout) : "");
  if (optimizer_offload) r.schedule += " optimizer offloaded";
  r.B = B;
  r.T = T;
  r.chunk = chunked(o) && o.chunk > 0 ? std::min(o.chunk, T) : T;
  r.bwd_chunk = chunked(o) && o.bwd_chunk > 0 ? std::min(o.bwd_chunk, T) : r.chunk;
  r.offload_window = o.offload_window;
  r.device_gib = budget.device_gib;
  r.host_gib = budget.host_gib;
  // The prefill's tokens: seco's stops where its last reverse chunk starts (optim/seco.cpp) unless it
  // saves layer inputs; spaco's runs all T (it reports every chunk's loss).
  const int64_t last_reverse_chunk = (T + r.bwd_chunk - 1) / r.bwd_chunk * r.bwd_chunk - r.bwd_chunk;
  const int64_t prefill_end = o.kind == ScheduleKind::seco && !inputs ? last_reverse_chunk : chunked(o) ? T : 0;
  const bool windowed = chunked(o) && o.offload_window > 0 && o.offload_window < L;
  const StepPlan s{cf,
                   B,
                   T,
                   o,
                   dtype,
                   lora,
                   optimizer_offload,
                   doc_starts,
                   device,
                   dtype_size(dtype),
                   dtype_size(accum_dtype(dtype)),
                   r.chunk,
                   r.bwd_chunk,
                   prefill_end,
                   chunked(o) && o.save_attention,
                   inputs,
                   chunked(o) && o.stream_kv,
                   windowed,
                   // One device slot cannot prefetch: the next layer's copy in waits for the current
                   // layer to leave the slot (engine/residency.h), so compute and copies take turns.
                   windowed && o.offload_window == 1,
                   o.cast_layers,
                   // An offloaded f32 state streams through the device; else the host's cores update it.
                   optimizer_offload && OffloadedAdamW::streams(device, accum_dtype(dtype)),
                   cp,
                   store};
  plan_memory(s, r);
  for (const auto& [name, bytes] : r.device) r.peak_device_bytes += bytes;
  for (const auto& [name, bytes] : r.host) r.peak_host_bytes += bytes;
  r.context_bytes = device.is_cpu() ? 0 : kCudaContextBytes;
  r.device_fits = double(r.peak_device_bytes + r.context_bytes) <= budget.device_gib * kGiB;
  r.host_fits = budget.host_gib <= 0 || double(r.peak_host_bytes) <= kPinnableHostShare * budget.host_gib * kGiB;
  r.fits = r.device_fits && r.host_fits;
  plan_time(s, r);
  if (cp > 1) plan_context_parallel(s, r);
  if (budget.zero3_ranks > 0)
    apply_zero3(r, plan_zero3(cf, T, o, dtype, budget.zero3_ranks, optimizer_offload, device, lora), budget, device);

  if (!r.host_fits) {
    r.advice = "keep more of the K/V store on the device (a larger --offload-window, not --stream-kv), drop "
               "--save-attention (its outputs are offloaded with the store), keep the optimizer on the device, or "
               "lower --seq";
  } else if (!r.fits) {
    if (chunked(o))
      r.advice = o.stream_kv ? "lower --chunk (the blocks and activations grow with it), or offload the optimizer "
                               "(--optimizer-offload)"
                             : "lower --chunk / --bwd-chunk (activations grow with it), set --offload-window to keep "
                               "only that many layers of the K/V store on the device, or --stream-kv to keep none";
    else if (o.kind == ScheduleKind::full)
      r.advice = "use --schedule checkpointed (--recompute selective) or seco with --chunk 4096";
    else
      r.advice = "use --schedule seco with --chunk 4096 (activations O(chunk) instead of O(T))";
    // bf16 full-parameter training on the device can also drop the blocks' resident compute copy.
    if (!o.cast_layers && can_cast_layers(dtype, lora, optimizer_offload) && !device.is_cpu() &&
        budget.zero3_ranks == 0) {
      const size_t block_bytes = LayerCast::slot_bytes_for(cf, dtype);
      r.advice += fmt::format("; --cast-layers frees {:.1f} GiB of resident bf16 block weights",
                              double((size_t(L) - LayerCast::kSlots) * block_bytes) / kGiB);
    }
  }
  return r;
}

std::string budget_text(const MemoryBudget& b) {
  return b.host_gib > 0 ? fmt::format("{:.1f} GiB of device and {:.0f}% of {:.1f} GiB of host memory", b.device_gib,
                                      100 * kPinnableHostShare, b.host_gib)
                        : fmt::format("{:.1f} GiB", b.device_gib);
}

double device_gib_or_gpu(double gib) {
  if (gib > 0) return gib;
  const std::vector<GpuInfo> gpus = list_gpus();
  return gpus.empty() ? kDefaultDeviceGib : double(gpus.front().memory_bytes) / kGiB;
}

double host_gib_or_machine(double gib) {
  if (gib > 0) return gib;
  if (list_gpus().empty()) return 0;
  return double(host_memory_available()) / kGiB;
}

size_t pool_limit_for(double gib, const char* option) {
  const double bytes = gib * kGiB - double(kCudaContextBytes);
  if (!(bytes > 0))
    fail(fmt::format("{} = {} GiB is less than the CUDA context's {} MiB", option, gib, kCudaContextBytes >> 20),
         "give the GiB the run may use, e.g. --device-memory 24");
  return static_cast<size_t>(bytes);
}

}  // namespace cw
