// Split-KV decoding against a contiguous or paged KV cache (Flash-Decoding: Dao, Haziza, Massa,
// Sizov, "Flash-Decoding for long-context inference", 2023; each split is the FlashAttention-2
// forward pass of arXiv 2307.08691, Algorithm 1, over a range of keys).
//
// Three kernels:
//   decode_split_kernel   grid (nheads_k * row_chunks, num_splits, batch) (grid_order 1, how
//                         decode.py launches contiguous caches) or (num_splits, batch, nheads_k *
//                         row_chunks) (grid_order 0, paged caches). One CTA streams the
//                         K/V tiles of one split of one sequence and one KV head through a
//                         cp.async ring of STAGES shared-memory buffers, and computes every query
//                         row that reads that KV head (GQA group x seqlen_q rows, up to GROUP = 16)
//                         against each tile with tensor cores (mma.m16n8k16, fp32 accumulate), so
//                         one read of the cache serves the whole group. It writes the normalised
//                         partial output and its LSE in fp32 to the workspace, or the final output
//                         directly when there is a single split; with decode_flags, the last block
//                         of a head merges the partials (fused combine, the default), or the blocks
//                         of a thread-block cluster merge them through distributed shared memory.
//   decode_combine_kernel merges the splits exactly (LSE-weighted, natural log) in fp32 and
//                         writes the output in T and the LSE; also the public merge_states.
//   decode_append_kernel  writes new k/v tokens at cache_seqlens[b] (contiguous or paged), in
//                         place, before the split kernel runs.
// All three wait (common/pdl.cuh) before their first global load, so that they may be launched
// as programmatic dependent launches: decode.py launches the append and split kernels so on
// sm_90+; the combine kernel (merge_states, the unfused variants) is launched plainly.
//
// Work split inside a CTA: warp w owns keys [w * BLOCK_N / NWARPS, (w + 1) * BLOCK_N / NWARPS)
// of every tile and keeps its own online-softmax state (m, l, acc) for the 16 rows; the NWARPS
// states are merged once at the end (the same merge as between splits). No shared memory
// traffic or barrier between warps inside the loop except the pipeline's one __syncthreads.
//
// Masking (common/mask.cuh, design.md semantics 1, 2, 5): a sequence's length is
// len = cache_seqlens[b] + seqlen_new (clamped to the capacity); query row i sees key j iff
// j < len and (not causal or j <= len - seqlen_q + i). Keys at or beyond len are never read:
// their cp.async copies have src_size 0 (zero-fill, no global read) and their scores are set to
// -inf before the max, so a NaN-filled cache tail cannot reach the result. Page ids outside
// [0, num_pages) are never dereferenced either (their rows are zero-filled; the validation mode
// of checks.check_kvcache raises before launch, so such a result is unspecified but memory-safe).
#include "common/dtype.cuh"
#include "common/params.cuh"
#include "common/mask.cuh"
#include "common/online_softmax.cuh"
#include "common/mma.cuh"
#include "common/cluster.cuh"
#include "common/pdl.cuh"
#include "common/tma.cuh"

namespace cf {

namespace decode_detail {
// float -> T, round to nearest even (local names: dtype.cuh may grow its own helpers)
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }

__device__ __forceinline__ unsigned dynamic_smem_bytes() {
    unsigned r;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

__device__ __forceinline__ bool fits_i32(int64_t x) { return x >= 0 && x <= 0x7fffffff; }

// An L2 policy that marks lines evict-first (K/V are streamed once per decode step).
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
    uint64_t pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}
}  // namespace decode_detail

// Compile-time options of the split kernel (template parameter FLAGS, a bit set). 0 is the
// plain kernel; the others are measured variants (experiments/sweep_decode_variants.py).
namespace decode_flags {
// The last split block to finish for a (batch, KV head, row chunk) merges all splits of its rows
// and writes the final output and LSE (no combine launch). Needs a counter per (batch, KV head,
// row chunk) in a buffer the launcher passes (the workspace, or decode.py's per-stream zero
// buffer), zero before the first launch; the last block resets it to zero,
// so the launch can be replayed (CUDA graphs).
constexpr int kFusedCombine = 1;
// K/V copies carry an L2 evict_first cache policy (cp.async ... .L2::cache_hint).
constexpr int kEvictFirst = 2;
// K/V copies carry the .L2::256B prefetch-size hint.
constexpr int kPrefetch256 = 4;
// K/V copies carry the .L2::128B prefetch-size hint (H200, session-3 probe: +2% with the padded
// layout; the hint CUTLASS's cp.async atoms carry). Bit 8 was the per-row bulk-copy variant
// (removed: 2x slower, experiments/NOTES.md v2 outcome).
constexpr int kPrefetch128 = 8;
// Warp-local pipeline (contiguous caches, cp.async path): each warp copies the key rows it owns
// (its BLOCK_N / NWARPS keys of every tile) and waits only for its own copies (cp.async wait +
// __syncwarp), so the loop has no CTA barrier and the warps stream independently.
constexpr int kWarpLocal = 16;
// Cluster combine (sm_90): when the launch groups the num_splits blocks of each (batch, KV head,
// row chunk) into one thread-block cluster (cluster_nctarank() == num_splits, grid_order 0),
// each block leaves its normalised partial (fp32 O and LSE) in its own shared memory and, after
// a cluster barrier, the blocks merge slices of the rows by reading every split's partial
// through distributed shared memory (no workspace, no fence, no atomic, no L2 round trip).
// A launch without clusters runs the other paths (fused combine or partials to the workspace).
constexpr int kClusterCombine = 32;
// Fused combine with one release/acquire arrival per block: after a __syncthreads, thread 0
// alone increments the counter with atom.acq_rel.gpu (releasing the block's partial writes,
// which the barrier ordered before it, and acquiring the other blocks' for the last one), instead
// of a __threadfence() (fence.sc.gpu) in every thread, a relaxed atomic and a second fence.
constexpr int kReleaseArrive = 64;
// K and V of a tile in separate cp.async groups (K first): the scores and probabilities of a tile
// are computed once its K has landed, while its V is still arriving; P V waits for V (a second
// barrier per tile). Aimed at splits of one or two tiles, where nothing else hides the V copy.
constexpr int kKVGroups = 128;
// Paged caches: the page ids of the split's first tiles are fetched together with the sequence's
// length (both by cp.async, one wait), for the split the block would have if the sequence filled
// its block_table row (len = max_pages_per_seq * page_size). Where that guess gives this block's
// first tile (the longest sequences of a batch, which set the call's time), one dependent round
// trip fewer before the first K/V copy; elsewhere they are fetched again after the length, as
// without the flag. A wrong guess costs a few 4-byte reads of block_table, never a K/V read.
constexpr int kSpecPageIds = 256;
// Programmatic dependent launch (common/pdl.cuh): where the next kernel of the stream is let
// be scheduled. Default: after the main loop (the epilogue and merge remain). kPdlEarlyTrigger:
// at entry, after the wait; kPdlNoTrigger: never explicitly (implicitly when the blocks exit).
constexpr int kPdlEarlyTrigger = 512;
constexpr int kPdlNoTrigger = 1024;
// Tile-loop instruction count (v18; the loop executed ~600 instructions per warp per 64-key tile
// at b64 x 1k, 54% of them integer, experiments/NOTES.md v17). Each is bitwise neutral except
// kLazyRescale.
// Contiguous caches: each thread's K/V source pointers are computed once per tile and advanced by
// a precomputed row step per copy (64-bit adds) instead of a 64-bit j * row_stride product per
// copy; a tile whose rows all lie below len (and a thread whose column is inside headdim) copies
// without the per-copy validity test and address select.
// Paged caches (page_size a power of two; the launcher checks, the kernel traps otherwise): the
// ring holds one page id per page of the tile instead of one per row (BLOCK_N / page_size ids,
// or one when a page holds whole tiles), so a tile needs fewer 4-byte id copies; pages of
// BLOCK_N keys or more copy as the contiguous path from the page's row, smaller pages compute
// each copy's address from its page id, its row's offset in the page (a shift and a mask, no
// division) and no per-copy length test on tiles wholly inside the sequence. An id outside
// [0, num_pages) zero-fills its rows and is replaced by page 0 as the (unread) source address.
constexpr int kCopyPointers = 2048;
// Skip the accumulator rescale (HEADDIM / 2 FMUL per thread) on a tile where no row of the warp
// moved its running max (warp vote): the skipped factors are exactly 1, so the result is the same.
constexpr int kSkipRescale = 4096;
// Lazy rescale (FlashAttention-4's conditional rescaling): the running max, the reference point
// of exp2, moves only when some row of the warp would gain more than kLazyThreshold (log2 units,
// a factor 256) over it; otherwise the tile's probabilities are taken against the stale point
// (at most 2^8, no overflow in fp32, the same relative precision in bf16/fp16). The final
// O = acc / l and LSE = m + log(l) are the same quantities; the roundings differ.
constexpr int kLazyRescale = 8192;
// Q's mma A fragments stay in registers for the whole loop (HEADDIM / 4 registers) instead of
// one ldmatrix per 16 dims per tile.
constexpr int kQRegs = 16384;
// Tiles in which every valid row of the block sees every key (all but the causal diagonal's and
// the last partial tile) skip the per-score mask (block-uniform branch). Padding rows (zero Q)
// then get finite scores; they are never written.
constexpr int kMaskFast = 32768;
// TMA copies (sm_90, contiguous caches; v30 in experiments/NOTES.md): thread 0 issues each
// tile's K and V as HEADDIM / 64 boxes of BLOCK_N rows x 64 elements per cache
// (cp.async.bulk.tensor through the tensor maps of decode_split_tma_kernel), completing on one
// mbarrier per stage, instead of every thread issuing 16-byte cp.async copies. The boxes land
// with the 128-byte swizzle (DecodeTraits::kv_offset_tma) behind a Q area padded to 1024 bytes.
// Rows past the cache's capacity are zero-filled by the TMA unit; rows in [len, capacity) of a
// sequence's last tile are read (inside the cache, never into the result): their scores are
// masked to -inf, and each warp zeroes its own V rows there before P V (0 x NaN would be NaN).
// Bitwise the same output as the cp.async kernel: the same values meet the same mma in the
// same order.
constexpr int kTma = 65536;
// Speculative prologue (contiguous caches, copy pointers, the CTA pipeline): the first
// STAGES - 1 tiles of the split the block would have at full capacity (len = seqlen_cache) are
// issued right after the grid-dependency wait, before the sequence's length has arrived (it
// comes by a 4-byte cp.async beside them, in its own group). Where that guess gives this
// block's tiles (every block of a single-split launch; the longest sequences otherwise) the
// first K/V copies start one round trip earlier; elsewhere the guessed copies are let land and
// the prologue is issued again (one round trip later than without the flag). The guessed copies
// read rows below the capacity only; rows in [len, capacity) of the sequence's last tile reach
// shared memory (never the result): their scores are masked to -inf, and each warp zeroes its
// own V rows there before P V, as with kTma.
constexpr int kSpecKV = 131072;
// Q tile by 16-byte cp.async (the CTA pipeline, cp.async copies: not with kTma, kWarpLocal,
// kQRegs or kSpecKV), issued beside the length (its round trip overlaps the length's) and
// landed with the first K/V group committed after it (the first tile's; with kSpecPageIds and
// a missed guess, the real ids'). Without the flag the Q tile comes by 2-byte loads after the
// K/V copies, each load's shared-memory store waiting for it before the next load issues: at
// b64 x 128 keys those stores held 47% of the kernel's stall samples (ncu source view,
// experiments/NOTES.md v44). Rows past the block's valid rows and columns past headdim are
// zero-filled. A q whose base or varying strides are not 16-byte multiples takes the 2-byte
// loads (block-uniform check). The tile holds the same bits either way.
constexpr int kQAsync = 262144;
constexpr int kAll = 524287;  // every defined bit (decode.py checks flags against its own list)
}  // namespace decode_flags
constexpr float kLazyThreshold = 8.f;

// 16-byte cp.async of one K/V chunk with the FLAGS' cache hints; valid = false zero-fills the
// 16 bytes and reads nothing (src_size 0), `src` must still be a valid address.
template <int FLAGS>
__device__ __forceinline__ void cp_async_kv(uint32_t smem_addr, const void* src, bool valid,
                                            uint64_t policy) {
    const int n = valid ? 16 : 0;
    constexpr bool ef = (FLAGS & decode_flags::kEvictFirst) != 0;
    constexpr bool pf256 = (FLAGS & decode_flags::kPrefetch256) != 0;
    constexpr bool pf128 = (FLAGS & decode_flags::kPrefetch128) != 0;
    static_assert(!(pf128 && pf256), "one prefetch-size hint");
#define CF_CP_ASYNC_KV(HINTS) \
    asm volatile("cp.async.cg.shared.global" HINTS " [%0], [%1], 16, %2;\n" \
                 :: "r"(smem_addr), "l"(src), "r"(n) : "memory")
#define CF_CP_ASYNC_KV_POLICY(HINTS) \
    asm volatile("cp.async.cg.shared.global.L2::cache_hint" HINTS " [%0], [%1], 16, %2, %3;\n" \
                 :: "r"(smem_addr), "l"(src), "r"(n), "l"(policy) : "memory")
    if constexpr (ef && pf256) CF_CP_ASYNC_KV_POLICY(".L2::256B");
    else if constexpr (ef && pf128) CF_CP_ASYNC_KV_POLICY(".L2::128B");
    else if constexpr (ef) CF_CP_ASYNC_KV_POLICY("");
    else if constexpr (pf256) CF_CP_ASYNC_KV(".L2::256B");
    else if constexpr (pf128) CF_CP_ASYNC_KV(".L2::128B");
    else cp_async_16(smem_addr, src, valid);
#undef CF_CP_ASYNC_KV
#undef CF_CP_ASYNC_KV_POLICY
}

// Arrival at a split group's counter: old value; acq_rel at GPU scope (see kReleaseArrive).
__device__ __forceinline__ int atomic_add_acq_rel_gpu(int* counter, int v) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;"
                 : "=r"(old) : "l"(counter), "r"(v) : "memory");
    return old;
}

// Online merge of partial states (o normalised, lse natural log) into a running (m, l, acc):
// the combine of Flash-Decoding done in one pass over the parts, a batch at a time. Parts with
// lse = -inf are skipped (their o is not used). Result o = acc / l, lse = m + log(l).
// Compile-time merge batch size, passed to the generic lambdas that load and merge a batch.
template <int N> struct MergeBatch { static constexpr int kN = N; };

struct MergeState4 {
    float m, l, acc[4];
    __device__ __forceinline__ void init() {
        m = neg_inf<float>();
        l = 0.f;
        acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
    }
    // Merges the first n <= N parts of a batch at once: the batch's max, then each part's weight
    // exp(lse - max) independently (no dependent chain of exps through a running max), then one
    // rescale of the running state. Explicit roundings (__fmaf_rn, __fadd_rn): the same result
    // wherever the compiler inlines this, so the fused and the cluster combine agree bitwise.
    // Branch-free (v12): parts past n and empty parts (lse = -inf; their o is unused and may be
    // NaN) are masked by selects, so the N weights are computed back to back and the compiler
    // does not wrap each part in a branch (v11 timeline: 0.77 us at 8 parts, 1.0 us at 16).
    // The same operations in the same order as the branchy form: bitwise the same result.
    template <int N>
    __device__ __forceinline__ void add_batch(const float (&lse)[N], const float4 (&o)[N],
                                              int n) {
        static_assert(N % 4 == 0, "batch: a multiple of 4 (four max chains)");
        // four interleaved max chains (max is exact: any order gives the same value)
        float m0 = neg_inf<float>(), m1 = m0, m2 = m0, m3 = m0;
#pragma unroll
        for (int u = 0; u < N; u += 4) {
            m0 = fmaxf(m0, u < n ? lse[u] : neg_inf<float>());
            m1 = fmaxf(m1, u + 1 < n ? lse[u + 1] : neg_inf<float>());
            m2 = fmaxf(m2, u + 2 < n ? lse[u + 2] : neg_inf<float>());
            m3 = fmaxf(m3, u + 3 < n ? lse[u + 3] : neg_inf<float>());
        }
        const float mb = fmaxf(fmaxf(m0, m1), fmaxf(m2, m3));
        if (mb == neg_inf<float>()) return;  // every part of the batch is empty
        const float m_new = fmaxf(m, mb);
        const float f = expf(m - m_new);     // m = -inf (first batch): 0
        float wt[N];
        bool ok[N];
#pragma unroll
        for (int u = 0; u < N; ++u) {
            ok[u] = u < n && lse[u] != neg_inf<float>();
            wt[u] = expf(ok[u] ? lse[u] - m_new : neg_inf<float>());  // 0 where masked
        }
        float lb = 0.f, a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll
        for (int u = 0; u < N; ++u) {
            lb = ok[u] ? __fadd_rn(lb, wt[u]) : lb;
            a0 = ok[u] ? __fmaf_rn(wt[u], o[u].x, a0) : a0;
            a1 = ok[u] ? __fmaf_rn(wt[u], o[u].y, a1) : a1;
            a2 = ok[u] ? __fmaf_rn(wt[u], o[u].z, a2) : a2;
            a3 = ok[u] ? __fmaf_rn(wt[u], o[u].w, a3) : a3;
        }
        l = __fmaf_rn(l, f, lb);
        acc[0] = __fmaf_rn(acc[0], f, a0);
        acc[1] = __fmaf_rn(acc[1], f, a1);
        acc[2] = __fmaf_rn(acc[2], f, a2);
        acc[3] = __fmaf_rn(acc[3], f, a3);
        m = m_new;
    }
};

// Writes a merged (row, 4 columns) item: o = acc / l in T, and the LSE (natural log; -inf for a
// row that saw no key) once per row. Shared by the fused and the cluster combine, so the two
// give bitwise the same output for the same parts.
template <typename T>
__device__ __forceinline__ void store_merged(const DecodeParams& p, const MergeState4& st, int b,
                                             int qi, int h, int c) {
    const float inv = inv_normaliser(st.l);
    T* out = reinterpret_cast<T*>(p.o) + b * p.o_batch_stride + qi * p.o_row_stride
             + h * p.o_head_stride + c;
#pragma unroll
    for (int x = 0; x < 4; ++x) out[x] = decode_detail::from_float<T>(st.acc[x] * inv);
    if (c == 0 && p.lse != nullptr)
        p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + qi] =
            st.l == 0.f ? neg_inf<float>() : st.m + logf(st.l);
}

// Compile-time shape of the split kernel; decode.py's smem formula mirrors kSmemBytes.
template <typename T, int HEADDIM, int BLOCK_N, int NWARPS, int GROUP, int STAGES>
struct DecodeTraits {
    static_assert(sizeof(T) == 2, "tensor-core decode: fp16 / bf16 only");
    static_assert(HEADDIM % 16 == 0 && HEADDIM <= 256, "HEADDIM: multiple of 16, <= 256");
    static_assert(GROUP == 16, "GROUP is the mma M dimension (16 rows per CTA)");
    static_assert(BLOCK_N % (16 * NWARPS) == 0, "each warp owns whole 16-key mma k-steps");
    static_assert(STAGES >= 2, "pipeline needs at least double buffering");
    static constexpr int kThreads = NWARPS * 32;
    static constexpr int kVec = 16 / sizeof(T);               // elements per 16-byte copy
    static constexpr int kChunksPerRow = HEADDIM / kVec;
    static constexpr int kQStride = HEADDIM + kVec;           // Q rows: +16 B, conflict-free
    static constexpr int kKeysPerWarp = BLOCK_N / NWARPS;
    static constexpr int kKSteps = kKeysPerWarp / 16;         // 16-key blocks per warp per tile
    // K and V tiles: rows of HEADDIM elements without padding, 16-byte chunks swizzled inside
    // each 128-byte group (chunk c of row r stored at c ^ (r % 8); see kv_offset). A warp's
    // copies of two whole rows then fill 512 contiguous bytes, and each 8 x 16 B ldmatrix
    // matrix (8 consecutive rows, one logical chunk) touches 8 different bank groups. The padded
    // rows used before (+16 B per row) split each warp's copies into extra L2 requests: 2.0 L2
    // sector lookups per DRAM sector and 88% of DRAM peak vs 1.5 and 95% for a plain copy with
    // the same global addresses (ncu, H200, experiments/NOTES.md v4).
    static_assert(kChunksPerRow % 8 == 0, "K/V rows: whole 128-byte swizzle groups");
    static constexpr int kTileElems = BLOCK_N * HEADDIM;      // one K (or V) tile
    static constexpr int kStageElems = 2 * kTileElems;        // K tile then V tile
    static constexpr int kQElems = GROUP * kQStride;
    // Element offset of 16-byte chunk `chunk` of row `row` in a K or V tile.
    static __device__ __forceinline__ int kv_offset(int row, int chunk) {
        return row * HEADDIM + (chunk ^ (row & 7)) * kVec;
    }
    // decode_flags::kTma: a tile is HEADDIM / 64 boxes of [BLOCK_N][64] elements (128-byte rows,
    // the TMA unit's 128-byte swizzle: chunk c of a box row r at c ^ (r % 8)); chunk `chunk` of
    // the row lies in box chunk / 8. The same conflict-free ldmatrix pattern as kv_offset.
    static __device__ __forceinline__ int kv_offset_tma(int row, int chunk) {
        return (chunk >> 3) * (BLOCK_N * 64) + row * 64 + ((chunk & 7) ^ (row & 7)) * kVec;
    }
    // Page ids of the tiles in flight, a ring of STAGES tiles (paged caches; allocated always).
    static constexpr int kPageIdBytes = STAGES * BLOCK_N * 4;
    static constexpr int kSmemBytes = (kQElems + STAGES * kStageElems) * (int)sizeof(T)
                                      + kPageIdBytes;
    // decode_flags::kTma: the stage buffers start 1024-byte aligned (the swizzle's period), so
    // the Q area is padded; the page-id ring (unused on contiguous caches) holds the STAGES
    // mbarriers.
    static constexpr int kQBytes = kQElems * (int)sizeof(T);
    static constexpr int kQBytesTma = (kQBytes + 1023) / 1024 * 1024;
    static constexpr int kSmemBytesTma = kSmemBytes - kQBytes + kQBytesTma;
    // Epilogue scratch (aliases the stage buffers once the pipeline has drained).
    static constexpr int kOStride = HEADDIM + 4;
    static constexpr int kEpilogueBytes = (NWARPS * GROUP * kOStride + 3 * NWARPS * GROUP
                                           + 2 * GROUP) * 4;
    // Cluster combine: this block's normalised partial O [GROUP][HEADDIM] and LSE [GROUP] in
    // fp32, after the scratch (read by the other blocks of the cluster).
    static constexpr int kPartBytes = (GROUP * HEADDIM + GROUP) * 4;
    static_assert(kEpilogueBytes <= STAGES * kStageElems * (int)sizeof(T), "epilogue fits");
    static constexpr bool kPartFits =
        kEpilogueBytes + kPartBytes <= STAGES * kStageElems * (int)sizeof(T);
    // Largest cluster the cluster combine merges (the non-portable maximum of sm_90).
    static constexpr int kMaxCluster = 16;
    // Parts loaded and merged at once by the fused and the cluster combine (MergeState4::
    // add_batch; both use the same batches, so they give bitwise the same result); 8 at hd256,
    // where 16 would spill. With at most half that many splits, both use the half batch (v12b:
    // fewer masked parts to step over; the same operations on the valid parts, so the same
    // result).
    static constexpr int kMergeBatch = HEADDIM >= 256 ? 8 : 16;
    // The half batch for at most kMergeBatch / 2 splits (hd256: none, the registers are short).
    static constexpr int kMergeHalf = HEADDIM >= 256 ? kMergeBatch : kMergeBatch / 2;
    static_assert((BLOCK_N * kChunksPerRow) % kThreads == 0, "whole copies per thread");
    static constexpr int kCopiesPerThread = BLOCK_N * kChunksPerRow / kThreads;
    // Copy i = tid + c * kThreads of a tile is row i / kChunksPerRow, column chunk
    // i % kChunksPerRow; with kThreads a multiple of kChunksPerRow a thread keeps one column
    // chunk and visits rows tid / kChunksPerRow + c * kRowsPerPass, c < kCopiesPerThread.
    static_assert(kThreads % kChunksPerRow == 0, "a thread copies one column chunk of its rows");
    static constexpr int kRowsPerPass = kThreads / kChunksPerRow;
    // Warp-local copies (decode_flags::kWarpLocal): a warp copies its own kKeysPerWarp rows,
    // lane l column chunk l % kChunksPerRow of rows l / kChunksPerRow + c * kWarpRowsPerPass.
    static constexpr int kWarpRowsPerPass = kChunksPerRow >= 32 ? 1 : 32 / kChunksPerRow;
    static constexpr int kWarpCopies = kKeysPerWarp * kChunksPerRow / 32;
};

// Runtime values of the split kernel that DecodeParams does not carry.
struct DecodeSplitExtra {
    int* counters;   // FLAGS & kFusedCombine: (batch, nheads_k * row_chunks) arrival counters
    int grid_order;  // 0: grid (splits, batch, nheads_k * row_chunks); 1: (nheads_k * row_chunks,
                     // splits, batch), the KV-head blocks of one key range launched together
    const void* tmap_k = nullptr;  // decode_flags::kTma: generic addresses of the tensor maps
    const void* tmap_v = nullptr;  // (__grid_constant__ parameters) of K and V
};

// Length (tokens, after appending) of sequence b, clamped to [0, capacity] so that a bad
// cache_seqlens with validate=False cannot make the kernels read outside the cache.
__device__ __forceinline__ int sequence_length_from(const DecodeParams& p, int cache_seqlen) {
    int len = p.cache_seqlens ? cache_seqlen + p.seqlen_new : p.seqlen_cache;
    return max(0, min(len, p.seqlen_cache));
}
__device__ __forceinline__ int sequence_length(const DecodeParams& p, int b) {
    return sequence_length_from(p, p.cache_seqlens ? p.cache_seqlens[b] : 0);
}

// Page slot of key j in its sequence's block_table row (a shift for powers of two).
__device__ __forceinline__ int page_slot(const DecodeParams& p, int j) {
    return p.page_shift >= 0 ? (j >> p.page_shift) : (j / p.page_size);
}

template <typename T, int HEADDIM, int BLOCK_N, int NWARPS, int GROUP, int STAGES, bool PAGED,
          int FLAGS>
__device__ __forceinline__ void decode_split(const DecodeParams& p, const DecodeSplitExtra& ex) {
    using Tr = DecodeTraits<T, HEADDIM, BLOCK_N, NWARPS, GROUP, STAGES>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    constexpr bool WL = (FLAGS & decode_flags::kWarpLocal) != 0;
    constexpr bool KVG = (FLAGS & decode_flags::kKVGroups) != 0;
    constexpr bool CP = (FLAGS & decode_flags::kCopyPointers) != 0;
    constexpr bool LAZY = (FLAGS & decode_flags::kLazyRescale) != 0;
    constexpr bool SKIP = LAZY || (FLAGS & decode_flags::kSkipRescale) != 0;
    constexpr bool QREGS = (FLAGS & decode_flags::kQRegs) != 0;
    constexpr bool MASKFAST = (FLAGS & decode_flags::kMaskFast) != 0;
    constexpr bool TMA = (FLAGS & decode_flags::kTma) != 0;
    constexpr bool SPECKV = (FLAGS & decode_flags::kSpecKV) != 0;
    constexpr bool QASYNC = (FLAGS & decode_flags::kQAsync) != 0;
    static_assert((FLAGS & ~decode_flags::kAll) == 0, "unknown FLAGS bit");
    static_assert(!QASYNC || (!TMA && !WL && !QREGS && !SPECKV),
                  "Q by cp.async: the CTA pipeline with cp.async K/V copies");
    static_assert(!SPECKV || (!PAGED && CP && !WL && !KVG && !TMA),
                  "speculative prologue: contiguous caches, copy pointers, the CTA pipeline");
    static_assert(!TMA || (!PAGED && !WL && !KVG && HEADDIM % 64 == 0),
                  "TMA copies: contiguous caches, the CTA pipeline, whole 64-element boxes");
    // cp.async groups per tile (kKVGroups: K, then V and nothing else)
    constexpr int kGroupsPerTile = KVG ? 2 : 1;
    static_assert(!(FLAGS & decode_flags::kClusterCombine) || Tr::kPartFits,
                  "cluster combine: the partial fits beside the epilogue scratch");
    static_assert(!WL || !PAGED, "warp-local copies: contiguous caches");
    static_assert(!WL || (32 % Tr::kChunksPerRow == 0 || Tr::kChunksPerRow == 32),
                  "warp-local copies: whole rows per pass of a warp");
    if (decode_detail::dynamic_smem_bytes() < (unsigned)(TMA ? Tr::kSmemBytesTma : Tr::kSmemBytes))
        __trap();  // launch bug, never silent
    // Paged copy pointers address a page by shift and mask: every tile starts a page (or lies in
    // one) and a copy pass does not straddle two pages only if BLOCK_N and the pass are powers of
    // two (with a 96-key tile, pages of 16 would put a copy one row past its page).
    static_assert(!(CP && PAGED) || ((BLOCK_N & (BLOCK_N - 1)) == 0
                                     && (Tr::kRowsPerPass & (Tr::kRowsPerPass - 1)) == 0),
                  "paged copy pointers: BLOCK_N and the copy pass must be powers of two");
    if constexpr (CP && PAGED)  // paged copy pointers: a power-of-two page, 32-bit strides
        if (p.page_shift < 0 || !decode_detail::fits_i32(p.k_batch_stride)
            || !decode_detail::fits_i32(p.v_batch_stride)
            || !decode_detail::fits_i32((int64_t)p.page_size * p.k_row_stride)
            || !decode_detail::fits_i32((int64_t)p.page_size * p.v_row_stride))
            __trap();
    constexpr bool kEarlyTrigger = (FLAGS & decode_flags::kPdlEarlyTrigger) != 0;
    constexpr bool kLateTrigger = (FLAGS & (decode_flags::kPdlEarlyTrigger
                                            | decode_flags::kPdlNoTrigger)) == 0;
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sStages = reinterpret_cast<T*>(smem_raw + (TMA ? Tr::kQBytesTma : Tr::kQBytes));
    int* sPage = reinterpret_cast<int*>(sStages + STAGES * Tr::kStageElems);  // [STAGES][BLOCK_N]
    uint64_t* sBar = reinterpret_cast<uint64_t*>(sPage);  // kTma: [STAGES] mbarriers

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    if constexpr (TMA) {  // one mbarrier per stage, one arrival (thread 0's expect_tx) per use
        if ((smem_u32addr(sStages) & 1023u) != 0u) __trap();  // the swizzle needs 1024 B
        if (tid == 0) {
            tma_prefetch_desc(ex.tmap_k);
            tma_prefetch_desc(ex.tmap_v);
#pragma unroll
            for (int s = 0; s < STAGES; ++s) mbarrier_init(smem_u32addr(sBar + s), 1u);
            mbarrier_init_fence();
        }
        __syncthreads();
    }
    const int g = lane >> 2, t = lane & 3;  // mma groupID / threadID_in_group
    const int split = ex.grid_order == 0 ? blockIdx.x : blockIdx.y;
    const int b = ex.grid_order == 0 ? blockIdx.y : blockIdx.z;
    const int hz = ex.grid_order == 0 ? blockIdx.z : blockIdx.x;  // hk * num_row_chunks + chunk
    const int hk = hz / p.num_row_chunks;
    const int row_base = (hz % p.num_row_chunks) * GROUP;
    const int rows = p.h_per_kv * p.seqlen_q;  // query rows reading this KV head
    // Row r of the CTA is query token qi = r / h_per_kv of head hk * h_per_kv + r % h_per_kv.

    // Query token of this thread's rows g and g + 8 (-1: a padding row).
    int row_qi[2];
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
        const int rg = row_base + g + 8 * rh;
        row_qi[rh] = rg < rows ? rg / p.h_per_kv : -1;
    }

    // ---- this split's tiles: [tile_begin, tile_end) of the sequence's ceil(len / BLOCK_N) ----
    constexpr bool SPEC = PAGED && (FLAGS & decode_flags::kSpecPageIds) != 0;
    const bool tile_pages = PAGED && p.page_size % BLOCK_N == 0;
    // kSpecPageIds: the ids of the first STAGES - 1 tiles of the split for len = capacity,
    // copied in the same cp.async group as the length (see decode_flags::kSpecPageIds), into
    // the ring slots tile % STAGES as the prologue's own fetch.
    // Paged: 4-byte cp.async copies of the page ids of `tile` (if tile < tile_end) into its ring
    // slot sPage[tile % STAGES]: one id per row j < n_keys, or one per tile when tile_pages;
    // kCopyPointers: one per page of the tile (entry r: the page holding key tile * BLOCK_N +
    // r * page_size, if below n_keys).
    auto fetch_page_ids = [&](int tile, int tile_end, int n_keys) {
        if constexpr (PAGED) {
            if (tile >= tile_end) return;
            int* dst = sPage + (tile % STAGES) * BLOCK_N;
            const int* row_ids = p.block_table + (int64_t)b * p.block_table_batch_stride;
            if constexpr (CP) {
                const int t0 = tile * BLOCK_N;
                static_assert(BLOCK_N <= Tr::kThreads, "one id per thread at most");
                const int n_ids = tile_pages ? 1 : BLOCK_N >> p.page_shift;
                if (tid < n_ids && t0 + (tid << p.page_shift) < n_keys)
                    cp_async_4(smem_u32addr(dst + tid), row_ids + (t0 >> p.page_shift) + tid);
            } else {
                for (int r = tid; r < (tile_pages ? 1 : BLOCK_N); r += Tr::kThreads) {
                    const int j = tile * BLOCK_N + r;
                    if (j < n_keys) cp_async_4(smem_u32addr(dst + r), row_ids + page_slot(p, j));
                }
            }
        }
    };
    int spec_begin = -1, spec_end = 0;  // kSpecPageIds, kSpecKV: the split at full capacity
    if constexpr (SPEC || SPECKV) {
        const int nt_g = (p.seqlen_cache + BLOCK_N - 1) / BLOCK_N;
        const int tps_g = p.split_tiles > 0 ? p.split_tiles : (nt_g + p.num_splits - 1) / p.num_splits;
        spec_begin = min(split * tps_g, nt_g);
        spec_end = min(spec_begin + tps_g, nt_g);
    }

    // ---- K/V tile copy: 16-byte cp.async, zero-fill past len / headdim / for bad page ids ----
    // This thread copies column chunk `col` of rows row0 + c * kRowsPerPass of every tile.
    const int row0 = WL ? warp * Tr::kKeysPerWarp + lane / Tr::kChunksPerRow : tid / Tr::kChunksPerRow;
    const int chunk = (WL ? lane : tid) % Tr::kChunksPerRow;
    const int col = chunk * Tr::kVec;
    const bool col_ok = col < p.headdim;
    const T* kbase = reinterpret_cast<const T*>(p.k);
    const T* vbase = reinterpret_cast<const T*>(p.v);
    // Contiguous: (b, 0, hk, col) of each cache; paged: (page 0, row 0, hk, col).
    const T* kcol = kbase + (PAGED ? 0 : (int64_t)b * p.k_batch_stride)
                    + (int64_t)hk * p.k_head_stride + col;
    const T* vcol = vbase + (PAGED ? 0 : (int64_t)b * p.v_batch_stride)
                    + (int64_t)hk * p.v_head_stride + col;
    // Paged copy pointers (copy_page_rows below): this thread's row offset inside a page.
    const int page_mask = PAGED ? p.page_size - 1 : 0;
    const T* kpage = col_ok ? kcol + (int64_t)(row0 & page_mask) * p.k_row_stride : kbase;
    const T* vpage = col_ok ? vcol + (int64_t)(row0 & page_mask) * p.v_row_stride : vbase;

    const uint64_t policy =
        (FLAGS & decode_flags::kEvictFirst) ? decode_detail::l2_evict_first_policy() : 0ull;
    constexpr int kCopies = WL ? Tr::kWarpCopies : Tr::kCopiesPerThread;
    constexpr int kPass = WL ? Tr::kWarpRowsPerPass : Tr::kRowsPerPass;
    // kCopyPointers: this thread's copies of `tile` into sK / sV (do_k, do_v: literal flags);
    // source row r0 + c * kPass of the split's cache, pointer advanced by one row step per copy.
    // Paged (page ids per page, see fetch_page_ids): pages of at least BLOCK_N keys take the same
    // pointer walk from the tile's first row in its page; smaller pages, copy_page_rows below.
    // Rows below n_keys are copied, the others zero-filled (n_keys: len, or the capacity for
    // kSpecKV's guessed tiles).
    auto copy_tile_pointers = [&](T* sK, T* sV, int tile, bool do_k, bool do_v, int n_keys) {
        const int r0 = tile * BLOCK_N + row0;
        const T* kp;
        const T* vp;
        bool rows_ok = col_ok;  // paged: and the tile's page id is inside the pool
        if constexpr (PAGED) {
            const int id = sPage[(tile % STAGES) * BLOCK_N];
            rows_ok = rows_ok && (unsigned)id < (unsigned)p.num_pages;
            const int64_t page = rows_ok ? id : 0;  // an unread but valid source address
            const int in_page = r0 & (p.page_size - 1);
            kp = kcol + page * p.k_batch_stride + (int64_t)in_page * p.k_row_stride;
            vp = vcol + page * p.v_batch_stride + (int64_t)in_page * p.v_row_stride;
        } else {
            kp = kcol + (int64_t)r0 * p.k_row_stride;
            vp = vcol + (int64_t)r0 * p.v_row_stride;
        }
        const int64_t kstep = (int64_t)kPass * p.k_row_stride;
        const int64_t vstep = (int64_t)kPass * p.v_row_stride;
        // Two loops on purpose: merged (valid = full || c * kPass < rem), nvcc keeps the
        // per-copy selects on full tiles too (one path instead of two in the SASS).
        if (rows_ok && tile * BLOCK_N + BLOCK_N <= n_keys) {  // every row of the tile is valid
#pragma unroll
            for (int c = 0; c < kCopies; ++c) {
                const int off = Tr::kv_offset(row0 + c * kPass, chunk);
                if (do_k) cp_async_kv<FLAGS>(smem_u32addr(sK + off), kp, true, policy);
                if (do_v) cp_async_kv<FLAGS>(smem_u32addr(sV + off), vp, true, policy);
                kp += kstep;
                vp += vstep;
            }
        } else {
            const int rem = rows_ok ? n_keys - r0 : 0;  // copies c with c * kPass < rem are valid
#pragma unroll
            for (int c = 0; c < kCopies; ++c) {
                const int off = Tr::kv_offset(row0 + c * kPass, chunk);
                const bool valid = c * kPass < rem;
                if (do_k)
                    cp_async_kv<FLAGS>(smem_u32addr(sK + off), valid ? kp : kbase, valid, policy);
                if (do_v)
                    cp_async_kv<FLAGS>(smem_u32addr(sV + off), valid ? vp : vbase, valid, policy);
                kp += kstep;
                vp += vstep;
            }
        }
    };
    // Programmatic dependent launch (common/pdl.cuh): no global load before this wait (the code
    // above is arithmetic on the block's indices and the parameters, and shared memory, so that
    // it overlaps the previous kernel's tail or the wait). The next kernel of the stream is let
    // be scheduled after the main loop (decode_flags: or here).
    pdl_wait();
    if constexpr (kEarlyTrigger) pdl_launch_dependents();
    // The length: a plain load, or (kSpecPageIds) a 4-byte cp.async by thread 0 into the padding
    // of the Q tile's row 0 (16 bytes that no Q store or ldmatrix touches), in the same group as
    // the guessed ids, so that one wait and one barrier land both. (Before, the length came by a
    // plain load whose first use ptxas scheduled ahead of the speculative id copies, so the
    // copies waited for the length: two dependent round trips instead of one; NOTES v34.)
    static_assert((Tr::kQStride - HEADDIM) * sizeof(T) >= sizeof(int),
                  "the length's slot lies in the Q tile's row padding");
    int* sLen = reinterpret_cast<int*>(sQ + HEADDIM);  // kSpecPageIds, kSpecKV
    auto copy_len = [&]() {
        if (tid == 0 && p.cache_seqlens != nullptr)
            cp_async_4(smem_u32addr(sLen), p.cache_seqlens + b);
    };
    // kQAsync: the Q tile by 16-byte cp.async, issued right after the length's load (with
    // kSpecPageIds: right after the length's and guessed ids' copies are committed) so that the
    // round trips overlap; Q needs neither the length nor the page ids. The copies join the
    // next commit group: the first tile's (issue_tile commits it, also when empty; the loop's
    // first wait lands it), or with kSpecPageIds and a missed guess the real ids' (waited for
    // in the prologue); with no tile, the epilogue's wait-all lands them before shared memory
    // is reused. The loop reads sQ only after its first wait and __syncthreads. Invalid rows and
    // columns are zero-filled (src-size 0, no byte read). Needs every Q chunk 16-byte aligned:
    // checked once (block-uniform) on the base and the strides of the dims that vary; else the
    // Q tile comes by the 2-byte loads after the prologue, as without the flag.
    const bool q_async = QASYNC && ((reinterpret_cast<unsigned long long>(p.q)
                                     | (unsigned long long)(p.batch > 1 ? p.q_batch_stride : 0)
                                         * sizeof(T)
                                     | (unsigned long long)(p.seqlen_q > 1 ? p.q_row_stride : 0)
                                         * sizeof(T)
                                     | (unsigned long long)(p.nheads > 1 ? p.q_head_stride : 0)
                                         * sizeof(T)) & 15ull) == 0;
    auto copy_q = [&]() {
        const uint16_t* q = reinterpret_cast<const uint16_t*>(p.q)
                            + b * p.q_batch_stride + hk * p.h_per_kv * p.q_head_stride;
        constexpr int kChunks = HEADDIM / 8;  // 16-byte chunks per row
        static_assert(GROUP * kChunks % Tr::kThreads == 0, "whole Q chunks per thread");
#pragma unroll
        for (int k = 0; k < GROUP * kChunks / Tr::kThreads; ++k) {
            const int e = tid + k * Tr::kThreads;
            const int r = e / kChunks, c = (e % kChunks) * 8, rg = row_base + r;
            const bool valid = rg < rows && c < p.headdim;
            const int qi = rg / p.h_per_kv, hh = rg - qi * p.h_per_kv;  // head hk * h_per_kv + hh
            const uint16_t* src = valid ? q + qi * p.q_row_stride + hh * p.q_head_stride + c
                                        : reinterpret_cast<const uint16_t*>(p.q);
            cp_async_16(smem_u32addr(sQ + r * Tr::kQStride + c), src, valid);
        }
    };
    int len_raw;
    if constexpr (SPEC) {
        copy_len();
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) fetch_page_ids(spec_begin + s, spec_end, p.seqlen_cache);
        cp_async_commit();
        // Q right behind the length and the ids, but outside their group: the wait below lands
        // only theirs (cp.async.wait_group counts committed groups), and Q joins the next group
        // committed (see copy_q; v46: inside the ids' group, its copies held the wait 0.5-0.8 us)
        if (q_async) copy_q();
        cp_async_wait<0>();
        __syncthreads();  // the length and the guessed ids are visible to every thread
        len_raw = p.cache_seqlens != nullptr ? *sLen : 0;
    } else if constexpr (SPECKV) {
        // the length in its own (oldest) group, then the guessed tiles, one group per stage as
        // the prologue below commits them; only the length's group is waited for here
        copy_len();
        cp_async_commit();
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (spec_begin + s < spec_end) {
                T* sK = sStages + s * Tr::kStageElems;
                copy_tile_pointers(sK, sK + Tr::kTileElems, spec_begin + s, true, true,
                                   p.seqlen_cache);
            }
            cp_async_commit();
        }
        cp_async_wait<STAGES - 1>();
        __syncthreads();  // the length is visible to every thread
        len_raw = p.cache_seqlens != nullptr ? *sLen : 0;
    } else {
        len_raw = p.cache_seqlens ? p.cache_seqlens[b] : 0;
        if (q_async) copy_q();  // after the length's load, in the first tile's group
    }
    const int len = sequence_length_from(p, len_raw);
    const int n_tiles = (len + BLOCK_N - 1) / BLOCK_N;
    // (one split: no division between the length and the first copy)
    const int tiles_per_split = p.split_tiles > 0 ? p.split_tiles
                                : p.num_splits == 1 ? n_tiles
                                                    : (n_tiles + p.num_splits - 1) / p.num_splits;
    const int tile_begin = min(split * tiles_per_split, n_tiles);
    const int tile_end = min(tile_begin + tiles_per_split, n_tiles);
    const int n_iter = tile_end - tile_begin;

    // Paged: the page ids of tile t live in the ring slot sPage[t % STAGES] (tile_pages: every
    // tile lies inside one page, page_size a multiple of BLOCK_N: one id per tile, slot[0];
    // otherwise one id per row). They are copied from block_table by 4-byte cp.async, STAGES - 1
    // tiles ahead of the tile's K/V copies and in the same commit group as the K/V copies issued
    // then, so the cp.async wait that precedes a tile's K/V issue has also landed its ids: no
    // block_table load ever stalls a thread in the loop (a synchronous load per tile cost 30%
    // at one block per SM, experiments/NOTES.md v5). The first STAGES - 1 tiles' ids are fetched
    // before the prologue. Slot (t + STAGES - 1) % STAGES is refilled after the __syncthreads
    // that ends every read of tile t - 1's ids (the same slot): the loop's, or in the prologue
    // one issued after tile t's own copies (for t = tile_begin the slot is the ring's free one:
    // no barrier). Rows past len, and tiles past the split, get no copy; load_tile reads a
    // row's slot only when j < len.
    auto fetch_pages = [&](int tile) { fetch_page_ids(tile, tile_end, len); };
    // kCopyPointers, pages of fewer than BLOCK_N keys (a power of two, so every tile starts a
    // page): copy c of this thread reads row r = row0 + c * kPass of the tile, entry
    // r >> page_shift of the tile's ids, row r & (page_size - 1) of that page. As row0 < kPass
    // and both are powers of two, that row is (row0 & mask) + (c * kPass & mask): the first term
    // is folded into this thread's source pointers once (kpage, vpage), the second is a constant
    // per copy and page size. The ids are read before the first copy is issued (the copies'
    // asm has a memory clobber, which would make the compiler read them again for V). Strides
    // fit in 32 bits (the launcher checks, the kernel traps otherwise). A tile wholly inside the
    // sequence tests only the ids. Invalid copies (src-size 0) still name an address inside page
    // 0: a thread whose column lies past headdim starts from the cache's base instead.
    auto copy_page_rows = [&](T* sK, T* sV, int tile, bool do_k, bool do_v) {
        const int* ids = sPage + (tile % STAGES) * BLOCK_N;
        const int n_rows = col_ok ? len - tile * BLOCK_N : 0;  // rows r < n_rows are valid
        int id[kCopies];
#pragma unroll
        for (int c = 0; c < kCopies; ++c) id[c] = ids[(row0 + c * kPass) >> p.page_shift];
        auto copy = [&](int c, bool row_valid) {
            const bool valid = row_valid && (unsigned)id[c] < (unsigned)p.num_pages;
            const unsigned page = valid ? id[c] : 0u;  // an unread but valid source address
            const unsigned in_page = (c * kPass) & page_mask;
            const int off = Tr::kv_offset(row0 + c * kPass, chunk);
            // unsigned 32 x 32 -> 64-bit products (one IMAD.WIDE.U32 each)
            if (do_k)
                cp_async_kv<FLAGS>(smem_u32addr(sK + off),
                                   kpage + ((uint64_t)page * (unsigned)p.k_batch_stride
                                            + in_page * (unsigned)p.k_row_stride), valid, policy);
            if (do_v)
                cp_async_kv<FLAGS>(smem_u32addr(sV + off),
                                   vpage + ((uint64_t)page * (unsigned)p.v_batch_stride
                                            + in_page * (unsigned)p.v_row_stride), valid, policy);
        };
        if (n_rows >= BLOCK_N) {
#pragma unroll
            for (int c = 0; c < kCopies; ++c) copy(c, true);
        } else {
#pragma unroll
            for (int c = 0; c < kCopies; ++c) copy(c, row0 + c * kPass < n_rows);
        }
    };
    // Issues the copies of `tile` into `stage` (its page ids must be in sPage[tile % STAGES],
    // visible to every thread), then the page-id copies of tile + STAGES - 1 (sync_ids: after a
    // __syncthreads, see the prologue); one address computation per copy (load_tile below uses
    // copy_tile_pointers instead with kCopyPointers).
    auto load_tile_rows = [&](int stage, int tile, bool sync_ids) {
        T* sK = sStages + stage * Tr::kStageElems;
        T* sV = sK + Tr::kTileElems;
        const int* ids = sPage + (tile % STAGES) * BLOCK_N;
#pragma unroll
        for (int c = 0; c < kCopies; ++c) {
            const int row = row0 + c * kPass;
            const int j = tile * BLOCK_N + row;
            bool valid = j < len && col_ok;
            int64_t koff = 0, voff = 0;
            if constexpr (PAGED) {
                const int page = j < len ? ids[tile_pages ? 0 : row] : -1;  // -1: no id
                valid = valid && page >= 0 && page < p.num_pages;
                const int in_page = j - page_slot(p, j) * p.page_size;
                koff = (int64_t)page * p.k_batch_stride + (int64_t)in_page * p.k_row_stride;
                voff = (int64_t)page * p.v_batch_stride + (int64_t)in_page * p.v_row_stride;
            } else {
                koff = (int64_t)j * p.k_row_stride;
                voff = (int64_t)j * p.v_row_stride;
            }
            cp_async_kv<FLAGS>(smem_u32addr(sK + Tr::kv_offset(row, chunk)),
                               valid ? kcol + koff : kbase, valid, policy);
            if constexpr (!KVG)
                cp_async_kv<FLAGS>(smem_u32addr(sV + Tr::kv_offset(row, chunk)),
                                   valid ? vcol + voff : vbase, valid, policy);
        }
        if (sync_ids) __syncthreads();
        fetch_pages(tile + STAGES - 1);  // kKVGroups: in the K group (see the loop's waits)
        if constexpr (KVG) {
            cp_async_commit();  // the K group; the caller's commit closes the V group
#pragma unroll
            for (int c = 0; c < kCopies; ++c) {
                const int row = row0 + c * kPass;
                const int j = tile * BLOCK_N + row;
                bool valid = j < len && col_ok;
                int64_t voff = 0;
                if constexpr (PAGED) {
                    const int page = j < len ? ids[tile_pages ? 0 : row] : -1;
                    valid = valid && page >= 0 && page < p.num_pages;
                    const int in_page = j - page_slot(p, j) * p.page_size;
                    voff = (int64_t)page * p.v_batch_stride + (int64_t)in_page * p.v_row_stride;
                } else {
                    voff = (int64_t)j * p.v_row_stride;
                }
                cp_async_kv<FLAGS>(smem_u32addr(sV + Tr::kv_offset(row, chunk)),
                                   valid ? vcol + voff : vbase, valid, policy);
            }
        }
    };
    auto load_tile = [&](int stage, int tile, bool sync_ids) {
        if constexpr (TMA) {
            // thread 0: after the __syncthreads that ends every read of this stage, arm its
            // mbarrier with the tile's bytes (boxes past the capacity count in full, zero-filled)
            // and issue the K and V boxes (dims: headdim, KV head, key, sequence)
            if (tid == 0) {
                T* sK = sStages + stage * Tr::kStageElems;
                T* sV = sK + Tr::kTileElems;
                const uint32_t bar = smem_u32addr(sBar + stage);
                fence_proxy_async();
                mbarrier_arrive_expect_tx(bar, 2u * Tr::kTileElems * (unsigned)sizeof(T));
#pragma unroll
                for (int h = 0; h < HEADDIM / 64; ++h) {
                    tma_load_4d(smem_u32addr(sK + h * BLOCK_N * 64), ex.tmap_k, h * 64, hk,
                                tile * BLOCK_N, b, bar);
                    tma_load_4d(smem_u32addr(sV + h * BLOCK_N * 64), ex.tmap_v, h * 64, hk,
                                tile * BLOCK_N, b, bar);
                }
            }
        } else if constexpr (CP) {
            T* sK = sStages + stage * Tr::kStageElems;
            T* sV = sK + Tr::kTileElems;
            auto copy = [&](bool do_k, bool do_v) {
                if (!PAGED || tile_pages) copy_tile_pointers(sK, sV, tile, do_k, do_v, len);
                else copy_page_rows(sK, sV, tile, do_k, do_v);
            };
            copy(true, !KVG);
            if constexpr (PAGED) {
                if (sync_ids) __syncthreads();
                fetch_pages(tile + STAGES - 1);  // kKVGroups: in the K group
            }
            if constexpr (KVG) {
                cp_async_commit();  // the K group; the caller's commit closes the V group
                copy(false, true);
            }
        } else {
            load_tile_rows(stage, tile, sync_ids);
        }
    };
    // Issues tile `tile` into `stage` if `issue` (block-uniform), and always kGroupsPerTile
    // commits, so that every thread's group count is the same whatever the split's length.
    auto issue_tile = [&](bool issue, int stage, int tile, bool sync_ids = false) {
        if (issue) load_tile(stage, tile, sync_ids);
        else if constexpr (KVG) cp_async_commit();
        cp_async_commit();
    };

    // ---- per-thread rows (g and g + 8) and their visible key ranges -------------------------
    KeyRange range[2];
#pragma unroll
    for (int rh = 0; rh < 2; ++rh)
        range[rh] = row_qi[rh] >= 0
                        ? visible_keys(row_qi[rh], p.seqlen_q, len, p.causal != 0, -1, -1)
                        : KeyRange{0, 0};  // padding row: sees nothing, never written

    // ---- online-softmax state of this warp (FA-2: unscaled acc, normalised at the end) -------
    float m_i[2] = {neg_inf<float>(), neg_inf<float>()};  // running max, log2 domain
    float l_i[2] = {0.f, 0.f};                            // this thread's part of the row sum
    float acc[HEADDIM / 8][4];
#pragma unroll
    for (int dt = 0; dt < HEADDIM / 8; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[dt][e] = 0.f;

    const uint32_t sQ_addr = smem_u32addr(sQ + (lane & 15) * Tr::kQStride + (lane >> 4) * 8);
    const int warp_key0 = warp * Tr::kKeysPerWarp;

    // ---- pipeline prologue: STAGES - 1 tiles in flight ----------------------------------------
    if constexpr (PAGED) {  // the ids of the prologue's tiles, waited for once
        // kSpecPageIds with the right guess: the speculative fetch, landed and visible, covers
        // tiles tile_begin ... (tile_end <= the guess's end, rows j < len <= capacity). Otherwise
        // fetch them now (the speculative copies have landed: the two may write the same slots).
        if (tile_begin != spec_begin) {  // block-uniform
#pragma unroll
            for (int s = 0; s < STAGES - 1; ++s) fetch_pages(tile_begin + s);
            cp_async_commit();
            cp_async_wait<0>();
            __syncthreads();  // the prologue's ids are visible
        }
    }
    // kSpecKV with the right guess: the guessed copies are this split's prologue (tile_end <=
    // the guess's end; rows below len <= capacity hold the same data). Otherwise this thread's
    // guessed copies are let land (the real ones write the same shared memory: each thread
    // copies the same rows and column of every tile) and the prologue is issued as without it.
    const bool spec_kv_hit = SPECKV && tile_begin == spec_begin;  // block-uniform
    if constexpr (SPECKV)
        if (!spec_kv_hit) cp_async_wait<0>();
    if (!spec_kv_hit) {
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            // Paged: tile tile_begin + s's K/V copies are issued first; its load_tile then
            // refills the slot of tile tile_begin + s - 1 with the ids of tile_begin + s +
            // STAGES - 1, after a __syncthreads that ends every thread's reads of that slot
            // (s >= 1; at s = 0 the slot is the ring's free one). One barrier per prologue tile
            // as before, but after its copies are issued instead of before.
            issue_tile(s < n_iter, s, tile_begin + s, PAGED && s >= 1);
        }
    }

    // ---- Q tile (16 rows, zero-padded rows and columns) into shared memory, raw 16-bit copy ----
    // After the prologue's K/V copies are issued, so that its load latency overlaps theirs
    // rather than delaying the first K/V request (small problems: ~1 us of a 15-20 us call).
    // (kQAsync: copied by cp.async beside the length instead, see copy_q, unless misaligned.)
    if (!q_async) {
        const uint16_t* q = reinterpret_cast<const uint16_t*>(p.q);
        uint16_t* s = reinterpret_cast<uint16_t*>(sQ);
#pragma unroll 8
        for (int e = tid; e < GROUP * HEADDIM; e += Tr::kThreads) {
            const int r = e / HEADDIM, c = e % HEADDIM, rg = row_base + r;
            uint16_t val = 0;  // +0.0 in fp16 and bf16
            if (rg < rows && c < p.headdim) {
                const int qi = rg / p.h_per_kv, h = hk * p.h_per_kv + rg % p.h_per_kv;
                val = q[b * p.q_batch_stride + qi * p.q_row_stride + h * p.q_head_stride + c];
            }
            s[r * Tr::kQStride + c] = val;
        }
    }

    // The Q tile is read after the loop's first __syncthreads (and, warp-local or kQRegs, after
    // this one).
    if constexpr (WL || QREGS) __syncthreads();
    uint32_t qfrag[QREGS ? HEADDIM / 16 : 1][4];  // kQRegs: Q's A fragments, 16 dims each
    if constexpr (QREGS) {
#pragma unroll
        for (int ks = 0; ks < HEADDIM / 16; ++ks)
            ldmatrix_x4(qfrag[ks], sQ_addr + ks * 16 * (int)sizeof(T));
    }
    // kMaskFast: a tile [n0, n0 + BLOCK_N) needs no mask iff n0 >= lo of the block's last valid
    // row and n0 + BLOCK_N <= hi of its first (visible_keys' bounds are non-decreasing in the row).
    int unmasked_lo = 0, unmasked_hi = 0;
    if constexpr (MASKFAST) {
        const int nrows_valid = min(GROUP, rows - row_base);
        if (nrows_valid > 0) {
            const KeyRange first = visible_keys(row_base / p.h_per_kv, p.seqlen_q, len,
                                                p.causal != 0, -1, -1);
            const KeyRange last = visible_keys((row_base + nrows_valid - 1) / p.h_per_kv,
                                               p.seqlen_q, len, p.causal != 0, -1, -1);
            unmasked_lo = last.lo;
            unmasked_hi = first.hi;
        }
    }

    for (int it = 0; it < n_iter; ++it) {
        // this thread's copies of tile `it` (kKVGroups: of its K) have landed (kTma: all of them,
        // the stage's mbarrier completing its (it / STAGES)-th phase)
        if constexpr (TMA)
            mbarrier_wait(smem_u32addr(sBar + it % STAGES), (unsigned)(it / STAGES) & 1u);
        else
            cp_async_wait<kGroupsPerTile * (STAGES - 1) - 1>();
        if constexpr (WL)
            __syncwarp();             // the warp's have (its rows only); it is done with it - 1
        else
            __syncthreads();          // everyone's have; everyone is done with stage it - 1
        // (possibly empty) groups keep the wait count uniform
        issue_tile(it + STAGES - 1 < n_iter, (it + STAGES - 1) % STAGES,
                   tile_begin + it + STAGES - 1);

        const T* sK = sStages + (it % STAGES) * Tr::kStageElems;
        const T* sV = sK + Tr::kTileElems;
        const int key0 = (tile_begin + it) * BLOCK_N + warp_key0;  // first key of this warp
        auto kvo = [](int row, int chunk) {
            return TMA ? Tr::kv_offset_tma(row, chunk) : Tr::kv_offset(row, chunk);
        };
        if constexpr (TMA || SPECKV) {
            // the sequence's last tile: this warp zeroes its V rows at or past len (the TMA or
            // the guessed copies (kSpecKV, the prologue's tiles) copied them from the cache's
            // tail, which may hold anything; P is 0 there)
            const int n_valid = len - (tile_begin + it) * BLOCK_N;
            if (n_valid < BLOCK_N && (TMA || (spec_kv_hit && it < STAGES - 1))) {  // block-uniform
                T* sVw = sStages + (it % STAGES) * Tr::kStageElems + Tr::kTileElems;
                for (int e = lane; e < Tr::kKeysPerWarp * Tr::kChunksPerRow; e += 32) {
                    const int r = warp_key0 + e / Tr::kChunksPerRow;
                    if (r >= n_valid)
                        *reinterpret_cast<uint4*>(sVw + kvo(r, e % Tr::kChunksPerRow)) =
                            make_uint4(0u, 0u, 0u, 0u);
                }
                __syncwarp();
            }
        }

        // S = Q K^T for this warp's keys (16 rows x kKeysPerWarp keys), fp32
        float s[Tr::kKSteps][2][4];
#pragma unroll
        for (int kw = 0; kw < Tr::kKSteps; ++kw)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[kw][nt][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < HEADDIM / 16; ++ks) {
            uint32_t a[4];
            if constexpr (QREGS) {
#pragma unroll
                for (int x = 0; x < 4; ++x) a[x] = qfrag[ks][x];
            } else {
                ldmatrix_x4(a, sQ_addr + ks * 16 * (int)sizeof(T));
            }
#pragma unroll
            for (int kw = 0; kw < Tr::kKSteps; ++kw) {
                // matrices: (keys 0-7, dims lo), (keys 0-7, dims hi), (keys 8-15, lo), (8-15, hi)
                const int krow = warp_key0 + kw * 16 + (lane >> 4) * 8 + (lane & 7);
                const int kchunk = ks * 2 + ((lane >> 3) & 1);
                uint32_t bk[4];
                ldmatrix_x4(bk, smem_u32addr(sK + kvo(krow, kchunk)));
                mma_m16n8k16<T>(s[kw][0], a, bk[0], bk[1]);
                mma_m16n8k16<T>(s[kw][1], a, bk[2], bk[3]);
            }
        }

        // scale to the log2 domain and mask: -inf outside the row's visible range (incl. j >= len)
        float mx[2] = {neg_inf<float>(), neg_inf<float>()};
        const int n0 = (tile_begin + it) * BLOCK_N;
        const bool masked = !(MASKFAST && n0 >= unmasked_lo && n0 + BLOCK_N <= unmasked_hi);
#pragma unroll
        for (int kw = 0; kw < Tr::kKSteps; ++kw)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int rh = e >> 1;
                    const int j = key0 + kw * 16 + nt * 8 + 2 * t + (e & 1);
                    float x = __fmul_rn(s[kw][nt][e], p.scale_log2);
                    if (masked && !key_visible(range[rh], j)) x = neg_inf<float>();
                    s[kw][nt][e] = x;
                    mx[rh] = fmaxf(mx[rh], x);
                }
        // row max over the quad (the 4 threads holding one row), then rescale the old state
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
            mx[rh] = fmaxf(mx[rh], __shfl_xor_sync(0xffffffffu, mx[rh], 1));
            mx[rh] = fmaxf(mx[rh], __shfl_xor_sync(0xffffffffu, mx[rh], 2));
        }
        // kSkipRescale / kLazyRescale: the warp moves its rows' reference points only when some
        // row gains (more than kLazyThreshold); m = -inf gains from any finite max. The scaled
        // scores and the rescaled l are rounded products (__fmul_rn), so that the compiler cannot
        // fuse them into a later add on one path and not on another: skipping a factor of exactly
        // 1, or skipping the mask, then changes no bit.
        bool move = true;
        if constexpr (SKIP) {
            constexpr float th = LAZY ? kLazyThreshold : 0.f;
            move = __any_sync(0xffffffffu, mx[0] > m_i[0] + th || mx[1] > m_i[1] + th);
        }
        if (move) {
            float corr[2];
#pragma unroll
            for (int rh = 0; rh < 2; ++rh) {
                const float m_new = fmaxf(m_i[rh], mx[rh]);
                corr[rh] = rescale_factor(m_i[rh], m_new);
                m_i[rh] = m_new;
                l_i[rh] = __fmul_rn(l_i[rh], corr[rh]);
            }
#pragma unroll
            for (int dt = 0; dt < HEADDIM / 8; ++dt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[dt][e] *= corr[e >> 1];
        }

        // P = exp2(S - m), row sums, and O += P V (P stays in registers as the A fragment)
        auto probs = [&](int kw) {
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float pr = prob(s[kw][nt][e], m_i[e >> 1]);
                    s[kw][nt][e] = pr;
                    l_i[e >> 1] += pr;
                }
        };
        if constexpr (KVG) {
            // every probability before the wait for V; then V of tile `it` has landed (the
            // 2 (STAGES - 1) groups of tiles it + 1 ... it + STAGES - 1 may still be pending)
#pragma unroll
            for (int kw = 0; kw < Tr::kKSteps; ++kw) probs(kw);
            cp_async_wait<kGroupsPerTile * (STAGES - 1)>();
            if constexpr (WL) __syncwarp();
            else __syncthreads();
        }
#pragma unroll
        for (int kw = 0; kw < Tr::kKSteps; ++kw) {
            if constexpr (!KVG) probs(kw);
            uint32_t pa[4];
            pa[0] = pack2<T>(s[kw][0][0], s[kw][0][1]);
            pa[1] = pack2<T>(s[kw][0][2], s[kw][0][3]);
            pa[2] = pack2<T>(s[kw][1][0], s[kw][1][1]);
            pa[3] = pack2<T>(s[kw][1][2], s[kw][1][3]);
            // matrices (transposed): (keys 0-7, dims lo), (keys 8-15, lo), (0-7, hi), (8-15, hi)
            const int vrow = warp_key0 + kw * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
            for (int dn = 0; dn < HEADDIM / 16; ++dn) {
                const int vchunk = dn * 2 + (lane >> 4);
                uint32_t bv[4];
                ldmatrix_x4_trans(bv, smem_u32addr(sV + kvo(vrow, vchunk)));
                mma_m16n8k16<T>(acc[2 * dn], pa, bv[0], bv[1]);
                mma_m16n8k16<T>(acc[2 * dn + 1], pa, bv[2], bv[3]);
            }
        }
    }

    // ---- epilogue: merge the NWARPS warp states, normalise, write --------------------------
    if constexpr (kLateTrigger) pdl_launch_dependents();
    cp_async_wait<0>();
    __syncthreads();  // stage buffers are free: reuse them as fp32 scratch
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
        l_i[rh] += __shfl_xor_sync(0xffffffffu, l_i[rh], 1);
        l_i[rh] += __shfl_xor_sync(0xffffffffu, l_i[rh], 2);
    }
    // Only the CTA's valid rows are merged and written (b1 with GQA 4 and one token: 4 of 16).
    const int nrows = min(GROUP, rows - row_base);
    float* sO = reinterpret_cast<float*>(sStages);               // [NWARPS][GROUP][kOStride]
    float* sM = sO + NWARPS * GROUP * Tr::kOStride;              // [NWARPS][GROUP]
    float* sL = sM + NWARPS * GROUP;                             // [NWARPS][GROUP]
    float* sF = sL + NWARPS * GROUP;                             // [NWARPS][GROUP] warp factors
    float* sRow = sF + NWARPS * GROUP;                           // [2][GROUP]: 1 / l, LSE
#pragma unroll
    for (int dt = 0; dt < HEADDIM / 8; ++dt)
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
            if (g + 8 * rh >= nrows) continue;
            float* dst = sO + (warp * GROUP + g + 8 * rh) * Tr::kOStride + dt * 8 + 2 * t;
            dst[0] = acc[dt][2 * rh];
            dst[1] = acc[dt][2 * rh + 1];
        }
    if (t == 0) {
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
            sM[warp * GROUP + g + 8 * rh] = m_i[rh];
            sL[warp * GROUP + g + 8 * rh] = l_i[rh];
        }
    }
    __syncthreads();
    // One thread per row: the row's max over the warps, each warp's rescale factor, 1 / l, LSE
    // (computed once per row rather than once per output element).
    if (tid < nrows) {
        float m_tot = neg_inf<float>();
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) m_tot = fmaxf(m_tot, sM[w * GROUP + tid]);
        float l_tot = 0.f;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            const float f = rescale_factor(sM[w * GROUP + tid], m_tot);
            sF[w * GROUP + tid] = f;
            l_tot += sL[w * GROUP + tid] * f;
        }
        sRow[tid] = inv_normaliser(l_tot);
        sRow[GROUP + tid] = lse_from(m_tot, l_tot);
    }
    __syncthreads();

    const bool direct = p.num_splits == 1;  // single split: write the final output in T
    bool in_cluster = false;                // cluster combine (decode_flags::kClusterCombine)
    if constexpr ((FLAGS & decode_flags::kClusterCombine) != 0) {
        const unsigned nc = cluster_nctarank();
        in_cluster = nc > 1;
        if (in_cluster && (nc != (unsigned)p.num_splits || nc > Tr::kMaxCluster ||
                           ex.grid_order != 0))
            __trap();  // launch bug (decode.py launches one cluster per group), never silent
    }
    float* sPart = sRow + 2 * GROUP;        // [GROUP][HEADDIM], cluster combine only
    float* sPartL = sPart + GROUP * HEADDIM;  // [GROUP]
    // (row, 4 columns) items of the valid rows; padding columns (c >= p.headdim, a multiple of
    // 8) are skipped. Partials leave as 16-byte stores (the workspace is 16-byte aligned).
    constexpr int kHd4 = HEADDIM / 4;
    for (int e = tid; e < nrows * kHd4; e += Tr::kThreads) {
        const int r = e / kHd4, c = (e % kHd4) * 4, rg = row_base + r;
        if (c >= p.headdim) continue;
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            const float4 x = *reinterpret_cast<const float4*>(sO + (w * GROUP + r) * Tr::kOStride + c);
            const float f = sF[w * GROUP + r];
            o.x += x.x * f;
            o.y += x.y * f;
            o.z += x.z * f;
            o.w += x.w * f;
        }
        const float inv = sRow[r], lse = sRow[GROUP + r];
        o.x *= inv;
        o.y *= inv;
        o.z *= inv;
        o.w *= inv;
        const int qi = rg / p.h_per_kv, h = hk * p.h_per_kv + rg % p.h_per_kv;
        if (direct) {
            T* out = reinterpret_cast<T*>(p.o) + b * p.o_batch_stride + qi * p.o_row_stride
                     + h * p.o_head_stride + c;
            out[0] = decode_detail::from_float<T>(o.x);
            out[1] = decode_detail::from_float<T>(o.y);
            out[2] = decode_detail::from_float<T>(o.z);
            out[3] = decode_detail::from_float<T>(o.w);
            if (c == 0 && p.lse != nullptr)
                p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + qi] = lse;
        } else if (in_cluster) {
            *reinterpret_cast<float4*>(sPart + r * HEADDIM + c) = o;
            if (c == 0) sPartL[r] = lse;
        } else {
            const int64_t prow = ((int64_t)split * p.batch + b) * p.seqlen_q + qi;
            *reinterpret_cast<float4*>(p.o_part + (prow * p.nheads + h) * p.headdim + c) = o;
            if (c == 0)
                p.lse_part[(((int64_t)split * p.batch + b) * p.nheads + h) * p.seqlen_q + qi] = lse;
        }
    }

    // ---- cluster combine: the blocks of the cluster (the splits of (b, hz)) merge slices ----
    if constexpr ((FLAGS & decode_flags::kClusterCombine) != 0) {
        if (in_cluster) {
            cluster_sync();  // every split's partial is in its block's shared memory
            const int ns = p.num_splits, rank = (int)cluster_ctarank();  // rank == split
            const int hd4 = p.headdim / 4;
            // (row, 4 columns) items, interleaved over the cluster's blocks; each reads the ns
            // partials in the fused path's batches and merges them as it does.
            for (int e = tid * ns + rank; e < nrows * hd4; e += Tr::kThreads * ns) {
                const int r = e / hd4, c = (e % hd4) * 4, rg = row_base + r;
                const int qi = rg / p.h_per_kv, h = hk * p.h_per_kv + rg % p.h_per_kv;
                const uint32_t l_addr = smem_u32addr(sPartL + r);
                const uint32_t o_addr = smem_u32addr(sPart + r * HEADDIM + c);
                MergeState4 st;
                st.init();
                auto merge = [&](auto batch) {
                    constexpr int NB = decltype(batch)::kN;
                    for (int sp0 = 0; sp0 < ns; sp0 += NB) {
                        float lv[NB];
                        float4 ov[NB];
#pragma unroll
                        for (int u = 0; u < NB; ++u)
                            if (sp0 + u < ns) {
                                lv[u] = ld_shared_cluster_f32(map_shared_rank(l_addr, sp0 + u));
                                ov[u] = ld_shared_cluster_v4f32(map_shared_rank(o_addr, sp0 + u));
                            }
                        st.add_batch(lv, ov, ns - sp0);
                    }
                };
                if (ns <= Tr::kMergeHalf) merge(MergeBatch<Tr::kMergeHalf>{});
                else merge(MergeBatch<Tr::kMergeBatch>{});
                store_merged<T>(p, st, b, qi, h, c);
            }
            cluster_sync();  // no block exits while another still reads its shared memory
            return;
        }
    }

    // ---- fused combine: the last split block of (b, hz) to arrive merges all splits --------
    if constexpr ((FLAGS & decode_flags::kFusedCombine) != 0) {
        if (direct) return;
        constexpr bool kRel = (FLAGS & decode_flags::kReleaseArrive) != 0;
        if constexpr (!kRel)
            __threadfence();  // this thread's partials are visible device-wide before the arrival
        __syncthreads();  // every thread's are (kRel: ordered before thread 0's release)
        int* flag = reinterpret_cast<int*>(smem_raw);  // the Q tile is dead
        if (tid == 0) {
            int* counter = ex.counters + ((int64_t)b * p.nheads_k * p.num_row_chunks + hz);
            const int old = kRel ? atomic_add_acq_rel_gpu(counter, 1) : atomicAdd(counter, 1);
            const int last = old == p.num_splits - 1;
            if (last) atomicExch(counter, 0);  // all splits arrived: ready for the next launch
            *flag = last;
        }
        __syncthreads();  // kRel: the acquire of thread 0 is ordered before every thread's reads
        if (*flag == 0) return;
        if constexpr (!kRel)
            __threadfence();  // acquire: the other blocks' partials are read after their arrival
        // One (row, 4 columns) item per thread and pass; the parts are read through L2 (ld.cg).
        const int hd4 = p.headdim / 4;
        const int64_t o_split4 = (int64_t)p.batch * p.seqlen_q * p.nheads * p.headdim / 4;
        const int64_t l_split = (int64_t)p.batch * p.nheads * p.seqlen_q;
        for (int e = tid; e < nrows * hd4; e += Tr::kThreads) {
            const int r = e / hd4, c = (e % hd4) * 4, rg = row_base + r;
            const int qi = rg / p.h_per_kv, h = hk * p.h_per_kv + rg % p.h_per_kv;
            const float* lp = p.lse_part + ((int64_t)b * p.nheads + h) * p.seqlen_q + qi;
            const float4* op = reinterpret_cast<const float4*>(
                p.o_part + (((int64_t)b * p.seqlen_q + qi) * p.nheads + h) * p.headdim + c);
            MergeState4 st;
            st.init();
            // kMergeBatch parts' loads are issued before any of them is merged (one L2 round
            // trip per batch; per part before v10: 4.2 us at 16 splits), with pointers advanced
            // by a stride rather than recomputed per part.
            auto merge = [&](auto batch) {
                constexpr int NB = decltype(batch)::kN;
                for (int sp0 = 0; sp0 < p.num_splits; sp0 += NB) {
                    float lv[NB];
                    float4 ov[NB];
#pragma unroll
                    for (int u = 0; u < NB; ++u) {
                        if (sp0 + u < p.num_splits) {
                            lv[u] = __ldcg(lp);
                            ov[u] = __ldcg(op);
                        }
                        lp += l_split;
                        op += o_split4;
                    }
                    st.add_batch(lv, ov, p.num_splits - sp0);
                }
            };
            if (p.num_splits <= Tr::kMergeHalf) merge(MergeBatch<Tr::kMergeHalf>{});
            else merge(MergeBatch<Tr::kMergeBatch>{});
            store_merged<T>(p, st, b, qi, h, c);
        }
    }
}

// Entry points: plain arguments (CuPy passes pointers and NumPy scalars) in the order decode.py
// builds them (the TMA entry adds its two tensor maps after them), packed into DecodeParams.
// `counters` and `grid_order`: see DecodeSplitExtra; with FLAGS & kFusedCombine, `o` and `lse`
// are the final outputs for any number of splits.
#define CF_DECODE_SPLIT_PARAMS                                                                  \
    const void *q, const void *k, const void *v, const int *cache_seqlens,                      \
    const int *block_table, void *o, float *lse, float *o_part, float *lse_part,                \
    long long q_bs, long long q_rs, long long q_hs, long long k_bs, long long k_rs,             \
    long long k_hs, long long v_bs, long long v_rs, long long v_hs, long long o_bs,             \
    long long o_rs, long long o_hs, long long lse_bs, long long lse_hs, long long bt_bs,        \
    int batch, int nheads, int nheads_k, int seqlen_q, int headdim, int seqlen_cache,           \
    int seqlen_new, int page_size, int page_shift, int num_pages, int num_splits,               \
    int split_tiles, int num_row_chunks, int causal, float scale_log2, int *counters,           \
    int grid_order
#define CF_DECODE_SPLIT_ARGS                                                                    \
    q, k, v, cache_seqlens, block_table, o, lse, o_part, lse_part, q_bs, q_rs, q_hs, k_bs,      \
    k_rs, k_hs, v_bs, v_rs, v_hs, o_bs, o_rs, o_hs, lse_bs, lse_hs, bt_bs, batch, nheads,        \
    nheads_k, seqlen_q, headdim, seqlen_cache, seqlen_new, page_size, page_shift, num_pages,    \
    num_splits, split_tiles, num_row_chunks, causal, scale_log2, counters, grid_order

__device__ __forceinline__ void decode_split_params(DecodeParams& p, DecodeSplitExtra& ex,
                                                    CF_DECODE_SPLIT_PARAMS) {
    p.q = q; p.k = k; p.v = v; p.cache_seqlens = cache_seqlens; p.block_table = block_table;
    p.o = o; p.lse = lse; p.o_part = o_part; p.lse_part = lse_part;
    p.q_batch_stride = q_bs; p.q_row_stride = q_rs; p.q_head_stride = q_hs;
    p.k_batch_stride = k_bs; p.k_row_stride = k_rs; p.k_head_stride = k_hs;
    p.v_batch_stride = v_bs; p.v_row_stride = v_rs; p.v_head_stride = v_hs;
    p.o_batch_stride = o_bs; p.o_row_stride = o_rs; p.o_head_stride = o_hs;
    p.lse_batch_stride = lse_bs; p.lse_head_stride = lse_hs; p.block_table_batch_stride = bt_bs;
    p.batch = batch; p.nheads = nheads; p.nheads_k = nheads_k; p.h_per_kv = nheads / nheads_k;
    p.seqlen_q = seqlen_q; p.headdim = headdim; p.seqlen_cache = seqlen_cache;
    p.seqlen_new = seqlen_new; p.page_size = page_size; p.page_shift = page_shift;
    p.num_pages = num_pages; p.num_splits = num_splits; p.split_tiles = split_tiles;
    p.num_row_chunks = num_row_chunks; p.causal = causal; p.scale_log2 = scale_log2;
    ex.counters = counters;
    ex.grid_order = grid_order;
}

template <typename T, int HEADDIM, int BLOCK_N, int NWARPS, int GROUP, int STAGES, bool PAGED,
          int FLAGS>
__global__ void __launch_bounds__(NWARPS * 32, 1)
decode_split_kernel(CF_DECODE_SPLIT_PARAMS) {
    static_assert((FLAGS & decode_flags::kTma) == 0, "kTma kernels: decode_split_tma_kernel");
    DecodeParams p;
    DecodeSplitExtra ex;
    decode_split_params(p, ex, CF_DECODE_SPLIT_ARGS);
    decode_split<T, HEADDIM, BLOCK_N, NWARPS, GROUP, STAGES, PAGED, FLAGS>(p, ex);
}

// decode_flags::kTma: the same kernel with the tensor maps of the K and V caches (4-D: headdim,
// KV head, key, sequence; box 64 x 1 x BLOCK_N x 1, 128-byte swizzle, zero fill; built by
// launch.encode_tensor_map from decode.kv_tensor_map_geometry) as __grid_constant__
// parameters after the others.
template <typename T, int HEADDIM, int BLOCK_N, int NWARPS, int GROUP, int STAGES, bool PAGED,
          int FLAGS>
__global__ void __launch_bounds__(NWARPS * 32, 1)
decode_split_tma_kernel(CF_DECODE_SPLIT_PARAMS, const __grid_constant__ TmaDesc tmap_k,
                        const __grid_constant__ TmaDesc tmap_v) {
    static_assert((FLAGS & decode_flags::kTma) != 0, "the TMA entry runs kTma kernels");
    DecodeParams p;
    DecodeSplitExtra ex;
    decode_split_params(p, ex, CF_DECODE_SPLIT_ARGS);
    ex.tmap_k = &tmap_k;
    ex.tmap_v = &tmap_v;
    decode_split<T, HEADDIM, BLOCK_N, NWARPS, GROUP, STAGES, PAGED, FLAGS>(p, ex);
}
#undef CF_DECODE_SPLIT_PARAMS
#undef CF_DECODE_SPLIT_ARGS

// ------------------------------------------------------------------------------------------------
// Combine: out = sum_s w_s o_s / sum_s w_s, w_s = exp(lse_s - max_s lse_s), LSE = max + log(sum w)
// (natural log; merge(x, (0, -inf)) = x: empty parts get weight 0 and their o, which may hold
// NaN, never reaches the result). One warp per output row (b, i, h). The max and the sum run with
// the lanes over the parts (one load each per 32 parts, shuffle reductions); then every lane
// accumulates up to kMaxCols columns (c = lane + 32 k) over the parts, 8 parts per unrolled step,
// so about 2 + parts / 8 dependent L2 round trips per row instead of ~3 per part.
// Strides in elements: o_part (part, batch, row, head) with the head dim contiguous, lse_part
// (part, batch, head, row).
// ------------------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(128)
decode_combine_kernel(const float* o_part, const float* lse_part, T* out, float* lse_out,
                      long long op_ps, long long op_bs, long long op_rs, long long op_hs,
                      long long lp_ps, long long lp_bs, long long lp_hs, long long lp_rs,
                      long long o_bs, long long o_rs, long long o_hs,
                      long long lse_bs, long long lse_hs,
                      int num_parts, int batch, int seqlen, int nheads, int headdim) {
    constexpr int kMaxCols = 8;  // headdim <= 256
    pdl_wait();  // common/pdl.cuh
    pdl_launch_dependents();
    const int lane = threadIdx.x % 32;
    const long long rid = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (rid >= (long long)batch * seqlen * nheads) return;  // whole warps
    const int h = (int)(rid % nheads);
    const int i = (int)((rid / nheads) % seqlen);
    const int b = (int)(rid / ((long long)nheads * seqlen));
    const float* lp = lse_part + b * lp_bs + h * lp_hs + i * lp_rs;
    const float* op = o_part + b * op_bs + i * op_rs + h * op_hs;

    float lse_max = neg_inf<float>();
    for (int s = lane; s < num_parts; s += 32) lse_max = fmaxf(lse_max, lp[s * lp_ps]);
#pragma unroll
    for (int x = 16; x >= 1; x >>= 1) lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffffu, lse_max, x));
    float wsum = 0.f;
    for (int s = lane; s < num_parts; s += 32) wsum += merge_weight(lp[s * lp_ps], lse_max);
#pragma unroll
    for (int x = 16; x >= 1; x >>= 1) wsum += __shfl_xor_sync(0xffffffffu, wsum, x);
    const float inv = inv_normaliser(wsum);  // all parts empty: output 0

    float acc[kMaxCols];
#pragma unroll
    for (int k = 0; k < kMaxCols; ++k) acc[k] = 0.f;
#pragma unroll 8
    for (int s = 0; s < num_parts; ++s) {
        const float ls = lp[s * lp_ps];
        const float w = merge_weight(ls, lse_max);
        const bool empty = ls == neg_inf<float>();
#pragma unroll
        for (int k = 0; k < kMaxCols; ++k) {
            const int c = lane + 32 * k;
            if (c < headdim) {
                const float o = op[s * op_ps + c];
                acc[k] += empty ? 0.f : w * o;
            }
        }
    }
    T* orow = out + b * o_bs + i * o_rs + h * o_hs;
#pragma unroll
    for (int k = 0; k < kMaxCols; ++k) {
        const int c = lane + 32 * k;
        if (c < headdim) orow[c] = decode_detail::from_float<T>(acc[k] * inv);
    }
    if (lane == 0 && lse_out != nullptr)
        lse_out[b * lse_bs + h * lse_hs + i] =
            wsum == 0.f ? neg_inf<float>() : lse_max + logf(wsum);
}

// ------------------------------------------------------------------------------------------------
// Append: cache[b, cache_seqlens[b] + i, h, :] = new[b, i, h, :] (paged: through block_table).
// Raw element copy (E = uint16_t for fp16/bf16). Positions past the capacity and page ids
// outside the pool are skipped (checks.check_kvcache rejects them when validate=True).
// grid (ceil(seqlen_new * nheads_k * headdim / 256), batch), block 256.
// ------------------------------------------------------------------------------------------------
template <typename E, bool PAGED>
__global__ void __launch_bounds__(256)
decode_append_kernel(const E* k_new, const E* v_new, E* k_cache, E* v_cache,
                     const int* cache_seqlens, const int* block_table,
                     long long kn_bs, long long kn_rs, long long kn_hs,
                     long long vn_bs, long long vn_rs, long long vn_hs,
                     long long k_bs, long long k_rs, long long k_hs,
                     long long v_bs, long long v_rs, long long v_hs, long long bt_bs,
                     int seqlen_new, int nheads_k, int headdim, int seqlen_cache,
                     int page_size, int num_pages) {
    pdl_wait();  // common/pdl.cuh
    pdl_launch_dependents();
    const int b = blockIdx.y;
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (long long)seqlen_new * nheads_k * headdim) return;
    const int c = (int)(e % headdim);
    const int h = (int)((e / headdim) % nheads_k);
    const int i = (int)(e / ((long long)headdim * nheads_k));
    const int pos = cache_seqlens[b] + i;
    if (pos < 0 || pos >= seqlen_cache) return;
    long long kdst, vdst;
    if constexpr (PAGED) {
        const int page = block_table[b * bt_bs + pos / page_size];
        if (page < 0 || page >= num_pages) return;
        const int in_page = pos % page_size;
        kdst = page * k_bs + in_page * k_rs + h * k_hs + c;
        vdst = page * v_bs + in_page * v_rs + h * v_hs + c;
    } else {
        kdst = b * k_bs + (long long)pos * k_rs + h * k_hs + c;
        vdst = b * v_bs + (long long)pos * v_rs + h * v_hs + c;
    }
    k_cache[kdst] = k_new[b * kn_bs + i * kn_rs + h * kn_hs + c];
    v_cache[vdst] = v_new[b * vn_bs + i * vn_rs + h * vn_hs + c];
}

}  // namespace cf
