#include "tools/train/rank_weights.h"

#include "model/checkpoint.h"
#include "model/gguf_llama.h"
#include "model/lora.h"
#include "model/shard.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace cw {

namespace fs = std::filesystem;

namespace {
// The optimizer files of a checkpoint: one process's whole AdamW state; with ZeRO world rank w's
// shard of it; without ZeRO but with tensor parallelism TP rank t's (the moments of its TP shard, the
// same on every replica).
constexpr const char* kOptimizerFile = "optimizer.safetensors";
std::string optimizer_shard_file(int world_rank) { return fmt::format("optimizer-rank-{:05}.safetensors", world_rank); }
std::string optimizer_tp_file(int tp_rank) { return fmt::format("optimizer-tp-{:05}.safetensors", tp_rank); }
// Under ZeRO 3 world rank w's shard of the master weights, its moments in the file beside it.
std::string zero3_shard_file(int world_rank) { return fmt::format("zero3-rank-{:05}.safetensors", world_rank); }

// One integer of a checkpoint's state.json (`object` is the file's root or one of its sections,
// `key` its dotted name there), refused naming the file and key when it is missing, not an integer,
// or outside [min, max]. `absent` is the value of a key older checkpoints do not write.
int64_t state_integer(const nlohmann::json& object, const std::string& file, std::string_view section,
                      std::string_view key, int64_t min, int64_t max, std::optional<int64_t> absent = std::nullopt) {
  const std::string name = section.empty() ? std::string(key) : fmt::format("{}.{}", section, key);
  const std::string k(key);
  if (!object.is_object() || !object.contains(k)) {
    if (absent) return *absent;
    fail(fmt::format("{}: key '{}' is missing", file, name), "the checkpoint is damaged; resume from another one");
  }
  const nlohmann::json& v = object.at(k);
  if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)))
    fail(fmt::format("{}: '{}' must be an integer, got {}", file, name, v.dump()),
         "the checkpoint is damaged; resume from another one");
  const int64_t n = v.get<int64_t>();
  if (n < min || n > max)
    fail(fmt::format("{}: '{}' must be in [{}, {}] for this run, got {}", file, name, min, max, n),
         "the checkpoint is damaged or belongs to another run; resume from another one, or start a new run");
  return n;
}
}  // namespace

std::string RankGroups::optimizer_file_of(int w) const {
  if (zero3 && zero3->lora()) return w == 0 ? kOptimizerFile : "";  // the adapters' state, replicated
  if (zero3) return zero3_shard_file(w);
  if (zero() > 0) return optimizer_shard_file(w);
  if (tp_size() > 1) return w < tp_size() ? optimizer_tp_file(w) : "";  // replica 0's TP ranks: w = t
  return w == 0 ? kOptimizerFile : "";
}

std::vector<std::string> RankGroups::optimizer_files_of(int w) const {
  const std::string file = optimizer_file_of(w);
  if (file.empty()) return {};
  if (zero3 && !zero3->lora()) return {file, file + ".optimizer"};
  return {file};
}

std::string RankGroups::optimizer_file_to_read() const {
  if (zero3) return zero3->lora() ? optimizer_file_of(0) : optimizer_file();  // LoRA: rank 0's, the same on every rank
  if (zero() == 0 && tp_size() > 1) return optimizer_tp_file(tp_rank());
  return zero() > 0 ? optimizer_shard_file(world_rank()) : kOptimizerFile;
}

HostWeights whole_master(TrainingState& state, const LlamaConfig& full_config, const RankGroups& g) {
  if (!g.tp) {
    if (!g.lead()) return {};
    if (state.master().device().is_cpu()) return HostWeights::borrowed(state.master());
    return HostWeights::owned(state.master_on_host());
  }
  if (!g.first_replica()) return {};
  ParamSet full = state.lora() ? ParamSet(full_config, lora_parameter_table(full_config, state.model().lora()),
                                          state.master_dtype())
                               : ParamSet(full_config, state.master_dtype());
  gather_parameters(full, state.master(), g.tp->communicator());
  return HostWeights::owned(std::move(full));
}

HostWeights whole_master(ShardedDataParallel& zero3, const RankGroups& g) {
  if (zero3.lora()) {  // the adapters, replicated: rank 0's own
    if (!g.lead()) return {};
    ParamSet host = ParamSet::like(zero3.adapter_master(), zero3.adapter_master().dtype(), Device::host());
    copy_params(host, zero3.adapter_master());
    return HostWeights::owned(std::move(host));
  }
  std::optional<ParamSet> whole = zero3.shards().gather_whole_to(zero3.shards().master(), /*root=*/0);
  if (!whole) return {};
  return HostWeights::owned(std::move(*whole));
}

std::optional<ParamSet> whole_base(ShardedDataParallel& zero3, const RankGroups&) {
  return zero3.shards().gather_whole_to(zero3.shards().master(), /*root=*/0);
}

std::optional<ParamSet> whole_base(TrainingState& state, const LlamaConfig& full_config, const RankGroups& g) {
  const DType dtype = accum_dtype(state.model().dtype());
  if (!g.tp) return g.lead() ? std::optional<ParamSet>(state.base_on_host(dtype)) : std::nullopt;
  if (!g.first_replica()) return std::nullopt;
  ParamSet full(full_config, dtype);
  gather_parameters(full, state.model().params(), g.tp->communicator());
  return full;
}

namespace {

// This TP rank's shard (the table of `shard_like`) of the whole model's `full` (host).
ParamSet tp_part(const ParamSet& full, const ParamSet& shard_like, const RankGroups& g) {
  ParamSet part = ParamSet::like(shard_like, full.dtype(), Device::host());
  shard_parameters(part, full, g.tp_rank(), g.tp_size());
  return part;
}

// The whole model's master weights (host; under LoRA the whole model's adapters) into this rank's
// state: its TP shard of them with tensor parallelism.
void load_whole_master(TrainingState& state, const ParamSet& full, const RankGroups& g) {
  if (!g.tp) return state.load_master(full);
  state.load_master(tp_part(full, state.master(), g));
}

// Under LoRA: the whole model's base weights (host) into this rank's frozen compute weights.
void load_whole_base(TrainingState& state, const ParamSet& full, const RankGroups& g) {
  if (!g.tp) return state.load_base(full);
  state.load_base(tp_part(full, state.model().params(), g));
}

// The adapters' table of the whole model, in `dtype`, on the host.
ParamSet whole_adapters_like(const TrainingState& state, const LlamaConfig& full_config, DType dtype) {
  return ParamSet(full_config, lora_parameter_table(full_config, state.model().lora()), dtype);
}

// A checkpoint's weights (any stored dtype), or a GGUF file's (dequantized), into `host`.
void read_source_weights(ParamSet& host, const std::string& source) {
  if (is_gguf_file(source))
    load_gguf_weights(host, GgufReader(source));
  else
    load_checkpoint_weights(host, source);
}

// Loads a checkpoint's weights (any stored dtype), or a GGUF file's (dequantized), as the run's
// base weights: its master weights (the rank's TP shard of them), or under LoRA its frozen compute
// weights.
void load_base_from(TrainingState& state, const LlamaConfig& full_config, const std::string& source,
                    const RankGroups& g) {
  ParamSet host(full_config, state.lora() ? accum_dtype(state.model().dtype()) : state.master_dtype());
  read_source_weights(host, source);
  if (state.lora())
    load_whole_base(state, host, g);
  else
    load_whole_master(state, host, g);
}

// LoRA: the adapters of a PEFT directory (a checkpoint of this run, or model.adapter), the whole
// model's, in `dtype` on the host. Its adapter_config.json must describe the run's adapters.
ParamSet read_adapter_dir(const LlamaConfig& full_config, const LoraConfig& run, const std::string& dir, DType dtype) {
  const LoraConfig file = read_peft_config(dir);
  if (file.rank != run.rank || file.alpha != run.alpha || file.target_roles() != run.target_roles())
    fail(fmt::format("{}/adapter_config.json: r {}, lora_alpha {}, target_modules {} but the run has lora.rank {}, "
                     "lora.alpha {}, lora.targets {}",
                     dir, file.rank, file.alpha, fmt::join(file.target_names(), ","), run.rank, run.alpha,
                     fmt::join(run.target_names(), ",")),
         "give the adapter's own r, alpha and targets in [lora] (or lora.rank = 0 to take them from the file)");
  ParamSet host(full_config, lora_parameter_table(full_config, run), dtype);
  load_peft_adapter(host, dir);
  return host;
}

// ... as the master weights of the rank's state (its TP shard of them).
void load_adapter_from(TrainingState& state, const LlamaConfig& full_config, const std::string& dir,
                       const RankGroups& g) {
  load_whole_master(state, read_adapter_dir(full_config, state.model().lora(), dir, state.master_dtype()), g);
}


// A checkpoint a run resumes from: its directory, state.json, and where the loop continues.
struct ResumedCheckpoint {
  std::string path, state_file;
  nlohmann::json saved;
  ResumePoint point;
};

// The run directory's latest complete checkpoint, its state.json read and its counters and parallel
// layout checked against the run before anything is restored.
ResumedCheckpoint open_resume(const RunConfig& rc, RunDirectory& run_dir, const std::string& run_path,
                              const RankGroups& g, std::ostream& out) {
  std::vector<std::string> skipped;
  const auto ref = run_dir.latest_complete(&skipped);
  for (const auto& s : skipped) out << "resume: skipped " << s << "\n";
  if (!ref)
    fail(fmt::format("--resume: no complete checkpoint in '{}'", run_path),
         "start without --resume, or point --run-dir at the run to continue");
  ResumedCheckpoint r;
  r.path = ref->path;
  r.state_file = (fs::path(ref->path) / "state.json").string();
  std::ifstream sf(r.state_file);
  try {
    r.saved = nlohmann::json::parse(sf);
  } catch (const nlohmann::json::exception& e) {
    fail(fmt::format("{}/state.json: not valid JSON ({})", ref->path, e.what()), "the checkpoint is damaged");
  }
  // The counters, checked against the run before anything is restored: a step beyond train.steps
  // would train nothing and report a loss of no step.
  const nlohmann::json& saved = r.saved;
  const std::string& state_file = r.state_file;
  ResumePoint& p = r.point;
  if (!saved.is_object()) fail(fmt::format("{}: not a JSON object", state_file), "the checkpoint is damaged");
  p.step = state_integer(saved, state_file, "", "step", 0, rc.train.steps);
  if (p.step == rc.train.steps)
    fail(fmt::format("--resume: {} is at step {}, and train.steps = {}: the run is complete", ref->path, p.step,
                     rc.train.steps),
         fmt::format("raise train.steps to continue it (e.g. --set train.steps={})", 2 * rc.train.steps));
  // Every step sees at least one token, and step 0 none.
  p.tokens_seen = state_integer(saved, state_file, "", "tokens_seen", p.step, INT64_MAX);
  if (p.step == 0 && p.tokens_seen != 0)
    fail(fmt::format("{}: 'tokens_seen' must be 0 at step 0, got {}", state_file, p.tokens_seen),
         "the checkpoint is damaged; resume from another one");
  // A sharded optimizer state resumes only on the layout that wrote it.
  const nlohmann::json none = nlohmann::json::object();
  const nlohmann::json& layout = saved.contains("parallel") ? saved.at("parallel") : none;
  if (!layout.is_object())
    fail(fmt::format("{}: 'parallel' must be an object, got {}", state_file, layout.dump()),
         "the checkpoint is damaged; resume from another one");
  const int64_t ranks = static_cast<int64_t>(kMaxRanks);
  const int64_t saved_dp = state_integer(layout, state_file, "parallel", "dp", 1, ranks, 1);
  const int64_t saved_zero = state_integer(layout, state_file, "parallel", "zero", 0, 3, 0);
  const int64_t saved_tp = state_integer(layout, state_file, "parallel", "tp", 1, ranks, 1);
  const int64_t saved_cp = state_integer(layout, state_file, "parallel", "cp", 1, ranks, 1);
  // One process: the whole state. Under context parallelism the DP group is the world of dp x cp ranks.
  const int64_t run_dp = g.dp ? g.dp->size() / g.cp_size() : g.zero3 ? g.zero3->size() : 1;
  const int64_t run_zero = g.zero(), run_tp = g.tp_size(), run_cp = g.cp_size();
  const char* keep_hint =
      "resume with the checkpoint's parallel.dp, parallel.tp, parallel.cp and parallel.zero (its weights are a whole "
      "HF checkpoint: model.source can start a new run from them)";
  if (saved_tp != run_tp)
    fail(fmt::format("{}: the checkpoint was written with parallel.tp = {}; this run has {} (its optimizer state is "
                     "split by TP shards)",
                     ref->path, saved_tp, run_tp),
         keep_hint);
  if ((saved_zero > 0 || run_zero > 0) && saved_cp != run_cp)
    fail(fmt::format("{}: the checkpoint was written with parallel.cp = {} and parallel.zero = {}; this run has "
                     "parallel.cp = {} (its optimizer state is sharded over the dp x cp ranks)",
                     ref->path, saved_cp, saved_zero, run_cp),
         keep_hint);
  if ((saved_zero > 0 || run_zero > 0) && (saved_dp != run_dp || saved_zero != run_zero))
    fail(fmt::format("{}: the checkpoint was written with parallel.dp = {} and parallel.zero = {}; this run has {} and {}",
                     ref->path, saved_dp, saved_zero, run_dp, run_zero),
         keep_hint);
  return r;
}

// After the weights and the optimizer state: the sampler's position, the metrics cut after the
// checkpoint's step (rank 0), and the line that says where the run continues.
void finish_resume(const ResumedCheckpoint& r, const RunConfig& rc, const std::string& metrics_path,
                   WindowSampler& sampler, const RankGroups& g, std::ostream& out) {
  if (!r.saved.contains("sampler"))
    fail(fmt::format("{}: key 'sampler' is missing", r.state_file), "the checkpoint is damaged; resume from another one");
  sampler.restore(SamplerState::from_json(r.saved.at("sampler"), r.state_file));
  if (g.lead()) truncate_metrics_after(metrics_path, r.point.step);
  out << fmt::format("resumed from {} (step {} of {}, {} tokens seen)\n", r.path, r.point.step, rc.train.steps,
                     r.point.tokens_seen);
}

// Whether model.source holds weights (a GGUF file, or an HF directory with its safetensors) rather
// than only a config or a preset to initialise.
bool has_weights(const std::string& source) {
  return is_gguf_file(source) ||
         (fs::is_directory(source) && fs::exists(fs::path(source) / "config.json") &&
          (fs::exists(fs::path(source) / "model.safetensors") ||
           fs::exists(fs::path(source) / "model.safetensors.index.json")));
}
}  // namespace

ResumePoint resume_or_initialise(const RunConfig& rc, const LlamaConfig& full_config, bool resume,
                                 RunDirectory& run_dir, const std::string& run_path, const std::string& metrics_path,
                                 TrainingState& state, WindowSampler& sampler, const RankGroups& g, std::ostream& out) {
  ResumePoint p;
  const bool lora = state.lora();
  const bool source_has_weights = has_weights(rc.model.source);
  if (lora) {
    // With tensor parallelism the seeded base and adapters are drawn whole (in f64, as the draws of
    // one process are) and sharded, so the run starts where one process starts.
    if (source_has_weights) {
      load_base_from(state, full_config, rc.model.source, g);
    } else if (g.tp) {
      ParamSet full(full_config, DType::f64);
      init_parameters(full, rc.model.init_seed, full_config.initializer_range);
      load_whole_base(state, full, g);
    } else {
      state.init(rc.model.init_seed, state.model().config().initializer_range);
    }
    if (!resume) {
      if (!rc.model.adapter.empty()) {
        load_adapter_from(state, full_config, rc.model.adapter, g);
      } else if (g.tp) {
        ParamSet full = whole_adapters_like(state, full_config, DType::f64);
        init_lora_parameters(full, state.model().lora().seed);
        load_whole_master(state, full, g);
      } else {
        state.init_adapters();
      }
    }
  }
  if (resume) {
    const ResumedCheckpoint r = open_resume(rc, run_dir, run_path, g, out);
    p = r.point;
    if (lora) load_adapter_from(state, full_config, r.path, g);
    else load_base_from(state, full_config, r.path, g);
    const std::string optimizer_path = (fs::path(r.path) / g.optimizer_file_to_read()).string();
    if (g.dp && g.dp->optimizer_shard())
      g.dp->optimizer_shard()->load(optimizer_path);
    else
      state.optimizer().load(optimizer_path);
    finish_resume(r, rc, metrics_path, sampler, g, out);
  } else if (lora) {
    // done above
  } else if (source_has_weights) {
    load_base_from(state, full_config, rc.model.source, g);
  } else if (g.tp) {
    ParamSet full(full_config, state.master_dtype());
    init_parameters(full, rc.model.init_seed, full_config.initializer_range);
    load_whole_master(state, full, g);
  } else {
    state.init(rc.model.init_seed, state.model().config().initializer_range);
  }
  return p;
}

ResumePoint resume_or_initialise(const RunConfig& rc, const LlamaConfig& full_config, bool resume,
                                 RunDirectory& run_dir, const std::string& run_path, const std::string& metrics_path,
                                 ShardedDataParallel& zero3, WindowSampler& sampler, const RankGroups& g,
                                 std::ostream& out) {
  // Every rank reads or draws the same whole model (in the master dtype, as one process does; under
  // LoRA the frozen base in f64, as one process draws it) and keeps its shard.
  const auto load_source = [&](DType drawn) {
    ParamSet whole(full_config, drawn);
    if (has_weights(rc.model.source))
      read_source_weights(whole, rc.model.source);
    else
      init_parameters(whole, rc.model.init_seed, full_config.initializer_range);
    zero3.shards().load(whole);
  };
  if (zero3.lora()) {
    // The base always comes from model.source; the adapters (replicated) from the checkpoint,
    // model.adapter, or PEFT's initialisation from lora.seed, as one process's.
    load_source(has_weights(rc.model.source) ? accum_dtype(zero3.model().dtype()) : DType::f64);
    const LoraConfig& lora = zero3.model().lora();
    const DType master = zero3.adapter_master().dtype();
    if (resume) {
      const ResumedCheckpoint r = open_resume(rc, run_dir, run_path, g, out);
      zero3.load_adapters(read_adapter_dir(full_config, lora, r.path, master));
      zero3.adapter_optimizer().load((fs::path(r.path) / g.optimizer_file_to_read()).string());
      finish_resume(r, rc, metrics_path, sampler, g, out);
      return r.point;
    }
    if (!rc.model.adapter.empty()) {
      zero3.load_adapters(read_adapter_dir(full_config, lora, rc.model.adapter, master));
    } else {
      ParamSet drawn(full_config, lora_parameter_table(full_config, lora), DType::f64);
      init_lora_parameters(drawn, lora.seed);
      zero3.load_adapters(drawn);
    }
    return {};
  }
  if (resume) {
    const ResumedCheckpoint r = open_resume(rc, run_dir, run_path, g, out);
    zero3.load_shard((fs::path(r.path) / g.optimizer_file_to_read()).string());
    finish_resume(r, rc, metrics_path, sampler, g, out);
    return r.point;
  }
  load_source(zero3.shards().master().dtype());
  return {};
}

}  // namespace cw
