// `chunkwise plan`: the planner's report of one step (tools/planner/planner.h) as a table and JSON,
// and the command that prints it.
#include "tools/plan.h"

#include "engine/engine.h"
#include "engine/error.h"
#include "engine/memory.h"
#include "engine/residency.h"
#include "model/shard.h"
#include "optim/options.h"
#include "tools/bench_model.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <ostream>

namespace cw {

namespace {
constexpr double kGiB = double(size_t(1) << 30);
}  // namespace

std::string plan_table(const PlanReport& r) {
  std::string s = fmt::format("plan: {} x {} tokens, {}\n", r.B, r.T, r.schedule);
  s += fmt::format("  {:14} {:>10}\n", "device", "GiB");
  for (const auto& [name, bytes] : r.device) s += fmt::format("  {:14} {:10.2f}\n", name, double(bytes) / kGiB);
  s += fmt::format("  {:14} {:10.2f}   (the caching pool's peak: `chunkwise bench` peak_gib)\n", "peak",
                   r.peak_device_gib());
  s += fmt::format("  {:14} {:10.2f}   (outside the pool)\n", "cuda context", double(r.context_bytes) / kGiB);
  s += fmt::format("  {:14} {:10.2f}   (of activations: the largest attention backward's, cuDNN's GQA staging)\n",
                   "attn workspace", double(r.attention_workspace_bytes) / kGiB);
  if (!r.host.empty()) {
    s += fmt::format("  {:14} {:>10}\n", "host", "GiB");
    for (const auto& [name, bytes] : r.host) s += fmt::format("  {:14} {:10.2f}\n", name, double(bytes) / kGiB);
    s += fmt::format("  {:14} {:10.2f}\n", "peak", r.peak_host_gib());
  }
  s += fmt::format("  {:14} {:>10}\n", "time", "s");
  for (const auto& [name, sec] : r.time) s += fmt::format("  {:14} {:10.3f}\n", name, sec);
  if (r.kv_moved_bytes > 0)
    s += fmt::format("  {:14} {:10.1f}   GiB of K/V moved host <-> device a step\n", "kv moved", r.kv_moved_bytes / kGiB);
  s += fmt::format("  {:14} {:10.3f}   ({:.0f} tokens/s, {:.1f} TFLOP executed)\n", "step", r.step_s,
                   r.tokens_per_s(), r.flops / 1e12);
  const std::string host = r.host_gib > 0 ? fmt::format(" and {:.0f}% of {:.1f} GiB of host memory", 100 * kPinnableHostShare, r.host_gib) : "";
  s += fmt::format("{} in {:.1f} GiB of device memory{}{}\n", r.fits ? "fits" : "DOES NOT FIT", r.device_gib, host,
                   r.fits ? "" : fmt::format(" ({} over): {}", r.device_fits ? "host" : "device", r.advice));
  return s;
}

std::string plan_json(const PlanReport& r) {
  nlohmann::json j;
  j["schedule"] = r.schedule;
  j["batch"] = r.B;
  j["seq"] = r.T;
  j["chunk"] = r.chunk;
  j["bwd_chunk"] = r.bwd_chunk;
  j["offload_window"] = r.offload_window;
  j["peak_device_gib"] = r.peak_device_gib();
  j["peak_host_gib"] = r.peak_host_gib();
  j["cuda_context_gib"] = double(r.context_bytes) / kGiB;
  j["step_s"] = r.step_s;
  j["kv_moved_gib"] = r.kv_moved_bytes / kGiB;
  j["attention_workspace_gib"] = double(r.attention_workspace_bytes) / kGiB;
  j["tokens_per_s"] = r.tokens_per_s();
  j["flops"] = r.flops;
  if (r.cp > 1) {
    j["cp"] = r.cp;
    j["cp_all_to_alls"] = r.cp_all_to_alls;
    j["cp_exchange_gib"] = r.cp_exchange_bytes / kGiB;
    j["cp_all_reduce_gib"] = r.cp_all_reduce_bytes / kGiB;
  }
  j["device_memory_gib"] = r.device_gib;
  j["host_memory_gib"] = r.host_gib;
  j["fits"] = r.fits;
  j["device_fits"] = r.device_fits;
  j["host_fits"] = r.host_fits;
  if (!r.fits) j["advice"] = r.advice;
  for (const auto& [name, bytes] : r.device) j["categories"]["device"][name] = double(bytes) / kGiB;
  for (const auto& [name, bytes] : r.host) j["categories"]["host"][name] = double(bytes) / kGiB;
  for (const auto& [name, sec] : r.time) j["categories"]["time_s"][name] = sec;
  return j.dump(2);
}

std::string zero3_table(const Zero3Plan& z, const PlanOptions& po) {
  // Ring collectives: each GPU sends and receives (n - 1) / n of an all-gather's output (and of a
  // reduce-scatter's input) over its link.
  const double n = static_cast<double>(po.dp), bus = (n - 1) / n;
  const double gathered = double(z.gathered_bytes) * bus, scattered = double(z.scattered_bytes) * bus;
  std::string s = fmt::format("zero 3 over {} ranks: per step {} block all-gathers ({} blocks reused from their "
                              "buffer), {} of the outside unit; {} block and {} outside reduce-scatters\n",
                              po.dp, z.block_gathers, z.reuses, z.outside_gathers, z.block_reduce_scatters,
                              z.outside_reduce_scatters);
  s += fmt::format("  all-gathers    {:10.2f} GiB out, {:.2f} GiB over each GPU's link\n", z.gathered_bytes / kGiB,
                   gathered / kGiB);
  s += fmt::format("  reduce-scatter {:10.2f} GiB in, {:.2f} GiB over each GPU's link\n", z.scattered_bytes / kGiB,
                   scattered / kGiB);
  for (const auto& [name, gbps] : {std::pair<const char*, double>{"NVLink", po.nvlink_gbps}, {"network", po.network_gbps}})
    s += fmt::format("  at {} {:.0f} GB/s: {:.3f} s of collectives a step (overlapped with compute on NCCL)\n", name,
                     gbps, (gathered + scattered) / (gbps * 1e9));
  return s;
}

std::string context_parallel_table(const PlanReport& r, const PlanOptions& po) {
  std::string s = fmt::format("context parallel over {} ranks: per step {} all-to-alls (tokens to heads and back), "
                              "and one all-reduce of the gradient\n",
                              r.cp, r.cp_all_to_alls);
  s += fmt::format("  all-to-alls    {:10.2f} GiB out of each GPU\n", r.cp_exchange_bytes / kGiB);
  s += fmt::format("  all-reduce     {:10.2f} GiB over each GPU's link\n", r.cp_all_reduce_bytes / kGiB);
  for (const auto& [name, gbps] : {std::pair<const char*, double>{"NVLink", po.nvlink_gbps}, {"network", po.network_gbps}})
    s += fmt::format("  at {} {:.0f} GB/s: {:.3f} s of collectives a step (the exchanges wait on the compute stream: "
                     "not overlapped)\n",
                     name, gbps, (r.cp_exchange_bytes + r.cp_all_reduce_bytes) / (gbps * 1e9));
  return s;
}

int run_plan(const PlanOptions& po, std::ostream& out) {
  if (po.cp > 1 && (po.tp > 1 || po.zero == 3))
    fail("plan --cp: context parallelism with --tp or --zero 3 is not implemented", "plan --cp alone");
  if (po.zero == 3 && po.tp > 1)
    fail("plan --zero 3 plans data parallelism with sharded parameters: not with --tp", "drop --tp, or plan --zero 0");
  if (po.zero == 3 && po.lora.enabled() && po.optimizer_offload)
    fail("plan --zero 3 --lora-rank: the adapters' optimizer stays on the device under ZeRO 3",
         "drop --optimizer-offload");
  if (po.zero == 3 && po.dp < 2) fail("plan --zero 3 needs --dp N >= 2 ranks to shard over", "give --dp");
  // With tensor parallelism each GPU holds a Llama of 1/tp of the heads, K/V heads and FFN columns
  // (model/shard.h, as train plans a rank): its plan is the per-GPU plan. The collectives' time is not
  // in the step time.
  const LlamaConfig cf = po.tp > 1 ? tp_shard_config(LlamaConfig::resolve(po.model), po.tp) : LlamaConfig::resolve(po.model);
  if (po.tp > 1)
    out << fmt::format("tensor parallel: one GPU of {} (1/{} of the heads, K/V heads and FFN; embeddings and norms "
                       "whole; collectives not timed)\n",
                       po.tp, po.tp);
  if (cf.has_sliding_window())
    out << fmt::format("sliding window: {} keys a query{}, attention planned over the window (W T pairs, not T^2/2); "
                       "on the GPU our flash kernels honour it (cuDNN does not; docs/model_families.md)\n",
                       cf.sliding_window, cf.sliding_layers.empty() ? "" : " on the sliding layers");
  const DType dtype = parse_dtype(po.dtype);
  validate_lora(po.lora);
  // Under ZeRO 3 every plan below (auto's candidates, --longest's lengths) is one rank's.
  MemoryBudget gib(device_gib_or_gpu(po.device_memory_gib), host_gib_or_machine(po.host_memory_gib),
                   po.zero == 3 ? static_cast<int>(po.dp) : 0);
  gib.cp_ranks = static_cast<int>(po.cp);  // every plan below is one context-parallel rank's
  if (po.cp > 1)
    out << fmt::format("context parallel: one GPU of {} (1/{} of every chunk's tokens, 1/{} of the heads and its "
                       "share of the K/V heads; the whole model)\n",
                       po.cp, po.cp, po.cp);
  int64_t T = po.seq;
  ScheduleOptions o;
  std::vector<AutoCandidate> weighed;
  if (po.longest) {
    const LongestPlan l = longest_sequence(cf, po.batch, po.schedule, dtype, gib, po.lora, po.optimizer_offload);
    if (l.T == 0)
      fail(fmt::format("plan --longest: not even {} tokens fit in {}", l.granule, budget_text(gib)),
           "lower --batch or --chunk, use --stream-kv or --offload-window auto, or offload the optimizer");
    out << fmt::format("longest: {} tokens fit ({} more do not), planned below\n", l.T, l.granule);
    T = l.T;
    o = l.schedule;
  } else {
    o = resolve_auto_schedule(cf, po.batch, T, po.schedule, dtype, gib, po.lora, po.optimizer_offload,
                              po.explain ? &weighed : nullptr);
  }
  const std::vector<std::vector<int64_t>> documents =
      po.documents.empty() ? std::vector<std::vector<int64_t>>{} : bench_document_starts(po.documents, po.batch, T, 2000);
  if (!documents.empty())
    out << fmt::format("documents: {} ({} in the first sequence); attention planned over their causal squares\n",
                       po.documents, documents[0].size());
  PlanReport r = plan_step(cf, po.batch, T, o, dtype, gib, po.lora, po.optimizer_offload, documents);
  if (po.zero == 3)  // the plan is the rank's already (the budget's zero3_ranks); its collectives:
    out << zero3_table(plan_zero3(cf, T, o, dtype, static_cast<int>(po.dp), po.optimizer_offload, Device::gpu(0),
                                  po.lora),
                       po);
  if (po.cp > 1) out << context_parallel_table(r, po);
  out << plan_table(r);
  if (arena_log())
    for (const std::string& line : r.arena_blocks) out << "replay: " << line << "\n";
  if (!weighed.empty()) {
    // What auto compared: per recompute mode and saved outputs, each place of the K/V store with its
    // fastest chunk. The fastest that fits wins; one costing more memory or recompute, or offloading
    // more, must be 1% faster than the one before it.
    size_t width = 0;
    for (const AutoCandidate& c : weighed) width = std::max(width, describe_schedule(c.schedule).size());
    out << "auto weighed (each place of the K/V store with its fastest chunk; * chosen):\n";
    out << fmt::format("    {:<{}} {:>12} {:>12} {:>10}\n", "settings", width, "device GiB", "host GiB", "step s");
    for (const AutoCandidate& c : weighed)
      out << fmt::format("  {} {:<{}} {:>12.2f} {:>12} {:>10.3f}{}\n", c.chosen ? "*" : " ",
                         describe_schedule(c.schedule), width, c.peak_device_gib,
                         c.peak_host_gib > 0 ? fmt::format("{:.2f}", c.peak_host_gib) : "-", c.step_s,
                         c.fits ? "" : "  (does not fit)");
  }
  if (!po.json.empty()) {
    std::ofstream f(po.json);
    CW_CHECK_HINT(f.good(), "check the --json path", "plan: cannot write {}", po.json);
    f << plan_json(r) << "\n";
  }
  return r.fits ? 0 : 1;
}

}  // namespace cw
