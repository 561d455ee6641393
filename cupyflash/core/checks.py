"""Every user-facing input check of cupyflash, in one place.

Each public entry point (the CUDA paths in :mod:`cupyflash.api` and the NumPy reference in
:mod:`cupyflash.reference`) calls one of the ``check_*`` functions below before doing any work,
so that the kernels and the reference reject exactly the same inputs with exactly the same
messages.

The checks read only ``.shape``, ``.dtype`` and strides, so they accept NumPy arrays, CuPy arrays,
PyTorch tensors and anything else with those attributes; CuPy is never imported at module import
time. Content checks (``cu_seqlens``, ``cache_seqlens``, ``block_table`` values) copy those small
index arrays to the host when ``validate=True``.

Errors
------
``TypeError``
    Wrong kind of object or unsupported dtype.
``ValueError``
    Wrong shape, inconsistent sizes, or out-of-range values.

Every message starts with the name of the offending argument, then says what was given and what
is supported, e.g. ``"k: expected 4 dims (batch, seqlen_k, nheads_k, headdim), got shape (2, 3)"``.

Semantics (README, "Semantics"): causal masking is aligned bottom-right;
``window_size=(left, right)`` with -1 meaning unbounded, also bottom-right aligned;
``causal=True`` is the same as ``right=0``; ``softmax_scale=None`` means ``1/sqrt(headdim)``.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from . import deps
from .interop import is_device_array, np_dtype, torch_tensor_type  # (imports no CuPy)

__all__ = [
    "AttnProblem", "DecodeProblem", "SUPPORTED_DTYPES", "MAX_HEADDIM", "HEADDIM_MULTIPLE",
    "check_attention", "check_varlen", "check_kvcache", "check_kvcache_values", "check_merge",
    "resolve_softmax_scale",
    "check_last_dim_contiguous", "element_strides", "page_strides_fit_i32", "page_offsets_fit_i32",
    "aligned16", "rows_aligned16", "device_pointer",
    "check_window_size",
    "kernel_window", "dtype_name", "to_host", "host_array", "lengths_from_host",
    "negative_length_message", "capacity_message", "page_id_message", "HOST_INDEX_DTYPES",
]

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64")
MAX_HEADDIM = 256
HEADDIM_MULTIPLE = 8


# ----------------------------------------------------------------------------------------------
# Problem descriptions returned by the checks
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttnProblem:
    """A validated prefill (dense or variable-length) attention problem.

    Attributes
    ----------
    batch : int
        Number of sequences (varlen: ``len(cu_seqlens_q) - 1``).
    seqlen_q, seqlen_k : int
        Query / key length (varlen: ``max_seqlen_q`` / ``max_seqlen_k``).
    nheads, nheads_k : int
        Query heads and key/value heads; ``nheads % nheads_k == 0`` (GQA/MQA).
    headdim : int
        Head dimension, a positive multiple of 8, at most 256.
    dtype : str
        NumPy name of the element type: ``'float16'``, ``'bfloat16'``, ``'float32'`` or
        ``'float64'``.
    softmax_scale : float
        The resolved scale (finite, positive) applied to ``q k^T``.
    causal : bool
        True when the effective mask is causal, i.e. the normalised ``window_size[1] == 0``
        (``causal=True`` and ``window_size=(-1, 0)`` describe the same problem).
    window_size : tuple[int, int]
        Normalised ``(left, right)``, -1 = unbounded; ``causal=True`` sets ``right = 0``.
    varlen : bool
        True for :func:`check_varlen` problems.
    total_q, total_k : int
        Packed token counts (varlen only; 0 otherwise).
    """
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    headdim: int
    dtype: str
    softmax_scale: float
    causal: bool
    window_size: tuple
    varlen: bool = False
    total_q: int = 0
    total_k: int = 0


@dataclass(frozen=True)
class DecodeProblem:
    """A validated attention-against-a-KV-cache problem (decode / chunked prefill).

    Attributes
    ----------
    batch, seqlen_q, nheads, nheads_k, headdim : int
        Sizes of ``q`` (batch, seqlen_q, nheads, headdim) and the cache heads.
    dtype : str
        NumPy name of the element type.
    softmax_scale : float
        Resolved scale.
    causal : bool
        Bottom-right causal mask against each sequence's length (cache + new tokens).
    paged : bool
        True when ``block_table`` is given.
    seqlen_cache : int
        Capacity per sequence in tokens: cache dim 1 (contiguous) or
        ``max_pages_per_seq * page_size`` (paged).
    page_size : int
        Tokens per page (0 if contiguous).
    num_pages : int
        Pages in the pool (0 if contiguous).
    max_pages_per_seq : int
        Columns of ``block_table`` (0 if contiguous).
    seqlen_new : int
        Tokens appended from ``k``/``v`` (0 if none).
    num_splits : int
        As given (0 = choose by heuristic).
    page_offsets_fit_i32 : bool
        Paged caches: every page stride of ``k_cache`` and ``v_cache`` and ``page_size`` x
        their row strides lie in [0, 2^31) elements (False when a stride is negative, larger,
        or unknown), so that a page can be addressed with 32-bit offsets; True when contiguous.
    q_aligned16 : bool
        ``q``'s strides (of the dims with more than one element) are 16-byte multiples, and so is
        its data pointer where ``q`` is a device array (a host array's is not the one the
        kernel will see): the split kernel then copies the Q tile by 16-byte ``cp.async``
        beside the sequence's length, else by 2-byte loads (the same result, slower). Unknown
        strides: False.
    """
    batch: int
    seqlen_q: int
    nheads: int
    nheads_k: int
    headdim: int
    dtype: str
    softmax_scale: float
    causal: bool
    paged: bool
    seqlen_cache: int
    page_size: int
    num_pages: int
    max_pages_per_seq: int
    seqlen_new: int
    num_splits: int
    page_offsets_fit_i32: bool = True
    q_aligned16: bool = True


# ----------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------
def _is_int(x) -> bool:
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_bool(x) -> bool:
    return isinstance(x, (bool, np.bool_))


def dtype_name(x) -> str:
    """NumPy name of an array's element type.

    Parameters
    ----------
    x : array
        NumPy/CuPy array (``np.dtype(x.dtype).name``; ml_dtypes' bfloat16 gives ``'bfloat16'``)
        or PyTorch tensor (``torch.float16`` -> ``'float16'``).

    Returns
    -------
    str
        E.g. ``'float16'``, ``'bfloat16'``, ``'float32'``, ``'int32'``.
    """
    dt = x.dtype
    try:
        return _DTYPE_NAMES[dt]  # np.dtype(...).name costs ~1.5 us: remember it per dtype
    except (KeyError, TypeError):  # TypeError: an unhashable dtype (not cached)
        pass
    try:
        name = np.dtype(dt).name
    except TypeError:
        name = str(dt).rsplit(".", 1)[-1]  # torch.bfloat16 -> 'bfloat16'
    try:
        _DTYPE_NAMES[dt] = name
    except TypeError:
        pass
    return name


#: dtype object (NumPy / CuPy / ml_dtypes / torch) -> its name, filled by :func:`dtype_name`.
_DTYPE_NAMES: dict = {}


def _shape(x, name: str) -> tuple:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name}: expected an array (NumPy, CuPy, or torch tensor) with .shape "
                        f"and .dtype, got {type(x).__name__}")
    return tuple(int(s) for s in x.shape)


_is_device = is_device_array


def _check_ndim(x, name: str, layout: str) -> tuple:
    shape = _shape(x, name)
    want = layout.count(",") + 1
    if len(shape) != want:
        raise ValueError(f"{name}: expected {want} dims ({layout}), got shape {shape}")
    return shape


def _check_dtype(x, name: str, dtypes) -> str:
    dt = dtype_name(x)
    if dt not in dtypes:
        hint = ""
        if dt == "void16" and "bfloat16" in dtypes:  # cupy.asarray(torch bfloat16 tensor)
            hint = (" (2-byte raw 'void16' elements are what cupy.asarray() makes of a torch "
                    "bfloat16 tensor: pass the torch tensor itself, which is viewed without a "
                    "copy, or view the array as ml_dtypes.bfloat16)")
        raise TypeError(f"{name}: dtype {dt} is not supported; supported: {', '.join(dtypes)}"
                        + hint)
    return dt


def _check_same_dtype(x, name: str, dt: str, ref_name: str) -> None:
    got = dtype_name(x)
    if got != dt:
        raise TypeError(f"{name}: dtype {got} must match {ref_name} dtype {dt}")


def _check_headdim(d: int, name: str) -> None:
    if d <= 0 or d % HEADDIM_MULTIPLE or d > MAX_HEADDIM:
        raise ValueError(f"{name}: headdim {d} is not supported; supported: positive multiples "
                         f"of {HEADDIM_MULTIPLE} up to {MAX_HEADDIM}")


def _check_heads(nheads: int, nheads_k: int, kname: str) -> None:
    if nheads_k <= 0 or nheads <= 0:
        raise ValueError(f"{kname}: nheads ({nheads}) and nheads_k ({nheads_k}) must be positive")
    if nheads % nheads_k:
        raise ValueError(f"{kname}: nheads_k {nheads_k} ({kname} axis 2) must divide nheads "
                         f"{nheads} (q axis 2) (GQA/MQA: query head h reads KV head "
                         f"h // (nheads // nheads_k)); heads are read from axis 2 of (batch, "
                         f"seqlen, nheads, headdim): a (batch, nheads, seqlen, headdim) tensor "
                         f"must be transposed first")


def _check_bool(x, name: str) -> bool:
    if not _is_bool(x):
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__} {x!r}")
    return bool(x)


def element_strides(x) -> tuple | None:
    """Strides of ``x`` in elements: CuPy/NumPy ``.strides`` (bytes), torch ``.stride()``
    (elements), or the ``__cuda_array_interface__`` strides (None there: C-contiguous); None
    when they cannot be read (or are not whole elements)."""
    shape = tuple(int(s) for s in getattr(x, "shape", ()))
    stride_fn = getattr(x, "stride", None)
    if callable(stride_fn) and not hasattr(x, "strides"):  # torch
        return tuple(int(v) for v in stride_fn())
    if getattr(x, "strides", None) is not None:
        itemsize = int(x.itemsize) if hasattr(x, "itemsize") else np.dtype(x.dtype).itemsize
        st = tuple(int(v) for v in x.strides)
    elif hasattr(x, "__cuda_array_interface__"):
        cai = x.__cuda_array_interface__
        itemsize = np.dtype(cai["typestr"]).itemsize
        if cai.get("strides") is None:
            return tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape)))
        st = tuple(int(v) for v in cai["strides"])
    else:
        return None
    if any(v % itemsize for v in st):
        return None
    return tuple(v // itemsize for v in st)


def page_strides_fit_i32(page_size: int, strides) -> bool:
    """True when a paged cache's page stride ``strides[0]`` and ``page_size`` x its row stride
    ``strides[1]`` (elements) lie in [0, 2^31): its pages can be addressed with 32-bit offsets."""
    return (len(strides) >= 2 and 0 <= strides[0] < 2 ** 31
            and 0 <= page_size * strides[1] < 2 ** 31)


def page_offsets_fit_i32(page_size: int, *caches) -> bool:
    """:func:`page_strides_fit_i32` for every cache array (strides read by
    :func:`element_strides`; unknown strides: False)."""
    for c in caches:
        st = element_strides(c)
        if st is None or not page_strides_fit_i32(page_size, st):
            return False
    return True


def device_pointer(x) -> int | None:
    """The data pointer of a device array (a CuPy array's ``.data.ptr``, else its
    ``__cuda_array_interface__``), or None for a host array or when unknown."""
    if not is_device_array(x):
        return None
    tt = torch_tensor_type()
    if tt is not None and isinstance(x, tt):  # torch: no interface dict built either
        return int(x.data_ptr())
    data = getattr(x, "data", None)
    if hasattr(data, "ptr"):  # CuPy: no interface dict built
        return int(data.ptr)
    try:
        return int(x.__cuda_array_interface__["data"][0])
    except (AttributeError, KeyError, TypeError, ValueError, RuntimeError):
        return None


def rows_aligned16(shape, byte_strides) -> bool:
    """Every stride but the last (a unit-stride row, checked by
    :func:`check_last_dim_contiguous`) of a dim with more than one element is a multiple of 16
    bytes: each row then starts on a 16-byte boundary relative to the base."""
    return not any(n > 1 and s % 16 for n, s in zip(tuple(shape)[:-1], tuple(byte_strides)[:-1]))


def aligned16(x) -> bool:
    """:func:`rows_aligned16` for ``x``'s strides, and its data pointer a multiple of 16 when
    ``x`` is a device array (:func:`device_pointer`); unknown strides: False. The decode kernel's
    16-byte Q copies need it (kQAsync)."""
    st = element_strides(x)
    if st is None:
        return False
    itemsize = np_dtype(dtype_name(x)).itemsize
    if not rows_aligned16(x.shape, tuple(v * itemsize for v in st)):
        return False
    ptr = device_pointer(x)
    return ptr is None or ptr % 16 == 0


def check_last_dim_contiguous(x, name: str) -> None:
    """Raise unless the last dimension of ``x`` has unit stride.

    Reads CuPy/NumPy ``.strides`` (bytes), torch ``.stride()`` (elements), or the
    ``__cuda_array_interface__`` strides. Arrays with a last dimension of size <= 1 or with no
    elements always pass (their last stride is never used).

    Parameters
    ----------
    x : array-like
        The array to check.
    name : str
        Argument name used in the message.

    Raises
    ------
    ValueError
        ``"{name}: last dimension must be contiguous (stride 1 element), got stride ..."``.
    """
    shape = _shape(x, name)
    if not shape or shape[-1] <= 1 or 0 in shape:
        return
    stride_elems = None
    stride_fn = getattr(x, "stride", None)
    if callable(stride_fn) and not hasattr(x, "strides"):  # torch: strides in elements
        stride_elems = int(stride_fn()[-1])
    elif getattr(x, "strides", None) is not None:
        itemsize = int(x.itemsize) if hasattr(x, "itemsize") else np.dtype(x.dtype).itemsize
        stride_elems = int(x.strides[-1]) / itemsize
    elif hasattr(x, "__cuda_array_interface__"):
        cai = x.__cuda_array_interface__
        if cai.get("strides") is None:
            return  # C-contiguous by definition
        stride_elems = int(cai["strides"][-1]) / np.dtype(cai["typestr"]).itemsize
    if stride_elems is not None and stride_elems != 1:
        raise ValueError(f"{name}: last dimension must be contiguous (stride 1 element), got "
                         f"stride {stride_elems:g} elements for shape {shape}")


def to_host(x) -> np.ndarray:
    """A NumPy copy (or view) of ``x``; device arrays are copied to the host.

    Parameters
    ----------
    x : array-like
        Objects on a CUDA device (CuPy arrays, ``__cuda_array_interface__`` or CUDA DLPack
        objects) go through ``cupy.asnumpy`` (CuPy is imported only then, and the copy
        synchronises the current stream); everything else through ``np.asarray`` (NumPy arrays
        are returned as they are, CPU torch tensors and lists are converted).

    Returns
    -------
    numpy.ndarray
        Same shape and dtype.
    """
    if _is_device(x):
        cupy = deps.cupy("reading a CUDA array on the host")
        if not isinstance(x, cupy.ndarray):
            x = cupy.asarray(x) if hasattr(x, "__cuda_array_interface__") else cupy.from_dlpack(x)
        return cupy.asnumpy(x)
    return np.asarray(x)


def host_array(x, name: str) -> np.ndarray:
    """:func:`to_host` of an argument that must be an array: anything without ``.shape`` and
    ``.dtype`` (a list, a scalar) raises the TypeError of the shared checks (what ``explain``,
    ``explain_kvcache``, ``flash_attn_with_kvcache`` and ``merge_states`` raise), naming
    ``name``, so that the NumPy references reject the same inputs with the same message.
    (``flash_attn_func`` and ``flash_attn_varlen_func`` first require a CUDA array and say so.)
    """
    _shape(x, name)
    return to_host(x)


def kernel_window(problem) -> tuple:
    """``(left, right)`` of ``problem.window_size`` as the kernels take it (int32 arguments).

    A bound that no query row can reach is replaced by -1 (unbounded): the same mask, and the
    kernels' ``row + seqlen_k - seqlen_q +- window`` (int32) cannot overflow for windows up to
    2^31 - 1 ("no limit" written as INT_MAX). ``left`` is unreachable when ``left >= seqlen_k -
    1`` (every row's first visible key is then key 0), ``right`` when ``right >= seqlen_q - 1``
    (every row's last visible key is then the last key); ``seqlen_*`` are the maxima for varlen
    problems. 0 (causal) and -1 are kept as they are.
    """
    left, right = problem.window_size
    if left > 0 and left >= problem.seqlen_k - 1:
        left = -1
    if right > 0 and right >= problem.seqlen_q - 1:
        right = -1
    return int(left), int(right)


def resolve_softmax_scale(softmax_scale, headdim: int) -> float:
    """The scale applied to ``q k^T``: ``1/sqrt(headdim)`` when ``None``.

    Parameters
    ----------
    softmax_scale : float or None
        Requested scale (a real number, not bool).
    headdim : int
        Head dimension, used for the default.

    Returns
    -------
    float
        Finite, positive scale.

    Raises
    ------
    TypeError
        ``softmax_scale`` is not a real number or None.
    ValueError
        ``softmax_scale`` is NaN, infinite, zero or negative.
    """
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    if _is_bool(softmax_scale) or not isinstance(softmax_scale, (numbers.Real, np.floating,
                                                                 np.integer)):
        raise TypeError(f"softmax_scale: expected a float or None, got "
                        f"{type(softmax_scale).__name__} {softmax_scale!r}")
    s = float(softmax_scale)
    if not math.isfinite(s) or s <= 0.0:
        raise ValueError(f"softmax_scale: expected a finite positive float or None, got {s!r}")
    return s


def check_window_size(window_size, causal: bool) -> tuple:
    """Validate ``window_size`` and fold ``causal`` into it.

    Parameters
    ----------
    window_size : tuple of 2 int
        ``(left, right)``; each >= -1, -1 meaning unbounded. Bottom-right aligned: query row ``i``
        of ``seqlen_q`` sees key ``j`` iff
        ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right``.
    causal : bool
        ``True`` sets ``right = 0`` (the causal mask is the window ``(-1, 0)``).

    Returns
    -------
    tuple[int, int]
        The normalised window.

    Raises
    ------
    TypeError
        Not a tuple/list of two ints.
    ValueError
        An entry below -1.
    """
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 \
            or not all(_is_int(w) for w in window_size):
        raise TypeError(f"window_size: expected a tuple of 2 ints (left, right), each >= -1, "
                        f"got {window_size!r}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size: entries must be >= -1 (-1 = unbounded), got "
                         f"{(left, right)}")
    if causal:
        right = 0
    return (left, right)


def _check_device_consistency(named: dict, contiguous=None) -> None:
    """All given arrays on the GPU, or all on the host; names the first that differs. On the
    GPU, the last dimension of each array named in ``contiguous`` (default: all) must be
    contiguous."""
    items = [(n, a) for n, a in named.items() if a is not None]
    if not items:
        return
    first_name, first = items[0]
    first_dev = _is_device(first)
    for n, a in items[1:]:
        if _is_device(a) != first_dev:
            where = "a host" if first_dev else "a CUDA"
            other = "on the GPU" if first_dev else "on the host"
            raise TypeError(f"{n}: got {where} array {type(a).__name__} while {first_name} is "
                            f"{other}; pass all arrays on the same device")
    if first_dev:
        for n, a in items:
            if contiguous is None or n in contiguous:
                check_last_dim_contiguous(a, n)


def _check_out(out, q_shape: tuple, dt: str) -> None:
    if out is None:
        return
    shape = _shape(out, "out")
    if shape != q_shape:
        raise ValueError(f"out: expected shape {q_shape} (same as q), got {shape}")
    _check_same_dtype(out, "out", dt, "q")


#: Integer dtypes a host index array (``cu_seqlens``, ``cache_seqlens``, ``block_table``) may
#: have; its values must fit int32, the kernels' index type.
HOST_INDEX_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
_INT32_MIN, _INT32_MAX = -2 ** 31, 2 ** 31 - 1


def _int32_hint(x, name: str) -> str:
    """How to make a device index array ``x`` int32, in the caller's library."""
    tt = torch_tensor_type()
    if tt is not None and isinstance(x, tt):
        return f"pass {name}.to(torch.int32)"
    if type(x).__module__.split(".")[0] == "cupy":
        return f"pass {name}.astype(cupy.int32)"
    return (f"convert it to int32 ({name}.astype(cupy.int32) for CuPy, "
            f"{name}.to(torch.int32) for torch)")


def _check_index_array(x, name: str, ndim: int, layout: str) -> tuple:
    """Shape and dtype of an index array. A device array must be int32 (what the kernels read;
    the TypeError says how to convert it); a host array may have any integer dtype
    (:data:`HOST_INDEX_DTYPES`, e.g. NumPy's default int64) whose values fit int32 (ValueError
    naming the first that does not): the calls copy host arrays to the device as int32."""
    shape = _shape(x, name)
    if len(shape) != ndim:
        raise ValueError(f"{name}: expected {ndim} dim{'s' if ndim != 1 else ''} ({layout}), "
                         f"got shape {shape}")
    dt = dtype_name(x)
    if dt == "int32":
        return shape
    if _is_device(x):
        what = "an integer" if dt in HOST_INDEX_DTYPES else "a non-integer"
        raise TypeError(f"{name}: dtype {dt} is not supported on the GPU (the kernels read "
                        f"int32, {what} dtype was given); {_int32_hint(x, name)}")
    if dt not in HOST_INDEX_DTYPES:
        raise TypeError(f"{name}: dtype {dt} is not supported; expected an integer dtype "
                        f"(int32, or any integer type on the host, values within int32)")
    values = to_host(x)
    if values.size:
        bad = (values < _INT32_MIN) | (values > _INT32_MAX)
        if bad.any():
            i = tuple(int(j) for j in np.argwhere(bad)[0])
            raise ValueError(f"{name}: values must fit int32 (the kernels' index type), got "
                             f"{name}[{', '.join(map(str, i))}]={values[i]}")
    return shape


def _check_nonneg_int(x, name: str) -> int:
    if not _is_int(x):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__} {x!r}")
    if x < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {x}")
    return int(x)


# ----------------------------------------------------------------------------------------------
# Public checks
# ----------------------------------------------------------------------------------------------
def check_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), out=None,
                    dtypes=SUPPORTED_DTYPES) -> AttnProblem:
    """Validate a dense prefill attention call (FlashAttention-2, arXiv 2307.08691 Sec. 3.1).

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, nheads, headdim)
    k, v : array, shape (batch, seqlen_k, nheads_k, headdim)
        Same dtype as ``q``; ``nheads % nheads_k == 0``.
    softmax_scale : float or None
        See :func:`resolve_softmax_scale`.
    causal : bool
        Bottom-right aligned causal mask.
    window_size : tuple of 2 int
        See :func:`check_window_size`.
    out : array or None
        Optional output buffer, same shape and dtype as ``q``.
    dtypes : tuple of str
        Element types the caller supports (default: float16, bfloat16, float32, float64).

    Returns
    -------
    AttnProblem

    Raises
    ------
    TypeError
        Non-array argument, unsupported or mismatched dtype, host/device mix, bad ``causal``,
        ``window_size`` or ``softmax_scale`` type.
    ValueError
        Wrong number of dims, inconsistent batch / headdim / heads, unsupported headdim
        (not a positive multiple of 8 up to 256), ``nheads % nheads_k != 0``, non-contiguous last
        dimension of a device array, bad ``window_size`` or ``softmax_scale`` value, ``out``
        shape.

    Notes
    -----
    Sizes of 0 (batch, seqlen_q, seqlen_k) are accepted: the output is empty, or (for
    ``seqlen_k == 0``) every row is empty and gives output 0 and LSE -inf.
    """
    qs = _check_ndim(q, "q", "batch, seqlen_q, nheads, headdim")
    ks = _check_ndim(k, "k", "batch, seqlen_k, nheads_k, headdim")
    vs = _check_ndim(v, "v", "batch, seqlen_k, nheads_k, headdim")
    dt = _check_dtype(q, "q", dtypes)
    _check_same_dtype(k, "k", dt, "q")
    _check_same_dtype(v, "v", dt, "q")
    batch, seqlen_q, nheads, headdim = qs
    if ks[0] != batch:
        raise ValueError(f"k: batch {ks[0]} must match q batch {batch} (shape {ks})")
    if ks[3] != headdim:
        raise ValueError(f"k: headdim {ks[3]} must match q headdim {headdim} (shape {ks})")
    if vs != ks:
        raise ValueError(f"v: shape {vs} must match k shape {ks}")
    _check_headdim(headdim, "q")
    _check_heads(nheads, ks[2], "k")
    causal = _check_bool(causal, "causal")
    window = check_window_size(window_size, causal)
    scale = resolve_softmax_scale(softmax_scale, headdim)
    _check_out(out, qs, dt)
    _check_device_consistency({"q": q, "k": k, "v": v, "out": out})
    return AttnProblem(batch=batch, seqlen_q=seqlen_q, seqlen_k=ks[1], nheads=nheads,
                       nheads_k=ks[2], headdim=headdim, dtype=dt, softmax_scale=scale,
                       causal=window[1] == 0, window_size=window)


def lse_dtype(dtype: str) -> str:
    """The dtype of the forward's LSE for inputs of ``dtype``: float64 for float64 (the CUDA-core
    kernel computes it in float64, and the float64 backward recomputes P from it), else
    float32."""
    return "float64" if str(dtype) == "float64" else "float32"


def check_backward(problem: AttnProblem, q, k, dout, out, lse, dq=None, dk=None, dv=None) -> None:
    """Validate the arrays of a backward call (FlashAttention-2, arXiv 2307.08691, Sec. 3.2)
    against its forward ``problem`` (from :func:`check_attention` / :func:`check_varlen` on q, k,
    v): ``dout`` and ``out`` shaped and typed like ``q``; ``lse`` the forward's, (batch, nheads,
    seqlen_q) or varlen (nheads, total_q), float32 (float64 for float64 inputs); the optional
    gradient buffers ``dq`` like ``q``, ``dk`` and ``dv`` like ``k``. On the GPU every last
    dimension must be contiguous.

    Raises
    ------
    TypeError
        A wrong dtype, or host and device arrays mixed (naming the argument).
    ValueError
        A wrong shape (naming the argument and the expected shape).
    """
    qs, ks, dt = _shape(q, "q"), _shape(k, "k"), problem.dtype
    for name, x, want, like in (("dout", dout, qs, "q"), ("out", out, qs, "q"),
                                ("dq", dq, qs, "q"), ("dk", dk, ks, "k"), ("dv", dv, ks, "k")):
        if x is None:
            if name in ("dout", "out"):
                raise TypeError(f"{name}: required (an array shaped like {like})")
            continue
        shape = _shape(x, name)
        if shape != want:
            raise ValueError(f"{name}: expected shape {want} (same as {like}), got {shape}")
        _check_same_dtype(x, name, dt, "q")
    if lse is None:
        raise TypeError("lse: required (the forward's LSE: return_lse=True)")
    want = (problem.nheads, qs[0]) if problem.varlen else (problem.batch, problem.nheads,
                                                            problem.seqlen_q)
    shape = _shape(lse, "lse")
    if shape != want:
        raise ValueError(f"lse: expected shape {want} (the forward's LSE), got {shape}")
    ldt = dtype_name(lse)
    if ldt != lse_dtype(dt):
        raise TypeError(f"lse: expected dtype {lse_dtype(dt)} (the forward's LSE for {dt} "
                        f"inputs), got {ldt}")
    _check_device_consistency({"q": q, "dout": dout, "out": out, "lse": lse, "dq": dq, "dk": dk,
                               "dv": dv})


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                 softmax_scale=None, causal=False, window_size=(-1, -1), out=None,
                 dtypes=SUPPORTED_DTYPES, validate=True) -> AttnProblem:
    """Validate a variable-length (packed) prefill attention call.

    Sequence ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``; masks are applied per sequence (bottom-right aligned
    against that sequence's own lengths). FlashAttention-2 (arXiv 2307.08691) Sec. 3.1 per segment.

    Parameters
    ----------
    q : array, shape (total_q, nheads, headdim)
    k, v : array, shape (total_k, nheads_k, headdim)
    cu_seqlens_q, cu_seqlens_k : integer array, shape (batch + 1,)
        Cumulative sequence starts: begin at 0, non-decreasing, end at ``total_q`` / ``total_k``.
        int32 on the GPU; on the host any integer dtype whose values fit int32 (e.g.
        ``np.cumsum``'s int64).
    max_seqlen_q, max_seqlen_k : int
        Upper bounds (>= every sequence length); used to size launch grids.
    softmax_scale, causal, window_size, out, dtypes
        As in :func:`check_attention` (``out`` matches ``q``).
    validate : bool
        When True, read the ``cu_seqlens`` values (a host copy if on the GPU: this synchronises)
        and check them; when False, check shapes and dtypes only.

    Returns
    -------
    AttnProblem
        With ``varlen=True``, ``batch = len(cu_seqlens_q) - 1``, ``seqlen_q = max_seqlen_q``,
        ``seqlen_k = max_seqlen_k``, and ``total_q``/``total_k`` set.

    Raises
    ------
    TypeError, ValueError
        As in :func:`check_attention`, plus ``cu_seqlens`` of a non-integer dtype, device
        ``cu_seqlens`` that are not int32 (TypeError saying how to convert), host values outside
        int32, mismatched lengths, values not starting at 0, decreasing, not ending at the total,
        or longer than ``max_seqlen``.
    """
    qs = _check_ndim(q, "q", "total_q, nheads, headdim")
    ks = _check_ndim(k, "k", "total_k, nheads_k, headdim")
    vs = _check_ndim(v, "v", "total_k, nheads_k, headdim")
    dt = _check_dtype(q, "q", dtypes)
    _check_same_dtype(k, "k", dt, "q")
    _check_same_dtype(v, "v", dt, "q")
    total_q, nheads, headdim = qs
    total_k = ks[0]
    if ks[2] != headdim:
        raise ValueError(f"k: headdim {ks[2]} must match q headdim {headdim} (shape {ks})")
    if vs != ks:
        raise ValueError(f"v: shape {vs} must match k shape {ks}")
    _check_headdim(headdim, "q")
    _check_heads(nheads, ks[1], "k")
    cq = _check_index_array(cu_seqlens_q, "cu_seqlens_q", 1, "batch + 1")
    ck = _check_index_array(cu_seqlens_k, "cu_seqlens_k", 1, "batch + 1")
    if cq[0] < 1:
        raise ValueError(f"cu_seqlens_q: expected at least 1 entry (batch + 1), got shape {cq}")
    if ck != cq:
        raise ValueError(f"cu_seqlens_k: shape {ck} must match cu_seqlens_q shape {cq}")
    max_q = _check_nonneg_int(max_seqlen_q, "max_seqlen_q")
    max_k = _check_nonneg_int(max_seqlen_k, "max_seqlen_k")
    causal = _check_bool(causal, "causal")
    window = check_window_size(window_size, causal)
    scale = resolve_softmax_scale(softmax_scale, headdim)
    _check_out(out, qs, dt)
    _check_device_consistency({"q": q, "k": k, "v": v, "out": out})
    if not isinstance(validate, (bool, np.bool_)):
        raise TypeError(f"validate: expected a bool, got {type(validate).__name__}")
    if validate:
        for name, cu, total, mx, mxname in (
                ("cu_seqlens_q", cu_seqlens_q, total_q, max_q, "max_seqlen_q"),
                ("cu_seqlens_k", cu_seqlens_k, total_k, max_k, "max_seqlen_k")):
            c = to_host(cu).astype(np.int64)
            if c[0] != 0:
                raise ValueError(f"{name}: must start at 0, got {c[0]}")
            lens = np.diff(c)
            if (lens < 0).any():
                b = int(np.argmax(lens < 0))
                raise ValueError(f"{name}: must be non-decreasing, got {name}[{b}]={c[b]} > "
                                 f"{name}[{b + 1}]={c[b + 1]}")
            if c[-1] != total:
                raise ValueError(f"{name}: last entry {c[-1]} must equal the packed length "
                                 f"{total} (dim 0 of {'q' if name.endswith('q') else 'k'})")
            if lens.size and lens.max() > mx:
                raise ValueError(f"{mxname}: {mx} is smaller than the longest sequence "
                                 f"({int(lens.max())}) in {name}")
    return AttnProblem(batch=cq[0] - 1, seqlen_q=max_q, seqlen_k=max_k, nheads=nheads,
                       nheads_k=ks[1], headdim=headdim, dtype=dt, softmax_scale=scale,
                       causal=window[1] == 0, window_size=window, varlen=True,
                       total_q=total_q, total_k=total_k)


def check_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None, *,
                  softmax_scale=None, causal=True, num_splits=0, out=None,
                  dtypes=SUPPORTED_DTYPES, validate=True, device_values=True) -> DecodeProblem:
    """Validate attention against a KV cache (Flash-Decoding; FlashAttention-2 Sec. 3.1 per split).

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, nheads, headdim)
    k_cache, v_cache : array
        Contiguous: shape (batch, seqlen_cache, nheads_k, headdim). Paged (``block_table`` given):
        shape (num_pages, page_size, nheads_k, headdim), any ``page_size >= 1``. Same dtype as q.
    k, v : array or None, shape (batch, seqlen_new, nheads_k, headdim)
        New tokens written at ``cache_seqlens[b]`` before attending; both or neither.
    cache_seqlens : integer array, shape (batch,), or None
        Valid tokens per sequence before appending. ``None`` means the whole contiguous cache;
        required with ``block_table`` or with ``k``/``v``. int32 on the GPU; on the host any
        integer dtype whose values fit int32.
    block_table : integer array, shape (batch, max_pages_per_seq), or None
        Page ids of each sequence in order; only the first
        ``ceil((cache_seqlens[b] + seqlen_new) / page_size)`` entries of a row are read. Dtype
        as ``cache_seqlens``.
    softmax_scale : float or None
        See :func:`resolve_softmax_scale`.
    causal : bool
        Bottom-right causal mask against each sequence's total length.
    num_splits : int
        >= 0; 0 lets the heuristic choose.
    out : array or None
        Same shape and dtype as ``q``.
    dtypes : tuple of str
        Supported element types.
    validate : bool
        When True, check the values of ``cache_seqlens`` and ``block_table``
        (:func:`check_kvcache_values`; a host copy, so a synchronisation if on the GPU).
    device_values : bool
        With ``validate``: also read device arrays' values on the host (True, a
        synchronisation), or only host arrays' (False: the caller checks device arrays on the
        device, :mod:`cupyflash.core.guard`). Host ``cache_seqlens`` and ``block_table`` are
        accepted beside device arrays (the call copies them to the device).

    Returns
    -------
    DecodeProblem

    Raises
    ------
    TypeError
        Non-array, unsupported/mismatched dtypes (index arrays: an integer dtype, int32 on the
        GPU, the message saying how to convert), only one of ``k``/``v``, bad
        ``causal``/``num_splits``/``softmax_scale`` type, host/device mix.
    ValueError
        Wrong dims or inconsistent sizes, unsupported headdim, ``nheads % nheads_k != 0``,
        missing ``cache_seqlens`` where required, negative ``num_splits``, lengths over capacity,
        page ids out of range, host index values outside int32.
    """
    qs = _check_ndim(q, "q", "batch, seqlen_q, nheads, headdim")
    paged = block_table is not None
    cache_layout = ("num_pages, page_size, nheads_k, headdim" if paged
                    else "batch, seqlen_cache, nheads_k, headdim")
    kcs = _check_ndim(k_cache, "k_cache", cache_layout)
    vcs = _check_ndim(v_cache, "v_cache", cache_layout)
    dt = _check_dtype(q, "q", dtypes)
    _check_same_dtype(k_cache, "k_cache", dt, "q")
    _check_same_dtype(v_cache, "v_cache", dt, "q")
    batch, seqlen_q, nheads, headdim = qs
    if seqlen_q < 1:
        raise ValueError(f"q: seqlen_q is {seqlen_q} (shape {qs}); decoding needs at least one "
                         f"query token per sequence")
    if kcs[3] != headdim:
        raise ValueError(f"k_cache: headdim {kcs[3]} must match q headdim {headdim} "
                         f"(shape {kcs})")
    if vcs != kcs:
        raise ValueError(f"v_cache: shape {vcs} must match k_cache shape {kcs}")
    _check_headdim(headdim, "q")
    nheads_k = kcs[2]
    _check_heads(nheads, nheads_k, "k_cache")
    if paged:
        num_pages, page_size = kcs[0], kcs[1]
        bts = _check_index_array(block_table, "block_table", 2, "batch, max_pages_per_seq")
        if bts[0] != batch:
            raise ValueError(f"block_table: batch {bts[0]} must match q batch {batch} "
                             f"(shape {bts})")
        if page_size < 1:
            raise ValueError(f"k_cache: page_size (dim 1) must be >= 1, got shape {kcs}")
        max_pages = bts[1]
        seqlen_cache = max_pages * page_size
    else:
        num_pages = page_size = max_pages = 0
        if kcs[0] != batch:
            raise ValueError(f"k_cache: batch {kcs[0]} must match q batch {batch} (shape {kcs}; "
                             f"a paged cache (num_pages, page_size, nheads_k, headdim) needs "
                             f"block_table)")
        seqlen_cache = kcs[1]
    if (k is None) != (v is None):
        given = k if k is not None else v
        hint = ("; cache_seqlens and block_table are keyword arguments (cache_seqlens=...)"
                if isinstance(given, (int, list, tuple)) else "")
        raise TypeError(f"{'v' if k is not None else 'k'}: k and v must be given together "
                        f"(got k={type(k).__name__ if k is not None else None}, "
                        f"v={type(v).__name__ if v is not None else None}){hint}")
    seqlen_new = 0
    if k is not None:
        ns = _check_ndim(k, "k", "batch, seqlen_new, nheads_k, headdim")
        nvs = _check_ndim(v, "v", "batch, seqlen_new, nheads_k, headdim")
        _check_same_dtype(k, "k", dt, "q")
        _check_same_dtype(v, "v", dt, "q")
        if ns[0] != batch or ns[2] != nheads_k or ns[3] != headdim:
            raise ValueError(f"k: expected shape ({batch}, seqlen_new, {nheads_k}, {headdim}) "
                             f"(batch of q, heads and headdim of k_cache), got {ns}")
        if nvs != ns:
            raise ValueError(f"v: shape {nvs} must match k shape {ns}")
        seqlen_new = ns[1]
    if cache_seqlens is None:
        if paged:
            raise ValueError("cache_seqlens: required when block_table is given (paged cache)")
        if k is not None:
            raise ValueError("cache_seqlens: required when k/v are given (they are written at "
                             "cache_seqlens)")
    else:
        css = _check_index_array(cache_seqlens, "cache_seqlens", 1, "batch")
        if css[0] != batch:
            raise ValueError(f"cache_seqlens: expected shape ({batch},) (batch of q), got {css}")
    causal = _check_bool(causal, "causal")
    if not _is_int(num_splits):
        raise TypeError(f"num_splits: expected an int >= 0, got {type(num_splits).__name__} "
                        f"{num_splits!r}")
    if num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0 = heuristic), got {num_splits}")
    scale = resolve_softmax_scale(softmax_scale, headdim)
    _check_out(out, qs, dt)
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v,
             "cache_seqlens": cache_seqlens, "block_table": block_table, "out": out}
    if _is_device(q):  # host index data beside device arrays: checked here, copied by the call
        for n in ("cache_seqlens", "block_table"):
            if named[n] is not None and not _is_device(named[n]):
                del named[n]
    _check_device_consistency(named)
    if not isinstance(validate, (bool, np.bool_)):
        raise TypeError(f"validate: expected a bool, got {type(validate).__name__}")
    problem = DecodeProblem(batch=batch, seqlen_q=seqlen_q, nheads=nheads, nheads_k=nheads_k,
                            headdim=headdim, dtype=dt, softmax_scale=scale, causal=causal,
                            paged=paged, seqlen_cache=seqlen_cache, page_size=page_size,
                            num_pages=num_pages, max_pages_per_seq=max_pages,
                            seqlen_new=seqlen_new, num_splits=int(num_splits),
                            page_offsets_fit_i32=(not paged
                                                  or page_offsets_fit_i32(page_size, k_cache,
                                                                          v_cache)),
                            q_aligned16=aligned16(q))
    if validate and cache_seqlens is not None:
        if device_values:
            check_kvcache_values(problem, cache_seqlens, block_table)
        elif not _is_device(cache_seqlens):  # host lengths; host page ids too, if any
            check_kvcache_values(problem, cache_seqlens,
                                 None if _is_device(block_table) else block_table)
    return problem


def check_kvcache_values(problem: DecodeProblem, cache_seqlens, block_table=None) -> None:
    """The values of a decode call's ``cache_seqlens`` and ``block_table`` (read on the host: a
    synchronisation for device arrays): ``0 <= cache_seqlens[b]``, ``cache_seqlens[b] +
    seqlen_new <= seqlen_cache``, and (paged) page ids in ``[0, num_pages)`` in the first
    ``ceil((cache_seqlens[b] + seqlen_new) / page_size)`` entries of each row (the pages the
    sequence uses; the others are never read).

    Parameters
    ----------
    problem : DecodeProblem
        From :func:`check_kvcache` for the same arrays (shapes and dtypes already checked).
    cache_seqlens : integer array, shape (batch,)
    block_table : integer array, shape (batch, max_pages_per_seq), or None (contiguous; or page
        ids not checked here: the call checks a device block_table on the device)

    Raises
    ------
    ValueError
        A negative length, a length over the capacity, a page id outside the pool (the message
        names the argument, the entry and what was expected).
    """
    p = problem
    cs = to_host(cache_seqlens).astype(np.int64)
    if (cs < 0).any():
        b = int(np.argmax(cs < 0))
        raise ValueError(negative_length_message(b, int(cs[b])))
    total = cs + p.seqlen_new
    if (total > p.seqlen_cache).any():
        b = int(np.argmax(total > p.seqlen_cache))
        raise ValueError(capacity_message(b, int(cs[b]), p.seqlen_new, p.seqlen_cache, p.paged))
    if p.paged and block_table is not None:
        bt = to_host(block_table).astype(np.int64)
        used = -(-total // p.page_size)  # pages each sequence reads or writes
        cols = np.arange(p.max_pages_per_seq)[None, :]
        bad = (cols < used[:, None]) & ((bt < 0) | (bt >= p.num_pages))
        if bad.any():
            b, j = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(page_id_message(b, j, int(bt[b, j]), p.num_pages, int(used[b])))


# The messages of the value checks (also those of the device-side check, cupyflash.core.guard)
def negative_length_message(b: int, value: int) -> str:
    return f"cache_seqlens: must be >= 0, got cache_seqlens[{b}]={value}"


def capacity_message(b: int, value: int, seqlen_new: int, capacity: int, paged: bool) -> str:
    return (f"cache_seqlens: cache_seqlens[{b}]={value} + seqlen_new {seqlen_new} exceeds the "
            f"cache capacity {capacity} "
            + ("(max_pages_per_seq * page_size)" if paged else "(k_cache dim 1)"))


def page_id_message(b: int, j: int, value: int, num_pages: int, used: int) -> str:
    return (f"block_table: page id block_table[{b}, {j}]={value} is outside the pool "
            f"[0, {num_pages}) (sequence {b} uses {used} page{'s' if used != 1 else ''})")


def lengths_from_host(cache_seqlens, q):
    """FlashAttention's forms of ``cache_seqlens``: an int (every sequence's length) or a list
    or tuple of ints becomes an int32 NumPy array of ``q``'s batch; anything else (arrays,
    None, other types, which the checks then judge) is returned as it is.

    Raises
    ------
    TypeError
        A list with an entry that is not an int.
    ValueError
        A value outside int32.
    """
    if _is_int(cache_seqlens):
        shape = getattr(q, "shape", None)
        if shape is None or len(shape) < 1:
            return cache_seqlens  # the checks name q
        values = np.full((int(shape[0]),), int(cache_seqlens), np.int64)
    elif isinstance(cache_seqlens, (list, tuple)):
        if not all(_is_int(x) for x in cache_seqlens):
            raise TypeError(f"cache_seqlens: expected an integer array, an int or a list of "
                            f"ints, got {type(cache_seqlens).__name__} {cache_seqlens!r}"[:300])
        values = np.array([int(x) for x in cache_seqlens], np.int64).reshape(-1)
    else:
        return cache_seqlens
    if values.size and (values.min() < -2 ** 31 or values.max() >= 2 ** 31):
        raise ValueError(f"cache_seqlens: values must fit int32, got {cache_seqlens!r}"[:300])
    return values.astype(np.int32)


def check_merge(o_parts, lse_parts) -> tuple:
    """Validate partial attention states for :func:`merge_states` (Flash-Decoding combine).

    Parameters
    ----------
    o_parts : array, shape (num_parts, batch, seqlen, nheads, headdim)
        Normalised partial outputs; float16, bfloat16, float32 or float64.
    lse_parts : array, shape (num_parts, batch, nheads, seqlen)
        Natural-log partial LSEs (-inf for an empty part); float32 or float64.

    Returns
    -------
    tuple of int
        ``(num_parts, batch, seqlen, nheads, headdim)``.

    Raises
    ------
    TypeError
        Non-array, unsupported dtype, host/device mix.
    ValueError
        Wrong dims, ``num_parts < 1``, shapes that disagree, unsupported headdim; on the GPU,
        a head dim of ``o_parts`` that is not contiguous (``lse_parts`` may have any strides).
    """
    os_ = _check_ndim(o_parts, "o_parts", "num_parts, batch, seqlen, nheads, headdim")
    ls = _check_ndim(lse_parts, "lse_parts", "num_parts, batch, nheads, seqlen")
    _check_dtype(o_parts, "o_parts", SUPPORTED_DTYPES)
    _check_dtype(lse_parts, "lse_parts", ("float32", "float64"))
    num_parts, batch, seqlen, nheads, headdim = os_
    if num_parts < 1:
        raise ValueError(f"o_parts: expected at least 1 part (dim 0), got shape {os_}")
    want = (num_parts, batch, nheads, seqlen)
    if ls != want:
        raise ValueError(f"lse_parts: expected shape {want} (num_parts, batch, nheads, seqlen "
                         f"of o_parts), got {ls}")
    _check_headdim(headdim, "o_parts")
    # the combine kernel reads lse_parts with any strides; o_parts' head dim is read as vectors
    _check_device_consistency({"o_parts": o_parts, "lse_parts": lse_parts}, ("o_parts",))
    return os_
