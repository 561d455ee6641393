// Warp-level tensor-core and asynchronous-copy primitives (sm_80+), as thin inline-PTX wrappers.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type" and
// "Warp-level matrix load instruction: ldmatrix"). With lane = %laneid, g = lane >> 2 (groupID)
// and t = lane & 3 (threadID_in_group):
//   A (16x16, row-major, four .b32 = eight 16-bit values):
//     a[0] = A[g    ][2t, 2t+1]     a[1] = A[g + 8][2t, 2t+1]
//     a[2] = A[g    ][2t+8, 2t+9]   a[3] = A[g + 8][2t+8, 2t+9]
//   B (16x8, "col" = stored as B^T row-major, i.e. n-major; two .b32):
//     b[0] = B[2t, 2t+1][g]         b[1] = B[2t+8, 2t+9][g]
//   C/D (16x8 f32, four floats):
//     c[0], c[1] = C[g][2t, 2t+1]   c[2], c[3] = C[g + 8][2t, 2t+1]
//   The lower-indexed element of a 16-bit pair sits in the low half of its .b32 register.
// Consequence used by FlashAttention-2: the C fragments of two adjacent n8 tiles (columns
// 0-7 and 8-15) are, after rounding pairs to 16 bits, exactly the A fragment of the 16x16
// block they form: a[0] = pack(c0[0], c0[1]), a[1] = pack(c0[2], c0[3]),
// a[2] = pack(c1[0], c1[1]), a[3] = pack(c1[2], c1[3]). So P = softmax(S) never leaves registers.
//
// ldmatrix.m8n8.x4.b16: lanes 8i..8i+7 give the 16-byte-aligned row addresses of matrix i
// (row r of matrix i from lane 8i + r); register i of every lane receives matrix i's
// element pair [g][2t, 2t+1]. With .trans the matrix is read transposed: register i receives
// the pair [2t][g], [2t+1][g] of the stored 8x8 matrix.
//
// cp.async.cg.shared.global [dst], [src], 16, src_size: copies src_size bytes (0 or 16 here) and
// zero-fills the rest of the 16 bytes; with src_size = 0 nothing is read from global memory.
#pragma once
#include "dtype.cuh"

namespace cf {

__device__ __forceinline__ uint32_t smem_u32addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- ldmatrix -----------------------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr));
}

// ---- mma.sync m16n8k16, f32 accumulate: d = a * b + d ----------------------------------------
template <typename T> struct MmaOp;

template <> struct MmaOp<__half> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4],
                                               uint32_t b0, uint32_t b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

template <> struct MmaOp<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4],
                                               uint32_t b0, uint32_t b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    MmaOp<T>::run(d, a, b0, b1);
}

// ---- float pair -> packed 16-bit pair (x in the low half), round to nearest even --------------
template <typename T> __device__ __forceinline__ uint32_t pack2(float x, float y);

template <> __device__ __forceinline__ uint32_t pack2<__half>(float x, float y) {
    __half2 h = __floats2half2_rn(x, y);  // .x = x is the low half
    return *reinterpret_cast<uint32_t*>(&h);
}

template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float x, float y) {
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&h);
}

// ---- cp.async (16 bytes, L2 only: .cg) with zero-fill ---------------------------------------
// valid = false copies nothing (src_size 0) and writes 16 zero bytes; `src` must still be a
// valid address (callers pass the tensor base), though no byte of it is read.
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* src, bool valid) {
    const int src_size = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr), "l"(src), "r"(src_size)
                 : "memory");
}

// 4-byte cp.async (sizes below 16 exist only in the L1-allocating .ca form); no zero-fill.
__device__ __forceinline__ void cp_async_4(uint32_t smem_addr, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" :: "r"(smem_addr), "l"(src)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until at most N of this thread's committed groups are still in flight (groups complete
// in commit order). A __syncthreads() must follow before other threads' copies are read.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

}  // namespace cf
