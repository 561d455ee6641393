// Exact merge of partial attention states (the combine step of Flash-Decoding: Dao, Haziza,
// Massa, Sizov, "Flash-Decoding for long-context inference", 2023; also cascade and distributed
// attention): the kernel of the public merge_states (cupyflash/decode/__init__.py). The split kernel
// (decode/split.cu) merges its own splits (fused combine) and does not launch this one.
//
// out = sum_s w_s o_s / sum_s w_s, w_s = exp(lse_s - max_s lse_s), LSE = max + log(sum w)
// (natural log; merge(x, (0, -inf)) = x: empty parts get weight 0 and their o, which may hold
// NaN, never reaches the result). One warp per output row (b, i, h). The max and the sum run with
// the lanes over the parts (one load each per 32 parts, shuffle reductions); then every lane
// accumulates up to kMaxCols columns (c = lane + 32 k) over the parts, 8 parts per unrolled step,
// so about 2 + parts / 8 dependent L2 round trips per row instead of ~3 per part.
// Strides in elements: o_part (part, batch, row, head) with the head dim contiguous, lse_part
// (part, batch, head, row). Waits (common/pdl.cuh) before its first global load, like the other
// decode kernels, though decode.py launches it plainly.
#include "common/dtype.cuh"
#include "common/params.cuh"
#include "common/online_softmax.cuh"
#include "common/pdl.cuh"

namespace cf {

template <typename T>
__global__ void __launch_bounds__(128)
decode_combine_kernel(const __grid_constant__ MergeParams p) {
    constexpr int kMaxCols = 8;  // headdim <= 256
    const float* o_part = p.o_part;
    const float* lse_part = p.lse_part;
    T* out = static_cast<T*>(p.out);
    float* lse_out = p.lse_out;
    const long long op_ps = p.op_part_stride, op_bs = p.op_batch_stride;
    const long long op_rs = p.op_row_stride, op_hs = p.op_head_stride;
    const long long lp_ps = p.lp_part_stride, lp_bs = p.lp_batch_stride;
    const long long lp_hs = p.lp_head_stride, lp_rs = p.lp_row_stride;
    const long long o_bs = p.o_batch_stride, o_rs = p.o_row_stride, o_hs = p.o_head_stride;
    const long long lse_bs = p.lse_batch_stride, lse_hs = p.lse_head_stride;
    const int num_parts = p.num_parts, batch = p.batch, seqlen = p.seqlen, nheads = p.nheads;
    const int headdim = p.headdim;
    pdl_wait();  // common/pdl.cuh
    pdl_launch_dependents();
    const int lane = threadIdx.x % 32;
    const long long rid = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (rid >= (long long)batch * seqlen * nheads) return;  // whole warps
    const int h = (int)(rid % nheads);
    const int i = (int)((rid / nheads) % seqlen);
    const int b = (int)(rid / ((long long)nheads * seqlen));
    const float* lp = lse_part + b * lp_bs + h * lp_hs + i * lp_rs;
    const float* op = o_part + b * op_bs + i * op_rs + h * op_hs;

    float lse_max = neg_inf<float>();
    for (int s = lane; s < num_parts; s += 32) lse_max = fmaxf(lse_max, lp[s * lp_ps]);
#pragma unroll
    for (int x = 16; x >= 1; x >>= 1) lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffffu, lse_max, x));
    float wsum = 0.f;
    for (int s = lane; s < num_parts; s += 32) wsum += lse_weight(lp[s * lp_ps], lse_max);
#pragma unroll
    for (int x = 16; x >= 1; x >>= 1) wsum += __shfl_xor_sync(0xffffffffu, wsum, x);
    const float inv = SoftmaxRow<float>::inv_l(wsum);  // all parts empty: output 0

    float acc[kMaxCols];
#pragma unroll
    for (int k = 0; k < kMaxCols; ++k) acc[k] = 0.f;
#pragma unroll 8
    for (int s = 0; s < num_parts; ++s) {
        const float ls = lp[s * lp_ps];
        const float w = lse_weight(ls, lse_max);
        const bool empty = ls == neg_inf<float>();
#pragma unroll
        for (int k = 0; k < kMaxCols; ++k) {
            const int c = lane + 32 * k;
            if (c < headdim) {
                const float o = op[s * op_ps + c];
                acc[k] += empty ? 0.f : w * o;
            }
        }
    }
    T* orow = out + b * o_bs + i * o_rs + h * o_hs;
#pragma unroll
    for (int k = 0; k < kMaxCols; ++k) {
        const int c = lane + 32 * k;
        if (c < headdim) orow[c] = from_float<T>(acc[k] * inv);
    }
    if (lane == 0 && lse_out != nullptr)
        lse_out[b * lse_bs + h * lse_hs + i] = merged_lse(lse_max, wsum);
}

}  // namespace cf
