// The mma.sync tile operations of the m16n8k16 kernels, forward (forward/mma.cu) and backward
// (backward/mma.cu): the cp.async tile loader, the ldmatrix lane addresses, C = A B^T of two
// smem tiles (S = Q K^T; the backward's S^T = K Q^T, dP = dO V^T, dP^T = V dO^T) and C += P B with
// P straight from registers (P V; the backward's dV += P^T dO, dK += dS^T Q, dQ += dS K).
//
// A traits type Tr gives the tile: kThreads, kMTiles (m16 tiles per warp), kNTiles (n8 tiles of
// the score tile), kDTiles (n8 tiles of the accumulator), kKSteps (k16 steps of the scores),
// kPSteps (k16 steps of the P product), kChunks (16-byte chunks per row), kRow (padded smem row,
// elements), kQInRegs (the A operand of the scores held in registers), kPrefetch.
#pragma once
#include "mma.cuh"

namespace cf {

// Global -> shared copy of one [ROWS x HEADDIM] tile with 16-byte cp.async. Thread layout: kTPR
// threads per row (consecutive lanes take consecutive 16-byte chunks: coalesced), kRowsPerPass
// rows per pass. Each thread keeps one 64-bit offset (its row and chunk inside the tile); the
// per-pass row offsets are warp-uniform. Rows >= rows_valid and columns >= the actual head dim are
// zero-filled without reading global memory.
template <typename Tr, int ROWS>
struct TileLoader {
    static constexpr int kChunks = Tr::kChunks;
    static constexpr int kTPR = kChunks % 32 == 0 ? 32 : kChunks % 16 == 0 ? 16 : kChunks % 8 == 0 ? 8 : 4;
    static constexpr int kRowsPerPass = Tr::kThreads / kTPR;
    static constexpr int kPasses = (ROWS + kRowsPerPass - 1) / kRowsPerPass;
    static constexpr int kChunkIters = kChunks / kTPR;
    static_assert(kChunks % kTPR == 0 && Tr::kThreads % kTPR == 0, "loader layout");

    int r0, c0;           // this thread's row (within a pass) and first chunk
    uint32_t s_off;       // byte offset of (r0, c0) inside a smem tile

    __device__ __forceinline__ explicit TileLoader(int tid)
        : r0(tid / kTPR), c0(tid % kTPR),
          s_off((uint32_t)((tid / kTPR) * Tr::kRow + (tid % kTPR) * 8) * 2u) {}

    template <typename T>
    __device__ __forceinline__ void load(uint32_t s_tile, const T* g_tile, int64_t row_stride,
                                         int rows_valid, int chunks_valid, const T* g_safe) const {
        // Opaque copy: keeps the compiler from hoisting one 64-bit address per pass out of the
        // KV loop (that costs 2 registers each and made the 4-warp 128x64 tile spill).
        int64_t thread_off = (int64_t)r0 * row_stride + c0 * 8;
        asm volatile("" : "+l"(thread_off));
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
            const int r = r0 + pass * kRowsPerPass;
            if (ROWS % kRowsPerPass == 0 || r < ROWS) {
                const T* g_row = g_tile + (int64_t)(pass * kRowsPerPass) * row_stride + thread_off;
#pragma unroll
                for (int ci = 0; ci < kChunkIters; ++ci) {
                    const bool ok = r < rows_valid && c0 + ci * kTPR < chunks_valid;
                    const T* src = ok ? g_row + ci * kTPR * 8 : g_safe;
                    cp_async_16(s_tile + s_off + (uint32_t)((pass * kRowsPerPass * Tr::kRow + ci * kTPR * 8) * 2),
                                src, ok);
                }
            }
        }
    }
};

// ldmatrix row addresses (common/mma.cuh) of one warp: A operand rows (lane & 15), column half
// (lane >> 4); K (non-transposed B): key row (lane & 7) + 8 * (lane >> 4), column half
// ((lane >> 3) & 1); V (transposed B): key row (lane & 7) + 8 * ((lane >> 3) & 1), column half
// (lane >> 4). Element offsets inside a tile of padded rows.
template <typename Tr>
struct MmaLanes {
    int q, k, v;
    __device__ __forceinline__ MmaLanes(int lane, int warp_row0)
        : q((warp_row0 + (lane & 15)) * Tr::kRow + (lane >> 4) * 8),
          k(((lane & 7) + ((lane >> 4) << 3)) * Tr::kRow + ((lane >> 3) & 1) * 8),
          v(((lane & 7) + (((lane >> 3) & 1) << 3)) * Tr::kRow + (lane >> 4) * 8) {}
};

// The A fragments of Q for k-step ks of m-tile mt: from registers (kQInRegs), else ldmatrix.
template <typename Tr, typename QFrag>
__device__ __forceinline__ void q_fragment(uint32_t (&a)[4], const QFrag& q_frag, uint32_t sQ_addr,
                                           int mt, int ks) {
    if constexpr (Tr::kQInRegs) {
#pragma unroll
        for (int e = 0; e < 4; ++e) a[e] = q_frag[mt][ks][e];
    } else {
        ldmatrix_x4(a, sQ_addr + (uint32_t)((mt * 16 * Tr::kRow + ks * 16) * 2));
    }
}

// S = Q K^T of one tile (raw scores: not yet scaled), on mma.sync. With kPrefetch the steps
// i = (ks, np) run in order and the fragments of step i + 1 are loaded before the MMAs of step i
// (bk: every step; Q's a: when step i + 1 starts a new ks and Q is re-read from smem); fully
// unrolled, the buffers are renames.
template <typename T, typename Tr, typename QFrag>
__device__ __forceinline__ void mma_scores(float (&s)[Tr::kMTiles][4 * Tr::kNTiles],
                                           const QFrag& q_frag, uint32_t sQ_addr,
                                           uint32_t sK_addr) {
    constexpr int MT = Tr::kMTiles, NT = Tr::kNTiles, NP = NT / 2;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < 4 * NT; ++i) s[mt][i] = 0.f;
    auto mma = [&](int mt, int np, const uint32_t (&a)[4], const uint32_t (&bk)[4]) {
        mma_m16n8k16<T>(*reinterpret_cast<float(*)[4]>(&s[mt][8 * np]), a, bk[0], bk[1]);
        mma_m16n8k16<T>(*reinterpret_cast<float(*)[4]>(&s[mt][8 * np + 4]), a, bk[2], bk[3]);
    };
    auto k_addr = [&](int np, int ks) {  // b-fragments of key tiles 2np and 2np + 1
        return sK_addr + (uint32_t)((np * 16 * Tr::kRow + ks * 16) * 2);
    };
    if constexpr (Tr::kPrefetch) {
        constexpr int kSteps = Tr::kKSteps * NP;
        uint32_t a[2][MT][4], bk[2][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) q_fragment<Tr>(a[0][mt], q_frag, sQ_addr, mt, 0);
        ldmatrix_x4(bk[0], k_addr(0, 0));
#pragma unroll
        for (int i = 0; i < kSteps; ++i) {
            const int np = i % NP, cur = i & 1, ab = (i / NP) & 1;
            if (i + 1 < kSteps) {
                const int ks1 = (i + 1) / NP, np1 = (i + 1) % NP;
                if (np1 == 0) {
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
                        q_fragment<Tr>(a[ks1 & 1][mt], q_frag, sQ_addr, mt, ks1);
                }
                ldmatrix_x4(bk[cur ^ 1], k_addr(np1, ks1));
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) mma(mt, np, a[ab][mt], bk[cur]);
        }
    } else {
#pragma unroll
        for (int ks = 0; ks < Tr::kKSteps; ++ks) {
            uint32_t a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) q_fragment<Tr>(a[mt], q_frag, sQ_addr, mt, ks);
#pragma unroll
            for (int np = 0; np < NP; ++np) {
                uint32_t bk[4];
                ldmatrix_x4(bk, k_addr(np, ks));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma(mt, np, a[mt], bk);
            }
        }
    }
}

// acc += P V of one tile, P taken straight from registers as the A operand.
template <typename T, typename Tr>
__device__ __forceinline__ void mma_pv(float (&acc)[Tr::kMTiles][4 * Tr::kDTiles],
                                       const uint32_t (&p_frag)[Tr::kMTiles][Tr::kPSteps][4],
                                       uint32_t sV_addr) {
#pragma unroll
    for (int kc = 0; kc < Tr::kPSteps; ++kc) {
#pragma unroll
        for (int dp = 0; dp < Tr::kDTiles / 2; ++dp) {
            uint32_t bv[4];  // b-fragments of head-dim tiles 2dp (bv[0], bv[1]) and 2dp+1 (bv[2], bv[3])
            ldmatrix_x4_trans(bv, sV_addr + (uint32_t)((kc * 16 * Tr::kRow + dp * 16) * 2));
#pragma unroll
            for (int mt = 0; mt < Tr::kMTiles; ++mt) {
                mma_m16n8k16<T>(*reinterpret_cast<float(*)[4]>(&acc[mt][8 * dp]), p_frag[mt][kc],
                                bv[0], bv[1]);
                mma_m16n8k16<T>(*reinterpret_cast<float(*)[4]>(&acc[mt][8 * dp + 4]),
                                p_frag[mt][kc], bv[2], bv[3]);
            }
        }
    }
}

}  // namespace cf
