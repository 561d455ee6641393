// KV append of the decode call (cupyflash/decode/__init__.py, flash_attn_with_kvcache with k and v):
// cache[b, cache_seqlens[b] + i, h, :] = new[b, i, h, :] (paged: through block_table), in place,
// before the split kernel (decode/split.cu) runs. Raw element copy (E = uint16_t for fp16/bf16).
// Positions past the capacity and page ids outside the pool are skipped (validate=True reports
// them: host data before the launch, device data through the check below).
// grid (ceil(seqlen_new * nheads_k * headdim / 256), batch), block 256. Waits (common/pdl.cuh)
// before its first global load: decode.py launches it as a programmatic dependent launch on
// sm_90+. With `check_claim` (validate=True, device metadata) warp 0 of each sequence's first
// block checks its length and page ids first (common/kvcache_check.cuh; the split kernel after
// it then does not).
#include "common/dtype.cuh"
#include "common/params.cuh"
#include "common/pdl.cuh"
#include "common/kvcache_check.cuh"

namespace cf {

template <typename E, bool PAGED>
__global__ void __launch_bounds__(256)
decode_append_kernel(const __grid_constant__ DecodeAppendParams p) {
    pdl_wait();  // common/pdl.cuh
    pdl_launch_dependents();
    const E* k_new = static_cast<const E*>(p.k_new);
    const E* v_new = static_cast<const E*>(p.v_new);
    E* k_cache = static_cast<E*>(p.k_cache);
    E* v_cache = static_cast<E*>(p.v_cache);
    const int* cache_seqlens = p.cache_seqlens;
    const int* block_table = p.block_table;
    const long long kn_bs = p.kn_batch_stride, kn_rs = p.kn_row_stride, kn_hs = p.kn_head_stride;
    const long long vn_bs = p.vn_batch_stride, vn_rs = p.vn_row_stride, vn_hs = p.vn_head_stride;
    const long long k_bs = p.k_batch_stride, k_rs = p.k_row_stride, k_hs = p.k_head_stride;
    const long long v_bs = p.v_batch_stride, v_rs = p.v_row_stride, v_hs = p.v_head_stride;
    const long long bt_bs = p.block_table_batch_stride;
    const int seqlen_new = p.seqlen_new, nheads_k = p.nheads_k, headdim = p.headdim;
    const int seqlen_cache = p.seqlen_cache, page_size = p.page_size, num_pages = p.num_pages;
    int* check_claim = p.check_claim;
    int* check_record = p.check_record;
    const int b = blockIdx.y;
    if (check_claim != nullptr && blockIdx.x == 0 && threadIdx.x < 32)
        check_kvcache_sequence(KvCheck{check_claim, check_record}, b, cache_seqlens[b],
                               PAGED ? block_table + b * bt_bs : nullptr, seqlen_new,
                               seqlen_cache, page_size, num_pages);
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (long long)seqlen_new * nheads_k * headdim) return;
    const int c = (int)(e % headdim);
    const int h = (int)((e / headdim) % nheads_k);
    const int i = (int)(e / ((long long)headdim * nheads_k));
    const int pos = cache_seqlens[b] + i;
    if (pos < 0 || pos >= seqlen_cache) return;
    long long kdst, vdst;
    if constexpr (PAGED) {
        const int page = block_table[b * bt_bs + pos / page_size];
        if (page < 0 || page >= num_pages) return;
        const int in_page = pos % page_size;
        kdst = page * k_bs + in_page * k_rs + h * k_hs + c;
        vdst = page * v_bs + in_page * v_rs + h * v_hs + c;
    } else {
        kdst = b * k_bs + (long long)pos * k_rs + h * k_hs + c;
        vdst = b * v_bs + (long long)pos * v_rs + h * v_hs + c;
    }
    k_cache[kdst] = k_new[b * kn_bs + i * kn_rs + h * kn_hs + c];
    v_cache[vdst] = v_new[b * vn_bs + i * vn_rs + h * vn_hs + c];
}

}  // namespace cf
