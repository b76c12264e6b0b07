// The configuration of `chunkwise train`: one plain struct, read from TOML, adjusted by
// `--set section.key=value` overrides and the command line's flags, checked, and written back into
// the run directory.
//
// Every key is a row of an option table (optim/options.h): the sections' tables are in
// run_config.cpp, [schedule]'s is schedule_option_table() beside ScheduleOptions. The defaults are
// the structs' below; `chunkwise train` without --config runs default_run(), which differs from
// them only in data.train = ["@demo"], the demo corpus. `chunkwise options --markdown` prints the
// table docs/options.md shows, `--toml` the default run as commented TOML.
//
// Layers, later ones winning: defaults(), then the file given with --config (only the keys it names
// change), then each --set in order, then the flags. from_toml and apply_override check names and
// types only, so a value that is out of range in the file can still be fixed by a later --set;
// validate() checks the values once everything is applied.
//
// Errors are one line naming where the value came from (the file, with line:column, or "--set") and
// the key as "section.key", with a hint: unknown sections and keys suggest the closest known name,
// and a value of the wrong type says what was expected and what was found. An integer is accepted
// where a float is expected (lr = 3 means 3.0), never the other way round, since a truncated
// fraction of a step count or a token count is a mistake, not an intention.
//
// to_toml() writes every resolved value, so a run directory's copy reproduces the run on its own;
// from_toml(to_toml()) gives back exactly the same config (floats are written in the shortest form
// that reads back to the same double).
#pragma once

#include "model/config.h"
#include "optim/options.h"
#include "optim/schedule.h"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

namespace cw {

struct RunConfig {
  struct Model {
    std::string source = "small";         // preset name, config.json path, or HF checkpoint directory
    std::string dtype = "auto";           // auto (GPU: bf16, CPU: f32) | f64 | f32 | bf16
    uint64_t init_seed = 1234;            // random initialisation (ignored for a checkpoint)
    std::optional<bool> tie_embeddings;   // unset: as the model configures it
    std::string adapter;                  // a PEFT LoRA adapter directory to continue from; empty: none
    bool operator==(const Model&) const = default;
  };
  // [rope]: the model's RoPE scaling replaced for this run (fine-tuning to a longer context), as the
  // keys of HF's rope_scaling name it; type = "model" keeps the model's own. The run's model config
  // (model_config()) and so its checkpoints' config.json carry the replacement.
  struct Rope {
    std::string type = "model";           // model | default | linear | llama3 | yarn | dynamic
    double factor = 0;                    // 0: not given (every scaling but default needs it)
    int64_t original_max_position_embeddings = 0;  // llama3, yarn; 0: the model's max_position_embeddings
    double beta_fast = 32.0;              // yarn
    double beta_slow = 1.0;               // yarn
    double mscale = 0;                    // yarn; 0: not given
    double mscale_all_dim = 0;            // yarn; 0: not given
    double attention_factor = 0;          // yarn; 0: from factor, mscale and mscale_all_dim
    bool truncate = true;                 // yarn
    double low_freq_factor = 1.0;         // llama3
    double high_freq_factor = 4.0;        // llama3
    bool operator==(const Rope&) const = default;
  };
  struct Data {
    std::vector<std::string> train;       // paths and glob patterns (tools/data/tokens.h)
    std::vector<std::string> eval;        // empty: the last eval_fraction of the training stream
    std::string format = "shard";         // shard | u16 | u32
    double eval_fraction = 0.05;          // used only when eval is empty; 0: no evaluation data
    int64_t seq_len = 256;                // T: tokens per sequence
    int64_t batch_size = 8;               // B: sequences per micro-batch
    int64_t grad_accum = 1;               // micro-batches per optimizer step
    uint64_t seed = 1;                    // the window sampler's shuffle
    std::string tokenizer = "bytes";      // bytes | model | a tokenizer.json, a directory holding one, a .gguf
    std::string loss = "all";             // all | assistant: labels only on the loss mask's tokens
    bool documents = false;               // packed documents: attention within each (tools/data/batches.h)
    std::string positions = "document";   // with documents: RoPE positions restart per document | absolute
    bool operator==(const Data&) const = default;
  };
  struct Optimizer {
    double lr = 3e-3;                     // peak learning rate, reached after warmup
    double min_lr = 3e-4;                 // where the decay ends
    int64_t warmup_steps = 20;            // linear warmup from 0
    std::string decay = "cosine";         // cosine | linear | constant
    double beta1 = 0.9;                   // AdamW moments
    double beta2 = 0.95;
    double eps = 1e-8;
    double weight_decay = 0.1;            // decoupled
    double grad_clip = 1.0;               // global L2 norm; 0: no clipping
    bool offload = false;                 // master weights and moments in host memory (optim/adamw_offload.h)
    bool operator==(const Optimizer&) const = default;
  };
  struct Train {
    int64_t steps = 300;                  // optimizer steps
    std::string device = "auto";          // auto | cpu | cuda
    std::string nonfinite = "skip";       // a NaN/inf loss or gradient: skip the step, or stop
    bool deterministic = false;           // GPU: bitwise-reproducible gradients (slower attention backward)
    int64_t threads = 0;                  // CPU threads; 0: all cores
    double device_memory = 0;             // GPU: GiB the run may use; 0: the whole GPU
    bool memory_check = true;             // refuse before step 1 a run the plan says cannot fit
    bool operator==(const Train&) const = default;
  };
  struct Eval {
    int64_t every = 50;                   // steps between evaluations; 0: never
    int64_t batches = 8;                  // eval batches per evaluation
    bool at_start = false;                // also before the first step
    bool operator==(const Eval&) const = default;
  };
  struct Checkpoint {
    int64_t every = 100;                  // steps between checkpoints; 0: none periodically
    bool at_end = true;                   // save when the last step is done (a stop signal saves regardless)
    int64_t keep_last = 2;                // older checkpoints are deleted
    bool resume = false;                  // continue from the run directory's latest checkpoint
    bool operator==(const Checkpoint&) const = default;
  };
  struct Log {
    std::string run_dir;                  // empty: the trainer picks one
    int64_t every = 1;                    // steps between log lines
    bool plot = true;                     // write loss.svg (loss, learning rate, memory)
    bool operator==(const Log&) const = default;
  };
  struct Sample {
    std::string prompt = "The ";          // text generated from at the end of the run
    int64_t tokens = 200;                 // tokens to generate; 0: no sample
    double temperature = 0.8;             // 0: greedy
    int64_t top_k = 40;                   // 0: no top-k cut
    double top_p = 0.95;                  // 1: no nucleus cut
    uint64_t seed = 1;
    bool at_start = false;                // also before the first step
    bool operator==(const Sample&) const = default;
  };

  Model model;
  Rope rope;
  // [lora]: LoraConfig (model/lora.h): adapters on the base model, which stays frozen; rank 0: off.
  LoraConfig lora;
  Data data;
  // [schedule]: ScheduleOptions (optim/schedule.h), with the two defaults a training run changes.
  ScheduleOptions schedule{.kind = ScheduleKind::seco, .chunk = 64};
  // [parallel]: ParallelOptions (optim/options.h): data-parallel ranks, ZeRO, buckets; tensor parallelism.
  ParallelOptions parallel;
  Optimizer optimizer;
  Train train;
  Eval eval;
  Checkpoint checkpoint;
  Log log;
  Sample sample;

  bool operator==(const RunConfig&) const = default;

  static RunConfig defaults();     // RunConfig{}
  static RunConfig default_run();  // `chunkwise train` without --config: defaults(), data.train = ["@demo"]
  // Defaults overridden by the keys the text gives. `source` names the text in errors (a path).
  static RunConfig from_toml(const std::string& text, const std::string& source);
  static RunConfig from_file(const std::string& path);
  // The keys the text (or file) gives, applied on top of this config: a --config given with
  // --resume changes only the keys it names in the run's saved config.
  void apply_toml(const std::string& text, const std::string& source);
  void apply_file(const std::string& path);

  // "section.key=value", the value read as TOML (256, 0.5, true, "x", ["a", "b"]). String keys also
  // take the text after '=' verbatim when it is not a quoted TOML string (so model.source=tiny and
  // log.run_dir=runs/a work unquoted), and list keys take a single string as a one-element list.
  void apply_override(const std::string& assignment);

  // Each value against its table row's rule, then the rules between options; throws naming "section.key".
  void validate() const;

  ScheduleOptions schedule_options() const { return schedule; }

  // The model the run trains: model.source resolved (model/config.h), model.tie_embeddings and [rope]
  // applied. A yarn override stretches max_position_embeddings to factor x the original length, as
  // transformers' users write a YaRN config; dynamic keeps it (dynamic scales from it). Throws naming
  // rope.* for values the model refuses.
  LlamaConfig model_config() const;

  // Every option, bound to this config, in table order (section by section).
  std::vector<OptionRef> options();

  std::string to_toml() const;         // every key = value, section by section
  std::string commented_toml() const;  // the same, each key preceded by its help and accepted values
  // The options table of docs/options.md: key, flag, type, default, accepted values, help, one row per option.
  static std::string options_markdown();
  nlohmann::json to_json() const;  // {"section": {"key": value}}; an unset tie_embeddings is null
};

// `mc` with the RoPE scaling `rope` describes in place of its own (type "model": `mc` unchanged), as
// RunConfig::model_config applies [rope]; `what` names the model in the error a refused value gets.
LlamaConfig with_rope(LlamaConfig mc, const RunConfig::Rope& rope, const std::string& what);

// [rope] from "key=value" assignments (the keys of the run config's [rope] section without the
// "rope." prefix, e.g. {"type=yarn", "factor=8"}); `flag` names them in errors ("--rope").
RunConfig::Rope rope_from_assignments(const std::vector<std::string>& assignments, const std::string& flag);

// One key a resumed run changes against the config.toml its run directory saved.
struct ConfigChange {
  std::string key;       // "section.key"
  std::string from, to;  // as TOML values
  bool continues = true; // the run continues as it started (resume_keeps_continuation)
};

// Whether changing `key` ("section.key") on --resume leaves the run continuing as it started: what
// it reports, saves, evaluates and samples, and how long it runs. Those are train.steps (the
// decay of the learning rate then ends at the new last step), train.memory_check,
// train.device_memory, eval.*, checkpoint.*, log.* and sample.*. Every other key changes the
// model, the data, the batches, the schedule's arithmetic, a seed or the optimizer, so the resumed
// steps would not be the ones the started run takes.
bool resume_keeps_continuation(std::string_view key);

// The keys `resumed` changes against `saved` (the run directory's config.toml), in table order. A
// schedule.chunk or schedule.offload_window of "auto" in `resumed` where `saved` holds a count takes
// the count: the saved config holds the planner's choice for "auto" at the run's start.
std::vector<ConfigChange> resume_changes(const RunConfig& saved, RunConfig& resumed);

// Prints each change as "resume: section.key: from -> to" and refuses, naming every such key, the
// changes that break continuation unless `force` (--force-changes).
void check_resume_changes(const std::vector<ConfigChange>& changes, bool force, std::ostream& out);

}  // namespace cw
