"""float32 emulation of the split-decode kernel's softmax arithmetic and of its split merge.

Why: the GPU property ``tests/gpu/test_magnitude_gpu.py::test_decode_exact_at_any_magnitude``
failed in a soak run for 3 splits at score magnitudes 1e6-1e7 (float16, out error above
:func:`cupyflash.testing.magnitude_tolerance`). This file re-executes, operation by operation in
``np.float32``, what ``kernels_cu/decode/split.cu`` does to one query row -- the per-warp online
softmax over its keys of each tile, the warp merge of the epilogue, what a split writes to the
workspace, and the fused combine -- so that the merge arithmetic is checked against the project's
own bound on every CI run without a GPU.

Three merges are emulated on the same per-split states:

* ``"lse"`` (split.cu as of commit 14c8a20): a split writes ``o_i = acc_i / l_i`` and
  ``lse_i = fma(m_i c, ln2, ln l_i)`` in float32 (``SoftmaxRow::lse``); the last block merges
  with ``LseMerge4`` (weights ``exp2((lse_i - lse_max) log2e)``). ``lse_i`` holds the *scaled*
  max: its float32 ulp is 0.0078 at 1e5, 0.0625 at 1e6, 1 at 1e7, so when the maxima of several
  splits tie (their exact weights are ``l_1 : l_2 : ...``, e.g. 1 : 2) the ``ln l_i`` that tells
  them apart is rounded away (weights off by up to ``e^(ulp/2)`` each, or all equal from 1e8 on)
  and the output misses the bound: from ~1e5 (float16, bound 4 * 2^-10 W) or ~1e6 (bfloat16,
  4 * 2^-7 W) upwards, at any magnitude up to 1e30.
* ``"raw"`` (the kernel's since 2026-12-02: ``decode_merge``, ``PartialMerge4``): a split writes its raw-score max ``m_i``, its ``l_i`` and its
  *unnormalised* ``acc_i`` (all float32: exactly the values its own warp merge produced), and
  the merge is the warp merge one level up: ``M = max m_i``, ``f_i = exp2((m_i - M) c)``,
  ``L = sum l_i f_i``, ``out = (sum f_i acc_i) / L``, ``lse = fma(M c, ln2, ln L)``. ``m_i - M``
  is a difference of two raw scores (exact for tied maxima, Sterbenz for close ones), so tied
  splits get ``f_i = 1`` exactly and nothing in the merge grows with the magnitude; the final
  LSE is rounded once, as with one split.
* ``"raw_normalised"``: as ``"raw"`` but the split stores ``o_i = acc_i * (1 / l_i)`` and the
  merge weighs it by ``w_i = fl(l_i f_i)``: three more roundings per part (1 / l, the product,
  l f), measured 2.5 vs 2.1 float32 ulps of ``sum f_i |acc_i| / L`` at worst; no benefit.

The arithmetic the kernel implements (``c = scale_log2``; per row, 4 columns per item):

    split epilogue, num_splits > 1 (the warp merge unchanged: tot.m, f_w, tot.l = sum fma):
        a = 0; for w: a = fmaf(acc_w, f_w, a)           # NOT multiplied by inv_l(tot.l)
        o_part[split, b, qi, h, c:c+4] = a               # float4
        if c == 0: ml_part[split, b, h, qi] = (tot.m, tot.l)  # raw max (-inf: empty), l (0)
    merge (last block), per batch of N parts, state (m = -inf, l = 0, acc[4] = 0):
        mb = max over parts u < n of m_u;  if mb == -inf: skip the batch
        m_new = fmaxf(m, mb); ref = softmax_ref(m_new)
        f = exp2f((m - ref) * c)                         # 0 on the first batch
        lb = 0, a[4] = 0; for u: ok = u < n && m_u != -inf
            wt = ok ? exp2f((m_u - ref) * c) : 0         # difference first, then * c
            lb = ok ? fmaf(l_u, wt, lb) : lb;  a[x] = ok ? fmaf(wt, acc_u[x], a[x]) : a[x]
        l = fmaf(l, f, lb); acc[x] = fmaf(acc[x], f, a[x]); m = m_new
    out[x] = from_float<T>(acc[x] * inv_l(l));  lse = l == 0 ? -inf : fmaf(m * c, ln2, logf(l))
        (= SoftmaxRow<float>{m, l}.lse(l, c): the one-split LSE formula)

:func:`merge_raw` is this for one batch (at most kMergeHalf = 8 splits at hd <= 128). The
public ``merge_states`` (combine.cu: ``lse_weight``, ``merged_lse``) keeps its ``(o, lse)``
contract.

Correspondence with the kernel (``kernels_cu/decode/split.cu``, ``common/online_softmax.cuh``)
is given line by line in :func:`emulate_split` and the merge functions. Modelled as exact or
correctly rounded (the kernel's instructions are within 1-2 ulp of these; ``ulp_noise_seed``
perturbs exp2 by up to 2 ulp and log by 1 ulp, at random, to show that nothing depends on it):

* ``q . k``: exact (small integers; every partial sum is exact in the fp32 mma accumulator);
* ``exp2f`` (``-ftz=true``): the float64 ``exp2`` of the float32 argument, rounded to float32,
  results below 2^-126 flushed to 0; ``logf``: float64 ``log`` rounded;
* ``mma.m16n8k16`` with fp32 accumulate: ``fl32(C + sum of the 16 exact products)``;
* ``fmaf(a, b, c)``: ``fl32(a b + c)`` through float64 (a b is exact there; the sum may round
  twice, an error of at most 1 float32 ulp on ties);
* contractions: ``tot.l += sL * f`` and ``o.x += x.x * f`` are FFMAs (nvcc/NVRTC contract by
  default); ``l *= alpha``, ``acc *= alpha``, ``(s - ref) * c`` are separate roundings (the
  kernel computes the difference first, see online_softmax.cuh).

Row independence: every quantity of the kernel's softmax belongs to one query row (the mma
fragment only decides which thread holds which keys), so the emulation runs all rows of a case
at once, vectorised over ``(batch, head, query)``; the per-thread shares of ``l`` are kept (thread
``t`` of a quad owns keys ``2t, 2t+1, 8+2t, 9+2t`` of each 16-key step) and reduced as the
epilogue's two ``__shfl_xor_sync`` do. Paged and contiguous caches run the same arithmetic
(``KvPath``: "bitwise the same result"), so no page table is emulated.

Run as a script for the study behind the verdict (``--tied``: :func:`with_ties` on every case;
``--noise``: 1-2 ulp noise; ``--splits 2,3,5``)::

    python tests/test_decode_merge_emulation.py --draws 3000 --magnitudes drawn,1e6,1e7,1e30
    python tests/test_decode_merge_emulation.py --draws 600 --tied --seed 1

Measured (2026-12-02, 3 splits): over 3000 draws of the GPU test's own strategy rescaled to each
magnitude, ``"lse"`` missed the bound in 2 at 3e6 and 1e7 and in 3 at 1e8-1e30 (0 at <= 1e6 and
at the drawn magnitudes), ``"raw"``, ``"raw_normalised"`` and one split in none. With ties forced
(600 draws, 224 float16 + 376 bfloat16), ``"lse"`` missed in 0 at <= 3e4, 1 at 1e5, 54 at 3e5
(all float16), 102 at 1e6 (100 + 2), 333 at 3e6, 413 at 1e7, 430 at 1e8-1e30, by up to 344x the
bound; ``"raw"`` in none at any magnitude from 1 to 1e30, with 2, 3 or 5 splits, with or without
ulp noise (largest error 0.124 of the bound: the output's rounding to float16/bfloat16).
"""
from __future__ import annotations

import dataclasses
import math
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cupyflash import reference, testing
from cupyflash.decode import plan as decode_plan
from cupyflash.decode.kernels import ONE_BLOCK_SPLIT_CONFIGS, SPLIT_CONFIGS

ml_dtypes = pytest.importorskip("ml_dtypes")

F32 = np.float32
EPS32 = 2.0 ** -23
#: float32 constants exactly as the kernel spells them (online_softmax.cuh)
LN2_F = F32(0.693147180559945309417232121458176568)
LOG2E_F = F32(1.44269504088896340736)
FLT_MIN = 2.0 ** -126
#: The GPU test's strategy arguments (tests/gpu/test_magnitude_gpu.py::test_decode_exact_...).
GPU_CASE_ARGS = dict(dtypes=("float16", "bfloat16"), max_seqlen_q=4, max_seqlen_k=300,
                     headdims_from=(64, 128), max_group=4)
#: (block_n, nwarps) of the split kernel per compiled head dim: the one-block tile the planner
#: takes for the GPU test's small problems (decode.kernels.split_config), and the two-blocks-per-SM
#: tile it takes when the unsplit blocks exceed the SMs (SPLIT_CONFIGS).
TILES = {hd: sorted({(cfg.block_n, cfg.nwarps) for cfg in
                     (SPLIT_CONFIGS[hd], ONE_BLOCK_SPLIT_CONFIGS.get(hd, SPLIT_CONFIGS[hd]))})
         for hd in (64, 128)}
SCHEMES = ("lse", "raw", "raw_normalised")


# ----------------------------------------------------------------------------------------------
# float32 primitives (the CUDA functions the kernel calls, modelled as described above)
# ----------------------------------------------------------------------------------------------
class Fp32:
    """The kernel's scalar functions; ``rng`` (ulp_noise) perturbs exp2 by <= 2 ulp, log by 1."""

    def __init__(self, rng: np.random.Generator | None = None):
        self.rng = rng

    def _ulps(self, x, n):
        """x moved by a random number of ulps in [-n, n] (finite nonzero x only)."""
        if self.rng is None:
            return x
        k = self.rng.integers(-n, n + 1, np.shape(x))
        y = np.asarray(x, F32).copy()
        for _ in range(n):
            y = np.where(k > 0, np.nextafter(y, F32(np.inf)),
                         np.where(k < 0, np.nextafter(y, F32(-np.inf)), y)).astype(F32)
            k = k - np.sign(k)
        return np.where(np.isfinite(x) & (x != 0), y, x).astype(F32)

    def exp2(self, x):
        """exp2f with -ftz=true: exp2(0) = 1 and exp2(-inf) = 0 exactly; < 2^-126 -> 0."""
        x = np.asarray(x, F32)
        with np.errstate(over="ignore"):
            y = np.exp2(x.astype(np.float64)).astype(F32)
        y = np.where(x == 0, F32(1), self._ulps(y, 2))
        return np.where(y < FLT_MIN, F32(0), y).astype(F32)

    def log(self, x):
        x = np.asarray(x, F32)
        with np.errstate(divide="ignore"):
            y = np.log(x.astype(np.float64)).astype(F32)
        return self._ulps(y, 1)


def fma32(a, b, c):
    """fmaf(a, b, c): a b exact in float64, one (rarely two) roundings to float32."""
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64)
            + np.asarray(c, np.float64)).astype(F32)


def ftz(x):
    """-ftz=true: a float32 result below 2^-126 in magnitude is +-0."""
    return np.where(np.abs(x) < FLT_MIN, x * F32(0), x).astype(F32)


def softmax_ref(m):
    """softmax_ref: the reference point m, or 0 while m = -inf."""
    return np.where(m == -np.inf, F32(0), m).astype(F32)


def to_dtype(x, dtype):
    """from_float<T> / pack2<T>: round-to-nearest-even float32 -> float16/bfloat16 (as float32)."""
    return np.asarray(x, F32).astype(testing.np_dtype(dtype)).astype(F32)


# ----------------------------------------------------------------------------------------------
# The split kernel: one split's (m, l, acc) per query row
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class SplitState:
    """What one split's epilogue has for each row, after the warp merge (float32): the raw max
    ``m`` (``tot.m``), the row sum ``l`` (``tot.l``) and the unnormalised ``acc`` (the ``o``
    sum over the warps, before ``o *= inv``)."""
    m: np.ndarray    # (..., )
    l: np.ndarray    # (..., )
    acc: np.ndarray  # (..., d)


def scores_and_values(q, k, v):
    """Exact raw scores (float32, heads first: (b, h, sq, sk)) and V per head (b, h, sk, d)."""
    nh, nhk = q.shape[2], k.shape[2]
    kh = np.repeat(k.astype(np.float64), nh // nhk, axis=2)
    vh = np.repeat(v.astype(F32), nh // nhk, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), kh)
    assert np.all(np.abs(s) < 2 ** 24) and np.array_equal(s, np.round(s)), "scores: exact"
    return s.astype(F32), vh.transpose(0, 2, 1, 3)


def visible_mask(sq, sk, causal, block_len):
    """(sq, block_len) key_visible of visible_keys(row, sq, len = sk, causal) for keys < block_len
    (keys at or past len: zero-filled rows, scores -inf)."""
    i = np.arange(sq)[:, None]
    j = np.arange(block_len)[None, :]
    hi = np.minimum(sk, i + sk - sq + 1) if causal else np.full_like(i, sk)
    return (j >= 0) & (j < hi)


def split_tiles(seqlen, num_splits, block_n, split):
    """[tile_begin, tile_end) of `split` (split.cu: tiles_per_split, tile_begin, tile_end)."""
    n_tiles = -(-seqlen // block_n)
    tps = n_tiles if num_splits == 1 else -(-n_tiles // num_splits)
    t0 = min(split * tps, n_tiles)
    return t0, min(t0 + tps, n_tiles)


def emulate_split(s, vh, vis, dtype, c, block_n, nwarps, t0, t1, fp: Fp32) -> SplitState:
    """One split block of decode_split over tiles [t0, t1), all rows at once.

    s: raw scores (b, h, sq, sk) float32; vh: V (b, h, sk, d) in dtype's values (float32);
    vis: (sq, sk) visibility; c: scale_log2 (float32). Kernel lines in the comments."""
    lead, d = s.shape[:-1], vh.shape[-1]
    sk = s.shape[-1]
    kpw = block_n // nwarps                        # Tr::kKeysPerWarp
    pad = max(0, t1 * block_n - sk)                # keys past len: zero-filled K/V rows
    s = np.concatenate([s, np.zeros(lead + (pad,), F32)], -1)
    vh = np.concatenate([vh, np.zeros(vh.shape[:2] + (pad, d), F32)], -2)
    vis = np.concatenate([vis, np.zeros((vis.shape[0], pad), bool)], -1)
    # SoftmaxRow<float> row[2]; row.init(): m = -inf, l = 0 (l per thread: 4 of a quad)
    m = np.full((nwarps,) + lead, -np.inf, F32)
    lt = np.zeros((nwarps,) + lead + (4,), F32)
    acc = np.zeros((nwarps,) + lead + (d,), F32)   # float acc[HEADDIM / 8][4] = 0
    for tile in range(t0, t1):                     # for it in [0, n_iter)
        for w in range(nwarps):                    # the warps run the same code on their keys
            key0 = tile * block_n + w * kpw        # key0 = (tile_begin + it) * BLOCK_N + warp_key0
            js = np.arange(key0, key0 + kpw)
            # mask: -inf outside the row's visible range; mx = fmaxf over the warp's keys
            sc = np.where(vis[:, js], s[..., js], F32(-np.inf)).astype(F32)
            mx = sc.max(axis=-1)                   # + the two quad shuffles (max: exact)
            # alpha = row.update(mx, scale_log2): m_new = max(m, mx); alpha = exp2((m - ref) c)
            m_new = np.maximum(m[w], mx)
            ref = softmax_ref(m_new)
            alpha = fp.exp2((m[w] - ref) * c)      # (x - ref) * c: two float32 roundings
            m[w] = m_new
            lt[w] = ftz(lt[w] * alpha[..., None])  # l *= alpha (each thread's share)
            acc[w] = ftz(acc[w] * alpha[..., None])  # acc[dt][e] *= alpha[e >> 1]
            for kw in range(kpw // 16):            # for kw < kKSteps
                ks = slice(kw * 16, kw * 16 + 16)
                # pr = SoftmaxRow::prob(s, ref, c) = exp2((s - ref) * c)
                pr = fp.exp2((sc[..., ks] - ref[..., None]) * c)
                # row.l += pr, nt = 0 then 1, e & 1 = 0 then 1: thread t adds keys
                # 2t, 2t + 1, 8 + 2t, 9 + 2t of this 16-key step, in that order
                for t in range(4):
                    for x in (2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t):
                        lt[w][..., t] = lt[w][..., t] + pr[..., x]
                # pa = pack2<T>(pr...) (round to nearest even), O += P V (mma, fp32 accumulate)
                p16 = to_dtype(pr, dtype).astype(np.float64)
                vv = vh[..., key0 + kw * 16:key0 + kw * 16 + 16, :].astype(np.float64)
                prod = np.einsum("bhqk,bhkd->bhqd", p16, vv)
                acc[w] = (acc[w].astype(np.float64) + prod).astype(F32)
    # epilogue: row[rh].l += shfl_xor(l, 1); += shfl_xor(l, 2)  ->  (l0 + l1) + (l2 + l3)
    lw = (lt[..., 0] + lt[..., 1]) + (lt[..., 2] + lt[..., 3])
    # tot.m = fmaxf over the warps; f_w = merge_factor(m_w, tot.m, c); tot.l += sL * f (FFMA)
    tot_m = m.max(axis=0)
    ref = softmax_ref(tot_m)
    tot_l = np.zeros(lead, F32)
    o = np.zeros(lead + (d,), F32)
    for w in range(nwarps):
        f = fp.exp2((m[w] - ref) * c)
        tot_l = fma32(lw[w], f, tot_l)
        o = fma32(acc[w], f[..., None], o)         # o.x += x.x * f (FFMA), warp order
    return SplitState(m=tot_m, l=tot_l, acc=o)


def inv_l(l):
    """SoftmaxRow::inv_l: 1 / l (IEEE division), 0 for l = 0."""
    with np.errstate(divide="ignore"):
        return np.where(l == 0, F32(0), F32(1) / np.where(l == 0, F32(1), l)).astype(F32)


def split_lse(st_: SplitState, c, fp: Fp32):
    """SoftmaxRow::lse: fma(m * c, ln2, logf(l)); -inf for l = 0."""
    return np.where(st_.l == 0, F32(-np.inf), fma32(st_.m * c, LN2_F, fp.log(st_.l))).astype(F32)


def normalised(st_: SplitState):
    """The split's o_i = acc * inv (sRow[r] = inv_l(tot.l); o.x *= inv)."""
    return (st_.acc * inv_l(st_.l)[..., None]).astype(F32)


# ----------------------------------------------------------------------------------------------
# Merges (what the last block of a head does: the fused combine)
# ----------------------------------------------------------------------------------------------
def merge_lse(parts, c, dtype, fp: Fp32):
    """The kernel's merge until 2026-12-02 (split.cu at 14c8a20; ``LseMerge4`` has since left
    online_softmax.cuh): o_i, lse_i written in float32, ``LseMerge4::add_batch`` (one batch: the
    number of splits is at most kMergeHalf = 8 at hd <= 128), then out = from_float(acc * inv),
    lse = merged_lse(m, l) = m + logf(l)."""
    lse = [split_lse(p, c, fp) for p in parts]         # p.lse_part[...] = lse
    o = [normalised(p) for p in parts]                 # p.o_part[...] = o (float4)
    mb = np.maximum.reduce(lse)                        # four max chains, then fmaxf of them
    m_new = mb                                         # fmaxf(m = -inf, mb)
    lb = np.zeros(mb.shape, F32)
    a = np.zeros(o[0].shape, F32)
    for u in range(len(parts)):                        # u < N, in order
        ok = lse[u] != -np.inf
        # wt[u] = lse_weight(lse, m_new) = exp2((lse - softmax_ref(m_new)) * kLog2e)
        wt = np.where(ok, fp.exp2((lse[u] - softmax_ref(m_new)) * LOG2E_F), F32(0)).astype(F32)
        lb = np.where(ok, lb + wt, lb).astype(F32)
        a = np.where(ok[..., None], fma32(wt[..., None], o[u], a), a).astype(F32)
    # l = fmaf(l = 0, f = 0, lb), acc = fmaf(0, 0, a): lb, a (an all-empty batch returns early)
    out = to_dtype(a * inv_l(lb)[..., None], dtype)
    with np.errstate(divide="ignore"):
        out_lse = np.where(lb == 0, F32(-np.inf), m_new + fp.log(lb)).astype(F32)  # merged_lse
    return out, out_lse


def merge_raw(parts, c, dtype, fp: Fp32, normalise=False):
    """Recommended merge: the warp merge one level up, on the splits' raw (m_i, l_i, acc_i).

    M = max m_i; f_i = exp2((m_i - softmax_ref(M)) c); L = fma(l_i, f_i, L) and
    A = fma(acc_i, f_i, A) in split order; out = from_float(A * inv_l(L)); lse = fma(M c, ln2,
    logf(L)) (SoftmaxRow::lse). ``normalise``: the split stores o_i = acc_i * inv_l(l_i) and the
    merge weighs it by w_i = fl(l_i f_i): L += w_i, A = fma(w_i, o_i, A)."""
    M = np.maximum.reduce([p.m for p in parts])
    ref = softmax_ref(M)
    L = np.zeros(M.shape, F32)
    A = np.zeros(parts[0].acc.shape, F32)
    for p in parts:
        f = fp.exp2((p.m - ref) * c)                   # empty split: m = -inf -> 0
        if normalise:
            w = ftz(p.l * f)
            L = (L + w).astype(F32)
            A = fma32(w[..., None], normalised(p), A)
        else:
            L = fma32(p.l, f, L)
            A = fma32(p.acc, f[..., None], A)
    out = to_dtype(A * inv_l(L)[..., None], dtype)
    lse = np.where(L == 0, F32(-np.inf), fma32(M * c, LN2_F, fp.log(L))).astype(F32)
    return out, lse


def emulate_decode(q, k, v, softmax_scale, causal, *, num_splits, block_n, nwarps,
                   scheme="raw", ulp_noise_seed=None, cast=True):
    """out (b, sq, h, d) in q's dtype (as float32 values) and lse (b, h, sq) float32 of the
    split kernel on a full cache of seqlen_k = k.shape[1] keys (cache_seqlens = seqlen_k).
    ``cast=False``: the float32 output before its rounding to q's dtype."""
    dtype = str(q.dtype)
    fp = Fp32(None if ulp_noise_seed is None else np.random.default_rng(ulp_noise_seed))
    c = F32(softmax_scale * math.log2(math.e))        # decode/__init__.py: scale_log2
    s, vh = scores_and_values(q, k, v)
    sq, sk = q.shape[1], k.shape[1]
    vis = visible_mask(sq, sk, causal, sk)
    parts = [emulate_split(s, vh, vis, dtype, c, block_n, nwarps,
                           *split_tiles(sk, num_splits, block_n, sp), fp)
             for sp in range(num_splits)]
    odt = dtype if cast else "float32"
    if num_splits == 1:                               # direct: o * inv in T, SoftmaxRow::lse
        out, lse = to_dtype(normalised(parts[0]), odt), split_lse(parts[0], c, fp)
    elif scheme == "lse":
        out, lse = merge_lse(parts, c, odt, fp)
    elif scheme in ("raw", "raw_normalised"):
        out, lse = merge_raw(parts, c, odt, fp, normalise=scheme == "raw_normalised")
    else:
        raise ValueError(scheme)
    return out.transpose(0, 2, 1, 3), lse


# ----------------------------------------------------------------------------------------------
# The GPU test's properties (tests/gpu/test_magnitude_gpu.py: _assert_exact, _both)
# ----------------------------------------------------------------------------------------------
def violations(case, run, ratio=None) -> dict:
    """``run(q) -> (out, lse)``; returns {property: excess} for each property of _both that fails
    (excess: how far above the bound, in the property's units); empty when all hold. ``ratio``
    (a dict): gets "out", the largest |out - ref| / bound of the case and its twin."""
    bad = {}
    kw = case.kwargs()
    dt = str(case.q.dtype)
    res = {}
    for name, q in (("", case.q), (" (shifted)", case.q_shifted)):
        out, lse = (np.asarray(x, np.float64) for x in run(q))
        ref, ref_lse = reference.attention_reference(q, case.k, case.v, **kw)
        tol, ltol = testing.magnitude_tolerance(q, case.k, case.v, dt, accumulate="float32", **kw)
        if not np.isfinite(out).all():
            bad["nan" + name] = math.inf
        err = np.abs(out - ref) - tol
        if ratio is not None:
            with np.errstate(divide="ignore", invalid="ignore"):
                r = np.where(tol > 0, np.abs(out - ref) / tol, np.where(out == ref, 0, np.inf))
            ratio["out"] = max(ratio.get("out", 0.0), float(r.max()))
        if np.any(err > 0):
            bad["out" + name] = float(err.max())
        fin = np.isfinite(ref_lse)
        if not np.array_equal(np.isneginf(lse), ~fin) or not np.isfinite(lse[fin]).all():
            bad["lse_inf" + name] = math.inf
        else:
            lerr = np.abs(lse[fin] - ref_lse[fin]) - ltol[fin]
            if np.any(lerr > 0):
                bad["lse" + name] = float(lerr.max())
        res[name] = (out, lse, tol, ltol)
    (o0, l0, tol, ltol), (o1, l1, _, _) = res[""], res[" (shifted)"]
    d = np.abs(o1 - o0) - 2 * tol
    if np.isfinite(d).all() and np.any(d > 0):
        bad["shift_out"] = float(d.max())
    fin = np.isfinite(l0)
    want = l0[fin] + (case.shift * case.softmax_scale)[fin]
    with np.errstate(invalid="ignore"):
        ld = np.abs(l1[fin] - want) - (2 * ltol[fin] + 8 * EPS32 * np.abs(want))
    if not np.all(ld <= 0):
        bad["shift_lse"] = float(ld.max())
    return bad


def runner(case, num_splits, scheme, tile=None, ulp_noise_seed=None):
    """``run(q)`` for :func:`violations`: the emulated kernel on the case's k, v; ``tile``
    (block_n, nwarps), default the planner's tile for the GPU test's small problems
    (decode.kernels.split_config: hd64 128 x 4, hd128 128 x 8)."""
    if tile is None:
        cfg = ONE_BLOCK_SPLIT_CONFIGS.get(case.q.shape[-1], SPLIT_CONFIGS[case.q.shape[-1]])
        tile = (cfg.block_n, cfg.nwarps)
    return lambda q: emulate_decode(q, case.k, case.v, case.softmax_scale, case.causal,
                                    num_splits=num_splits, block_n=tile[0], nwarps=tile[1],
                                    scheme=scheme, ulp_noise_seed=ulp_noise_seed)


def at_magnitude(case, magnitude):
    """The case with softmax_scale rescaled so that its largest |scaled score| is ``magnitude``."""
    return dataclasses.replace(case, softmax_scale=case.softmax_scale * magnitude / case.magnitude,
                               magnitude=magnitude)


def tied_case(dtype="float16", headdim=64, seqlen_k=260, magnitude=1e7, seed=0):
    """A case of the GPU test's shape whose row max is reached in each of the 3 splits (keys 5,
    133 and 259 of a 128-key tile) a different number of times, so the exact weights of the
    splits are 1 : 2 : 3 -- what a scaled float32 LSE cannot carry at 1e7."""
    rng = np.random.default_rng(seed)
    npdt = testing.np_dtype(dtype)
    q = rng.integers(-3, 4, (1, 1, 1, headdim)).astype(np.float64)
    k = rng.integers(-3, 4, (1, seqlen_k, 1, headdim)).astype(np.float64)
    q[..., -1] = 0.0
    k[..., -1] = testing.SHIFT_KEY
    q[0, 0, 0, :-1] = np.where(q[0, 0, 0, :-1] == 0, 1, q[0, 0, 0, :-1])
    top = np.sign(q[0, 0, 0, :-1]) * 3                  # the largest possible score
    k[0, :, 0, :-1] = np.clip(k[0, :, 0, :-1], -2, 2)  # every other key scores lower
    for j in (5, 133, 134, 259, 257, 258):             # 1 in split 0, 2 in split 1, 3 in split 2
        k[0, j, 0, :-1] = top
    qs = q.copy()
    qs[..., -1] = 7
    raw = np.einsum("bqhd,bkhd->bhqk", qs, k)
    smax = max(float(np.abs(raw).max()), float(np.abs(np.einsum("bqhd,bkhd->bhqk", q, k)).max()))
    return testing.MagnitudeCase(
        q=q.astype(npdt), q_shifted=qs.astype(npdt), k=k.astype(npdt),
        v=testing.random_normal(rng, (1, seqlen_k, 1, headdim), dtype),
        shift=np.full((1, 1, 1), testing.SHIFT_KEY * 7.0), softmax_scale=magnitude / smax,
        causal=False, magnitude=magnitude, seed=seed)


def with_ties(case, seed, min_keys=129, max_keys=300):
    """``case`` lengthened to ``min_keys..max_keys`` keys (new small-integer keys, new normal
    values) and with 1-5 copies of the max key of each KV head's last query row (whose causal
    range is every key) at random positions: ties of the row max within and across splits, in
    unequal numbers -- the situation where merging the splits must weigh them exactly by their
    l_i. softmax_scale is reset so that the largest |scaled score| is still ``case.magnitude``."""
    rng = np.random.default_rng(seed)
    dt = str(case.q.dtype)
    q, qs = case.q.astype(np.float64), case.q_shifted.astype(np.float64)
    k = case.k.astype(np.float64)
    batch, sk, nhk, d = k.shape
    hpk, sq = q.shape[2] // nhk, q.shape[1]
    extra = max(0, int(rng.integers(min_keys, max_keys + 1)) - sk)
    k_new = rng.integers(-3, 4, (batch, extra, nhk, d)).astype(np.float64)
    k_new[..., -1] = testing.SHIFT_KEY
    k = np.concatenate([k, k_new], 1)
    v = np.concatenate([case.v, testing.random_normal(rng, (batch, extra, nhk, d), dt)], 1)
    for b in range(batch):
        for hk in range(nhk):
            j = int(np.argmax(k[b, :, hk] @ q[b, sq - 1, hk * hpk]))
            pos = rng.choice(k.shape[1], int(rng.integers(1, 6)), replace=False)
            k[b, pos, hk] = k[b, j, hk]
    kh = np.repeat(k, hpk, axis=2)
    smax = max(float(np.abs(np.einsum("bqhd,bkhd->bhqk", x, kh)).max()) for x in (q, qs))
    return dataclasses.replace(case, k=k.astype(case.k.dtype), v=v,
                               softmax_scale=case.magnitude / max(smax, 1.0))


@st.composite
def tied_cases(draw, magnitudes=None):
    """:func:`with_ties` of the GPU test's cases; ``magnitudes``: a strategy of magnitudes to
    rescale to (default: the case's own)."""
    case = draw(testing.magnitude_cases(**GPU_CASE_ARGS))
    if magnitudes is not None:
        case = at_magnitude(case, draw(magnitudes))
    return with_ties(case, draw(st.integers(0, 2**32 - 1)))


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------
def test_emulation_in_float64_limit_is_the_reference():
    """Sanity of the emulation: at a small magnitude (no rounding issue anywhere) both merges and
    one split agree with the float64 reference to the dtype's rounding."""
    case = tied_case(magnitude=3.0)
    ref, ref_lse = reference.attention_reference(case.q, case.k, case.v, **case.kwargs())
    for ns, scheme in ((1, "raw"), (3, "lse"), (3, "raw"), (3, "raw_normalised")):
        out, lse = runner(case, ns, scheme)(case.q)
        assert np.abs(out - ref).max() <= 4 * 2.0 ** -10 * np.abs(case.v.astype(float)).max()
        assert np.abs(lse - ref_lse).max() <= 1e-5


def test_split_tiles_match_split_layout():
    for sk in (1, 127, 128, 129, 210, 256, 257, 292, 300):
        for ns in (1, 2, 3, 8):
            for bn in (64, 128):
                got = [split_tiles(sk, ns, bn, s) for s in range(ns)]
                want = decode_plan.split_layout(sk, ns, bn)
                assert [(min(a * bn, sk), min(b * bn, sk)) for a, b in got] == want


@pytest.mark.parametrize("dtype,magnitude", [("float16", 1e6), ("float16", 1e7),
                                             ("bfloat16", 1e7), ("bfloat16", 1e30)])
def test_scaled_lse_merge_misses_the_bound_on_tied_splits(dtype, magnitude):
    """The GPU soak failure, reproduced: splits whose maxima tie (1, 2 and 3 keys) at magnitude
    1e6-1e30 are weighted through float32 LSEs that have lost the ln(l_i) differences (ulp
    0.0625 at 1e6, 1 at 1e7), and the output misses the bound; the raw (m, l, acc) merge meets
    it, and one split (the same arithmetic without a merge) meets it too."""
    case = tied_case(dtype=dtype, magnitude=magnitude)
    assert "out" in violations(case, runner(case, 3, "lse"))
    assert violations(case, runner(case, 3, "raw")) == {}
    assert violations(case, runner(case, 1, "raw")) == {}


@given(case=testing.magnitude_cases(**GPU_CASE_ARGS), num_splits=st.sampled_from([2, 3, 5]),
       small_tile=st.booleans())
def test_raw_merge_exact_at_any_magnitude(case, num_splits, small_tile):
    """The recommended merge passes the GPU test's properties (_assert_exact and _both of
    tests/gpu/test_magnitude_gpu.py) over the GPU test's own strategy (magnitudes 0.01-1e30),
    for both tiles the planner uses at each head dim."""
    tiles = TILES[case.q.shape[-1]]
    tile = tiles[0] if small_tile else tiles[-1]
    assert violations(case, runner(case, num_splits, "raw", tile)) == {}


@given(case=tied_cases(st.one_of(st.sampled_from([1e5, 1e6, 3e6, 1e7, 3e7, 1e9, 1e30]),
                                 st.floats(4.0, 30.0).map(lambda e: 10.0 ** e))),
       noise=st.booleans())
def test_raw_merge_exact_with_tied_splits(case, noise):
    """The soak's failing situation on every example: 3 splits, 129-300 keys, the row max tied
    within and across splits in unequal numbers, at magnitudes 1e4-1e30 with 1e6-1e7 drawn
    explicitly; with and without 1-2 ulp noise on exp2/log."""
    seed = case.seed if noise else None
    assert violations(case, runner(case, 3, "raw", ulp_noise_seed=seed)) == {}


# ----------------------------------------------------------------------------------------------
# Study (python tests/test_decode_merge_emulation.py): violations per scheme and magnitude
# ----------------------------------------------------------------------------------------------
def _study(draws, magnitudes, schemes, splits, noise, tied, seed):
    import collections
    import time

    from hypothesis import Phase, seed as hypothesis_seed

    rng = np.random.default_rng(seed)
    cases = []

    @hypothesis_seed(seed)
    @settings(max_examples=draws, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=testing.magnitude_cases(**GPU_CASE_ARGS), tie_seed=st.integers(0, 2**32 - 1))
    def collect(case, tie_seed):
        cases.append((case, tie_seed))

    collect()
    t = time.time()
    fails = collections.Counter()
    kinds = collections.Counter()
    worst = collections.defaultdict(float)
    ratios = collections.defaultdict(float)
    for case, tie_seed in cases:
        for mag in magnitudes:
            c = case if mag is None else at_magnitude(case, mag)
            if tied:
                c = with_ties(c, tie_seed)
            key = "drawn" if mag is None else f"{mag:.0e}"
            for scheme in schemes:
                for ns in ([1] if scheme == "one_split" else splits):
                    nz = rng.integers(2**31) if noise else None
                    rat = {}
                    bad = violations(c, runner(c, ns, "raw" if ns == 1 else scheme,
                                               ulp_noise_seed=nz), rat)
                    ratios[(scheme, ns, key)] = max(ratios[(scheme, ns, key)], rat["out"])
                    fails[(scheme, ns, key)] += bool(bad)
                    fails[(scheme, ns, key, str(c.q.dtype))] += bool(bad)
                    for kind, x in bad.items():
                        kinds[(scheme, ns, key, kind)] += 1
                        worst[(scheme, ns, key)] = max(worst[(scheme, ns, key)], x)
    n = len(cases)
    per_dt = collections.Counter(str(c.q.dtype) for c, _ in cases)
    print(f"{n} cases ({'tied' if tied else 'as drawn'}{', ulp noise' if noise else ''}; "
          f"{dict(per_dt)}) x {len(magnitudes)} magnitudes in {time.time() - t:.0f} s")
    for scheme in schemes:
        for ns in ([1] if scheme == "one_split" else splits):
            keys = ["drawn" if m is None else f"{m:.0e}" for m in magnitudes]
            row = [f"{k} {fails[(scheme, ns, k)]} ({fails[(scheme, ns, k, 'float16')]}+"
                   f"{fails[(scheme, ns, k, 'bfloat16')]})" for k in keys]
            print(f"{scheme} splits={ns}, violations/{n} (fp16+bf16): " + ", ".join(row))
            print("    largest |out - ref| / bound: "
                  + ", ".join(f"{k} {ratios[(scheme, ns, k)]:.3g}" for k in keys))
    for key, x in sorted(worst.items()):
        detail = {k[3]: v for k, v in kinds.items() if k[:3] == key}
        print("  worst excess", key, f"{x:.3g}", detail)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=100)
    ap.add_argument("--magnitudes",
                    default="drawn,1e0,1e2,1e3,1e4,1e5,3e5,1e6,3e6,1e7,1e8,1e10,1e15,1e20,1e30")
    ap.add_argument("--schemes", default="lse,raw,raw_normalised,one_split")
    ap.add_argument("--splits", default="3")
    ap.add_argument("--noise", action="store_true", help="1-2 ulp noise on exp2 and log")
    ap.add_argument("--tied", action="store_true", help="with_ties on every case")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    _study(a.draws, [None if m == "drawn" else float(m) for m in a.magnitudes.split(",")],
           a.schemes.split(","), [int(x) for x in a.splits.split(",")], a.noise, a.tied, a.seed)
    sys.exit(0)
