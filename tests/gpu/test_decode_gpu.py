"""GPU: split-KV decoding (flash_attn_with_kvcache), the KV append, and merge_states against the
float64 reference, on NaN-poisoned caches, pages and workspaces.

Accuracy rule (as FlashAttention's tests): the kernel's normwise relative error against the
float64 reference is at most twice that of a straightforward same-precision implementation
(scores in float64, unnormalised probabilities rounded to the dtype before P V, output rounded to
the dtype: what any fp16/bf16 tensor-core attention does) plus a quarter of the dtype's epsilon.
LSE (fp32 throughout): absolute error <= 1e-4 * (1 + |lse|); -inf exactly where the reference has it.
"""
import ctypes

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

cupy = pytest.importorskip("cupy")
# tests/gpu/conftest.py skips every gpu test when CuPy sees no device
pytestmark = pytest.mark.gpu

import ml_dtypes  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import decode, reference, testing  # noqa: E402
from cupyflash.core import checks
from cupyflash.decode import flash_attn_with_kvcache, merge_states  # noqa: E402
from gpu_arrays import to_device as _dev, to_host as _host  # noqa: E402 (tests/gpu/gpu_arrays.py)
from profiles import examples  # noqa: E402 (tests/gpu/profiles.py)

NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23}




def _nan_tailed_case(seed, cs, cap, hk, h, d, dtype, *, sq=1, page=0, table_seed=1,
                     spare_pages=3):
    """A KVCacheCase with ragged lengths ``cs`` whose cache tails (keys >= cs[b]) hold NaN:
    K, V, then q drawn from ``default_rng(seed)``; paged (``page`` > 0) through a table
    shuffled by ``default_rng(table_seed)`` with ``spare_pages`` unused pages."""
    rng = np.random.default_rng(seed)
    batch = len(cs)
    kc = testing.random_normal(rng, (batch, cap, hk, d), dtype)
    vc = testing.random_normal(rng, (batch, cap, hk, d), dtype)
    tail = np.arange(cap)[None, :] >= cs[:, None]
    kc[tail] = np.nan
    vc[tail] = np.nan
    q = testing.random_normal(rng, (batch, sq, h, d), dtype)
    bt = None
    kpool, vpool = kc, vc
    if page:
        kpool, bt = testing.contiguous_to_paged(kc, page, np.random.default_rng(table_seed),
                                                spare_pages)
        vpool, _ = testing.contiguous_to_paged(vc, page, np.random.default_rng(table_seed),
                                               spare_pages)
    return testing.KVCacheCase(q=q, k_cache=kpool, v_cache=vpool, k=None, v=None,
                               cache_seqlens=cs, block_table=bt, softmax_scale=None,
                               causal=True, page_size=page, seed=seed, k_cache_contiguous=kc,
                               v_cache_contiguous=vc)


_NAN_BITS = {"float16": 0x7E00, "bfloat16": 0x7FC0}


def _nan_like(x):
    """A CuPy array shaped like ``x`` (CuPy, 16-bit float) filled with NaN bits."""
    y = cupy.empty(x.shape, x.dtype)
    y.view(cupy.uint16).fill(_NAN_BITS[checks.dtype_name(x)])
    return y


def _gathered(case):
    """Per sequence: float64 K, V (L_b, nheads_k, d) of its first L_b = cache + new tokens."""
    f = np.float64
    res = []
    for b in range(case.q.shape[0]):
        c = int(case.cache_seqlens[b])
        kb = case.k_cache_contiguous[b, :c].astype(f)
        vb = case.v_cache_contiguous[b, :c].astype(f)
        if case.k is not None:
            kb = np.concatenate([kb, case.k[b].astype(f)])
            vb = np.concatenate([vb, case.v[b].astype(f)])
        res.append((kb, vb))
    return res


def _same_precision(case, dtype):
    """The straightforward same-precision implementation (see the module docstring)."""
    q = case.q.astype(np.float64)
    batch, sq, nh, d = q.shape
    hpk = nh // case.k_cache.shape[2]
    scale = checks.resolve_softmax_scale(case.softmax_scale, d)
    out = np.zeros(q.shape)
    for b, (kb, vb) in enumerate(_gathered(case)):
        L = kb.shape[0]
        j = np.arange(L)[None, :]
        i = np.arange(sq)[:, None]
        vis = (j <= i + L - sq) if case.causal else np.ones((sq, L), bool)
        for h in range(nh):
            s = np.where(vis, q[b, :, h] @ kb[:, h // hpk].T * scale, -np.inf)
            m = s.max(axis=1, initial=-np.inf)
            p = np.exp(s - np.where(np.isfinite(m), m, 0.0)[:, None])
            l = p.sum(axis=1)
            pr = p.astype(NP[dtype]).astype(np.float64)
            o = (pr @ vb[:, h // hpk]) / np.where(l == 0, 1.0, l)[:, None]
            out[b, :, h] = o.astype(NP[dtype]).astype(np.float64)
    return out


def _check_against_reference(case, out, lse, dtype):
    ref = reference.kvcache_attention_reference(*case.args(), **case.kwargs())
    out_h = _host(out).astype(np.float64)
    lse_h = cupy.asnumpy(lse).astype(np.float64)
    assert not np.isnan(out_h).any(), "NaN in out"
    assert not np.isnan(lse_h).any(), "NaN in lse"
    err = testing.rel_error(out_h, ref.out)
    base = testing.rel_error(_same_precision(case, dtype), ref.out)
    assert err <= 2 * base + 0.25 * EPS[dtype], (err, base)
    assert np.array_equal(np.isneginf(lse_h), np.isneginf(ref.lse))
    fin = np.isfinite(ref.lse)
    assert np.all(np.abs(lse_h[fin] - ref.lse[fin]) <= 1e-4 * (1 + np.abs(ref.lse[fin])))
    return ref


def _run(case, dtype, **kw):
    q, kc, vc, k, v, cs, bt = (_dev(x) for x in case.args())
    out = _nan_like(q)
    res = flash_attn_with_kvcache(q, kc, vc, k, v, cs, bt, softmax_scale=case.softmax_scale,
                                  causal=case.causal, return_lse=True, out=out, **kw)
    return res, (q, kc, vc, k, v, cs, bt)


# ----------------------------------------------------------------------------------------------
# Against the reference
# ----------------------------------------------------------------------------------------------
def _poisoned_workspace(q, kc, vc, k, v, cs, bt, **opts):
    """A workspace from alloc_workspace with its fp32 partials region NaN-poisoned (the
    documented contract: partials may hold anything, the fused combine's int32 counters at the
    end start at zero). Returns (workspace, used elements, counter elements)."""
    ws = decode.alloc_workspace(q, kc, vc, k, v, cs, bt, **opts)
    n = decode.workspace_size(q, kc, vc, k, v, cs, bt, **opts)
    counters = 0
    if n:
        b, sq, h, _ = q.shape
        hk = kc.shape[2]
        counters = b * hk * -(-(h // hk * sq) // decode.GROUP)
        ws[:n - counters] = np.nan
    else:
        ws.fill(np.nan)  # one split: the workspace is not touched
    return ws, n, counters


@st.composite
def split_options(draw):
    mode = draw(st.sampled_from(["heuristic", "explicit", "fixed"]))
    if mode == "heuristic":
        return dict(num_splits=0)
    if mode == "explicit":
        return dict(num_splits=draw(st.sampled_from([1, 2, 3, 5, 100])))
    return dict(split_size=draw(st.sampled_from([1, 64, 100, 300])))


@given(case=testing.kvcache_cases(dtypes=("float16", "bfloat16"), max_batch=3, max_seqlen_q=16,
                                  max_seqlen_new=4, max_pages_per_seq=64, max_seqlen_cache=600,
                                  max_headdim=256, max_nheads_k=2, max_group=8),
       opts=split_options(), poison_ws=st.booleans())
def test_kvcache_matches_reference(case, opts, poison_ws):
    dtype = checks.dtype_name(case.q)
    q, kc, vc, k, v, cs, bt = (_dev(x) for x in case.args())
    ws = None
    if poison_ws:
        ws, n, counters = _poisoned_workspace(q, kc, vc, k, v, cs, bt, **opts)
    out = _nan_like(q)
    o, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cs, bt, softmax_scale=case.softmax_scale,
                                     causal=case.causal, return_lse=True, out=out, workspace=ws,
                                     **opts)
    assert o is out and o.dtype == q.dtype and lse.dtype == cupy.float32
    ref = _check_against_reference(case, o, lse, dtype)
    if poison_ws and counters:  # the fused combine left its counters at zero
        assert bool((ws[n - counters:n].view(cupy.int32) == 0).all())
    if case.k is not None:  # append wrote exactly the reference's updated cache (NaN elsewhere)
        for got, want in ((kc, ref.k_cache), (vc, ref.v_cache)):
            g = _host(got)
            assert np.array_equal(np.isnan(g.astype(np.float64)), np.isnan(want.astype(np.float64)))
            assert np.array_equal(g.view(np.uint16)[~np.isnan(want.astype(np.float64))],
                                  want.view(np.uint16)[~np.isnan(want.astype(np.float64))])


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_llama_shape_long_cache(dtype, paged):
    """Llama-3-8B heads (32 / 8, hd128), ragged long caches, many tiles and splits."""
    case = _nan_tailed_case(7, np.array([4000, 1, 2500], np.int32), 4096, 8, 32, 128, dtype,
                            page=16 if paged else 0)
    for opts in (dict(num_splits=0), dict(num_splits=1), dict(num_splits=7)):
        (o, lse), _ = _run(case, dtype, **opts)
        _check_against_reference(case, o, lse, dtype)


def test_edge_cases_empty_and_masked_rows():
    """cache_seqlens == 0 -> (0, -inf); seqlen_q > L (causal) -> leading rows empty; more splits
    than tiles."""
    dtype = "bfloat16"
    case = _nan_tailed_case(3, np.array([0, 2, 80], np.int32), 80, 2, 4, 64, dtype, sq=5)
    for ns in (1, 2, 50):
        (o, lse), _ = _run(case, dtype, num_splits=ns)
        _check_against_reference(case, o, lse, dtype)
        oh, lh = _host(o).astype(np.float64), cupy.asnumpy(lse)
        assert np.all(oh[0] == 0) and np.all(np.isneginf(lh[0]))
        assert np.all(oh[1, :3] == 0) and np.all(np.isneginf(lh[1, :, :3]))  # 2 keys, 5 rows


# ----------------------------------------------------------------------------------------------
# Determinism, batch independence, append-then-attend
# ----------------------------------------------------------------------------------------------
@settings(max_examples=examples(10))
@given(case=testing.kvcache_cases(dtypes=("bfloat16",), append=False, max_batch=3,
                                  max_pages_per_seq=32, max_seqlen_cache=500, max_headdim=128,
                                  max_group=4),
       ns=st.sampled_from([0, 1, 4]))
def test_bitwise_repeatable(case, ns):
    (o1, l1), _ = _run(case, "bfloat16", num_splits=ns)
    (o2, l2), _ = _run(case, "bfloat16", num_splits=ns)
    assert np.array_equal(_host(o1).view(np.uint16), _host(o2).view(np.uint16))
    assert np.array_equal(cupy.asnumpy(l1).view(np.uint32), cupy.asnumpy(l2).view(np.uint32))


@settings(max_examples=examples(10))
@given(case=testing.kvcache_cases(dtypes=("float16",), append=False, max_batch=4,
                                  max_pages_per_seq=32, max_seqlen_cache=500, max_headdim=128,
                                  max_group=4),
       opts=st.sampled_from([dict(split_size=64), dict(split_size=200), dict(num_splits=3)]))
def test_row_result_independent_of_batch(case, opts):
    """split_size (and any explicit num_splits) make a row's result bitwise the same alone and
    inside the batch."""
    (o_all, l_all), (q, kc, vc, _, _, cs, bt) = _run(case, "float16", **opts)
    o_all, l_all = _host(o_all), cupy.asnumpy(l_all)
    for b in range(q.shape[0]):
        kcb = kc if bt is not None else kc[b:b + 1]
        vcb = vc if bt is not None else vc[b:b + 1]
        btb = None if bt is None else bt[b:b + 1]
        o1, l1 = flash_attn_with_kvcache(q[b:b + 1], kcb, vcb, cache_seqlens=cs[b:b + 1],
                                         block_table=btb, softmax_scale=case.softmax_scale,
                                         causal=case.causal, return_lse=True, **opts)
        assert np.array_equal(_host(o1)[0].view(np.uint16), o_all[b].view(np.uint16))
        assert np.array_equal(cupy.asnumpy(l1)[0].view(np.uint32), l_all[b].view(np.uint32))


def test_append_then_attend_equals_attend_over_appended_cache():
    rng = np.random.default_rng(11)
    dtype = "float16"
    for paged in (False, True):
        batch, cap, hk, h, d, sn = 2, 96, 2, 8, 128, 3
        cs = np.array([10, 70], np.int32)
        kc = testing.random_normal(rng, (batch, cap, hk, d), dtype)
        vc = testing.random_normal(rng, (batch, cap, hk, d), dtype)
        k = testing.random_normal(rng, (batch, sn, hk, d), dtype)
        v = testing.random_normal(rng, (batch, sn, hk, d), dtype)
        q = testing.random_normal(rng, (batch, sn, h, d), dtype)
        bt = None
        if paged:
            kc, bt = testing.contiguous_to_paged(kc, 16, np.random.default_rng(2), 2)
            vc, _ = testing.contiguous_to_paged(vc, 16, np.random.default_rng(2), 2)
        qd, kcd, vcd, kd, vd, csd = (_dev(x) for x in (q, kc, vc, k, v, cs))
        btd = _dev(bt)
        o1 = flash_attn_with_kvcache(qd, kcd, vcd, kd, vd, csd, btd, num_splits=2)
        o2 = flash_attn_with_kvcache(qd, kcd, vcd, cache_seqlens=csd + sn, block_table=btd,
                                     num_splits=2)
        assert np.array_equal(_host(o1).view(np.uint16), _host(o2).view(np.uint16))


# ----------------------------------------------------------------------------------------------
# merge_states on the GPU
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("odt", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("ldt", [np.float32, np.float64])
def test_merge_states_matches_reference(odt, ldt):
    rng = np.random.default_rng(5)
    parts, b, s, h, d = 6, 2, 3, 4, 72
    o = rng.standard_normal((parts, b, s, h, d)).astype(NP[odt])
    lse = (3 * rng.standard_normal((parts, b, h, s))).astype(ldt)
    lse[2] = -np.inf          # an empty part: its o is never read
    o[2] = np.nan
    lse[:, 1, 3, 2] = -np.inf  # a row with no part at all -> (0, -inf)
    ref_o, ref_l = reference.merge_states(o, lse)
    got_o, got_l = merge_states(_dev(o), _dev(lse))
    go = _host(got_o).astype(np.float64)
    gl = cupy.asnumpy(got_l).astype(np.float64)
    assert got_o.dtype == o.dtype and got_l.dtype == cupy.float32
    assert not np.isnan(go).any() and not np.isnan(gl).any()
    assert testing.rel_error(go, ref_o) <= 2 * EPS[odt]
    assert np.all(go[1, 2, 3] == 0) and np.isneginf(gl[1, 3, 2])
    fin = np.isfinite(ref_l)
    assert np.array_equal(fin, np.isfinite(gl))
    assert np.all(np.abs(gl[fin] - ref_l[fin]) <= 1e-5 * (1 + np.abs(ref_l[fin])))


# ----------------------------------------------------------------------------------------------
# CUDA graph capture, bad page ids without validation, unsupported dtype
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("paged,ns", [(False, 5), (True, 0), (False, 1)])
def test_cuda_graph_capture_and_replay(paged, ns):
    rng = np.random.default_rng(13)
    dtype = "bfloat16"
    batch, cap, hk, h, d = 2, 512, 2, 8, 128
    cs = np.array([300, 511], np.int32)
    kc = testing.random_normal(rng, (batch, cap, hk, d), dtype)
    vc = testing.random_normal(rng, (batch, cap, hk, d), dtype)
    q = testing.random_normal(rng, (batch, 1, h, d), dtype)
    bt = None
    if paged:
        kc, bt = testing.contiguous_to_paged(kc, 64, np.random.default_rng(4), 1)
        vc, _ = testing.contiguous_to_paged(vc, 64, np.random.default_rng(4), 1)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        qd, kcd, vcd, csd, btd = (_dev(x) for x in (q, kc, vc, cs, bt))
        ws = decode.alloc_workspace(qd, kcd, vcd, cache_seqlens=csd, block_table=btd,
                                    num_splits=ns)
        out = cupy.empty(qd.shape, qd.dtype)
        call = dict(cache_seqlens=csd, block_table=btd, num_splits=ns, out=out, validate=False,
                    workspace=ws)
        flash_attn_with_kvcache(qd, kcd, vcd, **call)  # warm-up: compile and load outside
        stream.synchronize()
        eager = _host(out).copy()
        out.view(cupy.uint16).fill(_NAN_BITS[dtype])
        stream.begin_capture()
        flash_attn_with_kvcache(qd, kcd, vcd, **call)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        assert np.array_equal(_host(out).view(np.uint16), eager.view(np.uint16))
        # new query values in place: the replay computes the new answer
        q2 = testing.random_normal(rng, q.shape, dtype)
        qd.view(cupy.uint16)[...] = _dev(q2).view(cupy.uint16)
        graph.launch(stream)
        stream.synchronize()
        replay = _host(out).copy()
        fresh = flash_attn_with_kvcache(qd, kcd, vcd, cache_seqlens=csd, block_table=btd,
                                        num_splits=ns)
        stream.synchronize()
        assert np.array_equal(replay.view(np.uint16), _host(fresh).view(np.uint16))


def test_calls_without_workspace_share_the_streams_counters():
    """Calls without ``workspace=`` take the fused combine's counters from a zero buffer kept per
    stream: calls of three shapes (one with more counters than the buffer's first size, so it
    grows) and several split counts, enqueued back to back on two streams at once without a
    synchronisation between them, all match the reference; the buffers are zero afterwards, and
    capturing such a call in a graph is refused before anything is enqueued."""
    dtype = "bfloat16"
    cases = [_nan_tailed_case(51, np.array([900, 0, 333], np.int32), 1024, 2, 8, 128, dtype),
             _nan_tailed_case(52, np.array([70, 1000], np.int32), 1024, 1, 4, 64, dtype,
                              page=16, table_seed=3),
             # 130 x 8 = 1040 counters > the buffer's first 1024
             _nan_tailed_case(53, np.random.default_rng(5).integers(0, 65, 130).astype(np.int32),
                              64, 8, 8, 64, dtype)]
    dev = [tuple(_dev(x) for x in (c.q, c.k_cache, c.v_cache, c.cache_seqlens, c.block_table))
           for c in cases]
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    results = []
    for rnd in range(2):
        for ns in (3, 16, 7):
            for stream in streams:
                for ci, (qd, kd, vd, csd, btd) in enumerate(dev):
                    with stream:
                        out, lse = flash_attn_with_kvcache(qd, kd, vd, cache_seqlens=csd,
                                                           block_table=btd, num_splits=ns,
                                                           return_lse=True, validate=False)
                    results.append((ci, out, lse))
    for stream in streams:
        stream.synchronize()
    for ci, out, lse in results:
        _check_against_reference(cases[ci], out, lse, dtype)
    bufs = [v[1] for k, v in decode._COUNTERS.items() if k[1] in {s.ptr for s in streams}]
    assert len(bufs) == 2 and all(b.size >= 1040 for b in bufs)
    assert all(int(cupy.count_nonzero(b)) == 0 for b in bufs)
    qd, kd, vd, csd, btd = dev[0]
    with streams[0]:
        out = cupy.empty(qd.shape, qd.dtype)
        streams[0].begin_capture()
        try:
            with pytest.raises(ValueError, match="workspace"):
                flash_attn_with_kvcache(qd, kd, vd, cache_seqlens=csd, num_splits=4, out=out,
                                        validate=False)
        finally:
            streams[0].end_capture()


def test_calls_without_workspace_on_the_per_thread_default_stream():
    """CuPy's per-thread default stream is one Python object whose work runs on each host
    thread's own CUDA stream: two threads calling back to back on it, without a workspace,
    each get their own counters (a shared buffer would let one thread's blocks count the
    other's arrivals) and match the reference."""
    import threading
    dtype = "bfloat16"
    case = _nan_tailed_case(61, np.array([1000, 517, 1], np.int32), 1024, 2, 8, 128, dtype)
    qd, kd, vd, csd = (_dev(x) for x in (case.q, case.k_cache, case.v_cache, case.cache_seqlens))
    found, errors = {}, []

    def work(tid):
        try:
            with cupy.cuda.Stream.ptds:
                outs = [flash_attn_with_kvcache(qd, kd, vd, cache_seqlens=csd, num_splits=ns,
                                                return_lse=True, validate=False)
                        for ns in (16, 3, 16, 7, 16) * 4]
                cupy.cuda.Stream.ptds.synchronize()
                table = decode._COUNTERS_PER_THREAD.table
                found[tid] = table[(cupy.cuda.runtime.getDevice(), cupy.cuda.Stream.ptds.ptr)][1]
            for out, lse in outs:
                _check_against_reference(case, out, lse, dtype)
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert found[0].data.ptr != found[1].data.ptr
    assert all(int(cupy.count_nonzero(b)) == 0 for b in found.values())


def test_bad_page_id_without_validation_is_memory_safe():
    """validate=False with a page id outside the pool: the kernels skip it (no out-of-bounds
    access; run under compute-sanitizer memcheck in the suite); other sequences are exact."""
    rng = np.random.default_rng(17)
    dtype = "float16"
    batch, cap, hk, h, d = 2, 64, 1, 2, 64
    cs = np.array([40, 40], np.int32)
    kc = testing.random_normal(rng, (batch, cap, hk, d), dtype)
    vc = testing.random_normal(rng, (batch, cap, hk, d), dtype)
    q = testing.random_normal(rng, (batch, 1, h, d), dtype)
    kp, bt = testing.contiguous_to_paged(kc, 16, np.random.default_rng(0), 0)
    vp, _ = testing.contiguous_to_paged(vc, 16, np.random.default_rng(0), 0)
    good = flash_attn_with_kvcache(_dev(q), _dev(kp), _dev(vp), cache_seqlens=_dev(cs),
                                   block_table=_dev(bt))
    bad_bt = bt.copy()
    bad_bt[1, 1] = 10 ** 6
    bad_bt[1, 2] = -5
    with pytest.raises(ValueError, match="block_table"):  # the device-side check (guard)
        flash_attn_with_kvcache(_dev(q), _dev(kp), _dev(vp), cache_seqlens=_dev(cs),
                                block_table=_dev(bad_bt))
        cupyflash.check_errors()
    k_new = testing.random_normal(rng, (batch, 2, hk, d), dtype)
    out = flash_attn_with_kvcache(_dev(q), _dev(kp), _dev(vp), cache_seqlens=_dev(cs),
                                  block_table=_dev(bad_bt), validate=False, num_splits=3)
    cupy.cuda.Device().synchronize()
    assert np.array_equal(_host(out)[0].view(np.uint16), _host(good)[0].view(np.uint16))
    # append with a bad page id and a length over the capacity: skipped, no crash
    flash_attn_with_kvcache(_dev(q), _dev(kp), _dev(vp), _dev(k_new), _dev(k_new),
                            cache_seqlens=_dev(np.array([62, 63], np.int32)),
                            block_table=_dev(bad_bt), validate=False)
    cupy.cuda.Device().synchronize()


def test_float32_is_rejected_on_gpu():
    q = cupy.zeros((1, 1, 2, 64), cupy.float32)
    kc = cupy.zeros((1, 8, 2, 64), cupy.float32)
    with pytest.raises(TypeError, match="float32"):
        flash_attn_with_kvcache(q, kc, kc)


# ----------------------------------------------------------------------------------------------
# The split kernel's paths against each other, bitwise: the fused combine, speculative page ids,
# copy pointers on pages, two stages, the Q tile by cp.async; shared memory NaN-poisoned first
# ----------------------------------------------------------------------------------------------
_POISON_SMEM = r"""
extern "C" __global__ void poison_smem(unsigned int bits, int words, unsigned int* sink) {
    extern __shared__ unsigned int sm[];
    for (int i = threadIdx.x; i < words; i += blockDim.x) sm[i] = bits;
    __syncthreads();
    if (sm[(threadIdx.x * 97) % words] != bits) *sink = 1;  // never: keeps the stores
}
"""


def _poison_shared_memory():
    """Fill every SM's shared memory with NaN bits (0x7FC0 pairs: NaN in bf16 and fp16) by two
    blocks per SM of the largest dynamic allocation, so that a kernel reading shared memory it
    did not write (a Q tile that never landed, padding never zeroed) reads NaN rather than the
    previous launch's identical leftovers."""
    dev = cupy.cuda.Device()
    words = dev.attributes["MaxSharedMemoryPerBlockOptin"] // 4
    kern = cupy.RawKernel(_POISON_SMEM, "poison_smem")
    kern.max_dynamic_shared_size_bytes = words * 4
    sink = cupy.zeros(1, cupy.uint32)
    kern((2 * dev.attributes["MultiProcessorCount"],), (1024,),
         (np.uint32(0x7FC07FC0), np.int32(words), sink), shared_mem=words * 4)
    dev.synchronize()
    assert int(sink.get()[0]) == 0


def _call_bits(case, dtype, q, kc, vc, cs, bt, ns, *, check=True, validate=True, ws=None):
    """One ``flash_attn_with_kvcache`` call with ``num_splits=ns`` over the CuPy arrays given
    (``case``'s values, in any layout), the output NaN-poisoned and, unless ``ws`` is passed, a
    workspace whose partials are NaN-poisoned (:func:`_poisoned_workspace`), shared memory
    NaN-poisoned last (:func:`_poison_shared_memory`); checked against the reference if
    ``check``; the fused combine's counters zero afterwards. Returns the output and LSE bits
    (host)."""
    if ws is None:
        ws, n, counters = _poisoned_workspace(q, kc, vc, None, None, cs, bt, num_splits=ns)
    else:
        n = counters = 0
    out = _nan_like(q)
    _poison_shared_memory()
    o, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, block_table=bt,
                                     softmax_scale=case.softmax_scale, causal=case.causal,
                                     num_splits=ns, return_lse=True, out=out, workspace=ws,
                                     validate=validate)
    if check:
        _check_against_reference(case, o, lse, dtype)
    if counters:
        assert bool((ws[n - counters:n].view(cupy.int32) == 0).all())
    return _host(o).view(np.uint16), cupy.asnumpy(lse).view(np.uint32)


@pytest.mark.parametrize("d", [128, 64, 256, 72])
@pytest.mark.parametrize("page,sq", [(0, 1), (16, 1), (0, 5), (3, 2)])
def test_fused_combine_matches_reference_and_resets_counters(d, page, sq):
    """The fused combine (the last split block of each (batch, KV head, row chunk) merges, v1,
    v9, v12) for split counts 2-19 (odd ones, more than 8 and 16: both merge batches, and more
    splits than tiles), ragged NaN-tailed caches, an empty sequence, GQA 4 and several query
    rows (two row chunks at sq = 5), contiguous and paged (pages of 16: copy pointers, of 3:
    page ids per row): matches the reference with NaN-poisoned partials, leaves its counters at
    zero, and a second launch on the same workspace gives bitwise the same output and LSE."""
    dtype = "bfloat16"
    hk, h, cap = 2, 8, 1200
    if page:
        cap = -(-cap // page) * page
    case = _nan_tailed_case(23, np.array([1100, 0, 311], np.int32), cap, hk, h, d, dtype,
                            sq=sq, page=page, table_seed=5, spare_pages=2)
    qd, kd, vd, csd, btd = (_dev(x) for x in (case.q, case.k_cache, case.v_cache,
                                              case.cache_seqlens, case.block_table))
    for ns in (2, 3, 7, 8, 12, 16, 19):
        ws, n, counters = _poisoned_workspace(qd, kd, vd, None, None, csd, btd, num_splits=ns)
        assert counters > 0 and n > counters
        first = _call_bits(case, dtype, qd, kd, vd, csd, btd, ns, ws=ws)
        assert bool((ws[n - counters:n].view(cupy.int32) == 0).all()), ns
        again = _call_bits(case, dtype, qd, kd, vd, csd, btd, ns, ws=ws)
        assert bool((ws[n - counters:n].view(cupy.int32) == 0).all()), ns
        assert np.array_equal(first[0], again[0]) and np.array_equal(first[1], again[1]), ns


def _capacity_edge_case(seed, page, d, table_seed):
    """Paged bf16 case (2 KV heads, 8 query heads) whose sequences are at capacity, one short of
    it, a page short, ragged and empty, with NaN cache tails, and whose table slots past each
    sequence's pages hold ids outside the pool (10^9 and -7 alternately)."""
    from dataclasses import replace
    cap = -(-1030 // page) * page
    cs = np.array([cap, cap - 1, cap - page, 517, 0], np.int32)
    case = _nan_tailed_case(seed, cs, cap, 2, 8, d, "bfloat16", page=page, table_seed=table_seed,
                            spare_pages=2)
    bt = case.block_table.copy()
    for b, n in enumerate(cs):
        used = -(-int(n) // page)
        bt[b, used:] = np.where(np.arange(bt.shape[1] - used) % 2 == 0, 10 ** 9, -7)
    return replace(case, block_table=bt)


def _reversed_pool(x):
    """The same pages as the CuPy pool ``x`` in a view with a negative page stride: its page
    offsets do not fit 32 bits, so the call runs the per-row page-id path (v20)."""
    y = x[::-1].copy()[::-1]
    assert y.strides[0] < 0 and bool((y.view(cupy.uint16) == x.view(cupy.uint16)).all())
    return y


@pytest.mark.parametrize("page", [1, 16, 64, 256])
def test_speculative_page_ids_give_the_contiguous_result(page):
    """The paged kernels up to hd128 guess each split's first tiles' page ids from the
    block_table width (v13). Sequences at capacity and one short of it (the guess is right), a
    page short, ragged and empty (the guess is wrong: the ids are fetched again), NaN cache
    tails, and table slots past each sequence's pages holding ids outside the pool (fetched by
    the guess, never dereferenced), with copy pointers and with per-row ids (a reversed pool):
    the reference, and bitwise the output and LSE of the same values in a contiguous cache (the
    same tile and split count), for 1-19 splits."""
    case = _capacity_edge_case(41, page, 128, 3)
    q, kd, vd, csd, btd = (_dev(x) for x in (case.q, case.k_cache, case.v_cache,
                                             case.cache_seqlens, case.block_table))
    kc, vc = _dev(case.k_cache_contiguous), _dev(case.v_cache_contiguous)
    krev, vrev = _reversed_pool(kd), _reversed_pool(vd)
    for name, k_, v_ in (("_paged_cp", kd, vd), ("_paged", krev, vrev)):
        plan = decode.explain_kvcache(q, k_, v_, cache_seqlens=csd, block_table=btd, num_splits=3,
                                      report=False)
        assert plan.name.endswith(name) and plan.template["block_n"] == 128, plan.name
    flat = decode.explain_kvcache(q, kc, vc, cache_seqlens=csd, num_splits=3, report=False)
    assert flat.template == dict(plan.template, paged=False), (flat.template, plan.template)
    for ns in (1, 2, 3, 8, 16, 19):
        want = _call_bits(case, "bfloat16", q, kc, vc, csd, None, ns)
        for k_, v_ in ((kd, vd), (krev, vrev)):
            got = _call_bits(case, "bfloat16", q, k_, v_, csd, btd, ns)
            assert np.array_equal(got[0], want[0]), (ns, k_.strides)
            assert np.array_equal(got[1], want[1]), (ns, k_.strides)


@pytest.mark.parametrize("page", [1, 2, 8, 16, 32, 64, 128, 256])
@pytest.mark.parametrize("d", [128, 72, 64])
def test_paged_copy_pointers_are_bitwise_the_per_row_page_ids(page, d):
    """v20: copy pointers on pages of a power-of-two size (one page id per page of a tile;
    pages smaller than a copy pass, between a pass and a tile, and of whole tiles) against the
    per-row page ids of the same pages (a reversed pool view, whose page offsets do not fit 32
    bits). Sequences at capacity, one short of it, a page short, ragged and empty, NaN cache
    tails, table slots past each sequence's pages holding ids outside the pool, a padded head
    dim (72 in hd128): the reference, and bitwise the same output and LSE, for 1-19 splits.
    Then ids outside the pool inside a sequence's pages (validate=False: those rows are
    zero-filled, never read): bitwise the same result."""
    case = _capacity_edge_case(43, page, d, 4)
    cs, bt = case.cache_seqlens, case.block_table
    bad = bt.copy()
    # outside the pool, inside pages the sequences read (seq 1: its last page)
    bad[0, 3], bad[3, 0] = -1, 2 ** 31 - 1
    bad[1, (int(cs[1]) - 1) // page] = case.k_cache.shape[0]
    q, kd, vd, csd = (_dev(x) for x in (case.q, case.k_cache, case.v_cache, cs))
    krev, vrev = _reversed_pool(kd), _reversed_pool(vd)
    for name, k_ in (("_paged_cp", kd), ("_paged", krev)):
        plan = decode.explain_kvcache(q, k_, k_, cache_seqlens=csd, block_table=_dev(bt),
                                      num_splits=3, report=False)
        assert plan.name.endswith(name), plan.name
    for ns in (1, 3, 16, 19):
        for table, check in ((bt, True), (bad, False)):
            btd = _dev(table)
            cp = _call_bits(case, "bfloat16", q, kd, vd, csd, btd, ns, check=check,
                            validate=check)
            rows = _call_bits(case, "bfloat16", q, krev, vrev, csd, btd, ns, check=check,
                              validate=check)
            assert np.array_equal(cp[0], rows[0]), (ns, check)
            assert np.array_equal(cp[1], rows[1]), (ns, check)



def test_paged_pools_past_32_bit_offsets_take_the_general_path():
    """Pages of a power-of-two size are addressed with 32-bit offsets (v20). Pool views whose
    offsets do not fit (a page stride of 2^31 elements; a reversed pool, negative strides) run
    the general paged kernel instead, say so in explain(), and give bitwise the result of the
    same pages in a plain pool (the two kernels compute the same; one page for the far view,
    so that its launch reads inside the buffer)."""
    rng = np.random.default_rng(3)
    q = _dev(testing.random_normal(rng, (1, 1, 2, 64), "bfloat16"))
    pool = _dev(testing.random_normal(rng, (1, 16, 1, 64), "bfloat16"))
    far = cupy.lib.stride_tricks.as_strided(pool, shape=pool.shape,
                                            strides=(2 ** 32,) + pool.strides[1:])
    cs, bt = _dev(np.array([10], np.int32)), _dev(np.zeros((1, 1), np.int32))
    plain = flash_attn_with_kvcache(q, pool, pool, cache_seqlens=cs, block_table=bt)
    for kc, vc in ((far, pool), (pool, far)):
        plan = decode.explain_kvcache(q, kc, vc, cache_seqlens=cs, block_table=bt, report=False)
        assert plan.name.endswith("_paged"), plan.name
        assert "negative or >= 2^31 elements" in str(plan)
        out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, block_table=bt)
        assert bool((out.view(cupy.uint16) == plain.view(cupy.uint16)).all())
    # a reversed pool of 6 pages: page i of the view is page 5 - i of the buffer
    case = _nan_tailed_case(9, np.array([40, 33], np.int32), 48, 2, 8, 128, "bfloat16", page=16,
                            table_seed=2, spare_pages=0)
    qd, kd, vd, csd, btd = (_dev(x) for x in (case.q, case.k_cache, case.v_cache,
                                              case.cache_seqlens, case.block_table))
    n = kd.shape[0]
    krev, vrev = kd[::-1].copy()[::-1], vd[::-1].copy()[::-1]  # same pages, negative strides
    assert krev.strides[0] < 0
    o1 = flash_attn_with_kvcache(qd, kd, vd, cache_seqlens=csd, block_table=btd, num_splits=3)
    o2, l2 = flash_attn_with_kvcache(qd, krev, vrev, cache_seqlens=csd, block_table=btd,
                                     num_splits=3, return_lse=True)
    assert n == 6 and bool((o1.view(cupy.uint16) == o2.view(cupy.uint16)).all())
    _check_against_reference(case, o2, l2, "bfloat16")


@pytest.mark.parametrize("page", [0, 16])
def test_several_waves_run_the_two_blocks_per_sm_tile(page):
    """More unsplit blocks than SMs (batch 20 x 8 KV heads = 160 > 132 on an H200): the
    heuristic runs hd128 with the 64-key tile at two blocks per SM (v9); ragged NaN-tailed
    caches still match the reference."""
    dtype = "bfloat16"
    cs = np.random.default_rng(31).integers(0, 700, 20).astype(np.int32)
    cs[0], cs[1] = 0, 1
    case = _nan_tailed_case(31, cs, 704, 8, 32, 128, dtype, page=page)
    q, kc, vc, _, _, csd, bt = (_dev(x) for x in case.args())
    plan = decode.explain_kvcache(q, kc, vc, cache_seqlens=csd, block_table=bt, report=False)
    nsm = cupy.cuda.Device().attributes["MultiProcessorCount"]
    if 20 * 8 > nsm:
        assert "_n64_w4_" in plan.name, plan.name
    (o, lse), _ = _run(case, dtype)
    _check_against_reference(case, o, lse, dtype)


@pytest.mark.parametrize("which", ["one_block", "two_splits", "several_waves"])
def test_two_stage_pipeline_is_bitwise_the_three_stage_one(which, monkeypatch):
    """heuristics.choose_split_stages: where the public path runs two K/V stages (the one-block
    tile with >= 8k keys per split, alone or with the fused merge of two splits; the
    several-waves tile from 4k keys), its output and LSE are bitwise those of the same call
    with the two-stage rule off (three stages, the same tile and split count; ragged,
    NaN-tailed caches)."""
    from cupyflash.core import cache
    from cupyflash.decode import plan as decode_plan
    dtype, d = "bfloat16", 128
    if which == "one_block":
        b, hk, h, cap, ns, tile = 2, 2, 8, 8192, 1, (128, 8)
        cs = np.array([8192, 5000], np.int32)
    elif which == "two_splits":
        b, hk, h, cap, ns, tile = 1, 2, 8, 16384, 2, (128, 8)
        cs = np.array([16384 - 37], np.int32)
    else:
        b, hk, h, cap, ns, tile = 17, 8, 32, 4096, 0, (64, 4)
        cs = np.random.default_rng(53).integers(3000, 4097, b).astype(np.int32)
        cs[1] = 1
    case = _nan_tailed_case(53, cs, cap, hk, h, d, dtype)
    q, kc, vc, _, _, csd, _ = (_dev(x) for x in case.args())
    plan = decode.explain_kvcache(q, kc, vc, cache_seqlens=csd, num_splits=ns, report=False)
    nsm = cupy.cuda.Device().attributes["MultiProcessorCount"]
    if which == "several_waves" and b * hk <= nsm:
        pytest.skip(f"{b * hk} blocks do not exceed {nsm} SMs")
    assert plan.template["stages"] == 2 and plan.template["block_n"] == tile[0], plan.name
    two = _call_bits(case, dtype, q, kc, vc, csd, None, ns, check=which != "several_waves")
    # the same call planned with the two-stage rule off (plans and launches not cached across)
    monkeypatch.setattr(decode_plan, "choose_split_stages", lambda stages, **kw: stages)
    monkeypatch.setattr(cache, "LAUNCH_CACHE", {})
    decode_plan._plan_cached.cache_clear()
    try:
        plan3 = decode.explain_kvcache(q, kc, vc, cache_seqlens=csd, num_splits=ns, report=False)
        assert plan3.template == dict(plan.template, stages=3), plan3.template
        assert plan3.num_splits == plan.num_splits
        three = _call_bits(case, dtype, q, kc, vc, csd, None, ns, check=False)
    finally:
        decode_plan._plan_cached.cache_clear()
    assert np.array_equal(two[0], three[0]) and np.array_equal(two[1], three[1])


@pytest.mark.parametrize("d,page", [(128, 0), (128, 16), (128, 256), (128, 3), (72, 0),
                                    (256, 16), (64, 0)])
@pytest.mark.parametrize("sq,dtype", [(1, "bfloat16"), (5, "float16")])
def test_q_async_is_bitwise_the_2byte_q_loads(d, page, sq, dtype):
    """The Q tile copied by 16-byte cp.async beside the length (v44, v47), landing with the next
    K/V group, gives bitwise the output and LSE of the 2-byte Q loads that a q off 16-byte
    strides takes (a q view 2 bytes past a 16-byte boundary, and one whose head stride is not a
    multiple of 8 elements), and matches the reference: contiguous and paged caches (pages of 3,
    16, 256: per-row ids, copy pointers and speculative ids where the public path has them),
    ragged NaN-tailed caches, an empty sequence, GQA 4, padded head dim 72 (columns past headdim
    zeroed), causal rows over two row chunks at sq = 5 (rows past the block's valid rows
    zeroed), split counts from 1 to more splits than tiles; shared memory poisoned with NaN
    before every launch, so a Q tile that did not land in time reads NaN."""
    hk, h, cap = 2, 8, 1100
    if page:
        cap = -(-cap // page) * page
    case = _nan_tailed_case(71, np.array([1037, 0, 130, 64, 1], np.int32), cap, hk, h, d, dtype,
                            sq=sq, page=page, table_seed=5, spare_pages=2)
    qd, kd, vd, csd, btd = (_dev(x) for x in (case.q, case.k_cache, case.v_cache,
                                              case.cache_seqlens, case.block_table))
    # q 2 bytes past a 16-byte boundary: the kernel's 2-byte loads for every chunk
    buf = cupy.empty(qd.size + 1, qd.dtype)
    qm = buf[1:].reshape(qd.shape)
    qm.view(cupy.uint16)[...] = qd.view(cupy.uint16)
    assert qm.data.ptr % 16 == 2
    wide = cupy.empty(qd.shape[:3] + (qd.shape[3] + 1,), qd.dtype)  # head stride d + 1
    qw = wide[..., :qd.shape[3]]
    qw.view(cupy.uint16)[...] = qd.view(cupy.uint16)
    for q_, ok in ((qd, True), (qm, False), (qw, False)):  # what explain() says of each q
        pl = decode.explain_kvcache(q_, kd, vd, cache_seqlens=csd, block_table=btd, report=False)
        assert pl.problem.q_aligned16 == ok
        assert any(t.startswith("q: the Q tile by 16-byte" if ok else "q: its strides")
                   for _, t in pl.reasons)
    for ns in (1, 3, 16):
        want = _call_bits(case, dtype, qd, kd, vd, csd, btd, ns)
        for name, q_ in (("q 2 bytes off", qm), ("head stride d + 1", qw)):
            got = _call_bits(case, dtype, q_, kd, vd, csd, btd, ns)
            assert np.array_equal(got[0], want[0]), (name, ns)
            assert np.array_equal(got[1], want[1]), (name, ns)


def test_misaligned_cache_is_rejected_before_launch():
    """cp.async needs a 16-byte aligned global address: a cache view 8 bytes into its buffer
    (rows still 16-byte multiples) is a ValueError naming the argument, before any launch."""
    buf = cupy.zeros(2 * 64 * 2 * 128 + 8, cupy.float16)
    kc = cupy.ndarray((2, 64, 2, 128), cupy.float16, memptr=buf.data + 8)
    q = cupy.ones((2, 1, 8, 128), cupy.float16)
    cs = cupy.full((2,), 64, cupy.int32)
    out = _nan_like(q)
    for validate in (True, False):
        with pytest.raises(ValueError, match=r"^k_cache: rows must be 16-byte aligned for the "
                                             r"decode kernel \(pointer 0x[0-9a-f]*8, strides"):
            flash_attn_with_kvcache(q, kc, kc, cache_seqlens=cs, num_splits=1, out=out,
                                    validate=validate)
    assert bool(cupy.isnan(out.astype(cupy.float32)).all())  # nothing was launched



def test_misaligned_workspace_is_rejected_before_launch():
    """The partials move as 16-byte vectors: a workspace that starts off a 16-byte boundary (an
    offset slice) is a ValueError naming the argument, on the first and on a warm call."""
    dtype = "bfloat16"
    case = _nan_tailed_case(37, np.array([900, 5], np.int32), 1024, 2, 8, 128, dtype)
    q, kc, vc, _, _, cs, bt = (_dev(x) for x in case.args())
    n = decode.workspace_size(q, kc, vc, cache_seqlens=cs, num_splits=4)
    ws = cupy.zeros(n + 4, cupy.float32)
    out = _nan_like(q)
    flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, num_splits=4, out=out,
                            workspace=ws[:n], validate=False)  # aligned: fine (and cached)
    for _ in range(2):
        with pytest.raises(ValueError, match="workspace: must start on a 16-byte boundary"):
            flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, num_splits=4, out=out,
                                    workspace=ws[1:n + 1], validate=False)


# ----------------------------------------------------------------------------------------------
# Programmatic dependent launch (decode.PDL, sm_90+)
# ----------------------------------------------------------------------------------------------
_PDL_SRC = r"""
// The late writer a dependent kernel must wait for: lets the next kernel of the stream be
// scheduled at once, waits `ns` nanoseconds, then copies n_i 32-bit words s_i -> d_i for up to
// four buffers (n_i = 0: unused).
extern "C" __global__ void late_copy(const unsigned* s0, unsigned* d0, long long n0,
                                     const unsigned* s1, unsigned* d1, long long n1,
                                     const unsigned* s2, unsigned* d2, long long n2,
                                     const unsigned* s3, unsigned* d3, long long n3,
                                     unsigned long long ns) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long i0 = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    for (long long i = i0; i < n0; i += stride) d0[i] = s0[i];
    for (long long i = i0; i < n1; i += stride) d1[i] = s1[i];
    for (long long i = i0; i < n2; i += stride) d2[i] = s2[i];
    for (long long i = i0; i < n3; i += stride) d3[i] = s3[i];
}
// A dependent kernel that does NOT wait: what it reads shows whether it overlapped the writer.
// (Its argument is one struct, as every kernel cupyflash.core.launch.Launch launches.)
struct ReadFirst { const unsigned* src; unsigned* out; };
extern "C" __global__ void read_first(const __grid_constant__ ReadFirst p) {
    p.out[0] = p.src[0];
}
"""
_LATE_NS = np.uint64(2_000_000)  # 2 ms: far longer than the host's enqueue of the next call


def _skip_unless_pdl():
    if int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs sm_90+")
    if not decode.PDL:
        pytest.skip("decode.PDL is off (CUPYFLASH_PDL=0)")


def _late_copy(kernel, pairs, unused):
    """Launch the late writer over (src, dst) CuPy array pairs (up to four, contiguous, sizes in
    bytes a multiple of 4), plainly, on the current stream; ``unused``: a uint32 array for the
    unused slots (allocated by the caller: nothing is allocated here, so it can be captured)."""
    args = []
    for src, dst in pairs:
        assert src.nbytes == dst.nbytes and src.nbytes % 4 == 0
        args += [src.reshape(-1).view(cupy.uint32), dst.reshape(-1).view(cupy.uint32),
                 np.int64(src.nbytes // 4)]
    args += [unused, unused, np.int64(0)] * (4 - len(pairs))
    kernel((132,), (256,), tuple(args) + (_LATE_NS,))


@pytest.mark.parametrize("page,ns", [(0, 0), (0, 1), (16, 0), (64, 3)])
def test_pdl_launch_waits_for_the_previous_kernel(page, ns):
    """The split kernel, launched as a programmatic dependent launch, may start before the
    previous kernel of its stream has finished; it must not read q, the caches, cache_seqlens or
    block_table before that kernel's writes land. The previous kernel lets dependents be scheduled
    at once, waits 2 ms, then writes the real values over poison (NaN in q and the caches, zero
    lengths, page ids -1). The decode call follows it directly (warm launch cache, a workspace
    passed in: no memset and no host work between the two). Control: a dependent kernel that
    does not wait reads the poison (the launches do overlap here). The output matches the
    reference of the real inputs and equals bitwise the same call launched plainly."""
    from cupyflash.core import launch
    _skip_unless_pdl()
    dtype = "bfloat16"
    case = _nan_tailed_case(31 + page + ns, np.array([700, 1024, 1], np.int32), 1024, 2, 8, 128,
                            dtype, page=page)
    q_real, kc_real, vc_real, _, _, cs_real, bt_real = (_dev(x) for x in case.args())
    mod = cupy.RawModule(code=_PDL_SRC)
    late, read_first = mod.get_function("late_copy"), mod.get_function("read_first")
    q, kc, vc = _nan_like(q_real), _nan_like(kc_real), _nan_like(vc_real)
    cs = cupy.zeros_like(cs_real)
    bt = None if bt_real is None else cupy.full_like(bt_real, -1)
    pairs = [(q_real, q), (kc_real, kc), (vc_real, vc),
             (cs_real, cs) if bt is None else (bt_real, bt)]
    if bt is not None:  # the lengths are real from the start; the page ids arrive late
        cs[...] = cs_real
    ws = decode.alloc_workspace(q_real, kc_real, vc_real, cache_seqlens=cs_real,
                                block_table=bt_real, num_splits=ns)
    out = _nan_like(q)
    unused = cupy.zeros(1, cupy.uint32)

    def call():
        return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, block_table=bt,
                                       num_splits=ns, return_lse=True, out=out, workspace=ws,
                                       validate=False)
    call()  # compile and cache this exact launch first (NaN inputs: the result is discarded)
    cupy.cuda.Device().synchronize()

    # control: a dependent launch that does not wait sees the poison the late writer replaces
    seen = cupy.zeros(1, cupy.uint32)
    poison = int(kc.reshape(-1).view(cupy.uint32)[0])
    read_first_pdl = launch.Launch(read_first, (ctypes.c_uint64 * 2)(), (1, 1, 1), (1, 1, 1),
                                   pointers=(0, 2), pdl=True)
    _late_copy(late, pairs, unused)
    read_first_pdl((kc.data.ptr, seen.data.ptr), cupy.cuda.get_current_stream().ptr)
    cupy.cuda.Device().synchronize()
    assert int(seen[0]) == poison, "the dependent launch did not overlap the writer"
    for src, dst in pairs:
        assert bool((dst.reshape(-1).view(cupy.uint32) == src.reshape(-1).view(cupy.uint32)).all())

    for y in (q, kc, vc, out):  # poison again
        y.view(cupy.uint16).fill(_NAN_BITS[dtype])
    if bt is None:
        cs.fill(0)
    else:
        bt.fill(-1)
    _late_copy(late, pairs, unused)
    _, lse = call()
    cupy.cuda.Device().synchronize()
    _check_against_reference(case, out, lse, dtype)
    got, got_lse = _host(out).copy(), cupy.asnumpy(lse)
    with decode.pdl_launches(False):
        plain, plain_lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, block_table=bt,
                                                   num_splits=ns, return_lse=True)
    assert np.array_equal(_host(plain).view(np.uint16), got.view(np.uint16))
    assert np.array_equal(cupy.asnumpy(plain_lse), got_lse)


@pytest.mark.parametrize("paged", [False, True])
def test_pdl_in_a_graph_after_a_writer_and_with_append(paged):
    """In a captured graph: a late writer (lets dependents be scheduled at once, waits 2 ms,
    then writes q and the new k, v tokens), then the decode call with an append (two programmatic
    dependent launches: append, split). Replayed twice with new source values between replays:
    each replay equals a plain eager call on the new inputs, so the append waited for the new
    tokens and the split for q."""
    _skip_unless_pdl()
    dtype = "float16"
    rng = np.random.default_rng(41)
    batch, cap, hk, h, d, new = 2, 640, 2, 8, 64, 3
    cs = np.array([300, 600], np.int32)
    kc = testing.random_normal(rng, (batch, cap, hk, d), dtype)
    vc = testing.random_normal(rng, (batch, cap, hk, d), dtype)
    bt = None
    if paged:
        kc, bt = testing.contiguous_to_paged(kc, 32, np.random.default_rng(5), 1)
        vc, _ = testing.contiguous_to_paged(vc, 32, np.random.default_rng(5), 1)
    late = cupy.RawModule(code=_PDL_SRC).get_function("late_copy")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        kcd, vcd, csd, btd = (_dev(x) for x in (kc, vc, cs, bt))
        kc0, vc0 = kcd.copy(), vcd.copy()
        srcs = [_dev(testing.random_normal(rng, shape, dtype))
                for shape in ((batch, 1, h, d), (batch, new, hk, d), (batch, new, hk, d))]
        q, kd, vd = (cupy.empty_like(x) for x in srcs)
        pairs = list(zip(srcs, (q, kd, vd)))
        ws = decode.alloc_workspace(q, kcd, vcd, kd, vd, csd, btd, num_splits=4)
        out = cupy.empty_like(q)
        call = dict(cache_seqlens=csd, block_table=btd, num_splits=4, out=out, validate=False,
                    workspace=ws)
        unused = cupy.zeros(1, cupy.uint32)
        for x, y in pairs:
            y[...] = x
        flash_attn_with_kvcache(q, kcd, vcd, kd, vd, **call)  # compile and cache first
        _late_copy(late, pairs, unused)  # and the writer
        stream.synchronize()
        stream.begin_capture()
        _late_copy(late, pairs, unused)
        flash_attn_with_kvcache(q, kcd, vcd, kd, vd, **call)
        graph = stream.end_capture()
        for rep in range(2):
            for x in srcs:
                x[...] = _dev(testing.random_normal(rng, x.shape, dtype))
            for y in (q, kd, vd):
                y.view(cupy.uint16).fill(_NAN_BITS[dtype])
            kcd[...] = kc0
            vcd[...] = vc0
            out.view(cupy.uint16).fill(_NAN_BITS[dtype])
            graph.launch(stream)
            stream.synchronize()
            got = _host(out).copy()
            kcd[...] = kc0
            vcd[...] = vc0
            with decode.pdl_launches(False):
                want = flash_attn_with_kvcache(srcs[0].copy(), kcd, vcd, srcs[1].copy(),
                                               srcs[2].copy(), cache_seqlens=csd,
                                               block_table=btd, num_splits=4)
            stream.synchronize()
            assert not np.isnan(got.astype(np.float32)).any(), rep
            assert np.array_equal(got.view(np.uint16), _host(want).view(np.uint16)), rep
