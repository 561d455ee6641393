"""Tile-size sweep of the prefill kernels: every (BLOCK_M, BLOCK_N, warps) specialisation in
``cupyflash.forward.kernels``'s table (mma.sync and, on sm_90a, the Hopper TMA kernel), launched
directly (bypassing the dispatcher), TFLOP/s (figure 7). ``--extra`` adds this script's own
mma.sync tiles (:data:`EXTRA_TILES`: the alternatives the defaults were measured against, which
the dispatcher never chooses and so are not in the table).

bf16, head dims 64 and 128 (any multiple of 8: each kernel at its padded head dim, TFLOP/s
counting the actual one), 16k tokens per batch, hidden 2048, S = 4096 and 8192, not causal
(``--causal`` adds causal). Each configuration's output is compared with a reference computed
once per shape (torch's flash backend if present, else the baseline) so that a fast but wrong
tile shape cannot win. ``chosen`` marks the configuration ``explain()`` picks for the shape.

    python experiments/bench_tiles.py --quick      # S = 4096 only
    python experiments/bench_tiles.py
    python experiments/bench_tiles.py --extra      # and EXTRA_TILES

Appends a run (experiments/common.py) to ``experiments/results/bench_tiles.jsonl`` (impl, dtype,
headdim, seqlen, causal, kernel, family, block_m, block_n, nwarps, ms, tflops, rel_diff, chosen,
extra).
"""
from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS  # noqa: E402

# mma.sync rows (fwd_..._w<warps>) and the Hopper TMA kernel's (fwdtma_..._s<ring stages>); the
# warps come from the launch block
NAME_RE = re.compile(r"^(?P<family>fwd|fwdtma)_(?P<dt>[a-z0-9]+)_hd(?P<hd>\d+)_m(?P<m>\d+)"
                     r"_n(?P<n>\d+)(?:_w(?P<w>\d+)|_s(?P<s>\d+))?(?P<rest>.*)$")


def table_specs():
    """(KernelSpec, parsed name fields) for every tensor-core prefill specialisation."""
    from cupyflash.forward import kernels as prefill
    out = []
    for item in prefill.all_specs():
        spec = getattr(item, "spec", item)
        m = NAME_RE.match(getattr(spec, "name", ""))
        if m:
            out.append((spec, m.groupdict()))
    return out


#: mma.sync tiles (headdim, block_m, block_n, nwarps) measured with ``--extra``, beside the
#: table's rows but not in it. They left cupyflash.forward.kernels.SUPPORTED on 2026-12-02 (issue
#: 34): the dispatcher never chooses them (tests/test_dispatch.py
#: test_table_has_no_unreachable_row), but they are what the defaults were measured against
#: (hd96 / hd128 128x64x4 against 128x64x8 and 128x128x8, experiments/NOTES.md v1).
EXTRA_TILES = ((32, 128, 64, 4), (32, 128, 128, 8), (64, 128, 128, 8), (64, 64, 128, 4),
               (96, 128, 64, 8), (96, 128, 128, 8), (128, 128, 64, 8), (128, 128, 128, 8))


def extra_rows(dtype: str) -> list:
    """:data:`EXTRA_TILES` as rows of ``dtype`` (float16 / bfloat16), built as the table builds
    its mma.sync rows (``kernels.PrefillConfig``; shared memory from ``kernels.layout``)."""
    from cupyflash.forward import kernels as prefill
    if dtype not in prefill.TC_DTYPES:
        return []
    return [prefill.PrefillConfig(dtype, hd, bm, bn, nw, prefill.TC_SOURCE) for hd, bm, bn, nw in EXTRA_TILES]


def extra_specs(dtype: str) -> list:
    """(KernelSpec, parsed name fields, row) for each extra row, causal and not: the table's
    naming and entry (``kernels.spec_of``) applied to :func:`extra_rows`."""
    from cupyflash.forward import kernels as prefill
    out = []
    for row in extra_rows(dtype):
        for causal in (False, True):
            spec = prefill.spec_of(row, causal)
            out.append((spec, NAME_RE.match(spec.name).groupdict(), row))
    return out


@contextlib.contextmanager
def launchable(rows):
    """While open, ``kernels.launch`` (and ``launch_config``) can launch the specs of ``rows``:
    it finds a spec's row by its name (``kernels.config_of``), so their names are registered
    there and removed on exit. ``SUPPORTED`` is untouched: the dispatcher never sees them.
    Raises ValueError for a row whose name the table has already."""
    from cupyflash.forward import kernels as prefill
    added = {}
    for row in rows:
        for causal in (False, True):
            name = prefill.spec_of(row, causal).name
            if name in prefill._BY_NAME:
                raise ValueError(f"{name} is a row of the table, not an extra tile")
            added[name] = (row, causal)
    prefill._BY_NAME.update(added)
    try:
        yield
    finally:
        for name in added:
            prefill._BY_NAME.pop(name, None)


def rel_diff(out, ref) -> float:
    """||out - ref|| / ||ref||; ``ref`` a torch tensor (b, s, h, d) or a CuPy array."""
    import cupy
    if isinstance(ref, cupy.ndarray):
        bits = cupy.uint16
        a = out.view(bits).astype(cupy.uint32) << 16 if str(out.dtype) == "bfloat16" else None
        if a is not None:  # bf16 -> fp32 by its bits, no bf16 arithmetic needed in CuPy
            a = a.view(cupy.float32)
            b = (ref.view(bits).astype(cupy.uint32) << 16).view(cupy.float32)
        else:
            a, b = out.astype(cupy.float32), ref.astype(cupy.float32)
        return float(cupy.linalg.norm(a - b) / cupy.linalg.norm(b))
    a = common.cupy_to_torch(out).float()
    return float((a - ref.float()).norm() / ref.float().norm())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--headdims", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--seqlens", nargs="+", type=int, default=None)
    ap.add_argument("--causal", action="store_true", help="also causal")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting new configurations after this many seconds")
    ap.add_argument("--isa", choices=("tma", "mma"), default=None,
                    help="only this kernel's rows (tma: the Hopper TMA kernel; mma: mma.sync)")
    ap.add_argument("--extra", action="store_true",
                    help="also EXTRA_TILES, mma.sync tiles that are not in the table")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_tiles.jsonl")
    args = ap.parse_args(argv)
    seqlens = args.seqlens or ([4096] if args.quick else [4096, 8192])
    budget = args.budget_s or (60.0 if args.quick else 400.0)
    causals = [False, True] if args.causal else [False]
    if not common.have_gpu():
        print("bench_tiles: no CUDA GPU here; nothing to measure")
        return 0
    try:
        specs = table_specs()
        from cupyflash.core import checks
        from cupyflash.forward import kernels as prefill
        from cupyflash.core.interop import current_stream
    except Exception as e:
        print(f"bench_tiles: cupyflash.forward.kernels unavailable ({type(e).__name__}: {e}); skipping")
        return 0
    import cupy
    from cupyflash import io_model
    t_start = time.time()
    n = 0
    # --extra: EXTRA_TILES beside the table's rows, launchable while the sweep runs
    extras = extra_specs(args.dtype) if args.extra and args.isa in (None, "mma") else []
    extra_names = {spec.name for spec, _, _ in extras}
    with launchable(extra_rows(args.dtype) if extras else []):
        for d in args.headdims:
            for S in seqlens:
                for causal in causals:
                    # every kernel that runs head dim d (prefill.configs_for: each at its own
                    # padded head dim, 72 on the TMA kernel's 128 and the mma.sync kernel's 96);
                    # TFLOP/s count d, not the padding
                    runs_d = {c for c in prefill.configs_for(args.dtype, d)
                              if args.isa is None or c.isa == args.isa}
                    mine = [(s, f) for s, f in specs
                            if prefill.config_of(s) in {(c, causal) for c in runs_d}]
                    mine += [(s, f) for s, f, row in extras if prefill.config_of(s)[1] == causal
                             and row.headdim == prefill.padded_headdim(d, "mma")]
                    if not mine:
                        print(f"bench_tiles: no {args.dtype} hd{d} causal={causal} specialisation in the table")
                        continue
                    B, H = max(1, args.tokens // S), args.hidden // d
                    common.free_memory()
                    q, k, v = common.random_qkv(B, S, S, H, H, d, args.dtype, seed=7)
                    problem = checks.check_attention(q, k, v, causal=causal)
                    flops = io_model.prefill_flops(B, H, S, S, d, causal)
                    ex = common.explain_record(q, k, v, causal=causal)
                    chosen = ex.get("kernel") if isinstance(ex, dict) else None
                    if isinstance(chosen, dict):
                        chosen = chosen.get("name") or chosen.get("spec", {}).get("name")
                    mine.sort(key=lambda sf: sf[0].name != chosen)  # the dispatcher's choice first
                    ref, ref_impl = None, None
                    try:
                        if common.impl_available("torch_flash")[0]:
                            ref = common.torch_sdpa(q, k, v, "flash", causal=causal)().transpose(1, 2)
                            ref_impl = "torch_flash"
                        else:
                            from cupyflash.baseline import attention_baseline
                            ref, ref_impl = attention_baseline(q, k, v, causal=causal), "baseline"
                    except Exception as e:
                        print(f"bench_tiles: no reference output ({type(e).__name__}: {e})")
                    recs = []
                    for spec, f in common.progress(mine, desc=f"tiles hd{d} S={S}"):
                        rec = {"what": "tiles", "impl": "cupyflash", "dtype": args.dtype, "headdim": d,
                               "batch": B, "nheads": H, "seqlen": S, "causal": causal,
                               "kernel": spec.name, "block_m": int(f["m"]), "block_n": int(f["n"]),
                               "family": f["family"],
                               "nwarps": prefill.launch_config(spec, problem)[1][0] // 32,
                               "smem_bytes": getattr(spec, "smem_bytes", None),
                               "chosen": spec.name == chosen,
                               "extra": spec.name in extra_names}
                        if time.time() - t_start > budget:
                            rec["error"] = f"skipped: time budget {budget:.0f} s spent"
                            n += common.append_results(args.out, [rec])
                            continue
                        out = cupy.empty_like(q)
                        lse = cupy.empty((B, H, S), dtype=cupy.float32)

                        def fn(spec=spec, out=out, lse=lse):
                            prefill.launch(spec, q, k, v, out, lse, problem=problem,
                                           stream=current_stream())
                            return out
                        try:
                            t = common.benchmark(fn, n_warmup=2, n_repeat=10 if args.quick else 20)
                            rec.update(t, tflops=flops / (t["ms"] * 1e-3) / 1e12)
                            if ref is not None:
                                rec["rel_diff"] = rel_diff(fn(), ref)
                                rec["rel_diff_vs"] = ref_impl
                        except Exception as e:
                            rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                        n += common.append_results(args.out, [rec])  # now: a timeout keeps what ran
                        recs.append(rec)
                        out = lse = None
                        r = rec
                        print(f"  hd{d} S={S} causal={causal} {r['kernel']}: "
                              + (f"{r['tflops']:.0f} TFLOP/s rel_diff {r.get('rel_diff', float('nan')):.1e}"
                                 if "tflops" in r else r.get("error", "?"))
                              + ("  <- chosen" if r["chosen"] else ""), flush=True)
                    q = k = v = ref = None  # free before the next shape
    print(f"bench_tiles: wrote {n} records to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
