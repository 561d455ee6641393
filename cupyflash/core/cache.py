"""The launch cache: what a warm call (same layouts and options as an earlier one) reuses.

Shared by the forward (:mod:`cupyflash.api`, :mod:`cupyflash.forward.dispatch`) and decode
(:mod:`cupyflash.decode`) paths.
"""
from __future__ import annotations

from . import interop

__all__ = ["LAUNCH_CACHE", "LAUNCH_CACHE_SIZE", "launch_key", "torch_key", "caller_key",
           "warm_entry", "cache_put", "ContiguousLayout", "out_like"]


# ----------------------------------------------------------------------------------------------
# The launch cache (what a warm call reuses)
# ----------------------------------------------------------------------------------------------
#: Everything a call derives from its arguments' layouts and options, kept per
#: :func:`launch_key`: the validated problem, the plan, the launch geometry, the constant kernel
#: arguments (NumPy scalars) and the compiled kernel. ``flash_attn_func``,
#: ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache`` store an entry only after the full
#: validation (:mod:`cupyflash.core.checks`) and the planning succeeded, and look it up *before*
#: validating only when every array argument is exactly a ``cupy.ndarray`` (or every one exactly
#: a ``torch.Tensor``: :func:`torch_key`, the device in the key) and every option is
#: a plain Python value of the exact type (``bool``, ``int``, ``float``, ``None``, a tuple of
#: two ``int``): for such arguments the checks read nothing but the key's fields, so a hit
#: proves they pass again. Values that are not in the key are checked on every call (the device
#: of every array for CuPy arrays, base-pointer alignment). Host content checks
#: (``validate=True``: ``cu_seqlens``, host ``cache_seqlens`` / ``block_table`` values) never
#: take the cached path (device ``cache_seqlens`` / ``block_table`` are checked by the decode
#: kernels, :mod:`cupyflash.core.guard`).
#: Cleared when it reaches :data:`LAUNCH_CACHE_SIZE` entries.
LAUNCH_CACHE: dict = {}
LAUNCH_CACHE_SIZE = 4096


def launch_key(kind: str, dev: int, options: tuple, arrays: tuple) -> tuple:
    """The :data:`LAUNCH_CACHE` key of a call of CuPy arrays (:func:`torch_key`: of torch
    tensors).

    Parameters
    ----------
    kind : str
        ``"dense"``, ``"varlen"`` or ``"kvcache"``.
    dev : int
        CUDA device of ``q`` (the launch device).
    options : tuple
        The call's options as given (hashable plain values; see :data:`LAUNCH_CACHE`).
    arrays : tuple
        The array arguments in signature order (None where absent); each contributes its
        ``(shape, strides, dtype)``.
    """
    return (kind, dev, options) + tuple(None if a is None else (a.shape, a.strides, a.dtype)
                                        for a in arrays)


def torch_key(head: tuple, arrays: tuple, tensor):
    """The :data:`LAUNCH_CACHE` key of a call of torch tensors, or None when an array is not
    exactly of the class ``tensor`` (``torch.Tensor``).

    One flat tuple: ``head`` (the kind, ``"dense:torch"``, ``"varlen:torch"`` or
    ``"kvcache:torch"``, then the call's options as given), then for each array in signature
    order ``None`` when absent, else its ``shape``, ``stride()`` (elements), ``dtype`` and
    ``device`` (a hit proves every array is on the device its entry was validated for; the
    entry's ``device`` is that device's ordinal). An absent array is one ``None`` and a shape is
    never None, so two keys of one kind are equal only when every array's fields are."""
    key = head
    for a in arrays:
        if a is None:
            key += (None,)
        elif type(a) is tensor:
            key += (a.shape, a.stride(), a.dtype, a.device)
        else:
            return None
    return key


#: the launch-cache kind of a torch caller's call (its layouts are torch's)
TORCH_KINDS = {"dense": "dense:torch", "varlen": "varlen:torch", "kvcache": "kvcache:torch"}


def caller_key(caller, kind: str, dev: int, options: tuple, arrays: tuple) -> tuple:
    """The :data:`LAUNCH_CACHE` key of a call by ``caller`` (:mod:`cupyflash.core.interop`'s
    CupyCaller: :func:`launch_key`; TorchCaller: :func:`torch_key`)."""
    if caller is interop.TorchCaller:
        return torch_key((TORCH_KINDS[kind],) + options, arrays, interop.torch_tensor_type())
    return launch_key(kind, dev, options, arrays)


def warm_entry(kind: str, options: tuple, arrays: tuple):
    """``(caller, device, entry)`` of a warm call: every array (``q`` first) exactly a
    ``cupy.ndarray``, or every one exactly a ``torch.Tensor``, their :func:`caller_key` in
    :data:`LAUNCH_CACHE` and all on ``q``'s device; else None (the caller runs the full checks,
    which raise or fill the cache). One pass over the arrays' attributes."""
    q = arrays[0]
    tq = type(q)
    if tq is (interop._CUPY_NDARRAY or interop.cupy_ndarray_type()):
        dev = q.data.device_id
        key = [kind, dev, options]
        append = key.append
        for a in arrays:
            if a is None:
                append(None)
            elif type(a) is not tq or a.data.device_id != dev:
                return None
            else:
                append((a.shape, a.strides, a.dtype))
        entry = LAUNCH_CACHE.get(tuple(key))
        return None if entry is None else (interop.CupyCaller, dev, entry)
    if tq is (interop._TORCH_TENSOR or interop.torch_tensor_type()) and tq is not type(None):
        key = torch_key((TORCH_KINDS[kind],) + options, arrays, tq)
        entry = LAUNCH_CACHE.get(key) if key is not None else None
        return None if entry is None else (interop.TorchCaller, entry.device, entry)
    return None


def cache_put(key, entry) -> None:
    """Store ``entry`` under ``key`` (clearing the cache when full)."""
    if len(LAUNCH_CACHE) >= LAUNCH_CACHE_SIZE:
        LAUNCH_CACHE.clear()
    LAUNCH_CACHE[key] = entry


class ContiguousLayout:
    """Shape, strides and dtype of a C-contiguous array not yet allocated (``out=None``)."""

    class data:  # noqa: N801 - stands in for MemoryPointer (cupy.empty is 256-byte aligned)
        ptr = 0

    def __init__(self, shape: tuple, dtype):
        self.shape, self.dtype, self.ndim = tuple(shape), dtype, len(shape)
        self.itemsize = dtype.itemsize
        self.strides = interop.c_strides(self.shape, dtype.itemsize)


def out_like(q) -> bool:
    """Whether an output of ``q``'s shape and dtype, C-contiguous, can be allocated as
    ``torch.empty_like(q)``: ``q`` is a torch tensor's :class:`cupyflash.core.interop.ArrayDesc`
    whose strides are exactly the C-contiguous ones (``empty_like`` keeps the strides of a dense
    tensor, so then it allocates what ``torch.empty(q.shape)`` would)."""
    return (isinstance(q, interop.ArrayDesc)
            and q.strides == ContiguousLayout(q.shape, q.dtype).strides)


