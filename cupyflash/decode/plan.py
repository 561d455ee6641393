"""Planning of a decode call (pure unless asked to compile): the split count, tile and pipeline
depth, the launch geometry and workspace, the reasons for each choice, and ``explain_kvcache``.

:func:`launch_config` turns a validated :class:`cupyflash.core.checks.DecodeProblem` into a
:class:`DecodeLaunch` (what the call path of :mod:`cupyflash.decode` launches);
:func:`plan_decode` wraps it in a :class:`cupyflash.core.planning.Plan` with the ptxas report, and
:func:`explain_kvcache` applies the call's checks to the call's arguments first. The algorithm
(Flash-Decoding, Dao et al. 2023) and the measurements behind each choice:
:mod:`cupyflash.decode`, :mod:`cupyflash.decode.kernels`, :mod:`cupyflash.forward.heuristics` and
experiments/NOTES.md (the vN in the reasons).
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ..core import checks, deps, jit, planning
from .kernels import (_SHORT, DTYPES, GROUP, HEADDIMS, ONE_BLOCK_SPLIT_CONFIGS,
                             SPLIT_CONFIGS, append_kernel_spec, kv_path, padded_headdim,
                             split_config, split_kernel_spec, split_smem_bytes)
from ..core.planning import H200_SMS
from .heuristics import (TWO_STAGES_MIN_KEYS_PER_SPLIT,
                         TWO_STAGES_MIN_KEYS_SEVERAL_WAVES, choose_num_splits,
                         choose_split_stages)

__all__ = ["H200_SMEM_PER_SM", "H200_SMEM_PER_BLOCK_OPTIN", "DecodeLaunch", "REASON_TOPICS",
           "launch_config", "split_layout", "plan_decode", "explain_kvcache", "workspace_elems",
           "workspace_size"]

# Device limits of the H200 (the default target of the pure planning functions; the launch path
# reads the real ones from the device).
H200_SMEM_PER_SM = 233472          # 228 KiB
H200_SMEM_PER_BLOCK_OPTIN = 232448  # 227 KiB
_SMEM_RESERVED_PER_BLOCK = 1024     # the driver keeps 1 KiB per resident block

# ----------------------------------------------------------------------------------------------
# Heuristic and split layout (pure functions)
# ----------------------------------------------------------------------------------------------
def split_layout(seqlen: int, num_splits: int, block_n: int, split_tiles: int = 0) -> list:
    """Key ranges ``[(start, stop), ...]`` of each split of one sequence, as the split kernel
    computes them (one NumPy-free mirror of its index arithmetic, used by the CPU tests).

    ``split_tiles > 0`` (the fixed ``split_size`` mode): split ``s`` covers tiles
    ``[s * split_tiles, (s + 1) * split_tiles)``; otherwise ``ceil(tiles / num_splits)`` tiles per
    split, with ``tiles = ceil(seqlen / block_n)``. Ranges are clipped to ``seqlen``; trailing
    splits may be empty.
    """
    tiles = -(-seqlen // block_n)
    per = split_tiles if split_tiles > 0 else -(-tiles // num_splits)
    out = []
    for s in range(num_splits):
        t0 = min(s * per, tiles)
        t1 = min(t0 + per, tiles)
        out.append((min(t0 * block_n, seqlen), min(t1 * block_n, seqlen)))
    return out


# ----------------------------------------------------------------------------------------------
# Plan (explain)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DecodeLaunch:
    """How a :func:`cupyflash.decode.flash_attn_with_kvcache` call launches (the fields the
    launch code needs; :func:`plan_decode` turns it into a :class:`cupyflash.core.planning.Plan` for
    ``explain``).

    kernel, template : split-kernel specialisation name and its template values.
    spec : the split kernel's :class:`cupyflash.core.jit.KernelSpec`.
    grid, block, smem_bytes : launch shape of the split kernel (dynamic shared memory, bytes);
        grid ``(nheads_k * row_chunks, num_splits, batch)`` for contiguous caches (the kernel's
        grid_order 1), ``(num_splits, batch, nheads_k * row_chunks)`` for paged ones.
    registers, spill_bytes : from the ptxas report (None unless requested).
    num_splits : blocks along the key axis (grid y, paged: grid x).
    split_tiles : fixed tiles per split (``split_size`` mode), 0 = each sequence's tiles divided
        into ``num_splits`` equal parts.
    row_chunks : blocks per KV head along the query rows.
    append : name of the append kernel launched (None without new tokens). Several splits are
        merged by the split kernel itself (fused combine): there is no combine launch.
    workspace_elems : elements (4 bytes) of workspace used (0 with one split): the fp32
        partials, then ``counter_elems`` int32 arrival counters of the fused combine.
    counter_elems : int32 counters at the end of the workspace (``batch * nheads_k *
        row_chunks``; 0 with one split). They must be zero before a launch; each launch leaves
        them zero (see :func:`cupyflash.decode.alloc_workspace`).
    hbm_bytes, flops : I/O model at full cache capacity (cupyflash.io_model).
    reasons : why each choice was made / alternatives rejected.
    reason_topics : the topic of each reason (:data:`REASON_TOPICS`), same length.
    """
    kernel: str
    template: dict
    spec: jit.KernelSpec
    grid: tuple
    block: tuple
    smem_bytes: int
    num_splits: int
    split_tiles: int
    row_chunks: int
    append: str | None
    workspace_elems: int
    hbm_bytes: int
    flops: int
    reasons: tuple
    reason_topics: tuple = ()
    registers: int | None = None
    spill_bytes: int | None = None
    counter_elems: int = 0


#: Topics of the reasons :func:`launch_config` gives (``Plan.reasons`` pairs them with the text):
#: the split count and how the splits merge; the tile (head-dim padding, tile shape, query-row
#: blocks); the pipeline depth; how Q and paged K/V are copied; everything else.
REASON_TOPICS = ("num_splits", "tile", "stages", "copies", "note")


def _check_split_size(split_size) -> None:
    if split_size is not None and (not checks._is_int(split_size) or split_size < 1):
        raise ValueError(f"split_size: expected an int >= 1 (keys per split) or None, got "
                         f"{split_size!r}")


def launch_config(problem: checks.DecodeProblem, *, split_size: int | None = None,
                  num_sms: int = H200_SMS, smem_per_sm: int = H200_SMEM_PER_SM,
                  max_smem_per_block: int = H200_SMEM_PER_BLOCK_OPTIN,
                  ptxas_arch: str | None = None) -> DecodeLaunch:
    """The launch configuration of a validated decode problem (pure unless ``ptxas_arch``).

    Parameters
    ----------
    problem : checks.DecodeProblem
        From :func:`cupyflash.core.checks.check_kvcache`.
    split_size : int or None
        Fixed keys per split (rounded up to a multiple of the tile's ``block_n``); overrides
        ``problem.num_splits``.
    num_sms, smem_per_sm, max_smem_per_block : int
        Device limits (H200 defaults; the launch path passes the current device's).
    ptxas_arch : str or None
        If given (e.g. ``"sm_90a"``), compile the split kernel with NVRTC and fill ``registers``
        and ``spill_bytes`` from the ptxas report (no GPU needed).

    Returns
    -------
    DecodeLaunch

    Raises
    ------
    TypeError
        Unsupported dtype (float32/float64: no tensor-core decode path).
    ValueError
        ``split_size`` not a positive int; no stage count fits the device's shared memory;
        a grid dimension over its limit: contiguous caches launch (nheads_k * row chunks,
        num_splits, batch), paged caches (num_splits, batch, nheads_k * row chunks), with y and
        z at most 65535.
    """
    p = problem
    reasons, topics = [], []

    def why(topic: str, text: str) -> None:  # topic: one of REASON_TOPICS
        reasons.append(text)
        topics.append(topic)

    hd = padded_headdim(p.headdim)
    if hd != p.headdim:
        why("tile", f"headdim {p.headdim} runs in the hd{hd} kernel (padding columns are "
                    "zero-filled in shared memory, not read)")
    cfg = split_config(hd)
    rows = (p.nheads // p.nheads_k) * p.seqlen_q
    row_chunks = -(-rows // GROUP)
    unsplit_ctas = p.batch * p.nheads_k * row_chunks
    two_fit = smem_per_sm // (split_smem_bytes(p.dtype, hd, SPLIT_CONFIGS[hd].block_n,
                                               SPLIT_CONFIGS[hd].stages)
                              + _SMEM_RESERVED_PER_BLOCK) >= 2
    several_waves = False
    if cfg != SPLIT_CONFIGS[hd] and unsplit_ctas > num_sms and split_size is None \
            and p.num_splits == 0 and two_fit:
        several_waves = True
        # several waves of blocks even unsplit: two blocks per SM overlap one block's first
        # copies with the other's stream (heuristic mode only: an explicit num_splits or
        # split_size keeps the tile, so a row's result does not depend on the batch) (H200, v9 sweep, hd128: b64 x 1k 72.1 vs 78.1 us,
        # b64 x 2k 130.2 vs 135.0, paged page 16 134.2 vs 145.8, b64 x 16k 4.53 vs 4.52 TB/s)
        why("tile", f"{unsplit_ctas} blocks (batch x nheads_k x row_chunks) > {num_sms} SMs: "
                    f"the {SPLIT_CONFIGS[hd].block_n}-key tile, two blocks per SM")
        cfg = SPLIT_CONFIGS[hd]
    if split_smem_bytes(p.dtype, hd, cfg.block_n, 2) > max_smem_per_block and \
            cfg != SPLIT_CONFIGS[hd]:
        why("tile", f"the {cfg.block_n}-key one-block tile does not fit the device's "
                    f"{max_smem_per_block} bytes of shared memory per block: using the "
                    f"{SPLIT_CONFIGS[hd].block_n}-key tile")
        cfg = SPLIT_CONFIGS[hd]
    stages = cfg.stages
    while stages > 2 and split_smem_bytes(p.dtype, hd, cfg.block_n, stages) > max_smem_per_block:
        stages -= 1
    if stages != cfg.stages:
        why("stages", f"{cfg.stages} stages need more than the device's {max_smem_per_block} "
                      f"bytes of shared memory per block: using {stages}")
    smem = split_smem_bytes(p.dtype, hd, cfg.block_n, stages)
    if smem > max_smem_per_block:
        raise ValueError(f"headdim: the hd{hd} decode kernel needs {smem} bytes of shared memory, "
                         f"the device allows {max_smem_per_block}")
    ctas_per_sm = max(1, smem_per_sm // (smem + _SMEM_RESERVED_PER_BLOCK))
    # Blocks per SM that the split count fills (heuristics.choose_num_splits, measured): one for
    # contiguous caches and for the one-block tiles; two (where they fit) for paged caches with
    # the other tiles (hd64, hd256 and the small-shared-memory fallback; measured before the page
    # ids moved to cp.async, not re-measured since).
    fill_per_sm = 1 if cfg == ONE_BLOCK_SPLIT_CONFIGS.get(hd) or not p.paged \
        else min(2, ctas_per_sm)
    if several_waves:
        fill_per_sm = 2
    if row_chunks > 1:
        why("tile", f"{rows} query rows per KV head (GQA {p.nheads // p.nheads_k} x seqlen_q "
                    f"{p.seqlen_q}) > {GROUP}: {row_chunks} blocks per KV head, each reads "
                    "the KV tiles (the repeats mostly from L2)")
    tiles_cap = -(-p.seqlen_cache // cfg.block_n)
    split_tiles = 0
    if split_size is not None:
        _check_split_size(split_size)
        split_tiles = -(-int(split_size) // cfg.block_n)
        num_splits = max(1, -(-tiles_cap // split_tiles))
        if p.num_splits >= 1:
            why("num_splits", f"num_splits={p.num_splits} ignored: split_size fixes the splits")
        why("num_splits", f"split_size={split_size}: {split_tiles} "
                          f"tile{'s' if split_tiles != 1 else ''} "
                          f"({split_tiles * cfg.block_n} keys) per split, {num_splits} splits "
                          f"cover the capacity {p.seqlen_cache}; a row's result does not depend "
                          "on the batch")
    elif p.num_splits >= 1:
        num_splits = p.num_splits
        why("num_splits", f"num_splits={num_splits} as given"
                          + (f" ({num_splits - tiles_cap} of them empty at capacity: "
                             f"{tiles_cap} tiles of {cfg.block_n} keys; empty splits cost a "
                             "block each and change no result)"
                             if num_splits > tiles_cap else ""))
    else:
        layout = "paged" if p.paged else "contiguous"
        num_splits = choose_num_splits(p.batch, p.nheads_k, p.seqlen_cache, num_sms,
                                       row_chunks=row_chunks, block_n=cfg.block_n,
                                       ctas_per_sm=fill_per_sm)
        why("num_splits", f"num_splits=0: heuristic: {p.batch * p.nheads_k * row_chunks} blocks "
                          f"(batch x nheads_k x row_chunks) for {num_sms * fill_per_sm} slots "
                          f"({num_sms} SMs x {fill_per_sm} block{'s' if fill_per_sm > 1 else ''}"
                          f" per SM, {layout} cache), {tiles_cap} "
                          f"tile{'s' if tiles_cap != 1 else ''} of {cfg.block_n} keys at capacity "
                          f"-> {num_splits} split{'s' if num_splits != 1 else ''}")
    one_block = cfg == ONE_BLOCK_SPLIT_CONFIGS.get(hd)
    depth = choose_split_stages(stages, headdim=hd, paged=p.paged, several_waves=several_waves,
                                one_block=one_block, seqlen_k=p.seqlen_cache,
                                num_splits=num_splits, block_n=cfg.block_n,
                                split_tiles=split_tiles)
    if depth != stages:
        if several_waves:
            cause = (f"several waves at capacity {p.seqlen_cache} >= "
                     f"{TWO_STAGES_MIN_KEYS_SEVERAL_WAVES} keys: one tile in flight per block, "
                     "64 KB per SM at two blocks")
        else:
            cause = (f">= {TWO_STAGES_MIN_KEYS_PER_SPLIT} keys per split at capacity: 64 KB of "
                     "copies in flight per SM")
        why("stages", f"{depth} K/V stages instead of {stages} (contiguous cache, {cause}; "
                      "heuristics.choose_split_stages, v24-v27; bitwise the same output)")
        stages = depth
        smem = split_smem_bytes(p.dtype, hd, cfg.block_n, stages)
    elif p.paged and choose_split_stages(
            stages, headdim=hd, paged=False, several_waves=several_waves, one_block=one_block,
            seqlen_k=p.seqlen_cache, num_splits=num_splits, block_n=cfg.block_n,
            split_tiles=split_tiles) != stages:
        why("stages", f"{stages} K/V stages kept: a contiguous cache of this shape would take "
                      "2, but on paged caches fewer bytes in flight measured slower (pages of "
                      "16, v25, v28; heuristics.choose_split_stages)")
    spec = split_kernel_spec(p.dtype, hd, p.paged, block_n=cfg.block_n, nwarps=cfg.nwarps,
                             stages=stages, page_size=_kv_page_size(p))
    if p.paged:
        why("copies", _page_copy_reason(hd, p.page_size, p.page_offsets_fit_i32))
    if p.q_aligned16:
        why("copies", "q: the Q tile by 16-byte cp.async beside the length (v44); a q whose "
                      "pointer or strides are not 16-byte multiples would take 2-byte loads")
    else:
        why("copies", "q: its strides (or pointer) are not 16-byte multiples: the Q tile by "
                      "2-byte loads after the K/V copies instead of 16-byte cp.async (bitwise "
                      "the same result; up to 5 us slower at short caches, v44); a contiguous "
                      "q avoids it")
    ws = counters = 0
    if num_splits > 1:
        counters = p.batch * p.nheads_k * row_chunks
        ws = workspace_elems(p.batch, p.seqlen_q, p.nheads, p.headdim, num_splits) + counters
        why("num_splits", f"{num_splits} splits: the last split block of each (batch, KV head, row "
                          "chunk) merges the partials (fused combine; arrival counters in the "
                          "workspace, or in a zero buffer kept per stream when none is passed)")
    else:
        why("num_splits", "one split: the split kernel writes the output directly (no combine)")
    append = append_kernel_spec(p.paged).name if p.seqlen_new > 0 else None
    from .. import io_model
    hbm = io_model.decode_hbm_bytes(p.batch, p.nheads, p.nheads_k, p.seqlen_cache, p.headdim,
                                    p.dtype, num_splits, p.seqlen_q, p.page_size)
    flops = io_model.decode_flops(p.batch, p.nheads, p.seqlen_cache, p.headdim, p.seqlen_q,
                                  p.causal)
    why("note", "bytes/FLOPs at full capacity: cache_seqlens are not read when planning")
    grid = _split_grid(p.paged, num_splits, p.batch, p.nheads_k * row_chunks)
    if _grid_order(p.paged):
        names = ("nheads_k * row chunks", "num_splits", "batch")
        why("note", f"grid {grid}: (KV-head blocks, splits, batch), the KV heads of one key "
                    "range launched together (contiguous cache; v16)")
    else:
        names = ("num_splits", "batch", "nheads_k * row chunks")
        why("note", f"grid {grid}: (splits, batch, KV-head blocks) (paged cache; v16)")
    for axis, (n, limit, name) in enumerate(zip(grid, (2 ** 31 - 1, 65535, 65535), names)):
        if n > limit:
            raise ValueError(f"{name}: {n} exceeds {limit}, the limit of the split kernel's grid "
                             f"dimension {'xyz'[axis]} ({'paged' if p.paged else 'contiguous'} "
                             f"cache)")
    why("note", "vN in these lines: the experiment of that name in experiments/NOTES.md")
    why("note", "launch: programmatic dependent launch on sm_90+ (append and split kernels), "
                "unless cupyflash.decode.PDL is False or CUPYFLASH_PDL=0")
    regs = spill = None
    if ptxas_arch is not None:
        rep = jit.compile_report(spec, ptxas_arch).ptxas
        regs, spill = rep.registers, rep.spill_bytes
    return DecodeLaunch(
        kernel=spec.name,
        template=dict(dtype=p.dtype, headdim=hd, block_n=cfg.block_n, nwarps=cfg.nwarps,
                      group=GROUP, stages=stages, paged=p.paged),
        spec=spec,
        grid=grid,
        block=(cfg.nwarps * 32, 1, 1),
        smem_bytes=smem, num_splits=num_splits, split_tiles=split_tiles, row_chunks=row_chunks,
        append=append, workspace_elems=ws, hbm_bytes=int(hbm), flops=int(flops),
        reasons=tuple(reasons), reason_topics=tuple(topics), registers=regs, spill_bytes=spill,
        counter_elems=counters)


def _kv_page_size(p) -> int | None:
    """The ``page_size`` that :func:`cupyflash.decode.kernels.kv_path` sees for problem ``p``:
    None (no copy pointers) for contiguous caches and for pools whose page offsets need more than
    32 bits."""
    return p.page_size if p.paged and p.page_offsets_fit_i32 else None


def _page_copy_reason(headdim: int, page_size: int, offsets_fit_i32: bool = True) -> str:
    """The explain() line saying how a paged cache's K/V copies find their pages (v20)."""
    if headdim <= 128 and page_size & (page_size - 1) == 0 and not offsets_fit_i32:
        return (f"page_size {page_size}: a page stride or page_size x row stride of k_cache or "
                "v_cache is negative or >= 2^31 elements: the general paged path (page ids "
                "per key row, 64-bit offsets), slower than copy pointers (v20)")
    if kv_path(headdim, True, page_size) == "paged_copy_pointers":
        return (f"page_size {page_size} (a power of two): copy pointers, one page id per page "
                "of a tile, addresses by shift and mask (v20)")
    if headdim > 128:
        return (f"hd{headdim} paged: the general paged path (page ids per key row, or one per "
                "tile for pages of whole tiles); copy pointers would spill registers at hd256")
    return (f"page_size {page_size} is not a power of two: page ids per key row and a division "
            "per row, slower (v20 measured the two paths on pages of 16: per-row 14.2 vs "
            "power-of-two 11.3 us at b1 x 8k, 21.1 vs 20.5 at b16 x 1k)")


def _grid_order(paged: bool) -> int:
    """The split kernel's block order on the public path: heads first (1) for contiguous caches,
    (splits, batch, heads) (0) for paged ones (v16 outcome, experiments/NOTES.md: heads first is
    1-1.5% faster at b64 x 1k-2k contiguous but 0.5-2.8% slower with pages of 16 and 256)."""
    return 0 if paged else 1


def _split_grid(paged: bool, num_splits: int, batch: int, head_blocks: int) -> tuple:
    """The split kernel's grid in :func:`_grid_order` (``head_blocks = nheads_k * row_chunks``)."""
    if _grid_order(paged):
        return (head_blocks, num_splits, batch)
    return (num_splits, batch, head_blocks)


def plan_decode(problem: checks.DecodeProblem, *, split_size: int | None = None,
                arch: str | None = None, report: bool = True, num_sms: int | None = None,
                smem_per_sm: int | None = None, max_smem_per_block: int | None = None):
    """The :class:`cupyflash.core.planning.Plan` of a decode problem (what ``explain`` returns).

    ``kernel`` is the split kernel (it also merges the splits: fused combine);
    ``extra_kernels`` the append (if new tokens); ``reasons`` holds the ``(topic, why)`` pairs
    of :func:`launch_config` (topics :data:`REASON_TOPICS`: the split count, tile, pipeline
    depth, how Q and paged K/V are copied, and notes); ``rejected`` lists the other decode
    specialisations with the reason.

    Parameters
    ----------
    problem : checks.DecodeProblem
    split_size : int or None
        As in :func:`cupyflash.decode.flash_attn_with_kvcache`.
    arch : str or None
        Architecture of the ptxas report; default the current device's, else ``"sm_90a"``.
        ``sm_80`` or newer (:func:`cupyflash.core.planning.check_arch`: TypeError / ValueError).
    report : bool
        Compile with NVRTC (no GPU needed) and fill registers / spills.
    num_sms, smem_per_sm, max_smem_per_block : int or None
        Device limits; default the current device's, else the H200's (132 SMs), with the shared
        memory of ``arch`` when one other than sm_90/sm_90a is named.
    """
    if not isinstance(problem, checks.DecodeProblem):
        raise TypeError(f"problem: expected cupyflash.core.checks.DecodeProblem, got "
                        f"{type(problem).__name__}")
    planning.check_arch(arch)
    lim = _planning_limits(arch)
    planning.check_device_limits(num_sms=num_sms, smem_per_sm=smem_per_sm,
                                 max_smem_per_block=max_smem_per_block)
    h200_assumed = lim.get("assumed", False) and num_sms is None  # said in the plan's notes
    num_sms = lim["num_sms"] if num_sms is None else num_sms
    smem_per_sm = lim["smem_per_sm"] if smem_per_sm is None else smem_per_sm
    max_smem_per_block = lim["max_smem_per_block"] if max_smem_per_block is None \
        else max_smem_per_block
    arch = planning.default_arch() if arch is None else arch
    la = launch_config(problem, split_size=split_size, num_sms=num_sms, smem_per_sm=smem_per_sm,
                       max_smem_per_block=max_smem_per_block)
    p = problem
    t = la.template

    def choice(spec, grid, block, smem):
        regs = spill = None
        if report:
            rep = jit.compile_report(spec, arch).ptxas
            regs, spill = rep.registers, rep.spill_bytes
        return planning.KernelChoice(name=spec.name, entry=spec.entry, template=tmpl(spec),
                                     grid=grid, block=block, smem_bytes=smem, registers=regs,
                                     spill_bytes=spill, arch=arch if report else None, spec=spec)

    def tmpl(spec):
        return dict(t) if spec.name == la.kernel else {"dtype": p.dtype}

    main = choice(la.spec, la.grid, la.block, la.smem_bytes)
    extra = []
    if la.append is not None:
        n = p.seqlen_new * p.nheads_k * p.headdim
        extra.append(choice(append_kernel_spec(p.paged), (-(-n // 256), p.batch, 1), (256, 1, 1),
                            0))
    rejected = []
    for dt in DTYPES:
        for hd in HEADDIMS:
            for pg in (False, True):
                ps = _kv_page_size(p) if pg else None
                spec = split_kernel_spec(dt, hd, pg, page_size=ps)
                if spec.name == la.kernel or (dt, hd, pg) == (p.dtype, t["headdim"], p.paged):
                    continue
                if dt != p.dtype:
                    why = f"dtype {dt} != {p.dtype}"
                elif pg != p.paged:
                    why = "paged cache (block_table given)" if p.paged else "contiguous cache"
                elif hd < p.headdim:
                    why = f"headdim {p.headdim} > {hd}"
                else:
                    why = f"hd{t['headdim']} is the smallest compiled head dim >= {p.headdim}"
                rejected.append((spec.name, why))
    rejected.sort(key=lambda r: (not r[0].startswith(f"decode_split_{_SHORT[p.dtype]}"), r[0]))
    notes = list(zip(la.reason_topics, la.reasons))
    if h200_assumed:
        notes.append(planning.h200_assumed_note(num_sms))
    return planning.Plan(problem=p, kernel=main, num_splits=la.num_splits, flops=la.flops,
                         hbm_bytes=la.hbm_bytes, rejected=rejected, reasons=notes,
                         extra_kernels=tuple(extra), num_sms=num_sms,
                         workspace_elems=la.workspace_elems)


def explain_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
                    softmax_scale=None, causal=True, num_splits=0, return_lse=False, out=None,
                    split_size=None, validate=False, workspace=None, *, arch=None, report=True,
                    num_sms=None):
    """The :class:`cupyflash.core.planning.Plan` of a :func:`cupyflash.decode.flash_attn_with_kvcache`
    call, without running it (accepts NumPy or CUDA arrays): the call's arguments, in the call's
    order, then keyword-only ``arch``, ``report`` and ``num_sms``.

    Raises what the call raises for bad shapes, dtypes, layouts (a last dimension that is not
    contiguous, cache row strides that are not 16-byte multiples; a host array's pointer is not
    checked), options, ``return_lse`` and a ``workspace`` of the wrong dtype, size or layout.
    The values of ``cache_seqlens`` and ``block_table`` (negative lengths, lengths over the
    capacity, page ids outside the pool: :func:`cupyflash.core.checks.check_kvcache_values`) are
    checked as the call checks them when they are host arrays (NumPy; reading them costs no
    synchronisation); CUDA arrays only with ``validate=True`` (the call's default, here
    ``False``). ``arch`` and ``num_sms``: see :func:`plan_decode` (without a GPU: an H200's 132
    SMs unless ``num_sms`` is given; ``arch`` must name sm_80 or newer).

    Raises
    ------
    TypeError, ValueError
        As :func:`cupyflash.decode.flash_attn_with_kvcache` (the message names the argument and
        what was expected), and :func:`plan_decode`'s for ``arch`` and ``num_sms``.
    """
    cache_seqlens = checks.lengths_from_host(cache_seqlens, q)  # an int or a list of ints
    prob = checks.check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                softmax_scale=softmax_scale, causal=causal,
                                num_splits=num_splits, out=out, dtypes=DTYPES, validate=validate)
    if not validate and cache_seqlens is not None and not checks.is_device_array(cache_seqlens):
        checks.check_kvcache_values(prob, cache_seqlens, block_table)  # host arrays: free
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                    ("out", out)):  # the kernels' layout rule, for host arrays too
        if x is not None:
            checks.check_last_dim_contiguous(x, name)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):  # the call's row alignment
        st = checks.element_strides(c)
        if st is not None:
            _check_row_strides(c.shape, tuple(v * np.dtype(prob.dtype).itemsize for v in st),
                               name)
    _check_split_size(split_size)
    plan = plan_decode(prob, split_size=split_size, arch=arch, report=report, num_sms=num_sms)
    if workspace is not None and plan.workspace_elems:
        _check_workspace(workspace, plan.workspace_elems)
    return plan


def _check_workspace(workspace, need: int) -> None:
    """A caller's workspace for a plan that uses ``need`` float32 elements: float32, C-contiguous,
    at least ``need`` elements (NumPy, CuPy or any array with ``dtype``/``size``/``flags``)."""
    if checks.dtype_name(workspace) != "float32":
        raise TypeError(f"workspace: expected float32, got {checks.dtype_name(workspace)}")
    flags = getattr(workspace, "flags", None)
    contiguous = flags is None or bool(flags.c_contiguous)
    if workspace.size < need or not contiguous:
        raise ValueError(f"workspace: expected a contiguous float32 array of at least "
                         f"{need} elements (workspace_size), got shape {workspace.shape}")


def workspace_elems(batch: int, seqlen_q: int, nheads: int, headdim: int, num_splits: int) -> int:
    """float32 elements of the split partials: each split's unnormalised accumulator (num_splits,
    batch, seqlen_q, nheads, headdim) followed by its raw row max and sum (num_splits, batch,
    nheads, seqlen_q, 2: ``kernels_cu/decode/split.cu``); 0 for one split.
    The workspace of :func:`cupyflash.decode.flash_attn_with_kvcache` has ``batch * nheads_k *
    row_chunks`` int32 counters after them (:attr:`DecodeLaunch.counter_elems`,
    :func:`cupyflash.decode.workspace_size`)."""
    if num_splits <= 1:
        return 0
    return num_splits * batch * seqlen_q * nheads * (headdim + 2)


def workspace_size(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
                   *, num_splits=0, split_size=None) -> int:
    """float32 elements of workspace that :func:`cupyflash.decode.flash_attn_with_kvcache`
    needs for these arguments (0 when it runs as one split): the fp32 partials
    (:func:`workspace_elems`), then ``batch * nheads_k * ceil(nheads // nheads_k * seqlen_q /
    16)`` int32 arrival counters of the fused combine, which must be zero before the first call
    (see :func:`cupyflash.decode.alloc_workspace`). Reads shapes only (``validate=False``) and,
    for CUDA arrays, the current device's SM count and shared memory; for host (NumPy) arrays it
    plans for an H200 even when a GPU is present (sizing offline). A workspace sized for another
    GPU than the one that runs the call may be too small: the call then raises ValueError before
    launching.

    Raises
    ------
    TypeError, ValueError
        The shape, dtype and option errors of :func:`cupyflash.core.checks.check_kvcache`, a bad
        ``split_size``.
    """
    cache_seqlens = checks.lengths_from_host(cache_seqlens, q)
    prob = checks.check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                num_splits=num_splits, dtypes=DTYPES, validate=False)
    # host arrays: plan for an H200 (no device is touched)
    on_device = any(checks.is_device_array(x) for x in (q, k_cache, v_cache))
    return _resolve_plan(prob, split_size, use_device=on_device).workspace_elems


# ----------------------------------------------------------------------------------------------
# GPU helpers
# ----------------------------------------------------------------------------------------------
def _device_limits() -> dict:
    cupy = deps.cupy()
    return _device_limits_of(cupy.cuda.Device().id)


def _planning_limits(arch: str | None = None, use_device: bool = True) -> dict:
    """The limits a plan is made for: the current device's when ``use_device`` and a GPU is
    visible; otherwise an H200's (132 SMs, 227 KiB per block), with the shared memory of
    ``arch`` when an architecture other than sm_90/sm_90a is named."""
    if use_device:
        try:
            return _device_limits()
        except Exception:  # no CuPy / no device
            pass
    lim = dict(num_sms=H200_SMS, smem_per_sm=H200_SMEM_PER_SM,
               max_smem_per_block=H200_SMEM_PER_BLOCK_OPTIN, assumed=True)
    if arch is not None and arch not in ("sm_90", "sm_90a"):
        lim["max_smem_per_block"] = planning.max_smem_bytes_for_arch(arch)
        lim["smem_per_sm"] = lim["max_smem_per_block"] + _SMEM_RESERVED_PER_BLOCK
    return lim


@functools.lru_cache(maxsize=None)
def _device_limits_of(dev_id: int) -> dict:
    cupy = deps.cupy()
    a = cupy.cuda.Device(dev_id).attributes
    return dict(num_sms=a["MultiProcessorCount"],
                smem_per_sm=a["MaxSharedMemoryPerMultiprocessor"],
                max_smem_per_block=a["MaxSharedMemoryPerBlockOptin"])


def _check_row_strides(shape, strides, name: str, ptr: int | None = None) -> None:
    """The split kernel copies 16-byte chunks of each cache row: rows must be 16-byte aligned
    (``strides`` in bytes; ``ptr`` the data pointer, None on the host)."""
    if (ptr is not None and ptr % 16 != 0) or not checks.rows_aligned16(shape, strides):
        where = f"pointer {ptr:#x}, " if ptr is not None else ""
        raise ValueError(f"{name}: rows must be 16-byte aligned for the decode kernel ({where}"
                         f"strides {tuple(strides)} bytes); pass a contiguous cache")


def _resolve_plan(prob, split_size, use_device=True):
    """The plan on the current device, or an H200's without ``use_device`` (cached: the
    per-call host cost stays small)."""
    _check_split_size(split_size)
    lim = _planning_limits(use_device=use_device)
    return _plan_cached(prob, split_size, lim["num_sms"], lim["smem_per_sm"],
                        lim["max_smem_per_block"])


@functools.lru_cache(maxsize=1024)
def _plan_cached(prob, split_size, num_sms, smem_per_sm, max_smem_per_block):
    return launch_config(prob, split_size=split_size, num_sms=num_sms, smem_per_sm=smem_per_sm,
                         max_smem_per_block=max_smem_per_block)

