"""Split-KV decoding against a KV cache (Flash-Decoding), its exact merge, and the KV append.

Algorithm
---------
Flash-Decoding (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference", 2023):
one or a few query tokens against a long KV cache give a 1 x S score row per head; the work is
bound by reading K and V, and one thread block per (batch, head) leaves most SMs idle at small
batch. The key range of each sequence is cut into ``num_splits`` splits processed by separate
thread blocks (each one the FlashAttention-2 forward pass, arXiv 2307.08691 Sec. 3.1, over its
keys); each writes a normalised fp32 partial output and its LSE, and the last split block of each
head to finish merges them exactly (fused combine, below): ``o = sum_s w_s o_s / sum_s w_s`` with
``w_s = exp(lse_s - max lse)``.

Kernels (``kernels_cu/flash_decode.cu``)
----------------------------------------
``decode_split_kernel``: grid ``(nheads_k * row_chunks, num_splits, batch)`` for contiguous
caches: the blocks of the KV heads of one sequence and key range are launched next to each
other, so the neighbouring 256-byte pieces of each cache row (one per KV head) are read at the
same time and each DRAM page is opened once (v16, experiments/NOTES.md: 1-1.5% at b64 x 1k-2k,
where the blocks run in two waves; cuDNN orders its grid the same way); ``(num_splits, batch,
nheads_k * row_chunks)`` for paged caches, where that order measured 0.5-2.8% slower. One block
reads
each K/V tile of its KV head once (16-byte ``cp.async`` copies into a ring of ``stages`` shared
buffers, so ``stages - 1`` tiles are in flight while one is computed) and serves every query row
of that head: the ``nheads // nheads_k`` GQA heads times the ``seqlen_q`` tokens, up to
``GROUP = 16`` rows per block (more rows use more blocks, ``row_chunks``). Scores and ``P V`` use
tensor cores (``mma.m16n8k16``, fp32 accumulate); the online softmax and the merges are fp32.
With a single split it writes the final output directly (no combine launch). When the
unsplit blocks already exceed the SMs (several waves), the heuristic runs hd128 with the
:data:`SPLIT_CONFIGS` tile (64 keys, two blocks per SM) instead of its one-block tile (see
:data:`ONE_BLOCK_SPLIT_CONFIGS`). On contiguous hd128 caches long streams run two stages
instead of three (one tile in flight per block: 64 KB per SM instead of 128 KB, 1-2% faster
from 8k keys per split, or from 4k keys in the several-waves case; bitwise the same output;
:func:`cupyflash.heuristics.choose_split_stages`).

Supported: float16 and bfloat16 (tensor cores; float32/float64 caches are rejected with a
TypeError); head dims that are multiples of 8 up to 256, run by the kernel compiled for 64, 128
or 256 (the padding columns are zero-filled in shared memory, never read from memory).

Page sizes: every page size from 1 to 256 (and beyond) works and reads the same bytes. The page
ids of a tile are copied from ``block_table`` into a shared-memory ring by 4-byte ``cp.async``,
``stages - 1`` tiles ahead of the tile's K/V copies and waited for together with earlier K/V
tiles, so no lookup stalls the loop. Powers of two (1, 2, 4, ..., 256 and beyond) are the fast
sizes (timed: 16 and 256; tested bitwise against the general path: 1 to 256): up to hd128 their
kernel keeps one id per page of a tile (one per tile for pages of ``block_n`` keys
or more) and computes each copy's address with a shift and a mask (copy pointers,
experiments/NOTES.md v20); this needs each cache's page stride and ``page_size`` x row stride
in [0, 2^31) elements (:attr:`cupyflash.checks.DecodeProblem.page_offsets_fit_i32`; a pool
view with negative or larger strides takes the general path, and ``explain()`` says so). The
general path (other sizes, hd256) keeps one id per key row (one per tile for pages of whole
tiles) and pays a shift, or for other sizes an integer division, per row. Measured on the H200
(``experiments/sweep_decode_variants.py``, CUDA-graph replay, shuffled tables), the
power-of-two path against the per-row one: b1 x 8k keys, pages of 16: 11.3 vs 14.2 us
(contiguous 10.6); b16 x 16k, pages of 256: -3.8%; b64 x 2k, pages of 16: -2%. Paged against
contiguous caches in ``experiments/bench_decode.py``: see the README's decode table.

CUDA graphs
-----------
With ``validate=False`` (no host read of ``cache_seqlens``/``block_table``), ``out=`` given,
``return_lse=False`` and, when more than one split is used, a ``workspace=`` from
:func:`alloc_workspace` (or any float32 CuPy array of at least :func:`workspace_size` elements,
zero-filled once), the call launches only kernels: no allocation and no host synchronisation,
so it can be captured in a CUDA graph. The number of splits depends only on shapes (never on
``cache_seqlens``).

Fused combine
-------------
With more than one split, the split kernel also merges: each block writes its fp32 partial, then
one thread increments an arrival counter of its (batch, KV head, row chunk) (in the workspace, or
in the per-stream buffer below) with a release/acquire atomic (``atom.acq_rel.gpu``, after a block
barrier); the block that arrives last reads all the partials (through L2, the loads of 16 parts in
flight at once, 8 with at most 8 splits; merged a batch at a time without branches: batch max,
independent weights, empty parts masked by selects) and writes the output and LSE, then resets the
counter to zero. There is no combine launch (H200, v1 sweep: +3% at batch 1 x 128k, +24% at batch 1
x 8k). Merging the splits of a head through distributed shared memory in one thread-block cluster
(``FLAG_CLUSTER_COMBINE``, :mod:`cupyflash.launch`) is a measured variant, not the default: on the
H200 it is ~1 us faster where its clusters fit one wave, but clusters of 4-16 blocks leave 12-20
SMs idle, so the split counts that fill the GPU run a second wave (experiments/NOTES.md v8).

The counters must be zero before a launch: :func:`alloc_workspace` returns a zero-filled
workspace, and every complete launch leaves them zero. A call without ``workspace=`` takes its
partials from CuPy's memory pool and its counters from a zero-filled buffer kept per (device,
stream) and shared by the calls on that stream (no memset per call); such a call cannot be
captured in a CUDA graph (ValueError: pass ``workspace=``).

Programmatic dependent launch
-----------------------------
On sm_90+ the append and split kernels are launched with programmatic stream serialization
(:class:`cupyflash.launch.PreparedLaunch`; CUDA Programming Guide, "Programmatic Dependent
Launch and Synchronization"): each may be scheduled while the previous kernel of the stream
finishes, and waits (``griddepcontrol.wait``, ``kernels_cu/common/pdl.cuh``) for that kernel's
completion and memory before its first global load, so the result is the same; what overlaps is
the launch and block set-up. The split kernel lets the next kernel be scheduled once its main
loop is done (the append kernel at entry), so the next launch overlaps its epilogue and merge.
H200, graph-timed (experiments/NOTES.md v15): 0.5-0.7 us faster at batch 1 up to 8k keys
(6.6 vs 7.2 us at 1k), 0.7 us at b16 x 1k, within noise from 16k keys up. Set
:data:`PDL` to False, run a block inside ``with pdl_launches(False):`` (restores the previous
value), or set the environment variable ``CUPYFLASH_PDL=0`` before import, to launch through
``cupy.RawKernel`` instead; measured in experiments/NOTES.md v15.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import threading
import weakref

import numpy as np

from . import checks, jit, launch
from .interop import as_cupy, np_dtype
from .heuristics import (H200_SMS, MAX_SPLITS, MIN_TILES_PER_SPLIT, TWO_STAGES_MIN_KEYS_PER_SPLIT,
                         TWO_STAGES_MIN_KEYS_SEVERAL_WAVES, choose_num_splits,
                         choose_split_stages)

__all__ = [
    "DTYPES", "HEADDIMS", "GROUP", "SplitConfig", "SPLIT_CONFIGS", "ONE_BLOCK_SPLIT_CONFIGS",
    "split_config", "DecodeLaunch",
    "MAX_SPLITS", "MIN_TILES_PER_SPLIT", "launch_config",
    "padded_headdim", "split_smem_bytes", "kernel_spec", "split_kernel_spec", "default_flags",
    "paged_copy_pointers_refusal",
    "combine_kernel_spec", "append_kernel_spec", "all_specs", "choose_num_splits",
    "split_layout", "plan_decode", "workspace_elems", "workspace_size", "alloc_workspace",
    "explain_kvcache", "flash_attn_with_kvcache", "merge_states", "pdl_launches",
]

SOURCE = "flash_decode.cu"
#: Launch the append and split kernels as programmatic dependent launches on sm_90+ (see the
#: module docstring). Read on every call; ``CUPYFLASH_PDL=0`` in the environment sets it False.
PDL = os.environ.get("CUPYFLASH_PDL", "1") != "0"


@contextlib.contextmanager
def pdl_launches(enabled: bool):
    """``with pdl_launches(False):`` runs a block with :data:`PDL` set to ``enabled`` (the calls
    inside launch plainly, or as programmatic dependent launches), restoring the previous value
    on exit. Process-wide, like :data:`PDL` itself (not per thread)."""
    global PDL
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__}")
    prev, PDL = PDL, enabled
    try:
        yield
    finally:
        PDL = prev


#: Element types of the split kernel (tensor cores).
DTYPES = ("float16", "bfloat16")
#: Compiled head dims; a head dim d runs with the smallest compiled one >= d.
HEADDIMS = (64, 128, 256)
#: Query rows per block = the M of one mma.m16n8k16 tile (GQA heads x query tokens).
GROUP = 16

_CTYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}
_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}

# Device limits of the H200 (the default target of the pure planning functions; the launch path
# reads the real ones from the device).
H200_SMEM_PER_SM = 233472          # 228 KiB
H200_SMEM_PER_BLOCK_OPTIN = 232448  # 227 KiB
_SMEM_RESERVED_PER_BLOCK = 1024     # the driver keeps 1 KiB per resident block


@dataclasses.dataclass(frozen=True)
class SplitConfig:
    """Tile shape of one split-kernel specialisation.

    block_n : keys per tile (each of the ``nwarps`` warps owns ``block_n / nwarps`` of them,
        a multiple of 16).
    nwarps : warps per block.
    stages : shared-memory ring depth; ``stages - 1`` K/V tiles are in flight during compute.
    """
    block_n: int
    nwarps: int
    stages: int


#: Per head dim: about 35 KB of K+V per tile, three stages (~108 KB of shared memory), so two
#: blocks fit on an H200 SM with ~140 KB of copies in flight per SM (Little's law at ~4.4 TB/s
#: and ~1-2 us of latency asks for 35-70 KB per SM).
SPLIT_CONFIGS = {64: SplitConfig(128, 4, 3), 128: SplitConfig(64, 4, 3), 256: SplitConfig(32, 2, 3)}
#: Head dims where a one-block-per-SM tile measured faster, for every cache layout (H200,
#: bf16, 32/8 heads, graph-timed TB/s; experiments/NOTES.md v2-v6): hd128 128 keys x 8 warps x
#: 3 stages (202 KB). Contiguous (v3): b16 x 1k 2.90-2.94 vs 2.66-2.69 for 64 x 4, b1 x 8k
#: 2.00-2.02 vs 1.80-1.83, large shapes +0.5-1%. Paged, once page ids moved to cp.async (v6):
#: b16 x 16k page 16 / 64 / 256 4.32 / 4.32 / 4.35 vs 4.15 / 4.16 / 4.20 for 64 x 4 at two
#: blocks per SM; b1 x 128k page 16 4.02 vs 3.82. Devices whose shared memory per block holds
#: it with two stages but not three (e.g. A100, 163 KB) run it with two (unmeasured there);
#: :data:`SPLIT_CONFIGS` is the fallback where even two stages do not fit. With the heuristic
#: (``num_splits=0``, no ``split_size``), a problem whose unsplit blocks (batch x nheads_k x
#: row_chunks) already exceed the SMs runs the :data:`SPLIT_CONFIGS` tile at two blocks per SM
#: instead (several waves: v9, b64 x 1k / 2k +8% / +4%, paged page 16 b64 x 2k +9%).
ONE_BLOCK_SPLIT_CONFIGS = {128: SplitConfig(128, 8, 3)}


def split_config(headdim: int) -> SplitConfig:
    """The split kernel's tile for a compiled head dim (the launch path's and
    :func:`split_kernel_spec`'s default): :data:`ONE_BLOCK_SPLIT_CONFIGS` where it has one,
    else :data:`SPLIT_CONFIGS`. The same tile serves contiguous and paged caches."""
    return ONE_BLOCK_SPLIT_CONFIGS.get(headdim, SPLIT_CONFIGS[headdim])


# ----------------------------------------------------------------------------------------------
# Specialisations (names are data: cache key, log line, profiler label)
# ----------------------------------------------------------------------------------------------
def padded_headdim(headdim: int) -> int:
    """The compiled head dim that runs ``headdim`` (smallest of :data:`HEADDIMS` >= it).

    Raises
    ------
    ValueError
        ``headdim`` above 256.
    """
    for hd in HEADDIMS:
        if headdim <= hd:
            return hd
    raise ValueError(f"headdim: {headdim} is not supported; supported: multiples of 8 up to "
                     f"{HEADDIMS[-1]}")


def split_smem_bytes(dtype: str, headdim: int, block_n: int, stages: int,
                     flags: int = 0) -> int:
    """Dynamic shared memory of the split kernel (mirrors ``DecodeTraits::kSmemBytes``).

    Q tile ``GROUP x (headdim + 8)`` (rows padded by 16 bytes: conflict-free ``ldmatrix``) plus
    ``stages`` x (K and V tiles of ``block_n x headdim``, unpadded rows with 16-byte chunks
    XOR-swizzled inside 128-byte groups), 16-bit elements; then a ring of ``stages`` x
    ``block_n`` int32 page ids (paged caches; allocated always). With :data:`FLAG_TMA` the Q
    area is padded to a multiple of 1024 bytes (the stage buffers' swizzle alignment); other
    ``flags`` do not change it.
    """
    e = np_dtype(dtype).itemsize
    q_bytes = GROUP * (headdim + 16 // e) * e
    if flags & FLAG_TMA:
        q_bytes = -(-q_bytes // 1024) * 1024
    return q_bytes + stages * 2 * block_n * headdim * e + stages * block_n * 4


#: Bits of the split kernel's FLAGS template parameter (``decode_flags`` in flash_decode.cu) and
#: their name suffixes: the fused last-block-done combine, the L2 evict_first policy, and the
#: ``.L2::256B`` / ``.L2::128B`` prefetch-size hints on the K/V copies (one at most). Bit 8 was
#: a per-row bulk-copy variant, removed after it measured 2x slower (experiments/NOTES.md v2).
FLAG_FUSED_COMBINE, FLAG_EVICT_FIRST, FLAG_PREFETCH_256, FLAG_PREFETCH_128 = 1, 2, 4, 8
#: Warp-local pipeline (contiguous caches only): each warp copies and waits for its own key rows
#: of every tile, so the tile loop has no CTA barrier (``decode_flags::kWarpLocal``).
FLAG_WARP_LOCAL = 16
#: Cluster combine (sm_90; experiments only): launched as one thread-block cluster per (batch,
#: KV head, row chunk) holding its ``num_splits`` blocks (:func:`run_split_variant`, up to 16),
#: the blocks merge their partials through distributed shared memory
#: (``decode_flags::kClusterCombine``); launched without clusters, the kernel runs its other
#: paths. Not used by the public functions: on the H200 clusters of 4-16 blocks at one block per
#: SM leave 12-20 SMs idle (GPC granularity), so the split counts that fill the GPU need a
#: second wave (v8, experiments/NOTES.md).
FLAG_CLUSTER_COMBINE = 32
#: Fused combine with one ``atom.acq_rel.gpu`` arrival by thread 0 after a ``__syncthreads``
#: instead of a ``__threadfence`` in every thread (``decode_flags::kReleaseArrive``).
FLAG_RELEASE_ARRIVE = 64
#: K and V of each tile in separate cp.async groups: a tile's scores and probabilities are
#: computed while its V is still arriving (``decode_flags::kKVGroups``; v11, experiments/NOTES.md).
FLAG_KV_GROUPS = 128
#: Paged caches: the page ids of a split's first tiles are fetched for the split the block would
#: have at full capacity together with the sequence's length (both by ``cp.async``, one wait),
#: and fetched again after it only where that guess was wrong (``decode_flags::kSpecPageIds``;
#: v13, v34 in experiments/NOTES.md).
FLAG_SPEC_PAGE_IDS = 256
#: Programmatic dependent launch: where the split kernel lets the next kernel of the stream be
#: scheduled (``griddepcontrol.launch_dependents``). Default: after its main loop (before the
#: epilogue and merge). ``FLAG_PDL_EARLY_TRIGGER``: at entry, right after its wait (v15: 1% slower
#: where one wave of 128 blocks streams for long); ``FLAG_PDL_NO_TRIGGER``: never (implicitly when
#: its blocks exit; v15b: keeps less of the gain). Ignored by plain launches.
FLAG_PDL_EARLY_TRIGGER = 512
FLAG_PDL_NO_TRIGGER = 1024
#: Tile-loop instruction count (v18, experiments/NOTES.md; ``decode_flags`` in flash_decode.cu).
#: ``FLAG_COPY_POINTERS``: K/V source pointers advanced by a row step per copy, and tiles wholly
#: inside the sequence copied without per-copy tests; on paged caches (v20; a power-of-two
#: ``page_size`` and 32-bit strides, :func:`paged_copy_pointers_refusal`) one page id per page
#: of a tile instead of one per row, and each copy's address from a shift and a mask.
#: ``FLAG_SKIP_RESCALE``: no accumulator rescale on a tile where no row of the warp moved its max
#: (the skipped factors are exactly 1). ``FLAG_LAZY_RESCALE``: the max moves only when some row
#: would gain more than 8 (log2 units; FlashAttention-4's conditional rescaling; the same result
#: up to rounding). ``FLAG_Q_REGS``: Q's mma fragments stay in registers. ``FLAG_MASK_FAST``:
#: tiles every valid row sees whole skip the per-score mask. All but the lazy rescale give
#: bitwise the same output as the kernel without them.
FLAG_COPY_POINTERS = 2048
FLAG_SKIP_RESCALE = 4096
FLAG_LAZY_RESCALE = 8192
FLAG_Q_REGS = 16384
FLAG_MASK_FAST = 32768
#: TMA copies (sm_90, contiguous caches; v30, experiments/NOTES.md): thread 0 issues each tile's
#: K and V as boxes of ``block_n`` rows x 64 elements through tensor maps
#: (:func:`kv_tensor_map_geometry`, built by ``launch.encode_tensor_map``), completing on an
#: mbarrier per stage, instead of every thread issuing 16-byte ``cp.async`` copies
#: (``decode_flags::kTma``; the kernel entry ``decode_split_tma_kernel`` takes the two maps).
#: Bitwise the same output as the kernel without it.
FLAG_TMA = 65536
#: Speculative prologue (contiguous caches with :data:`FLAG_COPY_POINTERS`; v35,
#: experiments/NOTES.md): the first tiles of the split the block would have at full capacity are
#: copied right after the grid-dependency wait, while the sequence's length is still in flight
#: (it comes by a 4-byte ``cp.async`` beside them); where the guess was wrong (ragged batches,
#: with several splits) they are let land and the prologue is issued again. Rows in
#: ``[len, capacity)`` of the guessed tiles reach shared memory, never the result (masked scores,
#: zeroed V rows). Bitwise the same output as the kernel without it
#: (``decode_flags::kSpecKV``).
FLAG_SPEC_KV = 131072
#: The Q tile by 16-byte ``cp.async`` issued beside the sequence's length (with speculative page
#: ids: right after the length's and ids' group, outside it, v47), landed with the first K/V
#: group committed after it (v44, experiments/NOTES.md: at short caches the earlier 2-byte Q
#: loads, each followed by its shared-memory store, held half the kernel's stall samples); a q
#: whose base or strides are not 16-byte multiples keeps the 2-byte loads. Not with
#: :data:`FLAG_TMA`, :data:`FLAG_WARP_LOCAL`, :data:`FLAG_Q_REGS` or :data:`FLAG_SPEC_KV`.
#: Bitwise the same output as the kernel without it (``decode_flags::kQAsync``).
FLAG_Q_ASYNC = 262144
_FLAG_LIMIT = 524288
_FLAG_SUFFIX = ((FLAG_FUSED_COMBINE, "_fused"), (FLAG_EVICT_FIRST, "_ef"),
                (FLAG_PREFETCH_256, "_pf256"), (FLAG_PREFETCH_128, "_pf128"),
                (FLAG_WARP_LOCAL, "_wl"), (FLAG_CLUSTER_COMBINE, "_cluster"),
                (FLAG_RELEASE_ARRIVE, "_rel"), (FLAG_KV_GROUPS, "_kvg"),
                (FLAG_SPEC_PAGE_IDS, "_spid"), (FLAG_PDL_EARLY_TRIGGER, "_trearly"),
                (FLAG_PDL_NO_TRIGGER, "_trnone"), (FLAG_COPY_POINTERS, "_cp"),
                (FLAG_SKIP_RESCALE, "_skip"), (FLAG_LAZY_RESCALE, "_lazy"),
                (FLAG_Q_REGS, "_qreg"), (FLAG_MASK_FAST, "_mf"), (FLAG_TMA, "_tma"),
                (FLAG_SPEC_KV, "_spkv"), (FLAG_Q_ASYNC, "_qasync"))
#: FLAGS of the split kernels that :func:`flash_attn_with_kvcache` launches: the fused
#: last-block-done combine (v1 sweep, H200: b1 x 128k 3.83 vs 3.72 TB/s with a combine launch at
#: 16 splits, b1 x 8k 1.84 vs 1.48) with the release/acquire arrival (v9, experiments/NOTES.md).
DEFAULT_FLAGS = FLAG_FUSED_COMBINE | FLAG_RELEASE_ARRIVE


def default_flags(headdim: int, paged: bool, page_size: int | None = None) -> int:
    """FLAGS of the split kernel the public functions launch: :data:`DEFAULT_FLAGS`, plus
    :data:`FLAG_SPEC_PAGE_IDS` for paged caches up to hd128 (v13 sweep, H200, graph-timed:
    b16 x 16k page 16 -1.7%, b1 x 128k page 16 -1.2%, b1 x 1k page 16 -0.2 us, nowhere slower;
    not at hd256, whose paged kernel is at 255 registers and would spill), and
    :data:`FLAG_COPY_POINTERS` for contiguous caches (v18 sweep, H200, flushed: b1 x 1k-8k
    -3.5 to -5%, elsewhere within +-0.5%; bitwise the same output) and for paged caches up to
    hd128 whose ``page_size`` is a power of two (v20 sweep, H200, graph-timed: b1 x 8k pages of
    16 14.2 -> 11.3 us, b16 x 16k pages of 256 -3.8%, b64 x 2k pages of 16 -2%; bitwise the same
    output; hd256 would spill). ``page_size=None`` (not known): no copy pointers on pages.
    Every path also has :data:`FLAG_Q_ASYNC` (v44 run, H200, L2 flushed: b64 x 128 keys 22.2 ->
    17.8 us, b16 x 128 10.0 -> 9.5, b64 x 1k 69.7 -> 66.8, b64 x 1k pages of 16 73.2 -> 69.7,
    b1 x 8k 17.4 -> 16.6, from 16k keys within +-0.5%; bitwise the same output; registers equal
    but hd64 +2, no spills)."""
    if paged:
        cp = (headdim <= 128 and page_size is not None and page_size >= 1
              and page_size & (page_size - 1) == 0)
        return (DEFAULT_FLAGS | FLAG_Q_ASYNC | (FLAG_SPEC_PAGE_IDS if headdim <= 128 else 0)
                | (FLAG_COPY_POINTERS if cp else 0))
    return DEFAULT_FLAGS | FLAG_COPY_POINTERS | FLAG_Q_ASYNC


def kv_tensor_map_geometry(shape, strides, itemsize: int, block_n: int) -> tuple:
    """``(dims, strides_bytes, box)`` of the tensor map through which the :data:`FLAG_TMA`
    kernel copies a contiguous cache of ``shape`` (batch, seqlen_cache, nheads_k, headdim) with
    element ``strides``: dims (headdim, nheads_k, seqlen_cache, batch), innermost first, with
    their byte strides (head, row, sequence; any order); the box is 64 elements of one head for
    ``block_n`` keys of one sequence (one 128-byte swizzle row per key).

    Raises
    ------
    ValueError
        A layout the TMA unit cannot describe (:func:`tma_refusal` says why)."""
    why = tma_refusal(shape, strides, itemsize)
    if why is not None:
        raise ValueError(f"k_cache/v_cache: no TMA copies: {why}")
    b, sc, hk, d = (int(x) for x in shape)
    sb, sr, sh = _tma_strides(shape, strides, itemsize)
    return (d, hk, sc, b), (sh, sr, sb), (64, 1, int(block_n), 1)


def _tma_stride_ok(stride_bytes: int) -> bool:
    """A stride the tensor map can carry: a positive multiple of 16 bytes below 2^40."""
    return 0 < stride_bytes < 2 ** 40 and stride_bytes % 16 == 0


def _tma_strides(shape, strides, itemsize: int) -> tuple:
    """Byte strides (batch, row, head) for the tensor map: a dim of one element never moves,
    so its stride (which may be 0 or unaligned in a view) is replaced by 16 bytes."""
    out = []
    for n, st in zip(shape[:3], strides[:3]):
        st = int(st) * itemsize
        out.append(st if int(n) > 1 or _tma_stride_ok(st) else 16)
    return tuple(out)


def tma_refusal(shape, strides, itemsize: int) -> str | None:
    """Why a contiguous cache (``shape`` (batch, seqlen_cache, nheads_k, headdim), element
    ``strides``) cannot be copied by TMA (:data:`FLAG_TMA`), or None when it can: unit stride
    in headdim, the strides of the other dims with more than one element positive multiples
    of 16 bytes below 2^40 (any order: a head-major cache works), every dim from 1 to 2^32.
    The pointer's 16-byte alignment is checked at launch, for every variant
    (:func:`run_split_variant`)."""
    if len(shape) != 4 or len(strides) != 4:
        return f"expected a 4-D cache, got shape {tuple(shape)}"
    if any(not 1 <= int(x) <= 2 ** 32 for x in shape):
        return f"every dim must lie in [1, 2^32], got shape {tuple(shape)}"
    if int(strides[3]) != 1:
        return f"headdim stride {strides[3]} is not 1"
    for name, n, st in zip(("batch", "row", "head"), shape[:3], strides[:3]):
        st = int(st) * itemsize
        if int(n) > 1 and not _tma_stride_ok(st):
            return f"{name} stride {st} bytes is not a positive multiple of 16 below 2^40"
    return None


def paged_copy_pointers_refusal(page_size: int, k_strides, v_strides) -> str | None:
    """Why a paged cache cannot take the copy-pointer kernel (:data:`FLAG_COPY_POINTERS`), or
    None when it can: the kernel needs a power-of-two ``page_size`` (a shift and a mask instead
    of a division) and 32-bit page strides and in-page row offsets (``k_strides``/``v_strides``:
    the caches' strides in elements, (page, row, head, dim)); launched otherwise, it traps."""
    if page_size < 1 or page_size & (page_size - 1):
        return f"page_size {page_size} is not a power of two"
    for name, st in (("k_cache", k_strides), ("v_cache", v_strides)):
        if not checks.page_strides_fit_i32(page_size, st):
            return (f"{name}: page stride {st[0]} or page_size x row stride {page_size * st[1]} "
                    "elements is negative or >= 2^31")
    return None


def split_kernel_spec(dtype: str, headdim: int, paged: bool, *, block_n: int | None = None,
                      nwarps: int | None = None, stages: int | None = None,
                      flags: int | None = None, page_size: int | None = None) -> jit.KernelSpec:
    """The split kernel for ``dtype`` and a compiled head dim (64, 128 or 256).

    Name ``decode_split_{bf16|fp16}_hd{D}_n{BLOCK_N}_w{NWARPS}_g{GROUP}_s{STAGES}[_paged]``
    followed by ``_fused``/``_ef``/``_pf256``/``_pf128``/``_wl``/``_cluster``/``_rel``/``_kvg``/
    ``_spid``/``_trearly``/``_trnone``/``_cp``/``_skip``/``_lazy``/``_qreg``/``_mf``/``_tma``/
    ``_spkv``/``_qasync`` for the
    ``flags`` bits (:data:`FLAG_FUSED_COMBINE`, ...); ``flags=None`` is what
    the public functions launch, :func:`default_flags` for ``page_size``
    (``_fused_rel_cp_qasync``; paged up to hd128 ``_fused_rel_spid_cp_qasync`` for power-of-two
    pages, else ``_fused_rel_spid_qasync``; paged hd256 ``_fused_rel_qasync``);
    ``block_n``/``nwarps``/``stages`` override :func:`split_config` (experiments).
    """
    if flags is None:
        flags = default_flags(headdim, paged, page_size)
    if not isinstance(flags, int) or flags < 0 or flags >= _FLAG_LIMIT:
        raise ValueError(f"flags: expected an int in [0, {_FLAG_LIMIT}), got {flags!r}")
    if flags & FLAG_PDL_EARLY_TRIGGER and flags & FLAG_PDL_NO_TRIGGER:
        raise ValueError("flags: FLAG_PDL_EARLY_TRIGGER and FLAG_PDL_NO_TRIGGER exclude each other")
    if flags & FLAG_WARP_LOCAL and paged:
        raise ValueError(f"flags: FLAG_WARP_LOCAL is for contiguous caches, got flags={flags}, "
                         f"paged={paged}")
    if flags & FLAG_Q_REGS and headdim > 128:
        raise ValueError(f"flags: FLAG_Q_REGS is for head dims up to 128 (the hd256 kernel is at "
                         f"255 registers and would spill), got headdim={headdim}")
    _tma_excludes = (FLAG_WARP_LOCAL | FLAG_KV_GROUPS | FLAG_COPY_POINTERS | FLAG_EVICT_FIRST
                     | FLAG_PREFETCH_256 | FLAG_PREFETCH_128)
    if flags & FLAG_TMA and (paged or flags & _tma_excludes):
        raise ValueError(f"flags: FLAG_TMA is for contiguous caches, without the cp.async path's "
                         f"flags (warp-local, K/V groups, copy pointers, L2 hints), got "
                         f"flags={flags}, paged={paged}")
    if flags & FLAG_SPEC_KV and (paged or not flags & FLAG_COPY_POINTERS
                                 or flags & (FLAG_WARP_LOCAL | FLAG_KV_GROUPS | FLAG_TMA)):
        raise ValueError(f"flags: FLAG_SPEC_KV is for contiguous caches with FLAG_COPY_POINTERS, "
                         f"without warp-local copies, K/V groups or TMA, got flags={flags}, "
                         f"paged={paged}")
    if flags & FLAG_Q_ASYNC and flags & (FLAG_TMA | FLAG_WARP_LOCAL | FLAG_Q_REGS | FLAG_SPEC_KV):
        raise ValueError(f"flags: FLAG_Q_ASYNC is for the CTA pipeline with cp.async copies, "
                         f"without TMA, warp-local copies, Q in registers or the speculative "
                         f"prologue, got flags={flags}")
    if flags & FLAG_PREFETCH_256 and flags & FLAG_PREFETCH_128:
        raise ValueError(f"flags: FLAG_PREFETCH_256 and FLAG_PREFETCH_128 exclude each other, "
                         f"got {flags}")
    if dtype not in DTYPES:
        raise TypeError(f"dtype: {dtype} has no decode kernel; supported: {', '.join(DTYPES)}")
    if headdim not in HEADDIMS:
        raise ValueError(f"headdim: compiled head dims are {HEADDIMS}, got {headdim}")
    cfg = split_config(headdim)
    bn = cfg.block_n if block_n is None else block_n
    nw = cfg.nwarps if nwarps is None else nwarps
    st = cfg.stages if stages is None else stages
    if flags & FLAG_TMA and not 16 <= bn <= 256:
        raise ValueError(f"block_n: FLAG_TMA copies a tile as boxes of block_n keys, 16 to 256 "
                         f"(the TMA box limit), got {bn}")
    copy_pass = nw * 32 // (headdim // 8)  # key rows per copy pass (16-byte chunks per row)
    if paged and flags & FLAG_COPY_POINTERS and (bn & (bn - 1) or copy_pass & (copy_pass - 1)):
        raise ValueError(f"flags: FLAG_COPY_POINTERS on a paged cache needs block_n and the copy "
                         f"pass (nwarps * 32 / (headdim / 8) key rows) to be powers of two, got "
                         f"block_n={bn}, pass={copy_pass}")
    name = (f"decode_split_{_SHORT[dtype]}_hd{headdim}_n{bn}_w{nw}_g{GROUP}_s{st}"
            + ("_paged" if paged else "")
            + "".join(suffix for bit, suffix in _FLAG_SUFFIX if flags & bit))
    kernel = "decode_split_tma_kernel" if flags & FLAG_TMA else "decode_split_kernel"
    entry = (f"cf::{kernel}<{_CTYPE[dtype]}, {headdim}, {bn}, {nw}, {GROUP}, {st}, "
             f"{'true' if paged else 'false'}, {flags}>")
    return jit.KernelSpec(name, SOURCE, entry, split_smem_bytes(dtype, headdim, bn, st, flags))


kernel_spec = split_kernel_spec


def combine_kernel_spec(dtype: str) -> jit.KernelSpec:
    """The combine (merge) kernel writing ``dtype`` (float16, bfloat16 or float32)."""
    if dtype not in _CTYPE:
        raise TypeError(f"dtype: {dtype} has no combine kernel; supported: {', '.join(_CTYPE)}")
    return jit.KernelSpec(f"decode_combine_{_SHORT[dtype]}", SOURCE,
                          f"cf::decode_combine_kernel<{_CTYPE[dtype]}>")


def append_kernel_spec(paged: bool) -> jit.KernelSpec:
    """The KV-append kernel (raw 16-bit element copy, for float16 and bfloat16 caches)."""
    return jit.KernelSpec("decode_append_b16" + ("_paged" if paged else ""), SOURCE,
                          f"cf::decode_append_kernel<unsigned short, {'true' if paged else 'false'}>")


def all_specs() -> list:
    """Every specialisation the public functions can launch (the supported set, as a table)."""
    # paged caches: pages of a power-of-two size (16: copy pointers up to hd128) and others (3)
    layouts = ((False, None), (True, 16), (True, 3))
    specs = [split_kernel_spec(dt, hd, pg, page_size=ps) for dt in DTYPES for hd in HEADDIMS
             for pg, ps in layouts]
    # the two-blocks-per-SM tile of head dims with a one-block tile (several waves)
    specs += [split_kernel_spec(dt, hd, pg, block_n=SPLIT_CONFIGS[hd].block_n,
                                nwarps=SPLIT_CONFIGS[hd].nwarps, stages=SPLIT_CONFIGS[hd].stages,
                                page_size=ps)
              for dt in DTYPES for hd in ONE_BLOCK_SPLIT_CONFIGS for pg, ps in layouts]
    # two-stage pipelines on contiguous caches (heuristics.choose_split_stages): both hd128 tiles
    specs += [split_kernel_spec(dt, hd, False, block_n=c.block_n, nwarps=c.nwarps, stages=2)
              for dt in DTYPES for hd, c1 in ONE_BLOCK_SPLIT_CONFIGS.items()
              for c in (c1, SPLIT_CONFIGS[hd])]
    specs = list({s.name: s for s in specs}.values())  # hd256: the same kernel for any page
    specs += [combine_kernel_spec(dt) for dt in _CTYPE]
    specs += [append_kernel_spec(pg) for pg in (False, True)]
    return specs


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
    """How a :func:`flash_attn_with_kvcache` call launches (the fields the launch code needs;
    :func:`plan_decode` turns it into a :class:`cupyflash.dispatch.Plan` for ``explain``).

    kernel, template : split-kernel specialisation name and its template values.
    grid, block, smem_bytes : launch shape of the split kernel (dynamic shared memory, bytes);
        grid ``(nheads_k * row_chunks, num_splits, batch)`` for contiguous caches (the kernel's
        grid_order 1), ``(num_splits, batch, nheads_k * row_chunks)`` for paged ones.
    registers, spill_bytes : from the ptxas report (None unless requested).
    num_splits : blocks along the key axis (grid y, paged: grid x).
    split_tiles : fixed tiles per split (``split_size`` mode), 0 = each sequence's tiles divided
        into ``num_splits`` equal parts.
    row_chunks : blocks per KV head along the query rows.
    combine, append : names of the combine / append kernels launched (None if not).
    workspace_elems : elements (4 bytes) of workspace used (0 with one split): the fp32
        partials, then ``counter_elems`` int32 arrival counters of the fused combine.
    counter_elems : int32 counters at the end of the workspace (``batch * nheads_k *
        row_chunks``; 0 with one split). They must be zero before a launch; each launch leaves
        them zero (see :func:`alloc_workspace`).
    hbm_bytes, flops : I/O model at full cache capacity (cupyflash.io_model).
    reasons : why each choice was made / alternatives rejected.
    reason_topics : the topic of each reason (:data:`REASON_TOPICS`), same length.
    """
    kernel: str
    template: dict
    grid: tuple
    block: tuple
    smem_bytes: int
    num_splits: int
    split_tiles: int
    row_chunks: int
    combine: str | None
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
        From :func:`cupyflash.checks.check_kvcache`.
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
                             stages=stages, page_size=_flags_page_size(p))
    if p.paged:
        why("copies", _page_copy_reason(hd, p.page_size, p.page_offsets_fit_i32))
    if p.q_aligned16:
        why("copies", "q: the Q tile by 16-byte cp.async beside the length (FLAG_Q_ASYNC, v44); "
                      "a q whose pointer or strides are not 16-byte multiples would take 2-byte "
                      "loads")
    else:
        why("copies", "q: its strides (or pointer) are not 16-byte multiples: the Q tile by "
                      "2-byte loads after the K/V copies instead of 16-byte cp.async (bitwise "
                      "the same result; up to 5 us slower at short caches, v44); a contiguous "
                      "q avoids it")
    combine = None  # the fused last-block-done combine (default_flags): no combine launch
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
    from . import io_model
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
        grid=grid,
        block=(cfg.nwarps * 32, 1, 1),
        smem_bytes=smem, num_splits=num_splits, split_tiles=split_tiles, row_chunks=row_chunks,
        combine=combine, append=append, workspace_elems=ws, hbm_bytes=int(hbm), flops=int(flops),
        reasons=tuple(reasons), reason_topics=tuple(topics), registers=regs, spill_bytes=spill,
        counter_elems=counters)


def _flags_page_size(p) -> int | None:
    """The ``page_size`` that :func:`default_flags` sees for problem ``p``: None (no copy
    pointers) for contiguous caches and for pools whose page offsets need more than 32 bits."""
    return p.page_size if p.paged and p.page_offsets_fit_i32 else None


def _page_copy_reason(headdim: int, page_size: int, offsets_fit_i32: bool = True) -> str:
    """The explain() line saying how a paged cache's K/V copies find their pages (v20)."""
    if headdim <= 128 and page_size & (page_size - 1) == 0 and not offsets_fit_i32:
        return (f"page_size {page_size}: a page stride or page_size x row stride of k_cache or "
                "v_cache is negative or >= 2^31 elements: the general paged path (page ids "
                "per key row, 64-bit offsets), slower than copy pointers (v20)")
    if default_flags(headdim, True, page_size) & FLAG_COPY_POINTERS:
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
    """The :class:`cupyflash.dispatch.Plan` of a decode problem (what ``explain`` returns).

    ``kernel`` is the split kernel (it also merges the splits: fused combine);
    ``extra_kernels`` the append (if new tokens); ``reasons`` holds the ``(topic, why)`` pairs
    of :func:`launch_config` (topics :data:`REASON_TOPICS`: the split count, tile, pipeline
    depth, how Q and paged K/V are copied, and notes); ``rejected`` lists the other decode
    specialisations with the reason.

    Parameters
    ----------
    problem : checks.DecodeProblem
    split_size : int or None
        As in :func:`flash_attn_with_kvcache`.
    arch : str or None
        Architecture of the ptxas report; default the current device's, else ``"sm_90a"``.
        ``sm_80`` or newer (:func:`cupyflash.dispatch.check_arch`: TypeError / ValueError).
    report : bool
        Compile with NVRTC (no GPU needed) and fill registers / spills.
    num_sms, smem_per_sm, max_smem_per_block : int or None
        Device limits; default the current device's, else the H200's (132 SMs), with the shared
        memory of ``arch`` when one other than sm_90/sm_90a is named.
    """
    from . import dispatch
    if not isinstance(problem, checks.DecodeProblem):
        raise TypeError(f"problem: expected cupyflash.checks.DecodeProblem, got "
                        f"{type(problem).__name__}")
    dispatch.check_arch(arch)
    lim = _planning_limits(arch)
    dispatch.check_device_limits(num_sms=num_sms, smem_per_sm=smem_per_sm,
                                 max_smem_per_block=max_smem_per_block)
    h200_assumed = lim.get("assumed", False) and num_sms is None  # said in the plan's notes
    num_sms = lim["num_sms"] if num_sms is None else num_sms
    smem_per_sm = lim["smem_per_sm"] if smem_per_sm is None else smem_per_sm
    max_smem_per_block = lim["max_smem_per_block"] if max_smem_per_block is None \
        else max_smem_per_block
    arch = dispatch.default_arch() if arch is None else arch
    la = launch_config(problem, split_size=split_size, num_sms=num_sms, smem_per_sm=smem_per_sm,
                       max_smem_per_block=max_smem_per_block)
    p = problem
    t = la.template

    def choice(spec, grid, block, smem):
        regs = spill = None
        if report:
            rep = jit.compile_report(spec, arch).ptxas
            regs, spill = rep.registers, rep.spill_bytes
        return dispatch.KernelChoice(name=spec.name, entry=spec.entry, template=tmpl(spec),
                                     grid=grid, block=block, smem_bytes=smem, registers=regs,
                                     spill_bytes=spill, arch=arch if report else None, spec=spec)

    def tmpl(spec):
        return dict(t) if spec.name == la.kernel else {"dtype": p.dtype}

    split_spec = split_kernel_spec(p.dtype, t["headdim"], p.paged, block_n=t["block_n"],
                                   nwarps=t["nwarps"], stages=t["stages"],
                                   page_size=_flags_page_size(p))
    main = choice(split_spec, la.grid, la.block, la.smem_bytes)
    extra = []
    if la.append is not None:
        n = p.seqlen_new * p.nheads_k * p.headdim
        extra.append(choice(append_kernel_spec(p.paged), (-(-n // 256), p.batch, 1), (256, 1, 1),
                            0))
    if la.combine is not None:
        rows = p.batch * p.seqlen_q * p.nheads
        extra.append(choice(combine_kernel_spec(p.dtype), (-(-rows // 4), 1, 1), (128, 1, 1), 0))
    rejected = []
    for dt in DTYPES:
        for hd in HEADDIMS:
            for pg in (False, True):
                ps = _flags_page_size(p) if pg else None
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
        notes.append(dispatch.h200_assumed_note(num_sms))
    return dispatch.Plan(problem=p, kernel=main, num_splits=la.num_splits, flops=la.flops,
                         hbm_bytes=la.hbm_bytes, rejected=rejected, reasons=notes,
                         extra_kernels=tuple(extra), num_sms=num_sms,
                         workspace_elems=la.workspace_elems)


def explain_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
                    softmax_scale=None, causal=True, num_splits=0, return_lse=False, out=None,
                    split_size=None, validate=False, workspace=None, *, arch=None, report=True,
                    num_sms=None):
    """The :class:`cupyflash.dispatch.Plan` of a :func:`flash_attn_with_kvcache` call, without
    running it (accepts NumPy or CUDA arrays): the call's arguments, in the call's order, then
    keyword-only ``arch``, ``report`` and ``num_sms``.

    Raises what :func:`flash_attn_with_kvcache` raises for bad shapes, dtypes, layouts (a last
    dimension that is not contiguous, cache row strides that are not 16-byte multiples; a host
    array's pointer is not checked), options, ``return_lse`` and a ``workspace`` of the wrong
    dtype, size or layout; the values of ``cache_seqlens`` and ``block_table`` (lengths over the
    capacity, page ids outside the pool) are checked only with ``validate=True``, the call's
    default, here ``False``. ``arch`` and ``num_sms``: see :func:`plan_decode` (without a GPU: an
    H200's 132 SMs unless ``num_sms`` is given; ``arch`` must name sm_80 or newer)."""
    prob = checks.check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                softmax_scale=softmax_scale, causal=causal,
                                num_splits=num_splits, out=out, dtypes=DTYPES, validate=validate)
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
    """float32 elements of the split partials: partial O (num_splits, batch, seqlen_q, nheads,
    headdim) followed by partial LSE (num_splits, batch, nheads, seqlen_q); 0 for one split.
    The workspace of :func:`flash_attn_with_kvcache` has ``batch * nheads_k * row_chunks``
    int32 counters after them (:attr:`DecodeLaunch.counter_elems`, :func:`workspace_size`)."""
    if num_splits <= 1:
        return 0
    return num_splits * batch * seqlen_q * nheads * (headdim + 1)


# ----------------------------------------------------------------------------------------------
# GPU helpers
# ----------------------------------------------------------------------------------------------
def _device_limits() -> dict:
    import cupy
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
        from . import dispatch
        lim["max_smem_per_block"] = dispatch.max_smem_bytes_for_arch(arch)
        lim["smem_per_sm"] = lim["max_smem_per_block"] + _SMEM_RESERVED_PER_BLOCK
    return lim


@functools.lru_cache(maxsize=None)
def _device_limits_of(dev_id: int) -> dict:
    import cupy
    a = cupy.cuda.Device(dev_id).attributes
    return dict(num_sms=a["MultiProcessorCount"],
                smem_per_sm=a["MaxSharedMemoryPerMultiprocessor"],
                max_smem_per_block=a["MaxSharedMemoryPerBlockOptin"])


def _estrides(x) -> tuple:
    """Strides of a CuPy array in elements."""
    return tuple(s // x.dtype.itemsize for s in x.strides)


def _check_row_strides(shape, strides, name: str, ptr: int | None = None) -> None:
    """The split kernel copies 16-byte chunks of each cache row: rows must be 16-byte aligned
    (``strides`` in bytes; ``ptr`` the data pointer, None on the host)."""
    if (ptr is not None and ptr % 16 != 0) or not checks.rows_aligned16(shape, strides):
        where = f"pointer {ptr:#x}, " if ptr is not None else ""
        raise ValueError(f"{name}: rows must be 16-byte aligned for the decode kernel ({where}"
                         f"strides {tuple(strides)} bytes); pass a contiguous cache")


def _check_cache_alignment(x, name: str) -> None:
    """:func:`_check_row_strides` of a CuPy cache, its pointer included."""
    _check_row_strides(x.shape, x.strides, name, x.data.ptr)


def _check_workspace_alignment(ws) -> None:
    """The split kernel moves the fp32 partials as 16-byte vectors: the workspace must start on a
    16-byte boundary (any array CuPy allocates does; a slice such as ``ws[1:]`` does not)."""
    if ws.data.ptr % 16:
        raise ValueError(f"workspace: must start on a 16-byte boundary (pointer "
                         f"{ws.data.ptr:#x}); pass an array from alloc_workspace or cupy.zeros, "
                         "not an offset slice")


def _nullptr():
    return np.uint64(0)


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


def workspace_size(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
                   *, num_splits=0, split_size=None) -> int:
    """float32 elements of workspace that :func:`flash_attn_with_kvcache` needs for these
    arguments (0 when it runs as one split): the fp32 partials (:func:`workspace_elems`), then
    ``batch * nheads_k * ceil(nheads // nheads_k * seqlen_q / 16)`` int32 arrival counters of
    the fused combine, which must be zero before the first call (see :func:`alloc_workspace`).
    Reads shapes only (``validate=False``) and, for CUDA arrays, the current device's SM count
    and shared memory; for host (NumPy) arrays it plans for an H200 even when a GPU is present
    (sizing offline). A workspace sized for another GPU than the one that runs the call may be
    too small: the call then raises ValueError before launching."""
    prob = checks.check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                num_splits=num_splits, dtypes=DTYPES, validate=False)
    # host arrays: plan for an H200 (no device is touched)
    on_device = any(checks.is_device_array(x) for x in (q, k_cache, v_cache))
    return _resolve_plan(prob, split_size, use_device=on_device).workspace_elems


def alloc_workspace(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
                    *, num_splits=0, split_size=None):
    """A zero-filled float32 CuPy workspace for calls with these arguments' shapes: pass it as
    ``workspace=`` (with ``out=``, ``validate=False`` and ``return_lse=False``) to capture the
    call in a CUDA graph.
    Never empty, so it is always a valid argument.

    Workspace contract: the first :func:`workspace_elems` elements hold fp32 partials (any
    content before a call: NaN is fine, every split overwrites its part); the last
    :attr:`DecodeLaunch.counter_elems` elements are int32 arrival counters of the fused combine
    that must be zero before a launch. Every complete launch leaves them zero (the last block of
    each group resets its counter), so a workspace from this function (or any float32 array of
    at least :func:`workspace_size` elements that was zero-filled once) can be reused and
    replayed in CUDA graphs indefinitely. Do not share one workspace between launches that can
    run concurrently (other streams)."""
    import cupy
    n = workspace_size(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                       num_splits=num_splits, split_size=split_size)
    return cupy.zeros(max(n, 1), dtype=cupy.float32)


def _append_tail(prob, k, v, k_cache, v_cache, block_table) -> tuple:
    """Constant arguments of the append kernel after its 6 pointers (from layouts only)."""
    kn, vn, kc, vc = (_estrides(x) for x in (k, v, k_cache, v_cache))
    bt_bs = _estrides(block_table)[0] if block_table is not None else 0
    i64 = np.int64
    return (i64(kn[0]), i64(kn[1]), i64(kn[2]), i64(vn[0]), i64(vn[1]), i64(vn[2]),
            i64(kc[0]), i64(kc[1]), i64(kc[2]), i64(vc[0]), i64(vc[1]), i64(vc[2]), i64(bt_bs),
            np.int32(prob.seqlen_new), np.int32(prob.nheads_k), np.int32(prob.headdim),
            np.int32(prob.seqlen_cache), np.int32(max(prob.page_size, 1)),
            np.int32(prob.num_pages))


def _append_grid(prob) -> tuple:
    return (-(-(prob.seqlen_new * prob.nheads_k * prob.headdim) // 256), prob.batch, 1)


def _launch_append(prob, k, v, k_cache, v_cache, cache_seqlens, block_table):
    kern = jit.get_kernel(append_kernel_spec(prob.paged))
    bt = block_table if block_table is not None else _nullptr()
    kern(_append_grid(prob), (256, 1, 1),
         (k, v, k_cache, v_cache, cache_seqlens, bt)
         + _append_tail(prob, k, v, k_cache, v_cache, block_table))


def _combine_tail(op, lp, o, ls, num_parts, batch, seqlen, nheads, headdim) -> tuple:
    """Constant arguments of the combine kernel after its 4 pointers: element strides of the
    partial O (5 dims) and LSE (4 dims), of out (4 dims) and of the LSE out (3 dims, or None)."""
    lse_bs, lse_hs = (ls[0], ls[1]) if ls is not None else (0, 0)
    i64 = np.int64
    return (i64(op[0]), i64(op[1]), i64(op[2]), i64(op[3]),
            i64(lp[0]), i64(lp[1]), i64(lp[2]), i64(lp[3]),
            i64(o[0]), i64(o[1]), i64(o[2]), i64(lse_bs), i64(lse_hs),
            np.int32(num_parts), np.int32(batch), np.int32(seqlen), np.int32(nheads),
            np.int32(headdim))


def _combine_grid(batch, seqlen, nheads) -> tuple:
    return (-(-(batch * seqlen * nheads) // 4), 1, 1)


def _launch_combine(o_part, lse_part, out, lse_out, num_parts, batch, seqlen, nheads, headdim):
    """o_part/lse_part: float32 CuPy arrays (num_parts, batch, seqlen, nheads, headdim) /
    (num_parts, batch, nheads, seqlen), any strides with the head dim contiguous."""
    kern = jit.get_kernel(combine_kernel_spec(checks.dtype_name(out)))
    tail = _combine_tail(_estrides(o_part), _estrides(lse_part), _estrides(out),
                         _estrides(lse_out) if lse_out is not None else None,
                         num_parts, batch, seqlen, nheads, headdim)
    kern(_combine_grid(batch, seqlen, nheads), (128, 1, 1),
         (o_part, lse_part, out, lse_out if lse_out is not None else _nullptr()) + tail)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                            block_table=None, softmax_scale=None, causal=True, num_splits=0,
                            return_lse=False, out=None, split_size=None, validate=True,
                            workspace=None):
    """Attention of new query tokens against a KV cache, split over the keys (Flash-Decoding).

    Sequence ``b`` attends to its first ``L_b = cache_seqlens[b] + seqlen_new`` keys: the cached
    tokens, then the new ``k[b]``/``v[b]``, which are first written into the cache at positions
    ``cache_seqlens[b] ... L_b - 1`` (in place; ``cache_seqlens`` itself is not changed). Query
    head ``h`` reads KV head ``h // (nheads // nheads_k)`` (GQA/MQA). Causal masking is aligned
    bottom-right: query row ``i`` sees key ``j`` iff ``j <= L_b - seqlen_q + i``. Nothing at or
    beyond ``L_b`` (cache tail, last page's tail, unused pages) is read into the result.

    Algorithm: Flash-Decoding (Dao et al. 2023, "Flash-Decoding for long-context inference"):
    FlashAttention-2 (arXiv 2307.08691, Sec. 3.1) over ``num_splits`` key ranges per sequence,
    in parallel, then an exact LSE-weighted merge in fp32 (the merge of :func:`merge_states`,
    done by the last split block of each head: one launch).

    Parameters
    ----------
    q : CUDA array, shape (batch, seqlen_q, nheads, headdim), float16 or bfloat16
        ``seqlen_q`` >= 1 (1 = decoding; up to 16 rows per KV head share one block, more rows
        use more blocks); ``headdim`` a multiple of 8 up to 256.
    k_cache, v_cache : CUDA arrays, same dtype as ``q``
        Contiguous: (batch, seqlen_cache, nheads_k, headdim). Paged (``block_table`` given):
        (num_pages, page_size, nheads_k, headdim), any ``page_size >= 1`` (powers of two are the
        fast sizes; see the module notes). Rows must be 16-byte aligned (true for contiguous
        caches). Modified in place when ``k``/``v`` are given.
    k, v : CUDA arrays or None, shape (batch, seqlen_new, nheads_k, headdim)
        New tokens to append before attending.
    cache_seqlens : int32 CUDA array, shape (batch,), or None
        Cached tokens per sequence before appending; None = the whole contiguous cache.
    block_table : int32 CUDA array, shape (batch, max_pages_per_seq), or None
        Page ids: token ``t`` of sequence ``b`` lives in page ``block_table[b, t // page_size]``
        at row ``t % page_size``. Only the entries a sequence uses are read.
    softmax_scale : float or None
        Scale of ``q k^T``; None = ``1/sqrt(headdim)``.
    causal : bool
        Bottom-right causal mask (default True, as decoding needs; note that FlashAttention's
        ``flash_attn_with_kvcache`` defaults to False).
    num_splits : int
        0 = :func:`cupyflash.decode.choose_num_splits` (from shapes and the device's SM count and
        shared memory only, never from ``cache_seqlens``; it may also switch hd128 to the
        two-blocks-per-SM tile when the batch needs several waves); any value >= 1 is honoured,
        including more splits than tiles (empty splits are harmless).
    return_lse : bool
        Also return the natural-log LSE, float32 (batch, nheads, seqlen_q); -inf for a row that
        sees no key (its output is 0).
    out : CUDA array or None
        Output, same shape and dtype as ``q`` (allocated if None).
    split_size : int or None
        Fixed keys per split (rounded up to the tile size, 32-128 keys): split boundaries depend
        only on the sequence, so a row's result is bitwise the same alone or in any batch.
        Overrides ``num_splits``.
    validate : bool
        Read ``cache_seqlens`` and ``block_table`` on the host (a synchronisation) and raise on
        lengths above the capacity and page ids outside ``[0, num_pages)``. With False nothing
        is read on the host; the kernels still never access memory outside the cache (bad
        lengths are clamped to the capacity and rows of bad pages are zero-filled: the result
        of such a call is unspecified, not unsafe).
    workspace : float32 CUDA array or None
        Scratch for the fp32 partials and the fused combine's int32 counters, at least
        :func:`cupyflash.decode.workspace_size` elements, from
        :func:`cupyflash.decode.alloc_workspace` (or zero-filled once: the counters at its end must
        start at zero; each launch leaves them zero), contiguous and 16-byte aligned. If None, the
        partials come from CuPy's memory pool and the counters from a zero-filled buffer kept per
        (device, stream) (per host thread on CuPy's per-thread default stream); such a call cannot
        be captured in a CUDA graph. Pass it (with ``out``, ``validate=False`` and
        ``return_lse=False``) to capture in a CUDA graph.

    Returns
    -------
    out : CUDA array, shape (batch, seqlen_q, nheads, headdim), dtype of ``q``
    lse : float32 CUDA array, shape (batch, nheads, seqlen_q)
        Only if ``return_lse``.

    Raises
    ------
    TypeError
        Host arrays (use :func:`cupyflash.reference.kvcache_attention_reference`), float32 or
        float64 (no tensor-core decode path), other errors of
        :func:`cupyflash.checks.check_kvcache`, a workspace that is not float32.
    ValueError
        From :func:`cupyflash.checks.check_kvcache` (shapes, lengths, page ids with
        ``validate``); unaligned cache rows; bad ``split_size``; a workspace too small or not
        16-byte aligned; no ``workspace`` while the stream captures a CUDA graph (with more
        than one split); a grid dimension over its limit (see
        :func:`cupyflash.decode.launch_config`).
    """
    opts = _plain_options(softmax_scale, causal, num_splits, split_size, return_lse)
    if opts is not None and validate is False:  # the warm path (dispatch.LAUNCH_CACHE)
        r = _cached_call(opts, q, k_cache, v_cache, k, v, cache_seqlens, block_table, out,
                         workspace)
        if r is not None:
            return r
    prob = checks.check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                softmax_scale=softmax_scale, causal=causal,
                                num_splits=num_splits, out=out, dtypes=DTYPES, validate=validate)
    from .interop import is_device_array
    if not is_device_array(q):
        raise TypeError("q: flash_attn_with_kvcache runs on the GPU, got a host array "
                        f"{type(q).__name__}; use cupyflash.reference.kvcache_attention_reference")
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    dt = prob.dtype
    q = as_cupy(q, "q", dt)
    k_cache = as_cupy(k_cache, "k_cache", dt)
    v_cache = as_cupy(v_cache, "v_cache", dt)
    k = None if k is None else as_cupy(k, "k", dt)
    v = None if v is None else as_cupy(v, "v", dt)
    out = None if out is None else as_cupy(out, "out", dt)
    cache_seqlens = None if cache_seqlens is None else as_cupy(cache_seqlens, "cache_seqlens", "int32")
    block_table = None if block_table is None else as_cupy(block_table, "block_table", "int32")
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v), ("out", out),
                    ("cache_seqlens", cache_seqlens), ("block_table", block_table)):
        if a is not None and a.device.id != q.device.id:
            raise ValueError(f"{name}: on CUDA device {a.device.id}, but q is on device "
                             f"{q.device.id}; pass all arrays on one device")
    _check_cache_alignment(k_cache, "k_cache")
    _check_cache_alignment(v_cache, "v_cache")
    with q.device:
        return _run_kvcache(prob, q, k_cache, v_cache, k, v, cache_seqlens, block_table, out,
                            return_lse, split_size, workspace, opts)


def _plain_options(softmax_scale, causal, num_splits, split_size, return_lse):
    """The launch-cache options ``("kvcache", softmax_scale, causal, num_splits, split_size,
    return_lse)`` when all are plain values of exact types (None or float; bool; int; None or
    int; bool), else None (such calls are validated and planned every time)."""
    if (type(causal) is bool and type(return_lse) is bool and type(num_splits) is int
            and (softmax_scale is None or type(softmax_scale) is float)
            and (split_size is None or type(split_size) is int)):
        return ("kvcache", softmax_scale, causal, num_splits, split_size, return_lse)
    return None


def _cached_call(opts, q, k_cache, v_cache, k, v, cache_seqlens, block_table, out, workspace):
    """A warm call (``validate=False``) from a :data:`cupyflash.dispatch.LAUNCH_CACHE` hit, or
    None when the arguments are not all ``cupy.ndarray``, not cached yet, on different devices
    or with unaligned cache pointers (the full path then validates: it raises or caches)."""
    from . import dispatch
    from .interop import cupy_ndarray_type
    nd = cupy_ndarray_type()
    arrays = (q, k_cache, v_cache, k, v, cache_seqlens, block_table, out, workspace)
    if nd is None or type(q) is not nd:
        return None
    for a in arrays:
        if a is not None and type(a) is not nd:
            return None
    dev = q.data.device_id
    entry = dispatch.LAUNCH_CACHE.get(dispatch.launch_key(opts[0], dev, opts[1:], arrays))
    if entry is None:
        return None
    for a in arrays:
        if a is not None and a.data.device_id != dev:
            return None
    if (k_cache.data.ptr | v_cache.data.ptr | (workspace.data.ptr if workspace is not None
                                                else 0)) % 16:
        return None
    import cupy
    if cupy.cuda.runtime.getDevice() == dev:
        return _execute_kvcache(entry, q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                out, workspace)
    with q.device:
        return _execute_kvcache(entry, q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                out, workspace)


def _run_kvcache(prob, q, k_cache, v_cache, k, v, cache_seqlens, block_table, out, return_lse,
                 split_size, workspace, opts=None):
    """Plan (cached in :data:`cupyflash.dispatch.LAUNCH_CACHE` when ``opts`` are plain), then
    allocate what the caller did not pass and launch append / split / combine. Arrays are CuPy
    views on the current device, validated."""
    from . import dispatch
    from .interop import cupy_ndarray_type
    plan = _resolve_plan(prob, split_size)  # also validates split_size
    if plan.workspace_elems and workspace is not None:
        workspace = as_cupy(workspace, "workspace", checks.dtype_name(workspace))
        # every call (the launch cache keys layouts, not pointers)
        _check_workspace_alignment(workspace)
    elif workspace is not None and type(workspace) is not cupy_ndarray_type():
        opts = None  # an unused workspace of another kind: its layout is no key
    arrays = (q, k_cache, v_cache, k, v, cache_seqlens, block_table, out, workspace)
    key = None
    if opts is not None:
        key = dispatch.launch_key(opts[0], q.device.id, opts[1:], arrays)
    entry = dispatch.LAUNCH_CACHE.get(key) if key is not None else None
    if entry is None:
        entry = _KVCacheLaunch(prob, plan, q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                               out, return_lse, workspace)
        if key is not None:
            dispatch.cache_put(key, entry)
    return _execute_kvcache(entry, *arrays)


class _KVCacheLaunch:
    """One :data:`cupyflash.dispatch.LAUNCH_CACHE` entry of :func:`flash_attn_with_kvcache`:
    the plan, the kernels and their constant arguments (NumPy scalars, from the layouts), built
    once per key after the checks; :func:`_execute_kvcache` adds the pointers per call."""
    __slots__ = ("prob", "plan", "return_lse", "lse_shape", "copy_seqlens", "ws_need",
                 "o_part_bytes", "counters_bytes", "counters_nbytes", "append_kernel",
                 "append_grid", "append_tail", "split_kernel", "split_tail", "split_end",
                 "append_pdl", "split_pdl")

    def __init__(self, prob, plan, q, k_cache, v_cache, k, v, cache_seqlens, block_table, out,
                 return_lse, workspace):
        from .dispatch import _ContiguousLayout
        self.prob, self.plan, self.return_lse = prob, plan, return_lse
        ns = plan.num_splits
        self.copy_seqlens = cache_seqlens is not None and cache_seqlens.strides[0] != 4
        b, sq, h, d = prob.batch, prob.seqlen_q, prob.nheads, prob.headdim
        self.lse_shape = (b, h, sq) if return_lse else None
        self.ws_need = plan.workspace_elems
        if self.ws_need and workspace is not None:  # checked before anything is launched
            _check_workspace(workspace, self.ws_need)
        rows = b * sq * h
        # workspace: partial O, partial LSE (fp32), then the fused combine's int32 counters
        self.o_part_bytes = 4 * ns * rows * d
        self.counters_bytes = 4 * ns * rows * (d + 1)
        self.counters_nbytes = 4 * plan.counter_elems
        import cupy
        pdl_ok = int(cupy.cuda.Device().compute_capability) >= 90
        self.append_kernel = self.append_tail = self.append_grid = self.append_pdl = None
        if prob.seqlen_new > 0 and b > 0:
            self.append_kernel = jit.get_kernel(append_kernel_spec(prob.paged))
            self.append_grid = _append_grid(prob)
            self.append_tail = _append_tail(prob, k, v, k_cache, v_cache, block_table)
            if pdl_ok:
                self.append_pdl = launch.PreparedLaunch(
                    self.append_kernel, self.append_grid, (256, 1, 1),
                    (_NULL,) * 6 + self.append_tail, range(6))
        self.split_kernel = self.split_tail = self.split_end = self.split_pdl = None
        if b == 0 or sq == 0:  # no query rows: an empty grid is not launchable
            return
        if out is None:
            out = _ContiguousLayout(q.shape, q.dtype)
        t = plan.template
        self.split_kernel = jit.get_kernel(split_kernel_spec(
            prob.dtype, t["headdim"], prob.paged, block_n=t["block_n"], nwarps=t["nwarps"],
            stages=t["stages"], page_size=_flags_page_size(prob)))
        qs, ks, vs, os_ = (_estrides(x) for x in (q, k_cache, v_cache, out))
        lse_bs, lse_hs = (h * sq, sq) if return_lse else (0, 0)  # contiguous (b, h, sq)
        bt_bs = _estrides(block_table)[0] if block_table is not None else 0
        page_size = prob.page_size if prob.paged else 1
        page_shift = int(math.log2(page_size)) if page_size & (page_size - 1) == 0 else -1
        i64, i32 = np.int64, np.int32
        self.split_tail = (
            i64(qs[0]), i64(qs[1]), i64(qs[2]),
            i64(ks[0]), i64(ks[1]), i64(ks[2]),
            i64(vs[0]), i64(vs[1]), i64(vs[2]),
            i64(os_[0]), i64(os_[1]), i64(os_[2]),
            i64(lse_bs), i64(lse_hs), i64(bt_bs),
            i32(prob.batch), i32(prob.nheads), i32(prob.nheads_k), i32(prob.seqlen_q),
            i32(prob.headdim), i32(prob.seqlen_cache), i32(prob.seqlen_new), i32(page_size),
            i32(page_shift), i32(prob.num_pages), i32(ns), i32(plan.split_tiles),
            i32(plan.row_chunks), i32(1 if prob.causal else 0),
            np.float32(prob.softmax_scale * math.log2(math.e)))
        # counters (one split: unused), grid order (_grid_order)
        self.split_end = (_NULL, i32(_grid_order(prob.paged)))
        if pdl_ok:  # pointers: the 9 of the head, then the counters
            n = 9 + len(self.split_tail)
            self.split_pdl = launch.PreparedLaunch(
                self.split_kernel, plan.grid, plan.block,
                (_NULL,) * 9 + self.split_tail + self.split_end, tuple(range(9)) + (n,),
                shared_mem=plan.smem_bytes)


_NULL = np.uint64(0)  # a NULL pointer argument (CuPy would pass None as a NULL *argument*)

# The fused combine's counters for calls without ``workspace=``: one zero-filled int32 buffer
# per (device, stream), grown on demand. Every complete launch leaves the counters it used at
# zero, so calls in stream order can share them whatever their shapes, and a call costs no
# memset launch (bench_decode v18: ~0.6 us of a 12 us call at batch 1). Keyed by the stream
# object (a weak reference, whose death drops the entry): a new stream that reuses a destroyed
# one's handle gets a new buffer. CuPy's per-thread default stream is one object whose work runs
# on each host thread's own CUDA stream, so its buffers are kept per host thread.
_COUNTERS: dict = {}
_COUNTERS_PER_THREAD = threading.local()


def _drop_counters(table: dict, key, ref) -> None:
    """Weak-reference callback: the stream died; forget its buffer (unless already replaced)."""
    hit = table.get(key)
    if hit is not None and hit[0] is ref:
        del table[key]


def _stream_counters(nbytes: int) -> int:
    """Device address of at least ``nbytes`` zero bytes of counters for the current stream.

    Raises
    ------
    ValueError
        The stream is capturing a CUDA graph (the caller must pass ``workspace=``)."""
    import cupy
    stream = cupy.cuda.get_current_stream()
    try:
        capturing = cupy.cuda.runtime.streamIsCapturing(stream.ptr)
    except cupy.cuda.runtime.CUDARuntimeError:  # the legacy stream during a global capture
        capturing = True
    if capturing:
        raise ValueError("workspace: a call captured in a CUDA graph needs workspace= "
                         "(alloc_workspace): a buffer allocated inside the call would be freed "
                         "while the graph still uses it")
    device = cupy.cuda.runtime.getDevice()
    if stream.ptr == cupy.cuda.runtime.streamPerThread:
        table = _COUNTERS_PER_THREAD.__dict__.setdefault("table", {})
    else:
        table = _COUNTERS
    key = (device, stream.ptr)
    hit = table.get(key)
    if hit is None or hit[0]() is not stream or hit[1].nbytes < nbytes:
        buf = cupy.zeros(max(-(-nbytes // 4), 1024), cupy.int32)  # memset on this stream
        ref = weakref.ref(stream, functools.partial(_drop_counters, table, key))
        table[key] = hit = (ref, buf)
    return hit[1].data.ptr


def _execute_kvcache(e, q, k_cache, v_cache, k, v, cache_seqlens, block_table, out, workspace):
    """Allocate what the caller did not pass and launch append / split / combine for the
    :class:`_KVCacheLaunch` ``e`` on the current device (that of every array)."""
    import cupy
    counters = None  # device address of the fused combine's counters
    if e.ws_need and workspace is None:
        # first, before anything is enqueued (refused while capturing a graph): the counters
        # from the stream's zero buffer, the partials from CuPy's pool (no kernel)
        counters = _stream_counters(e.counters_nbytes)
        workspace = cupy.empty(e.counters_bytes // 4, cupy.float32)
    elif e.ws_need:
        counters = workspace.data.ptr + e.counters_bytes
    if e.copy_seqlens:
        cache_seqlens = cupy.ascontiguousarray(cache_seqlens)
    if out is None:
        out = cupy.empty(q.shape, q.dtype)
    lse = cupy.empty(e.lse_shape, cupy.float32) if e.lse_shape is not None else None
    ns = e.plan.num_splits
    bt = block_table if block_table is not None else _NULL
    pdl = PDL and e.split_pdl is not None
    if pdl:  # programmatic dependent launches (module docstring), pointers as ints
        stream = cupy.cuda.get_current_stream().ptr
        bt_ptr = block_table.data.ptr if block_table is not None else 0
        cs_ptr = cache_seqlens.data.ptr if cache_seqlens is not None else 0
        if e.append_pdl is not None:
            e.append_pdl((k.data.ptr, v.data.ptr, k_cache.data.ptr, v_cache.data.ptr, cs_ptr,
                          bt_ptr), stream)
        ws = workspace.data.ptr if ns > 1 else 0
        e.split_pdl((q.data.ptr, k_cache.data.ptr, v_cache.data.ptr, cs_ptr, bt_ptr,
                     out.data.ptr, lse.data.ptr if lse is not None else 0, ws,
                     ws + e.o_part_bytes if ns > 1 else 0, counters if ns > 1 else 0),
                    stream)
        return (out, lse) if e.return_lse else out
    if e.append_tail is not None:  # append first; same stream, so the split kernel sees it
        e.append_kernel(e.append_grid, (256, 1, 1),
                        (k, v, k_cache, v_cache, cache_seqlens, bt) + e.append_tail)
    if e.split_tail is not None:
        cs = cache_seqlens if cache_seqlens is not None else _NULL
        lse_arg = lse if lse is not None else _NULL
        p = e.plan
        if ns > 1:  # fused combine: the last block of each group writes out and lse
            ptr = workspace.data.ptr
            head = (q, k_cache, v_cache, cs, bt, out, lse_arg, np.uint64(ptr),
                    np.uint64(ptr + e.o_part_bytes))
            end = (np.uint64(counters), e.split_end[1])
        else:
            head = (q, k_cache, v_cache, cs, bt, out, lse_arg, _NULL, _NULL)
            end = e.split_end
        e.split_kernel(p.grid, p.block, head + e.split_tail + end, shared_mem=p.smem_bytes)
    return (out, lse) if e.return_lse else out


def merge_states(o_parts, lse_parts):
    """Exact merge of partial attention states on the GPU (Flash-Decoding's combine step; also
    cascade and distributed attention).

    With ``m = max_s lse_s`` and ``w_s = exp(lse_s - m)``: ``o = sum_s w_s o_s / sum_s w_s`` and
    ``lse = m + log(sum_s w_s)``, in fp32. Parts with ``lse = -inf`` contribute nothing (their
    ``o`` is never read, so it may hold NaN); a row whose parts are all empty gives 0 and -inf.
    The NumPy twin is :func:`cupyflash.reference.merge_states`.

    Parameters
    ----------
    o_parts : CUDA array, shape (num_parts, batch, seqlen, nheads, headdim)
        Normalised partial outputs, float16, bfloat16 or float32 (converted to float32 first).
    lse_parts : CUDA array, shape (num_parts, batch, nheads, seqlen)
        Natural-log partial LSEs, float32 or float64 (converted to float32).

    Returns
    -------
    o : CUDA array, shape (batch, seqlen, nheads, headdim), dtype of ``o_parts``
    lse : float32 CUDA array, shape (batch, nheads, seqlen)

    Raises
    ------
    TypeError
        Host arrays (use :func:`cupyflash.reference.merge_states`), float64 ``o_parts``, and the
        errors of :func:`cupyflash.checks.check_merge`.
    ValueError
        From :func:`cupyflash.checks.check_merge`.
    """
    num_parts, batch, seqlen, nheads, headdim = checks.check_merge(o_parts, lse_parts)
    from .interop import is_device_array
    if not is_device_array(o_parts):
        raise TypeError("o_parts: merge_states runs on the GPU, got a host array "
                        f"{type(o_parts).__name__}; use cupyflash.reference.merge_states")
    dt = checks.dtype_name(o_parts)
    if dt not in _CTYPE:
        raise TypeError(f"o_parts: dtype {dt} is not supported on the GPU; supported: "
                        f"{', '.join(_CTYPE)} (float64: cupyflash.reference.merge_states)")
    import cupy
    o_parts = as_cupy(o_parts, "o_parts", dt)
    lse_parts = as_cupy(lse_parts, "lse_parts", checks.dtype_name(lse_parts))
    with o_parts.device:
        o32 = o_parts if dt == "float32" else o_parts.astype(cupy.float32)
        l32 = lse_parts if lse_parts.dtype == cupy.float32 else lse_parts.astype(cupy.float32)
        out = cupy.empty((batch, seqlen, nheads, headdim), o_parts.dtype)
        lse = cupy.empty((batch, nheads, seqlen), cupy.float32)
        if out.size:  # an empty grid is not launchable
            _launch_combine(o32, l32, out, lse, num_parts, batch, seqlen, nheads, headdim)
    return out, lse


# ----------------------------------------------------------------------------------------------
# Experiments: split-kernel variants (experiments/sweep_decode_variants.py, tests/gpu/test_decode_gpu.py)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SplitVariant:
    """A split-kernel configuration to measure against the default: tile shape (``block_n``
    keys, ``nwarps`` warps, ``stages`` buffers), ``flags`` (the ``FLAG_*`` bits; the public
    path launches :func:`default_flags`, while ``flags=0`` is the unfused kernel followed by a
    separate combine launch) and ``grid_order`` (0: grid (splits, batch, nheads_k *
    row_chunks); 1: (nheads_k * row_chunks, splits, batch), so the blocks of the KV heads of one
    key range are launched together)."""
    block_n: int
    nwarps: int
    stages: int
    flags: int = 0
    grid_order: int = 0
    pdl: bool = False  # launched as a programmatic dependent launch (sm_90+)
    l2_promotion: int | None = 256  # FLAG_TMA: the tensor maps' L2 fetch size (bytes)

    @property
    def name(self) -> str:
        return (f"n{self.block_n}_w{self.nwarps}_s{self.stages}"
                + "".join(sfx for bit, sfx in _FLAG_SUFFIX if self.flags & bit)
                + ("_hfirst" if self.grid_order else "") + ("_pdl" if self.pdl else "")
                + (f"_l2p{self.l2_promotion or 0}"
                   if self.flags & FLAG_TMA and self.l2_promotion != 256 else ""))

    def spec(self, dtype: str, headdim: int, paged: bool) -> jit.KernelSpec:
        return split_kernel_spec(dtype, headdim, paged, block_n=self.block_n, nwarps=self.nwarps,
                                 stages=self.stages, flags=self.flags)

    def workspace_elems(self, batch, seqlen_q, nheads, nheads_k, headdim, num_splits) -> int:
        """float32 elements: partial O and LSE, then (fused combine) int32 counters
        (batch, nheads_k * row_chunks), which must be zero before the first launch; none when
        the variant merges in a cluster (:data:`FLAG_CLUSTER_COMBINE`, up to 16 splits)."""
        if self.flags & FLAG_CLUSTER_COMBINE and num_splits <= launch.MAX_CLUSTER:
            return 0
        n = workspace_elems(batch, seqlen_q, nheads, headdim, num_splits)
        if n and self.flags & FLAG_FUSED_COMBINE:
            n += batch * nheads_k * -(-(nheads // nheads_k * seqlen_q) // GROUP)
        return n


def run_split_variant(variant: SplitVariant, q, k_cache, v_cache, cache_seqlens, block_table,
                      out, workspace, *, num_splits: int, lse=None, softmax_scale=None,
                      causal=True):
    """One decode step with ``variant`` (experiments; no checks beyond shapes, no append).

    CuPy arrays on the current device; ``workspace``: a contiguous float32 CuPy array of at least
    :meth:`SplitVariant.workspace_elems` elements, zero-filled once when the variant fuses the
    combine (the kernel leaves its counters at zero, so the call can be replayed in a graph).
    Returns ``out``."""
    prob = checks.check_kvcache(q, k_cache, v_cache, None, None, cache_seqlens, block_table,
                                softmax_scale=softmax_scale, causal=causal,
                                num_splits=num_splits, out=out, dtypes=DTYPES, validate=False)
    ns = int(num_splits)
    nul = np.uint64(0)  # a NULL pointer argument
    b, sq, h, d, hk = prob.batch, prob.seqlen_q, prob.nheads, prob.headdim, prob.nheads_k
    spec = variant.spec(prob.dtype, padded_headdim(d), prob.paged)
    row_chunks = -(-(h // hk * sq) // GROUP)
    cluster = ns if 1 < ns <= launch.MAX_CLUSTER and variant.flags & FLAG_CLUSTER_COMBINE else 1
    fused = ns > 1 and variant.flags & FLAG_FUSED_COMBINE and cluster == 1
    rows = b * sq * h
    o_part = lse_part = counters = nul
    if ns > 1 and cluster == 1:
        need = variant.workspace_elems(b, sq, h, hk, d, ns)
        if workspace is None or workspace.size < need or workspace.dtype != np.float32:
            raise ValueError(f"workspace: need a float32 array of {need} elements")
        _check_workspace_alignment(workspace)
        o_part = np.uint64(workspace.data.ptr)
        lse_part = np.uint64(workspace.data.ptr + 4 * ns * rows * d)
        if fused:
            counters = np.uint64(workspace.data.ptr + 4 * ns * rows * (d + 1))
    qs, ks, vs, os_ = (_estrides(x) for x in (q, k_cache, v_cache, out))
    lse_bs, lse_hs = (_estrides(lse)[:2] if lse is not None else (0, 0))
    bt_bs = _estrides(block_table)[0] if block_table is not None else 0
    page_size = prob.page_size if prob.paged else 1
    page_shift = int(math.log2(page_size)) if page_size & (page_size - 1) == 0 else -1
    if prob.paged and variant.flags & FLAG_COPY_POINTERS:
        why = paged_copy_pointers_refusal(page_size, ks, vs)
        if why is not None:
            raise ValueError(f"variant: FLAG_COPY_POINTERS on a paged cache: {why}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):  # cp.async and TMA alike
        _check_cache_alignment(c, name)
    final = ns == 1 or fused or cluster > 1
    tail = ()
    if variant.flags & FLAG_TMA:  # the tensor maps of K and V, after the other arguments
        import cupy
        cc = int(cupy.cuda.Device().compute_capability)
        if cc < 90:
            raise ValueError(f"variant: FLAG_TMA needs sm_90 or newer, the device is sm_{cc}")
        tail = tuple(launch.encode_tensor_map(
            c.data.ptr, *kv_tensor_map_geometry(c.shape, _estrides(c), c.itemsize, variant.block_n),
            l2_promotion=variant.l2_promotion) for c in (k_cache, v_cache))
    i64, i32 = np.int64, np.int32
    args = (q, k_cache, v_cache,
            cache_seqlens if cache_seqlens is not None else nul,
            block_table if block_table is not None else nul,
            out if final else nul, lse if (lse is not None and final) else nul,
            o_part, lse_part,
            i64(qs[0]), i64(qs[1]), i64(qs[2]), i64(ks[0]), i64(ks[1]), i64(ks[2]),
            i64(vs[0]), i64(vs[1]), i64(vs[2]), i64(os_[0]), i64(os_[1]), i64(os_[2]),
            i64(lse_bs), i64(lse_hs), i64(bt_bs),
            i32(b), i32(h), i32(hk), i32(sq), i32(d), i32(prob.seqlen_cache), i32(0),
            i32(page_size), i32(page_shift), i32(prob.num_pages), i32(ns), i32(0),
            i32(row_chunks), i32(1 if prob.causal else 0),
            np.float32(prob.softmax_scale * math.log2(math.e)), counters,
            i32(variant.grid_order)) + tail
    grid = (ns, b, hk * row_chunks) if variant.grid_order == 0 else (hk * row_chunks, ns, b)
    if cluster > 1:
        if variant.grid_order != 0:
            raise ValueError("variant: the cluster combine needs grid_order 0")
        launch.launch(jit.get_kernel(spec), grid, (variant.nwarps * 32, 1, 1), args,
                      shared_mem=spec.smem_bytes, cluster=(cluster, 1, 1), pdl=variant.pdl)
        return out
    if variant.pdl or tail:  # (CuPy cannot pass a tensor map by value)
        launch.launch(jit.get_kernel(spec), grid, (variant.nwarps * 32, 1, 1), args,
                      shared_mem=spec.smem_bytes, cluster=None, pdl=variant.pdl)
    else:
        jit.get_kernel(spec)(grid, (variant.nwarps * 32, 1, 1), args, shared_mem=spec.smem_bytes)
    if ns > 1 and not fused:
        o5 = workspace[:ns * rows * d].reshape(ns, b, sq, h, d)
        l4 = workspace[ns * rows * d:ns * rows * (d + 1)].reshape(ns, b, h, sq)
        _launch_combine(o5, l4, out, lse, ns, b, sq, h, d)
    return out
