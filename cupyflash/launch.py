"""Kernel launches with thread-block clusters, which ``cupy.RawKernel`` cannot request.

CuPy launches through ``cuLaunchKernel``, which has no way to give a cluster shape. This module
calls the CUDA driver's ``cuLaunchKernelEx`` (CUDA 12+) through ``ctypes`` with the launch
attribute ``CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION``, on the function handle of a kernel that
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
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

__all__ = ["MAX_PORTABLE_CLUSTER", "MAX_CLUSTER", "LaunchError", "launch",
           "max_active_clusters", "kernel_arguments"]

#: Blocks per cluster that every cluster-capable GPU supports.
MAX_PORTABLE_CLUSTER = 8
#: Blocks per cluster on H100/H200 with the non-portable opt-in.
MAX_CLUSTER = 16

# cuda.h enum values
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14


class LaunchError(RuntimeError):
    """A driver call of this module failed (the message names the call and the CUresult)."""


class _AttrValue(ctypes.Union):
    # CUlaunchAttributeValue: a union padded to 64 bytes; clusterDim is {x, y, z} unsigned ints
    _fields_ = [("pad", ctypes.c_char * 64), ("cluster_dim", ctypes.c_uint * 3)]


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
    lib.cuOccupancyMaxActiveClusters.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                                 ctypes.POINTER(_Config)]
    lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    for f in (lib.cuLaunchKernelEx, lib.cuOccupancyMaxActiveClusters, lib.cuFuncSetAttribute,
              lib.cuGetErrorName):
        f.restype = ctypes.c_int
    return lib


def _check(call: str, status: int) -> None:
    if status != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(status, ctypes.byref(name))
        raise LaunchError(f"{call} failed: {(name.value or b'?').decode()} ({status})")


def _config(grid, block, shared_mem: int, stream_ptr: int, cluster) -> tuple:
    """A CUlaunchConfig (and the attribute array it points to, to keep alive)."""
    attrs = (_Attr * 1)()
    attrs[0].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    for i in range(3):
        attrs[0].value.cluster_dim[i] = int(cluster[i])
    cfg = _Config()
    for i in range(3):
        cfg.grid[i] = int(grid[i])
        cfg.block[i] = int(block[i])
    cfg.shared_mem_bytes = int(shared_mem)
    cfg.stream = stream_ptr
    cfg.attrs = attrs
    cfg.num_attrs = 1
    return cfg, attrs


def kernel_arguments(args) -> tuple:
    """``(void** array, keep-alive list)`` of kernel arguments, converted as CuPy converts them
    for ``RawKernel``: CuPy arrays -> their device pointer, NumPy scalars -> their C type
    (``uint64`` is used for raw pointers and NULL). Other types raise TypeError."""
    import cupy
    c_types = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
               np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.float32): ctypes.c_float,
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


@functools.lru_cache(maxsize=None)
def _allow_non_portable(func_ptr: int) -> None:
    _check("cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED)", _driver().cuFuncSetAttribute(
        func_ptr, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))


def launch(kernel, grid, block, args, *, shared_mem: int = 0, cluster=(1, 1, 1),
           stream=None) -> None:
    """Launch ``kernel`` (a ``cupy.RawKernel``) with the thread-block cluster shape ``cluster``
    on ``stream`` (default: CuPy's current stream), like ``kernel(grid, block, args,
    shared_mem=shared_mem)`` otherwise.

    Parameters
    ----------
    kernel : cupy.RawKernel
    grid, block, cluster : tuple of 3 ints
        ``grid`` in blocks; each of its dimensions must be a multiple of ``cluster``'s.
    args : tuple
        As for ``RawKernel`` (:func:`kernel_arguments`).
    shared_mem : int
        Dynamic shared memory per block, bytes (the kernel's limit must already allow it).

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
    cluster = tuple(int(c) for c in cluster)
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
    cfg, _attrs = _config(grid, block, shared_mem, s.ptr, cluster)
    params, _keep = kernel_arguments(args)
    _check("cuLaunchKernelEx", _driver().cuLaunchKernelEx(ctypes.byref(cfg), func, params, None))


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
