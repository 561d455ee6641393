// One tile of prefill work -- BLOCK_M query rows of one (batch, head) -- as every forward kernel
// (and a backward pass) sees it: its sequence (lengths and offsets, varlen included), its first
// query row, the key tiles those rows visit, and where its rows live. The kernels of one CTA per
// tile (forward/mma.cu, forward/simt.cu) take theirs from the grid (fwd_tile_of_block, and the
// entry below); the persistent Hopper kernel (forward/hopper.cu) from its tile scheduler.
#pragma once
#include "params.cuh"
#include "mask.cuh"

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

template <int BLOCK_M, int BLOCK_N, bool CAUSAL>
struct FwdTile {
    FwdSeq seq;
    int m0, b, h;
    KeyTiles<BLOCK_N> tiles;
    int n_block_min, n_tiles;  // the key tiles [n_block_min, n_block_min + n_tiles)
    // TMA coordinates of the tile's copies (forward/hopper.cu): the rows of its first query and
    // of its sequence's key 0, and the batch entry (0 when varlen: cupyflash/core/tma.py maps the
    // packed tensors as one entry)
    int q_row, k_row, tma_b;

    __device__ __forceinline__ FwdTile(const FwdParams& p, int m_block, int h_, int b_)
        : seq(fwd_seq(p, b_, h_)), m0(m_block * BLOCK_M), b(b_), h(h_),
          tiles(m0, min(m0 + BLOCK_M, seq.seqlen_q) - 1, seq.seqlen_q, seq.seqlen_k, CAUSAL,
                p.window_left, p.window_right) {
        n_block_min = tiles.n_block_min;
        n_tiles = m0 < seq.seqlen_q ? tiles.n_block_max - tiles.n_block_min : 0;
        const bool varlen = p.cu_seqlens_q != nullptr;
        q_row = (varlen ? p.cu_seqlens_q[b] : 0) + m0;
        k_row = varlen ? p.cu_seqlens_k[b] : 0;
        tma_b = varlen ? 0 : b;
    }
    // No query row (m0 at or past the sequence's end): nothing to compute or write.
    __device__ __forceinline__ bool empty() const { return m0 >= seq.seqlen_q; }

    // The bases of the tile's (batch, head) in q, k, v, o and lse (written only if p.lse).
    template <typename T> __device__ __forceinline__ const T* q(const FwdParams& p) const {
        return static_cast<const T*>(p.q) + seq.q_off;
    }
    template <typename T> __device__ __forceinline__ const T* k(const FwdParams& p) const {
        return static_cast<const T*>(p.k) + seq.k_off;
    }
    template <typename T> __device__ __forceinline__ const T* v(const FwdParams& p) const {
        return static_cast<const T*>(p.v) + seq.v_off;
    }
    template <typename T> __device__ __forceinline__ T* o(const FwdParams& p) const {
        return static_cast<T*>(p.o) + seq.o_off;
    }
    __device__ __forceinline__ float* lse(const FwdParams& p) const { return p.lse + seq.lse_off; }
    // ... as L: float, or double for the float64 kernel (cupyflash.forward.kernels.lse_dtype)
    template <typename L> __device__ __forceinline__ L* lse_as(const FwdParams& p) const {
        return reinterpret_cast<L*>(p.lse) + seq.lse_off;
    }
};

// The tile of a CTA of the kernels of one CTA per tile: (m-block, head, batch) from the grid,
// the m-blocks in reverse when causal (the heaviest first).
template <int BLOCK_M, int BLOCK_N, bool CAUSAL>
__device__ __forceinline__ FwdTile<BLOCK_M, BLOCK_N, CAUSAL> fwd_tile_of_block(const FwdParams& p) {
    const int mb = CAUSAL ? (int)gridDim.x - 1 - (int)blockIdx.x : (int)blockIdx.x;
    return FwdTile<BLOCK_M, BLOCK_N, CAUSAL>(p, mb, blockIdx.y, blockIdx.z);
}

// The entry of the mma.sync and CUDA-core forward kernels: one CTA of Block's algorithm.
template <typename Block, typename T>
__global__ void __launch_bounds__(Block::kThreads, 1)
flash_fwd_entry(const __grid_constant__ FwdParams p) {
    Block::run(p);
}

}  // namespace cf
