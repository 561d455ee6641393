"""The backward reference: one-shot gradients against finite differences and torch.autograd,
FlashAttention-2's streaming backward against the one-shot, GQA, varlen and argument errors.

CPU only. Hypothesis draws shapes (lengths including 0, 1 and block-size neighbours), GQA
ratios, masks and data (``cupyflash.testing``).
"""
import math
import zlib

import numpy as np
import pytest
from hypothesis import given, strategies as st

from cupyflash import reference as R
from cupyflash import testing as T
from cupyflash.testing import rel_error

pytestmark = pytest.mark.filterwarnings("error")

EPS64 = float(np.finfo(np.float64).eps)
EPS32 = float(np.finfo(np.float32).eps)


def problem(seed, b, sq, sk, h, hk, d):
    """Random (q, k, v, dout), float64 standard normal."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, sq, h, d))
    k = rng.standard_normal((b, sk, hk, d))
    v = rng.standard_normal((b, sk, hk, d))
    return q, k, v, rng.standard_normal((b, sq, h, d))


def dout_for(q, seed):
    return np.random.default_rng(seed + 1).standard_normal(q.shape).astype(q.dtype)


gradient_magnitudes = T.backward_magnitudes


def assert_grads_close(got, want, magnitudes, tol):
    """Each of (dq, dk, dv): ||got - want|| <= tol * (componentwise magnitude of the gradient)."""
    for name, a, b, mag in zip(("dq", "dk", "dv"), got, want, magnitudes):
        assert a.shape == b.shape, name
        assert np.isfinite(a).all(), name
        err = np.linalg.norm(a.astype(np.float64) - b)
        assert err <= tol * mag, f"{name}: {err:.3g} > {tol:g} * {mag:.3g}"


# ----------------------------------------------------------------------------------------------
# One-shot gradients: finite differences and torch.autograd
# ----------------------------------------------------------------------------------------------
# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, kwargs)
FD_CASES = {
    "mha sq<sk": (2, 4, 6, 2, 2, 8, {}),
    "mha sq>sk": (1, 6, 4, 2, 2, 8, dict(softmax_scale=0.7)),
    "causal sq>sk (empty rows)": (1, 6, 4, 2, 2, 8, dict(causal=True)),
    "window": (1, 6, 6, 1, 1, 8, dict(window_size=(2, 1))),
    "gqa causal": (1, 4, 7, 4, 2, 8, dict(causal=True)),
    "mqa window": (1, 5, 5, 3, 1, 8, dict(window_size=(1, -1), softmax_scale=0.5)),
}


def central_differences(dout, q, k, v, kwargs, h=1e-5):
    """Gradients of loss = sum(dout * attention_reference(q, k, v)[0]) by central differences."""
    def loss(q, k, v):
        return float((dout * R.attention_reference(q, k, v, **kwargs)[0]).sum())
    args = [q.copy(), k.copy(), v.copy()]
    grads = []
    for a in args:
        g = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            x0 = a[idx]
            a[idx] = x0 + h
            up = loss(*args)
            a[idx] = x0 - h
            down = loss(*args)
            a[idx] = x0
            g[idx] = (up - down) / (2 * h)
        grads.append(g)
    return grads


@pytest.mark.parametrize("case", sorted(FD_CASES))
def test_backward_matches_finite_differences(case):
    b, sq, sk, h, hk, d, kw = FD_CASES[case]
    q, k, v, do = problem(zlib.crc32(case.encode()), b, sq, sk, h, hk, d)
    grads = R.attention_backward(do, q, k, v, **kw)
    fd = central_differences(do, q, k, v, kw)
    for name, g, want in zip(("dq", "dk", "dv"), grads, fd):
        assert g.dtype == np.float64 and g.shape == want.shape, name
        assert rel_error(g, want) < 1e-6, (name, rel_error(g, want))
    if kw.get("causal") and sq > sk:                     # rows 0 .. sq - sk - 1 see no key
        assert np.all(grads[0][:, :sq - sk] == 0)


def torch_attention(q, k, v, softmax_scale, mask):
    """Masked softmax attention in torch (float64), bottom-right mask given; rows with no
    visible key give 0 with zero gradient (their scores are replaced before the softmax, so no
    NaN enters the graph). GQA by repeat_interleave over the head axis."""
    import torch
    group = q.shape[2] // k.shape[2]
    qt = q.permute(0, 2, 1, 3)
    kt, vt = (x.repeat_interleave(group, dim=2).permute(0, 2, 1, 3) for x in (k, v))
    m = torch.as_tensor(mask)
    empty = ~m.any(-1)[:, None]
    s = (softmax_scale * qt @ kt.transpose(-1, -2)).masked_fill(~m, -math.inf)
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return (p @ vt).permute(0, 2, 1, 3)


@pytest.mark.parametrize("case", sorted(FD_CASES))
def test_backward_matches_torch_autograd(case):
    torch = pytest.importorskip("torch")
    b, sq, sk, h, hk, d, kw = FD_CASES[case]
    q, k, v, do = problem(zlib.crc32(case.encode()) + 7, b, 2 * sq + 3, 2 * sk + 1, h, hk, 2 * d)
    scale = kw.get("softmax_scale", 1 / math.sqrt(q.shape[-1]))
    mask = R.attention_mask(q.shape[1], k.shape[1], causal=kw.get("causal", False),
                            window_size=kw.get("window_size", (-1, -1)))
    qt, kt, vt = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    out_t = torch_attention(qt, kt, vt, scale, mask)
    out_t.backward(torch.tensor(do))
    out, _ = R.attention_reference(q, k, v, **kw)
    assert rel_error(out_t.detach().numpy(), out) <= 1e-13     # same forward
    grads = R.attention_backward(do, q, k, v, **kw)
    for name, g, t in zip(("dq", "dk", "dv"), grads, (qt, kt, vt)):
        assert rel_error(g, t.grad.numpy()) <= 1e-12, name


def test_empty_rows_and_no_keys():
    q, k, v, do = problem(11, 1, 5, 3, 2, 1, 8)
    dq, dk, dv = R.attention_backward(do, q, k, v, causal=True)
    # row i sees keys j <= i - 2: rows 0, 1 see nothing; row 2 sees key 0 only (P = 1, dS = 0)
    assert np.all(dq[:, :3] == 0) and np.abs(dq[:, 3:]).max() > 0.1
    assert np.all(np.isfinite(dk)) and np.all(np.isfinite(dv))
    out, lse = R.attention_reference(q, k, v, causal=True)
    sdq, sdk, sdv = R.streaming_attention_backward(do, q, k, v, out, lse, causal=True,
                                                   block_size_m=2, block_size_k=2)
    assert np.all(sdq[:, :2] == 0)
    for fn in (R.attention_backward, R.streaming_attention_backward):   # no keys at all
        args = (do, q, k[:, :0], v[:, :0])
        if fn is R.streaming_attention_backward:
            args += R.attention_reference(*args[1:])
        dq0, dk0, dv0 = fn(*args)
        assert dq0.shape == q.shape and np.all(dq0 == 0)
        assert dk0.shape == dv0.shape == (1, 0, 1, 8)


# ----------------------------------------------------------------------------------------------
# Streaming (FlashAttention-2's backward) == one-shot
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size_m, block_size_k", [(1, 1), (3, 5), (7, 16), (16, 7),
                                                         (64, 64), (128, 2)])
@pytest.mark.parametrize("kw", [{}, dict(causal=True), dict(window_size=(4, 2)),
                                dict(window_size=(-1, 3), softmax_scale=0.3)], ids=str)
def test_streaming_equals_one_shot(block_size_m, block_size_k, kw):
    """Lengths 19 (queries) and 13 (keys, so causal leaves rows 0..5 with no key), divisible by
    none of the block sizes but 1; GQA 4:2."""
    q, k, v, do = problem(12, 2, 19, 13, 4, 2, 16)
    out, lse = R.attention_reference(q, k, v, **kw)
    got = R.streaming_attention_backward(do, q, k, v, out, lse, block_size_m=block_size_m,
                                         block_size_k=block_size_k, **kw)
    want = R.attention_backward(do, q, k, v, **kw)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.dtype == np.float64
        assert rel_error(a, b) <= 1e-12, (name, rel_error(a, b))
    if kw.get("causal"):
        assert np.all(got[0][:, :6] == 0) and np.isneginf(lse[:, :, :6]).all()


@given(T.attention_cases(max_seqlen_q=40, max_seqlen_k=40, max_headdim=32),
       st.sampled_from([3, 7, 16, 64]), st.sampled_from([2, 7, 16, 64]))
def test_streaming_equals_one_shot_property(case, block_size_m, block_size_k):
    """Over random shapes (lengths 0, 1, block neighbours), GQA ratios, masks and scales.
    Measured against the gradients' componentwise magnitudes (``gradient_magnitudes``): a
    plain relative error is undefined where the exact gradient cancels to 0."""
    kw = case.kwargs()
    do = dout_for(case.q, case.seed)
    out, lse = R.attention_reference(case.q, case.k, case.v, **kw)
    got = R.streaming_attention_backward(do, case.q, case.k, case.v, out, lse,
                                         block_size_m=block_size_m, block_size_k=block_size_k,
                                         **kw)
    want = R.attention_backward(do, case.q, case.k, case.v, **kw)
    assert_grads_close(got, want, gradient_magnitudes(do, case.q, case.k, case.v, **kw), 1e-12)


@pytest.mark.parametrize("magnitude", [1e4, 1e5, 1e6])
@pytest.mark.parametrize("causal", [False, True])
def test_streaming_large_scores_stay_finite_and_match(magnitude, causal):
    """Scaled scores M + (a multiple of 1/8 up to about +-8): q, k hold integers, their first
    channel c = round(sqrt(8 M)), softmax_scale 1/8, so every scaled score is exact in float64
    and the softmax is spread over several keys (checked). The streaming P = exp(scale s - lse)
    differs from the exact P of row i by a factor exp(delta_i), |delta_i| <= ~2 eps |lse_i| (the
    rounding of lse and of scale s - lse), the same for the whole row, so it scales the row of dS
    alike (its zero row sum is kept): each gradient's relative error is at most max |delta_i| to
    first order, 4e-12 at M = 1e4 and 4e-10 at M = 1e6 (asserted with a factor 2 of headroom;
    about 4e-13 and 4e-11 measured). The one-shot is exact at any magnitude."""
    scale = 0.125
    rng = np.random.default_rng(13)
    q = rng.integers(-3, 4, (1, 24, 2, 8)).astype(np.float64)
    k = rng.integers(-3, 4, (1, 20, 1, 8)).astype(np.float64)
    q[..., 0] = k[..., 0] = round(math.sqrt(magnitude / scale))
    v, do = rng.standard_normal(k.shape), rng.standard_normal(q.shape)
    out, lse = R.attention_reference(q, k, v, softmax_scale=scale, causal=causal)
    fin = np.isfinite(lse)
    assert 0.99 * magnitude <= np.abs(lse[fin]).min() <= np.abs(lse[fin]).max() <= 1.01 * magnitude
    s = scale * np.einsum("bqhd,bkhd->bhqk", q, np.repeat(k, 2, axis=2))
    mask = R.attention_mask(24, 20, causal=causal)
    p_max = np.exp(np.where(mask, s - np.where(fin, lse, 0)[..., None], -np.inf)).max(-1)
    assert np.median(p_max[fin]) < 0.5                # spread, not one-hot: dS is not ~0
    want = R.attention_backward(do, q, k, v, softmax_scale=scale, causal=causal)
    got = R.streaming_attention_backward(do, q, k, v, out, lse, softmax_scale=scale,
                                         causal=causal, block_size_m=5, block_size_k=8)
    tol = 1e-13 + 4 * EPS64 * np.abs(lse[fin]).max()
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert np.isfinite(a).all() and np.isfinite(b).all(), name
        assert rel_error(a, b) <= tol, (name, rel_error(a, b), tol)


def test_streaming_float32():
    """dtype=float32: float32 results within a small multiple of eps32 of the exact gradients
    (d = 16, 13 keys: a few eps32 measured, 80 eps32 allowed)."""
    q, k, v, do = problem(14, 2, 19, 13, 4, 2, 16)
    out, lse = R.attention_reference(q, k, v, causal=True)
    f32 = [x.astype(np.float32) for x in (do, q, k, v, out)]
    got = R.streaming_attention_backward(*f32, lse.astype(np.float32), causal=True,
                                         block_size_m=8, block_size_k=8, dtype=np.float32)
    want = R.attention_backward(*f32[:4], causal=True)
    for a, b in zip(got, want):
        assert a.dtype == np.float32
        assert rel_error(a, b) <= 80 * EPS32


# ----------------------------------------------------------------------------------------------
# GQA / MQA
# ----------------------------------------------------------------------------------------------
@given(T.attention_cases(max_group=4, max_seqlen_q=24, max_seqlen_k=24, max_headdim=32))
def test_gqa_gradients_are_group_sums_of_mha(case):
    kw = case.kwargs()
    do = dout_for(case.q, case.seed)
    nheads, nheads_k = case.q.shape[2], case.k.shape[2]
    group = nheads // nheads_k
    dq, dk, dv = R.attention_backward(do, case.q, case.k, case.v, **kw)
    rep = [np.repeat(x, group, axis=2) for x in (case.k, case.v)]
    dq_r, dk_r, dv_r = R.attention_backward(do, case.q, *rep, **kw)
    b, sk, d = case.k.shape[0], case.k.shape[1], case.k.shape[3]
    assert rel_error(dq, dq_r) <= 1e-13
    assert rel_error(dk, dk_r.reshape(b, sk, nheads_k, group, d).sum(3)) <= 1e-13
    assert rel_error(dv, dv_r.reshape(b, sk, nheads_k, group, d).sum(3)) <= 1e-13
    dk_sum, dv_sum = np.zeros_like(dk), np.zeros_like(dv)
    for h in range(nheads):                            # query head h reads KV head h // group
        g = h // group
        dq_h, dk_h, dv_h = R.attention_backward(do[:, :, h:h + 1], case.q[:, :, h:h + 1],
                                                case.k[:, :, g:g + 1], case.v[:, :, g:g + 1],
                                                **kw)
        assert np.array_equal(dq_h[:, :, 0], dq[:, :, h])
        dk_sum[:, :, g] += dk_h[:, :, 0]
        dv_sum[:, :, g] += dv_h[:, :, 0]
    assert rel_error(dk, dk_sum) <= 1e-13 and rel_error(dv, dv_sum) <= 1e-13


# ----------------------------------------------------------------------------------------------
# Variable length == per-sequence dense
# ----------------------------------------------------------------------------------------------
def check_varlen_against_dense(do, q, k, v, lengths_q, lengths_k, kw):
    """Each sequence's slice of the packed gradients == the dense gradients of that sequence
    alone (up to rounding, measured against the gradients' magnitudes: the packed products sum
    in another order, and a peaked softmax can cancel a gradient far below its terms)."""
    cq, ck = T.cu_seqlens_from_lengths(lengths_q), T.cu_seqlens_from_lengths(lengths_k)
    dq, dk, dv = R.varlen_attention_backward(do, q, k, v, cq, ck, **kw)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
    assert dq.dtype == dk.dtype == dv.dtype == np.float64
    for b in range(len(lengths_q)):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        args = (do[None, rq], q[None, rq], k[None, rk], v[None, rk])
        assert_grads_close((dq[None, rq], dk[None, rk], dv[None, rk]),
                           R.attention_backward(*args, **kw),
                           gradient_magnitudes(*args, **kw), 1e-13)


@pytest.mark.parametrize("kw", [{}, dict(causal=True), dict(window_size=(2, 0))], ids=str)
def test_varlen_equals_dense_with_empty_sequences(kw):
    """Sequence 1 has no tokens at all, sequence 2 queries but no keys (dq = 0 there), sequence
    3 keys but no queries (dk = dv = 0 there)."""
    lengths_q, lengths_k = [5, 0, 3, 0, 4], [7, 0, 0, 6, 2]
    rng = np.random.default_rng(15)
    q, do = (rng.standard_normal((sum(lengths_q), 4, 8)) for _ in range(2))
    k, v = (rng.standard_normal((sum(lengths_k), 2, 8)) for _ in range(2))
    check_varlen_against_dense(do, q, k, v, lengths_q, lengths_k, kw)
    dq, dk, dv = R.varlen_attention_backward(do, q, k, v, T.cu_seqlens_from_lengths(lengths_q),
                                             T.cu_seqlens_from_lengths(lengths_k), **kw)
    assert np.all(dq[5:8] == 0) and np.all(dk[7:13] == 0) and np.all(dv[7:13] == 0)
    assert np.abs(dq[:5]).max() > 0


@given(T.varlen_cases(max_len=24, max_headdim=32))
def test_varlen_equals_dense_property(case):
    do = dout_for(case.q, case.seed)
    check_varlen_against_dense(do, case.q, case.k, case.v, case.lengths_q, case.lengths_k,
                               case.kwargs())


# ----------------------------------------------------------------------------------------------
# Argument errors: raised before any work, naming the argument
# ----------------------------------------------------------------------------------------------
_Q, _K, _DO = np.zeros((1, 5, 4, 8)), np.zeros((1, 7, 2, 8)), np.zeros((1, 5, 4, 8))
_OUT, _LSE = np.zeros((1, 5, 4, 8)), np.zeros((1, 4, 5))
_CU = np.array([0, 2, 5], np.int32), np.array([0, 3, 7], np.int32)

BAD = {
    "dout shape": (lambda: R.attention_backward(_DO[:, :4], _Q, _K, _K), ValueError, "dout"),
    "dout dtype": (lambda: R.attention_backward(_DO.astype(np.float32), _Q, _K, _K),
                   TypeError, "dout"),
    "dout list": (lambda: R.attention_backward(_DO.tolist(), _Q, _K, _K), TypeError, "dout"),
    "q heads": (lambda: R.attention_backward(_DO, _Q, _K[:, :, :1].repeat(3, 2), _K[:, :, :1]
                                             .repeat(3, 2)), ValueError, "k"),
    "stream dout": (lambda: R.streaming_attention_backward(_DO[..., :1, :], _Q, _K, _K, _OUT,
                                                           _LSE), ValueError, "dout"),
    "stream lse shape": (lambda: R.streaming_attention_backward(_DO, _Q, _K, _K, _OUT,
                                                                _LSE.transpose(0, 2, 1)),
                         ValueError, "lse"),
    "stream lse dtype": (lambda: R.streaming_attention_backward(_DO, _Q, _K, _K, _OUT,
                                                                _LSE.astype(np.int32)),
                         TypeError, "lse"),
    "stream out shape": (lambda: R.streaming_attention_backward(_DO, _Q, _K, _K, _OUT[:, :4],
                                                                _LSE), ValueError, "out"),
    "stream block_size_m": (lambda: R.streaming_attention_backward(_DO, _Q, _K, _K, _OUT, _LSE,
                                                                   block_size_m=0),
                            ValueError, "block_size_m"),
    "stream dtype": (lambda: R.streaming_attention_backward(_DO, _Q, _K, _K, _OUT, _LSE,
                                                            dtype=np.int32), TypeError, "dtype"),
    "varlen dout": (lambda: R.varlen_attention_backward(_DO[0, :4], _Q[0], _K[0], _K[0], *_CU),
                    ValueError, "dout"),
    "varlen cu": (lambda: R.varlen_attention_backward(_DO[0], _Q[0], _K[0], _K[0], _CU[0][::-1],
                                                      _CU[1]), ValueError, "cu_seqlens_q"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_backward_checks_before_work(case, monkeypatch):
    def trap(*args, **kwargs):
        raise AssertionError("computation started before validation")
    for fn in ("_backward_one_shot", "_stream_backward", "_exp_scores"):
        monkeypatch.setattr(R, fn, trap)
    call, exc, name = BAD[case]
    with pytest.raises(exc) as info:
        call()
    assert str(info.value).startswith(name + ":"), str(info.value)
