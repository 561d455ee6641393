"""cupyflash as an attention implementation of Hugging Face transformers (5.x).

    import cupyflash.hf
    cupyflash.hf.register()  # "cupyfa" joins transformers' attention registry
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16,
                                                 attn_implementation="cupyfa").cuda()
    tok.padding_side = "left"
    batch = tok(prompts, return_tensors="pt", padding=True).to("cuda")
    model.generate(**batch, max_new_tokens=32)   # padded batches of mixed lengths too

:func:`register` adds :func:`attention_forward` to ``transformers.AttentionInterface`` and
FlashAttention's mask function to its ``AttentionMaskInterface`` under the same name, so the
``attention_mask`` that reaches :func:`attention_forward` is None (no padding) or the 2-D
(batch, kv_len) padding mask (True / 1 = a real token). The model's attention layers call
:func:`attention_forward` with (batch, heads, seqlen, headdim) tensors; it picks one of four
paths, all through torch custom operators of :mod:`cupyflash.torch_ops` (``torch.compile``
traces them, autograd differentiates them):

1. **Equal lengths** (no mask, no packing): prefill (several query tokens) runs
   :func:`~cupyflash.torch_ops.flash_attn_func`, a decode step (one query token against the
   cache) :func:`~cupyflash.torch_ops.flash_attn_with_kvcache` on the layer's whole cache.
2. **Padded batches** (a 2-D mask with zeros; left or right padding, or holes anywhere): each
   row's real tokens are moved to the front of the row (one gather of q, k, v per layer, in
   place of the copy the packed layout needs anyway; row ``b`` keeps rows ``b*L .. b*L+L-1`` of
   a (batch*L, heads, headdim) buffer), then

   * prefill and training: :func:`~cupyflash.torch_ops.flash_attn_varlen_func` over ``3*batch``
     sequences: per row (its real queries, its real keys), (its padded queries, no keys), (no
     queries, its padded keys), so every row of the buffer belongs to a sequence and the kernels
     write every output and gradient row (padded positions get out = 0, gradient 0), and
     ``max_seqlen`` is the padded length (a static bound, no device read); the output is
     gathered back to the padded layout;
   * a decode step (one query, causal, no window, float16 / bfloat16):
     :func:`~cupyflash.torch_ops.flash_attn_with_kvcache` on the compacted cache with
     ``cache_seqlens`` = the real lengths (a device tensor); with a sliding window (or
     ``DECODE = "varlen"``) the varlen call instead.

   Causal and window masks are aligned bottom-right per sequence, i.e. on the real tokens with
   the padding removed: the semantics of transformers' FlashAttention-2 path; equal to SDPA's
   masked attention where each row's real tokens are contiguous (left or right padding). A
   padded query row's output is 0; padded keys are never read.
3. **Packed sequences from** ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (``max_length_q`` /
   ``max_length_k``) keyword arguments, e.g. from
   ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``: the batch's tokens are
   flattened to (batch*seqlen, heads, headdim) and attended per document (varlen).
4. **Packed sequences from** ``position_ids`` (no mask, no ``cu_seq_lens`` kwargs, query length
   = key length >= 2): a document starts wherever a position is not the previous one + 1 (as
   ``transformers.masking_utils.find_packed_sequence_indices``); with any restart the rows are
   attended per document (varlen), else path 1. ``position_ids`` of shape (batch, seqlen), or
   (1, seqlen) with batch 1; a (1, seqlen) tensor with batch > 1 is taken as positions shared by
   unpacked rows (as transformers' models create them) and not inspected.

Host synchronisation: paths 1 and 2 read nothing back to the host (lengths, indices and
``cu_seqlens`` stay on the device, ``max_seqlen`` is the static padded length, the varlen call
runs with ``validate=False`` and the decode call checks ``cache_seqlens`` on the device), so a
padded decode step (and a padded prefill) can be captured in a CUDA graph; while the stream
captures, the decode call gets a float32 workspace kept per (device, stream, shapes), shared by
the graphs captured on that stream (do not replay two of them concurrently). What does
synchronise: path 4 reads the document starts back once per forward (cached for the layers that
share the ``position_ids`` tensor; under ``torch.compile`` the inspection is a graph break), and
path 3 reads ``max_length_q`` / ``max_length_k`` when they are tensors or missing (ints, as the
collator gives, are used as they are). The indices of paths 2 and 4 are computed once per
forward and shared by the layers that receive the same mask / ``position_ids`` tensor (not under
``torch.compile`` or while capturing a graph: each layer then computes its own, a few small
kernels).

Supported: float16 / bfloat16 (float32 prefill too), head dims that are multiples of 8 up to
256, GQA/MQA, sliding windows (``sliding_window``), static caches (a mask shorter than the
keys: the keys past it are unused cache slots), training (the operators' backward is
:func:`cupyflash.flash_attn_backward`, deterministic under
``torch.use_deterministic_algorithms(True)``, ``FLASH_ATTENTION_DETERMINISTIC=1`` or a
``deterministic`` keyword (:func:`deterministic_backward`); the gathers are differentiable;
under ``torch.autocast`` q, k, v are cast to autocast's dtype), no dropout, no soft-capping, no 4-D masks.
Installed with the ``transformers`` extra (``pip install cupyflash[transformers]``).
"""
from __future__ import annotations

import itertools
import numbers
import os
import weakref
from typing import NamedTuple

import torch

from . import torch_ops

__all__ = ["NAME", "DECODE", "register", "attention_forward", "deterministic_backward",
           "padding_plan"]

#: the name :func:`register` uses by default (``attn_implementation="cupyfa"``). Not
#: "cupyflash": transformers takes any name containing "flash" for a FlashAttention package
#: to import (``transformers.utils.generic.is_flash_attention_requested``).
NAME = "cupyfa"

#: the kernel of a padded decode step without a window: "kvcache" (the split-KV decode kernel
#: with per-row ``cache_seqlens``) or "varlen" (the prefill kernel, one query per sequence);
#: experiments/bench_hf_generate.py times both.
DECODE = "kvcache"

_DECODE_DTYPES = (torch.float16, torch.bfloat16)


def register(name: str = NAME) -> str:
    """Register :func:`attention_forward` (and FlashAttention's mask preparation) with
    transformers under ``name``; returns ``name``. Idempotent.

    Raises
    ------
    ValueError
        ``name`` contains "flash" (transformers would look for a FlashAttention package)."""
    if "flash" in name:
        raise ValueError(f"name: {name!r} contains 'flash', which transformers reserves for "
                         "FlashAttention packages; use another name (default 'cupyfa')")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


def deterministic_backward(requested=None) -> bool:
    """Whether the layers' backward runs deterministic (bitwise-repeatable gradients, at a cost:
    :func:`cupyflash.flash_attn_backward`): ``requested`` when it is a bool, else True when
    ``torch.use_deterministic_algorithms(True)`` is on or ``FLASH_ATTENTION_DETERMINISTIC=1`` is
    set (the variable transformers' FlashAttention integration reads)."""
    if requested is not None:
        return bool(requested)
    return (torch.are_deterministic_algorithms_enabled()
            or os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1")


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, sliding_window=None, softcap=None, **kwargs):
    """transformers' attention-function signature.

    Parameters
    ----------
    module : torch.nn.Module or None
        The attention layer (its ``is_causal`` is read when ``is_causal`` is None; default
        causal).
    query : torch.Tensor, shape (batch, heads, q_len, headdim)
    key, value : torch.Tensor, shape (batch, kv_heads, kv_len, headdim)
        ``heads % kv_heads == 0``; float16 / bfloat16 (float32 outside decode steps).
    attention_mask : torch.Tensor or None
        None, or a 2-D (batch, mask_len) padding mask, bool or integer (nonzero = a real token),
        as FlashAttention's mask function gives it. ``mask_len > kv_len``: its last ``kv_len``
        columns are used; ``mask_len < kv_len`` (a static cache): the keys past ``mask_len`` are
        ignored. The queries are the last ``q_len`` of the ``kv_len`` positions.
    dropout, softcap : must be 0 / None.
    scaling : float, optional
        Softmax scale (default ``1 / sqrt(headdim)``).
    is_causal : bool, optional
    sliding_window : int, optional
        Each query sees the last ``sliding_window`` keys, itself included.
    **kwargs
        ``cu_seq_lens_q``, ``cu_seq_lens_k`` (1-D integer tensors of equal length,
        ``[0, ..., total]`` over the flattened batch*seqlen tokens), ``max_length_q``,
        ``max_length_k`` (ints, or tensors / None: then read from the device),
        ``position_ids`` ((batch or 1, q_len) integers): packed sequences (module docstring);
        ``deterministic`` (bool or None): the backward's (:func:`deterministic_backward`);
        anything else is ignored.

    Returns
    -------
    (out, None)
        ``out`` (batch, q_len, heads, headdim), dtype of the attention (``value``'s, or
        autocast's); 0 at padded query positions.

    Raises
    ------
    NotImplementedError
        Dropout, soft-capping, an attention mask that is not 2-D.
    ValueError
        A mask whose batch does not match ``query``'s, more queries than (unmasked) keys,
        ``cu_seq_lens_q`` without ``cu_seq_lens_k`` or the reverse, ``cu_seq_lens`` together
        with a padding mask, ``cu_seq_lens`` that are not 1-D or differ in length, a
        non-positive ``max_length``.
    TypeError
        ``cu_seq_lens`` that are not integer tensors, a ``max_length`` that is not an int.
    """
    if dropout:
        raise NotImplementedError("cupyflash attention: no dropout (use model.eval())")
    if softcap:
        raise NotImplementedError("cupyflash attention: no logit soft-capping")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if not (q.dtype == k.dtype == v.dtype):
        # under torch.autocast the rotary embedding hands over float32 q, k beside a bf16 / fp16
        # v: one dtype for the kernel, autocast's when it is on (as transformers' own
        # FlashAttention integration does), else v's
        dt = (torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda")
              else v.dtype)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
    window = (-1, -1)
    if sliding_window is not None:  # the last `sliding_window` keys, this one included
        window = (int(sliding_window) - 1, 0 if causal else -1)
    scale = None if scaling is None else float(scaling)
    causal = bool(causal)
    det = deterministic_backward(kwargs.get("deterministic"))
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if attention_mask is not None:
        if cu_q is not None or cu_k is not None:
            raise ValueError("cu_seq_lens_q / cu_seq_lens_k: not together with a padding "
                             "attention_mask (pass packed sequences without a mask, or a padded "
                             "batch without cu_seq_lens)")
        return _padded(q, k, v, attention_mask, scale, causal, window, det), None
    if cu_q is not None or cu_k is not None:
        return _packed_from_kwargs(q, k, v, cu_q, cu_k, kwargs.get("max_length_q"),
                                   kwargs.get("max_length_k"), scale, causal, window, det), None
    position_ids = kwargs.get("position_ids")
    if (position_ids is not None and q.shape[1] >= 2 and q.shape[1] == k.shape[1]
            and isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2
            and position_ids.shape[1] == q.shape[1]
            and (position_ids.shape[0] == q.shape[0] or position_ids.shape[0] == 1 == q.shape[0])):
        docs = _documents(position_ids)
        if docs is not None:
            return _packed(q, k, v, docs[0], docs[0], docs[1], docs[1], scale, causal,
                           window, det), None
    if q.shape[1] == 1 and causal and window == (-1, -1) and q.dtype in _DECODE_DTYPES:
        # a decode step: one token against the whole cache (split-KV kernel)
        out = torch_ops.flash_attn_with_kvcache(q, k, v, softmax_scale=scale, causal=True)
    else:
        out = torch_ops.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal,
                                        window_size=window, deterministic=det)
    return out, None


# ----------------------------------------------------------------------------------------------
# Padded batches
# ----------------------------------------------------------------------------------------------
class PaddingPlan(NamedTuple):
    """What :func:`padding_plan` derives from a padding mask (every tensor on the mask's device;
    no value is read on the host)."""
    #: (batch, kv_len) int64: ``k_src[b, j]`` = the position of the key that goes to slot ``j``
    #: of row ``b`` (the real keys first, in order, then the padded ones)
    k_src: torch.Tensor
    #: (batch, kv_len) int64: the inverse permutation (slot of the key at position ``j``)
    k_dest: torch.Tensor
    #: (batch, q_len) int64: as ``k_src``, for the query positions (the last q_len)
    q_src: torch.Tensor
    #: (batch, q_len) int64
    q_dest: torch.Tensor
    #: (batch,) int32: real keys per row
    k_lens: torch.Tensor
    #: (batch,) int32: ``k_lens``, 0 where the last position (a decode step's query) is padding
    #: (``cache_seqlens`` of a decode step: its output is then 0)
    decode_lens: torch.Tensor
    #: (3*batch + 1,) int32: the varlen call's sequence starts over the (batch*q_len) rows
    cu_seqlens_q: torch.Tensor
    #: (3*batch + 1,) int32: over the (batch*kv_len) key rows
    cu_seqlens_k: torch.Tensor
    #: (batch, 1) int64: ``arange(batch)``, the row index of the gathers
    rows: torch.Tensor


def padding_plan(mask: torch.Tensor, q_len: int) -> PaddingPlan:
    """The gathers and the varlen sequences of a padded batch, computed on the mask's device
    without a host synchronisation (static shapes only).

    Row ``b`` of the packed (batch*L, heads, headdim) buffers holds, from ``b*L`` on, its real
    tokens in order and then its padded ones; the varlen call sees per row three sequences:
    (real queries ``m_b``, real keys ``n_b``), (``q_len - m_b`` padded queries, no keys),
    (no queries, ``kv_len - n_b`` padded keys).

    Parameters
    ----------
    mask : torch.Tensor, shape (batch, kv_len), bool
        True = a real token.
    q_len : int
        The queries are the last ``q_len`` positions, ``1 <= q_len <= kv_len``.

    Returns
    -------
    PaddingPlan

    Raises
    ------
    ValueError
        ``mask`` not 2-D or not bool, ``q_len`` outside ``[1, kv_len]``.
    """
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(f"mask: expected a bool (batch, kv_len) tensor, got {mask.dtype} of "
                         f"shape {tuple(mask.shape)}")
    b, kv_len = mask.shape
    if not 1 <= q_len <= kv_len:
        raise ValueError(f"q_len: expected 1 <= q_len <= kv_len = {kv_len}, got {q_len}")
    k_src, k_dest, n_k = _row_order(mask)
    if q_len == kv_len:
        q_src, q_dest, n_q = k_src, k_dest, n_k
    else:
        q_src, q_dest, n_q = _row_order(mask[:, kv_len - q_len:])
    zero = torch.zeros_like(n_k)
    cu_q = _cumulative(torch.stack((n_q, q_len - n_q, zero), 1))
    cu_k = _cumulative(torch.stack((n_k, zero, kv_len - n_k), 1))
    rows = torch.arange(b, device=mask.device).unsqueeze(1)
    n_k = n_k.to(torch.int32)
    return PaddingPlan(k_src, k_dest, q_src, q_dest, n_k, n_k * mask[:, -1], cu_q, cu_k, rows)


def _row_order(m):
    """Per row of a bool (batch, L) mask: the stable order with the True entries first."""
    b, length = m.shape
    mi = m.to(torch.int64)
    real = mi.cumsum(1)                       # 1-based rank among the real tokens
    n = real[:, -1:]
    dest = torch.where(m, real, n + (1 - mi).cumsum(1)) - 1
    src = torch.empty_like(dest).scatter_(
        1, dest, torch.arange(length, device=m.device).expand(b, length))
    return src, dest, n.squeeze(1)


def _cumulative(lengths):
    """(batch, parts) int64 lengths -> int32 ``[0, cumsum...]`` over the flattened parts."""
    return torch.nn.functional.pad(lengths.flatten().cumsum(0, dtype=torch.int32), (1, 0))


def _take_rows(x, rows, idx):
    """``y[b, j] = x[b, idx[b, j]]`` for x (batch, L, ...) of any strides: one gather."""
    return x[rows, idx]


class _RowGather(torch.autograd.Function):
    """:func:`_take_rows` by a permutation ``idx`` (inverse ``inv``); its gradient is the gather
    by the inverse (no scatter-add)."""

    @staticmethod
    def forward(ctx, x, rows, idx, inv):
        ctx.save_for_backward(rows, inv)
        return _take_rows(x, rows, idx)

    @staticmethod
    def backward(ctx, grad):
        rows, inv = ctx.saved_tensors
        return _take_rows(grad, rows, inv), None, None, None


def _permute_rows(x, rows, idx, inv):
    if torch.is_grad_enabled() and x.requires_grad:
        return _RowGather.apply(x, rows, idx, inv)
    return _take_rows(x, rows, idx)


def _padding_mask(mask, q, k, v):
    """The bool (batch, kv_len) mask, and k, v cut to the mask (a static cache's unused slots)."""
    if mask.dim() != 2:
        raise NotImplementedError(
            f"cupyflash attention: attention_mask must be None or a 2-D (batch, kv_len) "
            f"padding mask (register() installs FlashAttention's mask function, which gives "
            f"one), got a {mask.dim()}-D mask of shape {tuple(mask.shape)}; arbitrary 4-D masks "
            f"are not supported")
    b, kv_len = q.shape[0], k.shape[1]
    if mask.shape[0] != b:
        raise ValueError(f"attention_mask: batch {mask.shape[0]} does not match the query's "
                         f"batch {b} (shape {tuple(mask.shape)})")
    m = mask if mask.dtype == torch.bool else mask != 0
    if m.device != q.device:
        m = m.to(q.device)
    if m.shape[1] > kv_len:    # the keys are the last kv_len positions (sliding-window caches)
        m = m[:, m.shape[1] - kv_len:]
    elif m.shape[1] < kv_len:  # a static cache: slots past the mask are unused
        k, v = k[:, :m.shape[1]], v[:, :m.shape[1]]
    if q.shape[1] > k.shape[1]:
        raise ValueError(f"attention_mask: {q.shape[1]} queries but only {k.shape[1]} key "
                         f"positions under the mask (shape {tuple(mask.shape)}); the queries "
                         f"must be the last positions of the keys")
    return m, k, v


def _padded(q, k, v, mask, scale, causal, window, deterministic=False):
    m, k, v = _padding_mask(mask, q, k, v)
    b, q_len, h, d = q.shape
    kv_len, hk = k.shape[1], k.shape[2]
    plan = _memoized(mask, ("pad", tuple(m.shape), q_len), lambda: padding_plan(m, q_len))
    kc = _permute_rows(k, plan.rows, plan.k_src, plan.k_dest)
    vc = _permute_rows(v, plan.rows, plan.k_src, plan.k_dest)
    if (q_len == 1 and causal and window == (-1, -1) and q.dtype in _DECODE_DTYPES
            and DECODE == "kvcache"):
        # a decode step: the split-KV kernel on the compacted cache, per-row lengths
        kw = {}
        ws = _capture_workspace(q, kc, vc, plan.decode_lens)
        if ws is not None:
            kw["workspace"] = ws
        return torch_ops.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=plan.decode_lens,
                                                 softmax_scale=scale, causal=True, **kw)
    qc = q if q_len == 1 else _permute_rows(q, plan.rows, plan.q_src, plan.q_dest)
    out = torch_ops.flash_attn_varlen_func(
        qc.reshape(b * q_len, h, d), kc.reshape(b * kv_len, hk, d),
        vc.reshape(b * kv_len, hk, d), plan.cu_seqlens_q, plan.cu_seqlens_k, q_len, kv_len,
        softmax_scale=scale, causal=causal, window_size=window, validate=False,
        deterministic=deterministic)
    out = out.view(b, q_len, h, d)
    return out if q_len == 1 else _permute_rows(out, plan.rows, plan.q_dest, plan.q_src)


_WORKSPACES: dict = {}


def _capture_workspace(q, kc, vc, lens):
    """A zero-filled float32 workspace for a decode call while torch's current stream captures
    a CUDA graph (the call refuses to capture without one when it splits), kept per (device,
    stream, shapes) and shared by the layers (sequential launches on one stream); None
    otherwise (the call then uses its per-stream buffers)."""
    if torch.compiler.is_compiling() or not q.is_cuda or \
            not torch.cuda.is_current_stream_capturing():
        return None
    stream = torch.cuda.current_stream(q.device).cuda_stream
    key = (q.device.index, stream, tuple(q.shape), tuple(kc.shape), q.dtype)
    ws = _WORKSPACES.get(key)
    if ws is None:
        from .decode import workspace_size
        n = workspace_size(q, kc, vc, cache_seqlens=lens)
        ws = _WORKSPACES[key] = torch.zeros(max(n, 1), dtype=torch.float32, device=q.device)
    return ws


# ----------------------------------------------------------------------------------------------
# Packed sequences
# ----------------------------------------------------------------------------------------------
def _packed(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, deterministic=False):
    """Varlen over the flattened batch: q (b, lq, h, d) -> (b*lq, h, d), the same for k, v."""
    b, q_len, h, d = q.shape
    out = torch_ops.flash_attn_varlen_func(
        q.reshape(-1, h, d), k.reshape(-1, k.shape[2], d), v.reshape(-1, v.shape[2], d),
        cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal, window_size=window,
        validate=False, deterministic=deterministic)
    return out.view(b, q_len, h, d)


def _packed_from_kwargs(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window,
                        deterministic=False):
    if cu_q is None or cu_k is None:
        raise ValueError("cu_seq_lens_q / cu_seq_lens_k: pass both (the sequence starts of the "
                         "queries and of the keys), got only "
                         + ("cu_seq_lens_q" if cu_k is None else "cu_seq_lens_k"))
    same = cu_k is cu_q
    cu_q = _as_cu_seqlens(cu_q, "cu_seq_lens_q", q.device)
    cu_k = cu_q if same else _as_cu_seqlens(cu_k, "cu_seq_lens_k", q.device)
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seq_lens_k: {cu_k.shape[0]} entries, cu_seq_lens_q has "
                         f"{cu_q.shape[0]}: one start per sequence (batch + 1) in both")
    max_q = _as_max_length(max_q, cu_q, "max_length_q")
    max_k = _as_max_length(max_k, cu_k, "max_length_k")
    return _packed(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, deterministic)


def _as_cu_seqlens(cu, name, device):
    if not isinstance(cu, torch.Tensor):
        if isinstance(cu, (list, tuple)):
            cu = torch.tensor(cu)
        else:
            raise TypeError(f"{name}: expected a 1-D integer tensor, got {type(cu).__name__}")
    if cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name}: expected a 1-D tensor [0, ..., total] of at least 2 entries, "
                         f"got shape {tuple(cu.shape)}")
    return cu.to(device=device, dtype=torch.int32, non_blocking=True)


def _as_max_length(mx, cu, name):
    """An int as it is; a tensor or None read from the device (a synchronisation)."""
    if mx is None:
        mx = (cu[1:] - cu[:-1]).max()
    if isinstance(mx, torch.Tensor):
        if mx.numel() != 1 or mx.dtype.is_floating_point:
            raise TypeError(f"{name}: expected an int, got a {mx.dtype} tensor of shape "
                            f"{tuple(mx.shape)}")
        mx = int(mx.item())
    if isinstance(mx, bool) or not isinstance(mx, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(mx).__name__}")
    mx = int(mx)
    if mx < 1:
        raise ValueError(f"{name}: expected a positive int (the longest sequence), got {mx}")
    return mx


@torch.compiler.disable
def _documents(position_ids):
    """``(cu_seqlens, max_len)`` of the documents of packed rows, or None when no row has a
    restart. Reads the starts back to the host (one synchronisation per ``position_ids``
    tensor: cached for the layers of a forward)."""
    return _memoized(position_ids, ("docs",), lambda: _find_documents(position_ids))


def _find_documents(position_ids):
    pos = position_ids
    b, length = pos.shape
    start = torch.ones_like(pos, dtype=torch.bool)
    start[:, 1:] = (pos[:, 1:] - pos[:, :-1]) != 1
    starts = torch.nonzero(start.flatten()).flatten().tolist()  # the synchronisation
    if len(starts) == b:
        return None
    bounds = starts + [b * length]
    max_len = max(e - s for s, e in itertools.pairwise(bounds))
    cu = torch.tensor(bounds, dtype=torch.int32).to(pos.device, non_blocking=True)
    return cu, max_len


# ----------------------------------------------------------------------------------------------
# A small cache: the layers of one forward receive the same mask / position_ids tensor
# ----------------------------------------------------------------------------------------------
_MEMO: list = []
_MEMO_SIZE = 8


def _memoized(t, key, build):
    """``build()``, reused while ``t`` is the same live tensor at the same version (in-place
    writes bump it) and ``key`` matches. Not under ``torch.compile``, not while a CUDA graph is
    captured (each capture must record the kernels that compute the result), not for inference
    tensors (no version counter)."""
    if torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing()):
        return build()
    try:
        version = t._version
    except RuntimeError:  # an inference-mode tensor
        return build()
    for ref, ver, k, value in _MEMO:
        if ref() is t and ver == version and k == key:
            return value
    value = build()
    _MEMO.insert(0, (weakref.ref(t), version, key, value))
    del _MEMO[_MEMO_SIZE:]
    return value
