"""Sustained prefill: time per call, SM clock, board power and clock-throttle reasons while each
implementation runs back to back for a few seconds (issue 23: what limits the kernel).

``bench_prefill.py`` times 20 calls after a short warm-up, so the GPU runs at whatever clock its
recent history left it (up to the H200's 1980 MHz boost). A model's prefill runs for much longer.
Here every implementation of a shape runs back to back for ``--seconds`` (default 2 s) while
``nvidia-smi`` samples the SM clock, the board power and the active clock-throttle reasons every
20 ms; the implementations of a shape take turns in ``--rounds`` rounds, as in bench_prefill. The
record keeps the sustained time per call and TFLOP/s, the medians of the samples taken after the
first 0.3 s of the burst, and the throttle reasons seen (``sw_power_cap`` is the board at its power
limit: the driver lowers the clock until the power fits). ``cycles_per_call`` = time x median clock
compares two kernels per clock cycle when they run at different clocks.

    python experiments/bench_power.py --quick  # hd128 S 16k, ~20 s on an H200
    python experiments/bench_power.py          # hd 64/128/256, S 4k/16k, causal and not: ~4 min

Shapes follow bench_prefill: bf16, batch = 16k tokens / S, heads = 2048 / head dim. Appends a run
(experiments/common.py) to ``experiments/results/bench_power.jsonl``; without nvidia-smi the clock
fields are None.
"""
from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_prefill  # noqa: E402
import common  # noqa: E402
from common import RESULTS  # noqa: E402

# NVML's clock-throttle reason bits (nvidia-smi --help-query-gpu, clocks_throttle_reasons.*)
THROTTLE_BITS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap",
                 0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
                 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
                 0x100: "display_clock_setting"}
QUERY = ("timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active,temperature.gpu,"
         "power.limit,pci.bus_id")


def throttle_names(mask: int) -> list:
    """The names of the throttle reasons set in ``mask`` (unknown bits as hex)."""
    names = [name for bit, name in THROTTLE_BITS.items() if mask & bit]
    rest = mask & ~sum(THROTTLE_BITS)
    return names + ([hex(rest)] if rest else [])


def bus_id(pci: str) -> str:
    """A PCI bus id in one spelling: nvidia-smi writes an 8-digit domain (00000000:19:00.0), CUDA
    a 4-digit one (0000:19:00.0)."""
    domain, _, rest = pci.strip().partition(":")
    return f"{int(domain, 16):x}:{rest.lower()}"


def parse_sample(line: str, gpu: str | None = None):
    """One ``nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits`` line -> (unix time,
    SM MHz, watts, throttle mask, deg C, power limit in watts), or None when the line is not one,
    or is another GPU's than PCI bus id ``gpu``."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 7:
        return None
    try:
        if gpu is not None and bus_id(parts[6]) != bus_id(gpu):
            return None
        t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        return (t, float(parts[1]), float(parts[2]), int(parts[3], 16), float(parts[4]),
                float(parts[5]))
    except ValueError:
        return None


class Sampler:
    """``nvidia-smi`` in the background on GPU ``gpu`` (its PCI bus id), one sample every
    ``period_ms``; ``window(t0, t1)`` gives the samples stamped between two ``time.time()`` values
    (nvidia-smi stamps them in local time, as ``datetime.timestamp`` reads them); lines of
    other GPUs are dropped."""

    def __init__(self, gpu: str, period_ms: int = 20):
        self.samples, self.proc, self.gpu = [], None, gpu
        exe = shutil.which("nvidia-smi")
        if exe:
            self.proc = subprocess.Popen([exe, f"--query-gpu={QUERY}",
                                          "--format=csv,noheader,nounits", "-lms", str(period_ms)],
                                         stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            s = parse_sample(line, self.gpu)
            if s:
                self.samples.append(s)

    def window(self, t0: float, t1: float) -> list:
        return [s for s in list(self.samples) if t0 <= s[0] <= t1]

    def close(self):
        if self.proc:
            self.proc.kill()


def summarise(samples: list) -> dict:
    """Medians and extremes of a burst's samples (None fields when there are none); ``throttle``
    names every reason seen in any of them."""
    if not samples:
        return {"n_samples": 0, "sm_clock_mhz": None, "power_w": None, "throttle": None}
    clk = [s[1] for s in samples]
    mask = 0
    for s in samples:
        mask |= s[3]
    return {"n_samples": len(samples), "sm_clock_mhz": statistics.median(clk),
            "sm_clock_mhz_min": min(clk), "sm_clock_mhz_max": max(clk),
            "power_w": statistics.median(s[2] for s in samples),
            "temperature_c": max(s[4] for s in samples),
            "power_limit_w": statistics.median(s[5] for s in samples),
            "throttle": throttle_names(mask)}


def sustained(fn, seconds: float, sync, chunk: int = 10) -> tuple:
    """Run ``fn`` back to back (a device synchronisation every ``chunk`` calls) for ``seconds``;
    returns (calls, wall seconds, start time, end time)."""
    sync()
    t0 = time.time()
    n = 0
    while time.time() - t0 < seconds:
        for _ in range(chunk):
            fn()
        n += chunk
        sync()
    return n, time.time() - t0, t0, time.time()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="hd128 S 16k non-causal only")
    ap.add_argument("--impls", nargs="+", default=["cupyflash", "fa3", "torch_cudnn"],
                    choices=bench_prefill.IMPLS)
    ap.add_argument("--headdims", nargs="+", type=int, default=[64, 128, 256])
    ap.add_argument("--seqlens", nargs="+", type=int, default=[4096, 16384])
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--seconds", type=float, default=2.0, help="length of each burst")
    ap.add_argument("--settle", type=float, default=0.3,
                    help="seconds at the start of a burst left out of the clock / power medians")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_power.jsonl")
    args = ap.parse_args(argv)
    if args.seconds <= args.settle:
        ap.error(f"--seconds: expected more than --settle ({args.settle}), got {args.seconds}")
    if args.rounds < 1:
        ap.error(f"--rounds: expected an int >= 1, got {args.rounds}")
    if args.quick:
        args.headdims, args.seqlens, args.causal = [128], [16384], "no"
    if not common.have_gpu():
        print("bench_power: no CUDA GPU here; nothing to measure")
        return 0
    import cupy

    from cupyflash import io_model
    impls = common.available_impls(args.impls, "bench_power")
    sampler = Sampler(cupy.cuda.Device().pci_bus_id)
    if sampler.proc is None:
        print("bench_power: no nvidia-smi here; clock, power and throttle fields are None")
    sync = cupy.cuda.runtime.deviceSynchronize  # every stream: CuPy's and torch's
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    grid = [(d, s, c) for d in args.headdims for s in args.seqlens for c in causals]
    n_written = 0
    try:
        for d, S, causal in common.progress(grid, desc="power"):
            B, H = max(1, args.tokens // S), args.hidden // d
            common.free_memory()
            q, k, v = common.random_qkv(B, S, S, H, H, d, args.dtype, seed=S + d)
            flops = io_model.prefill_flops(B, H, S, S, d, causal)
            fns = {}
            for impl in impls:
                try:
                    fns[impl] = bench_prefill.make_fn(impl, q, k, v, causal)
                    fns[impl]()  # compile / first call outside the bursts
                except Exception as e:  # noqa: BLE001 - said; the others go on
                    print(f"bench_power: {impl} hd{d} S={S} causal={causal}: "
                          f"{type(e).__name__}: {e}")
            records = []
            for r in range(args.rounds):
                for impl, fn in fns.items():
                    n, wall, t0, t1 = sustained(fn, args.seconds, sync)
                    time.sleep(0.1)  # the sampler's last lines of the burst
                    ms = wall / n * 1e3
                    rec = {"what": "prefill_sustained", "impl": impl, "dtype": args.dtype,
                           "headdim": d, "batch": B, "nheads": H, "nheads_k": H, "seqlen": S,
                           "causal": causal, "flops": flops, "round": r, "calls": n,
                           "seconds": wall, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
                    rec.update(summarise(sampler.window(t0 + args.settle, t1)))
                    if rec["sm_clock_mhz"]:
                        rec["cycles_per_call"] = ms * 1e-3 * rec["sm_clock_mhz"] * 1e6
                    records.append(rec)
            n_written += common.append_results(args.out, records)
            for impl in fns:
                med = common.median_round([x for x in records if x["impl"] == impl])
                print(f"  hd{d} B={B} H={H} S={S} causal={causal} {impl}: {med['tflops']:.0f} "
                      f"TFLOP/s, {med['sm_clock_mhz']} MHz, {med['power_w']} W, {med['throttle']}",
                      flush=True)
            del q, k, v, fns
    finally:
        sampler.close()
    print(f"bench_power: wrote {n_written} records to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
