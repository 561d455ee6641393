"""Kernel sources -> compiled kernels.

Two paths share one preprocessed source string:

* ``compile_report(spec, arch)`` calls NVRTC directly (no GPU needed) and returns the cubin and
  the parsed ``--ptxas-options=-v`` report (registers, shared memory, spills). CPU tests use it to
  build every specialisation for sm_80 and sm_90a; ``explain()`` uses it for the register report.
* ``get_kernel(spec)`` compiles through CuPy (``cupy.RawModule``), so CuPy's in-memory and on-disk
  caches apply. CuPy keys its disk cache by the source string only, so every ``#include "..."`` of
  our own headers is inlined first (with ``#line`` markers so that compiler errors and profilers
  point at the real file): editing a header changes the key. CuPy compiles for ``sm_<cc>`` of the
  device and has no way to ask for an architecture-specific target, so a spec that needs one
  (``KernelSpec.arch``, e.g. ``"sm_90a"`` for wgmma) is compiled here with NVRTC, the cubin kept
  in CuPy's cache folder (keyed by source, entry, options and NVRTC version), and loaded with
  ``cupy.RawModule(path=...)``.

Specialisations are C++ template instantiations named by a ``KernelSpec``: its ``name`` is the
readable cache key / log line / profiler label, its ``entry`` the C++ name expression.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import re
from pathlib import Path

from . import deps

__all__ = [
    "KernelSpec", "PtxasReport", "CompileResult", "kernels_dir", "preprocess", "preprocess_text",
    "check_compiles", "constants", "include_dirs",
    "compile_report", "parse_ptxas", "get_kernel", "get_kernels", "KernelSourceError",
]


class KernelSourceError(RuntimeError):
    """The kernel sources could not be found or did not compile."""


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One compiled specialisation.

    name : readable deterministic name, e.g. ``fwd_bf16_hd128_m128_n64_w4_causal``.
    source : path of the ``.cu`` file relative to ``kernels_cu/``.
    entry : C++ name expression of the ``__global__`` function, e.g.
        ``"cf::flash_fwd_entry<cf::FlashFwd<__nv_bfloat16, 128, 128, 64, 4, true>, __nv_bfloat16>"``.
    smem_bytes : dynamic shared memory the launch needs (raised on the function if > 48 KiB).
    arch : ``""`` (CuPy compiles for the device's ``sm_<cc>``), or the one target the kernel
        needs, e.g. ``"sm_90a"`` (wgmma); such a spec runs only on that architecture.
    """
    name: str
    source: str
    entry: str
    smem_bytes: int = 0
    arch: str = ""


@dataclasses.dataclass(frozen=True)
class PtxasReport:
    registers: int
    shared_bytes: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int

    @property
    def spill_bytes(self) -> int:
        return self.spill_stores + self.spill_loads


@dataclasses.dataclass(frozen=True)
class CompileResult:
    spec: KernelSpec
    arch: str
    cubin: bytes
    lowered_name: str
    ptxas: PtxasReport
    log: str


# ----------------------------------------------------------------------------------------------
# Locating and preprocessing the sources
# ----------------------------------------------------------------------------------------------
def kernels_dir() -> Path:
    """The folder holding the ``.cu``/``.cuh`` sources.

    Tried in order: ``$CUPYFLASH_KERNELS_DIR``; the data sub-package ``cupyflash/kernels_cu``
    (installed wheel); ``kernels_cu/`` beside the package (source checkout, editable install).

    Raises
    ------
    KernelSourceError
        If none exists, listing every path tried.
    """
    here = Path(__file__).resolve().parent.parent  # the cupyflash package
    tried = []
    env = os.environ.get("CUPYFLASH_KERNELS_DIR")
    candidates = ([Path(env)] if env else []) + [here / "kernels_cu", here.parent / "kernels_cu"]
    try:  # editable installs map the data package elsewhere; ask the import system too
        import importlib.util
        s = importlib.util.find_spec("cupyflash.kernels_cu")
        if s is not None and s.submodule_search_locations:
            candidates += [Path(p) for p in s.submodule_search_locations]
    except Exception:  # pragma: no cover - best effort only
        pass
    for c in candidates:
        tried.append(str(c))
        if (c / "common").is_dir():
            return c
    raise KernelSourceError("cupyflash: kernel sources (kernels_cu/) not found; tried: "
                            + ", ".join(tried))


_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def preprocess(source: str) -> str:
    """Return ``source`` (relative to ``kernels_cu/``) with our own headers inlined.

    ``#include "x.cuh"`` is resolved relative to the including file, then to ``kernels_cu/``;
    ``#pragma once`` is honoured; ``#include <...>`` is left for NVRTC's include path.
    """
    root = kernels_dir()
    return _preprocess_cached(str(root), source, _tree_mtime(root))


def _tree_mtime(root: Path) -> float:
    return max((p.stat().st_mtime for p in root.rglob("*.cu*")), default=0.0)


@functools.lru_cache(maxsize=None)
def _preprocess_cached(root: str, source: str, _mtime: float, text: str | None = None) -> str:
    rootp = Path(root)
    seen: set[Path] = set()
    out: list[str] = []

    def emit_lines(lines, path: Path, rel: str) -> None:
        for i, line in enumerate(lines, start=1):
            m = _INCLUDE_RE.match(line)
            if m:
                inc = m.group(1)
                cand = [path.parent / inc, rootp / inc]
                found = next((c for c in cand if c.is_file()), None)
                if found is None:
                    raise KernelSourceError(f"{rel}:{i}: cannot find header {inc!r}")
                emit(found)
                out.append(f'#line {i + 1} "kernels_cu/{rel}"')
            elif re.match(r"^\s*#\s*pragma\s+once", line):
                out.append("")
            else:
                out.append(line)

    def emit(path: Path) -> None:
        path = path.resolve()
        if path in seen:
            return
        text = path.read_text()
        if re.search(r"^\s*#\s*pragma\s+once", text, re.M):
            seen.add(path)
        rel = path.relative_to(rootp.resolve()).as_posix()
        out.append(f'#line 1 "kernels_cu/{rel}"')
        emit_lines(text.splitlines(), path, rel)

    if text is not None:  # a source given as text, its includes resolved from kernels_cu/
        out.append(f'#line 1 "{source}"')
        emit_lines(text.splitlines(), rootp / source, source)
        return "\n".join(out) + "\n"
    p = rootp / source
    if not p.is_file():
        raise KernelSourceError(f"kernel source {source!r} not found under {rootp}")
    emit(p)
    return "\n".join(out) + "\n"


def preprocess_text(text: str, name: str = "probe.cu") -> str:
    """:func:`preprocess` of a source given as ``text`` (its ``#include "..."`` resolved from
    ``kernels_cu/``)."""
    root = kernels_dir()
    return _preprocess_cached(str(root), name, _tree_mtime(root), text)


_PROBE_RE = re.compile(r"\.global \.align \d+ \.(b8|u64|b64|s64) cf_probe\[(\d+)\] = \{([^}]*)\}")


def constants(source: str, exprs: tuple, arch: str = "compute_80") -> tuple:
    """The values of integral constant expressions over a kernel source's templates, e.g.
    ``("cf::HopperFwdSmem<...>::kBytes",)``: NVRTC compiles the source with a probe array of
    them to PTX (no GPU needed) and the values are read from it. The host's one way of learning a
    kernel's layout (shared-memory sizes, flags): the C++ definition is the only one.

    Cached per process and on disk (beside CuPy's kernel cache, keyed by the preprocessed source,
    the expressions and the NVRTC version), so a warm call costs a dictionary lookup.

    Raises
    ------
    KernelSourceError
        NVRTC refused the probe (the message holds its log), or the probe is not in its PTX.
    """
    code = preprocess(source)
    return _constants_cached(code, tuple(exprs), arch)


@functools.lru_cache(maxsize=None)
def _constants_cached(code: str, exprs: tuple, arch: str) -> tuple:
    import json
    probe = (code + '\nextern "C" __device__ const long long cf_probe[] = {'
             + ", ".join(f"(long long)({e})" for e in exprs) + "};\n")
    nvrtc_version = "?"
    try:
        nvrtc_version = repr(deps.nvrtc("compiling a probe with NVRTC").getVersion())
    except Exception:  # noqa: BLE001 - reported by the compile below
        pass
    digest = hashlib.sha256("\n".join([probe, arch, nvrtc_version]).encode()).hexdigest()
    folder = Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))
    path = folder / f"cupyflash_probe_{digest}.json"
    try:
        return tuple(json.loads(path.read_text()))
    except (OSError, ValueError):
        pass
    ptx = _compile_ptx(probe, arch)
    m = _PROBE_RE.search(ptx)
    if m is None or int(m.group(2)) != (len(exprs) * 8 if m.group(1) == "b8" else len(exprs)):
        raise KernelSourceError("constants: the probe array is not in the PTX:\n" + ptx[-2000:])
    vals = [int(x, 0) for x in m.group(3).replace(" ", "").split(",") if x]
    if m.group(1) == "b8":  # (PTX leaves out the trailing zero bytes)
        raw = bytes(v & 0xFF for v in vals).ljust(8 * len(exprs), b"\0")
        vals = [int.from_bytes(raw[8 * i:8 * i + 8], "little", signed=True)
                for i in range(len(exprs))]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(vals))
        os.replace(tmp, path)
    except OSError:  # a read-only cache folder: compile again next process
        pass
    return tuple(vals)


def check_compiles(text: str, arch: str = "compute_80") -> str:
    """Compile the source ``text`` (includes from ``kernels_cu/``) to PTX with NVRTC (no GPU
    needed) and return the PTX: compile-time checks such as ``static_assert``s over the kernels'
    headers.

    Raises
    ------
    KernelSourceError
        NVRTC refused the source (the message holds its log)."""
    return _compile_ptx(preprocess_text(text), arch)


def _compile_ptx(code: str, arch: str) -> str:
    """PTX of a preprocessed source for ``arch`` (NVRTC; KernelSourceError on failure)."""
    with _nvrtc_program(code, "probe.cu", "compiling a probe with NVRTC") as (nvrtc, prog):
        _nvrtc_compile(nvrtc, prog, [f"--gpu-architecture={arch}"], (), f"({arch})")
        ptx = nvrtc.getPTX(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


@contextlib.contextmanager
def _nvrtc_program(code: str, name: str, need: str):
    """``(nvrtc, program)`` for ``code``, destroyed on exit; the first NVRTC call of a process
    loads the library, and a failure to load it is raised as :func:`deps.nvrtc_failure`."""
    nvrtc = deps.nvrtc(need)
    try:
        prog = nvrtc.createProgram(code, name, [], [])
    except nvrtc.NVRTCError:
        raise
    except Exception as e:  # noqa: BLE001 - CuPy found no libnvrtc (DynamicLibNotFoundError, ...)
        raise deps.nvrtc_failure(e) from e
    try:
        yield nvrtc, prog
    finally:
        nvrtc.destroyProgram(prog)


def _nvrtc_compile(nvrtc, prog, options: list, extra: tuple, what: str) -> None:
    """Compile ``prog`` with BASE_OPTIONS, ``options``, the include folders and ``extra``;
    KernelSourceError with NVRTC's log when it refuses."""
    opts = list(BASE_OPTIONS) + options + [f"-I{d}" for d in include_dirs()] + list(extra)
    try:
        nvrtc.compileProgram(prog, opts)
    except nvrtc.NVRTCError as e:
        raise KernelSourceError(f"NVRTC failed {what}: {e}\n"
                                + nvrtc.getProgramLog(prog)) from None


def include_dirs() -> list[str]:
    """Folders holding ``cuda_fp16.h``/``cuda_bf16.h`` for NVRTC (it has no default path).

    pip's ``nvidia-cuda-runtime`` (``nvidia/cu13/include``, ``nvidia/cuda_runtime/include``),
    then ``$CUDA_PATH/include``, ``$CUDA_HOME/include``, ``/usr/local/cuda/include``.
    """
    dirs: list[str] = []
    try:
        import nvidia  # namespace package of pip's CUDA wheels
        for base in nvidia.__path__:
            for sub in ("cu13/include", "cu12/include", "cuda_runtime/include"):
                d = Path(base) / sub
                if (d / "cuda_fp16.h").is_file():
                    dirs.append(str(d))
    except ImportError:
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            dirs.append(os.path.join(os.environ[env], "include"))
    dirs.append("/usr/local/cuda/include")
    return [d for d in dict.fromkeys(dirs) if os.path.isfile(os.path.join(d, "cuda_fp16.h"))]


BASE_OPTIONS = ("-std=c++17", "-default-device", "-DCUPYFLASH_NVRTC=1")
#: What CuPy adds to every NVRTC compile of ours (cupy/cuda/compiler.py); added here too, so that
#: the ptxas reports and the directly compiled cubins match what CuPy builds.
CUPY_IMPLICIT_OPTIONS = ("-ftz=true",)


# ----------------------------------------------------------------------------------------------
# Direct NVRTC compile (no GPU needed): cubin + ptxas report
# ----------------------------------------------------------------------------------------------
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(log: str, lowered_name: str | None = None) -> PtxasReport:
    """Parse the ``--ptxas-options=-v`` report of one entry function (the first if unnamed)."""
    block = log
    if lowered_name and f"'{lowered_name}'" in log:
        start = log.index(f"Compiling entry function '{lowered_name}'")
        nxt = log.find("Compiling entry function", start + 1)
        block = log[start:nxt if nxt >= 0 else None]
    regs = _PTXAS_REGS.search(block)
    smem = _PTXAS_SMEM.search(block)
    spill = _PTXAS_SPILL.search(block)
    if regs is None or spill is None:
        raise KernelSourceError("could not parse the ptxas report:\n" + log)
    return PtxasReport(registers=int(regs.group(1)), shared_bytes=int(smem.group(1)) if smem else 0,
                       stack_bytes=int(spill.group(1)), spill_stores=int(spill.group(2)),
                       spill_loads=int(spill.group(3)))


@functools.lru_cache(maxsize=None)
def _compile_report_cached(code: str, entry: str, arch: str, options: tuple) -> tuple:
    need = "compiling a kernel with NVRTC (explain() does, for its register report)"
    with _nvrtc_program(code, "cupyflash.cu", need) as (nvrtc, prog):
        nvrtc.addNameExpression(prog, entry)
        _nvrtc_compile(nvrtc, prog, list(CUPY_IMPLICIT_OPTIONS)
                       + [f"--gpu-architecture={arch}", "--ptxas-options=-v"], options,
                       f"for {entry} ({arch})")
        log = nvrtc.getProgramLog(prog)
        lowered = nvrtc.getLoweredName(prog, entry)
        cubin = nvrtc.getCUBIN(prog)
    return cubin, lowered, log


def compile_report(spec: KernelSpec, arch: str = "sm_90a", options: tuple = ()) -> CompileResult:
    """Compile ``spec`` with NVRTC for ``arch`` (no GPU needed) and parse the ptxas report.

    Raises
    ------
    ImportError
        :class:`cupyflash.core.deps.MissingDependency`: CuPy or the NVRTC library is missing
        (the message names the package and ``pip install 'cupyflash[cuda13]'`` /
        ``'cupyflash[cuda12]'``).
    KernelSourceError
        The sources are not found, or NVRTC rejected them (with NVRTC's log).
    """
    code = preprocess(spec.source)
    cubin, lowered, log = _compile_report_cached(code, spec.entry, arch, tuple(options))
    return CompileResult(spec=spec, arch=arch, cubin=cubin, lowered_name=lowered,
                         ptxas=parse_ptxas(log, lowered), log=log)


# ----------------------------------------------------------------------------------------------
# GPU path: CuPy RawModule (CuPy's own caches)
# ----------------------------------------------------------------------------------------------
_KERNELS: dict = {}


def get_kernel(spec: KernelSpec, options: tuple = ()):
    """The ``cupy.RawKernel`` for ``spec`` on the current device (compiled once per process;
    CuPy's disk cache keeps it across processes). Raises its dynamic shared-memory limit to
    ``spec.smem_bytes`` when that is above 48 KiB.

    Raises
    ------
    ImportError
        :class:`cupyflash.core.deps.MissingDependency`: CuPy or the NVRTC library is missing.
    """
    cupy = deps.cupy("launching a kernel")
    dev = cupy.cuda.runtime.getDevice()  # (cheaper than cupy.cuda.Device().id)
    key = (spec, tuple(options), dev)
    k = _KERNELS.get(key)
    if k is None:
        code = preprocess(spec.source)
        if spec.arch:
            k = _arch_kernel(spec, code, tuple(options))
        else:
            opts = BASE_OPTIONS + tuple(f"-I{d}" for d in include_dirs()) + tuple(options)
            mod = cupy.RawModule(code=code, options=opts, name_expressions=[spec.entry])
            try:  # (compiles here)
                k = mod.get_function(spec.entry)
            except cupy.cuda.compiler.CompileException:
                raise
            except Exception as e:  # noqa: BLE001
                if "nvrtc" not in str(e).lower():
                    raise
                raise deps.nvrtc_failure(e, "launching a kernel") from e  # no libnvrtc
        if spec.smem_bytes > 48 * 1024:
            k.max_dynamic_shared_size_bytes = spec.smem_bytes
        _KERNELS[key] = k
    return k


def get_kernels(specs) -> dict:
    """:func:`get_kernel` for every spec, in a thread pool (NVRTC releases the GIL) on the current
    device: compiles them into this process and CuPy's disk cache, so later launches and other
    processes load them. A spec that fails is reported, not raised (the launch that needs it
    raises again).

    Returns
    -------
    dict
        ``specs`` (how many), ``seconds`` (wall time) and ``failed`` (``"name: error"`` strings).
    """
    import time
    from concurrent.futures import ThreadPoolExecutor
    cupy = deps.cupy("compiling kernels")
    specs = list(specs)
    dev = cupy.cuda.runtime.getDevice()

    def build(spec):
        try:
            with cupy.cuda.Device(dev):
                get_kernel(spec)
            return None
        except Exception as e:  # noqa: BLE001 - reported; the launch raises it again
            return f"{spec.name}: {type(e).__name__}: {str(e)[:300]}"
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, min(len(specs), os.cpu_count() or 1))) as pool:
        failed = [f for f in pool.map(build, specs) if f]
    return {"specs": len(specs), "seconds": round(time.perf_counter() - t0, 1), "failed": failed}


def _arch_kernel(spec: KernelSpec, code: str, options: tuple):
    """``cupy.RawKernel`` of a spec with its own target (``spec.arch``): NVRTC cubin, cached on
    disk beside CuPy's kernels as ``cupyflash_<sha256>.cubin`` (+ ``.name``, the lowered name)."""
    cupy = deps.cupy("launching a kernel")
    nvrtc = deps.nvrtc("launching a kernel")
    cc = cupy.cuda.Device().compute_capability
    if spec.arch.rstrip("a") != f"sm_{cc}":
        raise KernelSourceError(f"{spec.name} is built for {spec.arch} only; the current device is "
                                f"sm_{cc}")
    try:  # the first NVRTC call of the process loads the library
        version = nvrtc.getVersion()
    except Exception as e:  # noqa: BLE001 - CuPy found no libnvrtc
        raise deps.nvrtc_failure(e, "launching a kernel") from e
    ident = "\n".join([code, spec.entry, spec.arch, repr(options), repr(version),
                       repr(BASE_OPTIONS + CUPY_IMPLICIT_OPTIONS)])
    digest = hashlib.sha256(ident.encode()).hexdigest()
    folder = Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))
    cubin_path, name_path = folder / f"cupyflash_{digest}.cubin", folder / f"cupyflash_{digest}.name"
    if not (cubin_path.is_file() and name_path.is_file()):
        cubin, lowered, _ = _compile_report_cached(code, spec.entry, spec.arch, options)
        folder.mkdir(parents=True, exist_ok=True)
        for path, data in ((cubin_path, cubin), (name_path, lowered.encode())):
            tmp = path.with_suffix(path.suffix + f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)  # atomic: concurrent processes never read half a file
    mod = cupy.RawModule(path=str(cubin_path))
    return mod.get_function(name_path.read_text())
