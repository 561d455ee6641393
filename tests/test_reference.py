"""Properties of the NumPy reference: online softmax, split-KV + merge, invariances, overflow.

Each property is its own test; Hypothesis draws shapes (lengths including 0, 1 and block-size
neighbours), GQA ratios, head dims, masks and fresh random data (``cupyflash.testing``).
"""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from cupyflash import reference as R
from cupyflash import testing as T
from cupyflash.testing import rel_error

pytestmark = pytest.mark.filterwarnings("error")

EPS32 = float(np.finfo(np.float32).eps)


def lse_close(a, b, tol):
    """|a - b| <= tol * (1 + |b|) elementwise, with equal infinities (-inf rows) exact."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    assert not np.isnan(a).any()
    same = a == b
    assert np.array_equal(np.isneginf(a), np.isneginf(b)), "empty rows differ"
    with np.errstate(invalid="ignore"):                 # -inf - -inf where both are empty
        diff = np.abs(np.where(same, 0.0, a - b))
    return bool((diff <= tol * (1 + np.where(np.isfinite(b), np.abs(b), 0))).all())


# ----------------------------------------------------------------------------------------------
# Online softmax == one-shot softmax
# ----------------------------------------------------------------------------------------------
@given(T.attention_cases(), st.sampled_from([1, 3, 16, 64]))
def test_online_equals_one_shot_float64(case, block):
    out, lse = R.online_softmax_attention(case.q, case.k, case.v, block_size_k=block,
                                          dtype=np.float64, **case.kwargs())
    ref, ref_lse = R.attention_reference(case.q, case.k, case.v, **case.kwargs())
    assert rel_error(out, ref) <= 1e-13
    assert lse_close(lse, ref_lse, 1e-13)


@given(T.attention_cases(dtypes=("float32",)), st.sampled_from([7, 16, 64]))
def test_online_float32_within_derived_bound(case, block):
    """float32 streaming vs the exact (float64) result: within the bound derived in
    ``testing.streaming_error_bound`` (rel_error <= eps32 * sqrt(sum_i K_i^2 ||W_i||^2)/||o||,
    K_i = (2d + 12) A_i + 2 c_exp + 2 (c_exp + 1) n_blk + 2 nb + 2 n_blk + 1)."""
    out, lse = R.online_softmax_attention(case.q, case.k, case.v, block_size_k=block,
                                          **case.kwargs())
    assert out.dtype == np.float32 and lse.dtype == np.float32
    ref, ref_lse = R.attention_reference(case.q, case.k, case.v, **case.kwargs())
    out_bound, lse_bound = T.streaming_error_bound(case.q, case.k, case.v, block_size_k=block,
                                                   **case.kwargs())
    assert rel_error(out, ref) <= out_bound
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert (np.abs(lse[fin].astype(np.float64) - ref_lse[fin]) <= lse_bound[fin]).all()


def test_float32_bound_is_informative():
    """The float32 bound at a typical shape (d = 64, 256 keys, unit-normal data) is a few
    hundred eps times the conditioning, i.e. far below 1; the measured error is far below it."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 64, 2, 64)).astype(np.float32) for _ in range(3))
    k, v = (rng.standard_normal((1, 256, 2, 64)).astype(np.float32) for _ in range(2))
    out, _ = R.online_softmax_attention(q, k, v)
    ref, _ = R.attention_reference(q, k, v)
    bound, _ = T.streaming_error_bound(q, k, v)
    err = rel_error(out, ref)
    assert err <= bound < 1e-2
    assert err <= 16 * EPS32 * math.sqrt(64)


# ----------------------------------------------------------------------------------------------
# Split-KV and merge
# ----------------------------------------------------------------------------------------------
@given(T.attention_cases(), st.integers(1, 9), st.sampled_from([1, 8, 16]))
def test_splits_then_merge_equals_unsplit(case, num_splits, block):
    o_parts, lse_parts = R.split_kv_partials(case.q, case.k, case.v, num_splits=num_splits,
                                             block_size_k=block, **case.kwargs())
    assert o_parts.shape == (num_splits, *case.q.shape)
    out, lse = R.merge_states(o_parts, lse_parts)
    ref, ref_lse = R.attention_reference(case.q, case.k, case.v, **case.kwargs())
    assert rel_error(out, ref) <= 1e-13
    assert lse_close(lse, ref_lse, 1e-13)


def test_empty_splits_are_zero_and_neg_inf():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 3, 1, 8)) for _ in range(3))
    o_parts, lse_parts = R.split_kv_partials(q, k, v, num_splits=5, block_size_k=1)
    assert np.all(o_parts[3:] == 0) and np.all(lse_parts[3:] == -np.inf)
    assert R.split_boundaries(3, 5, 1) == [(0, 1), (1, 2), (2, 3), (3, 3), (3, 3)]
    assert R.split_boundaries(0, 2, 64) == [(0, 0), (0, 0)]


@st.composite
def states(draw, n=1):
    """n partial states (o, lse) of one shape, some rows empty (0, -inf)."""
    b, s, h = draw(st.integers(1, 2)), draw(st.integers(1, 5)), draw(st.integers(1, 3))
    d = draw(T.headdims(32))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    out = []
    for _ in range(n):
        o = rng.standard_normal((b, s, h, d))
        lse = rng.standard_normal((b, h, s)) * 5
        empty = rng.random((b, h, s)) < 0.2
        lse[empty] = -np.inf
        o[empty.transpose(0, 2, 1)] = 0.0
        out.append((o, lse))
    return out


def merge(*parts):
    return R.merge_states(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]))


@given(states(1))
def test_merge_identity(parts):
    (o, lse), = parts
    empty_o = np.full_like(o, np.nan)                  # an empty part's o is never read
    out, out_lse = merge((o, lse), (empty_o, np.full_like(lse, -np.inf)))
    assert np.array_equal(out, o) and np.array_equal(out_lse, lse)
    both, both_lse = merge((np.zeros_like(o), np.full_like(lse, -np.inf)),
                           (empty_o, np.full_like(lse, -np.inf)))
    assert np.all(both == 0) and np.all(both_lse == -np.inf)


@given(states(2))
def test_merge_commutative(parts):
    x, y = parts
    a, b = merge(x, y), merge(y, x)
    assert rel_error(a[0], b[0]) <= 1e-15 and lse_close(a[1], b[1], 1e-15)


@given(states(3))
def test_merge_associative(parts):
    x, y, z = parts
    left = merge(merge(x, y), z)
    right = merge(x, merge(y, z))
    flat = merge(x, y, z)
    for o, lse in (left, right):
        assert rel_error(o, flat[0]) <= 1e-14 and lse_close(lse, flat[1], 1e-14)


# ----------------------------------------------------------------------------------------------
# Invariances
# ----------------------------------------------------------------------------------------------
@given(T.attention_cases(), st.floats(-1e3, 1e3))
def test_shift_invariance(case, c):
    """Adding c to every score of a row: output unchanged, LSE + c. Realised by 8 extra head
    dims: q gets c / scale in the first, k gets 1 there (so q'k'^T * scale = q k^T * scale + c)."""
    d = case.q.shape[-1]
    scale = case.softmax_scale if case.softmax_scale is not None else 1 / math.sqrt(d)
    pad_q = np.zeros((*case.q.shape[:-1], 8))
    pad_q[..., 0] = c / scale
    pad_k = np.zeros((*case.k.shape[:-1], 8))
    pad_k[..., 0] = 1.0
    q2 = np.concatenate([case.q, pad_q], axis=-1)
    k2 = np.concatenate([case.k, pad_k], axis=-1)
    v2 = np.concatenate([case.v, np.zeros_like(pad_k)], axis=-1)
    kw = dict(softmax_scale=scale, causal=case.causal, window_size=case.window_size)
    out, lse = R.attention_reference(case.q, case.k, case.v, **kw)
    out2, lse2 = R.attention_reference(q2, k2, v2, **kw)
    assert rel_error(out2[..., :d], out) <= 1e-12
    assert lse_close(lse2 - c, lse, 1e-12 * (1 + abs(c)))


@given(T.attention_cases(windows=False, causal=False), st.integers(0, 2**32 - 1))
def test_key_permutation_invariance(case, seed):
    perm = np.random.default_rng(seed).permutation(case.k.shape[1])
    out, lse = R.attention_reference(case.q, case.k, case.v, **case.kwargs())
    out2, lse2 = R.attention_reference(case.q, case.k[:, perm], case.v[:, perm], **case.kwargs())
    assert rel_error(out2, out) <= 1e-13 and lse_close(lse2, lse, 1e-13)


@given(T.attention_cases(max_group=4))
def test_gqa_equals_repeated_kv_heads(case):
    nheads, nheads_k = case.q.shape[2], case.k.shape[2]
    group = nheads // nheads_k
    out, lse = R.attention_reference(case.q, case.k, case.v, **case.kwargs())
    rep = [np.repeat(x, group, axis=2) for x in (case.k, case.v)]
    out2, lse2 = R.online_softmax_attention(case.q, *rep, block_size_k=16, dtype=np.float64,
                                            **case.kwargs())
    assert rel_error(out2, out) <= 1e-13 and lse_close(lse2, lse, 1e-13)
    for h in range(nheads):                            # query head h reads KV head h // group
        kv = slice(h // group, h // group + 1)
        o_h, l_h = R.attention_reference(case.q[:, :, h:h + 1], case.k[:, :, kv],
                                         case.v[:, :, kv], **case.kwargs())
        assert np.array_equal(o_h[:, :, 0], out[:, :, h]) and np.array_equal(l_h[:, 0], lse[:, h])


# ----------------------------------------------------------------------------------------------
# Semantics pinned down by hand
# ----------------------------------------------------------------------------------------------
def test_causal_is_bottom_right_and_empty_rows_are_zero_neg_inf():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 5, 1, 8))
    k, v = rng.standard_normal((1, 3, 1, 8)), rng.standard_normal((1, 3, 1, 8))
    out, lse = R.attention_reference(q, k, v, causal=True)
    # row i sees keys j <= i + 3 - 5: rows 0, 1 see nothing; row 2 sees key 0; row 4 sees all
    assert np.all(out[0, :2] == 0) and np.all(lse[0, 0, :2] == -np.inf)
    assert np.allclose(out[0, 2, 0], v[0, 0, 0], rtol=0, atol=1e-15)
    full, full_lse = R.attention_reference(q[:, 4:], k, v)
    assert rel_error(out[:, 4:], full) <= 1e-15 and lse_close(lse[:, :, 4:], full_lse, 1e-15)
    for fn in (R.attention_reference, R.online_softmax_attention):
        o, l = fn(q, k[:, :0], v[:, :0])               # no keys at all
        assert np.all(o == 0) and np.all(l == -np.inf)


def test_window_mask_table():
    m = R.attention_mask(3, 5, window_size=(1, 0))
    # diagonal at j = i + 2; visible j in [i + 1, i + 2]
    assert m.astype(int).tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    assert np.array_equal(R.attention_mask(3, 5, causal=True),
                          R.attention_mask(3, 5, window_size=(-1, 0)))


def test_softmax_scale_default_and_q_zero_gives_mean_of_v():
    rng = np.random.default_rng(4)
    k, v = rng.standard_normal((1, 6, 1, 16)), rng.standard_normal((1, 6, 1, 16))
    out, lse = R.attention_reference(np.zeros((1, 2, 1, 16)), k, v)
    assert np.allclose(out[0, :, 0], v[0, :, 0].mean(0), rtol=0, atol=1e-15)
    assert np.allclose(lse, math.log(6), rtol=0, atol=1e-15)


# ----------------------------------------------------------------------------------------------
# Large logits: the running max is what keeps the streaming sum finite
# ----------------------------------------------------------------------------------------------
def big_logit_problem(seed=5, n=64):
    """Scores 1e4 + (small integer): exact in float32 (integer products and sums < 2^24)."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-3, 4, (1, 8, 2, 8)).astype(np.float32)
    k = rng.integers(-3, 4, (1, n, 2, 8)).astype(np.float32)
    q[..., 0], k[..., 0] = 100.0, 100.0
    v = rng.standard_normal((1, n, 2, 8)).astype(np.float32)
    return q, k, v


def naive_streaming_sum(q, k, v, block=16, dtype=np.float32):
    """Streaming softmax WITHOUT the running max: l += sum exp(s), acc += exp(s) v."""
    qh, kh, vh = (x.transpose(0, 2, 1, 3).astype(dtype) for x in (q, k, v))
    l = np.zeros(qh.shape[:-1], dtype)
    acc = np.zeros(qh.shape, dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        for s0 in range(0, kh.shape[2], block):
            s = qh @ kh[:, :, s0:s0 + block].swapaxes(-1, -2)
            p = np.exp(s)
            l = l + p.sum(-1)
            acc = acc + p @ vh[:, :, s0:s0 + block]
        return (acc / l[..., None]).transpose(0, 2, 1, 3)


def test_large_logits_stay_finite_and_exact_with_running_max():
    q, k, v = big_logit_problem()
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k.astype(np.float64))
    assert 9.9e3 <= np.abs(s).min() and np.abs(s).max() <= 1.01e4
    out, lse = R.online_softmax_attention(q, k, v, softmax_scale=1.0, block_size_k=16)
    ref, ref_lse = R.attention_reference(q, k, v, softmax_scale=1.0)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    bound, _ = T.streaming_error_bound(q, k, v, softmax_scale=1.0, block_size_k=16)
    assert rel_error(out, ref) <= bound
    # The scores are exact here, so the A-terms of the bound vanish and only exp, the rescales
    # and the sums round: K = 2 c_exp + 2 (c_exp + 1) n_blk + 2 nb + 2 n_blk + 1 = 129
    # (c_exp = 8, n_blk = 4, nb = 16), rel_error <= eps32 * K * ||W|| / ||o||, W = P |v|.
    probs = np.exp(s - ref_lse[..., None])                            # (b, h, sq, sk)
    w = probs @ np.abs(v.astype(np.float64)).transpose(0, 2, 1, 3)
    kappa = np.linalg.norm(w) / np.linalg.norm(ref)
    assert rel_error(out, ref) <= 129 * EPS32 * kappa
    assert lse_close(lse, ref_lse, 4 * EPS32)


def test_large_logits_overflow_without_running_max():
    q, k, v = big_logit_problem()
    for dt in (np.float32, np.float64):                # exp(1e4) overflows even float64
        out = naive_streaming_sum(q, k, v, dtype=dt)
        assert not np.isfinite(out).any()
    # the same naive sum is fine for small logits: it is the magnitude, not the method
    small = naive_streaming_sum(q / 100, k / 100, v, dtype=np.float64)
    ref, _ = R.attention_reference(q / 100, k / 100, v, softmax_scale=1.0)
    assert rel_error(small, ref) <= 1e-13


# ----------------------------------------------------------------------------------------------
# Exact at any finite magnitude (docs/semantics.md, 6): the NumPy counterpart of the kernels'
# SoftmaxRow, streamed in float32 and float64, against the float64 one-shot reference
# ----------------------------------------------------------------------------------------------
@given(T.magnitude_cases(dtypes=("float16", "bfloat16", "float32", "float64")),
       st.sampled_from(("float32", "float64")), st.sampled_from((16, 64)))
def test_streaming_is_exact_at_any_magnitude_and_shift(case, acc, block):
    kw = case.kwargs()
    ref, ref_lse = R.attention_reference(case.q, case.k, case.v, **kw)
    out_tol, lse_tol = T.magnitude_tolerance(case.q, case.k, case.v, acc, accumulate=acc, **kw)
    for q, lse_shift in ((case.q, 0.0), (case.q_shifted, case.shift * case.softmax_scale)):
        out, lse = R.online_softmax_attention(q, case.k, case.v, block_size_k=block, dtype=acc, **kw)
        assert np.isfinite(out).all()
        assert np.all(np.abs(out.astype(np.float64) - ref) <= out_tol)
        fin = np.isfinite(ref_lse)
        assert np.array_equal(np.isneginf(lse), ~fin)
        want = ref_lse + lse_shift
        assert np.all(np.abs(lse[fin].astype(np.float64) - want[fin]) <= lse_tol[fin] + 8 * EPS32 * np.abs(want[fin]))


@given(T.magnitude_cases(dtypes=("float32", "float64"), max_seqlen_k=1, causal=False))
def test_one_visible_key_gives_its_value_row_at_any_magnitude(case):
    out, lse = R.online_softmax_attention(case.q_shifted, case.k, case.v, dtype=np.float32,
                                          **case.kwargs())
    group = case.q.shape[2] // case.k.shape[2]
    want = np.repeat(case.v[:, :1].astype(np.float32), group, axis=2)
    assert np.array_equal(out, np.broadcast_to(want, out.shape))
    assert np.isfinite(lse).all()
