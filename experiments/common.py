"""Shared plumbing of the experiment scripts: provenance, results files, timing, torch peers,
memory, and running a script under Nsight Compute (:func:`find_ncu`, :func:`run_profiled`,
:func:`ncu_csv_rows`).

Results files (``experiments/results/<script>.jsonl``, JSON Lines) hold runs. A run (one process
of a script) first appends one header line, then its measurements::

    {"what": "run", "run": "2026-12-02T04:32:27Z-cbced6e", "script": "bench_prefill.py",
     "argv": ["--quick"], "provenance": {"commit": "cbced6e...", "date": ..., "gpu": ...}}
    {"run": "2026-12-02T04:32:27Z-cbced6e", "what": "prefill", "impl": "fa3", "ms": 1.23, ...}

(The runs converted from the older shape on 2026-12-02 have no ``script`` and ``argv``.)

* ``provenance`` is :func:`provenance`'s dict (git commit and ``dirty``, date, GPU name and SM
  count, CuPy / CUDA runtime / driver versions, torch and cuDNN when torch is importable),
  written once per run; a record names its run by ``run`` (the run's start, UTC to the second,
  and its short commit: :func:`run_id`). :func:`append_results` writes both;
  :func:`read_results` reads a file back as records that carry their run's ``commit``, ``gpu``,
  ``date`` and ``provenance`` again (a record's own fields win; records without ``run``, the
  shape before 2026-12-02, are returned as they are).
* A record names the plan that ran by ``plan_kernel`` (the chosen kernel's name;
  ``plan_extra_kernels`` when the plan launches more, ``plan_error`` when planning raised) and
  its run's commit: ``cupyflash.explain()`` at that commit, on the record's problem, gives the
  rest (grid, registers, reasons). The few plan fields that readers use are stored beside it
  under their own names (``num_splits_chosen``, ``measured_over_roofline``, ``block_m``...).
  :func:`plan_fields` makes them from :func:`explain_record`.
* Older runs, and the per-record provenance and ``explain`` dicts of every run before this
  shape, are at the annotated tag ``results-archive-2026-12-02``::

      git show results-archive-2026-12-02:experiments/results/bench_decode.jsonl
      git ls-tree -r --name-only results-archive-2026-12-02 experiments/results/

Timing (:func:`benchmark`) uses CUDA events around each call, on the current (default) stream,
and reports the median. Two habits keep the numbers honest:

* a *blocking* spin kernel is queued before the timed calls, so the host enqueues all of them
  while the GPU is still busy and the events measure device time, not Python launch overhead
  (the nvbench technique); functions that synchronise internally defeat this, and their
  records then include host time;
* ``flush_l2=True`` reads a 256 MB buffer between repetitions (the H200 has a 60 MB L2), so
  inputs that would fit in L2 are read from HBM each time, as in a real model step. A read
  leaves L2 holding clean lines. Until commit 58b7e3f (2026-11-29, NOTES v19) the flush *wrote*
  the buffer (``flush_l2="write"``, still available). That left up to 60 MB of dirty lines,
  which the timed call had to write back to HBM while it streamed: ~11 us (8%) of a 135 us
  decode over a 128k-key cache on the H200, for every implementation (experiments/NOTES.md v19).
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import datetime
import functools
import glob
import importlib.util
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python experiments/x.py` from anywhere
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "experiments" / "results"
FIGURES = ROOT / "experiments" / "figures"

__all__ = [
    "ROOT", "RESULTS", "FIGURES", "provenance", "append_jsonl", "read_jsonl", "jsonable",
    "run_id", "run_header", "append_results", "read_results", "read_runs", "plan_fields",
    "progress", "have_gpu", "have_torch", "benchmark", "random_normal", "random_qkv",
    "cupy_to_torch", "torch_sdpa", "sdpa_backend", "peak_extra_memory_cupy", "peak_extra_memory_torch",
    "explain_record", "free_memory", "impl_available", "available_impls", "median_round", "find_ncu",
    "run_profiled", "ncu_csv_rows", "ncu_failure",
]


# ------------------------------------------------------------------------------------------------
# Provenance and JSON Lines
# ------------------------------------------------------------------------------------------------
def _git(*args) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except Exception:
        return ""


@functools.lru_cache(maxsize=None)
def provenance() -> dict:
    """Where a result came from: ``commit`` (``$CUPYFLASH_COMMIT`` when set, else the tree's
    HEAD); ``dirty``, whether kernels_cu/, cupyflash/ or experiments/ differ from it (None when
    ``$CUPYFLASH_COMMIT`` is not the tree's HEAD, which is then kept as ``git_head``: the device
    machine's copy keeps a .git at an older commit than its files, so git status there lists the
    later commits' changes); date (UTC), GPU, SMs, L2, CuPy / CUDA / driver, torch."""
    head = _git("rev-parse", "--verify", "-q", "HEAD")
    given = os.environ.get("CUPYFLASH_COMMIT")
    info = {"commit": given or head or "unknown"}
    if given and head and given != head:
        info.update(dirty=None, git_head=head)
    else:
        info["dirty"] = bool(_git("status", "--porcelain", "--", "kernels_cu", "cupyflash",
                                  "experiments"))
    info.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                host_python=sys.version.split()[0])
    try:
        import cupy
        info["cupy"] = cupy.__version__
        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        name = props["name"]
        info.update(gpu=name.decode() if isinstance(name, bytes) else name,
                    sms=int(props["multiProcessorCount"]), cc=f"{props['major']}.{props['minor']}",
                    l2_bytes=int(props.get("l2CacheSize", 0)),
                    gpu_mem_bytes=int(props.get("totalGlobalMem", 0)),
                    cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(),
                    cuda_driver=cupy.cuda.runtime.driverGetVersion())
    except Exception as e:  # no GPU: say why
        info["gpu"] = f"none ({type(e).__name__}: {str(e)[:120]})"
    if have_torch():
        try:
            import torch
            info["torch"] = torch.__version__
            info["cudnn"] = torch.backends.cudnn.version() if torch.cuda.is_available() else None
        except Exception as e:  # pragma: no cover - broken torch install
            info["torch"] = f"error ({type(e).__name__})"
    return info


def jsonable(x):
    """``json.dumps`` default: dataclasses, NumPy scalars/arrays, tuples, paths, anything else as
    its ``str``."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.asdict(x)
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (set, frozenset)):
        return sorted(x)
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return str(x)


def append_jsonl(path, records) -> int:
    """Append ``records`` (a dict or an iterable of dicts) to ``path`` as JSON Lines; returns the
    number written. Creates the folder."""
    if isinstance(records, dict):
        records = [records]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r, default=jsonable) + "\n")
            n += 1
    return n


def read_jsonl(path) -> list:
    """Records of a JSON Lines file ([] if it does not exist; malformed lines skipped)."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


#: The per-record fields that a run's header holds instead (see the module docstring).
_RUN_FIELDS = ("commit", "gpu", "date")

_HEADERS = {}  # results file (resolved) -> run id whose header this process wrote there


def run_id(prov: dict) -> str:
    """A run's name: its start (UTC, to the second) and short commit, as
    ``2026-12-02T04:32:27Z-cbced6e``."""
    return f"{str(prov.get('date', ''))[:19]}Z-{str(prov.get('commit', 'unknown'))[:7]}"


def run_header(prov: dict | None = None) -> dict:
    """The header line of this process's run: ``what="run"``, ``run`` (:func:`run_id`),
    ``script`` and ``argv`` (how it was called) and ``provenance`` (``prov``, default
    :func:`provenance`)."""
    prov = provenance() if prov is None else prov
    return {"what": "run", "run": run_id(prov), "script": Path(sys.argv[0]).name,
            "argv": sys.argv[1:], "provenance": prov}


def append_results(path, records, provenance: dict | None = None) -> int:
    """Append measurement records (a dict or an iterable of dicts) to the results file
    ``path``, in the shape of the module docstring; returns the number of records written.

    The first call of a process for a file writes the run's header (:func:`run_header` with
    ``provenance``, default :func:`provenance`) before the records; every record gets the run's
    id as ``run``. A record's ``provenance`` and its ``commit`` and ``gpu`` when they equal the
    run's are not written (the header holds them)."""
    if isinstance(records, dict):
        records = [records]
    records = list(records)
    path = Path(path)
    key = str(path.resolve())
    head = run_header(provenance)
    prov = head["provenance"]
    lines = []
    if _HEADERS.get(key) != head["run"] or not path.is_file():
        lines.append(head)
    for r in records:
        r = {k: v for k, v in r.items()
             if k != "provenance" and not (k in ("commit", "gpu") and prov.get(k) == v)}
        lines.append({"run": head["run"], **r})
    append_jsonl(path, lines)
    _HEADERS[key] = head["run"]
    return len(records)


def read_runs(path) -> dict:
    """The run headers of a results file: ``{run id: header}`` (a later header with the same id
    wins)."""
    return {r["run"]: r for r in read_jsonl(path) if r.get("what") == "run" and "run" in r}


def read_results(path, what: str | None = None) -> list:
    """The measurement records of a results file, in file order ([] if it does not exist), each
    with its run's ``commit``, ``gpu`` and ``date`` and the run's ``provenance`` dict added
    where the record has no field of that name; run headers left out. ``what``: only records
    with that ``what``. Records without a known ``run`` (the shape before 2026-12-02, or
    hand-written files) are returned unchanged."""
    recs = read_jsonl(path)
    runs = {r["run"]: r for r in recs if r.get("what") == "run" and "run" in r}
    out = []
    for r in recs:
        if r.get("what") == "run" and "run" in r:
            continue
        if what is not None and r.get("what") != what:
            continue
        head = runs.get(r.get("run"))
        if head is not None:
            prov = head.get("provenance") or {}
            extra = {k: prov[k] for k in _RUN_FIELDS if k in prov and k not in r}
            if "provenance" not in r:
                extra["provenance"] = prov
            r = {**r, **extra}
        out.append(r)
    return out


def progress(iterable, **kw):
    """tqdm if installed, else the iterable itself."""
    try:
        from tqdm.auto import tqdm
        return tqdm(iterable, **kw)
    except ImportError:  # pragma: no cover
        return iterable


# ------------------------------------------------------------------------------------------------
# What is available
# ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def have_gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@functools.lru_cache(maxsize=None)
def have_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


def impl_available(name: str) -> tuple[bool, str]:
    """Whether an implementation can run here: ``(ok, why_not)``.

    Names: ``cupyflash`` (prefill), ``cupyflash_decode``, ``baseline``, ``torch_flash``,
    ``torch_cudnn``, ``torch_efficient``.
    """
    if not have_gpu():
        return False, "no CUDA GPU"
    if name == "fa3":
        try:
            importlib.import_module("fa3_fwd_interface")
        except Exception as e:  # the wheel is optional: ../shared/peers/README.md
            return False, f"fa3_fwd_interface does not import ({type(e).__name__}: {e})"
        return True, ""
    if name.startswith("torch_"):
        if not have_torch():
            return False, "torch is not installed"
        import torch
        if not torch.cuda.is_available():
            return False, "torch sees no CUDA device"
        return True, ""
    return True, ""


def median_round(rounds: list, key: str = "ms"):
    """The round (a dict) with the median ``key`` of ``rounds``: the lower middle one of an even
    number, so that it is always one of the rounds measured."""
    return sorted(rounds, key=lambda r: r[key])[(len(rounds) - 1) // 2]


def available_impls(names, who: str) -> list:
    """The names of ``names`` that :func:`impl_available` says can run here, in order; says
    ``"<who>: skipping <name>: <why>"`` for each of the others."""
    out = []
    for name in names:
        ok, why = impl_available(name)
        if ok:
            out.append(name)
        else:
            print(f"{who}: skipping {name}: {why}")
    return out


@contextlib.contextmanager
def decode_pdl(enabled: bool):
    """Run a block with ``cupyflash.decode.PDL`` (programmatic dependent launch of the decode
    kernels) set to ``enabled``, restoring the previous value; a no-op for a cupyflash without
    the switch. Reads the flag per call, so a timed closure may enter it on every call."""
    from cupyflash import decode
    if hasattr(decode, "pdl_launches"):
        with decode.pdl_launches(enabled):
            yield
        return
    if not hasattr(decode, "PDL"):
        yield
        return
    prev, decode.PDL = decode.PDL, enabled
    try:
        yield
    finally:
        decode.PDL = prev


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------
_SPIN_SRC = r"""
extern "C" __global__ void cupyflash_spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
"""


@functools.lru_cache(maxsize=None)
def _spin_kernel():
    import cupy
    return cupy.RawKernel(_SPIN_SRC, "cupyflash_spin")


_FLUSH = {}

_READ_FLUSH_SRC = r"""
extern "C" __global__ void cupyflash_read_flush(const uint4* __restrict__ buf, unsigned long long n,
                                                unsigned int* sink) {
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const uint4 x = buf[i];
        acc.x ^= x.x; acc.y ^= x.y; acc.z ^= x.z; acc.w ^= x.w;
    }
    // never true for the zero-filled buffer; keeps the loads from being optimised away
    if ((acc.x & acc.y & acc.z & acc.w) == 0xFFFFFFFFu) *sink = 1;
}
"""


@functools.lru_cache(maxsize=None)
def _read_flush_kernel():
    import cupy
    return cupy.RawKernel(_READ_FLUSH_SRC, "cupyflash_read_flush")


#: Dynamic shared memory per block of the ``"read_smem"`` flush: 4 blocks of 56 KB per SM ask
#: for the largest shared-memory carveout (228 KB on sm_90), as a GEMM before attention would.
_FLUSH_SMEM = 56 << 10


def flush_l2_cache(mode: str = "read") -> None:
    """Evict L2 before a timed call (enqueued on CuPy's current stream): ``"read"`` streams a
    256 MB buffer through it (L2 left holding clean lines), ``"write"`` fills the buffer (L2 left
    holding dirty lines, which the next kernel pays to write back), ``"read_smem"`` reads it
    with the same kernel launched with 56 KB of (unused) dynamic shared memory per block, so
    that the SMs leave the flush configured for the largest shared-memory carveout instead of
    the smallest (the plain read kernel uses none)."""
    if mode not in ("read", "write", "read_smem"):
        raise ValueError(f"mode: expected 'read', 'write' or 'read_smem', got {mode!r}")
    import cupy
    buf = _flush_buffer()
    if mode == "write":
        buf.fill(0)
        return
    key = ("sink", cupy.cuda.Device().id)
    if key not in _FLUSH:
        _FLUSH[key] = cupy.zeros(1, dtype=cupy.uint32)
    n = buf.nbytes // 16
    kern = _read_flush_kernel()
    if mode == "read_smem":
        kern.max_dynamic_shared_size_bytes = _FLUSH_SMEM
        kern((528,), (512,), (buf, np.uint64(n), _FLUSH[key]), shared_mem=_FLUSH_SMEM)
    else:
        kern((528,), (512,), (buf, np.uint64(n), _FLUSH[key]))


def _flush_buffer(nbytes=256 << 20):
    import cupy
    key = (cupy.cuda.Device().id, nbytes)
    if key not in _FLUSH:
        _FLUSH[key] = cupy.zeros(nbytes, dtype=cupy.uint8)
    return _FLUSH[key]


def benchmark(fn, *, n_warmup: int = 3, n_repeat: int = 20, flush_l2: bool | str = False,
              spin: bool = True, max_spin_ms: float = 500.0) -> dict:
    """Time ``fn()`` on the GPU with CUDA events; returns milliseconds.

    Parameters
    ----------
    fn : callable or list of callables
        A list is cycled through (rotating inputs: each callable closes over its own buffers).
    n_warmup, n_repeat : int
        Untimed and timed calls.
    flush_l2 : bool or str
        Evict L2 before each timed call (outside the events) with :func:`flush_l2_cache`:
        ``True`` or ``"read"`` reads a 256 MB buffer, ``"write"`` writes it (the method before
        commit 58b7e3f, 2026-11-29). The record's ``flush_l2`` says which (``"read"``, ``"write"`` or False).
    spin : bool
        Queue a spin kernel first so that host launch overhead does not leak into the device
        time (see the module docstring). Its length is sized from the measured host time of one
        call, capped at ``max_spin_ms``.

    Returns
    -------
    dict
        ``ms`` (median), ``ms_min``, ``ms_p20``, ``ms_p80``, ``n_repeat``, ``flush_l2``,
        ``host_ms`` (host time to enqueue one call).
    """
    import cupy
    fns = list(fn) if isinstance(fn, (list, tuple)) else [fn]
    mode = ("read" if flush_l2 is True else flush_l2) if flush_l2 else False
    if mode:
        flush_l2_cache(mode)  # validates the mode; allocates and compiles outside the timing
    for i in range(max(1, n_warmup)):
        fns[i % len(fns)]()
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for i in range(min(3, n_repeat)):
        if mode:
            flush_l2_cache(mode)
        fns[i % len(fns)]()
    host_ms = (time.perf_counter() - t0) * 1e3 / min(3, n_repeat)
    cupy.cuda.Device().synchronize()
    starts = [cupy.cuda.Event() for _ in range(n_repeat)]
    ends = [cupy.cuda.Event() for _ in range(n_repeat)]
    if spin:
        ns = int(min(max_spin_ms, 1.5 * host_ms * n_repeat + 1.0) * 1e6)
        _spin_kernel()((1,), (1,), (np.uint64(ns),))
    for i in range(n_repeat):
        if mode:
            flush_l2_cache(mode)
        starts[i].record()
        fns[i % len(fns)]()
        ends[i].record()
    ends[-1].synchronize()
    ms = np.array([cupy.cuda.get_elapsed_time(s, e) for s, e in zip(starts, ends)])
    return {"ms": float(np.median(ms)), "ms_min": float(ms.min()),
            "ms_p20": float(np.percentile(ms, 20)), "ms_p80": float(np.percentile(ms, 80)),
            "n_repeat": n_repeat, "flush_l2": mode, "host_ms": round(host_ms, 4)}


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------
_BF16_BITS = None


def random_normal(shape, dtype: str, seed: int = 0, chunk_elems: int = 1 << 28):
    """A CuPy array of standard-normal values of ``dtype`` (float16, bfloat16, float32, float64),
    generated in chunks of ``chunk_elems`` float32 values (so a 34 GB KV cache needs no 68 GB
    float32 temporary). bfloat16 is produced by round-to-nearest-even on the float32 bits."""
    global _BF16_BITS
    import cupy
    if dtype == "bfloat16":
        if _BF16_BITS is None:
            _BF16_BITS = cupy.ElementwiseKernel(
                "float32 x", "uint16 y",
                "unsigned int u = __float_as_uint(x); u += 0x7fffu + ((u >> 16) & 1u); "
                "y = (unsigned short)(u >> 16);", "cupyflash_f32_to_bf16_bits")
        out = cupy.empty(shape, dtype=cupy.uint16)
    else:
        out = cupy.empty(shape, dtype=dtype)
    flat = out.reshape(-1)
    rs = cupy.random.RandomState(seed)
    for start in range(0, flat.size, chunk_elems):
        stop = min(start + chunk_elems, flat.size)
        x = rs.standard_normal(stop - start, dtype=cupy.float32)
        if dtype == "bfloat16":
            _BF16_BITS(x, flat[start:stop])
        else:
            flat[start:stop] = x.astype(dtype)
        del x
    if dtype == "bfloat16":
        import ml_dtypes
        return out.view(ml_dtypes.bfloat16)
    return out


def random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, seed=0):
    """q (batch, seqlen_q, nheads, d), k and v (batch, seqlen_k, nheads_k, d), standard normal."""
    return (random_normal((batch, seqlen_q, nheads, headdim), dtype, seed),
            random_normal((batch, seqlen_k, nheads_k, headdim), dtype, seed + 1),
            random_normal((batch, seqlen_k, nheads_k, headdim), dtype, seed + 2))


def free_memory():
    """Release CuPy's cached blocks (and torch's) so the next allocation sees the device."""
    try:
        import cupy
        cupy.cuda.Device().synchronize()
        cupy.get_default_memory_pool().free_all_blocks()
    except Exception:
        pass
    if have_torch() and "torch" in sys.modules:
        import torch
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# Torch peers
# ------------------------------------------------------------------------------------------------
def cupy_to_torch(x):
    """Zero-copy torch view of a CuPy array (bfloat16 travels as int16 bits through DLPack)."""
    import torch
    if np.dtype(x.dtype).name == "bfloat16":
        import cupy
        return torch.from_dlpack(x.view(cupy.int16)).view(torch.bfloat16)
    return torch.from_dlpack(x)


def torch_sdpa(q, k, v, backend: str, causal: bool = False, enable_gqa: bool = False,
               select_per_call: bool = True):
    """A callable running ``torch.nn.functional.scaled_dot_product_attention`` with only the
    ``backend`` (``flash``, ``cudnn``, ``efficient``, ``math``) enabled, on the same memory as the
    CuPy arrays (or torch tensors) q (batch, seqlen_q, nheads, d), k, v (batch, seqlen_k,
    nheads_k, d). ``select_per_call=False``: the callable does not select the backend itself
    (the caller runs it inside ``sdpa_backend(backend)``, entered once).

    torch wants (batch, heads, seqlen, d): transposed views first; if the backend rejects their
    strides, contiguous copies made once here. The callable's attribute ``layout`` says which.
    torch's ``is_causal`` is top-left aligned: only pass ``causal`` when seqlen_q == seqlen_k
    (where it equals ours) or seqlen_q == 1 and causal is False.

    Raises
    ------
    RuntimeError
        If the backend rejects the problem (e.g. "No available kernel"), with torch's message.
    """
    import torch
    import torch.nn.functional as F
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError("torch_sdpa: torch's causal mask is top-left aligned; use seqlen_q == seqlen_k")
    qt, kt, vt = ((x if isinstance(x, torch.Tensor) else cupy_to_torch(x)).transpose(1, 2)
                  for x in (q, k, v))
    kw = {"is_causal": causal}
    if enable_gqa:
        kw["enable_gqa"] = True
    errors = []
    for layout in ("bshd_view", "bhsd_contiguous"):
        if layout == "bhsd_contiguous":
            qt, kt, vt = qt.contiguous(), kt.contiguous(), vt.contiguous()

        def run(qt=qt, kt=kt, vt=vt):
            if not select_per_call:
                return F.scaled_dot_product_attention(qt, kt, vt, **kw)
            with sdpa_backend(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, **kw)
        try:
            with sdpa_backend(backend):
                run()
            torch.cuda.synchronize()
            run.layout = layout
            return run
        except Exception as e:  # noqa: PERF203
            errors.append(f"{layout}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    raise RuntimeError(f"torch SDPA {backend}: " + " | ".join(errors))


def sdpa_backend(backend: str):
    """``torch.nn.attention.sdpa_kernel`` with only ``backend`` (``flash``, ``cudnn``,
    ``efficient``, ``math``) enabled."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([{"flash": SDPBackend.FLASH_ATTENTION,
                         "cudnn": SDPBackend.CUDNN_ATTENTION,
                         "efficient": SDPBackend.EFFICIENT_ATTENTION,
                         "math": SDPBackend.MATH}[backend]])


# ------------------------------------------------------------------------------------------------
# Peak extra device memory
# ------------------------------------------------------------------------------------------------
def _nbytes(res) -> int:
    if res is None:
        return 0
    if isinstance(res, (tuple, list)):
        return sum(_nbytes(r) for r in res)
    nb = getattr(res, "nbytes", None)
    if nb is not None:
        return int(nb)
    if hasattr(res, "element_size"):  # torch tensor
        return int(res.element_size() * res.numel())
    return 0


def peak_extra_memory_cupy(fn) -> dict:
    """Device memory a CuPy-allocating ``fn()`` needs beyond its result, in bytes.

    ``fn`` is called once untimed first (compilation, cuBLAS handle and workspace), then CuPy's
    pool is emptied and ``fn`` is called again: the pool only grows when no cached block fits, so
    its growth over the call is the peak of simultaneously live allocations (up to block
    rounding). ``peak_extra_bytes`` is that growth minus the result's bytes; ``device_extra_bytes``
    is the drop in ``cudaMemGetInfo``'s free memory minus the result (it also sees allocations
    outside the pool, e.g. library workspaces, at 2 MiB granularity).
    """
    import cupy
    pool = cupy.get_default_memory_pool()
    res = fn()
    del res
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    total0 = pool.total_bytes()
    free0 = cupy.cuda.runtime.memGetInfo()[0]
    res = fn()
    cupy.cuda.Device().synchronize()
    total1 = pool.total_bytes()
    free1 = cupy.cuda.runtime.memGetInfo()[0]
    out = _nbytes(res)
    del res
    pool.free_all_blocks()
    return {"peak_extra_bytes": int(total1 - total0 - out),
            "device_extra_bytes": int(free0 - free1 - out), "result_bytes": out}


def peak_extra_memory_torch(fn) -> dict:
    """Like :func:`peak_extra_memory_cupy` for a torch-allocating ``fn`` (torch's caching
    allocator statistics: ``max_memory_allocated`` during the call minus before, minus result)."""
    import torch
    res = fn()
    del res
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    res = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    out = _nbytes(res)
    del res
    return {"peak_extra_bytes": int(peak - before - out), "result_bytes": out}


# ------------------------------------------------------------------------------------------------
# explain() records
# ------------------------------------------------------------------------------------------------
def explain_record(*args, kind: str = "prefill", **kwargs):
    """The plan's summary for the call's arguments (``cupyflash.explain`` for prefill,
    ``cupyflash.explain_kvcache`` for ``kind="decode"``): ``dataclasses.asdict`` of the plan
    (problem; kernel name, template, grid, block, shared memory, registers, spills;
    ``num_splits``, modelled FLOPs and HBM bytes, workspace, the reasons for the choice) without
    ``rejected``, the list of every other specialisation and why it was not chosen. ``{"error":
    ...}`` when planning raises (recorded beside the measurement rather than aborting a
    sweep). The scripts read what they need from it and record :func:`plan_fields`."""
    try:
        import cupyflash
        fn = cupyflash.explain_kvcache if kind == "decode" else cupyflash.explain
        plan = fn(*args, **kwargs)
        rec = dataclasses.asdict(plan) if dataclasses.is_dataclass(plan) else dict(plan)
        rec.pop("rejected", None)
        return json.loads(json.dumps(rec, default=jsonable))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def plan_fields(explain: dict) -> dict:
    """What a results record keeps of an :func:`explain_record`: ``{"plan_kernel": name}``
    (plus ``plan_extra_kernels``, the names of any further kernels the plan launches), or
    ``{"plan_error": why}`` when planning raised. The record's run names the commit; explain()
    at that commit gives the rest of the plan."""
    if not isinstance(explain, dict):
        return {"plan_error": f"not a plan: {explain!r}"[:300]}
    if "error" in explain:
        return {"plan_error": explain["error"]}
    kernel = explain.get("kernel")
    out = {"plan_kernel": kernel.get("name") if isinstance(kernel, dict) else kernel}
    extra = [k.get("name") if isinstance(k, dict) else k for k in explain.get("extra_kernels") or []]
    if extra:
        out["plan_extra_kernels"] = extra
    return out


# ------------------------------------------------------------------------------------------------
# Nsight Compute: a script runs itself in driver mode under ncu (exp_hbm.py, ncu_prefill.py)
# ------------------------------------------------------------------------------------------------
def find_ncu() -> str | None:
    """Path of the Nsight Compute CLI (``ncu``), or None."""
    for c in [shutil.which("ncu"), "/usr/local/cuda/bin/ncu",
              *sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"), reverse=True),
              *sorted(glob.glob("/usr/local/cuda*/bin/ncu"), reverse=True)]:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


_CHILD = [None]


def _kill_child(*_) -> tuple:
    """Kill the running ncu child's process group; returns what it had printed ``(out, err)``."""
    p = _CHILD[0]
    if p is not None and p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = p.communicate()
        return out or "", err or ""
    return "", ""


def _on_term(signum, frame):
    """SIGTERM handler of the ncu scripts: end ncu and its target, then exit."""
    _kill_child()
    sys.exit(128 + signum)


def run_profiled(cmd: list, timeout: float) -> tuple:
    """Run ``cmd`` (ncu and its target) with the repository on PYTHONPATH; returns
    ``(stdout + stderr, seconds, returncode)``. The child gets its own process group, so that a
    timeout (ours, TimeoutError, or the runner's SIGTERM, :func:`_on_term`) ends ncu *and* its
    target; the TimeoutError's ``output`` is what the child had printed until then."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        PYTHONUNBUFFERED="1")
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    _CHILD[0] = p
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = _kill_child()
        e = TimeoutError(f"ncu run exceeded {timeout:.0f} s")
        e.output = out + "\n" + err  # what it printed before the kill
        raise e from None
    finally:
        _CHILD[0] = None
    return out + "\n" + err, round(time.time() - t0, 1), p.returncode


def ncu_csv_rows(text: str) -> list:
    """The CSV rows (lists of fields) of ncu's ``--csv`` console output, from its first header
    row (first field ``ID``) on; the target's own output and ncu's ``==PROF==`` lines are
    dropped. Raises ValueError (with the output's tail) when there is no header."""
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu CSV header in output:\n" + "\n".join(lines[-30:]))
    return list(csv.reader(io.StringIO("\n".join(l for l in lines[start:] if l.startswith('"')))))


def ncu_failure(text: str) -> str | None:
    """Why ncu could not profile at all, when its output says so (no access to the performance
    counters, no supported device), else None."""
    t = text or ""
    if "ERR_NVGPUCTRPERM" in t or "permission to access NVIDIA GPU Performance Counters" in t:
        return ("the GPU performance counters are not readable by this user (ERR_NVGPUCTRPERM: "
                "https://developer.nvidia.com/ERR_NVGPUCTRPERM)")
    if "Failed to initialize the profiler" in t:  # e.g. LibraryNotLoaded under gVisor
        line = next(l for l in t.splitlines() if "Failed to initialize the profiler" in l)
        return f"ncu cannot start its profiler here ({line.strip()[:200]})"
    if "No supported GPU" in t or "not supported on this device" in t.lower():
        return "ncu does not support this GPU"
    return None
