"""cupyflash: FlashAttention as readable CUDA C, JIT-compiled through CuPy, with a NumPy reference.

Public API
----------
flash_attn_func, flash_attn_varlen_func : tiled prefill (FlashAttention-2, arXiv 2307.08691)
flash_attn_with_kvcache, merge_states   : split-KV decode (Flash-Decoding) and its exact merge
check_errors                            : raise what the decode calls' device-side checks found
explain, explain_varlen, explain_kvcache : the dispatch plan of a call, as data (no GPU needed)
attention_baseline                      : the materialising baseline (S x S scores in memory)
reference                               : NumPy float64 / online-softmax reference (no GPU needed)
testing                                 : Hypothesis strategies for fuzzing kernels against it
decode                                  : decode planning and workspaces (workspace_size,
                                          alloc_workspace, launch_config, plan_decode), from
                                          decode_plan and decode_kernels (specialisations)

torch_ops                               : the calls as torch.library custom ops (torch.compile,
                                          CUDA graphs); imports torch
hf                                      : register() makes "cupyfa" an attention implementation
                                          of Hugging Face transformers

CuPy is imported lazily: ``import cupyflash`` and the reference work on a machine without a GPU.
"""
__version__ = "0.1.0"

import importlib

_LAZY = {"flash_attn_func": "api", "flash_attn_varlen_func": "api", "explain": "api",
         "explain_varlen": "api",
         "flash_attn_with_kvcache": "decode", "merge_states": "decode", "explain_kvcache": "decode",
         "attention_baseline": "baseline", "check_errors": "guard",
         "reference": None, "checks": None, "testing": None, "dispatch": None, "heuristics": None, "prefill": None,
         "decode": None, "decode_plan": None, "decode_kernels": None, "baseline": None,
         "io_model": None, "jit": None, "guard": None, "interop": None,
         "torch_ops": None, "hf": None}


def __getattr__(name):  # PEP 562: submodules load on first use
    if name in _LAZY:
        mod = _LAZY[name]
        value = (importlib.import_module(f".{name}", __name__) if mod is None
                 else getattr(importlib.import_module(f".{mod}", __name__), name))
        globals()[name] = value  # later lookups find it here: no import machinery per call
        return value
    raise AttributeError(f"module 'cupyflash' has no attribute {name!r}")

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "merge_states",
           "explain", "explain_varlen", "explain_kvcache", "check_errors", "attention_baseline",
           "reference", "checks", "testing", "__version__"]


def __dir__():  # tab completion sees the lazy names too
    return sorted(set(globals()) | set(_LAZY) | set(__all__))
