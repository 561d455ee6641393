"""Kernel launches with thread-block clusters or programmatic dependent launch, which
``cupy.RawKernel`` cannot request.

CuPy launches through ``cuLaunchKernel``, which has no way to give a cluster shape or a launch
attribute. This module calls the CUDA driver's ``cuLaunchKernelEx`` (CUDA 12+) through ``ctypes``
with the launch attributes ``CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION`` and
``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``, on the function handle of a kernel that
CuPy compiled and loaded (so CuPy's compile and disk caches still apply), on CuPy's current
stream (so the launch is ordered with CuPy's work and can be captured in a CUDA graph).
NVIDIA's ``cuda-bindings`` package exposes the same call; it is not a dependency of this
library, and ``ctypes`` needs nothing beyond the driver that CuPy already loads.

Structures and enum values: ``cuda.h`` of CUDA 12/13 (``CUlaunchConfig``, ``CUlaunchAttribute``
with its 64-byte value union, ``CUlaunchAttributeID``, ``CUfunction_attribute``). The layout is
checked on the CPU by ``tests/test_launch.py``.

Thread-block clusters (CUDA Programming Guide, "Thread Block Clusters"): compute capability 9.0+;
up to 8 blocks per cluster portably, up to 16 on H100/H200 once a kernel opts in
(``CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED``, which :func:`launch` sets when asked
for more than 8).

Programmatic dependent launch (CUDA Programming Guide, "Programmatic Dependent Launch and
Synchronization"; compute capability 9.0+): a kernel launched with
``programmaticStreamSerializationAllowed = 1`` may be scheduled before the previous kernel of its
stream has finished, once every block of that kernel has executed ``griddepcontrol.
launch_dependents`` or exited. It must then execute ``griddepcontrol.wait`` (which returns once
the previous grid has completed and its memory is visible) before it reads anything that kernel
may have written. What it gains is the launch and block set-up (parameter fetch, shared-memory
carve-out) overlapping the previous kernel's last blocks. The kernels of this library that are
launched so (``kernels_cu/common/pdl.cuh``) wait before their first global load.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

__all__ = ["MAX_PORTABLE_CLUSTER", "MAX_CLUSTER", "LaunchError", "launch",
           "max_active_clusters", "kernel_arguments", "PreparedLaunch", "TensorMap",
           "encode_tensor_map"]

#: Blocks per cluster that every cluster-capable GPU supports.
MAX_PORTABLE_CLUSTER = 8
#: Blocks per cluster on H100/H200 with the non-portable opt-in.
MAX_CLUSTER = 16

# cuda.h enum values
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14


class LaunchError(RuntimeError):
    """A driver call of this module failed (the message names the call and the CUresult)."""


class _AttrValue(ctypes.Union):
    # CUlaunchAttributeValue: a union padded to 64 bytes; clusterDim is {x, y, z} unsigned ints,
    # programmaticStreamSerializationAllowed an int
    _fields_ = [("pad", ctypes.c_char * 64), ("cluster_dim", ctypes.c_uint * 3),
                ("programmatic", ctypes.c_int)]


class _Attr(ctypes.Structure):
    # CUlaunchAttribute: {CUlaunchAttributeID id; char pad[4]; CUlaunchAttributeValue value;}
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _Config(ctypes.Structure):
    # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("num_attrs", ctypes.c_uint)]


class TensorMap(ctypes.Structure):
    """A ``CUtensorMap`` (``cuda.h``: 16 opaque 64-bit words), passed by value as a kernel
    argument (``const __grid_constant__ cf::TmaDesc`` in ``kernels_cu/common/tma.cuh``)."""
    _fields_ = [("words", ctypes.c_uint64 * 16)]


# cuda.h enum values of cuTensorMapEncodeTiled
CU_TENSOR_MAP_DATA_TYPE_UINT16 = 1
CU_TENSOR_MAP_INTERLEAVE_NONE = 0
CU_TENSOR_MAP_SWIZZLE_128B = 3
CU_TENSOR_MAP_L2_PROMOTION = {None: 0, 64: 1, 128: 2, 256: 3}
CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0  # out-of-bounds elements are zero


@functools.lru_cache(maxsize=1)
def _driver():
    """libcuda with the argument types of the calls used here (loaded on first use)."""
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p,
                                     ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    lib.cuOccupancyMaxActiveClusters.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                                 ctypes.POINTER(_Config)]
    lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuTensorMapEncodeTiled.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    for f in (lib.cuLaunchKernelEx, lib.cuOccupancyMaxActiveClusters, lib.cuFuncSetAttribute,
              lib.cuGetErrorName, lib.cuTensorMapEncodeTiled):
        f.restype = ctypes.c_int
    return lib


def _check(call: str, status: int) -> None:
    if status != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(status, ctypes.byref(name))
        raise LaunchError(f"{call} failed: {(name.value or b'?').decode()} ({status})")


def encode_tensor_map(ptr: int, dims, strides_bytes, box, *,
                      l2_promotion: int | None = 256) -> TensorMap:
    """A tiled tensor map of 16-bit elements (``cuTensorMapEncodeTiled``; CUDA Driver API,
    "Tensor Map Object Management") at device address ``ptr``: ``dims`` (innermost first,
    elements), ``strides_bytes`` (of dims 1.., bytes, multiples of 16), ``box`` (elements per
    copy along each dim, the innermost 128 bytes at most), the 128-byte shared-memory swizzle,
    zero fill out of bounds, and L2 fetches of ``l2_promotion`` bytes (64, 128, 256 or None).

    Raises
    ------
    LaunchError
        The driver refused the description (the message names the CUresult)."""
    rank = len(dims)
    if not (1 <= rank <= 5 and len(strides_bytes) == rank - 1 and len(box) == rank):
        raise ValueError(f"dims, strides_bytes, box: expected rank 1-5 with rank - 1 strides, "
                         f"got {dims}, {strides_bytes}, {box}")
    raw = ctypes.create_string_buffer(128 + 64)  # the driver writes it 64-byte aligned
    addr = (ctypes.addressof(raw) + 63) & ~63
    _check("cuTensorMapEncodeTiled", _driver().cuTensorMapEncodeTiled(
        ctypes.c_void_p(addr), CU_TENSOR_MAP_DATA_TYPE_UINT16, rank, ctypes.c_void_p(int(ptr)),
        (ctypes.c_uint64 * rank)(*[int(d) for d in dims]),
        (ctypes.c_uint64 * max(1, rank - 1))(*[int(s) for s in strides_bytes]),
        (ctypes.c_uint32 * rank)(*[int(b) for b in box]),
        (ctypes.c_uint32 * rank)(*([1] * rank)),
        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
        CU_TENSOR_MAP_L2_PROMOTION[l2_promotion], CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE))
    return TensorMap.from_buffer_copy(ctypes.string_at(addr, ctypes.sizeof(TensorMap)))


def _config(grid, block, shared_mem: int, stream_ptr: int, cluster, pdl: bool = False) -> tuple:
    """A CUlaunchConfig (and the attribute array it points to, to keep alive): the cluster
    shape unless ``cluster`` is None, and with ``pdl`` programmatic stream serialization."""
    attrs = (_Attr * 2)()
    n = 0
    if cluster is not None:
        attrs[n].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        for i in range(3):
            attrs[n].value.cluster_dim[i] = int(cluster[i])
        n += 1
    if pdl:
        attrs[n].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attrs[n].value.programmatic = 1
        n += 1
    cfg = _Config()
    for i in range(3):
        cfg.grid[i] = int(grid[i])
        cfg.block[i] = int(block[i])
    cfg.shared_mem_bytes = int(shared_mem)
    cfg.stream = stream_ptr
    cfg.attrs = attrs
    cfg.num_attrs = n
    return cfg, attrs


def kernel_arguments(args) -> tuple:
    """``(void** array, keep-alive list)`` of kernel arguments, converted as CuPy converts them
    for ``RawKernel``: CuPy arrays -> their device pointer, NumPy scalars -> their C type
    (``uint64`` is used for raw pointers and NULL); a :class:`TensorMap` is passed by value.
    Other types raise TypeError."""
    import cupy
    c_types = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
               np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.float32): ctypes.c_float,
               np.dtype(np.uint32): ctypes.c_uint32}
    keep = []
    for i, a in enumerate(args):
        if isinstance(a, TensorMap):
            keep.append(a)
        elif isinstance(a, cupy.ndarray):
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


@functools.lru_cache(maxsize=None)
def _allow_non_portable(func_ptr: int) -> None:
    _check("cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED)", _driver().cuFuncSetAttribute(
        func_ptr, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))


def launch(kernel, grid, block, args, *, shared_mem: int = 0, cluster=(1, 1, 1),
           stream=None, pdl: bool = False) -> None:
    """Launch ``kernel`` (a ``cupy.RawKernel``) with the thread-block cluster shape ``cluster``
    (and, with ``pdl``, as a programmatic dependent launch) on ``stream`` (default: CuPy's
    current stream), like ``kernel(grid, block, args, shared_mem=shared_mem)`` otherwise.

    Parameters
    ----------
    kernel : cupy.RawKernel
    grid, block, cluster : tuple of 3 ints
        ``grid`` in blocks; each of its dimensions must be a multiple of ``cluster``'s.
        ``cluster=None``: no cluster attribute at all.
    args : tuple
        As for ``RawKernel`` (:func:`kernel_arguments`).
    shared_mem : int
        Dynamic shared memory per block, bytes (the kernel's limit must already allow it).
    pdl : bool
        Programmatic stream serialization (sm_90+): the kernel must execute
        ``griddepcontrol.wait`` before reading what the previous kernel wrote.

    Raises
    ------
    ValueError
        A grid dimension that is not a multiple of the cluster's, or a cluster above
        :data:`MAX_CLUSTER` blocks.
    LaunchError
        The driver refused the launch (e.g. clusters on a GPU before sm_90).
    """
    import cupy
    if len(grid) != 3 or len(block) != 3:
        raise ValueError(f"grid, block: expected 3 ints each, got {tuple(grid)}, {tuple(block)}")
    if cluster is None:  # no cluster attribute
        cluster_attr, cluster = None, (1, 1, 1)
    else:
        cluster_attr = cluster = tuple(int(c) for c in cluster)
    if len(cluster) != 3 or min(cluster) < 1 or any(g % c for g, c in zip(grid, cluster)):
        raise ValueError(f"cluster: expected 3 positive ints dividing the grid {tuple(grid)}, "
                         f"got {cluster}")
    size = cluster[0] * cluster[1] * cluster[2]
    if size > MAX_CLUSTER:
        raise ValueError(f"cluster: at most {MAX_CLUSTER} blocks, got {size}")
    func = _function_ptr(kernel)
    if size > MAX_PORTABLE_CLUSTER:
        _allow_non_portable(func)
    s = cupy.cuda.get_current_stream() if stream is None else stream
    cfg, _attrs = _config(grid, block, shared_mem, s.ptr, cluster_attr, pdl)
    params, _keep = kernel_arguments(args)
    _check("cuLaunchKernelEx", _driver().cuLaunchKernelEx(ctypes.byref(cfg), func, params, None))


class PreparedLaunch:
    """A programmatic dependent launch (see the module docstring) of one kernel whose grid,
    block, shared memory and scalar arguments are converted once; each call supplies only the
    pointer arguments and the stream, so that the per-call host cost stays near that of
    ``cupy.RawKernel`` (the full conversion of :func:`kernel_arguments` takes tens of us for a
    kernel with ~50 arguments). Calls do not share mutable state, so threads may share one.

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
    """

    __slots__ = ("_func", "_grid", "_block", "_shared_mem", "_attrs", "_template", "_keep",
                 "_slots", "_n")

    def __init__(self, kernel, grid, block, args, pointer_slots, *, shared_mem: int = 0):
        if len(grid) != 3 or len(block) != 3:
            raise ValueError(f"grid, block: expected 3 ints each, got {tuple(grid)}, "
                             f"{tuple(block)}")
        self._slots = tuple(int(i) for i in pointer_slots)
        self._n = len(args)
        if any(not 0 <= i < self._n for i in self._slots):
            raise ValueError(f"pointer_slots: expected indices below {self._n}, got "
                             f"{self._slots}")
        self._func = _function_ptr(kernel)
        self._grid, self._block = tuple(int(g) for g in grid), tuple(int(b) for b in block)
        self._shared_mem = int(shared_mem)
        _cfg, self._attrs = _config(self._grid, self._block, self._shared_mem, 0, None, True)
        # the addresses of the converted scalars; pointer slots are filled per call
        ptrs, self._keep = kernel_arguments(args)
        self._template = [ptrs[i] for i in range(self._n)]

    def params(self, pointers) -> tuple:
        """``(void** array, keep-alive list)`` of the arguments with ``pointers`` (ints, in
        ``pointer_slots`` order) in their slots."""
        if len(pointers) != len(self._slots):
            raise ValueError(f"pointers: expected {len(self._slots)}, got {len(pointers)}")
        vals = [ctypes.c_uint64(int(x)) for x in pointers]
        addrs = list(self._template)
        for i, v in zip(self._slots, vals):
            addrs[i] = ctypes.addressof(v)
        return (ctypes.c_void_p * max(1, self._n))(*addrs), vals

    def __call__(self, pointers, stream_ptr: int) -> None:
        """Launch with ``pointers`` (ints, in ``pointer_slots`` order) on the stream handle
        ``stream_ptr``."""
        params, _vals = self.params(pointers)
        cfg = _Config()
        cfg.grid[0], cfg.grid[1], cfg.grid[2] = self._grid
        cfg.block[0], cfg.block[1], cfg.block[2] = self._block
        cfg.shared_mem_bytes = self._shared_mem
        cfg.stream = stream_ptr
        cfg.attrs = self._attrs
        cfg.num_attrs = 1
        _check("cuLaunchKernelEx", _driver().cuLaunchKernelEx(ctypes.byref(cfg), self._func,
                                                              params, None))


def max_active_clusters(kernel, block, cluster, *, shared_mem: int = 0) -> int:
    """How many clusters of shape ``cluster`` of ``kernel`` can be resident on the current GPU
    at once (``cuOccupancyMaxActiveClusters``): the clusters of one wave."""
    cluster = tuple(int(c) for c in cluster)
    if len(cluster) != 3 or min(cluster) < 1 or cluster[0] * cluster[1] * cluster[2] > MAX_CLUSTER:
        raise ValueError(f"cluster: expected 3 positive ints, at most {MAX_CLUSTER} blocks, got "
                         f"{cluster}")
    func = _function_ptr(kernel)
    if cluster[0] * cluster[1] * cluster[2] > MAX_PORTABLE_CLUSTER:
        _allow_non_portable(func)
    cfg, _attrs = _config(cluster, block, shared_mem, 0, cluster)
    n = ctypes.c_int()
    _check("cuOccupancyMaxActiveClusters",
           _driver().cuOccupancyMaxActiveClusters(ctypes.byref(n), func, ctypes.byref(cfg)))
    return n.value
