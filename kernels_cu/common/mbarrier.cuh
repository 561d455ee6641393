// mbarriers and the async-proxy fence (sm_90; PTX ISA 8.0, "mbarrier", "fence.proxy.async") of
// the Hopper prefill kernel's Q tile and K/V rings (forward/hopper.cu). CTA scope
// throughout. Before sm_90 the sm_90-only instructions compile to traps.
#pragma once

namespace cf {

// Generic-proxy shared-memory accesses (st.shared, ld.shared) before -> ordered with the async
// proxy's (TMA writes, wgmma reads) after.
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#else
    __trap();
#endif
}

// The same for this thread's accesses in every state space (global memory too: the backward's
// bulk reductions into dq_accum against the turn counters' acquire and release).
__device__ __forceinline__ void fence_proxy_async_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async;\n" ::: "memory");
#else
    __trap();
#endif
}

// ---- mbarrier (PTX ISA 9.7.13.15) ------------------------------------------------------------
__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}

// One arrival of this thread.
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" :: "r"(bar) : "memory");
}

// One arrival of this thread that also tells the barrier to expect `bytes` more bytes of
// asynchronous copies (TMA, common/tma.cuh) in the current phase: the phase completes once every
// arrival and every expected byte has landed.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n"
                 :: "r"(bar), "r"(bytes) : "memory");
#else
    __trap();
#endif
}

// Wait until the phase with parity `parity` of the barrier has completed (the k-th completion,
// counted from 0, has parity k & 1). Memory operations of the arriving threads before their
// arrival (and, for cp.async arrivals, the copies) are visible to this thread afterwards.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
#else
    __trap();
#endif
}

}  // namespace cf
