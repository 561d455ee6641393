"""Decode launch heuristics: pure functions of the problem's sizes (no GPU, no CuPy, no state).

Every threshold carries, next to it, the measurement that justifies it.
"""
from __future__ import annotations

from ..core.planning import H200_SMS

__all__: list = []


def _is_int(x) -> bool:
    """A Python or NumPy integer, not a bool (pure: no NumPy import needed)."""
    return hasattr(x, "__index__") and not isinstance(x, bool) and type(x).__name__ != "bool_"

# ----------------------------------------------------------------------------------------------
# Decode (Flash-Decoding): number of KV splits. The launch code and the split kernel live in
# cupyflash/decode/__init__.py and kernels_cu/decode/split.cu.
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
