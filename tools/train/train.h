// `chunkwise train`: the training loop, device-agnostic (the CPU now).
//
// One optimizer step = grad_accum micro-batches of batch_size windows of seq_len + 1 tokens, each
// run through the configured schedule (full, seco, spaco) with the loss normalised by the step's
// total count of supervised tokens (so accumulation equals one large batch); then non-finite guard,
// global-norm clipping, the LR schedule and AdamW. Eval every eval.every steps and at the end;
// checkpoints every checkpoint.every steps and at the end, atomically (tools/train/run_dir.h).
// Resume restores parameters, optimizer moments and step, and the sampler's position: the
// continuation is bit-identical to an uninterrupted run. SIGINT / SIGTERM finish the current step,
// save, and exit with kExitInterrupted; a second signal exits at once.
//
// The tokenizer (data.tokenizer; "model": model.source's own) is checked against the model's
// vocabulary before anything is loaded; the run directory keeps a copy of it (tokenizer_files), and
// with a BPE tokenizer every checkpoint carries HF's tokenizer files beside config.json and
// model.safetensors, so a checkpoint is a whole HF model directory. The closing sample (and with
// sample.at_start one before step 1, as eval.at_start evaluates there) encodes and decodes with it.
//
// Data parallel (parallel.dp = n > 1; parallel/data_parallel.h): every rank holds the same sampler
// and takes its own slice of each global micro-batch of n x batch_size windows
// (WindowSampler::next_rank_batch), so a run equals one process with batch_size x n, to rounding.
// Tensor parallel (parallel.tp = m > 1; parallel/tensor_parallel.h): the m ranks of a replica each
// hold 1/m of every block's heads and FFN and run the same batch. A run has n x m ranks on a grid
// (parallel/grid.h: world rank w = d m + t, the TP ranks of a replica adjacent); it starts from the
// weights one process starts from (a random initialisation draws the whole model, then shards it).
// The logged loss is the global mean; rank 0 alone prints, writes the metrics, the config and the
// checkpoints' shared files: the whole master weights as one HF checkpoint (with TP assembled from
// the first replica's shards: gather_parameters) and state.json, which records dp, tp and zero. The
// optimizer state: without ZeRO and TP rank 0's optimizer.safetensors; with ZeRO each rank's shard
// as optimizer-rank-<w>.safetensors; without ZeRO but with TP each TP shard's moments as
// optimizer-tp-<t>.safetensors (written by the first replica). The other ranks stage theirs in a
// temporary that rank 0 moves in before the manifest. Resume needs the same tp, and with ZeRO the
// same dp and zero. The first replica evaluates and samples (its TP ranks together). Under ZeRO 3
// (parallel.zero = 3, ranks needed) a rank holds only its shards (parallel/zero3.h): every rank
// evaluates, each rank's checkpoint file is its shard of the master weights with its moments
// (zero3-rank-<w>.safetensors and .optimizer), and rank 0 assembles the whole HF checkpoint from the
// shard files; with LoRA the shards are the frozen base and the checkpoint is one process's (PEFT's
// files, rank 0's optimizer file: the adapters are replicated). A stop
// (signal, --stop-after) is agreed by all ranks at the end of a step.
// Without a communicator, parallel.dp x parallel.tp = n > 1 on the CPU runs the n ranks as threads
// of this process (the threads backend); on GPUs, one process per GPU passes its communicator
// (parallel/launch.h), with NCCL at world size 1 too (groups of one rank).
#pragma once

#include "tools/train/run_config.h"

#include <iosfwd>
#include <optional>
#include <string>

namespace cw {

constexpr int kExitInterrupted = 75;  // stopped by a signal after saving a checkpoint

struct TrainOptions {
  std::string run_dir;  // overrides log.run_dir
  bool resume = false;  // overrides checkpoint.resume when true
  bool print_sample = true;
  int64_t stop_after = 0;  // > 0: stop after this many steps of this invocation, saving (as a signal would)
  std::string trace;       // write a Chrome trace of this invocation's first step here (engine/trace.h)
};

struct TrainResult {
  int64_t last_step = 0;
  double last_loss = 0;
  std::optional<double> last_eval_loss;
  std::string run_dir;
  bool interrupted = false;
};

class Communicator;

// comm: this process's rank of the job's parallel.dp x parallel.tp ranks (null: one process, or
// threads on the CPU when dp x tp > 1).
TrainResult run_training(const RunConfig& config, const TrainOptions& options, std::ostream& out,
                         Communicator* comm = nullptr);

// The demo corpus shard that "@demo" in data.train stands for ($CHUNKWISE_DEMO_DATA, else
// .cache/demo/jargon.bin under the current directory; tools/run prepares it).
std::string demo_data_path();

}  // namespace cw
