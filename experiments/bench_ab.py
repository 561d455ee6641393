"""Before/after timing of two builds of cupyflash on the same GPU, in one run.

A kernel change is judged against the code it replaces, measured side by side: this script times
the same prefill, decode and backward calls with the library of this checkout ("after") and with
the one in ``--before DIR`` (a checkout of another commit, e.g. ``git worktree add /tmp/before
TAG`` or ``git archive TAG cupyflash kernels_cu | tar -x -C DIR``), alternating the two in
``--rounds`` rounds of one process each, so that clock drift and a warm or cold GPU fall on both
alike. Each call is timed by :func:`common.benchmark` (CUDA events, median; decode with L2
flushed between repetitions, as in a model step; the backward as ``flash_attn_backward`` alone,
by default and with ``deterministic=True``: ops ``backward`` and ``backward_det``). The record
per shape keeps every round's median for both builds, their medians, and ``ratio = after /
before`` (below 1: the change is faster).

    PYTHONPATH=. python experiments/bench_ab.py --before /tmp/before            # full set
    PYTHONPATH=. python experiments/bench_ab.py --before /tmp/before --only decode --rounds 3
    PYTHONPATH=. python experiments/bench_ab.py --before /tmp/before --prefill-seqlens 16384 --headdims 128
    PYTHONPATH=. python experiments/bench_ab.py --before /tmp/before --only backward --headdims 64 128
    PYTHONPATH=. python experiments/bench_ab.py --before /tmp/before --variants /tmp/v1 /tmp/v2 --only backward

Appends a run to ``experiments/results/bench_ab.jsonl``: a header with this checkout's commit and
the GPU (experiments/common.py), then one line per shape with ``commit_before``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (op, dtype, headdim, batch, seqlen_q, seqlen_k, nheads, nheads_k, causal, paged page size or 0)
def _prefill_shapes(dtype_hd_s, causal=(False, True), op="prefill"):
    """Shapes of ``op`` at 16k tokens per batch and hidden 2048, one per (dtype, head dim, S) and
    causal flag."""
    return [(op, dt, hd, 16384 // s, s, s, 2048 // hd, 2048 // hd, c, 0)
            for dt, hd, s in dtype_hd_s for c in causal]


PREFILL = _prefill_shapes((("bfloat16", 128, 4096), ("bfloat16", 64, 4096),
                           ("bfloat16", 256, 4096), ("float16", 128, 4096),
                           ("bfloat16", 128, 1024))) + \
    [("prefill", "float32", 64, 2, 1024, 1024, 8, 8, False, 0)]
# bf16 at S 1k and 8k, both modes (issue 35's shapes)
BACKWARD = [x for op in ("backward", "backward_det")
            for x in _prefill_shapes([("bfloat16", hd, s) for hd in (64, 128, 256)
                                      for s in (1024, 8192)], op=op)]
# Llama-3-8B decode heads (32 query, 8 KV, hd128), one new token, full caches
DECODE = [("decode", "bfloat16", 128, b, 1, s, 32, 8, False, ps)
          for b, s, ps in ((1, 16384, 0), (1, 131072, 0), (16, 1024, 0), (16, 16384, 0),
                           (64, 1024, 0), (64, 4096, 0), (16, 4096, 16), (64, 1024, 16))]


def shapes_of(ops, prefill=None, headdims=(64, 128, 256)):
    """The shapes a run times: ``prefill`` (or PREFILL), DECODE and BACKWARD (at ``headdims``),
    those of ``ops``."""
    backward = [x for x in BACKWARD if x[2] in headdims]
    return [x for x in (PREFILL if prefill is None else prefill) + DECODE + backward
            if x[0] in ops]


def _worker(out_path, shapes):
    """Time every shape with whichever cupyflash is first on the path (imported before
    ``common``, which would put this checkout's first); write {key: median ms}."""
    import cupyflash  # noqa: F401  (the build under test: PYTHONPATH decides)
    sys.path.insert(0, str(HERE))
    import cupy
    import numpy as np
    import common
    res = {"cupyflash": os.path.dirname(cupyflash.__file__)}
    for op, dt, hd, b, sq, sk, h, hk, causal, ps in shapes:
        key = json.dumps([op, dt, hd, b, sq, sk, h, hk, causal, ps])
        q, k, v = common.random_qkv(b, sq, sk, h, hk, hd, dt, seed=1)
        if op in ("backward", "backward_det"):
            dout = common.random_normal(q.shape, dt, 4)
            o, lse = cupyflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
            dq, dk, dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
            det = op == "backward_det"

            def fn():
                cupyflash.flash_attn_backward(dout, q, k, v, o, lse, causal=causal,
                                              deterministic=det, dq=dq, dk=dk, dv=dv)
            t = common.benchmark(fn, n_warmup=3, n_repeat=20)
            dout = o = lse = dq = dk = dv = None
        elif op == "prefill":
            out = cupy.empty_like(q)

            def fn():
                cupyflash.flash_attn_func(q, k, v, causal=causal, out=out)
            t = common.benchmark(fn, n_warmup=3, n_repeat=20)
        else:
            lens = cupy.full((b,), sk, cupy.int32)
            bt = None
            if ps:
                pages = b * sk // ps
                perm = cupy.asarray(np.random.default_rng(3).permutation(pages).astype(np.int32))
                bt = perm.reshape(b, sk // ps)
                k = k.reshape(pages, ps, hk, hd)[cupy.argsort(perm)]
                v = v.reshape(pages, ps, hk, hd)[cupy.argsort(perm)]
            out = cupy.empty_like(q)

            def fn():
                cupyflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, block_table=bt,
                                                  out=out, validate=False)
            t = common.benchmark(fn, n_warmup=3, n_repeat=30, flush_l2=True)
        res[key] = t["ms"]
        fn = q = k = v = out = None  # free the arrays before the next shape allocates
        common.free_memory()
    Path(out_path).write_text(json.dumps(res))


def _commit(root: Path) -> str:
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
        return r.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, help="root of the other build (holds cupyflash/ and "
                    "kernels_cu/)")
    ap.add_argument("--variants", type=Path, nargs="+", default=[], metavar="DIR",
                    help="roots of further builds, timed in the same rounds and each compared "
                    "with --before")
    ap.add_argument("--rounds", type=int, default=2, help="processes per build, alternated")
    ap.add_argument("--only", choices=("prefill", "decode", "backward"),
                    help="one op only (backward: both modes; not in the default set)")
    ap.add_argument("--before-commit", default=None, help="commit of --before (default: its git "
                    "HEAD, or 'unknown')")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "bench_ab.jsonl")
    ap.add_argument("--prefill-seqlens", type=int, nargs="+", metavar="S",
                    help="prefill shapes: bf16 at these S (16k tokens per batch, hidden 2048, "
                    "causal and not) instead of the default set")
    ap.add_argument("--headdims", type=int, nargs="+", default=[64, 128, 256],
                    help="head dims of --prefill-seqlens and of the backward shapes")
    ap.add_argument("--worker", nargs=2, metavar=("PATH", "SHAPES"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.worker[0], [tuple(x) for x in json.loads(args.worker[1])])
        return 0
    for s in args.prefill_seqlens or ():
        if s < 1 or 16384 % s:
            ap.error(f"--prefill-seqlens: {s} does not divide 16384 (16k tokens per batch)")
    for hd in args.headdims:
        if hd not in (64, 128, 256):
            ap.error(f"--headdims: {hd} is not one of 64, 128, 256")
    prefill = None
    if args.prefill_seqlens:  # bf16 at each (S, head dim)
        prefill = _prefill_shapes([("bfloat16", hd, s) for s in args.prefill_seqlens
                                   for hd in args.headdims])
    if args.before is None:
        ap.error("--before: the root of the build to compare against is required")
    for root in [args.before] + args.variants:
        if not (root / "cupyflash").is_dir():
            ap.error(f"--before/--variants: {root} holds no cupyflash/ package")
    sys.path.insert(0, str(HERE))
    import common
    ops = {None: ["prefill", "decode"], "backward": ["backward", "backward_det"]}.get(
        args.only, [args.only])
    shapes = shapes_of(ops, prefill, args.headdims)
    sides = {"before": args.before.resolve(), "after": HERE.parent}
    sides.update((f"variant {v.resolve().name}", v.resolve()) for v in args.variants)
    if len(set(sides.values())) < len(sides):
        ap.error("--before/--variants: each build must be a different directory")
    names = list(sides)
    runs = {side: [] for side in names}
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    for r in range(args.rounds):  # the order rotates, so that no build always runs first
        for side in names[r % len(names):] + names[:r % len(names)]:
            path = tmp / f"bench_ab_{side.replace(' ', '_')}_{r}.json"
            env = dict(os.environ, PYTHONPATH=str(sides[side]))
            print(f"round {r}: {side} ({sides[side]})", flush=True)
            subprocess.run([sys.executable, __file__, "--worker", str(path), json.dumps(shapes)],
                           env=env, check=True)
            runs[side].append(json.loads(path.read_text()))
    for side in sides:  # each side really imported its own build
        got = {Path(x["cupyflash"]).resolve().parent for x in runs[side]}
        assert got == {sides[side]}, f"{side}: imported cupyflash from {got}"
    recs = []
    for side in names[1:]:
        variant = None if side == "after" else sides[side].name
        for key in runs[side][0]:
            if key == "cupyflash":
                continue
            op, dt, hd, b, sq, sk, h, hk, causal, ps = json.loads(key)
            before = [x[key] for x in runs["before"]]
            after = [x[key] for x in runs[side]]
            mb, ma = statistics.median(before), statistics.median(after)
            recs.append(dict(what="bench_ab", op=op, dtype=dt, headdim=hd, batch=b, seqlen_q=sq,
                             seqlen_k=sk, nheads=h, nheads_k=hk, causal=causal, page_size=ps,
                             ms_before=before, ms_after=after, ms_before_median=mb,
                             ms_after_median=ma, ratio=ma / mb, variant=variant,
                             commit_before=args.before_commit or _commit(sides["before"])))
            print(f"{variant or 'after':10s} {op:12s} {dt:8s} hd{hd:<3d} b{b:<3d} sq{sq:<5d} "
                  f"sk{sk:<6d} {'causal' if causal else 'full  '} p{ps:<3d} before {mb:8.4f} ms"
                  f"  after {ma:8.4f} ms  ratio {ma / mb:.4f}", flush=True)
    common.append_results(args.out, recs)  # the run's header: this checkout's commit and GPU
    return 0


if __name__ == "__main__":
    sys.exit(main())
