"""cupyflash as an attention implementation of Hugging Face transformers (5.x).

    import cupyflash.hf
    cupyflash.hf.register()  # "cupyfa" joins transformers' attention registry
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16,
                                                 attn_implementation="cupyfa").cuda()
    model.generate(input_ids, max_new_tokens=32)

:func:`register` adds :func:`attention_forward` to ``transformers.AttentionInterface`` and
FlashAttention's mask function (a mask only where there is padding) to its
``AttentionMaskInterface`` under the same name. The model's attention layers then call
:func:`attention_forward` with (batch, heads, seqlen, headdim) tensors: prefill (several query
tokens) runs :func:`cupyflash.torch_ops.flash_attn_func`, each decode step (one query token
against the cache) :func:`cupyflash.torch_ops.flash_attn_with_kvcache` on the layer's whole
cache; both are torch custom operators, so a compiled model traces them. Causal masks are
aligned bottom-right (the query tokens are the last of the keys), as a cache needs.

Supported: float16 / bfloat16 (float32 prefill too), head dims that are multiples of 8 up to
256, GQA/MQA, sliding windows (``sliding_window``), training (the operators' backward is
:func:`cupyflash.flash_attn_backward`; under ``torch.autocast`` q, k, v are cast to autocast's
dtype), no dropout, no soft-capping, and batches without padding: a padded batch (an attention
mask with zeros) raises NotImplementedError.
Installed with the ``transformers`` extra (``pip install cupyflash[transformers]``).
"""
from __future__ import annotations

import torch

from . import torch_ops

__all__ = ["NAME", "register", "attention_forward"]

#: the name :func:`register` uses by default (``attn_implementation="cupyfa"``). Not
#: "cupyflash": transformers takes any name containing "flash" for a FlashAttention package
#: to import (``transformers.utils.generic.is_flash_attention_requested``).
NAME = "cupyfa"

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


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, sliding_window=None, softcap=None, **kwargs):
    """transformers' attention-function signature: ``query`` (batch, heads, q_len, headdim),
    ``key``/``value`` (batch, kv_heads, kv_len, headdim); returns ``(out, None)`` with ``out``
    (batch, q_len, heads, headdim).

    Raises
    ------
    NotImplementedError
        A padding mask, dropout, soft-capping.
    """
    if attention_mask is not None:
        raise NotImplementedError("cupyflash attention: padded batches (an attention mask with "
                                  "zeros) are not supported; pass sequences of equal length")
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
    if q.shape[1] == 1 and causal and window == (-1, -1) and q.dtype in _DECODE_DTYPES:
        # a decode step: one token against the whole cache (split-KV kernel)
        out = torch_ops.flash_attn_with_kvcache(q, k, v, softmax_scale=scale, causal=True)
    else:
        out = torch_ops.flash_attn_func(q, k, v, softmax_scale=scale, causal=bool(causal),
                                        window_size=window)
    return out, None
