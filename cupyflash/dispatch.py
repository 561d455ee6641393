"""Problem -> kernel specialisation, as data.

:func:`plan_prefill` turns a validated :class:`cupyflash.checks.AttnProblem` into a :class:`Plan`:
the chosen specialisation (name, template values), its launch geometry, its register and spill
counts from the ptxas report of an NVRTC compile (no GPU needed), the predicted FLOPs and HBM
bytes (:mod:`cupyflash.io_model`), and, for every other specialisation of the supported table
(:data:`cupyflash.prefill.SUPPORTED`), the reason it was not chosen. ``explain()`` returns this
plan; the launch path uses :func:`launch_plan` (the same decision, cached per problem and device,
without the compile report and the I/O model).

There is no silent fallback: when no specialisation fits, :func:`plan_prefill` raises
``ValueError`` with every candidate's rejection reason.

Decode plans (split-KV, Flash-Decoding) are appended below by the decode work.
"""
from __future__ import annotations

import dataclasses
import functools
import re

from . import checks, heuristics, interop, jit

__all__ = ["KernelChoice", "Plan", "plan_prefill", "launch_plan", "default_arch",
           "check_arch", "check_device_limits", "h200_assumed_note", "max_smem_bytes_for_arch"]

#: bf16 matmul throughput measured on the H200 (8192^3, torch/cuBLAS,
#: experiments/results/bench_ceilings.jsonl: 1.366 ms): the tensor-core roof of Plan.roofline_ms.
H200_MATMUL_TFLOPS = 805.0
#: Read bandwidth measured on the H200 (4 GB reduction, bench_ceilings.jsonl): the memory roof.
H200_READ_TBPS = 4.54

#: Opt-in dynamic shared memory per block (bytes) by architecture (CUDA C Programming Guide,
#: "Compute Capabilities" table). Used when no device is visible; on a GPU the device is asked.
_SMEM_BY_ARCH = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_87": 163 * 1024,
                 "sm_89": 99 * 1024, "sm_90": 227 * 1024, "sm_90a": 227 * 1024,
                 "sm_100": 227 * 1024, "sm_100a": 227 * 1024, "sm_120": 99 * 1024}


# ----------------------------------------------------------------------------------------------
# The plan, as data
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """One kernel launch of a plan.

    Attributes
    ----------
    name : str
        Specialisation name, e.g. ``fwd_bf16_hd128_m128_n64_w8_causal`` (also the cache key and
        the profiler label).
    entry : str
        C++ name expression of the ``__global__`` function.
    template : dict
        Template values: ``dtype``, ``headdim`` (the compiled, padded one), ``block_m``,
        ``block_n``, ``nwarps``, ``causal``, and for prefill ``isa`` (``"tma"``, ``"mma"``,
        ``"simt"``).
    grid, block : tuple of 3 int
        Launch geometry (CTAs; threads per CTA).
    smem_bytes : int
        Dynamic shared memory per CTA, bytes.
    registers : int or None
        Registers per thread from the ptxas report (None when not compiled for the plan).
    spill_bytes : int or None
        Spill stores + spill loads, bytes, from the same report.
    arch : str or None
        Architecture of the ptxas report (``"sm_90a"``, ...).
    spec : cupyflash.jit.KernelSpec
        What :func:`cupyflash.jit.get_kernel` compiles.
    """
    name: str
    entry: str
    template: dict
    grid: tuple
    block: tuple
    smem_bytes: int
    registers: int | None
    spill_bytes: int | None
    arch: str | None
    spec: jit.KernelSpec = dataclasses.field(repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a call launches and why (the record ``explain()`` returns).

    Attributes
    ----------
    problem : cupyflash.checks.AttnProblem or cupyflash.checks.DecodeProblem
        The validated problem (prefill or decode).
    kernel : KernelChoice
        The (main) kernel.
    num_splits : int or None
        Split-KV factor (Flash-Decoding); None for prefill.
    flops : int or None
        ``4 * batch * nheads * visible (query, key) pairs * headdim``, causal and windows counted
        exactly (:func:`cupyflash.io_model.prefill_flops`); None for a varlen plan made without
        the sequence lengths.
    hbm_bytes : int or None
        Predicted device-memory traffic, bytes (:func:`cupyflash.io_model.prefill_hbm_bytes` with
        the chosen tile: Q read once, each CTA's visible K/V tiles read from HBM, O and the float32
        LSE written once: an upper bound on DRAM bytes, since L2 may serve repeated K/V reads;
        for the Hopper TMA kernel K/V once per head, what its scheduler's L2 groups achieve:
        Nsight Compute measured 0.87-1.03x of it at S 1k-16k, NOTES v57).
    rejected : list of (str, str)
        ``(specialisation name, reason)`` for every other specialisation, nearest first (empty
        in the cached plans of the launch path, :func:`launch_plan`).
    reasons : list of (str, str)
        ``(topic, text)``: why the chosen launch looks as it does (decode: the topics of
        :data:`cupyflash.decode.REASON_TOPICS`: ``"num_splits"`` for the split count and the
        merge, ``"tile"``, ``"stages"`` for the pipeline depth, ``"copies"`` for how Q and
        paged K/V are copied, ``"note"`` for the rest); for prefill only a ``"note"`` when the
        plan assumed an H200 (no GPU visible), its choice being explained by ``rejected``.
    extra_kernels : tuple of KernelChoice
        Further launches (decode's KV-append kernel when new tokens are given; the split
        kernels merge their partials themselves); empty for prefill.
    num_sms : int
        Streaming multiprocessors the heuristic assumed.
    workspace_elems : int or None
        Decode: float32 elements of the ``workspace=`` the call needs (the split partials and the
        fused merge's counters; 0 with one split; :func:`cupyflash.decode.workspace_size`);
        None for prefill.
    roofline_ms : float or None
        Prefill on tensor cores (float16/bfloat16): the predicted time, milliseconds, of a
        kernel at the H200's measured roofs, ``max(flops / 805 TFLOP/s, hbm_bytes / 4.54 TB/s)``
        (:data:`H200_MATMUL_TFLOPS`, :data:`H200_READ_TBPS`): the time if the softmax were
        entirely hidden behind the tensor cores. ``experiments/bench_prefill.py`` records the
        measured time over it (``measured_over_roofline``). None otherwise.
    """
    problem: object
    kernel: KernelChoice
    num_splits: int | None
    flops: int | None
    hbm_bytes: int | None
    rejected: list
    extra_kernels: tuple = ()
    num_sms: int = heuristics.H200_SMS
    reasons: list = dataclasses.field(default_factory=list)
    workspace_elems: int | None = None
    roofline_ms: float | None = None

    # Shortcuts to the main kernel's fields.
    @property
    def name(self) -> str:
        return self.kernel.name

    @property
    def template(self) -> dict:
        return self.kernel.template

    @property
    def grid(self) -> tuple:
        return self.kernel.grid

    @property
    def block(self) -> tuple:
        return self.kernel.block

    @property
    def smem_bytes(self) -> int:
        return self.kernel.smem_bytes

    @property
    def registers(self) -> int | None:
        return self.kernel.registers

    @property
    def spill_bytes(self) -> int | None:
        return self.kernel.spill_bytes

    def as_dict(self) -> dict:
        """JSON-ready dict (experiments store it as provenance)."""
        def kc(k: KernelChoice) -> dict:
            d = {f.name: getattr(k, f.name) for f in dataclasses.fields(k) if f.name != "spec"}
            d["grid"], d["block"] = list(k.grid), list(k.block)
            d["source"] = k.spec.source
            return d
        prob = dataclasses.asdict(self.problem) if dataclasses.is_dataclass(self.problem) else {}
        return {"problem": prob, "kernel": kc(self.kernel),
                "extra_kernels": [kc(k) for k in self.extra_kernels],
                "num_splits": self.num_splits, "flops": self.flops, "hbm_bytes": self.hbm_bytes,
                "num_sms": self.num_sms, "workspace_elems": self.workspace_elems,
                "roofline_ms": self.roofline_ms,
                "reasons": [list(r) for r in self.reasons],
                "rejected": [list(r) for r in self.rejected]}

    def __str__(self) -> str:
        k = self.kernel
        regs = "?" if k.registers is None else k.registers
        spill = "?" if k.spill_bytes is None else k.spill_bytes
        lines = [f"{k.name}  ({k.entry})",
                 "  template: " + " ".join(f"{a}={b}" for a, b in k.template.items()),
                 f"  grid={k.grid} block={k.block} smem={k.smem_bytes} B  registers={regs} "
                 f"spill={spill} B ({k.arch or 'not compiled'})",
                 f"  num_splits={self.num_splits} flops={self.flops} hbm_bytes={self.hbm_bytes} "
                 f"num_sms={self.num_sms}"
                 + ("" if self.roofline_ms is None else f" roofline_ms={self.roofline_ms:.4g}")
                 + ("" if self.workspace_elems is None
                    else f" workspace_elems={self.workspace_elems}")]
        for e in self.extra_kernels:
            lines.append(f"  + {e.name} grid={e.grid} block={e.block} smem={e.smem_bytes} B")
        if self.reasons:
            lines.append(f"  why ({len(self.reasons)}):")
            lines += [f"    {n}: {r}" for n, r in self.reasons]
        lines.append(f"  rejected ({len(self.rejected)}):")
        lines += [f"    {n}: {r}" for n, r in self.rejected[:8]]
        if len(self.rejected) > 8:
            lines.append(f"    ... {len(self.rejected) - 8} more (Plan.rejected)")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Device facts (CuPy imported only when asked; explain() works without a GPU)
# ----------------------------------------------------------------------------------------------
def _device_id():
    """The current CUDA device id, or None when CuPy or a device is missing."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy.cuda.runtime.getDevice()
    except Exception:
        return None


@functools.lru_cache(maxsize=None)
def _device_info(dev: int) -> tuple:
    """``(arch, num_sms, max opt-in shared memory per block)`` of device ``dev``."""
    import cupy
    d = cupy.cuda.Device(dev)
    cc = d.compute_capability  # e.g. '90'
    arch = "sm_90a" if cc == "90" else f"sm_{cc}"  # Hopper: the 'a' target of CPU compile tests
    attrs = d.attributes
    return arch, int(attrs["MultiProcessorCount"]), int(attrs["MaxSharedMemoryPerBlockOptin"])


def default_arch() -> str:
    """``"sm_<cc>"`` of the current device (``"sm_90a"`` for compute capability 9.0), or
    ``"sm_90a"`` when no device is visible."""
    dev = _device_id()
    return _device_info(dev)[0] if dev is not None else "sm_90a"


def check_arch(arch) -> None:
    """Raise unless ``arch`` is None or an NVRTC target of compute capability 8.0 or newer
    (``"sm_80"``, ``"sm_86"``, ``"sm_90a"``, ...): every kernel uses ``cp.async`` and bf16
    tensor-core instructions, which need sm_80.

    Raises
    ------
    TypeError
        ``arch`` is not a str (or None).
    ValueError
        Not of the form ``sm_<major><minor>[suffix]``, or older than sm_80.
    """
    if arch is None:
        return
    if not isinstance(arch, str):
        raise TypeError(f"arch: expected a str such as 'sm_80' or 'sm_90a', or None, got "
                        f"{type(arch).__name__} {arch!r}")
    m = re.fullmatch(r"sm_(\d+)[a-z]?", arch)
    if m is None:
        raise ValueError(f"arch: expected an NVRTC target such as 'sm_80' or 'sm_90a', got "
                         f"{arch!r}")
    if int(m.group(1)) < 80:
        raise ValueError(f"arch: {arch!r} is older than sm_80; the kernels need sm_80 or newer "
                         f"(cp.async, bf16 tensor cores)")


def check_device_limits(**limits) -> None:
    """Raise ValueError naming the first of the keyword ``limits`` (SM counts, shared-memory
    bytes a plan is made for) that is neither None nor an int >= 1."""
    for name, val in limits.items():
        if val is not None and (not checks._is_int(val) or val < 1):
            raise ValueError(f"{name}: expected an int >= 1 or None, got {val!r}")


def h200_assumed_note(num_sms: int) -> tuple:
    """The ``("note", text)`` reason of a plan made without a visible GPU for an H200's SMs
    (prefill and decode plans say it alike)."""
    return ("note", f"planned for {num_sms} SMs, an H200's: no GPU is visible here; pass "
                    f"num_sms= (and the device's arch) for another GPU")


def max_smem_bytes_for_arch(arch: str) -> int:
    """Opt-in dynamic shared memory per block of ``arch`` (bytes); 227 KiB if unknown."""
    return _SMEM_BY_ARCH.get(arch, 227 * 1024)


# ----------------------------------------------------------------------------------------------
# Prefill
# ----------------------------------------------------------------------------------------------
def _io_prediction(problem, block_m: int, block_n: int, lengths, kv_reuse: bool = False) -> tuple:
    """``(flops, hbm_bytes)`` from cupyflash.io_model; per sequence for varlen (None, None when
    the lengths are unknown). ``kv_reuse``: K and V counted once per head (the TMA kernel,
    whose persistent scheduler runs a head's query tiles together so that they share K and V in
    L2: measured 0.87-1.03x of that count, NOTES v57), else once per query tile."""
    from . import io_model
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
    :func:`cupyflash.heuristics.choose_prefill_tile`.

    Parameters
    ----------
    problem : cupyflash.checks.AttnProblem
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
    cupyflash.jit.KernelSourceError
        With ``report``: the chosen specialisation does not compile.
    """
    if not isinstance(problem, checks.AttnProblem):
        raise TypeError(f"problem: expected cupyflash.checks.AttnProblem, got "
                        f"{type(problem).__name__}")
    check_arch(arch)
    check_device_limits(num_sms=num_sms, max_smem_bytes=max_smem_bytes)
    dev = _device_id() if (arch is None or num_sms is None or max_smem_bytes is None) else None
    info = _device_info(dev) if dev is not None else None
    if arch is None:
        arch = info[0] if info else "sm_90a"
    h200_assumed = num_sms is None and not info  # said in the plan's notes
    if num_sms is None:
        num_sms = info[1] if info else heuristics.H200_SMS
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
    from . import prefill
    p = problem
    try:
        pad = {isa: prefill.padded_headdim(p.headdim, isa) for isa in prefill.ISAS}
    except ValueError:
        pad = None
    causal = bool(p.causal)

    if not reasons:
        feasible = [c for c in (prefill.configs_for(p.dtype, p.headdim) if pad else ())
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
                rejected.append((0, prefill.spec_of(cfg, causal).name, (
                    f"tile m{cfg.block_m} n{cfg.block_n} w{cfg.nwarps} {cfg.isa}: the heuristic "
                    f"chose m{tile[0]} n{tile[1]} w{tile[2]} {tile[3]} for seqlen_q={p.seqlen_q}, "
                    f"seqlen_k={p.seqlen_k}, batch*nheads={p.batch * p.nheads}, "
                    f"num_sms={num_sms} (cupyflash.heuristics.choose_prefill_tile)")))
        rejected.sort(key=lambda r: r[0])  # stable: nearest candidates first, table order within

    spec = prefill.spec_of(chosen, causal)
    grid, block, smem = prefill.launch_config(spec, p, num_sms)
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
    if flops is not None and hbm is not None and p.dtype in prefill.TC_DTYPES:
        roofline = 1e3 * max(flops / (H200_MATMUL_TFLOPS * 1e12), hbm / (H200_READ_TBPS * 1e12))
    return Plan(problem=p, kernel=choice, num_splits=None, flops=flops, hbm_bytes=hbm,
                roofline_ms=roofline,
                rejected=[(n, w) for _, n, w in rejected], num_sms=int(num_sms))


def _feasible_and_rejected(p, pad, causal, arch, max_smem_bytes) -> tuple:
    """Table rows that can run problem ``p`` at all (in :func:`prefill.configs_for`'s order), and
    ``(rank, name, reason)`` for the other specialisations; ``pad``: isa -> padded head dim, or
    None for a head dim nothing runs. Raises ValueError with every reason when no row is
    feasible."""
    from . import prefill
    feasible, rejected = [], []
    order = prefill.configs_for(p.dtype, p.headdim) if pad else ()
    for cfg in order + tuple(c for c in prefill.SUPPORTED if c not in order):
        for c in (False, True):
            name = prefill.spec_of(cfg, c).name
            # rank: how near the candidate is to the problem (listed nearest first)
            if cfg.dtype != p.dtype:
                rank, why = 4, f"dtype {cfg.dtype}; the problem is {p.dtype}"
            elif pad is None:
                rank, why = 3, (f"headdim {p.headdim} is not compiled (compiled: "
                                f"{', '.join(map(str, prefill.HEADDIMS))}, the TMA kernel "
                                f"{', '.join(map(str, prefill.TMA_HEADDIMS))}; multiples of 8 up "
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
    import cupy
    return _launch_plan_cached(problem, cupy.cuda.runtime.getDevice())


@functools.lru_cache(maxsize=4096)
def _launch_plan_cached(problem, dev: int) -> Plan:
    arch, sms, smem = _device_info(dev)
    return _plan_prefill(problem, arch, False, False, sms, smem, None, reasons=False)


# ----------------------------------------------------------------------------------------------
# The launch cache (what a warm call reuses)
# ----------------------------------------------------------------------------------------------
#: Everything a call derives from its arguments' layouts and options, kept per
#: :func:`launch_key`: the validated problem, the plan, the launch geometry, the constant kernel
#: arguments (NumPy scalars) and the compiled kernel. ``flash_attn_func``,
#: ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache`` store an entry only after the full
#: validation (:mod:`cupyflash.checks`) and the planning succeeded, and look it up *before*
#: validating only when every array argument is exactly a ``cupy.ndarray`` (or every one exactly
#: a ``torch.Tensor``: :func:`torch_key`, the device in the key) and every option is
#: a plain Python value of the exact type (``bool``, ``int``, ``float``, ``None``, a tuple of
#: two ``int``): for such arguments the checks read nothing but the key's fields, so a hit
#: proves they pass again. Values that are not in the key are checked on every call (the device
#: of every array for CuPy arrays, base-pointer alignment). Host content checks
#: (``validate=True``: ``cu_seqlens``, host ``cache_seqlens`` / ``block_table`` values) never
#: take the cached path (device ``cache_seqlens`` / ``block_table`` are checked by the decode
#: kernels, :mod:`cupyflash.guard`).
#: Cleared when it reaches :data:`LAUNCH_CACHE_SIZE` entries.
LAUNCH_CACHE: dict = {}
LAUNCH_CACHE_SIZE = 4096


def launch_key(kind: str, dev: int, options: tuple, arrays: tuple) -> tuple:
    """The :data:`LAUNCH_CACHE` key of a call of CuPy arrays (:func:`torch_key`: of torch
    tensors).

    Parameters
    ----------
    kind : str
        ``"dense"``, ``"varlen"`` or ``"kvcache"``.
    dev : int
        CUDA device of ``q`` (the launch device).
    options : tuple
        The call's options as given (hashable plain values; see :data:`LAUNCH_CACHE`).
    arrays : tuple
        The array arguments in signature order (None where absent); each contributes its
        ``(shape, strides, dtype)``.
    """
    return (kind, dev, options) + tuple(None if a is None else (a.shape, a.strides, a.dtype)
                                        for a in arrays)


def torch_key(head: tuple, arrays: tuple, tensor):
    """The :data:`LAUNCH_CACHE` key of a call of torch tensors, or None when an array is not
    exactly of the class ``tensor`` (``torch.Tensor``).

    One flat tuple: ``head`` (the kind, ``"dense:torch"``, ``"varlen:torch"`` or
    ``"kvcache:torch"``, then the call's options as given), then for each array in signature
    order ``None`` when absent, else its ``shape``, ``stride()`` (elements), ``dtype`` and
    ``device`` (a hit proves every array is on the device its entry was validated for; the
    entry's ``device`` is that device's ordinal). An absent array is one ``None`` and a shape is
    never None, so two keys of one kind are equal only when every array's fields are."""
    key = head
    for a in arrays:
        if a is None:
            key += (None,)
        elif type(a) is tensor:
            key += (a.shape, a.stride(), a.dtype, a.device)
        else:
            return None
    return key


#: the launch-cache kind of a torch caller's call (its layouts are torch's)
TORCH_KINDS = {"dense": "dense:torch", "varlen": "varlen:torch", "kvcache": "kvcache:torch"}


def caller_key(caller, kind: str, dev: int, options: tuple, arrays: tuple) -> tuple:
    """The :data:`LAUNCH_CACHE` key of a call by ``caller`` (:mod:`cupyflash.interop`'s
    CupyCaller: :func:`launch_key`; TorchCaller: :func:`torch_key`)."""
    if caller is interop.TorchCaller:
        return torch_key((TORCH_KINDS[kind],) + options, arrays, interop.torch_tensor_type())
    return launch_key(kind, dev, options, arrays)


def warm_entry(kind: str, options: tuple, arrays: tuple):
    """``(caller, device, entry)`` of a warm call: every array (``q`` first) exactly a
    ``cupy.ndarray``, or every one exactly a ``torch.Tensor``, their :func:`caller_key` in
    :data:`LAUNCH_CACHE` and all on ``q``'s device; else None (the caller runs the full checks,
    which raise or fill the cache). One pass over the arrays' attributes."""
    q = arrays[0]
    tq = type(q)
    if tq is (interop._CUPY_NDARRAY or interop.cupy_ndarray_type()):
        dev = q.data.device_id
        key = [kind, dev, options]
        append = key.append
        for a in arrays:
            if a is None:
                append(None)
            elif type(a) is not tq or a.data.device_id != dev:
                return None
            else:
                append((a.shape, a.strides, a.dtype))
        entry = LAUNCH_CACHE.get(tuple(key))
        return None if entry is None else (interop.CupyCaller, dev, entry)
    if tq is (interop._TORCH_TENSOR or interop.torch_tensor_type()) and tq is not type(None):
        key = torch_key((TORCH_KINDS[kind],) + options, arrays, tq)
        entry = LAUNCH_CACHE.get(key) if key is not None else None
        return None if entry is None else (interop.TorchCaller, entry.device, entry)
    return None


def cache_put(key, entry) -> None:
    """Store ``entry`` under ``key`` (clearing the cache when full)."""
    if len(LAUNCH_CACHE) >= LAUNCH_CACHE_SIZE:
        LAUNCH_CACHE.clear()
    LAUNCH_CACHE[key] = entry


class _ContiguousLayout:
    """Shape, strides and dtype of a C-contiguous array not yet allocated (``out=None``)."""

    class data:  # noqa: N801 - stands in for MemoryPointer (cupy.empty is 256-byte aligned)
        ptr = 0

    def __init__(self, shape: tuple, dtype):
        self.shape, self.dtype, self.ndim = tuple(shape), dtype, len(shape)
        self.itemsize = dtype.itemsize
        self.strides = interop.c_strides(self.shape, dtype.itemsize)


def out_like(q) -> bool:
    """Whether an output of ``q``'s shape and dtype, C-contiguous, can be allocated as
    ``torch.empty_like(q)``: ``q`` is a torch tensor's :class:`cupyflash.interop.ArrayDesc`
    whose strides are exactly the C-contiguous ones (``empty_like`` keeps the strides of a dense
    tensor, so then it allocates what ``torch.empty(q.shape)`` would)."""
    return (isinstance(q, interop.ArrayDesc)
            and q.strides == _ContiguousLayout(q.shape, q.dtype).strides)


class PrefillLaunch:
    """One :data:`LAUNCH_CACHE` entry of the prefill path (built by :func:`prefill_launch`).

    Attributes
    ----------
    problem : cupyflash.checks.AttnProblem
    plan : Plan
        From :func:`launch_plan` (no compile report, no I/O model).
    action : str
        ``"launch"``; ``"fill"`` (no keys: out 0, LSE -inf, no launch); ``"none"`` (empty LSE).
    lse_shape : tuple
        (batch, nheads, seqlen_q), varlen (nheads, total_q); float32, allocated per call when
        asked for (``return_lse``; otherwise the kernel gets NULL and writes none).
    grid, block, smem : launch geometry.
    tensor_cores : bool
        Base pointers must be 16-byte aligned (checked per call).
    strides, sizes : tuple
        Constant kernel arguments (:func:`cupyflash.prefill.args_template`); the dense call's
        arguments are ``(q, k, v, out, lse) + tail``.
    kernel : cupy.RawKernel or None
        Fetched on the first launch.
    prepared : cupyflash.launch.PreparedLaunch or None
        The launch with the constant arguments converted once (built on the first launch);
        a call passes the 7 pointers (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k; 0 for
        the dense call's) and the stream.
    device : int
        The CUDA device the entry was built for (that of every array of its key).
    out_like_q : bool
        ``out`` is allocated by the caller (``out=None``) and ``q`` (a torch tensor's
        :class:`cupyflash.interop.ArrayDesc`) has C-contiguous strides: ``torch.empty_like(q)``
        then gives the contiguous output the kernel is built for, at less host cost than
        ``torch.empty``.
    """
    __slots__ = ("problem", "plan", "action", "lse_shape", "grid", "block", "smem",
                 "tensor_cores", "strides", "sizes", "tail", "kernel", "prepared", "device",
                 "out_like_q")

    def __init__(self, problem, dev, q, k, v, out):
        from . import prefill
        self.problem = p = problem
        self.device = dev
        self.out_like_q = out is None and out_like(q)
        self.plan = launch_plan(p)  # raises (every rejection) when no specialisation fits
        spec = self.plan.kernel.spec
        self.lse_shape = (p.nheads, p.total_q) if p.varlen else (p.batch, p.nheads, p.seqlen_q)
        n_lse = 1
        for n in self.lse_shape:
            n_lse *= n
        no_keys = p.total_k == 0 if p.varlen else p.seqlen_k == 0
        self.action = "none" if n_lse == 0 else "fill" if no_keys else "launch"
        self.grid, self.block, self.smem = prefill.launch_config(spec, p, self.plan.num_sms)
        self.kernel = self.prepared = None
        self.strides = self.sizes = self.tail = None
        self.tensor_cores = prefill.config_of(spec)[0].dtype in prefill.TC_DTYPES
        if self.action == "launch" and 0 in self.grid:
            self.action = "none"  # varlen without validate: no sequences or max_seqlen_q = 0
        if self.action == "launch":
            if self.grid[1] > 65535 or self.grid[2] > 65535:
                raise ValueError(f"problem: nheads ({self.grid[1]}) and batch "
                                 f"({self.grid[2]}) must be <= 65535")
            if out is None:
                out = _ContiguousLayout(q.shape, q.dtype)
            lse_strides = (self.lse_shape[1], 1) if p.varlen else \
                (self.lse_shape[1] * self.lse_shape[2], self.lse_shape[2], 1)
            self.strides, self.sizes = prefill.args_template(spec, q, k, v, out, lse_strides,
                                                             problem=p, varlen=p.varlen)
            self.tail = self.strides + prefill._NULL2 + self.sizes


def prefill_launch(problem, key, dev, q, k, v, out) -> PrefillLaunch:
    """The cached :class:`PrefillLaunch` of ``key`` (None: do not cache), built for the
    validated ``problem`` and the layouts of ``q``, ``k``, ``v``, ``out`` (None: allocated
    contiguous) on the current device ``dev`` when missing."""
    entry = LAUNCH_CACHE.get(key) if key is not None else None
    if entry is None:
        entry = PrefillLaunch(problem, dev, q, k, v, out)
        if key is not None:
            cache_put(key, entry)
    return entry
