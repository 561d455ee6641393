"""Public entry points: FlashAttention's function names and (batch, seqlen, nheads, headdim) layout.

``flash_attn_func`` / ``flash_attn_varlen_func`` compute exact softmax attention with the tiled
forward pass of FlashAttention-2 (Dao, arXiv 2307.08691, Sec. 3.1, Algorithm 1): the
``seqlen_q x seqlen_k`` score matrix never reaches device memory. On Hopper (sm_90a)
float16/bfloat16 at head dims from 40 up (padded onto 64, 128 or 256) run the TMA kernel built as
FlashAttention-3 (Shah et al., arXiv 2407.08608: TMA producer, warpgroup MMA, Sec. 3.1 ping-pong
and Sec. 3.2 intra-warpgroup overlap, a persistent grid); elsewhere mma.sync (tensor cores) or
CUDA cores (float32/float64). ``explain`` names the kernel. ``explain`` returns what such a
call would launch (:class:`cupyflash.core.planning.Plan`) without launching anything; it also works on
NumPy arrays, on a machine without a GPU.

Every call does its work in this order, so bad input never reaches a kernel:

1. every array argument must live on a CUDA device (``TypeError`` naming the argument);
2. :mod:`cupyflash.core.checks` validates shapes, dtypes, heads, ``softmax_scale``, ``window_size``,
   ``out`` (``TypeError`` / ``ValueError`` naming the argument);
3. :func:`cupyflash.forward.dispatch.plan_prefill` picks the specialisation (``ValueError`` listing why
   each candidate was rejected when none fits);
4. the output (unless given) and the LSE (float32; float64 for float64 inputs) are allocated and the kernel is launched, by the
   caller's conventions (:mod:`cupyflash.core.interop`): PyTorch CUDA tensors (every array argument a
   tensor) are read through their own attributes, the results are tensors from torch's caching
   allocator and the launch goes to torch's current stream of ``q``'s device; anything else is
   viewed as CuPy arrays without copying (:func:`cupyflash.core.interop.as_cupy`), the results are
   CuPy arrays and the launch goes to CuPy's current stream of that device.

A warm call (same layouts and options as an earlier one, see
:data:`cupyflash.core.cache.LAUNCH_CACHE`) skips steps 1-3: it reads each array's pointer, shape,
strides and dtype, allocates the outputs and launches.

The only device memory a call allocates besides its output is the LSE,
``batch * nheads * seqlen_q * 4`` bytes.
"""
from __future__ import annotations

import sys

import numpy as np

from .core import checks
from .forward import dispatch, run
from .forward.run import NO_WINDOW, require_bool

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_backward",
           "flash_attn_varlen_backward", "explain", "explain_varlen"]


# ----------------------------------------------------------------------------------------------
# Tracing by torch.compile: the calls become custom operators
# ----------------------------------------------------------------------------------------------
def _torch_compiling() -> bool:
    """True while ``torch.compile`` (Dynamo) or ``torch.export`` traces the caller
    (``torch.compiler.is_compiling()``, which Dynamo folds to True); False when torch has not
    been imported (never imports it) and in eager code, the custom operators' real
    implementations included. Once torch is imported this name is rebound to
    ``torch.compiler.is_compiling`` itself (~0.1 us per eager call, no frame of ours)."""
    global _torch_compiling
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    _torch_compiling = torch.compiler.is_compiling
    return _torch_compiling()


def _all_torch(*arrays) -> bool:
    """Every non-None array a torch tensor (torch is imported: the caller is being traced)."""
    tensor = sys.modules["torch"].Tensor
    return all(a is None or isinstance(a, tensor) for a in arrays)


def _grad_wanted(q, k, v, out) -> bool:
    """A torch caller whose q, k or v requires grad, with grad mode on: the call goes through the
    custom operator, whose registered backward is :func:`flash_attn_backward` (False without
    torch imported, or for any other caller: no cost beyond a dictionary lookup). ``out=`` is
    refused then (ValueError): a result written into a given buffer has no gradient."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    t = torch.Tensor  # (attribute reads, no generator: this runs on every eager call)
    want = ((isinstance(q, t) and q.requires_grad) or (isinstance(k, t) and k.requires_grad)
            or (isinstance(v, t) and v.requires_grad))
    if want and torch.is_grad_enabled():
        if out is not None:
            raise ValueError("out: not allowed when q, k or v requires grad (the result must be "
                             "a new tensor to carry its gradient); drop out= or call under "
                             "torch.no_grad()")
        return True
    return False


def _traced_call(op, args: tuple, kwargs: dict, return_lse, out):
    """What a call traced by ``torch.compile`` runs instead of its body: the custom operator
    wrapper ``op`` of :mod:`cupyflash.torch_ops` (its fake implementation gives the shapes, so
    Dynamo never traces the CuPy/NumPy call path; the compiled code runs the real call). The
    operator returns a new output: a given ``out`` is written by a copy of it."""
    want_lse = require_bool(return_lse, "return_lse")
    o, lse = op(*args, return_lse=True, **kwargs)
    if out is not None:
        out.copy_(o)
        o = out
    return (o, lse) if want_lse else o



# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------
def flash_attn_func(q, k, v, *, softmax_scale=None, causal=False, window_size=NO_WINDOW,
                    return_lse=False, out=None, deterministic=False):
    """Exact softmax attention, tiled on chip (FlashAttention-2 forward).

    ``out[b, i, h] = sum_j softmax_j(softmax_scale * q[b, i, h] . k[b, j, h // g]) v[b, j, h // g]``
    over the keys ``j`` that query row ``i`` may see, with ``g = nheads // nheads_k`` (GQA/MQA).
    FlashAttention-2, arXiv 2307.08691, Sec. 3.1 (online softmax, unscaled accumulator normalised
    once at the end) and Algorithm 1; on sm_90a devices, float16/bfloat16 at head dims from 40 up
    (padded onto 64, 128 or 256) use the TMA kernel built as FlashAttention-3 (arXiv 2407.08608,
    Sec. 3.1-3.2: producer warp, warpgroup MMA, softmax/GEMM overlap, persistent grid). The
    result is the same function (tested against the same float64 reference).

    Parameters
    ----------
    q : CUDA array, shape (batch, seqlen_q, nheads, headdim)
        float16, bfloat16, float32 or float64. A ``cupy.ndarray`` or anything exposing
        ``__cuda_array_interface__`` or DLPack on a CUDA device (e.g. a PyTorch CUDA tensor),
        used in place (no copy). Any strides, but the last dimension must be contiguous.
    k, v : CUDA array, shape (batch, seqlen_k, nheads_k, headdim)
        Same dtype and device as ``q``; ``nheads % nheads_k == 0``.
    softmax_scale : float, optional
        Multiplies ``q k^T``; default ``1 / sqrt(headdim)``. Must be finite and positive.
        This and the options after it are keyword-only: FlashAttention's fourth positional
        parameter is ``dropout_p`` (no dropout here), so a call ported with it positionally
        raises a TypeError instead of reading the dropout rate as the scale.
    causal : bool
        Causal mask aligned bottom-right: row ``i`` sees key ``j`` iff
        ``j <= i + seqlen_k - seqlen_q``. Same as ``window_size=(left, 0)``: with ``causal=True``
        a window's right side is dropped (FlashAttention's convention), its left side kept.
    window_size : tuple of 2 int
        Sliding window ``(left, right)`` in keys, -1 = unbounded, aligned bottom-right like
        ``causal``: row ``i`` sees ``i + seqlen_k - seqlen_q - left <= j <=
        i + seqlen_k - seqlen_q + right``.
    return_lse : bool
        Also return the log-sum-exp of each row.
    out : CUDA array, optional
        Output buffer, same shape, dtype and device as ``q``; written in place and returned
        (itself for a torch caller, else as a CuPy view of the same memory). Allocated when
        None.
    deterministic : bool
        For the backward pass of a torch caller's autograd (FlashAttention's flag): True gives
        bitwise-repeatable gradients (:func:`flash_attn_backward`'s ``deterministic``; on
        sm_90a the Hopper kernel's dQ then adds in a fixed order, slower). Checked, not used
        by the forward.

    Returns
    -------
    out : torch.Tensor or cupy.ndarray, shape (batch, seqlen_q, nheads, headdim), dtype of ``q``
        A contiguous ``torch.Tensor`` when every array argument is a torch tensor, else a
        ``cupy.ndarray``. Rows with no visible key are 0.
    lse : torch.Tensor or cupy.ndarray, shape (batch, nheads, seqlen_q), float32 (float64 for float64)
        Only if ``return_lse``: natural log of each row's softmax denominator of the scaled
        scores (``-inf`` for a row with no visible key). Without ``return_lse`` none is
        allocated and the kernel writes none.

    Raises
    ------
    TypeError
        An array argument not on a CUDA device (NumPy arrays: use
        :func:`cupyflash.reference.attention_reference`), unsupported or mismatched dtypes,
        non-bool ``causal`` / ``return_lse``, bad ``window_size`` or ``softmax_scale`` type,
        an option passed positionally (they are keyword-only).
    ValueError
        Wrong shapes, ``headdim`` not a multiple of 8 up to 256, ``nheads % nheads_k != 0``,
        non-contiguous last dimension, arrays on different devices, a NaN/Inf/non-positive
        ``softmax_scale``, or no kernel specialisation for the problem (the message lists why
        each was rejected; see :func:`explain`).

    Notes
    -----
    Differentiable for torch callers: when ``q``, ``k`` or ``v`` requires grad (and grad mode
    is on) the call runs the custom operator ``cupyflash::flash_attn``, whose backward is
    :func:`flash_attn_backward` (``out.backward()`` fills ``q.grad``, ``k.grad``, ``v.grad``;
    the returned LSE is not differentiated). ``out=`` is refused then.

    Runs on torch's current stream of ``q``'s device for torch tensors
    (``torch.cuda.current_stream(q.device)``; inside ``with torch.cuda.stream(s):`` on ``s``),
    else on CuPy's current stream of the device holding ``q`` (``with cupy.cuda.Stream(): ...``).

    Traced by ``torch.compile`` (``fullgraph=True`` too) with torch tensors, the call is the
    custom operator ``cupyflash::flash_attn`` (:func:`cupyflash.torch_ops.flash_attn_func`),
    whose fake implementation gives the output shapes: no graph break, and the compiled code
    runs this function on the tensors. ``out=`` is then written by a copy of the operator's
    output.
    """
    if deterministic is not False:
        require_bool(deterministic, "deterministic")
    if (_torch_compiling() and _all_torch(q, k, v, out)) or _grad_wanted(q, k, v, out):
        from . import torch_ops
        return _traced_call(torch_ops.flash_attn_func, (q, k, v),
                            dict(softmax_scale=softmax_scale, causal=causal,
                                 window_size=window_size, deterministic=deterministic),
                            return_lse, out)
    return run.flash_attn(q, k, v, softmax_scale, causal, window_size, return_lse, out)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           *, softmax_scale=None, causal=False, window_size=(-1, -1),
                           return_lse=False, out=None, validate=True, deterministic=False):
    """Exact attention over a packed batch of variable-length sequences (FlashAttention-2 forward).

    Sequence ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``; each is attended on its own, with the causal / window
    masks aligned bottom-right against that sequence's own lengths. FlashAttention-2,
    arXiv 2307.08691, Sec. 3.1 and Algorithm 1, per sequence; on sm_90a float16/bfloat16 from
    head dim 40 up, the TMA kernel built as FlashAttention-3 (arXiv 2407.08608), its tensor maps
    seeing the packed tokens as one batch entry.

    Parameters
    ----------
    q : CUDA array, shape (total_q, nheads, headdim)
    k, v : CUDA array, shape (total_k, nheads_k, headdim)
        Dtypes, strides and devices as in :func:`flash_attn_func`.
    cu_seqlens_q, cu_seqlens_k : CUDA int32 array, shape (batch + 1,)
        Sequence starts: ``0 = cu[0] <= cu[1] <= ... <= cu[batch] = total``. Zero-length
        sequences are allowed (a query with no keys gives 0 and LSE -inf). Host arrays (e.g.
        ``np.cumsum`` of the lengths) are refused with the line that copies them to the device:
        ``cupy.asarray(cu, dtype=cupy.int32)`` / ``torch.as_tensor(cu, dtype=torch.int32,
        device=q.device)``; a device array of another integer dtype, with ``.astype(cupy.int32)``
        / ``.to(torch.int32)``.
    max_seqlen_q, max_seqlen_k : int
        At least the longest query / key sequence; ``max_seqlen_q`` sizes the launch grid.
    softmax_scale, causal, window_size, return_lse, out
        As in :func:`flash_attn_func` (``out`` has the shape of ``q``).
    validate : bool
        When True (default) the ``cu_seqlens`` values are copied to the host and checked (this
        synchronises with the device); False checks shapes and dtypes only, and the caller
        guarantees the values (wrong values then read out of bounds).
    deterministic : bool
        As in :func:`flash_attn_func` (the varlen backward's kernels are always
        deterministic).

    Returns
    -------
    out : torch.Tensor or cupy.ndarray, shape (total_q, nheads, headdim), dtype of ``q``
        By the caller's kind and on the caller's stream, as in :func:`flash_attn_func`.
    lse : torch.Tensor or cupy.ndarray, shape (nheads, total_q), float32 (float64 for float64)
        Only if ``return_lse``.

    Raises
    ------
    TypeError, ValueError
        As in :func:`flash_attn_func`, plus non-int32 or host ``cu_seqlens`` (TypeError saying
        how to convert them), and (with ``validate``) ``cu_seqlens`` not starting at 0,
        decreasing, not ending at the packed length, or longer than ``max_seqlen``.

    Notes
    -----
    Traced by ``torch.compile`` with torch tensors, the call is the custom operator
    ``cupyflash::flash_attn_varlen`` (:func:`cupyflash.torch_ops.flash_attn_varlen_func`), as
    in :func:`flash_attn_func`; pass ``validate=False`` there (True reads ``cu_seqlens`` on the
    host when the compiled code runs: a synchronisation, and no CUDA graph).
    """
    if deterministic is not False:
        require_bool(deterministic, "deterministic")
    if (_torch_compiling() and _all_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, out)) or \
            _grad_wanted(q, k, v, out):
        from . import torch_ops
        return _traced_call(torch_ops.flash_attn_varlen_func,
                            (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                            dict(softmax_scale=softmax_scale, causal=causal,
                                 window_size=window_size, validate=validate,
                                 deterministic=deterministic), return_lse, out)
    return run.flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 softmax_scale, causal, window_size, return_lse, out, validate)


def flash_attn_backward(dout, q, k, v, out, lse, *, softmax_scale=None, causal=False,
                        window_size=(-1, -1), deterministic=False, dq=None, dk=None, dv=None):
    """Gradients of :func:`flash_attn_func` with respect to ``q``, ``k``, ``v`` (FlashAttention-2
    backward).

    With ``P = softmax(softmax_scale * q k^T)`` over the visible keys, recomputed from the
    forward's ``lse`` (never stored): ``dv = P^T dout``, ``dP = dout v^T``,
    ``dS = P * (dP - D)`` with ``D = rowsum(dout * out)``, ``dq = softmax_scale * dS k``,
    ``dk = softmax_scale * dS^T q``; under GQA/MQA ``dk``, ``dv`` are summed over the query heads
    of each KV head. FlashAttention-2, arXiv 2307.08691, Sec. 3.2 and Algorithm 2. On sm_90a
    (float16/bfloat16, dense) one Hopper kernel per key block computes dK, dV and adds dQ to an
    fp32 accumulator by reductions in L2 (FlashAttention-3, arXiv 2407.08608;
    ``deterministic`` below); elsewhere three kernels (``kernels_cu/common/bwd_tile.cuh``): D,
    then dK/dV (one CTA per key block) and dQ (one CTA per query block), with no atomics, so the
    gradients are bitwise the same from run to run. float16/bfloat16 on tensor cores (wgmma on
    Hopper, else mma.sync; fp32 accumulation), float32/float64 on
    CUDA cores in their own precision (float64: within rounding of a float64 one-shot backward,
    so ``torch.autograd.gradcheck`` runs through it). Extra device memory: D, one value per query
    row (``batch * nheads * seqlen_q`` float32, float64 for float64); the Hopper kernel instead
    two float32 values per query row (LSE, D) and the float32 dQ accumulator (``batch * nheads *
    seqlen_q * headdim``, rows rounded up to 64); never S x S.

    Parameters
    ----------
    dout : CUDA array, shape (batch, seqlen_q, nheads, headdim)
        The gradient of the loss with respect to ``out``; dtype of ``q``.
    q, k, v : CUDA arrays
        The forward's inputs, as in :func:`flash_attn_func`.
    out : CUDA array, shape of ``q``
        The forward's output.
    lse : CUDA array, shape (batch, nheads, seqlen_q)
        The forward's LSE (``return_lse=True``): float32, float64 for float64 inputs.
    softmax_scale, causal, window_size
        The forward's, as in :func:`flash_attn_func`.
    deterministic : bool
        True: bitwise the same gradients from run to run (each gradient element is reduced in
        a fixed order), and a sequence's gradients do not depend on the other sequences of its
        batch. False (the default) gives the same, except where the Hopper kernel runs (sm_90a,
        float16/bfloat16, dense; ``CUPYFLASH_BWD_HOPPER=0`` turns it off): it adds ``dq`` over
        the key blocks by fp32 reductions in L2, in an order that varies (``dk``, ``dv`` stay
        repeatable); with True the key blocks take turns (FlashAttention-3's semaphores), in a
        fixed order, at 0.70-0.94x the default's speed on an H100 (2026-12-07, 4e04ef9; still
        faster than the mma.sync kernels).
    dq, dk, dv : CUDA arrays, optional
        Buffers for the results, shaped and typed like ``q``, ``k``, ``v`` (any strides with a
        contiguous last dimension); allocated when None.

    Returns
    -------
    (dq, dk, dv) : torch.Tensor or cupy.ndarray, shapes and dtype of q, k, v
        Torch tensors when every array argument is one (on torch's current stream of q's
        device), else CuPy arrays (on CuPy's current stream).

    Raises
    ------
    TypeError
        An array argument not on a CUDA device (NumPy: use
        :func:`cupyflash.reference.attention_backward`), a wrong dtype (``lse`` included),
        non-bool ``causal`` / ``deterministic``.
    ValueError
        Shapes that do not match the forward's (naming the argument), the forward's own errors
        (:func:`flash_attn_func`).
    """
    from .backward import run as bwd
    return bwd.flash_attn_backward(dout, q, k, v, out, lse, softmax_scale, causal, window_size,
                                   deterministic, dq, dk, dv)


def flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k, *, softmax_scale=None, causal=False,
                               window_size=(-1, -1), deterministic=False, dq=None, dk=None,
                               dv=None, validate=True):
    """Gradients of :func:`flash_attn_varlen_func` (packed variable-length sequences): as
    :func:`flash_attn_backward`, each sequence on its own.

    Parameters
    ----------
    dout, out : CUDA arrays, shape (total_q, nheads, headdim)
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, validate
        The forward's, as in :func:`flash_attn_varlen_func`.
    lse : CUDA array, shape (nheads, total_q)
        The forward's LSE: float32, float64 for float64 inputs.
    softmax_scale, causal, window_size, deterministic, dq, dk, dv
        As in :func:`flash_attn_backward`.

    Returns
    -------
    (dq, dk, dv) : shapes of q, k, v (packed).

    Raises
    ------
    TypeError, ValueError
        As :func:`flash_attn_backward` and :func:`flash_attn_varlen_func`.
    """
    from .backward import run as bwd
    return bwd.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                          window_size, deterministic, dq, dk, dv, validate)


def explain(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
            return_lse=False, out=None, arch=None, num_sms=None):
    """The plan :func:`flash_attn_func` would execute for these arguments, as data; launches nothing.

    Accepts the same arguments as :func:`flash_attn_func`, and arrays of any kind (NumPy arrays
    too: only shapes and dtypes are read), so it runs on a machine without a GPU.

    Parameters
    ----------
    q, k, v, softmax_scale, causal, window_size, return_lse, out
        As in :func:`flash_attn_func` (``return_lse`` does not change the plan).
    arch : str, optional
        Architecture of the ptxas report (``"sm_80"``, ``"sm_90a"``, ...; sm_80 or newer);
        default the current device's, or ``"sm_90a"`` without a GPU.
    num_sms : int, optional
        SMs the tile heuristic plans for; default the current device's, or an H200's 132
        without a GPU (the plan's notes then say so).

    Returns
    -------
    cupyflash.core.planning.Plan
        Kernel specialisation name and template values, grid, block, dynamic shared memory
        (bytes), registers per thread and spill bytes (ptxas report of an NVRTC compile),
        ``num_splits`` (None for prefill), predicted FLOPs and HBM bytes, ``roofline_ms`` (the
        predicted time in milliseconds at the H200's measured roofs), and the reasons every other
        specialisation was not chosen (``rejected``; printing shows the nearest eight).

    Raises
    ------
    TypeError, ValueError
        Exactly those :func:`flash_attn_func` raises for invalid or unsupported input (except the
        CUDA-array requirement).
    """
    require_bool(return_lse, "return_lse")
    problem = checks.check_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                     window_size=window_size, out=out)
    _check_layouts({"q": q, "k": k, "v": v, "out": out})
    return dispatch.plan_prefill(problem, arch=arch, num_sms=num_sms)


def _check_layouts(named: dict) -> None:
    """The kernels' layout rule, also for host arrays passed to ``explain``: the checks apply it
    to device arrays only (the NumPy reference takes any strides)."""
    for name, x in named.items():
        if x is not None:
            checks.check_last_dim_contiguous(x, name)


def explain_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   *, softmax_scale=None, causal=False, window_size=(-1, -1),
                   return_lse=False, out=None, validate=True, arch=None, num_sms=None):
    """The plan :func:`flash_attn_varlen_func` would execute, as data; launches nothing.

    Same arguments as :func:`flash_attn_varlen_func`; arrays of any kind (NumPy included; host
    ``cu_seqlens`` of any integer dtype whose values fit int32, e.g. ``np.cumsum``'s int64). FLOPs
    are counted exactly per sequence when ``validate`` (the ``cu_seqlens`` are read), else None.
    ``arch`` and ``num_sms``: as in :func:`explain`.

    Returns
    -------
    cupyflash.core.planning.Plan

    Raises
    ------
    TypeError, ValueError
        As :func:`flash_attn_varlen_func` (except the CUDA-array requirement).
    """
    require_bool(return_lse, "return_lse")
    problem = checks.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                                  window_size=window_size, out=out, validate=validate)
    _check_layouts({"q": q, "k": k, "v": v, "out": out})
    lengths = None
    if validate:
        lengths = (np.diff(checks.to_host(cu_seqlens_q).astype(np.int64)),
                   np.diff(checks.to_host(cu_seqlens_k).astype(np.int64)))
    return dispatch.plan_prefill(problem, arch=arch, lengths=lengths, num_sms=num_sms)


