"""Launch heuristics: pure functions of the problem's sizes (no GPU, no CuPy, no state).

Every threshold carries, next to it, the measurement that justifies it. Thresholds marked
"provisional" have not been measured yet; ``experiments/bench_tiles.py`` times every tile of the
supported table (``cupyflash.forward.kernels.SUPPORTED``) over the shapes below, and the lead replaces
each "provisional" note with the measured numbers (GPU, run, speed-up) when they exist.

Prefill (FlashAttention-2, arXiv 2307.08691, Sec. 3.2-3.3): one CTA per (``block_m`` query rows,
head, batch). A larger ``block_m`` reuses every K/V tile for more query rows (fewer bytes per FLOP)
but makes fewer CTAs, and a tile taller than the sequence computes padding rows.

Decode heuristics: :mod:`cupyflash.decode.heuristics`.
"""
from __future__ import annotations

from ..core.planning import H200_SMS
from . import kernels

__all__ = ["prefill_tiles", "choose_prefill_tile"]


def _is_int(x) -> bool:
    """A Python or NumPy integer, not a bool (pure: no NumPy import needed)."""
    return hasattr(x, "__index__") and not isinstance(x, bool) and type(x).__name__ != "bool_"


def prefill_tiles(dtype: str, headdim: int, arch: str = "sm_90a") -> tuple:
    """The compiled ``(block_m, block_n, nwarps, isa)`` tiles for ``dtype`` and ``headdim`` that
    ``arch`` runs, default first (``isa``: ``"tma"`` rows run on sm_90a only).

    Parameters
    ----------
    dtype : str
        ``'float16'``, ``'bfloat16'``, ``'float32'`` or ``'float64'``.
    headdim : int
        Actual head dim (a multiple of 8 up to 256); each instruction set's rows at its own
        padded head dim (:func:`cupyflash.forward.kernels.configs_for`: 72 runs as 128 on the TMA
        kernel and as 96 on the mma.sync kernel).
    arch : str
        Target architecture, ``"sm_90a"`` (H100/H200) by default.

    Returns
    -------
    tuple of (int, int, int, str)
        In the order of :func:`cupyflash.forward.kernels.configs_for` (above hd32 the TMA rows first,
        at hd32 and below after the mma.sync rows; within a kernel
        ``cupyflash.forward.kernels.SUPPORTED``'s order; the first is the suggested default); empty
        when nothing is compiled for the pair.

    Raises
    ------
    ValueError
        ``headdim`` not a multiple of 8 in [8, 256].
    """
    return tuple((c.block_m, c.block_n, c.nwarps, c.isa)
                 for c in kernels.configs_for(dtype, headdim) if c.arch in ("", arch))


_SHORT_TILE = (64, 64, 4, "mma")


def _first_with_block_m(tiles, block_m):
    return next(t for t in tiles if t[0] == block_m)


def choose_prefill_tile(dtype: str, headdim: int, seqlen_q: int, seqlen_k: int, causal: bool,
                        num_sms: int = H200_SMS, *, batch_nheads: int = 1,
                        tiles: tuple | None = None) -> tuple:
    """Tile ``(block_m, block_n, nwarps, isa)`` of the prefill kernel for one problem.

    Rules, in order (each one's evidence is in the comment beside it in the code):

    1. Start from the table's default tile for (dtype, padded headdim).
       1b. Head dims up to 32 on the mma.sync kernel, ``seqlen_k`` up to 256 (1024 when causal):
       the 64 x 64 x 4-warp tile.
    2. Short queries: ``seqlen_q`` no longer than the smallest compiled ``block_m`` -> the first
       tile with that smallest ``block_m`` (a tile that has it already, rule 1b's, is kept).
    3. Under-filled GPU: if the default makes fewer CTAs (``batch_nheads * ceil(seqlen_q /
       block_m)``) than ``num_sms``, step down to the next smaller compiled ``block_m``.
       3b. The TMA kernel's 192-row tile (hd64), causal, ``seqlen_k`` up to 1024: its 128-row
       tile.
       3c. Padding: a tile of the same kernel with fewer rows that makes no more m-blocks (the
       TMA kernel's 128 rows instead of 192 for ``seqlen_q`` up to 128, or 193-256; measured).
    4. Short keys: ``seqlen_k`` no longer than a smaller compiled ``block_n`` of the chosen
       ``block_m`` -> the smallest such ``block_n`` (same ``nwarps`` and ``isa`` if compiled).

    ``causal`` changes the choice at head dims up to 32 (rule 1b) and at head dims 40-64 on the
    TMA kernel (padded onto its hd64 rows: rule 3b), both measured: elsewhere causal launches
    skip whole tiles above the diagonal with any tile shape.

    Parameters
    ----------
    dtype : str
        Element type name.
    headdim : int
        Actual head dim (padded internally).
    seqlen_q, seqlen_k : int
        Query / key lengths (``max_seqlen_*`` for varlen), >= 0.
    causal : bool
        Causal mask (bottom-right).
    num_sms : int
        Streaming multiprocessors of the device (132 on an H100/H200 SXM).
    batch_nheads : int
        ``batch * nheads``: the CTAs per m-block row of the grid.
    tiles : tuple of (int, int, int, str), optional
        The candidates ``(block_m, block_n, nwarps, isa)``, default first; default
        :func:`prefill_tiles` ``(dtype, headdim)`` (sm_90a). The dispatcher passes the subset
        the device runs and whose shared memory fits it.

    Returns
    -------
    tuple of (int, int, int, str)
        ``(block_m, block_n, nwarps, isa)``, a row of ``cupyflash.forward.kernels.SUPPORTED``.

    Raises
    ------
    ValueError
        No tile compiled for ``(dtype, headdim)``, or negative sizes.
    """
    if seqlen_q < 0 or seqlen_k < 0 or num_sms < 1 or batch_nheads < 0:
        raise ValueError(f"sizes: expected seqlen_q, seqlen_k, batch_nheads >= 0 and num_sms >= 1, "
                         f"got {seqlen_q}, {seqlen_k}, {batch_nheads}, {num_sms}")
    tiles = prefill_tiles(dtype, headdim) if tiles is None else tuple(tiles)
    if not tiles:
        raise ValueError(f"dtype: no prefill tile available for dtype {dtype!r} and headdim "
                         f"{headdim}")
    # Rule 1: the table's first row (cupyflash/forward/kernels.py _TC_TILES). bf16/fp16 hd96 and hd128:
    # 128x64x4w, measured fastest by the v1 tile sweep (H200, 16k tokens, S = 4096 /
    # 16384, experiments/NOTES.md): hd128 non-causal 312-321 TFLOP/s vs 292-299 (128x32x4) and
    # 256-262 (128x64x8); hd128 causal 258-281, the best tile at S = 4096 and 0.7% behind
    # 128x128x8 (283) at S = 16384, too small a gap for a causal-specific rule; hd96 296-304
    # vs 234-259 for every other tile, causal 277-302 vs <= 251. hd64 keeps 128x64x4w (305-314).
    # (128x64x8 and 128x128x8 left the table on 2026-12-02: never chosen; bench_tiles --extra.)
    # Not adopted (and removed from the kernel): hd64 causal with 3 K/V stages: +0.2-2% causal
    # (280 vs 277 at S = 4096, 304 vs 303 bf16 / 303 vs 297 fp16 at S = 16384) but -1.5%
    # non-causal.
    # On sm_90a the TMA rows (kernels._TMA_TILES, the Hopper TMA kernel) come first for every
    # head dim above kernels.TMA_FIRST_ABOVE (32; padded onto 64, 128, 256) and are taken by this
    # rule; v50 and v60 in experiments/NOTES.md have their measurements.
    tile = tiles[0]                                              # rule 1
    block_ms = sorted({t[0] for t in tiles})
    # Rule 1b: head dims up to 32 (the mma.sync hd32 rows), keys up to 256, or up to 1024 when
    # causal (the lengths measured): 64x64x4w.
    # Measured (bench_tiles, H200, fp16, 24 sequences x 12 heads, 2026-12-01, recorded in 28aa8d4,
    # results-archive-2026-12-02:experiments/results/session17/short_tiles.jsonl): causal S = 128 / 256 / 512 / 1024 31 /
    # 65 / 109 / 149 TFLOP/s against 22 / 53 / 94 / 135 for 128x128x4w (the first row), 1.10-1.41x;
    # non-causal S = 128 / 256 52 / 108 against 47 / 97, but 143 / 168 against 146 / 189 at
    # S = 512 / 1024. More CTAs of half the rows: at these lengths a 128-row CTA has 1-8 key
    # tiles, and its prologue and epilogue are most of its time.
    short = _SHORT_TILE
    if (short in tiles and tile[3] == "mma" and headdim <= 32
            and (seqlen_k <= 256 or (causal and seqlen_k <= 1024))):
        tile = short

    # Rule 2. Provisional: to be measured by experiments/bench_tiles.py (seqlen_q in 1..128,
    # every block_m). Expected: a tile taller than the sequence spends (block_m - seqlen_q) /
    # block_m of its QK^T and PV tensor-core work on zero rows; the smallest tile wastes least.
    # A tile that already has the smallest block_m (rule 1b's 64 x 64) is kept: without rule
    # 1b that is the table's first row, which _first_with_block_m would return anyway.
    if seqlen_q <= block_ms[0]:
        if tile[0] > block_ms[0]:
            tile = _first_with_block_m(tiles, block_ms[0])
    else:
        # Rule 3. Provisional: to be measured by experiments/bench_tiles.py (batch * nheads * m-
        # blocks below, at and above num_sms). Expected: with fewer CTAs than SMs the idle SMs
        # cost more than the extra K/V traffic of a smaller block_m (FlashAttention-2 Sec. 3.2
        # parallelises over the sequence for exactly this reason). One step down: 128 -> 64
        # rows, or 192 -> 128 on the TMA kernel at hd64 (not measured for under-filled grids).
        smaller = [m for m in block_ms if m < tile[0]]
        if smaller and batch_nheads * -(-seqlen_q // tile[0]) < num_sms:
            tile = _first_with_block_m(tiles, smaller[-1])
        # Rule 3c: a shorter tile of the same kernel that makes no more m-blocks does the same
        # CTAs with fewer padding rows (the TMA kernel at hd64: 128 rows instead of 192 for
        # seqlen_q in 65..128 and 193..256, where a 192-row tile's third warpgroup, or 128 of
        # its 384 rows, computes rows past the sequence). Measured (bench_tiles --isa tma, H200,
        # bf16, 16k tokens, 2026-12-02, recorded in 7623388,
        # results-archive-2026-12-02:experiments/results/session18/tiles_rule3c.jsonl):
        # S = 128 168 / 73 TFLOP/s (non-causal / causal) against 136 / 61 for 192 x 128,
        # S = 256 230 / 129 against 187 / 85; at S = 320 (3 m-blocks of 128, 2 of 192) 192 x 128
        # wins non-causal, 216 against 187.
        m_blocks = -(-seqlen_q // tile[0])
        shorter = [t for t in tiles if t[3] == tile[3] and t[0] < tile[0]
                   and -(-seqlen_q // t[0]) <= m_blocks]
        if shorter:
            tile = min(shorter, key=lambda t: t[0])  # (the table's first of the fewest rows)

    # Rule 3b (after rule 3, which may have stepped down from 192 rows already): the TMA
    # kernel's 192-row tile (hd64, three consumer warpgroups), causal, keys up to 1024: its
    # 128-row tile. Measured (bench_tiles --isa tma, H200, bf16, 16k tokens, hidden 2048,
    # 2026-12-01, recorded in 4183281 and b2eda86, results-archive-2026-12-02:experiments/results/session18/tiles_v62.jsonl,
    # tiles_hd64_rule3b.jsonl):
    # causal S = 512 / 1024 200 / 280 TFLOP/s (128 x 128) against 180 / 247 (192 x 128); from
    # S = 2048 192 x 128 wins, causal 357 / 411 / 495 against 346 / 390 / 421 (S 2k / 4k /
    # 16k), non-causal at every length (313 / 373 / 451 / 478 / 517 against 304 / 358 / 395 /
    # 417 / 432 at S 512 / 1k / 2k / 4k / 16k). A causal 192-row tile computes more masked
    # scores on the diagonal, a large share of a short sequence's tiles.
    if tile[3] == "tma" and tile[0] == 192 and causal and seqlen_k <= 1024:
        tile = next((t for t in tiles if t[3] == "tma" and t[0] == 128), tile)

    # Rule 4. Provisional: to be measured by experiments/bench_tiles.py (seqlen_k <= 64).
    # Expected: when every key fits in a narrower tile, the wider one computes masked columns.
    # The narrower tile may be another kernel's: the TMA rows have one key tile per head dim,
    # so short keys at a 128-row TMA tile take an mma.sync 128-row tile with fewer keys. Neither
    # side of that has been measured at such short keys.
    narrower = [t for t in tiles if t[0] == tile[0] and t[1] < tile[1] and seqlen_k <= t[1]]
    if narrower:
        same_warps = [t for t in narrower if t[2:] == tile[2:]]
        tile = min(same_warps or narrower, key=lambda t: t[1])
    return tile


