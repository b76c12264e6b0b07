#include "optim/options.h"

#include "engine/error.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <type_traits>

namespace cw {

// clang-format off
const std::vector<Option<ScheduleOptions>>& schedule_option_table() {
  using S = ScheduleOptions;
  static const std::vector<Option<S>> table = {
    // key             flag               member             values                    help
    {"name",           "--schedule",      &S::kind,          one_of(schedule_names()),
     "how gradients are computed: full (everything kept) | checkpointed (layer inputs kept, each layer recomputed "
     "before its backward) | seco (exact, chunk by chunk, keeping only K/V) | spaco (seco visiting a sample of the "
     "chunks on the way back)"},
    {"chunk",          "--chunk",         &S::chunk,         in_range_or_auto(0, kMaxTokensOfSequence), "seco, spaco: prefill chunk length in tokens; 0: the whole sequence; auto: the fastest the planner finds to fit (GPU)"},
    {"bwd_chunk",      "--bwd-chunk",     &S::bwd_chunk,     in_range(0, kMaxTokensOfSequence), "seco, spaco: reverse-sweep chunk length; 0: same as chunk"},
    {"keep",           "--keep",          &S::keep,          in_range(0, kMaxTokensOfSequence), "spaco: chunks backpropagated per step (t of k); 0: all"},
    {"seed",           "--spaco-seed",    &S::seed,          {},                       "spaco: seed of the chunk sample (step s draws with (seed, s))"},
    {"stratified",     "--stratified",    &S::stratified,    {},                       "spaco: sample chunks with and without labels in proportion"},
    {"scale_loss",     "--scale-loss",    &S::scale_loss,    {},                       "spaco: scale visited chunks' loss gradient by k/t"},
    {"scale_relay",    "--scale-relay",   &S::scale_relay,   {},                       "spaco: scale relayed dK/dV by k/t per hop, up to relay_cap"},
    {"relay_cap",      "--relay-cap",     &S::relay_cap,     at_least(0),              "spaco: cap of the cumulative relay factor; 0: none"},
    {"drop_relay",     "--drop-relay",    &S::drop_relay,    {},                       "spaco: discard all cross-chunk relay (the chunk-local gradient)"},
    {"recompute",      "--recompute",     &S::recompute,     one_of(recompute_names()),
     "what each chunk's backward recomputes (seco, spaco: inside every reverse-sweep chunk): full (keep layer "
     "inputs only, recompute each layer) | selective (keep all but the MLP's [tokens, ffn] intermediates, "
     "recomputed in the backward) | none (keep everything) | auto (checkpointed: full; the others: none, or the "
     "planner's choice where chunk or offload_window is auto)"},
    {"mlp_shards",     "--mlp-shards",    &S::mlp_shards,    in_range(0, kMaxCount, "automatic"), "any schedule: tiled MLP row shards; 1: untiled, 0: automatic (ceil(ffn / hidden))"},
    {"cast_layers",    "--cast-layers",   &S::cast_layers,   {},
     "any schedule, bf16 on a GPU, full parameters: no resident bf16 copy of the blocks' weights; each block's are "
     "rounded from the f32 master into one of two device slots as it runs, as autocast does (1.8 GiB less at 1B, "
     "13 GiB at 8B, for a cast per block use); with chunk or offload_window auto, the planner turns it on where "
     "that is clearly faster"},
    {"offload",        "--offload",       &S::offload,       {},                       "checkpointed, recompute full: the kept layer inputs in pinned host memory (GPU)"},
    {"offload_window", "--offload-window", &S::offload_window, in_range_or_auto(0, kMaxCount, "the whole K/V store on the device"),
     "seco, spaco: K/V store layers kept on the device, the rest in pinned host memory; 0: all on the device; auto: "
     "the fastest that fits of the store on the device, a window of 2 or 1 layers, or streamed (stream_kv), as the "
     "planner predicts (GPU)"},
    {"stream_kv",      "--stream-kv",     &S::stream_kv,     {},
     "seco, spaco: the whole K/V store in pinned host memory, streamed to the GPU one chunk-sized key block at a "
     "time, attention running block by block: device memory does not grow with the sequence (needs bwd_chunk = chunk "
     "and offload_window = 0)"},
    {"save_attention", "--save-attention", &S::save_attention, {},
     "seco, spaco: the prefill saves each layer's attention output and lse in the K/V store (offloaded with it), so "
     "the reverse sweep does not run the attention forward again; with chunk or offload_window auto, the planner "
     "turns it on where that fits and is clearly faster"},
    {"save_inputs",    "--save-inputs",   &S::save_inputs,   {},
     "seco, spaco: the prefill runs over every chunk and saves each layer's input in the K/V store (offloaded with "
     "it), so the reverse sweep runs no chunk forward: each layer is recomputed from its saved input just before its "
     "backward, one layer's activations alive at a time; with chunk or offload_window auto, the planner turns it on "
     "where that fits and is clearly faster"},
  };
  return table;
}

const std::vector<Option<ParallelOptions>>& parallel_option_table() {
  using P = ParallelOptions;
  static const std::vector<Option<P>> table = {
    // key             flag               member             values                    help
    {"dp",             "--dp",            &P::dp,            in_range(1, kMaxRanks),   "data-parallel ranks: each runs its own batch_size sequences per micro-batch (a step sees dp times the tokens); gradients are reduced once per optimizer step"},
    {"zero",           "--zero",          &P::zero,          between(0, 3, false, false),
     "ZeRO sharding over the data-parallel ranks: 0 (each rank keeps the whole AdamW state) | 1 (each keeps the moments "
     "of its contiguous shard of the parameters, updates it, and the weights are all-gathered) | 2 (also only its shard "
     "of the reduced gradient: each bucket is reduced to the rank whose shard holds it instead of all-reduced) | 3 (each "
     "rank holds only its shard of every parameter, gradient and moment: each block is all-gathered just before its "
     "forward or backward and its gradient reduce-scattered right after)"},
    {"bucket_mb",      "--bucket-mb",     &P::bucket_mb,     between(0, kMaxCount, true, false), "gradient reduction bucket size in MiB; each bucket is reduced as soon as the step's last backward has finished it (zero 2: also cut at the shards' boundaries)"},
    {"tp",                "--tp",                &P::tp,               in_range(1, kMaxRanks),   "tensor-parallel ranks: each holds 1/tp of every block's heads, K/V heads and FFN width (must divide them); a run has dp x tp ranks, a replica's tp ranks adjacent (rank = dp rank x tp + tp rank)"},
    {"sequence_parallel", "--sequence-parallel", &P::sequence_parallel, {},          "tp: norms, residual stream, embedding and loss on each rank's 1/tp of the tokens (all-gather / reduce-scatter at the linears)"},
    {"tp_regather",       "--tp-regather",       &P::tp_regather,       {},          "tp with sequence_parallel: the backward all-gathers each layer's normed input again instead of keeping it"},
    {"cp",                "--cp",                &P::cp,                in_range(1, kMaxRanks),
     "context-parallel ranks of each data-parallel rank: each holds 1/cp of every chunk's tokens and attends 1/cp of "
     "the heads (must divide the heads; seq_len and the chunks multiples of cp); a run has dp x cp ranks, a data-parallel "
     "rank's cp ranks adjacent (rank = dp rank x cp + cp rank); not with tp or zero 3"},
  };
  return table;
}
const std::vector<Option<LoraConfig>>& lora_option_table() {
  using L = LoraConfig;
  static const std::vector<Option<L>> table = {
    // key             flag               member             values                    help
    {"rank",           "--lora-rank",     &L::rank,          in_range(0, kMaxCount, "no adapters"),
     "LoRA: adapters of this rank on lora.targets, the base frozen (no master copy, gradient or optimizer state "
     "for it); 0: full-parameter training"},
    {"alpha",          "--lora-alpha",    &L::alpha,         above(0),                 "LoRA: the adapters' output is scaled by alpha / rank"},
    {"dropout",        "--lora-dropout",  &L::dropout,       between(0, 1, false, true),
     "LoRA: dropout on the adapters' input in training steps; the masks are seeded (lora.seed, step, layer, token), "
     "so every schedule sees the same ones"},
    {"targets",        "--lora-targets",  &L::targets,       {},
     "LoRA: the linears that get adapters, a comma list of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
     "down_proj, or all-linear; empty: q_proj,v_proj (PEFT's Llama default)"},
    {"seed",           "--lora-seed",     &L::seed,          {},                       "LoRA: seed of A's initialisation (B starts at 0) and of the dropout masks"},
  };
  return table;
}
// clang-format on

void validate_lora(const LoraConfig& lora) {
  for (const OptionRef& o : bind_options("lora", lora_option_table(), const_cast<LoraConfig&>(lora))) check_option(o);
  lora.validate();
}

void ParallelOptions::validate() const {
  for (const OptionRef& o : bind_options("parallel", parallel_option_table(), const_cast<ParallelOptions&>(*this)))
    check_option(o);
  if (zero == 3 && tp > 1)
    fail(fmt::format("parallel.zero = 3 does not combine with parallel.tp = {}: a block's gather would have to split "
                     "along tensor parallelism's shards", tp),
         "use --zero 3 with --tp 1, or --zero 1|2 with --tp");
  if (cp > 1 && (tp > 1 || zero == 3))
    fail(fmt::format("parallel.cp = {} does not combine with {}: context parallelism runs with data parallelism and "
                     "ZeRO 0-2 only",
                     cp, tp > 1 ? fmt::format("parallel.tp = {}", tp) : std::string("parallel.zero = 3")),
         tp > 1 ? "set parallel.tp = 1 with parallel.cp" : "use parallel.zero = 0, 1 or 2 with parallel.cp");
  if (tp_regather && !sequence_parallel)
    fail("parallel.tp_regather needs parallel.sequence_parallel: without it nothing is gathered, so nothing is gathered "
         "again",
         "set parallel.sequence_parallel = true (--sequence-parallel) or tp_regather = false");
}

bool ScheduleOptions::one_backward_chunk(int64_t T) const {
  if (!chunked()) return true;
  const int64_t c = bwd_chunk > 0 ? bwd_chunk : chunk;
  return c <= 0 || c >= T;
}

bool ScheduleOptions::layer_local_kv_grads(int64_t T, int64_t layers) const {
  const bool windowed = offload_window > 0 && offload_window < layers;
  return one_backward_chunk(T) && !windowed && stream_block(T) == 0;
}

RecomputeMode ScheduleOptions::recompute_mode() const {
  if (recompute != RecomputeMode::automatic) return recompute;
  return kind == ScheduleKind::checkpointed ? RecomputeMode::full : RecomputeMode::none;
}

void ScheduleOptions::validate() const {
  // The table's rules read through the bound pointers only.
  for (const OptionRef& o : bind_options("schedule", schedule_option_table(), const_cast<ScheduleOptions&>(*this)))
    check_option(o);
  if (offload && !(kind == ScheduleKind::checkpointed && recompute_mode() == RecomputeMode::full))
    fail("schedule.offload applies to schedule checkpointed with recompute = full (the kept layer inputs)",
         "set schedule.name = checkpointed and schedule.recompute = full, or offload = false");
  if (save_attention && !chunked())
    fail("schedule.save_attention applies to schedules seco and spaco (the prefill saves what their reverse sweep "
         "recomputes)",
         "set schedule.name = seco or spaco, or save_attention = false");
  if (save_inputs && !chunked())
    fail("schedule.save_inputs applies to schedules seco and spaco (the prefill saves what their reverse sweep "
         "recomputes)",
         "set schedule.name = seco or spaco, or save_inputs = false");
  if (save_inputs && stream_kv)
    fail("schedule.save_inputs is not kept by a streamed K/V store (stream_kv)",
         "set schedule.stream_kv = false (offload_window keeps a window of layers instead), or save_inputs = false");
  if ((chunk == kAuto || offload_window == kAuto) && !chunked())
    fail(fmt::format("schedule.{} = auto applies to schedules seco and spaco", chunk == kAuto ? "chunk" : "offload_window"),
         "set schedule.name = seco or spaco, or give a number");
  if (stream_kv && !chunked())
    fail("schedule.stream_kv applies to schedules seco and spaco (their K/V store outlives a chunk)",
         "set schedule.name = seco or spaco, or stream_kv = false");
  if (stream_kv && offload_window != 0)
    fail("schedule.stream_kv and schedule.offload_window are two kinds of K/V offload",
         "set offload_window = 0 with stream_kv (streaming keeps no layer whole on the device)");
  if (stream_kv && bwd_chunk != 0 && bwd_chunk != chunk)
    fail(fmt::format("schedule.stream_kv streams the store in blocks of the chunk: bwd_chunk {} must equal chunk {}",
                     bwd_chunk, chunk),
         "set bwd_chunk = 0 (the chunk) with stream_kv");
  if (offload_window > 0 && !chunked())
    fail("schedule.offload_window applies to schedules seco and spaco (their K/V store outlives a chunk)",
         "set schedule.name = seco or spaco, or offload_window = 0");
  // Name the first spaco-only option set on another schedule, rather than the whole group.
  if (kind != ScheduleKind::spaco) {
    const std::pair<const char*, bool> spaco_only[] = {
        {"keep", keep != 0}, {"stratified", stratified}, {"scale_relay", scale_relay}, {"drop_relay", drop_relay}};
    for (const auto& [key, set] : spaco_only)
      if (set)
        fail(fmt::format("schedule.{} is a spaco option; schedule.name is {}", key, toml_string(schedule_name(kind))),
             "set schedule.name = \"spaco\" (--schedule spaco) or remove it");
  }
}

// ---- rules ----

OptionRule at_least(double min, std::string_view zero) {
  OptionRule r;
  r.min = min;
  r.zero = zero;
  return r;
}
OptionRule at_least_or_auto(double min, std::string_view zero) {
  OptionRule r = at_least(min, zero);
  r.or_auto = true;
  return r;
}
OptionRule in_range(double min, double max, std::string_view zero) {
  OptionRule r = between(min, max, false, false);
  r.zero = zero;
  return r;
}
OptionRule in_range_or_auto(double min, double max, std::string_view zero) {
  OptionRule r = in_range(min, max, zero);
  r.or_auto = true;
  return r;
}
OptionRule above(double min) {
  OptionRule r;
  r.min = min;
  r.min_open = true;
  return r;
}
OptionRule between(double min, double max, bool min_open, bool max_open) {
  OptionRule r;
  r.min = min;
  r.max = max;
  r.min_open = min_open;
  r.max_open = max_open;
  return r;
}
OptionRule one_of(std::vector<std::string_view> words) {
  OptionRule r;
  r.words = words;
  return r;
}
OptionRule non_empty() {
  OptionRule r;
  r.non_empty = true;
  return r;
}
OptionRule no_empty_path() {
  OptionRule r;
  r.no_empty_path = true;
  return r;
}

std::string OptionRule::describe() const {
  if (min && max)
    return fmt::format("in {}{}, {}{}{}", min_open ? '(' : '[', *min, *max, max_open ? ')' : ']',
                       or_auto ? ", or auto" : "");
  if (min) return fmt::format("{} {}{}", min_open ? ">" : ">=", *min, or_auto ? ", or auto" : "");
  if (max) return fmt::format("{} {}", max_open ? "<" : "<=", *max);
  if (!words.empty()) {
    std::string out;
    for (std::string_view w : words) out += (out.empty() ? "" : " | ") + std::string(w);
    return out;
  }
  if (non_empty) return "not empty";
  if (no_empty_path) return "no empty path";
  return "";
}

std::string OptionRef::name() const { return fmt::format("{}.{}", section, key); }

namespace {

void check_range(const OptionRef& o, double v, const std::string& shown) {
  const OptionRule& r = *o.rule;
  const bool low = r.min && (r.min_open ? !(v > *r.min) : !(v >= *r.min));
  const bool high = r.max && (r.max_open ? !(v < *r.max) : !(v <= *r.max));
  if (low || high)
    fail(fmt::format("{} must be {}{}, got {}", o.name(), r.describe(),
                     r.zero.empty() ? "" : fmt::format(" (0: {})", r.zero), shown));
}

}  // namespace

void check_option(const OptionRef& o) {
  const OptionRule& r = *o.rule;
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, int64_t>) {
          if (r.or_auto && *p == kAuto) return;
          check_range(o, static_cast<double>(*p), fmt::format("{}", *p));
        } else if constexpr (std::is_same_v<T, uint64_t>) {
          if (*p > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
            fail(fmt::format("{} must be < 2^63 to be written as a TOML integer, got {}", o.name(), *p));
          check_range(o, static_cast<double>(*p), fmt::format("{}", *p));
        } else if constexpr (std::is_same_v<T, double>) {
          // Non-finite values pass or fail comparisons by accident; name them explicitly.
          if (!std::isfinite(*p)) fail(fmt::format("{} must be a finite number, got {}", o.name(), *p));
          check_range(o, *p, fmt::format("{}", *p));
        } else if constexpr (std::is_same_v<T, std::string>) {
          if (r.non_empty && p->empty()) fail(fmt::format("{} must not be empty", o.name()), std::string(o.help));
          if (!r.words.empty()) {
            for (std::string_view w : r.words)
              if (*p == w) return;
            fail(fmt::format("{} must be one of {}, got {}", o.name(), r.describe(), toml_string(*p)));
          }
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          if (r.no_empty_path)
            for (const std::string& item : *p)
              if (item.empty()) fail(fmt::format("{} holds an empty path", o.name()), std::string(o.help));
        }
        // A word option holds one of its words' values: its readers took no other word.
      },
      o.target);
}

std::string_view option_type_name(const OptionTarget& target) {
  return std::visit(
      [](auto* p) -> std::string_view {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, int64_t>) return "integer";
        else if constexpr (std::is_same_v<T, uint64_t>) return "unsigned integer";
        else if constexpr (std::is_same_v<T, double>) return "number";
        else if constexpr (std::is_same_v<T, bool>) return "boolean";
        else if constexpr (std::is_same_v<T, std::optional<bool>>) return "boolean or unset";
        else if constexpr (std::is_same_v<T, std::string> || std::is_enum_v<T>) return "string";
        else return "list of strings";
      },
      target);
}

void copy_option_value(const OptionTarget& to, const OptionTarget& from) {
  std::visit(
      [&](auto* dst) {
        using P = decltype(dst);
        *dst = *std::get<P>(from);
      },
      to);
}

bool option_values_equal(const OptionTarget& a, const OptionTarget& b) {
  return std::visit(
      [&](auto* x) {
        using P = decltype(x);
        const auto* y = std::get_if<P>(&b);
        return y && **y == *x;
      },
      a);
}

// ---- TOML text of values ----

std::string toml_string(std::string_view s) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto byte = static_cast<unsigned char>(ch);
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        // TOML basic strings may not hold other control characters raw.
        if (byte < 0x20 || byte == 0x7f)
          out += fmt::format("\\u{:04X}", static_cast<unsigned>(byte));
        else
          out += ch;
    }
  }
  return out + "\"";
}

// fmt's "{}" is the shortest text that reads back to the same double; TOML needs a '.' or an
// exponent to read it as a float rather than an integer ("inf" and "nan" are floats already).
std::string toml_float(double v) {
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

std::optional<std::string> toml_value(const OptionRef& option) {
  const bool or_auto = option.rule && option.rule->or_auto;
  return std::visit(
      [or_auto](auto* p) -> std::optional<std::string> {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, int64_t>) return or_auto && *p == kAuto ? "\"auto\"" : fmt::format("{}", *p);
        else if constexpr (std::is_same_v<T, uint64_t>) return fmt::format("{}", *p);
        else if constexpr (std::is_same_v<T, double>) return toml_float(*p);
        else if constexpr (std::is_same_v<T, bool>) return *p ? "true" : "false";
        else if constexpr (std::is_same_v<T, std::optional<bool>>) {
          if (!p->has_value()) return std::nullopt;
          return **p ? "true" : "false";
        } else if constexpr (std::is_same_v<T, std::string>) {
          return toml_string(*p);
        } else if constexpr (std::is_enum_v<T>) {
          return toml_string(option_word(*p));
        } else {
          std::string out = "[";
          for (size_t i = 0; i < p->size(); ++i) out += (i ? ", " : "") + toml_string((*p)[i]);
          return out + "]";
        }
      },
      option.target);
}

}  // namespace cw
