// The online-softmax step of one tile of scores held in m16n8 accumulator fragments: the one step
// of every tensor-core kernel (forward/hopper.cu's wgmma accumulators, forward/mma.cu's and
// decode/split.cu's mma.sync ones), so a change to the softmax is one edit here. The arithmetic
// is common/online_softmax.cuh's SoftmaxRow; the CUDA-core kernel (forward/simt.cu) keeps its
// own layout.
//
// Layout: 16 rows by 8 NT columns. With lane = %laneid, g = lane >> 2 and t = lane & 3, this
// thread holds rows g and g + 8 (hh = 0, 1): s[4 i + 2 hh + e] is the score of row g + 8 hh and
// column 8 i + 2 t + e (e = 0, 1) -- the mma.sync m16n8 C fragment repeated over i, which is
// also the wgmma m64nN accumulator of one warp (common/wgmma.cuh). The four threads of a quad
// (same g) hold one row.
#pragma once
#include "dtype.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "online_softmax.cuh"

namespace cf {

// The columns of a tile this thread's rows see: for row hh, columns c with
// lo[hh] <= 8 i + e < hi[hh] (c = 8 i + 2 t + e, the tile's first key k0).
struct TileBounds {
    int lo[2], hi[2];
};

// Bounds of rows row0 and row0 + 8 against keys [k0, k0 + 8 NT) from each row's visible range.
__device__ __forceinline__ TileBounds tile_bounds(const KeyRange (&range)[2], int k0, int t) {
    TileBounds b;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        b.lo[hh] = range[hh].lo - k0 - 2 * t;
        b.hi[hh] = range[hh].hi - k0 - 2 * t;
    }
    return b;
}

// The mask alone, in place: scores outside the bounds become -inf (for a kernel that masks
// before a step without MASK, as forward/mma.cu does: one copy of the step in its loop).
template <int NT>
__device__ __forceinline__ void mask_scores(float (&s)[4 * NT], const TileBounds& b) {
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                if (!(8 * i + e >= b.lo[hh] && 8 * i + e < b.hi[hh])) s[4 * i + 2 * hh + e] = -INFINITY;
}

// The step, for this thread's two rows: with MASK, scores outside the bounds become -inf (a
// replacement, not an addition: a key past a varlen sequence's end may hold NaN or Inf, and its
// score must still be -inf; docs/semantics.md, 5); then the row max over the quad, the state
// update (alpha: the factor that rescales the old accumulator), P = exp2((S - m) c), handed to
// `sink(i, hh, p0, p1)` (columns 8 i + 2 t, +1 of row hh), and l += the row sum of P.
// The row max and row sum use ACC independent partial results each (both rows interleaved), so
// that they are not one chain of NT dependent instructions: with 2-3 warps per scheduler (the
// Hopper kernel) nothing else would hide that latency; a kernel short of registers takes 1.
template <int NT, bool MASK, int ACC, typename Sink>
__device__ __forceinline__ void softmax_tile_step(const float (&s)[4 * NT],
                                                  SoftmaxRow<float> (&row)[2], float (&alpha)[2],
                                                  const TileBounds& b, float scale_log2,
                                                  Sink&& sink) {
    constexpr int kAcc = ACC;
    static_assert(ACC == 1 || ACC == 2, "one or two partial results");
    auto score = [&](int i, int hh, int e) {
        const float x = s[4 * i + 2 * hh + e];
        if constexpr (MASK) return (8 * i + e >= b.lo[hh] && 8 * i + e < b.hi[hh]) ? x : -INFINITY;
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
        float mx = kAcc > 1 ? fmaxf(mp[hh][0], mp[hh][kAcc - 1]) : mp[hh][0];
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
            sink(i, hh, p0, p1);
        }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
        row[hh].l += kAcc > 1 ? sp[hh][0] + sp[hh][kAcc - 1] : sp[hh][0];
}

// The step with P written over S in place (fp32; forward/hopper.cu packs it once the previous
// P V is done).
template <int NT, bool MASK, int ACC = 2>
__device__ __forceinline__ void softmax_tile_step(float (&s)[4 * NT], SoftmaxRow<float> (&row)[2],
                                                  float (&alpha)[2], const TileBounds& b,
                                                  float scale_log2) {
    softmax_tile_step<NT, MASK, ACC>(s, row, alpha, b, scale_log2,
                                     [&](int i, int hh, float p0, float p1) {
                                         s[4 * i + 2 * hh] = p0;
                                         s[4 * i + 2 * hh + 1] = p1;
                                     });
}

// The step with P packed to 16 bits at once as the A fragments of P V (pack_p below).
template <typename T, int NT, bool MASK, int ACC = 2>
__device__ __forceinline__ void softmax_tile_step_packed(const float (&s)[4 * NT],
                                                         SoftmaxRow<float> (&row)[2],
                                                         float (&alpha)[2], const TileBounds& b,
                                                         float scale_log2,
                                                         uint32_t (&pf)[NT / 2][4]) {
    softmax_tile_step<NT, MASK, ACC>(s, row, alpha, b, scale_log2,
                                     [&](int i, int hh, float p0, float p1) {
                                         pf[i >> 1][(i & 1) * 2 + hh] = pack2<T>(p0, p1);
                                     });
}

// P (probabilities in the score layout) packed to 16 bits as the A fragments of P V: columns
// 8 i + 2 t, +1 of row g + 8 hh -> A register (i & 1) * 2 + hh of k-step i / 2 (common/mma.cuh:
// the C fragments of two adjacent n8 tiles are the A fragment of the 16x16 block they form).
template <typename T, int NT>
__device__ __forceinline__ void pack_p(const float (&s)[4 * NT], uint32_t (&pf)[NT / 2][4]) {
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
            pf[i >> 1][(i & 1) * 2 + hh] = pack2<T>(s[4 * i + 2 * hh], s[4 * i + 2 * hh + 1]);
}

// The accumulator (16 rows by 8 DT columns, the score layout) rescaled by each row's alpha.
template <int DT>
__device__ __forceinline__ void rescale_rows(float (&o)[4 * DT], const float (&alpha)[2]) {
#pragma unroll
    for (int d = 0; d < DT; ++d) {
        o[4 * d + 0] *= alpha[0];
        o[4 * d + 1] *= alpha[0];
        o[4 * d + 2] *= alpha[1];
        o[4 * d + 3] *= alpha[1];
    }
}

// The end of a row: this thread's share of its l summed over the quad (the row's whole sum: its
// LSE is SoftmaxRow::lse(l, c), and SoftmaxRow::inv_l(l) normalises its output).
__device__ __forceinline__ float quad_sum(float l) {
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    return l;
}

// Row hh of this thread's part of a normalised output tile written from registers to `dst`
// (the row's first element): columns 8 d + 2 t, +1 below `ncols`, scaled by `inv`.
template <typename T, int DT>
__device__ __forceinline__ void store_row(const float (&o)[4 * DT], int hh, float inv, T* dst,
                                          int t, int ncols) {
#pragma unroll
    for (int d = 0; d < DT; ++d) {
        const int col = d * 8 + 2 * t;
        if (col < ncols)
            *reinterpret_cast<uint32_t*>(dst + col) =
                pack2<T>(o[4 * d + 2 * hh] * inv, o[4 * d + 2 * hh + 1] * inv);
    }
}

}  // namespace cf
