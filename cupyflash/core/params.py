"""The kernel parameter structs, as ctypes structures (host side of ``kernels_cu/common/params.cuh``).

Every kernel of the library takes one struct by value (``const __grid_constant__``); the host
fills one of these once per launch configuration (strides, sizes, scale: the constant fields)
and per call only its pointers (:class:`cupyflash.core.launch.Launch`). Field names and order
are the C struct's; ``tests/test_params.py`` compiles the offsets and sizes below against the C
definitions (NVRTC ``static_assert``), so the two sides cannot drift apart.

Pointers are ``c_uint64`` (a device address, 0 for NULL).
"""
from __future__ import annotations

import ctypes

__all__ = ["TensorMap", "FwdParams", "FwdTmaParams", "BwdParams", "BwdTmaParams", "DecodeParams", "DecodeAppendParams",
           "MergeParams", "BaselineSoftmaxParams", "STRUCTS", "pointer_fields"]

_P = ctypes.c_uint64
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32


class TensorMap(ctypes.Structure):
    """A ``CUtensorMap`` (``cuda.h``: 16 opaque 64-bit words, 64-byte aligned), the C side's
    ``cf::TmaDesc`` (``kernels_cu/common/tma.cuh``)."""
    _fields_ = [("words", ctypes.c_uint64 * 16)]


def _padded(name: str, fields: list, align: int):
    """A ctypes structure of ``fields`` whose size is rounded up to ``align`` bytes, as C rounds
    a struct holding a member of that alignment (ctypes aligns to 8 at most)."""
    size = ctypes.sizeof(type("_Probe", (ctypes.Structure,), {"_fields_": fields}))
    pad = -size % align
    return type(name, (ctypes.Structure,), {"_fields_": fields + ([("_pad", ctypes.c_char * pad)]
                                                                 if pad else [])})


class FwdParams(ctypes.Structure):
    """``cf::FwdParams``: the prefill forward (mma.sync and CUDA-core kernels; inside
    :class:`FwdTmaParams` for the Hopper kernel)."""
    _fields_ = ([(n, _P) for n in ("q", "k", "v", "o", "lse", "cu_seqlens_q", "cu_seqlens_k")]
                + [(f"{t}_{s}_stride", _I64) for t in ("q", "k", "v", "o")
                   for s in ("batch", "row", "head")]
                + [("lse_batch_stride", _I64), ("lse_head_stride", _I64)]
                + [(n, _I32) for n in ("batch", "nheads", "nheads_k", "h_per_kv", "seqlen_q",
                                       "seqlen_k", "headdim")]
                + [("scale_log2", ctypes.c_float), ("softmax_scale_d", ctypes.c_double),
                   ("window_left", _I32), ("window_right", _I32)])


FwdTmaParams = _padded("FwdTmaParams", [("tq", TensorMap), ("tk", TensorMap), ("tv", TensorMap),
                                        ("to", TensorMap), ("fwd", FwdParams),
                                        ("tile_counter", _P), ("o_map_ok", _I32)], 64)
FwdTmaParams.__doc__ = ("``cf::FwdTmaParams``: the Hopper forward's four tensor maps, "
                        ":class:`FwdParams`, the causal scheduler's counter and the O-map flag.")


class BwdParams(ctypes.Structure):
    """``cf::BwdParams``: the backward pass (``backward/*.cu``): its own pointers (``dq_accum``:
    the Hopper kernel's fp32 dQ accumulator, else NULL), the forward's :class:`FwdParams`, then
    the strides of dout, dq, dk, dv and dsum."""
    _fields_ = ([(n, _P) for n in ("dout", "dq", "dk", "dv", "dsum", "dq_accum")]
                + [("fwd", FwdParams)]
                + [(f"{t}_{s}_stride", _I64) for t in ("do", "dq", "dk", "dv")
                   for s in ("batch", "row", "head")]
                + [("dsum_batch_stride", _I64), ("dsum_head_stride", _I64)])


BwdTmaParams = _padded("BwdTmaParams", [("tq", TensorMap), ("tk", TensorMap), ("tv", TensorMap),
                                        ("tdo", TensorMap), ("bwd", BwdParams)], 64)
BwdTmaParams.__doc__ = ("``cf::BwdTmaParams``: the Hopper backward's four tensor maps (q, k, v, "
                        "dout) and :class:`BwdParams`.")


class DecodeParams(ctypes.Structure):
    """``cf::DecodeParams``: the split kernel of split-KV decode (``decode/split.cu``)."""
    _fields_ = ([(n, _P) for n in ("q", "k", "v", "cache_seqlens", "block_table", "o", "lse",
                                   "o_part", "ml_part", "counters", "check_claim",
                                   "check_record")]
                + [(f"{t}_{s}_stride", _I64) for t in ("q", "k", "v", "o")
                   for s in ("batch", "row", "head")]
                + [("lse_batch_stride", _I64), ("lse_head_stride", _I64),
                   ("block_table_batch_stride", _I64)]
                + [(n, _I32) for n in ("batch", "nheads", "nheads_k", "h_per_kv", "seqlen_q",
                                       "headdim", "seqlen_cache", "seqlen_new", "page_size",
                                       "page_shift", "num_pages", "num_splits", "split_tiles",
                                       "num_row_chunks", "grid_order", "causal")]
                + [("scale_log2", ctypes.c_float)])


class DecodeAppendParams(ctypes.Structure):
    """``cf::DecodeAppendParams``: the KV append of a decode call (``decode/append.cu``)."""
    _fields_ = ([(n, _P) for n in ("k_new", "v_new", "k_cache", "v_cache", "cache_seqlens",
                                   "block_table", "check_claim", "check_record")]
                + [(f"{t}_{s}_stride", _I64) for t in ("kn", "vn", "k", "v")
                   for s in ("batch", "row", "head")]
                + [("block_table_batch_stride", _I64)]
                + [(n, _I32) for n in ("seqlen_new", "nheads_k", "headdim", "seqlen_cache",
                                       "page_size", "num_pages")])


class MergeParams(ctypes.Structure):
    """``cf::MergeParams``: the merge of partial states (``decode/combine.cu``, merge_states)."""
    _fields_ = ([(n, _P) for n in ("o_part", "lse_part", "out", "lse_out")]
                + [(f"op_{s}_stride", _I64) for s in ("part", "batch", "row", "head")]
                + [(f"lp_{s}_stride", _I64) for s in ("part", "batch", "head", "row")]
                + [(f"o_{s}_stride", _I64) for s in ("batch", "row", "head")]
                + [("lse_batch_stride", _I64), ("lse_head_stride", _I64)]
                + [(n, _I32) for n in ("num_parts", "batch", "seqlen", "nheads", "headdim")])


class BaselineSoftmaxParams(ctypes.Structure):
    """``cf::BaselineSoftmaxParams``: the softmax pass of the materialising baseline."""
    _fields_ = ([("s", _P), ("p", _P), ("lse", _P), ("rows", _I64)]
                + [(n, _I32) for n in ("seqlen_q", "seqlen_k", "causal", "window_left",
                                       "window_right")]
                + [("softmax_scale", ctypes.c_double)])


#: ``{C struct name: ctypes structure}`` of every kernel parameter struct (tests/test_params.py).
STRUCTS = {"FwdParams": FwdParams, "FwdTmaParams": FwdTmaParams, "BwdParams": BwdParams,
           "BwdTmaParams": BwdTmaParams, "DecodeParams": DecodeParams,
           "DecodeAppendParams": DecodeAppendParams, "MergeParams": MergeParams,
           "BaselineSoftmaxParams": BaselineSoftmaxParams}


def pointer_fields(struct: type, names: tuple) -> tuple:
    """``(offset, count)`` of the consecutive pointer fields ``names`` of ``struct`` (the block
    a call writes at once).

    Raises
    ------
    ValueError
        The fields are not consecutive 64-bit fields in this order."""
    offs = [getattr(struct, n).offset for n in names]
    if any(getattr(struct, n).size != 8 for n in names) or \
            any(b - a != 8 for a, b in zip(offs, offs[1:])):
        raise ValueError(f"pointers: {names} are not consecutive 64-bit fields of "
                         f"{struct.__name__}")
    return offs[0], len(names)
