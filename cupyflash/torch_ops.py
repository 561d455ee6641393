"""cupyflash as PyTorch custom operators, for ``torch.compile`` and CUDA graphs.

Importing this module (it imports torch) registers five operators with ``torch.library``, each
with a fake (meta) implementation that gives the output shapes and dtypes without running
anything, so that ``torch.compile(fullgraph=True)`` traces a function calling them without a
graph break and runs the real kernels in the compiled code:

* ``torch.ops.cupyflash.flash_attn(q, k, v, softmax_scale, causal, window_left,
  window_right, deterministic) -> (out, lse)``
* ``torch.ops.cupyflash.flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, softmax_scale, causal, window_left, window_right, validate, deterministic) ->
  (out, lse)`` (``deterministic``: not used by the forward; saved for its backward)
* ``torch.ops.cupyflash.flash_attn_backward(dout, q, k, v, out, lse, softmax_scale, causal,
  window_left, window_right, deterministic) -> (dq, dk, dv)`` and
  ``torch.ops.cupyflash.flash_attn_varlen_backward(...)``: the gradients (FlashAttention-2
  backward), registered with ``torch.library.register_autograd`` as the backward of the two
  forward operators, so ``out.backward()`` and ``torch.compile`` trace both passes without a
  graph break (the LSE output is not differentiated);
* ``torch.ops.cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens,
  block_table, out, workspace, softmax_scale, causal, num_splits, split_size, validate) -> lse``;
  writes ``out`` and, with ``k``/``v``, appends to the caches (declared mutated: ``k_cache``,
  ``v_cache``, ``out``, ``workspace``).

The functions below wrap them with the signatures of :func:`cupyflash.flash_attn_func`,
:func:`cupyflash.flash_attn_varlen_func` and :func:`cupyflash.flash_attn_with_kvcache`
(torch tensors only; ``cache_seqlens`` may be an int or a list, made a device tensor here).
The operators run the same calls (torch tensors in and out, torch's current stream), so a decode
step calling :func:`flash_attn_with_kvcache` with ``out=`` and ``workspace=`` (and device
``cache_seqlens``) can be captured by ``torch.cuda.graph`` and replayed with new lengths and
cache contents.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import decode
from .forward import run

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]


@torch.library.custom_op("cupyflash::flash_attn", mutates_args=())
def _flash_attn(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float], causal: bool,
                window_left: int, window_right: int,
                deterministic: bool) -> Tuple[Tensor, Tensor]:
    return run.flash_attn(q, k, v, softmax_scale, causal, (window_left, window_right), True, None)


@_flash_attn.register_fake
def _flash_attn_fake(q, k, v, softmax_scale, causal, window_left, window_right, deterministic):
    b, sq, h, _ = q.shape
    return (q.new_empty(q.shape),  # contiguous, as the call allocates it
            q.new_empty((b, h, sq), dtype=_lse_dtype(q)))


@torch.library.custom_op("cupyflash::flash_attn_varlen", mutates_args=())
def _flash_attn_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                       cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                       softmax_scale: Optional[float], causal: bool, window_left: int,
                       window_right: int, validate: bool,
                       deterministic: bool) -> Tuple[Tensor, Tensor]:
    return run.flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 softmax_scale, causal, (window_left, window_right), True, None,
                                 validate)


@_flash_attn_varlen.register_fake
def _flash_attn_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            softmax_scale, causal, window_left, window_right, validate,
                            deterministic):
    total_q, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((h, total_q), dtype=_lse_dtype(q))


# ---- the backward (FlashAttention-2 Sec. 3.2), and autograd for the two forward operators ----
@torch.library.custom_op("cupyflash::flash_attn_backward", mutates_args=())
def _flash_attn_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                         softmax_scale: Optional[float], causal: bool, window_left: int,
                         window_right: int, deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    from .backward import run as bwd
    return bwd.flash_attn_backward(dout, q, k, v, out, lse, softmax_scale, causal,
                                   (window_left, window_right), deterministic, None, None, None)


@_flash_attn_backward.register_fake
def _flash_attn_backward_fake(dout, q, k, v, out, lse, softmax_scale, causal, window_left,
                              window_right, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.custom_op("cupyflash::flash_attn_varlen_backward", mutates_args=())
def _flash_attn_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                                lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                max_seqlen_q: int, max_seqlen_k: int,
                                softmax_scale: Optional[float], causal: bool, window_left: int,
                                window_right: int,
                                deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    from .backward import run as bwd
    return bwd.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                          (window_left, window_right), deterministic, None, None,
                                          None, False)


@_flash_attn_varlen_backward.register_fake
def _flash_attn_varlen_backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                     max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                     window_left, window_right, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _grad_out(g, like):
    """The gradient of ``out`` as the kernels read it: zeros when autograd passes None, a copy
    when its last dimension is not contiguous (e.g. the expanded gradient of ``out.sum()``)."""
    if g is None:
        return torch.zeros_like(like)
    return g if g.stride(-1) == 1 else g.contiguous()


def _setup_dense(ctx, inputs, output):
    q, k, v, softmax_scale, causal, window_left, window_right, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (softmax_scale, causal, window_left, window_right, deterministic)


def _backward_dense(ctx, grad_out, grad_lse):
    # The LSE output is not differentiated (as FlashAttention's): its gradient is ignored.
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.cupyflash.flash_attn_backward(_grad_out(grad_out, out), q, k, v, out,
                                                         lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


def _setup_varlen(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_left, window_right,
     _validate, deterministic) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = (max_q, max_k, softmax_scale, causal, window_left, window_right, deterministic)


def _backward_varlen(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.cupyflash.flash_attn_varlen_backward(
        _grad_out(grad_out, out), q, k, v, out, lse, cu_q, cu_k, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("cupyflash::flash_attn", _backward_dense, setup_context=_setup_dense)
torch.library.register_autograd("cupyflash::flash_attn_varlen", _backward_varlen,
                                setup_context=_setup_varlen)


@torch.library.custom_op("cupyflash::flash_attn_with_kvcache",
                         mutates_args=("k_cache", "v_cache", "out", "workspace"))
def _flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor],
                             v: Optional[Tensor], cache_seqlens: Optional[Tensor],
                             block_table: Optional[Tensor], out: Tensor,
                             workspace: Optional[Tensor], softmax_scale: Optional[float],
                             causal: bool, num_splits: int, split_size: Optional[int],
                             validate: bool) -> Tensor:
    _, lse = decode.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale=softmax_scale,
        causal=causal, num_splits=num_splits, return_lse=True, out=out, split_size=split_size,
        validate=validate, workspace=workspace)
    return lse


@_flash_attn_with_kvcache.register_fake
def _flash_attn_with_kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, block_table, out,
                                  workspace, softmax_scale, causal, num_splits, split_size,
                                  validate):
    b, sq, h, _ = q.shape
    return q.new_empty((b, h, sq), dtype=torch.float32)


def _lse_dtype(q):
    """The forward's LSE dtype: float64 for float64 inputs, else float32."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _scale(softmax_scale):
    return None if softmax_scale is None else float(softmax_scale)


def flash_attn_func(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                    return_lse=False, deterministic=False):
    """:func:`cupyflash.flash_attn_func` on torch tensors through ``cupyflash::flash_attn``
    (traceable by ``torch.compile``; ``deterministic`` is its backward's). Returns ``out`` or
    ``(out, lse)``."""
    out, lse = torch.ops.cupyflash.flash_attn(q, k, v, _scale(softmax_scale), bool(causal),
                                              int(window_size[0]), int(window_size[1]),
                                              bool(deterministic))
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                           softmax_scale=None, causal=False, window_size=(-1, -1),
                           return_lse=False, validate=True, deterministic=False):
    """:func:`cupyflash.flash_attn_varlen_func` through ``cupyflash::flash_attn_varlen``.
    Inside ``torch.compile`` or a CUDA graph pass ``validate=False`` (True reads the
    ``cu_seqlens`` on the host, a synchronisation)."""
    out, lse = torch.ops.cupyflash.flash_attn_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
        _scale(softmax_scale), bool(causal), int(window_size[0]), int(window_size[1]),
        bool(validate), bool(deterministic))
    return (out, lse) if return_lse else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                            block_table=None, *, softmax_scale=None, causal=True, num_splits=0,
                            return_lse=False, out=None, split_size=None, validate=True,
                            workspace=None):
    """:func:`cupyflash.flash_attn_with_kvcache` through ``cupyflash::flash_attn_with_kvcache``:
    ``out`` is allocated here when not given (contiguous, like the call's), an int or a list
    ``cache_seqlens`` becomes an int32 tensor on ``q``'s device. Returns ``out`` or
    ``(out, lse)``. For a CUDA graph pass ``out``, ``workspace``
    (:func:`cupyflash.decode.alloc_workspace`'s size, zero-filled once) and device
    ``cache_seqlens``."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32,
                                   device=q.device)
    elif isinstance(cache_seqlens, (list, tuple)):
        cache_seqlens = torch.tensor(_int_list(cache_seqlens), dtype=torch.int32).to(
            q.device, non_blocking=True)
    lse = torch.ops.cupyflash.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, out, workspace,
        _scale(softmax_scale), bool(causal), int(num_splits),
        None if split_size is None else int(split_size), bool(validate))
    return (out, lse) if return_lse else out


def _int_list(values) -> List[int]:
    return [int(x) for x in values]
