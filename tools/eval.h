// `chunkwise eval`: long-context evaluation of a model (--model or --run: tools/model_io.h
// ModelSource), forward only. Two tasks.
//
// loss-by-position: the model's loss at each position of windows of T+1 tokens of held-out token
// data (tools/data/tokens.h): window w is tokens [wT, wT + T] of the stream, or, with documents,
// windows that start at a document start, each after the last one's end. The starts are those
// training reads (tools/data/batches.h): the files' stored ones, else every marker token (a
// document's BOS, or --bos-token).
// Each window runs through the chunked prefill (optim/chunks.h prefill): the K/V store is filled
// chunk by chunk, so device memory holds the store and one chunk's activations, never T tokens'.
// Without documents RoPE positions are absolute from the window's first token (a window is read as
// continuous text). With them, the window's documents are packed: each attends only itself, its
// positions from 0 (docs/packed_documents.md), and a token counts at its position in its own
// document; a document's last token (whose target opens the next) counts nowhere. The loss at
// position t is -log p(token t+1 | tokens 0..t) in nats, kept per row on the device (model/llama.h
// LossRows) and read back once a window.
// Positions are grouped in buckets by edges e1 < e2 < ... < ek: [0, e1), [e1, e2), ...,
// [e(k-1), ek), and a final [ek, T) when T > ek; an edge at or past T ends its bucket at T and the
// buckets after it are dropped. A bucket's mean loss is its summed loss over every window divided by
// its token count; every window holds the same positions, so it is also the mean of the windows'.
//
// passkey: the synthetic retrieval test of Mohtashami and Jaggi (2023). A prompt is the task's
// description, N filler groups ("The grass is green. The sky is blue. The sun is yellow. Here we go.
// There and back again."), a line with a random 5-digit key ("The pass key is 12345. Remember it.
// 12345 is the pass key.") after round(depth x N) of the groups, the rest of the groups, and the
// question "What is the pass key? The pass key is". N is the largest count that keeps the prompt's
// ids (BOS or a chat's template included, the whole text tokenized at once, as the tokenizer
// tokenizes it) at or below the target length, so a prompt falls short of its length by less than
// one group's tokens. With chat, everything up to "What is the pass key?" is the user's message
// (the tokenizer's ChatML template) and "The pass key is" opens the assistant's reply. The model
// continues greedily (tools/train/sample.h generate_from_ids, the prompt prefilled in chunks); an
// answer is correct when its text, after leading whitespace, starts with the key's 5 digits and no
// sixth digit follows. Keys are drawn in order (length, depth, trial) from a seeded Rng. The depths
// are evenly spaced in [0, 1] (one depth: 0.5); accuracy is counted per length x depth.
//
// Results are printed, written as JSON (--json) and drawn (--chart): loss against position bucket as
// a line chart on a log2 axis (several results as several lines: `chunkwise chart a.json b.json`,
// or the eval's --compare), passkey accuracy as a heat map of lengths x depths (plot.h HeatMap).
#pragma once

#include "tools/data/tokens.h"
#include "tools/model_io.h"
#include "tools/plot.h"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <vector>

namespace cw {

// "1K,4K,16K,64K" -> {1024, 4096, 16384, 65536}: token counts, each a positive integer with an
// optional K (x 1024) or M (x 1048576), strictly ascending. Fails naming `flag` on anything else.
std::vector<int64_t> parse_token_counts(const std::string& list, const std::string& flag);

// ---- loss by position ----

struct PositionBucket {
  int64_t lo = 0, hi = 0;  // positions [lo, hi)
  int64_t tokens = 0;      // losses counted: the bucket's positions over every window
  double loss_sum = 0;     // nats
  double mean_loss() const;  // NaN without tokens
};

// The buckets of positions [0, T) for the edges (see the header comment), nothing counted yet.
std::vector<PositionBucket> position_buckets(const std::vector<int64_t>& edges, int64_t T);
// Adds one window's per-position losses (T values, position order) into the buckets.
void add_window(std::vector<PositionBucket>& buckets, std::span<const double> losses);

// Where the windows of T+1 tokens start in the stream, in stream order: every window of the dataset's
// (w T), or with documents a document start (the dataset's flags) from which T+1 tokens remain, the
// longest documents' first, each window kept clear of those taken before (the deep positions of a
// loss-by-position are then the longest documents', not whichever document a window happens to
// start). limit > 0: at most `limit` windows (the first `limit` of the stream, or with documents the
// `limit` longest documents'). min_document > 0 (documents only): only documents of at least that
// many tokens open a window. Fails when there is none.
std::vector<int64_t> window_starts(const TokenDataset& data, int64_t T, bool documents, int64_t limit,
                                   int64_t min_document = 0);

// The per-position losses (T values, nats) of one window of T+1 ids through the chunked prefill in
// chunks of `chunk` tokens (0: one chunk) with `kv`, a store of 1 x T tokens without gradients on
// the model's device. chunk_done, if set, is told (chunks done, chunks) after each chunk. The model's
// RoPE tables grow to T positions (LlamaModel::ensure_positions), as a training step's do.
std::vector<double> window_losses(LlamaModel& model, std::span<const uint32_t> window, int64_t chunk,
                                  KVStore& kv, Arena& arena,
                                  const std::function<void(int64_t, int64_t)>& chunk_done = {});

// One window's per-position losses; with documents also where they start in the window (the first
// 0) and whether the window's last target opens a document (no loss counts there).
struct WindowLosses {
  std::vector<double> losses;
  std::vector<int64_t> doc_starts;
  bool last_target_opens_document = false;
};
// With the window's flags (T+1 bytes, tools/data/tokens.h): its documents packed (each attends only
// itself, RoPE positions restarting at each: optim/schedule.h set_documents), starting where the
// flags mark a document start; empty flags: one continuous text.
WindowLosses window_losses(LlamaModel& model, std::span<const uint32_t> window, int64_t chunk, KVStore& kv,
                           Arena& arena, std::span<const uint8_t> flags,
                           const std::function<void(int64_t, int64_t)>& chunk_done = {});
// Adds a window's losses to the buckets: by position in the window, or with documents by each
// token's position in its own document, leaving out the positions whose target opens a document.
// min_document > 0: only the documents with at least that many tokens in the window count (with
// min_document = T, every bucket averages the same documents: those that fill their window).
void add_window(std::vector<PositionBucket>& buckets, const WindowLosses& window, int64_t min_document = 0);

struct LossByPositionResult {
  std::string model, label;        // the model as given; the label a chart gives its line
  std::vector<std::string> data;   // the data files
  std::string device, dtype;
  int64_t seq = 0, chunk = 0, windows = 0;
  bool documents = false;          // windows started at document starts
  int64_t min_document = 0;        // only documents of at least this many tokens counted; 0: all
  std::vector<PositionBucket> buckets;
  double mean_loss() const;        // over every position counted

  // {"task": "loss-by-position", "model", "label", "data", "device", "dtype", "seq", "chunk",
  //  "windows", "documents", "min_document", "mean_loss", "buckets": [{"lo", "hi", "tokens", "mean_loss"}]}
  nlohmann::json to_json() const;
  // Fails naming `source` and the key that is missing or of the wrong type.
  static LossByPositionResult from_json(const nlohmann::json& j, const std::string& source);
};

// The loss by position of the model over the windows of `tokens` at `starts` (each T+1 ids), the
// prefill in chunks of `chunk`. Prints a line per window (when 10 s have passed since the last, and
// the last window) and, inside a window that runs long, where its prefill is (tools/progress.h).
// Fills the buckets, seq, chunk, windows, device and dtype of the result. The model's RoPE tables
// grow to T positions.
LossByPositionResult loss_by_position(LlamaModel& model, const std::vector<uint32_t>& tokens,
                                      const std::vector<int64_t>& starts, int64_t T, const std::vector<int64_t>& edges,
                                      int64_t chunk, std::ostream& log,
                                      const std::vector<uint8_t>* flags = nullptr, int64_t min_document = 0);

// ---- passkey ----

// The prompt's fixed texts (see the header comment).
inline constexpr const char* kPasskeyTask =
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz you "
    "about the important information there.";
inline constexpr const char* kPasskeyFiller =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
inline constexpr const char* kPasskeyQuestion = "What is the pass key?";
inline constexpr const char* kPasskeyAnswerStart = "The pass key is";
// "The pass key is KEY. Remember it. KEY is the pass key."
std::string passkey_line(const std::string& key);

struct PasskeyPrompt {
  std::vector<uint32_t> ids;
  std::string key;
  int64_t groups = 0;         // filler groups N
  int64_t groups_before = 0;  // of them before the key's line: round(depth x N)
};

// The text of a prompt (a chat's user message ends at the question; the answer's start follows the
// template), and its ids.
std::string passkey_text(int64_t groups_before, int64_t groups_after, const std::string& key, bool chat);
std::vector<uint32_t> passkey_ids(const Tokenizer& tokenizer, int64_t groups_before, int64_t groups_after,
                                  const std::string& key, bool chat);
// The prompt of at most `length` ids with the key at `depth` in [0, 1] (see the header comment).
// groups_hint: a guess of N (a previous prompt's) that saves encodings; 0: none. Fails when even no
// filler at all exceeds the length.
PasskeyPrompt passkey_prompt(const Tokenizer& tokenizer, int64_t length, double depth, const std::string& key,
                             bool chat, int64_t groups_hint = 0);
// Whether an answer is right: after leading whitespace the key's digits, then no digit.
bool passkey_correct(const std::string& answer, const std::string& key);
// `count` depths evenly spaced in [0, 1]: i / (count - 1); one depth is 0.5.
std::vector<double> passkey_depths(int64_t count);

struct PasskeyCell {
  int64_t length = 0;
  double depth = 0;
  int64_t trials = 0, correct = 0;
  double prompt_tokens = 0;  // the prompts' mean length
  double accuracy() const { return trials > 0 ? static_cast<double>(correct) / static_cast<double>(trials) : 0.0; }
};

struct PasskeyOptions {
  std::vector<int64_t> lengths = {2048, 4096, 8192, 16384, 32768, 65536};
  int64_t depths = 10;
  int64_t trials = 5;
  uint64_t seed = 1;
  bool chat = false;
  int64_t answer_tokens = 8;    // new tokens generated for an answer
  int64_t chunk = 4096;         // the prompt's prefill chunk
};

struct PasskeyResult {
  std::string model, label, tokenizer, device, dtype;
  bool chat = false;
  int64_t trials = 0, answer_tokens = 0, chunk = 0;
  uint64_t seed = 0;
  std::vector<int64_t> lengths;
  std::vector<double> depths;
  std::vector<PasskeyCell> cells;  // length-major: cells[i * depths + j] is lengths[i] at depths[j]
  double accuracy() const;         // over every trial

  // {"task": "passkey", "model", "label", "tokenizer", "device", "dtype", "chat", "trials", "seed",
  //  "answer_tokens", "chunk", "lengths", "depths", "accuracy",
  //  "cells": [{"length", "depth", "trials", "correct", "accuracy", "prompt_tokens"}]}
  nlohmann::json to_json() const;
  static PasskeyResult from_json(const nlohmann::json& j, const std::string& source);
};

// The passkey test of the model with its tokenizer; a line per length x depth as it is done.
// Fills the cells, lengths, depths and the options' fields of the result. The model's RoPE tables
// grow to the longest prompt and its answer (generate).
PasskeyResult passkey(LlamaModel& model, const Tokenizer& tokenizer, const PasskeyOptions& options,
                      std::ostream& log);

// ---- charts ----

// Mean loss against position bucket, a line (with markers) per result, each bucket at the log2 of
// its middle position, ticks at the powers of two labelled 1K, 2K, ...; labels[i] (or, when empty,
// the result's label) names line i.
Chart loss_by_position_chart(const std::vector<LossByPositionResult>& results, const std::vector<std::string>& labels,
                             const std::string& title);
// Accuracy (%) of each length (x) and depth (y, 0% at the top).
HeatMap passkey_heat_map(const PasskeyResult& result, const std::string& title);

// Whether `path` is a JSON file holding an eval result (a "task" this header writes).
bool is_eval_result(const std::string& path);
// `chunkwise chart A.json [B.json ...] --out FILE.svg`: loss-by-position results as lines of one
// chart (--label names them in order), or one passkey result as its heat map. Fails naming the
// file for anything else, and for several passkey results or results of both tasks.
void write_eval_chart(const std::vector<std::string>& files, const std::vector<std::string>& labels,
                      const std::string& out, const std::string& title);

// ---- the command ----

struct EvalOptions {
  std::string task;               // loss-by-position | passkey
  ModelSource source;
  std::string device = "auto";    // auto (CUDA when available) | cpu | cuda
  std::string dtype = "auto";     // auto (GPU: bf16, CPU: f32) | f64 (CPU) | f32 | bf16 (GPU)
  std::string json, chart;        // files to write; empty: none
  std::string label;              // the result's label; empty: the model as given
  std::vector<std::string> compare;  // earlier loss-by-position results drawn with this one
  int64_t chunk = 4096;           // the prefill's chunk
  // loss-by-position
  std::vector<std::string> data;  // token files and globs
  std::string format = "shard";   // shard | u16 | u32
  int64_t seq = 0;                // T
  std::string buckets = "1K,4K,16K,64K";
  int64_t windows = 0;            // at most this many; 0: all
  bool documents = false;         // windows start at a document start, documents packed
  int64_t min_document = 0;       // with documents: only documents of at least this many tokens count
  std::string bos_token;          // where the data stores no starts, the token before each; empty: the BOS
  // passkey
  std::string lengths = "2K,4K,8K,16K,32K,64K";
  int64_t depths = 10, trials = 5, answer_tokens = 8;
  uint64_t seed = 1;
  bool chat = false;
};

// Runs the task, prints its table, writes the JSON and the chart. Returns the exit status.
int run_eval(const EvalOptions& options, std::ostream& out);

}  // namespace cw
