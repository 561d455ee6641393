"""Numerics of the online softmax, on the CPU with the NumPy reference (figure 6).

1. Error vs sequence length and block size: attention computed in float32 and float64 by the
   streaming algorithm (``cupyflash.reference.online_softmax_attention``: running max, rescaled
   normaliser and accumulator, blocks of ``block_size_k`` keys) and by a one-shot softmax in the
   same precision, each against the float64 one-shot reference on the same inputs. The claim:
   streaming is exact up to rounding, its error of the same order as one-shot's at every length
   and block size.
2. Overflow: one query against 1024 keys whose logits lie in ``[0.95 c, c]``. A streaming sum of
   ``exp(s)`` *without* the running max (what one would write without FlashAttention's
   rescaling) overflows once ``c + ln(keys)`` passes ``ln(max float)`` (11.1 in float16, 88.7 in
   float32, 709.8 in float64): the output becomes inf/NaN, or silently 0 when only the normaliser
   overflows; with the running max the result stays
   correct at every ``c``: its error equals the stable one-shot softmax's in the same precision
   (both round the logits to the dtype, which at large ``c`` is the dominant error).

    python experiments/exp_numerics.py --quick      # ~10 s on 2 cores
    python experiments/exp_numerics.py

Appends a run (experiments/common.py; its provenance says ``machine: "cpu"`` and names no GPU) to
``experiments/results/exp_numerics.jsonl`` (``part`` = ``error`` / ``overflow``).
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS  # noqa: E402


def one_shot(q, k, v, scale, dtype):
    """softmax(scale q k^T) v in ``dtype`` with the whole score matrix (one head, no mask)."""
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    s = (q @ k.T) * dtype(scale)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    return (p @ v) / p.sum(axis=-1, keepdims=True)


def naive_stream(q, k, v, scale, dtype, block=64):
    """Streaming softmax *without* a running max: l += sum exp(s), acc += exp(s) v, out = acc / l."""
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    l = np.zeros(q.shape[0], dtype)
    acc = np.zeros((q.shape[0], v.shape[1]), dtype)
    for j in range(0, k.shape[0], block):
        s = (q @ k[j:j + block].T) * dtype(scale)
        p = np.exp(s)
        l = l + p.sum(axis=-1)
        acc = acc + p @ v[j:j + block]
    return acc / l[:, None]


def rel_err(x, ref):
    """Frobenius relative error (inf if x has a non-finite entry), computed in long double."""
    x = np.asarray(x, dtype=np.longdouble)
    ref = np.asarray(ref, dtype=np.longdouble)
    if not np.isfinite(x).all():
        return float("inf")
    return float(np.sqrt(((x - ref) ** 2).sum()) / np.sqrt((ref ** 2).sum()))


def part_error(seqlens, blocks, headdim, seed):
    from cupyflash.reference import online_softmax_attention
    rng = np.random.default_rng(seed)
    recs = []
    for S in common.progress(seqlens, desc="error vs S"):
        q = rng.standard_normal((1, S, 1, headdim))
        k = rng.standard_normal((1, S, 1, headdim))
        v = rng.standard_normal((1, S, 1, headdim))
        scale = 1.0 / np.sqrt(headdim)
        for dtype in (np.float32, np.float64):
            # inputs rounded to the dtype; the reference sees the same rounded values, in extended
            # precision (x86 long double, 64-bit mantissa) so that float64's own error shows
            qd, kd, vd = (x.astype(dtype) for x in (q, k, v))
            ref = one_shot(qd[0, :, 0], kd[0, :, 0], vd[0, :, 0], scale, np.longdouble)
            e1 = rel_err(one_shot(qd[0, :, 0], kd[0, :, 0], vd[0, :, 0], scale, dtype), ref)
            recs.append({"part": "error", "method": "one_shot", "dtype": np.dtype(dtype).name,
                         "seqlen": S, "block_size_k": None, "headdim": headdim, "rel_err": e1})
            for bs in blocks:
                o, _ = online_softmax_attention(qd, kd, vd, block_size_k=bs, dtype=dtype)
                recs.append({"part": "error", "method": "online", "dtype": np.dtype(dtype).name,
                             "seqlen": S, "block_size_k": bs, "headdim": headdim,
                             "rel_err": rel_err(o[0, :, 0], ref)})
    return recs


def part_overflow(logit_max, nkeys, seed):
    """One query, ``nkeys`` keys, headdim 8, softmax_scale 1: logits = c * (1 - 0.05 u)."""
    from cupyflash.reference import online_softmax_attention
    rng = np.random.default_rng(seed)
    d = 8
    u = rng.random(nkeys)
    v = rng.standard_normal((1, nkeys, 1, d))
    recs = []
    for dtype in (np.float16, np.float32, np.float64):
        for c in logit_max:
            if dtype == np.float16 and c > 60000:
                continue
            q = np.zeros((1, 1, 1, d))
            q[..., 0] = c
            k = np.zeros((1, nkeys, 1, d))
            k[0, :, 0, 0] = 1 - 0.05 * u
            k[0, :, 0, 1] = 0.01 * rng.standard_normal(nkeys)  # a little noise off-axis
            qd, kd, vd = (x.astype(dtype) for x in (q, k, v))
            ref = one_shot(qd[0, :, 0], kd[0, :, 0], vd[0, :, 0], 1.0, np.longdouble)
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                naive = naive_stream(qd[0, :, 0], kd[0, :, 0], vd[0, :, 0], 1.0, dtype)
                onl, _ = online_softmax_attention(qd, kd, vd, softmax_scale=1.0, block_size_k=64,
                                                  dtype=dtype)
                shot = one_shot(qd[0, :, 0], kd[0, :, 0], vd[0, :, 0], 1.0, dtype)
            onl = onl[0, :, 0]
            eps = float(np.finfo(dtype).eps)
            for method, out in (("no_running_max", naive), ("online", onl), ("one_shot", shot)):
                err = rel_err(out, ref)
                recs.append({"part": "overflow", "method": method, "dtype": np.dtype(dtype).name,
                             "logit_max": float(c), "nkeys": nkeys, "finite": bool(np.isfinite(
                                 np.asarray(out, dtype=np.float64)).all()),
                             "rel_err": err, "rel_err_in_eps": err / eps if np.isfinite(err) else None,
                             "ln_max": float(np.log(np.finfo(dtype).max))})
    return recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seqlens", nargs="+", type=int, default=None)
    ap.add_argument("--blocks", nargs="+", type=int, default=[16, 64, 256])
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "exp_numerics.jsonl")
    args = ap.parse_args(argv)
    seqlens = args.seqlens or ([128, 512, 2048] if args.quick else [128, 256, 512, 1024, 2048, 4096, 8192])
    logits = [1, 2, 3, 4, 5, 6, 8, 10, 11, 12, 20, 50, 70, 80, 82, 84, 86, 88, 89, 90, 100, 200,
              300, 500, 650, 690, 700, 703, 706, 709, 710, 711, 800, 1000, 2000]
    # NumPy on the host: the run's provenance names the code and the host, not a GPU
    prov = {k: v for k, v in common.provenance().items()
            if k in ("commit", "dirty", "git_head", "date", "host_python")}
    recs = part_error(seqlens, args.blocks, args.headdim, args.seed)
    recs += part_overflow(logits, 1024, args.seed)
    for r in recs:
        r["what"] = "numerics"
    n = common.append_results(args.out, recs, provenance=dict(prov, machine="cpu"))
    for dt in ("float16", "float32", "float64"):
        over = [r["logit_max"] for r in recs if r["part"] == "overflow" and r["dtype"] == dt
                and r["method"] == "no_running_max" and not r["rel_err"] < 0.5]
        worst = max((r["rel_err"] for r in recs if r["part"] == "overflow" and r["dtype"] == dt
                     and r["method"] == "online"), default=float("nan"))
        shot = max((r["rel_err"] for r in recs if r["part"] == "overflow" and r["dtype"] == dt
                    and r["method"] == "one_shot"), default=float("nan"))
        print(f"  {dt}: without the running max the output is wrong (inf/NaN, or error > 50%) from logit "
              f"{min(over) if over else 'never (in range)'}; with it the worst rel. error is "
              f"{worst:.2e} (stable one-shot softmax in {dt}: {shot:.2e})")
    for dt in ("float32", "float64"):
        e = [r for r in recs if r["part"] == "error" and r["dtype"] == dt]
        print(f"  {dt}: online rel. error {min(r['rel_err'] for r in e if r['method'] == 'online'):.1e}"
              f"..{max(r['rel_err'] for r in e if r['method'] == 'online'):.1e}, one-shot "
              f"{min(r['rel_err'] for r in e if r['method'] == 'one_shot'):.1e}"
              f"..{max(r['rel_err'] for r in e if r['method'] == 'one_shot'):.1e}")
    print(f"exp_numerics: wrote {n} records to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
