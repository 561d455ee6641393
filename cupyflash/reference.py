"""NumPy reference implementations: the definition of "correct" for every cupyflash kernel.

* :func:`attention_reference`: one-shot softmax attention in float64 (materialises the scores).
* :func:`online_softmax_attention`: the streaming algorithm of FlashAttention (running max ``m``,
  normaliser ``l``, unscaled accumulator ``acc`` rescaled by ``exp(m_old - m_new)``), vectorised
  over query rows, over blocks of ``block_size_k`` keys, in the input's dtype or float64.
* :func:`split_kv_partials` and :func:`merge_states`: Flash-Decoding's split-KV partial states
  ``(o, lse)`` and their exact combination.
* :func:`varlen_attention_reference`: packed variable-length batches (``cu_seqlens``).
* :func:`kvcache_attention_reference`: decode against a contiguous or paged KV cache, with
  optional new tokens appended at ``cache_seqlens``.
* :func:`attention_backward`: the gradients ``(dq, dk, dv)`` of attention, one-shot in float64
  (materialises the probabilities).
* :func:`streaming_attention_backward`: the same gradients by FlashAttention-2's backward
  algorithm (blocks of queries and keys, probabilities recomputed from the forward's LSE), as the
  kernels compute it, in float64 or float32.
* :func:`varlen_attention_backward`: the gradients over a packed variable-length batch.

The online-softmax update exists in exactly one function, :func:`online_softmax_update`;
streaming attention, split-KV partials and the merge all call it. The masking rule exists in
exactly one function, :func:`visible`.

Semantics (README, "Semantics"): causal masking and windows are aligned bottom-right (query row
``i`` of ``seqlen_q`` sees key ``j`` iff ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k -
seqlen_q + right``; ``causal`` means ``right = 0``); a row with no visible key gives output 0 and
LSE -inf; LSE is the natural log of the softmax denominator of the scaled scores; GQA query head
``h`` reads KV head ``h // (nheads // nheads_k)``. Every function validates its inputs through
:mod:`cupyflash.core.checks` (the same checks the kernels use) before any work.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .core import checks

__all__ = [
    "visible", "attention_mask", "attention_reference", "online_softmax_update",
    "online_softmax_finalize", "online_softmax_attention", "split_boundaries",
    "split_kv_partials", "merge_states", "varlen_attention_reference", "KVCacheResult",
    "kvcache_attention_reference", "attention_backward", "streaming_attention_backward",
    "varlen_attention_backward",
]

_NEG_INF = -np.inf


# ----------------------------------------------------------------------------------------------
# Masks
# ----------------------------------------------------------------------------------------------
def visible(i, j, seqlen_q, seqlen_k, window_size=(-1, -1)):
    """Whether query row ``i`` sees key ``j`` (elementwise, broadcasting; the one masking rule).

    Parameters
    ----------
    i, j : int or int array
        Query row and key index within one sequence (broadcast together).
    seqlen_q, seqlen_k : int or int array
        That sequence's query and key lengths (broadcast with ``i``/``j``).
    window_size : tuple of 2 int
        Normalised ``(left, right)``, -1 = unbounded (causal is ``right = 0``).

    Returns
    -------
    bool or bool array
        ``j < seqlen_k`` and ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q +
        right`` (each bound dropped when its entry is -1): the bottom-right alignment of
        FlashAttention-2 (arXiv 2307.08691) causal / sliding-window masks.
    """
    left, right = window_size
    j = np.asarray(j)
    diag = np.asarray(i) + np.asarray(seqlen_k) - np.asarray(seqlen_q)
    ok = (j >= 0) & (j < seqlen_k)
    if left >= 0:
        ok = ok & (j >= diag - left)
    if right >= 0:
        ok = ok & (j <= diag + right)
    return ok


def attention_mask(seqlen_q, seqlen_k, *, causal=False, window_size=(-1, -1)) -> np.ndarray:
    """Boolean mask of visible keys, shape (seqlen_q, seqlen_k), True = visible.

    Parameters
    ----------
    seqlen_q, seqlen_k : int
    causal : bool
        Bottom-right causal (same as ``window_size[1] = 0``).
    window_size : tuple of 2 int
        ``(left, right)``, -1 = unbounded.

    Raises
    ------
    TypeError, ValueError
        Bad ``window_size`` (see :func:`cupyflash.core.checks.check_window_size`).
    """
    window = checks.check_window_size(window_size, checks._check_bool(causal, "causal"))
    vis = visible(np.arange(seqlen_q)[:, None], np.arange(seqlen_k)[None, :],
                  seqlen_q, seqlen_k, window)
    # (an unbounded window leaves the row index out of `visible`: broadcast to the full shape)
    return np.broadcast_to(vis, (seqlen_q, seqlen_k)).copy()


# ----------------------------------------------------------------------------------------------
# The online-softmax update (the only place it exists in NumPy)
# ----------------------------------------------------------------------------------------------
def online_softmax_update(m, l, acc, s, v, scale=1.0):
    """Fold one block of scores into the running softmax state.

    FlashAttention (arXiv 2205.14135) Sec. 3.1 with FlashAttention-2's (arXiv 2307.08691,
    Sec. 3.1) unscaled accumulator: with ``m_new = max(m, rowmax(s))``,

    ``l_new = exp((m - m_new) scale) * l + sum_j exp((s_j - m_new) scale)``,
    ``acc_new = exp((m - m_new) scale) * acc + sum_j exp((s_j - m_new) scale) v_j``.

    The same arithmetic as the kernels' ``SoftmaxRow`` (kernels_cu/common/online_softmax.cuh):
    the max is kept in raw-score units and the difference is taken before the scale, so the
    key with the row's max gets probability exactly 1 at any finite magnitude, and adding a
    constant to every score changes no probability. Rows with nothing visible yet keep
    ``m = -inf, l = 0, acc = 0`` (the exponentials use 0 as the reference point instead of
    -inf, so no ``-inf - -inf = NaN`` appears).

    Parameters
    ----------
    m, l : array, shape (..., rows)
        Running max (raw-score units, before ``scale``) and normaliser.
    acc : array, shape (..., rows, d)
        Unnormalised output accumulator.
    s : array, shape (..., rows, n)
        Raw scores of the block (``q . k``); -inf marks a masked key. ``n`` may be 0.
    v : array, shape (..., n, d) or (..., rows, n, d)
        Values shared by every row (attention), or one value per row and key (merging partial
        states, :func:`merge_states`). In the per-row form a key with probability 0 contributes
        exactly nothing even if its value is NaN.
    scale : float
        ``softmax_scale`` (1 for merging states: their scores are natural-log LSEs).

    Returns
    -------
    m_new, l_new, acc_new : arrays
        Same shapes as ``m``, ``l``, ``acc``; computed in the dtype of the inputs.
    """
    m_blk = s.max(axis=-1) if s.shape[-1] else np.full(s.shape[:-1], _NEG_INF, s.dtype)
    m_new = np.maximum(m, m_blk)                         # running max
    m_ref = np.where(m_new == _NEG_INF, 0, m_new).astype(m_new.dtype)  # exp reference point
    scale = np.asarray(scale, m_new.dtype)
    alpha = np.exp((m - m_ref) * scale)                  # rescale factor of the old state
    p = np.exp((s - m_ref[..., None]) * scale)           # block probabilities (unnormalised)
    if v.ndim == s.ndim + 1:                             # per-row values (merge)
        pv = np.where(p[..., None] > 0, p[..., None] * v, 0).astype(acc.dtype).sum(axis=-2)
    else:
        pv = (p @ v).astype(acc.dtype)  # (ml_dtypes' bfloat16 matmul returns float32)
    l_new = alpha * l + p.sum(axis=-1)                   # normaliser
    acc_new = alpha[..., None] * acc + pv                # rescaled accumulator
    return m_new, l_new, acc_new


def online_softmax_finalize(m, l, acc, scale=1.0):
    """Normalise a streaming state once at the end (FlashAttention-2 Sec. 3.1).

    Parameters
    ----------
    m, l : array, shape (..., rows)
    acc : array, shape (..., rows, d)
    scale : float
        The ``scale`` of :func:`online_softmax_update`.

    Returns
    -------
    out : array, shape (..., rows, d)
        ``acc / l``; 0 for a row with ``l == 0`` (nothing visible).
    lse : array, shape (..., rows)
        ``m * scale + log(l)``, natural log; -inf for a row with ``l == 0``.
    """
    empty = l == 0
    safe_l = np.where(empty, 1, l).astype(l.dtype)
    out = np.where(empty[..., None], 0, acc / safe_l[..., None]).astype(acc.dtype)
    lse = np.where(empty, _NEG_INF, m * np.asarray(scale, m.dtype) + np.log(safe_l)).astype(m.dtype)
    return out, lse


# ----------------------------------------------------------------------------------------------
# Shared plumbing
# ----------------------------------------------------------------------------------------------
def _heads_first(x, nheads):
    """(batch, seqlen, nheads_x, d) -> (batch, nheads, seqlen, d), repeating KV heads for GQA:
    query head h reads KV head h // (nheads // nheads_x)."""
    group = nheads // x.shape[2]
    if group > 1:
        x = np.repeat(x, group, axis=2)
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3))


def _compute_dtype(dtype, like):
    dt = np.dtype(like.dtype if dtype is None else dtype)
    if checks.dtype_name(np.empty(0, dt)) not in checks.SUPPORTED_DTYPES:
        raise TypeError(f"dtype: {dt} is not supported; supported: "
                        f"{', '.join(checks.SUPPORTED_DTYPES)}")
    return dt


def _exp_scores(qh, kh, vis, scale):
    """Float64 ``p = exp((s - m) * scale)`` of the raw scores ``s = q k^T`` (-inf where ``vis`` is
    False), the row max ``m`` of the raw scores (0 for a row with nothing visible, whose ``p`` is
    all 0) and ``l = rowsum(p)``: the unnormalised softmax, exact at any finite magnitude."""
    s = qh @ kh.swapaxes(-1, -2)
    s = np.where(vis, s, _NEG_INF)
    m = s.max(axis=-1) if s.shape[-1] else np.full(s.shape[:-1], _NEG_INF)
    m_ref = np.where(m == _NEG_INF, 0.0, m)
    p = np.exp((s - m_ref[..., None]) * scale)
    return p, m_ref, p.sum(axis=-1)


def _one_shot(qh, kh, vh, vis, scale):
    """Float64 softmax(scale * s) v with the whole raw score matrix s = q k^T; vis broadcasts to
    (b, h, sq, sk). The max is taken on the raw scores and subtracted before the scale (as the
    kernels do), so the result is exact at any finite magnitude of the scores."""
    p, m_ref, l = _exp_scores(qh, kh, vis, scale)
    empty = l == 0
    safe_l = np.where(empty, 1.0, l)
    out = np.where(empty[..., None], 0.0, (p @ vh) / safe_l[..., None])
    lse = np.where(empty, _NEG_INF, m_ref * scale + np.log(safe_l))
    return out, lse


def _stream(qh, kh, vh, vis, scale, block_size_k, dtype, key_start=0, key_stop=None):
    """Streaming state (m, l, acc) over keys [key_start, key_stop) in blocks of block_size_k."""
    b, h, sq, d = qh.shape
    key_stop = kh.shape[2] if key_stop is None else key_stop
    q_ = qh.astype(dtype)
    scale_ = dtype.type(scale)
    m = np.full((b, h, sq), _NEG_INF, dtype)
    l = np.zeros((b, h, sq), dtype)
    acc = np.zeros((b, h, sq, d), dtype)
    for start in range(key_start, key_stop, block_size_k):
        stop = min(start + block_size_k, key_stop)
        k_blk = kh[:, :, start:stop].astype(dtype)
        v_blk = vh[:, :, start:stop].astype(dtype)
        s = (q_ @ k_blk.swapaxes(-1, -2)).astype(dtype)              # S = Q K^T (raw)
        s = np.where(vis[..., start:stop], s, _NEG_INF).astype(dtype)  # mask
        m, l, acc = online_softmax_update(m, l, acc, s, v_blk, scale_)
    return m, l, acc


def _check_block_size(block_size, name="block_size_k"):
    if not checks._is_int(block_size):
        raise TypeError(f"{name}: expected an int >= 1, got {block_size!r}")
    if block_size < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {block_size}")
    return int(block_size)


# ----------------------------------------------------------------------------------------------
# Dense attention
# ----------------------------------------------------------------------------------------------
def attention_reference(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1)):
    """Exact attention, one-shot softmax in float64 (the oracle for every kernel).

    ``out = softmax(softmax_scale * q k^T + mask) v`` with the whole score matrix materialised
    (the standard attention of FlashAttention, arXiv 2205.14135, Sec. 2.2).

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, nheads, headdim)
    k, v : array, shape (batch, seqlen_k, nheads_k, headdim)
        float16, bfloat16 (ml_dtypes), float32 or float64 (NumPy, CuPy, or anything
        ``np.asarray`` takes); upcast to float64.
    softmax_scale : float or None
        Multiplies ``q k^T``; None = ``1/sqrt(headdim)``.
    causal : bool
        Bottom-right aligned causal mask.
    window_size : tuple of 2 int
        ``(left, right)`` sliding window, -1 = unbounded, bottom-right aligned.

    Returns
    -------
    out : float64 array, shape (batch, seqlen_q, nheads, headdim)
        0 for rows with no visible key.
    lse : float64 array, shape (batch, nheads, seqlen_q)
        Natural-log sum of exp of the scaled visible scores; -inf for rows with no visible key.

    Raises
    ------
    TypeError, ValueError
        From :func:`cupyflash.core.checks.check_attention`.
    """
    q, k, v = (checks.host_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    p = checks.check_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size)
    vis = attention_mask(p.seqlen_q, p.seqlen_k, window_size=p.window_size)
    f = np.float64
    out, lse = _one_shot(_heads_first(q.astype(f), p.nheads), _heads_first(k.astype(f), p.nheads),
                         _heads_first(v.astype(f), p.nheads), vis, p.softmax_scale)
    return out.transpose(0, 2, 1, 3), lse


def online_softmax_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                             block_size_k=64, dtype=None):
    """Streaming (online-softmax) attention over blocks of keys, as the kernels compute it.

    FlashAttention (arXiv 2205.14135) Sec. 3.1, Algorithm 1, with FlashAttention-2's
    (arXiv 2307.08691, Sec. 3.1) unscaled accumulator normalised once at the end. Vectorised over
    all query rows; keys are visited in blocks of ``block_size_k`` and each block is folded in by
    :func:`online_softmax_update`.

    Parameters
    ----------
    q, k, v, softmax_scale, causal, window_size
        As in :func:`attention_reference`.
    block_size_k : int
        Keys per block (>= 1); the result is independent of it up to rounding.
    dtype : numpy dtype or None
        Arithmetic precision (float16, bfloat16, float32, float64); None = the dtype of ``q``.

    Returns
    -------
    out : array of ``dtype``, shape (batch, seqlen_q, nheads, headdim)
    lse : array of ``dtype``, shape (batch, nheads, seqlen_q)
        As in :func:`attention_reference` (0 and -inf for empty rows).

    Raises
    ------
    TypeError, ValueError
        From :func:`cupyflash.core.checks.check_attention`; bad ``block_size_k`` or ``dtype``.

    Notes
    -----
    Error bound in float32: see :func:`cupyflash.testing.streaming_error_bound`.
    """
    q, k, v = (checks.host_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    p = checks.check_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size)
    block_size_k = _check_block_size(block_size_k)
    dt = _compute_dtype(dtype, q)
    vis = attention_mask(p.seqlen_q, p.seqlen_k, window_size=p.window_size)
    m, l, acc = _stream(_heads_first(q, p.nheads), _heads_first(k, p.nheads),
                        _heads_first(v, p.nheads), vis, p.softmax_scale, block_size_k, dt)
    out, lse = online_softmax_finalize(m, l, acc, dt.type(p.softmax_scale))
    return out.transpose(0, 2, 1, 3), lse


# ----------------------------------------------------------------------------------------------
# Split-KV (Flash-Decoding) and merging
# ----------------------------------------------------------------------------------------------
def split_boundaries(seqlen_k, num_splits, block_size_k=64):
    """Key ranges ``[(start, stop), ...]`` of each split, in whole blocks of ``block_size_k``.

    ``n_blocks = ceil(seqlen_k / block_size_k)`` blocks are dealt out ``ceil(n_blocks /
    num_splits)`` per split in order; trailing splits may be empty (``start == stop``) when
    ``num_splits`` exceeds the number of blocks. The merged result does not depend on the
    boundaries (up to rounding).

    Parameters
    ----------
    seqlen_k : int
        Keys to split (>= 0).
    num_splits : int
        Number of splits (>= 1).
    block_size_k : int
        Granularity (>= 1).

    Raises
    ------
    TypeError, ValueError
        ``num_splits`` or ``block_size_k`` not an int >= 1.
    """
    block_size_k = _check_block_size(block_size_k)
    if not checks._is_int(num_splits):
        raise TypeError(f"num_splits: expected an int >= 1, got {num_splits!r}")
    if num_splits < 1:
        raise ValueError(f"num_splits: expected an int >= 1, got {num_splits}")
    n_blocks = -(-seqlen_k // block_size_k)
    per_split = -(-n_blocks // num_splits) * block_size_k
    return [(min(s * per_split, seqlen_k), min((s + 1) * per_split, seqlen_k))
            for s in range(num_splits)]


def split_kv_partials(q, k, v, num_splits, *, softmax_scale=None, causal=False,
                      window_size=(-1, -1), block_size_k=64, dtype=np.float64):
    """Per-split partial attention states (Flash-Decoding's split step).

    Split ``s`` attends only to its key range (:func:`split_boundaries`), with the masks still
    evaluated at global key positions, and returns its own normalised output and LSE.
    ``merge_states(*split_kv_partials(...))`` equals the unsplit attention.

    Parameters
    ----------
    q, k, v, softmax_scale, causal, window_size
        As in :func:`attention_reference`.
    num_splits : int
        >= 1; splits with no keys (or no visible key) give ``(0, -inf)``.
    block_size_k : int
        Block size of the streaming loop and granularity of the split boundaries.
    dtype : numpy dtype
        Arithmetic precision (default float64).

    Returns
    -------
    o_parts : array, shape (num_splits, batch, seqlen_q, nheads, headdim)
    lse_parts : array, shape (num_splits, batch, nheads, seqlen_q)
        Natural log; -inf where the split saw no key.

    Raises
    ------
    TypeError, ValueError
        From :func:`cupyflash.core.checks.check_attention`; bad ``num_splits``/``block_size_k``.
    """
    q, k, v = (checks.host_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    p = checks.check_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size)
    bounds = split_boundaries(p.seqlen_k, num_splits, block_size_k)
    dt = _compute_dtype(dtype, q)
    vis = attention_mask(p.seqlen_q, p.seqlen_k, window_size=p.window_size)
    qh, kh, vh = (_heads_first(x, p.nheads) for x in (q, k, v))
    o_parts, lse_parts = [], []
    for start, stop in bounds:
        m, l, acc = _stream(qh, kh, vh, vis, p.softmax_scale, block_size_k, dt, start, stop)
        o, lse = online_softmax_finalize(m, l, acc, dt.type(p.softmax_scale))
        o_parts.append(o.transpose(0, 2, 1, 3))
        lse_parts.append(lse)
    return np.stack(o_parts), np.stack(lse_parts)


def merge_states(o_parts, lse_parts, *, dtype=np.float64):
    """Exact combination of partial attention states (Flash-Decoding's combine step).

    With ``lse_max = max_i lse_i`` and ``w_i = exp(lse_i - lse_max)``:
    ``lse = lse_max + log(sum_i w_i)`` and ``o = sum_i w_i o_i / sum_i w_i``. This is attention in
    which part ``i`` is one key with score ``lse_i`` and value ``o_i``, so it is computed by the
    same :func:`online_softmax_update` (FlashAttention arXiv 2205.14135 Sec. 3.1). Parts with
    ``lse = -inf`` contribute nothing (their ``o`` is ignored, even if NaN):
    ``merge(x, (0, -inf)) = x``; merging only empty parts gives ``(0, -inf)``.

    Parameters
    ----------
    o_parts : array, shape (num_parts, batch, seqlen, nheads, headdim)
    lse_parts : array, shape (num_parts, batch, nheads, seqlen)
        Natural-log LSE, float32 or float64.
    dtype : numpy dtype
        Arithmetic precision (default float64).

    Returns
    -------
    o : array, shape (batch, seqlen, nheads, headdim)
    lse : array, shape (batch, nheads, seqlen)

    Raises
    ------
    TypeError, ValueError
        From :func:`cupyflash.core.checks.check_merge`.
    """
    o_parts = checks.host_array(o_parts, "o_parts")
    lse_parts = checks.host_array(lse_parts, "lse_parts")
    num_parts, batch, seqlen, nheads, d = checks.check_merge(o_parts, lse_parts)
    dt = np.dtype(dtype)
    s = np.moveaxis(lse_parts.astype(dt), 0, -1)                    # (b, h, sq, parts)
    vals = np.moveaxis(o_parts.astype(dt), 0, -2).transpose(0, 2, 1, 3, 4)  # (b, h, sq, parts, d)
    m = np.full((batch, nheads, seqlen), _NEG_INF, dt)
    l = np.zeros((batch, nheads, seqlen), dt)
    acc = np.zeros((batch, nheads, seqlen, d), dt)
    m, l, acc = online_softmax_update(m, l, acc, s, vals)
    o, lse = online_softmax_finalize(m, l, acc)
    return o.transpose(0, 2, 1, 3), lse


# ----------------------------------------------------------------------------------------------
# Variable length
# ----------------------------------------------------------------------------------------------
def _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, window_size):
    """Validated host ``q, k, v``, the :class:`~cupyflash.core.checks.AttnProblem` and the
    block-diagonal (total_q, total_k) mask of a packed batch (see
    :func:`varlen_attention_reference`)."""
    q, k, v = (checks.host_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    cq_arr = checks.host_array(cu_seqlens_q, "cu_seqlens_q")
    ck_arr = checks.host_array(cu_seqlens_k, "cu_seqlens_k")
    if max_seqlen_q is None and cq_arr.ndim == 1 and cq_arr.size >= 1:
        max_seqlen_q = int(np.diff(cq_arr.astype(np.int64)).max(initial=0))
    if max_seqlen_k is None and ck_arr.ndim == 1 and ck_arr.size >= 1:
        max_seqlen_k = int(np.diff(ck_arr.astype(np.int64)).max(initial=0))
    p = checks.check_varlen(q, k, v, cq_arr, ck_arr, max_seqlen_q, max_seqlen_k,
                            softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                            validate=True)
    cq, ck = cq_arr.astype(np.int64), ck_arr.astype(np.int64)
    len_q, len_k = np.diff(cq), np.diff(ck)
    seg_q = np.repeat(np.arange(p.batch), len_q)           # sequence of each packed row
    seg_k = np.repeat(np.arange(p.batch), len_k)
    pos_q = np.arange(p.total_q) - cq[seg_q]               # position within its sequence
    pos_k = np.arange(p.total_k) - ck[seg_k]
    vis = (seg_q[:, None] == seg_k[None, :]) & visible(
        pos_q[:, None], pos_k[None, :], len_q[seg_q][:, None], len_k[seg_q][:, None],
        p.window_size)
    return q, k, v, p, vis


def varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                               max_seqlen_k=None, *, softmax_scale=None, causal=False,
                               window_size=(-1, -1)):
    """Exact float64 attention over a packed batch of variable-length sequences.

    All sequences are computed at once with a block-diagonal mask over the packed tokens: query
    row ``t`` of sequence ``b`` sees key ``u`` iff ``u`` belongs to sequence ``b`` and the
    bottom-right mask of that sequence's own lengths allows it.

    Parameters
    ----------
    q : array, shape (total_q, nheads, headdim)
    k, v : array, shape (total_k, nheads_k, headdim)
    cu_seqlens_q, cu_seqlens_k : integer array, shape (batch + 1,)
        Sequence starts (0, ..., total); any integer dtype (e.g. ``np.cumsum``'s int64) whose
        values fit int32.
    max_seqlen_q, max_seqlen_k : int or None
        Bounds on the lengths (None = the actual maxima).
    softmax_scale, causal, window_size
        As in :func:`attention_reference`, applied per sequence.

    Returns
    -------
    out : float64 array, shape (total_q, nheads, headdim)
    lse : float64 array, shape (nheads, total_q)
        -inf for rows with no visible key (e.g. a sequence with no keys).

    Raises
    ------
    TypeError, ValueError
        From :func:`cupyflash.core.checks.check_varlen` (``validate=True``).
    """
    q, k, v, p, vis = _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, softmax_scale, causal, window_size)
    f = np.float64
    out, lse = _one_shot(_heads_first(q[None].astype(f), p.nheads),
                         _heads_first(k[None].astype(f), p.nheads),
                         _heads_first(v[None].astype(f), p.nheads), vis, p.softmax_scale)
    return out[0].transpose(1, 0, 2), lse[0]


# ----------------------------------------------------------------------------------------------
# KV cache (decode)
# ----------------------------------------------------------------------------------------------
class KVCacheResult(NamedTuple):
    """Result of :func:`kvcache_attention_reference` (unpacks as a 4-tuple).

    out : float64 (batch, seqlen_q, nheads, headdim)
    lse : float64 (batch, nheads, seqlen_q)
    k_cache, v_cache : the caches after appending ``k``/``v`` (new arrays of the cache dtype), or
        the inputs (as NumPy arrays) when nothing was appended.
    """
    out: np.ndarray
    lse: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray


def kvcache_attention_reference(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                                block_table=None, softmax_scale=None, causal=True):
    """Exact float64 attention of new queries against a (contiguous or paged) KV cache.

    Sequence ``b`` attends to its first ``L_b = cache_seqlens[b] + seqlen_new`` keys: the
    ``cache_seqlens[b]`` cached tokens, then the new ``k[b]``/``v[b]`` (written at positions
    ``cache_seqlens[b] ... L_b - 1``). Causal masking is bottom-right against ``L_b``: query row
    ``i`` sees key ``j`` iff ``j <= i + L_b - seqlen_q``. Nothing at or beyond ``L_b`` (cache
    tail, tail of the last page, unused ``block_table`` entries) is read. Flash-Decoding computes
    the same function in splits (see :func:`split_kv_partials`).

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, nheads, headdim)
    k_cache, v_cache : array
        Contiguous (batch, seqlen_cache, nheads_k, headdim) or, with ``block_table``, paged
        (num_pages, page_size, nheads_k, headdim) with any ``page_size >= 1``.
    k, v : array or None, shape (batch, seqlen_new, nheads_k, headdim)
        New tokens to append before attending.
    cache_seqlens : integer array (batch,), int, list of ints, or None
        Valid cached tokens per sequence (any integer dtype, values within int32); None = the
        whole contiguous cache.
    block_table : integer array (batch, max_pages_per_seq) or None
        Page ids; token ``t`` of sequence ``b`` lives at
        ``k_cache[block_table[b, t // page_size], t % page_size]``.
    softmax_scale : float or None
        None = ``1/sqrt(headdim)``.
    causal : bool
        Bottom-right causal mask (default True).

    Returns
    -------
    KVCacheResult
        ``(out, lse, k_cache, v_cache)``: float64 output and natural-log LSE (0 and -inf for a
        sequence with no key), and the updated caches. The inputs are never modified: the
        updated caches are copies when ``k``/``v`` are given.

    Raises
    ------
    TypeError, ValueError
        From :func:`cupyflash.core.checks.check_kvcache` (``validate=True``).
    """
    q, k_cache, v_cache = (checks.host_array(x, n) for x, n in ((q, "q"), (k_cache, "k_cache"),
                                                                 (v_cache, "v_cache")))
    k = None if k is None else checks.host_array(k, "k")
    v = None if v is None else checks.host_array(v, "v")
    cache_seqlens = checks.lengths_from_host(cache_seqlens, q)  # an int or a list of ints
    cs_in = None if cache_seqlens is None else checks.host_array(cache_seqlens, "cache_seqlens")
    bt_in = None if block_table is None else checks.host_array(block_table, "block_table")
    p = checks.check_kvcache(q, k_cache, v_cache, k, v, cs_in, bt_in, softmax_scale=softmax_scale,
                             causal=causal, validate=True)
    cs = (np.full(p.batch, p.seqlen_cache, np.int64) if cs_in is None
          else cs_in.astype(np.int64))
    if k is not None:
        k_cache, v_cache = k_cache.copy(), v_cache.copy()
    f = np.float64
    out = np.zeros((p.batch, p.seqlen_q, p.nheads, p.headdim))
    lse = np.full((p.batch, p.nheads, p.seqlen_q), _NEG_INF)
    window = (-1, 0) if p.causal else (-1, -1)
    for b in range(p.batch):
        pos = np.arange(cs[b] + p.seqlen_new)              # token positions of sequence b
        if p.paged:
            page = bt_in[b, pos // p.page_size].astype(np.int64)
            slot = (page, pos % p.page_size)
        else:
            slot = (np.full(pos.shape, b), pos)
        if k is not None:                                  # append: write new tokens in place
            new = slice(int(cs[b]), None)
            k_cache[slot[0][new], slot[1][new]] = k[b]
            v_cache[slot[0][new], slot[1][new]] = v[b]
        kb = k_cache[slot].astype(f)[None]                 # (1, L_b, nheads_k, d): gathered keys
        vb = v_cache[slot].astype(f)[None]
        vis = visible(np.arange(p.seqlen_q)[:, None], pos[None, :], p.seqlen_q, pos.size, window)
        o, s = _one_shot(_heads_first(q[b:b + 1].astype(f), p.nheads), _heads_first(kb, p.nheads),
                         _heads_first(vb, p.nheads), vis, p.softmax_scale)
        out[b] = o[0].transpose(1, 0, 2)
        lse[b] = s[0]
    return KVCacheResult(out, lse, k_cache, v_cache)


# ----------------------------------------------------------------------------------------------
# Backward: gradients of attention
# ----------------------------------------------------------------------------------------------
def _check_dout(dout, q_shape, dt):
    shape = checks._shape(dout, "dout")
    if shape != q_shape:
        raise ValueError(f"dout: expected shape {q_shape} (same as q), got {shape}")
    checks._check_same_dtype(dout, "dout", dt, "q")


def _check_lse(lse, want, layout):
    shape = checks._shape(lse, "lse")
    if shape != want:
        raise ValueError(f"lse: expected shape {want} ({layout}), got {shape}")
    checks._check_dtype(lse, "lse", ("float32", "float64"))


def _sum_groups(xh, nheads_k):
    """(batch, nheads, seqlen, d) per query head -> (batch, seqlen, nheads_k, d): the gradient of
    KV head g is the sum over the query heads that read it (``h // (nheads // nheads_k) == g``,
    consecutive heads, as :func:`_heads_first` repeats them)."""
    b, h, s, d = xh.shape
    return xh.reshape(b, nheads_k, h // nheads_k, s, d).sum(axis=2).transpose(0, 2, 1, 3)


def _backward_one_shot(doh, qh, kh, vh, vis, scale):
    """Float64 gradients per query head (heads first, KV heads repeated), with the whole
    probability matrix P = softmax(scale * q k^T) over the visible keys (from
    :func:`_exp_scores`, so exact at any finite magnitude). Rows with nothing visible have P = 0
    and so contribute nothing."""
    p, _, l = _exp_scores(qh, kh, vis, scale)
    prob = p / np.where(l == 0, 1.0, l)[..., None]        # P (0 on empty rows)
    dv = prob.swapaxes(-1, -2) @ doh                      # dV = P^T dO
    dp = doh @ vh.swapaxes(-1, -2)                        # dP = dO V^T
    delta = (prob * dp).sum(axis=-1, keepdims=True)       # D = rowsum(P * dP) = rowsum(dO * O)
    ds = prob * (dp - delta)                              # dS = P * (dP - D)
    dq = scale * (ds @ kh)                                # dQ = scale dS K
    dk = scale * (ds.swapaxes(-1, -2) @ qh)               # dK = scale dS^T Q
    return dq, dk, dv


def _stream_backward(doh, qh, kh, vh, oh, lse, vis, scale, block_size_m, block_size_k, dt):
    """FlashAttention-2's backward over blocks in ``dt`` (heads first, KV heads repeated): the
    gradients per query head. ``vis`` is the full (seqlen_q, seqlen_k) mask."""
    sq, sk = qh.shape[2], kh.shape[2]
    scale_ = dt.type(scale)
    delta = (doh * oh).sum(axis=-1).astype(dt)            # pre-pass: D_i = rowsum(dO_i * O_i)
    has_lse = np.isfinite(lse)                            # -inf: the row sees nothing
    lse = np.where(has_lse, lse, 0).astype(dt)
    dq = np.zeros_like(qh)
    dk = np.zeros_like(kh)
    dv = np.zeros_like(vh)
    for j0 in range(0, sk, block_size_k):                 # key blocks (one CTA each, on a GPU)
        j1 = min(j0 + block_size_k, sk)
        k_j, v_j = kh[:, :, j0:j1], vh[:, :, j0:j1]
        dk_j = np.zeros_like(k_j)
        dv_j = np.zeros_like(v_j)
        for i0 in range(0, sq, block_size_m):             # query blocks
            i1 = min(i0 + block_size_m, sq)
            vis_ij = vis[i0:i1, j0:j1]
            if not vis_ij.any():                          # fully masked block pair: skipped
                continue
            q_i, do_i = qh[:, :, i0:i1], doh[:, :, i0:i1]
            ok = vis_ij & has_lse[:, :, i0:i1, None]
            s = (q_i @ k_j.swapaxes(-1, -2)).astype(dt)                    # S = Q_i K_j^T
            arg = np.where(ok, scale_ * s - lse[:, :, i0:i1, None], _NEG_INF).astype(dt)
            p = np.exp(arg)                                                # P = exp(scale S - L)
            dv_j += (p.swapaxes(-1, -2) @ do_i).astype(dt)                 # dV_j += P^T dO_i
            dp = (do_i @ v_j.swapaxes(-1, -2)).astype(dt)                  # dP = dO_i V_j^T
            ds = (p * (dp - delta[:, :, i0:i1, None])).astype(dt)          # dS = P (dP - D_i)
            dk_j += (scale_ * (ds.swapaxes(-1, -2) @ q_i)).astype(dt)      # dK_j += s dS^T Q_i
            dq[:, :, i0:i1] += (scale_ * (ds @ k_j)).astype(dt)            # dQ_i += s dS K_j
        dk[:, :, j0:j1] = dk_j
        dv[:, :, j0:j1] = dv_j
    return dq, dk, dv


def attention_backward(dout, q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1)):
    """Exact gradients of attention, one-shot in float64 (the oracle for backward kernels).

    With ``P = softmax(softmax_scale * q k^T + mask)`` materialised and ``out = P v``, the
    gradients of a loss with ``dL/dout = dout`` are (FlashAttention-2, arXiv 2307.08691,
    Sec. 3.2 / Algorithm 2; the softmax Jacobian of FlashAttention, arXiv 2205.14135, App. B.2):
    ``dV = P^T dO``, ``dP = dO V^T``, ``D = rowsum(P * dP)`` (= ``rowsum(dO * out)``),
    ``dS = P * (dP - D)``, ``dQ = softmax_scale dS K``, ``dK = softmax_scale dS^T Q``.

    Parameters
    ----------
    dout : array, shape (batch, seqlen_q, nheads, headdim)
        Gradient of the loss with respect to the output; same dtype as ``q``.
    q, k, v, softmax_scale, causal, window_size
        As in :func:`attention_reference` (upcast to float64).

    Returns
    -------
    dq : float64 array, shape (batch, seqlen_q, nheads, headdim)
        0 on rows with no visible key (their output is the constant 0).
    dk, dv : float64 arrays, shape (batch, seqlen_k, nheads_k, headdim)
        For GQA/MQA the sum over the query heads of each group (query head ``h`` reads KV head
        ``h // (nheads // nheads_k)``).

    Raises
    ------
    TypeError, ValueError
        From :func:`cupyflash.core.checks.check_attention`; ``dout`` not an array, of another
        shape or dtype than ``q`` (the message starts with the argument's name).
    """
    dout, q, k, v = (checks.host_array(x, n)
                     for x, n in ((dout, "dout"), (q, "q"), (k, "k"), (v, "v")))
    p = checks.check_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size)
    _check_dout(dout, q.shape, p.dtype)
    vis = attention_mask(p.seqlen_q, p.seqlen_k, window_size=p.window_size)
    f = np.float64
    dq, dk, dv = _backward_one_shot(*(_heads_first(x.astype(f), p.nheads) for x in (dout, q, k, v)),
                                    vis, p.softmax_scale)
    return dq.transpose(0, 2, 1, 3), _sum_groups(dk, p.nheads_k), _sum_groups(dv, p.nheads_k)


def streaming_attention_backward(dout, q, k, v, out, lse, *, softmax_scale=None, causal=False,
                                 window_size=(-1, -1), block_size_m=64, block_size_k=64,
                                 dtype=None):
    """Gradients of attention by FlashAttention-2's backward algorithm, as the kernels compute it.

    FlashAttention-2 (arXiv 2307.08691) Sec. 3.2 / Algorithm 2, vectorised over batch, heads and
    the rows of a block: a pre-pass ``D = rowsum(dout * out)`` per query row; then for each block
    ``j`` of ``block_size_k`` keys (accumulators ``dK_j``, ``dV_j``) and each block ``i`` of
    ``block_size_m`` queries: ``P_ij = exp(softmax_scale * Q_i K_j^T - lse_i)`` where visible,
    else 0 (and 0 on a row with ``lse = -inf``), ``dV_j += P_ij^T dO_i``, ``dP = dO_i V_j^T``,
    ``dS = P_ij * (dP - D_i)``, ``dK_j += softmax_scale dS^T Q_i``, ``dQ_i += softmax_scale dS
    K_j``. Block pairs with no visible entry (:func:`attention_mask`) are skipped. P is never
    stored whole: it is recomputed from the forward's LSE.

    Parameters
    ----------
    dout : array, shape (batch, seqlen_q, nheads, headdim)
        Gradient of the loss with respect to ``out``; same dtype as ``q``.
    q, k, v, softmax_scale, causal, window_size
        As in :func:`attention_reference`.
    out : array, shape (batch, seqlen_q, nheads, headdim)
        The forward's output (same dtype as ``q``), e.g. from :func:`attention_reference`.
    lse : array, shape (batch, nheads, seqlen_q)
        The forward's natural-log LSE, float32 or float64; -inf on rows with no visible key.
    block_size_m, block_size_k : int
        Query rows and keys per block (>= 1); the result is independent of them up to rounding.
    dtype : numpy dtype or None
        Arithmetic precision (float16, bfloat16, float32, float64); None = float64. float32
        emulates the kernels' float32 accumulation (the inputs are rounded to it first).

    Returns
    -------
    dq : array of ``dtype``, shape (batch, seqlen_q, nheads, headdim)
    dk, dv : arrays of ``dtype``, shape (batch, seqlen_k, nheads_k, headdim)
        As in :func:`attention_backward` (GQA: summed over each group of query heads).

    Raises
    ------
    TypeError, ValueError
        From :func:`cupyflash.core.checks.check_attention` (which also checks ``out``: shape and
        dtype of ``q``); ``dout`` not of ``q``'s shape and dtype; ``lse`` not of shape (batch,
        nheads, seqlen_q) or not float32/float64; bad ``block_size_m``, ``block_size_k`` or
        ``dtype``. Each message starts with the argument's name.

    Notes
    -----
    Unlike the forward (exact at any finite score magnitude), recomputing P from the LSE is
    not: ``softmax_scale * s - lse`` is a difference of two numbers of the size ``M`` of the
    largest scaled score, and ``lse`` itself is rounded to ``eps * M``, so every P of a row
    carries a relative error of a few ``eps * M`` (float64: about 1e-12 at ``M = 1e4``, 1e-10
    at ``M = 1e6``; a float32 LSE: about 1e-3 at ``M = 1e4``).
    """
    dout, q, k, v, out, lse = (checks.host_array(x, n) for x, n in (
        (dout, "dout"), (q, "q"), (k, "k"), (v, "v"), (out, "out"), (lse, "lse")))
    p = checks.check_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size, out=out)
    _check_dout(dout, q.shape, p.dtype)
    _check_lse(lse, (p.batch, p.nheads, p.seqlen_q), "batch, nheads, seqlen_q")
    block_size_m = _check_block_size(block_size_m, "block_size_m")
    block_size_k = _check_block_size(block_size_k, "block_size_k")
    dt = _compute_dtype(np.float64 if dtype is None else dtype, q)
    vis = attention_mask(p.seqlen_q, p.seqlen_k, window_size=p.window_size)
    doh, qh, kh, vh, oh = (_heads_first(x, p.nheads).astype(dt) for x in (dout, q, k, v, out))
    dq, dk, dv = _stream_backward(doh, qh, kh, vh, oh, lse.astype(dt), vis, p.softmax_scale,
                                  block_size_m, block_size_k, dt)
    return dq.transpose(0, 2, 1, 3), _sum_groups(dk, p.nheads_k), _sum_groups(dv, p.nheads_k)


def varlen_attention_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale=None,
                              causal=False, window_size=(-1, -1)):
    """Exact float64 gradients of attention over a packed batch of variable-length sequences.

    :func:`attention_backward` of each sequence on its own, computed at once with the
    block-diagonal mask of :func:`varlen_attention_reference` (FlashAttention-2, arXiv
    2307.08691, Sec. 3.2 / Algorithm 2, per sequence).

    Parameters
    ----------
    dout : array, shape (total_q, nheads, headdim)
        Gradient of the loss with respect to the output; same dtype as ``q``.
    q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size
        As in :func:`varlen_attention_reference`.

    Returns
    -------
    dq : float64 array, shape (total_q, nheads, headdim)
        0 on rows with no visible key (e.g. a sequence with no keys).
    dk, dv : float64 arrays, shape (total_k, nheads_k, headdim)
        GQA/MQA: summed over each group of query heads; 0 for keys no query sees.

    Raises
    ------
    TypeError, ValueError
        From :func:`cupyflash.core.checks.check_varlen` (``validate=True``); ``dout`` not of
        ``q``'s shape and dtype (the message starts with the argument's name).
    """
    dout = checks.host_array(dout, "dout")
    q, k, v, p, vis = _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, None, None,
                                      softmax_scale, causal, window_size)
    _check_dout(dout, q.shape, p.dtype)
    f = np.float64
    dq, dk, dv = _backward_one_shot(*(_heads_first(x[None].astype(f), p.nheads)
                                      for x in (dout, q, k, v)), vis, p.softmax_scale)
    return dq[0].transpose(1, 0, 2), _sum_groups(dk, p.nheads_k)[0], _sum_groups(dv, p.nheads_k)[0]
