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
// states (SoftmaxRow of common/online_softmax.cuh); pass 2 re-reads the row and writes
// P = exp2((s - m) * scale * log2(e)) / l, and 0 for masked keys. An empty row (nothing visible)
// gives P = 0 and LSE = -inf.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "common/params.cuh"
#include "common/mask.cuh"
#include "common/online_softmax.cuh"

namespace cf {

__device__ __forceinline__ void store_prob(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void store_prob(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void store_prob(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_prob(double* p, double x) { *p = x; }

// ScoreT: element type of S (float, or double for float64 inputs); ProbT: element type of P (the
// input dtype). Acc = ScoreT. kThreads: threads per block (a multiple of 32, at most 1024).
template <typename ScoreT, typename ProbT, int kThreads>
__global__ void __launch_bounds__(kThreads)
baseline_softmax_kernel(const __grid_constant__ BaselineSoftmaxParams prm) {
    using Acc = ScoreT;
    const ScoreT* __restrict__ S = static_cast<const ScoreT*>(prm.s);
    ProbT* __restrict__ P = static_cast<ProbT*>(prm.p);
    float* __restrict__ lse = prm.lse;
    const long long rows = prm.rows;
    const int seqlen_q = prm.seqlen_q, seqlen_k = prm.seqlen_k, causal = prm.causal;
    const int window_left = prm.window_left, window_right = prm.window_right;
    const double softmax_scale = prm.softmax_scale;
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

    // Pass 1: this thread's running max m and normaliser l over its keys, one key at a time.
    SoftmaxRow<Acc> st;
    st.init();
    for (int j = r.lo + threadIdx.x; j < r.hi; j += kThreads) {
        const Acc x = Acc(s_row[j]);
        st.update(x, scale_log2);
        st.l += SoftmaxRow<Acc>::prob(x, st.ref(), scale_log2);
    }
    // Merge across the warp, then across warps.
    for (int off = 16; off > 0; off >>= 1) {
        const Acc m_o = __shfl_xor_sync(0xffffffffu, st.m, off);
        const Acc l_o = __shfl_xor_sync(0xffffffffu, st.l, off);
        st.merge(m_o, l_o, scale_log2);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) { s_m[warp] = st.m; s_l[warp] = st.l; }
    __syncthreads();
    st.m = s_m[0];
    st.l = s_l[0];
    for (int w = 1; w < kWarps; ++w) st.merge(s_m[w], s_l[w], scale_log2);

    if (threadIdx.x == 0) lse[row] = float(st.lse(st.l, scale_log2));

    // Pass 2: P = exp2((s - m) c) / l for visible keys, 0 elsewhere (every element written).
    const Acc inv_l = SoftmaxRow<Acc>::inv_l(st.l);
    const Acc ref = st.ref();
    for (int j = threadIdx.x; j < seqlen_k; j += kThreads) {
        Acc pj = Acc(0);
        if (key_visible(r, j)) pj = SoftmaxRow<Acc>::prob(Acc(s_row[j]), ref, scale_log2) * inv_l;
        store_prob(p_row + j, pj);
    }
}

}  // namespace cf
