// Thread-block clusters (sm_90+): the CTAs of a cluster run at the same time on one GPC and can
// read each other's shared memory ("distributed shared memory"). Thin inline-PTX wrappers (PTX
// ISA 7.8+, "Special registers: %cluster_ctarank, %cluster_nctarank", "barrier.cluster",
// "mapa", "ld" with the .shared::cluster state space).
//
// Launching: the cluster shape is given at launch time (cupyflash/launch.py: cuLaunchKernelEx
// with CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION); a kernel launched without it runs as clusters of
// one CTA (cluster_nctarank() == 1), so the same code serves both launches.
//
// Ordering: barrier.cluster.arrive.release + barrier.cluster.wait.acquire make every shared-
// memory write a thread did before the arrive visible to every thread of the cluster after its
// wait. A CTA's shared memory is released when the CTA exits, so a CTA whose shared memory other
// CTAs read must not exit before they are done: end with one more cluster_sync().
//
// Before sm_90 (no clusters) the same names compile: cluster_nctarank() is 1 and cluster_ctarank()
// 0, so code guarded by `cluster_nctarank() > 1` never runs; the other wrappers trap.
#pragma once
#include "dtype.cuh"

namespace cf {

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned cluster_ctarank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ unsigned cluster_nctarank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
    return r;
}

// Every thread of every CTA of the cluster arrives and waits (all threads must call it).
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The shared::cluster address of shared::cta address `smem_addr` in the CTA of rank `rank`.
__device__ __forceinline__ uint32_t map_shared_rank(uint32_t smem_addr, unsigned rank) {
    uint32_t r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_addr), "r"(rank));
    return r;
}

__device__ __forceinline__ float ld_shared_cluster_f32(uint32_t addr) {
    float x;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(x) : "r"(addr) : "memory");
    return x;
}

__device__ __forceinline__ float4 ld_shared_cluster_v4f32(uint32_t addr) {
    float4 x;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "r"(addr) : "memory");
    return x;
}
#else   // before sm_90: a launch has no clusters
__device__ __forceinline__ unsigned cluster_ctarank() { return 0; }
__device__ __forceinline__ unsigned cluster_nctarank() { return 1; }
__device__ __forceinline__ void cluster_sync() { __trap(); }
__device__ __forceinline__ uint32_t map_shared_rank(uint32_t, unsigned) { __trap(); return 0; }
__device__ __forceinline__ float ld_shared_cluster_f32(uint32_t) { __trap(); return 0.f; }
__device__ __forceinline__ float4 ld_shared_cluster_v4f32(uint32_t) {
    __trap();
    return make_float4(0.f, 0.f, 0.f, 0.f);
}
#endif

}  // namespace cf
