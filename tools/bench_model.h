// `chunkwise bench`: training steps of a whole model on the GPU at given settings (a benchmark, not
// a test), the figures tools/bench/model_vs_hf.py sets beside HF transformers'.
//
// Setup (as ../shared/BENCHMARKS.md describes the reference): random initialisation, bf16 compute
// weights with f32 master weights and f32 gradients, AdamW, random token ids (never zeros), batch B
// of T tokens, labels the next token. Each step is a full training step: zero the gradients, the
// schedule's forward and backward, the global gradient norm and clipping, the AdamW update; the GPU
// is synchronised at the end of each step and the step's wall time recorded. After `warmup` untimed
// steps the median of `steps` timed ones gives tokens/s = B * T / step_s.
// MFU = tokens/s * flops_per_token / peak, with flops_per_token = 6 * (matmul parameters, LM head
// included) + 12 * L * H * D * T / 2 (causal attention, forward and backward), and peak the bf16
// GEMM rate measured in the same process (8192^3 through our cuBLASLt path) unless given. With LoRA
// (--lora-rank) the frozen base costs 4 instead of 6 per parameter (no weight gradients) and the
// adapters 6 per adapter parameter. spaco counts the forward of every token and the backward
// (4 of the 6, two thirds of the attention) of the fraction t/k it backpropagates, the attention's
// share as if the visited chunks sat at average positions.
// Each step's line also says how many cuDNN attention plans it built and the seconds that took
// (cw::attention_plan_stats; the first step builds them, the JSON has them per step).
// Memory: the caching pool's peak in-use bytes over the whole run (weights included), and the
// training state's bytes by category (optim/training.h). Running out of device memory is a result
// (status "oom"), not a crash.
#pragma once

#include <cstdint>
#include <iosfwd>
#include "optim/schedule.h"

#include <string>
#include <vector>

namespace cw {

struct BenchModelOptions {
  std::string model = "llama-3.2-1b";  // preset, config.json or checkpoint directory
  int64_t seq = 4096, batch = 1;
  ScheduleOptions schedule;            // every schedule option, as train and gradcheck take them (chunk and
                                       // offload_window may be kAuto: the planner chooses, tools/planner)
  bool optimizer_offload = false;      // master weights and moments in host memory (optim/adamw_offload.h)
  double device_memory_gib = 0;        // the device memory the run may use (engine.h); 0: the whole GPU
  double host_memory_gib = 0;          // the host memory the plan may pin 90% of; 0: the machine's available
  bool force = false;                  // run a step the planner says does not fit (to measure where it fails)
  LoraConfig lora;                     // rank > 0: LoRA adapters trained, the base frozen in the compute dtype
  bool deterministic = false;          // deterministic kernels only (cw::set_deterministic)
  std::string dtype = "bf16";          // bf16 | f32
  int steps = 3, warmup = 1;
  double peak_tflops = 0;              // 0: measure
  std::string json;                    // also write the result as JSON here
  std::string trace;                   // write a Chrome trace of the last timed step here (engine/trace.h)
  // Packed documents (optim/schedule.h Batch::doc_starts, positions restarting at each): "L" cuts each
  // sequence into documents of L tokens (the last shorter), "LO:HI" draws each document's length
  // uniformly from [LO, HI] (seeded per step). Empty: one document a sequence. The attention's flops
  // are then the documents' causal squares, not the sequence's.
  std::string documents;
};

// Sequence starts of documents as BenchModelOptions::documents describes them, for B sequences of T
// tokens; the draw is a function of seed. Fails naming the flag on a malformed spec.
std::vector<std::vector<int64_t>> bench_document_starts(const std::string& spec, int64_t B, int64_t T, uint64_t seed);

// Returns the process exit code (0 also for an out-of-memory result, which the JSON records).
int run_bench_model(const BenchModelOptions& options, std::ostream& out);

}  // namespace cw
