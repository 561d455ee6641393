"""The eager execution of the backward calls (:func:`cupyflash.flash_attn_backward`,
:func:`cupyflash.flash_attn_varlen_backward`): the checks (:mod:`cupyflash.core.checks`), the
plan (:func:`cupyflash.backward.kernels.plan_backward`), the allocation of the gradients and of
D, and the launches, by the caller's conventions (:mod:`cupyflash.core.interop`).
"""
from __future__ import annotations

import collections

from ..core import checks, interop
from ..core.interop import TorchCaller, as_cupy, caller_of, describe_torch
from ..forward.run import _device_of, _require_device, _same_device, require_bool
from ..forward import kernels as fwd_kernels
from . import kernels

__all__ = ["flash_attn_backward", "flash_attn_varlen_backward"]

_HINT = {"dense": "; for NumPy arrays use cupyflash.reference.attention_backward",
         "varlen": "; for NumPy arrays use cupyflash.reference.varlen_attention_backward"}

#: Prepared launches, keyed by (kernel, constant fields, grid, device); least recently used out.
_LAUNCHES: collections.OrderedDict = collections.OrderedDict()
_MAX_LAUNCHES = 512


def _elem_strides(x, caller) -> tuple:
    """Element strides of a CuPy array or a torch tensor's descriptor."""
    if caller is TorchCaller:
        return tuple(x.stride())
    return tuple(s // x.dtype.itemsize for s in x.strides)


def _launch(kernel, fields, grid, block, dev, pointers, stream, maps=None) -> None:
    """Launch ``kernel`` (its :class:`launch.Launch` made on first use); ``maps``: the call's
    tensor-map layouts, used by the kernel that takes them (``kernel.takes_maps``)."""
    from ..core import jit, launch, tma
    hopper = kernel.takes_maps
    key = (kernel, fields, grid, dev, maps if hopper else None)
    run = _LAUNCHES.get(key)
    if run is None:
        spec = kernel.spec
        prepare = tma.BackwardMaps(maps, _MAP_SOURCES) if hopper else None
        run = launch.Launch(jit.get_kernel(spec), kernels.params_of(fields, tma=hopper), grid,
                            block, pointers=kernels.pointer_block(tma=hopper),
                            shared_mem=spec.smem_bytes, prepare=prepare)
        _LAUNCHES[key] = run
        if len(_LAUNCHES) > _MAX_LAUNCHES:
            _LAUNCHES.popitem(last=False)
    else:
        _LAUNCHES.move_to_end(key)
    run(pointers, stream)


#: q, k, v and dout in a call's pointers (kernels.POINTERS): the Hopper kernel's tensor maps.
_MAP_SOURCES = tuple(kernels.POINTERS.index(n) for n in ("q", "k", "v", "dout"))


def _hopper_maps(problem, strides, arrays, caller, dev):
    """The tensor-map layouts of the Hopper plan where it takes this call, else None: sm_90a,
    float16/bfloat16, dense, strides and base addresses a tensor map accepts, and
    :func:`kernels.hopper_enabled`."""
    from ..core import planning, tma
    if (problem.varlen or problem.dtype not in fwd_kernels.TC_DTYPES
            or not kernels.hopper_enabled()
            or planning._device_info(dev)[0] != fwd_kernels.WG_ARCH):
        return None
    if any(caller.ptr(arrays[n]) % 16 for n in ("q", "k", "v", "dout")):
        return None
    block_m, block_n = kernels.HOPPER_TILES[kernels.hopper_headdim(problem.headdim)]
    return tma.backward_maps_layout(problem, strides, block_m, block_n)


def _backward(problem, dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
              deterministic=False):
    named = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout, "dq": dq, "dk": dk,
             "dv": dv, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
    caller = caller_of(q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, cu_seqlens_k)
    dt = problem.dtype
    dtypes = {"lse": checks.lse_dtype(dt), "cu_seqlens_q": "int32", "cu_seqlens_k": "int32"}
    if caller is TorchCaller:
        views = {n: describe_torch(a) if a is not None else None for n, a in named.items()}
        arrays = dict(named)
    else:
        views = {n: as_cupy(a, n, dtypes.get(n, dt)) if a is not None else None
                 for n, a in named.items()}
        arrays = views
    _same_device(views)
    if dt in fwd_kernels.TC_DTYPES:  # mma.sync kernels: 16-byte cp.async, paired stores
        fwd_kernels.check_tensor_core_layout({n: views[n] for n in
                                              ("dout", "q", "k", "v", "out", "dq", "dk", "dv")})
    dev = _device_of(views["q"])
    strides = {n: _elem_strides(arrays[n], caller) for n in
               ("q", "k", "v", "out", "lse", "dout")}
    maps = _hopper_maps(problem, strides, arrays, caller, dev)
    plan = kernels.plan_backward(dt, problem.headdim, problem.causal, hopper=maps is not None,
                                 deterministic=bool(deterministic) and maps is not None)
    geometry = [(kern,) + kernels.launch_geometry(kern, problem) for kern in plan.kernels]
    for _, grid, _ in geometry:  # before any launch
        if grid[1] > 65535 or grid[2] > 65535:
            raise ValueError(f"problem: nheads ({grid[1]}) and batch ({grid[2]}) must be "
                             f"<= 65535")
    device = interop.on_device(dev) if caller is TorchCaller else views["q"].device
    with device:
        for n, like in (("dq", "q"), ("dk", "k"), ("dv", "k")):
            if arrays[n] is None:
                arrays[n] = caller.empty(tuple(views[like].shape), dt, dev)
        # D per row; the Hopper plan: LSE log2(e) and D per 64-row query block, padded
        dsum = caller.empty(kernels.stats_shape(problem) if maps is not None
                            else tuple(views["lse"].shape), kernels.ACC_DTYPE[dt], dev)
        dq_accum = None
        if maps is not None:  # zeroed on the call's stream, before the Hopper kernel adds to it:
            # the dQ tiles of a step's rows, padded (kernels_cu/backward/hopper.cu's DqTile);
            # deterministic: then int32 turn counters per (batch, head, query block of a step),
            # one per consumer warpgroup at hd256 (DqTurns)
            bm = plan.dq.block_m
            blocks = problem.batch * problem.nheads * -(-problem.seqlen_q // bm)
            turns = kernels.turns_per_tile(plan.dq.headdim) if deterministic else 0
            size = blocks * bm * plan.dq.headdim + blocks * turns
            dq_accum = caller.full((size,), 0, "float32", dev)
        for n in ("dq", "dk", "dv"):
            strides[n] = _elem_strides(arrays[n], caller)
        strides["dsum"] = _elem_strides(dsum, caller)
        fields = kernels.bwd_fields(problem, strides, problem.varlen)
        ptr = caller.ptr
        pointers = tuple(ptr(arrays[n]) if arrays[n] is not None else 0 for n in
                         ("dout", "dq", "dk", "dv")) + (
            ptr(dsum), ptr(dq_accum) if dq_accum is not None else 0) + tuple(
            ptr(arrays[n]) if arrays[n] is not None else 0 for n in
            ("q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k"))
        stream = caller.stream(dev)
        for kern, grid, block in geometry:
            if 0 not in grid:  # (no rows: dsum, dq; no keys: dkdv; nothing to write)
                _launch(kern, fields, grid, block, dev, pointers, stream, maps)
    return arrays["dq"], arrays["dk"], arrays["dv"]


def flash_attn_backward(dout, q, k, v, out, lse, softmax_scale, causal, window_size,
                        deterministic, dq, dk, dv):
    """The eager call of :func:`cupyflash.api.flash_attn_backward` (its documentation)."""
    require_bool(deterministic, "deterministic")
    _require_device({"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, "dq": dq,
                     "dk": dk, "dv": dv}, _HINT["dense"])
    problem = checks.check_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                     window_size=window_size)
    checks.check_backward(problem, q, k, dout, out, lse, dq, dk, dv)
    return _backward(problem, dout, q, k, v, out, lse, dq, dk, dv, None, None, deterministic)


def flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, softmax_scale, causal, window_size, deterministic,
                               dq, dk, dv, validate):
    """The eager call of :func:`cupyflash.api.flash_attn_varlen_backward` (its documentation)."""
    require_bool(deterministic, "deterministic")
    _require_device({"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse,
                     "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "dq": dq,
                     "dk": dk, "dv": dv}, _HINT["varlen"])
    problem = checks.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                                  window_size=window_size, validate=validate)
    checks.check_backward(problem, q, k, dout, out, lse, dq, dk, dv)
    return _backward(problem, dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k)
