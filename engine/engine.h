// chunkwise engine: the settings and queries of the engine as a whole. Together with engine/ops/*.h,
// engine/memory.h, engine/residency.h, engine/trace.h and engine/env.h this is everything the layers
// above (model/, optim/, tools/) see of the engine: nothing above engine/ names a CUDA symbol or
// includes engine/cuda/.
//
// Settings are process-wide, each with a setter (tests and benchmarks force choices through them);
// those a user may choose also have an environment variable (engine/env.h: the registry), read once,
// on first use, unless the setter ran first.
#pragma once

#include "engine/ops/attention.h"
#include "engine/tensor.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace cw {

// ---- What this build and this machine have ----
struct BuildFeatures {
  bool cuda, cudnn, nccl;
};
BuildFeatures build_features();

struct GpuInfo {
  int index;
  std::string name;
  int sm_major, sm_minor, multiprocessors;
  size_t memory_bytes;
};
// The GPUs the CUDA runtime sees; empty in a CPU-only build or on a machine without a GPU.
std::vector<GpuInfo> list_gpus();
bool gpu_available();  // this build has CUDA and the runtime sees at least one GPU
// One line per device, starting with the CPU; used by `chunkwise devices` and test skip messages.
std::string describe_devices();

// ---- Determinism (env CW_DETERMINISTIC=0|1; off by default) ----
// On: every GPU result is bitwise reproducible (only deterministic kernels run). Off: the attention
// backward may sum dQ with f32 atomics (values agree to f32 rounding; the order varies).
void set_deterministic(bool on);
bool deterministic();

// ---- Attention kernel (env CW_ATTENTION; `auto` by default) ----
// Forces the kernel family every attention call runs (engine/ops/attention.h: choose_attention_kernel
// says what `automatic` picks and why). Forcing a family that cannot take a call is a clear error.
void set_attention_kernel(AttentionKernel kernel);
AttentionKernel attention_kernel();

// ---- GEMM algorithms (off by default; on only where bench-ops times the two) ----
// On: the first call of each GEMM shape (engine/cuda/linear.cu: shape, transposes, dtypes, alignment)
// times up to eight of cuBLASLt's candidate algorithms on the call's own operands and keeps the
// fastest for the life of the process, so a process gives the same bits on every call; another
// process may time another algorithm fastest and round differently. Off, and whenever determinism is
// on: cuBLASLt's first answer, the same in every process. The stats: shapes tuned, those where the
// fastest was not cuBLASLt's first answer, and the summed time of one call of each, first answer
// against the fastest. Off by default: whole steps run no faster with it (a 32K step within the noise
// of one run; docs/decisions.md, "GEMMs"), and the timed choice varies from process to process.
void set_gemm_tuning(bool on);
bool gemm_tuning();
struct GemmTuneStats {
  bool on = false;  // tuning applies (asked for, and not deterministic())
  int64_t plans = 0, changed = 0;
  double first_ms = 0, chosen_ms = 0;
};
GemmTuneStats gemm_tune_stats();  // zeros without CUDA

// Sets a process-wide setting (a set_X / X pair of this header) for one scope and restores what it
// was, however the scope ends.
template <typename T>
class SettingScope {
 public:
  SettingScope(T (*get)(), void (*set)(T), T value) : set_(set), saved_(get()) { set(value); }
  ~SettingScope() { set_(saved_); }
  SettingScope(const SettingScope&) = delete;
  SettingScope& operator=(const SettingScope&) = delete;
  const T& saved() const { return saved_; }  // the value before the scope

 private:
  void (*set_)(T);
  T saved_;
};

// ---- The attention backward's workspace budget (env CW_ATTENTION_WORKSPACE_MIB) ----
// A cuDNN backward plan needing more workspace than the budget does not run; flash takes the call.
// By default the budget is a quarter of the device memory free when the first backward asks (at
// least 256 MiB); raise_attention_workspace_budget lifts it to at least `bytes` (bench and train
// pass what their plan counted for the largest backward: tools/planner). CW_ATTENTION_WORKSPACE_MIB=N
// fixes it at N MiB, whatever is raised.
void raise_attention_workspace_budget(Device device, int64_t bytes);
int64_t attention_workspace_budget(Device device);  // 0 without cuDNN

// ---- cuDNN attention: the forms the tests and bench-ops compare ----
// These have setters and no environment variable: each default is the faster form, and the other
// stays for the tests that hold the two against each other (and bench-ops, which times them).
// Plans: cuDNN runs each attention problem through an execution plan that costs ~0.1-0.8 s to build.
// exact (the default): one plan per key count, so a SeCO step's first pass builds one per chunk
// offset (128K in chunks of 2048: 128 plans, 23 s on an H100; built ahead, below) and every step
// runs the fastest kernels. shared: a call whose K/V are a slice of a longer store (SeCO's K/V store)
// runs the plan of the store's whole extent, the real key count given at run time, so a step builds
// one plan per direction (engine/cuda/attention_cudnn_plans.cu says when it applies); its padded
// kernel runs a warm 128K step about 6% slower (docs/decisions.md, "cuDNN plans and the first step").
// With exact plans, a built shared plan still stands in for an exact one that is being built ahead. The
// results agree to rounding (tested on the GPU).
enum class CudnnPlans { exact, shared };
void set_cudnn_plans(CudnnPlans plans);
CudnnPlans cudnn_plans();
// The prefix apart (on by default): a chunk's call with keys before it (c >= 64 queries, p = S - c >= c,
// an exact plan) runs as two cuDNN graphs: the chunk's queries against the p earlier keys unmasked,
// and against its own c keys causal, merged (forward) or with dQ summed (backward). cuDNN's
// bottom-right causal mask computes the mask on every key tile; apart, the prefix needs none and the
// own block is the square causal case, which skips the tiles above the diagonal (0.86-0.93x the time
// of one call forward, 0.71-0.90x backward, at 64K keys: docs/performance.md, "GPU ops against
// torch"). Exact plans only (shared plans keep one graph). Off: one graph.
void set_cudnn_split_prefix(bool on);
bool cudnn_split_prefix();
// The backward of that unmasked prefix with grouped K/V heads stacked (on by default): each K/V
// head's G query heads stacked into one head of G c rows (Q, O, dO copied head-major; the lse is
// already laid out so), so cuDNN runs it as plain multi-head attention and accumulates dK, dV over
// all G c rows itself (3% faster at 128K on an H100). Off: cuDNN computes dK, dV per query head and
// reduces them in a pass of its own, O(G p) traffic per call.
void set_cudnn_stack_gqa(bool on);
bool cudnn_stack_gqa();
// Whether a causal cuDNN call of `queries` rows, the last of `keys` keys, runs with its prefix apart
// under the settings: the split on, exact plans, a chunk of at least kSplitMinQueries queries with at
// least as many keys before it (the split was measured on chunks of 1K-32K; a few queries keep one
// graph and its one plan). The rule the cuDNN path follows and the planner (tools/planner) predicts
// with.
inline constexpr int64_t kSplitMinQueries = 64;
bool cudnn_splits_prefix(int64_t queries, int64_t keys);
// Whether such a call's backward, `heads` query heads on `kv_heads` K/V heads, runs its prefix with
// the query heads stacked per K/V head: the prefix apart (cudnn_splits_prefix), grouped heads, the
// setting on (cudnn_stack_gqa). The cuDNN path and the planner follow this one rule.
bool cudnn_stacks_gqa(int64_t queries, int64_t keys, int64_t heads, int64_t kv_heads);
// Plans built ahead (env CW_CUDNN_PLAN_THREADS: the count of host threads, 0: off; default half the
// cores, at most 8): when
// a call whose K/V are a slice of a longer store (a SeCO sweep) needs an exact plan not yet built,
// the plans of the other offsets of its chunk length, both directions, in sweep order, are queued
// for host threads that build them while the step runs, after the family's two shared plans. With
// determinism off, such a call runs on the shared plan while its own is still being built, or on
// our flash kernels while that too is being built (engine/ops/attention.cpp), so the first step
// does not wait, except the backward whose keys fill the store, which shapes the scratch arena for
// every later step; with it on, the call waits for its plan (or builds it itself).
void set_cudnn_plan_threads(int threads);
int cudnn_plan_threads();
// Plans built since the process started (all devices), those cuDNN refused (a shared plan it
// refuses falls back to the exact one), the seconds spent building both (summed over the threads
// that built them), of them the plans built ahead, the seconds calls waited for a plan another
// thread was building, and the calls that ran their family's shared plan while their exact plan
// was being built ahead, the calls that ran with their prefix apart (cudnn_split_prefix), and of
// those the backwards whose prefix ran stacked (cudnn_stack_gqa). Zeros without cuDNN.
struct AttentionPlanStats {
  int64_t built = 0, refused = 0, built_ahead = 0, stood_in = 0, split = 0, stacked = 0;
  double seconds = 0, waited_seconds = 0;
};
AttentionPlanStats attention_plan_stats();

// ---- Background work ----
// The host threads the engine runs on its own (the cuDNN plans built ahead): stop_background_work
// drops what is queued and waits for the work in hand. A program stops them before it exits (hold a
// BackgroundWorkScope in main): the libraries those threads call tear down their state with the
// static destructors, which must not run under them.
void stop_background_work();
struct BackgroundWorkScope {
  BackgroundWorkScope() = default;
  BackgroundWorkScope(const BackgroundWorkScope&) = delete;
  BackgroundWorkScope& operator=(const BackgroundWorkScope&) = delete;
  ~BackgroundWorkScope() { stop_background_work(); }
};

// ---- Copies between host and device ----
// The seconds the device's compute stream spent blocked waiting for host <-> device copies (K/V
// offload, offloaded layer inputs) since the previous call; waits for the device. 0 for the CPU.
double take_copy_wait_seconds(Device device);

// ---- Copies for work done on the host (the offloaded optimizer, optim/adamw_offload.h) ----
// Host memory that the device's copies can read and write asynchronously: pinned (page-locked) on a
// GPU, plain host memory on the CPU. Zero bytes allocate nothing.
class StagingBuffer {
 public:
  StagingBuffer() = default;
  StagingBuffer(size_t bytes, Device device);
  StagingBuffer(StagingBuffer&& other) noexcept;
  StagingBuffer& operator=(StagingBuffer&& other) noexcept;
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;
  ~StagingBuffer();
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_{};
};
// Host memory that already exists (a ParamSet's buffer), page-locked for `device` while this lives, so
// copy_async to and from it runs asynchronously at the bus's speed. Nothing on the CPU.
class PinnedRegion {
 public:
  PinnedRegion(void* data, size_t bytes, Device device);
  PinnedRegion(const PinnedRegion&) = delete;
  PinnedRegion& operator=(const PinnedRegion&) = delete;
  ~PinnedRegion();

 private:
  void* data_ = nullptr;
};
// Copies `bytes` between a staging buffer and device memory (either direction) on one of the device's
// two copy lanes (to_host: the lane of copies out of device memory, else the lane of copies in; the
// two run at once), after everything queued on its compute stream so far (the bytes read are final,
// the bytes written no longer read). Returns a ticket. On the CPU it is a memcpy at the call (ticket 0).
uint64_t copy_async(void* dst, const void* src, size_t bytes, Device device, bool to_host = false);
// The host blocks until the ticket's copy (and every earlier copy of its lane) has finished.
void host_wait_for_copy(uint64_t ticket, Device device);
// The compute stream waits (the host does not) until the ticket's copy has finished: the next op
// queued reads what it wrote.
void compute_wait_for_copy(uint64_t ticket, Device device);

// ---- CPU threads ----
// The CPU kernels' parallel loops (OpenMP loops and Eigen's matrix products) use up to cpu_threads()
// threads. The limit belongs to the calling thread (OpenMP's per-thread nthreads setting), so
// threads that each run kernels (parallel/comm.h's thread ranks) can share the cores out between
// them instead of each opening a team of all of them. 1 in a build without OpenMP.
int cpu_threads();
// Sets the calling thread's limit to max(1, n) for the scope and restores the previous one after.
class CpuThreadsScope {
 public:
  explicit CpuThreadsScope(int n);
  ~CpuThreadsScope();
  CpuThreadsScope(const CpuThreadsScope&) = delete;
  CpuThreadsScope& operator=(const CpuThreadsScope&) = delete;

 private:
  int previous_;
};

// ---- Device memory ----
struct DeviceMemory {
  size_t free = 0, total = 0;  // bytes, as the driver reports them
};
DeviceMemory device_memory(Device device);
struct PoolStats {
  size_t in_use = 0, cached = 0, peak_in_use = 0, cuda_mallocs = 0;
};
PoolStats pool_stats(Device device);      // the device's caching pool (zeros for the CPU)
// A ceiling on the bytes the device's caching pool holds from the driver (in use and cached; 0: none,
// the default): an allocation that would pass it first returns the cached blocks, then fails with an
// out-of-memory error naming the limit. `--device-memory GiB` of train and bench sets it to the GiB
// less the CUDA context (tools/planner/planner.h), so a run behaves as on a GPU of that size.
void set_device_memory_limit(Device device, size_t bytes);
size_t device_memory_limit(Device device);
// The limit for a scope (a run), the previous one restored after it.
class DeviceMemoryLimitScope {
 public:
  DeviceMemoryLimitScope(Device device, size_t bytes) : device_(device), previous_(device_memory_limit(device)) {
    set_device_memory_limit(device, bytes);
  }
  ~DeviceMemoryLimitScope() { set_device_memory_limit(device_, previous_); }
  DeviceMemoryLimitScope(const DeviceMemoryLimitScope&) = delete;
  DeviceMemoryLimitScope& operator=(const DeviceMemoryLimitScope&) = delete;

 private:
  Device device_;
  size_t previous_;
};
void release_cached(Device device);       // cached blocks back to the driver
std::string memory_report(Device device); // one line: in use, cached, peak, mallocs, free

// ---- Sizes of the engine's own buffers (tools/planner predicts memory from these; each op's scratch: scratch.h) ----
inline constexpr size_t kMemoryAlignBytes = 64;                      // buffers and arena allocations round up to this
inline constexpr size_t kHostArenaBlockBytes = size_t(64) << 20;     // an arena's block on the host (block_bytes 0)
inline constexpr size_t kDeviceArenaBlockBytes = size_t(256) << 20;  // ... on a GPU
inline constexpr size_t kCublasWorkspaceBytes = size_t(32) << 20;    // cuBLASLt's workspace, one per device
// The GPU device pool's size class of a request: 512-byte steps below 1 MiB, 2 MiB steps above.
constexpr size_t device_pool_block(size_t bytes) {
  constexpr size_t small = 512, large = size_t(2) << 20;
  return bytes < (size_t(1) << 20) ? (bytes + small - 1) / small * small : (bytes + large - 1) / large * large;
}
// The GPU LM head's row block over N rows of logits with leading dimension ld (elements of
// elem_bytes): as many rows as fit 512 MiB of logits, at most 2048, in whole quanta of 64 rows
// (at least one quantum), at most N (engine/cuda/lm_head.cu says why).
constexpr int64_t lm_head_block_rows(int64_t N, int64_t ld, size_t elem_bytes) {
  constexpr size_t budget = size_t(512) << 20;
  constexpr int64_t max_rows = 2048, quantum = 64;
  int64_t rows = static_cast<int64_t>(budget / (static_cast<size_t>(ld) * elem_bytes));
  rows = (rows < max_rows ? rows : max_rows) / quantum * quantum;
  rows = rows > quantum ? rows : quantum;
  return rows < N ? rows : N;
}

// ---- Ordering and timing ----
void synchronize(Device device);          // waits for everything queued on the device
// Opens (or closes) a profiled range: cudaProfilerStart / cudaProfilerStop, which profilers (Nsight,
// tools/kernel_profile) take as the part of a run to report. Bench opens one around each timed step;
// the caller synchronizes before closing it. Nothing on the CPU.
void profiler_range(Device device, bool open);
// The GPU's compute stream (every op's) as an opaque handle, a cudaStream_t: for a library that must
// queue its work in order with the ops (the NCCL communicator, parallel/comm_nccl.cu). Makes the
// device current for the calling thread.
void* compute_stream(Device device);
// Median milliseconds of fn over `repeat` timed runs after `warmup` untimed ones (CUDA events on the
// device's stream; wall clock on the CPU). For benchmarks, never for tests.
double median_ms(const std::function<void()>& fn, Device device, int warmup = 3, int repeat = 20);

}  // namespace cw
