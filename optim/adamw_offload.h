// AdamW with its state in host memory: the master weights and both moments live on the host, while
// the compute weights and the gradients stay on the device (ZeRO-Offload's split of a training step,
// for one process). For an 8B model that is 96 GB of host memory (f32 master, m and v: 12 bytes a
// parameter) off a device that keeps 16 GB of bf16 weights and 32 GB of f32 gradients.
//
// Two ways to update, both walking the flat parameter vector (table order, ParamSet::flat) in pieces
// of piece_elems from the end (the order in which a backward completes the gradient):
//
// Streamed through the device (a GPU and an f32 state; the update takes 29% less time than on the
// host's cores, a 1B model on an H100 with 16 cores): the state is page-locked where it lies, and for
// piece i its master, m and v go in on one copy lane to device slot i % kSlots, AdamW's device kernel
// updates them from the device's gradients (writing the bf16 compute weights in place), and they go
// home on the other lane while the next pieces come in: 12 bytes in and 12 out an element, both lanes
// at once, the host idle. The arithmetic is the GPU's adamw_update kernel, so a streamed step gives
// the bits of AdamW kept on the device. Memory: kSlots x 3 x piece_elems x 4 bytes on the device. The
// step returns when the state is home.
//
// On the host's cores (on the CPU, or an f64 state): the arithmetic is the CPU adamw_update op
// (f64 arithmetic, each result rounded once to the state's dtype), so a step gives the bits AdamW::step
// gives on the CPU, and agrees with the GPU's f32 kernel to f32 rounding. For piece i:
//   1. its gradients are copied device -> host into staging slot i % kSlots (the device's side
//      stream, after the compute queued so far: the backward that wrote them);
//   2. the host's threads update it (master, m, v in place) and write its new compute weights
//      (rounded to the compute dtype) into the slot's outgoing staging;
//   3. those are copied host -> device into the compute weights.
// The copies of the next pieces in and of the previous one out run while the host updates piece i;
// the compute stream waits for the last copy out before the next op, so the next step reads the new
// weights. Memory: the state on the host, plus kSlots x piece_elems x (gradient + compute bytes) of
// pinned staging; nothing on the device. (Measured on a 16-core GPU machine: 2.3 G elements a second.)
// On the CPU (tests) the copies are memcpys and the same loop runs.
//
// What it does not do: start before the backward ends. Clipping and the non-finite guard need the
// global gradient norm before any element is updated, so the update cannot begin while the last
// backward still runs (ZeRO-Offload's CPU step waits for the backward too).
#pragma once

#include "engine/engine.h"
#include "engine/memory.h"
#include "optim/adamw.h"

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

namespace cw {

class OffloadedAdamW {
 public:
  static constexpr int kSlots = 3;
  static constexpr int64_t kDefaultPieceElems = int64_t(8) << 20;  // 32 MiB of f32 gradients

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
  // The mutable state gives up the streamed step's page-locking first: a load may replace the moments'
  // memory, which must not be freed while locked (the next step locks what is there then).
  AdamW& state() {
    pinned_.clear();
    pinned_at_ = {};
    return adamw_;
  }
  const AdamW& state() const { return adamw_; }
  int64_t piece_elems() const { return piece_; }
  size_t staging_bytes() const;  // pinned host bytes of the staging slots (allocated on the first step)
  // Whether a step updates on the device, the state streamed through it (a GPU and f32 state), or
  // on the host's cores; and the device bytes of its slots then (kSlots x master, m, v of a piece).
  static bool streams(Device device, DType state_dtype);
  bool streams() const { return streams(device_, adamw_.exp_avg_.dtype()); }
  static size_t device_staging_bytes_for(int64_t numel, DType state_dtype, int64_t piece_elems = kDefaultPieceElems);
  size_t device_staging_bytes() const;
  // The staging slots' bytes for a vector of `numel` elements (what staging_bytes() will be).
  static size_t staging_bytes_for(int64_t numel, DType grad_dtype, DType compute_dtype,
                                  int64_t piece_elems = kDefaultPieceElems);

 private:
  void update_piece(const ParamSet& master, int64_t begin, int64_t length, const void* grad, DType grad_dtype,
                    void* compute, DType compute_dtype, double lr);
  // The step streamed through the device (streams()): each piece's master, m and v in, AdamW's device
  // kernel on them and the device's gradients, master, m and v home again.
  void step_streamed(const ParamSet& master, const ParamSet& grads, double lr, const ParamSet& compute);

  AdamW adamw_;
  Device device_;
  int64_t piece_;
  std::vector<StagingBuffer> grad_stage_, compute_stage_;
  std::vector<Buffer> state_stage_;  // streamed: [slot * 3 + (master, m, v)] on the device
  std::vector<std::unique_ptr<PinnedRegion>> pinned_;  // streamed: master, m and v page-locked
  std::array<void*, 3> pinned_at_{};
};

}  // namespace cw
