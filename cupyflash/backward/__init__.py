"""The backward pass (FlashAttention-2, arXiv 2307.08691, Sec. 3.2 and Algorithm 2): the kernel
table and plan (:mod:`.kernels`) and the eager calls (:mod:`.run`). The public functions are
:func:`cupyflash.flash_attn_backward` and :func:`cupyflash.flash_attn_varlen_backward`
(:mod:`cupyflash.api`); torch callers get them through autograd (:mod:`cupyflash.torch_ops`).
"""
