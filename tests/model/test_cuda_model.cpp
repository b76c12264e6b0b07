// The whole model on the GPU: one training step's gradients against the CPU in f64, the schedules
// against each other on the device, and a short bf16 training run tracking the same run in f32.
//
// Tolerances (relative L2 per parameter tensor, worst tensor):
//   kModelF32Tol  GPU f32 against CPU f64 over two layers, the LM head and the loss: every op is
//                 within about 1e-6 of f64 (tests/engine/test_cuda_*.cpp), and a step chains some
//                 twenty of them, forward and backward; gradients of tiny tensors (norm gains) sum
//                 cancelling terms, so 1e-4 leaves a margin over the 1e-5 seen in practice.
//   kModelBf16Tol GPU bf16 (f32 master weights, f32 gradients) against CPU f64: bf16 keeps 8 bits,
//                 each activation is rounded once per op (2^-9 relative), so gradients carry a few
//                 percent of error; 0.1 catches a wrong formula (which gives O(1)) with margin.
//   kScheduleF32Tol  seco / checkpointed against full, all on the GPU in f32: the same math grouped
//                 differently (chunked attention, recomputed layers), f32 rounding only.
#include "engine/cuda/ops.h"
#include "engine/cuda/runtime.h"
#include "engine/engine.h"
#include "engine/ops/attention.h"
#include "engine/random.h"
#include "optim/schedule.h"
#include "optim/training.h"
#include "tests/gpu_support.h"
#include "tests/support.h"

#include <cmath>
#include <functional>
#include <optional>
#include <vector>

using namespace cw;

namespace {

constexpr double kModelF32Tol = 1e-4;
constexpr double kModelBf16Tol = 0.1;
constexpr double kScheduleF32Tol = 1e-5;

LlamaConfig tiny_config() {
  LlamaConfig cfg = LlamaConfig::preset("tiny");
  cfg.num_key_value_heads = 2;  // GQA 2:1
  return cfg;
}

// The step's gradients for `model` (any device, any dtype) under schedule options o.
void gradients(LlamaModel& model, const Batch& batch, const ParamSet& grads, const ScheduleOptions& o,
               double* loss = nullptr) {
  grads.zero();
  auto s = Schedule::create(o);
  const StepStats st = s->step(model, batch, grads);
  if (loss) *loss = st.loss;
}

struct Compared {
  double worst = 0;
  std::string name;
};

Compared compare_sets(const ParamSet& a, const ParamSet& ref) {
  Compared c;
  for (size_t i = 0; i < a.size(); ++i) {
    const double rel = test::compare(a[i], ref[i]).rel;
    CHECK_MESSAGE(std::isfinite(rel), a.specs()[i].name, " is not finite");
    if (!(rel <= c.worst)) {
      c.worst = rel;
      c.name = a.specs()[i].name;
    }
  }
  return c;
}

ScheduleOptions named(const char* name, int64_t chunk = 0) {
  ScheduleOptions o;
  o.kind = parse_schedule_kind(name);
  o.chunk = chunk;
  return o;
}

// The oracle of the GPU cases: `cfg` on the CPU in f64 with parameters from init_seed, and its
// full-backprop gradients and loss on `batch`.
struct F64Reference {
  LlamaModel model;
  ParamSet grads;
  double loss = 0;
  F64Reference(const LlamaConfig& cfg, const Batch& batch, uint64_t init_seed)
      : model(cfg, DType::f64), grads(cfg, DType::f64) {
    init_parameters(model.params(), init_seed, 0.2, 0.1);
    gradients(model, batch, grads, named("full"), &loss);
  }
};

// gradients() under a forced kernel family: false, the refusal reported, where a family this device
// or build lacks (cuDNN, Hopper's wgmma) says it cannot take the call; any other error fails.
bool gradients_unless_refused(LlamaModel& model, const Batch& batch, const ParamSet& grads, const ScheduleOptions& o,
                              double* loss) {
  try {
    gradients(model, batch, grads, o, loss);
    return true;
  } catch (const Error& e) {
    const std::string what = e.what();
    REQUIRE_MESSAGE(what.find("was requested but cannot take this call") != std::string::npos, what);
    MESSAGE("not run: ", what);
    return false;
  }
}

// The GPU's gradients and loss against the CPU's in f64 at the dtype's tolerance; the log line names
// what ran (`label`) and the worst tensor.
void expect_matches_reference(const ParamSet& grads, double loss, const F64Reference& ref, DType dt,
                              const std::string& label) {
  const Compared c = compare_sets(grads, ref.grads);
  MESSAGE(label, ": worst ", c.name, " rel ", c.worst);
  const double tol = dt == DType::f32 ? kModelF32Tol : kModelBf16Tol;
  CHECK(c.worst <= tol);
  CHECK(std::abs(loss - ref.loss) <= tol * std::abs(ref.loss));
}

// `o`, where it is spaco, backpropagating `keep` of the chunks drawn with `seed` (other schedules as given).
ScheduleOptions sampled(ScheduleOptions o, int64_t keep, uint64_t seed) {
  if (o.kind == ScheduleKind::spaco) o.keep = keep, o.seed = seed;
  return o;
}

// Under determinism every kernel's sums have a fixed order, so two ways of computing the same
// gradient from the same values give the same bits. For f32 and bf16: a 4-layer tiny model on the
// GPU (parameters from init_seed) and a batch of 2 x 56 tokens (batch_seed); compare(model, batch, a,
// b) runs schedules into the two gradient sets; each comparison it asks for is bitwise.
void deterministic_pairs(uint64_t batch_seed, uint64_t init_seed,
                         const std::function<void(LlamaModel&, const Batch&, const ParamSet&, const ParamSet&)>& compare) {
  test::DeterminismScope deterministic(true);
  LlamaConfig cfg = tiny_config();
  cfg.num_hidden_layers = 4;
  for (const DType dt : {DType::f32, DType::bf16}) {
    CAPTURE(std::string(dtype_name(dt)));
    const Batch batch = random_batch(2, 56, cfg.vocab_size, batch_seed);
    LlamaModel model(cfg, dt, Device::gpu(0));
    init_parameters(model.params(), init_seed, 0.2, 0.1);
    ParamSet a(cfg, DType::f32, Device::gpu(0)), b(cfg, DType::f32, Device::gpu(0));
    compare(model, batch, a, b);
  }
}

void expect_same_gradients(const ParamSet& got, const ParamSet& want) {
  for (size_t i = 0; i < want.size(); ++i) test::expect_same_bits(got[i], want[i], "gradient");
}

}  // namespace

TEST_CASE("cuda: one training step of the tiny model on the GPU matches the CPU in f64" *
          doctest::skip(!cw::test::gpu_ready())) {
  const LlamaConfig cfg = tiny_config();
  const Batch batch = random_batch(2, 24, cfg.vocab_size, 11);

  const F64Reference ref(cfg, batch, 5);

  for (const DType dt : {DType::f32, DType::bf16}) {
    CAPTURE(std::string(dtype_name(dt)));
    LlamaModel model(cfg, dt, Device::gpu(0));
    copy_params(model.params(), ref.model.params());
    ParamSet grads(cfg, DType::f32, Device::gpu(0));
    double loss = 0;
    gradients(model, batch, grads, named("full"), &loss);
    const Compared c = compare_sets(grads, ref.grads);
    MESSAGE(std::string(dtype_name(dt)), " full on the GPU vs CPU f64: worst gradient ", c.name, " rel ", c.worst, ", loss ", loss,
            " vs ", ref.loss);
    const double tol = dt == DType::f32 ? kModelF32Tol : kModelBf16Tol;
    CHECK(c.worst <= tol);
    CHECK(std::abs(loss - ref.loss) <= tol * std::abs(ref.loss));
  }
}

TEST_CASE("cuda: qwen2 (q/k/v biases) and qwen3 (per-head q/k norms) on the GPU match the CPU in f64; seco "
          "equals full, fused Q/K/V or not" *
          doctest::skip(!cw::test::gpu_ready())) {
  for (const char* preset : {"tiny-qwen2", "tiny-qwen3"}) {
    CAPTURE(std::string(preset));
    const LlamaConfig cfg = LlamaConfig::preset(preset);
    const Batch batch = random_batch(2, 24, cfg.vocab_size, 13);
    const F64Reference ref(cfg, batch, 7);
    for (const DType dt : {DType::f32, DType::bf16})
      for (const bool fused : {true, false}) {
        CAPTURE(std::string(dtype_name(dt)));
        CAPTURE(fused);
        const SettingScope<bool> fusion(fused_qkv, set_fused_qkv, fused);
        LlamaModel model(cfg, dt, Device::gpu(0));
        copy_params(model.params(), ref.model.params());
        for (const ScheduleOptions& o : {named("full"), named("seco", 7)}) {
          CAPTURE(schedule_name(o.kind));
          ParamSet grads(cfg, DType::f32, Device::gpu(0));
          double loss = 0;
          gradients(model, batch, grads, o, &loss);
          expect_matches_reference(grads, loss, ref, dt,
                                   fmt::format("{} {} {} {} on the GPU vs CPU f64", preset, dtype_name(dt),
                                               schedule_name(o.kind), fused ? "fused" : "three GEMMs"));
        }
      }
  }
}

TEST_CASE("cuda: seco and checkpointed (offload, selective, tiled MLP) equal full on the GPU (f32)" *
          doctest::skip(!cw::test::gpu_ready())) {
  const LlamaConfig cfg = tiny_config();
  const Batch batch = random_batch(2, 40, cfg.vocab_size, 12);
  LlamaModel model(cfg, DType::f32, Device::gpu(0));
  init_parameters(model.params(), 6, 0.2, 0.1);
  ParamSet full(cfg, DType::f32, Device::gpu(0)), other(cfg, DType::f32, Device::gpu(0));
  double full_loss = 0, loss = 0;
  gradients(model, batch, full, named("full"), &full_loss);

  ScheduleOptions seco = named("seco", 12);
  seco.bwd_chunk = 7;
  ScheduleOptions ckpt = named("checkpointed");
  ScheduleOptions tiled = named("checkpointed");
  tiled.mlp_shards = 3;
  ScheduleOptions offload = named("checkpointed");
  offload.offload = true;  // layer inputs through pinned host memory on the side stream
  ScheduleOptions selective = named("checkpointed");
  selective.recompute = RecomputeMode::selective;
  ScheduleOptions saved = seco;  // the reverse sweep re-splits the prefill's saved attention outputs
  saved.save_attention = true;
  ScheduleOptions saved_recompute = saved;  // and recomputes each layer inside the chunk from its input
  saved_recompute.recompute = RecomputeMode::full;
  ScheduleOptions saved_inputs = saved;  // no chunk forward: each layer recomputed from the prefill's input
  saved_inputs.save_inputs = true;
  ScheduleOptions inputs_only = seco;  // the same, attending again
  inputs_only.save_inputs = true;
  for (const ScheduleOptions& o : {seco, saved, saved_recompute, saved_inputs, inputs_only, ckpt, tiled, offload,
                                   selective}) {
    CAPTURE(schedule_name(o.kind));
    gradients(model, batch, other, o, &loss);
    const Compared c = compare_sets(other, full);
    MESSAGE(schedule_name(o.kind), " (chunk ", o.chunk, ", mlp shards ", o.mlp_shards, ", recompute ",
            recompute_name(o.recompute), ", offload ",
            o.offload, ") vs full on the GPU: worst ", c.name, " rel ", c.worst);
    CHECK(c.worst <= kScheduleF32Tol);
    CHECK(std::abs(loss - full_loss) <= 1e-6 * std::abs(full_loss));
  }
}

TEST_CASE("cuda: packed documents (every attention family, seco and full) match the CPU in f64" *
          doctest::skip(!cw::test::gpu_ready())) {
  // Documents of 1 to 23 tokens, cut differently in the two sequences; seco's chunks of 12 and 7
  // start, end and straddle them; the streamed store's blocks of 8 too. The reference: full on the
  // CPU in f64 with the same documents.
  const LlamaConfig cfg = tiny_config();
  Batch batch = random_batch(2, 48, cfg.vocab_size, 19);
  set_documents(batch, {{0, 1, 9, 32, 33}, {0, 23, 40}});
  const F64Reference ref(cfg, batch, 7);
  ScheduleOptions seco = named("seco", 12);
  seco.bwd_chunk = 7;
  ScheduleOptions saved = seco;
  saved.save_attention = true;
  saved.save_inputs = true;
  ScheduleOptions window = named("seco", 16);
  window.offload_window = 1;
  ScheduleOptions streamed = named("seco", 8);  // blocks of 8: the merges of attention_merge_documents_block
  streamed.stream_kv = true;
  for (const AttentionKernel kernel : {AttentionKernel::automatic, AttentionKernel::cudnn, AttentionKernel::flash_wgmma,
                                       AttentionKernel::flash_mma, AttentionKernel::flash_simt}) {
    for (const DType dt : {DType::f32, DType::bf16}) {
      if (dt == DType::f32 && kernel != AttentionKernel::automatic && kernel != AttentionKernel::flash_simt) continue;
      test::AttentionKernelScope forced(kernel);
      LlamaModel model(cfg, dt, Device::gpu(0));
      copy_params(model.params(), ref.model.params());
      ParamSet grads(cfg, DType::f32, Device::gpu(0));
      for (const ScheduleOptions& o : {named("full"), seco, saved, window, streamed}) {
        CAPTURE(std::string(attention_kernel_name(kernel)));
        CAPTURE(o.stream_kv);
        CAPTURE(std::string(dtype_name(dt)));
        CAPTURE(o.chunk);
        double loss = 0;
        if (!gradients_unless_refused(model, batch, grads, o, &loss)) break;
        expect_matches_reference(grads, loss, ref, dt,
                                 fmt::format("{} {} {} (chunk {}, saved {}, window {}) with documents vs CPU f64",
                                             attention_kernel_name(kernel), dtype_name(dt), schedule_name(o.kind),
                                             o.chunk, o.save_attention, o.offload_window));
      }
    }
  }
}

TEST_CASE("cuda: mistral's sliding window (every flash family; seco, streamed and full) matches the CPU in f64; "
          "cuDNN refuses it" *
          doctest::skip(!cw::test::gpu_ready())) {
  // tiny-mistral with a window of 7 keys over sequences of 48 (the window cuts inside every chunk
  // and key block); seco's chunks of 12 and 7, the streamed store's blocks of 8 (unmasked windowed
  // blocks merged by attention_merge, rows of a block past their window seeing nothing). Head dim 6
  // runs on the SIMT family only; 64 on the tensor-core families too. The reference: full on the
  // CPU in f64 with the same window.
  for (const int64_t D : {6, 64}) {
    CAPTURE(D);
    LlamaConfig cfg = LlamaConfig::preset("tiny-mistral");
    cfg.sliding_window = 7;
    cfg.head_dim = D;
    const Batch batch = random_batch(2, 48, cfg.vocab_size, 23);
    const F64Reference ref(cfg, batch, 9);
    ScheduleOptions seco = named("seco", 12);
    seco.bwd_chunk = 7;
    ScheduleOptions streamed = named("seco", 8);
    streamed.stream_kv = true;
    for (const AttentionKernel kernel : {AttentionKernel::automatic, AttentionKernel::cudnn,
                                         AttentionKernel::flash_wgmma, AttentionKernel::flash_mma,
                                         AttentionKernel::flash_simt}) {
      const bool tensor_cores = kernel == AttentionKernel::flash_wgmma || kernel == AttentionKernel::flash_mma;
      if (D == 6 && tensor_cores) continue;  // they need head dim 64 or 128
      for (const DType dt : {DType::f32, DType::bf16}) {
        if (dt == DType::f32 && kernel != AttentionKernel::automatic && kernel != AttentionKernel::flash_simt) continue;
        CAPTURE(std::string(attention_kernel_name(kernel)));
        CAPTURE(std::string(dtype_name(dt)));
        test::AttentionKernelScope forced(kernel);
        LlamaModel model(cfg, dt, Device::gpu(0));
        copy_params(model.params(), ref.model.params());
        ParamSet grads(cfg, DType::f32, Device::gpu(0));
        for (const ScheduleOptions& o : {named("full"), seco, streamed}) {
          CAPTURE(o.stream_kv);
          CAPTURE(o.chunk);
          double loss = 0;
          if (kernel == AttentionKernel::cudnn) {
            // Forced cuDNN cannot take a windowed call, and says why (without cuDNN: that it is absent).
            const std::string what = test::error_of([&] { gradients(model, batch, grads, o, &loss); });
            INFO(what);
            CHECK(what.find("was requested but cannot take this call") != std::string::npos);
            CHECK((what.find("sliding-window") != std::string::npos || what.find("no cuDNN") != std::string::npos));
            break;
          }
          if (!gradients_unless_refused(model, batch, grads, o, &loss)) break;
          expect_matches_reference(grads, loss, ref, dt,
                                   fmt::format("mistral D={} {} {} {} (chunk {}, streamed {}) with a window of 7 "
                                               "vs CPU f64",
                                               D, attention_kernel_name(kernel), dtype_name(dt),
                                               schedule_name(o.kind), o.chunk, o.stream_kv));
        }
      }
    }
  }
}

TEST_CASE("cuda: gemma 2 (capped scores, gelu, (1 + w) and post-norms, sqrt(C) embeddings, capped logits, a "
          "sliding and a global layer) matches the CPU in f64; seco equals it" *
          doctest::skip(!cw::test::gpu_ready())) {
  // tiny-gemma2 over sequences of 48: layer 0 through a window of 7 keys, layer 1 every key; every op
  // of Gemma 2 on the device (the geglu, rmsnorm-offset, embedding-scale and lm_head-cap kernels, the
  // capped attention on flash_mma in bf16 and flash_simt in f32 and at head dim 6). Head dims 6, 64
  // and Gemma 2's 256 (the mma kernels' widest tiles, the SIMT kernels' larger instantiation); at 64
  // also without the score cap, where cuDNN and the tensor-core families take the attention. The
  // reference: full on the CPU in f64.
  struct Variant {
    int64_t D;
    bool capped;
  };
  for (const Variant var : {Variant{6, true}, Variant{64, true}, Variant{64, false}, Variant{256, true}}) {
    CAPTURE(var.D);
    CAPTURE(var.capped);
    LlamaConfig cfg = LlamaConfig::preset("tiny-gemma2");
    REQUIRE(cfg.attn_logit_softcapping > 0);
    if (!var.capped) cfg.attn_logit_softcapping = 0.0;
    cfg.sliding_window = 7;
    cfg.head_dim = var.D;
    const Batch batch = random_batch(2, 48, cfg.vocab_size, 29);
    const F64Reference ref(cfg, batch, 9);
    ScheduleOptions seco = named("seco", 12);
    seco.bwd_chunk = 7;
    for (const DType dt : {DType::f32, DType::bf16}) {
      CAPTURE(std::string(dtype_name(dt)));
      LlamaModel model(cfg, dt, Device::gpu(0));
      copy_params(model.params(), ref.model.params());
      ParamSet grads(cfg, DType::f32, Device::gpu(0));
      for (const ScheduleOptions& o : {named("full"), named("checkpointed"), seco}) {
        CAPTURE(std::string(schedule_name(o.kind)));
        reset_attention_census();
        double loss = 0;
        gradients(model, batch, grads, o, &loss);
        expect_matches_reference(grads, loss, ref, dt,
                                 fmt::format("gemma2 D={} {} {} {} (chunk {}) vs CPU f64", var.D,
                                             var.capped ? "capped" : "uncapped", dtype_name(dt),
                                             schedule_name(o.kind), o.chunk));
        // Capped, every call ran on the chooser's family for the cap: flash_mma where it takes the
        // shape (bf16, head dim 64 or 256), else flash_simt.
        if (var.capped) {
          const AttentionKernel expected =
              dt == DType::bf16 && var.D != 6 ? AttentionKernel::flash_mma : AttentionKernel::flash_simt;
          for (const AttentionCensusEntry& e : attention_census()) CHECK(e.kernel == expected);
        }
      }
    }
  }
}

TEST_CASE("cuda: seco and spaco with the K/V store offloaded equal the store on the device, bitwise (deterministic)" *
          doctest::skip(!cw::test::gpu_ready())) {
  // Moving the store through pinned host memory on the side stream must not change a bit: a missed
  // wait or a stale slot would.
  deterministic_pairs(13, 7, [](LlamaModel& model, const Batch& batch, const ParamSet& on_device,
                                const ParamSet& offloaded) {
    for (const char* name : {"seco", "spaco"}) {
      ScheduleOptions o = sampled(named(name, 9), 5, 3);
      o.bwd_chunk = 6;
      double loss_dev = 0, loss_off = 0;
      gradients(model, batch, on_device, o, &loss_dev);
      for (int64_t window : {1, 2, 3}) {
        CAPTURE(window);
        o.offload_window = window;
        gradients(model, batch, offloaded, o, &loss_off);
        expect_same_gradients(offloaded, on_device);
        CHECK(loss_off == loss_dev);
      }
    }
  });
}

TEST_CASE("cuda: seco and spaco with the K/V store streamed in key blocks match the store on the device" *
          doctest::skip(!cw::test::gpu_ready())) {
  // Streamed, attention runs block by block (unmasked blocks on flash) and merges: the same math in
  // another order, so the gradients agree to the dtype's rounding, not bitwise.
  LlamaConfig cfg = tiny_config();
  cfg.num_hidden_layers = 4;
  for (const DType dt : {DType::f32, DType::bf16}) {
    CAPTURE(std::string(dtype_name(dt)));
    const Batch batch = random_batch(2, 60, cfg.vocab_size, 17);  // 5 blocks of 12 tokens
    LlamaModel model(cfg, dt, Device::gpu(0));
    init_parameters(model.params(), 9, 0.2, 0.1);
    ParamSet on_device(cfg, DType::f32, Device::gpu(0)), streamed(cfg, DType::f32, Device::gpu(0));
    for (const char* name : {"seco", "spaco"}) {
      for (const bool saved : {false, true}) {
        CAPTURE(std::string(name));
        CAPTURE(saved);
        ScheduleOptions o = sampled(named(name, 12), 3, 4);
        o.save_attention = saved;
        double loss_dev = 0, loss_str = 0;
        gradients(model, batch, on_device, o, &loss_dev);
        o.stream_kv = true;
        gradients(model, batch, streamed, o, &loss_str);
        const Compared c = compare_sets(streamed, on_device);
        INFO("worst ", c.name, " ", c.worst);
        CHECK(c.worst <= (dt == DType::f32 ? 1e-4 : 5e-2));
        CHECK(std::abs(loss_str - loss_dev) <= (dt == DType::f32 ? 1e-5 : 1e-2) * std::abs(loss_dev));
      }
    }
  }
}

TEST_CASE("cuda: seco and spaco with saved attention outputs (and layer recompute) equal them without, bitwise (deterministic)" *
          doctest::skip(!cw::test::gpu_ready())) {
  // Same chunks forward and backward: the prefill's attention output and lse are the bits the
  // recompute would produce, so reading them back (from the device or through pinned host memory)
  // must not change a bit.
  deterministic_pairs(14, 8, [](LlamaModel& model, const Batch& batch, const ParamSet& plain, const ParamSet& saved) {
    for (const char* name : {"seco", "spaco"}) {
      ScheduleOptions o = sampled(named(name, 8), 4, 3);
      double loss_plain = 0, loss_saved = 0;
      gradients(model, batch, plain, o, &loss_plain);
      o.save_attention = true;
      for (const RecomputeMode recompute : {RecomputeMode::automatic, RecomputeMode::full}) {
        o.recompute = recompute;
        for (int64_t window : {0, 1, 2}) {
          CAPTURE(recompute_name(recompute));
          CAPTURE(window);
          o.offload_window = window;
          gradients(model, batch, saved, o, &loss_saved);
          expect_same_gradients(saved, plain);
          CHECK(loss_saved == loss_plain);
        }
      }
    }
  });
}

TEST_CASE("cuda: seco and spaco with saved layer inputs equal them without, bitwise (deterministic)" *
          doctest::skip(!cw::test::gpu_ready())) {
  // Same chunks forward and backward: the prefill's layer inputs are the bits the reverse chunk's
  // forward would produce, and each layer recomputed from its input runs the same kernels on them, so
  // reading them back (from the device or through pinned host memory) must not change a bit.
  deterministic_pairs(15, 9, [](LlamaModel& model, const Batch& batch, const ParamSet& plain,
                                const ParamSet& from_store) {
    for (const char* name : {"seco", "spaco"})
      for (const bool saved : {false, true})
        for (const RecomputeMode recompute : {RecomputeMode::automatic, RecomputeMode::selective}) {
          ScheduleOptions o = sampled(named(name, 8), 4, 3);
          o.save_attention = saved;
          o.recompute = recompute;
          double loss_plain = 0, loss_in = 0;
          gradients(model, batch, plain, o, &loss_plain);
          o.save_inputs = true;
          for (int64_t window : {0, 1, 2}) {
            CAPTURE(std::string(name));
            CAPTURE(saved);
            CAPTURE(recompute_name(recompute));
            CAPTURE(window);
            o.offload_window = window;
            gradients(model, batch, from_store, o, &loss_in);
            expect_same_gradients(from_store, plain);
            CHECK(loss_in == loss_plain);
          }
        }
  });
}

TEST_CASE("cuda: the offloaded K/V store keeps the window's layers on the device, every layer in host memory" *
          doctest::skip(!cw::test::gpu_ready())) {
  const LlamaConfig cfg = LlamaConfig::preset("small");
  for (const int64_t T : {1024, 4096}) {
    KVStore kv(cfg, 1, T, DType::bf16, {.with_grads = true, .device = Device::gpu(0), .offload_window = 2});
    MESSAGE("T=", T, ": device ", kv.bytes(), " bytes, host ", kv.host_bytes(), " bytes");
    CHECK(kv.host_bytes() == KVStore::host_bytes_needed(cfg, 1, T, DType::bf16, {.with_grads = true}));
    CHECK(kv.bytes() * static_cast<size_t>(cfg.num_hidden_layers) == kv.host_bytes() * 2);
  }
}

TEST_CASE("cuda: a bf16 training run tracks the same run in f32" * doctest::skip(!cw::test::gpu_ready())) {
  // A learnable corpus: a fixed random sequence of 97 tokens repeated, so the loss falls fast and
  // far; both runs start from the same master weights and see the same batches.
  LlamaConfig cfg = LlamaConfig::preset("small");
  std::vector<int32_t> motif(97);
  Rng rng(3);
  for (auto& t : motif) t = static_cast<int32_t>(rng.below(static_cast<uint64_t>(cfg.vocab_size)));
  const int64_t B = 4, T = 128, steps = 40;
  auto batch_at = [&](int64_t step) {
    std::vector<int32_t> ids(static_cast<size_t>(B * T));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) ids[static_cast<size_t>(b * T + t)] = motif[static_cast<size_t>((step * 7 + b * 31 + t) % 97)];
    return causal_lm_batch(ids, B, T);
  };
  AdamWOptions ao;
  std::vector<double> curve[2];
  const DType dts[2] = {DType::f32, DType::bf16};
  for (int k = 0; k < 2; ++k) {
    TrainingState st(cfg, dts[k], Device::gpu(0), ao);
    st.init(17, cfg.initializer_range);
    ScheduleOptions o = named("seco", 32);
    auto schedule = Schedule::create(o);
    for (int64_t s = 0; s < steps; ++s) {
      st.grads().zero();
      curve[k].push_back(schedule->step(st.model(), batch_at(s), st.grads()).loss);
      clip_grad_norm(st.grads(), 1.0);
      st.optimizer_step(3e-3);
    }
  }
  MESSAGE("f32 loss: first ", curve[0].front(), " last ", curve[0].back(), "; bf16: first ", curve[1].front(), " last ",
          curve[1].back());
  CHECK(curve[0].back() < 0.5 * curve[0].front());  // it learns
  // Tracking: the gap between the curves, step by step, against the starting loss. Where the loss
  // falls steeply a small shift in time between the runs shows as a gap of a fraction of a nat, so
  // the bound is on the scale of the whole curve; a broken bf16 path stalls or diverges (a gap of
  // the order of the starting loss).
  double worst = 0;
  for (int64_t s = 0; s < steps; ++s)
    worst = std::max(worst, std::abs(curve[0][static_cast<size_t>(s)] - curve[1][static_cast<size_t>(s)]));
  const double first = curve[0].front();
  MESSAGE("bf16 vs f32 loss curve: worst gap ", worst, " nats = ", worst / first, " of the starting loss");
  CHECK(worst / first <= 0.1);
  CHECK(curve[1].back() < 0.5 * curve[1].front());  // bf16 learns too
  CHECK(std::abs(curve[1].back() - curve[0].back()) <= 0.05 * first);
}

TEST_CASE("cuda: GPU gradient norm, clipping and finiteness agree with the host" *
          doctest::skip(!cw::test::gpu_ready())) {
  const LlamaConfig cfg = tiny_config();
  ParamSet host(cfg, DType::f32), dev(cfg, DType::f32, Device::gpu(0));
  init_parameters(host, 9, 0.5, 0.3);
  copy_params(dev, host);
  const double hn = grad_global_norm(host), dn = grad_global_norm(dev);
  CHECK(std::abs(hn - dn) <= 1e-12 * hn);
  CHECK(grad_global_norm(dev) == dn);  // reproducible to the bit
  clip_grad_norm(dev, 0.5 * dn);
  CHECK(std::abs(grad_global_norm(dev) - 0.5 * dn) <= 1e-6 * dn);
  CHECK(all_finite(dev));
  fill(dev[3].slice(0, 0, 1), std::nan(""));
  CHECK_FALSE(all_finite(dev));
}

// ---- LoRA (model/lora.h): adapters on a frozen base ----
namespace {
LoraConfig gpu_lora(const char* targets, double dropout) {
  LoraConfig l;
  l.rank = 4;
  l.alpha = 8.0;
  l.dropout = dropout;
  l.targets = targets;
  l.seed = 3;
  return l;
}
}  // namespace

TEST_CASE("cuda: LoRA adapters' gradients on the GPU (f32, bf16) match the CPU in f64; seco equals full on the GPU" *
          doctest::skip(!cw::test::gpu_ready())) {
  // With dropout the GPU's masks must be the CPU's (the same hash of seed, sequence, position and
  // column), or the f32 comparison fails by O(1).
  const LlamaConfig cfg = tiny_config();
  const Batch batch = random_batch(2, 24, cfg.vocab_size, 15);
  for (const char* targets : {"q_proj,v_proj", "all-linear"})
    for (const double dropout : {0.0, 0.1}) {
      CAPTURE(std::string(targets));
      CAPTURE(dropout);
      const LoraConfig l = gpu_lora(targets, dropout);
      LlamaModel ref(cfg, DType::f64, Device::host(), nullptr, l);
      init_parameters(ref.params(), 5, 0.2, 0.1);
      init_lora_parameters(ref.adapters(), l.seed, 0.1);  // B random: A's gradient is zero while B is
      ParamSet ref_grads = ParamSet::like(ref.adapters(), DType::f64);
      double ref_loss = 0;
      gradients(ref, batch, ref_grads, named("full"), &ref_loss);
      for (const DType dt : {DType::f32, DType::bf16}) {
        CAPTURE(std::string(dtype_name(dt)));
        LlamaModel model(cfg, dt, Device::gpu(0), nullptr, l);
        copy_params(model.params(), ref.params());
        copy_params(model.adapters(), ref.adapters());
        ParamSet grads = ParamSet::like(model.adapters(), DType::f32, Device::gpu(0));
        double loss = 0;
        gradients(model, batch, grads, named("full"), &loss);
        const Compared c = compare_sets(grads, ref_grads);
        MESSAGE(targets, " dropout ", dropout, " ", std::string(dtype_name(dt)),
                " LoRA full on the GPU vs CPU f64: worst adapter gradient ", c.name, " rel ", c.worst);
        const double tol = dt == DType::f32 ? kModelF32Tol : kModelBf16Tol;
        CHECK(c.worst <= tol);
        CHECK(std::abs(loss - ref_loss) <= tol * std::abs(ref_loss));
        if (dt != DType::f32) continue;
        // The schedules on the GPU against full on the GPU: the relay through k_proj/v_proj's adapters.
        ParamSet other = ParamSet::like(grads, DType::f32);
        ScheduleOptions seco = named("seco", 7);
        seco.bwd_chunk = 5;
        ScheduleOptions ckpt = named("checkpointed");
        ckpt.mlp_shards = 3;
        for (const ScheduleOptions& o : {seco, ckpt}) {
          CAPTURE(schedule_name(o.kind));
          double other_loss = 0;
          gradients(model, batch, other, o, &other_loss);
          const Compared s = compare_sets(other, grads);
          MESSAGE(schedule_name(o.kind), " vs full on the GPU with LoRA: worst ", s.name, " rel ", s.worst);
          CHECK(s.worst <= kScheduleF32Tol);
          CHECK(std::abs(other_loss - loss) <= 1e-6 * std::abs(loss));
        }
      }
    }
}

TEST_CASE("cuda: LoRA training state in bf16: the base frozen in bf16 with no master, gradient or moments" *
          doctest::skip(!cw::test::gpu_ready())) {
  const LlamaConfig cfg = LlamaConfig::preset("small");
  const LoraConfig l = gpu_lora("all-linear", 0.05);
  TrainingState st(cfg, DType::bf16, Device::gpu(0), AdamWOptions{}, {.lora = l});
  st.init(17, cfg.initializer_range);
  const ParamSet& base = st.model().params();
  const ParamSet& adapters = st.model().adapters();
  CHECK(base.dtype() == DType::bf16);
  CHECK(st.master().dtype() == DType::f32);
  CHECK(same_table(st.master(), adapters));
  CHECK(same_table(st.grads(), adapters));
  const ParamSet base_before = st.base_on_host(DType::f32);
  auto schedule = Schedule::create(named("seco", 32));
  double first = 0, last = 0;
  for (int s = 0; s < 20; ++s) {
    const Batch batch = random_batch(2, 64, cfg.vocab_size, 3);  // one batch, learnt by the adapters
    st.grads().zero();
    const double loss = schedule->step(st.model(), batch, st.grads(), 0, static_cast<uint64_t>(s)).loss;
    (s == 0 ? first : last) = loss;
    clip_grad_norm(st.grads(), 1.0);
    st.optimizer_step(1e-2);
  }
  MESSAGE("LoRA bf16 on one batch: loss ", first, " -> ", last);
  CHECK(last < first);
  const ParamSet base_after = st.base_on_host(DType::f32);
  for (size_t i = 0; i < base_after.size(); ++i) CHECK_MESSAGE(test::same_bits(base_after[i], base_before[i]), base_after.specs()[i].name);
  const MemoryReport mem = memory_report(st, 0, 0);
  MESSAGE("memory: ", mem.line());
  CHECK(mem.master == adapters.numel() * 4);
  CHECK(mem.gradients == adapters.numel() * 4);
  CHECK(mem.optimizer == adapters.numel() * 8);
  CHECK(mem.weights == base.numel() * 2 + adapters.numel() * 2);
}

TEST_CASE("cuda: bf16 training with the blocks cast from the master as they run equals the resident copy, bitwise "
          "(deterministic)" * doctest::skip(!cw::test::gpu_ready())) {
  // schedule.cast_layers rounds each block from the f32 master into a slot as it runs (model/layer_cast.h):
  // the same bf16 weights as the resident copy, so a few optimizer steps of any schedule give the same
  // losses, gradients and master weights, bit for bit, with 2 blocks' weights resident instead of L.
  test::DeterminismScope deterministic(true);
  LlamaConfig cfg = tiny_config();
  cfg.num_hidden_layers = 6;
  const Batch batch = random_batch(2, 48, cfg.vocab_size, 21);
  for (const char* name : {"seco", "checkpointed", "full"}) {
    CAPTURE(std::string(name));
    ScheduleOptions o = named(name);
    if (o.kind == ScheduleKind::seco) o.chunk = 16;
    if (o.kind == ScheduleKind::checkpointed) o.recompute = RecomputeMode::full;
    std::vector<double> losses[2];
    std::optional<TrainingState> states[2];
    for (int cast = 0; cast < 2; ++cast) {
      states[cast].emplace(cfg, DType::bf16, Device::gpu(0), AdamWOptions{},
                           TrainingStateOptions{.cast_layers = cast == 1});
      TrainingState& st = *states[cast];
      st.init(9, 0.2);
      auto schedule = Schedule::create(o);
      for (int s = 0; s < 3; ++s) {
        st.grads().zero();
        losses[cast].push_back(schedule->step(st.model(), batch, st.grads()).loss);
        if (s < 2) st.optimizer_step(1e-2);
      }
    }
    CHECK(losses[1] == losses[0]);
    CHECK(losses[0].back() < losses[0].front());  // the steps changed the weights the blocks were cast from
    const TrainingState &resident = *states[0], &cast = *states[1];
    REQUIRE(same_table(cast.grads(), resident.grads()));
    for (size_t i = 0; i < cast.grads().size(); ++i) {
      test::expect_same_bits(cast.grads()[i], resident.grads()[i], "gradient");
      test::expect_same_bits(cast.master()[i], resident.master()[i], "master weight");
    }
    const MemoryReport m_res = memory_report(resident, 0, 0), m_cast = memory_report(cast, 0, 0);
    const size_t block = LayerCast::slot_bytes_for(cfg, DType::bf16);
    MESSAGE(std::string(name), ": weights resident ", m_res.weights, " bytes, cast ", m_cast.weights, "; ",
            cast.model().layer_cast()->casts(), " casts");
    CHECK(m_res.weights - m_cast.weights == (cfg.num_hidden_layers - LayerCast::kSlots) * block);
  }
  CHECK_THROWS_WITH_AS(TrainingState(cfg, DType::f32, Device::gpu(0), AdamWOptions{}, {.cast_layers = true}),
                       doctest::Contains("bf16"), Error);
}
