"""The materialising baseline without a GPU: its softmax kernel compiles (NVRTC, sm_80 and
sm_90a, no spills), and its index bookkeeping (the two column-major cuBLAS calls of
``gemm_plans`` and the kernel's row -> (head, query) mapping) replayed in NumPy gives the float64
reference."""
import numpy as np
import pytest

from cupyflash import baseline, io_model
from cupyflash.core import jit
from cupyflash.reference import attention_reference


@pytest.fixture(scope="module")
def reports():
    return {(s.name, arch): jit.compile_report(s, arch)
            for s in baseline.all_specs() for arch in ("sm_80", "sm_90a")}


def test_softmax_kernel_compiles(reports):
    assert len(reports) == 8
    for (name, arch), r in reports.items():
        assert r.ptxas.spill_bytes == 0, (name, arch, r.ptxas)
        assert r.ptxas.registers <= 64, (name, arch, r.ptxas)


def _colmajor(buf, rows, cols, ld):
    """Column-major (rows x cols) matrix with leading dimension ld over a flat buffer."""
    return np.lib.stride_tricks.as_strided(buf, shape=(rows, cols),
                                           strides=(buf.itemsize, ld * buf.itemsize))


def _np_gemm(plan, a, b, c):
    """cublasGemmStridedBatchedEx semantics on flat NumPy buffers (alpha = 1, beta = 0)."""
    transa, transb, m, n, k, lda, sa, ldb, sb, ldc, sc, nb = plan
    for i in range(nb):
        A = _colmajor(a[i * sa:], k if transa else m, m if transa else k, lda)
        B = _colmajor(b[i * sb:], n if transb else k, k if transb else n, ldb)
        A = A.T if transa else A
        B = B.T if transb else B
        C = _colmajor(c[i * sc:], m, n, ldc)
        C[...] = A @ B


def _np_softmax(s_flat, rows, sq, sk, causal, window, scale):
    """The kernel's per-row work: row r is query r % sq."""
    s = s_flat.reshape(rows, sk)
    p = np.zeros_like(s)
    lse = np.empty(rows)
    for r in range(rows):
        lo, hi = io_model.visible_key_range(r % sq, sq, sk, causal, window)
        lo, hi = int(lo), int(hi)
        if hi <= lo:
            lse[r] = -np.inf
            continue
        x = s[r, lo:hi] * scale
        mx = x.max()
        e = np.exp(x - mx)
        p[r, lo:hi] = e / e.sum()
        lse[r] = mx + np.log(e.sum())
    return p.ravel(), lse


@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,window", [
    (2, 5, 7, 4, 2, 8, False, (-1, -1)),
    (1, 7, 5, 6, 1, 16, True, (-1, -1)),     # MQA, causal with Sq > Sk: empty rows
    (2, 6, 6, 2, 2, 8, False, (2, 1)),
    (1, 1, 9, 8, 2, 8, True, (-1, -1)),      # decode shape
])
def test_gemm_plans_and_row_mapping_replayed_in_numpy(b, sq, sk, h, hk, d, causal, window):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, sq, h, d))
    k = rng.standard_normal((b, sk, hk, d))
    v = rng.standard_normal((b, sk, hk, d))
    g = h // hk
    plan_qk, plan_pv = baseline.gemm_plans(b, hk, g, sq, sk, d)
    qh = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).ravel()
    kh = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).ravel()
    vh = np.ascontiguousarray(v.transpose(0, 2, 1, 3)).ravel()
    s = np.full(b * h * sq * sk, np.nan)
    _np_gemm(plan_qk, kh, qh, s)
    assert not np.isnan(s).any()
    scale = 1 / np.sqrt(d)
    win = (window[0], 0) if causal else window
    p, lse = _np_softmax(s, b * h * sq, sq, sk, causal, win, scale)
    oh = np.full(b * h * sq * d, np.nan)
    _np_gemm(plan_pv, vh, p, oh)
    out = oh.reshape(b, h, sq, d).transpose(0, 2, 1, 3)
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal, window_size=window)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref_lse.ravel()))
    fin = np.isfinite(lse)
    np.testing.assert_allclose(lse[fin], ref_lse.ravel()[fin], rtol=1e-12)


def test_specs_are_named_data():
    names = [s.name for s in baseline.all_specs()]
    assert names == ["baseline_softmax_f32_to_f16", "baseline_softmax_f32_to_bf16",
                     "baseline_softmax_f32_to_f32", "baseline_softmax_f64_to_f64"]
    assert baseline.score_dtype("bfloat16") == "float32" and baseline.score_dtype("float64") == "float64"
