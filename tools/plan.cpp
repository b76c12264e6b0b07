#include "tools/plan.h"

#include "optim/chunks.h"

#include "engine/engine.h"
#include "engine/error.h"
#include "engine/residency.h"
#include "model/layer.h"
#include "model/layer_cast.h"
#include "model/lora.h"
#include "model/params.h"
#include "model/shard.h"
#include "optim/adamw_offload.h"
#include "optim/options.h"
#include "tools/bench_model.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <optional>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <ostream>

namespace cw {

namespace {
constexpr size_t kMiB = size_t(1) << 20;
constexpr double kGiB = double(size_t(1) << 30);

// ---- What the code allocates (each constant names its source) ----
constexpr size_t kArenaBlockBytes = kDeviceArenaBlockBytes;  // the engine's own sizes (engine.h)
constexpr size_t kArenaAlign = kMemoryAlignBytes;
constexpr double kDefaultDeviceGib = 80;

// ---- Throughputs (H100 80GB HBM3, measured 2026-11-21..24) ----
// The model's GEMMs (2048-8192 wide, bf16, f32 accumulate through cuBLASLt) at 8192 rows and more:
// 88% of the 774 TFLOP/s 8192^3 GEMM `chunkwise bench` measured (RESULTS.md); fewer rows run slower
// (matmul_row_efficiency). With the other terms fixed, these rates put the recorded full 4K/8K step
// times within 10%.
constexpr double kMatmulTflops = 680;
// A layer's GEMMs at `rows` tokens against 8192 and more: 0.05 less a halving. `bench-ops --linears`
// (RESULTS.md twelfth session, Llama-3.2-1B's layer, cuBLASLt's first choice) ran them at 600, 696
// and 746 TFLOP/s at 2048, 4096 and 8192 rows (launches included; in a step they overlap, so the
// steps differ less: 128K in chunks of 8192 against 2048, thirteenth session).
double matmul_row_efficiency(int64_t rows) {
  const double halvings = std::log2(8192.0 / double(std::max<int64_t>(rows, 1)));
  return std::clamp(1.0 - 0.05 * halvings, 0.7, 1.0);
}
// cuDNN fused attention, one forward and a backward (2.5 forwards' FLOPs) together, by head size:
// at D 64 410 TFLOP/s as one masked graph (394-442 at 8K-32K tokens, BENCHMARKS.md "Single ops on
// the H100"), 460 with a chunk's earlier keys apart (engine.h, cudnn_split_prefix; chunks of 1K-32K
// against 64K keys: forward 511-561, backward 437-456, `bench-ops --chunk-attention`, RESULTS.md,
// tenth session); 510 at D 128 (forward 607, backward 482 at 8K: RESULTS.md, "Attention, LM head and
// memory-bound ops against torch", 2026-11-21; the split not measured there on an H100); straight
// between.
double attention_tflops(int64_t head_dim, bool split) {
  const double d = std::clamp(double(head_dim), 64.0, 128.0);
  const double d64 = split ? 460 : 410;
  return d64 + (510 - d64) * (d - 64) / 64;
}
// The same attention run block by block against a streamed K/V store (chunk-sized unmasked blocks,
// merged; dK, dV sent home per block): the blocks cost about what one call does (0.94-1.18x forward,
// 0.94-1.04x backward, `bench-ops --chunk-attention`), and the step waits for some copies: at 128K
// (chunk 4096, saved outputs) 13.52 s streamed against 12.47 s on the device, 1.06 s of it waiting
// (RESULTS.md, ninth session).
// (Against one masked graph's rate: the blocks run no faster with the prefix apart.)
constexpr double kStreamedAttentionSlowdown = 1.12;
// With a window of layers offloaded, the compute stream still waits for some copies (a layer's data
// arriving after the layer before it ends): 0.4-1.8% of the copies' time with fetches and stores on
// their own lanes and the last layer's backward fetched behind its recompute (window 2, saved
// outputs: 0.018 s for 219 GiB at 128K in chunks of 8192, 0.043 s for 110 GiB at 64K and 0.007 s for
// 31 GiB at 32K in chunks of 4096), H100, fourteenth session (`chunkwise bench` copy_wait_s).
constexpr double kWindowCopyWaitShare = 0.012;
// Memory-bound ops at 70% of the 3.0 TB/s device copy (BENCHMARKS.md's bar for them; they meet it).
constexpr double kElementwiseBytesPerS = 0.7 * 3.0e12;
// The attention backward's K/V-gradient adds (engine/cuda/attention_cudnn.cu add_kv_kernel: cuDNN's bf16
// dK, dV of every key a chunk attends added into the f32 accumulators): a streaming pass, 698 GB in
// 233 ms at 128K in chunks of 2048 (`tools/kernel_profile`, RESULTS.md thirteenth session).
constexpr double kKvGradAddBytesPerS = 2.9e12;
// Host <-> device copies of pinned memory on the side stream: 49 GB/s, the K/V offload's measured
// rate (RESULTS.md, "Where a 128K step goes with the store offloaded": 420 GiB in 9.14 s).
constexpr double kPcieBytesPerS = 49e9;
// The offloaded optimizer's host update (the CPU adamw_update op on all cores), measured on the GPU
// machine's 16 cores: Llama-3.2-1B at 4K, full backprop, 0.606 s a step with the optimizer offloaded
// against 0.086 s on the device (0.022 s of it the device's update): 1.236 G elements in 0.54 s
// (H100 machine, fourteenth session, `.dev/s14h.sh`). The development machine: 0.43 G/s on one core.
constexpr double kHostAdamWElemsPerS = 2.3e9;

size_t round_to(size_t n, size_t q) { return (n + q - 1) / q * q; }
// Whether the blocks can be cast from the master as they run (schedule.cast_layers; optim/training.h
// says why): bf16 compute beside an f32 master on the device, so neither LoRA (no master for the
// base) nor the optimizer offloaded (the master on the host).
bool can_cast_layers(DType dtype, const LoraConfig& lora, bool optimizer_offload) {
  return dtype == DType::bf16 && !lora.enabled() && !optimizer_offload;
}
// The device pool's block for a buffer of `bytes` (rounded like engine/memory.cpp's buffers).
size_t pool_block(size_t bytes) {
  return device_pool_block(std::max<size_t>(round_to(std::max<size_t>(bytes, 1), kArenaAlign), 1));
}

// engine/memory.cpp's Arena, replayed: the same block choice, tails and scopes, no memory.
class ArenaReplay {
 public:
  struct Mark {
    size_t block, offset, in_use;
  };
  void alloc(size_t bytes) {
    const size_t need = round_to(bytes == 0 ? 1 : bytes, kArenaAlign);
    const size_t in_use_before = in_use_;
    while (current_ < blocks_.size() && offset_ + need > blocks_[current_]) {
      in_use_ += blocks_[current_] - offset_;
      ++current_;
      offset_ = 0;
    }
    if (current_ == blocks_.size()) {
      blocks_.push_back(std::max(kArenaBlockBytes, need));
      offset_ = 0;
      if (log_) log_->push_back(arena_block_line(blocks_.size() - 1, blocks_.back(), need, in_use_ - in_use_before,
                                                 in_use_before));
    }
    offset_ += need;
    in_use_ += need;
  }
  Mark mark() const { return {current_, offset_, in_use_}; }
  void reset(const Mark& m) {
    current_ = m.block;
    offset_ = m.offset;
    in_use_ = m.in_use;
  }
  size_t reserved() const {  // what the pool holds for the arena
    size_t n = 0;
    for (size_t b : blocks_) n += pool_block(b);
    return n;
  }
  // Where to describe each block it adds (arena_block_line), or nowhere.
  void log_blocks_to(std::vector<std::string>* log) { log_ = log; }

 private:
  std::vector<std::string>* log_ = nullptr;
  std::vector<size_t> blocks_;
  size_t current_ = 0, offset_ = 0, in_use_ = 0;
};

struct Scope {
  ArenaReplay& a;
  ArenaReplay::Mark m;
  explicit Scope(ArenaReplay& arena) : a(arena), m(arena.mark()) {}
  ~Scope() { a.reset(m); }
};

// The shapes of one chunk: B sequences of c tokens attending S keys; the LoRA adapters, if any.
struct Shape {
  const LlamaConfig& cf;
  int64_t B, c, S;
  size_t e, acc;  // compute and accumulator element bytes
  const LoraConfig* lora = nullptr;
  bool streamed = false;  // schedule.stream_kv: attention runs block by block (S is one block)
  bool fused_qkv = true;  // model/layer.h fuses_qkv: one Q/K/V GEMM
  size_t N() const { return size_t(B * c); }
  size_t row(int64_t width) const { return N() * size_t(width) * e; }
  // cuDNN runs the call with its earlier keys apart: two graphs.
  bool split() const { return !streamed && cudnn_splits_prefix(c, S); }
  // Its prefix's backward stacks the query heads per K/V head: Q, O, dO copied head-major.
  bool stacked() const {
    return !streamed && cudnn_stacks_gqa(c, S, cf.num_attention_heads, cf.num_key_value_heads);
  }
};

// The input width of a block linear.
int64_t linear_in(const LlamaConfig& cf, ParamRole linear) {
  return linear == ParamRole::wo ? cf.q_dim() : linear == ParamRole::w_down ? cf.intermediate_size : cf.hidden_size;
}

// engine/ops/lora_linear.cpp's scratch for the adapted linears among `linears`, the largest one
// (each call returns its scratch, so only one is alive at a time): forward drop(x) [rows, in] with
// dropout, u [rows, r]; backward drop(x), g and u [rows, r], drop(g A) [rows, in] with dropout.
void lora_scratch(ArenaReplay& a, const Shape& s, std::initializer_list<ParamRole> linears, size_t rows,
                  bool backward) {
  if (!s.lora || !s.lora->enabled()) return;
  const std::vector<ParamRole> targets = s.lora->target_roles();
  const bool dropout = s.lora->dropout > 0;
  int64_t widest = -1;
  for (ParamRole l : linears)
    if (std::find(targets.begin(), targets.end(), l) != targets.end()) widest = std::max(widest, linear_in(s.cf, l));
  if (widest < 0) return;
  const size_t in_bytes = rows * size_t(widest) * s.e, r_bytes = rows * size_t(s.lora->rank) * s.e;
  Scope scope(a);
  if (dropout) a.alloc(in_bytes);  // drop(x)
  a.alloc(r_bytes);                // forward: u; backward: g
  if (backward) {
    a.alloc(r_bytes);              // u
    if (dropout) a.alloc(in_bytes);  // drop(g A)
  }
}

// model/layer.cpp: LayerActivations::allocate.
void layer_activations(ArenaReplay& a, const Shape& s, MlpKept mlp) {
  const LlamaConfig& cf = s.cf;
  a.alloc(s.row(cf.hidden_size));                                  // h1
  a.alloc(s.N() * s.acc);                                          // rstd
  a.alloc(s.row(cf.q_dim()));                                      // q
  a.alloc(s.row(cf.q_dim()));                                      // attn
  a.alloc(size_t(s.B * cf.num_attention_heads * s.c) * s.acc);     // lse
  a.alloc(s.row(cf.hidden_size));                                  // x_mid
  if (mlp != MlpKept::products) a.alloc(s.row(cf.hidden_size));    // h2
  a.alloc(s.N() * s.acc);                                          // rstd
  if (mlp != MlpKept::input)
    for (int i = 0; i < (mlp == MlpKept::all ? 3 : 2); ++i) a.alloc(s.row(cf.intermediate_size));  // gate, up, act
}

std::vector<int64_t> shard_rows(int64_t N, int64_t shards) {
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < shards; ++i) rows.push_back(N * (i + 1) / shards - N * i / shards);
  return rows;
}

// model/layer.cpp: block_forward's scratch (keep: the activations are given, holding `kept` of the
// MLP; from_saved: the attention output is read from the store, so no K/V projections; output false:
// a recompute for the backward alone, which skips W_down's product).
void block_forward(ArenaReplay& a, const Shape& s, bool keep, int64_t mlp_shards, bool from_saved = false,
                   MlpKept kept = MlpKept::all, bool output = true) {
  const LlamaConfig& cf = s.cf;
  Scope scope(a);
  const int64_t shards = resolve_mlp_shards(mlp_shards, cf, int64_t(s.N()));
  if (!keep) layer_activations(a, s, shards == 1 ? MlpKept::all : MlpKept::input);
  const bool products = keep && kept == MlpKept::products;  // h2 and act in scratch
  if (!from_saved && s.fused_qkv) {
    a.alloc(s.row(cf.q_dim() + 2 * cf.kv_dim()));  // q, k, v side by side
  } else {
    a.alloc(s.row(cf.q_dim()));     // q_pre
    if (!from_saved) {
      a.alloc(s.row(cf.kv_dim()));  // k_pre
      a.alloc(s.row(cf.kv_dim()));  // v
    }
  }
  if (s.streamed && !from_saved) {  // model/kv_store.cpp attend_forward: the merged output, a block's
    a.alloc(s.N() * size_t(cf.q_dim()) * s.acc);
    a.alloc(s.row(cf.q_dim()));
    a.alloc(s.N() * size_t(cf.num_attention_heads) * s.acc);
  }
  a.alloc(s.row(cf.hidden_size));  // o (cuDNN's forward needs no workspace beyond its 256-byte minimum)
  if (s.split()) {  // the prefix's out and lse while the call runs
    Scope attention(a);
    a.alloc(s.row(cf.q_dim()));
    a.alloc(s.N() * size_t(cf.num_attention_heads) * 4);
  }
  if (products) a.alloc(s.row(cf.hidden_size));  // h2
  if (!output) {
    if (products) a.alloc(s.row(cf.intermediate_size));  // act
    lora_scratch(a, s, {ParamRole::wq, ParamRole::wk, ParamRole::wv, ParamRole::wo, ParamRole::w_gate,
                        ParamRole::w_up}, s.N(), false);
    return;
  }
  a.alloc(s.row(cf.hidden_size));  // m
  if (products) a.alloc(s.row(cf.intermediate_size));  // act
  // Without gate and up in the activations (kept: the MLP's input only, as selective recompute keeps;
  // transient: tiled) the MLP runs shard by shard on [rows, F] scratch, one shard too.
  const bool tiled = keep ? kept == MlpKept::input : shards > 1;
  if (tiled) {
    for (int64_t rows : shard_rows(int64_t(s.N()), shards)) {
      Scope shard(a);
      for (int i = 0; i < 3; ++i) a.alloc(size_t(rows * cf.intermediate_size) * s.e);
      lora_scratch(a, s, {ParamRole::w_gate, ParamRole::w_up, ParamRole::w_down}, size_t(rows), false);
    }
  }
  // The adapters' scratch, bounded by its largest call with everything above alive (the MLP's come
  // last; a tiled MLP's were taken per shard above).
  if (!tiled)
    lora_scratch(a, s, {ParamRole::wq, ParamRole::wk, ParamRole::wv, ParamRole::wo, ParamRole::w_gate,
                        ParamRole::w_up, ParamRole::w_down}, s.N(), false);
  else
    lora_scratch(a, s, {ParamRole::wq, ParamRole::wk, ParamRole::wv, ParamRole::wo}, s.N(), false);
}

void mlp_rows_backward(ArenaReplay& a, const Shape& s, int64_t rows) {
  Scope scope(a);
  for (int i = 0; i < 3; ++i) a.alloc(size_t(rows * s.cf.intermediate_size) * s.e);  // d_act, d_gate, d_up
  lora_scratch(a, s, {ParamRole::w_gate, ParamRole::w_up, ParamRole::w_down}, size_t(rows), true);
}

// engine/cuda/attention_cudnn.cu's backward workspace for B sequences against S keys: with GQA it
// stages the per-query-head dK and dV of all S keys (bf16) for the head reduction in the graph;
// and cuDNN's 256 bytes (measured at 256K: 2 GiB and 256 bytes).
size_t attention_backward_workspace(const LlamaConfig& cf, int64_t B, int64_t S) {
  const bool gqa = cf.num_attention_heads != cf.num_key_value_heads;
  return (gqa ? 2 * size_t(B * cf.num_attention_heads * S * cf.head_dim) * 2 : 0) + 256;
}

// model/layer.cpp: block_backward's scratch, with engine/cuda/attention_cudnn.cu's backward (the
// frontend form: f32 dQ accumulator, bf16 dK/dV scratch over the Hkv heads, and the workspace
// staging the per-query-head dK and dV of all S keys, bf16, for the head reduction in the graph).
void block_backward(ArenaReplay& a, const Shape& s, MlpKept mlp, int64_t mlp_shards) {
  const LlamaConfig& cf = s.cf;
  const int64_t H = cf.num_attention_heads, Hkv = cf.num_key_value_heads, D = cf.head_dim;
  Scope scope(a);
  a.alloc(s.row(cf.hidden_size));  // d_h
  if (mlp != MlpKept::input) {
    mlp_rows_backward(a, s, int64_t(s.N()));
  } else {
    for (int64_t rows : shard_rows(int64_t(s.N()), resolve_mlp_shards(mlp_shards, cf, int64_t(s.N())))) {
      Scope shard(a);
      for (int i = 0; i < 3; ++i) a.alloc(size_t(rows * cf.intermediate_size) * s.e);
      mlp_rows_backward(a, s, rows);
    }
  }
  a.alloc(s.row(cf.q_dim()));  // d_attn
  a.alloc(s.row(cf.q_dim()));  // d_q
  if (s.streamed) {  // model/kv_store.cpp attend_backward: dQ summed over the blocks, a block's dQ
    a.alloc(s.N() * size_t(cf.q_dim()) * s.acc);
    a.alloc(s.row(cf.q_dim()));
  }
  {
    Scope attention(a);
    a.alloc(s.N() * size_t(H * D) * 4);                   // dQ accumulator, f32
    a.alloc(size_t(s.B * s.S * Hkv * D) * 2);             // dK scratch
    a.alloc(size_t(s.B * s.S * Hkv * D) * 2);             // dV scratch
    if (s.split()) a.alloc(s.row(cf.q_dim()));            // the prefix's dQ
    a.alloc(size_t(s.B * H * s.c) * 4);                   // Delta
    if (s.stacked())
      for (int i = 0; i < 3; ++i) a.alloc(s.row(cf.q_dim()));  // Q, O, dO head-major
    // The workspace (split, no less than the shared plan's over all S keys: attention_cudnn_plans.cu).
    a.alloc(attention_backward_workspace(cf, s.B, s.S));
  }
  if (s.fused_qkv) {
    a.alloc(s.row(cf.q_dim() + 2 * cf.kv_dim()));  // d(q, k, v) side by side
  } else {
    a.alloc(s.row(cf.kv_dim()));  // d_k
    a.alloc(s.row(cf.kv_dim()));  // d_v
  }
  a.alloc(s.row(cf.hidden_size));  // d_h1
  lora_scratch(a, s, {ParamRole::wq, ParamRole::wk, ParamRole::wv, ParamRole::wo}, s.N(), true);
}

// engine/cuda/lm_head.cu: the logits block of `block_rows_for`.
size_t lm_head_block(const Shape& s) {
  const int64_t kN = int64_t(16 / s.e), V = s.cf.vocab_size;
  const int64_t ld = (V + kN - 1) / kN * kN;
  const int64_t rows = lm_head_block_rows(int64_t(s.N()), ld, s.e);
  return size_t(rows * ld) * s.e + 8;
}

// model/llama.cpp ChunkBackward::head: d(normed) and the LM head's logits block, for its call.
void lm_head_backward(ArenaReplay& a, const Shape& s) {
  Scope head(a);
  a.alloc(s.row(s.cf.hidden_size));  // d_normed
  a.alloc(lm_head_block(s));
}

// optim/chunks.cpp prefill: one chunk forward, nothing kept.
// optim/chunks.cpp slice_chunk: one sequence's chunk is a view of the step's tokens; several are copied.
void chunk_tokens(ArenaReplay& a, const Shape& s) {
  if (s.B == 1) return;
  a.alloc(s.N() * 4);  // ids
  a.alloc(s.N() * 4);  // labels
}

void prefill_chunk(ArenaReplay& a, const Shape& s, int64_t mlp_shards, bool with_loss) {
  Scope scope(a);
  chunk_tokens(a, s);
  Scope forward(a);
  a.alloc(s.row(s.cf.hidden_size));  // ping
  a.alloc(s.row(s.cf.hidden_size));  // pong
  a.alloc(s.row(s.cf.hidden_size));  // normed
  a.alloc(s.N() * s.acc);            // rstd
  block_forward(a, s, false, mlp_shards);  // every layer alike: the scratch of one
  if (with_loss) {
    a.alloc(s.N() * s.acc);  // row_loss
    a.alloc(lm_head_block(s));
  }
}

// optim/chunks.cpp backprop_chunk: ChunkActivations, the forward keeping them, then backward_chunk.
void backprop_chunk(ArenaReplay& a, const Shape& s, const ActivationPolicy& p, bool from_saved) {
  const LlamaConfig& cf = s.cf;
  const int64_t L = cf.num_hidden_layers;
  const MlpKept mlp = mlp_kept(p, cf, int64_t(s.N()));
  Scope scope(a);
  chunk_tokens(a, s);
  const int64_t streams = p.offload_inputs ? 3 : L + 1;
  for (int64_t i = 0; i < streams; ++i) a.alloc(s.row(cf.hidden_size));
  if (p.keep_layers)
    for (int64_t l = 0; l < L; ++l) layer_activations(a, s, mlp);
  a.alloc(s.row(cf.hidden_size));  // normed
  a.alloc(s.N() * s.acc);          // rstd
  block_forward(a, s, p.keep_layers, p.mlp_shards, from_saved, mlp);
  Scope backward(a);
  a.alloc(s.N() * s.acc);           // row_loss
  a.alloc(s.row(cf.hidden_size));   // d_x
  lm_head_backward(a, s);
  if (p.keep_layers) {
    block_backward(a, s, mlp, p.mlp_shards);
    return;
  }
  Scope layer(a);
  layer_activations(a, s, mlp);
  block_forward(a, s, true, p.mlp_shards, from_saved, mlp, /*output=*/false);
  block_backward(a, s, mlp, p.mlp_shards);
}

// model/llama.cpp backward_chunk_from_store: per layer its saved input (packed for several
// sequences) and one layer's activations; the last layer's recompute also gives x_L, its final norm
// and the LM head; the other layers' recompute skips W_down's product. Every layer but the last
// alike: the scratch of one.
void backprop_chunk_from_store(ArenaReplay& a, const Shape& s, const ActivationPolicy& p, bool from_saved) {
  const LlamaConfig& cf = s.cf;
  const MlpKept mlp = mlp_kept(p, cf, int64_t(s.N()));
  Scope scope(a);
  chunk_tokens(a, s);
  a.alloc(s.N() * s.acc);          // row_loss
  a.alloc(s.row(cf.hidden_size));  // d_x
  for (const bool last : {true, false}) {
    Scope layer(a);
    if (s.B > 1) a.alloc(s.row(cf.hidden_size));  // the input, packed
    layer_activations(a, s, mlp);
    if (last) {
      Scope head(a);
      a.alloc(s.row(cf.hidden_size));  // x_L
      block_forward(a, s, true, p.mlp_shards, from_saved, mlp);
      a.alloc(s.row(cf.hidden_size));  // normed
      a.alloc(s.N() * s.acc);          // rstd
      lm_head_backward(a, s);
    } else {
      block_forward(a, s, true, p.mlp_shards, from_saved, mlp, /*output=*/false);
    }
    block_backward(a, s, mlp, p.mlp_shards);
  }
}

bool chunked(const ScheduleOptions& o) { return o.name == "seco" || o.name == "spaco"; }


// Bytes the K/V offload moves in one step (model/kv_store.cpp's begin_layer / end_layer, per layer):
// the prefill fetches each chunk's prefix of K, V and sends the chunk's K, V (and saved outputs)
// home; each reverse chunk ending at t1 fetches K, V [0, t1) (twice without saved outputs: its
// recompute and its backward), dK, dV [0, t1) (all but the first, whose homes are logical zeros) and
// sends dK, dV [0, t1) home; with saved outputs it fetches the chunk's outputs instead of
// recomputing them. Checked against the recorded runs in tests/tools/test_plan.cpp.
struct OffloadedStep {
  int64_t B, T;
  int64_t c, c2;        // prefill and reverse-sweep chunk lengths
  int64_t prefill_end;  // the prefill's tokens (seco leaves its last reverse chunk out)
  size_t e, acc;        // bytes of the compute and accumulation dtypes
  bool saved, streamed;
  double reverse;  // the fraction of reverse chunks visited (spaco)
  bool inputs;     // saved layer inputs: no chunk forward in the reverse sweep
};
double kv_offload_bytes(const LlamaConfig& cf, const OffloadedStep& st) {
  const auto [B, T, c, c2, prefill_end, e, acc, saved, streamed, reverse, inputs] = st;
  const double kv = double(2 * B * cf.num_key_value_heads * cf.head_dim) * double(e);
  const double g = double(2 * B * cf.num_key_value_heads * cf.head_dim) * double(acc);
  const double out = saved ? double(B * cf.num_attention_heads) * double(cf.head_dim * int64_t(e) + int64_t(acc)) : 0;
  const double in = inputs ? double(B * cf.hidden_size) * double(e) : 0;
  const double n = std::ceil(double(prefill_end) / double(c)), m = std::ceil(double(T) / double(c2));
  const double prefill = kv * double(c) * n * (n - 1) / 2 + (kv + out + in) * double(prefill_end);
  const double prefix_sum = double(c2) * m * (m + 1) / 2;  // sum over reverse chunks of t1
  // With saved outputs the chunks the prefill did not reach (seco's last) run a forward instead:
  // K, V of their prefix in, their K, V and outputs home.
  const double unsaved = double(T - prefill_end);
  // With saved inputs no reverse chunk runs a forward (its backward fetches its inputs instead).
  const double recompute = inputs  ? in * double(T)
                           : saved ? out * double(prefill_end) + kv * double(prefill_end) + (kv + out) * unsaved
                                   : kv * prefix_sum + kv * double(T);
  // Streamed, a chunk's own dK, dV stay on the device (its backward is their last reader): the
  // chunks send home [0, t0), not [0, t1).
  const double sent = streamed ? prefix_sum - double(T) : prefix_sum;
  const double backward = kv * prefix_sum + g * (prefix_sum - double(T)) + g * sent + out * double(T);
  return double(cf.num_hidden_layers) * (prefill + reverse * (recompute + backward));
}

// Causal attention pairs of queries [p, p+c) against keys [0, p+c), summed over chunks of length c.
double causal_pairs(int64_t T, int64_t c) {
  double pairs = 0;
  for (int64_t p = 0; p < T; p += c) {
    const double n = double(std::min(c, T - p));
    pairs += n * double(p) + n * (n + 1) / 2;
  }
  return pairs;
}
// The same over packed documents: per sequence (doc_starts, each row's first 0) the pairs of its
// queries before `end`, each attending its own document's keys up to itself, averaged over the rows.
double document_pairs(const std::vector<std::vector<int64_t>>& doc_starts, int64_t T, int64_t end) {
  double pairs = 0;
  for (const std::vector<int64_t>& row : doc_starts)
    for (size_t i = 0; i < row.size(); ++i) {
      const double n = double(std::max<int64_t>(0, std::min(i + 1 < row.size() ? row[i + 1] : T, end) - row[i]));
      pairs += n * (n + 1) / 2;
    }
  return pairs / double(doc_starts.size());
}
// The keys whose dK, dV a backward in chunks of c adds to, summed over the chunks (each chunk's own
// and every earlier one): T^2 / 2c + T / 2.
double kv_grad_keys(int64_t T, int64_t c) {
  double keys = 0;
  for (int64_t p = 0; p < T; p += c) keys += double(std::min(T, p + c));
  return keys;
}
}  // namespace

std::string describe_schedule(const ScheduleOptions& o) {
  std::string s = o.name;
  if (o.name == "checkpointed" || o.recompute_mode() != "none")
    s += " recompute " + o.recompute_mode() + (o.offload ? " offload" : "");
  if (chunked(o)) s += fmt::format(" chunk {} bwd-chunk {}", o.chunk, o.bwd_chunk > 0 ? o.bwd_chunk : o.chunk);
  if (o.mlp_shards != 1) s += fmt::format(" mlp-shards {}", o.mlp_shards);
  if (o.offload_window > 0) s += fmt::format(" offload-window {}", o.offload_window);
  if (o.save_attention) s += " save-attention";
  if (o.save_inputs) s += " save-inputs";
  if (o.stream_kv) s += " stream-kv";
  if (o.cast_layers) s += " cast-layers";
  return s;
}

double PlanReport::peak_device_gib() const { return double(peak_device_bytes) / kGiB; }
double PlanReport::peak_host_gib() const { return double(peak_host_bytes) / kGiB; }

PlanReport plan_step(const LlamaConfig& cf, int64_t B, int64_t T, const ScheduleOptions& o, DType dtype,
                     const MemoryBudget& budget, const LoraConfig& lora, bool optimizer_offload,
                     const std::vector<std::vector<int64_t>>& doc_starts) {
  CW_CHECK(B > 0 && T > 0, "plan: batch {} and sequence {} must be positive", B, T);
  CW_CHECK(doc_starts.empty() || static_cast<int64_t>(doc_starts.size()) == B,
           "plan: document starts for {} sequences, the batch has {}", doc_starts.size(), B);
  CW_CHECK(dtype == DType::bf16 || dtype == DType::f32, "plan: --dtype {} (the GPU trains in bf16 or f32)",
           dtype_name(dtype));
  CW_CHECK(o.name == "full" || o.name == "checkpointed" || chunked(o),
           "plan: --schedule {} (want full | checkpointed | seco | spaco)", o.name);
  const int64_t L = cf.num_hidden_layers, C = cf.hidden_size, F = cf.intermediate_size, V = cf.vocab_size;
  const int64_t H = cf.num_attention_heads, Hkv = cf.num_key_value_heads, D = cf.head_dim;
  CW_CHECK(o.offload_window >= 0 && o.offload_window <= L, "plan: --offload-window {} outside [0, {}] layers",
           o.offload_window, L);
  PlanReport r;
  r.schedule = describe_schedule(o);
  if (lora.enabled())
    r.schedule += fmt::format(" lora rank {} on {}{}", lora.rank, fmt::join(lora.target_names(), ","),
                              lora.dropout > 0 ? fmt::format(" dropout {}", lora.dropout) : "");
  if (optimizer_offload) r.schedule += " optimizer offloaded";
  r.B = B;
  r.T = T;
  r.chunk = chunked(o) && o.chunk > 0 ? std::min(o.chunk, T) : T;
  r.bwd_chunk = chunked(o) && o.bwd_chunk > 0 ? std::min(o.bwd_chunk, T) : r.chunk;
  // The prefill's tokens: seco's stops where its last reverse chunk starts (optim/seco.cpp) unless it
  // saves layer inputs; spaco's runs all T (it reports every chunk's loss).
  const bool inputs = chunked(o) && o.save_inputs;
  CW_CHECK(!(inputs && o.stream_kv), "plan: --save-inputs is not kept by a streamed store (--stream-kv)");
  const int64_t prefill_end = o.name == "seco" && !inputs
                                  ? (T + r.bwd_chunk - 1) / r.bwd_chunk * r.bwd_chunk - r.bwd_chunk
                              : chunked(o) ? T : 0;
  r.offload_window = o.offload_window;
  r.device_gib = budget.device_gib;
  r.host_gib = budget.host_gib;
  const size_t e = dtype_size(dtype), acc = dtype_size(accum_dtype(dtype));

  // Fixed: one pool block per parameter set (model/params.cpp), RoPE tables (f32, T positions). What
  // is trained (master, moments, gradients) is every parameter, or under LoRA the adapters alone.
  const int64_t adapter_numel = lora_parameter_count(cf, lora);
  const size_t n = size_t(cf.parameter_count()), trained = size_t(trained_parameter_count(cf, lora));
  // With cast_layers (model/layer_cast.h) the compute copy holds the tensors outside the blocks, and
  // kSlots slots of one block's size each take a block as it runs.
  const bool cast = o.cast_layers;
  CW_CHECK(!cast || can_cast_layers(dtype, lora, optimizer_offload),
           "plan: --cast-layers rounds bf16 blocks from the f32 master on the device: it needs --dtype bf16, no LoRA "
           "and the optimizer on the device");
  const size_t block_numel = LayerCast::slot_bytes_for(cf, dtype) / e;
  const size_t resident_numel = cast ? n - block_numel * size_t(L) : n;
  r.device.emplace_back("weights", pool_block(resident_numel * e) + (lora.enabled() ? pool_block(trained * e) : 0) +
                                       (cast ? LayerCast::kSlots * pool_block(block_numel * e) : 0));
  // optim/adamw_offload.h: an offloaded f32 state streams through the device (else the host's cores update it).
  const bool streamed_optimizer = optimizer_offload && OffloadedAdamW::streams(Device::gpu(0), accum_dtype(dtype));
  if (optimizer_offload) {  // master and moments page-locked on the host
    r.host.emplace_back("master", trained * acc);
    r.host.emplace_back("optimizer", 2 * trained * acc);
    if (streamed_optimizer)  // through the device's slots
      r.device.emplace_back("optimizer", pool_block(OffloadedAdamW::device_staging_bytes_for(int64_t(trained), accum_dtype(dtype))));
    else
      r.host.emplace_back("staging", OffloadedAdamW::staging_bytes_for(int64_t(trained), accum_dtype(dtype), dtype));
  } else {
    if (dtype == DType::bf16) r.device.emplace_back("master", pool_block(trained * 4));
    r.device.emplace_back("optimizer", 2 * pool_block(trained * acc));
  }
  r.device.emplace_back("gradients", pool_block(trained * acc));

  // The K/V store: per layer K, V in the compute dtype, dK, dV in the accumulator dtype; with saved
  // attention outputs also O [B, T, H, D] and lse [B, H, T]; with saved inputs x_l [B, T, C].
  const bool saved = chunked(o) && o.save_attention;
  const size_t kv_elems = size_t(B * T * Hkv * D), out_elems = size_t(B * T * H * D), lse_elems = size_t(B * T * H);
  const size_t in_elems = size_t(B * T * C);
  size_t kv_layer = 2 * pool_block(kv_elems * e) + 2 * pool_block(kv_elems * acc);
  if (saved) kv_layer += pool_block(out_elems * e) + pool_block(lse_elems * acc);
  if (inputs) kv_layer += pool_block(in_elems * e);
  const size_t kv_host = (2 * kv_elems * (e + acc) + (saved ? out_elems * e + lse_elems * acc : 0) +
                          (inputs ? in_elems * e : 0)) * size_t(L);
  const bool streamed = chunked(o) && o.stream_kv;
  const bool windowed = chunked(o) && o.offload_window > 0 && o.offload_window < L;  // a window of layers offloaded
  // One device slot cannot prefetch: the next layer's copy in waits for the current layer to leave
  // the slot (engine/residency.h), so compute and copies take turns.
  const bool serial_copies = windowed && o.offload_window == 1;
  if (streamed) {
    // Three device slots of one chunk-sized block of every part (model/kv_store.h).
    const size_t rows = size_t(B * r.chunk);
    size_t block = 2 * pool_block(rows * size_t(Hkv * D) * e) + 2 * pool_block(rows * size_t(Hkv * D) * acc);
    if (saved) block += pool_block(rows * size_t(H * D) * e) + pool_block(rows * size_t(H) * acc);
    r.device.emplace_back("kv", 3 * block);
    r.host.emplace_back("kv", kv_host);
  } else if (o.layer_local_kv_grads(T, L)) {
    // One backward chunk of all T tokens: one layer's dK, dV serve every layer (model/kv_store.h,
    // layer-local gradients).
    const size_t grads = 2 * pool_block(kv_elems * acc);
    r.device.emplace_back("kv", (kv_layer - grads) * size_t(L) + grads);
  } else {
    const int64_t device_layers = o.offload_window > 0 ? o.offload_window : L;
    r.device.emplace_back("kv", kv_layer * size_t(device_layers));
    if (o.offload_window > 0) r.host.emplace_back("kv", kv_host);
  }

  // Activations: the arena over the step, the backward chunk that attends all T keys last (the
  // arena keeps its largest extent, so the order of phases does not matter).
  const ActivationPolicy policy = activation_policy(o, lora);
  ArenaReplay arena;
  arena.log_blocks_to(&r.arena_blocks);
  const LoraConfig* adapters = lora.enabled() ? &lora : nullptr;
  const int64_t keys = streamed ? r.chunk : T;  // the most keys one attention call sees
  // A tensor-parallel rank does not fuse (model/layer.h); counted as fused it is given a d(q, k, v) of
  // one [N, q_dim] more than its d_k and d_v: an over-estimate.
  const bool fused = fuses_qkv(adapters, nullptr);
  arena.alloc(size_t(B * T) * 4);  // optim/chunks.cpp step_tokens: the step's ids and labels, uploaded once
  arena.alloc(size_t(B * T) * 4);
  arena.alloc(size_t(B * T) * 8);  // the step's loss rows (model/llama.h LossRows, f64)
  if (prefill_end > 0)
    prefill_chunk(arena, Shape{cf, B, std::min(r.chunk, prefill_end), keys, e, acc, adapters, streamed, fused},
                  o.mlp_shards, o.name == "spaco");
  if (inputs)
    backprop_chunk_from_store(arena, Shape{cf, B, r.bwd_chunk, keys, e, acc, adapters, streamed, fused}, policy, saved);
  else
    backprop_chunk(arena, Shape{cf, B, r.bwd_chunk, keys, e, acc, adapters, streamed, fused}, policy, saved);
  r.attention_workspace_bytes = attention_backward_workspace(cf, B, keys);
  r.device.emplace_back("activations", arena.reserved());
  if (policy.offload_inputs) r.host.emplace_back("layer inputs", size_t(L) * size_t(B * T * C) * e);
  r.device.emplace_back("other", 2 * pool_block(size_t(T) * size_t(D / 2) * 4) + kCublasWorkspaceBytes);

  for (const auto& [name, bytes] : r.device) r.peak_device_bytes += bytes;
  for (const auto& [name, bytes] : r.host) r.peak_host_bytes += bytes;
  r.context_bytes = kCudaContextBytes;
  r.device_fits = double(r.peak_device_bytes + r.context_bytes) <= budget.device_gib * kGiB;
  r.host_fits = budget.host_gib <= 0 || double(r.peak_host_bytes) <= kPinnableHostShare * budget.host_gib * kGiB;
  r.fits = r.device_fits && r.host_fits;

  // Time. Passes of the layers' work over the reverse tokens (spaco visits keep of k chunks).
  double reverse = 1;
  if (o.name == "spaco" && o.keep > 0) {
    const double k = std::ceil(double(T) / double(r.bwd_chunk));
    reverse = std::min(1.0, double(o.keep) / k);
  }
  const double tokens = double(B * T);
  const double layer_matmul = 2.0 * double(L) * double(C * H * D + 2 * C * Hkv * D + H * D * C + 3 * C * F);
  const double mlp_gate_up = 2.0 * double(L) * double(2 * C * F);
  // Forward passes of every layer: the prefill (its share of the tokens), the forward of the reverse
  // tokens, one recompute more for checkpointed full; the backward counts as two (dX and dW). With
  // saved inputs the reverse tokens' one forward is each layer's recompute before its backward.
  const double prefill = double(prefill_end) / double(T);
  const double extra_forward = !policy.keep_layers && !inputs ? 1 : 0;
  // A frozen base (LoRA) has no weight-gradient products: its backward counts once (dX).
  const double backward = lora.enabled() ? 1 : 2;
  const double passes = prefill + reverse * (1 + extra_forward + backward);
  double matmul = tokens * layer_matmul * passes;
  // The adapters: 2 flops per adapter parameter and token in each forward, dX and d(A, B) backward.
  const double adapter_pass = lora.enabled() ? 2.0 * double(adapter_numel) : 0.0;
  matmul += tokens * adapter_pass * (prefill + reverse * (1 + extra_forward + 2));
  // The prefill's share runs at its chunk's rows, the rest at the reverse chunk's.
  const double prefill_matmul = tokens * prefill * (layer_matmul + adapter_pass);
  // A recompute from saved attention outputs skips the K and V projections (not the first forward of
  // a chunk the prefill did not reach).
  const double unsaved_tokens = double(B * (T - prefill_end));
  if (saved)
    matmul -= (tokens * reverse * (1 + extra_forward) - unsaved_tokens) * 2.0 * double(L) * double(2 * C * Hkv * D);
  // Selective recompute and the tiled MLP with kept activations run gate/up again in the backward.
  if (policy.keep_layers && !inputs && mlp_kept(policy, cf, B * r.bwd_chunk) == MlpKept::input)
    matmul += tokens * reverse * mlp_gate_up;
  // A layer recomputed just before its backward skips W_down's product (only the next layer reads
  // it): each recompute of a checkpointed layer, and with saved inputs every layer's but the last's
  // (whose output the LM head reads).
  const double mlp_down = 2.0 * double(C * F);
  if (inputs)
    matmul -= tokens * reverse * double(L - 1) * mlp_down;
  else
    matmul -= tokens * reverse * extra_forward * double(L) * mlp_down;
  // The fused LM head: logits, dX and dW over the reverse tokens; spaco's prefill also takes the loss.
  const double head = 2.0 * double(V * C) * tokens * ((1 + backward) * reverse + (o.name == "spaco" ? 1 : 0));
  // Attention: 4 H D flops per (query, key) pair and layer forward, 2.5x that backward; a pair is a
  // query and a key of its own document (the query's causal prefix when there are no documents).
  const double per_pair = 4.0 * double(H * D) * double(L) * double(B);
  const auto pairs = [&](int64_t end, int64_t c) {
    return doc_starts.empty() ? causal_pairs(end, c) : document_pairs(doc_starts, T, end);
  };
  // With saved outputs the reverse sweep's forwards (and a layer recompute) run no attention.
  const double reverse_forward = saved ? 0 : 1 + extra_forward;
  const double unsaved_pairs = saved ? pairs(T, r.bwd_chunk) - pairs(prefill_end, r.bwd_chunk) : 0;
  const double attention = per_pair * (pairs(prefill_end, r.chunk) +
                                       reverse * pairs(T, r.bwd_chunk) * (reverse_forward + 2.5) +
                                       unsaved_pairs);
  const double elementwise = tokens * double(L) * passes * double(16 * C + 6 * F) * double(e);
  // The optimizer: on the device, its traffic; offloaded, the slowest stage of its pipeline, which
  // overlap one another: streamed through the device (f32 state), master, m and v in on one lane and
  // out on the other, and the device's update; else gradients out, the host's update, weights in.
  const double device_update_s = double(trained) * (dtype == DType::bf16 ? 38.0 : 36.0) / kElementwiseBytesPerS;
  const double optimizer_s =
      !optimizer_offload ? device_update_s
      : streamed_optimizer ? std::max(double(3 * trained * acc) / kPcieBytesPerS, device_update_s)
          : std::max({double(trained * acc) / kPcieBytesPerS, double(trained * e) / kPcieBytesPerS,
                      double(trained) / kHostAdamWElemsPerS});
  r.flops = matmul + head + attention;
  // A streamed store's blocks each run as one unmasked or square graph: one masked graph's rate, then
  // its measured slowdown.
  // The rate of the calls that dominate: the reverse chunks' against all T keys.
  const double attention_s = attention / (attention_tflops(D, !streamed && cudnn_splits_prefix(r.bwd_chunk, T)) * 1e12) *
                             (streamed ? kStreamedAttentionSlowdown : 1.0);
  // The backward's dK, dV adds: per key and layer, K's and V's bf16 gradient read and the f32
  // accumulator read and written.
  const double kv_grad_adds = reverse * kv_grad_keys(T, r.bwd_chunk) * double(B * L) * 2.0 * double(Hkv * D) *
                              double(e + 2 * acc) / kKvGradAddBytesPerS;
  const double matmul_s = prefill_matmul / (kMatmulTflops * 1e12 * matmul_row_efficiency(B * r.chunk)) +
                         (matmul - prefill_matmul) / (kMatmulTflops * 1e12 * matmul_row_efficiency(B * r.bwd_chunk));
  r.time = {{"matmul", matmul_s},
            {"lm_head", head / (kMatmulTflops * 1e12)},
            {"attention", attention_s},
            {"kv grad adds", kv_grad_adds},
            {"elementwise", elementwise / kElementwiseBytesPerS},
            {"optimizer", optimizer_s}};
  // cast_layers: a block is cast each time a chunk's pass reaches it, except where a slot still holds
  // it: every prefill chunk casts all L blocks; a reverse chunk's backward finds its forward's last
  // kSlots blocks, and the next reverse chunk's forward finds the first kSlots its backward ended with.
  if (cast) {
    const double prefill_chunks = std::ceil(double(prefill_end) / double(r.chunk));
    const double reverse_chunks = reverse * std::ceil(double(T) / double(r.bwd_chunk));
    const double slots = double(std::min<int64_t>(L / 2, LayerCast::kSlots));
    // With saved inputs a reverse chunk only runs down the layers: it finds the kSlots blocks of the
    // pass before it only at the first (the prefill's last layers).
    r.layer_casts = inputs ? prefill_chunks * double(L) + reverse_chunks * double(L) - slots
                           : prefill_chunks * double(L) + reverse_chunks * (2 * double(L) - 2 * slots) + slots;
    r.time.emplace_back("weight casts", r.layer_casts * double(block_numel) * double(4 + e) / kElementwiseBytesPerS);
  }
  for (const auto& [name, s] : r.time) r.step_s += s;
  // The K/V offload's copies run on the side stream beside the compute (RESULTS.md: 99.9% of them
  // under it at 128K); they lengthen the step only where they outlast what they hide behind. A
  // window's next layer is fetched while the current layer computes, so that is the whole step; a
  // streamed store's blocks are fetched two ahead of the attention that reads them, so that is the
  // attention (RESULTS.md, eighth session: 32K, chunk 2048 waited 0.41 s of 2.00). With a window of
  // one layer they add to the step (seventh session: 8B at 64K in 24 GiB waited 58% of the step).
  if (streamed || windowed) {
    r.kv_moved_bytes =
        kv_offload_bytes(cf, {B, T, r.chunk, r.bwd_chunk, prefill_end, e, acc, saved, streamed, reverse, inputs});
    const double copies_s = r.kv_moved_bytes / kPcieBytesPerS;
    if (serial_copies) {
      r.time.emplace_back("kv copies (one slot: not overlapped)", copies_s);
      r.step_s += copies_s;
    } else if (streamed) {
      const double beyond = std::max(0.0, copies_s - attention_s);
      r.time.emplace_back("kv copies beyond attention", beyond);
      r.step_s += beyond;
    } else {
      // The compute's waits for copies, or where the copies outlast the compute, what they add.
      const double waits = std::max(kWindowCopyWaitShare * copies_s, copies_s - r.step_s);
      r.time.emplace_back("kv copy waits", waits);
      r.step_s += waits;
    }
  }

  if (!r.host_fits) {
    r.advice = "keep more of the K/V store on the device (a larger --offload-window, not --stream-kv), drop "
               "--save-attention (its outputs are offloaded with the store), keep the optimizer on the device, or "
               "lower --seq";
  } else if (!r.fits) {
    if (chunked(o))
      r.advice = o.stream_kv ? "lower --chunk (the blocks and activations grow with it), or offload the optimizer "
                               "(--optimizer-offload)"
                             : "lower --chunk / --bwd-chunk (activations grow with it), set --offload-window to keep "
                               "only that many layers of the K/V store on the device, or --stream-kv to keep none";
    else if (o.name == "full")
      r.advice = "use --schedule checkpointed (--recompute selective) or seco with --chunk 4096";
    else
      r.advice = "use --schedule seco with --chunk 4096 (activations O(chunk) instead of O(T))";
    // bf16 full-parameter training on the device can also drop the blocks' resident compute copy.
    if (!cast && can_cast_layers(dtype, lora, optimizer_offload))
      r.advice += fmt::format("; --cast-layers frees {:.1f} GiB of resident bf16 block weights",
                              double((size_t(L) - LayerCast::kSlots) * block_numel * e) / kGiB);
  }
  return r;
}

const std::vector<int64_t>& chunk_candidates() {
  static const std::vector<int64_t> c = {1024, 2048, 4096, 8192, 16384, 32768};
  return c;
}

namespace {
// Of `candidates`, in order of growing chunks, the last that fits and is predicted within 1% of the
// fastest before it: the time model is blind to kernel efficiency at small row counts, so fewer,
// larger kernels win a near tie. nullopt where none fits.
std::optional<ScheduleOptions> longest_near_fastest(const std::vector<ScheduleOptions>& candidates,
                                                    const LlamaConfig& config, int64_t B, int64_t T, DType dtype,
                                                    const MemoryBudget& budget, const LoraConfig& lora,
                                                    bool optimizer_offload) {
  std::optional<ScheduleOptions> best;
  double best_s = 0;
  for (const ScheduleOptions& o : candidates) {
    const PlanReport r = plan_step(config, B, T, o, dtype, budget, lora, optimizer_offload);
    if (r.fits && (!best || r.step_s <= best_s * 1.01)) {
      best_s = best ? std::min(best_s, r.step_s) : r.step_s;
      best = o;
    }
  }
  return best;
}
}  // namespace

int64_t choose_chunk(const LlamaConfig& config, int64_t B, int64_t T, const ScheduleOptions& schedule, DType dtype,
                     const MemoryBudget& budget, const std::vector<int64_t>& candidates, const LoraConfig& lora,
                     bool optimizer_offload) {
  std::vector<ScheduleOptions> chunked_at;
  for (int64_t c : candidates) {
    if (c > T) continue;
    ScheduleOptions o = schedule;
    o.chunk = c;
    o.bwd_chunk = 0;
    chunked_at.push_back(o);
  }
  const auto best = longest_near_fastest(chunked_at, config, B, T, dtype, budget, lora, optimizer_offload);
  return best ? best->chunk : 0;
}

namespace {
// A prefill in longer chunks than the reverse sweep's: its GEMMs run over more rows and its
// attention and window copies in fewer calls, for little memory (a prefill chunk keeps nothing).
// From `o` (chunk c, no bwd_chunk of its own, fitting): bwd_chunk = c and, of c, 2c, 4c up to
// kLongestAutoPrefill, the longest near the fastest (longest_near_fastest). The cap: 16384 is the
// longest measured to help (32K, 64K); at 128K prefill chunks of 16384 and 32768 both peaked 0.25 GiB
// over their plan and gained 0.2% (RESULTS.md, fifteenth session). The streamed store needs
// bwd_chunk = chunk.
constexpr int64_t kLongestAutoPrefill = 16384;

ScheduleOptions longer_prefill(const LlamaConfig& config, int64_t B, int64_t T, const ScheduleOptions& o, DType dtype,
                               const MemoryBudget& budget, const LoraConfig& lora, bool optimizer_offload) {
  if (!chunked(o) || o.stream_kv || o.bwd_chunk > 0 || o.chunk <= 0) return o;
  std::vector<ScheduleOptions> prefills{o};
  for (int64_t k : {2, 4}) {
    ScheduleOptions p = o;
    p.bwd_chunk = o.chunk;
    p.chunk = k * o.chunk;
    if (p.chunk > std::min(T, kLongestAutoPrefill)) break;
    prefills.push_back(p);
  }
  return longest_near_fastest(prefills, config, B, T, dtype, budget, lora, optimizer_offload).value_or(o);
}
}  // namespace

int64_t choose_offload_window(const LlamaConfig& config, int64_t B, int64_t T, const ScheduleOptions& schedule,
                              DType dtype, const MemoryBudget& budget, const LoraConfig& lora, bool optimizer_offload) {
  ScheduleOptions o = schedule;
  for (int64_t w = 0; w <= config.num_hidden_layers; ++w) {
    o.offload_window = w == 0 ? 0 : w;
    if (plan_step(config, B, T, o, dtype, budget, lora, optimizer_offload).fits) return w;
  }
  return -1;
}

std::string plan_table(const PlanReport& r) {
  std::string s = fmt::format("plan: {} x {} tokens, {}\n", r.B, r.T, r.schedule);
  s += fmt::format("  {:14} {:>10}\n", "device", "GiB");
  for (const auto& [name, bytes] : r.device) s += fmt::format("  {:14} {:10.2f}\n", name, double(bytes) / kGiB);
  s += fmt::format("  {:14} {:10.2f}   (the caching pool's peak: `chunkwise bench` peak_gib)\n", "peak",
                   r.peak_device_gib());
  s += fmt::format("  {:14} {:10.2f}   (outside the pool)\n", "cuda context", double(r.context_bytes) / kGiB);
  s += fmt::format("  {:14} {:10.2f}   (of activations: the largest attention backward's, cuDNN's GQA staging)\n",
                   "attn workspace", double(r.attention_workspace_bytes) / kGiB);
  if (!r.host.empty()) {
    s += fmt::format("  {:14} {:>10}\n", "host", "GiB");
    for (const auto& [name, bytes] : r.host) s += fmt::format("  {:14} {:10.2f}\n", name, double(bytes) / kGiB);
    s += fmt::format("  {:14} {:10.2f}\n", "peak", r.peak_host_gib());
  }
  s += fmt::format("  {:14} {:>10}\n", "time", "s");
  for (const auto& [name, sec] : r.time) s += fmt::format("  {:14} {:10.3f}\n", name, sec);
  if (r.kv_moved_bytes > 0)
    s += fmt::format("  {:14} {:10.1f}   GiB of K/V moved host <-> device a step\n", "kv moved", r.kv_moved_bytes / kGiB);
  s += fmt::format("  {:14} {:10.3f}   ({:.0f} tokens/s, {:.1f} TFLOP executed)\n", "step", r.step_s,
                   r.tokens_per_s(), r.flops / 1e12);
  const std::string host = r.host_gib > 0 ? fmt::format(" and {:.0f}% of {:.1f} GiB of host memory", 100 * kPinnableHostShare, r.host_gib) : "";
  s += fmt::format("{} in {:.1f} GiB of device memory{}{}\n", r.fits ? "fits" : "DOES NOT FIT", r.device_gib, host,
                   r.fits ? "" : fmt::format(" ({} over): {}", r.device_fits ? "host" : "device", r.advice));
  return s;
}

std::string plan_json(const PlanReport& r) {
  nlohmann::json j;
  j["schedule"] = r.schedule;
  j["batch"] = r.B;
  j["seq"] = r.T;
  j["chunk"] = r.chunk;
  j["bwd_chunk"] = r.bwd_chunk;
  j["offload_window"] = r.offload_window;
  j["peak_device_gib"] = r.peak_device_gib();
  j["peak_host_gib"] = r.peak_host_gib();
  j["cuda_context_gib"] = double(r.context_bytes) / kGiB;
  j["step_s"] = r.step_s;
  j["kv_moved_gib"] = r.kv_moved_bytes / kGiB;
  j["attention_workspace_gib"] = double(r.attention_workspace_bytes) / kGiB;
  j["tokens_per_s"] = r.tokens_per_s();
  j["flops"] = r.flops;
  j["device_memory_gib"] = r.device_gib;
  j["host_memory_gib"] = r.host_gib;
  j["fits"] = r.fits;
  j["device_fits"] = r.device_fits;
  j["host_fits"] = r.host_fits;
  if (!r.fits) j["advice"] = r.advice;
  for (const auto& [name, bytes] : r.device) j["categories"]["device"][name] = double(bytes) / kGiB;
  for (const auto& [name, bytes] : r.host) j["categories"]["host"][name] = double(bytes) / kGiB;
  for (const auto& [name, sec] : r.time) j["categories"]["time_s"][name] = sec;
  return j.dump(2);
}

namespace {
// resolve_auto_schedule for one recompute mode.
// The budget in words, for errors: "24.0 GiB" or "24.0 GiB of device and 90% of 128.0 GiB of host memory"
// (kPinnableHostShare).
std::string budget_text(const MemoryBudget& b) {
  return b.host_gib > 0 ? fmt::format("{:.1f} GiB of device and {:.0f}% of {:.1f} GiB of host memory", b.device_gib,
                                      100 * kPinnableHostShare, b.host_gib)
                        : fmt::format("{:.1f} GiB", b.device_gib);
}

// The settings chosen, and where `weighed` (when given) holds them.
struct Resolved {
  ScheduleOptions schedule;
  size_t weighed_index = 0;
};

Resolved resolve_chunk_and_window(const LlamaConfig& cf, int64_t B, int64_t T, ScheduleOptions o, DType dtype,
                                  const MemoryBudget& gib, const LoraConfig& lora, bool optimizer_offload,
                                  std::vector<AutoCandidate>* weighed = nullptr) {
  const bool auto_chunk = o.chunk == kAuto, auto_window = o.offload_window == kAuto;
  CW_CHECK(chunked(o), "schedule.chunk and schedule.offload_window = auto are for schedules seco and spaco");
  auto out_of_memory = [&] {
    std::string sizes;
    for (int64_t c : chunk_candidates()) sizes += (sizes.empty() ? "" : ", ") + std::to_string(c);
    fail(fmt::format("out of memory at every chunk length ({}) in {}{}", sizes, budget_text(gib),
                     auto_window ? " with any K/V offload window or the store streamed" : ""),
         auto_window ? (gib.host_gib > 0 ? "lower the sequence length or batch, or use a machine with more device or "
                                           "host memory (the offloaded store is pinned in host memory)"
                                         : "lower the sequence length or batch, or offload the optimizer "
                                           "(--optimizer-offload)")
                     : "set the offload window (--offload-window N or auto), or lower the sequence length or batch");
  };
  if (!auto_window) {
    if (auto_chunk) o.chunk = choose_chunk(cf, B, T, o, dtype, gib, chunk_candidates(), lora, optimizer_offload);
    if (auto_chunk && o.chunk == 0) out_of_memory();
    if (auto_chunk) o = longer_prefill(cf, B, T, o, dtype, gib, lora, optimizer_offload);
    if (!weighed) return {o};
    const PlanReport r = plan_step(cf, B, T, o, dtype, gib, lora, optimizer_offload);
    weighed->push_back({o, r.fits, r.peak_device_gib(), r.peak_host_gib(), r.step_s, false});
    return {o, weighed->size() - 1};
  }
  // auto window: where the K/V store lives, with each place's fastest chunk (or the given one): on the
  // device; a window of two layers (the least memory whose copies overlap the compute; a larger
  // window moves the same bytes in more memory); of one (less memory still, its copies not
  // overlapped); streamed in chunk-sized blocks (no layer whole on the device). The fastest that fits
  // wins; an earlier one unless a later one is 1% faster (an offload adds risks the model does not
  // time, such as host memory pressure).
  std::vector<ScheduleOptions> places;
  for (const int64_t w : {int64_t(0), int64_t(2), int64_t(1)}) {
    if (w >= cf.num_hidden_layers || (w > 0 && o.stream_kv)) continue;
    ScheduleOptions p = o;
    p.offload_window = w;
    places.push_back(p);
  }
  if (!o.stream_kv && !o.save_inputs && o.bwd_chunk == 0) {
    ScheduleOptions streamed = o;
    streamed.offload_window = 0;
    streamed.stream_kv = true;
    places.push_back(streamed);
  }
  std::optional<Resolved> best;
  double best_s = 0;
  for (ScheduleOptions p : places) {
    if (auto_chunk) p.chunk = choose_chunk(cf, B, T, p, dtype, gib, chunk_candidates(), lora, optimizer_offload);
    if (p.chunk <= 0) continue;
    if (auto_chunk) p = longer_prefill(cf, B, T, p, dtype, gib, lora, optimizer_offload);
    const PlanReport r = plan_step(cf, B, T, p, dtype, gib, lora, optimizer_offload);
    if (weighed) weighed->push_back({p, r.fits, r.peak_device_gib(), r.peak_host_gib(), r.step_s, false});
    if (r.fits && (!best || r.step_s < best_s * 0.99)) {
      best = Resolved{p, weighed ? weighed->size() - 1 : 0};
      best_s = r.step_s;
    }
  }
  if (best) return *best;
  if (auto_chunk) out_of_memory();
  fail(fmt::format("out of memory with any K/V offload window or the store streamed at chunk {} in {}", o.chunk,
                   budget_text(gib)),
       "lower the chunk (--chunk N or auto), or offload the optimizer (--optimizer-offload)");
}
}  // namespace

ScheduleOptions resolve_auto_schedule(const LlamaConfig& cf, int64_t B, int64_t T, ScheduleOptions o, DType dtype,
                                      const MemoryBudget& gib, const LoraConfig& lora, bool optimizer_offload,
                                      std::vector<AutoCandidate>* weighed) {
  if (o.chunk != kAuto && o.offload_window != kAuto) return o;
  if (!chunked(o)) return resolve_chunk_and_window(cf, B, T, o, dtype, gib, lora, optimizer_offload, weighed).schedule;
  // With a planned chunk or window, what happens inside a chunk is planned too. recompute = auto:
  // keeping every activation of a chunk (none) is fastest per chunk, but recomputing inside it
  // (selective, full) lets a larger chunk fit, and a larger chunk moves fewer K/V bytes where the
  // store is offloaded. Saved attention outputs (save_attention, unless already asked for) spare the
  // reverse sweep its attention forward for store memory. Each alternative that costs memory or
  // recomputes more must be clearly (1%) faster than the one before it.
  std::vector<std::string> modes{o.recompute};
  if (o.recompute == "auto") modes = {"none", "selective", "full"};
  // Casting the blocks from the master as they run (cast_layers, where it applies) frees their
  // resident copy for a cast per block use.
  std::vector<bool> saves{o.save_attention};
  if (!o.save_attention) saves = {false, true};
  // Saved layer inputs (save_inputs, unless already asked for) spare the reverse sweep its chunk
  // forward, and a chunk all but one layer's activations, for store memory; not with a streamed store.
  std::vector<bool> inputs{o.save_inputs};
  if (!o.save_inputs && !o.stream_kv) inputs = {false, true};
  std::vector<bool> casts{o.cast_layers};
  if (!o.cast_layers && can_cast_layers(dtype, lora, optimizer_offload)) casts = {false, true};
  std::optional<Resolved> best;
  double best_s = 0;
  std::optional<Error> first_error;
  for (const bool cast : casts) {
    for (const bool save : saves) {
      for (const bool in : inputs) {
        for (const std::string& mode : modes) {
          // With saved inputs every layer is recomputed from its input: none and full are the same.
          if (in && mode == "full" && o.recompute == "auto") continue;
          ScheduleOptions m = o;
          m.recompute = mode;
          m.save_attention = save;
          m.save_inputs = in;
          m.cast_layers = cast;
          try {
            const Resolved r = resolve_chunk_and_window(cf, B, T, m, dtype, gib, lora, optimizer_offload, weighed);
            const double s = plan_step(cf, B, T, r.schedule, dtype, gib, lora, optimizer_offload).step_s;
            if (!best || s < best_s * 0.99) {
              best = r;
              best_s = s;
            }
          } catch (const Error& e) {
            if (!first_error) first_error = e;
          }
        }
      }
    }
  }
  if (!best) throw *first_error;
  if (weighed) (*weighed)[best->weighed_index].chosen = true;
  return best->schedule;
}

LongestPlan longest_sequence(const LlamaConfig& cf, int64_t B, const ScheduleOptions& schedule, DType dtype,
                             const MemoryBudget& budget, const LoraConfig& lora, bool optimizer_offload, int64_t limit) {
  LongestPlan best;
  best.granule = chunked(schedule) && schedule.chunk > 0 ? schedule.chunk : 1024;
  best.schedule = schedule;
  // Whether k granules fit, and the settings that do.
  const auto fits = [&](int64_t k, ScheduleOptions* chosen) {
    const int64_t T = k * best.granule;
    try {
      const ScheduleOptions o = resolve_auto_schedule(cf, B, T, schedule, dtype, budget, lora, optimizer_offload);
      if (!plan_step(cf, B, T, o, dtype, budget, lora, optimizer_offload).fits) return false;
      *chosen = o;
      return true;
    } catch (const Error&) {  // auto found nothing that fits
      return false;
    }
  };
  // Doubling to the first length that does not fit, then halving the gap: memory grows with T.
  const int64_t max_k = std::max<int64_t>(limit / best.granule, 1);
  int64_t good = 0, bad = 1;
  ScheduleOptions chosen;
  while (bad <= max_k && fits(bad, &chosen)) {
    good = bad;
    best.schedule = chosen;
    bad = std::min(bad * 2, max_k + 1);
    if (good == max_k) break;
  }
  if (good == max_k) bad = max_k + 1;
  while (bad - good > 1) {
    const int64_t mid = good + (bad - good) / 2;
    if (fits(mid, &chosen)) {
      good = mid;
      best.schedule = chosen;
    } else {
      bad = mid;
    }
  }
  best.T = good * best.granule;
  return best;
}

double device_gib_or_gpu(double gib) {
  if (gib > 0) return gib;
  const std::vector<GpuInfo> gpus = list_gpus();
  return gpus.empty() ? kDefaultDeviceGib : double(gpus.front().memory_bytes) / kGiB;
}

double host_gib_or_machine(double gib) {
  if (gib > 0) return gib;
  if (list_gpus().empty()) return 0;
  return double(host_memory_available()) / kGiB;
}

size_t pool_limit_for(double gib, const char* option) {
  const double bytes = gib * kGiB - double(kCudaContextBytes);
  if (!(bytes > 0))
    fail(fmt::format("{} = {} GiB is less than the CUDA context's {} MiB", option, gib, kCudaContextBytes >> 20),
         "give the GiB the run may use, e.g. --device-memory 24");
  return static_cast<size_t>(bytes);
}

int run_plan(const PlanOptions& po, std::ostream& out) {
  // With tensor parallelism each GPU holds a Llama of 1/tp of the heads, K/V heads and FFN columns
  // (model/shard.h, as train plans a rank): its plan is the per-GPU plan. The collectives' time is not
  // in the step time.
  const LlamaConfig cf = po.tp > 1 ? tp_shard_config(LlamaConfig::resolve(po.model), po.tp) : LlamaConfig::resolve(po.model);
  if (po.tp > 1)
    out << fmt::format("tensor parallel: one GPU of {} (1/{} of the heads, K/V heads and FFN; embeddings and norms "
                       "whole; collectives not timed)\n",
                       po.tp, po.tp);
  const DType dtype = parse_dtype(po.dtype);
  validate_lora(po.lora);
  const MemoryBudget gib(device_gib_or_gpu(po.device_memory_gib), host_gib_or_machine(po.host_memory_gib));
  int64_t T = po.seq;
  ScheduleOptions o;
  std::vector<AutoCandidate> weighed;
  if (po.longest) {
    const LongestPlan l = longest_sequence(cf, po.batch, po.schedule, dtype, gib, po.lora, po.optimizer_offload);
    if (l.T == 0)
      fail(fmt::format("plan --longest: not even {} tokens fit in {}", l.granule, budget_text(gib)),
           "lower --batch or --chunk, use --stream-kv or --offload-window auto, or offload the optimizer");
    out << fmt::format("longest: {} tokens fit ({} more do not), planned below\n", l.T, l.granule);
    T = l.T;
    o = l.schedule;
  } else {
    o = resolve_auto_schedule(cf, po.batch, T, po.schedule, dtype, gib, po.lora, po.optimizer_offload,
                              po.explain ? &weighed : nullptr);
  }
  const std::vector<std::vector<int64_t>> documents =
      po.documents.empty() ? std::vector<std::vector<int64_t>>{} : bench_document_starts(po.documents, po.batch, T, 2000);
  if (!documents.empty())
    out << fmt::format("documents: {} ({} in the first sequence); attention planned over their causal squares\n",
                       po.documents, documents[0].size());
  const PlanReport r = plan_step(cf, po.batch, T, o, dtype, gib, po.lora, po.optimizer_offload, documents);
  out << plan_table(r);
  if (arena_log())
    for (const std::string& line : r.arena_blocks) out << "replay: " << line << "\n";
  if (!weighed.empty()) {
    // What auto compared: per recompute mode and saved outputs, each place of the K/V store with its
    // fastest chunk. The fastest that fits wins; one costing more memory or recompute, or offloading
    // more, must be 1% faster than the one before it.
    size_t width = 0;
    for (const AutoCandidate& c : weighed) width = std::max(width, describe_schedule(c.schedule).size());
    out << "auto weighed (each place of the K/V store with its fastest chunk; * chosen):\n";
    out << fmt::format("    {:<{}} {:>12} {:>12} {:>10}\n", "settings", width, "device GiB", "host GiB", "step s");
    for (const AutoCandidate& c : weighed)
      out << fmt::format("  {} {:<{}} {:>12.2f} {:>12} {:>10.3f}{}\n", c.chosen ? "*" : " ",
                         describe_schedule(c.schedule), width, c.peak_device_gib,
                         c.peak_host_gib > 0 ? fmt::format("{:.2f}", c.peak_host_gib) : "-", c.step_s,
                         c.fits ? "" : "  (does not fit)");
  }
  if (!po.json.empty()) {
    std::ofstream f(po.json);
    CW_CHECK_HINT(f.good(), "check the --json path", "plan: cannot write {}", po.json);
    f << plan_json(r) << "\n";
  }
  return r.fits ? 0 : 1;
}

}  // namespace cw
