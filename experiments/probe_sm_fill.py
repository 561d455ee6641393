"""Does a decode launch stream faster on all 132 SMs than on 128? (NOTES v23 probe)

    PYTHONPATH=. python experiments/probe_sm_fill.py [--out DIR]

Batch 16 x 8 KV heads (Llama-3-8B) makes 128 unsplit blocks, one per SM, and 4 of the H200's
132 SMs idle; a balanced ("stream-K") split would give every SM the same share. Before building
one, this probe measures what an extra 4 SMs are worth with the current kernel: the same
per-block work (one KV head of one sequence, num_splits fixed) launched as 128 and as 132
blocks (16 query / 4 KV heads, batch 32 vs 33), and as 256 vs 264 blocks (batch 64 vs 66, the
heuristic's two-blocks-per-SM tile). If TB/s scales with the blocks (x 132 / 128 = 1.031), the
balanced split has up to 3% to gain at batch 16; if not, per-SM bandwidth is not the limit.
Graph-timed (20 calls per graph, best of 3) and flushed (median of 30, L2 flushed before each
call). Records are appended to ``$OUT/probe_sm_fill.jsonl`` (or --out).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get(
        "OUT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")))
    ap.add_argument("--seqlens", nargs="+", type=int, default=[1024, 4096, 16384])
    args = ap.parse_args(argv)
    import cupy as cp
    import ml_dtypes
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common
    import cupyflash

    bf = ml_dtypes.bfloat16
    H, HK, D = 16, 4, 128
    prov = common.provenance()
    rng = cp.random.default_rng(1)
    recs = []
    # (batch, num_splits): 0 is the heuristic (the 64 x 4 tile, two blocks per SM, at 256+ blocks)
    for S in args.seqlens:
        for B, ns in ((32, 1), (33, 1), (64, 0), (66, 0)):
            q = rng.standard_normal((B, 1, H, D), dtype=cp.float32).astype(bf)
            kc = rng.standard_normal((B, S, HK, D), dtype=cp.float32).astype(bf)
            vc = rng.standard_normal((B, S, HK, D), dtype=cp.float32).astype(bf)
            cs = cp.full((B,), S, cp.int32)
            out = cp.full(q.shape, np.nan, dtype=bf)
            plan = cupyflash.explain_kvcache(q, kc, vc, cache_seqlens=cs, num_splits=ns, report=False)
            fn = lambda: cupyflash.flash_attn_with_kvcache(  # noqa: E731
                q, kc, vc, cache_seqlens=cs, num_splits=ns, out=out, validate=False)
            fn()
            cp.cuda.Device().synchronize()
            assert not bool(cp.isnan(out.astype(cp.float32)).any()), "unwritten output"
            kv = 2 * B * S * HK * D * 2
            g = common.graph_time_us(fn)
            f = common.benchmark(fn, n_warmup=3, n_repeat=30, flush_l2=True)["ms"] * 1e3
            blocks = B * HK * max(1, ns or 1)
            rec = dict(probe="sm_fill", batch=B, nheads=H, nheads_k=HK, headdim=D, seqlen_k=S,
                       num_splits_arg=ns, blocks_unsplit=B * HK, us_graph=g,
                       tbps_graph=kv / g / 1e6, us_flushed=f, tbps_flushed=kv / f / 1e6,
                       plan=str(plan).splitlines()[:6], **prov)
            recs.append(rec)
            print(f"B={B} S={S} ns={ns} blocks={blocks}: graph {g:.1f} us {kv / g / 1e6:.2f} TB/s"
                  f" | flushed {f:.1f} us {kv / f / 1e6:.2f} TB/s", flush=True)
            del q, kc, vc, out
            common.free_memory()
    os.makedirs(args.out, exist_ok=True)
    common.append_jsonl(os.path.join(args.out, "probe_sm_fill.jsonl"), recs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
