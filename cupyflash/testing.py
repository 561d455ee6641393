"""Hypothesis strategies and error measures for testing attention kernels against the reference.

Public so that anyone can fuzz their own kernel against :mod:`cupyflash.reference`::

    from hypothesis import given
    from cupyflash import reference, testing

    @given(testing.attention_cases(dtypes=("float32",)))
    def test_mine(case):
        out = my_kernel(case.q, case.k, case.v, **case.kwargs())
        ref, _ = reference.attention_reference(case.q, case.k, case.v, **case.kwargs())
        assert testing.rel_error(out, ref) <= 1e-5

Strategies draw compile-time-like parameters (dtype, head dim) from small sets and runtime ones
(batch, lengths including 0, 1 and block-size neighbours, heads, GQA ratios, windows, page tables
in shuffled order) freely. Array contents come from a ``numpy.random.Generator`` seeded by a drawn
integer: fresh standard-normal data every example, never zeros. Cache tails, unused pages and
unused ``block_table`` entries are filled with NaN by default (``poison=True``): nothing beyond a
sequence's length may influence a result.

Every strategy checks its arguments when it is built (not when Hypothesis first draws from it):
a wrong type raises ``TypeError``, a value out of range (a negative size, a minimum above its
maximum, a dtype or head dim the kernels do not have) ``ValueError``, each message starting with
the argument's name and saying what was expected.

Requires ``hypothesis`` (``pip install hypothesis``, or the ``test`` extra): importing this
module without it raises an ImportError that says so.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np

from .core import deps
from .core.checks import HEADDIM_MULTIPLE, MAX_HEADDIM
from .core.interop import np_dtype  # the one name -> NumPy dtype map ('bfloat16': ml_dtypes'), re-exported

st = deps.hypothesis_strategies("cupyflash.testing")

__all__ = [
    "backward_magnitudes", "backward_error",
    "DTYPES", "BLOCK_SIZES", "np_dtype", "rel_error", "streaming_error_bound",
    "dtypes", "headdims", "head_counts", "seqlens", "window_sizes", "softmax_scales",
    "segment_lengths", "cu_seqlens_from_lengths", "random_normal",
    "AttentionCase", "attention_cases", "VarlenCase", "varlen_cases",
    "KVCacheCase", "kvcache_cases", "paged_to_contiguous", "contiguous_to_paged",
    "MAX_SCORE_MAGNITUDE", "MagnitudeCase", "magnitude_cases", "magnitude_tolerance",
]

DTYPES = ("float16", "bfloat16", "float32", "float64")
#: Tile sizes used by the kernels; lengths near their multiples are drawn often.
BLOCK_SIZES = (16, 32, 64, 128)


# ----------------------------------------------------------------------------------------------
# Error measures
# ----------------------------------------------------------------------------------------------
def _host64(x) -> np.ndarray:
    from .core.checks import to_host
    return to_host(x).astype(np.float64)


def rel_error(out, ref) -> float:
    """Normwise relative error ``||out - ref||_2 / ||ref||_2`` (all elements, float64).

    Equal infinities (e.g. LSE = -inf of empty rows in both) count as exact; any NaN in ``out``,
    or an infinity in only one of them, gives ``inf``. If ``||ref|| == 0`` the result is 0 when
    ``out`` is also all zero, else ``inf``.

    Parameters
    ----------
    out, ref : array (NumPy, CuPy, anything ``np.asarray`` takes), same shape

    Returns
    -------
    float

    Raises
    ------
    ValueError
        Shapes differ, or ``ref`` holds NaN.
    """
    a, b = _host64(out), _host64(ref)
    if a.shape != b.shape:
        raise ValueError(f"out: shape {a.shape} must match ref shape {b.shape}")
    if np.isnan(b).any():
        raise ValueError("ref: holds NaN; a reference must be NaN-free")
    if np.isnan(a).any():
        return math.inf
    same = a == b                                        # covers equal infinities
    with np.errstate(invalid="ignore", over="ignore"):   # inf - inf where both are equal
        delta = np.where(same, 0.0, a - b)
    if not np.isfinite(delta).all():
        return math.inf
    diff = np.linalg.norm(delta)
    norm = np.linalg.norm(np.where(np.isfinite(b), b, 0.0))
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return float(diff / norm)


def streaming_error_bound(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                          block_size_k=64, dtype=np.float32, c_exp=8.0):
    """First-order error bound of the streaming algorithm (``online_softmax_attention``).

    Bounds ``rel_error(out_hat, out)`` where ``out_hat`` is the streaming result computed in
    ``dtype`` (float32 or float64) on inputs exactly representable in ``dtype`` and ``out`` the
    exact attention. With unit roundoff ``u = eps / 2``, for query row ``i``:

    * ``A_i = max_j softmax_scale * sum_c |q_ic| |k_jc|`` over visible keys (bounds ``|s_ij|``);
    * ``n_blk`` blocks of at most ``nb = block_size_k`` keys;
    * scores: ``|s_hat - s| <= (d + 2) u A_i`` (dot product of length d, then the rounded scale),
      which perturbs each normalised weight by a relative ``2 (d + 2) u A_i``;
    * each unnormalised weight ``p_j = exp(s_j - m) * prod(alpha)`` carries a relative error of at
      most ``E_i = u (4 A_i + c_exp + (c_exp + 1) n_blk)``: the subtraction ``s - m`` (``|s - m|
      <= 2 A_i``), ``exp`` (``c_exp`` u, i.e. ``c_exp / 2`` ulp), and per later block one rescale
      ``alpha = exp(m_old - m_new)`` (its subtraction telescopes to ``<= 2 A_i u`` in total) and
      one multiply; perturbing weights relatively by ``E`` moves the output by ``2 E W``;
    * the sums of ``l`` and of ``acc = sum p v`` (positive / absolute terms, any order): ``(nb +
      n_blk) u`` each, relative to ``W``; the final division: ``u``;

    where ``W_ic = sum_j P_ij |v_jc|``. Hence componentwise

    ``|out_hat - out|_ic <= u K_i W_ic``, ``K_i = (2d + 12) A_i + 2 c_exp + 2 (c_exp + 1) n_blk
    + 2 nb + 2 n_blk + 1``,

    and with a factor 2 for the neglected higher-order terms (``2 u = eps``)::

        rel_error <= eps * sqrt(sum_i K_i^2 ||W_i||^2) / ||out||.

    For the LSE (absolute, per row): ``|lse_hat - lse| <= eps * [(d + 6) A_i + 2 c_exp +
    (c_exp + 1) n_blk + nb + n_blk + |lse_i|]``.

    Parameters
    ----------
    q, k, v, softmax_scale, causal, window_size, block_size_k
        As in :func:`~cupyflash.reference.online_softmax_attention`.
    dtype : numpy dtype
        Precision of the streaming computation (float32 or float64; for float64 the same bound
        also covers the float64 reference's own error when doubled).
    c_exp : float
        Accuracy of ``np.exp`` in units of ``u`` (default 8 = 4 ulp; NumPy's float32 SIMD
        ``exp`` is documented within a few ulp).

    Returns
    -------
    out_bound : float
        Bound on ``rel_error(out_hat, out)``.
    lse_bound : float64 array, shape (batch, nheads, seqlen_q)
        Bound on ``|lse_hat - lse|`` per row (0 for rows with no visible key).

    References
    ----------
    FlashAttention arXiv 2205.14135 Sec. 3.1 (online softmax); Higham, *Accuracy and Stability of
    Numerical Algorithms*, Sec. 3.1 (the ``gamma_n`` bounds used for the sums).
    """
    from . import reference
    from .core import checks
    q, k, v = (checks.to_host(x) for x in (q, k, v))
    p = checks.check_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size)
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"dtype: the bound is derived for float32/float64, got {dt}")
    eps = float(np.finfo(dt).eps)
    f = np.float64
    qh = reference._heads_first(q.astype(f), p.nheads)
    kh = reference._heads_first(k.astype(f), p.nheads)
    vh = reference._heads_first(v.astype(f), p.nheads)
    vis = reference.attention_mask(p.seqlen_q, p.seqlen_k, window_size=p.window_size)
    out, lse = reference._one_shot(qh, kh, vh, vis, p.softmax_scale)
    a = p.softmax_scale * (np.abs(qh) @ np.abs(kh).swapaxes(-1, -2))
    a_i = np.where(vis, a, 0.0).max(axis=-1, initial=0.0)             # (b, h, sq)
    probs = np.exp(np.where(vis, (qh @ kh.swapaxes(-1, -2)) * p.softmax_scale, -np.inf)
                   - np.where(np.isfinite(lse), lse, 0.0)[..., None])
    w = probs @ np.abs(vh)                                             # (b, h, sq, d)
    nb = min(block_size_k, max(p.seqlen_k, 1))
    n_blk = -(-p.seqlen_k // block_size_k)
    d = p.headdim
    k_i = (2 * d + 12) * a_i + 2 * c_exp + 2 * (c_exp + 1) * n_blk + 2 * nb + 2 * n_blk + 1
    num = math.sqrt(float(((k_i ** 2) * (w ** 2).sum(axis=-1)).sum()))
    den = float(np.linalg.norm(out))
    out_bound = 0.0 if num == 0.0 else (math.inf if den == 0.0 else eps * num / den)
    lse_fin = np.where(np.isfinite(lse), np.abs(lse), 0.0)
    lse_bound = eps * ((d + 6) * a_i + 2 * c_exp + (c_exp + 1) * n_blk + nb + n_blk + lse_fin)
    lse_bound = np.where(np.isfinite(lse), lse_bound, 0.0)
    return out_bound, lse_bound


# ----------------------------------------------------------------------------------------------
# Argument checks of the strategies (run when a strategy is built)
# ----------------------------------------------------------------------------------------------
def backward_magnitudes(dout, q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1)):
    """Norms of the componentwise magnitudes of the gradients of attention (NumPy, float64):
    ``|P|^T |dO|`` (dv), ``scale |dS|~ |K|`` and ``scale |dS|~^T |Q|`` (dq, dk) with
    ``|dS|~ = P (|dP| + |D|)``, KV terms summed over each GQA group. Each bounds its gradient
    elementwise and does not vanish where the gradient cancels to 0 (e.g. a row that sees one
    key: dS = 0 exactly), so it is the scale that rounding errors are measured against."""
    from . import reference
    f = np.float64
    group = q.shape[2] // k.shape[2]
    scale = 1 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    qh, doh = (np.asarray(x, dtype=f).transpose(0, 2, 1, 3) for x in (q, dout))
    kh, vh = (np.repeat(np.asarray(x, dtype=f), group, axis=2).transpose(0, 2, 1, 3) for x in (k, v))
    mask = reference.attention_mask(q.shape[1], k.shape[1], causal=causal, window_size=window_size)
    s = np.where(mask, scale * qh @ kh.swapaxes(-1, -2), -np.inf)
    row_max = np.where(mask.any(-1), s.max(-1, initial=-np.inf), 0.0)[..., None]
    e = np.exp(s - row_max)
    p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    dp = doh @ vh.swapaxes(-1, -2)
    ds_abs = p * (np.abs(dp) + np.abs((p * dp).sum(-1, keepdims=True)))

    def kv_sum(x):  # (b, h, s, d) -> summed over each group
        return x.reshape(x.shape[0], k.shape[2], group, *x.shape[2:]).sum(2)
    return (np.linalg.norm(scale * ds_abs @ np.abs(kh)),
            np.linalg.norm(kv_sum(scale * ds_abs.swapaxes(-1, -2) @ np.abs(qh))),
            np.linalg.norm(kv_sum(p.swapaxes(-1, -2) @ np.abs(doh))))


def backward_error(got, dout, q, k, v, **kwargs) -> tuple:
    """Errors of computed gradients ``got = (dq, dk, dv)`` against the float64 one-shot backward
    (:func:`cupyflash.reference.attention_backward` on the same inputs), each as
    ``||got - ref||_2 / m`` with ``m`` its :func:`backward_magnitudes` (so a gradient that cancels
    to 0 is still measured against the size of its terms), and the largest finite ``|LSE|``
    of the rows (recomputing ``P = exp(s - LSE)`` from a stored LSE costs a relative error of
    about ``eps(LSE dtype) * |LSE|`` per probability, whatever the kernel).

    Returns
    -------
    (errors, max_abs_lse) : ((float, float, float), float)
        ``inf`` for a gradient with a NaN or infinity.
    """
    from . import reference
    ref = reference.attention_backward(dout, q, k, v, **kwargs)
    mags = backward_magnitudes(dout, q, k, v, **kwargs)
    errs = []
    for g, r, m in zip(got, ref, mags):
        g = np.asarray(g, dtype=np.float64)
        if not np.isfinite(g).all():
            errs.append(math.inf)
            continue
        e = float(np.linalg.norm(g - r))
        errs.append(0.0 if e == 0 else (e / m if m > 0 else math.inf))
    _, lse = reference.attention_reference(q, k, v, **kwargs)
    fin = np.isfinite(lse)
    return tuple(errs), float(np.abs(lse[fin]).max()) if fin.any() else 0.0


def _int(x, name: str, lo: int | None = None, hi: int | None = None) -> int:
    """``x`` as an int in ``[lo, hi]`` (None: unbounded); bools are not ints here."""
    want = ("an int" + (f" >= {lo}" if hi is None and lo is not None else "")
            + (f" in [{lo}, {hi}]" if hi is not None and lo is not None else ""))
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name}: expected {want}, got {type(x).__name__} {x!r}")
    x = int(x)
    if (lo is not None and x < lo) or (hi is not None and x > hi):
        raise ValueError(f"{name}: expected {want}, got {x}")
    return x


def _at_most(lo_name: str, lo: int, hi_name: str, hi: int) -> None:
    if lo > hi:
        raise ValueError(f"{lo_name}: {lo} is larger than {hi_name} ({hi})")


def _bool(x, name: str, none_ok: bool = False):
    if x is None and none_ok:
        return None
    if not isinstance(x, (bool, np.bool_)):
        want = "True, False or None (drawn)" if none_ok else "a bool"
        raise TypeError(f"{name}: expected {want}, got {type(x).__name__} {x!r}")
    return bool(x)


def _dtype_names(names, name: str = "dtypes") -> tuple:
    """A non-empty tuple of names from :data:`DTYPES` (NumPy dtypes and types are named)."""
    if isinstance(names, (str, bytes)):
        raise TypeError(f"{name}: expected a tuple of dtype names, got the string {names!r} "
                        f"(write ({names!r},))")
    try:
        names = tuple(names)
    except TypeError:
        raise TypeError(f"{name}: expected a tuple of dtype names from {DTYPES}, got "
                        f"{type(names).__name__} {names!r}") from None
    if not names:
        raise ValueError(f"{name}: expected at least one dtype name from {DTYPES}, got ()")
    out = []
    for n in names:
        key = n
        if not isinstance(n, str):
            try:
                key = np.dtype(n).name
            except TypeError:
                key = repr(n)
        if key not in DTYPES:
            raise ValueError(f"{name}: {n!r} is not supported; the kernels and the reference "
                             f"take {', '.join(DTYPES)}")
        out.append(key)
    return tuple(out)


def _headdim_limit(x, name: str) -> int:
    """A largest head dim: an int in [8, 256] (the checks' multiples of 8 up to 256)."""
    return _int(x, name, HEADDIM_MULTIPLE, MAX_HEADDIM)


def _int_tuple(values, name: str, lo: int, allow_empty: bool = True) -> tuple:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name}: expected a tuple of ints >= {lo}, got "
                        f"{type(values).__name__} {values!r}")
    out = tuple(_int(v, f"{name}[{i}]", lo) for i, v in enumerate(values))
    if not out and not allow_empty:
        raise ValueError(f"{name}: expected at least one int >= {lo}, got ()")
    return out


# ----------------------------------------------------------------------------------------------
# Basic strategies
# ----------------------------------------------------------------------------------------------
def dtypes(names=DTYPES):
    """Strategy: a dtype name.

    Parameters
    ----------
    names : tuple of str
        Candidates from float16, bfloat16, float32, float64 (the default: all four). NumPy
        dtypes are accepted and drawn as their names.

    Returns
    -------
    SearchStrategy[str]

    Raises
    ------
    TypeError
        ``names`` is a string or not iterable.
    ValueError
        ``names`` is empty or names a dtype outside :data:`DTYPES` (e.g. ``'int8'``).
    """
    return st.sampled_from(_dtype_names(names, "names"))


def headdims(max_value=256, min_value=8):
    """Strategy: head dims, the multiples of 8 in ``[min_value, max_value]``.

    Parameters
    ----------
    max_value, min_value : int
        Range; ``max_value`` at most 256 (the checks accept multiples of 8 from 8 to 256), and
        the range must hold a multiple of 8 from 8 up.

    Returns
    -------
    SearchStrategy[int]

    Raises
    ------
    TypeError
        A bound that is not an int.
    ValueError
        A negative ``min_value``, ``max_value`` above 256, ``min_value > max_value``, or no
        multiple of 8 (from 8) in the range.
    """
    max_value = _int(max_value, "max_value", 0, MAX_HEADDIM)
    min_value = _int(min_value, "min_value", 0)
    _at_most("min_value", min_value, "max_value", max_value)
    values = tuple(range(max(HEADDIM_MULTIPLE, -(-min_value // HEADDIM_MULTIPLE)
                             * HEADDIM_MULTIPLE), max_value + 1, HEADDIM_MULTIPLE))
    if not values:
        raise ValueError(f"max_value: no head dim (a multiple of {HEADDIM_MULTIPLE} from "
                         f"{HEADDIM_MULTIPLE}) in [{min_value}, {max_value}]")
    return st.sampled_from(values)


def head_counts(max_nheads_k=4, max_group=4):
    """Strategy: head counts for MHA, GQA and MQA.

    Parameters
    ----------
    max_nheads_k : int
        Largest number of KV heads (>= 1).
    max_group : int
        Largest ratio ``nheads // nheads_k`` (>= 1).

    Returns
    -------
    SearchStrategy[tuple[int, int]]
        ``(nheads, nheads_k)`` with ``nheads = group * nheads_k``.

    Raises
    ------
    TypeError, ValueError
        A limit that is not an int >= 1.
    """
    max_nheads_k = _int(max_nheads_k, "max_nheads_k", 1)
    max_group = _int(max_group, "max_group", 1)
    return st.tuples(st.integers(1, max_nheads_k), st.integers(1, max_group)).map(
        lambda t: (t[0] * t[1], t[0]))


def seqlens(max_value=64, min_value=0, block_sizes=BLOCK_SIZES):
    """Strategy: sequence lengths (tokens), biased to the edges of tiles.

    Parameters
    ----------
    max_value, min_value : int
        Range of lengths, ``0 <= min_value <= max_value``.
    block_sizes : tuple of int
        Tile sizes ``b >= 1``; ``0, 1, b - 1, b, b + 1`` are drawn often, other lengths
        uniformly (empty: uniformly only).

    Returns
    -------
    SearchStrategy[int]

    Raises
    ------
    TypeError
        A bound or block size that is not an int; ``block_sizes`` not a tuple.
    ValueError
        A negative bound, ``min_value > max_value``, a block size below 1.
    """
    max_value = _int(max_value, "max_value", 0)
    min_value = _int(min_value, "min_value", 0)
    _at_most("min_value", min_value, "max_value", max_value)
    block_sizes = _int_tuple(block_sizes, "block_sizes", 1)
    special = sorted({x for b in block_sizes for x in (0, 1, b - 1, b, b + 1)
                      if min_value <= x <= max_value})
    uniform = st.integers(min_value, max_value)
    return st.one_of(st.sampled_from(special), uniform) if special else uniform


def window_sizes(max_value=64):
    """Strategy: sliding windows ``(left, right)`` in keys, -1 = unbounded.

    Parameters
    ----------
    max_value : int
        Largest finite entry (>= 0).

    Returns
    -------
    SearchStrategy[tuple[int, int]]
        ``(-1, -1)`` often; otherwise each entry in ``[-1, max_value]``.

    Raises
    ------
    TypeError, ValueError
        ``max_value`` not an int >= 0.
    """
    max_value = _int(max_value, "max_value", 0)
    entry = st.one_of(st.just(-1), st.integers(0, max_value))
    return st.one_of(st.just((-1, -1)), st.tuples(entry, entry))


def softmax_scales():
    """Strategy: ``softmax_scale`` values.

    Returns
    -------
    SearchStrategy[float or None]
        ``None`` (= ``1/sqrt(headdim)``) or a finite scale in ``[0.01, 2]``.
    """
    return st.one_of(st.none(), st.floats(0.01, 2.0))


def segment_lengths(max_batch=4, max_len=40, min_batch=1):
    """Strategy: per-sequence lengths of a variable-length batch.

    Parameters
    ----------
    max_batch, min_batch : int
        Range of the number of sequences, ``0 <= min_batch <= max_batch``.
    max_len : int
        Longest sequence (>= 0; lengths of 0 are drawn too).

    Returns
    -------
    SearchStrategy[list[int]]

    Raises
    ------
    TypeError, ValueError
        A limit that is not an int >= 0, or ``min_batch > max_batch``.
    """
    max_batch = _int(max_batch, "max_batch", 0)
    min_batch = _int(min_batch, "min_batch", 0)
    _at_most("min_batch", min_batch, "max_batch", max_batch)
    return st.lists(seqlens(_int(max_len, "max_len", 0)), min_size=min_batch,
                    max_size=max_batch)


def cu_seqlens_from_lengths(lengths) -> np.ndarray:
    """Cumulative sequence starts of a packed batch.

    Parameters
    ----------
    lengths : sequence of int

    Returns
    -------
    numpy.ndarray
        int32, shape (len(lengths) + 1,): ``[0, l0, l0 + l1, ...]``.
    """
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)


def random_normal(rng: np.random.Generator, shape, dtype="float64", scale=1.0) -> np.ndarray:
    """Fresh standard-normal data (never zeros).

    Parameters
    ----------
    rng : numpy.random.Generator
    shape : tuple of int
    dtype : str or dtype
        Cast target (see :func:`np_dtype`).
    scale : float
        Standard deviation.

    Returns
    -------
    numpy.ndarray
    """
    return (rng.standard_normal(shape) * scale).astype(np_dtype(dtype))


def _seeds():
    return st.integers(0, 2**32 - 1)


# ----------------------------------------------------------------------------------------------
# Composite cases
# ----------------------------------------------------------------------------------------------
class _MaskedCall:
    """The keyword arguments shared by dense and varlen cases."""
    softmax_scale: float | None
    causal: bool
    window_size: tuple

    def kwargs(self) -> dict:
        """``softmax_scale``, ``causal``, ``window_size`` as keyword arguments."""
        return dict(softmax_scale=self.softmax_scale, causal=self.causal,
                    window_size=self.window_size)


@dataclass
class AttentionCase(_MaskedCall):
    """A dense attention problem: ``q`` (batch, seqlen_q, nheads, d), ``k``/``v`` (batch,
    seqlen_k, nheads_k, d) NumPy arrays of one dtype, plus the call's keyword arguments."""
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    softmax_scale: float | None
    causal: bool
    window_size: tuple
    seed: int


def attention_cases(*, dtypes=("float64",), max_batch=2, max_seqlen_q=48, max_seqlen_k=48,
                    max_headdim=64, max_nheads_k=3, max_group=3, causal=None, windows=True,
                    min_seqlen=0, scale=1.0):
    """Strategy: :class:`AttentionCase` with random shapes, GQA ratio, masks and data.

    Parameters
    ----------
    dtypes : tuple of str
        Dtypes to draw from (:data:`DTYPES`).
    max_batch, max_nheads_k, max_group : int
        Size limits, each >= 1.
    max_seqlen_q, max_seqlen_k : int
        Longest query / key length, each >= ``min_seqlen`` (lengths include 0, 1 and
        block-size neighbours).
    max_headdim : int
        Largest head dim, 8 to 256 (multiples of 8 up to it are drawn).
    causal : bool or None
        Fixed, or drawn when None.
    windows : bool
        Draw sliding windows too (else ``(-1, -1)``).
    min_seqlen : int
        Smallest length drawn (>= 0).
    scale : float
        Standard deviation of the data (finite, > 0).

    Returns
    -------
    SearchStrategy[AttentionCase]

    Raises
    ------
    TypeError
        An argument of the wrong type (``dtypes`` a string, a size that is not an int, a
        non-bool ``causal`` / ``windows``, a non-real ``scale``).
    ValueError
        A dtype outside :data:`DTYPES`, a size out of range, ``min_seqlen`` above a maximum.
    """
    dtypes = _dtype_names(dtypes)
    min_seqlen = _int(min_seqlen, "min_seqlen", 0)
    max_seqlen_q = _int(max_seqlen_q, "max_seqlen_q", 0)
    max_seqlen_k = _int(max_seqlen_k, "max_seqlen_k", 0)
    _at_most("min_seqlen", min_seqlen, "max_seqlen_q", max_seqlen_q)
    _at_most("min_seqlen", min_seqlen, "max_seqlen_k", max_seqlen_k)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a finite float > 0, got {type(scale).__name__} "
                        f"{scale!r}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected a finite float > 0, got {scale!r}")
    return _attention_cases(dtypes=dtypes, max_batch=_int(max_batch, "max_batch", 1),
                            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                            max_headdim=_headdim_limit(max_headdim, "max_headdim"),
                            max_nheads_k=_int(max_nheads_k, "max_nheads_k", 1),
                            max_group=_int(max_group, "max_group", 1),
                            causal=_bool(causal, "causal", none_ok=True),
                            windows=_bool(windows, "windows"), min_seqlen=min_seqlen,
                            scale=float(scale))


@st.composite
def _attention_cases(draw, *, dtypes, max_batch, max_seqlen_q, max_seqlen_k, max_headdim,
                     max_nheads_k, max_group, causal, windows, min_seqlen, scale):
    """:func:`attention_cases` with checked arguments."""
    dt = draw(st.sampled_from(tuple(dtypes)))
    batch = draw(st.integers(1, max_batch))
    sq = draw(seqlens(max_seqlen_q, min_seqlen))
    sk = draw(seqlens(max_seqlen_k, min_seqlen))
    nheads, nheads_k = draw(head_counts(max_nheads_k, max_group))
    d = draw(headdims(max_headdim))
    is_causal = draw(st.booleans()) if causal is None else causal
    window = draw(window_sizes(max(sq, sk, 1))) if windows else (-1, -1)
    sm_scale = draw(softmax_scales())
    seed = draw(_seeds())
    rng = np.random.default_rng(seed)
    return AttentionCase(q=random_normal(rng, (batch, sq, nheads, d), dt, scale),
                         k=random_normal(rng, (batch, sk, nheads_k, d), dt, scale),
                         v=random_normal(rng, (batch, sk, nheads_k, d), dt, scale),
                         softmax_scale=sm_scale, causal=is_causal, window_size=window, seed=seed)


@dataclass
class VarlenCase(_MaskedCall):
    """A packed variable-length problem: ``q`` (total_q, nheads, d), ``k``/``v`` (total_k,
    nheads_k, d), int32 ``cu_seqlens_q``/``cu_seqlens_k`` (batch + 1,), the per-sequence lengths,
    ``max_seqlen_q``/``max_seqlen_k`` and the call's keyword arguments."""
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    cu_seqlens_q: np.ndarray
    cu_seqlens_k: np.ndarray
    max_seqlen_q: int
    max_seqlen_k: int
    lengths_q: list
    lengths_k: list
    softmax_scale: float | None
    causal: bool
    window_size: tuple
    seed: int


def varlen_cases(*, dtypes=("float64",), max_batch=4, max_len=40, max_headdim=64,
                 max_nheads_k=2, max_group=3, causal=None, windows=True):
    """Strategy: :class:`VarlenCase` (packed batches for ``flash_attn_varlen_func``).

    Parameters
    ----------
    dtypes : tuple of str
        Dtypes to draw from (:data:`DTYPES`).
    max_batch, max_len : int
        Sequences per batch (>= 1) and longest sequence (>= 0); lengths include 0 and 1 (empty
        sequences, sequences with queries but no keys and vice versa).
    max_headdim : int
        Largest head dim, 8 to 256.
    max_nheads_k, max_group : int
        Each >= 1.
    causal : bool or None
        Fixed, or drawn when None.
    windows : bool
        Draw sliding windows too.

    Returns
    -------
    SearchStrategy[VarlenCase]
        ``max_seqlen_*`` may exceed the longest sequence by up to 3.

    Raises
    ------
    TypeError, ValueError
        As :func:`attention_cases`, naming the argument.
    """
    return _varlen_cases(dtypes=_dtype_names(dtypes), max_batch=_int(max_batch, "max_batch", 1),
                         max_len=_int(max_len, "max_len", 0),
                         max_headdim=_headdim_limit(max_headdim, "max_headdim"),
                         max_nheads_k=_int(max_nheads_k, "max_nheads_k", 1),
                         max_group=_int(max_group, "max_group", 1),
                         causal=_bool(causal, "causal", none_ok=True),
                         windows=_bool(windows, "windows"))


@st.composite
def _varlen_cases(draw, *, dtypes, max_batch, max_len, max_headdim, max_nheads_k, max_group,
                  causal, windows):
    """:func:`varlen_cases` with checked arguments."""
    dt = draw(st.sampled_from(tuple(dtypes)))
    batch = draw(st.integers(1, max_batch))
    lq = draw(st.lists(seqlens(max_len), min_size=batch, max_size=batch))
    lk = draw(st.lists(seqlens(max_len), min_size=batch, max_size=batch))
    nheads, nheads_k = draw(head_counts(max_nheads_k, max_group))
    d = draw(headdims(max_headdim))
    is_causal = draw(st.booleans()) if causal is None else causal
    window = draw(window_sizes(max_len)) if windows else (-1, -1)
    extra_q = draw(st.integers(0, 3))                   # max_seqlen may exceed the longest
    extra_k = draw(st.integers(0, 3))
    sm_scale = draw(softmax_scales())
    seed = draw(_seeds())
    rng = np.random.default_rng(seed)
    tq, tk = sum(lq), sum(lk)
    return VarlenCase(q=random_normal(rng, (tq, nheads, d), dt),
                      k=random_normal(rng, (tk, nheads_k, d), dt),
                      v=random_normal(rng, (tk, nheads_k, d), dt),
                      cu_seqlens_q=cu_seqlens_from_lengths(lq),
                      cu_seqlens_k=cu_seqlens_from_lengths(lk),
                      max_seqlen_q=max(lq) + extra_q, max_seqlen_k=max(lk) + extra_k,
                      lengths_q=lq, lengths_k=lk, softmax_scale=sm_scale, causal=is_causal,
                      window_size=window, seed=seed)


def paged_to_contiguous(cache, block_table) -> np.ndarray:
    """Gather a paged KV cache into the contiguous layout.

    Parameters
    ----------
    cache : array, shape (num_pages, page_size, nheads_k, headdim)
    block_table : int array, shape (batch, max_pages_per_seq)
        Every entry must be a valid page id.

    Returns
    -------
    numpy.ndarray, shape (batch, max_pages_per_seq * page_size, nheads_k, headdim)
    """
    from .core.checks import to_host
    cache, bt = to_host(cache), to_host(block_table).astype(np.int64)
    g = cache[bt]                                       # (batch, max_pages, page_size, hk, d)
    return g.reshape(bt.shape[0], -1, *cache.shape[2:])


def contiguous_to_paged(cache, page_size, rng: np.random.Generator, extra_pages=0,
                        fill=np.nan):
    """Scatter a contiguous cache (batch, seqlen_cache, nheads_k, d) into a pool of pages in
    shuffled order.

    Parameters
    ----------
    cache : numpy.ndarray, shape (batch, seqlen_cache, nheads_k, headdim)
    page_size : int
        Tokens per page; must divide ``seqlen_cache``.
    rng : numpy.random.Generator
        Draws the page order (the pool is shuffled, as in a real page allocator).
    extra_pages : int
        Unused pages added to the pool.
    fill : scalar
        Value of the unused pages (NaN by default: nothing may read them).

    The pool has ``batch * seqlen_cache / page_size + extra_pages`` pages.

    Raises
    ------
    TypeError, ValueError
        ``page_size`` not an int >= 1, ``extra_pages`` not an int >= 0, or ``page_size`` not
        dividing ``seqlen_cache``.

    Returns
    -------
    pool : array (num_pages, page_size, nheads_k, d)
    block_table : int32 array (batch, seqlen_cache / page_size)
    """
    page_size = _int(page_size, "page_size", 1)
    extra_pages = _int(extra_pages, "extra_pages", 0)
    batch, cap = cache.shape[:2]
    if cap % page_size:
        raise ValueError(f"page_size: {page_size} must divide seqlen_cache {cap}")
    max_pages = cap // page_size
    num_pages = batch * max_pages + extra_pages
    perm = rng.permutation(num_pages)
    bt = perm[:batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    pool = np.full((num_pages, page_size, *cache.shape[2:]), fill, cache.dtype)
    pool[bt.reshape(-1)] = cache.reshape(batch * max_pages, page_size, *cache.shape[2:])
    return pool, bt


@dataclass
class KVCacheCase:
    """A decode problem against a KV cache.

    ``q`` (batch, seqlen_q, nheads, d); ``k_cache``/``v_cache`` contiguous (batch, seqlen_cache,
    nheads_k, d) or paged (num_pages, page_size, nheads_k, d) with ``block_table`` (batch,
    max_pages_per_seq) int32 in shuffled order; optional new ``k``/``v`` (batch, seqlen_new,
    nheads_k, d); ``cache_seqlens`` int32 (batch,). ``k_cache_contiguous``/``v_cache_contiguous``
    hold the same logical cache in the contiguous layout (equal to ``k_cache``/``v_cache`` when
    not paged). With poisoning, every cache position at or beyond ``cache_seqlens[b]``, every
    unused page and the page that unused ``block_table`` entries point to hold NaN.
    """
    q: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    k: np.ndarray | None
    v: np.ndarray | None
    cache_seqlens: np.ndarray
    block_table: np.ndarray | None
    softmax_scale: float | None
    causal: bool
    page_size: int
    seed: int
    k_cache_contiguous: np.ndarray = field(repr=False, default=None)
    v_cache_contiguous: np.ndarray = field(repr=False, default=None)

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def seqlen_new(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    def args(self) -> tuple:
        """``(q, k_cache, v_cache, k, v, cache_seqlens, block_table)``."""
        return (self.q, self.k_cache, self.v_cache, self.k, self.v, self.cache_seqlens,
                self.block_table)

    def kwargs(self) -> dict:
        """``softmax_scale``, ``causal`` as keyword arguments."""
        return dict(softmax_scale=self.softmax_scale, causal=self.causal)


_PAGE_SIZES = (1, 2, 3, 5, 8, 16, 64, 256)


def kvcache_cases(*, dtypes=("float64",), paged=None, append=None, max_batch=3,
                  max_seqlen_q=16, max_seqlen_new=4, max_pages_per_seq=6, page_sizes=_PAGE_SIZES,
                  max_seqlen_cache=96, max_headdim=64, max_nheads_k=2, max_group=4, causal=None,
                  poison=True):
    """Strategy: :class:`KVCacheCase`, contiguous or paged, with ragged ``cache_seqlens``
    (including 0, 1 and full), optional appended tokens, GQA, and (paged) any page size with
    pages in shuffled order.

    Parameters
    ----------
    dtypes : tuple of str
        Dtypes to draw from (:data:`DTYPES`; the GPU decode path takes float16 and bfloat16).
    paged, append, causal : bool or None
        Fixed, or drawn when None.
    max_batch, max_seqlen_q, max_pages_per_seq, max_seqlen_cache : int
        Size limits, each >= 1 (the capacity is at most ``max_seqlen_cache`` tokens per
        sequence, unless the appended tokens need more pages).
    max_seqlen_new : int
        Most tokens appended (>= 0).
    page_sizes : tuple of int
        Page sizes to draw from, each >= 1; with ``paged`` not False, at least one at most
        ``max_seqlen_cache``.
    max_headdim : int
        Largest head dim, 8 to 256.
    max_nheads_k, max_group : int
        Each >= 1.
    poison : bool
        Fill everything beyond each sequence's length with NaN.

    Returns
    -------
    SearchStrategy[KVCacheCase]

    Raises
    ------
    TypeError, ValueError
        As :func:`attention_cases`, naming the argument; ``page_sizes`` with no size that fits
        ``max_seqlen_cache``.
    """
    paged = _bool(paged, "paged", none_ok=True)
    max_seqlen_cache = _int(max_seqlen_cache, "max_seqlen_cache", 1)
    page_sizes = _int_tuple(page_sizes, "page_sizes", 1, allow_empty=False)
    if paged is not False and not any(p <= max_seqlen_cache for p in page_sizes):
        raise ValueError(f"page_sizes: no page size of {page_sizes} fits max_seqlen_cache "
                         f"({max_seqlen_cache}); give a smaller one, or paged=False")
    return _kvcache_cases(dtypes=_dtype_names(dtypes), paged=paged,
                          append=_bool(append, "append", none_ok=True),
                          max_batch=_int(max_batch, "max_batch", 1),
                          max_seqlen_q=_int(max_seqlen_q, "max_seqlen_q", 1),
                          max_seqlen_new=_int(max_seqlen_new, "max_seqlen_new", 0),
                          max_pages_per_seq=_int(max_pages_per_seq, "max_pages_per_seq", 1),
                          page_sizes=page_sizes, max_seqlen_cache=max_seqlen_cache,
                          max_headdim=_headdim_limit(max_headdim, "max_headdim"),
                          max_nheads_k=_int(max_nheads_k, "max_nheads_k", 1),
                          max_group=_int(max_group, "max_group", 1),
                          causal=_bool(causal, "causal", none_ok=True),
                          poison=_bool(poison, "poison"))


@st.composite
def _kvcache_cases(draw, *, dtypes, paged, append, max_batch, max_seqlen_q, max_seqlen_new,
                   max_pages_per_seq, page_sizes, max_seqlen_cache, max_headdim, max_nheads_k,
                   max_group, causal, poison):
    """:func:`kvcache_cases` with checked arguments."""
    dt = draw(st.sampled_from(tuple(dtypes)))
    is_paged = draw(st.booleans()) if paged is None else paged
    do_append = draw(st.booleans()) if append is None else append
    is_causal = draw(st.booleans()) if causal is None else causal
    batch = draw(st.integers(1, max_batch))
    sq = draw(st.integers(1, max_seqlen_q))
    snew = draw(st.integers(0, max_seqlen_new)) if do_append else 0
    nheads, nheads_k = draw(head_counts(max_nheads_k, max_group))
    d = draw(headdims(max_headdim))
    if is_paged:
        ps = draw(st.sampled_from([p for p in page_sizes if p <= max_seqlen_cache]))
        lo = max(1, -(-snew // ps))                      # room for the appended tokens
        max_pages = draw(st.integers(lo, max(lo, min(max_pages_per_seq, max_seqlen_cache // ps))))
        cap = max_pages * ps
    else:
        ps = 0
        cap = draw(st.integers(max(snew, 1), max(snew, 1, max_seqlen_cache)))
    room = cap - snew                                    # largest valid cache_seqlens
    cs = draw(st.lists(st.one_of(st.sampled_from(sorted({0, min(1, room), room})),
                                 st.integers(0, room)), min_size=batch, max_size=batch))
    cs = np.array(cs, np.int32)
    sm_scale = draw(softmax_scales())
    seed = draw(_seeds())
    rng = np.random.default_rng(seed)
    npdt = np_dtype(dt)
    kc = random_normal(rng, (batch, cap, nheads_k, d), dt)
    vc = random_normal(rng, (batch, cap, nheads_k, d), dt)
    if poison:
        tail = np.arange(cap)[None, :] >= cs[:, None]
        kc[tail] = np.nan
        vc[tail] = np.nan
    q = random_normal(rng, (batch, sq, nheads, d), dt)
    k = random_normal(rng, (batch, snew, nheads_k, d), dt) if do_append else None
    v = random_normal(rng, (batch, snew, nheads_k, d), dt) if do_append else None
    bt = None
    k_cache, v_cache = kc, vc
    if is_paged:
        fill = np.nan if poison else 0.0
        extra = 1 + draw(st.integers(0, 2))              # spare pages (the first is the poison)
        perm_seed = int(rng.integers(2**32))
        k_cache, bt = contiguous_to_paged(kc, ps, np.random.default_rng(perm_seed), extra, fill)
        v_cache, _ = contiguous_to_paged(vc, ps, np.random.default_rng(perm_seed), extra, fill)
        if poison:                                       # unused entries -> a NaN page
            used = -(-(cs.astype(np.int64) + snew) // ps)
            spare = np.setdiff1d(np.arange(k_cache.shape[0]), bt.reshape(-1))[0]
            bt = np.where(np.arange(bt.shape[1])[None, :] < used[:, None], bt, spare)
            bt = bt.astype(np.int32)
    k_cache = np.ascontiguousarray(k_cache, dtype=npdt)
    v_cache = np.ascontiguousarray(v_cache, dtype=npdt)
    return KVCacheCase(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=cs,
                       block_table=bt, softmax_scale=sm_scale, causal=is_causal, page_size=ps,
                       seed=seed, k_cache_contiguous=kc, v_cache_contiguous=vc)


# ----------------------------------------------------------------------------------------------
# Scores of any finite magnitude (docs/semantics.md, 6)
# ----------------------------------------------------------------------------------------------
#: Largest ``|softmax_scale * q . k|`` that :func:`magnitude_cases` draws. Every kernel
#: accumulates scores in float32 or float64, but the LSE is float32 for every dtype (docs/semantics.md,
#: 3), and it holds the scaled max score: 1e30 keeps it far inside float32 (3.4e38).
MAX_SCORE_MAGNITUDE = 1e30
#: The shift channel: every key holds this value in its last head-dim channel, so a query whose
#: last channel is ``a`` has every score of its row raised by ``SHIFT_KEY * a``.
SHIFT_KEY = 16


@dataclass
class MagnitudeCase:
    """Attention whose scaled scores reach a drawn magnitude, with exactly computable scores.

    ``q``, ``k`` hold small integers (``[-3, 3]``; exact in every dtype, and so is every partial
    sum of ``q . k`` in a float32 accumulator), so the kernels and the float64 reference see the
    same raw scores. ``k``'s last channel is :data:`SHIFT_KEY` for every key and ``q``'s is 0;
    ``q_shifted`` differs from ``q`` only there, by an integer ``a`` per (batch, query, head), so
    row ``(b, h, i)`` of ``q_shifted`` has the scores of ``q`` plus ``shift[b, h, i] = SHIFT_KEY *
    a`` (raw units): the same softmax, and an LSE larger by ``softmax_scale * shift``.
    ``softmax_scale`` is set so that the largest ``|softmax_scale * score|`` is ``magnitude``,
    drawn log-uniformly up to :data:`MAX_SCORE_MAGNITUDE`. ``v`` is standard normal.
    """
    q: np.ndarray
    q_shifted: np.ndarray
    k: np.ndarray
    v: np.ndarray
    shift: np.ndarray
    softmax_scale: float
    causal: bool
    magnitude: float
    seed: int

    def kwargs(self) -> dict:
        """``softmax_scale``, ``causal`` as keyword arguments."""
        return dict(softmax_scale=self.softmax_scale, causal=self.causal)


def magnitude_cases(*, dtypes=("float64",), max_batch=2, max_seqlen_q=40, max_seqlen_k=80,
                    headdims_from=(8, 64, 128), max_nheads_k=2, max_group=2, causal=None,
                    max_magnitude=MAX_SCORE_MAGNITUDE):
    """Strategy: :class:`MagnitudeCase`, scores from about 0.01 to ``max_magnitude`` (log-uniform).

    Parameters
    ----------
    dtypes : tuple of str
        Dtypes to draw from (:data:`DTYPES`).
    max_batch, max_seqlen_q, max_seqlen_k : int
        Size limits, each >= 1 (lengths from 1, biased to tile edges).
    headdims_from : tuple of int
        Head dims to draw from: multiples of 8 from 8 to 256.
    max_nheads_k, max_group : int
        Each >= 1.
    causal : bool or None
        Fixed, or drawn when None.
    max_magnitude : float
        Largest ``|softmax_scale * q . k|``, from 0.01 to :data:`MAX_SCORE_MAGNITUDE`.

    Returns
    -------
    SearchStrategy[MagnitudeCase]

    Raises
    ------
    TypeError, ValueError
        As :func:`attention_cases`, naming the argument; a head dim that is not a multiple of 8
        in [8, 256]; ``max_magnitude`` outside [0.01, :data:`MAX_SCORE_MAGNITUDE`].
    """
    heads = _int_tuple(headdims_from, "headdims_from", HEADDIM_MULTIPLE, allow_empty=False)
    for i, d in enumerate(heads):
        if d % HEADDIM_MULTIPLE or d > MAX_HEADDIM:
            raise ValueError(f"headdims_from[{i}]: expected a multiple of {HEADDIM_MULTIPLE} "
                             f"from {HEADDIM_MULTIPLE} to {MAX_HEADDIM}, got {d}")
    if (isinstance(max_magnitude, (bool, np.bool_))
            or not isinstance(max_magnitude, numbers.Real)):
        raise TypeError(f"max_magnitude: expected a float, got {type(max_magnitude).__name__} "
                        f"{max_magnitude!r}")
    if not 0.01 <= max_magnitude <= MAX_SCORE_MAGNITUDE:  # (NaN fails too)
        raise ValueError(f"max_magnitude: expected a float in [0.01, {MAX_SCORE_MAGNITUDE:g}] "
                         f"(the float32 LSE holds the scaled max score), got {max_magnitude!r}")
    return _magnitude_cases(dtypes=_dtype_names(dtypes), max_batch=_int(max_batch, "max_batch", 1),
                            max_seqlen_q=_int(max_seqlen_q, "max_seqlen_q", 1),
                            max_seqlen_k=_int(max_seqlen_k, "max_seqlen_k", 1),
                            headdims_from=heads,
                            max_nheads_k=_int(max_nheads_k, "max_nheads_k", 1),
                            max_group=_int(max_group, "max_group", 1),
                            causal=_bool(causal, "causal", none_ok=True),
                            max_magnitude=float(max_magnitude))


@st.composite
def _magnitude_cases(draw, *, dtypes, max_batch, max_seqlen_q, max_seqlen_k, headdims_from,
                     max_nheads_k, max_group, causal, max_magnitude):
    """:func:`magnitude_cases` with checked arguments."""
    dt = draw(st.sampled_from(tuple(dtypes)))
    batch = draw(st.integers(1, max_batch))
    sq = draw(seqlens(max_seqlen_q, 1))
    sk = draw(seqlens(max_seqlen_k, 1))
    nheads, nheads_k = draw(head_counts(max_nheads_k, max_group))
    d = draw(st.sampled_from(tuple(headdims_from)))
    is_causal = draw(st.booleans()) if causal is None else causal
    magnitude = 10.0 ** draw(st.floats(-2.0, math.log10(max_magnitude)))
    seed = draw(_seeds())
    rng = np.random.default_rng(seed)
    npdt = np_dtype(dt)
    q = rng.integers(-3, 4, (batch, sq, nheads, d)).astype(np.float64)
    k = rng.integers(-3, 4, (batch, sk, nheads_k, d)).astype(np.float64)
    q[..., -1] = 0.0
    k[..., -1] = SHIFT_KEY
    a = rng.integers(-64, 65, (batch, sq, nheads)).astype(np.float64)
    q_shifted = q.copy()
    q_shifted[..., -1] = a
    group = nheads // nheads_k
    kh = np.repeat(k, group, axis=2)
    raw = np.einsum("bqhd,bkhd->bhqk", q_shifted, kh)
    raw0 = np.einsum("bqhd,bkhd->bhqk", q, kh)
    smax = max(float(np.abs(raw).max()), float(np.abs(raw0).max()), 1.0)
    scale = magnitude / smax
    return MagnitudeCase(q=q.astype(npdt), q_shifted=q_shifted.astype(npdt), k=k.astype(npdt),
                         v=random_normal(rng, (batch, sk, nheads_k, d), dt),
                         shift=(SHIFT_KEY * a).transpose(0, 2, 1), softmax_scale=scale,
                         causal=is_causal, magnitude=magnitude, seed=seed)


def magnitude_tolerance(q, k, v, dtype, *, softmax_scale, causal=False, accumulate="float32"):
    """Componentwise error bounds for a :class:`MagnitudeCase` (exact scores).

    With exact raw scores the only roundings are the probabilities' (``exp2((s - m) c)``: the
    difference, the product and the exponential, a few units of the accumulator's roundoff each),
    P rounded to ``dtype`` for the second product (tensor-core kernels), the sums over at most
    ``n`` keys and the output rounded to ``dtype``. So ``|out - ref| <= (4 eps_dtype + (32 + n)
    eps_acc) W`` with ``W = softmax(s) |v|`` (the reference applied to ``|v|``), and for the LSE
    ``|lse - ref| <= 8 eps32 (1 + |ref|) + (32 + n) eps_acc`` (the LSE is float32).

    Parameters
    ----------
    q, k, v : host arrays of the case
    dtype : str
        Input dtype (its epsilon bounds the roundings of P and of the output).
    softmax_scale, causal
        As in the call.
    accumulate : str
        ``"float32"`` or ``"float64"``: the kernel's accumulator.

    Returns
    -------
    out_tol : float64 array, shape of ``q``
    lse_tol : float64 array, shape (batch, nheads, seqlen_q)

    Raises
    ------
    ValueError
        ``dtype`` not in :data:`DTYPES`, ``accumulate`` not float32 or float64.
    """
    from . import reference
    eps = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23,
           "float64": 2.0 ** -52}
    if dtype not in eps:
        raise ValueError(f"dtype: expected one of {', '.join(eps)}, got {dtype!r}")
    if accumulate not in ("float32", "float64"):
        raise ValueError(f"accumulate: expected 'float32' or 'float64', got {accumulate!r}")
    eps_acc = eps[accumulate]
    n = k.shape[1]
    f = np.float64
    w, lse_ref = reference.attention_reference(q.astype(f), k.astype(f), np.abs(v.astype(f)),
                                               softmax_scale=softmax_scale, causal=causal)
    out_tol = (4 * eps[dtype] + (32 + n) * eps_acc) * w
    lse_tol = 8 * eps["float32"] * (1 + np.abs(np.where(np.isfinite(lse_ref), lse_ref, 0)))
    return out_tol, lse_tol + (32 + n) * eps_acc

