"""Prefill pipeline-variant sweep (H7, v1 plan in experiments/NOTES.md): every tensor-core row of
``cupyflash.prefill.SUPPORTED`` and ``VARIANTS`` for a few head dims, timed on one GPU.

Shapes: bfloat16 and float16; head dims 128, 64, 96; S in (4096, 16384) (seqlen_q = seqlen_k);
causal False / True; 16k tokens per batch (B = 16384 // S) and hidden 2048 (H = 2048 // d).
Per shape every configuration is timed with CUDA events (2 warm-up calls, 20 timed, median;
experiments/common.benchmark) and its output is compared with the shape's first configuration
(rel = ||o - o_first|| / ||o_first|| in float32 < 1e-2, no NaN); the first configuration is
itself compared with a float32 CuPy reference on 128 query rows of two (batch, head) pairs.
All specialisations are compiled first on a thread pool; a compile error is reported, not fatal.

    PYTHONPATH=. python experiments/sweep_prefill_variants.py          # whole sweep, < 120 s on an H200
    PYTHONPATH=. python experiments/sweep_prefill_variants.py --headdims 128 --dtypes bfloat16

Writes one JSON object per measurement to $OUT/prefill_variants.jsonl (or experiments/results/ without $OUT).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

import numpy as np  # noqa: E402


def to_f32(x):
    """CuPy float16 / bfloat16 array -> float32 (bfloat16 by its bits)."""
    import cupy
    if np.dtype(x.dtype).name == "bfloat16":
        return (x.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
    return x.astype(cupy.float32)


def reference_rows(q, k, v, b, h, rows, scale, causal):
    """float32 softmax(q k^T * scale) v for query rows ``rows`` of (b, h); Sq = Sk here."""
    import cupy
    qs = to_f32(q[b, rows, h])                      # (r, d)
    ks = to_f32(k[b, :, h])                         # (S, d)
    vs = to_f32(v[b, :, h])
    s = (qs @ ks.T) * scale
    if causal:
        keys = cupy.arange(ks.shape[0])[None, :]
        s = cupy.where(keys <= rows[:, None], s, -cupy.inf)
    m = s.max(axis=1, keepdims=True)
    p = cupy.exp(s - m)
    l = p.sum(axis=1, keepdims=True)
    return (p @ vs) / l, (m[:, 0] + cupy.log(l[:, 0]))


def rel(a, b) -> float:
    import cupy
    return float(cupy.linalg.norm(a - b) / cupy.linalg.norm(b))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    ap.add_argument("--headdims", nargs="+", type=int, default=[128, 64, 96])
    ap.add_argument("--seqlens", nargs="+", type=int, default=[4096, 16384])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=110.0,
                    help="stop starting new shapes after this many seconds")
    args = ap.parse_args(argv)
    t_start = time.time()

    import common
    if not common.have_gpu():
        print("prefill_variants: no CUDA GPU here; nothing to measure")
        return 0
    import cupy
    from cupyflash import checks, io_model, jit, prefill

    out_dir = Path(os.environ.get("OUT", Path(__file__).resolve().parent / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / "prefill_variants.jsonl"
    fout = open(out_path, "a")

    def emit(rec):
        fout.write(json.dumps(rec) + "\n")
        fout.flush()

    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    try:
        commit = common._git("rev-parse", "--short", "HEAD")
    except Exception:
        commit = ""
    source_hash = jit.source_hash(prefill.spec_of(prefill.SUPPORTED[0], False))

    rows_all = prefill.SUPPORTED + prefill.VARIANTS
    cfgs = {(dt, hd): [c for c in rows_all if c.dtype == dt and c.headdim == hd]
            for dt in args.dtypes for hd in args.headdims}

    # ---- compile everything first (NVRTC through CuPy; threads overlap the compiles) ----
    specs = [prefill.spec_of(c, causal) for cl in cfgs.values() for c in cl for causal in (False, True)]
    compile_err = {}

    def build(spec):
        try:
            jit.get_kernel(spec)
            return spec.name, None
        except Exception as e:  # reported, not fatal
            return spec.name, f"{type(e).__name__}: {str(e)[:600]}"

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as pool:
        for name, err in pool.map(build, specs):
            if err:
                # one serial retry (in case the threaded path was the problem)
                name2, err2 = build(next(s for s in specs if s.name == name))
                if err2:
                    compile_err[name] = err2
                    print(f"COMPILE ERROR {name}: {err2}", flush=True)
    print(f"compiled {len(specs) - len(compile_err)}/{len(specs)} specs in "
          f"{time.time() - t_start:.1f} s", flush=True)

    summary = []
    for dt in args.dtypes:
        for hd in args.headdims:
            for S in args.seqlens:
                for causal in (False, True):
                    if time.time() - t_start > args.budget_s:
                        print(f"budget {args.budget_s:.0f} s spent: skipping {dt} hd{hd} S={S} "
                              f"causal={causal}", flush=True)
                        emit({"what": "prefill_variants", "dtype": dt, "headdim": hd, "seqlen": S,
                              "causal": causal, "error": "skipped: time budget"})
                        continue
                    B, H = max(1, 16384 // S), 2048 // hd
                    common.free_memory()
                    q, k, v = common.random_qkv(B, S, S, H, H, hd, dt, seed=11)
                    problem = checks.check_attention(q, k, v, causal=causal)
                    flops = io_model.prefill_flops(B, H, S, S, hd, causal)
                    first = None
                    recs = []
                    for cfg in cfgs[(dt, hd)]:
                        spec = prefill.spec_of(cfg, causal)
                        rec = {"what": "prefill_variants", "gpu": gpu, "commit": commit,
                               "source_hash": source_hash, "dtype": dt, "headdim": hd, "batch": B,
                               "nheads": H, "seqlen": S, "causal": causal, "kernel": spec.name,
                               "block_m": cfg.block_m, "block_n": cfg.block_n, "nwarps": cfg.nwarps,
                               "stages": cfg.stages, "sub_n": cfg.sub_n, "opt": cfg.opt,
                               "supported": cfg in prefill.SUPPORTED, "smem_bytes": cfg.smem_bytes}
                        if spec.name in compile_err:
                            rec["error"] = "compile: " + compile_err[spec.name]
                            emit(rec)
                            recs.append(rec)
                            continue
                        out = cupy.full(q.shape, np.nan, dtype=q.dtype) if dt == "float16" else \
                            cupy.full(q.shape, 0x7FC0, dtype=cupy.uint16).view(q.dtype)  # NaN poison
                        lse = cupy.full((B, H, S), np.nan, dtype=cupy.float32)

                        def fn(spec=spec, out=out, lse=lse):
                            prefill.launch(spec, q, k, v, out, lse, problem=problem)
                        try:
                            fn()
                            cupy.cuda.Device().synchronize()
                            o32 = to_f32(out)
                            rec["nan"] = bool(cupy.isnan(o32).any()) or bool(cupy.isnan(lse).any())
                            if first is None:
                                first = (spec.name, o32, lse.copy())
                                scale = 1.0 / math.sqrt(hd)
                                worst_o = worst_l = 0.0
                                rows = cupy.asarray(np.concatenate([np.arange(64), np.arange(S - 64, S)]))
                                for b_, h_ in ((0, 0), (B - 1, H - 1)):
                                    ro, rl = reference_rows(q, k, v, b_, h_, rows, scale, causal)
                                    worst_o = max(worst_o, rel(o32[b_, rows, h_], ro))
                                    worst_l = max(worst_l, float(cupy.abs(lse[b_, h_, rows] - rl).max()))
                                rec["ref_rel_diff"] = worst_o
                                rec["ref_lse_abs_diff"] = worst_l
                                rec["ok"] = (not rec["nan"]) and worst_o < 1e-2 and worst_l < 1e-2
                            else:
                                rec["vs"] = first[0]
                                rec["rel_diff"] = rel(o32, first[1])
                                rec["lse_abs_diff"] = float(cupy.abs(lse - first[2]).max())
                                rec["ok"] = (not rec["nan"]) and rec["rel_diff"] < 1e-2 \
                                    and rec["lse_abs_diff"] < 1e-2
                            del o32
                            t = common.benchmark(fn, n_warmup=2, n_repeat=args.reps)
                            rec.update(ms=t["ms"], ms_min=t["ms_min"],
                                       tflops=flops / (t["ms"] * 1e-3) / 1e12)
                        except Exception as e:
                            rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                            traceback.print_exc()
                        emit(rec)
                        recs.append(rec)
                        out = lse = None
                    first = None
                    q = k = v = None
                    recs.sort(key=lambda r: -r.get("tflops", -1))
                    print(f"\n{dt} hd{hd} S={S} B={B} H={H} causal={causal}  "
                          f"(t = {time.time() - t_start:.0f} s)")
                    for r in recs:
                        tag = "" if r["supported"] else " [variant]"
                        if "tflops" in r:
                            chk = ("ref %.1e" % r["ref_rel_diff"]) if "ref_rel_diff" in r else \
                                ("rel %.1e" % r["rel_diff"])
                            print(f"  {r['tflops']:6.1f} TFLOP/s {r['ms']:8.3f} ms  {r['kernel']:40s} "
                                  f"{chk} {'OK' if r['ok'] else 'WRONG'}{tag}")
                        else:
                            print(f"  ------ {r['kernel']:40s} {r.get('error', '?')[:200]}{tag}")
                    best = recs[0] if recs and "tflops" in recs[0] else None
                    if best:
                        summary.append((dt, hd, S, causal, best["kernel"], best["tflops"]))
                    sys.stdout.flush()

    print("\nbest per shape:")
    for dt, hd, S, causal, name, tf in summary:
        print(f"  {dt:9s} hd{hd:<4d} S={S:<6d} causal={causal!s:5s} {tf:6.1f}  {name}")
    bad = [r for r in map(json.loads, open(out_path)) if r.get("ok") is False
           and r.get("source_hash") == source_hash]
    print(f"\n{len(bad)} wrong results; wrote {out_path}; {time.time() - t_start:.0f} s total")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
