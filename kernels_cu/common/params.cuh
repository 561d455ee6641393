// Runtime values of a launch. Compile-time choices (dtype, head dim, tile sizes, causal) are
// template parameters of the kernels; everything that varies per call lives here.
#pragma once
#include <cstdint>

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
    float* __restrict__ lse;           // (batch, nheads, seqlen_q); varlen: (nheads, total_q)

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

}  // namespace cf
