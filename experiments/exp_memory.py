"""Peak extra device memory vs sequence length: the materialising baseline's O(S^2) score and
probability matrices against the tiled kernel's O(S) LSE (figure 2).

One sequence (batch 1), 16 heads of 128 (hidden 2048), bf16, self-attention, not causal. For
each S, each implementation is called once to warm up (compilation, library workspaces), the
allocator's cache is emptied, and the call is repeated: the growth of CuPy's memory pool during
that call (torch: ``max_memory_allocated``) minus the output's bytes is the peak extra memory.
The model's prediction (``io_model.baseline_extra_memory`` / ``prefill_extra_memory``) is
recorded beside it.

    python experiments/exp_memory.py --quick     # S = 1k .. 32k (baseline to 8k): ~20 s
    python experiments/exp_memory.py             # baseline up to 16k (S and P: 26 GB)

Appends a run (experiments/common.py) to ``experiments/results/exp_memory.jsonl``.
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
    ap.add_argument("--seqlens", nargs="+", type=int,
                    default=[1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--baseline-max-seqlen", type=int, default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--nheads", type=int, default=16)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=RESULTS / "exp_memory.jsonl")
    args = ap.parse_args(argv)
    base_max = args.baseline_max_seqlen or (8192 if args.quick else 16384)
    if not common.have_gpu():
        print("exp_memory: no CUDA GPU here; nothing to measure")
        return 0
    from cupyflash import io_model
    B, H, d, dt = args.batch, args.nheads, args.headdim, args.dtype
    impls = common.available_impls(("cupyflash", "baseline", "torch_flash"), "exp_memory")
    n = 0
    for S in common.progress(args.seqlens, desc="memory"):
        common.free_memory()
        q, k, v = common.random_qkv(B, S, S, H, H, d, dt, seed=S)
        recs = []
        for impl in impls:
            if impl == "baseline" and S > base_max:
                continue
            rec = {"what": "memory", "impl": impl, "dtype": dt, "batch": B, "nheads": H,
                   "headdim": d, "seqlen": S, "causal": False,
                   "input_bytes": int(q.nbytes + k.nbytes + v.nbytes)}
            try:
                if impl == "cupyflash":
                    from cupyflash.api import flash_attn_func
                    rec.update(common.peak_extra_memory_cupy(lambda: flash_attn_func(q, k, v)))
                    rec["model_extra_bytes"] = io_model.prefill_extra_memory(B, H, S)
                    rec.update(common.plan_fields(common.explain_record(q, k, v)))
                elif impl == "baseline":
                    from cupyflash.baseline import attention_baseline
                    rec.update(common.peak_extra_memory_cupy(lambda: attention_baseline(q, k, v)))
                    rec["model_extra_bytes"] = io_model.baseline_extra_memory(B, H, H, S, S, d, dt)
                else:
                    fn = common.torch_sdpa(q, k, v, "flash")
                    rec.update(common.peak_extra_memory_torch(fn))
                    rec["model_extra_bytes"] = io_model.prefill_extra_memory(B, H, S)
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            recs.append(rec)
        n += common.append_results(args.out, recs)
        print(f"  S={S}: " + "  ".join(
            f"{r['impl']}={r['peak_extra_bytes'] / 2**20:.1f} MiB (model {r['model_extra_bytes'] / 2**20:.1f})"
            if "peak_extra_bytes" in r else f"{r['impl']}: {r.get('error')}" for r in recs), flush=True)
        q = k = v = None  # free before the next size
    print(f"exp_memory: wrote {n} records to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
