// The online-softmax step of one S tile held in wgmma accumulator registers (the m64nN f32
// D fragment, common/wgmma.cuh), of the Hopper prefill kernel's consumers (forward/hopper.cu).
// The arithmetic is common/online_softmax.cuh's SoftmaxRow.
#pragma once
#include "dtype.cuh"
#include "params.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "online_softmax.cuh"

namespace cf {

// The online-softmax step of one S tile for this thread's two rows (row0, row0 + 8): mask (on
// boundary tiles), row max over the quad, the state update, P = exp2((S - m) c) written over S
// in place (fp32), and the factor alpha that rescales the old O (the arithmetic:
// common/online_softmax.cuh, SoftmaxRow). wg_pack_p below packs P to 16 bits once the previous
// P V has completed (forward/hopper.cu: one P buffer, FA3's form).
template <int BLOCK_N, int NT, bool MASK>
__device__ __forceinline__ void wg_softmax_step(float (&s)[BLOCK_N / 2],
                                                SoftmaxRow<float> (&row)[2], float (&alpha)[2],
                                                int row0, int k0, int t, const FwdParams& p,
                                                int seqlen_q, int seqlen_k, bool causal,
                                                float scale_log2) {
    // s is written while the previous P V group is pending, which ptxas accepts only when every
    // path through the consumer's loop issues the same groups (the loop always issues Q K^T and
    // P V, the last P V is peeled off): with `if (has_next)` around the Q K^T it serialised the
    // wgmma pipeline (C7515; NOTES v55, v62).
    // The row max and row sum use kAcc independent partial results each (and both rows are
    // interleaved), so that they are not one chain of BLOCK_N / 4 dependent instructions:
    // with 2-3 consumer warps per scheduler nothing else would hide that latency.
    constexpr int kAcc = 2;
    int lo[2] = {0, 0}, hi[2] = {0, 0};  // visible: lo <= 8i + e < hi (MASK only)
    if constexpr (MASK) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            // (causal: a right window >= 0 cannot narrow the range, diag + window_right + 1 >=
            // diag + 1, so it is not passed: one upper bound per row, not one per window case)
            const KeyRange r = visible_keys(row0 + 8 * hh, seqlen_q, seqlen_k, causal,
                                            p.window_left, causal ? -1 : p.window_right);
            lo[hh] = r.lo - k0 - 2 * t;
            hi[hh] = r.hi - k0 - 2 * t;
        }
    }
    // A masked score is replaced, not added to: a key past a varlen sequence's end may hold NaN
    // or Inf (the next sequence's row), and its score must still become -inf (design.md, 5).
    auto score = [&](int i, int hh, int e) {
        const float x = s[4 * i + 2 * hh + e];
        if constexpr (MASK) return (8 * i + e >= lo[hh] && 8 * i + e < hi[hh]) ? x : -INFINITY;
        else return x;
    };
    float mp[2][kAcc];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int a = 0; a < kAcc; ++a) mp[hh][a] = -INFINITY;
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
            mp[hh][i % kAcc] = fmaxf(mp[hh][i % kAcc], fmaxf(score(i, hh, 0), score(i, hh, 1)));
    float ref[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        float mx = fmaxf(mp[hh][0], mp[hh][1]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));  // the 4 threads of a quad
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));  // hold one row
        alpha[hh] = row[hh].update(mx, scale_log2);
        ref[hh] = row[hh].ref();
    }
    float sp[2][kAcc];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int a = 0; a < kAcc; ++a) sp[hh][a] = 0.f;
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const float p0 = SoftmaxRow<float>::prob(score(i, hh, 0), ref[hh], scale_log2);
            const float p1 = SoftmaxRow<float>::prob(score(i, hh, 1), ref[hh], scale_log2);
            sp[hh][i % kAcc] += p0 + p1;
            s[4 * i + 2 * hh] = p0;
            s[4 * i + 2 * hh + 1] = p1;
        }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
        row[hh].l += sp[hh][0] + sp[hh][1];
}

// P (probabilities in the S accumulator's layout) packed to 16 bits as the A fragments of P V:
// keys 8i + 2t, +1 of row g + 8 hh -> A register (i & 1) * 2 + hh of k-step i / 2.
template <typename T, int BLOCK_N>
__device__ __forceinline__ void wg_pack_p(const float (&s)[BLOCK_N / 2], uint32_t (&pf)[BLOCK_N / 16][4]) {
#pragma unroll
    for (int i = 0; i < BLOCK_N / 8; ++i)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
            pf[i >> 1][(i & 1) * 2 + hh] = pack2<T>(s[4 * i + 2 * hh], s[4 * i + 2 * hh + 1]);
}

}  // namespace cf
