// The persistent grid's work: the tile scheduler (which tile a CTA runs next) and the hand-over
// of each tile's index from the producer warp to the consumer warpgroups.
#pragma once
#include "dtype.cuh"
#include "params.cuh"
#include "wgmma.cuh"

namespace cf {

// The persistent tile scheduler (FA3 Sec. 3.1's, for the forward; a backward walks its key
// blocks the same way). Work tile t = (m-block, head, batch), in this order: (batch,
// head) pairs in groups whose K and V together fit in a part of L2 (kL2Bytes), so that the CTAs
// running at the same time share them; inside a group, m-blocks (the heaviest, last ones first
// when causal: longest tiles first), and inside an m-block the group's heads. CTA i starts with
// tile i. Non-causal tiles all cost the same: CTA i then takes i + gridDim.x, i + 2 gridDim.x, ...
// (static). Causal tiles do not: the next tile goes to the CTA that asks first, from a global
// counter (dynamic; FA3's scheduler for causal masks): a static stride puts tiles of nearly the
// same length on the same CTA round after round when it is close to the number of m-blocks.
// Causal with fewer than kTailTilesPerCta tiles per CTA, the last group is the tail group: at
// least 2 gridDim.x / num_m_blocks heads (the groups before it keep their size), so that the
// work left after its longest tiles are handed out is about one longest tile per CTA or more.
// With one small last group its longest tiles go out when the other CTAs have only its short
// tiles left, and those CTAs then wait for them (hd256, S 2k-8k, ~8 tiles per CTA: SMs active
// ~89% of the kernel's time against FA3's ~98%; the tail group: 6-8% faster). With more tiles
// per CTA a longest tile is a smaller part of a CTA's work and the counter evens the end out
// (hd128 / hd64, 15-21 tiles per CTA: the tail group 3% slower / 0-3% faster; NOTES v73).
template <int BLOCK_M, bool CAUSAL>
struct TileScheduler {
    // 8 MB of the H100/H200's 50/60 MB: with 24 MB, DRAM reads were twice io_model's at S 4k-16k
    // (exp_hbm, NOTES v57): a group's K and V did not stay in L2 from one round of CTAs to the
    // next. 8 MB is about one round's worth of tiles (132 CTAs) at S >= 2k.
    static constexpr long long kL2Bytes = 8ll << 20;
    static constexpr int kTailTilesPerCta = 12;
    int num_m_blocks, num_bh, nheads, group, num_tiles;
    int tail_bh;  // first (batch, head) pair of the tail group (num_bh: no tail group)

    __device__ __forceinline__ TileScheduler(const FwdParams& p, int headdim) {
        num_m_blocks = (p.seqlen_q + BLOCK_M - 1) / BLOCK_M;
        nheads = p.nheads;
        num_bh = p.batch * p.nheads;
        num_tiles = num_m_blocks * num_bh;
        // K and V of one query head (16-bit), shared by h_per_kv query heads
        const long long kv_bytes = max(1ll, (long long)p.seqlen_k * headdim * 4 / p.h_per_kv);
        group = (int)max(1ll, min((long long)num_bh, kL2Bytes / kv_bytes));
        // a head's tiles add up to about num_m_blocks / 2 longest tiles
        const int tail_min = (2 * (int)gridDim.x + num_m_blocks - 1) / max(num_m_blocks, 1);
        const bool tail = CAUSAL && num_tiles < kTailTilesPerCta * (int)gridDim.x;
        tail_bh = tail ? num_bh - min(num_bh, max(group, tail_min)) : num_bh;
    }

    struct Work { int m_block, h, b; };

    // The tile after `t` for this CTA (the producer's thread asks; >= num_tiles: none left).
    // Dynamic: the counter starts at 0 and counts the requests; each CTA's last request is the
    // one that returns a tile >= num_tiles, so num_tiles - gridDim.x + gridDim.x = num_tiles
    // requests are made in all and the one that sees num_tiles - 1 resets the counter for the
    // next launch (kernels of one stream run one after the other).
    __device__ __forceinline__ int next(int t, int* counter) const {
        if (!CAUSAL) return t + (int)gridDim.x;
        const int ticket = atomicAdd(counter, 1);
        if (ticket == num_tiles - 1) atomicExch(counter, 0);
        return (int)gridDim.x + ticket;
    }


    __device__ __forceinline__ Work get(int t) const {
        const int head_tiles = tail_bh * num_m_blocks;  // the tiles before the tail group
        int first, size, r;
        if (t < head_tiles) {
            const int span = group * num_m_blocks;
            const int grp = t / span;
            first = grp * group;
            size = min(group, tail_bh - first);
            r = t - grp * span;
        } else {
            first = tail_bh;
            size = num_bh - tail_bh;
            r = t - head_tiles;
        }
        const int mi = r / size;
        const int bh = first + (r - mi * size);
        return Work{CAUSAL ? num_m_blocks - 1 - mi : mi, bh % nheads, bh / nheads};
    }
};

// The hand-over of each work tile's index from the producer warp to the consumer warpgroups,
// through one shared int between named barriers (FA3's tile scheduler does the same): the
// producer writes the index, then arrives on each consumer warpgroup's FULL0 + wg; a warpgroup
// syncs on its own, reads the index and arrives on EMPTY, on which the producer syncs (every
// consumer) before it writes the next one. One FULL barrier per warpgroup, so that a warpgroup
// starts its next tile without waiting for the others' epilogues. (Handed over with mbarriers,
// the same order held, but compute-sanitizer's racecheck does not follow mbarriers: 11 hazards.)
template <int WGS, int EMPTY, int FULL0>
struct TileHandoff {
    static constexpr int kEmptyThreads = 128 * WGS + 32;  // the consumers and the producer warp
    static constexpr int kFullThreads = 128 + 32;         // a warpgroup and the producer warp
    int* index;  // in shared memory

    // Producer warp (every lane; lane 0 writes): publish tile t, once the consumers have read
    // the previous one (`first`: no previous one).
    __device__ __forceinline__ void publish(int t, bool first, bool leader) const {
        if (!first) named_barrier_sync(EMPTY, kEmptyThreads);
        if (leader) *index = t;
        // (the arrivals after the write, in the caller's branches: see the producer)
    }
    __device__ __forceinline__ void signal() const {
#pragma unroll
        for (int c = 0; c < WGS; ++c) named_barrier_arrive(FULL0 + c, kFullThreads);
    }
    // Consumer warpgroup wg: the next tile's index (the producer may write the one after once
    // every warpgroup has called done()).
    __device__ __forceinline__ int receive(int wg) const {
        named_barrier_sync(FULL0 + wg, kFullThreads);
        return *index;
    }
    __device__ __forceinline__ void done() const { named_barrier_arrive(EMPTY, kEmptyThreads); }
};

}  // namespace cf
