// tools/progress.h: where a long step is, and the schedules' progress hook that feeds it.
#include "optim/schedule.h"
#include "tests/support.h"
#include "tools/progress.h"

#include <sstream>
#include <string>
#include <vector>

using namespace cw;

namespace {
struct Call {
  std::string phase;
  int64_t done, total;
};
bool operator==(const Call& a, const Call& b) { return a.phase == b.phase && a.done == b.done && a.total == b.total; }

// A tiny f64 model of `layers` layers, a batch of T tokens and its gradients: enough for a step.
struct TinyStep {
  LlamaConfig cfg;
  LlamaModel model;
  Batch batch;
  ParamSet grads;
  TinyStep(int layers, int64_t T)
      : cfg(with_layers(layers)),
        model(cfg, DType::f64),
        batch(random_batch(1, T, cfg.vocab_size, 6)),
        grads(cfg, DType::f64) {
    init_parameters(model.params(), 5, cfg.initializer_range);
  }
  static LlamaConfig with_layers(int layers) {
    LlamaConfig c = LlamaConfig::preset("tiny");
    c.num_hidden_layers = layers;
    return c;
  }
};
}  // namespace

TEST_CASE("progress: seco and spaco tell their hook every prefill and reverse-sweep chunk") {
  TinyStep t(2, 40);
  const auto run = [&](ScheduleOptions o) {
    std::vector<Call> calls;
    auto s = Schedule::create(o);
    StepHooks hooks;
    hooks.progress = [&calls](const char* phase, int64_t done, int64_t total) { calls.push_back({phase, done, total}); };
    s->set_hooks(hooks);
    t.grads.zero();
    s->step(t.model, t.batch, t.grads);
    return calls;
  };
  ScheduleOptions seco;
  seco.kind = ScheduleKind::seco;
  seco.chunk = 8;  // 5 chunks; the prefill stops before the last
  const std::vector<Call> expect_seco = {{"prefill", 1, 4},  {"prefill", 2, 4},  {"prefill", 3, 4},
                                         {"prefill", 4, 4},  {"backward", 1, 5}, {"backward", 2, 5},
                                         {"backward", 3, 5}, {"backward", 4, 5}, {"backward", 5, 5}};
  CHECK(run(seco) == expect_seco);
  ScheduleOptions spaco = seco;
  spaco.kind = ScheduleKind::spaco;
  spaco.keep = 2;
  const std::vector<Call> got = run(spaco);
  REQUIRE(got.size() == 7);  // every prefill chunk (spaco reports every chunk's loss), 2 backwards
  CHECK(got[4] == Call{"prefill", 5, 5});
  CHECK(got[6] == Call{"backward", 2, 2});
}

TEST_CASE("progress: quiet for short steps; in a log a line per interval; on a terminal a bar cleared at the end") {
  std::ostringstream log;
  StepProgress quiet(log, false, 3600, 30);
  quiet.start(1);
  quiet.update("backward", 3, 10);
  quiet.finish();
  CHECK(log.str().empty());

  StepProgress lines(log, false, 0, 0);
  lines.start(7);
  lines.update("prefill", 1, 4);
  lines.update("backward", 37, 256);
  lines.finish();
  CHECK(log.str() == "step 7: prefill 1/4 chunks (25%), 0m00s into the step\n"
                     "step 7: backward 37/256 chunks (14%), 0m00s into the step\n");

  std::ostringstream tty;
  StepProgress bar(tty, true, 0, 30);
  bar.start(2);
  bar.update("backward", 1, 2);
  bar.update("backward", 2, 2);  // within a second of the last redraw: skipped
  bar.finish();
  CHECK(tty.str() == "\r\033[Kstep 2: backward 1/2 chunks (50%), 0m00s into the step\r\033[K");
  CHECK(short_duration(3725) == "1h02m");
  CHECK(short_duration(65.4) == "1m05s");
}

TEST_CASE("progress: attach makes StepProgress the schedule's progress hook and keeps its other hooks") {
  TinyStep t(1, 24);
  ScheduleOptions o;
  o.kind = ScheduleKind::seco;
  o.chunk = 8;
  auto s = Schedule::create(o);
  int summed = 0;
  StepHooks hooks;
  hooks.sum_over_ranks = [&summed](std::vector<double>&) { ++summed; };
  s->set_hooks(hooks);
  std::ostringstream log;
  StepProgress lines(log, false, 0, 0);
  lines.attach(*s);
  CHECK(s->hooks().sum_over_ranks);
  lines.start(1);
  s->step(t.model, t.batch, t.grads);
  lines.finish();
  CHECK(log.str().find("step 1: prefill 1/2 chunks (50%)") != std::string::npos);
  CHECK(log.str().find("step 1: backward 3/3 chunks (100%)") != std::string::npos);
}
