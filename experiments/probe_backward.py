"""Does every backward configuration end, and with what error? Each case runs in its own process
under a time limit, so a kernel that never ends is named by its case instead of stalling a test
suite (the first GPU runs of the Hopper backward stalled without naming a test: the log of
2026-12-06 01:20 in experiments/notes/).

Per case (batch, seqlen, nheads, nheads_k, headdim, causal, deterministic, dtype, kernel: the Hopper
plan, sm_90a's default, or the mma.sync one, ``CUPYFLASH_BWD_HOPPER=0``): the forward with
its LSE, the backward twice into fresh buffers, each gradient's error against the float64 NumPy
reference (``cupyflash.testing.backward_error``: relative to the size of its terms), whether the
two runs are bitwise equal, NaN anywhere, the mean time of five more backward calls
(wall clock, synchronised: a sanity figure, not a benchmark; ``bench_backward.py`` times), the
fastest of five CUDA-event times of each kernel of the call (``kernel_ms``: where the time goes),
and
the names of the kernels that ran (so a case that asked for the Hopper plan shows whether it got it).

    PYTHONPATH=. python experiments/probe_backward.py                 # hd 64/128, all masks, both modes
    PYTHONPATH=. python experiments/probe_backward.py --timeout 20 --headdims 128 --deterministic true
    PYTHONPATH=. python experiments/probe_backward.py --kernel hopper --deterministic false

Needs a GPU. Prints one JSON line per case (``status``: ok, error, or timeout) and appends the run
to ``experiments/results/probe_backward.jsonl`` (experiments/common.py).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(2, 333, 4, 2), (2, 2048, 8, 8)]  # (batch, seqlen, nheads, nheads_k)


def run_case(case: dict) -> dict:
    """One case, in this process (the child's side)."""
    import cupy
    import ml_dtypes
    import numpy as np

    from cupyflash import flash_attn_backward, flash_attn_func, testing
    from cupyflash.backward import run as bwd_run
    rng = np.random.default_rng(0)
    b, s, h, hk, d = (case[n] for n in ("batch", "seqlen", "nheads", "nheads_k", "headdim"))
    causal, det = case["causal"], case["deterministic"]
    dt = np.dtype(ml_dtypes.bfloat16 if case["dtype"] == "bfloat16" else np.float16)
    host = [rng.standard_normal((b, s, n, d)).astype(dt) for n in (h, hk, hk, h)]
    # 16-bit floats travel as their bits (CuPy copies them so); 0xFFFF is NaN in both
    q, k, v, dout = (cupy.asarray(x.view(np.uint16)).view(dt) for x in host)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    runs = []
    for _ in range(2):
        bufs = [cupy.full(x.shape, 0xFFFF, dtype=cupy.uint16).view(dt) for x in (q, k, v)]
        flash_attn_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det,
                            dq=bufs[0], dk=bufs[1], dv=bufs[2])
        runs.append([cupy.asnumpy(x.view(cupy.uint16)).view(dt) for x in bufs])
    f64 = [x.astype(np.float64) for x in host]
    errs, _ = testing.backward_error([x.astype(np.float64) for x in runs[0]], f64[3], *f64[:3],
                                     causal=causal)
    launch, events = bwd_run._launch, []

    def timed(kern, *a, **kw):  # each launch between two CUDA events
        ev = (cupy.cuda.Event(), cupy.cuda.Event())
        ev[0].record()
        launch(kern, *a, **kw)
        ev[1].record()
        events.append((kern.name, ev))
    # one more call first: the wall clock of the first calls after the float64 reference (seconds
    # of CPU with the GPU idle) read 21 ms for a 0.5 ms kernel on the H100 (2026-12-06 05:22)
    flash_attn_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det)
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        flash_attn_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det)
    cupy.cuda.Device().synchronize()
    wall = (time.perf_counter() - t0) / 5 * 1e3
    bwd_run._launch = timed
    try:
        for _ in range(5):
            flash_attn_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det)
        cupy.cuda.Device().synchronize()
    finally:
        bwd_run._launch = launch
    kernel_ms = {}
    for name, (a, z) in events:
        kernel_ms[name] = min(kernel_ms.get(name, float("inf")), cupy.cuda.get_elapsed_time(a, z))
    return {"err": dict(zip(("dq", "dk", "dv"), (float(e) for e in errs))),
            "bitwise_equal": dict(zip(("dq", "dk", "dv"),
                                      (a.tobytes() == c.tobytes() for a, c in zip(*runs)))),
            "nan": any(bool(np.isnan(x.astype(np.float32)).any()) for x in runs[0]),
            "ms": wall, "kernel_ms": kernel_ms,
            "kernels": sorted({key[0].name for key in bwd_run._LAUNCHES})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--headdims", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--causal", choices=["both", "true", "false"], default="both")
    ap.add_argument("--deterministic", choices=["both", "true", "false"], default="both")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--kernel", choices=["both", "hopper", "mma"], default="both",
                    help="mma: CUPYFLASH_BWD_HOPPER=0 in the case's process")
    ap.add_argument("--timeout", type=float, default=30, help="seconds per case")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # the child's side: one case as JSON
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "probe_backward.jsonl")
    args = ap.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import common  # experiments/common.py: provenance and JSON Lines runs
    if not common.have_gpu():
        print("probe_backward.py needs an NVIDIA GPU (CuPy found none)", file=sys.stderr)
        return 2
    pick = {"both": (False, True), "true": (True,), "false": (False,)}
    rows = []
    kernels = ("hopper", "mma") if args.kernel == "both" else (args.kernel,)
    for kern, d, causal, det, (b, s, h, hk) in itertools.product(
            kernels, args.headdims, pick[args.causal], pick[args.deterministic], SHAPES):
        case = dict(batch=b, seqlen=s, nheads=h, nheads_k=hk, headdim=d, causal=causal,
                    deterministic=det, dtype=args.dtype, kernel=kern)
        env = dict(os.environ, CUPYFLASH_BWD_HOPPER="1" if kern == "hopper" else "0")
        t0 = time.time()
        try:
            p = subprocess.run([sys.executable, __file__, "--case", json.dumps(case)],
                               capture_output=True, text=True, timeout=args.timeout, env=env)
            if p.returncode == 0:
                row = {"status": "ok", **json.loads(p.stdout.strip().splitlines()[-1])}
            else:
                row = {"status": "error", "stderr": p.stderr.strip()[-800:]}
        except subprocess.TimeoutExpired:
            row = {"status": "timeout"}
        row = {"what": "probe_backward", **case, **row, "seconds": round(time.time() - t0, 1)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        common.append_results(args.out, row)  # case by case: a run cut short keeps its rows
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
