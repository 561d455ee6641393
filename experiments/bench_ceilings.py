"""The two ceilings of the roofline (figure 4), measured on the GPU at hand.

* Memory: a device-to-device copy of ``--copy-gb`` GB (``cudaMemcpyAsync``), bandwidth counting
  bytes read plus bytes written; and a read-only pass (``cupy.sum`` of a float32 array).
* Compute: an ``--n``-cubed bf16 matrix product with float32 accumulation (cuBLAS through
  ``cublasGemmStridedBatchedEx``, as the baseline calls it; and through torch when installed),
  on random data.

    python experiments/bench_ceilings.py [--quick]     # a few seconds

Appends a run (experiments/common.py) to ``experiments/results/bench_ceilings.jsonl``
(``what`` = copy_bw / read_bw / bf16_matmul, ``tbps`` or ``tflops``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--copy-gb", type=float, default=4.0)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_ceilings.jsonl")
    args = ap.parse_args(argv)
    if not common.have_gpu():
        print("bench_ceilings: no CUDA GPU here; nothing to measure")
        return 0
    import cupy
    reps = 10 if args.quick else 30
    recs = []

    nbytes = int(args.copy_gb * 1e9) // 16 * 16
    src = cupy.empty(nbytes // 4, dtype=cupy.float32)
    src[...] = 1.0
    dst = cupy.empty_like(src)

    def copy():
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToDevice,
                                      cupy.cuda.get_current_stream().ptr)
    t = common.benchmark(copy, n_warmup=3, n_repeat=reps)
    recs.append(dict(what="copy_bw", bytes=2 * nbytes, **t, tbps=2 * nbytes / (t["ms"] * 1e-3) / 1e12))
    t = common.benchmark(lambda: src.sum(), n_warmup=3, n_repeat=reps)
    recs.append(dict(what="read_bw", bytes=nbytes, **t, tbps=nbytes / (t["ms"] * 1e-3) / 1e12))
    src = dst = None  # free before the matmul
    common.free_memory()

    n = args.n
    flops = 2 * n ** 3
    try:
        from cupyflash.baseline import _gemm_strided_batched
        a = common.random_normal((n, n), "bfloat16", seed=1)
        b = common.random_normal((n, n), "bfloat16", seed=2)
        c = cupy.empty((n, n), dtype=cupy.float32)
        plan = (0, 0, n, n, n, n, n * n, n, n * n, n, n * n, 1)
        t = common.benchmark(lambda: _gemm_strided_batched(plan, a, b, c, "bfloat16", "float32"),
                             n_warmup=3, n_repeat=reps)
        recs.append(dict(what="bf16_matmul", impl="cublas_gemmex", n=n, **t,
                         tflops=flops / (t["ms"] * 1e-3) / 1e12))
        a = b = c = None
    except Exception as e:
        recs.append(dict(what="bf16_matmul", impl="cublas_gemmex", error=f"{type(e).__name__}: {e}"))
    if common.have_torch():
        try:
            import torch
            a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            t = common.benchmark(lambda: a @ b, n_warmup=3, n_repeat=reps)
            recs.append(dict(what="bf16_matmul", impl="torch", n=n, **t,
                             tflops=flops / (t["ms"] * 1e-3) / 1e12))
            a = b = None
        except Exception as e:
            recs.append(dict(what="bf16_matmul", impl="torch", error=f"{type(e).__name__}: {e}"))
    common.append_results(args.out, recs)
    for r in recs:
        print(f"  {r['what']} {r.get('impl', '')}: " + (f"{r['tbps']:.2f} TB/s" if "tbps" in r else
              f"{r['tflops']:.0f} TFLOP/s" if "tflops" in r else r.get("error", "?")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
