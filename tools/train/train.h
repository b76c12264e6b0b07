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

TrainResult run_training(const RunConfig& config, const TrainOptions& options, std::ostream& out);

// The demo corpus shard that "@demo" in data.train stands for ($CHUNKWISE_DEMO_DATA, else
// .cache/demo/jargon.bin under the current directory; tools/run prepares it).
std::string demo_data_path();

}  // namespace cw
