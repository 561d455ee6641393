// The online-softmax update, in one place (FlashAttention arXiv 2205.14135 Sec. 3.1;
// FlashAttention-2 arXiv 2307.08691 Sec. 3.1: unscaled accumulator, normalised once at the end).
//
// State per query row: running max m (scores in the log2 domain, i.e. already multiplied by
// softmax_scale * log2(e)), normaliser l = sum exp2(s - m), accumulator acc = sum exp2(s - m) v.
// A new block with row max m_blk: m_new = max(m, m_blk); acc and l are multiplied by
// exp2(m - m_new) before the block's terms are added.
// An empty row keeps m = -inf, l = 0: output 0, LSE = -inf (never NaN).
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

// Reference point for exponentials: -inf (nothing visible yet) is replaced by 0 so that
// exp2(-inf - ref) = 0 instead of exp2(-inf + inf) = NaN.
template <typename T>
__device__ __forceinline__ T safe_max(T m) { return m == neg_inf<T>() ? T(0) : m; }

// Factor that rescales the old (acc, l) when the running max moves from m_old to m_new.
template <typename T>
__device__ __forceinline__ T rescale_factor(T m_old, T m_new) {
    return exp2_<T>(m_old - safe_max(m_new));  // m_old = -inf gives 0 (acc and l are 0 anyway)
}

// exp2(s - m) for one score against the (new) running max.
template <typename T>
__device__ __forceinline__ T prob(T s, T m) { return exp2_<T>(s - safe_max(m)); }

// exp2(s_raw * scale_log2 - m_ref) with the scale folded into one fused multiply-add
// (FlashAttention-2, Sec. 3.1): s_raw is the unscaled score q.k, scale_log2 = softmax_scale *
// log2(e), and m_ref = safe_max(m) is the row's reference point, computed once per row.
template <typename T> __device__ __forceinline__ T fma_(T a, T b, T c);
template <> __device__ __forceinline__ float fma_<float>(float a, float b, float c) { return fmaf(a, b, c); }
template <> __device__ __forceinline__ double fma_<double>(double a, double b, double c) { return fma(a, b, c); }

template <typename T>
__device__ __forceinline__ T prob_fma(T s_raw, T scale_log2, T m_ref) {
    return exp2_<T>(fma_<T>(s_raw, scale_log2, -m_ref));
}

// Natural-log LSE of the row from its log2-domain max and normaliser; -inf for an empty row.
template <typename T>
__device__ __forceinline__ T lse_from(T m_log2, T l) {
    const T ln2 = T(0.693147180559945309417232121458176568);
    return l == T(0) ? neg_inf<T>() : m_log2 * ln2 + log_<T>(l);
}

// 1 / l for the final normalisation; 0 for an empty row so the output is 0.
template <typename T>
__device__ __forceinline__ T inv_normaliser(T l) { return l == T(0) ? T(0) : T(1) / l; }

// Merge of two partial states (o normalised, lse natural log): the combine step of split-KV
// decoding (Flash-Decoding) and of cascade attention. merge(x, (0, -inf)) = x.
template <typename T>
__device__ __forceinline__ T merge_weight(T lse_part, T lse_max) {
    return lse_part == neg_inf<T>() ? T(0) : exp(lse_part - lse_max);
}

}  // namespace cf
