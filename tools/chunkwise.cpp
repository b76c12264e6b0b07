// `chunkwise`: the command line. Each subcommand is a thin layer over a library function in tools/,
// optim/ or model/, so tests call the same code. Errors end in one clear line and a non-zero exit.
#include "chunkwise_config.h"
#include "engine/engine.h"
#include "engine/env.h"
#include "engine/error.h"
#include "tools/data/tokenizer.h"
#include "tools/data/tokens.h"
#include "tools/bench_chart.h"
#include "tools/bench_model.h"
#include "tools/bench_ops.h"
#include "tools/cli_options.h"
#include "tools/eval.h"
#include "tools/plan.h"
#include "tools/gradcheck.h"
#include "tools/model_io.h"
#include "tools/train/run_config.h"
#include "tools/train/sample.h"
#include "parallel/comm_nccl.h"
#include "parallel/launch.h"
#include "tools/train/train.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdint>
#include <filesystem>
#include <iostream>

namespace {

// The bounds of the count flags, those of the option tables (optim/options.h): CLI11 refuses a
// value outside them naming the flag, the value and the range, before anything is sized by it.
constexpr int64_t kTokens = static_cast<int64_t>(cw::kMaxTokensOfSequence);
constexpr int64_t kSequences = static_cast<int64_t>(cw::kMaxSequencesOfBatch);
constexpr int64_t kSteps = static_cast<int64_t>(cw::kMaxSteps);
constexpr int64_t kCount = static_cast<int64_t>(cw::kMaxCount);
CLI::Range count_range(int64_t min, int64_t max) { return CLI::Range(min, max); }

}  // namespace

int main(int argc, char** argv) {
  const cw::BackgroundWorkScope background;  // stopped before the static destructors run
  CLI::App app{"chunkwise: exact long-sequence training of Llama models (SeCO / SpaCO)"};
  app.set_version_flag("--version", std::string("chunkwise ") + CW_VERSION);
  app.require_subcommand(1);

  cw::GradcheckOptions gc;
  CLI::App* gradcheck =
      app.add_subcommand("gradcheck", "check a schedule's gradients (finite differences, full, the reference step, ...)");
  gradcheck->add_option("--model", gc.model, "preset, config.json, HF checkpoint directory or .gguf file")->capture_default_str();
  gradcheck->add_option("--seq", gc.seq, "tokens per sequence")->check(count_range(1, kTokens))->capture_default_str();
  gradcheck->add_option("--batch", gc.batch, "sequences")->check(count_range(1, kSequences))->capture_default_str();
  gradcheck->add_option("--dtype", gc.dtype, "f64 | f32")->capture_default_str();
  cw::add_schedule_flags(*gradcheck, gc.schedule);
  cw::add_parallel_flags(*gradcheck, gc.parallel);
  cw::add_lora_flags(*gradcheck, gc.lora);
  gradcheck->add_option("--documents", gc.documents,
                        "packed documents: lengths summing to --seq (sequence b takes them rotated by b)")
      ->delimiter(',');
  gradcheck->add_option("--positions", gc.positions,
                        "with --documents: RoPE positions restart at each document (document) or not (absolute)")
      ->check(CLI::IsMember({"document", "absolute"}))
      ->capture_default_str();
  gradcheck->add_option("--optimizer-steps", gc.optimizer_steps, "against single: AdamW steps before the parameters are compared")
      ->capture_default_str();
  gradcheck->add_option("--against", gc.against,
                        "fd | full | single | separate | reference (default: single with --dp, --tp or --cp > 1, "
                        "else fd for full, full otherwise)");
  gradcheck->add_option("--tol", gc.tol, "fail above this max_rel_err (default 1e-7 fd, 1e-12 the others in f64)");
  gradcheck->add_option("--directions", gc.directions, "random directions per tensor (fd)")
      ->check(count_range(1, kCount))->capture_default_str();
  gradcheck->add_option("--step", gc.step, "finite-difference step along a unit direction")->capture_default_str();
  gradcheck->add_option("--seed", gc.seed, "seed of the init, batch and directions")->capture_default_str();
  gradcheck->add_option("--norm-jitter", gc.norm_jitter, "random init: norm weights 1 (Gemma's 0) + N(0, jitter)")
      ->capture_default_str();
  gradcheck->add_option("--tie-embeddings", gc.tie_embeddings, "override tie_word_embeddings (0 or 1)");
  gradcheck->add_option("--tokens", gc.tokens_file, "batch from a headerless little-endian uint32 file (B x T ids)");
  gradcheck->add_option("--gather-dir", gc.gather_dir,
                        "started by a launcher (one process per GPU, NCCL): where the ranks leave their results for "
                        "rank 0 (a directory every rank can write)");
  gradcheck->add_option("--save-grads", gc.save_grads, "write the loss and gradients (f64, HF names) as safetensors");

  CLI::App* devices = app.add_subcommand("devices", "list the build's features and the devices it sees");

  cw::InitOptions io;
  CLI::App* init = app.add_subcommand("init", "write a randomly initialised HF checkpoint");
  init->add_option("--model", io.model, "preset or config.json")->capture_default_str();
  init->add_option("--out", io.out, "output directory")->required();
  init->add_option("--dtype", io.dtype, "stored dtype: f32 | bf16 | f64")->capture_default_str();
  init->add_option("--seed", io.seed, "initialisation seed")->capture_default_str();
  init->add_option("--norm-jitter", io.norm_jitter, "norm weights 1 (Gemma's 0) + N(0, jitter)")->capture_default_str();
  init->add_option("--tie-embeddings", io.tie_embeddings, "override tie_word_embeddings (0 or 1)");

  cw::LogitsOptions lo;
  CLI::App* logits = app.add_subcommand("logits", "write the logits of a token batch (to compare with other frameworks)");
  logits->add_option("--model", lo.model, "preset, config.json, checkpoint directory or .gguf file")->required();
  logits->add_option("--tokens", lo.tokens, "headerless little-endian uint32 file of batch x seq ids")->required();
  logits->add_option("--batch", lo.batch, "sequences")->check(count_range(1, kSequences))->capture_default_str();
  logits->add_option("--seq", lo.seq, "tokens per sequence")->check(count_range(1, kTokens))->required();
  logits->add_option("--dtype", lo.dtype, "f64 | f32")->capture_default_str();
  logits->add_option("--chunk", lo.chunk, "run in chunks against the K/V store (0: whole sequence)")
      ->check(count_range(0, kTokens))->capture_default_str();
  logits->add_option("--out", lo.out, "output safetensors (tensor 'logits' [batch*seq, vocab])")->required();
  logits->add_option("--adapter", lo.adapter, "a PEFT LoRA adapter directory put on the model");

  cw::MergeOptions mo;
  CLI::App* merge = app.add_subcommand("merge", "fold a PEFT LoRA adapter into its base: a plain HF checkpoint");
  merge->add_option("--model", mo.model, "the base: preset, config.json, checkpoint directory or .gguf file")->required();
  merge->add_option("--adapter", mo.adapter, "the PEFT adapter directory (adapter_config.json, adapter_model.safetensors)")
      ->required();
  merge->add_option("--out", mo.out, "output directory (config.json, model.safetensors)")->required();
  merge->add_option("--dtype", mo.dtype, "stored dtype: f32 | bf16 | f64")->capture_default_str();
  merge->add_option("--seed", mo.seed, "initialisation seed of a base that is not a checkpoint")->capture_default_str();

  cw::BenchOpsOptions bo;
  CLI::App* bench_ops = app.add_subcommand("bench-ops", "time the GPU ops on one shape set (a benchmark)");
  bench_ops->add_option("--tokens", bo.tokens, "rows N")->check(count_range(1, kTokens))->capture_default_str();
  bench_ops->add_option("--hidden", bo.hidden, "C")->capture_default_str();
  bench_ops->add_option("--ffn", bo.ffn, "F")->capture_default_str();
  bench_ops->add_option("--heads", bo.heads, "query heads")->capture_default_str();
  bench_ops->add_option("--kv-heads", bo.kv_heads, "K/V heads of the chunk rows (grouped-query attention; = heads: multi-head)")
      ->capture_default_str();
  bench_ops->add_option("--head-dim", bo.head_dim, "D")->capture_default_str();
  bench_ops->add_option("--vocab", bo.vocab, "embedding rows")->capture_default_str();
  bench_ops->add_option("--dtype", bo.dtype, "bf16 | f32")->capture_default_str();
  bench_ops->add_option("--repeat", bo.repeat, "timed runs (median)")
      ->check(count_range(1, kCount))->capture_default_str();
  bench_ops->add_option("--json", bo.json, "also write the results as JSON");
  bench_ops->add_option("--attention-tokens", bo.attention_tokens, "attention rows at these sequence lengths")
      ->capture_default_str();
  bench_ops->add_option("--attention-shapes", bo.attention_shapes,
                        "the attention rows' HEADS:KV_HEADS:HEAD_DIM, e.g. 8:4:256 (Gemma 2 2B's)")
      ->capture_default_str();
  bench_ops->add_option("--attention-softcap", bo.attention_softcap,
                        "the attention rows' score cap (Gemma 2's attn_logit_softcapping, 50; 0: none)")
      ->capture_default_str();
  bench_ops->add_option("--lm-head-tokens", bo.lm_head_tokens, "LM head rows at these token counts, e.g. 8192 32768")
      ->capture_default_str();
  bench_ops->add_option("--chunk-attention", bo.chunk_attention,
                        "CHUNK:KEYS rows: a chunk's attention in one call and in CHUNK-key blocks (the streamed store), "
                        "e.g. 4096:131072");
  bench_ops->add_option("--linears", bo.linears,
                        "OUT:IN rows: a linear at --tokens rows (forward, d_x, d_W in f32), with cuBLASLt's first "
                        "algorithm and the tuned one (engine.h, gemm_tuning), e.g. 512:2048 3072:2048");

  cw::BenchModelOptions bm;
  CLI::App* bench = app.add_subcommand("bench", "time training steps of a whole model on the GPU (a benchmark)");
  bench->add_option("--model", bm.model, "preset, config.json, checkpoint directory or .gguf file")->capture_default_str();
  bench->add_option("--seq", bm.seq, "tokens per sequence")->check(count_range(1, kTokens))->capture_default_str();
  bench->add_option("--batch", bm.batch, "sequences per step")
      ->check(count_range(1, kSequences))->capture_default_str();
  cw::add_schedule_flags(*bench, bm.schedule);  // --chunk and --offload-window take auto: the planner chooses
  cw::add_lora_flags(*bench, bm.lora);
  bench->add_flag("--optimizer-offload", bm.optimizer_offload,
                  "master weights and AdamW's moments in host memory, updated on the GPU piece by piece as they stream through it (ZeRO-Offload)");
  bench->add_option("--device-memory", bm.device_memory_gib,
                    "GiB the run may use (the pool's ceiling less the CUDA context; 0: the whole GPU)")
      ->capture_default_str();
  bench->add_option("--host-memory", bm.host_memory_gib,
                    "GiB of host memory the plan checks its pinned part against (90% of it; 0: what the machine has "
                    "available)")
      ->capture_default_str();
  bench->add_flag("--deterministic", bm.deterministic, "bitwise-reproducible gradients (deterministic kernels only)");
  bench->add_option("--dtype", bm.dtype, "bf16 | f32")->capture_default_str();
  bench->add_option("--steps", bm.steps, "timed steps (median)")->check(count_range(1, kCount))->capture_default_str();
  bench->add_option("--warmup", bm.warmup, "untimed steps first")->check(count_range(0, kCount))->capture_default_str();
  bench->add_option("--peak-tflops", bm.peak_tflops, "bf16 peak for MFU (0: measure)")->capture_default_str();
  bench->add_option("--json", bm.json, "also write the result as JSON");
  bench->add_option("--documents", bm.documents,
                    "packed documents, positions restarting at each: L (documents of L tokens) or LO:HI (lengths "
                    "drawn in that range)");
  bench->add_option("--trace", bm.trace, "write a Chrome trace (chrome://tracing, Perfetto) of the last timed step");
  bench->add_flag("--force", bm.force, "run even when the planner says the step does not fit (finds where it fails)");

  cw::PlanOptions po;  // tools/plan.h
  CLI::App* plan = app.add_subcommand("plan", "predicted peak memory and step time of a training step");
  plan->add_option("--model", po.model)->capture_default_str();
  plan->add_option("--seq", po.seq)->check(count_range(1, kTokens))->capture_default_str();
  plan->add_option("--batch", po.batch)->check(count_range(1, kSequences))->capture_default_str();
  cw::add_schedule_flags(*plan, po.schedule);  // --chunk and --offload-window take auto: the planner chooses
  cw::add_lora_flags(*plan, po.lora);
  plan->add_option("--dtype", po.dtype)->capture_default_str();
  plan->add_option("--tp", po.tp,
                   "tensor parallel ranks: plan one GPU's share (its heads, K/V heads and FFN columns; without "
                   "sequence parallelism)")->capture_default_str();
  plan->add_option("--dp", po.dp, "data-parallel ranks (with --zero 3: the ranks each parameter is sharded over)")
      ->check(count_range(1, 1 << 20))
      ->capture_default_str();
  plan->add_option("--cp", po.cp,
                   "context-parallel ranks: plan one rank (1/cp of every chunk's tokens and of the heads, the whole "
                   "model) and its all-to-alls' bytes and times")
      ->check(count_range(1, 1 << 20))
      ->capture_default_str();
  plan->add_option("--zero", po.zero,
                   "3: plan one rank of ZeRO 3 (its shard, the gathered block buffers, the collectives' bytes and "
                   "times); 0-2 plan one process's memory")
      ->check(CLI::Range(0, 3))
      ->capture_default_str();
  plan->add_option("--device-memory", po.device_memory_gib, "GiB (default: the GPU's, else 80)");
  plan->add_option("--host-memory", po.host_memory_gib,
                   "GiB of host memory, of which the plan may pin 90% (default: this machine's available memory "
                   "when it has a GPU, else not checked)");
  plan->add_flag("--optimizer-offload", po.optimizer_offload,
                 "master weights and AdamW's moments in host memory, updated on the GPU piece by piece as they stream through it (ZeRO-Offload)");
  plan->add_flag("--explain", po.explain,
                 "with --chunk / --offload-window auto: also list every plan auto compared (settings, memory, time)");
  plan->add_flag("--longest", po.longest,
                 "plan the longest sequence that fits (a multiple of the chunk, else of 1024 tokens) instead of --seq");
  plan->add_option("--json", po.json, "also write the plan as JSON");
  plan->add_option("--documents", po.documents,
                   "packed documents of L tokens, or of lengths drawn in LO:HI, as bench --documents: attention "
                   "planned over their causal squares");

  std::vector<std::string> chart_inputs, chart_labels;
  std::string chart_out, chart_title;
  double chart_device_gib = 0;
  CLI::App* chart = app.add_subcommand(
      "chart", "a picture (SVG): a benchmark table (.csv) as speed and memory against tokens, a step's time by kind "
      "(.csv) as stacked bars, a run's loss curves, or eval results (.json): loss by position as lines, passkey "
      "accuracy as a heat map");
  chart->add_option("inputs", chart_inputs,
                    "a .csv benchmark table or step-time table (tools/bench_chart.h), a run directory or its "
                    "metrics.jsonl; or one or more results of chunkwise eval --json, drawn together")
      ->required();
  chart->add_option("--out", chart_out, "the SVG to write")->required();
  chart->add_option("--title", chart_title, "the chart's title");
  chart->add_option("--label", chart_labels, "eval results: the line of each, in order (default: its own label)");
  chart->add_option("--device-gib", chart_device_gib, "a benchmark table: draw the device's memory at this many GiB");

  std::string config_path, run_dir;
  std::vector<std::string> overrides;
  bool resume = false;
  CLI::App* train = app.add_subcommand("train", "train a model (no --config: the demo run)");
  train->add_option("--config", config_path, "run configuration (TOML)");
  train->add_option("--set", overrides, "override a key: section.key=value (repeatable)");
  train->add_option("--run-dir", run_dir, "run directory (default: runs/<date-time>, printed at start)");
  train->add_flag("--resume", resume,
                  "continue from the latest complete checkpoint in the run directory, with the run's saved "
                  "config.toml under --config, --set and the flags");
  bool force_changes = false;
  train->add_flag("--force-changes", force_changes,
                  "--resume: accept changes to keys that make the resumed steps differ from the started run's "
                  "(model, data, batch, schedule, seeds, optimizer)");
  // The flags of the config's rows that name one (--device, --deterministic, the schedule's), written
  // here and applied after --config and --set.
  cw::RunConfig train_flags = cw::RunConfig::defaults();
  const std::vector<cw::OptionRef> train_flag_options = train_flags.options();
  const std::vector<CLI::Option*> train_flag_given = cw::add_option_flags(*train, train_flag_options);
  int64_t stop_after = 0;
  train->add_option("--stop-after", stop_after, "stop after N steps of this invocation, saving a checkpoint")
      ->check(count_range(0, kSteps));
  std::string train_trace;
  train->add_option("--trace", train_trace, "write a Chrome trace (chrome://tracing, Perfetto) of the first step");

  cw::SampleOptions so;
  int64_t sample_step = 0;
  std::string sample_model, sample_tokenizer, sample_system, sample_device = "auto", sample_dtype = "auto";
  CLI::App* sample = app.add_subcommand("sample", "generate text from a run's checkpoint or from a model");
  CLI::Option* sample_run = sample->add_option("--run", run_dir, "run directory (its latest complete checkpoint)");
  CLI::Option* sample_model_opt =
      sample->add_option("--model", sample_model, "an HF checkpoint directory or a .gguf file");
  sample_run->excludes(sample_model_opt);
  sample->add_option("--step", sample_step, "--run: checkpoint step (default: the latest complete)")->needs(sample_run);
  sample->add_option("--tokenizer", sample_tokenizer,
                     "'model' (the model's own), 'bytes', an HF tokenizer.json, a directory holding one, or a .gguf "
                     "file (default: --run: the run's; --model: 'model')");
  CLI::Option* sample_prompt = sample->add_option("--prompt", so.prompt, "prompt text (--chat: the user's message)")
                                   ->capture_default_str();
  std::string sample_prompt_file;
  sample->add_option("--prompt-file", sample_prompt_file,
                     "the prompt's text from a file (printed: the continuation alone)")
      ->excludes(sample_prompt);
  sample->add_option("--prefill-chunk", so.prefill_chunk,
                     "prompt tokens a prefill chunk (each attends the K/V store); 0: the whole prompt in one")
      ->check(count_range(0, kTokens))
      ->capture_default_str();
  sample->add_flag("--chat", so.chat, "apply the tokenizer's chat template (ChatML) and stop at <|im_end|>");
  CLI::Option* sample_system_opt =
      sample->add_option("--system", sample_system, "--chat: the system message (default: the template's own, if any)");
  std::vector<std::string> sample_rope;
  sample->add_option("--rope", sample_rope,
                     "KEY=VALUE...: replace the model's RoPE scaling, keys as a run's [rope] (e.g. type=yarn factor=8 "
                     "original_max_position_embeddings=8192, or type=dynamic factor=4)");
  sample->add_option("--device", sample_device, "auto (CUDA when available) | cpu | cuda")->capture_default_str();
  sample->add_option("--dtype", sample_dtype, "auto (GPU: bf16, CPU: f32) | f64 | f32 | bf16")->capture_default_str();
  sample->add_option("--tokens", so.tokens, "tokens to generate")
      ->check(count_range(0, kTokens))->capture_default_str();
  sample->add_option("--temperature", so.temperature, "0: greedy")->capture_default_str();
  sample->add_option("--top-k", so.top_k, "0: off")->check(count_range(0, kTokens))->capture_default_str();
  sample->add_option("--top-p", so.top_p, "1: off")->capture_default_str();
  sample->add_option("--seed", so.seed, "sampling seed")->capture_default_str();

  cw::EvalOptions eo;  // tools/eval.h
  CLI::App* eval = app.add_subcommand("eval", "long-context evaluation: loss by position, passkey retrieval");
  eval->add_option("--task", eo.task, "loss-by-position | passkey")->required();
  CLI::Option* eval_model =
      eval->add_option("--model", eo.source.model, "preset, config.json (random init), HF checkpoint directory or .gguf file");
  CLI::Option* eval_run = eval->add_option("--run", eo.source.run, "a run directory (its latest complete checkpoint)");
  eval_run->excludes(eval_model);
  eval->add_option("--step", eo.source.step, "--run: checkpoint step (default: the latest complete)")->needs(eval_run);
  eval->add_option("--tokenizer", eo.source.tokenizer,
                   "'model', 'bytes', an HF tokenizer.json, a directory holding one, or a .gguf file (default: --run: "
                   "the run's; --model: the model's own)");
  eval->add_option("--init-seed", eo.source.seed, "random init of a preset or config.json")->capture_default_str();
  eval->add_option("--rope", eo.source.rope,
                   "KEY=VALUE...: replace the model's RoPE scaling, keys as a run's [rope] (e.g. type=yarn factor=8 "
                   "original_max_position_embeddings=8192): a model extended without training, or type=dynamic");
  eval->add_option("--device", eo.device, "auto (CUDA when available) | cpu | cuda")->capture_default_str();
  eval->add_option("--dtype", eo.dtype, "auto (GPU: bf16, CPU: f32) | f64 | f32 | bf16")->capture_default_str();
  eval->add_option("--chunk", eo.chunk, "tokens a prefill chunk (each attends the K/V store); 0: one chunk")
      ->check(count_range(0, kTokens))
      ->capture_default_str();
  eval->add_option("--json", eo.json, "write the result as JSON");
  eval->add_option("--chart", eo.chart, "draw the result (SVG)");
  eval->add_option("--label", eo.label, "the result's name in charts (default: the model as given)");
  eval->add_option("--compare", eo.compare, "loss-by-position: earlier results (.json) drawn with this one");
  eval->add_option("--data", eo.data, "loss-by-position: held-out token shards or globs");
  eval->add_option("--format", eo.format, "loss-by-position: shard | u16 | u32")->capture_default_str();
  eval->add_option("--seq", eo.seq, "loss-by-position: T, the tokens a window feeds the model")
      ->check(count_range(0, kTokens));
  eval->add_option("--buckets", eo.buckets,
                   "loss-by-position: bucket edges; 1K,4K means positions [0,1K), [1K,4K), then [4K,T)")
      ->capture_default_str();
  eval->add_option("--windows", eo.windows, "loss-by-position: at most this many windows (0: all)")
      ->check(count_range(0, kSequences))->capture_default_str();
  eval->add_flag("--documents", eo.documents,
                 "loss-by-position: windows start at a document's first token (the tokenizer's BOS)");
  eval->add_option("--bos-token", eo.bos_token, "--documents: the token before each document (default: the BOS)");
  eval->add_option("--min-document", eo.min_document,
                   "--documents: count only documents of at least N tokens in their window (--seq: every bucket "
                   "averages the same documents)")
      ->capture_default_str();
  eval->add_option("--lengths", eo.lengths, "passkey: prompt lengths in tokens")->capture_default_str();
  eval->add_option("--depths", eo.depths, "passkey: depths of the key, evenly spaced in [0, 1]")->capture_default_str();
  eval->add_option("--trials", eo.trials, "passkey: keys a length and depth")
      ->check(count_range(1, kCount))->capture_default_str();
  eval->add_option("--answer-tokens", eo.answer_tokens, "passkey: tokens generated for an answer")
      ->check(count_range(1, kTokens))->capture_default_str();
  eval->add_option("--seed", eo.seed, "passkey: the keys' seed")->capture_default_str();
  eval->add_flag("--chat", eo.chat, "passkey: the prompt as the user's message of the tokenizer's chat template");

  bool options_toml = false, options_markdown = false, options_env = false;
  CLI::App* options = app.add_subcommand("options", "every option of a training run: the table of docs/options.md (markdown)");
  CLI::Option* markdown_opt = options->add_flag(
      "--markdown", options_markdown, "the table of keys, flags, types, defaults, values and help (the default)");
  CLI::Option* toml_opt = options->add_flag("--toml", options_toml, "the default run as TOML, each key with its help");
  options
      ->add_flag("--env", options_env,
                 "the environment variables instead: name, default and meaning (docs/environment.md's tables)")
      ->excludes(markdown_opt)
      ->excludes(toml_opt);

  std::vector<std::string> text_inputs, jsonl_inputs, chat_inputs;
  std::string shard_out, jsonl_field = "text";
  cw::TokenizeOptions to;
  std::string tokenizer_spec = "bytes";
  const std::string tokenizer_help =
      "'bytes', an HF tokenizer.json, a directory holding one, or a .gguf model";
  CLI::App* tokenize = app.add_subcommand(
      "tokenize", "UTF-8 text files, JSON Lines of texts or of chats to an llm.c token shard and its flags file "
                  "(document starts; chats: the assistant's tokens)");
  CLI::Option* text_opt = tokenize->add_option("inputs", text_inputs, "text files or globs");
  CLI::Option* jsonl_opt = tokenize->add_option(
      "--jsonl", jsonl_inputs, "JSON Lines files or globs instead: one document per record, its --field string "
                               "(empty lines are skipped)");
  CLI::Option* field_opt =
      tokenize->add_option("--field", jsonl_field, "--jsonl: the records' text field")->capture_default_str();
  CLI::Option* chat_opt = tokenize->add_option(
      "--chat-jsonl", chat_inputs, "JSON Lines files or globs of conversations instead ({\"messages\": [{\"role\", "
                                   "\"content\"}, ...]}; empty lines are skipped), rendered with --tokenizer's chat "
                                   "template; the flags file marks the assistant's tokens for data.loss = assistant");
  tokenize->add_option("--out", shard_out, "output shard (uint16 ids up to 65536 tokens, else uint32)")->required();
  tokenize->add_option("--tokenizer", tokenizer_spec, tokenizer_help)->capture_default_str();
  CLI::Option* split_opt = tokenize->add_flag("--split-paragraphs", to.split_on_blank_lines,
                                              "text files: one document per blank-line separated paragraph");
  CLI::Option* eos_opt = tokenize->add_flag("--eos", to.add_eos, "EOS after each document");
  bool keep_invalid_utf8 = false;
  CLI::Option* invalid_utf8_opt = tokenize->add_flag(
      "--keep-invalid-utf8", keep_invalid_utf8,
      "text files: tokenize bytes that are not UTF-8 as they are instead of refusing the file");
  CLI::Option* bos_token_opt =
      tokenize->add_option("--bos-token", to.bos_token, "the token before each document (default: the tokenizer's BOS)");
  CLI::Option* eos_token_opt =
      tokenize->add_option("--eos-token", to.eos_token, "the token --eos writes (default: the tokenizer's EOS)");
  text_opt->excludes(jsonl_opt)->excludes(chat_opt);
  jsonl_opt->excludes(chat_opt);
  field_opt->needs(jsonl_opt);
  split_opt->excludes(jsonl_opt)->excludes(chat_opt);
  invalid_utf8_opt->excludes(jsonl_opt)->excludes(chat_opt);
  for (CLI::Option* o : {eos_opt, bos_token_opt, eos_token_opt}) o->excludes(chat_opt);

  std::string encode_file;
  CLI::App* encode = app.add_subcommand("encode", "the ids of each line of a text file, one line of ids per line");
  encode->add_option("--tokenizer", tokenizer_spec, tokenizer_help)->required();
  encode->add_option("--text-file", encode_file, "the text: each line encoded without its newline, no BOS/EOS")
      ->required();
  std::string encode_separator = "\n";
  CLI::Option* separator_opt = encode->add_option(
      "--separator", encode_separator,
      "encode the pieces of the file between occurrences of this text instead of its lines (each piece keeps its "
      "newlines; the text as given, e.g. $'\\n__ggml_vocab_test__\\n' in bash)");
  int encode_bench_passes = 0;
  encode->add_option("--bench", encode_bench_passes,
                     "a benchmark instead: encode the lines N times, print the timings as JSON (not the ids)")
      ->excludes(separator_opt);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const cw::Error& e) {  // a word a word option does not take (--schedule, --recompute)
    std::cerr << "chunkwise: error: " << e.what() << "\n";
    return 2;
  }
  try {
    if (*gradcheck) {
      // Started by a launcher: this process is one rank of --dp x --tp on its local rank's GPU, joined
      // by NCCL; rank 0 prints and compares against one process on its GPU.
      const cw::Environment env = cw::process_environment();
      const cw::LaunchInfo launch = cw::read_launch_info(env);
      if (launch.launcher == cw::Launcher::single) return cw::run_gradcheck(gc, std::cout);
      if (launch.rank == 0) std::cout << "launch: " << launch.describe() << "\n";
      const std::unique_ptr<cw::Communicator> comm =
          cw::make_nccl_communicator(launch, launch.local_rank, cw::NcclOptions::from_environment(env));
      cw::NullStream silent;
      return cw::run_gradcheck(gc, launch.rank == 0 ? std::cout : silent.stream, comm.get());
    }
    if (*train) {
      // The layers above a base: --config's keys, each --set, the flags.
      const auto layered = [&](cw::RunConfig base) {
        if (!config_path.empty()) base.apply_file(config_path);
        for (const auto& o : overrides) base.apply_override(o);
        cw::copy_given_flags(train_flag_given, train_flag_options, base.options());
        return base;
      };
      cw::RunConfig rc = layered(config_path.empty() ? cw::RunConfig::default_run() : cw::RunConfig::defaults());
      // A resumed run is the run as it was started: its saved config.toml, the layers on top of it.
      const std::string dir = !run_dir.empty() ? run_dir : rc.log.run_dir;
      const std::filesystem::path saved_path = std::filesystem::path(dir) / "config.toml";
      if ((resume || rc.checkpoint.resume) && !dir.empty() && std::filesystem::exists(saved_path)) {
        const cw::RunConfig saved = cw::RunConfig::from_file(saved_path.string());
        cw::RunConfig resumed = layered(saved);
        resumed.validate();
        cw::check_resume_changes(cw::resume_changes(saved, resumed), force_changes, std::cout);
        rc = resumed;
      } else if (force_changes) {
        cw::fail("--force-changes applies to --resume of a run directory that holds its config.toml",
                 "give --resume and the --run-dir of the run, or leave --force-changes out");
      } else {
        rc.validate();
      }
      cw::TrainOptions topt;
      topt.run_dir = run_dir;
      topt.resume = resume;
      topt.stop_after = stop_after;
      topt.trace = train_trace;
      // Started by a launcher (torchrun, mpirun, srun): one process per GPU, the ranks joined by NCCL,
      // each on the GPU of its local rank. Otherwise one process (parallel.dp > 1 then runs threads).
      const cw::Environment env = cw::process_environment();
      const cw::LaunchInfo launch = cw::read_launch_info(env);
      std::unique_ptr<cw::Communicator> comm;
      if (launch.launcher != cw::Launcher::single) {
        if (launch.rank == 0) std::cout << "launch: " << launch.describe() << "\n";
        comm = cw::make_nccl_communicator(launch, launch.local_rank, cw::NcclOptions::from_environment(env));
      }
      const cw::TrainResult r = cw::run_training(rc, topt, std::cout, comm.get());
      return r.interrupted ? cw::kExitInterrupted : 0;
    }
    if (*options) {
      std::cout << (options_env    ? cw::env::tables_markdown()
                    : options_toml ? cw::RunConfig::default_run().commented_toml()
                                   : cw::RunConfig::options_markdown());
      return 0;
    }
    if (*sample) {
      if (sample_model.empty() && run_dir.empty())
        cw::fail("chunkwise sample needs --run DIR or --model MODEL", "e.g. chunkwise sample --run runs/a --prompt \"The \"");
      if (*sample_system_opt) so.system = sample_system;
      if (!sample_prompt_file.empty()) so.prompt = cw::read_prompt_file(sample_prompt_file);
      const cw::Device device = cw::resolve_device(sample_device, "--device");
      const cw::DType dtype = cw::resolve_compute_dtype(sample_dtype, device, "--dtype", "--device");
      cw::ModelSource source{.model = sample_model,
                             .run = run_dir,
                             .step = sample_step,
                             .tokenizer = sample_tokenizer,
                             .rope = sample_rope};
      if (!sample_model.empty() && sample_tokenizer.empty()) source.tokenizer = cw::kModelTokenizer;
      const cw::Generation g = cw::sample_from(source, so, device, dtype);
      // What the prompt cost, on stderr beside the checkpoint line (stdout holds the text alone).
      std::cerr << fmt::format("chunkwise: prompt of {} tokens through the prefill in {:.2f} s ({:.0f} tokens/s{}), "
                               "{} tokens generated in {:.2f} s ({:.1f} tokens/s)\n",
                               g.prompt.size(), g.prefill_seconds,
                               static_cast<double>(g.prompt.size()) / std::max(g.prefill_seconds, 1e-9),
                               so.prefill_chunk > 0 ? fmt::format(", chunks of {}", so.prefill_chunk) : "",
                               g.generated.size(), g.decode_seconds,
                               static_cast<double>(g.generated.size()) / std::max(g.decode_seconds, 1e-9));
      // A plain prompt is continued, so it is printed with its continuation; a chat prints the reply, and
      // a prompt file (pages long, perhaps) only the continuation.
      std::cout << (so.chat || !sample_prompt_file.empty() ? "" : so.prompt) << g.text << "\n";
      return 0;
    }
    if (*tokenize) {
      if (text_inputs.empty() && jsonl_inputs.empty() && chat_inputs.empty())
        cw::fail("chunkwise tokenize needs inputs: text files, --jsonl FILE... or --chat-jsonl FILE...",
                 "e.g. chunkwise tokenize --out data.bin notes.txt");
      const std::unique_ptr<cw::Tokenizer> tokenizer = cw::load_tokenizer(tokenizer_spec);
      to.require_utf8 = !keep_invalid_utf8;
      if (!chat_inputs.empty()) {
        const cw::TokenizeCounts c = cw::tokenize_chat_jsonl(*tokenizer, chat_inputs, shard_out);
        std::cout << fmt::format("tokenize: {} files, {} conversations, {} bytes rendered -> {} tokens ({} the "
                                 "assistant's) in {} and {}\n",
                                 c.files, c.documents, c.bytes, c.tokens, c.loss_tokens, shard_out,
                                 cw::token_flags_path(shard_out));
      } else {
        const cw::TokenizeCounts c =
            jsonl_inputs.empty() ? cw::tokenize_files(*tokenizer, text_inputs, shard_out, to)
                                 : cw::tokenize_jsonl(*tokenizer, jsonl_inputs, shard_out, jsonl_field, to);
        std::cout << fmt::format("tokenize: {} files{}, {} documents, {} bytes -> {} tokens in {} and {}\n", c.files,
                                 jsonl_inputs.empty() ? "" : fmt::format(" ({} records)", c.records), c.documents,
                                 c.bytes, c.tokens, shard_out, cw::token_flags_path(shard_out));
      }
      return 0;
    }
    if (*encode) {
      std::ios::sync_with_stdio(false);
      const std::unique_ptr<cw::Tokenizer> tokenizer = cw::load_tokenizer(tokenizer_spec);
      if (encode_bench_passes > 0)
        cw::bench_encode(*tokenizer, encode_file, encode_bench_passes, std::cout);
      else
        cw::encode_lines(*tokenizer, encode_file, std::cout, encode_separator);
      return 0;
    }
    if (*init) {
      cw::init_checkpoint(io);
      std::cout << "wrote " << io.out << "\n";
      return 0;
    }
    if (*logits) {
      cw::write_logits(lo);
      std::cout << "wrote " << lo.out << "\n";
      return 0;
    }
    if (*merge) {
      cw::merge_adapter_checkpoint(mo);
      std::cout << "wrote " << mo.out << "\n";
      return 0;
    }
    if (*bench_ops) {
      cw::run_bench_ops(bo, std::cout);
      return 0;
    }
    if (*chart) {
      cw::write_chart(chart_inputs, chart_out, chart_title, chart_labels, chart_device_gib);
      std::cout << "wrote " << chart_out << "\n";
      return 0;
    }
    if (*eval) return cw::run_eval(eo, std::cout);
    if (*bench) return cw::run_bench_model(bm, std::cout);
    if (*plan) return cw::run_plan(po, std::cout);
    if (*devices) {
      std::cout << cw::describe_devices();
      return 0;
    }
  } catch (const cw::Error& e) {
    std::cerr << "chunkwise: error: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "chunkwise: unexpected error: " << e.what() << "\n";
    return 3;
  }
  return 0;
}
