// RunConfig: the option tables of its sections (the schedule's in optim/options.cpp) drive reading,
// overriding, validating, writing and the error messages, so a key added to a struct is added to
// its table once and every path knows it.
#include "tools/train/run_config.h"

#include "engine/error.h"
#include "model/cp_group.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string_view>
#include <variant>

namespace cw {

namespace {

// The tokens a whole run may see: the counters that sum them are signed 64-bit, with headroom.
constexpr int64_t kMaxRunTokens = int64_t(1) << 62;

using Model = RunConfig::Model;
using Rope = RunConfig::Rope;
using Data = RunConfig::Data;
using Optimizer = RunConfig::Optimizer;
using Train = RunConfig::Train;
using Eval = RunConfig::Eval;
using Checkpoint = RunConfig::Checkpoint;
using Log = RunConfig::Log;
using Sample = RunConfig::Sample;

// Every option of every section but [schedule] (optim/options.cpp), in the order to_toml writes
// them. The defaults are the structs' (run_config.h).
// clang-format off
const std::vector<Option<Model>> model_options = {
  // key            flag  member                  values                                help
  {"source",         "", &Model::source,          non_empty(),                          "a preset name (tiny, small, llama-3.2-1b, qwen3-0.6b, ...), an HF config.json (random initialisation), an HF checkpoint directory or a GGUF file to continue from"},
  {"dtype",          "", &Model::dtype,           one_of({"auto", "f64", "f32", "bf16"}), "compute precision: auto (GPU: bf16 with f32 master weights; CPU: f32) | f64 (CPU) | f32 | bf16 (GPU)"},
  {"init_seed",      "", &Model::init_seed,       {},                                   "seed of the random initialisation (unused for a checkpoint)"},
  {"tie_embeddings", "", &Model::tie_embeddings,  {},                                   "tie the LM head to the embedding; unset: as the model configures it"},
  {"adapter",        "", &Model::adapter,         {},                                   "a PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) to continue training on the base model.source; its r, lora_alpha and target_modules are the run's when lora.rank is 0, else they must equal lora.*; empty: none"},
};
const std::vector<Option<Rope>> rope_options = {
  {"type",           "", &Rope::type,             one_of({"model", "default", "linear", "llama3", "yarn", "dynamic"}), "the RoPE scaling the run trains with, replacing the model's (HF's rope_type): model (keep the model's own) | default (none) | linear | llama3 | yarn | dynamic (dynamic NTK: frequencies of each sequence's length; engine/ops/rope.h)"},
  {"factor",         "", &Rope::factor,           in_range(0, kMaxCount, "not given"), "the context stretch (>= 1), needed by every type but model and default"},
  {"original_max_position_embeddings", "", &Rope::original_max_position_embeddings, in_range(0, kMaxTokensOfSequence, "the model's max_position_embeddings"), "llama3, yarn: the context length the model was trained with (give it when the model already has a scaling); yarn sets max_position_embeddings to factor times it"},
  {"beta_fast",      "", &Rope::beta_fast,        above(0),                             "yarn: rotations over the original context above which a frequency is kept (> beta_slow)"},
  {"beta_slow",      "", &Rope::beta_slow,        above(0),                             "yarn: rotations below which a frequency is divided by factor"},
  {"mscale",         "", &Rope::mscale,           at_least(0, "not given"),             "yarn: with mscale_all_dim, the attention factor is get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)"},
  {"mscale_all_dim", "", &Rope::mscale_all_dim,   at_least(0, "not given"),             "yarn: see mscale"},
  {"attention_factor", "", &Rope::attention_factor, at_least(0, "from factor and mscale"), "yarn: what cos and sin are multiplied by; 0: 0.1 ln(factor) + 1, or from mscale and mscale_all_dim when both are given"},
  {"truncate",       "", &Rope::truncate,         {},                                   "yarn: floor and ceil the correction range's ends; false: keep them fractional"},
  {"low_freq_factor", "", &Rope::low_freq_factor, above(0),                             "llama3: wavelengths above original / low_freq_factor are divided by factor"},
  {"high_freq_factor", "", &Rope::high_freq_factor, above(0),                           "llama3: wavelengths below original / high_freq_factor are kept (> low_freq_factor)"},
};
const std::vector<Option<Data>> data_options = {
  {"train",          "", &Data::train,            no_empty_path(),                         "token files: paths and glob patterns, concatenated in order (globs sorted); \"@demo\": the demo corpus"},
  {"eval",           "", &Data::eval,             no_empty_path(),                         "held-out token files; empty: the last eval_fraction of the training stream"},
  {"format",         "", &Data::format,           one_of({"shard", "u16", "u32"}),      "file format: shard (llm.c, with header) | u16 | u32 (headerless ids)"},
  {"eval_fraction",  "", &Data::eval_fraction,    between(0, 1, false, true),           "held out of the training stream when eval is empty; 0: no evaluation data"},
  {"seq_len",        "", &Data::seq_len,          in_range(2, kMaxTokensOfSequence),    "T: tokens per sequence"},
  {"batch_size",     "", &Data::batch_size,       in_range(1, kMaxSequencesOfBatch),    "B: sequences per micro-batch"},
  {"grad_accum",     "", &Data::grad_accum,       in_range(1, kMaxSequencesOfBatch),    "micro-batches per optimizer step (a step sees seq_len * batch_size * grad_accum tokens)"},
  {"seed",           "", &Data::seed,             {},                                   "seed of the shuffle of training windows"},
  {"tokenizer",      "", &Data::tokenizer,        non_empty(),                          "the tokenizer of the samples (prompt in, text out) and, with documents, of the BOS that marks where documents start in files without stored starts: bytes | \"model\" (model.source's own: a .gguf file, or a directory with tokenizer.json) | an HF tokenizer.json, a directory holding one, or a .gguf file; its vocabulary must fit the model's, and the run directory keeps a copy"},
  {"loss",           "--loss", &Data::loss,       one_of({"all", "assistant"}),         "which targets the loss trains on: all | assistant (only the tokens the data's loss mask marks: the assistant's replies of chunkwise tokenize --chat-jsonl; every token file needs its flags file with the mask)"},
  {"documents",      "--documents", &Data::documents, {},                               "packed documents: a token attends only to earlier tokens of its own document, and no label predicts the next document's first token; the starts come from each token file's flags file (chunkwise tokenize writes it), else from data.tokenizer's BOS"},
  {"positions",      "--positions", &Data::positions, one_of({"document", "absolute"}), "with documents: RoPE positions restart at 0 at each document start (document, as HF's padding-free packing) or count from the sequence's start (absolute)"},
};
const std::vector<Option<Optimizer>> optimizer_options = {
  {"lr",             "", &Optimizer::lr,          above(0),                             "AdamW: the peak learning rate, reached linearly from 0 after warmup_steps"},
  {"min_lr",         "", &Optimizer::min_lr,      at_least(0),                          "where the decay ends, at the last step (<= lr unless decay is constant)"},
  {"warmup_steps",   "", &Optimizer::warmup_steps, in_range(0, kMaxSteps),              "steps of linear warmup from 0"},
  {"decay",          "", &Optimizer::decay,       one_of({"cosine", "linear", "constant"}), "from lr down to min_lr: cosine | linear | constant (stays at lr)"},
  {"beta1",          "", &Optimizer::beta1,       between(0, 1, false, true),           "AdamW first-moment decay"},
  {"beta2",          "", &Optimizer::beta2,       between(0, 1, false, true),           "AdamW second-moment decay"},
  {"eps",            "", &Optimizer::eps,         above(0),                             "AdamW denominator epsilon"},
  {"weight_decay",   "", &Optimizer::weight_decay, at_least(0),                         "decoupled weight decay"},
  {"grad_clip",      "", &Optimizer::grad_clip,   at_least(0, "off"),                   "clip the global gradient L2 norm to this; 0: no clipping"},
  {"offload",        "--optimizer-offload", &Optimizer::offload, {},                    "keep the master weights and AdamW's moments in host memory (ZeRO-Offload; 12 bytes a trained parameter off the device), updated piece by piece on the GPU with the state streamed through it"},
};
const std::vector<Option<Train>> train_options = {
  {"steps",          "",                &Train::steps,         in_range(1, kMaxSteps),  "optimizer steps"},
  {"device",         "--device",        &Train::device,        one_of({"auto", "cpu", "cuda"}), "auto (CUDA when available) | cpu | cuda"},
  {"nonfinite",      "",                &Train::nonfinite,     one_of({"skip", "stop"}), "a step whose loss or gradient is NaN/inf: skip its update, or stop the run"},
  {"deterministic",  "--deterministic", &Train::deterministic, {},                    "GPU: bitwise-reproducible gradients run to run (attention's dQ summed without atomics: slower)"},
  {"threads",        "",                &Train::threads,       in_range(0, kMaxCount, "all cores"), "CPU threads; 0: all cores"},
  {"memory_check",   "",                &Train::memory_check,  {},                    "refuse before step 1 a run whose planned memory (tools/planner) exceeds what the device (or host) has free; false: start it anyway (where the plan is known to be pessimistic)"},
  {"device_memory",  "--device-memory", &Train::device_memory, in_range(0, kMaxCount, "the whole GPU"), "GPU: the device memory the run may use, in GiB (the caching pool's ceiling is this less the CUDA context), as if the GPU had that much; 0: the whole GPU"},
};
const std::vector<Option<Eval>> eval_options = {
  {"every",          "", &Eval::every,            in_range(0, kMaxSteps, "never"),    "evaluate every this many steps and at the end; 0: never"},
  {"batches",        "", &Eval::batches,          in_range(1, kMaxSequencesOfBatch),  "eval batches per evaluation"},
  {"at_start",       "", &Eval::at_start,         {},                                   "also evaluate before the first step (where a fine-tune starts from)"},
};
const std::vector<Option<Checkpoint>> checkpoint_options = {
  {"every",          "", &Checkpoint::every,      in_range(0, kMaxSteps, "never"),      "save every this many steps and at the end; 0: only at the end"},
  {"at_end",         "", &Checkpoint::at_end,     {},                                   "save at the end of the run; false: a run that keeps no state (benchmarks, checks; a stop signal still saves)"},
  {"keep_last",      "", &Checkpoint::keep_last,  in_range(1, kMaxCount),               "checkpoints kept; older ones are deleted"},
  {"resume",         "", &Checkpoint::resume,     {},                                   "continue from the run directory's latest complete checkpoint (as --resume)"},
};
const std::vector<Option<Log>> log_options = {
  {"run_dir",        "", &Log::run_dir,           {},                                   "where the run writes its log, config, checkpoints and plots; empty: runs/<date-time> (--run-dir overrides)"},
  {"every",          "", &Log::every,             in_range(1, kMaxSteps),               "steps between log lines"},
  {"plot",           "", &Log::plot,              {},                                   "plot the loss curves (loss.png)"},
};
const std::vector<Option<Sample>> sample_options = {
  {"prompt",         "", &Sample::prompt,         {},                                   "text the trained model continues at the end of the run"},
  {"tokens",         "", &Sample::tokens,         in_range(0, kMaxTokensOfSequence, "no sample"), "tokens to generate; 0: no sample"},
  {"temperature",    "", &Sample::temperature,    at_least(0, "greedy"),                "sampling temperature; 0: greedy"},
  {"top_k",          "", &Sample::top_k,          in_range(0, kMaxTokensOfSequence, "off"), "keep the k most likely tokens; 0: off"},
  {"top_p",          "", &Sample::top_p,          between(0, 1, true, false),           "nucleus: keep the most likely tokens up to this probability; 1: off"},
  {"seed",           "", &Sample::seed,           {},                                   "sampling seed"},
  {"at_start",       "", &Sample::at_start,       {},                                   "also sample before the first step (the model as the run starts)"},
};
// clang-format on

std::vector<OptionRef> fields_of(RunConfig& c) {
  std::vector<OptionRef> out;
  bind_options(out, "model", model_options, c.model);
  bind_options(out, "rope", rope_options, c.rope);
  bind_options(out, "lora", lora_option_table(), c.lora);
  bind_options(out, "data", data_options, c.data);
  bind_options(out, "schedule", schedule_option_table(), c.schedule);
  bind_options(out, "parallel", parallel_option_table(), c.parallel);
  bind_options(out, "optimizer", optimizer_options, c.optimizer);
  bind_options(out, "train", train_options, c.train);
  bind_options(out, "eval", eval_options, c.eval);
  bind_options(out, "checkpoint", checkpoint_options, c.checkpoint);
  bind_options(out, "log", log_options, c.log);
  bind_options(out, "sample", sample_options, c.sample);
  return out;
}

using Field = OptionRef;
using Target = OptionTarget;

// The names only (for suggestions and listings), from a config that lives as long as the program.
const std::vector<Field>& schema() {
  static RunConfig names_only = RunConfig::defaults();
  static const std::vector<Field> fields = fields_of(names_only);
  return fields;
}

std::vector<std::string_view> section_names() {
  std::vector<std::string_view> names;
  for (const Field& f : schema())
    if (names.empty() || names.back() != f.section) names.push_back(f.section);
  return names;
}

std::vector<std::string_view> keys_of(std::string_view section) {
  std::vector<std::string_view> keys;
  for (const Field& f : schema())
    if (f.section == section) keys.push_back(f.key);
  return keys;
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// The closest candidate within edit distance 2 (a typo, not a different word), or empty.
std::string_view closest(std::string_view word, const std::vector<std::string_view>& candidates) {
  std::string_view best;
  size_t best_distance = 3;
  for (std::string_view c : candidates) {
    const size_t d = edit_distance(word, c);
    if (d < best_distance) best = c, best_distance = d;
  }
  return best;
}

std::string join(const std::vector<std::string_view>& words) {
  std::string out;
  for (std::string_view w : words) out += (out.empty() ? "" : ", ") + std::string(w);
  return out;
}

// User text inside a message, with control characters escaped: errors stay on one line.
std::string shown(std::string_view s) {
  std::string out;
  for (const char ch : s) {
    const auto byte = static_cast<unsigned char>(ch);
    if (ch == '\n') out += "\\n";
    else if (byte < 0x20 || byte == 0x7f) out += fmt::format("\\x{:02x}", static_cast<unsigned>(byte));
    else out += ch;
  }
  return out;
}

// What a field takes, for "must be ..." messages.
std::string_view expected(const Target& target) {
  return std::visit(
      [](auto* p) -> std::string_view {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, int64_t>) return "an integer";
        else if constexpr (std::is_same_v<T, uint64_t>) return "a non-negative integer";
        else if constexpr (std::is_same_v<T, double>) return "a number";
        else if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, std::optional<bool>>) return "true or false";
        else if constexpr (std::is_same_v<T, std::string> || std::is_enum_v<T>) return "a string";
        else return "a list of strings";
      },
      target);
}

// An example assignment for the hint: the default value, or a made-up one where the default is
// empty or unset and so shows nothing.
std::string example(const Field& f) {
  const Field* d = nullptr;
  for (const Field& s : schema())
    if (s.section == f.section && s.key == f.key) d = &s;
  std::optional<std::string> v = d ? toml_value(*d) : std::nullopt;
  if (!v || *v == "\"\"" || *v == "[]") {
    if (std::holds_alternative<std::optional<bool>*>(f.target)) v = "true";
    else if (std::holds_alternative<std::vector<std::string>*>(f.target)) v = "[\"data/train_*.bin\"]";
    else v = "\"runs/example\"";
  }
  return fmt::format("e.g. {} = {}", f.key, *v);
}

std::string_view type_name(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::string: return "string";
    case toml::node_type::integer: return "integer";
    case toml::node_type::floating_point: return "float";
    case toml::node_type::boolean: return "boolean";
    case toml::node_type::array: return "array";
    case toml::node_type::table: return "table";
    case toml::node_type::date: return "date";
    case toml::node_type::time: return "time";
    case toml::node_type::date_time: return "date-time";
    default: return "nothing";
  }
}

// "integer 3", "string \"x\"": the found value, so the message shows what to change.
std::string describe(const toml::node& node) {
  if (const auto* s = node.as_string()) return fmt::format("string {}", toml_string(s->get()));
  if (const auto* i = node.as_integer()) return fmt::format("integer {}", i->get());
  if (const auto* x = node.as_floating_point()) return fmt::format("float {}", toml_float(x->get()));
  if (const auto* b = node.as_boolean()) return fmt::format("boolean {}", b->get() ? "true" : "false");
  return std::string(type_name(node));
}

// ---- reading ----

// The position prefix of messages: "path:line:column" in a file, "--set" for an override.
struct Origin {
  std::string source;
  bool positions = true;
  std::string at(const toml::source_region& region) const {
    if (!positions) return source;
    return fmt::format("{}:{}:{}", source, region.begin.line, region.begin.column);
  }
};

[[noreturn]] void wrong_type(const Field& f, const toml::node& node, const std::string& where) {
  fail(fmt::format("{}: {} must be {}, got {}", where, f.name(), expected(f.target), describe(node)), example(f));
}

void assign(const Field& f, const toml::node& node, const std::string& where) {
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, uint64_t>) {
          if constexpr (std::is_same_v<T, int64_t>) {
            if (const auto* word = node.as_string(); word && f.rule->or_auto && word->get() == "auto") {
              *p = kAuto;
              return;
            }
          }
          const auto* i = node.as_integer();
          if (!i) wrong_type(f, node, where);
          if constexpr (std::is_same_v<T, uint64_t>) {
            if (i->get() < 0) wrong_type(f, node, where);
            *p = static_cast<uint64_t>(i->get());
          } else {
            // kAuto is -1, so a negative count would read as "auto": only the word means that.
            if (f.rule->or_auto && i->get() < 0)
              fail(fmt::format("{}: {} must be {}, got {}", where, f.name(), f.rule->describe(), i->get()),
                   fmt::format("write {} = \"auto\" for the planner's choice, or a count", f.key));
            *p = i->get();
          }
        } else if constexpr (std::is_same_v<T, double>) {
          // An integer is a number too: lr = 3 means 3.0.
          if (const auto* x = node.as_floating_point()) *p = x->get();
          else if (const auto* i = node.as_integer()) *p = static_cast<double>(i->get());
          else wrong_type(f, node, where);
        } else if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, std::optional<bool>>) {
          const auto* b = node.as_boolean();
          if (!b) wrong_type(f, node, where);
          *p = b->get();
        } else if constexpr (std::is_same_v<T, std::string>) {
          const auto* s = node.as_string();
          if (!s) wrong_type(f, node, where);
          *p = s->get();
        } else if constexpr (std::is_enum_v<T>) {
          const auto* s = node.as_string();
          if (!s) wrong_type(f, node, where);
          read_option_word(s->get(), *p);
        } else {
          const auto* a = node.as_array();
          if (!a) wrong_type(f, node, where);
          std::vector<std::string> items;
          for (size_t i = 0; i < a->size(); ++i) {
            const auto* s = (*a)[i].as_string();
            if (!s)
              fail(fmt::format("{}: {}[{}] must be a string, got {}", where, f.name(), i, describe((*a)[i])),
                   example(f));
            items.push_back(s->get());
          }
          *p = std::move(items);
        }
      },
      f.target);
}

[[noreturn]] void unknown_section(std::string_view section, const std::string& where) {
  const std::vector<std::string_view> sections = section_names();
  const std::string_view near = closest(section, sections);
  fail(fmt::format("{}: unknown section [{}]", where, shown(section)),
       near.empty() ? fmt::format("sections are {}", join(sections)) : fmt::format("did you mean [{}]?", near));
}

// The field for section.key, or a one-line error suggesting what was probably meant.
Field& find_field(std::vector<Field>& fields, std::string_view section, std::string_view key,
                  const std::string& where) {
  const std::vector<std::string_view> sections = section_names();
  if (std::find(sections.begin(), sections.end(), section) == sections.end()) unknown_section(section, where);
  for (Field& f : fields)
    if (f.section == section && f.key == key) return f;
  const std::vector<std::string_view> keys = keys_of(section);
  std::string hint;
  if (const std::string_view near = closest(key, keys); !near.empty()) {
    hint = fmt::format("did you mean {}.{}?", section, near);
  } else {
    for (const Field& f : schema())
      if (f.key == key) hint = fmt::format("did you mean {}?", f.name());
    if (hint.empty()) hint = fmt::format("keys of [{}] are {}", section, join(keys));
  }
  fail(fmt::format("{}: unknown key {}.{}", where, section, shown(key)), hint);
}

std::string trim(std::string_view s) {
  const auto first = s.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos) return "";
  const auto last = s.find_last_not_of(" \t\r\n");
  return std::string(s.substr(first, last - first + 1));
}

// One value written as TOML, or nullopt if the text is not exactly one TOML value.
std::optional<toml::table> parse_value(const std::string& raw) {
  if (raw.empty() || raw.find_first_of("\r\n") != std::string::npos) return std::nullopt;
  try {
    toml::table t = toml::parse("v = " + raw);
    if (t.size() == 1 && t.contains("v")) return t;
  } catch (const toml::parse_error&) {
  }
  return std::nullopt;
}

// [rope]'s rules between keys: a scaling that stretches has a factor, and no key is set that the
// chosen type does not read (a value silently ignored is a mistake).
void validate_rope(const Rope& r) {
  const Rope d;
  struct Key {
    std::string_view name;
    bool set;
    std::vector<std::string_view> read_by;
  };
  const Key keys[] = {
      {"factor", r.factor != d.factor, {"linear", "llama3", "yarn", "dynamic"}},
      {"original_max_position_embeddings", r.original_max_position_embeddings != d.original_max_position_embeddings,
       {"llama3", "yarn"}},
      {"beta_fast", r.beta_fast != d.beta_fast, {"yarn"}},
      {"beta_slow", r.beta_slow != d.beta_slow, {"yarn"}},
      {"mscale", r.mscale != d.mscale, {"yarn"}},
      {"mscale_all_dim", r.mscale_all_dim != d.mscale_all_dim, {"yarn"}},
      {"attention_factor", r.attention_factor != d.attention_factor, {"yarn"}},
      {"truncate", r.truncate != d.truncate, {"yarn"}},
      {"low_freq_factor", r.low_freq_factor != d.low_freq_factor, {"llama3"}},
      {"high_freq_factor", r.high_freq_factor != d.high_freq_factor, {"llama3"}},
  };
  for (const Key& k : keys)
    if (k.set && std::find(k.read_by.begin(), k.read_by.end(), r.type) == k.read_by.end())
      fail(fmt::format("rope.{} is set but rope.type = {} does not read it", k.name, r.type),
           fmt::format("rope.{} is for rope.type = {}: set the type, or leave the key out", k.name, join(k.read_by)));
  if (r.type != "model" && r.type != "default" && !(r.factor >= 1))
    fail(fmt::format("rope.type = {} needs rope.factor >= 1, got {}", r.type, r.factor),
         "e.g. --set rope.factor=4 for four times the original context");
  if (!(r.beta_fast > r.beta_slow))
    fail(fmt::format("rope.beta_fast ({}) must exceed rope.beta_slow ({})", r.beta_fast, r.beta_slow),
         "YaRN's defaults are 32 and 1");
  if (!(r.high_freq_factor > r.low_freq_factor))
    fail(fmt::format("rope.high_freq_factor ({}) must exceed rope.low_freq_factor ({})", r.high_freq_factor,
                     r.low_freq_factor),
         "Llama 3.1's are 4 and 1");
}

}  // namespace

RunConfig RunConfig::defaults() { return RunConfig{}; }

RunConfig RunConfig::from_toml(const std::string& text, const std::string& source) {
  RunConfig config = defaults();
  config.apply_toml(text, source);
  return config;
}

void RunConfig::apply_toml(const std::string& text, const std::string& source) {
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    fail(fmt::format("{}:{}:{}: TOML syntax error: {}", source, e.source().begin.line, e.source().begin.column,
                     shown(e.description())),
         "see https://toml.io for the syntax");
  }
  const Origin origin{source, true};
  std::vector<Field> fields = fields_of(*this);
  const std::vector<std::string_view> sections = section_names();
  for (const auto& [name, node] : root) {
    const std::string where = origin.at(name.source());
    const auto* table = node.as_table();
    if (std::find(sections.begin(), sections.end(), name.str()) == sections.end()) {
      // A known key here was most likely written above its section header.
      if (!table)
        for (const Field& f : schema())
          if (f.key == name.str())
            fail(fmt::format("{}: key {} is outside any section", where, f.key),
                 fmt::format("put it under [{}]", f.section));
      unknown_section(name.str(), where);
    }
    if (!table)
      fail(fmt::format("{}: {} must be a table, got {}", where, name.str(), describe(node)),
           fmt::format("write [{}] on a line of its own and its keys below it", name.str()));
    for (const auto& [key, value] : *table) {
      const std::string key_where = origin.at(key.source());
      const Field& f = find_field(fields, name.str(), key.str(), key_where);
      assign(f, value, origin.at(value.source()));
    }
  }
}

RunConfig RunConfig::from_file(const std::string& path) {
  RunConfig config = defaults();
  config.apply_file(path);
  return config;
}

void RunConfig::apply_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    fail(fmt::format("{}: is a directory, not a config file", path), "give the path of a .toml file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(fmt::format("{}: cannot open config file", path), "check the path given to --config");
  std::ostringstream text;
  text << in.rdbuf();
  apply_toml(text.str(), path);
}

void RunConfig::apply_override(const std::string& assignment) {
  const std::string where = "--set";
  const auto eq = assignment.find('=');
  if (eq == std::string::npos)
    fail(fmt::format("{} '{}': expected section.key=value", where, shown(assignment)), "e.g. --set optimizer.lr=1e-3");
  const std::string name = trim(std::string_view(assignment).substr(0, eq));
  const std::string raw = trim(std::string_view(assignment).substr(eq + 1));
  const auto dot = name.find('.');
  if (dot == std::string::npos) {
    std::string hint = "e.g. --set optimizer.lr=1e-3";
    for (const Field& f : schema())
      if (f.key == name) hint = fmt::format("did you mean {}?", f.name());
    fail(fmt::format("{} '{}': key '{}' has no section (write section.key)", where, shown(assignment), shown(name)),
         hint);
  }
  std::vector<Field> fields = fields_of(*this);
  const Field& f = find_field(fields, name.substr(0, dot), name.substr(dot + 1), where);

  const std::optional<toml::table> parsed = parse_value(raw);
  const toml::node* node = parsed ? parsed->get("v") : nullptr;
  const bool quoted_or_list = !raw.empty() && (raw[0] == '"' || raw[0] == '\'' || raw[0] == '[');
  // A path or a name given bare on the command line is the string itself (a word option's word too).
  const auto text = [&]() -> std::string {
    if (node && node->is_string()) return node->as_string()->get();
    if (quoted_or_list)
      fail(fmt::format("{}: {} is not a valid TOML string: {}", where, f.name(), shown(raw)), example(f));
    return raw;
  };
  if (auto* s = std::get_if<std::string*>(&f.target)) {
    **s = text();
    return;
  }
  if (auto* kind = std::get_if<ScheduleKind*>(&f.target)) return read_option_word(text(), **kind);
  if (auto* mode = std::get_if<RecomputeMode*>(&f.target)) return read_option_word(text(), **mode);
  if (auto* list = std::get_if<std::vector<std::string>*>(&f.target)) {
    if (node && node->is_array()) assign(f, *node, where);
    else if (node && node->is_string()) **list = {node->as_string()->get()};
    else if (quoted_or_list)
      fail(fmt::format("{}: {} is not a valid TOML list: {}", where, f.name(), shown(raw)), example(f));
    else **list = {raw};
    return;
  }
  if (auto* n = std::get_if<int64_t*>(&f.target); n && f.rule->or_auto && (raw == "auto" || raw == "\"auto\"")) {
    **n = kAuto;  // bare or quoted, as on the command line
    return;
  }
  if (!node)
    fail(fmt::format("{}: {} must be {}, got '{}'", where, f.name(), expected(f.target), shown(raw)), example(f));
  assign(f, *node, where);
}

void RunConfig::validate() const {
  // Each value against its row's rule, in table order; the table only reads through its pointers.
  for (const OptionRef& o : fields_of(const_cast<RunConfig&>(*this))) check_option(o);
  // Then the rules between options.
  validate_rope(rope);
  schedule.validate();
  parallel.validate();
  lora.validate();
  // Products of bounded counts: each factor is checked above, so two ranks' counts multiply exactly
  // in 64 bits, and the run's tokens (up to 2^126) are compared as a double, exact to a part in 2^53.
  const int64_t ranks = parallel.dp * parallel.tp * parallel.cp;  // tp or cp is 1 (parallel.validate)
  if (static_cast<double>(ranks) > kMaxRanks)
    fail(fmt::format("parallel.dp x parallel.tp x parallel.cp must be <= {}, got {} x {} x {} = {} ranks", kMaxRanks,
                     parallel.dp, parallel.tp, parallel.cp, ranks),
         "lower parallel.dp, parallel.tp or parallel.cp");
  if (parallel.cp > 1) {
    const int64_t P = parallel.cp;
    if (data.documents)
      fail(fmt::format("data.documents with parallel.cp = {} is not implemented: a rank's share of a chunk would cut "
                       "its documents",
                       P),
           "set data.documents = false, or parallel.cp = 1");
    if (schedule.save_inputs)
      fail("schedule.save_inputs keeps every token of a chunk; parallel.cp splits them over ranks",
           "set schedule.save_inputs = false with parallel.cp");
    if (!cp_splits_chunks(P, data.seq_len, schedule.chunk, schedule.bwd_chunk))
      fail(fmt::format("parallel.cp = {} splits every chunk's tokens into equal shares: data.seq_len = {}, "
                       "schedule.chunk = {} and schedule.bwd_chunk = {} must be multiples of it",
                       P, data.seq_len, schedule.chunk, schedule.bwd_chunk),
           "give data.seq_len and the chunk lengths as multiples of parallel.cp");
  }
  // The run counts its tokens (tokens_seen, the metrics, the checkpoint's state) in 64 bits.
  const double run_tokens = static_cast<double>(parallel.dp) * static_cast<double>(data.batch_size) *
                            static_cast<double>(data.seq_len) * static_cast<double>(data.grad_accum) *
                            static_cast<double>(train.steps);
  if (run_tokens > static_cast<double>(kMaxRunTokens))
    fail(fmt::format("train.steps = {} steps of parallel.dp x data.batch_size x data.seq_len x data.grad_accum = "
                     "{} x {} x {} x {} tokens must be <= 2^62 tokens in all (the run's token count is 64-bit)",
                     train.steps, parallel.dp, data.batch_size, data.seq_len, data.grad_accum),
         "lower train.steps, data.batch_size, data.seq_len or data.grad_accum");
  // A constant rate never reaches min_lr, so only a decay makes the pair inconsistent.
  if (optimizer.decay != "constant" && optimizer.min_lr > optimizer.lr)
    fail(fmt::format("optimizer.min_lr must be <= optimizer.lr ({}), got {}", optimizer.lr, optimizer.min_lr),
         "the decay goes from lr down to min_lr");
  if (parallel.zero == 3 && schedule.cast_layers)
    fail("schedule.cast_layers rounds each block's weights from the whole master weights; parallel.zero = 3 gathers "
         "each block in the compute dtype from the ranks' shards instead",
         "turn schedule.cast_layers off with parallel.zero = 3");
  if (optimizer.offload && (parallel.zero == 1 || parallel.zero == 2))
    fail(fmt::format("optimizer.offload keeps the whole AdamW state on each rank's host; parallel.zero = {} shards it",
                     parallel.zero),
         "set parallel.zero = 0 or 3 with optimizer.offload (ZeRO 3 offloads each rank's shard), or turn "
         "optimizer.offload off");
  if (optimizer.offload && parallel.zero == 3 && (lora.enabled() || !model.adapter.empty()))
    fail("optimizer.offload with parallel.zero = 3 offloads the sharded master weights; under LoRA the base is frozen "
         "and the adapters' small state stays on the device",
         "turn optimizer.offload off with LoRA and parallel.zero = 3");
  if (eval.at_start && data.eval.empty() && data.eval_fraction <= 0)
    fail("eval.at_start is true but there is no eval data (data.eval is empty and data.eval_fraction is 0)",
         "set eval.at_start = false, give data.eval, or set data.eval_fraction > 0");
  if (eval.every != 0 && data.eval.empty() && data.eval_fraction <= 0)
    fail(fmt::format("eval.every is {} but there is no eval data (data.eval is empty and data.eval_fraction is 0)",
                     eval.every),
         "set eval.every = 0, give data.eval, or set data.eval_fraction > 0");
}

LlamaConfig RunConfig::model_config() const {
  LlamaConfig mc = LlamaConfig::resolve(model.source);
  if (model.tie_embeddings) mc.tie_word_embeddings = *model.tie_embeddings;
  return with_rope(mc, rope, fmt::format("model.source '{}' with rope.type = {}", model.source, rope.type));
}

LlamaConfig with_rope(LlamaConfig mc, const RunConfig::Rope& rope, const std::string& what) {
  if (rope.type == "model") return mc;
  validate_rope(rope);
  const int64_t original =
      rope.original_max_position_embeddings > 0 ? rope.original_max_position_embeddings : mc.max_position_embeddings;
  RopeScaling s;
  s.factor = rope.factor;
  if (rope.type == "linear") {
    s.type = RopeScaling::Type::linear;
  } else if (rope.type == "llama3") {
    s.type = RopeScaling::Type::llama3;
    s.low_freq_factor = rope.low_freq_factor;
    s.high_freq_factor = rope.high_freq_factor;
    s.original_max_position = original;
  } else if (rope.type == "yarn") {
    s.type = RopeScaling::Type::yarn;
    s.original_max_position = original;
    s.beta_fast = rope.beta_fast;
    s.beta_slow = rope.beta_slow;
    s.truncate = rope.truncate;
    // 0 is HF's "not given" for the three (its mscale test is truthiness).
    if (rope.attention_factor > 0) s.attention_factor = rope.attention_factor;
    if (rope.mscale > 0) s.mscale = rope.mscale;
    if (rope.mscale_all_dim > 0) s.mscale_all_dim = rope.mscale_all_dim;
    mc.max_position_embeddings = std::llround(rope.factor * static_cast<double>(original));
  } else if (rope.type == "dynamic") {
    s.type = RopeScaling::Type::dynamic;
    s.original_max_position = mc.max_position_embeddings;
  } else {
    s = RopeScaling{};  // default: no scaling
  }
  mc.rope_scaling = s;
  mc.validate(what);
  return mc;
}

RunConfig::Rope rope_from_assignments(const std::vector<std::string>& assignments, const std::string& flag) {
  RunConfig rc;
  for (const std::string& a : assignments) {
    const size_t eq = a.find('=');
    if (eq == std::string::npos || eq == 0)
      fail(fmt::format("{} '{}': not KEY=VALUE", flag, a), fmt::format("e.g. {} type=yarn {} factor=8", flag, flag));
    rc.apply_override("rope." + a);
  }
  return rc.rope;
}

namespace {

// [section] headers and key = value lines; with help, each key preceded by its help as a comment.
std::string write_toml(const RunConfig& config, std::string_view header, bool with_help) {
  std::string out(header);
  std::string_view section;
  for (const OptionRef& f : fields_of(const_cast<RunConfig&>(config))) {  // read only
    if (f.section != section) {
      section = f.section;
      out += fmt::format("\n[{}]\n", section);
    }
    if (with_help) {
      const std::string values = f.rule->describe();
      out += fmt::format("# {}{}\n", f.help, values.empty() || f.rule->words.size() ? "" : " (" + values + ")");
    }
    if (const std::optional<std::string> v = toml_value(f))
      out += fmt::format("{} = {}\n", f.key, *v);
    else
      out += fmt::format("# {} is unset: as the model configures it\n", f.key);
  }
  return out;
}

// A markdown table cell: '|' escaped, code in backticks.
std::string cell(std::string_view text) {
  std::string out;
  for (const char ch : text) out += ch == '|' ? std::string("\\|") : std::string(1, ch);
  return out;
}
std::string code(std::string_view text) { return text.empty() ? "" : "`" + cell(text) + "`"; }

}  // namespace

RunConfig RunConfig::default_run() {
  RunConfig c = defaults();
  c.data.train = {"@demo"};
  return c;
}

std::vector<OptionRef> RunConfig::options() { return fields_of(*this); }

std::string RunConfig::to_toml() const {
  return write_toml(*this, "# chunkwise train: the resolved configuration of this run.\n", false);
}

std::string RunConfig::commented_toml() const {
  return write_toml(*this,
                    "# chunkwise train: a run configuration, every key with its help and accepted values.\n"
                    "# A --config file need only name the keys it changes; --set section.key=value overrides\n"
                    "# either (e.g. --set optimizer.lr=1e-3 --set data.train=my.bin). \"@demo\" in data.train\n"
                    "# is the demo corpus.\n",
                    true);
}

std::string RunConfig::options_markdown() {
  RunConfig train = defaults();
  ScheduleOptions library;  // the defaults of bench, gradcheck (and ScheduleOptions itself)
  const std::vector<OptionRef> library_schedule = bind_options("schedule", schedule_option_table(), library);
  std::string out =
      "| key | flag | type | default | values | meaning |\n"
      "|---|---|---|---|---|---|\n";
  for (const OptionRef& f : fields_of(train)) {
    const std::optional<std::string> toml = toml_value(f);
    std::string value = toml ? code(*toml) : "unset";
    for (const OptionRef& l : library_schedule)
      if (f.section == l.section && f.key == l.key && !option_values_equal(f.target, l.target))
        value += fmt::format(" (bench, gradcheck: {})", code(*toml_value(l)));
    out += fmt::format("| {} | {} | {} | {} | {} | {} |\n", code(f.name()), code(f.flag),
                       option_type_name(f.target), value, cell(f.rule->describe()), cell(f.help));
  }
  return out;
}

bool resume_keeps_continuation(std::string_view key) {
  static const std::string_view keys[] = {"train.steps", "train.memory_check", "train.device_memory"};
  static const std::string_view sections[] = {"eval.", "checkpoint.", "log.", "sample."};
  for (std::string_view k : keys)
    if (key == k) return true;
  for (std::string_view s : sections)
    if (key.starts_with(s)) return true;
  return false;
}

std::vector<ConfigChange> resume_changes(const RunConfig& saved, RunConfig& resumed) {
  const std::vector<OptionRef> before = const_cast<RunConfig&>(saved).options();  // read only
  const std::vector<OptionRef> after = resumed.options();
  std::vector<ConfigChange> changes;
  for (size_t i = 0; i < after.size(); ++i) {
    if (auto* n = std::get_if<int64_t*>(&after[i].target); n && after[i].rule->or_auto && **n == kAuto)
      copy_option_value(after[i].target, before[i].target);
    if (option_values_equal(before[i].target, after[i].target)) continue;
    const std::string name = after[i].name();
    changes.push_back({name, toml_value(before[i]).value_or("unset"), toml_value(after[i]).value_or("unset"),
                       resume_keeps_continuation(name)});
  }
  return changes;
}

void check_resume_changes(const std::vector<ConfigChange>& changes, bool force, std::ostream& out) {
  std::string breaking;
  for (const ConfigChange& c : changes) {
    out << fmt::format("resume: {}: {} -> {}{}\n", c.key, c.from, c.to,
                       c.continues ? "" : force ? " (--force-changes: the run no longer continues as it started)" : "");
    if (!c.continues) breaking += fmt::format("{}{} ({} -> {})", breaking.empty() ? "" : ", ", c.key, c.from, c.to);
  }
  if (!breaking.empty() && !force)
    fail(fmt::format("--resume: the run directory's config.toml differs in {}: the resumed steps would not be the ones "
                     "the started run takes",
                     breaking),
         "resume without those changes (the saved config.toml is read, so --config and --set are needed only for "
         "changes), or give --force-changes to continue with them");
}

nlohmann::json RunConfig::to_json() const {
  RunConfig& self = const_cast<RunConfig&>(*this);  // read only, as in to_toml
  nlohmann::json j = nlohmann::json::object();
  for (const Field& f : fields_of(self)) {
    nlohmann::json& slot = j[std::string(f.section)][std::string(f.key)];
    std::visit(
        [&](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, std::optional<bool>>)
            slot = p->has_value() ? nlohmann::json(**p) : nlohmann::json(nullptr);
          else if constexpr (std::is_enum_v<T>) slot = std::string(option_word(*p));
          else slot = *p;
        },
        f.target);
  }
  return j;
}

}  // namespace cw
