// The TMA epilogue of a warpgroup (FlashAttention-3's): a 64-row output tile goes from the
// accumulator registers through shared memory to global memory by TMA stores. The forward writes
// O so (forward/hopper.cu); a backward writes dK and dV the same way.
//
// Protocol, per warpgroup (its named barrier `bar`, 128 threads; its thread 0, the leader,
// issues the stores):
//   1. leader: cp.async.bulk.wait_group.read 0 -- its previous tile's stores have read the
//      buffer; bar.sync (the buffer is free for every thread);
//   2. every thread writes its fragment (store_tile_swizzled), fence.proxy.async.shared::cta;
//      bar.sync (every write and fence is done);
//   3. leader: one TMA store per 64-column tile (tma_store_tile), commit.
// Before the leader exits: cp.async.bulk.wait_group 0 (the stores have read the shared memory).
#pragma once
#include "dtype.cuh"
#include "tma.cuh"

namespace cf {

// This thread's part of a 64 x (8 DT) tile (the warpgroup accumulator layout: warp w holds rows
// 16 w .. 16 w + 15, common/softmax_step.cuh), each row hh scaled by scale[hh], into `buf` as
// the TMA map's boxes (64 columns x 64 rows) read it, 128-byte swizzled: column tile c = d / 8 at
// c * 8 KB, row r at r * 128 bytes, its 16-byte chunk j = d % 8 at chunk j ^ (r % 8). A warp's 32
// four-byte stores of one (d, hh) hit 32 different banks (r % 8 = g).
template <typename T, int DT>
__device__ __forceinline__ void store_tile_swizzled(unsigned char* buf, const float (&o)[4 * DT],
                                                    const float (&scale)[2], int warp_in_wg,
                                                    int g, int t) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = warp_in_wg * 16 + g + 8 * hh;  // r % 8 == g
#pragma unroll
        for (int d = 0; d < DT; ++d)
            *reinterpret_cast<uint32_t*>(buf + (d >> 3) * (64 * 128) + r * 128 +
                                         (((d & 7) ^ g) << 4) + 4 * t) =
                pack2<T>(o[4 * d + 2 * hh] * scale[hh], o[4 * d + 2 * hh + 1] * scale[hh]);
    }
}

// The leader's stores of the tile at shared address `buf`: column tile c of the 4-D map `desc`
// at coordinates (c * 64, c1, c2, c3); elements outside the map (rows past the tensor, columns
// past its head dim) are not written, and column tiles at or past `ncols` are skipped (a head
// dim padded onto 256 can leave whole tiles outside).
template <int COL_TILES>
__device__ __forceinline__ void tma_store_tile(const TmaDesc* desc, uint32_t buf, int ncols,
                                               int c1, int c2, int c3) {
#pragma unroll
    for (int c = 0; c < COL_TILES; ++c)
        if (COL_TILES <= 2 || c * 64 < ncols)
            tma_store_4d(desc, buf + (uint32_t)(c * 64 * 128), c * 64, c1, c2, c3);
}

}  // namespace cf
