"""The decode kernels' specialisations: tiles, shared memory, names and template values (pure).

Kernels (``kernels_cu/``): the split kernel ``decode/split.cu`` (below), ``decode/combine.cu``
(the exact merge of :func:`cupyflash.decode.merge_states`) and ``decode/append.cu`` (new k/v
tokens into the cache). A specialisation's ``name`` is data: cache key, log line and profiler
label.

``decode_split_kernel``: grid ``(nheads_k * row_chunks, num_splits, batch)`` for contiguous
caches: the blocks of the KV heads of one sequence and key range are launched next to each
other, so the neighbouring 256-byte pieces of each cache row (one per KV head) are read at the
same time and each DRAM page is opened once (v16, experiments/NOTES.md: 1-1.5% at b64 x 1k-2k,
where the blocks run in two waves; cuDNN orders its grid the same way); ``(num_splits, batch,
nheads_k * row_chunks)`` for paged caches, where that order measured 0.5-2.8% slower. One block
reads each K/V tile of its KV head once (16-byte ``cp.async`` copies into a ring of ``stages``
shared buffers, so ``stages - 1`` tiles are in flight while one is computed) and serves every
query row of that head: the ``nheads // nheads_k`` GQA heads times the ``seqlen_q`` tokens, up
to :data:`GROUP` = 16 rows per block (more rows use more blocks, ``row_chunks``). Scores and
``P V`` use tensor cores (``mma.m16n8k16``, fp32 accumulate); the online softmax and the merges
are fp32. With a single split it writes the final output directly; with several, the last block
of a head to finish merges them (fused combine, v1: b1 x 128k 3.83 vs 3.72 TB/s with a combine
launch, b1 x 8k 1.84 vs 1.48) with one release/acquire arrival (v9). When the unsplit blocks
already exceed the SMs (several waves), the planner runs hd128 with the :data:`SPLIT_CONFIGS`
tile (64 keys, two blocks per SM) instead of its one-block tile (:data:`ONE_BLOCK_SPLIT_CONFIGS`).
On contiguous hd128 caches long streams run two stages instead of three (one tile in flight per
block: 64 KB per SM instead of 128 KB, 1-2% faster from 8k keys per split, or from 4k keys in
the several-waves case; bitwise the same output; :func:`cupyflash.decode.heuristics.choose_split_stages`).
Every kernel copies the Q tile by 16-byte ``cp.async`` beside the sequence's length (v44, L2
flushed: b64 x 128 keys 22.2 -> 17.8 us, b1 x 8k 17.4 -> 16.6), or by 2-byte loads for a ``q``
whose pointer or strides are not 16-byte multiples (bitwise the same tile; ``explain`` says which).

The split kernel finds a key's K/V rows one of three ways (template parameter ``KvPath``,
:func:`kv_path`; bitwise the same output):

* contiguous caches: source pointers stepped by a row stride per copy ("copy pointers"; v18
  sweep, flushed: b1 x 1k-8k -3.5 to -5%, elsewhere within +-0.5%);
* paged caches of a power-of-two ``page_size`` up to hd128 whose page stride and ``page_size`` x
  row stride lie in [0, 2^31) elements (:attr:`cupyflash.core.checks.DecodeProblem.page_offsets_fit_i32`;
  a pool view with negative or larger strides takes the general path, and ``explain`` says so;
  name suffix ``_paged_cp``): one page id per page of a tile (one per tile for pages of
  ``block_n`` keys or more), each copy's address by a shift and a mask (v20, CUDA-graph replay,
  shuffled tables, against the per-row path: b1 x 8k keys pages of 16 11.3 vs 14.2 us,
  contiguous 10.6; b16 x 16k pages of 256 -3.8%; b64 x 2k pages of 16 -2%; hd256 would spill);
* other paged caches (suffix ``_paged``): one page id per key row (one per tile for pages of
  whole tiles) and a shift, or for other sizes an integer division, per row.

Every page size from 1 to 256 (and beyond) works and reads the same bytes. The page ids of a tile
are copied from ``block_table`` into a shared-memory ring by 4-byte ``cp.async``, ``stages - 1``
tiles ahead of the tile's K/V copies and waited for together with earlier K/V tiles, so no
lookup stalls the loop. Paged kernels up to hd128 also fetch the first tiles' page ids together
with the sequence's length, for the split the block would have at full capacity (v13: b16 x 16k
pages of 16 -1.7%, b1 x 128k -1.2%, nowhere slower; not at hd256, whose paged kernel is at 255
registers). Paged against contiguous caches in ``experiments/bench_decode.py``: see the README's
decode table.
"""
from __future__ import annotations

import dataclasses
import functools

from ..core import jit

__all__ = [
    "DTYPES", "COMBINE_DTYPES", "HEADDIMS", "GROUP", "SplitConfig", "SPLIT_CONFIGS",
    "ONE_BLOCK_SPLIT_CONFIGS", "split_config", "padded_headdim", "split_smem_bytes", "KV_PATHS",
    "kv_path", "split_kernel_spec", "combine_kernel_spec", "append_kernel_spec", "all_specs",
]

#: Element types of the split kernel (tensor cores).
DTYPES = ("float16", "bfloat16")
#: Compiled head dims; a head dim d runs with the smallest compiled one >= d.
HEADDIMS = (64, 128, 256)
#: Query rows per block = the M of one mma.m16n8k16 tile (GQA heads x query tokens).
GROUP = 16

_CTYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}
_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
#: Output types of the combine kernel (merge_states).
COMBINE_DTYPES = tuple(_CTYPE)


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


def split_smem_bytes(dtype: str, headdim: int, block_n: int, stages: int) -> int:
    """Dynamic shared memory of the split kernel, bytes: its ``DecodeTraits::kSmemBytes`` (the Q
    tile ``GROUP x (headdim + 8)``, ``stages`` x (K and V tiles of ``block_n x headdim``) and a
    ring of ``stages`` x ``block_n`` int32 page ids), read from the kernel source through an NVRTC
    probe (:func:`cupyflash.core.jit.constants`, no GPU needed, cached): every tile of
    :data:`SPLIT_CONFIGS` / :data:`ONE_BLOCK_SPLIT_CONFIGS` at 2 and 3 stages in one probe.

    Raises
    ------
    ValueError
        ``dtype`` not one of :data:`DTYPES`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
    key = (dtype, headdim, block_n, stages)
    table = _split_layouts()
    if key not in table:
        table = _split_layouts((key,))
    return table[key]


def _traits(dtype: str, headdim: int, block_n: int, stages: int) -> str:
    # (the size does not depend on the warps: one warp keeps every traits' assertion true)
    return f"cf::DecodeTraits<{_CTYPE[dtype]}, {headdim}, {block_n}, 1, {GROUP}, {stages}>::kSmemBytes"


@functools.lru_cache(maxsize=None)
def _split_layouts(keys: tuple = ()) -> dict:
    """{(dtype, headdim, block_n, stages): kSmemBytes} of ``keys`` (default: every table tile)."""
    if not keys:
        keys = tuple((dt, hd, c.block_n, st) for dt in DTYPES for hd in HEADDIMS
                     for c in {SPLIT_CONFIGS[hd], ONE_BLOCK_SPLIT_CONFIGS.get(hd, SPLIT_CONFIGS[hd])}
                     for st in (2, 3))
    vals = jit.constants("decode/split.cu", tuple(_traits(*k) for k in keys))
    return dict(zip(keys, vals))


#: The split kernel's K/V paths (``KvPath`` in decode/split.cu): name suffix, template value.
KV_PATHS = {"contiguous": ("", "cf::KvPath::kContiguous"),
            "paged_copy_pointers": ("_paged_cp", "cf::KvPath::kPagedCopyPointers"),
            "paged_rows": ("_paged", "cf::KvPath::kPagedRows")}


def kv_path(headdim: int, paged: bool, page_size: int | None = None) -> str:
    """The key of :data:`KV_PATHS` the public functions run (module docstring): contiguous
    caches ``"contiguous"``; paged caches ``"paged_copy_pointers"`` up to hd128 for a
    power-of-two ``page_size`` (whose page strides and ``page_size`` x row strides the caller
    has found to fit 32 bits: :attr:`cupyflash.core.checks.DecodeProblem.page_offsets_fit_i32`),
    else ``"paged_rows"`` (also for ``page_size=None``, not known)."""
    if not paged:
        return "contiguous"
    if (headdim <= 128 and page_size is not None and page_size >= 1
            and page_size & (page_size - 1) == 0):
        return "paged_copy_pointers"
    return "paged_rows"


def split_kernel_spec(dtype: str, headdim: int, paged: bool, *, block_n: int | None = None,
                      nwarps: int | None = None, stages: int | None = None,
                      page_size: int | None = None) -> jit.KernelSpec:
    """The split kernel for ``dtype`` and a compiled head dim (64, 128 or 256), on the K/V path
    :func:`kv_path` picks for ``page_size`` (None: not known, or page offsets past 32 bits).

    Name ``decode_split_{bf16|fp16}_hd{D}_n{BLOCK_N}_w{NWARPS}_g{GROUP}_s{STAGES}`` followed by
    the path's suffix (``_paged_cp``: paged with copy pointers; ``_paged``: paged, page ids per
    row; none: contiguous). ``block_n``/``nwarps``/``stages`` override :func:`split_config`
    (the planner's two-blocks-per-SM tile and stage counts).

    Raises
    ------
    TypeError
        A dtype without a decode kernel (float32, float64).
    ValueError
        A head dim that is not compiled; a paged copy-pointer tile whose ``block_n`` or copy pass
        (``nwarps * 32 / (headdim / 8)`` key rows) is not a power of two.
    """
    if dtype not in DTYPES:
        raise TypeError(f"dtype: {dtype} has no decode kernel; supported: {', '.join(DTYPES)}")
    if headdim not in HEADDIMS:
        raise ValueError(f"headdim: compiled head dims are {HEADDIMS}, got {headdim}")
    cfg = split_config(headdim)
    bn = cfg.block_n if block_n is None else block_n
    nw = cfg.nwarps if nwarps is None else nwarps
    st = cfg.stages if stages is None else stages
    path = kv_path(headdim, paged, page_size)
    copy_pass = nw * 32 // (headdim // 8)  # key rows per copy pass (16-byte chunks per row)
    if path == "paged_copy_pointers" and (bn & (bn - 1) or copy_pass & (copy_pass - 1)):
        raise ValueError(f"block_n: paged copy pointers need block_n and the copy pass "
                         f"(nwarps * 32 / (headdim / 8) key rows) to be powers of two, got "
                         f"block_n={bn}, pass={copy_pass}")
    suffix, template = KV_PATHS[path]
    name = f"decode_split_{_SHORT[dtype]}_hd{headdim}_n{bn}_w{nw}_g{GROUP}_s{st}{suffix}"
    entry = (f"cf::decode_split_kernel<{_CTYPE[dtype]}, {headdim}, {bn}, {nw}, {GROUP}, {st}, "
             f"{template}>")
    return jit.KernelSpec(name, "decode/split.cu", entry, split_smem_bytes(dtype, headdim, bn, st))


def combine_kernel_spec(dtype: str) -> jit.KernelSpec:
    """The combine (merge) kernel writing ``dtype`` (float16, bfloat16 or float32).

    Raises
    ------
    TypeError
        Another dtype.
    """
    if dtype not in COMBINE_DTYPES:
        raise TypeError(f"dtype: {dtype} has no combine kernel; supported: "
                        f"{', '.join(COMBINE_DTYPES)}")
    return jit.KernelSpec(f"decode_combine_{_SHORT[dtype]}", "decode/combine.cu",
                          f"cf::decode_combine_kernel<{_CTYPE[dtype]}>")


def append_kernel_spec(paged: bool) -> jit.KernelSpec:
    """The KV-append kernel (raw 16-bit element copy, for float16 and bfloat16 caches)."""
    return jit.KernelSpec("decode_append_b16" + ("_paged" if paged else ""), "decode/append.cu",
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
    specs += [combine_kernel_spec(dt) for dt in COMBINE_DTYPES]
    specs += [append_kernel_spec(pg) for pg in (False, True)]
    return specs
