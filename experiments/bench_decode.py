"""Decode throughput: split-KV cupyflash vs torch SDPA (flash, cuDNN; ``enable_gqa=True``) vs the
materialising baseline, over contiguous and paged KV caches (issue 5's benchmark; figure 5).

Llama-3-8B attention shapes: 32 query heads, 8 KV heads, headdim 128, bf16, one new token per
sequence, every sequence holding ``seqlen_k`` cached keys. Bandwidth counts the K and V bytes
once: ``TB/s = 2 * batch * seqlen_k * nheads_k * headdim * 2 B / time``. Timed with the L2
flushed between calls (a 1k-key cache would otherwise sit in the 60 MB L2).

Three parts, all appended to ``experiments/results/bench_decode.jsonl``:

* ``sweep="main"``: batch x cache length x layout (contiguous, pages of 16 and 256 tokens with a
  shuffled block table), cupyflash with its heuristic ``num_splits`` and torch (contiguous only);
* ``sweep="unsplit"``: cupyflash with ``num_splits=1`` (FlashAttention without split-KV: one
  thread block per (sequence, KV head)) and the baseline, contiguous;
* ``sweep="splits"``: batch 1, ``num_splits`` from 1 to 128 (figure 5, left).

Besides ``cupyflash`` (the serving call: ``cache_seqlens`` a device array), the main sweep times
``cupyflash_dense``: the same call with ``cache_seqlens=None`` (attend to the whole cache), which
is what SDPA is given; the difference is the cost of reading the lengths on the device; and
``cupyflash_plain``: the default call launched through ``cupy.RawKernel`` instead of as a
programmatic dependent launch (``cupyflash.decode.pdl_launches(False)``; experiments/NOTES.md v15).

    python experiments/bench_decode.py --quick        # ~1 min on an H200
    python experiments/bench_decode.py                # batch {1, 16, 64}, cache 128 .. 128k

The short caches (128-512 keys: early tokens of a served batch) were added on 2026-11-29
(commit 0b915a2; experiments/NOTES.md v41-v44), where the gap to cuDNN was largest; pages of 256
start at 256 keys.

Fields (a run's header holds the commit, GPU and versions: experiments/common.py): impl, dtype,
batch, nheads, nheads_k, headdim, seqlen_k, page_size, num_splits (as requested;
``num_splits_chosen`` from explain() for 0), us, tbps, ``plan_kernel`` (the kernel the plan
chose), ``model_bytes`` (io_model's HBM bytes at the chosen split count).
"""
from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS  # noqa: E402

H, HK, D, DTYPE = 32, 8, 128, "bfloat16"


def decode_fn(q, kc, vc, cache_seqlens, block_table, num_splits, pdl=None):
    """The timed call. ``pdl=False``: launched through cupy.RawKernel, without programmatic
    dependent launch (cupyflash.decode.PDL), for the ablation row ``cupyflash_plain``."""
    from cupyflash.decode import flash_attn_with_kvcache
    kw = dict(cache_seqlens=cache_seqlens, block_table=block_table, causal=True,
              num_splits=num_splits)
    if "validate" in inspect.signature(flash_attn_with_kvcache).parameters:
        kw["validate"] = False  # no host copy of cache_seqlens inside the timed call
    if pdl is None:
        return lambda: flash_attn_with_kvcache(q, kc, vc, **kw)

    def call():
        with common.decode_pdl(pdl):
            return flash_attn_with_kvcache(q, kc, vc, **kw)
    return call


def chosen_splits(rec_explain):
    if isinstance(rec_explain, dict):
        for key in ("num_splits", "num_splits_chosen"):
            if isinstance(rec_explain.get(key), int):
                return rec_explain[key]
    return None


def measure(sweep, B, S, *, args, ok_flash, ok_base, torch_impls, pages, n_repeat):
    """One (batch, cache length) point: every impl and layout; returns the records."""
    import cupy
    from cupyflash import io_model
    kv_bytes = 2 * B * S * HK * D * 2
    q = common.random_normal((B, 1, H, D), DTYPE, seed=1)
    k_cache = common.random_normal((B, S, HK, D), DTYPE, seed=2)
    v_cache = common.random_normal((B, S, HK, D), DTYPE, seed=3)
    cache_seqlens = cupy.full((B,), S, dtype=cupy.int32)
    flops = io_model.decode_flops(B, H, S, D)
    base = {"what": "decode", "sweep": sweep, "dtype": DTYPE, "batch": B, "nheads": H,
            "nheads_k": HK, "headdim": D, "seqlen_k": S, "kv_bytes": kv_bytes, "flops": flops}
    records = []

    def run(impl, fn, page_size, num_splits, explain=None):
        rec = dict(base, impl=impl, page_size=page_size, num_splits=num_splits)
        try:
            t = common.benchmark(fn, n_warmup=3, n_repeat=n_repeat, flush_l2=args.flush)
            rec.update(t, us=t["ms"] * 1e3, tbps=kv_bytes / (t["ms"] * 1e-3) / 1e12,
                       tflops=flops / (t["ms"] * 1e-3) / 1e12)
            if explain is not None:
                rec.update(common.plan_fields(explain))
                rec["num_splits_chosen"] = chosen_splits(explain) or num_splits or None
                ns = rec["num_splits_chosen"] or max(num_splits, 1)
                rec["model_bytes"] = io_model.decode_hbm_bytes(
                    B, H, HK, S, D, DTYPE, num_splits=ns, page_size=page_size)
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            print(f"  {impl} B={B} S={S} page={page_size} splits={num_splits}: {rec['error']}")
        records.append(rec)

    def explain(kc, vc, bt, ns, cs=cache_seqlens):
        return common.explain_record(q, kc, vc, cache_seqlens=cs, block_table=bt,
                                     causal=True, num_splits=ns, kind="decode")

    if sweep == "splits":
        if ok_flash:
            for ns in [0] + list(args.splits):
                run("cupyflash", decode_fn(q, k_cache, v_cache, cache_seqlens, None, ns), 0, ns,
                    explain(k_cache, v_cache, None, ns))
    else:
        for page in pages:
            if page == 0:
                kc, vc, bt = k_cache, v_cache, None
            else:
                if S % page:
                    continue
                # the same memory as a pool of pages, handed out in a shuffled order
                kc = k_cache.reshape(B * S // page, page, HK, D)
                vc = v_cache.reshape(B * S // page, page, HK, D)
                perm = np.random.default_rng(B * S + page).permutation(B * S // page)
                bt = cupy.asarray(perm.reshape(B, S // page).astype(np.int32))
            if ok_flash:
                run("cupyflash", decode_fn(q, kc, vc, cache_seqlens, bt, 0), page, 0,
                    explain(kc, vc, bt, 0))
        if ok_flash:  # FlashAttention alone: no split
            run("cupyflash_unsplit", decode_fn(q, k_cache, v_cache, cache_seqlens, None, 1), 0, 1,
                explain(k_cache, v_cache, None, 1))
        if ok_flash:  # the same call given what SDPA is given: a dense cache, no length array
            run("cupyflash_dense", decode_fn(q, k_cache, v_cache, None, None, 0), 0, 0,
                explain(k_cache, v_cache, None, 0, cs=None))
        if ok_flash:  # the default call launched plainly (no programmatic dependent launch)
            run("cupyflash_plain", decode_fn(q, k_cache, v_cache, cache_seqlens, None, 0,
                                             pdl=False), 0, 0,
                explain(k_cache, v_cache, None, 0))
        if ok_base and B * S <= args.baseline_max_tokens:
            from cupyflash.baseline import attention_baseline
            run("baseline", lambda: attention_baseline(q, k_cache, v_cache, causal=True), 0, 0)
        for impl in torch_impls:
            try:
                fn = common.torch_sdpa(q, k_cache, v_cache, impl[len("torch_"):], causal=False,
                                       enable_gqa=True)
            except Exception as e:
                records.append(dict(base, impl=impl, page_size=0, num_splits=0,
                                    error=f"{type(e).__name__}: {str(e)[:400]}"))
                print(f"  {impl} B={B} S={S}: {records[-1]['error']}")
                continue
            run(impl, fn, 0, 0)
            records[-1]["torch_layout"] = getattr(fn, "layout", None)
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batches", nargs="+", type=int, default=None)
    ap.add_argument("--seqlens", nargs="+", type=int, default=None)
    ap.add_argument("--page-sizes", nargs="+", type=int, default=None, help="0 = contiguous")
    ap.add_argument("--splits", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--splits-seqlens", nargs="+", type=int, default=None)
    ap.add_argument("--baseline-max-tokens", type=int, default=16 * 131072,
                    help="largest batch * seqlen_k the baseline runs at (it copies K and V)")
    ap.add_argument("--max-cache-gb", type=float, default=40.0)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--n-repeat", type=int, default=None)
    ap.add_argument("--flush", choices=("read", "write", "read_smem"), default="read",
                    help="how L2 is evicted before each timed call (common.flush_l2_cache; "
                         "'write', the method before 58b7e3f (NOTES v19), leaves dirty lines; "
                         "'read_smem' leaves the SMs at the largest shared-memory carveout)")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_decode.jsonl")
    args = ap.parse_args(argv)
    batches = args.batches or ([1, 16] if args.quick else [1, 16, 64])
    seqlens = args.seqlens or ([4096, 32768, 131072] if args.quick
                               else [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768,
                                     65536, 131072])
    pages = args.page_sizes if args.page_sizes is not None else ([0, 16] if args.quick else [0, 16, 256])
    split_lens = args.splits_seqlens or ([131072] if args.quick else [16384, 131072])
    n_repeat = args.n_repeat or (20 if args.quick else 30)

    if not common.have_gpu():
        print("bench_decode: no CUDA GPU here; nothing to measure")
        return 0
    ok_flash, why = common.impl_available("cupyflash_decode")
    if not ok_flash:
        print(f"bench_decode: skipping cupyflash: {why}")
    ok_base, why_b = common.impl_available("baseline")
    if not ok_base:
        print(f"bench_decode: skipping baseline: {why_b}")
    torch_impls = []
    if not args.no_torch:
        ok_t, why_t = common.impl_available("torch_flash")
        torch_impls = ["torch_flash", "torch_cudnn"] if ok_t else []
        if not ok_t:
            print(f"bench_decode: skipping torch: {why_t}")
    prov = common.provenance()
    print(f"bench_decode: {prov.get('gpu')} commit {prov['commit'][:10]} -> {args.out}")

    jobs = [("main", b, s) for b in batches for s in seqlens]
    jobs += [("splits", 1, s) for s in split_lens]
    ctx = dict(args=args, ok_flash=ok_flash, ok_base=ok_base, torch_impls=torch_impls,
               pages=pages, n_repeat=n_repeat)
    n_written = 0
    for sweep, B, S in common.progress(jobs, desc="decode"):
        kv_bytes = 2 * B * S * HK * D * 2
        if kv_bytes > args.max_cache_gb * 1e9:
            print(f"  skip B={B} S={S}: cache {kv_bytes / 1e9:.1f} GB > --max-cache-gb")
            continue
        common.free_memory()
        records = measure(sweep, B, S, **ctx)  # its buffers die with its frame
        n_written += common.append_results(args.out, records)
        summary = "  ".join(f"{r['impl']}{'/p' + str(r['page_size']) if r['page_size'] else ''}"
                            f"{'/s' + str(r['num_splits']) if sweep == 'splits' else ''}="
                            f"{r['tbps']:.2f}" for r in records if "tbps" in r)
        print(f"  [{sweep}] B={B} S={S}: TB/s {summary}", flush=True)
    print(f"bench_decode: wrote {n_written} records to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
