"""Zero-copy views of caller arrays as CuPy arrays, and the stream to launch on."""
from __future__ import annotations

import functools
import sys

__all__ = ["as_cupy", "np_dtype", "is_device_array", "current_stream", "cupy_ndarray_type"]

_CUPY_NDARRAY = None


def cupy_ndarray_type():
    """``cupy.ndarray`` if CuPy has been imported, else None (an object cannot be a CuPy array
    before CuPy is imported, so this never imports it)."""
    global _CUPY_NDARRAY
    if _CUPY_NDARRAY is None:
        cupy = sys.modules.get("cupy")
        if cupy is not None and hasattr(cupy, "ndarray"):
            _CUPY_NDARRAY = cupy.ndarray
    return _CUPY_NDARRAY


def is_device_array(x) -> bool:
    """True for CuPy arrays and objects exposing ``__cuda_array_interface__`` or DLPack on a
    CUDA device (PyTorch CUDA tensors, JAX arrays on GPU, ...)."""
    # A CuPy array is answered by its type: hasattr(x, "__cuda_array_interface__") would build
    # CuPy's interface dict (dtype.descr, the current stream: microseconds per call).
    nd = _CUPY_NDARRAY or cupy_ndarray_type()
    if nd is not None and isinstance(x, nd):
        return True
    if hasattr(x, "__cuda_array_interface__"):
        return True
    dev = getattr(x, "__dlpack_device__", None)
    if dev is not None:
        try:
            return int(dev()[0]) in (2, 13)  # kDLCUDA, kDLCUDAManaged
        except Exception:
            return False
    return False


@functools.lru_cache(maxsize=None)
def np_dtype(name) -> "numpy.dtype":
    """The NumPy dtype of a dtype name; ``'bfloat16'`` is ml_dtypes' bfloat16 (CuPy's bf16).

    Parameters
    ----------
    name : str or dtype-like
        ``'float16'``, ``'bfloat16'``, ``'float32'``, ``'float64'``, ``'int32'``, ...
    """
    import numpy as np
    if str(name) == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def as_cupy(x, name: str, dtype: str | None = None):
    """View ``x`` as a ``cupy.ndarray`` without copying.

    DLPack is tried first: it carries bfloat16 as a real dtype, whereas torch describes a bf16
    tensor in ``__cuda_array_interface__`` as raw ``'<V2'`` records; failing DLPack, the memory
    the interface describes is wrapped directly. With ``dtype`` (a name the checks already
    validated), a view whose element type CuPy could not name is re-viewed as ``dtype``.

    Raises
    ------
    TypeError
        If ``x`` is not a device array (e.g. a NumPy array), naming the argument; or if its
        element size does not match ``dtype``.
    """
    import cupy
    if isinstance(x, cupy.ndarray):
        c = x
    elif not is_device_array(x):
        raise TypeError(f"{name}: expected a CUDA array (cupy.ndarray, or an object with "
                        f"__cuda_array_interface__ / DLPack on a CUDA device), got "
                        f"{type(x).__name__}")
    else:
        why = _no_gpu_reason()
        if why is not None:
            raise RuntimeError(f"{name}: no usable CUDA GPU ({why}); the NumPy references in "
                               "cupyflash.reference run without one")
        c = None
        if hasattr(x, "__dlpack__"):
            try:
                c = cupy.from_dlpack(x)
            except Exception:  # e.g. a DLPack dtype this CuPy cannot represent
                c = None
        if c is None:
            if not hasattr(x, "__cuda_array_interface__"):
                raise TypeError(f"{name}: CuPy cannot import this {type(x).__name__} through "
                                "DLPack, and it has no __cuda_array_interface__")
            c = _wrap_cai(x, dtype)
    if dtype is not None and c.dtype != (want := np_dtype(dtype)):
        if c.dtype.itemsize != want.itemsize:
            raise TypeError(f"{name}: CuPy sees dtype {c.dtype}, expected {dtype}")
        c = c.view(want)
    return c


@functools.lru_cache(maxsize=1)
def _no_gpu_reason() -> str | None:
    """Why CUDA cannot be used in this process (no driver, no device), or None (asked once)."""
    import cupy
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - CuPy raises CUDARuntimeError without a driver
        return f"{type(e).__name__}: {e}"
    return None if n > 0 else "no CUDA device found"


def _wrap_cai(x, dtype: str | None):
    """Zero-copy ``cupy.ndarray`` over the memory ``x.__cuda_array_interface__`` describes
    (shape, byte strides, pointer), typed ``dtype`` (default: the interface's typestr); ``x``
    is kept alive as the memory's owner."""
    import cupy
    import numpy as np
    cai = x.__cuda_array_interface__
    dt = np_dtype(dtype) if dtype is not None else np.dtype(cai["typestr"])
    shape = tuple(int(n) for n in cai["shape"])
    strides = cai.get("strides")
    if strides is None:  # C-contiguous
        strides, acc = [], dt.itemsize
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= max(n, 1)
    strides = tuple(int(st) for st in strides)
    size = 0 if 0 in shape else dt.itemsize + sum((n - 1) * st for n, st in zip(shape, strides))
    mem = cupy.cuda.UnownedMemory(int(cai["data"][0]), size, x)
    return cupy.ndarray(shape, dtype=dt, memptr=cupy.cuda.MemoryPointer(mem, 0), strides=strides)


def current_stream():
    """The caller's current CuPy stream (kernels launch on it)."""
    import cupy
    return cupy.cuda.get_current_stream()
