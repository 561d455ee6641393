"""PyTorch callers on the CPU: what a call reads of torch tensors, what it allocates, which
pointers and stream it hands the launches, the warm path (no imports, no interface dicts, no
DLPack), the decode call's host checks and device-side check records, without a GPU.

CPU tensors play CUDA tensors of device 0 (:func:`fake_cuda`): the device test, the allocator,
the stream and the driver launches are replaced, everything else (checks, planning, launch cache,
argument building) is the library's. ``tests/gpu/test_torch_gpu.py`` runs the same paths on a
GPU.
"""
import builtins
import ctypes
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cupyflash import api, decode  # noqa: E402
from cupyflash.forward import run  # noqa: E402
from cupyflash.core import jit  # noqa: E402
from cupyflash.core import checks, guard, interop, launch
from cupyflash.decode import plan as decode_plan
from cupyflash.forward import dispatch
from cupyflash.core import planning
from cupyflash.core import cache

STREAM = 0x5EA  # the fake torch stream handle every launch must get
CLAIM, RECORD = 0xC1A1, 0xEC0D  # the fake device addresses of the check's claim word and record


class _Launch:
    """Stands in for launch.Launch: records (kernel name, pdl, pointers, stream, check),
    check: a decode kernel's (constant) claim and record pointers of the device check (0, 0: no
    check); None for other kernels."""

    def __init__(self, log, kernel, params, grid, block, *, pointers, shared_mem=0, pdl=False,
                 prepare=None):
        self.log, self.name, self.pdl, self.grid = log, kernel.name, pdl, tuple(grid)
        self.count = pointers[1]
        self.check = ((params.check_claim, params.check_record)
                      if hasattr(params, "check_claim") else None)

    def __call__(self, pointers, stream):
        assert len(pointers) == self.count
        self.log.append((self.name, self.pdl, tuple(int(p) for p in pointers), stream,
                         self.check))


@pytest.fixture
def fake_cuda(monkeypatch):
    """CPU torch tensors as CUDA tensors of device 0 on stream STREAM; returns the launch log."""
    log = []
    tc = interop.TorchCaller
    monkeypatch.setattr(tc, "device", staticmethod(
        lambda a: 0 if a.device.type == "cpu" else -1))
    orig = interop.is_device_array

    def is_dev(x):
        return isinstance(x, torch.Tensor) or orig(x)
    for mod, name in ((run, "is_device_array"), (checks, "_is_device"),
                      (checks, "is_device_array"), (decode, "is_device_array")):
        monkeypatch.setattr(mod, name, is_dev)
    interop._torch()  # the dtype tables
    monkeypatch.setattr(tc, "empty", staticmethod(
        lambda shape, dt, dev: torch.empty(tuple(shape), dtype=interop._TORCH_DTYPES[dt])))
    monkeypatch.setattr(tc, "full", staticmethod(
        lambda shape, value, dt, dev: torch.full(tuple(shape), value,
                                                 dtype=interop._TORCH_DTYPES[dt])))
    monkeypatch.setattr(tc, "from_host", staticmethod(
        lambda values, dt, dev: torch.from_numpy(np.array(values, interop.np_dtype(dt)))))
    monkeypatch.setattr(tc, "stream", staticmethod(lambda dev: STREAM))
    monkeypatch.setattr(interop, "current_device", lambda: 0)
    monkeypatch.setattr(cache, "LAUNCH_CACHE", {})
    monkeypatch.setattr(planning, "_device_info", lambda dev: ("sm_90a", 132, 227 * 1024))
    monkeypatch.setattr(dispatch, "launch_plan", lambda p: dispatch._launch_plan_cached(p, 0))
    dispatch._launch_plan_cached.cache_clear()
    monkeypatch.setattr(jit, "get_kernel", lambda spec, *a: spec)
    monkeypatch.setattr(launch, "Launch", lambda *a, **k: _Launch(log, *a, **k))
    monkeypatch.setattr(decode, "_resolve_plan",
                        lambda prob, ss: decode_plan._resolve_plan(prob, ss, use_device=False))
    monkeypatch.setattr(decode, "_compute_capability", lambda: 90)
    monkeypatch.setattr(decode, "_is_capturing", lambda stream: False)
    monkeypatch.setattr(decode, "_TORCH_COUNTERS", {})
    monkeypatch.setattr(guard, "device_pointers", lambda dev: (CLAIM, RECORD))
    monkeypatch.setattr(guard, "_record", None)
    yield log
    dispatch._launch_plan_cached.cache_clear()


def _t(shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


class _Counter:
    def __init__(self, f):
        self.f, self.n = f, 0

    def __call__(self, *a, **k):
        self.n += 1
        return self.f(*a, **k)


# ----------------------------------------------------------------------------------------------
# Reading tensors
# ----------------------------------------------------------------------------------------------
def test_describe_torch_reads_pointer_layout_and_dtype():
    base = _t((2, 8, 5, 64))
    x = base.transpose(1, 2)[:, 1:]  # (2, 4, 8, 64), strided, with a storage offset
    d = interop.describe_torch(x)
    assert d.data.ptr == d.data_ptr() == x.data_ptr() != base.data_ptr()
    assert d.shape == (2, 4, 8, 64) and d.ndim == 4
    assert d.strides == tuple(2 * s for s in x.stride())  # bytes, as CuPy/NumPy give them
    assert d.dtype == interop.np_dtype("bfloat16") and d.itemsize == 2
    assert d.size == x.numel() and not d.flags.c_contiguous
    assert interop.describe_torch(base).flags.c_contiguous
    for dt, name in ((torch.float16, "float16"), (torch.float32, "float32"),
                     (torch.float64, "float64"), (torch.int32, "int32")):
        assert interop.torch_dtype_name(dt) == name == checks.dtype_name(torch.zeros(1, dtype=dt))


def test_caller_kind_and_device_test():
    a, b = _t((1, 2)), _t((1, 2))
    assert interop.caller_of(a, b, None) is interop.TorchCaller
    assert interop.caller_of(a, np.zeros(2)) is interop.CupyCaller  # mixed kinds: CuPy's
    assert interop.caller_of(np.zeros(2), a) is interop.CupyCaller
    assert not interop.is_device_array(a)  # a CPU tensor (answered without the interface)
    assert cache.torch_key(("dense:torch",), (a, None, b), torch.Tensor) == (
        "dense:torch", a.shape, a.stride(), a.dtype, torch.device("cpu"), None, b.shape,
        b.stride(), b.dtype, b.device)
    assert cache.torch_key(("dense:torch",), (a, np.zeros(2)), torch.Tensor) is None


def test_host_tensors_still_go_to_the_reference_paths():
    q = _t((1, 16, 4, 64))
    with pytest.raises(TypeError, match=r"^q: expected a CUDA array .*attention_reference"):
        api.flash_attn_func(q, q, q)
    assert api.explain(q, q, q, causal=True).name.endswith("_causal")


# ----------------------------------------------------------------------------------------------
# Prefill
# ----------------------------------------------------------------------------------------------
def test_prefill_torch_in_torch_out_on_torch_stream(fake_cuda, monkeypatch):
    """Tensors in: tensors out (allocated by the caller's allocator, contiguous), the launch gets
    their data_ptr()s and torch's stream; the second call is a launch-cache hit without checks."""
    q = _t((2, 4, 33, 64), seed=1).transpose(1, 2)  # (2, 33, 4, 64), strided
    k, v = _t((2, 40, 2, 64), seed=2), _t((2, 40, 2, 64), seed=3)
    spy = _Counter(checks.check_attention)
    monkeypatch.setattr(checks, "check_attention", spy)
    for i in range(3):
        out, lse = api.flash_attn_func(q, k, v, causal=True, return_lse=True)
        assert type(out) is torch.Tensor and type(lse) is torch.Tensor
        assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.is_contiguous()
        assert lse.shape == (2, 4, 33) and lse.dtype == torch.float32
        name, pdl, ptrs, stream, _ = fake_cuda[-1]
        assert ptrs == (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                        lse.data_ptr(), 0, 0)
        assert stream == STREAM and pdl is False and name.endswith("_causal")
    assert spy.n == 1 and len(fake_cuda) == 3
    (key,) = cache.LAUNCH_CACHE
    assert key[0] == "dense:torch"
    o2 = torch.empty_like(q)
    assert api.flash_attn_func(q, k, v, causal=True, out=o2) is o2  # out= is returned itself
    assert fake_cuda[-1][2][3] == o2.data_ptr()


def test_prefill_torch_warm_path_misses_on_any_key_field_and_revalidates(fake_cuda,
                                                                          monkeypatch):
    """After a call is cached, the same tensors with other strides, another dtype, an out, or a
    tensor on another device miss the entry: the full checks run again (and plan anew, or
    raise before any launch); options of other types than the cached ones' raise as before."""
    q, k = _t((2, 16, 4, 64)), _t((2, 16, 2, 64))
    spy = _Counter(checks.check_attention)
    monkeypatch.setattr(checks, "check_attention", spy)
    for _ in range(2):
        api.flash_attn_func(q, k, k, causal=True)
    assert spy.n == 1 and len(fake_cuda) == 2
    k_t = _t((2, 2, 16, 64)).transpose(1, 2)  # k's shape, other strides
    half = [x.half() for x in (q, k)]
    for args, kw in (((q, k_t, k), {}), ((*half, half[1]), {}), ((q, k, k), {"out": q.clone()}),
                     ((q, k, k), {"window_size": (8, 0)}), ((q, k, k), {"softmax_scale": 0.5})):
        n = spy.n
        for _ in range(2):  # missed, then its own entry
            api.flash_attn_func(*args, causal=True, **kw)
        assert spy.n == n + 1
    assert fake_cuda[-1][2][:3] == (q.data_ptr(), k.data_ptr(), k.data_ptr())
    n = len(fake_cuda)
    meta = torch.empty(tuple(k.shape), dtype=k.dtype, device="meta")  # not device 0 (fake_cuda)
    for kwargs, args, exc, match in (
            ({"causal": 1}, (q, k, k), TypeError, "^causal"),
            ({"causal": True, "return_lse": 1}, (q, k, k), TypeError, "^return_lse"),
            ({"causal": True, "softmax_scale": -1.0}, (q, k, k), ValueError, "^softmax_scale"),
            ({"causal": True, "window_size": (-2, 0)}, (q, k, k), ValueError, "^window_size"),
            ({"causal": True, "out": q.float()}, (q, k, k), TypeError, "^out: dtype"),
            ({"causal": True}, (q, meta, k), ValueError, r"^k: on CUDA device -1, but q is on "
                                                         r"device 0")):
        with pytest.raises(exc, match=match):
            api.flash_attn_func(*args, **kwargs)
    assert len(fake_cuda) == n


def test_decode_torch_warm_path_misses_on_any_key_field_and_revalidates(fake_cuda,
                                                                         monkeypatch):
    """The decode call's warm path: other cache strides, another dtype, host lengths, a tensor
    on another device, or other options miss the entry and run the full checks (which raise
    before any launch where the input is bad)."""
    q, kc, cs, _ = _decode_args()
    spy = _Counter(checks.check_kvcache)
    monkeypatch.setattr(checks, "check_kvcache", spy)
    for _ in range(2):
        decode.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=cs)
    assert spy.n == 1
    kc_t = _t((3, 2, 256, 128)).transpose(1, 2)  # kc's shape, other strides
    for args, kw in (((q, kc_t, kc), {}), ((q.half(), kc.half(), kc.half()), {}),
                     ((q, kc, kc), {"cache_seqlens": [5, 200, 0]}),
                     ((q, kc, kc), {"num_splits": 2}), ((q, kc, kc), {"return_lse": True})):
        kw = {"cache_seqlens": cs, **kw}
        n = spy.n
        for _ in range(2):
            decode.flash_attn_with_kvcache(*args, **kw)
        assert spy.n == n + (1 if type(kw["cache_seqlens"]) is torch.Tensor else 2)
    n = len(fake_cuda)
    meta = torch.empty(tuple(kc.shape), dtype=kc.dtype, device="meta")
    with pytest.raises(ValueError, match=r"^v_cache: on CUDA device -1, but q is on device 0"):
        decode.flash_attn_with_kvcache(q, kc, meta, cache_seqlens=cs)
    with pytest.raises(ValueError, match=r"^cache_seqlens: must be >= 0"):
        decode.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=[5, -1, 0])
    with pytest.raises(TypeError, match=r"^causal"):
        decode.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=cs, causal=1)
    assert len(fake_cuda) == n


def test_prefill_varlen_torch(fake_cuda, monkeypatch):
    """validate=False varlen calls of torch tensors: tensors out, the seven pointers; the second
    call is a launch-cache hit (no checks)."""
    q, k = _t((40, 4, 64), seed=4), _t((50, 2, 64), seed=5)
    cq = torch.tensor([0, 10, 40], dtype=torch.int32)
    ck = torch.tensor([0, 20, 50], dtype=torch.int32)
    spy = _Counter(checks.check_varlen)
    monkeypatch.setattr(checks, "check_varlen", spy)
    for _ in range(2):
        out, lse = api.flash_attn_varlen_func(q, k, k, cq, ck, 30, 30, return_lse=True,
                                              validate=False)
        assert type(out) is torch.Tensor and out.shape == q.shape and lse.shape == (4, 40)
        assert fake_cuda[-1][2] == (q.data_ptr(), k.data_ptr(), k.data_ptr(), out.data_ptr(),
                                    lse.data_ptr(), cq.data_ptr(), ck.data_ptr())
    assert len(cache.LAUNCH_CACHE) == 1 and spy.n == 1


def test_prefill_torch_errors_are_the_checks(fake_cuda):
    q, k = _t((1, 8, 4, 64)), _t((1, 8, 3, 64))
    with pytest.raises(ValueError, match=r"^k: nheads_k 3"):
        api.flash_attn_func(q, k, k)
    with pytest.raises(TypeError, match=r"^k: dtype float16 must match q dtype bfloat16"):
        api.flash_attn_func(q, q.half(), q)
    assert fake_cuda == []


def test_warm_calls_allocate_only_the_outputs_asked_for(fake_cuda, monkeypatch):
    """Per warm call: prefill allocates out, and the LSE only with return_lse (else the kernel
    gets NULL); nothing with out= given. Decode with several splits and no workspace allocates
    only out: its partials and counters come from the stream's scratch, the same addresses every
    call; the LSE only with return_lse. Consecutive calls return distinct tensors."""
    allocs = []
    orig, orig_like = interop.TorchCaller.empty, interop.TorchCaller.empty_like

    def counting(shape, dt, dev):
        allocs.append((tuple(shape), dt))
        return orig(shape, dt, dev)

    def counting_like(a):
        allocs.append((tuple(a.shape), interop.torch_dtype_name(a.dtype)))
        return orig_like(a)
    monkeypatch.setattr(interop.TorchCaller, "empty", staticmethod(counting))
    monkeypatch.setattr(interop.TorchCaller, "empty_like", staticmethod(counting_like))
    q, k = _t((2, 16, 4, 64)), _t((2, 16, 2, 64))
    api.flash_attn_func(q, k, k, causal=True)  # cold
    del allocs[:]
    o1 = api.flash_attn_func(q, k, k, causal=True)
    o2 = api.flash_attn_func(q, k, k, causal=True)
    assert allocs == [(tuple(q.shape), "bfloat16")] * 2
    assert o1.data_ptr() != o2.data_ptr() and fake_cuda[-1][2][4] == 0  # no LSE pointer
    del allocs[:]
    o, lse = api.flash_attn_func(q, k, k, causal=True, return_lse=True)
    assert [a[1] for a in allocs] == ["bfloat16", "float32"] and lse.shape == (2, 4, 16)
    assert fake_cuda[-1][2][4] == lse.data_ptr()
    del allocs[:]
    assert api.flash_attn_func(q, k, k, causal=True, out=o1) is o1 and allocs == []
    assert fake_cuda[-1][2][3:5] == (o1.data_ptr(), 0)

    qd, kc, cs, _ = _decode_args()
    decode.flash_attn_with_kvcache(qd, kc, kc, cache_seqlens=cs, num_splits=4)  # cold
    scratch = fake_cuda[-1][2][7:]
    del allocs[:]
    outs = [decode.flash_attn_with_kvcache(qd, kc, kc, cache_seqlens=cs, num_splits=4)
            for _ in range(2)]
    assert allocs == [(tuple(qd.shape), "bfloat16")] * 2
    assert outs[0].data_ptr() != outs[1].data_ptr()
    ws, lse_part, counters = fake_cuda[-1][2][7:]
    assert (ws, lse_part, counters) == scratch and fake_cuda[-1][2][6] == 0  # no LSE
    assert lse_part > ws and counters not in (0, ws)
    del allocs[:]
    _, lse = decode.flash_attn_with_kvcache(qd, kc, kc, cache_seqlens=cs, num_splits=4,
                                            return_lse=True)
    assert [a[1] for a in allocs] == ["bfloat16", "float32"] and fake_cuda[-1][2][6] == lse.data_ptr()


@pytest.mark.parametrize("q_kind", ["contiguous", "transposed", "size-1 dim strided"])
def test_outputs_are_c_contiguous_whatever_q(fake_cuda, monkeypatch, q_kind):
    """out (prefill and decode, warm and cold) has q's shape and dtype and C-contiguous strides
    (those the kernel is built for); torch.empty_like(q) serves only a q with exactly those
    strides (it keeps a dense q's strides), torch.empty the others."""
    likes = []
    orig_like = interop.TorchCaller.empty_like
    monkeypatch.setattr(interop.TorchCaller, "empty_like",
                        staticmethod(lambda a: likes.append(1) or orig_like(a)))

    def contiguous_strides(shape):
        return torch.empty(shape).stride()
    if q_kind == "contiguous":
        q, qd = _t((2, 16, 4, 64)), _t((3, 1, 8, 128))
    elif q_kind == "transposed":
        q, qd = _t((2, 4, 16, 64)).transpose(1, 2), _t((3, 8, 1, 128)).transpose(1, 2)
    else:  # torch calls these contiguous (a dim of one), yet their strides are not C's
        q, qd = _t((1, 32, 4, 64))[:, 16:], _t((1, 5, 8, 128))[:, 4:]
        assert q.is_contiguous() and q.stride() != contiguous_strides(q.shape)
    k, (_, kc, cs, _) = _t((q.shape[0], 16, 2, 64)), _decode_args(batch=qd.shape[0])
    for _ in range(2):
        o = api.flash_attn_func(q, k, k, causal=True)
        od = decode.flash_attn_with_kvcache(qd, kc, kc, cache_seqlens=cs)
        for x, ref in ((o, q), (od, qd)):
            assert x.shape == ref.shape and x.dtype == ref.dtype
            assert x.stride() == contiguous_strides(ref.shape)
    assert len(likes) == (4 if q_kind == "contiguous" else 0)


class _NoImports:
    """Counts import statements executed (builtins.__import__) while active."""

    def __enter__(self):
        self.n, self.names, self._orig = 0, [], builtins.__import__

        def counting(name, *a, **k):
            self.n += 1
            self.names.append(name)
            return self._orig(name, *a, **k)
        builtins.__import__ = counting
        return self

    def __exit__(self, *exc):
        builtins.__import__ = self._orig


def _forbid_interfaces(monkeypatch):
    def boom(self, *a, **k):
        raise AssertionError("the warm path read an interface (DLPack / __cuda_array_interface__)")
    monkeypatch.setattr(torch.Tensor, "__dlpack__", boom)
    monkeypatch.setattr(torch.Tensor, "__dlpack_device__", boom)
    monkeypatch.setattr(torch.Tensor, "__cuda_array_interface__", property(boom))


def test_warm_paths_import_nothing_and_read_no_interfaces(fake_cuda, monkeypatch):
    q, k = _t((2, 16, 4, 64)), _t((2, 16, 2, 64))
    qd, kc = _t((3, 1, 8, 128)), _t((3, 256, 2, 128))
    cs = torch.tensor([5, 200, 0], dtype=torch.int32)
    ws = torch.zeros(1 << 16, dtype=torch.float32)
    calls = [lambda: api.flash_attn_func(q, k, k, causal=True),
             lambda: decode.flash_attn_with_kvcache(qd, kc, kc, cache_seqlens=cs),
             lambda: decode.flash_attn_with_kvcache(qd, kc, kc, cache_seqlens=cs, num_splits=4,
                                                    workspace=ws, validate=False)]
    for call in calls:
        call()  # cold: checks, plan, cache
    _forbid_interfaces(monkeypatch)
    monkeypatch.setattr(checks, "to_host", lambda *a: pytest.fail("a host read"))
    n = len(fake_cuda)
    with _NoImports() as imports:
        for call in calls:
            call()
    assert imports.n == 0, imports.names
    assert len(fake_cuda) > n


# ----------------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------------
def _decode_args(paged=False, batch=3, cap=256):
    q = _t((batch, 1, 8, 128), seed=7)
    kc = _t((batch, cap, 2, 128), seed=8)
    cs = torch.tensor([5, 200, 0][:batch], dtype=torch.int32)
    bt = None
    if paged:
        kc = kc.reshape(batch * cap // 16, 16, 2, 128)
        bt = torch.arange(batch * cap // 16, dtype=torch.int32).reshape(batch, cap // 16)
    return q, kc, cs, bt


@pytest.mark.parametrize("paged", [False, True])
def test_decode_default_call_checks_on_the_device_without_a_host_read(fake_cuda, monkeypatch,
                                                                       paged):
    """validate=True (default) with device lengths: one launch, the split kernel, programmatic
    dependent, on torch's stream, given the check's claim and record pointers (it checks the
    lengths and page ids it reads: no check kernel); never a host read; torch tensors out.
    validate=False passes NULL for both."""
    q, kc, cs, bt = _decode_args(paged)
    monkeypatch.setattr(checks, "to_host", lambda *a: pytest.fail("a host read"))
    spy = _Counter(checks.check_kvcache)
    monkeypatch.setattr(checks, "check_kvcache", spy)
    for i in range(2):
        n = len(fake_cuda)
        out = decode.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=cs, block_table=bt,
                                             num_splits=1)
        assert type(out) is torch.Tensor and out.shape == q.shape and out.dtype == q.dtype
        assert len(fake_cuda) == n + 1
        sname, spdl, sptrs, sstream, scheck = fake_cuda[-1]
        assert sname.startswith("decode_split") and spdl is True and sstream == STREAM
        assert sptrs[:6] == (q.data_ptr(), kc.data_ptr(), kc.data_ptr(), cs.data_ptr(),
                             bt.data_ptr() if paged else 0, out.data_ptr())
        assert scheck == (CLAIM, RECORD)
    assert spy.n == 1  # the second call: the warm path
    decode.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=cs, block_table=bt, num_splits=1,
                                   validate=False)
    assert fake_cuda[-1][4] == (0, 0)  # no check
    with decode.pdl_launches(False):
        decode.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=cs, block_table=bt,
                                       num_splits=1)
    assert fake_cuda[-1][1] is False and fake_cuda[-1][4] == (CLAIM, RECORD)  # a plain launch


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("validate", [True, False])
def test_decode_with_new_tokens_the_append_kernel_checks(fake_cuda, paged, validate):
    """With new tokens the append kernel runs first and is the one that checks (it reads the
    lengths and page ids first); the split kernel after it does not check again."""
    q, kc, cs, bt = _decode_args(paged)
    kn = _t((3, 1, 2, 128), seed=9)
    for _ in range(2):  # cold, then warm
        del fake_cuda[:]
        decode.flash_attn_with_kvcache(q, kc, kc, kn, kn, cache_seqlens=cs, block_table=bt,
                                       num_splits=2, validate=validate)
        (aname, _, aptrs, astream, acheck), (sname, _, _, _, scheck) = fake_cuda
        assert aname.startswith("decode_append") and sname.startswith("decode_split")
        assert aptrs[4:] == (cs.data_ptr(), bt.data_ptr() if paged else 0)
        assert acheck == ((CLAIM, RECORD) if validate else (0, 0)) and scheck == (0, 0)


def test_decode_q_alignment_is_part_of_what_a_hit_proves(fake_cuda):
    """A q of the same layout but 2 bytes off a 16-byte boundary must not reuse the entry built
    for an aligned q (its kernel copies Q by 16 bytes): the call re-plans (2-byte Q loads) and
    that entry replaces the first; an aligned q may use it (the same result)."""
    q, kc, cs, _ = _decode_args()
    buf = torch.empty(q.numel() + 8, dtype=q.dtype)
    base = 8 - (buf.data_ptr() % 16) // 2  # elements to the next 16-byte boundary, + 8
    aligned = buf[base % 8:base % 8 + q.numel()].view(q.shape)
    off = buf[base % 8 + 1:base % 8 + 1 + q.numel()].view(q.shape)
    assert aligned.data_ptr() % 16 == 0 and off.data_ptr() % 16 == 2
    seen = []
    orig = decode._KVCacheLaunch.__init__

    def spy(self, prob, *a, **k):
        seen.append(prob.q_aligned16)
        orig(self, prob, *a, **k)
    decode._KVCacheLaunch.__init__ = spy
    try:
        for x in (aligned, off, off, aligned, aligned):
            decode.flash_attn_with_kvcache(x, kc, kc, cache_seqlens=cs, num_splits=1)
    finally:
        decode._KVCacheLaunch.__init__ = orig
    assert seen == [True, False]  # then every call hits the entry of the 2-byte loads


def test_decode_warm_call_with_unaligned_cache_or_workspace_raises(fake_cuda):
    """A cache or a workspace of a cached layout but 2 bytes off a 16-byte boundary is refused
    by the warm path (a hit does not prove pointers) and the full checks raise, naming it;
    nothing is launched."""
    q, kc, cs, _ = _decode_args()
    hq, hk = np.zeros(tuple(q.shape), np.float16), np.zeros(tuple(kc.shape), np.float16)
    need = decode.workspace_size(hq, hk, hk, cache_seqlens=cs.numpy(), num_splits=4)
    ws = torch.zeros(need + 8, dtype=torch.float32)
    ws = ws[(-ws.data_ptr() % 16) // 4:][:need]
    decode.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=cs, num_splits=4, workspace=ws)
    buf = torch.empty(kc.numel() + 16, dtype=kc.dtype)
    start = (-buf.data_ptr() % 16) // 2 + 1  # 2 bytes past a 16-byte boundary
    off = buf[start:start + kc.numel()].view(kc.shape)
    ws_off = torch.zeros(need + 8, dtype=torch.float32)
    ws_off = ws_off[(-ws_off.data_ptr() % 16) // 4 + 1:][:need]  # 4 bytes past
    n = len(fake_cuda)
    with pytest.raises(ValueError, match=r"^k_cache: rows must be 16-byte aligned"):
        decode.flash_attn_with_kvcache(q, off, kc, cache_seqlens=cs, num_splits=4, workspace=ws)
    with pytest.raises(ValueError, match=r"^workspace: must start on a 16-byte boundary"):
        decode.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=cs, num_splits=4,
                                       workspace=ws_off)
    assert len(fake_cuda) == n


def test_decode_workspace_and_lse_pointers(fake_cuda):
    q, kc, cs, _ = _decode_args()
    hq, hk = np.zeros(tuple(q.shape), np.float16), np.zeros(tuple(kc.shape), np.float16)
    need = decode.workspace_size(hq, hk, hk, cache_seqlens=cs.numpy(), num_splits=4)
    ws = torch.zeros(need, dtype=torch.float32)
    out = torch.empty_like(q)
    o, lse = decode.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=cs, num_splits=4, out=out,
                                            workspace=ws, return_lse=True, validate=False)
    assert o is out and lse.shape == (3, 8, 1)
    ptrs = fake_cuda[-1][2]
    assert ptrs[5:8] == (out.data_ptr(), lse.data_ptr(), ws.data_ptr())
    assert ptrs[9] > ptrs[8] > ws.data_ptr()  # the partial LSE, then the counters, in ws
    with pytest.raises(ValueError, match="workspace: expected a contiguous float32 array"):
        decode.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=cs, num_splits=4,
                                       workspace=ws[: need // 2])
    with pytest.raises(TypeError, match="workspace: expected float32"):
        decode.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=cs, num_splits=4,
                                       workspace=ws.double())


@pytest.mark.parametrize("lengths", [37, [37, 37, 37], (37, 37, 37), np.full(3, 37, np.int32),
                                     torch.full((3,), 37, dtype=torch.int32).numpy()])
def test_decode_host_lengths_are_checked_on_the_host_and_copied(fake_cuda, lengths):
    """FlashAttention's forms of cache_seqlens (an int, a list) and host arrays: checked on the
    host (no device check), copied to the device as int32 (batch,)."""
    q, kc, _, _ = _decode_args()
    out = decode.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lengths, num_splits=1)
    assert type(out) is torch.Tensor
    ((name, _, ptrs, _, check),) = fake_cuda
    assert name.startswith("decode_split") and check == (0, 0)  # checked: no device check


@pytest.mark.parametrize("lengths,match", [
    (10 ** 6, r"^cache_seqlens: cache_seqlens\[0\]=1000000 \+ seqlen_new 0 exceeds the cache "
              r"capacity 256 \(k_cache dim 1\)$"),
    ([1, -3, 2], r"^cache_seqlens: must be >= 0, got cache_seqlens\[1\]=-3$"),
    ([1, 2], r"^cache_seqlens: expected shape \(3,\)"),
    ([1, 2.5, 3], r"^cache_seqlens: expected an integer array, an int or a list of ints"),
])
def test_decode_bad_host_lengths_raise_before_any_launch(fake_cuda, lengths, match):
    q, kc, _, _ = _decode_args()
    with pytest.raises((ValueError, TypeError), match=match):
        decode.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lengths)
    assert fake_cuda == []


def test_decode_bad_host_page_ids_raise_before_any_launch(fake_cuda):
    q, kc, cs, bt = _decode_args(paged=True)
    bad = bt.numpy().copy()
    bad[1, 3] = 10 ** 6
    with pytest.raises(ValueError, match=r"^block_table: page id block_table\[1, 3\]=1000000 is "
                                         r"outside the pool \[0, 48\) \(sequence 1 uses 13 "
                                         r"pages\)$"):
        decode.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=cs.numpy(), block_table=bad)
    assert fake_cuda == []
    # device lengths beside host page ids: which ids are used depends on the lengths, so both
    # are checked on the device (the ids once copied there)
    decode.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=cs, block_table=bad)
    ((name, _, ptrs, _, check),) = fake_cuda
    assert name.startswith("decode_split") and check == (CLAIM, RECORD)
    assert ptrs[3] == cs.data_ptr() and ptrs[4] not in (0, bt.data_ptr())  # the ids' copy


def test_merge_states_torch_in_torch_out_on_torch_stream(fake_cuda, monkeypatch):
    """merge_states of torch tensors: torch tensors out (shapes, dtypes), the combine kernel
    launched plainly on torch's stream with the float32 inputs' and the outputs' pointers
    (float32 o_parts used in place; float64 LSEs converted; a strided float32 lse_parts read
    in place); a strided head dim and lse_parts on another device are refused before any
    launch."""
    o = _t((3, 2, 5, 4, 64), torch.float32, seed=11)
    lse = torch.randn(3, 2, 4, 5, dtype=torch.float64)
    out, lse_out = decode.merge_states(o, lse)
    assert type(out) is torch.Tensor and type(lse_out) is torch.Tensor
    assert out.shape == (2, 5, 4, 64) and out.dtype == torch.float32
    assert lse_out.shape == (2, 4, 5) and lse_out.dtype == torch.float32
    ((name, pdl, ptrs, stream, _),) = fake_cuda
    assert name == "decode_combine_fp32" and pdl is False and stream == STREAM
    assert ptrs[0] == o.data_ptr() and ptrs[1] != lse.data_ptr()  # the float32 copy of lse
    assert ptrs[2:] == (out.data_ptr(), lse_out.data_ptr())
    out16, _ = decode.merge_states(o.to(torch.bfloat16), lse.float())
    assert out16.dtype == torch.bfloat16 and fake_cuda[-1][0] == "decode_combine_bf16"
    assert fake_cuda[-1][2][2] == out16.data_ptr()
    lse_t = torch.randn(3, 2, 5, 4, dtype=torch.float32).transpose(2, 3)  # any LSE strides
    decode.merge_states(o, lse_t)
    assert fake_cuda[-1][2][1] == lse_t.data_ptr()  # float32: read in place, strided
    n = len(fake_cuda)
    strided = _t((3, 2, 5, 4, 128), torch.bfloat16, seed=12)[..., ::2]  # head-dim stride 2
    with pytest.raises(ValueError, match=r"^o_parts: last dimension must be contiguous"):
        decode.merge_states(strided, lse)
    monkeypatch.setattr(interop.TorchCaller, "device", staticmethod(lambda a: int(a is lse)))
    with pytest.raises(ValueError, match=r"^lse_parts: on CUDA device 1, but o_parts is on "
                                         r"device 0"):
        decode.merge_states(o, lse)
    assert len(fake_cuda) == n


def test_merge_states_launch_struct(monkeypatch):
    """The combine kernel's launch (the same for torch tensors and CuPy arrays): its struct holds
    each array's element strides (a strided lse too) and the sizes; a call passes the four
    pointers and the caller's stream, plainly (no PDL)."""
    seen = {}

    class Prep:
        def __init__(self, kern, params, grid, block, *, pointers, **kw):
            seen["launch"] = (params, grid, block, pointers, kw)

        def __call__(self, ptrs, stream):
            seen["call"] = (ptrs, stream)
    monkeypatch.setattr(jit, "get_kernel", lambda spec, *a: spec)
    monkeypatch.setattr(launch, "Launch", Prep)
    o = np.zeros((3, 2, 5, 4, 64), np.float32)
    lse = np.zeros((3, 2, 5, 4), np.float32).transpose(0, 1, 3, 2)  # (3, 2, 4, 5), strided
    out = np.zeros((2, 5, 4, 64), np.float32)
    lse_out = np.zeros((2, 4, 5), np.float32)
    descs = [interop.ArrayDesc(1000 * (i + 1), a.shape, [st // 4 for st in a.strides],
                               "float32", 0) for i, a in enumerate((o, lse, out, lse_out))]
    decode._launch_combine(*descs, 77)
    prm, grid, block, pointers, kw = seen["launch"]
    assert (grid, block, kw) == ((10, 1, 1), (128, 1, 1), {})  # 40 rows, 4 per block
    assert pointers == (0, 4)
    assert [prm.op_part_stride, prm.op_batch_stride, prm.op_row_stride, prm.op_head_stride] == \
        [2 * 5 * 4 * 64, 5 * 4 * 64, 4 * 64, 64]
    assert [prm.lp_part_stride, prm.lp_batch_stride, prm.lp_head_stride, prm.lp_row_stride] == \
        [40, 20, 1, 4]
    assert [prm.o_batch_stride, prm.o_row_stride, prm.o_head_stride, prm.lse_batch_stride,
            prm.lse_head_stride] == [5 * 4 * 64, 4 * 64, 64, 20, 5]
    assert [prm.num_parts, prm.batch, prm.seqlen, prm.nheads, prm.headdim] == [3, 2, 5, 4, 64]
    assert seen["call"] == ((1000, 2000, 3000, 4000), 77)


# ----------------------------------------------------------------------------------------------
# The device-side check's record (cupyflash.core.guard), surfaced without a synchronisation
# ----------------------------------------------------------------------------------------------
def _record(monkeypatch, *fields):
    rec = (ctypes.c_int32 * guard._RECORD_INTS)()
    for i, x in enumerate(fields):
        rec[i] = x
    monkeypatch.setattr(guard, "_record", rec)
    return rec


@pytest.mark.parametrize("fields,match", [
    ((1, 2, -1, -7, 0, 256, 0, 0, 0),
     r"^cache_seqlens: must be >= 0, got cache_seqlens\[2\]=-7 \[found on the device"),
    ((2, 0, -1, 300, 1, 256, 0, 0, 0),
     r"^cache_seqlens: cache_seqlens\[0\]=300 \+ seqlen_new 1 exceeds the cache capacity 256 "
     r"\(k_cache dim 1\) \[found on the device"),
    ((2, 0, -1, 300, 0, 256, 16, 0, 1), r"\(max_pages_per_seq \* page_size\) \[found"),
    ((3, 1, 4, 99, 0, 256, 48, 13, 1),
     r"^block_table: page id block_table\[1, 4\]=99 is outside the pool \[0, 48\) \(sequence 1 "
     r"uses 13 pages\) \[found on the device by the check of an earlier flash_attn_with_kvcache"),
])
def test_device_check_record_is_raised_by_the_next_call(fake_cuda, monkeypatch, fields, match):
    q, kc, cs, _ = _decode_args()
    decode.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=cs)  # warm
    n = len(fake_cuda)
    rec = _record(monkeypatch, *fields)
    assert guard.pending()
    with pytest.raises(guard.DeviceCheckError, match=match) as e:
        decode.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=cs)
    assert isinstance(e.value, ValueError)
    assert len(fake_cuda) == n  # raised before anything was launched
    assert list(rec) == [0] * guard._RECORD_INTS and not guard.pending()  # reported once
    decode.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=cs)
    assert len(fake_cuda) == n + 1


def test_check_errors_raises_and_clears(monkeypatch):
    monkeypatch.setattr(guard, "_record", None)
    guard.check_errors(synchronize=False)  # nothing recorded: nothing raised
    _record(monkeypatch, 2, 1, -1, 70, 0, 64, 0, 0, 0)
    import cupyflash
    with pytest.raises(ValueError, match=r"^cache_seqlens: cache_seqlens\[1\]=70 "):
        cupyflash.check_errors(synchronize=False)
    cupyflash.check_errors(synchronize=False)


def test_device_check_record_layout_matches_the_host_decoder():
    """The device check (kernels_cu/common/kvcache_check.cuh) writes the record fields and codes
    that guard.raise_pending decodes, the code last after a system-scope fence; both decode
    kernels call it (their compiles, no spills: tests/test_decode.py)."""
    src = (jit.kernels_dir() / "common" / "kvcache_check.cuh").read_text()
    fields = dict((n, int(v)) for n, v in re.findall(r"\b(kCheck\w+) = (\d+)", src))
    order = ("Code", "Batch", "Column", "Value", "SeqlenNew", "Capacity", "NumPages",
             "UsedPages", "Paged")  # raise_pending's unpacking order
    assert [fields["kCheck" + n] for n in order] == list(range(9))
    assert guard._RECORD_INTS >= 9
    assert (fields["kCheckNegative"], fields["kCheckOverCapacity"], fields["kCheckBadPage"]) == \
        (guard._NEGATIVE, guard._OVER_CAPACITY, guard._BAD_PAGE)
    for n in order[1:]:
        assert f"r[kCheck{n}] = " in src
    assert src.rindex("__threadfence_system") > src.index("r[kCheckCode] = code") > \
        src.index("__threadfence_system")
    for cu in ("decode/split.cu", "decode/append.cu"):
        text = (jit.kernels_dir() / cu).read_text()
        assert '#include "common/kvcache_check.cuh"' in text and "check_kvcache_sequence(" in text


# ----------------------------------------------------------------------------------------------
# torch.library custom ops (cupyflash.torch_ops): fake implementations, no graph breaks
# ----------------------------------------------------------------------------------------------
def test_custom_ops_match_their_fake_implementations(fake_cuda):
    """torch.library.opcheck: schema (declared mutations) and fake (meta) outputs against the
    real ones, for the three operators (AOT dispatch compares output values: the GPU tests; the
    fake launches here write nothing)."""
    from cupyflash import torch_ops  # noqa: F401 (registers the operators)
    utils = ("test_schema", "test_faketensor")
    q, k = _t((2, 16, 4, 64)), _t((2, 16, 2, 64))
    torch.library.opcheck(torch.ops.cupyflash.flash_attn.default, (q, k, k, None, True, -1, -1),
                          test_utils=utils)
    qv, kv = _t((40, 4, 64)), _t((50, 2, 64))
    cq = torch.tensor([0, 10, 40], dtype=torch.int32)
    ck = torch.tensor([0, 20, 50], dtype=torch.int32)
    torch.library.opcheck(torch.ops.cupyflash.flash_attn_varlen.default,
                          (qv, kv, kv, cq, ck, 30, 30, 0.125, False, -1, -1, False),
                          test_utils=utils)
    qd, kc, cs, _ = _decode_args()
    torch.library.opcheck(torch.ops.cupyflash.flash_attn_with_kvcache.default,
                          (qd, kc, kc.clone(), None, None, cs, None, torch.empty_like(qd), None,
                           None, True, 1, None, True), test_utils=utils)


def test_compile_fullgraph_traces_the_ops(fake_cuda):
    """torch.compile(fullgraph=True) of functions calling the operators (prefill, varlen, a
    decode step with out and workspace): no graph break, the outputs' shapes and dtypes, and the
    compiled code launches the kernels (the launch log grows)."""
    from cupyflash import torch_ops
    torch._dynamo.reset()
    q, k = _t((2, 16, 4, 64)), _t((2, 16, 2, 64))
    qv, kv = _t((40, 4, 64)), _t((50, 2, 64))
    cq = torch.tensor([0, 10, 40], dtype=torch.int32)
    ck = torch.tensor([0, 20, 50], dtype=torch.int32)
    qd, kc, cs, _ = _decode_args()
    ws = torch.zeros(1 << 16, dtype=torch.float32)
    out = torch.empty_like(qd)

    def prefill(q, k, cq, ck):
        o, lse = torch_ops.flash_attn_func(q, k, k, causal=True, return_lse=True)
        ov = torch_ops.flash_attn_varlen_func(qv, kv, kv, cq, ck, 30, 30, validate=False)
        return o * 2, lse, ov

    def step(qd, kc, cs):
        o = torch_ops.flash_attn_with_kvcache(qd, kc, kc, cache_seqlens=cs, out=out,
                                              workspace=ws, num_splits=4)
        return o + 1

    def step_int(qd, kc):
        return torch_ops.flash_attn_with_kvcache(qd, kc, kc, cache_seqlens=37) + 1
    for f, args in ((prefill, (q, k, cq, ck)), (step, (qd, kc, cs)), (step_int, (qd, kc))):
        n = len(fake_cuda)
        res = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
        eager = f(*args)
        res, eager = (r if isinstance(r, tuple) else (r,) for r in (res, eager))
        assert [(x.shape, x.dtype) for x in res] == [(x.shape, x.dtype) for x in eager]
        assert len(fake_cuda) > n
    assert res[0].shape == qd.shape


def test_compile_fullgraph_of_the_plain_calls_routes_to_the_ops(fake_cuda):
    """torch.compile(fullgraph=True) of a function calling cupyflash.flash_attn_func and
    cupyflash.flash_attn_varlen_func themselves: traced as the custom operators (one graph, no
    break, the operators in it; Dynamo never sees the CuPy/NumPy path), the compiled code runs
    the real call (the launch log grows); eager calls do not route (no operator)."""
    import cupyflash
    torch._dynamo.reset()
    q, k = _t((2, 16, 4, 64)), _t((2, 16, 2, 64))
    qv, kv = _t((40, 4, 64)), _t((50, 2, 64))
    cq = torch.tensor([0, 10, 40], dtype=torch.int32)
    ck = torch.tensor([0, 20, 50], dtype=torch.int32)

    def f(q, k, qv, kv, cq, ck):
        o, lse = cupyflash.flash_attn_func(q, k, k, causal=True, return_lse=True)
        ov = cupyflash.flash_attn_varlen_func(qv, kv, kv, cq, ck, 30, 30, softmax_scale=0.1,
                                              validate=False)
        return o * 2, lse, ov + 1
    args = (q, k, qv, kv, cq, ck)
    ex = torch._dynamo.explain(f)(*args)
    assert ex.graph_count == 1 and ex.graph_break_count == 0
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward
    torch._dynamo.reset()
    torch.compile(f, fullgraph=True, backend=capture)(*args)
    ((graph,),) = (graphs,)
    assert "target=torch.ops.cupyflash.flash_attn]" in graph
    assert "target=torch.ops.cupyflash.flash_attn_varlen]" in graph
    torch._dynamo.reset()
    n = len(fake_cuda)
    res = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    assert [x.shape for x in res] == [(2, 16, 4, 64), (2, 4, 16), (40, 4, 64)]
    assert [x.dtype for x in res] == [torch.bfloat16, torch.float32, torch.bfloat16]
    assert [name[:3] for name, *_ in fake_cuda[n:]] == ["fwd", "fwd"]  # the real calls ran
    n = len(fake_cuda)
    f(*args)  # eager: the library's call path (the same launches)
    assert len(fake_cuda) == n + 2 and not api._torch_compiling()


def test_compiled_plain_call_gives_the_eager_result(monkeypatch):
    """With the operator's real implementation replaced by a CPU stand-in (the float64
    reference), a function calling cupyflash.flash_attn_func compiled with fullgraph=True
    returns bitwise what the stand-in returns eagerly; out= is written and returned, and the
    LSE only comes back when asked for."""
    import types

    import cupyflash
    from cupyflash import reference, torch_ops

    def standin(q, k, v, softmax_scale, causal, window_size, return_lse, out):
        assert return_lse is True and out is None  # as the operator calls it
        o, lse = reference.attention_reference(*(x.double().numpy() for x in (q, k, v)),
                                               softmax_scale=softmax_scale, causal=causal,
                                               window_size=window_size)
        return torch.from_numpy(o).to(q.dtype), torch.from_numpy(lse).float()
    monkeypatch.setattr(torch_ops, "run", types.SimpleNamespace(flash_attn=standin))
    torch._dynamo.reset()
    q, k = _t((2, 16, 4, 64), torch.float16, 1), _t((2, 24, 2, 64), torch.float16, 2)
    out = torch.empty_like(q)

    def f(q, k):
        o, lse = cupyflash.flash_attn_func(q, k, k, causal=True, window_size=(8, 0),
                                           return_lse=True)
        o2 = cupyflash.flash_attn_func(q, k, k, softmax_scale=0.2, out=out)
        return o, lse, o2
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k)
    want = standin(q, k, k, None, True, (8, 0), True, None)
    want2 = standin(q, k, k, 0.2, False, (-1, -1), True, None)[0]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[2], want2) and torch.equal(out, want2)
