// A ring of shared-memory tiles filled by TMA and drained by tensor-core warps (FlashAttention-3,
// Shah et al., arXiv 2407.08608, Sec. 3.1; CUTLASS's PipelineTmaAsync): slot s has a "full"
// mbarrier (one producer arrival that expects the tile's bytes, completed by the copies) and an
// "empty" one (one arrival per consumer warp once its reads are done). Producer and consumers
// walk the ring with a PipelineState each.
//
// Parity (PTX ISA, mbarrier.try_wait.parity): the k-th completion of a barrier's phase, counted
// from 0, has parity k & 1, and a wait for parity P returns once the phase of parity P has
// completed; a barrier that has just been initialised is in its first phase (parity 0), and a
// wait for parity 1 -- "the phase before" -- returns at once. So the consumers start waiting
// for parity 0 of the full barriers, the producer for parity 1 of the empty ones: its first
// round over the free ring needs no special case.
#pragma once
#include "dtype.cuh"
#include "mbarrier.cuh"

namespace cf {

// A position in a ring of STAGES slots: the slot and the parity of its current use.
template <int STAGES>
struct PipelineState {
    int slot;
    uint32_t phase;
    __device__ __forceinline__ void advance() {
        if (STAGES == 1 || ++slot == STAGES) {
            slot = 0;
            phase ^= 1u;
        }
    }
};

template <int STAGES>
__device__ __forceinline__ PipelineState<STAGES> consumer_start() { return {0, 0u}; }
template <int STAGES>
__device__ __forceinline__ PipelineState<STAGES> producer_start() { return {0, 1u}; }

// The barriers of one ring: STAGES full barriers from `full0`, STAGES empty ones from `empty0`
// (shared addresses, 8 bytes each).
template <int STAGES>
struct MbarRing {
    uint32_t full0, empty0;

    __device__ __forceinline__ uint32_t full(int slot) const { return full0 + 8u * (uint32_t)slot; }
    __device__ __forceinline__ uint32_t empty(int slot) const { return empty0 + 8u * (uint32_t)slot; }

    // One thread, before any use (then fence_proxy_async and a CTA barrier).
    __device__ __forceinline__ void init(uint32_t consumer_arrivals) const {
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(full(s), 1);
            mbarrier_init(empty(s), consumer_arrivals);
        }
    }
    // Producer: wait until the consumers released the slot's previous tile.
    __device__ __forceinline__ void producer_acquire(const PipelineState<STAGES>& st) const {
        mbarrier_wait(empty(st.slot), st.phase);
    }
    // Producer (one thread): the slot's tile will be `bytes` of asynchronous copies that
    // complete on full(slot).
    __device__ __forceinline__ void producer_expect(const PipelineState<STAGES>& st,
                                                    uint32_t bytes) const {
        mbarrier_arrive_expect_tx(full(st.slot), bytes);
    }
    // Consumer: wait until the slot's tile has landed.
    __device__ __forceinline__ void consumer_wait(const PipelineState<STAGES>& st) const {
        mbarrier_wait(full(st.slot), st.phase);
    }
    // Consumer warp (one lane arrives: the reads that came before, wgmma waits included, are
    // warp-synchronous): the warp is done with the slot's tile.
    __device__ __forceinline__ void consumer_release(const PipelineState<STAGES>& st,
                                                     int lane) const {
        if (lane == 0) mbarrier_arrive(empty(st.slot));
    }
};

}  // namespace cf
