"""The host's kernel parameter structs (cupyflash/core/params.py) have the C structs' layout
(kernels_cu/common/params.cuh): NVRTC compiles (no GPU needed) a probe kernel that compares every
field's offset with the host's and stores a flag for each one that differs (the comparisons of
constants fold away when they hold, so its PTX then stores nothing), and ``static_assert``s every
struct's size. A field added on one side only fails here."""
import ctypes
import re

import pytest

from cupyflash.core import jit, params

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")


def _fields(struct: type, prefix: str = "", base: int = 0) -> list:
    """``[(C member path, host offset)]`` of every field, nested structs flattened."""
    out = []
    for name, ftype in struct._fields_:
        if name == "_pad":
            continue
        off = base + getattr(struct, name).offset
        out.append((prefix + name, off))
        if isinstance(ftype, type) and issubclass(ftype, ctypes.Structure) \
                and ftype is not params.TensorMap:
            out += _fields(ftype, f"{prefix}{name}.", off)
    return out


def layout_mismatches(structs: dict) -> list:
    """The ``Struct.field`` names (and ``sizeof Struct``) whose host offset (size) differs from
    the C definition's."""
    checks, names, sizes = [], [], []
    for cname, struct in structs.items():
        sizes.append(f"static_assert(sizeof(cf::{cname}) == {ctypes.sizeof(struct)}, "
                     f"\"sizeof {cname}\");")
        for path, off in _fields(struct):
            checks.append(f"    if ((unsigned long long)&((cf::{cname}*)0)->{path} != {off}ull) "
                          f"bad[{len(names)}] = 1;")
            names.append(f"{cname}.{path}")
    src = ('#include "common/params.cuh"\n' + "\n".join(sizes) + "\n"
           'extern "C" __global__ void cf_layout_probe(int* bad) {\n' + "\n".join(checks) + "\n}\n")
    try:
        ptx = jit.check_compiles(src)
    except jit.KernelSourceError as e:
        return sorted(set(re.findall(r"\"(sizeof \w+)\"", str(e)))) or [str(e)]
    stores = re.findall(r"st\.global\.\w+\s+\[%rd\d+(?:\+(\d+))?\]", ptx)
    return [names[int(o or 0) // 4] for o in stores]


def test_host_structs_match_the_kernel_headers():
    assert layout_mismatches(params.STRUCTS) == []


def test_the_check_fails_on_a_wrong_layout():
    """The check above can fail: a host struct with two fields swapped, and one of the wrong
    size, are caught."""
    swapped = type("FwdParams", (ctypes.Structure,), {"_fields_": [
        ("k", ctypes.c_uint64), ("q", ctypes.c_uint64)] + params.FwdParams._fields_[2:]})
    assert layout_mismatches({"FwdParams": swapped}) == ["FwdParams.k", "FwdParams.q"]
    short = type("MergeParams", (ctypes.Structure,), {"_fields_": params.MergeParams._fields_[:-1]})
    assert layout_mismatches({"MergeParams": short}) == ["sizeof MergeParams"]


def test_pointer_blocks_are_consecutive():
    assert params.pointer_fields(params.FwdParams, ("q", "k", "v", "o", "lse", "cu_seqlens_q",
                                                    "cu_seqlens_k")) == (0, 7)
    assert params.pointer_fields(params.DecodeParams, ("q", "k", "v", "cache_seqlens",
                                                       "block_table", "o", "lse", "o_part",
                                                       "ml_part", "counters")) == (0, 10)
    with pytest.raises(ValueError, match="consecutive"):
        params.pointer_fields(params.FwdParams, ("q", "v"))
