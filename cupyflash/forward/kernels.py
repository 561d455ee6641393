"""Tiled prefill forward kernels: the supported table, specialisation names, launch geometry and
the launch itself.

The kernels implement FlashAttention-2 (Dao, arXiv 2307.08691), Algorithm 1 with the work
partitioning of Sec. 3.2-3.3: one CTA per (``block_m`` query rows, head, batch), K/V tiles of
``block_n`` keys streamed through shared memory. Three kernels (``PrefillConfig.isa``):

* ``"tma"``: ``kernels_cu/forward/hopper.cu``, FlashAttention-3 (Shah et al., arXiv
  2407.08608) on Hopper (sm_90a only): TMA loads by a producer warpgroup, two or three consumer
  warpgroups with ``setmaxnreg``, warpgroup MMA with the intra-warpgroup overlap and turns
  between the consumers (FA3's ping-pong; round-robin with three), a persistent grid (dynamic
  tile order when causal); float16/bfloat16, head dims 64, 128, 256
  (every multiple of 8 padded onto them), dense and varlen problems. The default on sm_90a;
  its launch passes four tensor maps (q, k, v and, dense, o: :mod:`cupyflash.core.tma`);
* ``"mma"``: ``kernels_cu/forward/mma.cu``, mma.sync m16n8k16 (sm_80+), float16/bfloat16, every head dim;
* ``"simt"``: ``kernels_cu/forward/simt.cu``, CUDA cores, float32/float64.

Everything here is pure Python except :func:`launch` (which needs CuPy and a GPU):

* :data:`SUPPORTED` is the table of compiled configurations (a tuple of :class:`PrefillConfig`);
  within one (dtype, headdim) the first row is the suggested default (the first one the device
  can run), and (block_m, block_n, nwarps, isa) is unique, so a tile names one row.
* :func:`padded_headdim` maps an actual head dim (a multiple of 8 up to 256) to the compiled one
  of a kernel (``isa``); :func:`configs_for` lists the rows that run it, default first.
* :func:`kernel_spec` names a specialisation (``fwdtma_bf16_hd128_m128_n128_s2_causal``,
  ``fwd_bf16_hd128_m128_n64_w8_causal``, ``fwd_bf16_hd128_m128_n64_w4_pf``,
  ``fwdsimt_f64_hd64_m32_n32``) and returns its :class:`cupyflash.core.jit.KernelSpec`.
* :func:`launch_config` gives (grid, block, dynamic shared memory) for a spec and a problem.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ..core import checks, jit
from ..core.params import FwdParams, FwdTmaParams, pointer_fields

__all__ = [
    "PrefillConfig", "SUPPORTED", "HEADDIMS", "TC_DTYPES", "SIMT_DTYPES", "MAX_SMEM_BYTES",
    "TMA_HEADDIMS", "TMA_FIRST_ABOVE", "padded_headdim", "configs_for", "layout",
    "kernel_spec", "all_specs", "spec_of", "config_of",
    "launch_config", "POINTERS",
    "kernel_params", "params_of", "args_template", "check_pointers", "launch", "prepared_launch",
    "lse_dtype", "fwd_fields", "check_tensor_core_layout",
]

#: Compiled (padded) head dims; every multiple of 8 up to 256 maps to the next one of these.
HEADDIMS = (32, 64, 96, 128, 160, 192, 224, 256)
#: Tensor-core dtypes (mma.sync m16n8k16, fp32 accumulation) and CUDA-core dtypes (accumulate in T).
TC_DTYPES = ("float16", "bfloat16")
SIMT_DTYPES = ("float32", "float64")
#: Largest dynamic shared memory per block (opt-in) on sm_90 (H100/H200): 227 KiB.
#: (A100 allows 163 KiB, sm_86/89 99 KiB: dispatch must compare with the device's limit.)
MAX_SMEM_BYTES = 227 * 1024

TC_SOURCE = "forward/mma.cu"
SIMT_SOURCE = "forward/simt.cu"
TMA_SOURCE = "forward/hopper.cu"
#: The architecture the TMA kernel (wgmma, setmaxnreg) is compiled for, the only one that runs it.
WG_ARCH = "sm_90a"
#: Instruction sets of the prefill kernels (``PrefillConfig.isa``).
ISAS = ("tma", "mma", "simt")
#: The instruction sets that run on WG_ARCH only.
HOPPER_ISAS = ("tma",)
SIMT_THREADS = 128

_SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}
_CTYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double"}
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_LOG2E = 1.4426950408889634073599246810019


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """One compiled tile configuration (both causal and non-causal are instantiated).

    dtype : ``'float16'``, ``'bfloat16'`` (tensor cores) or ``'float32'``, ``'float64'`` (CUDA cores).
    headdim : compiled (padded) head dim, one of :data:`HEADDIMS`.
    block_m, block_n : query rows per CTA (``BLOCK_M``) and keys per K/V tile (``BLOCK_N``).
    nwarps : warps per CTA (tensor cores: each warp owns ``block_m / nwarps`` query rows;
        CUDA cores: always 4, i.e. 128 threads).
    source : kernel file under ``kernels_cu/``.
    stages : K/V tiles in the shared-memory ring (2: double buffering).
    prefetch : mma only: the Q K^T fragments of the next k16 step are loaded before the MMAs of
        the current one (name suffix ``_pf``; the kernel's ``PREFETCH``).
    isa : ``"tma"`` (the Hopper TMA kernel, :data:`TMA_SOURCE`, runs on :data:`WG_ARCH`
        only; ``nwarps = 4 * (block_m / 64 + 1)``), ``"mma"`` (mma.sync) or ``"simt"`` (CUDA
        cores).
    """
    dtype: str
    headdim: int
    block_m: int
    block_n: int
    nwarps: int
    source: str
    stages: int = 2
    prefetch: bool = False
    isa: str = "mma"

    @property
    def threads(self) -> int:
        return 32 * self.nwarps

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory per CTA, bytes: the kernel's own layout constant (``kBytes`` of
        ``HopperFwdSmem``, ``kSmemBytes`` of ``FwdTraits`` / ``SimtTraits``), read through an
        NVRTC probe (:func:`layout`)."""
        return layout(self)[0]

    @property
    def o_store(self) -> bool:
        """TMA rows whose kernel can write O through shared memory and TMA stores (in O buffers
        of its own, or through its V ring at hd256: ``HopperFwdSmem::kOStore || kOInV``); dense
        problems only, and only when the launch passes an O map
        (:func:`cupyflash.core.tma.o_map_layout`)."""
        return self.isa == "tma" and bool(layout(self)[1])

    @property
    def arch(self) -> str:
        """The one architecture that runs this row (:data:`WG_ARCH` for TMA), else ``""``
        (any sm_80+ device)."""
        return WG_ARCH if self.isa in HOPPER_ISAS else ""


def _layout_exprs(cfg: PrefillConfig) -> tuple:
    """The C++ constants of a row's shared-memory layout: (bytes, O through TMA stores)."""
    ct = _CTYPE[cfg.dtype]
    if cfg.isa == "tma":
        smem = (f"cf::FlashFwdHopper<{ct}, {cfg.headdim}, {cfg.block_m}, {cfg.block_n}, "
                f"false>::Smem")
        return f"{smem}::kBytes", f"{smem}::kOStore || {smem}::kOInV"
    if cfg.isa == "mma":
        pf = ", true" if cfg.prefetch else ""
        return (f"cf::FwdTraits<{ct}, {cfg.headdim}, {cfg.block_m}, {cfg.block_n}, "
                f"{cfg.nwarps}{pf}>::kSmemBytes", "0")
    return f"cf::SimtTraits<{ct}, {cfg.headdim}, {cfg.block_m}, {cfg.block_n}>::kSmemBytes", "0"


@functools.lru_cache(maxsize=None)
def _layouts(source: str, rows: tuple) -> dict:
    """{row: (smem bytes, o_store)} of the rows of one kernel source, from one NVRTC probe."""
    exprs = [e for cfg in rows for e in _layout_exprs(cfg)]
    vals = jit.constants(source, tuple(exprs))
    return {cfg: (vals[2 * i], vals[2 * i + 1]) for i, cfg in enumerate(rows)}


@functools.lru_cache(maxsize=None)
def layout(cfg: PrefillConfig) -> tuple:
    """``(smem_bytes, o_store)`` of a row: its kernel's layout constants (the one definition is
    the C++ one; read with :func:`cupyflash.core.jit.constants`, no GPU needed, cached). Rows of
    :data:`SUPPORTED` share one probe per kernel source; any other row (the tile benchmark's)
    gets its own."""
    rows = tuple(c for c in SUPPORTED if c.source == cfg.source)
    table = _layouts(cfg.source, rows)
    if cfg not in table:
        table = _layouts(cfg.source, (cfg,))
    return table[cfg]


# Tile shapes per compiled head dim, suggested default first. Tensor cores: (block_m, block_n,
# nwarps), every one compiles with zero spills for sm_80 and sm_90a (tests/test_compile_prefill.py).
# block_m / nwarps = 16 or 32 rows per warp; 32 rows per warp (two m16 tiles) halves the smem
# traffic for K and V per FLOP but needs ~2x the accumulator registers, so it only fits with
# smaller key tiles up to hd128 (128x64x4w: 255 registers, no spills; hd160+ spills at 32 rows
# per warp). Defaults hd96 / hd128 = 128x64x4w from the v1 sweep (H200, bf16 and fp16, 16k tokens,
# S = 4096 / 16384, experiments/NOTES.md "v1 outcome"): hd128 non-causal 315-321 TFLOP/s vs
# 295-299 for 128x32x4 (the v0 default) and 256-262 for 128x64x8; causal 258-281, best or within
# 0.7% of the best (128x128x8 283 at S = 16384, 252 at S = 4096). hd96: 296-304 vs 253-259 for
# 128x128x8 and 234-242 for the previous default 128x64x8; causal 277-302 vs 213-231.
# Only rows the dispatcher can choose (tests/test_dispatch.py test_table_has_no_unreachable_row:
# every architecture and shared-memory limit of core/planning.py, every decision input of
# heuristics.choose_prefill_tile). It takes the first row, the first row of a smaller block_m
# (rules 2, 3), rule 1b's 64x64x4w, the narrowest block_n of the chosen block_m that holds the
# keys (rule 4), and the first rows of what less shared memory leaves (99 KiB: sm_86/89/120;
# 163 KiB: sm_80/87). Never chosen, so gone from the table on 2026-12-02 (issue 34): a row behind
# another with the same block_m and block_n (128x64x8 at hd96/128, 128x128x8 at hd32), the
# widest block_n of a block_m behind a narrower row (64x128x4 and 128x128x8 at hd64, 128x128x8
# at hd96/128), and hd32's 128x64x4 (rule 4 would take it for keys <= 64, which rule 1b has
# already given 64x64x4w). experiments/bench_tiles.py --extra still measures them.
_TC_TILES = {
    32: ((128, 128, 4), (64, 128, 4), (64, 64, 4)),
    64: ((128, 64, 4), (64, 64, 4)),
    96: ((128, 64, 4), (128, 32, 4), (64, 64, 4)),
    128: ((128, 64, 4), (128, 32, 4), (64, 64, 4)),
    160: ((128, 64, 8), (64, 64, 4), (128, 32, 8), (64, 32, 4)),
    192: ((128, 64, 8), (64, 64, 4), (128, 32, 8), (64, 32, 4)),
    224: ((128, 64, 8), (64, 64, 4), (128, 32, 8), (64, 32, 4)),
    256: ((128, 64, 8), (128, 32, 8), (64, 32, 4)),  # 64x64x4w spills on sm_80
}
# CUDA cores (128 threads): (block_m, block_n). Rows per thread = block_m / 16.
# float64 above hd128: 16x32 only (its 32x32 rows, behind the 16-row default, were never chosen:
# the heuristic steps block_m down, never up; they left the table 2026-12-02).
_SIMT_TILES = {
    "float32": {hd: ((64, 32), (32, 32)) if hd <= 128 else ((32, 32), (16, 32)) for hd in HEADDIMS},
    "float64": {hd: ((32, 32), (16, 32)) if hd <= 128 else ((16, 32),) for hd in HEADDIMS},
}
_SIMT_TILES["float64"][256] = ((16, 32), (16, 16))  # 32x32 needs > 255 registers (spills)

# Rows with prefetched Q K^T fragments: (headdim, block_m, block_n, nwarps). v2 sweep (H200,
# experiments/NOTES.md "v2 prefill outcome"): hd128 128x64x4 with fragment prefetch (pf)
# 325-327 TFLOP/s non-causal vs 315-319 without, causal 282-309 vs 257-279. Measured there and
# not adopted (removed): one ex2.approx.ftz per exp2 and skipping the rescale when no row max
# moved (0-1%, noise), 3 K/V stages and 32-key register working sets (v1).
_TC_PREFETCH = {(128, 128, 64, 4)}

# Hopper TMA rows (kernels_cu/forward/hopper.cu, sm_90a only, dense and varlen problems):
# headdim -> (block_m, block_n, stages); a producer warpgroup plus block_m / 64 consumer
# warpgroups, nwarps = 4 * (block_m / 64 + 1); a persistent grid (launch_config).
# Listed first: the default on sm_90a. FlashAttention-3's tiles (bf16, its tile_size_fwd) except
# hd128 non-causal, where its 128 x 176 ran at 0.85-0.96x of 128 x 128 here (no shared memory left
# for the O buffers). Measured (bench_tiles --isa tma, H200, bf16, 2026-12-01, recorded in 4183281
# and b2eda86, NOTES v63-v65, results-archive-2026-12-02:experiments/results/session18/tiles_v62.jsonl,
# tiles_hd64_rule3b.jsonl): hd64 192 x 128 1.03-1.20x 128 x 128 except causal S 512 / 1k (0.90x /
# 0.88x: heuristics rule 3b); hd256 128 x 80 1.01-1.07x 128 x 64 at S 1k-16k.
_TMA_TILES = {64: ((192, 128, 2), (128, 128, 2)), 128: ((128, 128, 2),), 256: ((128, 80, 2),)}
#: The TMA kernel's compiled head dims; every multiple of 8 up to 256 runs padded onto the next.
TMA_HEADDIMS = tuple(sorted(_TMA_TILES))
#: Head dims up to this one default to the mma.sync kernel's hd32 rows on sm_90a: the TMA
#: kernel pads them to 64 and does twice the work. Measured (bench_tiles, H200, bf16, 2026-12-01,
#: recorded in 13267ba, results-archive-2026-12-02:experiments/results/session17/padded_tiles.jsonl): hd32 on TMA hd64 at
#: 0.78-0.98x of mma.sync hd32 (S 256 and 4k, causal and not); hd72/96 on TMA hd128 at 1.1-1.6x
#: of mma.sync hd96, hd192 on TMA hd256 at 1.2-2.0x of mma.sync hd192.
TMA_FIRST_ABOVE = 32


def _tma_row(dtype: str, hd: int, bm: int, bn: int, stages: int) -> PrefillConfig:
    return PrefillConfig(dtype, hd, bm, bn, 4 * (bm // 64 + 1), TMA_SOURCE, stages=stages,
                         isa="tma")


def _build_table() -> tuple:
    rows = []
    for dtype in TC_DTYPES:
        for hd in HEADDIMS:
            for bm, bn, st in _TMA_TILES.get(hd, ()):
                rows.append(_tma_row(dtype, hd, bm, bn, st))
            for bm, bn, nw in _TC_TILES[hd]:
                rows.append(PrefillConfig(dtype, hd, bm, bn, nw, TC_SOURCE,
                                          prefetch=(hd, bm, bn, nw) in _TC_PREFETCH))
    for dtype in SIMT_DTYPES:
        for hd in HEADDIMS:
            for bm, bn in _SIMT_TILES[dtype][hd]:
                rows.append(PrefillConfig(dtype, hd, bm, bn, SIMT_THREADS // 32, SIMT_SOURCE,
                                          isa="simt"))
    return tuple(rows)


#: The supported table: every compiled configuration the dispatcher may choose.
SUPPORTED: tuple = _build_table()


def padded_headdim(d: int, isa: str = "mma") -> int:
    """The compiled head dim that runs an actual head dim ``d`` (a multiple of 8 in [8, 256]).

    ``isa="mma"`` or ``"simt"``: the next one of :data:`HEADDIMS`; ``isa="tma"`` (the Hopper
    kernel): the next one of :data:`TMA_HEADDIMS` (64, 128, 256, FlashAttention-3's), the head
    dim columns past ``d`` loaded as zeros by the tensor maps and never stored.

    Raises
    ------
    ValueError
        If ``d`` is not a multiple of 8 in [8, 256], or ``isa`` is not one of :data:`ISAS`.
    """
    if isinstance(d, bool) or not isinstance(d, int) or d < 8 or d > 256 or d % 8:
        raise ValueError(f"headdim: got {d!r}; supported: multiples of 8 from 8 to 256 "
                         f"(compiled as {', '.join(map(str, HEADDIMS))}; the Hopper kernel as "
                         f"{', '.join(map(str, TMA_HEADDIMS))})")
    if isa not in ISAS:
        raise ValueError(f"isa: got {isa!r}; expected one of {ISAS}")
    return next(h for h in (TMA_HEADDIMS if isa == "tma" else HEADDIMS) if h >= d)


def configs_for(dtype: str, d: int) -> tuple:
    """The :data:`SUPPORTED` rows that run ``dtype`` at actual head dim ``d``: each instruction
    set's rows at its own padded head dim (:func:`padded_headdim`), the Hopper (TMA) rows first
    (the default where the target runs them) when ``d`` is above :data:`TMA_FIRST_ABOVE`, after
    the mma.sync rows otherwise; within an instruction set, the table's order.

    Raises
    ------
    ValueError
        If ``d`` is not a multiple of 8 in [8, 256].
    """
    pad = {isa: padded_headdim(d, isa) for isa in ISAS}
    order = ISAS if d > TMA_FIRST_ABOVE else ("mma", "tma", "simt")
    return tuple(c for isa in order for c in SUPPORTED
                 if c.isa == isa and c.dtype == dtype and c.headdim == pad[isa])


def _name(cfg: PrefillConfig, causal: bool) -> str:
    suffix = "_causal" if causal else ""
    if cfg.isa == "tma":
        return (f"fwdtma_{_SHORT[cfg.dtype]}_hd{cfg.headdim}_m{cfg.block_m}_n{cfg.block_n}"
                f"_s{cfg.stages}{suffix}")
    if cfg.dtype in TC_DTYPES:
        return (f"fwd_{_SHORT[cfg.dtype]}_hd{cfg.headdim}_m{cfg.block_m}_n{cfg.block_n}"
                f"_w{cfg.nwarps}{'_pf' if cfg.prefetch else ''}{suffix}")
    return f"fwdsimt_{_SHORT[cfg.dtype]}_hd{cfg.headdim}_m{cfg.block_m}_n{cfg.block_n}{suffix}"


def _entry(cfg: PrefillConfig, causal: bool) -> str:
    # The entry (kernels_cu/common/fwd_tile.cuh, or the Hopper kernel's) with one CTA's algorithm.
    c, t = ("true" if causal else "false"), _CTYPE[cfg.dtype]
    if cfg.isa == "tma":  # its own entry (FwdTmaParams: the tensor maps, then FwdParams)
        return (f"cf::flash_fwd_tma_entry<cf::FlashFwdHopper<{t}, {cfg.headdim}, {cfg.block_m}, "
                f"{cfg.block_n}, {c}>, {t}>")
    if cfg.dtype in TC_DTYPES:
        pf = ", true" if cfg.prefetch else ""
        block = (f"cf::FlashFwd<{t}, {cfg.headdim}, {cfg.block_m}, {cfg.block_n}, {cfg.nwarps}, "
                 f"{c}{pf}>")
    else:
        block = f"cf::FlashFwdSimt<{t}, {cfg.headdim}, {cfg.block_m}, {cfg.block_n}, {c}>"
    return f"cf::flash_fwd_entry<{block}, {t}>"


_BY_KEY = {(c.dtype, c.headdim, c.block_m, c.block_n, c.nwarps, c.isa): c for c in SUPPORTED}
_BY_NAME: dict = {}
for _c in SUPPORTED:
    for _causal in (False, True):
        _BY_NAME[_name(_c, _causal)] = (_c, _causal)
del _c, _causal


def kernel_spec(dtype: str, hd_padded: int, block_m: int, block_n: int, nwarps: int,
                causal: bool, *, isa: str | None = None) -> jit.KernelSpec:
    """The :class:`~cupyflash.core.jit.KernelSpec` of the :data:`SUPPORTED` row with this tile.

    ``isa``: ``"tma"``, ``"mma"`` or ``"simt"``; default ``"simt"`` for float32/float64 and
    ``"mma"`` for float16/bfloat16 (a TMA row must be asked for by name, or through
    :func:`spec_of`).

    Raises
    ------
    ValueError
        If the tile is not in the table (the message lists the tiles that are).
    """
    if isa is None:
        isa = "simt" if dtype in SIMT_DTYPES else "mma"
    cfg = _BY_KEY.get((dtype, hd_padded, block_m, block_n, nwarps, isa))
    if cfg is None:
        have = [f"m{c.block_m}_n{c.block_n}_w{c.nwarps}" + (f" ({c.isa})" if c.isa in HOPPER_ISAS
                                                            else "")
                for c in SUPPORTED if c.dtype == dtype and c.headdim == hd_padded]
        raise ValueError(f"prefill tile: ({dtype}, hd{hd_padded}, m{block_m}, n{block_n}, w{nwarps}"
                         f", isa {isa}) is not compiled; compiled for this dtype/headdim: "
                         f"{have or 'none'}")
    return spec_of(cfg, causal)


def spec_of(cfg: PrefillConfig, causal: bool) -> jit.KernelSpec:
    """The :class:`~cupyflash.core.jit.KernelSpec` of a :data:`SUPPORTED` row."""
    return jit.KernelSpec(name=_name(cfg, bool(causal)), source=cfg.source,
                          entry=_entry(cfg, bool(causal)), smem_bytes=cfg.smem_bytes,
                          arch=cfg.arch)


def all_specs() -> tuple:
    """Every specialisation in :data:`SUPPORTED` (each configuration, non-causal and causal)."""
    return tuple(spec_of(c, causal) for c in SUPPORTED for causal in (False, True))


def config_of(spec: jit.KernelSpec) -> tuple:
    """``(PrefillConfig, causal)`` of a prefill spec (looked up by its name)."""
    try:
        return _BY_NAME[spec.name]
    except KeyError:
        raise ValueError(f"spec: {spec.name!r} is not a prefill specialisation") from None


def launch_config(spec: jit.KernelSpec, problem, num_sms: int | None = None) -> tuple:
    """Launch geometry ``(grid, block, smem_bytes)`` of ``spec`` for ``problem`` (pure function).

    TMA rows (persistent): grid = (min(work tiles, ``num_sms``), 1, 1), work tiles = ceil(seqlen_q
    / block_m) * nheads * batch (``num_sms`` default: 132, an H100/H200 SXM). Other rows:
    grid = (ceil(seqlen_q / block_m), nheads, batch): one CTA per (m-block, head, batch).
    For varlen problems ``seqlen_q`` is max_seqlen_q and ``batch`` the number of sequences (CTAs
    and work tiles past a sequence's end do nothing). Causal kernels visit the m-blocks in
    reverse order (heaviest first) inside the kernel; the grid is the same.

    Parameters
    ----------
    spec : cupyflash.core.jit.KernelSpec from :func:`kernel_spec`.
    problem : cupyflash.core.checks.AttnProblem (uses batch, seqlen_q, nheads).
    """
    cfg, _ = config_of(spec)
    m_blocks = max(0, -(-problem.seqlen_q // cfg.block_m))
    if cfg.isa == "tma":
        from ..core.planning import H200_SMS
        tiles = m_blocks * problem.nheads * problem.batch
        return (min(tiles, int(num_sms or H200_SMS)), 1, 1), (cfg.threads, 1, 1), cfg.smem_bytes
    grid = (m_blocks, problem.nheads, problem.batch)
    return grid, (cfg.threads, 1, 1), cfg.smem_bytes


#: The LSE dtype of a forward of a dtype (float64 for float64, else float32).
lse_dtype = checks.lse_dtype


def _check_lse(cfg: PrefillConfig, lse) -> None:
    if lse is not None and np.dtype(lse.dtype).name != lse_dtype(cfg.dtype):
        raise ValueError(f"lse: a {cfg.dtype} forward writes a {lse_dtype(cfg.dtype)} LSE, got "
                         f"dtype {np.dtype(lse.dtype).name}")


def _strides(x, name: str, ndim: int) -> tuple:
    isz = x.dtype.itemsize
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(x.shape)}")
    st = [s // isz for s in x.strides]
    if any(s * isz != b for s, b in zip(st, x.strides)):
        raise ValueError(f"{name}: strides {x.strides} are not multiples of the item size {isz}")
    return tuple(st)


def kernel_params(spec: jit.KernelSpec, q, k, v, out, lse, *, problem, cu_seqlens_q=None,
                  cu_seqlens_k=None) -> FwdParams:
    """The kernel's parameter struct, :class:`cupyflash.core.params.FwdParams` (the C struct
    ``cf::FwdParams`` of kernels_cu/common/params.cuh), with the pointers of these arrays.

    Layouts: q/out (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_k, headdim),
    lse (batch, nheads, seqlen_q) of :func:`lse_dtype`; varlen: q/out (total_q, nheads, headdim), k/v
    (total_k, nheads_k, headdim), lse (nheads, total_q). Strides in elements (64-bit); the last
    dim of q/k/v/out and of lse must be contiguous.

    The constant fields are :func:`params_of` ``(*args_template(...))`` (which depend on shapes,
    strides and the problem only, so the launch cache of :mod:`cupyflash.forward.dispatch`
    keeps them), the pointers are the call's (checked by :func:`check_pointers`).
    """
    varlen = cu_seqlens_q is not None
    if (cu_seqlens_k is not None) != varlen:
        raise ValueError("cu_seqlens_q, cu_seqlens_k: give both or neither")
    _check_lse(config_of(spec)[0], lse)
    ls = _strides(lse, "lse", 2 if varlen else 3)
    prm = params_of(*args_template(spec, q, k, v, out, ls, problem=problem, varlen=varlen))
    check_pointers(spec, q, k, v, out)
    for name, x in (("q", q), ("k", k), ("v", v), ("o", out), ("lse", lse),
                    ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        setattr(prm, name, x.data.ptr if x is not None else 0)
    return prm


#: The per-call pointer fields of :class:`~cupyflash.core.params.FwdParams`, in order.
POINTERS = ("q", "k", "v", "o", "lse", "cu_seqlens_q", "cu_seqlens_k")
_STRIDE_FIELDS = tuple(f"{t}_{s}_stride" for t in ("q", "k", "v", "o")
                       for s in ("batch", "row", "head")) + ("lse_batch_stride", "lse_head_stride")
_SIZE_FIELDS = ("batch", "nheads", "nheads_k", "h_per_kv", "seqlen_q", "seqlen_k", "headdim",
                "scale_log2", "softmax_scale_d", "window_left", "window_right")


def params_of(strides: tuple, sizes: tuple) -> FwdParams:
    """A :class:`~cupyflash.core.params.FwdParams` with the constant fields of
    :func:`args_template` (``strides``, ``sizes``) and NULL pointers."""
    prm = FwdParams()
    for name, x in zip(_STRIDE_FIELDS + _SIZE_FIELDS, tuple(strides) + tuple(sizes)):
        setattr(prm, name, x.item() if hasattr(x, "item") else x)
    return prm


def args_template(spec: jit.KernelSpec, q, k, v, out, lse_strides: tuple, *, problem,
                  varlen: bool) -> tuple:
    """``(strides, sizes)``: the constant fields of the kernel's parameter struct, which follow
    from the layouts and the problem (NumPy scalars, in the order of
    ``cf::FwdParams``: :func:`params_of` makes the struct), after checking the layouts the kernel
    relies on. ``lse_strides`` in elements; q, k, v, out need ``ndim``, ``strides``, ``dtype`` (and,
    only when a layout check fails, ``data.ptr`` for the message)."""
    cfg, causal = config_of(spec)
    nd = 3 if varlen else 4
    qs, ks, vs, os_ = (_strides(x, n, nd) for x, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out")))
    ls = tuple(lse_strides)
    if len(ls) != (2 if varlen else 3):
        raise ValueError(f"lse: expected {2 if varlen else 3} dims, got strides {ls}")
    for n, st in (("q", qs), ("k", ks), ("v", vs), ("out", os_), ("lse", ls)):
        if st[-1] != 1:
            raise ValueError(f"{n}: the last dimension must be contiguous (stride 1), got strides {st}")
    if bool(problem.causal) != causal:
        raise ValueError(f"spec: {spec.name} is {'causal' if causal else 'non-causal'} but the "
                         f"problem has causal={problem.causal}")
    if problem.headdim > cfg.headdim:
        raise ValueError(f"spec: {spec.name} is compiled for headdim <= {cfg.headdim}, "
                         f"got {problem.headdim}")
    if np.dtype(q.dtype).name != cfg.dtype:
        raise ValueError(f"q: dtype {np.dtype(q.dtype).name} does not match spec {spec.name}")
    if cfg.dtype in TC_DTYPES and any(s % 8 for st in (qs, ks, vs, os_) for s in st[:-1]):
        _check_alignment(spec, q, k, v, out)  # raises, naming the first bad array
    return fwd_fields(problem, (qs, ks, vs, os_), ls, varlen)


def fwd_fields(problem, strides4: tuple, lse_strides: tuple, varlen: bool) -> tuple:
    """``(strides, sizes)`` of :class:`~cupyflash.core.params.FwdParams` (its constant fields, in
    order; :func:`params_of` makes the struct) from the element strides of q, k, v, out
    (``strides4``) and of the LSE, and the problem: the forward's, and the backward's
    ``BwdParams.fwd`` (:mod:`cupyflash.backward.kernels`)."""
    qs, ks, vs, os_ = strides4
    ls = lse_strides
    if varlen:  # the batch strides are unused (cu_seqlens give each sequence's start row)
        strides = (0, qs[0], qs[1], 0, ks[0], ks[1], 0, vs[0], vs[1], 0, os_[0], os_[1],
                   0, ls[0])
    else:
        strides = qs[:3] + ks[:3] + vs[:3] + os_[:3] + ls[:2]
    left, right = checks.kernel_window(problem)  # unreachable bounds as -1: no int32 overflow
    scale = float(problem.softmax_scale)
    sizes = (np.int32(problem.batch), np.int32(problem.nheads), np.int32(problem.nheads_k),
             np.int32(problem.nheads // problem.nheads_k),
             np.int32(problem.seqlen_q), np.int32(problem.seqlen_k), np.int32(problem.headdim),
             np.float32(scale * _LOG2E), np.float64(scale),
             np.int32(left), np.int32(right))
    return tuple(np.int64(s) for s in strides), sizes


def check_pointers(spec: jit.KernelSpec, q, k, v, out) -> None:
    """The per-call layout check of :func:`kernel_params`: the tensor-core kernel's 16-byte
    ``cp.async`` loads need 16-byte aligned base pointers (ValueError naming the array)."""
    if (config_of(spec)[0].dtype in TC_DTYPES
            and (q.data.ptr | k.data.ptr | v.data.ptr | out.data.ptr) % 16):
        _check_alignment(spec, q, k, v, out)


def _check_alignment(spec, q, k, v, out) -> None:
    """ValueError for the first of q, k, v, out whose base pointer is not 16-byte aligned or
    whose strides (but the last) are not multiples of 8 elements (tensor-core kernels)."""
    check_tensor_core_layout({"q": q, "k": k, "v": v, "out": out})


def check_tensor_core_layout(named: dict) -> None:
    """The tensor-core kernels' 16-byte ``cp.async`` loads and 4-byte paired stores need 16-byte
    aligned bases and rows: ValueError naming the first array (of ``{name: array}``, None
    skipped; CuPy arrays or :class:`cupyflash.core.interop.ArrayDesc`) whose base pointer is not
    16-byte aligned or whose strides (but the last) are not multiples of 8 elements. Used by the
    forward and the backward."""
    for n, x in named.items():
        if x is None:
            continue
        st = _strides(x, n, x.ndim)
        if x.data.ptr % 16 or any(s % 8 for s in st[:-1]):
            raise ValueError(f"{n}: the tensor-core kernel needs a 16-byte aligned base and "
                             f"strides that are multiples of 8 elements; got pointer "
                             f"{x.data.ptr:#x} and strides {st}")


def launch(spec: jit.KernelSpec, q, k, v, out, lse, *, problem, cu_seqlens_q=None,
           cu_seqlens_k=None, stream=None) -> None:
    """Launch one prefill specialisation (FlashAttention-2 forward, arXiv 2307.08691 Alg. 1).

    Writes ``out`` (same layout and dtype as q) and ``lse`` (natural log, :func:`lse_dtype`:
    float32, float64 for float64; -inf for a row that sees no key, whose output is 0). Inputs are validated by cupyflash.core.checks
    before this is called; here only what the kernel itself relies on is checked (layouts,
    alignment, spec/problem agreement). The public calls launch through the launch cache
    (:mod:`cupyflash.forward.run`); this builds the same :func:`prepared_launch` each call.

    Parameters
    ----------
    spec : KernelSpec from :func:`kernel_spec` (its causal flag must equal ``problem.causal``).
    q, k, v, out, lse : cupy.ndarray; see :func:`kernel_params` for the layouts.
    problem : cupyflash.core.checks.AttnProblem.
    cu_seqlens_q, cu_seqlens_k : int32 cupy.ndarray (batch + 1,) for varlen, else None.
    stream : cupy.cuda.Stream or None (the current stream).

    Raises
    ------
    ValueError
        On a layout / alignment / spec mismatch, or a grid larger than CUDA allows.
    """
    import cupy
    cfg = config_of(spec)[0]
    num_sms = None
    if cfg.isa == "tma":
        num_sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    grid, block, smem = launch_config(spec, problem, num_sms)
    if grid[0] == 0 or grid[1] == 0 or grid[2] == 0:
        return  # nothing to compute (no query rows, heads or sequences)
    if grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"problem: nheads ({grid[1]}) and batch ({grid[2]}) must be <= 65535")
    varlen = cu_seqlens_q is not None
    if (cu_seqlens_k is not None) != varlen:
        raise ValueError("cu_seqlens_q, cu_seqlens_k: give both or neither")
    _check_lse(cfg, lse)
    strides, sizes = args_template(spec, q, k, v, out, _strides(lse, "lse", 2 if varlen else 3),
                                   problem=problem, varlen=varlen)
    check_pointers(spec, q, k, v, out)
    run = prepared_launch(spec, jit.get_kernel(spec), grid, block, smem, problem, strides, sizes,
                          cupy.cuda.runtime.getDevice())
    stream = stream or cupy.cuda.get_current_stream()
    cu = (cu_seqlens_q.data.ptr, cu_seqlens_k.data.ptr) if varlen else (0, 0)
    run(tuple(x.data.ptr for x in (q, k, v, out, lse)) + cu, stream.ptr)


def prepared_launch(spec: jit.KernelSpec, kern, grid, block, smem: int, problem, strides: tuple,
                    sizes: tuple, device_id: int):
    """The :class:`cupyflash.core.launch.Launch` of ``spec`` with its constant fields
    (:func:`args_template`'s ``strides`` and ``sizes``) set once; a call passes the 7 pointers
    (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k; 0 for NULL) and a stream handle. A plain
    launch (the prefill kernels do not wait for the previous kernel). TMA rows take a
    :class:`cupyflash.core.params.FwdTmaParams` whose tensor maps, scheduler counter (causal)
    and O-map flag the launch fills per call (:class:`cupyflash.core.tma.PrefillMaps`: an O map
    for dense problems of rows that store O by TMA, :attr:`PrefillConfig.o_store`, whose ``out``
    strides a map accepts), on device ``device_id`` (the current one)."""
    from ..core import launch
    fwd = params_of(strides, sizes)
    off, n = pointer_fields(FwdParams, POINTERS)
    cfg, causal = config_of(spec)
    if cfg.isa != "tma":
        return launch.Launch(kern, fwd, grid, block, pointers=(off, n), shared_mem=smem)
    from ..core import tma
    prm = FwdTmaParams()
    prm.fwd = fwd
    maps = tma.PrefillMaps(tma.qkv_maps_layout(problem, strides, cfg.block_m, cfg.block_n),
                           tma.o_map_layout(problem, strides) if cfg.o_store else None,
                           causal=causal, device_id=device_id)
    return launch.Launch(kern, prm, grid, block, pointers=(FwdTmaParams.fwd.offset + off, n),
                         shared_mem=smem, prepare=maps)
