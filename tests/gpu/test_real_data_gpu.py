"""GPU tests on real model activations: the Q/K/V of every layer and head of all-MiniLM-L6-v2
(``tests/data/minilm_qkv.npz``; max |logit| 67, near one-hot rows: see tests/data/README.md).

Prefill (non-causal, as the encoder computes it, and causal: causal masking applied to the same
tensors) in float16, bfloat16, float32 and float64, and decode (each passage its own cache in one
ragged batch, queries = its last 1..4 positions; float16, bfloat16; with and without forced
splits; with the last positions appended as new k/v) against the float64 reference.

Bounds (per head, normwise relative error, and for fp16/bf16 also the max abs error):
float16/bfloat16 <= 2 x the error of a straightforward same-precision implementation on the same
inputs (``real_model.naive_same_precision``) + the unit roundoff; float32/float64 <= 64 eps and
<= the proven streaming bound of ``cupyflash.testing.streaming_error_bound``. Outputs are
NaN-filled before each launch; the cache tails hold NaN.

    pytest -m gpu tests/gpu/test_real_data_gpu.py
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))
_spec = importlib.util.spec_from_file_location("real_model", ROOT / "experiments" / "real_model.py")
rm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rm)

import cupyflash  # noqa: E402
from cupyflash import reference as ref  # noqa: E402
from cupyflash.testing import rel_error, streaming_error_bound  # noqa: E402

FX = rm.load_fixture(rm.FIXTURE)
CASES = list(rm.iter_cases(FX))
SCALE = FX["softmax_scale"]


def _check_low_precision(out, expected, naive, dtype, what):
    """fp16/bf16 rule: per head, error <= 2 x naive error + u (normwise and max-abs)."""
    out = rm.host64(out)
    assert not np.isnan(out).any(), f"{what}: NaN in the output"
    u = rm.eps(dtype) / 2
    err = rm.per_head_errors(out, expected)
    err_naive = rm.per_head_errors(naive, expected)
    bad = err > 2 * err_naive + u
    assert not bad.any(), (f"{what}: rel. error {err[bad].max():.3e} above 2 x naive "
                           f"({err_naive[bad].max():.3e}) + u; worst (batch, head) "
                           f"{np.argwhere(bad)[0].tolist()}")
    ad = np.abs(out - expected).max(axis=(1, 3))
    ad_naive = np.abs(naive - expected).max(axis=(1, 3))
    scale = np.abs(expected).max(axis=(1, 3))
    bad = ad > 2 * ad_naive + u * scale
    assert not bad.any(), f"{what}: max abs error {ad[bad].max():.3e} above 2 x naive + u|ref|"
    return err.max(), err_naive.max()


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_prefill_real(gpu, dtype, causal):
    worst = 0.0
    for c in CASES:
        what = f"L{c['layer']}_P{c['passage']} (n={c['seqlen']}) {dtype} causal={causal}"
        q, k, v = (rm.cast(c[t], dtype) for t in "qkv")
        expected, lse_ref = ref.attention_reference(q, k, v, softmax_scale=SCALE, causal=causal)
        qd, kd, vd = (cp.asarray(t) for t in (q, k, v))
        out = rm.nan_filled(cp, q.shape, dtype)
        res, lse = cupyflash.flash_attn_func(qd, kd, vd, softmax_scale=SCALE, causal=causal,
                                             return_lse=True, out=out)
        lse = cp.asnumpy(lse).astype(np.float64)
        assert lse.shape == lse_ref.shape and not np.isnan(lse).any(), what
        # LSE: scores are fp32 dot products of exactly representable inputs in every dtype, so
        # the float32 streaming bound applies (it includes the final rounding to float32)
        _, lse_bound = streaming_error_bound(q, k, v, softmax_scale=SCALE, causal=causal,
                                             block_size_k=16, dtype=np.float32)
        assert (np.abs(lse - lse_ref) <= lse_bound).all(), f"{what}: LSE error"
        if dtype in ("float16", "bfloat16"):
            naive = rm.naive_same_precision(q, k, v, SCALE, causal, dtype)
            e, _ = _check_low_precision(res, expected, naive, dtype, what)
        else:
            got = rm.host64(res)
            assert not np.isnan(got).any(), f"{what}: NaN in the output"
            err = rm.per_head_errors(got, expected)
            e = err.max()
            assert e <= rm.eps_bound(dtype), f"{what}: {e:.3e} > {rm.EPS_UNITS} eps"
            proven = max(streaming_error_bound(q, k, v, softmax_scale=SCALE, causal=causal,
                                               block_size_k=b, dtype=np.dtype(dtype))[0]
                         for b in (16, 128))
            assert rel_error(got, expected) <= proven, what
        worst = max(worst, e)
    # determinism on real data: the same call twice is bitwise identical
    c = CASES[-1]
    q, k, v = (cp.asarray(rm.cast(c[t], dtype)) for t in "qkv")
    a = cupyflash.flash_attn_func(q, k, v, softmax_scale=SCALE, causal=causal)
    b = cupyflash.flash_attn_func(q, k, v, softmax_scale=SCALE, causal=causal)
    bits = {2: cp.uint16, 4: cp.uint32, 8: cp.uint64}[a.itemsize]
    assert bool((a.view(bits) == b.view(bits)).all())
    print(f"prefill {dtype} causal={causal}: max rel. error per head {worst:.3e}")


@pytest.mark.parametrize("num_splits", [0, 3], ids=["splits_auto", "splits_3"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_decode_real(gpu, dtype, num_splits):
    """Passage p is cache p of one batch (cache_seqlens 18, 65, 128, 256; NaN tails); queries are
    its last 1..4 positions; bottom-right causal makes the answer the last rows of the causal
    prefill (the float64 kvcache reference)."""
    for layer in range(FX["num_layers"]):
        for sq in rm.DECODE_SEQLEN_Q:
            q, kc, vc, lens = rm.decode_inputs(FX, layer, sq, dtype)
            expected, naive = rm.decode_expected(q, kc, vc, lens, SCALE, dtype)
            out = rm.nan_filled(cp, q.shape, dtype)
            res = cupyflash.flash_attn_with_kvcache(
                cp.asarray(q), cp.asarray(kc), cp.asarray(vc), cache_seqlens=cp.asarray(lens),
                softmax_scale=SCALE, causal=True, num_splits=num_splits, out=out)
            _check_low_precision(res, expected, naive, dtype,
                                 f"decode L{layer} seqlen_q={sq} {dtype} num_splits={num_splits}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_decode_real_append(gpu, dtype):
    """The cache holds each passage's first n - s positions, the last s arrive as new k/v: the
    kernel appends them and attends; the cache afterwards holds the whole passage."""
    for layer in (0, 3, 5):
        for sq in (1, 4):
            q, kc_full, vc_full, lens = rm.decode_inputs(FX, layer, sq, dtype)
            expected, naive = rm.decode_expected(q, kc_full, vc_full, lens, SCALE, dtype)
            nb, cap_len, h, d = kc_full.shape
            kc, vc = kc_full.copy(), vc_full.copy()
            knew = np.empty((nb, sq, h, d), kc.dtype)
            vnew = np.empty((nb, sq, h, d), vc.dtype)
            for p, n in enumerate(lens):
                knew[p], vnew[p] = kc_full[p, n - sq:n], vc_full[p, n - sq:n]
                kc[p, n - sq:], vc[p, n - sq:] = np.nan, np.nan   # not yet written: NaN
            kcd, vcd = cp.asarray(kc), cp.asarray(vc)
            out = rm.nan_filled(cp, q.shape, dtype)
            res = cupyflash.flash_attn_with_kvcache(
                cp.asarray(q), kcd, vcd, k=cp.asarray(knew), v=cp.asarray(vnew),
                cache_seqlens=cp.asarray(lens - sq), softmax_scale=SCALE, causal=True, out=out)
            _check_low_precision(res, expected, naive, dtype,
                                 f"decode+append L{layer} seqlen_q={sq} {dtype}")
            kh, vh = kcd.get(), vcd.get()
            for p, n in enumerate(lens):
                bits = np.uint16
                assert (kh[p, :n].view(bits) == kc_full[p, :n].view(bits)).all()
                assert (vh[p, :n].view(bits) == vc_full[p, :n].view(bits)).all()
