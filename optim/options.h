// Option tables: one row per option of a settings struct, from which every spelling of it is made.
//
// A row names the option's TOML key (within its section), its command-line flag, the struct member
// that holds it, the values it accepts and one line of help. The struct's default-constructed value
// is the one source of defaults; nothing here repeats them. From the rows come: the CLI flags of
// train, bench, gradcheck and plan (tools/cli_options.h), reading TOML and `--set section.key=value`,
// the resolved config.toml of a run (tools/train/run_config.h), validation with one-line errors
// naming "section.key", and the options table of docs/options.md (`chunkwise options --markdown`,
// which a test compares with that page).
//
// The schedule's table is here, beside ScheduleOptions (optim/schedule.h); the other sections of
// the training run's configuration are in tools/train/run_config.cpp, in the same form.
#pragma once

#include "optim/schedule.h"

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace cw {

// Where one option's value lives in one struct; the alternative is the option's type. The enums are
// word options: written as one of a few words (a string in TOML, on the command line and in JSON),
// held as the value the word names (option_word, read_option_word below).
using OptionTarget = std::variant<int64_t*, uint64_t*, double*, bool*, std::optional<bool>*, std::string*,
                                  std::vector<std::string>*, ScheduleKind*, RecomputeMode*>;

// The same, as a member of S (a table row is about the struct, not one instance of it).
template <class S>
using OptionMember = std::variant<int64_t S::*, uint64_t S::*, double S::*, bool S::*, std::optional<bool> S::*,
                                  std::string S::*, std::vector<std::string> S::*, ScheduleKind S::*,
                                  RecomputeMode S::*>;

// A word option's word, and the value a word names: any other word throws one line naming the
// option's key and its words (parse_schedule_kind, parse_recompute_mode).
inline std::string_view option_word(ScheduleKind kind) { return schedule_name(kind); }
inline std::string_view option_word(RecomputeMode mode) { return recompute_name(mode); }
inline void read_option_word(std::string_view word, ScheduleKind& to) { to = parse_schedule_kind(word); }
inline void read_option_word(std::string_view word, RecomputeMode& to) { to = parse_recompute_mode(word); }

// The values an option accepts beyond its type. Numbers: a range; strings: one of some words, or
// not empty; lists of paths: no empty path. Always: floats finite, unsigned integers below 2^63 (TOML
// integers are signed 64-bit). A word option's rule lists its words, in the enum's order (for the
// help and the options table; its readers take no other word).
struct OptionRule {
  std::optional<double> min, max;
  bool or_auto = false;                     // an integer option: "auto" (kAuto, optim/schedule.h) too;
                                            // its readers refuse a negative number (kAuto is -1)
  bool min_open = false, max_open = false;  // > min rather than >= min; < max rather than <= max
  std::vector<std::string_view> words;      // a string option: one of these
  bool non_empty = false;                   // a string: not empty
  bool no_empty_path = false;               // a list of paths: none of them empty
  std::string_view zero;                    // what 0 means, shown in range errors: "(0: automatic)"

  std::string describe() const;             // ">= 0", ">= 0 or auto", "in [0, 1)", "full | seco", "not empty"; "" for none
};

OptionRule at_least(double min, std::string_view zero = {});  // >= min
OptionRule at_least_or_auto(double min, std::string_view zero = {});  // >= min, or "auto" (kAuto)
OptionRule in_range(double min, double max, std::string_view zero = {});  // in [min, max]
OptionRule in_range_or_auto(double min, double max, std::string_view zero = {});  // in [min, max], or "auto"

// The upper bounds of counts, so that a mistyped value (2^62 sequences) is refused by name before
// anything is sized by it, and every product of two bounded counts fits in 64 bits. Each lies far
// beyond what any machine can run: a sequence of 2^30 tokens holds a K/V store of terabytes even
// for a small model, and a micro-batch of 2^20 sequences is a million times a large one. Tighter
// limits that depend on the model and the machine are checked where those are known
// (tools/train/train.cpp).
inline constexpr double kMaxTokensOfSequence = 1073741824.0;  // 2^30: seq_len, chunk, bwd_chunk, generated tokens
inline constexpr double kMaxSequencesOfBatch = 1048576.0;     // 2^20: batch_size, grad_accum, eval batches
inline constexpr double kMaxSteps = 1099511627776.0;          // 2^40: steps, warmup, every-N-steps periods
inline constexpr double kMaxRanks = 65536.0;                  // 2^16: dp, tp, and dp x tp
inline constexpr double kMaxCount = 1048576.0;                // 2^20: shards, layers, kept checkpoints, threads, ranks of adapters
OptionRule above(double min);                                  // > min
OptionRule between(double min, double max, bool min_open, bool max_open);
OptionRule one_of(std::vector<std::string_view> words);
OptionRule non_empty();
OptionRule no_empty_path();

// One row of a table of the options of S.
template <class S>
struct Option {
  std::string_view key;    // the TOML key in its section
  std::string_view flag;   // the command-line flag ("--chunk"); empty: none
  OptionMember<S> member;
  OptionRule rule;
  std::string_view help;   // one line: CLI help, README, the commented TOML
};

// A row bound to one instance: what the readers, writers and checks work on.
struct OptionRef {
  std::string_view section, key, flag, help;
  const OptionRule* rule = nullptr;
  OptionTarget target;
  std::string name() const;  // "section.key"
};

template <class S>
void bind_options(std::vector<OptionRef>& out, std::string_view section, const std::vector<Option<S>>& table,
                  S& instance) {
  for (const Option<S>& o : table)
    out.push_back(OptionRef{section, o.key, o.flag, o.help, &o.rule,
                            std::visit([&](auto member) -> OptionTarget { return &(instance.*member); }, o.member)});
}

template <class S>
std::vector<OptionRef> bind_options(std::string_view section, const std::vector<Option<S>>& table, S& instance) {
  std::vector<OptionRef> out;
  bind_options(out, section, table, instance);
  return out;
}

// Throws a one-line cw::Error "section.key must be ..., got ..." when the value breaks its rule
// (the hint: the option's help).
void check_option(const OptionRef& option);

// The type as the options table names it: integer, unsigned integer, number, boolean, string (a word
// option too), list of strings.
std::string_view option_type_name(const OptionTarget& target);
// Copies the value of `from` into `to` (the same option of two instances).
void copy_option_value(const OptionTarget& to, const OptionTarget& from);
bool option_values_equal(const OptionTarget& a, const OptionTarget& b);

// Values as TOML text: "seco" quoted and escaped, floats in the shortest form that reads back to
// the same double, with a '.' or exponent, kAuto as "auto" where the rule takes it; nullopt for an
// unset optional (TOML has no null).
std::string toml_string(std::string_view s);
std::string toml_float(double v);
std::optional<std::string> toml_value(const OptionRef& option);

// [schedule]: every option of ScheduleOptions.
const std::vector<Option<ScheduleOptions>>& schedule_option_table();

// How a run is spread over ranks (processes, one per GPU; or threads of one process on the CPU).
// Data parallelism and ZeRO are parallel/data_parallel.h's, tensor parallelism (every block's heads
// and FFN split over tp ranks) parallel/tensor_parallel.h's, context parallelism (every chunk's tokens
// split over cp ranks) parallel/context_parallel.h's; the rows are parallel_option_table().
struct ParallelOptions {
  int64_t dp = 1;           // data-parallel ranks; each takes its own batch_size sequences per micro-batch
  int64_t zero = 0;         // 0: every rank keeps the whole AdamW state; 1: its shard of the moments;
                            // 2: also only its shard of the reduced gradient (a reduce-scatter);
                            // 3: only its shard of every parameter too (parallel/zero3.h; not with tp > 1)
  double bucket_mb = 25.0;  // gradient all-reduce buckets (MiB of gradient), each launched as soon as the
                            // step's last backward has finished it
  int64_t tp = 1;                  // tensor-parallel ranks; must divide heads, K/V heads and FFN width
  bool sequence_parallel = false;  // norms, residual stream, embedding and loss on each rank's tokens only
  bool tp_regather = false;        // with sequence_parallel: the backward all-gathers the normed input
                                   // again instead of keeping it (memory for communication)
  int64_t cp = 1;  // context-parallel ranks of each data-parallel rank: each holds 1/cp of every chunk's
                   // tokens and attends 1/cp of the heads (parallel/context_parallel.h; not with tp > 1 or zero 3)

  bool operator==(const ParallelOptions&) const = default;
  void validate() const;    // the table's rules and the rules between options; throws naming the option
};

// [parallel]: every option of ParallelOptions.
const std::vector<Option<ParallelOptions>>& parallel_option_table();

// [lora]: every option of LoraConfig (model/lora.h: LoRA adapters, the base frozen). Its rules between
// options are LoraConfig::validate()'s; validate_lora checks the rows, then those.
const std::vector<Option<LoraConfig>>& lora_option_table();
void validate_lora(const LoraConfig& lora);

}  // namespace cw
