"""Regenerate every figure from the committed JSON Lines results; no GPU needed.

    python experiments/plot.py                                  # experiments/results -> figures
    python experiments/plot.py --results DIR --figures DIR      # elsewhere (tests, CI)
    python experiments/plot.py --only fig6_numerics

A figure whose results file is missing or holds no usable record is skipped with a message (exit
status 0), so CI can always call this. Where a file holds several runs of the same point, the
last one in the file wins. Records are read with ``common.read_results`` (each with its run's
commit, GPU and date: experiments/common.py).

Figures (issue 6):
  fig1_prefill_runtime   prefill time vs S: cupyflash, FlashAttention-3, torch flash / cuDNN,
                         baseline (+ TFLOP/s); one row of panels per head dim in the records
  fig2_memory            peak extra device memory vs S, measured and modelled
  fig3_hbm_bytes         HBM bytes vs S (log-log): ncu measurement beside io_model
  fig4_roofline          arithmetic intensity vs TFLOP/s under the measured ceilings
  fig5_decode            decode bandwidth vs num_splits, cache length and batch
  fig6_numerics          online vs one-shot error; overflow without the running max
  fig7_tiles             prefill tile-size sweep
  backward               backward TFLOP/s vs S (bench_backward): cupyflash (deterministic
                         dashed) beside cuDNN, FA2 and FlexAttention; a panel per head dim and mask
  train_llama            a small Llama's training loss per step with cupyflash and with SDPA
                         attention, and their difference (experiments/train_llama.py)
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# Legend order is this order; an impl not listed is drawn last, in black dots, under its own name.
IMPL_STYLE = {
    "cupyflash": dict(color="C0", marker="o", label="cupyflash"),
    "fa3": dict(color="k", marker="P", lw=1.8, label="FlashAttention-3 (fa3 wheel)"),
    "cupyflash_wgmma": dict(color="C9", marker="o", linestyle="--", mfc="none",
                            label="cupyflash, wgmma kernel (before TMA)"),
    "cupyflash_unsplit": dict(color="C9", marker="v", label="cupyflash, num_splits=1"),
    "cupyflash_kernel": dict(color="C9", marker="o", mfc="none",
                             label="cupyflash flash_attn_backward (no autograd)"),
    "torch_flash": dict(color="C1", marker="s", label="torch SDPA flash (FA2)"),
    "torch_cudnn": dict(color="C2", marker="^", label="torch SDPA cuDNN"),
    "torch_efficient": dict(color="C4", marker="D", label="torch SDPA efficient"),
    "flex": dict(color="C5", marker="v", label="FlexAttention (torch.compile)"),
    "baseline": dict(color="C3", marker="x", label="materialising baseline"),
}


class SkipFigure(Exception):
    """The figure cannot be drawn from the results at hand (message says why)."""


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def load(results: Path, name: str, what: str | None = None, need=("ms",)) -> list:
    path = results / f"{name}.jsonl"
    recs = common.read_results(path)
    if not recs:
        raise SkipFigure(f"{path} missing or empty")
    recs = [r for r in recs if (what is None or r.get("what") == what)
            and "error" not in r and all(r.get(k) is not None for k in need)]
    if not recs:
        raise SkipFigure(f"{path}: no usable records (what={what}, fields {need})")
    return recs


def latest(recs, key) -> list:
    """Last record of each key (file order)."""
    out = {}
    for r in recs:
        out[key(r)] = r
    return list(out.values())


def _style(impl):
    return dict(IMPL_STYLE.get(impl, dict(color="k", marker=".", label=impl)))


def _impl_order(impl):
    """Sort key of impls in legends: IMPL_STYLE's order, unknown impls after, by name."""
    order = list(IMPL_STYLE)
    return (order.index(impl), "") if impl in IMPL_STYLE else (len(order), str(impl))


def _log2_xticks(ax, xs):
    xs = sorted(set(xs))
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{x // 1024}k" if x >= 1024 else str(x) for x in xs])


def _date(r) -> str:
    return str(r.get("date") or (r.get("provenance") or {}).get("date") or "")


def provenance_text(recs) -> str:
    """``"<gpu>, commit <c>"`` when every plotted record comes from one commit; else every
    commit with its number of records, newest first (by the records' dates): ``"<gpu>, commits
    <c1> (n1), <c2> (n2)"`` (a figure that mixes runs says so)."""
    newest = max(recs, key=_date)
    gpu = newest.get("gpu") or (newest.get("provenance") or {}).get("gpu") or "CPU"
    counts, when = {}, {}
    for r in recs:
        c = str(r.get("commit", ""))[:7]
        counts[c] = counts.get(c, 0) + 1
        when[c] = max(when.get(c, ""), _date(r))
    if len(counts) == 1:
        return f"{gpu}, commit {next(iter(counts))}"
    order = sorted(counts, key=lambda c: when[c], reverse=True)
    return f"{gpu}, commits " + ", ".join(f"{c} ({counts[c]})" for c in order)


def _provenance_note(fig, recs):
    fig.text(0.99, 0.005, provenance_text(recs), ha="right", va="bottom", fontsize=7,
             color="0.4")


def _save(fig, path: Path, recs=None) -> Path:
    """Write ``fig`` to ``path`` (PNG, 120 dpi) and close it; with ``recs``, first note the GPU
    and the commits of the plotted records in the corner (:func:`provenance_text`)."""
    if recs is not None:
        _provenance_note(fig, recs)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return path


# ------------------------------------------------------------------------------------------------
def fig1_prefill_runtime(results: Path, figures: Path, dtype: str = "bfloat16") -> list:
    recs = load(results, "bench_prefill", "prefill", need=("ms", "tflops", "seqlen"))
    recs = [r for r in recs if r.get("dtype") == dtype]
    if not recs:
        raise SkipFigure(f"bench_prefill: no {dtype} records")
    recs = latest(recs, lambda r: (r["impl"], r["headdim"], r["seqlen"], r["causal"]))
    hds = sorted({r["headdim"] for r in recs})
    plt = _plt()
    paths = []
    for metric, ylabel, fname in (("ms", "time per call (ms)", "fig1_prefill_runtime"),
                                  ("tflops", "TFLOP/s (causal counted exactly)", "fig1b_prefill_tflops")):
        fig, axes = plt.subplots(len(hds), 2, figsize=(11, 3.6 * len(hds)), squeeze=False)
        for i, hd in enumerate(hds):
            for j, causal in enumerate((False, True)):
                ax = axes[i][j]
                sub = [r for r in recs if r["headdim"] == hd and r["causal"] == causal]
                for impl in sorted({r["impl"] for r in sub}, key=_impl_order):
                    pts = sorted((r["seqlen"], r[metric]) for r in sub if r["impl"] == impl)
                    ax.plot(*zip(*pts), **_style(impl))
                if sub:
                    _log2_xticks(ax, [r["seqlen"] for r in sub])
                if metric == "ms":
                    ax.set_yscale("log")
                b = sub[0] if sub else {}
                ax.set_title(f"{dtype}, hd{hd}, {'causal' if causal else 'not causal'}"
                             + (f" (H={b.get('nheads')}, B=16k/S)" if b else ""), fontsize=10)
                ax.set_xlabel("sequence length S")
                ax.set_ylabel(ylabel)
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=8)
        fig.suptitle("Prefill: 16k tokens per batch, hidden 2048" if metric == "ms"
                     else "Prefill throughput", fontsize=11)
        paths.append(_save(fig, figures / f"{fname}.png", recs))
    return paths


# ------------------------------------------------------------------------------------------------
def fig2_memory(results: Path, figures: Path) -> list:
    from cupyflash import io_model
    recs = load(results, "exp_memory", "memory", need=("peak_extra_bytes", "seqlen"))
    recs = latest(recs, lambda r: (r["impl"], r["seqlen"]))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.6))
    for impl in sorted({r["impl"] for r in recs}):
        pts = sorted((r["seqlen"], r["peak_extra_bytes"] / 2**30) for r in recs
                     if r["impl"] == impl and r["peak_extra_bytes"] > 0)
        if pts:
            ax.plot(*zip(*pts), linestyle="-", **_style(impl))
    r0 = recs[0]
    B, H, d, dt = r0["batch"], r0["nheads"], r0["headdim"], r0["dtype"]
    ss = sorted({r["seqlen"] for r in recs})
    ax.plot(ss, [io_model.baseline_extra_memory(B, H, H, s, s, d, dt) / 2**30 for s in ss], "--",
            color=_style("baseline")["color"], alpha=0.6, label="model: S, P matrices (O(S²))")
    ax.plot(ss, [io_model.prefill_extra_memory(B, H, s) / 2**30 for s in ss], "--",
            color=_style("cupyflash")["color"], alpha=0.6, label="model: LSE only (O(S))")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    _log2_xticks(ax, ss)
    ax.set_xlabel("sequence length S")
    ax.set_ylabel("peak extra device memory (GiB)")
    ax.set_title(f"Memory beyond the output: batch {B}, {H} heads x {d}, {dt}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return [_save(fig, figures / "fig2_memory.png", recs)]


# ------------------------------------------------------------------------------------------------
def _slope(pts):
    import numpy as np
    if len(pts) < 2:
        return float("nan")
    x, y = zip(*pts)
    return float(np.polyfit(np.log(x), np.log(y), 1)[0])


def fig3_hbm_bytes(results: Path, figures: Path) -> list:
    recs = load(results, "exp_hbm", "hbm", need=("measured_bytes", "model_bytes"))
    recs = latest(recs, lambda r: (r["impl"], r["seqlen"], r.get("causal"), r.get("num_splits")))
    pre = [r for r in recs if r["impl"] in ("cupyflash", "baseline") and not r.get("causal")]
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw=dict(width_ratios=[3, 2]))
    for impl in ("baseline", "cupyflash"):
        sub = sorted((r for r in pre if r["impl"] == impl), key=lambda r: r["seqlen"])
        if not sub:
            continue
        st = _style(impl)
        meas = [(r["seqlen"], r["measured_bytes"] / 1e9) for r in sub]
        ax.plot(*zip(*meas), linestyle="-", color=st["color"], marker=st["marker"],
                label=f"{st['label']}: measured (slope {_slope(meas):.2f})")
        mod = [(r["seqlen"], r["model_bytes"] / 1e9) for r in sub]
        ax.plot(*zip(*mod), linestyle="--", color=st["color"], alpha=0.6,
                label=f"{st['label']}: model (slope {_slope(mod):.2f})"
                + (", K/V once per head" if impl == "cupyflash" else ""))
        if impl == "cupyflash" and all("model_bytes_no_reuse" in r for r in sub):
            nr = [(r["seqlen"], r["model_bytes_no_reuse"] / 1e9) for r in sub]
            ax.plot(*zip(*nr), linestyle=":", color=st["color"], alpha=0.6,
                    label=f"cupyflash: model, K/V per query tile (slope {_slope(nr):.2f})")
    if pre:
        _log2_xticks(ax, [r["seqlen"] for r in pre])
        b = pre[0]
        ax.set_title(f"HBM bytes of one call: batch {b.get('batch')}, {b.get('nheads')} heads x "
                     f"{b.get('headdim')}, {b.get('dtype')}", fontsize=10)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length S")
    ax.set_ylabel("DRAM bytes read + written (GB)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    labels, ratios, colors = [], [], []
    for r in sorted(recs, key=lambda r: (r["impl"], bool(r.get("causal")), r["seqlen"])):
        tag = {"cupyflash_decode": "decode"}.get(r["impl"], r["impl"])
        extra = " causal" if r.get("causal") else ""
        if r["impl"] == "cupyflash_decode":
            extra = f" splits={r.get('num_splits_model', r.get('num_splits'))}"
        labels.append(f"{tag} S={r['seqlen'] // 1024}k{extra}")
        ratios.append(r["measured_bytes"] / r["model_bytes"])
        colors.append(_style(r["impl"] if r["impl"] != "cupyflash_decode" else "cupyflash_unsplit")["color"])
    ax2.barh(range(len(ratios)), ratios, color=colors)
    ax2.axvspan(0.85, 1.15, color="0.85", zorder=0, label="±15%")
    ax2.axvline(1.0, color="k", lw=0.8)
    ax2.set_yticks(range(len(labels)))
    ax2.set_yticklabels(labels, fontsize=7)
    ax2.set_xlabel("measured / model")
    ax2.legend(fontsize=8)
    ax2.set_title("Nsight Compute dram__bytes vs io_model", fontsize=10)
    return [_save(fig, figures / "fig3_hbm_bytes.png", recs)]


# ------------------------------------------------------------------------------------------------
def fig4_roofline(results: Path, figures: Path) -> list:
    from cupyflash import io_model
    import numpy as np
    ceil = common.read_results(results / "bench_ceilings.jsonl")
    bw = [r["tbps"] for r in ceil if r.get("what") == "copy_bw" and "tbps" in r]
    peak = [r["tflops"] for r in ceil if r.get("what") == "bf16_matmul" and "tflops" in r]
    pts = []  # (label, impl, intensity, tflops)
    for r in latest(common.read_results(results / "bench_prefill.jsonl"),
                    lambda r: (r.get("impl"), r.get("dtype"), r.get("headdim"), r.get("seqlen"),
                               r.get("causal"))):
        if r.get("what") != "prefill" or "tflops" not in r or "error" in r:
            continue
        if r.get("dtype") != "bfloat16" or r.get("headdim") != 128 or r.get("causal"):
            continue
        B, H, S, d = r["batch"], r["nheads"], r["seqlen"], r["headdim"]
        if r["impl"] == "baseline":
            nbytes = io_model.baseline_hbm_bytes(B, H, H, S, S, d, "bfloat16")
        else:
            nbytes = io_model.prefill_hbm_bytes(B, H, H, S, S, d, "bfloat16", kv_reuse=True)
        pts.append((f"prefill S={S // 1024}k", r["impl"], io_model.intensity(r["flops"], nbytes),
                    r["tflops"]))
    for r in latest(common.read_results(results / "bench_decode.jsonl"),
                    lambda r: (r.get("impl"), r.get("batch"), r.get("seqlen_k"), r.get("page_size"),
                               r.get("num_splits"), r.get("sweep"))):
        if r.get("what") != "decode" or "us" not in r or "error" in r or r.get("sweep") != "main":
            continue
        if r.get("page_size") or r["impl"] not in ("cupyflash", "baseline", "torch_cudnn"):
            continue
        if r["impl"] == "baseline":
            nbytes = io_model.baseline_hbm_bytes(r["batch"], r["nheads"], r["nheads_k"], 1,
                                                 r["seqlen_k"], r["headdim"], r["dtype"])
        else:  # the split kernel's bytes (torch's kernels read K and V once too)
            ns = r.get("num_splits_chosen") or max(r.get("num_splits") or 1, 1)
            nbytes = io_model.decode_hbm_bytes(r["batch"], r["nheads"], r["nheads_k"], r["seqlen_k"],
                                               r["headdim"], r["dtype"], num_splits=ns)
        tflops = r["flops"] / (r["us"] * 1e-6) / 1e12
        pts.append((f"decode B={r['batch']}", r["impl"], io_model.intensity(r["flops"], nbytes), tflops))
    if not pts:
        raise SkipFigure("no bench_prefill / bench_decode records to place on the roofline")
    # drawn in a fixed order (prefill then decode, impls as in the legends, by intensity), not in
    # the order the points' keys first appear in the files, which depends on the older runs kept
    pts.sort(key=lambda p: (p[0].startswith("decode"), _impl_order(p[1]), p[2], p[3]))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    xs = np.logspace(-1, 4.5, 200)
    if bw and peak:
        BW, P = max(bw), max(peak)
        ax.plot(xs, np.minimum(P, xs * BW), "k-", lw=1.2,
                label=f"roof: copy {BW:.2f} TB/s, bf16 matmul {P:.0f} TFLOP/s")
        ax.axvline(P / BW, color="0.6", lw=0.6, ls=":")
    else:
        ax.text(0.02, 0.97, "ceilings not measured (bench_ceilings.jsonl missing)",
                transform=ax.transAxes, fontsize=8, va="top")
    seen = set()
    for label, impl, i, t in pts:
        st = _style(impl)
        kind = "prefill" if label.startswith("prefill") else "decode"
        lab = f"{st['label']} ({kind})"
        ax.scatter([i], [t], color=st["color"], marker=st["marker"] if kind == "prefill" else "*",
                   s=30 if kind == "prefill" else 60, label=None if lab in seen else lab)
        seen.add(lab)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per HBM byte, io_model)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title("Roofline: prefill (bf16 hd128, not causal) and decode (Llama-3-8B heads)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return [_save(fig, figures / "fig4_roofline.png")]


# ------------------------------------------------------------------------------------------------
def fig5_decode(results: Path, figures: Path) -> list:
    """Figure 5 from the newest full ``bench_decode.py`` run: the last one with a batch-64 point
    (``--quick`` runs, such as the GPU suite's, have none), the records with its commit, L2
    flush method and repeat count (quick runs time 20 calls, full ones 30), so that a quick run
    at the same commit does not replace its points. Runs with the ``read_smem`` flush (a probe
    of the SMs' shared-memory reconfiguration, NOTES v21) are not drawn."""
    recs = load(results, "bench_decode", "decode", need=("tbps", "seqlen_k"))
    full = [r for r in recs if r.get("sweep") == "main" and r.get("batch") == 64
            and r.get("flush_l2") != "read_smem"]
    if full:
        def run(r):
            return r.get("commit"), r.get("flush_l2"), r.get("n_repeat")
        ref = run(full[-1])
        recs = [r for r in recs if run(r) == ref]
    recs = latest(recs, lambda r: (r["impl"], r["batch"], r["seqlen_k"], r.get("page_size"),
                                   r.get("num_splits"), r.get("sweep")))
    ceil = [r["tbps"] for r in common.read_results(results / "bench_ceilings.jsonl")
            if r.get("what") == "read_bw" and "tbps" in r]
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    # (a) num_splits at batch 1
    ax = axes[0]
    sw = [r for r in recs if r.get("sweep") == "splits" and r["batch"] == 1]
    if sw:
        for j, S in enumerate(sorted({r["seqlen_k"] for r in sw})):
            pts = sorted((r["num_splits"], r["tbps"]) for r in sw if r["seqlen_k"] == S and r["num_splits"] > 0)
            if pts:
                ax.plot(*zip(*pts), marker="o", color=f"C{j}", label=f"cupyflash, {S // 1024}k keys")
            h = [r for r in sw if r["seqlen_k"] == S and r["num_splits"] == 0]
            if h and h[0].get("num_splits_chosen"):
                ax.scatter([h[0]["num_splits_chosen"]], [h[0]["tbps"]], marker="*", s=160, color=f"C{j}",
                           zorder=5, label=f"heuristic ({h[0]['num_splits_chosen']} splits)")
            for impl in ("baseline", "torch_flash", "torch_cudnn"):
                o = [r for r in recs if r["impl"] == impl and r["batch"] == 1 and r["seqlen_k"] == S
                     and r.get("sweep") == "main"]
                if o:
                    ax.axhline(o[0]["tbps"], ls="--", lw=0.9, color=_style(impl)["color"],
                               label=f"{_style(impl)['label']}, {S // 1024}k")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("num_splits")
        ax.set_ylabel("TB/s (K and V bytes once)")
        ax.set_title("Batch 1: bandwidth vs num_splits", fontsize=10)
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    else:
        ax.text(0.5, 0.5, "no num_splits sweep", ha="center", transform=ax.transAxes)
    main = [r for r in recs if r.get("sweep") == "main"]
    # (b) vs cache length at batch 1; (c) vs batch at the longest cache
    for ax, title in ((axes[1], "b"), (axes[2], "c")):
        if title == "b":
            sub = [r for r in main if r["batch"] == 1]
            xkey, xlabel = "seqlen_k", "cache length (keys)"
            ttl = "Batch 1: bandwidth vs cache length"
        else:
            if not main:
                continue
            S = max(r["seqlen_k"] for r in main)
            sub = [r for r in main if r["seqlen_k"] == S]
            xkey, xlabel = "batch", "batch"
            ttl = f"{S // 1024}k keys: bandwidth vs batch"
        for impl in ("cupyflash", "cupyflash_unsplit", "baseline", "torch_flash", "torch_cudnn"):
            for page in sorted({r.get("page_size") or 0 for r in sub if r["impl"] == impl}):
                pts = sorted((r[xkey], r["tbps"]) for r in sub
                             if r["impl"] == impl and (r.get("page_size") or 0) == page)
                if not pts:
                    continue
                st = _style(impl)
                if page:
                    st.update(label=f"{st['label']}, paged {page}", linestyle=":" if page < 64 else "-.")
                ax.plot(*zip(*pts), **st)
        if sub:
            if xkey == "seqlen_k":
                _log2_xticks(ax, [r[xkey] for r in sub])
            else:
                ax.set_xscale("log", base=2)
                ax.set_xticks(sorted({r[xkey] for r in sub}))
                ax.set_xticklabels([str(x) for x in sorted({r[xkey] for r in sub})])
        if ceil:
            ax.axhline(max(ceil), color="k", lw=0.8, ls="--", label=f"read bandwidth {max(ceil):.2f} TB/s")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("TB/s (K and V bytes once)")
        ax.set_title(ttl, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Decode, Llama-3-8B heads (32 q / 8 kv, d=128), bf16: FlashAttention alone vs split-KV",
                 fontsize=11)
    return [_save(fig, figures / "fig5_decode.png", recs)]


# ------------------------------------------------------------------------------------------------
def fig6_numerics(results: Path, figures: Path) -> list:
    recs = load(results, "exp_numerics", "numerics", need=("rel_err",))
    err = latest([r for r in recs if r.get("part") == "error"],
                 lambda r: (r["method"], r["dtype"], r["seqlen"], r.get("block_size_k")))
    ovf = latest([r for r in recs if r.get("part") == "overflow"],
                 lambda r: (r["method"], r["dtype"], r["logit_max"]))
    if not err and not ovf:
        raise SkipFigure("exp_numerics: no error / overflow records")
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    floor = 1e-19
    for ci, dt in enumerate(("float32", "float64")):
        sub = [r for r in err if r["dtype"] == dt]
        for bi, bs in enumerate(sorted({r["block_size_k"] for r in sub if r["method"] == "online"})):
            pts = sorted((r["seqlen"], max(r["rel_err"], floor)) for r in sub
                         if r["method"] == "online" and r["block_size_k"] == bs)
            ax.plot(*zip(*pts), marker="os^Dv"[bi % 5], color=f"C{ci}", alpha=0.5 + 0.5 * bi / 3,
                    label=f"{dt} online, block {bs}")
        pts = sorted((r["seqlen"], max(r["rel_err"], floor)) for r in sub if r["method"] == "one_shot")
        if pts:
            ax.plot(*zip(*pts), linestyle="--", marker=".", color=f"C{ci}", lw=2,
                    label=f"{dt} one-shot")
    if err:
        _log2_xticks(ax, [r["seqlen"] for r in err])
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (keys)")
    ax.set_ylabel("relative error vs extended-precision reference")
    ax.set_title("Online (streaming) vs one-shot softmax: same error", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    top = 10.0
    for ci, dt in enumerate(("float16", "float32", "float64")):
        for method, ls, mk in (("no_running_max", ":", "x"), ("online", "-", "o")):
            sub = sorted((r for r in ovf if r["dtype"] == dt and r["method"] == method),
                         key=lambda r: r["logit_max"])
            if not sub:
                continue
            xs = [r["logit_max"] for r in sub]
            ys = [min(max(r["rel_err"], floor), top) if math.isfinite(r["rel_err"]) else top for r in sub]
            ax2.plot(xs, ys, ls=ls, marker=mk, color=f"C{ci + 2}", ms=4,
                     label=f"{dt}, {'without running max' if method != 'online' else 'online (running max)'}")
        ln = [r.get("ln_max") for r in ovf if r["dtype"] == dt and r.get("ln_max")]
        if ln:
            ax2.axvline(ln[0], color=f"C{ci + 2}", lw=0.6, alpha=0.5)
    ax2.axhline(top, color="0.5", lw=0.6)
    ax2.text(1.05, top * 1.3, "inf / NaN", fontsize=7, color="0.4")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_ylim(top=top * 4)
    ax2.set_xlabel("largest logit c (logits in [0.95c, c], 1024 keys)")
    ax2.set_ylabel("relative error of the output")
    ax2.set_title("Overflow: streaming sums need the running max (vertical: ln(max float))", fontsize=10)
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=7)
    return [_save(fig, figures / "fig6_numerics.png", recs)]


# ------------------------------------------------------------------------------------------------
def fig7_tiles(results: Path, figures: Path) -> list:
    recs = load(results, "bench_tiles", "tiles", need=("tflops",))
    recs = latest(recs, lambda r: (r["kernel"], r["seqlen"], r.get("causal")))
    groups = sorted({(r["headdim"], r["seqlen"], bool(r.get("causal"))) for r in recs})
    plt = _plt()
    fig, axes = plt.subplots(1, len(groups), figsize=(max(6, 4.2 * len(groups)), 4.6), squeeze=False)
    for ax, (hd, S, causal) in zip(axes[0], groups):
        sub = sorted((r for r in recs if (r["headdim"], r["seqlen"], bool(r.get("causal"))) == (hd, S, causal)),
                     key=lambda r: (r.get("family", "fwd"), r["block_m"], r["block_n"], r["nwarps"]))
        # family: fwd = mma.sync, fwdtma = the Hopper TMA kernel (the runs of 2026-11-29,
        # before the TMA kernel, are mma.sync rows and carry no family)
        labels = [f"{r.get('family', 'fwd')}\n{r['block_m']}x{r['block_n']}\nw{r['nwarps']}"
                  for r in sub]
        colors = ["C0" if r.get("chosen") else "C7" for r in sub]
        bars = ax.bar(range(len(sub)), [r["tflops"] for r in sub], color=colors)
        for b, r in zip(bars, sub):
            if r.get("rel_diff") is not None and r["rel_diff"] > 2e-2:
                b.set_hatch("//")
        ax.set_xticks(range(len(sub)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"hd{hd}, S={S}{', causal' if causal else ''} (blue: explain()'s choice)", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("Prefill tile sweep: kernel family, BLOCK_M x BLOCK_N, warps (bf16, 16k tokens per batch)",
                 fontsize=11)
    return [_save(fig, figures / "fig7_tiles.png", recs)]


# ------------------------------------------------------------------------------------------------
def _bwd_plan(r) -> str:
    """``"hopper"`` where a cupyflash record ran the Hopper kernel (``bwd_kernels``), else ``""``."""
    return "hopper" if any(str(n).startswith("bwdtma") for n in r.get("bwd_kernels") or ()) else ""


def backward(results: Path, figures: Path, dtype: str = "bfloat16") -> list:
    """Backward TFLOP/s (2.5 x the forward's FLOPs over ``ms_bwd``) vs S from
    bench_backward.jsonl's last run: a panel per (head dim, causal), a line per impl, cupyflash's
    deterministic backward dashed, its Hopper kernel (``bwdtma_*`` in ``bwd_kernels``) with square
    markers."""
    recs = load(results, "bench_backward", "backward", need=("tflops_bwd", "seqlen", "headdim"))
    recs = [r for r in recs if r.get("dtype") == dtype]
    if not recs:
        raise SkipFigure(f"bench_backward: no {dtype} records")
    last = recs[-1].get("run")  # one run: its impls timed side by side on one GPU and commit
    recs = latest([r for r in recs if r.get("run") == last],
                  lambda r: (r["impl"], bool(r.get("deterministic")), _bwd_plan(r),
                             r["headdim"], r["seqlen"], bool(r.get("causal"))))
    hds = sorted({r["headdim"] for r in recs})
    plt = _plt()
    fig, axes = plt.subplots(len(hds), 2, figsize=(11, 3.6 * len(hds)), squeeze=False)
    for i, hd in enumerate(hds):
        for j, causal in enumerate((False, True)):
            ax = axes[i][j]
            sub = [r for r in recs if r["headdim"] == hd and bool(r.get("causal")) == causal]
            lines = sorted({(r["impl"], bool(r.get("deterministic")), _bwd_plan(r)) for r in sub},
                           key=lambda x: (_impl_order(x[0]), x[2], x[1]))
            for impl, det, plan in lines:
                pts = sorted((r["seqlen"], r["tflops_bwd"]) for r in sub
                             if r["impl"] == impl and bool(r.get("deterministic")) == det
                             and _bwd_plan(r) == plan)
                st = _style(impl)
                if plan:
                    st.update(marker="s", label=f"{st['label']}, Hopper kernel")
                if det:
                    st.update(linestyle="--", label=f"{st['label']}, deterministic")
                ax.plot(*zip(*pts), **st)
            if sub:
                _log2_xticks(ax, [r["seqlen"] for r in sub])
            b = sub[0] if sub else {}
            ax.set_title(f"{dtype}, hd{hd}, {'causal' if causal else 'not causal'}"
                         + (f" (H={b.get('nheads')}, B=16k/S)" if b else ""), fontsize=10)
            ax.set_xlabel("sequence length S")
            ax.set_ylabel("backward TFLOP/s (2.5 x forward FLOPs)")
            top = max((r["tflops_bwd"] for r in sub), default=1.0)
            ax.set_ylim(0, 1.6 * top)  # room above the lines for the legend
            ax.grid(True, which="both", alpha=0.3)
            if lines:
                ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("Backward pass: (forward + backward) - forward, 16k tokens per batch, hidden 2048",
                 fontsize=11)
    return [_save(fig, figures / "backward.png", recs)]



TRAIN_STYLE = {
    "sdpa": dict(color="C1", lw=1.4, label="SDPA (reference)"),
    "cupyflash": dict(color="C0", lw=1.4, label="cupyflash (attn_implementation=\"cupyfa\")"),
    "sdpa_alt": dict(color="0.45", lw=1.0, ls="--", label="SDPA, another backend (noise floor)"),
}


def train_llama(results: Path, figures: Path) -> list:
    """Loss per step of the last train_llama.py run in the file, every attention (upper panel),
    and each run's loss minus SDPA's (lower panel: per step, thin; its moving-average difference,
    thick; shaded: the agreement band +-tol x SDPA's moving average)."""
    from train_llama import moving_average
    path = results / "train_llama.jsonl"
    recs = common.read_results(path)
    if not recs:
        raise SkipFigure(f"{path} missing or empty")
    runs = [r for r in recs if r.get("what") == "train" and r.get("loss")]
    if not runs:
        raise SkipFigure(f"{path}: no train record with losses")
    last = runs[-1].get("run")
    runs = [r for r in runs if r.get("run") == last]
    failed = [r for r in recs if r.get("what") == "train" and r.get("run") == last
              and not r.get("loss")]
    comps = {c["impl"]: c for c in recs if c.get("what") == "compare" and c.get("run") == last}
    ref = next((r for r in runs if r["impl"] == "sdpa"), None)
    window = next(iter(comps.values()), {}).get("ma_window", 10)
    tol = next(iter(comps.values()), {}).get("tol", 0.02)
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 7.2), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 2]})

    def label(r):
        st = dict(TRAIN_STYLE.get(r["impl"], dict(color="k", label=r["impl"])))
        extra = []
        if r.get("tokens_per_s"):
            extra.append(f"{r['tokens_per_s'] / 1e3:,.0f}k tok/s")
        if r.get("error"):
            extra.append(f"raised at step {r.get('failed_step')} ({r.get('failed_phase')})")
        return st, st.pop("label") + (f" [{', '.join(extra)}]" if extra else "")

    for r in runs:
        st, lab = label(r)
        ax.plot(range(len(r["loss"])), r["loss"], label=lab,
                marker="o" if len(r["loss"]) < 3 else None, **st)
    floor = (runs[0].get("data") or {}).get("loss_floor")
    if floor:
        ax.axhline(floor, color="0.6", lw=0.8, ls=":",
                   label=f"loss floor of the data ({floor:.2f})")
    ax.set_ylabel("training loss (nats/token)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    m = runs[0].get("model") or {}
    d = runs[0].get("data") or {}
    ax.set_title(f"Llama {m.get('layers', '?')} layers, hidden {m.get('hidden', '?')}, "
                 f"{m.get('heads', '?')}/{m.get('kv_heads', '?')} heads x "
                 f"{m.get('head_dim', '?')}, "
                 f"{runs[0].get('precision', '')}; {d.get('batch', '?')} x {d.get('seqlen', '?')} "
                 "tokens per step", fontsize=10)
    if ref is not None:
        ma_ref = moving_average(ref["loss"], window)
        xs = range(window - 1, len(ma_ref))
        ax2.fill_between(xs, [-tol * ma_ref[i] for i in xs], [tol * ma_ref[i] for i in xs],
                         color="C2", alpha=0.12, label=f"agreement band: ±{tol:.0%} of SDPA's "
                         f"{window}-step moving average")
        for r in runs:
            if r is ref:
                continue
            n = min(len(r["loss"]), len(ref["loss"]))
            st, lab = label(r)
            st.pop("lw", None)
            diff = [r["loss"][i] - ref["loss"][i] for i in range(n)]
            ax2.plot(range(n), diff, lw=0.6, alpha=0.45, **st)
            ma = moving_average(r["loss"][:n], window)
            c = comps.get(r["impl"], {})
            verdict = {True: "agree", False: "differ"}.get(c.get("agree"), "not judged")
            stat = (f"max {c['max_ma_rel_diff']:.2%}, " if c.get("max_ma_rel_diff") is not None
                    else "")
            ax2.plot(range(n), [a - b for a, b in zip(ma, ma_ref[:n])], lw=1.8,
                     label=f"{r['impl']} - sdpa, moving average ({stat}{verdict})", **st)
    ax2.axhline(0, color="k", lw=0.6)
    notes = [f"{r['impl']}: {str(r.get('error', 'no steps'))[:90]}" for r in failed]
    if ref is None:
        notes.append("no sdpa run: no difference to draw")
    if notes:
        ax2.text(0.01, 0.03, "\n".join(notes), transform=ax2.transAxes, fontsize=7, color="C3",
                 va="bottom")
    ax2.set_xlabel("step")
    ax2.set_ylabel("loss - SDPA's loss")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=7, loc="upper right")
    return [_save(fig, figures / "train_llama.png", runs)]


FIGURES = {f.__name__: f for f in (fig1_prefill_runtime, fig2_memory, fig3_hbm_bytes, fig4_roofline,
                                   fig5_decode, fig6_numerics, fig7_tiles, backward,
                                   train_llama)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=common.RESULTS)
    ap.add_argument("--figures", type=Path, default=common.FIGURES)
    ap.add_argument("--only", nargs="+", choices=sorted(FIGURES), default=None)
    args = ap.parse_args(argv)
    args.figures.mkdir(parents=True, exist_ok=True)
    made, skipped, failed = [], [], []
    for name, fn in FIGURES.items():
        if args.only and name not in args.only:
            continue
        try:
            paths = fn(args.results, args.figures)
            made += paths
            print(f"plot: {name}: wrote {', '.join(str(p) for p in paths)}")
        except SkipFigure as e:
            skipped.append(name)
            print(f"plot: {name}: skipped ({e})")
        except Exception as e:  # report, draw the other figures, and exit non-zero
            failed.append(name)
            print(f"plot: {name}: FAILED ({type(e).__name__}: {e})")
    print(f"plot: {len(made)} files written, {len(skipped)} figures skipped (no results), "
          f"{len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
