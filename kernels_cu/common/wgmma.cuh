// Warpgroup-level tensor-core primitives of Hopper (sm_90a only), as thin inline-PTX wrappers.
//
// wgmma.mma_async (PTX ISA 9.7.15): a warpgroup (4 consecutive warps, the first one's index a
// multiple of 4) computes D(64 x N, f32) (+)= A(64 x 16) * B(16 x N) asynchronously. B always comes
// from shared memory through a 64-bit matrix descriptor; A from shared memory (descriptor) or from
// registers. Ordering rules used by the kernels:
//   * wgmma_fence() before the first wgmma of a batch and whenever the accumulator or A registers
//     were written by ordinary instructions since the previous wgmma;
//   * wgmma_commit() closes a group; wgmma_wait<N>() waits until at most N groups are pending;
//     the accumulators and the A registers of a pending group must not be read or written;
//   * shared memory written through the generic proxy (cp.async, st.shared) must be made visible
//     to the async proxy that wgmma reads through: fence_proxy_async() in the writing or waiting
//     thread, then a barrier, then the wgmma.
//
// Register fragments (PTX ISA "Register Fragments and Shared Memory Matrix Layouts" for wgmma
// .m64nNk16): warp w of the warpgroup owns rows 16w .. 16w + 15. With lane = %laneid,
// g = lane >> 2, t = lane & 3:
//   D (f32, N/2 registers): d[4i + 0], d[4i + 1] = D[g][8i + 2t, +1];  d[4i + 2], d[4i + 3] = D[g + 8][8i + 2t, +1]
//     (the mma.sync m16n8 C fragment, repeated for every 8 columns i);
//   A in registers (four .b32, 16-bit pairs): the mma.sync m16n8k16 A fragment (common/mma.cuh).
// So, exactly as with mma.sync, the S accumulator of keys 16k .. 16k + 15 packed to 16 bits is
// the A fragment of P for k-step k: a = {pack(d[8k], d[8k+1]), pack(d[8k+2], d[8k+3]),
// pack(d[8k+4], d[8k+5]), pack(d[8k+6], d[8k+7])}.
//
// Shared-memory layout (128-byte swizzle, PTX ISA "Shared Memory Matrix Layout"): a tile of R rows
// of 64 16-bit elements (128 bytes per row) stored row after row, where the 16-byte chunk c of row
// r sits at chunk position c ^ (r & 7); a 1024-byte aligned base (the pattern repeats every 8 rows,
// and the hardware applies the XOR to address bits, so the base must start a repeat). Head dims
// of 128 are two such tiles, [HEADDIM / 64][R][64].
//   K-major operand (Q as A, K as B of S = Q K^T: the 16 elements of one k-step are contiguous):
//     stride byte offset (SBO) = 1024 (8 rows to the next 8 rows), leading byte offset unused (1);
//     k-step s of a 64-wide tile starts 32 s bytes into the row.
//   MN-major operand (V as B of O = P V: the N = head-dim elements are contiguous): leading byte
//     offset (LBO) = distance between 64-element column tiles (R * 128 bytes), SBO = 1024 between
//     groups of 8 keys; k-step s (keys 16 s .. 16 s + 15) starts 16 * 128 s bytes in.
#pragma once
#include "dtype.cuh"
#include "mbarrier.cuh"

namespace cf {

// Matrix descriptor: start address, LBO, SBO (bytes, encoded >> 4 in 14 bits), base offset 0,
// swizzle mode 1 = 128-byte (bits 62-63).
__device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t smem_addr, uint32_t lbo, uint32_t sbo) {
    uint64_t d = 0;
    d |= (uint64_t)((smem_addr & 0x3FFFFu) >> 4);
    d |= (uint64_t)((lbo & 0x3FFFFu) >> 4) << 16;
    d |= (uint64_t)((sbo & 0x3FFFFu) >> 4) << 32;
    d |= (uint64_t)1 << 62;
    return d;
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}

// ---- named barriers (bar.sync / bar.arrive with an id and a thread count) -------------------
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

// Keeps the compiler from moving reads / writes of an accumulator register across a wgmma
// issue or wait (the asm statements that use it asynchronously are opaque to it).
template <int N>
__device__ __forceinline__ void wgmma_fence_operand(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

template <int N>
__device__ __forceinline__ void wgmma_fence_operand(uint32_t (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[i][e]) :: "memory");
}

// wgmma.mma_async m64nNk16 with f32 accumulators for one 16-bit input type T and one N:
//   ss:    D(64xN) (+)= A(64x16, smem, K-major) * B(16xN, smem, K-major); scale_d = 0: D = A*B;
//   rs_tn: D(64xN) (+)= A(64x16, registers, mma.m16n8k16 A-fragment order per warp) *
//          B(16xN, smem, MN-major: imm-trans-b = 1); scale_d as above.
//   ss_tn: D(64xN) (+)= A(64x16, smem, K-major) * B(16xN, smem, MN-major: imm-trans-b = 1) (the
//          backward's dV += P^T dO and dK += dS^T Q at hd256, P^T and dS^T from shared memory);
//   ss_tt: D(64xN) (+)= A(64x16, smem, MN-major: imm-trans-a = 1) * B(16xN, smem, MN-major:
//          imm-trans-b = 1) (the backward's dQ = dS K from dS^T and K as stored).
template <typename T, int N> struct Wgmma;

// One macro per N (the register lists differ), instantiated for both 16-bit input types; each
// N has the forms the TMA kernels use. N = 64: O += P V at hd64 (rs_tn); the backward's S^T = K Q^T,
// dP^T = V dO^T at hd128 (ss), dV, dK at hd64 (rs_tn) and dQ (ss_tt).
#define CF_WGMMA_M64N64K16(T, PTX_T) \
template <> struct Wgmma<T, 64> { \
    static constexpr int kAcc = 32; \
    static __device__ __forceinline__ void rs_tn(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) { \
        asm volatile( \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX_T "." PTX_T " " \
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
            "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d)); \
    } \
    /* TRANS = 1: both operands MN-major (imm-trans-a = imm-trans-b = 1) */ \
    template <int TRANS> \
    static __device__ __forceinline__ void ss_t(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d) { \
        asm volatile( \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX_T "." PTX_T " " \
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
            "%32, %33, p, 1, 1, %35, %35;\n}\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
            : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS)); \
    } \
    static __device__ __forceinline__ void ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d) { \
        ss_t<0>(d, desc_a, desc_b, scale_d); \
    } \
    static __device__ __forceinline__ void ss_tt(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d) { \
        ss_t<1>(d, desc_a, desc_b, scale_d); \
    } \
};

// N = 128: S = Q K^T of 128-key tiles and the backward's S^T, dP^T at hd64 (ss), O += P V at
// hd128 and, in two halves, hd256, the backward's dV, dK at hd128 (rs_tn) and, per half of the
// head dim, at hd256 (ss_tn).
#define CF_WGMMA_M64N128K16(T, PTX_T) \
template <> struct Wgmma<T, 128> { \
    static constexpr int kAcc = 64; \
    /* TRANS_B = 1: B MN-major (imm-trans-b = 1); A K-major */ \
    template <int TRANS_B> \
    static __device__ __forceinline__ void ss_t(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) { \
        asm volatile( \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_T "." PTX_T " " \
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
            "%64, %65, p, 1, 1, 0, %67;\n}\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
              "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
              "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
              "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
              "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
            : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_B)); \
    } \
    static __device__ __forceinline__ void ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) { \
        ss_t<0>(d, desc_a, desc_b, scale_d); \
    } \
    static __device__ __forceinline__ void ss_tn(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) { \
        ss_t<1>(d, desc_a, desc_b, scale_d); \
    } \
    static __device__ __forceinline__ void rs_tn(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) { \
        asm volatile( \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_T "." PTX_T " " \
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
            "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
              "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
              "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
              "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
              "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d)); \
    } \
};

// N = 80: S = Q K^T of hd256's 80-key tiles (FA3's; ss only).
#define CF_WGMMA_M64N80K16(T, PTX_T) \
template <> struct Wgmma<T, 80> { \
    static constexpr int kAcc = 40; \
    static __device__ __forceinline__ void ss(float (&d)[40], uint64_t desc_a, uint64_t desc_b, int scale_d) { \
        asm volatile( \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n80k16.f32." PTX_T "." PTX_T " " \
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, " \
            "%40, %41, p, 1, 1, 0, 0;\n}\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
              "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]) \
            : "l"(desc_a), "l"(desc_b), "r"(scale_d)); \
    } \
};

// N = 32: the backward's S^T, dP^T at hd256 (64 keys x each consumer warpgroup's 32 queries; ss).
#define CF_WGMMA_M64N32K16(T, PTX_T) \
template <> struct Wgmma<T, 32> { \
    static constexpr int kAcc = 16; \
    static __device__ __forceinline__ void ss(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int scale_d) { \
        asm volatile( \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n32k16.f32." PTX_T "." PTX_T " " \
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, " \
            "%16, %17, p, 1, 1, 0, 0;\n}\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) \
            : "l"(desc_a), "l"(desc_b), "r"(scale_d)); \
    } \
};

CF_WGMMA_M64N32K16(__nv_bfloat16, "bf16")
CF_WGMMA_M64N32K16(__half, "f16")
CF_WGMMA_M64N64K16(__nv_bfloat16, "bf16")
CF_WGMMA_M64N64K16(__half, "f16")
CF_WGMMA_M64N128K16(__nv_bfloat16, "bf16")
CF_WGMMA_M64N128K16(__half, "f16")
CF_WGMMA_M64N80K16(__nv_bfloat16, "bf16")
CF_WGMMA_M64N80K16(__half, "f16")
#undef CF_WGMMA_M64N32K16
#undef CF_WGMMA_M64N64K16
#undef CF_WGMMA_M64N128K16
#undef CF_WGMMA_M64N80K16

}  // namespace cf
