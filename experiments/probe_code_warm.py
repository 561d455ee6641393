"""Is the start-up cost of a lone decode call the kernel's code coming from DRAM? (NOTES v31)

    PYTHONPATH=. python experiments/probe_code_warm.py [--out DIR]

Timed alone after the L2 flush, our short-cache calls cost ~1 us more than in graph replay,
more than cuDNN's do (v21); shared-memory reconfiguration was ruled out (v21). The flush also
evicts the kernel's machine code (56 KB of SASS for the hd128 split kernel) from L2, so the
first blocks fetch their instructions from DRAM. This probe times each call after the flush
three ways (CUDA events around the call only, median of 40; a spin kernel first so that host
launch time does not leak in):
- ``cold``: flush, call (the benchmark's method);
- ``warm``: flush, the same call on a second q and output with every ``cache_seqlens`` = 1
  (the same plan and kernel, so its code is in L2 and the SMs' instruction caches, while of
  the K/V bytes only key 0 of each sequence is touched), then the timed call;
- for torch SDPA's cuDNN backend: flush, an SDPA call with 128 keys (same batch and heads), then
  the timed call (probably the same kernel; cuDNN's choice is not visible).
If ``warm`` is faster than ``cold`` by ~0.5-1 us for us and less for cuDNN, code fetch is the
start-up cost. Records are appended to ``$OUT/probe_code_warm.jsonl`` (or --out).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def _time(calls_before, fn, n=40):
    """Median/min us of ``fn`` timed alone after the flush and ``calls_before``."""
    import cupy as cp
    import common
    common.flush_l2_cache("read")
    for c in calls_before:
        c()
    fn()
    cp.cuda.Device().synchronize()
    starts = [cp.cuda.Event() for _ in range(n)]
    ends = [cp.cuda.Event() for _ in range(n)]
    common._spin_kernel()((1,), (1,), (np.uint64(int(n * 0.2e6)),))  # 0.2 ms of host time per rep
    for i in range(n):
        common.flush_l2_cache("read")
        for c in calls_before:
            c()
        starts[i].record()
        fn()
        ends[i].record()
    ends[-1].synchronize()
    t = np.array([cp.cuda.get_elapsed_time(s, e) for s, e in zip(starts, ends)]) * 1e3
    return float(np.median(t)), float(t.min())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get(
        "OUT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")))
    ap.add_argument("--cases", nargs="+", default=["16,1024", "64,1024", "16,2048", "1,2048",
                                                   "16,16384"])
    args = ap.parse_args(argv)
    import cupy as cp
    import ml_dtypes
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common
    import cupyflash
    from cupyflash import decode

    bf = ml_dtypes.bfloat16
    H, HK, D = 32, 8, 128
    prov = common.provenance()
    rng = cp.random.default_rng(2)
    recs = []
    for case in args.cases:
        B, S = (int(x) for x in case.split(","))
        q, q2 = (rng.standard_normal((B, 1, H, D), dtype=cp.float32).astype(bf) for _ in range(2))
        kc = rng.standard_normal((B, S, HK, D), dtype=cp.float32).astype(bf)
        vc = rng.standard_normal((B, S, HK, D), dtype=cp.float32).astype(bf)
        cs = cp.full((B,), S, cp.int32)
        cs1 = cp.ones((B,), cp.int32)
        out, out2 = (cp.full(q.shape, np.nan, dtype=bf) for _ in range(2))
        ws = decode.alloc_workspace(q, kc, vc, cache_seqlens=cs)
        ws2 = decode.alloc_workspace(q, kc, vc, cache_seqlens=cs)
        plan = cupyflash.explain_kvcache(q, kc, vc, cache_seqlens=cs, report=False)
        fn = lambda: cupyflash.flash_attn_with_kvcache(  # noqa: E731
            q, kc, vc, cache_seqlens=cs, out=out, validate=False, workspace=ws)
        warm = lambda: cupyflash.flash_attn_with_kvcache(  # noqa: E731
            q2, kc, vc, cache_seqlens=cs1, out=out2, validate=False, workspace=ws2)
        fn()
        cp.cuda.Device().synchronize()
        assert not bool(cp.isnan(out.astype(cp.float32)).any()), "unwritten output"
        kv = 2 * B * S * HK * D * 2
        res = {}
        res["ours_cold"] = _time([], fn)
        res["ours_warm"] = _time([warm], fn)
        if common.have_torch():
            import torch
            qt, kt, vt = (common.cupy_to_torch(x).transpose(1, 2) for x in (q, kc, vc))
            kt2, vt2 = kt[:, :, :128], vt[:, :, :128]
            from torch.nn.attention import SDPBackend, sdpa_kernel
            F = torch.nn.functional.scaled_dot_product_attention

            def sdpa(k_, v_):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F(qt, k_, v_, enable_gqa=True)
            try:
                sdpa(kt, vt)
                torch.cuda.synchronize()
                res["cudnn_cold"] = _time([], lambda: sdpa(kt, vt))
                res["cudnn_warm"] = _time([lambda: sdpa(kt2, vt2)], lambda: sdpa(kt, vt))
            except Exception as e:  # noqa: BLE001
                res["cudnn_error"] = f"{type(e).__name__}: {e}"
        rec = dict(probe="code_warm", batch=B, nheads=H, nheads_k=HK, headdim=D, seqlen_k=S,
                   kernel=plan.name, num_splits=plan.num_splits, kv_bytes=kv, **prov)
        for k_, v_ in res.items():
            if isinstance(v_, tuple):
                rec[k_ + "_us"], rec[k_ + "_us_min"] = v_
            else:
                rec[k_] = v_
        recs.append(rec)
        print(f"B={B} S={S} {plan.name}: " + " | ".join(
            f"{k_} {v_[0]:.2f} (min {v_[1]:.2f})" if isinstance(v_, tuple) else f"{k_} {v_}"
            for k_, v_ in res.items()), flush=True)
        del q, q2, kc, vc, out, out2, ws, ws2
        common.free_memory()
    os.makedirs(args.out, exist_ok=True)
    common.append_jsonl(os.path.join(args.out, "probe_code_warm.jsonl"), recs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
