"""What a decode call costs when it streams (almost) nothing, alone after the L2 flush (NOTES v41).

    PYTHONPATH=. python experiments/probe_fixed_cost.py [--out DIR] [--batches 16 64]

The short calls trail cuDNN by 1-2.6 us after a flush while matching it back to back (v40), and
that gap does not grow with the cache length: a fixed cost per call. This probe times, each alone
after the read flush (``common.benchmark(flush_l2=True)``, median of 30), at Llama-3-8B heads
(32 query, 8 KV heads, hd128, bf16):

* ``null``: an empty kernel with our grid's block count and size, without and with our
  split kernel's dynamic shared memory (the launch floor of such blocks);
* ``ours``: the public call over a cache of 1024 keys at lengths 0 (prologue and epilogue only:
  the length is read, nothing is copied), 1, 128 and 1024;
* ``ours`` without any length (``cache_seqlens=None`` over a view of 128 / 1024 keys), launched
  without programmatic dependent launch, and the default tile as an experiment variant: as
  launched, with the Q tile by 2-byte loads (the defaults before ``FLAG_Q_ASYNC``, v44), and
  with the speculative prologue (``FLAG_SPEC_KV``: the first tiles copied before the length
  lands; with 2-byte Q loads, which it requires);
* ``cuDNN``: torch SDPA over 128 and 1024 keys (no lengths: it reads every key; it has no
  kernel for one key).

Records go to ``$OUT/probe_fixed_cost.jsonl`` (or --out).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

_NULL_SRC = r"""
extern "C" __global__ void cupyflash_null(int* sink) {
    extern __shared__ int smem[];
    if (threadIdx.x == 1023) smem[0] = sink[0];  // never true at 256 threads; keeps the smem
}
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get(
        "OUT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")))
    ap.add_argument("--batches", nargs="+", type=int, default=[16, 64])
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args(argv)
    import cupy as cp
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common
    import cupyflash
    import cupyflash.decode

    H, HK, D, CAP = 32, 8, 128, 1024
    prov = common.provenance()
    rng = cp.random.default_rng(11)
    path = os.path.join(args.out, "probe_fixed_cost.jsonl")
    os.makedirs(args.out, exist_ok=True)

    def timed(fn):
        return common.benchmark(fn, n_warmup=3, n_repeat=30, flush_l2=True)["ms"] * 1e3

    def record(B, what, n_keys, us, **kw):
        common.append_jsonl(path, dict(probe="fixed_cost", what=what, batch=B, n_keys=n_keys,
                                       nheads=H, nheads_k=HK, headdim=D, us_flushed=us, **kw,
                                       **prov))
        print(f"B={B:3d} {what:28s} keys {n_keys:5d}: {us:7.2f} us flushed", flush=True)

    null = cp.RawKernel(_NULL_SRC, "cupyflash_null")
    sink = cp.zeros(1, cp.int32)
    for B in args.batches:
        q, kc, vc, cs_full = common.llama_decode_inputs(rng, B, CAP, H, HK, D)
        from cupyflash import checks
        la = cupyflash.decode.launch_config(checks.check_kvcache(q, kc, vc, cache_seqlens=cs_full))
        threads = int(np.prod(la.block))
        blocks = int(np.prod(la.grid))
        smem = la.smem_bytes
        for sm in (0, smem):
            null.max_dynamic_shared_size_bytes = max(sm, 0)
            fn = lambda sm=sm: null((blocks,), (threads,), (sink,), shared_mem=sm)  # noqa: E731
            record(B, f"null {blocks}x{threads} smem {sm}", 0, timed(fn), blocks=blocks,
                   threads=threads, smem=sm)
        out = cp.empty_like(q)
        for n in (0, 1, 128, CAP):
            cs = cp.full((B,), n, cp.int32)
            ws = cupyflash.decode.alloc_workspace(q, kc, vc, cache_seqlens=cs)
            fn = lambda cs=cs, ws=ws: cupyflash.flash_attn_with_kvcache(  # noqa: E731
                q, kc, vc, cache_seqlens=cs, out=out, validate=False, workspace=ws)
            fn()
            cp.cuda.Device().synchronize()
            o = out.astype(cp.float32)
            assert not bool(cp.isnan(o).any())
            if n == 0:
                assert not bool(o.any()), "an empty cache gives 0"
            record(B, "cupyflash", n, timed(fn), kernel=cupyflash.decode.launch_config(
                checks.check_kvcache(q, kc, vc, cache_seqlens=cs)).kernel)
        # the same call without any length (cache_seqlens=None over a view of n keys): no
        # length round trip before the first copy
        for n in (128, CAP):
            fn = lambda n=n: cupyflash.flash_attn_with_kvcache(  # noqa: E731
                q, kc[:, :n], vc[:, :n], out=out, validate=False)
            fn()
            record(B, "cupyflash cache_seqlens=None", n, timed(fn))
        # launched without programmatic dependent launch (cupy.RawKernel)
        with cupyflash.decode.pdl_launches(False):
            for n in (0, 128):
                cs = cp.full((B,), n, cp.int32)
                fn = lambda cs=cs: cupyflash.flash_attn_with_kvcache(  # noqa: E731
                    q, kc, vc, cache_seqlens=cs, out=out, validate=False)
                fn()
                record(B, "cupyflash PDL off", n, timed(fn))
        # the default tile as an experiment variant; with the Q tile by 2-byte loads (the
        # defaults before v44); and with the speculative prologue (v35: the first tiles copied
        # before the length lands), which excludes the Q tile's cp.async
        D_ = cupyflash.decode
        bn, w = la.template["block_n"], la.template["nwarps"]
        base = D_.default_flags(D, False)
        plain_q = base & ~D_.FLAG_Q_ASYNC
        for label, flags in (("variant default", base),
                             ("variant 2-byte q", plain_q),
                             ("variant spec_kv", plain_q | D_.FLAG_SPEC_KV)):
            var = D_.SplitVariant(bn, w, la.template["stages"], flags, 1, pdl=True)
            for n in (0, 128, CAP):
                cs = cp.full((B,), n, cp.int32)
                fn = lambda cs=cs, var=var: D_.run_split_variant(  # noqa: E731
                    var, q, kc, vc, cs, None, out, None, num_splits=1)
                fn()
                record(B, f"{label} {var.name}", n, timed(fn))
        if not args.no_torch:
            for n in (128, CAP):  # cuDNN has no kernel for one key
                try:
                    tf = common.torch_sdpa(q, kc[:, :n], vc[:, :n], "cudnn", enable_gqa=True)
                    record(B, f"torch_cudnn[{tf.layout}]", n, timed(tf))
                except Exception as e:  # noqa: BLE001
                    print(f"cudnn B={B} n={n}: {type(e).__name__}: {str(e)[:200]}")
        del q, kc, vc, out
        common.free_memory()
    return 0


if __name__ == "__main__":
    sys.exit(main())
