#include "model/kv_residency.h"

#include "engine/ops/residual.h"
#include "model/kv_store.h"

#include <algorithm>

namespace cw {

// ---- The parts' geometry ----

bool KVLayout::has(KVPart part) const {
  switch (part) {
    case kKeys: case kValues: return true;
    case kDKeys: case kDValues: return grads;
    case kOut: case kLse: return outputs;
    case kIn: return inputs;
    default: return false;
  }
}

size_t KVLayout::row_bytes(KVPart part) const {
  switch (part) {
    case kKeys: case kValues: return static_cast<size_t>(Hkv * D) * dtype_size(dtype);
    case kDKeys: case kDValues: return static_cast<size_t>(Hkv * D) * dtype_size(accum_dtype(dtype));
    case kOut: return static_cast<size_t>(H * D) * dtype_size(dtype);
    case kIn: return static_cast<size_t>(C) * dtype_size(dtype);
    default: return static_cast<size_t>(H) * dtype_size(accum_dtype(dtype));  // kLse
  }
}

std::vector<Residency::Span> KVLayout::spans(KVPart first, KVPart last, int64_t r0, int64_t r1, int64_t n) const {
  std::vector<Residency::Span> out;
  if (r1 <= r0) return out;
  for (int p = first; p <= last; ++p) {
    const bool lse = p == kLse;  // [B*H, n] of single values
    const size_t unit = lse ? dtype_size(accum_dtype(dtype)) : row_bytes(static_cast<KVPart>(p));
    const int64_t rows = lse ? B * H : B;
    out.push_back({p, static_cast<size_t>(r0) * unit, static_cast<size_t>(r1 - r0) * unit, false,
                   static_cast<size_t>(rows), static_cast<size_t>(n) * unit});
  }
  return out;
}

namespace {
// The residency's part sizes: `rows` rows a sequence of each part the store has, of parts [0, parts).
std::vector<size_t> part_sizes(const KVLayout& layout, int64_t rows, int parts) {
  std::vector<size_t> sizes;
  for (int p = 0; p < parts; ++p) {
    const KVPart part = static_cast<KVPart>(p);
    sizes.push_back(layout.has(part) ? layout.row_bytes(part) * static_cast<size_t>(layout.B * rows) : 0);
  }
  return sizes;
}
}  // namespace

// ---- The offload window ----

KVWindow::KVWindow(const KVLayout& layout, Device device, int64_t slots)
    : layout_(layout),
      res_(device, part_sizes(layout, layout.T, kParts), static_cast<int>(layout.L), static_cast<int>(slots),
           "kv layer") {
  const size_t L = static_cast<size_t>(layout.L);
  dev_kv_end_.assign(L, 0);
  dev_grad_end_.assign(L, 0);
  host_kv_end_.assign(L, 0);
  host_grad_end_.assign(L, 0);
  dev_out_.assign(L, {0, 0});
  dev_in_.assign(L, {0, 0});
}

std::vector<Residency::Span> KVWindow::grad_spans(int layer, int64_t t0, int64_t t1) const {
  const int64_t written = std::clamp(host_grad_end_[static_cast<size_t>(layer)], t0, t1);
  std::vector<Residency::Span> out = spans(kDKeys, kDValues, t0, written);
  for (Residency::Span sp : spans(kDKeys, kDValues, written, t1)) {
    sp.zero = true;
    out.push_back(sp);
  }
  return out;
}

// Adds rows [t0, t1) of a prefill's saved parts first..last to `need` unless the layer's slot holds
// them already (`have`: the rows the slot holds; `written`: the rows the prefill wrote).
void KVWindow::fetch_saved(KVPart first, KVPart last, std::pair<int64_t, int64_t>& have, int64_t written, int64_t t0,
                           int64_t t1, std::vector<Residency::Span>& need) const {
  if (have.first <= t0 && t1 <= have.second) return;
  CW_CHECK(t1 <= written, "saved {} of tokens [{}, {}) were not written (prefill wrote [0, {}))",
           first == kIn ? "layer inputs" : "attention outputs", t0, t1, written);
  const auto s = spans(first, last, t0, t1);
  need.insert(need.end(), s.begin(), s.end());
  have = {t0, t1};
}

void KVWindow::fetch_outputs(int layer, int64_t t0, int64_t t1, int64_t written, std::vector<Residency::Span>& need) {
  fetch_saved(kOut, kLse, dev_out_[static_cast<size_t>(layer)], written, t0, t1, need);
}

void KVWindow::fetch_inputs(int layer, int64_t t0, int64_t t1, int64_t written, std::vector<Residency::Span>& need) {
  fetch_saved(kIn, kIn, dev_in_[static_cast<size_t>(layer)], written, t0, t1, need);
}

// A layer not in a device slot (evicted, or never fetched) holds no rows there.
void KVWindow::forget_slot_rows(size_t l) {
  dev_kv_end_[l] = dev_grad_end_[l] = 0;
  dev_out_[l] = dev_in_[l] = {0, 0};
}

void KVWindow::begin_layer(int layer, KVUse use, int64_t t0, int64_t t1, const KVWritten& written) {
  const size_t l = static_cast<size_t>(layer);
  const int64_t L = layout_.L;
  if (!res_.resident(layer)) forget_slot_rows(l);
  if (use == KVUse::recompute) {
    std::vector<Residency::Span> need;
    fetch_outputs(layer, t0, t1, written.outputs_end, need);
    res_.fetch(layer, need);
    res_.ready_to_read(layer);  // the layer's dK, dV may still be going home from the last backward
    if (res_.slots() > 1 && layer + 1 < L) prefetch(layer + 1, use, t0, t1, written);
    // The last layer's backward follows (after the LM head): what it reads (K, V, dK, dV [0, t1), the
    // largest copy of the chunk) comes in now, behind this recompute, which reads only saved outputs.
    if (layer == L - 1 && layout_.grads) prefetch(layer, KVUse::backward, t0, t1, written);
    return;
  }
  // Forward: K, V [0, t0) must be current (the chunk writes [t0, t1)). Backward: K, V [0, t1) and dK, dV
  // [0, t1). What the slot already holds is not copied again.
  const int64_t kv_end = use == KVUse::forward ? t0 : t1;
  std::vector<Residency::Span> need;
  if (dev_kv_end_[l] < kv_end) need = spans(kKeys, kValues, dev_kv_end_[l], kv_end);
  if (use == KVUse::backward && dev_grad_end_[l] < t1) {
    const auto g = grad_spans(layer, dev_grad_end_[l], t1);
    need.insert(need.end(), g.begin(), g.end());
  }
  if (use == KVUse::backward && layout_.outputs) fetch_outputs(layer, t0, t1, written.outputs_end, need);
  if (use == KVUse::backward && layout_.inputs && t1 <= written.inputs_end)
    fetch_inputs(layer, t0, t1, written.inputs_end, need);
  res_.fetch(layer, need);
  dev_kv_end_[l] = std::max(dev_kv_end_[l], kv_end);
  if (use == KVUse::backward) dev_grad_end_[l] = std::max(dev_grad_end_[l], t1);
  res_.ready(layer);
  // The next layer in the direction of travel comes in while this one computes (with one slot there
  // is nowhere to put it). Forward wraps to layer 0 of the next chunk.
  if (res_.slots() > 1) {
    const int next = use == KVUse::forward ? (layer + 1) % static_cast<int>(L) : layer - 1;
    if (next >= 0 && next != layer) prefetch(next, use, t0, t1, written);
  }
}

// What layer `layer` will read next, fetched ahead. [t0, t1): the chunk now in flight (the next
// layer of a backward or recompute works on the same chunk).
void KVWindow::prefetch(int layer, KVUse use, int64_t t0, int64_t t1, const KVWritten& written) {
  const size_t l = static_cast<size_t>(layer);
  if (!res_.resident(layer)) forget_slot_rows(l);
  if (use == KVUse::recompute) {
    std::vector<Residency::Span> need;
    fetch_outputs(layer, t0, t1, written.outputs_end, need);
    res_.fetch(layer, need);
    return;
  }
  // Everything the host holds that a coming call may read: K, V written so far (up to the live end);
  // in the backward also dK, dV up to the live end.
  const int64_t live_end = written.live_end;
  const int64_t kv_end = std::min(host_kv_end_[l], live_end);
  std::vector<Residency::Span> need;
  if (dev_kv_end_[l] < kv_end) need = spans(kKeys, kValues, dev_kv_end_[l], kv_end);
  if (use == KVUse::backward && dev_grad_end_[l] < live_end) {
    const auto g = grad_spans(layer, dev_grad_end_[l], live_end);
    need.insert(need.end(), g.begin(), g.end());
  }
  if (use == KVUse::backward && layout_.outputs && t1 <= written.outputs_end)
    fetch_outputs(layer, t0, t1, written.outputs_end, need);
  if (use == KVUse::backward && layout_.inputs && t1 <= written.inputs_end)
    fetch_inputs(layer, t0, t1, written.inputs_end, need);
  res_.fetch(layer, need);
  dev_kv_end_[l] = std::max(dev_kv_end_[l], kv_end);
  if (use == KVUse::backward) dev_grad_end_[l] = std::max(dev_grad_end_[l], live_end);
}

void KVWindow::end_layer(int layer, KVUse use, int64_t t0, int64_t t1) {
  if (use == KVUse::recompute) return;  // a recompute from saved outputs writes nothing
  const size_t l = static_cast<size_t>(layer);
  if (use == KVUse::forward) {
    // The chunk's K, V (and saved outputs) go home (a recompute writes the same values again: the
    // copy is small, and keeping it unconditional keeps the host the single truth for everything a
    // layer wrote).
    std::vector<Residency::Span> out = spans(kKeys, kValues, t0, t1);
    if (layout_.outputs) {
      const auto o = spans(kOut, kLse, t0, t1);
      out.insert(out.end(), o.begin(), o.end());
      dev_out_[l] = {t0, t1};
    }
    if (layout_.inputs) {
      const auto in = spans(kIn, kIn, t0, t1);
      out.insert(out.end(), in.begin(), in.end());
      dev_in_[l] = {t0, t1};
    }
    res_.store(layer, out);
    dev_kv_end_[l] = std::max(dev_kv_end_[l], t1);
    host_kv_end_[l] = std::max(host_kv_end_[l], t1);
  } else {
    res_.store(layer, spans(kDKeys, kDValues, 0, t1));  // every key up to t1 got its share of dK, dV
    host_grad_end_[l] = std::max(host_grad_end_[l], t1);
  }
}

void KVWindow::zero_grads() {
  // The homes become logical zeros (nothing is cleared in host memory: the next fetch zeroes the
  // device rows); the slots are forgotten, so the next backward fetches (zeroes) its rows afresh.
  std::fill(host_grad_end_.begin(), host_grad_end_.end(), 0);
  res_.evict_all();
}

void KVWindow::reset() {
  std::fill(host_kv_end_.begin(), host_kv_end_.end(), 0);
  std::fill(dev_kv_end_.begin(), dev_kv_end_.end(), 0);
  std::fill(dev_grad_end_.begin(), dev_grad_end_.end(), 0);
  std::fill(dev_out_.begin(), dev_out_.end(), std::pair<int64_t, int64_t>{0, 0});
  std::fill(dev_in_.begin(), dev_in_.end(), std::pair<int64_t, int64_t>{0, 0});
}

// ---- The streamed store ----

KVStream::KVStream(const KVLayout& layout, Device device, int64_t block)
    : layout_(layout),
      block_(std::min(block, layout.T)),
      blocks_((layout.T + block_ - 1) / block_),
      // The chunk's own block, the prefix block being attended and the next one coming in.
      res_(device, part_sizes(layout, block_, kIn), static_cast<int>(layout.L * blocks_), 3, "kv block") {
  home_kv_.assign(static_cast<size_t>(layout.L * blocks_), 0);
  home_grads_.assign(static_cast<size_t>(layout.L * blocks_), 0);
}

int64_t KVStream::block_of(int64_t t0, int64_t t1) const {
  const int64_t j = t0 / block_;
  CW_CHECK(t1 <= j * block_ + block_rows(j), "streamed K/V store: range [{}, {}) crosses a block of {} tokens", t0, t1,
           block_);
  return j;
}

void KVStream::fetch_block(int layer, int64_t block, bool with_grads) {
  const int it = item(layer, block);
  const int64_t rows = block_rows(block);
  CW_CHECK(home_kv_[static_cast<size_t>(it)], "streamed K/V store: layer {} block {} read before a forward wrote it",
           layer, block);
  std::vector<Residency::Span> need = spans(kKeys, kValues, 0, rows);
  if (with_grads)
    for (Residency::Span sp : spans(kDKeys, kDValues, 0, rows)) {
      sp.zero = !home_grads_[static_cast<size_t>(it)];  // a home not written this step is logical zeros
      need.push_back(sp);
    }
  res_.fetch(it, need);
}

void KVStream::begin_layer(int layer, KVUse use, int64_t t0, int64_t t1, const KVWritten& written) {
  const int64_t j = t0 / block_;
  CW_CHECK(t0 == j * block_ && t1 <= t0 + block_rows(j),
           "streamed K/V store: chunk [{}, {}) is not one block of {} tokens (schedule.stream_kv needs the chunks to "
           "be the blocks: bwd_chunk = chunk)", t0, t1, block_);
  const int own = item(layer, j);
  if (use == KVUse::forward) {
    res_.fetch(own, {});  // the chunk writes its K, V (and outputs) into the slot
  } else if (use == KVUse::recompute) {
    res_.fetch(own, spans(kOut, kLse, 0, t1 - t0));
  } else {
    fetch_block(layer, j, true);
    // A layer recomputed inside the backward reads its saved outputs (when the prefill reached it).
    if (layout_.outputs && t1 <= written.outputs_end) res_.fetch(own, spans(kOut, kLse, 0, t1 - t0));
  }
  res_.ready(own);
}

void KVStream::end_layer(int layer, KVUse use, int64_t t0, int64_t t1) {
  // The chunk's K, V (and outputs) go home; its dK, dV are complete once its backward has read
  // them (nothing earlier attends these keys), so they stay.
  if (use != KVUse::forward) return;
  const int own = item(layer, t0 / block_);
  res_.store(own, spans(kKeys, kValues, 0, t1 - t0));
  if (layout_.outputs) res_.store(own, spans(kOut, kLse, 0, t1 - t0));
  home_kv_[static_cast<size_t>(own)] = 1;
}

void KVStream::zero_grads() {
  std::fill(home_grads_.begin(), home_grads_.end(), 0);
  res_.evict_all();
}

void KVStream::reset() { std::fill(home_kv_.begin(), home_kv_.end(), 0); }

namespace {
// An unmasked prefix block's window: its queries sit t0 - k0 positions past its first key k0.
AttentionWindow prefix_window(int64_t window, int64_t t0, int64_t k0) {
  return window > 0 ? AttentionWindow{window, t0 - k0} : AttentionWindow{};
}
}  // namespace

void KVStream::for_prefix_blocks(int layer, int64_t first, int64_t j, bool with_grads,
                                 const std::function<void(int item, int64_t k0, int64_t k1)>& visit) {
  const int own = item(layer, j);
  for (int64_t i = first; i < j; ++i) {
    res_.ready(item(layer, i));
    res_.fetch(own, {});  // most recently used: the prefetch below takes the block before this one
    if (i + 1 < j) fetch_block(layer, i + 1, with_grads);
    visit(item(layer, i), i * block_, i * block_ + block_rows(i));
  }
}

int64_t KVStream::first_key_read(const KVStore& kv, int layer, int64_t t0,
                                 const std::vector<std::vector<int64_t>>* doc_starts) {
  if (doc_starts == nullptr) return kv.first_key(layer, t0);
  int64_t earliest = t0;
  for (const std::vector<int64_t>& starts : *doc_starts) {
    // The start of the document that position t0 belongs to: the last start <= t0.
    const auto after = std::upper_bound(starts.begin(), starts.end(), t0);
    if (after != starts.begin()) earliest = std::min(earliest, *std::prev(after));
  }
  return earliest;
}

namespace {
// The document starts inside the chunk [t0, t1), counted from t0 (0 first: a document begun before
// the chunk is, within it, one that starts at its first query).
std::vector<std::vector<int64_t>> starts_within(const std::vector<std::vector<int64_t>>& doc_starts, int64_t t0,
                                                int64_t t1) {
  std::vector<std::vector<int64_t>> local;
  local.reserve(doc_starts.size());
  for (const std::vector<int64_t>& starts : doc_starts) {
    std::vector<int64_t>& l = local.emplace_back(1, 0);
    for (const int64_t s : starts)
      if (s > t0 && s < t1) l.push_back(s - t0);
  }
  return local;
}
}  // namespace

void KVStream::attend_forward(const KVStore& kv, int layer, int64_t t0, int64_t t1, const Tensor& out,
                              const AttentionSaved& saved, const Tensor& q, double scale, Arena& scratch,
                              int64_t window, double softcap, const std::vector<std::vector<int64_t>>* doc_starts) {
  // The chunk against its own block (causal), then against each earlier block (unmasked), merged in
  // the accumulation dtype; the next block comes in while one is attended. With a sliding window only
  // the blocks that hold keys from first_key(layer, t0) on, each from there (its rows past a query's window
  // masked by the op). With documents, the own block's queries split at the starts inside it, and an
  // earlier block serves only the queries of a document begun before the chunk, from that
  // document's start on.
  const int64_t j = t0 / block_, k_first = first_key_read(kv, layer, t0, doc_starts), first = k_first / block_;
  if (first < j) fetch_block(layer, first, false);  // queued first: it comes in while the own block is attended
  if (doc_starts)
    attention_forward_documents(out, saved, q, kv.keys(layer, t0, t1), kv.values(layer, t0, t1),
                                starts_within(*doc_starts, t0, t1), scale, scratch, 0, softcap);
  else
    attention_forward(out, saved, q, kv.keys(layer, t0, t1), kv.values(layer, t0, t1), scale, scratch,
                      AttentionMask::causal, {window}, softcap);
  if (first == j) return;
  ArenaScope scope(scratch);
  const int64_t B = out.size(0), c = out.size(1), H = out.size(2), D = out.size(3);
  const Tensor acc = scratch.alloc(saved.lse.dtype, {B, c, H, D});
  // Without documents every block's (out, lse) is whole: one pair of buffers serves them all (the
  // documents' block op stages its spans' own).
  Tensor block_out, block_lse;
  if (!doc_starts) {
    block_out = scratch.alloc(out.dtype, {B, c, H, D});
    block_lse = scratch.alloc(saved.lse.dtype, {saved.lse.size(0), saved.lse.size(1), saved.lse.size(2)});
  }
  copy_convert(acc, out);
  for_prefix_blocks(layer, first, j, false, [&](int, int64_t k0, int64_t k1) {
    if (doc_starts) {
      attention_merge_documents_block(acc, saved.lse, q, kv.keys(layer, k0, k1), kv.values(layer, k0, k1), t0, k0,
                                      *doc_starts, scale, scratch, softcap);
      return;
    }
    const int64_t from = std::max(k0, k_first);  // the block's keys inside the window
    attention_forward(block_out, {block_lse}, q, kv.keys(layer, from, k1), kv.values(layer, from, k1), scale,
                      scratch, AttentionMask::none, prefix_window(window, t0, from), softcap);
    attention_merge(acc, saved.lse, block_out, block_lse);
  });
  copy_convert(out, acc);
}

void KVStream::attend_backward(const KVStore& kv, int layer, int64_t t0, int64_t t1, const Tensor& d_q,
                               const Tensor& d_out, const AttentionSaved& saved, const Tensor& q, const Tensor& out,
                               double scale, Arena& scratch, int64_t window, double softcap,
                               const std::vector<std::vector<int64_t>>* doc_starts) {
  // Each block's share given the merged out and lse: dQ summed over the blocks in the accumulation
  // dtype (one rounding per block, not a running bf16 sum), each earlier block's dK, dV fetched,
  // added to and sent home. With a sliding window or documents, the blocks of the forward (above):
  // a block before the first one is not fetched, and its dK, dV get nothing.
  const int64_t j = t0 / block_, k_first = first_key_read(kv, layer, t0, doc_starts), first = k_first / block_;
  if (first < j) fetch_block(layer, first, true);  // comes in while the own block runs
  if (doc_starts)
    attention_backward_documents(d_q, kv.d_keys(layer, t0, t1), kv.d_values(layer, t0, t1), d_out, saved, q,
                                 kv.keys(layer, t0, t1), kv.values(layer, t0, t1), out,
                                 starts_within(*doc_starts, t0, t1), scale, GradMode::overwrite, scratch, 0, softcap);
  else
    attention_backward(d_q, kv.d_keys(layer, t0, t1), kv.d_values(layer, t0, t1), d_out, saved, q,
                       kv.keys(layer, t0, t1), kv.values(layer, t0, t1), out, scale, GradMode::overwrite, scratch,
                       AttentionMask::causal, {window}, softcap);
  if (first == j) return;
  ArenaScope scope(scratch);
  const int64_t rows = d_q.size(0) * d_q.size(1), width = d_q.size(2) * d_q.size(3);
  const Tensor dq_sum = scratch.alloc(saved.lse.dtype, {rows, width});
  copy_convert(dq_sum, d_q.view({rows, width}));
  // Without documents each block's dQ share is whole (one buffer for all); the documents' block op
  // adds its spans' shares into dq_sum itself.
  const Tensor dq_block = doc_starts ? Tensor{} : scratch.alloc(d_q.dtype, {rows, width});
  const Tensor dq_block4 = doc_starts ? Tensor{} : dq_block.view({d_q.size(0), d_q.size(1), d_q.size(2), d_q.size(3)});
  for_prefix_blocks(layer, first, j, true, [&](int it, int64_t k0, int64_t k1) {
    if (doc_starts) {
      attention_backward_documents_block(dq_sum.view({d_q.size(0), d_q.size(1), d_q.size(2), d_q.size(3)}),
                                         kv.d_keys(layer, k0, k1), kv.d_values(layer, k0, k1), d_out, saved, q,
                                         kv.keys(layer, k0, k1), kv.values(layer, k0, k1), out, t0, k0, *doc_starts,
                                         scale, scratch, softcap);
    } else {
      const int64_t from = std::max(k0, k_first);  // the block's keys inside the window
      attention_backward(dq_block4, kv.d_keys(layer, from, k1), kv.d_values(layer, from, k1), d_out, saved, q,
                         kv.keys(layer, from, k1), kv.values(layer, from, k1), out, scale, GradMode::overwrite,
                         scratch, AttentionMask::none, prefix_window(window, t0, from), softcap);
      accumulate(dq_sum, dq_block);
    }
    res_.store(it, spans(kDKeys, kDValues, 0, k1 - k0));
    home_grads_[static_cast<size_t>(it)] = 1;
  });
  copy_convert(d_q.view({rows, width}), dq_sum);
}

}  // namespace cw
