"""Launch heuristics: pure functions of the problem's sizes (no GPU, no CuPy, no state).

Every threshold carries, next to it, the measurement that justifies it. Thresholds marked
"provisional" have not been measured yet; ``experiments/bench_tiles.py`` times every tile of the
supported table (``cupyflash.prefill.SUPPORTED``) over the shapes below, and the lead replaces
each "provisional" note with the measured numbers (GPU, run, speed-up) when they exist.

Prefill (FlashAttention-2, arXiv 2307.08691, Sec. 3.2-3.3): one CTA per (``block_m`` query rows,
head, batch). A larger ``block_m`` reuses every K/V tile for more query rows (fewer bytes per FLOP)
but makes fewer CTAs, and a tile taller than the sequence computes padding rows.

Decode: ``choose_num_splits`` (Flash-Decoding), below.
"""
from __future__ import annotations

__all__ = ["H200_SMS", "prefill_tiles", "choose_prefill_tile"]

#: Streaming multiprocessors of an H100/H200 SXM: the default when no device is visible.
H200_SMS = 132


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
        padded head dim (:func:`cupyflash.prefill.configs_for`: 72 runs as 128 on the TMA
        kernel and as 96 on the mma.sync kernel).
    arch : str
        Target architecture, ``"sm_90a"`` (H100/H200) by default.

    Returns
    -------
    tuple of (int, int, int, str)
        In the order of :func:`cupyflash.prefill.configs_for` (above hd32 the TMA rows first,
        at hd32 and below after the mma.sync rows; within a kernel
        ``cupyflash.prefill.SUPPORTED``'s order; the first is the suggested default); empty
        when nothing is compiled for the pair.

    Raises
    ------
    ValueError
        ``headdim`` not a multiple of 8 in [8, 256].
    """
    from . import prefill  # pure Python; no CuPy
    return tuple((c.block_m, c.block_n, c.nwarps, c.isa)
                 for c in prefill.configs_for(dtype, headdim) if c.arch in ("", arch))


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
        ``(block_m, block_n, nwarps, isa)``, a row of ``cupyflash.prefill.SUPPORTED``.

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
    # Rule 1: the table's first row (cupyflash/prefill.py _TC_TILES). bf16/fp16 hd96 and hd128:
    # 128x64x4w, measured fastest by the v1 tile sweep (H200, 16k tokens, S = 4096 /
    # 16384, experiments/NOTES.md): hd128 non-causal 312-321 TFLOP/s vs 292-299 (128x32x4) and
    # 256-262 (128x64x8); hd128 causal 258-281, the best tile at S = 4096 and 0.7% behind
    # 128x128x8 (283) at S = 16384, too small a gap for a causal-specific rule; hd96 296-304
    # vs 234-259 for every other tile, causal 277-302 vs <= 251. hd64 keeps 128x64x4w (305-314).
    # Not adopted (and removed from the kernel): hd64 causal with 3 K/V stages: +0.2-2% causal
    # (280 vs 277 at S = 4096, 304 vs 303 bf16 / 303 vs 297 fp16 at S = 16384) but -1.5%
    # non-causal.
    # On sm_90a the TMA rows (prefill._TMA_TILES, the Hopper TMA kernel) come first for every
    # head dim above prefill.TMA_FIRST_ABOVE (32; padded onto 64, 128, 256) and are taken by this
    # rule; v50 and v60 in experiments/NOTES.md have their measurements.
    tile = tiles[0]                                              # rule 1
    block_ms = sorted({t[0] for t in tiles})
    # Rule 1b: head dims up to 32 (the mma.sync hd32 rows), keys up to 256, or up to 1024 when
    # causal (the lengths measured): 64x64x4w.
    # Measured (bench_tiles, H200, fp16, 24 sequences x 12 heads, session 17,
    # experiments/results/session17/short_tiles.jsonl): causal S = 128 / 256 / 512 / 1024 31 /
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
        # bf16, 16k tokens, session 18, experiments/results/session18/tiles_rule3c.jsonl):
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
    # session 18, experiments/results/session18/tiles_v62.jsonl, tiles_hd64_rule3b.jsonl):
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


# ----------------------------------------------------------------------------------------------
# Decode (Flash-Decoding): number of KV splits. The launch code and the split kernel live in
# cupyflash/decode.py and kernels_cu/flash_decode.cu.
# ----------------------------------------------------------------------------------------------
__all__ += ["MIN_TILES_PER_SPLIT", "MAX_SPLITS", "choose_num_splits"]

#: A split has at least this many tiles. One: since the merge of the splits costs one L2 round
#: trip per batch of 16 parts (v10), a short cache is best cut into one-tile splits up to one
#: wave of blocks (H200, v10 sweep, graph-timed, b1 at 8 KV heads, 128-key tiles: 1k keys 2 /
#: 4 / 8 splits 11.4 / 9.2 / 8.4 us; 4k keys 8 / 16 splits 11.6 / 10.6 us). It was 4 before
#: v10, when each extra split added a serial L2 round trip to the merge.
MIN_TILES_PER_SPLIT = 1
#: Upper bound on splits (workspace size; beyond ~2 blocks per SM more splits only add waves).
MAX_SPLITS = 128


def choose_num_splits(batch: int, nheads_k: int, seqlen_k: int, num_sms: int = H200_SMS, *,
                      row_chunks: int = 1, block_n: int = 64, ctas_per_sm: int = 1,
                      max_splits: int = MAX_SPLITS,
                      min_tiles_per_split: int = MIN_TILES_PER_SPLIT) -> int:
    """Number of KV splits for a decode step (pure; Flash-Decoding's occupancy argument).

    The split kernel is bandwidth-bound and every block of one launch does the same amount of
    work, so the best launch is one wave of equal blocks: ``slots = num_sms * ctas_per_sm``
    blocks are targeted, and ``ctas = batch * nheads_k * row_chunks`` blocks exist without
    splitting. Rule::

        splits = floor(slots / ctas)                        # fill one wave, never start a 2nd
        splits = min(splits, ceil(tiles / min_tiles_per_split), max_splits)
        splits = max(splits, 1)

    with ``tiles = ceil(seqlen_k / block_n)``. ``floor`` rather than ``ceil``: with equal blocks,
    ``ceil`` would start a second, mostly empty wave (e.g. 128 blocks on 132 slots: 1 split runs
    in one wave, 2 splits in two).

    ``ctas_per_sm`` is the number of blocks per SM to fill, not the number that fit:
    :func:`cupyflash.decode.launch_config` passes 1 for contiguous caches and for hd128 paged
    caches (its 128-key x 8-warp tile, ~200 KB, one block per SM), 2 (when two fit) for paged
    caches at the other head dims, and 2 whenever the unsplit blocks already exceed the SMs
    (several waves: it then runs the two-blocks-per-SM tile, v9; the rule gives 1 split). Measured on the H200 (bf16, 32/8 heads, hd128, fused
    combine, CUDA-graph timed TB/s of K+V; experiments/NOTES.md):

    * contiguous (v1, 64-key tiles of ~108 KB), batch 1 x 128k: 16 splits 3.83, 33 splits 3.68,
      66 splits 3.34 -> one block per SM (a second block only adds partials and merge work);
      batch 1 x 8k: 16 splits 1.84, 33 1.47; batch 16 x 16k: 1 split 4.11-4.13, 2 splits
      4.02-4.06. Same with today's 128 x 8 tile (v6): batch 1 x 128k 16 splits 4.14-4.21, 32
      splits 3.88-3.95, 8 splits 3.31-3.40.
    * paged: with per-tile page-id loads (v1) two blocks per SM hid them (page 16, batch 1 x
      128k: 33 splits 3.45, 16 splits 2.37); since the page ids arrive by cp.async with the K/V
      copies (v6), hd128 paged caches run one block per SM like contiguous ones (page 16, batch
      1 x 128k: 16 splits 4.02 with the 128 x 8 tile, 33 splits 3.82 with 64 x 4).

    * short caches (v10, 128 x 8 tile, merge loads batched): batch 1 x 1k (8 tiles) 2 / 4 / 8
      splits 11.4 / 9.2 / 8.4 us; batch 1 x 4k (32 tiles) 8 / 16 splits 11.6 / 10.6 us ->
      ``min_tiles_per_split = 1``.

    Examples (H200, Llama-3-8B heads: nheads_k = 8, hd128, ``block_n = 128``,
    ``ctas_per_sm = 1``, contiguous or paged): batch 1 -> 16 splits (128 blocks) from 2k keys,
    8 at 1k (one tile each); batch >= 9 -> 1. With ``ctas_per_sm = 2`` (paged hd64 / hd256): batch 1 ->
    33 (264 blocks).

    Properties (tested): ``1 <= splits <= max(1, min(max_splits, tiles))``; non-increasing in
    ``batch``, ``nheads_k`` and ``row_chunks``; non-decreasing in ``seqlen_k``, ``num_sms`` and
    ``ctas_per_sm``.

    Parameters
    ----------
    batch, nheads_k : int
        Sequences and KV heads (>= 1).
    seqlen_k : int
        Keys per sequence: the cache capacity (an upper bound; the split kernel divides each
        sequence's own length into ``splits`` parts).
    num_sms : int
        Streaming multiprocessors (132 on an H200 SXM).
    row_chunks : int
        ``ceil(nheads // nheads_k * seqlen_q / GROUP)`` blocks per KV head.
    block_n : int
        Keys per tile of the split kernel.
    ctas_per_sm : int
        Split blocks per SM to fill (see above: 1 for the one-block tiles, 2 where two blocks
        per SM run).
    max_splits, min_tiles_per_split : int
        Caps (see :data:`MAX_SPLITS`, :data:`MIN_TILES_PER_SPLIT`).

    Returns
    -------
    int
        ``>= 1``.
    """
    for name, val in (("batch", batch), ("nheads_k", nheads_k), ("num_sms", num_sms),
                      ("row_chunks", row_chunks), ("block_n", block_n),
                      ("ctas_per_sm", ctas_per_sm), ("max_splits", max_splits),
                      ("min_tiles_per_split", min_tiles_per_split)):
        if not _is_int(val) or val < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {val!r}")
    if not _is_int(seqlen_k) or seqlen_k < 0:
        raise ValueError(f"seqlen_k: expected an int >= 0, got {seqlen_k!r}")
    tiles = -(-seqlen_k // block_n)
    ctas = batch * nheads_k * row_chunks
    slots = num_sms * ctas_per_sm
    splits = slots // ctas
    splits = min(splits, -(-tiles // min_tiles_per_split), max_splits)
    return int(max(splits, 1))


__all__ += ["TWO_STAGES_MIN_KEYS_PER_SPLIT", "TWO_STAGES_MIN_KEYS_SEVERAL_WAVES",
            "choose_split_stages"]

#: Keys per split (at capacity) from which the one-block hd128 tile (128 keys x 8 warps) runs two
#: K/V stages instead of three on a contiguous cache: 64 KB of copies in flight per SM instead of
#: 128 KB (H200, v26 sweep, graph / flushed us, three vs two stages, bitwise the same output):
#: b16 x 16k 236.6 / 239.6 vs 234.3 / 238.0, b16 x 32k 467.8 / 470.6 vs 463.7 / 466.7, b16 x 128k
#: 1857 / 1853 vs 1848 / 1849, b4 x 32k (4 splits of 8k) 124.1 / 126.7 vs 122.7 / 125.6, b1 x 128k
#: (16 splits of 8k) 124.2 / 125.9 vs 123.1 / 126.4; below it two stages lose or tie: b16 x 4k
#: 63.5 / 66.0 vs 63.2 / 66.7, b1 x 32k (16 splits of 2k) 36.2 / 39.0 vs 37.0 / 40.0.
TWO_STAGES_MIN_KEYS_PER_SPLIT = 8192
#: Cache capacity from which the several-waves hd128 tile (64 keys x 4 warps; unsplit blocks >
#: SMs) runs two stages instead of three on a contiguous cache: one tile in flight per block, 64 KB
#: per SM at two blocks (its 191 registers x 128 threads allow two blocks per SM, not the three
#: its shared memory would) (H200, v24-v25 sweeps, graph / flushed us at b64): 1k 66.4 / 69.5 vs 66.8 / 70.6, 2k 123.4 /
#: 127.0 vs 123.1 / 127.1, 4k 239.1 / 242.9 vs 237.3 / 240.6, 8k 472.8 / 478.2 vs 465.4 / 468.8,
#: 16k 939.1 / 946.2 vs 921.2 / 924.4, 32k 1869.6 / 1880.4 vs 1832.8 / 1836.8; b32 x 16k 469.1 /
#: 472.7 vs 464.5 / 468.1.
TWO_STAGES_MIN_KEYS_SEVERAL_WAVES = 4096


def choose_split_stages(stages: int, *, headdim: int, paged: bool, several_waves: bool,
                        one_block: bool, seqlen_k: int, num_splits: int, block_n: int,
                        split_tiles: int = 0) -> int:
    """K/V pipeline depth of the decode split kernel (pure; measured on the H200 only).

    The split kernel streams each block's keys through a ring of ``stages`` shared-memory
    buffers, ``stages - 1`` tiles in flight. On long contiguous caches fewer bytes in flight per
    SM stream faster (v24-v26 in experiments/NOTES.md: 64 KB per SM rather than 128 KB), so:

    * contiguous hd128 cache, several waves (the 64-key tile, unsplit blocks > SMs) and
      ``seqlen_k >= TWO_STAGES_MIN_KEYS_SEVERAL_WAVES``: 2 stages (64 KB per SM in flight);
    * contiguous hd128 cache, the one-block tile, and at least
      ``TWO_STAGES_MIN_KEYS_PER_SPLIT`` keys per split at capacity (``ceil(tiles / num_splits)
      * block_n``, or ``split_tiles * block_n`` in the fixed ``split_size`` mode): 2 stages;
    * otherwise ``stages`` unchanged (paged caches measured slower with fewer bytes in flight at
      pages of 16, v25; other head dims not measured).

    The depth changes no result: the same tiles meet the same warps in the same order, so the
    output is bitwise that of the deeper pipeline (a GPU test checks it).

    Parameters
    ----------
    stages : int
        The tile's stage count (already reduced to fit the device), >= 2.
    headdim : int
        Compiled head dim.
    paged, several_waves, one_block : bool
        Paged cache; the several-waves tile was chosen; the one-block tile was chosen (see
        ``decode.launch_config``; neither: a fallback tile for a smaller device, unchanged).
    seqlen_k : int
        Cache capacity (keys), >= 0.
    num_splits, block_n : int
        Splits and keys per tile, >= 1.
    split_tiles : int
        Tiles per split in the fixed ``split_size`` mode (the kernel's ``split_tiles``), 0
        otherwise (each sequence's tiles divided into ``num_splits`` parts).

    Returns
    -------
    int
        ``2`` or ``stages``.

    Raises
    ------
    ValueError
        ``stages < 2``, ``num_splits`` or ``block_n`` < 1, ``seqlen_k`` or ``split_tiles`` < 0.
    """
    for name, val, lo in (("stages", stages, 2), ("num_splits", num_splits, 1),
                          ("block_n", block_n, 1), ("seqlen_k", seqlen_k, 0),
                          ("split_tiles", split_tiles, 0)):
        if not _is_int(val) or val < lo:
            raise ValueError(f"{name}: expected an int >= {lo}, got {val!r}")
    if paged or headdim != 128 or stages <= 2:
        return stages
    if several_waves:
        return 2 if seqlen_k >= TWO_STAGES_MIN_KEYS_SEVERAL_WAVES else stages
    if not one_block:
        return stages
    tiles = -(-seqlen_k // block_n)
    keys_per_split = (split_tiles if split_tiles > 0 else -(-tiles // num_splits)) * block_n
    return 2 if keys_per_split >= TWO_STAGES_MIN_KEYS_PER_SPLIT else stages
