// The backward pass on Hopper (sm_90a only), fp16 / bf16 inputs, fp32 accumulation:
// FlashAttention-2's backward (Dao, arXiv 2307.08691, Sec. 3.2 and Algorithm 2) on the Hopper
// machinery of FlashAttention-3 (Shah et al., arXiv 2407.08608): TMA copies into 128-byte
// swizzled shared memory, completed on mbarriers, and warpgroup MMA (common/wgmma.cuh).
//
// One CTA per (key block of 128 keys, 64 at hd256; KV head, batch), three warpgroups (FlashAttention-3's
// warp specialisation): two consumer warpgroups of 64 keys each compute; warpgroup 2's warp 0
// issues every copy and its warp 1 adds dQ (setmaxnreg moves registers to the consumers). K and
// V stay in shared memory; a ring of kStages slots carries the Q and dO tiles of query steps of
// kBlockM rows (128 at hd64, 64 at hd128 and hd256), one step per (query head of the group, query block
// that sees the keys). Step j, per consumer warpgroup (its 64 keys as rows):
//   S^T = K Q^T, dP^T = V dO^T                        (wgmma, both operands from smem)
//   P^T = exp2(S^T c - LSE log2 e), dS^T = P^T (dP^T - D)   (registers; common/bwd_tile.cuh)
//   dV += P^T dO, dK += dS^T Q                        (A from registers, as the forward's P V)
//   dS^T -> shared memory, then its part of dQ = dS K (both operands transposed: ss_tt; rows
//   half w at hd64, columns half w at hd128) into its half of the step's dQ tile in shared
//   memory (DqTile), which the writer warp adds to an fp32 accumulator in global memory by a
//   bulk reduction (cp.reduce.async.bulk .add.f32); dq_convert_entry scales and rounds it.
// At hd256 dK and dV of 64 keys do not fit one warpgroup's registers: a CTA takes 64 keys, its
// two consumer warpgroups split the head dim (bwd_consumer_split: S^T over half the step's
// queries each, P^T and dS^T through shared memory, dQ added from registers; no writer warp).
// So dK and dV are summed in registers over the query heads of a GQA group (no atomics), dQ
// over the key blocks by reductions in L2, in an order that varies from run to run; DETERMINISTIC
// fixes it (FlashAttention-3's semaphores, flash-attention PR 1893): the key blocks add to a
// query block's dQ one after the other, each waiting for its turn on a counter per (batch, query
// head, query block) that the previous one increments (DqTurns below); only the writer warp
// waits for it (at hd256 a thread of each consumer warpgroup, on its warpgroup's own counter).
//
// The producer (bwd_producer) copies K and V once, then each step's Q and dO tiles and the LSE
// and D of its rows (written padded per 64-row block by the pre-pass, bwd_hopper_prep_entry, so
// that no thread waits on a global load inside a step) into its slot, once the consumers have
// released the slot's previous step (the ring's "empty" mbarriers, common/pipeline.cuh). The
// consumer warpgroups meet once per step, on a named barrier (kBarDs: both halves of dS^T
// written), and hand each dQ half to the writer and back through named barriers.
// Dense problems only (the tensor maps end at each sequence's length, so TMA zero-fills rows
// past it; a varlen problem runs the mma.sync kernels).
#include "common/dtype.cuh"
#include "common/params.cuh"
#include "common/mask.cuh"
#include "common/mma.cuh"
#include "common/wgmma.cuh"
#include "common/tma.cuh"
#include "common/pipeline.cuh"
#include "common/softmax_step.cuh"
#include "common/fwd_tile.cuh"
#include "common/bwd_tile.cuh"

namespace cf {

template <typename T, int HEADDIM>
struct HopperBwdTraits {
    static constexpr int kHeadDim = HEADDIM;
    // query rows per step: 128 at hd64 (FlashAttention-3's tile there: a step's GEMMs as large
    // as hd128's, half the steps and barriers), 64 at hd128 (registers)
    static constexpr int kBlockM = HEADDIM == 64 ? 128 : 64;
    // hd256 (kSplitD): dK and dV of 64 keys at every column are 256 floats per thread, more than
    // the registers; so a CTA takes 64 keys, both consumer warpgroups the same ones, and
    // warpgroup w owns head-dim columns [128 w, 128 w + 128) of dK, dV and dQ, and the step's
    // query columns [32 w, 32 w + 32) of S^T and dP^T; P^T and dS^T go through shared memory
    // (FlashAttention-3's hd256 layout: its dQ is added from registers too)
    static constexpr bool kSplitD = HEADDIM == 256;
    static constexpr int kBlockN = kSplitD ? 64 : 128;  // keys per CTA (64 per warpgroup, or 64 shared)
    // two consumer warpgroups and a producer one (its warp 0 copies, warp 1 adds dQ)
    static constexpr int kConsumerThreads = 256;
    static constexpr int kThreads = kConsumerThreads + 128;
    // setmaxnreg (as the forward's): the launch's 168 registers per thread move from the producer
    // warpgroup (40) to the consumers (232); the counts add up to the CTA's 64K. FA3's 24 / 240
    // left 4-16 bytes of spills in every variant (ptxas, CUDA 13); 40 / 232 none.
    static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8;
    static constexpr int kProducerRegs = 40;
    static constexpr int kConsumerRegs = 232;
    static constexpr int kStages = HEADDIM == 128 ? 3 : 2;  // Q / dO ring (shared memory)
    static constexpr int kQBytes = kBlockM * HEADDIM * 2;   // one Q or dO tile
    static constexpr int kKBytes = kBlockN * HEADDIM * 2;   // the K or V tile
    static constexpr int kDSBytes = kBlockN * kBlockM * 2;  // dS^T, [kBlockN keys][kBlockM queries]
    // a step's buffer in shared memory: dS^T, after P^T when kSplitD
    static constexpr int kPSBytes = (kSplitD ? 2 : 1) * kDSBytes;
    static constexpr int kStatsBytes = 2 * kBlockM * 4;     // LSE log2(e) and D of a step's rows
    static constexpr int kSCols = kSplitD ? kBlockM / 2 : kBlockM;  // S^T columns per warpgroup
    static constexpr int kSAcc = kSCols / 2;        // S^T floats per thread (64 keys x kSCols)
    static constexpr int kDCols = kSplitD ? HEADDIM / 2 : HEADDIM;  // dK, dV columns per warpgroup
    static constexpr int kAcc = kDCols / 2;         // dK, dV floats per thread (64 keys x kDCols)
    // dQ of a step: warpgroup w computes query rows [64 w, 64 w + 64) at every column when a
    // step has 128 rows (kDqRows), else the 64 rows at columns [64 w, 64 w + 64) (hd128)
    // (kSplitD: columns [128 w, 128 w + 128) in two GEMMs of 64 columns, kQN)
    static constexpr bool kDqRows = kBlockM == 128;
    static constexpr int kQN = (kDqRows && !kSplitD) ? HEADDIM : 64;  // dQ columns per GEMM
    static constexpr int kQAcc = kQN / 2;           // dQ floats per thread (64 rows x kQN)
    static constexpr int kHdSteps = HEADDIM / 16;   // k16 steps of S^T and dP^T
    static constexpr int kMSteps = kBlockM / 16;    // k16 steps of dV and dK (queries)
    static constexpr int kSSteps = kSCols / 16;     // k16 steps in a warpgroup's P^T, dS^T
    static constexpr int kNSteps = kBlockN / 16;    // k16 steps of dQ (keys)
    static_assert(sizeof(T) == 2, "wgmma path is for 16-bit inputs");
    static_assert(HEADDIM == 64 || HEADDIM == 128 || HEADDIM == 256,
                  "compiled head dims: 64, 128, 256");
    static_assert(kQN == 64, "dQ: one 64-column swizzle span of K per warpgroup");
    static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads == kLaunchRegs * kThreads,
                  "setmaxnreg: the counts add up to the launch's registers");
};

// The shared memory, its one definition (cupyflash/backward/kernels.py reads kBytes through an
// NVRTC probe): from a 1024-byte aligned base (the swizzle repeat) K, V, the Q ring, the dO
// ring, two dS^T buffers (step j writes buffer j & 1: the other warpgroup may still read the
// previous one; each [kBlockN keys][64 queries] blocks of 128-byte rows, one per 64 query
// columns; kSplitD: P^T, then dS^T), the ring of the steps' row statistics
// (bwd_hopper_prep_entry), the dQ tile of a step (fp32, DqTile; none when kSplitD), the
// mbarriers; + 1024 bytes to align the base.
template <typename Tr>
struct HopperBwdSmem {
    static constexpr int S = Tr::kStages;
    static constexpr uint32_t kK = 0;
    static constexpr uint32_t kV = kK + Tr::kKBytes;
    static constexpr uint32_t kQ = kV + Tr::kKBytes;
    static constexpr uint32_t kDO = kQ + S * Tr::kQBytes;
    static constexpr uint32_t kDS = kDO + S * Tr::kQBytes;
    static constexpr uint32_t kStats = kDS + 2 * Tr::kPSBytes;
    static constexpr uint32_t kDQ = kStats + S * Tr::kStatsBytes;
    static constexpr uint32_t kKVFull = kDQ + (Tr::kSplitD ? 0 : Tr::kBlockM * Tr::kHeadDim * 4);
    static constexpr uint32_t kFull = kKVFull + 8;   // per ring slot: its copies have landed
    static constexpr uint32_t kEmpty = kFull + 8 * S;  // per ring slot: the consumers are done
    static constexpr int kBytes = (int)kEmpty + 8 * S + 1024;
    static_assert(kBytes <= 227 * 1024, "shared memory of the configuration");
};

// Where step j of a CTA works: query head h, query rows [m0, m0 + 64).
struct BwdStep {
    int h, m0;
};

template <typename Tr>
__device__ __forceinline__ BwdStep bwd_step(int j, int n_m, int m_block_min, int hk, int h_per_kv) {
    return BwdStep{hk * h_per_kv + j / n_m, (m_block_min + j % n_m) * Tr::kBlockM};
}

// The GEMMs of warpgroup w (descriptors: common/wgmma.cuh; k-step and slot offsets are added to
// the address field in 16-byte units).
template <typename T, typename Tr, int HEADDIM = Tr::kHeadDim>
struct BwdGemms {
    uint32_t k_rows, v_rows;   // this warpgroup's 64 keys of K and V (K-major A of S^T, dP^T)
    uint32_t q0, do0, ds0;     // the first Q, dO slots and dS^T buffer
    uint32_t ds_rows;          // this warpgroup's dQ rows in a dS^T buffer (64 query columns)
    uint32_t k_cols;           // K as the MN-major B of dQ: this warpgroup's kQN columns

    __device__ __forceinline__ BwdGemms(uint32_t base, int w) {
        using L = HopperBwdSmem<Tr>;
        k_rows = base + L::kK + (uint32_t)(w * 64 * 128);
        v_rows = base + L::kV + (uint32_t)(w * 64 * 128);
        q0 = base + L::kQ;
        do0 = base + L::kDO;
        ds0 = base + L::kDS;
        // kDqRows: query block w of the dS^T buffer and every column of K; else all 64 query
        // rows and K's column tile w
        ds_rows = Tr::kDqRows ? (uint32_t)(w * Tr::kBlockN * 128) : 0u;
        k_cols = base + L::kK + (Tr::kDqRows ? 0u : (uint32_t)(w * Tr::kBlockN * 128));
    }
    // S^T (64 keys x kSCols queries) = A B^T of a 64-row K-major A (keys) and a kSCols-row B
    // (queries)
    static __device__ __forceinline__ void scores(float (&s)[Tr::kSAcc], uint32_t a_rows,
                                                  uint32_t b_rows) {
        const uint64_t a = wgmma_desc_sw128(a_rows, 16, 1024);
        const uint64_t b = wgmma_desc_sw128(b_rows, 16, 1024);
#pragma unroll
        for (int ks = 0; ks < Tr::kHdSteps; ++ks) {
            const uint64_t ao = (uint64_t)(((ks >> 2) * Tr::kBlockN * 128 + (ks & 3) * 32) >> 4);
            const uint64_t bo = (uint64_t)(((ks >> 2) * Tr::kBlockM * 128 + (ks & 3) * 32) >> 4);
            Wgmma<T, Tr::kSCols>::ss(s, a + ao, b + bo, ks > 0 ? 1 : 0);
        }
    }
    __device__ __forceinline__ void st_dpt(float (&st)[Tr::kSAcc], float (&dpt)[Tr::kSAcc],
                                           int slot) const {
        scores(st, k_rows, q0 + (uint32_t)(slot * Tr::kQBytes));
        scores(dpt, v_rows, do0 + (uint32_t)(slot * Tr::kQBytes));
        wgmma_commit();
    }
    // acc (64 keys x HEADDIM) += A (registers, 64 keys x kBlockM queries) B (a Q or dO slot,
    // MN-major)
    static __device__ __forceinline__ void acc_rs(float (&acc)[Tr::kAcc],
                                                  const uint32_t (&a)[Tr::kMSteps][4], uint32_t b_tile) {
        const uint64_t b = wgmma_desc_sw128(b_tile, (uint32_t)(Tr::kBlockM * 128), 1024);
#pragma unroll
        for (int kk = 0; kk < Tr::kMSteps; ++kk)
            Wgmma<T, HEADDIM>::rs_tn(acc, a[kk], b + (uint64_t)((kk * 16 * 128) >> 4), 1);
    }
    __device__ __forceinline__ void dv_dk(float (&dv)[Tr::kAcc], float (&dk)[Tr::kAcc],
                                          const uint32_t (&pt)[Tr::kMSteps][4],
                                          const uint32_t (&dst)[Tr::kMSteps][4], int slot) const {
        acc_rs(dv, pt, do0 + (uint32_t)(slot * Tr::kQBytes));   // dV += P^T dO
        acc_rs(dk, dst, q0 + (uint32_t)(slot * Tr::kQBytes));   // dK += dS^T Q
        wgmma_commit();
    }
    // dQ (64 queries x kQN) = dS K: A = dS^T buffer (MN-major: queries contiguous), B = K
    // (MN-major: head dim contiguous), k-steps over the 128 keys
    __device__ __forceinline__ void dq(float (&acc)[Tr::kQAcc], int buf) const {
        const uint64_t a = wgmma_desc_sw128(ds0 + (uint32_t)(buf * Tr::kDSBytes) + ds_rows,
                                            (uint32_t)(Tr::kBlockN * 128), 1024);
        const uint64_t b = wgmma_desc_sw128(k_cols, (uint32_t)(Tr::kBlockN * 128), 1024);
#pragma unroll
        for (int kk = 0; kk < Tr::kNSteps; ++kk) {
            const uint64_t o = (uint64_t)((kk * 16 * 128) >> 4);
            Wgmma<T, Tr::kQN>::ss_tt(acc, a + o, b + o, kk > 0 ? 1 : 0);
        }
        wgmma_commit();
    }
};

// The GEMMs of warpgroup w at hd256 (kSplitD): the CTA's 64 keys, the step's query columns
// [32 w, 32 w + 32) of S^T and dP^T, head-dim columns [128 w, 128 w + 128) of dV and dK, and
// dQ's in two GEMMs of 64 columns.
template <typename T, typename Tr>
struct BwdGemmsSplit {
    uint32_t k0, v0;         // K and V (the 64 keys: K-major A of S^T, dP^T)
    uint32_t q_rows, do_rows;  // this warpgroup's 32 rows of the first Q, dO slots (B of S^T, dP^T)
    uint32_t q_cols, do_cols;  // its 128 columns of the first Q, dO slots (MN-major B of dK, dV)
    uint32_t ps0;            // the first P^T, dS^T buffer

    __device__ __forceinline__ BwdGemmsSplit(uint32_t base, int w) {
        using L = HopperBwdSmem<Tr>;
        k0 = base + L::kK;
        v0 = base + L::kV;
        q_rows = base + L::kQ + (uint32_t)(w * Tr::kSCols * 128);
        do_rows = base + L::kDO + (uint32_t)(w * Tr::kSCols * 128);
        q_cols = base + L::kQ + (uint32_t)(2 * w * Tr::kBlockM * 128);
        do_cols = base + L::kDO + (uint32_t)(2 * w * Tr::kBlockM * 128);
        ps0 = base + L::kDS;
    }
    __device__ __forceinline__ void st_dpt(float (&st)[Tr::kSAcc], float (&dpt)[Tr::kSAcc],
                                           int slot) const {
        BwdGemms<T, Tr>::scores(st, k0, q_rows + (uint32_t)(slot * Tr::kQBytes));
        BwdGemms<T, Tr>::scores(dpt, v0, do_rows + (uint32_t)(slot * Tr::kQBytes));
        wgmma_commit();
    }
    // acc (64 keys x 128 columns) += A (a 64 x 64 buffer in shared memory, K-major: queries
    // contiguous) B (128 columns of a Q or dO slot, MN-major)
    static __device__ __forceinline__ void acc_ss(float (&acc)[Tr::kAcc], uint32_t a_tile,
                                                  uint32_t b_tile) {
        const uint64_t a = wgmma_desc_sw128(a_tile, 16, 1024);
        const uint64_t b = wgmma_desc_sw128(b_tile, (uint32_t)(Tr::kBlockM * 128), 1024);
#pragma unroll
        for (int kk = 0; kk < Tr::kMSteps; ++kk)
            Wgmma<T, Tr::kDCols>::ss_tn(acc, a + (uint64_t)((kk * 32) >> 4),
                                        b + (uint64_t)((kk * 16 * 128) >> 4), 1);
    }
    __device__ __forceinline__ void dv_dk(float (&dv)[Tr::kAcc], float (&dk)[Tr::kAcc], int buf,
                                          int slot) const {
        const uint32_t ps = ps0 + (uint32_t)(buf * Tr::kPSBytes);
        acc_ss(dv, ps, do_cols + (uint32_t)(slot * Tr::kQBytes));                 // dV += P^T dO
        acc_ss(dk, ps + Tr::kDSBytes, q_cols + (uint32_t)(slot * Tr::kQBytes));   // dK += dS^T Q
        wgmma_commit();
    }
    // dQ (64 queries x 64 columns [64 c, 64 c + 64)) = dS K: A = the dS^T buffer (MN-major:
    // queries contiguous), B = K's column tile c (MN-major), k-steps over the 64 keys
    __device__ __forceinline__ void dq(float (&acc)[Tr::kQAcc], int buf, int c) const {
        const uint64_t a = wgmma_desc_sw128(ps0 + (uint32_t)(buf * Tr::kPSBytes + Tr::kDSBytes),
                                            (uint32_t)(Tr::kBlockN * 128), 1024);
        const uint64_t b = wgmma_desc_sw128(k0 + (uint32_t)(c * Tr::kBlockN * 128),
                                            (uint32_t)(Tr::kBlockN * 128), 1024);
#pragma unroll
        for (int kk = 0; kk < Tr::kNSteps; ++kk) {
            const uint64_t o = (uint64_t)((kk * 16 * 128) >> 4);
            Wgmma<T, Tr::kQN>::ss_tt(acc, a + o, b + o, kk > 0 ? 1 : 0);
        }
        wgmma_commit();
    }
};

// One 16-byte reduction into global memory (sm_90: red with a vector type).
__device__ __forceinline__ void red_add_v4_f32(float4* p, float a, float b, float c, float d) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(p), "f"(a), "f"(b),
                 "f"(c), "f"(d) : "memory");
}

// hd256's dQ tile of a step (64 query rows x 256, fp32) as dq_accum stores it per (batch, query
// head, query block), added to from registers (red.global.add.v4.f32): float4 number
// (8 c + i) 128 + u holds thread u of the warpgroup that computed column tile c (64 columns,
// c = 2 w + half): dq[4 i .. 4 i + 3], rows r = 16 (u >> 5) + ((u >> 2) & 7) and r + 8,
// columns 64 c + 8 i + 2 (u & 3) + {0, 1}. A warp's reductions are 512 contiguous bytes.
template <typename Tr>
struct DqTileSplit {
    static constexpr int kFloats = Tr::kBlockM * Tr::kHeadDim;
    static constexpr int kN8 = Tr::kQN / 8;  // float4 per thread and column tile

    // this thread's part of column tile c into the tile at `acc` (global memory)
    static __device__ __forceinline__ void add(float* acc, const float (&dq)[Tr::kQAcc], int c,
                                               int u) {
        float4* tile = reinterpret_cast<float4*>(acc) + c * kN8 * 128 + u;
#pragma unroll
        for (int i = 0; i < kN8; ++i)
            red_add_v4_f32(tile + i * 128, dq[4 * i], dq[4 * i + 1], dq[4 * i + 2], dq[4 * i + 3]);
    }
    // the first row and column of float4 number e of a tile (the others: + 1 column, + 8 rows)
    static __device__ __forceinline__ void position(int e, int& row, int& col) {
        const int u = e & 127, ci = e >> 7, c = ci / kN8, i = ci % kN8;
        row = 16 * (u >> 5) + ((u >> 2) & 7);
        col = Tr::kQN * c + 8 * i + 2 * (u & 3);
    }
};

// The dQ tile of a step (kBlockM query rows x HEADDIM, fp32) in fragment order, as the CTA's
// shared memory holds it and as dq_accum stores it per (batch, query head, query block): float2
// number (w kPairs + k) 128 + u holds thread u of warpgroup w's dq[4 (k >> 1) + 2 (k & 1) + {0,
// 1}], the row 16 (u >> 5) + ((u >> 2) & 7) + 8 (k & 1) and columns 8 (k >> 1) + 2 (u & 3) +
// {0, 1} of warpgroup w's part (kDqRows: + 64 w to the row, else + kQN w to the column).
// Consecutive threads write consecutive float2 (no bank conflicts); the tile is one contiguous
// run, each warpgroup's part half of it: one bulk reduction adds either.
template <typename Tr>
struct DqTile {
    static constexpr int kPairs = Tr::kQAcc / 2;  // float2 per thread
    static constexpr int kFloats = Tr::kBlockM * Tr::kHeadDim;
    static constexpr int kBytes = kFloats * 4;

    static __device__ __forceinline__ void store(float2* tile, const float (&dq)[Tr::kQAcc], int w,
                                                 int u) {
#pragma unroll
        for (int k = 0; k < kPairs; ++k) {
            const int e = 4 * (k >> 1) + 2 * (k & 1);
            tile[(w * kPairs + k) * 128 + u] = make_float2(dq[e], dq[e + 1]);
        }
    }
    // the row and first column of float2 number e of a tile
    static __device__ __forceinline__ void position(int e, int& row, int& col) {
        const int u = e & 127, wk = e >> 7, w = wk / kPairs, k = wk % kPairs;
        row = (Tr::kDqRows ? 64 * w : 0) + 16 * (u >> 5) + ((u >> 2) & 7) + 8 * (k & 1);
        col = (Tr::kDqRows ? 0 : w * Tr::kQN) + 8 * (k >> 1) + 2 * (u & 3);
    }
};

// The order in which the key blocks add to a query block's dQ when DETERMINISTIC: descending
// key blocks when causal (a key block reaches query block m after the key blocks nearer the
// diagonal did, at the same step count: the order in which they arrive anyway), ascending
// otherwise. A key block waits only for key blocks launched before it: the grid's x index runs
// the key blocks in that order (bwd_key_block). One counter per (batch, query head, query
// block; hd256: per consumer warpgroup, kPerTile), int32, after the dq_accum tiles, zeroed with
// them; key block n's turn at query block m is its rank among the key blocks that see m (an
// interval of key blocks, found by bisection over the same QueryTiles the CTAs walk, so the
// count cannot disagree with what they do).
template <typename Tr, bool CAUSAL>
struct DqTurns {
    // hd256 (kSplitD): one counter per consumer warpgroup (each adds its own 128 columns)
    static constexpr int kPerTile = Tr::kSplitD ? 2 : 1;
    int* counters;   // of this (batch, query head 0): + (h * n_m_total + m) kPerTile + w
    int n_blocks, n_m_total;
    int seqlen_q, seqlen_k, window_left, window_right;

    __device__ __forceinline__ bool sees(int n, int m) const {
        const QueryTiles<Tr::kBlockM> qt(n * Tr::kBlockN, min((n + 1) * Tr::kBlockN, seqlen_k) - 1,
                                         seqlen_q, seqlen_k, CAUSAL, window_left, window_right);
        return qt.m_block_min <= m && m < qt.m_block_max;
    }
    // key block n's turn at query block m (n sees m)
    __device__ __forceinline__ int rank(int n, int m) const {
        if (CAUSAL) {  // descending: the key blocks above n that see m go first
            int lo = n, hi = n_blocks;  // sees(lo, m); the first block above n that does not: in (lo, hi]
            while (hi - lo > 1) {
                const int mid = (lo + hi) >> 1;
                if (sees(mid, m)) lo = mid; else hi = mid;
            }
            return lo - n;
        }
        int lo = -1, hi = n;  // ascending: the first block that sees m, in (lo, hi]
        while (hi - lo > 1) {
            const int mid = (lo + hi) >> 1;
            if (sees(mid, m)) hi = mid; else lo = mid;
        }
        return n - hi;
    }
    __device__ __forceinline__ int* counter(int h, int m0, int w = 0) const {
        return counters + ((int64_t)h * n_m_total + m0 / Tr::kBlockM) * kPerTile + w;
    }
};

__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// The key block of CTA blockIdx.x: reversed when DETERMINISTIC and causal, so that the key
// blocks a CTA waits for (DqTurns: those above it) were launched before it.
template <typename Tr, bool CAUSAL, bool DETERMINISTIC>
__device__ __forceinline__ int bwd_key_block() {
    return (DETERMINISTIC && CAUSAL) ? (int)gridDim.x - 1 - (int)blockIdx.x : (int)blockIdx.x;
}

// The pre-pass's blocks of row statistics (kernels.stats_shape): per 64 query rows of (batch,
// head) 128 floats, LSE log2(e) of the rows, then their D; the blocks of a step (kBlockM / 64)
// are consecutive, and the buffer is padded to 128 rows so that a step never reads past it.
constexpr int kStatsRows = 64;

// LSE log2(e) and D of this thread's query columns 8 i + 2 t + {0, 1} of a step, from its ring
// slot (`smem`: bwd_hopper_prep_entry's blocks of 64 rows, LSE log2(e) then D). 64-row steps
// read them into registers before the scores' wait, so that the loads overlap the GEMMs (4-10% of
// hd128's time on an H100 when read after it, 2026-12-06); 128-row steps (32 + 32 registers
// more) read them where they are used.
template <typename Tr>
struct BwdStats {
    static constexpr bool kEarly = Tr::kBlockM == 64;
    static constexpr int kN = kEarly ? Tr::kSAcc / 4 : 1;
    const float* smem;
    float2 lse2[kN], dsum[kN];

    __device__ __forceinline__ BwdStats(const float* s, int t) : smem(s) {
        if constexpr (kEarly) {
#pragma unroll
            for (int i = 0; i < kN; ++i) read(i, t, lse2[i], dsum[i]);
        }
    }
    __device__ __forceinline__ void read(int i, int t, float2& l, float2& d) const {
        const int q = 8 * i + 2 * t;  // the step's query column of e = 0
        const float* blk = smem + (q / kStatsRows) * (2 * kStatsRows) + q % kStatsRows;
        l = *reinterpret_cast<const float2*>(blk);
        d = *reinterpret_cast<const float2*>(blk + kStatsRows);
    }
    __device__ __forceinline__ void get(int i, int t, float2& l, float2& d) const {
        if constexpr (kEarly) l = lse2[i], d = dsum[i];
        else read(i, t, l, d);
    }
};

// P^T and dS^T of one step in place (st -> P^T, dpt -> dS^T), for this thread's keys (rows
// key0 + 8 (e >> 1)) and queries (columns m0 + 8 i + 2 t + (e & 1)); LSE log2(e) and D of the
// columns from `stats`.
template <typename Tr, bool CAUSAL>
__device__ __forceinline__ void bwd_probs(float (&st)[Tr::kSAcc], float (&dpt)[Tr::kSAcc],
                                          const BwdStats<Tr>& stats, bool mask, int key0, int m0,
                                          int t, int seqlen_q, int seqlen_k, const FwdParams& f) {
    // the mask by key (two per thread): the step's columns that see it, [lo, hi) - 2 t
    int lo[2], hi[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const KeyRange r = visible_queries(key0 + 8 * hh, seqlen_q, seqlen_k, CAUSAL,
                                           f.window_left, f.window_right);
        lo[hh] = max(r.lo, m0 - 1) - m0 - 2 * t;  // (clamped: no overflow)
        hi[hh] = min(r.hi, m0 + Tr::kBlockM + 1) - m0 - 2 * t;
    }
#pragma unroll
    for (int i = 0; i < Tr::kSAcc / 4; ++i) {
        float2 lse2, dsum;
        stats.get(i, t, lse2, dsum);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int idx = 4 * i + e;
            float pr = exp2f(fmaf(st[idx], f.scale_log2, -((e & 1) ? lse2.y : lse2.x)));
            const int c = 8 * i + (e & 1);  // the column, less 2 t
            if (mask && !(c >= lo[e >> 1] && c < hi[e >> 1])) pr = 0.f;
            st[idx] = pr;
            dpt[idx] = pr * (dpt[idx] - ((e & 1) ? dsum.y : dsum.x));
        }
    }
}

// dS^T (packed A fragments of this thread) into buffer `buf` (per 64 query columns a block of
// [kBlockN keys][64 queries], 128-byte rows, 16-byte chunk c of row r at c ^ (r & 7): the layout
// TMA would leave and ss_tt reads), from query column 16 kk0 (kSplitD: P^T too, the same way).
template <typename Tr>
__device__ __forceinline__ void store_ds(unsigned char* buf, const uint32_t (&dsf)[Tr::kSSteps][4],
                                         int key_row0, int t, int kk0 = 0) {
#pragma unroll
    for (int kk = 0; kk < Tr::kSSteps; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            // A fragment e of k-step kk: columns 16 kk + 8 (e >> 1) + 2 t, rows + 8 (e & 1)
            const int r = key_row0 + 8 * (e & 1), col16 = 2 * (kk0 + kk) + (e >> 1);
            const int blk = col16 >> 3, chunk = col16 & 7;
            *reinterpret_cast<uint32_t*>(buf + blk * Tr::kBlockN * 128 + r * 128 +
                                         ((chunk ^ (r & 7)) << 4) + 4 * t) = dsf[kk][e];
        }
}

// The first of a step's blocks of row statistics in the pre-pass's buffer (kStatsRows).
__device__ __forceinline__ float* bwd_stats_block(const BwdParams& p, int b, int h, int row0) {
    return static_cast<float*>(p.dsum) + b * p.dsum_batch_stride + h * p.dsum_head_stride +
           (row0 / kStatsRows) * (2 * kStatsRows);
}

// The Q / dO ring's barriers (common/pipeline.cuh): slot s's "full" completes once per use when
// its step's copies have landed, its "empty" once per use when the consumers' 8 warps are done
// with it. Step j uses slot j % kStages; producer and consumers walk it with a PipelineState.
template <typename Tr>
__device__ __forceinline__ MbarRing<Tr::kStages> bwd_ring(uint32_t base) {
    using L = HopperBwdSmem<Tr>;
    return MbarRing<Tr::kStages>{base + L::kFull, base + L::kEmpty};
}

// The named barriers of the kernel (id 0 is __syncthreads'); the dQ barriers count a consumer
// warpgroup and the writer warp.
enum HopperBwdBarrier : int {
    kBarDs = 1,       // both consumer warpgroups have written the step's dS^T (hd256: and P^T)
    kBarDqFull = 2,   // + w: consumer warpgroup w's half of the dQ tile is written (2, 3)
    kBarDqEmpty = 4,  // + w: the writer's reduction has read that half (4, 5)
    // hd256 (kSplitD), DETERMINISTIC: consumer warpgroup w may add its dQ; at the end, it has
    // (6, 7: 128 threads)
    kBarTurn = 6,
};
constexpr int kBwdDqBarThreads = 128 + 32;

// Step j's S^T = K Q^T and dP^T = V dO^T issued, once its slot's copies have landed.
template <typename Tr, typename Gemms>
__device__ __forceinline__ void bwd_scores(const Gemms& gemm, float (&st)[Tr::kSAcc],
                                           float (&dpt)[Tr::kSAcc], uint32_t base,
                                           const PipelineState<Tr::kStages>& ring_st) {
    bwd_ring<Tr>(base).consumer_wait(ring_st);
    wgmma_fence();
    gemm.st_dpt(st, dpt, ring_st.slot);
}

// The producer warp's lane 0: K and V of the key block once, then the Q and dO tiles of each
// step and its rows' statistics into slot j % kStages, once the consumers released the slot's
// previous step (j - kStages).
template <typename Tr>
__device__ __forceinline__ void bwd_producer(const BwdTmaParams& P, uint32_t base, int n_steps,
                                             int n_m, int m_block_min, int n0, int hk, int b) {
    using L = HopperBwdSmem<Tr>;
    const BwdParams& p = P.bwd;
    if (n_steps == 0) return;
    tma_prefetch_desc(&P.tq);
    tma_prefetch_desc(&P.tk);
    tma_prefetch_desc(&P.tv);
    tma_prefetch_desc(&P.tdo);
    const uint32_t kv_full = base + L::kKVFull;
    mbarrier_arrive_expect_tx(kv_full, 2 * Tr::kKBytes);
#pragma unroll
    for (int c = 0; c < Tr::kHeadDim / 64; ++c) {
        const uint32_t off = (uint32_t)(c * Tr::kBlockN * 128);
        tma_load_4d(base + L::kK + off, &P.tk, c * 64, hk, n0, b, kv_full);
        tma_load_4d(base + L::kV + off, &P.tv, c * 64, hk, n0, b, kv_full);
    }
    const MbarRing<Tr::kStages> ring = bwd_ring<Tr>(base);
    // (the producer's first round over the ring passes at once: common/pipeline.cuh)
    PipelineState<Tr::kStages> ps = producer_start<Tr::kStages>();
    for (int j = 0; j < n_steps; ++j, ps.advance()) {
        ring.producer_acquire(ps);
        const BwdStep st = bwd_step<Tr>(j, n_m, m_block_min, hk, p.fwd.h_per_kv);
        ring.producer_expect(ps, 2 * Tr::kQBytes + Tr::kStatsBytes);
        const uint32_t full = ring.full(ps.slot);
        bulk_load(base + L::kStats + (uint32_t)(ps.slot * Tr::kStatsBytes),
                  bwd_stats_block(p, b, st.h, st.m0), Tr::kStatsBytes, full);
#pragma unroll
        for (int c = 0; c < Tr::kHeadDim / 64; ++c) {
            const uint32_t off = (uint32_t)(ps.slot * Tr::kQBytes + c * Tr::kBlockM * 128);
            tma_load_4d(base + L::kQ + off, &P.tq, c * 64, st.h, st.m0, b, full);
            tma_load_4d(base + L::kDO + off, &P.tdo, c * 64, st.h, st.m0, b, full);
        }
    }
}

// The dQ writer warp: per step, each consumer warpgroup's half of the dQ tile, once written
// (kBarDqFull + w), added to the query block's tile of dq_accum by a bulk reduction
// (cp.reduce.async.bulk .add.f32, issued by lane 0: the additions leave the consumers' path);
// the half is handed back (kBarDqEmpty + w) once the reduction has read it. DETERMINISTIC, lane 0
// first waits for this key block's turn at the query block (DqTurns), and passes it on once
// both reductions have completed (after the hand-back, so that the consumers do not wait for
// the L2 round trip). No deadlock: passing turn j needs only turn j, which the key blocks before
// this one pass on the same terms (induction over DqTurns's order).
template <typename Tr, bool CAUSAL, bool DETERMINISTIC>
__device__ __forceinline__ void bwd_dq_writer(const BwdParams& p, uint32_t base, int lane,
                                              int n_steps, int n_m, int m_block_min, int n_block,
                                              int hk, int b) {
    using L = HopperBwdSmem<Tr>;
    const FwdParams& f = p.fwd;
    constexpr int kHalf = DqTile<Tr>::kBytes / 2;
    const int n_m_total = (f.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
    const int64_t tiles = (int64_t)f.nheads * n_m_total;  // dq_accum tiles of a batch entry
    float* dq_accum = p.dq_accum + b * tiles * DqTile<Tr>::kFloats;
    const DqTurns<Tr, CAUSAL> turns{  // the counters follow the tiles of every batch entry
        reinterpret_cast<int*>(p.dq_accum + f.batch * tiles * DqTile<Tr>::kFloats) + b * tiles,
        (int)gridDim.x, n_m_total, f.seqlen_q, f.seqlen_k, f.window_left, f.window_right};
    for (int j = 0; j < n_steps; ++j) {
        const BwdStep stp = bwd_step<Tr>(j, n_m, m_block_min, hk, f.h_per_kv);
        float* dst = dq_accum + ((int64_t)stp.h * n_m_total + stp.m0 / Tr::kBlockM) * DqTile<Tr>::kFloats;
        int* turn = turns.counter(stp.h, stp.m0);
#pragma unroll
        for (int w = 0; w < 2; ++w) {
            named_barrier_sync(kBarDqFull + w, kBwdDqBarThreads);
            if (lane == 0) {
                if (DETERMINISTIC && w == 0) {  // this key block's turn at the query block
                    const int my = turns.rank(n_block, stp.m0 / Tr::kBlockM);
                    while (ld_acquire_gpu(turn) != my) __nanosleep(32);
                    fence_proxy_async_all();  // the acquire before the reductions (async proxy)
                }
                bulk_reduce_add_f32(dst + w * (DqTile<Tr>::kFloats / 2),
                                    base + L::kDQ + (uint32_t)(w * kHalf), kHalf);
                bulk_commit_group();
            }
            __syncwarp();  // (bar.sync is .aligned: the warp converged before the next one)
        }
        if (lane == 0) bulk_wait_group_read<0>();
        __syncwarp();
        if (j + 1 < n_steps) {  // the consumers wait for these from their second step on
            named_barrier_arrive(kBarDqEmpty, kBwdDqBarThreads);
            named_barrier_arrive(kBarDqEmpty + 1, kBwdDqBarThreads);
        }
        if (DETERMINISTIC && lane == 0) {  // the reductions complete, then the next key block's turn
            bulk_wait_group<0>();
            fence_proxy_async_all();  // the reductions' writes (async proxy) before the release
            red_release_gpu_add(turn, 1);
        }
    }
    if (lane == 0) bulk_wait_group<0>();  // the last reductions, before the CTA's memory goes
}

// The epilogue: dK = softmax_scale dS^T Q and dV of this thread's keys key0 + {0, 8} (columns
// from col0), rounded to T (zeros for keys no query saw).
template <typename T, typename Tr>
__device__ __forceinline__ void bwd_store_dk_dv(const BwdParams& p, const float (&dk)[Tr::kAcc],
                                                const float (&dv)[Tr::kAcc], int b, int hk,
                                                int key0, int t, int col0 = 0) {
    const FwdParams& f = p.fwd;
    const BwdSeq s0 = bwd_seq(p, b, hk * f.h_per_kv);
    const float scale = (float)f.softmax_scale_d;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int key = key0 + 8 * hh;
        if (key >= f.seqlen_k) continue;
        T* dk_row = static_cast<T*>(p.dk) + s0.dk_off + (int64_t)key * p.dk_row_stride;
        T* dv_row = static_cast<T*>(p.dv) + s0.dv_off + (int64_t)key * p.dv_row_stride;
#pragma unroll
        for (int i = 0; i < Tr::kAcc / 4; ++i) {
            const int col = col0 + 8 * i + 2 * t, idx = 4 * i + 2 * hh;
            if (col >= f.headdim) continue;
            *reinterpret_cast<uint32_t*>(dk_row + col) = pack2<T>(dk[idx] * scale, dk[idx + 1] * scale);
            *reinterpret_cast<uint32_t*>(dv_row + col) = pack2<T>(dv[idx], dv[idx + 1]);
        }
    }
}

// Consumer warpgroup w (0 or 1; its 64 keys of the block): every step of the query blocks that
// see its keys, then its dK and dV (bwd_store_dk_dv).
template <typename T, typename Tr, bool CAUSAL>
__device__ __forceinline__ void bwd_consumer(const BwdParams& p, uint32_t base, unsigned char* raw,
                                             int w, int tid, int n_steps, int n_m,
                                             int m_block_min, int n0, int hk, int b) {
    using L = HopperBwdSmem<Tr>;
    const FwdParams& f = p.fwd;
    const int lane = tid & 31, warp_in_wg = (tid >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    const int seqlen_q = f.seqlen_q, seqlen_k = f.seqlen_k;
    const BwdGemms<T, Tr> gemm(base, w);
    const MbarRing<Tr::kStages> ring = bwd_ring<Tr>(base);
    const int key_row0 = w * 64 + warp_in_wg * 16 + g;  // this thread's keys: + 0, + 8
    float dk[Tr::kAcc], dv[Tr::kAcc];
#pragma unroll
    for (int i = 0; i < Tr::kAcc; ++i) dk[i] = dv[i] = 0.f;
    if (n_steps > 0) mbarrier_wait(base + L::kKVFull, 0u);
    PipelineState<Tr::kStages> ring_st = consumer_start<Tr::kStages>();
    for (int j = 0; j < n_steps; ++j, ring_st.advance()) {
        const int slot = ring_st.slot, buf = j & 1;
        const BwdStep stp = bwd_step<Tr>(j, n_m, m_block_min, hk, f.h_per_kv);
        // S^T = K Q^T, dP^T = V dO^T (and, with 64-row steps, the LSE and D read meanwhile)
        float st[Tr::kSAcc], dpt[Tr::kSAcc];
        bwd_scores<Tr>(gemm, st, dpt, base, ring_st);
        const BwdStats<Tr> stats(reinterpret_cast<const float*>(raw + L::kStats +
                                                                slot * Tr::kStatsBytes), t);
        wgmma_wait<0>();
        wgmma_fence_operand(st);
        wgmma_fence_operand(dpt);
        // P^T = exp2(S^T c - LSE log2 e), dS^T = P^T (dP^T - D)
        const bool mask = bwd_tile_needs_mask<Tr::kBlockM, Tr::kBlockN>(f, stp.m0, n0, seqlen_q,
                                                                         seqlen_k, CAUSAL);
        bwd_probs<Tr, CAUSAL>(st, dpt, stats, mask, n0 + key_row0, stp.m0, t, seqlen_q, seqlen_k,
                              f);
        uint32_t ptf[Tr::kMSteps][4], dsf[Tr::kMSteps][4];
        pack_p<T, Tr::kSAcc / 4>(st, ptf);
        pack_p<T, Tr::kSAcc / 4>(dpt, dsf);
        // dS^T to shared memory before the wgmmas that read dsf are issued (the A registers of
        // a pending wgmma may not even be read)
        store_ds<Tr>(raw + L::kDS + buf * Tr::kDSBytes, dsf, key_row0, t);
        fence_proxy_async();  // the dS^T writes (generic proxy) before wgmma's reads (async)
        // dV += P^T dO, dK += dS^T Q
        wgmma_fence_operand(dv);
        wgmma_fence_operand(dk);
        wgmma_fence_operand(ptf);
        wgmma_fence_operand(dsf);
        wgmma_fence();
        gemm.dv_dk(dv, dk, ptf, dsf, slot);
        // both warpgroups' dS^T written (and each done with step j - 1's dQ, which read the
        // other buffer)
        named_barrier_sync(kBarDs, Tr::kConsumerThreads);
        // dQ = dS K (this warpgroup's part of the step's query block)
        float dq[Tr::kQAcc];
        wgmma_fence();
        gemm.dq(dq, buf);
        wgmma_wait<0>();
        wgmma_fence_operand(dq);
        wgmma_fence_operand(dv);
        wgmma_fence_operand(dk);
        ring.consumer_release(ring_st, lane);  // this warp's reads of the slot are done
        // the half of the dQ tile to the writer warp, once it has read the previous one
        if (j > 0) named_barrier_sync(kBarDqEmpty + w, kBwdDqBarThreads);
        DqTile<Tr>::store(reinterpret_cast<float2*>(raw + L::kDQ), dq, w, tid & 127);
        fence_proxy_async();  // the tile's writes (generic proxy) before the reduction's reads
        named_barrier_arrive(kBarDqFull + w, kBwdDqBarThreads);
    }
    bwd_store_dk_dv<T, Tr>(p, dk, dv, b, hk, n0 + key_row0, t);
}

// Consumer warpgroup w at hd256 (kSplitD): the CTA's 64 keys, the step's query columns
// [32 w, 32 w + 32) of S^T, dP^T, P^T and dS^T, head-dim columns [128 w, 128 w + 128) of dK,
// dV and dQ. Step j:
//   S^T, dP^T of its 32 queries issued, then step j - 1's second dQ column tile added while
//   they run; P^T, dS^T into buffer j & 1 (shared memory); both warpgroups' halves written
//   (kBarDs); dV += P^T dO, dK += dS^T Q (A from the buffer); dQ = dS K in two GEMMs of 64
//   columns, the first added to dq_accum from registers as soon as it completes, the second
//   at step j + 1 (red.global.add.v4.f32: no dQ tile in shared memory, none left for it;
//   DqTileSplit). The reductions, 16 per thread and step, throttle the load-store queue (ncu,
//   2026-12-07): half of them behind the next scores took 5-10% off (NOTES v92).
// DETERMINISTIC: a thread of each warpgroup waits for the key block's turn at the query block
// (DqTurns: one counter per warpgroup, for its columns) before the warpgroup adds, and passes
// it on with a release after the next step's kBarDs, which orders the warpgroup's additions
// before it (the release is cumulative); by then they have reached L2, so the release does not
// hold up the warp (at once after the additions it did: 2026-12-07, experiments/NOTES.md v91).
// No deadlock: between a turn and its release lie only the step's additions and the next
// step's scores (and the additions behind them), none of which waits for a turn.
template <typename T, typename Tr, bool CAUSAL, bool DETERMINISTIC>
__device__ __forceinline__ void bwd_consumer_split(const BwdParams& p, uint32_t base,
                                                   unsigned char* raw, int w, int tid, int n_steps,
                                                   int n_m, int m_block_min, int n0, int n_block,
                                                   int hk, int b) {
    using L = HopperBwdSmem<Tr>;
    const FwdParams& f = p.fwd;
    const int lane = tid & 31, warp_in_wg = (tid >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    const int seqlen_q = f.seqlen_q, seqlen_k = f.seqlen_k;
    const BwdGemmsSplit<T, Tr> gemm(base, w);
    const MbarRing<Tr::kStages> ring = bwd_ring<Tr>(base);
    const int key_row0 = warp_in_wg * 16 + g;  // this thread's keys: + 0, + 8
    const int q0 = w * Tr::kSCols;             // its query columns of a step
    const int n_m_total = (seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
    const int64_t tiles = (int64_t)f.nheads * n_m_total;  // dq_accum tiles of a batch entry
    float* dq_accum = p.dq_accum + b * tiles * DqTileSplit<Tr>::kFloats;
    const DqTurns<Tr, CAUSAL> turns{  // the counters follow the tiles of every batch entry
        reinterpret_cast<int*>(p.dq_accum + f.batch * tiles * DqTileSplit<Tr>::kFloats) +
            b * tiles * DqTurns<Tr, CAUSAL>::kPerTile,
        (int)gridDim.x, n_m_total, seqlen_q, seqlen_k, f.window_left, f.window_right};
    int* prev_turn = nullptr;  // DETERMINISTIC: the counter of the last step's turn
    float dk[Tr::kAcc], dv[Tr::kAcc];
#pragma unroll
    for (int i = 0; i < Tr::kAcc; ++i) dk[i] = dv[i] = 0.f;
    if (n_steps > 0) mbarrier_wait(base + L::kKVFull, 0u);
    PipelineState<Tr::kStages> ring_st = consumer_start<Tr::kStages>();
    // the second dQ column tile of step j - 1 is added here, while step j's scores compute
    // (copied from dqb once its wgmma completed, and zeroed on the way in: else ptxas, seeing
    // registers a wgmma may define, waits for the scores before the additions, C7517)
    float dqb[Tr::kQAcc], dqc[Tr::kQAcc];
#pragma unroll
    for (int i = 0; i < Tr::kQAcc; ++i) dqc[i] = 0.f;
    float* prev_tile = nullptr;
    for (int j = 0; j < n_steps; ++j, ring_st.advance()) {
        const int slot = ring_st.slot, buf = j & 1;
        const BwdStep stp = bwd_step<Tr>(j, n_m, m_block_min, hk, f.h_per_kv);
        float st[Tr::kSAcc], dpt[Tr::kSAcc];
        bwd_scores<Tr>(gemm, st, dpt, base, ring_st);
        if (j > 0) DqTileSplit<Tr>::add(prev_tile, dqc, 2 * w + 1, tid & 127);
        const BwdStats<Tr> stats(reinterpret_cast<const float*>(raw + L::kStats +
                                                                slot * Tr::kStatsBytes) + q0, t);
        wgmma_wait<0>();
        wgmma_fence_operand(st);
        wgmma_fence_operand(dpt);
        // P^T = exp2(S^T c - LSE log2 e), dS^T = P^T (dP^T - D)
        const bool mask = bwd_tile_needs_mask<Tr::kBlockM, Tr::kBlockN>(f, stp.m0, n0, seqlen_q,
                                                                         seqlen_k, CAUSAL);
        bwd_probs<Tr, CAUSAL>(st, dpt, stats, mask, n0 + key_row0, stp.m0 + q0, t, seqlen_q,
                              seqlen_k, f);
        uint32_t ptf[Tr::kSSteps][4], dsf[Tr::kSSteps][4];
        pack_p<T, Tr::kSAcc / 4>(st, ptf);
        pack_p<T, Tr::kSAcc / 4>(dpt, dsf);
        unsigned char* ps = raw + L::kDS + buf * Tr::kPSBytes;
        store_ds<Tr>(ps, ptf, key_row0, t, q0 / 16);
        store_ds<Tr>(ps + Tr::kDSBytes, dsf, key_row0, t, q0 / 16);
        fence_proxy_async();  // the writes (generic proxy) before wgmma's reads (async)
        // both halves written (and each warpgroup done with step j - 1, which read the other
        // buffer)
        named_barrier_sync(kBarDs, Tr::kConsumerThreads);
        // DETERMINISTIC: the warpgroup's additions of step j - 1 are behind the barrier (the
        // second tile's issued above): its turn there passes on now (the release is cumulative)
        if (DETERMINISTIC && j > 0 && (tid & 127) == 0) red_release_gpu_add(prev_turn, 1);
        // dV += P^T dO, dK += dS^T Q; dQ = dS K, its two column tiles
        float dqa[Tr::kQAcc];
        wgmma_fence_operand(dv);
        wgmma_fence_operand(dk);
        wgmma_fence();
        gemm.dv_dk(dv, dk, buf, slot);
        gemm.dq(dqa, buf, 2 * w);
        gemm.dq(dqb, buf, 2 * w + 1);
        wgmma_wait<2>();
        wgmma_fence_operand(dv);
        wgmma_fence_operand(dk);
        ring.consumer_release(ring_st, lane);  // this warp's reads of the slot are done
        float* tile = dq_accum + ((int64_t)stp.h * n_m_total + stp.m0 / Tr::kBlockM) *
                                     DqTileSplit<Tr>::kFloats;
        if constexpr (DETERMINISTIC) {
            prev_turn = turns.counter(stp.h, stp.m0, w);
            if ((tid & 127) == 0) {
                const int my = turns.rank(n_block, stp.m0 / Tr::kBlockM);
                while (ld_acquire_gpu(prev_turn) != my) __nanosleep(32);
            }
            __syncwarp();  // (bar.sync is .aligned: warp 0 converged after its lane's spin)
            named_barrier_sync(kBarTurn + w, 128);
        }
        wgmma_wait<1>();
        wgmma_fence_operand(dqa);
        DqTileSplit<Tr>::add(tile, dqa, 2 * w, tid & 127);
        wgmma_wait<0>();
        wgmma_fence_operand(dqb);
#pragma unroll
        for (int i = 0; i < Tr::kQAcc; ++i) asm volatile("mov.b32 %0, %1;" : "=f"(dqc[i]) : "f"(dqb[i]));
        prev_tile = tile;
    }
    if (n_steps > 0) DqTileSplit<Tr>::add(prev_tile, dqc, 2 * w + 1, tid & 127);
    if (DETERMINISTIC && n_steps > 0) {  // the last step's turn, once the warpgroup has added
        named_barrier_sync(kBarTurn + w, 128);
        if ((tid & 127) == 0) red_release_gpu_add(prev_turn, 1);
    }
    bwd_store_dk_dv<T, Tr>(p, dk, dv, b, hk, n0 + key_row0, t, w * Tr::kDCols);
}

// One CTA: the barriers, then each warpgroup takes its role: warpgroups 0 and 1 compute
// (bwd_consumer; hd256: bwd_consumer_split), warpgroup 2's warp 0 copies (bwd_producer) and its
// warp 1 adds dQ (bwd_dq_writer; not at hd256); its other warps leave.
template <typename T, int HEADDIM, bool CAUSAL, bool DETERMINISTIC>
__device__ __forceinline__ void bwd_hopper_block(const BwdTmaParams& P) {
    using Tr = HopperBwdTraits<T, HEADDIM>;
    using L = HopperBwdSmem<Tr>;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t base = (smem_u32addr(smem_raw) + 1023u) & ~1023u;
    unsigned char* raw = smem_raw + (base - smem_u32addr(smem_raw));
    const BwdParams& p = P.bwd;
    const FwdParams& f = p.fwd;
    const int tid = threadIdx.x, lane = tid & 31;
    // warp-uniform (common/wgmma.cuh): a role branch ptxas thinks divergent serialises wgmma
    const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);
    const int n_block = bwd_key_block<Tr, CAUSAL, DETERMINISTIC>();
    const int n0 = n_block * Tr::kBlockN, hk = blockIdx.y, b = blockIdx.z;
    const QueryTiles<Tr::kBlockM> qt(n0, min(n0 + Tr::kBlockN, f.seqlen_k) - 1, f.seqlen_q,
                                     f.seqlen_k, CAUSAL, f.window_left, f.window_right);
    const int n_m = qt.m_block_max - qt.m_block_min, n_steps = f.h_per_kv * n_m;
    if (tid == 0) {
        mbarrier_init(base + L::kKVFull, 1);
        bwd_ring<Tr>(base).init(Tr::kConsumerThreads / 32);
        fence_proxy_async();  // the initialised barriers, before TMA completes bytes on them
    }
    __syncthreads();
    if (wg == 2) {
        warpgroup_reg_dealloc<Tr::kProducerRegs>();
        const int warp = __shfl_sync(0xffffffffu, (tid >> 5) & 3, 0);
        if (warp == 0 && lane == 0)
            bwd_producer<Tr>(P, base, n_steps, n_m, qt.m_block_min, n0, hk, b);
        else if (warp == 1 && !Tr::kSplitD)  // (kSplitD: the consumers add dQ themselves)
            bwd_dq_writer<Tr, CAUSAL, DETERMINISTIC>(p, base, lane, n_steps, n_m, qt.m_block_min,
                                                    n_block, hk, b);
        return;
    }
    warpgroup_reg_alloc<Tr::kConsumerRegs>();
    if constexpr (Tr::kSplitD)
        bwd_consumer_split<T, Tr, CAUSAL, DETERMINISTIC>(p, base, raw, wg, tid, n_steps, n_m,
                                                         qt.m_block_min, n0, n_block, hk, b);
    else
        bwd_consumer<T, Tr, CAUSAL>(p, base, raw, wg, tid, n_steps, n_m, qt.m_block_min, n0, hk, b);
}

// The entries: cf::bwd_hopper_entry<T, HEADDIM, CAUSAL, DETERMINISTIC> (grid: key blocks of
// 128, KV heads, batch; 384 threads; dynamic shared memory HopperBwdSmem::kBytes) after the
// pre-pass (cf::bwd_hopper_prep_entry) into a zeroed dq_accum (DETERMINISTIC: and the turn counters
// after it), then cf::bwd_dq_convert_entry<T, HEADDIM> (grid: query blocks of kBlockM rows,
// heads, batch; 256 threads): dq = softmax_scale dq_accum.
template <typename T, int HEADDIM, bool CAUSAL, bool DETERMINISTIC>
__global__ void __launch_bounds__(HopperBwdTraits<T, HEADDIM>::kThreads, 1)
bwd_hopper_entry(const __grid_constant__ BwdTmaParams P) {
    bwd_hopper_block<T, HEADDIM, CAUSAL, DETERMINISTIC>(P);
}

// The pre-pass of the Hopper plan: per 64-row query block of (batch, head), LSE log2(e) of its
// rows (bwd_lse_log2: +inf past the end) and then their D = rowsum(dO * O) (0 past the end), 128
// floats at dsum + batch / head strides + block * 128 (bwd_stats_block), which the main kernel
// copies into its ring with a step's Q and dO tiles. Grid (query blocks of 64 up to the buffer's
// padded end, heads, batch), 128 threads: 8 lanes per row, each with 16-byte loads of dO and O
// (columns 8 lane' + 64 c, lane' = lane & 7), 16 rows per pass; every load of the block is
// issued before the first sum (the kernel is a stream of loads: keep them in flight). Head dims
// up to HEADDIM_MAX (128 or 256).
template <typename T, int HEADDIM_MAX>
__global__ void __launch_bounds__(128) bwd_hopper_prep_entry(const __grid_constant__ BwdParams p) {
    constexpr int M = kStatsRows, kRows = 16, kPasses = M / kRows;
    constexpr int kChunks = HEADDIM_MAX / 64;  // 64 columns each
    const int b = blockIdx.z, h = blockIdx.y, sub = threadIdx.x & 7, row = threadIdx.x >> 3;
    const BwdSeq s = bwd_seq(p, b, h);
    const int seqlen_q = s.f.seqlen_q, headdim = p.fwd.headdim, r0 = blockIdx.x * M;
    const T* o = static_cast<const T*>(p.fwd.o) + s.f.o_off;
    const T* dout = static_cast<const T*>(p.dout) + s.do_off;
    uint4 ov[kPasses][kChunks], dv[kPasses][kChunks];
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
        const int r = r0 + i * kRows + row;
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
            const int col = 64 * c + 8 * sub;
            ov[i][c] = dv[i][c] = make_uint4(0u, 0u, 0u, 0u);
            if (r < seqlen_q && col < headdim) {
                ov[i][c] = __ldg(reinterpret_cast<const uint4*>(o + (int64_t)r * p.fwd.o_row_stride + col));
                dv[i][c] = __ldg(reinterpret_cast<const uint4*>(dout + (int64_t)r * p.do_row_stride + col));
            }
        }
    }
    float* stats = bwd_stats_block(p, b, h, r0);
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
        float d = 0.f;
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
            const uint32_t x[4] = {ov[i][c].x, ov[i][c].y, ov[i][c].z, ov[i][c].w};
            const uint32_t y[4] = {dv[i][c].x, dv[i][c].y, dv[i][c].z, dv[i][c].w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 a = to_float2<T>(x[e]), g = to_float2<T>(y[e]);
                d = fmaf(a.y, g.y, fmaf(a.x, g.x, d));
            }
        }
#pragma unroll
        for (int off = 4; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
        const int k = i * kRows + row;
        if (sub == 0) {
            stats[k] = bwd_lse_log2<float>(p.fwd.lse + s.f.lse_off, r0 + k, seqlen_q);
            stats[M + k] = d;
        }
    }
}

// dq = softmax_scale dq_accum for one query block of kBlockM rows: the tile (DqTile; hd256:
// DqTileSplit) read in order, a float4 per thread and iteration, all loads issued before the
// first store. DqTile: float2 numbers 2 e and 2 e + 1 (threads u and u + 1 of a fragment), one
// row's columns c .. c + 3; DqTileSplit: columns c, c + 1 of rows r and r + 8.
template <typename T, int HEADDIM>
__global__ void __launch_bounds__(256) bwd_dq_convert_entry(const __grid_constant__ BwdParams p) {
    using Tr = HopperBwdTraits<T, HEADDIM>;
    constexpr int kFloats = Tr::kBlockM * HEADDIM;
    constexpr int kIters = kFloats / 4 / 256;
    static_assert(kIters * 4 * 256 == kFloats, "whole float4 per thread");
    const FwdParams& f = p.fwd;
    const int m = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const BwdSeq s = bwd_seq(p, b, h);
    const float4* acc = reinterpret_cast<const float4*>(
        p.dq_accum + (((int64_t)b * f.nheads + h) * gridDim.x + m) * kFloats);
    float4 x[kIters];
#pragma unroll
    for (int i = 0; i < kIters; ++i) x[i] = __ldg(acc + threadIdx.x + 256 * i);
    const float scale = (float)f.softmax_scale_d;
    T* dq = static_cast<T*>(p.dq) + s.dq_off;
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
        const int e = threadIdx.x + 256 * i;
        int row, c;
        if constexpr (Tr::kSplitD) {
            DqTileSplit<Tr>::position(e, row, c);
            const int r = m * Tr::kBlockM + row;
            if (c >= f.headdim) continue;  // (head dims are multiples of 8: c + 1 too)
            if (r < f.seqlen_q)
                *reinterpret_cast<uint32_t*>(dq + (int64_t)r * p.dq_row_stride + c) =
                    pack2<T>(x[i].x * scale, x[i].y * scale);
            if (r + 8 < f.seqlen_q)
                *reinterpret_cast<uint32_t*>(dq + (int64_t)(r + 8) * p.dq_row_stride + c) =
                    pack2<T>(x[i].z * scale, x[i].w * scale);
        } else {
            DqTile<Tr>::position(2 * e, row, c);
            const int r = m * Tr::kBlockM + row;
            if (r < f.seqlen_q && c < f.headdim) {  // (head dims are multiples of 8: c + 3 too)
                *reinterpret_cast<uint2*>(dq + (int64_t)r * p.dq_row_stride + c) =
                    make_uint2(pack2<T>(x[i].x * scale, x[i].y * scale),
                               pack2<T>(x[i].z * scale, x[i].w * scale));
            }
        }
    }
}

}  // namespace cf
