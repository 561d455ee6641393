"""Kernel-level GPU tests of the tiled prefill forward (``cupyflash.forward.kernels.launch`` directly, no
dispatch): every tile configuration in ``prefill.SUPPORTED`` against the float64 reference.

Run: ``pytest -m gpu tests/gpu/test_prefill_kernels_gpu.py`` (skips without a CUDA device).

Oracles (FlashAttention-2 arXiv 2307.08691 is the algorithm under test):

* float16 / bfloat16: ``max|out - ref| <= 2 * max|base - ref| + eps(dtype) * max|ref|`` where
  ``base`` is a straightforward same-precision implementation on the same inputs (the rule of
  FlashAttention's own tests): ``q * scale`` rounded to the dtype, ``S = q k^T`` with float32
  accumulation rounded to the dtype, softmax in float32, ``P`` rounded to the dtype,
  ``O = P V`` with float32 accumulation rounded to the dtype (NumPy on the host).
* float32: normwise relative error ``<= 2 * streaming_error_bound(float32, block_size_k=BLOCK_N)``
  (cupyflash.testing: a first-order bound ``eps32 * K``, K stated there in units of float32
  epsilon; it covers the kernel's exp2 with folded scale: exp2f is within 2 ulp).
* float64: normwise relative error ``<= 1e-12``.
* LSE (float32 for every dtype): ``-inf`` exactly where the reference is ``-inf``; elsewhere
  ``|lse - ref| <= 2 * lse_bound + 2 * eps32 * (1 + |ref|)``.
* Rows that see no key: output exactly 0, LSE -inf.

Outputs are poisoned with NaN before each launch and checked with ``isnan`` first; every case runs
twice and both results must be bitwise equal.
"""

import numpy as np
import pytest

# "precompiled" (tests/gpu/conftest.py) builds every prefill specialisation in parallel first.
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("precompiled")]

cupy = pytest.importorskip("cupy")  # tests/gpu/conftest.py skips these without a device

from cupyflash import reference, testing  # noqa: E402
from cupyflash.core import checks
from cupyflash.forward import kernels as prefill

EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23, "float64": 2.0 ** -52}
EPS32 = EPS["float32"]
_NAN_BITS = {2: (np.uint16, {"float16": 0x7E00, "bfloat16": 0x7FC0}),
             4: (np.uint32, {"float32": 0x7FC00000}),
             8: (np.uint64, {"float64": 0x7FF8000000000000})}


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------
def _nan_array(shape, dtype_name):
    """A CuPy array of ``dtype_name`` filled with (quiet) NaN, built from its bit pattern."""
    dt = testing.np_dtype(dtype_name)
    ut, bits = _NAN_BITS[dt.itemsize]
    return cupy.full(shape, bits[dtype_name], dtype=ut).view(dt)


def _randn(rng, shape, dtype_name):
    """Host array of standard normal values, rounded to ``dtype_name``."""
    return rng.standard_normal(shape).astype(testing.np_dtype(dtype_name))


def _round(x, dt):
    return np.asarray(x, np.float32).astype(dt).astype(np.float32)


def same_precision_attention(q, k, v, scale, window_size, dtype_name):
    """Straightforward attention with every intermediate rounded to the low precision (host).

    q (b, sq, h, d), k/v (b, sk, hk, d) -> out (b, sq, h, d) float64 (values of the dtype).
    """
    dt = testing.np_dtype(dtype_name)
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    vis = reference.attention_mask(sq, sk, window_size=window_size)
    out = np.zeros((b, sq, h, d))
    qs = _round(q.astype(np.float32) * np.float32(scale), dt)
    for bi in range(b):
        for hi in range(h):
            kh = hi // (h // hk)
            s = _round(qs[bi, :, hi] @ k[bi, :, kh].astype(np.float32).T, dt)
            s = np.where(vis, s, -np.inf)
            m = s.max(axis=-1, keepdims=True, initial=-np.inf)
            e = np.exp(s - np.where(np.isfinite(m), m, 0.0)).astype(np.float32)
            den = e.sum(axis=-1, keepdims=True)
            p = _round(np.where(den > 0, e / np.where(den > 0, den, 1), 0), dt)
            out[bi, :, hi] = _round(p @ v[bi, :, kh].astype(np.float32), dt)
    return out


def _launch(spec, q, k, v, problem, cu_q=None, cu_k=None, out=None):
    """Launch into fresh NaN-poisoned out (unless given) and lse; returns host copies."""
    if out is None:
        out = _nan_array(q.shape, problem.dtype)
    lse_shape = (problem.nheads, q.shape[0]) if problem.varlen else \
        (problem.batch, problem.nheads, problem.seqlen_q)
    lse = cupy.full(lse_shape, np.nan, dtype=prefill.lse_dtype(problem.dtype))
    prefill.launch(spec, q, k, v, out, lse, problem=problem, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    cupy.cuda.get_current_stream().synchronize()
    return out, lse


def _bits(x):
    a = cupy.asnumpy(x)
    return a.view(np.uint8).tobytes()


def _check(out, lse, q, k, v, problem, cfg, *, what=""):
    """Compare host arrays out (b, sq, h, d) / lse (b, h, sq) with the oracles of the module doc."""
    dtype_name = problem.dtype
    out = np.asarray(out).astype(np.float64)
    lse = np.asarray(lse).astype(np.float64)
    assert not np.isnan(out).any(), f"{what}: NaN in out (an element was never written)"
    assert not np.isnan(lse).any(), f"{what}: NaN in lse (a row was never written)"
    ref_o, ref_l = reference.attention_reference(q, k, v, softmax_scale=problem.softmax_scale,
                                                 window_size=problem.window_size)
    empty = np.isneginf(ref_l)                                 # (b, h, sq)
    assert np.array_equal(np.isneginf(lse), empty), f"{what}: -inf LSE rows differ"
    assert np.all(out.transpose(0, 2, 1, 3)[empty] == 0), f"{what}: rows with no key must be 0"
    _, lse_bound = testing.streaming_error_bound(q, k, v, softmax_scale=problem.softmax_scale,
                                                 window_size=problem.window_size,
                                                 block_size_k=cfg.block_n, dtype=np.float32)
    fin = ~empty
    lse_err = np.abs(lse[fin] - ref_l[fin])
    lse_tol = 2 * lse_bound[fin] + 2 * EPS32 * (1 + np.abs(ref_l[fin]))
    assert np.all(lse_err <= lse_tol), f"{what}: LSE error {lse_err.max()} > {lse_tol.min()}"
    if dtype_name in ("float16", "bfloat16"):
        base = same_precision_attention(q, k, v, problem.softmax_scale, problem.window_size, dtype_name)
        err = float(np.max(np.abs(out - ref_o), initial=0.0))
        err_base = float(np.max(np.abs(base - ref_o), initial=0.0))
        tol = 2 * err_base + EPS[dtype_name] * float(np.max(np.abs(ref_o), initial=0.0))
        assert err <= tol, f"{what}: max error {err:.3g} > 2 x same-precision {err_base:.3g} + 1 ulp"
    elif dtype_name == "float32":
        bound, _ = testing.streaming_error_bound(q, k, v, softmax_scale=problem.softmax_scale,
                                                 window_size=problem.window_size,
                                                 block_size_k=cfg.block_n, dtype=np.float32)
        err = testing.rel_error(out, ref_o)
        assert err <= 2 * bound, f"{what}: float32 rel error {err:.3g} > 2 x bound {bound:.3g}"
    else:
        err = testing.rel_error(out, ref_o)
        assert err <= 1e-12, f"{what}: float64 rel error {err:.3g} > 1e-12"


def _configs(dtype_name, hd):
    """The table's rows that run head dim ``hd`` (each kernel at its padded head dim: 200 runs
    as 256 on the TMA kernel, as 224 on the mma.sync one)."""
    return list(prefill.configs_for(dtype_name, hd))


# ----------------------------------------------------------------------------------------------
# Dense problems: every tile configuration x scenarios
# ----------------------------------------------------------------------------------------------
DTYPES = ("float16", "bfloat16", "float32", "float64")
HEADDIMS = (8, 40, 64, 128, 200, 256)
# (seqlen_q, seqlen_k, causal, window_size, nheads, nheads_k); batch 2 everywhere.
SCENARIOS = [
    (1, 1, False, (-1, -1), 2, 2),
    (17, 333, False, (-1, -1), 4, 1),      # GQA 4, many key tiles, ragged tail
    (333, 17, True, (-1, -1), 4, 4),       # Sq > Sk causal: the first 316 rows see no key
    (128, 128, True, (-1, -1), 4, 1),      # square causal, tile-aligned
    (333, 333, False, (32, 8), 2, 2),      # window on both sides: tiles skipped at both ends
    (17, 128, True, (5, -1), 4, 1),        # causal + left window
    (128, 333, False, (-1, 0), 2, 2),      # right = 0 is causal (bottom-right)
    (333, 128, False, (-1, -1), 4, 4),     # Sq > Sk non-causal, ragged q tail
    (1, 333, True, (-1, -1), 4, 1),        # one query row, decode-like
]
_CASES = [(dt, hd, i) for dt in DTYPES for hd in HEADDIMS for i in range(len(_configs(dt, hd)))]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: "sq{}-sk{}-{}-w{}_{}-h{}_{}".format(
    s[0], s[1], "causal" if s[2] else "full", s[3][0], s[3][1], s[4], s[5]))
@pytest.mark.parametrize("dtype_name,headdim,cfg_index", _CASES,
                         ids=[f"{dt}-d{hd}-cfg{i}" for dt, hd, i in _CASES])
def test_dense(dtype_name, headdim, cfg_index, scenario):
    sq, sk, causal, window, h, hk = scenario
    cfg = _configs(dtype_name, headdim)[cfg_index]
    rng = np.random.default_rng([sq, sk, headdim, cfg_index, DTYPES.index(dtype_name)])
    qh = _randn(rng, (2, sq, h, headdim), dtype_name)
    kh = _randn(rng, (2, sk, hk, headdim), dtype_name)
    vh = _randn(rng, (2, sk, hk, headdim), dtype_name)
    q, k, v = (cupy.asarray(x) for x in (qh, kh, vh))
    problem = checks.check_attention(q, k, v, causal=causal, window_size=window)
    spec = prefill.spec_of(cfg, problem.causal)
    out1, lse1 = _launch(spec, q, k, v, problem)
    out2, lse2 = _launch(spec, q, k, v, problem)
    assert _bits(out1) == _bits(out2) and _bits(lse1) == _bits(lse2), f"{spec.name}: runs differ"
    _check(cupy.asnumpy(out1), cupy.asnumpy(lse1), qh, kh, vh, problem, cfg, what=spec.name)


# ----------------------------------------------------------------------------------------------
# Softmax scale, strided views (q/k/v slices of a packed qkv tensor; out inside a larger buffer)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("headdim", (64, 128))
def test_strided_views_and_scale(dtype_name, headdim):
    rng = np.random.default_rng(7)
    b, s, h = 2, 150, 3
    qkv_h = _randn(rng, (b, s, 3, h, headdim), dtype_name)
    qkv = cupy.asarray(qkv_h)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    big = _nan_array((b, s, h + 1, headdim + 16), dtype_name)   # out is a strided window of it
    out = big[:, :, 1:, 8:8 + headdim]
    problem = checks.check_attention(q, k, v, softmax_scale=0.3, causal=True)
    for cfg in _configs(dtype_name, headdim):
        big[...] = _nan_array(big.shape, dtype_name)
        spec = prefill.spec_of(cfg, True)
        _, lse = _launch(spec, q, k, v, problem, out=out)
        host = cupy.asnumpy(big).astype(np.float64)
        pad = np.ones(host.shape, bool)
        pad[:, :, 1:, 8:8 + headdim] = False
        assert np.isnan(host[pad]).all(), f"{spec.name}: wrote outside the out view"
        _check(host[:, :, 1:, 8:8 + headdim], cupy.asnumpy(lse), qkv_h[:, :, 0], qkv_h[:, :, 1],
               qkv_h[:, :, 2], problem, cfg, what=spec.name)


# ----------------------------------------------------------------------------------------------
# Varlen (cu_seqlens), including empty and one-token sequences: every row of the table, the TMA
# kernel's too (head dims 40 and 128 run its hd64 and hd128 rows, 256 its 64-key tiles)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("headdim", (40, 128, 256))
@pytest.mark.parametrize("causal", (False, True))
def test_varlen(dtype_name, headdim, causal):
    rng = np.random.default_rng(11)
    lens_q = [5, 0, 130, 1, 64, 3]   # the last: queries and no key (output 0, LSE -inf)
    lens_k = [9, 3, 70, 200, 64, 0]
    h, hk = 4, 2
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    qh = _randn(rng, (cu_q[-1], h, headdim), dtype_name)
    kh = _randn(rng, (cu_k[-1], hk, headdim), dtype_name)
    vh = _randn(rng, (cu_k[-1], hk, headdim), dtype_name)
    q, k, v = (cupy.asarray(x) for x in (qh, kh, vh))
    cq, ck = cupy.asarray(cu_q), cupy.asarray(cu_k)
    problem = checks.check_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=causal)
    for cfg in _configs(dtype_name, headdim):
        spec = prefill.spec_of(cfg, causal)
        out1, lse1 = _launch(spec, q, k, v, problem, cu_q=cq, cu_k=ck)
        out2, lse2 = _launch(spec, q, k, v, problem, cu_q=cq, cu_k=ck)
        assert _bits(out1) == _bits(out2) and _bits(lse1) == _bits(lse2)
        out_h, lse_h = cupy.asnumpy(out1), cupy.asnumpy(lse1)
        for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
            if lq == 0:
                continue
            sl_q, sl_k = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            sub = checks.check_attention(qh[None, sl_q], kh[None, sl_k], vh[None, sl_k], causal=causal)
            _check(out_h[None, sl_q], lse_h[None, :, sl_q], qh[None, sl_q], kh[None, sl_k],
                   vh[None, sl_k], sub, cfg, what=f"{spec.name} seq {i}")


# ----------------------------------------------------------------------------------------------
# Varlen, docs/semantics.md, 5: a tile that runs past a sequence's end reads the next
# sequence's rows (the TMA kernel's copies start at the sequence's first row; its producer
# zeroes such V rows), or the memory after cu_seqlens[-1]. NaN / Inf there must change nothing.
# ----------------------------------------------------------------------------------------------
_POISON_LENS_Q = [37, 1, 130, 0, 5, 64, 3, 200]     # 1, 0, shorter than a tile, ragged tails
_POISON_LENS_K = [100, 1, 200, 7, 37, 128, 0, 333]  # 128: a whole tile, no tail


def _packed(rng, lens, heads, d, dtype_name, poisoned, values, pad=70):
    """A packed host array of random rows for sequences of ``lens`` and its copy on the device,
    a view of a buffer with ``pad`` NaN rows after the last sequence. The rows of the sequences
    in ``poisoned`` alternate between the two non-finite ``values``."""
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    x = _randn(rng, (cu[-1], heads, d), dtype_name)
    for b in poisoned:
        x[cu[b]:cu[b + 1]:2] = values[0]
        x[cu[b] + 1:cu[b + 1]:2] = values[1]
    buf = _nan_array((cu[-1] + pad, heads, d), dtype_name)
    ut = _NAN_BITS[x.dtype.itemsize][0]
    buf[:cu[-1]].view(ut)[...] = cupy.asarray(x.view(ut))  # bits, no 16-bit float kernel needed
    return x, buf[:cu[-1]]


@pytest.mark.parametrize("dtype_name", ("float16", "bfloat16", "float32"))
@pytest.mark.parametrize("headdim", (64, 120, 256))
@pytest.mark.parametrize("causal", (False, True))
def test_varlen_other_sequences_rows_change_nothing(dtype_name, headdim, causal):
    """Each row of the table runs the packed batch three times: clean, with the odd sequences'
    q, k and v rows non-finite (NaN and +Inf, alternating by row), and with the even ones'.
    Every clean sequence of a poisoned run (its neighbours poisoned) equals the clean run's
    result bitwise, output and LSE, and is finite; the clean run matches the reference. The
    packed tensors are views of larger buffers whose rows after cu_seqlens[-1] are NaN."""
    h, hk = 4, 2
    lq, lk = _POISON_LENS_Q, _POISON_LENS_K
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    cq, ck = cupy.asarray(cu_q), cupy.asarray(cu_k)
    runs = []
    for poisoned in ((), range(1, len(lq), 2), range(0, len(lq), 2)):
        rng = np.random.default_rng(23)  # the same finite values in every run
        qh, q = _packed(rng, lq, h, headdim, dtype_name, poisoned, (np.nan, np.inf))
        kh, k = _packed(rng, lk, hk, headdim, dtype_name, poisoned, (np.nan, np.inf))
        vh, v = _packed(rng, lk, hk, headdim, dtype_name, poisoned, (np.inf, np.nan))
        runs.append((poisoned, qh, kh, vh, q, k, v))
    problem = checks.check_varlen(runs[0][4], runs[0][5], runs[0][6], cq, ck, max(lq), max(lk),
                                  causal=causal)
    for cfg in _configs(dtype_name, headdim):
        spec = prefill.spec_of(cfg, causal)
        results = [tuple(cupy.asnumpy(x) for x in _launch(spec, q, k, v, problem, cu_q=cq, cu_k=ck))
                   for _, _, _, _, q, k, v in runs]
        clean_o, clean_l = results[0]
        _, qh, kh, vh = runs[0][:4]
        for b in range(len(lq)):
            sl_q, sl_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            if lq[b]:
                sub = checks.check_attention(qh[None, sl_q], kh[None, sl_k], vh[None, sl_k],
                                             causal=causal)
                _check(clean_o[None, sl_q], clean_l[None, :, sl_q], qh[None, sl_q],
                       kh[None, sl_k], vh[None, sl_k], sub, cfg, what=f"{spec.name} seq {b}")
            for (poisoned, *_), (o, lse) in zip(runs[1:], results[1:]):
                if b in poisoned:
                    continue
                what = f"{spec.name} seq {b}, sequences {list(poisoned)} poisoned"
                assert np.isfinite(o[sl_q].astype(np.float64)).all(), f"{what}: non-finite output"
                assert _bits(o[sl_q]) == _bits(clean_o[sl_q]), f"{what}: output differs"
                assert _bits(lse[:, sl_q]) == _bits(clean_l[:, sl_q]), f"{what}: LSE differs"


# ----------------------------------------------------------------------------------------------
# 64-bit offsets: every tensor has more than 2^31 elements
# ----------------------------------------------------------------------------------------------
def test_offsets_beyond_2_pow_31():
    """q, k, v and out of shape (1, S, 1, 128) bfloat16 with S * 128 > 2^31; a causal window of
    64 keys keeps the work small (tiles outside the window are skipped by the loop bounds). The
    last 200 rows are checked against the reference on the last 264 keys (bottom-right alignment
    makes that sub-problem identical)."""
    d, win, tail = 128, 64, 200
    s = (1 << 31) // d + 4096
    free = cupy.cuda.runtime.memGetInfo()[0]
    if free < 6 * s * d * 2:
        pytest.skip("needs ~20 GB of free device memory")
    dt = testing.np_dtype("bfloat16")
    cupy.random.seed(3)
    q, k, v = (cupy.random.standard_normal((1, s, 1, d), dtype=np.float32).astype(dt) for _ in range(3))
    problem = checks.check_attention(q, k, v, causal=True, window_size=(win, 0))
    cfg = _configs("bfloat16", d)[0]
    spec = prefill.spec_of(cfg, True)
    out, lse = _launch(spec, q, k, v, problem)
    qt = cupy.asnumpy(q[:, -tail:])
    kt, vt = cupy.asnumpy(k[:, -(tail + win):]), cupy.asnumpy(v[:, -(tail + win):])
    sub = checks.check_attention(qt, kt, vt, causal=True, window_size=(win, 0))
    _check(cupy.asnumpy(out[:, -tail:]), cupy.asnumpy(lse[:, :, -tail:]), qt, kt, vt, sub, cfg,
           what=spec.name + " (tail rows past 2^31 elements)")
    assert not bool(cupy.isnan(out).any()), "some output row was never written"
    del q, k, v, out, lse
    cupy.get_default_memory_pool().free_all_blocks()
