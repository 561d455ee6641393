"""Does the cache's memory order change how fast the same decode streams it? (NOTES v40)

    PYTHONPATH=. python experiments/probe_kv_layout.py [--out DIR] [--shapes 16,1024 ...]

Llama-3-8B heads (32 query, 8 KV heads, hd128), bf16, every sequence full, the public call at
the heuristic's split count, on the same values stored two ways:

* ``bshd``: the standard (batch, seqlen, nheads_k, headdim) cache. A block (one KV head) reads
  256 bytes out of every 2 KB row, and the 8 heads' blocks read the rest of each row;
* ``bhsd``: a (batch, seqlen, nheads_k, headdim) *view* of (batch, nheads_k, seqlen, headdim)
  storage: each block streams one contiguous region (its head's keys back to back).

The kernel, the plan and the bytes are the same; only the DRAM addresses' order differs. So
``bhsd`` against ``bshd`` measures what DRAM locality is worth to this kernel, an upper bound
for a kernel that reads whole 2 KB rows of the standard layout (all KV heads in one block).
torch SDPA cuDNN runs on both stores too (``bhsd`` is its native layout, no copy). Graph-timed
(20 calls per graph, best of 3) and flushed (median of 30); our two outputs must be bitwise
equal. Records are appended to ``$OUT/probe_kv_layout.jsonl`` (or --out).
"""
from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get(
        "OUT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")))
    ap.add_argument("--shapes", nargs="+",
                    default=["16,1024", "16,2048", "16,4096", "64,1024", "64,2048", "16,16384"],
                    help="batch,seqlen_k pairs")
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args(argv)
    import cupy as cp
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common

    H, HK, D = 32, 8, 128
    prov = common.provenance()
    rng = cp.random.default_rng(5)
    os.makedirs(args.out, exist_ok=True)
    for shape in args.shapes:
        B, S = (int(x) for x in shape.split(","))
        q, kc, vc, cs = common.llama_decode_inputs(rng, B, S, H, HK, D)
        # the same values in (batch, head, seq, d) storage, viewed as (batch, seq, head, d)
        kh = cp.ascontiguousarray(kc.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        vh = cp.ascontiguousarray(vc.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        assert not kh.flags.c_contiguous and kh.strides[1] == D * 2
        kv = 2 * B * S * HK * D * 2
        ref = None
        for name, k_, v_ in (("bshd", kc, vc), ("bhsd", kh, vh)):
            o32, g, f = common.timed_decode_call(q, k_, v_, cs, what=name)
            if ref is None:
                ref = o32
            same = bool((o32 == ref).all())
            impls = [("cupyflash", g, f)]
            if not args.no_torch:
                try:
                    tf = common.torch_sdpa(q, k_, v_, "cudnn", enable_gqa=True)
                    impls.append((f"torch_cudnn[{tf.layout}]", common.torch_graph_time_us(tf)[0],
                                  common.benchmark(tf, n_warmup=3, n_repeat=30,
                                                   flush_l2=True)["ms"] * 1e3))
                except Exception as e:  # noqa: BLE001
                    print(f"torch cudnn {name}: {type(e).__name__}: {str(e)[:200]}")
            for impl, g_, f_ in impls:
                rec = dict(probe="kv_layout", layout=name, impl=impl, batch=B, seqlen_k=S,
                           nheads=H, nheads_k=HK, headdim=D, us_graph=g_,
                           tbps_graph=kv / g_ / 1e6, us_flushed=f_, tbps_flushed=kv / f_ / 1e6,
                           bitwise_equal_to_bshd=same if impl == "cupyflash" else None, **prov)
                common.append_jsonl(os.path.join(args.out, "probe_kv_layout.jsonl"), rec)
                print(f"B={B:3d} S={S:6d} {name} {impl:30s}: graph {g_:8.2f} us "
                      f"{kv / g_ / 1e6:.2f} TB/s | flushed {f_:8.2f} us {kv / f_ / 1e6:.2f} TB/s"
                      + (f" | bitwise {same}" if impl == "cupyflash" else ""), flush=True)
        del q, kc, vc, kh, vh
        common.free_memory()
    return 0


if __name__ == "__main__":
    sys.exit(main())
