#include "tools/bench_model.h"

#include "chunkwise_config.h"
#include "engine/engine.h"
#include "engine/ops/attention.h"
#include "engine/ops/linear.h"
#include "engine/random.h"
#include "engine/residency.h"
#include "engine/trace.h"
#include "optim/options.h"
#include "optim/schedule.h"
#include "optim/training.h"
#include "tools/planner/planner.h"
#include "tools/progress.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <optional>
#include <ostream>
#include <vector>

#include <unistd.h>

namespace cw {

namespace {

// The bf16 GEMM rate of this GPU through our own cuBLASLt path: 8192^3, median of 10 (TFLOP/s).
double measure_bf16_peak(Device g) {
  const int64_t n = 8192;
  double ms = 0;
  {
    OwnedTensor host(DType::f32, {n, n});
    fill_normal(host, 5, 0, 0.0, 1.0);
    OwnedTensor a = OwnedTensor::on(g, DType::bf16, {n, n}), b = OwnedTensor::on(g, DType::bf16, {n, n});
    OwnedTensor c = OwnedTensor::on(g, DType::bf16, {n, n});
    copy_convert(a, host);
    copy_convert(b, host);
    ms = median_ms([&] { linear_forward(c, a, b); }, g, 3, 10);
  }
  release_cached(g);
  return 2.0 * double(n) * double(n) * double(n) / (ms * 1e-3) / 1e12;
}

// LoRA: the frozen base's weight gradients are not computed, so its matmuls cost 4 flops per
// parameter and token (forward, d_x) instead of 6; the adapters' own products (2 r (in + out) per
// linear and token, three passes) are added. `backward_fraction` (spaco: t/k of the chunks
// backpropagated) scales the backward's share: every token runs forward (2 per parameter, a third
// of the attention's), the visited fraction backward (the rest).
double flops_per_token(const LlamaConfig& c, double T, const LoraConfig& lora, double backward_fraction = 1.0) {
  const double C = double(c.hidden_size), F = double(c.intermediate_size);
  const double per_layer = C * double(c.q_dim()) * 2 + C * double(c.kv_dim()) * 2 + 3 * C * F;
  const double matmul_params = per_layer * double(c.num_hidden_layers) + double(c.vocab_size) * C;
  const double attention = 12.0 * double(c.num_hidden_layers) * double(c.num_attention_heads) * double(c.head_dim) *
                           T / 2.0;
  const double adapters = lora.enabled() ? double(lora_parameter_count(c, lora)) : 0.0;
  const double forward = 2.0 * matmul_params + 2.0 * adapters + attention / 3.0;
  const double backward = (lora.enabled() ? 2.0 : 4.0) * matmul_params + 4.0 * adapters + attention * 2.0 / 3.0;
  return forward + backward_fraction * backward;
}

// The mean over tokens of the keys a query attends, times two: T for one causal sequence, the sum of
// the documents' squared lengths over T when packed (what flops_per_token's attention term takes).
// Under a sliding window of W keys (0: none) a document of n tokens counts n^2 - (n - W)^2 for
// n > W: its queries past the first W see W keys each, not all before them.
double attention_extent(const std::vector<std::vector<int64_t>>& starts, int64_t T, int64_t window) {
  const auto squares_of = [window](double n) {
    const double past = window > 0 && n > double(window) ? n - double(window) : 0.0;
    return n * n - past * past;
  };
  if (starts.empty()) return squares_of(static_cast<double>(T)) / static_cast<double>(T);
  double squares = 0;
  for (const auto& row : starts)
    for (size_t i = 0; i < row.size(); ++i)
      squares += squares_of(static_cast<double>((i + 1 < row.size() ? row[i + 1] : T) - row[i]));
  return squares / static_cast<double>(T * static_cast<int64_t>(starts.size()));
}

void write_result(const std::string& path, const nlohmann::json& r) {
  if (path.empty()) return;
  std::ofstream f(path);
  if (!f) fail(fmt::format("bench: cannot write '{}'", path), "check the directory exists and is writable");
  f << r.dump(2) << "\n";
}

bool is_out_of_memory(const std::string& what) {
  return what.find("out of memory") != std::string::npos || what.find("cannot allocate") != std::string::npos;
}

nlohmann::json census_json(const std::vector<AttentionCensusEntry>& census) {
  nlohmann::json j = nlohmann::json::array();
  for (const AttentionCensusEntry& e : census)
    j.push_back({{"direction", e.backward ? "backward" : "forward"}, {"kernel", attention_kernel_name(e.kernel)},
                 {"calls", e.calls}, {"tflop", e.flops / 1e12}, {"reason", e.reason}});
  return j;
}

// The part of a step's attention (by flops) that ran off cuDNN on the GPU, for its line; empty when none.
std::string off_cudnn_note(const std::vector<AttentionCensusEntry>& census) {
  double total = 0, off = 0;
  int64_t calls = 0;
  for (const AttentionCensusEntry& e : census) {
    total += e.flops;
    if (e.kernel != AttentionKernel::cudnn && e.kernel != AttentionKernel::cpu) off += e.flops, calls += e.calls;
  }
  return off > 0 ? fmt::format(", {} attention calls ({:.1f}% of its flops) off cuDNN", calls, 100 * off / total) : "";
}

}  // namespace

std::vector<std::vector<int64_t>> bench_document_starts(const std::string& spec, int64_t B, int64_t T, uint64_t seed) {
  int64_t lo = 0, hi = 0;
  const size_t colon = spec.find(':');
  try {
    size_t used = 0;
    lo = std::stoll(spec.substr(0, colon), &used);
    if (used != (colon == std::string::npos ? spec.size() : colon)) throw std::invalid_argument(spec);
    hi = lo;
    if (colon != std::string::npos) {
      hi = std::stoll(spec.substr(colon + 1), &used);
      if (used != spec.size() - colon - 1) throw std::invalid_argument(spec);
    }
  } catch (const std::logic_error&) {
    fail(fmt::format("bench --documents '{}' is not a length or a range LO:HI", spec),
         "give e.g. --documents 8192 (documents of 8192 tokens) or --documents 512:8192 (lengths drawn in that range)");
  }
  if (lo < 1 || hi < lo)
    fail(fmt::format("bench --documents '{}': lengths must be at least 1 and LO <= HI", spec),
         "give e.g. --documents 512:8192");
  Rng rng(seed);
  std::vector<std::vector<int64_t>> starts(static_cast<size_t>(B));
  for (auto& row : starts)
    for (int64_t at = 0; at < T; at += lo + static_cast<int64_t>(rng.below(static_cast<uint64_t>(hi - lo + 1))))
      row.push_back(at);
  return starts;
}

int run_bench_model(const BenchModelOptions& o, std::ostream& out) {
  if (!gpu_available()) fail("bench needs a GPU", "run it on the GPU machine (tools/gpu-check)");
  const Device g = Device::gpu(0);
  const LlamaConfig cfg = LlamaConfig::resolve(o.model);
  const DType dt = parse_dtype(o.dtype);
  if (dt != DType::bf16 && dt != DType::f32) fail(fmt::format("bench --dtype {}: use bf16 or f32", o.dtype));
  CW_CHECK(o.steps >= 1 && o.warmup >= 0, "bench needs --steps >= 1 and --warmup >= 0");

  validate_lora(o.lora);
  // The device memory the run may use, and the schedule the planner picks where asked (auto).
  const double gib = device_gib_or_gpu(o.device_memory_gib);
  const MemoryBudget budget(gib, host_gib_or_machine(o.host_memory_gib));
  ScheduleOptions so = o.schedule;
  try {
    so = resolve_auto_schedule(cfg, o.batch, o.seq, so, dt, budget, o.lora, o.optimizer_offload);
  } catch (const Error& e) {  // auto found nothing that fits: a result, as running out of memory is
    const std::string status = is_out_of_memory(e.what()) ? "oom" : "error";
    const nlohmann::json r = {{"impl", "chunkwise"}, {"model", o.model}, {"seq", o.seq}, {"batch", o.batch},
                              {"schedule", schedule_name(so.kind)}, {"status", status}, {"error", e.what()}};
    out << "bench: " << status << ": " << e.what() << "\n";
    write_result(o.json, r);
    return status == "oom" ? 0 : 1;
  }
  so.validate();
  const auto documents_of_step = [&](int s) {
    return o.documents.empty() ? std::vector<std::vector<int64_t>>{}
                               : bench_document_starts(o.documents, o.batch, o.seq, 2000 + static_cast<uint64_t>(s));
  };
  const PlanReport plan =
      plan_step(cfg, o.batch, o.seq, so, dt, budget, o.lora, o.optimizer_offload, documents_of_step(o.warmup));
  out << fmt::format("plan: {}: peak {:.2f} GiB of {:.1f} on the device, {:.2f} GiB host, {:.2f} s a step predicted\n",
                     plan.schedule, plan.peak_device_gib(), gib, plan.peak_host_gib(), plan.step_s);
  // CW_ARENA_LOG=1: the plan's arena blocks here, the run's own on stderr as the arena adds them.
  if (arena_log())
    for (const std::string& line : plan.arena_blocks) out << "plan's replay: " << line << "\n";
  // The plan counts cuDNN's backward workspace for its largest call: let every call have it.
  raise_attention_workspace_budget(g, static_cast<int64_t>(plan.attention_workspace_bytes));
  std::optional<DeviceMemoryLimitScope> limit;
  if (o.device_memory_gib > 0) limit.emplace(g, pool_limit_for(o.device_memory_gib, "bench --device-memory"));

  nlohmann::json r = {{"impl", "chunkwise"}, {"model", o.model}, {"seq", o.seq}, {"batch", o.batch},
                      {"schedule", schedule_name(so.kind)}, {"recompute", recompute_name(so.recompute)}, {"chunk", so.chunk},
                      {"bwd_chunk", so.bwd_chunk}, {"mlp_shards", so.mlp_shards}, {"offload", so.offload},
                      {"offload_window", so.offload_window}, {"stream_kv", so.stream_kv}, {"save_attention", so.save_attention},
                      {"save_inputs", so.save_inputs}, {"cast_layers", so.cast_layers},
                      {"keep", so.keep}, {"dtype", o.dtype},
                      {"device", device_name(g)}};
  if (o.lora.enabled())
    r["lora"] = {{"rank", o.lora.rank}, {"alpha", o.lora.alpha}, {"dropout", o.lora.dropout},
                 {"targets", o.lora.target_names()}};
  r["optimizer_offload"] = o.optimizer_offload;
  r["device_memory_gib"] = gib;
  r["plan"] = {{"settings", plan.schedule}, {"peak_device_gib", plan.peak_device_gib()},
               {"peak_host_gib", plan.peak_host_gib()}, {"step_s", plan.step_s}, {"fits", plan.fits}};
#if CW_HAVE_CUDA
  set_deterministic(o.deterministic);
  r["attention"] = attention_kernel_name(attention_kernel());
  r["deterministic"] = deterministic();
#endif
  const double peak = o.peak_tflops > 0 ? o.peak_tflops : measure_bf16_peak(g);
  // The layers' mean extent: each within its own sliding window (Gemma 2's global layers have none).
  double extent = 0;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l)
    extent += attention_extent(documents_of_step(o.warmup), o.seq, cfg.layer_window(l));
  extent /= static_cast<double>(cfg.num_hidden_layers);
  const double fpt = flops_per_token(cfg, extent, o.lora);
  if (!o.documents.empty()) r["documents"] = o.documents;
  r["peak_tflops"] = peak;
  r["flops_per_token"] = fpt;
  std::vector<double> step_s;
  nlohmann::json plan_steps = nlohmann::json::array();  // per step: attention plans built and their build seconds
  std::vector<double> copy_waits;  // per step: seconds the compute stream waited for host <-> device copies
  nlohmann::json census_steps = nlohmann::json::array();  // per step: which kernel took the attention calls
  std::vector<AttentionCensusEntry> census;                // the last step's
  try {
    AdamWOptions ao;
    if (!plan.host_fits && !o.force)
      fail(fmt::format("the plan says this step runs out of memory on the host: {:.2f} GiB pinned (K/V store, saved "
                       "outputs, offloaded optimizer) and {:.0f}% of the host's {:.2f} GiB available may be pinned",
                       plan.peak_host_gib(), 100 * kPinnableHostShare, plan.host_gib),
           plan.advice + "; or pass --force to run it anyway");
    if (!plan.device_fits && !o.force)
      fail(fmt::format("the plan says this step runs out of memory: its peak of {:.2f} GiB and the CUDA context do "
                       "not fit {:.1f} GiB of device memory",
                       plan.peak_device_gib(), gib),
           plan.advice + "; or pass --force to run it anyway");
    TrainingState st(cfg, dt, g, ao,
                     {.lora = o.lora, .offload_optimizer = o.optimizer_offload, .cast_layers = so.cast_layers});
    st.init_tiled(1, cfg.initializer_range);
    auto schedule = Schedule::create(so);
    // A step of minutes shows its chunks as it goes (a log: a line every 30 s after the first 10).
    StepProgress progress(out, &out == &std::cout && isatty(STDOUT_FILENO));
    progress.attach(*schedule);
    StepStats stats;
    for (int s = 0; s < o.warmup + o.steps; ++s) {
      Batch batch = random_batch(o.batch, o.seq, cfg.vocab_size, 1000 + static_cast<uint64_t>(s));
      if (!o.documents.empty()) set_documents(batch, documents_of_step(s));
      synchronize(g);
      const bool traced = !o.trace.empty() && s + 1 == o.warmup + o.steps;
      if (traced) trace::start(g);
      const AttentionPlanStats plans0 = attention_plan_stats();
      reset_attention_census();
      take_copy_wait_seconds(g);  // counts from here
      const bool timed = s >= o.warmup;
      if (timed) profiler_range(g, true);  // a profiler's range: the timed steps (tools/kernel_profile)
      const auto t0 = std::chrono::steady_clock::now();
      st.grads().zero();
      progress.start(s + 1);
      stats = schedule->step(st.model(), batch, st.grads());
      progress.finish();
      clip_grad_norm(st.grads(), 1.0);
      st.optimizer_step(1e-5);
      synchronize(g);
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (timed) profiler_range(g, false);
      const double copy_wait_s = take_copy_wait_seconds(g);
      if (traced) trace::stop().write(o.trace);
      const AttentionPlanStats plans1 = attention_plan_stats();
      const int64_t built = plans1.built - plans0.built, refused = plans1.refused - plans0.refused,
                    ahead = plans1.built_ahead - plans0.built_ahead, stood_in = plans1.stood_in - plans0.stood_in,
                    split = plans1.split - plans0.split;
      const double plan_s = plans1.seconds - plans0.seconds, waited_s = plans1.waited_seconds - plans0.waited_seconds;
      plan_steps.push_back({{"built", built}, {"refused", refused}, {"built_ahead", ahead}, {"seconds", plan_s},
                            {"waited_seconds", waited_s}, {"stood_in", stood_in}, {"split", split}});
      census = attention_census();
      census_steps.push_back(census_json(census));
      copy_waits.push_back(copy_wait_s);
      // The first step builds the attention plans (cuDNN); what that cost is part of its time. Plans
      // built ahead cost the step only the time it waited for them.
      const std::string plan_note =
          built + refused > 0
              ? fmt::format(", attention plans: {} built{} in {:.2f} s of build time ({} ahead on {} threads, {:.2f} s "
                            "waited{})",
                            built, refused > 0 ? fmt::format(" ({} refused)", refused) : "", plan_s, ahead,
                            cudnn_plan_threads(), waited_s,
                            stood_in > 0 ? fmt::format(", {} calls on a shared plan meanwhile", stood_in) : "")
              : "";
      // Time the compute stream sat waiting for host <-> device copies: the offload's overhead.
      const std::string wait_note =
          copy_wait_s > 0 ? fmt::format(", waited {:.2f} s ({:.1f}%) for copies", copy_wait_s, 100 * copy_wait_s / sec) : "";
      // cuDNN calls that ran their earlier keys apart (engine.h, cudnn_split_prefix).
      const std::string split_note = split > 0 ? fmt::format(", {} cuDNN calls with the prefix apart", split) : "";
      out << fmt::format("step {}{}: {:.3f} s, loss {:.4f}{}{}{}{}\n", s + 1, s < o.warmup ? " (warm-up)" : "", sec,
                         stats.loss, wait_note, plan_note, split_note, off_cudnn_note(census))
          << std::flush;
      if (timed) step_s.push_back(sec);
    }
    const GemmTuneStats tuned = gemm_tune_stats();
    if (tuned.plans > 0)
      out << fmt::format("GEMM shapes tuned: {}; cuBLASLt's first answer was not the fastest for {} ({:.2f} ms against "
                         "{:.2f} ms, one call of each)\n",
                         tuned.plans, tuned.changed, tuned.first_ms, tuned.chosen_ms);
    r["gemm_tuning"] = {{"on", tuned.on}, {"plans", tuned.plans}, {"changed", tuned.changed},
                        {"first_ms", tuned.first_ms}, {"chosen_ms", tuned.chosen_ms}};
    const MemoryReport mem = memory_report(st, stats.activation_high_water, stats.kv_bytes);
    nlohmann::json mj;
    for (const auto& [name, bytes] : mem.categories()) mj[name] = bytes;
    if (st.optimizer_offloaded())
      mj["host"] = {{"master", mem.host_master}, {"optimizer", mem.host_optimizer}, {"staging", mem.host_staging}};
    r["memory"] = mj;
    r["chunks"] = stats.chunks;
    r["chunks_visited"] = stats.chunks_visited;
    r["kv_host_gib"] = double(stats.kv_host_bytes) / double(1ull << 30);
    r["kv_moved_gib_per_step"] = double(stats.kv_bytes_moved) / double(1ull << 30);
    if (stats.kv_host_bytes > 0)
      out << fmt::format("K/V store: {:.2f} GiB on the device, {:.2f} GiB in pinned host memory, {:.1f} GiB moved a step\n",
                         double(stats.kv_bytes) / double(1ull << 30), double(stats.kv_host_bytes) / double(1ull << 30),
                         double(stats.kv_bytes_moved) / double(1ull << 30));
    out << "memory: " << mem.line() << "\n";
    out << attention_census_text(census, fmt::format("in step {}", o.warmup + o.steps));
    if (!o.trace.empty()) out << "trace of step " << o.warmup + o.steps << ": " << o.trace << "\n";
    std::sort(step_s.begin(), step_s.end());
    const double med = step_s[step_s.size() / 2];
    // The planner against this run (tools/planner/planner.h: its peak within 10% of measured).
    const double peak_gib = double(mem.device_peak) / double(1ull << 30);
    out << fmt::format("against the plan: peak {:.2f} GiB measured, {:.2f} planned ({:+.1f}%); step {:.3f} s measured, "
                       "{:.3f} planned ({:+.1f}%)\n",
                       peak_gib, plan.peak_device_gib(), 100 * (plan.peak_device_gib() / peak_gib - 1), med,
                       plan.step_s, 100 * (plan.step_s / med - 1));
    const double tps = double(o.batch * o.seq) / med;
    r["status"] = "ok";
    r["step_s"] = med;
    r["step_times"] = step_s;
    r["attention_plans"] = plan_steps;
    r["attention_calls"] = census_steps;
    r["copy_wait_s"] = copy_waits;
    r["tokens_per_s"] = tps;
    // spaco: the model flops of the chunks it backpropagated (the last step's t of k).
    const double visited = stats.chunks > 0 ? double(stats.chunks_visited) / double(stats.chunks) : 1.0;
    const double fpt_done = visited < 1.0 ? flops_per_token(cfg, extent, o.lora, visited) : fpt;
    r["flops_per_token"] = fpt_done;
    r["mfu"] = tps * fpt_done / (peak * 1e12);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    r["status"] = is_out_of_memory(what) ? "oom" : "error";
    r["error"] = what;
    out << "bench: " << r["status"].get<std::string>() << ": " << what << "\n";
  }
  const PoolStats ps = pool_stats(g);
  r["peak_bytes"] = ps.peak_in_use;
  r["peak_gib"] = double(ps.peak_in_use) / double(1ull << 30);
  // What the driver counts as used at the end: the pool's blocks (in use and cached), the CUDA
  // context and what the libraries allocate themselves; with --device-memory, the figure to hold it to.
  const DeviceMemory dm = device_memory(g);
  r["device_held_gib"] = double(dm.total - dm.free) / double(1ull << 30);
  if (r["status"] == "ok")
    out << fmt::format("{} {} T={} B={}: {:.3f} s/step, {:.0f} tokens/s, MFU {:.1f}% of {:.0f} TFLOP/s, peak {:.2f} GiB "
                       "(the driver counts {:.2f} GiB held at the end)\n",
                       o.model, schedule_name(so.kind), o.seq, o.batch, r["step_s"].get<double>(), r["tokens_per_s"].get<double>(),
                       100 * r["mfu"].get<double>(), peak, r["peak_gib"].get<double>(),
                       r["device_held_gib"].get<double>());
  write_result(o.json, r);
  return r["status"] == "error" ? 1 : 0;
}

}  // namespace cw
