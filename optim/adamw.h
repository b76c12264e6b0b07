// AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization") on CPU master weights, and
// the gradient helpers a training step needs before it: global norm, clipping, finiteness.
//
// For every parameter element p with gradient g, at optimizer step t = 1, 2, ...:
//   m     = b1 m + (1 - b1) g
//   v     = b2 v + (1 - b2) g^2
//   mhat  = m / (1 - b1^t)                 bias correction: m and v start at 0
//   vhat  = v / (1 - b2^t)
//   p    -= lr (mhat / (sqrt(vhat) + eps) + wd p)
// The decay term uses p before the update and is decoupled: it is not fed through m and v, so it is
// not rescaled by the adaptive denominator. lr is given per step (optim/lr_schedule.h); wd is
// applied only to the tensors selected for decay, and is 0 for the others:
//   decayed   the linear weights (q/k/v/o, gate/up/down), an untied lm_head.weight and LoRA's A and B
//             (as HF's Trainer decays every non-norm, non-bias parameter of a PEFT model)
//   optional  the norm weights and the q/k/v biases (decay_norms: HF's Trainer decays neither) and
//             model.embed_tokens.weight (decay_embeddings); a tied
//             model's embedding is also its head and follows decay_embeddings
// Pulling norm gains (which sit at 1) or embedding rows (most of which see no gradient in a step)
// towards zero is not a regulariser anyone wants by default.
//
// State layout: two ParamSets with the parameters' table and dtype (f32 or f64): exp_avg holds m and
// exp_avg_sq holds v, element for element with the parameters, plus the step count t (the number of
// completed steps). The arithmetic of one element is done in f64 and rounded once to the state
// dtype. One plain loop in table order, no threads: the same inputs give the same bits.
//
// On disk (save/load) the state is one safetensors file holding "exp_avg/<HF name>" and
// "exp_avg_sq/<HF name>" for every parameter, in the state's dtype, and the metadata
//   {"step": "<t>", "beta1", "beta2", "eps", "weight_decay", "decay_norms", "decay_embeddings"}.
// load restores the moments and t bit-exactly. The hyperparameters in the file are a record, not
// a setting: a resumed run uses this optimizer's options (it may change them on purpose).
#pragma once

#include "model/params.h"

#include <cstdint>
#include <string>
#include <vector>

namespace cw {

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  bool decay_norms = false;       // also decay the RMSNorm gains and the q/k/v biases
  bool decay_embeddings = false;  // also decay model.embed_tokens.weight (tied: the head too)

  void validate() const;  // throws naming the option ("optimizer.beta1", ...)
};

class AdamW {
 public:
  // State for parameters with the table, dtype (f32 or f64) and device of `like` (the model's table,
  // or a LoRA adapters' set), moments zero, t = 0.
  AdamW(const ParamSet& like, const AdamWOptions& options = {});
  AdamW(const LlamaConfig& config, DType dtype, const AdamWOptions& options = {}, Device device = Device::host());

  // One step at learning rate lr (>= 0, finite): updates params (the master weights) in place.
  // grads (f32 or f64) must have the parameters' table and device; params must have the state's
  // dtype. compute_copy (the GPU's bf16 compute weights, same table and device), when given,
  // receives the updated master weights rounded to bf16 in the same kernel.
  void step(const ParamSet& params, const ParamSet& grads, double lr, const ParamSet* compute_copy = nullptr);

  // Whether the tensor with this spec receives weight decay under these options.
  bool decays(const ParamSpec& spec) const;

  int64_t steps() const { return step_; }
  const AdamWOptions& options() const { return options_; }
  const ParamSet& exp_avg() const { return exp_avg_; }
  const ParamSet& exp_avg_sq() const { return exp_avg_sq_; }

  // Writes the state atomically (see the header). Throws naming the path on failure.
  void save(const std::string& path) const;
  // Replaces the state with the file's. Every tensor must be present, with the state's shape and
  // dtype, and no other tensor may be there; "step" must be a non-negative integer. Throws naming
  // the file and the tensor or key, leaving the state unchanged.
  void load(const std::string& path);

 private:
  friend class OffloadedAdamW;  // the same state, updated piece by piece on the host (optim/adamw_offload.h)

  AdamWOptions options_;
  ParamSet exp_avg_, exp_avg_sq_;
  int64_t step_ = 0;
};

// Whether a tensor with this spec receives weight decay under these options (see the header).
bool adamw_decays(const AdamWOptions& options, const ParamSpec& spec);

// The range [begin, end) of the flat parameter vector (ParamSet::flat, table order) cut at tensor
// boundaries, each run with its tensor's weight decay: what an update over a range applies
// (AdamWShard, OffloadedAdamW).
struct DecayRun {
  int64_t begin = 0, length = 0;  // in the flat vector
  double weight_decay = 0;
};
std::vector<DecayRun> decay_runs(const ParamSet& like, const AdamWOptions& options, int64_t begin, int64_t end);

// AdamW on one contiguous range [begin, end) of the flat parameter vector (every tensor of the
// table, in table order, as ParamSet::flat() lays them out): ZeRO's sharded optimizer, where rank r
// keeps the moments of its own range only (parallel/data_parallel.h). Element for element it is
// AdamW::step: the same engine op on each piece of a tensor the range covers, with that tensor's
// weight decay, so a set of shards that tile the vector gives the bits of one AdamW.
// State: exp_avg and exp_avg_sq [end - begin] in the parameters' dtype and device, and the step t.
// On disk: one safetensors file with "exp_avg" and "exp_avg_sq" [end - begin] and the metadata
// {"step", "begin", "end", "numel"} and the hyperparameters (a record, as AdamW's); load requires
// the same range of a vector of the same length.
class AdamWShard {
 public:
  AdamWShard(const ParamSet& like, int64_t begin, int64_t end, const AdamWOptions& options = {});

  // One step at learning rate lr: params' elements in the range, from grads' elements in the range
  // (both full-table sets; nothing outside the range is read or written). compute_copy, when
  // given, receives the updated range rounded to bf16, as in AdamW::step.
  void step(const ParamSet& params, const ParamSet& grads, double lr, const ParamSet* compute_copy = nullptr);

  int64_t begin() const { return begin_; }
  int64_t end() const { return end_; }
  int64_t steps() const { return step_; }
  const Tensor& exp_avg() const { return exp_avg_.tensor; }
  const Tensor& exp_avg_sq() const { return exp_avg_sq_.tensor; }
  size_t bytes() const { return exp_avg_.tensor.bytes() + exp_avg_sq_.tensor.bytes(); }

  void save(const std::string& path) const;  // atomic; throws naming the path
  void load(const std::string& path);        // throws naming the file and what differs; state unchanged then

 private:
  AdamWOptions options_;
  int64_t begin_ = 0, end_ = 0, numel_ = 0;
  std::vector<DecayRun> pieces_;  // the range cut at tensor boundaries, in order
  OwnedTensor exp_avg_, exp_avg_sq_;  // on the parameters' device
  int64_t step_ = 0;
};

// sqrt of the sum of every squared element (f32 or f64), accumulated in f64 in table order (on a
// GPU: in a fixed order of per-block f64 partials, cw::sum_squares).
double grad_global_norm(const ParamSet& grads);
// Scales grads in place by max_norm / norm when norm > max_norm, so that their global norm becomes
// max_norm; returns the norm before clipping. max_norm <= 0 disables clipping. A non-finite norm is
// returned without scaling (scaling would only spread the NaN): the caller skips such a step.
double clip_grad_norm(const ParamSet& grads, double max_norm);
// Whether every element (f32, f64 or bf16) is finite (on a GPU: whether the sum of squares is).
bool all_finite(const ParamSet& set);

}  // namespace cw
