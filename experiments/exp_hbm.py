"""HBM bytes measured by Nsight Compute beside the I/O model's prediction (figure 3).

For each implementation and size, this script runs itself in *driver* mode under

    ncu --clock-control none --profile-from-start off --print-units base --csv \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum  python exp_hbm.py --driver ...

The driver builds the inputs, calls the implementation once untimed (compilation, library
handles), then calls it once more between ``cudaProfilerStart`` / ``cudaProfilerStop``: only the
kernels of that call are profiled. The bytes of all of them (the baseline is several kernels:
layout copies, two GEMMs, the softmax) are summed. ncu flushes the caches before each kernel it
profiles (its default ``--cache-control all``), so each kernel starts cold, as the model assumes.

Shapes: batch 4, 16 heads of 128, bf16 (fixed batch and heads, growing S: the baseline's bytes
grow as S^2, the tiled kernel's compulsory bytes as S). Decode: Llama-3-8B heads, batch 1.

Model columns recorded per point: ``model_bytes`` (the algorithm's count: the baseline's
``baseline_traffic``; for the tiled kernel, K/V read once per KV head, ``kv_reuse=True``),
``model_bytes_no_reuse`` (tiled kernel, every query tile's K/V loads from HBM, with the kernel's
BLOCK_M / BLOCK_N from ``explain()``), and the decode model with the chosen ``num_splits``.

    python experiments/exp_hbm.py --quick           # 7 profiled runs, ~1 min on an H200
    python experiments/exp_hbm.py                   # S = 1k .. 32k

Appends a run (experiments/common.py) to ``experiments/results/exp_hbm.jsonl``; skips with a
message when ncu is missing or cannot read the counters.
"""
from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS, _on_term, find_ncu, ncu_csv_rows, run_profiled  # noqa: E402

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
PREFILL = dict(batch=4, nheads=16, headdim=128, dtype="bfloat16")
DECODE = dict(batch=1, nheads=32, nheads_k=8, headdim=128, dtype="bfloat16")


# ------------------------------------------------------------------------------------------------
# Driver: one call of one implementation, bracketed by cudaProfilerStart/Stop
# ------------------------------------------------------------------------------------------------
def driver(impl: str, seqlen: int, causal: bool, num_splits: int) -> int:
    import cupy
    if impl in ("cupyflash", "baseline"):
        p = PREFILL
        q, k, v = common.random_qkv(p["batch"], seqlen, seqlen, p["nheads"], p["nheads"],
                                    p["headdim"], p["dtype"])
        if impl == "cupyflash":
            from cupyflash.api import flash_attn_func
            fn = lambda: flash_attn_func(q, k, v, causal=causal)  # noqa: E731
        else:
            from cupyflash.baseline import attention_baseline
            fn = lambda: attention_baseline(q, k, v, causal=causal)  # noqa: E731
    elif impl == "cupyflash_decode":
        p = DECODE
        q = common.random_normal((p["batch"], 1, p["nheads"], p["headdim"]), p["dtype"], 1)
        kc = common.random_normal((p["batch"], seqlen, p["nheads_k"], p["headdim"]), p["dtype"], 2)
        vc = common.random_normal((p["batch"], seqlen, p["nheads_k"], p["headdim"]), p["dtype"], 3)
        cs = cupy.full((p["batch"],), seqlen, dtype=cupy.int32)
        from cupyflash.decode import flash_attn_with_kvcache
        fn = lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=True,  # noqa: E731
                                             num_splits=num_splits)
    else:
        raise SystemExit(f"unknown impl {impl}")
    fn()
    cupy.cuda.Device().synchronize()
    cupy.cuda.runtime.profilerStart()
    fn()
    cupy.cuda.Device().synchronize()
    cupy.cuda.runtime.profilerStop()
    return 0


# ------------------------------------------------------------------------------------------------
# Parent: run the driver under ncu, parse its CSV
# ------------------------------------------------------------------------------------------------
def parse_ncu_csv(text: str) -> dict:
    """Sum each metric over every profiled kernel of ncu's ``--csv`` output.

    Returns ``{"kernels": [names], "dram__bytes_read.sum": int, ...}``; raises ValueError when no
    metric row is found (the text is in the message)."""
    lines = text.splitlines()
    table = ncu_csv_rows(text)
    rows = [dict(zip(table[0], r)) for r in table[1:] if r and r[0] != "ID"]
    out = {m: 0 for m in METRICS}
    kernels, units = {}, {}
    for r in rows:
        name = r.get("Metric Name")
        if name not in METRICS:
            continue
        val = (r.get("Metric Value") or "").replace(",", "").strip()
        if not val or val == "n/a":
            continue
        unit = (r.get("Metric Unit") or "byte").strip().lower()
        scale = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12}.get(unit, 1)
        out[name] += int(round(float(val) * scale))
        kernels[r.get("ID")] = r.get("Kernel Name", "?")
        units[unit] = True
    if not kernels:
        raise ValueError("ncu CSV has no dram__bytes rows:\n" + "\n".join(lines[-30:]))
    out["kernels"] = [kernels[k] for k in sorted(kernels, key=lambda x: int(x) if x.isdigit() else 0)]
    out["units"] = sorted(units)
    return out


def measure(ncu: str, impl: str, seqlen: int, causal: bool, num_splits: int, timeout: float) -> dict:
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--print-units", "base",
           "--csv", "--metrics", ",".join(METRICS), sys.executable, str(Path(__file__).resolve()),
           "--driver", impl, "--seqlen", str(seqlen), "--num-splits", str(num_splits)]
    if causal:
        cmd.append("--causal")
    text, secs, rc = run_profiled(cmd, timeout)
    res = parse_ncu_csv(text)
    res["ncu_seconds"] = secs
    res["ncu_rc"] = rc
    return res


def model_columns(impl, seqlen, causal, num_splits, explain) -> dict:
    from cupyflash import io_model
    if impl == "baseline":
        p = PREFILL
        t = io_model.baseline_traffic(p["batch"], p["nheads"], p["nheads"], seqlen, seqlen,
                                      p["headdim"], p["dtype"], causal)
        return {"model_read": t.read, "model_write": t.write, "model_bytes": t.total,
                "model_terms": t.as_dict()["terms"]}
    if impl == "cupyflash":
        p = PREFILL
        bm, bn = block_sizes(explain)
        t = io_model.prefill_traffic(p["batch"], p["nheads"], p["nheads"], seqlen, seqlen,
                                     p["headdim"], p["dtype"], causal, kv_reuse=True)
        t2 = io_model.prefill_traffic(p["batch"], p["nheads"], p["nheads"], seqlen, seqlen,
                                      p["headdim"], p["dtype"], causal, block_m=bm, block_n=bn)
        return {"model_read": t.read, "model_write": t.write, "model_bytes": t.total,
                "model_bytes_no_reuse": t2.total, "block_m": bm, "block_n": bn}
    p = DECODE
    ns = num_splits
    if not ns and isinstance(explain, dict) and isinstance(explain.get("num_splits"), int):
        ns = explain["num_splits"]
    t = io_model.decode_traffic(p["batch"], p["nheads"], p["nheads_k"], seqlen, p["headdim"],
                                p["dtype"], num_splits=max(ns or 1, 1))
    return {"model_read": t.read, "model_write": t.write, "model_bytes": t.total,
            "num_splits_model": max(ns or 1, 1)}


def block_sizes(explain) -> tuple:
    """(BLOCK_M, BLOCK_N) from an explain() record (template values or the kernel name)."""
    text = json.dumps(explain) if explain else ""
    m = re.search(r"_m(\d+)_n(\d+)", text)
    if m:
        return int(m.group(1)), int(m.group(2))
    bm = re.search(r'"(?:block_m|BLOCK_M)": (\d+)', text)
    bn = re.search(r'"(?:block_n|BLOCK_N)": (\d+)', text)
    return (int(bm.group(1)) if bm else 128), (int(bn.group(1)) if bn else None)


def explain_for(impl, seqlen, causal, num_splits):
    import numpy as np
    if impl == "cupyflash":
        p = PREFILL
        q = np.empty((p["batch"], seqlen, p["nheads"], p["headdim"]), np.float16)
        import ml_dtypes
        q = q.view(ml_dtypes.bfloat16)
        return common.explain_record(q, q, q, causal=causal)
    if impl == "cupyflash_decode":
        import cupy
        p = DECODE
        q = common.random_normal((p["batch"], 1, p["nheads"], p["headdim"]), p["dtype"], 1)
        kc = common.random_normal((p["batch"], seqlen, p["nheads_k"], p["headdim"]), p["dtype"], 2)
        cs = cupy.full((p["batch"],), seqlen, dtype=cupy.int32)
        rec = common.explain_record(q, kc, kc, cache_seqlens=cs, causal=True, num_splits=num_splits,
                                    kind="decode")
        del q, kc
        common.free_memory()
        return rec
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--driver", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seqlen", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--num-splits", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--causal", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--flash-seqlens", nargs="+", type=int, default=None)
    ap.add_argument("--baseline-seqlens", nargs="+", type=int, default=None)
    ap.add_argument("--decode-seqlens", nargs="+", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=None, help="seconds per profiled run")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new profiled run after this many seconds")
    ap.add_argument("--out", type=Path, default=RESULTS / "exp_hbm.jsonl")
    args = ap.parse_args(argv)
    if args.driver:
        return driver(args.driver, args.seqlen, args.causal, args.num_splits)

    signal.signal(signal.SIGTERM, _on_term)
    if not common.have_gpu():
        print("exp_hbm: no CUDA GPU here; nothing to measure")
        return 0
    ncu = find_ncu()
    if ncu is None:
        print("exp_hbm: Nsight Compute (ncu) not found; skipping")
        return 0
    fl = args.flash_seqlens or ([2048, 8192, 32768] if args.quick
                                else [1024, 2048, 4096, 8192, 16384, 32768])
    bl = args.baseline_seqlens or ([1024, 4096] if args.quick else [1024, 2048, 4096, 8192])
    dl = args.decode_seqlens or ([131072] if args.quick else [16384, 131072])
    timeout = args.timeout or (60.0 if args.quick else 120.0)
    budget = args.budget_s or (80.0 if args.quick else 480.0)
    jobs = ([("cupyflash", s, False, 0) for s in fl] + [("baseline", s, False, 0) for s in bl]
            + [("cupyflash_decode", s, False, ns) for s in dl for ns in ((0,) if args.quick else (0, 1))]
            + [("cupyflash", 8192, True, 0)])
    t_start = time.time()
    avail = {i: common.impl_available(i) for i in ("cupyflash", "baseline", "cupyflash_decode")}
    n = 0
    for impl, S, causal, ns in common.progress(jobs, desc="ncu"):
        ok, why = avail[impl]
        if time.time() - t_start > budget:
            print(f"exp_hbm: time budget {budget:.0f} s spent; not profiling {impl} S={S}")
            continue
        if not ok:
            print(f"exp_hbm: skipping {impl}: {why}")
            continue
        p = PREFILL if impl != "cupyflash_decode" else DECODE
        rec = {"what": "hbm", "impl": impl, "seqlen": S, "causal": causal, "num_splits": ns,
               **p, "ncu": ncu, "cache_control": "all (ncu default: caches flushed before each kernel)"}
        try:
            ex = explain_for(impl, S, causal, ns)
            if ex is not None:
                rec.update(common.plan_fields(ex))
            rec.update(model_columns(impl, S, causal, ns, ex))
            m = measure(ncu, impl, S, causal, ns, timeout)
            rec.update(measured_read=m["dram__bytes_read.sum"], measured_write=m["dram__bytes_write.sum"],
                       kernels=m["kernels"], ncu_seconds=m["ncu_seconds"], ncu_rc=m["ncu_rc"])
            rec["measured_bytes"] = rec["measured_read"] + rec["measured_write"]
            rec["measured_over_model"] = rec["measured_bytes"] / rec["model_bytes"]
            print(f"  {impl} S={S} causal={causal} splits={ns}: measured "
                  f"{rec['measured_bytes'] / 1e9:.3f} GB, model {rec['model_bytes'] / 1e9:.3f} GB "
                  f"(x{rec['measured_over_model']:.2f}), {len(m['kernels'])} kernels", flush=True)
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            print(f"  {impl} S={S}: {rec['error'][:600]}", flush=True)
        n += common.append_results(args.out, [rec])
    print(f"exp_hbm: wrote {n} records to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
