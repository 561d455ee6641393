// Where the work of one (batch, head) of the prefill forward (and backward) lives: its lengths
// and the element offsets of its rows in q, k, v, o and lse, dense or varlen (cu_seqlens).
#pragma once
#include "params.cuh"

namespace cf {

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
