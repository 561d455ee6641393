"""experiments/ncu_prefill.py without a GPU: the parsing of ncu's raw CSV page (a sample written
by hand in the format of ``ncu --csv --page raw --print-units base``), the attribution of kernels
to shapes by the marker kernel, the retries, and the paths that must exit 0 with a message (no
GPU, no ncu, counters not readable)."""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import common  # noqa: E402
import ncu_prefill  # noqa: E402

COLS = ["dram__bytes_read.sum", "gpu__time_duration.sum", "launch__block_size", "launch__grid_size",
        "launch__registers_per_thread",
        "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",
        "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__throughput.avg.pct_of_peak_sustained_elapsed",
        "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",
        "smsp__inst_executed.sum", "smsp__issue_active.avg.pct_of_peak_sustained_active",
        "sass__inst_executed_per_opcode"]
UNITS = ["byte", "nsecond", "", "", "register/thread", "%", "%", "%", "%", "ratio", "ratio", "ratio",
         "ratio", "inst", "%", ""]
FIXED = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
         "Block Size", "Grid Size", "Device", "CC", "device__attribute_display_name"]
TMA = ("void cf::flash_fwd_tma_entry<cf::FlashFwdHopper<__nv_bfloat16, 64, 128, 128, false, 2>, "
       "__nv_bfloat16>(cf::FwdParams, const __grid_constant__ CUtensorMap)")


def _row(i, name, block, grid, vals):
    fields = [str(i), "4242", "python3.12", "127.0.0.1", name, "1", "7", block, grid, "0", "9.0",
              "NVIDIA H200"] + vals
    return ",".join(f'"{f}"' for f in fields)


def _marker(i, idx):
    return _row(i, ncu_prefill.MARKER, "(32, 1, 1)", f"({idx + 1}, 1, 1)",
                ["0", "2,080", "32", str(idx + 1), "4", "0", "0", "0", "0.01", "0", "1", "0.5",
                 "0", "12", "0.1", "(!) n/a"])


# what the console shows: the target's own lines, ncu's ==PROF== lines, then the raw page
SAMPLE = "\n".join([
    "==PROF== Connected to process 4242 (/usr/bin/python3.12)",
    '==PROF== Profiling "cupyflash_ncu_marker": 0%....50%....100% - 14 passes',
    '==PROF== Profiling "flash_fwd_tma_entry": 0%....50%....100% - 14 passes',
    "NCU_PREFILL shape 0 ok",
    "NCU_PREFILL shape 1 error RuntimeError: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access",
    '==PROF== Profiling "cupyflash_ncu_marker": 0%....50%....100% - 14 passes',
    "NCU_PREFILL shape 2 ok",
    "==PROF== Disconnected from process 4242",
    ",".join(f'"{c}"' for c in FIXED + COLS),
    ",".join(['""'] * len(FIXED) + [f'"{u}"' for u in UNITS]),
    _marker(0, 0),
    _row(1, "void cupy_fill<int>(int *, int)", "(128, 1, 1)", "(1, 1, 1)",
         ["0", "1,500", "128", "1", "16", "0", "0", "0", "0.2", "0", "1", "0.1", "0", "40", "0.1", ""]),
    _row(2, TMA, "(384, 1, 1)", "(132, 1, 1)",
         ["201,326,592", "3,421,504", "384", "132", "168", "41.5", "36.2", "52.3", "46.1", "0.41",
          "1", "1.93", "0.72", "1,476,000,000", "55.2", ""]),
    _marker(3, 1),
    _marker(4, 2),
    _row(5, TMA.replace("false", "true"), "(384, 1, 1)", "(132, 1, 1)",
         ["150,000,000", "2,000,000", "384", "132", "168", "40", "30", "50", "45", "0.5", "1",
          "1.5", "0.9", "1,000,000,000", "50", ""]),
]) + "\n"


def _args(**kw):
    return argparse.Namespace(
        batch=2, seqlen=8192, hidden=2048, dtype="bfloat16", timeout=60.0, **kw)


def test_parse_raw_csv_reads_units_separators_and_text():
    ks = ncu_prefill.parse_raw_csv(SAMPLE)
    assert [k["id"] for k in ks] == [0, 1, 2, 3, 4, 5]
    k = ks[2]
    assert k["name"] == TMA and k["grid"] == [132, 1, 1] and k["block"] == [384, 1, 1]
    assert k["metrics"]["gpu__time_duration.sum"] == (3421504.0, "nsecond")
    assert k["metrics"]["dram__bytes_read.sum"] == (201326592.0, "byte")
    assert k["metrics"]["sass__inst_executed_per_opcode"] == ("", "")
    assert ks[0]["metrics"]["sass__inst_executed_per_opcode"][0] == "(!) n/a"
    with pytest.raises(ValueError, match="no ncu CSV header"):
        ncu_prefill.parse_raw_csv("==ERROR== Failed to find metric regex:sm__pipe_tensor\n")


def test_summary_of_a_kernel():
    k = ncu_prefill.summarize_kernel(ncu_prefill.parse_raw_csv(SAMPLE)[2], keep_raw=True)
    assert k["duration_ms"] == pytest.approx(3.421504)
    assert k["sm_throughput_pct"] == 46.1 and k["xu_pct"] == 36.2 and k["issue_active_pct"] == 55.2
    # no GMMA-cycles column in the sample: the tensor pipe's cycles come next
    assert k["tensor_pct"] == 52.3
    assert k["tensor_metric"] == "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"
    assert k["warp_inst_executed"] == 1476000000 and k["registers"] == 168
    assert k["grid"] == [132, 1, 1] and k["block"] == [384, 1, 1]
    assert k["dram_read_bytes"] == 201326592
    assert list(k["stalls"]) == ["wait", "selected", "math_pipe_throttle", "barrier"]
    assert k["stalls_top"] == [["wait", 1.93], ["math_pipe_throttle", 0.72], ["barrier", 0.41]]
    assert k["pipes"] == {"cycles_tensor": 52.3, "inst_tensor_op_gmma": 41.5, "inst_xu": 36.2}
    assert k["raw"]["gpu__time_duration.sum"] == [3421504.0, "nsecond"]
    assert not any(n.startswith("device__attribute") for n in k["raw"])
    json.dumps(k)


def test_tensor_pipe_is_the_busiest_tensor_counter():
    pct = "avg.pct_of_peak_sustained_active"

    def k(**vals):
        return {"name": "k", "grid": None, "block": None,
                "metrics": {f"sm__{n}.{pct}": (v, "%") for n, v in vals.items()}}
    s = ncu_prefill.summarize_kernel(k(pipe_tensor_cycles_active=0.0,
                                       pipe_tensor_op_gmma_cycles_active=81.5,
                                       inst_executed_pipe_tensor_op_gmma=40.0))
    assert (s["tensor_pct"], s["tensor_metric"]) == (81.5, f"sm__pipe_tensor_op_gmma_cycles_active.{pct}")
    s = ncu_prefill.summarize_kernel(k(inst_executed_pipe_tensor_op_gmma=40.0,
                                       inst_executed_pipe_tensor_op_hmma=0.0))
    assert s["tensor_metric"] == f"sm__inst_executed_pipe_tensor_op_gmma.{pct}"
    s = ncu_prefill.summarize_kernel(k())
    assert s["tensor_pct"] is None and s["stalls_top"] == [] and s["grid"] is None


def test_kernels_split_by_marker_and_driver_messages():
    ks = ncu_prefill.parse_raw_csv(SAMPLE)
    g = ncu_prefill.split_by_marker(ks, 3)
    assert [k["id"] for k in g[0]] == [1, 2] and g[1] == [] and [k["id"] for k in g[2]] == [5]
    m = ncu_prefill.driver_messages(SAMPLE)
    assert m[0] == "ok" and m[2] == "ok" and m[1].startswith("RuntimeError: CUDA_ERROR_ILLEGAL")


def test_records_and_table():
    args = _args()
    shapes = [ncu_prefill.shape_of(64, False, args), ncu_prefill.shape_of(64, True, args),
              ncu_prefill.shape_of(128, False, args)]
    assert ncu_prefill.parse_shapes(ncu_prefill.format_shapes(shapes), args) == shapes
    assert shapes[2]["nheads"] == 16 and shapes[0]["nheads"] == 32
    groups = ncu_prefill.split_by_marker(ncu_prefill.parse_raw_csv(SAMPLE), 3)
    msgs = ncu_prefill.driver_messages(SAMPLE)
    info = {"level": 0, "ncu_seconds": 12.0, "ncu_rc": 0, "metrics_requested": ["x"], "sections": []}
    recs = [ncu_prefill.build_record("fa3", s, groups[i], msgs.get(i), info, "ncu", "v", True)
            for i, s in enumerate(shapes)]
    r = recs[0]
    assert r["what"] == "ncu_prefill" and r["impl"] == "fa3" and r["headdim"] == 64
    assert r["main_kernel"] == 1 and "raw" in r["kernels"][1] and "raw" not in r["kernels"][0]
    assert r["duration_ms"] == pytest.approx(3.421504 + 0.0015)
    assert r["tflops_ncu"] == pytest.approx(r["flops"] / (r["duration_ms"] * 1e-3) / 1e12)
    assert recs[1]["error"].startswith("RuntimeError") and "kernels" not in recs[1]
    json.loads(json.dumps(recs, default=common.jsonable))
    cf = dict(recs[0], impl="cupyflash", duration_ms=2 * recs[0]["duration_ms"])
    out = ncu_prefill.table(recs + [cf])
    assert "fa3" in out and "wait 1.93" in out and "error: RuntimeError" in out
    assert "hd64 not causal: cupyflash / FA3 time x2.00" in out


def test_no_gpu_path_exits_zero(tmp_path):
    out = tmp_path / "n.jsonl"
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "ncu_prefill.py"), "--quick",
                        "--out", str(out)], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    assert "no CUDA GPU" in r.stdout and not out.exists()


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(common, "have_gpu", lambda: True)
    monkeypatch.setattr(common, "impl_available", lambda impl: (True, ""))
    monkeypatch.setattr(common, "find_ncu", lambda: sys.executable)
    monkeypatch.setattr(ncu_prefill, "explain_for", lambda s: {"kernel": {"name": "fake"}})


def test_no_ncu_exits_zero(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(common, "have_gpu", lambda: True)
    monkeypatch.setattr(common, "find_ncu", lambda: None)
    assert ncu_prefill.main(["--quick", "--out", str(tmp_path / "n.jsonl")]) == 0
    assert "ncu) not found" in capsys.readouterr().out
    assert not (tmp_path / "n.jsonl").exists()


def test_unreadable_counters_exit_zero(fake_gpu, monkeypatch, tmp_path, capsys):
    calls = []

    def fake_run(cmd, timeout):
        calls.append(cmd)
        return ("==PROF== Connected to process 1\n==ERROR== ERR_NVGPUCTRPERM - The user does not "
                "have permission to access NVIDIA GPU Performance Counters on the target device 0.",
                1.0, 1)
    monkeypatch.setattr(common, "run_profiled", fake_run)
    assert ncu_prefill.main(["--quick", "--out", str(tmp_path / "n.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "not readable" in out and len(calls) == 1
    assert not (tmp_path / "n.jsonl").exists()


def test_refused_metrics_are_dropped_and_records_written(fake_gpu, monkeypatch, tmp_path, capsys):
    calls = []

    def fake_run(cmd, timeout):
        calls.append(cmd)
        metrics = cmd[cmd.index("--metrics") + 1]
        if "regex:" in metrics:
            return "==ERROR== Failed to find metric regex:sm__pipe_tensor.*\n", 2.0, 1
        assert "--section" in cmd and "--page" in cmd and "--profile-from-start" in cmd
        shapes = cmd[cmd.index("--shapes") + 1]
        assert shapes == "64:0,128:0"
        return SAMPLE.replace("NCU_PREFILL shape 1 error", "NCU_PREFILL shape 1 xx"), 30.0, 0
    monkeypatch.setattr(common, "run_profiled", fake_run)
    out = tmp_path / "n.jsonl"
    assert ncu_prefill.main(["--quick", "--impls", "cupyflash", "--out", str(out)]) == 0
    assert len(calls) == 2
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["what"] == "run" and lines[0]["provenance"]["commit"] == \
        common.provenance()["commit"]  # the run's header, then its records
    assert all(r["run"] == lines[0]["run"] and "provenance" not in r for r in lines[1:])
    recs = common.read_results(out)
    assert [(r["impl"], r["headdim"], r["causal"]) for r in recs] == [("cupyflash", 64, False),
                                                                     ("cupyflash", 128, False)]
    assert recs[0]["level"] == 1 and not any("regex" in m for m in recs[0]["metrics_requested"])
    assert recs[0]["plan_kernel"] == "fake" and "explain" not in recs[0]
    assert recs[1]["error"] == "no kernel profiled for this shape"
    assert recs[0]["provenance"]["commit"] == recs[0]["commit"]
    text = capsys.readouterr().out
    assert "cupyflash:" in text and "1/2 shapes profiled" in text and "top stalls" in text


def test_backward_mode_profiles_the_backward_impls_into_their_own_file(fake_gpu, monkeypatch,
                                                                       tmp_path, capsys):
    calls = []

    def fake_run(cmd, timeout):
        calls.append(cmd)
        assert cmd[-1] == "--backward"  # the driver profiles out.backward(dout)
        return SAMPLE, 30.0, 0
    monkeypatch.setattr(common, "run_profiled", fake_run)
    monkeypatch.setattr(ncu_prefill, "RESULTS", tmp_path)
    assert ncu_prefill.main(["--backward", "--quick", "--batch", "16", "--seqlen", "1024"]) == 0
    drivers = [c[c.index("--driver") + 1] for c in calls]
    assert drivers == list(ncu_prefill.BWD_IMPLS)
    recs = common.read_results(tmp_path / "ncu_backward.jsonl")
    assert not (tmp_path / "ncu_prefill.jsonl").exists()
    r = next(r for r in recs if r["impl"] == "cupyflash_det" and r["headdim"] == 64)
    fwd = __import__("cupyflash.io_model", fromlist=["x"]).prefill_flops(16, 32, 1024, 1024, 64,
                                                                         False)
    assert r["what"] == "ncu_backward" and r["flops"] == pytest.approx(2.5 * fwd)
    assert r["batch"] == 16 and "plan_kernel" not in r
    text = capsys.readouterr().out
    assert "cupyflash_det / cupyflash time x1.00" in text
    assert "cupyflash / cuDNN time x1.00" in text


def test_timeout_keeps_what_was_printed(fake_gpu, monkeypatch, tmp_path):
    def fake_run(cmd, timeout):
        e = TimeoutError("ncu run exceeded 60 s")
        e.output = SAMPLE
        raise e
    monkeypatch.setattr(common, "run_profiled", fake_run)
    out = tmp_path / "n.jsonl"
    assert ncu_prefill.main(["--quick", "--impls", "fa3", "--out", str(out)]) == 0
    recs = common.read_results(out)
    assert recs[0]["ncu_rc"] == 124 and "kernels" in recs[0]


def test_run_profiled_timeout_carries_the_output():
    with pytest.raises(TimeoutError) as e:
        common.run_profiled([sys.executable, "-c", "import time; print('started', flush=True); "
                             "time.sleep(30)"], timeout=2)
    assert "started" in e.value.output


def test_ncu_failure_messages():
    assert "not readable" in common.ncu_failure("==ERROR== ERR_NVGPUCTRPERM - The user does not")
    why = common.ncu_failure("==ERROR== Failed to initialize the profiler: LibraryNotLoaded\n")
    assert "LibraryNotLoaded" in why
    assert common.ncu_failure(SAMPLE) is None and common.ncu_failure("") is None


# ----------------------------------------------------------------------------------------------
# bench_overhead: the host reference (how fast the machine's Python is, per run)
# ----------------------------------------------------------------------------------------------
def test_bench_overhead_python_reference_and_its_table_row():
    import bench_overhead
    hit, misaligned = bench_overhead._python_ref()
    assert hit == 1 and misaligned == 0  # the key is in the table; the pointers are aligned
    us = bench_overhead.eager_us(bench_overhead._python_ref, 200, 2, lambda: None)
    assert len(us) == 2 and all(0 < x < 1000 for x in us)
    rec = {"op": "host", "impl": "reference", "caller": "python", "variant": "warm_path_like",
           "batch": 0, "seqlen_k": 0, "us_per_call": 0.8125}
    row = bench_overhead.table([rec]).splitlines()[1]
    assert row.split()[:5] == ["host", "b0", "x", "0", "reference"] and row.endswith("0.812")
    row = bench_overhead.table([dict(rec, op="decode", batch=1, seqlen_k=4096, impl="cupyflash",
                                     caller="torch", variant="defaults", us_per_call=17.94,
                                     host_us=12.345)]).splitlines()[1]
    assert row.split() == ["decode", "b1", "x", "4096", "cupyflash", "torch", "defaults", "261",
                           "17.9", "12.35"]


def test_bench_overhead_host_us_syncs_before_each_burst_only():
    import bench_overhead
    events = []
    us = bench_overhead.host_us(lambda: events.append("call"), 3, 2, lambda: events.append("sync"))
    # one warm-up call, then per burst a synchronisation and 3 calls, one synchronisation last
    assert events == ["call"] + (["sync"] + ["call"] * 3) * 2 + ["sync"]
    assert len(us) == 2 and all(x > 0 for x in us)
    events.clear()  # busy: the long kernel queued after each synchronisation, before the burst
    bench_overhead.host_us(lambda: events.append("call"), 2, 2, lambda: events.append("sync"),
                           lambda: events.append("sleep"))
    assert events == ["call"] + (["sync", "sleep"] + ["call"] * 2) * 2 + ["sync"]


def test_sim_schedule_twin_is_a_permutation_and_matches_the_kernels_constants():
    """experiments/sim_schedule.py's twin of TileScheduler hands out every (m-block, head)
    tile exactly once, in either causal order, and its constants are the kernel's."""
    import re

    import sim_schedule as sim
    for batch, nheads, seqlen, hd in ((1, 3, 1000, 64), (2, 8, 8192, 256), (5, 7, 777, 128),
                                      (16, 8, 1024, 256), (1, 1, 64, 128)):
        for causal, tail in ((False, None), (True, None), (True, True), (True, False)):
            for grid in (1, 7, 132):
                bm = sim.tile(batch, nheads, seqlen, hd, causal, grid)[0]
                n = -(-seqlen // bm) * batch * nheads
                order = sim.tile_order(batch, nheads, seqlen, hd, bm, causal, grid, tail=tail)
                assert sorted(order) == sorted((m, bh) for m in range(-(-seqlen // bm))
                                               for bh in range(batch * nheads))
                assert len(order) == n
    src = (ROOT / "kernels_cu" / "common" / "tile_scheduler.cuh").read_text()
    assert re.search(r"kL2Bytes = 8ll << 20;", src) and sim.L2_BYTES == 8 << 20
    m = re.search(r"kTailTilesPerCta = (\d+);", src)
    assert m and int(m.group(1)) == sim.TAIL_TILES_PER_CTA


def test_sim_schedule_tail_group_evens_out_hd256_causal():
    """The model behind v73: at hd256, S 8k (16k tokens, 16 heads, ~8 tiles per CTA) the last
    CTA finishes >= 10% after the ideal with one small last group, within 3% with the tail
    group, and the kernel's rule takes the tail group there but not at hd128 (15.5 per CTA)."""
    import sim_schedule as sim
    bm, bn = sim.tile(2, 8, 8192, 256, True, 132)
    assert (bm, bn) == (128, 80)
    spans = {t: sim.makespan(sim.tile_order(2, 8, 8192, 256, bm, True, 132, tail=t),
                             8192, bm, bn, True, 132) for t in (False, True, None)}
    assert spans[False] > 1.10 and spans[True] < 1.03 and spans[None] == spans[True]
    bm = sim.tile(2, 16, 8192, 128, True, 132)[0]
    assert sim.tile_order(2, 16, 8192, 128, bm, True, 132) == \
        sim.tile_order(2, 16, 8192, 128, bm, True, 132, tail=False)


def test_bench_prefill_rounds_interleave_and_keep_the_median_round(monkeypatch):
    """bench_prefill --rounds: round r times every impl once, in turn; each impl keeps the
    round with its median time (with every round's ms), and an impl that raises is recorded
    once and left out of the later rounds."""
    import bench_prefill
    calls = []
    times = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 6.0, 4.0])}

    def fake_benchmark(fn, **kw):
        name = fn()
        calls.append(name)
        if name == "c":
            raise RuntimeError("c fails")
        return {"ms": next(times[name]), "ms_min": 0.5, "n_repeat": kw["n_repeat"]}
    monkeypatch.setattr(bench_prefill.common, "benchmark", fake_benchmark)
    fns = {n: (lambda n=n: n) for n in ("a", "c", "b")}
    out = bench_prefill.time_interleaved(fns, 3, n_warmup=1, n_repeat=7)
    assert calls == ["a", "c", "b", "a", "b", "a", "b"]
    assert out["a"] == {"ms": 2.0, "ms_min": 0.5, "n_repeat": 7, "ms_rounds": [3.0, 1.0, 2.0],
                        "rounds": 3}
    assert out["b"]["ms"] == 5.0 and out["b"]["ms_rounds"] == [5.0, 6.0, 4.0]
    assert isinstance(out["c"], RuntimeError)
    # one round: the one timing, as before --rounds
    times["a"] = iter([9.0])
    assert bench_prefill.time_interleaved({"a": lambda: "a"}, 1, n_repeat=3)["a"]["ms"] == 9.0


def test_bench_power_parses_nvidia_smi_samples_and_throttle_reasons():
    """bench_power: one nvidia-smi CSV line -> (time, MHz, W, throttle mask, deg C); lines that
    are not samples (a header, an error) are dropped; the throttle mask's bits are named."""
    import datetime
    import bench_power
    line = "2026/12/02 04:41:07.250, 1650, 689.61, 0x0000000000000004, 47, 700.00, 00000000:19:00.0"
    when = datetime.datetime(2026, 12, 2, 4, 41, 7, 250000).timestamp()
    assert bench_power.parse_sample(line) == (when, 1650.0, 689.61, 4, 47.0, 700.0)
    assert bench_power.parse_sample(line, "0000:19:00.0") == (when, 1650.0, 689.61, 4, 47.0, 700.0)
    assert bench_power.parse_sample(line, "0000:1A:00.0") is None  # another GPU's line
    assert bench_power.parse_sample("timestamp, clocks.current.sm [MHz], power.draw [W]") is None
    assert bench_power.parse_sample(
        "2026/12/02 04:41:07.250, [N/A], 689.61, 0x4, 47, 700.00, 0:19:00.0") is None
    assert bench_power.throttle_names(0x4) == ["sw_power_cap"]
    assert bench_power.throttle_names(0x0) == []
    assert bench_power.throttle_names(0x1 | 0x40 | 0x400) == ["gpu_idle", "hw_thermal_slowdown",
                                                               "0x400"]


def test_bench_power_summarises_a_burst_and_its_window():
    import bench_power
    samples = [(10.0, 1980.0, 300.0, 0x0, 40.0, 700.0), (10.2, 1700.0, 690.0, 0x4, 45.0, 700.0),
               (10.4, 1650.0, 695.0, 0x4, 46.0, 700.0), (10.6, 1600.0, 700.0, 0x20, 47.0, 700.0)]
    sm = bench_power.Sampler.__new__(bench_power.Sampler)
    sm.samples, sm.proc, sm.gpu = samples, None, None
    win = sm.window(10.1, 10.6)
    assert win == samples[1:]
    rec = bench_power.summarise(win)
    assert rec == {"n_samples": 3, "sm_clock_mhz": 1650.0, "sm_clock_mhz_min": 1600.0,
                   "sm_clock_mhz_max": 1700.0, "power_w": 695.0, "temperature_c": 47.0,
                   "power_limit_w": 700.0, "throttle": ["sw_power_cap", "sw_thermal_slowdown"]}
    assert bench_power.summarise([])["sm_clock_mhz"] is None


def test_bench_power_runs_a_burst_for_its_seconds_and_syncs_per_chunk():
    import bench_power
    calls, syncs = [], []
    n, wall, t0, t1 = bench_power.sustained(lambda: calls.append(1), 0.05,
                                            lambda: syncs.append(len(calls)), chunk=4)
    assert n == len(calls) and n % 4 == 0 and n >= 4
    assert syncs[0] == 0 and syncs[1:] == list(range(4, n + 1, 4))
    assert wall >= 0.05 and t1 >= t0 + 0.05


def test_bench_power_no_gpu_and_bad_arguments(tmp_path):
    out = tmp_path / "p.jsonl"
    env = {**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_power.py"), "--quick",
                        "--out", str(out)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "no CUDA GPU" in r.stdout and not out.exists()
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_power.py"),
                        "--seconds", "0.2"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "--seconds: expected more than --settle" in r.stderr


def test_available_impls_keeps_the_order_and_says_why_it_skips(monkeypatch, capsys):
    monkeypatch.setattr(common, "impl_available",
                        lambda name: (False, "no wheel") if name == "fa3" else (True, ""))
    assert common.available_impls(["cupyflash", "fa3", "torch_cudnn"], "bench_x") == \
        ["cupyflash", "torch_cudnn"]
    assert capsys.readouterr().out == "bench_x: skipping fa3: no wheel\n"


def test_median_round_is_one_of_the_rounds():
    rounds = [{"ms": 3.0, "i": 0}, {"ms": 1.0, "i": 1}, {"ms": 2.0, "i": 2}, {"ms": 4.0, "i": 3}]
    assert common.median_round(rounds[:3]) == {"ms": 2.0, "i": 2}
    assert common.median_round(rounds) == {"ms": 2.0, "i": 2}  # even count: the lower middle
    assert common.median_round([{"t": 5, "ms": 9}], key="t") == {"t": 5, "ms": 9}


def test_bench_tiles_extra_tiles_stay_out_of_the_table():
    """bench_tiles --extra: its own mma.sync tiles (the rows that left the supported table on
    2026-12-02, never chosen by the dispatcher) are named and built as the table's rows are,
    are launchable (kernels.config_of / launch_config find them) only inside
    bench_tiles.launchable, and never enter SUPPORTED; a table row is refused as an extra."""
    import bench_tiles
    from cupyflash.core.checks import AttnProblem
    from cupyflash.forward import kernels as prefill
    table = set(prefill.SUPPORTED)
    names = {s.name for s in prefill.all_specs()}
    rows = bench_tiles.extra_rows("bfloat16")
    assert len(rows) == len(bench_tiles.EXTRA_TILES) and not table & set(rows)
    specs = bench_tiles.extra_specs("bfloat16")
    assert len(specs) == 2 * len(rows)
    p = AttnProblem(batch=2, seqlen_q=300, seqlen_k=300, nheads=4, nheads_k=4, headdim=64,
                    dtype="bfloat16", softmax_scale=0.125, causal=False, window_size=(-1, -1))
    for spec, f, row in specs:
        assert spec.name not in names and spec.source == prefill.TC_SOURCE and not spec.arch
        assert (f["family"], int(f["hd"]), int(f["m"]), int(f["n"]), int(f["w"])) == \
            ("fwd", row.headdim, row.block_m, row.block_n, row.nwarps)
        assert spec.smem_bytes == prefill.layout(row)[0] > 0
        with pytest.raises(ValueError, match="not a prefill specialisation"):
            prefill.config_of(spec)
    assert "fwd_bf16_hd128_m128_n64_w8_causal" in {s.name for s, _, _ in specs}
    with bench_tiles.launchable(rows):
        for spec, _, row in specs:
            cfg, causal = prefill.config_of(spec)
            assert cfg == row and spec.name.endswith("_causal") == causal
            assert prefill.launch_config(spec, p)[1] == (32 * row.nwarps, 1, 1)
        assert set(prefill.SUPPORTED) == table
    with pytest.raises(ValueError, match="not a prefill specialisation"):
        prefill.config_of(specs[0][0])
    with pytest.raises(ValueError, match="is a row of the table"):
        with bench_tiles.launchable([prefill.SUPPORTED[0]]):
            pass
    assert bench_tiles.extra_rows("float32") == [] and bench_tiles.extra_specs("float64") == []


# ----------------------------------------------------------------------------------------------
# bench_backward: the sweep, the FLOP count, the records, one shape end to end on the CPU (a
# stand-in cupyflash, timings faked), and its figure
# ----------------------------------------------------------------------------------------------
def test_bench_backward_arguments_and_shapes():
    import bench_backward as bb
    a = bb.parse_args(["--quick"])
    assert a.dtypes == ["bfloat16"] and a.seqlens == [1024, 4096] and a.n_repeat == 10
    assert a.headdims == [64, 128, 256] and a.causals == [False, True]
    assert a.deterministics == [False, True] and a.impls == list(bb.IMPLS) and a.rounds == 1
    assert a.out.name == "bench_backward.jsonl" and not a.flex_dynamic
    a = bb.parse_args(["--fp16", "--deterministic", "true", "--causal", "false"])
    assert a.dtypes == ["bfloat16", "float16"] and a.n_repeat == 20
    assert a.seqlens == [512, 1024, 2048, 4096, 8192, 16384, 32768]
    assert a.deterministics == [True] and a.causals == [False]
    assert bb.parse_args(["--dtypes", "float16", "--fp16"]).dtypes == ["float16"]
    shapes = bb.shape_list(bb.parse_args([]))
    assert len(shapes) == 3 * 7 * 2
    for s in shapes:  # 16k tokens per batch, hidden 2048
        assert s["batch"] == max(1, 16384 // s["seqlen"]) and s["nheads"] * s["headdim"] == 2048
    assert shapes[0] == {"dtype": "bfloat16", "headdim": 64, "batch": 32, "nheads": 32,
                         "seqlen": 512, "causal": False}
    assert shapes[-1] == {"dtype": "bfloat16", "headdim": 256, "batch": 1, "nheads": 8,
                          "seqlen": 32768, "causal": True}
    assert bb.configs(["cupyflash", "torch_cudnn", "cupyflash_kernel"], [False, True]) == [
        ("cupyflash", False), ("cupyflash", True), ("torch_cudnn", False),
        ("cupyflash_kernel", False), ("cupyflash_kernel", True)]
    for bad in (["--rounds", "0"], ["--headdims", "96"], ["--impls", "fa3"], ["--dtypes", "float32"]):
        with pytest.raises(SystemExit):
            bb.parse_args(bad)


def test_bench_backward_flops():
    import bench_backward as bb
    assert bb.fwd_flops(2, 16, 4096, 128, False) == 4 * 2 * 16 * 4096 ** 2 * 128
    assert bb.fwd_flops(2, 16, 4096, 128, True) == 2 * 2 * 16 * 4096 ** 2 * 128
    assert bb.bwd_flops(2, 16, 4096, 128, True) == 2.5 * bb.fwd_flops(2, 16, 4096, 128, True)
    # at 16k tokens per batch the work grows as S: twice the length, half the batch, twice the FLOPs
    assert bb.fwd_flops(8, 16, 2048, 128, False) * 2 == bb.fwd_flops(4, 16, 4096, 128, False)
    assert bb.ref_heads(32, 1024, 8.0) == 32 and bb.ref_heads(16, 32768, 8.0) == 1
    assert bb.ref_heads(16, 8192, 8.0) == 5  # 6 float32 S x S matrices per head in 8 GiB


def _timing(ms):
    return {"ms": ms, "ms_min": 0.9 * ms, "ms_p20": 0.95 * ms, "ms_p80": 1.05 * ms, "n_repeat": 20,
            "host_ms": 0.2}


def test_bench_backward_records_and_ratios():
    import bench_backward as bb
    shape = {"dtype": "bfloat16", "headdim": 128, "batch": 4, "nheads": 16, "seqlen": 4096,
             "causal": True}
    recs = []
    for impl, det, fwd, fb, bwd in (("cupyflash", False, 1.0, 4.0, None),
                                    ("cupyflash", True, 1.0, 5.0, None),
                                    ("cupyflash_kernel", False, 0.9, 3.8, 2.7),
                                    ("torch_cudnn", False, 0.8, 3.8, None),
                                    ("torch_flash", False, 1.2, 7.2, None)):
        r = bb.base_record(shape, impl, det)
        r.update(bb.timed_fields(r, _timing(fwd), _timing(fb), bwd and _timing(bwd)))
        recs.append(r)
    recs.append(dict(bb.base_record(shape, "flex", False), error="RuntimeError: no"))
    bb.add_ratios(recs)
    cf, det, kern, cudnn, fa2, flex = recs
    for r in recs:
        assert {"impl", "dtype", "headdim", "batch", "seqlen", "nheads", "causal",
                "deterministic"} <= set(r) and r["what"] == "backward"
    for r in recs[:5]:
        assert {"ms_fwd", "ms_fwd_bwd", "ms_bwd", "tflops_bwd"} <= set(r)
    assert cf["flops_fwd"] == 2 * 4 * 16 * 4096 ** 2 * 128 and cf["flops_bwd"] == 2.5 * cf["flops_fwd"]
    assert cf["ms_bwd"] == pytest.approx(3.0) and cf["bwd_timing"] == "difference"
    assert cf["tflops_bwd"] == pytest.approx(cf["flops_bwd"] / 3e-3 / 1e12)
    assert cf["tflops_fwd_bwd"] == pytest.approx(3.5 * cf["flops_fwd"] / 4e-3 / 1e12)
    assert cf["ms_fwd_bwd_p80"] == pytest.approx(4.2) and cf["n_repeat"] == 20
    assert kern["ms_bwd"] == 2.7 and kern["bwd_timing"] == "direct"
    assert kern["ms_bwd_diff"] == pytest.approx(2.9) and kern["ms_bwd_min"] == pytest.approx(2.43)
    # ratio = peer ms_bwd / cupyflash ms_bwd: cuDNN's backward 3.0 ms, FA2's 6.0 ms
    assert cf["ratio_vs_torch_cudnn"] == pytest.approx(1.0)
    assert cf["ratio_vs_torch_flash"] == pytest.approx(2.0)
    assert det["ratio_vs_torch_flash"] == pytest.approx(1.5) and det["deterministic"] is True
    assert cf["ratio_fwd_bwd_vs_torch_flash"] == pytest.approx(1.8)
    assert kern["ratio_vs_torch_cudnn"] == pytest.approx(3.0 / 2.7)
    assert not any(k.startswith("ratio") for r in (cudnn, fa2, flex) for k in r)
    assert "ratio_vs_flex" not in cf  # flex failed on this shape
    line = bb.summary_line(shape, recs)
    assert "cupyflash[det]=" in line and "cupyflash/torch_flash=x2.00" in line
    json.loads(json.dumps(recs, default=common.jsonable))


class _FakeCupyflash:
    """cupyflash's backward contract, computed by torch on the CPU (float32 inside)."""
    calls = []

    @staticmethod
    def flash_attn_func(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                        deterministic=False, return_lse=False):
        import math
        import torch
        _FakeCupyflash.calls.append(("fwd", deterministic, return_lse))
        qt, kt, vt = (x.transpose(1, 2).float() for x in (q, k, v))
        s = qt @ kt.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if causal:
            n = s.shape[-1]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = (torch.softmax(s, -1) @ vt).to(q.dtype).transpose(1, 2)
        return (out, torch.logsumexp(s, -1)) if return_lse else out

    @staticmethod
    def flash_attn_backward(dout, q, k, v, out, lse, *, softmax_scale=None, causal=False,
                            window_size=(-1, -1), deterministic=False):
        import torch
        _FakeCupyflash.calls.append(("bwd", deterministic))
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        o = _FakeCupyflash.flash_attn_func(*leaves, causal=causal)
        return torch.autograd.grad(o, leaves, dout)


def test_bench_backward_one_shape_end_to_end_on_the_cpu(monkeypatch):
    """run_shape on CPU tensors: every configuration set up, timed in interleaved rounds
    (common.benchmark faked), checked against the float32 math reference; a backend that
    cannot run (cuDNN on the CPU) is an error record and the others go on."""
    pytest.importorskip("torch")  # the inputs and the fake's math are CPU torch tensors
    import bench_backward as bb
    monkeypatch.setattr(bb, "_cupyflash", lambda: _FakeCupyflash)
    _FakeCupyflash.calls = []
    timed = []

    def fake_benchmark(fn, **kw):
        timed.append(fn)
        fn()
        return _timing(2.0 if fn.__name__ == "fwd_bwd" else 0.5)
    monkeypatch.setattr(common, "benchmark", fake_benchmark)
    args = bb.parse_args(["--quick", "--rounds", "2", "--impls", "cupyflash", "cupyflash_kernel",
                          "torch_cudnn", "torch_flash"])
    shape = {"dtype": "bfloat16", "headdim": 32, "batch": 2, "nheads": 3, "seqlen": 96,
             "causal": True}
    recs = bb.run_shape(shape, args, args.impls, device="cpu")
    assert [(r["impl"], r["deterministic"]) for r in recs] == [
        ("cupyflash", False), ("cupyflash", True), ("cupyflash_kernel", False),
        ("cupyflash_kernel", True), ("torch_cudnn", False), ("torch_flash", False)]
    cudnn = recs[4]
    assert cudnn["error"].startswith("RuntimeError: torch_cudnn: bshd_view:")
    assert "bhsd_contiguous" in cudnn["error"] and "ms_bwd" not in cudnn
    # 2 rounds x (3 autograd configs x 2 phases + 2 kernel configs x 3 phases)
    assert len(timed) == 2 * (3 * 2 + 2 * 3)
    for r in recs[:4] + recs[5:]:
        assert r["ms_fwd"] == 0.5 and r["ms_fwd_bwd"] == 2.0 and r["ms_fwd_rounds"] == [0.5, 0.5]
        assert r["ref"] == "torch_math_float32" and r["ref_heads"] == 3
        for g in ("out", "dq", "dk", "dv"):
            assert 0 < r[f"rel_err_{g}"] < 2e-2, (r["impl"], g, r[f"rel_err_{g}"])
        assert r["first_call_s"] >= 0 and r["inputs_bytes"] == 4 * 2 * 96 * 3 * 32 * 2
    assert recs[0]["ms_bwd"] == 1.5 and recs[2]["ms_bwd"] == 0.5
    assert recs[0]["ratio_vs_torch_flash"] == 1.0 and "ratio_vs_torch_cudnn" not in recs[0]
    assert recs[5]["torch_layout"] == "bshd_view"
    assert all(recs[i]["bitwise_repeatable"] is True for i in range(4))
    # cupyflash called as the contract says: deterministic reaches the backward
    assert ("fwd", True, False) in _FakeCupyflash.calls and ("bwd", True) in _FakeCupyflash.calls
    json.loads(json.dumps(recs, default=common.jsonable))


def test_bench_backward_skips_a_cupyflash_without_backward(monkeypatch):
    import types

    import bench_backward as bb
    monkeypatch.setattr(bb, "_cupyflash", lambda: types.SimpleNamespace(flash_attn_func=None))
    ok, why = bb.impl_available("cupyflash_kernel")
    assert not ok and "no backward pass" in why
    monkeypatch.setattr(bb, "_cupyflash", lambda: _FakeCupyflash)
    assert bb.impl_available("cupyflash") == (True, "")
    assert bb.impl_available("flex")[0] is False  # no CUDA here: torch sees no device


def test_bench_backward_no_gpu_exits_zero(tmp_path):
    out = tmp_path / "b.jsonl"
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_backward.py"), "--quick",
                        "--out", str(out)], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    assert "no CUDA GPU" in r.stdout and not out.exists()


def test_run_gpu_experiments_names_bench_backward_per_head_dim():
    """The runner's named-only entries: bench_backward and one per head dim, each with a time
    limit in both modes, its arguments accepted by the script."""
    import bench_backward as bb
    sh = ROOT / "experiments" / "run_gpu_experiments.sh"
    script = ("eval \"$(sed -n '/^declare -A QUICK/,/^ORDER=/p' " + str(sh) + " | grep -v '^ORDER')\"; "
              "for s in bench_backward bench_backward_hd64 bench_backward_hd128 bench_backward_hd256; do "
              "echo \"$s|${SCRIPT[$s]:-$s}|${ARGS[$s]:-}|${QUICK[$s]:-}|${FULL[$s]:-}\"; done")
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    rows = [line.split("|") for line in r.stdout.splitlines()]
    assert [row[0] for row in rows] == ["bench_backward", "bench_backward_hd64",
                                        "bench_backward_hd128", "bench_backward_hd256"]
    for name, target, extra, quick, full in rows:
        assert target == "bench_backward" and (ROOT / "experiments" / f"{target}.py").is_file()
        assert 0 < int(quick) <= 590 and 0 < int(full) <= 590
        a = bb.parse_args(extra.split())
        assert a.headdims == ([int(name[len("bench_backward_hd"):])] if "_hd" in name
                              else [64, 128, 256])


def _backward_results(d: Path) -> None:
    import bench_backward as bb
    recs = []
    for hd in (64, 128):
        for S in (1024, 4096, 16384):
            for causal in (False, True):
                shape = {"dtype": "bfloat16", "headdim": hd, "batch": max(1, 16384 // S),
                         "nheads": 2048 // hd, "seqlen": S, "causal": causal}
                for impl, det, tf in (("cupyflash", False, 300), ("cupyflash", True, 250),
                                      ("cupyflash_kernel", False, 310), ("torch_cudnn", False, 400),
                                      ("torch_flash", False, 330), ("flex", False, 280)):
                    r = bb.base_record(shape, impl, det)
                    ms_bwd = r["flops_bwd"] / (tf * 1e12) * 1e3
                    r.update(bb.timed_fields(r, _timing(ms_bwd / 2), _timing(1.5 * ms_bwd)))
                    recs.append(dict(r, gpu="NVIDIA H200", commit="0123456789abcdef"))
    recs.append(dict(bb.base_record(shape, "flex", False), error="RuntimeError: hd256"))
    recs.append({"what": "skipped", "impl": "flex", "reason": "no triton"})
    common.append_jsonl(d / "bench_backward.jsonl", recs)


def test_plot_backward_from_synthetic_results(tmp_path, monkeypatch):
    import plot
    res, figs = tmp_path / "results", tmp_path / "figures"
    res.mkdir()
    figs.mkdir()
    with pytest.raises(plot.SkipFigure, match="bench_backward.jsonl missing"):
        plot.backward(res, figs)
    assert plot.main(["--results", str(res), "--figures", str(figs), "--only", "backward"]) == 0
    assert not (figs / "backward.png").exists()
    _backward_results(res)
    seen = {}
    orig = plot._save

    def spy(fig, path, recs=None):
        seen[path.name] = [(ax.get_title(), [(ln.get_label(), ln.get_linestyle()) for ln in ax.get_lines()])
                           for ax in fig.axes]
        return orig(fig, path, recs)
    monkeypatch.setattr(plot, "_save", spy)
    assert plot.main(["--results", str(res), "--figures", str(figs), "--only", "backward"]) == 0
    p = figs / "backward.png"
    assert p.is_file() and p.stat().st_size > 5000 and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    axes = seen["backward.png"]
    assert [t.split(",")[1:3] for t, _ in axes] == [[" hd64", " not causal (H=32"], [" hd64", " causal (H=32"],
                                                    [" hd128", " not causal (H=16"], [" hd128", " causal (H=16"]]
    for _, lines in axes:
        labels = dict(lines)
        assert list(labels)[:3] == ["cupyflash", "cupyflash, deterministic",
                                    plot.IMPL_STYLE["cupyflash_kernel"]["label"]]
        assert labels["cupyflash"] == "-" and labels["cupyflash, deterministic"] == "--"
        assert {plot.IMPL_STYLE[i]["label"] for i in ("torch_cudnn", "torch_flash", "flex")} <= set(labels)
    with pytest.raises(plot.SkipFigure, match="no float16 records"):
        plot.backward(res, figs, dtype="float16")


# ------------------------------------------------------------------------------------------------
# experiments/train_llama.py: the model builder, the token stream, SDPA training steps on the CPU,
# the comparison, a backend that raises (as cupyflash does until it has a backward)
# ------------------------------------------------------------------------------------------------
TINY_ARGS = ["--device", "cpu", "--vocab", "128", "--hidden", "64", "--layers", "2", "--heads",
             "4", "--kv-heads", "2", "--head-dim", "16", "--intermediate", "128",
             "--max-positions", "128", "--batch", "4", "--seqlen", "64"]


def _train_llama():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import train_llama
    return train_llama


def _tiny_config(tl):
    return tl.llama_config(**{k: v for k, v in tl.TINY.items() if k in tl.MODEL})


def test_train_llama_config_model_and_stream_are_deterministic():
    tl = _train_llama()
    import numpy as np
    import torch
    cfg = tl.llama_config()  # the experiment's model (not built here)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.max_position_embeddings) == (
        512, 6, 8, 2, 64, 2048)
    assert cfg.attention_dropout == 0.0 and not cfg.use_cache
    tiny = _tiny_config(tl)
    a, b, c = tl.initial_state(tiny, 0), tl.initial_state(tiny, 0), tl.initial_state(tiny, 1)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(v.dtype == torch.float32 for v in a.values())
    assert any(not torch.equal(a[k], c[k]) for k in a)

    s, s2 = tl.MarkovStream(128, 64, 4, seed=0), tl.MarkovStream(128, 64, 4, seed=0)
    x = s.batch(3)
    assert x.shape == (4, 64) and x.dtype == np.int64 and 0 <= x.min() and x.max() < 128
    assert np.array_equal(x, s2.batch(3))
    assert not np.array_equal(x, s.batch(4))
    assert not np.array_equal(x, tl.MarkovStream(128, 64, 4, seed=1).batch(3))
    assert s.period == 32 and np.array_equal(x[:, 32:], x[:, :32])  # the walk, repeated
    for row in x:  # every transition of the walk is one of the chain's
        assert all(row[t + 1] in s.succ[row[t]] for t in range(31))
    h = s.entropy_rate()
    assert 1.0 < h < np.log(8)
    assert s.loss_floor() == pytest.approx(31 * h / 63)
    assert s.describe()["loss_floor"] == round(s.loss_floor(), 4)


def test_train_llama_sdpa_trains_on_the_cpu():
    tl = _train_llama()
    cfg = _tiny_config(tl)
    init = tl.initial_state(cfg, 0)
    stream = tl.MarkovStream(128, 64, 4, seed=0)
    rec = tl.train_run("sdpa", cfg, init, stream, 8, lr=1e-2, warmup=0, min_lr_ratio=1.0)
    assert "error" not in rec, rec.get("error")
    assert rec["steps_done"] == 8 and all(len(rec[k]) == 8
                                          for k in ("loss", "grad_norm", "lr", "step_ms"))
    loss = rec["loss"]
    assert all(map(lambda v: v == v and abs(v) < 1e3, loss + rec["grad_norm"]))
    assert abs(loss[0] - __import__("math").log(128)) < 0.2  # starts near ln(vocab)
    assert sum(loss[-3:]) / 3 < loss[0] - 0.1 and min(loss) < loss[0]  # and falls
    assert rec["tokens_per_s"] > 0 and rec["attn_implementation"] == "sdpa"
    # the same run again: the same losses (fixed weights, fixed batches)
    again = tl.train_run("sdpa", cfg, init, stream, 2, lr=1e-2, warmup=0, min_lr_ratio=1.0)
    assert again["loss"] == loss[:2]
    # fp32 weights under autocast: finite too
    ac = tl.train_run("sdpa", cfg, init, stream, 2, precision="autocast", lr=1e-2, warmup=0)
    assert "error" not in ac and ac["steps_done"] == 2
    assert abs(ac["loss"][0] - loss[0]) < 0.05


def test_train_llama_compare_criterion():
    tl = _train_llama()
    ref_loss = [8.0 * 0.99 ** i + 1 for i in range(40)]

    def rec(impl, loss, steps=40, **kw):
        return {"impl": impl, "loss": loss, "steps": steps, "steps_done": len(loss), **kw}
    ref = rec("sdpa", ref_loss)
    ok = tl.compare(rec("cupyflash", [x * 1.01 for x in ref_loss]), ref)
    assert ok["agree"] is True and ok["max_ma_rel_diff"] == pytest.approx(0.01)
    assert ok["max_abs_loss_diff"] == pytest.approx(0.09) and ok["max_abs_loss_diff_step"] == 0
    bad = tl.compare(rec("cupyflash", ref_loss[:30] + [x * 1.05 for x in ref_loss[30:]]), ref)
    assert bad["agree"] is False and bad["max_ma_rel_diff_step"] == 39
    cut = tl.compare(rec("cupyflash", ref_loss[:1], steps_done=0, error="RuntimeError: x"), ref)
    assert cut["agree"] is None and cut["error"] == "RuntimeError: x"
    assert cut["steps_compared"] == 1 and cut["first_loss_diff"] == 0
    assert tl.moving_average([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]
    comps = tl.comparisons([ref, rec("sdpa_alt", [x * 1.004 for x in ref_loss]),
                            rec("cupyflash", [x * 1.006 for x in ref_loss])], 10, 0.02)
    cf = next(c for c in comps if c["impl"] == "cupyflash")
    assert cf["noise_max_ma_rel_diff"] == pytest.approx(0.004) and cf["within_2x_noise"] is True
    assert tl.lr_at(0, 100, 1e-3, 10) == pytest.approx(1e-4)
    assert tl.lr_at(10, 100, 1e-3, 10) == pytest.approx(1e-3)
    assert tl.lr_at(99, 100, 1e-3, 10) == pytest.approx(1e-4)


def test_train_llama_records_a_backend_that_raises(tmp_path, monkeypatch):
    """A backend whose backward raises (cupyflash before it has one) is recorded with the
    message, the step and phase, and its forward's loss; the other runs go on and the records
    are written; the plot draws the run."""
    tl = _train_llama()
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class NoBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("no backward yet")

    def attention(module, q, k, v, mask, **kw):
        out, w = sdpa_attention_forward(module, q, k, v, mask, **kw)
        return NoBackward.apply(out), w
    AttentionInterface.register("nobwd_test", attention)
    orig = tl.attn_implementation
    monkeypatch.setattr(tl, "attn_implementation",
                        lambda run: "nobwd_test" if run == "cupyflash" else orig(run))
    out = tmp_path / "results" / "train_llama.jsonl"
    assert tl.main(TINY_ARGS + ["--steps", "12", "--lr", "1e-2", "--out", str(out)]) == 0
    import common
    recs = common.read_results(out)
    train = {r["impl"]: r for r in recs if r["what"] == "train"}
    assert list(train) == ["sdpa", "cupyflash", "sdpa_alt"]
    cf = train["cupyflash"]
    assert cf["error"] == "RuntimeError: no backward yet"
    assert (cf["failed_step"], cf["failed_phase"], cf["steps_done"]) == (0, "backward", 0)
    assert cf["loss"] == train["sdpa"]["loss"][:1]  # same forward
    assert train["sdpa"]["steps_done"] == 12 and train["sdpa_alt"]["steps_done"] == 12
    assert train["sdpa"]["model"]["params"] > 0 and train["sdpa"]["data"]["period"] == 32
    comps = {r["impl"]: r for r in recs if r["what"] == "compare"}
    assert comps["cupyflash"]["agree"] is None and "no backward" in comps["cupyflash"]["error"]
    assert comps["sdpa_alt"]["agree"] is True  # two SDPA backends: within the noise
    head = json.loads(out.read_text().splitlines()[0])
    assert head["provenance"]["machine"] == "cpu" and "gpu" not in head["provenance"]
    import plot
    paths = plot.train_llama(out.parent, tmp_path)
    assert paths[0].stat().st_size > 5000


def test_train_llama_without_a_gpu_trains_a_tiny_model_and_writes_nothing(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "t.jsonl"
    env = {**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "train_llama.py"), "--quick",
                        "--out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "no CUDA GPU" in r.stdout and "sdpa_alt vs sdpa" in r.stdout and not out.exists()


# ----------------------------------------------------------------------------------------------
# bench_hf_generate: the arguments, the prompt mix, the no-GPU exit, one tiny run on the CPU
# ----------------------------------------------------------------------------------------------
def test_bench_hf_generate_arguments():
    import bench_hf_generate as bg
    a = bg.parse_args(["--quick"])
    assert (a.prompt_max, a.new_tokens, a.layers, a.repeats) == (256, 32, 4, 2)
    assert a.prompt_lens == [256, 49, 192, 8, 128, 225, 69, 151] and a.batch == 8
    assert a.out.name == "bench_hf_generate.jsonl" and a.impls == list(bg.IMPLS)
    a = bg.parse_args(["--prompt-max", "100", "--batch", "10", "--impls", "sdpa"])
    assert (a.prompt_max, a.new_tokens, a.layers, a.repeats) == (100, 128, 16, 3)
    assert a.prompt_lens[8:] == [100, 19] and min(a.prompt_lens) == 3 and a.impls == ["sdpa"]
    assert bg.prompt_lengths(10, 4) == [10, 2, 8, 1]
    with pytest.raises(SystemExit):
        bg.parse_args(["--new-tokens", "1"])
    with pytest.raises(SystemExit):
        bg.parse_args(["--heads", "5"])
    with pytest.raises(SystemExit):
        bg.parse_args(["--impls", "eager"])
    assert bg.impl_available("sdpa") == (True, "")
    ok, why = bg.impl_available("flash_attention_2")
    assert (ok and why == "") or "flash_attn does not import" in why
    line = bg.summary_line({"impl": "cupyfa", "tokens_per_s": 1234.5, "ms_generate": 200.0,
                            "ms_prefill": 20.0, "ms_decode_step_est": 5.8})
    assert "1234.5 tok/s" in line and "decode step - ms (est 5.80)" in line
    assert "error: boom" in bg.summary_line({"impl": "sdpa", "error": "boom"})


def test_bench_hf_generate_no_gpu_exits_zero(tmp_path):
    out = tmp_path / "g.jsonl"
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_hf_generate.py"),
                        "--quick", "--out", str(out)], capture_output=True, text=True,
                       timeout=120, env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    assert "no CUDA GPU" in r.stdout and not out.exists()


def test_bench_hf_generate_runs_a_tiny_model_on_the_cpu():
    """run() end to end on the CPU with SDPA (a tiny Llama): every timing field, and the
    agreement with itself."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import bench_hf_generate as bg
    a = bg.parse_args(["--prompt-max", "12", "--batch", "3", "--new-tokens", "3", "--layers",
                       "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                       "--intermediate", "64", "--vocab", "64", "--repeats", "1",
                       "--decode-steps", "2", "--impls", "sdpa"])
    (rec,) = bg.run(a, a.impls, device="cpu")
    assert "error" not in rec, rec
    assert rec["what"] == "hf_generate" and rec["prompt_lens"] == [12, 2, 9]
    for key in ("ms_generate", "ms_prefill", "ms_decode_step", "ms_decode_step_est",
                "tokens_per_s"):
        assert rec[key] > 0, key
    assert rec["head_dim"] == 16 and "agree_with_sdpa" not in rec


def test_gpu_suite_keeps_the_hypothesis_replay_of_a_failure(tmp_path):
    import gpu_suite
    report = ("AssertionError: out error above its bound\n"
              "Falsifying example: test_prefill_exact_at_any_magnitude(\n    family='baseline',\n"
              "    data=data(...),\n)\nDraw 1: MagnitudeCase(...)\n"
              "You can reproduce this example by temporarily adding "
              "@reproduce_failure('6.168.3', b'AXicc2RwZHRkgEJGEBvKAQAqKgMQ') as a decorator")
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.gpu.t" name="a"><failure message="AssertionError: out">'
        f'{report}</failure></testcase>'
        '<testcase classname="tests.gpu.t" name="b"><failure message="plain">no hypothesis here'
        '</failure></testcase>'
        '<testcase classname="tests.gpu.t" name="c"/></testsuite></testsuites>')
    s = gpu_suite.junit_summary(xml)
    assert (s["tests"], s["failed"], s["passed"]) == (3, 2, 1)
    first, second = s["failures"]
    assert first["reproduce_failure"] == "@reproduce_failure('6.168.3', b'AXicc2RwZHRkgEJGEBvKAQAqKgMQ')"
    assert first["falsifying_example"].startswith("Falsifying example: test_prefill_exact")
    assert "family='baseline'" in first["falsifying_example"]
    assert "reproduce_failure" not in second and "falsifying_example" not in second


def test_bench_ab_backward_shapes_and_a_run_without_a_gpu(monkeypatch, tmp_path):
    import bench_ab
    shapes = bench_ab.shapes_of(["backward", "backward_det"], headdims=(64, 128))
    assert len(shapes) == 16 and {s[0] for s in shapes} == {"backward", "backward_det"}
    for op, dt, hd, b, sq, sk, h, hk, causal, ps in shapes:
        assert dt == "bfloat16" and hd in (64, 128) and b * sq == 16384 and h * hd == 2048
        assert sq == sk and h == hk and ps == 0
    assert not [s for s in bench_ab.shapes_of(["prefill", "decode"]) if "backward" in s[0]]
    # a run: the workers (one process per build and round) replaced by a fake that records its
    # arguments and writes a time per shape
    before = tmp_path / "before"
    (before / "cupyflash").mkdir(parents=True)
    calls = []

    def fake_run(cmd, env, check):
        calls.append((cmd, env["PYTHONPATH"]))
        path, got = cmd[cmd.index("--worker") + 1], json.loads(cmd[cmd.index("--worker") + 2])
        root = env["PYTHONPATH"]
        ms = 2.0 if root == str(before.resolve()) else 1.5
        res = {"cupyflash": str(Path(root) / "cupyflash")}  # (the worker writes its dirname)
        res.update({json.dumps(list(s)): ms for s in got})
        Path(path).write_text(json.dumps(res))
    monkeypatch.setattr(bench_ab.subprocess, "run", fake_run)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    out = tmp_path / "ab.jsonl"
    assert bench_ab.main(["--before", str(before), "--only", "backward", "--headdims", "128",
                          "--rounds", "2", "--before-commit", "abc1234", "--out", str(out)]) == 0
    assert len(calls) == 4 and {c[1] for c in calls} == {str(before.resolve()),
                                                          str(bench_ab.HERE.parent)}
    recs = [r for r in map(json.loads, out.read_text().splitlines()) if r["what"] == "bench_ab"]
    assert len(recs) == 8 and {r["op"] for r in recs} == {"backward", "backward_det"}
    assert all(r["headdim"] == 128 and r["ratio"] == 0.75 and r["commit_before"] == "abc1234"
               and r["ms_before"] == [2.0, 2.0] and r["variant"] is None for r in recs)
    # --variants: a third build in the same rounds (the order rotating), compared with --before
    variant = tmp_path / "v1"
    (variant / "cupyflash").mkdir(parents=True)
    calls.clear()
    out.unlink()
    assert bench_ab.main(["--before", str(before), "--variants", str(variant), "--only",
                          "backward", "--headdims", "128", "--rounds", "3", "--before-commit",
                          "abc1234", "--out", str(out)]) == 0
    roots = [c[1] for c in calls]
    assert len(roots) == 9 and roots[0] != roots[3] != roots[6] and \
        sorted(roots) == sorted(3 * [str(before.resolve()), str(bench_ab.HERE.parent),
                                     str(variant.resolve())])
    recs = [r for r in map(json.loads, out.read_text().splitlines()) if r["what"] == "bench_ab"]
    assert len(recs) == 16 and {r["variant"] for r in recs} == {None, "v1"}
    assert all(r["ratio"] == 0.75 and len(r["ms_after"]) == 3 for r in recs)
    with pytest.raises(SystemExit):  # the same directory twice
        bench_ab.main(["--before", str(before), "--variants", str(before), "--out", str(out)])
