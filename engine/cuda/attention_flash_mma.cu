// Flash attention, mma.sync family (flash_mma): FlashAttention-2 style kernels on
// mma.sync.m16n8k16 tensor cores (bf16 inputs, f32 accumulation), for any GPU of sm_80 or newer.
//   Computes: out, lse (forward); after the Delta pass of attention_flash.cu, d_k, d_v (always
//   added, one writer per element) and d_q (backward), by the algorithm in attention_flash.cuh.
//   Operands: bf16, head dim 64, 128 or 256, 16-byte aligned rows (K/V batch strides multiples of
//   8); d_k/d_v f32, 8-byte aligned. With the score cap (Gemma 2's) every kernel is instantiated a
//   second time (CAP): the scores go through score_log2's tanh and dS takes its slope.
//   Tiles: ldmatrix from XOR-swizzled shared memory (16-byte chunk c of row r at chunk c ^ (r & 7),
//   so the 8 rows of one ldmatrix phase hit 8 bank groups), cp.async double buffering.
//     forward:  a CTA owns BR queries of one head; each warp keeps MT x 16 rows' scores, softmax
//               state and O in registers; key blocks past the causal diagonal are skipped and only
//               blocks straddling it (or the end) are masked.
//     dK/dV:    a CTA per (b, K/V head, 16 NW keys); each warp holds its 16 keys' dK, dV in
//               registers over every (head of the group, query block) that sees them.
//     dQ:       a CTA per (b, head, query block) recomputes S and dP and sums dQ in key order.
//   Backward forms (mma_backward): with a.dq_accum (determinism off) one fused dK/dV/dQ kernel of
//   8 warps that adds each tile's dS K into the f32 accumulator with 8-byte atomics (d_q then varies
//   in its last bits run to run); without, the two-kernel form (dK/dV, then dQ), bitwise repeatable.
//     At D 256 the dK/dV kernel is tc_dkdv_wide_kernel (below): P^T and dS^T go through shared
//     memory so that each warp holds dK and dV for half the head dim.
//   Chosen by the chooser for bf16 at D 64/128 where wgmma is not available (not an sm_90a build or
//   not a compute capability 9.0 GPU), for every capped call and D 256 (wgmma has neither), or when
//   forced (CW_ATTENTION=flash-mma).
#include "engine/cuda/attention_flash.cuh"

namespace cw::gpu::flash {
namespace {

// ------------------------------------------------------------------------------------------------
// Tensor-core path (bf16, D = 64, 128 or 256): PTX wrappers.
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// acc (16x8 f32) += A (16x16 bf16, row) * B (16x8 bf16, col).
__device__ __forceinline__ void mma(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Fragment layouts of mma.m16n8k16 (g = lane / 4, t = lane % 4):
//   A 16x16: a0 (row g, cols 2t, 2t+1), a1 (row g+8, same cols), a2 (row g, cols 2t+8, +9), a3 (g+8, 2t+8).
//   B 16x8:  b0 (rows 2t, 2t+1, col g), b1 (rows 2t+8, 2t+9, col g).
//   C 16x8:  c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8, cols 2t, 2t+1).
// So the accumulators of two neighbouring 8-column tiles are, packed to bf16 pairs, exactly the A
// fragment of the next product (P and dS feed P V, dS K, P^T dO, dS^T Q without a trip through
// shared memory).
//
// A tile is ROWS x D bf16 in shared memory, row-major, its 16-byte chunks XOR-swizzled.
template <int D> __device__ __forceinline__ int swz(int row, int chunk) { return row * D + ((chunk ^ (row & 7)) << 3); }

// ldmatrix lane addressing. Every tile row used below starts at a multiple of 8, so row & 7 is
// lane & 7 in all three forms.
//  A operand (16 rows x 16 cols at (row0, kstep)): matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15).
template <int D> __device__ __forceinline__ uint32_t a_addr(const bf16_t* tile, int row0, int kstep, int lane) {
  return smem_addr(tile + swz<D>(row0 + (lane & 7) + ((lane >> 3) & 1) * 8, kstep * 2 + (lane >> 4)));
}
//  B operand from rows = n (keys or queries), cols = k (head dim): two 8-row n-tiles starting at
//  n0, one kstep; r0, r1 = b0, b1 of tile n0; r2, r3 = b0, b1 of tile n0 + 8.
template <int D> __device__ __forceinline__ uint32_t bn_addr(const bf16_t* tile, int n0, int kstep, int lane) {
  return smem_addr(tile + swz<D>(n0 + (lane >> 4) * 8 + (lane & 7), kstep * 2 + ((lane >> 3) & 1)));
}
//  B operand from rows = k (keys or queries), cols = n (head dim), with .trans: 16 rows at k0,
//  two 8-col n-tiles starting at chunk pair dpair; r0, r1 = b0, b1 of the first, r2, r3 of the second.
template <int D> __device__ __forceinline__ uint32_t bk_addr(const bf16_t* tile, int k0, int dpair, int lane) {
  return smem_addr(tile + swz<D>(k0 + (lane & 7) + ((lane >> 3) & 1) * 8, dpair * 2 + (lane >> 4)));
}

// ROWS x D rows of a bf16 operand (row stride `ld`) into a swizzled tile; rows at or past `valid`
// are zero-filled (`base`, a valid address, stands in for them).
template <int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile(bf16_t* tile, const bf16_t* src, int64_t ld, int valid, const bf16_t* base) {
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int n = 0; n < (ROWS * kChunks + THREADS - 1) / THREADS; ++n) {
    const int idx = threadIdx.x + n * THREADS;
    if (ROWS * kChunks % THREADS == 0 || idx < ROWS * kChunks) {
      const int r = idx / kChunks, ch = idx % kChunks;
      const bool ok = r < valid;
      cp_async16(smem_addr(tile + swz<D>(r, ch)), ok ? src + r * ld + ch * 8 : base, ok);
    }
  }
}

// A (16 x 16) fragments of a 16-row tile slice for every kstep of D: a[ks].
template <int D>
__device__ __forceinline__ void load_a_frags(uint32_t (&a)[D / 16][4], const bf16_t* tile, int row0, int lane) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) ldsm_x4(a[ks], a_addr<D>(tile, row0, ks, lane));
}

// acc[16 x N] += A[16 x D] * Bt^T where Bt is an N x D tile (rows = n): S = Q K^T and friends.
// A comes from registers (a_regs) or, when FROM_SMEM, from the tile `a_tile` at row a_row0.
template <int D, int N, bool FROM_SMEM>
__device__ __forceinline__ void mma_abt(float (&acc)[N / 8][4], const uint32_t (&a_regs)[FROM_SMEM ? 1 : D / 16][4],
                                        const bf16_t* a_tile, int a_row0, const bf16_t* bt, int lane) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    uint32_t a[4];
    if constexpr (FROM_SMEM) {
      ldsm_x4(a, a_addr<D>(a_tile, a_row0, ks, lane));
    } else {
#pragma unroll
      for (int x = 0; x < 4; ++x) a[x] = a_regs[ks][x];
    }
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      uint32_t b[4];
      ldsm_x4(b, bn_addr<D>(bt, np * 16, ks, lane));
      mma(acc[2 * np], a, b[0], b[1]);
      mma(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// One k-step of a product by a K x D tile Bk (rows = k) in shared memory: acc[16 x N] += A[16 x 16]
// Bk[k0 .. k0 + 16, col0 .. col0 + N), A one k-step's fragment (mma.m16n8k16's A layout), for the
// products by Bk whose A is read from shared memory (fused_dq_tile's dS, mma_sb's P^T and dS^T).
template <int D, int N>
__device__ __forceinline__ void mma_kstep_bk(float (&acc)[N / 8][4], const uint32_t (&a)[4], const bf16_t* bk, int k0,
                                             int col0, int lane) {
#pragma unroll
  for (int dp = 0; dp < N / 16; ++dp) {
    uint32_t b[4];
    ldsm_x4_trans(b, bk_addr<D>(bk, k0, col0 / 16 + dp, lane));
    mma(acc[2 * dp], a, b[0], b[1]);
    mma(acc[2 * dp + 1], a, b[2], b[3]);
  }
}

// acc[16 x D] += X[16 x K] * Bk where X is given as f32 accumulators of K / 8 n-tiles (packed to
// bf16 here) and Bk is a K x D tile (rows = k): O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q.
template <int D, int K>
__device__ __forceinline__ void mma_xb(float (&acc)[D / 8][4], const float (&x)[K / 8][4], const bf16_t* bk, int lane) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t a[4];
    a_frag_from_acc(a, x, kk);
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t b[4];
      ldsm_x4_trans(b, bk_addr<D>(bk, kk * 16, dp, lane));
      mma(acc[2 * dp], a, b[0], b[1]);
      mma(acc[2 * dp + 1], a, b[2], b[3]);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Tensor-core forward. CTA: NW warps, BR = NW * MT * 16 queries of one (b, h); key blocks of BC.
// Shared memory: Q tile, then two stages of K and V tiles.
// ------------------------------------------------------------------------------------------------
template <int D, int NW, int MT, int BC> struct TcForward {
  static constexpr int kThreads = NW * 32, kRows = NW * MT * 16;
  static constexpr int kSmem = (kRows + 4 * BC) * D * static_cast<int>(sizeof(bf16_t));
  // Q fragments stay in registers when they are small; otherwise they are re-read per key block.
  static constexpr bool kQInRegs = MT * D <= 128;
};

template <int D, int NW, int MT, int BC, bool CAP>
__global__ void __launch_bounds__(NW * 32) tc_forward_kernel(const Operands<bf16_t> a, const Problem pr) {
  using Cfg = TcForward<D, NW, MT, BC>;
  constexpr int BR = Cfg::kRows, NT = BC / 8, DT = D / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16_t* sQ = reinterpret_cast<bf16_t*>(smem_raw);
  bf16_t* sK = sQ + BR * D;      // [2][BC * D]
  bf16_t* sV = sK + 2 * BC * D;  // [2][BC * D]
  const Block blk = query_block_of(pr, BR);
  const int qb = blk.block, h = blk.head, b = blk.b, g = h / pr.group;
  const int q0 = qb * BR, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const int wrow = warp * MT * 16;  // the warp's first row in the tile
  const bf16_t* kg = a.k + b * pr.k_batch + g * D;
  const bf16_t* vg = a.v + b * pr.v_batch + g * D;

  // Key blocks [kb_first, nkb): from the one holding the first row's oldest visible key (window, document) to
  // the one holding the last row's position. The stages alternate by step, not by block.
  const int key_end = min(pr.S, pr.p + q0 + BR);  // keys visible to the tile's last row
  const int nkb = (key_end + BC - 1) / BC, kb_first = first_visible_key(pr, b, pr.p + q0) / BC;
  const int k_first = kb_first * BC;
  load_tile<D, BR, Cfg::kThreads>(sQ, a.q + q_offset(pr, b, q0, h), pr.q_row, pr.c - q0, a.q);
  load_tile<D, BC, Cfg::kThreads>(sK, kg + k_first * pr.kv_row, pr.kv_row, pr.S - k_first, a.k);
  load_tile<D, BC, Cfg::kThreads>(sV, vg + k_first * pr.kv_row, pr.kv_row, pr.S - k_first, a.v);
  cp_async_commit();

  float o[MT][DT][4] = {};
  float m[MT][2], l[MT][2];  // running max (base-2 domain) and this thread's part of the running sum
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = -kInf, l[mt][0] = l[mt][1] = 0.0f;
  uint32_t qf[MT][Cfg::kQInRegs ? D / 16 : 1][4];

  for (int kb = kb_first; kb < nkb; ++kb) {
    const int step = kb - kb_first;
    cp_async_wait_all();
    __syncthreads();  // block kb has landed for everyone, and nobody still reads block kb - 1's stage
    if (kb + 1 < nkb) {
      const int k1 = (kb + 1) * BC, st = (step + 1) & 1;
      load_tile<D, BC, Cfg::kThreads>(sK + st * BC * D, kg + k1 * pr.kv_row, pr.kv_row, pr.S - k1, a.k);
      load_tile<D, BC, Cfg::kThreads>(sV + st * BC * D, vg + k1 * pr.kv_row, pr.kv_row, pr.S - k1, a.v);
    }
    cp_async_commit();
    const bf16_t* cK = sK + (step & 1) * BC * D;
    const bf16_t* cV = sV + (step & 1) * BC * D;
    if constexpr (Cfg::kQInRegs) {
      if (step == 0)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) load_a_frags<D>(qf[mt], sQ, wrow + mt * 16, lane);
    }

    float s[MT][NT][4] = {};
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) mma_abt<D, BC, !Cfg::kQInRegs>(s[mt], qf[mt], sQ, wrow + mt * 16, cK, lane);

    // Only blocks that cross the diagonal of the tile, a row's window or document start (or the end of
    // the keys) need the mask.
    const int k0 = kb * BC;
    const bool masked = k0 + BC - 1 > pr.p + q0 || k0 + BC > pr.S || cuts_block(pr, b, k0, pr.p + q0 + BR - 1);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int qpos = pr.p + q0 + wrow + mt * 16 + (lane >> 2) + hh * 8;  // the row's position
        float mx = -kInf;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float slope;  // the backward's; unused here
            float x = score_log2<CAP>(pr, s[mt][nt][2 * hh + e], slope);
            const int key = k0 + nt * 8 + 2 * t + e;
            if (masked && (!key_visible(pr, b, key, qpos) || key >= pr.S)) x = -kInf;
            s[mt][nt][2 * hh + e] = x;
            mx = fmaxf(mx, x);
          }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));  // the 4 threads of a quad share a row
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[mt][hh], mx);
        const float m_use = m_new == -kInf ? 0.0f : m_new;
        const float correction = fast_exp2(m[mt][hh] - m_use);
        m[mt][hh] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pv = fast_exp2(s[mt][nt][2 * hh + e] - m_use);
            s[mt][nt][2 * hh + e] = pv;
            sum += pv;
          }
        l[mt][hh] = l[mt][hh] * correction + sum;  // quad-reduced once, at the end
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) o[mt][dt][2 * hh] *= correction, o[mt][dt][2 * hh + 1] *= correction;
      }
      mma_xb<D, BC>(o[mt], s[mt], cV, lane);
    }
  }
  cp_async_wait_all();  // nothing in flight at exit (a tile with no key block to attend loaded one)

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float sum = l[mt][hh];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int i = q0 + wrow + mt * 16 + (lane >> 2) + hh * 8;
      if (i >= pr.c) continue;
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // 0: a row that saw no key (out 0, lse -inf)
      bf16_t* out = a.o + q_offset(pr, b, i, h) + 2 * t;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
        *reinterpret_cast<uint32_t*>(out + dt * 8) = pack_bf16(o[mt][dt][2 * hh] * inv, o[mt][dt][2 * hh + 1] * inv);
      if (t == 0) a.lse[stat_offset(pr, b, h, i)] = (m[mt][hh] + log2f(sum)) * kLn2;
    }
}

// ------------------------------------------------------------------------------------------------
// Tensor-core dK/dV. CTA: NW warps, BC = NW * 16 keys of one (b, g); query blocks of BR, double
// buffered (Q, dO, lse, Delta). Warp w owns keys [16 w, 16 w + 16) of the block.
// FUSED_DQ (the non-deterministic backward): each step also writes its dS^T tile (bf16, keys x
// queries) to shared memory and, after a second barrier, all warps compute the tile's dQ
// contribution dS (BR x BC) K (BC x D) together (fused_dq_tile) and add it into the f32
// accumulator with 8-byte atomics.
// ------------------------------------------------------------------------------------------------
// A dK/dV CTA's loads. Its keys [k0, k0 + BC) of K/V head g: the K and V tiles, once (rows past
// the keys zeroed). Then per step of key_block_steps the Q and dO tiles of the step's head and query
// rows [q0, q0 + BR) (rows past the chunk zeroed) and their lse and Delta, double buffered by
// cp.async: step s lands in stage s & 1 while step s - 1 computes. Construction issues the K/V tiles
// and step 0's rows; begin_step(s) starts step s.
template <int D, int BC, int BR, int THREADS> struct DkdvLoads {
  bf16_t* sQ;  // [2][BR * D]
  bf16_t* sdO;  // [2][BR * D]
  float* sLse;  // [2][BR]
  float* sDelta;  // [2][BR]
  const Operands<bf16_t>& a;
  const Problem& pr;
  int b, g;
  KeyBlockSteps steps;

  __device__ __forceinline__ DkdvLoads(bf16_t* sK, bf16_t* sV, bf16_t* sQ_, bf16_t* sdO_, float* sLse_,
                                       float* sDelta_, const Operands<bf16_t>& a_, const Problem& pr_, int b_,
                                       int g_, int k0)
      : sQ(sQ_), sdO(sdO_), sLse(sLse_), sDelta(sDelta_), a(a_), pr(pr_), b(b_), g(g_) {
    load_tile<D, BC, THREADS>(sK, a.k + b * pr.k_batch + k0 * pr.kv_row + g * D, pr.kv_row, pr.S - k0, a.k);
    load_tile<D, BC, THREADS>(sV, a.v + b * pr.v_batch + k0 * pr.kv_row + g * D, pr.kv_row, pr.S - k0, a.v);
    steps = key_block_steps(pr, b, k0, BC, BR);
    if (steps.count > 0) issue(0);
    cp_async_commit();
  }
  // The top of step `step`: its rows have landed and every thread is past step - 1 (its stage, and
  // any shared tile the step wrote, are free again); step + 1's rows go into the other stage.
  __device__ __forceinline__ void begin_step(int step) const {
    cp_async_wait_all();
    __syncthreads();
    if (step + 1 < steps.count) issue(step + 1);
    cp_async_commit();
  }
  __device__ __forceinline__ void issue(int step) const {
    const int h = steps.head(pr, g, step), q0 = steps.q0(step, BR), stage = step & 1;
    load_tile<D, BR, THREADS>(sQ + stage * BR * D, a.q + q_offset(pr, b, q0, h), pr.q_row, pr.c - q0, a.q);
    load_tile<D, BR, THREADS>(sdO + stage * BR * D, a.d_out + q_offset(pr, b, q0, h), pr.q_row, pr.c - q0, a.d_out);
    load_row_stats<BR, THREADS>(sLse + stage * BR, sDelta + stage * BR, a.lse, a.delta, pr, b, h, q0);
  }
};

template <int D, int NW, int BR, bool FUSED_DQ> struct TcDkdv {
  static constexpr int kThreads = NW * 32, kKeys = NW * 16;
  static constexpr int kDsBytes = FUSED_DQ ? kKeys * BR * static_cast<int>(sizeof(bf16_t)) : 0;
  static constexpr int kSmem = (2 * kKeys + 4 * BR) * D * static_cast<int>(sizeof(bf16_t)) + 4 * BR * 4 + kDsBytes;
  static constexpr bool kKVInRegs = D <= 64;  // the warp's K and V fragments in registers
  static_assert(!FUSED_DQ || BR % 64 == 0, "the dS^T tile's swizzle needs rows of 8+ 16-byte chunks");
};

// dQ rows [q0, q0 + BR) of head h += dS K for one step's tile: sdS is the BC x BR dS^T tile
// (keys-major, swizzled), sK the CTA's BC x D keys. The BR x D output is cut into 16-row x
// DQN-column units dealt round-robin to the warps; each unit reads its dS fragments with
// ldmatrix.trans (matrix m of the x4 covers query half m & 1 and key half m >> 1).
template <class Cfg, int D, int BR>
__device__ __forceinline__ void fused_dq_tile(const Operands<bf16_t>& a, const Problem& pr, const bf16_t* sdS,
                                              const bf16_t* sK, int b, int h, int q0, int warp, int lane) {
  constexpr int BC = Cfg::kKeys, NW = Cfg::kThreads / 32;
  // Units of 16 query rows x DQN head-dim columns: at least one per warp where the tile allows.
  constexpr int DQN = (BR / 16) * D / NW >= 64 ? 64 : ((BR / 16) * D / NW >= 32 ? 32 : 16);
  constexpr int UNIT_COLS = D / DQN, UNITS = (BR / 16) * UNIT_COLS;
  static_assert(D % DQN == 0 && BR % 16 == 0, "dQ units must tile the BR x D output");
  const int t = lane & 3;
#pragma unroll 1
  for (int unit = warp; unit < UNITS; unit += NW) {
    const int row0 = unit / UNIT_COLS * 16, col0 = unit % UNIT_COLS * DQN;
    float dq[DQN / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      uint32_t af[4];
      ldsm_x4_trans(af, smem_addr(sdS + swz<BR>(kk * 16 + ((lane >> 4) & 1) * 8 + (lane & 7),
                                                row0 / 8 + ((lane >> 3) & 1))));
      mma_kstep_bk<D, DQN>(dq, af, sK, kk * 16, col0, lane);
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int i = q0 + row0 + (lane >> 2) + hh * 8;
      if (i >= pr.c) continue;
      float* acc = a.dq_accum + q_offset(pr, b, i, h) + col0 + 2 * t;
#pragma unroll
      for (int dt = 0; dt < DQN / 8; ++dt) atomic_add2(acc + dt * 8, dq[dt][2 * hh], dq[dt][2 * hh + 1]);
    }
  }
}

template <int D, int NW, int BR, bool FUSED_DQ, bool CAP>
__global__ void __launch_bounds__(NW * 32) tc_dkdv_kernel(const Operands<bf16_t> a, const Problem pr) {
  using Cfg = TcDkdv<D, NW, BR, FUSED_DQ>;
  constexpr int BC = Cfg::kKeys, NQ = BR / 8, DT = D / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16_t* sK = reinterpret_cast<bf16_t*>(smem_raw);
  bf16_t* sV = sK + BC * D;
  bf16_t* sQ = sV + BC * D;    // [2][BR * D]
  bf16_t* sdO = sQ + 2 * BR * D;  // [2][BR * D]
  float* sLse = reinterpret_cast<float*>(sdO + 2 * BR * D);  // [2][BR]
  float* sDelta = sLse + 2 * BR;                              // [2][BR]
  bf16_t* sdS = reinterpret_cast<bf16_t*>(sDelta + 2 * BR);   // FUSED_DQ: [BC keys][BR queries], swizzled
  const Block blk = key_block_of(pr);
  const int kb = blk.block, g = blk.head, b = blk.b;
  const int k0 = kb * BC, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const int wkey = warp * 16;

  const DkdvLoads<D, BC, BR, Cfg::kThreads> loads(sK, sV, sQ, sdO, sLse, sDelta, a, pr, b, g, k0);
  const KeyBlockSteps& steps = loads.steps;

  float dk[DT][4] = {}, dv[DT][4] = {};
  uint32_t kf[Cfg::kKVInRegs ? D / 16 : 1][4], vf[Cfg::kKVInRegs ? D / 16 : 1][4];
  for (int step = 0; step < steps.count; ++step) {
    loads.begin_step(step);
    if constexpr (Cfg::kKVInRegs) {
      if (step == 0) {
        load_a_frags<D>(kf, sK, wkey, lane);
        load_a_frags<D>(vf, sV, wkey, lane);
      }
    }
    const int stage = step & 1, q0 = steps.q0(step, BR);
    const bf16_t* cQ = sQ + stage * BR * D;
    const bf16_t* cdO = sdO + stage * BR * D;

    float st[NQ][4] = {}, dpt[NQ][4] = {};  // S^T and dP^T: 16 keys x BR queries
    mma_abt<D, BR, !Cfg::kKVInRegs>(st, kf, sK, wkey, cQ, lane);
    mma_abt<D, BR, !Cfg::kKVInRegs>(dpt, vf, sV, wkey, cdO, lane);

    const bool masked = k0 + BC - 1 > pr.p + q0 || q0 + BR > pr.c || k0 + BC > pr.S ||
                        cuts_block(pr, b, k0, pr.p + q0 + BR - 1);
    probs_and_score_grads_t<NQ, CAP>(st, dpt, sLse + stage * BR, sDelta + stage * BR, pr, b, k0 + wkey, q0,
                                     masked, lane);
    if constexpr (FUSED_DQ) {
      // The warp's 16 rows of dS^T, rounded to bf16 as the dK product rounds them. Free to
      // overwrite: every warp finished reading the previous step's tile before the loop's barrier.
#pragma unroll
      for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          *reinterpret_cast<uint32_t*>(sdS + swz<BR>(wkey + (lane >> 2) + hh * 8, nt) + 2 * t) =
              pack_bf16(dpt[nt][2 * hh], dpt[nt][2 * hh + 1]);
    }
    mma_xb<D, BR>(dv, st, cdO, lane);
    mma_xb<D, BR>(dk, dpt, cQ, lane);
    if constexpr (FUSED_DQ) {
      __syncthreads();  // the whole BC x BR dS^T tile is in shared memory
      fused_dq_tile<Cfg, D, BR>(a, pr, sdS, sK, b, steps.head(pr, g, step), q0, warp, lane);
    }
  }
  cp_async_wait_all();  // nothing in flight at exit (a key block no query sees loaded its tiles)

  add_key_grads<D>(a, pr, b, g, k0 + wkey, dk, dv, lane);
}

// ------------------------------------------------------------------------------------------------
// Tensor-core dQ. CTA: NW warps, BR = NW * 16 queries of one (b, h); key blocks of BC, double
// buffered. dQ = scale sum_j dS_ij k_j with dS recomputed from Q, K, V, dO, lse, Delta.
// ------------------------------------------------------------------------------------------------
template <int D, int NW, int BC> struct TcDq {
  static constexpr int kThreads = NW * 32, kRows = NW * 16;
  static constexpr int kSmem = (2 * kRows + 4 * BC) * D * static_cast<int>(sizeof(bf16_t));
  static constexpr bool kInRegs = D <= 64;  // Q and dO fragments in registers
};

template <int D, int NW, int BC, bool CAP>
__global__ void __launch_bounds__(NW * 32) tc_dq_kernel(const Operands<bf16_t> a, const Problem pr) {
  using Cfg = TcDq<D, NW, BC>;
  constexpr int BR = Cfg::kRows, NT = BC / 8, DT = D / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16_t* sQ = reinterpret_cast<bf16_t*>(smem_raw);
  bf16_t* sdO = sQ + BR * D;
  bf16_t* sK = sdO + BR * D;     // [2][BC * D]
  bf16_t* sV = sK + 2 * BC * D;  // [2][BC * D]
  const Block blk = query_block_of(pr, BR);
  const int qb = blk.block, h = blk.head, b = blk.b, g = h / pr.group;
  const int q0 = qb * BR, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const int wrow = warp * 16;
  const bf16_t* kg = a.k + b * pr.k_batch + g * D;
  const bf16_t* vg = a.v + b * pr.v_batch + g * D;

  // Key blocks [kb_first, nkb) as in the forward; the stages alternate by step.
  const int key_end = min(pr.S, pr.p + q0 + BR);
  const int nkb = (key_end + BC - 1) / BC, kb_first = first_visible_key(pr, b, pr.p + q0) / BC;
  const int k_first = kb_first * BC;
  load_tile<D, BR, Cfg::kThreads>(sQ, a.q + q_offset(pr, b, q0, h), pr.q_row, pr.c - q0, a.q);
  load_tile<D, BR, Cfg::kThreads>(sdO, a.d_out + q_offset(pr, b, q0, h), pr.q_row, pr.c - q0, a.d_out);
  load_tile<D, BC, Cfg::kThreads>(sK, kg + k_first * pr.kv_row, pr.kv_row, pr.S - k_first, a.k);
  load_tile<D, BC, Cfg::kThreads>(sV, vg + k_first * pr.kv_row, pr.kv_row, pr.S - k_first, a.v);
  cp_async_commit();

  float lse2[2], delta[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int i = q0 + wrow + (lane >> 2) + hh * 8;
    lse2[hh] = i < pr.c ? a.lse[stat_offset(pr, b, h, i)] * kLog2e : 0.0f;
    delta[hh] = i < pr.c ? a.delta[stat_offset(pr, b, h, i)] : 0.0f;
  }
  float dq[DT][4] = {};
  uint32_t qf[Cfg::kInRegs ? D / 16 : 1][4], df[Cfg::kInRegs ? D / 16 : 1][4];
  for (int kb = kb_first; kb < nkb; ++kb) {
    const int step = kb - kb_first;
    cp_async_wait_all();
    __syncthreads();
    if (kb + 1 < nkb) {
      const int k1 = (kb + 1) * BC, st = (step + 1) & 1;
      load_tile<D, BC, Cfg::kThreads>(sK + st * BC * D, kg + k1 * pr.kv_row, pr.kv_row, pr.S - k1, a.k);
      load_tile<D, BC, Cfg::kThreads>(sV + st * BC * D, vg + k1 * pr.kv_row, pr.kv_row, pr.S - k1, a.v);
    }
    cp_async_commit();
    if constexpr (Cfg::kInRegs) {
      if (step == 0) {
        load_a_frags<D>(qf, sQ, wrow, lane);
        load_a_frags<D>(df, sdO, wrow, lane);
      }
    }
    const bf16_t* cK = sK + (step & 1) * BC * D;
    const bf16_t* cV = sV + (step & 1) * BC * D;
    float s[NT][4] = {}, dp[NT][4] = {};
    mma_abt<D, BC, !Cfg::kInRegs>(s, qf, sQ, wrow, cK, lane);
    mma_abt<D, BC, !Cfg::kInRegs>(dp, df, sdO, wrow, cV, lane);
    const int k0 = kb * BC;
    const bool masked = k0 + BC - 1 > pr.p + q0 || k0 + BC > pr.S || cuts_block(pr, b, k0, pr.p + q0 + BR - 1);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hh = e >> 1, key = k0 + nt * 8 + 2 * t + (e & 1);
        const int qpos = pr.p + q0 + wrow + (lane >> 2) + hh * 8;
        float slope;
        float p = fast_exp2(score_log2<CAP>(pr, s[nt][e], slope) - lse2[hh]);
        if (masked && (!key_visible(pr, b, key, qpos) || key >= pr.S)) p = 0.0f;
        s[nt][e] = p * (dp[nt][e] - delta[hh]) * slope;  // dS
      }
    mma_xb<D, BC>(dq, s, cK, lane);
  }
  cp_async_wait_all();  // nothing in flight at exit (as in the forward)

#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int i = q0 + wrow + (lane >> 2) + hh * 8;
    if (i >= pr.c) continue;
    bf16_t* d_q = a.o + q_offset(pr, b, i, h) + 2 * t;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) write_d_q_pair(d_q + dt * 8, pr, dq[dt][2 * hh], dq[dt][2 * hh + 1]);
  }
}

// ------------------------------------------------------------------------------------------------
// Tensor-core dK/dV at head dim 256 (and, when FUSED_DQ, dQ by atomics). A warp's 16 keys over all
// 256 columns would hold 256 accumulators of dK and dV a thread, more than the register file gives,
// so each product is cut among the warps its own way. CTA: 8 warps, 64 keys of one (b, g); query
// blocks of BR = 64, double buffered (Q, dO, lse, Delta). Per step:
//   1. S^T = K Q^T and dP^T = V dO^T (64 keys x 64 queries, over the whole head dim): warp w takes
//      keys 16 (w % 4) .. + 16 against queries 32 (w / 4) .. + 32;
//   2. P^T and dS^T from them (probs_and_score_grads_t), rounded to bf16 into shared memory
//      (keys-major, swizzled), as the products round them;
//   3. after a barrier, dV += P^T dO and dK += dS^T Q: warp w takes keys 16 (w % 4) .. + 16 and
//      head-dim columns 128 (w / 4) .. + 128 (64 accumulators of each a thread), its A operand read
//      back from shared memory;
//   4. FUSED_DQ: dQ += dS K for the block (fused_dq_tile, as the narrower kernel does).
// ------------------------------------------------------------------------------------------------
template <int D, int BR, bool FUSED_DQ> struct TcDkdvWide {
  static constexpr int kWarps = 8, kThreads = kWarps * 32, kKeys = 64, kCols = D / 2;
  static constexpr int kSmem = (2 * kKeys + 4 * BR) * D * static_cast<int>(sizeof(bf16_t)) +
                               2 * kKeys * BR * static_cast<int>(sizeof(bf16_t)) + 4 * BR * 4;
  static_assert(BR == 64, "a step's S^T is cut into 4 x 2 warp tiles of 16 keys x 32 queries");
};

// acc[16 x N] += A[16 x K] B, A rows a_row0 .. + 16 of a K-wide tile in shared memory (P^T or dS^T,
// keys x queries), B columns col0 .. + N of a K x D tile (rows = k: dO or Q).
template <int D, int K, int N>
__device__ __forceinline__ void mma_sb(float (&acc)[N / 8][4], const bf16_t* a_tile, int a_row0, const bf16_t* bk,
                                       int col0, int lane) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t af[4];
    ldsm_x4(af, a_addr<K>(a_tile, a_row0, kk, lane));
    mma_kstep_bk<D, N>(acc, af, bk, kk * 16, col0, lane);
  }
}

template <int D, int BR, bool FUSED_DQ, bool CAP>
__global__ void __launch_bounds__(256) tc_dkdv_wide_kernel(const Operands<bf16_t> a, const Problem pr) {
  using Cfg = TcDkdvWide<D, BR, FUSED_DQ>;
  constexpr int BC = Cfg::kKeys, COLS = Cfg::kCols;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16_t* sK = reinterpret_cast<bf16_t*>(smem_raw);
  bf16_t* sV = sK + BC * D;
  bf16_t* sQ = sV + BC * D;       // [2][BR * D]
  bf16_t* sdO = sQ + 2 * BR * D;  // [2][BR * D]
  bf16_t* sP = sdO + 2 * BR * D;  // P^T [BC keys][BR queries], swizzled
  bf16_t* sdS = sP + BC * BR;     // dS^T, the same
  float* sLse = reinterpret_cast<float*>(sdS + BC * BR);  // [2][BR]
  float* sDelta = sLse + 2 * BR;                          // [2][BR]
  const Block blk = key_block_of(pr);
  const int kb = blk.block, g = blk.head, b = blk.b;
  const int k0 = kb * BC, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const int wkey = (warp & 3) * 16;        // the warp's 16 keys in every product
  const int wq = (warp >> 2) * 32;         // its 32 queries of S^T and dP^T
  const int wcol = (warp >> 2) * COLS;     // its head-dim columns of dK and dV

  const DkdvLoads<D, BC, BR, Cfg::kThreads> loads(sK, sV, sQ, sdO, sLse, sDelta, a, pr, b, g, k0);
  const KeyBlockSteps& steps = loads.steps;

  float dk[COLS / 8][4] = {}, dv[COLS / 8][4] = {};
  const uint32_t no_regs[1][4] = {};  // mma_abt's register operand, unused: A comes from shared memory
  for (int step = 0; step < steps.count; ++step) {
    loads.begin_step(step);  // past it, last step's P^T and dS^T are no longer read
    const int stage = step & 1, q0 = steps.q0(step, BR);
    const bf16_t* cQ = sQ + stage * BR * D;
    const bf16_t* cdO = sdO + stage * BR * D;

    float st[4][4] = {}, dpt[4][4] = {};  // S^T and dP^T: the warp's 16 keys x 32 queries
    mma_abt<D, 32, true>(st, no_regs, sK, wkey, cQ + wq * D, lane);
    mma_abt<D, 32, true>(dpt, no_regs, sV, wkey, cdO + wq * D, lane);
    const bool masked = k0 + BC - 1 > pr.p + q0 || q0 + BR > pr.c || k0 + BC > pr.S ||
                        cuts_block(pr, b, k0, pr.p + q0 + BR - 1);
    probs_and_score_grads_t<4, CAP>(st, dpt, sLse + stage * BR + wq, sDelta + stage * BR + wq, pr, b, k0 + wkey,
                                    q0 + wq, masked, lane);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int off = swz<BR>(wkey + (lane >> 2) + hh * 8, wq / 8 + nt) + 2 * t;
        *reinterpret_cast<uint32_t*>(sP + off) = pack_bf16(st[nt][2 * hh], st[nt][2 * hh + 1]);
        *reinterpret_cast<uint32_t*>(sdS + off) = pack_bf16(dpt[nt][2 * hh], dpt[nt][2 * hh + 1]);
      }
    __syncthreads();  // the whole 64 x 64 P^T and dS^T are in shared memory
    mma_sb<D, BR, COLS>(dv, sP, wkey, cdO, wcol, lane);
    mma_sb<D, BR, COLS>(dk, sdS, wkey, cQ, wcol, lane);
    if constexpr (FUSED_DQ) fused_dq_tile<Cfg, D, BR>(a, pr, sdS, sK, b, steps.head(pr, g, step), q0, warp, lane);
  }
  cp_async_wait_all();  // nothing in flight at exit (a key block no query sees loaded its tiles)

  add_key_grads<D, COLS>(a, pr, b, g, k0 + wkey, dk, dv, lane, wcol);
}

template <int D, int NW, int MT, int BC, bool CAP>
void launch_tc_forward(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream) {
  using Cfg = TcForward<D, NW, MT, BC>;
  launch_tiled<Cfg>(tc_forward_kernel<D, NW, MT, BC, CAP>, pr.c, Cfg::kRows, pr.H, a, pr, stream);
}

template <int D, int NW, int BR, bool FUSED_DQ, bool CAP>
void launch_tc_dkdv(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream) {
  using Cfg = TcDkdv<D, NW, BR, FUSED_DQ>;
  launch_tiled<Cfg>(tc_dkdv_kernel<D, NW, BR, FUSED_DQ, CAP>, pr.S, Cfg::kKeys, pr.Hkv, a, pr, stream);
}

template <int D, int BR, bool FUSED_DQ, bool CAP>
void launch_tc_dkdv_wide(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream) {
  using Cfg = TcDkdvWide<D, BR, FUSED_DQ>;
  launch_tiled<Cfg>(tc_dkdv_wide_kernel<D, BR, FUSED_DQ, CAP>, pr.S, Cfg::kKeys, pr.Hkv, a, pr, stream);
}

template <int D, int NW, int BC, bool CAP>
void launch_tc_dq(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream) {
  using Cfg = TcDq<D, NW, BC>;
  launch_tiled<Cfg>(tc_dq_kernel<D, NW, BC, CAP>, pr.c, Cfg::kRows, pr.H, a, pr, stream);
}

// The tile shapes. D 64 and 128: chosen by timing the candidates on an H100 at B = 1, S = c = 8192.
//   forward D = 64:  4 warps x 16 rows (BR 64), BC 64    D = 128: 4 warps x 32 rows (BR 128), BC 64
//   dK/dV:           4 warps x 16 keys (BC 64), BR 64    dQ:      4 warps x 16 rows (BR 64), BC 64
//   fused dK/dV/dQ:  8 warps x 16 keys (BC 128), BR 64, dQ inline after a second barrier, 8-byte atomics
// D 256 (Gemma 2), where a warp's O, dQ or dK/dV rows over the whole head dim take 128 registers:
//   forward:         8 warps x 16 rows (BR 128), BC 32 (128 KiB of shared memory; BC 64 spills)
//   dK/dV:           tc_dkdv_wide_kernel, 8 warps, 64 keys, BR 64 (209 KiB), dQ fused as above
//   dQ:              4 warps x 16 rows (BR 64), BC 32
template <bool CAP> void mma_forward_at(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream) {
  if (pr.D == 64) return launch_tc_forward<64, 4, 1, 64, CAP>(a, pr, stream);
  if (pr.D == 128) return launch_tc_forward<128, 4, 2, 64, CAP>(a, pr, stream);
  launch_tc_forward<256, 8, 1, 32, CAP>(a, pr, stream);
}

template <int D, bool CAP> void mma_backward_at(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream) {
  if constexpr (D == 256) {
    if (a.dq_accum != nullptr) return launch_tc_dkdv_wide<D, 64, true, CAP>(a, pr, stream);  // fused, dQ by atomics
    launch_tc_dkdv_wide<D, 64, false, CAP>(a, pr, stream);
    launch_tc_dq<D, 4, 32, CAP>(a, pr, stream);
  } else {
    if (a.dq_accum != nullptr) return launch_tc_dkdv<D, 8, 64, true, CAP>(a, pr, stream);  // fused, dQ by atomics
    launch_tc_dkdv<D, 4, 64, false, CAP>(a, pr, stream);
    launch_tc_dq<D, 4, 64, CAP>(a, pr, stream);
  }
}
template <bool CAP> void mma_backward_cap(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream) {
  if (pr.D == 64) mma_backward_at<64, CAP>(a, pr, stream);
  else if (pr.D == 128) mma_backward_at<128, CAP>(a, pr, stream);
  else mma_backward_at<256, CAP>(a, pr, stream);
}

}  // namespace

void mma_forward(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream) {
  if (pr.softcap > 0.0f) mma_forward_at<true>(a, pr, stream);
  else mma_forward_at<false>(a, pr, stream);
}

void mma_backward(const Operands<bf16_t>& a, const Problem& pr, cudaStream_t stream) {
  if (pr.softcap > 0.0f) mma_backward_cap<true>(a, pr, stream);
  else mma_backward_cap<false>(a, pr, stream);
}

}  // namespace cw::gpu::flash
