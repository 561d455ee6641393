// The softmax step of the materialising baseline (FlashAttention arXiv 2205.14135, Algorithm 0):
// S = Q K^T has been written to device memory by a GEMM (cupyflash/baseline.py); this kernel
// reads each row of S, applies the scale and the causal / sliding-window mask, writes
// P = softmax(S) in the input dtype and the row's LSE, and the next GEMM computes O = P V.
// It exists to be compared with the fused kernel: its S and P round-trips through HBM are the
// O(S^2) traffic that FlashAttention removes.
//
// One thread block per row of S. Rows are ordered (batch, kv head, group member, query), which
// for nheads = nheads_k * group and head h = kv_head * group + member is exactly (batch, head,
// query): the query index of row r is r % seqlen_q and the LSE of row r goes to lse[r], the
// (batch, nheads, seqlen_q) layout of the flash kernels.
//
// Pass 1 keeps a per-thread online (max, sum) over the row's visible keys and merges the threads'
// states (the update of common/online_softmax.cuh); pass 2 re-reads the row and writes
// P = exp2(s * scale * log2(e) - m) / l, and 0 for masked keys. An empty row (nothing visible)
// gives P = 0 and LSE = -inf.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "common/mask.cuh"
#include "common/online_softmax.cuh"

namespace cf {

__device__ __forceinline__ void store_prob(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void store_prob(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void store_prob(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_prob(double* p, double x) { *p = x; }

// Merge (m_b, l_b) into (m_a, l_a): running max and normaliser of the union of two key sets.
template <typename Acc>
__device__ __forceinline__ void merge_state(Acc& m_a, Acc& l_a, Acc m_b, Acc l_b) {
    const Acc m_new = m_a > m_b ? m_a : m_b;
    l_a = l_a * rescale_factor<Acc>(m_a, m_new) + l_b * rescale_factor<Acc>(m_b, m_new);
    m_a = m_new;
}

// ScoreT: element type of S (float, or double for float64 inputs); ProbT: element type of P (the
// input dtype). Acc = ScoreT. kThreads: threads per block (a multiple of 32, at most 1024).
template <typename ScoreT, typename ProbT, int kThreads>
__global__ void __launch_bounds__(kThreads)
baseline_softmax_kernel(const ScoreT* __restrict__ S, ProbT* __restrict__ P, float* __restrict__ lse,
                        long long rows, int seqlen_q, int seqlen_k, int causal,
                        int window_left, int window_right, double softmax_scale) {
    using Acc = ScoreT;
    constexpr int kWarps = kThreads / 32;
    __shared__ Acc s_m[kWarps];
    __shared__ Acc s_l[kWarps];

    const long long row = blockIdx.x;
    if (row >= rows) return;
    const ScoreT* s_row = S + row * (long long)seqlen_k;
    ProbT* p_row = P + row * (long long)seqlen_k;
    const int i = (int)(row % seqlen_q);
    const KeyRange r = visible_keys(i, seqlen_q, seqlen_k, causal != 0, window_left, window_right);
    const Acc scale_log2 = Acc(softmax_scale * 1.4426950408889634073599246810018921);

    // Pass 1: this thread's running max m and normaliser l = sum exp2(x - m) over its keys.
    Acc m = neg_inf<Acc>(), l = Acc(0);
    for (int j = r.lo + threadIdx.x; j < r.hi; j += kThreads) {
        const Acc x = Acc(s_row[j]) * scale_log2;
        if (x > m) {
            l = l * rescale_factor<Acc>(m, x) + Acc(1);
            m = x;
        } else {
            l += prob<Acc>(x, m);
        }
    }
    // Merge across the warp, then across warps.
    for (int off = 16; off > 0; off >>= 1) {
        const Acc m_o = __shfl_xor_sync(0xffffffffu, m, off);
        const Acc l_o = __shfl_xor_sync(0xffffffffu, l, off);
        merge_state<Acc>(m, l, m_o, l_o);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) { s_m[warp] = m; s_l[warp] = l; }
    __syncthreads();
    m = s_m[0];
    l = s_l[0];
    for (int w = 1; w < kWarps; ++w) merge_state<Acc>(m, l, s_m[w], s_l[w]);

    if (threadIdx.x == 0) lse[row] = float(lse_from<Acc>(m, l));

    // Pass 2: P = exp2(x - m) / l for visible keys, 0 elsewhere (every element written).
    const Acc inv_l = inv_normaliser<Acc>(l);
    for (int j = threadIdx.x; j < seqlen_k; j += kThreads) {
        Acc pj = Acc(0);
        if (key_visible(r, j)) pj = prob<Acc>(Acc(s_row[j]) * scale_log2, m) * inv_l;
        store_prob(p_row + j, pj);
    }
}

}  // namespace cf
