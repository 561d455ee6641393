"""The prefill (forward) path: the supported kernel table, specialisation names and launch
geometry (:mod:`.kernels`), the tile heuristics (:mod:`.heuristics`) and the planner and launch
cache entries (:mod:`.dispatch`). The public calls are :func:`cupyflash.flash_attn_func` and
:func:`cupyflash.flash_attn_varlen_func` (:mod:`cupyflash.api`); the kernels are
``kernels_cu/forward/``."""
