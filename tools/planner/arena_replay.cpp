#include "tools/planner/arena_replay.h"

#include "engine/engine.h"
#include "engine/memory.h"
#include "model/layer.h"
#include "model/llama.h"
#include "optim/chunks.h"

#include <algorithm>

namespace cw {

namespace {
constexpr size_t kArenaBlockBytes = kDeviceArenaBlockBytes;  // the engine's own sizes (engine.h)
constexpr size_t kArenaAlign = kMemoryAlignBytes;
size_t round_to(size_t n, size_t q) { return (n + q - 1) / q * q; }
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
  const std::vector<size_t>& blocks() const { return blocks_; }
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
    // The workspace (split, no less than the shared plan's over all S keys: attention_cudnn.cu).
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
}  // namespace

size_t StepArena::reserved() const {
  size_t n = 0;
  for (size_t b : blocks) n += b;
  return n;
}

StepArena replay_step_arena(const StepArenaInputs& in) {
  const LlamaConfig& cf = in.config;
  const ScheduleOptions& o = in.schedule;
  const int64_t B = in.B, T = in.T;
  const size_t e = dtype_size(in.dtype), acc = dtype_size(accum_dtype(in.dtype));
  const int64_t chunk = chunked(o) && o.chunk > 0 ? std::min(o.chunk, T) : T;
  const int64_t bwd_chunk = chunked(o) && o.bwd_chunk > 0 ? std::min(o.bwd_chunk, T) : chunk;
  const bool inputs = chunked(o) && o.save_inputs, saved = chunked(o) && o.save_attention;
  const bool streamed = chunked(o) && o.stream_kv;
  const int64_t prefill_end = o.name == "seco" && !inputs ? (T + bwd_chunk - 1) / bwd_chunk * bwd_chunk - bwd_chunk
                              : chunked(o)                ? T
                                                          : 0;
  // The arena over the step, the backward chunk that attends all T keys last (the arena keeps its
  // largest extent, so the order of phases does not matter).
  StepArena out;
  const ActivationPolicy policy = activation_policy(o, in.lora);
  ArenaReplay arena;
  arena.log_blocks_to(&out.block_lines);
  const LoraConfig* adapters = in.lora.enabled() ? &in.lora : nullptr;
  const int64_t keys = streamed ? chunk : T;  // the most keys one attention call sees
  // A tensor-parallel rank does not fuse (model/layer.h); counted as fused it is given a d(q, k, v) of
  // one [N, q_dim] more than its d_k and d_v: an over-estimate.
  const bool fused = fuses_qkv(adapters, nullptr);
  arena.alloc(size_t(B * T) * 4);  // optim/chunks.cpp step_tokens: the step's ids and labels, uploaded once
  arena.alloc(size_t(B * T) * 4);
  arena.alloc(size_t(B * T) * 8);  // the step's loss rows (model/llama.h LossRows, f64)
  if (prefill_end > 0)
    prefill_chunk(arena, Shape{cf, B, std::min(chunk, prefill_end), keys, e, acc, adapters, streamed, fused},
                  o.mlp_shards, o.name == "spaco");
  if (inputs)
    backprop_chunk_from_store(arena, Shape{cf, B, bwd_chunk, keys, e, acc, adapters, streamed, fused}, policy, saved);
  else
    backprop_chunk(arena, Shape{cf, B, bwd_chunk, keys, e, acc, adapters, streamed, fused}, policy, saved);
  out.attention_workspace = attention_backward_workspace(cf, B, keys);
  out.blocks = arena.blocks();
  return out;
}

}  // namespace cw
