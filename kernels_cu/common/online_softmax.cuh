// The online softmax, in one place: every kernel that updates or merges a softmax state does it
// with the functions below (FlashAttention arXiv 2205.14135 Sec. 3.1; FlashAttention-2 arXiv
// 2307.08691 Sec. 3.1: unscaled accumulator, normalised once at the end). A kernel keeps its own
// fragment layout (which thread holds which scores, and the shuffles that reduce a row); the
// arithmetic is here. The NumPy counterpart is cupyflash/reference.py: online_softmax_update.
//
// State of one query row, in raw-score units (s = q.k, before softmax_scale):
//   m   running max of the raw scores seen so far (-inf: none visible yet),
//   l   sum over those keys of exp2((s - m) * c), c = softmax_scale * log2(e),
//   acc sum of exp2((s - m) * c) v (the kernel's registers; rescaled by the factor update() gives).
// A tile of scores with row max mx: m_new = max(m, mx); the old l and acc are multiplied by
// exp2((m - m_new) * c); each score contributes p = exp2((s - m_new) * c).
//
// Why the difference is taken before the scale (s - m, then * c), and not as one
// fma(s, c, -m * c): the key with the row's max gets p = exp2(0) = 1 exactly, and every other
// p lies in [0, 1], at any finite magnitude. With the fused form, m * c is rounded to a float
// whose error grows with |m| (a few thousand at |s c| ~ 1e10), and p of the max key becomes
// exp2(that error): 0 or inf in fp16/bf16/fp32, so a single visible key returned 0 or NaN. The
// difference s - m is also exact when s and m are close (Sterbenz), so adding a constant to every
// score changes no probability. Cost: one FADD and one FMUL per score where the fused form has
// one FFMA.
//
// An empty row keeps m = -inf, l = 0: output 0, LSE = -inf (never NaN). -inf is replaced by 0 as
// the reference point of the exponentials, so that (-inf) - (-inf) = NaN never appears.
#pragma once
// <cstdint>/<cmath> under nvcc; NVRTC has no standard headers (see dtype.cuh)
#include "dtype.cuh"

namespace cf {

template <typename T> __device__ __forceinline__ T exp2_(T x);
template <> __device__ __forceinline__ float exp2_<float>(float x) { return exp2f(x); }
template <> __device__ __forceinline__ double exp2_<double>(double x) { return exp2(x); }
template <typename T> __device__ __forceinline__ T log_(T x);
template <> __device__ __forceinline__ float log_<float>(float x) { return logf(x); }
template <> __device__ __forceinline__ double log_<double>(double x) { return log(x); }
template <typename T> __device__ __forceinline__ T neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return -INFINITY; }
template <> __device__ __forceinline__ double neg_inf<double>() { return -(double)INFINITY; }
template <typename T> __device__ __forceinline__ T fma_(T a, T b, T c);
template <> __device__ __forceinline__ float fma_<float>(float a, float b, float c) { return fmaf(a, b, c); }
template <> __device__ __forceinline__ double fma_<double>(double a, double b, double c) { return fma(a, b, c); }
template <typename T> __device__ __forceinline__ T max_(T a, T b) { return a > b ? a : b; }
template <> __device__ __forceinline__ float max_<float>(float a, float b) { return fmaxf(a, b); }

// The reference point of the exponentials for a running max m: m, or 0 while m = -inf.
template <typename T>
__device__ __forceinline__ T softmax_ref(T m) { return m == neg_inf<T>() ? T(0) : m; }

// exp2((x - ref) * c): a probability (x a score, ref the row's reference point), the factor that
// moves a state from one max to a larger one (x the old max), or a merge weight (x a part's LSE,
// c = log2(e)). In [0, 1] whenever x <= ref; x = -inf gives 0.
template <typename T>
__device__ __forceinline__ T softmax_weight(T x, T ref, T c) { return exp2_<T>((x - ref) * c); }

// Per-row state (m, l). l may be one thread's share of the row (the threads of a row add their
// shares once, at the end: the kernel's shuffles); m is the same in every thread of the row.
template <typename T>
struct SoftmaxRow {
    T m, l;

    __device__ __forceinline__ void init() { m = neg_inf<T>(); l = T(0); }

    // Step 1 of a tile: fold in the tile's row max mx (raw; -inf when the tile shows the row no
    // key). Returns the factor alpha by which the caller multiplies its accumulator; l is
    // rescaled here. Afterwards ref() is the reference point of this tile's probabilities.
    __device__ __forceinline__ T update(T mx, T c) {
        const T m_new = max_<T>(m, mx);
        const T alpha = softmax_weight<T>(m, softmax_ref(m_new), c);  // m = -inf: 0 (l, acc are 0)
        m = m_new;
        l *= alpha;
        return alpha;
    }
    __device__ __forceinline__ T ref() const { return softmax_ref(m); }
    // Step 2: p = exp2((s - m) * c) for each score of the tile (ref = ref(), hoisted by the
    // caller out of its loop over scores); the caller adds p V to acc and the row sum of p to l.
    static __device__ __forceinline__ T prob(T s, T ref, T c) { return softmax_weight<T>(s, ref, c); }

    // Merge another share (m_o, l_o) of the same row, over other keys, into this one (the
    // accumulators, if any, are scaled by merge_factor(m_x, m, c) of each side).
    __device__ __forceinline__ void merge(T m_o, T l_o, T c) {
        const T m_new = max_<T>(m, m_o);
        const T ref = softmax_ref(m_new);
        l = l * softmax_weight<T>(m, ref, c) + l_o * softmax_weight<T>(m_o, ref, c);
        m = m_new;
    }

    // Finalisation, with l the whole row's sum: 1 / l (0 for an empty row, so the output is 0),
    // and the natural-log LSE m * softmax_scale + ln l (-inf for an empty row).
    static __device__ __forceinline__ T inv_l(T l_row) { return l_row == T(0) ? T(0) : T(1) / l_row; }
    __device__ __forceinline__ T lse(T l_row, T c) const {
        const T ln2 = T(0.693147180559945309417232121458176568);
        return l_row == T(0) ? neg_inf<T>() : fma_<T>(m * c, ln2, log_<T>(l_row));
    }
};

// Merge of two unnormalised states of one row over disjoint keys, (m_a, l_a, acc_a) and
// (m_b, l_b, acc_b): m = max(m_a, m_b), l = f_a l_a + f_b l_b, acc = f_a acc_a + f_b acc_b.
// merge_factor gives f_x for a part with max m_x against the merged max m.
template <typename T>
__device__ __forceinline__ T merge_factor(T m_x, T m, T c) {
    return softmax_weight<T>(m_x, softmax_ref(m), c);
}

// Merge of normalised partial states (o_i, lse_i natural log), the combine of Flash-Decoding and
// of cascade attention: this is the online softmax over "keys" with score lse_i and value o_i
// (c = log2(e)), so o = sum w_i o_i / sum w_i, w_i = exp(lse_i - lse_max), lse = lse_max +
// ln(sum w_i). A part with lse = -inf has weight 0 and its o is never read:
// merge(x, (0, -inf)) = x; merging only empty parts gives (0, -inf).
constexpr float kLog2e = 1.44269504088896340736f;
__device__ __forceinline__ float lse_weight(float lse_part, float lse_max) {
    return lse_part == neg_inf<float>() ? 0.f : softmax_weight<float>(lse_part, softmax_ref(lse_max), kLog2e);
}
// The merged LSE from the parts' max and the sum of their weights (-inf when every part is empty).
__device__ __forceinline__ float merged_lse(float lse_max, float wsum) {
    return wsum == 0.f ? neg_inf<float>() : lse_max + logf(wsum);
}

// Merges fold a batch of N parts at a time: the batch's max first, then each part's weight
// independently (no dependent chain of exponentials through a running max), then one rescale of
// the running state. Parts past n and empty parts are masked by selects, so the N weights are
// computed back to back without a branch per part (v11-v12).
template <int N> struct MergeBatch { static constexpr int kN = N; };

// The merge of unnormalised partial states of one row over disjoint keys, for 4 output columns:
// the split kernel's partials (decode/split.cu), each its raw row max m_u (score units, before
// softmax_scale), its sum l_u = sum exp2((s - m_u) c) and its unnormalised accumulator acc_u.
// This is the online softmax one level up -- weights exp2((m_u - m) c), the difference taken
// before the scale (see above) -- so it is exact at any score magnitude: a float32 LSE per part
// (the merge of (o, lse) pairs this replaced on 2026-12-02) rounds ln l_u away once |LSE| reaches
// ~1e6 (an ulp of 0.06; 1 at 1e7), and with it the relative weight of two parts that share the
// row's max (experiments/NOTES.md v75). Batches of N parts (MergeBatch). Result: o = acc / l;
// LSE = SoftmaxRow{m, l}.lse(l, c).
struct PartialMerge4 {
    float m, l, acc[4];
    __device__ __forceinline__ void init() {
        m = neg_inf<float>();
        l = 0.f;
        acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
    }
    // ml[u] = (m_u, l_u) of part u < n; a part with m_u = -inf saw no key (its acc is unused)
    template <int N>
    __device__ __forceinline__ void add_batch(const float2 (&ml)[N], const float4 (&o)[N], int n,
                                              float c) {
        static_assert(N % 4 == 0, "batch: a multiple of 4 (four max chains)");
        float m0 = neg_inf<float>(), m1 = m0, m2 = m0, m3 = m0;  // four independent max chains
#pragma unroll
        for (int u = 0; u < N; u += 4) {
            m0 = fmaxf(m0, u < n ? ml[u].x : neg_inf<float>());
            m1 = fmaxf(m1, u + 1 < n ? ml[u + 1].x : neg_inf<float>());
            m2 = fmaxf(m2, u + 2 < n ? ml[u + 2].x : neg_inf<float>());
            m3 = fmaxf(m3, u + 3 < n ? ml[u + 3].x : neg_inf<float>());
        }
        const float mb = fmaxf(fmaxf(m0, m1), fmaxf(m2, m3));
        if (mb == neg_inf<float>()) return;  // every part of the batch is empty
        const float m_new = fmaxf(m, mb);
        const float ref = softmax_ref(m_new);
        const float f = softmax_weight<float>(m, ref, c);  // m = -inf (first batch): 0
        float lb = 0.f, a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll
        for (int u = 0; u < N; ++u) {
            const bool ok = u < n && ml[u].x != neg_inf<float>();
            const float wt = softmax_weight<float>(ok ? ml[u].x : neg_inf<float>(), ref, c);
            lb = ok ? fmaf(ml[u].y, wt, lb) : lb;
            a0 = ok ? fmaf(wt, o[u].x, a0) : a0;
            a1 = ok ? fmaf(wt, o[u].y, a1) : a1;
            a2 = ok ? fmaf(wt, o[u].z, a2) : a2;
            a3 = ok ? fmaf(wt, o[u].w, a3) : a3;
        }
        l = fmaf(l, f, lb);
        acc[0] = fmaf(acc[0], f, a0);
        acc[1] = fmaf(acc[1], f, a1);
        acc[2] = fmaf(acc[2], f, a2);
        acc[3] = fmaf(acc[3], f, a3);
        m = m_new;
    }
};

}  // namespace cf
