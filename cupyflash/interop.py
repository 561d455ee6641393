"""Zero-copy views of caller arrays as CuPy arrays, and the stream to launch on."""
from __future__ import annotations

import sys

__all__ = ["as_cupy", "is_device_array", "current_stream", "cupy_ndarray_type"]

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


def as_cupy(x, name: str):
    """View ``x`` as a ``cupy.ndarray`` without copying.

    Raises
    ------
    TypeError
        If ``x`` is not a device array (e.g. a NumPy array), naming the argument.
    """
    import cupy
    if isinstance(x, cupy.ndarray):
        return x
    # DLPack first: it carries bfloat16 as a real dtype, whereas torch describes bf16 in
    # __cuda_array_interface__ as raw '<V2' bytes. Both paths are zero-copy.
    if is_device_array(x) and hasattr(x, "__dlpack__"):
        return cupy.from_dlpack(x)
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)  # zero-copy: wraps the pointer
    raise TypeError(f"{name}: expected a CUDA array (cupy.ndarray, or an object with "
                    f"__cuda_array_interface__ / DLPack on a CUDA device), got {type(x).__name__}")


def current_stream():
    """The caller's current CuPy stream (kernels launch on it)."""
    import cupy
    return cupy.cuda.get_current_stream()
