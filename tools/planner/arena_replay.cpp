#include "tools/planner/arena_replay.h"

#include "engine/engine.h"
#include "engine/memory.h"
#include "engine/ops/attention.h"
#include "engine/scratch.h"
#include "model/layer.h"
#include "model/llama.h"
#include "optim/chunks.h"

#include <algorithm>
#include <compare>
#include <map>

namespace cw {

namespace {
size_t round_up(size_t n, size_t q) { return (n + q - 1) / q * q; }
}  // namespace

void ArenaReplay::alloc(size_t bytes) {
  const size_t need = round_up(bytes == 0 ? 1 : bytes, kMemoryAlignBytes);
  const size_t in_use_before = in_use_;
  while (current_ < blocks_.size() && offset_ + need > blocks_[current_]) {
    in_use_ += blocks_[current_] - offset_;  // the tail of a block is lost until a reset
    ++current_;
    offset_ = 0;
  }
  if (current_ == blocks_.size()) {
    blocks_.push_back(std::max(block_bytes_, need));
    offset_ = 0;
    if (log_)
      log_->push_back(
          arena_block_line(blocks_.size() - 1, blocks_.back(), need, in_use_ - in_use_before, in_use_before));
  }
  offset_ += need;
  in_use_ += need;
  high_water_ = std::max(high_water_, in_use_);
}

void ArenaReplay::reset(const Mark& m) {
  current_ = m.block;
  offset_ = m.offset;
  in_use_ = m.in_use;
}

size_t StepArena::reserved() const {
  size_t n = 0;
  for (size_t b : blocks) n += b;
  return n;
}

namespace {
// A chunk's requests, recorded before they reach the arena: a request's bytes, or the opening or
// closing of a scope (an ArenaScope in the code replayed).
constexpr int64_t kOpen = -1, kClose = -2;
struct Requests {
  std::vector<int64_t> ops;
  size_t attention_workspace = 0;
  void alloc(size_t bytes) { ops.push_back(static_cast<int64_t>(std::max<size_t>(bytes, 1))); }
};
struct Scope {
  Requests& r;
  explicit Scope(Requests& requests) : r(requests) { r.ops.push_back(kOpen); }
  ~Scope() { r.ops.push_back(kClose); }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;
};

void apply(ArenaReplay& arena, const Requests& r) {
  std::vector<ArenaReplay::Mark> marks;
  for (const int64_t op : r.ops) {
    if (op == kOpen) {
      marks.push_back(arena.mark());
    } else if (op == kClose) {
      arena.reset(marks.back());
      marks.pop_back();
    } else {
      arena.alloc(static_cast<size_t>(op));
    }
  }
}

// One chunk of the step: B sequences, tokens [t0, t1), on the step's device, in a layer whose sliding
// window is `window` (config layer_window).
struct Chunk {
  const LlamaConfig& cf;
  int64_t B, t0, t1;
  DType dtype;
  const LoraConfig* lora;  // null: no adapters
  Device device;
  int64_t stream_block;  // schedule.stream_kv's key block; 0: the store is not streamed
  bool fused;            // model/layer.h fuses_qkv: one Q/K/V GEMM each way
  int64_t window = 0;    // the layer's sliding window (0: none)
  int64_t cp = 1;        // context-parallel ranks: the rank holds ct() tokens of each sequence
  int64_t c() const { return t1 - t0; }
  int64_t ct() const { return c() / cp; }
  // The heads attention runs on: all, or under context parallelism the rank's (cp_attention_config).
  int64_t heads() const { return cf.num_attention_heads / cp; }
  int64_t kv_heads() const { return std::max<int64_t>(1, cf.num_key_value_heads / cp); }
  int64_t first_key() const { return window_first_key(t0, window); }  // KVStore::first_key
  Chunk in_layer_of(int64_t w) const {
    Chunk s = *this;
    s.window = w;
    return s;
  }
  int64_t N() const { return B * ct(); }  // the rank's rows
  // Whether cuDNN takes this chunk's attention (the chooser's shape rule, engine/ops/attention.h);
  // else a flash family does.
  bool cudnn_attention() const {
    return cudnn_takes_shape({dtype, cf.head_dim, window > 0, cf.attn_logit_softcapping > 0});
  }
  // Whether, cuDNN aside, a tensor-core flash family takes it (flash_mma takes every shape flash_wgmma
  // does): its backward's scratch holds the fused dQ accumulator.
  bool tensor_core_flash() const {
    return mma_flash_takes_shape({dtype, cf.head_dim, window > 0, cf.attn_logit_softcapping > 0});
  }
  size_t e() const { return dtype_size(dtype); }
  size_t acc() const { return dtype_size(accum_dtype(dtype)); }
  size_t row(int64_t width) const { return static_cast<size_t>(N() * width) * e(); }  // [N, width]
  size_t stat(int64_t width) const { return static_cast<size_t>(N() * width) * acc(); }  // f32 or f64
  // The chunk's K (or V) of the rank's heads, [B, c, kv_heads, D] (context parallelism).
  size_t kv_heads_bytes() const { return static_cast<size_t>(B * c() * kv_heads() * cf.head_dim) * e(); }
  // Whether several ranks hold each K/V head (context parallelism over more ranks than K/V heads).
  bool kv_replicated() const { return kv_heads() * cp > cf.num_key_value_heads; }
  AttentionDims attention(int64_t S) const {
    return {B, c(), S, heads(), kv_heads(), cf.head_dim};
  }
};

// ---- The ops' scratch, by backend (engine/scratch.h) ----

// One attention call's forward against S keys (causal: the chunk's own keys last).
void attention_forward(Requests& r, const Chunk& s, int64_t S, bool causal) {
  Scope scope(r);
  if (s.device.is_cpu()) {
    for (size_t bytes : cpu_attention_scratch(s.c(), S, s.dtype, false)) r.alloc(bytes);
  } else if (s.cudnn_attention()) {
    // cuDNN (it takes no sliding window: the flash kernels serve one); its forward plans' workspace
    // is not replayed (they ask for none beyond a few bytes).
    const bool split = causal && cudnn_splits_prefix(s.c(), S);
    const CudnnForwardScratch f = cudnn_attention_forward_scratch(s.attention(S), split);
    if (f.prefix_out) {
      r.alloc(f.prefix_out);
      r.alloc(f.prefix_lse);
    }
  }  // the flash kernels' forward takes none
}

void attention_backward(Requests& r, const Chunk& s, int64_t S, bool causal) {
  Scope scope(r);
  const AttentionDims d = s.attention(S);
  if (s.device.is_cpu()) {
    for (size_t bytes : cpu_attention_scratch(s.c(), S, s.dtype, true)) r.alloc(bytes);
  } else if (s.cudnn_attention()) {
    // cuDNN: the fast form (the default without determinism), exact plans, d_q overwritten.
    const bool split = causal && cudnn_splits_prefix(s.c(), S);
    const bool stacked = causal && cudnn_stacks_gqa(s.c(), S, d.H, d.Hkv);
    const size_t workspace = cudnn_attention_backward_workspace(d);
    r.attention_workspace = std::max(r.attention_workspace, workspace);
    for (size_t bytes : cudnn_attention_backward_scratch(d, S, true, false, split, stacked).requests(workspace))
      r.alloc(bytes);
  } else {
    for (size_t bytes : flash_attention_backward_scratch(d, s.tensor_core_flash(), false)) r.alloc(bytes);
  }
}

// The LM head with its loss over the chunk's rows (engine/ops/lm_head_loss.h): its logits block.
void lm_head(Requests& r, const Chunk& s) {
  Scope scope(r);
  r.alloc(lm_head_scratch_bytes(s.device, s.N(), s.cf.vocab_size, s.e(), kLmHeadBlockRows));
}

// ---- model/kv_store.cpp: a chunk's attention against the store ----

// attend_forward: one call against keys [first_key(), t1) (the layer's sliding window's; else 0);
// streamed, the chunk's own block causal, then each earlier block within the window unmasked (the
// first cut at the window's start), merged in the accumulation dtype (the blocks' calls take the
// same scratch: the largest, the block just before the chunk's, stands for all).
int64_t largest_prefix_block(const Chunk& s) {
  return s.t0 - std::max(s.t0 - s.stream_block, s.first_key());
}
void attend_forward(Requests& r, const Chunk& s) {
  if (s.stream_block == 0) return attention_forward(r, s, s.t1 - s.first_key(), true);
  attention_forward(r, s, s.c(), true);
  if (s.first_key() / s.stream_block == s.t0 / s.stream_block) return;
  Scope scope(r);
  r.alloc(s.stat(s.cf.q_dim()));  // the merged output
  r.alloc(s.row(s.cf.q_dim()));   // a block's output
  r.alloc(s.stat(s.cf.num_attention_heads));  // a block's lse
  attention_forward(r, s, largest_prefix_block(s), false);
}

// attend_backward: streamed, dQ summed over the blocks in the accumulation dtype beside a block's dQ.
void attend_backward(Requests& r, const Chunk& s) {
  if (s.stream_block == 0) return attention_backward(r, s, s.t1 - s.first_key(), true);
  attention_backward(r, s, s.c(), true);
  if (s.first_key() / s.stream_block == s.t0 / s.stream_block) return;
  Scope scope(r);
  r.alloc(s.stat(s.cf.q_dim()));  // dQ summed
  r.alloc(s.row(s.cf.q_dim()));   // a block's dQ
  attention_backward(r, s, largest_prefix_block(s), false);
}

// ---- model/layer.cpp ----

int64_t linear_in(const LlamaConfig& cf, ParamRole linear) {
  return linear == ParamRole::wo ? cf.q_dim() : linear == ParamRole::w_down ? cf.intermediate_size : cf.hidden_size;
}

// A block linear over `rows` rows: with an adapter, engine/ops/lora_linear.cpp's scratch: forward
// drop(x) [rows, in] (with dropout) and u [rows, r]; backward drop(x), g and u [rows, r], and
// drop(g A) [rows, in] (with dropout). Without one, a plain linear takes none.
void linear(Requests& r, const Chunk& s, ParamRole role, int64_t rows, bool backward) {
  if (!s.lora) return;
  const std::vector<ParamRole> targets = s.lora->target_roles();
  if (std::find(targets.begin(), targets.end(), role) == targets.end()) return;
  const bool dropout = s.lora->dropout > 0;
  const size_t in_bytes = static_cast<size_t>(rows * linear_in(s.cf, role)) * s.e();
  const size_t r_bytes = static_cast<size_t>(rows * s.lora->rank) * s.e();
  Scope scope(r);
  if (dropout) r.alloc(in_bytes);  // drop(x)
  r.alloc(r_bytes);                // forward: u; backward: g
  if (!backward) return;
  r.alloc(r_bytes);                  // u
  if (dropout) r.alloc(in_bytes);    // drop(g A)
}

// LayerActivations::allocate.
void layer_activations(Requests& r, const Chunk& s, MlpKept mlp) {
  const LlamaConfig& cf = s.cf;
  r.alloc(s.row(cf.hidden_size));              // h1
  r.alloc(s.stat(1));                          // rstd
  r.alloc(s.row(cf.q_dim()));                  // q
  if (cf.qk_norm) {
    r.alloc(s.row(cf.q_dim()));                // q_raw
    r.alloc(s.row(cf.kv_dim()));               // k_raw
    r.alloc(s.stat(cf.num_attention_heads));   // the per-head norms' rstd
    r.alloc(s.stat(cf.num_key_value_heads));
  }
  r.alloc(s.row(cf.q_dim()));                  // attn (under CP the chunk's tokens of H/cp heads: as many values)
  if (s.cp > 1) r.alloc(s.row(cf.q_dim()));    // attn_rows, the rank's tokens of every head
  r.alloc(s.stat(cf.num_attention_heads));     // lse
  r.alloc(s.row(cf.hidden_size));              // x_mid
  if (mlp != MlpKept::products) r.alloc(s.row(cf.hidden_size));  // h2
  r.alloc(s.stat(1));                          // rstd
  if (mlp != MlpKept::input)
    for (int i = 0; i < (mlp == MlpKept::all ? 3 : 2); ++i) r.alloc(s.row(cf.intermediate_size));  // gate, up, act
  if (!cf.post_norms) return;
  for (int i = 0; i < 2; ++i) {
    r.alloc(s.row(cf.hidden_size));  // the attention's, then the MLP's output before its post-norm
    r.alloc(s.stat(1));              // the post-norm's rstd
  }
}

std::vector<int64_t> shard_rows(int64_t N, int64_t shards) {
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < shards; ++i) rows.push_back(N * (i + 1) / shards - N * i / shards);
  return rows;
}

// mlp_rows_forward's linears (gate, up) over `rows` rows.
void mlp_rows_forward(Requests& r, const Chunk& s, int64_t rows) {
  linear(r, s, ParamRole::w_gate, rows, false);
  linear(r, s, ParamRole::w_up, rows, false);
}

void mlp_rows_backward(Requests& r, const Chunk& s, int64_t rows) {
  const size_t ffn = static_cast<size_t>(rows * s.cf.intermediate_size) * s.e();
  Scope scope(r);
  r.alloc(ffn);  // d_act
  linear(r, s, ParamRole::w_down, rows, true);
  r.alloc(ffn);  // d_gate
  r.alloc(ffn);  // d_up
  linear(r, s, ParamRole::w_gate, rows, true);
  linear(r, s, ParamRole::w_up, rows, true);
}

// How a block's forward runs: keep, the chunk's activations are given, holding `kept` of the MLP
// (false: a prefill's, in scratch); from_saved, the attention output is read from the store (no K/V
// projections, no attention); output false, a recompute for the backward alone (no W_down product).
struct BlockRun {
  bool keep = false;
  MlpKept kept = MlpKept::all;
  int64_t mlp_shards = 1;
  bool from_saved = false;
  bool output = true;
};

void block_forward(Requests& r, const Chunk& s, const BlockRun& run) {
  const LlamaConfig& cf = s.cf;
  const int64_t N = s.N();
  Scope scope(r);
  const int64_t shards = resolve_mlp_shards(run.mlp_shards, cf, N);
  const MlpKept mlp = run.keep ? run.kept : shards == 1 ? MlpKept::all : MlpKept::input;
  if (!run.keep) layer_activations(r, s, mlp);
  if (!run.from_saved && s.fused) {
    r.alloc(s.row(cf.q_dim() + 2 * cf.kv_dim()));  // q, k, v side by side
    if (cf.qk_norm) {
      r.alloc(s.row(cf.q_dim()));   // q normed
      r.alloc(s.row(cf.kv_dim()));  // k normed
    }
  } else {
    r.alloc(s.row(cf.q_dim()));  // q_pre
    linear(r, s, ParamRole::wq, N, false);
  }
  if (run.from_saved && cf.qk_norm) {  // the chunk's k and its norm's statistics, for the norm's backward
    r.alloc(s.row(cf.kv_dim()));
    linear(r, s, ParamRole::wk, N, false);
  }
  if (!run.from_saved) {
    if (!s.fused) {
      r.alloc(s.row(cf.kv_dim()));  // k_pre
      linear(r, s, ParamRole::wk, N, false);
      if (s.cp > 1) r.alloc(s.kv_heads_bytes());  // store_rows: k of the rank's heads
      r.alloc(s.row(cf.kv_dim()));  // v
      linear(r, s, ParamRole::wv, N, false);
      if (s.cp > 1) r.alloc(s.kv_heads_bytes());  // store_rows: v of the rank's heads
    }
    attend_forward(r, s);
  }
  r.alloc(s.row(cf.hidden_size));  // o
  linear(r, s, ParamRole::wo, N, false);
  if (cf.post_norms) r.alloc(s.row(cf.hidden_size));  // the post-norm's output
  const size_t ffn = static_cast<size_t>(N * cf.intermediate_size) * s.e();
  if (mlp == MlpKept::products) r.alloc(s.row(cf.hidden_size));  // h2, not kept
  const bool gate = mlp != MlpKept::input;                         // gate and up are in the activations
  // A recompute for the backward alone skips W_down's product, unless the post-norm's backward reads it.
  if (!run.output && !cf.post_norms) {
    if (!gate) return;
    if (mlp != MlpKept::all) r.alloc(ffn);  // act, not kept
    return mlp_rows_forward(r, s, N);
  }
  r.alloc(s.row(cf.hidden_size));  // m
  if (gate) {
    if (mlp != MlpKept::all) r.alloc(ffn);  // act
    mlp_rows_forward(r, s, N);
    linear(r, s, ParamRole::w_down, N, false);
  } else {
    // Tiled: one shard's [rows, F] gate, up and act at a time.
    for (const int64_t rows : shard_rows(N, shards)) {
      Scope shard(r);
      for (int i = 0; i < 3; ++i) r.alloc(static_cast<size_t>(rows * cf.intermediate_size) * s.e());
      mlp_rows_forward(r, s, rows);
      linear(r, s, ParamRole::w_down, rows, false);
    }
  }
  if (cf.post_norms) r.alloc(s.row(cf.hidden_size));  // the post-norm's output
}

void block_backward(Requests& r, const Chunk& s, MlpKept mlp, int64_t mlp_shards) {
  const LlamaConfig& cf = s.cf;
  const int64_t N = s.N();
  Scope scope(r);
  if (cf.post_norms) r.alloc(s.row(cf.hidden_size));  // d(m), from the post-norm's backward
  r.alloc(s.row(cf.hidden_size));  // d(h2)
  if (mlp != MlpKept::input) {
    mlp_rows_backward(r, s, N);
  } else {
    // Tiled: each shard's gate, up and act recomputed from the kept h2, then its backward.
    for (const int64_t rows : shard_rows(N, resolve_mlp_shards(mlp_shards, cf, N))) {
      Scope shard(r);
      for (int i = 0; i < 3; ++i) r.alloc(static_cast<size_t>(rows * cf.intermediate_size) * s.e());
      mlp_rows_forward(r, s, rows);
      mlp_rows_backward(r, s, rows);
    }
  }
  if (cf.post_norms) r.alloc(s.row(cf.hidden_size));  // d(o), from the post-norm's backward
  r.alloc(s.row(cf.q_dim()));  // d_attn
  linear(r, s, ParamRole::wo, N, true);
  if (s.cp > 1) r.alloc(s.row(cf.q_dim()));  // d_attn of the rank's heads
  r.alloc(s.row(cf.q_dim()));  // d_q
  attend_backward(r, s);
  if (s.cp > 1) r.alloc(s.row(cf.q_dim()));  // d_q of the rank's tokens
  if (s.fused) {
    r.alloc(s.row(cf.q_dim() + 2 * cf.kv_dim()));  // d(q, k, v) side by side
    if (cf.qk_norm) r.alloc(s.row(cf.kv_dim()));    // d_k, packed for the norm's backward
  } else {
    r.alloc(s.row(cf.kv_dim()));  // d_k
    r.alloc(s.row(cf.kv_dim()));  // d_v
    if (s.cp > 1)
      for (int i = 0; i < 2; ++i) {  // read_store_grad: dK, dV of the rank's heads (replicas: summed in acc)
        if (!s.kv_replicated()) {
          r.alloc(s.kv_heads_bytes());
        } else {
          r.alloc(s.kv_heads_bytes() / s.e() * s.acc());
          r.alloc(s.stat(s.cf.kv_dim()));  // the replicas' sum, the rank's tokens
        }
      }
  }
  r.alloc(s.row(cf.hidden_size));  // d(h1)
  if (s.fused) return;
  linear(r, s, ParamRole::wq, N, true);
  linear(r, s, ParamRole::wk, N, true);
  linear(r, s, ParamRole::wv, N, true);
}

// ---- model/llama.cpp and optim/chunks.cpp: a chunk through the model ----

// The sliding windows of layers [0, L - skip_last) in the order a pass meets them (the forward's from
// layer 0, the backward's from the last), each once. A layer's requests depend on the chunk and its
// window alone (the layers of a Llama or a Mistral make the same; Gemma 2's sliding and global layers
// two kinds), and every layer's start from the same place in the arena: a layer whose window one
// before it in the pass had makes that layer's requests from there, lands where it did and takes
// nothing new (replay_step_arena says why), so one layer of each window stands for all of them.
std::vector<int64_t> pass_windows(const LlamaConfig& cf, bool forward, int64_t skip_last = 0) {
  std::vector<int64_t> windows;
  const int64_t n = cf.num_hidden_layers - skip_last;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t w = cf.layer_window(forward ? i : n - 1 - i);
    if (std::find(windows.begin(), windows.end(), w) == windows.end()) windows.push_back(w);
  }
  return windows;
}

// slice_chunk: one sequence's chunk is a view of the step's tokens; several sequences' are copied.
void chunk_tokens(Requests& r, const Chunk& s) {
  if (s.B == 1) return;
  r.alloc(static_cast<size_t>(s.N()) * 4);  // ids
  r.alloc(static_cast<size_t>(s.N()) * 4);  // labels
}

// prefill's chunk: forward_chunk keeping nothing (the blocks ping-pong between two residual-stream
// buffers; every layer's scratch is the same), with its loss when with_loss.
Requests prefill_chunk(const Chunk& s, int64_t mlp_shards, bool with_loss) {
  const LlamaConfig& cf = s.cf;
  Requests r;
  Scope scope(r);
  chunk_tokens(r, s);
  Scope forward(r);
  r.alloc(s.row(cf.hidden_size));  // ping
  r.alloc(s.row(cf.hidden_size));  // pong
  r.alloc(s.row(cf.hidden_size));  // normed
  r.alloc(s.stat(1));              // rstd
  for (const int64_t w : pass_windows(cf, true))
    block_forward(r, s.in_layer_of(w), {.keep = false, .mlp_shards = mlp_shards});
  if (with_loss) {
    r.alloc(s.stat(1));  // row_loss
    lm_head(r, s);
  }
  return r;
}

// How a chunk of the reverse sweep runs: its forward reads saved attention outputs where the prefill
// wrote them; the backward's recomputes read them whenever the store keeps them.
struct ReverseChunk {
  const ActivationPolicy& policy;
  bool forward_from_saved, backward_from_saved;
  bool from_store;  // backward_chunk_from_store: the prefill saved its layer inputs
};

// ChunkBackward's head: d(normed) and the LM head's logits block.
void head_backward(Requests& r, const Chunk& s) {
  Scope head(r);
  r.alloc(s.row(s.cf.hidden_size));  // d_normed
  lm_head(r, s);
}

// backprop_chunk: ChunkActivations, the forward keeping them, then backward_chunk.
Requests backprop_chunk(const Chunk& s, const ReverseChunk& rc, StepArena& out) {
  const LlamaConfig& cf = s.cf;
  const ActivationPolicy& p = rc.policy;
  const MlpKept mlp = mlp_kept(p, cf, s.N());
  Requests r;
  Scope scope(r);
  chunk_tokens(r, s);
  if (p.offload_inputs) {
    r.alloc(s.row(cf.hidden_size));  // x_L; the other layers' inputs in two residency slots
    out.input_slots.assign(2, s.row(cf.hidden_size));
  } else {
    for (int64_t l = 0; l <= cf.num_hidden_layers; ++l) r.alloc(s.row(cf.hidden_size));  // the stream
  }
  if (p.keep_layers)
    for (int64_t l = 0; l < cf.num_hidden_layers; ++l) layer_activations(r, s, mlp);
  r.alloc(s.row(cf.hidden_size));  // normed
  r.alloc(s.stat(1));              // rstd
  // run_blocks: a policy that keeps no layer's activations runs its forward as a prefill's.
  for (const int64_t w : pass_windows(cf, true))
    block_forward(r, s.in_layer_of(w), {.keep = p.keep_layers, .kept = mlp, .mlp_shards = p.mlp_shards,
                                        .from_saved = rc.forward_from_saved});
  Scope backward(r);
  r.alloc(s.stat(1));              // row_loss
  r.alloc(s.row(cf.hidden_size));  // d_x
  head_backward(r, s);
  for (const int64_t w : pass_windows(cf, false)) {
    const Chunk l = s.in_layer_of(w);
    if (p.keep_layers) {
      block_backward(r, l, mlp, p.mlp_shards);
      continue;
    }
    Scope layer(r);
    layer_activations(r, l, mlp);
    block_forward(r, l, {.keep = true, .kept = mlp, .mlp_shards = p.mlp_shards,
                         .from_saved = rc.backward_from_saved, .output = false});
    block_backward(r, l, mlp, p.mlp_shards);
  }
  return r;
}

// backward_chunk_from_store: per layer its saved input (packed for several sequences) and one
// layer's activations; the last layer's recompute also gives x_L, its final norm and the LM head;
// the other layers' recompute skips W_down's product and is the same for each of one window.
Requests backprop_chunk_from_store(const Chunk& s, const ReverseChunk& rc) {
  const LlamaConfig& cf = s.cf;
  const ActivationPolicy& p = rc.policy;
  const MlpKept mlp = mlp_kept(p, cf, s.N());
  Requests r;
  Scope scope(r);
  chunk_tokens(r, s);
  Scope backward(r);
  r.alloc(s.stat(1));              // row_loss
  r.alloc(s.row(cf.hidden_size));  // d_x
  std::vector<std::pair<bool, int64_t>> layers{{true, cf.layer_window(cf.num_hidden_layers - 1)}};
  for (const int64_t w : pass_windows(cf, false, 1)) layers.emplace_back(false, w);
  for (const auto& [last, w] : layers) {
    const Chunk l = s.in_layer_of(w);
    Scope layer(r);
    if (l.B > 1) r.alloc(l.row(cf.hidden_size));  // the input, packed
    layer_activations(r, l, mlp);
    if (last) {
      Scope head(r);
      r.alloc(l.row(cf.hidden_size));  // x_L
      block_forward(r, l, {.keep = true, .kept = mlp, .mlp_shards = p.mlp_shards,
                           .from_saved = rc.backward_from_saved});
      r.alloc(l.row(cf.hidden_size));  // normed
      r.alloc(l.stat(1));              // rstd
      head_backward(r, l);
    } else {
      block_forward(r, l, {.keep = true, .kept = mlp, .mlp_shards = p.mlp_shards,
                           .from_saved = rc.backward_from_saved, .output = false});
    }
    block_backward(r, l, mlp, p.mlp_shards);
  }
  return r;
}

bool chunked(const ScheduleOptions& o) { return o.chunked(); }

// What a chunk's requests depend on but the keys its attention spans: chunks of one form make the
// same requests but for those whose size grows with the span (the CPU's score blocks, cuDNN's
// backward dK, dV and workspace).
enum class ChunkKind { prefill, backprop, from_store };  // prefill_chunk, backprop_chunk, ..._from_store
struct ChunkForm {
  ChunkKind kind = ChunkKind::prefill;
  int64_t c = 0;
  bool forward_from_saved = false, first_block = false, split = false, stacked = false;
  auto operator<=>(const ChunkForm&) const = default;
};

ChunkForm form_of(ChunkKind kind, const Chunk& s, bool forward_from_saved) {
  ChunkForm f{kind, s.c(), forward_from_saved, s.stream_block > 0 && s.t0 < s.stream_block, false, false};
  if (s.stream_block == 0) {
    f.split = cudnn_splits_prefix(s.c(), s.t1);
    f.stacked = cudnn_stacks_gqa(s.c(), s.t1, s.cf.num_attention_heads, s.cf.num_key_value_heads);
  }
  return f;
}

// The keys a chunk's scratch grows with: on the CPU all it attends; on a GPU its backward's (cuDNN's
// forward scratch does not grow with them, the flash kernels' takes none of that size); streamed,
// none (each call spans one block).
int64_t span_of(const Chunk& s, bool backward) {
  if (s.stream_block > 0) return 0;
  if (s.device.is_cpu()) return s.t1;
  return backward && s.dtype == DType::bf16 ? s.t1 : 0;
}
}  // namespace

StepArena replay_step_arena(const StepArenaInputs& in) {
  const LlamaConfig& cf = in.config;
  const ScheduleOptions& o = in.schedule;
  const int64_t B = in.B, T = in.T;
  StepArena out;
  ArenaReplay arena(in.block_bytes != 0 ? in.block_bytes
                                        : in.device.is_cpu() ? kHostArenaBlockBytes : kDeviceArenaBlockBytes);
  arena.log_blocks_to(&out.block_lines);
  // StepFrame: the batch's ids and labels (and packed documents' starts) uploaded once (a GPU's; the
  // CPU reads the batch's own), and the step's loss rows (model/llama.h LossRows, f64).
  if (!in.device.is_cpu()) {
    arena.alloc(static_cast<size_t>(B * T) * 4);
    arena.alloc(static_cast<size_t>(B * T) * 4);
    if (in.documents) arena.alloc(static_cast<size_t>(B * T) * 4);
  }
  arena.alloc(static_cast<size_t>(B * T) * 8);

  const LoraConfig* lora = in.lora.enabled() ? &in.lora : nullptr;
  // A tensor-parallel rank (plan --tp, its shard's config) does not fuse (model/layer.h); counted as
  // fused, its d(q, k, v) is one [N, q_dim] more than its d_k and d_v: an over-estimate.
  const bool fused = fuses_qkv(lora, nullptr) && in.cp == 1;
  const bool is_chunked = chunked(o);
  const int64_t stream_block = is_chunked ? o.stream_block(T) : 0;
  const auto chunk = [&](int64_t t0, int64_t t1) {
    return Chunk{cf, B, t0, t1, in.dtype, lora, in.device, stream_block, fused, 0, in.cp};
  };
  // Each chunk's requests reach the arena unless a chunk of its form already did with at least its
  // span: then each of its requests is at most the other's, and replayed from any later state it
  // lands at or before where the other's did, in the same blocks (blocks are only ever added after
  // them), so it takes no new block and reaches no higher (the bytes in use are a function of that
  // place). So the reverse sweep's chunks after the first of each form, which attend fewer keys, and
  // a GPU prefill's repeated chunks need not be replayed.
  std::map<ChunkForm, int64_t> widest;
  const auto take = [&](const ChunkForm& form, int64_t span, const auto& requests) {
    const auto it = widest.find(form);
    if (it != widest.end() && span <= it->second) return;
    const Requests r = requests();
    out.attention_workspace = std::max(out.attention_workspace, r.attention_workspace);
    apply(arena, r);
    widest[form] = span;
  };

  const ActivationPolicy policy = activation_policy(o, in.lora);
  if (!is_chunked) {
    const Chunk whole = chunk(0, T);
    take(form_of(ChunkKind::backprop, whole, false), span_of(whole, true),
         [&] { return backprop_chunk(whole, {policy, false, false, false}, out); });
  } else {
    const std::vector<int64_t> sweep = chunk_bounds(T, o.bwd_chunk > 0 ? o.bwd_chunk : o.chunk);
    // The prefill (optim/seco.cpp, spaco.cpp): seco's stops where its last reverse chunk starts,
    // unless it saves layer inputs; spaco's runs all T (it reports every chunk's loss).
    const int64_t until = o.kind == ScheduleKind::seco && !o.save_inputs ? sweep[sweep.size() - 2] : T;
    const std::vector<int64_t> prefill = until > 0 ? chunk_bounds(until, o.chunk) : std::vector<int64_t>{};
    for (size_t i = 0; i + 1 < prefill.size(); ++i) {
      const Chunk s = chunk(prefill[i], prefill[i + 1]);
      take(form_of(ChunkKind::prefill, s, false), span_of(s, false),
           [&] { return prefill_chunk(s, o.mlp_shards, o.kind == ScheduleKind::spaco); });
    }
    for (size_t i = sweep.size() - 1; i-- > 0;) {
      const int64_t t0 = sweep[i], t1 = sweep[i + 1];
      const ReverseChunk rc{policy, o.save_attention && t1 <= until, o.save_attention, o.save_inputs && t1 <= until};
      const Chunk s = chunk(t0, t1);
      const ChunkKind kind = rc.from_store ? ChunkKind::from_store : ChunkKind::backprop;
      take(form_of(kind, s, rc.forward_from_saved), span_of(s, true), [&] {
        return rc.from_store ? backprop_chunk_from_store(s, rc) : backprop_chunk(s, rc, out);
      });
    }
  }
  out.high_water = arena.high_water();
  out.blocks = arena.blocks();
  return out;
}

}  // namespace cw
