// chunkwise engine: the CUDA runtime as the rest of the engine sees it (no CUDA headers here).
//
// Memory: device allocations come from one caching pool per device (freed blocks are kept by size
// class and reused, so steady-state steps never call cudaMalloc); Buffer, OwnedTensor and Arena
// (engine/memory.h) take a Device and allocate through it. Streams: every op launches on the
// current stream of its device (one per device, created on first use; ops never synchronise).
// Errors: every CUDA, cuBLAS and kernel-launch failure becomes a cw::Error naming the call, the
// library's message and file:line (engine/cuda/common.cuh has the check macros).
// In a build without CUDA every function here throws a clear error (gpu::available() is false).
#pragma once

#include "engine/error.h"
#include "engine/tensor.h"

#include <cstddef>
#include <string>
#include <vector>

namespace cw {
struct GemmTuneStats;  // engine.h
}  // namespace cw

namespace cw::gpu {

bool available();        // this build has CUDA and the runtime sees at least one GPU
int device_count();

void* device_alloc(size_t bytes, int device);   // from the caching pool; never nullptr
void device_free(void* p, int device);          // back to the pool
void device_memset_zero(void* p, size_t bytes, int device);

struct PoolStats {
  size_t in_use = 0, cached = 0, peak_in_use = 0, cuda_mallocs = 0;
};
PoolStats pool_stats(int device);
// The most bytes the pool may hold from the driver (in use + cached); 0: no limit (engine.h).
void set_pool_limit(int device, size_t bytes);
size_t pool_limit(int device);
void release_cached(int device);                // give cached blocks back to the driver

// Copies between any two tensors of the same shape where at least one is on a GPU, converting
// dtype (f32 <-> bf16 <-> f64) as needed. Supports contiguous tensors and tensors whose only gap is
// the batch stride (dimension 0), as K/V store slices have. Ordered on the current stream;
// copies that read or write host memory synchronise before returning (host data is then valid).
void copy_convert(const Tensor& dst, const Tensor& src);
void fill(const Tensor& t, double value);        // device tensor, any float dtype or i32
void scale_inplace(const Tensor& t, double factor);

// The sum of squares of every element (f32, bf16 or f64; contiguous), accumulated in f64 in a fixed
// order (the same bits on every call); NaN or inf in the input shows in the result. Waits for it.
double sum_squares(const Tensor& t);

struct MemoryInfo {
  size_t free = 0, total = 0;  // bytes, as the driver reports them (cudaMemGetInfo)
};
MemoryInfo memory_info(int device = 0);

// Pinned (page-locked) host memory, which asynchronous copies need; blocks are cached and reused.
void* pinned_alloc(size_t bytes);
void pinned_free(void* p);
// Page-locks existing host memory (cudaHostRegister) so copies to and from it are asynchronous, and
// releases it; a clear error when the system cannot lock that much. Returns false (and locks nothing)
// where a page of the range is locked already (small allocations sharing a page): copies still work.
bool host_register(void* p, size_t bytes);
void host_unregister(void* p);

// Copies beside the compute: each device has two side streams ("lanes"), one for copies into device
// memory and one for copies out of it, so a store (device -> host) and a fetch (host -> device) use
// both directions of the bus at once. Each lane runs its copies in order.
enum class CopyLane : int { in = 0, out = 1 };

// Copies and zeroings between any two of host (pinned) and device memory as one batch on one of the
// device's lanes, ordered after everything queued on its compute stream so far, so they overlap the
// compute queued next (one ticket, one pair of events for the batch): `rows` rows of `bytes` bytes
// each, row r at dst + r pitch and src + r pitch (rows = 1: one run; zero: dst's rows set to zero, src
// unused: a K/V home that holds logical zeros is not copied). wait_for_copy(ticket) makes the compute
// stream wait for the batch (the host does not block). The K/V window's spans and the offloaded
// optimizer's pieces (engine.h copy_async) go in and out this way.
struct SideCopy {
  void* dst;
  const void* src;
  size_t bytes, rows = 1, pitch = 0;
  bool zero = false;
};
uint64_t copies_on_side_stream(const std::vector<SideCopy>& copies, int device, CopyLane lane = CopyLane::in);
// `lane`'s next copies also wait for these tickets' copies (on either lane): a copy into bytes that a
// copy out of them may still be reading, or the reverse. A ticket already waited for is passed over.
void lane_wait_for_copies(const std::vector<uint64_t>& tickets, CopyLane lane, int device);
void wait_for_copy(uint64_t ticket, int device);
// The host blocks until the ticket's copy (and every earlier one of its lane) has finished.
void host_wait_for_copy(uint64_t ticket, int device);
void wait_for_all_copies(int device);           // the host waits until every copy of both lanes is done
// The time the device's compute stream spent blocked in wait_for_copy, measured with timed events
// recorded around each wait. Waits for the compute stream, returns the seconds since the previous
// call and starts counting again.
double take_copy_wait_seconds(int device);

// Timing marks for the trace recorder (engine/trace.h): a CUDA event with timing recorded on the
// device's compute stream (lane < 0), or on a copy lane (0: in, 1: out; after_compute: the lane first
// waits for everything queued on the compute stream so far, as each copy does, so the mark is the
// copy's start). Returns the mark's index (0, 1, ...). trace_marks_resolve waits for the compute
// stream and both lanes, returns every mark's time in milliseconds after mark 0 (which must be on
// `device`) and forgets the marks.
size_t trace_mark(int device, int lane, bool after_compute);
std::vector<double> trace_marks_resolve(int device);
void trace_marks_clear();

void synchronize(int device = 0);               // waits for the device's stream
void* compute_stream_handle(int device);        // current_stream(device) as an opaque pointer
std::string memory_report(int device = 0);      // one line: in use, cached, peak, mallocs
void profiler_range(bool open);                 // cudaProfilerStart / cudaProfilerStop
GemmTuneStats gemm_tune_stats();                // engine.h (engine/cuda/linear.cu)

}  // namespace cw::gpu

#include <functional>

namespace cw::gpu {
// Median milliseconds of `fn` over `repeat` timed runs after `warmup` untimed ones, measured with
// CUDA events on the device's stream (for benchmarks, never for tests).
double median_ms(const std::function<void()>& fn, int device = 0, int warmup = 3, int repeat = 20);
}  // namespace cw::gpu
