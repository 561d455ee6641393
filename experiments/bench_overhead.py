"""Host-side costs of a call (issue 4): cold JIT compile of one specialisation, and the warm
per-call overhead of the public functions against a bare launch of the same kernel.

* cold compile: a fresh process with an empty CuPy kernel cache (``CUPY_CACHE_DIR`` pointed at a
  new temporary folder) times the first ``flash_attn_func`` call (NVRTC + module load + launch),
  then the second call in a second fresh process that reuses that cache (disk-cache hit);
* warm overhead: host microseconds per call over many calls on a tiny problem (the kernels queue
  asynchronously, so this is the Python cost), for ``flash_attn_func``,
  ``flash_attn_varlen_func(validate=False)`` and ``flash_attn_with_kvcache(validate=False)``,
  beside a bare ``RawKernel`` launch of the prefill kernel with prebuilt arguments.

    PYTHONPATH=. python experiments/bench_overhead.py          # appends results/bench_overhead.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_overhead.jsonl"

_COLD = r"""
import json, sys, time
t0 = time.perf_counter()
import cupy, numpy as np, cupyflash
q = cupy.asarray(np.random.default_rng(0).standard_normal((1, 256, 8, 128)).astype(np.float16))
t1 = time.perf_counter()
out = cupyflash.flash_attn_func(q, q, q, causal=True)
cupy.cuda.Device().synchronize()
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "first_call_s": t2 - t1,
                  "kernel": cupyflash.explain(q, q, q, causal=True).kernel.name}))
"""


def cold_compile(cache_dir: str) -> dict:
    env = dict(os.environ, CUPY_CACHE_DIR=cache_dir)
    p = subprocess.run([sys.executable, "-c", _COLD], env=env, capture_output=True, text=True,
                       timeout=120)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def per_call_us(f, n: int) -> float:
    f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return 1e6 * (time.perf_counter() - t0) / n


def warm_overheads(n: int) -> list[dict]:
    import cupy
    import numpy as np

    import cupyflash
    from cupyflash import checks, dispatch, jit, prefill

    rng = np.random.default_rng(0)
    dev = lambda shape, dt=np.float16: cupy.asarray(rng.standard_normal(shape).astype(dt))  # noqa: E731
    q = dev((1, 128, 8, 64))
    out = cupy.empty_like(q)
    cu = cupy.asarray(np.array([0, 128], np.int32))
    qv = q.reshape(128, 8, 64)
    outv = cupy.empty_like(qv)
    qd, kc, vc = dev((4, 1, 32, 128)), dev((4, 1024, 8, 128)), dev((4, 1024, 8, 128))
    lens = cupy.full((4,), 1000, cupy.int32)
    outd = cupy.empty_like(qd)
    calls = {
        "flash_attn_func": lambda: cupyflash.flash_attn_func(q, q, q, out=out),
        "flash_attn_varlen_func(validate=False)": lambda: cupyflash.flash_attn_varlen_func(
            qv, qv, qv, cu, cu, 128, 128, out=outv, validate=False),
        "flash_attn_with_kvcache(validate=False, num_splits=1)":
            lambda: cupyflash.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, num_splits=1,
                                                      out=outd, validate=False),
        "flash_attn_with_kvcache(validate=False, num_splits=0)":
            lambda: cupyflash.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, num_splits=0,
                                                      out=outd, validate=False),
    }
    # the bare launch of the kernel flash_attn_func runs, arguments prebuilt
    p = checks.check_attention(q, q, q)
    spec = dispatch.launch_plan(p).kernel.spec
    lse = cupy.empty((1, 8, 128), cupy.float32)
    args = prefill.kernel_args(spec, q, q, q, out, lse, problem=p)
    grid, block, smem = prefill.launch_config(spec, p)
    kern = jit.get_kernel(spec)
    calls["bare RawKernel launch (same prefill kernel)"] = lambda: kern(grid, block, args,
                                                                        shared_mem=smem)
    recs = []
    for name, f in calls.items():
        us = min(per_call_us(f, n) for _ in range(3))
        cupy.cuda.Device().synchronize()
        recs.append({"what": "warm_call", "call": name, "us_per_call": round(us, 2)})
        print(f"  {name:58s} {us:7.1f} us/call")
    return recs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--quick", action="store_true", help="1000 calls per measurement")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if args.quick:
        args.calls = 1000
    prov = common.provenance()
    recs = []
    with tempfile.TemporaryDirectory() as cache:
        cold = cold_compile(cache)
        warm = cold_compile(cache)  # same cache folder: disk-cache hit, new process
    recs.append({"what": "cold_compile", **cold, "disk_cache_hit_first_call_s": warm["first_call_s"]})
    print(f"  cold first call (NVRTC + load + launch) {cold['first_call_s']:.2f} s "
          f"({cold['kernel']}); with CuPy's disk cache {warm['first_call_s']:.2f} s")
    recs += warm_overheads(args.calls)
    n = common.append_jsonl(args.out, [{**r, **prov} for r in recs])
    print(f"bench_overhead: wrote {n} records to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
