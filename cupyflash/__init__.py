"""cupyflash: FlashAttention as readable CUDA C, JIT-compiled through CuPy, with a NumPy reference.

Public API
----------
flash_attn_func, flash_attn_varlen_func : tiled prefill (FlashAttention-2, arXiv 2307.08691);
                                          differentiable for torch callers
flash_attn_backward, flash_attn_varlen_backward : their gradients (FlashAttention-2 backward)
flash_attn_with_kvcache, merge_states   : split-KV decode (Flash-Decoding) and its exact merge
check_errors                            : raise what the decode calls' device-side checks found
explain, explain_varlen, explain_kvcache : the dispatch plan of a call, as data (no GPU needed)
attention_baseline                      : the materialising baseline (S x S scores in memory)
reference                               : NumPy float64 / online-softmax reference (no GPU needed)
testing                                 : Hypothesis strategies for fuzzing kernels against it
                                          (needs hypothesis: the ``test`` extra)
io_model                                : HBM bytes and FLOPs of each path (pure)

Packages: ``forward`` (the prefill path: kernel table, heuristics, planner), ``decode`` (the
split-KV path: public calls, kernels, planner, heuristics), ``core`` (checks, interop, JIT,
launches, tensor maps, plans, the launch cache), ``backward`` (the backward pass: kernel table,
eager calls).

torch_ops                               : the calls as torch.library custom ops (torch.compile,
                                          CUDA graphs); imports torch
hf                                      : register() makes "cupyfa" an attention implementation
                                          of Hugging Face transformers; imports transformers

CuPy is imported lazily: ``import cupyflash`` and the reference work on a machine without a GPU.
"""
__version__ = "0.1.0"

import importlib

_LAZY = {"flash_attn_func": "api", "flash_attn_varlen_func": "api", "explain": "api",
         "flash_attn_backward": "api", "flash_attn_varlen_backward": "api",
         "explain_varlen": "api",
         "flash_attn_with_kvcache": "decode", "merge_states": "decode", "explain_kvcache": "decode",
         "attention_baseline": "baseline", "check_errors": "core.guard",
         "reference": None, "testing": None, "io_model": None, "baseline": None, "api": None,
         "core": None, "forward": None, "decode": None, "backward": None,
         "torch_ops": None, "hf": None}


def __getattr__(name):  # PEP 562: submodules load on first use
    if name in _LAZY:
        mod = _LAZY[name]
        value = (importlib.import_module(f".{name}", __name__) if mod is None
                 else getattr(importlib.import_module(f".{mod}", __name__), name))
        globals()[name] = value  # later lookups find it here: no import machinery per call
        return value
    raise AttributeError(f"module 'cupyflash' has no attribute {name!r}")

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_backward",
           "flash_attn_varlen_backward", "flash_attn_with_kvcache", "merge_states",
           "explain", "explain_varlen", "explain_kvcache", "check_errors", "attention_baseline",
           "reference", "io_model", "core", "forward", "decode", "backward", "__version__"]


def __dir__():  # tab completion and pydoc: every name that imports without torch
    return sorted(set(globals()) | set(__all__))
