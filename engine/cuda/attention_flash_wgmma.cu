// Flash attention, wgmma family (flash_wgmma): the tensor-core kernels on Hopper's warpgroup MMA
// (sm_90a), with the operands, results and algorithm of the mma.sync family (attention_flash_mma.cu);
// only the matrix products change.
//   Operands: bf16, head dim 64 or 128, 16-byte aligned rows; d_k/d_v f32, 8-byte aligned.
//   Forward: a CTA of two warpgroups owns 128 queries of one head (64 each); key blocks of 128 in
//     two cp.async stages; S = Q K^T from shared memory, online softmax in registers, O += P V
//     with P from registers.
//   Backward, dQ fused (a.dq_accum set: determinism off): a CTA of two warpgroups owns 128 keys of
//     one K/V head and loops over every (head of the group, block of 64 queries) that sees them;
//     per step S^T, dP^T, P^T, dS^T, dV += P^T dO, dK += dS^T Q, and dS^T to shared memory; after a
//     barrier dQ += dS K, warpgroup w taking head-dim columns [w D / 2, (w + 1) D / 2), each warp
//     adding its staged dQ rows into the f32 accumulator with 16-byte atomics (d_q varies in its
//     last bits run to run). dK, dV stay in registers and are added once, one writer per element.
//   Backward, deterministic (no a.dq_accum): the same dK/dV kernel without dQ, then a dQ kernel
//     shaped like the forward that recomputes S and dP and sums dQ in key order: bitwise repeatable.
//   Chosen by the chooser first among our families for bf16 at D 64/128 on a compute capability 9.0
//   GPU in an sm_90a build (CW_ATTENTION=flash-wgmma forces it). Elsewhere the kernel bodies trap
//   and wgmma_built() says false.
// Why a second tensor-core family: mma.sync feeds every product from registers loaded by ldmatrix,
// so each warp re-reads its shared-memory operands and shared-memory bandwidth bounds the backward;
// wgmma multiplies 64 x N x 16 per warpgroup straight from shared memory, reading each operand once.
//
// wgmma in brief (PTX ISA, "asynchronous warpgroup level matrix instructions"):
//  * D[64 x N] (+)= A[64 x 16] B[16 x N]; warp w of the warpgroup owns rows 16w .. 16w + 15 of D in
//    the accumulator layout of mma.m16n8k16 (so the softmax code of the mma.sync kernels applies
//    unchanged), and A may come from registers in the matching A-fragment layout.
//  * Shared-memory operands are named by a 64-bit descriptor: start address, the byte distance
//    between 8-row groups (SBO) and between 64-element column blocks (LBO), and the swizzle mode.
//    All tiles here use the 128-byte swizzle: a ROWS x D tile is D / 64 column blocks of ROWS rows
//    x 128 bytes, and 16-byte chunk c of row r is stored at chunk c ^ (r & 7) (the repeat is 1024
//    bytes, so every tile starts on a 1024-byte boundary).
//  * The same tile serves as a "K-major" operand (S = Q K^T reads Q and K this way) and, with the
//    transpose bit, as an "MN-major" operand (O += P V reads V this way, dQ += dS K reads K).
//  * The instructions are asynchronous: wgmma.fence before (registers written by ordinary
//    instructions), commit_group after, wait_group before the results are read. Shared memory
//    written by ordinary stores or cp.async is made visible to them by fence.proxy.async.
#include "engine/cuda/attention_flash.cuh"

namespace cw::gpu::flash {
namespace {

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CW_WGMMA_BODY 0  // device pass for a GPU without wgmma: the kernels trap (never launched)
// The helpers below serve only the kernel bodies this pass leaves out: no warning that they are unused.
#pragma nv_diag_suppress 177
#else
#define CW_WGMMA_BODY 1
#endif

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Ordinary and cp.async writes to shared memory -> visible to wgmma (the async proxy).
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// After a wait: the accumulators are read only from here on (the compiler may not hoist their
// uses above the wait, which it cannot see as a definition of them).
template <int N> __device__ __forceinline__ void settle(float (&d)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

// D[64 x 32] (+)= A[64 x 16] B[16 x 32], A and B from shared memory (descriptors).
template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_ss(float (&d)[4][4], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "%16, %17, p, 1, 1, %19, %20;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B));
}

// D[64 x 64] (+)= A[64 x 16] B[16 x 64], A and B from shared memory (descriptors).
template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_ss(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, %35, %36;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B));
}

// D[64 x 128] (+)= A[64 x 16] B[16 x 128], A and B from shared memory (descriptors).
template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_ss(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, %67, %68;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
        "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
        "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
        "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
        "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
        "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B));
}

// D[64 x 64] (+)= A[64 x 16] B[16 x 64], A from registers (each warp's 16 rows in the A fragment
// layout of mma.m16n8k16), B from shared memory.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(TRANS_B));
}

// Element offset of (row, col) in a 128-byte-swizzled ROWS x D tile (col a multiple of 8: the
// start of a 16-byte chunk).
template <int ROWS> __device__ __forceinline__ int sw128(int row, int col) {
  return (col >> 6) * ROWS * 64 + row * 64 + ((((col >> 3) & 7) ^ (row & 7)) << 3);
}
// Descriptor of a 128-byte-swizzled operand at shared address `addr` (SBO 1024: 8 rows of 128
// bytes; `lbo` the distance between column blocks, used by MN-major operands wider than 64).
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr, uint32_t lbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}
// K-major operand: rows [row0, row0 + 64 or N) of a ROWS-row tile, contraction columns
// [16 ks, 16 ks + 16) (column block ks / 4, 32 bytes per step inside it).
template <int ROWS> __device__ __forceinline__ uint64_t desc_k_major(const bf16_t* tile, int row0, int ks) {
  return desc_sw128(smem_addr(tile + (ks >> 2) * ROWS * 64 + row0 * 64 + (ks & 3) * 16), 16);
}
// MN-major operand: contraction rows [k0, k0 + 16) of a ROWS-row tile, columns from `col` (a
// multiple of 64, or of 32 for an operand 32 wide: it then starts 64 bytes into the swizzled rows).
template <int ROWS> __device__ __forceinline__ uint64_t desc_mn_major(const bf16_t* tile, int k0, int col) {
  return desc_sw128(smem_addr(tile + (col >> 6) * ROWS * 64 + k0 * 64 + (col & 63)), ROWS * 128);
}

// ROWS x D rows of a bf16 operand (row stride `ld`) into a 128-byte-swizzled tile; rows at or past
// `valid` are zero-filled (`base`, a valid address, stands in for them).
template <int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile_sw128(bf16_t* tile, const bf16_t* src, int64_t ld, int valid,
                                                const bf16_t* base) {
  constexpr int kChunks = D / 8;
  static_assert(ROWS * kChunks % THREADS == 0, "the tile must split evenly over the threads");
#pragma unroll
  for (int n = 0; n < ROWS * kChunks / THREADS; ++n) {
    const int idx = threadIdx.x + n * THREADS, r = idx / kChunks, ch = idx % kChunks;
    const bool ok = r < valid;
    cp_async16(smem_addr(tile + sw128<ROWS>(r, ch * 8)), ok ? src + r * ld + ch * 8 : base, ok);
  }
}

// The dynamic shared memory rounded up to the swizzle's 1024-byte repeat (the launch adds 1024).
__device__ __forceinline__ bf16_t* aligned_smem(unsigned char* raw) {
  const uint32_t a = smem_addr(raw);
  return reinterpret_cast<bf16_t*>(raw + ((1024 - (a & 1023)) & 1023));
}

// bf16 A fragments of every k-step of the next product from f32 accumulators.
template <int NT> __device__ __forceinline__ void pack_a_frags(uint32_t (&f)[NT / 2][4], const float (&x)[NT][4]) {
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) a_frag_from_acc(f[kk], x, kk);
}

// ------------------------------------------------------------------------------------------------
// Forward. CTA: 2 warpgroups, 128 queries of one (b, h); key blocks of BC in two stages.
// ------------------------------------------------------------------------------------------------
template <int D, int BC> struct WgForward {
  static constexpr int kThreads = 256, kRows = 128;
  static constexpr int kSmem = (kRows + 4 * BC) * D * static_cast<int>(sizeof(bf16_t)) + 1024;
};

template <int D, int BC>
__global__ void __launch_bounds__(256, 1) wg_forward_kernel(const Operands<bf16_t> a, const Problem pr) {
#if CW_WGMMA_BODY
  constexpr int BR = 128, NT = BC / 8, DB = D / 64;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  bf16_t* sQ = aligned_smem(smem_raw);
  bf16_t* sK = sQ + BR * D;      // [2][BC * D]
  bf16_t* sV = sK + 2 * BC * D;  // [2][BC * D]
  const Block blk = query_block_of(pr, BR);
  const int qb = blk.block, h = blk.head, b = blk.b, g = h / pr.group;
  const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, t = lane & 3;
  const int q0 = qb * BR, wrow = wg * 64 + ((threadIdx.x >> 5) & 3) * 16;  // the warp's first row
  const bf16_t* kg = a.k + b * pr.k_batch + g * D;
  const bf16_t* vg = a.v + b * pr.v_batch + g * D;

  // Key blocks [kb_first, nkb): from the one holding the first row's oldest visible key (window, document) to
  // the one holding the last row's position. The stages alternate by step, not by block.
  const int key_end = min(pr.S, pr.p + q0 + BR);
  const int nkb = (key_end + BC - 1) / BC, kb_first = first_visible_key(pr, b, pr.p + q0) / BC;
  const int k_first = kb_first * BC;
  load_tile_sw128<D, BR, 256>(sQ, a.q + q_offset(pr, b, q0, h), pr.q_row, pr.c - q0, a.q);
  load_tile_sw128<D, BC, 256>(sK, kg + k_first * pr.kv_row, pr.kv_row, pr.S - k_first, a.k);
  load_tile_sw128<D, BC, 256>(sV, vg + k_first * pr.kv_row, pr.kv_row, pr.S - k_first, a.v);
  cp_async_commit();

  float o[DB][8][4] = {};
  float m[2] = {-kInf, -kInf}, l[2] = {0.0f, 0.0f};
  for (int kb = kb_first; kb < nkb; ++kb) {
    const int step = kb - kb_first;
    cp_async_wait_all();
    fence_async_shared();
    __syncthreads();  // block kb has landed for everyone; nobody still reads block kb - 1's stage
    if (kb + 1 < nkb) {
      const int k1 = (kb + 1) * BC, st = (step + 1) & 1;
      load_tile_sw128<D, BC, 256>(sK + st * BC * D, kg + k1 * pr.kv_row, pr.kv_row, pr.S - k1, a.k);
      load_tile_sw128<D, BC, 256>(sV + st * BC * D, vg + k1 * pr.kv_row, pr.kv_row, pr.S - k1, a.v);
    }
    cp_async_commit();
    const bf16_t* cK = sK + (step & 1) * BC * D;
    const bf16_t* cV = sV + (step & 1) * BC * D;

    float s[NT][4];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      wgmma_ss<0, 0>(s, desc_k_major<BR>(sQ, wg * 64, ks), desc_k_major<BC>(cK, 0, ks), ks > 0);
    wgmma_commit();
    wgmma_wait_all();
    settle(s);

    const int k0 = kb * BC;
    const bool masked = k0 + BC - 1 > pr.p + q0 || k0 + BC > pr.S || cuts_block(pr, b, k0, pr.p + q0 + BR - 1);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int qpos = pr.p + q0 + wrow + (lane >> 2) + hh * 8;
      float mx = -kInf;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float x = s[nt][2 * hh + e] * pr.scale_log2;
          const int key = k0 + nt * 8 + 2 * t + e;
          if (masked && (!key_visible(pr, b, key, qpos) || key >= pr.S)) x = -kInf;
          s[nt][2 * hh + e] = x;
          mx = fmaxf(mx, x);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[hh], mx);
      const float m_use = m_new == -kInf ? 0.0f : m_new;
      const float correction = fast_exp2(m[hh] - m_use);
      m[hh] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pv = fast_exp2(s[nt][2 * hh + e] - m_use);
          s[nt][2 * hh + e] = pv;
          sum += pv;
        }
      l[hh] = l[hh] * correction + sum;
#pragma unroll
      for (int db = 0; db < DB; ++db)
#pragma unroll
        for (int dt = 0; dt < 8; ++dt) o[db][dt][2 * hh] *= correction, o[db][dt][2 * hh + 1] *= correction;
    }

    uint32_t pf[BC / 16][4];
    pack_a_frags<NT>(pf, s);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk)
#pragma unroll
      for (int db = 0; db < DB; ++db) wgmma_rs<1>(o[db], pf[kk], desc_mn_major<BC>(cV, kk * 16, db * 64), 1);
    wgmma_commit();
    wgmma_wait_all();
#pragma unroll
    for (int db = 0; db < DB; ++db) settle(o[db]);
  }
  cp_async_wait_all();  // nothing in flight at exit (a tile with no key block to attend loaded one)

#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float sum = l[hh];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int i = q0 + wrow + (lane >> 2) + hh * 8;
    if (i >= pr.c) continue;
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // 0: a row that saw no key (out 0, lse -inf)
    bf16_t* out = a.o + q_offset(pr, b, i, h) + 2 * t;
#pragma unroll
    for (int db = 0; db < DB; ++db)
#pragma unroll
      for (int dt = 0; dt < 8; ++dt)
        *reinterpret_cast<uint32_t*>(out + db * 64 + dt * 8) =
            pack_bf16(o[db][dt][2 * hh] * inv, o[db][dt][2 * hh + 1] * inv);
    if (t == 0) a.lse[stat_offset(pr, b, h, i)] = (m[hh] + log2f(sum)) * kLn2;
  }
#else
  __trap();
#endif
}

// ------------------------------------------------------------------------------------------------
// dK/dV (and, when FUSED_DQ, dQ by atomics). CTA: 2 warpgroups, 128 keys of one (b, g); query
// blocks of 64 in two stages.
// ------------------------------------------------------------------------------------------------
template <int D> struct WgBackward {
  static constexpr int kThreads = 256, kKeys = 128, kRows = 64;
  // dQ staging rows: kDqCols floats padded by 4, so that each half-warp's 8-byte stores of a tile
  // hit 16 different bank pairs (rows stay 16-byte aligned).
  static constexpr int kDqStride = D / 2 + 4;
  static constexpr int kSmem = (2 * kKeys + 4 * kRows) * D * static_cast<int>(sizeof(bf16_t)) +
                               kKeys * kRows * static_cast<int>(sizeof(bf16_t)) + 4 * kRows * 4 +
                               2 * 64 * kDqStride * 4 + 1024;
  // dQ: warpgroup w computes head-dim columns [w D / 2, (w + 1) D / 2) over all 128 keys.
  static constexpr int kDqCols = D / 2;
};

template <int D, bool FUSED_DQ>
__global__ void __launch_bounds__(256, 1) wg_backward_kernel(const Operands<bf16_t> a, const Problem pr) {
#if CW_WGMMA_BODY
  using Cfg = WgBackward<D>;
  constexpr int BC = Cfg::kKeys, BR = Cfg::kRows, DB = D / 64;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  bf16_t* sK = aligned_smem(smem_raw);
  bf16_t* sV = sK + BC * D;
  bf16_t* sQ = sV + BC * D;       // [2][BR * D]
  bf16_t* sdO = sQ + 2 * BR * D;  // [2][BR * D]
  bf16_t* sdS = sdO + 2 * BR * D;  // dS^T [BC keys][BR queries], one column block
  float* sLse = reinterpret_cast<float*>(sdS + BC * BR);  // [2][BR]
  float* sDelta = sLse + 2 * BR;                          // [2][BR]
  float* sDq = sDelta + 2 * BR;                           // [2 warpgroups][64 rows][kDqStride]
  const Block blk = key_block_of(pr);
  const int kb = blk.block, g = blk.head, b = blk.b;
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, t = lane & 3;
  const int k0 = kb * BC, wkey = wg * 64 + warp * 16;  // the warp's first key in the block

  load_tile_sw128<D, BC, 256>(sK, a.k + b * pr.k_batch + k0 * pr.kv_row + g * D, pr.kv_row, pr.S - k0, a.k);
  load_tile_sw128<D, BC, 256>(sV, a.v + b * pr.v_batch + k0 * pr.kv_row + g * D, pr.kv_row, pr.S - k0, a.v);
  const KeyBlockSteps steps = key_block_steps(pr, b, k0, BC, BR);
  auto issue = [&](int step, int stage) {  // a step's Q and dO tiles, lse and Delta into stage `stage`
    const int h = steps.head(pr, g, step), q0 = steps.q0(step, BR);
    load_tile_sw128<D, BR, 256>(sQ + stage * BR * D, a.q + q_offset(pr, b, q0, h), pr.q_row, pr.c - q0, a.q);
    load_tile_sw128<D, BR, 256>(sdO + stage * BR * D, a.d_out + q_offset(pr, b, q0, h), pr.q_row, pr.c - q0,
                                a.d_out);
    load_row_stats<BR, 256>(sLse + stage * BR, sDelta + stage * BR, a.lse, a.delta, pr, b, h, q0);
  };
  if (steps.count > 0) issue(0, 0);
  cp_async_commit();

  float dk[DB][8][4] = {}, dv[DB][8][4] = {};
  for (int step = 0; step < steps.count; ++step) {
    cp_async_wait_all();
    fence_async_shared();
    __syncthreads();  // this step's tiles have landed; last step's dS^T and stage are no longer read
    if (step + 1 < steps.count) issue(step + 1, (step + 1) & 1);
    cp_async_commit();
    const int stage = step & 1, h = steps.head(pr, g, step), q0 = steps.q0(step, BR);
    const bf16_t* cQ = sQ + stage * BR * D;
    const bf16_t* cdO = sdO + stage * BR * D;

    // S^T = K Q^T and dP^T = V dO^T for the warpgroup's 64 keys x 64 queries.
    float st[8][4], dpt[8][4];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      wgmma_ss<0, 0>(st, desc_k_major<BC>(sK, wg * 64, ks), desc_k_major<BR>(cQ, 0, ks), ks > 0);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      wgmma_ss<0, 0>(dpt, desc_k_major<BC>(sV, wg * 64, ks), desc_k_major<BR>(cdO, 0, ks), ks > 0);
    wgmma_commit();
    wgmma_wait_all();
    settle(st);
    settle(dpt);

    const bool masked = k0 + BC - 1 > pr.p + q0 || q0 + BR > pr.c || k0 + BC > pr.S ||
                        cuts_block(pr, b, k0, pr.p + q0 + BR - 1);
    probs_and_score_grads_t(st, dpt, sLse + stage * BR, sDelta + stage * BR, pr, b, k0 + wkey, q0, masked,
                            lane);
    // dS^T rows of this warp into shared memory (bf16, as the products round it) for dQ.
    if constexpr (FUSED_DQ) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          *reinterpret_cast<uint32_t*>(sdS + sw128<BC>(wkey + (lane >> 2) + hh * 8, nt * 8) + 2 * t) =
              pack_bf16(dpt[nt][2 * hh], dpt[nt][2 * hh + 1]);
    }
    uint32_t pf[4][4], df[4][4];
    pack_a_frags<8>(pf, st);
    pack_a_frags<8>(df, dpt);
    // dV += P^T dO, dK += dS^T Q (left running while dS^T is exchanged).
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BR / 16; ++kk)
#pragma unroll
      for (int db = 0; db < DB; ++db) wgmma_rs<1>(dv[db], pf[kk], desc_mn_major<BR>(cdO, kk * 16, db * 64), 1);
#pragma unroll
    for (int kk = 0; kk < BR / 16; ++kk)
#pragma unroll
      for (int db = 0; db < DB; ++db) wgmma_rs<1>(dk[db], df[kk], desc_mn_major<BR>(cQ, kk * 16, db * 64), 1);
    wgmma_commit();
    if constexpr (!FUSED_DQ) {
      wgmma_wait_all();
#pragma unroll
      for (int db = 0; db < DB; ++db) settle(dk[db]), settle(dv[db]);
      continue;
    } else {
    fence_async_shared();
    __syncthreads();  // both warpgroups' dS^T rows are in shared memory

    // dQ += dS K: A = dS (queries x keys) is the MN-major view of dS^T, B = K the MN-major view of sK.
    constexpr int DQC = Cfg::kDqCols;
    float dq[DQC / 8][4];
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk)
      wgmma_ss<1, 1>(dq, desc_mn_major<BC>(sdS, kk * 16, 0), desc_mn_major<BC>(sK, kk * 16, wg * DQC), kk > 0);
    wgmma_commit();
    wgmma_wait_all();
    settle(dq);
#pragma unroll
    for (int db = 0; db < DB; ++db) settle(dk[db]), settle(dv[db]);
    // The warp's 16 rows of dQ columns [col0, col0 + DQC) go through shared memory (the staging
    // rows are the warp's own: __syncwarp orders them) and into the f32 accumulator with 16-byte
    // atomics, each warp request covering whole row segments (faster than 8-byte atomics from the
    // fragments or one bulk asynchronous reduction per row).
    const int col0 = wg * DQC;
    float* rows = sDq + (wg * 64 + warp * 16) * Cfg::kDqStride;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int nt = 0; nt < DQC / 8; ++nt)
        *reinterpret_cast<float2*>(rows + ((lane >> 2) + hh * 8) * Cfg::kDqStride + nt * 8 + 2 * t) =
            make_float2(dq[nt][2 * hh], dq[nt][2 * hh + 1]);
    __syncwarp();
    constexpr int kQuads = DQC / 4;  // 16-byte pieces of a staged row
#pragma unroll
    for (int n = 0; n < 16 * kQuads / 32; ++n) {
      const int idx = n * 32 + lane, r = idx / kQuads, quad = idx % kQuads;
      const int i = q0 + warp * 16 + r;
      const float4 x = *reinterpret_cast<const float4*>(rows + r * Cfg::kDqStride + quad * 4);
      if (i < pr.c) atomicAdd(reinterpret_cast<float4*>(a.dq_accum + q_offset(pr, b, i, h) + col0 + quad * 4), x);
    }
    __syncwarp();  // the staging rows are read before the next step overwrites them
    }
  }
  cp_async_wait_all();  // nothing in flight at exit (a key block no query sees loaded its tiles)

  // dk[DB][8][4] is the accumulator layout of D / 8 column tiles.
  add_key_grads<D>(a, pr, b, g, k0 + wkey, reinterpret_cast<const float(&)[D / 8][4]>(dk),
                   reinterpret_cast<const float(&)[D / 8][4]>(dv), lane);
#else
  __trap();
#endif
}

// ------------------------------------------------------------------------------------------------
// dQ of the deterministic backward. CTA: 2 warpgroups, 128 queries of one (b, h); key blocks of
// 64 in two stages. Per block: S = Q K^T and dP = dO V^T (SS), dS = P (dP - Delta) in registers,
// dQ += dS K (dS from registers, K as the MN-major operand). Each d_q element is summed by one
// thread in key order and written once: bitwise reproducible.
// ------------------------------------------------------------------------------------------------
template <int D> struct WgDq {
  static constexpr int kThreads = 256, kRows = 128, kKeys = 64;
  static constexpr int kSmem = (2 * kRows + 4 * kKeys) * D * static_cast<int>(sizeof(bf16_t)) + 1024;
};

template <int D>
__global__ void __launch_bounds__(256, 1) wg_dq_kernel(const Operands<bf16_t> a, const Problem pr) {
#if CW_WGMMA_BODY
  constexpr int BR = WgDq<D>::kRows, BC = WgDq<D>::kKeys, NT = BC / 8, DB = D / 64;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  bf16_t* sQ = aligned_smem(smem_raw);
  bf16_t* sdO = sQ + BR * D;
  bf16_t* sK = sdO + BR * D;     // [2][BC * D]
  bf16_t* sV = sK + 2 * BC * D;  // [2][BC * D]
  const Block blk = query_block_of(pr, BR);
  const int qb = blk.block, h = blk.head, b = blk.b, g = h / pr.group;
  const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, t = lane & 3;
  const int q0 = qb * BR, wrow = wg * 64 + ((threadIdx.x >> 5) & 3) * 16;
  const bf16_t* kg = a.k + b * pr.k_batch + g * D;
  const bf16_t* vg = a.v + b * pr.v_batch + g * D;

  // Key blocks [kb_first, nkb) as in the forward; the stages alternate by step.
  const int key_end = min(pr.S, pr.p + q0 + BR);
  const int nkb = (key_end + BC - 1) / BC, kb_first = first_visible_key(pr, b, pr.p + q0) / BC;
  const int k_first = kb_first * BC;
  load_tile_sw128<D, BR, 256>(sQ, a.q + q_offset(pr, b, q0, h), pr.q_row, pr.c - q0, a.q);
  load_tile_sw128<D, BR, 256>(sdO, a.d_out + q_offset(pr, b, q0, h), pr.q_row, pr.c - q0, a.d_out);
  load_tile_sw128<D, BC, 256>(sK, kg + k_first * pr.kv_row, pr.kv_row, pr.S - k_first, a.k);
  load_tile_sw128<D, BC, 256>(sV, vg + k_first * pr.kv_row, pr.kv_row, pr.S - k_first, a.v);
  cp_async_commit();

  float lse2[2], delta[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int i = q0 + wrow + (lane >> 2) + hh * 8;
    lse2[hh] = i < pr.c ? a.lse[stat_offset(pr, b, h, i)] * kLog2e : 0.0f;
    delta[hh] = i < pr.c ? a.delta[stat_offset(pr, b, h, i)] : 0.0f;
  }
  float dq[DB][8][4] = {};
  for (int kb = kb_first; kb < nkb; ++kb) {
    const int step = kb - kb_first;
    cp_async_wait_all();
    fence_async_shared();
    __syncthreads();
    if (kb + 1 < nkb) {
      const int k1 = (kb + 1) * BC, st = (step + 1) & 1;
      load_tile_sw128<D, BC, 256>(sK + st * BC * D, kg + k1 * pr.kv_row, pr.kv_row, pr.S - k1, a.k);
      load_tile_sw128<D, BC, 256>(sV + st * BC * D, vg + k1 * pr.kv_row, pr.kv_row, pr.S - k1, a.v);
    }
    cp_async_commit();
    const bf16_t* cK = sK + (step & 1) * BC * D;
    const bf16_t* cV = sV + (step & 1) * BC * D;

    float s[NT][4], dp[NT][4];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      wgmma_ss<0, 0>(s, desc_k_major<BR>(sQ, wg * 64, ks), desc_k_major<BC>(cK, 0, ks), ks > 0);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      wgmma_ss<0, 0>(dp, desc_k_major<BR>(sdO, wg * 64, ks), desc_k_major<BC>(cV, 0, ks), ks > 0);
    wgmma_commit();
    wgmma_wait_all();
    settle(s);
    settle(dp);
    const int k0 = kb * BC;
    const bool masked = k0 + BC - 1 > pr.p + q0 || k0 + BC > pr.S || cuts_block(pr, b, k0, pr.p + q0 + BR - 1);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hh = e >> 1, key = k0 + nt * 8 + 2 * t + (e & 1);
        const int qpos = pr.p + q0 + wrow + (lane >> 2) + hh * 8;
        float p = fast_exp2(s[nt][e] * pr.scale_log2 - lse2[hh]);
        if (masked && (!key_visible(pr, b, key, qpos) || key >= pr.S)) p = 0.0f;
        s[nt][e] = p * (dp[nt][e] - delta[hh]);  // dS
      }
    uint32_t sf[BC / 16][4];
    pack_a_frags<NT>(sf, s);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk)
#pragma unroll
      for (int db = 0; db < DB; ++db) wgmma_rs<1>(dq[db], sf[kk], desc_mn_major<BC>(cK, kk * 16, db * 64), 1);
    wgmma_commit();
    wgmma_wait_all();
#pragma unroll
    for (int db = 0; db < DB; ++db) settle(dq[db]);
  }
  cp_async_wait_all();  // nothing in flight at exit (as in the forward)

#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int i = q0 + wrow + (lane >> 2) + hh * 8;
    if (i >= pr.c) continue;
    bf16_t* d_q = a.o + q_offset(pr, b, i, h) + 2 * t;
#pragma unroll
    for (int db = 0; db < DB; ++db)
#pragma unroll
      for (int dt = 0; dt < 8; ++dt)
        write_d_q_pair(d_q + db * 64 + dt * 8, pr, dq[db][dt][2 * hh], dq[db][dt][2 * hh + 1]);
  }
#else
  __trap();
#endif
}

}  // namespace

bool wgmma_built() {
#if defined(CW_WGMMA_BUILD) && CW_WGMMA_BUILD
  return true;
#else
  return false;
#endif
}

void wgmma_forward(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream) {
  if (pr.D == 64) {
    using Cfg = WgForward<64, 128>;
    return launch_tiled<Cfg>(wg_forward_kernel<64, 128>, pr.c, Cfg::kRows, pr.H, a, pr, stream);
  }
  using Cfg = WgForward<128, 128>;
  launch_tiled<Cfg>(wg_forward_kernel<128, 128>, pr.c, Cfg::kRows, pr.H, a, pr, stream);
}

template <int D> void wgmma_backward_at(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream) {
  using Cfg = WgBackward<D>;
  if (a.dq_accum != nullptr)
    return launch_tiled<Cfg>(wg_backward_kernel<D, true>, pr.S, Cfg::kKeys, pr.Hkv, a, pr, stream);
  launch_tiled<Cfg>(wg_backward_kernel<D, false>, pr.S, Cfg::kKeys, pr.Hkv, a, pr, stream);
  launch_tiled<WgDq<D>>(wg_dq_kernel<D>, pr.c, WgDq<D>::kRows, pr.H, a, pr, stream);
}

void wgmma_backward(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream) {
  if (pr.D == 64) wgmma_backward_at<64>(a, pr, stream);
  else wgmma_backward_at<128>(a, pr, stream);
}

}  // namespace cw::gpu::flash
