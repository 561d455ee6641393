// Runtime values of a launch. Compile-time choices (dtype, head dim, tile sizes, causal) are
// template parameters of the kernels; everything that varies per call lives here.
#pragma once
// <cstdint>/<cmath> under nvcc; NVRTC has no standard headers (see dtype.cuh)
#include "dtype.cuh"

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
                                       // nullptr: not written (return_lse=False)

    int64_t q_batch_stride, q_row_stride, q_head_stride;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
    int64_t lse_batch_stride, lse_head_stride;  // lse row stride is 1

    const int* __restrict__ cu_seqlens_q;  // nullptr unless varlen
    const int* __restrict__ cu_seqlens_k;

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

// Where the work of (batch b, query head h) lives: its sequence lengths and the element offsets
// of token 0 of q/o (head h), k/v (KV head h / h_per_kv) and of its LSE row. Varlen sequences
// start at cu_seqlens[b] (batch strides ignored); otherwise at b * batch_stride. 64-bit throughout.
struct FwdSeq {
    int seqlen_q, seqlen_k;
    int64_t q_off, k_off, v_off, o_off, lse_off;
};

__device__ __forceinline__ FwdSeq fwd_seq(const FwdParams& p, int b, int h) {
    FwdSeq s;
    const int hk = h / p.h_per_kv;  // GQA / MQA
    int64_t q_tok = 0, k_tok = 0;
    int64_t bq = b, bk = b;
    s.seqlen_q = p.seqlen_q;
    s.seqlen_k = p.seqlen_k;
    if (p.cu_seqlens_q != nullptr) {
        q_tok = p.cu_seqlens_q[b];
        s.seqlen_q = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
        bq = 0;
    }
    if (p.cu_seqlens_k != nullptr) {
        k_tok = p.cu_seqlens_k[b];
        s.seqlen_k = p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
        bk = 0;
    }
    s.q_off = bq * p.q_batch_stride + q_tok * p.q_row_stride + (int64_t)h * p.q_head_stride;
    s.o_off = bq * p.o_batch_stride + q_tok * p.o_row_stride + (int64_t)h * p.o_head_stride;
    s.k_off = bk * p.k_batch_stride + k_tok * p.k_row_stride + (int64_t)hk * p.k_head_stride;
    s.v_off = bk * p.v_batch_stride + k_tok * p.v_row_stride + (int64_t)hk * p.v_head_stride;
    s.lse_off = bq * p.lse_batch_stride + (int64_t)h * p.lse_head_stride + q_tok;
    return s;
}

}  // namespace cf

namespace cf {

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
    float* __restrict__ o_part;             // workspace (num_splits, batch, seqlen_q, nheads, headdim)
    float* __restrict__ lse_part;           // workspace (num_splits, batch, nheads, seqlen_q)

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
                        // on gridDim.x (grid_order 1) or .z (grid_order 0); decode.py launches
                        // contiguous caches with order 1, paged ones with order 0
    int causal;
    float scale_log2;   // softmax_scale * log2(e)
};

}  // namespace cf
