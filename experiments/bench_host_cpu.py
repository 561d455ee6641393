"""Host cost of warm calls measured on the CPU, without a GPU (issue 22, item 2): what the
library's own Python costs per call, every device operation replaced by a no-op.

* ``launch``: :class:`cupyflash.core.launch.Launch.__call__` with 10 pointers (the decode
  split kernel's), the driver's ``cuLaunchKernelEx`` a compiled C function that returns
  0 (built with ``cc`` at start), called through ctypes as the library calls the driver.
* ``TMA launch``: :class:`cupyflash.core.launch.Launch.__call__` of the TMA prefill kernel
  (its :class:`cupyflash.core.tma.PrefillMaps`) with new q/k/v pointers on every call (two sets
  in turn), the tensor-map calls
  (``cuTensorMapEncodeTiled``, ``cuTensorMapReplaceAddress``) no-op C functions too.
* ``prefill`` / ``decode``: warm calls on the issue's shapes (prefill 24 x 256 tokens, 12 heads
  x hd32, fp16, causal; decode Llama-3-8B heads, batch 1 x 4k keys and 16 x 1k, bf16, device
  ``cache_seqlens``), through the real warm path (launch cache, pointers, allocations,
  ``Launch``), with CPU torch tensors playing CUDA tensors of device 0 (as
  ``tests/test_torch_caller.py``'s fixture does) and, for the CuPy caller, stand-in objects
  with a ``cupy.ndarray``'s attributes (``data.ptr``, ``shape``, ``strides``, ``dtype``).
  Outputs are CPU ``torch.empty`` or ``torch.empty_like`` (torch caller; the library uses the
  latter for a C-strided ``q`` since 7f659c5) or stand-ins (CuPy caller): on a GPU host the
  CUDA allocations (on the H200 host ``torch.empty`` on a device 3.7 us, ``torch.empty_like``
  1.9 us; CPU ones here ~2 and ~1 us) and the real driver launches (~4.5 us each on the H200
  host) come on top. The stream's capture query of the decode scratch (``_is_capturing``) is
  a no-op here too.

Fastest of ``--repeats`` loops of ``--calls`` calls (timeit); microseconds per call. Prints a
table; writes nothing (CPU numbers are not experiment results).

    PYTHONPATH=. python experiments/bench_host_cpu.py [--calls 100000] [--repeats 5]
"""
from __future__ import annotations

import argparse
import ctypes
import math
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's cupyflash
from cupyflash import api, decode  # noqa: E402
from cupyflash.forward import run  # noqa: E402
from cupyflash.core import jit  # noqa: E402
from cupyflash.core import checks, guard, interop, launch
from cupyflash.decode import plan as decode_plan
from cupyflash.forward import dispatch
from cupyflash.core import planning

STREAM = 0x5EA


class _Mem:
    __slots__ = ("ptr", "device_id")

    def __init__(self, ptr, dev=0):
        self.ptr, self.device_id = ptr, dev


class _Dev:
    id = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Out:
    """What the CuPy caller's allocator returns here: a pointer and a shape (costs ~0.2 us)."""
    __slots__ = ("data", "shape")
    _next = [1 << 40]

    def __init__(self, shape, dtype):
        self.shape = shape
        self.data = _Mem(_Out._next[0])
        _Out._next[0] += 1 << 24


ALLOCS = [0]


class FakeCupy:
    """A stand-in for a ``cupy.ndarray`` on device 0: the attributes the library reads."""
    _next = [1 << 20]

    def __init__(self, shape, dtype, strides=None):
        self.dtype = np.dtype(dtype)
        self.shape = tuple(shape)
        self.ndim = len(self.shape)
        self.itemsize = self.dtype.itemsize
        self.strides = interop.c_strides(self.shape, self.itemsize) if strides is None \
            else tuple(strides)
        self.size = math.prod(self.shape)
        self.nbytes = self.size * self.itemsize
        self.data = _Mem(FakeCupy._next[0])
        FakeCupy._next[0] += (self.nbytes + 511) // 256 * 256
        self.device = _Dev()

    @property
    def flags(self):
        class F:
            c_contiguous = True
        return F


_NOOP_SO = None


class _NoopDriver:
    """Stands in for libcuda: ``cuLaunchKernelEx`` is a compiled C function of four pointer
    arguments returning 0 (cc is needed), as are the tensor-map calls of :mod:`cupyflash.core.tma`;
    reached as the library reaches the real one: ``lib.cuLaunchKernelEx`` with the argument types that ``launch._driver`` declares,
    ``lib["cuLaunchKernelEx"]`` a new function object without them."""

    def __init__(self):
        global _NOOP_SO
        if _NOOP_SO is None:
            d = Path(tempfile.mkdtemp())
            (d / "noop.c").write_text(
                "int cuLaunchKernelEx(void *a, void *b, void *c, void *d) { return 0; }\n"
                "int cuTensorMapEncodeTiled(void *m, int t, unsigned r, void *p, void *d,\n"
                "    void *s, void *b, void *e, int i, int w, int l, int o) { return 0; }\n"
                "int cuTensorMapReplaceAddress(void *m, void *p) { return 0; }\n")
            subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(d / "noop.so"),
                            str(d / "noop.c")], check=True)
            _NOOP_SO = str(d / "noop.so")
        self._lib = ctypes.CDLL(_NOOP_SO)
        f = self._lib.cuLaunchKernelEx
        f.argtypes = [ctypes.POINTER(launch._Config), ctypes.c_void_p,
                      ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        f.restype = ctypes.c_int
        self.cuLaunchKernelEx = f
        # the tensor-map calls of cupyflash.core.tma (which declares their argument types)
        self.cuTensorMapEncodeTiled = self._lib.cuTensorMapEncodeTiled
        self.cuTensorMapReplaceAddress = self._lib.cuTensorMapReplaceAddress

    def __getitem__(self, name):
        return self._lib[name]


def install_fakes():
    """Replace the device, the allocators, the stream and the driver (the CPU tests' fixture,
    with the real Launch and a no-op cuLaunchKernelEx)."""
    tc, cc = interop.TorchCaller, interop.CupyCaller
    tc.device = staticmethod(lambda a: 0 if a.device.type == "cpu" else -1)
    orig = interop.is_device_array

    def is_dev(x):
        return isinstance(x, (torch.Tensor, FakeCupy)) or orig(x)
    for mod, name in ((run, "is_device_array"), (checks, "_is_device"),
                      (checks, "is_device_array"), (decode, "is_device_array")):
        setattr(mod, name, is_dev)
    interop._torch()
    def torch_empty(shape, dt, dev):
        ALLOCS[0] += 1
        return torch.empty(shape, dtype=interop._TORCH_DTYPES[dt])

    def torch_empty_like(a):
        ALLOCS[0] += 1
        return torch.empty_like(a)

    def cupy_empty(shape, dt, dev):
        ALLOCS[0] += 1
        return _Out(shape, dt)
    tc.empty = staticmethod(torch_empty)
    tc.empty_like = staticmethod(torch_empty_like)  # (the library's from 7f659c5 on)
    tc.full = staticmethod(lambda shape, value, dt, dev: torch.full(
        tuple(shape), value, dtype=interop._TORCH_DTYPES[dt]))
    tc.stream = staticmethod(lambda dev: STREAM)
    cc.empty = staticmethod(cupy_empty)
    cc.stream = staticmethod(lambda dev: STREAM)
    interop._CUPY_NDARRAY = FakeCupy
    ident = lambda x, *a, **k: x  # noqa: E731
    run.as_cupy = decode.as_cupy = ident
    interop.current_device = lambda: 0
    if hasattr(api, "_current_device"):  # (before 7f659c5)
        api._current_device = lambda: 0
    planning._device_info = lambda dev: ("sm_90a", 132, 227 * 1024)
    dispatch.launch_plan = lambda p: dispatch._launch_plan_cached(p, 0)
    jit.get_kernel = lambda spec, *a: spec
    launch._function_ptr = lambda kernel: 0x1234
    launch._LAUNCH_EX = None
    launch._driver = _NoopDriver  # cuLaunchKernelEx: a C function that returns 0
    decode._resolve_plan = lambda prob, ss: decode_plan._resolve_plan(prob, ss, use_device=False)
    decode._compute_capability = lambda: 90
    decode._is_capturing = lambda stream: False
    if hasattr(guard, "_setup"):
        guard._setup = lambda dev: (0x10, 0x20)
    if hasattr(decode, "_stream_counters"):  # (before issue 22's step 3)
        orig_counters = decode._stream_counters

        def counters(caller, dev, stream, *a):
            if caller is cc:
                return 0x30
            return orig_counters(caller, dev, stream, *a)
        decode._stream_counters = counters
    if hasattr(decode, "_stream_scratch"):
        orig_scratch = decode._stream_scratch

        def scratch(caller, dev, stream, *a):
            if caller is cc:
                return 0x30, 0x40
            return orig_scratch(caller, dev, stream, *a)
        decode._stream_scratch = scratch


def per_call_us(f, calls: int, repeats: int) -> float:
    f()
    f()
    t = timeit.repeat(f, number=calls, repeat=repeats)
    return min(t) / calls * 1e6  # the least disturbed loop (a shared 2-core machine)


def cases():
    g = torch.Generator().manual_seed(0)

    def t(shape, dtype):
        return torch.randn(shape, generator=g).to(dtype)

    def c(shape, dtype):
        return FakeCupy(shape, dtype)
    bf16, fp16 = interop.np_dtype("bfloat16"), np.float16
    out = {}
    # prefill 24 x 256, 12 heads x hd32, fp16, causal
    q = t((24, 256, 12, 32), torch.float16)
    out["prefill torch"] = lambda: api.flash_attn_func(q, q, q, causal=True)
    qc = c((24, 256, 12, 32), fp16)
    out["prefill cupy"] = lambda: api.flash_attn_func(qc, qc, qc, causal=True)
    for b, s in ((1, 4096), (16, 1024)):
        qd = t((b, 1, 32, 128), torch.bfloat16)
        kc = t((b, s, 8, 128), torch.bfloat16)
        cs = torch.full((b,), s - 1, dtype=torch.int32)
        qdc, kcc, csc = c((b, 1, 32, 128), bf16), c((b, s, 8, 128), bf16), c((b,), np.int32)
        for caller, (qq, kk, cc_) in (("torch", (qd, kc, cs)), ("cupy", (qdc, kcc, csc))):
            out[f"decode b{b}x{s // 1024}k {caller} defaults"] = (
                lambda qq=qq, kk=kk, cc_=cc_: decode.flash_attn_with_kvcache(
                    qq, kk, kk, cache_seqlens=cc_))
            out[f"decode b{b}x{s // 1024}k {caller} validate=False"] = (
                lambda qq=qq, kk=kk, cc_=cc_: decode.flash_attn_with_kvcache(
                    qq, kk, kk, cache_seqlens=cc_, validate=False))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=100_000, help="calls per loop (launch)")
    ap.add_argument("--call-loops", type=int, default=20_000, help="calls per loop (calls)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    install_fakes()
    fake_kernel = type("K", (), {"kernel": type("F", (), {"ptr": 0x1234})})()
    from cupyflash.core import params
    pl = launch.Launch(fake_kernel, params.DecodeParams(), (4, 1, 8), (256, 1, 1),
                       pointers=(0, 10), shared_mem=1 << 16, pdl=True)
    ptrs = tuple(0x7000_0000_0000 + 256 * i for i in range(10))
    rows = [("Launch.__call__ (decode: 10 pointers)",
             per_call_us(lambda: pl(ptrs, STREAM), args.calls, args.repeats))]
    # the TMA prefill launch (non-causal: no counter) with new q/k/v pointers on every call,
    # as in a model (each call's tensors are new): the three tensor maps get the new addresses
    from cupyflash.core import tma
    maps = tuple(((64, 12, 256, 24), (64, 64 * 12, 64 * 12 * 256), (64, 1, 128, 1))
                 for _ in range(3))
    tl = launch.Launch(fake_kernel, params.FwdTmaParams(), (132, 1, 1), (384, 1, 1),
                       pointers=(params.FwdTmaParams.fwd.offset, 7), shared_mem=1 << 17,
                       prepare=tma.PrefillMaps(maps, causal=False, device_id=0))
    sets = [tuple(0x7000_0000_0000 + (1 << 24) * (3 * j + i) for i in range(5)) + (0, 0)
            for j in range(2)]
    turn = [0]

    def tma_call():
        turn[0] ^= 1
        tl(sets[turn[0]], STREAM)
    rows.append(("Launch.__call__ (TMA prefill: new q/k/v maps)",
                 per_call_us(tma_call, args.calls, args.repeats)))
    for name, f in cases().items():
        us = per_call_us(f, args.call_loops, args.repeats)
        ALLOCS[0] = 0
        f()
        rows.append((name, us, ALLOCS[0]))
    print(f"{'call':42s} {'us/call':>8s}  outputs allocated per call")
    for name, us, *n in rows:
        print(f"{name:42s} {us:8.2f}  {n[0] if n else ''}")


if __name__ == "__main__":
    main()
