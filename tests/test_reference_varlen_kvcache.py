"""Properties of the reference for packed variable-length batches and KV-cache decoding."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from cupyflash import reference as R
from cupyflash import testing as T
from cupyflash.testing import rel_error

pytestmark = pytest.mark.filterwarnings("error")


def same_lse(a, b, tol):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape and not np.isnan(a).any()
    assert np.array_equal(np.isneginf(a), np.isneginf(b)), "empty rows differ"
    fin = np.isfinite(b)
    return bool((np.abs(a[fin] - b[fin]) <= tol * (1 + np.abs(b[fin]))).all())


@given(T.varlen_cases())
def test_varlen_equals_per_sequence(case):
    out, lse = R.varlen_attention_reference(case.q, case.k, case.v, case.cu_seqlens_q,
                                            case.cu_seqlens_k, case.max_seqlen_q,
                                            case.max_seqlen_k, **case.kwargs())
    assert out.shape == case.q.shape and lse.shape == (case.q.shape[1], case.q.shape[0])
    cq, ck = case.cu_seqlens_q, case.cu_seqlens_k
    for b in range(len(case.lengths_q)):
        rows, keys = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        o_b, l_b = R.attention_reference(case.q[None, rows], case.k[None, keys],
                                         case.v[None, keys], **case.kwargs())
        assert rel_error(out[rows], o_b[0]) <= 1e-13
        assert same_lse(lse[:, rows], l_b[0], 1e-13)


@given(T.kvcache_cases(paged=True))
def test_paged_equals_contiguous(case):
    """Same logical cache, paged (shuffled pages, NaN in every unused slot) vs contiguous."""
    res = R.kvcache_attention_reference(*case.args(), **case.kwargs())
    ref = R.kvcache_attention_reference(case.q, case.k_cache_contiguous, case.v_cache_contiguous,
                                        case.k, case.v, case.cache_seqlens, None, **case.kwargs())
    assert not np.isnan(res.out).any()                 # NaN tails never read
    assert rel_error(res.out, ref.out) <= 1e-15
    assert same_lse(res.lse, ref.lse, 1e-15)
    if case.k is not None:                             # the appended tokens land in the same place
        valid = (np.arange(case.k_cache_contiguous.shape[1])[None, :]
                 < (case.cache_seqlens + case.seqlen_new)[:, None])
        for new, old in ((res.k_cache, ref.k_cache), (res.v_cache, ref.v_cache)):
            assert np.array_equal(T.paged_to_contiguous(new, case.block_table)[valid], old[valid])


@given(T.kvcache_cases(paged=False, append=False, causal=True))
def test_decode_equals_last_rows_of_causal_prefill(case):
    """Decoding seqlen_q new queries against L cached keys == the last seqlen_q rows of causal
    prefill over those L keys (queries of earlier positions are irrelevant to those rows)."""
    sq = case.q.shape[1]
    res = R.kvcache_attention_reference(*case.args(), **case.kwargs())
    rng = np.random.default_rng(case.seed)
    for b, length in enumerate(case.cache_seqlens):
        keys = slice(0, int(length))
        earlier = rng.standard_normal((1, max(int(length) - sq, 0), *case.q.shape[2:]))
        q_full = np.concatenate([earlier.astype(case.q.dtype), case.q[b:b + 1]], axis=1)
        out, lse = R.attention_reference(q_full, case.k_cache[b:b + 1, keys],
                                         case.v_cache[b:b + 1, keys], causal=True,
                                         softmax_scale=case.softmax_scale)
        assert rel_error(res.out[b], out[0, -sq:]) <= 1e-13
        assert same_lse(res.lse[b], lse[0, :, -sq:], 1e-13)


@given(T.kvcache_cases(append=True))
def test_append_then_attend_equals_concatenated_cache(case):
    res = R.kvcache_attention_reference(*case.args(), **case.kwargs())
    snew = case.seqlen_new
    for b, length in enumerate(case.cache_seqlens):
        length = int(length)
        kc = case.k_cache_contiguous[b:b + 1, :length]
        vc = case.v_cache_contiguous[b:b + 1, :length]
        k_all = np.concatenate([kc, case.k[b:b + 1]], axis=1)
        v_all = np.concatenate([vc, case.v[b:b + 1]], axis=1)
        out, lse = R.attention_reference(case.q[b:b + 1], k_all, v_all, **case.kwargs())
        assert rel_error(res.out[b], out[0]) <= 1e-13
        assert same_lse(res.lse[b], lse[0], 1e-13)
        if not case.paged:
            assert np.array_equal(res.k_cache[b, length:length + snew], case.k[b])
            assert np.array_equal(res.v_cache[b, length:length + snew], case.v[b])


@given(T.kvcache_cases(append=True))
def test_kvcache_reference_does_not_mutate_inputs(case):
    before = [x.copy() for x in (case.k_cache, case.v_cache)]
    R.kvcache_attention_reference(*case.args(), **case.kwargs())
    for x, y in zip(before, (case.k_cache, case.v_cache)):
        assert np.array_equal(x, y, equal_nan=True)


def test_empty_cache_gives_zero_and_neg_inf():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 1, 2, 8))
    kc = np.full((2, 4, 1, 8), np.nan)
    kc[1, :2] = rng.standard_normal((2, 1, 8))
    res = R.kvcache_attention_reference(q, kc, kc, cache_seqlens=np.array([0, 2], np.int32))
    assert np.all(res.out[0] == 0) and np.all(res.lse[0] == -np.inf)
    assert np.isfinite(res.out[1]).all() and np.isfinite(res.lse[1]).all()


@given(T.kvcache_cases(paged=False, append=False), st.integers(1, 6))
def test_kvcache_split_then_merge_equals_one_split(case, num_splits):
    """Flash-Decoding: any split count merged == one split (reference split over the cache)."""
    res = R.kvcache_attention_reference(*case.args(), **case.kwargs())
    sq = case.q.shape[1]
    for b, length in enumerate(case.cache_seqlens):
        keys = slice(0, int(length))
        window = (-1, 0) if case.causal else (-1, -1)
        parts = R.split_kv_partials(case.q[b:b + 1], case.k_cache[b:b + 1, keys],
                                    case.v_cache[b:b + 1, keys], num_splits=num_splits,
                                    block_size_k=4, window_size=window,
                                    softmax_scale=case.softmax_scale)
        out, lse = R.merge_states(*parts)
        assert out.shape == (1, sq, *case.q.shape[2:])
        assert rel_error(out[0], res.out[b]) <= 1e-13
        assert same_lse(lse[0], res.lse[b], 1e-13)


def test_strategies_draw_edge_cases():
    """The strategies reach the edges the kernels care about (lengths 0/1, tile neighbours)."""
    from hypothesis import find
    find(T.seqlens(64), lambda n: n == 0)
    find(T.seqlens(64), lambda n: n == 33)
    find(T.kvcache_cases(paged=True), lambda c: c.page_size == 1 and (c.cache_seqlens == 0).any())
    find(T.head_counts(), lambda hc: hc[0] == 4 * hc[1] and hc[1] > 1)


def test_kvcache_reference_and_explain_reject_lists_alike():
    """A block_table (or q) given as a Python list, or a cache_seqlens list of non-ints: the
    reference raises the TypeError that explain_kvcache and the GPU call raise, naming the
    argument (it used to convert the list to int64 and complain about the dtype; fresh-user
    trial, 2026-11-29, 99d506f). cache_seqlens as an int or a list of ints (FlashAttention's forms) is
    accepted by all three, and means the int32 array of those lengths."""
    import ml_dtypes
    import cupyflash
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 1, 8, 128)).astype(ml_dtypes.bfloat16)
    pool = rng.standard_normal((4, 16, 2, 128)).astype(ml_dtypes.bfloat16)
    cs = np.array([40], np.int32)
    bt = np.array([[0, 1, 2]], np.int32)
    for name, kw in (("block_table", dict(cache_seqlens=cs, block_table=bt.tolist())),
                     ("cache_seqlens", dict(cache_seqlens=[40.0], block_table=bt))):
        msgs = []
        for fn in (cupyflash.explain_kvcache, R.kvcache_attention_reference):
            with pytest.raises(TypeError, match=f"^{name}: expected an (int32 |integer )?array") as e:
                fn(q, pool, pool, **kw)
            msgs.append(str(e.value))
        assert msgs[0] == msgs[1]
    want = R.kvcache_attention_reference(q, pool, pool, cache_seqlens=cs, block_table=bt)
    for lengths in ([40], (40,), 40):
        got = R.kvcache_attention_reference(q, pool, pool, cache_seqlens=lengths,
                                            block_table=bt)
        assert np.array_equal(got.out, want.out) and np.array_equal(got.lse, want.lse)
        plan = cupyflash.explain_kvcache(q, pool, pool, cache_seqlens=lengths, block_table=bt,
                                         report=False)
        assert plan == cupyflash.explain_kvcache(q, pool, pool, cache_seqlens=cs,
                                                 block_table=bt, report=False)
    with pytest.raises(TypeError, match="^q: expected an array"):
        R.kvcache_attention_reference(q.tolist(), pool, pool, cache_seqlens=cs,
                                              block_table=bt)
    with pytest.raises(TypeError, match="^o_parts: expected an array"):
        R.merge_states([[0.0]], np.zeros((1,), np.float32))
