// The kernel parameters: every entry of the library takes one of these structs, by value, as
// its only argument (`const __grid_constant__`). Runtime values live here; compile-time choices
// (dtype, head dim, tile sizes, causal) are template parameters of the kernels.
//
// The host builds the same structs with ctypes (cupyflash/core/params.py) and launches through
// cupyflash/core/launch.py; tests/test_params.py compiles the offsets and sizes the host assumes
// against these definitions (static_asserts under NVRTC), so the two cannot drift apart. The
// per-call pointers of each struct come first, one after the other: the host writes them as one
// block per call.
#pragma once
// <cstdint>/<cmath> under nvcc; NVRTC has no standard headers (see dtype.cuh)
#include "dtype.cuh"
#include "tma.cuh"

namespace cf {

// Tiled prefill forward (FlashAttention-2, arXiv 2307.08691, Algorithm 1).
// Layout (batch, seqlen, nheads, headdim); strides are in elements, the last dim contiguous.
// Varlen: q/k/v/o are (total_tokens, nheads, headdim); cu_seqlens_* (batch + 1) give each
// sequence's start row, and the batch strides are unused.
struct FwdParams {
    const void* __restrict__ q;
    const void* __restrict__ k;
    const void* __restrict__ v;
    void* __restrict__ o;
    float* __restrict__ lse;           // (batch, nheads, seqlen_q); varlen: (nheads, total_q);
                                       // double for the float64 kernel (FwdTile::lse_as);
                                       // nullptr: not written (return_lse=False)
    const int* __restrict__ cu_seqlens_q;  // nullptr unless varlen
    const int* __restrict__ cu_seqlens_k;

    int64_t q_batch_stride, q_row_stride, q_head_stride;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
    int64_t lse_batch_stride, lse_head_stride;  // lse row stride is 1

    int batch, nheads, nheads_k, h_per_kv;  // h_per_kv = nheads / nheads_k (GQA/MQA)
    int seqlen_q, seqlen_k;                 // max lengths when varlen
    int headdim;                            // actual head dim (<= the compiled, padded one)

    // Scores are s = softmax_scale * q.k.  scale_log2 = softmax_scale * log2(e) so the kernels
    // can use exp2; the fp64 path uses softmax_scale_d.
    float scale_log2;
    double softmax_scale_d;

    // Sliding window, bottom-right aligned like causal: with shift = seqlen_k - seqlen_q, query
    // row i sees key j iff  i + shift - window_left <= j <= i + shift + window_right ; -1 = unbounded.
    int window_left, window_right;
};

// The backward pass (backward/*.cu; FlashAttention-2, arXiv 2307.08691, Sec. 3.2 and
// Algorithm 2): the forward's problem (`fwd`: q, k, v, o, its lse, cu_seqlens, strides, sizes,
// scale, window) and the backward's own arrays. dout and dq like q (dq: T), dk and dv like k
// (T), dsum: D = rowsum(dout * o) per query row, laid out like a contiguous lse ((batch, nheads,
// seqlen_q) or varlen (nheads, total_q)), in the accumulator type (float; double for float64).
// dq_accum: the Hopper kernel's fp32 dQ accumulator (batch, nheads, seqlen_q, compiled head
// dim), zeroed before it runs (backward/hopper.cu); NULL for the other kernels.
// The pointers come first, then fwd's, one block of 13 (the per-call fields).
struct BwdParams {
    const void* __restrict__ dout;
    void* __restrict__ dq;
    void* __restrict__ dk;
    void* __restrict__ dv;
    void* __restrict__ dsum;
    float* __restrict__ dq_accum;
    FwdParams fwd;
    int64_t do_batch_stride, do_row_stride, do_head_stride;
    int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
    int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
    int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
    int64_t dsum_batch_stride, dsum_head_stride;
};

// The Hopper forward (forward/hopper.cu): four tensor maps, q, k, v and o as 4-D (headdim,
// nheads, seqlen, batch) tensors of 16-bit elements (boxes of 64 x 1 x BLOCK_M (q), BLOCK_N
// (k, v) or 64 (o) x 1 with the 128-byte swizzle: cupyflash/core/tma.py), then FwdParams, the
// causal scheduler's counter (an int that is 0 before the launch and left 0 after it; one per
// stream; unused when non-causal) and o_map_ok (1: the o map is encoded for this call's out, a
// dense problem; 0: O is written from registers and the o map is not read).
struct FwdTmaParams {
    TmaDesc tq, tk, tv, to;
    FwdParams fwd;
    int* tile_counter;
    int o_map_ok;
};

// The Hopper backward (backward/hopper.cu): four tensor maps, q, k, v and dout as 4-D
// (headdim, nheads, seqlen, batch) tensors of 16-bit elements (boxes of 64 x 1 x 64 (q, dout) or
// 128 (k, v) x 1 with the 128-byte swizzle: cupyflash/core/tma.py), then BwdParams.
struct BwdTmaParams {
    TmaDesc tq, tk, tv, tdo;
    BwdParams bwd;
};

// Split-KV decode against a KV cache (Flash-Decoding; FlashAttention-2 arXiv 2307.08691 Sec. 3.1
// per split). Strides in elements, the last dim contiguous. Paged cache: the "batch" strides of
// k/v step over pages (num_pages, page_size, nheads_k, headdim) and block_table maps a
// sequence's page slot to a page id.
struct DecodeParams {
    const void* __restrict__ q;             // (batch, seqlen_q, nheads, headdim)
    const void* __restrict__ k;             // cache, see above
    const void* __restrict__ v;
    const int* __restrict__ cache_seqlens;  // (batch,) tokens before appending; nullptr = full
    const int* __restrict__ block_table;    // (batch, max_pages_per_seq); nullptr if contiguous
    void* __restrict__ o;                   // final output (batch, seqlen_q, nheads, headdim), T
    float* __restrict__ lse;                // final LSE (batch, nheads, seqlen_q) or nullptr
    float* __restrict__ o_part;             // workspace (num_splits, batch, seqlen_q, nheads, headdim):
                                            // each split's unnormalised accumulator
    float* __restrict__ ml_part;            // workspace (num_splits, batch, nheads, seqlen_q, 2):
                                            // each split's raw row max m and sum l
    int* counters;                          // (batch, nheads_k * row_chunks) arrival counters of
                                            // the fused combine, 0 between launches; one split:
                                            // unused
    int* check_claim;                       // the metadata check (common/kvcache_check.cuh,
    int* check_record;                      // cupyflash/core/guard.py); nullptr: no check

    int64_t q_batch_stride, q_row_stride, q_head_stride;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
    int64_t lse_batch_stride, lse_head_stride;  // lse row stride is 1
    int64_t block_table_batch_stride;

    int batch, nheads, nheads_k, h_per_kv, seqlen_q, headdim;
    int seqlen_cache;   // capacity per sequence in tokens (contiguous dim 1, or pages * page_size)
    int seqlen_new;     // tokens appended before attending (counted in each sequence's length)
    int page_size, page_shift, num_pages;  // page_shift = log2(page_size) or -1
    int num_splits;     // the split kernel's grid: gridDim.y (grid_order 1) or .x (grid_order 0)
    int split_tiles;    // > 0: fixed BLOCK_N-tiles per split; 0: ceil(tiles / num_splits)
    int num_row_chunks; // ceil(h_per_kv * seqlen_q / GROUP); nheads_k * num_row_chunks blocks
                        // on gridDim.x (grid_order 1) or .z (grid_order 0)
    int grid_order;     // 1: grid (nheads_k * row_chunks, splits, batch) (contiguous caches);
                        // 0: (splits, batch, nheads_k * row_chunks) (paged)
    int causal;
    float scale_log2;   // softmax_scale * log2(e)
};

// The KV append of a decode call (decode/append.cu): new[b, i, h, :] into the cache at position
// cache_seqlens[b] + i (through block_table when paged). Element strides.
struct DecodeAppendParams {
    const void* k_new;
    const void* v_new;
    void* k_cache;
    void* v_cache;
    const int* cache_seqlens;
    const int* block_table;
    int* check_claim;    // as in DecodeParams
    int* check_record;
    int64_t kn_batch_stride, kn_row_stride, kn_head_stride;
    int64_t vn_batch_stride, vn_row_stride, vn_head_stride;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int64_t block_table_batch_stride;
    int seqlen_new, nheads_k, headdim, seqlen_cache, page_size, num_pages;
};

// The merge of normalised partial states (decode/combine.cu, the public merge_states): o_part
// (part, batch, row, head, headdim) and lse_part (part, batch, head, row), float32, strides in
// elements, into out (batch, row, head, headdim) and lse_out (batch, head, row).
struct MergeParams {
    const float* o_part;
    const float* lse_part;
    void* out;
    float* lse_out;
    int64_t op_part_stride, op_batch_stride, op_row_stride, op_head_stride;
    int64_t lp_part_stride, lp_batch_stride, lp_head_stride, lp_row_stride;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
    int64_t lse_batch_stride, lse_head_stride;
    int num_parts, batch, seqlen, nheads, headdim;
};

// The softmax pass of the materialising baseline (baseline.cu): S (rows, seqlen_k) of scores in
// device memory -> P (rows, seqlen_k) and the rows' LSE.
struct BaselineSoftmaxParams {
    const void* s;
    void* p;
    float* lse;
    int64_t rows;
    int seqlen_q, seqlen_k, causal, window_left, window_right;
    double softmax_scale;
};

}  // namespace cf
