// The backward pass on tensor cores (fp16 / bf16 inputs, fp32 accumulation), mma.sync m16n8k16.
//
// FlashAttention-2 (Dao, arXiv 2307.08691), Sec. 3.2 and Algorithm 2, as three kernels without
// atomics (common/bwd_tile.cuh): the pre-pass D = rowsum(dO * O), the dK/dV kernel and the dQ
// kernel. Both main kernels are the forward's loop (forward/mma.cu) with other operands, built
// from the same parts (common/mma_tile.cuh): C = A B^T of two smem tiles (mma_scores) and
// C += P B with P straight from the accumulator registers (mma_pv), so no probability tile
// leaves registers:
//   dK/dV: each warp owns 16 keys; S^T = K Q^T and dP^T = V dO^T (keys as rows), then
//          P^T = exp2(S^T c - LSE log2 e), dS^T = P^T (dP^T - D), rounded to T in A-fragment
//          order, dV += P^T dO and dK += dS^T Q (dO and Q read transposed by ldmatrix.trans);
//   dQ:    each warp owns 16 query rows; S = Q K^T, dP = dO V^T, dS = P (dP - D), dQ += dS K.
// PART splits the dK/dV kernel where both accumulators do not fit in registers (head dims above
// 128): 0 computes both, 1 dK only, 2 dV only (one more S^T per part). The streamed tiles are
// double-buffered with cp.async (BwdMmaTraits::kStages).
//
// Shared-memory tiles have rows padded by 16 bytes (HEADDIM + 8 elements), as in the forward:
// conflict-free ldmatrix for every compiled head dim.
#include "common/dtype.cuh"
#include "common/params.cuh"
#include "common/mask.cuh"
#include "common/online_softmax.cuh"
#include "common/mma.cuh"
#include "common/mma_tile.cuh"
#include "common/fwd_tile.cuh"
#include "common/bwd_tile.cuh"

namespace cf {

// The tile of one backward kernel in the terms of common/mma_tile.cuh: ROWS rows per CTA (keys of
// the dK/dV kernel, query rows of the dQ kernel), COLS columns of the score tile.
template <typename T, int HEADDIM, int ROWS, int COLS, int NWARPS>
struct BwdMmaTraits {
    static constexpr bool kPrefetch = false;
    static constexpr bool kQInRegs = false;                  // A operands re-read from smem
    static constexpr int kThreads = NWARPS * 32;
    static constexpr int kMTiles = ROWS / (16 * NWARPS);     // m16 row tiles per warp
    static constexpr int kNTiles = COLS / 8;                 // n8 tiles of the score tile
    static constexpr int kDTiles = HEADDIM / 8;              // n8 tiles of an accumulator row
    static constexpr int kKSteps = HEADDIM / 16;             // k16 steps of the scores
    static constexpr int kPSteps = COLS / 16;                // k16 steps of the P product
    static constexpr int kChunks = HEADDIM / 8;              // 16-byte chunks per row
    static constexpr int kRow = HEADDIM + 8;                 // padded smem row, elements
    // The streamed tiles (COLS rows: Q and dO of the dK/dV kernel, K and V of the dQ kernel) are
    // double-buffered: the copies of step j + 1 are in flight while step j computes.
    static constexpr int kStages = 2;
    // Two resident tiles of ROWS rows, two streamed tiles of COLS rows per stage, and two float
    // rows of COLS per stage (the dK/dV kernel's LSE and D of its query rows).
    static constexpr int kSmemBytes =
        (2 * ROWS + 2 * kStages * COLS) * kRow * (int)sizeof(T) + 2 * kStages * 4 * COLS;

    static_assert(sizeof(T) == 2, "tensor-core path is for 16-bit inputs");
    static_assert(HEADDIM % 32 == 0 && HEADDIM <= 256, "padded head dim");
    static_assert(ROWS % (16 * NWARPS) == 0 && kMTiles >= 1, "ROWS = 16 * NWARPS * kMTiles");
    static_assert(COLS % 16 == 0, "COLS multiple of 16");
    static_assert((kRow * 2 / 16) % 2 == 1, "odd pitch in 16-byte chunks: conflict-free ldmatrix");
};

// The C fragments of a 16 x (8 NT) tile rounded to T as the A fragments of its k16 steps
// (common/mma.cuh: a[0], a[1] from n8 tile 2kc, a[2], a[3] from n8 tile 2kc + 1).
template <typename T, int NT>
__device__ __forceinline__ void pack_a_fragments(uint32_t (&a)[NT / 2][4], const float (&c)[4 * NT]) {
#pragma unroll
    for (int kc = 0; kc < NT / 2; ++kc)
#pragma unroll
        for (int e = 0; e < 4; ++e) a[kc][e] = pack2<T>(c[8 * kc + 2 * e], c[8 * kc + 2 * e + 1]);
}

// The element (e) of n8 tile nt of a thread's C fragment: row g + 8 (e >> 1), column
// 8 nt + 2 t + (e & 1) of the warp's 16-row tile.
__device__ __forceinline__ int frag_row(int g, int e) { return g + 8 * (e >> 1); }
__device__ __forceinline__ int frag_col(int nt, int t, int e) { return 8 * nt + 2 * t + (e & 1); }

// dK and/or dV (PART 0: both, 1: dK, 2: dV) of one key block (BLOCK_N keys of KV head
// blockIdx.y, batch blockIdx.z), summed over the query heads of its group and the query blocks
// that see it.
template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, int NWARPS, bool CAUSAL, int PART>
__device__ __forceinline__ void bwd_dkdv_mma_block(const BwdParams& p) {
    using Tr = BwdMmaTraits<T, HEADDIM, BLOCK_N, BLOCK_M, NWARPS>;
    constexpr int MT = Tr::kMTiles, NT = Tr::kNTiles, DT = Tr::kDTiles;
    constexpr bool kDK = PART != 2, kDV = PART != 1;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sK = reinterpret_cast<T*>(smem_raw);                 // [BLOCK_N][kRow]
    T* sV = sK + BLOCK_N * Tr::kRow;                        // [BLOCK_N][kRow]
    T* sQ = sV + BLOCK_N * Tr::kRow;                        // [kStages][BLOCK_M][kRow]
    T* sdO = sQ + Tr::kStages * BLOCK_M * Tr::kRow;         // [kStages][BLOCK_M][kRow]
    float* sL = reinterpret_cast<float*>(sdO + Tr::kStages * BLOCK_M * Tr::kRow);  // [kStages][BLOCK_M]: lse log2(e)
    float* sD = sL + Tr::kStages * BLOCK_M;                                         // [kStages][BLOCK_M]: D
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const FwdParams& f = p.fwd;

    // ---- set-up: this CTA's keys, resident K and V tiles ----
    const int n0 = blockIdx.x * BLOCK_N, hk = blockIdx.y, b = blockIdx.z;
    const BwdSeq s0 = bwd_seq(p, b, hk * f.h_per_kv);
    const int seqlen_q = s0.f.seqlen_q, seqlen_k = s0.f.seqlen_k;
    if (n0 >= seqlen_k) return;
    const int chunks_valid = f.headdim / 8;
    const uint32_t sK_base = smem_u32addr(sK), sV_base = smem_u32addr(sV);
    const uint32_t sQ_base = smem_u32addr(sQ), sdO_base = smem_u32addr(sdO);
    {
        const TileLoader<Tr, BLOCK_N> loader(tid);
        const T* k = static_cast<const T*>(f.k) + s0.f.k_off;
        const T* v = static_cast<const T*>(f.v) + s0.f.v_off;
        loader.load(sK_base, k + (int64_t)n0 * f.k_row_stride, f.k_row_stride, seqlen_k - n0, chunks_valid, k);
        if (kDK) loader.load(sV_base, v + (int64_t)n0 * f.v_row_stride, f.v_row_stride, seqlen_k - n0, chunks_valid, v);
        cp_async_commit();
    }
    const TileLoader<Tr, BLOCK_M> q_loader(tid);
    const int warp_row0 = warp * 16 * MT;                   // this warp's first key in the block
    const MmaLanes<Tr> lanes(lane, warp_row0);
    const QueryTiles<BLOCK_M> qt(n0, min(n0 + BLOCK_N, seqlen_k) - 1, seqlen_q, seqlen_k, CAUSAL,
                                 f.window_left, f.window_right);
    float dk[kDK ? MT : 1][kDK ? 4 * DT : 1], dv[kDV ? MT : 1][kDV ? 4 * DT : 1];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < 4 * DT; ++i) {
            if constexpr (kDK) dk[mt][i] = 0.f;
            if constexpr (kDV) dv[mt][i] = 0.f;
        }

    // ---- main loop: every query head of the group, every query block that sees the keys;
    //      step j computes on stage j % 2 while the copies of step j + 1 fill the other ----
    const int n_m = qt.m_block_max - qt.m_block_min, n_steps = f.h_per_kv * n_m;
    constexpr uint32_t kStageBytes = BLOCK_M * Tr::kRow * sizeof(T);
    auto load_step = [&](int j) {  // Q, dO (cp.async) and LSE, D (plain) of step j, if any
        if (j < n_steps) {
            const int st = j & 1, m0 = (qt.m_block_min + j % n_m) * BLOCK_M;
            const BwdSeq s = bwd_seq(p, b, hk * f.h_per_kv + j / n_m);
            const T* q = static_cast<const T*>(f.q) + s.f.q_off;
            const T* dout = static_cast<const T*>(p.dout) + s.do_off;
            q_loader.load(sQ_base + st * kStageBytes, q + (int64_t)m0 * f.q_row_stride, f.q_row_stride,
                          seqlen_q - m0, chunks_valid, q);
            q_loader.load(sdO_base + st * kStageBytes, dout + (int64_t)m0 * p.do_row_stride, p.do_row_stride,
                          seqlen_q - m0, chunks_valid, dout);
            const float* lse = f.lse + s.f.lse_off;
            const float* dsum = static_cast<const float*>(p.dsum) + s.dsum_off;
            for (int i = tid; i < BLOCK_M; i += Tr::kThreads) {
                sL[st * BLOCK_M + i] = bwd_lse_log2<float>(lse, m0 + i, seqlen_q);
                sD[st * BLOCK_M + i] = m0 + i < seqlen_q ? dsum[m0 + i] : 0.f;
            }
        }
        cp_async_commit();  // (an empty group past the last step keeps the wait count uniform)
    };
    load_step(0);
    for (int j = 0; j < n_steps; ++j) {
        const int stage = j & 1, m0 = (qt.m_block_min + j % n_m) * BLOCK_M;
        __syncthreads();      // every warp is done with step j - 1: its stage may be refilled
        load_step(j + 1);
        cp_async_wait<1>();   // this thread's copies of step j (and K, V) have landed
        __syncthreads();      // ... and everyone's, LSE and D included
        const uint32_t sQ_st = sQ_base + stage * kStageBytes, sdO_st = sdO_base + stage * kStageBytes;
        const float* sL_st = sL + stage * BLOCK_M;
        const float* sD_st = sD + stage * BLOCK_M;
        const bool mask = bwd_tile_needs_mask<BLOCK_M, BLOCK_N>(f, m0, n0, seqlen_q, seqlen_k, CAUSAL);
        float st[MT][4 * NT];
        mma_scores<T, Tr>(st, 0, sK_base + (uint32_t)(lanes.q * 2), sQ_st + (uint32_t)(lanes.k * 2));
        float dpt[kDK ? MT : 1][kDK ? 4 * NT : 1];
        if constexpr (kDK)
            mma_scores<T, Tr>(dpt, 0, sV_base + (uint32_t)(lanes.q * 2), sdO_st + (uint32_t)(lanes.k * 2));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            // P^T and dS^T of this warp's keys (rows) against the block's queries (columns)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = frag_col(nt, t, e), i = 4 * nt + e;
                    float pr = exp2f(fmaf(st[mt][i], f.scale_log2, -sL_st[col]));
                    if (mask) {
                        const KeyRange r = visible_keys(m0 + col, seqlen_q, seqlen_k, CAUSAL,
                                                        f.window_left, f.window_right);
                        if (!key_visible(r, n0 + warp_row0 + 16 * mt + frag_row(g, e))) pr = 0.f;
                    }
                    st[mt][i] = pr;
                    if constexpr (kDK) dpt[mt][i] = pr * (dpt[mt][i] - sD_st[col]);
                }
        }
        if constexpr (kDV) {
            uint32_t pt_frag[MT][NT / 2][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) pack_a_fragments<T, NT>(pt_frag[mt], st[mt]);
            mma_pv<T, Tr>(dv, pt_frag, sdO_st + (uint32_t)(lanes.v * 2));   // dV += P^T dO
        }
        if constexpr (kDK) {
            uint32_t dst_frag[MT][NT / 2][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) pack_a_fragments<T, NT>(dst_frag[mt], dpt[mt]);
            mma_pv<T, Tr>(dk, dst_frag, sQ_st + (uint32_t)(lanes.v * 2));   // dK += dS^T Q
        }
    }
    cp_async_wait<0>();  // nothing may still be writing to smem when the CTA retires

    // ---- epilogue: dK = softmax_scale dS^T Q, dV, rounded to T (zeros for unseen keys) ----
    const float scale = (float)f.softmax_scale_d;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int key = n0 + warp_row0 + 16 * mt + g + 8 * hh;
            if (key >= seqlen_k) continue;
            T* dk_row = static_cast<T*>(p.dk) + s0.dk_off + (int64_t)key * p.dk_row_stride;
            T* dv_row = static_cast<T*>(p.dv) + s0.dv_off + (int64_t)key * p.dv_row_stride;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                const int col = dt * 8 + 2 * t, i = 4 * dt + 2 * hh;
                if (col >= f.headdim) continue;
                if constexpr (kDK)
                    *reinterpret_cast<uint32_t*>(dk_row + col) = pack2<T>(dk[mt][i] * scale, dk[mt][i + 1] * scale);
                if constexpr (kDV)
                    *reinterpret_cast<uint32_t*>(dv_row + col) = pack2<T>(dv[mt][i], dv[mt][i + 1]);
            }
        }
}

// dQ of one query block (BLOCK_M rows of head blockIdx.y, batch blockIdx.z; heaviest first when
// causal) over the key blocks its rows see.
template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, int NWARPS, bool CAUSAL>
__device__ __forceinline__ void bwd_dq_mma_block(const BwdParams& p) {
    using Tr = BwdMmaTraits<T, HEADDIM, BLOCK_M, BLOCK_N, NWARPS>;
    constexpr int MT = Tr::kMTiles, NT = Tr::kNTiles, DT = Tr::kDTiles;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);                 // [BLOCK_M][kRow]
    T* sdO = sQ + BLOCK_M * Tr::kRow;                       // [BLOCK_M][kRow]
    T* sK = sdO + BLOCK_M * Tr::kRow;                       // [kStages][BLOCK_N][kRow]
    T* sV = sK + Tr::kStages * BLOCK_N * Tr::kRow;          // [kStages][BLOCK_N][kRow]
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const FwdParams& f = p.fwd;

    // ---- set-up: this CTA's rows (resident Q, dO; LSE and D in registers), its key tiles ----
    const int mb = CAUSAL ? (int)gridDim.x - 1 - (int)blockIdx.x : (int)blockIdx.x;
    const int m0 = mb * BLOCK_M, h = blockIdx.y, b = blockIdx.z;
    const BwdSeq s = bwd_seq(p, b, h);
    const int seqlen_q = s.f.seqlen_q, seqlen_k = s.f.seqlen_k;
    if (m0 >= seqlen_q) return;
    const int chunks_valid = f.headdim / 8;
    const uint32_t sQ_base = smem_u32addr(sQ), sdO_base = smem_u32addr(sdO);
    const uint32_t sK_base = smem_u32addr(sK), sV_base = smem_u32addr(sV);
    {
        const TileLoader<Tr, BLOCK_M> loader(tid);
        const T* q = static_cast<const T*>(f.q) + s.f.q_off;
        const T* dout = static_cast<const T*>(p.dout) + s.do_off;
        loader.load(sQ_base, q + (int64_t)m0 * f.q_row_stride, f.q_row_stride, seqlen_q - m0, chunks_valid, q);
        loader.load(sdO_base, dout + (int64_t)m0 * p.do_row_stride, p.do_row_stride, seqlen_q - m0, chunks_valid, dout);
        cp_async_commit();
    }
    const int warp_row0 = warp * 16 * MT;
    const MmaLanes<Tr> lanes(lane, warp_row0);
    float lse2[MT][2], dsum[MT][2];
    KeyRange range[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = m0 + warp_row0 + 16 * mt + g + 8 * hh;
            lse2[mt][hh] = bwd_lse_log2<float>(f.lse + s.f.lse_off, r, seqlen_q);
            dsum[mt][hh] = r < seqlen_q ? static_cast<const float*>(p.dsum)[s.dsum_off + r] : 0.f;
            range[mt][hh] = visible_keys(r, seqlen_q, seqlen_k, CAUSAL, f.window_left, f.window_right);
        }
    const KeyTiles<BLOCK_N> tiles(m0, min(m0 + BLOCK_M, seqlen_q) - 1, seqlen_q, seqlen_k, CAUSAL,
                                  f.window_left, f.window_right);
    const TileLoader<Tr, BLOCK_N> kv_loader(tid);
    const T* k_base = static_cast<const T*>(f.k) + s.f.k_off;
    const T* v_base = static_cast<const T*>(f.v) + s.f.v_off;
    float dq[MT][4 * DT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < 4 * DT; ++i) dq[mt][i] = 0.f;

    // ---- main loop over the key tiles; tile j computes on stage j % 2 while the copies of
    //      tile j + 1 fill the other ----
    constexpr uint32_t kStageBytes = BLOCK_N * Tr::kRow * sizeof(T);
    auto load_tile = [&](int nb) {  // K, V of key tile nb, if any
        if (nb < tiles.n_block_max) {
            const int n0 = nb * BLOCK_N;
            const uint32_t off = ((nb - tiles.n_block_min) & 1) * kStageBytes;
            kv_loader.load(sK_base + off, k_base + (int64_t)n0 * f.k_row_stride, f.k_row_stride, seqlen_k - n0,
                           chunks_valid, k_base);
            kv_loader.load(sV_base + off, v_base + (int64_t)n0 * f.v_row_stride, f.v_row_stride, seqlen_k - n0,
                           chunks_valid, v_base);
        }
        cp_async_commit();
    };
    load_tile(tiles.n_block_min);
    for (int nb = tiles.n_block_min; nb < tiles.n_block_max; ++nb) {
        const int n0 = nb * BLOCK_N;
        const uint32_t off = ((nb - tiles.n_block_min) & 1) * kStageBytes;
        __syncthreads();      // every warp is done with tile nb - 1: its stage may be refilled
        load_tile(nb + 1);
        cp_async_wait<1>();   // this thread's copies of tile nb (and Q, dO) have landed
        __syncthreads();      // ... and everyone's
        const uint32_t sK_st = sK_base + off, sV_st = sV_base + off;
        float st[MT][4 * NT], dp[MT][4 * NT];
        mma_scores<T, Tr>(st, 0, sQ_base + (uint32_t)(lanes.q * 2), sK_st + (uint32_t)(lanes.k * 2));
        mma_scores<T, Tr>(dp, 0, sdO_base + (uint32_t)(lanes.q * 2), sV_st + (uint32_t)(lanes.k * 2));
        const bool mask = tiles.needs_mask(nb);
        uint32_t ds_frag[MT][NT / 2][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int hh = e >> 1, i = 4 * nt + e;
                    float pr = exp2f(fmaf(st[mt][i], f.scale_log2, -lse2[mt][hh]));
                    if (mask && !key_visible(range[mt][hh], n0 + frag_col(nt, t, e))) pr = 0.f;
                    dp[mt][i] = pr * (dp[mt][i] - dsum[mt][hh]);
                }
            pack_a_fragments<T, NT>(ds_frag[mt], dp[mt]);
        }
        mma_pv<T, Tr>(dq, ds_frag, sK_st + (uint32_t)(lanes.v * 2));   // dQ += dS K
    }
    cp_async_wait<0>();

    // ---- epilogue: dQ = softmax_scale dS K, rounded to T ----
    const float scale = (float)f.softmax_scale_d;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = m0 + warp_row0 + 16 * mt + g + 8 * hh;
            if (r >= seqlen_q) continue;
            T* row = static_cast<T*>(p.dq) + s.dq_off + (int64_t)r * p.dq_row_stride;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                const int col = dt * 8 + 2 * t, i = 4 * dt + 2 * hh;
                if (col < f.headdim)
                    *reinterpret_cast<uint32_t*>(row + col) = pack2<T>(dq[mt][i] * scale, dq[mt][i + 1] * scale);
            }
        }
}

// The entries: cf::bwd_dkdv_mma_entry<T, HEADDIM, BLOCK_M, BLOCK_N, NWARPS, CAUSAL, PART> (grid:
// key blocks, KV heads, batch), cf::bwd_dq_mma_entry<T, HEADDIM, BLOCK_M, BLOCK_N, NWARPS, CAUSAL>
// (grid: query blocks, heads, batch), and the pre-pass cf::bwd_dsum_entry<T, float>
// (common/bwd_tile.cuh).
template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, int NWARPS, bool CAUSAL, int PART>
__global__ void __launch_bounds__(NWARPS * 32, 1) bwd_dkdv_mma_entry(const __grid_constant__ BwdParams p) {
    bwd_dkdv_mma_block<T, HEADDIM, BLOCK_M, BLOCK_N, NWARPS, CAUSAL, PART>(p);
}

template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, int NWARPS, bool CAUSAL>
__global__ void __launch_bounds__(NWARPS * 32, 1) bwd_dq_mma_entry(const __grid_constant__ BwdParams p) {
    bwd_dq_mma_block<T, HEADDIM, BLOCK_M, BLOCK_N, NWARPS, CAUSAL>(p);
}

}  // namespace cf
