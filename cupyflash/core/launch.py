"""The one launch path of every kernel of the library: :class:`Launch`.

Every kernel takes one parameter struct by value (``kernels_cu/common/params.cuh``, mirrored by
:mod:`cupyflash.core.params`). :class:`Launch` launches it through the CUDA driver's
``cuLaunchKernelEx`` (CUDA 12+, through ``ctypes``) on the function handle of a kernel that
CuPy compiled and loaded (so CuPy's compile and disk caches still apply), on any CUDA stream
handle (CuPy's or torch's: the launch is ordered with the caller's work and can be captured in a
CUDA graph). ``cupy.RawKernel`` can neither pass a struct of more than its scalar types nor
request a launch attribute; NVIDIA's ``cuda-bindings`` package exposes the same call, but it is
not a dependency of this library, and ``ctypes`` needs nothing beyond the driver that CuPy
already loads. The per-call host cost is one slice assignment of the call's pointers into the
struct and one driver call.

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
their first global load; the prefill kernels do not wait and are launched plainly.
"""
from __future__ import annotations

import ctypes
import functools
import threading

__all__ = ["LaunchError", "Launch"]

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
    :class:`Launch` passes ready ctypes objects (the configuration by reference, the
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


def _function_ptr(kernel) -> int:
    """The CUfunction handle of a ``cupy.RawKernel`` (loaded on the current device)."""
    return int(kernel.kernel.ptr)


class Launch:
    """The launch of one kernel, whose only argument is its parameter struct
    (:mod:`cupyflash.core.params`, passed by value), through ``cuLaunchKernelEx``: grid, block,
    shared memory and the struct's constant fields are set once; a call writes the struct's
    per-call pointers (one consecutive block of 64-bit fields) and the stream, and launches. The
    one launch path of every kernel of the library, CuPy and torch callers alike (any CUDA
    stream handle). With ``pdl`` it is a programmatic dependent launch (see the module
    docstring); without, a plain launch.

    The struct lives in a 64-byte aligned buffer of this object (tensor maps inside it must be
    64-byte aligned for the driver's encoders); ``prepare(address, pointers, stream_ptr, own)``,
    when given, runs before each launch on the struct at ``address`` (the Hopper forward's tensor
    maps and scheduler counter: :class:`cupyflash.core.tma.PrefillMaps`; ``own`` is False for a
    copy, see below). The driver copies the
    struct before ``cuLaunchKernelEx`` returns, so the next call may change it at once. Threads
    may share one object: a call takes its lock without waiting; a call that finds it taken
    (another thread is launching the same kernel) launches from a copy of its own.

    Parameters
    ----------
    kernel : cupy.RawKernel
        Loaded on the current device (the handle is taken here).
    params : ctypes.Structure
        The kernel's parameter struct with its constant fields set (copied here).
    grid, block : tuple of 3 ints
    pointers : tuple of 2 ints
        ``(byte offset, count)`` of the per-call pointer fields in ``params``
        (:func:`cupyflash.core.params.pointer_fields`).
    shared_mem : int
        Dynamic shared memory per block, bytes.
    pdl : bool
        Request programmatic stream serialization (sm_90+ kernels that wait with
        ``griddepcontrol.wait`` before their first global load).
    prepare : callable or None
        See above; raises to refuse the call (nothing is launched).

    Raises
    ------
    ValueError
        ``grid`` or ``block`` not 3 ints; the pointer block outside ``params``.
    """

    __slots__ = ("_func_arg", "_grid", "_block", "_shared_mem", "_pdl", "_attrs", "_size",
                 "_buf", "_addr", "_vals", "_offset", "_count", "_prepare", "_cfg", "_cfg_ref",
                 "_params", "_lock", "__weakref__")

    def __init__(self, kernel, params, grid, block, *, pointers, shared_mem: int = 0,
                 pdl: bool = False, prepare=None):
        if len(grid) != 3 or len(block) != 3:
            raise ValueError(f"grid, block: expected 3 ints each, got {tuple(grid)}, "
                             f"{tuple(block)}")
        self._size = ctypes.sizeof(params)
        self._offset, self._count = (int(x) for x in pointers)
        if self._offset < 0 or self._offset + 8 * self._count > self._size:
            raise ValueError(f"pointers: {self._count} pointers at byte {self._offset} lie "
                             f"outside the {self._size}-byte {type(params).__name__}")
        self._func_arg = ctypes.c_void_p(_function_ptr(kernel))
        self._grid, self._block = tuple(int(g) for g in grid), tuple(int(b) for b in block)
        self._shared_mem = int(shared_mem)
        self._pdl = bool(pdl)
        self._attrs = _pdl_attrs()
        self._prepare = prepare
        self._buf, self._addr, self._vals, self._cfg, self._params = self._arrays(
            ctypes.string_at(ctypes.addressof(params), self._size))
        self._cfg_ref = ctypes.byref(self._cfg)
        self._lock = threading.Lock()

    @property
    def address(self) -> int:
        """Host address of the launch's parameter struct (64-byte aligned)."""
        return self._addr

    def _arrays(self, image: bytes) -> tuple:
        """``(buffer, struct address, pointer block, configuration, void** array)``: a 64-byte
        aligned copy of the struct bytes ``image``, the ``uint64`` array over its pointer
        fields, the launch configuration without a stream, and the argument array (one
        argument: the struct)."""
        buf = ctypes.create_string_buffer(self._size + 64)
        addr = (ctypes.addressof(buf) + 63) & ~63
        ctypes.memmove(addr, image, self._size)
        vals = (ctypes.c_uint64 * max(1, self._count)).from_address(addr + self._offset)
        cfg = _Config()
        cfg.grid[0], cfg.grid[1], cfg.grid[2] = self._grid
        cfg.block[0], cfg.block[1], cfg.block[2] = self._block
        cfg.shared_mem_bytes = self._shared_mem
        cfg.attrs = self._attrs
        cfg.num_attrs = 1 if self._pdl else 0
        return buf, addr, vals, cfg, (ctypes.c_void_p * 1)(addr)

    def __call__(self, pointers, stream_ptr: int) -> None:
        """Launch with ``pointers`` (ints, the per-call pointer fields in order; 0 for NULL) on
        the stream handle ``stream_ptr``.

        Raises
        ------
        ValueError
            Not one pointer per field (or ``prepare`` refused the call).
        LaunchError
            The driver refused the launch (or a tensor map)."""
        f = _LAUNCH_EX or _launch_ex()
        lock = self._lock
        if lock.acquire(False):  # the struct is ours until released
            try:
                self._vals[:] = pointers  # (ValueError unless one per field)
                if self._prepare is not None:
                    self._prepare(self._addr, pointers, stream_ptr)
                self._cfg.stream = stream_ptr
                status = f(self._cfg_ref, self._func_arg, self._params, None)
            except ValueError:
                self._check_count(pointers)
                raise
            finally:
                lock.release()
        else:  # another thread is launching this kernel: a copy of our own
            self._check_count(pointers)
            buf, addr, vals, cfg, params = self._arrays(ctypes.string_at(self._addr, self._size))
            vals[:] = pointers
            if self._prepare is not None:
                self._prepare(addr, pointers, stream_ptr, False)
            cfg.stream = stream_ptr
            status = f(ctypes.byref(cfg), self._func_arg, params, None)
        if status:
            _check("cuLaunchKernelEx", status)

    def _check_count(self, pointers) -> None:
        if len(pointers) != self._count:
            raise ValueError(f"pointers: expected {self._count}, got {len(pointers)}")
