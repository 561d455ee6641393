// Tiled prefill forward for Hopper (sm_90a only), fp16 / bf16 inputs, fp32 accumulation:
// FlashAttention-3 (Shah et al., arXiv 2407.08608) built on the algorithm of FlashAttention-2
// (Dao, arXiv 2307.08691, Algorithm 1) and the one softmax step of common/softmax_step.cuh.
//
// A persistent CTA (at most one per SM) takes work tiles (BLOCK_M query rows of one head) from
// the tile scheduler (common/tile_scheduler.cuh: static when non-causal, a global counter when
// causal) and runs them one after the other. Its warpgroups have two roles (FA3 Sec. 3.1):
//   * the producer (one warp of the last warpgroup, whose registers go to the consumers with
//     setmaxnreg; fwd_producer): TMA copies of the Q tile and of a ring of kStages K and V tiles
//     into 128-byte swizzled shared memory (common/pipeline.cuh: a slot's "full" mbarrier counts
//     its bytes; it is refilled once every consumer warp released it on its "empty" one);
//   * the consumers (BLOCK_M / 64 warpgroups of 64 query rows; fwd_consumer): in step i a
//     warpgroup issues S_{i+1} = Q K_{i+1}^T and O += P_i V_i on the tensor cores and runs the
//     softmax of S_{i+1} while P_i V_i runs (FA3 Sec. 3.2, intra-warpgroup overlap;
//     fwd_mainloop); the warpgroups take turns issuing their GEMMs (FA3 Sec. 3.1's ping-pong,
//     round-robin with three); the output is normalised once and, for dense problems, written
//     through shared memory by TMA stores (fwd_epilogue, common/epilogue.cuh).
// The producer hands each tile's index to the consumers (TileHandoff), so both roles walk the
// same tiles and the same ring positions. The consumers compute no load address and issue no
// copy: every instruction they issue is GEMM, softmax or a barrier.
// Varlen (packed sequences, cu_seqlens): the tensor maps see the packed tensors as one batch
// entry of total-token rows, and a tile's copies start at its sequence's first row. Rows past a
// sequence's end then hold the next sequence's tokens (or TMA's zeros past the tensor): query
// rows are independent and not stored, keys are masked in S (a select: NaN gives -inf), and
// the V rows, which P (0 there) would multiply, are zeroed by the producer (0 * NaN = NaN;
// docs/semantics.md, 5).
#include "common/dtype.cuh"
#include "common/params.cuh"
#include "common/mask.cuh"
#include "common/online_softmax.cuh"
#include "common/mma.cuh"
#include "common/wgmma.cuh"
#include "common/tma.cuh"
#include "common/pipeline.cuh"
#include "common/softmax_step.cuh"
#include "common/tile_scheduler.cuh"
#include "common/epilogue.cuh"
#include "common/fwd_tile.cuh"

namespace cf {

template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N>
struct HopperFwdTraits {
    static constexpr int kStages = 2;                         // K and V tiles in each ring (3: v52)
    static constexpr int kConsumerWGs = BLOCK_M / 64;
    static constexpr int kConsumerThreads = 128 * kConsumerWGs;
    static constexpr int kConsumerWarps = 4 * kConsumerWGs;
    static constexpr int kThreads = kConsumerThreads + 128;  // + the producer warpgroup
    static constexpr int kColTiles = HEADDIM / 64;            // 64-element (128-byte) column tiles
    static constexpr int kQBytes = BLOCK_M * HEADDIM * 2;
    static constexpr int kKVBytes = BLOCK_N * HEADDIM * 2;
    static constexpr int kOWGBytes = 64 * HEADDIM * 2;        // one warpgroup's O tile
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
    static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads == kLaunchRegs * kThreads,
                  "setmaxnreg: the counts add up to the launch's registers");
};

// The shared memory of the kernel, its one definition (cupyflash/forward/kernels.py reads kBytes
// and kOStore / kOInV from this struct through an NVRTC probe): from a 1024-byte aligned base
// (the swizzle repeat), the Q tile, the K ring, the V ring, where they fit in sm_90's 227 KB
// (hd64, hd128; not hd256) one O buffer per consumer warpgroup (64 x HEADDIM, 128-byte swizzled
// as the TMA store reads it), the mbarriers, the handed-over tile index and (kOInV) o_free.
// Without room for O buffers (hd256) the O tiles go through the V ring instead (FA3's epilogue
// there) when they fit in it: the producer then loads a work tile's first V only once the
// previous tiles' stores have read O (o_free). The kBytes of the launch include 1024 bytes to
// align the base.
template <typename Tr>
struct HopperFwdSmem {
    static constexpr int S = Tr::kStages;
    // full_k, full_v, empty_k, empty_v per ring slot; q_full, q_empty, v_landed
    static constexpr int kBarriers = 4 * S + 3;
    static constexpr uint32_t kQ = 0;
    static constexpr uint32_t kK = kQ + Tr::kQBytes;
    static constexpr uint32_t kV = kK + S * Tr::kKVBytes;
    static constexpr uint32_t kO = kV + S * Tr::kKVBytes;
    static constexpr int kNoOBytes = (int)kO + 8 * kBarriers + 8 + 1024;
    static constexpr bool kOStore = kNoOBytes + Tr::kConsumerWGs * Tr::kOWGBytes <= 227 * 1024;
    static constexpr bool kOInV = !kOStore && Tr::kConsumerWGs * Tr::kOWGBytes <= S * Tr::kKVBytes;
    static constexpr uint32_t kBars = kO + (kOStore ? Tr::kConsumerWGs * Tr::kOWGBytes : 0);
    static constexpr uint32_t kFullK = kBars, kFullV = kFullK + 8 * S;
    static constexpr uint32_t kEmptyK = kFullV + 8 * S, kEmptyV = kEmptyK + 8 * S;
    static constexpr uint32_t kQFull = kEmptyV + 8 * S, kQEmpty = kQFull + 8, kVLanded = kQEmpty + 8;
    static constexpr uint32_t kTileIndex = kBars + 8 * kBarriers;
    static constexpr uint32_t kOFree = kTileIndex + 8;  // kOInV only
    static constexpr int kBytes = (int)kOFree + (kOInV ? 8 : 0) + 1024;
    // sm_90's opt-in limit; also keeps every shared address below 2^18, the reach of the
    // descriptors' 14-bit (address >> 4) field (common/wgmma.cuh)
    static_assert(kBytes <= 227 * 1024, "shared memory of the configuration");
};

// Named barriers (bar.sync ids; 0 is __syncthreads).
enum HopperFwdBarrier : int {
    kBarTurn = 1,       // + wg: warpgroup wg's turn to issue its GEMMs (1 .. 3)
    kBarTileEmpty = 4,  // the consumers have read the handed-over tile index
    kBarOInV = 5,       // kOInV: every consumer's last P V has read the V ring
    kBarEpilogue = 6,   // + wg: warpgroup wg's O buffer (6 .. 8)
    kBarTileFull = 9,   // + wg: the next tile's index for warpgroup wg (9 .. 11)
};
static_assert(kBarTurn + 3 <= kBarTileEmpty && kBarEpilogue + 3 <= kBarTileFull &&
              kBarTileFull + 3 <= 16, "named barrier ids: at most 3 consumer warpgroups, 16 ids");

// What both roles share: the layout's addresses, the rings and the hand-over.
template <typename Tr>
struct HopperFwdShared {
    using L = HopperFwdSmem<Tr>;
    uint32_t base;        // shared address of the 1024-byte aligned base
    unsigned char* raw;   // its generic address
    MbarRing<Tr::kStages> k, v;
    TileHandoff<Tr::kConsumerWGs, kBarTileEmpty, kBarTileFull> handoff;

    __device__ __forceinline__ explicit HopperFwdShared(unsigned char* smem)
        : base((smem_u32addr(smem) + 1023u) & ~1023u),
          raw(smem + (base - smem_u32addr(smem))),
          k{base + L::kFullK, base + L::kEmptyK},
          v{base + L::kFullV, base + L::kEmptyV},
          handoff{reinterpret_cast<int*>(raw + L::kTileIndex)} {}
    __device__ __forceinline__ uint32_t q_full() const { return base + L::kQFull; }
    __device__ __forceinline__ uint32_t q_empty() const { return base + L::kQEmpty; }
    __device__ __forceinline__ uint32_t v_landed() const { return base + L::kVLanded; }
    __device__ __forceinline__ uint32_t o_free() const { return base + L::kOFree; }
    __device__ __forceinline__ uint32_t q_tile() const { return base + L::kQ; }
    __device__ __forceinline__ uint32_t k_slot(int s) const { return base + L::kK + s * Tr::kKVBytes; }
    __device__ __forceinline__ uint32_t v_slot(int s) const { return base + L::kV + s * Tr::kKVBytes; }
    // warpgroup wg's O tile: its buffer, or (kOInV) its part of the V ring
    __device__ __forceinline__ uint32_t o_tile(int wg) const {
        return base + (L::kOInV ? L::kV : L::kO) + (uint32_t)(wg * Tr::kOWGBytes);
    }

    // One thread, before any other use: every mbarrier (then a CTA barrier).
    __device__ __forceinline__ void init() const {
        k.init(Tr::kConsumerWarps);
        v.init(Tr::kConsumerWarps);
        mbarrier_init(q_full(), 1);
        mbarrier_init(q_empty(), Tr::kConsumerWarps);
        mbarrier_init(v_landed(), 1);
        if (L::kOInV) mbarrier_init(o_free(), Tr::kConsumerWGs);
        fence_proxy_async();  // the initialised barriers, before TMA completes bytes on them
    }
};

template <int BLOCK_M, int BLOCK_N, bool CAUSAL>
__device__ __forceinline__ FwdTile<BLOCK_M, BLOCK_N, CAUSAL> fwd_tile(
        const FwdParams& p, const typename TileScheduler<BLOCK_M, CAUSAL>::Work& w) {
    return FwdTile<BLOCK_M, BLOCK_N, CAUSAL>(p, w.m_block, w.h, w.b);
}

// Rows [valid, BLOCK_N) of the V slot at generic address `slot` set to zero in every 64-column
// tile, by one warp: whole 128-byte rows, which the 128-byte swizzle leaves in place (it only
// moves the 16-byte chunks inside a row), 16 bytes per lane and store.
template <typename Tr, int BLOCK_N>
__device__ __forceinline__ void zero_rows_from(unsigned char* slot, int valid, int lane) {
    uint4* chunks = reinterpret_cast<uint4*>(slot);
#pragma unroll
    for (int c = 0; c < Tr::kColTiles; ++c)
        for (int i = valid * 8 + lane; i < BLOCK_N * 8; i += 32)
            chunks[c * BLOCK_N * 8 + i] = make_uint4(0u, 0u, 0u, 0u);
}

// ============================== producer ==============================
// One warp: lane 0 issues every copy and arrival; the whole warp walks the tiles and waits with
// it, to zero V rows together. o_in_v: the first V of a tile waits until the stores of every
// earlier tile have read O out of the V ring (the o_wait-th completion of o_free; a parity wait
// is enough: the consumers have finished every earlier epilogue but the latest, as they read the
// previous index after the one before it, and cannot finish this tile's before its first V).
template <typename Tr, int HEADDIM, int BLOCK_M, int BLOCK_N, bool CAUSAL>
__device__ __forceinline__ void fwd_producer(const FwdTmaParams& P, const HopperFwdShared<Tr>& sh,
                                             int* tile_counter, bool o_in_v) {
    using Sched = TileScheduler<BLOCK_M, CAUSAL>;
    const FwdParams& p = P.fwd;
    // built after setmaxnreg: no value lives across the change of register count (built
    // before it, some were spilled for the 24-register producer)
    const Sched sched(p, HEADDIM);
    const int lane = threadIdx.x & 31;
    const bool leader = lane == 0;
    if (leader) {
        tma_prefetch_desc(&P.tq);
        tma_prefetch_desc(&P.tk);
        tma_prefetch_desc(&P.tv);
    }
    const bool varlen = p.cu_seqlens_k != nullptr;
    PipelineState<Tr::kStages> kv = producer_start<Tr::kStages>();  // K and V rings in step
    PipelineState<1> q_st = consumer_start<1>();      // q_empty: one completion per tile
    PipelineState<1> landed = consumer_start<1>();    // v_landed: one copy at a time
    int epilogues = 0;  // non-empty work tiles handed out so far (o_free's completions)
    for (int t = blockIdx.x, first = 1;; first = 0) {
        // the tile's index, once the consumers have read the previous one and their last
        // Q K^T of it has completed; t >= num_tiles tells them to stop
        if (!first) {
            mbarrier_wait(sh.q_empty(), q_st.phase);
            q_st.advance();
        }
        sh.handoff.publish(t, first != 0, leader);
        // (the arrivals in each branch: with them before the test, ptxas spilled 40 bytes)
        if (t >= sched.num_tiles) {
            sh.handoff.signal();
            break;
        }
        sh.handoff.signal();
        const auto w = fwd_tile<BLOCK_M, BLOCK_N, CAUSAL>(p, sched.get(t));
        const int o_wait = epilogues;
        if (!w.empty()) ++epilogues;
        if (w.n_tiles > 0) {
            if (leader) {
                mbarrier_arrive_expect_tx(sh.q_full(), Tr::kQBytes);
#pragma unroll
                for (int c = 0; c < Tr::kColTiles; ++c)
                    tma_load_4d(sh.q_tile() + (uint32_t)(c * BLOCK_M * 128), &P.tq, c * 64, w.h,
                                w.q_row, w.tma_b, sh.q_full());
            }
            const int hk = w.h / p.h_per_kv;
            for (int j = 0; j < w.n_tiles; ++j, kv.advance()) {
                const int n0 = (w.n_block_min + j) * BLOCK_N;
                sh.k.producer_acquire(kv);
                if (leader) {
                    sh.k.producer_expect(kv, Tr::kKVBytes);
#pragma unroll
                    for (int c = 0; c < Tr::kColTiles; ++c)
                        tma_load_4d(sh.k_slot(kv.slot) + (uint32_t)(c * BLOCK_N * 128), &P.tk,
                                    c * 64, hk, w.k_row + n0, w.tma_b, sh.k.full(kv.slot));
                }
                // The tile that runs past a varlen sequence's end: its V lands on v_landed, the
                // warp zeroes the rows past the end, then lane 0 completes full_v's phase with
                // its one arrival (no bytes). Dense maps end at seqlen_k: TMA zero-fills there.
                const bool v_tail = varlen && n0 + BLOCK_N > w.seq.seqlen_k;
                const uint32_t v_bar = v_tail ? sh.v_landed() : sh.v.full(kv.slot);
                if (o_in_v && j == 0 && o_wait > 0)
                    mbarrier_wait(sh.o_free(), (uint32_t)((o_wait - 1) & 1));
                sh.v.producer_acquire(kv);
                if (leader) {
                    mbarrier_arrive_expect_tx(v_bar, Tr::kKVBytes);
#pragma unroll
                    for (int c = 0; c < Tr::kColTiles; ++c)
                        tma_load_4d(sh.v_slot(kv.slot) + (uint32_t)(c * BLOCK_N * 128), &P.tv,
                                    c * 64, hk, w.k_row + n0, w.tma_b, v_bar);
                }
                if (v_tail) {
                    mbarrier_wait(sh.v_landed(), landed.phase);
                    landed.advance();
                    zero_rows_from<Tr, BLOCK_N>(sh.raw + (sh.v_slot(kv.slot) - sh.base),
                                                w.seq.seqlen_k - n0, lane);
                    fence_proxy_async();  // the zeros (generic proxy) before wgmma's reads (async)
                    __syncwarp();         // every lane's zeros and fence before lane 0's arrival
                    if (leader) mbarrier_arrive(sh.v.full(kv.slot));
                }
            }
        } else if (leader) {  // no key: the consumers write 0 and -inf without Q
            mbarrier_arrive(sh.q_full());
        }
        if (leader) t = sched.next(t, tile_counter);
        t = __shfl_sync(0xffffffffu, t, 0);  // lane 0 asks (one request per CTA and tile)
    }
}

// ============================== consumers ==============================
// The GEMMs of a consumer warpgroup: S = Q K^T of a ring slot, O += P V of a ring slot (issued
// and committed, not waited for). Descriptors: one base per operand and call, made opaque so
// that the compiler cannot hoist one 64-bit descriptor per k-step out of the loop (2 registers
// each); k-step and slot offsets are added to the address field (16-byte units; shared
// addresses stay below 2^18 bytes). Layouts: common/wgmma.cuh.
template <typename T, typename Tr, int BLOCK_M, int BLOCK_N>
struct FwdGemms {
    using MmaS = Wgmma<T, BLOCK_N>;   // S (64 x BLOCK_N) = Q K^T
    using MmaO = Wgmma<T, Tr::kON>;   // O (64 x kON) += P V, kOChunks times
    // Loop-invariant, made once per warpgroup: the descriptors of this warpgroup's 64 rows of Q
    // and of the first K and V ring slots (a slot's is that plus slot * kKVBytes / 16 in the
    // address field).
    uint64_t dq, dk0, dv0;

    __device__ __forceinline__ FwdGemms(uint32_t q_wg, uint32_t k0, uint32_t v0)
        : dq(wgmma_desc_sw128(q_wg, 16, 1024)), dk0(wgmma_desc_sw128(k0, 16, 1024)),
          dv0(wgmma_desc_sw128(v0, (uint32_t)(BLOCK_N * 128), 1024)) {}

    static __device__ __forceinline__ uint64_t opaque(uint64_t d) {
        asm volatile("" : "+l"(d));
        return d;
    }
    static __device__ __forceinline__ uint64_t slot_desc(uint64_t d0, int slot) {
        return d0 + (uint64_t)(slot * (Tr::kKVBytes >> 4));
    }
    __device__ __forceinline__ void qk(float (&s)[Tr::kSAcc], int k_slot) const {
        const uint64_t q = opaque(dq);
        const uint64_t k = opaque(slot_desc(dk0, k_slot));
#pragma unroll
        for (int ks = 0; ks < Tr::kQKSteps; ++ks) {
            // k-step ks: column tile ks / 4, 32 bytes per k-step inside the 128-byte row
            const uint64_t qo = (uint64_t)(((ks >> 2) * BLOCK_M * 128 + (ks & 3) * 32) >> 4);
            const uint64_t ko = (uint64_t)(((ks >> 2) * BLOCK_N * 128 + (ks & 3) * 32) >> 4);
            MmaS::ss(s, q + qo, k + ko, ks > 0 ? 1 : 0);
        }
        wgmma_commit();
    }
    // head dims above 128 as kOChunks wgmmas of N = 128 (column tiles 2c, 2c + 1 of V,
    // registers 64c .. of O)
    __device__ __forceinline__ void pv(float (&o)[Tr::kOAcc], uint32_t (&pf)[Tr::kPVSteps][4],
                                       int v_slot) const {
        const uint64_t v = opaque(slot_desc(dv0, v_slot));
#pragma unroll
        for (int kk = 0; kk < Tr::kPVSteps; ++kk)  // keys 16 kk .. 16 kk + 15: 16 rows of 128 bytes
#pragma unroll
            for (int c = 0; c < Tr::kOChunks; ++c)
                MmaO::rs_tn(*reinterpret_cast<float (*)[Tr::kON / 2]>(o + c * (Tr::kON / 2)), pf[kk],
                            v + (uint64_t)((kk * 16 * 128 + c * 2 * BLOCK_N * 128) >> 4), 1);
        wgmma_commit();
    }
};

// Turns (FA3's warp scheduler barriers): the consumer warpgroups issue their GEMMs one after the
// other, 0, 1, (2,) 0, ...: warpgroup wg waits on kBarTurn + wg, issues, and hands the turn to
// the next one (128 threads arrive, 128 sync: 256 per phase). The order runs on across work
// tiles (every warpgroup takes n_tiles + 1 turns in a tile), so that one warpgroup's first
// Q K^T of a tile runs while the next finishes its epilogue: the last warpgroup hands
// warpgroup 0 the kernel's first turn, and warpgroup 0 takes the one left over after the last.
template <int WGS>
struct Turns {
    int mine, next;
    __device__ __forceinline__ explicit Turns(int wg)
        : mine(kBarTurn + wg), next(kBarTurn + (wg + 1 < WGS ? wg + 1 : 0)) {}
    __device__ __forceinline__ void wait() const { named_barrier_sync(mine, 256); }
    __device__ __forceinline__ void pass() const { named_barrier_arrive(next, 256); }
};

// The softmax step of key tile nb for rows row0, row0 + 8 (mask only on boundary tiles).
template <typename Tr, int BLOCK_N, bool CAUSAL, typename Tile>
__device__ __forceinline__ void fwd_softmax(float (&s)[Tr::kSAcc], SoftmaxRow<float> (&row)[2],
                                            float (&alpha)[2], const Tile& w, int nb, int row0,
                                            int t, const FwdParams& p) {
    if (w.tiles.needs_mask(nb)) {
        // The rows' key bounds are derived from row0 in each masked step (a few integer
        // instructions, on boundary tiles only): row0 is made opaque here so that the compiler
        // cannot hoist them out of the key loop, where they took 4-6 registers per thread for
        // the whole loop and the hd128 causal kernel spilled (16 / 28 bytes at 240 registers).
        int r0 = row0;
        asm volatile("" : "+r"(r0));
        KeyRange range[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)  // (causal: a right window >= 0 cannot narrow the range)
            range[hh] = visible_keys(r0 + 8 * hh, w.seq.seqlen_q, w.seq.seqlen_k, CAUSAL,
                                     p.window_left, CAUSAL ? -1 : p.window_right);
        softmax_tile_step<Tr::kNTiles, true>(s, row, alpha, tile_bounds(range, nb * BLOCK_N, t),
                                             p.scale_log2);
    } else {
        softmax_tile_step<Tr::kNTiles, false>(s, row, alpha, TileBounds{}, p.scale_log2);
    }
}

// The key loop of one work tile with keys (FA2 Algorithm 1 with FA3's overlap): the prologue
// computes S_0 and its softmax; step i issues S_{i+1} = Q K_{i+1}^T and O += P_i V_i, runs the
// softmax of S_{i+1} while P_i V_i is on the tensor cores, then, P_i V_i done, rescales O and
// packs P_{i+1}; the last step is the P V of the last key tile. s is written while a P V group
// is pending, which ptxas accepts only when every path through the loop issues the same groups
// (the loop always issues Q K^T and P V, the last P V is peeled off): with `if (has_next)`
// around the Q K^T it serialised the wgmma pipeline (C7515; NOTES v55, v62).
template <typename T, typename Tr, int BLOCK_M, int BLOCK_N, bool CAUSAL, typename Tile>
__device__ __forceinline__ void fwd_mainloop(const HopperFwdShared<Tr>& sh,
                                             const FwdGemms<T, Tr, BLOCK_M, BLOCK_N>& gemm,
                                             const Turns<Tr::kConsumerWGs>& turn, const Tile& w,
                                             const FwdParams& p, float (&o)[Tr::kOAcc],
                                             SoftmaxRow<float> (&row)[2],
                                             PipelineState<Tr::kStages>& kv, int row0, int t,
                                             int lane) {
    const int n_tiles = w.n_tiles;
    PipelineState<Tr::kStages> kn = kv;  // the K of the next S
    uint32_t p_cur[Tr::kPVSteps][4];
    {  // ---- prologue: S_0 and its softmax ----
        float s[Tr::kSAcc], alpha[2];
        sh.k.consumer_wait(kn);
        turn.wait();
        wgmma_fence();
        gemm.qk(s, kn.slot);
        turn.pass();
        wgmma_wait<0>();
        wgmma_fence_operand(s);
        sh.k.consumer_release(kn, lane);
        kn.advance();
        if (n_tiles == 1 && lane == 0) mbarrier_arrive(sh.q_empty());  // the last Q K^T
        fwd_softmax<Tr, BLOCK_N, CAUSAL>(s, row, alpha, w, w.n_block_min, row0, t, p);
        pack_p<T, Tr::kNTiles>(s, p_cur);
    }
    // ---- main loop: step i consumes V_i (P_i V_i, ring position kv) and K_{i+1} (kn) ----
    for (int i = 0; i + 1 < n_tiles; ++i) {
        float s[Tr::kSAcc], alpha[2];
        sh.k.consumer_wait(kn);
        turn.wait();
        // O and P_i were last written by ordinary instructions (rescale, pack)
        wgmma_fence_operand(o);
        wgmma_fence_operand(p_cur);
        wgmma_fence();
        gemm.qk(s, kn.slot);
        // V_i only now: the Q K^T runs while a late V copy lands (the first V of a tile at
        // hd256, whose ring held the previous tile's O until its stores read it)
        sh.v.consumer_wait(kv);
        gemm.pv(o, p_cur, kv.slot);
        turn.pass();
        wgmma_wait<1>();                   // S_{i+1} is done; P_i V_i may still run
        wgmma_fence_operand(s);
        sh.k.consumer_release(kn, lane);
        kn.advance();
        if (i + 2 == n_tiles && lane == 0) mbarrier_arrive(sh.q_empty());  // the last Q K^T
        fwd_softmax<Tr, BLOCK_N, CAUSAL>(s, row, alpha, w, w.n_block_min + i + 1, row0, t, p);
        wgmma_wait<0>();                   // P_i V_i is done: O and P_i are free
        wgmma_fence_operand(p_cur);
        wgmma_fence_operand(o);
        sh.v.consumer_release(kv, lane);
        kv.advance();
        rescale_rows<Tr::kDTiles>(o, alpha);
        pack_p<T, Tr::kNTiles>(s, p_cur);
    }
    // ---- last step: P V of the last key tile ----
    sh.v.consumer_wait(kv);
    turn.wait();
    wgmma_fence_operand(o);
    wgmma_fence_operand(p_cur);
    wgmma_fence();
    gemm.pv(o, p_cur, kv.slot);
    turn.pass();
    wgmma_wait<0>();
    wgmma_fence_operand(o);
    sh.v.consumer_release(kv, lane);
    kv.advance();
}

// The end of a work tile: out = O / l (0 for an empty row) and the LSE; O through shared memory
// and TMA stores (o_store: common/epilogue.cuh; kOInV: over the V ring once every warpgroup's
// last P V has read it, the producer told by o_free once the stores have read it), else from
// registers. The LSE stays a plain store.
template <typename T, typename Tr, int HEADDIM, typename Tile>
__device__ __forceinline__ void fwd_epilogue(const FwdTmaParams& P, const HopperFwdShared<Tr>& sh,
                                             const Tile& w, const float (&o)[Tr::kOAcc],
                                             const SoftmaxRow<float> (&row)[2], int wg,
                                             int warp_in_wg, int g, int t, bool o_store) {
    using L = HopperFwdSmem<Tr>;
    const FwdParams& p = P.fwd;
    const int row0 = w.m0 + wg * 64 + warp_in_wg * 16 + g;  // this thread's rows: row0, row0 + 8
    float inv[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const float l = quad_sum(row[hh].l);
        inv[hh] = SoftmaxRow<float>::inv_l(l);
        const int r = row0 + 8 * hh;
        if (r < w.seq.seqlen_q && t == 0 && p.lse != nullptr)  // NULL: not asked for
            w.lse(p)[r] = row[hh].lse(l, p.scale_log2);
    }
    if (!o_store) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = row0 + 8 * hh;
            if (r < w.seq.seqlen_q)
                store_row<T, Tr::kDTiles>(o, hh, inv[hh],
                                          w.template o<T>(p) + (int64_t)r * p.o_row_stride, t,
                                          p.headdim);
        }
        return;
    }
    const bool leader = (threadIdx.x & 127) == 0;  // issues, commits and waits for the stores
    if (leader) bulk_wait_group_read<0>();  // its previous tile's stores have read the buffer
    // kOInV: every warpgroup's last P V has read the V ring before any O is written over it
    // (the warpgroups' O tiles straddle both ring slots)
    if (L::kOInV) named_barrier_sync(kBarOInV, Tr::kConsumerThreads);
    named_barrier_sync(kBarEpilogue + wg, 128);
    const uint32_t buf = sh.o_tile(wg);
    store_tile_swizzled<T, Tr::kDTiles>(sh.raw + (buf - sh.base), o, inv, warp_in_wg, g, t);
    fence_proxy_async();                        // the generic writes, before TMA's reads
    named_barrier_sync(kBarEpilogue + wg, 128);  // every thread's writes and fence
    if (leader) {
        // rows past seqlen_q and columns past headdim are outside the map: not written
        const int r0 = w.m0 + wg * 64;
        if (r0 < w.seq.seqlen_q) tma_store_tile<Tr::kColTiles>(&P.to, buf, p.headdim, w.h, r0, w.b);
        bulk_commit_group();
        if (L::kOInV) {  // the V ring is the producer's again once the stores read it
            bulk_wait_group_read<0>();
            mbarrier_arrive(sh.o_free());
        }
    }
}

// A consumer warpgroup: the work tiles the producer hands over, one after the other.
template <typename T, typename Tr, int HEADDIM, int BLOCK_M, int BLOCK_N, bool CAUSAL>
__device__ __forceinline__ void fwd_consumer(const FwdTmaParams& P, const HopperFwdShared<Tr>& sh,
                                             int wg, bool o_store) {
    const FwdParams& p = P.fwd;
    const TileScheduler<BLOCK_M, CAUSAL> sched(p, HEADDIM);  // (after setmaxnreg, as the producer's)
    const int tid = threadIdx.x, lane = tid & 31, warp_in_wg = (tid >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    if (o_store && (tid & 127) == 0) tma_prefetch_desc(&P.to);
    const FwdGemms<T, Tr, BLOCK_M, BLOCK_N> gemm(sh.q_tile() + (uint32_t)(wg * 64 * 128), sh.k_slot(0),
                                                 sh.v_slot(0));
    const Turns<Tr::kConsumerWGs> turn(wg);
    if (wg == Tr::kConsumerWGs - 1) turn.pass();
    PipelineState<Tr::kStages> kv = consumer_start<Tr::kStages>();  // in step with the producer
    PipelineState<1> q_st = consumer_start<1>();
    for (;;) {
        const int tile = sh.handoff.receive(wg);
        if (tile >= sched.num_tiles) break;
        sh.handoff.done();
        mbarrier_wait(sh.q_full(), q_st.phase);  // its Q, if it has keys
        q_st.advance();
        const auto w = fwd_tile<BLOCK_M, BLOCK_N, CAUSAL>(p, sched.get(tile));
        if (w.n_tiles <= 0 && lane == 0) mbarrier_arrive(sh.q_empty());  // no Q to read
        if (w.empty()) continue;
        float o[Tr::kOAcc];
#pragma unroll
        for (int i = 0; i < Tr::kOAcc; ++i) o[i] = 0.f;
        SoftmaxRow<float> row[2];
        row[0].init();
        row[1].init();
        if (w.n_tiles > 0) {
            const int row0 = w.m0 + wg * 64 + warp_in_wg * 16 + g;
            fwd_mainloop<T, Tr, BLOCK_M, BLOCK_N, CAUSAL>(sh, gemm, turn, w, p, o, row, kv, row0,
                                                          t, lane);
        }
        fwd_epilogue<T, Tr, HEADDIM>(P, sh, w, o, row, wg, warp_in_wg, g, t, o_store);
    }
    if (wg == 0) turn.wait();  // the last turn passed (or the first, if the CTA had no keyed tile)
    // The shared memory of the CTA outlives no thread: the stores complete before their leader
    // exits (their reads of the O buffers above all).
    if (o_store && (tid & 127) == 0) bulk_wait_group<0>();
}

// One CTA: set-up, then each warpgroup takes its role.
template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, bool CAUSAL>
__device__ __forceinline__ void flash_fwd_hopper_block(const FwdTmaParams& P) {
    using Tr = HopperFwdTraits<T, HEADDIM, BLOCK_M, BLOCK_N>;
    using L = HopperFwdSmem<Tr>;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const HopperFwdShared<Tr> sh(smem_raw);
    // The warpgroup index, broadcast from lane 0 so that the compiler knows it is warp-uniform:
    // a role branch it thinks divergent makes ptxas serialise every wgmma behind it (C7520).
    const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x / 128, 0);
    if (threadIdx.x == 0) sh.init();
    __syncthreads();
    // O through shared memory and TMA stores (FA3) when the kernel has room for the O tiles
    // (their own buffers, or the V ring), the host encoded the O map (o_map_ok: dense, and
    // out's strides and base are ones a tensor map accepts) and the problem is dense (a varlen
    // tile's box would run past its sequence into the next one's rows); else from registers.
    // Both roles need it: with kOInV the producer waits for o_free.
    const bool o_store = (L::kOStore || L::kOInV) && P.o_map_ok != 0 && P.fwd.cu_seqlens_q == nullptr;
    if (wg == Tr::kConsumerWGs) {
        warpgroup_reg_dealloc<Tr::kProducerRegs>();
        if (threadIdx.x < Tr::kConsumerThreads + 32)  // one warp produces, the others leave
            fwd_producer<Tr, HEADDIM, BLOCK_M, BLOCK_N, CAUSAL>(P, sh, P.tile_counter,
                                                                L::kOInV && o_store);
        return;
    }
    warpgroup_reg_alloc<Tr::kConsumerRegs>();
    fwd_consumer<T, Tr, HEADDIM, BLOCK_M, BLOCK_N, CAUSAL>(P, sh, wg, o_store);
}

// One CTA of the TMA forward, for flash_fwd_tma_entry below: the name expression is
// cf::flash_fwd_tma_entry<cf::FlashFwdHopper<T, HEADDIM, BLOCK_M, BLOCK_N, CAUSAL>, T>.
template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, bool CAUSAL>
struct FlashFwdHopper {
    using Traits = HopperFwdTraits<T, HEADDIM, BLOCK_M, BLOCK_N>;
    using Smem = HopperFwdSmem<Traits>;
    static constexpr int kThreads = Traits::kThreads;
    static __device__ __forceinline__ void run(const FwdTmaParams& P) {
        flash_fwd_hopper_block<T, HEADDIM, BLOCK_M, BLOCK_N, CAUSAL>(P);
    }
};

// The entry: FwdTmaParams (common/params.cuh) by value. The grid is persistent: min(work
// tiles, SMs) CTAs on x; dynamic shared memory HopperFwdSmem::kBytes.
template <typename Block, typename T>
__global__ void __launch_bounds__(Block::kThreads, 1)
flash_fwd_tma_entry(const __grid_constant__ FwdTmaParams P) {
    Block::run(P);
}

}  // namespace cf
