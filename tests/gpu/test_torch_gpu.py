"""PyTorch callers on a GPU (issue 22): torch tensors in, torch tensors out, on torch's current
stream; the default decode call never synchronises; bad metadata raises before the launch
(host data) or through the device-side check (device arrays); a decode step captured in a
``torch.cuda.graph`` replays with new lengths and new cache contents.

Streams are checked by what a wrong one would break: a long kernel runs first on a side torch
stream, the real inputs are then written over NaN poison on that stream, the call follows and
its result is consumed on that stream. A launch on any other stream would run at once, read the
poison and leave NaN; a call that synchronised would find the side stream idle afterwards.

Run: ``python -m pytest -q -m gpu tests/gpu/test_torch_gpu.py``.
"""
import time

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_guard_records")]

import ml_dtypes  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import decode, reference  # noqa: E402
from cupyflash.core import guard

if not torch.cuda.is_available():  # CuPy may see a GPU that this torch build cannot use
    pytest.skip("torch without CUDA", allow_module_level=True)

EPS = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
NP = {torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16}
SLEEP_CYCLES = 200_000_000  # ~0.1 s at the H200's ~2 GHz: far longer than any call below




def _dev():
    return torch.device("cuda", torch.cuda.current_device())


def _randn(shape, dtype, seed):
    g = torch.Generator(device=_dev()).manual_seed(seed)
    return torch.randn(shape, generator=g, device=_dev(), dtype=torch.float32).to(dtype)


def _host(x, dtype):
    return x.float().cpu().numpy().astype(NP[dtype])


def _assert_close(out, lse, ref_out, ref_lse, dtype):
    """Output within 4 ulp of the dtype at the reference's scale (NaN poison fails), LSE within
    1e-4 relative (-inf exactly where the reference has it)."""
    o = out.double().cpu().numpy()
    assert not np.isnan(o).any(), "NaN in the output (poisoned inputs were read?)"
    err = np.abs(o - ref_out).max()
    assert err <= 4 * EPS[dtype] * max(np.abs(ref_out).max(), 1e-6), err
    if lse is not None:
        lh = lse.double().cpu().numpy()
        assert np.array_equal(np.isneginf(lh), np.isneginf(ref_lse))
        fin = np.isfinite(ref_lse)
        assert np.all(np.abs(lh[fin] - ref_lse[fin]) <= 1e-4 * (1 + np.abs(ref_lse[fin])))


def _late_inputs_on_a_side_stream(pairs, call):
    """On a new side stream: a long kernel, then the real inputs copied over the poison
    (``(dst, src)`` pairs), then ``call()``, whose results are cloned on that stream. Checks
    that the call returned while the stream was still busy (no synchronisation); returns
    ``(results, clones)`` once the stream is done."""
    side = torch.cuda.Stream(device=_dev())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)  # the long kernel
        for dst, src in pairs:
            dst.copy_(src)  # the real inputs arrive late, on this stream
        res = call()
        clones = tuple(r.clone() for r in res)  # consumed on this stream
        done = torch.cuda.Event()
        done.record()
    assert not done.query(), "the call synchronised (the side stream is already idle)"
    torch.cuda.synchronize()
    return res, clones


def _poisoned(*xs):
    return [torch.full_like(x, float("nan")) for x in xs]


def _to_cupy(x):
    """A CuPy view of a torch tensor, the same memory (bfloat16 through int16 bits, then viewed
    as ml_dtypes' bfloat16, CuPy's bf16)."""
    if x.dtype == torch.bfloat16:
        return cupy.from_dlpack(x.view(torch.int16)).view(ml_dtypes.bfloat16)
    return cupy.from_dlpack(x)


def _from_cupy(x):
    """A bfloat16 CuPy array as a torch tensor (through int16: the same bits)."""
    return torch.from_dlpack(x.view(cupy.int16)).view(torch.bfloat16)


_SPIN = None


def _cupy_sleep():
    """A long kernel on CuPy's current stream."""
    global _SPIN
    if _SPIN is None:
        _SPIN = cupy.RawKernel(r'''extern "C" __global__ void spin(long long cycles) {
            long long t0 = clock64(); while (clock64() - t0 < cycles) { } }''', "spin")
    _SPIN((1,), (1,), (np.int64(SLEEP_CYCLES),))


# ----------------------------------------------------------------------------------------------
# 1. Tensors in, tensors out, on torch's current stream
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_runs_on_torch_stream_and_returns_tensors(dtype):
    B, S, H, Hk, D = 2, 300, 8, 2, 128
    q_src = _randn((B, H, S, D), dtype, 1).transpose(1, 2)  # strided (B, S, H, D)
    k_src, v_src = _randn((B, S, Hk, D), dtype, 2), _randn((B, S, Hk, D), dtype, 3)
    q = torch.full((B, H, S, D), float("nan"), device=_dev(), dtype=dtype).transpose(1, 2)
    k, v = _poisoned(k_src, v_src)
    cupyflash.flash_attn_func(q, k, v, causal=True)  # compile and cache (result discarded)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(_dev())
    (out, lse), (res, res_lse) = _late_inputs_on_a_side_stream(
        ((q, q_src), (k, k_src), (v, v_src)),
        lambda: cupyflash.flash_attn_func(q, k, v, causal=True, return_lse=True))
    assert type(out) is torch.Tensor and type(lse) is torch.Tensor
    assert out.device == q.device and out.dtype == dtype and out.shape == q.shape
    assert out.is_contiguous() and lse.shape == (B, H, S) and lse.dtype == torch.float32
    # allocated by torch's caching allocator (CuPy's pool would not count here)
    assert torch.cuda.memory_allocated(_dev()) - before >= out.nbytes + lse.nbytes
    ref, ref_lse = reference.attention_reference(*(_host(x, dtype) for x in (q_src, k_src, v_src)),
                                                 causal=True)
    _assert_close(res, res_lse, ref, ref_lse, dtype)
    assert torch.equal(res, out)


@pytest.mark.parametrize("causal", [False, True])
def test_tma_maps_follow_new_tensors(causal):
    """Warm calls of the TMA kernel with new q/k/v tensors of one layout (each map encoded on
    the first call, then only its address replaced: cupyflash.core.tma) equal, bitwise, the same
    calls each made with a new launch-cache entry (every map encoded anew)."""
    from cupyflash.core import cache
    dtype = torch.bfloat16
    if torch.cuda.get_device_capability(_dev()) != (9, 0):
        pytest.skip("the TMA kernel runs on sm_90a")
    sets = [tuple(_randn(shape, dtype, 10 * i + j) for j, shape in
                  enumerate(((4, 1024, 8, 128), (4, 1024, 2, 128), (4, 1024, 2, 128))))
            for i in range(3)]
    assert cupyflash.explain(*sets[0], causal=causal).name.startswith("fwdtma")
    fresh = []
    for qkv in sets:
        cache.LAUNCH_CACHE.clear()
        fresh.append(cupyflash.flash_attn_func(*qkv, causal=causal, return_lse=True))
    cache.LAUNCH_CACHE.clear()
    warm = [cupyflash.flash_attn_func(*qkv, causal=causal, return_lse=True) for qkv in sets]
    warm.append(cupyflash.flash_attn_func(*sets[0], causal=causal, return_lse=True))
    fresh.append(fresh[0])
    torch.cuda.synchronize()
    for (o1, l1), (o2, l2) in zip(fresh, warm):
        assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert not torch.equal(fresh[0][0], fresh[1][0])  # the inputs differ


def test_varlen_runs_on_torch_stream():
    dtype = torch.bfloat16
    lens_q, lens_k = [100, 0, 37], [120, 5, 37]
    cq = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device=_dev())
    ck = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device=_dev())
    q_src = _randn((sum(lens_q), 8, 64), dtype, 4)
    k_src, v_src = _randn((sum(lens_k), 4, 64), dtype, 5), _randn((sum(lens_k), 4, 64), dtype, 6)
    q, k, v = _poisoned(q_src, k_src, v_src)
    call = dict(causal=True, return_lse=True, validate=False)
    cupyflash.flash_attn_varlen_func(q, k, v, cq, ck, 100, 120, **call)
    torch.cuda.synchronize()
    (out, lse), (res, res_lse) = _late_inputs_on_a_side_stream(
        ((q, q_src), (k, k_src), (v, v_src)),
        lambda: cupyflash.flash_attn_varlen_func(q, k, v, cq, ck, 100, 120, **call))
    assert type(out) is torch.Tensor and out.shape == q.shape and lse.shape == (8, sum(lens_q))
    ref, ref_lse = reference.varlen_attention_reference(
        *(_host(x, dtype) for x in (q_src, k_src, v_src)), cq.cpu().numpy(), ck.cpu().numpy(),
        100, 120, causal=True)
    _assert_close(res, res_lse, ref, ref_lse, dtype)


def test_warm_calls_allocate_only_the_outputs_asked_for():
    """Warm calls hold only what they return: prefill without return_lse allocates out alone
    (the kernel writes no LSE) and gives the result of a call with it; a decode call with
    several splits and no workspace allocates only out (partials and counters: the stream's
    scratch), and two calls give distinct tensors with the same values."""
    dtype = torch.float16
    q, k, v = (_randn((4, 256, 12, 32), dtype, s) for s in (91, 92, 93))
    ref, _ = cupyflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    cupyflash.flash_attn_func(q, k, v, causal=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(_dev())
    out = cupyflash.flash_attn_func(q, k, v, causal=True)
    assert torch.cuda.memory_allocated(_dev()) - before == -(-out.nbytes // 512) * 512
    assert torch.equal(out, ref)
    qd, kc, vc, cs, _ = _decode_case(False, seed=94)
    outs = [cupyflash.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=cs, num_splits=4)]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(_dev())
    outs.append(cupyflash.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=cs, num_splits=4))
    assert torch.cuda.memory_allocated(_dev()) - before == -(-outs[1].nbytes // 512) * 512
    torch.cuda.synchronize()
    assert outs[0].data_ptr() != outs[1].data_ptr() and torch.equal(outs[0], outs[1])
    _assert_close(outs[1], None, _decode_ref(qd, kc, vc, cs, None, torch.bfloat16).out, None,
                  torch.bfloat16)


def _decode_case(paged, seed=7, batch=4, cap=1024, hk=8, h=32, d=128, dtype=torch.bfloat16,
                 lens=(1000, 17, 513, 0), page=16):
    """Llama-3-8B heads: q (batch, 1, 32, 128), caches of 8 KV heads; paged: a shuffled pool."""
    q = _randn((batch, 1, h, d), dtype, seed)
    kc, vc = _randn((batch, cap, hk, d), dtype, seed + 1), _randn((batch, cap, hk, d), dtype,
                                                                    seed + 2)
    cs = torch.tensor(lens[:batch], dtype=torch.int32, device=_dev())
    bt = None
    if paged:
        pps = cap // page
        perm = torch.randperm(batch * pps, generator=torch.Generator().manual_seed(seed))
        bt = perm.reshape(batch, pps).to(torch.int32).to(_dev())
        pool_k = torch.empty((batch * pps, page, hk, d), dtype=dtype, device=_dev())
        pool_v = torch.empty_like(pool_k)
        pool_k[perm.to(_dev())] = kc.reshape(batch * pps, page, hk, d)
        pool_v[perm.to(_dev())] = vc.reshape(batch * pps, page, hk, d)
        kc, vc = pool_k, pool_v
    return q, kc, vc, cs, bt


def _decode_ref(q, kc, vc, cs, bt, dtype, k=None, v=None):
    return reference.kvcache_attention_reference(
        _host(q, dtype), _host(kc, dtype), _host(vc, dtype),
        None if k is None else _host(k, dtype), None if v is None else _host(v, dtype),
        cache_seqlens=cs.cpu().numpy(), block_table=None if bt is None else bt.cpu().numpy(),
        causal=True)


@pytest.mark.parametrize("paged", [False, True])
def test_decode_runs_on_torch_stream_with_defaults(paged):
    """Defaults (validate=True: the device-side check; no workspace: torch-allocated partials and
    the stream's counters) on a side stream behind a long kernel: no synchronisation, the
    reference's result, torch tensors out."""
    dtype = torch.bfloat16
    q_src, kc_src, vc_src, cs, bt = _decode_case(paged)
    q, kc, vc = _poisoned(q_src, kc_src, vc_src)
    cupyflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, block_table=bt)  # warm
    torch.cuda.synchronize()
    (out, lse), (res, res_lse) = _late_inputs_on_a_side_stream(
        ((q, q_src), (kc, kc_src), (vc, vc_src)),
        lambda: cupyflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, block_table=bt,
                                                 return_lse=True))
    assert type(out) is torch.Tensor and out.shape == q.shape and lse.shape == (4, 32, 1)
    ref = _decode_ref(q_src, kc_src, vc_src, cs, bt, dtype)
    _assert_close(res, res_lse, ref.out, ref.lse, dtype)
    guard.check_errors()  # the device-side check found nothing


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_merge_states_runs_on_torch_stream_and_returns_tensors(dtype):
    """merge_states of torch tensors behind a long kernel on a side stream: torch tensors out,
    no synchronisation, and the reference merge (empty parts with NaN outputs ignored)."""
    o_src = _randn((3, 2, 5, 8, 64), dtype, 101)
    lse_src = _randn((3, 2, 8, 5), torch.float32, 102)
    lse_src[1, 0] = float("-inf")  # an empty part: its output is never read
    o_src[1, 0] = float("nan")
    o, lse = _poisoned(o_src, lse_src)
    cupyflash.merge_states(o, lse)  # compile (result discarded)
    torch.cuda.synchronize()
    (out, lse_out), (res, res_lse) = _late_inputs_on_a_side_stream(
        ((o, o_src), (lse, lse_src)), lambda: cupyflash.merge_states(o, lse))
    assert type(out) is torch.Tensor and type(lse_out) is torch.Tensor
    assert out.shape == (2, 5, 8, 64) and out.dtype == dtype and lse_out.shape == (2, 8, 5)
    ref, ref_lse = reference.merge_states(o_src.double().cpu().numpy(),
                                          lse_src.double().cpu().numpy())
    tol = {torch.bfloat16: 2 * EPS[torch.bfloat16], torch.float32: 1e-5}[dtype]
    assert not torch.isnan(res).any()
    assert np.abs(res.double().cpu().numpy() - ref).max() <= tol * max(np.abs(ref).max(), 1)
    assert np.allclose(res_lse.double().cpu().numpy(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_merge_states_torch_equals_cupy_bitwise(dtype):
    """The torch launch (on torch's stream) and the CuPy one (on CuPy's stream)
    run one kernel on the same inputs: bitwise equal outputs and LSEs (a strided lse_parts,
    float64 LSEs converted by each caller)."""
    o = _randn((4, 2, 3, 6, 128), dtype, 201)
    lse = (_randn((4, 2, 3, 6), torch.float64, 202) * 30).transpose(2, 3)  # (4, 2, 6, 3)
    lse[2, 1] = float("-inf")
    out_t, lse_t = cupyflash.merge_states(o, lse)
    out_c, lse_c = cupyflash.merge_states(cupy.from_dlpack(o), cupy.from_dlpack(lse))
    torch.cuda.synchronize()
    assert type(out_c) is cupy.ndarray and type(out_t) is torch.Tensor
    assert torch.equal(out_t, torch.from_dlpack(out_c))
    assert torch.equal(lse_t, torch.from_dlpack(lse_c))


def test_cupy_callers_keep_cupy_conventions():
    """CuPy arrays in: CuPy arrays out, launched on CuPy's current stream (behind a long kernel
    on a non-blocking CuPy stream), for prefill and decode."""
    dtype = torch.bfloat16
    q_t, kc_t, vc_t, cs_t, _ = _decode_case(False, seed=21)
    srcs = [_to_cupy(x) for x in (q_t, kc_t, vc_t)]
    cs = _to_cupy(cs_t)
    q, kc, vc = (_to_cupy(torch.full_like(x, float("nan"))) for x in (q_t, kc_t, vc_t))
    s = cupy.cuda.Stream(non_blocking=True)
    with s:  # warm-up on this stream: CuPy's pool gets its first blocks for it (cudaMalloc, which
        # may synchronise), the per-stream counters are made and CuPy's copy kernels are loaded
        # (a module load may synchronise too); the calls below are warm ones
        for dst in (q, kc, vc):
            dst.view(cupy.int16)[...] = dst.view(cupy.int16)
        out = cupyflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs)
        pre = cupyflash.flash_attn_func(q, kc, vc)
        res, res_pre = (x.view(cupy.int16).copy() for x in (out, pre))
        del out, pre, res, res_pre
    cupy.cuda.Device().synchronize()
    with s:
        _cupy_sleep()
        for dst, src in zip((q, kc, vc), srcs):  # raw 16-bit copies on this stream
            dst.view(cupy.int16)[...] = src.view(cupy.int16)
        out = cupyflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs)
        pre = cupyflash.flash_attn_func(q, kc, vc)
        res, res_pre = (x.view(cupy.int16).copy() for x in (out, pre))
    assert not s.done, "a call synchronised"
    assert isinstance(out, cupy.ndarray) and isinstance(pre, cupy.ndarray)
    s.synchronize()
    as_bf16 = lambda x: torch.from_dlpack(x).view(torch.bfloat16)  # noqa: E731
    ref = _decode_ref(q_t, kc_t, vc_t, cs_t, None, dtype)
    _assert_close(as_bf16(res), None, ref.out, None, dtype)
    ref_pre, _ = reference.attention_reference(*(_host(x, dtype) for x in (q_t, kc_t, vc_t)))
    _assert_close(as_bf16(res_pre), None, ref_pre, None, dtype)


# ----------------------------------------------------------------------------------------------
# 3. No synchronisation; bad metadata still reported
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["torch", "cupy"])
@pytest.mark.parametrize("lengths", ["device", "int", "list"])
def test_default_decode_call_does_not_synchronise(kind, lengths):
    """20 default calls (validate=True) enqueued behind a 0.1 s kernel return while it still
    runs; the last result is the reference's."""
    dtype = torch.bfloat16
    q, kc, vc, cs, _ = _decode_case(False, seed=31, lens=(700, 700, 700, 700))
    lens = {"device": cs, "int": 700, "list": [700] * 4}[lengths]
    if kind == "cupy":
        q_, kc_, vc_ = (_to_cupy(x) for x in (q, kc, vc))
        lens = _to_cupy(cs) if lengths == "device" else lens
        stream_busy = lambda: not cupy.cuda.get_current_stream().done  # noqa: E731
        sleep = _cupy_sleep
    else:
        q_, kc_, vc_ = q, kc, vc
        stream_busy = lambda: not torch.cuda.current_stream().query()  # noqa: E731
        sleep = lambda: torch.cuda._sleep(SLEEP_CYCLES)  # noqa: E731
    cupyflash.flash_attn_with_kvcache(q_, kc_, vc_, cache_seqlens=lens)  # warm
    torch.cuda.synchronize()
    sleep()
    t0 = time.perf_counter()
    for _ in range(20):
        out = cupyflash.flash_attn_with_kvcache(q_, kc_, vc_, cache_seqlens=lens)
    host_s = time.perf_counter() - t0
    assert stream_busy(), f"a call synchronised ({host_s * 1e3:.1f} ms for 20 calls)"
    torch.cuda.synchronize()
    out_t = out if kind == "torch" else _from_cupy(out)
    ref = _decode_ref(q, kc, vc, cs, None, dtype)
    _assert_close(out_t, None, ref.out, None, dtype)


@pytest.mark.parametrize("kind", ["torch", "cupy"])
def test_bad_device_metadata_is_reported_without_a_synchronisation(kind):
    """Device lengths over the capacity, negative, and page ids outside the pool: the call
    returns (no read-back), check_errors() raises the host check's message, or the next call
    raises it once the check has run; reported once; the output has no NaN from outside."""
    conv = (lambda x: x) if kind == "torch" else _to_cupy
    q, kc, vc, cs, _ = _decode_case(False, seed=41)
    bad = cs.clone()
    bad[1] = 1024 + 7
    cupyflash.flash_attn_with_kvcache(*(conv(x) for x in (q, kc, vc)), cache_seqlens=conv(bad))
    with pytest.raises(guard.DeviceCheckError,
                       match=r"^cache_seqlens: cache_seqlens\[1\]=1031 \+ seqlen_new 0 exceeds "
                             r"the cache capacity 1024 \(k_cache dim 1\) \[found on the device"):
        cupyflash.check_errors()
    cupyflash.check_errors()  # reported once
    bad[1] = -3
    cupyflash.flash_attn_with_kvcache(*(conv(x) for x in (q, kc, vc)), cache_seqlens=conv(bad))
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"^cache_seqlens: must be >= 0, got "
                                         r"cache_seqlens\[1\]=-3"):  # the next call raises
        cupyflash.flash_attn_with_kvcache(*(conv(x) for x in (q, kc, vc)),
                                          cache_seqlens=conv(cs))
    # paged: an id outside the pool in a page that sequence 2 (513 tokens, 33 pages) uses
    q, kp, vp, cs, bt = _decode_case(True, seed=42)
    bad_bt = bt.clone()
    bad_bt[2, 32] = 10 ** 6
    bad_bt[2, 40] = -1  # not used by sequence 2: never reported
    out = cupyflash.flash_attn_with_kvcache(*(conv(x) for x in (q, kp, vp)),
                                            cache_seqlens=conv(cs), block_table=conv(bad_bt))
    with pytest.raises(ValueError, match=r"^block_table: page id block_table\[2, 32\]=1000000 is "
                                         r"outside the pool \[0, 256\) \(sequence 2 uses 33 "
                                         r"pages\)"):
        cupyflash.check_errors()
    out_t = out if kind == "torch" else _from_cupy(out)
    assert not torch.isnan(out_t).any()  # rows of bad pages are zero-filled, never read
    good = cupyflash.flash_attn_with_kvcache(*(conv(x) for x in (q, kp, vp)),
                                             cache_seqlens=conv(cs), block_table=conv(bt))
    torch.cuda.synchronize()
    good_t = good if kind == "torch" else _from_cupy(good)
    assert torch.equal(good_t[[0, 1, 3]], out_t[[0, 1, 3]])  # the other sequences are exact


@pytest.mark.parametrize("num_splits", [1, 3])
def test_bad_device_metadata_with_new_tokens_is_reported_by_the_append_check(num_splits):
    """With new tokens the append kernel checks the metadata (the split kernel does not check
    again): a page id outside the pool, a negative length and a length that the new tokens
    push over the capacity, each reported once by check_errors() with the host check's
    message; with valid metadata nothing is reported."""
    q, kp, vp, cs, bt = _decode_case(True, seed=45)
    kn, vn = _randn((4, 2, 8, 128), torch.bfloat16, 46), _randn((4, 2, 8, 128), torch.bfloat16, 47)

    def call(lens, table):
        return cupyflash.flash_attn_with_kvcache(q, kp.clone(), vp.clone(), kn, vn,
                                                 cache_seqlens=lens, block_table=table,
                                                 num_splits=num_splits)
    call(cs, bt)
    cupyflash.check_errors()  # valid: nothing found
    bad_bt = bt.clone()
    bad_bt[2, 32] = 10 ** 6  # sequence 2: 513 + 2 tokens, 33 pages
    call(cs, bad_bt)
    with pytest.raises(guard.DeviceCheckError,
                       match=r"^block_table: page id block_table\[2, 32\]=1000000 is outside "
                             r"the pool \[0, 256\) \(sequence 2 uses 33 pages\) \[found"):
        cupyflash.check_errors()
    cupyflash.check_errors()  # reported once
    for i, value, match in ((1, -4, r"^cache_seqlens: must be >= 0, got cache_seqlens\[1\]=-4"),
                            (3, 1023, r"^cache_seqlens: cache_seqlens\[3\]=1023 \+ seqlen_new 2 "
                                      r"exceeds the cache capacity 1024 \(max_pages_per_seq")):
        bad = cs.clone()
        bad[i] = value
        call(bad, bt)
        with pytest.raises(guard.DeviceCheckError, match=match):
            cupyflash.check_errors()


def test_bad_host_metadata_raises_before_the_launch():
    q, kc, vc, cs, bt = _decode_case(True, seed=51)
    out = torch.full_like(q, float("nan"))
    for lengths, match in ((2000, r"cache_seqlens\[0\]=2000 \+ seqlen_new 0 exceeds"),
                           ([5, 6, -1, 0], r"must be >= 0, got cache_seqlens\[2\]=-1"),
                           (np.array([5, 6, 2000, 0], np.int32), r"cache_seqlens\[2\]=2000")):
        with pytest.raises(ValueError, match=match):
            cupyflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, block_table=bt,
                                              out=out)
    bad = bt.cpu().numpy()
    bad[0, 0] = -5
    with pytest.raises(ValueError, match=r"block_table\[0, 0\]=-5 is outside the pool"):
        cupyflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs.cpu().numpy(),
                                          block_table=bad, out=out)
    torch.cuda.synchronize()
    assert torch.isnan(out).all()  # nothing was launched
    res = cupyflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs.tolist(),
                                            block_table=bt.cpu().numpy(), out=out)
    assert res is out
    torch.cuda.synchronize()
    ref = _decode_ref(q, kc, vc, cs, bt, torch.bfloat16)
    _assert_close(out, None, ref.out, None, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# 4. A decode step in a torch CUDA graph
# ----------------------------------------------------------------------------------------------
def _compile_prefill_case(dtype, seeds) -> tuple:
    """``(q, k, v, qv, kv, cu_seqlens)``: batch 2 x 200, 8 query and 2 KV heads (GQA), hd128,
    and the same tokens packed as two varlen sequences of 150 and 250."""
    q, k, v = (_randn((2, 200, 8, 128), dtype, s) for s in seeds)
    k, v = k[:, :, :2].contiguous(), v[:, :, :2].contiguous()
    cq = torch.tensor([0, 150, 400], dtype=torch.int32, device=_dev())
    return q, k, v, q.reshape(400, 8, 128), k.reshape(400, 2, 128), cq


def test_compile_fullgraph_gives_the_eager_result():
    """torch.compile(fullgraph=True) (inductor) of functions calling the custom ops: prefill,
    varlen, and a decode step that appends a token and writes into out with a workspace: no
    graph break, and bitwise the eager result (outputs, LSE, the appended caches)."""
    from torch._dynamo.utils import counters

    from cupyflash import torch_ops
    torch._dynamo.reset()
    counters.clear()
    dtype = torch.bfloat16
    q, k, v, qv, kv, cq = _compile_prefill_case(dtype, (81, 82, 83))

    def prefill(q, k, v, qv, kv, cq):
        o, lse = torch_ops.flash_attn_func(q, k, v, causal=True, return_lse=True)
        ov, lv = torch_ops.flash_attn_varlen_func(qv, kv, kv, cq, cq, 250, 250, causal=True,
                                                  return_lse=True, validate=False)
        return o, lse, ov, lv
    eager = prefill(q, k, v, qv, kv, cq)
    compiled = torch.compile(prefill, fullgraph=True)(q, k, v, qv, kv, cq)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)

    qd, kc, vc, cs, bt = _decode_case(True, seed=84)
    k_new, v_new = _randn((4, 1, 8, 128), dtype, 85), _randn((4, 1, 8, 128), dtype, 86)
    n = decode.workspace_size(qd, kc, vc, k_new, v_new, cs, bt)

    def step(qd, kc, vc, k_new, v_new, cs, bt, out, ws):
        o, lse = torch_ops.flash_attn_with_kvcache(qd, kc, vc, k_new, v_new, cache_seqlens=cs,
                                                   block_table=bt, out=out, workspace=ws,
                                                   return_lse=True)
        return o * 1, lse
    res = []
    for f in (step, torch.compile(step, fullgraph=True)):
        kc_i, vc_i = kc.clone(), vc.clone()
        out = torch.empty_like(qd)
        ws = torch.zeros(max(n, 1), dtype=torch.float32, device=_dev())
        o, lse = f(qd, kc_i, vc_i, k_new, v_new, cs, bt, out, ws)
        torch.cuda.synchronize()
        res.append((o, lse, kc_i, vc_i, out))
    for a, b in zip(*res):
        assert torch.equal(a, b)
    assert torch.equal(res[0][0], res[0][4])  # out was written
    ref = _decode_ref(qd, kc, vc, cs, bt, dtype, k_new, v_new)
    _assert_close(res[1][0], res[1][1], ref.out, ref.lse, dtype)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_compile_fullgraph_of_the_plain_calls_gives_the_eager_result():
    """torch.compile(fullgraph=True) (inductor) of a function calling cupyflash.flash_attn_func
    and cupyflash.flash_attn_varlen_func themselves (traced as the custom operators): no graph
    break, bitwise the eager result (outputs, LSEs, out= written)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    dtype = torch.bfloat16
    q, k, v, qv, kv, cq = _compile_prefill_case(dtype, (91, 92, 93))

    def prefill(q, k, v, qv, kv, cq, out):
        o, lse = cupyflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
        o2 = cupyflash.flash_attn_func(q, k, v, window_size=(64, 0), out=out)
        ov, lv = cupyflash.flash_attn_varlen_func(qv, kv, kv, cq, cq, 250, 250, causal=True,
                                                  return_lse=True, validate=False)
        return o * 1, lse, o2 * 1, ov, lv
    outs = [torch.empty_like(q) for _ in range(2)]
    eager = prefill(q, k, v, qv, kv, cq, outs[0])
    compiled = torch.compile(prefill, fullgraph=True)(q, k, v, qv, kv, cq, outs[1])
    torch.cuda.synchronize()
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], compiled[2])
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("via", ["call", "op"])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_step_captured_in_a_torch_cuda_graph(paged, via):
    """One decode step (append the new token's k, v; attend) with a preallocated workspace and
    out, called directly or through the custom op, captured by torch.cuda.graph with the
    default validate=True (its device-side check is captured too); replayed with new lengths,
    new cache contents and new tokens: each replay's output and cache equal the reference's. A
    replay with a length over the capacity is reported by check_errors()."""
    dtype = torch.bfloat16
    q, kc, vc, cs, bt = _decode_case(paged, seed=61, lens=(1000, 17, 513, 0))
    k_new, v_new = _randn((4, 1, 8, 128), dtype, 62), _randn((4, 1, 8, 128), dtype, 63)
    n = decode.workspace_size(q, kc, vc, k_new, v_new, cs, bt)
    ws = torch.zeros(max(n, 1), dtype=torch.float32, device=_dev())
    out = torch.empty_like(q)

    if via == "op":  # the custom operator (cupyflash.torch_ops)
        from cupyflash.torch_ops import flash_attn_with_kvcache as call
    else:
        call = cupyflash.flash_attn_with_kvcache

    def step():
        return call(q, kc, vc, k_new, v_new, cache_seqlens=cs, block_table=bt, out=out,
                    workspace=ws)
    side = torch.cuda.Stream(device=_dev())
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm up: compile, plan, cache
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert step() is out
    rng = np.random.default_rng(64)
    for rnd in range(3):
        lens = [int(x) for x in rng.integers(0, 1023, 4)]
        cs.copy_(torch.tensor(lens, dtype=torch.int32))
        for x, seed in ((q, 70), (kc, 71), (vc, 72), (k_new, 73), (v_new, 74)):
            x.copy_(_randn(x.shape, dtype, seed + 10 * rnd))
        if paged:
            perm = torch.randperm(bt.numel(), generator=torch.Generator().manual_seed(rnd))
            bt.copy_(perm.reshape(bt.shape).to(torch.int32))
        torch.cuda.synchronize()
        ref = _decode_ref(q, kc, vc, cs, bt, dtype, k_new, v_new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_close(out, None, ref.out, None, dtype)
        assert np.array_equal(_host(kc, dtype).view(np.uint16), ref.k_cache.view(np.uint16))
        assert np.array_equal(_host(vc, dtype).view(np.uint16), ref.v_cache.view(np.uint16))
    cupyflash.check_errors()  # the captured checks found nothing
    cs[2] = 1024  # + 1 new token: over the capacity
    graph.replay()
    with pytest.raises(ValueError, match=r"^cache_seqlens: cache_seqlens\[2\]=1024 \+ seqlen_new "
                                         r"1 exceeds the cache capacity 1024"):
        cupyflash.check_errors()


@pytest.mark.parametrize("warm_stream", ["other", "capturing"])
def test_causal_tma_prefill_captured_in_a_torch_cuda_graph(warm_stream):
    """A causal prefill on the Hopper TMA kernel (its scheduler needs a zeroed counter per
    stream: cupyflash.core.tma.tile_counter) captured by torch.cuda.graph, warmed up on another
    stream (the capture then gets a counter of its own) or on the capturing stream itself
    (it uses that stream's); replayed with new q/k/v contents, each replay equals, bitwise, the
    eager call on the same inputs, and every counter is left 0."""
    from cupyflash.core import tma
    dtype = torch.bfloat16
    if torch.cuda.get_device_capability(_dev()) != (9, 0):
        pytest.skip("the TMA kernel runs on sm_90a")
    q, k, v = (_randn(shape, dtype, 80 + j) for j, shape in
               enumerate(((2, 1100, 8, 128), (2, 1100, 2, 128), (2, 1100, 2, 128))))
    assert cupyflash.explain(q, k, v, causal=True).name.startswith("fwdtma")
    out = torch.empty_like(q)
    capture = torch.cuda.Stream(device=_dev())
    warm = capture if warm_stream == "capturing" else torch.cuda.Stream(device=_dev())
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        cupyflash.flash_attn_func(q, k, v, causal=True, out=out)  # compile, plan, cache
    torch.cuda.synchronize()
    n_captured = len(tma._CAPTURED)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        cupyflash.flash_attn_func(q, k, v, causal=True, out=out)
    assert len(tma._CAPTURED) == n_captured + (warm_stream == "other")
    for rnd in range(3):
        for x, seed in ((q, 90), (k, 91), (v, 92)):
            x.copy_(_randn(x.shape, dtype, seed + 10 * rnd))
        want = cupyflash.flash_attn_func(q, k, v, causal=True)
        torch.cuda.synchronize()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"replay {rnd}"
    for arr in list(tma._COUNTERS.values()) + tma._CAPTURED:
        assert int(arr.get()[0]) == 0


# ----------------------------------------------------------------------------------------------
# 5. A real client: Hugging Face transformers
# ----------------------------------------------------------------------------------------------
def test_hf_llama_generate_with_cupyflash_matches_sdpa(monkeypatch):
    """A small Llama-style decoder built from a config (random weights, no download), bf16:
    generate() with attn_implementation="cupyfa" runs cupyflash for prefill and for every decode
    step; its per-step logits, and a plain forward's, are as close to the float32 model's as
    SDPA's bf16 logits are (within 2x SDPA's error plus 2 bf16 ulp of the logits' scale)."""
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from transformers import LlamaConfig

    import cupyflash.hf
    name = cupyflash.hf.register()
    calls = {"prefill": 0, "decode": 0}
    ops = cupyflash.hf.torch_ops

    def counted(kind, f):
        def g(*a, **k):
            calls[kind] += 1
            return f(*a, **k)
        return g
    monkeypatch.setattr(cupyflash.hf, "torch_ops", SimpleNamespace(
        flash_attn_func=counted("prefill", ops.flash_attn_func),
        flash_attn_with_kvcache=counted("decode", ops.flash_attn_with_kvcache)))
    cfg = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024,
                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=512)  # head_dim 64, GQA 4
    from hf_models import same_weight_models
    models = same_weight_models(cfg, name)  # eval mode
    ids = torch.randint(0, 1024, (3, 64), device=_dev(),
                        generator=torch.Generator(device=_dev()).manual_seed(1))
    with torch.no_grad():
        g = models["ours"].generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0,
                                    return_dict_in_generate=True, output_logits=True)
        assert calls["prefill"] > 0 and calls["decode"] >= 2 * 15, (  # 2 layers x 15 steps
                calls, models["ours"].config._attn_implementation)
        seq = g.sequences
        fp32 = models["fp32"](seq).logits.float()
        sdpa = models["sdpa"](seq).logits.float()
        ours_fwd = models["ours"](seq).logits.float()  # a plain forward: prefill only
    scale = fp32.abs().max().item()

    def check(ours, pos):
        err = (ours.float() - fp32[:, pos]).abs().max().item()
        err_sdpa = (sdpa[:, pos] - fp32[:, pos]).abs().max().item()
        assert err <= 2 * err_sdpa + 2 * EPS[torch.bfloat16] * scale, (pos, err, err_sdpa)
    for step, logits in enumerate(g.logits):  # step 0: prefill; then one decode step each
        check(logits, 63 + step)
    check(ours_fwd, slice(None))
