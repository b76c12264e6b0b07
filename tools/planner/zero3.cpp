// ZeRO 3's share of a plan (planner.h plan_zero3): the collectives of one step and the rank's memory.
#include "engine/engine.h"
#include "engine/residency.h"
#include "optim/adamw_offload.h"
#include "parallel/zero3.h"
#include "parallel/zero3_layout.h"
#include "tools/planner/planner.h"

#include <fmt/format.h>

#include <algorithm>

namespace cw {

namespace {
// The passes a step runs over the blocks, in order (model/llama.h): a forward that keeps nothing (a
// prefill chunk: it gathers the outside unit and releases it), a forward that keeps activations for
// the backward that follows (the two share one gather of the outside unit), a backward.
enum class Pass { prefill, recompute, backward };

std::vector<Pass> block_passes(const ScheduleOptions& o, int64_t T) {
  if (!o.chunked()) return {Pass::recompute, Pass::backward};  // full, checkpointed: one chunk of all T
  const int64_t c = o.chunk > 0 ? std::min(o.chunk, T) : T;
  const int64_t bc = o.bwd_chunk > 0 ? std::min(o.bwd_chunk, T) : c;
  const int64_t reverse = (T + bc - 1) / bc;  // the reverse sweep's chunks
  const int64_t visited = o.kind == ScheduleKind::spaco && o.keep > 0 ? std::min(o.keep, reverse) : reverse;
  // seco's prefill stops where its last reverse chunk starts unless it saves inputs; spaco's runs all T
  // (optim/seco.cpp, optim/spaco.cpp).
  const int64_t prefill_end = o.kind == ScheduleKind::seco && !o.save_inputs ? (reverse - 1) * bc : T;
  std::vector<Pass> passes(static_cast<size_t>((prefill_end + c - 1) / c), Pass::prefill);
  for (int64_t i = 0; i < visited; ++i) {
    if (!o.save_inputs) passes.push_back(Pass::recompute);  // with saved inputs a backward alone
    passes.push_back(Pass::backward);
  }
  return passes;
}
}  // namespace

Zero3Plan plan_zero3(const LlamaConfig& config, int64_t T, const ScheduleOptions& o, DType dtype, int ranks,
                     bool optimizer_offload, Device device, const LoraConfig& lora) {
  const ShardLayout layout(parameter_table(config), ranks);
  const int64_t L = layout.layers(), held = std::min<int64_t>(L, ShardedParameters::kBlockSlots);
  const size_t e = dtype_size(dtype), acc = dtype_size(accum_dtype(dtype));
  Zero3Plan p;
  p.frozen = lora.enabled();
  const std::vector<Pass> passes = block_passes(o, T);
  for (size_t i = 0; i < passes.size(); ++i) {
    // A pass opposite to the pass before it starts with the blocks that pass ended with; one in the
    // same direction finds them only when they are all the blocks. The step's first pass finds none:
    // the optimizer step changed every block, unless the base is frozen (LoRA), when it finds those
    // the previous step's last backward ended with (a step, after the first, as the planner counts).
    const bool forward = passes[i] != Pass::backward;
    const int64_t reused = i == 0                                               ? (p.frozen ? held : 0)
                           : forward != (passes[i - 1] != Pass::backward) ? held
                                                                          : (L <= held ? L : 0);
    p.block_gathers += L - reused;
    p.reuses += reused;
    if (passes[i] != Pass::recompute) ++p.outside_gathers;  // a recompute's gather is its backward's
    if (!forward && !p.frozen) {
      p.block_reduce_scatters += L;
      ++p.outside_reduce_scatters;
    }
  }
  const int64_t block = layout.largest_block_part() * ranks, outside = layout.outside().part * ranks;
  p.gathered_bytes = (p.block_gathers * block + p.outside_gathers * outside) * static_cast<int64_t>(e);
  p.scattered_bytes = (p.block_reduce_scatters * block + p.outside_reduce_scatters * outside) * static_cast<int64_t>(acc);
  for (int r = 0; r < ranks; ++r)
    p.largest_shard_elements = std::max(p.largest_shard_elements, static_cast<size_t>(layout.shard_numel(r)));
  const size_t shard = p.largest_shard_elements;
  const size_t master = shard * acc, moments = 2 * shard * acc, grads = shard * acc;
  const size_t slots = ShardedParameters::kBlockSlots;
  p.gathered_buffer_bytes = (slots * static_cast<size_t>(block) + static_cast<size_t>(outside)) * e;
  if (p.frozen) {  // the base's shard in the compute dtype; the adapters' copy beside it
    p.shard_bytes = shard * e;
    p.adapter_bytes = static_cast<size_t>(lora_parameter_count(config, lora)) * e;
    return p;
  }
  if (optimizer_offload) {  // the optimizer offload of one process, on the shard (optim/adamw_offload.h)
    const DType state = accum_dtype(dtype);
    p.host_shard_bytes = master + moments;
    p.shard_bytes = grads + shard * e;  // the gradient and the compute copy the gathers read
    if (OffloadedAdamW::streams(device, state))
      p.shard_bytes += OffloadedAdamW::device_staging_bytes_for(static_cast<int64_t>(shard), state);
    else
      p.host_shard_bytes += OffloadedAdamW::staging_bytes_for(static_cast<int64_t>(shard), state, dtype);
  } else {
    p.shard_bytes = master + moments + grads;
  }
  p.gradient_buffer_bytes = (slots * static_cast<size_t>(block + block / ranks) +
                             static_cast<size_t>(outside + outside / ranks)) * acc;
  return p;
}

void apply_zero3(PlanReport& r, const Zero3Plan& z, const MemoryBudget& budget, Device device) {
  // Under LoRA the master, moments and gradient are the adapters' and stay; the weights go either way.
  const auto whole = [&](const std::string& name) {
    return name == "weights" ||
           (!z.frozen && (name == "master" || name == "optimizer" || name == "gradients" || name == "staging"));
  };
  const auto drop = [&](std::vector<std::pair<std::string, size_t>>& list) {
    list.erase(std::remove_if(list.begin(), list.end(), [&](const auto& c) { return whole(c.first); }), list.end());
  };
  drop(r.device);
  drop(r.host);
  const auto pool = [&](size_t bytes) { return device.is_cpu() ? bytes : device_pool_block(bytes); };
  if (z.frozen)
    r.device.insert(r.device.begin(), {{"shard", pool(z.shard_bytes)},
                                       {"gathered", pool(z.gathered_buffer_bytes)},
                                       {"adapters", pool(z.adapter_bytes)}});
  else
    r.device.insert(r.device.begin(), {{"shard", pool(z.shard_bytes)},
                                       {"gathered", pool(z.gathered_buffer_bytes)},
                                       {"grad buffers", pool(z.gradient_buffer_bytes)}});
  if (z.host_shard_bytes > 0) r.host.insert(r.host.begin(), {"shard", z.host_shard_bytes});
  r.peak_device_bytes = 0;
  r.peak_host_bytes = 0;
  for (const auto& [name, bytes] : r.device) r.peak_device_bytes += bytes;
  for (const auto& [name, bytes] : r.host) r.peak_host_bytes += bytes;
  r.device_fits = double(r.peak_device_bytes + r.context_bytes) <= budget.device_gib * double(size_t(1) << 30);
  r.host_fits = budget.host_gib <= 0 ||
                double(r.peak_host_bytes) <= kPinnableHostShare * budget.host_gib * double(size_t(1) << 30);
  r.fits = r.device_fits && r.host_fits;
  r.schedule += fmt::format(" zero 3");
}

}  // namespace cw
