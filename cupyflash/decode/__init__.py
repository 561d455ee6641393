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

Supported: float16 and bfloat16 (tensor cores; float32/float64 caches are rejected with a
TypeError); head dims that are multiples of 8 up to 256, run by the kernel compiled for 64, 128
or 256 (the padding columns are zero-filled in shared memory, never read from memory).

Kernels, tiles, K/V paths and page sizes: :mod:`cupyflash.decode.kernels`; the split count,
tile and pipeline depth of a call: :mod:`cupyflash.decode.plan`.

CUDA graphs
-----------
With device ``cache_seqlens``/``block_table`` (never read on the host; with ``validate`` the
device-side check is captured too), ``out=`` given, ``return_lse=False`` and, when more than
one split is used, a ``workspace=`` from
:func:`alloc_workspace` (or any float32 CuPy array of at least :func:`workspace_size` elements,
zero-filled once), the call launches only kernels: no allocation and no host synchronisation,
so it can be captured in a CUDA graph. The number of splits depends only on shapes (never on
``cache_seqlens``).

Fused combine
-------------
With more than one split, the split kernel also merges: each block writes its fp32 partial, then
one thread increments an arrival counter of its (batch, KV head, row chunk) (in the workspace, or
in the per-stream buffer below) with a release/acquire atomic; the block that arrives last reads
all the partials, writes the output and LSE, and resets the counter to zero. There is no combine
launch (H200, v1 sweep: +3% at batch 1 x 128k, +24% at batch 1 x 8k).

The counters must be zero before a launch: :func:`alloc_workspace` returns a zero-filled
workspace, and every complete launch leaves them zero. A call without ``workspace=`` takes its
partials and its counters from buffers kept per (device, stream) and shared by the calls on that
stream (allocated by the caller's allocator, grown to the largest call seen: no allocation and
no memset per call; each launch writes and reads its partials after the previous kernel of the
stream has completed); such a call cannot be captured in a CUDA graph (ValueError: pass
``workspace=``).

Programmatic dependent launch
-----------------------------
On sm_90+ the append and split kernels are launched with programmatic stream serialization
(:class:`cupyflash.core.launch.Launch`; CUDA Programming Guide, "Programmatic Dependent
Launch and Synchronization"): each may be scheduled while the previous kernel of the stream
finishes, and waits (``griddepcontrol.wait``, ``kernels_cu/common/pdl.cuh``) for that kernel's
completion and memory before its first global load, so the result is the same; what overlaps is
the launch and block set-up. The split kernel lets the next kernel be scheduled once its main
loop is done (the append kernel at entry), so the next launch overlaps its epilogue and merge.
H200, graph-timed (experiments/NOTES.md v15): 0.5-0.7 us faster at batch 1 up to 8k keys
(6.6 vs 7.2 us at 1k), 0.7 us at b16 x 1k, within noise from 16k keys up. Set
:data:`PDL` to False, run a block inside ``with pdl_launches(False):`` (restores the previous
value), or set the environment variable ``CUPYFLASH_PDL=0`` before import, to launch plainly
instead (the same driver call without the attribute); measured in experiments/NOTES.md v15.

Callers, streams and checks
---------------------------
torch tensors in give torch tensors out, launched on torch's current stream of their device;
CuPy arrays keep CuPy's conventions (:mod:`cupyflash.core.interop`). A warm call (same layouts and
options as an earlier one) reads pointers and layouts from the arrays' attributes and launches
through prepared driver launches (:class:`cupyflash.core.launch.Launch`). With
``validate=True`` (the default) nothing is read back to the host: host ``cache_seqlens`` /
``block_table`` (an int, a list, NumPy) are checked on the host before the launch and copied to
the device asynchronously; device ones are checked on the device by the call's first kernel (the
append kernel, else the split kernel: no extra launch), whose findings are raised by the next
call or by :func:`cupyflash.check_errors` (:mod:`cupyflash.core.guard`).

Modules
-------
This module is the call path (:func:`flash_attn_with_kvcache`, :func:`merge_states`, workspaces,
the launch cache and the launches); :mod:`cupyflash.decode.plan` plans a call and explains it
(:func:`explain_kvcache`, :func:`launch_config`, :func:`plan_decode`);
:mod:`cupyflash.decode.kernels` names the kernels' specialisations. Their public names are
re-exported here.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import weakref

import numpy as np

from ..core import cache, checks, deps, guard, interop, jit, launch
from ..core.params import DecodeAppendParams, DecodeParams, MergeParams, pointer_fields
from .kernels import (COMBINE_DTYPES, DTYPES, GROUP, HEADDIMS, KV_PATHS,
                             ONE_BLOCK_SPLIT_CONFIGS, SPLIT_CONFIGS, SplitConfig, all_specs,
                             append_kernel_spec, combine_kernel_spec, kv_path, padded_headdim,
                             split_config, split_kernel_spec, split_smem_bytes)
from .plan import (H200_SMEM_PER_BLOCK_OPTIN, H200_SMEM_PER_SM, REASON_TOPICS,
                          DecodeLaunch, _check_row_strides, _check_workspace, _grid_order,
                          _resolve_plan, explain_kvcache, launch_config, plan_decode,
                          split_layout, workspace_elems, workspace_size)
from .heuristics import MAX_SPLITS, MIN_TILES_PER_SPLIT, choose_num_splits
from ..core.interop import (CupyCaller, TorchCaller, _cupy, as_cupy, caller_of, cupy_ndarray_type,
                      describe_torch, is_device_array)

__all__ = [
    # the call path (this module)
    "flash_attn_with_kvcache", "merge_states", "workspace_size", "alloc_workspace", "PDL",
    "pdl_launches",
    # planning and explain (decode_plan)
    "explain_kvcache", "plan_decode", "launch_config", "DecodeLaunch", "REASON_TOPICS",
    "split_layout", "workspace_elems", "H200_SMEM_PER_SM", "H200_SMEM_PER_BLOCK_OPTIN",
    "choose_num_splits", "MAX_SPLITS", "MIN_TILES_PER_SPLIT",
    # specialisations (decode_kernels)
    "DTYPES", "COMBINE_DTYPES", "HEADDIMS", "GROUP", "SplitConfig", "SPLIT_CONFIGS",
    "ONE_BLOCK_SPLIT_CONFIGS", "split_config", "padded_headdim", "split_smem_bytes", "KV_PATHS",
    "kv_path", "split_kernel_spec", "combine_kernel_spec", "append_kernel_spec", "all_specs",
]

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




def _estrides(x) -> tuple:
    """Strides of a CuPy array in elements."""
    return tuple(s // x.dtype.itemsize for s in x.strides)


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
    cupy = deps.cupy("alloc_workspace")
    n = workspace_size(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                       num_splits=num_splits, split_size=split_size)
    return cupy.zeros(max(n, 1), dtype=cupy.float32)


def _append_params(prob, k, v, k_cache, v_cache, block_table) -> DecodeAppendParams:
    """The append kernel's parameter struct with its constant fields (from layouts only)."""
    prm = DecodeAppendParams()
    for t_, x in (("kn", k), ("vn", v), ("k", k_cache), ("v", v_cache)):
        for s_, st in zip(("batch", "row", "head"), _estrides(x)[:3]):
            setattr(prm, f"{t_}_{s_}_stride", st)
    prm.block_table_batch_stride = _estrides(block_table)[0] if block_table is not None else 0
    prm.seqlen_new, prm.nheads_k, prm.headdim = prob.seqlen_new, prob.nheads_k, prob.headdim
    prm.seqlen_cache, prm.page_size = prob.seqlen_cache, max(prob.page_size, 1)
    prm.num_pages = prob.num_pages
    return prm


#: The per-call pointer fields of the append kernel, in order.
_APPEND_POINTERS = ("k_new", "v_new", "k_cache", "v_cache", "cache_seqlens", "block_table")
#: The per-call pointer fields of the split kernel, in order.
_SPLIT_POINTERS = ("q", "k", "v", "cache_seqlens", "block_table", "o", "lse", "o_part",
                   "ml_part", "counters")


def _append_grid(prob) -> tuple:
    return (-(-(prob.seqlen_new * prob.nheads_k * prob.headdim) // 256), prob.batch, 1)


def _combine_launch(o_part, lse_part, out, lse_out):
    """The :class:`cupyflash.core.launch.Launch` of the combine kernel (decode/combine.cu) over
    ``o_part`` (num_parts, batch, seqlen, nheads, headdim) and ``lse_part`` (num_parts, batch,
    nheads, seqlen), float32, any strides with the head dim contiguous, into ``out`` (batch,
    seqlen, nheads, headdim) and the float32 ``lse_out`` (batch, nheads, seqlen): one warp per
    output row, launched plainly (no PDL); a call passes the four pointers in that order and a
    stream handle."""
    num_parts, batch, seqlen, nheads, headdim = o_part.shape
    prm = MergeParams()
    for pre, names, x in (("op", ("part", "batch", "row", "head"), o_part),
                          ("lp", ("part", "batch", "head", "row"), lse_part),
                          ("o", ("batch", "row", "head"), out),
                          ("lse", ("batch", "head"), lse_out)):
        for n, st in zip(names, _estrides(x)):
            setattr(prm, f"{pre}_{n}_stride", st)
    prm.num_parts, prm.batch, prm.seqlen = num_parts, batch, seqlen
    prm.nheads, prm.headdim = nheads, headdim
    kern = jit.get_kernel(combine_kernel_spec(checks.dtype_name(out)))
    return launch.Launch(kern, prm, (-(-(batch * seqlen * nheads) // 4), 1, 1), (128, 1, 1),
                         pointers=pointer_fields(MergeParams, ("o_part", "lse_part", "out",
                                                               "lse_out")))


def _launch_combine(o_part, lse_part, out, lse_out, stream_ptr: int) -> None:
    """The combine kernel (:func:`_combine_launch`) over CuPy arrays or
    :class:`cupyflash.core.interop.ArrayDesc` of torch tensors, on the stream handle
    ``stream_ptr`` of the current device."""
    _combine_launch(o_part, lse_part, out, lse_out)(
        tuple(x.data.ptr for x in (o_part, lse_part, out, lse_out)), stream_ptr)


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
    cache_seqlens : int32 CUDA array, shape (batch,), int, list of ints, host integer array, or None
        Cached tokens per sequence before appending; None = the whole contiguous cache. An int
        (every sequence's length, as in FlashAttention), a list, or a host array (NumPy, CPU
        tensor; any integer dtype, e.g. NumPy's default int64, values within int32) is checked
        on the host and copied to the device as int32 asynchronously (no synchronisation). A
        CUDA array must be int32 (the TypeError otherwise says ``.astype(cupy.int32)`` /
        ``.to(torch.int32)``).
    block_table : int32 CUDA array (or host integer array), shape (batch, max_pages_per_seq), or None
        Page ids: token ``t`` of sequence ``b`` lives in page ``block_table[b, t // page_size]``
        at row ``t % page_size``. Only the entries a sequence uses are read.
    softmax_scale : float or None
        Scale of ``q k^T``; None = ``1/sqrt(headdim)``. Must be finite and positive.
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
        Check ``cache_seqlens`` and ``block_table``: negative lengths, lengths above the
        capacity, page ids outside ``[0, num_pages)``, without a synchronisation. Host data
        raises ValueError before the launch. Device arrays are checked on the device by the
        call's first kernel (:mod:`cupyflash.core.guard`): a violation is raised as
        :class:`cupyflash.core.guard.DeviceCheckError` (a ValueError, the same message) by the next
        ``flash_attn_with_kvcache`` call once the check has run, or by
        :func:`cupyflash.check_errors` (which synchronises first). With False nothing is
        checked. Either way the kernels never access memory outside the cache (bad lengths are
        clamped to the capacity and rows of bad pages are zero-filled: the result of such a call
        is unspecified, not unsafe).
    workspace : float32 CUDA array or None
        Scratch for the fp32 partials and the fused combine's int32 counters, at least
        :func:`cupyflash.decode.workspace_size` elements, from
        :func:`cupyflash.decode.alloc_workspace` (or zero-filled once: the counters at its end must
        start at zero; each launch leaves them zero), contiguous and 16-byte aligned. If None,
        the partials and the counters come from buffers kept per (device, stream) (per host
        thread on CuPy's per-thread default stream), allocated by the caller's allocator (CuPy's
        memory pool, torch's caching allocator) on first use and grown to the largest call on
        that stream; such a call cannot be captured in a CUDA graph. Pass it (with ``out`` and ``return_lse=False``; device ``cache_seqlens`` and
        ``block_table``) to capture in a CUDA graph.

    Returns
    -------
    out : torch.Tensor or cupy.ndarray, shape (batch, seqlen_q, nheads, headdim), dtype of ``q``
        A torch tensor when the arrays are torch tensors (launched on torch's current stream of
        their device), else a CuPy array (CuPy's current stream).
    lse : float32, shape (batch, nheads, seqlen_q), of the same kind
        Only if ``return_lse``.

    Raises
    ------
    TypeError
        Host arrays (use :func:`cupyflash.reference.kvcache_attention_reference`), float32 or
        float64 (no tensor-core decode path), other errors of
        :func:`cupyflash.core.checks.check_kvcache`, a workspace that is not float32.
    ValueError
        From :func:`cupyflash.core.checks.check_kvcache` (shapes, lengths, page ids with
        ``validate``); unaligned cache rows; bad ``split_size``; a workspace too small or not
        16-byte aligned; no ``workspace`` while the stream captures a CUDA graph (with more
        than one split); a grid dimension over its limit (see
        :func:`cupyflash.decode.launch_config`).
    """
    if guard._record is not None and guard._record[0]:  # an earlier call's device check
        guard.raise_pending()
    tensor = interop._TORCH_TENSOR  # (None until a torch tensor was seen: no hit possible)
    if (type(q) is tensor and (validate is True or validate is False)
            and (causal is True or causal is False)
            and (return_lse is False or return_lse is True) and type(num_splits) is int
            and (softmax_scale is None or type(softmax_scale) is float)
            and (split_size is None or type(split_size) is int)):
        # the warm path of torch tensors (the options of _plain_options, checked inline)
        entry = cache.LAUNCH_CACHE.get(cache.torch_key(
            ("kvcache:torch", softmax_scale, causal, num_splits, split_size, return_lse),
            (q, k_cache, v_cache, k, v, cache_seqlens, block_table, out, workspace), tensor))
        if entry is not None:
            r = _execute_kvcache_on(entry, TorchCaller, entry.device,
                                    validate and cache_seqlens is not None, q, k_cache, v_cache,
                                    k, v, cache_seqlens, block_table, out, workspace)
            if r is not None:
                return r
    opts = _plain_options(softmax_scale, causal, num_splits, split_size, return_lse)
    if opts is not None and (validate is False or validate is True) and type(q) is not tensor:
        # the warm path of CuPy arrays
        r = _cached_call(opts, validate, q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                         out, workspace)
        if r is not None:
            return r
    cache_seqlens = checks.lengths_from_host(cache_seqlens, q)  # an int or a list of ints
    prob = checks.check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                softmax_scale=softmax_scale, causal=causal,
                                num_splits=num_splits, out=out, dtypes=DTYPES, validate=validate,
                                device_values=False)
    if not is_device_array(q):
        raise TypeError("q: flash_attn_with_kvcache runs on the GPU, got a host array "
                        f"{type(q).__name__}; use cupyflash.reference.kvcache_attention_reference")
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    host_cs = cache_seqlens is not None and not is_device_array(cache_seqlens)
    host_bt = block_table is not None and not is_device_array(block_table)
    # lengths or page ids on the device: checked there (validate; host ones were checked above)
    device_check = bool(validate) and cache_seqlens is not None and not (host_cs and
                                                                         (host_bt or
                                                                          block_table is None))
    dt = prob.dtype
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "out": out,
             "cache_seqlens": None if host_cs else cache_seqlens,
             "block_table": None if host_bt else block_table, "workspace": workspace}
    caller = caller_of(*named.values())
    if caller is TorchCaller:
        descs = {n: None if a is None else describe_torch(a) for n, a in named.items()}
        arrays = dict(named)
    else:
        descs = {n: None if a is None else as_cupy(
            a, n, dt if n not in ("cache_seqlens", "block_table", "workspace")
            else "int32" if n != "workspace" else checks.dtype_name(a))
            for n, a in named.items() if n != "workspace"}
        descs["workspace"] = workspace  # viewed only when the plan uses it (_run_kvcache)
        arrays = dict(descs)
    dev = descs["q"].device_id if caller is TorchCaller else descs["q"].device.id
    for name, a in descs.items():
        if a is None or name == "workspace":
            continue
        a_dev = a.device_id if caller is TorchCaller else a.device.id
        if a_dev != dev:
            raise ValueError(f"{name}: on CUDA device {a_dev}, but q is on device {dev}; pass "
                             f"all arrays on one device")
    _check_cache_alignment(descs["k_cache"], "k_cache")
    _check_cache_alignment(descs["v_cache"], "v_cache")
    with interop.on_device(dev):
        for name, host in (("cache_seqlens", cache_seqlens if host_cs else None),
                           ("block_table", block_table if host_bt else None)):
            if host is not None:  # to the device, asynchronously on the caller's stream
                a = caller.from_host(checks.to_host(host), "int32", dev)
                arrays[name] = a
                descs[name] = describe_torch(a) if caller is TorchCaller else a
        return _run_kvcache(prob, caller, dev, arrays, descs, return_lse, split_size, opts,
                            device_check)


def _plain_options(softmax_scale, causal, num_splits, split_size, return_lse):
    """The launch-cache options ``("kvcache", softmax_scale, causal, num_splits, split_size,
    return_lse)`` when all are plain values of exact types (None or float; bool; int; None or
    int; bool), else None (such calls are validated and planned every time)."""
    if (type(causal) is bool and type(return_lse) is bool and type(num_splits) is int
            and (softmax_scale is None or type(softmax_scale) is float)
            and (split_size is None or type(split_size) is int)):
        return ("kvcache", softmax_scale, causal, num_splits, split_size, return_lse)
    return None


_ARRAY_NAMES = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "block_table", "out",
                "workspace")


def _cached_call(opts, validate, q, k_cache, v_cache, k, v, cache_seqlens, block_table, out,
                 workspace):
    """A warm call from a :data:`cupyflash.core.cache.LAUNCH_CACHE` hit (the CuPy caller's; torch
    tensors take the inline path of :func:`flash_attn_with_kvcache`), or None when the arrays
    are not all exactly ``cupy.ndarray``, not cached yet, on
    different devices or with unaligned cache pointers (the full path then validates: it raises
    or caches). With ``validate`` the first kernel also checks ``cache_seqlens`` /
    ``block_table`` on the device (:mod:`cupyflash.core.guard`)."""
    arrays = (q, k_cache, v_cache, k, v, cache_seqlens, block_table, out, workspace)
    hit = cache.warm_entry(opts[0], opts[1:], arrays)
    if hit is None:
        return None
    caller, dev, entry = hit
    return _execute_kvcache_on(entry, caller, dev, validate and cache_seqlens is not None,
                               *arrays)


def _execute_kvcache_on(entry, caller, dev, check, *arrays):
    """:func:`_execute_kvcache` with ``dev`` made the current device for it when it is not."""
    if interop.current_device() == dev:
        return _execute_kvcache(entry, caller, dev, check, *arrays)
    with interop.on_device(dev):
        return _execute_kvcache(entry, caller, dev, check, *arrays)


def _run_kvcache(prob, caller, dev, arrays, descs, return_lse, split_size, opts, check):
    """Plan (cached in :data:`cupyflash.core.cache.LAUNCH_CACHE` when ``opts`` are plain), then
    allocate what the caller did not pass and launch append / split (checking) on the current
    device ``dev``. ``arrays``: the call's arrays by name (torch tensors, or CuPy arrays and
    views), validated; ``descs``: what the planning reads of them (ArrayDesc or CuPy arrays)."""
    plan = _resolve_plan(prob, split_size)  # also validates split_size
    workspace = arrays["workspace"]
    if plan.workspace_elems and workspace is not None:
        if caller is CupyCaller:
            workspace = as_cupy(workspace, "workspace", checks.dtype_name(workspace))
            arrays["workspace"] = descs["workspace"] = workspace
        # every call (the launch cache keys layouts, not pointers)
        _check_workspace_alignment(descs["workspace"])
    elif workspace is not None and caller is CupyCaller and type(workspace) is not \
            cupy_ndarray_type():
        opts = None  # an unused workspace of another kind: its layout is no key
    values = tuple(arrays[n] for n in _ARRAY_NAMES)
    key = None
    if opts is not None:
        key = cache.caller_key(caller, opts[0], dev, opts[1:], values)
    entry = cache.LAUNCH_CACHE.get(key) if key is not None else None
    if entry is None or entry.prob != prob:  # (a q of the same layout, on another alignment)
        entry = _KVCacheLaunch(prob, plan, dev, *(descs[n] for n in _ARRAY_NAMES[:8]),
                               return_lse, descs["workspace"] if plan.workspace_elems else None)
        if key is not None:
            cache.cache_put(key, entry)
    r = _execute_kvcache(entry, caller, dev, check, *values)
    if r is None:  # the alignments were checked above: never return None to a caller
        raise RuntimeError("flash_attn_with_kvcache: internal error, a validated call was "
                           "refused by its launch (pointer alignment)")
    return r


def _compute_capability() -> int:
    """Of the current device, as an int (90 for sm_90)."""
    return int(_cupy().cuda.Device().compute_capability)


class _KVCacheLaunch:
    """One :data:`cupyflash.core.cache.LAUNCH_CACHE` entry of :func:`flash_attn_with_kvcache`:
    the plan, the kernels' prepared launches with their constant arguments (from the layouts),
    built once per key after the checks on the current device ``device``;
    :func:`_execute_kvcache` adds the pointers and the stream per call. Arrays: CuPy arrays or
    :class:`cupyflash.core.interop.ArrayDesc` (layouts only). ``out_like_q``: as in
    :class:`cupyflash.forward.dispatch.PrefillLaunch` (``out`` by ``torch.empty_like(q)``)."""
    __slots__ = ("prob", "plan", "return_lse", "lse_shape", "copy_seqlens", "ws_need",
                 "o_part_bytes", "counters_bytes", "counters_nbytes", "append_kernel",
                 "append_grid", "append_params", "split_kernel", "split_params",
                 "pdl_ok", "launches", "bt_stride", "device", "out_like_q")

    def __init__(self, prob, plan, dev, q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                 out, return_lse, workspace):
        from ..core.cache import ContiguousLayout
        self.prob, self.plan, self.return_lse = prob, plan, return_lse
        self.device = dev
        self.out_like_q = out is None and cache.out_like(q)
        ns = plan.num_splits
        self.copy_seqlens = cache_seqlens is not None and cache_seqlens.strides[0] != 4
        self.bt_stride = _estrides(block_table)[0] if block_table is not None else 0
        b, sq, h, d = prob.batch, prob.seqlen_q, prob.nheads, prob.headdim
        self.lse_shape = (b, h, sq) if return_lse else None
        self.ws_need = plan.workspace_elems
        if self.ws_need and workspace is not None:  # checked before anything is launched
            _check_workspace(workspace, self.ws_need)
        rows = b * sq * h
        # workspace: partial accumulators, (m, l) pairs (fp32), then the fused combine's counters
        self.o_part_bytes = 4 * ns * rows * d
        self.counters_bytes = 4 * ns * rows * (d + 2)
        self.counters_nbytes = 4 * plan.counter_elems
        self.pdl_ok = _compute_capability() >= 90
        self.launches = {}  # (pdl, check) -> (append Launch or None, split one or None)
        self.append_kernel = self.append_params = self.append_grid = None
        if prob.seqlen_new > 0 and b > 0:
            self.append_kernel = jit.get_kernel(append_kernel_spec(prob.paged))
            self.append_grid = _append_grid(prob)
            self.append_params = _append_params(prob, k, v, k_cache, v_cache, block_table)
        self.split_kernel = self.split_params = None
        if b == 0 or sq == 0:  # no query rows: an empty grid is not launchable
            return
        if out is None:
            out = ContiguousLayout(q.shape, q.dtype)
        self.split_kernel = jit.get_kernel(plan.spec)
        prm = self.split_params = DecodeParams()
        for t_, x in (("q", q), ("k", k_cache), ("v", v_cache), ("o", out)):
            for s_, st in zip(("batch", "row", "head"), _estrides(x)[:3]):
                setattr(prm, f"{t_}_{s_}_stride", st)
        # contiguous (b, h, sq) LSE
        prm.lse_batch_stride, prm.lse_head_stride = (h * sq, sq) if return_lse else (0, 0)
        prm.block_table_batch_stride = self.bt_stride
        page_size = prob.page_size if prob.paged else 1
        prm.batch, prm.nheads, prm.nheads_k = prob.batch, prob.nheads, prob.nheads_k
        prm.h_per_kv, prm.seqlen_q, prm.headdim = prob.nheads // prob.nheads_k, sq, d
        prm.seqlen_cache, prm.seqlen_new = prob.seqlen_cache, prob.seqlen_new
        prm.page_size = page_size
        prm.page_shift = int(math.log2(page_size)) if page_size & (page_size - 1) == 0 else -1
        prm.num_pages, prm.num_splits, prm.split_tiles = prob.num_pages, ns, plan.split_tiles
        prm.num_row_chunks, prm.grid_order = plan.row_chunks, _grid_order(prob.paged)
        prm.causal = 1 if prob.causal else 0
        prm.scale_log2 = prob.softmax_scale * math.log2(math.e)
        if self.pdl_ok:  # build the default launches now (on the entry's device)
            self.prepared(True, False, -1)

    def prepared(self, pdl: bool, check: bool, dev: int) -> tuple:
        """``(append, split)``: the prepared launches of the append kernel (None when the call
        has no new tokens) and the split kernel (None without query rows), programmatic
        dependent (``pdl``, sm_90+) or plain; with ``check``, the first of them also checks
        ``cache_seqlens`` / ``block_table`` on the device (:mod:`cupyflash.core.guard`: the claim
        and record pointers of device ``dev`` as its last arguments; NULL without). Built once
        per entry (on its device)."""
        runs = self.launches.get((pdl, check))
        if runs is None:
            claim = record = 0
            if check:
                claim, record = guard.device_pointers(dev)
            append = split = None
            if self.append_params is not None:  # the first kernel: it checks
                prm = DecodeAppendParams.from_buffer_copy(self.append_params)
                prm.check_claim, prm.check_record = claim, record
                append = launch.Launch(
                    self.append_kernel, prm, self.append_grid, (256, 1, 1),
                    pointers=pointer_fields(DecodeAppendParams, _APPEND_POINTERS), pdl=pdl)
                claim = record = 0
            if self.split_params is not None:
                prm = DecodeParams.from_buffer_copy(self.split_params)
                prm.check_claim, prm.check_record = claim, record
                split = launch.Launch(
                    self.split_kernel, prm, self.plan.grid, self.plan.block,
                    pointers=pointer_fields(DecodeParams, _SPLIT_POINTERS),
                    shared_mem=self.plan.smem_bytes, pdl=pdl)
            runs = self.launches[(pdl, check)] = (append, split)
        return runs


# The scratch of calls without ``workspace=``, per (device, stream): the fused combine's
# counters, one zero-filled int32 buffer, and the split partials, one float32 buffer, each grown
# on demand (to the largest call seen on the stream; a few MB at most for the shapes:
# b64 x 32 heads x hd128 x 4 splits is 4.2 MB). Every complete launch leaves the counters it used
# at zero, so calls in stream order can share them whatever their shapes, and a call costs no
# memset launch (bench_decode v18: ~0.6 us of a 12 us call at batch 1). The partials are written
# and read by one launch only, after its griddepcontrol.wait (common/pdl.cuh: the previous kernel
# of the stream has completed), so calls in stream order can share them too, and a call costs no
# allocation (a torch.empty on the H200 host: ~5 us). Neither is ever returned to the caller.
# CuPy callers' buffers are keyed by the stream object (a weak reference, whose death drops the
# entry): a new stream that reuses a destroyed one's handle gets new buffers. CuPy's per-thread
# default stream is one object whose work runs on each host thread's own CUDA stream, so its
# buffers are kept per host thread. torch callers' buffers (torch tensors, the counters zeroed on
# the stream) are keyed by the stream handle: torch keeps its streams for the life of the
# process. Entries: CuPy (stream ref, counters, partials, counters address, partials address);
# torch (counters, partials, counters address, partials address, counters bytes, partials
# bytes).
_COUNTERS: dict = {}
_COUNTERS_PER_THREAD = threading.local()
_TORCH_COUNTERS: dict = {}


def _drop_counters(table: dict, key, ref) -> None:
    """Weak-reference callback: the stream died; forget its buffers (unless already replaced)."""
    hit = table.get(key)
    if hit is not None and hit[0] is ref:
        del table[key]


def _is_capturing(stream_ptr: int) -> bool:
    """Whether the stream (handle) is capturing a CUDA graph."""
    cupy = _cupy()
    try:
        return bool(cupy.cuda.runtime.streamIsCapturing(stream_ptr))
    except cupy.cuda.runtime.CUDARuntimeError:  # the legacy stream during a global capture
        return True


def _stream_scratch(caller, dev: int, stream_ptr: int, counters_nbytes: int,
                    partials_nbytes: int) -> tuple:
    """``(counters, partials)``: device addresses of at least ``counters_nbytes`` zero bytes of
    counters and ``partials_nbytes`` bytes for the split partials (16-byte aligned, any
    content), for the caller's current stream ``stream_ptr`` on device ``dev`` (the current
    device); see the comment above.

    Raises
    ------
    ValueError
        The stream is capturing a CUDA graph (the caller must pass ``workspace=``)."""
    if _is_capturing(stream_ptr):
        raise ValueError("workspace: a call captured in a CUDA graph needs workspace= "
                         "(alloc_workspace): a buffer allocated inside the call would be freed "
                         "while the graph still uses it")
    if caller is TorchCaller:
        key = (dev, stream_ptr)
        hit = _TORCH_COUNTERS.get(key)
        if hit is None or hit[4] < counters_nbytes or hit[5] < partials_nbytes:
            counters = partials = None
            if hit is not None:
                counters = hit[0] if hit[4] >= counters_nbytes else None
                partials = hit[1] if hit[5] >= partials_nbytes else None
            if counters is None:  # zeroed on the stream itself
                counters = caller.full((max(-(-counters_nbytes // 4), 1024),), 0, "int32", dev)
            if partials is None:
                partials = caller.empty((max(-(-partials_nbytes // 4), 1024),), "float32", dev)
            hit = _TORCH_COUNTERS[key] = (counters, partials, counters.data_ptr(),
                                          partials.data_ptr(), counters.numel() * 4,
                                          partials.numel() * 4)
        return hit[2], hit[3]
    cupy = _cupy()
    stream = cupy.cuda.get_current_stream()
    if stream.ptr == cupy.cuda.runtime.streamPerThread:
        table = _COUNTERS_PER_THREAD.__dict__.setdefault("table", {})
    else:
        table = _COUNTERS
    key = (dev, stream.ptr)
    hit = table.get(key)
    if (hit is None or hit[0]() is not stream or hit[1].nbytes < counters_nbytes
            or hit[2].nbytes < partials_nbytes):
        counters = partials = None
        if hit is not None and hit[0]() is stream:
            counters = hit[1] if hit[1].nbytes >= counters_nbytes else None
            partials = hit[2] if hit[2].nbytes >= partials_nbytes else None
        if counters is None:  # memset on this stream
            counters = cupy.zeros(max(-(-counters_nbytes // 4), 1024), cupy.int32)
        if partials is None:
            partials = cupy.empty(max(-(-partials_nbytes // 4), 1024), cupy.float32)
        ref = weakref.ref(stream, functools.partial(_drop_counters, table, key))
        table[key] = hit = (ref, counters, partials, counters.data.ptr, partials.data.ptr)
    return hit[3], hit[4]


def _execute_kvcache(e, caller, dev, check, q, k_cache, v_cache, k, v, cache_seqlens,
                     block_table, out, workspace):
    """Allocate what the caller did not pass and launch append and split for the
    :class:`_KVCacheLaunch` ``e`` on the current device ``dev`` (that of every array), on the
    caller's current stream (:mod:`cupyflash.core.interop`); with ``check`` the first of them also
    checks ``cache_seqlens`` / ``block_table`` on the device (:mod:`cupyflash.core.guard`).

    Returns None, having done nothing, when the caches or the workspace the plan uses do not
    start on a 16-byte boundary, or ``q`` does not while the entry copies Q by 16 bytes: what a
    launch-cache hit does not prove (the warm path then takes the full path, which raises or
    plans for this ``q``; the full path has checked them before)."""
    ptr = caller.ptr
    qp, kcp, vcp = ptr(q), ptr(k_cache), ptr(v_cache)
    ws = ptr(workspace) if e.ws_need and workspace is not None else 0  # the split partials
    if (kcp | vcp | ws) % 16 or (e.prob.q_aligned16 and qp % 16):
        return None
    stream = caller.stream(dev)
    counters = ws + e.counters_bytes if ws else 0  # the fused combine's counters
    if e.ws_need and workspace is None:
        # first, before anything is enqueued (refused while capturing a graph): the counters
        # and the partials from the stream's scratch (no kernel, no allocation once grown)
        counters, ws = _stream_scratch(caller, dev, stream, e.counters_nbytes, e.counters_bytes)
    bt_ptr = ptr(block_table) if block_table is not None else 0
    if e.copy_seqlens:
        cache_seqlens = caller.contiguous(cache_seqlens)
    if out is None:  # (torch: empty_like where it gives what empty would, cheaper)
        out = caller.empty_like(q) if e.out_like_q else caller.empty(q.shape, e.prob.dtype, dev)
    lse = caller.empty(e.lse_shape, "float32", dev) if e.lse_shape is not None else None
    # programmatic dependent launches (module docstring); with ``check`` the first kernel also
    # checks the lengths and page ids (recorded on the device, raised later: guard)
    append, split = e.prepared(PDL and e.pdl_ok, check, dev)
    cs_ptr = ptr(cache_seqlens) if cache_seqlens is not None else 0
    if append is not None:  # append first; same stream, so the split kernel sees it
        append((ptr(k), ptr(v), kcp, vcp, cs_ptr, bt_ptr), stream)
    if split is not None:
        split((qp, kcp, vcp, cs_ptr, bt_ptr, ptr(out), ptr(lse) if lse is not None else 0, ws,
               ws + e.o_part_bytes if ws else 0, counters), stream)
    return (out, lse) if e.return_lse else out


def _same_merge_device(o_dev: int, lse_dev: int) -> None:
    """ValueError unless ``lse_parts`` is on the GPU of ``o_parts`` (device ordinals)."""
    if lse_dev != o_dev:
        raise ValueError(f"lse_parts: on CUDA device {lse_dev}, but o_parts is on device "
                         f"{o_dev}; pass both on one device")


def _merge_states_torch(o_parts, lse_parts, dt: str) -> tuple:
    """:func:`merge_states` of torch CUDA tensors (checked by it: among others, the head dim
    contiguous): float32 copies where the inputs are not float32 already, and both outputs,
    allocated by torch; the combine kernel launched on torch's current stream of the tensors'
    device."""
    dev = TorchCaller.device(o_parts)
    _same_merge_device(dev, TorchCaller.device(lse_parts))
    batch, seqlen, nheads, headdim = o_parts.shape[1:]
    with interop.on_device(dev):
        o32, l32 = o_parts.float(), lse_parts.float()  # (themselves when float32)
        out = TorchCaller.empty((batch, seqlen, nheads, headdim), dt, dev)
        lse = TorchCaller.empty((batch, nheads, seqlen), "float32", dev)
        if out.numel():  # an empty grid is not launchable
            _launch_combine(*(describe_torch(x) for x in (o32, l32, out, lse)),
                            TorchCaller.stream(dev))
    return out, lse


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
        Natural-log partial LSEs, float32 or float64 (converted to float32); any strides.

    Returns
    -------
    o : torch.Tensor or cupy.ndarray, shape (batch, seqlen, nheads, headdim), dtype of ``o_parts``
    lse : float32, shape (batch, nheads, seqlen), of the same kind
        Torch tensors when both inputs are torch tensors (allocated by torch, the float32 copies
        too; the kernel launched on torch's current stream of their device); else CuPy arrays
        (CuPy's current stream).

    Raises
    ------
    TypeError
        Host arrays (use :func:`cupyflash.reference.merge_states`), float64 ``o_parts``, and the
        errors of :func:`cupyflash.core.checks.check_merge`.
    ValueError
        From :func:`cupyflash.core.checks.check_merge`; ``lse_parts`` on another GPU than
        ``o_parts``.
    """
    num_parts, batch, seqlen, nheads, headdim = checks.check_merge(o_parts, lse_parts)
    if not is_device_array(o_parts):
        raise TypeError("o_parts: merge_states runs on the GPU, got a host array "
                        f"{type(o_parts).__name__}; use cupyflash.reference.merge_states")
    dt = checks.dtype_name(o_parts)
    if dt not in COMBINE_DTYPES:
        raise TypeError(f"o_parts: dtype {dt} is not supported on the GPU; supported: "
                        f"{', '.join(COMBINE_DTYPES)} (float64: cupyflash.reference.merge_states)")
    if caller_of(o_parts, lse_parts) is TorchCaller:
        return _merge_states_torch(o_parts, lse_parts, dt)
    cupy = deps.cupy("merge_states")
    o_parts = as_cupy(o_parts, "o_parts", dt)
    lse_parts = as_cupy(lse_parts, "lse_parts", checks.dtype_name(lse_parts))
    _same_merge_device(o_parts.device.id, lse_parts.device.id)
    with o_parts.device:
        o32 = o_parts if dt == "float32" else o_parts.astype(cupy.float32)
        l32 = lse_parts if lse_parts.dtype == cupy.float32 else lse_parts.astype(cupy.float32)
        out = cupy.empty((batch, seqlen, nheads, headdim), o_parts.dtype)
        lse = cupy.empty((batch, nheads, seqlen), cupy.float32)
        if out.size:  # an empty grid is not launchable
            _launch_combine(o32, l32, out, lse, cupy.cuda.get_current_stream().ptr)
    return out, lse
