// The training state under LoRA (optim/training.h): the base is the model's compute weights and
// nothing else (no master copy, gradient or AdamW moments), the adapters alone are trained, and the
// memory report says so.
#include "optim/schedule.h"
#include "optim/training.h"
#include "tests/support.h"

#include <cstring>

using namespace cw;

namespace {
bool same_bits(const ParamSet& a, const ParamSet& b) {
  return a.bytes() == b.bytes() && std::memcmp(a.flat().data, b.flat().data, a.bytes()) == 0;
}
}  // namespace

TEST_CASE("training state: under LoRA only the adapters have master weights, gradients and moments") {
  const LlamaConfig cfg = LlamaConfig::preset("tiny");
  LoraConfig lora;
  lora.rank = 2;
  lora.targets = "q_proj,v_proj,down_proj";
  lora.seed = 5;
  for (const DType dt : {DType::f64, DType::f32}) {
    INFO(dtype_name(dt));
    TrainingState st(cfg, dt, Device::host(), AdamWOptions{}, {.lora = lora});
    st.init(3, cfg.initializer_range);
    REQUIRE(st.lora());
    const ParamSet& adapters = st.model().adapters();
    CHECK(&st.master() == &adapters);  // f32 / f64: the master weights are the compute weights
    CHECK(same_table(st.grads(), adapters));
    CHECK(same_table(st.optimizer().exp_avg(), adapters));
    CHECK(st.grads().numel() == adapters.numel());
    CHECK(adapters.numel() == int64_t{cfg.num_hidden_layers} * 2 * (cfg.hidden_size + cfg.q_dim()) +
                                  int64_t{cfg.num_hidden_layers} * 2 * (cfg.hidden_size + cfg.kv_dim()) +
                                  int64_t{cfg.num_hidden_layers} * 2 * (cfg.intermediate_size + cfg.hidden_size));

    const ParamSet base_before = st.base_on_host(dt), adapters_before = st.master_on_host();
    const Batch batch = random_batch(2, 12, cfg.vocab_size, 8);
    auto schedule = Schedule::create(ScheduleOptions{.kind = ScheduleKind::seco, .chunk = 5});
    st.grads().zero();
    schedule->step(st.model(), batch, st.grads());
    // B starts at 0 (PEFT), so the first step moves B only; a second one moves A too.
    st.optimizer_step(1e-2);
    st.grads().zero();
    schedule->step(st.model(), batch, st.grads(), 0, 1);
    st.optimizer_step(1e-2);
    CHECK(same_bits(st.base_on_host(dt), base_before));  // the base never moves
    const ParamSet adapters_after = st.master_on_host();
    for (size_t i = 0; i < adapters_after.size(); ++i)
      CHECK_MESSAGE(test::compare(adapters_after[i], adapters_before[i]).max_abs > 0, adapters_after.specs()[i].name);

    const MemoryReport mem = memory_report(st, 0, 0);
    const ParamSet& base = st.model().params();
    CHECK(mem.weights == base.bytes() + adapters.bytes());
    CHECK(mem.master == 0);
    CHECK(mem.gradients == adapters.bytes());
    CHECK(mem.optimizer == 2 * adapters.bytes());
    CHECK(mem.gradients * 10 < base.bytes());  // the point: a small fraction of the full state
  }
}

TEST_CASE("training state: full-parameter training is unchanged (every parameter trained)") {
  const LlamaConfig cfg = LlamaConfig::preset("tiny");
  TrainingState st(cfg, DType::f64, Device::host(), AdamWOptions{});
  CHECK_FALSE(st.lora());
  CHECK(&st.master() == &st.model().params());
  CHECK(same_table(st.grads(), st.model().params()));
  const MemoryReport mem = memory_report(st, 0, 0);
  CHECK(mem.gradients == st.model().params().bytes());
  CHECK(mem.optimizer == 2 * st.model().params().bytes());
}
