"""Run the GPU test suite (+ optional sanitizer pass and quick benchmarks) in one go and record it.

Writes ``experiments/results/gpu_suite.json`` (commit, date, GPU, counts, failures) and, when
``$OUT`` is set (the device machine), copies every produced file there.

    PYTHONPATH=. python experiments/gpu_suite.py                 # GPU tests + quick benchmarks
    PYTHONPATH=. python experiments/gpu_suite.py --tests-only -k decode
    PYTHONPATH=. python experiments/gpu_suite.py --sanitize      # + compute-sanitizer memcheck/racecheck/synccheck
    PYTHONPATH=. python experiments/gpu_suite.py --tests-only --soak   # + the property tests, thorough
    PYTHONPATH=. python experiments/gpu_suite.py --workers 12  # tests in 12 processes (pytest-xdist)

Most of a fresh machine's test time is NVRTC compiling kernels, one CPU core each: ``--workers``
spreads the tests over processes (they share CuPy's on-disk kernel cache), and the three sanitizer
tools run side by side.

``--soak`` runs the GPU property tests (the Hypothesis ones: ``-m "gpu and hypothesis"``) again
under ``HYPOTHESIS_PROFILE=thorough`` (1000 examples each, tests/conftest.py) and records them
under ``soak``: the default profile draws too few examples to be the only evidence.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"


def sh(cmd: list[str], timeout: float, log: Path, env=None) -> int:
    """Run ``cmd`` with its output streamed into ``log``; return its exit code (124 on timeout).

    The command gets its own process group, killed as a whole on timeout: pytest-xdist's workers
    would otherwise outlive their parent and keep the output pipe (and this script) waiting."""
    print("+", " ".join(cmd), flush=True)
    t0 = time.time()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True, env=env,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = 124
    out = log.read_text(errors="replace")
    tail = "\n".join(out.splitlines()[-25:])
    print(tail, f"\n[rc={rc}, {time.time() - t0:.1f}s]", flush=True)
    return rc


def hypothesis_replay(text: str) -> dict:
    """What a failure's report needs to replay a Hypothesis example elsewhere: the
    ``@reproduce_failure`` decorator (the profiles set ``print_blob``) and the start of the
    falsifying example; empty when the report has neither."""
    out = {}
    blob = re.search(r"@reproduce_failure\([^)]*\)", text)
    if blob:
        out["reproduce_failure"] = blob.group(0)
    i = text.find("Falsifying example")
    if i >= 0:
        out["falsifying_example"] = text[i:i + 1500]
    return out


def junit_summary(xml_path: Path) -> dict:
    if not xml_path.exists():
        return {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [],
                "note": "no junit xml (pytest did not run or crashed)"}
    root = ET.parse(xml_path).getroot()
    failures, counts = [], dict(tests=0, failed=0, errors=0, skipped=0)
    for case in root.iter("testcase"):
        counts["tests"] += 1
        name = f"{case.get('classname')}::{case.get('name')}"
        for tag, key in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            el = case.find(tag)
            if el is not None:
                counts[key] += 1
                if key != "skipped":
                    failures.append({"test": name, "kind": key,
                                     "message": (el.get("message") or "")[:800],
                                     **hypothesis_replay(el.text or "")})
                break
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    return {**counts, "failures": failures}


def provenance() -> dict:
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        except Exception:
            return ""
    # The device machine gets a copy of the tree without .git: the caller passes the commit.
    commit = os.environ.get("CUPYFLASH_COMMIT") or git("rev-parse", "--verify", "-q", "HEAD") or "unknown"
    info = {"commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        import cupy
        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        info.update(gpu=props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
                    sms=props["multiProcessorCount"], cc=f"{props['major']}.{props['minor']}",
                    cupy=cupy.__version__, cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(),
                    cuda_driver=cupy.cuda.runtime.driverGetVersion())
    except Exception as e:  # no GPU: record why
        info["gpu"] = f"none ({type(e).__name__}: {e})"
    return info


def warm_kernel_cache() -> dict:
    """Compile every kernel the library can launch on this device into CuPy's on-disk cache
    (``jit.get_kernels``), so that the test processes started afterwards load them instead of
    each compiling the same kernels."""
    import cupy

    from cupyflash import baseline
    from cupyflash.backward import kernels as backward
    from cupyflash.core import jit
    from cupyflash.decode import kernels as decode
    from cupyflash.forward import kernels as forward
    specs = [*forward.all_specs(), *decode.all_specs(), *baseline.all_specs(),
             *(k.spec for k in backward.all_kernels())]
    cc = cupy.cuda.Device().compute_capability
    return jit.get_kernels(s for s in specs if not s.arch or s.arch.rstrip("a") == f"sm_{cc}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tests-only", action="store_true", help="skip the quick benchmarks")
    ap.add_argument("--bench-only", action="store_true", help="skip the tests")
    ap.add_argument("--sanitize", action="store_true", help="also run compute-sanitizer memcheck, racecheck, synccheck")
    ap.add_argument("--sanitize-timeout", type=int, default=130, help="seconds per sanitizer tool")
    ap.add_argument("--soak", action="store_true",
                    help="also run the GPU property tests under HYPOTHESIS_PROFILE=thorough")
    ap.add_argument("--soak-timeout", type=float, default=400, help="seconds for the soak")
    ap.add_argument("-k", default=None, help="pytest -k expression")
    ap.add_argument("--test-timeout", type=float, default=300)
    ap.add_argument("--workers", type=int, default=0,
                    help="pytest-xdist processes for the tests and the soak (0: one process)")
    ap.add_argument("--bench", nargs="*", default=["bench_prefill.py --quick", "bench_decode.py --quick"],
                    help="experiment scripts (with args) to run after the tests")
    args = ap.parse_args()
    xdist = []
    if args.workers > 0:
        try:
            import xdist as _  # noqa: F401
        except ImportError:
            ap.error("--workers needs pytest-xdist (pip install pytest-xdist)")
        xdist = ["-n", str(args.workers)]
    start = time.time()

    RESULTS.mkdir(parents=True, exist_ok=True)
    out_dir = RESULTS / "_logs"  # ignored by git; bundled into $OUT at the end
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.setdefault("HYPOTHESIS_PROFILE", "ci")
    if args.workers > 0:  # NumPy's BLAS threads per worker: N workers x all cores each thrash
        threads = str(max(1, (os.cpu_count() or 1) // args.workers))
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(var, threads)
        env.setdefault("CUPYFLASH_GPU_PRECOMPILE", "0")  # warm_kernel_cache compiled them once
    record = {"what": "gpu_suite", **provenance()}
    path = RESULTS / "gpu_suite.json"

    def save():  # after every stage: a run cut short still leaves its record (and in $OUT)
        path.write_text(json.dumps(record, indent=2) + "\n")
        if os.environ.get("OUT"):  # the device tool returns at most 8 files: a bundle + the record
            out = Path(os.environ["OUT"])
            with tarfile.open(out / "bundle.tar.gz", "w:gz") as tar:
                for p in RESULTS.rglob("*"):
                    if p.is_file() and p.stat().st_mtime > start - 5:
                        tar.add(p, arcname=str(p.relative_to(ROOT)))
            shutil.copy(path, out / path.name)

    if args.workers > 0:
        record["warm_kernel_cache"] = warm_kernel_cache()
        print("warm kernel cache:", record["warm_kernel_cache"], flush=True)

    sanitizing = None
    if args.sanitize:  # independent processes: the three tools side by side, beside the tests
        san = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
        tools = ("memcheck", "racecheck", "synccheck")

        def sanitize(tool):
            extra = ["--small"] if tool != "memcheck" else []
            return sh([san, "--tool", tool, "--error-exitcode", "99", sys.executable,
                       "experiments/sanitize_cases.py", *extra], args.sanitize_timeout,
                      out_dir / f"sanitize_{tool}.log", env)
        pool = ThreadPoolExecutor(len(tools))
        sanitizing = {tool: pool.submit(sanitize, tool) for tool in tools}

    if not args.bench_only:
        xml = out_dir / "gpu_junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests", "-p", "no:cacheprovider",
               f"--junitxml={xml}", "-rfE", *xdist]
        if args.k:
            cmd += ["-k", args.k]
        t0 = time.time()
        rc = sh(cmd, args.test_timeout, out_dir / "gpu_tests.log", env)
        record["tests"] = {"rc": rc, "seconds": round(time.time() - t0, 1), "selection": args.k,
                           "workers": args.workers,
                           **junit_summary(xml)}
        save()

    if args.soak:
        xml = out_dir / "soak_junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu and hypothesis", "tests",
               "-p", "no:cacheprovider", f"--junitxml={xml}", "-rfE", *xdist]
        if args.k:  # the same selection as the tests
            cmd += ["-k", args.k]
        t0 = time.time()
        rc = sh(cmd, args.soak_timeout, out_dir / "soak.log",
                dict(env, HYPOTHESIS_PROFILE="thorough"))
        record["soak"] = {"rc": rc, "seconds": round(time.time() - t0, 1),
                          "profile": "thorough", "workers": args.workers,
                          "selection": "-m 'gpu and hypothesis'" + (f" -k '{args.k}'" if args.k else ""),
                          **junit_summary(xml)}
        save()

    if sanitizing is not None:
        record["sanitizer"] = {}
        for tool, fut in sanitizing.items():
            rc = fut.result()
            text = (out_dir / f"sanitize_{tool}.log").read_text()
            summary = [l for l in text.splitlines() if "ERROR SUMMARY" in l or "RACECHECK SUMMARY" in l]
            record["sanitizer"][tool] = {"rc": rc, "summary": summary[-3:]}
        pool.shutdown()
        save()

    if not args.tests_only:
        record["bench"] = {}
        for spec in args.bench:
            parts = spec.split()
            log = out_dir / ("bench_" + Path(parts[0]).stem + ".log")
            rc = sh([sys.executable, f"experiments/{parts[0]}", *parts[1:]], 240, log, env)
            record["bench"][spec] = {"rc": rc}
            save()

    save()
    print(json.dumps({k: v for k, v in record.items() if k not in ("tests", "soak")},
                     indent=1)[:3000])
    for key, what in (("tests", "GPU tests"), ("soak", "GPU property soak (thorough)")):
        if key in record:
            t = record[key]
            print(f"{what}: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, "
                  f"{t['skipped']} skipped in {t['seconds']} s")
            for f in t["failures"][:30]:
                print("FAIL", f["test"], "|", f["message"][:300])
    return 0


if __name__ == "__main__":
    sys.exit(main())
