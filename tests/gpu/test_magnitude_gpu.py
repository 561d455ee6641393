"""GPU: every kernel family is exact at any finite score magnitude (docs/semantics.md, 6).

Cases come from :func:`cupyflash.testing.magnitude_cases`: small-integer ``q``/``k`` (so the raw
scores are exact in every accumulator and equal to the float64 reference's), a ``softmax_scale``
that puts the largest scaled score at a magnitude drawn log-uniformly up to 1e30, and a shifted
twin whose every score of a row is larger by an integer. Properties, per kernel family:

* no NaN or Inf; the output within :func:`cupyflash.testing.magnitude_tolerance` of the float64
  reference (componentwise: a few units of the dtype's and the accumulator's roundoff times
  ``softmax(s) |v|``), and the LSE within its bound;
* the shifted twin gives the same output (same bound) and an LSE larger by
  ``softmax_scale * shift``;
* one visible key gives exactly its V row.

Families: prefill through the public call (the TMA kernel on sm_90a for float16/bfloat16 where
the dispatcher takes it, mma.sync elsewhere, CUDA cores for float32/float64), the mma.sync
kernel launched directly at head dims 64 and 128, the materialising baseline, split-KV decode
(one split, and several splits merged by the fused combine; contiguous and paged caches), and
``merge_states`` (the separate combine kernel).
"""
import dataclasses

import numpy as np
import pytest
from hypothesis import given, strategies as st

cupy = pytest.importorskip("cupy")  # tests/gpu/conftest.py skips these without a device
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("precompiled")]

from cupyflash import baseline, reference, testing  # noqa: E402
from cupyflash.core import checks
from cupyflash.forward import kernels as prefill
from cupyflash import flash_attn_func, flash_attn_with_kvcache, merge_states  # noqa: E402
from gpu_arrays import to_device as _dev, to_host as _host  # noqa: E402 (tests/gpu/gpu_arrays.py)

EPS32 = 2.0 ** -23
ACC = {"float16": "float32", "bfloat16": "float32", "float32": "float32", "float64": "float64"}
_ALL_ONES = {2: np.int16, 4: np.int32, 8: np.int64}  # -1: every bit set, a NaN in each float type




def _poisoned(shape, dtype):
    """A CuPy array of ``dtype`` filled with NaN bit patterns (every launch writes into one)."""
    return cupy.full(shape, -1, dtype=_ALL_ONES[np.dtype(dtype).itemsize]).view(dtype)


def _assert_exact(out, lse, case, q, what):
    """No NaN/Inf, output and LSE within their bounds of the float64 reference (host arrays)."""
    out = np.asarray(out).astype(np.float64)
    lse = np.asarray(lse).astype(np.float64)
    assert np.isfinite(out).all(), f"{what}: NaN/Inf in out (magnitude {case.magnitude:.3g})"
    kw = case.kwargs()
    ref, ref_lse = reference.attention_reference(q, case.k, case.v, **kw)
    dt = str(case.q.dtype)
    out_tol, lse_tol = testing.magnitude_tolerance(q, case.k, case.v, dt, accumulate=ACC[dt], **kw)
    err = np.abs(out - ref)
    assert np.all(err <= out_tol), (f"{what}: out error {err.max():.3g} above its bound at "
                                    f"magnitude {case.magnitude:.3g}")
    fin = np.isfinite(ref_lse)
    assert np.array_equal(np.isneginf(lse), ~fin), f"{what}: -inf LSE rows differ"
    assert np.isfinite(lse[fin]).all(), f"{what}: NaN/Inf LSE"
    lse_err = np.abs(lse[fin] - ref_lse[fin])
    assert np.all(lse_err <= lse_tol[fin]), f"{what}: LSE error {lse_err.max():.3g}"
    return out, lse, out_tol, lse_tol


def _both(run, case, what):
    """The case and its shifted twin: both exact, the same output, and the LSE moved by
    softmax_scale * shift."""
    o0, l0, tol, ltol = _assert_exact(*run(case.q), case, case.q, what)
    o1, l1, _, _ = _assert_exact(*run(case.q_shifted), case, case.q_shifted, what + " (shifted)")
    assert np.all(np.abs(o1 - o0) <= 2 * tol), f"{what}: the shift changed the output"
    fin = np.isfinite(l0)
    want = l0[fin] + (case.shift * case.softmax_scale)[fin]
    assert np.all(np.abs(l1[fin] - want) <= 2 * ltol[fin] + 8 * EPS32 * np.abs(want)), \
        f"{what}: the LSE did not move by the shift"


def _one_key(run, case, what):
    """Keep only the first key: the output is exactly its V row, for every query row."""
    out, lse = run(case.q_shifted)
    group = case.q.shape[2] // case.k.shape[2]
    want = np.repeat(case.v[:, :1], group, axis=2)
    out = np.asarray(out)
    assert np.array_equal(out.astype(np.float64), np.broadcast_to(want, out.shape).astype(np.float64)), \
        f"{what}: one visible key must give its V row (magnitude {case.magnitude:.3g})"
    assert np.isfinite(np.asarray(lse)).all()


# ----------------------------------------------------------------------------------------------
# Prefill
# ----------------------------------------------------------------------------------------------
def _api(case, k, v):
    def run(q):
        out = _poisoned(q.shape, q.dtype)
        o, lse = flash_attn_func(_dev(q), _dev(k), _dev(v), return_lse=True, out=out,
                                 **case.kwargs())
        return _host(o), cupy.asnumpy(lse)
    return run


def _mma(case, k, v):
    dt = str(case.q.dtype)
    hd = case.q.shape[-1]

    def run(q):
        problem = checks.check_attention(q, k, v, **case.kwargs())
        pad = prefill.padded_headdim(hd)  # the 128-row 4-warp mma.sync row of the head dim
        cfg = next(c for c in prefill.SUPPORTED if c.isa == "mma" and c.dtype == dt
                   and c.headdim == pad and c.block_m == 128 and c.nwarps == 4)
        spec = prefill.spec_of(cfg, problem.causal)
        out = _poisoned(q.shape, q.dtype)
        lse = cupy.full((problem.batch, problem.nheads, problem.seqlen_q), np.nan, np.float32)
        prefill.launch(spec, _dev(q), _dev(k), _dev(v), out, lse, problem=problem)
        return _host(out), cupy.asnumpy(lse)
    return run


def _baseline(case, k, v):
    def run(q):
        o, lse = baseline.attention_baseline(_dev(q), _dev(k), _dev(v), return_lse=True,
                                             **case.kwargs())
        return _host(o), cupy.asnumpy(lse)
    return run


PREFILL = {"api": _api, "mma": _mma, "baseline": _baseline}


@pytest.mark.parametrize("family", sorted(PREFILL))
@given(data=st.data())
def test_prefill_exact_at_any_magnitude(family, data):
    mma = family == "mma"  # the 128-row 4-warp tiles: every padded head dim up to 128
    case = data.draw(testing.magnitude_cases(
        dtypes=("float16", "bfloat16") if mma else testing.DTYPES,
        headdims_from=(8, 64, 128) if mma else (8, 64, 128, 256)))
    run = PREFILL[family](case, case.k, case.v)
    _both(run, case, f"{family} {case.q.dtype} hd{case.q.shape[-1]}")
    first = dataclasses.replace(case, k=case.k[:, :1], v=case.v[:, :1], causal=False)
    _one_key(PREFILL[family](first, first.k, first.v), first, f"{family} one key")


# ----------------------------------------------------------------------------------------------
# Decode (split-KV, fused combine) and merge_states (the combine kernel)
# ----------------------------------------------------------------------------------------------
def _decode(case, k, v, paged, num_splits):
    batch, sk = k.shape[:2]
    if paged:
        ps = 16
        cap = -(-sk // ps) * ps
        pad = np.zeros((batch, cap - sk) + k.shape[2:], k.dtype)
        kc, bt = testing.contiguous_to_paged(np.concatenate([k, pad], 1), ps,
                                             np.random.default_rng(case.seed), 1)
        vc, _ = testing.contiguous_to_paged(np.concatenate([v, pad], 1), ps,
                                            np.random.default_rng(case.seed), 1)
        kc, vc, bt = _dev(kc), _dev(vc), cupy.asarray(bt.astype(np.int32))
    else:
        kc, vc, bt = _dev(k), _dev(v), None
    lens = cupy.full((batch,), sk, np.int32)

    def run(q):
        out = _poisoned(q.shape, q.dtype)
        o, lse = flash_attn_with_kvcache(_dev(q), kc, vc, cache_seqlens=lens, block_table=bt,
                                         num_splits=num_splits, return_lse=True, out=out,
                                         **case.kwargs())
        return _host(o), cupy.asnumpy(lse)
    return run


@pytest.mark.parametrize("paged", (False, True), ids=("contiguous", "paged"))
@pytest.mark.parametrize("num_splits", (1, 3))
@given(data=st.data())
def test_decode_exact_at_any_magnitude(paged, num_splits, data):
    case = data.draw(testing.magnitude_cases(dtypes=("float16", "bfloat16"), max_seqlen_q=4,
                                             max_seqlen_k=300, headdims_from=(64, 128),
                                             max_group=4))
    what = f"decode {'paged' if paged else 'contiguous'} splits={num_splits} {case.q.dtype}"
    _both(_decode(case, case.k, case.v, paged, num_splits), case, what)
    first = dataclasses.replace(case, k=case.k[:, :1], v=case.v[:, :1], causal=False)
    _one_key(_decode(first, first.k, first.v, paged, 1), first, what + " one key")


@given(st.integers(1, 6), st.floats(0.0, 30.0), st.integers(0, 2**32 - 1))
def test_merge_states_exact_at_any_magnitude(num_parts, log_mag, seed):
    rng = np.random.default_rng(seed)
    shape = (num_parts, 2, 3, 2, 64)
    o = rng.standard_normal(shape).astype(np.float32)
    mag = 10.0 ** log_mag
    # LSEs on a grid of 2**(e - 19) with |lse| <= 8 * 2**e and shifts of k * 2**e, |k| <= 4:
    # lse + shift stays below 2**(e + 4) on that grid (23 bits), so it is exact in float32 and
    # the shifted inputs are the same states (with a shift of k * mag, float32 rounded lse +
    # shift: an exact merge of what the kernel receives missed the output bound in 7 of 4000
    # CPU draws at magnitudes 1e2-1e3)
    e = int(np.ceil(np.log2(mag)))
    grid = 2.0 ** (e - 19)
    lse = rng.standard_normal((num_parts, 2, 2, 3)) * mag
    lse = (np.clip(np.round(lse / grid), -2 ** 22, 2 ** 22) * grid).astype(np.float32)
    lse[rng.random(lse.shape) < 0.2] = -np.inf                  # empty parts
    shift = (2.0 ** e * rng.integers(-4, 5, (1, 2, 2, 3))).astype(np.float32)
    assert np.array_equal((lse + shift).astype(np.float64), lse.astype(np.float64) + shift)
    ref_o, ref_lse = reference.merge_states(o, lse)
    for s in (np.float32(0), shift):
        out_o, out_lse = merge_states(cupy.asarray(o), cupy.asarray(lse + s))
        out_o, out_lse = cupy.asnumpy(out_o).astype(np.float64), cupy.asnumpy(out_lse).astype(np.float64)
        assert np.isfinite(out_o).all()
        w = reference.merge_states(np.abs(o), lse)[0]
        assert np.all(np.abs(out_o - ref_o) <= 64 * EPS32 * (w + np.abs(ref_o)))
        fin = np.isfinite(ref_lse)
        assert np.array_equal(np.isneginf(out_lse), ~fin)
        want = (ref_lse + np.broadcast_to(np.asarray(s, np.float64), lse.shape)[0])[fin]
        assert np.all(np.abs(out_lse[fin] - want) <= 16 * EPS32 * (1 + np.abs(want)))
    # a single visible part: its o, exactly
    one = np.full_like(lse, -np.inf)
    one[0] = (rng.standard_normal(lse.shape[1:]) * mag).astype(np.float32)
    out_o, _ = merge_states(cupy.asarray(o), cupy.asarray(one))
    assert np.array_equal(cupy.asnumpy(out_o), o[0])
