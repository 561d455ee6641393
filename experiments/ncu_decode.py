"""Per-kernel Nsight Compute profile of cupyflash's decode call beside torch SDPA's cuDNN
backend at the same shapes (experiments/NOTES.md v14, v16: why cuDNN streams the short caches
faster).

For each (batch, seqlen_k) this script runs itself in *driver* mode under

    ncu --clock-control none --profile-from-start off --print-units base --csv \
        --section SpeedOfLight --section LaunchStats --section Occupancy \
        --section SchedulerStats --metrics <METRICS>  python ncu_decode.py --driver ...

The driver builds one Llama-3-8B decode problem (32 query heads, 8 KV heads, headdim 128, bf16,
one query token, every sequence full), calls cupyflash (``cache_seqlens`` on the device, the
heuristic's ``num_splits``) and SDPA/cuDNN (``enable_gqa=True`` on transposed views of the same
memory, as ``bench_decode.py``) once each untimed, then once each between
``cudaProfilerStart`` / ``cudaProfilerStop``. ncu flushes the caches before every kernel, so the
durations are cold and serialised (programmatic dependent launch does not overlap anything
here). One record per profiled kernel: its grid, block, registers, shared memory, duration,
DRAM throughput (% of peak) and bytes, issue rate and executed warp instructions.

    python experiments/ncu_decode.py                       # b64 x 1k, b16 x 2k, b16 x 1k, b1 x 1k
    python experiments/ncu_decode.py --shapes 64,1024
    python experiments/ncu_decode.py --shapes 1,16384,16 1,16384   # a paged cache (pages of 16)

A third number in a shape is a page size: cupyflash then reads a paged copy of the cache (pages
in a shuffled order, as ``bench_decode.py``), and cuDNN the contiguous one (it has no paged
path), so that the two records of the shape compare the paged kernel with cuDNN's.
    python experiments/ncu_decode.py --import-csv ncu.csv --shapes 64,1024 16,2048 --commit SHA

``--import-csv`` parses a CSV that ncu wrote for the same calls elsewhere (the v16 table was
captured so: per shape, cupyflash's call, then cuDNN's), assigns the kernels to ``--shapes`` in
call order (a shape starts at each cupyflash kernel: the call without an append is one kernel)
and appends the records with the commit given. Appends to
``experiments/results/ncu_decode.jsonl``; skips with a message when ncu or torch is missing.
"""
from __future__ import annotations

import argparse
import csv
import io
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS  # noqa: E402
import exp_hbm  # noqa: E402  (find_ncu, the child-process handling)

H, HK, D, DTYPE = 32, 8, 128, "bfloat16"
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "SchedulerStats", "WarpStateStats",
            "MemoryWorkloadAnalysis")
METRICS = ("dram__bytes_read.sum", "smsp__inst_executed.sum", "gpu__time_duration.sum")
#: record field <- ncu metric name (sections and METRICS), numbers parsed without separators
FIELDS = {
    "duration_ns": "gpu__time_duration.sum",
    "dram_bytes_read": "dram__bytes_read.sum",
    "warp_instructions": "smsp__inst_executed.sum",
    "dram_throughput_pct": "DRAM Throughput",
    "registers_per_thread": "Registers Per Thread",
    "dynamic_smem_bytes": "Dynamic Shared Memory Per Block",
    "achieved_occupancy_pct": "Achieved Occupancy",
    "issued_warps_per_scheduler": "Issued Warp Per Scheduler",
    "warp_cycles_per_issued_instruction": "Warp Cycles Per Issued Instruction",
    "l2_hit_rate_pct": "L2 Hit Rate",
    "sm_frequency_hz": "SM Frequency",
}
#: ``--stalls``: where a warp's cycles between two issued instructions go (ncu's warp-state
#: breakdown, averaged per issued instruction; they sum to ``warp_cycles_per_issued_instruction``)
STALLS = ("barrier", "long_scoreboard", "short_scoreboard", "wait", "mio_throttle", "lg_throttle",
          "math_pipe_throttle", "no_instruction", "membar", "dispatch_stall", "selected",
          "not_selected", "branch_resolving", "drain", "sleeping", "misc")
STALL_FIELDS = {f"stall_{r}": f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio"
                for r in STALLS}


# ------------------------------------------------------------------------------------------------
# Driver: one untimed and one profiled call of each implementation
# ------------------------------------------------------------------------------------------------
def driver(batch: int, seqlen: int, page: int = 0) -> int:
    import cupy
    import numpy as np
    from cupyflash.decode import flash_attn_with_kvcache
    q = common.random_normal((batch, 1, H, D), DTYPE, seed=1)
    kc = common.random_normal((batch, seqlen, HK, D), DTYPE, seed=2)
    vc = common.random_normal((batch, seqlen, HK, D), DTYPE, seed=3)
    cs = cupy.full((batch,), seqlen, dtype=cupy.int32)
    kp, vp, bt = kc, vc, None
    if page:  # the same buffers as a pool of pages, read through a shuffled table (as
        # bench_decode.py: the keys' order differs from cuDNN's contiguous call, the bytes do not)
        n = batch * seqlen // page
        perm = np.random.default_rng(batch * seqlen + page).permutation(n)
        bt = cupy.asarray(perm.reshape(batch, seqlen // page).astype(np.int32))
        kp, vp = kc.reshape(n, page, HK, D), vc.reshape(n, page, HK, D)
    fns = [lambda: flash_attn_with_kvcache(q, kp, vp, cache_seqlens=cs, block_table=bt,
                                           causal=True, validate=False)]
    try:
        fns.append(common.torch_sdpa(q, kc, vc, "cudnn", causal=False, enable_gqa=True))
    except Exception as e:  # noqa: BLE001
        print(f"ncu_decode: torch cuDNN unavailable: {type(e).__name__}: {e}", flush=True)
    def sync():
        cupy.cuda.Device().synchronize()
        if len(fns) > 1:  # torch's stream too
            import torch
            torch.cuda.synchronize()

    for fn in fns:
        fn()
    sync()
    for fn in fns:
        cupy.cuda.runtime.profilerStart()
        fn()
        sync()
        cupy.cuda.runtime.profilerStop()
    return 0


# ------------------------------------------------------------------------------------------------
# Parent: run the driver under ncu; parse its CSV into one record per kernel
# ------------------------------------------------------------------------------------------------
#: unit -> factor to the base unit (bytes, nanoseconds, hertz); others (%, counts) are kept
_SCALE = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9,
          "ns": 1, "nsecond": 1, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6,
          "hz": 1, "khz": 1e3, "mhz": 1e6, "ghz": 1e9}


def _number(text: str, unit: str = ""):
    t = (text or "").replace(",", "").strip()
    if not t or t == "n/a":
        return None
    try:
        v = float(t) * _SCALE.get((unit or "").strip().lower(), 1)
    except ValueError:
        return None
    return int(v) if float(v).is_integer() else v


def impl_of(kernel_name: str) -> str:
    """``cupyflash`` for this library's kernels (``cf::``), ``torch_cudnn`` for cuDNN's,
    ``other`` otherwise."""
    if "cf::" in kernel_name:
        return "cupyflash"
    if "cudnn" in kernel_name:
        return "torch_cudnn"
    return "other"


def parse_kernels(text: str) -> list:
    """One dict per profiled kernel of ncu's ``--csv --page details`` output (the ``ID`` order):
    ``id``, ``kernel``, ``impl``, ``grid``, ``block`` (tuples), and the :data:`FIELDS` found.
    Raises ValueError when the text has no ncu CSV header or no kernel rows."""
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu CSV header in output:\n" + "\n".join(lines[-30:]))
    rows = csv.DictReader(io.StringIO("\n".join(l for l in lines[start:] if l.startswith('"'))))
    by_name = {v: k for k, v in {**FIELDS, **STALL_FIELDS}.items()}
    kernels = {}
    for r in rows:
        kid = r.get("ID")
        if kid is None or r.get("Metric Name") is None:
            continue
        k = kernels.setdefault(kid, {
            "id": int(kid) if kid.isdigit() else kid, "kernel": r.get("Kernel Name", "?"),
            "grid": _dims(r.get("Grid Size")), "block": _dims(r.get("Block Size"))})
        field = by_name.get(r["Metric Name"])
        if field is not None:
            v = _number(r.get("Metric Value"), r.get("Metric Unit"))
            if v is not None:
                k[field] = v
    if not kernels:
        raise ValueError("ncu CSV has no kernel rows:\n" + "\n".join(lines[-30:]))
    out = [kernels[k] for k in sorted(kernels, key=lambda x: int(x) if x.isdigit() else 0)]
    for k in out:
        k["impl"] = impl_of(k["kernel"])
    return out


def split_by_call(kernels) -> list:
    """The kernels of several shapes' profiled calls, grouped per shape: a group starts at each
    cupyflash kernel (per shape the driver profiles cupyflash's one-kernel call first)."""
    groups = []
    for k in kernels:
        if k["impl"] == "cupyflash" or not groups:
            groups.append([])
        groups[-1].append(k)
    return groups


def _dims(text):
    nums = [int(x) for x in (text or "").strip("() ").split(",") if x.strip().isdigit()]
    return tuple(nums) if len(nums) == 3 else None


def measure(ncu: str, batch: int, seqlen: int, timeout: float, page: int = 0,
            stalls: bool = False) -> tuple:
    metrics = METRICS + (tuple(STALL_FIELDS.values()) if stalls else ())
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--print-units", "base",
           "--csv", "--page", "details", *[a for s in SECTIONS for a in ("--section", s)],
           "--metrics", ",".join(metrics), sys.executable, str(Path(__file__).resolve()),
           "--driver", "--batch", str(batch), "--seqlen", str(seqlen), "--page", str(page)]
    text, secs, rc = exp_hbm.run_profiled(cmd, timeout)
    return parse_kernels(text), secs, rc


def records(kernels, batch, seqlen, base, page: int = 0) -> list:
    """One record per kernel; ``page_size`` is the cache layout cupyflash read (0: contiguous);
    cuDNN's kernels always read the contiguous cache."""
    kv_bytes = 2 * batch * seqlen * HK * D * 2
    return [dict(base, what="ncu_decode", batch=batch, seqlen_k=seqlen, nheads=H, nheads_k=HK,
                 headdim=D, dtype=DTYPE, kv_bytes=kv_bytes,
                 page_size=page if k.get("impl") == "cupyflash" else 0, **k) for k in kernels]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--seqlen", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--page", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--shapes", nargs="+", default=["64,1024", "16,2048", "16,1024", "1,1024"],
                    help="batch,seqlen_k pairs, or batch,seqlen_k,page_size (a paged cache)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per profiled run")
    ap.add_argument("--import-csv", type=Path, default=None)
    ap.add_argument("--commit", default=None, help="with --import-csv: the commit that ran")
    ap.add_argument("--gpu", default="NVIDIA H200", help="with --import-csv")
    ap.add_argument("--source", default=None, help="with --import-csv: how the CSV was made")
    ap.add_argument("--out", type=Path, default=RESULTS / "ncu_decode.jsonl")
    ap.add_argument("--stalls", action="store_true",
                    help="also record the warp-state stall breakdown (stall_* fields)")
    args = ap.parse_args(argv)
    if args.driver:
        return driver(args.batch, args.seqlen, args.page)
    shapes = []
    for sh in args.shapes:
        t = tuple(int(x) for x in sh.split(","))
        if len(t) not in (2, 3) or min(t) < (0 if len(t) == 3 else 1) or (
                len(t) == 3 and t[2] and (t[1] % t[2] or t[2] > t[1])):
            ap.error(f"--shapes: expected batch,seqlen_k or batch,seqlen_k,page_size with the "
                     f"page size dividing seqlen_k, got {sh!r}")
        shapes.append(t if len(t) == 3 else t + (0,))
    if args.import_csv is not None:
        if not args.commit:
            ap.error("--import-csv needs --commit")
        groups = split_by_call(parse_kernels(args.import_csv.read_text()))
        if len(groups) != len(shapes):
            ap.error(f"--import-csv: {len(groups)} cupyflash calls in the CSV, {len(shapes)} "
                     "--shapes")
        base = {"gpu": args.gpu, "commit": args.commit,
                "source": args.source or f"imported {args.import_csv.name}",
                "clock_control": "none", "cache_control": "all"}
        recs = [r for (b, sq, pg), ks in zip(shapes, groups) for r in records(ks, b, sq, base, pg)]
        common.append_jsonl(args.out, recs)
        print(f"ncu_decode: {len(recs)} kernel records -> {args.out}")
        return 0

    signal.signal(signal.SIGTERM, exp_hbm._on_term)
    if not common.have_gpu():
        print("ncu_decode: no CUDA GPU here; nothing to measure")
        return 0
    ncu = exp_hbm.find_ncu()
    if ncu is None:
        print("ncu_decode: Nsight Compute (ncu) not found; skipping")
        return 0
    prov = common.provenance()
    n = 0
    for batch, seqlen, page in shapes:
        base = {"gpu": prov.get("gpu"), "commit": prov["commit"], "provenance": prov, "ncu": ncu,
                "clock_control": "none", "cache_control": "all"}
        try:
            ks, secs, rc = measure(ncu, batch, seqlen, args.timeout, page, args.stalls)
            recs = records(ks, batch, seqlen, dict(base, ncu_seconds=secs, ncu_rc=rc), page)
        except Exception as e:  # noqa: BLE001
            recs = [dict(base, what="ncu_decode", batch=batch, seqlen_k=seqlen, page_size=page,
                         error=f"{type(e).__name__}: {str(e)[:1500]}")]
        for r in recs:
            if "error" in r:
                print(f"  B={batch} S={seqlen}: {r['error'][:600]}", flush=True)
            else:
                print(f"  B={batch} S={seqlen} p={r['page_size']} {r['impl']:12s} grid "
                      f"{r['grid']} block {r['block']} {r.get('duration_ns', 0) / 1e3:7.2f} us "
                      f"DRAM {r.get('dram_throughput_pct', float('nan'))}% L2 hit "
                      f"{r.get('l2_hit_rate_pct', float('nan'))}% "
                      f"{r.get('warp_instructions', 0) / 1e6:.1f} M warp instructions, "
                      f"{r.get('warp_cycles_per_issued_instruction', float('nan'))} cycles per "
                      "issue", flush=True)
        common.append_jsonl(args.out, recs)
        n += len(recs)
    print(f"ncu_decode: wrote {n} records to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
