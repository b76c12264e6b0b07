// The attention chooser (engine/ops/attention.cpp): what it picks for a call and what a forced
// family that cannot serve says. GPU-only choices (cuDNN, wgmma) are checked on the GPU in
// tests/engine/test_backend_ops.cpp (every family forced on every attention row) and test_cuda_attention.cpp.
#include "engine/engine.h"
#include "engine/memory.h"
#include "engine/ops/attention.h"
#include "tests/support.h"

#include <doctest/doctest.h>

#include <atomic>
#include <cstdlib>
#include <string>

using namespace cw;

namespace {
// A call as the chooser sees it, on a device the test need not have: the flash_mma and flash_simt
// rules read only the shape, dtype and alignment.
AttentionCall gpu_call(DType dtype, int64_t D, bool tensor_core_operands = true) {
  return AttentionCall{Device::gpu(0), dtype, 1, 16, 32, 4, 2, D, true, tensor_core_operands, nullptr, nullptr, nullptr};
}
std::string error_of(const AttentionCall& call, AttentionKernel forced) {
  try {
    choose_attention_kernel(call, {forced, false});
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("attention kernel names round-trip; unknown names are a clear error") {
  for (AttentionKernel k : {AttentionKernel::automatic, AttentionKernel::cpu, AttentionKernel::cudnn,
                            AttentionKernel::flash, AttentionKernel::flash_wgmma, AttentionKernel::flash_mma,
                            AttentionKernel::flash_simt})
    CHECK(parse_attention_kernel(attention_kernel_name(k)) == k);
  CHECK(std::string(attention_kernel_name(AttentionKernel::flash_wgmma)) == "flash-wgmma");
  try {
    parse_attention_kernel("fast");
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("unknown attention kernel 'fast'") != std::string::npos);
  }
}

TEST_CASE("attention chooser: CPU operands run the CPU kernel whatever the setting") {
  OwnedTensor q(DType::f64, {1, 4, 2, 8}), k(DType::f64, {1, 6, 1, 8}), v(DType::f64, {1, 6, 1, 8});
  OwnedTensor out(DType::f64, {1, 4, 2, 8});
  const AttentionCall call = attention_call(q, k, v, out);
  CHECK(call.S == 6);
  CHECK(call.c == 4);
  CHECK_FALSE(call.backward);
  for (AttentionKernel forced : {AttentionKernel::automatic, AttentionKernel::flash_mma, AttentionKernel::cudnn})
    CHECK(choose_attention_kernel(call, {forced, false}).kernel == AttentionKernel::cpu);
}

TEST_CASE("attention chooser: a forced family that cannot take the call names why") {
  // mma.sync tensor cores: bf16 at head dim 64, 128 or 256 with aligned operands only.
  const std::string f32 = error_of(gpu_call(DType::f32, 64), AttentionKernel::flash_mma);
  CHECK(f32.find("flash-mma was requested") != std::string::npos);
  CHECK(f32.find("needs bf16, head dim 64, 128 or 256") != std::string::npos);
  CHECK(f32.find("CW_ATTENTION=auto") != std::string::npos);
  CHECK_FALSE(error_of(gpu_call(DType::bf16, 32), AttentionKernel::flash_mma).empty());
  CHECK_FALSE(error_of(gpu_call(DType::bf16, 64, false), AttentionKernel::flash_mma).empty());
  CHECK(choose_attention_kernel(gpu_call(DType::bf16, 128), {AttentionKernel::flash_mma, false}).kernel ==
        AttentionKernel::flash_mma);
  CHECK(choose_attention_kernel(gpu_call(DType::bf16, 256), {AttentionKernel::flash_mma, false}).kernel ==
        AttentionKernel::flash_mma);
  CHECK_FALSE(error_of(gpu_call(DType::bf16, 192), AttentionKernel::flash_mma).empty());
  // The SIMT kernels take any even head dim up to 256, f32 or bf16.
  CHECK(choose_attention_kernel(gpu_call(DType::f32, 6), {AttentionKernel::flash_simt, false}).kernel ==
        AttentionKernel::flash_simt);
  CHECK(error_of(gpu_call(DType::f32, 7), AttentionKernel::flash_simt).find("even head dim") != std::string::npos);
  CHECK_FALSE(error_of(gpu_call(DType::bf16, 258), AttentionKernel::flash_simt).empty());
}

TEST_CASE("attention settings: set_attention_kernel and set_deterministic are read back") {
  const AttentionKernel saved_kernel = attention_kernel();
  const bool saved_det = deterministic();
  set_attention_kernel(AttentionKernel::flash_simt);
  set_deterministic(true);
  CHECK(attention_flags().forced == AttentionKernel::flash_simt);
  CHECK(attention_flags().deterministic);
  set_attention_kernel(saved_kernel);
  set_deterministic(saved_det);
  CHECK(attention_kernel() == saved_kernel);
}

TEST_CASE("attention settings: which cuDNN calls run with their prefix apart") {
  // A chunk of at least 64 queries with as many keys before it, exact plans, the split on; a token at a
  // time (one query) and a chunk with fewer keys before it than queries run as one graph.
  const test::SettingScope<bool> split(cudnn_split_prefix, set_cudnn_split_prefix, true);
  const test::SettingScope<CudnnPlans> exact(cudnn_plans, set_cudnn_plans, CudnnPlans::exact);
  CHECK(cudnn_splits_prefix(256, 512));
  CHECK(cudnn_splits_prefix(kSplitMinQueries, 4 * kSplitMinQueries));
  CHECK_FALSE(cudnn_splits_prefix(256, 511));
  CHECK_FALSE(cudnn_splits_prefix(1, 300));
  CHECK_FALSE(cudnn_splits_prefix(kSplitMinQueries - 1, 1000));
  {
    const test::SettingScope<CudnnPlans> shared(cudnn_plans, set_cudnn_plans, CudnnPlans::shared);
    CHECK_FALSE(cudnn_splits_prefix(256, 512));
  }
  const test::SettingScope<bool> off(cudnn_split_prefix, set_cudnn_split_prefix, false);
  CHECK_FALSE(cudnn_splits_prefix(256, 512));
}

TEST_CASE("attention: a sliding window on a GPU goes to the flash families; cuDNN refuses it, naming why, in one line") {
  AttentionCall call = gpu_call(DType::bf16, 64);
  call.window = {4096, 0};
  // Every flash family honours the window (the automatic choice, which asks the device about wgmma,
  // is checked on the GPU: tests/model/test_cuda_model.cpp's Mistral case and the op table's rows).
  for (const AttentionKernel forced : {AttentionKernel::flash_mma, AttentionKernel::flash_simt})
    CHECK(choose_attention_kernel(call, {forced, false}).kernel == forced);
  AttentionCall f32 = gpu_call(DType::f32, 6);
  f32.window = {5, 0};
  CHECK(choose_attention_kernel(f32, {AttentionKernel::flash_simt, false}).kernel == AttentionKernel::flash_simt);
  // Our cuDNN graphs have no window mask: forced cuDNN is an error saying so (or that there is no cuDNN).
  const std::string message = error_of(call, AttentionKernel::cudnn);
  INFO(message);
  CHECK(message.find("cudnn was requested but cannot take this call") != std::string::npos);
  CHECK((message.find("sliding-window") != std::string::npos || message.find("no cuDNN") != std::string::npos));
  CHECK(message.find('\n') == std::string::npos);
  // The CPU takes it.
  call.device = Device::host();
  CHECK(choose_attention_kernel(call, {AttentionKernel::automatic, false}).kernel == AttentionKernel::cpu);
}

TEST_CASE("attention: a score cap goes to flash-mma in bf16 (to flash-simt in f32 or with unaligned operands); "
          "wgmma and cuDNN forced are refused in one line naming the cap; the CPU takes it") {
  // Gemma 2's attn_logit_softcapping: cuDNN's graphs and the wgmma kernels have no cap, the mma.sync
  // kernels and the SIMT kernels do, so the automatic choice and a flash request land on flash_mma
  // (the chooser never asks cuDNN or the device about a capped call, so this runs without a GPU).
  for (const int64_t D : {64, 128, 256}) {
    CAPTURE(D);
    AttentionCall call = gpu_call(DType::bf16, D);
    call.softcap = 50.0;
    for (const AttentionKernel setting : {AttentionKernel::automatic, AttentionKernel::flash, AttentionKernel::flash_mma}) {
      CAPTURE(std::string(attention_kernel_name(setting)));
      CHECK(choose_attention_kernel(call, {setting, false}).kernel == AttentionKernel::flash_mma);
    }
    const AttentionChoice automatic = choose_attention_kernel(call, {AttentionKernel::automatic, false});
    CHECK(automatic.reason.find("no score cap") != std::string::npos);
    CHECK(choose_attention_kernel(call, {AttentionKernel::flash_simt, false}).kernel == AttentionKernel::flash_simt);
    for (const AttentionKernel forced : {AttentionKernel::flash_wgmma, AttentionKernel::cudnn}) {
      CAPTURE(std::string(attention_kernel_name(forced)));
      const std::string message = error_of(call, forced);
      INFO(message);
      CHECK(message.find("no score cap") != std::string::npos);
      CHECK(message.find('\n') == std::string::npos);
    }
  }
  AttentionCall call = gpu_call(DType::bf16, 256, false);  // operands the tensor-core kernels cannot load
  call.softcap = 50.0;
  CHECK(choose_attention_kernel(call, {AttentionKernel::flash, false}).kernel == AttentionKernel::flash_simt);
  call = gpu_call(DType::f32, 64);
  call.softcap = 50.0;
  CHECK(choose_attention_kernel(call, {AttentionKernel::flash, false}).kernel == AttentionKernel::flash_simt);
  call.device = Device::host();
  CHECK(choose_attention_kernel(call, {AttentionKernel::automatic, false}).kernel == AttentionKernel::cpu);
}

TEST_CASE("attention: head dim 256 (Gemma 2's) goes to flash-mma, other head dims above 128 to flash-simt; "
          "beyond 256 every GPU family refuses") {
  CHECK(choose_attention_kernel(gpu_call(DType::bf16, 256), {AttentionKernel::flash, false}).kernel ==
        AttentionKernel::flash_mma);
  CHECK(error_of(gpu_call(DType::bf16, 256), AttentionKernel::flash_wgmma).find("head dim 64 or 128") !=
        std::string::npos);
  CHECK(choose_attention_kernel(gpu_call(DType::bf16, 136), {AttentionKernel::flash, false}).kernel ==
        AttentionKernel::flash_simt);
  CHECK(error_of(gpu_call(DType::bf16, 136), AttentionKernel::flash_mma).find("head dim 64, 128 or 256") !=
        std::string::npos);
  const std::string message = error_of(gpu_call(DType::bf16, 258), AttentionKernel::flash);
  INFO(message);
  CHECK(message.find("at most 256") != std::string::npos);
  CHECK(message.find('\n') == std::string::npos);
}

// The shape's rules (attention.h), which the chooser applies first and the planner asks: one table of
// shapes and which families their shape allows.
TEST_CASE("attention shape rules: which families a dtype, head dim, window and cap allow") {
  struct Case {
    AttentionShape shape;
    bool cudnn, wgmma_flash, mma_flash, simt_flash;
    const char* cudnn_why;  // a fragment of cuDNN's refusal, where it refuses
  };
  const Case cases[] = {
      {{DType::bf16, 64}, true, true, true, true, ""},
      {{DType::bf16, 128}, true, true, true, true, ""},
      {{DType::bf16, 96}, true, false, false, true, ""},  // cuDNN's multiples of 8; the flash tiles' 64, 128, 256 only
      {{DType::bf16, 8}, true, false, false, true, ""},
      {{DType::f32, 64}, false, false, false, true, "takes bf16 only"},
      {{DType::bf16, 128, true}, false, true, true, true, "sliding-window"},
      {{DType::bf16, 64, false, true}, false, false, true, true, "no score cap"},
      {{DType::bf16, 256, true, true}, false, false, true, true, "no score cap"},  // Gemma 2's local layers
      {{DType::bf16, 256}, false, false, true, true, "multiple of 8 up to 128"},
      {{DType::f32, 256, false, true}, false, false, false, true, "no score cap"},
      {{DType::bf16, 136}, false, false, false, true, "multiple of 8 up to 128"},
      {{DType::bf16, 6}, false, false, false, true, "multiple of 8 up to 128"},
      {{DType::bf16, 258}, false, false, false, false, "multiple of 8 up to 128"},
      {{DType::f32, 7}, false, false, false, false, "takes bf16 only"},
  };
  for (const Case& c : cases) {
    CAPTURE(dtype_name(c.shape.dtype));
    CAPTURE(c.shape.head_dim);
    CAPTURE(c.shape.windowed);
    CAPTURE(c.shape.capped);
    std::string why;
    CHECK(cudnn_takes_shape(c.shape, &why) == c.cudnn);
    CHECK(why.find(c.cudnn_why) != std::string::npos);
    CHECK(wgmma_flash_takes_shape(c.shape, &why) == c.wgmma_flash);
    CHECK(why.empty() == c.wgmma_flash);
    CHECK(mma_flash_takes_shape(c.shape, &why) == c.mma_flash);
    CHECK(why.empty() == c.mma_flash);
    CHECK(simt_flash_takes_shape(c.shape, &why) == c.simt_flash);
    CHECK(why.empty() == c.simt_flash);
  }
}

TEST_CASE("attention chooser: a call the shape rules refuse to a family is refused by the chooser for the same reason") {
  // flash-wgmma forced on a capped bf16 call at head dim 64, flash-mma on f32: the rules' words
  // reach the error.
  AttentionCall call = gpu_call(DType::bf16, 64);
  call.softcap = 50.0;
  std::string why;
  CHECK_FALSE(wgmma_flash_takes_shape({DType::bf16, 64, false, true}, &why));
  CHECK(error_of(call, AttentionKernel::flash_wgmma).find(why) != std::string::npos);
  call.dtype = DType::f32;
  CHECK_FALSE(mma_flash_takes_shape({DType::f32, 64, false, true}, &why));
  CHECK(error_of(call, AttentionKernel::flash_mma).find(why) != std::string::npos);
  CHECK(choose_attention_kernel(call, {AttentionKernel::flash_simt, false}).kernel == AttentionKernel::flash_simt);
}
