"""Prefill throughput: cupyflash vs torch SDPA (FlashAttention-2 and cuDNN backends) vs the
materialising baseline, timed side by side in one run (issue 4's benchmark; figure 1).

Shapes follow FlashAttention-2's benchmark: 16k tokens per batch (``batch = max(1, 16384 / S)``),
hidden 2048 (``nheads = 2048 / headdim``), self-attention (``seqlen_q = seqlen_k = S``).
TFLOP/s = ``4 * batch * nheads * pairs * headdim / time`` with the causal pairs counted exactly
(``cupyflash.io_model.prefill_flops``). The baseline runs only while its ``S x S`` matrices fit
(``--baseline-max-seqlen``).

    python experiments/bench_prefill.py --quick       # bf16, S in {1k, 4k, 16k}: ~1 min on an H200
    python experiments/bench_prefill.py               # bf16 + fp16, hd 64/128, S = 512 .. 32768

Appends a run to ``experiments/results/bench_prefill.jsonl`` (its header: commit, GPU, versions;
experiments/common.py): per record impl, dtype, headdim, batch, nheads, seqlen, causal, ms,
tflops, the timing spread, for cupyflash the kernel its plan chose (``plan_kernel``) and
``measured_over_roofline`` (the time over ``explain()``'s roofline prediction), its peak extra
device memory, and the output's relative difference to torch's flash backend. Impls: ``fa3``
(FlashAttention-3, when ``fa3_fwd_interface`` imports: ../shared/peers/README.md; bf16 only; the
run says why when it is skipped), ``torch_cudnn``, ``torch_flash`` (FlashAttention-2 in torch),
``baseline`` (materialising).

``--rounds R`` times the impls of a shape in R interleaved rounds (round r times every impl once,
in turn) and keeps, per impl, the round with the median time (its ``ms``, spread and
``host_ms``; every round's ``ms`` in ``ms_rounds``): a ratio between two impls then rests on
R side-by-side timings, not on one each (single sweeps move by a few percent from run to run).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS  # noqa: E402

IMPLS = ("cupyflash", "fa3", "torch_flash", "torch_cudnn", "baseline")


def _fa3_fn(q, k, v, causal):
    """FlashAttention-3 (the ``fa3_fwd`` wheel's ``fa3_fwd_interface``; bf16 only) on torch views
    of the same memory."""
    import fa3_fwd_interface as fa3
    if str(q.dtype) != "bfloat16":
        raise ValueError(f"fa3: the wheel runs bfloat16 only, got {q.dtype}")
    qt, kt, vt = (common.cupy_to_torch(x) for x in (q, k, v))

    def run():
        out = fa3.flash_attn_func(qt, kt, vt, causal=causal)
        return out[0] if isinstance(out, tuple) else out
    return run


def make_fn(impl, q, k, v, causal):
    """A no-argument callable computing attention with ``impl`` (raises if unavailable)."""
    if impl == "cupyflash":
        from cupyflash.api import flash_attn_func
        return lambda: flash_attn_func(q, k, v, causal=causal)
    if impl == "baseline":
        from cupyflash.baseline import attention_baseline
        return lambda: attention_baseline(q, k, v, causal=causal)
    if impl.startswith("torch_"):
        return common.torch_sdpa(q, k, v, impl[len("torch_"):], causal=causal)
    if impl == "fa3":
        return _fa3_fn(q, k, v, causal)
    raise ValueError(f"impl: unknown {impl!r}; known: {IMPLS}")


def rel_diff_vs(out_cupy, ref_torch_bhsd) -> float:
    """||out - ref|| / ||ref|| with out (b, s, h, d) CuPy and ref (b, h, s, d) torch."""
    a = common.cupy_to_torch(out_cupy).float()
    b = ref_torch_bhsd.transpose(1, 2).float()
    return float((a - b).norm() / b.norm())


def time_interleaved(fns: dict, rounds: int, **bench) -> dict:
    """Per impl of ``fns`` (name -> callable), the :func:`common.benchmark` record of the round
    with the median ``ms`` over ``rounds`` interleaved rounds (round r times every impl once, in
    the order given), with every round's ``ms`` in ``ms_rounds`` and ``rounds``; or the
    exception an impl raised (it is then left out of the later rounds)."""
    runs = {impl: [] for impl in fns}
    out = {}
    for _ in range(rounds):
        for impl, fn in fns.items():
            if impl in out:  # raised in an earlier round
                continue
            try:
                runs[impl].append(common.benchmark(fn, **bench))
            except Exception as e:  # noqa: BLE001 - the caller records it
                out[impl] = e
    for impl, ts in runs.items():
        if impl not in out:
            out[impl] = dict(common.median_round(ts), ms_rounds=[t["ms"] for t in ts],
                             rounds=len(ts))
    return out


def _failed(rec: dict, e: Exception, dtype, d, S, causal) -> None:
    """Record why ``rec``'s impl failed, and say so."""
    rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    print(f"bench_prefill: {rec['impl']} {dtype} hd{d} S={S} causal={causal}: {rec['error']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="reduced sweep (bf16, S in 1k/4k/16k)")
    ap.add_argument("--dtypes", nargs="+", default=None)
    ap.add_argument("--headdims", nargs="+", type=int, default=[64, 128, 256])
    ap.add_argument("--seqlens", nargs="+", type=int, default=None)
    ap.add_argument("--causal", choices=["both", "true", "false"], default="both")
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per batch (batch = tokens / S)")
    ap.add_argument("--hidden", type=int, default=2048, help="nheads = hidden / headdim")
    ap.add_argument("--baseline-max-seqlen", type=int, default=8192)
    ap.add_argument("--n-warmup", type=int, default=3)
    ap.add_argument("--n-repeat", type=int, default=None)
    ap.add_argument("--no-memory", action="store_true", help="skip cupyflash's peak-memory measurement")
    ap.add_argument("--rounds", type=int, default=1,
                    help="interleaved timing rounds per shape (module docstring)")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_prefill.jsonl")
    args = ap.parse_args(argv)
    dtypes = args.dtypes or (["bfloat16"] if args.quick else ["bfloat16", "float16"])
    seqlens = args.seqlens or ([1024, 4096, 16384] if args.quick
                               else [512, 1024, 2048, 4096, 8192, 16384, 32768])
    causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    n_repeat = args.n_repeat or (10 if args.quick else 20)
    if args.rounds < 1:
        ap.error(f"--rounds: expected an int >= 1, got {args.rounds}")

    if not common.have_gpu():
        print("bench_prefill: no CUDA GPU here; nothing to measure")
        return 0
    from cupyflash import io_model
    impls = common.available_impls(args.impls, "bench_prefill")
    prov = common.provenance()
    print(f"bench_prefill: {prov.get('gpu')} commit {prov['commit'][:10]} -> {args.out}")

    grid = [(dt, d, s, c) for dt in dtypes for d in args.headdims for s in seqlens for c in causals]
    n_written = 0
    for dtype, d, S, causal in common.progress(grid, desc="prefill"):
        B, H = max(1, args.tokens // S), args.hidden // d
        common.free_memory()
        q, k, v = common.random_qkv(B, S, S, H, H, d, dtype, seed=S + d)
        flops = io_model.prefill_flops(B, H, S, S, d, causal)
        base = {"what": "prefill", "dtype": dtype, "headdim": d, "batch": B, "nheads": H,
                "nheads_k": H, "seqlen": S, "causal": causal, "flops": flops}
        torch_ref = None
        records, fns = [], {}
        for impl in impls:
            if impl == "baseline" and S > args.baseline_max_seqlen:
                continue
            records.append(dict(base, impl=impl))
            try:
                fns[impl] = make_fn(impl, q, k, v, causal)
            except Exception as e:  # record why, keep going
                _failed(records[-1], e, dtype, d, S, causal)
        timed = time_interleaved(fns, args.rounds, n_warmup=args.n_warmup, n_repeat=n_repeat)
        for rec in records:
            impl = rec["impl"]
            if "error" in rec:
                continue
            if isinstance(timed[impl], Exception):
                _failed(rec, timed[impl], dtype, d, S, causal)
                continue
            fn, t = fns[impl], timed[impl]
            try:
                rec.update(t, tflops=flops / (t["ms"] * 1e-3) / 1e12)
                if impl.startswith("torch_"):
                    rec["torch_layout"] = getattr(fn, "layout", None)
                if impl == "torch_flash":
                    torch_ref = fn()
                if impl == "cupyflash":
                    ex = common.explain_record(q, k, v, causal=causal)
                    rec.update(common.plan_fields(ex))
                    roof = ex.get("roofline_ms")
                    if roof:  # explain()'s prediction against the measurement
                        rec["measured_over_roofline"] = t["ms"] / roof
                    if not args.no_memory:
                        rec.update(common.peak_extra_memory_cupy(fn))
                        rec["model_extra_bytes"] = io_model.prefill_extra_memory(B, H, S)
            except Exception as e:  # record why, keep going
                _failed(rec, e, dtype, d, S, causal)
        # correctness beside speed: each output against torch's flash backend on the same inputs
        if torch_ref is not None:
            for rec in records:
                if rec["impl"] in ("cupyflash", "baseline", "fa3") and "error" not in rec:
                    try:
                        rec["rel_diff_vs_torch_flash"] = rel_diff_vs(fns[rec["impl"]](),
                                                                     torch_ref)
                    except Exception as e:
                        rec["rel_diff_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        n_written += common.append_results(args.out, records)
        del q, k, v, torch_ref
        summary = "  ".join(f"{r['impl']}={r['tflops']:.0f}" for r in records if "tflops" in r)
        print(f"  {dtype} hd{d} B={B} H={H} S={S} causal={causal}: TFLOP/s {summary}", flush=True)
    print(f"bench_prefill: wrote {n_written} records to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
