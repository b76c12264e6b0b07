// The offloaded optimizer (optim/adamw_offload.h): the same bits as AdamW, piece by piece through
// staging slots; in a training state (optim/training.h) with the master weights and moments on the
// host; its checkpoints interchangeable with AdamW's; and on a GPU against the CPU.
#include "engine/engine.h"
#include "engine/random.h"
#include "optim/adamw_offload.h"
#include "optim/schedule.h"
#include "optim/training.h"
#include "tests/support.h"

#include <cstring>
#include <filesystem>

using namespace cw;

namespace {
bool same_bits(const ParamSet& a, const ParamSet& b) {
  return a.bytes() == b.bytes() && std::memcmp(a.flat().data, b.flat().data, a.bytes()) == 0;
}

// A parameter set of the tiny model's table, filled with seeded values (norm gains and all).
ParamSet seeded(const LlamaConfig& cfg, DType dt, uint64_t seed, double scale) {
  ParamSet p(cfg, dt);
  fill_normal(p.flat(), seed, 0, 0.0, scale);
  return p;
}
}  // namespace

TEST_CASE("offloaded AdamW: the bits of AdamW for any piece length, with the compute copy in its dtype") {
  const LlamaConfig cfg = LlamaConfig::preset("tiny");
  AdamWOptions opt;
  opt.weight_decay = 0.1;
  opt.decay_norms = false;  // so the pieces cross tensors with and without decay
  for (const DType dt : {DType::f64, DType::f32}) {
    // Pieces: smaller than a tensor, not dividing the vector, one element, and the whole vector.
    for (const int64_t piece : {int64_t(97), int64_t(1000), int64_t(1), int64_t(1) << 30}) {
      CAPTURE(std::string(dtype_name(dt)));
      CAPTURE(piece);
      ParamSet reference = seeded(cfg, dt, 1, 0.02), offloaded = seeded(cfg, dt, 1, 0.02);
      ParamSet compute(cfg, dt);
      AdamW adamw(reference, opt);
      OffloadedAdamW off(offloaded, Device::host(), opt, piece);
      for (int step = 0; step < 3; ++step) {
        const ParamSet grads = seeded(cfg, dt, 10 + uint64_t(step), 1.0);
        adamw.step(reference, grads, 1e-2);
        off.step(offloaded, grads, 1e-2, compute);
      }
      CHECK(same_bits(offloaded, reference));
      CHECK(same_bits(off.state().exp_avg(), adamw.exp_avg()));
      CHECK(same_bits(off.state().exp_avg_sq(), adamw.exp_avg_sq()));
      CHECK(off.state().steps() == 3);
      CHECK(same_bits(compute, reference));  // the compute copy: the master weights, in its dtype here
      CHECK(off.staging_bytes() > 0);
    }
  }
}

TEST_CASE("offloaded AdamW: a bf16 compute copy is the new master weights rounded to nearest even") {
  // The path of a GPU run: f32 master, bf16 compute weights written by the op's bf16 rounding.
  const LlamaConfig cfg = LlamaConfig::preset("tiny");
  ParamSet master = seeded(cfg, DType::f32, 2, 0.02);
  OffloadedAdamW off(master, Device::host(), AdamWOptions{}, 333);
  const ParamSet grads = seeded(cfg, DType::f32, 3, 1.0);
  ParamSet compute(cfg, DType::bf16);
  off.step(master, grads, 1e-3, compute);
  ParamSet rounded(cfg, DType::bf16);
  copy_params(rounded, master);  // copy_convert's rounding
  CHECK(same_bits(compute, rounded));
}

TEST_CASE("offloaded AdamW: refuses state on a device, a foreign table and non-float gradients") {
  const LlamaConfig cfg = LlamaConfig::preset("tiny");
  ParamSet master = seeded(cfg, DType::f32, 1, 0.02);
  OffloadedAdamW off(master, Device::host());
  ParamSet other = seeded(LlamaConfig::preset("small"), DType::f32, 1, 0.02);
  ParamSet compute(cfg, DType::f32);
  CHECK_THROWS_WITH_AS(off.step(master, other, 1e-3, compute), doctest::Contains("table"), Error);
  CHECK_THROWS_WITH_AS(off.step(master, master, -1, compute), doctest::Contains("learning rate"), Error);
  CHECK_THROWS_WITH_AS(OffloadedAdamW(master, Device::host(), AdamWOptions{}, 0), doctest::Contains("piece"), Error);
}

TEST_CASE("training state: optimizer offload trains like the state on the device, and their checkpoints load in each other") {
  const LlamaConfig cfg = LlamaConfig::preset("tiny");
  LoraConfig lora;
  lora.rank = 2;
  lora.targets = "q_proj,v_proj";
  for (const bool with_lora : {false, true}) {
    CAPTURE(with_lora);
    const LoraConfig& adapters = with_lora ? lora : LoraConfig{};
    TrainingState plain(cfg, DType::f64, Device::host(), AdamWOptions{}, {.lora = adapters});
    TrainingState off(cfg, DType::f64, Device::host(), AdamWOptions{}, {.lora = adapters, .offload_optimizer = true});
    plain.init(3, cfg.initializer_range);
    off.init(3, cfg.initializer_range);
    REQUIRE(off.optimizer_offloaded());
    CHECK(&off.master() != &off.model().trainable());  // a separate master set, on the host
    CHECK(off.master().device().is_cpu());
    auto schedule = Schedule::create(ScheduleOptions{.kind = ScheduleKind::seco, .chunk = 5});
    for (int step = 0; step < 3; ++step) {
      const Batch batch = random_batch(2, 12, cfg.vocab_size, 20 + uint64_t(step));
      for (TrainingState* st : {&plain, &off}) {
        st->grads().zero();
        schedule->step(st->model(), batch, st->grads(), 0, uint64_t(step));
        clip_grad_norm(st->grads(), 1.0);
        st->optimizer_step(1e-2);
      }
    }
    CHECK(same_bits(off.master_on_host(), plain.master_on_host()));
    CHECK(same_bits(off.model().trainable(), plain.model().trainable()));  // the compute weights follow
    CHECK(same_bits(off.optimizer().exp_avg_sq(), plain.optimizer().exp_avg_sq()));

    const MemoryReport mem = memory_report(off, 0, 0);
    CHECK(mem.master == 0);
    CHECK(mem.optimizer == 0);
    CHECK(mem.host_master == off.master().bytes());
    CHECK(mem.host_optimizer == 2 * off.master().bytes());
    CHECK(mem.host_staging > 0);
    CHECK(mem.line().find("host: master") != std::string::npos);

    // AdamW's file format either way: an offloaded run resumes a plain one's state and back.
    const test::TempDir dir("adamw-offload");
    const std::string a = dir.file("plain.safetensors"), b = dir.file("off.safetensors");
    plain.optimizer().save(a);
    off.optimizer().save(b);
    TrainingState resumed(cfg, DType::f64, Device::host(), AdamWOptions{},
                          {.lora = adapters, .offload_optimizer = true});
    resumed.optimizer().load(a);
    CHECK(same_bits(resumed.optimizer().exp_avg(), plain.optimizer().exp_avg()));
    CHECK(resumed.optimizer().steps() == 3);
    plain.optimizer().load(b);
    CHECK(same_bits(plain.optimizer().exp_avg(), off.optimizer().exp_avg()));
  }
}

TEST_CASE("training state: optimizer offload refuses ZeRO's sharded state") {
  const LlamaConfig cfg = LlamaConfig::preset("tiny");
  CHECK_THROWS_WITH_AS(TrainingState(cfg, DType::f32, Device::host(), AdamWOptions{},
                                     {.full_optimizer = false, .offload_optimizer = true}),
                       doctest::Contains("parallel.zero"), Error);
}

TEST_CASE("cuda: offloaded AdamW on a GPU run gives the bits of AdamW's GPU kernel" *
          doctest::skip(!gpu_available())) {
  const Device g = Device::gpu(0);
  const LlamaConfig cfg = LlamaConfig::preset("tiny");
  AdamWOptions opt;
  // The GPU state: bf16 compute weights with f32 master and moments on the device (AdamW's kernel);
  // the offloaded one: the same with master and moments on the host (the CPU op) and staging copies.
  TrainingState device_state(cfg, DType::bf16, g, opt);
  TrainingState offloaded(cfg, DType::bf16, g, opt, {.offload_optimizer = true});
  const ParamSet init = seeded(cfg, DType::f32, 5, 0.02);
  device_state.load_master(init);
  offloaded.load_master(init);
  // Gradients: the same seeded values on the device for both, so only the update differs.
  for (int step = 0; step < 3; ++step) {
    const ParamSet host_grads = seeded(cfg, DType::f32, 40 + uint64_t(step), 1.0);
    copy_params(device_state.grads(), host_grads);
    copy_params(offloaded.grads(), host_grads);
    device_state.optimizer_step(1e-2);
    offloaded.optimizer_step(1e-2);
  }
  synchronize(g);
  // Streamed through the GPU (f32 state): AdamW's own kernel on the same values, so the bits of the
  // state kept on the device.
  REQUIRE(offloaded.offloaded_optimizer()->streams());
  const ParamSet a = device_state.master_on_host(), b = offloaded.master_on_host();
  CHECK(same_bits(b, a));
  ParamSet v_device(cfg, DType::f32);
  copy_params(v_device, device_state.optimizer().exp_avg_sq());
  CHECK(same_bits(offloaded.optimizer().exp_avg_sq(), v_device));
  CHECK(memory_report(offloaded, 0, 0).optimizer == offloaded.offloaded_optimizer()->device_staging_bytes());
  // The compute weights on the device are the offloaded master weights rounded to bf16.
  ParamSet compute_host(cfg, DType::f32);
  copy_params(compute_host, offloaded.model().trainable());
  ParamSet rounded(cfg, DType::bf16);
  copy_params(rounded, b);
  ParamSet rounded_f32(cfg, DType::f32);
  copy_params(rounded_f32, rounded);
  CHECK(same_bits(compute_host, rounded_f32));
}

TEST_CASE("cuda: offloaded AdamW streamed through the GPU, for any piece length, gives the bits of AdamW on the device" *
          doctest::skip(!gpu_available())) {
  const Device g = Device::gpu(0);
  const LlamaConfig cfg = LlamaConfig::preset("tiny");
  AdamWOptions opt;
  opt.weight_decay = 0.1;
  opt.decay_norms = false;  // pieces cross tensors with and without decay
  for (const int64_t piece : {int64_t(97), int64_t(1000), int64_t(1) << 30}) {
    CAPTURE(piece);
    ParamSet host_master = seeded(cfg, DType::f32, 1, 0.02);
    ParamSet device_master = ParamSet::like(host_master, DType::f32, g);
    copy_params(device_master, host_master);
    ParamSet compute_a = ParamSet::like(host_master, DType::bf16, g), compute_b = ParamSet::like(host_master, DType::bf16, g);
    AdamW adamw(device_master, opt);
    OffloadedAdamW off(host_master, g, opt, piece);
    REQUIRE(off.streams());
    for (int step = 0; step < 3; ++step) {
      ParamSet grads = ParamSet::like(host_master, DType::f32, g);
      copy_params(grads, seeded(cfg, DType::f32, 10 + uint64_t(step), 1.0));
      adamw.step(device_master, grads, 1e-2, &compute_a);
      off.step(host_master, grads, 1e-2, compute_b);
    }
    synchronize(g);
    ParamSet back(cfg, DType::f32), m(cfg, DType::f32), ca(cfg, DType::bf16), cb(cfg, DType::bf16);
    copy_params(back, device_master);
    CHECK(same_bits(host_master, back));
    copy_params(m, adamw.exp_avg());
    CHECK(same_bits(off.state().exp_avg(), m));
    copy_params(ca, compute_a);
    copy_params(cb, compute_b);
    CHECK(same_bits(ca, cb));
    CHECK(off.device_staging_bytes() > 0);
    CHECK(off.staging_bytes() == 0);  // no host staging: the state itself is page-locked
  }
}
