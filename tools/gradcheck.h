// `chunkwise gradcheck`: are the gradients right?
//
// Two comparisons, one row per parameter tensor, last line `max_rel_err=<x>`:
//   against fd   (default for --schedule full): finite differences of the loss along random unit
//                directions v of each tensor, fourth-order central stencil
//                fd = (-L(+2h) + 8 L(+h) - 8 L(-h) + L(-2h)) / 12h, against the analytic g.v;
//                rel_err = |g.v - fd| / max(|g.v|, |fd|), worst over the directions.
//   against full (default for seco / spaco): the schedule's gradients against the full schedule's on
//                the same model and batch; rel_err = ||a - b||_2 / ||b||_2 per tensor (worst element
//                shown), and a row for the loss.
//   against single (default with --dp N > 1, --tp M > 1, --zero Z > 0 or launched): N x M ranks as
//                threads of the CPU backend (parallel/comm.h) on a DP x TP grid (parallel/grid.h):
//                DP rank d takes sequences [d B/N, (d+1) B/N) of the --batch sequences, TP rank t
//                holds shard t of the same initial model (parallel/tensor_parallel.h;
//                --sequence-parallel, --tp-regather),
//                every step through DataParallel on the DP group; against one process on the
//                whole batch, both under the same schedule: the loss and every gradient of the
//                first step (assembled from the TP shards, and with ZeRO 2 from the DP ranks'
//                shards), then every parameter after --optimizer-steps AdamW steps (the same batch
//                each step). The DP ranks of a TP shard must hold bitwise the same parameters (and
//                gradients, without ZeRO 2), the TP ranks the same replicated tensors, every rank
//                the same loss; with --zero 1|2 the run is repeated with zero 0 and the parameters
//                must be bitwise identical to it. --zero 3 (parallel/zero3.h; no --tp; threads or
//                launched) gathers the first step's gradient and the final parameters whole from
//                the ranks' shards (with LoRA: the shards are the frozen base, the adapters are
//                replicated and compared), prints rank 0's gathers and reduce-scatters, and
//                against zero 0 is bitwise identical with one backward chunk (full, checkpointed)
//                and within the tolerance with several (each chunk's gradient reduced on its own);
//                launched, within the tolerance (bitwise or not printed): the GPU's GEMM algorithms
//                follow the operands' alignment, which the sharded buffers change. With --tp each
//                TP rank's activation high-water mark and reusable-buffer use are printed. spaco: every rank draws the sample one
//                process draws on the whole batch (optim/spaco.cpp), so the estimators are
//                compared exactly like the exact schedules.
//                --cp P (context parallelism, parallel/context_parallel.h; threads or launched, without
//                --tp, --zero or --documents): P ranks of one context-parallel group, each holding the
//                same initial model and c/P tokens of every chunk of every sequence (attention on its
//                H/P heads of the whole chunk); with --dp D, D such groups, DP rank d taking sequences
//                [d B/D, (d+1) B/D). Every rank's gradient is its tokens' share of the whole batch's,
//                summed over all D x P ranks before the AdamW step; the loss, the first step's
//                gradients and the parameters after the steps against one process, and every rank
//                must hold bitwise the same parameters.
//   against separate (with --documents): the packed batch's loss and gradients under the schedule
//                against every document run alone as a sequence of its own (the full schedule, the
//                packed batch's normaliser), summed: what the document mask and restarted RoPE
//                positions promise (engine/ops/attention.h). With absolute positions too: a rotary
//                score depends only on the difference of two positions, so within a document the
//                positions' origin does not matter but for rounding.
//   against reference: the schedule's loss and gradients against reference_step (model/reference.h),
//                the whole-sequence step written by hand from the math in f64, which shares no layer
//                code with the schedules (with --documents and --lora-rank too; not with
//                --lora-dropout); rel_err as against full.
// The run fails (non-zero exit) when max_rel_err exceeds --tol (1e-7 against fd, 1e-12 against full,
// single, separate and reference in f64).
// With --lora-rank r (and --lora-targets, --lora-alpha, --lora-dropout, --lora-seed) the model gets
// LoRA adapters and the checked tensors are theirs, the base frozen: every comparison above runs on
// the adapters' gradients (and parameters). The adapters start from PEFT's A and, unlike PEFT, a
// random B (N(0, kLoraCheckBStd)), so that A's gradient is not zero. With dropout the masks are
// those of step 0 in every loss the check evaluates. With --tp the adapters are sharded with their
// linears (parallel/tensor_parallel.h), dropout then only on column-parallel targets.
#pragma once

#include "optim/options.h"
#include "optim/schedule.h"

#include <iosfwd>
#include <string>

namespace cw {

class Communicator;  // parallel/comm.h

struct GradcheckOptions {
  std::string model = "tiny";      // preset, config.json, or HF checkpoint directory
  int64_t seq = 16;
  int64_t batch = 1;
  std::string dtype = "f64";
  ScheduleOptions schedule;        // name, chunk, bwd_chunk, keep, ...
  ParallelOptions parallel;        // dp, zero, bucket_mb; tp, sequence_parallel, tp_regather; cp (against single)
  LoraConfig lora;                 // rank > 0: check the LoRA adapters' gradients, the base frozen
  int optimizer_steps = 3;         // against single: AdamW steps before the parameters are compared
  std::string against;             // "fd" | "full" | "single" | "separate" | "reference"; empty: single with
                                   // --dp or --tp > 1, else fd for full, full otherwise
  double tol = -1;                 // < 0: the default for the comparison
  int directions = 3;              // random directions per tensor (fd)
  double step = 1e-3;              // fd step h along a unit direction
  uint64_t seed = 1234;            // model init, batch, directions
  double norm_jitter = 0.1;        // random init only: norm weights 1 (Gemma's 0) + N(0, jitter)
  int tie_embeddings = -1;         // -1: as configured; 0 / 1: override
  std::string tokens_file;         // headerless little-endian uint32, batch x seq ids
  std::string save_grads;          // write loss and gradients (f64, HF names) as safetensors
  std::string gather_dir;          // launched: where each rank writes its result for rank 0
  // Packed documents: lengths summing to seq; sequence b holds them rotated by b places (so the
  // sequences of a batch are cut differently). Empty: one document a sequence.
  std::vector<int64_t> documents;
  std::string positions = "document";  // with documents: RoPE positions restart at each (document) or not (absolute)
};

// Runs the check, printing the table to out; returns the process exit code (0 pass, 1 fail).
// world: a launched world (one process per GPU, NCCL; parallel/launch.h): --against single with
// --dp x --tp (or --cp) = its size, in f32, each process one rank on its GPU; the ranks write their results
// to gather_dir, and rank 0 assembles them and compares them with one process on its own GPU
// (default tolerance 1e-4: f32 sums in other orders on the GPU). --zero 3 runs the same way, each
// process a ZeRO 3 rank over NCCL. The other ranks return 0.
int run_gradcheck(const GradcheckOptions& options, std::ostream& out, Communicator* world = nullptr);


}  // namespace cw
