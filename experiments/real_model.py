"""The main job: cupyflash on a real model's attention inputs, end to end.

Question: on the Q/K/V of a real pretrained transformer (all-MiniLM-L6-v2, every layer and head,
four text passages of 18-256 tokens; max |logit| 67, rows that are one-hot to six digits: see
``tests/data/README.md``), how far is each kernel from the float64 reference, and how fast is it
beside the materialising baseline?

With a CUDA GPU (CuPy sees a device) it runs, in every supported dtype:

* prefill (``cupyflash.flash_attn_func``), non-causal (what the encoder computes) and causal
  (causal masking applied to the same tensors): float16, bfloat16, float32, float64;
* decode (``cupyflash.flash_attn_with_kvcache``): per layer one batch of the four passages, each
  its own cache (ragged ``cache_seqlens``, NaN in the cache tails), queries = its last 1..4
  positions, causal: float16, bfloat16;

and prints the error table (normwise relative error per head against
``cupyflash.reference``, max over passages/layers/heads) beside the error of a straightforward
same-precision implementation (NumPy emulation: S, P and O each rounded to the dtype) and of the
materialising baseline, the kernel that ran (``cupyflash.explain``), and the median time of
cupyflash and of ``cupyflash.baseline.attention_baseline`` on a larger batch made of the real
heads (the 256-token passage's six layers, repeated). Writes
``{out}/results/real_model_errors.json`` and ``{out}/figures/real_model_errors.png``.

Without a GPU it says so in one line, then runs the CPU parts: the float64 reference and the
online-softmax reference on the real tensors (score statistics; online vs one-shot error), and
NVRTC compiles of the kernels the job would launch (registers, spills), and exits 0.

    python experiments/real_model.py                       # the main job
    python experiments/real_model.py --dtypes fp16,bf16 --no-figure
    python experiments/real_model.py --quick               # 2 compiles / a smaller timing batch

Regenerate the input fixture with ``experiments/capture_qkv.py``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402  (puts the checkout first on sys.path)
from capture_qkv import FIXTURE, compute_stats, iter_cases, load_fixture  # noqa: E402

from cupyflash import reference as ref  # noqa: E402

NO_GPU_LINE = ("no CUDA GPU found: running the CPU parts (reference on real tensors, "
               "NVRTC compile of the kernels)")
ALIASES = {"fp16": "float16", "f16": "float16", "half": "float16", "bf16": "bfloat16",
           "fp32": "float32", "f32": "float32", "fp64": "float64", "f64": "float64"}
PREFILL_DTYPES = ("float16", "bfloat16", "float32", "float64")
DECODE_DTYPES = ("float16", "bfloat16")      # cupyflash.decode.DTYPES (tensor cores only)
DECODE_SEQLEN_Q = (1, 2, 3, 4)
SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}

# Error bounds against the float64 reference (the rule of tests/gpu/test_prefill_gpu.py), per head, normwise:
# * float16/bfloat16: at most twice the error of a straightforward same-precision implementation
#   on the same inputs (FlashAttention's own test rule) plus the unit roundoff u = eps/2 (one
#   rounding of the output; keeps the bound meaningful if the naive error happens to be tiny);
# * float32/float64: EPS_UNITS * eps of the dtype. The NumPy float32 online softmax on these
#   tensors measures 3.9 eps32 (tests/test_real_data.py); 64 allows for exp2 with the folded
#   log2(e) scale and a different summation order in the kernel.
EPS_UNITS = 64


def np_dtype(name: str) -> np.dtype:
    """NumPy dtype of a name; 'bfloat16' is ml_dtypes' (CuPy's bfloat16)."""
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


#: Machine epsilon (spacing of 1.0) per dtype; the unit roundoff is eps / 2.
EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23, "float64": 2.0 ** -52}


def eps(dtype: str) -> float:
    return EPS[dtype]


def rel_error(out: np.ndarray, expected: np.ndarray) -> float:
    """Normwise relative error ``||out - expected||_2 / ||expected||_2``; inf if ``out`` holds NaN
    or Inf (the measure of ``cupyflash.testing.rel_error``, restated here so that the main job
    needs no Hypothesis)."""
    if not np.isfinite(out).all():
        return math.inf
    return float(np.linalg.norm(out - expected) / np.linalg.norm(expected))


def parse_dtypes(text: str) -> list[str]:
    out = []
    for t in text.split(","):
        t = ALIASES.get(t.strip().lower(), t.strip().lower())
        if t not in PREFILL_DTYPES:
            raise argparse.ArgumentTypeError(
                f"--dtypes: unknown dtype {t!r}; supported: {', '.join(PREFILL_DTYPES)} "
                "(or fp16, bf16, fp32, fp64)")
        out.append(t)
    return out


# ----------------------------------------------------------------------------------------------
# Straightforward same-precision attention (the fp16/bf16 yardstick) and error measures
# ----------------------------------------------------------------------------------------------
def naive_same_precision(q, k, v, softmax_scale: float, causal: bool, dtype: str) -> np.ndarray:
    """What a plain three-step implementation computes in ``dtype`` (e.g. PyTorch's
    ``softmax(q @ k.T * scale) @ v`` in half precision): matrix products accumulate in float32
    and round their result to ``dtype``; the softmax is computed in float32 on the rounded
    scores and its result rounded to ``dtype``.

    q : (batch, seqlen_q, nheads, d); k, v : (batch, seqlen_k, nheads, d) (no GQA), values
    already representable in ``dtype``. Returns float64 (batch, seqlen_q, nheads, d). Causal
    masking is bottom-right aligned.
    """
    dt = np_dtype(dtype)

    def rnd(x):
        return x.astype(dt).astype(np.float32)

    qf, kf, vf = (np.asarray(t).astype(dt).astype(np.float32) for t in (q, k, v))
    s = rnd(np.einsum("bihd,bjhd->bhij", qf, kf) * np.float32(softmax_scale))
    if causal:
        sq, sk = s.shape[-2:]
        vis = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
        s = np.where(vis, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = rnd(p / p.sum(-1, keepdims=True))
    return rnd(np.einsum("bhij,bjhd->bihd", p, vf)).astype(np.float64)


def host64(x) -> np.ndarray:
    """Host float64 copy of a NumPy or CuPy array."""
    if hasattr(x, "get"):
        x = x.get()
    return np.asarray(x).astype(np.float64)


def per_head_errors(out, expected) -> np.ndarray:
    """:func:`rel_error` of each (batch, head) block of (batch, seqlen, nheads, d) arrays;
    returns (batch, nheads)."""
    out = host64(out)
    expected = np.asarray(expected, np.float64)
    b, _, h, _ = expected.shape
    return np.array([[rel_error(out[i, :, j], expected[i, :, j]) for j in range(h)]
                     for i in range(b)])


def fp16_bf16_bound(naive_err: np.ndarray, dtype: str) -> np.ndarray:
    return 2.0 * naive_err + eps(dtype) / 2


def eps_bound(dtype: str) -> float:
    return EPS_UNITS * eps(dtype)


#: float32/float64 runs multiply the fixture's float16 values by this factor before rounding to
#: the dtype, so that the inputs fill the mantissa: on float16-representable inputs a kernel that
#: lost input precision (e.g. loaded through a 16-bit type) would go unnoticed. 1/3 has no finite
#: binary expansion; the logits change by 0.07 %, the statistics not visibly.
FULL_MANTISSA_FACTOR = 1 + 1 / 3072


def cast(x: np.ndarray, dtype: str) -> np.ndarray:
    """The fixture's float16 values as the ``dtype`` inputs of a run: rounded once to ``dtype``
    (bfloat16), exact (float16), or scaled by :data:`FULL_MANTISSA_FACTOR` and rounded once
    (float32, float64)."""
    x = np.asarray(x).astype(np.float64)
    if dtype in ("float32", "float64"):
        x = x * FULL_MANTISSA_FACTOR
    return x.astype(np_dtype(dtype))


# ----------------------------------------------------------------------------------------------
# Plans (explain) and compile reports
# ----------------------------------------------------------------------------------------------
def _get(plan, *names, default=None):
    for n in names:
        if isinstance(plan, dict) and n in plan:
            return plan[n]
        if hasattr(plan, n):
            return getattr(plan, n)
    return default


def plan_summary(plan) -> str:
    """One line for a prefill ``Plan`` (``cupyflash.explain``) or a ``decode.DecodePlan``."""
    for attr in ("summary", "summary_line", "line"):
        f = getattr(plan, attr, None)
        if callable(f):
            return str(f())
        if isinstance(f, str):
            return f
    kernel = _get(plan, "kernel", "name")
    name = _get(kernel, "name", default=kernel) if not isinstance(kernel, str) else kernel
    parts = [str(name)]
    for label, keys in (("grid", ("grid",)), ("block", ("block",)), ("smem", ("smem_bytes",)),
                        ("regs", ("registers",)), ("spill", ("spill_bytes",)),
                        ("splits", ("num_splits",))):
        val = _get(plan, *keys)
        if val is None and kernel is not None and not isinstance(kernel, str):
            val = _get(kernel, *keys)
        if val is not None:
            parts.append(f"{label}={tuple(val) if isinstance(val, list) else val}")
    return " ".join(parts)


def prefill_plan(q, k, v, scale, causal, arch=None):
    import cupyflash
    return cupyflash.explain(q, k, v, softmax_scale=scale, causal=causal, arch=arch)


def decode_plan(q, k_cache, v_cache, cache_seqlens, scale, arch=None, num_splits=0):
    """``cupyflash.decode.explain_kvcache``: the plan of a ``flash_attn_with_kvcache`` call,
    with the ptxas report of an NVRTC compile for ``arch`` (default: the current device's, or
    sm_90a without a GPU)."""
    from cupyflash import decode
    return decode.explain_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                  softmax_scale=scale, causal=True, num_splits=num_splits,
                                  arch=arch)


def plan_record(plan) -> dict:
    """JSON-ready summary of a plan (``Plan.as_dict`` where it exists) without ``rejected``, the
    list of every specialisation not chosen (as ``common.explain_record``)."""
    rec = plan.as_dict() if hasattr(plan, "as_dict") else json.loads(
        json.dumps(plan, default=common.jsonable))
    if isinstance(rec, dict):
        rec.pop("rejected", None)
    return rec


def decode_inputs(fx: dict, layer: int, seqlen_q: int, dtype: str):
    """One decode batch of layer ``layer``: passage ``p`` is cache ``p`` (ragged
    ``cache_seqlens`` = the token counts; capacity = the longest rounded up to 64, plus 64; the
    tails hold NaN, which must not reach the result), its queries are the passage's last
    ``seqlen_q`` positions. Returns host ``(q, k_cache, v_cache, cache_seqlens)`` in ``dtype``.
    With bottom-right causal alignment the exact answer is the last ``seqlen_q`` rows of the
    passage's causal prefill."""
    seqlens = fx["seqlens"].astype(np.int32)
    nb = len(seqlens)
    cap_len = int(-(-seqlens.max() // 64) * 64) + 64
    h, d = fx["num_heads"], fx["head_dim"]
    dt = np_dtype(dtype)
    kc = np.full((nb, cap_len, h, d), np.nan, np.float32).astype(dt)
    vc = np.full((nb, cap_len, h, d), np.nan, np.float32).astype(dt)
    q = np.empty((nb, seqlen_q, h, d), dt)
    for p, n in enumerate(seqlens):
        kc[p, :n] = cast(fx[f"L{layer}_P{p}_k"][0], dtype)
        vc[p, :n] = cast(fx[f"L{layer}_P{p}_v"][0], dtype)
        q[p] = cast(fx[f"L{layer}_P{p}_q"][0, n - seqlen_q:], dtype)
    return q, kc, vc, seqlens


def decode_expected(q, kc, vc, seqlens, scale, dtype):
    """float64 reference and same-precision naive output of a decode batch."""
    exp = ref.kvcache_attention_reference(q, kc, vc, cache_seqlens=seqlens, softmax_scale=scale,
                                          causal=True).out
    naive = np.concatenate([naive_same_precision(q[p:p + 1], kc[p:p + 1, :n], vc[p:p + 1, :n],
                                                 scale, True, dtype)
                            for p, n in enumerate(seqlens)])
    return exp, naive


# ----------------------------------------------------------------------------------------------
# CPU parts
# ----------------------------------------------------------------------------------------------
def run_cpu(args, fx: dict) -> int:
    scale = fx["softmax_scale"]
    s = compute_stats(fx)["summary"]
    print(f"inputs: {fx['model']}, {fx['num_layers']} layers x {fx['num_heads']} heads, "
          f"head dim {fx['head_dim']}, passages of {fx['seqlens'].tolist()} tokens "
          f"({s['num_heads_total']} passage/layer/head combinations)")
    print(f"score statistics: max |logit| {s['max_abs_logit']:.1f} (median per head "
          f"{s['median_max_abs_logit']:.1f}), max row range {s['max_row_range']:.1f}, "
          f"min row entropy {s['entropy_min']:.2e} nats, "
          f"{100 * s['frac_heads_top1_mass_max_over_0.9']:.0f}% of heads have a row with > 90% of "
          "its mass on one key")
    cases = list(iter_cases(fx))
    print("reference on the real tensors: online vs one-shot, normwise rel. error per head "
          "(max over passages, layers, heads)")
    print(f"  {'mode':<18}{'float64':>12}{'float32':>12}")
    for causal in (False, True):
        e64 = e32 = 0.0
        for c in common.progress(cases, desc="causal" if causal else "non-causal", leave=False):
            o, _ = ref.attention_reference(c["q"], c["k"], c["v"], softmax_scale=scale,
                                           causal=causal)
            for dt in (np.float64, np.float32):
                oo, _ = ref.online_softmax_attention(c["q"], c["k"], c["v"], softmax_scale=scale,
                                                     causal=causal, dtype=dt)
                e = per_head_errors(oo, o).max()
                if dt is np.float64:
                    e64 = max(e64, e)
                else:
                    e32 = max(e32, e)
        print(f"  {'prefill causal' if causal else 'prefill':<18}{e64:>12.2e}{e32:>12.2e}")
    e_dec = 0.0
    for layer in range(fx["num_layers"]):
        full = [ref.attention_reference(*(fx[f"L{layer}_P{p}_{t}"] for t in "qkv"),
                                        softmax_scale=scale, causal=True)[0]
                for p in range(len(fx["seqlens"]))]
        for sq in DECODE_SEQLEN_Q:
            q, kc, vc, lens = decode_inputs(fx, layer, sq, "float16")
            got = ref.kvcache_attention_reference(q, kc, vc, cache_seqlens=lens,
                                                  softmax_scale=scale, causal=True).out
            for p, n in enumerate(lens):
                e_dec = max(e_dec, per_head_errors(got[p:p + 1], full[p][:, n - sq:]).max())
    print(f"  {'decode (kvcache)':<18}{e_dec:>12.2e}{'':>12}   "
          "(vs the last rows of causal prefill)")
    return compile_cpu(args, fx)


def compile_cpu(args, fx: dict) -> int:
    """NVRTC-compile the specialisations the GPU job would launch; print registers/spills."""
    scale = fx["softmax_scale"]
    n = int(fx["seqlens"].max())
    h, d = fx["num_heads"], fx["head_dim"]
    jobs = []
    for dt in args.dtypes:
        for causal in (False, True):
            jobs.append(("prefill", dt, causal))
    for dt in args.dtypes:
        if dt in DECODE_DTYPES:
            jobs.append(("decode", dt, True))
    if args.quick:
        jobs = [j for j in jobs if j[1] == "float16" and not (j[0] == "prefill" and j[2])][:2]
        jobs = jobs or [("prefill", args.dtypes[0], False)]
    print(f"NVRTC compile ({args.arch}) of the kernels the job launches on these shapes"
          + (" (--quick: 2)" if args.quick else "") + ":")
    failed = 0
    for kind, dt, causal in common.progress(jobs, desc="compile", leave=False):
        label = f"{kind:<8}{SHORT[dt]:<5}{'causal' if causal and kind == 'prefill' else '':<7}"
        t0 = time.perf_counter()
        try:
            if kind == "prefill":
                x = np.zeros((1, n, h, d), np_dtype(dt))
                plan = prefill_plan(x, x, x, scale, causal, arch=args.arch)
            else:
                q, kc, vc, lens = decode_inputs(fx, 0, 1, dt)
                plan = decode_plan(q, kc, vc, lens, scale, arch=args.arch)
        except Exception as e:  # a kernel that does not build is a real failure: report it
            failed += 1
            print(f"  {label} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            continue
        print(f"  {label} {plan_summary(plan)}  [{time.perf_counter() - t0:.1f} s]")
    if failed:
        print(f"{failed} compile(s) failed")
        return 1
    return 0


# ----------------------------------------------------------------------------------------------
# GPU job
# ----------------------------------------------------------------------------------------------
_QNAN_BITS = {"float16": 0x7E00, "bfloat16": 0x7FC0, "float32": 0x7FC00000,
              "float64": 0x7FF8000000000000}


def nan_filled(cp, shape, dtype: str):
    """A CuPy array of quiet NaNs (written as bit patterns: no bfloat16 arithmetic needed)."""
    out = cp.empty(shape, dtype=np_dtype(dtype))
    out.view({2: cp.uint16, 4: cp.uint32, 8: cp.uint64}[out.itemsize]).fill(_QNAN_BITS[dtype])
    return out


def run_prefill(fx, dtype, causal, baseline=True):
    """Errors (per passage/layer/head) of cupyflash, the naive same-precision NumPy
    implementation and (optionally) the materialising baseline, on every captured head."""
    import cupy as cp

    import cupyflash
    from cupyflash.baseline import attention_baseline
    scale = fx["softmax_scale"]
    rows = []
    plans = {}
    for c in common.progress(list(iter_cases(fx)), desc=f"prefill {SHORT[dtype]}"
                             + (" causal" if causal else ""), leave=False):
        q, k, v = (cast(c[t], dtype) for t in "qkv")
        expected, _ = ref.attention_reference(q, k, v, softmax_scale=scale, causal=causal)
        qd, kd, vd = (cp.asarray(t) for t in (q, k, v))
        out = nan_filled(cp, q.shape, dtype)
        res = cupyflash.flash_attn_func(qd, kd, vd, softmax_scale=scale, causal=causal, out=out)
        err = per_head_errors(res, expected)[0]
        row = {"layer": c["layer"], "passage": c["passage"], "seqlen": c["seqlen"],
               "err": err.tolist()}
        if dtype in ("float16", "bfloat16"):
            naive = naive_same_precision(q, k, v, scale, causal, dtype)
            row["err_naive"] = per_head_errors(naive, expected)[0].tolist()
            row["bound"] = fp16_bf16_bound(np.array(row["err_naive"]), dtype).tolist()
        else:
            row["bound"] = [eps_bound(dtype)] * err.size
        if baseline:
            bo = attention_baseline(qd, kd, vd, softmax_scale=scale, causal=causal)
            row["err_baseline"] = per_head_errors(bo, expected)[0].tolist()
        rows.append(row)
        if c["seqlen"] not in plans:
            plans[c["seqlen"]] = prefill_plan(qd, kd, vd, scale, causal)
    return rows, plans


def run_decode(fx, dtype, num_splits=0):
    import cupy as cp

    import cupyflash
    scale = fx["softmax_scale"]
    rows = []
    plan = None
    for layer in common.progress(range(fx["num_layers"]), desc=f"decode {SHORT[dtype]}",
                                 leave=False):
        for sq in DECODE_SEQLEN_Q:
            q, kc, vc, lens = decode_inputs(fx, layer, sq, dtype)
            expected, naive = decode_expected(q, kc, vc, lens, scale, dtype)
            out = nan_filled(cp, q.shape, dtype)
            res = cupyflash.flash_attn_with_kvcache(
                cp.asarray(q), cp.asarray(kc), cp.asarray(vc), cache_seqlens=cp.asarray(lens),
                softmax_scale=scale, causal=True, num_splits=num_splits, out=out)
            err = per_head_errors(res, expected)
            en = per_head_errors(naive, expected)
            for p in range(len(lens)):
                rows.append({"layer": layer, "passage": p, "seqlen": int(lens[p]), "seqlen_q": sq,
                             "err": err[p].tolist(), "err_naive": en[p].tolist(),
                             "bound": fp16_bf16_bound(en[p], dtype).tolist()})
            if plan is None:
                plan = decode_plan(q, kc, vc, lens, scale, num_splits=num_splits)
    return rows, plan


def summarise(rows: list, key: str = "err") -> float | None:
    """Max of ``key`` over all rows and heads (None if the rows lack it)."""
    vals = [max(r[key]) for r in rows if key in r]
    return float(max(vals)) if vals else None


def fmt(x, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}.2e}"


def time_job(fx, dtypes, batch_reps: int):
    """Median time of cupyflash and the materialising baseline on a batch made of the real heads:
    the longest passage's six layers, repeated ``batch_reps`` times."""
    import cupy as cp

    import cupyflash
    from cupyflash.baseline import attention_baseline
    scale = fx["softmax_scale"]
    p = int(np.argmax(fx["seqlens"]))
    out = []
    for dtype in dtypes:
        stack = {t: np.concatenate([cast(fx[f"L{layer}_P{p}_{t}"], dtype)
                                    for layer in range(fx["num_layers"])] * batch_reps)
                 for t in "qkv"}
        q, k, v = (cp.asarray(stack[t]) for t in "qkv")
        for causal in (False, True):
            t_flash = common.benchmark(lambda: cupyflash.flash_attn_func(
                q, k, v, softmax_scale=scale, causal=causal), n_repeat=30)
            t_base = common.benchmark(lambda: attention_baseline(
                q, k, v, softmax_scale=scale, causal=causal), n_repeat=30)
            out.append({"op": "prefill", "dtype": dtype, "causal": causal,
                        "shape": list(q.shape), "cupyflash_ms": t_flash["ms"],
                        "baseline_ms": t_base["ms"], "speedup": t_base["ms"] / t_flash["ms"],
                        "kernel": plan_summary(prefill_plan(q, k, v, scale, causal))})
        if dtype in DECODE_DTYPES:  # one new token per sequence against its 256-token cache
            qd = cp.ascontiguousarray(q[:, -1:])
            lens = cp.full((q.shape[0],), q.shape[1], cp.int32)
            # validate=False: no host read of cache_seqlens, so nothing synchronises in the call
            t_flash = common.benchmark(lambda: cupyflash.flash_attn_with_kvcache(
                qd, k, v, cache_seqlens=lens, softmax_scale=scale, causal=True, validate=False),
                n_repeat=30)
            t_base = common.benchmark(lambda: attention_baseline(
                qd, k, v, softmax_scale=scale, causal=True), n_repeat=30)
            plan = decode_plan(qd, k, v, lens, scale)
            out.append({"op": "decode", "dtype": dtype, "causal": True,
                        "shape": list(qd.shape), "cache": list(k.shape),
                        "cupyflash_ms": t_flash["ms"], "baseline_ms": t_base["ms"],
                        "speedup": t_base["ms"] / t_flash["ms"], "kernel": plan_summary(plan)})
        q = k = v = qd = None  # free before the next dtype's batch
        common.free_memory()
    return out


def run_gpu(args, fx: dict) -> int:
    import cupy as cp
    prov = common.provenance()
    print(f"GPU: {prov.get('gpu')} (CuPy {prov.get('cupy')}, CUDA runtime "
          f"{prov.get('cuda_runtime')}); inputs: {fx['model']}, passages of "
          f"{fx['seqlens'].tolist()} tokens, {fx['num_layers']} layers x {fx['num_heads']} heads, "
          f"head dim {fx['head_dim']}")
    table = []
    detail = {}
    ok = True
    for dtype in args.dtypes:
        for causal in (False, True):
            rows, plans = run_prefill(fx, dtype, causal, baseline=not args.no_baseline)
            mode = "prefill causal" if causal else "prefill"
            detail[f"{mode}/{dtype}"] = rows
            passed = all(e <= b for r in rows for e, b in zip(r["err"], r["bound"]))
            ok &= passed
            table.append({"mode": mode, "dtype": dtype, "max_err": summarise(rows),
                          "max_err_naive": summarise(rows, "err_naive"),
                          "max_err_baseline": summarise(rows, "err_baseline"),
                          "bound": ("2 x naive + eps/2" if dtype in DECODE_DTYPES
                                    else f"{EPS_UNITS} eps = {eps_bound(dtype):.2e}"),
                          "pass": passed,
                          "kernel": plan_summary(plans[max(plans)]),
                          **common.plan_fields(plan_record(plans[max(plans)]))})
        for ns in (args.num_splits if dtype in DECODE_DTYPES else []):
            rows, plan = run_decode(fx, dtype, num_splits=ns)
            mode = "decode" if ns == 0 else f"decode {ns} splits"
            detail[f"{mode}/{dtype}"] = rows
            passed = all(e <= b for r in rows for e, b in zip(r["err"], r["bound"]))
            ok &= passed
            table.append({"mode": mode, "dtype": dtype, "max_err": summarise(rows),
                          "max_err_naive": summarise(rows, "err_naive"),
                          "max_err_baseline": None, "bound": "2 x naive + eps/2",
                          "pass": passed, "kernel": plan_summary(plan),
                          **common.plan_fields(plan_record(plan))})
        cp.get_default_memory_pool().free_all_blocks()

    print("\nerror vs the float64 reference (normwise relative, per head; max over "
          f"{len(fx['seqlens'])} passages x {fx['num_layers']} layers x {fx['num_heads']} heads"
          "; decode: x 4 query counts)")
    print(f"{'mode':<16}{'dtype':<10}{'cupyflash':>11}{'naive same-prec':>17}{'baseline':>11}"
          f"  {'bound':<20}{'ok':<4}kernel")
    for t in table:
        print(f"{t['mode']:<16}{t['dtype']:<10}{fmt(t['max_err'], 11)}{fmt(t['max_err_naive'], 17)}"
              f"{fmt(t['max_err_baseline'], 11)}  {t['bound']:<20}{'yes' if t['pass'] else 'NO':<4}"
              f"{t['kernel']}")

    timing = []
    if not args.no_timing:
        reps = 4 if args.quick else args.batch_reps
        timing = time_job(fx, [d for d in args.dtypes], reps)
        print(f"\ntime (median of 30, CUDA events) on a batch made of the real heads: the "
              f"{int(fx['seqlens'].max())}-token passage's {fx['num_layers']} layers x {reps}")
        print(f"{'op':<9}{'dtype':<10}{'causal':<8}{'shape':<22}{'cupyflash ms':>13}"
              f"{'baseline ms':>13}{'speedup':>9}  kernel")
        for t in timing:
            print(f"{t['op']:<9}{t['dtype']:<10}{str(t['causal']):<8}{str(tuple(t['shape'])):<22}"
                  f"{t['cupyflash_ms']:>13.4f}{t['baseline_ms']:>13.4f}{t['speedup']:>8.2f}x  "
                  f"{t['kernel']}")

    results = args.out / "results" / "real_model_errors.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    fixture = args.fixture.resolve()
    if fixture.is_relative_to(common.ROOT):
        fixture = fixture.relative_to(common.ROOT)
    record = {"provenance": prov, "fixture": str(fixture),
              "model": fx["model"], "seqlens": fx["seqlens"].tolist(),
              "softmax_scale": fx["softmax_scale"], "metric": "normwise relative error per head "
              "(cupyflash.testing.rel_error) vs cupyflash.reference (float64)",
              "table": table, "timing": timing,
              "per_head": {key: [{**r, **{f: [float(f"{x:.3g}") for x in r[f]]
                                          for f in ("err", "err_naive", "err_baseline", "bound")
                                          if f in r}} for r in rows]
                           for key, rows in detail.items()}}
    results.write_text(dump_json(record))
    print(f"\nwrote {results}")
    if not args.no_figure:
        fig = args.out / "figures" / "real_model_errors.png"
        plot(record, fig)
        print(f"wrote {fig}")
    if not ok:
        print("SOME ERRORS ABOVE THEIR BOUNDS (see the 'ok' column)")
    return 0 if ok else 1


def dump_json(record: dict) -> str:
    """JSON text: indented, except one line per per-head row (keeps the file small)."""
    head = {k: v for k, v in record.items() if k != "per_head"}
    text = json.dumps(head, indent=1, default=common.jsonable)[:-2]
    groups = []
    for key, rows in record["per_head"].items():
        lines = ",\n".join("   " + json.dumps(r, default=common.jsonable) for r in rows)
        groups.append(f"  {json.dumps(key)}: [\n{lines}\n  ]")
    return text + ',\n "per_head": {\n' + ",\n".join(groups) + "\n }\n}\n"


def plot(record: dict, path: Path) -> None:
    """Per-layer max error (over passages/heads) of cupyflash (solid) and of the naive
    same-precision implementation (dashed), one panel per mode, log scale."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    modes = list(dict.fromkeys(key.split("/")[0] for key in record["per_head"]))
    fig, axes = plt.subplots(1, len(modes), figsize=(4.3 * len(modes), 4), sharey=True,
                             squeeze=False)
    axes = axes[0]
    colors = {"float16": "C0", "bfloat16": "C1", "float32": "C2", "float64": "C3"}
    for ax, mode in zip(axes, modes):
        for key, rows in record["per_head"].items():
            m, dtype = key.split("/")
            if m != mode:
                continue
            layers = sorted({r["layer"] for r in rows})
            for field, style in (("err", "-o"), ("err_naive", "--x")):
                if not all(field in r for r in rows):
                    continue
                ys = [max(1e-17, max(max(r[field]) for r in rows if r["layer"] == lay))
                      for lay in layers]  # floor: an exact (0) error stays on the log axis
                ax.semilogy(layers, ys, style, color=colors[dtype],
                            label=f"{SHORT[dtype]}" + (" naive" if field == "err_naive" else ""))
        for dtype in sorted({k.split("/")[1] for k in record["per_head"]
                             if k.startswith(mode + "/")}):
            ax.axhline(eps(dtype) / 2, color=colors[dtype], lw=0.8, ls=":")  # unit roundoff
        ax.set_title(mode + "  (dotted: unit roundoff)")
        ax.set_xlabel("layer")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("max rel. error per head vs float64")
    fig.suptitle(f"cupyflash on all-MiniLM-L6-v2 Q/K/V (passages of {record['seqlens']} tokens)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", type=parse_dtypes, default=list(PREFILL_DTYPES),
                    help="comma-separated: fp16,bf16,fp32,fp64 (decode runs the fp16/bf16 ones)")
    ap.add_argument("--out", type=Path, default=HERE,
                    help="folder receiving results/real_model_errors.json and "
                         "figures/real_model_errors.png (default: experiments/)")
    ap.add_argument("--fixture", type=Path, default=FIXTURE)
    ap.add_argument("--no-figure", action="store_true")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--no-baseline", action="store_true", help="skip the baseline's error column")
    ap.add_argument("--num-splits", type=lambda t: [int(x) for x in t.split(",")], default=[0, 3],
                    help="decode num_splits values, comma-separated (0 = the heuristic, which "
                         "picks 1 split for these short caches; 3 exercises the combine kernel)")
    ap.add_argument("--batch-reps", type=int, default=32,
                    help="timing batch = the 6 layers of the longest passage x this (default 32: "
                         "batch 192, 2304 heads)")
    ap.add_argument("--arch", default="sm_90a", help="NVRTC target of the CPU compile")
    ap.add_argument("--quick", action="store_true",
                    help="CPU: compile 2 specialisations; GPU: small timing batch")
    ap.add_argument("--cpu", action="store_true", help="run the CPU parts even with a GPU")
    args = ap.parse_args(argv)
    fx = load_fixture(args.fixture)
    if args.cpu or not common.have_gpu():
        if not args.cpu:
            print(NO_GPU_LINE, flush=True)
        return run_cpu(args, fx)
    return run_gpu(args, fx)


if __name__ == "__main__":
    sys.exit(main())
