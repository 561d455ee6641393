"""Public entry points: FlashAttention's function names and (batch, seqlen, nheads, headdim) layout.

``flash_attn_func`` / ``flash_attn_varlen_func`` compute exact softmax attention with the tiled
forward pass of FlashAttention-2 (Dao, arXiv 2307.08691, Sec. 3.1, Algorithm 1): the
``seqlen_q x seqlen_k`` score matrix never reaches device memory. On Hopper (sm_90a)
float16/bfloat16 at head dims from 40 up (padded onto 64, 128 or 256) run the TMA kernel built as
FlashAttention-3 (Shah et al., arXiv 2407.08608: TMA producer, warpgroup MMA, Sec. 3.1 ping-pong
and Sec. 3.2 intra-warpgroup overlap, a persistent grid); elsewhere mma.sync (tensor cores) or
CUDA cores (float32/float64). ``explain`` names the kernel. ``explain`` returns what such a
call would launch (:class:`cupyflash.dispatch.Plan`) without launching anything; it also works on
NumPy arrays, on a machine without a GPU.

Every call does its work in this order, so bad input never reaches a kernel:

1. every array argument must live on a CUDA device (``TypeError`` naming the argument);
2. :mod:`cupyflash.checks` validates shapes, dtypes, heads, ``softmax_scale``, ``window_size``,
   ``out`` (``TypeError`` / ``ValueError`` naming the argument);
3. :func:`cupyflash.dispatch.plan_prefill` picks the specialisation (``ValueError`` listing why
   each candidate was rejected when none fits);
4. the output (unless given) and the float32 LSE are allocated and the kernel is launched, by the
   caller's conventions (:mod:`cupyflash.interop`): PyTorch CUDA tensors (every array argument a
   tensor) are read through their own attributes, the results are tensors from torch's caching
   allocator and the launch goes to torch's current stream of ``q``'s device; anything else is
   viewed as CuPy arrays without copying (:func:`cupyflash.interop.as_cupy`), the results are
   CuPy arrays and the launch goes to CuPy's current stream of that device.

A warm call (same layouts and options as an earlier one, see
:data:`cupyflash.dispatch.LAUNCH_CACHE`) skips steps 1-3: it reads each array's pointer, shape,
strides and dtype, allocates the outputs and launches.

The only device memory a call allocates besides its output is the LSE,
``batch * nheads * seqlen_q * 4`` bytes.
"""
from __future__ import annotations

import sys

import numpy as np

from . import checks, dispatch, interop
from .interop import (ArrayDesc, TorchCaller, as_cupy, caller_of,
                      describe_torch, is_device_array)

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "explain", "explain_varlen"]

_NUMPY_HINT = {
    "dense": "; for NumPy arrays use cupyflash.reference.attention_reference",
    "varlen": "; for NumPy arrays use cupyflash.reference.varlen_attention_reference",
}


# ----------------------------------------------------------------------------------------------
# Argument plumbing (validation itself lives in cupyflash.checks)
# ----------------------------------------------------------------------------------------------
def _require_device(named: dict, hint: str) -> None:
    """TypeError naming the first argument that is not a CUDA array (NumPy, lists, CPU tensors)."""
    for name, x in named.items():
        if x is not None and not is_device_array(x):
            raise TypeError(f"{name}: expected a CUDA array (cupy.ndarray, or an object exposing "
                            f"__cuda_array_interface__ or DLPack on a CUDA device), got "
                            f"{type(x).__module__}.{type(x).__name__}{hint}")


def _require_bool(x, name: str) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__} {x!r}")
    return bool(x)


def _device_of(a) -> int:
    """CUDA device of a CuPy array or an :class:`cupyflash.interop.ArrayDesc`."""
    return a.device_id if isinstance(a, ArrayDesc) else a.device.id


def _same_device(arrays: dict) -> None:
    """ValueError unless every array (CuPy array or ArrayDesc) lives on the device of the first
    (``q``)."""
    items = [(n, a) for n, a in arrays.items() if a is not None]
    first_name, first = items[0]
    first_dev = _device_of(first)
    for n, a in items[1:]:
        if _device_of(a) != first_dev:
            raise ValueError(f"{n}: on CUDA device {_device_of(a)}, but {first_name} is on "
                             f"device {first_dev}; pass all arrays on one device")


def _run(problem, q, k, v, out, cu_seqlens_q=None, cu_seqlens_k=None, options=None,
         want_lse=True):
    """Plan, allocate, launch (inputs already validated). Returns ``(out, lse)``: torch tensors
    for a torch caller (:func:`cupyflash.interop.caller_of`), else CuPy arrays; ``lse`` is None
    unless ``want_lse`` (the kernel then writes none).

    ``options``: the call's ``(kind, ...)`` options when they are plain values (the launch
    cache key, see :data:`cupyflash.dispatch.LAUNCH_CACHE`), else None (nothing is cached).
    """
    named = {"q": q, "k": k, "v": v, "out": out,
             "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
    caller = caller_of(q, k, v, out, cu_seqlens_q, cu_seqlens_k)
    if caller is TorchCaller:  # descriptors for the planning; the tensors themselves launch
        views = {n: describe_torch(a) if a is not None else None for n, a in named.items()}
        arrays = (q, k, v, out, cu_seqlens_q, cu_seqlens_k)
    else:
        views = {n: (as_cupy(a, n, problem.dtype if n in ("q", "k", "v", "out") else "int32")
                     if a is not None else None) for n, a in named.items()}
        arrays = tuple(views.values())
    _same_device(views)
    dev = _device_of(views["q"])
    device = interop.on_device(dev) if caller is TorchCaller else views["q"].device
    with device:  # the device of q: its current stream, its SM count
        key = None
        if options is not None:  # (the dense call's key has no cu_seqlens)
            key = dispatch.caller_key(caller, options[0], dev, options[1:],
                                      arrays if problem.varlen else arrays[:4])
        d = tuple(views.values())
        entry = dispatch.prefill_launch(problem, key, dev, *d[:4])
        return _execute(entry, caller, dev, want_lse, *arrays)


def _execute(entry, caller, dev, want_lse, q, k, v, out, cu_seqlens_q, cu_seqlens_k):
    """Allocate and launch a :class:`cupyflash.dispatch.PrefillLaunch` on the current device
    ``dev`` (that of every array) and the caller's stream. Returns ``(out, lse)``; without
    ``want_lse`` no LSE is allocated or written (None; the kernel gets NULL)."""
    if out is None:  # (torch: empty_like where it gives what empty would, cheaper)
        out = (caller.empty_like(q) if entry.out_like_q
               else caller.empty(q.shape, entry.problem.dtype, dev))
    lse = caller.empty(entry.lse_shape, "float32", dev) if want_lse else None
    action = entry.action
    if action == "launch":
        ptr = caller.ptr
        qp, kp, vp, op = ptr(q), ptr(k), ptr(v), ptr(out)
        if entry.tensor_cores and (qp | kp | vp | op) % 16:
            from . import prefill
            prefill.check_pointers(entry.plan.kernel.spec,
                                   *(_desc(caller, x) for x in (q, k, v, out)))  # raises
        run = entry.prepared
        if run is None:
            run = _prepare(entry)
        run((qp, kp, vp, op, ptr(lse) if lse is not None else 0,
             ptr(cu_seqlens_q) if cu_seqlens_q is not None else 0,
             ptr(cu_seqlens_k) if cu_seqlens_k is not None else 0), caller.stream(dev))
    elif action == "fill":  # every row sees no key: 0 and -inf (Semantics 2), no launch
        caller.fill(out, 0)
        if lse is not None:
            caller.fill(lse, -np.inf)
    # "none": no query rows, batch or heads: nothing to compute, no empty grid
    return out, lse


def _desc(caller, x):
    """``x`` as the planning reads it (a torch tensor's :class:`ArrayDesc`; a CuPy array)."""
    return describe_torch(x) if caller is TorchCaller else x


def _prepare(entry):
    """The prepared launch of a prefill entry (:func:`cupyflash.prefill.prepared_launch`), built
    once on its device."""
    from . import jit, prefill
    kern = entry.kernel
    if kern is None:
        kern = entry.kernel = jit.get_kernel(entry.plan.kernel.spec)
    entry.prepared = prefill.prepared_launch(entry.plan.kernel.spec, kern, entry.grid,
                                             entry.block, entry.smem, entry.problem,
                                             entry.strides, entry.sizes, entry.device)
    return entry.prepared


def _cached_call(key_options, want_lse, q, k, v, out, cu_seqlens_q=None, cu_seqlens_k=None):
    """The warm path: ``(out, lse)`` from a :data:`cupyflash.dispatch.LAUNCH_CACHE` hit, or
    None (not every array exactly a ``cupy.ndarray``, or every one exactly a ``torch.Tensor``;
    not cached yet; arrays on different devices: the caller runs the full checks, which raise
    or fill the cache). Reads each array's layout and pointer from its own attributes."""
    arrays = (q, k, v, out, cu_seqlens_q, cu_seqlens_k) if key_options[0] == "varlen" else \
        (q, k, v, out)
    hit = dispatch.warm_entry(key_options[0], key_options[1:], arrays)
    if hit is None:
        return None
    caller, dev, entry = hit
    return _execute_on(entry, caller, dev, want_lse, q, k, v, out, cu_seqlens_q, cu_seqlens_k)


def _execute_on(entry, caller, dev, want_lse, q, k, v, out, cu_seqlens_q, cu_seqlens_k):
    """:func:`_execute` with ``dev`` made the current device for it when it is not."""
    if interop.current_device() == dev:
        return _execute(entry, caller, dev, want_lse, q, k, v, out, cu_seqlens_q, cu_seqlens_k)
    with interop.on_device(dev):
        return _execute(entry, caller, dev, want_lse, q, k, v, out, cu_seqlens_q, cu_seqlens_k)


_NO_WINDOW = (-1, -1)  # the default window_size (the warm path knows it by identity)


def _plain_window(window_size) -> bool:
    """``window_size`` is a tuple of two int (the exact types the launch cache accepts)."""
    return (type(window_size) is tuple and len(window_size) == 2
            and type(window_size[0]) is int and type(window_size[1]) is int)


def _plain_options(softmax_scale, causal, window_size):
    """``(softmax_scale, causal, window_size)`` when all are plain values of the exact types the
    launch cache accepts (None or float; bool; tuple of two int), else None."""
    if (type(causal) is bool and (softmax_scale is None or type(softmax_scale) is float)
            and _plain_window(window_size)):
        return softmax_scale, causal, window_size
    return None


def _torch_compiling() -> bool:
    """True while ``torch.compile`` (Dynamo) or ``torch.export`` traces the caller
    (``torch.compiler.is_compiling()``, which Dynamo folds to True); False when torch has not
    been imported (never imports it) and in eager code, the custom operators' real
    implementations included. Once torch is imported this name is rebound to
    ``torch.compiler.is_compiling`` itself (~0.1 us per eager call, no frame of ours)."""
    global _torch_compiling
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    _torch_compiling = torch.compiler.is_compiling
    return _torch_compiling()


def _all_torch(*arrays) -> bool:
    """Every non-None array a torch tensor (torch is imported: the caller is being traced)."""
    tensor = sys.modules["torch"].Tensor
    return all(a is None or isinstance(a, tensor) for a in arrays)


def _traced_call(op, args: tuple, kwargs: dict, return_lse, out):
    """What a call traced by ``torch.compile`` runs instead of its body: the custom operator
    wrapper ``op`` of :mod:`cupyflash.torch_ops` (its fake implementation gives the shapes, so
    Dynamo never traces the CuPy/NumPy call path; the compiled code runs the real call). The
    operator returns a new output: a given ``out`` is written by a copy of it."""
    want_lse = _require_bool(return_lse, "return_lse")
    o, lse = op(*args, return_lse=True, **kwargs)
    if out is not None:
        out.copy_(o)
        o = out
    return (o, lse) if want_lse else o


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------
def flash_attn_func(q, k, v, *, softmax_scale=None, causal=False, window_size=_NO_WINDOW,
                    return_lse=False, out=None):
    """Exact softmax attention, tiled on chip (FlashAttention-2 forward).

    ``out[b, i, h] = sum_j softmax_j(softmax_scale * q[b, i, h] . k[b, j, h // g]) v[b, j, h // g]``
    over the keys ``j`` that query row ``i`` may see, with ``g = nheads // nheads_k`` (GQA/MQA).
    FlashAttention-2, arXiv 2307.08691, Sec. 3.1 (online softmax, unscaled accumulator normalised
    once at the end) and Algorithm 1; on sm_90a devices, float16/bfloat16 at head dims from 40 up
    (padded onto 64, 128 or 256) use the TMA kernel built as FlashAttention-3 (arXiv 2407.08608,
    Sec. 3.1-3.2: producer warp, warpgroup MMA, softmax/GEMM overlap, persistent grid). The
    result is the same function (tested against the same float64 reference).

    Parameters
    ----------
    q : CUDA array, shape (batch, seqlen_q, nheads, headdim)
        float16, bfloat16, float32 or float64. A ``cupy.ndarray`` or anything exposing
        ``__cuda_array_interface__`` or DLPack on a CUDA device (e.g. a PyTorch CUDA tensor),
        used in place (no copy). Any strides, but the last dimension must be contiguous.
    k, v : CUDA array, shape (batch, seqlen_k, nheads_k, headdim)
        Same dtype and device as ``q``; ``nheads % nheads_k == 0``.
    softmax_scale : float, optional
        Multiplies ``q k^T``; default ``1 / sqrt(headdim)``. Must be finite and positive.
        This and the options after it are keyword-only: FlashAttention's fourth positional
        parameter is ``dropout_p`` (no dropout here), so a call ported with it positionally
        raises a TypeError instead of reading the dropout rate as the scale.
    causal : bool
        Causal mask aligned bottom-right: row ``i`` sees key ``j`` iff
        ``j <= i + seqlen_k - seqlen_q``. Same as ``window_size=(left, 0)``: with ``causal=True``
        a window's right side is dropped (FlashAttention's convention), its left side kept.
    window_size : tuple of 2 int
        Sliding window ``(left, right)`` in keys, -1 = unbounded, aligned bottom-right like
        ``causal``: row ``i`` sees ``i + seqlen_k - seqlen_q - left <= j <=
        i + seqlen_k - seqlen_q + right``.
    return_lse : bool
        Also return the log-sum-exp of each row.
    out : CUDA array, optional
        Output buffer, same shape, dtype and device as ``q``; written in place and returned
        (itself for a torch caller, else as a CuPy view of the same memory). Allocated when
        None.

    Returns
    -------
    out : torch.Tensor or cupy.ndarray, shape (batch, seqlen_q, nheads, headdim), dtype of ``q``
        A contiguous ``torch.Tensor`` when every array argument is a torch tensor, else a
        ``cupy.ndarray``. Rows with no visible key are 0.
    lse : torch.Tensor or cupy.ndarray, shape (batch, nheads, seqlen_q), float32
        Only if ``return_lse``: natural log of each row's softmax denominator of the scaled
        scores (``-inf`` for a row with no visible key). Without ``return_lse`` none is
        allocated and the kernel writes none.

    Raises
    ------
    TypeError
        An array argument not on a CUDA device (NumPy arrays: use
        :func:`cupyflash.reference.attention_reference`), unsupported or mismatched dtypes,
        non-bool ``causal`` / ``return_lse``, bad ``window_size`` or ``softmax_scale`` type,
        an option passed positionally (they are keyword-only).
    ValueError
        Wrong shapes, ``headdim`` not a multiple of 8 up to 256, ``nheads % nheads_k != 0``,
        non-contiguous last dimension, arrays on different devices, a NaN/Inf/non-positive
        ``softmax_scale``, or no kernel specialisation for the problem (the message lists why
        each was rejected; see :func:`explain`).

    Notes
    -----
    Runs on torch's current stream of ``q``'s device for torch tensors
    (``torch.cuda.current_stream(q.device)``; inside ``with torch.cuda.stream(s):`` on ``s``),
    else on CuPy's current stream of the device holding ``q`` (``with cupy.cuda.Stream(): ...``).

    Traced by ``torch.compile`` (``fullgraph=True`` too) with torch tensors, the call is the
    custom operator ``cupyflash::flash_attn`` (:func:`cupyflash.torch_ops.flash_attn_func`),
    whose fake implementation gives the output shapes: no graph break, and the compiled code
    runs this function on the tensors. ``out=`` is then written by a copy of the operator's
    output.
    """
    if _torch_compiling() and _all_torch(q, k, v, out):
        from . import torch_ops
        return _traced_call(torch_ops.flash_attn_func, (q, k, v),
                            dict(softmax_scale=softmax_scale, causal=causal,
                                 window_size=window_size), return_lse, out)
    tensor = interop._TORCH_TENSOR  # (None until a torch tensor was seen: no hit possible)
    if (type(q) is tensor and type(k) is tensor and type(v) is tensor
            and (causal is False or causal is True) and (return_lse is False or return_lse is True)
            and (softmax_scale is None or type(softmax_scale) is float)
            and (window_size is _NO_WINDOW or _plain_window(window_size))):
        # the warm path of torch tensors (an out of another kind: no key, the full path)
        key = dispatch.torch_key(("dense:torch", softmax_scale, causal, window_size),
                                 (q, k, v, out), tensor)
        entry = dispatch.LAUNCH_CACHE.get(key)
        if entry is not None:
            o, lse = _execute_on(entry, TorchCaller, entry.device, return_lse, q, k, v, out,
                                 None, None)
            return (o, lse) if return_lse else o
    opts = _plain_options(softmax_scale, causal, window_size)
    if opts is not None:
        opts = ("dense",) + opts
        if type(return_lse) is bool:
            r = _cached_call(opts, return_lse, q, k, v, out)
            if r is not None:
                return r if return_lse else r[0]
    want_lse = _require_bool(return_lse, "return_lse")
    _require_device({"q": q, "k": k, "v": v, "out": out}, _NUMPY_HINT["dense"])
    problem = checks.check_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                     window_size=window_size, out=out)
    o, lse = _run(problem, q, k, v, out, options=opts, want_lse=want_lse)
    return (o, lse) if want_lse else o


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           *, softmax_scale=None, causal=False, window_size=(-1, -1),
                           return_lse=False, out=None, validate=True):
    """Exact attention over a packed batch of variable-length sequences (FlashAttention-2 forward).

    Sequence ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``; each is attended on its own, with the causal / window
    masks aligned bottom-right against that sequence's own lengths. FlashAttention-2,
    arXiv 2307.08691, Sec. 3.1 and Algorithm 1, per sequence; on sm_90a float16/bfloat16 from
    head dim 40 up, the TMA kernel built as FlashAttention-3 (arXiv 2407.08608), its tensor maps
    seeing the packed tokens as one batch entry.

    Parameters
    ----------
    q : CUDA array, shape (total_q, nheads, headdim)
    k, v : CUDA array, shape (total_k, nheads_k, headdim)
        Dtypes, strides and devices as in :func:`flash_attn_func`.
    cu_seqlens_q, cu_seqlens_k : CUDA int32 array, shape (batch + 1,)
        Sequence starts: ``0 = cu[0] <= cu[1] <= ... <= cu[batch] = total``. Zero-length
        sequences are allowed (a query with no keys gives 0 and LSE -inf).
    max_seqlen_q, max_seqlen_k : int
        At least the longest query / key sequence; ``max_seqlen_q`` sizes the launch grid.
    softmax_scale, causal, window_size, return_lse, out
        As in :func:`flash_attn_func` (``out`` has the shape of ``q``).
    validate : bool
        When True (default) the ``cu_seqlens`` values are copied to the host and checked (this
        synchronises with the device); False checks shapes and dtypes only, and the caller
        guarantees the values (wrong values then read out of bounds).

    Returns
    -------
    out : torch.Tensor or cupy.ndarray, shape (total_q, nheads, headdim), dtype of ``q``
        By the caller's kind and on the caller's stream, as in :func:`flash_attn_func`.
    lse : torch.Tensor or cupy.ndarray, shape (nheads, total_q), float32
        Only if ``return_lse``.

    Raises
    ------
    TypeError, ValueError
        As in :func:`flash_attn_func`, plus non-int32 or host ``cu_seqlens``, and (with
        ``validate``) ``cu_seqlens`` not starting at 0, decreasing, not ending at the packed
        length, or longer than ``max_seqlen``.

    Notes
    -----
    Traced by ``torch.compile`` with torch tensors, the call is the custom operator
    ``cupyflash::flash_attn_varlen`` (:func:`cupyflash.torch_ops.flash_attn_varlen_func`), as
    in :func:`flash_attn_func`; pass ``validate=False`` there (True reads ``cu_seqlens`` on the
    host when the compiled code runs: a synchronisation, and no CUDA graph).
    """
    if _torch_compiling() and _all_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, out):
        from . import torch_ops
        return _traced_call(torch_ops.flash_attn_varlen_func,
                            (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                            dict(softmax_scale=softmax_scale, causal=causal,
                                 window_size=window_size, validate=validate), return_lse, out)
    opts = _plain_options(softmax_scale, causal, window_size)
    if opts is not None and type(max_seqlen_q) is int and type(max_seqlen_k) is int:
        # validate is not in the key: the entry follows from shapes alone, but only
        # validate=False may skip the checks (validate=True reads the values every call)
        opts = ("varlen",) + opts + (max_seqlen_q, max_seqlen_k)
        if (validate is False and type(return_lse) is bool
                and cu_seqlens_q is not None and cu_seqlens_k is not None):
            r = _cached_call(opts, return_lse, q, k, v, out, cu_seqlens_q, cu_seqlens_k)
            if r is not None:
                return r if return_lse else r[0]
    else:
        opts = None
    want_lse = _require_bool(return_lse, "return_lse")
    _require_device({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q,
                     "cu_seqlens_k": cu_seqlens_k, "out": out}, _NUMPY_HINT["varlen"])
    problem = checks.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                                  window_size=window_size, out=out, validate=validate)
    o, lse = _run(problem, q, k, v, out, cu_seqlens_q, cu_seqlens_k, options=opts,
                  want_lse=want_lse)
    return (o, lse) if want_lse else o


def explain(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
            return_lse=False, out=None, arch=None, num_sms=None):
    """The plan :func:`flash_attn_func` would execute for these arguments, as data; launches nothing.

    Accepts the same arguments as :func:`flash_attn_func`, and arrays of any kind (NumPy arrays
    too: only shapes and dtypes are read), so it runs on a machine without a GPU.

    Parameters
    ----------
    q, k, v, softmax_scale, causal, window_size, return_lse, out
        As in :func:`flash_attn_func` (``return_lse`` does not change the plan).
    arch : str, optional
        Architecture of the ptxas report (``"sm_80"``, ``"sm_90a"``, ...; sm_80 or newer);
        default the current device's, or ``"sm_90a"`` without a GPU.
    num_sms : int, optional
        SMs the tile heuristic plans for; default the current device's, or an H200's 132
        without a GPU (the plan's notes then say so).

    Returns
    -------
    cupyflash.dispatch.Plan
        Kernel specialisation name and template values, grid, block, dynamic shared memory
        (bytes), registers per thread and spill bytes (ptxas report of an NVRTC compile),
        ``num_splits`` (None for prefill), predicted FLOPs and HBM bytes, ``roofline_ms`` (the
        predicted time in milliseconds at the H200's measured roofs), and the reasons every other
        specialisation was not chosen (``rejected``; printing shows the nearest eight).

    Raises
    ------
    TypeError, ValueError
        Exactly those :func:`flash_attn_func` raises for invalid or unsupported input (except the
        CUDA-array requirement).
    """
    _require_bool(return_lse, "return_lse")
    problem = checks.check_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                     window_size=window_size, out=out)
    _check_layouts({"q": q, "k": k, "v": v, "out": out})
    return dispatch.plan_prefill(problem, arch=arch, num_sms=num_sms)


def _check_layouts(named: dict) -> None:
    """The kernels' layout rule, also for host arrays passed to ``explain``: the checks apply it
    to device arrays only (the NumPy reference takes any strides)."""
    for name, x in named.items():
        if x is not None:
            checks.check_last_dim_contiguous(x, name)


def explain_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   *, softmax_scale=None, causal=False, window_size=(-1, -1),
                   return_lse=False, out=None, validate=True, arch=None, num_sms=None):
    """The plan :func:`flash_attn_varlen_func` would execute, as data; launches nothing.

    Same arguments as :func:`flash_attn_varlen_func`; arrays of any kind (NumPy included). FLOPs
    are counted exactly per sequence when ``validate`` (the ``cu_seqlens`` are read), else None.
    ``arch`` and ``num_sms``: as in :func:`explain`.

    Returns
    -------
    cupyflash.dispatch.Plan

    Raises
    ------
    TypeError, ValueError
        As :func:`flash_attn_varlen_func` (except the CUDA-array requirement).
    """
    _require_bool(return_lse, "return_lse")
    problem = checks.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                                  window_size=window_size, out=out, validate=validate)
    _check_layouts({"q": q, "k": k, "v": v, "out": out})
    lengths = None
    if validate:
        lengths = (np.diff(checks.to_host(cu_seqlens_q).astype(np.int64)),
                   np.diff(checks.to_host(cu_seqlens_k).astype(np.int64)))
    return dispatch.plan_prefill(problem, arch=arch, lengths=lengths, num_sms=num_sms)


# ==============================================================================================
# Decode (split-KV, Flash-Decoding): H4 appends flash_attn_with_kvcache and friends below this
# line. Keep the order of work above: device check -> checks.check_kvcache -> dispatch plan ->
# launch on interop.current_stream().
# ==============================================================================================
