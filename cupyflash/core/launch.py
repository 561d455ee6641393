"""Programmatic dependent launches, which ``cupy.RawKernel`` cannot request.

CuPy launches through ``cuLaunchKernel``, which has no way to give a launch attribute. This
module calls the CUDA driver's ``cuLaunchKernelEx`` (CUDA 12+) through ``ctypes`` with the launch
attribute ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``, on the function handle of a
kernel that CuPy compiled and loaded (so CuPy's compile and disk caches still apply), on a CuPy
stream (so the launch is ordered with CuPy's work and can be captured in a CUDA graph). NVIDIA's
``cuda-bindings`` package exposes the same call; it is not a dependency of this library, and
``ctypes`` needs nothing beyond the driver that CuPy already loads.

Structures and enum values: ``cuda.h`` of CUDA 12/13 (``CUlaunchConfig``, ``CUlaunchAttribute``
with its 64-byte value union, ``CUlaunchAttributeID``). The layout is checked on the CPU by
``tests/test_launch.py``.

Programmatic dependent launch (CUDA Programming Guide, "Programmatic Dependent Launch and
Synchronization"; compute capability 9.0+): a kernel launched with
``programmaticStreamSerializationAllowed = 1`` may be scheduled before the previous kernel of its
stream has finished, once every block of that kernel has executed ``griddepcontrol.
launch_dependents`` or exited. It must then execute ``griddepcontrol.wait`` (which returns once
the previous grid has completed and its memory is visible) before it reads anything that kernel
may have written. What it gains is the launch and block set-up (parameter fetch, shared-memory
carve-out) overlapping the previous kernel's last blocks. The kernels of this library that are
launched so (the decode append and split kernels, ``kernels_cu/common/pdl.cuh``) wait before
their first global load; the prefill kernels do not wait, and launch through ``cupy.RawKernel``.
"""
from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np

__all__ = ["LaunchError", "kernel_arguments", "PreparedLaunch"]

# cuda.h enum value
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchError(RuntimeError):
    """A driver call of this module failed (the message names the call and the CUresult)."""


class _AttrValue(ctypes.Union):
    # CUlaunchAttributeValue: a union padded to 64 bytes; programmaticStreamSerializationAllowed
    # is an int
    _fields_ = [("pad", ctypes.c_char * 64), ("programmatic", ctypes.c_int)]


class _Attr(ctypes.Structure):
    # CUlaunchAttribute: {CUlaunchAttributeID id; char pad[4]; CUlaunchAttributeValue value;}
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _Config(ctypes.Structure):
    # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=1)
def _driver():
    """libcuda with the argument types of the calls used here (loaded on first use)."""
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p,
                                     ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    for f in (lib.cuLaunchKernelEx, lib.cuGetErrorName):
        f.restype = ctypes.c_int
    return lib


_LAUNCH_EX = None


def _launch_ex():
    """``cuLaunchKernelEx`` without declared argument types (looked up once): every call of
    :class:`PreparedLaunch` passes ready ctypes objects (the configuration by reference, the
    function handle as ``c_void_p``, the ``void*`` array, None), which ctypes hands over as
    they are; declared types would convert each of them again (~0.3 us per launch)."""
    global _LAUNCH_EX
    if _LAUNCH_EX is None:
        f = _driver()["cuLaunchKernelEx"]  # a new function object: _driver()'s keeps its types
        f.restype = ctypes.c_int
        _LAUNCH_EX = f
    return _LAUNCH_EX


def _check(call: str, status: int) -> None:
    if status != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(status, ctypes.byref(name))
        raise LaunchError(f"{call} failed: {(name.value or b'?').decode()} ({status})")


def _pdl_attrs():
    """The one launch attribute of a programmatic dependent launch (an array of one)."""
    attrs = (_Attr * 1)()
    attrs[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attrs[0].value.programmatic = 1
    return attrs


def kernel_arguments(args) -> tuple:
    """``(void** array, keep-alive list)`` of kernel arguments, converted as CuPy converts them
    for ``RawKernel``: CuPy arrays -> their device pointer, NumPy scalars -> their C type
    (``uint64`` is used for raw pointers and NULL). Other types raise TypeError."""
    import cupy
    c_types = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
               np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.float32): ctypes.c_float,
               np.dtype(np.float64): ctypes.c_double,
               np.dtype(np.uint32): ctypes.c_uint32}
    keep = []
    for i, a in enumerate(args):
        if isinstance(a, cupy.ndarray):
            keep.append(ctypes.c_void_p(a.data.ptr))
        elif isinstance(a, np.generic) and a.dtype in c_types:
            keep.append(c_types[a.dtype](a.item()))
        else:
            raise TypeError(f"kernel argument {i}: expected a cupy.ndarray or a NumPy scalar of "
                            f"{sorted(str(d) for d in c_types)}, got {type(a).__name__}")
    ptrs = (ctypes.c_void_p * max(1, len(keep)))(
        *[ctypes.cast(ctypes.byref(k), ctypes.c_void_p) for k in keep])
    return ptrs, keep


def _function_ptr(kernel) -> int:
    """The CUfunction handle of a ``cupy.RawKernel`` (loaded on the current device)."""
    return int(kernel.kernel.ptr)


class PreparedLaunch:
    """A launch through ``cuLaunchKernelEx`` of one kernel whose grid, block, shared memory and
    scalar arguments are converted once; each call supplies only the pointer arguments and the
    stream handle, so the per-call host cost stays below that of ``cupy.RawKernel`` (the full
    conversion of :func:`kernel_arguments` takes tens of us for a kernel with ~50 arguments).
    With ``pdl`` (default) it is a programmatic dependent launch (see the module docstring);
    without, a plain launch on the given stream (any CUDA stream handle: CuPy's, PyTorch's).

    The launch configuration, one ``uint64`` array holding the pointer arguments and the
    ``void*`` argument array over it are built once and reused: a call assigns its pointers to
    that array by one slice assignment, the stream to the configuration, and calls the driver
    (which copies the arguments before ``cuLaunchKernelEx`` returns). Threads may share one
    object: a call takes its lock without waiting; a call that finds it taken (another thread is
    launching the same kernel) launches from arrays of its own instead.

    Parameters
    ----------
    kernel : cupy.RawKernel
        Loaded on the current device (the handle is taken here).
    grid, block : tuple of 3 ints
    args : tuple
        The argument list as for ``RawKernel``; the entries at ``pointer_slots`` are
        placeholders, replaced by the call's pointers (ints, 0 for NULL).
    pointer_slots : tuple of int
        Indices of the per-call pointer arguments.
    shared_mem : int
        Dynamic shared memory per block, bytes.
    pdl : bool
        Request programmatic stream serialization (sm_90+ kernels that wait with
        ``griddepcontrol.wait`` before their first global load).

    Raises
    ------
    ValueError
        ``grid`` or ``block`` not 3 ints; a pointer slot outside ``args``.
    TypeError
        An argument :func:`kernel_arguments` cannot convert.
    """

    __slots__ = ("_func", "_func_arg", "_grid", "_block", "_shared_mem", "_attrs", "_template",
                 "_keep", "_slots", "_n", "_pdl", "_cfg", "_cfg_ref", "_vals", "_params",
                 "_lock", "__weakref__")

    def __init__(self, kernel, grid, block, args, pointer_slots, *, shared_mem: int = 0,
                 pdl: bool = True):
        if len(grid) != 3 or len(block) != 3:
            raise ValueError(f"grid, block: expected 3 ints each, got {tuple(grid)}, "
                             f"{tuple(block)}")
        self._slots = tuple(int(i) for i in pointer_slots)
        self._n = len(args)
        if any(not 0 <= i < self._n for i in self._slots):
            raise ValueError(f"pointer_slots: expected indices below {self._n}, got "
                             f"{self._slots}")
        self._func = _function_ptr(kernel)
        self._func_arg = ctypes.c_void_p(self._func)
        self._grid, self._block = tuple(int(g) for g in grid), tuple(int(b) for b in block)
        self._shared_mem = int(shared_mem)
        self._pdl = bool(pdl)
        self._attrs = _pdl_attrs()
        # the addresses of the converted scalars; pointer slots are filled per call
        ptrs, self._keep = kernel_arguments(args)
        self._template = [ptrs[i] for i in range(self._n)]
        self._cfg, self._vals, self._params = self._arrays()
        self._cfg_ref = ctypes.byref(self._cfg)
        self._lock = threading.Lock()

    def _arrays(self) -> tuple:
        """``(configuration, pointer values, void** array)``: the configuration without a
        stream, a ``uint64`` array with one element per pointer slot, and the argument array
        whose pointer slots address that array's elements (the others the constant scalars)."""
        cfg = _Config()
        cfg.grid[0], cfg.grid[1], cfg.grid[2] = self._grid
        cfg.block[0], cfg.block[1], cfg.block[2] = self._block
        cfg.shared_mem_bytes = self._shared_mem
        cfg.attrs = self._attrs
        cfg.num_attrs = 1 if self._pdl else 0
        vals = (ctypes.c_uint64 * max(1, len(self._slots)))()
        addrs = list(self._template)
        base = ctypes.addressof(vals)
        for j, i in enumerate(self._slots):
            addrs[i] = base + 8 * j
        return cfg, vals, (ctypes.c_void_p * max(1, self._n))(*addrs)

    def params(self, pointers) -> tuple:
        """``(void** array, keep-alive list)`` of the arguments with ``pointers`` (ints, in
        ``pointer_slots`` order) in their slots (a new array: not the one calls reuse)."""
        if len(pointers) != len(self._slots):
            raise ValueError(f"pointers: expected {len(self._slots)}, got {len(pointers)}")
        vals = [ctypes.c_uint64(int(x)) for x in pointers]
        addrs = list(self._template)
        for i, v in zip(self._slots, vals):
            addrs[i] = ctypes.addressof(v)
        return (ctypes.c_void_p * max(1, self._n))(*addrs), vals

    def __call__(self, pointers, stream_ptr: int) -> None:
        """Launch with ``pointers`` (ints, in ``pointer_slots`` order) on the stream handle
        ``stream_ptr``.

        Raises
        ------
        ValueError
            Not one pointer per slot.
        LaunchError
            The driver refused the launch."""
        f = _LAUNCH_EX or _launch_ex()
        lock = self._lock
        if lock.acquire(False):  # the shared arrays are ours until released
            try:
                self._vals[:] = pointers  # (ValueError unless one per slot)
                self._cfg.stream = stream_ptr
                status = f(self._cfg_ref, self._func_arg, self._params, None)
            except ValueError:
                self._check_count(pointers)
                raise
            finally:
                lock.release()
        else:  # another thread is launching this kernel: arrays of this call's own
            self._check_count(pointers)
            cfg, vals, params = self._arrays()
            vals[:] = pointers
            cfg.stream = stream_ptr
            status = f(ctypes.byref(cfg), self._func_arg, params, None)
        if status:
            _check("cuLaunchKernelEx", status)

    def _check_count(self, pointers) -> None:
        if len(pointers) != len(self._slots):
            raise ValueError(f"pointers: expected {len(self._slots)}, got {len(pointers)}")
