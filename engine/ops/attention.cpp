// The attention op's public entry: the contract checked once, then one chooser picks the kernel
// family that runs the call (engine/ops/attention.h lists them), and a switch dispatches to it.
// Backends check only what is theirs (alignment, a plan cuDNN can build).
#include "engine/ops/attention.h"

#include "chunkwise_config.h"
#include "engine/cpu/attention.h"
#include "engine/cuda/runtime.h"
#include "engine/engine.h"
#include "engine/env.h"
#include "engine/ops/residual.h"
#if CW_HAVE_CUDA
#include "engine/cuda/ops.h"
#endif

#include <algorithm>
#include <cmath>
#include <array>
#include <atomic>
#include <thread>
#include <map>
#include <mutex>
#include <limits>
#include <optional>

namespace cw {

// ---- The settings (engine/engine.h) ----
namespace {
constexpr std::array<const char*, 7> kKernelNames{"auto", "cpu", "cudnn", "flash", "flash-wgmma", "flash-mma",
                                                  "flash-simt"};
std::atomic<int> g_kernel{-1};         // -1: not yet read from CW_ATTENTION
std::atomic<int> g_cudnn_plan_threads{-1};  // -1: not yet read from CW_CUDNN_PLAN_THREADS
EnvFlag g_deterministic{env::kDeterministic};
// The cuDNN forms the tests and bench-ops compare (engine.h): no variable, the defaults the fastest.
std::atomic<CudnnPlans> g_cudnn_plans{CudnnPlans::exact};
std::atomic<bool> g_cudnn_split_prefix{true};
std::atomic<bool> g_cudnn_stack_gqa{true};
}  // namespace

const char* attention_kernel_name(AttentionKernel kernel) { return kKernelNames[static_cast<size_t>(kernel)]; }

AttentionKernel parse_attention_kernel(const std::string& name) {
  for (size_t i = 0; i < kKernelNames.size(); ++i)
    if (name == kKernelNames[i]) return static_cast<AttentionKernel>(i);
  fail("unknown attention kernel '" + name + "'",
       "use auto, cpu, cudnn, flash (our best flash family), flash-wgmma, flash-mma or flash-simt");
}

void set_attention_kernel(AttentionKernel kernel) { g_kernel.store(static_cast<int>(kernel)); }

AttentionKernel attention_kernel() {
  int v = g_kernel.load();
  if (v < 0) {
    const std::optional<std::string> e = env::text(env::kAttention);
    v = static_cast<int>(e ? parse_attention_kernel(*e) : AttentionKernel::automatic);
    g_kernel.store(v);
  }
  return static_cast<AttentionKernel>(v);
}

void set_deterministic(bool on) { g_deterministic.set(on); }
bool deterministic() { return g_deterministic.get(); }

void set_cudnn_plans(CudnnPlans plans) { g_cudnn_plans.store(plans); }
CudnnPlans cudnn_plans() { return g_cudnn_plans.load(); }

void set_cudnn_split_prefix(bool on) { g_cudnn_split_prefix.store(on); }
bool cudnn_split_prefix() { return g_cudnn_split_prefix.load(); }

void set_cudnn_stack_gqa(bool on) { g_cudnn_stack_gqa.store(on); }
bool cudnn_stack_gqa() { return g_cudnn_stack_gqa.load(); }

bool cudnn_splits_prefix(int64_t queries, int64_t keys) {
  return queries >= kSplitMinQueries && keys - queries >= queries && cudnn_split_prefix() &&
         cudnn_plans() == CudnnPlans::exact;
}

bool cudnn_stacks_gqa(int64_t queries, int64_t keys, int64_t heads, int64_t kv_heads) {
  return heads != kv_heads && cudnn_stack_gqa() && cudnn_splits_prefix(queries, keys);
}

void set_cudnn_plan_threads(int threads) {
  CW_CHECK(threads >= 0, "set_cudnn_plan_threads({}): the count of plan threads cannot be negative", threads);
  g_cudnn_plan_threads.store(threads);
}

int cudnn_plan_threads() {
  int v = g_cudnn_plan_threads.load();
  if (v < 0) {
    // By default half the cores (the host keeps the rest), at most 8: cuDNN's builds slow each other
    // down (0.15 s alone, about 1 s each with 8 at once), so more threads build no faster
    // (docs/decisions.md, "cuDNN plans and the first step").
    const std::optional<int64_t> n = env::integer(env::kCudnnPlanThreads);
    v = n ? static_cast<int>(*n) : static_cast<int>(std::clamp(std::thread::hardware_concurrency() / 2, 1u, 8u));
    g_cudnn_plan_threads.store(v);
  }
  return v;
}

AttentionFlags attention_flags() { return {attention_kernel(), deterministic()}; }

// ---- The contract ----
namespace {
bool packed_kv(const Tensor& t, int64_t Hkv, int64_t D) {
  return t.stride[1] == Hkv * D && t.stride[2] == D && t.stride[3] == 1 && t.stride[0] >= t.size(1) * Hkv * D;
}

void check_forward_operands(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                            const AttentionSaved& saved, const Arena& scratch, AttentionMask mask,
                            AttentionWindow window = {}, double softcap = 0.0) {
  CW_CHECK(q.ndim == 4 && k.ndim == 4, "attention q {} and k {} must be [B, c, H, D] and [B, S, Hkv, D]",
           q.describe(), k.describe());
  const int64_t B = q.size(0), c = q.size(1), H = q.size(2), D = q.size(3), S = k.size(1), Hkv = k.size(2);
  if (mask == AttentionMask::causal)
    CW_CHECK(S >= c, "attention: {} queries but only {} keys (keys must cover [0, p + c))", c, S);
  else
    CW_CHECK(S >= 1, "attention: an unmasked call needs at least one key, got {}", S);
  CW_CHECK(window.size >= 0, "attention: a sliding window of {} keys (0: none)", window.size);
  CW_CHECK(softcap >= 0 && std::isfinite(softcap), "attention: a score cap of {} (positive and finite; 0: none)",
           softcap);
  if (mask == AttentionMask::causal)
    CW_CHECK(window.distance == 0, "attention: a causal call places its queries itself; window distance {} must be 0",
             window.distance);
  else if (window.size > 0)
    CW_CHECK(window.distance >= S, "attention: an unmasked block's queries sit past its {} keys, window distance {}",
             S, window.distance);
  CW_CHECK(Hkv > 0 && H % Hkv == 0, "attention: {} query heads not a multiple of {} K/V heads", H, Hkv);
  check_shape(k, {B, S, Hkv, D}, "attention k");
  check_same_shape(v, k, "attention v", "attention k");
  check_same_shape(out, q, "attention out", "attention q");
  check_shape(saved.lse, {B, H, c}, "attention saved lse");
  check_contiguous(q, "attention q");
  check_contiguous(out, "attention out");
  check_contiguous(saved.lse, "attention saved lse");
  for (const Tensor* t : {&k, &v})
    CW_CHECK(packed_kv(*t, Hkv, D), "attention k/v {}: the [S, Hkv, D] part must be packed (only the batch stride may differ)",
             t->describe());
  check_dtype(k, q.dtype, "attention k");
  check_dtype(v, q.dtype, "attention v");
  check_dtype(out, q.dtype, "attention out");
  check_dtype(saved.lse, accum_dtype(q.dtype), "attention saved lse");
  check_same_device({{q, "attention q"}, {k, "attention k"}, {v, "attention v"}, {out, "attention out"},
                     {saved.lse, "attention saved lse"}});
  CW_CHECK(scratch.device() == q.device, "attention: the scratch arena is on {}, the operands on {}",
           device_name(scratch.device()), device_name(q.device));
}

void check_backward_operands(const Tensor& d_q, const Tensor& d_k, const Tensor& d_v, const Tensor& d_out,
                             const Tensor& q, const Tensor& k) {
  check_same_shape(d_q, q, "attention d_q", "attention q");
  check_same_shape(d_out, q, "attention d_out", "attention q");
  check_dtype(d_q, q.dtype, "attention d_q");
  check_dtype(d_out, q.dtype, "attention d_out");
  check_contiguous(d_q, "attention d_q");
  check_contiguous(d_out, "attention d_out");
  for (const Tensor* t : {&d_k, &d_v}) {
    check_same_shape(*t, k, "attention d_k/d_v", "attention k");
    check_dtype(*t, accum_dtype(q.dtype), "attention d_k/d_v");
    CW_CHECK(packed_kv(*t, k.size(2), k.size(3)), "attention d_k/d_v {}: the [S, Hkv, D] part must be packed",
             t->describe());
  }
  check_same_device({{q, "attention q"}, {d_q, "attention d_q"}, {d_out, "attention d_out"}, {d_k, "attention d_k"},
                     {d_v, "attention d_v"}});
}

bool aligned(const Tensor* t, size_t bytes) {
  return t == nullptr || reinterpret_cast<uintptr_t>(t->data) % bytes == 0;
}

#if CW_HAVE_CUDNN
// The attention backward's workspace budget on a device (engine.h): the default, set for the
// process when the first backward asks, raised by raise_attention_workspace_budget; the variable
// fixes it.
std::mutex g_budget_mutex;
std::map<int, int64_t> g_budgets, g_budget_floors;

// CW_ATTENTION_WORKSPACE_MIB in bytes, if set (then it fixes the budget); read once.
std::optional<int64_t> workspace_budget_from_env() {
  static const std::optional<int64_t> fixed = []() -> std::optional<int64_t> {
    const std::optional<int64_t> mib = env::integer(env::kAttentionWorkspaceMib);
    if (!mib) return std::nullopt;
    return *mib << 20;
  }();
  return fixed;
}

int64_t workspace_budget(int device) {
  if (const std::optional<int64_t> fixed = workspace_budget_from_env()) return *fixed;
  std::lock_guard lock(g_budget_mutex);
  const auto floor = g_budget_floors.find(device);
  const int64_t raised = floor == g_budget_floors.end() ? 0 : floor->second;
  if (auto it = g_budgets.find(device); it != g_budgets.end()) return std::max(it->second, raised);
  const int64_t budget = std::max(int64_t{256} << 20, static_cast<int64_t>(gpu::memory_info(device).free / 4));
  g_budgets.emplace(device, budget);
  return std::max(budget, raised);
}
#endif

// Whether `kernel` (a concrete family) can take the call; if not, *why says so. The shape's rules
// first (cudnn_takes_shape and the others, below), then what depends on the operands and the device.
bool serves(AttentionKernel kernel, const AttentionCall& call, const AttentionFlags& flags, bool forced,
            std::string* why) {
  const bool cpu = call.device.is_cpu();
  [[maybe_unused]] const bool causal = call.mask == AttentionMask::causal;
  const AttentionShape shape{call.dtype, call.D, call.window.size > 0, call.softcap > 0};
  switch (kernel) {
    case AttentionKernel::cpu:
      *why = "the operands are on a GPU";
      return cpu;
    case AttentionKernel::cudnn:
#if CW_HAVE_CUDNN
      if (cpu) break;
      if (!cudnn_takes_shape(shape, why)) return false;
      // Automatic, determinism off: a SeCO call whose plan is still being built ahead runs on flash
      // rather than wait for it (the first step; engine.h, cudnn_plan_threads). With determinism
      // on, which kernel runs must not depend on timing, so the call waits.
      if (!forced && !flags.deterministic &&
          !gpu::cudnn_attention_plan_ready(*call.q, *call.k, *call.v, call.backward, causal)) {
        *why = "its plan is being built ahead (flash runs this call meanwhile)";
        return false;
      }
      if (!call.backward) return gpu::cudnn_attention_forward_supports(*call.q, *call.k, why, causal);
      // Forced: cuDNN's own deterministic form serves the deterministic switch. Automatic: cuDNN's
      // backward only with determinism off (its fast engine sums dQ with atomics) and when its
      // workspace fits the budget; the flash backward needs O(c) scratch whatever happens.
      if (forced) return gpu::cudnn_attention_supports(*call.q, *call.k, why, causal);
      if (flags.deterministic) {
        *why = "determinism is on";
        return false;
      }
      return gpu::cudnn_attention_forward_supports(*call.q, *call.k, why, causal) &&
             gpu::cudnn_attention_backward_fits(*call.q, *call.k, *call.v, workspace_budget(call.device.index), why,
                                                causal);
#else
      if (cpu) break;
      *why = "this build has no cuDNN";
      return false;
#endif
    case AttentionKernel::flash_wgmma:
#if CW_HAVE_CUDA
      if (cpu) break;
      if (!wgmma_flash_takes_shape(shape, why)) return false;
      if (!call.tensor_core_operands) {
        *why = "needs 16-byte aligned operands";
        return false;
      }
      if (!gpu::flash_wgmma_available(call.device.index)) {
        *why = "needs an sm_90a build on a compute capability 9.0 GPU";
        return false;
      }
      return true;
#endif
      break;
    case AttentionKernel::flash_mma:
      if (cpu) break;
      if (!mma_flash_takes_shape(shape, why)) return false;
      *why = "needs 16-byte aligned operands";
      return call.tensor_core_operands;
    case AttentionKernel::flash_simt:
      if (cpu) break;
      return simt_flash_takes_shape(shape, why);
    case AttentionKernel::automatic:
    case AttentionKernel::flash: break;
  }
  *why = cpu ? "the operands are on the CPU" : "this build has no CUDA";
  return false;
}
}  // namespace

AttentionCall attention_call(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor* d_q,
                             const Tensor* d_out, const Tensor* d_k, const Tensor* d_v, AttentionMask mask,
                             AttentionWindow window, double softcap) {
  AttentionCall call{q.device, q.dtype, q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3),
                     d_q != nullptr, false, &q, &k, &v, mask, window, softcap};
  // The tensor-core kernels load rows with 16-byte copies and add dK/dV with 8-byte vectors.
  call.tensor_core_operands = aligned(&q, 16) && aligned(&k, 16) && aligned(&v, 16) && aligned(&out, 16) &&
                              aligned(d_q, 16) && aligned(d_out, 16) && aligned(d_k, 8) && aligned(d_v, 8) &&
                              k.stride[0] % 8 == 0 && v.stride[0] % 8 == 0 && (!d_k || d_k->stride[0] % 2 == 0) &&
                              (!d_v || d_v->stride[0] % 2 == 0);
  return call;
}

AttentionChoice choose_attention_kernel(const AttentionCall& call, const AttentionFlags& flags) {
  // The CPU has one kernel; the setting chooses among the GPU families (a test may force one and
  // still compute its CPU reference).
  if (call.device.is_cpu()) return {AttentionKernel::cpu, "the operands are on the CPU"};
  // A score cap or a head dim of 256: flash-mma and flash-simt serve them; a sliding window: every
  // flash family honours it. cuDNN refuses all three (serves, above), so the automatic choice goes to
  // the fastest flash family that takes the call.
  std::string why, reasons;
  const AttentionKernel forced = flags.forced;
  const auto try_kernel = [&](AttentionKernel k, bool is_forced) {
    if (serves(k, call, flags, is_forced, &why)) return true;
    reasons += std::string(reasons.empty() ? "" : "; ") + attention_kernel_name(k) + ": " + why;
    return false;
  };
  if (forced != AttentionKernel::automatic && forced != AttentionKernel::flash) {
    if (try_kernel(forced, true)) return {forced, std::string("forced (CW_ATTENTION / set_attention_kernel)")};
    fail(fmt::format("attention: kernel {} was requested but cannot take this call ({} q [{}, {}, {}, {}] against {} "
                     "keys, {} heads of K/V, {}): {}",
                     attention_kernel_name(forced), device_name(call.device), call.B, call.c, call.H, call.D, call.S,
                     call.Hkv, call.backward ? "backward" : "forward", reasons),
         "use CW_ATTENTION=auto (or set_attention_kernel(AttentionKernel::automatic))");
  }
  // automatic: cuDNN where it serves; then our flash families, fastest first.
  if (forced == AttentionKernel::automatic && try_kernel(AttentionKernel::cudnn, false))
    return {AttentionKernel::cudnn, "cuDNN serves this shape"};
  for (AttentionKernel k : {AttentionKernel::flash_wgmma, AttentionKernel::flash_mma, AttentionKernel::flash_simt})
    if (try_kernel(k, false)) return {k, reasons.empty() ? "the fastest flash family here" : reasons};
  fail(fmt::format("attention: no kernel can take {} q [{}, {}, {}, {}] against {} keys: {}", device_name(call.device),
                   call.B, call.c, call.H, call.D, call.S, reasons),
       "use head dims that are even and at most 256, f32 or bf16 on a GPU");
}

// ---- The shape's rules (attention.h) ----
bool cudnn_takes_shape(const AttentionShape& shape, std::string* why) {
  std::string reason;
  // A score cap is one more map of every score inside the softmax and a factor in dS: our cuDNN
  // graphs do not build it.
  if (shape.capped) reason = "our cuDNN graphs have no score cap (flash-mma and flash-simt compute it)";
  // Our cuDNN graphs (attention_cudnn_graphs.cu) build the causal mask from pointwise nodes and
  // their plans are keyed by shape and mask; a window would be one more comparison in every graph,
  // plan key and split-prefix form, and cuDNN would still run the tiles left of the window. The
  // flash families skip those tiles, so they take every windowed call.
  else if (shape.windowed) reason = "our cuDNN graphs have no sliding-window mask (the flash kernels honour it)";
  else if (shape.dtype != DType::bf16) reason = fmt::format("dtype {} (the cuDNN path takes bf16 only)", dtype_name(shape.dtype));
  // cuDNN's fused attention (attention_cudnn.cuh's kMaxHeadDim).
  else if (shape.head_dim <= 0 || shape.head_dim % 8 != 0 || shape.head_dim > 128)
    reason = fmt::format("head dim {} (cuDNN needs a multiple of 8 up to 128)", shape.head_dim);
  if (why) *why = reason;
  return reason.empty();
}

bool wgmma_flash_takes_shape(const AttentionShape& shape, std::string* why) {
  // Its tiles are instantiated for head dims 64 and 128, on bf16 MMA; the cap is not in them.
  std::string reason;
  if (shape.capped) reason = "no score cap in its kernels (flash-mma and flash-simt compute it)";
  else if (shape.dtype != DType::bf16 || (shape.head_dim != 64 && shape.head_dim != 128))
    reason = "needs bf16, head dim 64 or 128";
  if (why) *why = reason;
  return reason.empty();
}

bool mma_flash_takes_shape(const AttentionShape& shape, std::string* why) {
  // Its tiles are instantiated for head dims 64, 128 and 256 (Gemma 2's), each with and without the cap.
  const bool ok = shape.dtype == DType::bf16 && (shape.head_dim == 64 || shape.head_dim == 128 || shape.head_dim == 256);
  if (why) *why = ok ? "" : "needs bf16, head dim 64, 128 or 256";
  return ok;
}

bool simt_flash_takes_shape(const AttentionShape& shape, std::string* why) {
  // Instantiated for head dims up to 128 and up to 256 (attention_flash.cuh's kMaxD), two elements a thread.
  const bool ok = shape.head_dim > 0 && shape.head_dim % 2 == 0 && shape.head_dim <= 256;
  if (why) *why = ok ? "" : "needs an even head dim of at most 256";
  return ok;
}

// ---- The workspace budget (engine/engine.h) ----
void raise_attention_workspace_budget(Device device, int64_t bytes) {
#if CW_HAVE_CUDNN
  if (device.is_cpu() || workspace_budget_from_env()) return;  // fixed by the variable
  std::lock_guard lock(g_budget_mutex);
  int64_t& floor = g_budget_floors[device.index];
  floor = std::max(floor, bytes);
#else
  (void)device;
  (void)bytes;
#endif
}

int64_t attention_workspace_budget(Device device) {
#if CW_HAVE_CUDNN
  return device.is_cpu() ? 0 : workspace_budget(device.index);
#else
  (void)device;
  return 0;
#endif
}

// ---- The census ----
namespace {
struct CensusKey {
  bool backward;
  AttentionKernel kernel;
  std::string reason;
  auto operator<=>(const CensusKey&) const = default;
};
std::mutex g_census_mutex;
std::map<CensusKey, std::pair<int64_t, double>> g_census;

void count_call(const AttentionCall& call, const AttentionChoice& choice, double flops) {
  std::lock_guard lock(g_census_mutex);
  auto& [calls, total] = g_census[CensusKey{call.backward, choice.kernel, choice.reason}];
  ++calls;
  total += flops;
}
void count_call(const AttentionCall& call, const AttentionChoice& choice) {
  count_call(call, choice, attention_call_flops(call));
}
}  // namespace

double attention_pairs(int64_t c, int64_t S, AttentionMask mask, AttentionWindow window) {
  const bool causal = mask == AttentionMask::causal;
  if (window.size == 0) {
    // Bottom-right causal: query i of c sees the S - c earlier keys and i + 1 of its own chunk.
    const double cd = double(c), Sd = double(S);
    return causal ? cd * (Sd - cd) + cd * (cd + 1) / 2 : cd * Sd;
  }
  // Query i sees keys [max(0, o + i - W + 1), min(S - 1, o + i)].
  const int64_t o = causal ? S - c : window.distance;
  double pairs = 0;
  for (int64_t i = 0; i < c; ++i)
    pairs += double(std::max<int64_t>(0, std::min(S, o + i + 1) - std::max<int64_t>(0, o + i - window.size + 1)));
  return pairs;
}

double attention_call_flops(const AttentionCall& call) {
  const double forward =
      4.0 * double(call.B) * double(call.H) * double(call.D) * attention_pairs(call.c, call.S, call.mask, call.window);
  return call.backward ? 2.5 * forward : forward;
}

std::vector<AttentionCensusEntry> attention_census() {
  std::vector<AttentionCensusEntry> entries;
  {
    std::lock_guard lock(g_census_mutex);
    for (const auto& [key, value] : g_census)
      entries.push_back({key.backward, key.kernel, key.reason, value.first, value.second});
  }
  std::sort(entries.begin(), entries.end(), [](const AttentionCensusEntry& a, const AttentionCensusEntry& b) {
    return a.backward != b.backward ? !a.backward : a.flops > b.flops;
  });
  return entries;
}

std::string attention_census_text(const std::vector<AttentionCensusEntry>& census, const std::string& when) {
  double total = 0;
  for (const AttentionCensusEntry& e : census) total += e.flops;
  std::string s;
  for (const AttentionCensusEntry& e : census)
    s += fmt::format("attention {}: {} on {}: {} calls, {:.1f}% of the flops ({})\n", when,
                     e.backward ? "backward" : "forward", attention_kernel_name(e.kernel), e.calls,
                     total > 0 ? 100 * e.flops / total : 0.0, e.reason);
  return s;
}

void reset_attention_census() {
  std::lock_guard lock(g_census_mutex);
  g_census.clear();
}

// ---- The op ----
#if CW_HAVE_CUDA
namespace {
// The flash family of a flash kernel the chooser named.
gpu::FlashFamily flash_family(AttentionKernel k) {
  return k == AttentionKernel::flash_wgmma ? gpu::FlashFamily::wgmma
         : k == AttentionKernel::flash_mma ? gpu::FlashFamily::mma
                                           : gpu::FlashFamily::simt;
}
}  // namespace
#endif

void attention_forward(const Tensor& out, const AttentionSaved& saved, const Tensor& q, const Tensor& k,
                       const Tensor& v, double scale, Arena& scratch, AttentionMask mask, AttentionWindow window,
                       double softcap) {
  check_forward_operands(q, k, v, out, saved, scratch, mask, window, softcap);
  const AttentionCall call = attention_call(q, k, v, out, nullptr, nullptr, nullptr, nullptr, mask, window, softcap);
  const AttentionChoice choice = choose_attention_kernel(call, attention_flags());
  count_call(call, choice);
  const bool causal = mask == AttentionMask::causal;
  switch (choice.kernel) {
    case AttentionKernel::cpu:
      return cpu::attention_forward(out, saved, q, k, v, scale, scratch, causal, window, softcap);
#if CW_HAVE_CUDNN
    case AttentionKernel::cudnn: return gpu::cudnn_attention_forward(out, saved, q, k, v, scale, scratch, causal);
#endif
#if CW_HAVE_CUDA
    case AttentionKernel::flash_wgmma:
    case AttentionKernel::flash_mma:
    case AttentionKernel::flash_simt:
      return gpu::flash_attention_forward(out, saved, q, k, v, scale, flash_family(choice.kernel), causal, window, {},
                                          softcap);
#endif
    default: fail(std::string("attention: kernel ") + attention_kernel_name(choice.kernel) + " is not in this build");
  }
}

void attention_backward(const Tensor& d_q, const Tensor& d_k, const Tensor& d_v, const Tensor& d_out,
                        const AttentionSaved& saved, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, double scale, GradMode mode, Arena& scratch, AttentionMask mask,
                        AttentionWindow window, double softcap) {
  check_forward_operands(q, k, v, out, saved, scratch, mask, window, softcap);
  check_backward_operands(d_q, d_k, d_v, d_out, q, k);
  const AttentionFlags flags = attention_flags();
  const AttentionCall call = attention_call(q, k, v, out, &d_q, &d_out, &d_k, &d_v, mask, window, softcap);
  const AttentionChoice choice = choose_attention_kernel(call, flags);
  count_call(call, choice);
  const bool causal = mask == AttentionMask::causal;
  switch (choice.kernel) {
    case AttentionKernel::cpu:
      return cpu::attention_backward(d_q, d_k, d_v, d_out, saved, q, k, v, out, scale, mode, scratch, causal, window,
                                     softcap);
#if CW_HAVE_CUDNN
    case AttentionKernel::cudnn:
      return gpu::cudnn_attention_backward(d_q, d_k, d_v, d_out, saved, q, k, v, out, scale, mode, scratch, causal);
#endif
#if CW_HAVE_CUDA
    case AttentionKernel::flash_wgmma:
    case AttentionKernel::flash_mma:
    case AttentionKernel::flash_simt:
      return gpu::flash_attention_backward(d_q, d_k, d_v, d_out, saved, q, k, v, out, scale, mode, scratch,
                                           flash_family(choice.kernel), flags.deterministic, causal, window, {},
                                           softcap);
#endif
    default: fail(std::string("attention: kernel ") + attention_kernel_name(choice.kernel) + " is not in this build");
  }
}

std::vector<DocumentSpan> document_spans(const std::vector<std::vector<int64_t>>& doc_starts, int64_t B, int64_t p,
                                         int64_t c) {
  CW_CHECK(static_cast<int64_t>(doc_starts.size()) == B, "attention: document starts for {} sequences, the call has {}",
           doc_starts.size(), B);
  std::vector<DocumentSpan> spans;
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<int64_t>& starts = doc_starts[static_cast<size_t>(b)];
    CW_CHECK(!starts.empty() && starts.front() == 0, "attention: sequence {}'s first document must start at 0", b);
    for (size_t i = 0; i < starts.size(); ++i) {
      CW_CHECK(i == 0 || starts[i] > starts[i - 1], "attention: sequence {}'s document starts must ascend ({} after {})",
               b, starts[i], starts[i - 1]);
      const int64_t begin = starts[i];
      const int64_t end = i + 1 < starts.size() ? starts[i + 1] : std::numeric_limits<int64_t>::max();
      const int64_t q0 = std::max(begin, p) - p, q1 = std::min(end, p + c) - p;
      if (q0 < q1) spans.push_back({b, q0, q1, begin});
    }
  }
  return spans;
}

namespace {
// Sequence b's rows [r0, r0 + n) of a [B, c, ...] tensor (or a K/V slice), as a batch of one.
Tensor sequence_rows(const Tensor& t, int64_t b, int64_t r0, int64_t n) { return t.slice(0, b, 1).slice(1, r0, n); }
// lse [B, H, c]: sequence b's columns [q0, q1) as [H, q1 - q0] rows of pitch c (a copy takes that stride).
Tensor lse_columns(const Tensor& lse, int64_t b, int64_t q0, int64_t q1) {
  Tensor t = lse.slice(0, b, 1).slice(2, q0, q1 - q0);
  Tensor rows = t;
  rows.ndim = 2;
  rows.shape = {t.size(1), t.size(2), 0, 0};
  rows.stride = {t.stride[1], 1, 0, 0};
  return rows;
}
bool whole_rows(const DocumentSpan& s, int64_t c) { return s.q0 == 0 && s.q1 == c; }
// A span's lse rows [1, H, n] of lse [B, H, c]: the sequence's own rows when the span is its whole
// chunk, else a packed copy in `scratch` (holding lse's values when `read`; written back by
// store_span_lse).
Tensor span_lse(const Tensor& lse, const DocumentSpan& s, int64_t c, Arena& scratch, bool read) {
  if (whole_rows(s, c)) return lse.slice(0, s.b, 1);
  const int64_t H = lse.size(1), n = s.q1 - s.q0;
  const Tensor staged = scratch.alloc(lse.dtype, {1, H, n});
  if (read) copy_convert(staged.view({H, n}), lse_columns(lse, s.b, s.q0, s.q1));
  return staged;
}
void store_span_lse(const Tensor& lse, const DocumentSpan& s, int64_t c, const Tensor& staged) {
  if (!whole_rows(s, c)) copy_convert(lse_columns(lse, s.b, s.q0, s.q1), staged.view({lse.size(1), s.q1 - s.q0}));
}
// The first key a span's call reads: its document's start, or with a window of W keys its first
// query's oldest visible key when that is later (p: the chunk's first position).
int64_t span_first_key(const DocumentSpan& s, int64_t p, int64_t window) {
  return std::max(s.k0, window_first_key(p + s.q0, window));
}

// Packed documents in one call: a flash family takes the whole chunk with each row's document start
// (doc_first), so the chunk costs one launch whatever its documents; the CPU and cuDNN take the spans
// one by one. One call pays where spans are short (a call a span launches kernels for little work,
// and cuDNN builds a plan for each span shape): the automatic choice takes it when the chunk's spans
// average fewer than kOneCallBelowSpanRows rows (docs/packed_documents.md has the measurements). A
// forced family decides alone: cuDNN (or the CPU) span by span, a flash family in one call.
constexpr int64_t kOneCallBelowSpanRows = 2048;

// The flash family of a one-call chunk: the chooser's pick among the flash families for the whole
// chunk's call (or the forced one); nullopt: span by span.
std::optional<AttentionKernel> documents_in_one_call(const AttentionCall& whole, size_t spans) {
  const int64_t rows = whole.B * whole.c;
  if (!CW_HAVE_CUDA || whole.device.is_cpu() || static_cast<int64_t>(spans) <= whole.B)
    return std::nullopt;  // the CPU, or one call a sequence already
  AttentionFlags flags = attention_flags();
  if (flags.forced == AttentionKernel::cudnn || flags.forced == AttentionKernel::cpu) return std::nullopt;
  if (flags.forced != AttentionKernel::automatic) return choose_attention_kernel(whole, flags).kernel;
  if (rows / static_cast<int64_t>(spans) >= kOneCallBelowSpanRows) return std::nullopt;
  // The fastest flash family that takes the whole call; where none does (a head dim only cuDNN
  // takes), the spans go one by one to whatever serves them.
  flags.forced = AttentionKernel::flash;
  try {
    return choose_attention_kernel(whole, flags).kernel;
  } catch (const Error&) {
    return std::nullopt;
  }
}

// An int32 [B, n] table in `arena` (on its device) whose rows of each span hold its document's start:
// a chunk's doc_first (n = c, the chunk's spans) or a step's first_keys (n = T, spans from position 0).
Tensor upload_first_keys(const std::vector<DocumentSpan>& spans, int64_t B, int64_t n, Arena& arena) {
  std::vector<int32_t> host(static_cast<size_t>(B * n));
  for (const DocumentSpan& s : spans)
    std::fill(host.begin() + s.b * n + s.q0, host.begin() + s.b * n + s.q1, static_cast<int32_t>(s.k0));
  const Tensor table = arena.alloc(DType::i32, {B, n});
  copy_convert(table, Tensor(host.data(), DType::i32, Device::host(), {B, n}));
  return table;
}

#if CW_HAVE_CUDA
// The one-call chunk's doc_first [B, c]: the caller's first_keys columns [p, p + c), or built from the
// spans and uploaded into `scratch`.
Tensor chunk_first_keys(const Tensor& first_keys, const std::vector<DocumentSpan>& spans, int64_t B, int64_t p,
                        int64_t c, const Tensor& q, Arena& scratch) {
  if (first_keys.data) {
    CW_CHECK(first_keys.dtype == DType::i32 && first_keys.ndim == 2 && first_keys.size(0) == B &&
                 first_keys.size(1) >= p + c && first_keys.device == q.device,
             "attention: first_keys must be int32 [{}, >= {}] on {}, got {}", B, p + c, device_name(q.device),
             first_keys.describe());
    return first_keys.slice(1, p, c);
  }
  return upload_first_keys(spans, B, c, scratch);
}

// The census counts a one-call chunk as one call with its spans' flops.
void count_one_call(const AttentionCall& whole, AttentionKernel kernel, const std::vector<DocumentSpan>& spans,
                    int64_t p, int64_t window) {
  double flops = 0;
  for (const DocumentSpan& s : spans) {
    AttentionCall span = whole;
    span.B = 1, span.c = s.q1 - s.q0, span.S = p + s.q1 - span_first_key(s, p, window);
    flops += attention_call_flops(span);
  }
  count_call(whole, {kernel, "packed documents in one call"}, flops);
}
#endif
}  // namespace

void attention_forward_documents(const Tensor& out, const AttentionSaved& saved, const Tensor& q, const Tensor& k,
                                 const Tensor& v, const std::vector<std::vector<int64_t>>& doc_starts, double scale,
                                 Arena& scratch, int64_t window, double softcap, const Tensor& first_keys) {
  check_forward_operands(q, k, v, out, saved, scratch, AttentionMask::causal, {window}, softcap);
  const int64_t B = q.size(0), c = q.size(1), p = k.size(1) - c;
  const std::vector<DocumentSpan> spans = document_spans(doc_starts, B, p, c);
  const AttentionCall whole = attention_call(q, k, v, out, nullptr, nullptr, nullptr, nullptr,
                                             AttentionMask::causal, {window}, softcap);
  if (const std::optional<AttentionKernel> one = documents_in_one_call(whole, spans.size())) {
#if CW_HAVE_CUDA
    ArenaScope scope(scratch);
    count_one_call(whole, *one, spans, p, window);
    return gpu::flash_attention_forward(out, saved, q, k, v, scale, flash_family(*one), true, {window},
                                        chunk_first_keys(first_keys, spans, B, p, c, q, scratch), softcap);
#endif
  }
  for (const DocumentSpan& s : spans) {
    ArenaScope scope(scratch);
    const int64_t k0 = span_first_key(s, p, window), n = s.q1 - s.q0, keys = p + s.q1 - k0;
    // A span of whole rows writes its lse in place; a part of a row through a packed copy.
    const Tensor lse = span_lse(saved.lse, s, c, scratch, false);
    attention_forward(sequence_rows(out, s.b, s.q0, n), {lse}, sequence_rows(q, s.b, s.q0, n),
                      sequence_rows(k, s.b, k0, keys), sequence_rows(v, s.b, k0, keys), scale, scratch,
                      AttentionMask::causal, {window}, softcap);
    store_span_lse(saved.lse, s, c, lse);
  }
}

void attention_backward_documents(const Tensor& d_q, const Tensor& d_k, const Tensor& d_v, const Tensor& d_out,
                                  const AttentionSaved& saved, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& out, const std::vector<std::vector<int64_t>>& doc_starts, double scale,
                                  GradMode mode, Arena& scratch, int64_t window, double softcap,
                                  const Tensor& first_keys) {
  check_forward_operands(q, k, v, out, saved, scratch, AttentionMask::causal, {window}, softcap);
  check_backward_operands(d_q, d_k, d_v, d_out, q, k);
  const int64_t B = q.size(0), c = q.size(1), p = k.size(1) - c;
  const std::vector<DocumentSpan> spans = document_spans(doc_starts, B, p, c);
  const AttentionCall whole = attention_call(q, k, v, out, &d_q, &d_out, &d_k, &d_v, AttentionMask::causal, {window},
                                             softcap);
  if (const std::optional<AttentionKernel> one = documents_in_one_call(whole, spans.size())) {
#if CW_HAVE_CUDA
    ArenaScope scope(scratch);
    count_one_call(whole, *one, spans, p, window);
    return gpu::flash_attention_backward(d_q, d_k, d_v, d_out, saved, q, k, v, out, scale, mode, scratch,
                                         flash_family(*one),
                                         attention_flags().deterministic, true, {window},
                                         chunk_first_keys(first_keys, spans, B, p, c, q, scratch), softcap);
#endif
  }
  for (const DocumentSpan& s : spans) {
    ArenaScope scope(scratch);
    const int64_t k0 = span_first_key(s, p, window), n = s.q1 - s.q0, keys = p + s.q1 - k0;
    const Tensor lse = span_lse(saved.lse, s, c, scratch, true);
    attention_backward(sequence_rows(d_q, s.b, s.q0, n), sequence_rows(d_k, s.b, k0, keys),
                       sequence_rows(d_v, s.b, k0, keys), sequence_rows(d_out, s.b, s.q0, n), {lse},
                       sequence_rows(q, s.b, s.q0, n), sequence_rows(k, s.b, k0, keys),
                       sequence_rows(v, s.b, k0, keys), sequence_rows(out, s.b, s.q0, n), scale, mode, scratch,
                       AttentionMask::causal, {window}, softcap);
  }
}

Tensor document_first_keys(const std::vector<std::vector<int64_t>>& doc_starts, int64_t T, Arena& arena) {
  const int64_t B = static_cast<int64_t>(doc_starts.size());
  return upload_first_keys(document_spans(doc_starts, B, 0, T), B, T, arena);
}

namespace {
// The spans of a chunk at [p, p + c) that read keys of the block [k0, k0 + n), with the block rows
// they read: [first, n) of the block.
struct BlockSpan {
  DocumentSpan span;
  int64_t first;
};
std::vector<BlockSpan> block_spans(const std::vector<std::vector<int64_t>>& doc_starts, int64_t B, int64_t p,
                                   int64_t c, int64_t k0, int64_t n) {
  CW_CHECK(k0 >= 0 && n >= 1 && k0 + n <= p, "attention: the key block [{}, {}) must precede the chunk at {}", k0,
           k0 + n, p);
  std::vector<BlockSpan> out;
  for (const DocumentSpan& s : document_spans(doc_starts, B, p, c))
    if (s.k0 < k0 + n) out.push_back({s, std::max(s.k0, k0) - k0});
  return out;
}
}  // namespace

void attention_merge_documents_block(const Tensor& acc, const Tensor& lse_acc, const Tensor& q, const Tensor& k,
                                     const Tensor& v, int64_t p, int64_t k0,
                                     const std::vector<std::vector<int64_t>>& doc_starts, double scale,
                                     Arena& scratch, double softcap) {
  const int64_t B = q.size(0), c = q.size(1), H = q.size(2), D = q.size(3), n = k.size(1);
  check_shape(acc, {B, c, H, D}, "attention_merge_documents_block acc");
  check_shape(lse_acc, {B, H, c}, "attention_merge_documents_block lse_acc");
  for (const BlockSpan& bs : block_spans(doc_starts, B, p, c, k0, n)) {
    const DocumentSpan& s = bs.span;
    ArenaScope scope(scratch);
    const int64_t rows = s.q1 - s.q0, keys = n - bs.first;
    const Tensor out_b = scratch.alloc(q.dtype, {1, rows, H, D}), lse_b = scratch.alloc(lse_acc.dtype, {1, H, rows});
    attention_forward(out_b, {lse_b}, sequence_rows(q, s.b, s.q0, rows), sequence_rows(k, s.b, bs.first, keys),
                      sequence_rows(v, s.b, bs.first, keys), scale, scratch, AttentionMask::none, {}, softcap);
    const Tensor lse = span_lse(lse_acc, s, c, scratch, true);
    attention_merge(sequence_rows(acc, s.b, s.q0, rows), lse, out_b, lse_b);
    store_span_lse(lse_acc, s, c, lse);
  }
}

void attention_backward_documents_block(const Tensor& dq_acc, const Tensor& d_k, const Tensor& d_v,
                                        const Tensor& d_out, const AttentionSaved& saved, const Tensor& q,
                                        const Tensor& k, const Tensor& v, const Tensor& out, int64_t p, int64_t k0,
                                        const std::vector<std::vector<int64_t>>& doc_starts, double scale,
                                        Arena& scratch, double softcap) {
  const int64_t B = q.size(0), c = q.size(1), H = q.size(2), D = q.size(3), n = k.size(1);
  check_shape(dq_acc, {B, c, H, D}, "attention_backward_documents_block dq_acc");
  for (const BlockSpan& bs : block_spans(doc_starts, B, p, c, k0, n)) {
    const DocumentSpan& s = bs.span;
    ArenaScope scope(scratch);
    const int64_t rows = s.q1 - s.q0, keys = n - bs.first;
    const Tensor lse = span_lse(saved.lse, s, c, scratch, true);
    const Tensor dq_b = scratch.alloc(d_out.dtype, {1, rows, H, D});
    attention_backward(dq_b, sequence_rows(d_k, s.b, bs.first, keys), sequence_rows(d_v, s.b, bs.first, keys),
                       sequence_rows(d_out, s.b, s.q0, rows), {lse}, sequence_rows(q, s.b, s.q0, rows),
                       sequence_rows(k, s.b, bs.first, keys), sequence_rows(v, s.b, bs.first, keys),
                       sequence_rows(out, s.b, s.q0, rows), scale, GradMode::overwrite, scratch, AttentionMask::none,
                       {}, softcap);
    accumulate(sequence_rows(dq_acc, s.b, s.q0, rows), dq_b);
  }
}

void attention_merge(const Tensor& acc, const Tensor& lse_acc, const Tensor& out_b, const Tensor& lse_b) {
  CW_CHECK(acc.ndim == 4, "attention_merge: acc {} must be [B, c, H, D]", acc.describe());
  const int64_t B = acc.size(0), c = acc.size(1), H = acc.size(2);
  check_same_shape(out_b, acc, "attention_merge out_b", "attention_merge acc");
  check_shape(lse_acc, {B, H, c}, "attention_merge lse_acc");
  check_shape(lse_b, {B, H, c}, "attention_merge lse_b");
  CW_CHECK(out_b.dtype != DType::i32, "attention_merge: out_b is i32, not a float dtype");
  const DType acc_dtype = accum_dtype(out_b.dtype);
  for (const auto& [t, name] : {std::pair{&acc, "attention_merge acc"}, {&lse_acc, "attention_merge lse_acc"},
                                {&lse_b, "attention_merge lse_b"}})
    check_dtype(*t, acc_dtype, name);
  for (const auto& [t, name] : {std::pair{&acc, "attention_merge acc"}, {&lse_acc, "attention_merge lse_acc"},
                                {&out_b, "attention_merge out_b"}, {&lse_b, "attention_merge lse_b"}})
    check_contiguous(*t, name);
  check_same_device({{acc, "attention_merge acc"}, {lse_acc, "attention_merge lse_acc"},
                     {out_b, "attention_merge out_b"}, {lse_b, "attention_merge lse_b"}});
  if (acc.device.is_cpu()) return cpu::attention_merge(acc, lse_acc, out_b, lse_b);
#if CW_HAVE_CUDA
  return gpu::attention_merge(acc, lse_acc, out_b, lse_b);
#else
  fail("attention_merge: the operands are on a GPU but this build has no CUDA");
#endif
}

}  // namespace cw
