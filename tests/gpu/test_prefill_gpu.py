"""GPU tests of the tiled prefill kernels (``pytest -m gpu tests/gpu/test_prefill_gpu.py``).

Oracle: the float64 one-shot reference (:func:`cupyflash.reference.attention_reference`).

* float16 / bfloat16: max abs error <= 2 x that of a straightforward same-precision
  implementation on the same inputs, plus ``eps(dtype) * max|ref|`` (one ulp at the largest
  output). The same-precision implementation follows FlashAttention's own test reference
  (``attention_ref(upcast=False)``): ``q * softmax_scale`` rounded to the dtype; ``S = q k^T`` with
  float32 accumulation, rounded to the dtype; softmax in float32, ``P`` rounded to the dtype;
  ``O = P V`` with float32 accumulation, rounded to the dtype (what cuBLAS GEMMs in the dtype do).
  It runs in NumPy on the host.
* float32: normwise relative error <= 2 x the proven first-order bound of
  :func:`cupyflash.testing.streaming_error_bound` (float32, the kernel's key block size): a
  bound of the form ``eps32 * K`` with ``K`` stated there in units of float32 epsilon.
* float64: normwise relative error <= 1e-12.
* LSE (float32 for every dtype): ``-inf`` exactly where the reference has ``-inf``; elsewhere
  ``|lse - lse_ref| <= 2 * lse_bound + 2 * eps32 * (1 + |lse_ref|)`` (float32 streaming bound).

Every output buffer is filled with NaN before the launch and checked with ``isnan`` before any
difference is taken; padding around strided views is NaN and must stay NaN; every problem runs
twice and the two results must be bitwise equal. Hypothesis draws shapes (lengths 1..300 with
tile-edge values, GQA ratios, head dims 8..256, all dtypes, causal, windows, softmax scales,
memory layouts); ``max_examples`` is 60 under the ``ci`` profile (``HYPOTHESIS_PROFILE``).
"""
import math
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")  # tests/gpu/conftest.py skips these without a device

from cupyflash import io_model, reference, testing  # noqa: E402
from cupyflash.core import jit
from cupyflash.core.params import FwdTmaParams
from cupyflash.forward import kernels as prefill
from cupyflash.forward import dispatch
from cupyflash.api import flash_attn_func, flash_attn_varlen_func  # noqa: E402
from cupyflash.core.checks import check_attention  # noqa: E402
from cupyflash.testing import np_dtype  # noqa: E402
from profiles import examples  # noqa: E402 (tests/gpu/profiles.py)

DTYPES = ("float16", "bfloat16", "float32", "float64")
EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23, "float64": 2.0 ** -52}
EPS32 = EPS["float32"]
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_NAN_BITS = {"float16": 0x7E00, "bfloat16": 0x7FC0, "float32": 0x7FC00000,
             "float64": 0x7FF8000000000000}



@pytest.fixture(autouse=True, scope="module")
def _warm(precompiled):
    """Compile every specialisation first (tests/gpu/conftest.py), so examples time kernels."""
    yield


# ----------------------------------------------------------------------------------------------
# Host <-> device with exact bits (16-bit types move as raw uint16)
# ----------------------------------------------------------------------------------------------
def to_dev(x):
    x = np.ascontiguousarray(x)
    return cupy.asarray(x.view(_UINT[x.dtype.itemsize])).view(x.dtype)


def to_host(x):
    """Host copy of any (strided) device array; the copy kernel runs on unsigned integers."""
    u = cupy.ascontiguousarray(x.view(_UINT[x.dtype.itemsize]))
    return cupy.asnumpy(u).view(x.dtype)


def nan_buffer(shape, dtype):
    """A fresh device buffer of ``dtype`` whose every element is a quiet NaN."""
    dt = np_dtype(dtype)
    buf = cupy.empty(shape, dtype=dt)
    buf.view(_UINT[dt.itemsize]).fill(_NAN_BITS[dtype])
    return buf


def placed(x, layout):
    """Device copy of host ``x`` (batch, seqlen, heads, d) in a memory ``layout``.

    ``contiguous``; ``heads_major`` (memory (batch, heads, seqlen, d), viewed transposed: head
    stride > row stride); ``padded`` (a view into a NaN-filled buffer 37 rows and 8 columns
    larger: NaN right after every row and after every sequence; returned with that buffer).
    """
    if layout == "contiguous":
        return to_dev(x), None
    if layout == "heads_major":
        return to_dev(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3), None
    b, s, h, d = x.shape
    buf = nan_buffer((b, s + 37, h, d + 8), x.dtype.name)
    view = buf[:, :s, :, :d]
    u = _UINT[x.dtype.itemsize]
    view.view(u)[...] = to_dev(x).view(u)  # integer copy: bits exact, no bfloat16 kernel needed
    return view, buf


def out_buffer(shape, dtype, layout):
    if layout == "padded":
        b, s, h, d = shape
        buf = nan_buffer((b, s + 37, h, d + 8), dtype)
        return buf[:, :s, :, :d], buf
    if layout == "heads_major":
        b, s, h, d = shape
        return nan_buffer((b, h, s, d), dtype).transpose(0, 2, 1, 3), None
    return nan_buffer(shape, dtype), None


def bits(x):
    x = np.ascontiguousarray(x)
    return x.view(_UINT[x.dtype.itemsize])


# ----------------------------------------------------------------------------------------------
# The same-precision implementation (FlashAttention's attention_ref(upcast=False)), on the host
# ----------------------------------------------------------------------------------------------
def _round(x, dtype):
    return x.astype(np_dtype(dtype)).astype(np.float32)


def same_precision_attention(q, k, v, *, softmax_scale, window_size, dtype):
    """(batch, seqlen_q, nheads, d) float32 array holding values of ``dtype``; see module doc."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    qs = _round(q.astype(np.float32) * np.float32(softmax_scale), dtype).transpose(0, 2, 1, 3)
    kh = np.repeat(k.astype(np.float32), g, axis=2).transpose(0, 2, 1, 3)  # (b, h, sk, d)
    vh = np.repeat(v.astype(np.float32), g, axis=2).transpose(0, 2, 1, 3)
    if sk == 0:
        return np.zeros((b, sq, h, d), np.float32)
    s = _round(qs @ kh.swapaxes(-1, -2), dtype)  # float32 GEMM (BLAS), output in the dtype
    vis = reference.attention_mask(sq, sk, window_size=window_size)
    s = np.where(vis, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0).astype(np.float32)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    p = _round(np.where(l > 0, p / np.where(l > 0, l, 1), 0.0).astype(np.float32), dtype)
    o = (p @ vh).transpose(0, 2, 1, 3)  # float32 GEMM, (b, sq, h, d)
    return _round(o, dtype)


# ----------------------------------------------------------------------------------------------
# The comparison every test uses
# ----------------------------------------------------------------------------------------------
def assert_matches_reference(out, lse, q, k, v, *, dtype, softmax_scale=None, causal=False,
                             window_size=(-1, -1), block_n=64, what=""):
    """``out`` (b, sq, h, d) and ``lse`` (b, h, sq) host arrays against the float64 reference."""
    out = np.asarray(out)
    lse = np.asarray(lse)
    assert not np.isnan(out.astype(np.float64)).any(), f"{what}: NaN in out (element not written?)"
    assert not np.isnan(lse).any(), f"{what}: NaN in lse"
    kw = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size)
    ref, lse_ref = reference.attention_reference(q, k, v, **kw)
    prob = check_attention(q, k, v, **kw)
    o64 = out.astype(np.float64)

    # LSE: -inf exactly where the reference row is empty; float32 streaming bound elsewhere.
    empty = np.isneginf(lse_ref)
    assert np.array_equal(np.isneginf(lse), empty), f"{what}: -inf LSE rows differ"
    assert (o64[np.transpose(empty, (0, 2, 1))] == 0).all(), f"{what}: empty rows not zero"
    out_bound, lse_bound = testing.streaming_error_bound(q, k, v, block_size_k=block_n,
                                                         dtype=np.float32, **kw)
    fin = ~empty
    lerr = np.abs(lse.astype(np.float64) - np.where(fin, lse_ref, 0.0))[fin]
    ltol = (2 * lse_bound + 2 * EPS32 * (1 + np.abs(np.where(fin, lse_ref, 0.0))))[fin]
    assert (lerr <= ltol).all(), (f"{what}: LSE error {lerr.max():.3g} above bound "
                                  f"(worst ratio {(lerr / ltol).max():.3g})")

    if dtype in ("float16", "bfloat16"):
        base = same_precision_attention(q, k, v, softmax_scale=prob.softmax_scale,
                                        window_size=prob.window_size, dtype=dtype)
        err = float(np.abs(o64 - ref).max(initial=0.0))
        err_base = float(np.abs(base.astype(np.float64) - ref).max(initial=0.0))
        atol = EPS[dtype] * float(np.abs(ref).max(initial=0.0))
        assert err <= 2 * err_base + atol, (f"{what}: max error {err:.3g} > 2 x same-precision "
                                            f"error {err_base:.3g} + {atol:.3g}")
    elif dtype == "float32":
        rel = testing.rel_error(o64, ref)
        assert rel <= 2 * out_bound, (f"{what}: float32 rel error {rel:.3g} = {rel / EPS32:.1f} "
                                      f"eps > 2 x bound = {2 * out_bound / EPS32:.1f} eps")
    else:
        rel = testing.rel_error(o64, ref)
        assert rel <= 1e-12, f"{what}: float64 rel error {rel:.3g} > 1e-12"


def block_n_of(q, k, v, **kw):
    return dispatch.launch_plan(check_attention(q, k, v, **kw)).kernel.template["block_n"]


def host_inputs(rng, b, sq, sk, h, hk, d, dtype, scale=1.0):
    return (testing.random_normal(rng, (b, sq, h, d), dtype, scale),
            testing.random_normal(rng, (b, sk, hk, d), dtype, scale),
            testing.random_normal(rng, (b, sk, hk, d), dtype, scale))


# ----------------------------------------------------------------------------------------------
# Dense: Hypothesis over shapes, dtypes, masks, layouts
# ----------------------------------------------------------------------------------------------
@st.composite
def dense_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    batch = draw(st.integers(1, 2))
    sq = draw(testing.seqlens(300, min_value=1))
    sk = draw(testing.seqlens(300, min_value=1))
    nheads, nheads_k = draw(testing.head_counts(max_nheads_k=2, max_group=4))
    d = draw(testing.headdims(256))
    causal = draw(st.booleans())
    window = draw(testing.window_sizes(max(sq, sk)))
    scale = draw(testing.softmax_scales())
    layout = draw(st.sampled_from(("contiguous", "heads_major", "padded")))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    return dict(dtype=dtype, batch=batch, sq=sq, sk=sk, nheads=nheads, nheads_k=nheads_k, d=d,
                causal=causal, window=window, scale=scale, layout=layout, seed=seed)


@settings(max_examples=examples(60))
@given(dense_cases())
def test_dense_matches_reference(case):
    c = case
    rng = np.random.default_rng(c["seed"])
    q, k, v = host_inputs(rng, c["batch"], c["sq"], c["sk"], c["nheads"], c["nheads_k"], c["d"],
                          c["dtype"])
    kw = dict(softmax_scale=c["scale"], causal=c["causal"], window_size=c["window"])
    qd, qbuf = placed(q, c["layout"])
    kd, kbuf = placed(k, c["layout"])
    vd, vbuf = placed(v, c["layout"])
    results = []
    for _ in range(2):  # two runs: bitwise equal
        out, obuf = out_buffer(q.shape, c["dtype"], c["layout"])
        res, lse = flash_attn_func(qd, kd, vd, return_lse=True, out=out, **kw)
        assert res is out, "the result must be the given out buffer"
        assert lse.dtype == prefill.lse_dtype(c["dtype"])
        assert lse.shape == (c["batch"], c["nheads"], c["sq"])
        if obuf is not None:  # nothing written outside the view (padding stays NaN)
            pad = to_host(obuf)
            assert np.isnan(pad[:, c["sq"]:].astype(np.float64)).all()
            assert np.isnan(pad[..., c["d"]:].astype(np.float64)).all()
        results.append((to_host(res), to_host(lse)))
    (o1, l1), (o2, l2) = results
    assert np.array_equal(bits(o1), bits(o2)) and np.array_equal(bits(l1), bits(l2)), \
        "two runs differ bitwise"
    for buf in (qbuf, kbuf, vbuf):  # inputs untouched
        if buf is not None:
            assert np.isnan(to_host(buf)[..., c["d"]:].astype(np.float64)).all()
    assert_matches_reference(o1, l1, q, k, v, dtype=c["dtype"],
                             block_n=block_n_of(q, k, v, **kw), what=str(c), **kw)


def test_dense_allocates_and_returns_cupy():
    rng = np.random.default_rng(1)
    q, k, v = host_inputs(rng, 2, 77, 130, 4, 2, 64, "bfloat16")
    out = flash_attn_func(to_dev(q), to_dev(k), to_dev(v), causal=True)
    assert isinstance(out, cupy.ndarray) and out.shape == q.shape and out.dtype == q.dtype
    out2, lse = flash_attn_func(to_dev(q), to_dev(k), to_dev(v), causal=True, return_lse=True)
    assert lse.shape == (2, 4, 77) and lse.dtype == np.float32
    assert np.array_equal(bits(to_host(out)), bits(to_host(out2)))
    assert_matches_reference(to_host(out2), to_host(lse), q, k, v, dtype="bfloat16", causal=True,
                             block_n=block_n_of(q, k, v, causal=True))


# ----------------------------------------------------------------------------------------------
# Every element written, LSE included (direct launch with NaN-poisoned out and lse)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (17, 5)),
                                           (True, (40, -1))])
def test_every_element_written_lse_too(dtype, causal, window):
    from cupyflash.core.interop import current_stream
    rng = np.random.default_rng(2)
    b, sq, sk, h, hk, d = 2, 131, 67, 4, 2, 72
    q, k, v = host_inputs(rng, b, sq, sk, h, hk, d, dtype)
    kw = dict(causal=causal, window_size=window)
    prob = check_attention(q, k, v, **kw)
    plan = dispatch.launch_plan(prob)
    out = nan_buffer(q.shape, dtype)
    lse = cupy.full((b, h, sq), np.nan, dtype=prefill.lse_dtype(dtype))
    prefill.launch(plan.kernel.spec, to_dev(q), to_dev(k), to_dev(v), out, lse, problem=prob,
                   stream=current_stream())
    assert_matches_reference(to_host(out), to_host(lse), q, k, v, dtype=dtype,
                             block_n=plan.kernel.template["block_n"], what=plan.kernel.name, **kw)


# ----------------------------------------------------------------------------------------------
# Every specialisation of the supported table, launched directly (whatever the heuristic picks)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", prefill.all_specs(), ids=lambda s: s.name)
def test_every_specialisation(spec):
    """Lengths that are not tile multiples (at least two and a bit K/V tiles, one and a bit Q
    tiles), a head dim 8 below the compiled one (column padding), GQA; NaN-poisoned out and lse.
    Causal: seqlen_q = seqlen_k + 11, so the first 11 rows see no key (0 and -inf)."""
    import zlib
    from cupyflash.core.interop import current_stream
    cfg, causal = prefill.config_of(spec)
    b, h, hk, d = 2, 4, 2, cfg.headdim - 8
    sq, sk = cfg.block_m + 19, 2 * cfg.block_n + 7
    if causal:
        sq = max(cfg.block_m + 19, 2 * cfg.block_n + 18)
        sk = sq - 11
    rng = np.random.default_rng(zlib.crc32(spec.name.encode()))
    q, k, v = host_inputs(rng, b, sq, sk, h, hk, d, cfg.dtype)
    prob = check_attention(q, k, v, causal=causal)
    out = nan_buffer(q.shape, cfg.dtype)
    lse = cupy.full((b, h, sq), np.nan, dtype=prefill.lse_dtype(cfg.dtype))
    prefill.launch(spec, to_dev(q), to_dev(k), to_dev(v), out, lse, problem=prob,
                   stream=current_stream())
    assert_matches_reference(to_host(out), to_host(lse), q, k, v, dtype=cfg.dtype,
                             causal=causal, block_n=cfg.block_n, what=spec.name)


# ----------------------------------------------------------------------------------------------
# Mask semantics made visible: q = 0 and V[j] = j, so out = mean of the visible key indices
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk,causal,window", [
    (100, 200, False, (-1, -1)), (100, 200, True, (-1, -1)), (200, 100, True, (-1, -1)),
    (150, 150, False, (10, 3)), (37, 200, True, (20, -1)), (200, 37, False, (0, 0)),
    (129, 255, False, (-1, 0)), (64, 64, True, (0, -1))])
def test_visible_keys_by_mean_index(dtype, sq, sk, causal, window):
    b, h, hk, d = 1, 2, 1, 40
    dt = np_dtype(dtype)
    q = np.zeros((b, sq, h, d), dt)
    v = np.broadcast_to(np.arange(sk, dtype=np.float64)[None, :, None, None],
                        (b, sk, hk, d)).astype(dt)
    k = testing.random_normal(np.random.default_rng(3), (b, sk, hk, d), dtype)
    out, lse = flash_attn_func(to_dev(q), to_dev(k), to_dev(v), causal=causal,
                               window_size=window, return_lse=True)
    out, lse = to_host(out).astype(np.float64), to_host(lse).astype(np.float64)
    w = check_attention(q, k, v, causal=causal, window_size=window).window_size
    lo, hi = io_model.visible_key_range(np.arange(sq), sq, sk, causal, w)
    lo, hi = np.clip(lo, 0, sk), np.clip(hi, 0, sk)
    count = np.maximum(hi - lo, 0)
    mean = np.where(count > 0, (lo + hi - 1) / 2.0, 0.0)
    want = np.broadcast_to(mean[None, :, None, None], out.shape)
    tol = 2 * max(EPS[dtype], EPS32) * np.abs(want) + 1e-300
    assert not np.isnan(out).any()
    assert (np.abs(out - want) <= tol).all(), f"max error {np.abs(out - want).max()}"
    lse_want = np.where(count > 0, np.log(np.maximum(count, 1)), -np.inf)
    lse_want = np.broadcast_to(lse_want[None, None, :], lse.shape)
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_want))
    fin = np.isfinite(lse_want)
    assert (np.abs(lse[fin] - lse_want[fin]) <= 4 * EPS32 * (1 + lse_want[fin])).all()


# ----------------------------------------------------------------------------------------------
# Empty rows and degenerate sizes
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_more_queries_than_keys_gives_zero_and_neg_inf(dtype):
    rng = np.random.default_rng(4)
    b, sq, sk, h, d = 2, 100, 30, 3, 64
    q, k, v = host_inputs(rng, b, sq, sk, h, h, d, dtype)
    out, lse = flash_attn_func(to_dev(q), to_dev(k), to_dev(v), causal=True, return_lse=True,
                               out=nan_buffer(q.shape, dtype))
    out, lse = to_host(out), to_host(lse)
    assert (out[:, :sq - sk].astype(np.float64) == 0).all()
    assert np.isneginf(lse[:, :, :sq - sk]).all()
    assert_matches_reference(out, lse, q, k, v, dtype=dtype, causal=True,
                             block_n=block_n_of(q, k, v, causal=True))


@pytest.mark.parametrize("dtype", ("bfloat16", "float64"))
def test_degenerate_sizes(dtype):
    dt = np_dtype(dtype)
    rng = np.random.default_rng(5)
    # no query rows: nothing to launch, empty results
    q, k, v = host_inputs(rng, 2, 0, 5, 2, 2, 32, dtype)
    out, lse = flash_attn_func(to_dev(q), to_dev(k), to_dev(v), return_lse=True)
    assert out.shape == (2, 0, 2, 32) and lse.shape == (2, 2, 0)
    # no keys: every row is empty -> 0 and -inf
    q, k, v = host_inputs(rng, 2, 9, 0, 2, 2, 32, dtype)
    out, lse = flash_attn_func(to_dev(q), to_dev(k), to_dev(v), return_lse=True,
                               out=nan_buffer(q.shape, dtype))
    assert (to_host(out).astype(np.float64) == 0).all() and np.isneginf(to_host(lse)).all()
    # a window that leaves some rows empty
    q, k, v = host_inputs(rng, 1, 50, 10, 2, 1, 16, dtype)
    out, lse = flash_attn_func(to_dev(q), to_dev(k), to_dev(v), window_size=(0, 0),
                               return_lse=True, out=nan_buffer(q.shape, dtype))
    assert_matches_reference(to_host(out), to_host(lse), q, k, v, dtype=dtype,
                             window_size=(0, 0), block_n=block_n_of(q, k, v, window_size=(0, 0)))
    assert dt == out.dtype


# ----------------------------------------------------------------------------------------------
# GQA / MQA: each query head reads KV head h // (nheads // nheads_k)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nheads,nheads_k", [(8, 1), (8, 2), (6, 3), (4, 4)])
@pytest.mark.parametrize("dtype", ("float16", "float32"))
def test_gqa_head_mapping(nheads, nheads_k, dtype):
    rng = np.random.default_rng(6)
    q, k, v = host_inputs(rng, 2, 90, 111, nheads, nheads_k, 64, dtype)
    v = (v.astype(np.float64) + 3.0 * np.arange(nheads_k)[None, None, :, None]).astype(v.dtype)
    out, lse = flash_attn_func(to_dev(q), to_dev(k), to_dev(v), return_lse=True)
    assert_matches_reference(to_host(out), to_host(lse), q, k, v, dtype=dtype,
                             block_n=block_n_of(q, k, v))


# ----------------------------------------------------------------------------------------------
# Variable length: equal to the reference applied to each sequence on its own
# ----------------------------------------------------------------------------------------------
@settings(max_examples=examples(40))
@given(testing.varlen_cases(dtypes=DTYPES, max_batch=4, max_len=200, max_headdim=256,
                            max_nheads_k=2, max_group=4))
def test_varlen_matches_per_sequence_reference(case):
    c = case
    dtype = c.q.dtype.name  # 'bfloat16' for ml_dtypes' bfloat16
    out = nan_buffer(c.q.shape, dtype)
    res, lse = flash_attn_varlen_func(to_dev(c.q), to_dev(c.k), to_dev(c.v),
                                      to_dev(c.cu_seqlens_q), to_dev(c.cu_seqlens_k),
                                      c.max_seqlen_q, c.max_seqlen_k, return_lse=True, out=out,
                                      **c.kwargs())
    assert res is out
    assert lse.shape == (c.q.shape[1], c.q.shape[0])
    out_h, lse_h = to_host(res), to_host(lse)
    res2, lse2 = flash_attn_varlen_func(to_dev(c.q), to_dev(c.k), to_dev(c.v),
                                        to_dev(c.cu_seqlens_q), to_dev(c.cu_seqlens_k),
                                        c.max_seqlen_q, c.max_seqlen_k, return_lse=True,
                                        validate=False, **c.kwargs())
    assert np.array_equal(bits(out_h), bits(to_host(res2)))
    assert np.array_equal(bits(lse_h), bits(to_host(lse2)))
    cq, ck = c.cu_seqlens_q.astype(np.int64), c.cu_seqlens_k.astype(np.int64)
    for b in range(len(c.lengths_q)):
        if c.lengths_q[b] == 0:
            continue
        sl_q, sl_k = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        q1, k1, v1 = c.q[None, sl_q], c.k[None, sl_k], c.v[None, sl_k]
        assert_matches_reference(out_h[None, sl_q], lse_h[None, :, sl_q], q1, k1, v1,
                                 dtype=dtype, block_n=block_n_of(q1, k1, v1, **c.kwargs()),
                                 what=f"sequence {b} of {c.lengths_q}/{c.lengths_k}",
                                 **c.kwargs())


# ----------------------------------------------------------------------------------------------
# 64-bit offsets: tensors with more than 2**31 elements
# ----------------------------------------------------------------------------------------------
def _need_free_bytes(n):
    free, _ = cupy.cuda.runtime.memGetInfo()
    if free < n:
        pytest.skip(f"needs {n / 2**30:.0f} GiB of free device memory, {free / 2**30:.0f} free")


def _normal_f16(shape, seed):
    g = cupy.random.default_rng(seed)
    return g.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)


def test_kv_over_2_pow_31_elements():
    """k and v of shape (16384, 2049, 1, 64): 2_148_532_224 elements each (4.3 GB in fp16); one
    query per sequence, so the run is short (~8.6 GB read). Sampled batches (the last ones sit
    past element 2**31) are compared with the reference."""
    _need_free_bytes(24 * 2 ** 30)
    B, sk, d = 16384, 2049, 64
    assert B * sk * d > 2 ** 31
    q = _normal_f16((B, 1, 1, d), 10)
    k = _normal_f16((B, sk, 1, d), 11)
    v = _normal_f16((B, sk, 1, d), 12)
    out = nan_buffer(q.shape, "float16")
    res, lse = flash_attn_func(q, k, v, out=out, return_lse=True)
    assert not bool(cupy.isnan(res).any())
    idx = np.array([0, 1, B // 2, B - 3, B - 2, B - 1])
    qh, kh, vh = to_host(q[idx]), to_host(k[idx]), to_host(v[idx])
    assert_matches_reference(to_host(res[idx]), to_host(lse[idx]), qh, kh, vh, dtype="float16",
                             block_n=block_n_of(qh, kh, vh), what="kv > 2**31 elements")
    del q, k, v, out, res, lse
    cupy.get_default_memory_pool().free_all_blocks()


def test_q_and_out_over_2_pow_31_elements():
    """q and out of shape (16384, 2049, 1, 64) (> 2**31 elements) against a single key per
    sequence: every output row is exactly that sequence's v row, and LSE is its scaled score."""
    _need_free_bytes(24 * 2 ** 30)
    B, sq, d = 16384, 2049, 64
    q = _normal_f16((B, sq, 1, d), 20)
    k = _normal_f16((B, 1, 1, d), 21)
    v = _normal_f16((B, 1, 1, d), 22)
    out = nan_buffer(q.shape, "float16")
    res, lse = flash_attn_func(q, k, v, out=out, return_lse=True)
    assert bool((res == v).all()), "every row must equal its sequence's single v row (exact)"
    idx = np.array([0, B // 2, B - 1])
    qh, kh = to_host(q[idx]).astype(np.float64), to_host(k[idx]).astype(np.float64)
    want = np.einsum("bshd,bthd->bhs", qh, kh) / math.sqrt(d)
    got = to_host(lse[idx]).astype(np.float64)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5)
    del q, k, v, out, res, lse
    cupy.get_default_memory_pool().free_all_blocks()


# ----------------------------------------------------------------------------------------------
# Streams: the kernel runs on the caller's current stream
# ----------------------------------------------------------------------------------------------
_SPIN = r'''
extern "C" __global__ void spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
'''


def test_runs_on_current_stream():
    """On a non-blocking stream: a ~0.25 s spin kernel, then q is written, then our call. Had the
    call used any other stream it would read q before the write (q starts as NaN)."""
    rng = np.random.default_rng(7)
    q, k, v = host_inputs(rng, 2, 130, 190, 4, 2, 128, "float16")
    q_src, kd, vd = to_dev(q), to_dev(k), to_dev(v)
    qd = nan_buffer(q.shape, "float16")
    flash_attn_func(q_src, kd, vd, return_lse=True)  # warm: plan cached, kernel compiled
    cupy.cuda.Device().synchronize()
    spin = cupy.RawKernel(_SPIN, "spin")
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        spin((1,), (1,), (np.int64(500_000_000),))
        qd[...] = q_src
        out, lse = flash_attn_func(qd, kd, vd, return_lse=True)
        assert not s.done, "the spin kernel should still be running"
    s.synchronize()
    assert_matches_reference(to_host(out), to_host(lse), q, k, v, dtype="float16",
                             block_n=block_n_of(q, k, v))


# ----------------------------------------------------------------------------------------------
# PyTorch: tensors in, tensors out, without a copy; cross-check against SDPA
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
@pytest.mark.parametrize("causal", (False, True))
def test_torch_tensors_and_sdpa(dtype, causal):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    import torch.nn.functional as F
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    gen = torch.Generator(device="cuda").manual_seed(8)
    B, S, H, Hk, D = 2, 257, 8, 2, 128
    dev = torch.device("cuda", cupy.cuda.Device().id)
    # q in heads-major memory, viewed as (B, S, H, D): non-contiguous, last dim contiguous
    q = torch.randn(B, H, S, D, device=dev, dtype=tdt, generator=gen).transpose(1, 2)
    k = torch.randn(B, S, Hk, D, device=dev, dtype=tdt, generator=gen)
    v = torch.randn(B, S, Hk, D, device=dev, dtype=tdt, generator=gen)
    out = torch.full((B, S, H, D), float("nan"), device=dev, dtype=tdt)
    torch.cuda.synchronize()
    res, lse = flash_attn_func(q, k, v, causal=causal, out=out, return_lse=True)
    assert res is out, "must write into out and return it (torch in, torch out)"
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    torch.cuda.synchronize()
    res2 = flash_attn_func(q, k, v, causal=causal)  # allocating path, torch inputs
    torch.cuda.synchronize()
    assert isinstance(res2, torch.Tensor) and res2.device == q.device
    assert torch.equal(res2, out)

    g = H // Hk
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2),
                                          k.repeat_interleave(g, dim=2).transpose(1, 2),
                                          v.repeat_interleave(g, dim=2).transpose(1, 2),
                                          is_causal=causal).transpose(1, 2)  # Sq == Sk: same mask
    torch.cuda.synchronize()
    qh, kh, vh = (x.float().cpu().numpy().astype(np_dtype(dtype)) for x in (q, k, v))
    ref, lse_ref = reference.attention_reference(qh, kh, vh, causal=causal)
    ours = out.float().cpu().numpy().astype(np.float64)
    theirs = sdpa.float().cpu().numpy().astype(np.float64)
    assert not np.isnan(ours).any()
    err, err_sdpa = np.abs(ours - ref).max(), np.abs(theirs - ref).max()
    atol = EPS[dtype] * np.abs(ref).max()
    assert err <= 2 * err_sdpa + atol, f"ours {err:.3g} vs torch SDPA {err_sdpa:.3g}"
    lse_h = lse.double().cpu().numpy()
    assert np.allclose(lse_h, lse_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
@pytest.mark.parametrize("window", [(-1, 2 ** 31 - 1), (2 ** 31 - 1, 2 ** 31 - 1), (2 ** 31 - 1, 0)])
def test_int_max_window_means_unbounded(dtype_name, window):
    """A window of 2^31 - 1 ("no limit" as INT_MAX) gives the unbounded result (the kernels'
    int32 row + shift +- window would wrap without checks.kernel_window), S_q > S_k included."""
    rng = np.random.default_rng(23)
    dt = np_dtype(dtype_name)
    for sq, sk in ((300, 300), (333, 100)):
        qh, kh, vh = (rng.standard_normal((2, s, 4, 128)).astype(dt) for s in (sq, sk, sk))
        out, lse = flash_attn_func(*(cupy.asarray(x) for x in (qh, kh, vh)), window_size=window,
                                   return_lse=True)
        ref, ref_lse = reference.attention_reference(qh, kh, vh, causal=window[1] == 0)
        got = cupy.asnumpy(out).astype(np.float64)
        assert not np.isnan(got).any()
        tol = 3e-2 if dtype_name == "bfloat16" else 1e-5
        assert testing.rel_error(got, ref) < tol, (window, sq, sk)
        fin = np.isfinite(ref_lse)
        assert np.array_equal(np.isfinite(cupy.asnumpy(lse)), fin)


@pytest.mark.parametrize("causal", [False, True])
def test_tma_persistent_scheduler_on_two_streams(causal):
    """The TMA kernel's persistent grid: more work tiles than SMs (every CTA takes several), the
    causal one from its per-stream counter (kernels_cu/common/tile_scheduler.cuh TileScheduler).
    Launches alternate between two CuPy streams; every result matches the reference, repeats are
    bitwise equal, and every counter is back at 0 afterwards (the next launch's start)."""
    from cupyflash.core import tma
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the TMA kernel runs on sm_90a only")
    rng = np.random.default_rng(41)
    B, S, H, Hk, d = 2, 1100, 8, 2, 128  # 2 * 8 * 9 = 144 tiles of 128 rows > 132 SMs
    qh, kh, vh = (rng.standard_normal((B, S, h, d)).astype(np_dtype("bfloat16"))
                  for h in (H, Hk, Hk))
    q, k, v = (cupy.asarray(x) for x in (qh, kh, vh))
    plan = dispatch.launch_plan(check_attention(q, k, v, causal=causal))
    assert plan.template["isa"] == "tma" and plan.grid[0] <= 132, plan.name
    ref, _ = reference.attention_reference(qh, kh, vh, causal=causal)
    base = same_precision_attention(qh, kh, vh, softmax_scale=1 / math.sqrt(d),
                                    window_size=(-1, 0) if causal else (-1, -1), dtype="bfloat16")
    tol = 2 * np.abs(base - ref).max() + EPS["bfloat16"] * np.abs(ref).max()
    streams = (cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True))
    results = []
    for i in range(6):
        with streams[i % 2]:
            out = nan_buffer(q.shape, "bfloat16")
            flash_attn_func(q, k, v, causal=causal, out=out)
            results.append(out)
    for s in streams:
        s.synchronize()
    first = to_host(results[0])
    assert not np.isnan(first.astype(np.float64)).any()
    assert np.abs(first.astype(np.float64) - ref).max() <= tol
    for r in results[1:]:
        assert to_host(r).tobytes() == first.tobytes()
    for arr in tma._COUNTERS.values():
        assert int(arr.get()[0]) == 0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 120, 256])
def test_varlen_call_on_the_tma_kernel(causal, d):
    """flash_attn_varlen_func on the Hopper TMA kernel (enough work tiles that the dispatcher
    takes it): sequences of 1 token, none, shorter than a tile, ragged and tile-sized, queries
    without keys; every sequence matches its own reference, the persistent CTAs take several
    tiles each (causal: from the counter, left 0), the warm call (validate=False, cached
    entry) is bitwise equal, and NaN rows after cu_seqlens_k[-1] (k, v are views of larger
    buffers) change nothing."""
    from cupyflash import api
    from cupyflash.core import tma
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the TMA kernel runs on sm_90a only")
    rng = np.random.default_rng(43)
    lens_q = [300, 1, 0, 517, 128, 77, 2, 5]
    lens_k = [260, 1, 9, 517, 128, 100, 0, 700]
    h, hk, dt = 16, 4, "bfloat16"
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    qh = testing.random_normal(rng, (cq[-1], h, d), dt)
    kh = testing.random_normal(rng, (ck[-1], hk, d), dt)
    vh = testing.random_normal(rng, (ck[-1], hk, d), dt)
    k, v = (nan_buffer((ck[-1] + 50, hk, d), dt)[:ck[-1]] for _ in range(2))
    for dst, src in ((k, kh), (v, vh)):  # bits: no bfloat16 kernel needed
        dst.view(np.uint16)[...] = to_dev(src.view(np.uint16))
    q = to_dev(qh)
    cq_d, ck_d = to_dev(cq), to_dev(ck)
    args = (q, k, v, cq_d, ck_d, max(lens_q), max(lens_k))
    plan = api.explain_varlen(*args, causal=causal)
    assert plan.template["isa"] == "tma", plan.name  # 5 m-blocks x 16 heads x 8 sequences
    out = nan_buffer(q.shape, dt)
    res, lse = flash_attn_varlen_func(*args, causal=causal, return_lse=True, out=out)
    out_h, lse_h = to_host(res), to_host(lse)
    for _ in range(2):  # warm: the cached entry, its tensor maps
        res2, lse2 = flash_attn_varlen_func(*args, causal=causal, return_lse=True, validate=False)
        assert to_host(res2).tobytes() == out_h.tobytes()
        assert to_host(lse2).tobytes() == lse_h.tobytes()
    for b in range(len(lens_q)):
        if lens_q[b] == 0:
            continue
        sl_q, sl_k = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        q1, k1, v1 = qh[None, sl_q], kh[None, sl_k], vh[None, sl_k]
        assert_matches_reference(out_h[None, sl_q], lse_h[None, :, sl_q], q1, k1, v1, dtype=dt,
                                 causal=causal, block_n=plan.template["block_n"],
                                 what=f"{plan.name} sequence {b} ({lens_q[b]}, {lens_k[b]})")
    for arr in tma._COUNTERS.values():
        assert int(arr.get()[0]) == 0


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tma_o_through_the_v_ring_across_many_tiles(dtype, causal):
    """hd256 writes O through its V ring (kOInV): every work tile's epilogue, with keys or
    without, must finish reading O before the producer loads the next keyed tile's V over it
    (the producer's o_free wait). More work tiles than SMs, so every persistent CTA takes
    several. Causal (the counter's order): 300 more queries than keys (rows 0-299 see no key:
    0 and -inf), so each head's first two 128-row tiles have no key at all and run between
    keyed tiles of other heads; 576 tiles. Non-causal (the static order): keyed tiles back to
    back, 288 of them. Out and lse NaN-poisoned; checked against the reference; a second call
    is bitwise equal. A broken hand-over hangs rather than fails: run under a timeout."""
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the TMA kernel runs on sm_90a only")
    rng = np.random.default_rng([300, int(causal)])
    B, H, d, sk, sq = (3, 24, 256, 700, 1000) if causal else (2, 16, 256, 1100, 1100)
    qh, kh, vh = host_inputs(rng, B, sq, sk, H, H, d, dtype)
    q, k, v = to_dev(qh), to_dev(kh), to_dev(vh)
    problem = check_attention(q, k, v, causal=causal)
    cfg = next(c for c in prefill.SUPPORTED if c.isa == "tma" and c.dtype == dtype
               and c.headdim == 256)
    smem = f"cf::FlashFwdHopper<{prefill._CTYPE[dtype]}, 256, {cfg.block_m}, {cfg.block_n}, false>::Smem"
    assert cfg.o_store and jit.constants(prefill.TMA_SOURCE, (f"{smem}::kOInV",)) == (1,)
    spec = prefill.spec_of(cfg, causal)
    runs = []
    for _ in range(2):
        out = nan_buffer((B, sq, H, d), dtype)
        lse = cupy.full((B, H, sq), np.nan, dtype=np.float32)
        prefill.launch(spec, q, k, v, out, lse, problem=problem)
        runs.append((to_host(out), to_host(lse)))
    assert_matches_reference(*runs[0], qh, kh, vh, dtype=dtype, causal=causal,
                             block_n=cfg.block_n, what=f"{spec.name} many tiles")
    assert bits(runs[1][0]).tobytes() == bits(runs[0][0]).tobytes()
    assert runs[1][1].tobytes() == runs[0][1].tobytes()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq", [1000, 1])
@pytest.mark.parametrize("d", [64, 72, 128, 136, 200, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tma_o_store_epilogue_and_its_register_fallback(dtype, d, sq, causal):
    """The TMA kernel's epilogue (issue 23, item 1): dense problems write O through shared
    memory and TMA stores, a buffer per consumer warpgroup at hd64 / hd128 and the V ring at
    hd256 (the producer loads a tile's first V after the stores read O); the O map clips rows
    past seqlen_q and columns past the head dim; outs whose strides a tensor map refuses
    (reversed rows) and calls whose out base the map refuses (8-byte aligned) are written from
    registers.
    Shapes whose last m-block is partial (1000 rows: 7 full blocks and 104 rows; 1 row: the
    second warpgroup's box entirely past the end). Every out is NaN before the call; every
    result matches the reference and the TMA-store results are bitwise equal to the register
    ones (both round the same O / l); padding around strided views stays NaN; the warm launch
    (one prepared launch, new out pointers: the O map's address replaced) keeps all of it."""
    from cupyflash.core import jit, tma
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the TMA kernel runs on sm_90a only")
    rng = np.random.default_rng([d, sq, int(causal)])
    B, H, Hk, sk = 2, 4, 2, (1000 if sq > 1 else 333)
    qh, kh, vh = host_inputs(rng, B, sq, sk, H, Hk, d, dtype)
    q, k, v = to_dev(qh), to_dev(kh), to_dev(vh)
    problem = check_attention(q, k, v, causal=causal)
    cfg = next(c for c in prefill.SUPPORTED if c.isa == "tma" and c.dtype == dtype
               and c.headdim == prefill.padded_headdim(d, "tma"))
    assert cfg.o_store, cfg
    spec = prefill.spec_of(cfg, causal)

    def launch_into(out):
        lse = cupy.full((B, H, sq), np.nan, dtype=np.float32)
        prefill.launch(spec, q, k, v, out, lse, problem=problem)
        cupy.cuda.get_current_stream().synchronize()
        return lse

    shape = (B, sq, H, d)
    results = {}
    # contiguous, a padded view (rows of d + 8, 37 more rows), heads-major: the O map's path
    for layout in ("contiguous", "padded", "heads_major"):
        out, buf = out_buffer(shape, dtype, layout)
        lse = launch_into(out)
        results[layout] = (to_host(out), to_host(lse))
        if buf is not None:
            pad = np.ones(buf.shape, bool)
            pad[:, :sq, :, :d] = False
            assert np.isnan(to_host(buf).astype(np.float64)[pad]).all(), \
                f"{spec.name} {layout}: wrote outside the out view"
    # reversed rows: a negative stride, no O map (registers)
    strides, _ = prefill.args_template(spec, q, k, v, nan_buffer(shape, dtype)[:, ::-1],
                                       (H * sq, sq, 1), problem=problem, varlen=False)
    assert tma.o_map_layout(problem, strides) is None
    rev = nan_buffer(shape, dtype)
    lse = launch_into(rev[:, ::-1])
    results["reversed"] = (to_host(rev)[:, ::-1], to_host(lse))
    out_h, lse_h = results["contiguous"]
    assert_matches_reference(out_h, lse_h, qh, kh, vh, dtype=dtype, causal=causal,
                             block_n=cfg.block_n, what=f"{spec.name} d{d} sq{sq}")
    for layout, (o, l) in results.items():
        assert bits(o).tobytes() == bits(out_h).tobytes(), f"{spec.name} {layout}: out differs"
        assert l.tobytes() == lse_h.tobytes(), f"{spec.name} {layout}: lse differs"

    # one prepared launch, out pointers changing per call (same layout): A, B, then a view 8
    # bytes into a buffer (the map refuses the base: o_map_ok 0, registers), then A again
    grid, block, smem = prefill.launch_config(spec, problem,
                                              cupy.cuda.Device().attributes["MultiProcessorCount"])
    lse = cupy.full((B, H, sq), np.nan, dtype=np.float32)
    strides, sizes = prefill.args_template(spec, q, k, v, q, (H * sq, sq, 1), problem=problem,
                                           varlen=False)
    run = prefill.prepared_launch(spec, jit.get_kernel(spec), grid, block, smem, problem,
                                  strides, sizes, cupy.cuda.runtime.getDevice())
    n = B * sq * H * d
    flat = nan_buffer((n + 8,), dtype)
    outs = (nan_buffer(shape, dtype), nan_buffer(shape, dtype), flat[4:4 + n].reshape(shape))
    assert outs[2].data.ptr % 16 == 8
    for i, want_flag in ((0, 1), (1, 1), (2, 0), (0, 1)):
        outs[i].view(_UINT[2]).fill(_NAN_BITS[dtype])
        lse.fill(np.nan)
        run(tuple(x.data.ptr for x in (q, k, v, outs[i], lse)) + (0, 0),
            cupy.cuda.get_current_stream().ptr)
        cupy.cuda.get_current_stream().synchronize()
        assert FwdTmaParams.from_address(run.address).o_map_ok == want_flag
        assert bits(to_host(outs[i])).tobytes() == bits(out_h).tobytes(), \
            f"{spec.name} warm call {i}: out differs"
        assert to_host(lse).tobytes() == lse_h.tobytes()
    assert np.isnan(to_host(flat[:4]).astype(np.float64)).all()
    assert np.isnan(to_host(flat[4 + n:]).astype(np.float64)).all()
