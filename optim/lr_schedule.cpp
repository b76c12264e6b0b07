#include "optim/lr_schedule.h"

#include "engine/error.h"

#include <fmt/format.h>

#include <cmath>
#include <numbers>

namespace cw {

// Option names are the run config's: peak_lr is optimizer.lr, total_steps is train.steps.
void LrSchedule::validate() const {
  if (!(std::isfinite(peak_lr) && peak_lr > 0.0))
    fail(fmt::format("optimizer.lr = {} must be positive", peak_lr), "typical values are 1e-4 to 3e-3");
  if (!(std::isfinite(min_lr) && min_lr >= 0.0))
    fail(fmt::format("optimizer.min_lr = {} must be >= 0", min_lr), "a common choice is optimizer.lr / 10");
  // A constant rate never reaches min_lr, so only a decay makes the pair inconsistent.
  if (decay != Decay::constant && min_lr > peak_lr)
    fail(fmt::format("optimizer.min_lr = {} must be <= optimizer.lr = {}", min_lr, peak_lr),
         "the decay goes from optimizer.lr down to optimizer.min_lr");
  if (warmup_steps < 0) fail(fmt::format("optimizer.warmup_steps = {} must be >= 0", warmup_steps));
  if (total_steps < 1) fail(fmt::format("train.steps = {} must be >= 1", total_steps));
}

double LrSchedule::at(int64_t step) const {
  validate();
  CW_CHECK(step >= 1, "learning-rate schedule asked for step {}; steps count from 1", step);
  if (step <= warmup_steps) return peak_lr * static_cast<double>(step) / static_cast<double>(warmup_steps);
  if (decay == Decay::constant) return peak_lr;
  // step > warmup_steps here, so total_steps > warmup_steps whenever step < total_steps.
  const double progress = step >= total_steps ? 1.0
                                              : static_cast<double>(step - warmup_steps) /
                                                    static_cast<double>(total_steps - warmup_steps);
  if (decay == Decay::linear) return min_lr + (peak_lr - min_lr) * (1.0 - progress);
  return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

LrSchedule::Decay LrSchedule::parse(const std::string& name) {
  if (name == "cosine") return Decay::cosine;
  if (name == "linear") return Decay::linear;
  if (name == "constant") return Decay::constant;
  fail(fmt::format("optimizer.decay = '{}' is not a known decay", name), "use cosine, linear or constant");
}

const char* LrSchedule::name(Decay decay) {
  switch (decay) {
    case Decay::cosine: return "cosine";
    case Decay::linear: return "linear";
    case Decay::constant: return "constant";
  }
  return "?";
}

}  // namespace cw
