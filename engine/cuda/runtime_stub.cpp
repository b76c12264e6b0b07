// A build without CUDA: the runtime says so, clearly, whenever a GPU tensor is asked for.
#include "engine/cuda/runtime.h"
#include "engine/engine.h"

#include "engine/error.h"

namespace cw::gpu {

namespace {
[[noreturn]] void no_cuda() {
  fail("this build of chunkwise has no CUDA backend", "install the CUDA toolkit (nvcc, cuBLAS) and rebuild, or use the CPU");
}
}  // namespace

bool available() { return false; }
int device_count() { return 0; }
void* device_alloc(size_t, int) { no_cuda(); }
void device_free(void*, int) {}
void device_memset_zero(void*, size_t, int) { no_cuda(); }
PoolStats pool_stats(int) { return {}; }
void release_cached(int) {}
void copy_convert(const Tensor&, const Tensor&) { no_cuda(); }
void fill(const Tensor&, double) { no_cuda(); }
void scale_inplace(const Tensor&, double) { no_cuda(); }
double sum_squares(const Tensor&) { no_cuda(); }
MemoryInfo memory_info(int) { no_cuda(); }
void* pinned_alloc(size_t) { no_cuda(); }
void pinned_free(void*) {}
bool host_register(void*, size_t) { no_cuda(); }
void host_unregister(void*) {}
uint64_t copies_on_side_stream(const std::vector<SideCopy>&, int, CopyLane) { no_cuda(); }
void lane_wait_for_copies(const std::vector<uint64_t>&, CopyLane, int) { no_cuda(); }
void wait_for_copy(uint64_t, int) { no_cuda(); }
void host_wait_for_copy(uint64_t, int) { no_cuda(); }
void set_pool_limit(int, size_t) { no_cuda(); }
size_t pool_limit(int) { return 0; }
void wait_for_all_copies(int) {}
double take_copy_wait_seconds(int) { return 0.0; }
size_t trace_mark(int, int, bool) { no_cuda(); }
std::vector<double> trace_marks_resolve(int) { no_cuda(); }
void trace_marks_clear() {}
void synchronize(int) {}
void* compute_stream_handle(int) { no_cuda(); }
std::string memory_report(int) { return "no CUDA in this build"; }
void profiler_range(bool) {}
GemmTuneStats gemm_tune_stats() { return {}; }

}  // namespace cw::gpu

namespace cw::gpu {
double median_ms(const std::function<void()>&, int, int, int) { no_cuda(); }
}  // namespace cw::gpu
