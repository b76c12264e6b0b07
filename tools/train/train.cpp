#include "tools/train/train.h"

#include "engine/random.h"
#include "engine/residency.h"
#include "engine/trace.h"
#include "model/checkpoint.h"
#include "model/lora.h"
#include "optim/adamw.h"
#include "optim/lr_schedule.h"
#include "optim/schedule.h"
#include "tools/progress.h"
#include "optim/training.h"
#include "parallel/context_parallel.h"
#include "parallel/data_parallel.h"
#include "parallel/grid.h"
#include "parallel/launch.h"
#include "parallel/tensor_parallel.h"
#include "parallel/zero3.h"
#include "chunkwise_config.h"
#include "engine/engine.h"
#include "engine/env.h"
#include "engine/ops/attention.h"
#include "tools/data/batches.h"
#include "tools/data/tokenizer.h"
#include "tools/data/tokens.h"
#include "tools/model_io.h"
#include "tools/planner/planner.h"
#include "tools/plot.h"
#include "tools/train/rank_weights.h"
#include "tools/train/run_dir.h"
#include "tools/train/sample.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <ostream>
#include <unistd.h>
#include <utility>

namespace cw {

namespace fs = std::filesystem;

namespace {
std::atomic<int> g_signals{0};

void on_signal(int) {
  if (g_signals.fetch_add(1) >= 1) _exit(128 + SIGINT);  // the second signal: leave at once
}

struct SignalGuard {
  struct sigaction old_int {}, old_term {};
  SignalGuard() {
    g_signals = 0;
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
  }
  ~SignalGuard() {
    sigaction(SIGINT, &old_int, nullptr);
    sigaction(SIGTERM, &old_term, nullptr);
  }
};

// `batch` with rows of token 0 and no labels appended up to `rows` rows: the loss and the supervised
// count are the batch's.
Batch with_unlabelled_rows(const Batch& batch, int64_t rows) {
  const int64_t T = batch.T();
  Batch padded{OwnedTensor(DType::i32, {rows, T}), OwnedTensor(DType::i32, {rows, T})};
  std::fill_n(padded.labels.tensor.ptr<int32_t>(), rows * T, -100);
  copy_convert(padded.ids.tensor.slice(0, 0, batch.B()), batch.ids);
  copy_convert(padded.labels.tensor.slice(0, 0, batch.B()), batch.labels);
  if (!batch.doc_starts.empty()) {  // each added row one document
    padded.doc_starts = batch.doc_starts;
    padded.doc_starts.resize(static_cast<size_t>(rows), {0});
    padded.document_positions = batch.document_positions;
  }
  return padded;
}

double rss_mib() {
  std::ifstream f("/proc/self/statm");
  long pages = 0, resident = 0;
  f >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1 << 20);
}

std::vector<std::string> resolve_demo(const std::vector<std::string>& specs) {
  std::vector<std::string> out;
  for (const auto& s : specs) out.push_back(s == "@demo" ? demo_data_path() : s);
  return out;
}

// ---- the steps of run_training, in order ----

// Where and how the run computes: the model's config, the device, the compute dtype, the adapters.
struct Placement {
  LlamaConfig model;
  Device device;
  DType dtype;
  LoraConfig lora;  // rank 0: full-parameter training
};

// The run's adapters: lora.*, or with model.adapter and lora.rank = 0 the adapter's own r, alpha,
// dropout and targets (lora.seed still seeds the dropout masks).
LoraConfig resolve_lora(const RunConfig& rc) {
  if (rc.model.adapter.empty() || rc.lora.enabled()) return rc.lora;
  LoraConfig file = read_peft_config(rc.model.adapter);
  file.seed = rc.lora.seed;
  return file;
}

Placement resolve_placement(const RunConfig& rc) {
  const Device device = resolve_device(rc.train.device, "train.device");
  const DType dtype = resolve_compute_dtype(rc.model.dtype, device, "model.dtype", "train.device");
#if CW_HAVE_CUDA
  if (!device.is_cpu()) set_deterministic(rc.train.deterministic);
#endif
  return {rc.model_config(), device, dtype, resolve_lora(rc)};
}

// Sizes no machine of this kind can hold, refused before anything is sized by them, whatever
// train.memory_check says (the planner's check in check_memory is the precise one; these are lower
// bounds). The step's micro-batches are built at once in host memory, ids and labels at least 4
// bytes each; a micro-batch keeps, in any schedule, at least each layer's K/V (seco, spaco) or
// input (full, checkpointed) for every token, in host or device memory.
void check_sizes_fit_machine(const RunConfig& rc, const Placement& p, const LlamaConfig& rank_model) {
  const double host = double(host_memory_total());
  if (host <= 0) return;
  const double device = p.device.is_cpu() ? 0.0 : double(device_memory(p.device).total);
  const double B = double(rc.data.batch_size), T = double(rc.data.seq_len), accum = double(rc.data.grad_accum);
  constexpr double kBatchBytesPerToken = 8;  // a 32-bit id and a 32-bit label
  const double batches = accum * B * T * kBatchBytesPerToken;
  if (batches > host)
    fail(fmt::format("data.grad_accum x data.batch_size x data.seq_len = {} x {} x {} tokens are built at once for a "
                     "step: at least {} of host memory, and this machine has {} in all",
                     rc.data.grad_accum, rc.data.batch_size, rc.data.seq_len, format_bytes(batches), format_bytes(host)),
         "lower data.grad_accum, data.batch_size or data.seq_len");
  const double per_layer = double(std::min(rank_model.hidden_size, 2 * rank_model.kv_dim()));
  const double kept = B * T * per_layer * double(rank_model.num_hidden_layers) * double(dtype_size(p.dtype));
  if (kept > host + device)
    fail(fmt::format("data.batch_size x data.seq_len = {} x {} tokens keep at least {} a micro-batch ({} values a "
                     "token in each of {} layers), and this machine has {} of host and device memory in all",
                     rc.data.batch_size, rc.data.seq_len, format_bytes(kept), per_layer, rank_model.num_hidden_layers,
                     format_bytes(host + device)),
         "lower data.batch_size or data.seq_len");
}

// The training state (weights, master weights, gradients, AdamW's moments; optim/training.h) against
// the device's and the host's memory, before the tokenizer, the data or the state is loaded: a model
// too large for the machine is refused naming model.source and what to change, not by the allocator.
// Ranks that are threads of this process (on the CPU) each hold a state. train.memory_check = false
// holds it to the memory the machine has in all instead of what is available.
void check_state_fits_machine(const RunConfig& rc, const Placement& p, const LlamaConfig& rank_model,
                              const Communicator* comm) {
  // ZeRO 3 holds no whole model: the planner's check (check_memory) counts the rank's shard and buffers.
  if (comm && rc.parallel.zero == 3) return;
  const bool zero = comm && rc.parallel.zero > 0;
  MemoryNeed need = TrainingState::memory_need(rank_model, p.dtype, p.device,
                                               {.full_optimizer = !zero,
                                                .lora = p.lora,
                                                .offload_optimizer = rc.optimizer.offload,
                                                .cast_layers = rc.schedule.cast_layers});
  const int64_t thread_ranks = comm && comm->device().is_cpu() ? comm->size() : 1;
  need.repeat(thread_ranks);
  std::vector<std::string> advice;
  if (!p.device.is_cpu() && !rc.optimizer.offload && !zero)
    advice.push_back("optimizer.offload = true (master weights and moments in host memory)");
  if (!p.lora.enabled()) advice.push_back("lora.rank = 8 (adapters trained, the base frozen)");
  if (!p.device.is_cpu())
    advice.push_back(rc.parallel.tp > 1 ? "a larger parallel.tp" : "parallel.tp = N (the model split over N GPUs)");
  advice.push_back("a smaller model or a machine with more memory");
  std::string hint = fmt::format("use {}", fmt::join(advice, ", "));
  if (rc.train.memory_check)
    hint += "; train.memory_check = false sets it against the memory the machine has in all instead";
  std::string task = fmt::format("to train in {}", dtype_name(p.dtype));
  if (thread_ranks > 1) task += fmt::format(" on {} thread ranks", thread_ranks);
  else if (rc.parallel.tp > 1) task += fmt::format(" (a 1/{} share on each rank)", rc.parallel.tp);
  require_memory(need, p.device,
                 {.model = fmt::format("model.source '{}'", rc.model.source),
                  .parameters = p.model.parameter_count(),
                  .task = task,
                  .advice = hint,
                  .against_total = !rc.train.memory_check});
}

struct TrainData {
  TokenDataset train;
  WindowSplit split;  // train and eval windows
};

// data.documents, data.positions, data.loss: what a batch takes from the data beside its ids.
BatchOptions batch_options(const RunConfig::Data& data) {
  return {.documents = data.documents,
          .document_positions = data.positions == "document",
          .assistant_loss = data.loss == "assistant"};
}

// The data with what batch_options needs (flags; document starts, else data.tokenizer's BOS).
TrainData load_data(const RunConfig& rc, const LlamaConfig& mc, const Tokenizer& tokenizer,
                    const std::string& tokenizer_spec) {
  const std::vector<std::string> train_specs = resolve_demo(rc.data.train);
  if (train_specs.empty()) fail("data.train is empty", "list token shards or globs in data.train");
  const TokenDatasetOptions dopt{parse_token_format(rc.data.format, "data.format"), mc.vocab_size};
  const auto open = [&](const std::vector<std::string>& specs) {
    return open_training_data(specs, dopt, batch_options(rc.data), tokenizer.bos_id(),
                              fmt::format("'{}' (data.tokenizer)", tokenizer_spec));
  };
  TrainData d{open(train_specs), {}};
  if (rc.data.eval.empty()) {
    d.split = split_by_fraction(d.train, rc.data.seq_len, rc.data.eval_fraction);
  } else {
    d.split = split_by_files(d.train, open(resolve_demo(rc.data.eval)), rc.data.seq_len);
  }
  return d;
}

// The device memory a run may take: what the driver has free, under train.device_memory's ceiling.
double usable_device_bytes(Device device) { return static_cast<double>(usable_device_memory(device)); }

// The device memory the planner checks against, from the bytes a run may still take: the CUDA
// context is already among the used ones, and the plan counts it again (tools/planner/planner.h).
double plan_gib(double usable_bytes) { return (usable_bytes + double(kCudaContextBytes)) / double(1ull << 30); }

// schedule.chunk / offload_window = auto: the planner's choice for this GPU's free memory
// (tools/planner/planner.h).
void resolve_auto_lengths(RunConfig& rc, const Placement& p, int zero3_ranks, std::ostream& log) {
  ScheduleOptions& s = rc.schedule;
  if (s.chunk != kAuto && s.offload_window != kAuto) return;
  if (p.device.is_cpu())
    fail("schedule.chunk / schedule.offload_window = auto: the planner models a GPU's memory",
         "give numbers on the CPU (e.g. schedule.chunk = 1024, offload_window = 0)");
  const double gib = plan_gib(usable_device_bytes(p.device));
  // The host's memory too: the planner may offload the store (and its saved outputs) there.
  MemoryBudget budget(gib, double(host_memory_available()) / double(1ull << 30), zero3_ranks);
  budget.cp_ranks = static_cast<int>(rc.parallel.cp);  // a plan of one context-parallel rank
  s = resolve_auto_schedule(p.model, rc.data.batch_size, rc.data.seq_len, s, p.dtype, budget, p.lora,
                            rc.optimizer.offload);
  log << fmt::format("schedule: the planner chose {} for {:.1f} GiB of device memory\n", describe_schedule(s), gib);
}

// Memory guard: fail before step 1, not in the middle of it. Returns the planner's plan of a step
// (tools/planner/planner.h) on the run's device: on a GPU the caching pool's peak, on the CPU the
// buffers' bytes and the arena's blocks; and the host memory it pins.
PlanReport check_memory(const Placement& p, const RunConfig& rc, int zero3_ranks) {
  const double have = p.device.is_cpu() ? double(host_memory_available()) : usable_device_bytes(p.device);
  // ZeRO 3 (zero3_ranks > 0): the plan holds the rank's shard and the gathered blocks' buffers instead
  // of the whole model's weights, master, moments and gradient.
  MemoryBudget budget(p.device.is_cpu() ? have / double(1ull << 30) : plan_gib(have), 0, zero3_ranks);
  budget.cp_ranks = static_cast<int>(rc.parallel.cp);
  const PlanReport plan = plan_step(p.model, rc.data.batch_size, rc.data.seq_len, rc.schedule_options(), p.dtype,
                                    budget, p.lora, rc.optimizer.offload, {}, p.device);
  const double need = static_cast<double>(plan.peak_device_bytes);
  // The plan counts cuDNN's backward workspace for its largest call: let every call have it.
  if (!p.device.is_cpu())
    raise_attention_workspace_budget(p.device, static_cast<int64_t>(plan.attention_workspace_bytes));
  std::string advice =
      "lower data.batch_size, data.seq_len or schedule.chunk, use schedule.name = seco, or set optimizer.offload";
  if (!p.device.is_cpu() && !plan.advice.empty())
    advice = plan.advice + " (or schedule.chunk = auto, offload_window = auto)";
  if (rc.train.memory_check && have > 0 && need > have)
    fail(fmt::format("this run needs about {} of {} memory and the {} has {} available", format_bytes(need),
                     p.device.is_cpu() ? "host" : "device", device_name(p.device), format_bytes(have)),
         advice + "; train.memory_check = false starts it anyway");
  // Host memory: the offloaded optimizer's master weights, moments and staging, and on a GPU the K/V
  // store's pinned copy; on the CPU beside the step's own.
  const double host_need = static_cast<double>(plan.peak_host_bytes);
  const double host_have = double(host_memory_available());
  const double host_total = host_need + (p.device.is_cpu() ? need : 0.0);
  if (rc.train.memory_check && host_need > 0 && host_have > 0 && host_total > host_have) {
    std::string parts;
    for (const auto& [name, bytes] : plan.host)
      parts += fmt::format("{}{} {}", parts.empty() ? "" : ", ", name, format_bytes(static_cast<double>(bytes)));
    fail(fmt::format("this run keeps {} in host memory ({}) and the host has {} available", format_bytes(host_need),
                     parts, format_bytes(host_have)),
         "turn optimizer.offload off, train fewer parameters (lora.rank), keep more of the K/V store on the device "
         "(schedule.offload_window), or use a machine with more memory");
  }
  return plan;
}

AdamWOptions adamw_options(const RunConfig& rc) {
  AdamWOptions aopt;
  aopt.beta1 = rc.optimizer.beta1;
  aopt.beta2 = rc.optimizer.beta2;
  aopt.eps = rc.optimizer.eps;
  aopt.weight_decay = rc.optimizer.weight_decay;
  return aopt;
}

// The lines printed before step 1: the run directory, model, data, schedule, the resolved config.
void print_header(const RunConfig& rc, const Placement& p, const TrainData& data, const PlanReport& planned,
                  const std::string& run_path, std::ostream& out) {
  const LlamaConfig& mc = p.model;
  const int64_t B = rc.data.batch_size, T = rc.data.seq_len, accum = rc.data.grad_accum;
  out << fmt::format("run dir: {}\n", run_path);
  out << fmt::format("model {}: {} layers, hidden {}, {} heads ({} K/V), vocab {}, {:.2f} M parameters, {} on {}{}\n",
                     rc.model.source, mc.num_hidden_layers, mc.hidden_size, mc.num_attention_heads,
                     mc.num_key_value_heads, mc.vocab_size, static_cast<double>(mc.parameter_count()) / 1e6,
                     dtype_name(p.dtype), device_name(p.device),
                     p.lora.enabled() ? " (frozen)" : p.dtype == DType::bf16 ? " (f32 master weights, f32 gradients)" : "");
  if (p.lora.enabled()) {
    const double adapters = static_cast<double>(lora_parameter_count(mc, p.lora));
    out << fmt::format("lora: rank {}, alpha {} (scale {}), dropout {}, on {}{}: {:.3f} M trainable parameters "
                       "({:.3f}% of the base){}\n",
                       p.lora.rank, p.lora.alpha, p.lora.scale(), p.lora.dropout, fmt::join(p.lora.target_names(), ","),
                       rc.model.adapter.empty() ? "" : fmt::format(" from {}", rc.model.adapter), adapters / 1e6,
                       100.0 * adapters / static_cast<double>(mc.parameter_count()),
                       p.dtype == DType::bf16 ? ", f32 master weights and gradients" : "");
  }
  out << fmt::format("data: {} ({} tokens): {} train windows, {} eval windows of {} tokens\n", data.train.describe(),
                     data.train.size(), data.split.train.size(), data.split.eval.size(), T);
  const int64_t dp = rc.parallel.dp;
  out << fmt::format("schedule {} (chunk {}, bwd chunk {}), {}{} x {} x {} = {} tokens per step, {} steps, "
                     "planned memory {}{}\n",
                     schedule_name(rc.schedule.kind), rc.schedule.chunk, rc.schedule.bwd_chunk,
                     dp > 1 ? fmt::format("{} ranks x ", dp) : "", accum, B, T, dp * B * T * accum, rc.train.steps,
                     format_bytes(static_cast<double>(planned.peak_device_bytes)),
                     planned.peak_host_bytes > 0
                         ? fmt::format(" (and {} of host memory)", format_bytes(static_cast<double>(planned.peak_host_bytes)))
                         : "");
  if (dp > 1 && rc.parallel.zero == 3)
    out << fmt::format("data parallel: {} ranks, zero 3 (each rank holds 1/{} of every parameter, gradient and moment; "
                       "each block gathered as it runs, its gradient reduce-scattered)\n",
                       dp, dp);
  else if (dp > 1)
    out << fmt::format("data parallel: {} ranks, zero {}, gradient buckets of {} MiB\n", dp, rc.parallel.zero,
                       rc.parallel.bucket_mb);
  if (rc.parallel.tp > 1)
    out << fmt::format("tensor parallel: {} ranks per data-parallel rank ({} ranks in all), sequence parallel {}, "
                       "regather {}\n",
                       rc.parallel.tp, dp * rc.parallel.tp, rc.parallel.sequence_parallel, rc.parallel.tp_regather);
  if (rc.parallel.cp > 1) {
    const LlamaConfig heads = cp_attention_config(mc, rc.parallel.cp);
    out << fmt::format("context parallel: {} ranks per data-parallel rank ({} ranks in all), each 1/{} of every "
                       "chunk's tokens and {} of {} heads ({} of {} K/V heads in its store)\n",
                       rc.parallel.cp, dp * rc.parallel.cp, rc.parallel.cp, heads.num_attention_heads,
                       mc.num_attention_heads, heads.num_key_value_heads,
                       mc.num_key_value_heads);
  }
  out << "config:\n" << rc.to_toml() << "\n";
  out.flush();
}

// Where a ZeRO 3 rank's memory goes: the weights are the working buffers the blocks are gathered
// into (and their gradients reduce-scattered from), the master weights, moments and gradient its
// shard's; under LoRA the weights also the frozen base's shard, the rest the adapters'.
MemoryReport zero3_memory_report(const ShardedDataParallel& zero3, const StepStats& stats) {
  const ShardedParameters& shards = zero3.shards();
  MemoryReport r;
  r.weights = shards.buffer_bytes();
  if (zero3.lora()) {  // the frozen base's shard, and the adapters' master, moments and gradient (replicated)
    r.weights += shards.master().bytes();
    r.master = zero3.adapter_master().bytes();
    r.optimizer = 2 * zero3.adapter_master().bytes();
    r.gradients = zero3.adapter_grads().bytes();
  } else {
    r.master = shards.master().bytes();
    r.optimizer = shards.optimizer().exp_avg().bytes() + shards.optimizer().exp_avg_sq().bytes();
    r.gradients = shards.grads().bytes();
  }
  r.activations = stats.activation_high_water;
  r.kv = stats.kv_bytes;
  r.host_kv = stats.kv_host_bytes;
  if (!shards.master().device().is_cpu()) r.device_peak = pool_stats(shards.master().device()).peak_in_use;
  return r;
}

// The optimizer steps from progress.step + 1 to train.steps: micro-batches through the schedule,
// the non-finite guard, clipping, AdamW; logging, the first step's memory report, evaluation,
// checkpoints, and stopping on a signal or --stop-after.
class TrainLoop {
 public:
  // groups: this rank's place (all null: one process); state: null under ZeRO 3 (groups.zero3 holds
  // the rank's shards and the model); metrics: null on ranks other than 0.
  TrainLoop(const RunConfig& rc, const TrainOptions& opt, const Placement& placement, const WindowSplit& split,
            TrainingState* state, Schedule& schedule, WindowSampler& sampler, RunDirectory& run_dir,
            MetricsLog* metrics, const Tokenizer& tokenizer, const RankGroups& groups, std::ostream& out)
      : rc_(rc), opt_(opt), placement_(placement), split_(split), state_(state), schedule_(schedule),
        sampler_(sampler), run_dir_(run_dir), metrics_(metrics), tokenizer_(tokenizer), groups_(groups),
        dp_(groups.dp), zero3_(groups.zero3), comm_(groups.world), lead_(groups.lead()), out_(out),
        lr_schedule_{rc.optimizer.lr, rc.optimizer.min_lr, rc.optimizer.warmup_steps, rc.train.steps,
                     LrSchedule::parse(rc.optimizer.decay)},
        eval_arena_(placement.device),
        batch_options_(batch_options(rc.data)),
        tty_(isatty(STDOUT_FILENO) && &out == &std::cout && groups.lead()),
        step_progress_(out, tty_) {
    // A step of minutes (SeCO at long context) shows its chunks as it goes; the lead rank prints.
    if (lead_) step_progress_.attach(schedule_);
  }

  // Runs to the end (or a stop), filling result's last step, loss, eval loss and interrupted.
  void run(ResumePoint progress, TrainResult& result) {
    // Thread ranks share the process's handlers: train_on_threads installs them once for all.
    std::optional<SignalGuard> signals;
    if (!comm_ || comm_->backend() != "threads") signals.emplace();
    start_step_ = progress.step;
    tokens_seen_ = progress.tokens_seen;
    const auto t_loop = std::chrono::steady_clock::now();
    int64_t step = start_step_;
    double last_loss = std::nan("");
    // Where a fine-tune starts from (the first replica's TP ranks evaluate together, under ZeRO 3 all).
    if (groups_.holds_model_together() && step == 0 && rc_.eval.at_start) {
      const double el = evaluate();
      if (metrics_) {
        metrics_->append({{"step", 0}, {"eval_loss", el}, {"tokens", 0}});
        out_ << fmt::format("step {:>5}: eval loss {:.4f} ({:.3f} bits per token) before training\n", 0, el,
                            el / std::log(2.0))
             << std::flush;
      }
    }
    while (step < rc_.train.steps) {
      ++step;
      const bool traced = !opt_.trace.empty() && step == start_step_ + 1;
      if (traced) trace::start(placement_.device);
      const auto t0 = std::chrono::steady_clock::now();
      step_progress_.start(step);
      const StepOutcome o = train_step(step);
      step_progress_.finish();
      tokens_seen_ += tokens_per_step();
      last_loss = o.loss;
      const auto t1 = std::chrono::steady_clock::now();
      if (traced) {
        trace::stop().write(opt_.trace);
        out_ << fmt::format("trace of step {}: {}\n", step, opt_.trace);
      }
      log_step(step, o, std::chrono::duration<double>(t1 - t0).count(),
               std::chrono::duration<double>(t1 - t_loop).count());
      if (step == start_step_ + 1) report_memory(step, o.stats);
      const bool last = step == rc_.train.steps;
      // Every replica holds the same weights: the first one evaluates (its TP ranks together; under
      // ZeRO 3 every rank, each block gathered from all). eval.every = 0: never (not even at the end;
      // there may be no eval data then).
      if (groups_.holds_model_together() && rc_.eval.every > 0 && (step % rc_.eval.every == 0 || last)) {
        const double el = evaluate();
        result.last_eval_loss = el;
        if (metrics_) {
          metrics_->append({{"step", step}, {"eval_loss", el}, {"tokens", tokens_seen_}});
          out_ << clear_line() << fmt::format("step {:>5}: eval loss {:.4f} ({:.3f} bits per token)\n", step, el,
                                              el / std::log(2.0));
        }
      }
      const bool stop = agreed(g_signals.load() > 0) || (opt_.stop_after > 0 && step - start_step_ >= opt_.stop_after && !last);
      if ((rc_.checkpoint.every > 0 && step % rc_.checkpoint.every == 0) || (last && rc_.checkpoint.at_end) || stop)
        save(step);
      if (stop) {
        out_ << clear_line() << fmt::format("stopped: saved step {} in {}; continue with --resume\n", step,
                                            result.run_dir);
        result.interrupted = true;
        break;
      }
    }
    if (tty_) out_ << "\r\033[K";
    result.last_step = step;
    result.last_loss = last_loss;
  }

 private:
  struct StepOutcome {
    double loss = 0, grad_norm = 0, lr = 0;
    bool skipped = false;
    StepStats stats;  // the last micro-batch's
  };

  int64_t tokens_per_step() const {
    return rc_.parallel.dp * rc_.data.batch_size * rc_.data.seq_len * rc_.data.grad_accum;
  }
  // Whether any rank says so (a signal reaches the ranks at different moments; they must stop together).
  bool agreed(bool any) {
    if (!comm_) return any;
    std::vector<double> flag{any ? 1.0 : 0.0};
    sum_host_values(*comm_, flag);
    return flag[0] > 0;
  }
  const char* clear_line() const { return tty_ ? "\r\033[K" : ""; }
  LlamaModel& model() { return zero3_ ? zero3_->model() : state_->model(); }

  // One optimizer step: the micro-batches' gradients summed (the loss normalised by the step's
  // supervised count), then the guard, clipping and the update.
  StepOutcome train_step(int64_t step) {
    if (dp_) return data_parallel_step(*dp_, step);
    if (zero3_) return data_parallel_step(*zero3_, step);
    const int64_t B = rc_.data.batch_size, accum = rc_.data.grad_accum;
    const ParamSet& grads = state_->grads();
    grads.zero();
    std::vector<Batch> micro;
    double normaliser = 0;
    for (int64_t m = 0; m < accum; ++m) {
      micro.push_back(batch_of_windows(sampler_.windows(), sampler_.next_batch_windows(B), batch_options_));
      normaliser += static_cast<double>(micro.back().supervised());
    }
    StepOutcome o;
    for (int64_t m = 0; m < accum; ++m) {
      o.stats = schedule_.step(state_->model(), micro[static_cast<size_t>(m)], grads, normaliser,
                               static_cast<uint64_t>(step * accum + m));
      o.loss += o.stats.loss;
    }
    o.grad_norm = grad_global_norm(grads);
    o.lr = lr_schedule_.at(step);
    o.skipped = skip_nonfinite(o, step, accum);
    if (!o.skipped) {
      clip_grad_norm(grads, rc_.optimizer.grad_clip);
      state_->optimizer_step(o.lr);
    }
    return o;
  }

  // A non-finite loss or gradient norm: stops the run (train.nonfinite = stop) or says the update is
  // skipped and returns true. On every rank of a data-parallel run the loss and norm are the global
  // ones, so every rank decides alike.
  bool skip_nonfinite(const StepOutcome& o, int64_t step, int64_t accum) {
    if (std::isfinite(o.loss) && std::isfinite(o.grad_norm)) return false;
    const std::string what = fmt::format("step {}: non-finite {} (loss {}, grad norm {}) over {} micro-batches", step,
                                         std::isfinite(o.loss) ? "gradient" : "loss", o.loss, o.grad_norm, accum);
    if (rc_.train.nonfinite == "stop") fail(what, "lower optimizer.lr or set train.nonfinite = skip");
    out_ << "warning: " << what << "; update skipped\n";
    return true;
  }

  // train_step with data parallelism: this rank's slice of every global micro-batch, one reduction,
  // the global loss and norm (the same on every rank, so every rank takes the same decisions).
  // Parallel is DataParallel (ZeRO 0-2) or ShardedDataParallel (ZeRO 3): the same four steps.
  template <class Parallel>
  StepOutcome data_parallel_step(Parallel& dp, int64_t step) {
    const int64_t B = rc_.data.batch_size, accum = rc_.data.grad_accum;
    std::vector<Batch> micro;
    for (int64_t m = 0; m < accum; ++m) {
      // Its slice of the global batch (a context-parallel group's ranks share theirs).
      const int slot = groups_.batch_slot(), slots = groups_.batch_slots();
      micro.push_back(
          batch_of_windows(sampler_.windows(), sampler_.next_rank_batch_windows(B, slot, slots), batch_options_));
      micro.back().sequence0 = slot * B;  // where its sequences sit in the global batch (LoRA's dropout masks)
    }
    StepOutcome o;
    const DataParallelStep d = dp.compute_gradients(schedule_, micro, static_cast<uint64_t>(step * accum));
    o.loss = d.loss;
    o.stats = d.stats;
    o.grad_norm = dp.gradient_norm();
    o.lr = lr_schedule_.at(step);
    o.skipped = skip_nonfinite(o, step, accum);
    if (!o.skipped) {
      dp.clip_gradients(rc_.optimizer.grad_clip);
      dp.optimizer_step(o.lr);
    }
    return o;
  }

  // The metrics line of every step; the log line (and the progress bar on a terminal) every log.every.
  void log_step(int64_t step, const StepOutcome& o, double step_s, double elapsed) {
    const double eta = elapsed / static_cast<double>(step - start_step_) * static_cast<double>(rc_.train.steps - step);
    const double tok_s = static_cast<double>(tokens_per_step()) / step_s;
    if (!metrics_) return;  // ranks other than 0 neither log nor print
    nlohmann::json record = {{"step", step}, {"loss", o.loss}, {"lr", o.lr}, {"grad_norm", o.grad_norm},
                             {"tokens", tokens_seen_}, {"tokens_per_s", tok_s}, {"step_s", step_s},
                             {"skipped", o.skipped}, {"rss_mib", rss_mib()}};
    if (!placement_.device.is_cpu()) {  // the caching pool: in use after the step, and its peak so far
      const PoolStats pool = pool_stats(placement_.device);
      record["device_mib"] = static_cast<double>(pool.in_use) / double(1 << 20);
      record["device_peak_mib"] = static_cast<double>(pool.peak_in_use) / double(1 << 20);
    }
    metrics_->append(record);
    if (step % rc_.log.every != 0 && step != rc_.train.steps && step != start_step_ + 1) return;
    const std::string line = fmt::format(
        "step {:>5}/{} | loss {:.4f} | grad norm {:.3f} | lr {:.2e} | {:.0f} tok/s | {} elapsed, ETA {} | mem {:.0f} MiB",
        step, rc_.train.steps, o.loss, o.grad_norm, o.lr, tok_s, short_duration(elapsed), short_duration(eta), rss_mib());
    if (tty_) {
      const int width = 30, done = static_cast<int>(width * step / rc_.train.steps);
      out_ << "\r\033[K" << line << "\n"
           << "[" << std::string(static_cast<size_t>(done), '#') << std::string(static_cast<size_t>(width - done), '.')
           << "] " << fmt::format("{}%", 100 * step / rc_.train.steps) << std::flush;
    } else {
      out_ << line << "\n" << std::flush;
    }
  }

  // Where the memory goes, once the first step has shown the activation and K/V peaks.
  void report_memory(int64_t step, const StepStats& stats) {
    if (!metrics_) return;
    MemoryReport mem = zero3_ ? zero3_memory_report(*zero3_, stats)
                              : memory_report(*state_, stats.activation_high_water, stats.kv_bytes, stats.kv_host_bytes);
    if (dp_ && !state_->optimizer_offloaded()) mem.optimizer = dp_->optimizer_bytes();  // ZeRO: this rank's shard
    out_ << clear_line() << fmt::format("memory ({}): {}\n", device_name(placement_.device), mem.line());
    nlohmann::json mj = {{"step", step}};
    for (const auto& [name, bytes] : mem.categories()) mj["memory_" + name] = bytes;
    for (const auto& [name, bytes] : {std::pair<const char*, size_t>{"master", mem.host_master},
                                      {"optimizer", mem.host_optimizer}, {"staging", mem.host_staging},
                                      {"kv", mem.host_kv}})
      if (bytes > 0) mj[std::string("memory_host_") + name] = bytes;
    metrics_->append(mj);
  }

  // The mean loss over eval.batches batches of the eval windows, in order.
  // Parallel: the first replica alone (its TP ranks together; under ZeRO 3 every rank, each its share
  // of the batches), with batches of the global batch size (as one process would).
  double evaluate() {
    const int64_t B = rc_.data.batch_size * rc_.parallel.dp;
    double sum = 0;
    int64_t count = 0;
    const int64_t n = std::min<int64_t>(rc_.eval.batches, split_.eval.num_batches(B));
    // Under ZeRO 3 every rank evaluates (each block's gather needs all of them), so the batches are
    // dealt out: rank r takes batches r, r + ranks, ...; a rank left one batch short runs batch 0
    // again uncounted, so that every rank asks for the same blocks; the sums are added over the ranks.
    const int ranks = zero3_ ? zero3_->size() : 1, rank = zero3_ ? zero3_->rank() : 0;
    for (int64_t k = 0; k < (n + ranks - 1) / ranks; ++k) {
      const int64_t i = k * ranks + rank;
      const bool counted = i < n;
      Batch batch = batch_of_windows(split_.eval, split_.eval.batch_windows(counted ? i : 0, B), batch_options_);
      const int64_t rows = batch.B();
      // Sequence parallelism splits a chunk's rows x tokens over the TP ranks: a last, shorter batch
      // gets rows without labels up to a multiple of tp (they add nothing to the loss or the count).
      if (groups_.tp && groups_.tp->sequence_parallel() && rows % groups_.tp_size() != 0)
        batch = with_unlabelled_rows(batch, (rows / groups_.tp_size() + 1) * groups_.tp_size());
      // The eval store placed as training places it (its K/V may not fit the device either).
      const double loss = batch_loss(model(), batch, rc_.schedule, eval_arena_);
      if (!counted) continue;
      sum += loss * static_cast<double>(batch.supervised());
      count += batch.supervised();
    }
    if (zero3_) {
      std::vector<double> totals{sum, static_cast<double>(count)};
      sum_host_values(*comm_, totals);
      sum = totals[0];
      count = static_cast<int64_t>(totals[1]);
    }
    // Context parallelism: each rank's loss is its tokens' share of the batch's (the whole batch's
    // count divides it), so the shares add up over the group; the count is the batch's on every rank.
    if (groups_.cp) {
      std::vector<double> shares{sum};
      sum_host_values(*groups_.cp, shares);
      sum = shares[0];
    }
    return count > 0 ? sum / static_cast<double>(count) : std::nan("");
  }

  // A checkpoint: the master weights (f32 for a bf16 run, so that a resume continues bit-exactly),
  // the optimizer moments, the step, token count and sampler position, the config.
  // Parallel: rank 0 writes the shared files: the whole master weights as one HF checkpoint (with
  // tensor parallelism assembled from the first replica's TP shards) and state.json (every rank holds
  // the same sampler state). Each rank that holds optimizer state no other rank holds writes it
  // (RankGroups::optimizer_file): the others first into a staging directory named like a checkpoint
  // temporary (so a crash leaves nothing a resume reads, and remove_stale_temporaries deletes it),
  // and rank 0 moves them into the checkpoint before its manifest is written. Barriers order the
  // three phases. Under ZeRO 3 every rank's file (rank 0's too) is staged: its shard of the master
  // weights with its moments beside it, from which it resumes exactly; rank 0 then assembles the
  // whole model's weights from the staged shard files (consolidate_shards): only rank 0 ever holds
  // the whole model, and only while it writes it.
  void save(int64_t step) {
    const SamplerState ss = sampler_.state();
    const bool sharded_master = zero3_ && !zero3_->lora();  // the whole weights come from the shard files
    const HostWeights weights = sharded_master ? HostWeights{}
                                : zero3_       ? whole_master(*zero3_, groups_)
                                               : whole_master(*state_, placement_.model, groups_);
    const AdamWShard* shard = dp_ ? dp_->optimizer_shard() : nullptr;
    const fs::path staging = fs::path(run_dir_.path()) / fmt::format(".{}.tmp-shards", checkpoint_dir_name(step));
    const auto save_optimizer = [&](const fs::path& path) {
      if (sharded_master)
        zero3_->save_shard(path.string());
      else if (zero3_)
        zero3_->adapter_optimizer().save(path.string());
      else if (shard)
        shard->save(path.string());
      else
        std::as_const(*state_).optimizer().save(path.string());
    };
    const std::string mine = groups_.optimizer_file();
    const int first_staged = sharded_master ? 0 : 1;  // the ranks whose files go through the staging directory
    bool staged_any = false;
    for (int w = first_staged; w < groups_.world_size(); ++w)
      staged_any = staged_any || !groups_.optimizer_file_of(w).empty();
    if (!mine.empty() && groups_.world_rank() >= first_staged) {
      fs::create_directories(staging);
      save_optimizer(staging / mine);
    }
    if (comm_) comm_->barrier();
    if (lead_)
      run_dir_.save_checkpoint(
          step,
          [&](const std::string& dir) {
            if (sharded_master) {
              std::vector<std::string> shards;
              for (int w = 0; w < groups_.world_size(); ++w) shards.push_back((staging / groups_.optimizer_file_of(w)).string());
              const ParamSet whole = consolidate_shards(placement_.model, shards);
              save_checkpoint_weights(whole, placement_.model, dir, whole.dtype());
            } else if (placement_.lora.enabled()) {
              // Under LoRA the checkpoint holds the adapters (PEFT's files), the base staying model.source.
              save_peft_adapter(*weights, placement_.lora, dir, rc_.model.source, (*weights).dtype());
            } else {
              save_checkpoint_weights(*weights, placement_.model, dir, state_->master_dtype());
            }
            if (first_staged > 0) save_optimizer(fs::path(dir) / mine);
            for (int w = first_staged; w < groups_.world_size(); ++w)
              for (const std::string& file : groups_.optimizer_files_of(w))
                fs::rename(staging / file, fs::path(dir) / file);
            nlohmann::json saved = {{"step", step},
                                    {"tokens_seen", tokens_seen_},
                                    {"sampler", ss.to_json()},
                                    {"tokenizer", tokenizer_.to_json()}};
            if (dp_)
              saved["parallel"] = {{"dp", dp_->size() / groups_.cp_size()},
                                   {"zero", dp_->zero()},
                                   {"tp", groups_.tp_size()},
                                   {"cp", groups_.cp_size()}};
            if (zero3_) saved["parallel"] = {{"dp", zero3_->size()}, {"zero", 3}, {"tp", 1}};
            write_text_atomic((fs::path(dir) / "state.json").string(), saved.dump(2) + "\n");
            write_text_atomic((fs::path(dir) / "run.toml").string(), rc_.to_toml());
            // With a BPE tokenizer the checkpoint is a whole HF model directory (AutoTokenizer loads it too).
            for (const auto& [name, text] : hf_tokenizer_files(tokenizer_))
              write_text_atomic((fs::path(dir) / name).string(), text);
          },
          rc_.checkpoint.keep_last);
    if (lead_ && staged_any) fs::remove_all(staging);
    if (comm_) comm_->barrier();  // no rank stages the next checkpoint's files before this one is complete
  }

  const RunConfig& rc_;
  const TrainOptions& opt_;
  const Placement& placement_;
  const WindowSplit& split_;
  TrainingState* state_;  // null under ZeRO 3
  Schedule& schedule_;
  WindowSampler& sampler_;
  RunDirectory& run_dir_;
  MetricsLog* metrics_;
  const Tokenizer& tokenizer_;
  const RankGroups& groups_;
  DataParallel* dp_;
  ShardedDataParallel* zero3_;
  Communicator* comm_;
  const bool lead_;
  std::ostream& out_;
  LrSchedule lr_schedule_;
  Arena eval_arena_;
  const BatchOptions batch_options_;  // documents and loss mask of every batch, training and eval
  const bool tty_;
  StepProgress step_progress_;
  int64_t start_step_ = 0, tokens_seen_ = 0;
};

// The text the model continues from sample.prompt (on the host, from the whole master weights;
// under LoRA the frozen base's compute weights and the adapters' master weights), under `title`.
void print_sample(const RunConfig& rc, const LlamaConfig& mc, const LoraConfig& lora, const ParamSet& weights,
                  const ParamSet* base, const Tokenizer& tokenizer, const char* title, std::ostream& out) {
  SampleOptions so;
  so.prompt = rc.sample.prompt;
  so.tokens = rc.sample.tokens;
  so.temperature = rc.sample.temperature;
  so.top_k = rc.sample.top_k;
  so.top_p = rc.sample.top_p;
  so.seed = rc.sample.seed;
  LlamaModel host_model(mc, weights.dtype(), Device::host(), nullptr, lora);
  if (lora.enabled()) {
    copy_params(host_model.params(), *base);
    copy_params(host_model.adapters(), weights);
  } else {
    copy_params(host_model.params(), weights);
  }
  out << title << ":\n" << rc.sample.prompt << generate(host_model, tokenizer, so).text << "\n" << std::flush;
}
}  // namespace

std::string demo_data_path() {
  if (const std::optional<std::string> path = env::text(env::kDemoData)) return *path;
  const std::string p = ".cache/demo/jargon.bin";
  if (!fs::exists(p))
    fail(fmt::format("the demo corpus '{}' is not there", p),
         "run `tools/run train`, which fetches it (the Jargon File from Debian's jargon-text), or set data.train");
  return p;
}


namespace {
// parallel.dp x parallel.tp > 1 without a communicator: the ranks as threads of this process (the
// CPU's threads backend), rank 0 printing to `out`. They must agree on the run directory, so it is
// fixed here.
TrainResult train_on_threads(const RunConfig& rc, const TrainOptions& opt, std::ostream& out) {
  const int64_t ranks = rc.parallel.dp * rc.parallel.tp * rc.parallel.cp;
  if (!resolve_device(rc.train.device, "train.device").is_cpu())
    fail(fmt::format("{} ranks (parallel.dp x tp x cp = {} x {} x {}) on GPUs need one process per GPU", ranks,
                     rc.parallel.dp, rc.parallel.tp, rc.parallel.cp),
         fmt::format("launch {} ranks with torchrun, mpirun or srun (one per GPU), or set train.device = cpu to run "
                     "them as threads",
                     ranks));
  TrainOptions shared = opt;
  if (shared.run_dir.empty()) shared.run_dir = !rc.log.run_dir.empty() ? rc.log.run_dir : default_run_dir();
  TrainResult result;
  SignalGuard signals;  // one for every rank: a signal stops them together (TrainLoop::agreed)
  run_thread_ranks(static_cast<int>(ranks), [&](Communicator& comm) {
    TrainResult r = run_training(rc, shared, out, &comm);
    if (comm.rank() == 0) result = r;
  });
  return result;
}
}  // namespace

TrainResult run_training(const RunConfig& given, const TrainOptions& opt, std::ostream& out, Communicator* comm) {
  given.validate();
  RunConfig rc = given;  // schedule.chunk / offload_window = auto become the planner's numbers below
  const int64_t ranks = rc.parallel.dp * rc.parallel.tp * rc.parallel.cp;
  if (!comm && ranks > 1) return train_on_threads(rc, opt, out);
  if (comm && comm->size() != ranks)
    fail(fmt::format("parallel.dp x tp x cp = {} x {} x {} is {} ranks, but {} were launched", rc.parallel.dp,
                     rc.parallel.tp, rc.parallel.cp, ranks, comm->size()),
         "set parallel.dp, parallel.tp and parallel.cp (--set parallel.dp=N ...) so that dp x tp x cp is the number "
         "of ranks launched");
  const bool lead = !comm || comm->rank() == 0;
  NullStream silent;  // parallel/launch.h
  std::ostream& log = lead ? out : silent.stream;
  const auto t_start = std::chrono::steady_clock::now();
  TrainResult result;
  result.run_dir = !opt.run_dir.empty() ? opt.run_dir : (!rc.log.run_dir.empty() ? rc.log.run_dir : default_run_dir());
  if (comm && comm->size() > 1 && opt.run_dir.empty() && rc.log.run_dir.empty())
    fail("parallel ranks need the same run directory", "give --run-dir or log.run_dir");
  const bool resume = opt.resume || rc.checkpoint.resume;

  Placement placement = resolve_placement(rc);
  if (comm && !comm->device().is_cpu()) {  // one process per GPU: the rank computes on its communicator's GPU
    if (placement.device.is_cpu())
      fail(fmt::format("train.device = {} but the ranks were launched with GPUs (NCCL)", rc.train.device),
           "set train.device = cuda, or run the ranks as threads of one process on the CPU (no launcher)");
    placement.device = comm->device();
  }
  const LlamaConfig& mc = placement.model;
  std::optional<DeviceMemoryLimitScope> device_limit;
  if (rc.train.device_memory > 0) {
    if (placement.device.is_cpu())
      fail(fmt::format("train.device_memory = {} GiB limits a GPU's memory, but the run is on the CPU",
                       rc.train.device_memory),
           "leave train.device_memory at 0 on the CPU");
    device_limit.emplace(placement.device, pool_limit_for(rc.train.device_memory, "train.device_memory"));
  }
  // train.threads: the CPU kernels' threads for this run (and its thread ranks' share of them).
  std::optional<CpuThreadsScope> threads;
  if (rc.train.threads > 0) threads.emplace(static_cast<int>(rc.train.threads));
  // What one rank holds: with tensor parallelism 1/tp of every block's heads and FFN (this says at
  // once when tp does not divide them).
  const LlamaConfig rank_config = rc.parallel.tp > 1 ? tp_shard_config(mc, rc.parallel.tp) : mc;
  if (rc.parallel.cp > 1) cp_attention_config(mc, rc.parallel.cp);  // cp must split the heads: say so here
  check_sizes_fit_machine(rc, placement, rank_config);
  check_state_fits_machine(rc, placement, rank_config, comm);
  // data.tokenizer: kept in the run directory; where the run turns ids into text (its samples), checked
  // against the model before anything is loaded (a run on token ids alone needs no tokenizer of its size).
  const std::string tokenizer_spec = resolve_tokenizer_spec(rc.data.tokenizer, rc.model.source, "data.tokenizer");
  const std::unique_ptr<Tokenizer> tokenizer = load_tokenizer(tokenizer_spec);
  if (rc.sample.tokens > 0)
    check_tokenizer_fits_model(*tokenizer, tokenizer_spec, mc.vocab_size, rc.model.source, "data.tokenizer");
  const TrainData data = load_data(rc, mc, *tokenizer, tokenizer_spec);
  WindowSampler sampler(data.split.train, rc.data.seed);  // the same on every rank (next_rank_batch)
  // ZeRO 3 needs ranks (a launcher, or threads on the CPU); one process holds the whole model anyway.
  const bool sharded = comm && rc.parallel.zero == 3;
  const int zero3_ranks = sharded ? static_cast<int>(rc.parallel.dp) : 0;
  resolve_auto_lengths(rc, {rank_config, placement.device, placement.dtype, placement.lora}, zero3_ranks, log);
  if (rc.parallel.cp > 1) rc.validate();  // the chunks auto chose must split into cp shares too
  const PlanReport planned =
      check_memory({rank_config, placement.device, placement.dtype, placement.lora}, rc, zero3_ranks);

  // The grid (parallel/grid.h): the world split into this rank's TP and DP groups; at world size 1
  // (a launcher with one process) groups of one, through the same path.
  // Context parallelism: the DP group is the whole world (every rank's gradient is its tokens' share,
  // summed over all of them: parallel/data_parallel.h), and each data-parallel rank's cp adjacent
  // ranks form the group whose exchanges the model makes.
  std::optional<ParallelGrid> grid;
  if (comm) grid.emplace(*comm, rc.parallel.dp * rc.parallel.cp, rc.parallel.tp);
  std::unique_ptr<Communicator> cp_comm;
  std::optional<ContextParallel> context_parallel;
  if (rc.parallel.cp > 1) {
    const int P = static_cast<int>(rc.parallel.cp);
    cp_comm = comm->split(comm->rank() / P, comm->rank() % P);
    context_parallel.emplace(*cp_comm);
  }
  std::optional<TensorParallel> tensor_parallel;
  if (rc.parallel.tp > 1) tensor_parallel.emplace(grid->tp(), TensorParallelOptions{rc.parallel.sequence_parallel,
                                                                                      rc.parallel.tp_regather});
  TensorParallel* tp = tensor_parallel ? &*tensor_parallel : nullptr;
  // The rank's state: the whole model's (TrainingState, with DataParallel over the ranks), or under
  // ZeRO 3 its shards and the model that gathers its blocks from them.
  std::optional<TrainingState> state;
  std::optional<DataParallel> dp;
  std::optional<ShardedDataParallel> zero3;
  if (sharded) {
    zero3.emplace(grid->dp(), mc, placement.dtype, adamw_options(rc), rc.parallel, rc.optimizer.offload,
                  placement.lora);
  } else {
    state.emplace(mc, placement.dtype, placement.device, adamw_options(rc),
                  TrainingStateOptions{.full_optimizer = rc.parallel.zero == 0 || !comm,
                                  .tp = tp,
                                  .lora = placement.lora,
                                  .offload_optimizer = rc.optimizer.offload,
                                  .cast_layers = rc.schedule.cast_layers});
    if (context_parallel) state->model().set_context_parallel(&*context_parallel);
    if (comm) dp.emplace(grid->dp(), *state, rc.parallel, tp);
  }
  const RankGroups groups{comm, grid ? &*grid : nullptr, dp ? &*dp : nullptr, tp, zero3 ? &*zero3 : nullptr,
                          cp_comm.get()};
  auto schedule = Schedule::create(rc.schedule_options());

  RunDirectory run_dir(result.run_dir);
  if (lead) run_dir.remove_stale_temporaries();
  if (comm) comm->barrier();  // before any rank reads the directory or stages into it
  const std::string metrics_path = (fs::path(result.run_dir) / "metrics.jsonl").string();
  const ResumePoint progress =
      zero3 ? resume_or_initialise(rc, mc, resume, run_dir, result.run_dir, metrics_path, *zero3, sampler, groups, log)
            : resume_or_initialise(rc, mc, resume, run_dir, result.run_dir, metrics_path, *state, sampler, groups, log);
  std::optional<MetricsLog> metrics;
  if (lead) {
    write_text_atomic((fs::path(result.run_dir) / "config.toml").string(), rc.to_toml());
    for (const auto& [name, text] : tokenizer_files(*tokenizer))
      write_text_atomic((fs::path(result.run_dir) / name).string(), text);
    metrics.emplace(metrics_path);
  }
  print_header(rc, placement, data, planned, result.run_dir, log);
  // The sample: from the whole weights on rank 0 (TP: the first replica's ranks assemble them
  // together; ZeRO 3: every rank's shard gathered).
  const auto sample = [&](const char* title) {
    const HostWeights weights = zero3 ? whole_master(*zero3, groups) : whole_master(*state, mc, groups);
    const std::optional<ParamSet> base = !placement.lora.enabled() ? std::nullopt
                                         : zero3                 ? whole_base(*zero3, groups)
                                                                 : whole_base(*state, mc, groups);
    if (lead) print_sample(rc, mc, placement.lora, *weights, base ? &*base : nullptr, *tokenizer, title, log);
  };
  if (opt.print_sample && progress.step == 0 && rc.sample.at_start && rc.sample.tokens > 0) sample("sample before training");

  TrainLoop(rc, opt, placement, data.split, state ? &*state : nullptr, *schedule, sampler, run_dir,
            metrics ? &*metrics : nullptr, *tokenizer, groups, log)
      .run(progress, result);

  const int64_t step = result.last_step;
  const double last_loss = result.last_loss;
  if (lead && rc.log.plot)  // from the metrics log, so a resumed run's picture has its whole history
    write_svg((fs::path(result.run_dir) / "loss.svg").string(),
              run_chart(metrics_path, fmt::format("{} / {}: training against tokens seen", rc.model.source,
                                                  schedule_name(rc.schedule.kind))));
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  // Which kernel took the run's attention calls (training and evaluation) and why.
  if (lead && !placement.device.is_cpu()) log << attention_census_text(attention_census(), "over the run");
  log << fmt::format("done: step {}, loss {:.4f}{}, {} in {}\n", step, last_loss,
                     result.last_eval_loss ? fmt::format(", eval loss {:.4f}", *result.last_eval_loss) : "",
                     result.interrupted ? "interrupted" : "finished", short_duration(total));
  if (opt.print_sample && !result.interrupted && rc.sample.tokens > 0) sample("sample");
  return result;
}

}  // namespace cw
