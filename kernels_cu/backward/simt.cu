// The backward pass on CUDA cores for float32 and float64: the exactness paths (float64 within
// rounding of a float64 one-shot backward, so torch.autograd.gradcheck runs through it).
//
// FlashAttention-2 (Dao, arXiv 2307.08691), Sec. 3.2 and Algorithm 2, as three kernels without
// atomics (common/bwd_tile.cuh): the pre-pass D = rowsum(dO * O), then the dK/dV kernel (one CTA
// per key block, walking the query blocks that see it) and the dQ kernel (one CTA per query
// block, walking the key blocks it sees). Every product and sum is computed in T; the LSE is T
// too (the float64 forward writes a float64 LSE).
//
// The tiling of forward/simt.cu: 128 threads as 16 row groups x 8 lanes (common/simt_tile.cuh);
// tiles in shared memory with rows padded by 16 bytes; the probability tiles (P^T and dS^T, or
// dS) go through shared memory, each row written and read by the 8 lanes of one warp.
#include "common/dtype.cuh"
#include "common/params.cuh"
#include "common/mask.cuh"
#include "common/online_softmax.cuh"
#include "common/fwd_tile.cuh"
#include "common/bwd_tile.cuh"
#include "common/simt_tile.cuh"

namespace cf {

template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N>
struct SimtBwdTraits {
    static constexpr int kThreads = 128;
    static constexpr int kTR = 16, kTC = 8;                 // row groups x lanes per row group
    static constexpr int kVec = 16 / (int)sizeof(T);
    static constexpr int kDV = HEADDIM / (kTC * kVec);      // 16-byte accumulator chunks per thread
    static constexpr int kRow = HEADDIM + kVec;             // padded tile row
    static constexpr int kTRow = BLOCK_M + kVec;            // padded P^T / dS^T row (dK/dV kernel)
    static constexpr int kSRow = BLOCK_N + kVec;            // padded dS row (dQ kernel)
    // Bytes of dynamic shared memory of each kernel (cupyflash/backward/kernels.py reads them).
    static constexpr int kDkdvSmemBytes =
        (2 * BLOCK_N * kRow + 2 * BLOCK_M * kRow + 2 * BLOCK_N * kTRow + 2 * BLOCK_M) * (int)sizeof(T);
    static constexpr int kDqSmemBytes =
        (2 * BLOCK_M * kRow + 2 * BLOCK_N * kRow + BLOCK_M * kSRow + 2 * BLOCK_M) * (int)sizeof(T);

    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "float or double");
    static_assert(BLOCK_M % kTR == 0 && BLOCK_N % kTR == 0 && BLOCK_M % kTC == 0 &&
                  BLOCK_N % kTC == 0 && BLOCK_M % kVec == 0 && BLOCK_N % kVec == 0, "tile shape");
    static_assert(HEADDIM % (kTC * kVec) == 0 && HEADDIM % 32 == 0, "padded head dim");
};

// scale * log2(e) in T (the float64 path from the float64 softmax_scale), and the scale itself.
template <typename T>
__device__ __forceinline__ T bwd_scale_log2(const FwdParams& p) {
    return sizeof(T) == 8 ? T(p.softmax_scale_d * 1.4426950408889634073599246810019) : T(p.scale_log2);
}

// The query rows [m0, m0 + BLOCK_M) of one head as the backward reads them: Q and dO tiles, and
// per row lse * log2(e) (+inf: p = 0) and D (0 past the end).
template <typename Tr, typename T, int BLOCK_M, int HEADDIM>
__device__ __forceinline__ void load_query_rows(T* sQ, T* sdO, T* sL, T* sD, const BwdParams& p,
                                                const BwdSeq& s, int m0, int tid) {
    const int warp = tid >> 5, lane = tid & 31, seqlen_q = s.f.seqlen_q;
    const T* q = static_cast<const T*>(p.fwd.q) + s.f.q_off + (int64_t)m0 * p.fwd.q_row_stride;
    const T* dout = static_cast<const T*>(p.dout) + s.do_off + (int64_t)m0 * p.do_row_stride;
    load_tile_simt<Tr, T, BLOCK_M, HEADDIM>(sQ, q, p.fwd.q_row_stride, seqlen_q - m0, p.fwd.headdim, warp, lane);
    load_tile_simt<Tr, T, BLOCK_M, HEADDIM>(sdO, dout, p.do_row_stride, seqlen_q - m0, p.fwd.headdim, warp, lane);
    const T* lse = reinterpret_cast<const T*>(p.fwd.lse) + s.f.lse_off;
    const T* dsum = static_cast<const T*>(p.dsum) + s.dsum_off;
    for (int i = tid; i < BLOCK_M; i += Tr::kThreads) {
        sL[i] = bwd_lse_log2<T>(lse, m0 + i, seqlen_q);
        sD[i] = m0 + i < seqlen_q ? dsum[m0 + i] : T(0);
    }
}

// A [ROWS x headdim] accumulator tile of this thread (rows tr + 16 i) times `scale` into global
// rows r0 + ... < rows_valid.
template <typename Tr, typename T, int R>
__device__ __forceinline__ void store_rows_simt(T* g, int64_t row_stride, const T (&acc)[R][Tr::kDV][Tr::kVec],
                                                T scale, int r0, int rows_valid, int headdim, int tr, int tc) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const int r = r0 + tr + Tr::kTR * i;
        if (r < rows_valid) {
            T* row = g + (int64_t)r * row_stride;
#pragma unroll
            for (int c = 0; c < Tr::kDV; ++c)
#pragma unroll
                for (int x = 0; x < Tr::kVec; ++x) {
                    const int col = (tc + Tr::kTC * c) * Tr::kVec + x;
                    if (col < headdim) row[col] = acc[i][c][x] * scale;
                }
        }
    }
}

template <typename Tr, typename T, int R>
__device__ __forceinline__ void zero_acc(T (&acc)[R][Tr::kDV][Tr::kVec]) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int c = 0; c < Tr::kDV; ++c)
#pragma unroll
            for (int x = 0; x < Tr::kVec; ++x) acc[i][c][x] = T(0);
}

// dK, dV of one key block (BLOCK_N keys of KV head blockIdx.y, batch blockIdx.z), summed over the
// query heads of its group and the query blocks that see it.
template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, bool CAUSAL>
__device__ __forceinline__ void bwd_dkdv_simt_block(const BwdParams& p) {
    using Tr = SimtBwdTraits<T, HEADDIM, BLOCK_M, BLOCK_N>;
    constexpr int RN = BLOCK_N / Tr::kTR, CM = BLOCK_M / Tr::kTC;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sK = reinterpret_cast<T*>(smem_raw);                 // [BLOCK_N][kRow]
    T* sV = sK + BLOCK_N * Tr::kRow;                        // [BLOCK_N][kRow]
    T* sQ = sV + BLOCK_N * Tr::kRow;                        // [BLOCK_M][kRow]
    T* sdO = sQ + BLOCK_M * Tr::kRow;                       // [BLOCK_M][kRow]
    T* sPt = sdO + BLOCK_M * Tr::kRow;                      // [BLOCK_N][kTRow]: P^T
    T* sdSt = sPt + BLOCK_N * Tr::kTRow;                    // [BLOCK_N][kTRow]: dS^T
    T* sL = sdSt + BLOCK_N * Tr::kTRow;                     // [BLOCK_M]
    T* sD = sL + BLOCK_M;                                   // [BLOCK_M]
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int tr = tid / Tr::kTC, tc = tid % Tr::kTC;
    const FwdParams& f = p.fwd;

    // ---- set-up: this CTA's keys, resident K and V tiles ----
    const int n0 = blockIdx.x * BLOCK_N, hk = blockIdx.y, b = blockIdx.z;
    const BwdSeq s0 = bwd_seq(p, b, hk * f.h_per_kv);
    const int seqlen_q = s0.f.seqlen_q, seqlen_k = s0.f.seqlen_k;
    if (n0 >= seqlen_k) return;
    const T c = bwd_scale_log2<T>(f);
    load_tile_simt<Tr, T, BLOCK_N, HEADDIM>(sK, static_cast<const T*>(f.k) + s0.f.k_off + (int64_t)n0 * f.k_row_stride,
                                            f.k_row_stride, seqlen_k - n0, f.headdim, warp, lane);
    load_tile_simt<Tr, T, BLOCK_N, HEADDIM>(sV, static_cast<const T*>(f.v) + s0.f.v_off + (int64_t)n0 * f.v_row_stride,
                                            f.v_row_stride, seqlen_k - n0, f.headdim, warp, lane);
    const QueryTiles<BLOCK_M> qt(n0, min(n0 + BLOCK_N, seqlen_k) - 1, seqlen_q, seqlen_k, CAUSAL,
                                 f.window_left, f.window_right);
    T dk[RN][Tr::kDV][Tr::kVec], dv[RN][Tr::kDV][Tr::kVec];
    zero_acc<Tr>(dk);
    zero_acc<Tr>(dv);

    // ---- main loop: every query head of the group, every query block that sees the keys ----
    for (int hh = 0; hh < f.h_per_kv; ++hh) {
        const BwdSeq s = bwd_seq(p, b, hk * f.h_per_kv + hh);
        for (int mb = qt.m_block_min; mb < qt.m_block_max; ++mb) {
            const int m0 = mb * BLOCK_M;
            __syncthreads();  // everyone is done with the previous Q, dO (and, first, K, V land)
            load_query_rows<Tr, T, BLOCK_M, HEADDIM>(sQ, sdO, sL, sD, p, s, m0, tid);
            __syncthreads();
            T st[RN][CM], dpt[RN][CM];
            simt_scores<Tr, HEADDIM>(st, sK, sQ, tr, tc);    // S^T = K Q^T (raw)
            simt_scores<Tr, HEADDIM>(dpt, sV, sdO, tr, tc);  // dP^T = V dO^T
            const bool mask = bwd_tile_needs_mask<BLOCK_M, BLOCK_N>(f, m0, n0, seqlen_q, seqlen_k, CAUSAL);
#pragma unroll
            for (int j = 0; j < CM; ++j) {
                const int col = tc + Tr::kTC * j;             // query row m0 + col
                const KeyRange r = visible_keys(m0 + col, seqlen_q, seqlen_k, CAUSAL, f.window_left, f.window_right);
#pragma unroll
                for (int i = 0; i < RN; ++i) {
                    const int row = tr + Tr::kTR * i;         // key n0 + row
                    T pr = exp2_<T>(fma_<T>(st[i][j], c, -sL[col]));
                    if (mask && !key_visible(r, n0 + row)) pr = T(0);
                    sPt[row * Tr::kTRow + col] = pr;
                    sdSt[row * Tr::kTRow + col] = pr * (dpt[i][j] - sD[col]);
                }
            }
            __syncwarp();  // P^T / dS^T rows of this warp: written and read by its own lanes
            simt_acc_pv<Tr, BLOCK_M, Tr::kTRow>(dv, sPt, sdO, tr, tc);   // dV += P^T dO
            simt_acc_pv<Tr, BLOCK_M, Tr::kTRow>(dk, sdSt, sQ, tr, tc);   // dK += dS^T Q
        }
    }

    // ---- epilogue: dK = softmax_scale dS^T Q, dV (zeros for keys no query sees) ----
    const T scale = T(f.softmax_scale_d);
    store_rows_simt<Tr>(static_cast<T*>(p.dk) + s0.dk_off, p.dk_row_stride, dk, scale, n0, seqlen_k, f.headdim, tr, tc);
    store_rows_simt<Tr>(static_cast<T*>(p.dv) + s0.dv_off, p.dv_row_stride, dv, T(1), n0, seqlen_k, f.headdim, tr, tc);
}

// dQ of one query block (BLOCK_M rows of head blockIdx.y, batch blockIdx.z; heaviest first when
// causal), over the key blocks its rows see.
template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, bool CAUSAL>
__device__ __forceinline__ void bwd_dq_simt_block(const BwdParams& p) {
    using Tr = SimtBwdTraits<T, HEADDIM, BLOCK_M, BLOCK_N>;
    constexpr int RM = BLOCK_M / Tr::kTR, CN = BLOCK_N / Tr::kTC;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);                 // [BLOCK_M][kRow]
    T* sdO = sQ + BLOCK_M * Tr::kRow;                       // [BLOCK_M][kRow]
    T* sK = sdO + BLOCK_M * Tr::kRow;                       // [BLOCK_N][kRow]
    T* sV = sK + BLOCK_N * Tr::kRow;                        // [BLOCK_N][kRow]
    T* sdS = sV + BLOCK_N * Tr::kRow;                       // [BLOCK_M][kSRow]
    T* sL = sdS + BLOCK_M * Tr::kSRow;                      // [BLOCK_M]
    T* sD = sL + BLOCK_M;                                   // [BLOCK_M]
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int tr = tid / Tr::kTC, tc = tid % Tr::kTC;
    const FwdParams& f = p.fwd;

    // ---- set-up: this CTA's rows (resident Q, dO, LSE, D) and key tiles ----
    const int mb = CAUSAL ? (int)gridDim.x - 1 - (int)blockIdx.x : (int)blockIdx.x;
    const int m0 = mb * BLOCK_M, h = blockIdx.y, b = blockIdx.z;
    const BwdSeq s = bwd_seq(p, b, h);
    const int seqlen_q = s.f.seqlen_q, seqlen_k = s.f.seqlen_k;
    if (m0 >= seqlen_q) return;
    const T c = bwd_scale_log2<T>(f);
    load_query_rows<Tr, T, BLOCK_M, HEADDIM>(sQ, sdO, sL, sD, p, s, m0, tid);
    const KeyTiles<BLOCK_N> tiles(m0, min(m0 + BLOCK_M, seqlen_q) - 1, seqlen_q, seqlen_k, CAUSAL,
                                  f.window_left, f.window_right);
    const T* k_base = static_cast<const T*>(f.k) + s.f.k_off;
    const T* v_base = static_cast<const T*>(f.v) + s.f.v_off;
    T dq[RM][Tr::kDV][Tr::kVec];
    zero_acc<Tr>(dq);

    // ---- main loop over the key tiles ----
    for (int nb = tiles.n_block_min; nb < tiles.n_block_max; ++nb) {
        const int n0 = nb * BLOCK_N;
        __syncthreads();
        load_tile_simt<Tr, T, BLOCK_N, HEADDIM>(sK, k_base + (int64_t)n0 * f.k_row_stride, f.k_row_stride,
                                                seqlen_k - n0, f.headdim, warp, lane);
        load_tile_simt<Tr, T, BLOCK_N, HEADDIM>(sV, v_base + (int64_t)n0 * f.v_row_stride, f.v_row_stride,
                                                seqlen_k - n0, f.headdim, warp, lane);
        __syncthreads();
        T st[RM][CN], dp[RM][CN];
        simt_scores<Tr, HEADDIM>(st, sQ, sK, tr, tc);    // S = Q K^T (raw)
        simt_scores<Tr, HEADDIM>(dp, sdO, sV, tr, tc);   // dP = dO V^T
        const bool mask = tiles.needs_mask(nb);
#pragma unroll
        for (int i = 0; i < RM; ++i) {
            const int row = tr + Tr::kTR * i;
            const KeyRange r = visible_keys(m0 + row, seqlen_q, seqlen_k, CAUSAL, f.window_left, f.window_right);
#pragma unroll
            for (int j = 0; j < CN; ++j) {
                const int col = tc + Tr::kTC * j;
                T pr = exp2_<T>(fma_<T>(st[i][j], c, -sL[row]));
                if (mask && !key_visible(r, n0 + col)) pr = T(0);
                sdS[row * Tr::kSRow + col] = pr * (dp[i][j] - sD[row]);
            }
        }
        __syncwarp();
        simt_acc_pv<Tr, BLOCK_N, Tr::kSRow>(dq, sdS, sK, tr, tc);   // dQ += dS K
    }

    // ---- epilogue: dQ = softmax_scale dS K ----
    store_rows_simt<Tr>(static_cast<T*>(p.dq) + s.dq_off, p.dq_row_stride, dq, T(f.softmax_scale_d),
                        m0, seqlen_q, f.headdim, tr, tc);
}

// The entries: cf::bwd_dkdv_simt_entry<T, HEADDIM, BLOCK_M, BLOCK_N, CAUSAL> (grid: key blocks,
// KV heads, batch), cf::bwd_dq_simt_entry<...> (grid: query blocks, heads, batch), and the
// pre-pass cf::bwd_dsum_entry<T, T> (common/bwd_tile.cuh); 128 threads each.
template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, bool CAUSAL>
__global__ void __launch_bounds__(128, 1) bwd_dkdv_simt_entry(const __grid_constant__ BwdParams p) {
    bwd_dkdv_simt_block<T, HEADDIM, BLOCK_M, BLOCK_N, CAUSAL>(p);
}

template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, bool CAUSAL>
__global__ void __launch_bounds__(128, 1) bwd_dq_simt_entry(const __grid_constant__ BwdParams p) {
    bwd_dq_simt_block<T, HEADDIM, BLOCK_M, BLOCK_N, CAUSAL>(p);
}

}  // namespace cf
