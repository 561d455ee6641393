"""What every planner shares: the plan as data (:class:`Plan`, :class:`KernelChoice`) and the
device facts a plan is made for (architecture, SMs, shared memory; CuPy is imported only when a
device is asked, so ``explain()`` works without a GPU).

The forward planner (:mod:`cupyflash.forward.dispatch`) and the decode planner
(:mod:`cupyflash.decode.plan`) both return a :class:`Plan`; ``explain()`` prints it.
"""
from __future__ import annotations

import dataclasses
import functools
import re

from . import checks, deps, jit

__all__ = ["KernelChoice", "Plan", "H200_SMS", "default_arch", "check_arch", "check_device_limits",
           "h200_assumed_note", "max_smem_bytes_for_arch"]

#: Streaming multiprocessors of an H100/H200 SXM: the default when no device is visible.
H200_SMS = 132

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
    spec : cupyflash.core.jit.KernelSpec
        What :func:`cupyflash.core.jit.get_kernel` compiles.
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
    problem : cupyflash.core.checks.AttnProblem or cupyflash.core.checks.DecodeProblem
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
    num_sms: int = H200_SMS
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
    cupy = deps.cupy()
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


