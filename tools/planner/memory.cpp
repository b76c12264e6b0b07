// A step's memory by category, on its device and in pinned host memory: the buffers the training
// state, the K/V store and the model allocate, sized as the code sizes them, and the schedule's
// arena replayed (arena_replay.h).
#include "engine/engine.h"
#include "model/layer_cast.h"
#include "optim/adamw_offload.h"
#include "optim/chunks.h"
#include "tools/planner/arena_replay.h"
#include "tools/planner/step.h"

#include <algorithm>

namespace cw {

namespace {
// What one buffer of `bytes` takes on the step's device: a GPU's caching pool rounds it to its size
// class (engine.h device_pool_block, after the buffers' own alignment); a CPU buffer is its bytes.
size_t buffer(const StepPlan& s, size_t bytes) {
  if (s.device.is_cpu()) return bytes;
  const size_t aligned = (std::max<size_t>(bytes, 1) + kMemoryAlignBytes - 1) / kMemoryAlignBytes * kMemoryAlignBytes;
  return device_pool_block(aligned);
}
}  // namespace

void plan_memory(const StepPlan& s, PlanReport& r) {
  const LlamaConfig& cf = s.cf;
  const int64_t B = s.B, T = s.T, L = cf.num_hidden_layers, C = cf.hidden_size;
  // The store's heads (under context parallelism the rank's: StepPlan::store).
  const int64_t H = s.store.num_attention_heads, Hkv = s.store.num_key_value_heads, D = cf.head_dim;
  const size_t e = s.e, acc = s.acc;

  // Fixed: one buffer per parameter set (model/params.cpp), the RoPE tables. What is trained
  // (master, moments, gradients) is every parameter, or under LoRA the adapters alone.
  const size_t n = static_cast<size_t>(cf.parameter_count());
  const size_t trained = static_cast<size_t>(trained_parameter_count(cf, s.lora));
  // With cast_layers (model/layer_cast.h) the compute copy holds the tensors outside the blocks, and
  // kSlots slots of one block's size each take a block as it runs.
  const size_t block_numel = LayerCast::slot_bytes_for(cf, s.dtype) / e;
  const size_t resident_numel = s.cast ? n - block_numel * static_cast<size_t>(L) : n;
  r.device.emplace_back("weights", buffer(s, resident_numel * e) + (s.lora.enabled() ? buffer(s, trained * e) : 0) +
                                       (s.cast ? LayerCast::kSlots * buffer(s, block_numel * e) : 0));
  if (s.optimizer_offload) {  // master and moments page-locked on the host
    r.host.emplace_back("master", trained * acc);
    r.host.emplace_back("optimizer", 2 * trained * acc);
    const DType state = accum_dtype(s.dtype);
    if (s.streamed_optimizer)  // through the device's slots
      r.device.emplace_back("optimizer", buffer(s, OffloadedAdamW::device_staging_bytes_for(int64_t(trained), state)));
    else
      r.host.emplace_back("staging", OffloadedAdamW::staging_bytes_for(int64_t(trained), state, s.dtype));
  } else {
    if (s.dtype == DType::bf16) r.device.emplace_back("master", buffer(s, trained * 4));
    r.device.emplace_back("optimizer", 2 * buffer(s, trained * acc));
  }
  r.device.emplace_back("gradients", buffer(s, trained * acc));

  // The K/V store (model/kv_store.h): per layer K, V in the compute dtype, dK, dV in the accumulator
  // dtype; with saved attention outputs also O [B, T, H, D] and lse [B, H, T]; with saved inputs
  // x_l [B, T, C].
  const size_t kv_elems = size_t(B * T * Hkv * D), out_elems = size_t(B * T * H * D), lse_elems = size_t(B * T * H);
  const size_t in_elems = size_t(B * T * C);
  size_t kv_layer = 2 * buffer(s, kv_elems * e) + 2 * buffer(s, kv_elems * acc);
  if (s.saved) kv_layer += buffer(s, out_elems * e) + buffer(s, lse_elems * acc);
  if (s.inputs) kv_layer += buffer(s, in_elems * e);
  const size_t kv_host = (2 * kv_elems * (e + acc) + (s.saved ? out_elems * e + lse_elems * acc : 0) +
                          (s.inputs ? in_elems * e : 0)) * size_t(L);
  if (s.streamed) {
    // Three device slots of one chunk-sized block of every part.
    const size_t rows = size_t(B * s.chunk);
    size_t block = 2 * buffer(s, rows * size_t(Hkv * D) * e) + 2 * buffer(s, rows * size_t(Hkv * D) * acc);
    if (s.saved) block += buffer(s, rows * size_t(H * D) * e) + buffer(s, rows * size_t(H) * acc);
    r.device.emplace_back("kv", 3 * block);
    r.host.emplace_back("kv", kv_host);
  } else if (s.o.layer_local_kv_grads(T, L)) {
    // One backward chunk of all T tokens: one layer's dK, dV serve every layer (layer-local gradients).
    const size_t grads = 2 * buffer(s, kv_elems * acc);
    r.device.emplace_back("kv", (kv_layer - grads) * size_t(L) + grads);
  } else {
    const int64_t device_layers = s.windowed ? s.o.offload_window : L;
    r.device.emplace_back("kv", kv_layer * size_t(device_layers));
    if (s.windowed) r.host.emplace_back("kv", kv_host);
  }

  // Activations: the schedule's arena over the step, and the step's other transient buffers.
  const StepArena arena =
      replay_step_arena({cf, B, T, s.o, s.dtype, s.lora, s.device, 0, !s.doc_starts.empty(), s.cp});
  r.arena_blocks = arena.block_lines;
  r.attention_workspace_bytes = arena.attention_workspace;
  size_t activations = 0;
  for (const size_t b : arena.blocks) activations += buffer(s, b);
  for (const size_t b : arena.input_slots) activations += buffer(s, b);
  r.device.emplace_back("activations", activations);
  if (activation_policy(s.o, s.lora).offload_inputs) r.host.emplace_back("layer inputs", size_t(L) * in_elems * e);
  // The RoPE tables (f32 on a GPU, the compute dtype on the CPU) and, on a GPU, cuBLASLt's workspace.
  const size_t rope = size_t(T) * size_t(D / 2) * (s.device.is_cpu() ? e : 4);
  r.device.emplace_back("other", 2 * buffer(s, rope) + (s.device.is_cpu() ? 0 : kCublasWorkspaceBytes));
  // Context parallelism: an exchange's send and receive buffers (parallel/context_parallel.cpp), each
  // P blocks of the rank's tokens of the heads exchanged, while the exchange runs: the queries' are
  // the widest (H heads; the keys' are Hkv, or P <= H where the ranks outnumber the K/V heads).
  if (s.cp > 1) {
    const int64_t rows = B * std::max(s.chunk, s.bwd_chunk) / s.cp;
    r.device.emplace_back("cp exchange", 2 * buffer(s, size_t(rows * cf.num_attention_heads * D) * e));
  }
}

}  // namespace cw
