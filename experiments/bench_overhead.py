"""Per-call cost of a call as users make it (issue 22): eager loops of cupyflash with torch
tensors and with CuPy arrays beside torch SDPA (cuDNN, flash, efficient) in the same run, on the
issue's shapes; plus the cold JIT compile of one specialisation.

* eager loop: ``--calls`` calls back to back after a warm-up, one synchronisation, wall time
  divided by the number of calls (``us_per_call``; the median of ``--repeats`` loops, each loop
  in ``us_all``). Where the GPU is the bottleneck this is the GPU time per call, elsewhere the
  host's.
* host time: the same calls in bursts of ``--burst`` right after a synchronisation, timed
  without synchronising (``host_us``, the median over ``--bursts`` bursts; ``host_us_min``):
  what the host spends to enqueue one call while the launch queue is far from full, whatever
  the GPU time; ``host_us_busy``: the same bursts queued behind a ~2 ms sleep kernel, so that
  every launch finds the stream busy (on the H200 on 2026-12-02, the runs at 2f4c0f2 and
  0990e17, it was not cheaper on an idle stream). Where ``us_per_call`` is above both this and
  the GPU time, the host ran slower in the loop than in the bursts (a shape's bursts are timed
  right after its loops).
* interleaved rounds: the variants of one shape (and the host references among themselves) are
  timed together, round r running loop r of every variant in turn, then burst b of every
  variant in turn, then busy burst b likewise, so that a few seconds of interference on a
  shared host spread over all the variants instead of landing on one (a run had CuPy
  ``validate=False`` 5-7 us slower than CuPy defaults, one flag apart, when each variant was
  timed in one stretch). Each variant keeps its warm-up, right before its first loop, its first
  burst and its first busy burst.
* GPU time: the same cupyflash call (``validate=False``, ``out=`` and ``workspace=`` given)
  captured once in a torch CUDA graph and replayed ``--calls`` times (``variant:
  "cuda_graph"``): what the kernels take without any host work, the floor of the eager loops.
* shapes: Llama-3-8B decode heads (32 query, 8 KV, hd128), bf16, one new token, batch 1 x 4k
  keys, 16 x 1k, 64 x 4k (every sequence at the full length, as SDPA sees it); a small prefill,
  batch 24 x 256 tokens, 12 heads x hd32, fp16, causal.
* cold compile: a fresh process with an empty CuPy kernel cache times its first
  ``flash_attn_func`` call (NVRTC + module load + launch), then a second fresh process that
  reuses that cache (``--no-cold`` skips it).
* host reference (``op: "host"``): how fast this machine's host is, so that runs on different
  machines can be compared (the same calls took 12-25 us on three H200 hosts on 2026-12-01,
  experiments/notes/2026-12-01_2204_ea8be9b.md):
  a fixed piece of pure Python like the warm path's, ``torch.empty_like`` on the device, an
  empty CuPy kernel's launch, and the library's own driver launch of an empty kernel
  (``Launch``, plain and programmatic-dependent), per call.

One JSON line per measurement (``op``, ``impl``, ``caller``, ``variant``, ``batch``,
``seqlen_q``, ``seqlen_k``, ``us_per_call``, ...) after the run's header line (the provenance:
``commit``, ``gpu``, ...; experiments/common.py).
The table printed last puts each number beside the issue's (measured before this work).

    PYTHONPATH=. python experiments/bench_overhead.py          # appends results/bench_overhead.jsonl
"""
from __future__ import annotations

import argparse
import ctypes
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_overhead.jsonl"

#: (op, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, causal)
SHAPES = [("decode", 1, 1, 4096, 32, 8, 128, "bfloat16", False),
          ("decode", 16, 1, 1024, 32, 8, 128, "bfloat16", False),
          ("decode", 64, 1, 4096, 32, 8, 128, "bfloat16", False),
          ("prefill", 24, 256, 256, 12, 12, 32, "float16", True)]

#: the issue's numbers (H200, before this work): (op, batch, seqlen_k, impl, caller, variant)
OLD_US = {("decode", 1, 4096, "cupyflash", "torch", "defaults"): 261,
          ("decode", 16, 1024, "cupyflash", "torch", "defaults"): 253,
          ("decode", 64, 4096, "cupyflash", "torch", "defaults"): 432,
          ("decode", 1, 4096, "cupyflash", "torch", "validate=False"): 202,
          ("decode", 16, 1024, "cupyflash", "torch", "validate=False"): 199,
          ("decode", 64, 4096, "cupyflash", "torch", "validate=False"): 237,
          ("decode", 1, 4096, "cupyflash", "cupy", "defaults"): 109,
          ("decode", 16, 1024, "cupyflash", "cupy", "defaults"): 105,
          ("decode", 64, 4096, "cupyflash", "cupy", "defaults"): 341,
          ("decode", 1, 4096, "cupyflash", "cupy", "validate=False"): 30,
          ("decode", 16, 1024, "cupyflash", "cupy", "validate=False"): 26,
          ("decode", 64, 4096, "cupyflash", "cupy", "validate=False"): 236,
          ("decode", 1, 4096, "sdpa_cudnn", "torch", "defaults"): 51,
          ("decode", 16, 1024, "sdpa_cudnn", "torch", "defaults"): 41,
          ("decode", 64, 4096, "sdpa_cudnn", "torch", "defaults"): 240,
          ("prefill", 24, 256, "cupyflash", "torch", "defaults"): 192,
          ("prefill", 24, 256, "cupyflash", "cupy", "defaults"): 31,
          ("prefill", 24, 256, "sdpa_cudnn", "torch", "defaults"): 64}

_COLD = r"""
import json, sys, time
t0 = time.perf_counter()
import cupy, numpy as np, cupyflash
q = cupy.asarray(np.random.default_rng(0).standard_normal((1, 256, 8, 128)).astype(np.float16))
t1 = time.perf_counter()
out = cupyflash.flash_attn_func(q, q, q, causal=True)
cupy.cuda.Device().synchronize()
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "first_call_s": t2 - t1,
                  "kernel": cupyflash.explain(q, q, q, causal=True).kernel.name}))
"""


def cold_compile(cache_dir: str) -> dict:
    env = dict(os.environ, CUPY_CACHE_DIR=cache_dir)
    p = subprocess.run([sys.executable, "-c", _COLD], env=env, capture_output=True, text=True,
                       timeout=120)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def eager_us(fn, calls: int, repeats: int, sync, warmup: int | None = None) -> list:
    """Wall microseconds per call of ``calls`` back-to-back calls, one synchronisation, per
    repeat (after a warm-up of ``warmup`` calls, by default ``calls // 10 + 3``, and a
    synchronisation)."""
    for _ in range(calls // 10 + 3 if warmup is None else warmup):
        fn()
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        out.append(1e6 * (time.perf_counter() - t0) / calls)
    return out


def host_us(fn, burst: int, bursts: int, sync, busy=None, warmup: int = 1) -> list:
    """Host microseconds per call of ``burst`` back-to-back calls started on an idle GPU (one
    synchronisation before each burst, none inside the timing), per burst, after ``warmup``
    calls: the enqueue cost. With ``busy`` (a call that queues a long kernel on the same
    stream), each burst is enqueued behind that kernel instead, so every launch finds the
    stream busy."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(bursts):
        sync()
        if busy is not None:
            busy()
        t0 = time.perf_counter()
        for _ in range(burst):
            fn()
        out.append(1e6 * (time.perf_counter() - t0) / burst)
    sync()
    return out


def _timed_interleaved(cases: list, repeats: int, burst: int, bursts: int,
                       digits: int = 2) -> list:
    """``us_per_call`` (median of ``repeats`` eager loops, each in ``us_all``), ``host_us`` and
    ``host_us_min`` (bursts on an idle GPU) and, where the case has ``busy``, ``host_us_busy``
    (bursts behind a long kernel): one dict per case. A case is ``(fn, sync, context, calls,
    busy)``: ``context`` makes the context manager entered around each of the case's loops and
    bursts (None: none), ``calls`` the calls per loop, ``busy`` None for no busy bursts.

    The cases are interleaved: round r runs loop r of every case in turn; then round b runs
    burst b of every case in turn, and then likewise the busy bursts. Each case's warm-ups
    (:func:`eager_us`'s and :func:`host_us`'s) come right before its first loop, its first
    burst and its first busy burst, as when the case was timed on its own."""
    def within(context, f, *args):
        with context() if context is not None else contextlib.nullcontext():
            return f(*args)
    us, hs, busy_hs = ([[] for _ in cases] for _ in range(3))
    for r in range(repeats):
        for (fn, sync, context, calls, _), out in zip(cases, us):
            out += within(context, eager_us, fn, calls, 1, sync, None if r == 0 else 0)
    for samples, with_busy in ((hs, False), (busy_hs, True)):  # idle bursts, then busy ones
        for b in range(bursts):
            for (fn, sync, context, _, busy), out in zip(cases, samples):
                if not with_busy or busy is not None:
                    out += within(context, host_us, fn, burst, 1, sync,
                                  busy if with_busy else None, int(b == 0))
    recs = []
    for u, h, hb in zip(us, hs, busy_hs):
        rec = dict(us_per_call=round(statistics.median(u), digits),
                   us_all=[round(x, digits) for x in u],
                   host_us=round(statistics.median(h), digits), host_us_min=round(min(h), digits))
        if hb:
            rec["host_us_busy"] = round(statistics.median(hb), digits)
        recs.append(rec)
    return recs


def sleep_kernel(torch, us: float = 2000.0):
    """A call that queues ``torch.cuda._sleep`` for about ``us`` microseconds (at 2 GHz) on
    torch's current stream (the legacy default stream, CuPy's too, unless either was set)."""
    cycles = int(us * 2000)
    return lambda: torch.cuda._sleep(cycles)


def graph_us(torch, fn, calls: int, repeats: int) -> list:
    """Microseconds per replay of ``fn`` captured once in a torch CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return eager_us(g.replay, calls, repeats, torch.cuda.synchronize)


def measure_shape(shape, calls: int, repeats: int, burst: int = 32, bursts: int = 40) -> list:
    import cupy
    import torch

    import cupyflash
    from cupyflash import decode
    op, B, SQ, SK, H, HK, D, dtype, causal = shape
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(0)
    rand = lambda *s: torch.randn(s, generator=g, device=dev, dtype=tdt)  # noqa: E731
    q = rand(B, SQ, H, D)
    k, v = rand(B, SK, HK, D), rand(B, SK, HK, D)
    base = dict(op=op, batch=B, seqlen_q=SQ, seqlen_k=SK, nheads=H, nheads_k=HK, headdim=D,
                dtype=dtype, causal=causal, calls=calls)
    tsync = torch.cuda.synchronize

    def csync():
        cupy.cuda.Device().synchronize()
    records, runs = [], []  # runs: (record, fn, sync, context), timed together below

    def add(impl, caller, variant, fn, sync, context=None, **extra):
        records.append(dict(base, impl=impl, caller=caller, variant=variant, **extra))
        runs.append((records[-1], fn, sync, context))
    if op == "decode":
        lens = torch.full((B,), SK, dtype=torch.int32, device=dev)
        qc, kc, vc, lc = (to_cupy(x) for x in (q, k, v, lens))
        for caller, (qq, kk, vv, ll), sync in (("torch", (q, k, v, lens), tsync),
                                               ("cupy", (qc, kc, vc, lc), csync)):
            add("cupyflash", caller, "defaults",
                lambda qq=qq, kk=kk, vv=vv, ll=ll: cupyflash.flash_attn_with_kvcache(
                    qq, kk, vv, cache_seqlens=ll), sync)
            add("cupyflash", caller, "validate=False",
                lambda qq=qq, kk=kk, vv=vv, ll=ll: cupyflash.flash_attn_with_kvcache(
                    qq, kk, vv, cache_seqlens=ll, validate=False), sync)
        ws = torch.zeros(max(decode.workspace_size(q, k, v, cache_seqlens=lens), 1),
                         dtype=torch.float32, device=dev)
        out = torch.empty_like(q)
        graph_fn = lambda: cupyflash.flash_attn_with_kvcache(  # noqa: E731
            q, k, v, cache_seqlens=lens, out=out, workspace=ws, validate=False)
    else:
        qc, kc, vc = (to_cupy(x) for x in (q, k, v))
        for caller, (qq, kk, vv), sync in (("torch", (q, k, v), tsync),
                                           ("cupy", (qc, kc, vc), csync)):
            add("cupyflash", caller, "defaults",
                lambda qq=qq, kk=kk, vv=vv: cupyflash.flash_attn_func(
                    qq, kk, vv, causal=causal), sync)
        out = torch.empty_like(q)
        graph_fn = lambda: cupyflash.flash_attn_func(q, k, v, causal=causal, out=out)  # noqa: E731
    graph = dict(base, impl="cupyflash", caller="torch", variant="cuda_graph")
    records.append(graph)
    for backend in ("cudnn", "flash", "efficient"):
        impl = f"sdpa_{backend}"
        # the backend selected around each loop and burst, not per call
        context = lambda backend=backend: common.sdpa_backend(backend)  # noqa: E731
        try:  # a backend that rejects the shape raises here, before the timed rounds
            fn = common.torch_sdpa(q, k, v, backend, causal=causal, enable_gqa=H != HK,
                                   select_per_call=False)
            with context():
                fn()
            tsync()
        except Exception as e:  # noqa: BLE001 - say why
            records.append(dict(base, impl=impl, caller="torch", variant="defaults",
                                error=f"{type(e).__name__}: {str(e)[:300]}"))
            continue
        add(impl, "torch", "defaults", fn, tsync, context, torch_layout=fn.layout)
    busy = sleep_kernel(torch)
    cases = [(fn, sync, context, calls, busy) for _, fn, sync, context in runs]
    for (rec, *_), timed in zip(runs, _timed_interleaved(cases, repeats, burst, bursts)):
        rec.update(timed)
    us = graph_us(torch, graph_fn, calls, repeats)
    graph.update(us_per_call=round(statistics.median(us), 2), us_all=[round(x, 2) for x in us])
    return records


def to_cupy(x):
    """A CuPy view of a torch CUDA tensor, the same memory (16-bit floats travel as int16 bits
    through DLPack, then are viewed as float16 / ml_dtypes' bfloat16)."""
    import cupy
    import torch

    from cupyflash.core.interop import np_dtype
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if x.dtype in names:
        return cupy.from_dlpack(x.view(torch.int16)).view(np_dtype(names[x.dtype]))
    return cupy.from_dlpack(x)


class _RefObj:
    __slots__ = ("shape", "dtype", "ptr")

    def __init__(self, i):
        self.shape, self.dtype, self.ptr = (1, 4096, 8, 128), "bfloat16", 0x7000 + 256 * i


_REF_OBJS = tuple(_RefObj(i) for i in range(4))
_REF_TABLE = {(("k",) + tuple((o.shape, o.dtype) for o in _REF_OBJS)): 1}


def _python_ref():
    """A fixed piece of pure Python of the warm path's kind (attribute reads, a tuple key, a
    dict lookup, integer arithmetic): its time per call measures the host's Python speed."""
    key = ("k",) + tuple((o.shape, o.dtype) for o in _REF_OBJS)
    hit = _REF_TABLE.get(key)
    ptrs = tuple(o.ptr for o in _REF_OBJS)
    return hit, (ptrs[0] | ptrs[1] | ptrs[2]) % 16


def host_reference(calls: int, repeats: int, burst: int = 32, bursts: int = 40) -> list:
    """How fast this host is, for comparing per-call numbers across machines and runs (the
    same GPU work took 12-25 us per call on three H200 hosts): microseconds per call of
    :func:`_python_ref`, of ``torch.empty_like`` of a decode query on the device, of an empty
    CuPy kernel's launch, and of the library's driver
    launch (:class:`cupyflash.core.launch.Launch`) of an empty kernel, plain and
    programmatic-dependent (eager loops as above, and ``host_us`` from bursts: the enqueue)."""
    import cupy
    import numpy as np
    import torch

    from cupyflash.core import launch
    q = torch.empty((1, 1, 32, 128), dtype=torch.bfloat16, device="cuda")
    k = cupy.RawKernel('extern "C" __global__ void cf_empty() {}', "cf_empty")
    k((1,), (1,), ())
    cupy.cuda.Device().synchronize()
    n = 50 * calls
    csync = cupy.cuda.Device().synchronize
    stream = cupy.cuda.get_current_stream().ptr
    cases = [("python", "warm_path_like", _python_ref, lambda: None, n),
             ("torch", "empty_like", lambda: torch.empty_like(q), torch.cuda.synchronize, n),
             ("cupy", "empty_kernel_launch", lambda: k((1,), (1,), ()), csync, calls)]
    k1 = cupy.RawKernel('extern "C" __global__ void cf_empty1(const void* p) {}', "cf_empty1")
    k1((1,), (1,), (np.uint64(0),))
    for pdl in (False, True):  # the library's driver launch of an empty kernel (one pointer)
        run = launch.Launch(k1, ctypes.c_uint64(0), (1, 1, 1), (1, 1, 1), pointers=(0, 1),
                            pdl=pdl)
        cases.append(("driver", f"prepared_launch_pdl={pdl}",
                      lambda run=run: run((0,), stream), csync, calls))
    busy = sleep_kernel(torch)  # launches: the enqueue on an idle and on a busy stream as well
    timed = _timed_interleaved(
        [(fn, sync, None, m, busy if caller in ("cupy", "driver") else None)
         for caller, variant, fn, sync, m in cases], repeats, burst, bursts, digits=3)
    return [dict(op="host", impl="reference", caller=caller, variant=variant, batch=0,
                 seqlen_q=0, seqlen_k=0, calls=m, **t)
            for (caller, variant, fn, sync, m), t in zip(cases, timed)]


def table(records: list) -> str:
    """Rows: shape x (impl, caller, variant); columns: before (the issue) and now (us/call of
    the eager loop), and the host's enqueue time per call (``host_us``) where measured."""
    lines = [f"{'shape':24s} {'impl':10s} {'caller':6s} {'variant':26s} {'before':>7s} "
             f"{'now':>8s} {'host':>8s} {'busy':>8s}"]
    for r in records:
        if r.get("variant") in ("cold_compile", "disk_cache"):
            continue
        shape = f"{r['op']} b{r['batch']} x {r['seqlen_k']}"
        old = OLD_US.get((r["op"], r["batch"], r["seqlen_k"], r["impl"], r["caller"],
                          r["variant"]))
        now = (f"{r['us_per_call']:8.{3 if r['op'] == 'host' else 1}f}" if "us_per_call" in r
               else "   error")
        host = f"{r['host_us']:8.2f}" if "host_us" in r else ""
        if "host_us_busy" in r:
            host += f" {r['host_us_busy']:8.2f}"
        lines.append(f"{shape:24s} {r['impl']:10s} {r['caller']:6s} {r['variant']:26s} "
                     f"{old if old is not None else '':>7} {now} {host}".rstrip())
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=300, help="calls per timed loop")
    ap.add_argument("--repeats", type=int, default=5, help="timed loops per measurement")
    ap.add_argument("--burst", type=int, default=32,
                    help="calls per burst of the host-time measurement (host_us)")
    ap.add_argument("--bursts", type=int, default=40, help="bursts per host-time measurement")
    ap.add_argument("--quick", action="store_true", help="100 calls, 3 loops, no cold compile")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-compile processes")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.quick:
        args.calls, args.repeats, args.no_cold = 100, 3, True
    if not common.have_gpu() or not common.have_torch():
        print("bench_overhead: needs a CUDA GPU and torch with CUDA; nothing measured")
        return 0
    prov = common.provenance()
    recs = []
    if not args.no_cold:
        with tempfile.TemporaryDirectory() as cache:
            cold = cold_compile(cache)
            warm = cold_compile(cache)  # same cache folder: disk-cache hit, new process
        common_fields = dict(op="prefill", impl="cupyflash", caller="cupy", batch=1, seqlen_q=256,
                             seqlen_k=256, kernel=cold["kernel"])
        recs.append(dict(common_fields, variant="cold_compile",
                         us_per_call=round(1e6 * cold["first_call_s"], 1),
                         import_s=cold["import_s"]))
        recs.append(dict(common_fields, variant="disk_cache",
                         us_per_call=round(1e6 * warm["first_call_s"], 1)))
        print(f"  cold first call (NVRTC + load + launch) {cold['first_call_s']:.2f} s "
              f"({cold['kernel']}); with CuPy's disk cache {warm['first_call_s']:.2f} s")
    recs += host_reference(args.calls, args.repeats, args.burst, args.bursts)
    for shape in SHAPES:
        recs += measure_shape(shape, args.calls, args.repeats, args.burst, args.bursts)
    n = common.append_results(args.out, recs)
    print(f"bench_overhead: wrote {n} records to {args.out} (commit {prov.get('commit')}, "
          f"{prov.get('gpu')})")
    print(table(recs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
