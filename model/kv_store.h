// The K/V store: every layer's post-RoPE keys and values for every processed token, and their
// gradient accumulators.
//
// Layout: per layer, separate buffers K, V [B, T, Hkv, D] (the grouped heads, never expanded) in the
// compute dtype, and dK, dV of the same shape in the accumulation dtype (f64 in f64 mode, f32
// otherwise). A range of token positions [t0, t1) of a layer is a view with batch stride T*Hkv*D,
// which the attention op accepts directly. The unit of placement is the layer: each layer's four
// buffers are independent allocations, so a GPU backend can keep a window of layers on the device
// and the rest in pinned host memory, moving one layer ahead of use.
//
// Ranges are tracked: `release_from(t)` marks tokens [t, T) as released (SeCO's reverse sweep is done
// with them), after which a view that touches them is an error, so a schedule that reads what it
// has already given up is caught in tests.
//
// Who writes what (SeCO): the prefill writes K, V of each chunk; the reverse sweep's recompute
// rewrites the chunk's own K, V; each chunk's attention backward ADDS into dK, dV over [0, p+c);
// the chunk then reads dK, dV over its own [p, p+c) (local plus everything later chunks added).
//
// Saved attention outputs (optional, `attention_outputs`): per layer also the attention output O
// [B, T, H, D] in the compute dtype and its log-sum-exp [B*H, T] in the accumulation dtype, written
// by the prefill. A query's output and lse depend only on the keys at or before it, so they are the
// same whatever the chunking; the reverse sweep's recompute then reads them back instead of running
// the attention forward again (and needs neither K, V of earlier tokens nor the chunk's own K, V
// projections). With offload they live with the layer's K/V in host memory and only the chunk's rows
// move.
//
// Saved layer inputs (optional, `layer_inputs`): per layer also its input x_l [B, T, C] (the residual
// stream entering the block) in the compute dtype, written by the prefill. With them a reverse-sweep
// chunk needs no forward pass: each layer is recomputed from its saved input just before its backward
// (model/llama.h backward_chunk_from_store), so one layer's activations are alive at a time and the
// recompute skips what only the next layer reads (W_down's product; with saved attention outputs also
// the K/V projections and the attention). Offloaded with the layer's K/V; only the chunk's rows move.
// Not with a streamed store.
//
// Layer-local gradients (`layer_local_grads`, the store on the device): when one backward chunk
// covers all T tokens (full backprop, or seco with a single reverse chunk), a layer's dK, dV are added
// and read back within that layer's backward and never again, so one layer's accumulators serve every
// layer, zeroed as each layer's backward begins: L - 1 layers' dK, dV fewer.
//
// Streamed (stream_block = Kb > 0): every part lives in host memory in blocks of Kb tokens, one
// residency item per (layer, block), and three device slots hold the blocks in use: the chunk's own
// block and the prefix block being attended, the next one coming in behind it. A chunk must be one
// block ([j Kb, j Kb + c), c <= Kb). attend_forward runs the chunk causally against its own block
// and unmasked against each earlier block, merging their outputs (engine/ops/attention.h); the
// backward runs the blocks in turn with the merged output and lse, each earlier block's dK, dV
// fetched, added to and sent home. Device memory is then three blocks whatever T. A view then lies
// within one block (batch stride Kb*Hkv*D) and needs that block resident.
#pragma once

#include "engine/memory.h"
#include "engine/ops/attention.h"
#include "engine/residency.h"
#include "model/config.h"

#include <functional>
#include <memory>
#include <vector>

namespace cw {

// What a store holds beside K and V, and where it lives (above). Call sites name what they set:
// KVStore(config, B, T, dtype, {.with_grads = true, .offload_window = 2}).
struct KVStoreOptions {
  bool with_grads = false;          // the accumulators dK, dV (a training step; evaluation needs none)
  Device device = Device::host();   // where attention reads the store: host memory or one GPU's
  int64_t offload_window = 0;       // W > 0 (below the layer count): layers in host memory, W on the device
  int64_t stream_block = 0;         // Kb > 0: streamed in blocks of Kb tokens (not with a window)
  bool attention_outputs = false;   // saved attention outputs (needs with_grads)
  bool layer_inputs = false;        // saved layer inputs (needs with_grads; not streamed)
  bool layer_local_grads = false;   // one layer's dK, dV for all layers (no window, not streamed)
  bool operator==(const KVStoreOptions&) const = default;
};

class KVStore {
 public:
  // offload_window W > 0 (and below the layer count): every layer's K, V, dK, dV live in host memory
  // (pinned for a GPU), layer-major, and W device slots hold the layers in use (engine/residency.h);
  // the layer loops call begin_layer / end_layer around each layer, which move what the layer needs
  // and prefetch the next layer in the direction of travel. W = 0: everything on the device, and
  // those calls do nothing.
  KVStore(const LlamaConfig& config, int64_t batch, int64_t tokens, DType dtype, const KVStoreOptions& options = {});

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

  // The named points of the layer loops, for a chunk of tokens [t0, t1):
  //   forward:  the layer reads K, V [0, t0) and writes K, V [t0, t1) (end_layer sends them home);
  //   backward: the layer reads K, V [0, t1) and adds into dK, dV [0, t1) (end_layer sends those home);
  //   recompute: (saved outputs only) the layer reads its saved outputs [t0, t1) and nothing else.
  // With saved outputs, forward also writes O and lse [t0, t1), and backward also reads them; with
  // saved inputs, forward writes the layer's input rows [t0, t1) and backward reads them.
  enum class Use { forward, backward, recompute };
  void begin_layer(int layer, Use use, int64_t t0, int64_t t1);
  void end_layer(int layer, Use use, int64_t t0, int64_t t1);

  // The attention of the chunk [t0, t1)'s queries against keys [0, t1) of `layer` (between
  // begin_layer and end_layer of Use::forward / backward): one call, or streamed block by block.
  // Shapes and saved values as attention_forward / attention_backward (d_q overwritten; dK, dV of
  // keys [0, t1) added into the accumulators).
  // doc_starts (packed documents, engine/ops/attention.h): each query attends only keys of its own
  // document; not with a streamed store.
  void attend_forward(int layer, int64_t t0, int64_t t1, const Tensor& out, const AttentionSaved& saved,
                      const Tensor& q, double scale, Arena& scratch,
                      const std::vector<std::vector<int64_t>>* doc_starts = nullptr);
  void attend_backward(int layer, int64_t t0, int64_t t1, const Tensor& d_q, const Tensor& d_out,
                       const AttentionSaved& saved, const Tensor& q, const Tensor& out, double scale, Arena& scratch,
                       const std::vector<std::vector<int64_t>>* doc_starts = nullptr);

  void zero_grads();  // layer-local gradients: each layer's backward zeroes them as it begins
  void release_from(int64_t t);  // tokens [t, T) are no longer readable
  void reset();                  // all tokens readable again, gradients zeroed

  int64_t batch() const { return B_; }
  int64_t tokens() const { return T_; }
  bool has_grads() const { return with_grads_; }
  bool has_outputs() const { return with_outputs_; }
  bool has_inputs() const { return with_inputs_; }
  bool layer_local_grads() const { return layer_local_grads_; }
  int64_t outputs_written() const { return outputs_end_; }  // saved outputs exist for tokens [0, this)
  int64_t inputs_written() const { return inputs_end_; }    // saved inputs exist for tokens [0, this)
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  DType grad_dtype() const { return accum_dtype(dtype_); }
  int64_t offload_window() const { return res_ && block_ == 0 ? res_->slots() : 0; }
  int64_t stream_block() const { return block_; }
  size_t bytes() const;          // all buffers on `device` (with offload: the window's slots)
  size_t host_bytes() const;     // with offload: the host copies of every layer; else 0
  size_t bytes_per_token() const;
  size_t bytes_moved() const { return res_ ? res_->bytes_moved() : 0; }  // host <-> device so far
  // Host bytes a store of these dimensions needs with offload (for checks before allocating).
  static size_t host_bytes_needed(const LlamaConfig& config, int64_t batch, int64_t tokens, DType dtype,
                                  const KVStoreOptions& options);

 private:
  enum Part { kKeys = 0, kValues = 1, kDKeys = 2, kDValues = 3, kOut = 4, kLse = 5, kIn = 6, kParts = 7 };
  bool has_part(Part part) const;  // K, V always; dK, dV with grads; O, lse with outputs; x_l with inputs
  Tensor view(Part part, int layer, int64_t t0, int64_t t1) const;
  void check_range(int layer, int64_t t0, int64_t t1) const;
  struct Rows {
    void* data;
    int64_t n, r0;  // rows a sequence has there, and the first one's
  };
  Rows rows_of(Part part, int layer, int64_t t0, int64_t t1) const;
  size_t row_bytes(Part part) const;  // one token of one sequence
  size_t part_bytes(Part part) const { return row_bytes(part) * static_cast<size_t>(B_ * T_); }
  // Rows [r0, r1) of parts first..last (streamed: within one block), lse's columns included.
  std::vector<Residency::Span> spans(Part first, Part last, int64_t r0, int64_t r1) const;
  // dK, dV rows [t0, t1) of `layer` to fetch: copied where the home was written, zeroed beyond.
  std::vector<Residency::Span> grad_spans(int layer, int64_t t0, int64_t t1) const;
  void fetch_saved(Part first, Part last, std::pair<int64_t, int64_t>& have, int64_t written, int64_t t0, int64_t t1,
                   std::vector<Residency::Span>& need) const;
  void fetch_outputs(int layer, int64_t t0, int64_t t1, std::vector<Residency::Span>& need);  // O and lse
  void fetch_inputs(int layer, int64_t t0, int64_t t1, std::vector<Residency::Span>& need);   // x_l
  void prefetch(int layer, Use use, int64_t t0, int64_t t1);
  void forget_slot_rows(size_t layer);  // the layer has no slot: none of its rows is on the device
  // Streamed: the residency item of (layer, block), its token rows, and the item fetched with K, V
  // and (`grads`) dK, dV of its home (rows the home has not been written with fetched as zeros).
  int item(int layer, int64_t block) const { return static_cast<int>(layer * blocks_ + block); }
  int64_t block_rows(int64_t block) const { return std::min(block_, T_ - block * block_); }
  int64_t block_of(int64_t t0, int64_t t1) const;  // the block holding [t0, t1) (a range never crosses one)
  void fetch_block(int layer, int64_t block, bool kv, bool grads);
  // The blocks before block j of `layer` in turn, each resident (K, V and, `grads`, dK, dV; block 0
  // fetched by the caller) while the next comes in: visit(item, k0, k1) with its token range.
  void for_prefix_blocks(int layer, int64_t j, bool grads,
                         const std::function<void(int item, int64_t k0, int64_t k1)>& visit);

  int64_t L_, B_, T_, H_, Hkv_, D_, C_;
  DType dtype_;
  Device device_;
  bool with_grads_, with_outputs_, with_inputs_;
  bool layer_local_grads_ = false;
  int64_t live_end_;
  int64_t outputs_end_ = 0, inputs_end_ = 0;
  std::vector<HostBuffer> bufs_[kParts];  // without offload: [part][layer] on `device`
  std::unique_ptr<Residency> res_;        // with offload
  std::vector<int64_t> dev_kv_end_, dev_grad_end_, host_kv_end_;  // rows [0, end) current, per layer
  // Host dK, dV rows [0, end) hold what a backward wrote; the rows beyond are logical zeros (the
  // home is not cleared between steps: fetching them zeroes the device rows instead of copying).
  std::vector<int64_t> host_grad_end_;
  std::vector<std::pair<int64_t, int64_t>> dev_out_, dev_in_;      // saved-output / input rows current in the slot
  // Streamed: the block length (0: not streamed), blocks per layer, and per item whether its home
  // holds K, V and dK, dV written this step.
  int64_t block_ = 0, blocks_ = 0;
  std::vector<char> home_kv_, home_grads_;
};

}  // namespace cw
