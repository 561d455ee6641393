"""Problem -> kernel specialisation, as data.

:func:`plan_prefill` turns a validated :class:`cupyflash.core.checks.AttnProblem` into a :class:`Plan`:
the chosen specialisation (name, template values), its launch geometry, its register and spill
counts from the ptxas report of an NVRTC compile (no GPU needed), the predicted FLOPs and HBM
bytes (:mod:`cupyflash.io_model`), and, for every other specialisation of the supported table
(:data:`cupyflash.forward.kernels.SUPPORTED`), the reason it was not chosen. ``explain()`` returns this
plan; the launch path uses :func:`launch_plan` (the same decision, cached per problem and device,
without the compile report and the I/O model).

There is no silent fallback: when no specialisation fits, :func:`plan_prefill` raises
``ValueError`` with every candidate's rejection reason.

The shared plan types and device facts: :mod:`cupyflash.core.planning`.
"""
from __future__ import annotations

import dataclasses
import functools

from ..core import cache, checks, deps, jit, planning
from ..core.cache import ContiguousLayout, out_like
from ..core.planning import (H200_MATMUL_TFLOPS, H200_READ_TBPS, H200_SMS, KernelChoice, Plan,
                             check_arch, check_device_limits, h200_assumed_note,
                             max_smem_bytes_for_arch)
from . import heuristics, kernels

__all__ = ["plan_prefill", "launch_plan", "PrefillLaunch", "prefill_launch"]


# ----------------------------------------------------------------------------------------------
# Prefill
# ----------------------------------------------------------------------------------------------
def _io_prediction(problem, block_m: int, block_n: int, lengths, kv_reuse: bool = False) -> tuple:
    """``(flops, hbm_bytes)`` from cupyflash.io_model; per sequence for varlen (None, None when
    the lengths are unknown). ``kv_reuse``: K and V counted once per head (the TMA kernel,
    whose persistent scheduler runs a head's query tiles together so that they share K and V in
    L2: measured 0.87-1.03x of that count, NOTES v57), else once per query tile."""
    from .. import io_model
    p = problem
    left_right = tuple(p.window_size)
    if p.varlen:
        if lengths is None:
            return None, None
        flops = hbm = 0
        for lq, lk in zip(*lengths):
            lq, lk = int(lq), int(lk)
            flops += io_model.prefill_flops(1, p.nheads, lq, lk, p.headdim, p.causal, left_right)
            hbm += io_model.prefill_hbm_bytes(1, p.nheads, p.nheads_k, lq, lk, p.headdim,
                                              p.dtype, p.causal, left_right, block_m, block_n,
                                              kv_reuse)
        return flops, hbm
    flops = io_model.prefill_flops(p.batch, p.nheads, p.seqlen_q, p.seqlen_k, p.headdim,
                                   p.causal, left_right)
    hbm = io_model.prefill_hbm_bytes(p.batch, p.nheads, p.nheads_k, p.seqlen_q, p.seqlen_k,
                                     p.headdim, p.dtype, p.causal, left_right, block_m, block_n,
                                     kv_reuse)
    return flops, hbm


def plan_prefill(problem, *, arch: str | None = None, report: bool = True,
                 predict: bool = True, num_sms: int | None = None,
                 max_smem_bytes: int | None = None, lengths=None) -> Plan:
    """Choose the prefill specialisation for ``problem`` and describe the launch.

    FlashAttention-2 (arXiv 2307.08691) Sec. 3.1 / Algorithm 1 kernels; the tile comes from
    :func:`cupyflash.forward.heuristics.choose_prefill_tile`.

    Parameters
    ----------
    problem : cupyflash.core.checks.AttnProblem
        A validated dense or varlen problem.
    arch : str, optional
        Architecture for the ptxas report and the shared-memory limit; default
        :func:`default_arch` (the current device's, else ``"sm_90a"``); sm_80 or newer
        (:func:`check_arch`).
    report : bool
        Compile the chosen specialisation with NVRTC (cached per process) and fill
        ``registers`` / ``spill_bytes``; False leaves them None.
    predict : bool
        Fill ``flops`` / ``hbm_bytes`` from :mod:`cupyflash.io_model`; False leaves them None.
    num_sms : int, optional
        SMs for the heuristic; default the current device's, else 132.
    max_smem_bytes : int, optional
        Shared-memory limit per block (bytes); default the current device's opt-in limit, else
        that of ``arch``.
    lengths : (array, array), optional
        Varlen only: per-sequence query and key lengths, for exact FLOPs / bytes.

    Returns
    -------
    Plan

    Raises
    ------
    TypeError
        ``problem`` is not an ``AttnProblem``; ``arch`` is not a str.
    ValueError
        No specialisation fits (the message lists every candidate and why it was rejected); a
        bad ``arch`` (:func:`check_arch`), ``num_sms`` or ``max_smem_bytes``.
    cupyflash.core.jit.KernelSourceError
        With ``report``: the chosen specialisation does not compile.
    """
    if not isinstance(problem, checks.AttnProblem):
        raise TypeError(f"problem: expected cupyflash.core.checks.AttnProblem, got "
                        f"{type(problem).__name__}")
    check_arch(arch)
    check_device_limits(num_sms=num_sms, max_smem_bytes=max_smem_bytes)
    dev = planning._device_id() if (arch is None or num_sms is None or max_smem_bytes is None) else None
    info = planning._device_info(dev) if dev is not None else None
    if arch is None:
        arch = info[0] if info else "sm_90a"
    h200_assumed = num_sms is None and not info  # said in the plan's notes
    if num_sms is None:
        num_sms = info[1] if info else H200_SMS
    if max_smem_bytes is None:
        max_smem_bytes = info[2] if info else max_smem_bytes_for_arch(arch)
    plan = _plan_prefill(problem, arch, report, predict, num_sms, max_smem_bytes,
                         None if lengths is None else tuple(tuple(int(x) for x in a)
                                                            for a in lengths))
    if h200_assumed:
        plan = dataclasses.replace(plan, reasons=plan.reasons + [h200_assumed_note(num_sms)])
    return plan


def _plan_prefill(problem, arch, report, predict, num_sms, max_smem_bytes, lengths,
                  reasons: bool = True) -> Plan:
    """The decision. ``reasons=False`` (the launch path) skips writing the rejection list,
    unless nothing fits, where the full error is raised all the same."""
    p = problem
    try:
        pad = {isa: kernels.padded_headdim(p.headdim, isa) for isa in kernels.ISAS}
    except ValueError:
        pad = None
    causal = bool(p.causal)

    if not reasons:
        feasible = [c for c in (kernels.configs_for(p.dtype, p.headdim) if pad else ())
                    if c.smem_bytes <= max_smem_bytes and c.arch in ("", arch)]
        if not feasible:  # raises, listing every candidate's reason
            return _plan_prefill(problem, arch, report, predict, num_sms, max_smem_bytes,
                                 lengths, True)
        rejected = []
    else:
        feasible, rejected = _feasible_and_rejected(p, pad, causal, arch, max_smem_bytes)
    tiles = tuple((c.block_m, c.block_n, c.nwarps, c.isa) for c in feasible)
    tile = heuristics.choose_prefill_tile(p.dtype, p.headdim, p.seqlen_q, p.seqlen_k, causal,
                                          num_sms, batch_nheads=p.batch * p.nheads, tiles=tiles)
    chosen = feasible[tiles.index(tile)]
    if reasons:
        for cfg in feasible:
            if cfg is not chosen:
                rejected.append((0, kernels.spec_of(cfg, causal).name, (
                    f"tile m{cfg.block_m} n{cfg.block_n} w{cfg.nwarps} {cfg.isa}: the heuristic "
                    f"chose m{tile[0]} n{tile[1]} w{tile[2]} {tile[3]} for seqlen_q={p.seqlen_q}, "
                    f"seqlen_k={p.seqlen_k}, batch*nheads={p.batch * p.nheads}, "
                    f"num_sms={num_sms} (cupyflash.forward.heuristics.choose_prefill_tile)")))
        rejected.sort(key=lambda r: r[0])  # stable: nearest candidates first, table order within

    spec = kernels.spec_of(chosen, causal)
    grid, block, smem = kernels.launch_config(spec, p, num_sms)
    registers = spill = None
    rep_arch = None
    if report:
        rep_arch = spec.arch or arch
        rep = jit.compile_report(spec, rep_arch).ptxas
        registers, spill = rep.registers, rep.spill_bytes
    flops = hbm = None
    if predict:
        flops, hbm = _io_prediction(p, tile[0], tile[1], lengths, kv_reuse=tile[3] == "tma")
    template = {"dtype": p.dtype, "headdim": chosen.headdim, "block_m": tile[0], "block_n": tile[1],
                "nwarps": tile[2], "causal": causal, "isa": tile[3]}
    choice = KernelChoice(name=spec.name, entry=spec.entry, template=template,
                          grid=tuple(int(g) for g in grid), block=tuple(int(b) for b in block),
                          smem_bytes=int(smem), registers=registers, spill_bytes=spill,
                          arch=rep_arch, spec=spec)
    roofline = None
    if flops is not None and hbm is not None and p.dtype in kernels.TC_DTYPES:
        roofline = 1e3 * max(flops / (H200_MATMUL_TFLOPS * 1e12), hbm / (H200_READ_TBPS * 1e12))
    return Plan(problem=p, kernel=choice, num_splits=None, flops=flops, hbm_bytes=hbm,
                roofline_ms=roofline,
                rejected=[(n, w) for _, n, w in rejected], num_sms=int(num_sms))


def _feasible_and_rejected(p, pad, causal, arch, max_smem_bytes) -> tuple:
    """Table rows that can run problem ``p`` at all (in :func:`kernels.configs_for`'s order), and
    ``(rank, name, reason)`` for the other specialisations; ``pad``: isa -> padded head dim, or
    None for a head dim nothing runs. Raises ValueError with every reason when no row is
    feasible."""
    feasible, rejected = [], []
    order = kernels.configs_for(p.dtype, p.headdim) if pad else ()
    for cfg in order + tuple(c for c in kernels.SUPPORTED if c not in order):
        for c in (False, True):
            name = kernels.spec_of(cfg, c).name
            # rank: how near the candidate is to the problem (listed nearest first)
            if cfg.dtype != p.dtype:
                rank, why = 4, f"dtype {cfg.dtype}; the problem is {p.dtype}"
            elif pad is None:
                rank, why = 3, (f"headdim {p.headdim} is not compiled (compiled: "
                                f"{', '.join(map(str, kernels.HEADDIMS))}, the TMA kernel "
                                f"{', '.join(map(str, kernels.TMA_HEADDIMS))}; multiples of 8 up "
                                f"to 256 run padded to the next one)")
            elif cfg.headdim != pad[cfg.isa]:
                hd = pad[cfg.isa]
                rank, why = 3, (f"compiled for headdim {cfg.headdim}; the problem needs {hd} on "
                                f"the {cfg.isa} kernel"
                                + (f" (headdim {p.headdim}, padded)" if hd != p.headdim else ""))
            elif c and not causal:
                rank, why = 2, (f"causal specialisation; the problem is not causal (window_size "
                                f"{p.window_size}: right != 0)")
            elif not c and causal:
                rank, why = 2, ("non-causal specialisation; the problem is causal (window "
                                "right == 0): the causal one serves it (mask known at compile "
                                "time)")
            elif cfg.arch not in ("", arch):
                rank, why = 1, (f"{cfg.isa} kernel: runs on {cfg.arch} (Hopper) only; the "
                                f"target is {arch}")
            elif cfg.smem_bytes > max_smem_bytes:
                rank, why = 1, (f"needs {cfg.smem_bytes} B of shared memory; {arch} allows "
                                f"{max_smem_bytes} B per block")
            else:
                feasible.append(cfg)
                continue
            rejected.append((rank, name, why))
    if not feasible:
        rejected.sort(key=lambda r: r[0])
        raise ValueError(
            f"problem: no prefill kernel for dtype={p.dtype}, headdim={p.headdim}, "
            f"causal={causal}, window_size={p.window_size}; every candidate was rejected:\n"
            + "\n".join(f"  {n}: {w}" for _, n, w in rejected))
    return feasible, rejected


def launch_plan(problem) -> Plan:
    """The plan the launch path uses: :func:`plan_prefill` for the current device without the
    compile report and the I/O model, cached per (problem, device). Needs a visible device."""
    cupy = deps.cupy("launching a prefill kernel")
    return _launch_plan_cached(problem, cupy.cuda.runtime.getDevice())


@functools.lru_cache(maxsize=4096)
def _launch_plan_cached(problem, dev: int) -> Plan:
    arch, sms, smem = planning._device_info(dev)
    return _plan_prefill(problem, arch, False, False, sms, smem, None, reasons=False)




class PrefillLaunch:
    """One :data:`cupyflash.core.cache.LAUNCH_CACHE` entry of the prefill path (built by :func:`prefill_launch`).

    Attributes
    ----------
    problem : cupyflash.core.checks.AttnProblem
    plan : Plan
        From :func:`launch_plan` (no compile report, no I/O model).
    action : str
        ``"launch"``; ``"fill"`` (no keys: out 0, LSE -inf, no launch); ``"none"`` (empty LSE).
    lse_shape, lse_dtype : tuple, str
        (batch, nheads, seqlen_q), varlen (nheads, total_q); float32 (float64 for float64:
        :func:`cupyflash.forward.kernels.lse_dtype`), allocated per call when asked for
        (``return_lse``; otherwise the kernel gets NULL and writes none).
    grid, block, smem : launch geometry.
    tensor_cores : bool
        Base pointers must be 16-byte aligned (checked per call).
    strides, sizes : tuple
        The constant fields of the kernel's parameter struct
        (:func:`cupyflash.forward.kernels.args_template`).
    kernel : cupy.RawKernel or None
        Fetched on the first launch.
    prepared : cupyflash.core.launch.Launch or None
        The launch with the constant fields set once (built on the first launch);
        a call passes the 7 pointers (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k; 0 for
        the dense call's) and the stream.
    device : int
        The CUDA device the entry was built for (that of every array of its key).
    out_like_q : bool
        ``out`` is allocated by the caller (``out=None``) and ``q`` (a torch tensor's
        :class:`cupyflash.core.interop.ArrayDesc`) has C-contiguous strides: ``torch.empty_like(q)``
        then gives the contiguous output the kernel is built for, at less host cost than
        ``torch.empty``.
    """
    __slots__ = ("problem", "plan", "action", "lse_shape", "lse_dtype", "grid", "block", "smem",
                 "tensor_cores", "strides", "sizes", "kernel", "prepared", "device",
                 "out_like_q")

    def __init__(self, problem, dev, q, k, v, out):
        self.problem = p = problem
        self.device = dev
        self.out_like_q = out is None and out_like(q)
        self.plan = launch_plan(p)  # raises (every rejection) when no specialisation fits
        spec = self.plan.kernel.spec
        self.lse_shape = (p.nheads, p.total_q) if p.varlen else (p.batch, p.nheads, p.seqlen_q)
        self.lse_dtype = kernels.lse_dtype(p.dtype)
        n_lse = 1
        for n in self.lse_shape:
            n_lse *= n
        no_keys = p.total_k == 0 if p.varlen else p.seqlen_k == 0
        self.action = "none" if n_lse == 0 else "fill" if no_keys else "launch"
        self.grid, self.block, self.smem = kernels.launch_config(spec, p, self.plan.num_sms)
        self.kernel = self.prepared = None
        self.strides = self.sizes = None
        self.tensor_cores = kernels.config_of(spec)[0].dtype in kernels.TC_DTYPES
        if self.action == "launch" and 0 in self.grid:
            self.action = "none"  # varlen without validate: no sequences or max_seqlen_q = 0
        if self.action == "launch":
            if self.grid[1] > 65535 or self.grid[2] > 65535:
                raise ValueError(f"problem: nheads ({self.grid[1]}) and batch "
                                 f"({self.grid[2]}) must be <= 65535")
            if out is None:
                out = ContiguousLayout(q.shape, q.dtype)
            lse_strides = (self.lse_shape[1], 1) if p.varlen else \
                (self.lse_shape[1] * self.lse_shape[2], self.lse_shape[2], 1)
            self.strides, self.sizes = kernels.args_template(spec, q, k, v, out, lse_strides,
                                                             problem=p, varlen=p.varlen)


def prefill_launch(problem, key, dev, q, k, v, out) -> PrefillLaunch:
    """The cached :class:`PrefillLaunch` of ``key`` (None: do not cache), built for the
    validated ``problem`` and the layouts of ``q``, ``k``, ``v``, ``out`` (None: allocated
    contiguous) on the current device ``dev`` when missing."""
    entry = cache.LAUNCH_CACHE.get(key) if key is not None else None
    if entry is None:
        entry = PrefillLaunch(problem, dev, q, k, v, out)
        if key is not None:
            cache.cache_put(key, entry)
    return entry
