// Tensor memory accelerator (TMA) copies and the mbarriers that count their bytes (sm_90+;
// PTX ISA 8.0: "cp.async.bulk.tensor", "mbarrier", "fence.proxy.async"; CUDA Programming Guide,
// "Asynchronous Data Copies using the Tensor Memory Accelerator").
//
// A tensor map (CUtensorMap, 128 bytes, built on the host by cuTensorMapEncodeTiled:
// cupyflash/launch.py encode_tensor_map) describes a strided tensor in global memory and the
// box one copy moves. A single thread issues the copy of a whole box into shared memory; the
// TMA unit walks the rows, zero-fills the elements outside the tensor's bounds and, with the
// 128-byte swizzle, stores 16-byte chunk c of the box's 128-byte row r at chunk c ^ (r % 8) of
// that row (the destination must be 1024-byte aligned for this pattern). Completion is counted
// in bytes on an mbarrier: the issuing thread arms the barrier with the bytes it expects
// (arrive.expect_tx), and a thread that waits on the barrier's phase parity returns once they
// have all landed and are visible to it.
//
// The barrier itself (init, expect_tx arrival, wait) and the async-proxy fence are in mbarrier.cuh. Before sm_90
// these compile to traps: no launch path selects a TMA kernel there.
#pragma once

#include "mbarrier.cuh"

namespace cf {

// The kernel parameter that carries a CUtensorMap (the driver's type is not visible to NVRTC
// without cuda.h; the layout is 16 opaque 64-bit words, 64-byte aligned).
struct __align__(64) TmaDesc {
    unsigned long long words[16];
};

__device__ __forceinline__ void tma_prefetch_desc(const void* desc) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("prefetch.tensormap [%0];" :: "l"(desc) : "memory");
#endif
}

// Copies the box at coordinates (c0, c1, c2, c3) (innermost first, in elements) of the 4-D
// tensor map `desc` (a generic address of a __grid_constant__ parameter) to shared address
// `dst`, completing its bytes on the mbarrier `bar`.
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

}  // namespace cf
