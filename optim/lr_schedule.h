// The learning-rate schedule: linear warmup, then a decay to a floor.
//
// Steps count from 1, the first optimizer step. With W = warmup_steps, N = total_steps:
//   step <= W          lr = peak * step / W            (peak/W at step 1, peak at step W)
//   W < step <= N      progress = (step - W) / (N - W)  in (0, 1]
//                        cosine    min + (peak - min) * 0.5 * (1 + cos(pi * progress))
//                        linear    min + (peak - min) * (1 - progress)
//                        constant  peak
//   step > N           the value at N (min, or peak for constant): a run extended past its plan
//                      keeps training at the floor rather than failing
// W = 0 means no warmup: decay starts from peak at step 0, so step 1 is already slightly below it.
// W may exceed N (a short run with the default warmup): the run then ends during the warmup.
#pragma once

#include <cstdint>
#include <string>

namespace cw {

struct LrSchedule {
  enum class Decay { cosine, linear, constant };

  double peak_lr = 3e-4;        // optimizer.lr
  double min_lr = 0.0;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;      // train.steps
  Decay decay = Decay::cosine;

  // The learning rate of optimizer step `step` (>= 1). Validates first.
  double at(int64_t step) const;
  // peak_lr > 0, min_lr >= 0 and (unless constant) <= peak_lr, warmup_steps >= 0, total_steps >= 1;
  // throws naming the run-config option: optimizer.lr, optimizer.min_lr, optimizer.warmup_steps,
  // train.steps.
  void validate() const;

  // "cosine" | "linear" | "constant"; throws naming optimizer.decay and the choices otherwise.
  static Decay parse(const std::string& name);
  static const char* name(Decay decay);
};

}  // namespace cw
