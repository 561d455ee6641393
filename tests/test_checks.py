"""Every bad input raises the named error, before any work, with the argument's name first."""
import math

import numpy as np
import pytest

from cupyflash import reference
from cupyflash.core import checks

pytestmark = pytest.mark.filterwarnings("error")

F32 = np.float32


def a(*shape, dtype=F32):
    """A small random array (content is irrelevant to the shape/dtype checks)."""
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


def i32(*vals):
    return np.array(vals, np.int32)


Q, K = a(2, 5, 4, 64), a(2, 7, 2, 64)


class FakeCuda:
    """Minimal stand-in for a device array (CuPy / torch CUDA): shape, dtype, CUDA interface."""

    def __init__(self, shape, dtype=F32, strides=None):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.__cuda_array_interface__ = {"shape": self.shape, "typestr": self.dtype.str,
                                         "data": (0, False), "version": 3, "strides": strides}


class FakeTorch:
    """Minimal stand-in for a torch tensor: ``.stride()`` in elements, no ``.strides``."""

    def __init__(self, shape, stride):
        self.shape, self.dtype, self._stride = tuple(shape), np.dtype(F32), tuple(stride)

    def stride(self):
        return self._stride


# (call, exception, leading argument name)
ATTN = checks.check_attention
VARLEN = checks.check_varlen
KV = checks.check_kvcache
PAGED = dict(cache_seqlens=i32(3, 40), block_table=i32([1, 2, 3], [4, 5, 6]))
KC = a(10, 16, 2, 64)
BAD_CALLS = {
    # --- dense ---
    "q not an array": (lambda: ATTN([[1.0]], K, K), TypeError, "q"),
    "q 3 dims": (lambda: ATTN(a(2, 5, 64), K, K), ValueError, "q"),
    "k 5 dims": (lambda: ATTN(Q, a(2, 7, 2, 64, 1), K), ValueError, "k"),
    "q int dtype": (lambda: ATTN(Q.astype(np.int32), K, K), TypeError, "q"),
    "q dtype not allowed": (lambda: ATTN(Q, K, K, dtypes=("float16",)), TypeError, "q"),
    "k dtype mismatch": (lambda: ATTN(Q, K.astype(np.float64), K), TypeError, "k"),
    "v dtype mismatch": (lambda: ATTN(Q, K, K.astype(np.float16)), TypeError, "v"),
    "k batch": (lambda: ATTN(Q, a(3, 7, 2, 64), a(3, 7, 2, 64)), ValueError, "k"),
    "k headdim": (lambda: ATTN(Q, a(2, 7, 2, 32), a(2, 7, 2, 32)), ValueError, "k"),
    "v shape": (lambda: ATTN(Q, K, a(2, 8, 2, 64)), ValueError, "v"),
    "headdim 60": (lambda: ATTN(a(2, 5, 4, 60), a(2, 7, 2, 60), a(2, 7, 2, 60)), ValueError, "q"),
    "headdim 264": (lambda: ATTN(a(1, 1, 1, 264), a(1, 1, 1, 264), a(1, 1, 1, 264)),
                    ValueError, "q"),
    "heads not divisible": (lambda: ATTN(Q, a(2, 7, 3, 64), a(2, 7, 3, 64)), ValueError, "k"),
    "nheads_k 0": (lambda: ATTN(Q, a(2, 7, 0, 64), a(2, 7, 0, 64)), ValueError, "k"),
    "scale nan": (lambda: ATTN(Q, K, K, softmax_scale=math.nan), ValueError, "softmax_scale"),
    "scale inf": (lambda: ATTN(Q, K, K, softmax_scale=math.inf), ValueError, "softmax_scale"),
    "scale 0": (lambda: ATTN(Q, K, K, softmax_scale=0.0), ValueError, "softmax_scale"),
    "scale negative": (lambda: ATTN(Q, K, K, softmax_scale=-1.0), ValueError, "softmax_scale"),
    "scale str": (lambda: ATTN(Q, K, K, softmax_scale="1"), TypeError, "softmax_scale"),
    "scale bool": (lambda: ATTN(Q, K, K, softmax_scale=True), TypeError, "softmax_scale"),
    "causal int": (lambda: ATTN(Q, K, K, causal=1), TypeError, "causal"),
    "window 3 entries": (lambda: ATTN(Q, K, K, window_size=(1, 2, 3)), TypeError, "window_size"),
    "window float": (lambda: ATTN(Q, K, K, window_size=(1.0, 2)), TypeError, "window_size"),
    "window -2": (lambda: ATTN(Q, K, K, window_size=(-2, 0)), ValueError, "window_size"),
    "out shape": (lambda: ATTN(Q, K, K, out=a(2, 5, 4, 32)), ValueError, "out"),
    "out dtype": (lambda: ATTN(Q, K, K, out=Q.astype(np.float64)), TypeError, "out"),
    "host/device mix": (lambda: ATTN(Q, FakeCuda(K.shape), K), TypeError, "k"),
    "device last dim strided": (
        lambda: ATTN(FakeCuda(Q.shape, strides=(5 * 4 * 128 * 4, 4 * 128 * 4, 128 * 4, 8)),
                     FakeCuda(K.shape), FakeCuda(K.shape)), ValueError, "q"),
    # --- varlen ---
    "varlen q 4 dims": (lambda: VARLEN(Q, a(9, 2, 64), a(9, 2, 64), i32(0, 9), i32(0, 9), 9, 9),
                        ValueError, "q"),
    "varlen k headdim": (lambda: VARLEN(a(9, 4, 64), a(9, 2, 32), a(9, 2, 32), i32(0, 9),
                                        i32(0, 9), 9, 9), ValueError, "k"),
    "cu_seqlens float": (lambda: VARLEN(a(9, 4, 64), a(9, 2, 64), a(9, 2, 64),
                                        np.array([0.0, 9.0]), i32(0, 9), 9, 9),
                         TypeError, "cu_seqlens_q"),
    "cu_seqlens beyond int32": (lambda: VARLEN(a(9, 4, 64), a(9, 2, 64), a(9, 2, 64),
                                               i32(0, 9), np.array([0, 2 ** 31]), 9, 9),
                                ValueError, "cu_seqlens_k"),
    "device cu_seqlens int64": (lambda: VARLEN(FakeCuda((9, 4, 64)), FakeCuda((9, 2, 64)),
                                               FakeCuda((9, 2, 64)), FakeCuda((2,), np.int64),
                                               FakeCuda((2,), np.int32), 9, 9),
                                TypeError, "cu_seqlens_q"),
    "cu_seqlens 2 dims": (lambda: VARLEN(a(9, 4, 64), a(9, 2, 64), a(9, 2, 64), i32([0, 9]),
                                         i32(0, 9), 9, 9), ValueError, "cu_seqlens_q"),
    "cu_seqlens empty": (lambda: VARLEN(a(0, 4, 64), a(0, 2, 64), a(0, 2, 64), i32(), i32(),
                                        0, 0), ValueError, "cu_seqlens_q"),
    "cu_seqlens_k length": (lambda: VARLEN(a(9, 4, 64), a(9, 2, 64), a(9, 2, 64), i32(0, 9),
                                           i32(0, 4, 9), 9, 9), ValueError, "cu_seqlens_k"),
    "cu_seqlens start": (lambda: VARLEN(a(9, 4, 64), a(9, 2, 64), a(9, 2, 64), i32(1, 9),
                                        i32(0, 9), 9, 9), ValueError, "cu_seqlens_q"),
    "cu_seqlens decreasing": (lambda: VARLEN(a(9, 4, 64), a(9, 2, 64), a(9, 2, 64),
                                             i32(0, 5, 3, 9), i32(0, 3, 6, 9), 9, 9),
                              ValueError, "cu_seqlens_q"),
    "cu_seqlens last": (lambda: VARLEN(a(9, 4, 64), a(9, 2, 64), a(9, 2, 64), i32(0, 9),
                                       i32(0, 8), 9, 9), ValueError, "cu_seqlens_k"),
    "max_seqlen_q small": (lambda: VARLEN(a(9, 4, 64), a(9, 2, 64), a(9, 2, 64), i32(0, 2, 9),
                                          i32(0, 4, 9), 6, 9), ValueError, "max_seqlen_q"),
    "max_seqlen_k negative": (lambda: VARLEN(a(9, 4, 64), a(9, 2, 64), a(9, 2, 64), i32(0, 9),
                                             i32(0, 9), 9, -1), ValueError, "max_seqlen_k"),
    "max_seqlen_k float": (lambda: VARLEN(a(9, 4, 64), a(9, 2, 64), a(9, 2, 64), i32(0, 9),
                                          i32(0, 9), 9, 9.0), TypeError, "max_seqlen_k"),
    "varlen out": (lambda: VARLEN(a(9, 4, 64), a(9, 2, 64), a(9, 2, 64), i32(0, 9), i32(0, 9),
                                  9, 9, out=a(8, 4, 64)), ValueError, "out"),
    # --- kv cache ---
    "kv q 3 dims": (lambda: KV(a(2, 4, 64), K, K), ValueError, "q"),
    "kv k_cache batch": (lambda: KV(Q, a(3, 7, 2, 64), a(3, 7, 2, 64)), ValueError, "k_cache"),
    "kv k_cache dtype": (lambda: KV(Q, K.astype(np.float16), K), TypeError, "k_cache"),
    "kv v_cache shape": (lambda: KV(Q, K, a(2, 8, 2, 64)), ValueError, "v_cache"),
    "kv heads": (lambda: KV(Q, a(2, 7, 3, 64), a(2, 7, 3, 64)), ValueError, "k_cache"),
    "kv k without v": (lambda: KV(Q, K, K, k=a(2, 1, 2, 64), cache_seqlens=i32(1, 1)),
                       TypeError, "v"),
    "kv v without k": (lambda: KV(Q, K, K, v=a(2, 1, 2, 64), cache_seqlens=i32(1, 1)),
                       TypeError, "k"),
    "kv k heads": (lambda: KV(Q, K, K, a(2, 1, 4, 64), a(2, 1, 4, 64), i32(1, 1)),
                   ValueError, "k"),
    "kv v shape": (lambda: KV(Q, K, K, a(2, 1, 2, 64), a(2, 2, 2, 64), i32(1, 1)),
                   ValueError, "v"),
    "kv append without seqlens": (lambda: KV(Q, K, K, a(2, 1, 2, 64), a(2, 1, 2, 64)),
                                  ValueError, "cache_seqlens"),
    "kv seqlens float": (lambda: KV(Q, K, K, cache_seqlens=np.array([1.0, 2.0])),
                         TypeError, "cache_seqlens"),
    "kv seqlens bool": (lambda: KV(Q, K, K, cache_seqlens=np.array([True, False])),
                        TypeError, "cache_seqlens"),
    "kv seqlens beyond int32": (lambda: KV(Q, K, K, cache_seqlens=np.array([1, -2 ** 31 - 1])),
                                ValueError, "cache_seqlens"),
    "kv device seqlens int64": (lambda: KV(FakeCuda(Q.shape), FakeCuda(K.shape),
                                           FakeCuda(K.shape),
                                           cache_seqlens=FakeCuda((2,), np.int64)),
                                TypeError, "cache_seqlens"),
    "kv seqlens shape": (lambda: KV(Q, K, K, cache_seqlens=i32(1, 2, 3)),
                         ValueError, "cache_seqlens"),
    "kv seqlens negative": (lambda: KV(Q, K, K, cache_seqlens=i32(1, -1)),
                            ValueError, "cache_seqlens"),
    "kv seqlens over capacity": (lambda: KV(Q, K, K, cache_seqlens=i32(1, 8)),
                                 ValueError, "cache_seqlens"),
    "kv append over capacity": (lambda: KV(Q, K, K, a(2, 2, 2, 64), a(2, 2, 2, 64),
                                           i32(1, 6)), ValueError, "cache_seqlens"),
    "kv num_splits negative": (lambda: KV(Q, K, K, num_splits=-1), ValueError, "num_splits"),
    "kv num_splits float": (lambda: KV(Q, K, K, num_splits=2.0), TypeError, "num_splits"),
    "kv causal None": (lambda: KV(Q, K, K, causal=None), TypeError, "causal"),
    "kv scale": (lambda: KV(Q, K, K, softmax_scale=-0.5), ValueError, "softmax_scale"),
    "kv out": (lambda: KV(Q, K, K, out=K), ValueError, "out"),
    "paged without seqlens": (lambda: KV(Q, KC, KC, block_table=i32([1, 2], [3, 4])),
                              ValueError, "cache_seqlens"),
    "paged table float": (lambda: KV(Q, KC, KC, cache_seqlens=i32(1, 1),
                                     block_table=np.array([[1.0], [2.0]])),
                          TypeError, "block_table"),
    "paged table beyond int32": (lambda: KV(Q, KC, KC, cache_seqlens=i32(1, 1),
                                            block_table=np.array([[1], [2 ** 32]], np.uint64)),
                                 ValueError, "block_table"),
    "paged table 1 dim": (lambda: KV(Q, KC, KC, cache_seqlens=i32(1, 1),
                                     block_table=i32(1, 2)), ValueError, "block_table"),
    "paged table batch": (lambda: KV(Q, KC, KC, cache_seqlens=i32(1, 1),
                                     block_table=i32([1], [2], [3])), ValueError, "block_table"),
    "paged page_size 0": (lambda: KV(Q, a(10, 0, 2, 64), a(10, 0, 2, 64), cache_seqlens=i32(0, 0),
                                     block_table=i32([1], [2])), ValueError, "k_cache"),
    "paged page id too big": (lambda: KV(Q, KC, KC, cache_seqlens=i32(3, 40),
                                         block_table=i32([1, 2, 3], [4, 5, 10])),
                              ValueError, "block_table"),
    "paged page id negative": (lambda: KV(Q, KC, KC, cache_seqlens=i32(3, 40),
                                          block_table=i32([-1, 2, 3], [4, 5, 6])),
                               ValueError, "block_table"),
    "paged over capacity": (lambda: KV(Q, KC, KC, cache_seqlens=i32(3, 49),
                                       block_table=i32([1, 2, 3], [4, 5, 6])),
                            ValueError, "cache_seqlens"),
    "paged append spills a page": (lambda: KV(Q, KC, KC, a(2, 2, 2, 64), a(2, 2, 2, 64),
                                              i32(3, 15), i32([1, 2], [3, 99])),
                                   ValueError, "block_table"),
    # --- merge ---
    "merge o 4 dims": (lambda: checks.check_merge(a(2, 1, 3, 4), a(2, 1, 4, 3)),
                       ValueError, "o_parts"),
    "merge lse shape": (lambda: checks.check_merge(a(2, 1, 3, 4, 8), a(2, 1, 3, 4)),
                        ValueError, "lse_parts"),
    "merge lse fp16": (lambda: checks.check_merge(a(2, 1, 3, 4, 8), a(2, 1, 4, 3,
                                                                     dtype=np.float16)),
                       TypeError, "lse_parts"),
    "merge 0 parts": (lambda: checks.check_merge(a(0, 1, 3, 4, 8), a(0, 1, 4, 3)),
                      ValueError, "o_parts"),
    "merge headdim": (lambda: checks.check_merge(a(2, 1, 3, 4, 5), a(2, 1, 4, 3)),
                      ValueError, "o_parts"),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS), ids=str)
def test_bad_call_raises_named_error(case):
    call, exc, name = BAD_CALLS[case]
    with pytest.raises(exc) as info:
        call()
    assert str(info.value).startswith(name + ":"), str(info.value)


# ----------------------------------------------------------------------------------------------
# Index arrays: any integer dtype on the host (values within int32), int32 on the GPU
# ----------------------------------------------------------------------------------------------
HOST_INT_DTYPES = (np.int64, np.int32, np.int16, np.uint8, np.uint32, np.uint64)


@pytest.mark.parametrize("dt", HOST_INT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_host_index_arrays_of_any_integer_dtype(dt):
    """NumPy's default int64 (``np.array([3, 5])``, ``np.cumsum``) and the other integer dtypes
    are accepted on the host, as a list already was; the problem and the reference's result are
    those of int32."""
    import cupyflash
    lens = np.array([3, 6])
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(dt)  # np.cumsum: int64
    qv, kv = a(9, 4, 64), a(9, 2, 64)
    assert VARLEN(qv, kv, kv, cu, cu, 6, 6) == VARLEN(qv, kv, kv, i32(0, 3, 9), i32(0, 3, 9), 6, 6)
    out, lse = reference.varlen_attention_reference(qv, kv, kv, cu, cu)
    want, want_lse = reference.varlen_attention_reference(qv, kv, kv, i32(0, 3, 9), i32(0, 3, 9))
    assert np.array_equal(out, want) and np.array_equal(lse, want_lse)
    cs, bt = np.array([3, 40]).astype(dt), np.array([[1, 2, 3], [4, 5, 6]]).astype(dt)
    assert KV(Q, KC, KC, cache_seqlens=cs, block_table=bt) == KV(Q, KC, KC, **PAGED)
    out = reference.kvcache_attention_reference(Q, KC, KC, cache_seqlens=cs, block_table=bt)
    want = reference.kvcache_attention_reference(Q, KC, KC, **PAGED)
    assert np.array_equal(out[0], want[0])
    # the plans read them too (no compile: report=False where the call has it)
    q16, k16 = qv.astype(np.float16), kv.astype(np.float16)
    p = cupyflash.explain_varlen(q16, k16, k16, cu, cu, 6, 6, arch="sm_80")
    assert p == cupyflash.explain_varlen(q16, k16, k16, i32(0, 3, 9), i32(0, 3, 9), 6, 6,
                                         arch="sm_80")
    kc16 = KC.astype(np.float16)
    p = cupyflash.explain_kvcache(Q.astype(np.float16), kc16, kc16, cache_seqlens=cs,
                                  block_table=bt, report=False)
    assert p == cupyflash.explain_kvcache(Q.astype(np.float16), kc16, kc16, report=False,
                                          **PAGED)


def test_host_index_values_outside_int32_name_the_entry():
    with pytest.raises(ValueError, match=r"^cache_seqlens: values must fit int32.*"
                                         r"cache_seqlens\[1\]=4294967296"):
        KV(Q, K, K, cache_seqlens=np.array([1, 2 ** 32]))
    with pytest.raises(ValueError, match=r"^block_table: .*block_table\[1, 0\]=-2147483649"):
        KV(Q, KC, KC, cache_seqlens=i32(1, 1), block_table=np.array([[1], [-2 ** 31 - 1]]))


def test_device_index_arrays_say_how_to_convert():
    """On the GPU the kernels read int32: the message gives the conversion of the caller's
    library (CuPy's ``astype``, torch's ``to``)."""
    with pytest.raises(TypeError, match=r"^cache_seqlens: dtype int64 is not supported on the "
                                        r"GPU.*\.astype\(cupy\.int32\).*\.to\(torch\.int32\)"):
        KV(FakeCuda(Q.shape), FakeCuda(K.shape), FakeCuda(K.shape),
           cache_seqlens=FakeCuda((2,), np.int64))
    torch = pytest.importorskip("torch")
    t = torch.zeros(3, dtype=torch.int64, device="meta")  # a tensor: torch's own conversion
    assert checks._int32_hint(t, "cu_seqlens_q") == "pass cu_seqlens_q.to(torch.int32)"


def test_varlen_call_with_host_cu_seqlens_says_how_to_copy_them():
    """A CUDA ``q`` with ``np.cumsum`` cu_seqlens: the message copies them to the device (not
    the NumPy reference's hint meant for host ``q``)."""
    import cupyflash
    cu = np.array([0, 9])
    with pytest.raises(TypeError, match=r"^cu_seqlens_q: expected a CUDA array.*"
                                        r"cupy\.asarray\(cu_seqlens_q, dtype=cupy\.int32\)"):
        cupyflash.flash_attn_varlen_func(FakeCuda((9, 4, 64)), FakeCuda((9, 2, 64)),
                                         FakeCuda((9, 2, 64)), cu, cu, 9, 9)


# Bad inputs to the reference raise the same errors, before any arithmetic (the compute kernels
# of the reference are replaced by traps).
REF_BAD = {
    "attention headdim": (lambda: reference.attention_reference(a(1, 2, 1, 12), a(1, 2, 1, 12),
                                                                a(1, 2, 1, 12)), ValueError, "q"),
    "online scale": (lambda: reference.online_softmax_attention(Q, K, K, softmax_scale=0.0),
                     ValueError, "softmax_scale"),
    "online block": (lambda: reference.online_softmax_attention(Q, K, K, block_size_k=0),
                     ValueError, "block_size_k"),
    "split num_splits": (lambda: reference.split_kv_partials(Q, K, K, num_splits=0),
                         ValueError, "num_splits"),
    "split heads": (lambda: reference.split_kv_partials(Q, a(2, 7, 3, 64), a(2, 7, 3, 64),
                                                        num_splits=2), ValueError, "k"),
    "merge lse": (lambda: reference.merge_states(a(2, 1, 3, 4, 8), a(2, 1, 3, 4)),
                  ValueError, "lse_parts"),
    "varlen cu": (lambda: reference.varlen_attention_reference(
        a(9, 4, 64), a(9, 2, 64), a(9, 2, 64), i32(0, 5, 3, 9), i32(0, 3, 6, 9)),
        ValueError, "cu_seqlens_q"),
    "kvcache page id": (lambda: reference.kvcache_attention_reference(
        Q, KC, KC, cache_seqlens=i32(3, 40), block_table=i32([1, 2, 3], [4, 5, 10])),
        ValueError, "block_table"),
    "kvcache window": (lambda: reference.attention_reference(Q, K, K, window_size=(0, -3)),
                       ValueError, "window_size"),
}


@pytest.mark.parametrize("case", sorted(REF_BAD), ids=str)
def test_reference_checks_before_work(case, monkeypatch):
    def trap(*args, **kwargs):
        raise AssertionError("computation started before validation")
    for fn in ("_one_shot", "_stream", "online_softmax_update"):
        monkeypatch.setattr(reference, fn, trap)
    call, exc, name = REF_BAD[case]
    with pytest.raises(exc) as info:
        call()
    assert str(info.value).startswith(name + ":"), str(info.value)


# ----------------------------------------------------------------------------------------------
# Good calls: the returned problem descriptions
# ----------------------------------------------------------------------------------------------
def test_attention_problem_fields():
    p = checks.check_attention(Q, K, K)
    assert p == checks.AttnProblem(batch=2, seqlen_q=5, seqlen_k=7, nheads=4, nheads_k=2,
                                   headdim=64, dtype="float32", softmax_scale=0.125,
                                   causal=False, window_size=(-1, -1))


@pytest.mark.parametrize("causal, window, want_window, want_causal", [
    (True, (-1, -1), (-1, 0), True),
    (False, (-1, 0), (-1, 0), True),
    (True, (4, 7), (4, 0), True),
    (False, (4, 7), (4, 7), False),
    (False, (3, -1), (3, -1), False),
])
def test_causal_folds_into_window(causal, window, want_window, want_causal):
    p = checks.check_attention(Q, K, K, causal=causal, window_size=window)
    assert p.window_size == want_window and p.causal is want_causal


@pytest.mark.parametrize("d", [8, 24, 72, 136, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_every_multiple_of_8_and_dtype_accepted(d, dtype):
    from cupyflash.testing import np_dtype
    dt = np_dtype(dtype)
    p = checks.check_attention(a(1, 3, 2, d, dtype=dt), a(1, 4, 1, d, dtype=dt),
                               a(1, 4, 1, d, dtype=dt))
    assert p.headdim == d and p.dtype == dtype and p.softmax_scale == 1 / math.sqrt(d)


def test_empty_sizes_accepted():
    p = checks.check_attention(a(0, 0, 2, 8), a(0, 0, 2, 8), a(0, 0, 2, 8))
    assert (p.batch, p.seqlen_q, p.seqlen_k) == (0, 0, 0)


def test_varlen_problem_fields():
    p = checks.check_varlen(a(9, 4, 64), a(11, 2, 64), a(11, 2, 64), i32(0, 0, 9),
                            i32(0, 11, 11), 10, 12, causal=True)
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.total_q, p.total_k, p.varlen) == \
        (2, 10, 12, 9, 11, True)
    assert p.window_size == (-1, 0)


def test_varlen_validate_false_skips_values():
    p = checks.check_varlen(a(9, 4, 64), a(9, 2, 64), a(9, 2, 64), i32(0, 5, 3, 9),
                            i32(0, 3, 6, 9), 1, 1, validate=False)
    assert p.batch == 3


def test_decode_problem_fields_contiguous():
    p = checks.check_kvcache(Q, a(2, 40, 2, 64), a(2, 40, 2, 64), a(2, 3, 2, 64),
                             a(2, 3, 2, 64), i32(0, 37), num_splits=5)
    assert (p.paged, p.seqlen_cache, p.page_size, p.num_pages, p.max_pages_per_seq,
            p.seqlen_new, p.num_splits, p.causal) == (False, 40, 0, 0, 0, 3, 5, True)


def test_decode_problem_fields_paged():
    p = checks.check_kvcache(Q, KC, KC, cache_seqlens=i32(3, 40),
                             block_table=i32([1, 2, -7], [4, 5, 6]), causal=False)
    assert (p.paged, p.seqlen_cache, p.page_size, p.num_pages, p.max_pages_per_seq,
            p.seqlen_new, p.causal) == (True, 48, 16, 10, 3, 0, False)


def test_unused_block_table_entries_are_not_checked():
    # sequence 0 uses 1 page (3 tokens); its other entries may hold anything
    checks.check_kvcache(Q, KC, KC, cache_seqlens=i32(3, 0), block_table=i32([1, 99, -5],
                                                                             [-1, -1, -1]))


def test_merge_shape():
    assert checks.check_merge(a(3, 1, 5, 2, 16), a(3, 1, 2, 5)) == (3, 1, 5, 2, 16)


@pytest.mark.parametrize("scale, want", [(None, 0.125), (0.5, 0.5), (2, 2.0),
                                         (np.float32(0.25), 0.25)])
def test_resolve_softmax_scale(scale, want):
    assert checks.resolve_softmax_scale(scale, 64) == want


# ----------------------------------------------------------------------------------------------
# Strides, dtype names, host copies
# ----------------------------------------------------------------------------------------------
def test_last_dim_contiguous_numpy():
    x = a(2, 3, 4, 16)
    checks.check_last_dim_contiguous(x, "q")
    checks.check_last_dim_contiguous(x[:, ::2], "q")              # other strides are free
    with pytest.raises(ValueError, match=r"^q: last dimension must be contiguous"):
        checks.check_last_dim_contiguous(x[..., ::2], "q")


def test_last_dim_contiguous_cuda_interface_and_torch():
    checks.check_last_dim_contiguous(FakeCuda((2, 3, 4, 16)), "k")  # strides None = C order
    checks.check_last_dim_contiguous(FakeCuda((2, 3, 4, 16), strides=(768, 256, 64, 4)), "k")
    with pytest.raises(ValueError, match=r"^k: .*stride 2 elements"):
        checks.check_last_dim_contiguous(FakeCuda((2, 3, 4, 16), strides=(1536, 512, 128, 8)),
                                         "k")
    checks.check_last_dim_contiguous(FakeTorch((2, 3, 4, 16), (192, 64, 16, 1)), "v")
    with pytest.raises(ValueError, match=r"^v: "):
        checks.check_last_dim_contiguous(FakeTorch((2, 3, 4, 16), (192, 64, 1, 4)), "v")


def test_dtype_name():
    from cupyflash.testing import np_dtype

    class TorchLike:
        dtype = "torch.bfloat16"  # str() of a torch dtype; np.dtype() rejects it
    assert checks.dtype_name(np.zeros(1, np_dtype("bfloat16"))) == "bfloat16"
    assert checks.dtype_name(TorchLike()) == "bfloat16"


def test_raw_two_byte_elements_get_a_bfloat16_hint():
    """cupy.asarray(torch bfloat16 tensor) gives 'void16' elements: the error says what to do."""
    q = np.zeros((1, 4, 2, 64), np.float16).view("V2")
    k = np.zeros((1, 4, 2, 64), np.float16)
    with pytest.raises(TypeError, match=r"^q: dtype void16 is not supported.*torch bfloat16"):
        checks.check_attention(q, k, k)
    with pytest.raises(TypeError, match=r"^q: dtype float64 is not supported; supported: "
                                        r"float16, bfloat16$"):
        checks._check_dtype(np.zeros(2), "q", ("float16", "bfloat16"))


def test_to_host_numpy_and_lists():
    x = a(2, 3)
    assert checks.to_host(x) is x
    assert checks.to_host([[1.0, 2.0]]).shape == (1, 2)


def test_checks_does_not_import_cupy():
    import subprocess
    import sys
    code = ("import sys, cupyflash.core.checks, cupyflash.reference; "
            "assert 'cupy' not in sys.modules, 'cupy imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------------------------
# kernel_window: unreachable window bounds reach the kernels as -1 (no int32 overflow there)
# ----------------------------------------------------------------------------------------------
from hypothesis import given, strategies as st  # noqa: E402


class _Win:
    def __init__(self, sq, sk, window):
        self.seqlen_q, self.seqlen_k, self.window_size = sq, sk, window


_BOUND = st.one_of(st.integers(-1, 45), st.sampled_from([2 ** 31 - 1, 2 ** 31 - 2, 2 ** 30]))


@given(sq=st.integers(0, 40), sk=st.integers(0, 40), left=_BOUND, right=_BOUND)
def test_kernel_window_keeps_the_mask(sq, sk, left, right):
    kl, kr = checks.kernel_window(_Win(sq, sk, (left, right)))
    assert kl in (left, -1) and kr in (right, -1)
    assert -1 <= kl < max(sk, 1) and -1 <= kr < max(sq, 1)  # small enough for int32 arithmetic
    same = reference.attention_mask(sq, sk, window_size=(kl, kr))
    want = reference.attention_mask(sq, sk, window_size=(left, right))
    assert np.array_equal(same, want)


def test_kernel_window_examples():
    assert checks.kernel_window(_Win(128, 128, (-1, 2 ** 31 - 1))) == (-1, -1)
    assert checks.kernel_window(_Win(128, 64, (2 ** 31 - 1, 0))) == (-1, 0)  # causal kept
    assert checks.kernel_window(_Win(128, 64, (16, 8))) == (16, 8)
    assert checks.kernel_window(_Win(1, 64, (5, 0))) == (5, 0)


def test_device_array_without_a_gpu_gets_a_clear_error():
    """Fresh-user trial (2026-11-29, 0f2272b): on a machine without a CUDA driver, a device array passed
    to the GPU path raised CuPy's "CUDA driver version is insufficient"; now the argument is
    named and the NumPy references are pointed to."""
    from cupyflash.core import interop
    pytest.importorskip("cupy")
    if interop._no_gpu_reason() is None:
        pytest.skip("a CUDA GPU is present")
    fake = FakeCuda((2, 1, 4, 64), np.float16)
    with pytest.raises(RuntimeError, match=r"^q: no usable CUDA GPU \(.*\); the NumPy "
                                           r"references in cupyflash.reference run without one"):
        interop.as_cupy(fake, "q")
