// parallel/watchdog.h with fake works: one that never completes must abort (once) and raise an
// error naming it within the timeout; works that complete must never fire; a health check's error
// must abort at once.
#include "parallel/watchdog.h"

#include "parallel/comm_nccl.h"

#include "engine/error.h"

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>

using namespace cw;

namespace {

// How much later than its timeout the watchdog may fire: its poll interval plus scheduling on a
// loaded two-core machine.
constexpr double kLateSeconds = 2.0;

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return Seconds(Clock::now() - t).count(); }

// An "is it done?" that says yes once `seconds` have passed: a watchdog that should have fired by
// then lets wait() return normally, so the test fails instead of hanging.
std::function<bool()> done_after(double seconds) {
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(Seconds(seconds));
  return [until] { return Clock::now() > until; };
}

// Records every abort call.
struct AbortLog {
  std::mutex mutex;
  int calls = 0;
  std::string failure;
  std::thread::id thread;
  WatchdogHooks hooks() {
    WatchdogHooks h;
    h.abort = [this](const std::string& f) {
      std::lock_guard lock(mutex);
      ++calls;
      failure = f;
      thread = std::this_thread::get_id();
    };
    return h;
  }
};

}  // namespace

TEST_CASE("watchdog: a work that never completes fails within the timeout, naming the collective") {
  AbortLog log;
  const double timeout = 0.3;
  Watchdog watchdog(Seconds(timeout), log.hooks(), "what to do");
  const std::string what = "all_reduce of 1024 x bf16 on rank 0 of 2 (GPU 0)";
  const auto start = Clock::now();
  watchdog.watch(what, done_after(timeout + kLateSeconds));
  const std::string expected = what + " did not finish within 0.3 s";
  CHECK_THROWS_WITH_AS(watchdog.wait(done_after(timeout + kLateSeconds)), doctest::Contains(expected.c_str()), Error);
  const double elapsed = seconds_since(start);
  CHECK(elapsed >= timeout);
  CHECK(elapsed < timeout + kLateSeconds);
  CHECK(watchdog.failed());
  {
    std::lock_guard lock(log.mutex);
    CHECK(log.calls == 1);
    CHECK(log.failure == watchdog.failure());
    CHECK(log.thread != std::this_thread::get_id());  // aborted from the watchdog's own thread
  }
  // From now on every call throws the same failure, with the hint.
  CHECK_THROWS_WITH_AS(watchdog.throw_if_failed(), doctest::Contains("(hint: what to do)"), Error);
  CHECK_THROWS_WITH_AS(watchdog.watch("broadcast", [] { return true; }), doctest::Contains(what.c_str()), Error);
  CHECK_THROWS_WITH_AS(watchdog.wait_all(), doctest::Contains(what.c_str()), Error);  // the failed work
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::lock_guard lock(log.mutex);
  CHECK(log.calls == 1);  // once only
}

TEST_CASE("watchdog: works that complete never fire it, and the oldest overdue one is named") {
  AbortLog log;
  const double timeout = 0.3;
  {
    Watchdog watchdog(Seconds(timeout), log.hooks());
    std::atomic<int> completed{0};
    // Three works finishing at 50, 100 and 150 ms.
    for (int i = 0; i < 3; ++i)
      watchdog.watch("work " + std::to_string(i), [&completed, i] { return completed.load() > i; });
    watchdog.watch("done at once", [] { return true; });
    std::thread finisher([&] {
      for (int i = 0; i < 3; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        ++completed;
      }
    });
    watchdog.wait_all();
    finisher.join();
    std::this_thread::sleep_for(Seconds(2 * timeout));  // past the timeout: nothing pending, nothing fires
    CHECK_FALSE(watchdog.failed());
    CHECK_NOTHROW(watchdog.throw_if_failed());
  }
  CHECK(log.calls == 0);

  // Two overdue works: the first issued names the failure.
  AbortLog second;
  Watchdog watchdog(Seconds(0.1), second.hooks());
  watchdog.watch("first", [] { return false; });
  watchdog.watch("second", [] { return false; });
  CHECK_THROWS_WITH_AS(watchdog.wait(done_after(0.1 + kLateSeconds)), doctest::Contains("first did not finish"), Error);
}

TEST_CASE("watchdog: the health check's error aborts at once, and setup runs on its thread") {
  AbortLog log;
  std::atomic<bool> peer_died{false};
  std::thread::id setup_thread;
  WatchdogHooks hooks = log.hooks();
  hooks.health = [&] { return peer_died ? std::string("NCCL reported an error: remote process exited") : std::string(); };
  hooks.thread_setup = [&] { setup_thread = std::this_thread::get_id(); };
  Watchdog watchdog(Seconds(600), hooks);
  watchdog.watch("all_gather", [] { return false; });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK_FALSE(watchdog.failed());
  const auto start = Clock::now();
  peer_died = true;
  CHECK_THROWS_WITH_AS(watchdog.wait(done_after(kLateSeconds)), doctest::Contains("remote process exited"), Error);
  CHECK(seconds_since(start) < kLateSeconds);  // not the 600 s timeout
  std::lock_guard lock(log.mutex);
  CHECK(log.calls == 1);
  CHECK(setup_thread == log.thread);
  CHECK(setup_thread != std::this_thread::get_id());
}

TEST_CASE("watchdog: the collective timeout from the environment") {
  CHECK(comm_timeout_from(environment_from({})).count() == 600);
  CHECK(comm_timeout_from(environment_from({{"CHUNKWISE_COMM_TIMEOUT_S", "30"}})).count() == 30);
  CHECK_THROWS_WITH_AS(comm_timeout_from(environment_from({{"CHUNKWISE_COMM_TIMEOUT_S", "ten"}})),
                       doctest::Contains("CHUNKWISE_COMM_TIMEOUT_S='ten' is not a positive number of seconds"), Error);
  CHECK_THROWS_WITH_AS(Watchdog(Seconds(0), AbortLog().hooks()), doctest::Contains("timeout must be positive"), Error);
}

TEST_CASE("watchdog: the NCCL backend's timeouts from the environment") {
  NcclOptions o = NcclOptions::from_environment(environment_from({}));
  CHECK(o.bootstrap_timeout.count() == 300);
  CHECK(o.collective_timeout.count() == 600);
  CHECK(o.exit_on_failure);
  o = NcclOptions::from_environment(
      environment_from({{"CHUNKWISE_BOOTSTRAP_TIMEOUT_S", "20"}, {"CHUNKWISE_COMM_TIMEOUT_S", "45.5"}}));
  CHECK(o.bootstrap_timeout.count() == 20);
  CHECK(o.collective_timeout.count() == 45.5);
}
