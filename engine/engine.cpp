// The engine's public settings and queries (engine/engine.h): CPU answers here, GPU ones from the
// CUDA runtime (engine/cuda/runtime.h; in a build without CUDA its stub says so).
#include "engine/engine.h"

#include "chunkwise_config.h"
#include "engine/cuda/runtime.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace cw {

#if CW_HAVE_CUDA
std::vector<GpuInfo> cuda_list_gpus();  // engine/cuda/device_query.cu
#endif
#if CW_HAVE_CUDNN
namespace gpu {
AttentionPlanStats cudnn_plan_stats();  // engine/cuda/attention_cudnn_plans.cu
void cudnn_stop_plan_threads();         // engine/cuda/attention_cudnn_plans.cu
}  // namespace gpu
#endif

BuildFeatures build_features() { return {CW_HAVE_CUDA != 0, CW_HAVE_CUDNN != 0, CW_HAVE_NCCL != 0}; }

std::vector<GpuInfo> list_gpus() {
#if CW_HAVE_CUDA
  return cuda_list_gpus();
#else
  return {};
#endif
}

bool gpu_available() { return gpu::available(); }

int cpu_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// Eigen's products ask omp_get_max_threads() too (Eigen::nbThreads() while setNbThreads was never
// called, which is process-wide and stays untouched), so the per-thread setting covers them.
CpuThreadsScope::CpuThreadsScope(int n) : previous_(cpu_threads()) {
#ifdef _OPENMP
  omp_set_num_threads(std::max(1, n));
#else
  (void)n;
#endif
}

CpuThreadsScope::~CpuThreadsScope() {
#ifdef _OPENMP
  omp_set_num_threads(previous_);
#endif
}

std::string describe_devices() {
  const BuildFeatures f = build_features();
  std::string s = fmt::format("build: cuda={} cudnn={} nccl={}\ncpu: {} hardware threads\n", f.cuda, f.cudnn, f.nccl,
                              std::thread::hardware_concurrency());
  for (const GpuInfo& g : list_gpus())
    s += fmt::format("cuda:{}: {} (sm_{}{}, {} SMs, {:.1f} GiB)\n", g.index, g.name, g.sm_major, g.sm_minor,
                     g.multiprocessors, static_cast<double>(g.memory_bytes) / (1ull << 30));
  return s;
}

AttentionPlanStats attention_plan_stats() {
#if CW_HAVE_CUDNN
  return gpu::cudnn_plan_stats();
#else
  return {};
#endif
}

void stop_background_work() {
#if CW_HAVE_CUDNN
  gpu::cudnn_stop_plan_threads();
#endif
}

double take_copy_wait_seconds(Device device) {
  return device.is_cpu() ? 0.0 : gpu::take_copy_wait_seconds(device.index);
}

StagingBuffer::StagingBuffer(size_t bytes, Device device) : bytes_(bytes), device_(device) {
  if (bytes == 0) return;
  if (device.is_cpu()) {
    data_ = std::aligned_alloc(kMemoryAlignBytes, (bytes + kMemoryAlignBytes - 1) / kMemoryAlignBytes * kMemoryAlignBytes);
    CW_CHECK(data_, "cannot allocate {} MiB of host memory for staging copies", double(bytes) / double(1 << 20));
  } else {
    data_ = gpu::pinned_alloc(bytes);
  }
}

StagingBuffer::StagingBuffer(StagingBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)), device_(other.device_) {}

StagingBuffer& StagingBuffer::operator=(StagingBuffer&& other) noexcept {
  if (this != &other) {
    this->~StagingBuffer();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    device_ = other.device_;
  }
  return *this;
}

StagingBuffer::~StagingBuffer() {
  if (!data_) return;
  if (device_.is_cpu()) std::free(data_);
  else gpu::pinned_free(data_);
  data_ = nullptr;
}

PinnedRegion::PinnedRegion(void* data, size_t bytes, Device device) {
  if (device.is_cpu() || !data || bytes == 0) return;
  if (gpu::host_register(data, bytes)) data_ = data;
}

PinnedRegion::~PinnedRegion() { gpu::host_unregister(data_); }

uint64_t copy_async(void* dst, const void* src, size_t bytes, Device device, bool to_host) {
  if (device.is_cpu()) {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return 0;
  }
  return gpu::copies_on_side_stream({{dst, src, bytes}}, device.index, to_host ? gpu::CopyLane::out : gpu::CopyLane::in);
}

void host_wait_for_copy(uint64_t ticket, Device device) {
  if (!device.is_cpu()) gpu::host_wait_for_copy(ticket, device.index);
}

void compute_wait_for_copy(uint64_t ticket, Device device) {
  if (!device.is_cpu()) gpu::wait_for_copy(ticket, device.index);
}

void set_device_memory_limit(Device device, size_t bytes) {
  CW_CHECK(!device.is_cpu(), "set_device_memory_limit is for a GPU; host memory is the operating system's");
  gpu::set_pool_limit(device.index, bytes);
}

size_t device_memory_limit(Device device) { return device.is_cpu() ? 0 : gpu::pool_limit(device.index); }

DeviceMemory device_memory(Device device) {
  CW_CHECK(!device.is_cpu(), "device_memory asks about a GPU; host memory is the operating system's");
  const gpu::MemoryInfo m = gpu::memory_info(device.index);
  return {m.free, m.total};
}

PoolStats pool_stats(Device device) {
  if (device.is_cpu()) return {};
  const gpu::PoolStats s = gpu::pool_stats(device.index);
  return {s.in_use, s.cached, s.peak_in_use, s.cuda_mallocs};
}

void release_cached(Device device) {
  if (!device.is_cpu()) gpu::release_cached(device.index);
}

std::string memory_report(Device device) {
  return device.is_cpu() ? std::string("cpu: host memory (no pool)") : gpu::memory_report(device.index);
}

void synchronize(Device device) {
  if (!device.is_cpu()) gpu::synchronize(device.index);
}

namespace {
std::atomic<bool> g_gemm_tuning{false};
}  // namespace

void set_gemm_tuning(bool on) { g_gemm_tuning.store(on); }
bool gemm_tuning() { return g_gemm_tuning.load(); }

GemmTuneStats gemm_tune_stats() { return gpu::gemm_tune_stats(); }

void profiler_range(Device device, bool open) {
  if (!device.is_cpu()) gpu::profiler_range(open);
}

void* compute_stream(Device device) {
  CW_CHECK(!device.is_cpu(), "compute_stream: {} has no stream; a GPU has", device_name(device));
  return gpu::compute_stream_handle(device.index);
}

double median_ms(const std::function<void()>& fn, Device device, int warmup, int repeat) {
  if (!device.is_cpu()) return gpu::median_ms(fn, device.index, warmup, repeat);
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < std::max(repeat, 1); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(ms.begin(), ms.begin() + static_cast<std::ptrdiff_t>(ms.size() / 2), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace cw
