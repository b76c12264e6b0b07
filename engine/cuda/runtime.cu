// The CUDA runtime of the engine: caching device allocator, per-device stream, copies with dtype
// conversion, fills, and the error helpers behind CW_CUDA_CHECK / CW_CUBLAS_CHECK.
//
// Caching pool: sizes are rounded to a class (512 B steps below 1 MiB, 2 MiB steps above); a freed
// block goes to its class's free list and the next request of that class takes it, so a training
// step that repeats the previous step's allocations never reaches cudaMalloc. When cudaMalloc runs
// out of memory the pool returns its cached blocks to the driver and tries once more; failing that,
// the error reports what is in use, what is cached and the peak.
#include "engine/cuda/common.cuh"
#include "engine/cuda/runtime.h"
#include "engine/engine.h"
#include "engine/memory.h"

#include <cublas_v2.h>
#include <cuda_profiler_api.h>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <map>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace cw::gpu {

void raise_cuda(cudaError_t e, const char* expr, const char* file, int line) {
  cudaGetLastError();  // clear a non-sticky error so later calls are not blamed for it
  const std::string hint = e == cudaErrorMemoryAllocation
                               ? "the GPU is out of memory: lower the batch, sequence or chunk length"
                               : (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver
                                      ? "no usable GPU: run on a machine with an NVIDIA GPU and driver, or use --device cpu"
                                      : "");
  ::cw::detail::raise(expr, file, line, CW_FORMAT("CUDA error {}: {}", cudaGetErrorName(e), cudaGetErrorString(e)),
                      hint);
}

void raise_cublas(cublasStatus_t s, const char* expr, const char* file, int line) {
  ::cw::detail::raise(expr, file, line, CW_FORMAT("cuBLAS error {}: {}", static_cast<int>(s), cublasGetStatusString(s)));
}

namespace {
constexpr int kMaxDevices = 16;

size_t size_class(size_t bytes) { return cw::device_pool_block(bytes); }

struct Pool {
  std::mutex mutex;
  std::multimap<size_t, void*> free_blocks;      // size class -> cached block
  std::unordered_map<void*, size_t> live;        // block -> size class
  PoolStats stats;
  size_t limit = 0;  // the most bytes held from the driver (in use + cached); 0: none
};

Pool& pool(int device) {
  static std::array<Pool, kMaxDevices> pools;
  CW_CHECK(device >= 0 && device < kMaxDevices, "GPU index {} out of range", device);
  return pools[static_cast<size_t>(device)];
}

void release_locked(Pool& p) {
  for (auto& [size, ptr] : p.free_blocks) {
    cudaFree(ptr);
    p.stats.cached -= size;
  }
  p.free_blocks.clear();
}

// A tensor as rows of contiguous elements: rows x row_elems with `pitch` elements between row starts.
// Contiguous tensors are one row; K/V store slices are B rows with the store's batch stride.
struct Rows {
  int64_t rows, row_elems, pitch;
};
Rows as_rows(const Tensor& t, const char* what) {
  if (t.contiguous()) return {1, t.numel(), t.numel()};
  int64_t inner = 1;
  for (int d = t.ndim - 1; d >= 1; --d) {
    CW_CHECK(t.stride[d] == inner || t.shape[d] == 1, "{} {}: on the GPU only dimension 0 may be strided", what,
             t.describe());
    inner *= t.shape[d];
  }
  return {t.shape[0], inner, t.stride[0]};
}

template <class Src, class Dst>
__global__ void convert_kernel(Dst* dst, int64_t dst_pitch, const Src* src, int64_t src_pitch, int64_t rows,
                               int64_t row_elems) {
  const int64_t n = rows * row_elems;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / row_elems, c = i % row_elems;
    dst[r * dst_pitch + c] = static_cast<Dst>(static_cast<float>(src[r * src_pitch + c]));
  }
}
template <class Src>
__global__ void convert_to_bf16_kernel(__nv_bfloat16* dst, int64_t dst_pitch, const Src* src, int64_t src_pitch,
                                       int64_t rows, int64_t row_elems) {
  const int64_t n = rows * row_elems;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / row_elems, c = i % row_elems;
    dst[r * dst_pitch + c] = __float2bfloat16_rn(static_cast<float>(src[r * src_pitch + c]));
  }
}
__global__ void convert_from_bf16_kernel_f32(float* dst, int64_t dst_pitch, const __nv_bfloat16* src,
                                             int64_t src_pitch, int64_t rows, int64_t row_elems) {
  const int64_t n = rows * row_elems;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / row_elems, c = i % row_elems;
    dst[r * dst_pitch + c] = __bfloat162float(src[r * src_pitch + c]);
  }
}

template <class T> __global__ void fill_kernel(T* p, int64_t pitch, int64_t rows, int64_t row_elems, T value) {
  const int64_t n = rows * row_elems;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[(i / row_elems) * pitch + i % row_elems] = value;
}

template <class T> __global__ void scale_kernel(T* p, int64_t pitch, int64_t rows, int64_t row_elems, float f) {
  const int64_t n = rows * row_elems;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    T& x = p[(i / row_elems) * pitch + i % row_elems];
    x = from_f32<T>(to_f32(x) * f);
  }
}

unsigned grid_for(int64_t n) { return static_cast<unsigned>(std::min<int64_t>(4096, (n + 255) / 256)); }
}  // namespace

bool available() { return device_count() > 0; }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

cudaStream_t current_stream(int device) {
  static std::array<cudaStream_t, kMaxDevices> streams{};
  static std::mutex mutex;
  std::lock_guard lock(mutex);
  CW_CHECK(device >= 0 && device < kMaxDevices, "GPU index {} out of range", device);
  CW_CUDA_CHECK(cudaSetDevice(device));
  if (!streams[static_cast<size_t>(device)])
    CW_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[static_cast<size_t>(device)], cudaStreamNonBlocking));
  return streams[static_cast<size_t>(device)];
}

void* device_alloc(size_t bytes, int device) {
  Pool& p = pool(device);
  const size_t size = size_class(std::max<size_t>(bytes, 1));
  std::lock_guard lock(p.mutex);
  void* ptr = nullptr;
  if (auto it = p.free_blocks.find(size); it != p.free_blocks.end()) {
    ptr = it->second;
    p.free_blocks.erase(it);
    p.stats.cached -= size;
  } else {
    CW_CUDA_CHECK(cudaSetDevice(device));
    if (p.limit > 0 && p.stats.in_use + p.stats.cached + size > p.limit) release_locked(p);
    if (p.limit > 0 && p.stats.in_use + size > p.limit)
      fail(CW_FORMAT("cuda:{}: cannot allocate {} MiB: out of memory under the device memory limit of {:.2f} GiB "
                     "(in use {} MiB, peak {} MiB)",
                     device, double(size) / (1 << 20), double(p.limit) / double(1ull << 30),
                     double(p.stats.in_use) / (1 << 20), double(p.stats.peak_in_use) / (1 << 20)),
           "raise --device-memory, or lower the batch, sequence or chunk length (chunkwise plan says what fits)");
    cudaError_t e = cudaMalloc(&ptr, size);
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      release_locked(p);
      e = cudaMalloc(&ptr, size);
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      fail(CW_FORMAT("cuda:{}: cannot allocate {} MiB ({}; in use {} MiB, peak {} MiB)", device,
                       double(size) / (1 << 20), cudaGetErrorString(e), double(p.stats.in_use) / (1 << 20),
                       double(p.stats.peak_in_use) / (1 << 20)),
           "lower the batch, sequence or chunk length, or use a schedule that keeps less (seco)");
    }
    ++p.stats.cuda_mallocs;
  }
  p.live[ptr] = size;
  p.stats.in_use += size;
  p.stats.peak_in_use = std::max(p.stats.peak_in_use, p.stats.in_use);
  return ptr;
}

void device_free(void* ptr, int device) {
  if (!ptr) return;
  Pool& p = pool(device);
  std::lock_guard lock(p.mutex);
  auto it = p.live.find(ptr);
  if (it == p.live.end()) return;  // not ours: never free what we did not allocate
  // The block may still be read by queued kernels; ordering on the one stream makes reuse safe.
  p.free_blocks.emplace(it->second, ptr);
  p.stats.in_use -= it->second;
  p.stats.cached += it->second;
  p.live.erase(it);
}

void device_memset_zero(void* ptr, size_t bytes, int device) {
  CW_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, current_stream(device)));
}

void set_pool_limit(int device, size_t bytes) {
  Pool& p = pool(device);
  std::lock_guard lock(p.mutex);
  p.limit = bytes;
}

size_t pool_limit(int device) {
  Pool& p = pool(device);
  std::lock_guard lock(p.mutex);
  return p.limit;
}

PoolStats pool_stats(int device) {
  Pool& p = pool(device);
  std::lock_guard lock(p.mutex);
  return p.stats;
}

void release_cached(int device) {
  Pool& p = pool(device);
  synchronize(device);
  std::lock_guard lock(p.mutex);
  release_locked(p);
}

void synchronize(int device) { CW_CUDA_CHECK(cudaStreamSynchronize(current_stream(device))); }

void* compute_stream_handle(int device) { return current_stream(device); }

void profiler_range(bool open) { CW_CUDA_CHECK(open ? cudaProfilerStart() : cudaProfilerStop()); }

std::string memory_report(int device) {
  const PoolStats s = pool_stats(device);
  size_t free_b = 0, total_b = 0;
  CW_CUDA_CHECK(cudaSetDevice(device));
  CW_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return CW_FORMAT("cuda:{}: in use {} MiB, cached {} MiB, peak {} MiB, {} cudaMalloc calls, "
                     "device free {} of {} GiB",
                     device, double(s.in_use) / (1 << 20), double(s.cached) / (1 << 20),
                     double(s.peak_in_use) / (1 << 20), s.cuda_mallocs, double(free_b) / (1ull << 30),
                     double(total_b) / (1ull << 30));
}

void copy_convert(const Tensor& dst, const Tensor& src) {
  check_same_shape(dst, src, "copy destination", "copy source");
  if (dst.numel() == 0) return;
  const bool dst_dev = !dst.device.is_cpu(), src_dev = !src.device.is_cpu();
  const int device = dst_dev ? dst.device.index : src.device.index;
  cudaStream_t stream = current_stream(device);
  if (dst.dtype != src.dtype && dst_dev != src_dev) {
    // Convert on the host side, then move the bytes: host conversion is exact (round to nearest even).
    if (src_dev) {
      OwnedTensor staged = OwnedTensor::of_shape(src.dtype, std::vector<int64_t>(src.shape.begin(), src.shape.begin() + src.ndim));
      gpu::copy_convert(staged.tensor, src);
      ::cw::copy_convert(dst, staged.tensor);
    } else {
      OwnedTensor staged = OwnedTensor::of_shape(dst.dtype, std::vector<int64_t>(dst.shape.begin(), dst.shape.begin() + dst.ndim));
      ::cw::copy_convert(staged.tensor, src);
      gpu::copy_convert(dst, staged.tensor);
    }
    return;
  }
  const Rows d = as_rows(dst, "copy destination"), s = as_rows(src, "copy source");
  // A packed side (rows == 1) is read as rows of the other side's length: the shapes are equal, so
  // a row is everything but dimension 0 on both sides.
  CW_CHECK(d.rows == s.rows || d.rows == 1 || s.rows == 1, "copy between {} and {}: row layouts differ",
           dst.describe(), src.describe());
  const int64_t rows = std::max(d.rows, s.rows), row_elems = dst.numel() / rows;
  if (dst.dtype == src.dtype) {
    const size_t es = dtype_size(dst.dtype);
    CW_CUDA_CHECK(cudaMemcpy2DAsync(dst.data, static_cast<size_t>(d.rows == 1 ? row_elems : d.pitch) * es, src.data,
                                    static_cast<size_t>(s.rows == 1 ? row_elems : s.pitch) * es,
                                    static_cast<size_t>(row_elems) * es, static_cast<size_t>(rows), cudaMemcpyDefault,
                                    stream));
    if (!dst_dev || !src_dev) CW_CUDA_CHECK(cudaStreamSynchronize(stream));  // host data valid on return
    return;
  }
  // Both on the device, different dtypes.
  const int64_t dp = d.rows == 1 ? row_elems : d.pitch, sp = s.rows == 1 ? row_elems : s.pitch;
  const unsigned grid = grid_for(rows * row_elems);
  auto bf = [](const Tensor& t) { return static_cast<__nv_bfloat16*>(t.data); };
  if (dst.dtype == DType::bf16 && src.dtype == DType::f32)
    convert_to_bf16_kernel<float><<<grid, 256, 0, stream>>>(bf(dst), dp, static_cast<const float*>(src.data), sp, rows, row_elems);
  else if (dst.dtype == DType::bf16 && src.dtype == DType::f64)
    convert_to_bf16_kernel<double><<<grid, 256, 0, stream>>>(bf(dst), dp, static_cast<const double*>(src.data), sp, rows, row_elems);
  else if (dst.dtype == DType::f32 && src.dtype == DType::bf16)
    convert_from_bf16_kernel_f32<<<grid, 256, 0, stream>>>(static_cast<float*>(dst.data), dp, bf(src), sp, rows, row_elems);
  else if (dst.dtype == DType::f32 && src.dtype == DType::f64)
    convert_kernel<double, float><<<grid, 256, 0, stream>>>(static_cast<float*>(dst.data), dp, static_cast<const double*>(src.data), sp, rows, row_elems);
  else if (dst.dtype == DType::f64 && src.dtype == DType::f32)
    convert_kernel<float, double><<<grid, 256, 0, stream>>>(static_cast<double*>(dst.data), dp, static_cast<const float*>(src.data), sp, rows, row_elems);
  else
    fail(CW_FORMAT("GPU copy from {} to {} is not supported", dtype_name(src.dtype), dtype_name(dst.dtype)));
  CW_KERNEL_CHECK();
}

namespace {
// The launch geometry of an in-place kernel over a tensor seen as rows (contiguous, or rows at a pitch).
struct InPlace {
  int64_t pitch, rows, row_elems;
  cudaStream_t stream;
  unsigned grid;
};
InPlace in_place(const Tensor& t, const char* what) {
  const Rows r = as_rows(t, what);
  return {r.rows == 1 ? r.row_elems : r.pitch, r.rows, r.row_elems, current_stream(t.device.index), grid_for(t.numel())};
}
}  // namespace

void fill(const Tensor& t, double value) {
  if (t.numel() == 0) return;
  const InPlace g = in_place(t, "fill target");
  auto launch = [&](auto* data, auto v) {
    fill_kernel<<<g.grid, 256, 0, g.stream>>>(data, g.pitch, g.rows, g.row_elems, v);
  };
  switch (t.dtype) {
    case DType::f32: launch(static_cast<float*>(t.data), float(value)); break;
    case DType::f64: launch(static_cast<double*>(t.data), value); break;
    case DType::bf16: launch(static_cast<__nv_bfloat16*>(t.data), __float2bfloat16_rn(float(value))); break;
    case DType::i32: launch(static_cast<int32_t*>(t.data), int32_t(value)); break;
  }
  CW_KERNEL_CHECK();
}

void scale_inplace(const Tensor& t, double factor) {
  if (t.numel() == 0) return;
  const InPlace g = in_place(t, "scale target");
  if (t.dtype == DType::f32)
    scale_kernel<<<g.grid, 256, 0, g.stream>>>(static_cast<float*>(t.data), g.pitch, g.rows, g.row_elems, float(factor));
  else if (t.dtype == DType::bf16)
    scale_kernel<<<g.grid, 256, 0, g.stream>>>(static_cast<__nv_bfloat16*>(t.data), g.pitch, g.rows, g.row_elems,
                                               float(factor));
  else
    fail(CW_FORMAT("GPU scale of a {} tensor is not supported", dtype_name(t.dtype)));
  CW_KERNEL_CHECK();
}

}  // namespace cw::gpu

namespace cw::gpu {
double median_ms(const std::function<void()>& fn, int device, int warmup, int repeat) {
  cudaStream_t stream = current_stream(device);
  for (int i = 0; i < warmup; ++i) fn();
  cudaEvent_t start, stop;
  CW_CUDA_CHECK(cudaEventCreate(&start));
  CW_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> ms(static_cast<size_t>(repeat));
  for (int i = 0; i < repeat; ++i) {
    CW_CUDA_CHECK(cudaEventRecord(start, stream));
    fn();
    CW_CUDA_CHECK(cudaEventRecord(stop, stream));
    CW_CUDA_CHECK(cudaEventSynchronize(stop));
    CW_CUDA_CHECK(cudaEventElapsedTime(&ms[static_cast<size_t>(i)], start, stop));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}
}  // namespace cw::gpu

namespace cw::gpu {
namespace {
constexpr int kSumBlocks = 1024, kSumThreads = 256;

// Pass 1: each block sums the squares of a fixed grid-stride share of the elements in f64 and writes
// one partial; the element-to-thread assignment depends only on n, so the result is reproducible.
// f64 inputs are read as they are, the others widened from f32.
template <class T> __global__ void sum_squares_partials(const T* x, int64_t n, double* partials) {
  __shared__ double lane[kSumThreads];
  double s = 0.0;
  for (int64_t i = blockIdx.x * int64_t(kSumThreads) + threadIdx.x; i < n; i += int64_t(kSumBlocks) * kSumThreads) {
    double d;
    if constexpr (std::is_same_v<T, double>)
      d = x[i];
    else
      d = static_cast<double>(to_f32(x[i]));
    s += d * d;
  }
  lane[threadIdx.x] = s;
  __syncthreads();
  for (int w = kSumThreads / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) lane[threadIdx.x] += lane[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = lane[0];
}
// Pass 2: one thread adds the partials in index order.
__global__ void sum_partials(const double* partials, int n, double* out) {
  double s = 0.0;
  for (int i = 0; i < n; ++i) s += partials[i];
  *out = s;
}
}  // namespace

double sum_squares(const Tensor& t) {
  CW_CHECK(!t.device.is_cpu() && t.contiguous(), "gpu::sum_squares needs a contiguous device tensor, got {}",
           t.describe());
  if (t.numel() == 0) return 0.0;
  const int device = t.device.index;
  cudaStream_t stream = current_stream(device);
  double* partials = static_cast<double*>(device_alloc((kSumBlocks + 1) * sizeof(double), device));
  switch (t.dtype) {
    case DType::f32:
      sum_squares_partials<float><<<kSumBlocks, kSumThreads, 0, stream>>>(static_cast<const float*>(t.data), t.numel(), partials);
      break;
    case DType::bf16:
      sum_squares_partials<__nv_bfloat16><<<kSumBlocks, kSumThreads, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(t.data), t.numel(), partials);
      break;
    case DType::f64:
      sum_squares_partials<double><<<kSumBlocks, kSumThreads, 0, stream>>>(static_cast<const double*>(t.data), t.numel(),
                                                                          partials);
      break;
    case DType::i32: device_free(partials, device); fail("gpu::sum_squares of an i32 tensor");
  }
  CW_KERNEL_CHECK();
  sum_partials<<<1, 1, 0, stream>>>(partials, kSumBlocks, partials + kSumBlocks);
  CW_KERNEL_CHECK();
  double result = 0.0;
  CW_CUDA_CHECK(cudaMemcpyAsync(&result, partials + kSumBlocks, sizeof(double), cudaMemcpyDeviceToHost, stream));
  CW_CUDA_CHECK(cudaStreamSynchronize(stream));
  device_free(partials, device);
  return result;
}

MemoryInfo memory_info(int device) {
  int previous = 0;
  CW_CUDA_CHECK(cudaGetDevice(&previous));
  if (previous != device) CW_CUDA_CHECK(cudaSetDevice(device));
  size_t free_b = 0, total_b = 0;
  const cudaError_t e = cudaMemGetInfo(&free_b, &total_b);
  if (previous != device) cudaSetDevice(previous);
  CW_CUDA_CHECK(e);
  return {free_b, total_b};
}
}  // namespace cw::gpu

// Pinned host memory and the side ("copy") streams: two lanes a device, in and out.
namespace cw::gpu {
namespace {
struct PinnedPool {
  std::mutex mutex;
  std::multimap<size_t, void*> free_blocks;  // pinning is slow (page by page): blocks are reused
  std::map<void*, size_t> live;
};
PinnedPool& pinned_pool() {
  static PinnedPool* p = new PinnedPool;  // never destroyed: blocks may be returned during exit
  return *p;
}

constexpr int kLanes = 2;
struct Ticket {
  int device, lane;
  cudaEvent_t done;  // recorded on the lane after the ticket's copies
};
struct SideStreams {
  std::mutex mutex;
  std::array<std::array<cudaStream_t, kLanes>, kMaxDevices> streams{};  // [device][lane]
  std::map<uint64_t, Ticket> tickets;  // the copies not yet waited for by a compute stream
  uint64_t next = 1;
};
SideStreams& side_streams() {
  static SideStreams* s = new SideStreams;
  return *s;
}
// The device's copy lane, created on first use; the caller holds s.mutex.
cudaStream_t side_stream_locked(SideStreams& s, int device, int lane) {
  cudaStream_t& side = s.streams[static_cast<size_t>(device)][static_cast<size_t>(lane)];
  if (!side) CW_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  return side;
}
// Every lane of the device that exists; the caller holds s.mutex.
void synchronize_lanes_locked(SideStreams& s, int device) {
  for (cudaStream_t side : s.streams[static_cast<size_t>(device)])
    if (side) CW_CUDA_CHECK(cudaStreamSynchronize(side));
}
// Makes `side` wait for everything queued on `compute` so far.
void side_after_compute(cudaStream_t side, cudaStream_t compute) {
  cudaEvent_t after_compute;
  CW_CUDA_CHECK(cudaEventCreateWithFlags(&after_compute, cudaEventDisableTiming));
  CW_CUDA_CHECK(cudaEventRecord(after_compute, compute));
  CW_CUDA_CHECK(cudaStreamWaitEvent(side, after_compute, 0));
  CW_CUDA_CHECK(cudaEventDestroy(after_compute));  // released once the wait has been satisfied
}
}  // namespace

namespace {
// A new pinned block of `bytes` at least 2 MiB: an anonymous mapping aligned to and advised for
// transparent huge pages, then page-locked (cudaHostRegister); nullptr where any of it fails. Pinning
// 2 MiB pages is the kernel's work a 512th as often: on the H100 machine 20 GiB took 3.2 s so against
// cudaHostAlloc's 11.0 s (5 GiB: 1.1 s against 3.1), the first step's cost of an offloaded K/V store.
// Blocks are never returned (the pool reuses them), so the mapping's alignment slack stays with it.
constexpr size_t kHugePage = size_t(2) << 20;
void* pin_huge(size_t bytes) {
  if (bytes < kHugePage) return nullptr;
  const size_t len = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* m = mmap(nullptr, len + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  void* aligned = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(m) + kHugePage - 1) / kHugePage * kHugePage);
  madvise(aligned, len, MADV_HUGEPAGE);  // advice: without huge pages to give, the kernel maps 4 KiB ones
  if (cudaHostRegister(aligned, len, cudaHostRegisterPortable) == cudaSuccess) return aligned;
  cudaGetLastError();
  munmap(m, len + kHugePage);
  return nullptr;
}
}  // namespace

void* pinned_alloc(size_t bytes) {
  PinnedPool& p = pinned_pool();
  std::lock_guard lock(p.mutex);
  if (auto it = p.free_blocks.find(bytes); it != p.free_blocks.end()) {
    void* ptr = it->second;
    p.free_blocks.erase(it);
    p.live[ptr] = bytes;
    return ptr;
  }
  if (void* huge = pin_huge(bytes)) {
    p.live[huge] = bytes;
    return huge;
  }
  void* ptr = nullptr;
  const cudaError_t e = cudaHostAlloc(&ptr, std::max<size_t>(bytes, 1), cudaHostAllocPortable);
  if (e != cudaSuccess) {
    cudaGetLastError();
    fail(CW_FORMAT("cannot pin {} MiB of host memory ({})", double(bytes) / (1 << 20), cudaGetErrorString(e)),
         "offload less (a shorter sequence) or turn schedule.offload off");
  }
  p.live[ptr] = bytes;
  return ptr;
}

bool host_register(void* ptr, size_t bytes) {
  if (!ptr || bytes == 0) return false;
  const cudaError_t e = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
  if (e == cudaErrorHostMemoryAlreadyRegistered) {
    cudaGetLastError();
    return false;
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    fail(CW_FORMAT("cannot page-lock {} MiB of host memory ({})", double(bytes) / (1 << 20), cudaGetErrorString(e)),
         "free host memory, or keep the optimizer on the device (optimizer.offload off)");
  }
  return true;
}

void host_unregister(void* ptr) {
  if (ptr) cudaHostUnregister(ptr);  // nothing to report at teardown
}

void pinned_free(void* ptr) {
  if (!ptr) return;
  PinnedPool& p = pinned_pool();
  std::lock_guard lock(p.mutex);
  auto it = p.live.find(ptr);
  if (it == p.live.end()) return;
  p.free_blocks.emplace(it->second, ptr);
  p.live.erase(it);
}

namespace {
// Queues `op` on the device's copy lane after everything already queued on its compute stream (the
// source of a copy is final and the bytes it overwrites are no longer read) and returns its ticket.
template <typename Op>
uint64_t on_side_stream(int device, CopyLane lane, Op op) {
  cudaStream_t compute = current_stream(device);  // also makes `device` current
  SideStreams& s = side_streams();
  std::lock_guard lock(s.mutex);
  cudaStream_t side = side_stream_locked(s, device, static_cast<int>(lane));
  side_after_compute(side, compute);
  op(side);
  cudaEvent_t done;
  CW_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  CW_CUDA_CHECK(cudaEventRecord(done, side));
  const uint64_t ticket = s.next++;
  s.tickets[ticket] = {device, static_cast<int>(lane), done};
  return ticket;
}
}  // namespace

void lane_wait_for_copies(const std::vector<uint64_t>& tickets, CopyLane lane, int device) {
  if (tickets.empty()) return;
  CW_CUDA_CHECK(cudaSetDevice(device));
  SideStreams& s = side_streams();
  std::lock_guard lock(s.mutex);
  cudaStream_t side = side_stream_locked(s, device, static_cast<int>(lane));
  for (uint64_t t : tickets) {
    // A ticket no longer kept was waited for by the compute stream, which every later copy follows.
    auto it = s.tickets.find(t);
    if (it != s.tickets.end() && it->second.lane != static_cast<int>(lane))
      CW_CUDA_CHECK(cudaStreamWaitEvent(side, it->second.done, 0));
  }
}

uint64_t copies_on_side_stream(const std::vector<SideCopy>& copies, int device, CopyLane lane) {
  return on_side_stream(device, lane, [&](cudaStream_t side) {
    for (const SideCopy& c : copies) {
      if (c.bytes == 0 || c.rows == 0) continue;
      if (c.rows == 1 && c.zero) CW_CUDA_CHECK(cudaMemsetAsync(c.dst, 0, c.bytes, side));
      else if (c.rows == 1) CW_CUDA_CHECK(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, side));
      else if (c.zero) CW_CUDA_CHECK(cudaMemset2DAsync(c.dst, c.pitch, 0, c.bytes, c.rows, side));
      else CW_CUDA_CHECK(cudaMemcpy2DAsync(c.dst, c.pitch, c.src, c.pitch, c.bytes, c.rows, cudaMemcpyDefault, side));
    }
  });
}

namespace {
// Timed event pairs around the compute stream's waits for copies (take_copy_wait_seconds). Pairs
// that have completed are folded into `seconds` once many are pending, so memory stays bounded
// when nobody asks.
struct CopyWaits {
  std::mutex mutex;
  std::array<std::vector<std::pair<cudaEvent_t, cudaEvent_t>>, kMaxDevices> pending;
  std::array<double, kMaxDevices> seconds{};
  std::vector<cudaEvent_t> spare;
  cudaEvent_t event() {
    if (spare.empty()) {
      cudaEvent_t e;
      CW_CUDA_CHECK(cudaEventCreate(&e));
      return e;
    }
    cudaEvent_t e = spare.back();
    spare.pop_back();
    return e;
  }
  // Folds the pairs of `device` from the front while they are complete (all of them: `wait` true).
  void fold(int device, bool wait) {
    auto& p = pending[static_cast<size_t>(device)];
    size_t n = 0;
    for (; n < p.size(); ++n) {
      auto [before, after] = p[n];
      if (wait) {
        CW_CUDA_CHECK(cudaEventSynchronize(after));
      } else if (cudaEventQuery(after) != cudaSuccess) {
        cudaGetLastError();  // cudaErrorNotReady is not an error here
        break;
      }
      float ms = 0;
      CW_CUDA_CHECK(cudaEventElapsedTime(&ms, before, after));
      seconds[static_cast<size_t>(device)] += ms / 1e3;
      spare.push_back(before);
      spare.push_back(after);
    }
    p.erase(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(n));
  }
};
CopyWaits& copy_waits() {
  static CopyWaits* w = new CopyWaits;
  return *w;
}
}  // namespace

double take_copy_wait_seconds(int device) {
  CopyWaits& w = copy_waits();
  std::lock_guard lock(w.mutex);
  w.fold(device, true);
  const double s = w.seconds[static_cast<size_t>(device)];
  w.seconds[static_cast<size_t>(device)] = 0;
  return s;
}

void wait_for_copy(uint64_t ticket, int device) {
  cudaStream_t compute = current_stream(device);
  SideStreams& s = side_streams();
  std::lock_guard lock(s.mutex);
  auto it = s.tickets.find(ticket);
  if (it == s.tickets.end()) return;  // already waited for
  {
    CopyWaits& w = copy_waits();
    std::lock_guard wl(w.mutex);
    const cudaEvent_t before = w.event(), after = w.event();
    CW_CUDA_CHECK(cudaEventRecord(before, compute));
    CW_CUDA_CHECK(cudaStreamWaitEvent(compute, it->second.done, 0));
    CW_CUDA_CHECK(cudaEventRecord(after, compute));
    auto& p = w.pending[static_cast<size_t>(device)];
    p.emplace_back(before, after);
    if (p.size() >= 1024) w.fold(device, false);
  }
  // A lane runs its copies in order, so waiting for this one covers every earlier ticket of the
  // device's same lane: their events are released too (safe before they complete).
  const int lane = it->second.lane;
  for (auto e = s.tickets.begin(); e != s.tickets.end() && e->first <= ticket;) {
    if (e->second.device != device || e->second.lane != lane) {
      ++e;
      continue;
    }
    CW_CUDA_CHECK(cudaEventDestroy(e->second.done));
    e = s.tickets.erase(e);
  }
}

void host_wait_for_copy(uint64_t ticket, int device) {
  SideStreams& s = side_streams();
  cudaEvent_t done = nullptr;
  std::array<cudaStream_t, kLanes> lanes{};
  {
    std::lock_guard lock(s.mutex);
    auto it = s.tickets.find(ticket);
    if (it != s.tickets.end()) done = it->second.done;
    else lanes = s.streams[static_cast<size_t>(device)];  // its event is gone (a compute wait took it): wait for all
  }
  // Outside the lock: other threads queue copies meanwhile. A ticket's event is destroyed only by
  // wait_for_copy, which the thread that owns the ticket calls.
  CW_CUDA_CHECK(cudaSetDevice(device));
  if (done) CW_CUDA_CHECK(cudaEventSynchronize(done));
  for (cudaStream_t side : lanes)
    if (side) CW_CUDA_CHECK(cudaStreamSynchronize(side));
}

void wait_for_all_copies(int device) {
  SideStreams& s = side_streams();
  std::lock_guard lock(s.mutex);
  synchronize_lanes_locked(s, device);
}
}  // namespace cw::gpu

// Timing marks of the trace recorder: events with timing, kept until resolved.
namespace cw::gpu {
namespace {
struct TraceMarks {
  std::mutex mutex;
  std::vector<cudaEvent_t> events;
};
TraceMarks& trace_marks() {
  static TraceMarks* m = new TraceMarks;
  return *m;
}
}  // namespace

size_t trace_mark(int device, int lane, bool after_compute) {
  cudaStream_t compute = current_stream(device);  // also makes `device` current
  cudaStream_t stream = compute;
  if (lane >= 0) {
    SideStreams& s = side_streams();
    std::lock_guard lock(s.mutex);
    stream = side_stream_locked(s, device, lane);
    if (after_compute) side_after_compute(stream, compute);
  }
  cudaEvent_t e;
  CW_CUDA_CHECK(cudaEventCreate(&e));  // with timing
  CW_CUDA_CHECK(cudaEventRecord(e, stream));
  TraceMarks& m = trace_marks();
  std::lock_guard lock(m.mutex);
  m.events.push_back(e);
  return m.events.size() - 1;
}

std::vector<double> trace_marks_resolve(int device) {
  synchronize(device);
  wait_for_all_copies(device);
  struct Taken {  // the marks, destroyed however this returns
    std::vector<cudaEvent_t> events;
    ~Taken() {
      for (cudaEvent_t e : events) cudaEventDestroy(e);
    }
  } taken;
  {
    TraceMarks& m = trace_marks();
    std::lock_guard lock(m.mutex);
    taken.events.swap(m.events);
  }
  std::vector<double> ms(taken.events.size(), 0.0);
  for (size_t i = 1; i < taken.events.size(); ++i) {
    float t = 0;
    CW_CUDA_CHECK(cudaEventElapsedTime(&t, taken.events[0], taken.events[i]));
    ms[i] = t;
  }
  return ms;
}

void trace_marks_clear() {
  TraceMarks& m = trace_marks();
  std::lock_guard lock(m.mutex);
  for (cudaEvent_t e : m.events) cudaEventDestroy(e);
  m.events.clear();
}
}  // namespace cw::gpu
