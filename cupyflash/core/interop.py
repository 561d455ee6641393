"""Caller arrays: zero-copy CuPy views, PyTorch tensors read by their attributes, and the stream
to launch on.

Two caller kinds keep their own conventions (:class:`CupyCaller`, :class:`TorchCaller`): CuPy
arrays in give CuPy arrays out, launched on CuPy's current stream; PyTorch CUDA tensors in (every
array argument a ``torch.Tensor``) give tensors out, allocated by torch's caching allocator and
launched on torch's current stream of the tensors' device. A torch tensor's pointer, shape,
strides and dtype are read from its own attributes (``data_ptr()``, ``shape``, ``stride()``,
``dtype``): no ``__cuda_array_interface__`` dict, no DLPack capsule. Other objects (JAX arrays,
anything exposing the interface or DLPack; torch tensors mixed with other kinds) are viewed as
CuPy arrays (:func:`as_cupy`) and follow CuPy's conventions. torch is never imported here: a
tensor cannot exist before its user imported torch.
"""
from __future__ import annotations

import contextlib
import functools
import operator
import sys

import numpy as np

from . import deps

__all__ = ["as_cupy", "np_dtype", "is_device_array", "current_stream", "cupy_ndarray_type",
           "torch_tensor_type", "TORCH_DTYPE_NAMES", "ArrayDesc", "describe_torch", "CupyCaller",
           "TorchCaller", "caller_of"]

_CUPY_NDARRAY = None
_TORCH_TENSOR = None


def _imported(module: str, attr: str):
    """``module.attr`` if ``module`` has been imported (by anyone), else None; never imports."""
    mod = sys.modules.get(module)
    return getattr(mod, attr, None) if mod is not None else None


def torch_tensor_type():
    """``torch.Tensor`` if torch has been imported, else None (never imports torch)."""
    global _TORCH_TENSOR
    if _TORCH_TENSOR is None:
        _TORCH_TENSOR = _imported("torch", "Tensor")
    return _TORCH_TENSOR


def cupy_ndarray_type():
    """``cupy.ndarray`` if CuPy has been imported, else None (an object cannot be a CuPy array
    before CuPy is imported, so this never imports it)."""
    global _CUPY_NDARRAY
    if _CUPY_NDARRAY is None:
        _CUPY_NDARRAY = _imported("cupy", "ndarray")
    return _CUPY_NDARRAY


def is_device_array(x) -> bool:
    """True for CuPy arrays and objects exposing ``__cuda_array_interface__`` or DLPack on a
    CUDA device (PyTorch CUDA tensors, JAX arrays on GPU, ...)."""
    # A CuPy array is answered by its type: hasattr(x, "__cuda_array_interface__") would build
    # CuPy's interface dict (dtype.descr, the current stream: microseconds per call).
    nd = _CUPY_NDARRAY or cupy_ndarray_type()
    if nd is not None and isinstance(x, nd):
        return True
    tt = _TORCH_TENSOR or torch_tensor_type()
    if tt is not None and isinstance(x, tt):  # (the interface property builds a dict)
        return bool(x.is_cuda)
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
def np_dtype(name) -> "np.dtype":
    """The NumPy dtype of a dtype name; ``'bfloat16'`` is ml_dtypes' bfloat16 (CuPy's bf16).

    Parameters
    ----------
    name : str or dtype-like
        ``'float16'``, ``'bfloat16'``, ``'float32'``, ``'float64'``, ``'int32'``, ...

    Raises
    ------
    ImportError
        ``'bfloat16'`` without ml_dtypes installed (the message says what to install).
    """
    if str(name) == "bfloat16":
        return np.dtype(deps.ml_dtypes("the bfloat16 dtype").bfloat16)
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
    ImportError
        CuPy is not installed (the message names the package and the extras to install).
    """
    cupy = _cupy()  # (MissingDependency without CuPy)
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
    cupy = deps.cupy()
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - CuPy raises CUDARuntimeError without a driver
        return f"{type(e).__name__}: {e}"
    return None if n > 0 else "no CUDA device found"


def c_strides(shape, itemsize: int) -> tuple:
    """Byte strides of a C-contiguous array of ``shape`` (a dim of size 0 or 1 counts as 1)."""
    strides, acc = [], int(itemsize)
    for n in reversed(tuple(shape)):
        strides.insert(0, acc)
        acc *= max(int(n), 1)
    return tuple(strides)


def _wrap_cai(x, dtype: str | None):
    """Zero-copy ``cupy.ndarray`` over the memory ``x.__cuda_array_interface__`` describes
    (shape, byte strides, pointer), typed ``dtype`` (default: the interface's typestr); ``x``
    is kept alive as the memory's owner."""
    cupy = deps.cupy()
    cai = x.__cuda_array_interface__
    dt = np_dtype(dtype) if dtype is not None else np.dtype(cai["typestr"])
    shape = tuple(int(n) for n in cai["shape"])
    strides = cai.get("strides")
    strides = c_strides(shape, dt.itemsize) if strides is None else tuple(int(st) for st in strides)
    size = 0 if 0 in shape else dt.itemsize + sum((n - 1) * st for n, st in zip(shape, strides))
    mem = cupy.cuda.UnownedMemory(int(cai["data"][0]), size, x)
    return cupy.ndarray(shape, dtype=dt, memptr=cupy.cuda.MemoryPointer(mem, 0), strides=strides)


def current_stream():
    """The caller's current CuPy stream (kernels launch on it)."""
    cupy = deps.cupy()
    return cupy.cuda.get_current_stream()


# ----------------------------------------------------------------------------------------------
# Caller kinds: how a call reads its arrays, allocates its outputs and picks its stream
# ----------------------------------------------------------------------------------------------
#: torch dtype -> dtype name (filled once torch is imported: :func:`torch_dtype_name`)
TORCH_DTYPE_NAMES: dict = {}
_TORCH_DTYPES: dict = {}  # name -> torch dtype
_cupy_module = None
_torch_module = None


def _cupy():
    """The cupy module (imported on first use, then a global read)."""
    global _cupy_module
    if _cupy_module is None:
        _cupy_module = deps.cupy()
    return _cupy_module


def _torch():
    """The torch module (already imported by the caller whose tensor we hold)."""
    global _torch_module
    if _torch_module is None:
        import torch
        _torch_module = torch
        for name in ("float16", "bfloat16", "float32", "float64", "int32", "int64", "int16",
                     "int8", "uint8", "bool"):
            dt = getattr(torch, name, None)
            if dt is not None:
                TORCH_DTYPE_NAMES[dt] = name
                _TORCH_DTYPES[name] = dt
        # the same calls, C-level: no Python frame per call
        TorchCaller.ptr = staticmethod(torch.Tensor.data_ptr)
        TorchCaller.empty_like = staticmethod(torch.empty_like)
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            TorchCaller.stream = staticmethod(raw)
    return _torch_module


def torch_dtype_name(dt) -> str:
    """The library's name of a torch dtype (``torch.bfloat16`` -> ``'bfloat16'``)."""
    _torch()
    name = TORCH_DTYPE_NAMES.get(dt)
    return name if name is not None else str(dt).rsplit(".", 1)[-1]


class _DataPtr:
    """Stands in for ``cupy.cuda.MemoryPointer`` (``.ptr``) in an :class:`ArrayDesc`."""
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


class _Flags:
    __slots__ = ("c_contiguous",)

    def __init__(self, c_contiguous: bool):
        self.c_contiguous = c_contiguous


class ArrayDesc:
    """What the checks, the planning and the launches read of a caller's array: data pointer,
    shape, strides (bytes, as CuPy/NumPy give them), NumPy dtype and device, read once from the
    array's own attributes (:func:`describe_torch`). Attributes mirror ``cupy.ndarray``'s
    (``shape``, ``strides``, ``dtype``, ``itemsize``, ``ndim``, ``data.ptr``) and torch's
    ``data_ptr()``."""
    __slots__ = ("shape", "strides", "dtype", "itemsize", "ndim", "data", "device_id")

    def __init__(self, ptr: int, shape: tuple, elem_strides: tuple, dtype_name: str,
                 device_id: int):
        self.dtype = np_dtype(dtype_name)
        self.itemsize = self.dtype.itemsize
        self.shape = tuple(int(n) for n in shape)
        self.strides = tuple(int(s) * self.itemsize for s in elem_strides)
        self.ndim = len(self.shape)
        self.data = _DataPtr(int(ptr))
        self.device_id = int(device_id)

    def data_ptr(self) -> int:
        return self.data.ptr

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def flags(self):
        """``c_contiguous`` as NumPy computes it (dims of one element take any stride)."""
        acc, ok = self.itemsize, True
        for n, st in zip(reversed(self.shape), reversed(self.strides)):
            if n > 1 and st != acc:
                ok = False
            acc *= max(n, 1)
        return _Flags(ok or self.size == 0)

    def __repr__(self) -> str:
        return (f"ArrayDesc(ptr={self.data.ptr:#x}, shape={self.shape}, strides={self.strides}, "
                f"dtype={self.dtype.name}, device={self.device_id})")


def describe_torch(t) -> ArrayDesc:
    """:class:`ArrayDesc` of a torch CUDA tensor, from ``data_ptr()``, ``shape``, ``stride()``,
    ``dtype`` and its device (strides in elements, storage offset in the pointer)."""
    return ArrayDesc(t.data_ptr(), tuple(t.shape), tuple(t.stride()), torch_dtype_name(t.dtype),
                     TorchCaller.device(t))


class CupyCaller:
    """CuPy's conventions: CuPy arrays out (CuPy's memory pool), CuPy's current stream."""
    tag = "cupy"
    #: ``(shape, strides, dtype)`` of an array (a C-level getter: no Python frame per call)
    layout = staticmethod(operator.attrgetter("shape", "strides", "dtype"))
    #: the device pointer of an array (``a.data.ptr``)
    ptr = staticmethod(operator.attrgetter("data.ptr"))

    @staticmethod
    def device(a) -> int:
        return a.data.device_id

    @staticmethod
    def empty(shape, dtype_name: str, dev: int):
        return _cupy().empty(shape, np_dtype(dtype_name))

    @staticmethod
    def stream(dev: int) -> int:
        return _cupy().cuda.get_current_stream().ptr

    @staticmethod
    def contiguous(a):
        return _cupy().ascontiguousarray(a)

    @staticmethod
    def from_host(values, dtype_name: str, dev: int):
        """A device copy of a host NumPy array (asynchronous on the current stream: CuPy
        stages it in pinned memory it keeps until the copy is done)."""
        return _cupy().asarray(values, dtype=np_dtype(dtype_name))

    @staticmethod
    def full(shape, value, dtype_name: str, dev: int):
        return _cupy().full(shape, value, np_dtype(dtype_name))

    @staticmethod
    def fill(a, value) -> None:
        if value == 0:  # raw zero bits (bfloat16 arrays included)
            a.view({2: "uint16", 4: "uint32", 8: "uint64"}[a.dtype.itemsize]).fill(0)
        else:
            a.fill(value)


class TorchCaller:
    """PyTorch's conventions: tensors out (torch's caching allocator, on the tensors' device),
    torch's current stream of that device (``torch.cuda.current_stream(device)``)."""
    tag = "torch"
    _devices: dict = {}

    @staticmethod
    def device(a) -> int:
        return a.get_device() if a.is_cuda else -1

    @staticmethod
    def ptr(a) -> int:
        """``a.data_ptr()`` (replaced by ``torch.Tensor.data_ptr`` itself once torch is
        loaded, :func:`_torch`: no Python frame per call)."""
        return a.data_ptr()

    @staticmethod
    def torch_device(dev: int):
        d = TorchCaller._devices.get(dev)
        if d is None:
            d = TorchCaller._devices[dev] = _torch().device("cuda", dev)
        return d

    @staticmethod
    def empty(shape, dtype_name: str, dev: int):
        if _torch_module is None:
            _torch()
        return _torch_module.empty(shape, dtype=_TORCH_DTYPES[dtype_name],
                                   device=TorchCaller.torch_device(dev))

    @staticmethod
    def empty_like(a):
        """``torch.empty_like(a)`` (replaced by that function itself once torch is loaded)."""
        return _torch().empty_like(a)

    @staticmethod
    def stream(dev: int) -> int:
        """Handle of torch's current stream of device ``dev`` (replaced by
        ``torch._C._cuda_getCurrentRawStream`` itself once torch is loaded, where it exists)."""
        return _raw_stream(dev)

    @staticmethod
    def contiguous(a):
        return a.contiguous()

    @staticmethod
    def from_host(values, dtype_name: str, dev: int):
        """A device copy of a host NumPy array, asynchronous on torch's current stream (through
        pinned memory, which torch's host allocator keeps until the copy is done)."""
        torch = _torch()
        host = torch.from_numpy(np.ascontiguousarray(values, dtype=np_dtype(dtype_name)))
        return host.pin_memory().to(TorchCaller.torch_device(dev), non_blocking=True)

    @staticmethod
    def full(shape, value, dtype_name: str, dev: int):
        return _torch().full(shape, value, dtype=_TORCH_DTYPES[dtype_name],
                             device=TorchCaller.torch_device(dev))

    @staticmethod
    def fill(a, value) -> None:
        a.fill_(value)


def current_device() -> int:  # noqa: F811 (rebinds itself on first use)
    """The current CUDA device (CuPy's and torch's: both the runtime's). On first use this name
    is rebound to ``cupy.cuda.runtime.getDevice`` itself (no frame of ours per call)."""
    global current_device
    current_device = _cupy().cuda.runtime.getDevice
    return current_device()


def on_device(dev: int):
    """A context that makes ``dev`` the current device (nothing to do when it is already)."""
    if current_device() == dev:
        return contextlib.nullcontext()
    return _cupy().cuda.Device(dev)


_RAW_STREAM = None


def _raw_stream(dev: int) -> int:
    """Handle of torch's current stream on device ``dev`` (``torch._C._cuda_getCurrentRawStream``,
    what torch's own compiled code reads; else ``torch.cuda.current_stream(dev).cuda_stream``)."""
    global _RAW_STREAM
    if _RAW_STREAM is None:
        torch = _torch()
        f = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _RAW_STREAM = f if f is not None else (
            lambda d: torch.cuda.current_stream(d).cuda_stream)
    return _RAW_STREAM(dev)


def caller_of(*arrays):
    """:class:`TorchCaller` when the first array is a torch tensor and every other non-None
    one is too; :class:`CupyCaller` otherwise (CuPy arrays, other kinds, mixed kinds)."""
    tt = _TORCH_TENSOR or torch_tensor_type()
    if tt is None or not isinstance(arrays[0], tt):
        return CupyCaller
    for a in arrays[1:]:
        if a is not None and not isinstance(a, tt):
            return CupyCaller
    return TorchCaller
