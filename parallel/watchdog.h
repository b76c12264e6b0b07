// The watchdog: turns a collective that never finishes into an error instead of a silent hang.
//
// A backend registers every collective it issues with watch(what, is_done); a thread polls the
// pending ones (every poll interval) and the backend's health check. When the oldest pending work is
// older than the timeout, or the health check reports an error (NCCL: ncclCommGetAsyncError, e.g. a
// peer's connection closed because its process died), the watchdog records one failure message and
// calls abort(message) once, from its thread (NCCL: ncclCommAbort, which ends the kernels waiting for
// the dead peer; the NCCL backend then also ends the process unless told not to). After that, every
// throw_if_failed() and wait() throws the failure as a cw::Error.
//
// Why a thread: the host may be blocked where no collective call of ours runs (in a stream sync, a
// copy to the host), waiting for a GPU kernel that waits for a peer that is gone.
// Why the callables: the logic is the same for any backend and is tested on the CPU with fakes.
// Callbacks run without the watchdog's lock held (abort may take the backend's lock, which the
// backend may hold while it calls watch()); is_done may be called from the watchdog thread and
// from wait() concurrently, so it must be thread-safe.
//
// Timeout: CHUNKWISE_COMM_TIMEOUT_S (seconds, > 0), default 600: a collective of a training step
// waits for the slowest rank's step, which at long contexts can take minutes.
// Tested in tests/parallel/test_watchdog.cpp.
#pragma once

#include "parallel/bootstrap.h"  // Seconds, seconds_from
#include "parallel/launch.h"

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace cw {

Seconds comm_timeout_from(const Environment& env);

struct WatchdogHooks {
  std::function<void(const std::string& failure)> abort;  // required: called once, on the watchdog thread
  std::function<std::string()> health;                     // optional: "" while healthy, else the error
  std::function<void()> thread_setup;                      // optional: first thing on the thread (e.g. set the GPU)
};

class Watchdog {
 public:
  // `hint` is the cw::Error's hint on every failure (what the user can do about it).
  Watchdog(Seconds timeout, WatchdogHooks hooks, std::string hint = "",
           Seconds poll_interval = std::chrono::milliseconds(10));
  ~Watchdog();  // stops the thread; never aborts
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // A work issued now, described by `what` (e.g. "all_reduce of 1024 x bf16 on rank 0 of 2"); the
  // watchdog forgets it once is_done() is true. Throws the failure if the watchdog already fired.
  void watch(std::string what, std::function<bool()> is_done);

  // Blocks the calling thread until is_done() is true; throws the failure if the watchdog fires first.
  void wait(const std::function<bool()>& is_done) const;
  // Blocks until no watched work is pending; throws the failure if the watchdog fires first.
  void wait_all() const;

  bool failed() const;
  std::string failure() const;  // "" until it fires
  void throw_if_failed() const;
  Seconds timeout() const { return timeout_; }

 private:
  struct Work {
    std::string what;
    std::function<bool()> is_done;
    std::chrono::steady_clock::time_point started;
  };
  void run();
  void fire(const std::string& failure);

  const Seconds timeout_, poll_interval_;
  const WatchdogHooks hooks_;
  const std::string hint_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;  // stop requests
  std::vector<std::shared_ptr<Work>> pending_;  // in issue order
  std::string failure_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace cw
