"""The eager execution of the forward calls (:func:`cupyflash.flash_attn_func`,
:func:`cupyflash.flash_attn_varlen_func`): the warm path (a :data:`cupyflash.core.cache.LAUNCH_CACHE`
hit), else the checks (:mod:`cupyflash.core.checks`), the plan (:mod:`.dispatch`), the allocation
of the outputs and the launch, by the caller's conventions (:mod:`cupyflash.core.interop`).
"""
from __future__ import annotations

import numpy as np

from ..core import cache, checks, interop
from ..core.interop import (ArrayDesc, TorchCaller, as_cupy, caller_of,
                            describe_torch, is_device_array)
from . import dispatch, kernels

__all__ = ["flash_attn", "flash_attn_varlen", "require_bool", "NO_WINDOW"]

_NUMPY_HINT = {
    "dense": "; for NumPy arrays use cupyflash.reference.attention_reference",
    "varlen": "; for NumPy arrays use cupyflash.reference.varlen_attention_reference",
}


# ----------------------------------------------------------------------------------------------
# Argument plumbing (validation itself lives in cupyflash.core.checks)
# ----------------------------------------------------------------------------------------------
def _require_device(named: dict, hint: str) -> None:
    """TypeError naming the first argument that is not a CUDA array (NumPy, lists, CPU tensors).
    Host ``cu_seqlens`` beside a CUDA ``q`` are told how to copy them to the device instead of
    being sent to the NumPy reference."""
    for name, x in named.items():
        if x is not None and not is_device_array(x):
            if name.startswith("cu_seqlens") and is_device_array(named.get("q")):
                hint = (f"; copy it to q's device as int32: cupy.asarray({name}, "
                        f"dtype=cupy.int32) for CuPy, torch.as_tensor({name}, "
                        f"dtype=torch.int32, device=q.device) for torch")
            raise TypeError(f"{name}: expected a CUDA array (cupy.ndarray, or an object exposing "
                            f"__cuda_array_interface__ or DLPack on a CUDA device), got "
                            f"{type(x).__module__}.{type(x).__name__}{hint}")


def require_bool(x, name: str) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__} {x!r}")
    return bool(x)


def _device_of(a) -> int:
    """CUDA device of a CuPy array or an :class:`cupyflash.core.interop.ArrayDesc`."""
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
    for a torch caller (:func:`cupyflash.core.interop.caller_of`), else CuPy arrays; ``lse`` is None
    unless ``want_lse`` (the kernel then writes none).

    ``options``: the call's ``(kind, ...)`` options when they are plain values (the launch
    cache key, see :data:`cupyflash.core.cache.LAUNCH_CACHE`), else None (nothing is cached).
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
            key = cache.caller_key(caller, options[0], dev, options[1:],
                                      arrays if problem.varlen else arrays[:4])
        d = tuple(views.values())
        entry = dispatch.prefill_launch(problem, key, dev, *d[:4])
        return _execute(entry, caller, dev, want_lse, *arrays)


def _execute(entry, caller, dev, want_lse, q, k, v, out, cu_seqlens_q, cu_seqlens_k):
    """Allocate and launch a :class:`cupyflash.forward.dispatch.PrefillLaunch` on the current device
    ``dev`` (that of every array) and the caller's stream. Returns ``(out, lse)``; without
    ``want_lse`` no LSE is allocated or written (None; the kernel gets NULL)."""
    if out is None:  # (torch: empty_like where it gives what empty would, cheaper)
        out = (caller.empty_like(q) if entry.out_like_q
               else caller.empty(q.shape, entry.problem.dtype, dev))
    lse = caller.empty(entry.lse_shape, entry.lse_dtype, dev) if want_lse else None
    action = entry.action
    if action == "launch":
        ptr = caller.ptr
        qp, kp, vp, op = ptr(q), ptr(k), ptr(v), ptr(out)
        if entry.tensor_cores and (qp | kp | vp | op) % 16:
            kernels.check_pointers(entry.plan.kernel.spec,
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
    """The prepared launch of a prefill entry (:func:`cupyflash.forward.kernels.prepared_launch`), built
    once on its device."""
    from ..core import jit
    kern = entry.kernel
    if kern is None:
        kern = entry.kernel = jit.get_kernel(entry.plan.kernel.spec)
    entry.prepared = kernels.prepared_launch(entry.plan.kernel.spec, kern, entry.grid,
                                             entry.block, entry.smem, entry.problem,
                                             entry.strides, entry.sizes, entry.device)
    return entry.prepared


def _cached_call(key_options, want_lse, q, k, v, out, cu_seqlens_q=None, cu_seqlens_k=None):
    """The warm path: ``(out, lse)`` from a :data:`cupyflash.core.cache.LAUNCH_CACHE` hit, or
    None (not every array exactly a ``cupy.ndarray``, or every one exactly a ``torch.Tensor``;
    not cached yet; arrays on different devices: the caller runs the full checks, which raise
    or fill the cache). Reads each array's layout and pointer from its own attributes."""
    arrays = (q, k, v, out, cu_seqlens_q, cu_seqlens_k) if key_options[0] == "varlen" else \
        (q, k, v, out)
    hit = cache.warm_entry(key_options[0], key_options[1:], arrays)
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


NO_WINDOW = (-1, -1)  # the default window_size (the warm path knows it by identity)


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




def flash_attn(q, k, v, softmax_scale, causal, window_size, return_lse, out):
    """The eager call of :func:`cupyflash.api.flash_attn_func` (its documentation); also what the
    custom operator of :mod:`cupyflash.torch_ops` runs."""
    tensor = interop._TORCH_TENSOR  # (None until a torch tensor was seen: no hit possible)
    if (type(q) is tensor and type(k) is tensor and type(v) is tensor
            and (causal is False or causal is True) and (return_lse is False or return_lse is True)
            and (softmax_scale is None or type(softmax_scale) is float)
            and (window_size is NO_WINDOW or _plain_window(window_size))):
        # the warm path of torch tensors (an out of another kind: no key, the full path)
        key = cache.torch_key(("dense:torch", softmax_scale, causal, window_size),
                                 (q, k, v, out), tensor)
        entry = cache.LAUNCH_CACHE.get(key)
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
    want_lse = require_bool(return_lse, "return_lse")
    _require_device({"q": q, "k": k, "v": v, "out": out}, _NUMPY_HINT["dense"])
    problem = checks.check_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                     window_size=window_size, out=out)
    o, lse = _run(problem, q, k, v, out, options=opts, want_lse=want_lse)
    return (o, lse) if want_lse else o




def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                      causal, window_size, return_lse, out, validate):
    """The eager call of :func:`cupyflash.api.flash_attn_varlen_func` (its documentation); also
    what the custom operator of :mod:`cupyflash.torch_ops` runs."""
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
    want_lse = require_bool(return_lse, "return_lse")
    _require_device({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q,
                     "cu_seqlens_k": cu_seqlens_k, "out": out}, _NUMPY_HINT["varlen"])
    problem = checks.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                                  window_size=window_size, out=out, validate=validate)
    o, lse = _run(problem, q, k, v, out, cu_seqlens_q, cu_seqlens_k, options=opts,
                  want_lse=want_lse)
    return (o, lse) if want_lse else o


