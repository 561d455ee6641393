"""A missing optional dependency is named, with the pip command that installs it.

``pip install cupyflash`` (no extras) installs NumPy only. Every path that needs CuPy, its NVRTC
or cuBLAS binding, ml_dtypes or Hypothesis must then raise an ImportError that names the missing
package and the extras (``cupyflash[cuda13]`` / ``cupyflash[cuda12]``), not a bare ``No module
named 'cupy_backends'``. Simulated in subprocesses whose import system refuses those modules.
"""
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import cupyflash

ROOT = Path(cupyflash.__file__).resolve().parent

_BLOCK = """
import json, sys
import numpy as np
BLOCKED = {blocked!r}
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
for m in list(sys.modules):
    if m.split('.')[0] in BLOCKED:
        del sys.modules[m]

class FakeCuda:  # a device array as far as the checks can tell (CUDA array interface)
    def __init__(self, shape, dtype=np.float16):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.__cuda_array_interface__ = {{"shape": self.shape, "typestr": self.dtype.str,
                                          "data": (0, False), "version": 3, "strides": None}}

results = {{}}
def attempt(label, fn):
    try:
        fn()
        results[label] = None
    except ImportError as e:
        results[label] = ["ImportError", str(e)]
    except Exception as e:
        results[label] = [type(e).__name__, str(e)]
"""


def _run(blocked, body: str) -> dict:
    code = _BLOCK.format(blocked=tuple(blocked)) + body + "\nprint(json.dumps(results))\n"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT.parent, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_without_cupy_every_cuda_path_names_the_extras():
    """Without CuPy (``pip install .``): the explain calls (they compile for the ptxas report),
    the kernel cache, the views of device arrays, the calls and the baseline each raise an
    ImportError naming CuPy's packages and both extras."""
    body = """
import cupyflash
from cupyflash import decode
from cupyflash.core import checks, interop, jit
from cupyflash.forward import kernels
q = np.zeros((1, 64, 4, 64), np.float16)
k = np.zeros((1, 64, 2, 64), np.float16)
cu = np.array([0, 64], np.int32)
attempt("explain", lambda: cupyflash.explain(q, k, k))
attempt("explain_varlen", lambda: cupyflash.explain_varlen(q[0], k[0], k[0], cu, cu, 64, 64))
attempt("explain_kvcache", lambda: cupyflash.explain_kvcache(q[:, :1], k, k, cache_seqlens=[3]))
attempt("get_kernel", lambda: jit.get_kernel(kernels.all_specs()[0]))
attempt("as_cupy", lambda: interop.as_cupy(FakeCuda(q.shape), "q"))
attempt("to_host", lambda: checks.to_host(FakeCuda((3,), np.int32)))
attempt("flash_attn_func", lambda: cupyflash.flash_attn_func(
    FakeCuda(q.shape), FakeCuda(k.shape), FakeCuda(k.shape)))
attempt("flash_attn_with_kvcache", lambda: cupyflash.flash_attn_with_kvcache(
    FakeCuda((1, 1, 4, 64)), FakeCuda(k.shape), FakeCuda(k.shape), cache_seqlens=[3]))
attempt("merge_states", lambda: cupyflash.merge_states(
    FakeCuda((2, 1, 1, 4, 64), np.float32), FakeCuda((2, 1, 4, 1), np.float32)))
attempt("alloc_workspace", lambda: decode.alloc_workspace(q[:, :1], k, k, cache_seqlens=[3]))
attempt("attention_baseline", lambda: cupyflash.attention_baseline(
    FakeCuda(q.shape), FakeCuda(k.shape), FakeCuda(k.shape)))
# what needs no CuPy still works
from cupyflash import reference
attempt("reference", lambda: reference.attention_reference(q, k, k))
"""
    res = _run(("cupy", "cupy_backends", "cupyx"), body)
    assert res.pop("reference") is None
    for label, got in res.items():
        assert got is not None, f"{label}: raised nothing"
        kind, msg = got
        assert kind == "ImportError", (label, got)
        for part in ("cupy-cuda13x", "cupy-cuda12x", "cupyflash[cuda13]", "cupyflash[cuda12]"):
            assert part in msg, (label, part, msg)
        assert "No module named" in msg, (label, msg)  # the original error is kept


def test_without_ml_dtypes_or_hypothesis_the_message_says_what_to_install():
    body = """
import cupyflash
from cupyflash.core import interop
attempt("bfloat16", lambda: interop.np_dtype("bfloat16"))
attempt("float16", lambda: interop.np_dtype("float16"))
attempt("testing", lambda: __import__("cupyflash.testing"))
q, kc = np.zeros((2, 1, 4, 64), np.float16), np.zeros((2, 16, 2, 64), np.float16)
attempt("float16 decode plan", lambda: cupyflash.explain_kvcache(  # (its rejected list names
    q, kc, kc, cache_seqlens=[3, 5], report=False))                # bfloat16 kernels too)
"""
    res = _run(("ml_dtypes", "hypothesis"), body)
    assert res["float16"] is None and res["float16 decode plan"] is None, res
    kind, msg = res["bfloat16"]
    assert kind == "ImportError" and "pip install ml_dtypes" in msg and "cupyflash[cuda13]" in msg
    kind, msg = res["testing"]
    assert kind == "ImportError" and "pip install hypothesis" in msg, msg


def test_missing_nvrtc_library_is_named(monkeypatch):
    """CuPy installed without the NVRTC library (``pip install cupy-cuda13x`` alone): the first
    NVRTC call fails to load ``libnvrtc``; the compile report names the package instead."""
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cupyflash.core import deps, jit
    from cupyflash.forward import kernels

    def no_library(*args, **kwargs):
        raise RuntimeError('Failure finding "libnvrtc.so.13 or libnvrtc.so.12": No such file')

    monkeypatch.setattr(nvrtc, "createProgram", no_library)
    spec = kernels.all_specs()[0]
    with pytest.raises(deps.MissingDependency, match=r"nvidia-cuda-nvrtc.*cupyflash\[cuda13\]"):
        jit._compile_report_cached.__wrapped__(jit.preprocess(spec.source), spec.entry,
                                               "sm_90a", ())


# Modules that import CuPy directly: each site runs only after a call on its path has already
# imported CuPy through cupyflash.core.deps (the kernel launchers receive compiled kernels and
# CuPy arrays), or catches every failure itself (planning._device_id: no CuPy means no device).
_DIRECT_IMPORTS_ALLOWED = {"core/launch.py", "core/tma.py", "forward/kernels.py",
                           "core/planning.py:_device_id"}
_OPTIONAL = ("cupy", "cupy_backends", "cupyx", "ml_dtypes", "hypothesis")


def test_optional_modules_are_imported_through_deps():
    """Every import of an optional dependency in the package goes through
    :mod:`cupyflash.core.deps` (which names the package to install), except the sites listed in
    ``_DIRECT_IMPORTS_ALLOWED``. torch is not listed: its callers hold torch tensors already."""
    found = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "core/deps.py" or rel in _DIRECT_IMPORTS_ALLOWED:
            continue
        tree = ast.parse(path.read_text())
        scope = {}  # import node -> name of the innermost function holding it
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    scope[node] = fn.name  # (inner functions are walked later: they win)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            where = f"{rel}:{scope[node]}" if node in scope else rel
            found += [f"{where}: import {n}" for n in names
                      if n.split(".")[0] in _OPTIONAL and where not in _DIRECT_IMPORTS_ALLOWED]
    assert not found, "import these through cupyflash.core.deps:\n" + "\n".join(sorted(set(found)))
