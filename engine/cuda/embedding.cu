// GPU embedding lookup and its backward (the math of engine/ops/embedding.h).
//
// Dtypes: ids [N] i32 on the device; table, out, d_out in the compute dtype T (f32 or bf16);
// d_table [V, C] f32, accumulated.
//
// Ids: a kernel cannot throw, so ids on the device must be validated before they are uploaded (the
// caller checks them on the host; the CPU entry point does the same for host ids). As a guard that
// costs nothing, an id outside [0, V) never touches memory out of bounds: the forward writes NaN
// into that row of out (so a bad id shows up as a NaN loss rather than as silent garbage) and the
// backward skips that row.
//
// Launch shapes:
//   forward: one thread per output element, 256 threads per block, grid-stride over N*C (coalesced
//     along C). A faster version would copy whole rows with 16-byte vector loads.
//   backward: one thread per column c (grid over C, 256 per block); each thread walks n = 0..N-1 in
//     order doing d_table[ids[n], c] += d_out[n, c]. Warps read and write consecutive columns, so
//     the accesses are coalesced; the cost is N dependent read-modify-writes per thread (each one a
//     global load and store), i.e. O(N) latency with only C-way parallelism: for N = 16k tokens and
//     C = 2048 this is on the order of milliseconds. The reason is determinism without atomics:
//     repeated ids are summed in row order, exactly as the CPU does, so the result is bitwise
//     reproducible (and for f32 matches the CPU's f32 order). A faster deterministic version would
//     sort the (id, n) pairs once and give each distinct id's rows to its own block.
// Nothing synchronises; everything runs on current_stream(device) of the operands' device.
#include "engine/cuda/common.cuh"
#include "engine/cuda/ops.h"

#include <algorithm>
#include <type_traits>

namespace cw::gpu {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;

template <class F> void dispatch_compute(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::f32: f(std::type_identity<float>{}); return;
    case DType::bf16: f(std::type_identity<__nv_bfloat16>{}); return;
    default:
      fail(CW_FORMAT("{} on the GPU supports f32 and bf16, not {}", op, dtype_name(dtype)),
           "choose --dtype bf16 or f32 for GPU runs");
  }
}

void check_gpu(const Tensor& t, const Tensor& ref, const char* what) {
  CW_CHECK(!t.device.is_cpu(), "{} is on {}; the GPU op needs it on a GPU", what, device_name(t.device));
  check_same_device(t, ref, what, "embedding ids");
  check_contiguous(t, what);
}

template <class T> T* dptr(const Tensor& t) { return static_cast<T*>(t.data); }

template <class T>
__global__ void embedding_forward_kernel(T* out, const int32_t* ids, const T* table, int64_t N, int64_t C,
                                         int64_t V) {
  const int64_t total = N * C;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = i / C, c = i - n * C;
    const int64_t id = ids[n];
    out[i] = (id >= 0 && id < V) ? table[id * C + c] : from_f32<T>(__int_as_float(0x7fc00000));  // NaN: bad id
  }
}

template <class T>
__global__ void embedding_backward_kernel(float* d_table, const T* d_out, const int32_t* ids, int64_t N, int64_t C,
                                          int64_t V) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t id = ids[n];
    if (id < 0 || id >= V) continue;  // invalid id (see the header): never write out of bounds
    d_table[id * C + c] += to_f32(d_out[n * C + c]);
  }
}

}  // namespace

void embedding_forward(const Tensor& out, const Tensor& ids, const Tensor& table) {
  CW_CHECK(ids.ndim == 1, "embedding ids must be [N], got {}", ids.describe());
  CW_CHECK(table.ndim == 2, "embedding table must be [V, C], got {}", table.describe());
  const int64_t N = ids.numel(), C = table.size(1), V = table.size(0);
  check_dtype(ids, DType::i32, "embedding ids");
  check_shape(out, {N, C}, "embedding out");
  check_dtype(out, table.dtype, "embedding out");
  check_gpu(ids, ids, "embedding ids (on the device, validated on the host before upload)");
  check_gpu(table, ids, "embedding table");
  check_gpu(out, ids, "embedding out");
  const int64_t total = N * C;
  if (total == 0) return;
  cudaStream_t stream = current_stream(ids.device.index);
  dispatch_compute(table.dtype, "embedding_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(blocks_for(total, kThreads), kMaxBlocks));
    embedding_forward_kernel<T><<<grid, kThreads, 0, stream>>>(dptr<T>(out), dptr<const int32_t>(ids),
                                                               dptr<const T>(table), N, C, V);
    CW_KERNEL_CHECK();
  });
}

void embedding_backward(const Tensor& d_table, const Tensor& d_out, const Tensor& ids) {
  CW_CHECK(ids.ndim == 1, "embedding ids must be [N], got {}", ids.describe());
  CW_CHECK(d_table.ndim == 2, "embedding d_table must be [V, C], got {}", d_table.describe());
  const int64_t N = ids.numel(), C = d_table.size(1), V = d_table.size(0);
  check_dtype(ids, DType::i32, "embedding ids");
  check_dtype(d_table, DType::f32, "embedding d_table (f32 on the GPU)");
  check_shape(d_out, {N, C}, "embedding d_out");
  check_gpu(ids, ids, "embedding ids (on the device, validated on the host before upload)");
  check_gpu(d_table, ids, "embedding d_table");
  check_gpu(d_out, ids, "embedding d_out");
  if (N == 0 || C == 0) return;
  cudaStream_t stream = current_stream(ids.device.index);
  dispatch_compute(d_out.dtype, "embedding_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    embedding_backward_kernel<T><<<blocks_for(C, kThreads), kThreads, 0, stream>>>(
        dptr<float>(d_table), dptr<const T>(d_out), dptr<const int32_t>(ids), N, C, V);
    CW_KERNEL_CHECK();
  });
}

}  // namespace cw::gpu
