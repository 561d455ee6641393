// Tiled prefill forward on Hopper's warpgroup tensor cores (wgmma.mma_async, sm_90a only),
// fp16 / bf16 inputs, fp32 accumulation.
//
// The algorithm is the one of flash_fwd.cu (FlashAttention-2, Dao, arXiv 2307.08691, Algorithm 1,
// Sec. 3.1-3.3): one CTA per (BLOCK_M query rows, head, batch), K/V tiles streamed through shared
// memory, the online softmax in registers (common/online_softmax.cuh), P reused from registers as the A operand of P V, the output normalised once at the end.
// What changes is the matrix instruction and, with it, the schedule (FlashAttention-3, Shah et al.,
// arXiv 2407.08608, Sec. 3.1-3.2):
//   * each warpgroup (4 warps, 128 threads) owns 64 query rows; S = Q K^T is
//     wgmma.m64n{BLOCK_N}k16 with Q and K read by the tensor cores straight from shared memory
//     (128-byte swizzled tiles, common/wgmma.cuh), O += P V is wgmma.m64n{HEADDIM}k16 with P from
//     registers and V from shared memory (MN-major);
//   * intra-warpgroup pipelining (FA3 Sec. 3.2, Algorithm 2): in iteration j the warpgroup issues
//     S_{j+1} = Q K_{j+1}^T and O += P_j V_j asynchronously, then runs the softmax of S_{j+1} on
//     the CUDA cores while the tensor cores work on P_j V_j; O is rescaled once P_j V_j is done;
//   * warpgroup ping-pong (FA3 Sec. 3.1): the two warpgroups issue their GEMMs in turn (named
//     barriers 1 and 2), so one warpgroup's softmax overlaps the other's GEMMs;
//   * a ring of STAGES K and V tiles filled by cp.async from all threads, tracked by mbarriers
//     instead of CTA barriers: each thread's copies arrive on the tile's "full" barrier when they
//     land (cp.async.mbarrier.arrive.noinc), each thread arrives on its "empty" barrier when the
//     wgmma that read the tile has completed, and a slot is refilled only after its empty barrier
//     completed. Tiles are loaded STAGES - 1 iterations before they are consumed. No warp
//     specialisation and no TMA: the copies are generic-proxy writes, made visible to wgmma with
//     fence.proxy.async by the consuming thread after its wait.
// Measured on the H200 (experiments/NOTES.md v3): each of ping-pong + mbarrier ring and the
// softmax's independent reduction chains added ~20%; a ring of 2 tiles loses 20-25% against 3.
// Causal / sliding-window: key tiles outside every row's range are skipped by the loop bounds
// (common/mask.cuh KeyTiles); tiles that straddle a boundary evaluate the mask. Rows past the
// sequence end and head-dim columns past the actual head dim are zero-filled by the copies.
#include "common/dtype.cuh"
#include "common/params.cuh"
#include "common/mask.cuh"
#include "common/online_softmax.cuh"
#include "common/mma.cuh"
#include "common/wgmma.cuh"
#include "common/wg_softmax.cuh"
#include "common/fwd_entry.cuh"

namespace cf {

template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, int STAGES>
struct WgmmaFwdTraits {
    static constexpr int kWarpgroups = BLOCK_M / 64;
    static constexpr int kThreads = 128 * kWarpgroups;
    static constexpr int kQBytes = BLOCK_M * HEADDIM * 2;    // Q tile
    static constexpr int kKVBytes = BLOCK_N * HEADDIM * 2;   // one K or one V tile
    // Q, STAGES K and STAGES V tiles, 4 * STAGES mbarriers, and 1024 bytes to align the base to
    // the swizzle repeat. cupyflash/prefill.py computes the same number.
    static constexpr int kSmemBytes = kQBytes + 2 * STAGES * kKVBytes + 32 * STAGES + 1024;
    static constexpr int kSAcc = BLOCK_N / 2;                 // S floats per thread (64 x BLOCK_N)
    static constexpr int kOAcc = HEADDIM / 2;                 // O floats per thread (64 x HEADDIM)
    static constexpr int kQKSteps = HEADDIM / 16;             // k16 steps of Q K^T
    static constexpr int kPVSteps = BLOCK_N / 16;             // k16 steps of P V
    static constexpr int kNTiles = BLOCK_N / 8;               // 8-key column groups of S
    static constexpr int kDTiles = HEADDIM / 8;               // 8-column groups of O

    static_assert(sizeof(T) == 2, "wgmma path is for 16-bit inputs");
    static_assert(HEADDIM == 64 || HEADDIM == 128, "compiled head dims: 64, 128 (one or two 128-byte swizzle tiles)");
    static_assert(BLOCK_M == 64 || BLOCK_M == 128, "one or two warpgroups");
    static_assert(BLOCK_N == 64 || BLOCK_N == 128, "BLOCK_N: an N of common/wgmma.cuh");
    static_assert(STAGES >= 2 && STAGES <= 4, "K/V ring of 2..4 tiles");
    // sm_90's opt-in limit; also keeps every shared address below 2^18, the reach of the
    // descriptors' 14-bit (address >> 4) field (common/wgmma.cuh)
    static_assert(kSmemBytes <= 227 * 1024, "shared memory of the configuration");
};

// Global -> shared copy of one [ROWS x HEADDIM] tile with 16-byte cp.async into the 128-byte
// swizzled layout of common/wgmma.cuh: chunk c (16 bytes) of row r goes to column tile c / 8, row
// r, chunk position (c % 8) ^ (r % 8). Consecutive threads take consecutive chunks of a row
// (coalesced reads; the 8 chunks of a row land in 8 distinct bank groups). Rows >= rows_valid and
// chunks >= chunks_valid are zero-filled without reading global memory.
template <int ROWS, int HEADDIM, int THREADS>
struct SwizzledTileLoader {
    static constexpr int kChunks = HEADDIM / 8;
    static constexpr int kRowsPerPass = THREADS / kChunks;
    static constexpr int kPasses = ROWS / kRowsPerPass;
    static_assert(THREADS % kChunks == 0 && ROWS % kRowsPerPass == 0 && kRowsPerPass % 8 == 0,
                  "loader layout: whole passes of a multiple of 8 rows");

    int r0, c;
    uint32_t s_off;  // byte offset of (r0, c) inside a tile; r0 % 8 is the same in every pass

    __device__ __forceinline__ explicit SwizzledTileLoader(int tid)
        : r0(tid / kChunks), c(tid % kChunks),
          s_off((uint32_t)((tid % kChunks) / 8 * ROWS * 128 + (tid / kChunks) * 128
                           + ((((tid % kChunks) & 7) ^ ((tid / kChunks) & 7)) << 4))) {}

    template <typename T>
    __device__ __forceinline__ void load(uint32_t s_tile, const T* g_tile, int64_t row_stride,
                                         int rows_valid, int chunks_valid, const T* g_safe) const {
        int64_t thread_off = (int64_t)r0 * row_stride + c * 8;
        asm volatile("" : "+l"(thread_off));  // one 64-bit offset, not one per pass
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
            const int r = r0 + pass * kRowsPerPass;
            const bool ok = r < rows_valid && c < chunks_valid;
            const T* src = ok ? g_tile + (int64_t)(pass * kRowsPerPass) * row_stride + thread_off : g_safe;
            cp_async_16(s_tile + s_off + (uint32_t)(pass * kRowsPerPass * 128), src, ok);
        }
    }
};

template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, bool CAUSAL, int STAGES>
__device__ __forceinline__ void flash_fwd_wgmma_block(const FwdParams& p) {
    using Tr = WgmmaFwdTraits<T, HEADDIM, BLOCK_M, BLOCK_N, STAGES>;
    using MmaS = Wgmma<T, BLOCK_N>;   // S (64 x BLOCK_N) = Q K^T
    using MmaO = Wgmma<T, HEADDIM>;   // O (64 x HEADDIM) += P V
    constexpr int NT = Tr::kNTiles, DT = Tr::kDTiles, S = STAGES;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t sQ = (smem_u32addr(smem_raw) + 1023u) & ~1023u;  // swizzle repeat alignment
    const uint32_t sK = sQ + Tr::kQBytes;                            // K ring: S tiles
    const uint32_t sV = sK + S * Tr::kKVBytes;                       // V ring: S tiles
    // mbarriers, 8 bytes each: full_k[S], full_v[S] (the copies of a tile have landed: one
    // cp.async-triggered arrival per thread), empty_k[S], empty_v[S] (every thread's wgmma that
    // read the tile has completed: one arrival per thread).
    const uint32_t bars = sV + S * Tr::kKVBytes;
    auto full_k = [&](int st) { return bars + 8u * (uint32_t)st; };
    auto full_v = [&](int st) { return bars + 8u * (uint32_t)(S + st); };
    auto empty_k = [&](int st) { return bars + 8u * (uint32_t)(2 * S + st); };
    auto empty_v = [&](int st) { return bars + 8u * (uint32_t)(3 * S + st); };

    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = tid >> 7, warp_in_wg = (tid >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;

    // ---- this CTA's rows, sequence and key tiles (common/fwd_entry.cuh) ----
    const FwdCta<T, BLOCK_M, BLOCK_N, CAUSAL> cta(p);
    if (cta.empty()) return;
    const int seqlen_q = cta.seq.seqlen_q, seqlen_k = cta.seq.seqlen_k, m0 = cta.m0;
    const T* q_base = cta.q;
    const T* k_base = cta.k;
    const T* v_base = cta.v;
    const KeyTiles<BLOCK_N>& tiles = cta.tiles;
    const int chunks_valid = p.headdim / 8;
    const int n_block_min = tiles.n_block_min;
    const int n_tiles = tiles.n_block_max - tiles.n_block_min;

    const SwizzledTileLoader<BLOCK_M, HEADDIM, Tr::kThreads> q_loader(tid);
    const SwizzledTileLoader<BLOCK_N, HEADDIM, Tr::kThreads> kv_loader(tid);
    // Producer side (every thread copies its share): tile j of K (v = false) or V (v = true) into
    // ring slot j % S, after every thread released tile j - S of that slot; the copies then
    // arrive on the slot's full barrier. (v is a constant at every call site.)
    auto load_tile = [&](int j, bool v) {
        const int st = j % S;
        if (j >= S) mbarrier_wait(v ? empty_v(st) : empty_k(st), (uint32_t)((j / S - 1) & 1));
        const T* base = v ? v_base : k_base;
        const int64_t stride = v ? p.v_row_stride : p.k_row_stride;
        const int n0 = (n_block_min + j) * BLOCK_N;
        kv_loader.load((v ? sV : sK) + (uint32_t)st * Tr::kKVBytes, base + (int64_t)n0 * stride,
                       stride, seqlen_k - n0, chunks_valid, base);
        cp_async_mbarrier_arrive(v ? full_v(st) : full_k(st));
    };
    auto load_k = [&](int j) { load_tile(j, false); };
    auto load_v = [&](int j) { load_tile(j, true); };
    // Consumer side: wait until tile j's K (V) has landed, then make it visible to the async
    // proxy that wgmma reads through.
    auto wait_k = [&](int j) { mbarrier_wait(full_k(j % S), (uint32_t)((j / S) & 1)); fence_proxy_async(); };
    auto wait_v = [&](int j) { mbarrier_wait(full_v(j % S), (uint32_t)((j / S) & 1)); fence_proxy_async(); };

    // Descriptors: one base per operand and call, made opaque so that the compiler cannot hoist
    // one 64-bit descriptor per k-step out of the KV loop (that costs 2 registers each); the
    // k-step offsets are added to the address field (in 16-byte units; shared addresses stay
    // below 2^18 bytes, so the 14-bit field never carries).
    const uint32_t sQ_wg = sQ + (uint32_t)(wg * 64 * 128);  // this warpgroup's 64 rows
    auto opaque = [](uint64_t d) { asm volatile("" : "+l"(d)); return d; };
    // S = Q K^T of tile j (issued, committed, not waited for).
    auto issue_qk = [&](float (&s)[Tr::kSAcc], int j) {
        const uint64_t dq = opaque(wgmma_desc_sw128(sQ_wg, 16, 1024));
        const uint64_t dk = opaque(wgmma_desc_sw128(sK + (uint32_t)(j % S) * Tr::kKVBytes, 16, 1024));
#pragma unroll
        for (int ks = 0; ks < Tr::kQKSteps; ++ks) {
            // k-step ks: column tile ks / 4, 32 bytes per k-step inside the 128-byte row
            const uint64_t qo = (uint64_t)(((ks >> 2) * BLOCK_M * 128 + (ks & 3) * 32) >> 4);
            const uint64_t ko = (uint64_t)(((ks >> 2) * BLOCK_N * 128 + (ks & 3) * 32) >> 4);
            MmaS::ss(s, dq + qo, dk + ko, ks > 0 ? 1 : 0);
        }
        wgmma_commit();
    };
    // O += P V of tile j (issued, committed, not waited for).
    auto issue_pv = [&](float (&o)[Tr::kOAcc], uint32_t (&pf)[Tr::kPVSteps][4], int j) {
        const uint64_t dv = opaque(wgmma_desc_sw128(sV + (uint32_t)(j % S) * Tr::kKVBytes,
                                                    (uint32_t)(BLOCK_N * 128), 1024));
#pragma unroll
        for (int kk = 0; kk < Tr::kPVSteps; ++kk)  // keys 16 kk .. 16 kk + 15: 16 rows of 128 bytes
            MmaO::rs_tn(o, pf[kk], dv + (uint64_t)((kk * 16 * 128) >> 4), 1);
        wgmma_commit();
    };

    // acc O (unnormalised) and the softmax state (running max m, this thread's share l of the row
    // sum) of the rows row0 and row0 + 8 of this thread.
    const int row0 = m0 + wg * 64 + warp_in_wg * 16 + g;
    float o[Tr::kOAcc];
#pragma unroll
    for (int i = 0; i < Tr::kOAcc; ++i) o[i] = 0.f;
    SoftmaxRow<float> row[2];
    row[0].init();
    row[1].init();
    const float scale_log2 = p.scale_log2;
    // The online-softmax step of key tile nb; the mask is evaluated only on boundary tiles.
    auto softmax = [&](const float (&s)[Tr::kSAcc], uint32_t (&pf)[Tr::kPVSteps][4],
                       float (&alpha)[2], int nb) {
        if (tiles.needs_mask(nb))
            wg_softmax_step<T, BLOCK_N, NT, true>(s, pf, row, alpha, row0, nb * BLOCK_N, t, p,
                                                  seqlen_q, seqlen_k, CAUSAL, scale_log2);
        else
            wg_softmax_step<T, BLOCK_N, NT, false>(s, pf, row, alpha, row0, nb * BLOCK_N, t, p,
                                                   seqlen_q, seqlen_k, CAUSAL, scale_log2);
    };

    if (n_tiles > 0) {
        if (tid == 0) {
            for (int st = 0; st < S; ++st) {
                mbarrier_init(full_k(st), Tr::kThreads);
                mbarrier_init(full_v(st), Tr::kThreads);
                mbarrier_init(empty_k(st), Tr::kThreads);
                mbarrier_init(empty_v(st), Tr::kThreads);
            }
        }
        __syncthreads();  // the barriers are initialised before anyone arrives on them
        // ---- prologue: Q (waited for with a CTA barrier, once), K_0, then the "slots" t =
        // 0 .. S - 2 (slot t = K_{t+1} and V_t: what iteration t consumes) ----
        q_loader.load(sQ, q_base + (int64_t)m0 * p.q_row_stride, p.q_row_stride, seqlen_q - m0,
                      chunks_valid, q_base);
        cp_async_commit();
        load_k(0);
        for (int tt = 0; tt < S - 1; ++tt) {
            if (tt + 1 < n_tiles) load_k(tt + 1);
            if (tt < n_tiles) load_v(tt);
        }
        cp_async_wait<0>();  // the Q group (K/V copies are tracked by the mbarriers)
        fence_proxy_async();
        __syncthreads();  // Q (no mbarrier) has landed for every thread
        uint32_t p_cur[Tr::kPVSteps][4];
        {
            float s[Tr::kSAcc];
            wait_k(0);
            wgmma_fence();
            issue_qk(s, 0);
            wgmma_wait<0>();
            wgmma_fence_operand(s);
            mbarrier_arrive(empty_k(0));
            float alpha[2];
            softmax(s, p_cur, alpha, n_block_min);
        }
        // Warpgroup ping-pong (FlashAttention-3 Sec. 3.1): the two warpgroups take turns issuing
        // their GEMMs (named barriers 1 and 2), so that one's softmax overlaps the other's GEMMs
        // instead of both computing softmax while the tensor cores idle. Warpgroup 1 hands the
        // first turn to warpgroup 0.
        constexpr int kPingPong = Tr::kWarpgroups == 2;
        if (kPingPong && wg == 1) named_barrier_arrive(1, 256);

        // ---- main loop: iteration i consumes V_i (P_i V_i) and K_{i+1} (S_{i+1}) ----
        for (int i = 0; i < n_tiles; ++i) {
            const bool has_next = i + 1 < n_tiles;
            if (has_next) wait_k(i + 1);
            wait_v(i);
            if (kPingPong) named_barrier_sync(1 + wg, 256);           // my turn
            float s[Tr::kSAcc];
            // O and P_i were last written by ordinary instructions (rescale, copy): keep those
            // writes before the wgmma fence (PTX: registers of a wgmma written before it).
            wgmma_fence_operand(o);
            wgmma_fence_operand(p_cur);
            wgmma_fence();
            if (has_next) issue_qk(s, i + 1);
            issue_pv(o, p_cur, i);
            if (kPingPong) named_barrier_arrive(1 + (wg ^ 1), 256);   // the other's turn
            if (has_next) {
                uint32_t p_next[Tr::kPVSteps][4];
                float alpha[2];
                wgmma_wait<1>();                   // S_{i+1} is done; P_i V_i may still run
                wgmma_fence_operand(s);
                mbarrier_arrive(empty_k((i + 1) % S));
                const int nb = n_block_min + i + 1;
                softmax(s, p_next, alpha, nb);
                wgmma_wait<0>();                   // P_i V_i is done: O and P_i are free
                // P_i is read by the P_i V_i group until here: keeping it live to this point
                // stops the compiler from building P_{i+1} in P_i's registers (ptxas would then
                // serialise the wgmma pipeline, C7513).
                wgmma_fence_operand(p_cur);
                wgmma_fence_operand(o);
                mbarrier_arrive(empty_v(i % S));
#pragma unroll
                for (int d = 0; d < DT; ++d) {
                    o[4 * d + 0] *= alpha[0];
                    o[4 * d + 1] *= alpha[0];
                    o[4 * d + 2] *= alpha[1];
                    o[4 * d + 3] *= alpha[1];
                }
#pragma unroll
                for (int kk = 0; kk < Tr::kPVSteps; ++kk)
#pragma unroll
                    for (int e = 0; e < 4; ++e) p_cur[kk][e] = p_next[kk][e];
            } else {
                wgmma_wait<0>();
                wgmma_fence_operand(o);
                mbarrier_arrive(empty_v(i % S));
            }
            // Refill: slot i + S - 1 (K_{i+S}, V_{i+S-1}); their ring slots held K_i and
            // V_{i-1}, which both warpgroups released before the end of iteration i - 1.
            if (i + S < n_tiles) load_k(i + S);
            if (i + S - 1 < n_tiles) load_v(i + S - 1);
        }
        // Warpgroup 1 handed over one more turn than warpgroup 0 takes in the loop.
        if (kPingPong && wg == 0) named_barrier_sync(1, 256);
    }

    // ---- epilogue: l_i summed over the quad; out = O / l (0 for an empty row); LSE ----
    T* o_base = cta.o;
    float* lse_base = cta.lse;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        float l = row[hh].l;
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = SoftmaxRow<float>::inv_l(l);
        const int r = row0 + 8 * hh;
        if (r < seqlen_q) {
            T* o_row = o_base + (int64_t)r * p.o_row_stride;
#pragma unroll
            for (int d = 0; d < DT; ++d) {
                const int col = d * 8 + 2 * t;
                if (col < p.headdim)
                    *reinterpret_cast<uint32_t*>(o_row + col) =
                        pack2<T>(o[4 * d + 2 * hh] * inv, o[4 * d + 2 * hh + 1] * inv);
            }
            if (t == 0 && p.lse != nullptr) lse_base[r] = row[hh].lse(l, scale_log2);
        }
    }
}

// One CTA of the wgmma forward, for the shared entry cf::flash_fwd_entry
// (common/fwd_entry.cuh): the name expression is
// cf::flash_fwd_entry<cf::FlashFwdWgmma<T, HEADDIM, BLOCK_M, BLOCK_N, CAUSAL, STAGES>, T>.
template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, bool CAUSAL, int STAGES>
struct FlashFwdWgmma {
    static constexpr int kThreads = WgmmaFwdTraits<T, HEADDIM, BLOCK_M, BLOCK_N, STAGES>::kThreads;
    static __device__ __forceinline__ void run(const FwdParams& p) {
        flash_fwd_wgmma_block<T, HEADDIM, BLOCK_M, BLOCK_N, CAUSAL, STAGES>(p);
    }
};

}  // namespace cf
