// A step's time: the FLOPs and bytes it executes over rates measured on an H100 80GB HBM3. Each rate
// is a row of docs/performance.md, "The rates of the planner's time model" (the value, what was
// measured, the date and the command).
#include "model/layer_cast.h"
#include "model/layer.h"
#include "model/llama.h"
#include "engine/engine.h"
#include "engine/ops/attention.h"
#include "optim/chunks.h"
#include "tools/planner/step.h"

#include <algorithm>
#include <cmath>

namespace cw {

namespace {
// The model's GEMMs (2048-8192 wide, bf16, f32 accumulate through cuBLASLt) at 8192 rows and more:
// 88% of the 8192^3 GEMM's rate; with the other terms fixed, it puts the recorded full-backprop 4K
// and 8K steps within 10% (record: kMatmulTflops).
constexpr double kMatmulTflops = 680;
// A layer's GEMMs at `rows` tokens against 8192 and more: 0.05 less a halving (record:
// matmul_row_efficiency). The measured GEMMs include their launches; in a step they overlap, so whole
// steps in short chunks differ less than the GEMMs alone.
double matmul_row_efficiency(int64_t rows) {
  const double halvings = std::log2(8192.0 / double(std::max<int64_t>(rows, 1)));
  return std::clamp(1.0 - 0.05 * halvings, 0.7, 1.0);
}
// cuDNN fused attention, one forward and a backward (2.5 forwards' FLOPs) together, by head size: at
// D 64 as one masked graph, or faster with a chunk's earlier keys apart (engine.h,
// cudnn_split_prefix); at D 128 the faster rate of its larger tiles (the split not measured there);
// straight between (record: attention_tflops).
double attention_tflops(int64_t head_dim, bool split) {
  const double d = std::clamp(double(head_dim), 64.0, 128.0);
  const double d64 = split ? 460 : 410;
  return d64 + (510 - d64) * (d - 64) / 64;
}
// The SIMT flash kernels (no tensor cores), one forward and a backward together: the attention of
// calls no tensor-core family takes, f32, or bf16 at a head dim neither cuDNN (multiples of 8 up to
// 128) nor flash-mma (64, 128, 256) takes (record: kSimtAttentionTflops).
constexpr double kSimtAttentionTflops = 3.0;
// The mma.sync flash kernels at head dim 256 (Gemma 2's), one forward and a backward together, with
// the score cap or without (record: kMmaHeadDim256AttentionTflops).
constexpr double kMmaHeadDim256AttentionTflops = 200.0;
// Whether the step's attention runs on cuDNN or a tensor-core flash family, else on the SIMT kernels
// (the chooser's shape rules, engine/ops/attention.h; flash_mma takes every shape flash_wgmma takes).
// The step's layers share the head dim, dtype and cap; a window (on some layers) keeps cuDNN off them,
// not the tensor-core flash families.
bool tensor_core_attention(const LlamaConfig& cf, DType dtype) {
  const AttentionShape shape{dtype, cf.head_dim, cf.sliding_window > 0, cf.attn_logit_softcapping > 0};
  return cudnn_takes_shape(shape) || mma_flash_takes_shape(shape);
}
// The same attention run block by block against a streamed K/V store (chunk-sized unmasked blocks,
// merged; dK, dV sent home per block): the blocks cost about what one call does, and the step waits
// for some copies (record: kStreamedAttentionSlowdown). Applied to one masked graph's rate: the
// blocks run no faster with the prefix apart.
constexpr double kStreamedAttentionSlowdown = 1.12;
// With a window of layers offloaded, the compute stream still waits for some copies (a layer's data
// arriving after the layer before it ends), with fetches and stores on their own lanes and the last
// layer's backward fetched behind its recompute (record: kWindowCopyWaitShare).
constexpr double kWindowCopyWaitShare = 0.012;
// Memory-bound ops at 70% of the device copy's bandwidth, which they meet (record: kElementwiseBytesPerS).
constexpr double kElementwiseBytesPerS = 0.7 * 3.0e12;
// The attention backward's K/V-gradient adds (cuDNN's bf16 dK, dV of every key a chunk attends added
// into the f32 accumulators): one streaming pass (record: kKvGradAddBytesPerS).
constexpr double kKvGradAddBytesPerS = 2.9e12;
// Host <-> device copies of pinned memory on the side stream: the K/V offload's rate (record:
// kPcieBytesPerS).
constexpr double kPcieBytesPerS = 49e9;
// The offloaded optimizer's host update (the CPU adamw_update op on all 16 cores of the H100 machine;
// the 2-core development machine runs 0.43 G elements/s on one) (record: kHostAdamWElemsPerS).
constexpr double kHostAdamWElemsPerS = 2.3e9;

// Bytes the K/V offload moves in one step (model/kv_store.cpp's begin_layer / end_layer, per layer):
// the prefill fetches each chunk's prefix of K, V and sends the chunk's K, V (and saved outputs)
// home; each reverse chunk ending at t1 fetches K, V [0, t1) (twice without saved outputs: its
// recompute and its backward), dK, dV [0, t1) (all but the first, whose homes are logical zeros) and
// sends dK, dV [0, t1) home; with saved outputs it fetches the chunk's outputs instead of
// recomputing them. Checked against the recorded runs and a CPU step's own count in
// tests/tools/test_plan.cpp.
double kv_offload_bytes(const StepPlan& s, double reverse) {
  const LlamaConfig& cf = s.store;  // the heads the store holds
  const int64_t B = s.B, T = s.T, c = s.chunk, c2 = s.bwd_chunk, prefill_end = s.prefill_end;
  const double kv = double(2 * B * cf.num_key_value_heads * cf.head_dim) * double(s.e);
  const double g = double(2 * B * cf.num_key_value_heads * cf.head_dim) * double(s.acc);
  const double out =
      s.saved ? double(B * cf.num_attention_heads) * double(cf.head_dim * int64_t(s.e) + int64_t(s.acc)) : 0;
  const double in = s.inputs ? double(B * cf.hidden_size) * double(s.e) : 0;
  const double n = std::ceil(double(prefill_end) / double(c)), m = std::ceil(double(T) / double(c2));
  const double prefill = kv * double(c) * n * (n - 1) / 2 + (kv + out + in) * double(prefill_end);
  const double prefix_sum = double(c2) * m * (m + 1) / 2;  // sum over reverse chunks of t1
  // With saved outputs the chunks the prefill did not reach (seco's last) run a forward instead:
  // K, V of their prefix in, their K, V and outputs home.
  const double unsaved = double(T - prefill_end);
  // With saved inputs no reverse chunk runs a forward (its backward fetches its inputs instead).
  const double recompute = s.inputs  ? in * double(T)
                           : s.saved ? out * double(prefill_end) + kv * double(prefill_end) + (kv + out) * unsaved
                                     : kv * prefix_sum + kv * double(T);
  // Streamed, a chunk's own dK, dV stay on the device (its backward is their last reader): the
  // chunks send home [0, t0), not [0, t1).
  const double sent = s.streamed ? prefix_sum - double(T) : prefix_sum;
  const double backward = kv * prefix_sum + g * (prefix_sum - double(T)) + g * sent + out * double(T);
  return double(cf.num_hidden_layers) * (prefill + reverse * (recompute + backward));
}

// The pairs of the first n queries of a sequence (or document), each attending the keys from the
// start up to itself: at most W of them under a sliding window (W = 0: none). Whatever the chunking,
// the chunks' calls keep these pairs.
double causal_pairs(int64_t n, int64_t W) {
  const double nd = double(n);
  if (W <= 0 || n <= W) return nd * (nd + 1) / 2;
  return double(W) * double(W + 1) / 2 + (nd - double(W)) * double(W);
}
// The same over packed documents: per sequence (doc_starts, each row's first 0) the pairs of its
// queries before `end`, each attending its own document's keys up to itself, averaged over the rows.
double document_pairs(const std::vector<std::vector<int64_t>>& doc_starts, int64_t T, int64_t end, int64_t W) {
  double pairs = 0;
  for (const std::vector<int64_t>& row : doc_starts)
    for (size_t i = 0; i < row.size(); ++i)
      pairs += causal_pairs(std::max<int64_t>(0, std::min(i + 1 < row.size() ? row[i + 1] : T, end) - row[i]), W);
  return pairs / double(doc_starts.size());
}
// The keys whose dK, dV a backward in chunks of c adds to, summed over the chunks (each chunk's own
// and every earlier one within the sliding window W, 0: none): without a window T^2 / 2c + T / 2.
double kv_grad_keys(int64_t T, int64_t c, int64_t W) {
  double keys = 0;
  for (int64_t p = 0; p < T; p += c) keys += double(std::min(T, p + c) - window_first_key(p, W));
  return keys;
}
}  // namespace

void plan_time(const StepPlan& s, PlanReport& r) {
  const LlamaConfig& cf = s.cf;
  const ScheduleOptions& o = s.o;
  const int64_t B = s.B, T = s.T, L = cf.num_hidden_layers, C = cf.hidden_size, F = cf.intermediate_size;
  const int64_t V = cf.vocab_size, H = cf.num_attention_heads, Hkv = cf.num_key_value_heads, D = cf.head_dim;
  const size_t trained = size_t(trained_parameter_count(cf, s.lora));
  const ActivationPolicy policy = activation_policy(o, s.lora);
  // Passes of the layers' work over the reverse tokens (spaco visits keep of k chunks).
  double reverse = 1;
  if (o.kind == ScheduleKind::spaco && o.keep > 0) {
    const double k = std::ceil(double(T) / double(s.bwd_chunk));
    reverse = std::min(1.0, double(o.keep) / k);
  }
  const double tokens = double(B * T);
  const double layer_matmul = 2.0 * double(L) * double(C * H * D + 2 * C * Hkv * D + H * D * C + 3 * C * F);
  const double mlp_gate_up = 2.0 * double(L) * double(2 * C * F);
  // Forward passes of every layer: the prefill (its share of the tokens), the forward of the reverse
  // tokens, one recompute more for checkpointed full; the backward counts as two (dX and dW). With
  // saved inputs the reverse tokens' one forward is each layer's recompute before its backward.
  const double prefill = double(s.prefill_end) / double(T);
  const double extra_forward = !policy.keep_layers && !s.inputs ? 1 : 0;
  // A frozen base (LoRA) has no weight-gradient products: its backward counts once (dX).
  const double backward = s.lora.enabled() ? 1 : 2;
  const double passes = prefill + reverse * (1 + extra_forward + backward);
  double matmul = tokens * layer_matmul * passes;
  // The adapters: 2 flops per adapter parameter and token in each forward, dX and d(A, B) backward.
  const double adapter_pass = s.lora.enabled() ? 2.0 * double(lora_parameter_count(cf, s.lora)) : 0.0;
  matmul += tokens * adapter_pass * (prefill + reverse * (1 + extra_forward + 2));
  // The prefill's share runs at its chunk's rows, the rest at the reverse chunk's.
  const double prefill_matmul = tokens * prefill * (layer_matmul + adapter_pass);
  // A recompute from saved attention outputs skips the K and V projections (not the first forward of
  // a chunk the prefill did not reach).
  const double unsaved_tokens = double(B * (T - s.prefill_end));
  if (s.saved)
    matmul -= (tokens * reverse * (1 + extra_forward) - unsaved_tokens) * 2.0 * double(L) * double(2 * C * Hkv * D);
  // Selective recompute and the tiled MLP with kept activations run gate/up again in the backward.
  if (policy.keep_layers && !s.inputs && mlp_kept(policy, cf, B * s.bwd_chunk) == MlpKept::input)
    matmul += tokens * reverse * mlp_gate_up;
  // A layer recomputed just before its backward skips W_down's product (only the next layer reads
  // it): each recompute of a checkpointed layer, and with saved inputs every layer's but the last's
  // (whose output the LM head reads).
  const double mlp_down = 2.0 * double(C * F);
  if (s.inputs)
    matmul -= tokens * reverse * double(L - 1) * mlp_down;
  else
    matmul -= tokens * reverse * extra_forward * double(L) * mlp_down;
  // The fused LM head: logits, dX and dW over the reverse tokens; spaco's prefill also takes the loss.
  const double spaco = o.kind == ScheduleKind::spaco ? 1 : 0;
  const double head = 2.0 * double(V * C) * tokens * ((1 + backward) * reverse + spaco);
  // Attention: 4 H D flops per (query, key) pair and layer forward, 2.5x that backward; a pair is a
  // query and a key of its own document (the query's causal prefix when there are no documents),
  // within its layer's sliding window if it has one (every layer of a Mistral, Gemma 2's sliding
  // layers), summed over the layers.
  const double per_pair = 4.0 * double(H * D) * double(B);
  // (The chunks' calls keep the same pairs whatever their length.)
  const auto pairs = [&](int64_t end) {
    double sum = 0;
    for (int64_t l = 0; l < L; ++l)
      sum += s.doc_starts.empty() ? causal_pairs(end, cf.layer_window(l))
                                  : document_pairs(s.doc_starts, T, end, cf.layer_window(l));
    return sum;
  };
  // With saved outputs the reverse sweep's forwards (and a layer recompute) run no attention.
  const double reverse_forward = s.saved ? 0 : 1 + extra_forward;
  const double unsaved_pairs = s.saved ? pairs(T) - pairs(s.prefill_end) : 0;
  const double attention = per_pair * (pairs(s.prefill_end) +
                                       reverse * pairs(T) * (reverse_forward + 2.5) + unsaved_pairs);
  // Gemma 2's post-norms: two norms more a layer, each reading its input, keeping a copy and writing
  // its output.
  const int64_t post_norm_elements = cf.post_norms ? 6 * C : 0;
  const double elementwise = tokens * double(L) * passes * double(16 * C + 6 * F + post_norm_elements) * double(s.e);
  // The optimizer: on the device, its traffic; offloaded, the slowest stage of its pipeline, which
  // overlap one another: streamed through the device (f32 state), master, m and v in on one lane and
  // out on the other, and the device's update; else gradients out, the host's update, weights in.
  const double device_update_s = double(trained) * (s.dtype == DType::bf16 ? 38.0 : 36.0) / kElementwiseBytesPerS;
  const double optimizer_s =
      !s.optimizer_offload ? device_update_s
      : s.streamed_optimizer ? std::max(double(3 * trained * s.acc) / kPcieBytesPerS, device_update_s)
          : std::max({double(trained * s.acc) / kPcieBytesPerS, double(trained * s.e) / kPcieBytesPerS,
                      double(trained) / kHostAdamWElemsPerS});
  r.flops = matmul + head + attention;
  // The rate of the calls that dominate: the reverse chunks' against all T keys. A streamed store's
  // blocks each run as one unmasked or square graph: one masked graph's rate, then its measured
  // slowdown.
  const bool tensor_cores = tensor_core_attention(cf, s.dtype);
  const double tflops = !tensor_cores ? kSimtAttentionTflops
                        : D > 128     ? kMmaHeadDim256AttentionTflops
                                      : attention_tflops(D, !s.streamed && cudnn_splits_prefix(s.bwd_chunk, T));
  const bool streamed_blocks = s.streamed && tensor_cores;  // the slowdown measured on cuDNN
  const double attention_s = attention / (tflops * 1e12) * (streamed_blocks ? kStreamedAttentionSlowdown : 1.0);
  // The backward's dK, dV adds: per key and layer, K's and V's bf16 gradient read and the f32
  // accumulator read and written.
  double kv_grad_key_layers = 0;  // per layer the keys its backward adds dK, dV to (its window's)
  for (int64_t l = 0; l < L; ++l) kv_grad_key_layers += kv_grad_keys(T, s.bwd_chunk, cf.layer_window(l));
  const double kv_grad_adds = reverse * kv_grad_key_layers * double(B) * 2.0 * double(Hkv * D) *
                              double(s.e + 2 * s.acc) / kKvGradAddBytesPerS;
  const double matmul_s =
      prefill_matmul / (kMatmulTflops * 1e12 * matmul_row_efficiency(B * s.chunk)) +
      (matmul - prefill_matmul) / (kMatmulTflops * 1e12 * matmul_row_efficiency(B * s.bwd_chunk));
  // Context parallelism: a rank runs 1/cp of every chunk's rows through the linears, the LM head and
  // the elementwise work, and attention (and its store's dK, dV adds) on 1/cp of the heads; the
  // optimizer updates the whole model on every rank. (The GEMMs' rate is kept at the chunk's rows.)
  const double share = 1.0 / double(s.cp);
  const double kv_share = double(s.store.num_key_value_heads) / double(Hkv);
  r.flops = r.flops * share;
  r.time = {{"matmul", matmul_s * share},
            {"lm_head", head / (kMatmulTflops * 1e12) * share},
            {"attention", attention_s * share},
            {"kv grad adds", kv_grad_adds * kv_share},
            {"elementwise", elementwise / kElementwiseBytesPerS * share},
            {"optimizer", optimizer_s}};
  // cast_layers: a block is cast each time a chunk's pass reaches it, except where a slot still holds
  // it: every prefill chunk casts all L blocks; a reverse chunk's backward finds its forward's last
  // kSlots blocks, and the next reverse chunk's forward finds the first kSlots its backward ended with.
  if (s.cast) {
    const double prefill_chunks = std::ceil(double(s.prefill_end) / double(s.chunk));
    const double reverse_chunks = reverse * std::ceil(double(T) / double(s.bwd_chunk));
    const double slots = double(std::min<int64_t>(L / 2, LayerCast::kSlots));
    // With saved inputs a reverse chunk only runs down the layers: it finds the kSlots blocks of the
    // pass before it only at the first (the prefill's last layers).
    r.layer_casts = s.inputs ? prefill_chunks * double(L) + reverse_chunks * double(L) - slots
                             : prefill_chunks * double(L) + reverse_chunks * (2 * double(L) - 2 * slots) + slots;
    const double block_numel = double(LayerCast::slot_bytes_for(cf, s.dtype) / s.e);
    r.time.emplace_back("weight casts", r.layer_casts * block_numel * double(4 + s.e) / kElementwiseBytesPerS);
  }
  for (const auto& [name, sec] : r.time) r.step_s += sec;
  // The K/V offload's copies run on the side stream beside the compute (nearly all of them under it);
  // they lengthen the step only where they outlast what they hide behind: a window's next layer is
  // fetched while the current layer computes, so that is the whole step; a streamed store's blocks
  // are fetched two ahead of the attention that reads them, so that is the attention; with a window
  // of one layer they add to the step (docs/performance.md, "The rates of the planner's time model":
  // where the copies hide).
  if (s.streamed || s.windowed) {
    r.kv_moved_bytes = kv_offload_bytes(s, reverse);
    const double copies_s = r.kv_moved_bytes / kPcieBytesPerS;
    if (s.serial_copies) {
      r.time.emplace_back("kv copies (one slot: not overlapped)", copies_s);
      r.step_s += copies_s;
    } else if (s.streamed) {
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
}

}  // namespace cw
