// The one definition of which keys a query row may see (docs/semantics.md, 1, 2, 5).
#pragma once

namespace cf {

// Bottom-right alignment: shift = seqlen_k - seqlen_q. Causal is window_right = 0.
// Returns the half-open key range [lo, hi) visible to query row `row` (may be empty: lo >= hi).
struct KeyRange { int lo, hi; };

__device__ __forceinline__ KeyRange visible_keys(int row, int seqlen_q, int seqlen_k, bool causal,
                                                 int window_left, int window_right) {
    const int diag = row + seqlen_k - seqlen_q;
    int lo = 0, hi = seqlen_k;
    if (causal) hi = min(hi, diag + 1);
    if (window_right >= 0) hi = min(hi, diag + window_right + 1);
    if (window_left >= 0) lo = max(lo, diag - window_left);
    return KeyRange{lo, hi};
}

__device__ __forceinline__ bool key_visible(const KeyRange& r, int key) {
    return key >= r.lo && key < r.hi;
}

// The same relation seen from a key: the half-open range [lo, hi) of query rows that see key
// `key` (empty for a key past seqlen_k; rows past seqlen_q are the caller's). Row i sees the key
// iff visible_keys(i) holds it: key < i + shift + 1 (causal), key <= i + shift + window_right,
// key >= i + shift - window_left.
__device__ __forceinline__ KeyRange visible_queries(int key, int seqlen_q, int seqlen_k,
                                                   bool causal, int window_left,
                                                   int window_right) {
    const int diag = key - (seqlen_k - seqlen_q);  // the row whose diagonal is this key
    int lo = -0x7fffffff - 1, hi = 0x7fffffff;  // (no <climits> under NVRTC)
    if (causal) lo = diag;
    if (window_right >= 0) lo = max(lo, diag - window_right);
    if (window_left >= 0) hi = diag + window_left + 1;
    if (key >= seqlen_k) lo = hi = 0;
    return KeyRange{lo, hi};
}

// The key tiles a block of query rows [row_first, row_last] must visit (FlashAttention-2 skips
// the others: loop bounds, not masks). visible_keys(i).lo and .hi are non-decreasing in i, so
// the union of the rows' ranges is [lo(row_first), hi(row_last)), and a tile [n0, n0 + BLOCK_N)
// lies inside every row's range (needs no mask) iff n0 >= lo(row_last) and
// n0 + BLOCK_N <= hi(row_first). Tiles [n_block_min, n_block_max); empty when no row sees a key.
template <int BLOCK_N>
struct KeyTiles {
    int n_block_min, n_block_max;
    int lo_last, hi_first;

    __device__ __forceinline__ KeyTiles(int row_first, int row_last, int seqlen_q, int seqlen_k,
                                        bool causal, int window_left, int window_right) {
        const KeyRange first = visible_keys(row_first, seqlen_q, seqlen_k, causal, window_left, window_right);
        const KeyRange last = visible_keys(row_last, seqlen_q, seqlen_k, causal, window_left, window_right);
        const int lo = max(first.lo, 0), hi = min(last.hi, seqlen_k);
        n_block_min = lo / BLOCK_N;
        n_block_max = hi > lo ? (hi + BLOCK_N - 1) / BLOCK_N : n_block_min;
        lo_last = last.lo;
        hi_first = first.hi;
    }

    __device__ __forceinline__ bool needs_mask(int n_block) const {
        const int n0 = n_block * BLOCK_N;
        return !(n0 >= lo_last && n0 + BLOCK_N <= hi_first);
    }
};

}  // namespace cf
