// The K/V store: every layer's post-RoPE keys and values for every processed token, and their
// gradient accumulators.
//
// Layout: per layer, separate buffers K, V [B, T, Hkv, D] (the grouped heads, never expanded) in the
// compute dtype, and dK, dV of the same shape in the accumulation dtype (f64 in f64 mode, f32
// otherwise). A range of token positions [t0, t1) of a layer is a view with batch stride T*Hkv*D,
// which the attention op accepts directly. Ranges are tracked: `release_from(t)` marks tokens [t, T)
// as released (SeCO's reverse sweep is done with them), after which a view that touches them is an
// error, so a schedule that reads what it has already given up is caught in tests.
//
// Who writes what (SeCO): the prefill writes K, V of each chunk; the reverse sweep's recompute
// rewrites the chunk's own K, V; each chunk's attention backward ADDS into dK, dV over [0, p+c);
// the chunk then reads dK, dV over its own [p, p+c) (local plus everything later chunks added).
//
// Its modes (KVStoreOptions). What it keeps beside K and V, written by the prefill for the reverse
// sweep:
//   attention_outputs  per layer the attention output O [B, T, H, D] and its lse [B*H, T]. A query's
//                      output depends only on keys at or before it, so it is the same whatever the
//                      chunking; the recompute reads it back instead of attending again (and needs
//                      neither earlier K, V nor the chunk's own K/V projections).
//   layer_inputs       per layer its input x_l [B, T, C]: a reverse chunk then runs no forward pass,
//                      each layer recomputed from its input just before its backward
//                      (model/llama.h backward_chunk_from_store). Not with a streamed store.
// How it keeps the gradients:
//   layer_local_grads  when one backward chunk covers all T tokens, a layer's dK, dV are added and
//                      read back within its own backward: one layer's accumulators serve every
//                      layer, zeroed as each layer's backward begins (on the device only).
// Where it lives (model/kv_residency.h moves it; saved outputs and inputs go with their layer's K/V):
//   on the device      (the default) every buffer on `device`; begin_layer / end_layer do nothing.
//   offload_window W   the layers in pinned host memory, W device slots holding those in use.
//   stream_block Kb    host memory in blocks of Kb tokens, three device slots, the attention run
//                      block by block; device memory does not grow with T. A view then lies within
//                      one block (batch stride Kb*Hkv*D) and needs that block resident.
#pragma once

#include "engine/memory.h"
#include "engine/ops/attention.h"
#include "model/config.h"
#include "model/kv_residency.h"

#include <memory>
#include <vector>

namespace cw {

// What a store holds beside K and V, and where it lives (above). Call sites name what they set:
// KVStore(config, B, T, dtype, {.with_grads = true, .offload_window = 2}).
struct KVStoreOptions {
  bool with_grads = false;          // the accumulators dK, dV (a training step; evaluation needs none)
  Device device = Device::host();   // where attention reads the store: host memory or one GPU's
  int64_t offload_window = 0;       // W > 0 (below the layer count): offloaded, W layers on the device
  int64_t stream_block = 0;         // Kb > 0: streamed in blocks of Kb tokens (not with a window)
  bool attention_outputs = false;   // saved attention outputs (needs with_grads)
  bool layer_inputs = false;        // saved layer inputs (needs with_grads; not streamed)
  bool layer_local_grads = false;   // one layer's dK, dV for all layers (no window, not streamed)
  bool operator==(const KVStoreOptions&) const = default;
};

class KVStore {
 public:
  KVStore(const LlamaConfig& config, int64_t batch, int64_t tokens, DType dtype, const KVStoreOptions& options = {});
  ~KVStore();

  Tensor keys(int layer, int64_t t0, int64_t t1) const { return view(kKeys, layer, t0, t1); }
  Tensor values(int layer, int64_t t0, int64_t t1) const { return view(kValues, layer, t0, t1); }
  Tensor d_keys(int layer, int64_t t0, int64_t t1) const { return view(kDKeys, layer, t0, t1); }
  Tensor d_values(int layer, int64_t t0, int64_t t1) const { return view(kDValues, layer, t0, t1); }
  // Saved attention outputs (has_outputs()): O [B, t1-t0, H, D] (batch stride T*H*D) and lse
  // [B*H, t1-t0] (row stride T), to be copied to or from the attention op's [B, c, H, D] / [B, H, c].
  Tensor outputs(int layer, int64_t t0, int64_t t1) const;
  Tensor output_lse(int layer, int64_t t0, int64_t t1) const;
  // Saved layer inputs (has_inputs()): x_l [B, t1-t0, C] (batch stride T*C).
  Tensor inputs(int layer, int64_t t0, int64_t t1) const;

  // The named points of the layer loops around each layer, for a chunk of tokens [t0, t1) (KVUse,
  // model/kv_residency.h, says what each reads and writes): offloaded or streamed, begin_layer
  // brings in what the layer reads (and prefetches the next), end_layer sends home what it wrote.
  using Use = KVUse;
  void begin_layer(int layer, Use use, int64_t t0, int64_t t1);
  void end_layer(int layer, Use use, int64_t t0, int64_t t1);

  // The attention of the chunk [t0, t1)'s queries against keys [0, t1) of `layer` (between
  // begin_layer and end_layer of Use::forward / backward): one call, or streamed block by block.
  // Shapes and saved values as attention_forward / attention_backward (d_q overwritten; dK, dV of
  // keys [0, t1) added into the accumulators).
  // doc_starts (packed documents, engine/ops/attention.h): each query attends only keys of its own
  // document (streamed: only the blocks its documents reach are fetched). The layer's sliding window
  // (config layer_window, W): the calls read only keys [first_key(layer, t0), t1) (below), each query
  // its own W; not with documents in a streamed store. The model's score cap (config
  // attn_logit_softcapping) goes to every call. first_keys: the step's document starts on the device
  // for the one-call form (engine/ops/attention.h attention_forward_documents), or empty.
  void attend_forward(int layer, int64_t t0, int64_t t1, const Tensor& out, const AttentionSaved& saved,
                      const Tensor& q, double scale, Arena& scratch,
                      const std::vector<std::vector<int64_t>>* doc_starts = nullptr, const Tensor& first_keys = {});
  void attend_backward(int layer, int64_t t0, int64_t t1, const Tensor& d_q, const Tensor& d_out,
                       const AttentionSaved& saved, const Tensor& q, const Tensor& out, double scale, Arena& scratch,
                       const std::vector<std::vector<int64_t>>* doc_starts = nullptr, const Tensor& first_keys = {});

  // The first key a chunk starting at t0 attends in `layer`: t0 - W + 1 under a sliding window of W
  // keys, else 0. The keys before it are neither read nor given gradient by this chunk (the relay
  // stops there).
  int64_t first_key(int layer, int64_t t0) const;
  int64_t window_size(int layer) const { return windows_[static_cast<size_t>(layer)]; }

  void zero_grads();  // layer-local gradients: each layer's backward zeroes them as it begins
  void release_from(int64_t t);  // tokens [t, T) are no longer readable
  void reset();                  // all tokens readable again, gradients zeroed

  // The options as the store applies them: a window of every layer is none, the stream block at
  // most T, layer-local gradients only with gradients.
  const KVStoreOptions& options() const { return options_; }
  int64_t batch() const { return B_; }
  int64_t tokens() const { return T_; }
  bool has_grads() const { return options_.with_grads; }
  bool has_outputs() const { return options_.attention_outputs; }
  bool has_inputs() const { return options_.layer_inputs; }
  bool layer_local_grads() const { return options_.layer_local_grads; }
  int64_t outputs_written() const { return written_.outputs_end; }  // saved outputs exist for tokens [0, this)
  int64_t inputs_written() const { return written_.inputs_end; }    // saved inputs exist for tokens [0, this)
  DType dtype() const { return dtype_; }
  Device device() const { return options_.device; }
  DType grad_dtype() const { return accum_dtype(dtype_); }
  int64_t offload_window() const { return options_.offload_window; }
  int64_t stream_block() const { return options_.stream_block; }
  size_t bytes() const;          // all buffers on `device` (offloaded or streamed: the slots)
  size_t host_bytes() const;     // offloaded or streamed: the host copies of every layer; else 0
  size_t bytes_per_token() const;
  size_t bytes_moved() const;    // host <-> device so far
  // Host bytes a store of these dimensions needs offloaded (for checks before allocating).
  static size_t host_bytes_needed(const LlamaConfig& config, int64_t batch, int64_t tokens, DType dtype,
                                  const KVStoreOptions& options);

 private:
  Tensor view(KVPart part, int layer, int64_t t0, int64_t t1) const;
  void check_range(int layer, int64_t t0, int64_t t1) const;
  struct Rows {
    void* data;
    int64_t n, r0;  // rows a sequence has there, and the first one's
  };
  Rows rows_of(KVPart part, int layer, int64_t t0, int64_t t1) const;

  KVStoreOptions options_;
  KVLayout layout_;
  int64_t L_, B_, T_, H_, Hkv_, D_, C_;
  std::vector<int64_t> windows_;  // each layer's sliding window W (0: none)
  double softcap_;                // the attention scores' cap (0: none)
  DType dtype_;
  KVWritten written_;  // live_end: tokens [0, this) readable
  std::vector<HostBuffer> bufs_[kParts];  // on the device: [part][layer]
  std::unique_ptr<KVWindow> window_;      // offloaded
  std::unique_ptr<KVStream> stream_;      // streamed
};

}  // namespace cw
