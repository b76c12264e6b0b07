#include "tools/progress.h"

#include "optim/schedule.h"

#include <fmt/format.h>

#include <utility>

namespace cw {

std::string short_duration(double seconds) {
  const int64_t t = static_cast<int64_t>(seconds + 0.5);
  return t >= 3600 ? fmt::format("{}h{:02}m", t / 3600, (t / 60) % 60) : fmt::format("{}m{:02}s", t / 60, t % 60);
}

StepProgress::StepProgress(std::ostream& out, bool tty, double quiet_s, double every_s, std::string unit)
    : out_(out), tty_(tty), quiet_s_(quiet_s), every_s_(every_s), unit_(std::move(unit)) {}

void StepProgress::start(int64_t step, int64_t of) {
  step_ = step;
  of_ = of;
  t0_ = std::chrono::steady_clock::now();
  last_shown_ = -1;
}

void StepProgress::update(const char* phase, int64_t done, int64_t total) {
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  if (s < quiet_s_) return;
  // A terminal redraws at most once a second; a log gets a line every every_s seconds.
  if (last_shown_ >= 0 && s - last_shown_ < (tty_ ? 1.0 : every_s_)) return;
  last_shown_ = s;
  const int64_t pct = total > 0 ? 100 * done / total : 0;
  const std::string which = of_ > 0 ? fmt::format("{}/{}", step_, of_) : fmt::format("{}", step_);
  const std::string line = fmt::format("{} {}: {} {}/{} chunks ({}%), {} into the {}", unit_, which, phase, done,
                                       total, pct, short_duration(s), unit_);
  if (tty_)
    out_ << "\r\033[K" << line << std::flush;
  else
    out_ << line << "\n" << std::flush;
}

void StepProgress::finish() {
  if (tty_ && last_shown_ >= 0) out_ << "\r\033[K" << std::flush;
  last_shown_ = -1;
}

void StepProgress::attach(Schedule& schedule) {
  StepHooks hooks = schedule.hooks();
  hooks.progress = [this](const char* phase, int64_t done, int64_t total) { update(phase, done, total); };
  schedule.set_hooks(std::move(hooks));
}

}  // namespace cw
