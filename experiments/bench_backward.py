"""Training step of attention: how fast is cupyflash's backward pass (forward + backward) beside
torch SDPA's cuDNN and FlashAttention-2 backends and FlexAttention (``torch.compile``), timed side
by side in one run, and at what peak memory?

Shapes follow bench_prefill (FlashAttention-2's benchmark): 16k tokens per batch
(``batch = max(1, 16384 / S)``), hidden 2048 (``nheads = 2048 / headdim``), self-attention,
head dims 64/128/256, causal and not, S = 512 .. 32768 (``--quick``: 1k and 4k), bf16
(``--fp16`` adds float16). cupyflash runs with ``deterministic`` False and True.

Per (shape, impl), CUDA-event medians (``common.benchmark``; ``--rounds R``: R interleaved rounds,
the median round kept, as in bench_prefill) of

* ``ms_fwd``: the training forward alone (inputs that require grad, so the call saves what its
  backward needs; the output is dropped);
* ``ms_fwd_bwd``: forward, then ``out.backward(dout)`` into fresh ``.grad`` s (set to None first,
  so no accumulation kernel runs);
* ``ms_bwd = ms_fwd_bwd - ms_fwd``; ``tflops_bwd = 2.5 * flops_fwd / ms_bwd`` with
  ``flops_fwd = 4 * batch * nheads * S^2 * headdim``, halved when causal (FlashAttention-2's
  count: the backward does 2.5 times the forward's matmul work).

What a user calls: cupyflash ``flash_attn_func(q, k, v, causal=, deterministic=)`` on
(batch, S, nheads, d) tensors; SDPA on ``q.transpose(1, 2)`` views of the same tensors (the
(batch, nheads, S, d) order torch wants, as a model writes it; when a backend rejects the views,
contiguous (batch, nheads, S, d) leaves: ``torch_layout`` says which), the backend chosen with
``sdpa_kernel``; FlexAttention ``torch.compile(flex_attention, dynamic=False)`` on the same views,
the causal block mask made once per shape outside the timing (one compile per shape, its time in
``first_call_s``; ``--flex-dynamic``: dynamic shapes, fewer compiles, possibly slower kernels). ``dout`` is one (batch, S, nheads, d) tensor, given
to SDPA and Flex as its transposed view.

``impl="cupyflash_kernel"`` is cupyflash without autograd: ``ms_fwd`` times
``flash_attn_func(..., return_lse=True)``, ``ms_bwd`` times ``flash_attn_backward(dout, q, k, v,
out, lse, causal=, deterministic=)`` alone (``bwd_timing: "direct"``; ``ms_bwd_diff`` is
``ms_fwd_bwd - ms_fwd`` beside it).

Each record (``what: "backward"``): impl, dtype, headdim, batch, nheads, seqlen, causal,
deterministic (False for the peers: their defaults), flops_fwd, flops_bwd, ms_fwd, ms_fwd_bwd,
ms_bwd, tflops_bwd (tflops_fwd, tflops_fwd_bwd), the timing spread, ``first_call_s`` (the first
forward + backward, compiles included), ``peak_mem_bytes`` (``torch.cuda.max_memory_allocated``
over one forward + backward, after ``reset_peak_memory_stats``, minus what was allocated before
it: the inputs q, k, v, dout, ``inputs_bytes``; plus the growth of CuPy's pool, if cupyflash
allocates there: ``cupy_pool_bytes``); for cupyflash ``ratio_vs_<peer> = peer ms_bwd /
cupyflash ms_bwd`` (above 1: cupyflash's backward is faster) and ``ratio_fwd_bwd_vs_<peer>``,
against torch_cudnn, torch_flash and flex of the same shape and run, and ``bitwise_repeatable``
(two runs' gradients equal bit for bit), ``bwd_kernels`` (the dK/dV kernels cupyflash ran so far
for this mask: ``bwdtma_*`` is the Hopper plan, sm_90a's default). Correctness, once per shape, outside the timing: every
impl's out, dq, dk, dv against torch SDPA's math backend in float32 on the same inputs
(batch 0, the first ``ref_heads`` heads: as many as fit ``--ref-budget-gib``, at least one),
``rel_err_out``, ``rel_err_dq``, ``rel_err_dk``, ``rel_err_dv`` (``||x - ref|| / ||ref||``); never
asserted. An impl that cannot run here (does not import, no backward in this cupyflash) is
skipped with a ``what: "skipped"`` record saying why; one that fails on a shape gets ``error``.

    python experiments/bench_backward.py --quick      # bf16, S 1k/4k: ~4-6 min on an H200 (estimate:
                                                      # mostly Flex's 12 compiles)
    python experiments/bench_backward.py --headdims 128   # one head dim, S 512 .. 32k: ~5-7 min
    python experiments/bench_backward.py              # all three: ~15-20 min (split it by head dim:
                                                      # run_gpu_experiments.sh full bench_backward_hd64 ...)

Appends a run to ``experiments/results/bench_backward.jsonl`` (experiments/common.py); plot.py
draws ``figures/backward.png`` from it. Give a device run its commit: ``CUPYFLASH_COMMIT=<sha>``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_prefill  # noqa: E402
import common  # noqa: E402
from common import RESULTS  # noqa: E402

IMPLS = ("cupyflash", "cupyflash_kernel", "torch_cudnn", "torch_flash", "flex")
CUPYFLASH_IMPLS = ("cupyflash", "cupyflash_kernel")
PEERS = ("torch_cudnn", "torch_flash", "flex")
DTYPES = ("bfloat16", "float16")
SEQLENS_FULL = (512, 1024, 2048, 4096, 8192, 16384, 32768)
SEQLENS_QUICK = (1024, 4096)
BWD_OVER_FWD = 2.5  # FlashAttention-2's count: backward FLOPs = 2.5 x the forward's


# ------------------------------------------------------------------------------------------------
# Pure parts (no GPU): arguments, shapes, FLOPs, records
# ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="reduced sweep (S in 1k/4k)")
    ap.add_argument("--fp16", action="store_true", help="float16 too (default: bfloat16 only)")
    ap.add_argument("--dtypes", nargs="+", default=None, choices=DTYPES,
                    help="dtypes (overrides --fp16)")
    ap.add_argument("--headdims", nargs="+", type=int, default=[64, 128, 256])
    ap.add_argument("--seqlens", nargs="+", type=int, default=None)
    ap.add_argument("--causal", choices=["both", "true", "false"], default="both")
    ap.add_argument("--deterministic", choices=["both", "true", "false"], default="both",
                    help="cupyflash's deterministic backward")
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per batch (batch = tokens / S)")
    ap.add_argument("--hidden", type=int, default=2048, help="nheads = hidden / headdim")
    ap.add_argument("--n-warmup", type=int, default=3)
    ap.add_argument("--n-repeat", type=int, default=None, help="timed calls (default 20, --quick 10)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="interleaved timing rounds per shape (bench_prefill's --rounds)")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    ap.add_argument("--no-check", action="store_true", help="skip the float32 reference check")
    ap.add_argument("--ref-budget-gib", type=float, default=8.0,
                    help="memory for the math reference's S x S matrices (sets ref_heads)")
    ap.add_argument("--flex-dynamic", action="store_true",
                    help="compile Flex with dynamic shapes (fewer compiles; default: static)")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_backward.jsonl")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments, with the sweep resolved: ``dtypes``, ``seqlens``, ``causals`` (bools),
    ``deterministics`` (bools), ``n_repeat``."""
    ap = build_parser()
    args = ap.parse_args(argv)
    args.dtypes = args.dtypes or (["bfloat16", "float16"] if args.fp16 else ["bfloat16"])
    args.seqlens = args.seqlens or list(SEQLENS_QUICK if args.quick else SEQLENS_FULL)
    args.causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    args.deterministics = {"both": [False, True], "true": [True], "false": [False]}[args.deterministic]
    args.n_repeat = args.n_repeat or (10 if args.quick else 20)
    if args.rounds < 1:
        ap.error(f"--rounds: expected an int >= 1, got {args.rounds}")
    bad = [d for d in args.headdims if d <= 0 or args.hidden % d]
    if bad:
        ap.error(f"--headdims: {bad} do not divide --hidden {args.hidden}")
    if any(s <= 0 for s in args.seqlens):
        ap.error(f"--seqlens: expected positive lengths, got {args.seqlens}")
    return args


def shape_list(args) -> list:
    """The sweep's problems, in order (dtype, head dim, S, causal), each a dict of dtype,
    headdim, batch, nheads, seqlen, causal."""
    return [{"dtype": dt, "headdim": d, "batch": max(1, args.tokens // S),
             "nheads": args.hidden // d, "seqlen": S, "causal": c}
            for dt in args.dtypes for d in args.headdims for S in args.seqlens for c in args.causals]


def fwd_flops(batch, nheads, seqlen, headdim, causal) -> float:
    """Forward FLOPs, FlashAttention-2's count: ``4 * batch * nheads * S^2 * headdim`` (two
    matmuls), halved when causal."""
    f = 4.0 * batch * nheads * seqlen * seqlen * headdim
    return f / 2 if causal else f


def bwd_flops(batch, nheads, seqlen, headdim, causal) -> float:
    """Backward FLOPs: 2.5 x the forward's (five matmuls against two)."""
    return BWD_OVER_FWD * fwd_flops(batch, nheads, seqlen, headdim, causal)


def _tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12 if ms and ms > 0 else None


def _spread(prefix: str, t: dict) -> dict:
    """A timing's spread under ``prefix`` (``ms_fwd`` -> ms_fwd_min, ms_fwd_p20, ...)."""
    out = {}
    for k in ("ms_min", "ms_p20", "ms_p80"):
        if k in t:
            out[f"{prefix}_{k[3:]}"] = t[k]
    if "ms_rounds" in t:
        out[f"{prefix}_rounds"] = t["ms_rounds"]
    return out


def base_record(shape: dict, impl: str, deterministic: bool) -> dict:
    """The fields every record of ``impl`` on ``shape`` carries before it is timed."""
    b, h, s, d, c = (shape[k] for k in ("batch", "nheads", "seqlen", "headdim", "causal"))
    return {"what": "backward", "impl": impl, "dtype": shape["dtype"], "headdim": d, "batch": b,
            "nheads": h, "seqlen": s, "causal": c, "deterministic": bool(deterministic),
            "flops_fwd": fwd_flops(b, h, s, d, c), "flops_bwd": bwd_flops(b, h, s, d, c)}


def timed_fields(rec: dict, t_fwd: dict, t_fwd_bwd: dict, t_bwd: dict | None = None) -> dict:
    """The timing fields of a record from :func:`common.benchmark` results: ``ms_fwd``,
    ``ms_fwd_bwd``, ``ms_bwd`` (``t_bwd``'s median when the backward was timed alone, else the
    difference; ``bwd_timing`` says which), TFLOP/s of each, the spreads."""
    ms_fwd, ms_fwd_bwd = t_fwd["ms"], t_fwd_bwd["ms"]
    diff = ms_fwd_bwd - ms_fwd
    out = {"ms_fwd": ms_fwd, "ms_fwd_bwd": ms_fwd_bwd}
    if t_bwd is not None:
        out.update(ms_bwd=t_bwd["ms"], bwd_timing="direct", ms_bwd_diff=diff, **_spread("ms_bwd", t_bwd))
    else:
        out.update(ms_bwd=diff, bwd_timing="difference")
    out.update(tflops_bwd=_tflops(rec["flops_bwd"], out["ms_bwd"]),
               tflops_fwd=_tflops(rec["flops_fwd"], ms_fwd),
               tflops_fwd_bwd=_tflops(rec["flops_fwd"] + rec["flops_bwd"], ms_fwd_bwd),
               n_repeat=t_fwd_bwd.get("n_repeat"), host_ms_fwd_bwd=t_fwd_bwd.get("host_ms"),
               **_spread("ms_fwd", t_fwd), **_spread("ms_fwd_bwd", t_fwd_bwd))
    return out


def add_ratios(records: list) -> list:
    """For each cupyflash record (``cupyflash``, ``cupyflash_kernel``) of one shape, beside every
    peer of ``records`` timed in the same run: ``ratio_vs_<peer> = peer ms_bwd / ms_bwd`` (above
    1: cupyflash faster) and ``ratio_fwd_bwd_vs_<peer>``. Records with an ``error`` or without
    timings are left out on both sides. Returns ``records`` (updated in place)."""
    peers = {r["impl"]: r for r in records
             if r.get("impl") in PEERS and "error" not in r and r.get("ms_bwd")}
    for r in records:
        if r.get("impl") not in CUPYFLASH_IMPLS or "error" in r or not r.get("ms_bwd"):
            continue
        for name, p in peers.items():
            if r["ms_bwd"] > 0 and p["ms_bwd"] > 0:
                r[f"ratio_vs_{name}"] = p["ms_bwd"] / r["ms_bwd"]
            if r.get("ms_fwd_bwd") and p.get("ms_fwd_bwd"):
                r[f"ratio_fwd_bwd_vs_{name}"] = p["ms_fwd_bwd"] / r["ms_fwd_bwd"]
    return records


def rel_err(x, ref) -> float:
    """``||x - ref|| / ||ref||`` in float32 (torch tensors of one shape)."""
    a, b = x.detach().float(), ref.detach().float()
    return float((a - b).norm() / b.norm())


def ref_heads(nheads: int, seqlen: int, budget_gib: float) -> int:
    """Heads of batch 0 that the float32 math reference takes: as many as fit ``budget_gib``
    at ~6 live S x S float32 matrices per head (scores, probabilities and their gradients),
    at least one, at most ``nheads``."""
    per_head = 6 * 4 * seqlen * seqlen
    return max(1, min(nheads, int(budget_gib * 2**30 // per_head)))


def label(rec: dict) -> str:
    """A record's name in the printed summary: ``impl`` and ``[det]`` when deterministic."""
    return rec["impl"] + ("[det]" if rec.get("deterministic") else "")


def summary_line(shape: dict, records: list) -> str:
    tf = "  ".join(f"{label(r)}={r['tflops_bwd']:.0f}" for r in records if r.get("tflops_bwd"))
    rat = "  ".join(f"{label(r)}/{p[len('ratio_vs_'):]}=x{r[p]:.2f}" for r in records
                    if r["impl"] == "cupyflash" for p in sorted(r) if p.startswith("ratio_vs_"))
    return (f"  {shape['dtype']} hd{shape['headdim']} B={shape['batch']} H={shape['nheads']} "
            f"S={shape['seqlen']} causal={shape['causal']}: bwd TFLOP/s {tf}"
            + (f"\n    ratio (peer ms_bwd / ours) {rat}" if rat else ""))


# ------------------------------------------------------------------------------------------------
# Implementations: each a dict of callables on one shape's inputs
# ------------------------------------------------------------------------------------------------
def _cupyflash():
    """The cupyflash module (tests substitute their own)."""
    import cupyflash
    return cupyflash


def _version(module: str):
    try:
        return __import__(module).__version__
    except Exception:
        return None


def _sync(device) -> None:
    import torch
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _autograd_fns(fwd, leaves, dout, out_to_bshd, grad_to_bshd) -> dict:
    """``clear`` (the leaves' grads to None) and ``fwd_bwd`` (clear, ``fwd()``, ``backward``;
    returns out, dq, dk, dv in (batch, S, nheads, d) order) around a grad-enabled ``fwd``."""
    def clear():
        for t in leaves:
            t.grad = None

    def fwd_bwd():
        clear()
        out = fwd()
        out.backward(dout)
        return (out_to_bshd(out), *(grad_to_bshd(t.grad) for t in leaves))
    return {"fwd": fwd, "fwd_bwd": fwd_bwd, "clear": clear, "dout": dout}


def _ident(x):
    return x


def _bhsd(x):
    return x.transpose(1, 2)


def cupyflash_fns(q, k, v, dout, causal, deterministic) -> dict:
    """cupyflash through autograd: ``flash_attn_func(q, k, v, causal=, deterministic=)``, then
    ``out.backward(dout)``."""
    f = _cupyflash().flash_attn_func

    def fwd():
        return f(q, k, v, causal=causal, deterministic=deterministic)
    return _autograd_fns(fwd, (q, k, v), dout, _ident, _ident)


def cupyflash_kernel_fns(q, k, v, dout, causal, deterministic) -> dict:
    """cupyflash without autograd: ``flash_attn_func(..., return_lse=True)`` and
    ``flash_attn_backward(dout, q, k, v, out, lse, ...)``; ``bwd`` reuses one forward's out and
    lse."""
    cf = _cupyflash()
    f, b = cf.flash_attn_func, cf.flash_attn_backward
    qd, kd, vd = (x.detach() for x in (q, k, v))

    def fwd():
        return f(qd, kd, vd, causal=causal, return_lse=True)
    saved = {}

    def bwd():
        if "out" not in saved:
            saved["out"], saved["lse"] = fwd()
        return b(dout, qd, kd, vd, saved["out"], saved["lse"], causal=causal,
                 deterministic=deterministic)

    def fwd_bwd():
        out, lse = fwd()
        dq, dk, dv = b(dout, qd, kd, vd, out, lse, causal=causal, deterministic=deterministic)
        return out, dq, dk, dv
    return {"fwd": fwd, "fwd_bwd": fwd_bwd, "bwd": bwd, "clear": lambda: None, "saved": saved}


_FLEX = {}


def flex_compiled(dynamic: bool):
    """``torch.compile(flex_attention, dynamic=dynamic)``, made once; dynamo's recompile limit
    raised so that each shape of the sweep gets its own compile instead of eager FlexAttention
    (which materialises the scores) after the eighth."""
    if dynamic not in _FLEX:
        import torch
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 512))
        for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 4096))
        _FLEX[dynamic] = torch.compile(flex_attention, dynamic=dynamic)
    return _FLEX[dynamic]


def _causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def peer_fns(impl, q, k, v, dout, causal, flex_dynamic=False) -> dict:
    """A torch peer (``torch_cudnn``, ``torch_flash``, ``flex``) on (batch, nheads, S, d)
    arguments: transposed views of q, k, v first; contiguous (batch, nheads, S, d) leaves when
    the backend rejects the views (``layout``). A first forward + backward is run here (its
    wall time, compiles included: ``first_call_s``). Raises RuntimeError with each layout's
    error when neither runs."""
    import torch.nn.functional as F
    if impl.startswith("torch_"):
        backend = impl[len("torch_"):]

        def call(qt, kt, vt):
            with common.sdpa_backend(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    elif impl == "flex":
        from torch.nn.attention.flex_attention import create_block_mask
        flex = flex_compiled(flex_dynamic)
        S = q.shape[1]
        mask = (create_block_mask(_causal_mask, None, None, S, S, device=q.device) if causal
                else None)

        def call(qt, kt, vt):
            return flex(qt, kt, vt, block_mask=mask)
    else:
        raise ValueError(f"impl: unknown peer {impl!r}; known: {PEERS}")
    errors = []
    for layout in ("bshd_view", "bhsd_contiguous"):
        if layout == "bshd_view":
            leaves, prep, grad_to_bshd, d = (q, k, v), _bhsd, _ident, dout.transpose(1, 2)
        else:
            leaves = tuple(x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
            prep, grad_to_bshd, d = _ident, _bhsd, dout.transpose(1, 2).contiguous()

        def fwd(leaves=leaves, prep=prep):
            return call(*(prep(t) for t in leaves))
        fns = _autograd_fns(fwd, leaves, d, _bhsd, grad_to_bshd)
        try:
            t0 = time.perf_counter()
            fns["fwd_bwd"]()
            _sync(q.device)
            fns.update(layout=layout, first_call_s=round(time.perf_counter() - t0, 3))
            fns["clear"]()
            return fns
        except Exception as e:  # noqa: PERF203 - try the next layout
            fns["clear"]()
            first = (str(e).strip().splitlines() or [""])[0]
            errors.append(f"{layout}: {type(e).__name__}: {first[:300]}")
    raise RuntimeError(f"{impl}: " + " | ".join(errors))


def make_fns(impl, deterministic, q, k, v, dout, causal, flex_dynamic=False) -> dict:
    """The callables of one configuration (module docstring), its first forward + backward
    already run (``first_call_s``)."""
    if impl in PEERS:
        return peer_fns(impl, q, k, v, dout, causal, flex_dynamic)
    if impl == "cupyflash":
        fns = cupyflash_fns(q, k, v, dout, causal, deterministic)
    elif impl == "cupyflash_kernel":
        fns = cupyflash_kernel_fns(q, k, v, dout, causal, deterministic)
    else:
        raise ValueError(f"impl: unknown {impl!r}; known: {IMPLS}")
    t0 = time.perf_counter()
    fns["fwd_bwd"]()
    _sync(q.device)
    fns["first_call_s"] = round(time.perf_counter() - t0, 3)
    fns["clear"]()
    return fns


def impl_available(impl: str) -> tuple:
    """``(ok, why_not)`` for the names of :data:`IMPLS` on this machine."""
    if impl in CUPYFLASH_IMPLS:
        try:
            _cupyflash().flash_attn_backward  # noqa: B018 - raises when there is none
        except Exception as e:
            return False, (f"this cupyflash has no backward pass (cupyflash.flash_attn_backward: "
                           f"{type(e).__name__}: {str(e)[:200]})")
        return True, ""
    if impl == "flex":
        ok, why = common.impl_available("torch_flash")  # torch with CUDA
        if not ok:
            return ok, why
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
            import triton  # noqa: F401 - torch.compile's GPU code generator
        except Exception as e:
            return False, f"FlexAttention does not import ({type(e).__name__}: {str(e)[:200]})"
        return True, ""
    return common.impl_available(impl)


# ------------------------------------------------------------------------------------------------
# Measurements beside the timing
# ------------------------------------------------------------------------------------------------
def peak_memory(fns, device) -> dict:
    """Peak memory of one forward + backward: ``torch.cuda.max_memory_allocated`` over the call
    (after ``reset_peak_memory_stats``) minus ``memory_allocated`` before it (the inputs and
    whatever else was live), plus the growth of CuPy's pool over the call (emptied first).
    Returns the fields and, under ``"result"``, the call's (out, dq, dk, dv)."""
    import torch
    if not str(device).startswith("cuda"):
        return {"result": fns["fwd_bwd"]()}
    import cupy
    fns["clear"]()
    torch.cuda.synchronize()
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    pool0 = pool.total_bytes()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    res = fns["fwd_bwd"]()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    grown = pool.total_bytes() - pool0
    return {"peak_mem_bytes": int(peak - before + grown), "peak_mem_torch_bytes": int(peak - before),
            "cupy_pool_bytes": int(grown), "mem_before_bytes": int(before), "result": res}


def reference(q, k, v, dout, causal, heads: int) -> tuple:
    """(out, dq, dk, dv) of batch 0's first ``heads`` heads in (1, S, heads, d) order, by torch
    SDPA's math backend in float32 from the same (rounded) inputs."""
    import torch.nn.functional as F
    leaves = [x.detach()[:1, :, :heads].float().transpose(1, 2).contiguous().requires_grad_()
              for x in (q, k, v)]
    with common.sdpa_backend("math"):
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    out.backward(dout[:1, :, :heads].float().transpose(1, 2))
    res = tuple(x.detach().transpose(1, 2).contiguous() for x in (out, *(t.grad for t in leaves)))
    del out, leaves
    return res


def check_fields(res, ref, heads: int) -> dict:
    """``rel_err_out``, ``rel_err_dq``, ``rel_err_dk``, ``rel_err_dv`` of a configuration's
    (out, dq, dk, dv) on batch 0's first ``heads`` heads against ``ref``."""
    return {f"rel_err_{n}": rel_err(x[:1, :, :heads], r)
            for n, x, r in zip(("out", "dq", "dk", "dv"), res, ref)}


def _grads_equal(a, b) -> bool:
    import torch
    return all(torch.equal(x, y) for x, y in zip(a[1:], b[1:]))


# ------------------------------------------------------------------------------------------------
def _fail(rec: dict, e: Exception) -> None:
    rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    print(f"bench_backward: {label(rec)} {rec['dtype']} hd{rec['headdim']} S={rec['seqlen']} "
          f"causal={rec['causal']}: {rec['error']}", flush=True)


def configs(impls, deterministics) -> list:
    """(impl, deterministic) pairs timed per shape: cupyflash's for each of ``deterministics``,
    the peers once (False: their defaults)."""
    return [(i, det) for i in impls for det in (deterministics if i in CUPYFLASH_IMPLS else [False])]


def inputs(shape: dict, device="cuda", seed: int = 0) -> tuple:
    """q, k, v (leaves that require grad) and dout, (batch, S, nheads, d), standard normal."""
    import torch
    g = torch.Generator(device=device).manual_seed(seed)
    dt = getattr(torch, shape["dtype"])
    dims = (shape["batch"], shape["seqlen"], shape["nheads"], shape["headdim"])
    q, k, v, dout = (torch.randn(dims, generator=g, device=device, dtype=dt) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


def run_shape(shape: dict, args, impls: list, device="cuda") -> list:
    """Every configuration of ``impls`` on one shape: set up (first call), time in
    ``args.rounds`` interleaved rounds, then per configuration the peak memory and the check
    against the float32 reference. Returns the records (errors recorded, never raised)."""
    q, k, v, dout = inputs(shape, device, seed=shape["seqlen"] + shape["headdim"])
    inputs_bytes = sum(x.element_size() * x.numel() for x in (q, k, v, dout))
    records, fns = [], {}
    for impl, det in configs(impls, args.deterministics):
        rec = dict(base_record(shape, impl, det), inputs_bytes=inputs_bytes)
        records.append(rec)
        try:
            f = make_fns(impl, det, q, k, v, dout, shape["causal"], args.flex_dynamic)
            fns[(impl, det)] = f
            rec["first_call_s"] = f["first_call_s"]
            if "layout" in f:
                rec["torch_layout"] = f["layout"]
            if impl in CUPYFLASH_IMPLS:  # which backward plan ran (kernels_cu/backward/*.cu)
                from cupyflash.backward import run as bwd_run
                rec["bwd_kernels"] = sorted({key[0].name for key in bwd_run._LAUNCHES
                                             if key[0].causal == shape["causal"]
                                             and key[0].headdim == shape["headdim"]
                                             and key[0].role == "dkdv"})
            if impl == "flex":
                rec["flex_dynamic"] = bool(args.flex_dynamic)
                rec["triton"] = _version("triton")
        except Exception as e:  # record why, keep going
            _fail(rec, e)
    timers = {}
    for key, f in fns.items():
        for phase in ("fwd", "fwd_bwd", "bwd"):
            if phase in f:
                timers[(key, phase)] = f[phase]
    timed = bench_prefill.time_interleaved(timers, args.rounds, n_warmup=args.n_warmup,
                                           n_repeat=args.n_repeat)
    for rec in records:
        key = (rec["impl"], rec["deterministic"])
        if key not in fns:
            continue
        ts = {ph: timed[(key, ph)] for ph in ("fwd", "fwd_bwd", "bwd") if (key, ph) in timed}
        bad = next((t for t in ts.values() if isinstance(t, Exception)), None)
        if bad is not None:
            _fail(rec, bad)
            del fns[key]
            continue
        rec.update(timed_fields(rec, ts["fwd"], ts["fwd_bwd"], ts.get("bwd")))
    add_ratios(records)

    ref, heads = None, 0
    if not args.no_check and fns:
        heads = ref_heads(shape["nheads"], shape["seqlen"], args.ref_budget_gib)
        try:
            ref = reference(q, k, v, dout, shape["causal"], heads)
        except Exception as e:
            print(f"bench_backward: the float32 reference failed: {type(e).__name__}: {e}")
            for rec in records:
                rec["check_error"] = f"reference: {type(e).__name__}: {str(e)[:200]}"
        common.free_memory()
    for rec in records:
        key = (rec["impl"], rec["deterministic"])
        if key not in fns:
            continue
        f = fns[key]
        try:
            if not args.no_memory or ref is not None or rec["impl"] in CUPYFLASH_IMPLS:
                mem = peak_memory(f, device)
                res = mem.pop("result")
                if not args.no_memory:
                    rec.update(mem)
                if ref is not None:
                    rec.update(check_fields(res, ref, heads), ref="torch_math_float32",
                               ref_heads=heads, ref_batch=1)
                if rec["impl"] in CUPYFLASH_IMPLS:
                    again = f["fwd_bwd"]()
                    rec["bitwise_repeatable"] = _grads_equal(res, again)
                    del again
                del res
            f["clear"]()
        except Exception as e:  # record why, keep the timings
            rec["check_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"bench_backward: {label(rec)}: memory / check failed: {rec['check_error']}")
    del fns, q, k, v, dout, ref
    return records


def main(argv=None) -> int:
    args = parse_args(argv)
    if not common.have_gpu():
        print("bench_backward: no CUDA GPU here; nothing to measure")
        return 0
    if not common.have_torch():
        print("bench_backward: torch is not installed; nothing to measure (every impl is a torch call)")
        return 0
    import torch
    if not torch.cuda.is_available():
        print(f"bench_backward: torch {torch.__version__} sees no CUDA device; nothing to measure")
        return 0
    prov = common.provenance()
    impls = []
    skipped = []
    for impl in args.impls:
        ok, why = impl_available(impl)
        if ok:
            impls.append(impl)
        else:
            print(f"bench_backward: skipping {impl}: {why}")
            skipped.append({"what": "skipped", "impl": impl, "reason": why})
    if skipped:
        common.append_results(args.out, skipped)
    if not impls:
        print("bench_backward: no implementation can run here")
        return 0
    print(f"bench_backward: {prov.get('gpu')} commit {prov['commit'][:10]} -> {args.out}")
    grid = shape_list(args)
    n_written = 0
    for shape in common.progress(grid, desc="backward"):
        common.free_memory()
        records = run_shape(shape, args, impls)
        n_written += common.append_results(args.out, records)
        print(summary_line(shape, records), flush=True)
    print(f"bench_backward: wrote {n_written} records to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
