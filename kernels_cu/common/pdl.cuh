// Programmatic dependent launch (sm_90+; CUDA Programming Guide, "Programmatic Dependent Launch
// and Synchronization"; PTX ISA 7.8, "griddepcontrol").
//
// A kernel launched with programmatic stream serialization (cupyflash/core/launch.py, Launch with pdl)
// may start while the previous kernel of its stream is still running: once every block of that
// kernel has executed griddepcontrol.launch_dependents or exited. pdl_wait() (griddepcontrol.wait)
// returns once the previous grid has completed and its memory operations are visible, so every
// kernel that is launched so calls it before its first global load of anything another kernel may
// have written (q, the caches, cache_seqlens, block_table, the workspace). Launched plainly, there
// is no prerequisite grid and pdl_wait() returns at once.
//
// pdl_launch_dependents() lets the next kernel of the stream (if it was launched with the
// attribute) be scheduled: its blocks then take SM resources as this grid's blocks exit, and its
// launch and block set-up overlap this grid's tail. It carries no memory ordering (the next
// kernel's own pdl_wait gives that), so it may be called anywhere.
//
// Before sm_90 both are no-ops (such GPUs are never launched with the attribute).
#pragma once

namespace cf {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace cf
