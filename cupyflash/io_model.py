"""FLOPs and HBM bytes of attention, counted by hand (no GPU needed).

The argument of FlashAttention (arXiv 2205.14135, Sec. 3.2, Theorem 2) is about bytes moved
between device memory (HBM) and the chip, not FLOPs: the materialising algorithm and the tiled
one do the same arithmetic, but the first writes and re-reads the ``seqlen_q x seqlen_k`` score
and probability matrices. This module states, per algorithm, which tensors cross HBM and how
many times, so that ``explain()`` can report a prediction and ``experiments/exp_hbm.py`` can put
it beside what Nsight Compute measures (``dram__bytes_read.sum``, ``dram__bytes_write.sum``).

Conventions
-----------
* Sizes are elements; ``dtype`` is a name (``"bfloat16"``, ``"float16"``, ``"float32"``,
  ``"float64"``), a NumPy dtype, or an item size in bytes. Results are integers (FLOPs, bytes).
* Masks follow the README's "Semantics": causal and ``window_size=(left, right)`` are aligned
  bottom-right; query row ``i`` sees key ``j`` iff ``i + Sk - Sq - left <= j <= i + Sk - Sq +
  right`` (``-1`` = unbounded; causal is ``right = 0``).
* FLOPs count the two matrix products only, over the visible (query, key) pairs:
  ``4 * batch * nheads * pairs * headdim`` (``2 d`` for ``q.k`` and ``2 d`` for ``p v``); the
  softmax's exponentials are not counted (the field's convention, as in FlashAttention's
  benchmarks). Non-causal: ``pairs = Sq * Sk``.
* Traffic is a :class:`Traffic`: bytes read and written, and a breakdown by tensor. The model
  counts what the algorithm asks of global memory; a cache (the H200's 60 MB L2) can serve
  repeated reads, so measured DRAM bytes may be lower: each function says which reuse it assumes.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = [
    "Traffic", "itemsize", "visible_pairs", "visible_key_range", "prefill_flops", "decode_flops",
    "prefill_traffic", "prefill_hbm_bytes", "prefill_extra_memory",
    "baseline_traffic", "baseline_hbm_bytes", "baseline_extra_memory",
    "decode_traffic", "decode_hbm_bytes", "intensity", "backward_flops", "backward_extra_memory",
]

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
LSE_BYTES = 4  # LSE is float32 on the GPU (README, "Semantics")


def itemsize(dtype) -> int:
    """Bytes per element of ``dtype`` (a name, a NumPy dtype, or an int item size)."""
    if isinstance(dtype, (int, np.integer)):
        if int(dtype) not in (1, 2, 4, 8):
            raise ValueError(f"dtype: item size must be 1, 2, 4 or 8 bytes, got {dtype}")
        return int(dtype)
    name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None) or str(dtype)
    if name in _ITEMSIZE:
        return _ITEMSIZE[name]
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        raise ValueError(f"dtype: expected one of {sorted(_ITEMSIZE)} or an item size, "
                         f"got {dtype!r}") from None


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes an algorithm moves through HBM.

    read, write : int
        Bytes read from and written to device memory.
    terms : tuple of (name, bytes_read, bytes_written)
        The breakdown by tensor (e.g. ``("kv", 8_388_608, 0)``); sums to ``read``/``write``.
    """
    read: int
    write: int
    terms: tuple = ()

    @property
    def total(self) -> int:
        return self.read + self.write

    def as_dict(self) -> dict:
        return {"read": self.read, "write": self.write, "total": self.total,
                "terms": {n: {"read": r, "write": w} for n, r, w in self.terms}}


def _traffic(*terms) -> Traffic:
    terms = tuple((n, int(r), int(w)) for n, r, w in terms)
    return Traffic(read=sum(t[1] for t in terms), write=sum(t[2] for t in terms), terms=terms)


# ------------------------------------------------------------------------------------------------
# Which keys each query row sees
# ------------------------------------------------------------------------------------------------
def _check_lengths(seqlen_q: int, seqlen_k: int) -> None:
    if seqlen_q < 0 or seqlen_k < 0:
        raise ValueError(f"seqlen: lengths must be >= 0, got seqlen_q={seqlen_q}, seqlen_k={seqlen_k}")


def visible_key_range(rows, seqlen_q: int, seqlen_k: int, causal: bool = False,
                      window_size=(-1, -1)):
    """Half-open visible key range ``[lo, hi)`` of query rows ``rows`` (int or int array).

    The NumPy twin of ``kernels_cu/common/mask.cuh: visible_keys``; ``hi <= lo`` means empty.
    """
    left, right = window_size
    rows = np.asarray(rows, dtype=np.int64)
    diag = rows + (seqlen_k - seqlen_q)
    lo = np.zeros_like(rows)
    hi = np.full_like(rows, seqlen_k)
    if causal:
        hi = np.minimum(hi, diag + 1)
    if right >= 0:
        hi = np.minimum(hi, diag + right + 1)
    if left >= 0:
        lo = np.maximum(lo, diag - left)
    return lo, hi


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool = False, window_size=(-1, -1)) -> int:
    """Number of (query, key) pairs that the mask lets through, counted exactly.

    Non-causal without a window: ``seqlen_q * seqlen_k``. Causal with ``seqlen_q == seqlen_k == S``:
    ``S (S + 1) / 2``.
    """
    _check_lengths(seqlen_q, seqlen_k)
    if not causal and tuple(window_size) == (-1, -1):
        return seqlen_q * seqlen_k
    lo, hi = visible_key_range(np.arange(seqlen_q), seqlen_q, seqlen_k, causal, window_size)
    return int(np.maximum(hi - lo, 0).sum())


def prefill_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, headdim: int,
                  causal: bool = False, window_size=(-1, -1)) -> int:
    """FLOPs of the forward pass: ``4 * batch * nheads * visible_pairs * headdim``.

    The useful work: both the tiled kernel (which skips masked tiles) and the materialising
    baseline (which computes every score, then masks) are credited with this count, so TFLOP/s
    compare like with like (FlashAttention-2, arXiv 2307.08691, Sec. 4.1).
    """
    return 4 * batch * nheads * visible_pairs(seqlen_q, seqlen_k, causal, window_size) * headdim


def decode_flops(batch: int, nheads: int, seqlen_k: int, headdim: int, seqlen_q: int = 1,
                 causal: bool = True) -> int:
    """FLOPs of a decoding step: ``seqlen_q`` new queries against ``seqlen_k`` keys (bottom-right
    causal, so one query sees every key)."""
    return prefill_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal)


# ------------------------------------------------------------------------------------------------
# Tiled prefill (FlashAttention-2 forward)
# ------------------------------------------------------------------------------------------------
def _keys_per_query_tile(seqlen_q, seqlen_k, causal, window_size, block_m, block_n):
    """Keys loaded by each query tile of ``block_m`` rows: the union of its rows' visible ranges
    (contiguous, since a row's range moves by one key per row), widened to whole ``block_n`` tiles
    if ``block_n`` is given (the kernel iterates over key tiles; it skips tiles no row sees)."""
    ntiles = -(-seqlen_q // block_m)
    if ntiles == 0:
        return np.zeros(0, dtype=np.int64)
    if not causal and tuple(window_size) == (-1, -1):  # every tile sees every key
        return np.full(ntiles, seqlen_k, dtype=np.int64)
    first = np.arange(ntiles, dtype=np.int64) * block_m
    lo_rows, hi_rows = visible_key_range(np.arange(seqlen_q), seqlen_q, seqlen_k, causal, window_size)
    nonempty = hi_rows > lo_rows
    big = np.iinfo(np.int64).max
    lo = np.minimum.reduceat(np.where(nonempty, lo_rows, big), first)
    hi = np.maximum.reduceat(np.where(nonempty, hi_rows, -big), first)
    empty = lo == big
    if block_n:
        lo = (lo // block_n) * block_n
        hi = np.minimum(seqlen_k, -(-hi // block_n) * block_n)
    return np.where(empty, 0, hi - lo)


def _union_keys(seqlen_q, seqlen_k, causal, window_size) -> int:
    lo, hi = visible_key_range(np.arange(seqlen_q), seqlen_q, seqlen_k, causal, window_size)
    ok = hi > lo
    if not ok.any():
        return 0
    return int(hi[ok].max() - lo[ok].min())


def prefill_traffic(batch: int, nheads: int, nheads_k: int, seqlen_q: int, seqlen_k: int,
                    headdim: int, dtype, causal: bool = False, window_size=(-1, -1),
                    block_m: int = 128, block_n: int | None = None,
                    kv_reuse: bool = False) -> Traffic:
    """HBM traffic of the tiled forward pass (FlashAttention-2, arXiv 2307.08691, Algorithm 1).

    One thread block per (batch, query head, query tile of ``block_m`` rows) reads its Q tile once,
    streams the K and V tiles of its KV head that any of its rows can see (causal / window tiles
    that no row sees are skipped), and writes its O tile and its rows' LSE (float32).

    Parameters
    ----------
    batch, nheads, nheads_k, seqlen_q, seqlen_k, headdim : int
    dtype : str, numpy dtype or int
        Element type of q, k, v, o.
    causal : bool
    window_size : (int, int)
    block_m : int
        Query rows per thread block (``explain()``'s ``BLOCK_M``): the number of passes over K/V
        per head is ``ceil(seqlen_q / block_m)``.
    block_n : int, optional
        Key tile width; when given, each block's key range is widened to whole tiles.
    kv_reuse : bool
        ``False`` (default): every block's K/V loads come from HBM, as in the paper's count
        (Theorem 2) and with GQA counted as the kernel behaves: each query head's blocks read their
        KV head, so K/V bytes scale with ``nheads``, not ``nheads_k``. This is the traffic the
        kernel requests from the memory system (an upper bound on DRAM bytes). ``True``: each KV
        head's K and V are read from HBM once per batch element (the compulsory lower bound, what
        an L2 holding a head's K/V across its concurrently running query tiles delivers).

    Returns
    -------
    Traffic
        Terms ``q``, ``kv``, ``o``, ``lse``.
    """
    e = itemsize(dtype)
    _check_lengths(seqlen_q, seqlen_k)
    if block_m <= 0:
        raise ValueError(f"block_m: must be > 0, got {block_m}")
    q = batch * nheads * seqlen_q * headdim * e
    if kv_reuse:
        keys = batch * nheads_k * _union_keys(seqlen_q, seqlen_k, causal, window_size)
    else:
        keys = batch * nheads * int(_keys_per_query_tile(seqlen_q, seqlen_k, causal, window_size,
                                                         block_m, block_n).sum())
    kv = 2 * keys * headdim * e
    o = batch * nheads * seqlen_q * headdim * e
    lse = batch * nheads * seqlen_q * LSE_BYTES
    return _traffic(("q", q, 0), ("kv", kv, 0), ("o", 0, o), ("lse", 0, lse))


def prefill_hbm_bytes(batch: int, nheads: int, nheads_k: int, seqlen_q: int, seqlen_k: int,
                      headdim: int, dtype, causal: bool = False, window_size=(-1, -1),
                      block_m: int = 128, block_n: int | None = None, kv_reuse: bool = False) -> int:
    """Total bytes (read + write) of :func:`prefill_traffic`."""
    return prefill_traffic(batch, nheads, nheads_k, seqlen_q, seqlen_k, headdim, dtype, causal,
                           window_size, block_m, block_n, kv_reuse).total


def prefill_extra_memory(batch: int, nheads: int, seqlen_q: int) -> int:
    """Device memory the tiled forward allocates beyond its output: the float32 LSE,
    ``batch * nheads * seqlen_q * 4`` bytes: O(S)."""
    return batch * nheads * seqlen_q * LSE_BYTES


def backward_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, headdim: int,
                   causal: bool = False, window_size=(-1, -1), executed: bool = False) -> int:
    """FLOPs of the backward pass over the visible pairs, ``2 * batch * nheads * pairs *
    headdim`` per matrix product.

    ``executed=False``: the field's convention, FlashAttention-2's five products (S = Q K^T
    recomputed, dP = dO V^T, dV = P^T dO, dK = dS^T Q, dQ = dS K), 2.5 x :func:`prefill_flops`;
    backward TFLOP/s everywhere in this project use it. ``executed=True``: the seven products
    cupyflash's kernels compute (``kernels_cu/common/bwd_tile.cuh``: its dK/dV and dQ kernels
    each recompute S and dP instead of reducing dQ with atomics), 3.5 x :func:`prefill_flops`.
    """
    products = 7 if executed else 5
    return 2 * products * batch * nheads * visible_pairs(seqlen_q, seqlen_k, causal,
                                                         window_size) * headdim


def backward_extra_memory(batch: int, nheads: int, seqlen_q: int, dtype="bfloat16") -> int:
    """Device memory the backward allocates beyond its gradients: D = rowsum(dO * O), one
    value per query row (float32; float64 for float64 inputs): O(S), never S x S."""
    return batch * nheads * seqlen_q * (8 if itemsize(dtype) == 8 else 4)


# ------------------------------------------------------------------------------------------------
# Materialising baseline (cupyflash.baseline.attention_baseline)
# ------------------------------------------------------------------------------------------------
def _score_itemsize(dtype, score_dtype) -> int:
    if score_dtype is not None:
        return itemsize(score_dtype)
    return 8 if itemsize(dtype) == 8 else 4  # fp32 scores (fp64 for fp64 inputs)


def baseline_traffic(batch: int, nheads: int, nheads_k: int, seqlen_q: int, seqlen_k: int,
                     headdim: int, dtype, causal: bool = False, window_size=(-1, -1),
                     score_dtype=None, layout_copies: bool = True) -> Traffic:
    """HBM traffic of the materialising algorithm (FlashAttention arXiv 2205.14135, Algorithm 0).

    What ``cupyflash.baseline.attention_baseline`` does, and what this counts:

    1. (``layout_copies``) q, k, v are copied from (batch, seqlen, heads, d) into head-major
       contiguous buffers: each read once, written once.
    2. ``S = Q K^T`` (batched GEMM, one batch per KV head, the GQA group's queries stacked as rows):
       Q and K read once (the GEMM's tile re-reads are assumed served by L2), S written in
       ``score_dtype`` (float32; float64 for float64 inputs).
    3. Softmax over each row of S (masking causal / window): S read once (the kernel makes two
       passes over a row; the second is assumed to hit L2, rows being at most a few tens of KB),
       P written in the input dtype, LSE written (float32).
    4. ``O = P V``: P and V read once, O written (head-major); (``layout_copies``) O copied back to
       (batch, seqlen_q, nheads, d): read once, written once.

    The mask does not change the bytes: every score is computed, stored and read. The S and P
    terms, ``batch * nheads * seqlen_q * seqlen_k * (2 * score + 2 * dtype)`` bytes, are quadratic
    in the sequence length (slope 2 on a log-log plot at fixed batch and heads).

    Returns
    -------
    Traffic
        Terms ``layout``, ``qk`` (GEMM operands), ``scores`` (S), ``probs`` (P), ``lse``,
        ``v``, ``o``.
    """
    e = itemsize(dtype)
    se = _score_itemsize(dtype, score_dtype)
    _check_lengths(seqlen_q, seqlen_k)
    qn = batch * nheads * seqlen_q * headdim * e
    kn = batch * nheads_k * seqlen_k * headdim * e
    sq = batch * nheads * seqlen_q * seqlen_k
    terms = []
    if layout_copies:
        terms.append(("layout", qn + 2 * kn + qn, qn + 2 * kn + qn))  # q, k, v in; o out
    terms += [("qk", qn + kn, 0),
              ("scores", sq * se, sq * se),
              ("probs", sq * e, sq * e),
              ("lse", 0, batch * nheads * seqlen_q * LSE_BYTES),
              ("v", kn, 0),
              ("o", 0, qn)]
    return _traffic(*terms)


def baseline_hbm_bytes(batch: int, nheads: int, nheads_k: int, seqlen_q: int, seqlen_k: int,
                       headdim: int, dtype, causal: bool = False, window_size=(-1, -1),
                       score_dtype=None, layout_copies: bool = True) -> int:
    """Total bytes (read + write) of :func:`baseline_traffic`."""
    return baseline_traffic(batch, nheads, nheads_k, seqlen_q, seqlen_k, headdim, dtype, causal,
                            window_size, score_dtype, layout_copies).total


def baseline_extra_memory(batch: int, nheads: int, nheads_k: int, seqlen_q: int, seqlen_k: int,
                          headdim: int, dtype, score_dtype=None) -> int:
    """Peak device memory ``attention_baseline`` holds beyond its output (out and LSE), bytes.

    The buffers live in stages (each freed as soon as the next stage no longer needs it):
    ``qh + kh + S`` (first GEMM), ``S + P`` (softmax), ``P + vh + oh`` (second GEMM), ``oh``
    (copy-out), plus the float32 LSE for the whole call (counted here as extra; it is part of the
    result only with ``return_lse=True``). The peak is the largest stage; ``S + P``
    (``batch * nheads * Sq * Sk * (score + dtype)`` bytes) dominates as soon as ``Sk`` exceeds a
    few ``headdim``: O(S^2).
    """
    e = itemsize(dtype)
    se = _score_itemsize(dtype, score_dtype)
    qh = oh = batch * nheads * seqlen_q * headdim * e
    kh = vh = batch * nheads_k * seqlen_k * headdim * e
    s = batch * nheads * seqlen_q * seqlen_k * se
    p = batch * nheads * seqlen_q * seqlen_k * e
    lse = batch * nheads * seqlen_q * LSE_BYTES
    return max(qh + kh + s, s + p, p + vh + oh, oh) + lse


# ------------------------------------------------------------------------------------------------
# Split-KV decoding (Flash-Decoding)
# ------------------------------------------------------------------------------------------------
def decode_traffic(batch: int, nheads: int, nheads_k: int, seqlen_k: int, headdim: int, dtype,
                   num_splits: int = 1, seqlen_q: int = 1, page_size: int = 0,
                   write_lse: bool = True) -> Traffic:
    """HBM traffic of one split-KV decoding step over a KV cache of ``seqlen_k`` keys per sequence.

    The split kernel has one block per (split, sequence, KV head) (grid (KV heads, splits,
    batch) for contiguous caches, (splits, batch, KV heads) for paged ones): each block reads its
    share of its KV head's cache once and serves all ``nheads / nheads_k`` query heads of the GQA
    group and all ``seqlen_q`` queries, so K and V cross HBM once: ``2 * batch * nheads_k *
    seqlen_k * headdim`` elements. With ``num_splits > 1`` each split writes a float32 partial
    accumulator and its row's (m, l) for every query row, and the merge (the fused combine's last
    block) reads them back and writes the final output (the Flash-Decoding workspace); empty
    splits still write their (0, -inf, 0) partial. With ``num_splits == 1`` the split kernel
    writes the output and LSE directly.

    Parameters
    ----------
    page_size : int
        0 for a contiguous cache; otherwise the block table entries the step reads
        (``ceil(seqlen_k / page_size)`` int32 per sequence) are counted.
    write_lse : bool
        Count the final float32 LSE write.

    Returns
    -------
    Traffic
        Terms ``q``, ``kv``, ``meta`` (cache_seqlens, block table), ``workspace`` (partials,
        written by the split kernel and read by the combine), ``o``, ``lse``.
    """
    e = itemsize(dtype)
    if num_splits < 1:
        raise ValueError(f"num_splits: must be >= 1 for the model (0 = heuristic is resolved by "
                         f"the dispatcher first), got {num_splits}")
    rows = batch * nheads * seqlen_q
    q = rows * headdim * e
    kv = 2 * batch * nheads_k * seqlen_k * headdim * e
    meta = batch * 4 + (batch * (-(-seqlen_k // page_size)) * 4 if page_size else 0)
    o = rows * headdim * e
    lse = rows * LSE_BYTES if write_lse else 0
    terms = [("q", q, 0), ("kv", kv, 0), ("meta", meta, 0)]
    if num_splits > 1:
        ws = num_splits * rows * (headdim + 2) * 4  # fp32 partial accumulators and (m, l)
        terms.append(("workspace", ws, ws))
    terms += [("o", 0, o), ("lse", 0, lse)]
    return _traffic(*terms)


def decode_hbm_bytes(batch: int, nheads: int, nheads_k: int, seqlen_k: int, headdim: int, dtype,
                     num_splits: int = 1, seqlen_q: int = 1, page_size: int = 0,
                     write_lse: bool = True) -> int:
    """Total bytes (read + write) of :func:`decode_traffic`."""
    return decode_traffic(batch, nheads, nheads_k, seqlen_k, headdim, dtype, num_splits,
                          seqlen_q, page_size, write_lse).total


def intensity(flops: float, nbytes: float) -> float:
    """Arithmetic intensity, FLOP per byte of HBM traffic (``inf`` if no bytes move).

    Against a roofline with bandwidth ``BW`` (bytes/s) and peak ``P`` (FLOP/s), a kernel of
    intensity ``I`` cannot exceed ``min(P, I * BW)``.
    """
    if nbytes <= 0:
        return math.inf
    return flops / nbytes
