"""Where the Hopper prefill kernel loses to FlashAttention-3: Nsight Compute, one call each
(issue 23, item 3: stall reasons, tensor-core and special-function utilisation).

For each implementation this script runs itself in *driver* mode under

    ncu --clock-control none --profile-from-start off --print-units base --csv --page raw \\
        --section SpeedOfLight --section LaunchStats --section WarpStateStats \\
        --section InstructionStats --section ComputeWorkloadAnalysis --metrics ... \\
        python ncu_prefill.py --driver IMPL --shapes 64:0,128:0,...

as exp_hbm.py does (the plumbing is common.find_ncu / run_profiled / ncu_csv_rows). The driver
builds each shape's inputs, calls the implementation once untimed (compilation, library
handles), then, between ``cudaProfilerStart`` / ``cudaProfilerStop``, launches a one-block marker
kernel whose grid size is the shape's index and calls the implementation once more: every kernel
after marker i and before marker i + 1 belongs to shape i, so one ncu process profiles all the
shapes of an implementation. ncu flushes the caches before each kernel (``--cache-control all``,
its default) and leaves the clocks alone (``--clock-control none``, as the timed benchmarks run).

Per profiled kernel the record keeps: name, duration, ``sm__throughput`` (% of peak), the tensor
pipe's busy % (``tensor_pct``; ``tensor_metric`` names the metric it came from: the largest of
the tensor pipes' busy cycles that ncu reported, GMMA's where it has that metric, else the
largest tensor instruction share), the XU pipe (exp2, the special functions) as % of its peak, issue slots busy, warp
instructions executed, registers per thread, grid, block, every warp stall reason (cycles per
issued instruction, ``smsp__average_warps_issue_stalled_*_per_issue_active.ratio``; ``stalls_top``
leaves out ``selected``, which is no stall) and every pipe's utilisation that ncu reported
(``pipes``). The longest kernel of a call also keeps ncu's whole raw page (``raw``: metric ->
[value, unit]) so that later questions need no new device run.

Shapes: bf16, batch 2, S = 8192, hidden 2048 (16 heads of 128, 32 of 64, 8 of 256), causal and
not; ``--quick``: hd 64 and 128, not causal. Implementations: ``cupyflash`` (the public
``cupyflash.flash_attn_func``) and ``fa3`` (``fa3_fwd_interface.flash_attn_func``, the wheel of
../shared/peers/README.md; skipped, saying why, when it does not import).

``--backward`` profiles the backward pass instead (issue 35): per shape the forward runs
unprofiled through autograd, then ``out.backward(dout)`` runs between the markers, so a record
holds every kernel of the backward call (the accumulator's zeroing, the pre-pass, the main
kernel, the dQ conversion: where the time goes at short sequences). Implementations
``cupyflash``, ``cupyflash_det`` (``deterministic=True``) and ``torch_cudnn`` (SDPA's cuDNN
backend), built by bench_backward.make_fns; FLOPs counted as 2.5x the forward's. Records go to
``experiments/results/ncu_backward.jsonl`` (``what``: ``ncu_backward``).

    python experiments/ncu_prefill.py --quick      # 2 ncu runs x 2 shapes, ~1 min on an H200
    python experiments/ncu_prefill.py              # 2 ncu runs x 6 shapes, < 3 min
    python experiments/ncu_prefill.py --backward --quick --batch 16 --seqlen 1024

Appends a run to ``experiments/results/ncu_prefill.jsonl`` (a header with the commit and GPU:
experiments/common.py; then one record per (impl, shape), with ``plan_kernel`` for cupyflash) and
prints a table. Without a GPU, without ncu, or when ncu cannot read the performance counters, it
says so and exits 0. When ncu rejects the optional metric expressions (``OPTIONAL_METRICS``), it runs
again with the sections and ``BASE_METRICS`` only, then with ``BASE_METRICS`` only.
"""
from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS  # noqa: E402

SECTIONS = ("SpeedOfLight", "LaunchStats", "WarpStateStats", "InstructionStats",
            "ComputeWorkloadAnalysis")
# names used on sm_90 by many public ncu scripts (and inside the sections above)
BASE_METRICS = (
    "gpu__time_duration.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "smsp__inst_executed.sum",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
    "launch__registers_per_thread",
    "launch__grid_size",
    "launch__block_size",
    "dram__bytes_read.sum",
)
# every tensor pipe's busy cycles and every pipe's instruction share that this ncu knows on this
# GPU (names differ between ncu versions: sm__pipe_tensor_op_gmma_cycles_active may not exist)
OPTIONAL_METRICS = (
    r"regex:sm__pipe_tensor.*_cycles_active\.avg\.pct_of_peak_sustained_active",
    r"regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active",
)
# tensor-pipe utilisation: the largest of the busy-cycle metrics that ncu reported (whether
# sm__pipe_tensor_cycles_active counts GMMA on sm_90 is not established here), else the largest
# instruction share
TENSOR_CYCLES = (
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
)
TENSOR_INST = (
    "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active",
)
STALL_RE = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
PIPE_RE = re.compile(r"^sm__(inst_executed_pipe_(\w+)|pipe_(\w+)_cycles_active)"
                     r"\.avg\.pct_of_peak_sustained_active$")
MARKER = "cupyflash_ncu_marker"
IMPLS = ("cupyflash", "fa3", "torch_cudnn", "cupyflash_det")
BWD_IMPLS = ("cupyflash", "cupyflash_det", "torch_cudnn")
TIME_UNITS = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3, "ns": 1e-6,
              "us": 1e-3, "ms": 1.0, "s": 1e3}


def shape_of(headdim: int, causal: bool, args) -> dict:
    return dict(dtype=args.dtype, batch=args.batch, seqlen=args.seqlen, nheads=args.hidden // headdim,
                headdim=headdim, causal=causal, hidden=args.hidden)


def format_shapes(shapes) -> str:
    return ",".join(f"{s['headdim']}:{int(s['causal'])}" for s in shapes)


def parse_shapes(spec: str, args) -> list:
    out = []
    for item in spec.split(","):
        hd, c = item.split(":")
        out.append(shape_of(int(hd), c == "1", args))
    return out


# ------------------------------------------------------------------------------------------------
# Driver: per shape one warm call, then marker + one call between cudaProfilerStart/Stop
# ------------------------------------------------------------------------------------------------
def backward_fn(impl: str, s: dict):
    """``--backward``: a callable that runs the forward (unprofiled), then returns one that runs
    the backward of that forward's output; and the inputs to keep alive."""
    import bench_backward
    import torch
    q, k, v, dout = bench_backward.inputs(s, "cuda", seed=s["headdim"])
    base, det = ("cupyflash", True) if impl == "cupyflash_det" else (impl, False)
    fns = bench_backward.make_fns(base, det, q, k, v, dout, s["causal"])

    def forward():
        fns["clear"]()
        out = fns["fwd"]()
        torch.cuda.synchronize()
        return lambda: out.backward(fns["dout"])
    return forward, (q, k, v, dout, fns)


def driver(impl: str, shapes: list, backward: bool = False) -> int:
    import cupy
    import bench_prefill
    marker = cupy.RawKernel(f'extern "C" __global__ void {MARKER}(int i) {{}}', MARKER)
    for i, s in enumerate(shapes):
        try:
            common.free_memory()
            if backward:
                forward, keep = backward_fn(impl, s)
                forward()()  # warm: compiles, library handles
                cupy.cuda.Device().synchronize()
                fn = forward()  # the output whose backward is profiled
            else:
                q, k, v = common.random_qkv(s["batch"], s["seqlen"], s["seqlen"], s["nheads"],
                                            s["nheads"], s["headdim"], s["dtype"], seed=s["headdim"])
                fn = bench_prefill.make_fn(impl, q, k, v, s["causal"])
                fn()
                keep = (q, k, v)
            cupy.cuda.Device().synchronize()
            cupy.cuda.runtime.profilerStart()
            marker((i + 1,), (32,), (cupy.int32(i),))
            fn()
            cupy.cuda.Device().synchronize()
            cupy.cuda.runtime.profilerStop()
            print(f"NCU_PREFILL shape {i} ok", flush=True)
            del keep, fn
        except Exception as e:  # the other shapes still run
            try:
                cupy.cuda.runtime.profilerStop()
            except Exception:
                pass
            msg = f"{type(e).__name__}: {e}".replace("\n", " ")[:400]
            print(f"NCU_PREFILL shape {i} error {msg}", flush=True)
    return 0


# ------------------------------------------------------------------------------------------------
# Parent: parse ncu's raw page
# ------------------------------------------------------------------------------------------------
def _number(text):
    t = (text or "").replace(",", "").strip()
    if not t or t.lower() in ("n/a", "nan"):
        return None
    try:
        return float(t)
    except ValueError:
        return None


def _dim3(text):
    nums = re.findall(r"\d+", text or "")
    return [int(x) for x in nums] if nums else None


def parse_raw_csv(text: str) -> list:
    """The kernels of ncu's ``--csv --page raw`` output, in profiling order: ``[{"id", "name",
    "block", "grid", "metrics": {name: (value, unit)}}]``. The page is one header row (``ID``,
    ``Process ID``, ..., ``Kernel Name``, ..., ``Block Size``, ``Grid Size``, ..., then one column
    per metric), a row of units (its leading fields empty) and one row per kernel; a repeated
    header starts a new table. Values that are not numbers (instanced metrics, strings) are kept
    as text. Raises ValueError when there is no header (the message has ncu's last lines)."""
    rows = common.ncu_csv_rows(text)
    fixed = {"ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Kernel Time",
             "Context", "Stream", "Block Size", "Grid Size", "Device", "CC", "Section Name"}
    header, units, kernels = None, None, []
    for r in rows:
        if not r:
            continue
        if r[0] == "ID":
            header, units = r, None
            continue
        if header is None:
            continue
        if r[0] == "":  # the units row
            units = r
            continue
        rec = dict(zip(header, r))
        unit = dict(zip(header, units)) if units else {}
        metrics = {}
        for name, val in rec.items():
            if name in fixed:
                continue
            num = _number(val)
            metrics[name] = (num if num is not None else val, unit.get(name, ""))
        kernels.append({"id": int(_number(rec["ID"]) or 0), "name": rec.get("Kernel Name", "?"),
                        "block": _dim3(rec.get("Block Size")), "grid": _dim3(rec.get("Grid Size")),
                        "metrics": metrics})
    if header is None:
        raise ValueError("ncu CSV: no raw-page header row")
    return sorted(kernels, key=lambda k: k["id"])


def _value(metrics, name):
    v = metrics.get(name)
    return v[0] if v is not None and isinstance(v[0], float) else None


def summarize_kernel(k: dict, keep_raw: bool = False) -> dict:
    """The record's view of one parsed kernel (see the module docstring)."""
    m = k["metrics"]
    out = {"name": k["name"]}
    dur = m.get("gpu__time_duration.sum")
    if dur is not None and isinstance(dur[0], float):
        out["duration_ms"] = dur[0] * TIME_UNITS.get(dur[1].strip().lower(), 1e-6)
    out["sm_throughput_pct"] = _value(m, "sm__throughput.avg.pct_of_peak_sustained_elapsed")
    out["tensor_pct"], out["tensor_metric"] = None, None
    for names in (TENSOR_CYCLES, TENSOR_INST):
        found = [(_value(m, n), n) for n in names if _value(m, n) is not None]
        if found:
            out["tensor_pct"], out["tensor_metric"] = max(found)
            break
    out["xu_pct"] = _value(m, "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active")
    out["issue_active_pct"] = _value(m, "smsp__issue_active.avg.pct_of_peak_sustained_active")
    inst = _value(m, "smsp__inst_executed.sum")
    out["warp_inst_executed"] = int(inst) if inst is not None else None
    regs = _value(m, "launch__registers_per_thread")
    out["registers"] = int(regs) if regs is not None else None
    grid, block = k.get("grid"), k.get("block")
    if grid is None and _value(m, "launch__grid_size") is not None:
        grid = [int(_value(m, "launch__grid_size")), 1, 1]
    if block is None and _value(m, "launch__block_size") is not None:
        block = [int(_value(m, "launch__block_size")), 1, 1]
    out["grid"], out["block"] = grid, block
    dram = _value(m, "dram__bytes_read.sum")
    out["dram_read_bytes"] = int(dram) if dram is not None else None
    stalls = {}
    for name in m:
        mm = STALL_RE.match(name)
        if mm and _value(m, name) is not None:
            stalls[mm.group(1)] = _value(m, name)
    out["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1]))
    out["stalls_top"] = [[r, round(v, 3)] for r, v in out["stalls"].items() if r != "selected"][:6]
    pipes = {}
    for name in m:
        mm = PIPE_RE.match(name)
        if mm and _value(m, name) is not None:
            key = f"inst_{mm.group(2)}" if mm.group(2) else f"cycles_{mm.group(3)}"
            pipes[key] = _value(m, name)
    out["pipes"] = dict(sorted(pipes.items()))
    if keep_raw:
        out["raw"] = {n: list(v) for n, v in m.items() if not n.startswith("device__attribute")}
    return out


def split_by_marker(kernels: list, nshapes: int) -> dict:
    """{shape index: [the kernels after its marker]}; kernels before the first marker dropped."""
    groups, cur = {i: [] for i in range(nshapes)}, None
    for k in kernels:
        if MARKER in (k["name"] or ""):
            cur = (k["grid"] or [0])[0] - 1
            continue
        if cur is not None and cur in groups:
            groups[cur].append(k)
    return groups


def driver_messages(text: str) -> dict:
    """{shape index: "ok" | error message} from the driver's NCU_PREFILL lines."""
    out = {}
    for m in re.finditer(r"^NCU_PREFILL shape (\d+) (ok|error (.*))$", text or "", re.M):
        out[int(m.group(1))] = "ok" if m.group(2) == "ok" else m.group(3)
    return out


def ncu_command(ncu: str, impl: str, shapes: list, args, level: int) -> list:
    """level 0: sections + BASE + OPTIONAL metrics; 1: sections + BASE; 2: BASE only."""
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--print-units", "base",
           "--csv", "--page", "raw"]
    if level < 2:
        for s in SECTIONS:
            cmd += ["--section", s]
    metrics = list(BASE_METRICS) + (list(OPTIONAL_METRICS) if level == 0 else [])
    cmd += ["--metrics", ",".join(metrics), sys.executable, str(Path(__file__).resolve()),
            "--driver", impl, "--shapes", format_shapes(shapes), "--batch", str(args.batch),
            "--seqlen", str(args.seqlen), "--hidden", str(args.hidden), "--dtype", args.dtype]
    return cmd + (["--backward"] if getattr(args, "backward", False) else [])


class CountersUnreadable(RuntimeError):
    pass


def profile_impl(ncu: str, impl: str, shapes: list, args, deadline: float) -> tuple:
    """Run the driver under ncu (dropping metric requests that ncu refuses); returns
    ``(groups, messages, info)``: kernels per shape index, the driver's per-shape status, and
    the command level, seconds and return code of the run used."""
    last = None
    for level in (0, 1, 2):
        if level and time.time() > deadline:
            break
        cmd = ncu_command(ncu, impl, shapes, args, level)
        try:
            text, secs, rc = common.run_profiled(cmd, args.timeout)
        except TimeoutError as e:
            text, secs, rc = getattr(e, "output", "") or "", args.timeout, 124
        why = common.ncu_failure(text)
        if why:
            raise CountersUnreadable(why)
        msgs = driver_messages(text)
        try:
            kernels = parse_raw_csv(text)
        except ValueError as e:
            last = f"ncu level {level} (rc {rc}, {secs} s): {str(e)[-1500:]}"
            print(f"ncu_prefill: {impl}: {last[:800]}", flush=True)
            if rc == 124:  # a timeout is not a refused metric: no retry
                break
            continue
        groups = split_by_marker(kernels, len(shapes))
        return groups, msgs, {"level": level, "ncu_seconds": secs, "ncu_rc": rc,
                              "metrics_requested": cmd[cmd.index("--metrics") + 1].split(","),
                              "sections": list(SECTIONS) if level < 2 else []}
    raise RuntimeError(last or "ncu did not run")


def ncu_version(ncu: str) -> str:
    try:
        out = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=30).stdout
        return out.strip().splitlines()[-1] if out.strip() else ""
    except Exception:
        return ""


def explain_for(s: dict):
    import numpy as np
    import ml_dtypes
    q = np.empty((s["batch"], s["seqlen"], s["nheads"], s["headdim"]), np.float16)
    if s["dtype"] == "bfloat16":
        q = q.view(ml_dtypes.bfloat16)
    return common.explain_record(q, q, q, causal=s["causal"])


def build_record(impl, s, kernels, msg, info, ncu, version, keep_raw, backward=False) -> dict:
    from cupyflash import io_model
    flops = io_model.prefill_flops(s["batch"], s["nheads"], s["seqlen"], s["seqlen"], s["headdim"],
                                   s["causal"]) * (2.5 if backward else 1.0)
    rec = {"what": "ncu_backward" if backward else "ncu_prefill", "impl": impl, **s, "nheads_k": s["nheads"], "flops": flops,
           "ncu": ncu,
           "ncu_version": version, "clock_control": "none",
           "cache_control": "all (ncu default: caches flushed before each kernel)", **info}
    if not kernels:
        rec["error"] = msg if msg and msg != "ok" else "no kernel profiled for this shape"
        return rec
    main = max(range(len(kernels)),
               key=lambda i: summarize_kernel(kernels[i]).get("duration_ms") or 0.0)
    rec["kernels"] = [summarize_kernel(k, keep_raw=keep_raw and i == main)
                      for i, k in enumerate(kernels)]
    rec["main_kernel"] = main
    total = sum(k.get("duration_ms") or 0.0 for k in rec["kernels"])
    rec["duration_ms"] = total
    if total > 0:
        rec["tflops_ncu"] = flops / (total * 1e-3) / 1e12
    if impl.startswith("cupyflash") and not backward:
        rec.update(common.plan_fields(explain_for(s)))
    return rec


def _fmt(v, f="{:.0f}"):
    return "-" if v is None else f.format(v)


def table(records: list) -> str:
    """The compact table printed at the end: one row per (impl, shape), the main kernel."""
    head = (f"{'impl':<10} {'hd':>3} {'causal':<6} {'ms':>6} {'TF/s':>5} {'SM%':>4} {'TC%':>4} "
            f"{'XU%':>4} {'iss%':>4} {'Minst':>6} {'regs':>4} {'grid x block':<13} top stalls")
    lines = [head, "-" * len(head)]
    by_shape = {}
    order = {impl: i for i, impl in enumerate(IMPLS)}
    for r in sorted(records, key=lambda r: (r["headdim"], r["causal"], order.get(r["impl"], 99))):
        if "kernels" not in r:
            lines.append(f"{r['impl']:<10} {r['headdim']:>3} {str(r['causal']):<6} "
                         f"error: {r.get('error', '?')[:90]}")
            continue
        k = r["kernels"][r["main_kernel"]]
        gb = f"{(k['grid'] or ['?'])[0]} x {(k['block'] or ['?'])[0]}"
        inst = k.get("warp_inst_executed")
        stalls = " ".join(f"{n} {v:.2f}" for n, v in k.get("stalls_top", [])[:3])
        lines.append(f"{r['impl']:<10} {r['headdim']:>3} {str(r['causal']):<6} "
                     f"{_fmt(r.get('duration_ms'), '{:.3f}'):>6} {_fmt(r.get('tflops_ncu')):>5} "
                     f"{_fmt(k.get('sm_throughput_pct')):>4} {_fmt(k.get('tensor_pct')):>4} "
                     f"{_fmt(k.get('xu_pct')):>4} {_fmt(k.get('issue_active_pct')):>4} "
                     f"{_fmt(inst / 1e6 if inst else None):>6} {_fmt(k.get('registers')):>4} "
                     f"{gb:<13} {stalls}")
        by_shape.setdefault((r["headdim"], r["causal"]), {})[r["impl"]] = r
    pairs = (("cupyflash", "fa3", "FA3"), ("cupyflash", "torch_cudnn", "cuDNN"),
             ("cupyflash_det", "cupyflash", "cupyflash"))
    for (hd, c), d in sorted(by_shape.items()):
        for x, y, name in pairs:
            if x not in d or y not in d:
                continue
            a, b = d[x], d[y]
            ka, kb = a["kernels"][a["main_kernel"]], b["kernels"][b["main_kernel"]]
            ia, ib = ka.get("warp_inst_executed"), kb.get("warp_inst_executed")
            lines.append(f"hd{hd} {'causal' if c else 'not causal'}: {x} / {name} time "
                         f"x{a['duration_ms'] / b['duration_ms']:.2f}"
                         + (f", warp instructions x{ia / ib:.2f}" if ia and ib else ""))
    lines.append("TC% = tensor pipe busy (% of peak, tensor_metric names which counter), XU% = "
                 "special-function pipe, iss% = issue slots busy, stalls in cycles per issued "
                 "instruction")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="hd 64 and 128, not causal")
    ap.add_argument("--headdims", nargs="+", type=int, default=None)
    ap.add_argument("--causal", choices=["both", "true", "false"], default=None)
    ap.add_argument("--impls", nargs="+", default=None, choices=IMPLS,
                    help="default: cupyflash fa3; --backward: " + " ".join(BWD_IMPLS))
    ap.add_argument("--backward", action="store_true", help="profile the backward call (docstring)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=2048, help="nheads = hidden / headdim")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per ncu run (one per impl)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new ncu run after this many seconds")
    ap.add_argument("--no-raw", action="store_true", help="do not keep the main kernel's raw page")
    ap.add_argument("--out", type=Path, default=None,
                    help="default results/ncu_prefill.jsonl; --backward: results/ncu_backward.jsonl")
    ap.add_argument("--driver", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--shapes", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.driver:
        return driver(args.driver, parse_shapes(args.shapes, args), args.backward)
    args.impls = args.impls or list(BWD_IMPLS if args.backward else ("cupyflash", "fa3"))
    args.out = args.out or RESULTS / ("ncu_backward.jsonl" if args.backward else "ncu_prefill.jsonl")

    signal.signal(signal.SIGTERM, common._on_term)
    if not common.have_gpu():
        print("ncu_prefill: no CUDA GPU here; nothing to measure")
        return 0
    ncu = common.find_ncu()
    if ncu is None:
        print("ncu_prefill: Nsight Compute (ncu) not found; skipping")
        return 0
    hds = args.headdims or ([64, 128] if args.quick else [64, 128, 256])
    causal = args.causal or ("false" if args.quick else "both")
    causals = {"both": [False, True], "true": [True], "false": [False]}[causal]
    shapes = [shape_of(d, c, args) for d in hds for c in causals]
    # defaults fit run_gpu_experiments.sh's limits (120 s quick, 240 s full) with the last run
    # started just inside the budget
    args.timeout = args.timeout or (60.0 if args.quick else 100.0)
    budget = args.budget_s or (55.0 if args.quick else 130.0)
    t0 = time.time()
    prov = common.provenance()
    version = ncu_version(ncu)
    print(f"ncu_prefill: {prov.get('gpu')} commit {prov['commit'][:10]}, {version or ncu}, "
          f"{len(shapes)} shapes -> {args.out}", flush=True)
    records = []
    for impl in args.impls:
        ok, why = common.impl_available("cupyflash" if impl == "cupyflash_det" else impl)
        if not ok:
            print(f"ncu_prefill: skipping {impl}: {why}", flush=True)
            continue
        if time.time() - t0 > budget:
            print(f"ncu_prefill: time budget {budget:.0f} s spent; not profiling {impl}", flush=True)
            continue
        try:
            groups, msgs, info = profile_impl(ncu, impl, shapes, args, t0 + budget)
        except CountersUnreadable as e:
            print(f"ncu_prefill: ncu cannot profile here: {e}; nothing recorded")
            return 0
        except Exception as e:
            print(f"ncu_prefill: {impl}: {type(e).__name__}: {str(e)[:800]}", flush=True)
            continue
        recs = [build_record(impl, s, groups.get(i, []), msgs.get(i), info, ncu, version,
                             not args.no_raw, args.backward) for i, s in enumerate(shapes)]
        common.append_results(args.out, recs)
        records += recs
        print(f"ncu_prefill: {impl}: {sum('kernels' in r for r in recs)}/{len(recs)} shapes "
              f"profiled in {info['ncu_seconds']} s (metric level {info['level']})", flush=True)
    if records:
        print(table(records))
    print(f"ncu_prefill: wrote {len(records)} records to {args.out} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
