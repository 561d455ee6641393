"""Split-KV decode variants on one GPU call (v8 decode plan in experiments/NOTES.md; v1: H8).

    PYTHONPATH=. python experiments/sweep_decode_variants.py [--quick] [--out DIR]

Llama-3-8B heads (32 query, 8 KV heads, d = 128), bf16, one query token, every sequence full.
For each case (batch, seqlen_k, page_size; 0 = contiguous) and each split-kernel variant
(cupyflash.decode.SplitVariant: tile shape, fused combine, L2 hints, grid order) x a few
num_splits: time with CUDA-graph replay (20 calls per graph, best of 3 replays; L2 not flushed,
as the first decode sweep), check the output against a float32 CuPy reference (normwise relative
error < 1e-2, no NaN) and against the default path's output, and print TB/s of K+V bytes.
Also times torch SDPA (cuDNN and flash backends, enable_gqa=True, BHSD views of BSHD storage)
when torch is importable. Records are appended to $OUT/decode_variants.jsonl (or --out; default
experiments/results/), each with the commit and the GPU.
A deadline (--budget seconds, default 100) skips the remaining measurements, never hangs.
Each case also times the public call with programmatic dependent launch off (``default_plain``,
bitwise compared with ``default``). Filters: ``--variants`` (name substrings), ``--cases``
(``batch,seqlen,page`` triples), ``--default-splits-only`` (each variant at the public
heuristic's split count, when its tile is the heuristic's). For example (NOTES v15b-v16):

    PYTHONPATH=. python experiments/sweep_decode_variants.py --default-splits-only \
        --variants fused_rel_pdl hfirst_pdl spid_pdl --cases 64,1024,0 16,1024,0 1,1024,0
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import numpy as np

T0 = time.time()
H, HK, D = 32, 8, 128
CASES = [(1, 131072, 0), (1, 131072, 16), (16, 16384, 0), (16, 16384, 16), (16, 16384, 256),
         (64, 16384, 0), (16, 1024, 0), (1, 8192, 0), (1, 1024, 0), (2, 32768, 0), (4, 8192, 0),
         (64, 1024, 0), (64, 2048, 0), (64, 2048, 16), (1, 4096, 0), (1, 2048, 0),
         (1, 1024, 16), (1, 8192, 16), (16, 1024, 16), (1, 2048, 256)]
SMEM_PER_SM, RESERVED = 233472, 1024


def variants():
    from cupyflash.decode import (FLAG_CLUSTER_COMBINE, FLAG_FUSED_COMBINE, FLAG_RELEASE_ARRIVE,
                                  FLAG_SPEC_PAGE_IDS,
                                  SplitVariant as V)
    F, C, R = FLAG_FUSED_COMBINE, FLAG_CLUSTER_COMBINE, FLAG_RELEASE_ARRIVE
    # v9 (experiments/NOTES.md "v9 decode plan"): the fused combine's arrival by one
    # release/acquire atomic (R) vs fences in every thread; v8: the splits of a head merged in a
    # thread-block cluster (C); two blocks per SM (64 x 4) for the multi-wave shapes
    contiguous = [V(128, 8, 3, F | R), V(128, 8, 3, F), V(128, 8, 3, F | C | R), V(64, 4, 3, F | R)]
    # v13: page ids fetched speculatively while the length is read (S)
    S = FLAG_SPEC_PAGE_IDS
    paged = [V(128, 8, 3, F | R), V(128, 8, 3, F), V(64, 4, 3, F | R), V(128, 8, 3, F | R | S),
             V(64, 4, 3, F | R | S)]
    # v15: programmatic dependent launch, the next kernel let be scheduled after the loop
    # (default), at entry (E) or never explicitly (N)
    from cupyflash.decode import FLAG_PDL_EARLY_TRIGGER as E, FLAG_PDL_NO_TRIGGER as N
    contiguous += [V(bn, w, 3, F | R | t, pdl=True) for bn, w in ((128, 8), (64, 4))
                   for t in (0, E, N)]
    paged += [V(128, 8, 3, F | R | S | t, pdl=True) for t in (0, E, N)]
    # v16: the KV heads of one sequence launched next to each other (grid_order 1), as cuDNN's
    # grid orders its blocks (v16 ncu)
    contiguous += [V(bn, w, 3, F | R, 1, pdl=True) for bn, w in ((128, 8), (64, 4))]
    paged += [V(128, 8, 3, F | R | S, 1, pdl=True)]
    # v18: fewer tile-loop instructions (NOTES v17 lead): copy pointers (P), skip (K) or lazy (L)
    # rescale, Q in registers (Q), no per-score mask on whole tiles (M); heads first, PDL
    from cupyflash.decode import (FLAG_COPY_POINTERS as P, FLAG_SKIP_RESCALE as K,
                                  FLAG_LAZY_RESCALE as L, FLAG_Q_REGS as Q, FLAG_MASK_FAST as M)
    contiguous += [V(bn, w, 3, F | R | x, 1, pdl=True) for bn, w in ((128, 8), (64, 4))
                   for x in (P, P | K, P | L, P | L | M, P | K | M | Q, P | L | M | Q)]
    paged += [V(128, 8, 3, F | R | S | x, pdl=True) for x in (K | M, L | M | Q)]
    # v19b: K and V in separate cp.async groups (v11) on top of the copy pointers, for the short
    # caches at batch 16-64 (the remaining gap to cuDNN)
    from cupyflash.decode import FLAG_KV_GROUPS as G
    contiguous += [V(bn, w, 3, F | R | P | G, 1, pdl=True) for bn, w in ((128, 8), (64, 4))]
    # v20: copy pointers on paged caches (one page id per page, shift-and-mask addresses), in
    # both grid orders (heads first was slower on pages before, v16)
    paged += [V(bn, w, 3, F | R | S | P, order, pdl=True) for bn, w in ((128, 8), (64, 4))
              for order in (0, 1)]
    # v24: smaller tiles, more blocks per SM, for the multi-wave shapes (b64 x 1k-8k: 512 blocks
    # on 264 slots of the 64 x 4 tile run in two rounds, each starting with a ramp; 32 x 2 x 3
    # stages fit 4 blocks per SM, one round of 528 slots; 32 x 2 x 4 and 64 x 4 x 2, 3 per SM)
    contiguous += [V(bn, w, st, F | R | P, 1, pdl=True) for bn, w, st in ((32, 2, 3), (32, 2, 4),
                                                                          (64, 4, 2))]
    # v26: one block per SM with 64 KB (128 x 8 x 2) or 96 KB (64 x 4 x 4) of copies in flight
    # instead of 128 KB (the 128 x 8 x 3 one-block tile), for batch 1-16 at long caches
    contiguous += [V(bn, w, st, F | R | P, 1, pdl=True) for bn, w, st in ((128, 8, 2), (64, 4, 4))]
    # v25: the 64 x 4 x 2 tile (three blocks per SM) on pages, in the paged default's grid order
    paged += [V(64, 4, 2, F | R | S | P, pdl=True)]
    # v28: the one-block paged tile with 64 KB (128 x 8 x 2) or 96 KB (64 x 4 x 4) in flight
    paged += [V(bn, w, st, F | R | S | P, pdl=True) for bn, w, st in ((128, 8, 2), (64, 4, 4))]
    # v32: the paged kernel without the speculative page ids (copy pointers only)
    paged += [V(bn, w, 3, F | R | P, pdl=True) for bn, w in ((128, 8), (64, 4))]
    # v30: K/V tiles copied by the TMA unit (one thread, boxes through tensor maps, an mbarrier
    # per stage) instead of 16-byte cp.async from every thread; L2 fetches of 256 B (default)
    # or 128 B
    from cupyflash.decode import FLAG_TMA as T
    contiguous += [V(bn, w, st, F | R | T, 1, pdl=True) for bn, w, st in ((128, 8, 3), (64, 4, 3),
                                                                          (128, 8, 2), (64, 4, 2))]
    contiguous += [V(bn, w, 3, F | R | T, 1, pdl=True, l2_promotion=128)
                   for bn, w in ((128, 8), (64, 4))]
    # v30b: no L2 promotion, or 64 B (256 B lost 3-7% in v30, 128 B matched cp.async)
    contiguous += [V(bn, w, 3, F | R | T, 1, pdl=True, l2_promotion=p)
                   for bn, w in ((128, 8), (64, 4)) for p in (None, 64)]
    # v35: the speculative prologue (the guessed split's first tiles copied before the length
    # has landed) on the contiguous copy-pointer tiles
    from cupyflash.decode import FLAG_SPEC_KV as SK
    contiguous += [V(bn, w, st, F | R | P | SK, 1, pdl=True)
                   for bn, w, st in ((128, 8, 3), (64, 4, 3), (128, 8, 2), (64, 4, 2))]
    # v36: the one-block tile with 4 warps (32 keys per warp): cuDNN's short-call blocks have 4
    # warps (v14, v16: the same grid, half our instructions, DRAM 5 points busier)
    contiguous += [V(128, 4, st, F | R | P, 1, pdl=True) for st in (3, 2)]
    paged += [V(128, 4, 3, F | R | S | P, pdl=True)]
    # v38 (next): the warp-local pipeline (no CTA barrier per tile; v4 had it +5% at the small
    # shapes before copy pointers, PDL and the heads-first grid, and it was not measured since)
    # on top of the current contiguous defaults
    from cupyflash.decode import FLAG_WARP_LOCAL as WLF
    contiguous += [V(bn, w, 3, F | R | P | WLF, 1, pdl=True) for bn, w in ((128, 8), (64, 4))]
    # v44: the Q tile by cp.async before the prologue's K/V copies (the default's 2-byte Q loads
    # held half the stall samples at b64 x 128 keys, v43/v44 ncu; in the public defaults since
    # the v44 run, so the variants above without it are the earlier defaults)
    from cupyflash.decode import FLAG_Q_ASYNC as QA
    contiguous += [V(bn, w, st, F | R | P | QA, 1, pdl=True)
                   for bn, w, st in ((128, 8, 3), (64, 4, 3), (128, 8, 2), (64, 4, 2))]
    paged += [V(bn, w, 3, F | R | S | P | QA, pdl=True) for bn, w in ((128, 8), (64, 4))]
    # v45: pages with the Q tile by cp.async, heads first (v16 kept pages at (splits, batch,
    # heads) by 1-2%, before copy pointers and the Q copies) and with two stages at short caches
    paged += [V(bn, w, st, F | R | S | P | QA, 1, pdl=True)
              for bn, w, st in ((128, 8, 3), (64, 4, 3))]
    paged += [V(128, 8, 2, F | R | S | P | QA, pdl=True)]
    return contiguous, paged


def cluster_occupancy(var, dtype="bfloat16"):
    """{cluster size: clusters resident at once} of the variant's kernel (cuOccupancyMax-
    ActiveClusters), or {"error": ...}."""
    from cupyflash import jit, launch
    spec = var.spec(dtype, D, False)
    out = {}
    for c in (2, 4, 8, 12, 16):
        try:
            out[c] = launch.max_active_clusters(jit.get_kernel(spec), (var.nwarps * 32, 1, 1),
                                                (c, 1, 1), shared_mem=spec.smem_bytes)
        except Exception as e:  # noqa: BLE001
            out[c] = f"{type(e).__name__}: {str(e)[:120]}"
    return out


def blocks_per_sm(smem):
    return max(1, SMEM_PER_SM // (smem + RESERVED))


def split_candidates(batch, seqlen, cps, block_n):
    """num_splits: one full wave of resident blocks, half and twice that (and 1 if small; and 2
    and 4 tiles per split when the tiles are few)."""
    ctas = batch * HK
    fill = max(1, (132 * cps) // ctas)
    tiles = -(-seqlen // block_n)
    out = {fill, max(1, fill // 2), min(2 * fill, 128)}
    if fill < 8:  # unsplit is hopeless when one wave needs >= 8 splits
        out.add(1)
    if tiles <= 4 * fill:  # few tiles per split: also 2 and 4 tiles per split
        out |= {max(1, tiles // 2), max(1, tiles // 4)}
    return sorted(s for s in out if s <= max(1, tiles))


def flushed(fn, kv_bytes):
    """Median of 30 calls with the L2 flushed before each (CUDA events; common.benchmark)."""
    import common
    t = common.benchmark(fn, n_warmup=3, n_repeat=30, flush_l2=True)
    us = t["ms"] * 1e3
    return dict(us_flushed=us, tbps_flushed=kv_bytes / us / 1e6)


def reference_fp32(q, k_seq, v_seq):
    """float32 attention of one query token against every key (causal bottom-right with
    seqlen_q = 1 sees all keys). k_seq/v_seq (B, S, HK, D) contiguous-order views."""
    import cupy as cp
    B, S = k_seq.shape[:2]
    out = cp.empty((B, 1, H, D), cp.float32)
    qf = q.astype(cp.float32).reshape(B, HK, H // HK, D)
    scale = 1.0 / math.sqrt(D)
    for b in range(B):
        kf = k_seq[b].astype(cp.float32)          # (S, HK, D)
        vf = v_seq[b].astype(cp.float32)
        s = cp.einsum("grd,sgd->grs", qf[b], kf) * scale
        s -= s.max(axis=-1, keepdims=True)
        p = cp.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        out[b, 0] = cp.einsum("grs,sgd->grd", p, vf).reshape(H, D)
    return out


def rel(a, b):
    import cupy as cp
    a = a.astype(cp.float32)
    b = b.astype(cp.float32)
    return float(cp.linalg.norm(a - b) / max(float(cp.linalg.norm(b)), 1e-30))


def torch_times(B, S, flushed_too=False):
    """{impl: us} for torch SDPA cuDNN / flash on BHSD views of BSHD bf16 tensors (graph replay);
    with ``flushed_too`` also ``{impl}_flushed``: :func:`flushed`'s median (torch and CuPy both
    run on the legacy default stream, so CuPy's events bracket the SDPA call)."""
    import common
    res = {}
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        import torch.nn.functional as F
    except Exception as e:  # noqa: BLE001
        return {"torch": f"unavailable: {type(e).__name__}: {e}"}
    try:
        q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(B, S, HK, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn(B, S, HK, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    except Exception as e:  # noqa: BLE001
        return {"torch": f"alloc failed: {type(e).__name__}: {e}"}
    for name, be in (("torch_cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("torch_flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(be):
                f = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
                for _ in range(3):
                    f()
                torch.cuda.synchronize()
                best, how = common.torch_graph_time_us(f)
                res[name] = best
                res[name + "_timing"] = how
                if flushed_too:
                    res[name + "_flushed"] = flushed(f, 1.0)["us_flushed"]
        except Exception as e:  # noqa: BLE001
            res[name] = f"error: {type(e).__name__}: {str(e)[:200]}"
    del q, k, v
    torch.cuda.empty_cache()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="first 3 contiguous variants only")
    ap.add_argument("--budget", type=float, default=100.0, help="seconds before skipping")
    ap.add_argument("--out", default=os.environ.get(
        "OUT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")))
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="only the variants whose name contains one of these strings")
    ap.add_argument("--cases", nargs="+", default=None,
                    help="only these cases, as batch,seqlen,page (e.g. 16,1024,0)")
    ap.add_argument("--default-splits-only", action="store_true",
                    help="time each variant at the public heuristic's num_splits only")
    ap.add_argument("--flushed", action="store_true",
                    help="also time the public call and each variant with the L2 flushed "
                         "before every call (common.benchmark, CUDA events, median): us_flushed")
    args = ap.parse_args(argv)

    import cupy as cp
    import ml_dtypes
    from cupyflash import decode as Dm

    bf = ml_dtypes.bfloat16
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "decode_variants.jsonl")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common
    commit = common.provenance()["commit"]
    fout = open(path, "a")  # appended: earlier runs in the file stay
    contiguous_vs, paged_vs = variants()
    if args.quick:
        contiguous_vs, paged_vs = contiguous_vs[:3], paged_vs[:2]
    if args.variants:
        contiguous_vs = [v for v in contiguous_vs if any(x in v.name for x in args.variants)]
        paged_vs = [v for v in paged_vs if any(x in v.name for x in args.variants)]
    cases = CASES
    if args.cases:
        cases = [tuple(int(x) for x in c.split(",")) for c in args.cases]
    dev = cp.cuda.Device()
    gpu = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    print(f"# {gpu}, {dev.attributes['MultiProcessorCount']} SMs; budget {args.budget:.0f} s",
          flush=True)
    rng = cp.random.default_rng(0)
    table = []
    for var in contiguous_vs:
        if var.flags & Dm.FLAG_CLUSTER_COMBINE:
            occ = cluster_occupancy(var)
            print(f"# {var.name}: clusters resident at once by cluster size {occ}", flush=True)
            fout.write(json.dumps(dict(variant=var.name, cluster_occupancy=occ, gpu=gpu,
                                       commit=commit)) + "\n")

    def emit(rec):
        rec.update(gpu=gpu, commit=commit, elapsed_s=round(time.time() - T0, 1))
        fout.write(json.dumps(rec) + "\n")
        fout.flush()
        table.append(rec)

    # one cache buffer, reused: largest case B * S
    max_tok = max(B * S for B, S, _ in cases)
    kbuf = rng.standard_normal((max_tok, HK, D), dtype=cp.float32).astype(bf)
    vbuf = rng.standard_normal((max_tok, HK, D), dtype=cp.float32).astype(bf)
    torch_cache = {}
    for B, S, ps in cases:
        if time.time() - T0 > args.budget:
            print(f"# budget: skipping case B={B} S={S} page={ps}", flush=True)
            emit(dict(case=[B, S, ps], skipped="budget"))
            continue
        kv_bytes = 2 * B * S * HK * D * 2
        q = rng.standard_normal((B, 1, H, D), dtype=cp.float32).astype(bf)
        kc = kbuf[:B * S].reshape(B, S, HK, D)
        vc = vbuf[:B * S].reshape(B, S, HK, D)
        cs = cp.full((B,), S, cp.int32)
        bt = None
        if ps:
            perm = np.random.default_rng(B * S + ps).permutation(B * S // ps)
            bt = cp.asarray(perm.reshape(B, S // ps).astype(np.int32))
            kc = kc.reshape(-1, ps, HK, D)
            vc = vc.reshape(-1, ps, HK, D)
            k_seq = kc[bt].reshape(B, S, HK, D)   # gathered copy for the reference only
            v_seq = vc[bt].reshape(B, S, HK, D)
        else:
            k_seq, v_seq = kc, vc
        ref = reference_fp32(q, k_seq, v_seq)
        del k_seq, v_seq
        label = f"B={B} S={S} page={ps}"

        # default public path (heuristic num_splits, fused combine)
        out_def = cp.empty_like(q)
        ws = Dm.alloc_workspace(q, kc, vc, cache_seqlens=cs, block_table=bt, num_splits=0)
        call = lambda: Dm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, block_table=bt,  # noqa: E731
                                                  num_splits=0, out=out_def, validate=False,
                                                  workspace=ws)
        def_ns = def_bn = None
        try:
            us = common.graph_time_us(call)
            plan = Dm.explain_kvcache(q, kc, vc, cache_seqlens=cs, block_table=bt, report=False)
            def_ns, def_bn = plan.num_splits, plan.template["block_n"]
            err = rel(out_def, ref)
            rec = dict(case=[B, S, ps], variant="default", num_splits=plan.num_splits, us=us,
                       tbps=kv_bytes / us / 1e6, rel_err=err,
                       ok=bool(err < 1e-2 and not cp.isnan(out_def.astype(cp.float32)).any()))
            if args.flushed:
                rec.update(flushed(call, kv_bytes))
        except Exception as e:  # noqa: BLE001
            rec = dict(case=[B, S, ps], variant="default", error=f"{type(e).__name__}: {e}")
            traceback.print_exc()
        emit(rec)
        print(f"{label:28s} {'default':28s} ns={rec.get('num_splits', '?'):>3} "
              f"{rec.get('us', float('nan')):8.1f} us {rec.get('tbps', float('nan')):5.2f} TB/s "
              f"flushed {rec.get('us_flushed', float('nan')):8.1f} us "
              f"err {rec.get('rel_err', float('nan')):.1e} {'' if rec.get('ok') else 'FAIL'}",
              flush=True)
        if getattr(Dm, "PDL", False):  # the same public call launched plainly (no PDL)
            out_plain = cp.full(q.shape, np.nan, dtype=cp.float32).astype(bf)
            call_plain = lambda: Dm.flash_attn_with_kvcache(  # noqa: E731
                q, kc, vc, cache_seqlens=cs, block_table=bt, num_splits=0, out=out_plain,
                validate=False, workspace=ws)
            try:
                with common.decode_pdl(False):
                    us = common.graph_time_us(call_plain)
                same = bool((out_plain.view(cp.uint16) == out_def.view(cp.uint16)).all())
                rec = dict(case=[B, S, ps], variant="default_plain", num_splits=rec.get("num_splits"),
                           us=us, tbps=kv_bytes / us / 1e6, bitwise_vs_default=same, ok=same)
            except Exception as e:  # noqa: BLE001
                rec = dict(case=[B, S, ps], variant="default_plain",
                           error=f"{type(e).__name__}: {e}")
                traceback.print_exc()
            emit(rec)
            print(f"{label:28s} {'default_plain':28s} {rec.get('us', float('nan')):8.1f} us "
                  f"{rec.get('tbps', float('nan')):5.2f} TB/s bitwise {rec.get('ok')}", flush=True)

        for var in (paged_vs if ps else contiguous_vs):
            smem = var.spec("bfloat16", D, bool(ps)).smem_bytes
            cps = blocks_per_sm(smem)
            cands = split_candidates(B, S, cps, var.block_n)
            if args.default_splits_only:
                cands = [def_ns] if def_ns and var.block_n == def_bn else []
            for ns in cands:
                if time.time() - T0 > args.budget:
                    break
                out = cp.full(q.shape, np.nan, dtype=cp.float32).astype(bf)
                n_ws = var.workspace_elems(B, 1, H, HK, D, ns)
                wsv = cp.zeros(max(n_ws, 1), cp.float32)  # fused counters start at zero
                fn = lambda: Dm.run_split_variant(var, q, kc, vc, cs, bt, out, wsv,  # noqa: E731
                                                  num_splits=ns)
                rec = dict(case=[B, S, ps], variant=var.name, num_splits=ns, smem=smem,
                           blocks_per_sm=cps, grid_blocks=B * HK * ns)
                try:
                    fn()
                    cp.cuda.Device().synchronize()
                    nan = bool(cp.isnan(out.astype(cp.float32)).any())
                    err = rel(out, ref)
                    us = common.graph_time_us(fn)
                    d_def = rel(out, out_def)
                    if var.flags & Dm.FLAG_FUSED_COMBINE and ns > 1:  # counters back at zero
                        base = ns * B * H * (D + 1)
                        rec["counters_zero"] = bool((wsv[base:n_ws].view(cp.int32) == 0).all())
                    rec.update(us=us, tbps=kv_bytes / us / 1e6, rel_err=err, rel_vs_default=d_def,
                               bitwise_vs_default=bool((out.view(cp.uint16)
                                                        == out_def.view(cp.uint16)).all()),
                               ok=bool(not nan and err < 1e-2 and d_def < 1e-2
                                       and rec.get("counters_zero", True)))
                    if args.flushed:
                        rec.update(flushed(fn, kv_bytes))
                except Exception as e:  # noqa: BLE001
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    traceback.print_exc()
                emit(rec)
                print(f"{label:28s} {var.name:28s} ns={ns:>3} {rec.get('us', float('nan')):8.1f} us "
                      f"{rec.get('tbps', float('nan')):5.2f} TB/s flushed "
                      f"{rec.get('us_flushed', float('nan')):8.1f} us "
                      f"err {rec.get('rel_err', float('nan')):.1e}"
                      f" {'' if rec.get('ok') else 'FAIL ' + rec.get('error', '')}", flush=True)
                del wsv, out

        if not args.no_torch and ps == 0 and time.time() - T0 < args.budget:
            key = (B, S)
            if key not in torch_cache:
                torch_cache[key] = torch_times(B, S, args.flushed)
            tt = torch_cache[key]
            for impl in ("torch_cudnn", "torch_flash"):
                v = tt.get(impl, tt.get("torch"))
                rec = dict(case=[B, S, ps], variant=impl)
                if isinstance(v, float):
                    rec.update(us=v, tbps=kv_bytes / v / 1e6, timing=tt.get(impl + "_timing"))
                    if impl + "_flushed" in tt:
                        vf = tt[impl + "_flushed"]
                        rec.update(us_flushed=vf, tbps_flushed=kv_bytes / vf / 1e6)
                else:
                    rec["error"] = v
                emit(rec)
                print(f"{label:28s} {impl:28s}        {rec.get('us', float('nan')):8.1f} us "
                      f"{rec.get('tbps', float('nan')):5.2f} TB/s flushed "
                      f"{rec.get('us_flushed', float('nan')):8.1f} us {rec.get('error', '')}",
                      flush=True)
        del q, ref, out_def, ws
        cp.get_default_memory_pool().free_all_blocks()

    # summary: best variant per case, ratio to cuDNN
    print("\n# best per case (ok only)")
    for B, S, ps in CASES:
        rs = [r for r in table if r.get("case") == [B, S, ps] and "us" in r]
        ours = [r for r in rs if r.get("ok")]
        if not ours:
            continue
        best = min(ours, key=lambda r: r["us"])
        dflt = next((r for r in rs if r["variant"] == "default"), None)
        cud = next((r for r in table if r.get("case") == [B, S, 0]
                    and r.get("variant") == "torch_cudnn" and "us" in r), None)
        line = (f"B={B:3d} S={S:6d} page={ps:3d}: best {best['variant']} ns={best['num_splits']} "
                f"{best['tbps']:.2f} TB/s")
        if dflt:
            line += f" | default {dflt['tbps']:.2f}"
        if cud:
            line += f" | cuDNN {cud['tbps']:.2f} (ratio {cud['us'] / best['us']:.2f})"
        print(line)
    fails = [r for r in table if "us" in r and r.get("variant", "").startswith(("n", "default"))
             and not r.get("ok")]
    print(f"# {len(fails)} failed checks; {time.time() - T0:.1f} s; records: {path}")
    fout.close()
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
