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
// Scale (engine/ops/embedding.h, Gemma's normaliser): 1 is the plain copy below; another value runs
// a grid-stride kernel over the elements, each row element widened to f32, times the scale and
// rounded once (the scale is the caller's, already rounded to the table's dtype). The backward
// adds scale * d_out in f32 (a scale of 1 adds d_out itself: the same bits as without one).
//
// Forward: a gather of whole rows, i.e. a pure copy (N*C*sizeof(T) read, as much written), so the
// only thing that matters is bandwidth. When C*sizeof(T) is a multiple of 16 and both pointers are
// 16-byte aligned, every row starts on a 16-byte boundary and each thread copies 16 bytes at a time
// (8 bf16 / 4 f32: 128-bit loads and stores, four times fewer memory instructions than scalar
// bf16); otherwise the same kernel runs on scalars. A block is (tx, ty) threads: tx along a row's
// vectors (up to 256, so a C = 2048 bf16 row is exactly one vector per thread) and ty rows side by
// side; each thread copies kFwdRows rows of its column, issuing all their loads before any store so
// that several 16-byte loads per thread are in flight (memory-level parallelism to cover DRAM
// latency). Grid: one block per kFwdRows*ty rows (2048 blocks for N = 8192 bf16 rows of C = 2048,
// many per SM on 132 SMs), grid-striding beyond 65536 blocks.
//
// Backward, deterministic without floating-point atomics (d_table[ids[n]] += d_out[n] for all n):
//   1. prep: keys[n] = ids[n] for a valid id, else the sentinel min(V, 2^31) (larger than every
//      valid id, so invalid rows sort to the end); rows[n] = n.
//   2. cub::DeviceRadixSort::SortPairs on (keys, rows), only over the bits a key can use
//      (bit_width(sentinel): 17 bits for V = 128256, so fewer radix passes than 32 bits). CUB's
//      radix sort is stable and rows start ascending, so within each id the rows stay in ascending
//      n: the sorted order, hence every sum below, is a fixed function of ids.
//   3. one block per segment (a run of equal keys) and per column chunk: the block whose position s
//      is a segment start (s == 0 or keys[s-1] != keys[s]) owns that id; each thread owns VEC
//      columns (16-byte vector loads of d_out, like the forward), loads d_table[id, cols] once,
//      adds the segment's d_out rows in ascending n in f32, and stores once. That is exactly the
//      CPU's order (d_table[id] += d_out[n] for n = 0..N-1, in f32), so f32 results are bitwise
//      equal to the CPU's and runs are bitwise reproducible; every (id, column) has exactly one
//      writer, so there are no races and no atomics. Traffic: d_out read once (N*C*sizeof(T)), each
//      distinct id's d_table row read and written once, plus the sort of N 4-byte pairs; the old
//      version did N dependent read-modify-writes of d_table per column (O(N) latency, C-way
//      parallelism: milliseconds). Rows of a segment are read in batches of kBwdBatch (their loads
//      in flight together, the next batch's indices prefetched) and added in order.
//      Segments of the sentinel (invalid ids) are skipped.
//   Temporaries (keys and rows before and after the sort, CUB's temp storage) come from the caching
//   pool in one block and go back to it right after the launches: every user of the pool's blocks
//   runs on the same stream, so a later reuse is ordered after these kernels.
// Nothing synchronises; everything runs on current_stream(device) of the operands' device.
#include "engine/cuda/common.cuh"
#include "engine/cuda/ops.h"
#include "engine/cuda/runtime.h"

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace cw::gpu {

namespace {

constexpr int kThreads = 256;          // forward block size (tx * ty <= kThreads)
constexpr int kFwdRows = 4;            // forward: rows copied per thread (loads in flight per thread)
constexpr int kBwdThreads = 128;       // backward: threads per block along the columns
constexpr int kBwdBatch = 8;           // backward: rows of a segment loaded together
constexpr int64_t kMaxBlocks = 65536;
constexpr int64_t kMaxGridY = 65535;

int sm_count(int device) {
  int n = 0;
  CW_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  return std::max(n, 1);
}

// ---- forward ----

// The NaN a bad id's row is filled with, as one element (Vec = T) or as 16 bytes of them.
template <class T, class Vec> __device__ __forceinline__ Vec nan_value() {
  if constexpr (std::is_same_v<Vec, uint4>) {
    const unsigned w = std::is_same_v<T, float> ? 0x7fc00000u : 0x7fc07fc0u;  // f32 qNaN / 2 bf16 qNaNs
    return make_uint4(w, w, w, w);
  } else {
    return from_f32<T>(__int_as_float(0x7fc00000));
  }
}

// Vec is uint4 (16-byte copies; Cv = C / (16 / sizeof(T)), rows 16-byte aligned) or T (Cv = C).
// Rows of a tile: base + ty + k * blockDim.y for k < kFwdRows.
template <class T, class Vec>
__global__ void __launch_bounds__(kThreads) embedding_forward_kernel(Vec* __restrict__ out, const int32_t* __restrict__ ids,
                                                                     const Vec* __restrict__ table, int64_t N, int64_t Cv,
                                                                     int64_t V) {
  const int64_t tile = static_cast<int64_t>(blockDim.y) * kFwdRows;
  const Vec nan = nan_value<T, Vec>();
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * tile; base < N; base += static_cast<int64_t>(gridDim.x) * tile) {
    int64_t n[kFwdRows], src[kFwdRows];  // src: row offset in table (in Vec), or -1 for a bad id
#pragma unroll
    for (int k = 0; k < kFwdRows; ++k) {
      n[k] = base + threadIdx.y + static_cast<int64_t>(k) * blockDim.y;
      const int64_t id = n[k] < N ? static_cast<int64_t>(ids[n[k]]) : -1;
      src[k] = (id >= 0 && id < V) ? id * Cv : -1;
    }
    for (int64_t cv = threadIdx.x; cv < Cv; cv += blockDim.x) {
      Vec v[kFwdRows];
#pragma unroll
      for (int k = 0; k < kFwdRows; ++k)  // all loads first: kFwdRows in flight per thread
        if (n[k] < N) v[k] = src[k] >= 0 ? table[src[k] + cv] : nan;
#pragma unroll
      for (int k = 0; k < kFwdRows; ++k)
        if (n[k] < N) out[n[k] * Cv + cv] = v[k];
    }
  }
}

// out[n, c] = s * table[ids[n], c], element by element (a bad id's row NaN, as above).
template <class T>
__global__ void __launch_bounds__(kThreads) embedding_scaled_forward_kernel(T* __restrict__ out,
                                                                            const int32_t* __restrict__ ids,
                                                                            const T* __restrict__ table, int64_t N,
                                                                            int64_t C, int64_t V, float s) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < N * C;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = i / C, id = ids[n];
    out[i] = id >= 0 && id < V ? from_f32<T>(to_f32(table[id * C + i % C]) * s) : nan_value<T, T>();
  }
}

template <class T, class Vec>
void launch_forward(T* out, const int32_t* ids, const T* table, int64_t N, int64_t C, int64_t V, cudaStream_t stream) {
  constexpr int64_t kVec = static_cast<int64_t>(sizeof(Vec) / sizeof(T));
  const int64_t Cv = C / kVec;
  const int tx = static_cast<int>(std::min<int64_t>(kThreads, (Cv + 31) / 32 * 32));
  const int ty = kThreads / tx;  // tx is a multiple of 32 in [32, 256]: ty >= 1, tx * ty <= 256
  const int64_t tiles = (N + static_cast<int64_t>(ty) * kFwdRows - 1) / (static_cast<int64_t>(ty) * kFwdRows);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(tiles, kMaxBlocks));
  embedding_forward_kernel<T, Vec><<<grid, dim3(static_cast<unsigned>(tx), static_cast<unsigned>(ty)), 0, stream>>>(
      reinterpret_cast<Vec*>(out), ids, reinterpret_cast<const Vec*>(table), N, Cv, V);
  CW_KERNEL_CHECK();
}

// ---- backward ----

// keys[n] = ids[n] if it is a valid id, else `sentinel` (> every valid id); rows[n] = n.
__global__ void embedding_sort_prep_kernel(uint32_t* __restrict__ keys, int32_t* __restrict__ rows,
                                           const int32_t* __restrict__ ids, int32_t N, int64_t V, uint32_t sentinel) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < N;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t id = ids[i];
    keys[i] = (id >= 0 && static_cast<int64_t>(id) < V) ? static_cast<uint32_t>(id) : sentinel;
    rows[i] = static_cast<int32_t>(i);
  }
}

// VEC consecutive elements of T as one load: uint4 when VEC > 1 (16 bytes), else T itself.
template <class T, int VEC> using RawVec = std::conditional_t<VEC == 1, T, uint4>;

// acc[0..VEC) += s times the VEC values in r, widened to f32 exactly (bf16 -> f32 is a 16-bit
// shift); s = 1 multiplies exactly.
template <class T, int VEC>
__device__ __forceinline__ void add_raw(float (&acc)[VEC], const RawVec<T, VEC>& r, float s) {
  if constexpr (VEC == 1) {
    acc[0] += s * to_f32(r);
  } else if constexpr (std::is_same_v<T, float>) {
    static_assert(VEC == 4);
    acc[0] += s * __uint_as_float(r.x);
    acc[1] += s * __uint_as_float(r.y);
    acc[2] += s * __uint_as_float(r.z);
    acc[3] += s * __uint_as_float(r.w);
  } else {
    static_assert(std::is_same_v<T, __nv_bfloat16> && VEC == 8);
    const unsigned w[4] = {r.x, r.y, r.z, r.w};  // little endian: element 2i is the low half of word i
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc[2 * i] += s * __uint_as_float(w[i] << 16);
      acc[2 * i + 1] += s * __uint_as_float(w[i] & 0xffff0000u);
    }
  }
}

// d_table f32 row segment of VEC floats (16-byte aligned when VEC > 1: VEC divides C and d_table is
// 16-byte aligned, so (id * C + cv * VEC) * 4 is a multiple of 16).
template <int VEC> __device__ __forceinline__ void load_f32(float (&acc)[VEC], const float* p) {
  if constexpr (VEC == 1) {
    acc[0] = *p;
  } else {
#pragma unroll
    for (int i = 0; i < VEC / 4; ++i) {
      const float4 q = reinterpret_cast<const float4*>(p)[i];
      acc[4 * i] = q.x, acc[4 * i + 1] = q.y, acc[4 * i + 2] = q.z, acc[4 * i + 3] = q.w;
    }
  }
}
template <int VEC> __device__ __forceinline__ void store_f32(float* p, const float (&acc)[VEC]) {
  if constexpr (VEC == 1) {
    *p = acc[0];
  } else {
#pragma unroll
    for (int i = 0; i < VEC / 4; ++i)
      reinterpret_cast<float4*>(p)[i] = make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]);
  }
}

// keys/rows: the sorted pairs (keys nondecreasing; equal keys in ascending row). Block x walks
// positions s = blockIdx.x, + gridDim.x, ...; at a segment start it sums that segment into
// d_table[key] for its columns (block y: column vectors blockIdx.y * blockDim.x + tid, + gridDim.y *
// blockDim.x, ...). Cv = C / VEC.
template <class T, int VEC>
__global__ void __launch_bounds__(kBwdThreads) embedding_backward_kernel(float* __restrict__ d_table, const T* __restrict__ d_out,
                                                                         const uint32_t* __restrict__ keys,
                                                                         const int32_t* __restrict__ rows, int64_t N,
                                                                         int64_t C, uint32_t sentinel, float scale) {
  using Raw = RawVec<T, VEC>;
  const int64_t Cv = C / VEC;
  for (int64_t s = blockIdx.x; s < N; s += gridDim.x) {
    const uint32_t key = keys[s];
    // Keys are sorted and s only grows, so once this block sees the sentinel (invalid ids, sorted
    // last) every later position it owns is invalid too.
    if (key >= sentinel) break;
    if (s > 0 && keys[s - 1] == key) continue;  // not a segment start: another block owns it
    for (int64_t cv = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; cv < Cv;
         cv += static_cast<int64_t>(gridDim.y) * blockDim.x) {
      float* dst = d_table + static_cast<int64_t>(key) * C + cv * VEC;
      float acc[VEC];
      load_f32<VEC>(acc, dst);
      // Batch b covers positions s + b*kBwdBatch + u; ok[u] says the position is in this segment
      // (in range and the same key). Keys are sorted, so ok is true for a prefix of the batch and
      // the segment continues past the batch only if ok[kBwdBatch - 1].
      int64_t j = s;
      bool ok[kBwdBatch];
      int32_t r[kBwdBatch];
#pragma unroll
      for (int u = 0; u < kBwdBatch; ++u) {
        ok[u] = j + u < N && keys[j + u] == key;
        r[u] = ok[u] ? rows[j + u] : 0;
      }
      while (true) {
        Raw v[kBwdBatch];
#pragma unroll
        for (int u = 0; u < kBwdBatch; ++u)  // all of the batch's row loads in flight together
          if (ok[u]) v[u] = reinterpret_cast<const Raw*>(d_out + static_cast<int64_t>(r[u]) * C)[cv];
        const bool more = ok[kBwdBatch - 1];
        bool next_ok[kBwdBatch];
        int32_t next_r[kBwdBatch];
#pragma unroll
        for (int u = 0; u < kBwdBatch; ++u) {  // prefetch the next batch's indices meanwhile
          const int64_t p = j + kBwdBatch + u;
          next_ok[u] = more && p < N && keys[p] == key;
          next_r[u] = next_ok[u] ? rows[p] : 0;
        }
#pragma unroll
        for (int u = 0; u < kBwdBatch; ++u)  // in ascending n: the CPU's order
          if (ok[u]) add_raw<T, VEC>(acc, v[u], scale);
        if (!more) break;
        j += kBwdBatch;
#pragma unroll
        for (int u = 0; u < kBwdBatch; ++u) ok[u] = next_ok[u], r[u] = next_r[u];
      }
      store_f32<VEC>(dst, acc);
    }
  }
}

template <class T, int VEC>
void launch_backward(float* d_table, const T* d_out, const uint32_t* keys, const int32_t* rows, int64_t N, int64_t C,
                     uint32_t sentinel, float s, int sms, cudaStream_t stream) {
  const int64_t Cv = C / VEC;
  const int64_t gy = std::min<int64_t>((Cv + kBwdThreads - 1) / kBwdThreads, kMaxGridY);
  // About 16 blocks of kBwdThreads per SM in all (positions are grid-strided, so any count is correct).
  const int64_t gx = std::min<int64_t>(N, std::max<int64_t>(1, (static_cast<int64_t>(sms) * 16 + gy - 1) / gy));
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(gx, kMaxBlocks)), static_cast<unsigned>(gy));
  embedding_backward_kernel<T, VEC><<<grid, kBwdThreads, 0, stream>>>(d_table, d_out, keys, rows, N, C, sentinel, s);
  CW_KERNEL_CHECK();
}

// One pool block for the backward's temporaries, returned to the pool when the scope ends (also on
// an exception): the kernels that use it are already enqueued on the one stream every pool user
// shares, so a later reuse of the block is ordered after them.
class PoolBlock {
 public:
  PoolBlock(size_t bytes, int device) : p_(device_alloc(bytes, device)), device_(device) {}
  ~PoolBlock() { device_free(p_, device_); }
  PoolBlock(const PoolBlock&) = delete;
  PoolBlock& operator=(const PoolBlock&) = delete;
  char* get() const { return static_cast<char*>(p_); }

 private:
  void* p_;
  int device_;
};

constexpr size_t align256(size_t x) { return (x + 255) / 256 * 256; }

}  // namespace

// The op's contract (shapes, dtypes, layout, device) is checked by the public entry
// (engine/ops/embedding.cpp); what is checked here is this backend's own: f32 or bf16, the sort's
// i32 row count.
void embedding_forward(const Tensor& out, const Tensor& ids, const Tensor& table, double scale) {
  const int64_t N = ids.numel(), C = table.size(1), V = table.size(0);
  const int64_t total = N * C;
  if (total == 0) return;
  cudaStream_t stream = current_stream(ids.device.index);
  dispatch_compute(table.dtype, "embedding_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int64_t kVec = 16 / static_cast<int64_t>(sizeof(T));
    T* o = dptr<T>(out);
    const T* t = dptr<const T>(table);
    const int32_t* id = dptr<const int32_t>(ids);
    if (scale != 1.0) {
      const unsigned grid = static_cast<unsigned>(std::min<int64_t>(blocks_for(total, kThreads), kMaxBlocks));
      embedding_scaled_forward_kernel<T><<<grid, kThreads, 0, stream>>>(o, id, t, N, C, V, static_cast<float>(scale));
      CW_KERNEL_CHECK();
      return;
    }
    // 16-byte copies need every row to start 16-byte aligned in both tensors.
    if (C % kVec == 0 && aligned16(o) && aligned16(t))
      launch_forward<T, uint4>(o, id, t, N, C, V, stream);
    else
      launch_forward<T, T>(o, id, t, N, C, V, stream);
  });
}

void embedding_backward(const Tensor& d_table, const Tensor& d_out, const Tensor& ids, double scale) {
  const int64_t N = ids.numel(), C = d_table.size(1), V = d_table.size(0);
  CW_CHECK(d_out.dtype == DType::f32 || d_out.dtype == DType::bf16,
           "embedding_backward on the GPU supports f32 and bf16, not {}", dtype_name(d_out.dtype));
  if (N == 0 || C == 0 || V == 0) return;  // V == 0: every id is invalid, nothing to add
  // Row indices are sorted as i32 and CUB counts items in int.
  CW_CHECK(N <= std::numeric_limits<int32_t>::max(), "embedding backward supports at most 2^31 - 1 ids, got {}", N);
  const int device = ids.device.index;
  cudaStream_t stream = current_stream(device);  // also makes `device` current (CUB launches there)

  // Key of an invalid id: larger than every valid id (ids are i32, so valid ones are < 2^31 too).
  const uint32_t sentinel = static_cast<uint32_t>(std::min<int64_t>(V, int64_t{1} << 31));
  const int end_bit = std::max(1, static_cast<int>(std::bit_width(sentinel)));  // keys in [0, sentinel]
  const int n_items = static_cast<int>(N);

  // Temporaries in one pool block: keys in/out, rows in/out (N * 4 bytes each), then CUB's storage.
  size_t cub_bytes = 0;
  CW_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, cub_bytes, static_cast<const uint32_t*>(nullptr),
                                                static_cast<uint32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                                static_cast<int32_t*>(nullptr), n_items, 0, end_bit, stream));
  const size_t arr = align256(static_cast<size_t>(N) * sizeof(uint32_t));  // N < 2^31: at most 8 GiB
  PoolBlock tmp(4 * arr + align256(cub_bytes), device);
  uint32_t* keys_in = reinterpret_cast<uint32_t*>(tmp.get());
  uint32_t* keys_out = reinterpret_cast<uint32_t*>(tmp.get() + arr);
  int32_t* rows_in = reinterpret_cast<int32_t*>(tmp.get() + 2 * arr);
  int32_t* rows_out = reinterpret_cast<int32_t*>(tmp.get() + 3 * arr);
  void* cub_tmp = tmp.get() + 4 * arr;

  embedding_sort_prep_kernel<<<static_cast<unsigned>(std::min<int64_t>(blocks_for(N, kThreads), kMaxBlocks)), kThreads, 0,
                               stream>>>(keys_in, rows_in, dptr<const int32_t>(ids), n_items, V, sentinel);
  CW_KERNEL_CHECK();
  CW_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(cub_tmp, cub_bytes, static_cast<const uint32_t*>(keys_in), keys_out,
                                                static_cast<const int32_t*>(rows_in), rows_out, n_items, 0, end_bit,
                                                stream));

  const int sms = sm_count(device);
  dispatch_compute(d_out.dtype, "embedding_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = 16 / static_cast<int>(sizeof(T));
    float* dt = dptr<float>(d_table);
    const T* dy = dptr<const T>(d_out);
    // Vector path: C a multiple of kVec (so every row of d_out and of d_table starts on a 16-byte
    // boundary given aligned base pointers) and both base pointers 16-byte aligned.
    if (C % kVec == 0 && aligned16(dt) && aligned16(dy))
      launch_backward<T, kVec>(dt, dy, keys_out, rows_out, N, C, sentinel, static_cast<float>(scale), sms, stream);
    else
      launch_backward<T, 1>(dt, dy, keys_out, rows_out, N, C, sentinel, static_cast<float>(scale), sms, stream);
  });
}

}  // namespace cw::gpu
