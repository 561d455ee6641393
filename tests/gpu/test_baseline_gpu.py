"""GPU: the materialising baseline (cuBLAS S = QK^T in fp32, our softmax kernel, cuBLAS PV)
against the float64 reference, for every dtype, GQA/MQA, causal (bottom-right) and windows."""
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
# tests/gpu/conftest.py skips every gpu test when CuPy sees no device
pytestmark = pytest.mark.gpu

import ml_dtypes  # noqa: E402

from cupyflash.baseline import attention_baseline  # noqa: E402
from cupyflash.reference import attention_reference  # noqa: E402

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
          "float64": np.float64}
# relative error (Frobenius) vs the float64 reference: fp16/bf16 are dominated by rounding the
# inputs and P to the dtype; fp32/fp64 accumulate in their own precision.
RTOL = {"float16": 3e-3, "bfloat16": 2e-2, "float32": 1e-5, "float64": 1e-12}


def _to_device(x):
    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize]
    return cupy.asarray(x.view(bits)).view(x.dtype) if x.dtype.itemsize == 2 else cupy.asarray(x)


def _to_host(x):
    if x.dtype.itemsize == 2:
        return cupy.asnumpy(x.view(cupy.uint16)).view(x.dtype)
    return cupy.asnumpy(x)


def _rel(a, b):
    return np.linalg.norm((a - b).ravel()) / max(np.linalg.norm(b.ravel()), 1e-300)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,window", [
    (2, 77, 77, 4, 4, 64, False, (-1, -1)),
    (2, 130, 130, 8, 2, 128, True, (-1, -1)),    # GQA, causal
    (1, 200, 100, 4, 1, 32, True, (-1, -1)),     # MQA, Sq > Sk: empty rows (0, -inf)
    (1, 64, 300, 6, 3, 80, False, (40, 8)),      # window, Sk > Sq
    (3, 1, 1000, 32, 8, 128, True, (-1, -1)),    # decode shape
])
def test_baseline_matches_reference(dtype, b, sq, sk, h, hk, d, causal, window):
    rng = np.random.default_rng(hash((dtype, b, sq, sk, h, d)) % 2**32)
    q = rng.standard_normal((b, sq, h, d)).astype(DTYPES[dtype])
    k = rng.standard_normal((b, sk, hk, d)).astype(DTYPES[dtype])
    v = rng.standard_normal((b, sk, hk, d)).astype(DTYPES[dtype])
    out, lse = attention_baseline(_to_device(q), _to_device(k), _to_device(v), causal=causal,
                                  window_size=window, return_lse=True)
    cupy.cuda.Device().synchronize()
    out_h, lse_h = _to_host(out).astype(np.float64), cupy.asnumpy(lse).astype(np.float64)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, window_size=window)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (b, h, sq) and lse.dtype == cupy.float32
    assert not np.isnan(out_h).any() and not np.isnan(lse_h).any()
    assert _rel(out_h, ref) <= RTOL[dtype], _rel(out_h, ref)
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse_h), empty)
    assert (out_h[np.broadcast_to(empty.transpose(0, 2, 1)[..., None], out_h.shape)] == 0).all()
    np.testing.assert_allclose(lse_h[~empty], ref_lse[~empty], rtol=1e-5, atol=1e-5)


def test_baseline_noncontiguous_inputs_and_default_scale():
    rng = np.random.default_rng(1)
    qkv = rng.standard_normal((2, 50, 3, 4, 64)).astype(np.float32)  # packed (b, s, 3, h, d)
    dq = cupy.asarray(qkv)
    q, k, v = dq[:, :, 0], dq[:, :, 1], dq[:, :, 2]
    out = attention_baseline(q, k, v, softmax_scale=0.3)
    ref, _ = attention_reference(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], softmax_scale=0.3)
    assert _rel(cupy.asnumpy(out).astype(np.float64), ref) <= RTOL["float32"]


def test_baseline_rejects_bad_input():
    q = cupy.zeros((1, 4, 3, 64), dtype=cupy.float32)
    k = cupy.zeros((1, 4, 2, 64), dtype=cupy.float32)
    with pytest.raises(ValueError, match="^k"):
        attention_baseline(q, k, k)
