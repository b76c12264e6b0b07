// Causal multi-head attention with grouped K/V heads, in the "chunk against cache" form.
//   The chunk's c queries sit at positions [p, p+c); they attend the S = p + c keys at [0, p+c),
//   the causal mask aligned bottom-right: query i sees keys j <= p + i. Full-sequence attention is
//   p = 0. Query head h reads K/V head h / (H / Hkv): grouped-query attention without copies.
//   forward:  s_ij = scale * q_i . k_j;  lse_i = log sum_j exp(s_ij);  P_ij = exp(s_ij - lse_i)
//             out_i = sum_j P_ij v_j
//   backward: Delta_i = d_out_i . out_i;  dP_ij = d_out_i . v_j;  dS_ij = P_ij (dP_ij - Delta_i)
//             d_q_i   = scale sum_j dS_ij k_j                 (overwrite or accumulate)
//             d_k_j  += scale sum_i dS_ij q_i                  (always ADDED: the caller's buffer covers
//             d_v_j  += sum_i P_ij d_out_i                      [0, p+c), which is what SeCO needs)
// Unmasked (mask = AttentionMask::none): every query sees all S keys, which then need not cover the
//   chunk (any S >= 1). This is a block of keys lying wholly before the chunk: attention against a
//   long prefix can run block by block, each block's (out, lse) combined by attention_merge, and
//   the backward per block given the combined out and lse (P_ij = exp(s_ij - lse_i) is then each
//   pair's share of the whole row, so the blocks' dK, dV and summed dQ are the whole call's).
// Sliding window (AttentionWindow, W > 0; Mistral's sliding_window): a query at position t sees only
//   the W newest keys, positions t - W < j <= t (itself and the W - 1 before it: transformers'
//   sliding-window mask, kv_idx > q_idx - sliding_window). Positions count from the call's key 0:
//   query i sits at o + i, o = S - c for a causal call and o = `distance` (>= S) for an unmasked
//   block, and sees keys max(0, o + i - W + 1) <= j <= min(S - 1, o + i); the sums above run over
//   those. A row of an unmasked block may see none: its lse is -inf and its out 0 (attention_merge
//   weighs it as nothing). P_ij is 0 off the window, so no dK, dV reaches a key no query sees; a
//   caller that passes only the keys [p - W + 1, p + c) gets the same result reading less. On the GPU
//   every flash family honours the window (masking each pair, skipping the key blocks wholly left of
//   a query tile's window and the query blocks past a key block's: work ~ W c, not S c); cuDNN does
//   not, and the chooser never picks it for a windowed call. Tested in
//   tests/engine/test_attention_documents.cpp (the windowed softmax written out, finite differences,
//   blocks merged) and the op table's window rows (the GPU rows: every flash family against the CPU).
// Score cap (softcap > 0; Gemma 2's attn_logit_softcapping): every score s_ij above becomes
//   cap tanh(s_ij / cap) before the mask and the softmax, and the backward multiplies dS_ij by the
//   cap's derivative 1 - tanh(s_ij / cap)^2 before the products that give d_q and d_k. It applies
//   to every call form (causal, unmasked blocks merged by attention_merge, windows, documents): a
//   block's capped scores are the whole row's. The CPU and the GPU's flash_mma and flash_simt
//   families compute it (the chooser keeps capped calls off cuDNN and flash_wgmma, whose kernels have
//   no cap). Tested in the op table's softcap rows (finite differences; the GPU rows against the CPU)
//   and tests/engine/test_attention_documents.cpp (the capped softmax written out).
// Shapes: q, out, d_q, d_out [B, c, H, D]; k, v [B, S, Hkv, D]; d_k, d_v [B, S, Hkv, D] in the
// accumulation dtype (f32 for f32/bf16, f64 for f64). k, v, d_k, d_v may have any batch stride
// (a slice of the K/V store); their inner [S, Hkv, D] must be packed. All on q's device (scratch too).
// Saved: lse [B, H, c] in the accumulation dtype; the backward recomputes P from q, k and lse.
// Scratch: the CPU path takes, per thread, score blocks of up to 64 query rows x S keys from
// `scratch` (one in the forward, two in the backward).
// Tested in tests/engine/test_backend_ops.cpp (the op table, every kernel family) and
// tests/engine/test_ops.cpp (chunked against whole-sequence).
#pragma once

#include "engine/memory.h"
#include "engine/tensor.h"

#include <string>
#include <vector>

namespace cw {

struct AttentionSaved {
  Tensor lse;  // [B, H, c]
};

enum class AttentionMask { causal, none };

// The sliding window of a call (above). Positions are the call's own: a causal call places its
// queries bottom-right (distance unused, 0); an unmasked block says how far its queries sit past its
// first key.
struct AttentionWindow {
  int64_t size = 0;      // W: keys a query sees at most, itself included; 0: no window
  int64_t distance = 0;  // unmasked calls: the first query's position minus the first key's (>= S)
  bool operator==(const AttentionWindow&) const = default;
};
// The oldest key position a query at `position` sees under a window of `window` keys (0: none).
inline int64_t window_first_key(int64_t position, int64_t window) {
  return window > 0 && position >= window ? position - window + 1 : 0;
}

// The kernel families that implement this op. Every call goes through choose_attention_kernel,
// which picks one from the call's shape, device and flags; tests and benchmarks force a family with
// set_attention_kernel (engine/engine.h; env CW_ATTENTION).
//   cpu          Eigen, f64/f32: the reference                       (engine/cpu/attention.cpp)
//   cudnn        cuDNN's fused attention, bf16; no sliding window    (engine/cuda/attention_cudnn.cu)
//   flash        the best of our flash families for the call (a request, never a result)
//   flash_wgmma  our flash kernels on Hopper warpgroup MMA, bf16, D 64/128 (attention_flash_wgmma.cu)
//   flash_mma    our flash kernels on mma.sync tensor cores, bf16, D 64/128/256 (attention_flash_mma.cu)
//   flash_simt   our flash kernels without tensor cores: f32 or bf16, even D <= 256 (attention_flash_simt.cu)
// A score cap (softcap) runs on the CPU, flash_mma and flash_simt.
enum class AttentionKernel { automatic, cpu, cudnn, flash, flash_wgmma, flash_mma, flash_simt };
const char* attention_kernel_name(AttentionKernel kernel);        // "auto", "cpu", "cudnn", "flash-wgmma", ...
AttentionKernel parse_attention_kernel(const std::string& name);  // throws naming the choices

// One attention call as the chooser sees it: shape, device, dtype, direction and whether the
// operands suit the tensor-core kernels (16-byte aligned rows; K/V batch strides multiples of 8).
struct AttentionCall {
  Device device;
  DType dtype;
  int64_t B, c, S, H, Hkv, D;
  bool backward;
  bool tensor_core_operands;
  const Tensor* q;  // the operands themselves, for backends that build plans from them (cuDNN)
  const Tensor* k;
  const Tensor* v;
  AttentionMask mask = AttentionMask::causal;
  AttentionWindow window = {};  // the CPU and the flash families honour a window; cuDNN refuses it
  double softcap = 0.0;         // a score cap: the CPU, flash_mma and flash_simt compute it
};
// out and, in the backward, d_q, d_out, d_k, d_v take part in the alignment rule.
AttentionCall attention_call(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                             const Tensor* d_q = nullptr, const Tensor* d_out = nullptr, const Tensor* d_k = nullptr,
                             const Tensor* d_v = nullptr, AttentionMask mask = AttentionMask::causal,
                             AttentionWindow window = {}, double softcap = 0.0);
struct AttentionFlags {
  AttentionKernel forced = AttentionKernel::automatic;  // what set_attention_kernel says, by default
  bool deterministic = false;                           // only bitwise-reproducible kernels
};
struct AttentionChoice {
  AttentionKernel kernel;  // never automatic or flash
  std::string reason;      // why this one, and why not the ones before it (logs, bench output)
};
// The one place that decides which kernel runs an attention call. A forced family that cannot take
// the call is an error naming the reason.
AttentionChoice choose_attention_kernel(const AttentionCall& call, const AttentionFlags& flags);
// The part of the chooser's rules that the shape alone decides: dtype, head dim, window and cap. The
// chooser applies them first; the operands' alignment, the device, cuDNN's plans and its workspace
// budget come after, per call. Code that plans without operands (tools/planner: which family's
// scratch a step replays, which rate it is timed at) asks these, so that the rule is stated once.
struct AttentionShape {
  DType dtype;
  int64_t head_dim;
  bool windowed = false;  // a sliding window
  bool capped = false;    // a score cap
};
// cuDNN (when the build has it): bf16, a head dim that is a multiple of 8 up to 128, no window, no cap.
bool cudnn_takes_shape(const AttentionShape& shape, std::string* why = nullptr);
// flash_wgmma: bf16, head dim 64 or 128, no cap (a window it honours).
bool wgmma_flash_takes_shape(const AttentionShape& shape, std::string* why = nullptr);
// flash_mma: bf16, head dim 64, 128 or 256, window and cap included.
bool mma_flash_takes_shape(const AttentionShape& shape, std::string* why = nullptr);
// flash_simt: an even head dim of at most 256, f32 or bf16, window and cap included.
bool simt_flash_takes_shape(const AttentionShape& shape, std::string* why = nullptr);
// The census: how many calls each kernel family took, by direction and the chooser's reason, with
// their model flops (forward 4 B H D per query-key pair the mask keeps; backward 2.5x that), since
// the last reset. A run reads it to see which kernel served its attention (bench prints it).
struct AttentionCensusEntry {
  bool backward;
  AttentionKernel kernel;
  std::string reason;
  int64_t calls;
  double flops;
};
std::vector<AttentionCensusEntry> attention_census();  // ordered: forward first, then by flops
void reset_attention_census();
// The census as lines, one per entry: "attention {when}: backward on cudnn: 512 calls, 71.4% of the
// flops (cuDNN serves this shape)".
std::string attention_census_text(const std::vector<AttentionCensusEntry>& census, const std::string& when);
// The model flops of one call (the figure the census adds up).
double attention_call_flops(const AttentionCall& call);
// The (query, key) pairs a call's mask and window keep: queries [0, c) against S keys.
double attention_pairs(int64_t c, int64_t S, AttentionMask mask, AttentionWindow window);

// The flags of the process-wide settings (engine/engine.h: attention_kernel(), deterministic()).
AttentionFlags attention_flags();

// softcap: the score cap (above; 0: none).
void attention_forward(const Tensor& out, const AttentionSaved& saved, const Tensor& q, const Tensor& k,
                       const Tensor& v, double scale, Arena& scratch, AttentionMask mask = AttentionMask::causal,
                       AttentionWindow window = {}, double softcap = 0.0);
void attention_backward(const Tensor& d_q, const Tensor& d_k, const Tensor& d_v, const Tensor& d_out,
                        const AttentionSaved& saved, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, double scale, GradMode mode, Arena& scratch,
                        AttentionMask mask = AttentionMask::causal, AttentionWindow window = {},
                        double softcap = 0.0);

// Packed documents: a document mask on the same call. Each sequence b holds documents starting at
// doc_starts[b] (positions in the whole sequence, ascending, the first 0; starts at or past p + c are
// ignored). A query at position t = p + i attends only keys of its own document:
//   keys j with start(t) <= j <= t,   start(t) = the last document start <= t
// so no key of an earlier document is seen and no gradient crosses a document start. The chunk's
// queries split at the document starts inside it into spans (below), and each span is one causal
// call of the op above on views: queries [q0, q1) of sequence b against keys [k0, p + q1) of the same
// sequence, bottom-right aligned. The math per query is the unmasked op's over its own keys, so each
// kernel family serves it unchanged; dK, dV of keys [0, p + c) are ADDED as above (keys of no query's
// document get nothing), d_q overwritten or accumulated. A span's lse rows are staged through
// `scratch` where they are not packed in saved.lse. Shapes, dtypes and saved values as above.
// On a GPU a flash family may instead take the whole chunk in one call, given each row's document
// start: the same math, one launch however many documents; it does so when the spans are short (a
// forced flash family always does; cuDNN and the CPU go span by span). The census names such a call
// "packed documents in one call". Each row's start is read from `first_keys` when given: int32
// [B, >= p + c] on the operands' device, position t's document start (a step uploads it once for all
// its chunks and layers, optim/schedule.h StepTokens); else it is built here from doc_starts and
// uploaded (int32 [B, c] in `scratch`, and a wait for the copy).
// With a sliding window of W keys (0: none) a query attends keys of its own document within its window,
// max(start(t), t - W + 1) <= j <= t: each span's call reads keys from max(k0, p + q0 - W + 1) on, the
// window masking the rest.
// Tested in tests/engine/test_ops.cpp (against each document run alone) and the op table.
struct DocumentSpan {
  int64_t b;       // the sequence
  int64_t q0, q1;  // its chunk rows [q0, q1): queries at positions [p + q0, p + q1)
  int64_t k0;      // where their document starts (k0 <= p + q0)
};
// The spans of a chunk of c queries at positions [p, p + c) of B sequences, in order (sequence, then
// rows). Checks doc_starts (B lists, each ascending, the first 0).
std::vector<DocumentSpan> document_spans(const std::vector<std::vector<int64_t>>& doc_starts, int64_t B, int64_t p,
                                         int64_t c);
void attention_forward_documents(const Tensor& out, const AttentionSaved& saved, const Tensor& q, const Tensor& k,
                                 const Tensor& v, const std::vector<std::vector<int64_t>>& doc_starts, double scale,
                                 Arena& scratch, int64_t window = 0, double softcap = 0.0,
                                 const Tensor& first_keys = {});
void attention_backward_documents(const Tensor& d_q, const Tensor& d_k, const Tensor& d_v, const Tensor& d_out,
                                  const AttentionSaved& saved, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& out, const std::vector<std::vector<int64_t>>& doc_starts, double scale,
                                  GradMode mode, Arena& scratch, int64_t window = 0, double softcap = 0.0,
                                  const Tensor& first_keys = {});
// first_keys for a batch of B = doc_starts.size() sequences of T tokens: int32 [B, T] in `arena` (on
// its device), position t of sequence b holding the start of its document (doc_starts as above).
Tensor document_first_keys(const std::vector<std::vector<int64_t>>& doc_starts, int64_t T, Arena& arena);

// Packed documents against one block of earlier keys, for a K/V prefix attended block by block (the
// streamed store, model/kv_residency.h): the chunk's queries at positions [p, p + c) against keys
// [k0, k0 + n) of the same sequences, k0 + n <= p, each query only against the keys of its own
// document (every key precedes every query: no causal mask inside the block). The spans of
// document_spans whose document starts before k0 + n read keys [max(k0, start), k0 + n); the others
// read nothing from the block and are left as they are. q, k, v, out, d_out, saved as
// attention_forward_documents; k, v, d_k, d_v the block's [B, n, Hkv, D].
// Forward: each span's (out, lse) against its keys merged into acc [B, c, H, D] and lse_acc [B, H, c]
// (accumulation dtype, updated in place) as attention_merge does. Backward, given the combined out and
// lse of every block (saved): the block's dK, dV ADDED, the span's dQ share ADDED to dq_acc [B, c, H, D]
// (accumulation dtype). Tested in tests/engine/test_attention_documents.cpp (merged over blocks, equal
// to one call over the whole prefix).
// softcap: the score cap (0: none).
void attention_merge_documents_block(const Tensor& acc, const Tensor& lse_acc, const Tensor& q, const Tensor& k,
                                     const Tensor& v, int64_t p, int64_t k0,
                                     const std::vector<std::vector<int64_t>>& doc_starts, double scale,
                                     Arena& scratch, double softcap = 0.0);
void attention_backward_documents_block(const Tensor& dq_acc, const Tensor& d_k, const Tensor& d_v,
                                        const Tensor& d_out, const AttentionSaved& saved, const Tensor& q,
                                        const Tensor& k, const Tensor& v, const Tensor& out, int64_t p, int64_t k0,
                                        const std::vector<std::vector<int64_t>>& doc_starts, double scale,
                                        Arena& scratch, double softcap = 0.0);

// Combines the attention of the same queries against two disjoint sets of keys (blocks of one row):
//   lse = log(exp(lse_acc) + exp(lse_b))
//   acc = exp(lse_acc - lse) acc + exp(lse_b - lse) out_b;  lse_acc = lse
// acc [B, c, H, D] and lse_acc [B, H, c] in the accumulation dtype (updated in place), out_b
// [B, c, H, D] in the compute dtype, lse_b [B, H, c] in the accumulation dtype. Nothing saved; no
// backward (the blocks' backward takes the combined out and lse, above). Packed operands, one device.
void attention_merge(const Tensor& acc, const Tensor& lse_acc, const Tensor& out_b, const Tensor& lse_b);

}  // namespace cw
