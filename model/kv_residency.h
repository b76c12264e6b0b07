// Where the K/V store's buffers live when they do not all stay on the device, and how they move
// (model/kv_store.h has the store and its modes). Both kinds keep every part's home in host memory
// (pinned for a GPU) and a few device slots, over engine/residency.h:
//
// KVWindow (schedule.offload_window = W, below the layer count): the unit is the layer. Its K, V,
// dK, dV (and saved outputs and inputs) live in host memory, layer-major, and W device slots hold the
// layers in use. The layer loops call begin_layer / end_layer around each layer: begin_layer fetches
// what the layer reads and prefetches the next layer in the direction of travel; end_layer sends
// home what it wrote. The window remembers which rows each slot already holds, so a row is copied
// once per visit; the host's dK, dV rows beyond those a backward wrote are logical zeros, zeroed on
// the device instead of copied.
//
// KVStream (schedule.stream_kv, blocks of Kb tokens): the unit is (layer, key block). Three device
// slots hold the chunk's own block and the prefix block being attended, the next one coming in
// behind it. A chunk must be one block ([j Kb, j Kb + c), c <= Kb). Its attention runs causally
// against its own block and unmasked against each earlier block, merging their outputs
// (engine/ops/attention.h); the backward runs the blocks in turn with the merged output and lse,
// each earlier block's dK, dV fetched, added to and sent home. Device memory is then three blocks
// whatever T.
//
// Both are internal to the store, tested through it (tests/optim/test_schedules.cpp's offload and
// streamed cases, tests/model/test_cuda_model.cpp on a GPU, tests/engine/test_trace.cpp's copies).
#pragma once

#include "engine/memory.h"
#include "engine/ops/attention.h"
#include "engine/residency.h"

#include <functional>
#include <utility>
#include <vector>

namespace cw {

class KVStore;

// A store's parts, per layer: K, V, their accumulators dK, dV, the saved attention output O and its
// lse, the saved layer input x_l.
enum KVPart { kKeys = 0, kValues = 1, kDKeys = 2, kDValues = 3, kOut = 4, kLse = 5, kIn = 6, kParts = 7 };

// The named points of the layer loops, for a chunk of tokens [t0, t1):
//   forward:   the layer reads K, V [0, t0) and writes K, V [t0, t1);
//   backward:  the layer reads K, V [0, t1) and adds into dK, dV [0, t1);
//   recompute: (saved outputs only) the layer reads its saved outputs [t0, t1) and nothing else.
// With saved outputs, forward also writes O and lse [t0, t1), and backward also reads them; with
// saved inputs, forward writes the layer's input rows [t0, t1) and backward reads them.
enum class KVUse { forward, backward, recompute };

// The parts' byte geometry: a row is one token of one sequence (of lse: one value per head).
struct KVLayout {
  int64_t L, B, T, H, Hkv, D, C;
  DType dtype;
  bool grads, outputs, inputs;  // which parts beyond K, V the store has

  bool has(KVPart part) const;  // K, V always; dK, dV with grads; O, lse with outputs; x_l with inputs
  size_t row_bytes(KVPart part) const;
  // The spans of rows [r0, r1) of parts first..last in buffers of n rows a sequence (T, or streamed a
  // block's Kb, rows then counted from the block's start): one strided span a part, a row of every
  // sequence (lse: a column of every (sequence, head) row).
  std::vector<Residency::Span> spans(KVPart first, KVPart last, int64_t r0, int64_t r1, int64_t n) const;
};

// What the store has done so far that the residency reads: the tokens still live, and the rows the
// prefill has written saved outputs and inputs for.
struct KVWritten {
  int64_t live_end = 0, outputs_end = 0, inputs_end = 0;
};

// The offload window (above).
class KVWindow {
 public:
  KVWindow(const KVLayout& layout, Device device, int64_t slots);
  void* device(int layer, KVPart part) const { return res_.device(layer, part); }  // the layer's slot
  void begin_layer(int layer, KVUse use, int64_t t0, int64_t t1, const KVWritten& written);
  void end_layer(int layer, KVUse use, int64_t t0, int64_t t1);
  void zero_grads();  // the homes' dK, dV become logical zeros; the slots are forgotten
  void reset();       // nothing is written: K, V rows and saved rows forgotten (then zero_grads)
  int64_t slots() const { return res_.slots(); }
  size_t device_bytes() const { return res_.device_bytes(); }
  size_t host_bytes() const { return res_.host_bytes(); }
  size_t bytes_moved() const { return res_.bytes_moved(); }

 private:
  std::vector<Residency::Span> spans(KVPart first, KVPart last, int64_t r0, int64_t r1) const {
    return layout_.spans(first, last, r0, r1, layout_.T);
  }
  // dK, dV rows [t0, t1) of `layer` to fetch: copied where the home was written, zeroed beyond.
  std::vector<Residency::Span> grad_spans(int layer, int64_t t0, int64_t t1) const;
  void fetch_saved(KVPart first, KVPart last, std::pair<int64_t, int64_t>& have, int64_t written, int64_t t0,
                   int64_t t1, std::vector<Residency::Span>& need) const;
  void fetch_outputs(int layer, int64_t t0, int64_t t1, int64_t written, std::vector<Residency::Span>& need);
  void fetch_inputs(int layer, int64_t t0, int64_t t1, int64_t written, std::vector<Residency::Span>& need);
  void prefetch(int layer, KVUse use, int64_t t0, int64_t t1, const KVWritten& written);
  void forget_slot_rows(size_t layer);  // the layer has no slot: none of its rows is on the device

  KVLayout layout_;
  Residency res_;
  std::vector<int64_t> dev_kv_end_, dev_grad_end_, host_kv_end_;  // rows [0, end) current, per layer
  // Host dK, dV rows [0, end) hold what a backward wrote; the rows beyond are logical zeros (the
  // home is not cleared between steps: fetching them zeroes the device rows instead of copying).
  std::vector<int64_t> host_grad_end_;
  std::vector<std::pair<int64_t, int64_t>> dev_out_, dev_in_;  // saved-output / input rows current in the slot
};

// The streamed store (above).
class KVStream {
 public:
  KVStream(const KVLayout& layout, Device device, int64_t block);
  int64_t block() const { return block_; }                  // Kb
  int64_t block_of(int64_t t0, int64_t t1) const;           // the block holding [t0, t1) (never crossing one)
  void* device(int layer, int64_t block, KVPart part) const { return res_.device(item(layer, block), part); }
  void begin_layer(int layer, KVUse use, int64_t t0, int64_t t1, const KVWritten& written);
  void end_layer(int layer, KVUse use, int64_t t0, int64_t t1);
  void zero_grads();  // every block's dK, dV home becomes logical zeros
  void reset();       // no block's home holds K, V of this step
  // The chunk [t0, t1)'s attention against the store's keys [kv.first_key(layer, t0), t1), block by
  // block (kv's views of the resident blocks), as KVStore::attend_forward / attend_backward; `window`
  // the layer's sliding window (0: none), whose blocks wholly before it are neither fetched nor read;
  // `softcap` the scores' cap (0: none), which every block's call applies. With packed
  // documents (doc_starts, the step's starts; not with a window) each query reads its own document's
  // keys only, and the blocks before the earliest start the chunk's documents reach are neither
  // fetched nor read.
  void attend_forward(const KVStore& kv, int layer, int64_t t0, int64_t t1, const Tensor& out,
                      const AttentionSaved& saved, const Tensor& q, double scale, Arena& scratch, int64_t window,
                      double softcap, const std::vector<std::vector<int64_t>>* doc_starts);
  void attend_backward(const KVStore& kv, int layer, int64_t t0, int64_t t1, const Tensor& d_q, const Tensor& d_out,
                       const AttentionSaved& saved, const Tensor& q, const Tensor& out, double scale, Arena& scratch,
                       int64_t window, double softcap, const std::vector<std::vector<int64_t>>* doc_starts);
  size_t device_bytes() const { return res_.device_bytes(); }
  size_t host_bytes() const { return res_.host_bytes(); }
  size_t bytes_moved() const { return res_.bytes_moved(); }

 private:
  std::vector<Residency::Span> spans(KVPart first, KVPart last, int64_t r0, int64_t r1) const {
    return layout_.spans(first, last, r0, r1, block_);
  }
  // The residency item of (layer, block), and its token rows.
  int item(int layer, int64_t block) const { return static_cast<int>(layer * blocks_ + block); }
  int64_t block_rows(int64_t block) const { return std::min(block_, layout_.T - block * block_); }
  // The item fetched with K, V and (with_grads) dK, dV of its home (rows the home has not been
  // written with fetched as zeros).
  void fetch_block(int layer, int64_t block, bool with_grads);
  // The blocks [first, j) of `layer` in turn, each resident (K, V and, with_grads, dK, dV; block
  // `first` fetched by the caller) while the next comes in: visit(item, k0, k1) with its token range.
  void for_prefix_blocks(int layer, int64_t first, int64_t j, bool with_grads,
                         const std::function<void(int item, int64_t k0, int64_t k1)>& visit);
  // The first key a chunk at t0 reads in `layer`: kv.first_key(layer, t0) (0, or the window's first),
  // or with documents the earliest start of a document that a sequence's query at t0 belongs to.
  static int64_t first_key_read(const KVStore& kv, int layer, int64_t t0,
                                const std::vector<std::vector<int64_t>>* doc_starts);

  KVLayout layout_;
  int64_t block_, blocks_;  // the block length and blocks per layer
  Residency res_;
  // Per item whether its home holds K, V and dK, dV written this step.
  std::vector<char> home_kv_, home_grads_;
};

}  // namespace cw
