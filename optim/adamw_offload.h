// AdamW with its state in host memory: the master weights and both moments live on the host and the
// update runs on the host's cores, while the compute weights and the gradients stay on the device
// (ZeRO-Offload's split of a training step, for one process). For an 8B model that is 96 GB of host
// memory (f32 master, m and v: 12 bytes a parameter) off a device that keeps 16 GB of bf16 weights
// and 32 GB of f32 gradients.
//
// The arithmetic is optim/adamw.h's, element for element: the CPU adamw_update op (f64 arithmetic,
// each result rounded once to the state's dtype), so an offloaded step gives the bits AdamW::step
// gives on the CPU, and agrees with the GPU's f32 kernel to f32 rounding.
//
// One step walks the flat parameter vector (table order, ParamSet::flat) in pieces of piece_elems,
// from the end (the order in which a backward completes the gradient); for piece i:
//   1. its gradients are copied device -> host into staging slot i % kSlots (the device's side
//      stream, after the compute queued so far: the backward that wrote them);
//   2. the host's threads update it (master, m, v in place) and write its new compute weights
//      (rounded to the compute dtype) into the slot's outgoing staging;
//   3. those are copied host -> device into the compute weights.
// The copies of the next pieces in and of the previous one out run while the host updates piece i;
// the compute stream waits for the last copy out before the next op, so the next step reads the new
// weights. Memory: the state on the host, plus kSlots x piece_elems x (gradient + compute bytes) of
// pinned staging; nothing on the device.
// On the CPU (tests) the copies are memcpys and the same loop runs.
//
// What it does not do: start before the backward ends. Clipping and the non-finite guard need the
// global gradient norm before any element is updated, so the update cannot begin while the last
// backward still runs (ZeRO-Offload's CPU step waits for the backward too).
#pragma once

#include "engine/engine.h"
#include "optim/adamw.h"

#include <cstdint>
#include <vector>

namespace cw {

class OffloadedAdamW {
 public:
  static constexpr int kSlots = 3;
  static constexpr int64_t kDefaultPieceElems = int64_t(16) << 20;  // 64 MiB of f32 gradients

  // master: the master weights in host memory (f32 or f64), the table of what is trained; the
  // moments are made like it (host, zero). device: where the gradients and compute weights live.
  OffloadedAdamW(const ParamSet& master, Device device, const AdamWOptions& options = {},
                 int64_t piece_elems = kDefaultPieceElems);

  // One step at learning rate lr: master (host) updated in place from grads (device, f32 or f64,
  // the master's table), compute (device, the master's table; bf16, f32 or f64) overwritten with the
  // new master weights in its dtype.
  void step(const ParamSet& master, const ParamSet& grads, double lr, const ParamSet& compute);

  // The state as an AdamW (moments, step count, options): checkpoints save and load it in AdamW's
  // format, so a run can resume with or without the offload. Its own step() is not to be called.
  AdamW& state() { return adamw_; }
  const AdamW& state() const { return adamw_; }
  int64_t piece_elems() const { return piece_; }
  size_t staging_bytes() const;  // pinned host bytes of the staging slots (allocated on the first step)
  // The staging slots' bytes for a vector of `numel` elements (what staging_bytes() will be).
  static size_t staging_bytes_for(int64_t numel, DType grad_dtype, DType compute_dtype,
                                  int64_t piece_elems = kDefaultPieceElems);

 private:
  void update_piece(const ParamSet& master, int64_t begin, int64_t length, const void* grad, DType grad_dtype,
                    void* compute, DType compute_dtype, double lr);

  AdamW adamw_;
  Device device_;
  int64_t piece_;
  std::vector<DecayRun> runs_;  // the whole vector, tensor by tensor
  std::vector<StagingBuffer> grad_stage_, compute_stage_;
};

}  // namespace cw
