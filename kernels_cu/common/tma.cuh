// Tensor memory accelerator (TMA) copies (sm_90+; PTX ISA 8.0 "cp.async.bulk.tensor"; CUDA
// Programming Guide, "Asynchronous Data Copies using the Tensor Memory Accelerator").
//
// A tensor map (CUtensorMap, 128 bytes, built on the host by cuTensorMapEncodeTiled:
// cupyflash/core/tma.py) describes a strided tensor in global memory and the box one copy moves. One
// thread issues the copy of a whole box into shared memory; the TMA unit walks the rows,
// zero-fills the elements outside the tensor's bounds and, with the 128-byte swizzle, stores the
// 16-byte chunk c of the box's 128-byte row r at chunk c ^ (r % 8) of that row (the layout the
// wgmma descriptors of common/wgmma.cuh read; the destination is 1024-byte aligned). Completion
// is counted in bytes on an mbarrier (mbarrier_arrive_expect_tx, common/mbarrier.cuh): a thread
// that waits on the barrier's phase sees the box once all of it has landed. The bytes of a box
// are counted in full, zero-filled ones included.
#pragma once
#include "mbarrier.cuh"

namespace cf {

// The kernel parameter that carries a CUtensorMap (cuda.h's type is not visible to NVRTC; the
// layout is 16 opaque 64-bit words, 64-byte aligned). Passed as `const __grid_constant__`.
struct __align__(64) TmaDesc {
    unsigned long long words[16];
};

// Fetch the descriptor into the TMA unit's cache ahead of the first copy.
__device__ __forceinline__ void tma_prefetch_desc(const void* desc) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("prefetch.tensormap [%0];" :: "l"(desc) : "memory");
#endif
}

// Copies the box at coordinates (c0, c1, c2, c3) (innermost first, in elements) of the 4-D
// tensor map `desc` (the generic address of a __grid_constant__ parameter) to the shared address
// `dst`, its bytes completing on the mbarrier `bar`.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* desc, int c0, int c1,
                                            int c2, int c3, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];"
        :: "r"(dst), "l"(desc), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
#else
    __trap();
#endif
}

// Copies `bytes` (a multiple of 16) from the global address `src` (16-byte aligned) to the
// shared address `dst` (16-byte aligned), completing on the mbarrier `bar` (PTX ISA
// "cp.async.bulk", the non-tensor form: a contiguous run, no tensor map).
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes,
                                          uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
#else
    __trap();
#endif
}

// The reverse copy (PTX ISA "cp.async.bulk.tensor", .global.shared::cta): the box at
// coordinates (c0, c1, c2, c3) of `desc` written from the shared address `src` (laid out as a
// load of the same map would leave it: 128-byte swizzled, 1024-byte aligned). Elements outside
// the tensor's bounds are not written. The shared memory must have been written before by the
// generic proxy: every writing thread fence_proxy_async(), then a barrier, then one thread
// issues the store. Completion is tracked per thread in bulk groups: bulk_commit_group() closes
// the group of the thread's stores issued since its last commit.
__device__ __forceinline__ void tma_store_4d(const void* desc, uint32_t src, int c0, int c1,
                                             int c2, int c3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
        :: "l"(desc), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
#else
    __trap();
#endif
}

// Adds the `bytes` (a multiple of 16) of floats at the shared address `src` to those at the
// global address `dst` (both 16-byte aligned), element by element, in L2 (PTX ISA
// "cp.reduce.async.bulk", .add.f32): the reduction of a whole tile by one thread, tracked in
// its bulk groups. The shared memory must have been written before by the generic proxy: every
// writing thread fence_proxy_async(), then a barrier, then one thread issues it.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 :: "l"(dst), "r"(src), "r"(bytes) : "memory");
#else
    __trap();
#endif
}

__device__ __forceinline__ void bulk_commit_group() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#endif
}

// Waits until at most N of this thread's committed bulk groups have not yet READ their shared
// source (their global writes may still be in flight): the shared memory may then be rewritten.
template <int N>
__device__ __forceinline__ void bulk_wait_group_read() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
#endif
}

// Waits until at most N of this thread's committed bulk groups are incomplete (reads and
// writes done).
template <int N>
__device__ __forceinline__ void bulk_wait_group() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.wait_group %0;" :: "n"(N) : "memory");
#endif
}

// Warp-specialised kernels move registers between warpgroups (PTX ISA "setmaxnreg"): every warp
// of a warpgroup executes the same instruction; the count is a multiple of 8 in [24, 256].
template <int N>
__device__ __forceinline__ void warpgroup_reg_dealloc() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(N));
#endif
}

template <int N>
__device__ __forceinline__ void warpgroup_reg_alloc() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(N));
#endif
}

}  // namespace cf
