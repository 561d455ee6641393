// Tiled prefill forward on CUDA cores for float32 and float64: the exactness paths.
//
// Same algorithm and tiling as forward/mma.cu: FlashAttention-2 (Dao, arXiv 2307.08691),
// Algorithm 1 with the partitioning of Sec. 3.2-3.3 (one CTA per BLOCK_M query rows, K_j / V_j
// tiles of BLOCK_N keys streamed through shared memory, online softmax of Sec. 3.1 with an
// unscaled accumulator normalised once at the end), but every product and sum is computed in T
// itself, so the float64 specialisation matches a float64 one-shot softmax to rounding error.
// Same params, masks (common/mask.cuh) and online-softmax update (common/online_softmax.cuh).
//
// Thread layout (128 threads): tr = tid / 8 (16 row groups), tc = tid % 8 (8 lanes per row group,
// all in one warp). Thread (tr, tc) owns query rows tr + 16 i (i < BLOCK_M / 16), score columns
// tc + 8 j (j < BLOCK_N / 8) of S, and 16-byte column chunks tc + 8 c of acc, so each row's max and
// sum are reductions over 8 lanes (__shfl_xor 1, 2, 4). Shared-memory rows are padded by 16 bytes:
// the 8 lanes of a quarter-warp read 8 different rows of K with 16-byte loads from 8 different
// bank groups. P goes through shared memory (rows written and read by the same warp: __syncwarp).
#include "common/dtype.cuh"
#include "common/params.cuh"
#include "common/mask.cuh"
#include "common/online_softmax.cuh"
#include "common/fwd_tile.cuh"
#include "common/simt_tile.cuh"

namespace cf {

template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N>
struct SimtTraits {
    static constexpr int kThreads = 128;
    static constexpr int kTR = 16, kTC = 8;                 // row groups x lanes per row group
    static constexpr int kRM = BLOCK_M / kTR;               // rows per thread
    static constexpr int kCN = BLOCK_N / kTC;               // S columns per thread
    static constexpr int kVec = 16 / (int)sizeof(T);        // elements per 16-byte smem access
    static constexpr int kDV = HEADDIM / (kTC * kVec);      // 16-byte acc chunks per row per thread
    static constexpr int kRow = HEADDIM + kVec;             // padded Q/K/V smem row
    static constexpr int kPRow = BLOCK_N + kVec;            // padded P smem row
    // Bytes of dynamic shared memory; cupyflash/forward/kernels.py computes the same number.
    static constexpr int kSmemBytes = (BLOCK_M * kRow + 2 * BLOCK_N * kRow + BLOCK_M * kPRow) * (int)sizeof(T);

    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "float or double");
    static_assert(BLOCK_M % kTR == 0 && BLOCK_N % kTC == 0 && BLOCK_N % kVec == 0, "tile shape");
    static_assert(HEADDIM % (kTC * kVec) == 0 && HEADDIM % 32 == 0, "padded head dim");
};

template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, bool CAUSAL>
__device__ __forceinline__ void flash_fwd_simt_block(const FwdParams& p) {
    using Tr = SimtTraits<T, HEADDIM, BLOCK_M, BLOCK_N>;
    constexpr int RM = Tr::kRM, CN = Tr::kCN, VEC = Tr::kVec, DV = Tr::kDV;
    constexpr int TR = Tr::kTR, TC = Tr::kTC;
    using Vec = VecN<T, VEC>;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);                 // [BLOCK_M][kRow]
    T* sK = sQ + BLOCK_M * Tr::kRow;                        // [BLOCK_N][kRow]
    T* sV = sK + BLOCK_N * Tr::kRow;                        // [BLOCK_N][kRow]
    T* sP = sV + BLOCK_N * Tr::kRow;                        // [BLOCK_M][kPRow]

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int tr = tid / TC, tc = tid % TC;

    const auto cta = fwd_tile_of_block<BLOCK_M, BLOCK_N, CAUSAL>(p);  // rows, sequence, key tiles (fwd_tile.cuh)
    if (cta.empty()) return;
    const int seqlen_q = cta.seq.seqlen_q, seqlen_k = cta.seq.seqlen_k, m0 = cta.m0;
    const T* q_base = cta.template q<T>(p);
    const T* k_base = cta.template k<T>(p);
    const T* v_base = cta.template v<T>(p);
    T* o_base = cta.template o<T>(p);
    T* lse_base = cta.template lse_as<T>(p);  // the LSE in T: float64 for float64
    const KeyTiles<BLOCK_N>& tiles = cta.tiles;
    // scale * log2(e), in T: the float64 path takes it from the float64 softmax_scale.
    const T scale_log2 = sizeof(T) == 8 ? T(p.softmax_scale_d * 1.4426950408889634073599246810019)
                                        : T(p.scale_log2);

    // Q tile (loaded once; the first __syncthreads of the loop publishes it).
    load_tile_simt<Tr, T, BLOCK_M, HEADDIM>(sQ, q_base + (int64_t)m0 * p.q_row_stride, p.q_row_stride,
                                            seqlen_q - m0, p.headdim, warp, lane);

    T acc[RM][DV][VEC];
    SoftmaxRow<T> row[RM];  // running max m and this thread's share l of the row sum
#pragma unroll
    for (int i = 0; i < RM; ++i) {
#pragma unroll
        for (int c = 0; c < DV; ++c)
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[i][c][e] = T(0);
        row[i].init();
    }

    for (int nb = tiles.n_block_min; nb < tiles.n_block_max; ++nb) {
        const int n0 = nb * BLOCK_N;
        // Load K_j, V_j (single-buffered: everyone is done with tile j-1 first).
        __syncthreads();
        load_tile_simt<Tr, T, BLOCK_N, HEADDIM>(sK, k_base + (int64_t)n0 * p.k_row_stride, p.k_row_stride,
                                                seqlen_k - n0, p.headdim, warp, lane);
        load_tile_simt<Tr, T, BLOCK_N, HEADDIM>(sV, v_base + (int64_t)n0 * p.v_row_stride, p.v_row_stride,
                                                seqlen_k - n0, p.headdim, warp, lane);
        __syncthreads();

        // S = Q K_j^T for this thread's RM x CN scores (raw, unscaled), 16-byte smem loads.
        T s[RM][CN];
#pragma unroll
        for (int i = 0; i < RM; ++i)
#pragma unroll
            for (int j = 0; j < CN; ++j) s[i][j] = T(0);
#pragma unroll 2
        for (int d = 0; d < HEADDIM; d += VEC) {
            Vec qv[RM];
#pragma unroll
            for (int i = 0; i < RM; ++i)
                qv[i] = *reinterpret_cast<const Vec*>(sQ + (tr + TR * i) * Tr::kRow + d);
#pragma unroll
            for (int j = 0; j < CN; ++j) {
                const Vec kv = *reinterpret_cast<const Vec*>(sK + (tc + TC * j) * Tr::kRow + d);
#pragma unroll
                for (int i = 0; i < RM; ++i)
#pragma unroll
                    for (int e = 0; e < VEC; ++e) s[i][j] = fma_<T>(qv[i].v[e], kv.v[e], s[i][j]);
            }
        }

        // Mask (only tiles that straddle a causal / window / sequence-end boundary): -inf.
        if (tiles.needs_mask(nb)) {
#pragma unroll
            for (int i = 0; i < RM; ++i) {
                const KeyRange r = visible_keys(m0 + tr + TR * i, seqlen_q, seqlen_k, CAUSAL,
                                                p.window_left, p.window_right);
#pragma unroll
                for (int j = 0; j < CN; ++j)
                    if (!key_visible(r, n0 + tc + TC * j)) s[i][j] = neg_inf<T>();
            }
        }

        // Online softmax (common/online_softmax.cuh): the row max over the 8 lanes of the row,
        // alpha = exp2((m_old - m) c) rescales l and acc, P = exp2((S - m) c) -> smem, l += rowsum(P).
#pragma unroll
        for (int i = 0; i < RM; ++i) {
            T mx = s[i][0];
#pragma unroll
            for (int j = 1; j < CN; ++j) mx = s[i][j] > mx ? s[i][j] : mx;
#pragma unroll
            for (int off = 1; off < TC; off <<= 1) {
                const T o = __shfl_xor_sync(0xffffffffu, mx, off);
                mx = o > mx ? o : mx;
            }
            const T alpha = row[i].update(mx, scale_log2);
            const T ref = row[i].ref();
            T rowsum = T(0);
            T* p_row = sP + (tr + TR * i) * Tr::kPRow;
#pragma unroll
            for (int j = 0; j < CN; ++j) {
                const T pr = SoftmaxRow<T>::prob(s[i][j], ref, scale_log2);
                p_row[tc + TC * j] = pr;
                rowsum += pr;
            }
            row[i].l += rowsum;
#pragma unroll
            for (int c = 0; c < DV; ++c)
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[i][c][e] *= alpha;
        }
        __syncwarp();  // P rows of this warp are written by and read by this warp only

        // acc += P V_j (keys past seqlen_k have P = 0 and zero-filled V rows).
#pragma unroll 1
        for (int n = 0; n < BLOCK_N; n += VEC) {
            Vec pv[RM];
#pragma unroll
            for (int i = 0; i < RM; ++i)
                pv[i] = *reinterpret_cast<const Vec*>(sP + (tr + TR * i) * Tr::kPRow + n);
#pragma unroll
            for (int e = 0; e < VEC; ++e)
#pragma unroll
                for (int c = 0; c < DV; ++c) {
                    const Vec vv = *reinterpret_cast<const Vec*>(sV + (n + e) * Tr::kRow + (tc + TC * c) * VEC);
#pragma unroll
                    for (int i = 0; i < RM; ++i)
#pragma unroll
                        for (int x = 0; x < VEC; ++x)
                            acc[i][c][x] = fma_<T>(pv[i].v[e], vv.v[x], acc[i][c][x]);
                }
        }
    }

    // Epilogue: l summed over the 8 lanes of the row; out = acc / l; LSE = m * scale + ln l (in T:
    // the backward recomputes P from it, exactly in float64).
#pragma unroll
    for (int i = 0; i < RM; ++i) {
        T l = row[i].l;
#pragma unroll
        for (int off = 1; off < TC; off <<= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
        const T inv = SoftmaxRow<T>::inv_l(l);
        const int r = m0 + tr + TR * i;
        if (r < seqlen_q) {
            T* o_row = o_base + (int64_t)r * p.o_row_stride;
#pragma unroll
            for (int c = 0; c < DV; ++c)
#pragma unroll
                for (int x = 0; x < VEC; ++x) {
                    const int col = (tc + TC * c) * VEC + x;
                    if (col < p.headdim) o_row[col] = acc[i][c][x] * inv;
                }
            if (tc == 0 && p.lse != nullptr) lse_base[r] = row[i].lse(l, scale_log2);
        }
    }
}

// One CTA of the CUDA-core forward (128 threads), for the shared entry cf::flash_fwd_entry
// (common/fwd_tile.cuh): cf::flash_fwd_entry<cf::FlashFwdSimt<T, HEADDIM, BLOCK_M, BLOCK_N, CAUSAL>, T>.
template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, bool CAUSAL>
struct FlashFwdSimt {
    static constexpr int kThreads = 128;
    static __device__ __forceinline__ void run(const FwdParams& p) {
        flash_fwd_simt_block<T, HEADDIM, BLOCK_M, BLOCK_N, CAUSAL>(p);
    }
};

}  // namespace cf
