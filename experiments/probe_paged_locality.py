"""Why do pages of 16 stream slower than contiguous caches? Page-table order probe (NOTES v29).

    PYTHONPATH=. python experiments/probe_paged_locality.py [--out DIR]

Llama-3-8B heads (32 query, 8 KV heads, hd128), bf16, every sequence full, the public call at
the heuristic's split count. The same paged pool (pages of 16 keys: 32 KB of K or V per page)
is read through four block tables:

* ``identity``: sequence b's pages in pool order (the contiguous cache's bytes, read as pages);
* ``group64``: pages shuffled only inside aligned groups of 64 pages (2 MB of the pool, one large
  GPU memory page): the same 2 MB regions as ``identity``, visited in a random order inside;
* ``shuffled``: pages shuffled over the whole pool (``bench_decode.py``'s tables);
* and the contiguous cache itself (``contiguous``), the same memory without a table.

``identity`` vs ``contiguous`` isolates the kernel's paged addressing; ``group64`` vs
``identity`` the order of 32 KB pieces inside 2 MB regions (DRAM locality); ``shuffled`` vs
``group64`` jumps between 2 MB regions (address translation). Graph-timed (20 calls per graph,
best of 3) and flushed (median of 30). Records are appended to
``$OUT/probe_paged_locality.jsonl`` (or --out).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def tables(batch: int, pages_per_seq: int, seed: int = 0) -> dict:
    """The three block tables (int32, (batch, pages_per_seq)) over a pool of batch *
    pages_per_seq pages; ``pages_per_seq`` a multiple of 64."""
    rng = np.random.default_rng(seed)
    n = batch * pages_per_seq
    ident = np.arange(n, dtype=np.int32)
    groups = ident.reshape(-1, 64).copy()
    for g in groups:
        rng.shuffle(g)
    return {"identity": ident.reshape(batch, pages_per_seq),
            "group64": groups.reshape(batch, pages_per_seq),
            "shuffled": rng.permutation(n).astype(np.int32).reshape(batch, pages_per_seq)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get(
        "OUT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")))
    ap.add_argument("--shapes", nargs="+", default=["16,16384", "16,4096", "1,131072", "64,2048"],
                    help="batch,seqlen_k pairs (seqlen_k a multiple of 1024)")
    args = ap.parse_args(argv)
    import cupy as cp
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common

    H, HK, D, PAGE = 32, 8, 128, 16
    prov = common.provenance()
    rng = cp.random.default_rng(3)
    for shape in args.shapes:
        B, S = (int(x) for x in shape.split(","))
        q, kc, vc, cs = common.llama_decode_inputs(rng, B, S, H, HK, D)
        kpool, vpool = kc.reshape(-1, PAGE, HK, D), vc.reshape(-1, PAGE, HK, D)  # views
        kv = 2 * B * S * HK * D * 2
        ref = None
        cases = [("contiguous", kc, vc, None)] + [
            (name, kpool, vpool, cp.asarray(t)) for name, t in tables(B, S // PAGE).items()]
        for name, k_, v_, bt in cases:
            if bt is not None and name != "identity":
                # the same sequences: pool page bt[b, t] holds keys [16 t, 16 t + 16) of b
                k_, v_ = cp.empty_like(kpool), cp.empty_like(vpool)
                k_[bt.ravel()] = kpool
                v_[bt.ravel()] = vpool
            o32, g, f = common.timed_decode_call(q, k_, v_, cs, bt, what=name)
            if ref is None:
                ref = o32
            same = bool((o32 == ref).all())  # the same keys in the same order: bitwise equal
            rec = dict(probe="paged_locality", table=name, batch=B, seqlen_k=S, page_size=PAGE,
                       nheads=H, nheads_k=HK, headdim=D, us_graph=g, tbps_graph=kv / g / 1e6,
                       us_flushed=f, tbps_flushed=kv / f / 1e6, equal_to_contiguous=same, **prov)
            common.append_jsonl(os.path.join(args.out, "probe_paged_locality.jsonl"), rec)
            print(f"B={B} S={S} {name:10s}: graph {g:8.1f} us {kv / g / 1e6:.2f} TB/s | flushed "
                  f"{f:8.1f} us {kv / f / 1e6:.2f} TB/s | equal {same}", flush=True)
            del k_, v_
        del q, kc, vc, kpool, vpool
        common.free_memory()
    return 0


if __name__ == "__main__":
    sys.exit(main())
