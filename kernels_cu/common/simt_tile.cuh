// Tile helpers of the CUDA-core (float32 / float64) kernels, forward (forward/simt.cu) and
// backward (backward/simt.cu): a 16-byte vector of T and the plain coalesced tile copy into
// padded shared-memory rows, and the two products of a thread's sub-tile. Tr gives kThreads,
// kRow (padded row, elements), kVec (elements per 16 bytes), kTR x kTC (row groups x lanes per
// row group: thread (tr, tc) owns rows tr + kTR i and columns tc + kTC j of a score tile, and the
// 16-byte column chunks tc + kTC c of an accumulator row) and kDV (accumulator chunks per row).
#pragma once
#include "dtype.cuh"
#include "online_softmax.cuh"

namespace cf {

template <typename T, int N>
struct __align__(16) VecN { T v[N]; };

// Plain coalesced copy of a [ROWS x HEADDIM] tile into smem: one warp per row, lanes along the
// head dim; rows >= rows_valid and columns >= cols_valid are written as zeros (never read).
template <typename Tr, typename T, int ROWS, int HEADDIM>
__device__ __forceinline__ void load_tile_simt(T* s_tile, const T* g_tile, int64_t row_stride,
                                               int rows_valid, int cols_valid, int warp, int lane) {
    constexpr int kWarps = Tr::kThreads / 32;
#pragma unroll 4
    for (int r = warp; r < ROWS; r += kWarps) {
        const T* g_row = g_tile + (int64_t)r * row_stride;
#pragma unroll
        for (int c0 = 0; c0 < HEADDIM; c0 += 32) {
            const int c = c0 + lane;
            s_tile[r * Tr::kRow + c] = (r < rows_valid && c < cols_valid) ? g_row[c] : T(0);
        }
    }
}

// s[i][j] = A[tr + kTR i] . B[tc + kTC j] over the head dim (rows of two padded smem tiles),
// 16-byte smem loads: S = Q K^T, and the backward's S^T = K Q^T, dP = dO V^T, dP^T = V dO^T.
template <typename Tr, int HEADDIM, typename T, int R, int C>
__device__ __forceinline__ void simt_scores(T (&s)[R][C], const T* sA, const T* sB, int tr, int tc) {
    using Vec = VecN<T, Tr::kVec>;
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int j = 0; j < C; ++j) s[i][j] = T(0);
#pragma unroll 2
    for (int d = 0; d < HEADDIM; d += Tr::kVec) {
        Vec av[R];
#pragma unroll
        for (int i = 0; i < R; ++i)
            av[i] = *reinterpret_cast<const Vec*>(sA + (tr + Tr::kTR * i) * Tr::kRow + d);
#pragma unroll
        for (int j = 0; j < C; ++j) {
            const Vec bv = *reinterpret_cast<const Vec*>(sB + (tc + Tr::kTC * j) * Tr::kRow + d);
#pragma unroll
            for (int i = 0; i < R; ++i)
#pragma unroll
                for (int e = 0; e < Tr::kVec; ++e) s[i][j] = fma_<T>(av[i].v[e], bv.v[e], s[i][j]);
        }
    }
}

// acc[i][c][x] += sum_n P[tr + kTR i][n] V[n][(tc + kTC c) kVec + x] over N columns of P (padded
// rows of PROW elements in smem) and N rows of V (a padded smem tile): acc += P V, and the
// backward's dV += P^T dO, dK += dS^T Q, dQ += dS K.
template <typename Tr, int N, int PROW, typename T, int R>
__device__ __forceinline__ void simt_acc_pv(T (&acc)[R][Tr::kDV][Tr::kVec], const T* sP, const T* sV,
                                            int tr, int tc) {
    using Vec = VecN<T, Tr::kVec>;
#pragma unroll 1
    for (int n = 0; n < N; n += Tr::kVec) {
        Vec pv[R];
#pragma unroll
        for (int i = 0; i < R; ++i)
            pv[i] = *reinterpret_cast<const Vec*>(sP + (tr + Tr::kTR * i) * PROW + n);
#pragma unroll
        for (int e = 0; e < Tr::kVec; ++e)
#pragma unroll
            for (int c = 0; c < Tr::kDV; ++c) {
                const Vec vv = *reinterpret_cast<const Vec*>(sV + (n + e) * Tr::kRow + (tc + Tr::kTC * c) * Tr::kVec);
#pragma unroll
                for (int i = 0; i < R; ++i)
#pragma unroll
                    for (int x = 0; x < Tr::kVec; ++x)
                        acc[i][c][x] = fma_<T>(pv[i].v[e], vv.v[x], acc[i][c][x]);
            }
    }
}

}  // namespace cf
