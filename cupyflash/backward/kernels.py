"""The backward kernels: the compiled tiles per (dtype, head dim), their names and shared memory,
their launch geometry and parameter struct.

FlashAttention-2 (Dao, arXiv 2307.08691), Sec. 3.2 and Algorithm 2, as three kernels without
atomics (``kernels_cu/common/bwd_tile.cuh`` says why and how):

* ``dsum``: D = rowsum(dO * O) per query row (float32; float64 for float64);
* ``dkdv``: one CTA per (key block, KV head, batch): dK and dV, summed over the query heads of a
  GQA group in registers (``part`` 0; above head dim 128 two launches, ``part`` 1 dK and 2 dV,
  as both accumulators do not fit in registers together);
* ``dq``: one CTA per (query block, head, batch): dQ.

Float16/bfloat16 run ``kernels_cu/backward/mma.cu`` (mma.sync m16n8k16, fp32 accumulation, sm_80+),
float32/float64 ``kernels_cu/backward/simt.cu`` (CUDA cores, computed in the dtype). Pure Python
but for :func:`layout` (an NVRTC probe of the shared-memory sizes, no GPU needed).

On sm_90a, float16/bfloat16, dense, a Hopper plan (``plan_backward(..., hopper=True)``) can run
instead, from ``kernels_cu/backward/hopper.cu``: a pre-pass writing LSE log2(e) and D per 64-row
query block, padded (:func:`stats_shape`), which the main kernel copies into its TMA ring with Q
and dO; the main kernel (TMA, warpgroup MMA; dK/dV and dQ in one kernel, dQ added to an fp32
accumulator by bulk reductions in L2, above head dim 128 by 16-byte reductions from registers;
with ``deterministic`` the key blocks add in a fixed order, one after the other, on turn
counters); a ``dq`` kernel that scales and rounds that accumulator. It is the default where it
applies (:func:`hopper_enabled`; ``CUPYFLASH_BWD_HOPPER=0`` runs the mma.sync kernels instead):
1.2-3x the mma.sync plan on an H100 (experiments/NOTES.md, v80-v81, v90).
"""
from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np

from ..core import jit
from ..core.params import BwdParams, BwdTmaParams, FwdParams
from ..forward import kernels as fwd

__all__ = ["BwdKernel", "BwdPlan", "MMA_SOURCE", "SIMT_SOURCE", "HOPPER_SOURCE", "HEADDIMS",
           "HOPPER_HEADDIMS", "HOPPER_TILES", "padded_headdim", "hopper_enabled",
           "plan_backward", "all_kernels", "stats_shape",
           "launch_geometry", "bwd_fields", "params_of", "POINTERS", "ACC_DTYPE"]

MMA_SOURCE = "backward/mma.cu"
SIMT_SOURCE = "backward/simt.cu"
HOPPER_SOURCE = "backward/hopper.cu"
#: The Hopper kernel's compiled head dims and their tiles (query rows per step, keys per CTA:
#: ``HopperBwdTraits``; the dq conversion takes one query block of a step's rows per CTA).
HOPPER_HEADDIMS = (64, 128, 256)
HOPPER_TILES = {64: (128, 128), 128: (64, 128), 256: (64, 64)}
#: Warps of the Hopper kernel's CTA (``HopperBwdTraits::kThreads``): two consumer warpgroups and
#: a producer one.
HOPPER_WARPS = 12
#: The Hopper pre-pass: rows per block of statistics (``kStatsRows``), and the rows its buffer is
#: padded to (the largest step: a step copies its blocks in one piece).
STATS_ROWS, STATS_PAD = 64, 128
#: Rows per CTA of the dsum pre-pass (``cf::kDsumRows``), 128 threads.
DSUM_ROWS = 16
#: The accumulator dtype of each input dtype (D, and the CUDA-core kernels' arithmetic).
ACC_DTYPE = {"float16": "float32", "bfloat16": "float32", "float32": "float32",
             "float64": "float64"}
_SHORT, _CTYPE = fwd._SHORT, fwd._CTYPE

# Tiles per compiled head dim: dK/dV launches (block_m query rows per step, block_n keys per CTA,
# nwarps, part) and the dQ tile (block_m rows per CTA, block_n keys per step, nwarps). Chosen by
# the ptxas report (sm_90a, no spills): hd128 dK/dV with 64-row query steps spills 32 bytes (254
# registers), with 32 it does not (249); above hd128 dK and dV together spill 1.7-4 KB, so they
# run as two launches (dK with 32-row steps: 64 spilled 88 bytes; dV with 32-row steps: 64 would
# need 270 KB of shared memory with the double-buffered Q and dO).
_MMA_TILES = {
    32: (((64, 128, 8, 0),), (128, 64, 8)),
    64: (((64, 128, 8, 0),), (128, 64, 8)),
    128: (((32, 128, 8, 0),), (128, 64, 8)),
    256: (((32, 128, 8, 1), (32, 128, 8, 2)), (128, 32, 8)),
}
#: The backward's compiled head dims: every multiple of 8 up to 256 runs on the next of these
#: (its columns past the actual head dim are zeros, never stored). Fewer than the forward's eight:
#: each compiled head dim is 4-6 kernels per dtype to build and test; hd96 and hd160-224 pay
#: 1.3-1.6x the work of a kernel of their own until the measurements say they need one.
HEADDIMS = tuple(sorted(_MMA_TILES))
# CUDA cores, 128 threads (16 row groups x 8 lanes): (block_m, block_n) of both kernels.
_SIMT_TILES = {"float32": {hd: (32, 32) if hd <= 128 else (32, 16) for hd in HEADDIMS},
               "float64": {hd: (32, 32) if hd <= 128 else (16, 16) for hd in HEADDIMS}}


def padded_headdim(d: int) -> int:
    """The compiled head dim of :data:`HEADDIMS` that runs an actual head dim ``d``.

    Raises
    ------
    ValueError
        ``d`` is not a multiple of 8 in [8, 256]."""
    if not (isinstance(d, int) and 8 <= d <= 256 and d % 8 == 0):
        raise ValueError(f"headdim: expected a multiple of 8 in [8, 256], got {d!r}")
    return next(h for h in HEADDIMS if h >= d)


@dataclasses.dataclass(frozen=True)
class BwdKernel:
    """One compiled backward kernel.

    role : ``"dsum"``, ``"dkdv"`` or ``"dq"``.
    dtype, headdim : input dtype and compiled (padded) head dim (0 for dsum: any).
    block_m, block_n : query rows and keys of its tile (dkdv: keys per CTA = block_n).
    nwarps : warps per CTA (CUDA cores and dsum: 4).
    causal : the mask's compile-time flag (windows are runtime values).
    part : dkdv only: 0 dK and dV, 1 dK, 2 dV.
    """
    role: str
    dtype: str
    headdim: int = 0
    block_m: int = 0
    block_n: int = 0
    nwarps: int = 4
    causal: bool = False
    part: int = 0
    tma: bool = False
    deterministic: bool = False  # the Hopper kernel only: dQ added in a fixed order

    @property
    def isa(self) -> str:
        """``"tma"`` (the Hopper kernel and its dq conversion), ``"mma"`` or ``"simt"``."""
        if self.tma:
            return "tma"
        return "mma" if self.dtype in fwd.TC_DTYPES else "simt"

    @property
    def source(self) -> str:
        return {"tma": HOPPER_SOURCE, "mma": MMA_SOURCE, "simt": SIMT_SOURCE}[self.isa]

    @property
    def threads(self) -> int:
        return 32 * self.nwarps

    @property
    def name(self) -> str:
        d = _SHORT[self.dtype]
        if self.role == "dsum":
            if self.tma:  # (one per dtype up to hd128, one above)
                return f"bwdtma_prep_{d}" + (f"_hd{self.headdim}" if self.headdim > 128 else "")
            return f"bwd_dsum_{d}"
        if self.tma:
            if self.role == "dq":
                return f"bwdtma_dqconv_{d}_hd{self.headdim}"
            return (f"bwdtma_{d}_hd{self.headdim}_m{self.block_m}_n{self.block_n}"
                    f"{'_causal' if self.causal else ''}{'_det' if self.deterministic else ''}")
        pre = "bwd" if self.isa == "mma" else "bwdsimt"
        w = f"_w{self.nwarps}" if self.isa == "mma" else ""
        part = {0: "", 1: "_dk", 2: "_dv"}[self.part]
        return (f"{pre}_{self.role}_{d}_hd{self.headdim}_m{self.block_m}_n{self.block_n}{w}"
                f"{part}{'_causal' if self.causal else ''}")

    @property
    def entry(self) -> str:
        t, c = _CTYPE[self.dtype], ("true" if self.causal else "false")
        if self.role == "dsum":
            if self.tma:
                return f"cf::bwd_hopper_prep_entry<{t}, {max(self.headdim, 128)}>"
            return f"cf::bwd_dsum_entry<{t}, {_CTYPE[ACC_DTYPE[self.dtype]]}>"
        if self.tma:
            if self.role == "dq":
                return f"cf::bwd_dq_convert_entry<{t}, {self.headdim}>"
            det = "true" if self.deterministic else "false"
            return f"cf::bwd_hopper_entry<{t}, {self.headdim}, {c}, {det}>"
        tile = f"{t}, {self.headdim}, {self.block_m}, {self.block_n}"
        if self.isa == "simt":
            return f"cf::bwd_{self.role}_simt_entry<{tile}, {c}>"
        if self.role == "dkdv":
            return f"cf::bwd_dkdv_mma_entry<{tile}, {self.nwarps}, {c}, {self.part}>"
        return f"cf::bwd_dq_mma_entry<{tile}, {self.nwarps}, {c}>"

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory, bytes: the kernel's own constant (``kSmemBytes`` of
        ``BwdMmaTraits``, ``kDkdvSmemBytes`` / ``kDqSmemBytes`` of ``SimtBwdTraits``), read by an
        NVRTC probe (:func:`layout`); ``kBytes`` of ``HopperBwdSmem`` for the Hopper kernel; 0
        for dsum and the dq conversion."""
        return layout(self.source, self._smem_expr()) if self.has_smem else 0

    @property
    def takes_maps(self) -> bool:
        """The Hopper kernel: its launch encodes tensor maps (``BwdTmaParams``)."""
        return self.tma and self.role == "dkdv"

    @property
    def has_smem(self) -> bool:
        return self.role != "dsum" and not (self.tma and self.role == "dq")

    def _smem_expr(self) -> str:
        t = _CTYPE[self.dtype]
        if self.tma:
            return f"cf::HopperBwdSmem<cf::HopperBwdTraits<{t}, {self.headdim}>>::kBytes"
        if self.isa == "simt":
            which = "kDkdvSmemBytes" if self.role == "dkdv" else "kDqSmemBytes"
            return (f"cf::SimtBwdTraits<{t}, {self.headdim}, {self.block_m}, {self.block_n}>::"
                    f"{which}")
        rows, cols = ((self.block_n, self.block_m) if self.role == "dkdv"
                      else (self.block_m, self.block_n))
        return f"cf::BwdMmaTraits<{t}, {self.headdim}, {rows}, {cols}, {self.nwarps}>::kSmemBytes"

    @property
    def spec(self) -> jit.KernelSpec:
        return jit.KernelSpec(name=self.name, source=self.source, entry=self.entry,
                              smem_bytes=self.smem_bytes, arch=fwd.WG_ARCH if self.tma else "")


def _probe_exprs(source: str) -> tuple:
    """The shared-memory expressions of every kernel of ``source`` (one probe per source)."""
    return tuple(sorted({k._smem_expr() for k in all_kernels() if k.source == source
                         and k.has_smem}))


@functools.lru_cache(maxsize=None)
def _layouts(source: str) -> dict:
    exprs = _probe_exprs(source)
    return dict(zip(exprs, jit.constants(source, exprs)))


def layout(source: str, expr: str) -> int:
    """The value of a shared-memory constant of ``source`` (cached NVRTC probe, no GPU)."""
    table = _layouts(source)
    if expr not in table:
        return jit.constants(source, (expr,))[0]
    return table[expr]


@dataclasses.dataclass(frozen=True)
class BwdPlan:
    """The kernels of one backward call, in launch order: dsum, the dK/dV launches, dQ."""
    dsum: BwdKernel
    dkdv: tuple
    dq: BwdKernel

    @property
    def kernels(self) -> tuple:
        return (self.dsum,) + self.dkdv + (self.dq,)


def hopper_enabled() -> bool:
    """Whether a call that the Hopper kernel can take runs it: yes unless
    ``CUPYFLASH_BWD_HOPPER=0`` (read per call; the mma.sync kernels then run, as on other GPUs)."""
    return os.environ.get("CUPYFLASH_BWD_HOPPER", "1") != "0"


def hopper_headdim(headdim: int) -> int:
    """The Hopper kernel's compiled head dim for an actual one (up to 256; ValueError above,
    which the input checks reject before any plan)."""
    hhd = next((h for h in HOPPER_HEADDIMS if h >= headdim), None)
    if hhd is None:
        raise ValueError(f"headdim: the Hopper backward takes at most {HOPPER_HEADDIMS[-1]}, "
                         f"got {headdim}")
    return hhd


def turns_per_tile(headdim: int) -> int:
    """The deterministic Hopper kernel's int32 turn counters per dQ tile (after dq_accum's
    tiles): one per consumer warpgroup at compiled head dim 256 (each adds its own columns),
    else one (``kernels_cu/backward/hopper.cu``'s ``DqTurns::kPerTile``)."""
    return 2 if hopper_headdim(headdim) == 256 else 1


@functools.lru_cache(maxsize=None)
def plan_backward(dtype: str, headdim: int, causal: bool, hopper: bool = False,
                  deterministic: bool = False) -> BwdPlan:
    """The backward kernels of a problem's dtype, actual head dim (a multiple of 8 up to 256,
    run on the next compiled one) and causal flag; ``hopper``: the Hopper plan (dsum, the
    Hopper kernel, the dq conversion; float16/bfloat16), whose kernel adds dQ in a fixed order
    when ``deterministic`` (the other plans always do).

    Raises
    ------
    ValueError
        An unsupported dtype or head dim (or one the Hopper plan does not take)."""
    if dtype not in ACC_DTYPE:
        raise ValueError(f"dtype: the backward takes {tuple(ACC_DTYPE)}, got {dtype}")
    hd = padded_headdim(headdim)
    dsum = BwdKernel("dsum", dtype)
    if hopper:
        if dtype not in fwd.TC_DTYPES:
            raise ValueError(f"hopper: the Hopper backward takes float16/bfloat16, got {dtype}")
        hhd = hopper_headdim(headdim)
        bm, bn = HOPPER_TILES[hhd]
        # LSE log2(e) and D, padded (one pre-pass up to hd128, one above)
        prep = BwdKernel("dsum", dtype, 0 if hhd <= 128 else hhd, STATS_ROWS, 0, 4, tma=True)
        return BwdPlan(prep, (BwdKernel("dkdv", dtype, hhd, bm, bn, HOPPER_WARPS, causal, tma=True,
                                        deterministic=deterministic),),
                       BwdKernel("dq", dtype, hhd, bm, 0, 8, tma=True))
    if dtype in fwd.TC_DTYPES:
        dkdv_tiles, (qm, qn, qw) = _MMA_TILES[hd]
        dkdv = tuple(BwdKernel("dkdv", dtype, hd, bm, bn, nw, causal, part)
                     for bm, bn, nw, part in dkdv_tiles)
        dq = BwdKernel("dq", dtype, hd, qm, qn, qw, causal)
    else:
        bm, bn = _SIMT_TILES[dtype][hd]
        dkdv = (BwdKernel("dkdv", dtype, hd, bm, bn, 4, causal),)
        dq = BwdKernel("dq", dtype, hd, bm, bn, 4, causal)
    return BwdPlan(dsum, dkdv, dq)


def all_kernels() -> tuple:
    """Every backward kernel a call can run (each dtype, compiled head dim, causal flag)."""
    seen = {}
    for dtype in ACC_DTYPE:
        for hd in HEADDIMS:
            for causal in (False, True):
                for k in plan_backward(dtype, hd, causal).kernels:
                    seen[k] = None
    for dtype in fwd.TC_DTYPES:
        for hd in HOPPER_HEADDIMS:
            for causal in (False, True):
                for det in (False, True):
                    for k in plan_backward(dtype, hd, causal, hopper=True, deterministic=det).kernels:
                        seen[k] = None
    return tuple(seen)


def stats_shape(problem) -> tuple:
    """Shape of the Hopper plan's float32 ``dsum`` buffer: (batch, nheads, query blocks of
    :data:`STATS_ROWS` rows up to a multiple of :data:`STATS_PAD` rows, 2 x that many): per
    block LSE log2(e), then D, of its rows (+inf and 0 past the end)."""
    m = STATS_ROWS
    return (problem.batch, problem.nheads, -(-problem.seqlen_q // STATS_PAD) * (STATS_PAD // m),
            2 * m)


def launch_geometry(kernel: BwdKernel, problem) -> tuple:
    """``(grid, block)`` of ``kernel`` for ``problem`` (varlen: seqlen_* are the maxima and
    ``batch`` the number of sequences; CTAs past a sequence's end return at once)."""
    p = problem
    if kernel.role == "dsum":
        grid = ((stats_shape(p)[2] if kernel.tma else -(-p.seqlen_q // DSUM_ROWS)), p.nheads,
                p.batch)
    elif kernel.role == "dkdv":
        grid = (-(-p.seqlen_k // kernel.block_n), p.nheads_k, p.batch)
    else:
        grid = (-(-p.seqlen_q // kernel.block_m), p.nheads, p.batch)
    return grid, (kernel.threads, 1, 1)


#: The per-call pointer fields of :class:`~cupyflash.core.params.BwdParams`, in order: its own
#: six, then those of ``fwd`` (one consecutive block).
POINTERS = ("dout", "dq", "dk", "dv", "dsum", "dq_accum") + fwd.POINTERS
_OWN_STRIDES = tuple(f"{t}_{s}_stride" for t in ("do", "dq", "dk", "dv")
                     for s in ("batch", "row", "head")) + ("dsum_batch_stride",
                                                           "dsum_head_stride")


def pointer_block(tma: bool = False) -> tuple:
    """``(byte offset, count)`` of :data:`POINTERS` in :class:`BwdParams` (``tma``: in
    :class:`BwdTmaParams`, after its tensor maps)."""
    if BwdParams.fwd.offset != 8 * 6 or FwdParams.q.offset != 0 or \
            FwdParams.cu_seqlens_k.offset != 8 * (len(fwd.POINTERS) - 1):
        raise ValueError("BwdParams: the pointers are not one consecutive block")
    return (BwdTmaParams.bwd.offset if tma else 0), len(POINTERS)


def bwd_fields(problem, strides: dict, varlen: bool) -> tuple:
    """``(fwd strides, fwd sizes, own strides)``: the constant fields of :class:`BwdParams` from
    the element strides of q, k, v, out, lse, dout, dq, dk, dv and dsum (``strides[name]``)."""
    fs, sizes = fwd.fwd_fields(problem, tuple(strides[n] for n in ("q", "k", "v", "out")),
                               strides["lse"], varlen)
    own = []
    for n in ("dout", "dq", "dk", "dv"):
        st = strides[n]
        own += [0, st[0], st[1]] if varlen else list(st[:3])
    ds = strides["dsum"]
    own += [0, ds[0]] if varlen else list(ds[:2])
    return fs, sizes, tuple(np.int64(x) for x in own)


def params_of(fields: tuple, tma: bool = False):
    """A :class:`BwdParams` with the constant fields of :func:`bwd_fields` and NULL pointers
    (``tma``: inside a :class:`BwdTmaParams` whose maps the launch encodes per call)."""
    fs, sizes, own = fields
    prm = BwdParams()
    prm.fwd = fwd.params_of(fs, sizes)
    for name, x in zip(_OWN_STRIDES, own):
        setattr(prm, name, int(x))
    if tma:
        outer = BwdTmaParams()
        outer.bwd = prm
        return outer
    return prm
