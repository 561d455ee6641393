// Tiled prefill forward on tensor cores (fp16 / bf16 inputs, fp32 accumulation).
//
// FlashAttention-2 (Dao, arXiv 2307.08691), Algorithm 1 with the work partitioning of Sec. 3.2-3.3:
// one CTA per (BLOCK_M query rows, head, batch); each warp owns 16 * kMTiles of those rows, so the
// row statistics (m_i, l_i) never need a cross-warp reduction. K_j / V_j tiles of BLOCK_N keys
// stream through shared memory with cp.async, double-buffered (tile j+1 is in flight while tile j
// is consumed). S = Q K_j^T and acc += P V_j run on mma.sync.m16n8k16 with fp32 accumulation; the
// online softmax (Sec. 3.1: unscaled acc, normalised once at the end; the arithmetic is
// common/online_softmax.cuh) stays in registers, and P is re-used straight from the S
// accumulator registers as the A operand of P V (see common/mma.cuh for why that is exact).
// Causal / sliding-window: key tiles outside every row's range are skipped by the loop bounds;
// only tiles that straddle a boundary evaluate the mask (common/mask.cuh), and on those a warp
// skips a tile that none of its own rows sees (exact: P would be 0; when Q is re-read from smem,
// FwdTraits::kWarpSkip).
//
// Shared memory rows are padded by 16 bytes (HEADDIM + 8 elements): the row pitch is then an odd
// number of 16-byte chunks, so the 8 row addresses of every ldmatrix phase fall in 8 distinct
// bank groups for every compiled head dim (96, 160 and 224 included, where an 8-chunk XOR swizzle
// does not tile the row), and cp.async writes stay 16-byte aligned.
#include "common/dtype.cuh"
#include "common/params.cuh"
#include "common/mask.cuh"
#include "common/online_softmax.cuh"
#include "common/mma.cuh"
#include "common/mma_tile.cuh"
#include "common/softmax_step.cuh"
#include "common/fwd_tile.cuh"

namespace cf {

// PREFETCH: software-pipelined fragments in S = Q K^T: the K (and Q) ldmatrix of the next k16
// step is issued before the MMAs of the current one (double-buffered fragments); the hd128 row
// (v2 prefill outcome, experiments/NOTES.md).
template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, int NWARPS, bool PREFETCH = false>
struct FwdTraits {
    static constexpr bool kPrefetch = PREFETCH;
    static constexpr int kThreads = NWARPS * 32;
    static constexpr int kMTiles = BLOCK_M / (16 * NWARPS);  // m16 row tiles per warp
    static constexpr int kNTiles = BLOCK_N / 8;              // n8 tiles of S per row tile
    static constexpr int kDTiles = HEADDIM / 8;              // n8 tiles of acc per row tile
    static constexpr int kKSteps = HEADDIM / 16;             // k16 steps of Q K^T
    static constexpr int kPSteps = BLOCK_N / 16;             // k16 steps of P V
    static constexpr int kChunks = HEADDIM / 8;              // 16-byte chunks per row
    static constexpr int kRow = HEADDIM + 8;                 // padded smem row, elements
    static constexpr int kQElems = BLOCK_M * kRow;
    static constexpr int kKVElems = BLOCK_N * kRow;
    static constexpr int kStages = 2;                        // K/V tiles in the cp.async ring
    // cp.async groups: Q, then one K group and one V group per tile; kStages - 1 tiles are in
    // flight ahead of the one being consumed. At the top of iteration j the committed groups
    // from K_j on are K_j, V_j, ..., K_{j+S-2}, V_{j+S-2}: K_j has landed when at most
    // kWaitK = 2 (S - 1) - 1 are pending; after the prefetch of tile j + S - 1 (2 more groups),
    // V_j has landed when at most kWaitV = 2 (S - 1) are pending. Q (the first group) has landed
    // when at most kWaitQ = 2 (S - 1) are pending after the prologue.
    static constexpr int kWaitK = 2 * (kStages - 1) - 1;
    static constexpr int kWaitV = 2 * (kStages - 1);
    static constexpr int kWaitQ = 2 * (kStages - 1);
    // Bytes of dynamic shared memory; cupyflash/forward/kernels.py computes the same number.
    static constexpr int kSmemBytes = (kQElems + 2 * kStages * kKVElems) * (int)sizeof(T);
    // Q as A fragments held in registers for the whole kernel when the register budget allows
    // (acc + S + Q fragments); otherwise re-read from smem with ldmatrix at every k-step, which is
    // what FlashAttention-2 itself does for these tile shapes.
    static constexpr int kRegEstimate = kMTiles * (HEADDIM / 2 + BLOCK_N / 2 + HEADDIM / 4);
    static constexpr bool kQInRegs = kRegEstimate <= 160;
    // Warp-level skip of fully masked sub-tiles on boundary tiles. Off when Q lives in registers:
    // there the extra live state made hd192 128x32x8w spill (ptxas, sm_90a), and those tiles
    // (16-row warps, or hd64) gain little from it.
    static constexpr bool kWarpSkip = !kQInRegs;
    // Independent partial results of the softmax step's row max and sum (common/softmax_step.cuh):
    // one (with two, hd192 128 x 32 x 8 spilled at 255 registers; 4-8 warps per CTA here).
    static constexpr int kSoftmaxAcc = 1;

    static_assert(sizeof(T) == 2, "tensor-core path is for 16-bit inputs");
    static_assert(HEADDIM % 32 == 0 && HEADDIM <= 256, "padded head dim");
    static_assert(BLOCK_M % (16 * NWARPS) == 0 && kMTiles >= 1, "BLOCK_M = 16 * NWARPS * kMTiles");
    static_assert(BLOCK_N % 16 == 0, "BLOCK_N multiple of 16");
    static_assert((kRow * 2 / 16) % 2 == 1, "odd pitch in 16-byte chunks: conflict-free ldmatrix");
};

template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, int NWARPS, bool CAUSAL, bool PREFETCH>
__device__ __forceinline__ void flash_fwd_block(const FwdParams& p) {
    using Tr = FwdTraits<T, HEADDIM, BLOCK_M, BLOCK_N, NWARPS, PREFETCH>;
    constexpr int MT = Tr::kMTiles, NT = Tr::kNTiles, DT = Tr::kDTiles;

    // ================================ set-up ================================================
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sK = sQ + Tr::kQElems;                      // [kStages][BLOCK_N][kRow]
    T* sV = sK + Tr::kStages * Tr::kKVElems;       // [kStages][BLOCK_N][kRow]
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;         // mma groupID, threadID_in_group

    // this CTA's rows, sequence and key tiles [n_block_min, n_block_max) (common/fwd_tile.cuh)
    const auto cta = fwd_tile_of_block<BLOCK_M, BLOCK_N, CAUSAL>(p);
    if (cta.empty()) return;
    const int seqlen_q = cta.seq.seqlen_q, seqlen_k = cta.seq.seqlen_k, m0 = cta.m0;
    const T* k_base = cta.template k<T>(p);
    const T* v_base = cta.template v<T>(p);
    const int chunks_valid = p.headdim / 8;
    const KeyTiles<BLOCK_N>& tiles = cta.tiles;
    const int n_block_min = tiles.n_block_min, n_block_max = tiles.n_block_max;

    // Q tile (group 0), then K, V of the first kStages - 1 tiles (2 groups each; empty groups
    // past the last tile keep the wait counts uniform)
    const TileLoader<Tr, BLOCK_N> kv_loader(tid);
    const uint32_t sQ_base = smem_u32addr(sQ), sK_base = smem_u32addr(sK), sV_base = smem_u32addr(sV);
    constexpr uint32_t kKVStageBytes = Tr::kKVElems * sizeof(T);
    auto load_kv = [&](int nb, uint32_t stage_off) {  // the K and V copies of tile nb, if any
        if (nb < n_block_max) {
            const int n0 = nb * BLOCK_N;
            kv_loader.load(sK_base + stage_off, k_base + (int64_t)n0 * p.k_row_stride,
                           p.k_row_stride, seqlen_k - n0, chunks_valid, k_base);
            cp_async_commit();
            kv_loader.load(sV_base + stage_off, v_base + (int64_t)n0 * p.v_row_stride,
                           p.v_row_stride, seqlen_k - n0, chunks_valid, v_base);
            cp_async_commit();
        } else {
            cp_async_commit();
            cp_async_commit();
        }
    };
    {
        const T* q_base = cta.template q<T>(p);
        TileLoader<Tr, BLOCK_M>(tid).load(sQ_base, q_base + (int64_t)m0 * p.q_row_stride,
                                          p.q_row_stride, seqlen_q - m0, chunks_valid, q_base);
        cp_async_commit();
    }
#pragma unroll
    for (int st = 0; st < Tr::kStages - 1; ++st) load_kv(n_block_min + st, st * kKVStageBytes);

    const int warp_row0 = warp * 16 * MT;          // first row of this warp inside the tile
    const MmaLanes<Tr> lanes(lane, warp_row0);
    const uint32_t sQ_addr = sQ_base + (uint32_t)(lanes.q * 2);
    uint32_t q_frag[Tr::kQInRegs ? MT : 1][Tr::kQInRegs ? Tr::kKSteps : 1][4];
    if constexpr (Tr::kQInRegs) {
        cp_async_wait<Tr::kWaitQ>();               // this thread's Q copies have landed
        __syncthreads();                           // ... and everyone else's
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int ks = 0; ks < Tr::kKSteps; ++ks)
                ldmatrix_x4(q_frag[mt][ks], sQ_addr + (uint32_t)((mt * 16 * Tr::kRow + ks * 16) * 2));
    }

    // acc (unnormalised output) and the softmax state of this thread's rows g, g + 8 of each m16
    // tile (common/softmax_step.cuh)
    float acc[MT][4 * DT];
    SoftmaxRow<float> row[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < 4 * DT; ++i) acc[mt][i] = 0.f;
        row[mt][0].init();
        row[mt][1].init();
    }

    // ================================ main loop =============================================
    int stage = 0;                                 // (nb - n_block_min) % kStages
    for (int nb = n_block_min; nb < n_block_max; ++nb) {
        const int n0 = nb * BLOCK_N;
        const uint32_t stage_off = (uint32_t)stage * kKVStageBytes;
        // K_j has landed (V_j may still be in flight); every warp is done with tile j-1; then
        // tile j + kStages - 1 into the stage tile j - 1 used
        cp_async_wait<Tr::kWaitK>();
        __syncthreads();
        load_kv(nb + Tr::kStages - 1,
                (uint32_t)(stage == 0 ? Tr::kStages - 1 : stage - 1) * kKVStageBytes);
        const bool mask_tile = tiles.needs_mask(nb);

        // A warp skips a tile that none of its (valid) rows sees: its P would be exactly 0 and
        // (m, l, acc) would stay bit-for-bit unchanged (alpha = 1, or 0 * 0). Only boundary
        // tiles can be such tiles (causal diagonal, window edges).
        bool active = true;
        if (Tr::kWarpSkip && mask_tile) {
            const int r_first = m0 + warp_row0;
            const int r_last = min(r_first + 16 * MT, seqlen_q) - 1;
            const KeyRange f = visible_keys(r_first, seqlen_q, seqlen_k, CAUSAL, p.window_left,
                                            p.window_right);
            const KeyRange l = visible_keys(r_last, seqlen_q, seqlen_k, CAUSAL, p.window_left,
                                            p.window_right);
            active = r_first <= r_last && n0 < l.hi && n0 + BLOCK_N > f.lo;
        }

        // S = Q K^T, then the softmax step of every m16 tile (common/softmax_step.cuh; the mask
        // only on tiles that straddle a causal / window / sequence-end boundary)
        uint32_t p_frag[MT][Tr::kPSteps][4];  // P rounded to T, already in A-fragment order
        if (active) {
            float s[MT][4 * NT];
            mma_scores<T, Tr>(s, q_frag, sQ_addr, sK_base + stage_off + (uint32_t)(lanes.k * 2));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                float alpha[2];
                if (mask_tile) {
                    KeyRange range[2];
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh)
                        range[hh] = visible_keys(m0 + warp_row0 + mt * 16 + g + hh * 8, seqlen_q,
                                                 seqlen_k, CAUSAL, p.window_left, p.window_right);
                    mask_scores<NT>(s[mt], tile_bounds(range, n0, t));
                }
                softmax_tile_step_packed<T, NT, false, Tr::kSoftmaxAcc>(
                    s[mt], row[mt], alpha, TileBounds{}, p.scale_log2, p_frag[mt]);
                rescale_rows<DT>(acc[mt], alpha);
            }
        }

        // V_j has landed for every thread (every warp passes here, active or not)
        cp_async_wait<Tr::kWaitV>();
        __syncthreads();
        if (active) mma_pv<T, Tr>(acc, p_frag, sV_base + stage_off + (uint32_t)(lanes.v * 2));
        stage = stage + 1 == Tr::kStages ? 0 : stage + 1;
    }
    cp_async_wait<0>();  // nothing may still be writing to smem when the CTA retires

    // ================================ epilogue ==============================================
    // out = acc / l (0 for an empty row); LSE = m * scale + ln l. (Written out here rather than
    // with common/softmax_step.cuh's store_row: that form made hd192 128 x 32 x 8 spill.)
    T* o_base = cta.template o<T>(p);
    float* lse_base = cta.lse(p);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const float l = quad_sum(row[mt][hh].l);
            const float inv = SoftmaxRow<float>::inv_l(l);
            const int r = m0 + warp_row0 + mt * 16 + g + hh * 8;
            if (r < seqlen_q) {
                T* o_row = o_base + (int64_t)r * p.o_row_stride;
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    const int col = dt * 8 + 2 * t;
                    if (col < p.headdim)
                        *reinterpret_cast<uint32_t*>(o_row + col) =
                            pack2<T>(acc[mt][4 * dt + 2 * hh] * inv, acc[mt][4 * dt + 2 * hh + 1] * inv);
                }
                if (t == 0 && p.lse != nullptr) lse_base[r] = row[mt][hh].lse(l, p.scale_log2);
            }
        }
}

// One CTA of the tensor-core forward, for the shared entry cf::flash_fwd_entry
// (common/fwd_tile.cuh): the name expression is
// cf::flash_fwd_entry<cf::FlashFwd<T, HEADDIM, BLOCK_M, BLOCK_N, NWARPS, CAUSAL, PREFETCH>, T>.
template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, int NWARPS, bool CAUSAL,
          bool PREFETCH = false>
struct FlashFwd {
    static constexpr int kThreads = NWARPS * 32;
    static __device__ __forceinline__ void run(const FwdParams& p) {
        flash_fwd_block<T, HEADDIM, BLOCK_M, BLOCK_N, NWARPS, CAUSAL, PREFETCH>(p);
    }
};

}  // namespace cf
