"""Does compute-sanitizer's racecheck follow a producer/consumer hand-over through named barriers?

The Hopper prefill kernel hands each work tile's index from its producer warp to its consumer
warps through one shared-memory int: the producer writes it and arrives on a named barrier
(``bar.arrive``), the consumers sync on that barrier (``bar.sync``), read it and arrive on a
second barrier, on which the producer syncs before it writes again (FA3's scheduler does the
same). racecheck reports that read and write as hazards. This probe runs the bare pattern, one
shared int over 4 rounds between warp 0 (producer) and warp 1 (consumer), in three forms:

* ``arrive``: the kernel's pattern (bar.arrive / bar.sync on barriers 1 and 2);
* ``syncthreads``: the same rounds with two ``__syncthreads()`` per round (the control);
* ``mbarrier``: the hand-over through two mbarriers (arrive / try_wait.parity), the kernel's
  earlier form.

Each run checks the values the consumer read (a wrong value exits 1). Run it under racecheck:

    compute-sanitizer --tool racecheck python experiments/racecheck_probe.py arrive
    compute-sanitizer --tool racecheck python experiments/racecheck_probe.py syncthreads
    compute-sanitizer --tool racecheck python experiments/racecheck_probe.py mbarrier
"""
from __future__ import annotations

import argparse
import sys

SOURCE = r"""
extern "C" __global__ void handoff(int* out, int form) {
    __shared__ int slot;
    __shared__ __align__(8) unsigned long long bars[2];  // full, empty (form 2)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned full = (unsigned)__cvta_generic_to_shared(&bars[0]);
    const unsigned empty = (unsigned)__cvta_generic_to_shared(&bars[1]);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(full));
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(empty));
    }
    __syncthreads();
    for (int round = 0; round < 4; ++round) {
        const unsigned parity = round & 1;
        if (form == 1) {                       // __syncthreads on both sides
            if (warp == 0 && lane == 0) slot = round + 1;
            __syncthreads();
            if (warp == 1) out[round * 32 + lane] = slot;
            __syncthreads();
            continue;
        }
        if (warp == 0) {                       // producer
            if (form == 0) {
                if (round > 0) asm volatile("bar.sync 2, 64;" ::: "memory");
                if (lane == 0) slot = round + 1;
                asm volatile("bar.arrive 1, 64;" ::: "memory");
            } else {
                if (lane == 0) {
                    if (round > 0) {
                        asm volatile("{\n.reg .pred p;\nW1: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W1;\n}"
                                     :: "r"(empty), "r"(parity ^ 1u) : "memory");
                    }
                    slot = round + 1;
                    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(full) : "memory");
                }
                __syncwarp();
            }
        } else {                               // consumer
            if (form == 0) {
                asm volatile("bar.sync 1, 64;" ::: "memory");
                out[round * 32 + lane] = slot;
                if (round < 3) asm volatile("bar.arrive 2, 64;" ::: "memory");
            } else {
                asm volatile("{\n.reg .pred p;\nW2: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W2;\n}"
                             :: "r"(full), "r"(parity) : "memory");
                out[round * 32 + lane] = slot;
                __syncwarp();
                if (lane == 0 && round < 3)
                    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(empty) : "memory");
            }
        }
    }
}
"""
FORMS = {"arrive": 0, "syncthreads": 1, "mbarrier": 2}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("form", choices=sorted(FORMS))
    args = ap.parse_args(argv)
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no GPU here
        print(f"racecheck_probe: no CUDA GPU ({type(e).__name__}: {e})")
        return 0
    kern = cupy.RawKernel(SOURCE, "handoff", options=("--std=c++17",))
    out = cupy.full((4 * 32,), -1, dtype=cupy.int32)
    kern((1,), (64,), (out, cupy.int32(FORMS[args.form])))
    got = out.reshape(4, 32).get()
    ok = all((got[r] == r + 1).all() for r in range(4))
    print(f"racecheck_probe {args.form}: consumer read {got[:, 0].tolist()} -> {'ok' if ok else 'WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
