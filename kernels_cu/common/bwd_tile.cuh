// The tiles of the backward pass (FlashAttention-2, arXiv 2307.08691, Sec. 3.2 and Algorithm 2)
// as every backward kernel sees them, and its pre-pass.
//
// The backward runs three kernels, none with atomics (so every gradient is bitwise the same from
// run to run, and a sequence's gradients do not depend on the other sequences of its batch):
//   1. dsum (this file): D_i = rowsum(dO_i * O_i) per query row (= rowsum(P_i * dP_i));
//   2. dK/dV: one CTA per (key block, KV head, batch) walks the query blocks that see its keys,
//      for every query head of its group (GQA/MQA sums in registers): S^T = K Q^T,
//      P^T = exp(scale S^T - LSE), dP^T = V dO^T, dS^T = P^T (dP^T - D), dV += P^T dO,
//      dK += dS^T Q; dK scaled by softmax_scale once at the end;
//   3. dQ: one CTA per (query block, head, batch) walks the key blocks its rows see, as the
//      forward does: S = Q K^T, P, dP = dO V^T, dS = P (dP - D), dQ += dS K; scaled at the end.
// P is recomputed from the forward's LSE (natural log): p = exp2(s c - lse log2(e)),
// c = softmax_scale log2(e). A row that sees no key (LSE -inf) and a row past its sequence's end
// take LSE = +inf here, so every p of theirs is exp2(-inf) = 0, as is every masked score's.
// The cost of no atomics is one more S = Q K^T and dP = dO V^T (7 matrix products for
// FlashAttention-2's 5).
#pragma once
#include "params.cuh"
#include "mask.cuh"
#include "fwd_tile.cuh"

namespace cf {

// Where the backward work of (batch b, query head h) lives: the forward's offsets (q, k, v, o,
// lse and lengths: fwd_seq) and those of dout, dq (head h), dk, dv (KV head h / h_per_kv) and
// D (dsum).
struct BwdSeq {
    FwdSeq f;
    int64_t do_off, dq_off, dk_off, dv_off, dsum_off;
};

__device__ __forceinline__ BwdSeq bwd_seq(const BwdParams& p, int b, int h) {
    BwdSeq s;
    s.f = fwd_seq(p.fwd, b, h);
    const int hk = h / p.fwd.h_per_kv;
    int64_t q_tok = 0, k_tok = 0, bq = b, bk = b;
    if (p.fwd.cu_seqlens_q != nullptr) {
        q_tok = p.fwd.cu_seqlens_q[b];
        k_tok = p.fwd.cu_seqlens_k[b];
        bq = bk = 0;
    }
    s.do_off = bq * p.do_batch_stride + q_tok * p.do_row_stride + (int64_t)h * p.do_head_stride;
    s.dq_off = bq * p.dq_batch_stride + q_tok * p.dq_row_stride + (int64_t)h * p.dq_head_stride;
    s.dk_off = bk * p.dk_batch_stride + k_tok * p.dk_row_stride + (int64_t)hk * p.dk_head_stride;
    s.dv_off = bk * p.dv_batch_stride + k_tok * p.dv_row_stride + (int64_t)hk * p.dv_head_stride;
    s.dsum_off = bq * p.dsum_batch_stride + (int64_t)h * p.dsum_head_stride + q_tok;
    return s;
}

// The query blocks [m_block_min, m_block_max) whose rows see any key of [n0, n_last]
// (the transpose of KeyTiles: visible_keys(i).lo and .hi are non-decreasing in i, so the rows
// that see a key of the block are those with hi(i) > n0 and lo(i) <= n_last, an interval).
template <int BLOCK_M>
struct QueryTiles {
    int m_block_min, m_block_max;

    __device__ __forceinline__ QueryTiles(int n0, int n_last, int seqlen_q, int seqlen_k,
                                          bool causal, int window_left, int window_right) {
        const int shift = seqlen_k - seqlen_q;
        int right = window_right;                      // hi(i) = min(seqlen_k, i + shift + right + 1)
        if (causal) right = right < 0 ? 0 : min(right, 0);
        int first = 0, last = seqlen_q - 1;
        if (right >= 0) first = max(first, n0 - shift - right);
        if (window_left >= 0) last = min(last, n_last - shift + window_left);
        if (n0 >= seqlen_k || first > last) {
            m_block_min = m_block_max = 0;
        } else {
            m_block_min = first / BLOCK_M;
            m_block_max = last / BLOCK_M + 1;
        }
    }
};

// The score tile (rows [m0, m0 + BLOCK_M), keys [n0, n0 + BLOCK_N)) needs the mask: some pair in
// it is not visible (causal / window edge, or keys past seqlen_k). Rows past seqlen_q need none
// (their LSE is +inf: p = 0).
template <int BLOCK_M, int BLOCK_N>
__device__ __forceinline__ bool bwd_tile_needs_mask(const FwdParams& p, int m0, int n0,
                                                    int seqlen_q, int seqlen_k, bool causal) {
    const int last = min(m0 + BLOCK_M, seqlen_q) - 1;
    return KeyTiles<BLOCK_N>(m0, last, seqlen_q, seqlen_k, causal, p.window_left,
                             p.window_right).needs_mask(n0 / BLOCK_N);
}

// The LSE of a row as the backward uses it: lse * log2(e) (so p = exp2(s c - that)), +inf for a
// row that sees no key (-inf) or lies past the sequence's end.
template <typename L>
__device__ __forceinline__ L bwd_lse_log2(const L* lse_row0, int r, int seqlen_q) {
    const L inf = (L)INFINITY;
    if (r >= seqlen_q) return inf;
    const L x = lse_row0[r];
    return x == -inf ? inf : x * (L)1.4426950408889634073599246810019;
}

// The pre-pass: D = rowsum(dO * O) of every query row, in Acc (float; double for float64), one
// warp per row. Grid (ceil(seqlen_q / kDsumRows), nheads, batch), 128 threads.
constexpr int kDsumRows = 16;

template <typename T, typename Acc>
__device__ __forceinline__ Acc to_acc(T x) {
    if constexpr (sizeof(T) == 2) return (Acc)to_float<T>(x);
    else return (Acc)x;
}

// D of query row r: rowsum(dO_r * O_r), summed by the 32 lanes of a warp (every lane returns it).
template <typename T, typename Acc>
__device__ __forceinline__ Acc dsum_row(const BwdParams& p, const BwdSeq& s, int r, int lane) {
    const T* o_row = static_cast<const T*>(p.fwd.o) + s.f.o_off + (int64_t)r * p.fwd.o_row_stride;
    const T* do_row = static_cast<const T*>(p.dout) + s.do_off + (int64_t)r * p.do_row_stride;
    Acc acc = Acc(0);
    for (int c = lane; c < p.fwd.headdim; c += 32)
        acc += to_acc<T, Acc>(o_row[c]) * to_acc<T, Acc>(do_row[c]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    return acc;
}

template <typename T, typename Acc>
__global__ void __launch_bounds__(128)
bwd_dsum_entry(const __grid_constant__ BwdParams p) {
    const int b = blockIdx.z, h = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const BwdSeq s = bwd_seq(p, b, h);
    Acc* dsum = static_cast<Acc*>(p.dsum) + s.dsum_off;
    for (int r = blockIdx.x * kDsumRows + warp; r < min((int)(blockIdx.x + 1) * kDsumRows, s.f.seqlen_q);
         r += 4) {
        const Acc acc = dsum_row<T, Acc>(p, s, r, lane);
        if (lane == 0) dsum[r] = acc;
    }
}

}  // namespace cf
