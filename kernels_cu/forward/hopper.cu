// Tiled prefill forward for Hopper (sm_90a only), fp16 / bf16 inputs, fp32 accumulation:
// FlashAttention-3 (Shah et al., arXiv 2407.08608) built on the algorithm of FlashAttention-2
// (Dao, arXiv 2307.08691, Algorithm 1) and the one online softmax of common/online_softmax.cuh.
//
// A persistent CTA (at most one per SM) takes work tiles (BLOCK_M query rows of one head) from
// the tile scheduler (static when non-causal, a global counter when causal) and runs them one
// after the other. Its warpgroups have two roles (FA3 Sec. 3.1, "warp specialisation"):
//   * the producer (one warp of the last warpgroup, whose registers are given to the consumers
//     with setmaxnreg): TMA copies of the Q tile and of a ring of STAGES K and V tiles into
//     128-byte swizzled shared memory, each completing on a "full" mbarrier by its byte count; a
//     slot is refilled once every consumer warp has released it on its "empty" mbarrier;
//   * the consumers (BLOCK_M / 64 warpgroups of 64 query rows: two, or three for hd64's 192
//     rows): in step i a warpgroup issues S_{i+1} = Q K_{i+1}^T and O += P_i V_i on the tensor
//     cores, runs the softmax of S_{i+1} in place (fp32 probabilities over S) while P_i V_i runs
//     (FA3 Sec. 3.2, intra-warpgroup overlap), then, P_i V_i done, rescales O and packs the
//     probabilities into P's registers (one P buffer, FA3's form); the warpgroups take turns
//     issuing their GEMMs, round-robin (named barriers: FA3 Sec. 3.1's ping-pong with two
//     warpgroups, 0, 1, 2, 0, ... with three); the output is normalised once and, for dense
//     problems, written through shared memory by TMA stores (FA3's epilogue): an O buffer per
//     warpgroup at hd64 / hd128, the V ring at hd256 (kOInV); else from registers.
// The O buffer protocol (per consumer warpgroup, named barrier 6 + wg, 128 threads; its thread
// 0, the "leader", issues the stores): [leader: cp.async.bulk.wait_group.read 0 -- its previous
// tile's stores have read the buffer] bar.sync; every thread writes its O fragment (swizzled),
// fence.proxy.async.shared::cta; bar.sync; leader: one TMA store per 64-column tile, commit.
// Before the leader exits: cp.async.bulk.wait_group 0. The LSE stays a plain store. kOInV (the
// O tiles over the V ring): first a bar.sync of every consumer (all last P V GEMMs have read
// V), and after the commit the leader waits for the stores' reads and arrives on o_free; the
// producer loads a work tile's first V once o_free has completed for every earlier tile.
// The producer hands each tile's index to the consumers (shared memory, between two named
// barriers), so both roles walk the same tiles and the same ring positions.
// Varlen (packed sequences, cu_seqlens): the tensor maps see the packed tensors as one batch
// entry of total-token rows, and a tile's copies start at its sequence's first row. Rows past a
// sequence's end then hold the next sequence's tokens (or TMA's zeros past the tensor): query
// rows are independent and not stored, keys are masked in S (a select: NaN gives -inf), and
// the V rows, which P (0 there) would multiply, are zeroed by the producer (0 * NaN = NaN;
// design.md, Semantics 5).
// The consumers compute no load address and issue no copy: every instruction they issue is
// GEMM, softmax or a barrier. Shared-memory layouts and descriptors: common/wgmma.cuh.
#include "common/dtype.cuh"
#include "common/params.cuh"
#include "common/sequence.cuh"
#include "common/mask.cuh"
#include "common/online_softmax.cuh"
#include "common/mma.cuh"
#include "common/wgmma.cuh"
#include "common/wg_softmax.cuh"
#include "common/tma.cuh"
#include "common/fwd_entry.cuh"

namespace cf {

template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, int STAGES>
struct HopperFwdTraits {
    static constexpr int kConsumerWGs = BLOCK_M / 64;
    static constexpr int kConsumerThreads = 128 * kConsumerWGs;
    static constexpr int kConsumerWarps = 4 * kConsumerWGs;
    static constexpr int kThreads = kConsumerThreads + 128;  // + the producer warpgroup
    static constexpr int kColTiles = HEADDIM / 64;            // 64-element (128-byte) column tiles
    static constexpr int kQBytes = BLOCK_M * HEADDIM * 2;
    static constexpr int kKVBytes = BLOCK_N * HEADDIM * 2;
    // full_k, full_v, empty_k, empty_v per ring slot; q_full, q_empty, v_landed
    static constexpr int kBarriers = 4 * STAGES + 3;
    // Q, the K and V rings, the barriers, the tile index (8 bytes), and 1024 bytes to align the
    // base to the swizzle repeat; then, where they fit in sm_90's 227 KB (hd64, hd128; not
    // hd256), one O buffer per consumer warpgroup (64 x HEADDIM, 128-byte swizzled as the TMA
    // store reads it: the epilogue below). cupyflash/forward/kernels.py computes the same numbers.
    static constexpr int kSmemBase = kQBytes + 2 * STAGES * kKVBytes + 8 * kBarriers + 8 + 1024;
    static constexpr int kOWGBytes = 64 * HEADDIM * 2;        // one warpgroup's O tile
    static constexpr bool kOStore = kSmemBase + kConsumerWGs * kOWGBytes <= 227 * 1024;
    static constexpr int kOBytes = kOStore ? kConsumerWGs * kOWGBytes : 0;
    // Without room for O buffers (hd256), the O tiles go through the V ring instead (FA3's
    // epilogue there) when they fit in it: the producer then loads a work tile's first V only
    // once the previous tiles' stores have read O (one more mbarrier, o_free, after the index).
    static constexpr bool kOInV = !kOStore && kConsumerWGs * kOWGBytes <= STAGES * kKVBytes;
    static constexpr int kSmemBytes = kSmemBase + kOBytes + (kOInV ? 8 : 0);
    // setmaxnreg: the registers the launch gives each thread (the register file's 64K over the
    // CTA's threads, in steps of 8: 168 at 384 threads, 128 at 512) move from the producer
    // warpgroup to the consumers, FA3's split: 24 / 240 with two consumer warpgroups (O, S and
    // P of hd128 take 160 of them), 32 / 160 with three (hd64: 128). The counts must add up to
    // the CTA's allocation exactly: with a producer at 32 beside two consumers at 240 the
    // consumers' setmaxnreg.inc waited forever for registers (an H200 hang).
    static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8;
    static constexpr int kProducerRegs = kConsumerWGs == 2 ? 24 : 32;
    static constexpr int kConsumerRegs = kConsumerWGs == 2 ? 240 : 160;
    static constexpr int kSAcc = BLOCK_N / 2;                 // S floats per thread (64 x BLOCK_N)
    static constexpr int kOAcc = HEADDIM / 2;                 // O floats per thread (64 x HEADDIM)
    static constexpr int kQKSteps = HEADDIM / 16;             // k16 steps of Q K^T
    static constexpr int kPVSteps = BLOCK_N / 16;             // k16 steps of P V
    static constexpr int kNTiles = BLOCK_N / 8;               // 8-key column groups of S
    static constexpr int kDTiles = HEADDIM / 8;               // 8-column groups of O
    static constexpr int kON = HEADDIM < 128 ? HEADDIM : 128; // N of one P V wgmma
    static constexpr int kOChunks = HEADDIM / kON;            // P V wgmmas per k-step

    static_assert(sizeof(T) == 2, "wgmma path is for 16-bit inputs");
    static_assert(HEADDIM == 64 || HEADDIM == 128 || HEADDIM == 256, "compiled head dims: 64, 128, 256");
    static_assert(BLOCK_M == 128 || BLOCK_M == 192, "two or three consumer warpgroups");
    static_assert(BLOCK_N == 80 || BLOCK_N == 128, "BLOCK_N: an N of common/wgmma.cuh");
    static_assert(STAGES >= 2 && STAGES <= 3, "K/V ring of 2 or 3 tiles");
    static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads == kLaunchRegs * kThreads,
                  "setmaxnreg: the counts add up to the launch's registers");
    // sm_90's opt-in limit; also keeps every shared address below 2^18, the reach of the
    // descriptors' 14-bit (address >> 4) field (common/wgmma.cuh)
    static_assert(kSmemBytes <= 227 * 1024, "shared memory of the configuration");
};

// The persistent tile scheduler. Work tile t = (m-block, head, batch), in this order: (batch,
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
struct FwdTileScheduler {
    // 8 MB of the H100/H200's 50/60 MB: with 24 MB, DRAM reads were twice io_model's at S 4k-16k
    // (exp_hbm, NOTES v57): a group's K and V did not stay in L2 from one round of CTAs to the
    // next. 8 MB is about one round's worth of tiles (132 CTAs) at S >= 2k.
    static constexpr long long kL2Bytes = 8ll << 20;
    static constexpr int kTailTilesPerCta = 12;
    int num_m_blocks, num_bh, nheads, group, num_tiles;
    int tail_bh;  // first (batch, head) pair of the tail group (num_bh: no tail group)

    __device__ __forceinline__ FwdTileScheduler(const FwdParams& p, int headdim) {
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

// One work tile as both roles see it: its sequence, first row and key tiles, and the TMA
// coordinates of its copies: the rows of its first query and of its sequence's key 0, and the
// batch entry (0 when varlen: cupyflash/core/tma.py maps the packed tensors as one entry).
template <int BLOCK_M, int BLOCK_N, bool CAUSAL>
struct FwdWork {
    FwdSeq seq;
    int m0, b, h, n_block_min, n_tiles;
    int q_row, k_row, tma_b;
    KeyTiles<BLOCK_N> tiles;

    __device__ __forceinline__ FwdWork(const FwdParams& p,
                                       const typename FwdTileScheduler<BLOCK_M, CAUSAL>::Work& w)
        : seq(fwd_seq(p, w.b, w.h)), m0(w.m_block * BLOCK_M), b(w.b), h(w.h),
          tiles(m0, min(m0 + BLOCK_M, seq.seqlen_q) - 1, seq.seqlen_q, seq.seqlen_k, CAUSAL,
                p.window_left, p.window_right) {
        n_block_min = tiles.n_block_min;
        n_tiles = m0 < seq.seqlen_q ? tiles.n_block_max - tiles.n_block_min : 0;
        const bool varlen = p.cu_seqlens_q != nullptr;
        q_row = (varlen ? p.cu_seqlens_q[b] : 0) + m0;
        k_row = varlen ? p.cu_seqlens_k[b] : 0;
        tma_b = varlen ? 0 : b;
    }
    __device__ __forceinline__ bool empty() const { return m0 >= seq.seqlen_q; }
};

template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, bool CAUSAL, int STAGES>
__device__ __forceinline__ void flash_fwd_hopper_block(const FwdParams& p, const TmaDesc& tq,
                                                       const TmaDesc& tk, const TmaDesc& tv,
                                                       const TmaDesc& to, int* tile_counter,
                                                       int o_map_ok) {
    using Tr = HopperFwdTraits<T, HEADDIM, BLOCK_M, BLOCK_N, STAGES>;
    using Sched = FwdTileScheduler<BLOCK_M, CAUSAL>;
    using Work = FwdWork<BLOCK_M, BLOCK_N, CAUSAL>;
    using MmaS = Wgmma<T, BLOCK_N>;   // S (64 x BLOCK_N) = Q K^T
    using MmaO = Wgmma<T, Tr::kON>;   // O (64 x kON) += P V, kOChunks times
    constexpr int S = STAGES;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t sQ = (smem_u32addr(smem_raw) + 1023u) & ~1023u;  // swizzle repeat alignment
    const uint32_t sK = sQ + Tr::kQBytes;                            // K ring: S tiles
    const uint32_t sV = sK + S * Tr::kKVBytes;                       // V ring: S tiles
    const uint32_t sO = sV + S * Tr::kKVBytes;                       // O buffers (kOStore)
    const uint32_t bars = sO + Tr::kOBytes;                          // mbarriers, 8 bytes each
    auto full_k = [&](int st) { return bars + 8u * (uint32_t)st; };
    auto full_v = [&](int st) { return bars + 8u * (uint32_t)(S + st); };
    auto empty_k = [&](int st) { return bars + 8u * (uint32_t)(2 * S + st); };
    auto empty_v = [&](int st) { return bars + 8u * (uint32_t)(3 * S + st); };
    const uint32_t q_full = bars + 8u * (uint32_t)(4 * S), q_empty = q_full + 8u;
    // a varlen sequence's last V tile lands here first (the producer cleans it, then fills full_v)
    const uint32_t v_landed = q_empty + 8u;
    // kOInV: completes once per epilogue (one arrival per consumer warpgroup, once its stores
    // have read the O tile out of the V ring); after the 8-byte tile index
    const uint32_t o_free = bars + 8u * (uint32_t)Tr::kBarriers + 8u;
    // The producer hands each work tile's index to the consumers through shared memory, between
    // named barriers (FA3's tile scheduler does the same): it writes the index, then arrives on
    // each consumer warpgroup's kTileFull + wg; a warpgroup syncs on its own, reads the index and
    // arrives on kTileEmpty, on which the producer syncs (every consumer) before it writes the
    // next one. One kTileFull per warpgroup, so that a warpgroup starts its next tile without
    // waiting for the others' epilogues. (Handed over with q_full / q_empty, the same order held,
    // but compute-sanitizer's racecheck does not follow mbarriers: 11 hazards.)
    constexpr int kTileEmpty = 4, kTileFull = 9;  // 1 .. 3: the turns; 6 .. 8: the epilogue (below)
    constexpr int kTileThreads = Tr::kConsumerThreads + 32;  // the consumers and the producer warp
    constexpr int kTileFullThreads = 128 + 32;               // a warpgroup and the producer warp
    int& s_tile = *reinterpret_cast<int*>(smem_raw + (bars + 8u * Tr::kBarriers - smem_u32addr(smem_raw)));

    const int tid = threadIdx.x;
    // The warpgroup index, broadcast from lane 0 so that the compiler knows it is warp-uniform:
    // a role branch it thinks divergent makes ptxas serialise every wgmma behind it (C7520).
    const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);
    if (tid == 0) {
        // full: the producer's expect-tx arrival plus the bytes; empty: one arrival per
        // consumer warp once its wgmma that read the tile has completed
        for (int st = 0; st < S; ++st) {
            mbarrier_init(full_k(st), 1);
            mbarrier_init(full_v(st), 1);
            mbarrier_init(empty_k(st), Tr::kConsumerWarps);
            mbarrier_init(empty_v(st), Tr::kConsumerWarps);
        }
        mbarrier_init(q_full, 1);
        mbarrier_init(q_empty, Tr::kConsumerWarps);
        mbarrier_init(v_landed, 1);
        if (Tr::kOInV) mbarrier_init(o_free, Tr::kConsumerWGs);
        fence_proxy_async();  // the initialised barriers, before TMA completes bytes on them
    }
    __syncthreads();

    // The epilogue writes O through shared memory and TMA stores (FA3) when the kernel has room
    // for the O tiles (kOStore: their own buffers; kOInV: the V ring), the host encoded the O
    // map (o_map_ok: dense, and out's strides and base are ones a tensor map accepts) and the
    // problem is dense (a varlen tile's box would run past its sequence into the next one's
    // rows); else from registers. Both roles need it: with kOInV the producer waits for o_free.
    const bool o_store = (Tr::kOStore || Tr::kOInV) && o_map_ok != 0 && p.cu_seqlens_q == nullptr;
    const bool o_in_v = Tr::kOInV && o_store;

    // ============================== producer ==============================
    if (wg == Tr::kConsumerWGs) {
        warpgroup_reg_dealloc<Tr::kProducerRegs>();
        // One warp produces, the other three leave. Lane 0 issues every copy and arrival; the
        // whole warp walks the tiles and waits with it, to zero V rows together (below).
        if (tid >= Tr::kConsumerThreads + 32) return;
        // Each role builds the scheduler after its setmaxnreg: no value lives across the change
        // of register count (built before it, some were spilled for the 24-register producer).
        const Sched sched(p, HEADDIM);
        const int lane = tid & 31;
        const bool leader = lane == 0;
        if (leader) {
            tma_prefetch_desc(&tq);
            tma_prefetch_desc(&tk);
            tma_prefetch_desc(&tv);
        }
        // The tile after t: lane 0 asks (the causal counter counts one request per CTA and
        // tile), the warp takes its answer.
        auto next_tile = [&](int t) {
            int n = 0;
            if (leader) n = sched.next(t, tile_counter);
            return __shfl_sync(0xffffffffu, n, 0);
        };
        // Rows [valid, BLOCK_N) of the V slot at `slot` set to zero in every 64-column tile:
        // whole 128-byte rows, which the 128-byte swizzle leaves in place (it only moves the
        // 16-byte chunks inside a row), 16 bytes per lane and store.
        auto zero_v_rows = [&](uint32_t slot, int valid) {
            uint4* chunks = reinterpret_cast<uint4*>(smem_raw + (slot - smem_u32addr(smem_raw)));
#pragma unroll
            for (int c = 0; c < Tr::kColTiles; ++c)
                for (int i = valid * 8 + lane; i < BLOCK_N * 8; i += 32)
                    chunks[c * BLOCK_N * 8 + i] = make_uint4(0u, 0u, 0u, 0u);
        };
        const bool varlen = p.cu_seqlens_k != nullptr;
        int kv = 0;       // K/V tiles loaded so far (ring position and phase)
        int v_tails = 0;  // V tiles that landed on v_landed so far (its phase)
        int epilogues = 0;  // non-empty work tiles handed out so far (o_free's completions)
        for (int t = blockIdx.x, qn = 0;; t = next_tile(t), ++qn) {
            // the tile's index, once the consumers have read the previous one and their last
            // Q K^T of it has completed; t >= num_tiles tells them to stop
            if (qn > 0) {
                mbarrier_wait(q_empty, (uint32_t)((qn - 1) & 1));
                named_barrier_sync(kTileEmpty, kTileThreads);
            }
            if (leader) s_tile = t;
            // (the arrivals in each branch: with them before the test, ptxas spilled 40 bytes of
            // the 24-register producer)
            if (t >= sched.num_tiles) {
#pragma unroll
                for (int c = 0; c < Tr::kConsumerWGs; ++c)
                    named_barrier_arrive(kTileFull + c, kTileFullThreads);
                break;
            }
#pragma unroll
            for (int c = 0; c < Tr::kConsumerWGs; ++c)
                named_barrier_arrive(kTileFull + c, kTileFullThreads);
            const Work w(p, sched.get(t));
            // o_in_v: the first V of this tile waits until the stores of every earlier tile have
            // read O out of the V ring (the o_wait-th completion of o_free). A parity wait is
            // enough: here the consumers have finished every earlier epilogue but the latest
            // (they read the previous index after the one before it), and cannot finish this
            // tile's before its first V.
            const int o_wait = epilogues;
            if (!w.empty()) ++epilogues;
            if (w.n_tiles <= 0) {  // no key: the consumers write 0 and -inf without Q
                if (leader) mbarrier_arrive(q_full);
                continue;
            }
            if (leader) {
                mbarrier_arrive_expect_tx(q_full, Tr::kQBytes);
#pragma unroll
                for (int c = 0; c < Tr::kColTiles; ++c)
                    tma_load_4d(sQ + (uint32_t)(c * BLOCK_M * 128), &tq, c * 64, w.h, w.q_row,
                                w.tma_b, q_full);
            }
            const int hk = w.h / p.h_per_kv;
            for (int j = 0; j < w.n_tiles; ++j, ++kv) {
                const int st = kv % S, n0 = (w.n_block_min + j) * BLOCK_N;
                const uint32_t release = (uint32_t)((kv / S - 1) & 1);  // the previous use's phase
                const uint32_t k_slot = sK + (uint32_t)(st * Tr::kKVBytes);
                const uint32_t v_slot = sV + (uint32_t)(st * Tr::kKVBytes);
                if (kv >= S) mbarrier_wait(empty_k(st), release);
                if (leader) {
                    mbarrier_arrive_expect_tx(full_k(st), Tr::kKVBytes);
#pragma unroll
                    for (int c = 0; c < Tr::kColTiles; ++c)
                        tma_load_4d(k_slot + (uint32_t)(c * BLOCK_N * 128), &tk, c * 64, hk,
                                    w.k_row + n0, w.tma_b, full_k(st));
                }
                // The tile that runs past a varlen sequence's end: its V lands on v_landed, the
                // warp zeroes the rows past the end, then lane 0 completes full_v's phase with
                // its one arrival (no bytes). Dense maps end at seqlen_k: TMA zero-fills there.
                const bool v_tail = varlen && n0 + BLOCK_N > w.seq.seqlen_k;
                const uint32_t v_bar = v_tail ? v_landed : full_v(st);
                if (o_in_v && j == 0 && o_wait > 0)
                    mbarrier_wait(o_free, (uint32_t)((o_wait - 1) & 1));
                if (kv >= S) mbarrier_wait(empty_v(st), release);
                if (leader) {
                    mbarrier_arrive_expect_tx(v_bar, Tr::kKVBytes);
#pragma unroll
                    for (int c = 0; c < Tr::kColTiles; ++c)
                        tma_load_4d(v_slot + (uint32_t)(c * BLOCK_N * 128), &tv, c * 64, hk,
                                    w.k_row + n0, w.tma_b, v_bar);
                }
                if (v_tail) {
                    // one copy at a time on v_landed: its k-th completion has parity k & 1
                    mbarrier_wait(v_landed, (uint32_t)(v_tails & 1));
                    ++v_tails;
                    zero_v_rows(v_slot, w.seq.seqlen_k - n0);
                    fence_proxy_async();  // the zeros (generic proxy) before wgmma's reads (async)
                    __syncwarp();         // every lane's zeros and fence before lane 0's arrival
                    if (leader) mbarrier_arrive(full_v(st));
                }
            }
        }
        return;
    }

    // ============================== consumers ==============================
    warpgroup_reg_alloc<Tr::kConsumerRegs>();
    const Sched sched(p, HEADDIM);  // (after setmaxnreg, as the producer's)
    const int lane = tid & 31, warp_in_wg = (tid >> 5) & 3;
    const int g = lane >> 2, t4 = lane & 3;
    const float scale_log2 = p.scale_log2;
    const bool o_leader = (tid & 127) == 0;  // issues, commits and waits for its stores
    // this warpgroup's O tile: its buffer, or (kOInV) its part of the V ring
    const uint32_t sO_wg = (Tr::kOInV ? sV : sO) + (uint32_t)(wg * Tr::kOWGBytes);
    // + wg: the warpgroup's epilogue barrier (1-4 and 9-11 taken above); + kWGs (kOInV): every
    // consumer, before O goes over the V ring
    constexpr int kOBar = 6;
    static_assert(kOBar + Tr::kConsumerWGs + (Tr::kOInV ? 1 : 0) <= kTileFull,
                  "named barrier ids: the epilogue's run into the tile index's");
    if (o_store && o_leader) tma_prefetch_desc(&to);
    // A warp releases a slot (or Q) once its wgmma that read it has completed: wgmma_wait is
    // warp-synchronous, so one lane arrives for the warp.
    auto release = [&](uint32_t bar) { if (lane == 0) mbarrier_arrive(bar); };
    auto wait_k = [&](int it) { mbarrier_wait(full_k(it % S), (uint32_t)((it / S) & 1)); };
    auto wait_v = [&](int it) { mbarrier_wait(full_v(it % S), (uint32_t)((it / S) & 1)); };

    // Descriptors: one base per operand and call, made opaque so that the compiler cannot hoist
    // one 64-bit descriptor per k-step out of the loop (2 registers each); k-step offsets are
    // added to the address field (16-byte units; shared addresses stay below 2^18 bytes).
    const uint32_t sQ_wg = sQ + (uint32_t)(wg * 64 * 128);  // this warpgroup's 64 rows
    auto opaque = [](uint64_t d) { asm volatile("" : "+l"(d)); return d; };
    // S = Q K^T of ring tile it (issued, committed, not waited for).
    auto issue_qk = [&](float (&s)[Tr::kSAcc], int it) {
        const uint64_t dq = opaque(wgmma_desc_sw128(sQ_wg, 16, 1024));
        const uint64_t dk = opaque(wgmma_desc_sw128(sK + (uint32_t)(it % S) * Tr::kKVBytes, 16, 1024));
#pragma unroll
        for (int ks = 0; ks < Tr::kQKSteps; ++ks) {
            // k-step ks: column tile ks / 4, 32 bytes per k-step inside the 128-byte row
            const uint64_t qo = (uint64_t)(((ks >> 2) * BLOCK_M * 128 + (ks & 3) * 32) >> 4);
            const uint64_t ko = (uint64_t)(((ks >> 2) * BLOCK_N * 128 + (ks & 3) * 32) >> 4);
            MmaS::ss(s, dq + qo, dk + ko, ks > 0 ? 1 : 0);
        }
        wgmma_commit();
    };
    // O += P V of ring tile it (issued, committed, not waited for); head dims above 128 as
    // kOChunks wgmmas of N = 128 (column tiles 2c, 2c + 1 of V, registers 64c .. of O).
    auto issue_pv = [&](float (&o)[Tr::kOAcc], uint32_t (&pf)[Tr::kPVSteps][4], int it) {
        const uint64_t dv = opaque(wgmma_desc_sw128(sV + (uint32_t)(it % S) * Tr::kKVBytes,
                                                    (uint32_t)(BLOCK_N * 128), 1024));
#pragma unroll
        for (int kk = 0; kk < Tr::kPVSteps; ++kk)  // keys 16 kk .. 16 kk + 15: 16 rows of 128 bytes
#pragma unroll
            for (int c = 0; c < Tr::kOChunks; ++c)
                MmaO::rs_tn(*reinterpret_cast<float (*)[Tr::kON / 2]>(o + c * (Tr::kON / 2)), pf[kk],
                            dv + (uint64_t)((kk * 16 * 128 + c * 2 * BLOCK_N * 128) >> 4), 1);
        wgmma_commit();
    };

    // Turns (FA3's warp scheduler barriers): the consumer warpgroups issue their GEMMs one after
    // the other, 0, 1, (2,) 0, ...: warpgroup wg waits on barrier 1 + wg, issues, and hands the
    // turn to the next one on its barrier (128 threads arrive, 128 sync: 256 per phase). The
    // order runs on across work tiles (every warpgroup takes n_tiles + 1 turns in a tile), so
    // that one warpgroup's first Q K^T of a tile runs while the next finishes its epilogue: the
    // last warpgroup hands warpgroup 0 the kernel's first turn, and warpgroup 0 takes the one
    // left over after the last tile.
    constexpr int kWGs = Tr::kConsumerWGs;
    const int next_wg = wg + 1 < kWGs ? wg + 1 : 0;
    auto my_turn = [&]() { named_barrier_sync(1 + wg, 256); };
    auto pass_turn = [&]() { named_barrier_arrive(1 + next_wg, 256); };
    if (wg == kWGs - 1) pass_turn();
    int kv = 0;  // ring position, in step with the producer
    for (int qn = 0;; ++qn) {
        named_barrier_sync(kTileFull + wg, kTileFullThreads);  // the next tile's index
        const int tile = s_tile;
        if (tile >= sched.num_tiles) break;
        named_barrier_arrive(kTileEmpty, kTileThreads);
        mbarrier_wait(q_full, (uint32_t)(qn & 1));  // its Q, if it has keys
        const Work w(p, sched.get(tile));
        if (w.n_tiles <= 0) release(q_empty);  // no Q to read: the producer may go on at once
        if (w.empty()) continue;
        const int row0 = w.m0 + wg * 64 + warp_in_wg * 16 + g;  // this thread's rows: row0, row0 + 8
        float o[Tr::kOAcc];
#pragma unroll
        for (int i = 0; i < Tr::kOAcc; ++i) o[i] = 0.f;
        SoftmaxRow<float> row[2];
        row[0].init();
        row[1].init();
        auto softmax = [&](float (&s)[Tr::kSAcc], float (&alpha)[2], int nb) {
            if (w.tiles.needs_mask(nb)) {
                // The rows' key bounds are derived from row0 in each masked step (a few integer
                // instructions, on boundary tiles only): row0 is made opaque here so that the
                // compiler cannot hoist them out of the key loop, where they took 4-6 registers
                // per thread for the whole loop and the hd128 causal kernel spilled (16 / 28
                // bytes at 240 registers; 0 now).
                int r0 = row0;
                asm volatile("" : "+r"(r0));
                wg_softmax_step<BLOCK_N, Tr::kNTiles, true>(s, row, alpha, r0, nb * BLOCK_N, t4, p,
                                                            w.seq.seqlen_q, w.seq.seqlen_k,
                                                            CAUSAL, scale_log2);
            } else
                wg_softmax_step<BLOCK_N, Tr::kNTiles, false>(s, row, alpha, row0, nb * BLOCK_N, t4,
                                                             p, w.seq.seqlen_q, w.seq.seqlen_k,
                                                             CAUSAL, scale_log2);
        };
        const int n_tiles = w.n_tiles;
        if (n_tiles > 0) {
            // ---- prologue: S_0 and its softmax ----
            uint32_t p_cur[Tr::kPVSteps][4];
            {
                float s[Tr::kSAcc];
                wait_k(kv);
                my_turn();
                wgmma_fence();
                issue_qk(s, kv);
                pass_turn();
                wgmma_wait<0>();
                wgmma_fence_operand(s);
                release(empty_k(kv % S));
                if (n_tiles == 1) release(q_empty);
                float alpha[2];
                softmax(s, alpha, w.n_block_min);
                wg_pack_p<T, BLOCK_N>(s, p_cur);
            }

            // ---- main loop: step i consumes V_i (P_i V_i) and K_{i+1} (S_{i+1}) ----
            for (int i = 0; i + 1 < n_tiles; ++i) {
                const int it = kv + i;
                wait_k(it + 1);
                my_turn();
                float s[Tr::kSAcc];
                // O and P_i were last written by ordinary instructions (rescale, pack)
                wgmma_fence_operand(o);
                wgmma_fence_operand(p_cur);
                wgmma_fence();
                issue_qk(s, it + 1);
                // V_i only now: the Q K^T runs while a late V copy lands (the first V of a tile
                // at hd256, whose ring held the previous tile's O until its stores read it)
                wait_v(it);
                issue_pv(o, p_cur, it);
                pass_turn();
                float alpha[2];
                wgmma_wait<1>();                   // S_{i+1} is done; P_i V_i may still run
                wgmma_fence_operand(s);
                release(empty_k((it + 1) % S));
                if (i + 2 == n_tiles) release(q_empty);  // the tile's last Q K^T
                softmax(s, alpha, w.n_block_min + i + 1);
                wgmma_wait<0>();                   // P_i V_i is done: O and P_i are free
                wgmma_fence_operand(p_cur);
                wgmma_fence_operand(o);
                release(empty_v(it % S));
#pragma unroll
                for (int d = 0; d < Tr::kDTiles; ++d) {
                    o[4 * d + 0] *= alpha[0];
                    o[4 * d + 1] *= alpha[0];
                    o[4 * d + 2] *= alpha[1];
                    o[4 * d + 3] *= alpha[1];
                }
                wg_pack_p<T, BLOCK_N>(s, p_cur);
            }
            // ---- last step: P V of the last key tile ----
            {
                const int it = kv + n_tiles - 1;
                wait_v(it);
                my_turn();
                wgmma_fence_operand(o);
                wgmma_fence_operand(p_cur);
                wgmma_fence();
                issue_pv(o, p_cur, it);
                pass_turn();
                wgmma_wait<0>();
                wgmma_fence_operand(o);
                release(empty_v(it % S));
            }
            kv += n_tiles;
        }

        // ---- epilogue: l summed over the quad; out = O / l (0 for an empty row); LSE ----
        T* o_base = static_cast<T*>(p.o) + w.seq.o_off;
        float* lse_base = p.lse + w.seq.lse_off;
        float inv[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float l = row[hh].l;
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            inv[hh] = SoftmaxRow<float>::inv_l(l);
            const int r = row0 + 8 * hh;
            if (r < w.seq.seqlen_q && t4 == 0 && p.lse != nullptr)  // NULL: not asked for
                lse_base[r] = row[hh].lse(l, scale_log2);
        }
        if (o_store) {
            // O through shared memory: the warpgroup's 64 rows into its buffer as the O map's
            // boxes (64 columns x 64 rows) read it, 128-byte swizzled: column tile c = d / 8 at
            // c * 8 KB, row r at r * 128 bytes, its 16-byte chunk j = d % 8 at chunk j ^ (r % 8).
            // A warp's 32 four-byte stores of one (d, hh) hit 32 different banks (r % 8 = g).
            // The leader's previous stores have read the buffer (wait_group.read), then the
            // barrier lets the warpgroup overwrite it.
            if (o_leader) bulk_wait_group_read<0>();
            // kOInV: every warpgroup's last P V has read the V ring before any O is written
            // over it (the warpgroups' O tiles straddle both ring slots)
            if (Tr::kOInV) named_barrier_sync(kOBar + kWGs, Tr::kConsumerThreads);
            named_barrier_sync(kOBar + wg, 128);
            unsigned char* o_sm = smem_raw + (sO_wg - smem_u32addr(smem_raw));
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int r = warp_in_wg * 16 + g + 8 * hh;  // r % 8 == g
#pragma unroll
                for (int d = 0; d < Tr::kDTiles; ++d)
                    *reinterpret_cast<uint32_t*>(o_sm + (d >> 3) * (64 * 128) + r * 128 +
                                                 (((d & 7) ^ g) << 4) + 4 * t4) =
                        pack2<T>(o[4 * d + 2 * hh] * inv[hh], o[4 * d + 2 * hh + 1] * inv[hh]);
            }
            fence_proxy_async();                  // the generic writes, before TMA's reads
            named_barrier_sync(kOBar + wg, 128);  // every thread's writes and fence
            if (o_leader) {
                // rows past seqlen_q and columns past headdim are outside the map: not written;
                // at hd256 a column tile can lie wholly past the head dim (hd136-192): skipped
                const int r0 = w.m0 + wg * 64;
                if (r0 < w.seq.seqlen_q) {
#pragma unroll
                    for (int c = 0; c < Tr::kColTiles; ++c)
                        if (Tr::kColTiles <= 2 || c * 64 < p.headdim)
                            tma_store_4d(&to, sO_wg + (uint32_t)(c * 64 * 128), c * 64, w.h,
                                         r0, w.b);
                }
                bulk_commit_group();
                if (o_in_v) {  // the V ring is the producer's again once the stores read it
                    bulk_wait_group_read<0>();
                    mbarrier_arrive(o_free);
                }
            }
        } else {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int r = row0 + 8 * hh;
                if (r < w.seq.seqlen_q) {
                    T* o_row = o_base + (int64_t)r * p.o_row_stride;
#pragma unroll
                    for (int d = 0; d < Tr::kDTiles; ++d) {
                        const int col = d * 8 + 2 * t4;
                        if (col < p.headdim)
                            *reinterpret_cast<uint32_t*>(o_row + col) = pack2<T>(
                                o[4 * d + 2 * hh] * inv[hh], o[4 * d + 2 * hh + 1] * inv[hh]);
                    }
                }
            }
        }
    }
    if (wg == 0) my_turn();  // the last turn passed (or the first, if the CTA had no keyed tile)
    // The shared memory of the CTA outlives no thread: the stores complete before their leader
    // exits (their reads of the O buffers above all).
    if (o_store && o_leader) bulk_wait_group<0>();
}

// One CTA of the TMA forward, for flash_fwd_tma_entry below: the name expression is
// cf::flash_fwd_tma_entry<cf::FlashFwdHopper<T, HEADDIM, BLOCK_M, BLOCK_N, CAUSAL, STAGES>, T>.
template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, bool CAUSAL, int STAGES>
struct FlashFwdHopper {
    static constexpr int kThreads = HopperFwdTraits<T, HEADDIM, BLOCK_M, BLOCK_N, STAGES>::kThreads;
    static __device__ __forceinline__ void run(const FwdParams& p, const TmaDesc& tq,
                                               const TmaDesc& tk, const TmaDesc& tv,
                                               const TmaDesc& to, int* tile_counter,
                                               int o_map_ok) {
        flash_fwd_hopper_block<T, HEADDIM, BLOCK_M, BLOCK_N, CAUSAL, STAGES>(
            p, tq, tk, tv, to, tile_counter, o_map_ok);
    }
};

// The entry: four tensor maps (q, k, v, o as 4-D (headdim, nheads, seqlen, batch) tensors of T,
// boxes of 64 x 1 x BLOCK_M (q), BLOCK_N (k, v) or 64 (o) x 1 with the 128-byte swizzle:
// cupyflash/core/tma.py), the causal scheduler's counter (an int that is 0 before the launch and left
// 0 after it; one per stream: cupyflash/core/tma.py; unused when non-causal), o_map_ok (1: the o map
// is encoded for this call's out, a dense problem; 0: O is written from registers and the o map
// is not read), then the arguments of flash_fwd_entry (common/fwd_entry.cuh). The grid is
// persistent: min(work tiles, SMs) CTAs on x.
template <typename Block, typename T>
__global__ void __launch_bounds__(Block::kThreads, 1)
flash_fwd_tma_entry(const __grid_constant__ FwdTmaParams P) {
    Block::run(P.fwd, P.tq, P.tk, P.tv, P.to, P.tile_counter, P.o_map_ok);
}

}  // namespace cf
