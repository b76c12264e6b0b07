// Context parallelism's collectives a step, one rank's (model/cp_group.h; the exchanges are
// model/layer.cpp's seams). Per layer and chunk: a forward that attends exchanges q, k and v to the
// rank's heads and the output back (4 all-to-alls), a forward from saved attention outputs q and the
// output (2), a backward d_attn, d_q, dK and dV (4). The prefill's chunks run forwards; each reverse
// chunk a forward (two where layers are recomputed before their backward: checkpointed, recompute
// full) and a backward. An exchange's buffer is P blocks of the rank's tokens of the heads exchanged:
// every query head, or P times the rank's K/V heads for keys and values; a rank sends (P - 1) / P of
// it. The gradient is all-reduced once a step: 2 (P - 1) / P of its bytes over each GPU's link (a ring).
#include "model/llama.h"
#include "optim/chunks.h"
#include "tools/planner/step.h"

#include <cmath>

namespace cw {

void plan_context_parallel(const StepPlan& s, PlanReport& r) {
  const LlamaConfig& cf = s.cf;
  const ScheduleOptions& o = s.o;
  const double P = double(s.cp), bus = (P - 1) / P;
  const double L = double(cf.num_hidden_layers), D = double(cf.head_dim), e = double(s.e);
  // Bytes per token of the rank in one exchange of queries (or the output), and of keys (or values).
  const double q = double(cf.num_attention_heads) * D * e;
  const double kv = P * double(s.store.num_key_value_heads) * D * e;
  // Replicated K/V heads' gradients are exchanged in the accumulation dtype (model/layer.cpp
  // read_store_grad), to be summed before they are rounded.
  const bool replicated = s.store.num_key_value_heads * s.cp > cf.num_key_value_heads;
  const double d_kv = replicated ? kv / e * double(s.acc) : kv;
  const double attend = 2 * q + 2 * kv, from_saved = 2 * q, backward = 2 * q + 2 * d_kv;
  // spaco visits keep of the reverse chunks.
  const double reverse_chunks = std::ceil(double(s.T) / double(s.bwd_chunk));
  const double reverse = o.kind == ScheduleKind::spaco && o.keep > 0 ? std::min(1.0, double(o.keep) / reverse_chunks) : 1;
  const double extra_forward = activation_policy(o, s.lora).keep_layers ? 0 : 1;
  // The rank's tokens over the prefill, over the whole sequence, and past the prefill's end (seco's
  // last chunk, whose forward attends even with saved outputs).
  const double prefill_tokens = double(s.B * s.prefill_end) / P, all = double(s.B * s.T) / P;
  const double unsaved = all - prefill_tokens;
  const double forward = s.saved ? prefill_tokens * from_saved + unsaved * attend : all * attend;
  r.cp_exchange_bytes =
      bus * L * (prefill_tokens * attend + reverse * (forward + all * (extra_forward * attend + backward)));
  const double prefill_chunks = std::ceil(double(s.prefill_end) / double(s.chunk));
  const double unsaved_chunks = std::ceil(double(s.T - s.prefill_end) / double(s.bwd_chunk));
  const double forward_count =
      s.saved ? 2 * (reverse_chunks - unsaved_chunks) + 4 * unsaved_chunks : 4 * reverse_chunks;
  r.cp_all_to_alls = static_cast<int64_t>(std::llround(
      L * (4 * prefill_chunks + reverse * (forward_count + reverse_chunks * (4 * extra_forward + 4)))));
  r.cp_all_reduce_bytes = 2 * bus * double(trained_parameter_count(cf, s.lora)) * double(s.acc);
}

}  // namespace cw
