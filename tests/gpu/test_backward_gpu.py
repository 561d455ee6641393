"""GPU tests of the backward pass (``pytest -m gpu tests/gpu/test_backward_gpu.py``).

Oracle: the float64 one-shot backward (:func:`cupyflash.reference.attention_backward`) on the
same inputs rounded to the dtype (q, k, v, dout), with the forward's ``out`` and ``lse`` from
cupyflash's own forward. Bound per dtype on each of dq, dk, dv (:func:`cupyflash.testing.
backward_error`: the error relative to the size of the gradient's terms, which stays meaningful
where the gradient cancels, e.g. a row that sees one key): :data:`BOUND`, plus
``4 eps(LSE dtype) max|LSE|`` (P is recomputed from the stored LSE). float16/bfloat16
round P and dS to the dtype before the three products that read them (as every FlashAttention
backward does) and the gradients to the dtype at the end; float32 computes in float32 from a
float32 LSE; float64 must agree to 1e-12.

Every gradient buffer is NaN before the launch (``dq=``, ``dk=``, ``dv=`` given) and checked with
``isnan`` first; every problem runs twice and the results must be bitwise equal (no atomics).
These tests run the mma.sync / CUDA-core plans (``CUPYFLASH_BWD_HOPPER=0`` for the module, so
that an H100/H200 tests them too); ``test_hopper_*`` run the Hopper plan (sm_90a, the default
there), which adds dQ by reductions in L2: there only dK and dV must be bitwise equal (all three
with ``deterministic=True``), and each test checks that the Hopper kernel ran.
"""
import numpy as np
import pytest
from hypothesis import given, settings

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

from cupyflash import reference, testing  # noqa: E402
from cupyflash.api import (flash_attn_backward, flash_attn_func,  # noqa: E402
                           flash_attn_varlen_backward, flash_attn_varlen_func)
from cupyflash.backward import kernels as bwd_kernels  # noqa: E402
from cupyflash.core.interop import np_dtype  # noqa: E402
from gpu_arrays import to_device, to_host  # noqa: E402

#: Error bound per dtype (dq, dk, dv each): the norm of the difference over the norm of the
#: gradient's componentwise magnitude (testing.backward_magnitudes), plus 4 eps(LSE) max|LSE|.
#: Measured on the H100/H200 (2026-12-05): float64 <= 1.3e-15, float32 <= 7e-7, bfloat16 <=
#: 2.6e-3, float16 <= 3.3e-4 (as normwise relative errors, over the CASES below).
BOUND = {"float64": 1e-12, "float32": 1e-5, "float16": 4e-3, "bfloat16": 2e-2}
LSE_DTYPE = {"float64": np.float64, "float32": np.float32, "float16": np.float32,
             "bfloat16": np.float32}
_NAN_BITS = {"float16": 0x7E00, "bfloat16": 0x7FC0}


@pytest.fixture(autouse=True, scope="module")
def mma_plan():
    """The mma.sync / CUDA-core plans for every test of this module but the Hopper ones (the
    ``hopper`` fixture and the Hopper property switch it back on)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUPYFLASH_BWD_HOPPER", "0")
        yield


def nan_like(shape, dtype):
    dt = np_dtype(dtype)
    if dt.itemsize == 2:
        buf = cupy.empty(shape, dtype=dt)
        buf.view(cupy.uint16).fill(_NAN_BITS[dtype])
        return buf
    return cupy.full(shape, np.nan, dtype=dt)


def inputs(rng, shape_q, shape_k, dtype, scale=1.0):
    q = testing.random_normal(rng, shape_q, dtype, scale)
    k = testing.random_normal(rng, shape_k, dtype, scale)
    v = testing.random_normal(rng, shape_k, dtype)
    dout = testing.random_normal(rng, shape_q, dtype)
    return q, k, v, dout


def run_backward(q, k, v, dout, repeatable=("dq", "dk", "dv"), **kw):
    """Forward (out, lse) then backward into NaN-poisoned buffers, twice; returns host dq, dk, dv
    of the first run after checking the second is bitwise equal (the gradients ``repeatable``)."""
    qd, kd, vd, dod = (to_device(x) for x in (q, k, v, dout))
    out, lse = flash_attn_func(qd, kd, vd, return_lse=True, **kw)
    runs = []
    for _ in range(2):
        bufs = [nan_like(x.shape, q.dtype.name) for x in (q, k, v)]
        dq, dk, dv = flash_attn_backward(dod, qd, kd, vd, out, lse, dq=bufs[0], dk=bufs[1],
                                         dv=bufs[2], **kw)
        assert dq is bufs[0] and dk is bufs[1] and dv is bufs[2]
        runs.append([to_host(x) for x in (dq, dk, dv)])
    for name, a, b in zip(("dq", "dk", "dv"), *runs):
        if name in repeatable:
            assert a.tobytes() == b.tobytes(), f"{name}: two runs differ: a race or an atomic"
    return runs[0]


def assert_grads(got, q, k, v, dout, dtype, what="", **kw):
    """Each gradient's error relative to the size of its terms (testing.backward_error) within
    BOUND[dtype] + 4 eps(LSE dtype) max|LSE| (P is recomputed from the stored LSE)."""
    for name, g in zip(("dq", "dk", "dv"), got):
        assert not np.isnan(np.asarray(g, dtype=np.float64)).any(), f"{what} {name}: NaN (not written)"
    errs, lse_max = testing.backward_error(got, dout, q, k, v, **kw)
    bound = BOUND[dtype] + 4 * np.finfo(LSE_DTYPE[dtype]).eps * lse_max
    for name, err in zip(("dq", "dk", "dv"), errs):
        assert err <= bound, f"{what} {name}: error {err:.3g} > {bound:.3g} (max|LSE| {lse_max:.3g})"


CASES = [  # (b, sq, sk, h, hk, d, causal, window)
    (2, 100, 100, 4, 4, 64, False, (-1, -1)),
    (2, 131, 67, 4, 2, 72, True, (-1, -1)),     # queries with no visible key (causal, sq > sk)
    (1, 67, 250, 6, 2, 128, True, (-1, -1)),
    (2, 200, 200, 2, 1, 40, False, (30, 10)),   # MQA, sliding window
    (1, 257, 129, 4, 2, 256, False, (-1, -1)),
    (1, 150, 150, 3, 3, 200, True, (64, -1)),
    (1, 33, 33, 2, 2, 16, False, (-1, -1)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_sq{}_sk{}_h{}_{}_d{}_{}_{}".format(*c))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_backward_matches_reference(dtype, case):
    b, sq, sk, h, hk, d, causal, window = case
    rng = np.random.default_rng([b, sq, sk, h, d])
    q, k, v, dout = inputs(rng, (b, sq, h, d), (b, sk, hk, d), dtype)
    kw = dict(causal=causal, window_size=window)
    got = run_backward(q, k, v, dout, **kw)
    assert_grads(got, q, k, v, dout, dtype, what=f"{dtype} {case}", **kw)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hd", bwd_kernels.HEADDIMS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_every_backward_kernel(dtype, hd, causal):
    """Every compiled head dim (its kernels: bwd_kernels.plan_backward), a head dim 8 below it,
    lengths that are no tile multiple (two and a bit key blocks), GQA."""
    d = hd - 8
    plan = bwd_kernels.plan_backward(dtype, d, causal)
    bn = plan.dkdv[0].block_n
    sq, sk = plan.dq.block_m + 19, 2 * bn + 7
    rng = np.random.default_rng([hd, int(causal), len(dtype)])
    q, k, v, dout = inputs(rng, (2, sq, 4, d), (2, sk, 2, d), dtype)
    got = run_backward(q, k, v, dout, causal=causal)
    assert_grads(got, q, k, v, dout, dtype, what=str([kern.name for kern in plan.kernels]),
                 causal=causal)


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_varlen_backward_and_batch_independence(dtype):
    """Packed sequences (one empty, one with no keys, one with fewer keys than queries) against
    the per-sequence reference; a sequence's gradients are bitwise the same alone and packed
    with others (no atomics, fixed reduction order)."""
    rng = np.random.default_rng(7)
    lq, lk = [37, 0, 5, 130], [50, 9, 0, 64]
    h, hk, d = 4, 2, 64
    cu_q, cu_k = testing.cu_seqlens_from_lengths(lq), testing.cu_seqlens_from_lengths(lk)
    q, k, v, dout = inputs(rng, (sum(lq), h, d), (sum(lk), hk, d), dtype)
    kw = dict(causal=True)

    def varlen(q, k, v, dout, cu_q, cu_k, mq, mk):
        qd, kd, vd, dod = (to_device(x) for x in (q, k, v, dout))
        cq, ck = to_device(cu_q.astype(np.int32)), to_device(cu_k.astype(np.int32))
        out, lse = flash_attn_varlen_func(qd, kd, vd, cq, ck, mq, mk, return_lse=True, **kw)
        bufs = [nan_like(x.shape, dtype) for x in (q, k, v)]
        g = flash_attn_varlen_backward(dod, qd, kd, vd, out, lse, cq, ck, mq, mk, dq=bufs[0],
                                       dk=bufs[1], dv=bufs[2], **kw)
        return [to_host(x) for x in g]

    got = varlen(q, k, v, dout, cu_q, cu_k, max(lq), max(lk))
    ref = reference.varlen_attention_backward(dout, q, k, v, cu_q, cu_k, **kw)
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        assert not np.isnan(np.asarray(g, np.float64)).any(), name
        assert testing.rel_error(np.asarray(g, np.float64), r) <= BOUND[dtype], name
    # the last sequence alone: bitwise the same gradients
    sl_q, sl_k = slice(cu_q[3], cu_q[4]), slice(cu_k[3], cu_k[4])
    alone = varlen(q[sl_q], k[sl_k], v[sl_k], dout[sl_q], np.array([0, lq[3]]),
                   np.array([0, lk[3]]), lq[3], lk[3])
    for name, a, g, sl in zip(("dq", "dk", "dv"), alone, got, (sl_q, sl_k, sl_k)):
        assert a.tobytes() == np.ascontiguousarray(g[sl]).tobytes(), name


def test_float64_exact_and_large_magnitudes():
    """float64 within 1e-12 of the float64 reference, also when the scores reach 1e6."""
    rng = np.random.default_rng(11)
    for scale in (1.0, 30.0, 1e3):
        q, k, v, dout = inputs(rng, (1, 90, 2, 64), (1, 70, 1, 64), "float64", scale=scale)
        got = run_backward(q, k, v, dout, causal=True)
        assert_grads(got, q, k, v, dout, "float64", what=f"scale {scale}", causal=True)


@settings(deadline=None)
@given(case=testing.attention_cases(dtypes=("float64", "float32", "bfloat16", "float16"),
                                    max_seqlen_q=160, max_seqlen_k=160, max_headdim=256,
                                    min_seqlen=1))
def test_backward_property(case):
    """Random shapes, GQA ratios, head dims, masks, scales and dtypes against the reference."""
    rng = np.random.default_rng(case.seed)
    dout = testing.random_normal(rng, case.q.shape, case.q.dtype.name)
    got = run_backward(case.q, case.k, case.v, dout, **case.kwargs())
    assert_grads(got, case.q, case.k, case.v, dout, case.q.dtype.name, **case.kwargs())


def test_torch_autograd_gradcheck_and_compile():
    """torch callers: out.backward() gives flash_attn_backward's gradients; gradcheck in float64
    through the library's own kernels; torch.compile(fullgraph=True) traces forward and
    backward."""
    torch = pytest.importorskip("torch")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(2, 40, 4, 32, device=dev, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 30, 2, 32, device=dev, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, 30, 2, 32, device=dev, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: flash_attn_func(a, b, c, causal=True),
                                    (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6)
    qb, kb, vb = (x.detach().to(torch.bfloat16).requires_grad_() for x in (q, k, v))
    out = flash_attn_func(qb, kb, vb, causal=True)
    assert out.grad_fn is not None
    dout = torch.randn_like(out)
    out.backward(dout)
    o2, lse = flash_attn_func(qb.detach(), kb.detach(), vb.detach(), causal=True, return_lse=True)
    ref = flash_attn_backward(dout, qb.detach(), kb.detach(), vb.detach(), o2, lse, causal=True)
    for a, b in zip((qb.grad, kb.grad, vb.grad), ref):
        assert torch.equal(a, b)
    f = torch.compile(lambda a, b, c: flash_attn_func(a, b, c, causal=True).float().square().sum(),
                      fullgraph=True)
    qc, kc, vc = (x.detach().clone().requires_grad_() for x in (qb, kb, vb))
    f(qc, kc, vc).backward()
    qe, ke, ve = (x.detach().clone().requires_grad_() for x in (qb, kb, vb))
    flash_attn_func(qe, ke, ve, causal=True).float().square().sum().backward()
    for a, b in zip((qc.grad, kc.grad, vc.grad), (qe.grad, ke.grad, ve.grad)):
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=1e-2)


# ---- the Hopper plan (kernels_cu/backward/hopper.cu) -------------------------------------------

@pytest.fixture
def hopper(monkeypatch):
    """The Hopper plan on (sm_90a only); yields a check that a given plan's kernel ran."""
    from cupyflash.backward import run as bwd_run
    from cupyflash.core import planning
    if planning.default_arch() != "sm_90a":
        pytest.skip("the Hopper backward runs on sm_90a only")
    monkeypatch.setenv("CUPYFLASH_BWD_HOPPER", "1")

    def ran(dtype, d, causal, deterministic=False):
        want = bwd_kernels.plan_backward(dtype, d, causal, hopper=True,
                                         deterministic=deterministic).dkdv[0]
        assert any(key[0] == want for key in bwd_run._LAUNCHES), f"{want.name} did not run"
    return ran


HOPPER_CASES = [  # (b, sq, sk, h, hk, d, causal, window)
    (2, 100, 100, 4, 4, 64, False, (-1, -1)),
    (2, 131, 67, 4, 2, 72, True, (-1, -1)),     # queries with no visible key (causal, sq > sk)
    (1, 67, 250, 6, 2, 128, True, (-1, -1)),    # keys no query sees (causal, sk > sq)
    (2, 200, 200, 2, 1, 40, False, (30, 10)),   # MQA, sliding window
    (1, 33, 33, 2, 2, 16, False, (-1, -1)),
    (2, 1000, 1000, 8, 2, 128, True, (-1, -1)),
    (1, 513, 700, 4, 4, 64, False, (100, 50)),
    (1, 2048, 2048, 4, 4, 128, False, (-1, -1)),
    (2, 300, 300, 4, 2, 256, True, (-1, -1)),   # hd256: 64-key CTAs, dQ added from registers
    (1, 131, 257, 2, 1, 192, False, (-1, -1)),  # (hd192 on the hd256 kernel)
    (1, 1000, 1000, 4, 4, 256, False, (70, 20)),
    (1, 67, 250, 6, 2, 256, True, (-1, -1)),
]


@pytest.mark.parametrize("case", HOPPER_CASES, ids=lambda c: "b{}_sq{}_sk{}_h{}_{}_d{}_{}_{}".format(*c))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_hopper_backward_matches_reference(hopper, dtype, case):
    b, sq, sk, h, hk, d, causal, window = case
    rng = np.random.default_rng([b, sq, sk, h, d, 90])
    q, k, v, dout = inputs(rng, (b, sq, h, d), (b, sk, hk, d), dtype)
    kw = dict(causal=causal, window_size=window)
    got = run_backward(q, k, v, dout, repeatable=("dk", "dv"), **kw)
    hopper(dtype, d, causal)
    assert_grads(got, q, k, v, dout, dtype, what=f"hopper {dtype} {case}", **kw)


@pytest.mark.parametrize("case", [(1, 300, 300, 4, 2, 128, True), (2, 700, 500, 4, 4, 64, False),
                                  (1, 1000, 1000, 8, 2, 128, False), (1, 77, 300, 2, 1, 40, True),
                                  (1, 100, 1200, 2, 2, 64, False), (1, 500, 700, 4, 2, 256, True),
                                  (2, 300, 900, 2, 2, 192, False)])
def test_hopper_backward_deterministic(hopper, case):
    """deterministic=True: the key blocks add dQ in a fixed order (turn counters), so all three
    gradients are bitwise repeatable, and as exact as the default (100 x 1200: more key blocks
    than query blocks)."""
    b, sq, sk, h, hk, d, causal = case
    rng = np.random.default_rng([sq, sk, d])
    q, k, v, dout = inputs(rng, (b, sq, h, d), (b, sk, hk, d), "bfloat16")
    got = run_backward(q, k, v, dout, causal=causal, deterministic=True)
    hopper("bfloat16", d, causal, deterministic=True)
    assert_grads(got, q, k, v, dout, "bfloat16", causal=causal)


def test_hopper_autograd_deterministic(hopper):
    """flash_attn_func(..., deterministic=True) under torch autograd hands the flag to its
    backward (the Hopper kernel's fixed dQ order): two backward passes, bitwise-equal gradients."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator(device="cuda").manual_seed(35)
    q, k, v = (torch.randn(2, 700, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    grads = []
    for _ in range(2):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        flash_attn_func(*leaves, causal=True, deterministic=True).backward(dout)
        grads.append([x.grad for x in leaves])
    hopper("bfloat16", 128, True, deterministic=True)
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        assert not torch.isnan(a).any() and torch.equal(a, b), name


@settings(deadline=None)
@given(case=testing.attention_cases(dtypes=("bfloat16", "float16"), max_seqlen_q=300,
                                    max_seqlen_k=300, max_headdim=256, min_seqlen=1))
def test_hopper_backward_property(case):
    """Random shapes, GQA ratios, head dims up to 256, masks and scales on the Hopper plan."""
    import os
    from unittest import mock
    from cupyflash.core import planning
    if planning.default_arch() != "sm_90a":
        pytest.skip("the Hopper backward runs on sm_90a only")
    # (not monkeypatch: a function-scoped fixture would span every example)
    with mock.patch.dict(os.environ, {"CUPYFLASH_BWD_HOPPER": "1"}):
        rng = np.random.default_rng(case.seed)
        dout = testing.random_normal(rng, case.q.shape, case.q.dtype.name)
        got = run_backward(case.q, case.k, case.v, dout, repeatable=("dk", "dv"), **case.kwargs())
    assert_grads(got, case.q, case.k, case.v, dout, case.q.dtype.name, **case.kwargs())
