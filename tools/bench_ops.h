// `chunkwise bench-ops`: our GPU ops timed on one shape set (a benchmark, not a test).
//
// Each op runs on fresh random data (never zeros) after a warm-up; the figure is the median of
// `repeat` runs timed with CUDA events. Memory-bound ops report the bytes they must move (inputs
// read once, outputs written once) per second and that rate as a share of a device-to-device copy
// measured in the same run; GEMMs report TFLOP/s. tools/bench/ops_vs_torch.py runs this and torch's
// equivalents on the same shapes and prints both side by side.
//
// Attention rows (per token count in attention_tokens; B = 1, p = 0, causal, bf16): the shapes of
// ../shared/BENCHMARKS.md's op table, H / Hkv / D = 32 / 8 / 64 (Llama-3.2-1B) and 24 / 8 / 128
// (Llama-3.2-3B), once per implementation (cw::set_attention_kernel: cudnn, then flash). TFLOP/s
// counts the causal half of the score matrix: forward 4 * H * T^2 * D / 2 (QK^T and PV, 2 FLOP per
// multiply-add), backward 2.5 times that (five T x T x D products: QK^T recomputed, dP = dO V^T,
// dV = P^T dO, dQ = dS K, dK = dS^T Q). The backward row times the backward alone (after one
// forward that produced out and lse); d_k, d_v are the op's f32 accumulators. A cuDNN row on operands
// cudnn_attention_supports rejects (or a build without cuDNN) is kept as a row with status
// "unsupported" and the reason, and no timing.
//
// Chunk attention rows (per "C:S" in chunk_attention): the last C queries of S positions against all
// S keys, forward and backward, in one call and block by block as the streamed K/V store computes
// it (copies left out), so that their ratio shows what blocking alone costs.
//
// LM head rows (per token count in lm_head_tokens; C = hidden, V = vocab, bf16; labels uniform in
// [0, V)): lm_head_loss_fused, the loss and both gradients in one call, i.e. forward + backward,
// TFLOP/s counting 6 * N * C * V (the logits GEMM, d_x and d_W). Also its extra peak device memory:
// the caching pool's peak in-use bytes during the calls minus the bytes in use just before them,
// with the operands AND the outputs (d_x, f32 d_W, row_loss) already allocated: the memory the
// fused loss itself needs (its logits block in scratch), measured before any other row allocates
// (so the pool's peak is the current use and the delta is exact; "exact" says so in the JSON).
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

namespace cw {

struct BenchOpsOptions {
  int64_t tokens = 8192;   // N rows
  int64_t hidden = 2048;   // C
  int64_t ffn = 8192;      // F
  int64_t heads = 32, kv_heads = 8, head_dim = 64;
  int64_t vocab = 128256;  // embedding table rows
  std::string dtype = "bf16";
  int repeat = 20;
  std::vector<int64_t> attention_tokens{8192};  // attention rows at these T (empty: none)
  std::vector<std::string> attention_shapes{"32:8:64", "24:8:128"};  // their "H:HKV:D" (1B's and 3B's)
  double attention_softcap = 0;                 // their score cap (Gemma 2's; 0: none)
  std::vector<int64_t> lm_head_tokens{8192};    // LM head rows at these N (empty: none), e.g. {8192, 32768}
  std::vector<std::string> chunk_attention;     // "C:S": a chunk of C queries against S keys, one call and in
                                                // C-key blocks as the streamed K/V store runs it (none by default)
  std::vector<std::string> linears;  // "O:I": a linear of O outputs and I inputs at N rows, forward, d_x and d_W,
                                     // with cuBLASLt's first algorithm and with the tuned one (none by default)
  std::string json;        // also write the results as JSON here
};

void run_bench_ops(const BenchOpsOptions& options, std::ostream& out);

}  // namespace cw
