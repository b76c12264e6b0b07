// The watchdog thread (contract in watchdog.h).
#include "parallel/watchdog.h"

#include "engine/error.h"

#include <algorithm>
#include <exception>

namespace cw {

Seconds comm_timeout_from(const Environment& env) {
  return seconds_from(env, "CHUNKWISE_COMM_TIMEOUT_S", Seconds(600));
}

Watchdog::Watchdog(Seconds timeout, WatchdogHooks hooks, std::string hint, Seconds poll_interval)
    : timeout_(timeout), poll_interval_(poll_interval), hooks_(std::move(hooks)), hint_(std::move(hint)) {
  CW_CHECK(timeout_.count() > 0, "watchdog: the timeout must be positive, not {} s", timeout_.count());
  CW_CHECK(poll_interval_.count() > 0, "watchdog: the poll interval must be positive, not {} s", poll_interval_.count());
  CW_CHECK(static_cast<bool>(hooks_.abort), "watchdog: an abort callable is required");
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void Watchdog::watch(std::string what, std::function<bool()> is_done) {
  std::lock_guard lock(mutex_);
  if (!failure_.empty()) fail(failure_, hint_);
  pending_.push_back(std::make_shared<Work>(Work{std::move(what), std::move(is_done), std::chrono::steady_clock::now()}));
}

void Watchdog::wait(const std::function<bool()>& is_done) const {
  // Poll: short sleeps first (a barrier is usually done within microseconds), then up to 1 ms.
  auto pause = std::chrono::microseconds(10);
  for (;;) {
    throw_if_failed();
    if (is_done()) return;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

void Watchdog::wait_all() const {
  std::vector<std::shared_ptr<Work>> snapshot;
  {
    std::lock_guard lock(mutex_);
    snapshot = pending_;
  }
  for (const std::shared_ptr<Work>& w : snapshot) wait(w->is_done);
}

bool Watchdog::failed() const {
  std::lock_guard lock(mutex_);
  return !failure_.empty();
}

std::string Watchdog::failure() const {
  std::lock_guard lock(mutex_);
  return failure_;
}

void Watchdog::throw_if_failed() const {
  const std::string f = failure();
  if (!f.empty()) fail(f, hint_);
}

void Watchdog::fire(const std::string& failure) {
  {
    std::lock_guard lock(mutex_);
    failure_ = failure;
  }
  try {
    hooks_.abort(failure);
  } catch (const std::exception&) {
    // The failure is recorded; an abort that fails too has nothing better to report.
  }
}

void Watchdog::run() {
  std::string failure;
  try {
    if (hooks_.thread_setup) hooks_.thread_setup();
  } catch (const std::exception& e) {
    failure = CW_FORMAT("watchdog: setting up its thread failed: {}", e.what());
  }
  while (failure.empty()) {
    std::vector<std::shared_ptr<Work>> snapshot;
    {
      std::unique_lock lock(mutex_);
      wake_.wait_for(lock, poll_interval_, [this] { return stop_; });
      if (stop_) return;
      snapshot = pending_;
    }
    // Without the lock: is_done and health may take the backend's own locks.
    std::vector<const Work*> finished;
    try {
      const auto now = std::chrono::steady_clock::now();
      for (const std::shared_ptr<Work>& w : snapshot) {
        if (w->is_done()) {
          finished.push_back(w.get());
        } else if (now - w->started > timeout_) {
          failure = CW_FORMAT("{} did not finish within {} s", w->what, timeout_.count());
          break;  // the oldest overdue work names the failure
        }
      }
      if (failure.empty() && hooks_.health) failure = hooks_.health();
    } catch (const std::exception& e) {
      failure = CW_FORMAT("watchdog: checking the pending collectives failed: {}", e.what());
    }
    std::lock_guard lock(mutex_);
    std::erase_if(pending_, [&](const std::shared_ptr<Work>& w) {
      return std::find(finished.begin(), finished.end(), w.get()) != finished.end();
    });
  }
  fire(failure);
}

}  // namespace cw
