// The one kernel entry of the prefill forward family. Its plain scalar / pointer arguments are the
// host-device ABI: cupyflash/forward/kernels.py (kernel_args / args_template) passes them in this order.
// They are packed into FwdParams here, once, and handed to Block::run, the tiled algorithm of one
// CTA: the tensor-core block (forward/mma.cu) or the CUDA-core block (forward/simt.cu).
#pragma once
#include "params.cuh"
#include "mask.cuh"

namespace cf {

// The work of one CTA of a prefill block: its (m-block, head, batch) from the grid (causal
// launches visit the m-blocks in reverse, heaviest first), its sequence (lengths and offsets,
// varlen included), its first query row m0, the q/k/v/o/lse bases of that (batch, head) and the
// key tiles its BLOCK_M rows visit. A CTA with m0 >= seq.seqlen_q has no rows (returns at once).
template <typename T, int BLOCK_M, int BLOCK_N, bool CAUSAL>
struct FwdCta {
    FwdSeq seq;
    int m0;
    const T* q;
    const T* k;
    const T* v;
    T* o;
    float* lse;
    KeyTiles<BLOCK_N> tiles;

    __device__ __forceinline__ explicit FwdCta(const FwdParams& p)
        : seq(fwd_seq(p, blockIdx.z, blockIdx.y)),
          m0((CAUSAL ? (int)gridDim.x - 1 - (int)blockIdx.x : (int)blockIdx.x) * BLOCK_M),
          q(static_cast<const T*>(p.q) + seq.q_off),
          k(static_cast<const T*>(p.k) + seq.k_off),
          v(static_cast<const T*>(p.v) + seq.v_off),
          o(static_cast<T*>(p.o) + seq.o_off),
          lse(p.lse + seq.lse_off),  // written only if p.lse != nullptr (return_lse)
          tiles(m0, min(m0 + BLOCK_M, seq.seqlen_q) - 1, seq.seqlen_q, seq.seqlen_k, CAUSAL,
                p.window_left, p.window_right) {}

    __device__ __forceinline__ bool empty() const { return m0 >= seq.seqlen_q; }
};

// The entry's argument list (the host-device ABI, in order) and its packing into FwdParams,
// shared by flash_fwd_entry below and the TMA entry of forward/hopper.cu (which takes three
// tensor maps before them).
#define CF_FWD_ENTRY_PARAMS(T)                                                                    \
    const T* q, const T* k, const T* v, T* o, float* lse,                                         \
    int64_t q_batch_stride, int64_t q_row_stride, int64_t q_head_stride,                          \
    int64_t k_batch_stride, int64_t k_row_stride, int64_t k_head_stride,                          \
    int64_t v_batch_stride, int64_t v_row_stride, int64_t v_head_stride,                          \
    int64_t o_batch_stride, int64_t o_row_stride, int64_t o_head_stride,                          \
    int64_t lse_batch_stride, int64_t lse_head_stride,                                            \
    const int* cu_seqlens_q, const int* cu_seqlens_k,                                             \
    int batch, int nheads, int nheads_k, int h_per_kv, int seqlen_q, int seqlen_k,                \
    int headdim, float scale_log2, double softmax_scale_d, int window_left, int window_right

#define CF_FWD_ENTRY_PACK(p)                                                                      \
    p.q = q; p.k = k; p.v = v; p.o = o; p.lse = lse;                                              \
    p.q_batch_stride = q_batch_stride; p.q_row_stride = q_row_stride; p.q_head_stride = q_head_stride; \
    p.k_batch_stride = k_batch_stride; p.k_row_stride = k_row_stride; p.k_head_stride = k_head_stride; \
    p.v_batch_stride = v_batch_stride; p.v_row_stride = v_row_stride; p.v_head_stride = v_head_stride; \
    p.o_batch_stride = o_batch_stride; p.o_row_stride = o_row_stride; p.o_head_stride = o_head_stride; \
    p.lse_batch_stride = lse_batch_stride; p.lse_head_stride = lse_head_stride;                   \
    p.cu_seqlens_q = cu_seqlens_q; p.cu_seqlens_k = cu_seqlens_k;                                 \
    p.batch = batch; p.nheads = nheads; p.nheads_k = nheads_k; p.h_per_kv = h_per_kv;             \
    p.seqlen_q = seqlen_q; p.seqlen_k = seqlen_k; p.headdim = headdim;                            \
    p.scale_log2 = scale_log2; p.softmax_scale_d = softmax_scale_d;                               \
    p.window_left = window_left; p.window_right = window_right

template <typename Block, typename T>
__global__ void __launch_bounds__(Block::kThreads, 1)
flash_fwd_entry(CF_FWD_ENTRY_PARAMS(T)) {
    FwdParams p;
    CF_FWD_ENTRY_PACK(p);
    Block::run(p);
}

}  // namespace cf
