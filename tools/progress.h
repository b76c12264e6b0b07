// Where a long training step is. A SeCO step at a million tokens takes minutes; the schedule tells
// its progress hook (optim/schedule.h, StepHooks::progress) after every chunk, and StepProgress shows
// it once the step has run `quiet_s` seconds: on a terminal a bar redrawn in place, in a log a plain
// line every `every_s` seconds, e.g.
//   step 3: backward 37/256 chunks (14%), 2m10s into the step
// Short steps print nothing. The unit of work need not be a step: an eval's windows (tools/eval.h)
// show as
//   window 2/16: prefill 9/16 chunks (56%), 1m40s into the window
#pragma once

#include <chrono>
#include <cstdint>
#include <ostream>
#include <string>

namespace cw {

class Schedule;

class StepProgress {
 public:
  // unit: what a line calls the work ("step", "window").
  StepProgress(std::ostream& out, bool tty, double quiet_s = 10, double every_s = 30, std::string unit = "step");

  void start(int64_t step, int64_t of = 0);                     // a step begins (of > 0: step of `of`)
  void update(const char* phase, int64_t done, int64_t total);  // the schedule's hook
  void finish();                                                // the step ended: a drawn bar is cleared
  // Becomes the schedule's progress hook (its other hooks kept); this object must outlive its steps.
  void attach(Schedule& schedule);

 private:
  std::ostream& out_;
  bool tty_;
  double quiet_s_, every_s_;
  std::string unit_;
  int64_t step_ = 0, of_ = 0;
  std::chrono::steady_clock::time_point t0_;
  double last_shown_ = -1;  // seconds into the step of the last line or redraw; -1: nothing shown
};

// "1m05s", "2h03m": a duration for progress lines.
std::string short_duration(double seconds);

}  // namespace cw
