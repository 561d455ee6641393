// The work of one CTA of the prefill forward kernels of one CTA per (m-block, head, batch)
// (forward/mma.cu, forward/simt.cu), and their entry.
#pragma once
#include "params.cuh"
#include "sequence.cuh"
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

// The entry of the mma.sync and CUDA-core forward kernels: one CTA of Block's algorithm.
template <typename Block, typename T>
__global__ void __launch_bounds__(Block::kThreads, 1)
flash_fwd_entry(const __grid_constant__ FwdParams p) {
    Block::run(p);
}

}  // namespace cf
