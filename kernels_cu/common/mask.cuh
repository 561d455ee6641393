// The one definition of which keys a query row may see (design.md, "Semantics" 1, 2, 5).
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

}  // namespace cf
