#include "tools/gradcheck.h"

#include "engine/random.h"
#include "model/checkpoint.h"
#include "model/reference.h"
#include "tools/model_io.h"
#include "model/safetensors.h"
#include "optim/training.h"
#include "parallel/comm.h"
#include "parallel/context_parallel.h"
#include "parallel/data_parallel.h"
#include "parallel/grid.h"
#include "parallel/tensor_parallel.h"
#include "parallel/zero3.h"

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <fmt/ranges.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <ostream>

namespace cw {

namespace {
// Sequence b's document starts: the lengths rotated by b places.
std::vector<std::vector<int64_t>> document_starts(const std::vector<int64_t>& lengths, int64_t batch, int64_t seq) {
  int64_t total = 0;
  for (const int64_t n : lengths) {
    if (n < 1) fail(fmt::format("--documents: a document of {} tokens", n), "give lengths of at least 1 token");
    total += n;
  }
  if (total != seq)
    fail(fmt::format("--documents lengths sum to {}, but --seq is {}", total, seq), "give lengths that sum to --seq");
  std::vector<std::vector<int64_t>> starts(static_cast<size_t>(batch));
  const size_t n = lengths.size();
  for (int64_t b = 0; b < batch; ++b) {
    int64_t at = 0;
    for (size_t i = 0; i < n; ++i) {
      starts[static_cast<size_t>(b)].push_back(at);
      at += lengths[(i + static_cast<size_t>(b)) % n];
    }
  }
  return starts;
}

Batch load_batch(const GradcheckOptions& o, int64_t vocab) {
  Batch batch = o.tokens_file.empty() ? random_batch(o.batch, o.seq, vocab, o.seed + 1)
                                      : read_token_batch(o.tokens_file, o.batch, o.seq, vocab);
  if (!o.documents.empty()) set_documents(batch, document_starts(o.documents, o.batch, o.seq), o.positions == "document");
  return batch;
}

// Tokens [t0, t1) of sequence b as a batch of one sequence (ids and the packed batch's labels).
Batch document_batch(const Batch& batch, int64_t b, int64_t t0, int64_t t1) {
  const int64_t T = batch.T(), n = t1 - t0;
  Batch doc{OwnedTensor(DType::i32, {1, n}), OwnedTensor(DType::i32, {1, n})};
  std::memcpy(doc.ids.tensor.data, batch.ids.tensor.ptr<int32_t>() + b * T + t0, static_cast<size_t>(n) * 4);
  std::memcpy(doc.labels.tensor.data, batch.labels.tensor.ptr<int32_t>() + b * T + t0, static_cast<size_t>(n) * 4);
  return doc;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += fmt::format("{}{}", i ? ", " : "", s[i]);
  return r + "]";
}

// Gradient of the batch loss under a schedule, into a fresh zeroed ParamSet.
StepStats gradients(const ScheduleOptions& so, LlamaModel& model, const Batch& batch, const ParamSet& grads) {
  auto schedule = Schedule::create(so);
  return schedule->step(model, batch, grads);
}

double dot(const Tensor& a, const Tensor& b) {
  OwnedTensor a64 = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{a.numel()});
  OwnedTensor b64 = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{b.numel()});
  copy_convert(a64, a.view({a.numel()}));
  copy_convert(b64, b.view({b.numel()}));
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += a64.tensor.ptr<double>()[i] * b64.tensor.ptr<double>()[i];
  return s;
}

// The tensor column's width: 48, or the longest name (PEFT's adapter names run to 64 characters).
size_t name_width(const ParamSet& set) {
  size_t w = 48;
  for (const ParamSpec& s : set.specs()) w = std::max(w, s.name.size());
  return w;
}

// One row per tensor: rel_err = ||a - b||_2 / ||b||_2 and the worst element; returns the largest.
double compare_sets(const ParamSet& ours, const ParamSet& ref, const char* norm_name, const char* ref_name,
                    std::ostream& out) {
  const size_t w = name_width(ours);
  out << fmt::format("{:<{}} {:<14} {:>13} {:>10} {:>28}\n", "tensor", w, "shape", fmt::format("||{}||", norm_name),
                     "rel_err", fmt::format("worst element (ours / {})", ref_name));
  double max_rel = 0;
  for (size_t i = 0; i < ours.size(); ++i) {
    const Tensor a = ours[i], b = ref[i];
    OwnedTensor a64 = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{a.numel()});
    OwnedTensor b64 = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{b.numel()});
    copy_convert(a64, a.view({a.numel()}));
    copy_convert(b64, b.view({b.numel()}));
    double num = 0, den = 0, worst_abs = -1, wa = 0, wb = 0;
    for (int64_t k = 0; k < a.numel(); ++k) {
      const double x = a64.tensor.ptr<double>()[k], y = b64.tensor.ptr<double>()[k];
      num += (x - y) * (x - y);
      den += y * y;
      if (std::abs(x - y) > worst_abs) {
        worst_abs = std::abs(x - y);
        wa = x;
        wb = y;
      }
    }
    const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    max_rel = std::max(max_rel, rel);
    out << fmt::format("{:<{}} {:<14} {:>13.6e} {:>10.3e} {:>28}\n", ours.specs()[i].name, w,
                       shape_str(ours.specs()[i].shape), std::sqrt(den), rel, fmt::format("{:.6e} / {:.6e}", wa, wb));
  }
  return max_rel;
}

// The loss row (below a table of `set`); returns its relative error.
double compare_loss(double ours, double ref, const ParamSet& set, std::ostream& out) {
  const double rel = std::abs(ours - ref) / std::max(std::abs(ref), 1e-300);
  out << fmt::format("{:<{}} {:<14} {:>13.6e} {:>10.3e} {:>28}\n", "loss", name_width(set), "[]", std::abs(ref), rel,
                     fmt::format("{:.10e} / {:.10e}", ours, ref));
  return rel;
}

bool same_bits(const ParamSet& a, const ParamSet& b) {
  return a.bytes() == b.bytes() && std::memcmp(a.flat().data, b.flat().data, a.bytes()) == 0;
}

// Sequences [first, first + count) of a batch.
Batch batch_rows(const Batch& batch, int64_t first, int64_t count) {
  const int64_t T = batch.T();
  Batch part{OwnedTensor(DType::i32, {count, T}), OwnedTensor(DType::i32, {count, T})};
  copy_convert(part.ids, batch.ids.tensor.slice(0, first, count));
  copy_convert(part.labels, batch.labels.tensor.slice(0, first, count));
  return part;
}

// The learning rate of the AdamW steps against single: large enough that the steps move every
// parameter well beyond rounding, so that a wrong update shows.
constexpr double kCheckLearningRate = 1e-3;
// The default --tol: finite differences (fourth-order stencil, f64: truncation and rounding far
// below it), and two exact computations of the same f64 gradient summed in other orders (full,
// single, separate, reference).
constexpr double kFiniteDifferenceTol = 1e-7;
constexpr double kExactF64Tol = 1e-12;
// LoRA's B in a check: random rather than PEFT's zero (A's gradient is s Bᵀ(...), zero while B is),
// at a scale where the adapters change the model's outputs by a few percent.
constexpr double kLoraCheckBStd = 0.05;

// One training run: the loss and gradients of its first step, the parameters after its last.
struct RunResult {
  double loss = 0;
  ParamSet grads, params;
};

// The initial model of a training run of the check: the base, then (LoRA) the adapters.
void load_initial(TrainingState& st, const LlamaModel& init) {
  st.load_base(init.params());
  if (init.has_adapters()) st.load_master(init.adapters());
}

// One process on the whole batch: the reference of --against single.
RunResult single_run(const GradcheckOptions& o, const LlamaConfig& config, DType dtype, Device device,
                     const LlamaModel& init, const Batch& batch) {
  TrainingState st(config, dtype, device, AdamWOptions{}, {.lora = o.lora});
  load_initial(st, init);
  auto schedule = Schedule::create(o.schedule);
  RunResult r{0, ParamSet::like(init.trainable(), dtype), ParamSet::like(init.trainable(), dtype)};
  for (int s = 0; s < o.optimizer_steps; ++s) {
    st.grads().zero();
    const StepStats stats = schedule->step(st.model(), batch, st.grads(), 0, static_cast<uint64_t>(s));
    if (s == 0) {
      r.loss = stats.loss;
      copy_params(r.grads, st.grads());
    }
    st.optimizer_step(kCheckLearningRate);
  }
  copy_params(r.params, st.master());
  return r;
}

// What one rank of a grid run leaves behind.
struct GridRank {
  double loss = 0;                 // the first step's global loss
  std::optional<ParamSet> grads;   // the first step's reduced gradient of its TP shard, valid in [begin, end)
  std::optional<ParamSet> params;  // its TP shard's master weights after the last step
  int64_t begin = 0, end = 0;      // ZeRO 2: its DP shard of the flat vector; else all of it
  DataParallelStep first_step;
  Zero3Counts zero3;               // ZeRO 3: the first step's gathers and reduce-scatters
  size_t buffer_high_water = 0, buffer_requested = 0, buffer_largest = 0;
  int64_t buffer_requests = 0;
};

// What a grid run gives for the comparison, assembled into whole-model tensors.
struct GridResult {
  RunResult run;
  bool ranks_agree = true;
  std::vector<GridRank> ranks;  // by world rank
};

// A rank's set copied into host memory (its table and dtype): what it leaves for the comparison.
ParamSet host_copy(const ParamSet& set) {
  ParamSet copy = ParamSet::like(set, set.dtype(), Device::host());
  copy_params(copy, set);
  return copy;
}

// One rank of a ZeRO 3 run (parallel/zero3.h; no TP) on its communicator's device (a thread's host
// memory, or a launched process's GPU over NCCL): the DP rank's sequences as grid_rank's, the first
// step's reduced gradient and the final parameters gathered whole from the ranks' shards
// (ShardedParameters::gather_whole, a collective every rank joins) into host sets. With LoRA the
// shards are the frozen base and the adapters, replicated, are what is compared.
GridRank zero3_rank(const GradcheckOptions& o, Communicator& world, const LlamaConfig& config, DType dtype,
                    const LlamaModel& init, const Batch& batch) {
  const int64_t per_rank = batch.B() / o.parallel.dp;
  ShardedDataParallel dp(world, config, dtype, AdamWOptions{}, o.parallel, false, o.lora);
  dp.shards().load(init.params());
  if (dp.lora()) dp.load_adapters(init.adapters());
  auto schedule = Schedule::create(o.schedule);
  std::vector<Batch> micro;
  micro.push_back(batch_rows(batch, dp.rank() * per_rank, per_rank));
  micro.back().sequence0 = dp.rank() * per_rank;
  GridRank r;
  for (int s = 0; s < o.optimizer_steps; ++s) {
    const DataParallelStep step = dp.compute_gradients(*schedule, micro, static_cast<uint64_t>(s));
    if (s == 0) {
      r.first_step = step;
      r.zero3 = dp.step_counts();
      r.loss = step.loss;
      r.grads.emplace(dp.lora() ? host_copy(dp.adapter_grads()) : dp.shards().gather_whole(dp.shards().grads()));
      r.end = r.grads->numel();
    }
    dp.optimizer_step(kCheckLearningRate);
  }
  r.params.emplace(dp.lora() ? host_copy(dp.adapter_master()) : dp.shards().gather_whole(dp.shards().master()));
  return r;
}

// One rank of a dp x tp grid (parallel/grid.h) on its communicator's device: DP rank d takes
// sequences [d B/dp, (d+1) B/dp) of the batch and TP rank t holds shard t of the initial model; every
// step goes through DataParallel on the DP group with the TP group's replicated-gradient reduction.
// ZeRO 3 goes to zero3_rank.
GridRank grid_rank(const GradcheckOptions& o, int64_t zero, Communicator& world, const LlamaConfig& config,
                   DType dtype, const LlamaModel& init, const Batch& batch) {
  if (zero == 3) return zero3_rank(o, world, config, dtype, init, batch);
  const int DP = static_cast<int>(o.parallel.dp), TP = static_cast<int>(o.parallel.tp);
  const int64_t per_rank = batch.B() / DP;
  ParallelOptions po = o.parallel;
  po.zero = zero;
  const ParallelGrid grid(world, DP, TP);
  std::optional<TensorParallel> tp_group;
  if (TP > 1) tp_group.emplace(grid.tp(), TensorParallelOptions{o.parallel.sequence_parallel, o.parallel.tp_regather});
  TensorParallel* tp = tp_group ? &*tp_group : nullptr;
  TrainingState st(config, dtype, world.device(), AdamWOptions{},
                   {.full_optimizer = zero == 0, .tp = tp, .lora = o.lora});
  if (TP > 1) {  // the rank's shard of the same initial model, and of its adapters
    ParamSet shard(tp_shard_config(config, TP), dtype);
    shard_parameters(shard, init.params(), grid.tp_rank(), TP);
    st.load_base(shard);
    if (init.has_adapters()) {
      ParamSet adapters = ParamSet::like(st.model().adapters(), dtype, Device::host());
      shard_parameters(adapters, init.adapters(), grid.tp_rank(), TP);
      st.load_master(adapters);
    }
  } else {
    load_initial(st, init);
  }
  DataParallel dp(grid.dp(), st, po, tp);
  auto schedule = Schedule::create(o.schedule);
  std::vector<Batch> micro;
  micro.push_back(batch_rows(batch, grid.dp_rank() * per_rank, per_rank));
  micro.back().sequence0 = grid.dp_rank() * per_rank;  // LoRA's dropout masks: one process's
  GridRank r;
  for (int s = 0; s < o.optimizer_steps; ++s) {
    const DataParallelStep step = dp.compute_gradients(*schedule, micro, static_cast<uint64_t>(s));
    if (s == 0) {
      r.first_step = step;
      r.loss = step.loss;
      r.grads.emplace(host_copy(st.grads()));
      r.begin = zero == 2 ? dp.shard_begin(dp.rank()) : 0;
      r.end = zero == 2 ? dp.shard_end(dp.rank()) : st.grads().numel();
    }
    dp.optimizer_step(kCheckLearningRate);
  }
  r.params.emplace(host_copy(st.master()));
  if (tp) {
    r.buffer_high_water = tp->buffer().capacity_bytes();
    r.buffer_requested = tp->buffer().requested_bytes();
    r.buffer_largest = tp->buffer().largest_request();
    r.buffer_requests = tp->buffer().requests();
  }
  return r;
}

// The ranks' results (by world rank) as whole-model sets: the gradient assembled from the ranks'
// parts (ZeRO 2: each DP rank's own range of its TP shard), the parameters from DP rank 0's TP
// shards. ranks_agree: the DP ranks of a TP shard hold the same bits of its parameters (and, without
// ZeRO 2, of its gradient), every TP rank the same bits of the replicated ones, and every rank the
// same loss.
GridResult assemble_grid(const GradcheckOptions& o, int64_t zero, std::vector<GridRank> ranks, DType dtype,
                         const LlamaModel& init) {
  const int DP = static_cast<int>(o.parallel.dp), TP = static_cast<int>(o.parallel.tp);
  GridResult result;
  result.ranks = std::move(ranks);
  // Whole-model sets (the adapters' under LoRA).
  result.run = RunResult{result.ranks[0].loss, ParamSet::like(init.trainable(), dtype),
                         ParamSet::like(init.trainable(), dtype)};
  const auto at = [&](int d, int t) -> const GridRank& {
    return result.ranks[static_cast<size_t>(ParallelGrid::world_rank(d, t, TP))];
  };
  for (int t = 0; t < TP; ++t) {
    ParamSet grads = ParamSet::like(*at(0, t).grads, dtype);
    for (int d = 0; d < DP; ++d) {
      const GridRank& r = at(d, t);
      copy_convert(grads.flat().slice(0, r.begin, r.end - r.begin), r.grads->flat().slice(0, r.begin, r.end - r.begin));
      result.ranks_agree = result.ranks_agree && r.loss == result.ranks[0].loss &&
                           same_bits(*r.params, *at(0, t).params) && (zero == 2 || same_bits(*r.grads, *at(0, t).grads));
    }
    if (TP == 1) {
      copy_params(result.run.grads, grads);
      copy_params(result.run.params, *at(0, t).params);
      continue;
    }
    unshard_parameters(result.run.grads, grads, t, TP, /*with_replicated=*/t == 0);
    unshard_parameters(result.run.params, *at(0, t).params, t, TP, /*with_replicated=*/t == 0);
    // The replicated tensors: the same bits on every TP rank (gradients where this rank holds them).
    for (size_t i = 0; i < grads.size(); ++i) {
      if (tp_split_dim(grads.specs()[i]) >= 0) continue;
      result.ranks_agree = result.ranks_agree && std::memcmp((*at(0, t).params)[i].data, (*at(0, 0).params)[i].data,
                                                             (*at(0, 0).params)[i].bytes()) == 0;
      if (zero < 2)
        result.ranks_agree = result.ranks_agree && std::memcmp((*at(0, t).grads)[i].data, (*at(0, 0).grads)[i].data,
                                                               (*at(0, 0).grads)[i].bytes()) == 0;
    }
  }
  return result;
}

// A rank's result as a file, for a launched grid (one process per rank): its gradient and
// parameters (ZeRO 3: gathered whole from the shards), and the figures as metadata (the loss to all
// 17 digits, ZeRO 3's counts of gathers and reduce-scatters).
void write_grid_rank(const std::string& path, const GridRank& r) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (size_t i = 0; i < r.grads->size(); ++i) tensors.emplace_back("grads/" + r.grads->specs()[i].name, (*r.grads)[i]);
  for (size_t i = 0; i < r.params->size(); ++i)
    tensors.emplace_back("params/" + r.params->specs()[i].name, (*r.params)[i]);
  const StepStats& st = r.first_step.stats;
  write_safetensors(path, tensors,
                    {{"loss", fmt::format("{:.17g}", r.loss)}, {"begin", std::to_string(r.begin)},
                     {"end", std::to_string(r.end)}, {"buckets", std::to_string(r.first_step.buckets)},
                     {"buckets_in_backward", std::to_string(r.first_step.buckets_in_backward)},
                     {"activation_high_water", std::to_string(st.activation_high_water)},
                     {"buffer_high_water", std::to_string(r.buffer_high_water)},
                     {"buffer_requested", std::to_string(r.buffer_requested)},
                     {"buffer_largest", std::to_string(r.buffer_largest)},
                     {"buffer_requests", std::to_string(r.buffer_requests)},
                     {"zero3_block_gathers", std::to_string(r.zero3.block_gathers)},
                     {"zero3_outside_gathers", std::to_string(r.zero3.outside_gathers)},
                     {"zero3_prefetched", std::to_string(r.zero3.prefetched)},
                     {"zero3_reuses", std::to_string(r.zero3.reuses)},
                     {"zero3_block_reduce_scatters", std::to_string(r.zero3.block_reduce_scatters)},
                     {"zero3_outside_reduce_scatters", std::to_string(r.zero3.outside_reduce_scatters)},
                     {"zero3_gathered_bytes", std::to_string(r.zero3.gathered_bytes)},
                     {"zero3_scattered_bytes", std::to_string(r.zero3.scattered_bytes)}});
}

// The same read back into host sets with the table of `like` (the rank's TP shard).
GridRank read_grid_rank(const std::string& path, const ParamSet& like, DType dtype) {
  const SafetensorsReader f(path);
  GridRank r;
  r.grads.emplace(ParamSet::like(like, dtype, Device::host()));
  r.params.emplace(ParamSet::like(like, dtype, Device::host()));
  for (size_t i = 0; i < like.size(); ++i) {
    f.read_into("grads/" + like.specs()[i].name, (*r.grads)[i]);
    f.read_into("params/" + like.specs()[i].name, (*r.params)[i]);
  }
  const auto number = [&](const char* key) {
    const auto it = f.metadata().find(key);
    CW_CHECK(it != f.metadata().end(), "{}: metadata '{}' is missing", path, key);
    return it->second;
  };
  r.loss = std::stod(number("loss"));
  r.begin = std::stoll(number("begin"));
  r.end = std::stoll(number("end"));
  r.first_step.loss = r.loss;
  r.first_step.buckets = std::stoll(number("buckets"));
  r.first_step.buckets_in_backward = std::stoll(number("buckets_in_backward"));
  r.first_step.stats.activation_high_water = std::stoull(number("activation_high_water"));
  r.buffer_high_water = std::stoull(number("buffer_high_water"));
  r.buffer_requested = std::stoull(number("buffer_requested"));
  r.buffer_largest = std::stoull(number("buffer_largest"));
  r.buffer_requests = std::stoll(number("buffer_requests"));
  r.zero3.block_gathers = std::stoll(number("zero3_block_gathers"));
  r.zero3.outside_gathers = std::stoll(number("zero3_outside_gathers"));
  r.zero3.prefetched = std::stoll(number("zero3_prefetched"));
  r.zero3.reuses = std::stoll(number("zero3_reuses"));
  r.zero3.block_reduce_scatters = std::stoll(number("zero3_block_reduce_scatters"));
  r.zero3.outside_reduce_scatters = std::stoll(number("zero3_outside_reduce_scatters"));
  r.zero3.gathered_bytes = std::stoll(number("zero3_gathered_bytes"));
  r.zero3.scattered_bytes = std::stoll(number("zero3_scattered_bytes"));
  return r;
}

// dp x tp ranks: as threads of this process (world null: the CPU's threads backend), or as the
// processes of a launched world (each computes its own rank, writes it to o.gather_dir, and rank 0
// reads them all). The whole result on rank 0 (and with threads); nullopt on the other processes.
std::optional<GridResult> grid_run(const GradcheckOptions& o, int64_t zero, const LlamaConfig& config, DType dtype,
                                   const LlamaModel& init, const Batch& batch, Communicator* world) {
  const int ranks = static_cast<int>(o.parallel.dp * o.parallel.tp);
  const std::filesystem::path dir = std::filesystem::path(o.gather_dir) / fmt::format("zero{}", zero);
  const auto file = [&](int rank) { return (dir / fmt::format("rank-{}.safetensors", rank)).string(); };
  // Each rank's result, through gather_dir when it is given (a launched world needs it; thread ranks
  // take the same path with it, which is how the CPU tests cover it).
  const auto one_rank = [&](Communicator& w) {
    GridRank r = grid_rank(o, zero, w, config, dtype, init, batch);
    if (!o.gather_dir.empty()) {
      if (w.rank() == 0) std::filesystem::create_directories(dir);
      w.barrier();
      write_grid_rank(file(w.rank()), r);
      w.barrier();  // every rank's file is complete
    }
    return r;
  };
  std::vector<GridRank> by_rank(static_cast<size_t>(ranks));
  std::optional<GridRank> mine;
  if (world) mine = one_rank(*world);
  else run_thread_ranks(ranks, [&](Communicator& w) { by_rank[static_cast<size_t>(w.rank())] = one_rank(w); });
  if (world && world->rank() != 0) return std::nullopt;
  if (!o.gather_dir.empty()) {
    const ParamSet like = ParamSet::like(world ? *mine->grads : *by_rank[0].grads, dtype);  // every rank: the same table
    for (int r = 0; r < ranks; ++r) by_rank[static_cast<size_t>(r)] = read_grid_rank(file(r), like, dtype);
  }
  return assemble_grid(o, zero, std::move(by_rank), dtype, init);
}

// The ranks' run against one process's: the first step's loss and gradients, the parameters after
// the optimizer steps, and whether the ranks agreed bitwise on `what`; the worst relative error
// (1 when they did not agree).
double compare_with_single(const GradcheckOptions& o, const RunResult& ranks, const RunResult& single,
                           bool agree, const std::string& what, std::ostream& out) {
  out << "first step: gradients against one process on the whole batch\n";
  double max_rel = compare_sets(ranks.grads, single.grads, "g_single", "single", out);
  max_rel = std::max(max_rel, compare_loss(ranks.loss, single.loss, ranks.grads, out));
  out << fmt::format("after {} AdamW steps (lr {}): parameters against one process\n", o.optimizer_steps,
                     kCheckLearningRate);
  max_rel = std::max(max_rel, compare_sets(ranks.params, single.params, "p_single", "single", out));
  out << fmt::format("ranks hold bitwise the same {}: {}\n", what, agree ? "yes" : "NO");
  return agree ? max_rel : std::max(max_rel, 1.0);
}

// --cp P against single (see the header): one rank of a context-parallel group, on its
// communicator's device (a thread's host memory, or a launched process's GPU over NCCL). With --dp D
// the world is D x P ranks, rank w in DP rank w / P (its B/D sequences) and CP rank w % P (c/P tokens
// of their every chunk); every rank's gradient is its tokens' share of the whole batch's (the loss
// divided by the whole batch's count of labels), and one all-reduce over the world sums them before
// each optimizer step. Its run, in host sets; and whether every rank ended with rank 0's parameters
// bitwise (a collective every rank joins).
std::pair<RunResult, bool> context_parallel_rank(const GradcheckOptions& o, Communicator& world,
                                                 const LlamaConfig& config, DType dtype, const LlamaModel& init,
                                                 const Batch& batch) {
  const int P = static_cast<int>(o.parallel.cp), D = static_cast<int>(o.parallel.dp), d = world.rank() / P;
  const std::unique_ptr<Communicator> cp_comm = world.split(d, world.rank() % P);  // the ranks of DP rank d
  const int64_t per_rank = batch.B() / D;
  Batch mine = batch_rows(batch, d * per_rank, per_rank);
  mine.sequence0 = d * per_rank;
  const double normaliser = static_cast<double>(std::max<int64_t>(1, batch.supervised()));
  TrainingState st(config, dtype, world.device(), AdamWOptions{}, {.lora = o.lora});
  load_initial(st, init);
  ContextParallel group(*cp_comm);
  st.model().set_context_parallel(&group);
  auto schedule = Schedule::create(o.schedule);
  RunResult r{0, ParamSet::like(init.trainable(), dtype), ParamSet::like(init.trainable(), dtype)};
  for (int s = 0; s < o.optimizer_steps; ++s) {
    st.grads().zero();
    const StepStats stats = schedule->step(st.model(), mine, st.grads(), normaliser, static_cast<uint64_t>(s));
    world.all_reduce(st.grads().flat())->wait();  // each rank's tokens' share, summed: the whole gradient
    std::vector<double> loss{stats.loss};
    sum_host_values(world, loss);
    if (s == 0) {
      r.loss = loss[0];
      copy_params(r.grads, st.grads());
    }
    st.optimizer_step(kCheckLearningRate);
  }
  copy_params(r.params, st.master());
  // Rank 0's parameters to every rank, compared there; the ranks that differ counted.
  const ParamSet rank0 = ParamSet::like(st.master(), st.master().dtype());
  copy_params(rank0, st.master());
  world.broadcast(rank0.flat(), 0)->wait();
  std::vector<double> differ{same_bits(host_copy(rank0), r.params) ? 0.0 : 1.0};
  sum_host_values(world, differ);
  return {std::move(r), differ[0] == 0};
}

// The ranks as threads (world null) or as the launched world's processes: rank 0's result (the other
// processes of a launched world get nullopt).
std::optional<std::pair<RunResult, bool>> context_parallel_run(const GradcheckOptions& o, const LlamaConfig& config,
                                                               DType dtype, const LlamaModel& init, const Batch& batch,
                                                               Communicator* world) {
  if (world) {
    auto mine = context_parallel_rank(o, *world, config, dtype, init, batch);
    if (world->rank() != 0) return std::nullopt;
    return mine;
  }
  std::optional<std::pair<RunResult, bool>> first;
  run_thread_ranks(static_cast<int>(o.parallel.cp * o.parallel.dp), [&](Communicator& comm) {
    auto mine = context_parallel_rank(o, comm, config, dtype, init, batch);
    if (comm.rank() == 0) first = std::move(mine);
  });
  return first;
}

double against_single_cp(const GradcheckOptions& o, const LlamaConfig& config, DType dtype, const LlamaModel& init,
                         const Batch& batch, std::ostream& out, Communicator* world) {
  const auto result = context_parallel_run(o, config, dtype, init, batch, world);
  if (!result) return 0;  // a launched rank other than 0: rank 0 compares
  const auto& [cp, agree] = *result;
  const RunResult single = single_run(o, config, dtype, world ? world->device() : Device::host(), init, batch);
  const LlamaConfig heads = cp_attention_config(config, o.parallel.cp);
  out << fmt::format("context parallel: {} ranks ({}), each 1/{} of every chunk's tokens and {} of {} heads ({} of "
                     "{} K/V heads in its store){}\n",
                     o.parallel.cp, world ? "processes through NCCL" : "threads", o.parallel.cp, heads.num_attention_heads,
                     config.num_attention_heads, heads.num_key_value_heads, config.num_key_value_heads,
                     o.parallel.dp > 1 ? fmt::format(", in each of {} data-parallel ranks of {} sequences",
                                                     o.parallel.dp, batch.B() / o.parallel.dp)
                                       : "");
  return compare_with_single(o, cp, single, agree, "parameters", out);
}

// --against single: see the header.
// world: null for thread ranks; a launched world's communicator (every process calls this, rank 0
// prints and compares, the others return 0 after the collective runs).
double against_single(const GradcheckOptions& o, const LlamaConfig& config, DType dtype, const LlamaModel& init,
                      const Batch& batch, std::ostream& out, Communicator* world) {
  const std::optional<GridResult> result = grid_run(o, o.parallel.zero, config, dtype, init, batch, world);
  // ZeRO's reference, zero 0, runs on every rank too (its collectives need them all).
  const std::optional<GridResult> plain =
      o.parallel.zero > 0 ? grid_run(o, 0, config, dtype, init, batch, world) : std::nullopt;
  if (!result) return 0;  // a launched rank other than 0: rank 0 compares
  const GridResult& grid = *result;
  // The reference: one process on the whole batch, on this process's device (rank 0's GPU when launched).
  const RunResult single = single_run(o, config, dtype, world ? world->device() : Device::host(), init, batch);
  const int64_t DP = o.parallel.dp, TP = o.parallel.tp;
  const char* kind = world ? "processes through NCCL" : "threads";
  out << fmt::format("data parallel: {} ranks ({}) x {} sequences, zero {}, {} gradient reductions, {} launched "
                     "inside the last backward\n",
                     DP, kind, batch.B() / DP, o.parallel.zero, grid.ranks[0].first_step.buckets,
                     grid.ranks[0].first_step.buckets_in_backward);
  if (TP > 1) {
    out << fmt::format("tensor parallel: {} ranks ({}) per data-parallel rank, sequence parallel {}, regather {}\n",
                       TP, kind, o.parallel.sequence_parallel, o.parallel.tp_regather);
    for (int t = 0; t < TP; ++t) {
      const GridRank& r = grid.ranks[static_cast<size_t>(t)];  // DP rank 0's
      out << fmt::format("tp rank {}: activations high-water {} B; reusable buffer high-water {} B (largest request {} "
                         "B) for {} requests of {} B in all\n",
                         t, r.first_step.stats.activation_high_water, r.buffer_high_water, r.buffer_largest,
                         r.buffer_requests, r.buffer_requested);
    }
  }
  if (o.parallel.zero == 3) {
    const Zero3Counts& z = grid.ranks[0].zero3;
    out << fmt::format("zero 3: first step, rank 0: {} block gathers ({} prefetched ahead of use), {} blocks reused "
                       "from their buffer, {} outside-block gathers, {} block and {} outside-block gradient "
                       "reduce-scatters; {} B gathered, {} B reduce-scattered\n",
                       z.block_gathers, z.prefetched, z.reuses, z.outside_gathers, z.block_reduce_scatters,
                       z.outside_reduce_scatters, z.gathered_bytes, z.scattered_bytes);
  }
  const std::string what = std::string("loss and parameters") + (o.parallel.zero == 2 ? "" : ", gradients") +
                           (TP > 1 ? " (of each TP shard; the replicated tensors on every TP rank)" : "");
  double max_rel = compare_with_single(o, grid.run, single, grid.ranks_agree, what, out);
  // Each backward chunk's gradient is reduce-scattered on its own and the shard sums them: the chunks'
  // sum is taken after the ranks', not before as ZeRO 0's one all-reduce takes it. (Under LoRA the
  // adapters' gradient is summed over the chunks first and reduced once, as ZeRO 0 does.)
  const bool reduced_per_chunk =
      o.parallel.zero == 3 && !o.lora.enabled() && !o.schedule.one_backward_chunk(o.seq);
  if (plain && reduced_per_chunk) {
    out << fmt::format("zero 3 against zero 0 after {} steps (the gradient reduced per backward chunk):\n",
                       o.optimizer_steps);
    max_rel = std::max(max_rel, compare_sets(grid.run.params, plain->run.params, "p_zero0", "zero 0", out));
    if (!plain->ranks_agree) max_rel = std::max(max_rel, 1.0);
  } else if (plain && o.parallel.zero == 3 && world) {
    // One backward chunk: the same sums as ZeRO 0's, but on a GPU the blocks' weights and gradients
    // lie in the pool's buffers rather than at their offsets in one whole parameter set, and cuBLASLt
    // picks a GEMM's algorithm by its operands' alignment (engine/cuda/linear.cu): bitwise where the
    // algorithms agree, within the tolerance always.
    const bool identical = same_bits(grid.run.params, plain->run.params);
    out << fmt::format("zero 3 against zero 0 after {} steps: parameters {} (on the GPU, the blocks' buffers "
                       "aligned otherwise than in one parameter set):\n",
                       o.optimizer_steps, identical ? "bitwise identical" : "not bitwise identical");
    max_rel = std::max(max_rel, compare_sets(grid.run.params, plain->run.params, "p_zero0", "zero 0", out));
    if (!plain->ranks_agree) max_rel = std::max(max_rel, 1.0);
  } else if (plain) {
    const bool identical = same_bits(grid.run.params, plain->run.params);
    out << fmt::format("zero {} against zero 0 after {} steps: parameters {}\n", o.parallel.zero, o.optimizer_steps,
                       identical ? "bitwise identical" : "DIFFER");
    if (!identical || !plain->ranks_agree) max_rel = std::max(max_rel, 1.0);
  }
  return max_rel;
}
}  // namespace

int run_gradcheck(const GradcheckOptions& o, std::ostream& out, Communicator* world) {
  o.schedule.validate();
  validate_lora(o.lora);
  LlamaConfig config = LlamaConfig::resolve(o.model);
  if (o.tie_embeddings >= 0) config.tie_word_embeddings = o.tie_embeddings == 1;
  const DType dtype = parse_dtype(o.dtype);
  if (dtype == DType::bf16) fail("gradcheck runs in f64 or f32", "use --dtype f64 (f32 on GPUs)");
  if (world) {  // launched: one rank of the grid per process, on its GPU
    if (dtype != DType::f32 || world->device().is_cpu())
      fail("a launched gradcheck runs its ranks on GPUs in f32", "give --dtype f32 (and launch one process per GPU)");
    if (o.parallel.cp > 1 && o.parallel.cp * o.parallel.dp != world->size())
      fail(fmt::format("--cp {} x --dp {} is {} ranks, but {} were launched", o.parallel.cp, o.parallel.dp,
                       o.parallel.cp * o.parallel.dp, world->size()),
           "launch cp x dp processes");
    if (o.parallel.cp == 1 && o.parallel.dp * o.parallel.tp != world->size())
      fail(fmt::format("--dp {} x --tp {} is {} ranks, but {} were launched", o.parallel.dp, o.parallel.tp,
                       o.parallel.dp * o.parallel.tp, world->size()),
           "launch dp x tp processes");
    if (!o.against.empty() && o.against != "single")
      fail(fmt::format("a launched gradcheck compares the ranks with one process: --against single, not {}", o.against));
    if (o.gather_dir.empty())
      fail("a launched gradcheck needs --gather-dir DIR", "a directory every rank can write (one machine: /tmp/...)");
    if (!o.save_grads.empty()) fail("--save-grads with a launched gradcheck is not supported", "drop --save-grads");
  }
  if (o.seq < 2 || o.batch < 1) fail(fmt::format("gradcheck needs --seq >= 2 and --batch >= 1 (got {} and {})", o.seq, o.batch));
  o.parallel.validate();
  const bool parallel = o.parallel.dp > 1 || o.parallel.tp > 1;
  // Ranks (or ZeRO's shards, or a launched world of one) have one reference: one process.
  const bool against_one_process = parallel || o.parallel.zero > 0 || world != nullptr || o.parallel.cp > 1;
  const std::string against = !o.against.empty() ? o.against
                              : against_one_process ? "single"
                                                    : (o.schedule.kind == ScheduleKind::full ? "fd" : "full");
  if (against != "fd" && against != "full" && against != "single" && against != "separate" && against != "reference")
    fail(fmt::format("unknown --against '{}'", against), "use fd, full, single, separate or reference");
  if (against == "reference" && o.lora.dropout > 0)
    fail(fmt::format("--against reference: the reference step has no dropout on the adapters (--lora-dropout {})",
                     o.lora.dropout),
         "give --lora-dropout 0 (--against full checks the schedules with dropout)");
  if (against == "separate" && o.documents.empty())
    fail("--against separate compares packed documents with each run alone",
         "give --documents L1,L2,... (summing to --seq)");
  if (against != "single" && (parallel || o.parallel.zero > 0))
    fail(fmt::format("--dp / --zero / --tp compare ranks with one process: they need --against single, not {}", against),
         "use --against single (the default with --dp > 1, --tp > 1 or --zero)");
  if (against == "single" && o.parallel.tp > 1 && !o.save_grads.empty())
    fail("--save-grads writes the gradients of one process; with --tp it is not supported", "drop --save-grads");
  if (against == "single" && o.batch % o.parallel.dp != 0)
    fail(fmt::format("--batch {} is not divisible by --dp {}: every rank takes batch / dp sequences", o.batch,
                     o.parallel.dp),
         "give --batch a multiple of --dp");
  if (o.parallel.tp > 1) tp_shard_config(config, o.parallel.tp);  // tp must divide the heads and FFN: say so here
  if (o.parallel.cp > 1) {  // parallel.validate() refused it with --tp and --zero 3
    if (o.parallel.zero > 0)
      fail("gradcheck --cp with --zero is not implemented", "give --cp alone, or with --dp (train runs it with ZeRO 1 and 2)");
    if (!o.documents.empty()) fail("--cp with --documents is not implemented", "drop --documents");
    if (against != "single") fail(fmt::format("--cp compares its ranks with one process: --against single, not {}", against));
    cp_attention_config(config, o.parallel.cp);  // the heads must split over the ranks: say so here
    if (!cp_splits_chunks(o.parallel.cp, o.seq, o.schedule.chunk, o.schedule.bwd_chunk))
      fail(fmt::format("--cp {} splits every chunk's tokens into equal parts: --seq {}, --chunk {} and --bwd-chunk {} "
                       "must be multiples of it",
                       o.parallel.cp, o.seq, o.schedule.chunk, o.schedule.bwd_chunk),
           "give --seq and the chunk lengths as multiples of --cp");
  }
  if (against == "single" && o.optimizer_steps < 1)
    fail(fmt::format("--optimizer-steps must be >= 1, got {}", o.optimizer_steps));
  const double tol = o.tol >= 0 ? o.tol
                                : (against == "fd" ? kFiniteDifferenceTol
                                                   : (dtype == DType::f64 ? kExactF64Tol : (world ? 1e-4 : 1e-5)));

  LlamaModel model(config, dtype, Device::host(), nullptr, o.lora);
  load_or_init(model, o.model, o.seed, o.norm_jitter);
  if (model.has_adapters()) init_lora_parameters(model.adapters(), o.lora.seed, kLoraCheckBStd);
  const Batch batch = load_batch(o, config.vocab_size);

  // What is checked: every parameter, or under LoRA the adapters (the base frozen).
  const ParamSet& checked = model.trainable();
  ParamSet grads = ParamSet::like(checked, dtype);
  const StepStats st = gradients(o.schedule, model, batch, grads);
  out << fmt::format("gradcheck: model {} ({} parameters, {} layers, tied={}), dtype {}, batch {} x {} tokens, "
                     "schedule {} (chunk {}, bwd chunk {}, visited {}/{}), against {}\n",
                     o.model, config.parameter_count(), config.num_hidden_layers, config.tie_word_embeddings, o.dtype,
                     o.batch, o.seq, schedule_name(o.schedule.kind), o.schedule.chunk, o.schedule.bwd_chunk, st.chunks_visited,
                     st.chunks, against);
  if (model.has_adapters())
    out << fmt::format("lora: rank {}, alpha {}, dropout {}, targets {}: {} adapter parameters checked, the base "
                       "frozen\n",
                       o.lora.rank, o.lora.alpha, o.lora.dropout, fmt::join(o.lora.target_names(), ","),
                       checked.numel());
  // Every loss the check evaluates sees step 0's dropout masks, as the step did.
  DropoutRoundScope masks(model, 0);
  double max_rel = 0;
  Arena arena;
  if (against == "single") {
    max_rel = o.parallel.cp > 1 ? against_single_cp(o, config, dtype, model, batch, out, world)
                       : against_single(o, config, dtype, model, batch, out, world);
    if (world) {
      world->barrier();  // every process ends together, after rank 0 has compared
      if (world->rank() != 0) return 0;  // rank 0 says the verdict
    }
  } else if (against == "fd") {
    const size_t w = name_width(checked);
    out << fmt::format("{:<{}} {:<14} {:>13} {:>13} {:>10}\n", "tensor", w, "shape", "g.v", "fd", "rel_err");
    for (size_t i = 0; i < checked.size(); ++i) {
      const Tensor p = checked[i];
      OwnedTensor original = OwnedTensor::of_shape(dtype, std::vector<int64_t>{p.numel()});
      copy_convert(original, p.view({p.numel()}));
      OwnedTensor dir = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{p.numel()});
      double worst = 0, worst_gv = 0, worst_fd = 0;
      for (int d = 0; d < o.directions; ++d) {
        fill_normal(dir, o.seed ^ 0xd1ec7, i * 1000 + static_cast<uint64_t>(d));
        double norm = 0;
        for (int64_t k = 0; k < p.numel(); ++k) norm += dir.tensor.ptr<double>()[k] * dir.tensor.ptr<double>()[k];
        scale_inplace(dir, 1.0 / std::sqrt(norm));
        auto loss_at = [&](double t) {
          // p = original + t * dir, computed in f64 and stored in the model's dtype
          OwnedTensor moved = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{p.numel()});
          copy_convert(moved, original);
          for (int64_t k = 0; k < p.numel(); ++k) moved.tensor.ptr<double>()[k] += t * dir.tensor.ptr<double>()[k];
          copy_convert(p.view({p.numel()}), moved);
          return batch_loss(model, batch, 0, arena);
        };
        const double h = o.step;
        const double fd = (-loss_at(2 * h) + 8 * loss_at(h) - 8 * loss_at(-h) + loss_at(-2 * h)) / (12 * h);
        copy_convert(p.view({p.numel()}), original);
        const double gv = dot(grads[i], dir);
        const double denom = std::max(std::abs(gv), std::abs(fd));
        const double rel = denom > 0 ? std::abs(gv - fd) / denom : 0.0;
        if (rel >= worst) {
          worst = rel;
          worst_gv = gv;
          worst_fd = fd;
        }
      }
      max_rel = std::max(max_rel, worst);
      out << fmt::format("{:<{}} {:<14} {:>13.6e} {:>13.6e} {:>10.3e}\n", checked.specs()[i].name, w,
                         shape_str(checked.specs()[i].shape), worst_gv, worst_fd, worst);
    }
    out << fmt::format("loss={:.17g}\n", st.loss);
  } else if (against == "separate") {
    // Every document alone, the full schedule, each loss divided by the packed batch's normaliser:
    // the sum over documents is the packed batch's mean loss and gradient.
    const ScheduleOptions ref;  // full
    ParamSet ref_grads = ParamSet::like(checked, dtype);
    double ref_loss = 0;
    int64_t documents = 0;
    for (int64_t b = 0; b < batch.B(); ++b) {
      const std::vector<int64_t>& starts = batch.doc_starts[static_cast<size_t>(b)];
      for (size_t i = 0; i < starts.size(); ++i, ++documents) {
        const int64_t t1 = i + 1 < starts.size() ? starts[i + 1] : batch.T();
        const Batch doc = document_batch(batch, b, starts[i], t1);
        if (doc.supervised() == 0) continue;  // a one-token document predicts nothing
        ref_loss += Schedule::create(ref)->step(model, doc, ref_grads, static_cast<double>(st.supervised)).loss;
      }
    }
    out << fmt::format("against {} documents run one by one\n", documents);
    max_rel = compare_sets(grads, ref_grads, "g_separate", "separate", out);
    max_rel = std::max(max_rel, compare_loss(st.loss, ref_loss, grads, out));
  } else if (against == "reference") {
    // The whole-sequence f64 step written from the math (model/reference.h), sharing no layer code
    // with the schedules.
    const ReferenceResult ref =
        reference_step(model, batch.ids, batch.labels, batch.doc_starts, batch.document_positions);
    out << "against the reference step (model/reference.h: whole sequence, f64, by hand)\n";
    max_rel = compare_sets(grads, ref.grads, "g_ref", "reference", out);
    max_rel = std::max(max_rel, compare_loss(st.loss, ref.loss, grads, out));
  } else {
    const ScheduleOptions ref;  // full
    ParamSet ref_grads = ParamSet::like(checked, dtype);
    const StepStats ref_st = gradients(ref, model, batch, ref_grads);
    max_rel = compare_sets(grads, ref_grads, "g_full", "full", out);
    max_rel = std::max(max_rel, compare_loss(st.loss, ref_st.loss, grads, out));
  }
  if (!o.save_grads.empty()) {
    std::vector<OwnedTensor> keep;
    std::vector<std::pair<std::string, Tensor>> tensors;
    keep.emplace_back(DType::f64, std::initializer_list<int64_t>{1});
    keep.back().tensor.ptr<double>()[0] = st.loss;
    tensors.emplace_back("loss", keep.back().tensor);
    for (size_t i = 0; i < grads.size(); ++i) {
      keep.push_back(OwnedTensor::of_shape(DType::f64, grads.specs()[i].shape));
      copy_convert(keep.back(), grads[i]);
      tensors.emplace_back(grads.specs()[i].name, keep.back().tensor);
    }
    write_safetensors(o.save_grads, tensors, {{"format", "pt"}, {"content", "chunkwise gradcheck gradients"}});
    out << fmt::format("wrote loss and {} gradients to {}\n", grads.size(), o.save_grads);
  }
  out << fmt::format("max_rel_err={:.3e}\n", max_rel);
  if (max_rel > tol) {
    out << fmt::format("FAIL: max_rel_err {:.3e} exceeds --tol {:.1e}\n", max_rel, tol);
    return 1;
  }
  return 0;
}

}  // namespace cw
