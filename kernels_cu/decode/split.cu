// The split kernel of split-KV decoding against a contiguous or paged KV cache (Flash-Decoding:
// Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference", 2023; each split is the
// FlashAttention-2 forward pass of arXiv 2307.08691, Algorithm 1, over a range of keys); beside
// it decode/append.cu (new k/v tokens into the cache) and decode/combine.cu (merge_states).
//
// One CTA streams the K/V tiles of one split of one sequence and one KV head through a cp.async
// ring of STAGES shared-memory buffers and computes every query row that reads that KV head (GQA
// group x seqlen_q rows, up to GROUP = 16) against each tile with tensor cores (mma.m16n8k16,
// fp32 accumulate). Warp w owns keys [w, w + 1) * BLOCK_N / NWARPS of every tile with its own
// online-softmax state (m, l, acc), merged with the other warps' at the end. One split writes
// the final output; several write normalised fp32 partials and LSEs to the workspace, and the
// last block of a head to finish merges them (fused combine). The kernel waits (common/pdl.cuh)
// before its first global load: decode.py launches it as a programmatic dependent launch.
//
// Masking (common/mask.cuh, docs/semantics.md 1, 2, 5): a sequence's length is
// len = cache_seqlens[b] + seqlen_new (clamped to the capacity); query row i sees key j iff
// j < len and (not causal or j <= len - seqlen_q + i). Keys at or beyond len are never read
// (cp.async src_size 0: zero-fill) and their scores are -inf, so a NaN-filled cache tail cannot
// reach the result. Page ids outside [0, num_pages) are never dereferenced (their rows are
// zero-filled; validate=True raises before launch: such a result is unspecified, memory-safe).
#include "common/dtype.cuh"
#include "common/params.cuh"
#include "common/mask.cuh"
#include "common/online_softmax.cuh"
#include "common/mma.cuh"
#include "common/softmax_step.cuh"
#include "common/pdl.cuh"
#include "common/kvcache_check.cuh"

namespace cf {

namespace decode_detail {
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
    unsigned r;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

__device__ __forceinline__ bool fits_i32(int64_t x) { return x >= 0 && x <= 0x7fffffff; }
}  // namespace decode_detail

// How the split kernel finds the K/V rows of a key (template parameter KV, chosen per call by
// decode.py; experiments/NOTES.md v18, v20). Every path gives bitwise the same result.
enum class KvPath : int {
    // (batch, seqlen_cache, nheads_k, headdim): source pointers computed once per tile, stepped
    // by a row stride per copy, no per-copy test on tiles inside the sequence (copy_tile_pointers)
    kContiguous = 0,
    // pages of a power-of-two size, 32-bit page strides and in-page offsets (the launcher checks,
    // the kernel traps otherwise): one id per page of a tile, addresses by shift and mask
    // (copy_tile_pointers for pages of >= BLOCK_N keys, copy_page_rows for smaller ones)
    kPagedCopyPointers = 1,
    // pages of any size: one id per key row (per tile for pages of whole tiles), an address
    // computation per copy with a shift or an integer division (copy_tile_rows)
    kPagedRows = 2,
};

// Arrival at a split group's counter (old value), acq_rel at GPU scope: thread 0's one atomic
// releases the block's partials and acquires the others' (v9: no __threadfence per thread).
__device__ __forceinline__ int atomic_add_acq_rel_gpu(int* counter, int v) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;"
                 : "=r"(old) : "l"(counter), "r"(v) : "memory");
    return old;
}

// Compile-time shape of the split kernel (cupyflash/decode/kernels.py reads kSmemBytes).
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
    // K and V tiles: unpadded rows, 16-byte chunk c of row r at c ^ (r % 8) in its 128-byte
    // group: conflict-free ldmatrix, and no extra L2 requests (padded rows: 88% of DRAM peak vs
    // 95%, experiments/NOTES.md v4).
    static_assert(kChunksPerRow % 8 == 0, "K/V rows: whole 128-byte swizzle groups");
    static constexpr int kTileElems = BLOCK_N * HEADDIM;      // one K (or V) tile
    static constexpr int kStageElems = 2 * kTileElems;        // K tile then V tile
    static constexpr int kQElems = GROUP * kQStride;
    // Element offset of 16-byte chunk `chunk` of row `row` in a K or V tile.
    static __device__ __forceinline__ int kv_offset(int row, int chunk) {
        return row * HEADDIM + (chunk ^ (row & 7)) * kVec;
    }
    // Page ids of the tiles in flight, a ring of STAGES tiles (paged caches; allocated always).
    static constexpr int kPageIdBytes = STAGES * BLOCK_N * 4;
    static constexpr int kQBytes = kQElems * (int)sizeof(T);
    static constexpr int kSmemBytes = kQBytes + STAGES * kStageElems * (int)sizeof(T)
                                      + kPageIdBytes;
    // Epilogue scratch (aliases the stage buffers once the pipeline has drained).
    static constexpr int kOStride = HEADDIM + 4;
    static constexpr int kEpilogueBytes = (NWARPS * GROUP * kOStride + 3 * NWARPS * GROUP
                                           + 3 * GROUP) * 4;
    static_assert(kEpilogueBytes <= STAGES * kStageElems * (int)sizeof(T), "epilogue fits");
    // Parts merged at once by the fused combine (8 at hd256: 16 would spill), and the half batch
    // for at most half as many splits (v12b; hd256: none, the registers are short).
    static constexpr int kMergeBatch = HEADDIM >= 256 ? 8 : 16;
    static constexpr int kMergeHalf = HEADDIM >= 256 ? kMergeBatch : kMergeBatch / 2;
    static_assert((BLOCK_N * kChunksPerRow) % kThreads == 0, "whole copies per thread");
    static constexpr int kCopiesPerThread = BLOCK_N * kChunksPerRow / kThreads;
    // Copy c of thread tid: column chunk tid % kChunksPerRow of row tid / kChunksPerRow + c *
    // kRowsPerPass (one column chunk per thread).
    static_assert(kThreads % kChunksPerRow == 0, "a thread copies one column chunk of its rows");
    static constexpr int kRowsPerPass = kThreads / kChunksPerRow;
};

// Length (after appending) of a sequence whose cache_seqlens entry is `cache_seqlen`, clamped to
// [0, capacity]: a bad cache_seqlens with validate=False cannot make the kernel read outside.
__device__ __forceinline__ int sequence_length(const DecodeParams& p, int cache_seqlen) {
    int len = p.cache_seqlens ? cache_seqlen + p.seqlen_new : p.seqlen_cache;
    return max(0, min(len, p.seqlen_cache));
}

// Page slot of key j in its sequence's block_table row (a shift for powers of two).
__device__ __forceinline__ int page_slot(const DecodeParams& p, int j) {
    return p.page_shift >= 0 ? (j >> p.page_shift) : (j / p.page_size);
}

// The block's share of the work: its split, sequence b, KV head hk, and rows. grid_order 0:
// grid (splits, batch, nheads_k * row_chunks); 1: (nheads_k * row_chunks, splits, batch), the
// KV-head blocks of one key range launched together. Row r of the block is query token
// qi = r / h_per_kv of head hk * h_per_kv + r % h_per_kv; rows past `rows` are padding.
struct DecodeBlock {
    int split, b, hz, hk, row_base, rows;

    __device__ __forceinline__ DecodeBlock(const DecodeParams& p, int group)
        : split(p.grid_order == 0 ? blockIdx.x : blockIdx.y),
          b(p.grid_order == 0 ? blockIdx.y : blockIdx.z),
          hz(p.grid_order == 0 ? blockIdx.z : blockIdx.x),  // hk * num_row_chunks + chunk
          hk(hz / p.num_row_chunks), row_base((hz % p.num_row_chunks) * group),
          rows(p.h_per_kv * p.seqlen_q) {}
    // query token of row rg (-1: a padding row)
    __device__ __forceinline__ int query_of(const DecodeParams& p, int rg) const {
        return rg < rows ? rg / p.h_per_kv : -1;
    }
};

// The K/V tile copies of one block into its ring of STAGES stages (16-byte cp.async, zero-fill
// past len / headdim / for bad page ids), and of the page ids of paged caches. This thread copies
// column chunk `chunk` of rows row0 + c * kRowsPerPass of every tile.
template <typename T, typename Tr, int HEADDIM, int BLOCK_N, int STAGES, KvPath KV>
struct KvTileCopier {
    static constexpr bool PAGED = KV != KvPath::kContiguous;
    static constexpr bool CP = KV != KvPath::kPagedRows;  // copy pointers (see KvPath)
    static constexpr int kCopies = Tr::kCopiesPerThread, kPass = Tr::kRowsPerPass;
    const DecodeParams& p;
    int* sPage;  // [STAGES][BLOCK_N] page ids
    int tid, b, row0, chunk;
    bool col_ok, tile_pages;
    const T* kbase;
    const T* vbase;
    const T* kcol;   // contiguous: (b, 0, hk, col) of each cache; paged: (page 0, row 0, hk, col)
    const T* vcol;
    const T* kpage;  // paged copy pointers: this thread's row offset inside a page
    const T* vpage;
    int page_mask;
    int len, tile_end;  // set once the sequence's length is known

    __device__ __forceinline__ KvTileCopier(const DecodeParams& p_, int* sPage_, int tid_, int b_,
                                            int hk)
        : p(p_), sPage(sPage_), tid(tid_), b(b_), row0(tid_ / Tr::kChunksPerRow),
          chunk(tid_ % Tr::kChunksPerRow), col_ok(chunk * Tr::kVec < p_.headdim),
          tile_pages(PAGED && p_.page_size % BLOCK_N == 0),
          kbase(reinterpret_cast<const T*>(p_.k)), vbase(reinterpret_cast<const T*>(p_.v)) {
        const int col = chunk * Tr::kVec;
        kcol = kbase + (PAGED ? 0 : (int64_t)b * p.k_batch_stride) + (int64_t)hk * p.k_head_stride + col;
        vcol = vbase + (PAGED ? 0 : (int64_t)b * p.v_batch_stride) + (int64_t)hk * p.v_head_stride + col;
        page_mask = PAGED ? p.page_size - 1 : 0;
        kpage = col_ok ? kcol + (int64_t)(row0 & page_mask) * p.k_row_stride : kbase;
        vpage = col_ok ? vcol + (int64_t)(row0 & page_mask) * p.v_row_stride : vbase;
    }

    // Paged: 4-byte cp.async copies of the ids of `tile` (if < end) into sPage[tile % STAGES]:
    // one per row j < n_keys, per tile when tile_pages, or (copy pointers) per page.
    __device__ __forceinline__ void fetch_page_ids(int tile, int end, int n_keys) const {
        if constexpr (PAGED) {
            if (tile >= end) return;
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
    }

    // Copy pointers: copy c from row r0 + c * kPass, a pointer stepped by a row stride (paged:
    // from the tile's row in its page). Rows below n_keys are copied, the others zero-filled.
    __device__ __forceinline__ void copy_tile_pointers(T* sK, T* sV, int tile, int n_keys) const {
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
        // Two loops on purpose: merged (valid = full || c * kPass < rem), nvcc keeps the per-copy
        // selects on full tiles too (one path instead of two in the SASS).
        if (rows_ok && tile * BLOCK_N + BLOCK_N <= n_keys) {  // every row of the tile is valid
#pragma unroll
            for (int c = 0; c < kCopies; ++c) {
                const int off = Tr::kv_offset(row0 + c * kPass, chunk);
                cp_async_16(smem_u32addr(sK + off), kp, true);
                cp_async_16(smem_u32addr(sV + off), vp, true);
                kp += kstep;
                vp += vstep;
            }
        } else {
            const int rem = rows_ok ? n_keys - r0 : 0;  // copies c with c * kPass < rem are valid
#pragma unroll
            for (int c = 0; c < kCopies; ++c) {
                const int off = Tr::kv_offset(row0 + c * kPass, chunk);
                const bool valid = c * kPass < rem;
                cp_async_16(smem_u32addr(sK + off), valid ? kp : kbase, valid);
                cp_async_16(smem_u32addr(sV + off), valid ? vp : vbase, valid);
                kp += kstep;
                vp += vstep;
            }
        }
    }

    // Copy pointers, pages of fewer than BLOCK_N keys: copy c reads tile row r = row0 + c * kPass,
    // id r >> page_shift, page row (row0 & mask) + (c * kPass & mask) (kpage / vpage hold the
    // first term). The ids are read before the first copy (the asm memory clobber would reload
    // them); invalid copies name page 0 (a column past headdim: the cache's base).
    __device__ __forceinline__ void copy_page_rows(T* sK, T* sV, int tile) const {
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
            cp_async_16(smem_u32addr(sK + off),
                        kpage + ((uint64_t)page * (unsigned)p.k_batch_stride
                                 + in_page * (unsigned)p.k_row_stride), valid);
            cp_async_16(smem_u32addr(sV + off),
                        vpage + ((uint64_t)page * (unsigned)p.v_batch_stride
                                 + in_page * (unsigned)p.v_row_stride), valid);
        };
        if (n_rows >= BLOCK_N) {
#pragma unroll
            for (int c = 0; c < kCopies; ++c) copy(c, true);
        } else {
#pragma unroll
            for (int c = 0; c < kCopies; ++c) copy(c, row0 + c * kPass < n_rows);
        }
    }

    // KvPath::kPagedRows: one address computation per copy from the row's page id.
    __device__ __forceinline__ void copy_tile_rows(T* sK, T* sV, int tile) const {
        const int* ids = sPage + (tile % STAGES) * BLOCK_N;
#pragma unroll
        for (int c = 0; c < kCopies; ++c) {
            const int row = row0 + c * kPass;
            const int j = tile * BLOCK_N + row;
            bool valid = j < len && col_ok;
            const int page = j < len ? ids[tile_pages ? 0 : row] : -1;  // -1: no id
            valid = valid && page >= 0 && page < p.num_pages;
            const int in_page = j - page_slot(p, j) * p.page_size;
            const int64_t koff = (int64_t)page * p.k_batch_stride + (int64_t)in_page * p.k_row_stride;
            const int64_t voff = (int64_t)page * p.v_batch_stride + (int64_t)in_page * p.v_row_stride;
            cp_async_16(smem_u32addr(sK + Tr::kv_offset(row, chunk)), valid ? kcol + koff : kbase,
                        valid);
            cp_async_16(smem_u32addr(sV + Tr::kv_offset(row, chunk)), valid ? vcol + voff : vbase,
                        valid);
        }
    }

    // The K/V copies of `tile` into `stage` (paged: its ids visible to every thread), then the
    // id copies of tile + STAGES - 1 (sync_ids: after a __syncthreads, see the prologue); if
    // `issue` (block-uniform), and always one commit (uniform wait counts).
    __device__ __forceinline__ void issue(bool issue, T* sStages, int stage, int tile,
                                          bool sync_ids = false) const {
        if (issue) {
            T* sK = sStages + stage * Tr::kStageElems;
            T* sV = sK + Tr::kTileElems;
            if constexpr (KV == KvPath::kPagedRows) copy_tile_rows(sK, sV, tile);
            else if (!PAGED || tile_pages) copy_tile_pointers(sK, sV, tile, len);
            else copy_page_rows(sK, sV, tile);
            if constexpr (PAGED) {
                if (sync_ids) __syncthreads();
                // tile t's ids are copied STAGES - 1 tiles ahead of its K/V copies, in the group of
                // the K/V copies issued then, so the wait before its K/V issue has landed them
                // (NOTES v5); rows past len have no id, never read
                fetch_page_ids(tile + STAGES - 1, tile_end, len);
            }
        }
        cp_async_commit();
    }
};

// S = Q K^T for this warp's keys (16 rows x kKeysPerWarp keys), fp32, in the score layout of
// common/softmax_step.cuh: s[4 (2 kw + nt) + e] is key warp_key0 + 16 kw + 8 nt + 2 t + (e & 1)
// of row g + 8 (e >> 1).
template <typename T, typename Tr, int HEADDIM>
__device__ __forceinline__ void decode_scores(float (&s)[8 * Tr::kKSteps], uint32_t sQ_addr,
                                              const T* sK, int warp_key0, int lane) {
#pragma unroll
    for (int i = 0; i < 8 * Tr::kKSteps; ++i) s[i] = 0.f;
#pragma unroll
    for (int ks = 0; ks < HEADDIM / 16; ++ks) {
        uint32_t a[4];
        ldmatrix_x4(a, sQ_addr + ks * 16 * (int)sizeof(T));
#pragma unroll
        for (int kw = 0; kw < Tr::kKSteps; ++kw) {
            // matrices: (keys 0-7, dims lo), (keys 0-7, dims hi), (keys 8-15, lo), (8-15, hi)
            const int krow = warp_key0 + kw * 16 + (lane >> 4) * 8 + (lane & 7);
            const int kchunk = ks * 2 + ((lane >> 3) & 1);
            uint32_t bk[4];
            ldmatrix_x4(bk, smem_u32addr(sK + Tr::kv_offset(krow, kchunk)));
            mma_m16n8k16<T>(*reinterpret_cast<float(*)[4]>(&s[8 * kw]), a, bk[0], bk[1]);
            mma_m16n8k16<T>(*reinterpret_cast<float(*)[4]>(&s[8 * kw + 4]), a, bk[2], bk[3]);
        }
    }
}

// acc += P V for this warp's keys (P in registers, the A fragments of common/softmax_step.cuh).
template <typename T, typename Tr, int HEADDIM>
__device__ __forceinline__ void decode_pv(float (&acc)[HEADDIM / 2],
                                          const uint32_t (&pf)[Tr::kKSteps][4], const T* sV,
                                          int warp_key0, int lane) {
#pragma unroll
    for (int kw = 0; kw < Tr::kKSteps; ++kw) {
        // matrices (transposed): (keys 0-7, dims lo), (keys 8-15, lo), (0-7, hi), (8-15, hi)
        const int vrow = warp_key0 + kw * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
        for (int dn = 0; dn < HEADDIM / 16; ++dn) {
            const int vchunk = dn * 2 + (lane >> 4);
            uint32_t bv[4];
            ldmatrix_x4_trans(bv, smem_u32addr(sV + Tr::kv_offset(vrow, vchunk)));
            mma_m16n8k16<T>(*reinterpret_cast<float(*)[4]>(&acc[8 * dn]), pf[kw], bv[0], bv[1]);
            mma_m16n8k16<T>(*reinterpret_cast<float(*)[4]>(&acc[8 * dn + 4]), pf[kw], bv[2], bv[3]);
        }
    }
}

// The end of a split: the NWARPS warp states merged (common/online_softmax.cuh), then either the
// final output (one split: normalised, in T, with its LSE) or this split's partial state (several:
// the unnormalised fp32 accumulator and the row's raw max m and sum l, merged by decode_merge).
// The stage buffers are free by now: they hold the warps' states as fp32 scratch.
template <typename T, typename Tr, int HEADDIM, int NWARPS, int GROUP>
__device__ __forceinline__ void decode_write_split(const DecodeParams& p, const DecodeBlock& blk,
                                                   unsigned char* scratch,
                                                   const float (&acc)[HEADDIM / 2],
                                                   SoftmaxRow<float> (&row)[2], int warp, int g,
                                                   int t) {
    const int tid = threadIdx.x;
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) row[rh].l = quad_sum(row[rh].l);
    // Only the block's valid rows are merged and written (b1 with GQA 4 and one token: 4 of 16).
    const int nrows = min(GROUP, blk.rows - blk.row_base);
    float* sO = reinterpret_cast<float*>(scratch);               // [NWARPS][GROUP][kOStride]
    float* sM = sO + NWARPS * GROUP * Tr::kOStride;              // [NWARPS][GROUP]
    float* sL = sM + NWARPS * GROUP;                             // [NWARPS][GROUP]
    float* sF = sL + NWARPS * GROUP;                             // [NWARPS][GROUP] warp factors
    float* sRow = sF + NWARPS * GROUP;                           // [3][GROUP]: m, l, 1 / l
#pragma unroll
    for (int dt = 0; dt < HEADDIM / 8; ++dt)
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
            if (g + 8 * rh >= nrows) continue;
            float* dst = sO + (warp * GROUP + g + 8 * rh) * Tr::kOStride + dt * 8 + 2 * t;
            dst[0] = acc[4 * dt + 2 * rh];
            dst[1] = acc[4 * dt + 2 * rh + 1];
        }
    if (t == 0) {
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
            sM[warp * GROUP + g + 8 * rh] = row[rh].m;
            sL[warp * GROUP + g + 8 * rh] = row[rh].l;
        }
    }
    __syncthreads();
    // One thread per row: the row's max over the warps, each warp's rescale factor and the
    // merged sum (once per row rather than once per output element).
    if (tid < nrows) {
        SoftmaxRow<float> tot;  // the warps' states merged: max, then each warp's factor
        tot.init();
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) tot.m = fmaxf(tot.m, sM[w * GROUP + tid]);
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            const float f = merge_factor(sM[w * GROUP + tid], tot.m, p.scale_log2);
            sF[w * GROUP + tid] = f;
            tot.l += sL[w * GROUP + tid] * f;
        }
        sRow[tid] = tot.m;
        sRow[GROUP + tid] = tot.l;
        sRow[2 * GROUP + tid] = SoftmaxRow<float>::inv_l(tot.l);
    }
    __syncthreads();

    const bool direct = p.num_splits == 1;  // single split: write the final output in T
    // (row, 4 columns) items of the valid rows; padding columns (c >= p.headdim, a multiple of
    // 8) are skipped. Partials leave as 16-byte stores (the workspace is 16-byte aligned).
    constexpr int kHd4 = HEADDIM / 4;
    for (int e = tid; e < nrows * kHd4; e += Tr::kThreads) {
        const int r = e / kHd4, c = (e % kHd4) * 4, rg = blk.row_base + r;
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
        const int qi = rg / p.h_per_kv, h = blk.hk * p.h_per_kv + rg % p.h_per_kv;
        if (direct) {
            const float inv = sRow[2 * GROUP + r];
            T* out = reinterpret_cast<T*>(p.o) + blk.b * p.o_batch_stride + qi * p.o_row_stride
                     + h * p.o_head_stride + c;
            out[0] = from_float<T>(o.x * inv);
            out[1] = from_float<T>(o.y * inv);
            out[2] = from_float<T>(o.z * inv);
            out[3] = from_float<T>(o.w * inv);
            if (c == 0 && p.lse != nullptr) {
                const SoftmaxRow<float> st{sRow[r], sRow[GROUP + r]};
                p.lse[blk.b * p.lse_batch_stride + h * p.lse_head_stride + qi] =
                    st.lse(st.l, p.scale_log2);
            }
        } else {
            const int64_t prow = ((int64_t)blk.split * p.batch + blk.b) * p.seqlen_q + qi;
            *reinterpret_cast<float4*>(p.o_part + (prow * p.nheads + h) * p.headdim + c) = o;
            if (c == 0)
                *reinterpret_cast<float2*>(
                    p.ml_part + 2 * ((((int64_t)blk.split * p.batch + blk.b) * p.nheads + h)
                                     * p.seqlen_q + qi)) = make_float2(sRow[r], sRow[GROUP + r]);
        }
    }
}

// The fused combine: the last split block of (b, hz) to arrive merges every split's partial
// state of its rows (no combine launch; v1: +3% at b1 x 128k, +24% at b1 x 8k): the online
// softmax one level up over the splits' raw (m, l, acc) (common/online_softmax.cuh,
// PartialMerge4), exact at any score magnitude. Its counter (workspace or per-stream buffer) is
// zero before a launch; the last block resets it (graph replays).
template <typename T, typename Tr, int GROUP>
__device__ __forceinline__ void decode_merge(const DecodeParams& p, const DecodeBlock& blk,
                                             int* flag) {
    const int tid = threadIdx.x;
    __syncthreads();  // every thread's partials are written, ordered before thread 0's release
    if (tid == 0) {
        int* counter = p.counters + ((int64_t)blk.b * p.nheads_k * p.num_row_chunks + blk.hz);
        const int old = atomic_add_acq_rel_gpu(counter, 1);
        const int last = old == p.num_splits - 1;
        if (last) atomicExch(counter, 0);  // all splits arrived: ready for the next launch
        *flag = last;
    }
    __syncthreads();  // the acquire of thread 0 is ordered before every thread's reads
    if (*flag == 0) return;
    // One (row, 4 columns) item per thread and pass; the parts are read through L2 (ld.cg).
    const int nrows = min(GROUP, blk.rows - blk.row_base);
    const int hd4 = p.headdim / 4;
    const int64_t o_split4 = (int64_t)p.batch * p.seqlen_q * p.nheads * p.headdim / 4;
    const int64_t ml_split = (int64_t)p.batch * p.nheads * p.seqlen_q;
    for (int e = tid; e < nrows * hd4; e += Tr::kThreads) {
        const int r = e / hd4, c = (e % hd4) * 4, rg = blk.row_base + r;
        const int qi = rg / p.h_per_kv, h = blk.hk * p.h_per_kv + rg % p.h_per_kv;
        const float2* mlp = reinterpret_cast<const float2*>(p.ml_part)
                            + ((int64_t)blk.b * p.nheads + h) * p.seqlen_q + qi;
        const float4* op = reinterpret_cast<const float4*>(
            p.o_part + (((int64_t)blk.b * p.seqlen_q + qi) * p.nheads + h) * p.headdim + c);
        PartialMerge4 st;
        st.init();
        // A batch's loads are issued before any of them is merged (one L2 round trip per batch;
        // per part before v10: 4.2 us at 16 splits), pointers advanced by a stride.
        auto merge = [&](auto batch) {
            constexpr int NB = decltype(batch)::kN;
            for (int sp0 = 0; sp0 < p.num_splits; sp0 += NB) {
                float2 mv[NB];
                float4 ov[NB];
#pragma unroll
                for (int u = 0; u < NB; ++u) {
                    if (sp0 + u < p.num_splits) {
                        mv[u] = __ldcg(mlp);
                        ov[u] = __ldcg(op);
                    }
                    mlp += ml_split;
                    op += o_split4;
                }
                st.add_batch(mv, ov, p.num_splits - sp0, p.scale_log2);
            }
        };
        if (p.num_splits <= Tr::kMergeHalf) merge(MergeBatch<Tr::kMergeHalf>{});
        else merge(MergeBatch<Tr::kMergeBatch>{});
        // o = acc / l in T, and the LSE (natural log; -inf for a row that saw no key) once per row
        const float inv = SoftmaxRow<float>::inv_l(st.l);
        T* out = reinterpret_cast<T*>(p.o) + blk.b * p.o_batch_stride + qi * p.o_row_stride
                 + h * p.o_head_stride + c;
#pragma unroll
        for (int x = 0; x < 4; ++x) out[x] = from_float<T>(st.acc[x] * inv);
        if (c == 0 && p.lse != nullptr)
            p.lse[blk.b * p.lse_batch_stride + h * p.lse_head_stride + qi] =
                SoftmaxRow<float>{st.m, st.l}.lse(st.l, p.scale_log2);
    }
}

// Whether q's tile is copied by 16-byte cp.async (block-uniform): its base and varying strides
// are 16-byte multiples. Else 2-byte loads after the prologue (decode_q_by_elements): same bits.
template <typename T>
__device__ __forceinline__ bool q_copies_async(const DecodeParams& p) {
    return ((reinterpret_cast<unsigned long long>(p.q)
             | (unsigned long long)(p.batch > 1 ? p.q_batch_stride : 0) * sizeof(T)
             | (unsigned long long)(p.seqlen_q > 1 ? p.q_row_stride : 0) * sizeof(T)
             | (unsigned long long)(p.nheads > 1 ? p.q_head_stride : 0) * sizeof(T))
            & 15ull) == 0;
}

// The block's first global loads, after pdl_wait: the sequence's length (returned, before
// clamping), the Q tile by 16-byte cp.async right after it (v44: 2-byte Q loads held 47% of the
// stall samples at b64 x 128 keys), in the next commit group (the first tile's, or a missed SPEC
// guess's ids'; with no tile the epilogue's wait-all), and the metadata check of a call without
// new tokens (common/kvcache_check.cuh: warp 0 of the first block of each sequence). SPEC: the
// length by a 4-byte cp.async of thread 0 into the padding of the Q tile's row 0, in the same
// group as the guessed ids: one wait lands both (as a plain load, ptxas scheduled its use ahead
// of the id copies: two round trips, NOTES v34); Q outside that group, so that the wait lands
// only the length and the ids (v46: inside, the Q copies held the wait 0.5-0.8 us).
template <typename T, typename Tr, int HEADDIM, int GROUP, int STAGES, bool SPEC, typename Copier>
__device__ __forceinline__ int decode_prologue(const DecodeParams& p, const DecodeBlock& blk,
                                               const Copier& kv, T* sQ, int spec_begin,
                                               int spec_end) {
    const int tid = threadIdx.x;
    static_assert((Tr::kQStride - HEADDIM) * sizeof(T) >= sizeof(int),
                  "the length's slot lies in the Q tile's row padding");
    int* sLen = reinterpret_cast<int*>(sQ + HEADDIM);  // SPEC
    const bool q_async = q_copies_async<T>(p);
    auto copy_q = [&]() {
        const uint16_t* q = reinterpret_cast<const uint16_t*>(p.q)
                            + blk.b * p.q_batch_stride + blk.hk * p.h_per_kv * p.q_head_stride;
        constexpr int kChunks = HEADDIM / 8;  // 16-byte chunks per row
        static_assert(GROUP * kChunks % Tr::kThreads == 0, "whole Q chunks per thread");
#pragma unroll
        for (int k = 0; k < GROUP * kChunks / Tr::kThreads; ++k) {
            const int e = tid + k * Tr::kThreads;
            const int r = e / kChunks, c = (e % kChunks) * 8, rg = blk.row_base + r;
            const bool valid = rg < blk.rows && c < p.headdim;
            const int qi = rg / p.h_per_kv, hh = rg - qi * p.h_per_kv;  // head hk * h_per_kv + hh
            const uint16_t* src = valid ? q + qi * p.q_row_stride + hh * p.q_head_stride + c
                                        : reinterpret_cast<const uint16_t*>(p.q);
            cp_async_16(smem_u32addr(sQ + r * Tr::kQStride + c), src, valid);
        }
    };
    int len_raw;
    if constexpr (SPEC) {
        if (tid == 0 && p.cache_seqlens != nullptr)
            cp_async_4(smem_u32addr(sLen), p.cache_seqlens + blk.b);
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) kv.fetch_page_ids(spec_begin + s, spec_end, p.seqlen_cache);
        cp_async_commit();
        if (q_async) copy_q();
        cp_async_wait<0>();
        __syncthreads();  // the length and the guessed ids are visible to every thread
        len_raw = p.cache_seqlens != nullptr ? *sLen : 0;
    } else {
        len_raw = p.cache_seqlens ? p.cache_seqlens[blk.b] : 0;
        if (q_async) copy_q();  // after the length's load, in the first tile's group
    }
    if (p.check_claim != nullptr && p.cache_seqlens != nullptr && blk.split == 0 && blk.hz == 0
        && tid < 32)
        check_kvcache_sequence(KvCheck{p.check_claim, p.check_record}, blk.b, len_raw,
                               Copier::PAGED ? p.block_table + (int64_t)blk.b * p.block_table_batch_stride
                                             : nullptr,
                               p.seqlen_new, p.seqlen_cache, p.page_size, p.num_pages);
    return len_raw;
}

// The Q tile by 2-byte loads (a q off 16-byte strides; zero-padded rows and columns), after the
// prologue's copies are issued, so that its latency overlaps theirs.
template <typename T, typename Tr, int HEADDIM, int GROUP>
__device__ __forceinline__ void decode_q_by_elements(const DecodeParams& p, const DecodeBlock& blk,
                                                     T* sQ) {
    if (q_copies_async<T>(p)) return;
    const uint16_t* q = reinterpret_cast<const uint16_t*>(p.q);
    uint16_t* s = reinterpret_cast<uint16_t*>(sQ);
#pragma unroll 8
    for (int e = threadIdx.x; e < GROUP * HEADDIM; e += Tr::kThreads) {
        const int r = e / HEADDIM, c = e % HEADDIM, rg = blk.row_base + r;
        uint16_t val = 0;  // +0.0 in fp16 and bf16
        if (rg < blk.rows && c < p.headdim) {
            const int qi = rg / p.h_per_kv, h = blk.hk * p.h_per_kv + rg % p.h_per_kv;
            val = q[blk.b * p.q_batch_stride + qi * p.q_row_stride + h * p.q_head_stride + c];
        }
        s[r * Tr::kQStride + c] = val;
    }
}

template <typename T, int HEADDIM, int BLOCK_N, int NWARPS, int GROUP, int STAGES, KvPath KV>
__device__ __forceinline__ void decode_split(const DecodeParams& p) {
    using Tr = DecodeTraits<T, HEADDIM, BLOCK_N, NWARPS, GROUP, STAGES>;
    using Copier = KvTileCopier<T, Tr, HEADDIM, BLOCK_N, STAGES, KV>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    constexpr bool PAGED = KV != KvPath::kContiguous;
    constexpr bool CP = KV != KvPath::kPagedRows;  // copy pointers (see KvPath)
    // Speculative page ids (v13, v34): the first tiles' ids of the split at full capacity come
    // with the length; where the guess is right (the longest sequences), one round trip fewer
    // before the first K/V copy, else they are fetched again. Not at hd256 (255 registers).
    constexpr bool SPEC = PAGED && HEADDIM <= 128;
    if (decode_detail::dynamic_smem_bytes() < (unsigned)Tr::kSmemBytes)
        __trap();  // launch bug, never silent
    // Paged copy pointers: a tile starts a page (or lies in one) and a copy pass does not
    // straddle two pages only if BLOCK_N and the pass are powers of two.
    static_assert(!(CP && PAGED) || ((BLOCK_N & (BLOCK_N - 1)) == 0
                                     && (Tr::kRowsPerPass & (Tr::kRowsPerPass - 1)) == 0),
                  "paged copy pointers: BLOCK_N and the copy pass must be powers of two");
    if constexpr (CP && PAGED)  // paged copy pointers: a power-of-two page, 32-bit strides
        if (p.page_shift < 0 || !decode_detail::fits_i32(p.k_batch_stride)
            || !decode_detail::fits_i32(p.v_batch_stride)
            || !decode_detail::fits_i32((int64_t)p.page_size * p.k_row_stride)
            || !decode_detail::fits_i32((int64_t)p.page_size * p.v_row_stride))
            __trap();

    // ================================ set-up ================================================
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sStages = reinterpret_cast<T*>(smem_raw + Tr::kQBytes);
    int* sPage = reinterpret_cast<int*>(sStages + STAGES * Tr::kStageElems);  // [STAGES][BLOCK_N]
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane >> 2, t = lane & 3;  // mma groupID / threadID_in_group
    const DecodeBlock blk(p, GROUP);
    Copier kv(p, sPage, tid, blk.b, blk.hk);
    int spec_begin = -1, spec_end = 0;  // SPEC: the split at full capacity
    if constexpr (SPEC) {
        const int nt_g = (p.seqlen_cache + BLOCK_N - 1) / BLOCK_N;
        const int tps_g = p.split_tiles > 0 ? p.split_tiles : (nt_g + p.num_splits - 1) / p.num_splits;
        spec_begin = min(blk.split * tps_g, nt_g);
        spec_end = min(spec_begin + tps_g, nt_g);
    }
    // Programmatic dependent launch (common/pdl.cuh): no global load before this wait, so that
    // the set-up above overlaps the previous kernel's tail.
    pdl_wait();
    const int len_raw = decode_prologue<T, Tr, HEADDIM, GROUP, STAGES, SPEC>(p, blk, kv, sQ,
                                                                           spec_begin, spec_end);
    const int len = sequence_length(p, len_raw);
    const int n_tiles = (len + BLOCK_N - 1) / BLOCK_N;
    // (one split: no division between the length and the first copy)
    const int tiles_per_split = p.split_tiles > 0 ? p.split_tiles
                                : p.num_splits == 1 ? n_tiles
                                                    : (n_tiles + p.num_splits - 1) / p.num_splits;
    const int tile_begin = min(blk.split * tiles_per_split, n_tiles);
    const int tile_end = min(tile_begin + tiles_per_split, n_tiles);
    const int n_iter = tile_end - tile_begin;
    kv.len = len;
    kv.tile_end = tile_end;

    // this thread's rows (g and g + 8) and their visible key ranges (padding rows see nothing)
    KeyRange range[2];
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
        const int qi = blk.query_of(p, blk.row_base + g + 8 * rh);
        range[rh] = qi >= 0 ? visible_keys(qi, p.seqlen_q, len, p.causal != 0, -1, -1)
                            : KeyRange{0, 0};
    }
    // online-softmax state of this warp (FA-2: unscaled acc, normalised at the end)
    SoftmaxRow<float> row[2];
    row[0].init();
    row[1].init();
    float acc[HEADDIM / 2];
#pragma unroll
    for (int i = 0; i < HEADDIM / 2; ++i) acc[i] = 0.f;
    const uint32_t sQ_addr = smem_u32addr(sQ + (lane & 15) * Tr::kQStride + (lane >> 4) * 8);
    const int warp_key0 = warp * Tr::kKeysPerWarp;

    // pipeline prologue: STAGES - 1 tiles in flight
    if constexpr (PAGED) {  // the ids of the prologue's tiles, waited for once
        // SPEC with the right guess: the speculative fetch (landed, visible) covers them.
        // Otherwise fetch them now (the speculative copies have landed: same slots).
        if (tile_begin != spec_begin) {  // block-uniform
#pragma unroll
            for (int s = 0; s < STAGES - 1; ++s) kv.fetch_page_ids(tile_begin + s, tile_end, len);
            cp_async_commit();
            cp_async_wait<0>();
            __syncthreads();  // the prologue's ids are visible
        }
    }
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        // Paged: issue refills the slot of tile tile_begin + s - 1 after a __syncthreads that
        // ends every read of it (s >= 1; at s = 0 the slot is the ring's free one).
        kv.issue(s < n_iter, sStages, s, tile_begin + s, PAGED && s >= 1);
    }
    decode_q_by_elements<T, Tr, HEADDIM, GROUP>(p, blk, sQ);

    // ================================ main loop =============================================
    for (int it = 0; it < n_iter; ++it) {
        cp_async_wait<STAGES - 2>();  // this thread's copies of tile `it` have landed
        __syncthreads();              // everyone's have; everyone is done with stage it - 1
        // (possibly empty) groups keep the wait count uniform
        kv.issue(it + STAGES - 1 < n_iter, sStages, (it + STAGES - 1) % STAGES,
                 tile_begin + it + STAGES - 1);
        const T* sK = sStages + (it % STAGES) * Tr::kStageElems;
        const T* sV = sK + Tr::kTileElems;
        const int key0 = (tile_begin + it) * BLOCK_N + warp_key0;  // first key of this warp
        float s[8 * Tr::kKSteps], alpha[2];
        uint32_t pf[Tr::kKSteps][4];
        decode_scores<T, Tr, HEADDIM>(s, sQ_addr, sK, warp_key0, lane);
        // every tile is masked: keys past len, causal, padding rows (common/softmax_step.cuh)
        softmax_tile_step_packed<T, 2 * Tr::kKSteps, true, 1>(s, row, alpha,
                                                              tile_bounds(range, key0, t),
                                                              p.scale_log2, pf);
        rescale_rows<HEADDIM / 8>(acc, alpha);
        decode_pv<T, Tr, HEADDIM>(acc, pf, sV, warp_key0, lane);
    }

    // ================================ epilogue ==============================================
    pdl_launch_dependents();  // the next kernel's launch overlaps the epilogue and the merge
    cp_async_wait<0>();
    __syncthreads();  // stage buffers are free: reuse them as fp32 scratch
    decode_write_split<T, Tr, HEADDIM, NWARPS, GROUP>(p, blk, reinterpret_cast<unsigned char*>(sStages),
                                                      acc, row, warp, g, t);
    if (p.num_splits > 1)
        decode_merge<T, Tr, GROUP>(p, blk, reinterpret_cast<int*>(smem_raw));  // (the Q tile is dead)
}

// The entry: DecodeParams (common/params.cuh) by value.
template <typename T, int HEADDIM, int BLOCK_N, int NWARPS, int GROUP, int STAGES, KvPath KV>
__global__ void __launch_bounds__(NWARPS * 32, 1)
decode_split_kernel(const __grid_constant__ DecodeParams p) {
    decode_split<T, HEADDIM, BLOCK_N, NWARPS, GROUP, STAGES, KV>(p);
}

}  // namespace cf
